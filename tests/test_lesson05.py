"""Lesson 05's claims against trusted references, beyond its checks (tests/test_checks.py runs
those on the solutions, the stubs and the seeded bugs).

The solutions train like torch's own sharded trainers: ``ShardedOptimizer`` like DDP with
``ZeroRedundancyOptimizer`` and ``FSDP`` like FSDP2's ``fully_shard`` on the same units, for
several world sizes. The trusted expectations of the checks are themselves checked: Task
5.4's one-process "data parallelism" gives torch DDP's losses, and Task 5.3's per-slice
reference equals one process on the whole batch. The ZeRO formulas of :mod:`kit.lessons.sharding`
keep their properties, ownership stays balanced for any parameter sizes, and the lesson
runs headless and shows what it claims.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from lesson_support import check_outputs, pass_with_spawned_ranks, printed_text, run_headless
from torch import nn
from torch.nn import functional as F

from autograder import course, lesson05
from autograder.checking import run_checks
from autograder.loading import load_tasks
from autograder.references import lesson05 as references
from autograder.registry import get_task, lesson_tasks
from kit.failures import LaunchError
from kit.launcher import preload_modules, run_ranks
from kit.lessons.models import TinyTransformer, token_batch
from kit.lessons.sharding import STAGES, stage_bytes, stage_traffic

LESSON = 5
SOURCE = course.lesson(LESSON).source


@pytest.fixture(scope="module")
def solution():
    preload_modules(lesson05.PRELOAD)
    return load_tasks(SOURCE)


def test_lesson05_gates_name_what_each_task_reimplements():
    assert get_task("5.5").companions == ("train_step",)
    gates = {t.id: set(t.forbidden) for t in lesson_tasks(5)}
    assert gates["5.1"] == set()
    assert "torch.distributed.optim.ZeroRedundancyOptimizer" in gates["5.2"]
    assert {"torch.distributed.fsdp", "torch.distributed.fsdp.fully_shard",
            "torch.nn.parallel.DistributedDataParallel"} <= gates["5.3"]
    assert gates["5.4"] == {"kit.lessons.resume.shard_model"}
    assert {"torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad",
            "torch.distributed.tensor.DTensor.full_tensor"} <= gates["5.5"]


# --------------------------------------------------------------------------- against torch


def _untied(seed: int) -> TinyTransformer:
    torch.manual_seed(seed)
    model = TinyTransformer(vocab=32, dim=16, layers=2, heads=2, context=8)
    model.head.weight = nn.Parameter(model.tok.weight.detach().clone())
    return model


def _zero_params(which: str, sharded_optimizer, steps: int = 3) -> dict[str, torch.Tensor]:
    """Each rank: AdamW steps on its own slice, sharded by the solution or by torch."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _untied(0)
    if which == "torch":
        wrapped = DistributedDataParallel(model)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                            lr=1e-2, eps=1e-4)
    else:
        wrapped = model
        optimizer = sharded_optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, eps=1e-4)
    for step in range(steps):
        x, y = token_batch(2 * world_size, 8, 32, seed=step)
        x, y = x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]
        F.cross_entropy(wrapped(x).flatten(0, 1), y.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@settings(max_examples=3, deadline=None)
@given(world_size=st.integers(1, 4))
def test_sharded_optimizer_trains_like_ddp_with_zero_redundancy_optimizer(solution, world_size):
    ours = run_ranks(_zero_params, ("ours", solution.ShardedOptimizer), world_size=world_size,
                     echo=False)
    torchs = run_ranks(_zero_params, ("torch", None), world_size=world_size, echo=False)
    for rank in range(world_size):
        for name, p in torchs[rank].items():
            torch.testing.assert_close(ours[rank][name], p, rtol=1e-4, atol=1e-5)


def _fsdp_params(which: str, fsdp, steps: int = 2) -> dict[str, torch.Tensor]:
    """Each rank: AdamW steps on its own slice with the solution's FSDP or FSDP2 per layer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _untied(0)
    if which == "torch":
        mesh = init_device_mesh("cpu", (world_size,))
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                fully_shard(m, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    else:
        wrapped = fsdp(model)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, eps=1e-4)
    for step in range(steps):
        x, y = token_batch(2 * world_size, 8, 32, seed=step)
        x, y = x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]
        F.cross_entropy(wrapped(x).flatten(0, 1), y.flatten()).backward()
        getattr(wrapped, "finish_gradient_synchronization", lambda: None)()
        optimizer.step()
        optimizer.zero_grad()
    if which == "torch":
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return wrapped.full_state_dict()


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp_solution_trains_like_fully_shard_on_the_same_units(solution, world_size):
    ours = run_ranks(_fsdp_params, ("ours", solution.FSDP), world_size=world_size, echo=False)
    torchs = run_ranks(_fsdp_params, ("torch", None), world_size=world_size, echo=False)
    assert set(ours[0]) == set(torchs[0])
    for rank in range(world_size):
        for name, p in torchs[rank].items():
            torch.testing.assert_close(ours[rank][name], p, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- the references


def _ddp_losses(seed: int) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(lesson05._fsdp2_model(seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(lesson05.FSDP2_STEPS):
        x, y = lesson05._slice(seed, step, rank, world_size, lesson05.FSDP2_PER_RANK,
                               lesson05.FSDP2_LENGTH, lesson05.FSDP2_VOCAB)
        loss = lesson05._loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_task_5_4_reference_gives_torch_ddp_losses():
    expected = references.fsdp2_expected(3)["losses"]
    ddp = run_ranks(_ddp_losses, (3,), world_size=lesson05.FSDP2_RANKS, echo=False)
    for rank in range(lesson05.FSDP2_RANKS):
        assert ddp[rank] == pytest.approx(expected[rank], rel=1e-5, abs=1e-6)


def test_task_5_3_reference_in_fp32_is_one_process_on_the_whole_batch():
    expected = references.fsdp_expected(5)["float32"]
    model = lesson05._fsdp_model(5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=lesson05.EPS)
    for step in range(lesson05.FSDP_STEPS):
        x, y = token_batch(lesson05.FSDP_RANKS * lesson05.FSDP_PER_RANK, lesson05.FSDP_LENGTH,
                           lesson05.FSDP_VOCAB, 5 * 7919 + step)
        lesson05._loss(model(x), y).backward()  # equal slices: the mean of the slices' means
        if step == 0:
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad, expected["grads"][name], rtol=1e-4, atol=1e-6)
        optimizer.step()
        optimizer.zero_grad()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected["final"][name], rtol=1e-4, atol=1e-5)


def _torch_clips_the_sharded_model(seed: int, labels: tuple[str, ...]) -> dict[str, Any]:
    """Each rank: torch's own clip_grad_norm_ on the FSDP2 DTensors of the clipping model."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = lesson05._clip_shard(lesson05._clip_model(seed))
    rows = lesson05.CLIP_PER_RANK
    x, y = lesson05._clip_batch(seed, world_size, rows)
    x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
    out: dict[str, Any] = {
        "local rows": {n: p.to_local().shape[0] for n, p in model.named_parameters()}
    }
    for label, norm_type, max_norm in lesson05.CLIP_CALLS:
        if label not in labels:
            continue
        model.zero_grad(set_to_none=True)
        lesson05._clip_loss(model(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm,
                                              2.0 if norm_type is None else norm_type)
        out[label] = (norm.full_tensor().item(), lesson05._full_grads(model))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_task_5_5_reference_equals_torch_clipping_the_fsdp2_shards(world_size):
    expected = (references.clip_expected_2 if world_size == 2 else references.clip_expected_4)(3)
    preload_modules(lesson05.PRELOAD)
    # torch 2.13's own inf norm raises on a rank holding an empty shard (below): not on 4 ranks
    labels = tuple(
        label for label, _, _ in lesson05.CLIP_CALLS if world_size == 2 or label != "inf"
    )
    ranks = run_ranks(
        _torch_clips_the_sharded_model, (3, labels), world_size=world_size, echo=False
    )
    for label in labels:
        for norm, grads in (run[label] for run in ranks):
            assert norm == pytest.approx(expected[label]["norm"].item(), rel=1e-12)
            for name, want in expected[label]["grads"].items():
                if want is None:  # the frozen and the unused unit
                    assert grads[name] is None, name
                else:
                    torch.testing.assert_close(grads[name], want, rtol=1e-12, atol=1e-12)
    # the clipping cases' model really is split unevenly: on 4 ranks some shards are empty
    rows = [run["local rows"] for run in ranks]
    assert any(len({r[n] for r in rows}) > 1 for n in rows[0])
    assert (world_size == 4) == any(r[n] == 0 for r in rows for n in r)
    assert {n for n, g in expected["2"]["grads"].items() if g is None} == {
        "frozen.weight", "frozen.bias", "unused.weight", "unused.bias"}


def test_torch_clip_grad_norm_inf_raises_on_a_rank_with_an_empty_shard():
    """What Lesson 05 says of torch 2.13: its inf norm fails where an uneven split leaves a rank
    an empty piece (ranks 2 and 3 of 4 here), the task's clip_grad_norm_ does not."""
    preload_modules(lesson05.PRELOAD)
    with pytest.raises(LaunchError, match="infinity norm on an empty tensor") as failed:
        run_ranks(_torch_clips_the_sharded_model, (3, ("inf",)), world_size=4, echo=False,
                  timeout=60)
    raised = {
        f.rank for f in failed.value.failures if "infinity norm on an empty tensor" in f.summary
    }
    assert raised == {2, 3}  # the others only lose their peers


def test_task_5_5_clipping_cases_are_active_and_idle_as_they_say():
    expected = references.clip_expected_4(0)
    for label, _, max_norm in lesson05.CLIP_CALLS:
        assert (expected[label]["norm"].item() > max_norm) == (max_norm == lesson05.CLIP_TINY)


# A clip that moves more than one number, with right values: only the communication cases fail.
TRAFFIC_BUGS = ("one all-reduce per parameter", "all-reduces a vector of per-parameter norms",
                "all-gathers the ranks' local sums")


@pytest.mark.parametrize("bug", TRAFFIC_BUGS)
def test_a_clip_with_right_values_and_more_traffic_fails_only_the_recorder_cases(bugs, bug):
    report = run_checks("5.5", dict(bugs["5.5"])[bug])
    failed = sorted(c.name for c in report.cases if c.status != "passed")
    assert failed == sorted(c.name for c in get_task("5.5").cases
                            if "all-reduce" in c.name or "bytes" in c.name), report.to_text()
    assert all(c.status == "failed" for c in report.cases if c.name in failed)


# --------------------------------------------------------------------------- the bounds, measured

# A seeded bug with right values that keeps memory the technique saves: (task, bug) -> the bound
# cases it fails (by what they bound) and words of the saving each failure must name.
MEMORY_BUGS = {
    ("5.2", "keeps every parameter's state on every rank, shows only its own in self.state"):
        {"optimizer state per rank": "optimizer state for parameters it does not own"},
    ("5.3", "keeps a reference to each unit's gathered buffer after forward"):
        {"bytes alive after the forward": "gathered units stay alive after their forward",
         "peak bytes during the forward": "several units are whole at once"},
    ("5.3", "keeps the original full parameters after wrapping"):
        {"parameter bytes per rank after wrapping": "full parameters next to its shards"},
    ("5.4", "keeps every block gathered until backward (reshard_after_forward=False)"):
        {"bytes alive after the forward": "every block stays gathered"},
}


@pytest.mark.parametrize(
    ("task_id", "bug"), list(MEMORY_BUGS), ids=[f"{t}: {b}" for t, b in MEMORY_BUGS]
)
def test_a_bug_that_keeps_the_memory_fails_only_its_bound_naming_the_saving_lost(
    bugs, task_id, bug
):
    task = get_task(task_id)
    bounds = MEMORY_BUGS[(task_id, bug)]
    names = {f"{b.what} is within {b.formula}": b.what for b in task.bounds}
    report = run_checks(task_id, dict(bugs[task_id])[bug])
    failed = {c.name: c for c in report.cases if c.status != "passed"}
    assert sorted(names.get(n, n) for n in failed) == sorted(bounds), report.to_text()
    for name, case in failed.items():
        assert case.status == "failed" and bounds[names[name]] in case.message, case.message
        assert "x the bound" in case.message, case.message
    # the bound cases score 0, every other case its full share, and the lost saving caps the
    # task at half its points (autograder.results.settle)
    kept = sum(c.max_points for c in report.cases if c.name not in failed)
    assert report.score == pytest.approx(min(kept, task.points / 2))


def test_every_task_of_lesson05_but_the_meter_states_a_bound_with_a_formula():
    for t in lesson_tasks(5):
        if t.id == "5.1":  # state_bytes is itself a meter: it bounds nothing
            assert not t.bounds
            continue
        assert t.bounds and all(b.formula and b.lost for b in t.bounds), t.id


# --------------------------------------------------------------------------- formulas, balance


@settings(max_examples=50, deadline=None)
@given(params=st.integers(1, 10**12), world_size=st.integers(1, 4096),
       precision=st.sampled_from(["fp32", "mixed (bf16 + fp32 master)"]))
def test_zero_formulas_shrink_stage_by_stage_and_reach_one_over_w(params, world_size, precision):
    totals = [sum(stage_bytes(params, world_size, s, precision).values()) for s in STAGES]
    assert totals[0] == pytest.approx(16 * params)  # Adam: 16 bytes per parameter either way
    assert all(a >= b for a, b in zip(totals, totals[1:]))
    assert totals[3] == pytest.approx(totals[0] / world_size)
    if world_size == 1:
        assert totals == pytest.approx([totals[0]] * 4)
    if world_size > 1:
        assert stage_traffic(params, world_size, 3) == pytest.approx(
            1.5 * stage_traffic(params, world_size, 0))
        assert stage_traffic(params, world_size, 1) == stage_traffic(params, world_size, 0)


def _owners(sharded_optimizer, cases: list[list[list[int]]]) -> list[list[int]]:
    """Per case (parameter groups of the given sizes): for each parameter, its elements if this
    rank keeps its state (SGD momentum buffers exist on the owner only), else 0."""
    out = []
    for groups in cases:
        params = [[nn.Parameter(torch.zeros(n)) for n in sizes] for sizes in groups]
        optimizer = sharded_optimizer([{"params": params[0]}], torch.optim.SGD, lr=0.1,
                                      momentum=0.9)
        for ps in params[1:]:
            optimizer.add_param_group({"params": ps})
        for p in (p for ps in params for p in ps):
            p.grad = torch.ones_like(p)
        optimizer.step()
        out.append([p.numel() if p in optimizer.state else 0 for ps in params for p in ps])
    return out


def test_ownership_is_balanced_for_random_parameter_sizes(solution):
    rng = random.Random(0)
    cases = [[[rng.choice([1, 3, 16, 100, 1000, 4096]) for _ in range(rng.randint(1, 8))]
              for _ in range(rng.randint(1, 3))] for _ in range(30)]
    world_size = 3
    per_rank = run_ranks(_owners, (solution.ShardedOptimizer, cases), world_size=world_size,
                         echo=False)
    for i, groups in enumerate(cases):
        sizes = [n for sizes in groups for n in sizes]
        owned = [per_rank[r][i] for r in range(world_size)]
        for j in range(len(sizes)):  # every parameter has exactly one owner
            assert sum(1 for r in range(world_size) if owned[r][j]) == 1, (groups, owned)
        bound = sum(sizes) / world_size + max(sizes)
        assert max(sum(o) for o in owned) <= bound, (groups, owned)


# --------------------------------------------------------------------------- the lesson


@pytest.mark.slow
def test_lesson05_runs_headless_with_its_solutions_and_shows_what_it_claims():
    result = run_headless(LESSON, timeout=240, budget=240)
    printed = printed_text(result)
    # with the solutions in place no launch may fail (a caught LaunchError prints and goes on)
    assert " first:" not in printed and "not yet (" not in printed, result.slowest(8)
    rows = [line.split() for line in printed.splitlines()
            if line.startswith(("DDP ", "ZeRO-1 ", "FSDP ")) and len(line.split()) == 4]
    assert len(rows) == 9, printed  # 3 schemes x (params, grads, optimizer)
    for scheme, kind, counted, formula in rows:
        assert math.isclose(float(counted), float(formula), rel_tol=0.03), (scheme, kind)
    assert (
        "reshard_after_forward=True: {'all_gather_single': 10, 'reduce_scatter_single': 5}"
        in printed
    )
    assert (
        "reshard_after_forward=False: {'all_gather_single': 5, 'reduce_scatter_single': 5}"
        in printed
    )
    assert "prefetch=False: 38 all-gathers, 0 of them started ahead" in printed
    assert "prefetch=True: 38 all-gathers, 18 of them started ahead" in printed
    yours, torchs = (re.search(rf"{who}: norm ([\d.]+), collectives \[(.*)\]", printed).groups()
                     for who in ("yours", "torch"))
    assert yours[0] == torchs[0] and yours[1] == "('all_reduce', 4)"  # one float32 element
    n_grads = sum(
        1 for _ in TinyTransformer(vocab=256, dim=64, layers=4, heads=4, context=32).parameters()
    )
    assert torchs[1] == f"('all_reduce', {4 * n_grads})"  # torch's: one element per gradient
    step = re.search(r"train_step, rank 0: (\{.*\})", printed).group(1)
    assert "'all_reduce': 1" in step and "'reduce_scatter_single': 5" in step  # 4 blocks + root
    # persistent ranks: the shards built in one cell, a step in the next, gathered in a third
    assert "[rank 1] qkv.weight DTensor (192, 64) (Shard(dim=0),): this rank holds (96, 64)" \
        in printed, printed
    assert "[rank 0] grad DTensor (Shard(dim=0),), local (96, 64)" in printed
    assert "[rank 1] Adam exp_avg DTensor (Shard(dim=0),), local (96, 64)" in printed
    assert "[rank 1] full (192, 64); row block 1 of it is this rank's shard: True" in printed
    full, mine = re.search(r"the model: (\d+) MiB .* rank 0 holds (\d+) MiB", printed).groups()
    assert int(mine) == pytest.approx(int(full) / 4, rel=0.05)  # meta-device init: 1/4 per rank
    check_outputs(result)


@pytest.mark.slow
def test_checks_pass_with_spawned_ranks_as_on_macos(solution, monkeypatch):
    pass_with_spawned_ranks(monkeypatch, solution,
                            dict.fromkeys(("5.1", "5.2", "5.3", "5.4", "5.5"), -1))
