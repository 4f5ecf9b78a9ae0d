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
# # {{title}}
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
#   `FlopCounterMode` does ({{task 12.1}});
# - say how many bytes DDP, ZeRO-1, FSDP and TP move per step and per rank, padding included
#   ({{task 12.2}});
# - read per-rank profiler traces and name the slow rank and what made it slow
#   ({{task 12.3}});
# - measure this CPU's achieved FLOP/s, the MFU of DDP and FSDP steps, a roofline, and predict
#   step times; pick a layout for a 7B model on 8, 64 and 512 GPUs from published H100 numbers.
#
# Replace each `raise NotImplementedError(...)` with your code, run the cell, then the
# `check(...)` cell under it.

# %% tags=["setup"]
import json
import math
import statistics
import tempfile
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

# Traces and figures of this lesson go to a folder of their own in the temporary directory, never
# into the folder you started Jupyter in; open the traces from there in https://ui.perfetto.dev.
WORK = Path(tempfile.mkdtemp(prefix="kit-lesson12-"))
print(f"this lesson's traces and figures: {WORK}")

# %% [markdown]
# ## 1. Counting FLOPs
#
# A training step is mostly matrix products. Multiplying an `(m, k)` matrix by a `(k, n)` one
# costs `2mkn` FLOPs (a multiply and an add per term). Backward costs about twice the forward:
# each product `Y = X W` needs one product for `dX` and one for `dW`. Hence the rule of thumb
# of the scaling-law papers ([Kaplan et al., 2020](https://arxiv.org/abs/2001.08361)):
# **training costs 6 · N · tokens FLOPs**, where Kaplan's `N` counts the parameters outside
# the embeddings (`12 · layers · dim²` for this model's blocks, biases aside). Attention's two
# products over every position add `12 · layers · seq_len · dim` per token for training,
# the count of PaLM's appendix B ([Chowdhery et al., 2022](https://arxiv.org/abs/2204.02311));
# Kaplan's table keeps half of it, the scores `Q Kᵀ` alone.
#
# `torch.utils.flop_counter.FlopCounterMode` counts the FLOPs of the aten ops that actually run
# ([source](https://github.com/pytorch/pytorch/blob/main/torch/utils/flop_counter.py)): it
# has a formula per op, in `flop_registry`. Here it is on the lesson's transformer; watch
# the attention.

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
    per_op = counter.get_flop_counts()["Global"]
    return counter.get_total_flops(), {str(k): v for k, v in per_op.items()}


from torch.nn.attention import SDPBackend  # noqa: E402

fused_total, fused_ops = counted()
math_total, math_ops = counted(SDPBackend.MATH)
params = sum(p.numel() for p in model.parameters())
print(f"fused attention kernel: {fused_total:,} FLOPs  {fused_ops}")
print(f"math attention backend: {math_total:,} FLOPs  {math_ops}")
tokens = batch * seq_len
kaplan = 6 * 12 * layers * dim**2 * tokens  # 6 N tokens, Kaplan's N: the blocks' weights only
palm = 12 * layers * seq_len * dim * tokens  # attention's two products over every position
head = 6 * dim * vocab * tokens  # the tied output layer: a real product of the embedding matrix
print(f"6 N tokens, Kaplan's N = 12·layers·dim²: {kaplan:,}; + attention 12·layers·seq_len·dim "
      f"per token: {kaplan + palm:,}; + the output layer 6·dim·vocab per token: "
      f"{kaplan + palm + head:,} "
      f"(= FlopCounterMode's math count: {kaplan + palm + head == math_total})")
print(f"6 N tokens with N every parameter ({params:,}): {6 * params * tokens:,}")
from torch.utils.flop_counter import flop_registry  # noqa: E402

print("FlopCounterMode has a formula for the CPU flash kernel:",
      torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in flop_registry)

