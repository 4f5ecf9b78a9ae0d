"""Run a task's checks in this process and show them to a student: ``check()`` and ``run_checks``.

``check("0.2", global_mean)`` in a notebook runs every case of task 0.2 (fixed seed, in this
process; cases that need ranks launch them) and returns a :class:`~autograder.results.TaskReport`:
Jupyter shows it as a table (each case passed or failed, expected vs got, a hint), a terminal as
text. Its plain-text form is just the score, which is how nbgrader reads partial credit from a
test cell (``nbgrader.utils.determine_grade``: the ``text/plain`` of the cell's
``execute_result``, cast to float). Nothing reaches stderr while checks run: nbgrader gives 0 to
a test cell that writes to stderr. Results are built by :mod:`autograder.results`, as in the
batch grader.

Hints go from concept to recipe. The first time a task fails in this kernel, ``check()`` shows
each failing case with its *concept* hint (what idea the case tests) and keeps the *recipe* (the
steps, in words) back; from the second failure of the same task on it shows both, and
``check(..., hint="recipe")`` shows both at once. A pass starts the count again.
:func:`run_checks` (``kit grade``, the batch grader, tests) always returns both.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from autograder import gates
from autograder.registry import Case, Task, fresh_runs, get_task
from autograder.results import (
    ERROR,
    FAILED,
    MISSING,
    NOT_IMPLEMENTED,
    PASSED,
    CaseResult,
    TaskReport,
    judge,
    raised,
    settle,
)

__all__ = ["ERROR", "FAILED", "HINT_LEVELS", "NOT_IMPLEMENTED", "PASSED", "CaseResult",
           "TaskReport",
           "check", "hint_level", "run_case", "run_checks", "stderr_to_stdout"]

HINT_LEVELS = ("concept", "recipe")
# Failed check() calls per task id in this kernel since its last pass: picks the hint level.
_failed_checks: dict[str, int] = {}
_RECIPE_NOTE = ("Hints first name the idea. Still stuck after another try? Run this check again "
                "for a step-by-step recipe, or ask for it now: check({task_id!r}, {name}, "
                "hint=\"recipe\").")


def run_case(task: Task, case: Case, impl: Any, seed: int = 0) -> CaseResult:
    """Run one case on ``impl`` in this process and judge it against the trusted expectation."""
    start = time.perf_counter()
    try:
        with gates.guard(task, impl):  # what the task re-implements scores it 0
            got = case.run(impl, seed)
    except Exception as e:
        return raised(task, case, e, time.perf_counter() - start)
    return judge(task, case, got, task.expected(case, seed), time.perf_counter() - start)


def run_checks(task_id: str, impl: Any, *, seed: int = 0,
               stop_at_failure: bool = False) -> TaskReport:
    """Run every case of ``task_id`` on ``impl``; no output beyond what ``impl`` prints.

    Once a case finds the task not implemented, the remaining cases are marked the same
    without running them (a stub would only raise again). ``stop_at_failure=True`` ends the
    report at the first case that does not pass, for a caller that needs only whether the task
    passes (the seeded-bug tests): the cases after it, and the shared runs only they read, are
    never run, so its score is not the task's score.

    Raises:
        KeyError: ``task_id`` is not a registered task.
    """
    task = get_task(task_id)
    fresh_runs()  # a helper the implementation calls may have changed since the last check
    report = TaskReport(task.id, task.name)
    if impl is None or not callable(impl):
        message = (f"check({task_id!r}, ...) needs your {task.name} itself, got "
                   f"{type(impl).__name__}; run the cell that defines {task.name} first.")
        status = MISSING if impl is None else ERROR
        report.cases = [CaseResult(c.name, status, 0.0, task.case_points(c), message)
                        for c in task.cases]
        return report
    todo = False
    with gates.watching():  # the task's trampolines are swapped in once, not once per case
        for case in task.cases:
            if todo:
                report.cases.append(CaseResult(case.name, NOT_IMPLEMENTED, 0.0,
                                               task.case_points(case)))
                continue
            result = run_case(task, case, impl, seed)
            todo = result.status == NOT_IMPLEMENTED
            report.cases.append(result)
            if stop_at_failure and result.status != PASSED:
                break
    return settle(report)


@contextmanager
def stderr_to_stdout() -> Iterator[None]:
    """Send everything written to stderr (Python and file descriptor 2) to stdout meanwhile."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fd = None
    try:
        saved_fd = os.dup(2)
        os.dup2(1, 2)
    except (OSError, ValueError, AttributeError):
        saved_fd = None
    old = sys.stderr
    sys.stderr = sys.stdout
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr = old
        if saved_fd is not None:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)


def hint_level(task_id: str) -> str:
    """The hint level the next failing ``check(task_id, ...)`` shows: ``"concept"`` on a first
    failure, ``"recipe"`` once the task has failed before in this kernel."""
    return "recipe" if _failed_checks.get(task_id, 0) >= 1 else "concept"


def _counts_as_a_try(report: TaskReport) -> bool:
    # A stub, a missing definition or a pass is not a failed attempt at the task.
    return not report.passed and report.status not in (NOT_IMPLEMENTED, MISSING)


def _at_level(report: TaskReport, level: str) -> TaskReport:
    """Keep back the recipes at the ``"concept"`` level, with a note saying how to see them."""
    if level == "recipe":
        return report
    withheld = False
    for c in report.cases:
        if c.recipe and not c.passed:
            c.recipe, withheld = "", True
    if withheld:
        report.note = _RECIPE_NOTE.format(task_id=report.task_id, name=report.name)
    return report


def check(task_id: str, impl: Any, *, seed: int = 0, hint: str | None = None) -> TaskReport:
    """Check your implementation of task ``task_id`` and show what passed and what did not.

    Use it as the last line of a cell: ``check("0.2", global_mean)``. In Jupyter the result
    shows as a table; elsewhere it is printed as text. The returned report's ``score`` is the
    points earned (nbgrader reads it as the cell's partial credit).

    A failing case shows a hint naming the idea it tests; from the task's second failure on
    (or with ``hint="recipe"``) it also shows a recipe: the steps, in words.
    """
    from kit.output import in_jupyter_kernel

    if hint is not None and hint not in HINT_LEVELS:
        raise ValueError(f"hint must be one of {', '.join(map(repr, HINT_LEVELS))} (or left out), "
                         f"got {hint!r}")
    with stderr_to_stdout():
        report = run_checks(task_id, impl, seed=seed)
    level = hint or hint_level(report.task_id)
    if _counts_as_a_try(report):
        _failed_checks[report.task_id] = _failed_checks.get(report.task_id, 0) + 1
    elif report.passed:
        _failed_checks.pop(report.task_id, None)
    report = _at_level(report, level)
    if not in_jupyter_kernel():
        print(report.to_text())
    return report
