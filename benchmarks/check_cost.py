"""What a lesson's checks cost: rank launches and wall time of ``run_checks`` on its solutions.

Runs every task of the chosen lessons on the solutions, in this process, as ``check()`` does
in a notebook (the trusted expectations included, computed on first use), and counts the
launches of ranks (``kit.launch``/``run_ranks``) and of ``torchrun`` processes, and the CPU
seconds spent by this process and the ranks (above the wall time where ranks ran in parallel:
what a grading batch pays per submission). Shared runs should make launches per task close to
the number of distinct runs a task needs.

    .venv/bin/python benchmarks/check_cost.py               # every lesson
    .venv/bin/python benchmarks/check_cost.py 5 6 --json out.json
    .venv/bin/python benchmarks/check_cost.py --warm       # what each submission pays in a batch
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cpu_seconds() -> tuple[float, float]:
    """(user, system) CPU seconds of this process and of its children that were waited for
    (the ranks and torchrun processes a check starts)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + kids.ru_utime, me.ru_stime + kids.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("lessons", nargs="*", type=int)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--warm", action="store_true",
                        help="run every task once untimed first: the timed pass then costs what a "
                             "grading batch pays per submission (expectations already computed)")
    args = parser.parse_args()

    import kit.launcher
    from autograder import course
    from autograder.checking import run_checks
    from autograder.loading import load_tasks
    from autograder.registry import fresh_runs, lesson_tasks

    counts = {"launches": 0, "torchrun": 0}
    validate = kit.launcher._validate

    def counted_validate(*a, **k):
        counts["launches"] += 1
        return validate(*a, **k)

    popen = subprocess.Popen.__init__

    def counted_popen(self, cmd, *a, **k):
        text = " ".join(map(str, cmd)) if isinstance(cmd, (list, tuple)) else str(cmd)
        if "torch.distributed.run" in text or "torchrun" in text:
            counts["torchrun"] += 1
        return popen(self, cmd, *a, **k)

    kit.launcher._validate = counted_validate
    subprocess.Popen.__init__ = counted_popen
    sources = {spec.number: spec.source for spec in course.LESSONS}
    rows = []
    for lesson in args.lessons or sorted(sources):
        module = load_tasks(sources[lesson])
        if args.warm:
            for task in lesson_tasks(lesson):
                run_checks(task.id, getattr(module, task.name))
            fresh_runs()  # keep the expectations, not the shared runs of this implementation
        for task in lesson_tasks(lesson):
            before = dict(counts)
            cpu_before = _cpu_seconds()
            start = time.perf_counter()
            report = run_checks(task.id, getattr(module, task.name))
            seconds = time.perf_counter() - start
            cpu = [after - was for after, was in zip(_cpu_seconds(), cpu_before)]
            row = {"task": task.id, "cases": len(task.cases), "seconds": round(seconds, 2),
                   "cpu": round(cpu[0] + cpu[1], 2), "sys": round(cpu[1], 2),
                   "launches": counts["launches"] - before["launches"],
                   "torchrun": counts["torchrun"] - before["torchrun"],
                   "score": f"{report.score:g}/{report.max_score:g}"}
            rows.append(row)
            print(f"{row['task']:>5}  {row['cases']:>3} cases  {row['seconds']:>6.2f} s  "
                  f"{row['cpu']:>6.2f} cpu-s ({row['sys']:.2f} sys)  "
                  f"{row['launches']:>3} launches  {row['torchrun']:>2} torchrun  {row['score']}",
                  flush=True)
    by_lesson: dict[int, dict[str, float]] = {}
    for row in rows:
        agg = by_lesson.setdefault(int(row["task"].split(".")[0]),
                                   dict.fromkeys(("seconds", "cpu", "sys", "launches", "torchrun",
                                                  "cases"), 0))
        for key in agg:
            agg[key] += row[key]
    print("\nlesson  cases  seconds  cpu-s (sys)  launches  torchrun")
    for lesson, agg in sorted(by_lesson.items()):
        print(f"{lesson:>6}  {agg['cases']:>5}  {agg['seconds']:>7.1f}  {agg['cpu']:>5.1f} "
              f"({agg['sys']:>4.1f})  {agg['launches']:>8}  {agg['torchrun']:>8}")
    if args.json:
        args.json.write_text(json.dumps({"tasks": rows, "lessons": by_lesson}, indent=1))
    sys.exit(0)


if __name__ == "__main__":
    main()
