"""What kit.meter costs: a small training step and a 1 MiB allocation loop, with and without it.

Side by side in one run: (a) an MLP training step (forward, backward, SGD step: ~110 small aten
ops) and (b) a loop allocating a 1 MiB tensor per step, each timed with no meter, with the meter
imported but idle, under one ``track()`` around the block, under a ``track()`` per step, with a
``mark()`` per step, and under ``count_flops()``. "No meter" runs in a second process that never
imports ``kit.meter``; the two processes take turns block by block, so drift in the machine's
load hits both alike. Each row gives the fastest of ``--blocks`` blocks of two numbers: the
median step inside the block, and the whole block (entering and leaving the meter, folding its
events) per step; ratios are to the no-meter row.

    python benchmarks/meter_overhead.py [--blocks 15] [--steps 20]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

torch.set_num_threads(1)  # per-op overhead is the question; one thread keeps the timing steady


def mlp_step() -> Callable[[], None]:
    """One SGD step of a 6-layer, 64-wide MLP on a (32, 64) batch."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.ReLU())])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, foreach=False)
    x, y = torch.randn(32, 64), torch.randn(32, 64)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        optimizer.step()

    return step


def alloc_step() -> None:
    torch.empty(1 << 20, dtype=torch.uint8)


WORKLOADS = {"MLP training step": mlp_step(), "1 MiB allocation": alloc_step}


def count_ops(step: Callable[[], None]) -> int:
    """Aten ops one step dispatches (forward, backward and optimizer)."""
    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return Count.n


def run_block(step: Callable[[], None], steps: int,
              around_block: Callable[[], AbstractContextManager],
              around_step: Callable[[Any], AbstractContextManager]) -> tuple[float, float]:
    """(median seconds of one step, seconds of the whole block per step)."""
    times = []
    start = time.perf_counter()
    with around_block() as meter_object:
        for _ in range(steps):
            t0 = time.perf_counter()
            with around_step(meter_object):
                step()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), (time.perf_counter() - start) / steps


def plain_block(name: str, steps: int) -> tuple[float, float]:
    return run_block(WORKLOADS[name], steps, nullcontext, lambda _: nullcontext())


def worker(steps: int) -> None:
    """The no-meter process: one plain block per request line on stdin."""
    for line in sys.stdin:
        median, whole = plain_block(line.strip(), steps)
        print(median, whole, flush=True)


class Marking:
    """Around a step: a ``mark()`` on the enclosing track after it."""

    def __init__(self, usage: Any) -> None:
        self.usage = usage

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.usage.mark(f"step {len(self.usage.marks)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.steps)
    plain = subprocess.Popen([sys.executable, __file__, "--worker", "--steps", str(args.steps)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def no_meter(name: str) -> tuple[float, float]:
        plain.stdin.write(name + "\n")
        plain.stdin.flush()
        median, whole = plain.stdout.readline().split()
        return float(median), float(whole)

    meter = importlib.import_module("kit.meter")
    configs: dict[str, Callable[[str], tuple[float, float]]] = {
        "no meter": no_meter,
        "imported, idle": lambda name: plain_block(name, args.steps),
        "one track() per block": lambda name: run_block(
            WORKLOADS[name], args.steps, meter.track, lambda _: nullcontext()),
        "one track() per step": lambda name: run_block(
            WORKLOADS[name], args.steps, nullcontext, lambda _: meter.track()),
        "a mark() per step": lambda name: run_block(WORKLOADS[name], args.steps, meter.track,
                                                    Marking),
        "count_flops()": lambda name: run_block(
            WORKLOADS[name], args.steps, meter.count_flops, lambda _: nullcontext()),
    }
    best: dict[tuple[str, str], tuple[float, float]] = {}
    for round_ in range(3 + args.blocks):  # 3 warm-up rounds: first calls of every kernel
        for name in WORKLOADS:
            for config, run in configs.items():
                median, whole = run(name)
                if round_ >= 3:
                    old = best.get((name, config), (float("inf"), float("inf")))
                    best[name, config] = (min(old[0], median), min(old[1], whole))
    plain.stdin.close()
    plain.wait()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread, fastest of "
          f"{args.blocks} blocks of {args.steps} steps; MLP step = "
          f"{count_ops(WORKLOADS['MLP training step'])} aten ops")
    for name in WORKLOADS:
        base_median, base_whole = best[name, "no meter"]
        print(f"\n{name:<24} {'step (median)':>22} {'whole block / step':>24}")
        for config in configs:
            median, whole = best[name, config]
            print(f"  {config:<22} {median * 1e6:9.1f} us {median / base_median:6.2f}x"
                  f" {whole * 1e6:11.1f} us {whole / base_whole:6.2f}x")


if __name__ == "__main__":
    main()
