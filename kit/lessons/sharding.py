"""Memory and traffic of sharded training: the ZeRO formulas, their bars and a calculator widget.

Lesson 05 uses it to put the per-rank bytes of DDP and of ZeRO stages 1-3 (Rajbhandari et al.,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020, section 5)
beside the bytes its ranks really hold. For a model of ``P`` parameters on ``W`` ranks, with
Adam:

* fp32 training keeps 4 bytes of parameter, 4 of gradient and 8 of optimizer state (two
  moments) per parameter;
* mixed precision (the paper's case) keeps 2 bytes of fp16/bf16 parameter, 2 of gradient and
  ``K = 12`` of optimizer state (fp32 master weight and two moments).

Stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also the parameters.
Activations are not in any of them: each rank computes its own batch's activations.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MODEL_SIZES", "PRECISIONS", "STAGES", "memory_calculator", "params_label",
           "plot_stage_bars", "stage_bytes", "stage_traffic"]

# Bytes per parameter of (parameters, gradients, optimizer state) with Adam.
PRECISIONS = {"fp32": (4, 4, 8), "mixed (bf16 + fp32 master)": (2, 2, 12)}
STAGES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3 / FSDP"}


def stage_bytes(params: float, world_size: int, stage: int, precision: str = "fp32"
                ) -> dict[str, float]:
    """Bytes one rank holds for ``params`` parameters at a ZeRO ``stage`` (0 = DDP).

    Returns ``{"params": ..., "grads": ..., "optimizer": ...}``; each sharded kind is 1/W.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {sorted(STAGES)} (0 is DDP), got {stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    p, g, o = PRECISIONS[precision]
    return {"params": params * p / (world_size if stage >= 3 else 1),
            "grads": params * g / (world_size if stage >= 2 else 1),
            "optimizer": params * o / (world_size if stage >= 1 else 1)}


def stage_traffic(params: float, world_size: int, stage: int, bytes_per_param: int = 4) -> float:
    """Bytes each rank sends per step with a ring algorithm (a receive for every send).

    DDP's all-reduce is a reduce-scatter plus an all-gather, ``2 (W-1)/W`` of the gradients;
    stages 1 and 2 do exactly that (reduce-scatter the gradients, all-gather the updated
    parameters); stage 3 all-gathers the parameters twice (forward and backward) and
    reduce-scatters the gradients: ``3 (W-1)/W``, 1.5 times as much.
    """
    per_pass = (world_size - 1) / world_size * params * bytes_per_param
    return (3 if stage == 3 else 2) * per_pass


def plot_stage_bars(params: float, world_size: int, precision: str = "fp32",
                    measured: dict[int, dict[str, float]] | None = None, ax: Any = None) -> Any:
    """Stacked bars of per-rank bytes for DDP and ZeRO stages 1-3; dots for ``measured[stage]``
    (a total per stage, as counted on a real rank). Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3))
    colours = {"params": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green"}
    unit, scale = _unit(stage_bytes(params, 1, 0, precision))
    for stage, label in STAGES.items():
        left = 0.0
        for kind, nbytes in stage_bytes(params, world_size, stage, precision).items():
            ax.barh(label, nbytes / scale, left=left, color=colours[kind],
                    label=kind if stage == 0 else None)
            left += nbytes / scale
        if measured and stage in measured:
            total = sum(measured[stage].values()) / scale
            ax.plot([total], [label], "k^", label="counted on rank 0" if stage == min(measured)
                    else None)
    ax.invert_yaxis()
    ax.set_xlabel(f"{unit} per rank")
    ax.set_title(f"{params:,.0f} parameters on {world_size} ranks, Adam, {precision}")
    ax.legend(loc="lower right", fontsize="small", frameon=False)
    return ax


def _unit(bytes_by_kind: dict[str, float]) -> tuple[str, float]:
    total = sum(bytes_by_kind.values())
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if total >= scale:
            return unit, scale
    return "bytes", 1


# The calculator's model sizes: log-spaced, with the sizes of well-known models among them.
MODEL_SIZES = (1e6, 3e6, 1e7, 3e7, 1e8, 3e8, 1e9, 3e9, 7e9, 1.3e10, 3e10, 7e10, 1.75e11, 4.05e11,
               1e12)


def params_label(params: float) -> str:
    """A parameter count as people write it: ``7e9`` -> ``"7B"``, ``1.3e10`` -> ``"13B"``."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if params >= scale:
            return f"{params / scale:.3g}{suffix}"
    return f"{params:.3g}"


def memory_calculator() -> Any:
    """An ipywidgets calculator: model size, world size and precision; bars for every stage."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    # Both sliders step through log-spaced stops: a linear 1..1024 slider puts 8 at the far left.
    size = widgets.SelectionSlider(options=[(params_label(p), p) for p in MODEL_SIZES], value=7e9,
                                   description="parameters", continuous_update=False)
    world = widgets.SelectionSlider(options=[2**k for k in range(11)], value=8,
                                    description="world size", continuous_update=False)
    precision = widgets.Dropdown(options=list(PRECISIONS), description="precision")
    out = widgets.Output()

    def draw(*_: Any) -> None:
        with out:
            out.clear_output(wait=True)
            plot_stage_bars(size.value, world.value, precision.value)
            plt.show()
            for stage, label in STAGES.items():
                total = sum(stage_bytes(size.value, world.value, stage, precision.value).values())
                print(f"{label:14s} {total / 2**30:10.2f} GiB per rank (+ activations)")

    for w in (size, world, precision):
        w.observe(draw, names="value")
    draw()
    return widgets.VBox([widgets.HBox([size, world, precision]), out])
