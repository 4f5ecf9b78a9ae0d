"""Seeded bugs for Lesson 08: the typical mistakes each check of tasks 8.1-8.5 must catch.

``BUGS[task_id]`` lists ``(what is wrong, implementation)``; tests/test_checks.py proves every one
fails at least one case of its task. Each bug is a correct implementation with one step
replaced, plus the cheats that wrap what the task re-implements (DTensor's
``parallelize_module``, ``torch.distributed.pipelining``): the registry's ``forbidden`` gate
scores those 0, and until it is enforced the recorded communication already fails them. The
full-weight layers (8.1, 8.2) give the right values and collectives and fail only the meter's
bounds: tests/test_lesson08.py holds them to exactly that. A task 8.1 bug is a column layer
defined beside its row layer (:func:`_beside`), as one notebook cell defines both.
"""

from __future__ import annotations

import copy
import types

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from bugs import edited_solution

# --------------------------------------------------------------------------- task 8.1


class _Copy(torch.autograd.Function):  # f
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):  # g
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        t, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(t, dim=-1)[r].contiguous(), None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        t, r = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(t, dim=-1)[r].contiguous()

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=-1), None


def _rank(group):
    return dist.get_rank(group)


def _beside(column, row):
    """``column`` as one notebook cell defining it beside ``row`` gives it: its ``__init__``
    sees ``row`` as the global name RowParallelLinear (what the checks' companion lookup reads)."""
    init = column.__init__
    bound = types.FunctionType(init.__code__, {**init.__globals__, "RowParallelLinear": row},
                               init.__name__, init.__defaults__, init.__closure__)
    name = column.__name__.lstrip("_")
    return type(name, (column,), {"__init__": bound, "__doc__": column.__doc__,
                                  "__module__": column.__module__, "__qualname__": name})


class _Row(nn.Module):
    f_in, g_out = _Identity, _Reduce

    def __init__(self, linear, group=None, input_is_parallel=True):
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        t, r = dist.get_world_size(group), self._rank(group)
        if linear.in_features % t:  # as the solution: equal slices or none
            raise ValueError(f"in_features must divide by the group size ({linear.in_features} % {t})")
        cols = slice(r * linear.in_features // t, (r + 1) * linear.in_features // t)
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone())

    def _rank(self, group):
        return _rank(group)

    def forward(self, x):
        if not self.input_is_parallel:
            x = _Scatter.apply(x, self.group)
        return self.g_out.apply(F.linear(x, self.weight), self.group) + self.bias


