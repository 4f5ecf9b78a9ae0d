"""The grading rank pool (autograder/pool.py) judges every case exactly as fresh ranks do.

The solutions and every seeded bug of the lessons in POOLED_LESSONS are checked twice, with
fresh ranks for each shared run and with the pool, and every case must get the same status
and points; a forbidden call made in a pooled rank still scores 0; a failed call leaves
nothing of its group behind; a group forked inside a case's gate does not keep watching for
it. (tests/test_grading.py: the batch grader gives the same records with the pool.)
"""

from __future__ import annotations

import os

import psutil
import pytest
from conftest import seeded_bugs

from autograder import course, gates, pool
from autograder.checking import run_checks
from autograder.loading import load_tasks
from autograder.registry import get_task, lesson_tasks
from kit import LaunchError

# Lessons whose tasks share world sizes across runs (the pool reuses groups), cheap to check;
# benchmarks/grading_throughput.py compares every lesson.
POOLED_LESSONS = (0, 4, 10)


def _judged(lesson: int, use_pool: bool) -> tuple[list, pool.RankPool | None]:
    module = load_tasks(course.lesson(lesson).source, lesson=lesson)
    subjects = [(t.id, "solution", getattr(module, t.name)) for t in lesson_tasks(lesson)]
    for task_id, bugs in seeded_bugs(lesson).items():
        subjects += [(task_id, what, impl) for what, impl in bugs]
    if not use_pool:
        return [(tid, what, [(c.name, c.status, c.points) for c in run_checks(tid, impl).cases])
                for tid, what, impl in subjects], None
    with pool.rank_pool(lesson_tasks(lesson)) as ranks:
        return [(tid, what, [(c.name, c.status, c.points) for c in run_checks(tid, impl).cases])
                for tid, what, impl in subjects], ranks


@pytest.mark.parametrize("lesson", POOLED_LESSONS)
def test_solutions_and_seeded_bugs_are_judged_the_same_in_the_pool(lesson):
    fresh, _ = _judged(lesson, False)
    pooled, ranks = _judged(lesson, True)
    assert ranks.calls > 0 and not ranks.groups  # the pool served runs, and closed its groups
    for (tid, what, want), (_, _, got) in zip(fresh, pooled):
        assert got == want, f"{tid} {what}: fresh {want}, pooled {got}"
    assert any(status == "passed" for _, _, cases in pooled for _, status, _ in cases)


def _calls_all_reduce(impl, seed):
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    impl(t)  # the "student's" code: it calls all_reduce itself
    return t.item() if dist.get_rank() == 0 else None


def _pids(_impl, _seed):
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    return os.getpid(), dist.get_world_size(), len(c10d._world.pg_map)


def _rank(_impl, _seed):
    import torch.distributed as dist

    return dist.get_rank()


def _new_group(_impl, _seed):
    import torch.distributed as dist

    dist.new_group([0, 1])
    return True


def _crash(_impl, _seed):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(5)
    dist.barrier()


def test_a_failed_call_stops_its_group_and_the_next_call_gets_a_fresh_one():
    with pool.rank_pool([]) as ranks:
        first = ranks.run(2, _pids, (None, 0), timeout=30)
        with pytest.raises(LaunchError, match="exited with code 5"):
            ranks.run(2, _crash, (None, 0), timeout=30)
        assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status()
                       != psutil.STATUS_ZOMBIE for pid, _, _ in first)
        second = ranks.run(2, _pids, (None, 0), timeout=30)
        assert {p for p, _, _ in second}.isdisjoint({p for p, _, _ in first})
        assert ranks.forks == 4


def test_the_pool_keeps_at_most_its_cap_of_ranks_alive(monkeypatch):
    monkeypatch.setattr(pool, "MAX_POOLED_RANKS", 5)
    with pool.rank_pool([]) as ranks:
        two = ranks.run(2, _pids, (None, 0), timeout=30)
        ranks.run(3, _pids, (None, 0), timeout=30)
        assert sorted(ranks.groups) == [2, 3]
        ranks.run(1, _pids, (None, 0), timeout=30)  # 2 + 3 + 1 > 5: size 2, used least lately
        assert sorted(ranks.groups) == [1, 3]
        assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status()
                       != psutil.STATUS_ZOMBIE for pid, _, _ in two)


def _rank_0_skips_the_barrier(_impl, _seed):
    import torch.distributed as dist

    if dist.get_rank() != 0:
        dist.barrier()


def test_a_deadlock_in_a_pooled_call_is_found_at_once_not_at_the_timeout():
    import time

    from kit import LaunchTimeout

    with pool.rank_pool([]) as ranks:
        ranks.run(2, _rank, (None, 0), timeout=30)
        start = time.monotonic()
        with pytest.raises(LaunchTimeout, match="already returned"):
            ranks.run(2, _rank_0_skips_the_barrier, (None, 0), timeout=60)
        assert time.monotonic() - start < 15
        assert ranks.run(2, _rank, (None, 0), timeout=30) == [0, 1]  # a fresh group


def test_a_call_that_makes_a_process_group_ends_its_groups_reuse():
    with pool.rank_pool([]) as ranks:
        before = ranks.run(2, _pids, (None, 0), timeout=30)
        again = ranks.run(2, _pids, (None, 0), timeout=30)
        assert [p for p, _, _ in again] == [p for p, _, _ in before]  # reused
        assert ranks.run(2, _new_group, (None, 0), timeout=30) == [True, True]
        after = ranks.run(2, _pids, (None, 0), timeout=30)
        assert {p for p, _, _ in after}.isdisjoint({p for p, _, _ in before})  # fresh ranks
        assert [n for _, _, n in after] == [n for _, _, n in before]  # no group left behind


def _calls_split(impl, seed):
    import torch

    return len(impl(torch.arange(6)))


def _student_module(tmp_path):
    import importlib.util

    student = tmp_path / "student_code.py"  # the gates judge code by the file it comes from
    student.write_text("import torch\nimport torch.distributed as dist\n\n\ndef ring(t):\n"
                       "    dist.all_reduce(t)\n\n\ndef split(t):\n"
                       "    return torch.tensor_split(t, 3)\n")
    spec = importlib.util.spec_from_file_location("student_code", student)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("task_id, run, name", [
    ("1.2", _calls_all_reduce, "ring"),  # a forbidden function: trampolines, the recorder
    ("0.1", _calls_split, "split"),  # a forbidden builtin: a TorchFunctionMode in the rank
])
def test_a_group_forked_inside_a_gate_watches_only_the_cases_it_is_called_in(tmp_path, task_id,
                                                                            run, name):
    task = get_task(task_id)
    impl = getattr(_student_module(tmp_path), name)
    with pool.rank_pool([task]) as ranks, gates.watching():
        with gates.guard(task, None):
            assert ranks.run(2, _rank, (None, 0), timeout=30) == [0, 1]  # forked in here
        assert ranks.forks == 2
        # Outside every gate the same ranks run the student's call: nothing watches them.
        assert ranks.run(2, run, (impl, 0), timeout=30)[0] in (2.0, 3)
        assert ranks.forks == 2
        # In the next case's gate, they watch for it again.
        with pytest.raises(gates.ForbiddenUse), gates.guard(task, None):
            ranks.run(2, run, (impl, 0), timeout=30)

