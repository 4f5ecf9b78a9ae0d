"""The hard gates: code that uses what its task re-implements, or the grader's code, scores 0.

Each exploit below once got full or most marks; each stands for a class of routes
(a name bound before the checks, a ProcessGroup method, a functional collective, a computed
name, a swallowed exception, a subclass, a wrapper around torch DDP, the grader's reference).
A failure here means a student can get the points of a task without doing it.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from autograder import gates
from autograder.checking import run_checks
from autograder.registry import get_task

sys.path.insert(0, str(Path(__file__).parent))

EXPLOITS = [
    ("0.1", "lesson00", "asks torch's DistributedSampler"),
    ("1.1", "lesson01", "calls broadcast imported before the checks started"),
    ("1.1", "lesson01", "calls ProcessGroup.broadcast"),
    ("1.2", "lesson01", "calls all_reduce imported before the checks started"),
    ("1.2", "lesson01", "a star: every rank sends to rank 0, which sums and sends back"),
    ("1.2", "lesson01", "calls ProcessGroup.allreduce"),
    ("1.2", "lesson01", "calls a functional collective"),
    ("1.2", "lesson01", "finds all_reduce by a computed name"),
    ("1.2", "lesson01", "catches the gate's exception and tries another route"),
    ("1.2", "lesson01", "calls the grader's reference"),
    ("1.4", "lesson01", "calls the grader's least-squares reference"),
    ("1.4", "lesson01", "predicts with kit.lessons.costmodel.ring_all_reduce_time"),
    ("3.1", "lesson03", "is torch's DistributedSampler (a subclass with no body)"),
    ("4.1", "lesson04", "wraps torch's DistributedDataParallel"),
    ("4.2", "lesson04", "wraps torch's DistributedDataParallel"),
    ("4.3", "lesson04", "wraps torch's DistributedDataParallel"),
]


def _bug(module: str, task_id: str, what: str):
    return dict(importlib.import_module(f"bugs.{module}").BUGS[task_id])[what]


@pytest.mark.parametrize(("task_id", "module", "what"), EXPLOITS)
def test_exploit_scores_zero_on_its_task(task_id, module, what):
    report = run_checks(task_id, _bug(module, task_id, what))
    assert report.score == 0, report.to_text()


@pytest.mark.parametrize(("task_id", "module", "what"), [e for e in EXPLOITS if "star" not in e[2]])
def test_gate_names_what_was_used_and_where(task_id, module, what):
    report = run_checks(task_id, _bug(module, task_id, what))
    assert report.status == "forbidden", report.to_text()
    message = next(c.message for c in report.cases if c.status == "forbidden")
    assert f"Task {task_id} uses " in message
    assert "bugs/" + module + ".py:" in message  # file:line of the student's code


def test_blocking_hook_gets_at_most_half_of_task_4_2():
    report = run_checks("4.2", _bug("lesson04", "4.2", "all-reduces in the hook but blocks there (no overlap)"))
    assert report.score <= get_task("4.2").points / 2, report.to_text()


def test_the_students_call_is_caught_inside_the_graders_harness():
    # 3.1's harness builds torch's DistributedSampler itself (its hypothesis search compares
    # with it): that is allowed, and solutions pass (tests/test_checks.py). A sampler the
    # student builds from it is not, even one made in a nested function.
    from torch.utils.data import DistributedSampler

    from autograder.checking import run_case

    def student_sampler(dataset, **kw):
        return DistributedSampler(dataset, **kw)

    task = get_task("3.1")
    result = run_case(task, task.cases[0], student_sampler)
    assert result.status == "forbidden"
    assert "torch.utils.data.DistributedSampler" in result.message
    assert "test_gates.py:" in result.message


def test_guard_restores_every_function_it_watched():
    import torch.distributed as dist

    code = dist.all_reduce.__code__
    with gates.guard(get_task("1.2"), None):
        assert dist.all_reduce.__code__ is not code
    assert dist.all_reduce.__code__ is code
    assert not gates._swapped
