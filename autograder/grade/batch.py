"""Batch grading: every submission checked in its own sandbox, scored in this trusted process.

``kit grade SUBMISSION... --out DIR`` (see :mod:`autograder.grade.notebook`) calls
:func:`grade_batch`. For each submission a :mod:`autograder.grade.sandbox` worker runs the untrusted
half of every case on the student's code; what comes back is read with
``torch.load(weights_only=True)``, checked to be plain data, and compared here with the expectation
computed from the trusted references with the run's secret seed. A worker that dies, hangs, prints
too much or forks too much costs only the task it was running: the worker restarts for the remaining
tasks.

Each submission's result is written to ``DIR/records/<student>.json`` atomically as soon as it is
graded, with an HMAC under the run's secret key; a run that is killed resumes by keeping every
record that still matches its submission (same notebooks, same lessons, same seed).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import secrets
import shutil
import signal
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from queue import Queue
from typing import Any

import torch

from autograder import course, gates
from autograder.grade.sandbox import (
    Limits,
    WorkerExit,
    make_workdir,
    remove_stale_workdirs,
    remove_workdir,
    require_sandbox,
    run_worker,
)
from autograder.grade.submissions import Submission, safe_name
from autograder.registry import Task, lesson_tasks
from autograder.results import (
    BLOCKED,
    ERROR,
    MISSING,
    NOT_IMPLEMENTED,
    STATUSES,
    TIMEOUT,
    CaseResult,
    TaskReport,
    judge,
    settle,
    unloaded_status,
)

__all__ = ["TASK_STATUSES", "BatchConfig", "GraderFault", "grade_batch", "load_records",
           "write_atomic"]


class GraderFault(RuntimeError):
    """The grader itself failed (not the submission): nothing is recorded, a re-run retries it."""

TASK_STATUSES = STATUSES
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


@dataclass
class BatchConfig:
    out: Path
    lessons: list[int]
    workers: int = 2
    limits: Limits = Limits()
    seed: int | None = None  # None: the run's secret seed (kept in DIR/.kit-grade/secret.json)


# --------------------------------------------------------------------------- secrets and records


def run_secret(out: Path, seed: int | None) -> dict[str, Any]:
    """The run's seed and HMAC key, created once per output folder (mode 0600) and reused on
    resume."""
    folder = out / ".kit-grade"
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    path = folder / "secret.json"
    if path.exists():
        secret = json.loads(path.read_text())
    else:
        secret = {"seed": secrets.randbelow(2**31), "key": secrets.token_hex(32)}
        write_atomic(path, json.dumps(secret), mode=0o600)
    if seed is not None:
        secret["seed"] = seed
    return secret


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # a reader sees the old record or the new one, never half of one


def _sign(record: dict[str, Any], key: str) -> str:
    body = json.dumps({k: v for k, v in record.items() if k != "hmac"}, sort_keys=True)
    return hmac.new(bytes.fromhex(key), body.encode(), hashlib.sha256).hexdigest()


def load_records(out: Path, key: str) -> dict[str, dict[str, Any]]:
    """Signed records in ``out/records``, by student; unsigned or altered ones are left out."""
    records = {}
    for path in sorted((out / "records").glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and hmac.compare_digest(str(record.get("hmac", "")),
                                                            _sign(record, key)):
            records[record["student"]] = record
    return records


# --------------------------------------------------------------------------- trusted expectations


def expectations(tasks: list[Task], seed: int) -> dict[str, Any]:
    """``{case key: expected data or ("raised", message)}`` for every case, computed here."""
    expected: dict[str, Any] = {}
    for task in tasks:
        for index, case in enumerate(task.cases):
            if case.needs == "cuda" and not torch.cuda.is_available():
                continue
            try:
                expected[case_key(task, index)] = ("ok", task.expected(case, seed))
            except Exception as e:  # a broken reference must not be blamed on students
                expected[case_key(task, index)] = ("raised", f"{type(e).__name__}: {e}")
    return expected


def case_key(task: Task, index: int) -> str:
    return f"{task.id.replace('.', '-')}-{index}"


def _check_plain(x: Any, depth: int = 0) -> None:
    if depth > 50:
        raise TypeError("nested too deeply")
    if type(x) is torch.Tensor:
        if x.layout != torch.strided or x.device.type != "cpu":
            raise TypeError(f"a {x.layout} tensor on {x.device}")
        return
    if type(x) in _PLAIN:
        return
    if type(x) in (list, tuple):
        for item in x:
            _check_plain(item, depth + 1)
        return
    if type(x) is dict:
        for k, v in x.items():
            _check_plain(k, depth + 1)
            _check_plain(v, depth + 1)
        return
    raise TypeError(f"a {type(x).__module__}.{type(x).__name__}")


def _read_untrusted(path: Path) -> bytes:
    """A file the worker wrote: a regular file, its last part not a link (never a FIFO that blocks,
    never a link the worker planted to something only the grader may read)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path.name} is not a regular file")
        return f.read()


