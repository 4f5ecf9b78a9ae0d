"""Lesson 03's checks can pass and can fail: solution passes, stubs and seeded bugs fail.

Also proves the lesson's claims independently of the checks: the solution's ShardSampler
matches torch's DistributedSampler (hypothesis), gather_unpadded matches one process for every
small (length, world size), and kit.lessons.data's timing and index streams measure what they say.
"""

from __future__ import annotations

import ast
import json

import pytest
import torch
from case_support import failed_cases
from conftest import seeded_bugs
from hypothesis import given, settings
from hypothesis import strategies as st
from lesson_support import check_outputs, pass_with_spawned_ranks, printed_text, run_headless
from torch.utils.data import DataLoader, DistributedSampler

from autograder import course
from autograder.registry import CheckFailed, get_task
from kit.launcher import run_ranks
from kit.lessons.data import SlowDataset, plot_index_streams, sampler_streams, time_loader

LESSON = 3
BUGS = seeded_bugs(LESSON)
SOURCE = course.lesson(LESSON).source
STUDENT = course.lesson(LESSON).notebook


def test_wrapping_distributed_sampler_fails_only_the_own_implementation_case():
    wrapped = dict(BUGS["3.1"])["wraps torch's DistributedSampler"]
    assert failed_cases("3.1", wrapped) == [
        "iterates on its own (does not wrap torch's DistributedSampler)"
    ]


def test_sampler_search_reports_the_smallest_differing_case():
    # Pads once only: wrong exactly when the padding (total_size - N) is longer than the dataset.
    bug = dict(BUGS["3.1"])[
        "pads once only: too short when the dataset is smaller than the padding"
    ]
    case = next(c for c in get_task("3.1").cases if c.name.startswith("hypothesis"))
    got = case.run(bug, 0)
    n, replicas, *_ = got["smallest failure"]["params"]
    assert 0 < n and replicas - n > n  # the padding (replicas - n) exceeds the dataset
    with pytest.raises(CheckFailed, match=r"ShardSampler\(range\("):
        case.compare(got, None)


def test_tampered_search_results_are_rechecked_by_the_trusted_side(solution):
    case = next(c for c in get_task("3.1").cases if c.name.startswith("hypothesis"))
    got = case.run(solution.ShardSampler, 0)
    record = got["tried"][-1]
    key = next(iter(record["got"]))
    record["got"][key]["len"] += 1  # what a sampler reporting the wrong length would send
    with pytest.raises(CheckFailed, match="wrong len"):
        case.compare(got, None)
    with pytest.raises(CheckFailed, match="tried only"):
        case.compare({"smallest failure": None, "tried": got["tried"][:3]}, None)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 120), replicas=st.integers(1, 8), shuffle=st.booleans(),
       seed=st.integers(0, 10**6), drop_last=st.booleans(), epoch=st.integers(0, 50))
def test_solution_sampler_equals_distributed_sampler(solution, n, replicas, shuffle, seed,
                                                     drop_last, epoch):
    for rank in range(replicas):
        ours = solution.ShardSampler(range(n), replicas, rank, shuffle, seed, drop_last)
        torchs = DistributedSampler(range(n), replicas, rank, shuffle, seed, drop_last)
        ours.set_epoch(epoch)
        torchs.set_epoch(epoch)
        assert list(ours) == list(torchs) and len(ours) == len(torchs)


def _every_length_on_rank(gather_unpadded, lengths):
    import torch.distributed as dist

    out = []
    for n in lengths:
        values = torch.arange(n * 2, dtype=torch.float64).reshape(n, 2)  # (n, 2)
        sampler = DistributedSampler(
            range(n), dist.get_world_size(), dist.get_rank(), shuffle=False
        )
        out.append(gather_unpadded(values[list(sampler)], n))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_gather_unpadded_restores_every_length_on_every_world_size(solution, world_size):
    lengths = list(range(12))
    for rank_result in run_ranks(_every_length_on_rank, (solution.gather_unpadded, lengths),
                                 world_size=world_size, echo=False, timeout=30):
        for n, got in zip(lengths, rank_result):
            assert torch.equal(got, torch.arange(n * 2, dtype=torch.float64).reshape(n, 2)), n


def test_naive_padded_accuracy_differs_from_single_process_but_gathered_equals_it(solution):
    # The lesson's claim: counting padded duplicates skews the metric; gathering fixes it.
    n, world_size = 10, 4
    correct = (torch.arange(n) < 2).to(torch.int64)  # only the samples padding repeats are right

    def on_rank(gather_unpadded):
        import torch.distributed as dist

        idx = list(DistributedSampler(range(n), world_size, dist.get_rank(), shuffle=False))
        counts = torch.tensor([correct[idx].sum().item(), len(idx)], dtype=torch.float64)
        dist.all_reduce(counts)
        return (counts[0] / counts[1]).item(), gather_unpadded(
            correct[idx], n
        ).double().mean().item()

    naive, exact = run_ranks(on_rank, (solution.gather_unpadded,), world_size=world_size,
                             echo=False)[0]
    assert exact == correct.double().mean().item() == 0.2
    assert naive == pytest.approx(4 / 12)


