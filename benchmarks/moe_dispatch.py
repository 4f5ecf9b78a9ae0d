"""Lesson 13's expert-parallel layer against one process, and all-to-all dispatch against
all-gather.

    .venv/bin/python benchmarks/moe_dispatch.py                        # 4 ranks, 8 experts, top-2
    .venv/bin/python benchmarks/moe_dispatch.py --world-size 2 --steps 20 --d-model 512 --k 1

One launch; every rank builds the same router and its E/W experts from per-expert seeds, and
the same step (forward, backward of a sum of squares) runs three ways, in turn, each step started
by a barrier and the order rotating so that a noisy neighbour slows all alike:

* **all-to-all**: the solutions' ``ExpertParallelMoE`` (Task 13.3): one all-to-all of counts,
  the kept rows out, the results back (and the mirror in backward);
* **all-gather**: every rank gathers every rank's tokens (``all_gather_tensor_autograd``), routes
  them all with their own rank's capacity, runs its experts' share of every token and returns
  the shares with a reduce-scatter (its backward: a reduce-scatter and an all-gather);
* **one process**: rank 0 alone runs every expert on every rank's tokens (routed rank by rank,
  so with the same capacities) while the others wait: the lesson's single-process ``MoELayer``.

A step's time is the slowest rank's (for one process: rank 0's); reported are medians over the
steps and the ratio to the all-to-all, with the bytes each variant's collectives carried on rank
0 in a last traced step (the recorder's counts: the rows a rank hands to each collective). The
two distributed variants are checked against each other first. Timing only: correctness is
tests/test_lesson13.py's job. On a laptop the ranks share a few cores, so the distributed
variants gain little over one process; the bytes are what carry over to a cluster.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from autograder import course
from autograder.loading import definitions_only, load_tasks, read_cells
from kit.launcher import preload_modules, run_ranks
from kit.lessons.moe import expert_range, make_experts, make_router, skewed_tokens
from kit.trace import trace

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["all-to-all (Task 13.3)", "all-gather", "one process"]


class AllGatherMoE(nn.Module):
    """Dispatch by all-gather: every token everywhere, each rank's experts' share
    reduce-scattered."""

    def __init__(self, route, router, experts_local, k, capacity_factor):
        super().__init__()
        self.route, self.router, self.experts = route, router, experts_local
        self.k, self.capacity_factor = k, capacity_factor
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.num_experts = len(experts_local) * self.world_size

    def forward(self, x):
        import torch.distributed._functional_collectives as funcol

        W, (T, d) = self.world_size, x.shape
        sizes = [None] * W
        dist.all_gather_object(sizes, T)  # tokens per rank: each rank's capacity depends on it
        padded = torch.cat([x, x.new_zeros(max(sizes) - T, d)])
        everyone = funcol.all_gather_tensor_autograd(padded, 0, dist.group.WORLD)  # (W*T', d)
        share = torch.zeros_like(everyone)
        first = self.rank * len(self.experts)
        for r, xs in enumerate(everyone.split(max(sizes))):
            xs = xs[:sizes[r]]
            cap = math.ceil(self.k * sizes[r] * self.capacity_factor / self.num_experts)
            routing = self.route(self.router(xs), self.k, cap)
            for i, expert in enumerate(self.experts):
                token, choice = torch.nonzero((routing.expert == first + i) & routing.kept,
                                              as_tuple=True)
                if token.numel():
                    rows = token + r * max(sizes)
                    share = share.index_add(0, rows,
                                            routing.weight[token, choice, None] * expert(xs[token]))
        mine = funcol.reduce_scatter_tensor_autograd(share, "sum", 0, dist.group.WORLD)
        return funcol.wait_tensor(mine)[:T]


def _single_process_layer(lesson):
    """Lesson 13's MoELayer, every expert in one process: a demo cell, which load_tasks leaves
    out, defined here beside the loaded module's route and capacity."""
    source = next(c.source for c in read_cells(course.lesson(13).source)
                  if "class MoELayer(" in c.source)
    namespace = dict(vars(lesson))
    exec(definitions_only(source), namespace)
    return namespace["MoELayer"]


