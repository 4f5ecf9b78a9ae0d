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
# # Lesson 08 · Model parallelism: tensor, sequence and pipeline parallel, and 2-D meshes

# %% tags=["setup"]
import math
import time

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from kit import LaunchError, LaunchTimeout, check, costmodel, launch
from kit.parallelism import layout_table, layout_widget, plot_schedule, simulate_schedule
from kit.trace import launch_traced, plot_timeline, region, trace

# %% [markdown]
# ### Task 8.1: `ColumnParallelLinear` and `RowParallelLinear`

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
    Keeps ``weight`` (out/t, in) and ``bias`` (out/t,): this rank's rows.
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
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[rows].clone())
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
    Keeps ``weight`` (out, in/t), this rank's columns, and ``bias`` (out,) whole.
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
# ### Task 8.2: `SequenceParallelMLP`

# %% tags=["task-8.2"]
def _all_gather_seq(x, group):
    """(b, s/t, h) -> (b, s, h): every rank's sequence shard, in rank order."""
    ### BEGIN SOLUTION
    t = dist.get_world_size(group)
    x = x.transpose(0, 1).contiguous()  # (s/t, b, h): the gathered dimension first
    out = torch.empty((t * x.shape[0], *x.shape[1:]), dtype=x.dtype)
    dist.all_gather_into_tensor(out, x, group=group)
    return out.transpose(0, 1)  # (b, s, h)
    ### END SOLUTION


def _reduce_scatter_seq(x, group):
    """(b, s, h) -> (b, s/t, h): this rank's sequence shard of the sum over ranks."""
    ### BEGIN SOLUTION
    t = dist.get_world_size(group)
    x = x.transpose(0, 1).contiguous()  # (s, b, h)
    out = torch.empty((x.shape[0] // t, *x.shape[1:]), dtype=x.dtype)
    dist.reduce_scatter_tensor(out, x, group=group)
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
        linear1: the full nn.Linear(h, f); ``self.linear1`` keeps rows: weight (f/t, h), bias (f/t,).
        linear2: the full nn.Linear(f, h); ``self.linear2`` keeps columns: weight (h, f/t) and the
            whole bias (h,).
        group: the tensor-parallel process group (None: the default group).
    After backward every .grad is final: the gradients of the parameters used on the sequence
    shard (the LayerNorm's, linear2's bias) are summed over the group.
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
# ### Task 8.3: `gpipe`

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
    """
    ### BEGIN SOLUTION
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
# ### Task 8.4: `one_f_one_b`

# %% tags=["task-8.4"]
def one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The 1F1B order of ("F", i) and ("B", i) for one stage, micro-batches in order.

    Warm-up: min(num_stages - stage - 1, num_microbatches) forwards; steady state: one
    forward then one backward until every forward is done; cool-down: the remaining backwards.
    """
    ### BEGIN SOLUTION
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = [("F", i) for i in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(num_microbatches - warmup, num_microbatches)]
    return order
    ### END SOLUTION


# %% tags=["check-8.4"]
check("8.4", one_f_one_b)
