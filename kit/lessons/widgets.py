"""An interactive ring all-reduce: step through every chunk on every rank (Lesson 01).

:func:`ring_all_reduce_steps` is the algorithm as a pure function: it takes every rank's data,
already split into ``p`` chunks, and returns the state after each of the ``2(p-1)`` steps
(reduce-scatter, then all-gather), with who sent which chunk to whom. Tests compare its last
state with a real ``dist.all_reduce``. :func:`ring_stepper` draws those states as an ipywidgets
player: one row per rank, one column per chunk, each cell showing which ranks' data it sums.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

__all__ = ["RingStep", "render_step", "ring_all_reduce_steps", "ring_stepper"]


@dataclass(frozen=True)
class RingStep:
    """The state of every rank after one step of a ring all-reduce.

    ``values[rank][chunk]`` is what the rank holds for that chunk; ``parts[rank][chunk]`` the
    set of ranks whose data it sums; ``sends`` the ``(src, dst, chunk)`` messages of this step.
    """

    phase: str  # "start", "reduce-scatter" or "all-gather"
    step: int  # 1-based within the phase (0 for "start")
    values: list[list[Any]]
    parts: list[list[frozenset[int]]]
    sends: list[tuple[int, int, int]]

    @property
    def title(self) -> str:
        if self.phase == "start":
            return "start: every rank holds its own data, split into p chunks"
        p = len(self.values)
        return f"{self.phase}, step {self.step} of {p - 1}"


def ring_all_reduce_steps(data: list[list[Any]]) -> list[RingStep]:
    """Every state of a ring all-reduce (sum) of ``data[rank][chunk]``, ``p`` ranks x ``p`` chunks.

    Values may be numbers or tensors (anything with ``+``). In reduce-scatter step ``s``
    (0-based) rank ``r`` sends chunk ``(r - s) % p`` to rank ``r + 1``, which adds it to its own;
    after ``p - 1`` steps rank ``r`` holds the full sum of chunk ``(r + 1) % p``. In all-gather
    step ``s`` rank ``r`` sends chunk ``(r + 1 - s) % p``, which the receiver copies. Returns
    ``2(p-1) + 1`` states, the first being the input.
    """
    p = len(data)
    if p == 0 or any(len(row) != p for row in data):
        raise ValueError("data must be p lists of p chunks (one row per rank, one chunk per "
                         f"rank), got row lengths {[len(row) for row in data]}")
    values = [list(row) for row in data]
    parts = [[frozenset({r}) for _ in range(p)] for r in range(p)]
    steps = [RingStep("start", 0, [list(v) for v in values], [list(q) for q in parts], [])]
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(p - 1):
            # every rank sends at once: read this step's messages before anyone updates
            offset = -s if phase == "reduce-scatter" else 1 - s
            sends = [(r, (r + 1) % p, (r + offset) % p) for r in range(p)]
            messages = [(dst, c, values[src][c], parts[src][c]) for src, dst, c in sends]
            for dst, c, value, who in messages:
                if phase == "reduce-scatter":
                    values[dst][c] = values[dst][c] + value
                    parts[dst][c] = parts[dst][c] | who
                else:
                    values[dst][c] = value
                    parts[dst][c] = who
            steps.append(RingStep(phase, s + 1, [list(v) for v in values],
                                  [list(q) for q in parts], sends))
    return steps


_NAMES = "abcdefgh"


def _label(who: frozenset[int], chunk: int) -> str:
    return "+".join(f"{_NAMES[r] if r < len(_NAMES) else r}{chunk}" for r in sorted(who))


def _format(value: Any) -> str:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def render_step(step: RingStep) -> str:
    """One state as an HTML table: rows are ranks, columns chunks; full sums in dark green."""
    p = len(step.values)
    received = {(dst, c) for _, dst, c in step.sends}
    sent = {(src, c) for src, _, c in step.sends}
    head = "".join(f"<th style='padding:2px 8px'>chunk {c}</th>" for c in range(p))
    rows = []
    for r in range(p):
        cells = []
        for c in range(p):
            n = len(step.parts[r][c])
            shade = 255 - int(150 * (n - 1) / max(p - 1, 1))  # 1 part: white; all p: green
            colour = f"rgb({shade},{min(255, shade + 60)},{shade})"
            border = ("3px solid #1565c0" if (r, c) in received else
                      "2px dashed #ef6c00" if (r, c) in sent else "1px solid #999")
            cells.append(f"<td style='background:{colour};border:{border};padding:3px 6px;"
                         f"text-align:center;font-family:monospace'>"
                         f"{html.escape(_label(step.parts[r][c], c))}<br>"
                         f"<small>{html.escape(_format(step.values[r][c]))}</small></td>")
        rows.append(f"<tr><th style='padding:2px 8px'>rank {r}</th>{''.join(cells)}</tr>")
    moves = ", ".join(f"rank {s}&rarr;{d}: chunk {c}" for s, d, c in step.sends) or ("no messages "
                                                                                     "yet")
    return (f"<div><b>{html.escape(step.title)}</b><table style='border-collapse:collapse;"
            f"margin:4px 0'><tr><th></th>{head}</tr>{''.join(rows)}</table>"
            f"<small>{moves}. Dashed orange: sent this step; blue: just received. The letters say "
            f"whose data a chunk sums (a = rank 0, b = rank 1, ...).</small></div>")


def ring_stepper(world_size: int = 4, data: list[list[Any]] | None = None) -> Any:
    """An ipywidgets player over :func:`ring_all_reduce_steps` (press play, or drag the slider).

    ``data[rank][chunk]`` defaults to ``10 * rank + chunk + 1`` so every sum is readable.
    """
    import ipywidgets as widgets

    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= 8:
        raise ValueError(f"world_size must be an integer from 1 to 8, got {world_size!r}")
    if data is None:
        data = [[10 * r + c + 1 for c in range(world_size)] for r in range(world_size)]
    steps = ring_all_reduce_steps(data)
    view = widgets.HTML(render_step(steps[0]))
    slider = widgets.IntSlider(value=0, min=0, max=len(steps) - 1, description="step",
                               continuous_update=True)
    play = widgets.Play(value=0, min=0, max=len(steps) - 1, interval=1200, description="play")
    widgets.jslink((play, "value"), (slider, "value"))
    slider.observe(lambda change: setattr(view, "value", render_step(steps[change["new"]])),
                   names="value")
    return widgets.VBox([widgets.HBox([play, slider]), view])
