"""Checks for Lesson 08, "Model parallelism": tasks 8.1-8.5.

Every case runs on real gloo ranks and compares with the unsharded model in one process, built
from the same seeded weights: outputs, input gradients and every parameter's gradient (each
rank's slice against the same slice of the full gradient). The collective tracer
(:mod:`kit.trace`) grades the communication: which collectives forward and backward made and
how many bytes (8.1, 8.2), and every point-to-point message's peer and size (8.3). The meter
(:mod:`kit.meter`) grades what the techniques save, from torch's allocator and FLOP counter: the
weight bytes a rank keeps and the matmul FLOPs it runs, 1/t of the layers' (8.1, 8.2), and the
activations a pipeline stage holds while its 1F1B order is played (8.4). Task 8.2 also reads the
autograd graph for what the LayerNorm saved for backward. Task 8.4's orders are checked as
properties over a grid of pipeline shapes (valid, as fast as GPipe, at most p − s in flight),
then played on real ranks by the grader's own executor; Task 8.5's interleaved orders are played
together by :func:`kit.lessons.parallelism.simulate_schedule` over a grid of (stages, chunks,
micro-batches): no deadlock, Megatron-LM's bubble, its bound on the chunks in flight. One
shared run per world size serves every case of a task; the unsharded model's answers live in
:mod:`autograder.references.lesson08`, named here by string.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from autograder.compare import CheckFailed, per_rank, short, tensor_mismatch
from autograder.registry import task

TIMEOUT = 30.0  # seconds per launch with forked ranks (spawned ones re-import torch: 4x)
PIPE_TIMEOUT = 15.0  # a pipeline launch: a deadlocked order ends here

# What the tasks re-implement (autograder.gates scores a use 0): DTensor's tensor parallelism
# for 8.1 and 8.2 (all of torch.distributed.tensor and its old name, torch.distributed._tensor),
# and the collectives with a backward that are its f and g (torch.distributed.nn.functional,
# the functional collectives' autograd versions); torch's pipeline schedules for 8.3 and 8.4 (all
# of torch.distributed.pipelining: its schedule internals, _Action, _format_pipeline_order,
# get_schedule_class and the private helpers that build each rank's order).
DTENSOR = ("torch.distributed.tensor.DTensor", "torch.distributed.tensor.distribute_tensor",
           "torch.distributed.tensor.distribute_module",
           "torch.distributed.tensor.parallel.parallelize_module",
           "torch.distributed.tensor.parallel.ColwiseParallel",
           "torch.distributed.tensor.parallel.RowwiseParallel",
           "torch.distributed.tensor.parallel.SequenceParallel",
           "torch.distributed.tensor", "torch.distributed._tensor",
           "torch.distributed.nn.functional",
           "torch.distributed._functional_collectives.all_gather_tensor_autograd",
           "torch.distributed._functional_collectives.reduce_scatter_tensor_autograd",
           "torch.distributed._functional_collectives.all_to_all_single_autograd")
PIPELINING = ("torch.distributed.pipelining.pipeline", "torch.distributed.pipelining.PipelineStage",
              "torch.distributed.pipelining.ScheduleGPipe",
              "torch.distributed.pipelining.Schedule1F1B",
              "torch.distributed.pipelining.ScheduleInterleaved1F1B",
              "torch.distributed.pipelining")
# Imported once before the ranks fork (Task.preload): ``tensor.backward(grad)`` imports sympy
# through torch.fx's symbolic shapes the first time it runs (1-4 s per process), the meter's
# FLOP counter (FlopCounterMode) imports torch._dynamo on first use (~2 s per process), and the
# libraries a cheat wraps take ~0.6 s each.
TP_PRELOAD = ("torch.fx.experimental.symbolic_shapes", "torch._dynamo",
              "torch.distributed.tensor.parallel")
PIPE_PRELOAD = ("torch.fx.experimental.symbolic_shapes", "torch.distributed.pipelining")

ALL_GATHER = {"all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_single"}
REDUCE_SCATTER = {"reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
                  "reduce_scatter_single"}


# --------------------------------------------------------------------------- shared helpers


def _local(t: Any) -> Any:
    """A plain tensor copy, or a description of whatever else it is (a DTensor is not a
    rank's slice: the task keeps plain tensors)."""
    if t is None:
        return None
    if type(t) not in (torch.Tensor, nn.Parameter):
        return f"<a {type(t).__name__}>"
    return t.detach().clone()


def _collectives(events: list[Any]) -> list[list[Any]]:
    return [[e.op, int(e.nbytes)] for e in events if e.kind == "collective"]


# None if a result equals the expected tensor up to float32 rounding; else what is wrong.
_mismatch = partial(tensor_mismatch, rtol=1e-4, atol=1e-5)


def _compare_tensors(got: Any, expected: dict[str, Any], hints: dict[str, str] | None = None,
                     recipes: dict[str, str] | None = None, cause: str = "") -> None:
    """``expected[setting][rank][name]`` tensors; every one must match ``got``'s. With
    ``cause``, a mismatch's cause is ``cause`` and the tensor's name: the same tensor wrong in a
    later case of the same run (more ranks, groups) follows the first."""
    hints, recipes = hints or {}, recipes or {}
    if not isinstance(got, dict) or set(got) != set(expected):
        raise CheckFailed("the ranks' results could not be read", expected=sorted(expected),
                          got=repr(got)[:200])
    for setting, ranks in expected.items():
        for rank, want in enumerate(ranks):
            have = got[setting][rank]
            for name, tensor in want.items():
                value = have.get(name) if isinstance(have, dict) else have
                problem = _mismatch(value, tensor)
                if problem is not None:
                    raise CheckFailed(f"{setting}, rank {rank}: {name} {problem}",
                                      expected=short(tensor), got=short(value),
                                      hint=hints.get(name.split(" ")[0], ""),
                                      recipe=recipes.get(name.split(" ")[0], ""),
                                      cause=f"{cause} {name}" if cause else "")


def _launch(fn: Any, args: tuple, world_size: int, preload: tuple[str, ...],
            timeout: float = TIMEOUT) -> list[Any]:
    """Every rank's return value of ``fn(*args)`` on ``world_size`` forked (or spawned) ranks."""
    from kit.launcher import default_start_method, run_ranks

    if default_start_method("gloo") != "fork":
        timeout *= 4  # spawned ranks re-import torch and the lesson
    return list(run_ranks(fn, args, world_size=world_size, timeout=timeout, echo=False,
                          preload=preload))


# The meter's layers, for 8.1 and 8.2: large enough that the weights dominate the biases a
# correct layer keeps whole (h = 64, f = 256: each weight 64 KiB), on (batch 2, seq 8) tokens.
METER_HIDDEN, METER_FFN, METER_TOKENS = 64, 256, (2, 8)
METER_WORLD = 4  # the bounds read the 4-rank runs: a layer that keeps everything holds 4x its share


def _kept_and_flops(build: Any, forward: Any) -> dict[str, int]:
    """Bytes ``build()`` allocated that are still alive once it returns (what the layer keeps),
    and the FLOPs of ``forward(layer)`` plus its backward, from the allocator and
    FlopCounterMode."""
    from kit import meter

    with meter.track() as kept:
        layer = build()
    with meter.count_flops() as flops:
        forward(layer).sum().backward()
    return {"weight bytes": kept.alive, "flops": flops.total}


def _metered(key: str) -> Any:
    """A bound case's pick: every rank's ``metered[key]``."""
    def pick(ranks: Any) -> dict[str, Any]:
        if not isinstance(ranks, list):
            return {"error": repr(ranks)[:200]}
        return {"measured": [r["metered"][key] if isinstance(r, dict) and "metered" in r else None
                             for r in ranks]}

    return pick
# --------------------------------------------------------------------------- task 8.1


HIDDEN, FFN = 8, 16  # the MLP: Linear(8, 16), GELU, Linear(16, 8)
TP_SHAPE = (3, 5, HIDDEN)  # (batch, seq, hidden) input


def mlp(seed: int) -> tuple[nn.Linear, nn.Linear]:
    """The full MLP's two layers, the same on every rank and in the trusted reference."""
    torch.manual_seed(seed)
    return nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)


