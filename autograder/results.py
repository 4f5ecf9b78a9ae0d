"""The one result model of grading: a case's outcome, a task's report, and how both are shown.

Every route that grades a task — ``check()`` in a notebook, ``kit grade NOTEBOOK``, the batch
grader (``kit grade --out``) and nbgrader's test cells — builds the same :class:`CaseResult` and
:class:`TaskReport` through the same two functions: :func:`judge` compares what a case returned
with the trusted expectation, and :func:`raised` turns what a case raised into a result. So one
notebook gets one status and one score per task whichever route grades it.

Statuses, each with one meaning:

=================  ==========================================================================
``passed``         the case's data equals the trusted expectation
``failed``         the data is wrong (the comparison says what and gives a hint)
``not implemented``the task is still the stub: it raised ``NotImplementedError``
``error``          the code raised, crashed a rank or the worker, or broke a resource limit
``timeout``        a case ran out of time, or its ranks hung
``missing``        the notebook holds no definition of the task (deleted, renamed)
``forbidden``      the task's code used what it re-implements, or the grader's own references
``blocked``        a case needs hardware (CUDA) this machine lacks: not the student's fault
=================  ==========================================================================
"""

from __future__ import annotations

import html
import re
import traceback
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from autograder.registry import Case, CheckFailed, Task

__all__ = [
    "BLOCKED", "ERROR", "FAILED", "FOLLOWS", "FORBIDDEN", "MISSING", "NOT_IMPLEMENTED", "PASSED",
    "STATUSES",
    "TIMEOUT", "CaseResult", "TaskReport", "Totals", "judge", "not_implemented_message", "raised",
    "settle", "task_status", "unloaded", "unloaded_status",
]

PASSED, FAILED, NOT_IMPLEMENTED = "passed", "failed", "not implemented"
ERROR, TIMEOUT, MISSING, FORBIDDEN, BLOCKED = "error", "timeout", "missing", "forbidden", "blocked"
STATUSES = (PASSED, FAILED, NOT_IMPLEMENTED, ERROR, TIMEOUT, MISSING, FORBIDDEN, BLOCKED)
FOLLOWS = "follows from the failure above: fix that first"
# A task's status is its worst case's; a task that is not there outranks one that misbehaves.
_TASK_PRIORITY = (MISSING, NOT_IMPLEMENTED, FORBIDDEN, BLOCKED, TIMEOUT, ERROR, FAILED)
# Frames of these folders are the grader's, not the student's: hidden from tracebacks.
_INTERNAL = (str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "kit"))


class Totals:
    """``score`` and ``max_score`` as the sums of the parts' own (a report of tasks sums its
    tasks, a lesson's progress its tasks, a folder's progress its lessons). ``_parts`` names the
    list attribute that holds them."""

    _parts = "tasks"

    @property
    def score(self) -> float:
        return sum(part.score for part in getattr(self, self._parts))

    @property
    def max_score(self) -> float:
        return sum(part.max_score for part in getattr(self, self._parts))


@dataclass
class CaseResult:
    """The outcome of one case: status, points and what to tell the student."""

    name: str
    status: str
    points: float
    max_points: float
    message: str = ""
    expected: str | None = None
    got: str | None = None
    hint: str = ""  # the concept the failure breaks
    details: str = ""  # traceback or rank report, shown folded
    seconds: float = 0.0
    recipe: str = ""  # the steps, in words; check() withholds it on a task's first failure
    cause: str = ""  # the mistake a failure shows, as a key (CheckFailed.cause)
    follows: str = ""  # the earlier case whose failure this one only repeats (see settle)

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CaseResult:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def task_status(statuses: list[str]) -> str:
    """The status of a task whose cases have ``statuses``."""
    if all(s == PASSED for s in statuses):
        return PASSED
    return next(s for s in _TASK_PRIORITY if s in statuses) if set(statuses) & set(_TASK_PRIORITY) \
        else FAILED


