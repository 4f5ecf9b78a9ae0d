"""Seeded bugs for Lesson 08: the typical mistakes each check of tasks 8.1-8.5 must catch.

``BUGS[task_id]`` lists ``(what is wrong, implementation)``; tests/test_checks.py proves every one
fails at least one case of its task. Each bug is the lesson's solution with one step changed
(:func:`bugs.edited_solution`), or a small subclass of its layers; the cheats wrap what the task
re-implements (DTensor's ``parallelize_module``, ``torch.distributed.pipelining``): the registry's
``forbidden`` gate scores those 0. The full-weight layers (8.1, 8.2) give the right values and
collectives and fail only the meter's bounds: tests/test_lesson08.py holds them to exactly that.
An edited solution's ``ColumnParallelLinear`` comes with its own ``RowParallelLinear`` (the
checks' companion lookup reads its module); a hand-written 8.1 column layer is defined beside its
row layer (:func:`_beside`), as one notebook cell defines both.
"""

from __future__ import annotations

import copy
import importlib
import logging
import types

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from autograder import course
from autograder.loading import load_tasks
from bugs import edited_solution

_lesson = load_tasks(course.lesson(8).source)  # the correct layers and schedules


def _mesh(group):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group or dist.group.WORLD, "cpu")


def _own(size, group):
    """This rank's slice of an axis split into equal parts of ``size``."""
    r = dist.get_rank(group)
    return slice(r * size, (r + 1) * size)


# --------------------------------------------------------------------------- task 8.1


def _beside(column, row):
    """``column`` as one notebook cell defining it beside ``row`` gives it: its ``__init__``
    sees ``row`` as the global name RowParallelLinear (what the checks' companion lookup reads)."""
    init = column.__init__
    bound = types.FunctionType(init.__code__, {**init.__globals__, "RowParallelLinear": row},
                               init.__name__, init.__defaults__, init.__closure__)
    name = column.__name__.lstrip("_")
    return type(name, (column,), {"__init__": bound, "__doc__": column.__doc__,
                                  "__module__": column.__module__, "__qualname__": name})


def _column(*edits):
    """The solution's ColumnParallelLinear, with its RowParallelLinear, after ``edits``."""
    return edited_solution(8, *edits).ColumnParallelLinear


def _by_global_rank(features):
    """The edit slicing a layer's ``features`` by the global rank, not the rank in the group."""
    old = f"t, r = dist.get_world_size(group), dist.get_rank(group)\n        if linear.{features}"
    return old, old.replace("dist.get_rank(group)", "dist.get_rank()")


ColumnGlobalRank = _column(_by_global_rank("out_features"), _by_global_rank("in_features"))


class _ColumnFullWeight(_lesson.ColumnParallelLinear):
    """Keeps every rank's rows of the weight and multiplies by the whole matrix, then keeps its
    own output features: right values and collectives, t times the weights and the FLOPs."""

    def __init__(self, linear, group=None, gather_output=False):
        super().__init__(linear, group, gather_output)
        self.rows = _own(self.weight.shape[0], group)
        self.full_weight = linear.weight.detach().clone()  # (out, in): every rank's rows
        self.full_bias = linear.bias.detach().clone()

    def forward(self, x):
        weight, bias = self.full_weight.clone(), self.full_bias.clone()
        weight[self.rows], bias[self.rows] = self.weight, self.bias  # its own rows, with grad
        y = F.linear(_lesson.CopyToTP.apply(x, self.group), weight, bias)[..., self.rows]
        return _lesson.GatherFromTP.apply(y, self.group) if self.gather_output else y


class _RowFullWeight(_lesson.RowParallelLinear):
    """Keeps every rank's columns and multiplies the zero-padded input by the whole matrix."""

    def __init__(self, linear, group=None, input_is_parallel=True):
        super().__init__(linear, group, input_is_parallel)
        self.cols = _own(self.weight.shape[1], group)
        self.full_weight = linear.weight.detach().clone()  # (out, in): every rank's columns

    def forward(self, x):
        x = x if self.input_is_parallel else _lesson.ScatterToTP.apply(x, self.group)
        weight = self.full_weight.clone()
        weight[:, self.cols] = self.weight  # its own columns, with grad
        x = F.pad(x, (self.cols.start, weight.shape[1] - self.cols.stop))  # zeros elsewhere
        return _lesson.ReduceFromTP.apply(F.linear(x, weight), self.group) + self.bias