def tp_data(seed: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The input and a random output weighting (so every output element matters)."""
    g = torch.Generator().manual_seed(seed * 31 + replica)
    return torch.randn(TP_SHAPE, generator=g), torch.randn(TP_SHAPE, generator=g)


def _metered_mlp(column_cls: Any, row_cls: Any, seed: int) -> dict[str, int]:
    """The metered column-GELU-row MLP over the whole world: what its layers keep, its FLOPs."""
    torch.manual_seed(seed + 300)
    # The full layers and the input exist before the track: only what the layers keep counts.
    lin1, lin2 = nn.Linear(METER_HIDDEN, METER_FFN), nn.Linear(METER_FFN, METER_HIDDEN)
    x = torch.randn(*METER_TOKENS, METER_HIDDEN, generator=torch.Generator().manual_seed(seed),
                    requires_grad=True)
    return _kept_and_flops(lambda: (column_cls(lin1), row_cls(lin2)),
                           lambda layers: layers[1](F.gelu(layers[0](x))))


def _tp_mlp_on_rank(column_cls: Any, row_cls: Any, seed: int) -> dict[str, Any]:
    """One rank: the column-GELU-row MLP on the whole world (and, on 4 ranks, on subgroups of
    2), each layer alone with its other option, and the metered MLP."""
    import torch.distributed as dist

    from kit.trace import trace

    rank, world = dist.get_rank(), dist.get_world_size()
    split = 2 if world == 4 else 0
    out: dict[str, Any] = {}
    settings = [("world", None, 0)]
    if split:
        groups = [dist.new_group(list(range(g, g + split))) for g in range(0, world, split)]
        settings.append((f"groups of {split}", groups[rank // split], 1 + rank // split))
    for name, group, replica in settings:
        lin1, lin2 = mlp(seed)
        x, w = tp_data(seed, replica)
        x.requires_grad_()
        col, row = column_cls(lin1, group=group), row_cls(lin2, group=group)
        with trace() as fwd:
            y = row(F.gelu(col(x)))
        loss = (y * w).sum()
        with trace() as bwd:
            loss.backward()
        out[name] = {"output": _local(y), "input grad": _local(x.grad),
                     "column weight": _local(col.weight),
                     "column weight grad": _local(col.weight.grad),
                     "column bias grad": _local(col.bias.grad),
                     "row weight": _local(row.weight), "row weight grad": _local(row.weight.grad),
                     "row bias grad": _local(row.bias.grad),
                     "forward": _collectives(fwd.events), "backward": _collectives(bwd.events)}
    # Each layer alone, with the options the MLP does not use.
    lin1, lin2 = mlp(seed)
    x, w = tp_data(seed, 0)
    x.requires_grad_()
    col = column_cls(lin1, gather_output=True)
    y = col(x)
    (y * torch.cat([w, w], dim=-1)).sum().backward()
    out["ColumnParallelLinear(gather_output=True)"] = {
        "output": _local(y), "input grad": _local(x.grad), "weight grad": _local(col.weight.grad)}
    h = torch.randn(3, 5, FFN, generator=torch.Generator().manual_seed(seed + 7),
                    requires_grad=True)
    row = row_cls(lin2, input_is_parallel=False)
    y = row(h)
    (y * w).sum().backward()
    out["RowParallelLinear(input_is_parallel=False)"] = {
        "output": _local(y), "input grad": _local(h.grad), "weight grad": _local(row.weight.grad)}
    out["metered"] = _metered_mlp(column_cls, row_cls, seed)
    if world == 4:  # features that do not divide by the group size: refused, not split unevenly
        out["indivisible"] = {label: _raised_by(lambda cls=cls, shape=shape: cls(nn.Linear(*shape)))
                              for label, cls, shape in _indivisible_layers(column_cls, row_cls)}
    return out


def _indivisible_layers(column_cls: Any, row_cls: Any) -> list[tuple[str, Any, tuple[int, int]]]:
    """The layers whose split features (6) do not divide by 4 ranks."""
    return [("ColumnParallelLinear(nn.Linear(8, 6)) on 4 ranks", column_cls, (8, 6)),
            ("RowParallelLinear(nn.Linear(6, 8)) on 4 ranks", row_cls, (6, 8))]


def _raised_by(build: Any) -> str:
    try:
        build()
    except Exception as e:  # noqa: BLE001 - what it raised is the answer
        return f"{type(e).__name__}: {str(e)[:200]}"
    return "built a layer"


def _compare_indivisible(got: Any, expected: Any) -> None:
    for rank, r in enumerate(per_rank(got, 4)):
        for label, did in (r.get("indivisible") or {}).items() if isinstance(r, dict) else ():
            if not str(did).startswith("ValueError"):
                raise CheckFailed(
                    f"rank {rank}: {label}: 6 features do not split into 4 equal slices",
                    expected="a ValueError naming the constraint (the features must divide by "
                             "the group size)", got=did,
                    hint="Tensor parallelism gives every rank an equal slice: torch's "
                         "ColwiseParallel and RowwiseParallel shard evenly too. Refuse a size "
                         "that does not divide instead of giving ranks slices of different sizes.",
                    recipe="In __init__, before slicing: if linear.out_features % t (column) or "
                           "linear.in_features % t (row), raise ValueError(...) with both numbers.")
        if not isinstance(r, dict) or "indivisible" not in r:
            raise CheckFailed(f"rank {rank}: could not read what the indivisible layers did",
                              got=repr(r)[:200])


def _tp_run(world_size: int) -> Any:
    """The shared run of every 8.1 case on ``world_size`` ranks."""
    def run(column_cls: Any, seed: int) -> list[dict[str, Any]]:
        # Found here and handed to the ranks: a spawned rank could not find it beside a class
        # that travelled by value.
        row_cls = TP.companion(column_cls, "RowParallelLinear")
        if row_cls is None:
            raise CheckFailed("RowParallelLinear is not defined",
                              hint="Define RowParallelLinear in the same cell as "
                                   "ColumnParallelLinear.")
        return _launch(_tp_mlp_on_rank, (column_cls, row_cls, seed), world_size, TP.preload)

    run.__name__ = f"tp_mlp_on_{world_size}_ranks"
    return TP.shared(run)


TP_VALUE_KEYS = ("output", "input grad", "column weight", "column weight grad", "column bias grad",
                 "row weight", "row weight grad", "row bias grad")
TP_HINTS = {
    "output": "The row layer's partial products add up to the full output only after g sums "
              "them over the group; the bias belongs to the sum, so it is added once.",
    "input": "The input is used by every rank's slice, so its gradient is the sum over ranks: "
             "f's backward all-reduces it.",
    "column": "The column layer owns a contiguous block of output features: its rows of the "
              "weight and of the bias, chosen by its rank in the group.",
    "row": "The row layer owns a contiguous block of input features: its columns of the weight, "
           "and the whole bias.",
}
TP_RECIPES = {
    "output": "Forward: f (identity), the column layer's rows with their bias, GELU, the row "
              "layer's columns without bias, g (all-reduce), then the bias once.",
    "input": "Write f as an autograd Function whose forward returns the input unchanged and whose "
             "backward all-reduces a copy of the gradient over the group; apply it to the input "
             "of the column layer.",
    "column": "The column layer keeps the rows r*out/t to (r+1)*out/t of the weight and of the "
              "bias, r being the rank in the group (dist.get_rank(group)), as new Parameters.",
    "row": "The row layer keeps the columns r*in/t to (r+1)*in/t of the weight and the whole "
           "bias, added once, after the all-reduce.",
}


def _compare_mlp(settings: tuple[str, ...]) -> Any:
    def compare(got: Any, expected: list[dict[str, Any]]) -> None:
        got = per_rank(got, len(expected))
        for setting in settings:
            want = {setting: [{k: e[setting][k] for k in TP_VALUE_KEYS} for e in expected]}
            have = {setting: [g.get(setting, {}) if isinstance(g, dict) else {} for g in got]}
            _compare_tensors(have, want, TP_HINTS, TP_RECIPES, cause="the MLP's")

    return compare


def _compare_single_layers(got: Any, expected: list[dict[str, Any]]) -> None:
    got = per_rank(got, len(expected))
    hints = {"output": "gather_output=True all-gathers the output slices along the last "
                       "dimension, in rank order; input_is_parallel=False keeps this rank's "
                       "slice of the input's last dimension first.",
             "input": "The gradient of an all-gather is this rank's slice of the gradient; the "
                      "gradient of taking a slice is the all-gather of the slices' gradients.",
             "weight": "Each layer keeps its own slice of the weight (rows for column, columns "
                       "for row)."}
    for setting in ("ColumnParallelLinear(gather_output=True)",
                    "RowParallelLinear(input_is_parallel=False)"):
        want = {setting: [e[setting] for e in expected]}
        have = {setting: [g.get(setting, {}) if isinstance(g, dict) else {} for g in got]}
        _compare_tensors(have, want, hints)


def _compare_tp_calls(got: Any, expected: list[dict[str, Any]]) -> None:
    got = per_rank(got, len(expected))
    for rank, (g, e) in enumerate(zip(got, expected)):
        for setting in [s for s in ("world", "groups of 2") if s in e]:
            for phase in ("forward", "backward"):
                have = g.get(setting, {}).get(phase) if isinstance(g, dict) else None
                want = e[setting][phase]
                if have != want:
                    raise CheckFailed(
                        f"{setting}, rank {rank}: the collectives of the MLP's {phase} pass "
                        "([op, bytes] as the tracer saw them)", expected=want, got=have,
                        hint="A tensor-parallel MLP communicates exactly twice: one "
                             "all-reduce of the output in forward (g) and one of the input's "
                             "gradient in backward (f), each of the whole (batch, seq, hidden) "
                             "tensor.",
                        recipe="Put the only collective of forward in g's forward and the only "
                               "one of backward in f's backward; reduce nothing else (not the "
                               "weights' gradients, not the bias), and call them through "
                               "torch.distributed so the tracer sees them.")


TP = task(
    "8.1", forbidden=DTENSOR,
    preload=TP_PRELOAD,
    hint="Tensor parallelism splits each Linear over the ranks: the column layer computes a "
         "slice of the output features, the row layer a partial sum over its slice of the input "
         "features. Two conjugate operations carry all the communication: f (identity forward, "
         "all-reduce backward) and g (all-reduce forward, identity backward).",
    recipe="Let r be the rank in the group and t its size. Write f and g as "
           "torch.autograd.Function classes: each all-reduces a copy (all-reduce works in place) "
           "over the given group, and backward returns None for the group argument. "
           "ColumnParallelLinear keeps rows r*out/t to (r+1)*out/t of the weight and the bias as "
           "new Parameters (detached copies); forward applies f, then the linear map with its "
           "bias; with gather_output=True it all-gathers the output slices along the last "
           "dimension in rank order (backward: keep this rank's slice of the gradient). "
           "RowParallelLinear keeps columns r*in/t to (r+1)*in/t of the weight and the whole "
           "bias; forward (with input_is_parallel=False first keeping this rank's slice of the "
           "input's last dimension, whose backward all-gathers the gradient) multiplies without "
           "the bias, applies g, then adds the bias once.",
)
_TP_RUNS = {world_size: _tp_run(world_size) for world_size in (1, 2, 4)}


def _tp_expected(world_size: int) -> Any:
    return lambda seed: TP.trusted("tp_expected")(seed, world_size)


TP.case("the MLP on 1 rank equals nn.Linear, GELU, nn.Linear", uses=_TP_RUNS[1],
        compare=_compare_mlp(("world",)), expect=_tp_expected(1))
TP.case("the MLP on 2 ranks: output, input gradient and every slice's gradient equal the "
        "unsharded MLP's", uses=_TP_RUNS[2], compare=_compare_mlp(("world",)), weight=2,
        expect=_tp_expected(2))
TP.case("the same on 4 ranks, and on 4 ranks as two tensor-parallel groups of 2 (group=)",
        uses=_TP_RUNS[4], compare=_compare_mlp(("world", "groups of 2")), weight=2,
        expect=_tp_expected(4))


@TP.case("one all-reduce of the output in forward, one of the input gradient in backward "
         "(2 and 4 ranks, and groups of 2)", compare=_compare_tp_calls, weight=2,
         expect=lambda seed: (TP.trusted("tp_expected")(seed, 2)
                              + TP.trusted("tp_expected")(seed, 4)))
def _(impl: Any, seed: int) -> Any:
    return _TP_RUNS[2](impl, seed) + _TP_RUNS[4](impl, seed)


TP.case("ColumnParallelLinear(gather_output=True) and RowParallelLinear(input_is_parallel="
        "False) each equal nn.Linear (2 ranks)", uses=_TP_RUNS[2], compare=_compare_single_layers,
        expect=_tp_expected(2))
TP.case("features that do not divide by the group size (6 on 4 ranks): a ValueError naming the "
        "constraint", weight=0.5, uses=_TP_RUNS[4],
        pick=lambda ranks: [{"indivisible": r.get("indivisible")} if isinstance(r, dict) else r
                            for r in ranks],
        compare=_compare_indivisible, expect=lambda seed: None)

# What tensor parallelism saves, measured on the 4-rank run's metered MLP (h = 64, f = 256):
# each rank keeps and multiplies by 1/t of both weights. The 25% margin covers what a correct
# layer may keep or compute beside its slices (the whole second bias, a spare buffer); a layer
# that keeps (or multiplies by) the whole weights is t = 4 times the share: 3.2x the bound.
TP.bound("weight bytes each rank keeps after building both layers",
         formula="1.25 · ((h·f + f·h)/t + f/t + h) · 4 bytes: its rows of the first layer's "
                 "weight and bias, its columns of the second's, the second's bias whole",
         lost="the layers keep the whole weights on every rank: tensor parallelism's 1/t of the "
              "weights per rank is lost",
         hint="Tensor parallelism exists so that no rank holds a whole weight: each keeps only "
              "its slice, measured here in bytes allocated and still alive after the layers are "
              "built.",
         recipe="Copy only this rank's rows (column layer) or columns (row layer) into new "
                "Parameters, and keep no other copy of the full weight: not as an attribute, a "
                "buffer, or a tensor to assemble the full matrix from.",
         expect="tp_weight_bytes_bound", uses=_TP_RUNS[4], pick=_metered("weight bytes"),
         weight=4.5)
TP.bound("matmul FLOPs per rank, forward and backward",
         formula="1.25 · 3 · 2·N·(h·f + f·h)/t: the forward, input-gradient and weight-gradient "
                 "matmuls of this rank's slices on N tokens",
         lost="every rank multiplies by the whole weights: tensor parallelism's 1/t of the "
              "compute per rank is lost",
         hint="Tensor parallelism splits the compute too: each rank multiplies only by its "
              "slice, so its matmuls are 1/t of the layer's, counted by torch's FLOP counter.",
         recipe="Multiply the input by this rank's slice of the weight only: no full-size matrix "
                "(padded, concatenated or masked) and no second, unsharded pass.",
         unit="FLOPs", expect="tp_flops_bound", uses=_TP_RUNS[4], pick=_metered("flops"),
         weight=4.5)
# --------------------------------------------------------------------------- task 8.2

SP_BATCH, SP_SEQ = 2, 8  # (batch, seq, HIDDEN); seq divides by 1, 2 and 4
SP_PASSES = 2  # two forward/backward passes accumulate into .grad


def sp_modules(seed: int) -> tuple[nn.LayerNorm, nn.Linear, nn.Linear]:
    """The full block's LayerNorm and two layers, the same on every rank and in the reference."""
    torch.manual_seed(seed + 100)
    norm = nn.LayerNorm(HIDDEN)
    with torch.no_grad():  # not the default ones and zeros: their gradient must show
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    return norm, nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)


