"""What a batch grading run writes: ``grades.csv``, feedback, Gradescope and nbgrader files.

Used by ``kit grade SUBMISSION... --out DIR`` (:mod:`autograder.grade.notebook`); the grading itself
is :mod:`autograder.grade.batch`. Every file here is rebuilt from the signed per-submission records,
so a resumed run writes exactly one row per submission.

* ``grades.csv``: one row per student: total, then one column per task (its score);
* ``feedback/<student>.txt``: each task's status and, for every case that lost points, why;
* ``gradescope/<student>/results.json`` (``--gradescope``): Gradescope's autograder format;
* ``nbgrader-grades.csv``: one row per student and lesson with the columns of nbgrader's own
  ``nbgrader export`` (``assignment, student_id, score, max_score``), for a gradebook import.
"""

from __future__ import annotations

import csv
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

from autograder.grade.batch import BatchConfig, GraderFault, grade_batch, write_atomic
from autograder.grade.sandbox import Limits
from autograder.grade.submissions import Submission, discover, safe_name
from autograder.loading import NotebookError
from autograder.results import PASSED, TaskReport
from kit.output import Progress

__all__ = ["feedback_text", "gradescope_results", "run_batch", "write_outputs"]


def feedback_text(record: dict[str, Any]) -> str:
    """A student's readable feedback: every task's report, as ``check()`` prints it."""
    lines = [f"Feedback for {record['student']}: {record['score']:.4g}/{record['max_score']:.4g} "
             "points", ""]
    for task in record["tasks"]:
        lines += [TaskReport.from_dict(task).to_text(details=False), ""]
    if record.get("notes"):
        lines += ["Notes:"] + [f"  {n}" for n in record["notes"]]
    return "\n".join(lines).rstrip() + "\n"


def gradescope_results(record: dict[str, Any]) -> dict[str, Any]:
    """Gradescope's ``results.json``: one test per task, its score and feedback as output."""
    tests = []
    for task in record["tasks"]:
        report = TaskReport.from_dict(task)
        tests.append({"name": f"Task {task['task']} {task['name']}", "number": task["task"],
                      "score": task["score"], "max_score": task["max_score"],
                      "status": "passed" if task["status"] == PASSED else "failed",
                      "output": report.to_text(details=False)[:8000]})
    return {"score": record["score"], "execution_time": record.get("seconds", 0),
            "output": "\n".join(record.get("notes", []))[:8000], "tests": tests}


def write_outputs(out: Path, subs: list[Submission], records: dict[str, dict[str, Any]], *,
                  gradescope: bool = False) -> Path:
    """Rebuild every output file from ``records``; one CSV row per submission, in input order."""
    task_ids = [t["task"] for t in records[subs[0].student]["tasks"]] if subs else []
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["student", "score", "max_score", *task_ids, "statuses"])
    by_lesson = io.StringIO()
    nb = csv.writer(by_lesson, lineterminator="\n")
    nb.writerow(["assignment", "student_id", "score", "max_score"])
    (out / "feedback").mkdir(exist_ok=True)
    for sub in subs:
        record = records[sub.student]
        scores = {t["task"]: t["score"] for t in record["tasks"]}
        statuses = " ".join(f"{t['task']}={t['status']}" for t in record["tasks"])
        writer.writerow([sub.student, record["score"], record["max_score"],
                         *[scores.get(tid, "") for tid in task_ids], statuses])
        lessons: dict[str, list[float]] = {}
        for t in record["tasks"]:
            total = lessons.setdefault(t["task"].split(".")[0].zfill(2), [0.0, 0.0])
            total[0] += t["score"]
            total[1] += t["max_score"]
        for lesson, (score, max_score) in lessons.items():
            nb.writerow([f"lesson{lesson}", sub.student, round(score, 6), round(max_score, 6)])
        name = safe_name(sub.student)
        write_atomic(out / "feedback" / f"{name}.txt", feedback_text(record))
        if gradescope:
            (out / "gradescope" / name).mkdir(parents=True, exist_ok=True)
            write_atomic(out / "gradescope" / name / "results.json",
                          json.dumps(gradescope_results(record), indent=1))
    write_atomic(out / "nbgrader-grades.csv", by_lesson.getvalue())
    write_atomic(out / "grades.csv", buffer.getvalue())
    return out / "grades.csv"


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return True


class GradingError(ValueError):
    """The batch was asked for something impossible; the message names the fix."""


def _batch_lessons(lessons: list[int] | None) -> list[int]:
    from autograder.registry import checked_lessons, lesson_tasks

    if lessons is None:  # every lesson with checks
        return checked_lessons()
    unknown = [n for n in lessons if not lesson_tasks(n)]
    if unknown:
        raise GradingError(f"lesson {unknown[0]:02d} has no checks "
                           f"(autograder/lesson{unknown[0]:02d}.py)")
    return lessons