ColumnFullWeight = _beside(_ColumnFullWeight, _RowFullWeight)


class _DTensorLinear(nn.Module):
    style = "ColwiseParallel"

    def __init__(self, linear, group=None, **options):
        super().__init__()
        from torch.distributed.tensor import parallel

        self.linear = copy.deepcopy(linear)
        parallel.parallelize_module(self.linear, _mesh(group), getattr(parallel, self.style)())
        self.weight, self.bias = self.linear.weight, self.linear.bias

    def forward(self, x):
        return self.linear(x)


class _DTensorRow(_DTensorLinear):
    style = "RowwiseParallel"


class _ColumnDTensor(_DTensorLinear):
    """The cheat: torch's ColwiseParallel / RowwiseParallel through parallelize_module."""


ColumnDTensor = _beside(_ColumnDTensor, _DTensorRow)


# --------------------------------------------------------------------------- task 8.2


def _sequence_parallel(*edits):
    return edited_solution(8, *edits).SequenceParallelMLP


_NORM_SUMMED = ("        weight = SumGradOverTP.apply(self.norm.weight, self.group)\n"
                "        bias = SumGradOverTP.apply(self.norm.bias, self.group)\n")
_NORM_NOT_SUMMED = (_NORM_SUMMED, "        weight, bias = self.norm.weight, self.norm.bias\n")
SPNormGradsNotReduced = _sequence_parallel(_NORM_NOT_SUMMED)


class SPNormReducedOnAccumulatedGrad(SPNormGradsNotReduced):
    """Sums the LayerNorm's .grad after it accumulated: the second pass counts the first t times."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for p in self.norm.parameters():
            p.register_post_accumulate_grad_hook(
                lambda p: dist.all_reduce(p.grad, group=self.group))


class SPFullWidth(_lesson.SequenceParallelMLP):
    """Keeps every rank's weights and runs the full-width MLP on the gathered sequence, the
    other ranks' features multiplied by zero: right values and collectives, t times the weights
    and the FLOPs."""

    def __init__(self, norm, linear1, linear2, group=None):
        super().__init__(norm, linear1, linear2, group)
        self.cols = _own(self.linear1.out_features, group)
        self.full1 = linear1.weight.detach().clone()  # (f, h): every rank's rows
        self.full_bias1 = linear1.bias.detach().clone()
        self.full2 = linear2.weight.detach().clone()  # (h, f): every rank's columns
        self.mine = torch.zeros(linear1.out_features)
        self.mine[self.cols] = 1.0

    def forward(self, x):
        sum_grad, norm, group = _lesson.SumGradOverTP.apply, self.norm, self.group
        h = F.layer_norm(x, norm.normalized_shape, sum_grad(norm.weight, group),
                         sum_grad(norm.bias, group), norm.eps)
        h = _lesson.SequenceAllGather.apply(h, group)
        w1, b1, w2 = self.full1.clone(), self.full_bias1.clone(), self.full2.clone()
        w1[self.cols], b1[self.cols] = self.linear1.weight, self.linear1.bias  # with grad
        w2[:, self.cols] = self.linear2.weight
        a = F.gelu(F.linear(h, w1, b1)) * self.mine  # (b, s, f): only this rank's features count
        return (_lesson.SequenceReduceScatter.apply(F.linear(a, w2), group)
                + sum_grad(self.linear2.bias, group))


class SPDTensor(nn.Module):
    """The cheat: SequenceParallel, ColwiseParallel and RowwiseParallel through
    parallelize_module."""

    def __init__(self, norm, linear1, linear2, group=None):
        super().__init__()
        from torch.distributed.tensor import Shard, parallel

        self.norm, self.linear1, self.linear2 = norm, copy.deepcopy(linear1), copy.deepcopy(linear2)
        parallel.parallelize_module(self, _mesh(group), {
            "norm": parallel.SequenceParallel(),
            "linear1": parallel.ColwiseParallel(input_layouts=Shard(1)),
            "linear2": parallel.RowwiseParallel(output_layouts=Shard(1))})

    def forward(self, x):
        return self.linear2(F.gelu(self.linear1(self.norm(x))))


# --------------------------------------------------------------------------- task 8.3


def _gpipe(*edits):
    return edited_solution(8, *edits).gpipe


def gpipe_interleaved(stage, microbatches, targets, loss_fn):
    """Backward of each micro-batch right after its forward: correct gradients, but not GPipe
    (and it holds one activation instead of m). The solution's gpipe, one micro-batch a call."""
    if len({len(x) for x in microbatches}) > 1:  # the edge's check, so that it has one defect
        raise ValueError("the micro-batches must all have the same size")
    m = len(microbatches)
    losses = [_lesson.gpipe(stage, [x], [y], lambda out, target: loss_fn(out, target) / m)
              for x, y in zip(microbatches, targets)]
    return None if losses[0] is None else sum(losses)


