"""Diagrams the lessons' prose describes: where communication sits, and what moves where.

Each function draws one picture with matplotlib and returns the figure (the lesson's cell calls
``plt.show()``); each takes the sizes it draws as arguments, so the same picture redraws for
another group size. Lesson 06: :func:`dcp_flow` (DCP's save planning and the load-time
intersection of pieces). Lesson 08: :func:`tensor_parallel_mlp` (Megatron's f and g) and
:func:`sequence_parallel_mlp` (the sequence-parallel transitions, after Korthikanti et al. 2022,
Fig. 5). Lesson 09: :func:`ring_rotation` (which K/V block each rank holds at each step) and
:func:`triangle_geometry` (the edges ij, ik, jk of AlphaFold's triangle updates). The small pure
functions beside them (:func:`ring_blocks`, :func:`piece_overlaps`) hold the arithmetic the
pictures show, so the tests can check it. Nothing here implements a lesson task.
"""

from __future__ import annotations

from typing import Any

__all__ = ["dcp_flow", "piece_overlaps", "ring_blocks", "ring_rotation", "sequence_parallel_mlp",
           "tensor_parallel_mlp", "triangle_geometry"]

_F, _G = "#f4a261", "#2a9d8f"  # f / all-gather side, g / reduce side
_RANKS = ["#a8dadc", "#ffd6a5", "#caffbf", "#bdb2ff", "#ffadad", "#fdffb6", "#9bf6ff", "#ffc6ff"]


def _plt():
    import matplotlib.pyplot as plt

    return plt


def _box(ax, x, y, w, h, text, color="white", fontsize=8, **kw) -> None:
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.05",
                                fc=color, ec="black", lw=0.8, **kw))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, start, end, color="black", **kw) -> None:
    ax.annotate("", xy=end, xytext=start,
                arrowprops=dict(arrowstyle="-|>", color=color, lw=0.9, shrinkA=0, shrinkB=0, **kw))


def _canvas(width: float, height: float, xlim: tuple[float, float], ylim: tuple[float, float]):
    fig, ax = _plt().subplots(figsize=(width, height))
    ax.set(xlim=xlim, ylim=ylim)
    ax.axis("off")
    return fig, ax


# --------------------------------------------------------------------------- Lesson 08


def _lanes(t: int) -> list[float]:
    """Vertical centres of t rank lanes, rank 0 on top."""
    return [(t - 1 - r) * 1.0 for r in range(t)]


def tensor_parallel_mlp(t: int = 2) -> Any:
    """Megatron's tensor-parallel MLP on t ranks: f, the column layer, GELU, the row layer, g."""
    lanes = _lanes(t)
    top, mid = lanes[0] + 0.9, (lanes[0] + lanes[-1]) / 2
    fig, ax = _canvas(9, 1.2 + 0.8 * t, (-0.3, 10.6), (lanes[-1] - 1.3, top + 0.2))
    _box(ax, 0, mid - 0.3, 1.1, 0.6, "X\n(b, s, h)\nevery rank")
    _box(ax, 1.6, lanes[-1] - 0.35, 0.6, lanes[0] - lanes[-1] + 0.7, "f", _F, fontsize=12)
    _box(ax, 7.8, lanes[-1] - 0.35, 0.6, lanes[0] - lanes[-1] + 0.7, "g", _G, fontsize=12)
    _arrow(ax, (1.1, mid), (1.6, mid))
    for r, y in enumerate(lanes):
        color = _RANKS[r % len(_RANKS)]
        ax.text(2.45, y + 0.38, f"rank {r}", fontsize=7, color="dimgray")
        _box(ax, 2.6, y - 0.25, 1.6, 0.5, f"X A$_{r}$  (b, s, 4h/t)", color)
        _box(ax, 4.5, y - 0.25, 0.9, 0.5, "GELU", color)
        _box(ax, 5.7, y - 0.25, 1.7, 0.5, f"· B$_{r}$: partial Y$_{r}$", color)
        for a, b in ((2.2, 2.6), (4.2, 4.5), (5.4, 5.7), (7.4, 7.8)):
            _arrow(ax, (a, y), (b, y))
    _box(ax, 8.9, mid - 0.3, 1.5, 0.6, "Y = Σ$_r$ Y$_r$\n(b, s, h)\nevery rank")
    _arrow(ax, (8.4, mid), (8.9, mid))
    low = lanes[-1] - 0.55
    ax.text(1.9, low, "f  forward: identity\n    backward: all-reduce dX", ha="center", va="top",
            fontsize=7.5, color="saddlebrown")
    ax.text(8.1, low, "g  forward: all-reduce\n    backward: identity", ha="center", va="top",
            fontsize=7.5, color="darkslategray")
    ax.text(5.0, top, f"column-parallel A, row-parallel B on t = {t} ranks: "
            "one all-reduce each way", ha="center", fontsize=9)
    return fig