@dataclass
class TaskReport:
    """Every case of one task. ``repr()`` is the score, for nbgrader's partial credit."""

    task_id: str
    name: str
    cases: list[CaseResult] = field(default_factory=list)
    output: str = ""  # what the task's checks printed (batch and `kit grade` keep it)
    note: str = ""  # a line for the student under the headline (check(): how to see the recipe)

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
        return task_status([c.status for c in self.cases])

    def __float__(self) -> float:
        return self.score

    def __repr__(self) -> str:
        # nbgrader: float(text/plain) of the test cell's result is the cell's score.
        return repr(round(self.score, 6))

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task_id, "name": self.name, "status": self.status,
                "score": round(self.score, 6), "max_score": round(self.max_score, 6),
                "cases": [asdict(c) for c in self.cases], "output": self.output}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TaskReport:
        return cls(data["task"], data["name"], [CaseResult.from_dict(c) for c in data["cases"]],
                   data.get("output", ""))

    def headline(self) -> str:
        points = f"{_num(self.score)}/{_num(self.max_score)} points"
        status = self.status
        if status == PASSED:
            return f"all {len(self.cases)} checks passed, {points}"
        if status == NOT_IMPLEMENTED:
            return (f"not implemented yet ({points}). Replace the `raise NotImplementedError(...)` "
                    f"line in {self.name} with your code, run that cell, then this one.")
        if status == MISSING:
            return f"missing: no {self.name} was found in the notebook ({points})"
        if status == FORBIDDEN:
            return f"scored 0: it uses what this task asks you to build ({points})"
        failed = sum(not c.passed for c in self.cases)
        why = "" if status == FAILED else f"{status}: "  # error, timeout, blocked
        return f"{why}{failed} of {len(self.cases)} checks failed, {points}"

    def to_text(self, *, details: bool = True) -> str:
        """The report as plain text: the notebook outside Jupyter, feedback files, terminals."""
        lines = [f"Task {self.task_id} {self.name}: {self.headline()}"]
        if self.note:
            lines.append(f"  {self.note}")
        for c in self.cases:
            mark = {PASSED: "PASS", NOT_IMPLEMENTED: "TODO"}.get(c.status, "FAIL")
            lines.append(f"  [{mark}] {c.name}  ({_num(c.points)}/{_num(c.max_points)})"
                         + ("" if c.status in (PASSED, FAILED, NOT_IMPLEMENTED)
                            else f"  {c.status}"))
            if c.follows:
                lines.append(f"         {FOLLOWS}")
            if c.message and not c.passed and not _repeats(c):
                lines += [f"         {line}" for line in c.message.splitlines()]
            if (c.expected is not None or c.got is not None) and not c.follows:
                lines += [f"         expected: {c.expected}", f"         got:      {c.got}"]
            if c.hint and c.status in (FAILED, ERROR, TIMEOUT) and not c.follows:
                lines.append(f"         hint: {c.hint}")
            if c.recipe and c.status in (FAILED, ERROR, TIMEOUT) and not c.follows:
                lines.append(f"         recipe: {c.recipe}")
            if c.details and details and not c.follows:
                lines += [f"           {line}" for line in c.details.rstrip().splitlines()[-12:]]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        grey = self.status in (NOT_IMPLEMENTED, MISSING)
        colour = "#2e7d32" if self.passed else ("#757575" if grey else "#c62828")
        rows = []
        for c in self.cases:
            mark, tint = {PASSED: ("&#10004;", "#2e7d32"),
                          NOT_IMPLEMENTED: ("&#9675;", "#757575")}.get(c.status,
                                                                       ("&#10008;", "#c62828"))
            body = []
            if c.follows:
                body.append(f"<div style='color:#757575'><i>{_esc(FOLLOWS)}</i></div>")
            if c.message and not c.passed and not _repeats(c):
                body.append(f"<div>{_rich(c.message)}</div>")
            if (c.expected is not None or c.got is not None) and not c.follows:
                body.append(_expected_got(c.expected, c.got))
            if c.hint and c.status in (FAILED, ERROR, TIMEOUT) and not c.follows:
                body.append(f"<div><i>Hint:</i> {_rich(c.hint)}</div>")
            if c.recipe and c.status in (FAILED, ERROR, TIMEOUT) and not c.follows:
                body.append(f"<div><i>Recipe:</i> {_rich(c.recipe)}</div>")
            if c.details and not c.follows:
                body.append(f"<details><summary>details</summary><pre>{_esc(c.details)}</pre></details>")
            rows.append(f"<tr><td style='color:{tint};font-size:1.2em;vertical-align:top'>"
                        f"{mark}</td>"
                        f"<td style='text-align:left;vertical-align:top'><b>{_esc(c.name)}</b>"
                        f"{''.join(body)}</td><td style='vertical-align:top'>"
                        f"{_num(c.points)}/{_num(c.max_points)}</td></tr>")
        return (f"<div class='kit-check'><div style='font-weight:bold;color:{colour}'>"
                f"Task {_esc(self.task_id)} <code>{_esc(self.name)}</code>: "
                f"{_rich(self.headline())}</div>"
                + (f"<div style='font-size:0.9em'>{_rich(self.note)}</div>" if self.note else "")
                + f"<table>{''.join(rows)}</table></div>")


