"""Step time of Lesson 04's three data-parallel wrappers and torch DDP on a small transformer.

    .venv/bin/python benchmarks/ddp_step_time.py                      # 2 and 4 ranks
    .venv/bin/python benchmarks/ddp_step_time.py --world-sizes 2 --steps 20 --timeline t.png

One launch per world size; in it every rank builds four copies of the same ``TinyTransformer``
(same initial weights), wraps them in ``NaiveDDP``, ``OverlappedDDP``, ``BucketedDDP`` (the
solutions) and ``torch.nn.parallel.DistributedDataParallel``, and steps them in turn, step by
step, each step (forward, backward, synchronisation, SGD) started by a barrier, so a noisy
neighbour slows all four alike. A step ends when its slowest rank is done: the time of a step
is the max over ranks; reported is the median over steps, and the ratio to torch DDP (the
target for ``BucketedDDP`` is within 1.2x). ``BucketedDDP`` and torch DDP use the same bucket
cap. A last, traced step of each wrapper counts its all-reduces and how many of them started
before backward returned (the overlap); ``--timeline`` draws those steps. Timing only:
correctness is tests/test_lesson04.py's job.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

from autograder import course
from autograder.loading import load_tasks
from kit.launcher import run_ranks
from kit.lessons.models import TinyTransformer, token_batch
from kit.trace import region, trace

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["NaiveDDP", "OverlappedDDP", "BucketedDDP", "torch DDP"]


def _step(ddp, optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    with region("forward"):
        loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())  # mean over (B * T) tokens
    with region("backward"):
        loss.backward()
    with region("synchronise"):
        getattr(ddp, "finish_gradient_synchronization", lambda: None)()
    optimizer.step()
    optimizer.zero_grad()


def _time_all(wrappers: dict, config: dict, steps: int, batch: int, cap_mb: float) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    models = {}
    for name in NAMES:
        torch.manual_seed(0)  # the same initial weights for all four
        model = TinyTransformer(**config)
        if name == "torch DDP":
            models[name] = DistributedDataParallel(model, bucket_cap_mb=cap_mb)
        elif name == "BucketedDDP":
            models[name] = wrappers[name](model, bucket_size_mb=cap_mb)
        else:
            models[name] = wrappers[name](model)
    optimizers = {n: torch.optim.SGD(m.parameters(), lr=0.01) for n, m in models.items()}
    times: dict[str, list[float]] = {n: [] for n in NAMES}
    for i in range(steps + 2):  # the first two rounds warm up every wrapper and are dropped
        x, y = token_batch(batch, config["context"], config["vocab"], seed=1000 * i + rank)
        order = NAMES if i % 2 else NAMES[::-1]  # alternate who goes first
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            _step(models[name], optimizers[name], x, y)
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    traced = {}
    for name in NAMES:
        x, y = token_batch(batch, config["context"], config["vocab"], seed=rank)
        dist.barrier()
        with trace() as t:
            _step(models[name], optimizers[name], x, y)
        traced[name] = [e.to_dict() for e in t.events]
    return {"times": times, "events": traced}


def _overlap(events: list[dict]) -> tuple[int, int]:
    """(all-reduces started before backward returned, all all-reduces) in one traced step."""
    backward_end = next(e["end"] for e in events if e["op"] == "backward")
    calls = [e for e in events if e["op"] == "all_reduce"]
    return sum(e["start"] < backward_end for e in calls), len(calls)


PHASE_COLOURS = {"forward": "tab:green", "backward": "tab:orange", "synchronise": "tab:red"}


def _plot(runs: dict[int, list], path: str) -> None:
    """One panel per wrapper: each rank's phases as bars, a blue tick where an all-reduce starts.

    An async all-reduce is drawn where it was started (the tracer knows when it was waited for,
    not when the network finished). torch DDP all-reduces from C++: only its phases show.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    world_size = min(runs)
    fig, axes = plt.subplots(len(NAMES), 1, figsize=(10, 0.9 + 0.45 * world_size * len(NAMES)))
    for ax, name in zip(axes, NAMES):
        lanes = [r["events"][name] for r in runs[world_size]]
        t0 = min(e["start"] for lane in lanes for e in lane)
        for rank, lane in enumerate(lanes):
            for e in lane:
                x = 1e3 * (e["start"] - t0)
                if e["kind"] == "region":
                    ax.barh(rank, 1e3 * (e["end"] - e["start"]), left=x, height=0.5,
                            color=PHASE_COLOURS[e["op"]], label=e["op"] if rank == 0 else None)
                elif e["op"] == "all_reduce":
                    ax.plot([x, x], [rank - 0.4, rank + 0.4], color="tab:blue", lw=1)
        ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)])
        ax.invert_yaxis()
        ax.set_title(f"{name}, {world_size} ranks (blue ticks: all-reduces start)",
                     fontsize="medium")
        ax.set_xlabel("time (ms)")
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"timeline of one traced step per wrapper: {path}")


def _time_ops(n_ops: int) -> dict:
    """Seconds per call of a 1-element all-reduce and a 1 MiB one (the cost that does not
    scale with bytes, and a bucket's), each the fastest of 10 blocks of ``n_ops`` calls: with
    two ranks on two cores, small-message latency jumps between ~100 and ~200 us from one
    launch to the next (whether a rank spins or sleeps), and the minimum is what is left
    when that noise is not."""
    out = {}
    for label, numel in (("1 element", 1), ("1 MiB", 2**18)):
        t = torch.ones(numel)
        dist.barrier()
        blocks = []
        for _ in range(10):
            start = time.perf_counter()
            for _ in range(n_ops):
                dist.all_reduce(t)
            blocks.append((time.perf_counter() - start) / n_ops)
        out[label] = min(blocks)
    return out


