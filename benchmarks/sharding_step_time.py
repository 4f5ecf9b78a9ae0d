"""Lesson 05's sharded trainers against torch's, side by side on 4 ranks, and bytes vs formulas.

    .venv/bin/python benchmarks/sharding_step_time.py
    .venv/bin/python benchmarks/sharding_step_time.py --world-size 4 --steps 20 --dim 128

One launch. In it every rank builds the same ``TinyTransformer`` (output layer untied, same
initial weights) five times and trains the copies in turn, step by step, each step
(forward, backward, synchronisation, AdamW) started by a barrier, so a noisy neighbour slows
all of them alike:

* ``FSDP`` (the Task 5.3 solution: one unit per ``nn.Linear``/``nn.Embedding``) against torch
  FSDP2 ``fully_shard`` on the same units, and against ``fully_shard`` per transformer block
  (its usual granularity); target: the solution within 1.5x of FSDP2 on the same units;
* ``ShardedOptimizer`` (Task 5.2: reduces the gradients itself, steps the owned parameters,
  broadcasts them) against torch DDP + ``ZeroRedundancyOptimizer``; target: within 1.2x.

A step ends when its slowest rank is done: a step's time is the max over ranks; reported is
the median over steps and the ratio. After timing, rank 0's bytes of parameters, gradients
and AdamW state under DDP, the ZeRO-1 solution and the FSDP solution are counted (with the
Task 5.1 solution) and printed beside the ZeRO formulas (:mod:`kit.lessons.sharding`). Timing only:
correctness is tests/test_lesson05.py's job.
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
from torch import nn
from torch.nn import functional as F

from autograder import course
from autograder.loading import load_tasks
from kit.launcher import preload_modules, run_ranks
from kit.lessons.models import TinyTransformer, token_batch
from kit.lessons.sharding import stage_bytes

ROOT = Path(__file__).resolve().parents[1]
PAIRS = [("FSDP (solution)", "fully_shard per layer"),
         ("FSDP (solution)", "fully_shard per block"),
         ("ShardedOptimizer (solution)", "DDP + ZeroRedundancyOptimizer")]
TARGETS = {PAIRS[0]: 1.5, PAIRS[2]: 1.2}


def _model(config: dict) -> TinyTransformer:
    torch.manual_seed(0)
    model = TinyTransformer(**config)
    model.head.weight = nn.Parameter(model.tok.weight.detach().clone())  # units share nothing
    return model


def _build(name: str, solution: Any, config: dict) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = _model(config)
    if name == "FSDP (solution)":
        wrapped = solution.FSDP(model)
        return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    if name.startswith("fully_shard"):
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        units = (nn.Linear, nn.Embedding) if name.endswith("layer") else (type(model.blocks[0]),)
        for m in model.modules():
            if isinstance(m, units):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    if name == "ShardedOptimizer (solution)":
        return model, solution.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    wrapped = DistributedDataParallel(model)
    return wrapped, ZeroRedundancyOptimizer(wrapped.parameters(),
                                            optimizer_class=torch.optim.AdamW, lr=1e-3)


def _step(model: Any, optimizer: Any, x: torch.Tensor, y: torch.Tensor, zero: bool = True) -> None:
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    getattr(model, "finish_gradient_synchronization", lambda: None)()
    optimizer.step()
    if zero:
        optimizer.zero_grad()


def _bytes(solution: Any, config: dict, batch: int) -> dict[str, dict[str, int]]:
    """Rank's bytes after one AdamW step under DDP, the ZeRO-1 and the FSDP solutions."""
    from torch.nn.parallel import DistributedDataParallel

    x, y = token_batch(batch, config["context"], config["vocab"], seed=dist.get_rank())
    out = {}
    for label in ("DDP", "ZeRO-1", "FSDP"):
        model = _model(config)
        if label == "DDP":
            wrapped = DistributedDataParallel(model)
            optimizer = torch.optim.AdamW(model.parameters())
        elif label == "ZeRO-1":
            wrapped = model
            optimizer = solution.ShardedOptimizer(model.parameters(), torch.optim.AdamW)
        else:
            wrapped = solution.FSDP(model)
            optimizer = torch.optim.AdamW(wrapped.parameters())
        _step(wrapped, optimizer, x, y, zero=False)  # count the gradients too
        out[label] = solution.state_bytes(model, optimizer)
    return out


def _time_all(solution: Any, config: dict, steps: int, batch: int) -> dict[str, Any]:
    rank = dist.get_rank()
    names = list(dict.fromkeys(n for pair in PAIRS for n in pair))
    built = {n: _build(n, solution, config) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(steps + 2):  # two warm-up rounds, dropped
        x, y = token_batch(batch, config["context"], config["vocab"], seed=1000 * i + rank)
        for name in (names if i % 2 else names[::-1]):  # alternate who goes first
            dist.barrier()
            start = time.perf_counter()
            _step(*built[name], x, y)
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    return {"times": times, "bytes": _bytes(solution, config, batch)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()

    # FSDP2's DTensors import Dynamo: once here, before the ranks fork, not in every rank
    preload_modules(("torch._dynamo", "torch.distributed.fsdp"))

    solution = load_tasks(course.lesson(5).source)
    config = {"vocab": 256, "dim": args.dim, "layers": args.layers, "heads": 4, "context": 64}
    n_params = sum(p.numel() for p in _model(config).parameters())
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"Sharded step time: TinyTransformer {config}, untied ({n_params / 1e6:.2f}M "
          f"parameters), {args.batch} x {config['context']} tokens per rank, AdamW, median of "
          f"{args.steps} steps on {args.world_size} gloo ranks, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, load average {load}")
    result = run_ranks(_time_all, (solution, config, args.steps, args.batch), {},
                       world_size=args.world_size, timeout=1800, echo=False)
    names = list(result[0]["times"])
    medians = {n: statistics.median(max(r["times"][n][i] for r in result)
                                    for i in range(args.steps)) for n in names}
    print(f"{'ours':>28} {'ms/step':>8}   {'torch':>30} {'ms/step':>8} {'ratio':>6} {'target':>7}")
    for ours, theirs in PAIRS:
        ratio = medians[ours] / medians[theirs]
        target = TARGETS.get((ours, theirs))
        verdict = ("" if target is None
                   else f"<= {target}x " + ("ok" if ratio <= target else "MISSED"))
        print(f"{ours:>28} {medians[ours] * 1e3:>8.1f}   {theirs:>30} "
              f"{medians[theirs] * 1e3:>8.1f} {ratio:>5.2f}x {verdict}")
    print(f"\nbytes on rank 0 after one AdamW step (KiB), counted vs the ZeRO formula (fp32, "
          f"{args.world_size} ranks):")
    print(f"{'':8s}{'kind':>10s}{'counted':>10s}{'formula':>10s}{'ratio':>8s}")
    for stage, label in ((0, "DDP"), (1, "ZeRO-1"), (3, "FSDP")):
        formula = stage_bytes(n_params, args.world_size, stage)
        for kind, counted in result[0]["bytes"][label].items():
            print(f"{label:8s}{kind:>10s}{counted / 2**10:>10.1f}{formula[kind] / 2**10:>10.1f}"
                  f"{counted / formula[kind]:>8.3f}")


if __name__ == "__main__":
    main()
