"""The grader's answers for Lesson 02 (trusted only): a reader of torchrun's environment (2.1),
a copy of the lesson's model, data and ``train_step`` whose uninterrupted single-process run
gives the parameters an exact resume must end with (2.2), and a finder of the first mismatched
collective (2.3). 2.1 and 2.3 run their references through the cases' own runs, so they return
the lesson's dataclasses (here, with the same fields).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autograder.lesson02 import GLOBAL_BATCH, MICROBATCHES, TOTAL_STEPS, Call

# --------------------------------------------------------------------------- 2.1


@dataclass
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    is_distributed: bool


def dist_info_from_env(env: Mapping[str, str] | None = None) -> DistInfo:
    """Task 2.1's reference: torchrun's variables, validated, or ValueError naming the variable."""
    env = os.environ if env is None else env

    def number(name: str, default: int, low: int = 0) -> int:
        if name not in env:
            return default
        try:
            value = int(env[name])
        except ValueError:
            raise ValueError(f"{name}={env[name]!r} is not an integer") from None
        if value < low:
            raise ValueError(f"{name}={value} must be >= {low}")
        return value

    world_size = number("WORLD_SIZE", 1, low=1)
    rank = number("RANK", 0)
    local_world_size = number("LOCAL_WORLD_SIZE", world_size, low=1)
    local_rank = number("LOCAL_RANK", rank % local_world_size)
    node_rank = number("GROUP_RANK", rank // local_world_size)
    port = number("MASTER_PORT", 29500, low=1)
    if port > 65535:
        raise ValueError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
    if rank >= world_size:
        raise ValueError(f"RANK={rank} must be < WORLD_SIZE={world_size}")
    if local_rank >= local_world_size:
        raise ValueError(f"LOCAL_RANK={local_rank} must be < LOCAL_WORLD_SIZE={local_world_size}")
    if world_size % local_world_size:
        raise ValueError(f"LOCAL_WORLD_SIZE={local_world_size} does not divide "
                         f"WORLD_SIZE={world_size}")
    if rank != node_rank * local_world_size + local_rank:
        raise ValueError(f"RANK={rank} != GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK "
                         f"({node_rank} * {local_world_size} + {local_rank})")
    return DistInfo(rank, local_rank, world_size, local_world_size, node_rank,
                    env.get("MASTER_ADDR", "127.0.0.1"), port, "WORLD_SIZE" in env)


def environ_of_two_ranks(seed: int) -> list[dict[str, Any]]:
    """What each of kit.launch's 2 ranks reads from os.environ (the port left out: it is free)."""
    return [{"rank": r, "local_rank": r, "world_size": 2, "local_world_size": 2, "node_rank": 0,
             "master_addr": "127.0.0.1", "is_distributed": True} for r in range(2)]


# --------------------------------------------------------------------------- 2.2
# Trusted copies of the lesson's model, data and train_step (its setup cell): the expected
# parameters come from here, never from the student's module.


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batch_at(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 4, generator=g)  # (B, 4)
    return x, x.sin().sum(dim=1, keepdim=True)  # (B, 1)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    # One process accumulates both micro-batches, two ranks take one each and all-reduce:
    # either way each grad is g0 + g1, so the runs agree bit for bit.
    x, y = batch_at(step)
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    optimizer.zero_grad()
    loss = torch.zeros(())
    for micro in range(rank, MICROBATCHES, world_size):
        xb, yb = x.chunk(MICROBATCHES)[micro], y.chunk(MICROBATCHES)[micro]
        loss = ((model(xb) - yb) ** 2).sum() / GLOBAL_BATCH
        loss.backward()
    if world_size > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad)
    optimizer.step()
    return loss.item()


def uninterrupted_run(seed: int = 0, total_steps: int = TOTAL_STEPS) -> dict[str, torch.Tensor]:
    """Task 2.2's expectation: an uninterrupted single-process run of the trusted loop (the
    training is fixed: the seed changes nothing)."""
    model = make_model()
    optimizer = make_optimizer(model)
    for step in range(total_steps):
        train_step(model, optimizer, step)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- 2.3


@dataclass
class Mismatch:
    index: int
    ranks: list[int]
    calls: dict[int, Any]


def first_mismatch(calls: dict[int, list[Call]]) -> Mismatch | None:
    """Task 2.3's reference: the first call index where the ranks disagree, and who differs."""
    ranks = sorted(calls)
    seqs = {r: [(op, tuple(shape)) for op, shape in calls[r]] for r in ranks}
    longest = max((len(s) for s in seqs.values()), default=0)
    for index in range(longest):
        at = {r: (seqs[r][index] if index < len(seqs[r]) else None) for r in ranks}
        if len(set(at.values())) == 1:
            continue
        counts = Counter(at.values())
        top = max(counts.values())
        # Majority call; a tie goes to the call of the lowest rank among the tied.
        majority = next(at[r] for r in ranks if counts[at[r]] == top)
        return Mismatch(index, [r for r in ranks if at[r] != majority], at)
    return None