def sequence_parallel_mlp(t: int = 2) -> Any:
    """The MLP block with sequence parallelism: LayerNorm and dropout on s/t tokens per rank,
    g (all-gather) before the column layer and ḡ (reduce-scatter) after the row layer."""
    lanes = _lanes(t)
    top, mid = lanes[0] + 1.0, (lanes[0] + lanes[-1]) / 2
    fig, ax = _canvas(10, 1.5 + 0.8 * t, (-0.2, 12.6), (lanes[-1] - 1.5, top + 0.25))
    span = lanes[0] - lanes[-1] + 0.7
    _box(ax, 2.3, lanes[-1] - 0.35, 0.6, span, "g", _F, fontsize=12)
    _box(ax, 8.9, lanes[-1] - 0.35, 0.6, span, "ḡ", _G, fontsize=12)
    for r, y in enumerate(lanes):
        color = _RANKS[r % len(_RANKS)]
        ax.text(0.0, y + 0.36, f"rank {r}: tokens {r}·s/t..{r + 1}·s/t", fontsize=6.5,
                color="dimgray")
        _box(ax, 0.0, y - 0.25, 1.9, 0.5, "LayerNorm\n(b, s/t, h)", color)
        _box(ax, 3.3, y - 0.25, 1.5, 0.5, f"X A$_{r}$ (b, s, 4h/t)", color)
        _box(ax, 5.1, y - 0.25, 0.8, 0.5, "GELU", color)
        _box(ax, 6.2, y - 0.25, 2.3, 0.5, f"· B$_{r}$: partial (b, s, h)", color)
        _box(ax, 9.9, y - 0.25, 2.5, 0.5, "+ bias, dropout,\nresidual (b, s/t, h)", color)
        for a, b in ((1.9, 2.3), (2.9, 3.3), (4.8, 5.1), (5.9, 6.2), (8.5, 8.9), (9.5, 9.9)):
            _arrow(ax, (a, y), (b, y))
    low = lanes[-1] - 0.55
    ax.text(2.6, low, "g  forward: all-gather (sequence)\n    backward: reduce-scatter",
            ha="center", va="top", fontsize=7.5, color="saddlebrown")
    ax.text(9.2, low, "ḡ  forward: reduce-scatter (sequence)\n    backward: all-gather",
            ha="center", va="top", fontsize=7.5, color="darkslategray")
    for x0, x1, label in ((0.0, 1.9, "sequence parallel"), (3.3, 8.5, "tensor parallel"),
                          (9.9, 12.4, "sequence parallel")):
        ax.plot([x0, x1], [top - 0.35] * 2, color="gray", lw=3, solid_capstyle="butt")
        ax.text((x0 + x1) / 2, top - 0.25, label, ha="center", fontsize=7.5, color="dimgray")
    ax.text(6.2, top + 0.05, f"the MLP block with sequence parallelism on t = {t} ranks "
            "(after Korthikanti et al. 2022, Fig. 5)", ha="center", fontsize=9)
    return fig


# --------------------------------------------------------------------------- Lesson 06


def piece_overlaps(saved: list[tuple[int, int]], loaded: list[tuple[int, int]]
                   ) -> list[tuple[int, int, int, int]]:
    """Every (loading rank, saved piece, start, stop) whose rows overlap; pieces are (offset,
    size)."""
    out = []
    for r, (lo, n) in enumerate(loaded):
        for p, (so, sn) in enumerate(saved):
            a, b = max(lo, so), min(lo + n, so + sn)
            if a < b:
                out.append((r, p, a, b))
    return out