def _repeats(c: CaseResult) -> bool:
    """A case that follows an earlier one word for word (the same error of a shared run, the same
    use of what the task re-implements): its message is the one already shown above."""
    return bool(c.follows) and c.status in (ERROR, FORBIDDEN)


def _num(x: float) -> str:
    return f"{x:.4g}"


def _esc(x: Any) -> str:
    return html.escape("" if x is None else str(x))


_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_CODE_STYLE = "font-family:monospace;background:rgba(127,127,127,0.12);padding:0 2px"


def _rich(x: Any) -> str:
    """Escaped text whose `code spans` show as code, as they would in Markdown."""
    return _CODE_SPAN.sub(lambda m: f"<code style='{_CODE_STYLE}'>{m.group(1)}</code>", _esc(x))


def _expected_got(expected: Any, got: Any) -> str:
    """Expected and got as two rows of one table: labels in one column, the values in boxes of
    one width below each other, so a difference shows by eye."""
    box = ("display:block;box-sizing:border-box;width:100%;white-space:pre-wrap;word-break:"
           f"break-all;text-align:left;{_CODE_STYLE};padding:1px 4px")
    rows = "".join(f"<tr><td style='text-align:right;vertical-align:top;padding:1px 6px 1px 0'>"
                   f"<b>{label}</b></td><td style='width:100%;padding:1px 0'><code style='{box}'>"
                   f"{_esc(value)}</code></td></tr>"
                   for label, value in (("expected", expected), ("got", got)))
    return ("<table class='kit-expected-got' style='margin:2px 0;border-collapse:collapse;"
            f"width:100%;table-layout:auto'>{rows}</table>")


# --------------------------------------------------------------------------- building results


def judge(task: Task, case: Case, got: Any, expected: Any, seconds: float = 0.0) -> CaseResult:
    """Compare what ``case`` returned with the trusted ``expected`` data: the one comparison
    path."""
    max_points = task.case_points(case)
    try:
        case.compare(got, expected)
    except CheckFailed as e:
        return CaseResult(case.name, FAILED, 0.0, max_points, e.message,
                          None if e.expected is None else str(e.expected)[:500],
                          None if e.got is None else str(e.got)[:500], e.hint or case.hint,
                          seconds=seconds, recipe=getattr(e, "recipe", "") or case.recipe,
                          cause=getattr(e, "cause", "") or "")
    except Exception as e:  # compare met data of a form it did not expect (batch: untrusted data)
        return CaseResult(case.name, FAILED, 0.0, max_points, "the result has the wrong form "
                          f"({type(e).__name__}: {str(e)[:200]})", hint=case.hint, seconds=seconds,
                          recipe=case.recipe)
    return CaseResult(case.name, PASSED, max_points, max_points, seconds=seconds)


def not_implemented_message(e: BaseException) -> str | None:
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
    return "".join(traceback.format_list(frames) + traceback.format_exception_only(type(e), e))


def hang_finding(case: Case, e: BaseException) -> str:
    """A hang as a finding: what the case's hang means (``Case.hang``), then the launcher's own
    reading of the stacks, which ranks wait in which collective and which had returned."""
    lines = [line.strip() for line in str(e).splitlines()]
    first = lines[0] if lines else "The ranks hung."
    when = first.split(":", 1)[0]  # "Deadlock after 0.9 s" or "Timed out after 30 s"
    diagnosis = lines[1] if len(lines) > 1 and lines[1] else first
    found = f"{when}: {diagnosis}" if when != first else diagnosis
    return f"{case.hang} {found}" if case.hang else found


