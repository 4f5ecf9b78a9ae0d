"""The alpha-beta cost model of communication, and the bandwidth numbers nccl-tests reports.

Sending ``n`` bytes costs ``alpha + beta * n`` seconds: ``alpha`` is the latency of one message,
``beta`` the seconds per byte (1 / bandwidth). Lesson 01 fits it to measured times and predicts a
ring all-reduce with it; Lessons 03-08 reuse it to reason about DDP buckets, FSDP all-gathers and
parallelism plans. Fitting alpha and beta is Task 1.4: its reference lives in the grader
(``autograder/references/lesson01.py``), not here, since Lesson 01's setup cell imports this module.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = [
    "BUS_FACTOR",
    "algorithm_bandwidth",
    "bus_bandwidth",
    "measure_seconds",
    "ring_all_reduce_time",
]

# Bus bandwidth = algorithm bandwidth * factor(p): the factor turns "bytes of the buffer per
# second" into "bytes each link carried per second", so that every op on a given network reports
# the same number, the link speed (nccl-tests' PERFORMANCE.md). A ring all-reduce sends each byte
# of the buffer 2(p-1)/p times over each rank's link: (p-1)/p in reduce-scatter, again in
# all-gather.
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "all_gather": lambda p: (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "all_to_all": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "reduce": lambda p: 1.0,
    "send": lambda p: 1.0,
}


def algorithm_bandwidth(nbytes: float, seconds: float) -> float:
    """Bytes of the buffer per second: ``nbytes / seconds`` (what a user sees)."""
    return nbytes / seconds


def bus_bandwidth(op: str, nbytes: float, seconds: float, world_size: int) -> float:
    """Bytes per second over each link: algorithm bandwidth times the op's factor for ``p`` ranks.

    ``nbytes`` is the whole buffer (the gathered output for all_gather, the input for
    reduce_scatter), as :class:`kit.trace.Event` counts it.
    """
    if op not in BUS_FACTOR:
        raise ValueError(f"no bus bandwidth factor for {op!r}; known ops: {', '.join(BUS_FACTOR)}")
    return algorithm_bandwidth(nbytes, seconds) * BUS_FACTOR[op](world_size)


def ring_all_reduce_time(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Seconds for a ring all-reduce of ``nbytes``: ``2(p-1) alpha + 2(p-1)/p nbytes beta``.

    Reduce-scatter and all-gather take ``p - 1`` steps each; every step sends one chunk of
    ``nbytes / p`` bytes to the right neighbour while receiving one from the left.
    """
    p = world_size
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta


def measure_seconds(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1) -> float:
    """The median wall time of ``fn()`` over ``repeats`` runs (after ``warmup`` runs).

    Inside ranks, put a ``dist.barrier()`` in ``fn`` or before timing, so every rank starts the
    collective together and the time is the collective's, not the wait for a late peer.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
