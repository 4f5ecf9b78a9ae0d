"""A collective tracer: which ``torch.distributed`` calls a rank made, how many bytes, and when.

Lesson 01 uses it to show collectives happen and to check that the point-to-point tasks call no
collective; Lessons 03-05 reuse the timeline to show DDP's bucketed all-reduces overlapping the
backward pass and FSDP's all-gathers. Inside a rank::

    with trace() as t:            # every dist.* call in the block is recorded
        dist.all_reduce(x)
        with region("backward"):  # a named compute span on the same timeline
            loss.backward()
    t.events                      # [Event(rank=0, index=0, op='all_reduce', nbytes=4096, ...)]

From a notebook, ``launch_traced(fn, world_size=4)`` is :func:`kit.launch` that also brings back
every rank's events, and ``plot_timeline(result.events)`` draws one lane per rank.

Tracing patches the public functions of ``torch.distributed`` (and ``Work.wait``, to time async
ops) for the duration of the block and restores them afterwards. A call made by another traced
call (``all_gather_object`` calls ``all_gather``) is folded into the outer event, so each event
is one call the user made. Only calls made through ``torch.distributed``'s Python functions are
seen: torch's C++ DDP reducer and the functional collectives FSDP2 uses talk to the process
group below Python, so trace those through a DDP communication hook or the course's own Python
DDP/FSDP. Names bound before the block (``from torch.distributed import all_reduce``) keep
pointing at the untraced function; call through ``dist.`` to be seen. Times come from ``time.perf_counter`` (a system-wide monotonic clock
on Linux and macOS), so events from different ranks on one machine share a time axis.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

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

P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "send_object_list", "recv_object_list"})
COLLECTIVE_OPS = frozenset({
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_single", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
    "monitored_barrier", "all_gather_object", "gather_object", "broadcast_object_list",
    "scatter_object_list", "all_reduce_coalesced", "_all_gather_base", "_reduce_scatter_base",
})
_TRACED = sorted(P2P_OPS | COLLECTIVE_OPS | {"batch_isend_irecv"})


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
    """A context manager recording every ``torch.distributed`` call made inside it."""
    return Tracer()


# --------------------------------------------------------------------------- patching

_lock = threading.RLock()
_active: list[Tracer] = []
_originals: dict[tuple[Any, str], Any] = {}
_pending: dict[int, Event] = {}  # id(Work) -> its event, until wait() returns
_local = threading.local()  # .depth: >0 while inside a traced call (inner calls fold into it)


def _activate(tracer: Tracer) -> None:
    with _lock:
        if not _active:
            _patch()
        _active.append(tracer)


def _deactivate(tracer: Tracer) -> None:
    with _lock:
        _active.remove(tracer)
        if not _active:
            _unpatch()
            _pending.clear()


def _patch() -> None:
    for name in _TRACED:
        original = getattr(c10d, name, None)
        if original is None:
            continue
        wrapper = _wrap(name, original)
        for module in (c10d, dist):
            if getattr(module, name, None) is original:
                _originals[(module, name)] = original
                setattr(module, name, wrapper)
    work = torch._C._distributed_c10d.Work
    _originals[(work, "wait")] = work.wait
    work.wait = _wait_wrapper(work.wait)


def _unpatch() -> None:
    for (owner, name), original in _originals.items():
        setattr(owner, name, original)
    _originals.clear()


def _now() -> float:
    return time.perf_counter()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _record(event: Event) -> None:
    for tracer in list(_active):
        tracer.events.append(event)


def _next_index() -> int:
    return len(_active[0].events) if _active else 0  # the outermost tracer sees every call


def _group_size(group: Any) -> int:
    if not dist.is_initialized():
        return 1
    try:
        return dist.get_world_size(group)
    except (RuntimeError, ValueError):
        return 1


def _tensor_bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(t) for t in x)
    return 0


def _message_bytes(op: str, a: dict[str, Any], group_size: int) -> int:
    """The op's message size (see :class:`Event`) from its bound arguments."""
    if op in ("all_gather", "all_gather_single", "all_gather_into_tensor", "_all_gather_base"):
        return _tensor_bytes(a.get("tensor_list", a.get("output_tensor")))
    if op in ("reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
              "_reduce_scatter_base"):
        return _tensor_bytes(a.get("input_list", a.get("input")))
    if op == "all_to_all":
        return _tensor_bytes(a.get("input_tensor_list"))
    if op == "all_to_all_single":
        return _tensor_bytes(a.get("input"))
    if op in ("gather", "scatter"):  # the full buffer the root holds
        return _tensor_bytes(a.get("tensor")) * group_size
    if op == "all_reduce_coalesced":
        return _tensor_bytes(a.get("tensors"))
    if "tensor" in a:
        return _tensor_bytes(a["tensor"])
    return 0  # barrier; object collectives add their inner calls' bytes