def read_result(path: Path) -> dict[str, Any]:
    """A case's result file, as plain data only; anything else is an error record."""
    try:
        record = torch.load(io.BytesIO(_read_untrusted(path)), weights_only=True,
                            map_location="cpu")
        _check_plain(record)
    except Exception as e:
        return {"status": ERROR, "message": "the case returned something that is not plain data "
                f"(tensors, numbers, strings, lists, dicts): {type(e).__name__}: {str(e)[:300]}"}
    if not isinstance(record, dict) or record.get("status") not in ("ok", NOT_IMPLEMENTED, ERROR,
                                                                    TIMEOUT, "forbidden"):
        return {"status": ERROR, "message": "the grading worker sent back a malformed result"}
    return record


# --------------------------------------------------------------------------- one submission


def _case(task: Task, index: int, status: str, message: str) -> CaseResult:
    case = task.cases[index]
    return CaseResult(case.name, status, 0.0, task.case_points(case), message[:2000],
                      hint=case.hint if status in (ERROR, TIMEOUT) else "")


def _judge(task: Task, index: int, raw: dict[str, Any] | None, expected: Any) -> CaseResult:
    """What the worker sent back for one case, judged here by :func:`autograder.results.judge`."""
    case = task.cases[index]
    if raw is None:
        return _case(task, index, ERROR, "the case did not run")
    status = raw.get("status")
    if status in (NOT_IMPLEMENTED, ERROR, TIMEOUT, "forbidden"):
        result = _case(task, index, status, str(raw.get("message", "")))
        result.details = str(raw.get("details", ""))[-2000:]
        return result
    kind, want = expected
    if kind != "ok":
        return _case(task, index, ERROR, f"the grader's reference failed ({want}); "
                     "this is not your fault: tell your instructor")
    return judge(task, case, raw.get("data"), want, float(raw.get("seconds", 0.0) or 0.0))


_KILLED = {
    "timeout": (TIMEOUT, "did not finish within {wall:g} s (an infinite loop, or ranks waiting "
                "for each other?)"),
    "wall": (TIMEOUT, "the submission ran out of its total time"),
    "output": (ERROR, "printed more than {output} bytes; print less"),
    "processes": (ERROR, "started more than {procs} processes at once"),
}


def _death(exit: WorkerExit, limits: Limits) -> tuple[str, str]:
    if exit.reason in _KILLED:
        status, text = _KILLED[exit.reason]
        return status, text.format(wall=limits.case_wall_s, output=limits.output,
                                   procs=limits.processes)
    code = exit.returncode
    if code is not None and code < 0:
        why = {signal.SIGXCPU: "it used up its CPU time", signal.SIGKILL: "out of memory?",
               signal.SIGSEGV: "a segmentation fault"}.get(-code, "")
        return ERROR, f"the process was killed by signal {-code}" + (f" ({why})" if why else "")
    return ERROR, (f"the code ended the grading process (exit code {code}): "
                   "do not call sys.exit() or os._exit() in graded code")


