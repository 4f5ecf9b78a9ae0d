"""Props for Lesson 12 (where the time goes): a profiler on every rank, traces merged and drawn.

:func:`profiled` runs ``torch.profiler`` (CPU activities) around a block on one rank and writes
that rank's Chrome trace (``rank<r>.json``, the file Perfetto and ``chrome://tracing`` open) into
a folder, with one clock marker so that the recorder's collectives (:mod:`kit.trace`, stamped with
``time.perf_counter``) land on the same time axis. :func:`load_traces` reads a folder back, one
parsed dict per rank; :func:`merge_traces` writes one trace with the ranks as rows and the
recorder's collectives beside each; :func:`plot_traces` draws the same thing as a matplotlib
figure in the notebook (no browser). :func:`straggler_run` is the small training loop whose
data loader, forward or send can be made slow on one rank; :func:`matmul_peak` measures this
CPU's achieved FLOP/s. Nothing here decides which rank is slow, counts a model's FLOPs or a
layout's bytes: those are the lesson's tasks.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CLOCK_MARKER",
    "PHASE_COLOURS",
    "event_phase",
    "load_traces",
    "matmul_peak",
    "merge_traces",
    "plot_traces",
    "profiled",
    "straggler_run",
    "warm_profiler",
]

CLOCK_MARKER = "kit:clock"  # a record_function span whose start is a known perf_counter time
PHASE_COLOURS = {"data": "tab:green", "compute": "tab:blue", "communication": "tab:red",
                 "collective (recorder)": "tab:orange"}


def warm_profiler() -> None:
    """Start and stop a CPU profiler once in this process.

    The first profiler a process starts initialises Kineto: 1-3 s, and 8 s for four ranks
    sharing two busy cores. Forked ranks inherit an initialised one and start in milliseconds,
    so the checks and the lesson call this before launching. Once Kineto is up, a call costs
    milliseconds.
    """
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    _quietly(prof.start)
    _quietly(prof.stop)


def _quietly(call: Any) -> Any:
    """``call()`` with Kineto's "profiler_start/stop" lines kept off stderr (nbgrader scores a
    cell that writes to stderr 0); anything else written there still gets through."""
    from kit.meter import _quiet

    with tempfile.TemporaryFile(buffering=0) as spool:
        return _quiet(spool, call)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


@contextmanager
def profiled(folder: str | os.PathLike | None = None, *, shapes: bool = False,
             memory: bool = False, stack: bool = False) -> Iterator[Any]:
    """Profile the block on this rank (CPU activities); write ``folder/rank<r>.json`` after it
    (without ``folder``, the trace is written to a private temporary folder and removed once
    parsed).

    ``shapes``, ``memory`` and ``stack`` are ``record_shapes``, ``profile_memory`` and
    ``with_stack`` (each makes the trace bigger and slower to write). Yields the
    ``torch.profiler.profile``; its ``trace`` attribute is set to the parsed trace on exit, with
    ``kitClock`` (the ``perf_counter`` time of a marker event and its trace timestamp) added.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=shapes, profile_memory=memory,
                   with_stack=stack)
    _quietly(prof.start)
    try:
        with record_function(CLOCK_MARKER):
            clock = time.perf_counter()
        yield prof
    finally:
        _quietly(prof.stop)
    rank = _rank()
    with ExitStack() as scratch:
        if folder is None:  # a folder of this call's own: concurrent runs never share a file
            base = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="kit-trace-")))
        else:
            base = Path(folder)
            base.mkdir(parents=True, exist_ok=True)
        path = base / f"rank{rank}.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
        marker = next((e for e in trace["traceEvents"] if e.get("name") == CLOCK_MARKER), None)
        if marker is not None:
            trace["kitClock"] = {"perf_counter_s": clock, "ts_us": float(marker["ts"])}
            if folder is not None:
                path.write_text(json.dumps(trace))
    trace["kitRank"] = rank
    prof.trace = trace


