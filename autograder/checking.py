"""Run a task's checks on an implementation and report them to a student, pytest or a grader.

``check("0.2", global_mean)`` in a notebook runs every case of task 0.2 (fixed seed, in this
process; cases that need ranks launch them) and returns a :class:`TaskReport`: Jupyter shows
it as a table (each case passed or failed, expected vs got, a hint), a terminal as text. Its
plain-text form is just the score, which is how nbgrader reads partial credit from a test
cell (``nbgrader.utils.determine_grade``: the ``text/plain`` of the cell's ``execute_result``,
cast to float). Nothing reaches stderr while checks run: nbgrader gives 0 to a test cell that
writes to stderr.
"""

from __future__ import annotations

import html
import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autograder.registry import Case, CheckFailed, Task, get_task

__all__ = ["CaseResult", "TaskReport", "check", "run_checks"]

PASSED, FAILED, ERROR, NOT_IMPLEMENTED = "passed", "failed", "error", "not implemented"
_INTERNAL = (str(Path(__file__).resolve().parent), str(Path(get_task.__code__.co_filename).resolve().parent))


@dataclass
class CaseResult:
    """The outcome of one case: status, points and what to tell the student."""

    name: str
    status: str  # passed | failed | error | not implemented
    points: float
    max_points: float
    message: str = ""
    expected: str | None = None
    got: str | None = None
    hint: str = ""
    details: str = ""  # traceback or rank report, shown folded
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == PASSED


@dataclass
class TaskReport:
    """Every case of one task. ``repr()`` is the score, for nbgrader's partial credit."""

    task_id: str
    name: str
    cases: list[CaseResult] = field(default_factory=list)

    @property
    def score(self) -> float:
        return sum(c.points for c in self.cases)

    @property
    def max_score(self) -> float:
        return sum(c.max_points for c in self.cases)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.cases)

    @property
    def status(self) -> str:
        if self.passed:
            return PASSED
        if any(c.status == NOT_IMPLEMENTED for c in self.cases):
            return NOT_IMPLEMENTED
        return FAILED

    def __float__(self) -> float:
        return self.score

    def __repr__(self) -> str:
        # nbgrader: float(text/plain) of the test cell's result is the cell's score.
        return repr(round(self.score, 6))

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task_id, "name": self.name, "status": self.status,
                "score": round(self.score, 6), "max_score": self.max_score,
                "cases": [asdict(c) for c in self.cases]}

    def to_text(self) -> str:
        lines = [f"Task {self.task_id} {self.name}: {_headline(self)}"]
        for c in self.cases:
            mark = {PASSED: "PASS", NOT_IMPLEMENTED: "TODO"}.get(c.status, "FAIL")
            lines.append(f"  [{mark}] {c.name}  ({_num(c.points)}/{_num(c.max_points)})")
            if c.message and not c.passed:
                lines += [f"         {line}" for line in c.message.splitlines()]
            if c.expected is not None or c.got is not None:
                lines += [f"         expected: {c.expected}", f"         got:      {c.got}"]
            if c.hint and c.status in (FAILED, ERROR):
                lines.append(f"         hint: {c.hint}")
            if c.details:
                lines += [f"           {line}" for line in c.details.rstrip().splitlines()[-12:]]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        colour = "#2e7d32" if self.passed else ("#757575" if self.status == NOT_IMPLEMENTED else "#c62828")
        rows = []
        for c in self.cases:
            mark, tint = {PASSED: ("&#10004;", "#2e7d32"),
                          NOT_IMPLEMENTED: ("&#9675;", "#757575")}.get(c.status, ("&#10008;", "#c62828"))
            body = []
            if c.message and not c.passed:
                body.append(f"<div>{_esc(c.message)}</div>")
            if c.expected is not None or c.got is not None:
                body.append("<table style='margin:2px 0'><tr><td><b>expected</b></td>"
                            f"<td><code>{_esc(c.expected)}</code></td></tr><tr><td><b>got</b></td>"
                            f"<td><code>{_esc(c.got)}</code></td></tr></table>")
            if c.hint and c.status in (FAILED, ERROR):
                body.append(f"<div><i>Hint:</i> {_esc(c.hint)}</div>")
            if c.details:
                body.append(f"<details><summary>details</summary><pre>{_esc(c.details)}</pre></details>")
            rows.append(f"<tr><td style='color:{tint};font-size:1.2em;vertical-align:top'>{mark}</td>"
                        f"<td style='text-align:left;vertical-align:top'><b>{_esc(c.name)}</b>"
                        f"{''.join(body)}</td><td style='vertical-align:top'>"
                        f"{_num(c.points)}/{_num(c.max_points)}</td></tr>")
        return (f"<div class='kit-check'><div style='font-weight:bold;color:{colour}'>"
                f"Task {_esc(self.task_id)} <code>{_esc(self.name)}</code>: {_esc(_headline(self))}</div>"
                f"<table>{''.join(rows)}</table></div>")


