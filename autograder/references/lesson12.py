"""The grader's answers for Lesson 12 (trusted only).

12.1's counts come from ``FlopCounterMode`` around a real forward and backward of the
``TinyTransformer`` of each shape, under the math attention backend (on CPU the fused kernel has
no FLOP formula and counts 0). 12.2's bytes are what the recorder saw on every rank in the third
step of real runs of each layout on 2 and 4 gloo ranks (the second step of DDP still rebuilds its
buckets and broadcasts their order); one launch per world size runs the four layouts in turn.
12.3 needs no answer here: its expectation is the rank and phase the run slowed down.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.nn import functional as F

from autograder.compare import one_thread
from autograder.lesson12 import LAYOUTS, TRAFFIC_PRELOAD, WORLD_SIZES, traffic_model, traffic_sizes

TRAFFIC_STEPS = 3  # bytes are read from the last one


@one_thread()
def counted_flops(shapes: list[tuple[int, ...]]) -> dict[str, Any]:
    """FlopCounterMode's count of one forward and backward per shape, and the forward's parts
    (for the failure message): the projections, attention's two products, the output layer."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from kit.lessons.models import TinyTransformer

    counts, parts = [], []
    for vocab, dim, layers, heads, batch, seq_len in shapes:
        torch.manual_seed(0)
        model = TinyTransformer(vocab, dim, layers, heads, context=seq_len)
        x = torch.randint(0, vocab, (batch, seq_len))
        counter = FlopCounterMode(display=False)
        with counter, sdpa_kernel(SDPBackend.MATH):
            logits = model(x)
            F.cross_entropy(logits.reshape(-1, vocab), x.reshape(-1)).backward()
        counts.append(int(counter.get_total_flops()))
        tokens = batch * seq_len
        parts.append({"forward": counts[-1] // 3,
                      "projections": layers * 2 * tokens * dim * dim * 12,
                      "attention": layers * 4 * batch * seq_len * seq_len * dim,
                      "head": 2 * tokens * dim * vocab})
    return {"counts": counts, "parts": parts, "shapes": [tuple(s) for s in shapes]}


def _build(layout: str, sizes: dict[str, int]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import torch.distributed as dist

    torch.manual_seed(0)
    model = traffic_model(sizes)
    if layout in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        if layout == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return model, ZeroRedundancyOptimizer(model.parameters(),
                                                  optimizer_class=torch.optim.AdamW, lr=1e-3)
    elif layout == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            parallelize_module(block.mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


@one_thread()
def _traffic_on_rank(sizes: dict[str, int]) -> dict[str, dict[str, int]]:
    """Runs on each rank: every layout for three steps; the recorder's bytes per op of the last."""
    import torch.distributed as dist

    from kit.lessons.models import token_batch
    from kit.trace import trace

    out = {}
    for layout in LAYOUTS:
        model, optimizer = _build(layout, sizes)
        # TP ranks share one batch (they split the model, not the data); the others split data
        seed = 0 if layout == "tp" else dist.get_rank()
        x, y = token_batch(sizes["batch"], sizes["seq_len"], sizes["vocab"], seed)
        for _ in range(TRAFFIC_STEPS):
            with trace() as t:
                loss = F.cross_entropy(model(x).reshape(-1, sizes["vocab"]), y.reshape(-1))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        totals: dict[str, int] = {}
        for e in t.events:
            if e.kind != "region":
                totals[e.op] = totals.get(e.op, 0) + int(e.nbytes)
        out[layout] = {op: n for op, n in totals.items() if n}
        dist.barrier()
    return out


@functools.lru_cache(maxsize=4)
def _measured(seed: int, world_size: int) -> dict[str, dict[str, int]]:
    # One launch per world size, which the four layout cases all read.
    from kit.launcher import run_ranks

    ranks = list(run_ranks(_traffic_on_rank, (traffic_sizes(seed),), world_size=world_size,
                           timeout=120, echo=False, preload=TRAFFIC_PRELOAD))
    if any(r != ranks[0] for r in ranks):
        raise RuntimeError(f"the ranks' traffic differs on {world_size} ranks: {ranks}")
    return ranks[0]


def measured_traffic(seed: int) -> dict[str, Any]:
    """Task 12.2's expectation: ``{"<layout>@<W>": {op: bytes}}`` as the recorder counted them."""
    out: dict[str, Any] = {"sizes": traffic_sizes(seed)}
    for world_size in (1, *WORLD_SIZES):  # one rank too: FSDP and TP send nothing there
        for layout, ops in _measured(seed, world_size).items():
            out[f"{layout}@{world_size}"] = ops
    return out
