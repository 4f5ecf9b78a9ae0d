"""Pictures and arithmetic for model parallelism (Lesson 08): pipeline schedules and layouts.

:func:`simulate_schedule` plays per-stage orders of forward and backward micro-batch steps on
an idealised pipeline (fixed step times, free messages) and :func:`plot_schedule` draws the
result, bubbles included. :func:`layout_costs` estimates, for a transformer and a number of
ranks, each data x tensor x pipeline layout's memory and communication per rank with Lesson
01's alpha-beta model; :func:`layout_table` lists every layout and :func:`layout_widget` makes
it interactive. Nothing here implements a lesson task: schedules come in as data.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from kit.launcher import preload_modules
from kit.lessons import costmodel

# ``tensor.backward(grad)``, which every pipeline stage but the last calls, imports sympy (through
# torch.fx's symbolic shapes) the first time, 1-4 s per process: the lesson, which imports this
# module in its setup cell, loads it once before its ranks fork instead of each rank paying.
preload_modules(("torch.fx.experimental.symbolic_shapes",))

__all__ = ["LayoutCost", "Model", "Network", "ScheduleRun", "layout_costs", "layout_table",
           "layout_widget", "plot_pipeline_run", "plot_schedule", "simulate_schedule"]

Op = tuple  # ("F", i) or ("B", i): micro-batch i's forward or backward on one stage;
# ("F", i, c) or ("B", i, c): the same for the stage's model chunk c (interleaved schedules)


# --------------------------------------------------------------------------- pipeline schedules


@dataclass
class ScheduleRun:
    """What :func:`simulate_schedule` found: ``steps[stage]`` is ``[(op, i, chunk, start,
    end)]``."""

    steps: list[list[tuple[str, int, int, float, float]]]
    makespan: float
    busy: float  # total time all stages spent computing
    peak_in_flight: list[int]  # per stage: most forwards done whose backward is not

    @property
    def bubble(self) -> float:
        """The idle fraction of the stages' time: 1 - busy / (stages * makespan)."""
        return 1.0 - self.busy / (len(self.steps) * self.makespan)


