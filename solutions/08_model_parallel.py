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
# Data parallelism (Lesson 04) and sharding (Lesson 05) keep the model's *computation* whole on
# every rank: each rank runs every layer on its own slice of the batch. That stops working in
# two ways. A single layer's activations or weights can be too big for one device, and data
# parallelism runs out of batch: with a global batch of 1024 sequences, 2048 ranks have less
# than one sequence each. Model parallelism splits the layers themselves: **tensor
# parallelism** splits each matrix multiplication across ranks, **sequence parallelism** splits
# the rest of the layer along the sequence, and **pipeline parallelism** gives each rank a few
# consecutive layers. Large models combine all of them with data parallelism on a
# multi-dimensional mesh of ranks.
#
# **Prerequisites:** Lesson 01 (send/recv, all-reduce, all-gather, reduce-scatter, the
# alpha-beta cost model), Lesson 04 (data parallelism, gradient hooks) and Lesson 05
# (`DeviceMesh`, FSDP2's `fully_shard`); custom `torch.autograd.Function`s.
#
# **You will be able to:**
# - split a linear layer by columns and by rows and write Megatron-LM's conjugate operators
#   f and g as autograd functions ({{task 8.1}});
# - split the LayerNorm region along the sequence, turning each all-reduce into an all-gather
#   and a reduce-scatter ({{task 8.2}});
# - run a GPipe pipeline with send/recv ({{task 8.3}}), write the 1F1B order that
#   bounds its activation memory ({{task 8.4}}) and Megatron-LM's interleaved 1F1B
#   order, which divides the bubble by the number of model chunks per rank ({{task 8.5}});
# - do the same with torch's own `parallelize_module` (DTensor) and
#   `torch.distributed.pipelining`, combine FSDP and tensor parallelism on a 2-D mesh, and
#   choose a layout from its memory and communication.
#
# Replace each `raise NotImplementedError(...)` with your code, run the cell, then the
# `check(...)` cell under it.

# %% tags=["setup"]
import contextlib
import copy
import logging
import tempfile
import time
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from kit import LaunchTimeout, check, launch
from kit.lessons import costmodel
from kit.lessons.parallelism import (
    Model,
    layout_table,
    layout_widget,
    plot_pipeline_run,
    plot_schedule,
    simulate_schedule,
)
from kit.torchrun import torchrun, write_script
from kit.trace import launch_traced, plot_timeline, region, trace

# %% [markdown]
# ## 1. Splitting a matrix multiplication
#
# A transformer's MLP is two linear layers around a GELU: $Y = \mathrm{GELU}(XA)\,B$, with $X$
# of shape (tokens, $h$), $A$ of shape ($h$, $4h$) and $B$ of shape ($4h$, $h$). Shoeybi et al.
# ([Megatron-LM, 2019](https://arxiv.org/abs/1909.08053)) split it over $t$ ranks so that only
# one all-reduce is needed:
#
# - **split $A$ by columns** $A = [A_0, \dots, A_{t-1}]$: rank $r$ computes
#   $\mathrm{GELU}(XA_r)$, its own columns of the hidden activation. GELU acts element by
#   element, so no communication is needed (split by rows instead, and GELU would need the sum
#   first);
# - **split $B$ by rows**: rank $r$ multiplies its columns of the activation by its rows $B_r$,
#   which gives a *partial sum*: $Y = \sum_r \mathrm{GELU}(XA_r)\,B_r$. One all-reduce adds them.
#
# In `nn.Linear`'s terms (`weight` is (out, in), $y = x W^\top + b$): the first layer keeps
# rows of its weight (output features), the second keeps columns (input features). Here is the
# identity in one process, with 4 "ranks":

# %%
torch.manual_seed(0)
up, down = nn.Linear(8, 32), nn.Linear(32, 8)
x = torch.randn(5, 8)
full = down(F.gelu(up(x)))
t = 4
partial_sums = [F.linear(F.gelu(F.linear(x, w1, b1)), w2)  # rank r: its rows of up, columns of down
                for w1, b1, w2 in zip(up.weight.chunk(t, dim=0), up.bias.chunk(t),
                                      down.weight.chunk(t, dim=1))]
print("sum of the 4 partial results + bias equals the MLP:",
      torch.allclose(sum(partial_sums) + down.bias, full, atol=1e-6))

# %% [markdown]
# ### f and g: where the communication goes in backward
#
# Every rank needs the same input $X$ and produces a partial $Y$. Megatron names the two places
# where ranks meet:
#
# - **g**, after the row-parallel layer: forward *all-reduces* the partial sums; backward is the
#   identity (each rank's partial sum contributed to $Y$ with weight 1, so each gets $Y$'s
#   gradient unchanged);
# - **f**, before the column-parallel layer: forward is the identity (everyone already has
#   $X$); backward *all-reduces* the gradient of $X$, because every rank's slice used $X$, and
#   $X$'s gradient is the sum of what each slice sends back.
#
# f and g are *conjugate*: each one's backward is the other's forward. Both are a few lines as a
# [`torch.autograd.Function`](https://pytorch.org/docs/stable/notes/extending.html#extending-torch-autograd)
# with a static `forward(ctx, ...)` and `backward(ctx, grad)`; `backward` returns one gradient
# per input of `forward` (`None` for the group). So a tensor-parallel MLP costs **one
# all-reduce in forward and one in backward**, each of the whole (batch, seq, $h$) activation.

# %%
from kit.lessons import figures

figures.tensor_parallel_mlp(t=2)
plt.show()

# %% [markdown]
# ### Task 8.1: `ColumnParallelLinear` and `RowParallelLinear`
#
# Write the four autograd functions and the two layers, as Megatron-LM's
# [`tensor_parallel/layers.py`](https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/tensor_parallel/layers.py)
# does:
#
# - `ColumnParallelLinear(linear, group=None, gather_output=False)` keeps `weight` (out/t, in)
#   and `bias` (out/t,), rows $r\cdot$out/t to $(r+1)\cdot$out/t of the full layer, $r$ being
#   `dist.get_rank(group)` and $t$ `dist.get_world_size(group)`. Its forward applies f, then
#   `F.linear`; with `gather_output=True` it all-gathers the slices into the full output
#   (`GatherFromTP`, whose backward keeps this rank's slice of the gradient).
# - `RowParallelLinear(linear, group=None, input_is_parallel=True)` keeps `weight` (out, in/t),
#   its columns, and the whole `bias` (out,). Its forward multiplies without the bias, applies g,
#   then adds the bias **once** (added on every rank before the sum, it would count $t$
#   times). With `input_is_parallel=False` it takes the full input and keeps its slice first
#   (`ScatterToTP`, whose backward all-gathers the gradient).
#
# `group=None` means the default group: `dist.all_reduce(x, group=None)` does that for you.
# Copy the slices into new `nn.Parameter`s (detached copies), so that each rank holds
# only its own. The all-reduces work in place: reduce a copy, never a tensor autograd still
# needs.

# %% tags=["task-8.1"]
class CopyToTP(torch.autograd.Function):
    """f: the identity in forward; in backward, the gradient summed over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION
        ctx.group = group
        return x.view_as(x)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        grad = grad.contiguous().clone()  # all_reduce works in place: leave autograd's buffer be
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
        ### END SOLUTION


class ReduceFromTP(torch.autograd.Function):
    """g: in forward, the partial results summed over the group; the identity in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        return grad, None
        ### END SOLUTION


