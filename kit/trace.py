"""A collective tracer: which operations a rank made, how many bytes, and when.

Lesson 01 uses it to show collectives happen and the checks use it to grade communication
patterns; Lessons 04, 05, 08 and 10 draw its timeline (DDP's bucketed all-reduces overlapping the
backward pass, torch DDP's own Reducer among them; FSDP's all-gathers; pipeline stages). Inside a
rank::

    with trace() as t:            # every operation in the block is recorded
        dist.all_reduce(x)
        with region("backward"):  # a named compute span on the same timeline
            loss.backward()
    t.events                      # [Event(rank=0, index=0, op='all_reduce', nbytes=4096, ...)]

From a notebook, ``launch_traced(fn, world_size=4)`` is :func:`kit.launch` that also brings back
every rank's events, and ``plot_timeline(result.events)`` draws one lane per rank.

The events come from :mod:`kit.recorder`, the gloo process group :func:`kit.launch` gives every
rank: it sees each operation below Python, whatever route it took (``dist.*``, a name imported
from ``torch.distributed`` before the block, a ``ProcessGroup`` method, functional collectives,
torch DDP's C++ reducer, FSDP2). An event's ``route`` says which. A call made by another
``torch.distributed`` call (``all_gather_object`` calls ``all_gather``) is folded into the outer
event, so each event is one call the user made. Nothing of ``torch.distributed`` is patched
except ``Work.wait`` while a block is open, to time async operations. Groups that are not
recording groups (NCCL, or a process not started by :func:`kit.launch`) show regions only.
Times come from ``time.perf_counter`` (a system-wide monotonic clock on Linux and macOS), so
events from different ranks on one machine share a time axis.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from kit import recorder
from kit.launcher import LaunchResult, run_ranks

__all__ = [
    "COLLECTIVE_OPS",
    "P2P_OPS",
    "Event",
    "TracedLaunch",
    "Tracer",
    "launch_traced",
    "match_messages",
    "plot_timeline",
    "region",
    "summarize",
    "trace",
]

# The operations the recorder knows, by kind (one list, kept in kit.recorder).
P2P_OPS = recorder.P2P_OPS
COLLECTIVE_OPS = recorder.COLLECTIVE_OPS


@dataclass
class Event:
    """One call on one rank. ``nbytes`` is the op's message size as nccl-tests counts it: the
    tensor for send/recv/broadcast/(all_)reduce, the *whole* gathered or scattered buffer for
    all_gather/reduce_scatter/all_to_all/gather/scatter, 0 for a barrier; object collectives
    count the bytes of the tensors they send under the hood. Times are ``perf_counter`` seconds;
    for an async op ``end`` is when ``wait()`` returned (or the call returned, if never waited)."""

    rank: int
    index: int  # call index on this rank, in issue order
    op: str  # "all_reduce", "isend", ... or a region's name
    kind: str  # "p2p", "collective" or "region"
    nbytes: int
    start: float
    end: float
    peer: int | None = None  # p2p: the other rank (global); None for "any source"
    async_op: bool = False
    group_size: int = 1
    # How it reached the wire: "dist" (a torch.distributed function), "functional",
    # "c++" (a torch component below Python: DDP's reducer), "pg" (a ProcessGroup method)
    route: str = ""
    # The global ranks of the group it ran in (a DeviceMesh axis is one group per slice)
    group_ranks: tuple[int, ...] = ()

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Tracer:
    """Records the events of one block (use :func:`trace`). ``events`` is in issue order."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def __enter__(self) -> Tracer:
        _activate(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _deactivate(self)

    def ops(self) -> list[str]:
        """The op of every event, in order."""
        return [e.op for e in self.events]

    def collectives(self) -> list[str]:
        """The collective ops called (empty when the block used point-to-point calls only)."""
        return [e.op for e in self.events if e.kind == "collective"]


def trace() -> Tracer:
    """A context manager recording every operation this rank's process groups make inside it."""
    return Tracer()


# --------------------------------------------------------------------------- recording

_lock = threading.RLock()
_active: list[Tracer] = []
_originals: dict[tuple[Any, str], Any] = {}
_pending: dict[int, tuple[Any, Event, list[int]]] = {}  # id(Work) -> (work, event, group ranks)
_waited: set[int] = set()  # id(event) of events whose end a Python wait() set
_fold: list[Any] = [None, None]  # (outer frame, event) of the object collective in progress


def _activate(tracer: Tracer) -> None:
    with _lock:
        if not _active:
            recorder.observers.append(_observe)
            recorder._issued.append(_issued)
            work = torch._C._distributed_c10d.Work
            _originals[(work, "wait")] = work.wait
            work.wait = _wait_wrapper(work.wait)
        _active.append(tracer)


def _deactivate(tracer: Tracer) -> None:
    with _lock:
        _active.remove(tracer)
        if not _active:
            for hooks, hook in ((recorder.observers, _observe), (recorder._issued, _issued)):
                if hook in hooks:
                    hooks.remove(hook)
            for (owner, name), original in _originals.items():
                setattr(owner, name, original)
            _originals.clear()
            _pending.clear()
            _waited.clear()
            _fold[:] = [None, None]


def _now() -> float:
    return time.perf_counter()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _record(event: Event) -> None:
    for tracer in list(_active):
        tracer.events.append(event)


def _next_index() -> int:
    return len(_active[0].events) if _active else 0  # the outermost tracer sees every call


def _observe(record: recorder.Record) -> None:
    """An operation is about to start: one event per call the user made."""
    if record.fold is not None and _fold[0] is record.fold:
        record.event = _fold[1]  # an object collective's inner traffic counts towards it
        record.event.nbytes += record.nbytes
        return
    event = Event(_rank(), _next_index(), record.op, record.kind, record.nbytes, record.start,
                  record.start, peer=record.peer, async_op=record.async_op,
                  group_size=record.group_size, route=record.route,
                  group_ranks=record.group_ranks)
    record.event = event
    _fold[:] = [record.fold, event] if record.fold is not None else [None, None]
    _record(event)


def _issued(record: recorder.Record, work: Any) -> None:
    event = record.event
    if event is None:
        return
    event.end = _now()
    if work is None:
        return
    _pending[id(work)] = (work, event, list(record.group_ranks))
    if record.route != "dist":  # waited below Python (DDP's reducer): end when it completes
        try:
            work.get_future().add_done_callback(lambda _: _completed(event))
        except (RuntimeError, AttributeError):
            pass


def _completed(event: Event) -> None:
    if id(event) not in _waited:
        event.end = max(event.end, _now())


def _wait_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        entry = _pending.pop(id(self), None)
        if entry is not None:
            _, event, _ = entry
            event.end = _now()
            _waited.add(id(event))
            if event.op == "recv" and event.peer is None:
                try:  # a receive from any source learns its sender once it completed
                    event.peer = dist.get_global_rank(dist.group.WORLD, self._source_rank())
                except (RuntimeError, ValueError, AttributeError):
                    pass
        return result

    return wait


@contextmanager
def region(name: str) -> Iterator[None]:
    """Record a named compute span (``"forward"``, ``"backward"``) on the traced timeline."""
    start = _now()
    try:
        yield
    finally:
        if _active:
            _record(Event(_rank(), _next_index(), name, "region", 0, start, _now()))


# --------------------------------------------------------------------------- launching


def _run_traced(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, list[dict]]:
    """Runs on each rank: ``fn`` under a tracer; its value and its events as plain dicts."""
    with trace() as t:
        value = fn(*args, **kwargs)
    return value, [e.to_dict() for e in t.events]


class TracedLaunch(LaunchResult):
    """A :class:`kit.LaunchResult` plus ``events[rank]``, the events each rank recorded."""

    events: list[list[Event]]

    def timeline(self, **kwargs: Any) -> Any:
        """Plot the events, one lane per rank (see :func:`plot_timeline`)."""
        return plot_timeline(self.events, **kwargs)


def launch_traced(fn: Callable[..., Any], *args: Any, world_size: int = 4, backend: str = "gloo",
                  timeout: float = 60.0, start_method: str | None = None, echo: bool = True,
                  **kwargs: Any) -> TracedLaunch:
    """:func:`kit.launch` with every rank traced: each rank's return value, plus ``.events``.

    ``echo=False`` keeps the ranks' output off the cell (checks use it).
    """
    inner = run_ranks(_run_traced, (fn, args, kwargs), {}, world_size=world_size, backend=backend,
                      timeout=timeout, start_method=start_method, echo=echo)
    result = TracedLaunch([v for v, _ in inner], inner.outputs, inner.durations, inner.wall_time,
                          inner.start_method)
    result.events = [[Event(**e) for e in events] for _, events in inner]
    return result


# --------------------------------------------------------------------------- reading


def _flatten(events: list[Event] | list[list[Event]]) -> list[Event]:
    if events and isinstance(events[0], list):
        return [e for lane in events for e in lane]
    return list(events)  # type: ignore[arg-type]


def summarize(events: list[Event] | list[list[Event]]) -> dict[str, dict[str, float]]:
    """Per op: number of calls, total bytes and total seconds, over every event given."""
    table: dict[str, dict[str, float]] = {}
    for e in _flatten(events):
        row = table.setdefault(e.op, {"calls": 0, "bytes": 0, "seconds": 0.0})
        row["calls"] += 1
        row["bytes"] += e.nbytes
        row["seconds"] += e.duration
    return table


def match_messages(events: list[list[Event]]) -> list[tuple[Event, Event]]:
    """Pair each send with the receive that got it: (sender's event, receiver's event).

    Messages between two ranks arrive in the order they were sent (torch's p2p contract for a
    given tag), so the k-th send from a to b is the k-th receive on b from a.
    """
    sends: dict[tuple[int, int], list[Event]] = {}
    recvs: dict[tuple[int, int], list[Event]] = {}
    for e in _flatten(events):
        if e.op in ("send", "isend") and e.peer is not None:
            sends.setdefault((e.rank, e.peer), []).append(e)
        elif e.op in ("recv", "irecv") and e.peer is not None:
            recvs.setdefault((e.peer, e.rank), []).append(e)
    pairs = []
    for key, out in sends.items():
        for s, r in zip(sorted(out, key=lambda e: e.index), sorted(recvs.get(key, []),
                                                                    key=lambda e: e.index)):
            pairs.append((s, r))
    return pairs


_COLOURS = {
    "all_reduce": "tab:blue", "broadcast": "tab:orange", "all_gather": "tab:green",
    "all_gather_into_tensor": "tab:green", "all_gather_single": "tab:green",
    "reduce_scatter_tensor": "tab:red", "reduce_scatter_single": "tab:red",
    "reduce_scatter": "tab:red", "send": "tab:purple", "isend": "tab:purple",
    "recv": "tab:brown", "irecv": "tab:brown", "barrier": "tab:gray", "reduce": "tab:olive",
    "all_to_all": "tab:cyan", "all_to_all_single": "tab:cyan",
}


def plot_timeline(events: list[list[Event]] | list[Event], ax: Any = None, *, title: str = "",
                  arrows: bool = True, unit: str = "ms") -> Any:
    """Draw events as bars, one lane per rank (rank 0 on top); return the matplotlib Axes.

    Args:
        events: ``events[rank]`` (as from :func:`launch_traced`) or one flat list.
        ax: an Axes to draw into (a new figure otherwise).
        arrows: draw an arrow from each send to the receive that matched it.
        unit: ``"ms"`` or ``"us"``; times are relative to the earliest event.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if unit not in ("ms", "us"):
        raise ValueError(f"unit must be 'ms' or 'us', got {unit!r}")
    flat = _flatten(events)
    if ax is None:
        ranks = max((e.rank for e in flat), default=0) + 1
        _, ax = plt.subplots(figsize=(9, 0.6 + 0.5 * ranks))
    if not flat:
        ax.set_title(title or "no events recorded")
        return ax
    scale = 1e3 if unit == "ms" else 1e6
    t0 = min(e.start for e in flat)
    ranks = sorted({e.rank for e in flat})
    seen: dict[str, str] = {}
    for e in flat:
        colour = _COLOURS.get(e.op, "lightgray" if e.kind == "region" else "tab:pink")
        seen.setdefault(e.op, colour)
        y = e.rank
        height = 0.35 if e.kind == "region" else 0.7
        ax.barh(y, max(e.duration, 1e-9) * scale, left=(e.start - t0) * scale, height=height,
                color=colour, edgecolor="black", linewidth=0.4,
                hatch="//" if e.kind == "region" else None)
    if arrows:
        for s, r in match_messages(events if isinstance(events[0], list) else [flat]):  # type: ignore[index]
            ax.annotate("", xy=((r.end - t0) * scale, r.rank),
                        xytext=((s.start - t0) * scale, s.rank),
                        arrowprops={"arrowstyle": "->", "color": "black", "lw": 0.6, "alpha": 0.6})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)
    ax.set_xlabel(f"time ({unit})")
    ax.legend(handles=[Patch(color=c, label=op) for op, c in seen.items()], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)
    if title:
        ax.set_title(title)
    return ax
