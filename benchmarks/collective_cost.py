"""What a gloo collective costs each rank, in CPU and wall milliseconds, by world size.

A check's ranks share the grading machine's cores, so every collective a check runs is paid in
CPU by every rank: this is what to weigh when choosing a check's world size and step count.
Each rank of a ``kit.launch`` group (forked, the recorder on, as in a check) runs each
collective on a 1,000-element float32 tensor ``--repeats`` times after one untimed call, and
reports its own CPU time (all its threads: Python, gloo's runloop and TCP loop) and wall time
per call; the table shows the mean over ranks.

    .venv/bin/python benchmarks/collective_cost.py [--world-sizes 2,3,4] [--repeats 200]
"""

from __future__ import annotations

import argparse
import resource
import time
from typing import Any

NUMEL = 1000
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this rank
    return usage.ru_utime + usage.ru_stime


def _costs(repeats: int) -> dict[str, tuple[float, float]]:
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    t = torch.ones(NUMEL)
    gathered, scattered = torch.empty(NUMEL * world), torch.ones(NUMEL * world)
    calls: dict[str, Any] = {
        "all_reduce": lambda: dist.all_reduce(t),
        "all_gather": lambda: dist.all_gather_into_tensor(gathered, t),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(t, scattered),
        "broadcast": lambda: dist.broadcast(t, 0),
        "barrier": dist.barrier,
    }
    out = {}
    for name in OPS:
        calls[name]()  # connections and buffers set up outside the timing
        dist.barrier()
        cpu, wall = _cpu(), time.perf_counter()
        for _ in range(repeats):
            calls[name]()
        out[name] = ((_cpu() - cpu) / repeats * 1e3, (time.perf_counter() - wall) / repeats * 1e3)
    return out


def main() -> None:
    import warnings

    from kit.launcher import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,3,4")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)  # reduce_scatter_tensor's rename
    print(f"per call, mean over ranks, {NUMEL} float32 elements: CPU ms (wall ms)")
    print("world  " + "  ".join(f"{op:>16}" for op in OPS))
    for world in (int(w) for w in args.world_sizes.split(",")):
        ranks = run_ranks(_costs, (args.repeats,), world_size=world, echo=False, timeout=300.0)
        cells = []
        for op in OPS:
            cpu = sum(r[op][0] for r in ranks) / world
            wall = sum(r[op][1] for r in ranks) / world
            cells.append(f"{cpu:6.2f} ({wall:5.2f})".rjust(16))
        print(f"{world:>5}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