class GatherFromTP(torch.autograd.Function):
    """Forward: all-gather the last dimension's slices; backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        t, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(t, dim=-1)[r].contiguous(), None
        ### END SOLUTION


class ScatterToTP(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dimension; backward: all-gather the slices."""

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION
        ctx.group = group
        t, r = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(t, dim=-1)[r].contiguous()
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=-1), None
        ### END SOLUTION


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split by rows (output features): this rank computes y's slice.

    Args:
        linear: the full nn.Linear(in, out), identical on every rank.
        group: the tensor-parallel process group (None: the default group).
        gather_output: all-gather the output slices into the full (..., out) output.
    Keeps ``weight`` (out/t, in) and ``bias`` (out/t,): this rank's rows. Raises ValueError when
    out_features does not divide by the group size t (every rank gets an equal slice); with
    t = 1 it is the whole layer.
    """

    def __init__(self, linear: nn.Linear, group=None, gather_output: bool = False):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        ### BEGIN SOLUTION
        t, r = dist.get_world_size(group), dist.get_rank(group)
        if linear.out_features % t:
            raise ValueError(f"out_features must divide by the group size "
                             f"({linear.out_features} % {t} != 0)")
        rows = slice(r * linear.out_features // t, (r + 1) * linear.out_features // t)
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach()[rows].clone()))
        ### END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        x = CopyToTP.apply(x, self.group)  # f: the input gradient is summed over ranks
        y = F.linear(x, self.weight, self.bias)  # (..., out/t)
        return GatherFromTP.apply(y, self.group) if self.gather_output else y
        ### END SOLUTION


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split by columns (input features): partial sums, summed over ranks.

    Args:
        linear: the full nn.Linear(in, out), identical on every rank.
        group: the tensor-parallel process group (None: the default group).
        input_is_parallel: the input is already this rank's (..., in/t) slice; if False, the
            layer takes the full (..., in) input and keeps its slice.
    Keeps ``weight`` (out, in/t), this rank's columns, and ``bias`` (out,) whole. Raises
    ValueError when in_features does not divide by the group size t.
    """

    def __init__(self, linear: nn.Linear, group=None, input_is_parallel: bool = True):
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        ### BEGIN SOLUTION
        t, r = dist.get_world_size(group), dist.get_rank(group)
        if linear.in_features % t:
            raise ValueError(f"in_features must divide by the group size "
                             f"({linear.in_features} % {t} != 0)")
        cols = slice(r * linear.in_features // t, (r + 1) * linear.in_features // t)
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        ### END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        if not self.input_is_parallel:
            x = ScatterToTP.apply(x, self.group)
        y = ReduceFromTP.apply(F.linear(x, self.weight), self.group)  # g: sum the partial sums
        return y if self.bias is None else y + self.bias  # the bias once, after the sum
        ### END SOLUTION


# %% tags=["check-8.1"]
check("8.1", ColumnParallelLinear)

# %% [markdown]
# Watch the MLP on 4 ranks with the collective tracer: one forward, one backward, each inside
# a named region. The recorder sees every all-reduce, whatever route it took.

# %%
def tp_mlp_step(batch=4, seq=64, hidden=256, steps=3):
    torch.manual_seed(0)  # the same full layers on every rank
    col = ColumnParallelLinear(nn.Linear(hidden, 4 * hidden))
    row = RowParallelLinear(nn.Linear(4 * hidden, hidden))
    x = torch.randn(batch, seq, hidden, requires_grad=True)  # the same input on every rank
    for step in range(steps):  # the last step is traced; the first ones warm up
        dist.barrier()  # start together, so an all-reduce's time is not a wait for a late peer
        with region("forward") if step == steps - 1 else contextlib.nullcontext():
            y = row(F.gelu(col(x)))
        with region("backward") if step == steps - 1 else contextlib.nullcontext():
            y.square().mean().backward()
    return [tuple(col.weight.shape), tuple(row.weight.shape)]


traced = launch_traced(tp_mlp_step, world_size=4, echo=False)
last_step = [[e for e in lane if e.start >= min(f.start for f in lane if f.op == "forward")]
             for lane in traced.events]  # the barriers and warm-up steps left out
print("each rank's slices (column weight, row weight):", traced[0])
for e in last_step[0]:
    if e.kind == "collective":
        print(f"rank 0: {e.op} of {e.nbytes / 1e3:.0f} kB")
plot_timeline(last_step, title="a tensor-parallel MLP on 4 ranks: one all-reduce each way")
plt.show()

# %% [markdown]
# ### What it costs
#
# A transformer layer has two such blocks, attention and MLP, so tensor parallelism costs **two
# all-reduces in forward and two in backward per layer**, each of the whole activation
# (batch × seq × $h$ values). With Lesson 01's alpha-beta model a ring all-reduce of $n$ bytes on
# $t$ ranks takes $2(t-1)\alpha + 2\frac{t-1}{t} n \beta$. On this machine, the tracer timed
# the MLP's two all-reduces above (Lesson 01's bus bandwidth puts them on the scale of a link):

# %%
for e in last_step[0]:
    if e.op == "all_reduce":  # bus bandwidth: what each rank's link carried per second
        busbw = costmodel.bus_bandwidth("all_reduce", e.nbytes, e.duration, 4)
        print(f"all-reduce of {e.nbytes / 1e3:.0f} kB on 4 ranks: {1e3 * e.duration:.2f} ms, "
              f"bus bandwidth {busbw / 1e9:.2f} GB/s")

# %% [markdown]
# On a laptop the "network" is shared memory and 4 processes share a few cores, so these times
# say more about the machine's load than about the link. Now scale it up: a 70B-class model
# (80 layers, $h$ = 8192) with micro-batches of one 4096-token sequence in bf16 moves
# 4 × 80 × 4096 × 8192 × 2 bytes = 21 GB through all-reduces per micro-batch, inside the
# tensor-parallel group. Price it with the model, $t$ = 8, on NVLink and on a network link.
# A ring all-reduce sends and receives at once, so $\beta$ is the inverse of the bandwidth
# *per direction*: NVIDIA quotes 600 GB/s of total (bidirectional) NVLink bandwidth per A100
# (NVLink 3) and 900 GB/s per H100 (NVLink 4), which is 300 and 450 GB/s each way
# ([A100](https://www.nvidia.com/en-us/data-center/a100/) and
# [H100](https://www.nvidia.com/en-us/data-center/h100/) datasheets):

# %%
for name, (a, b) in {"A100 NVLink 3 (300 GB/s each way)": (5e-6, 1 / 300e9),
                     "H100 NVLink 4 (450 GB/s each way)": (5e-6, 1 / 450e9),
                     "InfiniBand 200 Gb/s (~25 GB/s)": (10e-6, 1 / 25e9)}.items():
    per_layer = 4 * costmodel.ring_all_reduce_time(4096 * 8192 * 2, 8, a, b)  # t = 8
    print(f"{name:34s} 80 layers x 4 all-reduces, t = 8: {80 * per_layer:.2f} s per micro-batch")

# %% [markdown]
# Ten to fifteen times slower across the network, for every micro-batch of every step: that is
# why tensor parallelism stays inside a node.

# %% [markdown]
# ### Attention heads split across ranks
#
# Attention's heads are independent, so they split like the MLP's columns: the query, key and
# value projections are column-parallel (rank $r$ computes heads $r\cdot n_h/t$ to
# $(r+1)\cdot n_h/t$), attention runs on the local heads, and the output projection is
# row-parallel. Forward makes one all-reduce (g). Backward makes one per column layer (each
# has its own f): three here, with separate q, k and v layers; Megatron fuses them into one
# column-parallel QKV layer, laid out so that each rank's rows hold whole heads, and makes one.
# Built from your two layers and compared with the unsharded attention:

# %%
class HeadParallelAttention(nn.Module):
    """Multi-head self-attention with the heads split over the group: (B, T, D) -> (B, T, D)."""

    def __init__(self, q, k, v, proj, heads, group=None):
        super().__init__()
        t = dist.get_world_size(group)
        self.local_heads = heads // t
        self.q, self.k, self.v = (ColumnParallelLinear(m, group) for m in (q, k, v))
        self.proj = RowParallelLinear(proj, group)

    def forward(self, x):
        b, n, _ = x.shape
        # (B, T, D/t) -> (B, local heads, T, head size)
        q, k, v = (m(x).view(b, n, self.local_heads, -1).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, n, -1))


def attention_demo(dim=32, heads=4):
    torch.manual_seed(0)
    q, k, v, proj = (nn.Linear(dim, dim) for _ in range(4))
    x = torch.randn(2, 6, dim)
    attention = HeadParallelAttention(q, k, v, proj, heads)
    with trace() as t:
        ours = attention(x)
    # The reference: all heads in one process.
    qs, ks, vs = (m(x).view(2, 6, heads, -1).transpose(1, 2) for m in (q, k, v))
    ref = proj(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
               .transpose(1, 2).reshape(2, 6, dim))
    return torch.allclose(ours, ref, atol=1e-5), t.collectives()


same, calls = launch(attention_demo, world_size=2)[0]
print("head-parallel attention equals the unsharded one:", same, "| forward collectives:", calls)