def raised(task: Task, case: Case, e: BaseException, seconds: float = 0.0) -> CaseResult:
    """What a case that raised ``e`` (here, or on one of its ranks) scores, and why."""
    from kit.launcher import LaunchError, LaunchTimeout

    max_points = task.case_points(case)
    if (message := not_implemented_message(e)) is not None:
        return CaseResult(case.name, NOT_IMPLEMENTED, 0.0, max_points, message, seconds=seconds)
    forbidden = getattr(e, "forbidden_use", None)  # autograder.gates: the task is scored 0
    if forbidden:
        return CaseResult(case.name, FORBIDDEN, 0.0, max_points, str(e), hint=case.hint,
                          seconds=seconds)
    if isinstance(e, LaunchTimeout):
        return CaseResult(case.name, TIMEOUT, 0.0, max_points, hang_finding(case, e),
                          hint=case.hint, details=str(e), seconds=seconds, recipe=case.recipe)
    if isinstance(e, LaunchError):
        first = e.failures[0].summary if e.failures else str(e).splitlines()[0]
        return CaseResult(case.name, ERROR, 0.0, max_points, f"a rank failed: {first}",
                          hint=case.hint, details=str(e), seconds=seconds, recipe=case.recipe)
    if not isinstance(e, Exception):  # SystemExit, KeyboardInterrupt raised by graded code
        return CaseResult(case.name, ERROR, 0.0, max_points, f"raised {type(e).__name__}: {e} "
                          "(do not call sys.exit() or os._exit() in graded code)", hint=case.hint,
                          seconds=seconds)
    return CaseResult(case.name, ERROR, 0.0, max_points, f"raised {type(e).__name__}: {e}",
                      hint=case.hint, details=_student_traceback(e), seconds=seconds,
                      recipe=case.recipe)


def settle(report: TaskReport) -> TaskReport:
    """Apply the task-level rules to a report whose cases are all in: a task that used what it
    re-implements (any case ``forbidden``) scores 0 on every case, whatever the others found;
    a case that fails only because of an earlier one (the same cause, or the same error from a
    shared run) says so and gives no hint of its own: one mistake, one diagnosis."""
    seen: dict[tuple[str, ...], str] = {}
    for c in report.cases:
        key = (("cause", c.cause) if c.status == FAILED and c.cause else
               (c.status, c.message) if c.status in (ERROR, FORBIDDEN) else None)
        if key is None:
            continue
        if key in seen:
            c.follows = seen[key]
        else:
            seen[key] = c.name
    if any(c.status == FORBIDDEN for c in report.cases):
        why = next(c.message for c in report.cases if c.status == FORBIDDEN)
        for c in report.cases:
            if c.status != FORBIDDEN:
                c.points = 0.0
                c.message = c.message or f"scored 0 with the whole task: {why}"
        return report
    _cap_without_the_saving(report)
    return report


SAVING_CAP = 0.5  # the share of a saving task's points kept while a saving case does not pass
CAPPED = ("capped at half the task's points: this case measures the saving the technique exists "
          "for, and right values without it keep at most half")


def _cap_without_the_saving(report: TaskReport) -> None:
    """A saving task (one with ``saving=True`` cases) whose saving case does not pass keeps at most
    half its points, however many other cases pass: right values with one saving thrown away (of
    several a task may measure) are not most of the task. Every case's points shrink by the same
    factor; the first lost saving case says why."""
    from autograder.registry import get_task

    try:
        saving = {c.name for c in get_task(report.task_id).saving_cases}
    except KeyError:  # a report of a task this process does not know: nothing to apply
        return
    lost = [c for c in report.cases if c.name in saving and not c.passed]
    cap = SAVING_CAP * report.max_score
    if not lost or report.score <= cap + 1e-9:
        return
    factor = cap / report.score
    for c in report.cases:
        c.points *= factor
    first = lost[0]
    if CAPPED not in first.message:
        first.message = f"{first.message}\n({CAPPED})" if first.message else f"({CAPPED})"


def unloaded_status(why: str) -> str:
    """A task the loader could not give: ``error`` when its code is there but cannot run (a syntax
    error, an exception at import), ``missing`` when there is no definition of it at all."""
    return ERROR if "SyntaxError" in why or " raised " in why else MISSING


def unloaded(task: Task, why: str) -> TaskReport:
    """The report of a task the notebook does not give us (see :func:`unloaded_status`)."""
    status = unloaded_status(why)
    return TaskReport(task.id, task.name, [
        CaseResult(c.name, status, 0.0, task.case_points(c),
                   f"could not load it from the notebook: {why}")
        for c in task.cases])