def _peer(op: str, a: dict[str, Any]) -> int | None:
    peer = a.get("dst") if op in ("send", "isend", "send_object_list") else a.get("src")
    local = a.get("group_dst") if op in ("send", "isend", "send_object_list") else a.get("group_src")
    if peer is None and local is not None:
        try:
            peer = dist.get_global_rank(a.get("group") or dist.group.WORLD, local)
        except (RuntimeError, ValueError):
            peer = local
    return peer


def _wrap(op: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)
    kind = "p2p" if op in P2P_OPS else "collective"

    @functools.wraps(original)
    def traced(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_local, "depth", 0)
        if depth or not _active:
            outer = getattr(_local, "outer", None)
            result = original(*args, **kwargs)
            if outer is not None and outer.op.endswith(("_object", "_object_list")):
                try:  # an object collective's inner tensor traffic counts towards it
                    a = signature.bind(*args, **kwargs).arguments
                    outer.nbytes += _message_bytes(op, a, outer.group_size)
                except TypeError:
                    pass
            return result
        try:
            a = signature.bind(*args, **kwargs).arguments
        except TypeError:  # wrong arguments: let torch raise its own error
            return original(*args, **kwargs)
        if op == "batch_isend_irecv":
            return _traced_batch(original, a)
        size = _group_size(a.get("group"))
        event = Event(_rank(), _next_index(), op, kind, _message_bytes(op, a, size), _now(), 0.0,
                      peer=_peer(op, a) if kind == "p2p" else None,
                      async_op=op in ("isend", "irecv") or bool(a.get("async_op")),
                      group_size=size)
        _local.depth, _local.outer = 1, event
        try:
            result = original(*args, **kwargs)
        finally:
            _local.depth, _local.outer = 0, None
            event.end = _now()
        if op == "recv" and event.peer is None and isinstance(result, int):
            event.peer = result  # recv from any source returns the sender
        if event.async_op and result is not None:
            _pending[id(result)] = event
        _record(event)
        return result

    return traced


def _traced_batch(original: Callable[..., Any], a: dict[str, Any]) -> Any:
    """``batch_isend_irecv``: one isend/irecv event per P2POp, each ending at its own wait()."""
    p2p_ops = list(a["p2p_op_list"])
    for p in p2p_ops:  # torch tells isend from irecv by identity: P2POps made before tracing
        for name in ("isend", "irecv"):  # began hold the untraced functions
            if p.op is _originals.get((c10d, name)) or p.op is getattr(c10d, name):
                p.op = getattr(c10d, name)
    start = _now()
    _local.depth = 1
    try:
        works = original(p2p_ops)
    finally:
        _local.depth = 0
    end = _now()
    for i, p in enumerate(p2p_ops):
        name = getattr(p.op, "__name__", str(p.op))
        name = "isend" if "send" in name else "irecv"
        event = Event(_rank(), _next_index(), name, "p2p", _tensor_bytes(p.tensor), start, end,
                      peer=p.peer, async_op=True, group_size=_group_size(p.group))
        if works is not None and i < len(works):
            _pending[id(works[i])] = event
        _record(event)
    return works


def _wait_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        event = _pending.pop(id(self), None)
        if event is not None:
            event.end = _now()
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
            ax.annotate("", xy=((r.end - t0) * scale, r.rank), xytext=((s.start - t0) * scale, s.rank),
                        arrowprops={"arrowstyle": "->", "color": "black", "lw": 0.6, "alpha": 0.6})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)
    ax.set_xlabel(f"time ({unit})")
    ax.legend(handles=[Patch(color=c, label=op) for op, c in seen.items()], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)
    if title:
        ax.set_title(title)
    return ax