# %% [markdown]
# ## 2. Sequence parallelism
#
# Tensor parallelism splits the matrix multiplications, but not what lies between them: the
# LayerNorm, the dropouts and the residual additions run on the whole (batch, seq, $h$)
# activation on every rank, and keep it for backward. Korthikanti et al.
# ([Reducing Activation Recomputation in Large Transformer Models, 2022](https://arxiv.org/abs/2205.05198))
# count a layer's activation memory as $sbh(34 + 5as/h)$ bytes for $s$ tokens, micro-batch
# $b$, $a$ heads in 16-bit precision; tensor parallelism divides only part of it:
# $sbh(10 + 24/t + 5as/(ht))$. The 10 that does not shrink is the LayerNorm and dropout region.
#
# Their fix starts from an identity of Lesson 01: **an all-reduce is a reduce-scatter followed
# by an all-gather**. Place them differently: instead of all-reducing after the row-parallel
# layer, *reduce-scatter along the sequence*, so that each rank ends with the full sum for its
# own $s/t$ tokens; run LayerNorm, dropout and the residual on that shard (they act token by
# token); and *all-gather along the sequence* just before the next column-parallel layer needs
# every token. The bytes on the wire are the same as the all-reduce's, and the LayerNorm region
# now holds $1/t$ of the activation: $sbh(34 + 5as/h)/t$ in all.
#
# Two things change in backward. The all-gather's backward is a reduce-scatter (every rank's
# copy of the gathered sequence got a gradient, and they add up) and the reduce-scatter's
# backward an all-gather. And the parameters used on the shard, the LayerNorm's weight and
# bias and the row layer's bias, are replicated, but each rank's copy only saw its own tokens:
# their gradients must be **summed over the tensor-parallel group**, once per backward pass.
# Task 8.1's f does exactly that when the parameter passes through it.
#
# Korthikanti et al. draw this as their Figure 5: **g** is now an all-gather along the sequence
# in forward and a reduce-scatter in backward, and its conjugate **ḡ** a reduce-scatter in
# forward and an all-gather in backward. On the MLP block:

# %%
figures.sequence_parallel_mlp(t=2)
plt.show()

# %% [markdown]
# ### Task 8.2: `SequenceParallelMLP`
#
# `SequenceParallelMLP(norm, linear1, linear2, group=None)` takes the full modules and keeps
# `self.norm` whole, `self.linear1` an `nn.Linear` with this rank's rows of `linear1` (weight
# (f/t, h), bias (f/t,)) and `self.linear2` an `nn.Linear` with its columns of `linear2`
# (weight (h, f/t)) and the whole bias (h,). Its input and output are this rank's contiguous
# sequence shard, (batch, seq/t, hidden). Forward:
#
# 1. LayerNorm on the shard;
# 2. all-gather along the sequence (dimension 1) into (batch, seq, hidden), rank order;
# 3. `linear1` (column-parallel), GELU, `linear2`'s weight (row-parallel, no bias): a partial sum;
# 4. reduce-scatter along the sequence back to (batch, seq/t, hidden), then `linear2`'s bias.
#
# After `loss.backward()` every `.grad` must be final, also after several backward passes
# accumulate: sum each pass's gradient of the shard-region parameters, not the accumulated
# `.grad`. `dist.all_gather_single(output, input)` and `dist.reduce_scatter_single(output,
# input)` (torch 2.13's names for `all_gather_into_tensor` and `reduce_scatter_tensor`) gather
# and split along dimension 0: move the sequence to the front first (and make it contiguous).
# The checks also run it on one rank, where it must equal the unsharded block, and on an input
# without grad after a forward under `torch.no_grad()`, which must not change the next pass's
# gradients.

