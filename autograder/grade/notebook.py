"""``kit grade``: grade notebooks with the same checks students run.

    kit grade lessons/00_launching_ranks.ipynb              one notebook, checked in this process
    kit grade alice.ipynb --lessons 00,01 --json alice.json
    kit grade course/submitted --out grades --workers 2     a batch, each submission sandboxed
    kit grade submissions/ --out grades --gradescope --timeout 30
    kit grade course/submitted --out shard1 --shard 1/2 --secret run.json   then 2/2, then
    kit grade merge shard1 shard2 --out grades              (see autograder.grade.shards)

With ``--out`` (or several submissions) grading is the isolated batch of
:mod:`autograder.grade.batch`: it writes ``grades.csv``, ``records/<student>.json``,
``feedback/<student>.txt`` and, with ``--gradescope``, ``gradescope/<student>/results.json``; a
killed run resumes when re-run. As root where bubblewrap cannot make a sandbox, the batch refuses
(exit code 2, nothing written) unless ``--unsandboxed`` is given.
Without it, one notebook is checked in this process, which trusts it: use that on your own work.
As root that needs ``--unsandboxed`` too (the notebook's code would run as root); without it
``kit grade NOTEBOOK`` refuses (exit code 2, nothing written) and names ``--out`` for a sandbox.

The graded code is loaded with :func:`autograder.loading.load_tasks` (setup and solution cells only,
found by tag or by name, demos never run) and every task of the lesson is checked with
:func:`autograder.checking.run_checks`. Prints a per-task score table and writes JSON. The
submission itself is only read. :func:`grade_notebook` is the unit the batch grader runs per
submission.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autograder.checking import run_checks, stderr_to_stdout
from autograder.loading import LoadReport, NotebookError, lesson_of, lessons_arg, load_tasks
from autograder.registry import lesson_tasks
from autograder.results import TaskReport, Totals, unloaded

__all__ = ["GradeReport", "grade_notebook", "main"]

OUTPUT_LIMIT = 4000  # characters of captured output kept per task in the JSON


@dataclass
class GradeReport(Totals):
    """The grade of one notebook: every task of the graded lessons, and what could not be loaded."""

    notebook: Path
    lessons: list[int]
    tasks: list[TaskReport] = field(default_factory=list)
    loads: list[LoadReport] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "notebook": str(self.notebook),
            "lessons": [f"{n:02d}" for n in self.lessons],
            "score": round(self.score, 6),
            "max_score": self.max_score,
            "tasks": [t.to_dict() for t in self.tasks],
            "load": [{"lesson": f"{r.lesson:02d}", "found": r.found, "missing": r.missing,
                      "notes": r.notes} for r in self.loads],
        }

    def table(self) -> str:
        width = max([len(t.name) for t in self.tasks] + [4])
        lines = [f"{'task':<6}{'name':<{width + 2}}{'score':>11}  status"]
        for t in self.tasks:
            score = f"{t.score:.4g}/{t.max_score:.4g}"
            lines.append(f"{t.task_id:<6}{t.name:<{width + 2}}{score:>11}  {t.status}")
        lines.append(f"{'total':<{width + 8}}{f'{self.score:.4g}/{self.max_score:.4g}':>11}")
        for report in self.loads:
            lines += [f"missing {tid}: {why}" for tid, why in report.missing.items()]
            lines += [f"note: {note}" for note in report.notes]
        return "\n".join(lines)


def grade_notebook(path: str | Path, *, lessons: list[int] | None = None,
                   seed: int = 0) -> GradeReport:
    """Check every task of ``lessons`` (default: the lesson in the file name) in ``path``.

    Raises:
        NotebookError: missing or unreadable file, or no lesson given nor in the file name.
    """
    path = Path(path)
    if not path.is_file():
        raise NotebookError(f"no such notebook: {path}")
    if lessons is None:
        lesson = lesson_of(path)
        if lesson is None:
            raise NotebookError(f"cannot tell which lesson {path.name} is: name it NN_slug.ipynb "
                                "or pass --lessons 00")
        lessons = [lesson]
    report = GradeReport(path, lessons)
    for lesson in lessons:
        module = load_tasks(path, lesson=lesson)
        load: LoadReport = module.__load_report__
        report.loads.append(load)
        for task in lesson_tasks(lesson):
            impl = getattr(module, task.name, None)
            if task.id in load.missing or impl is None:
                report.tasks.append(unloaded(task, load.missing.get(task.id, "no definition")))
                continue
            buffer = io.StringIO()
            # The student's prints and rank output go to the JSON, not between the table rows.
            with contextlib.redirect_stdout(buffer), stderr_to_stdout():
                task_report = run_checks(task.id, impl, seed=seed)
            task_report.output = buffer.getvalue()[-OUTPUT_LIMIT:]
            report.tasks.append(task_report)
    return report


def in_process_refusal(path: Path, trusted: bool) -> str | None:
    """Why one notebook may not be checked in this process, else None.

    One notebook is checked here, not in a sandbox: its code runs as whoever runs ``kit grade``.
    As root that is everything (kit/, autograder/, the machine), so it is refused unless the
    grader says the notebook is trusted (``--unsandboxed``: your own work). As another user it
    runs as you, which is what checking your own notebook means."""
    from autograder.grade.sandbox import _is_root

    if trusted or not _is_root():
        return None
    return (f"refusing to check {path} in this process as root: its code would run as root, "
            "able to rewrite kit/ and autograder/ and anything else here.\n"
            "  Your own work: kit grade NOTEBOOK --unsandboxed (it is trusted).\n"
            "  Someone else's: kit grade NOTEBOOK --out DIR grades it in a sandbox "
            "(bubblewrap: make grade-setup).\n  Nothing was graded or written.")


def main(argv: list[str]) -> int:
    # kit grade merge SHARD_DIR... --out DIR
    if argv[:1] == ["merge"] and not Path("merge").exists():
        from autograder.grade.shards import main_merge

        return main_merge(argv[1:])
    parser = argparse.ArgumentParser(prog="kit grade",
                                     description="Grade notebooks or submission folders.")
    parser.add_argument("submissions", nargs="+", metavar="SUBMISSION",
                        help="a notebook, a folder of notebooks, an nbgrader course or submitted/ "
                             "folder, or a Gradescope export")
    parser.add_argument("--lessons", type=lessons_arg,
                        help="lessons to grade, e.g. 00,01 (default: from the file name; "
                        "in a batch: every lesson with checks)")
    parser.add_argument("--out", help="batch: the output folder (grades.csv, records/, feedback/)")
    parser.add_argument("--workers", type=int, default=2,
                        help="batch: sandbox workers at once, one submission each (with fewer "
                        "submissions than workers, a submission's lessons are split over them)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="batch: seconds one case may run before its task is marked timeout")
    parser.add_argument("--rank-pool", action="store_true",
                        help="batch: run a lesson's launches of one world size on ranks forked "
                        "once (the same scores, less CPU; see autograder/pool.py)")
    parser.add_argument("--gradescope", action="store_true",
                        help="batch: also write gradescope/<student>/results.json")
    parser.add_argument("--json", dest="json_path",
                        help="one notebook: where to write the JSON report "
                             "(default: grading-out/<name>.json; - for stdout)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the checks' data (one notebook: default 0; batch: the run's "
                             "secret)")
    parser.add_argument("--shard", metavar="I/N",
                        help="batch: grade only the I-th of N slices of the submissions (a "
                        "student's slice is fixed by a hash of the name); merge the shards' --out "
                        "folders with kit grade merge SHARD_DIR... --out DIR")
    parser.add_argument("--secret", metavar="FILE",
                        help="batch: the run secret (seed and signing key) to share between "
                        "shards, created in FILE by the first shard that starts (give every shard "
                        "the same)")
    parser.add_argument("--unsandboxed", action="store_true",
                        help="trust the submissions: a batch as root where bubblewrap cannot make "
                        "a sandbox grades anyway (without it kit grade refuses there; install "
                        "bubblewrap: apt-get install bubblewrap, or make grade-setup), and one "
                        "notebook is checked in this process as root (your own work)")
    args = parser.parse_args(argv)
    if args.out or args.shard or len(args.submissions) > 1 or Path(args.submissions[0]).is_dir():
        from autograder.grade.reports import run_batch

        return run_batch(args.submissions, out=Path(args.out or "grading-out"),
                         lessons=args.lessons,
                         workers=args.workers, timeout=args.timeout, gradescope=args.gradescope,
                         seed=args.seed, unsandboxed=args.unsandboxed, shard=args.shard,
                         secret=args.secret, rank_pool=args.rank_pool)
    path = Path(args.submissions[0])
    if (why := in_process_refusal(path, args.unsandboxed)) is not None:
        print(f"kit grade: {why}", file=sys.stderr)
        return 2
    out = Path(args.json_path) if args.json_path and args.json_path != "-" else \
        Path("grading-out") / f"{path.stem}.json"
    if args.json_path != "-" and out.resolve() == path.resolve():
        print(f"kit grade: --json would overwrite the submission {path}", file=sys.stderr)
        return 2
    try:
        report = grade_notebook(path, lessons=args.lessons, seed=args.seed or 0)
    except NotebookError as e:
        print(f"kit grade: {e}", file=sys.stderr)
        return 2
    print(f"kit grade: {path} (lesson {', '.join(f'{n:02d}' for n in report.lessons)})")
    print(report.table())
    text = json.dumps(report.to_dict(), indent=2)
    if args.json_path == "-":
        print(text)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n", encoding="utf-8")
        print(f"wrote {out}")
    return 0