def simulate_schedule(orders: list[list[Op]], forward: float = 1.0,
                      backward: float = 2.0, chunks: int | None = None) -> ScheduleRun:
    """Play ``orders[stage]`` on an ideal pipeline; each stage runs its steps in its order.

    ``("F", i)`` on stage s starts once stage s is free and ``("F", i)`` ended on stage s - 1;
    ``("B", i)`` once stage s is free, ``("B", i)`` ended on stage s + 1 and ``("F", i)`` ran on
    stage s. With ``chunks`` = v model chunks per stage (steps ``("F", i, c)``), chunk c of stage
    s is virtual stage c * p + s of a v * p-stage pipeline, and the same rules hold between
    virtual stages (so stage p - 1's chunk c feeds stage 0's chunk c + 1). Messages are free.
    Raises ValueError when the orders deadlock (a stage waits for a step that can never come) or
    hold a step that is not a forward or backward of a chunk in range.
    """
    p = len(orders)
    if chunks is None:
        chunks = 1 + max((step[2] for order in orders for step in order if len(step) > 2),
                         default=0)
    last = chunks * p - 1  # the last virtual stage
    done: dict[tuple[str, int, int], float] = {}  # (op, i, virtual stage) -> end time
    clock = [0.0] * p
    position = [0] * p
    steps: list[list[tuple[str, int, int, float, float]]] = [[] for _ in range(p)]
    in_flight, peak = [0] * p, [0] * p
    while any(position[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if position[s] == len(orders[s]):
                continue
            op, i, *rest = orders[s][position[s]]
            c = rest[0] if rest else 0
            if not 0 <= c < chunks:
                raise ValueError(f"stage {s}: step {orders[s][position[s]]} names chunk {c} "
                                 f"(use 0 to {chunks - 1})")
            v = c * p + s
            if op == "F":
                needs = [("F", i, v - 1)] if v > 0 else []
            elif op == "B":
                needs = [("F", i, v)] + ([("B", i, v + 1)] if v < last else [])
            else:
                raise ValueError(f"stage {s}: unknown step {op!r} (use 'F' or 'B')")
            if not all(n in done for n in needs):
                continue
            start = max([clock[s]] + [done[n] for n in needs])
            end = start + (forward if op == "F" else backward)
            done[(op, i, v)] = end
            clock[s] = end
            steps[s].append((op, i, c, start, end))
            in_flight[s] += 1 if op == "F" else -1
            peak[s] = max(peak[s], in_flight[s])
            position[s] += 1
            progressed = True
        if not progressed:
            waiting = ", ".join(f"stage {s} at {orders[s][position[s]]}" for s in range(p)
                                if position[s] < len(orders[s]))
            raise ValueError(f"the orders deadlock: {waiting} wait for steps that never come")
    makespan = max(clock)
    busy = sum(end - start for lane in steps for *_, start, end in lane)
    return ScheduleRun(steps, makespan, busy, peak)


# Chunk c's colours (forward, backward): later chunks lighter.
_COLOURS = [("tab:blue", "tab:green"), ("cornflowerblue", "yellowgreen"),
            ("lightsteelblue", "darkseagreen"), ("lavender", "honeydew")]


def plot_schedule(orders: list[list[Op]], ax: Any = None, *, title: str = "",
                  forward: float = 1.0, backward: float = 2.0, chunks: int | None = None) -> Any:
    """Draw :func:`simulate_schedule`'s run: one lane per stage, F in blue, B in green (later
    model chunks lighter), the micro-batch number in each box, white gaps are the bubble.
    Returns the Axes."""
    import matplotlib.pyplot as plt

    run = simulate_schedule(orders, forward, backward, chunks)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * len(orders)))
    for s, lane in enumerate(run.steps):
        for op, i, c, start, end in lane:
            colour = _COLOURS[min(c, len(_COLOURS) - 1)][op == "B"]
            ax.barh(s, end - start, left=start, height=0.8, color=colour, edgecolor="white")
            ax.text((start + end) / 2, s, str(i), ha="center", va="center",
                    color="white" if c == 0 else "black", fontsize=8)
    ax.set_yticks(range(len(orders)), [f"stage {s}" for s in range(len(orders))])
    ax.set_ylim(len(orders) - 0.5, -0.5)
    ax.set_xlabel(f"time (a forward = {forward:g}, a backward = {backward:g})")
    ax.set_title(title or f"bubble {run.bubble:.0%}, peak activations in flight "
                          f"{run.peak_in_flight}")
    return ax


def plot_pipeline_run(events: list[list[Any]], ax: Any = None, *, title: str = "") -> Any:
    """Draw a traced pipeline run like :func:`plot_schedule`: one lane per rank, a box per
    region named ``"F i"`` (blue) or ``"B i"`` (green) at the times it really ran, and an arrow
    from each send to the receive that got it (``kit.trace`` events, as ``launch_traced`` returns).
    """
    import matplotlib.pyplot as plt

    from kit.trace import match_messages

    flat = [e for lane in events for e in lane]
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * len(events)))
    t0 = min(e.start for e in flat)
    for e in flat:
        name = e.op.split()
        if e.kind != "region" or len(name) != 2 or name[0] not in ("F", "B"):
            continue
        colour = "tab:blue" if name[0] == "F" else "tab:green"
        ax.barh(e.rank, 1e3 * e.duration, left=1e3 * (e.start - t0), height=0.8, color=colour,
                edgecolor="white")
        ax.text(1e3 * (e.start + e.end - 2 * t0) / 2, e.rank, name[1], ha="center", va="center",
                color="white", fontsize=7)
    for send, recv in match_messages(events):
        ax.annotate("", xy=(1e3 * (recv.end - t0), recv.rank),
                    xytext=(1e3 * (send.start - t0), send.rank),
                    arrowprops={"arrowstyle": "->", "color": "black", "lw": 0.5, "alpha": 0.4})
    ranks = sorted({e.rank for e in flat})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)
    ax.set_xlabel("time (ms)")
    if title:
        ax.set_title(title)
    return ax


# --------------------------------------------------------------------------- choosing a layout


