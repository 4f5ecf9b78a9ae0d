"""Lesson 02 proves what it teaches, beyond the generic checks of tests/test_checks.py.

The solution's dist_info_from_env agrees with the trusted reader on every valid torchrun layout
(hypothesis); first_mismatch finds exactly the call a single rank changed; train_step in one
process equals two ranks bit for bit (what makes an exact resume possible); the collective
recorder never communicates; and the lesson runs headless showing each failure it discusses.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from lesson_support import check_outputs, printed_text, run_headless

from autograder import course
from autograder import lesson02 as checks
from autograder.references import lesson02 as references
from autograder.registry import CheckFailed
from kit.launcher import run_ranks
from kit.lessons.debugging import RECORDED, _run_recorded, record_collectives

LESSON = 2
SOURCE = course.lesson(LESSON).source


# --------------------------------------------------------------------------- 2.1


@st.composite
def torchrun_layouts(draw):
    nnodes = draw(st.integers(1, 4))
    local_world_size = draw(st.integers(1, 8))
    node, local = draw(st.integers(0, nnodes - 1)), draw(st.integers(0, local_world_size - 1))
    return {
        "RANK": str(node * local_world_size + local),
        "LOCAL_RANK": str(local),
        "WORLD_SIZE": str(nnodes * local_world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(node),
        "MASTER_ADDR": "node0",
        "MASTER_PORT": str(draw(st.integers(1, 65535))),
    }


@settings(max_examples=150, deadline=None)
@given(env=torchrun_layouts())
def test_dist_info_matches_the_trusted_reader_on_every_torchrun_layout(solution, env):
    info = solution.dist_info_from_env(env)
    assert checks._info_as_dict(info) == checks._info_as_dict(references.dist_info_from_env(env))
    assert info.rank == info.node_rank * info.local_world_size + info.local_rank


@settings(max_examples=100, deadline=None)
@given(env=torchrun_layouts(), extra=st.integers(0, 5))
def test_dist_info_rejects_a_rank_outside_the_world_naming_rank(solution, env, extra):
    env = {"RANK": str(int(env["WORLD_SIZE"]) + extra), "WORLD_SIZE": env["WORLD_SIZE"]}
    with pytest.raises(ValueError, match="RANK"):
        solution.dist_info_from_env(env)


def test_dist_info_reads_os_environ_by_default(solution, monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    info = solution.dist_info_from_env()
    assert (info.rank, info.world_size, info.local_rank, info.is_distributed) == (2, 3, 2, True)


# --------------------------------------------------------------------------- 2.2


def _train(steps: int) -> dict[str, torch.Tensor]:
    model = references.make_model()
    optimizer = references.make_optimizer(model)
    for step in range(steps):
        references.train_step(model, optimizer, step)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_two_ranks_all_reducing_equal_one_process_accumulating_bit_for_bit():
    # The foundation of "resume exactly": the 2-rank run and the 1-process reference agree.
    on_ranks = run_ranks(_train, (4,), {}, world_size=2, timeout=30)
    alone = _train(4)
    for params in on_ranks:
        assert all(torch.equal(params[k], alone[k]) for k in alone)
    assert not torch.equal(alone["0.weight"], references.make_model().state_dict()["0.weight"])


def test_lesson_setup_trains_exactly_like_the_trusted_copy(solution):
    model, optimizer = solution.make_model(), None
    optimizer = solution.make_optimizer(model)
    for step in range(checks.TOTAL_STEPS):
        solution.train_step(model, optimizer, step)
    expected = references.uninterrupted_run()
    assert all(torch.equal(model.state_dict()[k], expected[k]) for k in expected)


@pytest.mark.parametrize("steps,says", [
    ([[0, 1, 2, 3], [0, 1, 2, 3, 4, 5]], "started again from step 0"),
    ([[0, 1, 2, 3], [3, 3, 4, 5]], "in order"),
    ([[0, 1, 2, 3], [2, 3, 5]], "in order"),
])
def test_resume_check_explains_what_went_wrong_with_the_steps(steps, says):
    expected = references.uninterrupted_run()
    with pytest.raises(CheckFailed, match=says):
        checks._compare_resumed({"steps": steps, "params": expected}, expected)


def test_resume_check_accepts_an_exact_resume_and_rejects_one_ulp_of_drift():
    expected = references.uninterrupted_run()
    good = {"steps": [[0, 1, 2, 3], [3, 4, 5]], "params": expected}
    checks._compare_resumed(good, expected)
    drifted = {k: v.clone() for k, v in expected.items()}
    drifted["2.bias"] = torch.nextafter(drifted["2.bias"], torch.full_like(drifted["2.bias"], 9.0))
    with pytest.raises(CheckFailed, match="values differ"):
        checks._compare_resumed({**good, "params": drifted}, expected)


# --------------------------------------------------------------------------- 2.3


@st.composite
def sequences_with_one_odd_rank(draw):
    world_size = draw(st.integers(3, 6))
    calls = draw(st.lists(st.tuples(st.sampled_from(["all_reduce", "broadcast", "barrier"]),
                                    st.lists(st.integers(1, 5), max_size=2).map(tuple)),
                          min_size=1, max_size=8))
    odd, index = draw(st.integers(0, world_size - 1)), draw(st.integers(0, len(calls) - 1))
    how = draw(st.sampled_from(["shape", "op", "truncate"]))
    seqs = {r: list(calls) for r in range(world_size)}
    op, shape = calls[index]
    if how == "shape":
        seqs[odd][index] = (op, (*shape, 7))
    elif how == "op":
        seqs[odd][index] = ("all_gather", shape)
    else:
        seqs[odd] = seqs[odd][:index]
    return seqs, odd, index


@settings(max_examples=200, deadline=None)
@given(case=sequences_with_one_odd_rank())
def test_first_mismatch_finds_the_one_rank_that_changed_a_call(solution, case):
    seqs, odd, index = case
    found = solution.first_mismatch(seqs)
    assert (found.index, found.ranks) == (index, [odd])
    assert found.calls[odd] == (seqs[odd][index] if index < len(seqs[odd]) else None)
    assert solution.first_mismatch({r: list(seqs[(odd + 1) % len(seqs)]) for r in seqs}) is None


# --------------------------------------------------------------------------- the recorder


def test_recorder_notes_calls_without_communicating_and_restores_torch():
    originals = {name: getattr(dist, name) for name in RECORDED}

    def would_need_peers():  # no process group here: a real call would raise
        dist.all_reduce(torch.zeros(2, 3))
        dist.barrier()
        dist.all_gather([torch.zeros(4)] * 2, torch.zeros(4))

    assert _run_recorded(would_need_peers, (), {}) == [("all_reduce", (2, 3)), ("barrier", ()),
                                                      ("all_gather", (4,))]
    assert {name: getattr(dist, name) for name in RECORDED} == originals


def _skips_on_rank_1():
    if dist.get_rank() != 1:
        dist.all_reduce(torch.ones(3))  # would hang for real: rank 1 never joins
    dist.barrier()


def test_recorded_hang_is_located_by_first_mismatch(solution):
    calls = record_collectives(_skips_on_rank_1, world_size=3, timeout=30)
    found = solution.first_mismatch(calls)
    assert (found.index, found.ranks) == (0, [1])
    assert found.calls[1] == ("barrier", ())


# ---------------------------------------------------------------- plain gloo, mismatched sizes


def _mismatched(collective: str, sizes: tuple[int, int]) -> list[float]:
    rank = dist.get_rank()
    t = torch.arange(1.0, sizes[rank] + 1) * (rank + 1)
    if collective == "broadcast":
        dist.broadcast(t, src=0)
    else:
        dist.all_reduce(t)
    return t.tolist()


def test_plain_gloo_broadcast_of_mismatched_sizes_returns_wrong_data_without_an_error():
    # The lesson's claim, on torch's gloo: no size check across ranks, no error, stale data.
    got = run_ranks(_mismatched, ("broadcast", (3, 4)), {}, world_size=2, timeout=30, echo=False)
    assert list(got) == [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 8.0]]


def test_plain_gloo_all_reduce_of_mismatched_sizes_can_abort_a_rank():
    from kit.launcher import LaunchError

    with pytest.raises(LaunchError) as err:
        run_ranks(_mismatched, ("all_reduce", (8, 7)), {}, world_size=2, timeout=30, echo=False)
    assert any(not f.consequence and "SIGABRT" in f.summary for f in err.value.failures)


# --------------------------------------------------------------------------- the lesson


@pytest.mark.slow
def test_lesson02_runs_headless_and_shows_each_failure_it_discusses():
    result = run_headless(LESSON, timeout=240)
    printed = printed_text(result)
    assert "rank 1: killed at step 3" in printed and "resuming at step 3" in printed
    assert "identical to the uninterrupted run: True" in printed
    assert "two nodes == one process: True" in printed
    assert (
        "broadcast (3, 4): returned [1.0, 2.0, 3.0, 8.0]" in printed
    )  # plain gloo: silently wrong
    assert "hung: a rank never returned" in printed and "SIGABRT" in printed
    assert "Timed out waiting 2000ms" in printed
    assert "Rank 2 failed to pass monitoredBarrier" in printed
    assert "rank 0 in all_reduce; rank 1 in barrier" in printed  # the kit's hang report
    assert "Detected mismatch between collectives" in printed and "Root Cause" in printed
    results = json.dumps([c.get("outputs", []) for c in result.notebook.cells])
    assert "Mismatch(index=3, ranks=[2]" in results
    checks_out = check_outputs(result)
    scores = [
        o["data"]["text/plain"] for o in checks_out if o.get("output_type") == "execute_result"
    ]
    assert scores == ["3.0", "4.0", "3.0"]


def _params_with_threads(threads: int) -> dict[str, torch.Tensor]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return references.uninterrupted_run()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [2, 4])
def test_reference_weights_do_not_depend_on_the_thread_count(threads):
    # torchrun workers run with OMP_NUM_THREADS=1, the checking kernel with all its cores: the
    # exact comparison is only fair if the tiny model's arithmetic ignores the thread count.
    one, many = _params_with_threads(1), _params_with_threads(threads)
    assert all(torch.equal(one[k], many[k]) for k in one)
