"""Shared by the tests/test_lessonNN.py files: a lesson's headless run, what it printed, its check
cells' outputs, and its checks under spawned ranks (as on macOS)."""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import pytest

from autograder import course
from autograder.registry import fresh_runs, get_task


def run_headless(lesson: int, timeout: float, budget: float | None = None) -> Any:
    """The lesson's source run headless (kit.runner.run_notebook); asserts it ran through and,
    given ``budget``, in fewer seconds than that."""
    from kit.runner import run_notebook

    result = run_notebook(course.lesson(lesson).source, timeout=timeout)
    assert result.ok, str(result.failure)
    if budget is not None:
        assert result.seconds < budget, result.slowest()
    return result


def printed_text(result: Any) -> str:
    """Everything the executed notebook's cells printed, in order."""
    return "".join(o.get("text", "") for c in result.notebook.cells for o in c.get("outputs", []))


def check_outputs(result: Any) -> list[dict]:
    """The outputs of the notebook's check cells; asserts there are some and none is on stderr."""
    checks = [o for c in result.notebook.cells if "check" in str(c.get("metadata", {}).get("tags"))
              for o in c.get("outputs", [])]
    assert checks and '"stderr"' not in json.dumps(checks)
    return checks


def pass_with_spawned_ranks(monkeypatch: pytest.MonkeyPatch, solution: ModuleType,
                            cases: dict[str, int | str]) -> None:
    """Each task's case (``{task id: index in task.cases, or the start of the case's name}``)
    passes with the solution when every launch spawns its ranks, as on macOS."""
    import kit.launcher

    monkeypatch.setattr(kit.launcher, "default_start_method", lambda backend: "spawn")
    fresh_runs()  # no run kept from a forked launch: these must spawn
    for task_id, which in cases.items():
        task = get_task(task_id)
        case = (task.cases[which] if isinstance(which, int)
                else next(c for c in task.cases if c.name.startswith(which)))
        case.compare(case.run(getattr(solution, task.name), 0), task.expected(case, 0))
    fresh_runs()


def fails_exactly(task_id: str, impl: Any, prefix: str) -> tuple[list[Any], Any]:
    """Runs the task's checks on ``impl``; asserts the cases it fails are exactly those whose name
    starts with ``prefix`` (in order); returns those failed cases and the report."""
    from autograder.checking import run_checks

    report = run_checks(task_id, impl)
    failed = [c for c in report.cases if c.status != "passed"]
    assert [c.name for c in failed] == [
        c.name for c in report.cases if c.name.startswith(prefix)
    ], report.to_text()
    return failed, report


def fails_only_its_bounds(task_id: str, impl: Any, lost: str | list[str] | tuple[str, ...],
                          at_least: float) -> Any:
    """Runs the task's checks on ``impl``, a mistake with the right values that keeps what the
    technique frees, and asserts the meter alone sees it: every value case passes; every bound
    case (`` is within `` in its name) fails with 0 points, names the saving lost (``lost``: one
    phrase for every bound, or one per bound in order) and holds ``at_least`` times the bound or
    more; the score is the value cases' share, at most half the task's points. Returns the
    report."""
    import re

    from autograder.checking import run_checks

    task = get_task(task_id)
    report = run_checks(task_id, impl)
    bounds = [c for c in report.cases if " is within " in c.name]
    values = [c for c in report.cases if " is within " not in c.name]
    phrases = [lost] * len(bounds) if isinstance(lost, str) else list(lost)
    assert bounds and len(bounds) == len(phrases), report.to_text()
    assert all(c.status == "passed" for c in values), report.to_text()
    for case, phrase in zip(bounds, phrases):
        assert case.status == "failed" and case.points == 0, report.to_text()
        assert phrase in case.message, case.message
        held = float(re.search(r"holds ([\d.]+)x the bound", case.message)[1])
        assert held >= at_least, case.message
    value_share = sum(task.case_points(c) for c in task.cases if " is within " not in c.name)
    # right values with the saving thrown away keep at most half of the points (issue 45)
    assert report.score == pytest.approx(min(value_share, task.points / 2))
    return report
