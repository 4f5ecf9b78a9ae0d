"""A rank pool for grading: a lesson's launches of one world size run on ranks forked once.

Without it, every shared run of every case forks fresh ranks and forms a new gloo group (about
0.05-0.2 CPU-s for 2-4 ranks forked from a grading worker). Inside :func:`rank_pool`, a
:class:`~autograder.registry.SharedRun` with a world size runs on a persistent
:class:`kit.Ranks` group of that size instead, forked at its first use. What keeps a case's
result its own:

* **one lesson at a time.** The groups are forked after the lesson's notebook is loaded and
  every module its tasks preload is imported, and stopped when its cases end.
* **each case's gate.** A group forked inside a case's gate drops what it inherited
  (:func:`autograder.gates.forget_inherited`); each call installs the current case's gate in
  the ranks (:func:`autograder.gates.in_rank`), so a forbidden call is found there and scores
  the case 0 exactly as in a rank forked under the gate.
* **a reset before each call.** The default dtype, grad mode, thread count and RNG states the
  worker has now (what a rank forked now would inherit) are set; after it, once every rank has
  returned, a barrier checks the group is whole, else it is not reused. A call that made
  process groups (a ``DeviceMesh`` of its own) ends its group's reuse too: see :func:`_pooled`.
* **a failure is that case's.** A call that fails, hangs or crashes a rank stops its group
  (nothing of it is reused); the next call of that world size forks a fresh one.

What a pooled rank does not get back is the student's module as the worker holds it: a case
that rebinds the notebook's globals in a rank leaves them so for that rank's later calls.
``tests/test_pool.py`` grades the solutions and seeded bugs both ways and compares every case;
``benchmarks/grading_throughput.py --rank-pool`` compares the time.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["RankPool", "active", "rank_pool", "world_sizes_of"]

_active: RankPool | None = None
START_TIMEOUT_S = 120.0
# Pooled rank processes alive at once: under the worker's process limit (Limits.processes, 48)
# with room for a case's own launches beside them (Lesson 01 checks world sizes 1 to 8).
MAX_POOLED_RANKS = 16


def active() -> RankPool | None:
    """The pool the current task's shared runs use, or None (fresh ranks for each run)."""
    return _active


def world_sizes_of(tasks: Sequence[Any]) -> tuple[set[int], tuple[str, ...]]:
    """The world sizes of the tasks' shared runs and the modules they preload."""
    from autograder.registry import SharedRun, _Picked

    sizes: set[int] = set()
    preload: list[str] = []
    for task in tasks:
        preload += [m for m in task.preload if m not in preload]
        for case in task.cases:
            for run in (case.run, getattr(case, "uses", None)):
                run = run.run if isinstance(run, _Picked) else run
                if isinstance(run, SharedRun) and run.world_size:
                    sizes.add(run.world_size)
                    preload += [m for m in run.preload if m not in preload]
    return sizes, tuple(preload)


def _forget_inherited() -> None:
    from autograder import gates

    gates.forget_inherited()


def _state() -> dict[str, Any]:
    """What a rank forked now would inherit of torch's and Python's global state."""
    import torch

    return {"dtype": torch.get_default_dtype(), "grad": torch.is_grad_enabled(),
            "rng": torch.get_rng_state(), "random": random.getstate()}


def _pooled(gate: tuple[str, str] | None, state: dict[str, Any], fn: Any, args: tuple) -> Any:
    """On a pooled rank: the worker's state and the case's gate, then the call; returns its value
    and whether it made process groups."""
    import torch

    from autograder import gates

    torch.set_default_dtype(state["dtype"])
    torch.set_grad_enabled(state["grad"])
    torch.set_rng_state(state["rng"])
    random.setstate(state["random"])
    torch.set_num_threads(1)
    before = len(_groups())
    with gates.in_rank(gate):
        value = fn(*args)
    # A process group the call made (a DeviceMesh's) ends the group's reuse. Destroyed after the
    # call, it broke later calls of Lesson 14 ("Could not resolve the process group registered
    # under the name 55": torch.distributed state outside our reach, not its lru_caches, which
    # we emptied, still named it); kept, each would hold threads and sockets (6 threads and 10
    # descriptors per rank for a (2, 2) mesh) for the rest of the lesson.
    return value, len(_groups()) > before


def _groups() -> list[Any]:
    import torch.distributed.distributed_c10d as c10d

    return [g for g in list(c10d._world.pg_map) if g is not c10d.GroupMember.WORLD]


class RankPool:
    """Persistent groups by world size for one lesson's cases (see the module docstring)."""

    def __init__(self) -> None:
        self.groups: dict[int, Any] = {}
        self.forks = 0  # rank processes started
        self.calls = 0  # runs served

    def _group(self, world_size: int) -> Any:
        from kit.ranks import Ranks

        group = self.groups.pop(world_size, None)
        if group is not None and not group.alive:
            group.stop()
            group = None
        while group is None and self.groups and \
                sum(self.groups) + world_size > MAX_POOLED_RANKS:
            self._drop(next(iter(self.groups)))  # the least recently used size goes first
        if group is None:
            group = Ranks(world_size, echo=False, timeout=START_TIMEOUT_S,
                          setup=(_forget_inherited, (), {}))
            group.explain = False
            group.keep_after_error = False
            self.forks += world_size
        self.groups[world_size] = group  # last: the most recently used
        return group

    def run(self, world_size: int, fn: Any, args: tuple, timeout: float) -> list[Any]:
        """``fn(*args)`` on every rank of the pool's group of ``world_size``: a list by rank.
        Raises what :func:`kit.launch` raises; after any failure the group is gone."""
        from autograder import gates

        group = self._group(world_size)
        self.calls += 1
        try:
            returned = list(group.run(_pooled, gates.current(), _state(), fn, args,
                                      timeout=timeout))
        except BaseException:
            self._drop(world_size)
            raise
        values = [value for value, _ in returned]
        if any(made for _, made in returned):
            self._drop(world_size)
            return values
        # A separate call, once every rank has returned (inside the case's call, a rank done
        # early would wait in the barrier while its peers wait in the case's collective: the
        # deadlock probe, which starts once a rank has returned, could not see it). The case's
        # result stands either way; a group that fails it is not reused.
        if not group.healthy():
            self._drop(world_size)
        return values

    def _drop(self, world_size: int) -> None:
        group = self.groups.pop(world_size, None)
        if group is not None:
            group.stop()

    def close(self) -> None:
        for group in self.groups.values():
            group.stop()
        self.groups.clear()


@contextlib.contextmanager
def rank_pool(tasks: Sequence[Any]) -> Iterator[RankPool]:
    """Inside: the shared runs of ``tasks`` (one lesson's) use a pool. Every module they preload
    is imported here, so that groups forked later inherit them."""
    from kit.launcher import preload_modules

    global _active
    pool = RankPool()
    outer = _active
    try:
        preload_modules(world_sizes_of(tasks)[1])
        _active = pool
        yield pool
    finally:
        _active = outer
        pool.close()
