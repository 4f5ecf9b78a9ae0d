"""See which collectives each rank *would* call, without running them (Lesson 02).

A hang or a "Detected mismatch between collectives" error means the ranks disagree on the
sequence of collectives they call. :func:`record_collectives` runs a function on real ranks
with the ``torch.distributed`` collectives replaced by recorders that note ``(name, shape)``
and return at once, so code that would hang finishes and every rank's sequence comes back;
Lesson 02's ``first_mismatch`` (Task 2.3) then finds where the sequences part.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kit.launcher import run_ranks
from kit.recorder import COLLECTIVE_OPS

__all__ = ["RECORDED", "record_collectives"]

# Collectives replaced while recording, each noted with the shape of its first tensor: the
# tensor collectives of kit.recorder's list (object collectives and point-to-point calls run for
# real; the coalesced and underscore variants are internal), in a fixed order.
RECORDED = tuple(sorted(op for op in COLLECTIVE_OPS
                        if not op.startswith("_") and "object" not in op and "coalesced" not in op))


def _shape_of(args: tuple, kwargs: dict) -> tuple[int, ...]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return tuple(a.shape)
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return tuple(a[0].shape)
    return ()  # barrier: no tensor


def _recorder(name: str, calls: list[tuple[str, tuple[int, ...]]]) -> Callable[..., Any]:
    def record(*args: Any, **kwargs: Any) -> None:
        calls.append((name, _shape_of(args, kwargs)))  # no communication: never blocks

    return record


def _run_recorded(fn: Callable[..., Any], args: tuple,
                  kwargs: dict) -> list[tuple[str, tuple[int, ...]]]:
    calls: list[tuple[str, tuple[int, ...]]] = []
    saved = {name: getattr(dist, name) for name in RECORDED}
    try:
        for name in RECORDED:
            setattr(dist, name, _recorder(name, calls))
        fn(*args, **kwargs)
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
    return calls


def record_collectives(fn: Callable[..., Any], *args: Any, world_size: int = 4,
                       timeout: float = 30.0,
                       **kwargs: Any) -> dict[int, list[tuple[str, tuple[int, ...]]]]:
    """``{rank: [(collective, shape), ...]}``: the collectives ``fn`` calls on each of
    ``world_size`` ranks, in call order, recorded instead of run.

    Only calls written ``dist.all_reduce(...)`` (looked up on the module at call time) are seen.
    Because nothing is communicated, results of collectives are not computed: code whose
    control flow depends on them may take a different path than in a real run.
    """
    result = run_ranks(_run_recorded, (fn, args, kwargs), {}, world_size=world_size,
                       timeout=timeout)
    return {rank: [(op, tuple(shape)) for op, shape in calls] for rank, calls in enumerate(result)}