@dataclass(frozen=True)
class Model:
    """A GPT-style transformer and its training batch: 12 h^2 parameters per layer."""

    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    seq: int = 2048
    batch: int = 512  # sequences per step, over all data-parallel ranks
    micro_batch: int = 1  # sequences per micro-batch
    vocab: int = 50_000

    @property
    def params(self) -> float:
        return 12 * self.layers * self.hidden**2 + self.vocab * self.hidden


@dataclass(frozen=True)
class Network:
    """Alpha-beta links (Lesson 01): inside a node (NVLink) and between nodes (InfiniBand)."""

    gpus_per_node: int = 8
    alpha_intra: float = 5e-6
    # NVLink 3 (A100): 600 GB/s both ways per GPU, so 300 GB/s per direction (NVIDIA's A100
    # datasheet); NVLink 4 (H100) gives 450 GB/s per direction: Network(beta_intra=1 / 450e9).
    beta_intra: float = 1 / 300e9
    alpha_inter: float = 10e-6
    beta_inter: float = 1 / 25e9  # ~25 GB/s per GPU (200 Gb/s)


@dataclass
class LayoutCost:
    """One layout's per-rank estimate; memory in bytes, communication per step."""

    dp: int
    tp: int
    pp: int
    weights_bytes: float  # parameters, gradients and Adam states (16 bytes/param, mixed precision)
    activation_bytes: float  # with sequence parallelism, 1F1B: pp micro-batches on stage 0
    comm_bytes: dict[str, float]  # "dp", "tp", "pp": bytes this rank sends per step
    comm_seconds: dict[str, float]
    bubble: float

    @property
    def memory_bytes(self) -> float:
        return self.weights_bytes + self.activation_bytes


def _link(net: Network, span: int) -> tuple[float, float]:
    """(alpha, beta) of a group whose ranks span ``span`` consecutive GPUs."""
    if span <= net.gpus_per_node:
        return net.alpha_intra, net.beta_intra
    return net.alpha_inter, net.beta_inter


def layout_costs(model: Model, world_size: int, dp: int, tp: int, pp: int,
                 net: Network = Network(), bytes_per_value: int = 2) -> LayoutCost:
    """Estimate one layout (``dp * tp * pp == world_size``; tp innermost, pp outermost).

    Activations follow Korthikanti et al. (2022), Table 2, with tensor and sequence
    parallelism: ``s b h (34 / t + 5 a s / (h t))`` bytes per layer for a micro-batch of b
    sequences, times the ``pp`` micro-batches stage 0 holds under 1F1B.
    """
    if dp * tp * pp != world_size:
        raise ValueError(f"dp * tp * pp != world_size ({dp} * {tp} * {pp} != {world_size})")
    m = model.batch // (dp * model.micro_batch)  # micro-batches per step on each pipeline
    if m < 1:
        raise ValueError(f"batch {model.batch} is too small for dp={dp} and micro-batches "
                         f"of {model.micro_batch}")
    s, b, h, a = model.seq, model.micro_batch, model.hidden, model.heads
    layers = model.layers / pp
    weights = 16 * model.params / (tp * pp)
    per_layer = s * b * h * (34 / tp + 5 * a * s / (h * tp))
    activations = per_layer * layers * min(pp, m)
    act_values = s * b * h  # one micro-batch's (s, b, h) activation
    comm = {
        # gradients of this rank's parameters, all-reduced over the dp group
        "dp": costmodel.BUS_FACTOR["all_reduce"](dp) * bytes_per_value * model.params / (tp * pp),
        # per layer and micro-batch: all-gather + reduce-scatter forward and backward, twice
        # (attention and MLP): the volume of 4 all-reduces
        "tp": (4 * layers * m * costmodel.BUS_FACTOR["all_reduce"](tp) * act_values
               * bytes_per_value),
        # each micro-batch's activation forward and its gradient backward, at one boundary
        "pp": (2 * m * act_values * bytes_per_value) if pp > 1 else 0.0,
    }
    seconds = {}
    for name, size, span in (("dp", dp, tp * dp), ("tp", tp, tp), ("pp", pp, world_size)):
        alpha, beta = _link(net, span)
        if size == 1:
            seconds[name] = 0.0
        elif name == "dp":
            seconds[name] = costmodel.ring_all_reduce_time(
                bytes_per_value * model.params / (tp * pp), dp, alpha, beta)
        elif name == "tp":
            seconds[name] = 4 * layers * m * costmodel.ring_all_reduce_time(
                act_values * bytes_per_value, tp, alpha, beta)
        else:
            seconds[name] = 2 * m * (alpha + beta * act_values * bytes_per_value)
    bubble = (pp - 1) / (m + pp - 1)
    return LayoutCost(dp, tp, pp, weights, activations, comm, seconds, bubble)