def run_batch(submissions: list[str], *, out: Path, lessons: list[int] | None = None,
              workers: int = 2,
              timeout: float = 60.0, gradescope: bool = False, seed: int | None = None,
              unsandboxed: bool = False, shard: str | None = None,
              secret: str | None = None, rank_pool: bool = False) -> int:
    """``kit grade SUBMISSION... --out DIR``: grade, then write every report; returns the exit code.

    As root with no namespaced sandbox it refuses (exit code 2, nothing written) unless
    ``unsandboxed`` (``--unsandboxed``), which prints a loud warning instead. ``shard`` ("I/N",
    ``--shard``) grades only the I-th of N slices of the submissions and ``secret`` (``--secret
    FILE``) shares one run secret between shards: see :mod:`autograder.grade.shards`."""
    from autograder.grade.shards import (
        ShardError,
        parse_shard,
        select,
        shared_secret,
        write_manifest,
    )

    try:
        lessons = _batch_lessons(lessons)
        if workers < 1 or timeout <= 0:
            raise GradingError("--workers must be at least 1 and --timeout positive")
        if secret is not None and seed is not None:
            raise GradingError("give --secret or --seed, not both: the secret holds the seed")
        slice_ = parse_shard(shard) if shard is not None else None
        everyone = discover(submissions)
        subs = select(everyone, slice_) if slice_ else everyone
        for src in [Path(p) for p in submissions] + [s.source for s in subs if s.source]:
            if (src.is_dir() and _inside(out, src)) or _inside(src, out):
                raise GradingError(f"--out {out} and the submission {src} overlap: give the "
                                   "results a folder of their own, so no submission is ever "
                                   "written to")
    except (NotebookError, GradingError, ShardError) as e:
        print(f"kit grade: {e}", file=sys.stderr)
        return 2
    from autograder.grade.sandbox import (
        SandboxUnavailable,
        isolation_note,
        require_sandbox,
        unsandboxed_warning,
    )

    try:  # before anything is written: as root, no sandbox means no grading (unless --unsandboxed)
        require_sandbox(unsandboxed)
    except SandboxUnavailable as e:
        print(f"kit grade: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    if secret is not None:  # every shard grades with the same seed and signs with the same key
        try:
            shared = shared_secret(Path(secret))
        except ShardError as e:
            print(f"kit grade: {e}", file=sys.stderr)
            return 2
        (out / ".kit-grade").mkdir(mode=0o700, exist_ok=True)
        write_atomic(out / ".kit-grade" / "secret.json", json.dumps(shared), mode=0o600)
    if slice_:
        print(f"kit grade: shard {slice_[0]}/{slice_[1]}: {len(subs)} of {len(everyone)} "
              "submission(s)")
    print(f"kit grade: {len(subs)} submission(s), lessons {','.join(f'{n:02d}' for n in lessons)}, "
          f"{workers} worker(s), results in {out}")
    for sub in subs:
        for note in sub.notes:
            print(f"  {sub.student}: {note}")
    if (warning := unsandboxed_warning()) is not None:  # root, no sandbox, and --unsandboxed
        print("\n".join(f"kit grade: {line.strip()}" for line in warning.splitlines()),
              file=sys.stderr)
    elif (note := isolation_note()) is not None:
        print(f"kit grade: note: {note}")
    config = BatchConfig(out, lessons, workers, Limits(case_wall_s=timeout, rank_pool=rank_pool),
                         seed)
    start = time.monotonic()
    bar = Progress(len(subs), sys.stderr, width=20)

    def progress(done: int, total: int, seconds: float) -> None:
        left = seconds / done * (total - done)
        bar.total = total
        rate = 60 * done / max(seconds, 1e-9)
        bar.update(f"graded, {int(left // 60)}:{int(left % 60):02d} left, {rate:.1f} per minute",
                   done=done)

    try:
        records = grade_batch(subs, config, progress, unsandboxed=unsandboxed)
    except GraderFault as e:
        print(f"kit grade: {e}\nThe submissions graded so far are recorded; fix the grader and "
              "re-run the same command to finish.", file=sys.stderr)
        return 3
    finally:
        bar.close()
    if slice_:
        from autograder.grade.batch import run_secret

        run = run_secret(out, config.seed)
        write_manifest(out, run["key"], slice_, everyone, subs, lessons, run["seed"])
    path = write_outputs(out, subs, records, gradescope=gradescope)
    scores = [records[s.student]["score"] for s in subs]
    print(f"graded {len(subs)} submission(s) in {time.monotonic() - start:.1f} s; "
          f"mean score {sum(scores) / max(1, len(scores)):.3g}; wrote {path}")
    return 0
