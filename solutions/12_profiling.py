# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lesson 12 · Where the time goes: profiling ranks, counting FLOPs and bytes, finding the straggler
#
# Every lesson so far said what a technique should save. This one measures where a real
# distributed step spends its time, the way practitioners do: a `torch.profiler` trace on every
# rank, merged into one timeline; the FLOPs a step must do, and the fraction of the machine's
# peak it reaches (MFU); the bytes each layout must move; a model of the step time built from
# both; and the rule that the rank waiting longest in a collective is usually not the slow one.
#
# **Prerequisites:** Lesson 01 (the recorder, the α-β cost model), Lesson 04 (DDP), Lesson 05
# (ZeRO-1, FSDP2) and Lesson 08 (tensor parallelism).
#
# **You will be able to:**
# - count the FLOPs of a transformer's training step from its shapes, exactly as
#   `FlopCounterMode` does (**Task 12.1**, 3 points);
# - say how many bytes DDP, ZeRO-1, FSDP and TP move per step and per rank, padding included
#   (**Task 12.2**, 4 points);
# - read per-rank profiler traces and name the slow rank and what made it slow
#   (**Task 12.3**, 4 points);
# - measure this CPU's achieved FLOP/s, the MFU of DDP and FSDP steps, a roofline, and predict
#   step times; pick a layout for a 7B model on 8, 64 and 512 GPUs from published H100 numbers.
#
# Replace each `raise NotImplementedError(...)` with your code, run the cell, then the
# `check(...)` cell under it.

# %% tags=["setup"]
import json
import math
import statistics
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from kit import check, launch
from kit.lessons.costmodel import ring_all_reduce_time
from kit.lessons.models import TinyTransformer, token_batch
from kit.lessons.profiling import (
    load_traces,
    matmul_peak,
    merge_traces,
    plot_traces,
    profiled,
    straggler_run,
    warm_profiler,
)
from kit.trace import launch_traced, trace

WORK = Path("lesson12")  # traces and figures of this lesson are written here
WORK.mkdir(exist_ok=True)

# %% [markdown]
# ## 1. Counting FLOPs
#
# A training step is mostly matrix products. Multiplying an `(m, k)` matrix by a `(k, n)` one
# costs `2mkn` FLOPs (a multiply and an add per term). Backward costs about twice the forward:
# each product `Y = X W` needs one product for `dX` and one for `dW`. Hence the rule of thumb
# of the scaling-law papers ([Kaplan et al., 2020](https://arxiv.org/abs/2001.08361)):
# **training costs 6 · N · tokens FLOPs**, with `N` the parameters, plus an attention term
# `6 · 2 · layers · seq_len · dim` per token that the rule leaves out.
#
# `torch.utils.flop_counter.FlopCounterMode` counts the FLOPs of the aten ops that actually run
# ([docs](https://pytorch.org/docs/stable/torch.compiler_profiling_torch_compile.html)): it
# has a formula per op. Here it is on the lesson's transformer; watch the attention.

# %%
vocab, dim, layers, heads, batch, seq_len = 256, 64, 4, 4, 8, 64
model = TinyTransformer(vocab, dim, layers, heads, context=seq_len)
x, y = token_batch(batch, seq_len, vocab, seed=0)


