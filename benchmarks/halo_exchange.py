"""One GCN layer's communication: the halo exchange of Lesson 11 against an all-gather of the
feature matrix, bytes and time per rank, side by side.

    .venv/bin/python benchmarks/halo_exchange.py                       # 2 and 4 ranks
    .venv/bin/python benchmarks/halo_exchange.py --nodes 400000 --hidden 128 --world-sizes 2 4 8

On a generated power-law graph (``kit.lessons.graphs.power_law_graph``) partitioned by METIS
and at random, every rank holds its own rows of a (N, hidden) float32 feature matrix and
needs the rows of its halo. Two ways to get them, each timed over ``--repeats`` calls after a
barrier (the slowest rank's median counts) and counted by the recorder (bytes each rank sends):

* **halo**: the lesson's plan (``halo_plan``, built once) and one ``all_to_all_single`` of
  uneven splits carrying only the rows each rank asked for, as ``HaloGCNConv`` does;
* **all-gather**: ``all_gather_into_tensor`` of every rank's rows (padded to the largest part),
  the full matrix on every rank.

Reported per world size and partition: halo rows, MiB sent per rank, median seconds, and the
all-gather's bytes and time as multiples of the halo's. Ranks share the machine's cores and
talk over loopback, so times are a laptop's, but the ratio of bytes is the network's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from autograder import course
from autograder.loading import load_tasks
from kit.launcher import run_ranks
from kit.lessons.graphs import local_graph, metis_partition, power_law_graph, random_partition

ROOT = Path(__file__).resolve().parents[1]


def _exchange(halo_plan, part, edge_index, hidden: int, repeats: int) -> dict:
    from kit.trace import trace

    torch.set_num_threads(1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    lg = local_graph(edge_index, part, rank)
    plan = halo_plan(part, lg.edge_index, rank)
    x = torch.randn(lg.own.numel(), hidden)
    send_rows = torch.searchsorted(lg.own, torch.cat(plan.send))
    recv_sizes, send_sizes = [len(t) for t in plan.recv], [len(t) for t in plan.send]
    sizes = torch.bincount(part, minlength=world_size)
    most = int(sizes.max())

    def halo():
        out = x.new_empty(sum(recv_sizes), hidden)
        dist.all_to_all_single(out, x[send_rows], recv_sizes, send_sizes)
        return out

    def gather():
        padded = torch.cat([x, x.new_zeros(most - x.shape[0], hidden)])
        out = x.new_empty(world_size * most, hidden)
        dist.all_gather_into_tensor(out, padded)
        return out

    result = {}
    for name, fn in (("halo", halo), ("all-gather", gather)):
        fn()  # warm-up
        times = []
        with trace() as t:
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
        sent = [e.nbytes for e in t.events if e.op != "barrier"]
        # all_gather_into_tensor's event counts the gathered output: a rank's share goes to
        # every other rank, (W - 1) / W of it; all_to_all_single's counts what this rank sends
        per_call = sent[0] * (world_size - 1) / world_size if name == "all-gather" else sent[0]
        result[name] = {"bytes": per_call, "seconds": statistics.median(times)}
    result["halo rows"] = sum(recv_sizes)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=200_000)
    parser.add_argument("--degree", type=float, default=10.0)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)

    lesson = load_tasks(course.lesson(11).source)
    data = power_law_graph(args.nodes, args.degree)
    print(f"power-law graph: {data.num_nodes:,} nodes, {data.edge_index.shape[1]:,} edges, "
          f"hidden {args.hidden} (float32); per rank, median of {args.repeats} calls")
    print(f"{'ranks':>5s} {'partition':9s} {'halo rows':>10s} {'halo MiB':>9s} {'halo s':>8s} "
          f"{'gather MiB':>11s} {'gather s':>9s} {'bytes x':>8s} {'time x':>7s}")
    for world_size in args.world_sizes:
        for method in ("METIS", "random"):
            part = (metis_partition(data.edge_index, data.num_nodes, world_size)
                    if method == "METIS"
                    else random_partition(data.num_nodes, world_size))
            ranks = run_ranks(_exchange, (lesson.halo_plan, part, data.edge_index, args.hidden,
                                          args.repeats), world_size=world_size, timeout=600,
                              echo=False)
            halo = max(r["halo"]["bytes"] for r in ranks)
            halo_s = max(r["halo"]["seconds"] for r in ranks)
            gather = max(r["all-gather"]["bytes"] for r in ranks)
            gather_s = max(r["all-gather"]["seconds"] for r in ranks)
            print(f"{world_size:5d} {method:9s} {max(r['halo rows'] for r in ranks):10,d} "
                  f"{halo / 2**20:9.2f} {halo_s:8.4f} {gather / 2**20:11.2f} {gather_s:9.4f} "
                  f"{gather / max(halo, 1):7.2f}x {gather_s / max(halo_s, 1e-9):6.2f}x")


if __name__ == "__main__":
    main()
