"""``kit progress`` and ``kit.progress()``: where a learner stands in every lesson.

    kit progress                 the course folder (the one ``kit lab`` opens)
    kit progress ~/my-course     any folder holding the learner's NN_slug.ipynb notebooks
    kit progress --cached        only what is remembered: nothing is run

For every lesson with checks it finds the learner's notebook (``lessons/NN_*.ipynb``, else
``NN_*.ipynb`` in the folder, else one level of sub-folders, as nbgrader releases them), loads
its graded code as ``check()`` and ``kit grade`` do, and shows each task as ``passed``,
``failed``, ``not implemented`` or ``not started`` with its points, the total, and what to do
next. Checks run in this process, as ``check()`` does in a notebook: it is the learner's own code.

Results are remembered by the source each task was loaded from (its cell, plus the setup cells
and helpers it shares) and by the checks' own source, so only tasks whose cells changed run
again. The memory is one JSON file outside the learner's folder (``$KIT_PROGRESS_CACHE``, else
``$XDG_CACHE_HOME/kit/progress.json``, else ``~/.cache/kit/progress.json``); notebooks are only
read, never written.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import html
import io
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autograder.loading import SETUP, NotebookError, lessons_arg, load_tasks
from autograder.registry import Task, checked_lessons, lesson_tasks
from autograder.results import MISSING, NOT_IMPLEMENTED, PASSED, TaskReport, Totals, unloaded

__all__ = ["LessonProgress", "Progress", "TaskProgress", "course_progress", "find_notebooks",
           "main"]

PASSED_, FAILED_, TODO_, NOT_STARTED_ = "passed", "failed", "not implemented", "not started"
_AUTOGRADER = Path(__file__).resolve().parent
CACHE_VERSION = 1


def _is_checkpoint(path: Path) -> bool:
    return ".ipynb_checkpoints" in path.parts


def find_notebooks(folder: str | os.PathLike[str],
                   lessons: list[int] | None = None) -> dict[int, Path]:
    """The learner's notebook of each lesson in ``folder``: ``lessons/NN_*.ipynb`` first, then
    ``NN_*.ipynb`` in the folder itself, then in its sub-folders (``NN_slug/NN_slug.ipynb``).
    A lesson with no notebook is left out."""
    folder = Path(folder)
    found: dict[int, Path] = {}
    for pattern in ("lessons/[0-9][0-9]_*.ipynb", "[0-9][0-9]_*.ipynb", "*/[0-9][0-9]_*.ipynb"):
        for path in sorted(folder.glob(pattern)):
            if _is_checkpoint(path):
                continue
            lesson = int(path.name[:2])
            if (lessons is None or lesson in lessons) and lesson not in found:
                found[lesson] = path
    return dict(sorted(found.items()))


@dataclass
class TaskProgress:
    """One task: its state, points, and the line to show beside it."""

    task_id: str
    name: str
    state: str  # passed, failed, not implemented, not started
    score: float
    max_score: float
    detail: str = ""  # the first failing check, or why it is not started
    remembered: bool = False  # taken from the memory, not run now

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task_id, "name": self.name, "state": self.state,
                "score": round(self.score, 6), "max_score": round(self.max_score, 6),
                "detail": self.detail, "remembered": self.remembered}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TaskProgress:
        return cls(data["task"], data["name"], data["state"], float(data["score"]),
                   float(data["max_score"]), data.get("detail", ""), bool(data.get("remembered")))


@dataclass
class LessonProgress(Totals):
    lesson: int
    notebook: Path | None
    tasks: list[TaskProgress] = field(default_factory=list)
    problem: str = ""  # why the notebook could not be read


@dataclass
class Progress(Totals):
    """Every lesson of a folder. ``str()`` is the plain table; in Jupyter it shows as HTML."""

    folder: Path
    lessons: list[LessonProgress] = field(default_factory=list)
    ran: int = 0  # tasks whose checks ran now
    remembered: int = 0  # tasks taken from the memory

    _parts = "lessons"

    def next_step(self) -> str:
        """What to do next: the first task, in lesson order, that does not pass yet."""
        for lp in self.lessons:
            for t in lp.tasks:
                if t.state == PASSED_:
                    continue
                where = _shown(lp.notebook, self.folder)
                if lp.problem:
                    return f"Lesson {lp.lesson:02d}: {lp.problem}"
                if t.state == NOT_STARTED_ and lp.notebook is None:
                    return (f"Start Lesson {lp.lesson:02d}: no NN_slug.ipynb notebook of it is in "
                            f"{self.folder} yet (`kit lab` opens the course's copy).")
                if t.state == NOT_STARTED_:
                    return f"Task {t.task_id} `{t.name}` in {where}: {t.detail}"
                if t.state == NOT_IMPLEMENTED:
                    return (f"Task {t.task_id} `{t.name}` in {where}: write it (replace its "
                            "`raise NotImplementedError(...)` line), then run its check cell.")
                return (f"Task {t.task_id} `{t.name}` in {where}: {t.detail} Run its check cell "
                        "for the hint.")
        return f"Every task passes: {_num(self.score)}/{_num(self.max_score)} points."

    def to_dict(self) -> dict[str, Any]:
        return {"folder": str(self.folder), "score": round(self.score, 6),
                "max_score": round(self.max_score, 6), "next": self.next_step(),
                "lessons": [{"lesson": f"{lp.lesson:02d}",
                             "notebook": None if lp.notebook is None else str(lp.notebook),
                             "score": round(lp.score, 6), "max_score": round(lp.max_score, 6),
                             "problem": lp.problem, "tasks": [t.to_dict() for t in lp.tasks]}
                            for lp in self.lessons]}

    def table(self) -> str:
        """The plain-text form (a terminal, ``kit progress``)."""
        rows = [("task", "name", "state", "points", "")]
        for lp in self.lessons:
            where = _shown(lp.notebook, self.folder) if lp.notebook else "no notebook"
            rows.append((f"{lp.lesson:02d}", where, "", f"{_num(lp.score)}/{_num(lp.max_score)}",
                         lp.problem))
            for t in lp.tasks:
                rows.append((f"  {t.task_id}", t.name, t.state,
                             f"{_num(t.score)}/{_num(t.max_score)}", t.detail))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths))
                 + ("  " + r[4] if r[4] else "")
                 for r in rows]
        lines = [line.rstrip() for line in lines]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines += ["", f"total: {_num(self.score)}/{_num(self.max_score)} points "
                      f"({self.ran} task(s) checked now, {self.remembered} remembered)",
                  f"next: {self.next_step()}"]
        return "\n".join(lines)

    __str__ = table

    def _repr_html_(self) -> str:
        colours = {PASSED_: "#2e7d32", FAILED_: "#c62828", TODO_: "#757575",
                   NOT_STARTED_: "#9e9e9e"}
        body = []
        for lp in self.lessons:
            share = lp.score / lp.max_score if lp.max_score else 0.0
            bar = (f"<div style='background:#e0e0e0;width:160px;height:10px;display:inline-block'>"
                   f"<div style='background:#2e7d32;width:{160 * share:.0f}px;height:10px'>"
                   "</div></div>")
            where = html.escape(_shown(lp.notebook, self.folder)) if lp.notebook else "no notebook"
            body.append("<tr style='border-top:1px solid #bdbdbd'><td><b>Lesson "
                        f"{lp.lesson:02d}</b></td><td "
                        f"style='text-align:left'>{where}</td><td>{bar}</td><td>{_num(lp.score)}/{_num(lp.max_score)}</td>"
                        f"<td style='text-align:left'>{html.escape(lp.problem)}</td></tr>")
            for t in lp.tasks:
                body.append(f"<tr><td>{t.task_id}</td><td style='text-align:left'><code>"
                            f"{html.escape(t.name)}</code></td><td "
                            f"style='color:{colours[t.state]}'>{t.state}</td><td>{_num(t.score)}/{_num(t.max_score)}</td>"
                            f"<td style='text-align:left'>{html.escape(t.detail)}</td></tr>")
        return (f"<div class='kit-progress'><div style='font-weight:bold'>Progress: "
                f"{_num(self.score)}/{_num(self.max_score)} "
                f"points</div><table>{''.join(body)}</table><div><b>Next:</b> "
                f"{html.escape(self.next_step())}</div></div>")


def _num(x: float) -> str:
    return f"{x:.4g}"


def _shown(path: Path | None, folder: Path) -> str:
    if path is None:
        return ""
    try:
        return str(path.relative_to(folder))
    except ValueError:
        return str(path)


# --------------------------------------------------------------------------- memory


def default_cache() -> Path:
    """Where results are remembered: ``$KIT_PROGRESS_CACHE``, else the user's cache folder."""
    if os.environ.get("KIT_PROGRESS_CACHE"):
        return Path(os.environ["KIT_PROGRESS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kit" / "progress.json"


def _checks_fingerprint(lesson: int) -> str:
    """The checks' own source: a changed check or reference forgets what it had judged."""
    digest = hashlib.sha256(f"v{CACHE_VERSION}".encode())
    for path in (_AUTOGRADER / f"lesson{lesson:02d}.py",
                 _AUTOGRADER / "references" / f"lesson{lesson:02d}.py"):
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _key(task: Task, sources: dict[str, str], checks: str, seed: int) -> str:
    text = json.dumps([task.id, task.name, sources.get(task.id, ""), sources.get(SETUP, ""), checks,
                       seed])
    return hashlib.sha256(text.encode()).hexdigest()


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("version") == CACHE_VERSION else {}


def _write_cache(path: Path, data: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".progress-", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: progress still shows, it is just not remembered
        print(f"kit progress: could not remember results in {path}: {e}", file=sys.stderr)


# --------------------------------------------------------------------------- judging


def _from_report(report: TaskReport, why: str = "") -> TaskProgress:
    """A task's state from its report (``why``: what the loader said of a task it could not
    load)."""
    status = report.status
    if status == PASSED:
        state, detail = PASSED_, ""
    elif status == NOT_IMPLEMENTED:
        state, detail = TODO_, ""
    elif status == MISSING:
        state, detail = NOT_STARTED_, (
            f"no `{report.name}` was found in the notebook: restore its task cell (or its name), "
            "then run it." + (f" ({why})" if why else ""))
    else:
        first = next((c for c in report.cases if not c.passed), None)
        reason = "" if status == "failed" else f" ({status})"
        detail = f"fails '{first.name}'{reason}." if first else f"{status}."
        if why and not first:
            detail = f"{status}: {why}"
        elif why:
            detail += f" {why}"
        state = FAILED_
    return TaskProgress(report.task_id, report.name, state, report.score, report.max_score, detail)


def _not_started(task: Task, detail: str = "") -> TaskProgress:
    return TaskProgress(task.id, task.name, NOT_STARTED_, 0.0, float(task.points), detail)


def course_progress(folder: str | os.PathLike[str] | None = None, *,
                    lessons: list[int] | None = None,
                    run: bool = True, cache: str | os.PathLike[str] | None = None,
                    seed: int = 0) -> Progress:
    """Where the learner stands in every lesson of ``folder``.

    Args:
        folder: the folder of the learner's notebooks (default: the course folder ``kit lab``
            opens, :func:`kit.lab.course_root`).
        lessons: lesson numbers to show (default: every lesson with checks).
        run: check the tasks whose code changed since they were last checked. ``False`` shows
            only remembered results; a changed or never-checked task then shows as ``failed``
            with "changed since it was last checked".
        cache: the memory file (default: :func:`default_cache`); ``None`` uses the default.
        seed: the checks' seed (``check()`` uses 0).
    """
    if folder is None:
        from kit.lab import course_root

        folder = course_root()
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise NotebookError(f"no such folder: {folder}. Give the folder that holds your lesson "
                            "notebooks (NN_slug.ipynb, or a lessons/ folder of them).")
    wanted = checked_lessons() if lessons is None else sorted(lessons)
    notebooks = find_notebooks(folder, wanted)
    cache_path = Path(cache) if cache is not None else default_cache()
    memory = _read_cache(cache_path)
    results: dict[str, Any] = memory.setdefault("results", {})
    memory["version"] = CACHE_VERSION
    progress = Progress(folder)
    for lesson in wanted:
        tasks = lesson_tasks(lesson)
        path = notebooks.get(lesson)
        lp = LessonProgress(lesson, path)
        progress.lessons.append(lp)
        if path is None:
            lp.tasks = [_not_started(t) for t in tasks]
            continue
        try:
            module = load_tasks(path, lesson=lesson)
        except NotebookError as e:
            lp.problem = f"{path.name} cannot be read: {e}"
            lp.tasks = [_not_started(t, "the notebook cannot be read") for t in tasks]
            continue
        load = module.__load_report__
        checks = _checks_fingerprint(lesson)
        for task in tasks:
            impl = getattr(module, task.name, None)
            if task.id in load.missing or impl is None:
                why = load.missing.get(task.id, "no definition")
                lp.tasks.append(_from_report(unloaded(task, why), why))
                continue
            key = _key(task, load.sources, checks, seed)
            tp = _remembered(results.get(key))
            if tp is not None:
                progress.remembered += 1
            elif not run:
                tp = TaskProgress(task.id, task.name, FAILED_, 0.0, float(task.points),
                                  "changed since it was last checked (run `kit progress`).")
            else:
                tp = _check(task, impl, seed)
                results[key] = {k: v for k, v in tp.to_dict().items() if k != "remembered"}
                progress.ran += 1
            lp.tasks.append(tp)
    if progress.ran:
        _write_cache(cache_path, memory)
    return progress


def _remembered(entry: Any) -> TaskProgress | None:
    """A remembered result, or None when there is none (or it is unreadable: then it runs)."""
    try:
        tp = TaskProgress.from_dict(entry)
    except (TypeError, KeyError, ValueError):
        return None
    if tp.state not in (PASSED_, FAILED_, TODO_, NOT_STARTED_):
        return None
    tp.remembered = True
    return tp


def _check(task: Task, impl: Any, seed: int) -> TaskProgress:
    from autograder.checking import run_checks, stderr_to_stdout

    # What the learner's code prints (and its ranks) stays out of the table.
    with contextlib.redirect_stdout(io.StringIO()), stderr_to_stdout():
        report = run_checks(task.id, impl, seed=seed)
    return _from_report(report)


def progress(folder: str | os.PathLike[str] | None = None, **kwargs: Any) -> Progress:
    """``kit.progress()`` in a notebook: :func:`course_progress`, shown as an HTML table."""
    return course_progress(folder, **kwargs)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kit progress",
                                     description="Where you stand in every lesson: each task's "
                                                 "state and points.")
    parser.add_argument("folder", nargs="?",
                        help="the folder of your notebooks (default: the course folder)")
    parser.add_argument("--lessons", type=lessons_arg,
                        help="lessons to show, e.g. 00,01 (default: all)")
    parser.add_argument("--cached", action="store_true",
                        help="run nothing: show remembered results only")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args(argv)
    try:
        report = course_progress(args.folder, lessons=args.lessons, run=not args.cached)
    except (NotebookError, FileNotFoundError) as e:
        print(f"kit progress: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.table())
    return 0
