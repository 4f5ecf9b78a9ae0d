"""Lesson 06's claims, proved against torch's own behaviour and trusted references.

The solution/stub/seeded-bug runs of every task live in tests/test_checks.py; here: the hand-made
sharded save/load round-trips any split onto any other (hypothesis, against plain slicing), the
facts about DCP the lesson states (one copy of a key every rank saves, async_save stages a copy,
.metadata written last through a rename, a fresh optimizer's state_dict is empty while
get_state_dict creates the state, the CPU-backend requirement of async_save), the resumable
sampler resumes exactly, the secret kill plan always exercises both kills, and the lesson runs
headless.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from lesson_support import check_outputs, printed_text, run_headless

from autograder import course
from autograder.checking import run_checks
from autograder.lesson06 import RUN_TOTAL, _kill_plan
from autograder.registry import get_task, lesson_tasks
from kit.launcher import run_ranks
from kit.lessons.resume import ResumableSampler, make_model, make_optimizer, token_dataset

LESSON = 6
SOURCE = course.lesson(LESSON).source


# --------------------------------------------------------------------------- 6.1 by hand


def _split(total: int, cuts: list[int]) -> list[int]:
    edges = [0, *sorted(min(c, total) for c in cuts), total]
    return [b - a for a, b in zip(edges, edges[1:])]


def _save_piece(save_shards, folder, tensor, sizes):
    rank = dist.get_rank()
    offset = sum(sizes[:rank])
    save_shards(folder, "t", tensor[offset:offset + sizes[rank]].clone(), offset, tensor.numel())


@settings(max_examples=8, deadline=None)
@given(data=st.data(), total=st.integers(0, 300), save_ws=st.integers(1, 4))
def test_hand_made_shards_round_trip_any_split_onto_any_other(
    solution, tmp_path_factory, data, total, save_ws
):
    folder = str(tmp_path_factory.mktemp("shards"))
    tensor = torch.arange(total, dtype=torch.float64) * 1.5
    save_sizes = _split(total, data.draw(st.lists(st.integers(0, total), min_size=save_ws - 1,
                                                  max_size=save_ws - 1)))
    run_ranks(_save_piece, (solution.save_shards, folder, tensor, save_sizes), world_size=save_ws,
              echo=False)
    load_sizes = _split(total, data.draw(st.lists(st.integers(0, total), max_size=3)))
    offset = 0
    for n in load_sizes:  # one process loads every range: load_shards needs no collectives
        got = solution.load_shards(folder, "t", offset, n)
        assert got.dtype == torch.float64 and torch.equal(got, tensor[offset:offset + n])
        offset += n


def test_a_save_that_writes_other_ranks_pieces_fails_only_the_write_bound(bugs):
    # Right values, right files opened, right bytes read: only the kernel's count of the bytes
    # rank 0 writes shows that it wrote every rank's piece.
    task = get_task("6.1")
    (bound,) = task.bounds
    report = run_checks("6.1", dict(bugs["6.1"])["rank 0 gathers every piece and writes them all"])
    failed = [c for c in report.cases if c.status != "passed"]
    assert [c.name for c in failed] == [f"{bound.what} is within {bound.formula}"], report.to_text()
    assert failed[0].status == "failed"
    assert "rank 0 holds" in failed[0].message and "x the bound" in failed[0].message
    assert "a rank writes other ranks' pieces" in failed[0].message
    # a lost saving caps the task at half its points (autograder.results.settle)
    assert task.points - failed[0].max_points > task.points / 2
    assert report.score == pytest.approx(task.points / 2)


def test_lesson06_states_what_each_task_bounds():
    bounds = {t.id: [b.what for b in t.bounds] for t in lesson_tasks(6)}
    # 6.2 and 6.3 bound nothing (an exact resume is about what is saved; see autograder/lesson06.py)
    assert bounds == {"6.1": ["bytes a rank writes beyond its own pieces"], "6.2": [], "6.3": []}


# ------------------------------------------------------------- what the lesson says about DCP


def _same_key(folder):
    rank = dist.get_rank()
    dcp.save({"x": torch.full((2,), float(rank)), "obj": {"r": rank}}, checkpoint_id=folder)
    back = {"x": torch.zeros(2), "obj": {"r": -1}}
    dcp.load(back, checkpoint_id=folder)
    return back["x"][0].item(), back["obj"]["r"]


def test_dcp_keeps_one_copy_of_a_key_every_rank_saves(tmp_path):
    got = run_ranks(_same_key, (str(tmp_path),), world_size=3, echo=False)
    assert len(set(got)) == 1, got  # every rank loads the same (one rank's) values
    tensor_value, object_value = got[0]
    assert tensor_value in (0.0, 1.0, 2.0) and object_value in (0, 1, 2)


def _change_while_saving(folder):
    w = torch.arange(100, dtype=torch.float32)
    future = dcp.async_save(
        {"w": w}, checkpoint_id=folder, process_group=dist.new_group(backend="gloo")
    )
    w.zero_()
    future.result()
    back = {"w": torch.full((100,), -1.0)}
    dcp.load(back, checkpoint_id=folder)
    return back["w"]


def test_async_save_keeps_the_values_of_the_moment_it_was_called(tmp_path):
    got = run_ranks(_change_while_saving, (str(tmp_path),), world_size=2, echo=False)
    for w in got:
        assert torch.equal(w, torch.arange(100, dtype=torch.float32))


def _save_watching_finish(folder):
    from torch.distributed.checkpoint import filesystem

    seen = {}
    original = filesystem._FileSystemWriter.finish

    def finish(self, *args, **kwargs):
        seen["before"] = sorted(os.listdir(folder))
        original(self, *args, **kwargs)
        seen["after"] = sorted(os.listdir(folder))

    filesystem._FileSystemWriter.finish = finish
    dcp.save({"w": torch.ones(10) * dist.get_rank(), f"r{dist.get_rank()}": torch.ones(3)},
             checkpoint_id=folder)
    return seen


def test_metadata_is_written_last_after_every_rank_wrote_its_data(tmp_path):
    got = run_ranks(_save_watching_finish, (str(tmp_path),), world_size=2, echo=False)
    seen = got[0]  # rank 0 coordinates and writes .metadata
    assert ".metadata" not in seen["before"]
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(seen["before"])
    assert ".metadata" in seen["after"] and ".metadata.tmp" not in seen["after"]
    assert got[1] == {}  # rank 1 never writes metadata
    source = inspect.getsource(dcp.filesystem._FileSystemWriter.finish)
    assert "rename(tmp_path, metadata_path)" in source


def test_a_fresh_optimizer_has_no_state_until_get_state_dict_creates_it():
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = make_model()
    optimizer = make_optimizer(model)
    assert optimizer.state_dict()["state"] == {}
    _, optim_state = get_state_dict(model, optimizer)
    assert set(optim_state["state"]["tok.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert all(p.grad is None for p in model.parameters())


@settings(max_examples=25, deadline=None)
@given(numel=st.integers(1, 300), cuts=st.lists(st.integers(0, 300), max_size=4),
       seed=st.integers(0, 2**16))
def test_the_lessons_adamw_updates_any_split_of_a_tensor_bit_for_bit_as_the_whole(
    numel, cuts, seed
):
    """make_optimizer's foreach AdamW: FSDP2 shards of any size train exactly alike, which an
    exact resume on another number of ranks needs, and exactly as the single-tensor AdamW does.
    torch's fused AdamW does not (its vector loop and its scalar tail round differently: 57 of
    3,000 random splits differed in the last bit on a 2-core AMD EPYC, torch 2.13; foreach and
    single-tensor: 0 of 3,000), which is why the lesson does not use it."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randn(numel, generator=g)
    grads = [torch.randn(numel, generator=g) for _ in range(3)]

    def train(sizes, make=make_optimizer):
        model = torch.nn.Module()
        model.pieces = torch.nn.ParameterList(torch.nn.Parameter(t.clone())
                                              for t in start.split(sizes) if t.numel())
        optimizer = make(model)
        for grad in grads:
            for p, gp in zip(model.pieces, [t for t in grad.split(sizes) if t.numel()]):
                p.grad = gp.clone()
            optimizer.step()
        return torch.cat([p.detach() for p in model.pieces])

    whole = train([numel])
    assert not torch.equal(whole, start)
    assert torch.equal(train(_split(numel, cuts)), whole)
    single = train(
        _split(numel, cuts),
        lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01, foreach=False),
    )
    assert torch.equal(single, whole)


