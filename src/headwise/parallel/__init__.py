"""Heads across machines: tensor parallelism for headwise modules on ``torch.distributed``.

Heads are independent until the output projection, so multi-head attention splits across
ranks by heads (Megatron's column-parallel Q/K/V, row-parallel output projection).
``parallelize(module, device_mesh)`` applies that plan (``PLANS``) with PyTorch's own
``torch.distributed.tensor.parallel.parallelize_module`` to any headwise attention module
and to the models. See docs/use/parallel.md, and ``python -m torch.distributed.run
--nproc-per-node 2 -m headwise.parallel.demo`` for a runnable example.

Example (on each of 2 ranks, after ``torch.distributed.init_process_group("gloo")``):

    >>> from torch.distributed.device_mesh import init_device_mesh  # doctest: +SKIP
    >>> model = parallelize(GPT2LMHeadModel(config), init_device_mesh("cpu", (2,)))  # doctest: +SKIP
    >>> model.generate(input_ids, max_new_tokens=20)  # the same tokens on every rank  # doctest: +SKIP
"""

from .plan import PLANS
from .qkv import FusedQKVParallel, qkv_rows
from .shard import parallelize

__all__ = ["PLANS", "FusedQKVParallel", "parallelize", "qkv_rows"]