def _launch_as(mode: str, fn: Any, args: tuple, world_size: int, timeout: float) -> Any:
    """``run_ranks`` with the recorder (``mode == "recorder"``) or with plain gloo."""
    os.environ["KIT_RECORDER"] = "1" if mode == "recorder" else "0"
    try:
        return run_ranks(fn, args, {}, world_size=world_size, timeout=timeout, echo=False)
    finally:
        os.environ.pop("KIT_RECORDER", None)


def _recorder_overhead(wrappers: dict, config: dict, args: Any) -> None:
    """Median step time with the recorder / with plain gloo, per wrapper, launches alternating.

    The spread is the ratio of the quartiles: recorder Q1 / plain Q3 to recorder Q3 / plain Q1.
    """
    rounds = args.rounds
    print(f"{'ranks':>5} {'wrapper':>14}  recorder / plain gloo (median, quartile spread), "
          f"launches alternating: {rounds} of each mode for the steps, {2 * rounds} for the "
          f"per-call rows")
    for world_size in args.world_sizes:
        steps: dict[str, dict[str, list[float]]] = {"recorder": {n: [] for n in NAMES},
                                                    "plain gloo": {n: [] for n in NAMES}}
        for i in range(2 * rounds):
            mode = "recorder" if i % 2 == 0 else "plain gloo"
            result = _launch_as(mode, _time_all, (wrappers, config, args.steps, args.batch,
                                                  args.bucket_mb), world_size, timeout=900)
            for n in NAMES:
                steps[mode][n] += [max(r["times"][n][s] for r in result) for s in range(args.steps)]
        ops: dict[str, list[dict]] = {"recorder": [], "plain gloo": []}
        for i in range(4 * rounds):  # per call: a cost that step-time noise cannot hide
            mode = "recorder" if i % 2 == 0 else "plain gloo"
            ops[mode] += list(_launch_as(mode, _time_ops, (100,), world_size, timeout=300))
        for label in ("1 element", "1 MiB"):
            rec = statistics.median(r[label] for r in ops["recorder"])
            plain = statistics.median(r[label] for r in ops["plain gloo"])
            print(f"{world_size:>5} {'all_reduce ' + label:>24}  {rec / plain:.3f}x, "
                  f"{rec * 1e6:.0f} vs {plain * 1e6:.0f} us/call ({(rec - plain) * 1e6:+.0f} us)")
        for n in NAMES:
            rec, plain = steps["recorder"][n], steps["plain gloo"][n]
            r1, r2, r3 = statistics.quantiles(rec, n=4)
            p1, p2, p3 = statistics.quantiles(plain, n=4)
            print(f"{world_size:>5} {n:>14}  {r2 / p2:.3f}x ({r1 / p3:.2f}-{r3 / p1:.2f}), "
                  f"{r2 * 1e3:.1f} vs {p2 * 1e3:.1f} ms/step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--timeline", help="write a PNG timeline of one step of each wrapper")
    parser.add_argument("--rounds", type=int, default=3,
                        help="with --recorder-overhead: launches of each mode, alternating")
    parser.add_argument("--recorder-overhead", action="store_true",
                        help="instead: time each wrapper with the recorder (kit/recorder.py) and "
                             "with plain gloo, alternating launches, and print the ratios")
    args = parser.parse_args()

    solution = load_tasks(course.lesson(4).source)
    wrappers = {n: getattr(solution, n) for n in NAMES[:3]}
    config = {"vocab": 256, "dim": 128, "layers": 4, "heads": 4, "context": 64}
    n_params = sum(p.numel() for p in TinyTransformer(**config).parameters())
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"DDP step time: TinyTransformer {config} ({n_params / 1e6:.2f}M parameters, "
          f"{4 * n_params / 2**20:.1f} MiB of fp32 gradients), {args.batch} x {config['context']} "
          f"tokens per rank, buckets of {args.bucket_mb:g} MiB, median of {args.steps} steps, "
          f"gloo, torch {torch.__version__}, {os.cpu_count()} CPUs, load average {load}")
    if args.recorder_overhead:
        _recorder_overhead(wrappers, config, args)
        return
    print(f"{'ranks':>5} {'wrapper':>14} {'ms/step':>9} {'vs torch DDP':>13} "
          f"{'all-reduces':>12} {'started in backward':>20}")
    runs = {}
    for world_size in args.world_sizes:
        result = run_ranks(_time_all, (wrappers, config, args.steps, args.batch, args.bucket_mb),
                           {}, world_size=world_size, timeout=900, echo=False)
        runs[world_size] = list(result)
        medians = {n: statistics.median(max(r["times"][n][i] for r in result)
                                        for i in range(args.steps)) for n in NAMES}
        for name in NAMES:
            started, total = _overlap(result[0]["events"][name])
            counted = f"{total:>12d} {started:>20d}" if name != "torch DDP" else \
                f"{'(in C++)':>12} {'':>20}"
            print(f"{world_size:>5} {name:>14} {medians[name] * 1e3:>9.1f} "
                  f"{medians[name] / medians['torch DDP']:>12.2f}x {counted}")
    if args.timeline:
        _plot(runs, args.timeline)


if __name__ == "__main__":
    main()
