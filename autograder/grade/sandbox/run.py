"""The grading parent's side: start one worker on a job folder, enforce its limits, read it back."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autograder.grade.sandbox import CONTROL_FD_ENV, isolation, require_sandbox, sandbox_uid
from autograder.grade.sandbox.namespaces import _namespaced, _offline_nsswitch, python_argv
from autograder.grade.sandbox.processes import _Cgroups, _kill_all, _ProcessCounter, _set_subreaper


@dataclass(frozen=True)
class Limits:
    """Resource limits of one submission's worker. Sizes in bytes, times in seconds."""

    case_wall_s: float = 60.0  # one case (a hang or infinite loop ends its task)
    memory: int = 6 << 30  # address space per process: torch alone maps ~1.5 GiB
    processes: int = 48  # processes (not threads) alive at once: the worker and its ranks
    threads: int = 1024  # RLIMIT_NPROC counts threads; gloo and torch start many per rank
    file_size: int = 64 << 20
    output: int = 2 << 20  # bytes printed in all
    # A task's shared launches of one world size run on ranks forked once for the task
    # (autograder/pool.py) instead of fresh ranks per launch: the same scores, less CPU.
    rank_pool: bool = False


@dataclass
class WorkerExit:
    """How a worker ended: ``reason`` is None for a normal exit, else what the parent killed it
    for."""

    returncode: int | None
    reason: str | None  # None | "timeout" | "output" | "processes" | "wall"
    last: str | None  # the last control message: "load 0", "case 3", "done"
    output: str
    output_bytes: int
    seconds: float
    messages: list[str] = field(default_factory=list)



_SERIAL = itertools.count()
# Join each cgroup given ($1 of them), then become the rest of the command line.
_JOIN = ('n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" 2>/dev/null; shift; n=$((n - 1)); '
         'done; exec "$@"')


def _read_output(stream: Any, head: bytearray, tail: deque, count: list[int], keep: int) -> None:
    for chunk in iter(lambda: stream.read1(65536), b""):
        count[0] += len(chunk)
        if len(head) < keep:
            head += chunk[: keep - len(head)]
        tail.append(chunk)
        while sum(map(len, tail)) > keep * 2 and len(tail) > 1:
            tail.popleft()


def _read_control(fd: int, messages: list[tuple[float, str]]) -> None:
    with os.fdopen(fd, "rb") as f:
        for line in f:
            messages.append((time.monotonic(), line.decode(errors="replace").strip()[:200]))


