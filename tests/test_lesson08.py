"""Lesson 08's claims against trusted references, beyond its checks (tests/test_checks.py runs
those on the solutions, the stubs and the seeded bugs).

The hand-built layers give what torch's own implementations give on the same weights:
``ColumnParallelLinear``/``RowParallelLinear`` what ``parallelize_module`` with
``ColwiseParallel``/``RowwiseParallel`` gives (outputs and every local gradient), and
``SequenceParallelMLP`` what the ``SequenceParallel`` plan gives; ``gpipe`` the gradients of
``torch.distributed.pipelining``'s ``ScheduleGPipe``, ``one_f_one_b`` the order in which
``Schedule1F1B`` really runs forwards and backwards, and ``interleaved_one_f_one_b`` the order
``ScheduleInterleaved1F1B`` computes for each rank. The schedule simulator and the layout
arithmetic of :mod:`kit.lessons.parallelism` keep their formulas (bubble, peak activations,
Korthikanti's activation memory, bus bytes), and the lesson runs headless.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from lesson_support import (
    check_outputs,
    fails_exactly,
    fails_only_its_bounds,
    pass_with_spawned_ranks,
    printed_text,
    run_headless,
)
from torch import nn
from torch.nn import functional as F

from autograder import course
from autograder.checking import run_checks
from autograder.registry import get_task, lesson_tasks
from kit.launcher import run_ranks
from kit.lessons import costmodel
from kit.lessons.parallelism import Model, Network, layout_costs, layout_table, simulate_schedule

LESSON = 8
SOURCE = course.lesson(LESSON).source
# Imported before the ranks fork: each rank would otherwise pay the slow first import.
DTENSOR = ("torch.distributed.tensor.parallel",)
PIPELINING = ("torch.distributed.pipelining", "torch.fx.experimental.symbolic_shapes")


def test_lesson08_gates_name_what_each_task_reimplements():
    assert all(t.forbidden for t in lesson_tasks(8))  # every task names what it re-implements


# --------------------------------------------------------------------------- against DTensor


def _ours_and_torchs_mlp(column_cls, row_cls, hidden=8):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    theirs = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
    ours = nn.Sequential(column_cls(theirs[0]), nn.GELU(), row_cls(theirs[2]))
    parallelize_module(theirs, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(3, 5, hidden, generator=torch.Generator().manual_seed(1))
    outputs = []
    for model in (ours, theirs):
        y = model(x)
        y.pow(3).mean().backward()
        outputs.append(
            torch.Tensor(y.detach()).clone() if not hasattr(y, "wait") else y.wait().clone()
        )
    grads = {}
    for name, layer in (("column", 0), ("row", 2)):
        for p in ("weight", "bias"):
            ours_grad = getattr(ours[layer], p).grad
            theirs_grad = getattr(theirs[layer], p).grad.to_local()
            grads[f"{name} {p}"] = (ours_grad.clone(), theirs_grad.clone())
    return outputs, grads


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_layers_equal_torch_colwise_and_rowwise_parallel(solution, world_size):
    results = run_ranks(
        _ours_and_torchs_mlp,
        (solution.ColumnParallelLinear, solution.RowParallelLinear),
        world_size=world_size,
        echo=False,
        preload=DTENSOR,
    )
    for outputs, grads in results:
        torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)
        for name, (ours, theirs) in grads.items():
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=name)


def _ours_and_torchs_sequence_parallel(impl, hidden=8, seq=8):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    t, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (t,))
    torch.manual_seed(0)
    theirs = nn.ModuleDict({"norm": nn.LayerNorm(hidden), "up": nn.Linear(hidden, 4 * hidden),
                            "down": nn.Linear(4 * hidden, hidden)})
    with torch.no_grad():
        theirs["norm"].weight.uniform_(0.5, 1.5)
    ours = impl(copy.deepcopy(theirs["norm"]), theirs["up"], theirs["down"])
    parallelize_module(theirs, mesh, {"norm": SequenceParallel(),
                                      "up": ColwiseParallel(input_layouts=Shard(1)),
                                      "down": RowwiseParallel(output_layouts=Shard(1))})
    x = torch.randn(2, seq, hidden, generator=torch.Generator().manual_seed(1)).chunk(t, dim=1)[r]
    y_theirs = theirs["down"](F.gelu(theirs["up"](theirs["norm"](x))))
    y_ours = ours(x)
    y_theirs.pow(2).sum().backward()
    y_ours.pow(2).sum().backward()
    return (y_ours.detach().clone(), y_theirs.wait().clone() if hasattr(y_theirs, "wait") else
            y_theirs.detach().clone(), ours.norm.weight.grad.clone(),
            theirs["norm"].weight.grad.full_tensor().clone())


@pytest.mark.parametrize("world_size", [2, 4])
def test_sequence_parallel_block_equals_torch_sequence_parallel_plan(solution, world_size):
    for y_ours, y_theirs, g_ours, g_theirs in run_ranks(
            _ours_and_torchs_sequence_parallel, (solution.SequenceParallelMLP,),
            world_size=world_size, echo=False, preload=DTENSOR):
        torch.testing.assert_close(y_ours, y_theirs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g_ours, g_theirs, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- against pipelining


def _step(schedule, x, target, losses=None):
    """One step of a torch schedule on this rank: the first stage feeds the batch, the last
    stage the target (and collects the losses), every stage calls step."""
    rank, p = dist.get_rank(), dist.get_world_size()
    fed = {"target": target, "losses": losses} if rank == p - 1 else {}
    schedule.step(*(x,) if rank == 0 else (), **fed)


def _gpipe_vs_schedule_gpipe(gpipe, m, hidden=6):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(p)]
    mine, theirs = stages[rank], copy.deepcopy(stages[rank])
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(2 * m, hidden, generator=gen), torch.randn(2 * m, hidden, generator=gen)
    schedule = ScheduleGPipe(PipelineStage(theirs, rank, p, torch.device("cpu")), n_microbatches=m,
                             loss_fn=F.mse_loss)
    losses = []
    _step(schedule, x, y, losses)
    loss = gpipe(mine, list(x.chunk(m)), list(y.chunk(m)), F.mse_loss)
    grads = [
        (a.grad.clone(), b.grad.clone()) for a, b in zip(mine.parameters(), theirs.parameters())
    ]
    their_loss = torch.stack(losses).mean().detach() if losses else None
    return grads, loss, their_loss


@pytest.mark.parametrize("p,m", [(2, 2), (3, 5), (4, 4)])
def test_gpipe_equals_torch_schedule_gpipe(solution, p, m):
    for rank, (grads, loss, their_loss) in enumerate(
            run_ranks(_gpipe_vs_schedule_gpipe, (solution.gpipe, m), world_size=p, echo=False,
                      preload=PIPELINING)):
        for ours, theirs in grads:
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
        if rank == p - 1:
            torch.testing.assert_close(loss, their_loss)
        else:
            assert loss is None


def _torch_1f1b_order(m, hidden=4):
    """The order Schedule1F1B really runs its stage's forwards and backwards in."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, p = dist.get_rank(), dist.get_world_size()
    stage = PipelineStage(nn.Linear(hidden, hidden), rank, p, torch.device("cpu"))
    order = []
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def record_forward(index, *args, **kwargs):
        order.append(("F", index))
        return forward(index, *args, **kwargs)

    def record_backward(index, *args, **kwargs):
        order.append(("B", index))
        return backward(index, *args, **kwargs)

    stage.forward_one_chunk, stage.backward_one_chunk = record_forward, record_backward
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=F.mse_loss)
    _step(schedule, torch.randn(m, hidden), torch.randn(m, hidden))
    return order


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 7)])
def test_one_f_one_b_is_the_order_torch_schedule_1f1b_runs(solution, p, m):
    orders = run_ranks(_torch_1f1b_order, (m,), world_size=p, echo=False, preload=PIPELINING)
    for stage, order in enumerate(orders):
        assert solution.one_f_one_b(stage, p, m) == order