# Seconds each lesson's checks take on the solutions on 2 cores: the course spec's
# Lesson.grading_seconds (autograder/course.py). Only a weight for splitting one submission's
# lessons evenly over idle workers: a stale number costs balance, never a grade.
LESSON_SECONDS = {spec.number: spec.grading_seconds for spec in course.LESSONS}


def split_lessons(lessons: list[int], parts: int) -> list[list[int]]:
    """``lessons`` in at most ``parts`` groups of about equal grading time (longest first, each
    to the lightest group; :data:`LESSON_SECONDS`, the mean for a lesson it lacks), each group
    sorted, no group empty."""
    mean = sum(LESSON_SECONDS.values()) / len(LESSON_SECONDS)
    groups: list[list[int]] = [[] for _ in range(max(1, min(parts, len(lessons))))]
    load = [0.0] * len(groups)
    for lesson in sorted(lessons, key=lambda n: (-LESSON_SECONDS.get(n, mean), n)):
        lightest = load.index(min(load))
        groups[lightest].append(lesson)
        load[lightest] += LESSON_SECONDS.get(lesson, mean)
    return [sorted(g) for g in groups if g]


def grade_submission(sub: Submission, lessons: list[int], tasks: list[Task],
                     expected: dict[str, Any],
                     seed: int, limits: Limits, slot: int | list[int],
                     hide: tuple[Path, ...] = (), *, unsandboxed: bool = False) -> dict[str, Any]:
    """Grade one submission in sandbox workers; returns its record (not yet signed).

    ``slot``: the worker slot to use, or a list of them: with more than one, the lessons are
    split over that many workers running at once (:func:`split_lessons`), so one submission
    alone is graded in about half the time on two idle slots. Each worker still sees only this
    submission. ``hide``: paths its worker must not see (the output folder, every submission).
    ``unsandboxed``: see :func:`grade_batch`."""
    start = time.monotonic()
    slots = [slot] if isinstance(slot, int) else list(slot)
    groups = split_lessons([n for n in lessons if sub.notebook_for(n) is not None], len(slots))
    if len(groups) <= 1:
        parts = [_grade_lessons(sub, lessons, tasks, expected, seed, limits, slots[0], hide,
                                unsandboxed)]
    else:
        groups[0] += [n for n in lessons if sub.notebook_for(n) is None]  # judged missing here
        with ThreadPoolExecutor(max_workers=len(groups)) as pool:
            futures = [pool.submit(_grade_lessons, sub, group, tasks, expected, seed, limits,
                                   part_slot, hide, unsandboxed)
                       for group, part_slot in zip(groups, slots)]
            parts = [f.result() for f in futures]
    results = {k: v for part in parts for k, v in part[0].items()}
    loads = {k: v for part in parts for k, v in part[1].items()}
    output = "\n".join(part[2] for part in parts if part[2])
    return _record(sub, lessons, tasks, results, loads, output, time.monotonic() - start)


