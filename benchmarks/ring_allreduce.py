"""Lesson 01's ring all-reduce (the solution) against gloo's own dist.all_reduce, side by side.

    .venv/bin/python benchmarks/ring_allreduce.py                 # 4 ranks, 1 / 16 / 64 MB
    .venv/bin/python benchmarks/ring_allreduce.py --sizes-mb 16 --repeats 15

Both run in the same launch on the same float32 buffers, alternating call by call (so a noisy
neighbour slows both alike), each call started by a barrier. Reported: the median seconds of
each, their ratio (ring / gloo: 1.0 means as fast, the target is within 1.25x), and the bus
bandwidth 2(p-1)/p * bytes / seconds. Timing only: correctness is tests/test_lesson01.py's job.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from autograder import course
from autograder.loading import load_tasks
from kit.launcher import run_ranks
from kit.lessons import costmodel

ROOT = Path(__file__).resolve().parents[1]


def _time_both(ring_all_reduce, sizes_mb: list[float],
               repeats: int) -> dict[float, dict[str, list[float]]]:
    times: dict[float, dict[str, list[float]]] = {}
    for mb in sizes_mb:
        buffer = torch.ones(int(mb * 2**20) // 4)  # float32
        row = times.setdefault(mb, {"ring": [], "gloo": []})
        for i in range(repeats + 1):  # the first round warms up both and is dropped
            order = [("ring", ring_all_reduce), ("gloo", dist.all_reduce)]
            for name, op in order if i % 2 else order[::-1]:  # alternate who goes first
                dist.barrier()
                start = time.perf_counter()
                op(buffer)
                if i:
                    row[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()

    ring_all_reduce = load_tasks(course.lesson(1).source).ring_all_reduce
    result = run_ranks(_time_both, (ring_all_reduce, args.sizes_mb, args.repeats), {},
                       world_size=args.world_size, timeout=600, echo=False)
    p = args.world_size
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"ring_all_reduce (Lesson 01 solution) vs gloo dist.all_reduce, {p} ranks, float32, "
          f"median of {args.repeats}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"load average {load} (other work on the CPUs slows both, not always alike)")
    print(f"{'size':>8} {'ring ms':>9} {'gloo ms':>9} {'ring/gloo':>10} {'ring busbw':>11} "
          f"{'gloo busbw':>11}")
    for mb in args.sizes_mb:
        # a collective ends when its slowest rank is done: take the max over ranks per call
        ring = statistics.median(max(r[mb]["ring"][i] for r in result) for i in range(args.repeats))
        gloo = statistics.median(max(r[mb]["gloo"][i] for r in result) for i in range(args.repeats))
        nbytes = int(mb * 2**20) // 4 * 4
        bus = [costmodel.bus_bandwidth("all_reduce", nbytes, s, p) / 1e9 for s in (ring, gloo)]
        print(f"{mb:>6g}MB {ring * 1e3:>9.2f} {gloo * 1e3:>9.2f} {ring / gloo:>9.2f}x "
              f"{bus[0]:>8.2f}GB/s {bus[1]:>8.2f}GB/s")


if __name__ == "__main__":
    main()