def test_async_save_requires_a_group_with_a_cpu_backend_as_the_lesson_quotes():
    source = inspect.getsource(dcp.async_save)
    assert "A CPU backend must be enabled for async save; try initializing process group with " \
           "'cpu:gloo,cuda:nccl'" in source


# ------------------------------------------------- kit.lessons.resume and the kill plan


@settings(max_examples=20, deadline=None)
@given(first=st.integers(0, 30), world_size=st.integers(1, 4), rank=st.integers(0, 3))
def test_resumable_sampler_resumes_exactly_where_it_stopped(first, world_size, rank):
    rank = rank % world_size
    data = token_dataset(40)
    straight = ResumableSampler(data, num_replicas=world_size, rank=rank, seed=3)
    straight.set_epoch(2)
    order = list(straight)
    stopped = ResumableSampler(data, num_replicas=world_size, rank=rank, seed=3)
    stopped.set_epoch(2)
    taken = [i for _, i in zip(range(first), stopped)]
    resumed = ResumableSampler(data, num_replicas=world_size, rank=rank, seed=3)
    resumed.set_epoch(stopped.epoch)
    resumed.position = stopped.position
    assert taken + list(resumed) == order


@given(seed=st.integers(0, 2**31 - 1))
def test_kill_plan_kills_mid_save_then_after_the_resume_point(seed):
    plan = _kill_plan(seed)
    assert plan["save_victim"] in (0, 1) and plan["step_victim"] in (0, 1)
    assert plan["save_step"] in (4, 6)
    # attempt 1 resumes at save_step - 2 at the latest: the second kill comes after that
    assert plan["save_step"] < plan["kill_step"] < RUN_TOTAL