class _Column(nn.Module):
    f_in = _Copy

    def __init__(self, linear, group=None, gather_output=False):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        t, r = dist.get_world_size(group), self._rank(group)
        if linear.out_features % t:  # as the solution: equal slices or none
            raise ValueError(f"out_features must divide by the group size ({linear.out_features} % {t})")
        rows = slice(r * linear.out_features // t, (r + 1) * linear.out_features // t)
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = nn.Parameter(linear.bias.detach()[rows].clone())

    def _rank(self, group):
        return _rank(group)

    def forward(self, x):
        y = F.linear(self.f_in.apply(x, self.group), self.weight, self.bias)
        return _Gather.apply(y, self.group) if self.gather_output else y


class _RowIdentityOut(_Row):  # g replaced by f: identity forward, all-reduce backward
    g_out = _Copy


class _ColumnWrongDirection(_Column):
    """f and g swapped: all-reduce the input in forward, the output's gradient in backward."""

    f_in = _Reduce


ColumnWrongDirection = _beside(_ColumnWrongDirection, _RowIdentityOut)


class _RowBiasEverywhere(_Row):
    def forward(self, x):
        if not self.input_is_parallel:
            x = _Scatter.apply(x, self.group)
        return _Reduce.apply(F.linear(x, self.weight, self.bias), self.group)


class _ColumnBiasOnEveryRank(_Column):
    """The row layer adds its whole bias on every rank, before the all-reduce sums t copies."""


ColumnBiasOnEveryRank = _beside(_ColumnBiasOnEveryRank, _RowBiasEverywhere)


class _ColumnNoInputReduce(_Column):
    """f forgotten: the input's gradient is this rank's part only."""

    f_in = _Identity


ColumnNoInputReduce = _beside(_ColumnNoInputReduce, _Row)


def _global_rank(self, group):
    return dist.get_rank()


class _RowGlobalRank(_Row):
    _rank = _global_rank


class _ColumnGlobalRank(_Column):
    """Slices by the global rank instead of the rank in the group."""

    _rank = _global_rank


ColumnGlobalRank = _beside(_ColumnGlobalRank, _RowGlobalRank)


class _ColumnFullWeight(_Column):
    """Keeps every rank's rows of the weight and multiplies by the whole matrix, then keeps its
    own output features: right values and collectives, t times the weights and the FLOPs."""

    def __init__(self, linear, group=None, gather_output=False):
        super().__init__(linear, group, gather_output)
        t, r = dist.get_world_size(group), self._rank(group)
        self.rows = slice(r * linear.out_features // t, (r + 1) * linear.out_features // t)
        self.full_weight = linear.weight.detach().clone()  # (out, in): every rank's rows
        self.full_bias = linear.bias.detach().clone()

    def forward(self, x):
        r = self.rows
        weight = torch.cat([self.full_weight[:r.start], self.weight, self.full_weight[r.stop:]])
        bias = torch.cat([self.full_bias[:r.start], self.bias, self.full_bias[r.stop:]])
        y = F.linear(self.f_in.apply(x, self.group), weight, bias)[..., r]  # all out, keep mine
        return _Gather.apply(y, self.group) if self.gather_output else y


class _RowFullWeight(_Row):
    """Keeps every rank's columns and multiplies the zero-padded input by the whole matrix."""

    def __init__(self, linear, group=None, input_is_parallel=True):
        super().__init__(linear, group, input_is_parallel)
        t, r = dist.get_world_size(group), self._rank(group)
        self.cols = slice(r * linear.in_features // t, (r + 1) * linear.in_features // t)
        self.in_features = linear.in_features
        self.full_weight = linear.weight.detach().clone()  # (out, in): every rank's columns

    def forward(self, x):
        if not self.input_is_parallel:
            x = _Scatter.apply(x, self.group)
        c = self.cols
        weight = torch.cat([self.full_weight[:, :c.start], self.weight, self.full_weight[:, c.stop:]],
                           dim=1)
        x = F.pad(x, (c.start, self.in_features - c.stop))  # this rank's features, zeros elsewhere
        return self.g_out.apply(F.linear(x, weight), self.group) + self.bias


ColumnFullWeight = _beside(_ColumnFullWeight, _RowFullWeight)


class _DTensorLinear(nn.Module):
    style = "colwise"

    def __init__(self, linear, group=None, **options):
        super().__init__()
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cpu")
        self.linear = copy.deepcopy(linear)
        plan = ColwiseParallel() if self.style == "colwise" else RowwiseParallel()
        parallelize_module(self.linear, mesh, plan)
        self.weight, self.bias = self.linear.weight, self.linear.bias

    def forward(self, x):
        return self.linear(x)


class _DTensorRow(_DTensorLinear):
    style = "rowwise"


class _ColumnDTensor(_DTensorLinear):
    """The cheat: torch's ColwiseParallel / RowwiseParallel through parallelize_module."""


ColumnDTensor = _beside(_ColumnDTensor, _DTensorRow)


# --------------------------------------------------------------------------- task 8.2


def _all_gather_seq(x, group):
    t = dist.get_world_size(group)
    x = x.transpose(0, 1).contiguous()
    out = torch.empty((t * x.shape[0], *x.shape[1:]), dtype=x.dtype)
    dist.all_gather_single(out, x, group=group)
    return out.transpose(0, 1)


def _reduce_scatter_seq(x, group):
    t = dist.get_world_size(group)
    x = x.transpose(0, 1).contiguous()
    out = torch.empty((x.shape[0] // t, *x.shape[1:]), dtype=x.dtype)
    dist.reduce_scatter_single(out, x, group=group)
    return out.transpose(0, 1)


class _SeqGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _SeqGatherSliceBackward(_SeqGather):
    @staticmethod
    def backward(ctx, grad):
        t, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(t, dim=1)[r].contiguous(), None


class _SeqScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


class _SeqAllReduceThenSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        t, r = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(t, dim=1)[r].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


class _SequenceParallelMLP(nn.Module):
    gather, scatter, reduce_norm, reduce_bias = _SeqGather, _SeqScatter, _Copy, _Copy

    def __init__(self, norm, linear1, linear2, group=None):
        super().__init__()
        self.group, self.norm = group, norm
        t, r = dist.get_world_size(group), dist.get_rank(group)
        f = linear1.out_features
        cols = slice(r * f // t, (r + 1) * f // t)
        self.linear1 = nn.Linear(linear1.in_features, f // t)
        self.linear2 = nn.Linear(f // t, linear2.out_features)
        with torch.no_grad():
            self.linear1.weight.copy_(linear1.weight[cols])
            self.linear1.bias.copy_(linear1.bias[cols])
            self.linear2.weight.copy_(linear2.weight[:, cols])
            self.linear2.bias.copy_(linear2.bias)

    def _norm(self, x):
        weight = self.reduce_norm.apply(self.norm.weight, self.group)
        bias = self.reduce_norm.apply(self.norm.bias, self.group)
        return F.layer_norm(x, self.norm.normalized_shape, weight, bias, self.norm.eps)

    def forward(self, x):
        h = self.gather.apply(self._norm(x), self.group)
        h = F.linear(F.gelu(self.linear1(h)), self.linear2.weight)
        return self.scatter.apply(h, self.group) + self.reduce_bias.apply(self.linear2.bias, self.group)


class SPNormGradsNotReduced(_SequenceParallelMLP):
    reduce_norm = _Identity


class SPBiasGradNotReduced(_SequenceParallelMLP):
    reduce_bias = _Identity


class SPNormOnGatheredSequence(_SequenceParallelMLP):
    """All-gathers first and normalises the whole sequence: right values, t times the memory."""

    reduce_norm = _Identity  # every rank saw the whole sequence: no sum needed

    def forward(self, x):
        h = self._norm(self.gather.apply(x, self.group))
        h = F.linear(F.gelu(self.linear1(h)), self.linear2.weight)
        return self.scatter.apply(h, self.group) + _Copy.apply(self.linear2.bias, self.group)


class SPFullWidth(_SequenceParallelMLP):
    """Keeps every rank's weights and runs the full-width MLP on the gathered sequence, the
    other ranks' features multiplied by zero: right values and collectives, t times the weights
    and the FLOPs."""

    def __init__(self, norm, linear1, linear2, group=None):
        super().__init__(norm, linear1, linear2, group)
        t, r = dist.get_world_size(group), dist.get_rank(group)
        f = linear1.out_features
        self.cols = slice(r * f // t, (r + 1) * f // t)
        self.full1 = linear1.weight.detach().clone()  # (f, h): every rank's rows
        self.full_bias1 = linear1.bias.detach().clone()
        self.full2 = linear2.weight.detach().clone()  # (h, f): every rank's columns
        self.mine = torch.zeros(f)
        self.mine[self.cols] = 1.0

    def forward(self, x):
        c = self.cols
        h = self.gather.apply(self._norm(x), self.group)
        w1 = torch.cat([self.full1[:c.start], self.linear1.weight, self.full1[c.stop:]])
        b1 = torch.cat([self.full_bias1[:c.start], self.linear1.bias, self.full_bias1[c.stop:]])
        a = F.gelu(F.linear(h, w1, b1)) * self.mine  # (b, s, f): only this rank's features count
        w2 = torch.cat([self.full2[:, :c.start], self.linear2.weight, self.full2[:, c.stop:]], dim=1)
        return self.scatter.apply(F.linear(a, w2), self.group) + self.reduce_bias.apply(
            self.linear2.bias, self.group)


class SPAllReduceThenSlice(_SequenceParallelMLP):
    scatter = _SeqAllReduceThenSlice


class SPGatherBackwardSlices(_SequenceParallelMLP):
    gather = _SeqGatherSliceBackward


class SPNormReducedOnAccumulatedGrad(_SequenceParallelMLP):
    """Sums the LayerNorm's .grad after it accumulated: the second pass counts the first t times."""

    reduce_norm = _Identity

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for p in self.norm.parameters():
            p.register_post_accumulate_grad_hook(
                lambda p: dist.all_reduce(p.grad, group=self.group))


class SPDTensor(nn.Module):
    """The cheat: SequenceParallel, ColwiseParallel and RowwiseParallel through parallelize_module."""

    def __init__(self, norm, linear1, linear2, group=None):
        super().__init__()
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        self.norm, self.linear1, self.linear2 = norm, copy.deepcopy(linear1), copy.deepcopy(linear2)
        mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cpu")
        parallelize_module(self, mesh, {"norm": SequenceParallel(),
                                        "linear1": ColwiseParallel(input_layouts=Shard(1)),
                                        "linear2": RowwiseParallel(output_layouts=Shard(1))})

    def forward(self, x):
        return self.linear2(F.gelu(self.linear1(self.norm(x))))


# --------------------------------------------------------------------------- task 8.3


def _equal_sizes(microbatches):
    """The edge's check each 8.3 bug keeps, so that it has one defect."""
    if len({len(x) for x in microbatches}) > 1:
        raise ValueError("the micro-batches must all have the same size")


def _gpipe(stage, microbatches, targets, loss_fn, *, scale=True, grad_dst=None):
    _equal_sizes(microbatches)
    rank, p = dist.get_rank(), dist.get_world_size()
    m = len(microbatches)
    inputs, outputs = [], []
    for i in range(m):
        if rank == 0:
            x = microbatches[i]
        else:
            x = torch.empty_like(microbatches[i])
            dist.recv(x, src=rank - 1)
            x.requires_grad_()
        y = stage(x)
        if rank < p - 1:
            dist.send(y.detach(), dst=rank + 1)
        inputs.append(x)
        outputs.append(y)
    total = torch.zeros(())
    for i in reversed(range(m)):
        if rank == p - 1:
            loss = loss_fn(outputs[i], targets[i]) / (m if scale else 1)
            loss.backward()
            total += loss.detach() / (1 if scale else m)
        else:
            grad = torch.empty_like(outputs[i])
            dist.recv(grad, src=rank + 1)
            outputs[i].backward(grad)
        if rank > 0:
            dist.send(inputs[i].grad, dst=rank - 1 if grad_dst is None else grad_dst(rank))
    return total if rank == p - 1 else None


def gpipe_unscaled(stage, microbatches, targets, loss_fn):
    """Micro-batch losses not divided by m: gradients m times too large (the loss is right)."""
    return _gpipe(stage, microbatches, targets, loss_fn, scale=False)


def gpipe_grads_to_first_stage(stage, microbatches, targets, loss_fn):
    """Every stage sends its input's gradient to stage 0 instead of the previous stage."""
    return _gpipe(stage, microbatches, targets, loss_fn, grad_dst=lambda rank: 0)


def gpipe_interleaved(stage, microbatches, targets, loss_fn):
    """Backward of each micro-batch right after its forward: correct gradients, but not GPipe
    (and it holds one activation instead of m)."""
    _equal_sizes(microbatches)
    rank, p = dist.get_rank(), dist.get_world_size()
    m = len(microbatches)
    total = torch.zeros(())
    for i in range(m):
        if rank == 0:
            x = microbatches[i]
        else:
            x = torch.empty_like(microbatches[i])
            dist.recv(x, src=rank - 1)
            x.requires_grad_()
        y = stage(x)
        if rank < p - 1:
            dist.send(y.detach(), dst=rank + 1)
            grad = torch.empty_like(y)
            dist.recv(grad, src=rank + 1)
            y.backward(grad)
        else:
            loss = loss_fn(y, targets[i]) / m
            loss.backward()
            total += loss.detach()
        if rank > 0:
            dist.send(x.grad, dst=rank - 1)
    return total if rank == p - 1 else None


def gpipe_with_torch_pipelining(stage, microbatches, targets, loss_fn):
    """The cheat: torch.distributed.pipelining's PipelineStage and ScheduleGPipe."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank, p = dist.get_rank(), dist.get_world_size()
    m = len(microbatches)
    schedule = ScheduleGPipe(PipelineStage(stage, rank, p, torch.device("cpu")), n_microbatches=m,
                             loss_fn=loss_fn)
    if rank == 0:
        schedule.step(torch.cat(microbatches))
    elif rank == p - 1:
        losses = []
        schedule.step(target=torch.cat(targets), losses=losses)
        return torch.stack(losses).mean().detach()
    else:
        schedule.step()
    return None


_send_and_receive = dist.batch_isend_irecv  # what _gpipe_batched sends with; _with_copied_p2p swaps it


def _gpipe_batched(stage, microbatches, targets, loss_fn):
    """GPipe whose every message goes through _send_and_receive."""
    rank, p = dist.get_rank(), dist.get_world_size()
    m = len(microbatches)
    inputs, outputs = [], []
    for i in range(m):
        if rank == 0:
            x = microbatches[i]
        else:
            x = torch.empty_like(microbatches[i])
            for work in _send_and_receive([dist.P2POp(dist.irecv, x, rank - 1)]):
                work.wait()
            x.requires_grad_()
        y = stage(x)
        if rank < p - 1:
            for work in _send_and_receive([dist.P2POp(dist.isend, y.detach(), rank + 1)]):
                work.wait()
        inputs.append(x)
        outputs.append(y)
    total = torch.zeros(())
    for i in reversed(range(m)):
        if rank == p - 1:
            loss = loss_fn(outputs[i], targets[i]) / m
            loss.backward()
            total += loss.detach()
        else:
            grad = torch.empty_like(outputs[i])
            for work in _send_and_receive([dist.P2POp(dist.irecv, grad, rank + 1)]):
                work.wait()
            outputs[i].backward(grad)
        if rank > 0:
            for work in _send_and_receive([dist.P2POp(dist.isend, inputs[i].grad, rank - 1)]):
                work.wait()
    return total if rank == p - 1 else None


def _with_copied_p2p() -> types.FunctionType:
    """gpipe whose _send_and_receive is torch's private schedules._batch_p2p, copied at load time:
    a new function with its code (the source names neither the helper nor pipelining)."""
    import importlib
    import logging

    helper = importlib.import_module("torch.distributed." + "pipelining.schedules")._batch_p2p
    copy = types.FunctionType(helper.__code__, globals(), "_send_and_receive")
    names = {**globals(), "_send_and_receive": copy, "logger": logging.getLogger("gpipe")}
    return types.FunctionType(_gpipe_batched.__code__, names, "gpipe")


# --------------------------------------------------------------------------- task 8.4


def _one_f_one_b(stage, num_stages, num_microbatches, warmup):
    warmup = max(0, min(warmup, num_microbatches))
    order = [("F", i) for i in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(num_microbatches - warmup, num_microbatches)]


def one_f_one_b_long_warmup(stage, num_stages, num_microbatches):
    """Warm-up of num_stages - stage forwards: one too many."""
    return _one_f_one_b(stage, num_stages, num_microbatches, num_stages - stage)


def one_f_one_b_short_warmup(stage, num_stages, num_microbatches):
    """Warm-up of num_stages - stage - 2 forwards: a backward waits for a forward not yet sent."""
    return _one_f_one_b(stage, num_stages, num_microbatches, num_stages - stage - 2)


def one_f_one_b_is_gpipe(stage, num_stages, num_microbatches):
    """All forwards, then all backwards: correct, but m activations in flight."""
    return [("F", i) for i in range(num_microbatches)] + [("B", i) for i in range(num_microbatches)]


def one_f_one_b_from_torchs_schedule(stage, num_stages, num_microbatches):
    """The order of torch's own 1F1B, from a private helper of torch.distributed.pipelining."""
    from torch.distributed.pipelining import schedules

    warmup = min(num_stages - stage - 1, num_microbatches)
    actions = schedules._get_1f1b_rank_ops(1, num_stages, warmup, num_microbatches - warmup, warmup,
                                           stage, forward_stage_index=lambda _: stage,
                                           backward_stage_index=lambda _: stage)
    return [(a.computation_type.value, a.microbatch_index) for a in actions if a is not None]


def one_f_one_b_backwards_reversed(stage, num_stages, num_microbatches):
    """1F1B shape, but the cool-down runs its backwards last micro-batch first."""
    order = _one_f_one_b(stage, num_stages, num_microbatches, num_stages - stage - 1)
    k = min(num_stages - stage - 1, num_microbatches)
    if k > 1:
        tail = order[-k:]
        order = order[:-k] + tail[::-1]
    return order


# --------------------------------------------------------------------------- task 8.5


def _interleaved(stage, num_stages, num_microbatches, chunks, *, warmup=None, all_forwards=False,
                 forward_chunk=None, backward_chunk=None, micro_batch=None):
    p, v = num_stages, chunks
    total = num_microbatches * v
    if warmup is None:
        warmup = (p - stage - 1) * 2 + (v - 1) * p
    warmup = total if all_forwards else max(0, min(warmup, total))
    micro_batch = micro_batch or (lambda k: (k // (p * v)) * p + k % p)
    forward_chunk = forward_chunk or (lambda k: (k % (p * v)) // p)
    backward_chunk = backward_chunk or (lambda k: v - 1 - (k % (p * v)) // p)
    order = [("F", micro_batch(k), forward_chunk(k)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [("F", micro_batch(warmup + k), forward_chunk(warmup + k)),
                  ("B", micro_batch(k), backward_chunk(k))]
    return order + [("B", micro_batch(k), backward_chunk(k)) for k in range(total - warmup, total)]


def interleaved_is_gpipe(stage, num_stages, num_microbatches, chunks):
    """Every chunk's forward first, then every backward: no deadlock, but m·v chunks in flight."""
    return _interleaved(stage, num_stages, num_microbatches, chunks, all_forwards=True)


def interleaved_backward_chunks_in_forward_order(stage, num_stages, num_microbatches, chunks):
    """Virtual stages in the wrong order: the backward visits chunk 0 first, like the forward."""
    p = num_stages
    return _interleaved(stage, num_stages, num_microbatches, chunks,
                        backward_chunk=lambda k: (k % (p * chunks)) // p)


def interleaved_forward_chunks_last_first(stage, num_stages, num_microbatches, chunks):
    """Virtual stages in the wrong order: the forward starts at the last chunk."""
    p = num_stages
    return _interleaved(stage, num_stages, num_microbatches, chunks,
                        forward_chunk=lambda k: chunks - 1 - (k % (p * chunks)) // p,
                        backward_chunk=lambda k: (k % (p * chunks)) // p)


def interleaved_chunks_as_consecutive_stages(stage, num_stages, num_microbatches, chunks):
    """A stage's chunks taken as consecutive virtual stages (s·v + c): each micro-batch runs all
    its chunks in a row."""
    v = chunks
    return _interleaved(stage, num_stages, num_microbatches, chunks, micro_batch=lambda k: k // v,
                        forward_chunk=lambda k: k % v, backward_chunk=lambda k: v - 1 - k % v)


def interleaved_one_f_one_b_warmup(stage, num_stages, num_microbatches, chunks):
    """1F1B's warm-up, (p − s − 1)·2, without the (v − 1)·p forwards the later chunks need."""
    return _interleaved(stage, num_stages, num_microbatches, chunks,
                        warmup=(num_stages - stage - 1) * 2)


def interleaved_long_warmup(stage, num_stages, num_microbatches, chunks):
    """A warm-up one forward too long: one chunk more in flight than the bound."""
    p = num_stages
    return _interleaved(stage, num_stages, num_microbatches, chunks,
                        warmup=(p - stage - 1) * 2 + (chunks - 1) * p + 1)


def interleaved_all_forwards_when_one_round(stage, num_stages, num_microbatches, chunks):
    """Every forward first when m = p (one round), the general warm-up otherwise."""
    return _interleaved(stage, num_stages, num_microbatches, chunks,
                        all_forwards=num_microbatches == num_stages)


def interleaved_one_f_one_b_per_chunk(stage, num_stages, num_microbatches, chunks):
    """Plain 1F1B over the v·p virtual stages, this stage's chunks one after another."""
    p, m = num_stages, num_microbatches
    order = []
    for c in range(chunks):
        virtual = c * p + stage
        order += [(op, i, c) for op, i in _one_f_one_b(virtual, chunks * p, m, chunks * p - virtual - 1)]
    return order


def interleaved_from_torchs_schedule(stage, num_stages, num_microbatches, chunks):
    """The order of torch's ScheduleInterleaved1F1B, from its private rank-ops method."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    schedule = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    schedule.pp_group_size, schedule.n_local_stages = num_stages, chunks
    schedule._n_microbatches = num_microbatches
    schedule.number_of_rounds = max(1, num_microbatches // num_stages)
    schedule.microbatches_per_round = num_microbatches // schedule.number_of_rounds
    ops = schedule._calculate_single_rank_operations(stage)
    return [("F" if a.computation_type.name == "FORWARD" else "B", a.microbatch_index,
             a.stage_index // num_stages) for a in ops if a is not None]


BUGS = {
    "8.1": [
        ("all-reduce in the wrong direction (f and g swapped)", ColumnWrongDirection),
        ("the row layer's bias added on every rank before the all-reduce", ColumnBiasOnEveryRank),
        ("f forgotten: the input gradient is not all-reduced", ColumnNoInputReduce),
        ("slices by the global rank instead of the rank in the group", ColumnGlobalRank),
        ("wraps parallelize_module (ColwiseParallel, RowwiseParallel)", ColumnDTensor),
        ("keeps the whole weights and multiplies by them on every rank", ColumnFullWeight),
        ("splits features that do not divide by the group size unevenly (no ValueError)",
         edited_solution(8, (
             "        if linear.out_features % t:\n            raise ValueError(",
             "        if False:\n            raise ValueError(",
         )).ColumnParallelLinear),
    ],
    "8.2": [
        ("the LayerNorm gradients not reduced", SPNormGradsNotReduced),
        ("linear2's bias gradient not reduced (it is used on a shard)", SPBiasGradNotReduced),
        ("the LayerNorm runs on the gathered sequence", SPNormOnGatheredSequence),
        ("all-reduce then slice instead of reduce-scatter", SPAllReduceThenSlice),
        ("the all-gather's backward slices instead of reduce-scattering", SPGatherBackwardSlices),
        ("the LayerNorm .grad reduced after accumulation", SPNormReducedOnAccumulatedGrad),
        ("wraps parallelize_module (SequenceParallel)", SPDTensor),
        ("keeps the whole weights and runs the full-width MLP on every rank", SPFullWidth),
        ("one rank: skips the collectives, and linear2's bias with them",
         edited_solution(8, (
             "        ### BEGIN SOLUTION\n        weight = SumGradOverTP.apply(self.norm.weight",
             "        ### BEGIN SOLUTION\n        if dist.get_world_size(self.group) == 1:\n"
             "            return F.linear(F.gelu(self.linear1(self.norm(x))), self.linear2.weight)\n"
             "        weight = SumGradOverTP.apply(self.norm.weight",
         )).SequenceParallelMLP),
        ("the LayerNorm gradients summed by hooks each forward registers (a no_grad forward leaves "
         "one behind)",
         edited_solution(8, (
             "        weight = SumGradOverTP.apply(self.norm.weight, self.group)\n"
             "        bias = SumGradOverTP.apply(self.norm.bias, self.group)\n",
             "        for q in (self.norm.weight, self.norm.bias):\n"
             "            def once(g, handle=[], group=self.group):\n"
             "                handle[0].remove()\n"
             "                g = g.clone()\n"
             "                dist.all_reduce(g, group=group)\n"
             "                return g\n"
             "            once.__defaults__[0].append(q.register_hook(once))\n"
             "        weight, bias = self.norm.weight, self.norm.bias\n",
         )).SequenceParallelMLP),
    ],
    "8.3": [
        ("micro-batch losses not scaled by 1/m", gpipe_unscaled),
        ("gradients sent to the wrong stage (stage 0)", gpipe_grads_to_first_stage),
        ("backward right after each forward (not GPipe)", gpipe_interleaved),
        ("wraps torch.distributed.pipelining (ScheduleGPipe)", gpipe_with_torch_pipelining),
        ("sends through a load-time copy of torch's private schedules._batch_p2p", _with_copied_p2p()),
        ("first and last stage taken as exclusive: one stage never computes the loss",
         edited_solution(8, (
             "        if last:\n            loss = loss_fn",
             "        if last and not first:\n            loss = loss_fn",
         )).gpipe),
        ("the receive buffer shaped by microbatches[rank] (this stage's index, not the micro-batch's)",
         edited_solution(8, (
             "            x = torch.empty_like(microbatches[i])\n",
             "            x = torch.empty_like(microbatches[rank])\n",
         )).gpipe),
        ("micro-batches of different sizes: no ValueError",
         edited_solution(8, (
             "    if len(sizes) > 1:\n        raise ValueError(f\"the micro-batches",
             "    if False:\n        raise ValueError(f\"the micro-batches",
         )).gpipe),
    ],
    "8.4": [
        ("a warm-up one too long", one_f_one_b_long_warmup),
        ("a warm-up one too short", one_f_one_b_short_warmup),
        ("GPipe's order: all forwards, then all backwards", one_f_one_b_is_gpipe),
        ("the cool-down's backwards in reverse", one_f_one_b_backwards_reversed),
        ("takes torch's order from the private schedules._get_1f1b_rank_ops",
         one_f_one_b_from_torchs_schedule),
    ],
    "8.5": [
        ("GPipe's order: every chunk's forward, then every backward", interleaved_is_gpipe),
        ("virtual stages in the wrong order: backwards visit chunk 0 first",
         interleaved_backward_chunks_in_forward_order),
        ("virtual stages in the wrong order: forwards start at the last chunk",
         interleaved_forward_chunks_last_first),
        ("a stage's chunks taken as consecutive virtual stages (s·v + c)",
         interleaved_chunks_as_consecutive_stages),
        ("1F1B's warm-up, without the later chunks' (v − 1)·p forwards",
         interleaved_one_f_one_b_warmup),
        ("a warm-up one forward too long", interleaved_long_warmup),
        ("every forward first when m = p", interleaved_all_forwards_when_one_round),
        ("plain 1F1B on each chunk in turn", interleaved_one_f_one_b_per_chunk),
        ("takes torch's order from ScheduleInterleaved1F1B's private rank ops",
         interleaved_from_torchs_schedule),
        ("rounds of p micro-batches when m is not a multiple of p (Megatron-LM's rule only)",
         edited_solution(8, (
             "    r = m // rounds  # micro-batches per round\n",
             "    r = p  # micro-batches per round\n",
         )).interleaved_one_f_one_b),
        ("m not a multiple of the rounds: no ValueError",
         edited_solution(8, (
             "    if m % rounds:\n        raise ValueError(",
             "    if False:\n        raise ValueError(",
         )).interleaved_one_f_one_b),
    ],
}