def run_worker(workdir: Path, limits: Limits, *, slot: int = 0, cases: int = 1,
               keep_output: int = 4000, hide: Iterable[Path] = (),
               unsandboxed: bool = False) -> WorkerExit:
    """Run ``python -m autograder.grade.sandbox workdir/job.json`` under ``limits`` and wait for it.

    ``workdir`` holds the job and receives the results; it is handed to the worker's uid.
    ``cases`` bounds the total wall time (``case_wall_s`` per case, plus start-up). ``hide``:
    paths the worker must not see even where they lie inside the project it sees read-only
    (the output folder, the submissions); with namespaces they are covered, else they rely on
    the worker's uid. As root with no namespaces it raises :class:`SandboxUnavailable` before
    anything runs, unless ``unsandboxed`` (see :func:`require_sandbox`).
    """
    require_sandbox(unsandboxed)
    _set_subreaper()
    uid = sandbox_uid(slot)
    if uid is not None:
        for path in [workdir, *workdir.rglob("*")]:
            os.chown(path, uid, uid) if path.is_dir() else None
    read_fd, write_fd = os.pipe()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workdir),
           "TMPDIR": str(workdir), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONHASHSEED": "0", CONTROL_FD_ENV: str(write_fd),
           "KIT_SANDBOX_LIMITS": json.dumps(limits.__dict__)}
    argv = python_argv("from autograder.grade.sandbox.worker import main; main()",
                       str(workdir / "job.json"))
    cgroups = _Cgroups(f"kit-grade-{os.getpid()}-{slot}-{next(_SERIAL)}", limits)
    fds = [write_fd]
    if isolation().namespaces:
        fds.append(_offline_nsswitch())
        env["GLOO_SOCKET_IFNAME"] = "lo"  # the only interface in the worker's network namespace
        # A shell joins the cgroups and becomes bwrap: everything the sandbox starts is counted from
        # its first fork. setpriv kills bwrap if this grader dies; bwrap then ends the namespace.
        cmd = ["/bin/sh", "-c", _JOIN, "sh", str(len(cgroups.paths)),
               *[str(path / "cgroup.procs") for path in cgroups.paths],
               "setpriv", "--pdeathsig", "KILL", *_namespaced(workdir, uid, argv, hide, fds[1])]
        drop = {}
    else:
        cmd = argv
        drop = {"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}
    start = time.monotonic()
    # umask: the worker's files are its own whatever the grader's shell had (077 or 000)
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, pass_fds=fds,
                            umask=0o077,
                            **drop)
    for fd in fds:
        os.close(fd)
    if not isolation().namespaces:
        cgroups.add(proc.pid)  # before any submission code: the worker first imports torch
    head, tail, count = bytearray(), deque(), [0]
    messages: list[tuple[float, str]] = []
    readers = [threading.Thread(target=_read_output,
                                args=(proc.stdout, head, tail, count, keep_output),
                                daemon=True),
               threading.Thread(target=_read_control, args=(read_fd, messages), daemon=True)]
    for t in readers:
        t.start()
    total_wall = 60.0 + limits.case_wall_s * cases
    counter = _ProcessCounter(proc.pid, uid, cgroups)
    reason = None
    polls = 0
    while proc.poll() is None:
        time.sleep(0.02)
        polls += 1
        now = time.monotonic()
        since = messages[-1][0] if messages else start
        if now - since > limits.case_wall_s + (30.0 if not messages else 0.0):
            reason = "timeout"
        elif now - start > total_wall:
            reason = "wall"
        elif count[0] > limits.output:
            reason = "output"
        elif polls % 3 == 0 and counter.count() > limits.processes:
            reason = "processes"
        if reason:
            break
    _kill_all(proc.pid, uid, cgroups)
    proc.wait()
    cgroups.remove()
    for t in readers:
        t.join(timeout=2.0)
    text = bytes(head).decode(errors="replace")
    rest = b"".join(tail).decode(errors="replace")
    if count[0] > len(head):
        text += "\n...\n" + rest[-keep_output:]
    code = proc.returncode
    if isolation().namespaces and code is not None and 128 < code <= 128 + 64:
        code = 128 - code  # bwrap reports a child killed by signal N as 128 + N: as Popen would, -N
    return WorkerExit(code, reason, messages[-1][1] if messages else None, text,
                      count[0], time.monotonic() - start, [m for _, m in messages])


def _work_base() -> str:
    """Where worker folders go: the temporary directory, unless a worker of its own uid could not
    reach it there (a private ``TMPDIR``, without namespaces to mount it): then ``/tmp``."""
    base = tempfile.gettempdir()
    if sandbox_uid(0) is None or isolation().namespaces:
        return base
    reachable = all(os.stat(p).st_mode & 0o001 for p in [base, *map(str, Path(base).parents)])
    return base if reachable else "/tmp"


def make_workdir() -> Path:
    """A fresh private folder for one worker run (removed with :func:`remove_workdir`)."""
    path = Path(tempfile.mkdtemp(prefix=f"kit-grade-{os.getpid()}-", dir=_work_base()))
    os.chmod(path, 0o711 if sandbox_uid(0) is not None else 0o700)
    return path


def remove_workdir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def remove_stale_workdirs() -> None:
    """Remove the worker folders of grading runs that were killed (their grader pid is gone)."""
    for old in Path(_work_base()).glob("kit-grade-*-*"):
        try:
            os.kill(int(old.name.split("-")[2]), 0)
        except ValueError:
            continue
        except ProcessLookupError:
            remove_workdir(old)
        except OSError:
            continue