def test_kill_plan_covers_both_ranks_and_both_saves():
    plans = [_kill_plan(seed) for seed in range(40)]
    assert {p["save_victim"] for p in plans} == {0, 1}
    assert {p["step_victim"] for p in plans} == {0, 1}
    assert {p["save_step"] for p in plans} == {4, 6}


# --------------------------------------------------------------------------- the lesson


@pytest.mark.slow
def test_lesson06_runs_headless_with_its_solutions_and_shows_what_it_claims():
    result = run_headless(LESSON, timeout=300, budget=240)
    printed = printed_text(result)
    assert "saved on 4, loaded on 2: equal to the saved model: True" in printed
    assert "saved on 4, loaded on 3: equal to the saved model: True" in printed
    assert "values in the checkpoint after an in-place change during async_save: [1.0]" in printed
    assert "bit-identical after a SIGKILL and a restart: True" in printed
    assert "same weights as the run's final parameters: True" in printed
    assert "attempt 1: complete checkpoints ['step-000002'" in printed
    check_outputs(result)


def test_a_loop_that_tests_for_the_end_after_the_step_fails_the_after_the_last_step_case(bugs):
    report = run_checks("6.3", dict(bugs["6.3"])[
        "tests for the end after the step: resumed at total_steps it trains one step more"])
    failed = [c for c in report.cases if c.status != "passed"]
    assert [c.name for c in failed] == [
        next(c.name for c in report.cases if c.name.startswith("after the last step"))
    ], report.to_text()
    assert failed[0].message.startswith("after the last step (the newest complete checkpoint is "
                                        "step-000008"), failed[0].message
    assert "called train_step at steps [8]" in failed[0].message
    assert "before each step" in failed[0].hint


def test_a_state_without_initial_optimizer_state_fails_the_unused_head_case_naming_the_regime(bugs):
    report = run_checks("6.2", dict(bugs["6.2"])[
        "saves no optimizer state for a parameter without a gradient so far: a fresh load "
        "misses its keys"])
    failed = [c for c in report.cases if c.status != "passed"]
    assert [c.name for c in failed] == [next(c.name for c in report.cases
                                             if "unused head" in c.name)], report.to_text()
    assert failed[0].message.startswith("a parameter without a gradient so far"), failed[0].message
    assert "Missing key in checkpoint state_dict: train.optim.state.unused" in failed[0].message
    assert "zeros and step 0" in failed[0].hint


def test_a_loop_that_needs_ckpt_root_to_exist_fails_the_first_run_case_naming_the_regime(bugs):
    report = run_checks("6.3", dict(bugs["6.3"])[
        "lists ckpt_root with os.listdir: a first run, before the folder exists, raises"])
    failed = [c for c in report.cases if c.status != "passed"]
    assert [c.name for c in failed] == [
        "a first run: ckpt_root does not exist yet, so it starts at step 0"], report.to_text()
    assert failed[0].message.startswith("a first run (ckpt_root does not exist yet)")
    assert "FileNotFoundError" in failed[0].message