def sp_data(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass ``step``'s whole (batch, seq, hidden) input and output weighting."""
    g = torch.Generator().manual_seed(seed * 97 + step)
    shape = (SP_BATCH, SP_SEQ, HIDDEN)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def layer_norm_saved_bytes(output: torch.Tensor) -> int:
    """Bytes of activations (input, mean, 1/std) every layer norm in ``output``'s graph saved."""
    seen, stack, total = set(), [output.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name() == "NativeLayerNormBackward0":
            for attr in ("_saved_input", "_saved_result1", "_saved_result2"):
                t = getattr(node, attr, None)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        stack.extend(n for n, _ in node.next_functions)
    return total


def _metered_block(impl: Any, seed: int) -> dict[str, int]:
    """The metered LayerNorm-MLP block on this rank's sequence shard: what it keeps, its FLOPs."""
    import torch.distributed as dist

    t, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(seed + 400)
    # The full modules and the input exist before the track: only what the block keeps counts.
    norm = nn.LayerNorm(METER_HIDDEN)
    lin1, lin2 = nn.Linear(METER_HIDDEN, METER_FFN), nn.Linear(METER_FFN, METER_HIDDEN)
    x = torch.randn(*METER_TOKENS, METER_HIDDEN, generator=torch.Generator().manual_seed(seed))
    shard = x.chunk(t, dim=1)[rank].clone().requires_grad_()  # (b, s/t, h)
    return _kept_and_flops(lambda: impl(norm, lin1, lin2), lambda block: block(shard))


def _sp_without_grad(impl: Any, seed: int) -> dict[str, Any]:
    """A fresh block: a forward under torch.no_grad() (inference), then one training pass on an
    input shard that does not require grad. A crash is data: it fails only this edge's case."""
    import torch.distributed as dist

    rank, t = dist.get_rank(), dist.get_world_size()
    try:
        block = impl(*sp_modules(seed))
        x, w = sp_data(seed, 0)
        shard = x.chunk(t, dim=1)[rank].clone()  # no requires_grad: the input of a frozen stem
        with torch.no_grad():
            inferred = block(shard)
        y = block(shard)
        (y * w.chunk(t, dim=1)[rank]).sum().backward()
    except Exception as e:  # noqa: BLE001 - reported by the edge's case
        return {"raised": f"{type(e).__name__}: {e}"[:300]}
    return {"inference output": _local(inferred), "output": _local(y),
            "input grad": None if shard.grad is None else "a gradient",
            "grads": {f"{m}.{q}": _local(getattr(getattr(getattr(block, m, None), q, None),
                                                 "grad", None))
                      for m in ("norm", "linear1", "linear2") for q in ("weight", "bias")}}


def _sp_on_rank(impl: Any, seed: int, metered: bool = True) -> dict[str, Any]:
    import torch.distributed as dist

    from kit.trace import trace

    rank, t = dist.get_rank(), dist.get_world_size()
    norm, lin1, lin2 = sp_modules(seed)
    block = impl(norm, lin1, lin2)
    out: dict[str, Any] = {"outputs": [], "input grads": []}
    for step in range(SP_PASSES):
        x, w = sp_data(seed, step)
        shard = x.chunk(t, dim=1)[rank].clone().requires_grad_()  # (b, s/t, h)
        with trace() as fwd:
            y = block(shard)
        if step == 0:
            out["forward"] = _collectives(fwd.events)
            out["layer norm saved bytes"] = layer_norm_saved_bytes(y) if y.grad_fn else 0
        (y * w.chunk(t, dim=1)[rank]).sum().backward()
        out["outputs"].append(_local(y))
        out["input grads"].append(_local(shard.grad))
    out["grads"] = {f"{m}.{p}": _local(getattr(getattr(getattr(block, m, None), p, None),
                                               "grad", None))
                    for m in ("norm", "linear1", "linear2") for p in ("weight", "bias")}
    out["without grad"] = _sp_without_grad(impl, seed)
    if metered:
        out["metered"] = _metered_block(impl, seed)
    return out


_NORM_HINT = ("Each rank's LayerNorm saw only its shard of the sequence: its gradient is part "
              "of the whole, and the parts must be summed over the group in every backward pass.")
_NORM_RECIPE = ("Sum the LayerNorm gradients over the group once per backward pass (a gradient "
                "hook or an identity-forward / all-reduce-backward function on the weights where "
                "they are used), not on the accumulated .grad.")
SP_HINTS = {
    "output": "The block must compute what the unsharded LayerNorm, Linear, GELU, Linear does, "
              "for this rank's tokens: the all-gather and reduce-scatter replace the "
              "tensor-parallel all-reduce.",
    "input": "The all-gather's backward is a reduce-scatter: every rank's copy of the gathered "
             "sequence contributed to the loss.",
    "norm.weight": _NORM_HINT,
    "norm.bias": _NORM_HINT,
    "linear1.weight": "linear1 is column-parallel: each rank owns a block of its output features.",
    "linear1.bias": "linear1 is column-parallel: each rank owns a block of its output features.",
    "linear2.weight": "linear2 is row-parallel: each rank owns a block of its input features.",
    "linear2.bias": "linear2's bias is added on the shard, after the reduce-scatter: like the "
                    "LayerNorm's, each rank's copy saw only its own tokens.",
}
SP_RECIPES = {
    "output": "LayerNorm on the shard; all-gather along the sequence (dim 1); linear1's rows "
              "with their bias; GELU; linear2's columns without bias; reduce-scatter along the "
              "sequence; then linear2's whole bias.",
    "input": "Wrap the all-gather in an autograd Function whose backward reduce-scatters the "
             "gradient along the sequence, and the reduce-scatter in one whose backward "
             "all-gathers it.",
    "norm.weight": _NORM_RECIPE,
    "norm.bias": _NORM_RECIPE,
    "linear1.weight": "self.linear1 keeps the rows r*f/t to (r+1)*f/t of linear1's weight and "
                      "bias.",
    "linear1.bias": "self.linear1 keeps the rows r*f/t to (r+1)*f/t of linear1's weight and bias.",
    "linear2.weight": "self.linear2 keeps the columns r*f/t to (r+1)*f/t of linear2's weight.",
    "linear2.bias": "self.linear2 keeps the whole bias, added after the reduce-scatter; pass it "
                    "through the same identity-forward / all-reduce-backward function as the "
                    "LayerNorm's weights, once per pass.",
}


def _compare_sp_values(got: Any, expected: dict[str, Any]) -> None:
    want_ranks = expected["ranks"]
    got = per_rank(got, len(want_ranks))
    for rank, (g, e) in enumerate(zip(got, want_ranks)):
        for key in ("outputs", "input grads"):
            for step, want in enumerate(e[key]):
                have = g[key][step] if step < len(g.get(key, [])) else None
                problem = _mismatch(have, want)
                if problem is not None:
                    what = "output shard" if key == "outputs" else "input shard's gradient"
                    # the cause is what differs: the same on more ranks follows this case
                    raise CheckFailed(f"rank {rank}, pass {step + 1}: the {what} {problem}",
                                      expected=short(want), got=short(have), cause=what,
                                      hint=SP_HINTS[key.split(" ")[0].rstrip("s")],
                                      recipe=SP_RECIPES[key.split(" ")[0].rstrip("s")])
        for name, want in e["grads"].items():
            problem = _mismatch(g["grads"].get(name), want)
            if problem is not None:
                raise CheckFailed(f"rank {rank}: {name}.grad after {SP_PASSES} backward passes "
                                  f"{problem}", expected=short(want),
                                  got=short(g["grads"].get(name)), cause=f"{name}.grad",
                                  hint=SP_HINTS[name],
                                  recipe=SP_RECIPES[name])


def _compare_sp_calls(got: Any, expected: dict[str, Any]) -> None:
    n = expected["nbytes"]
    want = [["all_gather", n], ["reduce_scatter", n]]
    for rank, g in enumerate(per_rank(got, len(expected["ranks"]))):
        have = [[("all_gather" if op in ALL_GATHER else "reduce_scatter" if op in REDUCE_SCATTER
                  else op), nbytes] for op, nbytes in g.get("forward", [])]
        if have != want:
            extra = [f"{op} of {b} bytes" for op, b in have if [op, b] not in want]
            sent = (f": {', '.join(extra)} should not be sent (an all-reduce sends twice a "
                    "reduce-scatter's bytes and leaves every rank the whole sequence)"
                    if extra else "")
            raise CheckFailed(
                f"rank {rank}: the collectives of forward ([op, bytes of the whole gathered or "
                f"scattered (batch, seq, hidden) tensor]){sent}", expected=want,
                got=g.get("forward"),
                hint="One all-gather of the normalised shards before linear1 and one "
                     "reduce-scatter of linear2's partial sums; no all-reduce in forward.")


def _compare_sp_memory(got: Any, expected: dict[str, Any]) -> None:
    t = len(expected["ranks"])
    for rank, g in enumerate(per_rank(got, t)):
        have = g.get("layer norm saved bytes")
        if have != expected["saved"] // t:
            kept = (f"; it keeps {have / (expected['saved'] // t):g}x its share: activations of "
                    "more tokens than its s/t"
                    if isinstance(have, int) and have > expected["saved"] // t else "")
            raise CheckFailed(
                f"rank {rank}: bytes the LayerNorm saved for backward (its input, mean and "
                f"1/std), unsharded block: {expected['saved']}{kept}",
                expected=expected["saved"] // t,
                got=have, hint="Sequence parallelism saves memory only if the LayerNorm keeps "
                               "1/t of the activation for backward: this rank's tokens only.",
                recipe="Run the LayerNorm on this rank's (b, s/t, h) shard, before the "
                       "all-gather: the given norm module or F.layer_norm with its weights.")


SP = task(
    "8.2", forbidden=DTENSOR, preload=TP_PRELOAD,
    hint="Sequence parallelism runs the LayerNorm on this rank's shard of the sequence and "
         "splits the tensor-parallel all-reduce into an all-gather before linear1 and a "
         "reduce-scatter after linear2, each the other's backward. Parameters used on the shard "
         "saw only this rank's tokens, so their gradients are summed over the group.",
    recipe="In __init__ keep norm whole; make self.linear1 an nn.Linear holding rows r*f/t to "
           "(r+1)*f/t of linear1's weight and bias, and self.linear2 one holding those columns "
           "of linear2's weight and its whole bias. Write two autograd functions: an all-gather "
           "along dimension 1 (backward: reduce-scatter of the gradient) and a reduce-scatter "
           "along dimension 1 (backward: all-gather). The single-tensor collectives work on "
           "dimension 0: move the sequence to the front, make it contiguous, and move it back "
           "afterwards. Forward: LayerNorm on the (b, s/t, h) shard, all-gather to (b, s, h), "
           "linear1, GELU, linear2's weight without its bias, reduce-scatter back to "
           "(b, s/t, h), then add linear2's bias. Pass the LayerNorm's weight and bias and "
           "linear2's bias through an identity-forward, all-reduce-backward function (Task "
           "8.1's f) where they are used, so each pass's gradient is summed, not the "
           "accumulated .grad.",
)
_SP_RUNS = {t: SP.shared(_sp_on_rank, world_size=t, timeout=TIMEOUT) for t in (2, 4)}
_SP_RUNS[1] = SP.shared(partial(_sp_on_rank, metered=False), world_size=1, timeout=TIMEOUT)


def _sp_expected(t: int) -> Any:
    return lambda seed: SP.trusted("sp_expected")(seed, t)


SP.case("2 ranks: output shards, input gradients and every gradient (2 passes accumulated) "
        "equal the unsharded block's", uses=_SP_RUNS[2], compare=_compare_sp_values, weight=2,
        expect=_sp_expected(2))
SP.case("the same on 4 ranks", uses=_SP_RUNS[4], compare=_compare_sp_values, weight=2,
        expect=_sp_expected(4))


def _named(regime: str, compare: Any) -> Any:
    """``compare`` with ``regime`` named first in its feedback."""
    def named(got: Any, expected: Any) -> None:
        try:
            compare(got, expected)
        except CheckFailed as e:
            raise CheckFailed(f"{regime}: {e.message}", expected=e.expected, got=e.got,
                              hint=e.hint, recipe=e.recipe) from None

    return named


def _compare_sp_without_grad(got: Any, expected: dict[str, Any]) -> None:
    """A forward under no_grad, then a pass on an input without grad: the outputs and every
    .grad of one pass, and no gradient for the input."""
    regime = "an input without grad, after a forward under torch.no_grad()"
    for rank, (g, e) in enumerate(zip(per_rank(got, len(expected["ranks"])), expected["ranks"])):
        g = g.get("without grad") if isinstance(g, dict) else None
        if not isinstance(g, dict) or "raised" in g:
            raise CheckFailed(f"{regime}, rank {rank}: the block raised",
                              got=g.get("raised") if isinstance(g, dict) else repr(g)[:200],
                              hint="An input shard that does not require grad is ordinary (the "
                                   "first block of a frozen stem, inference): the parameters still "
                                   "get gradients, and under torch.no_grad() nothing is recorded.")
        for key, what in (("inference output", "output under torch.no_grad()"),
                          ("output", "output of the pass after it")):
            problem = _mismatch(g[key], e["outputs"][0])
            if problem is not None:
                raise CheckFailed(f"{regime}, rank {rank}: the {what} {problem}",
                                  expected=short(e["outputs"][0]), got=short(g[key]))
        for name, want in e["grads"].items():
            problem = _mismatch(g["grads"].get(name), want)
            if problem is not None:
                raise CheckFailed(
                    f"{regime}, rank {rank}: {name}.grad after one backward pass {problem}",
                    expected=short(want), got=short(g["grads"].get(name)),
                    hint="A forward under torch.no_grad() runs no backward: whatever a forward "
                         "arranges for its backward (a hook registered on a parameter) must not "
                         "outlive it, or the next backward sums the gradients twice.",
                    recipe="Sum the shard-region gradients inside the graph (an identity-forward, "
                           "all-reduce-backward autograd function applied to the parameters in "
                           "forward), not with hooks registered by forward.")


SP.case("world size 1: the block equals the unsharded LayerNorm, Linear, GELU, Linear (output, "
        "input gradient, every gradient over 2 passes)", uses=_SP_RUNS[1], weight=0.5,
        compare=_named("world size 1", _compare_sp_values), expect=_sp_expected(1))
SP.case("an input without grad, after a forward under torch.no_grad(): the same outputs, and "
        "every .grad that of one pass (2 ranks)", uses=_SP_RUNS[2], weight=0.5,
        compare=_compare_sp_without_grad, expect=lambda seed: SP.trusted("sp_expected")(seed, 2, 1))
SP.case("forward makes one all-gather and one reduce-scatter of the whole activation, and no "
        "all-reduce (4 ranks)", uses=_SP_RUNS[4], compare=_compare_sp_calls, expect=_sp_expected(4),
        saving=True)
SP.case("the LayerNorm's saved activations per rank are 1/t of the unsharded block's (4 ranks)",
        uses=_SP_RUNS[4], compare=_compare_sp_memory, expect=_sp_expected(4), saving=True)

# What the tensor-parallel half of the block saves, measured on the 4-rank run's metered block
# (h = 64, f = 256, the whole LayerNorm given, not counted): the same 1/t of the weights and of
# the matmuls as Task 8.1, N being the gathered sequence's tokens. The 25% margin covers a copy
# of the LayerNorm or a spare buffer; a block that keeps (or multiplies by) both whole weights
# is t = 4 times the share: 3.2x the bound.
SP.bound("weight bytes each rank keeps after building the block",
         formula="1.25 · ((h·f + f·h)/t + f/t + h) · 4 bytes: linear1's rows and their bias, "
                 "linear2's columns, linear2's bias whole",
         lost="the block keeps both whole weights on every rank: the 1/t of the weights per "
              "rank is lost",
         hint="The block is tensor parallel as well as sequence parallel: no rank holds a whole "
              "weight, measured in bytes allocated and still alive after it is built.",
         recipe="Keep only this rank's rows of linear1 and columns of linear2 (in self.linear1 "
                "and self.linear2), and no other copy of the full weights.",
         expect="sp_weight_bytes_bound", uses=_SP_RUNS[4], pick=_metered("weight bytes"), weight=3)
SP.bound("matmul FLOPs per rank, forward and backward",
         formula="1.25 · 3 · 2·N·(h·f + f·h)/t: the forward, input-gradient and weight-gradient "
                 "matmuls of this rank's slices on the N gathered tokens",
         lost="every rank runs the whole MLP: the 1/t of the compute per rank is lost",
         hint="After the all-gather every rank holds the whole sequence but multiplies it only "
              "by its slices: 1/t of the MLP's matmuls, counted by torch's FLOP counter.",
         recipe="Apply linear1's rows and linear2's columns only: no full-width matrix (padded, "
                "concatenated or masked) and no second, unsharded pass.",
         unit="FLOPs", expect="sp_flops_bound", uses=_SP_RUNS[4], pick=_metered("flops"), weight=3)
# --------------------------------------------------------------------------- task 8.3 and 8.4

PIPE_HIDDEN, PIPE_MICRO_BATCH = 6, 2  # stages map (2, 6) micro-batches to (2, 6)


def pipeline(seed: int, p: int) -> nn.ModuleList:
    """The p stages of the pipeline, the same on every rank and in the reference."""
    torch.manual_seed(seed + 200)
    return nn.ModuleList(nn.Sequential(nn.Linear(PIPE_HIDDEN, PIPE_HIDDEN), nn.Tanh())
                         for _ in range(p))


def pipe_data(seed: int, m: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The m input and target micro-batches."""
    g = torch.Generator().manual_seed(seed * 13 + m)
    x = torch.randn(m * PIPE_MICRO_BATCH, PIPE_HIDDEN, generator=g)
    y = torch.randn(m * PIPE_MICRO_BATCH, PIPE_HIDDEN, generator=g)
    return list(x.chunk(m)), list(y.chunk(m))


# The loss the student's gpipe calls: torch's own function (the gates refuse any call from the
# task's code into the grader's functions).
mse = F.mse_loss


def _stage_grads(stage: nn.Module) -> list[Any]:
    return [_local(q.grad) for q in stage.parameters()]


def _messages(events: list[Any]) -> list[list[Any]]:
    """Every point-to-point message in issue order: [send or recv, peer, bytes]."""
    out = []
    for e in events:
        if e.op in ("send", "isend"):
            out.append(["send", e.peer, int(e.nbytes)])
        elif e.op in ("recv", "irecv"):
            out.append(["recv", e.peer, int(e.nbytes)])
    return out


def _gpipe_on_rank(impl: Any, seed: int, m: int) -> dict[str, Any]:
    import torch.distributed as dist

    from kit.trace import trace

    rank, p = dist.get_rank(), dist.get_world_size()
    stage = pipeline(seed, p)[rank]
    xs, ys = pipe_data(seed, m)
    with trace() as t:
        loss = impl(stage, xs, ys, mse)
    return {"loss": _local(loss) if isinstance(loss, torch.Tensor) else repr(loss)[:80],
            "grads": _stage_grads(stage), "messages": _messages(t.events),
            "collectives": [e.op for e in t.events if e.kind == "collective"]}


def _compare_pipe_grads(got: Any, expected: dict[str, Any]) -> None:
    p = expected["p"]
    for rank, g in enumerate(per_rank(got, p)):
        for k, want in enumerate(expected["grads"][rank]):
            have = g["grads"][k] if k < len(g["grads"]) else None
            problem = _mismatch(have, want)
            if problem is not None:
                name = ("weight", "bias")[k] if k < 2 else f"parameter {k}"
                raise CheckFailed(
                    f"stage {rank} of {p}, {expected['m']} micro-batches: the Linear's {name} "
                    f"gradient {problem}", expected=short(want), got=short(have),
                    hint="A stage's gradients must add up to the whole batch's: each "
                         "micro-batch contributes 1/m of the mean loss, and each stage's input "
                         "gradient must reach the stage before it.",
                    recipe="Divide each micro-batch's loss by m before backward (the whole batch's "
                           "loss is the mean of the micro-batch means); send each input's "
                           "gradient to the previous stage (rank - 1).")


def _compare_pipe_loss(got: Any, expected: dict[str, Any]) -> None:
    p = expected["p"]
    for rank, g in enumerate(per_rank(got, p)):
        have = g["loss"]
        if rank < p - 1:
            if have != "None":
                raise CheckFailed(f"stage {rank}: gpipe returned {have!r}; only the last stage "
                                  "returns the loss", expected=None, got=have)
            continue
        problem = _mismatch(have, expected["loss"])
        if problem is not None or have.dim() != 0:
            raise CheckFailed(f"last stage: the returned loss {problem or 'is not a 0-d tensor'}",
                              expected=short(expected["loss"]), got=short(have),
                              hint="Return the mean of the m micro-batch losses as a 0-d tensor.")


def _compare_pipe_messages(got: Any, expected: dict[str, Any]) -> None:
    p, m = expected["p"], expected["m"]
    want = expected["messages"]
    got = per_rank(got, p)
    sends = sum(1 for g in got for msg in g["messages"] if msg[0] == "send")
    for rank, g in enumerate(got):
        if g["collectives"]:
            raise CheckFailed(f"stage {rank} called collectives: {g['collectives']}",
                              hint="A pipeline talks only to its neighbours: send and recv.")
    if sends != 2 * m * (p - 1):
        raise CheckFailed(f"{p} stages, {m} micro-batches: messages sent over all stages, "
                          f"2·m·(p−1) = {2 * m * (p - 1)}", expected=2 * m * (p - 1), got=sends,
                          hint="One activation per micro-batch forward across each stage "
                               "boundary, one gradient back: nothing else.")
    for rank, g in enumerate(got):
        if g["messages"] != want[rank]:
            raise CheckFailed(
                f"stage {rank}: its messages in order ([send or recv, peer, bytes])",
                expected=want[rank], got=g["messages"],
                hint="GPipe runs every forward before any backward, and each stage exchanges "
                     "messages only with its two neighbours: activations go right, gradients "
                     "go left.",
                recipe="Forward: receive micro-batch i's activation from rank - 1, send the "
                       "output to rank + 1, for every i; then backward: receive the gradient "
                       "from rank + 1, send the input's gradient to rank - 1.")


def _for_each_shape(compare: Any) -> Any:
    """``compare`` applied to the run and the expectation of every pipeline shape in turn."""
    def each(got: Any, expected: list[Any]) -> None:
        for g, e in zip(per_rank(got, len(expected), "pipeline run"), expected):
            compare(g, e)

    return each


# bounds nothing: GPipe keeps every micro-batch's activations until its backward by design (the
# cost 1F1B removes, bounded in 8.4); what it saves over one process, 1/p of the layers per
# rank, is the stage it is handed, and its traffic, 2·m·(p−1) messages of one micro-batch each,
# is checked exactly by the message case.
GPIPE = task(
    "8.3", forbidden=PIPELINING, preload=PIPE_PRELOAD,
    hint="GPipe: micro-batches flow forward through the stages, then their gradients flow "
         "back in reverse; a stage talks only to its neighbours, and the micro-batch losses, "
         "each divided by m, add up to the whole batch's mean loss.",
    recipe="Rank r holds stage r of p. Forward, for every micro-batch: stage 0 takes it from "
           "the list; every other stage receives its activation from rank - 1 into an empty "
           "tensor shaped like the micro-batch and marks it as requiring grad (a leaf). Run the "
           "stage, send the detached output to rank + 1 unless this is the last stage, and keep "
           "both input and output. Backward, micro-batches in reverse: the last stage computes "
           "the micro-batch loss divided by m, calls backward on it and adds it to a running "
           "total; the others receive the output's gradient from rank + 1 and call backward on "
           "the output with it. Every stage but the first then sends its input's gradient to "
           "rank - 1. Return the total as a 0-d tensor on the last stage, None elsewhere.",
)

PIPE_SHAPES = [(2, 3), (4, 4)]  # (stages, micro-batches)
_GPIPE_RUNS = [GPIPE.shared(partial(_gpipe_on_rank, m=m), world_size=p, timeout=PIPE_TIMEOUT)
               for p, m in PIPE_SHAPES]


@GPIPE.shared
def _gpipe_runs(impl: Any, seed: int) -> list[Any]:
    """Both pipeline shapes' runs, in PIPE_SHAPES order."""
    return [run(impl, seed) for run in _GPIPE_RUNS]


GPIPE.case("every stage's gradients equal the whole model's on the whole batch "
           "(2 stages x 3 micro-batches, 4 stages x 4)", weight=2, uses=_gpipe_runs,
           compare=_for_each_shape(_compare_pipe_grads), expect="gpipe_expected")
GPIPE.case("the last stage returns the mean loss, the others None", uses=_gpipe_runs,
           compare=_for_each_shape(_compare_pipe_loss), expect="gpipe_expected")
GPIPE.case("exactly 2·m·(p−1) messages, each to the neighbour it belongs to, all forwards "
           "before the backwards", weight=2, uses=_gpipe_runs,
           compare=_for_each_shape(_compare_pipe_messages), expect="gpipe_expected")

# The edges: one stage (p = 1, first and last at once), one micro-batch on two stages (fewer
# micro-batches than stages), and micro-batches of different sizes (refused on every rank before
# anything is sent: the mean of their means is not the batch's mean loss). Each a small launch
# of its own, so that a crash at one edge costs only its case.
GPIPE_EDGES = {"one stage (p = 1, 3 micro-batches)": (1, 3),
               "one micro-batch on 2 stages (fewer micro-batches than stages)": (2, 1)}
UNEQUAL_SIZES = (2, 1)  # the rows of the two micro-batches the refusal case hands gpipe


def _gpipe_refusal_on_rank(impl: Any, seed: int) -> dict[str, Any]:
    """What gpipe does with micro-batches of UNEQUAL_SIZES rows (one stage: nothing can hang)."""
    stage = pipeline(seed, 1)[0]
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, PIPE_HIDDEN, generator=g) for n in UNEQUAL_SIZES]
    ys = [torch.randn(n, PIPE_HIDDEN, generator=g) for n in UNEQUAL_SIZES]
    try:
        returned = impl(stage, xs, ys, mse)
    except Exception as e:  # noqa: BLE001 - what it raised is the answer
        return {"raised": type(e).__name__, "message": str(e)[:300]}
    return {"returned": repr(returned)[:120]}


def _guarded(regime: str, fn: Any, world_size: int) -> Any:
    """A shared run of ``fn`` on ``world_size`` ranks whose crash is data naming ``regime``."""
    def run(impl: Any, seed: int) -> Any:
        from kit.failures import LaunchError, LaunchTimeout

        try:
            return _launch(fn, (impl, seed), world_size, GPIPE.preload, PIPE_TIMEOUT)
        except (LaunchError, LaunchTimeout) as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            raised = [line for line in lines if line.split(":")[0].endswith(("Error", "Exception"))]
            return {"crashed": f"{regime}: {(raised or lines or [type(e).__name__])[-1][:300]}"}

    run.__name__ = f"gpipe {regime}"
    return GPIPE.shared(run)


def _edge_compare(regime: str, compare: Any) -> Any:
    """``compare`` with ``regime`` named first in its feedback, and a crash reported as one."""
    def each(got: Any, expected: Any) -> None:
        if isinstance(got, dict) and "crashed" in got:
            raise CheckFailed(f"gpipe crashed or hung at this edge: {got['crashed']}",
                              hint="One stage is the first and the last stage at once: it takes "
                                   "the micro-batches from the list, computes the losses and "
                                   "sends nothing. With fewer micro-batches than stages each "
                                   "stage still runs micro-batches 0..m−1, nothing more.")
        _named(regime, compare)(got, expected)

    return each


def _gpipe_edge_run(regime: str) -> Any:
    p, m = GPIPE_EDGES[regime]
    return _guarded(regime, partial(_gpipe_on_rank, m=m), p)


def _gpipe_edge_expected(regime: str) -> Any:
    return lambda seed: GPIPE.trusted("pipe_expected")(seed, *GPIPE_EDGES[regime])


def _gpipe_edge_values(got: Any, expected: dict[str, Any]) -> None:
    _compare_pipe_grads(got, expected)
    _compare_pipe_loss(got, expected)
    _compare_pipe_messages(got, expected)


for _regime in GPIPE_EDGES:
    GPIPE.case(f"{_regime}: the gradients, the loss and the messages equal the whole model's",
               weight=0.5, uses=_gpipe_edge_run(_regime),
               compare=_edge_compare(_regime, _gpipe_edge_values),
               expect=_gpipe_edge_expected(_regime))


def _compare_unequal(got: Any, expected: Any) -> None:
    got = got[0] if isinstance(got, list) and len(got) == 1 else got
    if isinstance(got, dict) and "crashed" in got:
        raise CheckFailed(
            f"gpipe crashed on micro-batches of {UNEQUAL_SIZES} rows: {got['crashed']}")
    if not isinstance(got, dict) or got.get("raised") != "ValueError":
        did = (f"returned {got['returned']}" if isinstance(got, dict) and "returned" in got
               else f"raised {got.get('raised')}: {got.get('message', '')}" if isinstance(got, dict)
               else repr(got)[:200])
        raise CheckFailed(
            f"micro-batches of different sizes ({' and '.join(map(str, UNEQUAL_SIZES))} rows): "
            "the mean of their mean losses is not the whole batch's mean loss",
            expected="a ValueError naming the constraint (the micro-batches must have the "
                     "same size)",
            got=did, hint="Dividing each micro-batch's mean loss by m gives the batch's mean only "
                          "when the micro-batches are equal; refuse unequal ones on every rank "
                          "before anything is sent, so no stage waits for a message that never "
                          "comes.",
            recipe="First thing in gpipe: if the micro-batches' first dimensions differ, raise "
                   "ValueError(...) naming their sizes.")


GPIPE.case(f"micro-batches of different sizes ({' and '.join(map(str, UNEQUAL_SIZES))} rows): a "
           "ValueError naming the constraint", weight=0.5, compare=_compare_unequal,
           uses=_guarded("micro-batches of different sizes", _gpipe_refusal_on_rank, 1),
           expect=lambda seed: None)


# --------------------------------------------------------------------------- task 8.4

GRID = [(s, p, m) for p in range(1, 6) for s in range(p) for m in range(1, 9)]

# The activations 1F1B bounds, measured by playing each stage's order of a 4-stage pipeline
# with 8 micro-batches in this process: stage s may hold num_stages - s micro-batches at once,
# GPipe's order holds all 8 (2x the bound on stage 0, 6.4x on stage 3). A micro-batch's
# activations on the played stage (Linear(32, 32), Tanh) are its input and its output, 16 x 32
# floats each; the gradients are allocated before the track and accumulate in place.
HELD_SHAPE = (4, 8)  # (stages, micro-batches)
HELD_HIDDEN, HELD_MICRO_BATCH = 32, 16


def _played_activations(order: list[list[Any]], seed: int) -> int:
    """Most bytes of activations alive between two steps while one stage plays ``order``."""
    from kit import meter

    m = HELD_SHAPE[1]
    torch.manual_seed(seed + 500)
    stage = nn.Sequential(nn.Linear(HELD_HIDDEN, HELD_HIDDEN), nn.Tanh())
    for q in stage.parameters():
        q.grad = torch.zeros_like(q)  # backward then accumulates in place: not counted
    g = torch.Generator().manual_seed(seed + 501)
    inputs = [torch.randn(HELD_MICRO_BATCH, HELD_HIDDEN, generator=g) for _ in range(m)]
    grads = [torch.randn(HELD_MICRO_BATCH, HELD_HIDDEN, generator=g) for _ in range(m)]
    held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with meter.track() as usage:
        for k, (op, i) in enumerate(order):
            if op == "F":  # the activation received from the previous stage, and the output
                x = inputs[i].clone().requires_grad_()
                held[i] = (x, stage(x))
                del x
            else:
                x, y = held.pop(i)
                y.backward(grads[i])
                del x, y  # this micro-batch's activations (and its input's gradient) are free
            usage.mark(f"after step {k}")
    return max(usage.marks.values(), default=0)


def _orders(impl: Any, seed: int) -> dict[str, Any]:
    """The implementation's order for every (stage, stages, micro-batches) of the grid, and the
    activations each stage of HELD_SHAPE holds when its order is played."""
    orders = {}
    for s, p, m in GRID:
        order = impl(s, p, m)
        try:
            orders[f"{s},{p},{m}"] = [[str(op), int(i)] for op, i in order]
        except (TypeError, ValueError):
            orders[f"{s},{p},{m}"] = repr(order)[:120]
    p, m = HELD_SHAPE
    held: dict[str, Any] = {"measured": []}
    for s in range(p):
        order = orders[f"{s},{p},{m}"]
        if not _well_formed(order, m):
            held = {"error": f"stage {s} of {p}'s order does not run each of the {m} micro-batches "
                             "forward, then backward, once"}
            break
        # Stage s may hold num_stages - s micro-batches: per allowed micro-batch, at most one.
        held["measured"].append(_played_activations(order, seed) / (p - s))
    return {"orders": orders, "held": held}


def _for_each_order(check: Any) -> Any:
    def compare(got: Any, expected: Any) -> None:
        if not isinstance(got, dict) or len(got) != len(GRID):
            raise CheckFailed("could not read the orders", got=repr(got)[:200])
        for s, p, m in GRID:
            order = got[f"{s},{p},{m}"]
            where = f"one_f_one_b(stage={s}, num_stages={p}, num_microbatches={m})"
            if not isinstance(order, list):
                raise CheckFailed(f"{where} is not a list of (str, int) pairs", got=order)
            check(where, [tuple(x) for x in order], s, p, m)

    return compare


def _each_once(where: str, order: list, s: int, p: int, m: int) -> None:
    forwards = [i for op, i in order if op == "F"]
    backwards = [i for op, i in order if op == "B"]
    if forwards != list(range(m)) or backwards != list(range(m)) or len(order) != 2 * m:
        raise CheckFailed(f"{where}: expected micro-batches 0..{m - 1} forward once and backward "
                          "once each, both in micro-batch order", got=order,
                          hint="m forwards and m backwards, each in order 0, 1, ..., m - 1.")
    for i in range(m):
        if order.index(("B", i)) < order.index(("F", i)):
            raise CheckFailed(f"{where}: micro-batch {i} goes backward before forward", got=order)


def _for_each_pipeline(check: Any) -> Any:
    """``check(where, orders, p, m)`` on every pipeline shape of the grid: all its stages'
    orders."""
    def compare(got: Any, expected: Any) -> None:
        if not isinstance(got, dict) or len(got) != len(GRID):
            raise CheckFailed("could not read the orders", got=repr(got)[:200])
        for p in sorted({p for _, p, _ in GRID}):
            for m in sorted({m for _, q, m in GRID if q == p}):
                orders = [got[f"{s},{p},{m}"] for s in range(p)]
                where = f"one_f_one_b(stage, num_stages={p}, num_microbatches={m})"
                if not all(isinstance(o, list) for o in orders):
                    raise CheckFailed(f"{where} is not a list of (str, int) pairs on every stage",
                                      got=orders)
                check(where, [[tuple(x) for x in o] for o in orders], p, m)

    return compare


def _as_fast_as_gpipe(where: str, orders: list, p: int, m: int) -> None:
    from kit.lessons.parallelism import simulate_schedule

    for s, order in enumerate(orders):
        if not _well_formed(order, m):
            raise CheckFailed(f"{where}: stage {s}'s order does not run each micro-batch forward, "
                              "then backward, once", got=order)
    try:
        run = simulate_schedule(orders)  # a forward takes 1, a backward 2
    except ValueError as e:
        raise CheckFailed(f"{where}, every stage played together: {e}", got=orders,
                          hint="A stage's forward of micro-batch i waits for the stage before it; "
                               "its backward waits for the stage after it. A backward that comes "
                               "before the next stage can have sent its gradient blocks the "
                               "pipe.") from None
    # No order beats GPipe: the last stage starts after p - 1 forwards and its last backward
    # still crosses p - 1 stages, so m·(1 + 2) + (p - 1)·(1 + 2) is the least possible time.
    least = 3 * (m + p - 1)
    if run.makespan > least + 1e-9:
        raise CheckFailed(f"{where}: the pipeline's time (a forward 1, a backward 2)",
                          expected=f"{least:g}, GPipe's: a bubble of (p − 1)/(m + p − 1)",
                          got=f"{run.makespan:g}, a bubble of {run.bubble:.1%}",
                          hint="1F1B keeps GPipe's bubble: a stage must not wait for a backward "
                               "while it could still forward a micro-batch the stages after it "
                               "need.")


def _in_flight(where: str, order: list, s: int, p: int, m: int) -> None:
    live = peak = 0
    for op, _ in order:
        live += 1 if op == "F" else -1
        peak = max(peak, live)
    if peak > p - s:
        raise CheckFailed(f"{where}: {peak} micro-batches' activations held at once",
                          expected=f"at most num_stages - stage = {p - s}", got=peak,
                          hint="Each extra warm-up forward keeps one more micro-batch's "
                               "activations alive.")


def _run_orders_on_rank(orders: list[list[list[Any]]], seed: int, m: int) -> list[Any]:
    """The grader's pipeline executor: rank s plays ``orders[s]`` with blocking receives and
    non-blocking sends (as torch.distributed.pipelining does), micro-batch losses / m."""
    import torch.distributed as dist

    rank, p = dist.get_rank(), dist.get_world_size()
    stage = pipeline(seed, p)[rank]
    xs, ys = pipe_data(seed, m)
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    sends = []
    for op, i in orders[rank]:
        if op == "F":
            if rank == 0:
                x = xs[i]
            else:
                x = torch.empty_like(xs[i])
                dist.recv(x, src=rank - 1)
                x.requires_grad_()
            y = stage(x)
            inputs[i], outputs[i] = x, y
            if rank < p - 1:
                sends.append(dist.isend(y.detach().clone(), dst=rank + 1))
        else:
            if rank == p - 1:
                (mse(outputs[i], ys[i]) / m).backward()
            else:
                grad = torch.empty_like(outputs[i])
                dist.recv(grad, src=rank + 1)
                outputs[i].backward(grad)
            if rank > 0:
                sends.append(dist.isend(inputs[i].grad.clone(), dst=rank - 1))
            del inputs[i], outputs[i]  # this micro-batch's activations are free
    for work in sends:
        work.wait()
    return _stage_grads(stage)


ONE_F_ONE_B_PLAYED = [(2, 4), (4, 6)]


def _well_formed(order: Any, m: int) -> bool:
    try:
        ops = [(str(op), int(i)) for op, i in order]
    except (TypeError, ValueError):
        return False
    every = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    return sorted(ops) == sorted(every) and all(
        ops.index(("F", i)) < ops.index(("B", i)) for i in range(m))


def _play(impl: Any, seed: int) -> list[Any]:
    results = []
    for p, m in ONE_F_ONE_B_PLAYED:
        orders = [impl(s, p, m) for s in range(p)]
        if not all(_well_formed(o, m) for o in orders):
            results.append("not every order runs each micro-batch forward then backward once")
            continue
        orders = [[[str(op), int(i)] for op, i in o] for o in orders]
        try:
            results.append(_launch(_run_orders_on_rank, (orders, seed, m), p,
                                   ONE_F_ONE_B.preload, timeout=PIPE_TIMEOUT))
        except Exception as e:  # noqa: BLE001 - a deadlock (LaunchTimeout) or a crash
            results.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return results


def _compare_played(got: Any, expected: Any) -> None:
    for (p, m), g, e in zip(ONE_F_ONE_B_PLAYED, got, expected):
        if isinstance(g, str):
            raise CheckFailed(f"{p} stages, {m} micro-batches on real ranks: {g}",
                              hint="Every stage must receive what its neighbour sends in the "
                                   "same micro-batch order; a forward waits for the previous "
                                   "stage, a backward for the next one.")
        _compare_pipe_grads([{"grads": grads} for grads in g], e)


ONE_F_ONE_B = task(
    "8.4", forbidden=PIPELINING, preload=PIPE_PRELOAD,
    hint="1F1B fills the pipe, then alternates: a stage runs as many forwards as there are "
         "stages after it before its first backward, and from then on never keeps more "
         "activations than that plus one.",
    recipe="Warm up with one forward per later stage (never more than there are micro-batches); "
           "in the steady state alternate the next forward with the oldest pending backward; "
           "cool down with the backwards that are left, oldest first.",
)
_ORDERS = ONE_F_ONE_B.shared(_orders)

ONE_F_ONE_B.case("every micro-batch goes forward, then backward, exactly once, in order",
                 uses=_ORDERS, pick="orders", compare=_for_each_order(_each_once))
ONE_F_ONE_B.case("all stages' orders played together: no deadlock, done in GPipe's time "
                 "(the least possible)", weight=2, uses=_ORDERS, pick="orders",
                 compare=_for_each_pipeline(_as_fast_as_gpipe))
ONE_F_ONE_B.case("at most num_stages − stage activations in flight", weight=2, saving=True,
                 uses=_ORDERS, pick="orders", compare=_for_each_order(_in_flight))
ONE_F_ONE_B.case("played on real ranks (2 stages x 4, 4 stages x 6): no deadlock, the whole "
                 "batch's gradients", compare=_compare_played,
                 expect="one_f_one_b_played")(_play)
# What 1F1B saves over GPipe, in bytes: the 25% margin covers the autograd bookkeeping a step
# leaves behind; one micro-batch too many on the last stage is already 1.6x the bound.
ONE_F_ONE_B.bound("activation bytes a stage holds, per micro-batch 1F1B lets it keep "
                  "(num_stages − stage of them), while its order is played (4 stages, 8 "
                  "micro-batches)",
                  formula="1.25 · one micro-batch's stage input and output (2 · b · h · 4 bytes)",
                  lost="the order keeps more micro-batches' activations alive than "
                       "num_stages − stage: 1F1B's memory bound over GPipe is lost",
                  hint="1F1B's point is memory: a backward frees a micro-batch's activations "
                       "before the next forward makes more, so stage s never holds more than "
                       "num_stages − s of them, measured here in bytes while the order runs.",
                  recipe="Start backwards as soon as the warm-up has filled the pipe below this "
                         "stage (num_stages − stage − 1 forwards), then alternate.",
                  expect="held_activations_bound", uses=_ORDERS, pick="held", weight=2)


# --------------------------------------------------------------------------- task 8.5

# (stages, chunks, micro-batches): m a multiple of p, from one round of p micro-batches to three.
INTERLEAVED_GRID = [(p, v, k * p) for p in range(1, 5) for v in range(1, 4) for k in (1, 2, 3)]


# The edges, as torch's ScheduleInterleaved1F1B takes them: m not a multiple of p goes round in
# max(1, m // p) rounds of r = m / rounds micro-batches (fewer micro-batches than stages: one
# round of all of them), which needs m to be a multiple of the rounds; any other m is refused.
INTERLEAVED_UNEVEN = [(p, v, m) for p in (2, 3, 4) for v in (1, 2, 3) for m in range(1, 3 * p)
                      if m % p and m % max(1, m // p) == 0]
INTERLEAVED_REFUSED = [(2, 2, 5), (3, 2, 7), (4, 2, 9), (4, 3, 11)]


def _order_data(order: Any) -> Any:
    try:
        return [[str(op), int(i), int(c)] for op, i, c in order]
    except (TypeError, ValueError):
        return repr(order)[:120]


def _interleaved_orders(impl: Any, seed: int) -> dict[str, Any]:
    """Every stage's order for every shape of INTERLEAVED_GRID and INTERLEAVED_UNEVEN, as plain
    data, and what each shape of INTERLEAVED_REFUSED did (raised, or returned). An edge shape
    that raises is recorded, not fatal: it fails only the edge's case."""
    orders = {}
    for p, v, m in INTERLEAVED_GRID:
        for s in range(p):
            orders[f"{s},{p},{m},{v}"] = _order_data(impl(s, p, m, v))
    for p, v, m in INTERLEAVED_UNEVEN:
        for s in range(p):
            try:
                orders[f"uneven {s},{p},{m},{v}"] = _order_data(impl(s, p, m, v))
            except Exception as e:  # noqa: BLE001 - reported by the edge's case
                orders[f"uneven {s},{p},{m},{v}"] = {"raised": f"{type(e).__name__}: {e}"[:200]}
    for p, v, m in INTERLEAVED_REFUSED:
        try:
            returned = impl(0, p, m, v)
            orders[f"refused {p},{m},{v}"] = {"returned": repr(returned)[:120]}
        except Exception as e:  # noqa: BLE001 - judged by the refusal's case
            orders[f"refused {p},{m},{v}"] = {"raised": type(e).__name__, "message": str(e)[:300]}
    return orders


# Every case of 8.5 plays the same orders: one that is ill formed, or that deadlocks, fails them
# all for that reason, so the cases after the first that names it follow it.
ILL_FORMED, DEADLOCK = "an order ill formed", "the orders deadlock"


def _chunk_steps_once(where: str, order: Any, m: int, v: int) -> None:
    if not isinstance(order, list):
        raise CheckFailed(f"{where} is not a list of (str, int, int) triples", got=order,
                          cause=ILL_FORMED)
    steps = [tuple(x) for x in order]
    want = {(op, i, c) for op in "FB" for i in range(m) for c in range(v)}
    if sorted(steps) != sorted(want):
        raise CheckFailed(f"{where}: expected a forward and a backward of every (micro-batch, "
                          f"chunk) for micro-batches 0..{m - 1} and chunks 0..{v - 1}, each once",
                          got=order, hint="2·m·v steps: ('F', i, c) and ('B', i, c) for every "
                                          "micro-batch i and chunk c.", cause=ILL_FORMED)
    for i in range(m):
        for c in range(v):
            if steps.index(("B", i, c)) < steps.index(("F", i, c)):
                raise CheckFailed(f"{where}: micro-batch {i}'s chunk {c} goes backward before "
                                  "forward", got=order, cause=ILL_FORMED)


def _interleaved_pipeline(check: Any = None) -> Any:
    """``check(where, run, p, m, v)`` on every shape, ``run`` the simulation of all its stages'
    orders with a unit time per chunk's forward and backward (with no ``check``: only that each
    stage's order is well formed)."""
    def compare(got: Any, expected: Any) -> None:
        from kit.lessons.parallelism import simulate_schedule

        if not isinstance(got, dict) or any(f"{s},{p},{m},{v}" not in got
                                            for p, v, m in INTERLEAVED_GRID for s in range(p)):
            raise CheckFailed("could not read the orders", got=repr(got)[:200])
        for p, v, m in INTERLEAVED_GRID:
            where = (f"interleaved_one_f_one_b(stage, num_stages={p}, num_microbatches={m}, "
                     f"chunks={v})")
            orders = []
            for s in range(p):
                _chunk_steps_once(where.replace("stage,", f"stage={s},"), got[f"{s},{p},{m},{v}"],
                                  m, v)
                orders.append([tuple(x) for x in got[f"{s},{p},{m},{v}"]])
            if check is None:
                continue
            try:
                run = simulate_schedule(orders, forward=1.0, backward=1.0, chunks=v)
            except ValueError as e:
                raise CheckFailed(
                    f"{where}, every stage played together: {e}", got=orders, cause=DEADLOCK,
                    hint="Chunk c of stage s is virtual stage c·p + s: a micro-batch's forward "
                         "visits stage 0..p−1 with chunk 0, then again with chunk 1, and its "
                         "backward comes back the other way. A stage that waits for a step the "
                         "others can only run after its own next step blocks the pipe.") from None
            check(where, run, p, m, v)

    return compare


def _no_deadlock(where: str, run: Any, p: int, m: int, v: int) -> None:
    pass  # the simulation finished: every stage ran its whole order


def _interleaved_bubble(where: str, run: Any, p: int, m: int, v: int) -> None:
    work = 2 * v * m  # each stage's forward and backward of every chunk, one unit each
    bubble, want = (run.makespan - work) / work, (p - 1) / (v * m)
    # No order does better: the last stage starts after p - 1 steps, and its last backward (of
    # chunk 0) still crosses p - 1 stages.
    if abs(bubble - want) > 1e-9:
        raise CheckFailed(f"{where}: the bubble (makespan − 2vm) / 2vm",
                          expected=f"(p − 1)/(v·m) = {want:.4f}",
                          got=f"{bubble:.4f} (makespan {run.makespan:g} for {work} units of work)",
                          hint="Interleaving pays off only if the pipe never drains in between: "
                               "warm up with enough forwards that every stage has a chunk to run "
                               "while the first backwards travel back.")


def _in_flight_within(where: str, run: Any, p: int, v: int, r: int, hint: str) -> None:
    """Stage s holds at most (p − s − 1)·2 + (v − 1)·r + 1 chunks forwarded but not yet
    backwarded (r: the micro-batches per round, p when m is a multiple of p)."""
    for s, peak in enumerate(run.peak_in_flight):
        bound = (p - s - 1) * 2 + (v - 1) * r + 1
        if peak > bound:
            formula = "(v − 1)·p" if r == p else "(v − 1)·r"
            raise CheckFailed(f"{where}: stage {s} holds {peak} chunks forwarded but not yet "
                              "backwarded", expected=f"at most (p − s − 1)·2 + {formula} + 1 = "
                                                     f"{bound}" + ("" if r == p else f", r = {r}"),
                              got=peak, hint=hint)


def _interleaved_in_flight(where: str, run: Any, p: int, m: int, v: int) -> None:
    _in_flight_within(where, run, p, v, p,
                      "Every forward beyond the warm-up keeps one more chunk's activations alive: "
                      "start the backwards as soon as the first micro-batch has come back, then "
                      "alternate.")


def _uneven_rounds(got: Any, expected: dict[str, float]) -> None:
    """m not a multiple of p: torch's rounds of r = m / max(1, m // p). Every stage's order well
    formed, all played together without deadlock, no slower than torch's orders, and at most
    (p − s − 1)·2 + (v − 1)·r + 1 chunks in flight on stage s."""
    from kit.lessons.parallelism import simulate_schedule

    for p, v, m in INTERLEAVED_UNEVEN:
        r = m // max(1, m // p)
        where = (f"interleaved_one_f_one_b(stage, num_stages={p}, num_microbatches={m}, chunks={v})"
                 f" (m not a multiple of p: torch goes round in {m // r} round(s) of {r})")
        orders = []
        for s in range(p):
            order = got.get(f"uneven {s},{p},{m},{v}") if isinstance(got, dict) else None
            if isinstance(order, dict) and "raised" in order:
                raise CheckFailed(f"{where.replace('stage,', f'stage={s},')} raised",
                                  expected="an order: torch's ScheduleInterleaved1F1B runs "
                                           "this shape",
                                  got=order["raised"],
                                  hint=f"m = {m} is not a multiple of p = {p}, but it is a "
                                       f"multiple of torch's max(1, m // p) = {m // r} round(s): "
                                       f"go round in rounds of r = {r} micro-batches, with r "
                                       "where p was.")
            try:
                _chunk_steps_once(where.replace("stage,", f"stage={s},"), order, m, v)
            except CheckFailed as e:
                raise CheckFailed(e.message, got=e.got, hint=(
                    f"With m = {m} not a multiple of p = {p}, rounds of p micro-batches run past "
                    f"the last micro-batch or leave some out: go round in torch's rounds of r = "
                    f"m / max(1, m // p) = {r} micro-batches, with r where p was.")) from None
            orders.append([tuple(x) for x in order])
        try:
            run = simulate_schedule(orders, forward=1.0, backward=1.0, chunks=v)
        except ValueError as e:
            raise CheckFailed(f"{where}, every stage played together: {e}", got=orders,
                              hint="The orders deadlock: a stage waits for a chunk the others "
                                   "can only send after its own next step.") from None
        slowest = expected[f"{p},{m},{v}"]
        if run.makespan > slowest + 1e-9:
            raise CheckFailed(f"{where}: every stage played together takes longer than torch's "
                              "ScheduleInterleaved1F1B", expected=f"makespan <= {slowest:g}",
                              got=f"{run.makespan:g}",
                              hint=f"Warm up with (p − s − 1)·2 + (v − 1)·r forwards, r = {r} the "
                                   "micro-batches per round, then alternate.")
        _in_flight_within(where, run, p, v, r, "Every forward beyond the warm-up keeps one more "
                          "chunk's activations alive, and the warm-up counts rounds of r.")


def _refuses_partial_rounds(got: Any, expected: Any) -> None:
    """m not a multiple of torch's rounds: a ValueError, as ScheduleInterleaved1F1B raises."""
    for p, v, m in INTERLEAVED_REFUSED:
        rounds = max(1, m // p)
        where = f"interleaved_one_f_one_b(0, num_stages={p}, num_microbatches={m}, chunks={v})"
        did = got.get(f"refused {p},{m},{v}", {}) if isinstance(got, dict) else {}
        if did.get("raised") != "ValueError":
            raise CheckFailed(
                f"{where}: m = {m} is not a multiple of the max(1, m // p) = {rounds} rounds, so "
                "it cannot go round in equal rounds",
                expected="a ValueError naming the constraint (torch's ScheduleInterleaved1F1B "
                         "raises one)",
                got=(f"returned {did['returned']}" if "returned" in did
                     else f"raised {did.get('raised')}: {did.get('message', '')}"),
                hint="Check the shape first: raise ValueError(...) saying that num_microbatches "
                     "must be a multiple of max(1, num_microbatches // num_stages).")


# bounds nothing in bytes: what interleaving trades is time for activations, both read from the
# trusted simulation of the orders the task returns (the bubble and the chunks in flight per
# stage); 8.4's bound already measures a stage's activations per micro-batch on the meter.
INTERLEAVED = task(
    "8.5", forbidden=PIPELINING,
    hint="Interleaved 1F1B is 1F1B on a pipeline of v·p virtual stages where each rank holds v "
         "of them (chunk c of stage s is virtual stage c·p + s): micro-batches go round the ranks "
         "v times forward and v times back, in rounds of p micro-batches.",
    recipe="Number this stage's forward chunk-steps k = 0, 1, ...: in each round of p·v steps the "
           "first p run chunk 0 for the round's p micro-batches, the next p chunk 1, and so on; "
           "backwards are numbered the same way with the chunks taken last-first. Warm up with "
           "two forwards per stage after this one plus p forwards per extra chunk (never more "
           "than m·v), then alternate the next forward with the next backward, then cool down "
           "with the remaining backwards.",
)
_INTERLEAVED_ORDERS = INTERLEAVED.shared(_interleaved_orders)

INTERLEAVED.case("every (micro-batch, chunk) goes forward, then backward, exactly once",
                 uses=_INTERLEAVED_ORDERS, compare=_interleaved_pipeline())
INTERLEAVED.case("all stages' orders played together with unit-time chunks: no deadlock",
                 uses=_INTERLEAVED_ORDERS, compare=_interleaved_pipeline(_no_deadlock))
INTERLEAVED.case("the bubble (makespan − 2vm)/2vm is (p − 1)/(v·m), 1F1B's divided by v",
                 weight=2, uses=_INTERLEAVED_ORDERS,
                 compare=_interleaved_pipeline(_interleaved_bubble))
INTERLEAVED.case("at most (p − s − 1)·2 + (v − 1)·p + 1 chunks in flight on stage s",
                 weight=2, uses=_INTERLEAVED_ORDERS,
                 compare=_interleaved_pipeline(_interleaved_in_flight))
INTERLEAVED.case("m not a multiple of p: torch's rounds of r = m / max(1, m // p), no slower "
                 "than its orders, at most (p − s − 1)·2 + (v − 1)·r + 1 in flight",
                 uses=_INTERLEAVED_ORDERS, expect="interleaved_uneven_makespans",
                 compare=_uneven_rounds)
INTERLEAVED.case("m not a multiple of max(1, m // p) rounds: a ValueError naming the constraint",
                 weight=0.5, uses=_INTERLEAVED_ORDERS, compare=_refuses_partial_rounds)
