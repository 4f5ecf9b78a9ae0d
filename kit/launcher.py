"""``kit.launch``: run a function on N real ``torch.distributed`` ranks from a notebook cell.

Every lesson uses it. Each rank is a process with the environment ``torchrun`` sets and an
initialised default process group, so code written for ``torchrun`` runs unchanged. The kernel
opens the rendezvous port (the OS picks it) and hands it to rank 0's ``TCPStore``, starts the
ranks (fork where safe, spawn with cloudpickle otherwise), shows their output live, stops every rank
as soon as one fails, and explains hangs at the timeout. Nothing of the kernel (environment, signal
handlers) is changed, and no process outlives the call.
"""

from __future__ import annotations

import importlib
import math
import os
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

from kit import _rank, hang
from kit.failures import (
    LaunchError,
    LaunchTimeout,
    RankFailure,
    clean_fatal_error,
    failure_message,
    timeout_message,
)
from kit.output import RankOutput

__all__ = ["LaunchError", "LaunchResult", "LaunchTimeout", "RankFailure", "launch", "run_ranks"]

STOP_GRACE_S = 0.5  # after a first failure, how long peers get to report their own failure
STACK_WAIT_S = 1.5  # at a timeout, how long ranks get to dump their stacks
EXIT_WAIT_S = 10.0  # after every rank returned, how long the group teardown may take
# Once a rank has returned, it will never call a collective again. After this long, the others'
# stacks are read, then again every PROBE_GAP_S: if every rank still working sits in the same
# collective call each time and used (almost) no CPU in between, none can make progress (a
# collective moving data uses CPU; one that waits for a peer still computing is not a deadlock,
# since that peer is not in a collective), and the launch is a deadlock at once, not at the timeout.
DEADLOCK_PROBE_S = 0.5
PROBE_GAP_S = 0.2
PROBES_ALIKE = 3  # how many probes in a row must agree (spanning 2 x PROBE_GAP_S)
IDLE_CPU_S = 0.03  # CPU seconds a blocked rank may use between two probes (signals, the dump)


class LaunchResult(list):
    """Every rank's return value, indexable by rank, plus what each rank printed and its time."""

    def __init__(self, values: list[Any], outputs: list[str], durations: list[float],
                 wall_time: float, start_method: str):
        super().__init__(values)
        self.outputs = outputs
        self.durations = durations
        self.wall_time = wall_time
        self.start_method = start_method


