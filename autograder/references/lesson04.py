"""The grader's answers for Lesson 04 (trusted only): one ``AwkwardNet`` trained in one process
on the whole global batch from rank 0's initial weights (what every data-parallel rank must
match), how many of its parameters get a gradient each step, and the bucket plan with the
all-reduces each step must start per bucket, during backward or in finish.
"""

from __future__ import annotations

from typing import Any

import torch

from autograder.lesson04 import (
    BLOCKING,
    FINISH,
    LR,
    MIB,
    NEVER_USED,
    SOMETIMES_USED,
    VOCAB,
    backward_phase,
    global_batch,
    grads_of,
    initial_model,
    loss_of,
    state_of,
)
from kit.lessons.models import AwkwardNet


def single_process(seed: int, world_size: int, steps: int, extra: list[int]) -> dict[str, Any]:
    """One model, rank 0's initial weights, SGD on the whole global batch: the initial state,
    every step's gradients and the final state."""
    model = initial_model(seed, 0)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    grads = []
    for step in range(steps):
        x, y = global_batch(seed, step, world_size)
        loss_of(model(x, use_extra=step in extra), y).backward()
        grads.append(grads_of(model))
        optimizer.step()
        optimizer.zero_grad()
    return {"initial": state_of(initial_model(seed, 0)), "grads": grads, "final": state_of(model)}


def with_grad(step: int, extra: list[int]) -> int:
    """How many parameters of AwkwardNet get a gradient in ``step`` (tied counted once)."""
    idle = NEVER_USED + (() if step in extra else SOMETIMES_USED)
    return sum(1 for n, p in AwkwardNet(VOCAB).named_parameters()
               if p.requires_grad and not n.startswith(idle))


def gradients_per_step(seed: int, steps: int, extra: list[int]) -> list[int]:
    """The most all-reduces each step may take without reducing a gradient twice."""
    return [with_grad(step, extra) for step in range(steps)]


def bucket_plan(cap_mb: float) -> list[list[str]]:
    """The buckets (parameter names) of ``AwkwardNet`` for a cap, in reverse order."""
    model = AwkwardNet(VOCAB)
    cap = cap_mb * MIB
    buckets: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, p in reversed(list(model.named_parameters())):
        if not p.requires_grad:
            continue
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def expected_calls(cap_mb: float, steps: int, extra: list[int], micro: int) -> list[dict[str, int]]:
    """Per step: all-reduces per micro-batch backward and in finish, one per bucket.

    A bucket fires during the last backward once all its parameters have their gradient; a
    bucket holding a parameter that got none this step fires in finish."""
    out = []
    for step in range(steps):
        idle = NEVER_USED + (() if step in extra else SOMETIMES_USED)
        buckets = bucket_plan(cap_mb)
        late = sum(any(n.startswith(idle) for n in b) for b in buckets)
        calls = {backward_phase(i, micro): 0 for i in range(micro)}
        calls[backward_phase(micro - 1, micro)] = len(buckets) - late
        calls[FINISH] = late
        calls[BLOCKING] = 0
        out.append(calls)
    return out


def bucket_calls(seed: int, cap_mb: float, steps: int, extra: list[int],
                 micro: int) -> dict[str, Any]:
    """The plan for ``cap_mb`` and the all-reduces each step must start
    (``_compare_bucket_calls``)."""
    return {"plan": bucket_plan(cap_mb), "calls": expected_calls(cap_mb, steps, extra, micro)}