def counted(backend=None):
    """FlopCounterMode's count of one forward and backward, per op."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(backend or [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1)).backward()
    return counter.get_total_flops(), {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}


from torch.nn.attention import SDPBackend  # noqa: E402

fused_total, fused_ops = counted()
math_total, math_ops = counted(SDPBackend.MATH)
params = sum(p.numel() for p in model.parameters())
print(f"fused attention kernel: {fused_total:,} FLOPs  {fused_ops}")
print(f"math attention backend: {math_total:,} FLOPs  {math_ops}")
print(f"6 N tokens rule:        {6 * params * batch * seq_len:,} FLOPs (N = {params:,} parameters, embeddings included)")

# %% [markdown]
# On CPU, `scaled_dot_product_attention` runs a fused flash kernel
# (`_scaled_dot_product_flash_attention_for_cpu`), and `FlopCounterMode` has no formula for it:
# attention counts as **zero**. Under `sdpa_kernel(SDPBackend.MATH)` the same attention runs as
# two batched products (`aten.bmm`), which it counts. The `6 N tokens` rule is off the other
# way: it counts the embeddings (a lookup, no FLOPs) and misses the attention scores.
#
# **Task 12.1.** Count it from the shapes: no model, no counter.

# %% tags=["task-12.1"]
def training_flops(vocab: int, dim: int, layers: int, heads: int, batch: int, seq_len: int) -> int:
    """FLOPs of one forward and backward of TinyTransformer(vocab, dim, layers, heads,
    context=seq_len) on a (batch, seq_len) input with cross-entropy on every position.

    Count what FlopCounterMode counts under the math attention backend: every matrix product
    (the QKV, output and MLP projections, the attention scores and their product with V over
    all seq_len x seq_len positions, the tied output layer), 2 FLOPs per multiply-add;
    backward is twice forward. Embedding lookups, norms, GELU, softmax and the loss count 0.
    """
    ### BEGIN SOLUTION
    tokens = batch * seq_len
    projections = 2 * tokens * dim * (3 * dim + dim + 4 * dim + 4 * dim)  # qkv, proj, mlp up, down
    attention = 2 * 2 * batch * seq_len * seq_len * dim  # Q K^T and (scores) V, all heads together
    head = 2 * tokens * dim * vocab  # the tied output layer
    forward = layers * (projections + attention) + head
    return 3 * forward  # backward: one product for the input's gradient, one for the weight's
    ### END SOLUTION


# %% tags=["check-12.1"]
check("12.1", training_flops)

# %% [markdown]
# ## 2. Bytes per layout
#
# **Task 12.2.** Every layout of Lessons 04-08 moves a fixed set of tensors per step. Say which
# and how big, per rank, as the recorder counts them: its convention is nccl-tests' message size
# (`kit/trace.py`'s `Event`), which counts an all-gather's *whole output* and a broadcast's
# tensor on every rank. The layouts:
#
# | `layout` | what runs |
# | --- | --- |
# | `"ddp"` | `DistributedDataParallel(model)` |
# | `"zero1"` | `ZeroRedundancyOptimizer(AdamW)` under DDP |
# | `"fsdp"` | `fully_shard` on each block, then on the model |
# | `"tp"` | `parallelize_module` on each block's MLP: `mlp.0` column-wise, `mlp.2` row-wise |
#
# The step measured is the third: DDP's second step still rebuilds its buckets (it broadcasts
# their order once).

# %% tags=["task-12.2"]
def step_traffic(layout: str, model: nn.Module, world_size: int, batch: int, seq_len: int) -> dict[str, int]:
    """Bytes per collective in one steady-state training step of ``model`` (a TinyTransformer)
    under ``layout`` on ``world_size`` ranks, as the recorder counts them on each rank.

    Keys are the recorder's op names ("all_reduce", "broadcast", "all_gather_single",
    "reduce_scatter_single"); entries of zero are left out. Read only the parameters' shapes
    and dtypes. ``batch`` and ``seq_len`` size TP's activations. FSDP pads each parameter's
    first dimension up to a multiple of world_size before sharding it.
    """
    ### BEGIN SOLUTION
    def nbytes(p: torch.Tensor, pad: bool = False) -> int:
        rows = p.shape[0] if p.dim() else 1
        if pad:
            rows = -(-rows // world_size) * world_size  # ceil to a multiple of W
        return rows * (p[0].numel() if p.dim() else 1) * p.element_size()

    params = list(model.parameters())  # the tied weight once
    total = sum(nbytes(p) for p in params)
    if layout == "ddp":
        return {"all_reduce": total}
    if layout == "zero1":
        return {"all_reduce": total, "broadcast": total}
    if layout == "fsdp":
        in_blocks = {id(p) for block in model.blocks for p in block.parameters()}
        root = sum(nbytes(p, pad=True) for p in params if id(p) not in in_blocks)
        blocks = sum(nbytes(p, pad=True) for block in model.blocks for p in block.parameters())
        # forward: root + every block; backward: every block again (resharded after forward)
        return {"all_gather_single": root + 2 * blocks, "reduce_scatter_single": root + blocks}
    if layout == "tp":
        dim = model.tok.weight.shape[1]
        activation = batch * seq_len * dim * model.tok.weight.element_size()
        return {"all_reduce": 2 * len(model.blocks) * activation}  # forward out, backward in
    raise ValueError(f"layout must be one of ddp, zero1, fsdp, tp; got {layout!r}")
    ### END SOLUTION


# %% tags=["check-12.2"]
check("12.2", step_traffic)

# %% [markdown]
# ## 3. Finding the straggler
#
# **Task 12.3.** One slow rank makes every other rank wait inside its collectives: their
# `gloo:all_reduce` events grow long while the slow rank's stays short, since by the time it
# arrives everyone is ready. Read the traces and name the slow rank and its phase.

# %% tags=["task-12.3"]
def find_straggler(traces: list[dict]) -> dict:
    """The slow rank and what made it slow: {"rank": r, "phase": "data" | "compute" |
    "communication"}.

    traces[r] is rank r's Chrome trace as torch.profiler's export_chrome_trace writes it (CPU
    activities), parsed. Read torch's own events only: "enumerate(DataLoader)...__next__"
    (data), aten:: and autograd ops on the main thread (compute), "gloo:" events on gloo's
    threads (communication waits). A delay before a send leaves a gap on the slow rank, on no
    event at all.
    """
    ### BEGIN SOLUTION
    def _span(e: dict) -> tuple[float, float]:
        return e["ts"], e["ts"] + e["dur"]

    def _inside(s: tuple[float, float], spans: list[tuple[float, float]]) -> bool:
        return any(a <= s[0] and s[1] <= b for a, b in spans)

    def union(spans: list[tuple[float, float]]) -> float:
        total, end = 0.0, float("-inf")
        for a, b in sorted(spans):
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    rows = []
    for rank_trace in traces:
        events = [e for e in rank_trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
        ops: dict = {}
        for e in events:
            if e.get("cat") == "cpu_op":
                ops[e["tid"]] = ops.get(e["tid"], 0) + 1
        main = max(ops, key=ops.get)  # the thread that ran the model
        mine = [e for e in events if e["tid"] == main]
        data = [_span(e) for e in mine if "DataLoader" in e["name"] and "__next__" in e["name"]]
        compute = [_span(e) for e in mine if e["name"].startswith(("aten::", "autograd::"))
                   and not _inside(_span(e), data)]
        comm = [_span(e) for e in events if e["name"].startswith("gloo:")]
        start = min(e["ts"] for e in mine)
        end = max(e["ts"] + e["dur"] for e in mine)
        gap = (end - start) - union(data + compute + [s for s in comm if start <= s[0] <= end])
        rows.append({"data": union(data), "compute": union(compute), "communication": gap,
                     "wait": union(comm)})
    slow = min(range(len(rows)), key=lambda r: rows[r]["wait"])  # the others wait for it
    others = [row for r, row in enumerate(rows) if r != slow]
    excess = {phase: rows[slow][phase] - statistics.median(o[phase] for o in others)
              for phase in ("data", "compute", "communication")}
    return {"rank": slow, "phase": max(excess, key=excess.get)}
    ### END SOLUTION


# %% tags=["check-12.3"]
check("12.3", find_straggler)