# %% [markdown]
# On CPU, `scaled_dot_product_attention` runs a fused flash kernel
# (`_scaled_dot_product_flash_attention_for_cpu`), and `FlopCounterMode` has no formula for it:
# attention counts as **zero**. Under `sdpa_kernel(SDPBackend.MATH)` the same attention runs as
# two batched products (`aten.bmm`), which it counts. The `6 N tokens` rule depends on what
# `N` is. Kaplan's `N` leaves out the embeddings, and so misses the output layer, a real
# product (`2 · dim · vocab` per token forward: tied to the token embedding here, it is where
# that matrix costs FLOPs). Every parameter in `N` gets the tied output layer right, but also
# charges the position embedding, a lookup. Both miss attention's products over the sequence,
# which grow with `seq_len`; only the three terms together are the count.
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

    At the edges: no blocks (layers=0) leaves the output layer; an empty batch (batch=0) costs
    0. A dim that heads do not divide, or a size below what the model accepts (vocab, dim,
    heads, seq_len below 1, layers or batch below 0), raises a ValueError naming it, as
    TinyTransformer refuses to build such a model.
    """
    ### BEGIN SOLUTION
    if min(vocab, dim, heads, seq_len) < 1 or min(layers, batch) < 0:
        raise ValueError(f"sizes out of range: vocab={vocab}, dim={dim}, heads={heads}, "
                         f"seq_len={seq_len} must be >= 1; layers={layers}, batch={batch} >= 0")
    if dim % heads:
        raise ValueError(f"dim must be a multiple of heads ({dim} % {heads} != 0)")
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
# Your count against `FlopCounterMode`'s, and against the rule of thumb, at the lesson's size
# and at one where the sequence is long:

# %%
print("training_flops equals FlopCounterMode:",
      training_flops(vocab, dim, layers, heads, batch, seq_len) == math_total)
for shape in [(vocab, dim, layers, heads, batch, seq_len), (256, 64, 4, 4, 1, 1024)]:
    v, d, n_layers, h, b, t = shape
    n = v * d + t * d + n_layers * (12 * d * d + 13 * d) + 2 * d
    print(f"{shape}: exact {training_flops(*shape):>14,}   "
          f"6 N tokens (N every parameter) {6 * n * b * t:>14,}"
          f"   ({6 * n * b * t / training_flops(*shape):.2f}x)")

# %% [markdown]
# ## 2. This machine's peak, MFU and the roofline
#
# **Model FLOPs utilisation** (MFU, from the PaLM paper,
# [Chowdhery et al., 2022](https://arxiv.org/abs/2204.02311)) is the FLOPs the model needs per
# second divided by the hardware's peak. Datasheet peaks are for dense matrix products at the
# best shape; on a CPU we measure ours with one large matmul, with one thread per rank (the
# ranks below each get one core's thread).

# %%
torch.set_num_threads(1)
peak = matmul_peak(n=512)
copy_src, copy_dst = torch.randn(8 * 2**20), torch.empty(8 * 2**20)  # 32 MB: beyond the caches
copy_dst.copy_(copy_src)  # first touch of the pages
start = time.perf_counter()
for _ in range(5):
    copy_dst.copy_(copy_src)
bandwidth = 5 * 2 * copy_src.numel() * 4 / (time.perf_counter() - start)  # read + write
torch.set_num_threads(2)
print(f"achieved peak, one thread: {peak / 1e9:.1f} GFLOP/s; "
      f"memory bandwidth ~{bandwidth / 1e9:.1f} GB/s")


# %%
def timed_steps(layout, dim_, batch_, steps=4, warmup=2):
    """Runs on each rank: the fastest of ``steps`` training steps of the lesson's model under
    ``layout`` (the minimum: other processes on shared cores only ever add time)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = TinyTransformer(vocab, dim_, 2, 4, context=seq_len)
    world = dist.get_world_size()
    if layout == "ddp":
        m = nn.parallel.DistributedDataParallel(m)
    elif layout == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in m.blocks:
            fully_shard(block)
        fully_shard(m)
    elif layout == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (world,))
        for block in m.blocks:
            parallelize_module(block.mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    xb, yb = token_batch(batch_, seq_len, vocab, seed=0 if layout == "tp" else dist.get_rank())
    times = []
    for _ in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        F.cross_entropy(m(xb).reshape(-1, vocab), yb.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return min(times[warmup:])


def mfu_run(dim_, batch_):
    peak_here = matmul_peak(n=512)  # measured while the other rank measures too: shared cores
    return {"peak": peak_here, "ddp": timed_steps("ddp", dim_, batch_),
            "fsdp": timed_steps("fsdp", dim_, batch_)}


mfu = launch(mfu_run, 128, 8, world_size=2)
flops_per_rank = training_flops(vocab, 128, 2, 4, 8, seq_len)
utilisation = {}
for layout in ("ddp", "fsdp"):
    step = max(r[layout] for r in mfu)  # a step ends when its slowest rank does
    achieved = flops_per_rank / step
    utilisation[layout] = achieved / statistics.mean(r["peak"] for r in mfu)
    print(f"{layout:>4}: step {step * 1e3:6.1f} ms, {achieved / 1e9:5.2f} GFLOP/s per rank, "
          f"MFU {utilisation[layout]:.0%}")
print(f"FSDP's MFU is {utilisation['fsdp'] / utilisation['ddp']:.2f}x DDP's")

# %% [markdown]
# Both are well below the matmul's peak: the model is small, so layer norms, GELU, softmax and
# Python overhead (none of which are FLOPs the model "needs") take much of the step. The two
# layouts do the same FLOPs per rank; FSDP adds its all-gathers, reduce-scatters and hooks to
# the critical path, DDP its one all-reduce, which it overlaps with backward. On two shared
# cores the ratio above moves from run to run by tens of percent: measure several times before
# you believe a difference smaller than that. Which operators are slow, and
# why? The **roofline** ([Williams et al., 2009](https://doi.org/10.1145/1498765.1498785))
# plots each operator's arithmetic intensity (FLOPs per byte it reads and writes) against the
# FLOP/s it reaches: below the ridge, memory bandwidth bounds it; above, compute does.


# %%
def op_point(name, fn, flops, nbytes, repeats=5):
    fn()
    best = min(measure_once(fn) for _ in range(repeats))
    return name, flops / nbytes, flops / best


def measure_once(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


torch.set_num_threads(1)
d, n_tok, t_len = 128, 8 * seq_len, seq_len
a, w_qkv, w_up, w_head = (torch.randn(n_tok, d), torch.randn(d, 3 * d), torch.randn(d, 4 * d),
                          torch.randn(d, vocab))
q = torch.randn(8 * 4, t_len, d // 4)
h4 = torch.randn(n_tok, 4 * d)
big = torch.randn(512, 512)
points = [
    op_point("qkv projection", lambda: a @ w_qkv, 2 * n_tok * d * 3 * d,
             4 * (n_tok * d + d * 3 * d + n_tok * 3 * d)),
    op_point("MLP up", lambda: a @ w_up, 2 * n_tok * d * 4 * d,
             4 * (n_tok * d + 4 * d * d + n_tok * 4 * d)),
    op_point("output layer", lambda: a @ w_head, 2 * n_tok * d * vocab,
             4 * (n_tok * d + d * vocab + n_tok * vocab)),
    op_point("scores Q K^T", lambda: q @ q.transpose(1, 2), 2 * 32 * t_len * t_len * (d // 4),
             4 * (2 * q.numel() + 32 * t_len * t_len)),
    op_point("residual add", lambda: a + a, a.numel(), 4 * 3 * a.numel()),
    op_point("GELU (~8 FLOPs/elt)", lambda: F.gelu(h4), 8 * h4.numel(), 4 * 2 * h4.numel()),
    op_point("512 x 512 matmul", lambda: big @ big, 2 * 512**3, 4 * 3 * 512**2),
]
torch.set_num_threads(2)
fig, ax = plt.subplots(figsize=(7, 4))
intensity = torch.logspace(-2, 3, 100)
ax.loglog(intensity, torch.clamp(intensity * bandwidth, max=peak), "k-",
          label="roofline (measured peak, bandwidth)")
for name, ai, achieved in points:
    ax.loglog(ai, achieved, "o")
    ax.annotate(name, (ai, achieved), fontsize="small", xytext=(4, -10), textcoords="offset points")
ax.set_xlabel("arithmetic intensity (FLOPs / byte)")
ax.set_ylabel("achieved FLOP/s, one thread")
ax.legend(loc="lower right", fontsize="small")
ax.set_title("Roofline of the step's main operators")
fig.savefig(WORK / "roofline.png", dpi=90, bbox_inches="tight")
plt.show()

# %% [markdown]
# The projections sit near the compute roof; the residual add and GELU sit far left, where
# bytes, not FLOPs, set the pace, and far below the peak. They can land on or above the DRAM
# slope because this step's operands (a few hundred kB) fit in the caches, which are faster
# than the 32 MB copy that measured the bandwidth. The GELU's "8 FLOPs per element" is
# a convention of this plot: `FlopCounterMode` gives elementwise ops no FLOPs at all. MFU
# counts only the matrix products for another reason: by definition (PaLM's) it divides the
# FLOPs the *model* needs, from its shapes, by the peak, so that recomputation, padding or a
# slower kernel lower MFU instead of raising the count; elementwise work is not free, it is
# simply not in the numerator.

# %% [markdown]
# ## 3. Bytes per layout
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
def step_traffic(layout: str, model: nn.Module, world_size: int, batch: int,
                 seq_len: int) -> dict[str, int]:
    """Bytes per collective in one steady-state training step of ``model`` (a TinyTransformer)
    under ``layout`` on ``world_size`` ranks, as the recorder counts them on each rank.

    Keys are the recorder's op names ("all_reduce", "broadcast", "all_gather_single",
    "reduce_scatter_single"); entries of zero are left out. Read only the parameters' shapes
    and dtypes. ``batch`` and ``seq_len`` size TP's activations. FSDP pads each parameter's
    first dimension up to a multiple of world_size before sharding it.

    On one rank FSDP and TP send nothing (the dict is empty: a shard is the whole tensor, a
    partial sum is the sum), while DDP and ZeRO-1 still call their collectives on the whole
    buffer. A world_size below 1 or an unknown layout is a ValueError.
    """
    ### BEGIN SOLUTION
    def nbytes(p: torch.Tensor, pad: bool = False) -> int:
        rows = p.shape[0] if p.dim() else 1
        if pad:
            rows = -(-rows // world_size) * world_size  # ceil to a multiple of W
        return rows * (p[0].numel() if p.dim() else 1) * p.element_size()

    if world_size < 1:
        raise ValueError(f"world_size must be at least 1; got {world_size}")
    if layout in ("fsdp", "tp") and world_size == 1:
        return {}  # one rank: FSDP gathers and scatters nothing, TP's partial sums are whole
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
# Your answer against the recorder, on real runs of the four layouts (the third step of each):


# %%
def recorded_traffic(dim_, batch_):
    """Runs on each rank: the recorder's bytes per op in the third step of each layout."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.set_num_threads(1)
    out = {}
    for layout in ("ddp", "zero1", "fsdp", "tp"):
        torch.manual_seed(0)
        m = TinyTransformer(vocab, dim_, 2, 2, context=seq_len)
        if layout in ("ddp", "zero1"):
            m = nn.parallel.DistributedDataParallel(m)
        elif layout == "fsdp":
            for block in m.blocks:
                fully_shard(block)
            fully_shard(m)
        else:
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for block in m.blocks:
                parallelize_module(block.mlp, mesh,
                                   {"0": ColwiseParallel(), "2": RowwiseParallel()})
        opt = (ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW)
               if layout == "zero1" else torch.optim.AdamW(m.parameters()))
        xb, yb = token_batch(batch_, seq_len, vocab, seed=0 if layout == "tp" else dist.get_rank())
        for _ in range(3):
            with trace() as t:
                F.cross_entropy(m(xb).reshape(-1, vocab), yb.reshape(-1)).backward()
                opt.step()
                opt.zero_grad()
        totals = {}
        for e in t.events:
            totals[e.op] = totals.get(e.op, 0) + e.nbytes
        out[layout] = {op: n for op, n in totals.items() if n}
    return out


recorded = launch(recorded_traffic, 30, 4, world_size=2)[0]
model30 = TinyTransformer(vocab, 30, 2, 2, context=seq_len)
agree = all(step_traffic(layout, model30, 2, 4, seq_len) == recorded[layout] for layout in recorded)
for layout, ops in recorded.items():
    print(f"{layout:>5}: {ops}")
print("the recorder agrees with step_traffic on every layout:", agree)

# %% [markdown]
# These are *buffer* sizes. What crosses each rank's link is what Lesson 01's ring sends: an
# all-reduce of `n` bytes sends `2(W-1)/W · n` per rank, an all-gather or reduce-scatter of a
# whole buffer `n` sends `(W-1)/W · n`, and a broadcast tree its `n`. So per rank and step, on
# `W` ranks, with `P` the parameter bytes and `A = batch · seq_len · dim` activation bytes:
#
# | layout | recorder (buffers) | on the wire per rank (ring) |
# | --- | --- | --- |
# | DDP | all-reduce `P` | `2(W-1)/W · P` |
# | ZeRO-1 | all-reduce `P`, broadcast `P` (each parameter from its owner) | `2(W-1)/W · P + P` |
# | FSDP | all-gather `2P`, reduce-scatter `P` (root: `P_root` once) | `3(W-1)/W · P` |
# | TP | all-reduce `2 · layers · A` | `4(W-1)/W · layers · A` |
#
# FSDP moves 1.5x the bytes of DDP to hold `1/W` of the state; TP moves activations, not
# parameters, so it wins when the batch is small and the model wide.

# %%
def wire_bytes(layout, model_, world, batch_, seq):
    """Bytes each rank sends per step under the ring algorithm, from step_traffic's buffers."""
    factor = {"all_reduce": 2 * (world - 1) / world, "all_gather_single": (world - 1) / world,
              "reduce_scatter_single": (world - 1) / world, "broadcast": 1.0}
    return sum(factor[op] * n for op, n in step_traffic(layout, model_, world, batch_, seq).items())


for world in (2, 4, 8):
    row = {layout: wire_bytes(layout, model30, world, 4, seq_len) / 1e3
           for layout in ("ddp", "zero1", "fsdp", "tp")}
    print(f"W={world}: " + ", ".join(f"{k} {v:6.1f} kB" for k, v in row.items()))

# %% [markdown]
# ## 4. A step-time model, calibrated here
#
# A step takes its compute time, FLOPs over achieved FLOP/s, plus the communication that nothing
# hides: with α-β (Lesson 01) each collective costs its latency per ring step plus its wire
# bytes times β. Calibrate on this machine, inside the ranks, with the cores as shared as in
# training: the matmul peak, α and β from all-reduces of two sizes, and one efficiency factor
# (what fraction of the peak an un-wrapped step reaches, at the middle size). Then predict
# DDP, FSDP and TP at three sizes on 2 and 4 ranks, and measure.

# %%
SIZES = (32, 64, 128)


def calibrate_and_time():
    torch.set_num_threads(1)
    world = dist.get_world_size()
    peak_here = matmul_peak(n=384)
    ring_times = {}
    for numel in (256, 2**20):
        buf = torch.ones(numel)
        samples = []
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf)
            samples.append(time.perf_counter() - start)
        ring_times[4 * numel] = statistics.median(samples)
    (n1, t1), (n2, t2) = sorted(ring_times.items())
    beta = (t2 - t1) / ((n2 - n1) * 2 * (world - 1) / world)
    alpha = max((t1 - 2 * (world - 1) / world * n1 * beta) / (2 * (world - 1)), 0.0)
    plain = {}
    for d_ in SIZES:  # one rank's step with no wrapper: what compute alone costs here
        torch.manual_seed(0)
        m = TinyTransformer(vocab, d_, 2, 4, context=seq_len)
        xb, yb = token_batch(4, seq_len, vocab, seed=0)
        samples = []
        for _ in range(4):
            start = time.perf_counter()
            F.cross_entropy(m(xb).reshape(-1, vocab), yb.reshape(-1)).backward()
            samples.append(time.perf_counter() - start)
        plain[d_] = statistics.median(samples[1:])
    measured = {(layout, d_): timed_steps(layout, d_, 4)
                for layout in ("ddp", "fsdp", "tp") for d_ in SIZES}
    return {"peak": peak_here, "alpha": alpha, "beta": beta, "plain": plain, "measured": measured}


def collective_seconds(op, nbytes, world, alpha, beta, calls):
    if op == "all_reduce":
        return calls * 2 * (world - 1) * alpha + 2 * (world - 1) / world * nbytes * beta
    return calls * (world - 1) * alpha + (world - 1) / world * nbytes * beta


def ddp_buckets(model, first=2**20, cap=25 * 2**20):
    """DDP's all-reduces per step: the gradients in reverse order of the parameters, into buckets
    of 1 MiB first (DDP's first bucket is small so that communication starts early), then of
    bucket_cap_mb=25 MiB each; a bucket closes once it holds at least its cap."""
    buckets, size, limit = 0, 0, first
    for p in reversed(list(model.parameters())):
        size += p.numel() * p.element_size()
        if size >= limit:
            buckets, size, limit = buckets + 1, 0, cap
    return buckets + (size > 0)


def predict(layout, d_, world, cal):
    flops = training_flops(vocab, d_, 2, 4, 4, seq_len)
    if layout == "tp":  # the MLPs (16 N D^2 of the 24 N D^2 per layer) are split W ways
        tokens = 4 * seq_len
        flops -= 3 * 2 * 16 * tokens * d_ * d_ * (1 - 1 / world)
    efficiency = training_flops(vocab, 64, 2, 4, 4, seq_len) / (cal["plain"][64] * cal["peak"])
    compute = flops / (efficiency * cal["peak"])
    m = TinyTransformer(vocab, d_, 2, 4, context=seq_len)
    # DDP's buckets; FSDP's units; TP's all-reduces
    calls = {"ddp": ddp_buckets(m), "fsdp": 5 + 3, "tp": 4}[layout]
    comm = sum(collective_seconds(op, n, world, cal["alpha"], cal["beta"], calls)
               for op, n in step_traffic(layout, m, world, 4, seq_len).items())
    return compute + comm


# DDP's buckets, against the assignment DDP itself computes (a private helper of torch's):
for d_ in SIZES:
    m_ = TinyTransformer(vocab, d_, 2, 4, context=seq_len)
    params_ = list(reversed(list(m_.parameters())))
    torch_buckets, _ = dist._compute_bucket_assignment_by_size(
        params_, [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20], [False] * len(params_))
    print(f"dim {d_}: {sum(p.numel() * 4 for p in params_) / 2**20:.2f} MiB of gradients, "
          f"{ddp_buckets(m_)} DDP all-reduce(s) per step "
          f"(torch's assignment: {len(torch_buckets)})")

predicted, measured = [], []
for world in (2, 4):
    cal = launch(calibrate_and_time, world_size=world)
    cal0 = {k: statistics.median(c[k] for c in cal) if k in ("peak", "alpha", "beta") else cal[0][k]
            for k in cal[0]}
    print(f"W={world}: peak {cal0['peak'] / 1e9:.1f} GFLOP/s per rank, "
          f"alpha {cal0['alpha'] * 1e6:.0f} us, beta {1 / cal0['beta'] / 1e9:.2f} GB/s")
    for (layout, d_), _ in cal[0]["measured"].items():
        # the step ends with the slowest rank
        seconds = max(c["measured"][(layout, d_)] for c in cal)
        predicted.append((layout, d_, world, predict(layout, d_, world, cal0)))
        measured.append(seconds)

ratios = [m_ / p[3] for p, m_ in zip(predicted, measured)]
for (layout, d_, world, p), m_ in zip(predicted, measured):
    print(f"{layout:>4} dim {d_:>3} on {world} ranks: predicted {p * 1e3:6.1f} ms, "
          f"measured {m_ * 1e3:6.1f} ms")
fig, ax = plt.subplots(figsize=(5, 4))
for (layout, _, world, p), m_ in zip(predicted, measured):
    ax.scatter(p * 1e3, m_ * 1e3, marker={"ddp": "o", "fsdp": "s", "tp": "^"}[layout],
               color="tab:blue" if world == 2 else "tab:red")
lim = [0, 1.1e3 * max(max(measured), max(p[3] for p in predicted))]
ax.plot(lim, lim, "k--", lw=0.8)
ax.set_xlabel("predicted step (ms)")
ax.set_ylabel("measured step (ms)")
ax.set_title("o DDP, s FSDP, ^ TP; blue 2 ranks, red 4")
fig.savefig(WORK / "predicted_vs_measured.png", dpi=90, bbox_inches="tight")
plt.show()
print(f"measured / predicted: median {statistics.median(ratios):.2f}, "
      f"from {min(ratios):.2f} to {max(ratios):.2f}")

# %% [markdown]
# The spread printed above is the model's honesty on this machine: ranks share two cores, so
# compute does not split cleanly, gloo's latency varies with load, and DTensor and FSDP add
# Python overhead per op that no FLOP count sees. The model is still the right shape: compute
# grows with `D^2`, communication with `P`, and the layout that moves fewer bytes per FLOP
# wins as the world grows.
#
# ### Picking a layout for a 7B model at 8, 64 and 512 GPUs
#
# The same model with **published H100 SXM numbers** (NVIDIA's datasheet: 989 TFLOP/s dense
# BF16, 80 GB HBM3, NVLink 900 GB/s total, so 450 GB/s each way, inside a node of 8; one
# 400 Gb/s NDR InfiniBand port, 50 GB/s, per GPU between nodes, as in a DGX H100). The
# assumptions are ours and stated: 7B parameters in 32 layers of width 4096; BF16 weights and
# gradients with FP32 Adam (16 bytes per parameter, as in ZeRO's paper); a global batch of 2^20
# tokens of 4096 each; 40 % MFU; ring collectives at link speed; gradient communication hidden
# behind the backward (two thirds of the compute) where it fits, while FSDP's forward gathers
# and TP's activations are not hidden. Activations' memory is left out.

# %%
H100 = {"flops": 989e12, "memory": 80e9, "nvlink": 450e9, "ib": 50e9}  # published, per GPU
N7B, LAYERS7B, WIDTH7B, SEQ7B, TOKENS7B, MFU7B = 7e9, 32, 4096, 4096, 2**20, 0.4


def layout_7b(layout, gpus, tp=8):
    dp = gpus // tp if layout == "tp+fsdp" else gpus
    link = H100["nvlink"] if dp <= 8 else H100["ib"]  # data-parallel traffic crosses nodes
    compute = 6 * N7B * TOKENS7B / gpus / (MFU7B * H100["flops"])
    grads = 2 * N7B / (tp if layout == "tp+fsdp" else 1)  # bf16 bytes a rank reduces
    ring = (dp - 1) / dp
    memory = {"ddp": 16 * N7B, "zero1": 4 * N7B + 12 * N7B / dp,
              "fsdp": 16 * N7B / dp, "tp+fsdp": 16 * N7B / gpus}[layout]
    hidden_comm = 2 * ring * grads / link  # the gradients' all-reduce (or reduce-scatter + gather)
    # ZeRO-1's parameter broadcast after the step and FSDP's forward all-gathers wait in line
    exposed = 0.0 if layout == "ddp" else ring * grads / link
    if layout == "tp+fsdp":  # 4 activation all-reduces per layer (2 forward, 2 backward), NVLink
        tokens_per_group = TOKENS7B / dp
        exposed += (4 * LAYERS7B * 2 * (tp - 1) / tp * tokens_per_group * WIDTH7B * 2
                    / H100["nvlink"])
    step = compute + exposed + max(0.0, hidden_comm - 2 / 3 * compute)
    return step, memory, dp


# 256 sequences in a global batch: at most 256 data-parallel replicas
SEQUENCES7B = TOKENS7B // SEQ7B


def why_not(step_memory_dp):
    """Why a layout cannot run, else ''."""
    _, memory, dp = step_memory_dp
    if memory > H100["memory"]:
        return " (does not fit)"
    if dp > SEQUENCES7B:  # each replica needs at least one whole sequence per step
        return f" (the batch's {SEQUENCES7B} sequences do not cover {dp} replicas)"
    return ""


rows = []
for gpus in (8, 64, 512):
    options = {layout: layout_7b(layout, gpus) for layout in ("ddp", "zero1", "fsdp", "tp+fsdp")}
    runs = {k: v for k, v in options.items() if not why_not(v)}
    best = min(runs, key=lambda k: (round(runs[k][0], 1), runs[k][1]))  # a tie: less memory
    print(f"{gpus:>3} GPUs: " + ", ".join(
        f"{k} {v[0]:.2f} s/{v[1] / 1e9:.0f} GB{why_not(v)}" for k, v in options.items())
        + f"  ->  {best}")
    rows.append((gpus, options, best))

# %% [markdown]
# DDP never fits: 16 bytes for each of 7B parameters is 112 GB. At 8 GPUs everything rides
# NVLink and the gradients hide behind a 9 s backward; at 64 they cross InfiniBand, at a ninth
# of NVLink's speed, and still hide. ZeRO-1 and FSDP tie on time there, so FSDP wins on memory,
# and tensor parallelism only adds its activation all-reduces. At 512 GPUs the batch decides:
# 2^20 tokens are 256 sequences of 4096, so 512 data-parallel replicas would get half a
# sequence each. Pure data parallelism (DDP, ZeRO, FSDP) cannot use more GPUs than the batch
# has sequences; to go further, split the work of one sequence: tensor parallelism inside the
# node (8 GPUs share each sequence, leaving 64 replicas), or context parallelism (Lesson 09's
# ring attention), which splits the sequence itself. A larger batch would not converge as well
# per token, so the batch is the fixed quantity. The step is short there too (a fraction of
# a second of compute per GPU), so the gradient traffic would no longer hide behind the
# backward either; tensor parallelism also divides the gradient bytes that cross nodes by 8,
# at the price of activation all-reduces that stay on NVLink.
# This is why large runs use 2-D (and more) meshes: TP within a node, FSDP across nodes.
# Real choices also weigh activation memory, pipeline bubbles and the batch size that
# converges; the [Ultra-Scale Playbook](https://huggingface.co/spaces/nanotron/ultrascale-playbook)
# works through them with measured numbers.

# %% [markdown]
# ## 5. Profiling every rank
#
# [`torch.profiler.profile`](https://pytorch.org/docs/stable/profiler.html) records every aten
# op, autograd node, `record_function` span and, with gloo, a `gloo:<op>` event per collective;
# `export_chrome_trace` writes them as a Chrome/Perfetto trace. `kit.lessons.profiling.profiled`
# does that on each rank (CPU activities; `shapes=`, `memory=`, `stack=` turn on
# `record_shapes`, `profile_memory`, `with_stack`), into this lesson's folder, one
# `rank<r>.json` per rank. Below, four ranks train a small transformer; rank 2 reads its data
# from a slow loader (half a second per batch). The recorder (`launch_traced`) sees the same
# run's collectives; `merge_traces` writes one trace with a row per rank, which Perfetto opens
# (`ui.perfetto.dev`, drag the file in), and `plot_traces` draws it here.

# %%
warm_profiler()  # the first profiler of a process starts Kineto (seconds); forked ranks inherit it
straggler_dir = WORK / "traces_data"
run = launch_traced(straggler_run, 2, "data", 0.5, steps=2, folder=str(straggler_dir), world_size=4)
traces = load_traces(straggler_dir)
merged = merge_traces(traces, run.events, WORK / "merged_trace.json")
fig, ax = plt.subplots(figsize=(10, 3.8))
plot_traces(traces, run.events, ax=ax, title="4 ranks, rank 2's data loader sleeps 0.5 s per batch")
fig.savefig(WORK / "merged_timeline.png", dpi=90, bbox_inches="tight")
plt.show()
print(f"merged trace: {len(merged['traceEvents'])} events in {WORK / 'merged_trace.json'}")

# %% [markdown]
# Reading it: each rank's top lane is its main thread (green: `DataLoader.__next__`; blue:
# forward, backward and the optimizer's ops); below, gloo's own threads (red: `gloo:all_reduce`,
# from when gloo's thread starts the op until it completes); at the bottom, the recorder's
# `all_reduce` calls (orange). Rank 2's green bar is long; the other ranks' red bars are just
# as long, because they are waiting for rank 2 to contribute. **The rank that waits longest in
# a collective is a victim; the straggler is the one that waits least.**
#
# What each rank did, in numbers (ms, from the trace):

# %%
for rank, tr in enumerate(traces):
    spans = [e for e in tr["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    gloo = sum(e["dur"] for e in spans if e["name"].startswith("gloo:")) / 1e3
    data = sum(e["dur"] for e in spans if "DataLoader" in e["name"]) / 1e3
    print(f"rank {rank}: data {data:6.1f} ms, waiting in gloo: {gloo:6.1f} ms")

# %% [markdown]
# ## 6. Finding the straggler
#
# **Task 12.3.** One slow rank makes every other rank wait inside its collectives: their
# `gloo:all_reduce` events grow long while the slow rank's stays short, since by the time it
# arrives everyone is ready. Real runs are messier than one clean injection, and the checks
# make them so:
#
# - **Noise.** Every rank's loader jitters, and the slow rank is late in most steps, not all:
#   in one step it is on time and another rank hiccups. One step's evidence can point at the
#   wrong rank; the sum over every collective of every step does not.
# - **A slow link.** When the transfer itself is slow, every rank's collective stretches, the
#   last one in included, and no rank is late: the answer is `{"rank": None, "phase": "link"}`.
# - **Overlap.** With the first micro-batch's gradients all-reduced while the second is read
#   and computed (as DDP overlaps its buckets with backward), a long wait is harmless if the
#   rank was busy meanwhile. Here one rank launches its first all-reduce late (the others are
#   still busy: nobody idles for it, yet it waits least in total), and another computes while
#   its all-reduce is in flight (the most compute of any rank, none of it late). Totals of
#   waits or of compute blame those two; only when each rank entered and left each
#   collective, against what its main thread was doing then, finds the rank that held the
#   others up.
#
# Read the traces and name the slow rank and its phase, or the link.

# %% tags=["task-12.3"]
def find_straggler(traces: list[dict]) -> dict:
    """The slow rank and what made it slow: {"rank": r, "phase": "data" | "compute" |
    "communication"}, or {"rank": None, "phase": "link"} when no rank is late and the
    collectives themselves take the time (a slow link, or more bytes than it carries fast).

    traces[r] is rank r's Chrome trace as torch.profiler's export_chrome_trace writes it (CPU
    activities), parsed, over one or more steps. Read torch's own events only:
    "enumerate(DataLoader)...__next__" (data), aten:: and autograd ops on the main thread
    (compute), "gloo:" events on gloo's threads (one per collective, from when the rank enters
    it until it leaves; the k-th to end on every rank is the same collective). A delay before a
    send leaves a gap on the slow rank, on no event at all (communication).

    Everyone leaves a collective together, so the rank that waited least in it entered last.
    The slow rank is the one whose late arrivals held the others up longest, summed over every
    collective: a wait during which a rank kept computing or loading held nobody up, and one
    late step is noise. Its phase is what it did, before those late arrivals, for longer than
    the others' median.

    Two traces are enough (the slow rank against the one other). Fewer than two, a rank whose
    trace holds no operator event, or traces without a gloo collective raise a ValueError
    naming the rank count or the rank.
    """
    ### BEGIN SOLUTION
    if len(traces) < 2:
        raise ValueError(f"find_straggler needs the traces of at least 2 ranks, got "
                         f"{len(traces)}: a straggler is slow against the others")

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

    def within(spans: list[tuple[float, float]], a: float, b: float) -> float:
        return union([(max(s, a), min(e, b)) for s, e in spans if s < b and e > a])

    ranks = []
    for rank, rank_trace in enumerate(traces):
        events = [e for e in rank_trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
        ops: dict = {}
        for e in events:
            if e.get("cat") == "cpu_op":
                ops[e["tid"]] = ops.get(e["tid"], 0) + 1
        if not ops:
            raise ValueError(f"rank {rank}'s trace has no operator events: was its profiler "
                             f"started around the step (activities=[ProfilerActivity.CPU])?")
        main = max(ops, key=ops.get)  # the thread that ran the model
        mine = [e for e in events if e["tid"] == main]
        data = [_span(e) for e in mine if "DataLoader" in e["name"] and "__next__" in e["name"]]
        compute = [_span(e) for e in mine if e["name"].startswith(("aten::", "autograd::"))
                   and not _inside(_span(e), data)]
        # in the order they end: two in flight at once may start in either order on gloo's
        # threads, but a collective ends only once every rank started it, so in issue order
        comm = sorted((_span(e) for e in events if e["name"].startswith("gloo:")),
                      key=lambda s: s[1])
        ranks.append({"data": data, "compute": compute, "comm": comm,
                      "start": min(e["ts"] for e in mine)})
    collectives = min(len(r["comm"]) for r in ranks)
    if not collectives:
        raise ValueError(f"rank {min(range(len(ranks)), key=lambda r: len(ranks[r]['comm']))}'s "
                         f"trace has no gloo: collective: nobody waited for anybody")

    def idle(r: dict, a: float, b: float) -> float:  # the main thread neither loads nor computes
        return (b - a) - within(r["data"] + r["compute"], a, b)

    held = [0.0] * len(ranks)  # how long each rank's late arrivals held the others up
    link, late = 0.0, []
    for k in range(collectives):
        waits = [r["comm"][k][1] - r["comm"][k][0] for r in ranks]
        last = min(range(len(ranks)), key=waits.__getitem__)  # entered last: waited least
        # each other rank idles from its entry until the last one's (its leave minus that wait)
        held[last] += statistics.median(
            idle(r, r["comm"][k][0], r["comm"][k][1] - waits[last])
            for i, r in enumerate(ranks) if i != last)
        # and everyone idles while the collective runs with all of them in
        link += statistics.median(idle(r, r["comm"][k][1] - waits[last], r["comm"][k][1])
                                  for r in ranks)
        late.append(last)
    slow = max(range(len(ranks)), key=held.__getitem__)
    if link > held[slow]:
        return {"rank": None, "phase": "link"}

    def phases(r: dict, k: int) -> dict[str, float]:
        """What rank r's main thread did from entering collective k-1 to entering k."""
        a, b = r["comm"][k - 1][0] if k else r["start"], r["comm"][k][0]
        busy = within(r["data"] + r["compute"] + r["comm"], a, b)
        return {"data": within(r["data"], a, b), "compute": within(r["compute"], a, b),
                "communication": (b - a) - busy}  # a gap: on no event, not yet in a collective

    excess = dict.fromkeys(("data", "compute", "communication"), 0.0)
    for k in (k for k in range(collectives) if late[k] == slow):
        mine, others = phases(ranks[slow], k), [phases(r, k) for i, r in enumerate(ranks)
                                                  if i != slow]
        for phase in excess:
            excess[phase] += mine[phase] - statistics.median(o[phase] for o in others)
    return {"rank": slow, "phase": max(excess, key=excess.get)}
    ### END SOLUTION


# %% tags=["check-12.3"]
check("12.3", find_straggler)

# %% [markdown]
# The five scenarios the check runs, on other ranks and steps, and the tempting wrong answers:
# the rank that waits least in total, and the rank that computes most.

# %%
# s: the slow rank's extra time per step (the hiccup: 0.6 of it by default); twice the check's,
# so that a laptop busy with other work still shows each answer
SCENARIO_DELAY = 0.2
SCENARIOS_HERE = {
    "data": dict(slow_rank=1, phase="data", off_step=0, hiccup_rank=2),
    "compute": dict(slow_rank=3, phase="compute", off_step=1, hiccup_rank=0),
    "communication": dict(slow_rank=0, phase="communication", off_step=2, hiccup_rank=1),
    "link": dict(slow_rank=None, phase="link"),
    "overlap": dict(slow_rank=2, phase="compute", off_step=1, hiccup_rank=0, hiccup=1.0,
                    late_launch=1, busy_wait=3),
}


def five_stragglers(folder):
    out = []
    for name, how in SCENARIOS_HERE.items():
        how = dict(how)
        out.append(straggler_run(how.pop("slow_rank"), how.pop("phase"), SCENARIO_DELAY,
                                 steps=3, jitter=0.02, folder=f"{folder}/{name}", **how))
    return out


scenario_dir = WORK / "traces_scenarios"
per_rank = launch(five_stragglers, str(scenario_dir), world_size=4)
found = []
for i, (name, how) in enumerate(SCENARIOS_HERE.items()):
    rank_traces = [r[i] for r in per_rank]
    spans = [[e for e in t["traceEvents"] if e.get("ph") == "X"] for t in rank_traces]
    waits = [sum(e["dur"] for e in s_ if e["name"].startswith("gloo:")) for s_ in spans]
    compute = [sum(e["dur"] for e in s_ if e.get("cat") == "cpu_op" and e["name"] in
                   ("aten::mm", "aten::tanh")) for s_ in spans]
    got = find_straggler(rank_traces)
    found.append(got == {"rank": how["slow_rank"], "phase": how["phase"]})
    print(f"{name:>13}: slow rank {how['slow_rank']}, find_straggler says {got}; least total "
          f"wait: rank {waits.index(min(waits))}, most matmul/tanh time: rank "
          f"{compute.index(max(compute))}")
print("find_straggler finds every scenario's answer:", all(found))
overlap = SCENARIOS_HERE["overlap"]
least_wait, most_compute = waits.index(min(waits)), compute.index(max(compute))
print(f"overlap: the least total wait is the late launcher (rank {overlap['late_launch']}): "
      f"{least_wait == overlap['late_launch']}; the most compute is the busy waiter (rank "
      f"{overlap['busy_wait']}): {most_compute == overlap['busy_wait']}")

# %% [markdown]
# In the overlap scenario both totals point at a decoy (the last line above), so the rule
# "the rank that waits least" names the late launcher. The figure shows why: rank 1's first
# all-reduce (a red bar on a gloo lane) starts late, while the others are still loading
# (green); rank 3 keeps computing (blue) through its wait; rank 2's long forward is what
# everyone's second all-reduce waits for.

# %%
overlap_traces = load_traces(scenario_dir / "overlap")
fig, ax = plt.subplots(figsize=(10, 3.8))
plot_traces(overlap_traces, ax=ax, title="overlap: rank 2 slow, rank 1 launches late, rank 3 "
            "computes while it waits")
fig.savefig(WORK / "overlap_timeline.png", dpi=90, bbox_inches="tight")
plt.show()

# %% [markdown]
# The delays are a tenth of a second per step, five to ten times a profiled step of this model
# on two busy cores, and every comparison is relative: a late arrival counts by how long it
# kept the others idle, and the phase by how far the slow rank exceeds the others' *median*.
# Noise of tens of milliseconds moves neither; on a machine so loaded that sleeps overshoot by
# as much as the delay, no rule can tell a straggler from the load. The "communication"
# straggler is a late send: the rank sleeps on the host before its all-reduce. The "link"
# scenario cannot slow loopback itself, so every all-reduce carries 16 MiB more: in the trace
# a slow link and too many bytes look the same (every rank idles in the collective after the
# last one arrived), and per-rank bus bandwidth (Lesson 01's `bus_bandwidth`) tells them apart.
#
# ## 7. Memory and overlap in a trace
#
# `profile_memory=True` records every allocation and free; with `record_shapes` and
# `with_stack`, the profiler's `export_memory_timeline` sorts the bytes alive into
# parameters, optimizer state, inputs, activations, gradients and temporaries over the step,
# on CPU as on GPU. Torch 2.13 marks it deprecated in favour of the CUDA memory snapshot
# below (the warning is printed). Two AdamW steps of the lesson's model:

# %%
import warnings  # noqa: E402

torch.manual_seed(0)
mem_model = TinyTransformer(vocab, 128, 2, 4, context=seq_len)
mem_opt = torch.optim.AdamW(mem_model.parameters())
xm, ym = token_batch(8, seq_len, vocab, seed=0)
with profiled(WORK / "traces_memory", shapes=True, memory=True, stack=True) as prof:
    for _ in range(2):  # the second step: optimizer state exists from the first
        F.cross_entropy(mem_model(xm).reshape(-1, vocab), ym.reshape(-1)).backward()
        mem_opt.step()
        mem_opt.zero_grad()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    prof.export_memory_timeline(str(WORK / "memory_timeline.json"), device="cpu")
print("torch says:", "; ".join(str(w.message) for w in caught)[:200])
times, sizes = json.loads((WORK / "memory_timeline.json").read_text())
# columns: an unused 0, then torch.profiler._memory_profiler's categories in this order
kinds = ["parameter", "optimizer state", "input", "temporary", "activation", "gradient",
         "autograd detail", "unknown"]
by_kind = torch.tensor(sizes, dtype=torch.float64)[:, 1:] / 2**20
seconds = (torch.tensor(times, dtype=torch.float64) - times[0]) / 1e6
fig, ax = plt.subplots(figsize=(8, 3.5))
ax.stackplot(seconds.numpy(), by_kind.T.numpy(), labels=kinds, step="post")
ax.set_xlabel("time (s)")
ax.set_ylabel("MiB alive")
ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
ax.set_title("two AdamW steps of the lesson's model, profile_memory=True (CPU)")
fig.savefig(WORK / "memory_timeline.png", dpi=90, bbox_inches="tight")
plt.show()
peak = int(by_kind.sum(1).argmax())
param_mib = sum(p.numel() * p.element_size() for p in mem_model.parameters()) / 2**20
print(f"peak {by_kind[peak].sum():.2f} MiB at {seconds[peak]:.3f} s: " + ", ".join(
    f"{k} {v:.2f}" for k, v in zip(kinds, by_kind[peak].tolist()) if v))
print(f"the parameters: {param_mib:.2f} MiB (numel x element_size); optimizer state at the "
      f"peak / parameters: {by_kind[peak][1] / by_kind[peak][0]:.2f}")

# %% [markdown]
# Parameters stay flat; optimizer state appears at the first `step()` (AdamW's two moments
# per parameter: the ratio printed above) and stays; activations rise through forward and fall
# through backward as gradients appear. On a GPU
# the same question has a better tool, the **memory snapshot**
# ([docs](https://pytorch.org/docs/stable/torch_cuda_memory.html)):
# `torch.cuda.memory._record_memory_history()` makes the caching allocator keep a stack trace
# for every allocation, and `torch.cuda.memory._dump_snapshot("snapshot.pickle")` writes its
# state: every *segment* the allocator reserved from CUDA (`cudaMalloc`) and the blocks carved
# out of it, live or free, each with the Python stack that made it. Dragged onto
# [pytorch.org/memory_viz](https://pytorch.org/memory_viz), it shows the bytes alive over time
# and the segments, which is where fragmentation (reserved but unusable memory) shows up. A
# CPU has no caching allocator of this kind, so the cell below records one only where CUDA
# exists and says so otherwise.

# %%
if torch.cuda.is_available():
    gpu_model = TinyTransformer(vocab, 128, 2, 4, context=seq_len).cuda()
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    F.cross_entropy(gpu_model(xm.cuda()).reshape(-1, vocab), ym.cuda().reshape(-1)).backward()
    torch.cuda.memory._dump_snapshot(str(WORK / "snapshot.pickle"))
    torch.cuda.memory._record_memory_history(enabled=None)
    snapshot = torch.cuda.memory._snapshot()
    print(f"{len(snapshot['segments'])} segments reserved, "
          f"{sum(s_['total_size'] for s_ in snapshot['segments']) / 2**20:.1f} MiB; "
          f"snapshot in {WORK / 'snapshot.pickle'}")
else:
    print("no CUDA device here: torch.cuda.memory._record_memory_history needs one (the "
          "snapshot records the CUDA caching allocator)")

# %% [markdown]
# **Overlap, read from the saved traces.** The overlap scenario's traces were written to
# disk (`rank<r>.json`, loaded back above). For each rank: how long a collective was in
# flight (a `gloo:` event on any of gloo's threads), how much of that the main thread spent
# computing or loading (hidden communication) and how much it sat idle (exposed):

# %%
def in_flight(trace):
    """(communication in flight, of it hidden behind the main thread's work) in ms."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    ops = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            ops[e["tid"]] = ops.get(e["tid"], 0) + 1
    main = max(ops, key=ops.get)
    work = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e["tid"] == main and e["name"] != "kit:clock")
    comm = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("gloo:"))

    def merged(spans):
        out = []
        for a, b in spans:
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return out

    comm, work = merged(comm), merged(work)
    total = sum(b - a for a, b in comm)
    hidden = sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in work)
    return total / 1e3, hidden / 1e3


for rank, rank_trace in enumerate(overlap_traces):
    total, hidden = in_flight(rank_trace)
    print(f"rank {rank}: a collective in flight {total:6.1f} ms, {hidden:6.1f} ms of it hidden "
          f"behind compute or loading ({hidden / total:.0%}), {total - hidden:6.1f} ms exposed")

# %% [markdown]
# Read the rows against the roles: the busy waiter (rank 3) hides most of its waits behind
# its own compute; the others hide the first all-reduce behind the second micro-batch and
# expose the second, which waits for rank 2. On
# GPUs with NCCL the same reading works on kernels: collectives run as `ncclDevKernel_*`
# kernels on a communication stream of their own, compute kernels on the default stream, and
# a trace with `ProfilerActivity.CUDA` shows both streams' rows. Communication hidden behind
# compute is the time both rows are busy; HTA's `get_comm_comp_overlap` reports that fraction
# per rank ([HTA docs](https://hta.readthedocs.io/)). `benchmarks/gpu_smoke.py` measures it on
# a GPU machine from the trace of an NCCL all-reduce launched beside a matmul.
#
# ## Running at scale
#
# > On GPUs the same code profiles CUDA kernels too; add the activity and write one trace per
# > rank under `torchrun`:
# >
# > ```python
# > # torchrun --standalone --nproc_per_node=8 train.py
# > from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
# >
# > with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
# >              schedule=schedule(wait=1, warmup=1, active=3),
# >              on_trace_ready=tensorboard_trace_handler(f"traces/rank{rank}")) as prof:
# >     for step, batch in enumerate(loader):
# >         train_step(batch)
# >         prof.step()
# >
# > torch.cuda.memory._record_memory_history(max_entries=100_000)  # the allocator keeps stacks
# > train_step(batch)
# > torch.cuda.memory._dump_snapshot(f"snapshot_rank{rank}.pickle")  # pytorch.org/memory_viz
# > ```
# >
# > - With NCCL, collectives are kernels (`ncclDevKernel_*` or `ncclKernel_*`, by NCCL version)
# >   on their own CUDA stream, so a GPU trace shows how much communication *overlaps*
# >   compute kernel by kernel, where a gloo trace shows it on host threads (section 7). A
# >   single GPU shows none: one rank has nothing to send, and NCCL launches no kernel for it.
# > - The snapshot holds the caching allocator's segments (what it reserved with `cudaMalloc`)
# >   and the blocks in them, each allocation with its stack
# >   ([docs](https://pytorch.org/docs/stable/torch_cuda_memory.html)).
# > - [Holistic Trace Analysis](https://hta.readthedocs.io/) (`pip install HolisticTraceAnalysis`,
# >   [tutorial](https://pytorch.org/tutorials/beginner/hta_intro_tutorial.html)) reads a folder
# >   of such per-rank traces: the GPUs' time split into compute, communication, memory and
# >   idle per rank, the longest kernels, idle time by cause, communication-computation
# >   overlap, kernel launch statistics, queue length per CUDA stream, and trace comparison.
# >   Every one of those is about GPU kernels and streams, which a CPU-only trace lacks.
# > - MFU on GPUs is quoted against the datasheet's dense BF16 peak (989 TFLOP/s on an H100
# >   SXM). PaLM reported 46 % on TPU v4 ([Chowdhery et al., 2022](https://arxiv.org/abs/2204.02311));
# >   Llama 3 405B 38-43 % on H100s ([Dubey et al., 2024](https://arxiv.org/abs/2407.21783)).
# > - `TORCH_NCCL_ENABLE_TIMING=1` and the flight recorder (Lesson 02) time every collective per
# >   rank in production, where a profiler is too heavy to leave on.
#
# ## Summary
#
# - A training step costs 3x its forward's matrix-product FLOPs: `6 N tokens` with Kaplan's
#   `N` (no embeddings), plus attention's `12 · layers · seq_len · dim` per token, plus the
#   output layer's `6 · dim · vocab`. On CPU, `FlopCounterMode` counts
#   fused attention as 0: count under `sdpa_kernel(SDPBackend.MATH)`.
# - MFU compares the model's FLOPs per second with a peak you measured or a datasheet states;
#   the roofline says whether an operator is bound by memory or by compute.
# - Per step and rank (recorder buffers): DDP all-reduces `P`; ZeRO-1 adds a broadcast of `P`;
#   FSDP all-gathers `2P` and reduce-scatters `P`, padded to the world size; TP all-reduces two
#   activations per block. The ring multiplies them by `2(W-1)/W` or `(W-1)/W` on the wire.
# - Step time ≈ compute + exposed communication; calibrate it where you run, then extrapolate
#   with published numbers, and let memory rule out what does not fit.
# - The rank waiting longest in a collective is waiting *for* the straggler. Count each late
#   arrival by the idle time it caused the others, over every collective of every step: a
#   wait spent computing or loading cost nothing, one late step is noise, and when everyone
#   idles after the last arrival the link (or the bytes) is slow, not a rank.
# - `profile_memory=True` and `export_memory_timeline` split the bytes alive by kind on CPU; on
#   GPUs the memory snapshot shows the caching allocator's segments and every allocation's
#   stack, and a CUDA trace shows NCCL's kernels on their own stream beside compute.
#
# **Read more:** [torch.profiler](https://pytorch.org/docs/stable/profiler.html) and its
# [recipe](https://pytorch.org/tutorials/recipes/recipes/profiler_recipe.html),
# [`FlopCounterMode`](https://github.com/pytorch/pytorch/blob/main/torch/utils/flop_counter.py),
# [Perfetto](https://perfetto.dev/docs/), [HTA](https://hta.readthedocs.io/),
# [nccl-tests' performance notes](https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md),
# the [Ultra-Scale Playbook](https://huggingface.co/spaces/nanotron/ultrascale-playbook),
# PaLM's MFU ([Chowdhery et al., 2022](https://arxiv.org/abs/2204.02311)),
# ZeRO ([Rajbhandari et al., 2020](https://arxiv.org/abs/1910.02054)).
#
# ## Exercises (not graded)
#
# 1. Profile with `shapes=True, memory=True` and find the largest allocation of a step in the
#    merged trace. Which op made it?
# 2. Add `"hsdp"` (FSDP within groups of 2, replicated across them, on a 2-D `DeviceMesh`) to
#    `step_traffic` and check it against the recorder on 4 ranks.
# 3. Put a delay in *every* rank's data loader, one rank twice as long as the others. Does
#    `find_straggler` still find it? What does "the others' median" assume?
# 4. Extend the 7B model with activation memory (Lesson 07's count) and find the batch at which
#    FSDP stops fitting on 8 GPUs.
