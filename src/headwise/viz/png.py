"""The heads page as one static picture (matplotlib): the grid of every head and one head in detail."""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

from .._optional import require
from .maps import ROLE_COLOURS, HeadMaps

if TYPE_CHECKING:
    from matplotlib.figure import Figure


#: Roles in the order ``clearest_head`` prefers them: the positional ones say most about a model.
_PREFERRED = ("previous", "next", "self", "[CLS]/[SEP]", "mixed")


def clearest_head(maps: HeadMaps) -> tuple[int, int]:
    """``(layer, head)`` of the head with the largest share in the first role of
    previous / next / self / [CLS]/[SEP] / mixed that some head has."""
    ranked = sorted(
        (_PREFERRED.index(role), -share, layer, head)
        for layer in range(maps.layers)
        for head in range(maps.heads)
        for role, share in [maps.role(layer, head)]
    )
    _, _, layer, head = ranked[0]
    return layer, head


#: A text the user gave (the sentence, its tokens, the model's name) drawn as typed: not matplotlib's math between
#: dollar signs ("$5 or $6" lost its dollars, an unbalanced "$\\frac{" failed at savefig), nor LaTeX under usetex.
_AS_TYPED = {"parse_math": False, "usetex": False}


def heads_figure(maps: HeadMaps, *, head: tuple[int, int] | None = None) -> Figure:
    """Every head's (T, T) map in a layers x heads grid, framed in its role's colour, and one head large.

    Args:
        maps: from ``head_maps``.
        head: ``(layer, head)`` to draw large, with the tokens on both axes; None = ``clearest_head``.

    Returns:
        A matplotlib ``Figure`` (titled with the model and the sentence, with a legend of roles),
        made without pyplot: no global state, ``fig.savefig(path)`` writes it.
    """
    if not isinstance(maps, HeadMaps):
        raise TypeError(f"maps must be a HeadMaps (from headwise.viz.head_maps), got {type(maps).__name__}")
    require("matplotlib", "bench", "drawing the heads as a picture")
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    L, H = maps.layers, maps.heads
    if head is None:
        head = clearest_head(maps)
    else:
        ints = isinstance(head, tuple) and len(head) == 2 and all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in head)
        if not ints or not (0 <= head[0] < L and 0 <= head[1] < H):
            raise (ValueError if ints else TypeError)(
                f"head must be a (layer, head) tuple of ints with 0 <= layer < {L} and 0 <= head < {H}, got {head!r}")
        head = (int(head[0]), int(head[1]))  # (numpy ints too)
    cell = 0.62
    fig = Figure(figsize=(H * cell + 6.2, max(L * cell + 1.6, 6.0)), layout="constrained")
    left, right = fig.subfigures(1, 2, width_ratios=[H * cell, 6.0])
    axes = left.subplots(L, H, squeeze=False, gridspec_kw={"wspace": 0.05, "hspace": 0.05})
    w = maps.weights.numpy()  # (L, H, T, T)
    for i in range(L):
        for h in range(H):
            ax = axes[i][h]
            role, share = maps.role(i, h)
            ax.imshow(w[i, h], cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            for spine in ax.spines.values():
                spine.set_edgecolor(ROLE_COLOURS[role])
                spine.set_linewidth(2.5 if (i, h) != head else 4.0)
            ax.set_title(f"{share:.2f}", fontsize=6, pad=1.5)
            if h == 0:
                ax.set_ylabel(f"layer {i}", fontsize=8)
            if i == L - 1:
                ax.set_xlabel(f"head {h}", fontsize=8)
    left.suptitle("every head: rows = queries, columns = keys", fontsize=9)
    ax = right.subplots()
    i, h = head
    role, share = maps.role(i, h)
    image = ax.imshow(w[i, h], cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
    T = len(maps.tokens)
    ax.set_xticks(range(T), maps.tokens, rotation=90, fontsize=8, **_AS_TYPED)
    ax.set_yticks(range(T), maps.tokens, fontsize=8, **_AS_TYPED)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    for spine in ax.spines.values():
        spine.set_edgecolor(ROLE_COLOURS[role])
        spine.set_linewidth(3)
    ax.set_title(f"layer {i}, head {h}: {role}" + ("" if role == "mixed" else f" ({share:.2f})"), fontsize=10)
    right.colorbar(image, ax=ax, shrink=0.6, label="attention weight")
    counts = {name: sum(maps.role(i, j)[0] == name for i in range(L) for j in range(H)) for name in ROLE_COLOURS}
    fig.legend(
        handles=[Patch(facecolor="white", edgecolor=c, linewidth=2.5, label=f"{name} ({counts[name]})") for name, c in ROLE_COLOURS.items()],
        loc="outside lower center", ncols=len(ROLE_COLOURS), fontsize=8, title="role: the kind of key that gets at least half of the weight", title_fontsize=8,
    )
    kind = "causal" if maps.causal else "bidirectional"
    fig.suptitle(f"{maps.model} ({L} layers x {H} heads, {kind}): \u201c{maps.text}\u201d", fontsize=11, **_AS_TYPED)
    return fig
