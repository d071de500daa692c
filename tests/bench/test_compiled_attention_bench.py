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
    assert "| gpt2 | fp32 | 2 | 12 | compiled |" in bench.markdown(rows)


def test_eager_times_the_step_with_and_without_the_kernels_rule(monkeypatch, tmp_path):
    seen = []
    run = decode_kernel.run
    ruled = lambda: any(r.runner == plan.DECODE_KERNEL for r in plan.RULES)  # noqa: E731 - the table in force has the kernel's rule
    monkeypatch.setattr(decode_kernel, "run", lambda *args: seen.append(ruled()) or run(*args))
    rows = bench.compiled_attention(["gpt2"], ["fp32"], [1], context=12, repeats=2, warmup=0, tiny=True, root=tmp_path, eager=True)
    (row,) = rows
    assert row.summed_ms is None and row.kernel_ms > 0 and row.without_ms > 0 and not row.compiled
    assert row.logits_rel < 1e-5
    assert bool(seen) == decode_kernel.available() and all(seen)  # it ran, under the table that has its rule only
    line = bench.markdown(rows).splitlines()[-1]
    assert line.startswith("| gpt2 | fp32 | 1 | 12 | eager |") and "| — |" in line