def _num(x: float) -> str:
    return f"{x:.4g}"


def _esc(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def _headline(report: TaskReport) -> str:
    points = f"{_num(report.score)}/{_num(report.max_score)} points"
    if report.passed:
        return f"all {len(report.cases)} checks passed, {points}"
    if report.status == NOT_IMPLEMENTED:
        return (f"not implemented yet ({points}). Replace the `raise NotImplementedError(...)` line "
                f"in {report.name} with your code, run that cell, then this one.")
    failed = sum(not c.passed for c in report.cases)
    return f"{failed} of {len(report.cases)} checks failed, {points}"


# --------------------------------------------------------------------------- running cases


def _not_implemented(e: BaseException) -> str | None:
    """The NotImplementedError message if ``e`` is one, here or on a launched rank."""
    if isinstance(e, NotImplementedError):
        return str(e) or "NotImplementedError"
    for failure in getattr(e, "failures", None) or []:
        if getattr(failure, "exception_type", None) == "NotImplementedError":
            return f"rank {failure.rank}: {failure.summary}"
    return None


def _student_traceback(e: BaseException) -> str:
    """The traceback without the frames of kit and autograder: what the student wrote."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not str(Path(f.filename).resolve()).startswith(_INTERNAL)]
    lines = traceback.format_list(frames) + traceback.format_exception_only(type(e), e)
    return "".join(lines)


def _error_result(case: Case, max_points: float, e: BaseException, seconds: float) -> CaseResult:
    from kit.launcher import LaunchError, LaunchTimeout

    if isinstance(e, LaunchTimeout):
        return CaseResult(case.name, ERROR, 0.0, max_points, "the ranks hung: they did not finish "
                          "in time. Does every rank call every collective, in the same order?",
                          hint=case.hint, details=str(e), seconds=seconds)
    if isinstance(e, LaunchError):
        first = e.failures[0].summary if e.failures else str(e).splitlines()[0]
        return CaseResult(case.name, ERROR, 0.0, max_points, f"a rank failed: {first}",
                          hint=case.hint, details=str(e), seconds=seconds)
    return CaseResult(case.name, ERROR, 0.0, max_points, f"raised {type(e).__name__}: {e}",
                      hint=case.hint, details=_student_traceback(e), seconds=seconds)


def run_case(task: Task, case: Case, impl: Any, seed: int = 0) -> CaseResult:
    """Run one case on ``impl`` and compare with the trusted expectation."""
    max_points = task.case_points(case)
    start = time.perf_counter()
    try:
        got = case.run(impl, seed)
    except Exception as e:
        seconds = time.perf_counter() - start
        if (message := _not_implemented(e)) is not None:
            return CaseResult(case.name, NOT_IMPLEMENTED, 0.0, max_points, message, seconds=seconds)
        return _error_result(case, max_points, e, seconds)
    try:
        case.compare(got, task.expected(case, seed))
    except CheckFailed as e:
        return CaseResult(case.name, FAILED, 0.0, max_points, e.message,
                          None if e.expected is None else str(e.expected),
                          None if e.got is None else str(e.got), e.hint or case.hint,
                          seconds=time.perf_counter() - start)
    return CaseResult(case.name, PASSED, max_points, max_points, seconds=time.perf_counter() - start)


def run_checks(task_id: str, impl: Any, *, seed: int = 0) -> TaskReport:
    """Run every case of ``task_id`` on ``impl``; no output beyond what ``impl`` prints.

    Once a case finds the task not implemented, the remaining cases are marked the same
    without running them (a stub would only raise again).

    Raises:
        KeyError: ``task_id`` is not a registered task.
    """
    task = get_task(task_id)
    report = TaskReport(task.id, task.name)
    if impl is None or not callable(impl):
        message = (f"check({task_id!r}, ...) needs your {task.name} itself, got "
                   f"{type(impl).__name__}; run the cell that defines {task.name} first.")
        report.cases = [CaseResult(c.name, ERROR, 0.0, task.case_points(c), message) for c in task.cases]
        return report
    todo: str | None = None
    for case in task.cases:
        if todo is not None:
            report.cases.append(CaseResult(case.name, NOT_IMPLEMENTED, 0.0, task.case_points(case)))
            continue
        result = run_case(task, case, impl, seed)
        if result.status == NOT_IMPLEMENTED:
            todo = result.message
        report.cases.append(result)
    return report


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


def _in_jupyter() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def check(task_id: str, impl: Any, *, seed: int = 0) -> TaskReport:
    """Check your implementation of task ``task_id`` and show what passed and what did not.

    Use it as the last line of a cell: ``check("0.2", global_mean)``. In Jupyter the result
    shows as a table; elsewhere it is printed as text. The returned report's ``score`` is the
    points earned (nbgrader reads it as the cell's partial credit).
    """
    with stderr_to_stdout():
        report = run_checks(task_id, impl, seed=seed)
    if not _in_jupyter():
        print(report.to_text())
    return report
