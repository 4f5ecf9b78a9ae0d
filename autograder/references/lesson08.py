"""The grader's answers for Lesson 08 (trusted only): the unsharded MLP, LayerNorm block and
pipeline, run in one process on the same seeded weights and data as the checks' ranks, with each
rank's slices of their gradients; GPipe's messages on every stage; and the bounds tensor
parallelism, sequence parallelism and 1F1B promise, computed from the sizes alone.
"""

from __future__ import annotations

from math import prod
from typing import Any

import torch
from torch.nn import functional as F

from autograder.lesson08 import (
    FFN,
    HELD_HIDDEN,
    HELD_MICRO_BATCH,
    METER_FFN,
    METER_HIDDEN,
    METER_TOKENS,
    METER_WORLD,
    ONE_F_ONE_B_PLAYED,
    PIPE_HIDDEN,
    PIPE_MICRO_BATCH,
    PIPE_SHAPES,
    SP_PASSES,
    layer_norm_saved_bytes,
    mlp,
    mse,
    pipe_data,
    pipeline,
    sp_data,
    sp_modules,
    tp_data,
)

# A bound's headroom over the exact share: what a correct layer may keep or compute beside its
# slices (a bias kept whole, a spare buffer) stays under it; a layer that keeps or multiplies by
# the whole weights is t = 4 times the share, 3.2x the bound.
MARGIN = 1.25


# --------------------------------------------------------------------------- task 8.1