def _grade_lessons(sub: Submission, lessons: list[int], tasks: list[Task], expected: dict[str, Any],
                   seed: int, limits: Limits, slot: int, hide: tuple[Path, ...],
                   unsandboxed: bool = False
                   ) -> tuple[dict[str, CaseResult], dict[int, dict[str, Any]], str]:
    """The cases of ``lessons`` run in one worker slot (restarted after a death): (judged cases
    by key, what loading each notebook reported, the worker's output)."""
    results: dict[str, CaseResult] = {}  # case key -> judged case
    loads: dict[int, dict[str, Any]] = {}
    pending = []  # (task, index) still to run
    for task in tasks:
        if task.lesson not in lessons:
            continue
        nb = sub.notebook_for(task.lesson)
        for index, case in enumerate(task.cases):
            key = case_key(task, index)
            if nb is None:
                results[key] = _case(task, index, MISSING,
                                     f"no notebook for lesson {task.lesson:02d} in this submission")
            elif key not in expected:
                results[key] = _case(task, index, BLOCKED,
                                     f"needs {case.needs}, which this grading machine lacks")
            else:
                pending.append((task, index))
    output: list[str] = []
    attempts = 0
    while pending and attempts < len(tasks) + 3:
        attempts += 1
        work = make_workdir()
        try:
            notebooks = []
            for lesson in sorted({t.lesson for t, _ in pending}):
                src = sub.notebook_for(lesson)
                copy = work / f"lesson{lesson:02d}{src.suffix}"
                shutil.copyfile(src,
                                copy)  # the worker reads a copy; the submission stays untouched
                os.chmod(copy, 0o444)
                notebooks.append([lesson, str(copy)])
            job = {"seed": seed, "notebooks": notebooks,
                   "cases": [[t.id, i, case_key(t, i)] for t, i in pending],
                   # the references' fingerprints (hashes, never code): a pasted reference
                   # scores 0 in the worker as it does in check()
                   "reference_prints": gates.answer_fingerprints(),
                   "reference_shapes": gates.answer_shapes()}
            (work / "job.json").write_text(json.dumps(job))
            os.chmod(work / "job.json", 0o444)  # readable by the worker's uid whatever the umask
            exit = run_worker(work, limits, slot=slot, cases=len(pending), hide=hide,
                              unsandboxed=unsandboxed)
            if exit.last is None and exit.reason is None:
                # It died before reading the submission: the grader's installation is at fault.
                raise GraderFault(f"the grading worker failed before loading {sub.student}'s "
                                  f"notebooks (exit code {exit.returncode}):\n"
                                  f"{exit.output[-3000:]}")
            output.append(exit.output)
            for lesson, _ in notebooks:
                loads[lesson] = _read_load(work / f"load-{lesson}.json")
            results_dir = work / "results"  # the worker could have swapped it for a link
            raws = {case_key(t, i): read_result(results_dir / f"{case_key(t, i)}.pt")
                    for t, i in pending if not results_dir.is_symlink()
                    and (results_dir / f"{case_key(t, i)}.pt").is_file()}
        finally:
            remove_workdir(work)
        still = []
        for task, index in pending:
            key = case_key(task, index)
            load = loads.get(task.lesson)
            if load and ("error" in load or task.id in load.get("missing", {})):
                why = load.get("error") or load["missing"][task.id]
                status = ERROR if "error" in load else unloaded_status(why)
                results[key] = _case(task, index, status,
                                     f"could not load it from the notebook: {why}")
            elif key in raws:
                results[key] = _judge(task, index, raws[key], expected[key])
            else:
                still.append((task, index))
        pending = still
        if not still:
            break
        # The worker stopped early: blame the case it was running (or loading) and its whole task.
        culprit = _culprit(exit, still)
        status, why = _death(exit, limits)
        for task, index in still:
            if task.id == culprit.id or (exit.last or "").startswith("load") \
                    and task.lesson == culprit.lesson:
                results[case_key(task, index)] = _case(task, index, status, why)
        pending = [(t, i) for t, i in pending if case_key(t, i) not in results]
    for task, index in pending:  # out of attempts
        results[case_key(task, index)] = _case(task, index, ERROR, "the case did not run")
    return results, loads, "\n".join(output)


def _read_load(path: Path) -> dict[str, Any]:
    # Written by the worker after the notebook's code ran: untrusted, so only its shape is used.
    try:
        data = json.loads(_read_untrusted(path).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if k in ("missing", "notes", "error")
            and isinstance(v, (dict, list, str))}


def _culprit(exit: WorkerExit, still: list[tuple[Task, int]]) -> Task:
    last = exit.last or ""
    if last.startswith("case "):
        for task, index in still:
            if case_key(task, index) == last[5:]:
                return task
    if last.startswith("load "):
        lesson = last[5:]
        for task, _ in still:
            if str(task.lesson) == lesson:
                return task
    return still[0][0]