def launch(fn: Callable[..., Any], *args: Any, world_size: int = 4, backend: str = "gloo",
           timeout: float = 60.0, start_method: str | None = None,
           preload: Sequence[str] = (), **kwargs: Any) -> LaunchResult:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return every rank's return value.

    Each rank sees ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` as under ``torchrun``, with the default process group
    already initialised (``backend``) and destroyed after every rank has returned.

    Args:
        fn: the function each rank runs (a notebook function, lambda or closure is fine).
        world_size: number of ranks.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (one GPU per rank).
        timeout: seconds before the launch is declared hung; each rank's stack is then shown.
        start_method: ``"fork"`` (the default for gloo where safe: fast) or ``"spawn"`` (the
            default for NCCL, whose ranks must initialise CUDA themselves).
        preload: modules to import before the ranks start (``"torch.distributed.fsdp"``): forked
            ranks inherit them instead of each paying the import (see :func:`preload_modules`).

    Raises:
        LaunchError: a rank raised, exited or was killed; every failed rank is named.
        LaunchTimeout: the ranks did not finish within ``timeout`` seconds.
    """
    return run_ranks(fn, args, kwargs, world_size=world_size, backend=backend, timeout=timeout,
                     start_method=start_method, preload=preload)


def preload_modules(modules: Iterable[str]) -> None:
    """Import ``modules`` in this process, once, so that ranks forked later inherit them.

    The one place the course warms forked ranks: FSDP2, DTensor, DCP and Dynamo take seconds to
    import, and every rank of every launch would pay it again. A name that does not import
    raises, so a typo cannot silently turn the warm-up off.
    """
    for name in modules:
        if name not in sys.modules:
            importlib.import_module(name)


# --------------------------------------------------------------------------- validation


def default_start_method(backend: str) -> str:
    import torch

    if sys.platform != "linux" or "fork" not in _mp().get_all_start_methods():
        return "spawn"  # macOS/Windows: fork is unsafe or absent
    if backend == "nccl":
        # A forked child cannot initialise CUDA once the parent has touched the driver, and even
        # torch.cuda.is_available() does (cudaGetDeviceCount: "Cannot re-initialize CUDA in
        # forked subprocess"). NCCL ranks are spawned, as torch.multiprocessing's docs ask.
        return "spawn"
    if torch.cuda.is_initialized():
        return "spawn"  # a forked child cannot use the kernel's CUDA context
    return "fork"


def _mp():
    import torch.multiprocessing as mp

    return mp


def _validate(fn: Any, args: tuple, kwargs: dict, world_size: Any, backend: Any, timeout: Any,
              start_method: str | None) -> str:
    import torch
    import torch.distributed as dist

    if not callable(fn):
        raise TypeError("kit.launch needs a function to run on every rank, got "
                        f"{type(fn).__name__} {fn!r}. Pass the function itself: kit.launch(train, "
                        "world_size=4).")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}.")
    if not isinstance(timeout, (int, float)) or not timeout > 0 or math.isinf(timeout):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
    known = ("gloo", "nccl", "mpi", "ucc", "xccl")
    if backend not in known:
        raise ValueError(f"unknown backend {backend!r}: use 'gloo' for CPU tensors or 'nccl' for "
                         "GPUs (one GPU per rank).")
    if backend == "nccl":
        # device_count() asks NVML and leaves the CUDA driver alone; is_available() would
        # initialise it in this process (the kernel) for nothing.
        gpus = torch.cuda.device_count()
        if gpus < world_size:
            raise ValueError(f"backend='nccl' needs one GPU per rank: found {gpus} GPU(s) for "
                             f"world_size={world_size}. On CPU use backend='gloo', or lower "
                             "world_size to the number of GPUs.")
    if not dist.is_available() or not dist.is_backend_available(backend):
        raise ValueError(f"backend {backend!r} is not available in this PyTorch build "
                         f"({torch.__version__}); use backend='gloo'.")
    if start_method is None:
        start_method = default_start_method(backend)
    if start_method not in ("fork", "spawn", "forkserver"):
        raise ValueError(f"start_method must be 'fork', 'spawn' or None, got {start_method!r}.")
    if start_method not in _mp().get_all_start_methods():
        raise ValueError(f"start_method={start_method!r} is not available on {sys.platform}; "
                         "use start_method='spawn'.")
    if start_method == "fork" and backend == "nccl":
        raise ValueError("backend='nccl' ranks cannot be forked: a forked child cannot initialise "
                         "CUDA once the kernel has touched it. Leave start_method unset (NCCL "
                         "ranks are spawned) or pass start_method='spawn'.")
    if start_method == "fork" and torch.cuda.is_initialized():
        raise RuntimeError("CUDA is already initialised in this kernel, and forked ranks cannot "
                           "use it. Use start_method='spawn', or restart the kernel and launch "
                           "before touching CUDA.")
    if start_method != "fork":
        _check_picklable(fn, args, kwargs)
    return start_method


def _check_picklable(fn: Any, args: tuple, kwargs: dict) -> None:
    named = [("the function", fn)] + [(f"argument {i}", a) for i, a in enumerate(args)]
    named += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
    for what, obj in named:
        try:
            cloudpickle.dumps(obj)
        except Exception as e:  # noqa: BLE001 - the message carries the cause
            raise TypeError(
                f"{what} ({type(obj).__name__}) cannot be sent to spawned ranks: {e}. Build it "
                "inside the function instead, pass plain data (tensors, numbers, paths), or use "
                "start_method='fork' on Linux.") from e


# --------------------------------------------------------------------------- running


@dataclass
class _Rank:
    rank: int
    process: Any
    result: Connection
    out_fd: int
    err_fd: int
    stack_path: str
    message: _rank.RankMessage | None = None
    exitcode: int | None = None
    killed: bool = False
    released: bool = False
    noted: bool = False  # its outcome has been looked at
    stack_seen: int = 0  # bytes of its stack file already read (each dump is appended)


def _rank_env(rank: int, world_size: int, addr: str, port: int) -> dict[str, str]:
    env = {
        "RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size,
        "LOCAL_WORLD_SIZE": world_size, "GROUP_RANK": 0, "GROUP_WORLD_SIZE": 1,
        "ROLE_RANK": rank, "ROLE_WORLD_SIZE": world_size, "ROLE_NAME": "default",
        "MASTER_ADDR": addr, "MASTER_PORT": port,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),  # torchrun's default
        "PYTHONUNBUFFERED": "1",
    }
    return {k: str(v) for k, v in env.items()}


def _kill(r: _Rank) -> None:
    """SIGKILL the rank's whole process group: the rank and anything it started (DataLoader
    workers), which may outlive a rank that already died."""
    if r.process.exitcode is None:
        r.killed = True
    for target in (lambda: os.killpg(r.process.pid, signal.SIGKILL),
                   lambda: os.kill(r.process.pid, signal.SIGKILL)):
        try:
            target()
            return
        except (ProcessLookupError, PermissionError):
            continue


def _start(ctx: Any, spec: _rank.RankSpec, payload: Any, listener: socket.socket | None,
           store_ready: Any) -> _Rank:
    result_parent, result_child = ctx.Pipe(duplex=True)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    out_conn, err_conn = Connection(out_w, readable=False), Connection(err_w, readable=False)
    process = ctx.Process(target=_rank.rank_main, name=f"kit-rank-{spec.rank}",
                          args=(spec, payload, result_child, out_conn, err_conn, listener,
                                store_ready))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "fork() with threads" (3.12+)
        process.start()
    for conn in (result_child, out_conn, err_conn):
        conn.close()
    try:
        os.setpgid(process.pid, process.pid)  # also done by the child: whoever runs first
    except OSError:
        pass
    for fd in (out_r, err_r):
        os.set_blocking(fd, False)
    return _Rank(spec.rank, process, result_parent, out_r, err_r, spec.stack_path)


def _describe_exit(r: _Rank) -> RankFailure | None:
    kind = r.message.kind if r.message else None
    if kind == _rank.OK and r.exitcode in (0, None):
        return None
    if kind == _rank.ERROR:
        etype, text, tb = r.message.body
        summary = f"raised {etype}: {text}" if text else f"raised {etype}"
        return RankFailure(r.rank, summary, tb, exception_type=etype, exitcode=r.exitcode)
    if kind == _rank.EXIT:
        return RankFailure(r.rank, f"called sys.exit({r.message.body})", exitcode=r.exitcode)
    code = r.exitcode
    if code is not None and code < 0:
        sig = signal.Signals(-code)
        what = signal.strsignal(sig) or sig.name
        return RankFailure(r.rank, f"was killed by signal {sig.name} ({what.lower()})",
                           exitcode=code)
    if kind == _rank.OK:
        return RankFailure(r.rank, f"returned, then exited with code {code} while shutting down",
                           exitcode=code)
    return RankFailure(r.rank, f"exited with code {code} without returning "
                               "(os._exit(), or a crash outside Python)", exitcode=code)


def run_ranks(fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, *,
              world_size: int = 4, backend: str = "gloo", timeout: float = 60.0,
              start_method: str | None = None, echo: bool = True,
              preload: Sequence[str] = ()) -> LaunchResult:
    """:func:`launch` with its options explicit; ``echo=False`` keeps rank output off the cell."""
    kwargs = dict(kwargs or {})
    method = _validate(fn, args, kwargs, world_size, backend, timeout, start_method)
    if method == "fork":
        preload_modules(preload)  # spawned ranks import what they unpickle anyway
    ctx = _mp().get_context(method)
    payload = (fn, args, kwargs) if method == "fork" else cloudpickle.dumps((fn, args, kwargs))
    tmp = tempfile.mkdtemp(prefix="kit-launch-")
    addr = "127.0.0.1"
    # Rank 0 hosts the rendezvous TCPStore, as under torchrun, on a socket the kernel opens with
    # port 0: the OS picks a free port and nothing can take it between choosing and listening.
    # The kernel itself runs no store thread, so forking it stays safe.
    listener = socket.create_server((addr, 0), backlog=max(128, world_size))
    port = listener.getsockname()[1]
    store_ready = ctx.Event()
    pg_timeout = max(2 * timeout, timeout + 30.0)  # the launcher's hang report must come first
    output = RankOutput(world_size, echo=echo)
    ranks: list[_Rank] = []
    sel = selectors.DefaultSelector()
    started = time.monotonic()
    try:
        for rank in range(world_size):
            spec = _rank.RankSpec(rank, world_size, backend, addr, port, pg_timeout,
                                  os.path.join(tmp, f"stack-{rank}.txt"), os.getpid(),
                                  _rank_env(rank, world_size, addr, port))
            r = _start(ctx, spec, payload, listener if rank == 0 else None, store_ready)
            if rank == 0:
                listener.close()  # rank 0 owns it now; later ranks must not inherit it
            ranks.append(r)
            sel.register(r.out_fd, selectors.EVENT_READ, (r, "out"))
            sel.register(r.err_fd, selectors.EVENT_READ, (r, "err"))
            sel.register(r.result.fileno(), selectors.EVENT_READ, (r, "result"))
            sel.register(r.process.sentinel, selectors.EVENT_READ, (r, "exit"))
        failures, stacks = _supervise(ranks, sel, output, started, timeout)
    except BaseException:
        for r in ranks:  # KeyboardInterrupt (the stop button) or a launcher bug: leave nothing
            _kill(r)
        raise
    finally:
        for r in ranks:
            _kill(r)
            r.process.join()
        _drain(ranks, output)
        output.flush()
        crash_reports = {r.rank: clean_fatal_error(_read(r.stack_path + ".crash")) for r in ranks}
        for r in ranks:
            for fd in (r.out_fd, r.err_fd):
                os.close(fd)
            r.result.close()
            r.process.close()
        sel.close()
        listener.close()
        shutil.rmtree(tmp, ignore_errors=True)
    wall = time.monotonic() - started
    outputs = [output.text(r) for r in range(world_size)]
    returned = {r.rank: r.message.seconds for r in ranks if r.message
                and r.message.kind == _rank.OK}
    if stacks is not None:
        hung_for = None if stacks.get("timeout", True) else wall
        stacks = {k: v for k, v in stacks.items() if k != "timeout"}
        raise LaunchTimeout(timeout_message(stacks, returned, timeout, world_size,
                                            deadlock=hung_for),
                            {k: v.raw for k, v in stacks.items()}, outputs)
    if failures:
        for f in failures:  # a signal or a bare exit: the rank's last stderr lines say most
            if not f.details and f.exception_type is None:
                f.details = (crash_reports.get(f.rank)
                             or "\n".join(output.stderr_tails[f.rank][-15:]))
        failed = {f.rank for f in failures}
        stopped = [r.rank for r in ranks if r.killed and r.rank not in failed
                   and r.rank not in returned]
        raise LaunchError(failure_message(failures, world_size,
                                          [r for r in returned if r not in failed],
                                          stopped), failures, outputs)
    values = [cloudpickle.loads(r.message.body) for r in ranks]
    durations = [float(r.message.seconds) for r in ranks]
    return LaunchResult(values, outputs, durations, wall, method)


def _drain(ranks: list[_Rank], output: RankOutput) -> None:
    for r in ranks:
        for fd, stream in ((r.out_fd, "out"), (r.err_fd, "err")):
            while True:
                try:
                    data = os.read(fd, 65536)
                except (BlockingIOError, OSError):
                    break
                if not data:
                    break
                output.feed(r.rank, stream, data)


def _supervise(ranks: list[_Rank], sel: selectors.BaseSelector, output: RankOutput,
               started: float, timeout: float, persistent: bool = False):
    """Pump output and results until every rank exits; stop all on failure or timeout.

    ``persistent`` (:class:`kit.Ranks`): one call on ranks that stay up, done once every rank has
    reported; after a failure, only the ranks that have not reported by the grace are killed."""
    deadline = started + timeout
    failures: list[RankFailure] = []
    stop_at: float | None = None
    probe_at: float | None = None  # when to look for a deadlock next (a rank has returned)
    alike = 0  # probes in a row that found every working rank blocked in the same place
    last_probe: _Probe | None = None
    while any(r.exitcode is None and not (persistent and r.message) for r in ranks):
        now = time.monotonic()
        if stop_at is not None and now >= stop_at:
            for r in ranks:
                if r.exitcode is None and not (persistent and r.message):
                    _kill(r)
        if stop_at is None and now >= deadline:
            return failures, _collect_stacks(ranks, output)
        if stop_at is None and probe_at is not None and now >= probe_at:
            probe = _probe_deadlock(ranks)
            alike = alike + 1 if _same_place(probe, last_probe) else 0
            if probe is not None and alike + 1 >= PROBES_ALIKE:
                stacks = _collect_stacks(ranks, output, probe.stacks)
                stacks["timeout"] = False  # a deadlock found, not the timeout
                return failures, stacks
            last_probe = probe
            probe_at = time.monotonic() + (PROBE_GAP_S if probe is not None else DEADLOCK_PROBE_S)
        wait = (stop_at if stop_at is not None else deadline) - now
        # The sentinel fires only once every holder of it has exited, and a rank's children
        # (DataLoader workers) hold it too: poll the exit status as well.
        events = sel.select(min(max(wait, 0.0), 0.2) if stop_at is None else 0.05)
        exited = [r for r in ranks if r.exitcode is None and r.process.exitcode is not None]
        events += [(_ExitKey(r), None) for r in exited if not any(
            k.data == (r, "exit") for k, _ in events)]
        for key, _ in events:
            r, what = key.data
            if what in ("out", "err"):
                try:
                    data = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if data:
                    output.feed(r.rank, what, data)
                else:
                    sel.unregister(key.fd)
            elif what == "result":
                _receive(r, sel)
            else:  # the process exited
                if r.exitcode is not None:
                    continue
                if key.fd in sel.get_map():
                    sel.unregister(key.fd)
                r.process.join()
                r.exitcode = r.process.exitcode
                _receive(r, sel)
            # A rank that reported an error counts at once: it may block on its way out.
            if not r.noted and (r.exitcode is not None
                                or (r.message and r.message.kind != _rank.OK)):
                r.noted = True
                failure = None if r.killed else _describe_exit(r)
                if failure is not None:
                    happened = r.message.at if r.message else time.monotonic()
                    failure.after_s = happened - started
                    failures.append(failure)
                    failures.sort(key=lambda f: f.after_s)
                    if stop_at is None:
                        stop_at = time.monotonic() + STOP_GRACE_S
        done = [r for r in ranks if r.message and r.message.kind == _rank.OK]
        if probe_at is None and done and len(done) < len(ranks):
            probe_at = time.monotonic() + DEADLOCK_PROBE_S
        if (not persistent and stop_at is None
                and all(r.message and r.message.kind == _rank.OK for r in ranks)):
            for r in ranks:  # everyone returned: let them tear the group down and exit
                if not r.released:
                    r.released = True
                    try:
                        r.result.send_bytes(b"release")
                    except OSError:
                        pass
            deadline = max(deadline, time.monotonic() + EXIT_WAIT_S)
    return failures, None


class _ExitKey:
    """A selector-like key for an exit found by polling rather than by the sentinel."""

    def __init__(self, r: _Rank):
        self.data = (r, "exit")
        self.fd = r.process.sentinel


def _receive(r: _Rank, sel: selectors.BaseSelector) -> None:
    try:
        while r.message is None and r.result.poll():
            r.message = cloudpickle.loads(r.result.recv_bytes())
    except (EOFError, OSError):
        pass
    if r.message is not None or r.exitcode is not None:
        try:
            sel.unregister(r.result.fileno())
        except (KeyError, ValueError, OSError):
            pass


def _working(ranks: list[_Rank]) -> list[_Rank]:
    return [r for r in ranks if r.exitcode is None
            and not (r.message and r.message.kind == _rank.OK)]


def _dump_stacks(waiting: list[_Rank]) -> dict[int, hang.RankStack]:
    """Ask each rank for its stack (faulthandler on SIGUSR1) and parse what it appends."""
    seen = {r.rank: r.stack_seen for r in waiting}
    for r in waiting:
        try:
            os.kill(r.process.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    end = time.monotonic() + STACK_WAIT_S
    sizes: dict[int, int] = {}
    while time.monotonic() < end:
        now = {r.rank: _size(r.stack_path) for r in waiting}
        if all(now[k] > seen[k] for k in now) and now == sizes:
            break
        sizes = now
        time.sleep(0.05)
    stacks = {}
    for r in waiting:
        text = _read(r.stack_path)[seen[r.rank]:]
        r.stack_seen = seen[r.rank] + len(text)
        if text:
            stacks[r.rank] = hang.parse_dump(r.rank, text)
    return stacks


@dataclass
class _Probe:
    stacks: dict[int, hang.RankStack]
    cpu: dict[int, float]  # CPU seconds each rank had used when its stack was read


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), or -1 when unreadable."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return -1.0


def _probe_deadlock(ranks: list[_Rank]) -> _Probe | None:
    """Each working rank's stack and CPU time when every one of them is inside a collective (a
    rank has returned, so it cannot be waiting for that one); None when some rank is elsewhere."""
    waiting = _working(ranks)
    if not waiting:
        return None
    cpu = {r.rank: _cpu_seconds(r.process.pid) for r in waiting}
    stacks = _dump_stacks(waiting)
    if len(stacks) < len(waiting) or not all(s.collective for s in stacks.values()):
        return None
    return _Probe(stacks, cpu)


def _same_place(a: _Probe | None, b: _Probe | None) -> bool:
    """Whether two probes found every rank blocked in the same call: the same frames (not one
    collective after another) and next to no CPU used in between (not a slow transfer)."""
    if a is None or b is None or a.stacks.keys() != b.stacks.keys():
        return False
    for k in a.stacks:
        if [(f.file, f.line, f.func) for f in a.stacks[k].frames] != \
                [(f.file, f.line, f.func) for f in b.stacks[k].frames]:
            return False
        if min(a.cpu[k], b.cpu[k]) < 0 or abs(a.cpu[k] - b.cpu[k]) > IDLE_CPU_S:
            return False
    return True


def _collect_stacks(ranks: list[_Rank], output: RankOutput,
                    stacks: dict[int, hang.RankStack] | None = None) -> dict[Any, Any]:
    """Every working rank's stack (asked for now, unless a deadlock probe just read them), then
    every rank killed."""
    stacks = dict(_dump_stacks(_working(ranks)) if stacks is None else stacks)
    for r in ranks:
        _kill(r)
    return stacks


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
