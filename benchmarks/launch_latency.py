"""Launch latency: kit.launch against raw fork, mp.spawn and torchrun, side by side in one run.

Each launcher starts 4 ranks that initialise a gloo group, run one all_reduce and tear down;
we time the whole launch from the caller's side and report medians and ratios to raw fork.

    python benchmarks/launch_latency.py [--repeats 15] [--slow-repeats 3] [--world-size 4]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kit.launcher import run_ranks

RANK_SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
"""


def one_all_reduce() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raw_rank(rank: int, world_size: int, port: int) -> None:
    # What a hand-written launcher does: env:// rendezvous on a port picked up front.
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    one_all_reduce()
    dist.destroy_process_group()


def time_kit(world_size: int, recorder: bool = True) -> float:
    """kit.launch; ``recorder=False`` gives the ranks plain gloo (KIT_RECORDER=0), to measure
    what recording below Python (kit/recorder.py) costs a launch."""
    os.environ["KIT_RECORDER"] = "1" if recorder else "0"
    try:
        start = time.perf_counter()
        run_ranks(one_all_reduce, world_size=world_size, echo=False)
        return time.perf_counter() - start
    finally:
        os.environ.pop("KIT_RECORDER", None)


def time_raw(world_size: int, method: str) -> float:
    start = time.perf_counter()
    mp.start_processes(_raw_rank, args=(world_size, _free_port()), nprocs=world_size,
                       start_method=method, join=True)
    return time.perf_counter() - start


def time_torchrun(world_size: int, script: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={world_size}", script], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="runs of the fast launchers")
    parser.add_argument("--slow-repeats", type=int, default=3, help="runs of spawn and torchrun")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    n = args.world_size
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(RANK_SCRIPT)
        script = f.name
    times: dict[str, list[float]] = {"raw fork": [], "kit.launch": [], "kit, no recorder": [],
                                     "mp.spawn": [], "torchrun": []}
    time_kit(n)  # warm up imports on both sides
    time_raw(n, "fork")
    for _ in range(args.repeats):  # interleaved, so drift hits both alike
        times["raw fork"].append(time_raw(n, "fork"))
        times["kit.launch"].append(time_kit(n))
        times["kit, no recorder"].append(time_kit(n, recorder=False))
    for _ in range(args.slow_repeats):
        times["mp.spawn"].append(time_raw(n, "spawn"))
        times["torchrun"].append(time_torchrun(n, script))
    os.unlink(script)
    base = statistics.median(times["raw fork"])
    print(f"{n} ranks, init + one all_reduce + teardown; torch {torch.__version__}, "
          f"{os.cpu_count()} cores")
    print(f"{'launcher':<12} {'median s':>9} {'vs raw fork':>12}  runs")
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name] = {"median_s": med, "ratio_to_raw_fork": med / base, "runs": len(ts)}
        print(f"{name:<12} {med:>9.3f} {med / base:>11.2f}x  {len(ts)}")
    overhead = statistics.median(times["kit.launch"]) / statistics.median(times["kit, no recorder"])
    print(f"recorder overhead on a launch: {overhead:.3f}x (kit.launch / kit with plain gloo)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
