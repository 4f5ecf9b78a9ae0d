"""The rank side of :func:`kit.launch`: what runs inside each started process.

The parent (``kit/launcher.py``) starts one process per rank with :func:`rank_main`. It sets up
what ``torchrun`` would (environment, default process group), runs the user's function, sends
the outcome back as plain bytes, and waits for the parent's release before destroying the
group, so a rank that returns early cannot tear down peers still inside a collective.
"""

from __future__ import annotations

import ctypes
import faulthandler
import io
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import cloudpickle

from kit import recorder  # imported here, once: forked ranks inherit it instead of importing it

OK, ERROR, EXIT = "ok", "error", "exit"
STOP = b"stop"  # a persistent rank's last command
# Frames of the wrappers persistent ranks run a call in (kit.Ranks restoring the file name, the
# grading pool's reset): a traceback starts below them, at the user's function, as in kit.launch.
_WRAPPERS = ("_with_source", "_pooled")


class RankMessage(NamedTuple):
    """What a rank sends on its result connection when its function is done (plain data)."""

    kind: str  # OK, ERROR or EXIT
    body: Any  # OK: the pickled return value; ERROR: (type, message, traceback); EXIT: repr(code)
    seconds: float  # how long the function ran
    at: float = 0.0  # time.monotonic() when it finished: the parent orders failures by it


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs that is not the user's function (all picklable)."""

    rank: int
    world_size: int
    backend: str
    master_addr: str
    master_port: int
    pg_timeout_s: float
    stack_path: str
    parent_pid: int
    env: dict[str, str]
    persistent: bool = False  # kit.Ranks: serve calls until told to stop


def _die_with_parent(parent_pid: int) -> None:
    """Never outlive the kernel: SIGKILL on parent death (Linux), else a watchdog thread."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent_pid:  # parent already gone before prctl took effect
            os._exit(1)
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="kit-parent-watchdog", daemon=True).start()


def _redirect_output(out: Connection, err: Connection) -> None:
    # fd-level, so output from C++ (gloo, NCCL) and from subprocesses is captured too.
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True)


def _send(conn: Connection, message: RankMessage) -> None:
    try:
        conn.send_bytes(cloudpickle.dumps(message))
    except (BrokenPipeError, OSError):  # parent gone or stopping us: nothing to report to
        pass


def _encode_return(value: Any) -> tuple[str, Any]:
    try:
        return OK, cloudpickle.dumps(value)
    except Exception as e:  # noqa: BLE001 - any pickling failure is the user's to see
        return ERROR, (
            "TypeError",
            f"the return value ({type(value).__name__}) cannot be sent back to the notebook: {e}. "
            "Return tensors, numbers, strings or containers of them.",
            "",
        )


def _failed(e: BaseException, started: float) -> RankMessage:
    frames = e.__traceback__.tb_next if e.__traceback__ else None  # skip ours
    while frames is not None and frames.tb_frame.f_code.co_name in _WRAPPERS:
        frames = frames.tb_next
    tb = "".join(traceback.format_exception(type(e), e, frames))
    return RankMessage(ERROR, (type(e).__qualname__, str(e), tb), time.perf_counter() - started)


def _call(payload: Any, started: float, *, interruptible: bool = False) -> RankMessage:
    """Run one ``(fn, args, kwargs)`` payload (pickled or not) and say how it ended.

    ``interruptible``: SIGINT (which the parent forwards when the kernel is interrupted) raises
    KeyboardInterrupt in the function, so a persistent rank stops at a Python line and keeps its
    state; between calls SIGINT stays ignored.
    """
    if interruptible:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        fn, args, kwargs = cloudpickle.loads(payload) if isinstance(payload, bytes) else payload
        value = fn(*args, **kwargs)
        kind, body = _encode_return(value)
        return RankMessage(kind, body, time.perf_counter() - started)
    except SystemExit as e:
        code = e.code
        if code is None or code == 0:
            return RankMessage(OK, cloudpickle.dumps(None), time.perf_counter() - started)
        return RankMessage(EXIT, repr(code), time.perf_counter() - started)
    except BaseException as e:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        return _failed(e, started)
    finally:
        if interruptible:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.stdout.flush()
        sys.stderr.flush()


def _serve(result: Connection) -> None:
    """A persistent rank's loop: each command is one pickled call; ``b"stop"`` (or the parent
    closing the connection) ends it. Globals, modules and the process group live on between
    calls."""
    while True:
        try:
            data = result.recv_bytes()
        except (EOFError, OSError):
            return
        if data == STOP:
            return
        message = _call(data, time.perf_counter(), interruptible=True)
        _send(result, message._replace(at=time.monotonic()))


def rank_main(spec: RankSpec, payload: bytes | tuple, result: Connection,
              out: Connection, err: Connection, listener: socket.socket | None,
              store_ready: Any) -> None:
    """Entry point of one rank (runs in the child process)."""
    try:
        os.setpgid(0, 0)  # own process group: the parent kills it whole (DataLoader workers too)
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel's interrupt is the parent's to handle
    _die_with_parent(spec.parent_pid)
    _redirect_output(out, err)
    # A crash (segfault, abort) writes the Python stack to a file the parent cleans up and shows;
    # SIGUSR1 (sent at a timeout) dumps every thread's stack for the hang report.
    crash_file = open(spec.stack_path + ".crash", "w")  # noqa: SIM115 - kept open for the handler
    faulthandler.enable(file=crash_file, all_threads=False)
    stack_file = open(spec.stack_path, "w")  # noqa: SIM115 - kept open for the signal handler
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update(spec.env)

    import torch
    import torch.distributed as dist

    # torchrun's default of one intra-op thread per rank (forked ranks inherit the kernel's pool).
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1") or 1)))

    persistent = spec.persistent
    started = time.perf_counter()
    message: RankMessage
    try:
        if spec.backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        # Rank 0 serves the store on the socket the parent opened (see kit/launcher.py). The others
        # connect once it serves: a connection queued before the server starts can sit unanswered
        # until the client's retry, seconds later.
        timeout = timedelta(seconds=spec.pg_timeout_s)
        if listener is not None:
            store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, True,
                                  timeout, wait_for_workers=False,
                                  master_listen_fd=listener.detach())
            store_ready.set()
        else:
            store_ready.wait(spec.pg_timeout_s)
            store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, False,
                                  timeout)
        # Record every operation below Python (kit/recorder.py); KIT_RECORDER=0 measures without.
        if spec.backend == "gloo" and os.environ.get("KIT_RECORDER", "1") != "0":
            recorder.install()
        dist.init_process_group(spec.backend, store=store, rank=spec.rank,
                                world_size=spec.world_size,
                                timeout=timedelta(seconds=spec.pg_timeout_s))
    except BaseException as e:  # noqa: BLE001 - the group never formed: report it as the call's
        message = _failed(e, started)
    else:
        message = _call(payload, started, interruptible=persistent)
    sys.stdout.flush()
    sys.stderr.flush()
    # CLOCK_MONOTONIC is system-wide: the parent orders failures by when they happened.
    _send(result, message._replace(at=time.monotonic()))
    if persistent and dist.is_initialized():
        _serve(result)  # kit.Ranks: more calls on the same group until the parent says stop
    elif message.kind == OK:
        # Hold the group until every rank has returned (the parent says so), like a final barrier
        # that cannot itself deadlock: a peer still in a collective keeps its connections.
        try:
            result.recv_bytes()
        except (EOFError, OSError):
            pass
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if message.kind == OK or persistent else 1)