def gpipe_with_torch_pipelining(stage, microbatches, targets, loss_fn):
    """The cheat: torch.distributed.pipelining's PipelineStage and ScheduleGPipe."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank, stages = dist.get_rank(), dist.get_world_size()
    schedule = ScheduleGPipe(PipelineStage(stage, rank, stages, torch.device("cpu")),
                             n_microbatches=len(microbatches), loss_fn=loss_fn)
    losses = []
    if rank == 0:
        schedule.step(torch.cat(microbatches))
    elif rank == stages - 1:
        schedule.step(target=torch.cat(targets), losses=losses)
    else:
        schedule.step()
    return torch.stack(losses).mean().detach() if losses else None


def _with_copied_p2p() -> types.FunctionType:
    """The solution's gpipe with every message sent through ``_send_and_receive``, bound to
    torch's private schedules._batch_p2p copied at load time: a new function with its code (the
    source names neither the helper nor pipelining)."""
    line = "\n            {}\n"  # gpipe's messages, at its loops' indentation
    wait = "[work.wait() for work in _send_and_receive([dist.P2POp(dist.{}, {})])]"
    batched = _gpipe(*((line.format(old), line.format(wait.format(*new))) for old, new in (
        ("dist.recv(x, src=rank - 1)", ("irecv", "x, rank - 1")),
        ("dist.send(y.detach(), dst=rank + 1)", ("isend", "y.detach(), rank + 1")),
        ("dist.recv(grad, src=rank + 1)", ("irecv", "grad, rank + 1")),
        ("dist.send(inputs[i].grad, dst=rank - 1)", ("isend", "inputs[i].grad, rank - 1")))))
    helper = importlib.import_module("torch.distributed." + "pipelining.schedules")._batch_p2p
    names = {**batched.__globals__, "logger": logging.getLogger("gpipe")}
    names["_send_and_receive"] = types.FunctionType(helper.__code__, names, "_send_and_receive")
    return types.FunctionType(batched.__code__, names, "gpipe")


# --------------------------------------------------------------------------- task 8.4


def _one_f_one_b(warmup):
    """The solution's 1F1B with ``warmup`` forwards first."""
    return edited_solution(8, ("warmup = min(num_stages - stage - 1, num_microbatches)",
                               f"warmup = {warmup}")).one_f_one_b


def one_f_one_b_from_torchs_schedule(stage, num_stages, num_microbatches):
    """The order of torch's own 1F1B, from a private helper of torch.distributed.pipelining."""
    from torch.distributed.pipelining import schedules

    p, m = num_stages, num_microbatches
    warmup = min(p - stage - 1, m)
    actions = schedules._get_1f1b_rank_ops(1, p, warmup, m - warmup, warmup, stage,
                                           forward_stage_index=lambda _: stage,
                                           backward_stage_index=lambda _: stage)
    return [(a.computation_type.value, a.microbatch_index) for a in actions if a is not None]


# --------------------------------------------------------------------------- task 8.5


def _interleaved(*edits):
    return edited_solution(8, *edits).interleaved_one_f_one_b


def _interleaved_warmup(warmup):
    """The solution's interleaved 1F1B with ``warmup`` forward chunk-steps first."""
    return _interleaved(("warmup = min((p - stage - 1) * 2 + (v - 1) * r, total)",
                         f"warmup = {warmup}"))


def interleaved_one_f_one_b_per_chunk(stage, num_stages, num_microbatches, chunks):
    """Plain 1F1B over the v·p virtual stages, this stage's chunks one after another."""
    virtual = chunks * num_stages
    return [(op, i, c) for c in range(chunks)
            for op, i in _lesson.one_f_one_b(c * num_stages + stage, virtual, num_microbatches)]


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