def load_traces(folder: str | os.PathLike) -> list[dict[str, Any]]:
    """The parsed ``rank<r>.json`` traces of a folder, indexed by rank."""
    paths = sorted(Path(folder).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    if not paths:
        raise FileNotFoundError(f"no rank<r>.json trace in {folder}: profile the ranks with "
                                "kit.lessons.profiling.profiled(folder) first")
    return [json.loads(p.read_text()) for p in paths]


def event_phase(event: dict[str, Any]) -> str:
    """How the figures colour an event, by its name: DataLoader, ``gloo:``/``nccl:``, or compute."""
    name = event.get("name", "")
    if "DataLoader" in name:
        return "data"
    if name.startswith(("gloo:", "nccl:", "c10d::", "record_param_comms")):
        return "communication"
    return "compute"


def _spans(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and "dur" in e and e.get("name") != CLOCK_MARKER
            and not str(e.get("name", "")).startswith("PyTorch Profiler")]


def _offset_us(trace: dict[str, Any]) -> float:
    """Add to a perf_counter time (in us) to get this trace's timestamp."""
    clock = trace.get("kitClock")
    return clock["ts_us"] - clock["perf_counter_s"] * 1e6 if clock else 0.0


def merge_traces(traces: Sequence[dict[str, Any]], events: Sequence[Sequence[Any]] | None = None,
                 path: str | os.PathLike | None = None) -> dict[str, Any]:
    """One Chrome trace of every rank: process ``r`` is rank ``r`` (its threads as they were),
    plus a thread "collectives (recorder)" per rank holding the recorder's events (``events[r]``,
    :class:`kit.trace.Event` or dicts) with their bytes. Written to ``path`` when given."""
    merged: list[dict[str, Any]] = []
    for rank, trace in enumerate(traces):
        merged.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        merged.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        for e in _spans(trace):
            merged.append({**e, "pid": rank})
        if events is not None and rank < len(events):
            offset = _offset_us(trace)
            merged.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": "recorder",
                           "args": {"name": "collectives (recorder)"}})
            for ev in events[rank]:
                ev = ev if isinstance(ev, dict) else ev.to_dict()
                if ev["kind"] == "region":
                    continue
                merged.append({"ph": "X", "cat": "recorder", "name": ev["op"], "pid": rank,
                               "tid": "recorder", "ts": ev["start"] * 1e6 + offset,
                               "dur": max(ev["end"] - ev["start"], 1e-6) * 1e6,
                               "args": {"bytes": ev["nbytes"], "peer": ev["peer"]}})
    out = {"traceEvents": merged, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(out))
    return out


