"""The meter: bytes and FLOPs a block of code costs on this rank, counted below Python.

Checks of Lessons 05-13 (ZeRO-1's optimizer state, FSDP freeing gathered parameters, ring
attention's K/V blocks, ...) and the lessons' own measurements use it to judge the memory a
technique saves from torch's own allocator reporting, never from attributes the student's code
chooses to expose. ``track()`` turns on the profiler's memory reporting alone: the CPU
allocator (``c10::ProfiledCPUMemoryReporter``) then reports every allocation and free with its
address and size, from this thread and from the threads torch hands its state to (autograd's,
gloo's workers), and the meter folds those events into bytes alive, peak and
per-mark numbers. ``count_flops()`` wraps ``FlopCounterMode``; ``count_ops()`` counts the aten
ops (kernels) dispatched, by name.

Idle, the meter costs nothing: it installs nothing. On 2 cores, a training step of ~110 small
ops runs at its usual speed inside ``track()`` (1.0x), but the events are read back at each
mark and at the block's end, ~5 us per allocation or free: a tracked block of such steps takes
1.9x as long; a ``track()`` adds ~0.7 ms, a ``mark()`` ~0.5 ms, and ``count_flops()`` (a
Python dispatch mode) runs the step 10x slower (``benchmarks/meter_overhead.py``).

It does not see memory from other allocators (numpy arrays, shared-memory and mmap'd
storages), allocations on threads torch does not hand its state to (a plain
``threading.Thread``), the work of an async collective still in flight at a mark, or Python
objects.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch._C._autograd import (
    _disable_profiler,
    _enable_profiler,
    _prepare_profiler,
    _profiler_enabled,
)
from torch._C._profiler import (
    ProfilerActivity,
    ProfilerConfig,
    ProfilerState,
    RecordScope,
    _ExperimentalConfig,
    _ExtraFields_Allocation,
)

__all__ = ["Flops", "Usage", "count_flops", "count_ops", "track"]

_ACTIVITIES = {ProfilerActivity.CPU}
# A scope no op of ordinary code runs in: the profiler records memory events and skips every op.
_SCOPES = {RecordScope.LITE_INTERPRETER}
# Kineto writes these to stderr at every profiler start and stop (no setting turns them off).
_KINETO_NOISE = re.compile(rb"^USDT:.*\] profiler_(start|stop)\s*$")
_C10_ERROR = 2  # c10's log levels: 0 INFO, 1 WARNING, 2 ERROR


class Usage:
    """Bytes of CPU memory allocated inside one ``track()`` block: read after it (or a mark).

    ``peak``, ``alive``, ``marks`` and ``peaks`` count only blocks allocated inside the track;
    ``largest`` is its largest single allocation and ``count`` the number of allocations.
    """

    def __init__(self) -> None:
        self.peak = 0
        self.alive = 0
        self.largest = 0
        self.count = 0
        self.marks: dict[str, int] = {}
        self.peaks: dict[str, int] = {}
        self._blocks: dict[int, int] = {}  # address -> bytes of each block allocated here, alive
        self._peak_since_mark = 0
        self._next_window: Callable[[], Any] | None = None  # set while the block runs

    def mark(self, name: str) -> None:
        """Record ``marks[name]`` (bytes alive now) and ``peaks[name]`` (peak since the last
        mark)."""
        if self._next_window is None:
            raise RuntimeError(f"usage.mark({name!r}) was called outside its `with meter.track()` "
                               "block: take marks while the block runs")
        if name in self.marks:
            raise ValueError(f"usage.mark({name!r}): this track already has a mark named {name!r}; "
                             "give each mark its own name, e.g. f'step {i}'")
        # A timestamp would order a mark only roughly against other threads' events; ending the
        # profiler's window puts everything recorded before the mark in the ended window.
        self._fold(self._next_window())
        self.marks[name] = self.alive
        self.peaks[name] = self._peak_since_mark
        self._peak_since_mark = self.alive

    def as_dict(self) -> dict[str, Any]:
        """Plain data (ints and dicts of ints) for a rank to return to the trusted side."""
        return {"peak": self.peak, "alive": self.alive, "largest": self.largest,
                "count": self.count, "marks": dict(self.marks), "peaks": dict(self.peaks)}

    def __repr__(self) -> str:
        return f"Usage({self.as_dict()})"

    def _fold(self, result: Any) -> None:
        """Replay one window's memory events, in time order, into the running address table."""
        for address, nbytes in _memory_events(result):
            if nbytes > 0:
                # An address handed out again was freed where the profiler did not see it.
                self.alive += nbytes - self._blocks.get(address, 0)
                self._blocks[address] = nbytes
                self.count += 1
                self.largest = max(self.largest, nbytes)
                self.peak = max(self.peak, self.alive)
                self._peak_since_mark = max(self._peak_since_mark, self.alive)
            else:  # a free; blocks allocated before the track are not in the table
                self.alive -= self._blocks.pop(address, 0)


