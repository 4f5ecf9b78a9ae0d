"""The grader's answers for Lesson 01 (trusted only): torch's own collectives for 1.1 and 1.2
(``dist.broadcast`` gives every rank the source's data in ceil(log2 p) rounds of a binomial tree;
``dist.all_reduce`` runs through the same traced case as the student's ring), and for 1.4 a
least-squares fit with torch's ``lstsq`` and the ring's time from
:func:`kit.lessons.costmodel.ring_all_reduce_time`, which the task forbids students to call.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from autograder.lesson01 import measurements, predictions, rank_tensor
from kit.lessons import costmodel

# --------------------------------------------------------------------------- 1.1 and 1.2


def tree_broadcast(tensor: torch.Tensor, src: int = 0) -> None:
    dist.broadcast(tensor, src)


def broadcast_from_src(seed: int, world_size: int, src: int, shape: tuple[int, ...],
                       dtype: torch.dtype) -> dict[str, Any]:
    """Every rank ends with src's tensor, after ceil(log2 p) rounds (computed in one process)."""
    data = rank_tensor(seed, src, shape, dtype)
    return {"tensors": [data] * world_size, "src": src,
            "rounds": math.ceil(math.log2(world_size)) if world_size > 1 else 0}


def ring_all_reduce(tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor)


# --------------------------------------------------------------------------- 1.4


def fit_alpha_beta(nbytes: Any, seconds: Any) -> tuple[float, float]:
    """Least-squares fit of ``seconds = alpha + beta * nbytes`` (float64, torch's lstsq)."""
    x = torch.as_tensor(nbytes, dtype=torch.float64).reshape(-1)
    y = torch.as_tensor(seconds, dtype=torch.float64).reshape(-1)
    if x.numel() != y.numel():
        raise ValueError(f"nbytes and seconds differ in length ({x.numel()} != {y.numel()})")
    if x.unique().numel() < 2:
        raise ValueError("fitting alpha and beta needs at least two different message sizes")
    design = torch.stack([torch.ones_like(x), x], dim=1)  # (m, 2): [1, n] per measurement
    alpha, beta = torch.linalg.lstsq(design, y[:, None], driver="gelsd").solution[:, 0].tolist()
    return alpha, beta


def true_alpha_beta(seed: int) -> list[float]:
    """The alpha and beta the exact timings were generated from."""
    return list(measurements(seed, 0.0)[2:])


def fit_of_noisy_timings(seed: int) -> list[float]:
    return list(fit_alpha_beta(*measurements(seed + 1, 0.2)[:2]))


def ring_predictions(seed: int) -> list[dict[str, Any]]:
    return predictions(costmodel.ring_all_reduce_time, 5e-5, 1e-9)