def _torch_interleaved_order(rank, p, m, v):
    """The (op, micro-batch, chunk) order ScheduleInterleaved1F1B computes for a rank, without a
    process group: its per-rank method reads only these attributes."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    schedule = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = p, v, m
    schedule.number_of_rounds = max(1, m // p)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    ops = schedule._calculate_single_rank_operations(rank)
    names = {"FORWARD": "F", "FULL_BACKWARD": "B"}
    return [(names[a.computation_type.name], a.microbatch_index, a.stage_index // p)
            for a in ops if a is not None]


@pytest.mark.parametrize(
    "p,v,m",
    [
        (1, 3, 2),
        (2, 2, 2),
        (2, 3, 6),
        (4, 2, 4),
        (4, 2, 8),
        (4, 3, 12),
        (3, 4, 9),
        (1, 1, 1),
        (4, 2, 1),
        (4, 2, 3),
        (4, 2, 6),
        (4, 3, 10),
        (3, 2, 8),
        (5, 2, 7),
    ],
)
def test_interleaved_one_f_one_b_is_the_order_torch_schedule_interleaved_1f1b_computes(solution, p,
                                                                                      v, m):
    for stage in range(p):
        assert solution.interleaved_one_f_one_b(stage, p, m, v) == _torch_interleaved_order(
            stage, p, m, v
        )


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 6), v=st.integers(1, 4), rounds=st.integers(1, 4))
def test_interleaved_bubble_is_p_minus_1_over_v_m_and_its_peak_megatrons_warmup_plus_one(
        solution, p, v, rounds):
    m = rounds * p
    run = simulate_schedule([solution.interleaved_one_f_one_b(s, p, m, v) for s in range(p)],
                            forward=1.0, backward=1.0, chunks=v)
    assert (run.makespan - 2 * v * m) / (2 * v * m) == pytest.approx((p - 1) / (v * m))
    assert run.peak_in_flight == [min((p - s - 1) * 2 + (v - 1) * p + 1, v * m) for s in range(p)]


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 6), v=st.integers(1, 4), m=st.integers(1, 20))
def test_interleaved_order_matches_torch_on_any_shape_and_refuses_what_torch_refuses(solution, p,
                                                                                     v, m):
    """Property: on every shape torch's ScheduleInterleaved1F1B accepts, the order is torch's and
    all stages play without deadlock within the in-flight bound of rounds of r; on every shape it
    refuses (m not a multiple of max(1, m // p) rounds), a ValueError that names the rounds."""
    rounds = max(1, m // p)
    if m % rounds:
        with pytest.raises(ValueError, match="multiple of the number of rounds"):
            solution.interleaved_one_f_one_b(0, p, m, v)
        return
    orders = [solution.interleaved_one_f_one_b(s, p, m, v) for s in range(p)]
    assert orders == [_torch_interleaved_order(s, p, m, v) for s in range(p)]
    run = simulate_schedule(orders, forward=1.0, backward=1.0, chunks=v)
    r = m // rounds
    assert all(
        peak <= (p - s - 1) * 2 + (v - 1) * r + 1 for s, peak in enumerate(run.peak_in_flight)
    )
    if m % p == 0:
        assert (run.makespan - 2 * v * m) / (2 * v * m) == pytest.approx((p - 1) / (v * m))


@pytest.mark.parametrize(
    "args", [(0, 0, 4, 2), (0, 2, 0, 2), (0, 2, 4, 0), (2, 2, 4, 2), (-1, 2, 4, 2)]
)
def test_interleaved_one_f_one_b_names_an_argument_out_of_range(solution, args):
    with pytest.raises(ValueError, match="num_stages, chunks and num_microbatches"):
        solution.interleaved_one_f_one_b(*args)


@pytest.mark.parametrize("bug,case,words", [
    ("rounds of p micro-batches when m is not a multiple of p", "m not a multiple of p:",
     ("m not a multiple of p", "rounds of r")),
    ("m not a multiple of the rounds: no ValueError", "m not a multiple of max(1, m // p) rounds",
     ("ValueError", "not a multiple of the max(1, m // p)")),
])
def test_interleaved_edge_bugs_lose_only_their_edge_case_with_feedback_naming_it(bugs, bug, case,
                                                                                words):
    report = run_checks("8.5", next(impl for label, impl in bugs["8.5"] if label.startswith(bug)))
    failed = [c for c in report.cases if c.status != "passed"]
    assert [c.name for c in failed] == [next(c.name for c in report.cases
                                             if c.name.startswith(case))], report.to_text()
    feedback = f"{failed[0].message} {failed[0].expected} {failed[0].hint}"
    assert all(w in feedback for w in words), feedback
    assert 0 < report.score < get_task("8.5").points


def test_an_uneven_tensor_parallel_split_loses_only_the_indivisible_case(bugs):
    report = run_checks("8.1", dict(bugs["8.1"])[
        "splits features that do not divide by the group size unevenly (no ValueError)"])
    failed = [c for c in report.cases if c.status != "passed"]
    assert [c.name.split(" (")[0] for c in failed] == [
        "features that do not divide by the group size"], report.to_text()
    assert "6 features do not split into 4 equal slices" in failed[0].message
    assert "ValueError" in failed[0].expected


# ------------------------------------------------------------------------ kit.lessons.parallelism


def _gpipe_order(m):
    return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 12), backward=st.sampled_from([1.0, 2.0, 3.0]))
def test_simulated_bubble_is_p_minus_1_over_m_plus_p_minus_1_for_gpipe_and_1f1b(solution, p, m,
                                                                                backward):
    expected = (p - 1) / (m + p - 1)
    gpipe = simulate_schedule([_gpipe_order(m)] * p, backward=backward)
    one_f_one_b = simulate_schedule([solution.one_f_one_b(s, p, m) for s in range(p)],
                                    backward=backward)
    assert gpipe.bubble == pytest.approx(expected)
    assert gpipe.peak_in_flight == [m] * p
    assert one_f_one_b.peak_in_flight == [min(p - s, m) for s in range(p)]
    if m >= p:  # 1F1B keeps GPipe's bubble once the pipeline can fill
        assert one_f_one_b.bubble == pytest.approx(expected)
        assert one_f_one_b.makespan == pytest.approx(gpipe.makespan)


def test_simulate_schedule_reports_a_deadlock_and_a_malformed_step():
    with pytest.raises(ValueError, match="deadlock"):
        simulate_schedule([[("F", 0), ("B", 0), ("F", 1), ("B", 1)],
                           [("F", 0), ("F", 1), ("B", 0), ("B", 1)]])
    with pytest.raises(ValueError, match="unknown step"):
        simulate_schedule([[("X", 0)]])
    with pytest.raises(ValueError, match="names chunk 2"):
        simulate_schedule([[("F", 0, 2), ("B", 0, 2)]], chunks=2)


def test_simulate_schedule_chains_chunks_round_the_stages():
    # p = 2, v = 2: micro-batch 0 visits stage 0, 1, 0, 1 forward (virtual stages 0-3), back
    # the other way: 8 unit steps one after another, nothing in parallel.
    orders = [[("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)]] * 2
    run = simulate_schedule(orders, forward=1.0, backward=1.0, chunks=2)
    assert run.makespan == 8 and run.peak_in_flight == [2, 2]
    assert [(op, c, start) for op, _, c, start, _ in run.steps[0]] == [
        ("F", 0, 0), ("F", 1, 2), ("B", 1, 5), ("B", 0, 7)]
    with pytest.raises(ValueError, match="deadlock"):  # stage 1's chunk 1 needs stage 0's first
        simulate_schedule([[("F", 0, 1), ("F", 0, 0), ("B", 0, 0), ("B", 0, 1)],
                           [("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)]], chunks=2)


def test_layout_costs_follow_the_formulas_they_cite():
    model = Model(layers=8, hidden=1024, heads=16, seq=512, batch=64, micro_batch=1)
    net = Network()
    with pytest.raises(ValueError, match=r"dp \* tp \* pp != world_size"):
        layout_costs(model, 8, 2, 2, 1, net)
    c = layout_costs(model, 8, dp=2, tp=2, pp=2, net=net)
    s, b, h, a, m = 512, 1, 1024, 16, 64 // 2
    # Korthikanti et al. 2022, Table 2, tensor + sequence parallel, 16-bit: sbh(34 + 5as/h)/t per
    # layer; stage 0 of a 1F1B pipeline holds p micro-batches of its L/p layers.
    assert c.activation_bytes == pytest.approx(s * b * h * (34 + 5 * a * s / h) / 2 * (8 / 2) * 2)
    assert c.weights_bytes == pytest.approx(16 * model.params / 4)
    assert c.comm_bytes["dp"] == pytest.approx(2 * (2 - 1) / 2 * 2 * model.params / 4)
    assert c.comm_bytes["tp"] == pytest.approx(4 * (8 / 2) * m * 2 * (2 - 1) / 2 * s * b * h * 2)
    assert c.comm_bytes["pp"] == pytest.approx(2 * m * s * b * h * 2)
    assert c.bubble == pytest.approx((2 - 1) / (m + 2 - 1))
    # tensor parallelism priced as ring all-reduces on NVLink (t = 2 spans one node)
    assert c.comm_seconds["tp"] == pytest.approx(4 * 4 * m * costmodel.ring_all_reduce_time(
        s * b * h * 2, 2, net.alpha_intra, net.beta_intra))
    layouts = layout_table(model, 8, net)
    assert {(r.dp, r.tp, r.pp) for r in layouts} == {
        (dp, tp, 8 // (dp * tp)) for dp in (1, 2, 4, 8) for tp in (1, 2, 4, 8) if 8 % (dp * tp) == 0
    }


# --------------------------------------------------------------------------- the lesson


@pytest.mark.slow
def test_lesson08_runs_headless_with_its_solutions_and_shows_what_it_claims():
    result = run_headless(LESSON, timeout=600, budget=240)
    printed = printed_text(result)
    assert "sum of the 4 partial results + bias equals the MLP: True" in printed
    # persistent ranks: the plan applied in one cell, the activations looked at in the next
    assert "[rank 1] 2.weight: (64, 256) (Shard(dim=1),), this rank holds (64, 128)" in printed
    assert "[rank 0] 2.bias: (64,) (Replicate(),), this rank holds (64,)" in printed
    outputs = {line.split("] ", 1)[1] for line in printed.splitlines() if "hidden Tensor" in line}
    assert len(outputs) == 1 and "(2, 16, 128); output AsyncCollectiveTensor (2, 16, 64)" \
        in outputs.pop(), printed  # the same whole output on both ranks
    assert printed.count("rank 0: all_reduce of 262 kB") == 2  # one forward, one backward
    assert (
        "head-parallel attention equals the unsharded one: True | forward collectives: "
        "['all_reduce']"
        in printed
    )
    kept = {
        line.rsplit(None, 2)[0].strip(): float(line.split()[-2])
        for line in printed.splitlines()
        if line.endswith(" kB") and line.split()[0] in ("unsharded", "tensor", "sequence")
    }
    assert kept["unsharded"] > kept["tensor parallel"] > kept["sequence parallel"]
    assert printed.count("same output as yours: True") == 1 and "same as yours: True" in printed
    assert "gradient equals one process: True" in printed
    assert "simulate_schedule: the orders deadlock" in printed
    assert "Timed out after 5 s" in printed
    assert "ScheduleGPipe: gradients equal gpipe's on every stage: True" in printed
    assert "Schedule1F1B: gradients equal gpipe's on every stage: True" in printed
    assert "GPipe: activations held at most [8, 8, 8, 8] per stage" in printed
    assert "1F1B: activations held at most [4, 3, 2, 1] per stage" in printed
    assert (
        "1F1B: bubble 0.3750 of the work (formula 0.3750); peak in flight [4, 3, 2, 1]" in printed
    )
    assert ("interleaved 1F1B, 2 chunks: bubble 0.1875 of the work (formula 0.1875); "
            "peak in flight [11, 9, 7, 5]") in printed
    import re

    under_torchrun = re.findall(r"\]:step (\d): loss ([0-9.]+)", printed)
    one_process = re.findall(r"one process, step (\d): loss ([0-9.]+)", printed)
    assert len(under_torchrun) == 3 and under_torchrun == one_process  # TP x DP = one process
    check_outputs(result)


@pytest.mark.slow
def test_checks_pass_with_spawned_ranks_as_on_macos(solution, monkeypatch):
    pass_with_spawned_ranks(monkeypatch, solution, dict.fromkeys(("8.1", "8.2", "8.3", "8.4"), -1))


# --------------------------------------------------------------------------- the meter's bounds

# Each mistake gives the right values and the right collectives, so only the meter sees it.
FULL_WEIGHTS = [
    (
        "8.1",
        "keeps the whole weights and multiplies by them on every rank",
        (
            "tensor parallelism's 1/t of the weights per rank is lost",
            "tensor parallelism's 1/t of the compute per rank is lost",
        ),
    ),
    (
        "8.2",
        "keeps the whole weights and runs the full-width MLP on every rank",
        ("the 1/t of the weights per rank is lost", "the 1/t of the compute per rank is lost"),
    ),
]


@pytest.mark.parametrize("task_id,bug,lost", FULL_WEIGHTS, ids=["8.1", "8.2"])
def test_a_layer_keeping_the_whole_weights_fails_only_the_bounds_naming_the_lost_share(
    bugs, task_id, bug, lost
):
    fails_only_its_bounds(task_id, dict(bugs[task_id])[bug], lost, at_least=3.0)


# --------------------------------------------------------------------------- the edges (issue 44)


@pytest.mark.parametrize(("task_id", "bug", "case", "regime"), [
    ("8.2", "one rank: skips the collectives", "world size 1", "world size 1: "),
    ("8.2", "summed by hooks each forward registers", "an input without grad",
     "an input without grad, after a forward under torch.no_grad()"),
    ("8.3", "first and last stage taken as exclusive", "one stage (p = 1",
     "one stage (p = 1, 3 micro-batches)"),
    ("8.3", "shaped by microbatches[rank]", "one micro-batch on 2 stages",
     "fewer micro-batches than stages"),
    ("8.3", "micro-batches of different sizes: no ValueError", "micro-batches of different sizes",
     "micro-batches of different sizes"),
])
def test_a_seeded_bug_at_an_edge_fails_exactly_its_case_naming_the_regime(bugs, task_id, bug, case,
                                                                            regime):
    impl = next(impl for label, impl in bugs[task_id] if bug in label)
    failed, report = fails_exactly(task_id, impl, case)
    assert regime in failed[0].message, report.to_text()