def tp_expected(seed: int, world_size: int) -> list[dict[str, Any]]:
    """The unsharded MLP in one process; each rank's slices of its gradients."""
    out: list[dict[str, Any]] = [{} for _ in range(world_size)]
    settings = [("world", world_size, 0)]
    if world_size == 4:
        settings.append(("groups of 2", 2, None))
    for name, t, replica in settings:
        for rank in range(world_size):
            r = rank % t
            lin1, lin2 = mlp(seed)
            x, w = tp_data(seed, replica if replica is not None else 1 + rank // t)
            x.requires_grad_()
            y = lin2(F.gelu(lin1(x)))
            (y * w).sum().backward()
            rows = slice(r * FFN // t, (r + 1) * FFN // t)
            out[rank][name] = {
                "output": y.detach(), "input grad": x.grad,
                "column weight": lin1.weight.detach()[rows],
                "column weight grad": lin1.weight.grad[rows],
                "column bias grad": lin1.bias.grad[rows],
                "row weight": lin2.weight.detach()[:, rows],
                "row weight grad": lin2.weight.grad[:, rows],
                "row bias grad": lin2.bias.grad,
                "forward": [["all_reduce", y.numel() * 4]],
                "backward": [["all_reduce", x.numel() * 4]]}
    lin1, lin2 = mlp(seed)
    x, w = tp_data(seed, 0)
    x.requires_grad_()
    y = lin1(x)
    (y * torch.cat([w, w], dim=-1)).sum().backward()
    h = torch.randn(3, 5, FFN, generator=torch.Generator().manual_seed(seed + 7),
                    requires_grad=True)
    y2 = lin2(h)
    (y2 * w).sum().backward()
    for rank in range(world_size):
        rows = slice(rank * FFN // world_size, (rank + 1) * FFN // world_size)
        out[rank]["ColumnParallelLinear(gather_output=True)"] = {
            "output": y.detach(), "input grad": x.grad, "weight grad": lin1.weight.grad[rows]}
        out[rank]["RowParallelLinear(input_is_parallel=False)"] = {
            "output": y2.detach(), "input grad": h.grad, "weight grad": lin2.weight.grad[:, rows]}
    return out


def _weight_share(t: int) -> int:
    """Bytes of this rank's slices: the first layer's rows (weight, bias), the second's
    columns, and the second's bias whole, in float32."""
    h, f = METER_HIDDEN, METER_FFN
    return ((h * f + f * h) // t + f // t + h) * 4


def _matmul_share(t: int) -> int:
    """Forward, input-gradient and weight-gradient matmuls of both layers' slices, 2·N·in·out
    FLOPs each, on the metered MLP's N tokens."""
    h, f, n = METER_HIDDEN, METER_FFN, prod(METER_TOKENS)
    return 3 * 2 * n * (h * f + f * h) // t


def tp_weight_bytes_bound(seed: int) -> dict[str, float]:
    return {"bound": MARGIN * _weight_share(METER_WORLD)}


def tp_flops_bound(seed: int) -> dict[str, float]:
    return {"bound": MARGIN * _matmul_share(METER_WORLD)}


# --------------------------------------------------------------------------- task 8.2


def sp_expected(seed: int, t: int, passes: int = SP_PASSES) -> dict[str, Any]:
    """The unsharded block, ``passes`` passes; each rank's shards and slices."""
    norm, lin1, lin2 = sp_modules(seed)
    outputs, input_grads = [], []
    for step in range(passes):
        x, w = sp_data(seed, step)
        x.requires_grad_()
        y = lin2(F.gelu(lin1(norm(x))))
        if step == 0:
            saved = layer_norm_saved_bytes(y)
            nbytes = y.numel() * y.element_size()
        (y * w).sum().backward()
        outputs.append(y.detach())
        input_grads.append(x.grad)
    ranks = []
    for r in range(t):
        cols = slice(r * FFN // t, (r + 1) * FFN // t)
        ranks.append({
            "outputs": [o.chunk(t, dim=1)[r] for o in outputs],
            "input grads": [g.chunk(t, dim=1)[r] for g in input_grads],
            "grads": {"norm.weight": norm.weight.grad, "norm.bias": norm.bias.grad,
                      "linear1.weight": lin1.weight.grad[cols],
                      "linear1.bias": lin1.bias.grad[cols],
                      "linear2.weight": lin2.weight.grad[:, cols], "linear2.bias": lin2.bias.grad}})
    return {"ranks": ranks, "saved": saved, "nbytes": nbytes}


def sp_weight_bytes_bound(seed: int) -> dict[str, float]:
    return {"bound": MARGIN * _weight_share(METER_WORLD)}


def sp_flops_bound(seed: int) -> dict[str, float]:
    # After the all-gather the matmuls see the whole sequence: N is every token of the batch.
    return {"bound": MARGIN * _matmul_share(METER_WORLD)}


# --------------------------------------------------------------------------- tasks 8.3 and 8.4


def gpipe_messages(p: int, m: int, nbytes: int) -> list[list[list[Any]]]:
    """GPipe's messages on each rank: forward recv/send per micro-batch, then backward."""
    out = []
    for r in range(p):
        msgs = []
        for _ in range(m):
            if r > 0:
                msgs.append(["recv", r - 1, nbytes])
            if r < p - 1:
                msgs.append(["send", r + 1, nbytes])
        for _ in range(m):
            if r < p - 1:
                msgs.append(["recv", r + 1, nbytes])
            if r > 0:
                msgs.append(["send", r - 1, nbytes])
        out.append(msgs)
    return out


def pipe_expected(seed: int, p: int, m: int) -> dict[str, Any]:
    """The whole pipeline in one process on the whole batch, and GPipe's messages."""
    model = pipeline(seed, p)
    xs, ys = pipe_data(seed, m)
    out = torch.cat(xs)
    for stage in model:
        out = stage(out)
    loss = mse(out, torch.cat(ys))
    loss.backward()
    nbytes = PIPE_MICRO_BATCH * PIPE_HIDDEN * 4
    return {"loss": loss.detach(), "grads": [[q.grad for q in s.parameters()] for s in model],
            "nbytes": nbytes, "p": p, "m": m, "messages": gpipe_messages(p, m, nbytes)}


def gpipe_expected(seed: int) -> list[dict[str, Any]]:
    return [pipe_expected(seed, p, m) for p, m in PIPE_SHAPES]


def one_f_one_b_played(seed: int) -> list[dict[str, Any]]:
    return [pipe_expected(seed, p, m) for p, m in ONE_F_ONE_B_PLAYED]


def held_activations_bound(seed: int) -> dict[str, float]:
    """One micro-batch's activations on the played stage: its input and its output."""
    return {"bound": MARGIN * 2 * HELD_MICRO_BATCH * HELD_HIDDEN * 4}


def _torch_interleaved_order(stage: int, p: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """Stage ``stage``'s (op, micro-batch, chunk) order as torch's ScheduleInterleaved1F1B
    computes it (torch 2.13, schedules.py): its per-rank method reads only these attributes, so
    no process group is needed."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    schedule = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = p, v, m
    schedule.number_of_rounds = max(1, m // p)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    names = {"FORWARD": "F", "FULL_BACKWARD": "B"}
    return [(names[a.computation_type.name], a.microbatch_index, a.stage_index // p)
            for a in schedule._calculate_single_rank_operations(stage) if a is not None]


def interleaved_uneven_makespans(seed: int) -> dict[str, float]:
    """The makespan of torch's interleaved orders, every stage played together with unit-time
    chunks, on each shape of INTERLEAVED_UNEVEN (m not a multiple of p): no order should take
    longer."""
    from autograder.lesson08 import INTERLEAVED_UNEVEN
    from kit.lessons.parallelism import simulate_schedule

    return {f"{p},{m},{v}": simulate_schedule([_torch_interleaved_order(s, p, m, v)
                                               for s in range(p)], forward=1.0, backward=1.0,
                                              chunks=v).makespan
            for p, v, m in INTERLEAVED_UNEVEN}
