"""The report as text and pictures: Markdown tables, a one-line-per-case summary, a plot."""

from __future__ import annotations

from dataclasses import fields

from .cases import DTYPES, MODES, Case, Report, Row, seconds
from .compile import markdown as compiled_table


def fastest_peer(report: Report, mode: str, case: Case) -> Row | None:
    """The peer with the lowest median time (or peak memory) in one case."""
    key = "peak_mib" if mode == "memory" else "median_s"
    peers = [r for r in report.rows if r.peer and r.mode == mode and r.case == case and getattr(r, key) is not None]
    return min(peers, key=lambda r: getattr(r, key), default=None)

_CEILING_PATH = {"onednn": "oneDNN inner product", "panels": "panels GEMM", "torch": "F.linear"}  # linear path -> its row in the ceilings


def linear_paths(report: Report) -> list[str]:
    """One line per dtype: headwise.linear's path, why, and its GEMM's share of the measured ceiling."""
    lines, run = [], {c.dtype for c in report.ceilings} | {r.case.dtype for r in report.rows}
    for dtype, name in DTYPES.items():
        if run and dtype not in run:
            continue
        info = report.linear.get(str(name).removeprefix("torch."))
        if not info:
            continue
        rate = next((c.gflops for c in report.ceilings if c.dtype == dtype and c.path == _CEILING_PATH.get(info["path"])), None)
        share = f"; its 2048³ GEMM: {rate:.0f} GFLOP/s, {100 * rate / report.ceiling(dtype):.0f}% of the ceiling" if rate else ""
        lines.append(f"Linear path {dtype}: {info['path']} ({info['reason']}{share})  ")
    return [*lines, ""] if lines else []


def markdown(report: Report) -> str:
    """The report as Markdown: ceilings, one table per mode, decode rows."""
    out = [f"Machine: {report.machine}", ""]
    if report.command:
        out += [f"Command: `{report.command}`", ""]
    gpu = any(r.case.device == "cuda" for r in report.rows)  # then rates in TFLOP/s
    rate, share, per = ("TFLOP/s", "% ceiling", 1e3) if gpu else ("GFLOP/s", "% ceiling", 1.0)
    out += [] if gpu else linear_paths(report)  # the projections' CPU path (a GPU takes F.linear)
    if report.ceilings:
        out += [f"| GEMM ceiling ({8192 if gpu else 2048}³) | path | {rate} | share of the ceiling |", "|---|---|---:|---:|"]
        out += [f"| {c.dtype} | {c.path} | {c.gflops / per:.0f} | {100 * c.gflops / report.ceiling(c.dtype):.0f}% |" for c in report.ceilings] + [""]
    for mode in MODES[:3]:
        rows = [r for r in report.rows if r.mode == mode]
        if not rows:
            continue
        if mode == "memory":
            out += ["| memory: case | implementation | peak MiB | vs fused reference |", "|---|---|---:|---:|"]
        else:
            out += [f"| {mode}: case | implementation | median s | IQR s | {rate} | {share} | vs fastest peer | load |",
                    "|---|---|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            c, label = r.case, r.case.label
            name = r.impl if r.peer else f"**{r.impl}**"
            if r.note:
                out.append(f"| {label} | {name} | {r.note} |" + " |" * (1 if mode == "memory" else 5))
            elif mode == "memory":
                ref = next((x for x in rows if x.case == c and x.impl.startswith("fused Linear") and x.peak_mib), None)
                ratio = f"{r.peak_mib / ref.peak_mib:.2f}x" if ref else ""
                out.append(f"| {label} | {name} | {r.peak_mib:.0f} | {ratio} |")
            else:
                best = fastest_peer(report, mode, c)
                ratio = f"{r.median_s / best.median_s:.2f}x" if best else ""
                pct = f"{r.pct_of_ceiling:.0f}%" if r.pct_of_ceiling is not None else ""
                out.append(f"| {label} | {name} | {seconds(r.median_s)} | {seconds(r.q1_s)}–{seconds(r.q3_s)} | {r.gflops / per:.{1 if gpu else 0}f} | {pct} | {ratio} | {r.load} |")
        out.append("")
    out += compiled_table(report.compiled)
    if report.decode:
        names = [f.name for f in fields(report.decode[0])]
        columns = [*names, "cache_speedup", "hf_speedup"]  # the last two: recompute / cached, transformers / headwise
        out += ["| decode: " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for d in report.decode:
            values = [*(getattr(d, n) for n in names), d.cache_speedup, d.hf_speedup]
            cells = [f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v)) for v in values]
            cells[-2:] = [f"{v:.2f}x" if v is not None else "" for v in values[-2:]]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def summary(report: Report) -> str:
    """One line per (mode, case): each headwise module against the fastest peer, as a ratio; "" when no case had a peer."""
    ours = [name for name in dict.fromkeys(r.impl for r in report.rows if not r.peer) if "(" not in name]  # default backends
    if not ours:  # nothing of headwise's to compare
        return ""
    out = ["| mode | case | fastest peer | its value | " + " | ".join(f"{n}" for n in ours) + " |",
           "|---|---|---|---:|" + "---:|" * len(ours)]
    for mode in MODES[:3]:
        key = "peak_mib" if mode == "memory" else "median_s"
        cases = list(dict.fromkeys(r.case for r in report.rows if r.mode == mode))
        for case in cases:
            best = fastest_peer(report, mode, case)
            if best is None:
                continue
            if mode == "memory":  # memory is compared with the fused reference, not the leanest peer
                best = next((r for r in report.rows if r.mode == mode and r.case == case and r.impl.startswith("fused Linear")
                             and r.peak_mib is not None), best)
            cells = []
            for name in ours:
                row = next((r for r in report.rows if r.mode == mode and r.case == case and r.impl == name), None)
                value = getattr(row, key) if row else None
                cells.append(f"{value / getattr(best, key):.2f}x" if value is not None else "")
            unit = f"{best.peak_mib:.0f} MiB" if mode == "memory" else f"{seconds(best.median_s)} s"
            out.append(f"| {mode} | {case.label} | {best.impl} | {unit} | " + " | ".join(cells) + " |")
    return "\n".join(out) if len(out) > 2 else ""