# %% tags=["task-8.2"]
def _all_gather_seq(x, group):
    """(b, s/t, h) -> (b, s, h): every rank's sequence shard, in rank order."""
    ### BEGIN SOLUTION
    t = dist.get_world_size(group)
    x = x.transpose(0, 1).contiguous()  # (s/t, b, h): the gathered dimension first
    out = torch.empty((t * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(out, x, group=group)
    return out.transpose(0, 1)  # (b, s, h)
    ### END SOLUTION


def _reduce_scatter_seq(x, group):
    """(b, s, h) -> (b, s/t, h): this rank's sequence shard of the sum over ranks."""
    ### BEGIN SOLUTION
    t = dist.get_world_size(group)
    x = x.transpose(0, 1).contiguous()  # (s, b, h)
    out = torch.empty((x.shape[0] // t, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, x, group=group)
    return out.transpose(0, 1)  # (b, s/t, h)
    ### END SOLUTION


class SequenceAllGather(torch.autograd.Function):
    """Forward: all-gather the sequence shards; backward: reduce-scatter the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class SequenceReduceScatter(torch.autograd.Function):
    """Forward: reduce-scatter the partial sums; backward: all-gather the gradient shards."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


class SumGradOverTP(torch.autograd.Function):
    """The identity in forward; backward sums this pass's gradient over the group (Task 8.1's f)."""

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION
        ctx.group = group
        return x.view_as(x)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
        ### END SOLUTION


class SequenceParallelMLP(nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear on a sequence shard: (b, s/t, h) -> (b, s/t, h).

    Args:
        norm: the full nn.LayerNorm(h); kept whole on every rank as ``self.norm``.
        linear1: the full nn.Linear(h, f); ``self.linear1`` keeps rows: weight (f/t, h), bias
            (f/t,).
        linear2: the full nn.Linear(f, h); ``self.linear2`` keeps columns: weight (h, f/t) and the
            whole bias (h,).
        group: the tensor-parallel process group (None: the default group).
    After backward every .grad is final: the gradients of the parameters used on the sequence
    shard (the LayerNorm's, linear2's bias) are summed over the group.

    Edges: on one rank (world size 1) the block is the unsharded block. An input shard that does
    not require grad, and a forward under torch.no_grad() (inference), work as usual and leave the
    gradients of later passes unchanged. Every rank's shard has the same length (seq divides by t).
    """

    def __init__(self, norm: nn.LayerNorm, linear1: nn.Linear, linear2: nn.Linear, group=None):
        super().__init__()
        self.group = group
        self.norm = norm
        ### BEGIN SOLUTION
        t, r = dist.get_world_size(group), dist.get_rank(group)
        f = linear1.out_features
        if f % t:
            raise ValueError(f"linear1.out_features must divide by the group size ({f} % {t} != 0)")
        cols = slice(r * f // t, (r + 1) * f // t)
        self.linear1 = nn.Linear(linear1.in_features, f // t)
        self.linear2 = nn.Linear(f // t, linear2.out_features)
        with torch.no_grad():
            self.linear1.weight.copy_(linear1.weight[cols])
            self.linear1.bias.copy_(linear1.bias[cols])
            self.linear2.weight.copy_(linear2.weight[:, cols])
            self.linear2.bias.copy_(linear2.bias)
        ### END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        weight = SumGradOverTP.apply(self.norm.weight, self.group)
        bias = SumGradOverTP.apply(self.norm.bias, self.group)
        h = F.layer_norm(x, self.norm.normalized_shape, weight, bias, self.norm.eps)  # (b, s/t, h)
        h = SequenceAllGather.apply(h, self.group)  # (b, s, h)
        h = F.gelu(self.linear1(h))  # (b, s, f/t)
        h = F.linear(h, self.linear2.weight)  # (b, s, h): a partial sum
        bias2 = SumGradOverTP.apply(self.linear2.bias, self.group)  # used on a shard too
        return SequenceReduceScatter.apply(h, self.group) + bias2  # (b, s/t, h)
        ### END SOLUTION


# %% tags=["check-8.2"]
check("8.2", SequenceParallelMLP)

# %% [markdown]
# Now measure what each version keeps for backward. `torch.autograd.graph.saved_tensors_hooks`
# calls a function on every tensor autograd saves; counting their bytes on each rank of a
# 4-rank group (parameters excluded) gives the activation memory of one block, for the
# unsharded block, the tensor-parallel one (Task 8.1) and the sequence-parallel one (Task 8.2):

# %%
def saved_bytes(kind, batch=2, seq=64, hidden=64):
    torch.manual_seed(0)
    norm, lin1 = nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden)
    lin2 = nn.Linear(4 * hidden, hidden)
    t, r = dist.get_world_size(), dist.get_rank()
    x = torch.randn(batch, seq, hidden)
    if kind == "unsharded":
        block = nn.Sequential(norm, lin1, nn.GELU(), lin2)
    elif kind == "tensor parallel":
        block = nn.Sequential(norm, ColumnParallelLinear(lin1), nn.GELU(), RowParallelLinear(lin2))
    else:
        block = SequenceParallelMLP(norm, lin1, lin2)
        x = x.chunk(t, dim=1)[r]  # this rank's tokens
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    total = 0

    def pack(tensor):  # called on every tensor autograd saves for backward
        nonlocal total
        if tensor.untyped_storage().data_ptr() not in weights:  # an activation, not a weight
            total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        block(x.requires_grad_())
    return total


kinds = ["unsharded", "tensor parallel", "sequence parallel"]
kept = dict(zip(kinds, launch(lambda: [saved_bytes(k) / 1e3 for k in kinds], world_size=4)[0]))
plt.figure(figsize=(6, 2))
plt.barh(kinds, list(kept.values()), color=["tab:gray", "tab:blue", "tab:green"])
plt.gca().invert_yaxis()
plt.xlabel("activations saved for backward per rank (kB), 4 ranks")
plt.show()
for k, v in kept.items():
    print(f"{k:18s} {v:7.1f} kB")

# %% [markdown]
# Tensor parallelism divides the MLP's inner activations (the $4h$-wide ones) by $t$ but keeps
# the LayerNorm's input and the column layer's input whole on every rank; sequence parallelism
# shrinks the LayerNorm region too. What remains whole is the all-gathered input of `linear1`,
# which autograd keeps for the weight gradient (Megatron also shards that one: it saves the
# shard and all-gathers it again in backward).

# %% [markdown]
# ## 3. The same with DTensor: `parallelize_module`
#
# torch ships tensor and sequence parallelism as
# [`torch.distributed.tensor.parallel`](https://pytorch.org/docs/stable/distributed.tensor.parallel.html).
# A [`DTensor`](https://pytorch.org/docs/stable/distributed.tensor.html) is a tensor laid out
# over a `DeviceMesh` with a *placement* per mesh dimension: `Shard(d)` (split along dimension
# d), `Replicate()` or `Partial()` (a pending sum, what your row layer holds before g).
# `parallelize_module(module, mesh, plan)` turns submodules' weights into DTensors following a
# plan written as data, a dict from submodule name to style:
#
# - `ColwiseParallel()`: the weight is `Shard(0)` of `weight` (out, in), your rows; the input
#   arrives replicated (f) and the output stays sharded.
# - `RowwiseParallel()`: `Shard(1)`, your columns; the output is `Partial`, all-reduced to
#   replicated (g).
# - `SequenceParallel()`: `Replicate()` (a LayerNorm's weight); it runs on `Shard(1)` of the
#   input, the sequence shard.
#
# It runs on CPU ranks with gloo: the mesh is `init_device_mesh("cpu", (t,))`. Here it is next
# to your layers, on the same weights:

# %%
def dtensor_mlp(hidden=64):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
    ours = nn.Sequential(ColumnParallelLinear(mlp[0]), nn.GELU(), RowParallelLinear(mlp[2]))
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(2, 16, hidden)
    with trace() as t:
        y = mlp(x)
        y.square().mean().backward()
    w = mlp[0].weight
    return {"weight": f"{type(w).__name__} {w.placements}, local shape {tuple(w.to_local().shape)}",
            "same output as yours": torch.allclose(y, ours(x), atol=1e-5),
            "collectives": [(e.op, e.nbytes) for e in t.events if e.kind == "collective"]}


import torch.distributed.tensor.parallel  # noqa: E402, F401 - imported once, before the ranks fork

for key, value in launch(dtensor_mlp, world_size=2)[0].items():
    print(f"{key}: {value}")

# %% [markdown]
# ### The plan's result, cell by cell: persistent ranks
#
# `%distributed start 2` starts ranks that keep their variables and process group between
# cells until `%distributed stop` (Lesson 04). Apply the plan in one cell and look at every
# parameter it placed:

# %%
# %load_ext kit
# %distributed start 2

# %%
# %%distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
parallelize_module(mlp, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)),
                   {"0": ColwiseParallel(), "2": RowwiseParallel()})
for name, p in mlp.named_parameters():
    print(f"{name}: {tuple(p.shape)} {p.placements}, this rank holds {tuple(p.to_local().shape)}")

# %% [markdown]
# The column layer's weight and bias are split by output feature (`Shard(0)`); the row
# layer's weight by input feature (`Shard(1)`), and its bias is replicated: it is added once,
# after the all-reduce. Now run the same input through it, stopping in the middle:

# %%
# %%distributed
x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))  # the same x everywhere
hidden = mlp[1](mlp[0](x))
y = mlp(x)
print(f"hidden {type(hidden).__name__} {tuple(hidden.shape)}; output {type(y).__name__} "
      f"{tuple(y.shape)}, sum {y.sum().item():.5f}")

# %% [markdown]
# The hidden activation is this rank's half of the 256 features, a plain tensor (the styles
# return local tensors by default, `use_local_output=True`). The output is whole and the same
# on both ranks; its type, `AsyncCollectiveTensor`, says it came from a functional all-reduce
# that is waited on where the tensor is first used, not where it was issued.

# %%
# %distributed stop

# %% [markdown]
# The same two all-reduces, issued by DTensor as functional collectives (the recorder sees them
# too). Sequence parallelism is a different plan on the same modules: the LayerNorm gets
# `SequenceParallel()`, the column layer is told its input arrives sharded along the sequence
# (`input_layouts=Shard(1)`) and the row layer to leave its output that way
# (`output_layouts=Shard(1)`):

# %%
def dtensor_sequence_parallel(hidden=64, seq=16):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    t, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (t,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    block = nn.ModuleDict({"norm": nn.LayerNorm(hidden), "up": nn.Linear(hidden, 4 * hidden),
                           "down": nn.Linear(4 * hidden, hidden)})
    # our block gets its own copy of the norm
    ours = SequenceParallelMLP(copy.deepcopy(block["norm"]), block["up"], block["down"])
    parallelize_module(block, mesh, {"norm": SequenceParallel(),
                                     "up": ColwiseParallel(input_layouts=Shard(1)),
                                     "down": RowwiseParallel(output_layouts=Shard(1))})
    x = torch.randn(2, seq, hidden).chunk(t, dim=1)[r]  # this rank's tokens
    with trace() as tr:
        y = block["down"](F.gelu(block["up"](block["norm"](x))))
    return {"output shard": tuple(y.shape), "same as yours": torch.allclose(y, ours(x), atol=1e-5),
            "forward collectives": [e.op for e in tr.events if e.kind == "collective"]}


for key, value in launch(dtensor_sequence_parallel, world_size=2)[0].items():
    print(f"{key}: {value}")

# %% [markdown]
# ### A 2-D mesh: FSDP × tensor parallelism
#
# On 4 ranks, arrange a (2, 2) mesh: the inner dimension `"tp"` (ranks {0, 1} and {2, 3}) runs
# tensor parallelism, the outer `"dp"` (ranks {0, 2} and {1, 3}) runs FSDP2 (Lesson 05) over
# the tensor-parallel shards, each `"dp"` row on its own half of the batch. torchtitan applies
# them in this order: `parallelize_module` on `mesh["tp"]` first, then `fully_shard` on
# `mesh["dp"]`. Each weight ends up a DTensor sharded over both dimensions, a quarter per rank:

# %%
def fsdp_times_tp(hidden=32):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)  # a gather-order note
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # about in-place ops on views
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
    reference = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(),
                              nn.Linear(4 * hidden, hidden))
    reference.load_state_dict(model.state_dict())
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    x = torch.randn(8, hidden, generator=torch.Generator().manual_seed(1))
    dp_rank = mesh["dp"].get_local_rank()
    with trace() as t:
        model(x.chunk(2)[dp_rank]).square().mean().backward()  # this dp row's half of the batch
    reference(x).square().mean().backward()  # the whole batch, one process
    w = model[0].weight
    return {"placements": str(w.placements), "local shape": tuple(w.to_local().shape),
            "full shape": tuple(w.shape),
            "gradient equals one process": torch.allclose(w.grad.full_tensor(),
                                                          reference[0].weight.grad, atol=1e-5),
            "collectives": sorted({e.op for e in t.events if e.kind == "collective"})}


import torch.distributed.fsdp  # noqa: E402, F401

for key, value in launch(fsdp_times_tp, world_size=4)[0].items():
    print(f"{key}: {value}")

# %% [markdown]
# FSDP all-gathers each tensor-parallel shard over `"dp"` before using it and reduce-scatters
# its gradient after; tensor parallelism all-reduces activations over `"tp"`. The two groups
# never mix, which is what lets each live on the network that suits it (section 6).

# %% [markdown]
# ## 4. Pipeline parallelism
#
# Give each of $p$ ranks a *stage*: a run of consecutive layers. Rank 0 runs the first stage
# and sends its output to rank 1, which runs the next, and so on; backward runs the other way,
# each stage sending the gradient of its input back. The messages are one activation per stage
# boundary, far smaller than tensor parallelism's all-reduces inside every layer, which is why
# pipelines cross the slow links between nodes.
#
# Run naively, one batch at a time, only one stage works while the others wait. GPipe
# ([Huang et al., 2019](https://arxiv.org/abs/1811.06965)) splits the batch into $m$
# **micro-batches**: stage 0 starts micro-batch 1 while stage 1 works on micro-batch 0. All
# forwards flow down the pipeline, then all backwards flow up; the gradients of the $m$
# micro-batches accumulate in `.grad`, and one optimizer step follows, exactly as for one big
# batch if each micro-batch's mean loss is divided by $m$. The idle time at the start and end,
# the **bubble**, is a fraction
#
# $$\frac{p-1}{m+p-1}$$
#
# of each stage's time: $p - 1$ steps of filling and draining, out of $m + p - 1$.
#
# ### Task 8.3: `gpipe`
#
# Write `gpipe(stage, microbatches, targets, loss_fn)`, run on every rank, rank $r$ holding
# stage $r$ of $p$ = `dist.get_world_size()`:
#
# 1. **forward**, for each micro-batch $i$ in order: rank 0 takes `microbatches[i]`; the others
#    `dist.recv` it from rank $r-1$ into a new tensor shaped like `microbatches[i]` (every stage
#    keeps the shape) and mark it `requires_grad_()` so that its gradient can be sent back; run
#    the stage; unless last, `dist.send` the detached output to rank $r+1$; keep input and
#    output;
# 2. **backward**, micro-batches in reverse order: the last stage calls `backward()` on
#    `loss_fn(output, target) / m`; the others receive the output's gradient from rank $r+1$ and
#    call `output.backward(grad)`; every stage but the first sends its input's `.grad` to rank
#    $r-1$;
# 3. return the mean of the micro-batch losses (a 0-d tensor) on the last stage, `None` elsewhere.
#
# That is $2m(p-1)$ messages in all, and nothing else: the checks count them. One stage ($p = 1$)
# and fewer micro-batches than stages are pipelines too; micro-batches of different sizes are a
# `ValueError` (the mean of their means would not be the batch's mean loss).

# %% tags=["task-8.3"]
def gpipe(stage: nn.Module, microbatches: list, targets: list, loss_fn):
    """One GPipe step on this rank's stage: all forwards, then all backwards in reverse.

    Rank r holds stage r of p = dist.get_world_size(). Every stage maps a (b, h) micro-batch to
    (b, h), so activations and their gradients have the micro-batches' shape.

    Args:
        stage: this rank's nn.Module; its .grad accumulate the whole batch's gradient.
        microbatches: the m input micro-batches (used on rank 0; their shapes everywhere).
        targets: the m targets (used on the last rank).
        loss_fn: loss_fn(output, target) -> a scalar mean loss of one micro-batch.
    Returns the mean of the m micro-batch losses on the last rank, None elsewhere.

    Edges: one stage (p = 1) is first and last at once and sends nothing; one micro-batch, or
    fewer micro-batches than stages, is a pipeline too. The micro-batches must all have the same
    size (only then is the mean of their mean losses the whole batch's): micro-batches of
    different sizes are a ValueError, raised on every rank before anything is sent.
    """
    ### BEGIN SOLUTION
    sizes = sorted({len(x) for x in microbatches})
    if len(sizes) > 1:
        raise ValueError(f"the micro-batches must all have the same size, got sizes {sizes}: "
                         "split a batch that divides by the number of micro-batches")
    rank, p = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == p - 1
    m = len(microbatches)
    inputs, outputs = [], []
    for i in range(m):  # forward of every micro-batch
        if first:
            x = microbatches[i]
        else:
            x = torch.empty_like(microbatches[i])
            dist.recv(x, src=rank - 1)
            x.requires_grad_()
        y = stage(x)
        if not last:
            dist.send(y.detach(), dst=rank + 1)
        inputs.append(x)
        outputs.append(y)
    total = torch.zeros(())
    for i in reversed(range(m)):  # backward, last micro-batch first
        if last:
            loss = loss_fn(outputs[i], targets[i]) / m  # the mean over micro-batches
            loss.backward()
            total += loss.detach()
        else:
            grad = torch.empty_like(outputs[i])
            dist.recv(grad, src=rank + 1)
            outputs[i].backward(grad)
        if not first:
            dist.send(inputs[i].grad, dst=rank - 1)
    return total if last else None
    ### END SOLUTION


# %% tags=["check-8.3"]
check("8.3", gpipe)

# %% [markdown]
# Draw the GPipe schedule for 4 stages and 8 micro-batches, with a backward taking twice a
# forward (it computes two matrix products for each of forward's one). `plot_schedule` plays
# per-stage orders on an ideal pipeline where messages are free:

# %%
def gpipe_order(m):
    return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]


fig, ax = plt.subplots(figsize=(9, 2.2))
plot_schedule([gpipe_order(8) for _ in range(4)], ax=ax, title="GPipe, 4 stages, 8 micro-batches")
plt.show()
ms = range(1, 33)
plt.figure(figsize=(5, 2.5))
for p in (2, 4, 8):
    plt.plot(ms, [simulate_schedule([gpipe_order(m)] * p).bubble for m in ms], "o", ms=3,
             label=f"p = {p}, simulated")
    plt.plot(ms, [(p - 1) / (m + p - 1) for m in ms], "k-", lw=0.6)
plt.xlabel("micro-batches m")
plt.ylabel("bubble fraction")
plt.legend(fontsize="small")
plt.title("(p − 1) / (m + p − 1): lines; the simulation: dots")
plt.show()

# %% [markdown]
# More micro-batches shrink the bubble, but look at the peak: every stage holds the activations
# of all $m$ micro-batches at once, between its forward and its backward. Memory grows with
# $m$, the very thing that shrinks the bubble.
#
# ### 1F1B: the same bubble, $p$ activations at most
#
# PipeDream-Flush (Narayanan et al., [*Memory-Efficient Pipeline-Parallel DNN Training*, ICML
# 2021](https://arxiv.org/abs/2006.09503)), better known as **1F1B**, reorders each stage's
# work. A stage runs a few **warm-up** forwards, just enough to keep the stages below it busy;
# then, in **steady state**, one forward and one backward in turn, each backward freeing the
# activations of the oldest micro-batch; then a **cool-down** of the remaining backwards. The
# bubble is the same as GPipe's, but stage $s$ never holds more than $p - s$ micro-batches'
# activations, however large $m$ is.
#
# ### Task 8.4: `one_f_one_b`
#
# Write `one_f_one_b(stage, num_stages, num_microbatches)`: the list of `("F", i)` and
# `("B", i)` steps that stage `stage` runs. Work out how many warm-up forwards each stage needs
# from what the checks ask of your orders, over many pipeline shapes:
#
# - **valid**: each micro-batch goes forward once, then backward once; forwards in micro-batch
#   order and backwards in micro-batch order (a neighbour receives messages in the order they
#   were sent);
# - **as fast as GPipe**: all stages' orders, played together by `simulate_schedule` (a forward
#   takes 1, a backward 2), never deadlock and finish in GPipe's time, which no order can beat:
#   the last stage starts after $p - 1$ forwards, and its last backward still has to cross
#   $p - 1$ stages;
# - **bounded**: stage $s$ never holds more than $p - s$ micro-batches forwarded but not yet
#   backwarded (the checks count them, and measure the bytes while your order runs);
# - played on real ranks by the grader's executor, the whole batch's gradients.

# %% tags=["task-8.4"]
def one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The 1F1B order of ("F", i) and ("B", i) steps for stage `stage` of `num_stages`.

    Every micro-batch 0..num_microbatches-1 goes forward once, then backward once; forwards in
    micro-batch order, backwards in micro-batch order. All stages' orders, run together, finish
    in GPipe's time, and stage s never holds more than num_stages - s micro-batches forwarded but
    not yet backwarded.
    """
    ### BEGIN SOLUTION
    warmup = min(num_stages - stage - 1, num_microbatches)  # fills the stages below this one
    order = [("F", i) for i in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(num_microbatches - warmup, num_microbatches)]
    return order
    ### END SOLUTION


# %% tags=["check-8.4"]
check("8.4", one_f_one_b)

# %% [markdown]
# Side by side with GPipe, 4 stages and 8 micro-batches: the same length, far fewer activations
# held.

# %%
fig, axes = plt.subplots(2, 1, figsize=(9, 4.2), sharex=True)
plot_schedule([gpipe_order(8) for _ in range(4)], ax=axes[0])
plot_schedule([one_f_one_b(s, 4, 8) for s in range(4)], ax=axes[1])
axes[0].set_title("GPipe: " + axes[0].get_title())
axes[1].set_title("1F1B: " + axes[1].get_title())
plt.tight_layout()
plt.show()

# %% [markdown]
# ### The schedules on real ranks
#
# Now run both on 4 ranks, each stage a small MLP, and draw them from the collective tracer's
# events: a region per forward (`F i`, blue) and backward (`B i`, green) at the time it really
# ran, an arrow per message from send to receive. The same runner plays any order; sends are
# non-blocking (`dist.isend`), as in `torch.distributed.pipelining`, so that a stage never
# waits for its neighbour to be ready to receive.

# %%
def run_pipeline(orders, m, hidden=256, micro_batch=32):
    """Rank r plays orders[r]; a region per step's compute; returns the most activations held."""
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    stage = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(micro_batch, hidden, generator=gen) for _ in range(m)]
    held, peak, sends = {}, 0, []
    for op, i in orders[rank]:
        if op == "F":
            x = xs[i]
            if rank > 0:  # wait for the previous stage: outside the region, so it shows as a gap
                x = torch.empty_like(xs[i])
                dist.recv(x, src=rank - 1)
                x.requires_grad_()
            with region(f"F {i}"):
                y = stage(x)
            held[i] = (x, y)
            if rank < p - 1:
                sends.append(dist.isend(y.detach(), dst=rank + 1))
        else:
            x, y = held.pop(i)
            grad = None
            if rank < p - 1:
                grad = torch.empty_like(y)
                dist.recv(grad, src=rank + 1)
            with region(f"B {i}"):
                if grad is None:
                    (y.square().mean() / m).backward()
                else:
                    y.backward(grad)
            if rank > 0:
                sends.append(dist.isend(x.grad, dst=rank - 1))
        peak = max(peak, len(held))
    for work in sends:
        work.wait()
    return peak


fig, axes = plt.subplots(2, 1, figsize=(9, 4.5))
for ax, (name, orders) in zip(axes, {"GPipe": [gpipe_order(8)] * 4,
                                     "1F1B": [one_f_one_b(s, 4, 8) for s in range(4)]}.items()):
    run = launch_traced(run_pipeline, orders, 8, world_size=4, echo=False)
    print(f"{name}: activations held at most {list(run)} per stage")
    plot_pipeline_run(run.events, ax=ax, title=f"{name} on 4 ranks, 8 micro-batches: "
                                               f"activations held at most {list(run)}")
plt.tight_layout()
plt.show()

# %% [markdown]
# Orders must agree between neighbours. Give stage 0 no warm-up (a backward right after each
# forward) while stage 1 runs two forwards first: stage 0 waits for micro-batch 0's gradient,
# stage 1 for micro-batch 1's activation, and neither ever comes. The simulation finds it
# without running anything; on real ranks it is a hang, which the launcher ends at its
# timeout and explains:

# %%
bad_orders = [[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 0), ("F", 1), ("B", 0), ("B", 1)]]
try:
    simulate_schedule(bad_orders)
except ValueError as e:
    print("simulate_schedule:", e)
try:
    launch(run_pipeline, bad_orders, 2, world_size=2, timeout=5)
except LaunchTimeout as e:
    print("\n".join(str(e).splitlines()[:4]))

# %% [markdown]
# On 4 processes sharing a laptop's few cores the boxes are less regular than in the ideal
# picture (a stage waits for a core as much as for its neighbour), but the shape is there:
# GPipe's forwards run down the diagonal and its backwards back up, while 1F1B alternates
# forwards and backwards and holds at most $p - s$ activations on stage $s$.
#
# ### `torch.distributed.pipelining`
#
# torch's [pipelining package](https://pytorch.org/docs/stable/distributed.pipelining.html)
# wraps a stage's module in `PipelineStage(module, stage_index, num_stages, device)` and runs a
# schedule, `ScheduleGPipe` or `Schedule1F1B(stage, n_microbatches, loss_fn)`, over it: rank 0
# calls `schedule.step(x)` with the whole batch (it splits it into micro-batches), the last rank
# `schedule.step(target=y, losses=losses)`, the others `schedule.step()`. It divides the
# accumulated gradients by $m$ (`scale_grads=True`), the same as your $1/m$ on each loss, and
# `Schedule1F1B` requires $m \ge p$. The gradients are your `gpipe`'s:

# %%
def torch_pipeline(schedule_name, m=4, hidden=6):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(p)]
    mine = stages[rank]
    theirs = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
    theirs.load_state_dict(mine.state_dict())
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(2 * m, hidden, generator=gen), torch.randn(2 * m, hidden, generator=gen)
    schedule_class = {"ScheduleGPipe": ScheduleGPipe, "Schedule1F1B": Schedule1F1B}[schedule_name]
    schedule = schedule_class(PipelineStage(theirs, rank, p, torch.device("cpu")),
                              n_microbatches=m, loss_fn=F.mse_loss)
    losses = []
    with trace() as t:
        if rank == 0:
            schedule.step(x)
        elif rank == p - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
    gpipe(mine, list(x.chunk(m)), list(y.chunk(m)), F.mse_loss)  # the same step, your way
    same = all(torch.allclose(a.grad, b.grad, atol=1e-6)
               for a, b in zip(mine.parameters(), theirs.parameters()))
    return same, len([e for e in t.events if e.kind == "p2p"])


import torch.distributed.pipelining  # noqa: E402, F401 - imported once, before the ranks fork

for name in ("ScheduleGPipe", "Schedule1F1B"):
    results = launch(torch_pipeline, name, world_size=4)
    print(f"{name}: gradients equal gpipe's on every stage: {all(r[0] for r in results)}; "
          f"point-to-point messages on each rank: {[r[1] for r in results]}")

# %% [markdown]
# torch's stages also exchange a few small messages before the first step to agree on the shapes
# of what they send (your `gpipe` knew them from the micro-batches).
#
# ### Interleaved 1F1B: a smaller bubble for more messages
#
# Narayanan et al. ([Megatron-LM, SC21](https://arxiv.org/abs/2104.04473), section 2.2.2) cut
# the bubble further by giving each rank $v$ **model chunks** instead of one block of
# consecutive layers: chunk $c$ of stage $s$ is **virtual stage** $c \cdot p + s$ of a pipeline
# of $v \cdot p$ virtual stages. A micro-batch's forward goes round the ranks $v$ times (stage
# 0's chunk 0, stage 1's chunk 0, ..., stage $p-1$'s chunk 0, then stage 0's chunk 1, ...) and
# its backward comes back the same way. Each chunk is $1/v$ of a stage's work, so the pipeline
# fills and drains in steps $v$ times shorter:
#
# ```
#   p = 2, v = 2: 4 virtual stages     rank 0: [chunk 0 = layers 0-1] [chunk 1 = layers 4-5]
#                                      rank 1: [chunk 0 = layers 2-3] [chunk 1 = layers 6-7]
#   forward:  rank 0 -> rank 1 -> rank 0 -> rank 1      backward: the other way
# ```
#
# With a unit time for every chunk's forward and backward, each stage has $2vm$ units of work,
# and the bubble falls from 1F1B's $\frac{p-1}{m}$ of that work to $\frac{p-1}{v \cdot m}$, for
# $v$ times the messages. Megatron-LM asks for $m$ to be a multiple of $p$: micro-batches go round
# in groups of $p$. torch's `ScheduleInterleaved1F1B` relaxes that: it makes
# $\max(1, \lfloor m/p \rfloor)$ rounds of $r = m / \text{rounds}$ micro-batches and raises a
# `ValueError` when $m$ is not a multiple of the rounds ($p = 4$: $m = 6$ is one round of 6,
# $m = 10$ two rounds of 5, $m = 3$ one round of 3; $m = 9$ is refused).
#
# ### Task 8.5: `interleaved_one_f_one_b`
#
# Write `interleaved_one_f_one_b(stage, num_stages, num_microbatches, chunks)`: the list of
# `("F", i, c)` and `("B", i, c)` steps (micro-batch `i`, model chunk `c`) that stage `stage`
# runs, in the order of Megatron-LM's interleaved schedule. As for 8.4, the checks hold your
# orders to the contract, over many shapes $(p, v, m)$:
#
# - each (micro-batch, chunk) goes forward once, then backward once, on every stage;
# - all stages' orders, played together by `simulate_schedule(orders, forward=1, backward=1,
#   chunks=v)`, never deadlock;
# - the bubble $(\text{makespan} - 2vm)/2vm$ is $\frac{p-1}{v \cdot m}$; no order does better,
#   for the reason of 8.4: stage $p-1$ starts after $p-1$ steps, and its last backward, of chunk
#   0, still crosses $p - 1$ stages;
# - stage $s$ holds at most $(p-s-1) \cdot 2 + (v-1) \cdot p + 1$ chunks forwarded but not yet
#   backwarded: Megatron-LM's warm-up, plus one. GPipe's order (every forward first) fails it.
#
# At the edges, do as torch does: with $m$ not a multiple of $p$, go round in torch's rounds of
# $r$ (above; $p$ becomes $r$ in the warm-up and in the bound, and no order of yours may take
# longer than torch's); with $m$ not a multiple of the rounds, raise a `ValueError` that names
# the constraint. One stage ($p = 1$), one chunk ($v = 1$, plain 1F1B) and one micro-batch are
# shapes like any other.

# %% tags=["task-8.5"]
def interleaved_one_f_one_b(stage: int, num_stages: int, num_microbatches: int,
                            chunks: int) -> list[tuple[str, int, int]]:
    """The interleaved 1F1B order of ("F", i, c) and ("B", i, c) steps for stage `stage`.

    Chunk c of stage s is virtual stage c * num_stages + s. Micro-batches go round in
    max(1, num_microbatches // num_stages) rounds of r = num_microbatches // rounds (r is
    num_stages when num_microbatches is a multiple of it; fewer micro-batches than stages make
    one round of all of them), so num_microbatches must be a multiple of the number of rounds,
    as for torch's ScheduleInterleaved1F1B: a ValueError names the constraint otherwise (and any
    argument out of range). Every (micro-batch, chunk) goes forward once, then backward once. All
    stages' orders, played together with unit-time chunks, never deadlock; when
    num_microbatches is a multiple of num_stages they leave a bubble of
    (num_stages - 1) / (chunks * num_microbatches) of the work. Stage s holds at most
    (num_stages - s - 1) * 2 + (chunks - 1) * r + 1 chunks forwarded but not yet backwarded.
    """
    ### BEGIN SOLUTION
    p, v, m = num_stages, chunks, num_microbatches
    if p < 1 or v < 1 or m < 1 or not 0 <= stage < p:
        raise ValueError(f"interleaved_one_f_one_b: need num_stages, chunks and num_microbatches "
                         f">= 1 and 0 <= stage < num_stages; got stage={stage}, num_stages={p}, "
                         f"num_microbatches={m}, chunks={v}")
    rounds = max(1, m // p)
    if m % rounds:
        raise ValueError(f"interleaved 1F1B runs micro-batches in rounds: num_microbatches={m} "
                         f"must be a multiple of the number of rounds, max(1, {m} // {p}) = "
                         f"{rounds} (e.g. {m - m % rounds} or {m - m % rounds + rounds})")
    r = m // rounds  # micro-batches per round
    total = m * v  # this stage's forward chunk-steps (and as many backwards)
    warmup = min((p - stage - 1) * 2 + (v - 1) * r, total)

    def step(op, k):  # the k-th forward or backward: rounds of r micro-batches through each chunk
        rnd, within = divmod(k, r * v)
        chunk = within // r
        return (op, rnd * r + within % r, chunk if op == "F" else v - 1 - chunk)

    order = [step("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [step("F", warmup + k), step("B", k)]
    order += [step("B", k) for k in range(total - warmup, total)]
    return order
    ### END SOLUTION


# %% tags=["check-8.5"]
check("8.5", interleaved_one_f_one_b)

# %% [markdown]
# Four stages, eight micro-batches: 1F1B with each stage's forward and backward taking 2 units,
# against the same work cut into $v = 2$ chunks of 1 unit (chunk 1 lighter):

# %%
p, m, v = 4, 8, 2
runs = {"1F1B": ([one_f_one_b(s, p, m) for s in range(p)], {"forward": v, "backward": v}),
        f"interleaved 1F1B, {v} chunks": ([interleaved_one_f_one_b(s, p, m, v) for s in range(p)],
                                          {"forward": 1, "backward": 1, "chunks": v})}
fig, axes = plt.subplots(2, 1, figsize=(9, 4.2), sharex=True)
for ax, (name, (orders, times)) in zip(axes, runs.items()):
    run = simulate_schedule(orders, **times)
    bubble = (run.makespan - 2 * v * m) / (2 * v * m)
    formula = (p - 1) / (m * times.get("chunks", 1))
    print(f"{name}: bubble {bubble:.4f} of the work (formula {formula:.4f}); "
          f"peak in flight {run.peak_in_flight}")
    plot_schedule(orders, ax=ax, **times, title=f"{name}: bubble {bubble:.1%} of the work, "
                                                f"in flight {run.peak_in_flight}")
plt.tight_layout()
plt.show()

# %% [markdown]
# The bubble halves; the price is in the peaks. Stage 0 now holds 11 chunks, 5.5 micro-batches'
# worth of activations against 1F1B's 4, and every micro-batch crosses each rank boundary $v$
# times as often. torch's `ScheduleInterleaved1F1B` runs this same order: its warm-up is
# `_get_warmup_ops` in `torch/distributed/pipelining/schedules.py`, the same
# $(v-1) \cdot p + 2(p - s - 1)$, and it relaxes $m$ to a multiple of the number of rounds.

# %% [markdown]
# ## 5. Choosing a layout
#
# With $N$ GPUs, a layout is a factorisation $N = d \times t \times p$ (data × tensor ×
# pipeline). Each dimension costs something different per rank and per step:
#
# - **data ($d$)**: memory per rank: weights, gradients and optimizer states whole (÷ $d$ with
#   FSDP/ZeRO); communication per rank and step: one all-reduce of the gradients,
#   $2\frac{d-1}{d}\cdot$ params.
# - **tensor ($t$)**: memory: weights ÷ $t$, activations ÷ $t$ (with sequence parallelism);
#   communication: 4 all-reduces of the activation per layer and micro-batch, inside the node.
# - **pipeline ($p$)**: memory: weights ÷ $p$, and stage 0 holds $p$ micro-batches of
#   activations (1F1B); communication: one activation and one gradient per micro-batch, to a
#   neighbour, and a bubble of $\frac{p-1}{m+p-1}$.
#
# `kit.lessons.parallelism.layout_table` puts numbers on it for a GPT-style model (12 $h^2$
# parameters per layer; 16 bytes per parameter for bf16 weights and gradients and fp32 Adam states;
# Korthikanti's activation formula with sequence parallelism) and prices the communication with
# Lesson 01's model, with NVLink inside a node of 8 GPUs and a 25 GB/s link between nodes. Here,
# a 13B-parameter model (40 layers, $h$ = 5120) on 64 GPUs, 512 sequences of 2048 tokens per
# step:

# %%
model_13b = Model(layers=40, hidden=5120, heads=40, seq=2048, batch=512, micro_batch=1)
print(f"{model_13b.params / 1e9:.1f}B parameters")
print(f"{'dp':>3} {'tp':>3} {'pp':>3} {'memory/rank':>12} {'DP GB':>7} {'TP GB':>7} {'PP GB':>7} "
      f"{'comm s':>7} {'bubble':>7}")
for r in sorted(layout_table(model_13b, 64), key=lambda r: sum(r.comm_seconds.values())):
    fits = "" if r.memory_bytes < 80e9 else "  (does not fit in 80 GB)"
    print(f"{r.dp:3d} {r.tp:3d} {r.pp:3d} {r.memory_bytes / 1e9:10.1f}GB "
          f"{r.comm_bytes['dp'] / 1e9:7.2f} {r.comm_bytes['tp'] / 1e9:7.1f} "
          f"{r.comm_bytes['pp'] / 1e9:7.2f} {sum(r.comm_seconds.values()):7.2f} "
          f"{r.bubble:7.0%}{fits}")

# %% [markdown]
# The table is sorted by the estimated communication time per step. Pure data parallelism does
# not fit: every GPU would hold all 200-odd GB of weights, gradients and optimizer states.
# Layouts with a pipeline communicate least (one activation per micro-batch and stage
# boundary) but pay the bubble, which grows with $p$ and shrinks with the micro-batches each
# pipeline gets. Tensor parallelism moves by far the most bytes, every layer, which only pays
# on NVLink, inside a node. (An estimate: it ignores compute and its overlap with
# communication, and FSDP would divide the weights' memory by $d$ too.) Move the sliders to see
# how the answer changes with the model and the number of GPUs:

# %%
layout_widget(model_13b, world_size=64)

# %% [markdown]
# ## The same code under `torchrun`
#
# Your layers take a process group and nothing else, so they run unchanged under `torchrun`.
# The script below copies your classes from this notebook, builds a (2, 2) mesh of
# `"dp"` × `"tp"` on 4 workers, runs the MLP tensor-parallel over `mesh["tp"]` and averages the
# gradients over `mesh["dp"]` (Lesson 04's data parallelism, by hand), each `"dp"` row on its
# half of every batch. Its losses must be one process's on the whole batch:

# %%
WORK = Path(tempfile.mkdtemp(prefix="lesson08-"))
HEADER = """
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.distributed.device_mesh import init_device_mesh
"""
MAIN = """
def batches(steps=3):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(8, 16, generator=gen) for _ in range(steps)]


def main():
    dist.init_process_group("gloo")  # GPUs: "nccl", after torch.cuda.set_device(LOCAL_RANK)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_group, dp_group = mesh["tp"].get_group(), mesh["dp"].get_group()
    torch.manual_seed(0)  # the same full layers everywhere; each rank keeps its slices
    model = nn.Sequential(ColumnParallelLinear(nn.Linear(16, 64), tp_group), nn.GELU(),
                          RowParallelLinear(nn.Linear(64, 16), tp_group))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step, x in enumerate(batches()):
        x = x.chunk(2)[mesh["dp"].get_local_rank()]  # this "dp" row's half of the batch
        loss = model(x).square().mean()
        loss.backward()
        for p in model.parameters():  # average over "dp"; the "tp" ranks hold different slices
            dist.all_reduce(p.grad, group=dp_group)
            p.grad /= 2
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss.detach(), group=dp_group)
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item() / 2:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""
script = write_script(WORK / "tp_dp.py", HEADER, CopyToTP, ReduceFromTP, GatherFromTP, ScatterToTP,
                      ColumnParallelLinear, RowParallelLinear, MAIN)
result = torchrun(script, nproc_per_node=4, echo=False, timeout=300)
print("\n".join(line for line in result.output.splitlines() if "step" in line))

torch.manual_seed(0)  # one process, the whole batch
reference = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
gen = torch.Generator().manual_seed(0)
for step in range(3):
    loss = reference(torch.randn(8, 16, generator=gen)).square().mean()
    loss.backward()
    sgd.step()
    sgd.zero_grad()
    print(f"one process, step {step}: loss {loss.item():.6f}")

# %% [markdown]
# ## Running at scale
#
# > Layouts follow the hardware. Tensor parallelism all-reduces activations in every layer, so
# > it stays inside a node, on NVLink (t ≤ 8). Pipeline stages exchange one activation per
# > micro-batch and cross nodes happily; data parallelism (FSDP) goes across nodes too, its
# > all-gathers and reduce-scatters overlapping with compute. On GPUs the same code runs under
# > `torchrun` with NCCL; `init_device_mesh` lays ranks out row-major, so the *last* mesh
# > dimension holds consecutive ranks, the GPUs of one node:
# >
# > ```python
# > # torchrun --nnodes=4 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 train.py
# > import os
# > import torch
# > import torch.distributed as dist
# > from torch.distributed.device_mesh import init_device_mesh
# > from torch.distributed.fsdp import fully_shard
# > from torch.distributed.tensor.parallel import (
# >     ColwiseParallel,
# >     RowwiseParallel,
# >     parallelize_module,
# > )
# > from kit.lessons.models import TinyTransformer
# >
# > torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
# > dist.init_process_group("nccl")
# > mesh = init_device_mesh("cuda", (4, 8), mesh_dim_names=("dp", "tp"))  # tp: one node's 8 GPUs
# > model = TinyTransformer(dim=2048, layers=16, heads=16).cuda()  # each block: mlp.0, GELU, mlp.2
# > for block in model.blocks:
# >     parallelize_module(block, mesh["tp"],
# >                        {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})
# >     fully_shard(block, mesh=mesh["dp"])
# > fully_shard(model, mesh=mesh["dp"])
# > # ... the usual loop; each "dp" row of the mesh reads its own slice of the data
# > dist.destroy_process_group()
# > ```
# >
# > For a pipeline dimension add it outermost, `init_device_mesh("cuda", (pp, dp, tp), ...)`, and
# > give `PipelineStage` the `mesh["pp"]` group (`group=mesh["pp"].get_group()`). Your
# > `ColumnParallelLinear` and `RowParallelLinear` run unchanged with NCCL on GPU tensors: pass
# > `group=mesh["tp"].get_group()`. For interleaved 1F1B, each rank builds one `PipelineStage`
# > per model chunk, stage index `c * pp + pp_rank`, and hands the list to
# > `ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn)`.
#
# ## Summary
#
# - **Tensor parallelism** splits the first linear layer by output features (columns of $A$)
#   and the second by input features (rows of $B$); f (identity / all-reduce) and g (all-reduce /
#   identity) put one all-reduce in forward and one in backward per block: 2 + 2 per
#   transformer layer, each of the whole activation. Attention splits by heads. The bias of
#   the row layer is added once, after the sum.
# - **Sequence parallelism** writes each all-reduce as reduce-scatter + all-gather along the
#   sequence and runs LayerNorm and dropout on the $1/t$ shard in between: the same bytes, $t$
#   times less activation memory there; the gradients of parameters used on the shard are
#   summed over the group.
# - **DTensor** expresses both as placements (`Shard`, `Replicate`, `Partial`) and plans
#   (`ColwiseParallel`, `RowwiseParallel`, `SequenceParallel`) applied by `parallelize_module`;
#   composed with FSDP2 on a 2-D `DeviceMesh`.
# - **Pipeline parallelism**: GPipe's micro-batches leave a bubble of $(p-1)/(m+p-1)$ and hold
#   $m$ activations per stage; 1F1B keeps the bubble and holds at most $p - s$; interleaved 1F1B
#   with $v$ chunks per rank divides the bubble by $v$ for $v$ times the messages and a longer
#   warm-up. `torch.distributed.pipelining` gives you `PipelineStage`, `ScheduleGPipe`,
#   `Schedule1F1B`, `ScheduleInterleaved1F1B`.
# - **Layouts**: tensor parallelism inside a node, pipeline and data parallelism across nodes;
#   price each choice by memory, bytes and the bubble.
#
# **Read more:** [Tensor Parallelism tutorial](https://pytorch.org/tutorials/intermediate/TP_tutorial.html),
# [`torch.distributed.tensor.parallel`](https://pytorch.org/docs/stable/distributed.tensor.parallel.html),
# [DTensor](https://pytorch.org/docs/stable/distributed.tensor.html),
# [`DeviceMesh`](https://pytorch.org/tutorials/recipes/distributed_device_mesh.html),
# [`torch.distributed.pipelining`](https://pytorch.org/docs/stable/distributed.pipelining.html),
# and the papers: Megatron-LM (Shoeybi et al., 2019), sequence parallelism (Korthikanti et
# al., 2022), GPipe (Huang et al., 2019), PipeDream-Flush (Narayanan et al., *Memory-Efficient
# Pipeline-Parallel DNN Training*, ICML 2021) and interleaved 1F1B (Narayanan et al.,
# [*Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM*](https://arxiv.org/abs/2104.04473), SC 2021).
#
# ## Exercises (not graded)
#
# 1. Fuse the attention's q, k and v into one `ColumnParallelLinear` of $3D$ outputs. How must
#    the rows of the fused weight be ordered so that each rank gets whole heads, and how many
#    all-reduces does backward make then?
# 2. Add dropout to `SequenceParallelMLP` after `linear2`. Which random numbers must differ
#    between ranks and which must agree? (Megatron keeps two generator states for this.)
# 3. Make `SequenceParallelMLP` save only its shard for `linear1`'s weight gradient and
#    all-gather it again in backward. How much activation memory does it save, and what does
#    it cost?
# 4. Write an order for 2 stages that deadlocks, and check it with `simulate_schedule`. Then
#    find an order that does not deadlock in the simulation but does on real ranks with blocking
#    `dist.send`.
# 5. In the layout table, find the smallest number of micro-batches for which pipeline
#    parallelism with $p = 4$ wastes less than 10% to the bubble. What does 1F1B's peak memory
#    look like at that $m$, compared with GPipe's?
