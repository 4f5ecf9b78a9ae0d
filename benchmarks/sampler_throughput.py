"""Neighbour-sampling throughput: Lesson 11's sampler against a per-node loop and PyG's own.

    .venv/bin/python benchmarks/sampler_throughput.py                      # 200k nodes
    .venv/bin/python benchmarks/sampler_throughput.py --nodes 1000000 --fanouts 15 10 5

On a generated power-law graph (``kit.lessons.graphs.power_law_graph``), one thread, the same
seed batches for every sampler: the lesson's solution (``sample_neighbors``, the whole frontier
drawn at once by Floyd's method), the same function inside PyG's ``NodeLoader`` (through
``FunctionSampler``: what a training loop pays), the trusted per-node loop
(``autograder.references.lesson11.sample_neighbors``, the obvious first version) and, where
``pyg-lib`` or ``torch-sparse`` is installed, PyG's ``NeighborLoader`` (C++). Reported: seeds
per second (median of ``--rounds`` interleaved passes) and the ratio to the solution, all in
one run, side by side. The loop runs on fewer batches (it is slow); its rate is per batch alike.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from autograder import course
from autograder.loading import load_tasks
from autograder.references.lesson11 import sample_neighbors as loop_sampler
from kit.lessons.graphs import FunctionSampler, in_neighbour_csr, power_law_graph, pyg_lib_available

ROOT = Path(__file__).resolve().parents[1]


def _rate(run, batches: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for seeds in batches:
        run(seeds)
    return sum(b.numel() for b in batches) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=200_000)
    parser.add_argument("--degree", type=float, default=10.0)
    parser.add_argument("--fanouts", type=int, nargs="+", default=[10, 5])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    lesson = load_tasks(course.lesson(11).source)
    data = power_law_graph(args.nodes, args.degree)
    rowptr, col = in_neighbour_csr(data.edge_index, data.num_nodes)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randperm(data.num_nodes, generator=g)[:args.batch]
               for _ in range(args.batches)]
    fanouts = list(args.fanouts)

    from torch_geometric.loader import NodeLoader
    from torch_geometric.sampler import NodeSamplerInput

    adapter = FunctionSampler(lesson.sample_neighbors, data, fanouts,
                              torch.Generator().manual_seed(1))
    node_loader = NodeLoader(data, node_sampler=adapter, input_nodes=torch.cat(batches),
                             batch_size=args.batch)
    samplers = {
        "solution (frontier at once)":
            lambda s: lesson.sample_neighbors(rowptr, col, s, fanouts, g),
        "per-node loop": lambda s: loop_sampler(rowptr, col, s, fanouts, g),
    }
    if pyg_lib_available():
        from torch_geometric.sampler import NeighborSampler

        pyg = NeighborSampler(data, fanouts)
        samplers["PyG NeighborLoader (pyg-lib)"] = lambda s: pyg.sample_from_nodes(
            NodeSamplerInput(input_id=None, node=s))
    rates: dict[str, list[float]] = {name: [] for name in samplers}
    rates["solution in PyG's NodeLoader"] = []
    for _ in range(args.rounds):
        for name, run in samplers.items():
            todo = batches[:2] if name == "per-node loop" else batches
            rates[name].append(_rate(run, todo))
        start = time.perf_counter()
        for _batch in node_loader:  # sampling plus slicing x and y by n_id: a training loop's cost
            pass
        rates["solution in PyG's NodeLoader"].append(args.batch * len(batches)
                                                     / (time.perf_counter() - start))

    nodes = statistics.mean(lesson.sample_neighbors(rowptr, col, b, fanouts, g).n_id.numel()
                            for b in batches[:5])
    print(f"power-law graph: {data.num_nodes:,} nodes, {data.edge_index.shape[1]:,} edges; "
          f"batches of {args.batch} seeds, fan-outs {fanouts} (~{nodes:,.0f} nodes a batch); "
          "one thread")
    best = statistics.median(rates["solution (frontier at once)"])
    print(f"{'sampler':32s} {'seeds/s':>10s} {'vs solution':>12s}")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"{name:32s} {rate:10,.0f} {rate / best:11.2f}x")
    if not pyg_lib_available():
        print("PyG NeighborLoader: skipped, pyg-lib (or torch-sparse) is not importable here "
              "(kit doctor says how to install it)")


if __name__ == "__main__":
    main()