@contextmanager
def track() -> Iterator[Usage]:
    """Count the bytes torch's CPU allocator hands out inside the block: ``with track() as usage``.

    Raises:
        RuntimeError: a profiler is already running in this thread (tracks do not nest).
    """
    if _profiler_enabled():
        raise RuntimeError("meter.track() cannot start: a torch profiler is already running in "
                           "this thread (a meter.track() inside another one, or inside "
                           "torch.profiler.profile). Tracks do not nest: split one track into "
                           "parts with usage.mark(name) instead.")
    usage = Usage()
    with tempfile.TemporaryFile(buffering=0) as spool, _c10_warnings_off():
        _quiet(spool, _start_window)
        usage._next_window = lambda: _quiet(spool, _switch_window)
        try:
            yield usage
        finally:
            usage._next_window = None
            usage._fold(_quiet(spool, _disable_profiler))


def _start_window() -> None:
    config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False,
                            _ExperimentalConfig())
    _prepare_profiler(config, _ACTIVITIES)
    _enable_profiler(config, _ACTIVITIES, _SCOPES)


def _switch_window() -> Any:
    # A collection between the two calls could free a tensor while no window is open; the
    # reporter would then forget it and the table would keep it alive.
    collecting = gc.isenabled()
    gc.disable()
    try:
        ended = _disable_profiler()
        _start_window()
    finally:
        if collecting:
            gc.enable()
    return ended


def _memory_events(result: Any) -> list[tuple[int, int]]:
    """``(address, +bytes | -bytes)`` of every CPU allocation and free in a result, in time
    order."""
    events = []
    pending = list(result.experimental_event_tree())
    while pending:  # allocations nest under user annotations (record_function) when there are any
        event = pending.pop()
        fields = event.extra_fields
        if isinstance(fields, _ExtraFields_Allocation) and fields.device.type == "cpu":
            events.append((event.start_time_ns, fields.ptr, fields.alloc_size))
        pending.extend(event.children)
    events.sort(key=lambda e: e[0])  # stable: a thread's events keep their recorded order
    return [(address, nbytes) for _, address, nbytes in events]


def _quiet(spool: BinaryIO, call: Callable[[], Any]) -> Any:
    """``call()`` with fd 2 sent to ``spool``; afterwards what others wrote there goes back to fd
    2."""
    saved = os.dup(2)
    os.dup2(spool.fileno(), 2)
    try:
        return call()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        spool.seek(0)
        written = spool.read()
        spool.seek(0)
        spool.truncate()
        if written:
            kept = b"".join(line for line in written.splitlines(keepends=True)
                            if not _KINETO_NOISE.match(line))
            if kept:
                os.write(2, kept)


@contextmanager
def _c10_warnings_off() -> Iterator[None]:
    # The CPU reporter LOG(WARNING)s "Memory block of unknown size was allocated before the
    # profiling started" when a tensor older than the track is freed inside it: that happens in
    # the user's code, not in a profiler call, so only c10's log level can keep it off stderr.
    level = _c10_log_level()
    if level is None or level.value >= _C10_ERROR:
        yield
        return
    before = level.value
    level.value = _C10_ERROR
    try:
        yield
    finally:
        level.value = before


@functools.cache
def _c10_log_level() -> ctypes.c_int | None:
    """c10's ``FLAGS_caffe2_log_level`` (the variable ``TORCH_CPP_LOG_LEVEL`` sets at start-up)."""
    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libc10.so", "libc10.dylib", "c10.dll"):
        if (lib_dir / name).exists():
            try:
                return ctypes.c_int.in_dll(ctypes.CDLL(str(lib_dir / name)),
                                           "FLAGS_caffe2_log_level")
            except (OSError, ValueError):
                return None
    return None


class Flops:
    """FLOPs counted inside one ``count_flops()`` block, total and per op (``"aten.mm"``)."""

    def __init__(self) -> None:
        self.total = 0
        self.by_op: dict[str, int] = {}

    def as_dict(self) -> dict[str, Any]:
        """Plain data for a rank to return to the trusted side."""
        return {"total": self.total, "by_op": dict(self.by_op)}

    def __repr__(self) -> str:
        return f"Flops({self.as_dict()})"


@contextmanager
def count_flops() -> Iterator[Flops]:
    """Count the FLOPs of the ops run inside the block (torch's ``FlopCounterMode`` formulas)."""
    from torch.utils.flop_counter import FlopCounterMode

    flops = Flops()
    mode = FlopCounterMode(display=False)
    try:
        with mode:
            yield flops
    finally:
        flops.by_op = {str(op): int(n) for op,
                       n in mode.get_flop_counts().get("Global", {}).items()}
        flops.total = int(mode.get_total_flops())


@contextmanager
def count_ops() -> Iterator[dict[str, int]]:
    """Count the aten ops dispatched inside the block, by name: ``{"aten.mm": 8, ...}``.

    A ``TorchDispatchMode`` sees every kernel below Python, whatever route called it (``@``,
    ``F.linear``, ``torch.einsum``, ``torch.ops.aten``). Its first use in a process imports
    ``torch._dynamo`` (seconds), as ``count_flops()`` does.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: dict[str, int] = {}

    class _Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                               kwargs: dict | None = None) -> Any:
            name = str(func.overloadpacket)
            counts[name] = counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    with _Counter():
        yield counts