def _record(sub: Submission, lessons: list[int], tasks: list[Task], results: dict[str, CaseResult],
            loads: dict[int, dict[str, Any]], output: str, seconds: float) -> dict[str, Any]:
    rows = []
    for task in tasks:
        if task.lesson not in lessons:
            continue
        report = settle(TaskReport(task.id, task.name,
                                   [results[case_key(task, i)] for i in range(len(task.cases))]))
        row = report.to_dict()
        del row["output"]  # the submission's output is kept once, for the whole record
        rows.append(row)
    notes = list(sub.notes)
    for lesson, load in sorted(loads.items()):
        notes += [f"lesson {lesson:02d}: {n}" for n in load.get("notes", [])
                  if isinstance(n, str)][:20]
    return {"student": sub.student, "score": round(sum(r["score"] for r in rows), 6),
            "max_score": round(sum(r["max_score"] for r in rows), 6), "tasks": rows,
            "notes": notes, "output": output[-8000:], "seconds": round(seconds, 2)}


# --------------------------------------------------------------------------- the batch


def grade_batch(subs: list[Submission], config: BatchConfig,
                progress: Callable[[int, int, float], None] | None = None, *,
                unsandboxed: bool = False) -> dict[str, dict[str, Any]]:
    """Grade every submission not already recorded in ``config.out``; returns all records by
    student.

    Fails closed: as root where no namespaced sandbox can be made, it raises
    :class:`~autograder.grade.sandbox.SandboxUnavailable` before it creates or reads anything in
    ``config.out``, unless ``unsandboxed=True`` (``kit grade --unsandboxed``: every submission is
    trusted). See :func:`autograder.grade.sandbox.require_sandbox`."""
    require_sandbox(unsandboxed)
    secret = run_secret(config.out, config.seed)
    (config.out / "records").mkdir(parents=True, exist_ok=True)
    tasks = [t for lesson in config.lessons for t in lesson_tasks(lesson)]
    done = load_records(config.out, secret["key"])
    stamp = {sub.student: {"digest": sub.digest(config.lessons), "lessons": config.lessons,
                           "seed": secret["seed"]} for sub in subs}
    records = {s: r for s, r in done.items() if s in stamp
               and all(r.get(k) == v for k, v in stamp[s].items())}
    todo = [sub for sub in subs if sub.student not in records]
    if progress and records:
        print(f"kit grade: resuming: {len(records)} of {len(subs)} submission(s) already graded")
    if not todo:
        return records
    remove_stale_workdirs()
    expected = expectations(tasks, secret["seed"])  # before any thread: references may fork ranks
    slots: Queue[int] = Queue()
    for slot in range(config.workers):
        slots.put(slot)
    lock = threading.Lock()
    started = time.monotonic()
    hide = (config.out,
            *{p for s in subs for p in (s.source, s.any_lesson, *s.notebooks.values()) if p})
    finished = [0]

    # Fewer submissions than workers (one submission alone, the usual case of a student's own
    # `kit grade` or of Gradescope): each one spreads its lessons over the idle workers. Never
    # more slots taken at once than exist, so no thread waits for a slot another one holds.
    share = max(1, config.workers // len(todo))

    def one(sub: Submission) -> None:
        mine = [slots.get() for _ in range(share)]
        try:
            record = grade_submission(sub, config.lessons, tasks, expected, secret["seed"],
                                      config.limits, mine, hide, unsandboxed=unsandboxed)
        finally:
            for slot in mine:
                slots.put(slot)
        record.update(stamp[sub.student])
        record["hmac"] = _sign(record, secret["key"])
        write_atomic(config.out / "records" / f"{safe_name(sub.student)}.json",
                     json.dumps(record, indent=1))
        with lock:
            records[sub.student] = record
            finished[0] += 1
            if progress:
                progress(finished[0], len(todo), time.monotonic() - started)

    with ThreadPoolExecutor(max_workers=config.workers) as pool:
        futures = [pool.submit(one, sub) for sub in todo]
        try:
            for future in futures:
                future.result()
        except GraderFault:
            for future in futures:
                future.cancel()
            raise
    # Rewrite every record from memory: a submission that wrote into records/ meanwhile loses.
    for sub in subs:
        write_atomic(config.out / "records" / f"{safe_name(sub.student)}.json",
                      json.dumps(records[sub.student], indent=1))
    return records