_CHUNKS = "chunk if op == \"F\" else v - 1 - chunk)"  # forwards chunk 0 first, backwards last

BUGS = {
    "8.1": [
        ("all-reduce in the wrong direction (f and g swapped)", _column(
            ("x = CopyToTP.apply(x, self.group)", "x = ReduceFromTP.apply(x, self.group)"),
            ("y = ReduceFromTP.apply(F.linear(x, self.weight), self.group)",
             "y = CopyToTP.apply(F.linear(x, self.weight), self.group)"))),
        ("the row layer's bias added on every rank before the all-reduce", _column((
            "y = ReduceFromTP.apply(F.linear(x, self.weight), self.group)  # g: sum the partial "
            "sums\n        return y if self.bias is None else y + self.bias",
            "return ReduceFromTP.apply(F.linear(x, self.weight, self.bias), self.group)"))),
        ("f forgotten: the input gradient is not all-reduced", _column((
            "x = CopyToTP.apply(x, self.group)  # f: the input gradient is summed over ranks\n"
            "        ", ""))),
        ("slices by the global rank instead of the rank in the group", ColumnGlobalRank),
        ("wraps parallelize_module (ColwiseParallel, RowwiseParallel)", ColumnDTensor),
        ("keeps the whole weights and multiplies by them on every rank", ColumnFullWeight),
        ("splits features that do not divide by the group size unevenly (no ValueError)",
         _column(("        if linear.out_features % t:\n            raise ValueError(",
                  "        if False:\n            raise ValueError("))),
    ],
    "8.2": [
        ("the LayerNorm gradients not reduced", SPNormGradsNotReduced),
        ("linear2's bias gradient not reduced (it is used on a shard)", _sequence_parallel((
            "bias2 = SumGradOverTP.apply(self.linear2.bias, self.group)",
            "bias2 = self.linear2.bias"))),
        ("the LayerNorm runs on the gathered sequence", _sequence_parallel((
            _NORM_SUMMED + "        h = F.layer_norm(x, self.norm.normalized_shape, weight, bias, "
            "self.norm.eps)  # (b, s/t, h)\n        h = SequenceAllGather.apply(h, self.group)",
            "        h = self.norm(SequenceAllGather.apply(x, self.group))"))),
        ("all-reduce then slice instead of reduce-scatter", _sequence_parallel((
            "        ctx.group = group\n        return _reduce_scatter_seq(x, group)\n",
            "        ctx.group = group\n"
            "        x = ReduceFromTP.apply(x, group)  # every rank gets the whole sum\n"
            "        return x.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)]"
            ".contiguous()\n"))),
        ("the all-gather's backward slices instead of reduce-scattering", _sequence_parallel((
            "return _reduce_scatter_seq(grad, ctx.group), None",
            "t, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)\n"
            "        return grad.chunk(t, dim=1)[r].contiguous(), None"))),
        ("the LayerNorm .grad reduced after accumulation", SPNormReducedOnAccumulatedGrad),
        ("wraps parallelize_module (SequenceParallel)", SPDTensor),
        ("keeps the whole weights and runs the full-width MLP on every rank", SPFullWidth),
        ("one rank: skips the collectives, and linear2's bias with them", _sequence_parallel((
            "        ### BEGIN SOLUTION\n        weight = SumGradOverTP.apply(self.norm.weight",
            "        ### BEGIN SOLUTION\n        if dist.get_world_size(self.group) == 1:\n"
            "            return F.linear(F.gelu(self.linear1(self.norm(x))), self.linear2.weight)\n"
            "        weight = SumGradOverTP.apply(self.norm.weight"))),
        ("the LayerNorm gradients summed by hooks each forward registers (a no_grad forward leaves "
         "one behind)", _sequence_parallel((
             _NORM_SUMMED,
             "        for q in (self.norm.weight, self.norm.bias):\n"
             "            def once(g, handle=[], group=self.group):\n"
             "                handle[0].remove()\n"
             "                g = g.clone()\n"
             "                dist.all_reduce(g, group=group)\n"
             "                return g\n"
             "            once.__defaults__[0].append(q.register_hook(once))\n"
             "        weight, bias = self.norm.weight, self.norm.bias\n"))),
    ],
    "8.3": [
        ("micro-batch losses not scaled by 1/m", _gpipe((
            "loss = loss_fn(outputs[i], targets[i]) / m  # the mean over micro-batches\n"
            "            loss.backward()\n            total += loss.detach()\n",
            "loss = loss_fn(outputs[i], targets[i])  # not divided by m\n"
            "            loss.backward()\n            total += loss.detach() / m\n"))),
        ("gradients sent to the wrong stage (stage 0)", _gpipe((
            "dist.send(inputs[i].grad, dst=rank - 1)", "dist.send(inputs[i].grad, dst=0)"))),
        ("backward right after each forward (not GPipe)", gpipe_interleaved),
        ("wraps torch.distributed.pipelining (ScheduleGPipe)", gpipe_with_torch_pipelining),
        ("sends through a load-time copy of torch's private schedules._batch_p2p",
         _with_copied_p2p()),
        ("first and last stage taken as exclusive: one stage never computes the loss", _gpipe((
            "        if last:\n            loss = loss_fn",
            "        if last and not first:\n            loss = loss_fn"))),
        ("the receive buffer shaped by microbatches[rank] (this stage's index, not the "
         "micro-batch's)", _gpipe((
             "            x = torch.empty_like(microbatches[i])\n",
             "            x = torch.empty_like(microbatches[rank])\n"))),
        ("micro-batches of different sizes: no ValueError", _gpipe((
            "    if len(sizes) > 1:\n        raise ValueError(f\"the micro-batches",
            "    if False:\n        raise ValueError(f\"the micro-batches"))),
    ],
    "8.4": [
        ("a warm-up one too long", _one_f_one_b("min(num_stages - stage, num_microbatches)")),
        ("a warm-up one too short",
         _one_f_one_b("max(0, min(num_stages - stage - 2, num_microbatches))")),
        ("GPipe's order: all forwards, then all backwards", _one_f_one_b("num_microbatches")),
        ("the cool-down's backwards in reverse", edited_solution(8, (
            "order += [(\"B\", i) for i in range(num_microbatches - warmup, num_microbatches)]",
            "order += [(\"B\", i) for i in reversed(range(num_microbatches - warmup, "
            "num_microbatches))]")).one_f_one_b),
        ("takes torch's order from the private schedules._get_1f1b_rank_ops",
         one_f_one_b_from_torchs_schedule),
    ],
    "8.5": [
        ("GPipe's order: every chunk's forward, then every backward", _interleaved_warmup("total")),
        ("virtual stages in the wrong order: backwards visit chunk 0 first",
         _interleaved((_CHUNKS, "chunk)"))),
        ("virtual stages in the wrong order: forwards start at the last chunk",
         _interleaved((_CHUNKS, "v - 1 - chunk if op == \"F\" else chunk)"))),
        ("a stage's chunks taken as consecutive virtual stages (s·v + c)", _interleaved((
            "rnd, within = divmod(k, r * v)\n        chunk = within // r\n"
            "        return (op, rnd * r + within % r,",
            "i, chunk = divmod(k, v)  # micro-batch i's chunks in a row\n        return (op, i,"))),
        ("1F1B's warm-up, without the later chunks' (v − 1)·p forwards",
         _interleaved_warmup("min((p - stage - 1) * 2, total)")),
        ("a warm-up one forward too long",
         _interleaved_warmup("min((p - stage - 1) * 2 + (v - 1) * r + 1, total)")),
        ("every forward first when m = p",
         _interleaved_warmup("total if m == p else min((p - stage - 1) * 2 + (v - 1) * r, total)")),
        ("plain 1F1B on each chunk in turn", interleaved_one_f_one_b_per_chunk),
        ("takes torch's order from ScheduleInterleaved1F1B's private rank ops",
         interleaved_from_torchs_schedule),
        ("rounds of p micro-batches when m is not a multiple of p (Megatron-LM's rule only)",
         _interleaved(("    r = m // rounds  # micro-batches per round\n",
                       "    r = p  # micro-batches per round\n"))),
        ("m not a multiple of the rounds: no ValueError",
         _interleaved(("    if m % rounds:\n        raise ValueError(",
                       "    if False:\n        raise ValueError("))),
    ],
}
