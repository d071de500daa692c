"""headwise.bench.compiled_attention: rows for each case, the three steps traced under their own table (no timing asserted)."""

import torch

from headwise.backends import decode_kernel, plan
from headwise.bench import compiled_attention as bench


def test_each_way_is_traced_under_its_own_table(monkeypatch, tmp_path):
    compile, seen = torch.compile, []

    def recording(gm, inputs):  # what each trace ran, then the graph as it is
        targets = [node.target for node in gm.graph.nodes]
        seen.append((torch.ops.headwise.decode_attention in targets, torch.nn.functional.scaled_dot_product_attention in targets))
        return gm.forward

    monkeypatch.setattr(torch, "compile", lambda *args, options=None, **kwargs: compile(*args, **{**kwargs, "backend": recording}))
    rules = plan.RULES
    rows = bench.compiled_attention(["gpt2"], ["fp32"], [2], context=12, repeats=2, warmup=0, tiny=True, root=tmp_path)
    assert plan.RULES is rules  # put back
    (row,) = rows
    assert (row.model, row.dtype, row.batch, row.context) == ("gpt2", "fp32", 2, 12)
    assert row.kernel_ms > 0 and row.summed_ms > 0 and row.without_ms > 0 and row.logits_rel < 1e-5
    assert seen == [(decode_kernel.available(), False), (False, False), (False, True)]  # the kernel, products summed, the fused kernel
    assert "| gpt2 | fp32 | 2 | 12 |" in bench.markdown(rows)
