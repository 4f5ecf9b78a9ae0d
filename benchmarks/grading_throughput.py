"""Batch grading speed of full submissions: one alone, and throughput with 1 and 2 workers.

    .venv/bin/python benchmarks/grading_throughput.py               # 3 full submissions per batch
    .venv/bin/python benchmarks/grading_throughput.py --copies 6 --lessons 00,01

Submissions are the lessons' solutions as notebooks (every check runs to the end, the slow
path), one notebook per lesson with checks. Reported, measured in this one run on this machine:

* the wall time of one full submission graded sandboxed (``kit grade --out``) with one worker,
  against the same notebooks checked in this process with no sandbox (the trusting ``kit grade
  NOTEBOOK`` path), and the in-process seconds of each lesson;
* the same submission alone in a 2-worker batch, which splits its lessons over both workers
  (what a student's own ``kit grade`` or Gradescope waits for);
* the CPU seconds the sandboxed submission's worker and ranks used: what bounds a batch, which
  grades at most cores * 60 / CPU-s submissions a minute;
* submissions per minute for ``--copies`` full submissions with ``--workers 1`` and
  ``--workers 2`` (or the counts given), their ratio (2.0 would be perfect scaling), and what a
  300-student class would take at that rate; and the steady rate, counted only while every
  worker was busy (a short batch's expectations, start and lone last submissions weigh on its
  rate far more than on a class's; needs at least twice as many copies as workers), and
  the CPU per submission and how busy the cores were in each batch.

Each of these runs twice, side by side: with fresh ranks for every launch and with the rank
pool (``Limits(rank_pool=True)``, ``autograder/pool.py``), and the full submission's every task
status and score are compared between the two (``--rank-pool off`` or ``on`` runs one).

Each batch grades into a fresh output folder, so nothing is resumed. Timing only: correctness
is tests/test_grading*.py's job.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

from autograder import course
from autograder.build import render, source_notebook
from autograder.grade.batch import BatchConfig, expectations, grade_batch
from autograder.grade.notebook import grade_notebook
from autograder.grade.sandbox import Limits, SandboxUnavailable, isolation_note, require_sandbox
from autograder.grade.submissions import discover
from autograder.loading import lesson_of
from autograder.registry import lesson_tasks

ROOT = Path(__file__).resolve().parents[1]
_JUDGED: dict[Path, dict[str, list]] = {}  # each batch's (task, status, score) by student


def _full_submission(folder: Path) -> list[int]:
    folder.mkdir(parents=True)
    lessons = []
    for spec in course.LESSONS:
        (folder / f"{spec.stem}.ipynb").write_text(render(source_notebook(spec.source)))
        lessons.append(spec.number)
    return lessons


def _batch(paths: list[Path], out: Path, lessons: list[int], workers: int,
           finished: list[float] | None = None,
           unsandboxed: bool = False, rank_pool: bool = False) -> tuple[float, float, float]:
    """(seconds, total score of all submissions, CPU seconds of the workers and their ranks);
    ``finished`` receives the seconds, after the batch's expectations, at which each
    submission's record was written. Every case's status goes to ``_JUDGED[out]``."""

    def progress(done: int, total: int, elapsed: float) -> None:
        if finished is not None:
            finished.append(elapsed)

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    records = grade_batch(discover(paths),
                          BatchConfig(out, lessons, workers, Limits(rank_pool=rank_pool), seed=0),
                          progress, unsandboxed=unsandboxed)
    _JUDGED[out] = {student: [(t["task"], t["status"], t["score"]) for t in r["tasks"]]
                    for student, r in records.items()}
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return seconds, sum(r["score"] for r in records.values()), cpu


def _steady_rate(finished: list[float], workers: int) -> float | None:
    """Submissions a minute while every worker was busy: from the first record to the last one
    written before a worker ran out of submissions (a class's rate, which a short batch's start
    and its last lone submissions understate). None with fewer than twice as many submissions
    as workers: the workers' first records then come nearly together, and so would the span."""
    last = len(finished) - workers  # index of the last completion with every worker still busy
    if last < workers or finished[last] <= finished[0]:
        return None
    return 60 * last / (finished[last] - finished[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=3, help="full submissions per batch")
    parser.add_argument("--lessons",
                        help="only these lessons, e.g. 00,01 (default: all with checks)")
    parser.add_argument("--workers", default="1,2",
                        help="the batches' worker counts, e.g. 1,2,3 (default 1,2; the speed-up "
                             "is the last over the first)")
    parser.add_argument("--rank-pool", default="off,on",
                        help="grade without and/or with the rank pool (autograder/pool.py), side "
                             "by side: off,on (default), off or on")
    parser.add_argument("--unsandboxed", action="store_true",
                        help="as root where bubblewrap cannot make a sandbox: time the batches "
                             "anyway, unsandboxed (the submissions are the course's own solutions)")
    args = parser.parse_args()
    try:  # as root without a sandbox the batches are refused: say so before any work
        require_sandbox(args.unsandboxed)
    except SandboxUnavailable as e:
        raise SystemExit(f"grading_throughput: {e}") from None
    tmp = Path(tempfile.mkdtemp(prefix="kit-grade-bench-"))
    try:
        print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        if note := isolation_note():
            print(f"note: {note}")
        lessons = _full_submission(tmp / "alice")
        if args.lessons:
            wanted = {int(x) for x in args.lessons.split(",")}
            for nb in (tmp / "alice").glob("*.ipynb"):
                if lesson_of(nb) not in wanted:
                    nb.unlink()
            lessons = [n for n in lessons if n in wanted]
        # First, in a fresh process: what a batch computes once for all its submissions.
        start = time.perf_counter()
        expectations([t for n in lessons for t in lesson_tasks(n)], 0)
        print(f"trusted expectations, computed once per batch: {time.perf_counter() - start:.1f} s")
        per_lesson = {}
        for nb in sorted((tmp / "alice").glob("*.ipynb")):
            start = time.perf_counter()
            per_lesson[lesson_of(nb)] = (grade_notebook(nb, lessons=[lesson_of(nb)]).score,
                                         time.perf_counter() - start)
        in_process = sum(t for _, t in per_lesson.values())
        pools = [{"off": False, "on": True}[p] for p in args.rank_pool.split(",")]
        full = {}
        for pool in pools:  # side by side: the same submission without and with the rank pool
            full[pool] = _batch([tmp / "alice"], tmp / f"out-full-{pool}", lessons, 1,
                                unsandboxed=args.unsandboxed, rank_pool=pool)
        sandboxed, points, cpu = full[pools[0]]
        alone, _, _ = _batch([tmp / "alice"], tmp / "out-alone-2", lessons, 2,
                             unsandboxed=args.unsandboxed, rank_pool=pools[-1])
        print("in-process seconds per lesson (expectations already computed; "
              "autograder.grade.batch.LESSON_SECONDS): " + ", ".join(
            f"{n:02d} {t:.1f}" for n, (_, t) in sorted(per_lesson.items())))
        print(f"one full submission (lessons {','.join(f'{n:02d}' for n in lessons)}): sandboxed "
              f"{sandboxed:.1f} s ({points:g} points), in-process {in_process:.1f} s "
              f"({sum(p for p, _ in per_lesson.values()):g} points), ratio "
              f"{sandboxed / in_process:.2f}")
        for pool in pools[1:]:
            seconds, points_, cpu_ = full[pool]
            same = _JUDGED[tmp / f"out-full-{pool}"] == _JUDGED[tmp / f"out-full-{pools[0]}"]
            print(f"with the rank pool: {seconds:.1f} s ({points_:g} points), {cpu_:.1f} CPU-s: "
                  f"{seconds / sandboxed:.2f}x the time and {cpu_ / cpu:.2f}x the CPU without it; "
                  f"every task's status and score identical: {same}")
        print(f"the same submission alone with --workers 2 (its lessons split over both"
              f"{', rank pool' if pools[-1] else ''}): {alone:.1f} s")
        # A batch that keeps every core busy grades cores * 60 / cpu submissions a minute at best.
        print(f"CPU of the sandboxed submission (worker and ranks): {cpu:.1f} CPU-s, so at most "
              f"{(os.cpu_count() or 1) * 60 / cpu:.2f}/min on {os.cpu_count()} cores")

        if args.copies < 1:
            return
        copies = tmp / "copies"
        for i in range(args.copies):
            shutil.copytree(tmp / "alice", copies / f"student{i:02d}")
        rates = {}
        counts = [int(w) for w in args.workers.split(",")]
        for workers, pool in [(w, p) for w in counts for p in pools]:
            finished: list[float] = []
            seconds, _, used = _batch(sorted(copies.iterdir()), tmp / f"out-{workers}-{pool}",
                                      lessons, workers, finished, unsandboxed=args.unsandboxed,
                                      rank_pool=pool)
            rates[workers, pool] = 60 * args.copies / seconds
            steady = _steady_rate(finished, workers)
            print(f"{args.copies} full submissions, {workers} worker(s)"
                  f"{', rank pool' if pool else ''}: {seconds:.1f} s "
                  f"({rates[workers, pool]:.2f}/min; 300 students in "
                  f"{300 / rates[workers, pool] / 60:.1f} h)"
                  + (f"; steady {steady:.2f}/min while every worker was busy (300 students in "
                     f"{300 / steady / 60:.1f} h and the expectations)" if steady else ""))
            # Below cores * 60 / CPU-s: either cores stood idle or each submission cost more CPU
            # with others beside it (ranks of several workers contending for the cores).
            print(f"  CPU per submission in this batch: {used / args.copies:.1f} CPU-s; the cores "
                  f"were {100 * used / (seconds * (os.cpu_count() or 1)):.0f}% busy with its "
                  "workers")
        for pool in pools:
            print(f"speed-up with {counts[-1]} workers over {counts[0]}"
                  f"{' (rank pool)' if pool else ''}: "
                  f"{rates[counts[-1], pool] / rates[counts[0], pool]:.2f}x")
        print(f"load average now {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