def test_sampler_streams_without_set_epoch_repeat_epoch_zero():
    def make(rank):
        return DistributedSampler(range(10), 4, rank, shuffle=True, seed=0)

    fixed = sampler_streams(make, 4, 3, set_epoch=False)
    moving = sampler_streams(make, 4, 3, set_epoch=True)
    assert fixed[0] == fixed[1] == fixed[2] == moving[0]
    assert moving[1] != moving[0]
    every = sorted(i for rank in moving[1] for i in rank)
    assert len(every) == 12 and set(every) == set(range(10))  # 2 padded duplicates


def test_index_stream_plot_frames_exactly_the_padded_slots():
    import matplotlib

    matplotlib.use("Agg")
    fig = plot_index_streams([[[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]], 10)
    frames = [p for p in fig.axes[0].patches if p.get_edgecolor()[:3] == (1.0, 0.0, 0.0)]
    assert sorted((p.get_x() + 0.5, p.get_y() + 0.5) for p in frames) == [(2.0, 2.0), (2.0, 3.0)]


def test_time_loader_sees_worker_startup_only_without_persistent_workers():
    def slow_start(worker_id):
        import time

        time.sleep(0.4)

    timings = {}
    for persistent in (False, True):
        loader = DataLoader(SlowDataset(4, 0.0), batch_size=2, num_workers=1,
                            worker_init_fn=slow_start, persistent_workers=persistent)
        timings[persistent] = time_loader(loader, epochs=2).first_batch_s
    assert timings[False][1] >= 0.4 and timings[True][1] < 0.4
    assert timings[True][0] >= 0.4


def test_slow_dataset_samples_are_made_from_the_index_and_bad_input_is_named():
    x, y = SlowDataset(5, 0.0, features=3)[4]
    assert torch.equal(x, torch.full((3,), 4.0)) and y == 4
    with pytest.raises(IndexError, match="out of range"):
        SlowDataset(5, 0.0)[5]
    with pytest.raises(ValueError, match="n >= 0"):
        SlowDataset(-1)


@pytest.mark.slow
def test_lesson03_runs_headless_with_its_solutions_and_shows_the_bugs_it_teaches():
    result = run_headless(LESSON, timeout=180)
    text = json.dumps([c.get("outputs", []) for c in result.notebook.cells])
    # The demos print what they claim: duplicated noise, identical ranks, the skewed metric.
    assert "one process: 0.200   4 ranks, all_reduce of counts: 0.333" in text
    assert "one process: 0.200   4 ranks, gather_unpadded: 0.200" in text
    printed = printed_text(result)
    draws = [line.split("=", 1)[1] for line in printed.splitlines() if "numpy draw) =" in line]
    assert len(draws) == 4
    assert draws[0] == draws[1]  # 2 ranks seeded alike draw alike without seed_worker ...
    assert draws[2] != draws[3]  # ... and differently with it
    noise = [
        ast.literal_eval(line.split(":", 1)[1])
        for line in printed.splitlines()
        if line.startswith("sample, noise:")
    ]
    assert [n for _, n in noise[0]][0::2] == [n for _, n in noise[0]][1::2]  # workers 0, 1 alike
    assert len({n for _, n in noise[1]}) == 6  # reseeded from the worker's seed: all different
    check_outputs(result)


@pytest.mark.slow
def test_rank_checks_pass_with_spawned_ranks_as_on_macos(solution, monkeypatch):
    pass_with_spawned_ranks(monkeypatch, solution, {
        "3.1": "defaults", "3.2": "different streams on every rank", "3.3": "accuracy"})


def test_a_seed_worker_that_requires_rank_fails_the_world_size_1_case_naming_the_regime(bugs):
    from autograder.checking import run_checks

    report = run_checks("3.2", dict(bugs["3.2"])[
        "requires RANK: a plain python run (world size 1) raises KeyError"])
    failed = [c for c in report.cases if c.status != "passed"]
    assert [c.name for c in failed] == [
        "world size 1: RANK unset (a plain python run), one worker: rank 0's streams"
    ], report.to_text()
    assert "world size 1 (RANK unset" in failed[0].message and "KeyError" in failed[0].message
    assert "default of 0" in failed[0].hint
