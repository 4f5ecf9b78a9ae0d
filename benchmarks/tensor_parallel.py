"""Step time of Lesson 08's hand-built tensor-parallel MLP against torch's ``parallelize_module``.

    .venv/bin/python benchmarks/tensor_parallel.py                       # 4 ranks
    .venv/bin/python benchmarks/tensor_parallel.py --world-size 2 --steps 40 --hidden 512

One launch; in it every rank builds the same MLP (Linear(h, 4h), GELU, Linear(4h, h)) twice
from the same weights: once with the solutions' ``ColumnParallelLinear`` and
``RowParallelLinear`` (Task 8.1), once with ``parallelize_module`` and ``ColwiseParallel`` /
``RowwiseParallel`` on a CPU ``DeviceMesh`` (DTensor). It steps them in turn, step by step
(forward, backward, SGD), each step started by a barrier and the order alternating, so that a
noisy neighbour slows both alike. The input requires grad, as it does inside a model, so
backward all-reduces its gradient (f). A step ends when its slowest rank is done: the time of a
step is the max over ranks; reported are the medians and the ratio hand-built / torch (the
target is within 1.3x). A last traced step of each lists its collectives: the same two
all-reduces. Timing only: correctness is tests/test_lesson08.py's job.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from autograder import course
from autograder.loading import load_tasks
from kit.launcher import preload_modules, run_ranks
from kit.trace import trace

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["hand-built (Task 8.1)", "parallelize_module"]


def _mlp(hidden: int) -> nn.Sequential:
    torch.manual_seed(0)  # the same full weights on every rank, for both versions
    return nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _time_both(column_cls, row_cls, hidden: int, batch: int, seq: int, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    ours_full = _mlp(hidden)
    ours = nn.Sequential(column_cls(ours_full[0]), nn.GELU(), row_cls(ours_full[2]))
    theirs = _mlp(hidden)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(theirs, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    models = dict(zip(NAMES, (ours, theirs)))
    optimizers = {n: torch.optim.SGD(m.parameters(), lr=1e-3) for n, m in models.items()}
    times: dict[str, list[float]] = {n: [] for n in NAMES}
    for i in range(steps + 2):  # the first two rounds warm up both and are dropped
        x = torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(i))
        x.requires_grad_()  # as in a model: the block's input gradient goes to the layer below
        for name in NAMES if i % 2 else NAMES[::-1]:  # alternate who goes first
            dist.barrier()
            start = time.perf_counter()
            _step(models[name], optimizers[name], x)
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    calls = {}
    for name in NAMES:
        dist.barrier()
        with trace() as t:
            _step(models[name], optimizers[name], x)
        calls[name] = [(e.op, e.nbytes) for e in t.events if e.kind == "collective"]
    return {"times": times, "calls": calls}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args(argv)

    preload_modules(("torch.distributed.tensor.parallel",))  # once here, not in every forked rank

    solution = load_tasks(course.lesson(8).source)
    result = run_ranks(_time_both, (solution.ColumnParallelLinear, solution.RowParallelLinear,
                                    args.hidden, args.batch, args.seq, args.steps),
                       world_size=args.world_size, timeout=600, echo=False)
    medians = {}
    for name in NAMES:
        per_step = [max(r["times"][name][i] for r in result) for i in range(args.steps)]
        medians[name] = statistics.median(per_step)
    print(f"MLP {args.hidden} -> {4 * args.hidden} -> {args.hidden}, input ({args.batch}, "
          f"{args.seq}, {args.hidden}), {args.world_size} ranks, median of {args.steps} steps "
          f"(max over ranks)")
    for name in NAMES:
        ratio = medians[name] / medians["parallelize_module"]
        print(f"  {name:24s} {1e3 * medians[name]:7.2f} ms/step  {ratio:4.2f}x parallelize_module")
        print(f"  {'':24s} collectives of one step on rank 0: {result[0]['calls'][name]}")
    ratio = medians[NAMES[0]] / medians[NAMES[1]]
    print(f"hand-built / parallelize_module = {ratio:.2f} (target: within 1.3x)")


if __name__ == "__main__":
    main()