def plot(report: Report, path: str) -> bool:
    """One panel per timed mode (median seconds per implementation, lines over T or bars), and
    one for decode (milliseconds per step over the context). Returns False, writing nothing,
    when the report has nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES[:3] if any(r.mode == m and (r.median_s or r.peak_mib) for r in report.rows)]
    panels = len(modes) + bool(report.decode)
    if not panels:
        return False
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 5), squeeze=False)
    if report.decode:
        _decode_panel(axes[0][-1], report.decode)
    for ax, mode in zip(axes[0], modes, strict=False):
        rows = [r for r in report.rows if r.mode == mode and (r.median_s or r.peak_mib)]
        value = (lambda r: r.peak_mib) if mode == "memory" else (lambda r: r.median_s)
        unit = "peak MiB" if mode == "memory" else "median seconds"
        series: dict[str, list[Row]] = {}
        for r in rows:
            series.setdefault(f"{r.impl} [{r.case.preset} {r.case.dtype}]", []).append(r)
        if len({r.case.tokens for r in rows}) > 1:
            for label, rs in series.items():
                ax.plot([r.case.tokens for r in rs], [value(r) for r in rs], marker="o", lw=2.5 if not rs[0].peer else 1.2, label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens T")
        else:
            labels = list(series)
            ax.barh(labels, [value(series[k][0]) for k in labels], color=["C3" if not series[k][0].peer else "C0" for k in labels])
            ax.invert_yaxis()
        ax.set_title(f"{mode} (B={rows[0].case.batch})")
        ax.set_ylabel(unit) if len({r.case.tokens for r in rows}) > 1 else ax.set_xlabel(unit)
        if len({r.case.tokens for r in rows}) > 1:
            ax.legend(fontsize=7)
    fig.suptitle(report.machine, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _decode_panel(ax, rows: list) -> None:
    """Milliseconds per decode step against the context, one line per implementation measured."""
    stacks = list(dict.fromkeys((d.width, d.batch) for d in rows))  # one line per stack and batch (presets, B)
    for width, batch in stacks:
        group = [d for d in rows if (d.width, d.batch) == (width, batch)]
        which = f" C={width} B={batch}" if len(stacks) > 1 else ""
        for attr, label in (("cached_ms", "headwise cached"), ("uncached_ms", "headwise recompute"), ("hf_cached_ms", "transformers cached")):
            values = [getattr(d, attr) for d in group]
            if all(v is not None for v in values):
                ax.plot([d.context for d in group], values, marker="o", lw=2.5 if attr == "cached_ms" else 1.2, label=label + which)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per decode step")
    ax.set_yscale("log")
    ax.set_title(f"decode ({rows[0].threads} threads)")
    ax.legend(fontsize=7)