def dcp_flow(saved: list[tuple[int, int]], loaded: list[tuple[int, int]], rows: int,
             name: str = "tensor") -> Any:
    """DCP's save (local plans, rank 0's global plan with replicated items deduplicated, every
    rank's file, ``.metadata`` last) and a load onto another world size: each loading rank's
    rows intersected with the saved pieces. ``saved``/``loaded`` are (first row, rows) per rank."""
    from matplotlib.patches import Rectangle

    plt = _plt()
    fig, (flow, rows_ax) = plt.subplots(2, 1, figsize=(10, 5.2), height_ratios=[1.25, 1])
    flow.set(xlim=(0, 12.4), ylim=(-0.2, 3.2))
    flow.axis("off")
    w = len(saved)
    steps = [("every rank:\nlocal plan\n(what I hold)", "white"),
             ("rank 0: global plan\ngathers the plans, keeps one\ncopy of replicated items,\nsends "
              "each rank its own", _F),
             ("every rank:\nwrites its pieces\n__{rank}_0.distcp", "white"),
             ("rank 0: writes\n.metadata last\n(piece → file, bytes)", _G)]
    for i, (text, color) in enumerate(steps):
        _box(flow, 0.2 + 3.1 * i, 1.9, 2.5, 1.0, text, color, fontsize=7.5)
        if i:
            _arrow(flow, (0.2 + 3.1 * i - 0.6, 2.4), (0.2 + 3.1 * i, 2.4))
    flow.text(0.0, 3.05, f"save on {w} ranks", fontsize=9, weight="bold")
    load = [("every rank:\nthe pieces its own\nlayout needs", "white"),
            (".metadata ∩ request:\nthe overlapping\nbyte ranges", _G),
            ("every rank reads\nonly those ranges\n(no saver layout needed)", "white")]
    for i, (text, color) in enumerate(load):
        _box(flow, 0.2 + 3.1 * i, 0.0, 2.5, 1.0, text, color, fontsize=7.5)
        if i:
            _arrow(flow, (0.2 + 3.1 * i - 0.6, 0.5), (0.2 + 3.1 * i, 0.5))
    _arrow(flow, (10.9, 1.9), (4.6, 1.0), color="tab:gray", linestyle="--", mutation_scale=12)
    flow.text(0.0, 1.15, f"load on {len(loaded)} ranks", fontsize=9, weight="bold")

    for p, (so, sn) in enumerate(saved):
        rows_ax.add_patch(Rectangle((so, 1.1), sn, 0.8, fc=_RANKS[p % len(_RANKS)], ec="black",
                                    lw=0.6))
        rows_ax.text(so + sn / 2, 1.5, f"__{p}_0.distcp", ha="center", va="center", fontsize=7)
    overlaps = piece_overlaps(saved, loaded)
    for r, p, a, b in overlaps:
        rows_ax.add_patch(Rectangle((a, 0.0), b - a, 0.8, fc=_RANKS[p % len(_RANKS)], ec="none"))
    for r, (lo, n) in enumerate(loaded):
        rows_ax.add_patch(Rectangle((lo, 0.0), n, 0.8, fill=False, ec="black", lw=1.6))
        files = ", ".join(str(p) for q, p, _, _ in overlaps if q == r)
        rows_ax.text(lo + n / 2, 0.4, f"load rank {r}: rows {lo}..{lo + n}\nreads files {files}",
                     ha="center", va="center", fontsize=7)
    rows_ax.set(xlim=(0, rows), ylim=(-0.1, 2.0), yticks=[0.4, 1.5],
                yticklabels=[f"loaded on {len(loaded)}", f"saved on {w}"],
                xlabel=f"rows of {name}: each loading rank reads the coloured overlaps only")
    rows_ax.spines[["top", "right", "left"]].set_visible(False)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- Lesson 09


def ring_blocks(world_size: int) -> list[list[int]]:
    """``held[step][rank]``: the K/V block a rank computes with at each step when blocks move
    right."""
    return [[(rank - step) % world_size for rank in range(world_size)]
            for step in range(world_size)]


def ring_rotation(world_size: int = 4) -> Any:
    """Ring attention's K/V rotation (left) against one all-gather of K/V (right), W ranks."""
    from matplotlib.patches import Rectangle

    plt = _plt()
    w = world_size
    fig, (ring, gather) = plt.subplots(1, 2, figsize=(10, 0.9 + 0.55 * w), width_ratios=[w, 1.6])
    for step, held in enumerate(ring_blocks(w)):
        for rank, block in enumerate(held):
            y = w - 1 - rank
            ring.add_patch(Rectangle((step + 0.1, y + 0.15), 0.8, 0.7,
                                     fc=_RANKS[block % len(_RANKS)],
                                     ec="black", lw=0.6))
            ring.text(step + 0.5, y + 0.5, f"K$_{block}$V$_{block}$", ha="center", va="center",
                      fontsize=8)
            if step < w - 1:
                dst = (rank + 1) % w
                if dst:  # to the right neighbour, one row down
                    _arrow(ring, (step + 0.9, y + 0.5), (step + 1.1, w - 1 - dst + 0.5),
                           color="gray")
                else:  # the last rank wraps around to rank 0
                    ring.annotate("", xy=(step + 1.1, w - 0.5), xytext=(step + 0.9, 0.5),
                                  arrowprops=dict(arrowstyle="-|>", color="tab:red", lw=0.7,
                                                  ls="--",
                                                  connectionstyle="arc3,rad=-0.25"))
    ring.set(xlim=(0, w), ylim=(0, w), xticks=[s + 0.5 for s in range(w)],
             xticklabels=[f"step {s}" for s in range(w)],
             yticks=[w - 1 - r + 0.5 for r in range(w)],
             yticklabels=[f"rank {r}: Q$_{r}$" for r in range(w)],
             title=f"ring: {w - 1} sends to the right; one K/V block in use per rank")
    ring.tick_params(length=0)
    ring.spines[:].set_visible(False)
    for rank in range(w):
        y = w - 1 - rank
        for block in range(w):
            gather.add_patch(Rectangle((block * 0.4, y + 0.15), 0.36, 0.7,
                                       fc=_RANKS[block % len(_RANKS)],
                                       ec="black", lw=0.5))
    gather.set(xlim=(0, 0.4 * w), ylim=(0, w), xticks=[], yticks=[],
               title="all-gather: every block\non every rank at once")
    gather.spines[:].set_visible(False)
    fig.tight_layout()
    return fig