def _top_level(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The spans not inside another span of the same thread (the outermost calls)."""
    out: list[dict[str, Any]] = []
    ends: dict[Any, float] = {}
    for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
        tid = e.get("tid")
        if e["ts"] >= ends.get(tid, float("-inf")):
            out.append(e)
            ends[tid] = e["ts"] + e["dur"]
    return out


def plot_traces(traces: Sequence[dict[str, Any]], events: Sequence[Sequence[Any]] | None = None,
                ax: Any = None, *, title: str = "", window: tuple[float, float] | None = None
                ) -> Any:
    """Draw every rank's trace as one row: its outermost data, compute and ``gloo:`` events
    (one thin lane per thread), and the recorder's collectives under them. Times in ms from the
    earliest event; ``window`` (ms, ms) zooms in. Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.9 + 0.9 * len(traces)))
    starts = [e["ts"] for t in traces for e in _spans(t)]
    if not starts:
        ax.set_title(title or "no events")
        return ax
    t0, t1 = min(starts), max(e["ts"] + e["dur"] for t in traces for e in _spans(t))
    for rank, trace in enumerate(traces):
        spans = _top_level(_spans(trace))
        tids = sorted({e.get("tid") for e in spans}, key=lambda t: -sum(
            1 for e in spans if e.get("tid") == t))  # the main thread (most events) first
        lanes = len(tids) + (1 if events is not None else 0)
        height = 0.8 / max(lanes, 1)
        for lane, tid in enumerate(tids):
            y = rank - 0.4 + (lane + 0.5) * height
            for e in spans:
                if e.get("tid") == tid:
                    ax.barh(y, e["dur"] / 1e3, left=(e["ts"] - t0) / 1e3, height=height * 0.9,
                            color=PHASE_COLOURS[event_phase(e)], linewidth=0)
        if events is not None and rank < len(events):
            y = rank - 0.4 + (lanes - 0.5) * height
            offset = _offset_us(trace)
            for ev in events[rank]:
                ev = ev if isinstance(ev, dict) else ev.to_dict()
                ts = ev["start"] * 1e6 + offset
                if ev["kind"] != "region" and t0 <= ts <= t1:  # the profiled window only
                    ax.barh(y, max(ev["end"] - ev["start"], 1e-6) * 1e3,
                            left=(ts - t0) / 1e3, height=height * 0.9,
                            color=PHASE_COLOURS["collective (recorder)"], linewidth=0)
    ax.set_yticks(range(len(traces)), [f"rank {r}" for r in range(len(traces))])
    ax.set_ylim(len(traces) - 0.5, -0.5)
    ax.set_xlabel("time (ms)")
    if window is not None:
        ax.set_xlim(*window)
    shown = [p for p in PHASE_COLOURS if events is not None or p != "collective (recorder)"]
    ax.legend(handles=[Patch(color=PHASE_COLOURS[p], label=p) for p in shown], fontsize="small",
              loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    if title:
        ax.set_title(title)
    return ax


def matmul_peak(n: int = 1024, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """This machine's achieved FLOP/s: the best of ``repeats`` ``(n, n) @ (n, n)`` products
    (``2 n^3`` FLOPs each), with the threads torch uses now."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up: the first call allocates and picks a kernel
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


# --------------------------------------------------------------------------- a straggler

STRAGGLER_MODEL = {"vocab": 64, "dim": 32, "layers": 2, "heads": 2, "context": 16}
HICCUP = 0.6  # in the off step, another rank is by default this fraction of ``delay`` slow
LINK_BYTES = 16 * 2**20  # "link": what every all-reduce carries; ~50 ms on 4 loopback gloo ranks


def straggler_run(slow_rank: int | None, phase: str, delay: float, *, steps: int = 2,
                  folder: str | os.PathLike | None = None, batch: int = 4, seed: int = 0,
                  jitter: float = 0.0, off_step: int | None = None,
                  hiccup_rank: int | None = None, hiccup: float = HICCUP,
                  late_launch: int | None = None,
                  busy_wait: int | None = None, link_bytes: int = LINK_BYTES) -> dict[str, Any]:
    """Train a small transformer on this rank for ``steps`` profiled steps (after one unprofiled
    warm-up step) and return the parsed trace.

    Each step reads a batch from a ``DataLoader``, runs forward and backward, all-reduces the
    gradients as one flat buffer and steps SGD. On ``slow_rank`` every profiled step is made
    ``delay`` seconds slower in one ``phase``: ``"data"`` (the dataset's ``__getitem__``
    sleeps), ``"compute"`` (extra matrix products in forward) or ``"communication"`` (a sleep
    on the host just before the all-reduce: a late send, such as a rank held up between
    backward and its collective). ``"link"`` slows nobody (``slow_rank`` is None): every rank's
    all-reduce carries ``link_bytes`` more, so the transfer itself is the long part, as over a
    slow link. ``slow_rank=None`` with another phase slows nobody.

    Noise: ``jitter`` makes every rank's loader sleep a random ``0..jitter`` seconds per batch.
    In step ``off_step`` the slow rank is on time and ``hiccup_rank`` is ``hiccup * delay``
    slow instead, in the same phase.

    Overlap: with ``late_launch`` or ``busy_wait`` set, each step is two micro-batches of
    ``batch`` sequences. The first one's gradients are all-reduced asynchronously while every
    rank reads the second (its loader waits ``delay``, as on slow storage) and runs its forward
    and backward; a compute delay goes into the second forward. Rank ``late_launch`` starts the
    first all-reduce only after its second backward (nobody waits for it: the others are busy).
    Rank ``busy_wait`` computes while its second all-reduce is in flight, until it completes:
    the most compute of any rank, none of it holding anyone up.
    """
    import random

    import torch.distributed as dist
    from torch.nn import functional as F

    from kit.lessons.models import TinyTransformer, token_batch

    if phase not in ("data", "compute", "communication", "link"):
        raise ValueError("phase must be 'data', 'compute', 'communication' or 'link', got "
                         f"{phase!r}")
    if phase == "link" and slow_rank is not None:
        raise ValueError(f"a slow link slows every rank's collective, not rank {slow_rank}: "
                         "pass slow_rank=None with phase='link'")
    torch.set_num_threads(1)  # one core's thread per rank: four ranks with two each thrash two cores
    rank = dist.get_rank()
    overlap = late_launch is not None or busy_wait is not None
    cfg = STRAGGLER_MODEL
    torch.manual_seed(seed)
    model = TinyTransformer(cfg["vocab"], cfg["dim"], cfg["layers"], cfg["heads"], cfg["context"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    now = {"step": -1}  # the profiled step running; -1: the warm-up
    noise = random.Random(seed * 1_000_003 + rank)
    padding = torch.zeros(link_bytes // 4 if phase == "link" else 0)

    def late(who: int | None) -> float:
        """How much later rank ``who`` is in this step."""
        if now["step"] < 0 or who is None:
            return 0.0
        if now["step"] == off_step:
            return hiccup * delay if who == hiccup_rank else 0.0
        return delay if who == slow_rank else 0.0

    per_step = 2 if overlap else 1

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return batch * per_step * (steps + 1)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            if i % batch == 0 and now["step"] >= 0:
                second = overlap and (i // batch) % 2 == 1
                time.sleep(noise.uniform(0.0, jitter) + (delay if second else 0.0)
                           + (late(rank) if phase == "data" and not second else 0.0))
            x, y = token_batch(1, cfg["context"], cfg["vocab"], seed * 1000 + i)
            return x[0], y[0]

    loader = iter(torch.utils.data.DataLoader(Tokens(), batch_size=batch))

    def gradients(slow_forward: bool) -> torch.Tensor:
        x, y = next(loader)
        logits = model(x)
        if slow_forward and phase == "compute" and late(rank):
            a = torch.randn(128, 128)
            start = time.perf_counter()
            while time.perf_counter() - start < late(rank):  # wall time, whatever the load
                a = torch.tanh(a @ a)
        F.cross_entropy(logits.reshape(-1, cfg["vocab"]), y.reshape(-1)).backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()] + [padding])

    def step() -> None:
        works = []
        if overlap:
            first = gradients(slow_forward=False)
            if rank != late_launch:
                works.append(dist.all_reduce(first, async_op=True))
            second = gradients(slow_forward=True)
            if rank == late_launch:
                works.append(dist.all_reduce(first, async_op=True))
            works.append(dist.all_reduce(second, async_op=True))
            if rank == busy_wait and now["step"] >= 0:
                a = torch.randn(128, 128)
                while not works[-1].is_completed():  # compute while the bytes are in flight
                    a = torch.tanh(a @ a)
        else:
            flat = gradients(slow_forward=True)
            if phase == "communication" and late(rank):
                time.sleep(late(rank))
            works.append(dist.all_reduce(flat, async_op=True))
        for work in works:
            work.wait()
        optimizer.step()
        optimizer.zero_grad()

    step()  # warm-up, unprofiled: first calls are slow on some ranks more than others
    dist.barrier()
    with profiled(folder) as prof:
        for now["step"] in range(steps):
            step()
    dist.barrier()
    return prof.trace
