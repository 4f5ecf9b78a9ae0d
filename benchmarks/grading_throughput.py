"""Batch grading speed: one full submission of every lesson, and throughput with 1 vs 2 workers.

    .venv/bin/python benchmarks/grading_throughput.py                 # full submission + 6 x Lesson 00
    .venv/bin/python benchmarks/grading_throughput.py --copies 10

Submissions are the lessons' solutions as notebooks (every check runs to the end, the slow
path). Reported, measured in this one run on this machine:

* the wall time of ``kit grade`` on one submission of every lesson with checks, sandboxed,
  against the same notebooks checked in this process with no sandbox (the trusting
  ``kit grade NOTEBOOK`` path): the sandbox's overhead as a ratio;
* submissions per minute for ``--copies`` Lesson 00 submissions with ``--workers 1`` and
  ``--workers 2``, and their ratio (2 workers / 1 worker; 2.0 would be perfect scaling).

Each batch grades into a fresh output folder, so nothing is resumed. Timing only: correctness
is tests/test_grading*.py's job.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from autograder.build import render, source_notebook
from autograder.grade.batch import BatchConfig, grade_batch
from autograder.grade.notebook import grade_notebook
from autograder.grade.sandbox import Limits, isolation_note
from autograder.grade.submissions import discover
from autograder.loading import lesson_of

ROOT = Path(__file__).resolve().parents[1]


def _full_submission(folder: Path) -> list[int]:
    folder.mkdir(parents=True)
    lessons = []
    for source in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.py")):
        if (ROOT / "autograder" / f"lesson{lesson_of(source):02d}.py").exists():
            (folder / f"{source.stem}.ipynb").write_text(render(source_notebook(source)))
            lessons.append(lesson_of(source))
    return lessons


def _batch(paths: list[Path], out: Path, lessons: list[int], workers: int) -> tuple[float, float]:
    """(seconds, total score of all submissions)."""
    start = time.perf_counter()
    records = grade_batch(discover(paths), BatchConfig(out, lessons, workers, Limits(), seed=0))
    return time.perf_counter() - start, sum(r["score"] for r in records.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=6, help="Lesson 00 submissions per batch")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kit-grade-bench-"))
    try:
        print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        if note := isolation_note():
            print(f"note: {note}")
        lessons = _full_submission(tmp / "alice")
        in_process = time.perf_counter()
        scores = [grade_notebook(nb, lessons=[lesson_of(nb)]).score for nb in sorted((tmp / "alice").glob("*.ipynb"))]
        in_process = time.perf_counter() - in_process
        sandboxed, points = _batch([tmp / "alice"], tmp / "out-full", lessons, 1)
        print(f"one full submission (lessons {','.join(f'{n:02d}' for n in lessons)}): sandboxed "
              f"{sandboxed:.1f} s ({points:g} points), in-process {in_process:.1f} s ({sum(scores):g} points), "
              f"ratio {sandboxed / in_process:.2f}")

        copies = tmp / "copies"
        copies.mkdir()
        for i in range(args.copies):
            shutil.copy(tmp / "alice" / "00_launching_ranks.ipynb", copies / f"student{i:02d}.ipynb")
        one, _ = _batch([copies], tmp / "out-1", [0], 1)
        two, _ = _batch([copies], tmp / "out-2", [0], 2)
        print(f"{args.copies} Lesson 00 submissions: 1 worker {one:.1f} s ({60 * args.copies / one:.1f}/min), "
              f"2 workers {two:.1f} s ({60 * args.copies / two:.1f}/min), speed-up {one / two:.2f}x; "
              f"load average now {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