def layout_table(model: Model, world_size: int, net: Network = Network(),
                 max_tp: int | None = None) -> list[LayoutCost]:
    """Every layout of ``world_size`` ranks (tp up to ``max_tp``, default one node)."""
    max_tp = max_tp or net.gpus_per_node
    out = []
    for tp in range(1, world_size + 1):
        if world_size % tp or tp > max_tp or model.heads % tp:
            continue
        for pp in range(1, world_size // tp + 1):
            if (world_size // tp) % pp or model.layers % pp:
                continue
            dp = world_size // (tp * pp)
            if model.batch // (dp * model.micro_batch) < 1:
                continue
            out.append(layout_costs(model, world_size, dp, tp, pp, net))
    return out


def _html_table(rows: list[LayoutCost], memory_limit_gb: float) -> str:
    head = ("<tr><th>dp</th><th>tp</th><th>pp</th><th>memory/rank (GB)</th>"
            "<th>DP comm (GB)</th><th>TP comm (GB)</th><th>PP comm (GB)</th>"
            "<th>comm time (s)</th><th>bubble</th></tr>")
    body = []
    for r in sorted(rows, key=lambda r: sum(r.comm_seconds.values())):
        fits = r.memory_bytes / 1e9 <= memory_limit_gb
        style = "" if fits else " style='color:#999'"
        cells = [r.dp, r.tp, r.pp, f"{r.memory_bytes / 1e9:.1f}"]
        cells += [f"{r.comm_bytes[k] / 1e9:.2f}" for k in ("dp", "tp", "pp")]
        cells += [f"{sum(r.comm_seconds.values()):.2f}", f"{r.bubble:.0%}"]
        body.append(f"<tr{style}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells)
                    + "</tr>")
    legend = (f"<div style='font-size:0.9em;margin-top:2px'><span style='color:#999'>grey rows"
              f"</span>: do not fit in {memory_limit_gb:g} GB per GPU (weights, gradients, "
              "optimizer state and activations); sorted by communication time, fastest first."
              "</div>")
    return f"<table>{head}{''.join(body)}</table>{legend}"


def layout_widget(model: Model = Model(), world_size: int = 64, memory_limit_gb: float = 80.0,
                  net: Network = Network()) -> Any:
    """Sliders for the model and the number of GPUs over :func:`layout_table`; layouts that do
    not fit in ``memory_limit_gb`` are greyed out, the fastest communication comes first."""
    import ipywidgets as w

    def choices(values: list[int], value: int) -> list[int]:
        return sorted({*values, value})  # the model's own value is always one of the stops

    sliders = {
        "world_size": w.SelectionSlider(options=choices([8, 16, 32, 64, 128, 256, 512], world_size),
                                        value=world_size, description="GPUs"),
        "layers": w.SelectionSlider(options=choices(list(range(8, 129, 8)), model.layers),
                                    value=model.layers, description="layers"),
        "hidden": w.SelectionSlider(options=choices([1024, 2048, 4096, 8192, 12288], model.hidden),
                                    value=model.hidden, description="hidden"),
        "seq": w.SelectionSlider(options=choices([512, 1024, 2048, 4096, 8192], model.seq),
                                 value=model.seq, description="sequence"),
    }
    out = w.HTML()

    def redraw(*_: Any) -> None:
        m = Model(layers=sliders["layers"].value, hidden=sliders["hidden"].value,
                  heads=model.heads, seq=sliders["seq"].value, batch=model.batch,
                  micro_batch=model.micro_batch, vocab=model.vocab)
        out.value = _html_table(layout_table(m, sliders["world_size"].value, net), memory_limit_gb)

    for s in sliders.values():
        s.observe(redraw, names="value")
    redraw()
    return w.VBox([w.HBox(list(sliders.values())[:2]), w.HBox(list(sliders.values())[2:]), out])