def _time_all(lesson, num_experts: int, k: int, d_model: int, d_hidden: int, tokens: int,
              capacity_factor: float, skew: float, steps: int) -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    router = make_router(d_model, num_experts, seed=0)
    mine = expert_range(num_experts, W, rank)
    experts = make_experts(num_experts, d_model, d_hidden, which=mine)
    xs = [skewed_tokens(tokens, d_model, router, favourite=1, skew=skew, seed=r) for r in range(W)]
    layers = {NAMES[0]: lesson.ExpertParallelMoE(router, experts, k, capacity_factor),
              NAMES[1]: AllGatherMoE(lesson.route, router, experts, k, capacity_factor)}
    if rank == 0:  # every expert, every rank's tokens (each routed with its own rank's capacity)
        layers[NAMES[2]] = _single_process_layer(lesson)(
            make_router(d_model, num_experts, seed=0),
            make_experts(num_experts, d_model, d_hidden), k, capacity_factor)

    def step(name: str) -> None:
        if name == NAMES[2]:
            if rank == 0:
                outs = [layers[name](x.clone().requires_grad_()) for x in xs]
                sum(o.square().sum() for o in outs).backward()
            return
        x = xs[rank].clone().requires_grad_()  # as in a model: the input's gradient is needed
        layers[name](x).square().sum().backward()

    with torch.no_grad():  # the two distributed dispatches agree before they are timed
        a, b = (layers[n](xs[rank]) for n in NAMES[:2])
    agree = torch.allclose(a, b, atol=1e-5)
    times: dict[str, list[float]] = {n: [] for n in NAMES}
    for i in range(steps + 1):  # the first round warms up and is dropped
        order = NAMES[i % 3:] + NAMES[:i % 3]  # rotate who goes first
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            step(name)
            if i >= 1:
                times[name].append(time.perf_counter() - start)
    sent = {}
    for name in NAMES[:2]:
        dist.barrier()
        with trace() as t:
            step(name)
        sent[name] = [(e.op, e.nbytes) for e in t.events if e.kind == "collective"]
    return {"times": times, "sent": sent, "agree": agree}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--d-hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--skew", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)

    preload_modules(("torch.distributed._functional_collectives",))
    lesson = load_tasks(course.lesson(13).source)
    result = run_ranks(_time_all, (lesson, args.experts, args.k, args.d_model, args.d_hidden,
                                   args.tokens, args.capacity_factor, args.skew, args.steps),
                       world_size=args.world_size, timeout=900, echo=False)
    if not all(r["agree"] for r in result):
        raise SystemExit("the all-gather and the all-to-all dispatch disagree: fix them first")
    medians = {}
    for name in NAMES:
        per_step = [max(r["times"][name][i] for r in result) for i in range(args.steps)]
        medians[name] = statistics.median(per_step)
    print(f"{args.experts} experts ({args.d_model} -> {args.d_hidden} -> {args.d_model}), "
          f"top-{args.k}, capacity factor {args.capacity_factor:g}, {args.tokens} tokens per rank, "
          f"{args.world_size} ranks; forward + backward, median of {args.steps} steps (max over "
          "ranks)")
    base = medians[NAMES[0]]
    bytes0 = sum(n for _, n in result[0]["sent"][NAMES[0]])
    for name in NAMES:
        line = (f"  {name:24s} {1e3 * medians[name]:8.1f} ms/step  {medians[name] / base:5.2f}x "
                "all-to-all")
        if name in result[0]["sent"]:
            nbytes = sum(n for _, n in result[0]["sent"][name])
            ops = sorted({op for op, _ in result[0]["sent"][name]})
            line += (f"   rank 0 sent {nbytes / 2**20:6.2f} MiB ({nbytes / bytes0:4.2f}x) via "
                     f"{', '.join(ops)}")
        print(line)


if __name__ == "__main__":
    main()
