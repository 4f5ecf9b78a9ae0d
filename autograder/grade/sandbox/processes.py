"""A worker's processes: counted (its cgroup, else ``/proc``), capped, killed and reaped."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autograder.grade.sandbox.run import Limits

import ctypes
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any


def _set_subreaper() -> None:
    # Orphans of a worker (a fork bomb's children) are re-parented here, not to an init that may
    # never reap them; we kill and reap them after each worker.
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
        except (OSError, AttributeError):
            pass


def _proc_stat(pid: str) -> tuple[int, str, int] | None:
    """(session id, state, parent pid) of a process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may contain spaces
    return int(fields[3]), fields[0], int(fields[1])


def _members(pid: int, uid: int | None) -> list[int]:
    """Live processes of a worker: every process of its uid, else of its session."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            owner = os.stat(f"/proc/{name}").st_uid
        except OSError:
            continue
        stat = _proc_stat(name)
        if stat is None or stat[1] == "Z":
            continue
        if (uid is not None and owner == uid) or (uid is None and stat[0] == pid):
            found.append(int(name))
    return found


class _ProcessCounter:
    """Counts a running worker's processes for the ``processes`` limit, every 60 ms.

    Once the worker's own ``pids`` cgroup holds it, that cgroup's member list is the count: the
    kernel puts every process the worker starts there, and an unprivileged uid cannot move one
    out. Reading it took 0.2 ms; a scan of ``/proc`` (every process on the machine, its owner
    and state) took 1.7 ms, 0.75 CPU-s of a full submission's 30 s. Until then (the worker has not
    joined it yet, or joining failed), and where there is no such cgroup, each count scans
    ``/proc`` as well. Killing (:func:`_kill_all`) always scans ``/proc``.
    """

    def __init__(self, pid: int, uid: int | None, cgroups: _Cgroups):
        self.pid, self.uid, self.cgroups = pid, uid, cgroups
        self.joined = False  # the worker is in its pids cgroup

    def count(self) -> int:
        if "pids" in self.cgroups.controllers:
            members = self.cgroups.members_of("pids")
            self.joined = self.joined or self.pid in members
            if self.joined:
                return len(members)
        return len(set(_members(self.pid, self.uid)) | set(self.cgroups.members()))


def _kill_all(pid: int, uid: int | None, cgroups: _Cgroups) -> None:
    with _suppress():
        os.killpg(pid, signal.SIGKILL)
    for _ in range(200):  # a fork bomb may fork between the scan and the kill: repeat
        members = {p for p in _members(pid, uid) + cgroups.members() if p != os.getpid()}
        if not members:
            break
        for p in members:
            with _suppress():
                os.kill(p, signal.SIGKILL)
        time.sleep(0.01)
    _reap_orphans(pid)


def _reap_orphans(worker: int) -> None:
    me = os.getpid()
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != worker:
            stat = _proc_stat(name)
            if stat and stat[1] == "Z" and stat[2] == me:
                with _suppress():
                    os.waitpid(int(name), os.WNOHANG)


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return exc[0] is not None and issubclass(exc[0], (OSError, ChildProcessError))


class _Cgroups:
    """Per-worker cgroups (v1 ``pids`` and ``memory``) where this process may create them (root).

    ``pids.max`` caps processes and threads of the worker and everything it starts, even as root
    (which ``RLIMIT_NPROC`` does not); ``memory.limit_in_bytes`` caps their memory together.
    Each controller is optional: without it, the rlimits and the parent's process count remain.
    """

    def __init__(self, name: str, limits: Limits):
        self.paths: list[Path] = []
        self.controllers: dict[str, Path] = {}  # "pids" / "memory" -> the worker's cgroup
        own = {}
        try:
            for line in Path("/proc/self/cgroup").read_text().splitlines():
                _, controllers, where = line.split(":", 2)
                for c in controllers.split(","):
                    own[c] = where
        except OSError:
            return
        for controller, setting, value in [("pids", "pids.max", limits.threads),
                                           ("memory", "memory.limit_in_bytes", limits.memory)]:
            path = Path("/sys/fs/cgroup") / controller / own.get(controller, "/").lstrip("/") / name
            _remove_stale(path.parent)
            try:
                path.mkdir()
                (path / setting).write_text(str(value))
                self.paths.append(path)
                self.controllers[controller] = path
            except OSError:
                with _suppress():
                    path.rmdir()

    def add(self, pid: int) -> None:
        for path in self.paths:
            with _suppress():
                (path / "cgroup.procs").write_text(str(pid))

    def members(self) -> list[int]:
        found: set[int] = set()
        for path in self.paths:
            found |= set(self._procs(path))
        return sorted(found)

    def members_of(self, controller: str) -> list[int]:
        """The processes in this worker's cgroup of ``controller`` (empty if it has none)."""
        path = self.controllers.get(controller)
        return self._procs(path) if path is not None else []

    @staticmethod
    def _procs(path: Path) -> list[int]:
        with _suppress():
            return [int(p) for p in (path / "cgroup.procs").read_text().split()]
        return []

    def remove(self) -> None:
        for path in self.paths:
            for _ in range(100):
                try:
                    pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
                except OSError:
                    pids = []
                for pid in pids:
                    with _suppress():
                        os.kill(pid, signal.SIGKILL)
                try:
                    path.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)


def _remove_stale(parent: Path) -> None:
    """Empty the cgroups of grading runs that were killed (their grader pid is gone)."""
    for old in parent.glob("kit-grade-*-*-*"):
        try:
            grader = int(old.name.split("-")[2])
            os.kill(grader, 0)
        except (ValueError, ProcessLookupError):
            stale = _Cgroups.__new__(_Cgroups)
            stale.paths = [old]
            stale.remove()
        except OSError:
            continue