def triangle_geometry(length: int = 8, i: int = 1, j: int = 5, k: int = 3) -> Any:
    """Triangle attention around the starting node: edge ij attends to the edges ik (every k),
    biased by the edges jk; left the residues, right the same entries of the L × L pair matrix."""
    import math

    from matplotlib.patches import Rectangle

    plt = _plt()
    fig, (tri, grid) = plt.subplots(1, 2, figsize=(10, 3.8), width_ratios=[1.1, 1])
    pos = {"i": (0.0, 0.0), "j": (2.0, 0.0), "k": (1.0, math.sqrt(3))}
    edges = [("i", "j", "tab:red", "z$_{ij}$: updated (query)"),
             ("i", "k", "tab:blue", "z$_{ik}$: keys, values"),
             ("j", "k", "tab:orange", "z$_{jk}$: bias b$_{jk}$")]
    for a, b, color, label in edges:
        (x0, y0), (x1, y1) = pos[a], pos[b]
        tri.plot([x0, x1], [y0, y1], color=color, lw=3, label=label, zorder=1)
    for name, (x, y) in pos.items():
        tri.scatter([x], [y], s=500, color="white", edgecolor="black", zorder=2)
        tri.text(x, y, name, ha="center", va="center", fontsize=12, zorder=3)
    tri.legend(loc="upper right", fontsize=7.5, frameon=False, bbox_to_anchor=(1.15, 1.05))
    tri.set(xlim=(-0.5, 2.6), ylim=(-0.6, 2.1), aspect="equal",
            title="three residues: edge ij learns from ik and jk,\nfor every third residue k")
    tri.text(1.0, -0.5, "triangle multiplication (outgoing): z$_{ij}$ ← Σ$_k$ a$_{ik}$ ⊙ b$_{jk}$",
             ha="center", fontsize=7.5)
    tri.axis("off")

    n = length
    for r in range(n):
        for c in range(n):
            color = "white"
            if r == i:
                color = "#9ecae1"  # row i: the edges ik the query ij attends to
            if r == j:
                color = "#fdd0a2"  # row j: the bias b_jk
            if (r, c) == (i, j):
                color = "tab:red"
            grid.add_patch(Rectangle((c, n - 1 - r), 1, 1, fc=color, ec="lightgray", lw=0.5))
    grid.add_patch(Rectangle((0, n - 1 - i), n, 1, fill=False, ec="tab:blue", lw=1.5))
    grid.add_patch(Rectangle((0, n - 1 - j), n, 1, fill=False, ec="tab:orange", lw=1.5))
    grid.add_patch(Rectangle((k, n - 1 - i), 1, 1, fill=False, ec="black", lw=1.2, ls="--"))
    grid.add_patch(Rectangle((k, n - 1 - j), 1, 1, fill=False, ec="black", lw=1.2, ls="--"))
    grid.set(xlim=(0, n), ylim=(0, n), aspect="equal", xticks=[c + 0.5 for c in range(n)],
             xticklabels=[str(c) for c in range(n)], yticks=[n - 1 - r + 0.5 for r in range(n)],
             yticklabels=[str(r) for r in range(n)], xlabel="second residue",
             ylabel="first residue",
             title=f"the pair matrix: output row i = {i} needs row i of z,\n"
                   f"the bias from all of z (row j = {j}; k = {k} dashed)")
    grid.tick_params(length=0, labelsize=7)
    fig.tight_layout()
    return fig
