"""headwise inside transformers: ``attn_implementation="headwise"`` for the models that route through it.

    import headwise
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=headwise.hf.register())
    headwise.hf.check(model)  # every attention layer runs on headwise, or a TypeError says which does not
    # or both at once: model = headwise.hf.load(AutoModelForCausalLM, path)

- ``adapter``: ``register`` puts ``attend`` (transformers' arguments translated onto
  ``headwise.attention``) and ``mask`` (transformers' mask builder) into its two interfaces.
- ``routing``: which attention classes call transformers' ``AttentionInterface``, read from
  their source; an architecture none of whose layers does is refused by name.
- ``loading``: ``check`` a loaded model, or ``load`` one and check it.

Needs the ``hf`` extra (``pip install 'headwise[hf]'``): without transformers this package
imports, and ``register``, ``check`` and ``load`` raise an ImportError naming the extra.
"""

from __future__ import annotations

from .adapter import INERT, REFUSED, attend, mask, register
from .loading import check, load

__all__ = ["INERT", "REFUSED", "attend", "check", "load", "mask", "register"]
