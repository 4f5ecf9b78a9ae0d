"""The isolated process in which ``kit grade`` runs a submission's code (the batch grader only).

The grading parent never imports a submission. It writes a job (notebook copies, seed, the cases
to run) into a fresh folder and starts ``python -m autograder.grade.sandbox JOB`` in a new session. The worker
loads the notebooks with :func:`autograder.loading.load_tasks`, runs each case's untrusted half
``run(impl, seed)`` and saves the plain data it returns with ``torch.save``; the parent reads it
back with ``torch.load(weights_only=True)`` and compares it with the trusted expectation.

Limits, and who enforces them:

* the worker sets its own ``RLIMIT_AS`` (memory), ``RLIMIT_CPU``, ``RLIMIT_FSIZE`` and
  ``RLIMIT_NPROC`` before any submission code runs; ranks it forks inherit them;
* the parent enforces wall time per case, total output size and the number of processes (it
  counts them in the worker's ``pids`` cgroup where it can make one, else in ``/proc``:
  ``RLIMIT_NPROC`` is per user and not enforced for root), and kills the whole group when one is
  exceeded;
* run as root with bubblewrap (``bwrap``) installed, each worker runs in mount, PID, network
  and IPC namespaces of its own as an unprivileged uid of its own (see :func:`sandbox_uid`, dropped
  with util-linux's ``setpriv``). It sees the system directories, the interpreter, the venv and
  the project read-only, a private writable work folder, an empty ``/tmp`` and ``/dev/shm``, and
  a loopback interface of its own (gloo's ranks meet there); nothing of the output folder, the
  run's secret, the submissions, other workers or the host's processes and network. When the
  worker ends, its PID namespace ends with it: nothing it started survives;
* run as root without namespaces (no bubblewrap, or a container that forbids them), grading
  fails closed: :func:`require_sandbox` raises :class:`SandboxUnavailable` (``kit grade`` exits
  with its message, writing nothing) unless the caller passes ``unsandboxed=True``
  (``kit grade --unsandboxed``). Then the worker still runs as its own uid when that uid can run
  the interpreter. Run as another user, the worker keeps that user, and :func:`isolation_note`
  says, in one line, what is missing (documented in CONTRIBUTING.md, reported by ``kit doctor``).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import itertools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Isolation", "Limits", "SandboxUnavailable", "WorkerExit", "isolation", "isolation_note", "refusal",
           "require_sandbox", "run_worker", "sandbox_uid", "unsandboxed_warning"]

UID_BASE = 61000  # unprivileged uids used for sandboxes when grading as root: UID_BASE and up
UID_COUNT = 1000
CONTROL_FD_ENV = "KIT_SANDBOX_CONTROL_FD"


@dataclass(frozen=True)
class Limits:
    """Resource limits of one submission's worker. Sizes in bytes, times in seconds."""

    case_wall_s: float = 60.0  # one case (a hang or infinite loop ends its task)
    memory: int = 6 << 30  # address space per process: torch alone maps ~1.5 GiB
    processes: int = 48  # processes (not threads) alive at once: the worker and its ranks
    threads: int = 1024  # RLIMIT_NPROC counts threads; gloo and torch start many per rank
    file_size: int = 64 << 20
    output: int = 2 << 20  # bytes printed in all


@dataclass
class WorkerExit:
    """How a worker ended: ``reason`` is None for a normal exit, else what the parent killed it for."""

    returncode: int | None
    reason: str | None  # None | "timeout" | "output" | "processes" | "wall"
    last: str | None  # the last control message: "load 0", "case 3", "done"
    output: str
    output_bytes: int
    seconds: float
    messages: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Isolation:
    """What separates a sandboxed worker from the grader on this machine (see :func:`isolation`)."""

    namespaces: bool  # own mount, PID, network and IPC namespaces (bubblewrap)
    own_uid: bool  # an unprivileged uid of its own (UID_BASE and up)
    missing: str | None  # None, or one line: the isolation this machine does not give, and why

    def describe(self) -> str:
        if self.namespaces:
            return (f"bubblewrap: each worker runs as a uid of its own (from {UID_BASE}) in mount, PID and network "
                    "namespaces of its own (read-only project, own loopback)")
        if self.own_uid:
            return f"each worker runs as a uid of its own (from {UID_BASE}); no namespaces"
        return "none: workers run as the grader's own user"


_ISOLATION: list[Isolation] = []  # probed once per process
_ISOLATION_LOCK = threading.Lock()
_PROBE = "import torch, autograder.grade.sandbox"


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _probe(cmd: list[str], **kwargs: Any) -> str | None:
    """None when ``cmd`` runs this interpreter and imports torch, else why not (one line)."""
    try:
        done = subprocess.run(cmd, cwd="/", stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=180, **kwargs)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    if done.returncode == 0:
        return None
    lines = [ln.strip() for ln in (done.stderr or done.stdout).decode(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:200] if lines else f"exit code {done.returncode}"


def isolation() -> Isolation:
    """Probe (once) which isolation this machine gives a worker; the probe imports torch there."""
    with _ISOLATION_LOCK:
        if not _ISOLATION:
            _ISOLATION.append(_probe_isolation())
        return _ISOLATION[0]


def _probe_isolation() -> Isolation:
    if not _is_root():
        found = Isolation(False, False, "not root: workers run as your user, with no namespaces and "
                          "no uid of their own")
    else:
        tools = [shutil.which(t) for t in ("bwrap", "setpriv")]
        if None in tools:
            why = "bubblewrap is not installed (apt-get install bubblewrap)" if tools[0] is None \
                else "setpriv (util-linux) is not installed"
        else:
            work = Path(tempfile.mkdtemp(prefix=f"kit-grade-{os.getpid()}-"))
            nss = _offline_nsswitch()
            try:
                os.chmod(work, 0o711)
                os.chown(work, _uid(0), _uid(0))
                why = _probe(_namespaced(work, _uid(0), [sys.executable, "-I", "-c", _PROBE], (), nss),
                             pass_fds=(nss,))
            finally:
                os.close(nss)
                shutil.rmtree(work, ignore_errors=True)
            why = None if why is None else f"bubblewrap could not start a sandbox here ({why})"
        if why is None:
            found = Isolation(True, True, None)
        else:
            uid = _probe([sys.executable, "-I", "-c", _PROBE], user=_uid(0), group=_uid(0), extra_groups=[])
            found = Isolation(False, uid is None, f"no namespaces: {why}" + (
                "" if uid is None else f"; and uid {_uid(0)} cannot run {sys.executable} (a Python "
                "under a private /root?), so workers run as root"))
    return found


def sandbox_uid(slot: int) -> int | None:
    """The uid a worker in ``slot`` runs as: its own unprivileged uid when grading as root.

    None (the grader's own uid) when not root, or when that uid cannot run this interpreter
    (e.g. Python installed under a private ``/root`` and no namespaces): see :func:`isolation_note`.
    """
    return _uid(slot) if isolation().own_uid else None


_UIDS: dict[int, tuple[int, int]] = {}  # slot -> (uid, fd of its lock, held while this process lives)
_UIDS_LOCK = threading.Lock()


def _uid(slot: int) -> int:
    """The uid reserved for ``slot`` in this process: the first from ``UID_BASE`` no other grader
    on this machine holds. Every process of a worker's uid is killed after it, and ``RLIMIT_NPROC``
    counts per uid: two graders must never share one. The reservation is an ``flock`` on a file
    only root may open, released by the kernel when this process ends, however it ends."""
    with _UIDS_LOCK:
        if slot in _UIDS:
            return _UIDS[slot][0]
        taken = {uid for uid, _ in _UIDS.values()}
        for uid in range(UID_BASE, UID_BASE + UID_COUNT):
            if uid in taken:
                continue
            try:
                fd = os.open(Path(tempfile.gettempdir()) / f"kit-grade-uid-{uid}.lock",
                             os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            os.set_inheritable(fd, False)
            _UIDS[slot] = (uid, fd)
            return uid
        raise RuntimeError(f"all {UID_COUNT} sandbox uids from {UID_BASE} are held by other graders")


def isolation_note() -> str | None:
    """One line naming the isolation a worker lacks on this machine, else None."""
    found = isolation()
    if found.missing is None:
        return None
    return (f"sandbox isolation is incomplete ({found.missing}): limits, the process cap and the "
            "signed records still apply, but a submission could "
            + ("see this machine's files, processes and network" if found.own_uid else
               "read or write your files and signal your processes")
            + ". Grade as root with bubblewrap installed for full isolation.")


class SandboxUnavailable(RuntimeError):
    """Grading as root where no namespaced sandbox can be made: refused (see :func:`require_sandbox`)."""


def _exposure(found: Isolation) -> str:
    if found.own_uid:
        return (f"as uid {UID_BASE} and up with no namespaces: it could read this machine's files (other "
                "students' notebooks included), see its processes and reach its network")
    return ("as root: it could rewrite kit/ and autograder/, read the run's secret and write into the "
            "output folder")


def refusal() -> str | None:
    """None where ``kit grade`` may start workers here; else why it refuses (several lines).

    The one decision of fail-closed grading: as root, a worker must run in bubblewrap's
    namespaces; without them (bubblewrap missing, or a container that forbids namespaces) grading
    is refused unless asked for explicitly. As another user, workers run as that user, as before
    (:func:`isolation_note` says so in one line)."""
    if not _is_root():
        return None
    found = isolation()
    if found.namespaces:
        return None
    return (f"refusing to grade as root without a sandbox ({found.missing}).\n"
            f"  Each submission's code would run {_exposure(found)}.\n"
            "  Fix: install bubblewrap (apt-get install bubblewrap, or make grade-setup) on a machine or "
            "container that may create namespaces (Docker: --privileged; or grade in a VM); `kit doctor` "
            "then shows grading isolation ok.\n"
            "  To grade anyway, trusting every submission: kit grade --unsandboxed "
            "(Python: grade_batch(..., unsandboxed=True)). Nothing was graded or written.")


def require_sandbox(unsandboxed: bool = False) -> Isolation:
    """The isolation workers get here; raises :class:`SandboxUnavailable` where :func:`refusal`
    refuses, unless ``unsandboxed`` (the caller's explicit choice to trust every submission)."""
    why = refusal()
    if why is not None and not unsandboxed:
        raise SandboxUnavailable(why)
    return isolation()


def unsandboxed_warning() -> str | None:
    """The loud warning of ``--unsandboxed`` where it takes effect (root, no sandbox), else None."""
    if refusal() is None:
        return None
    found = isolation()
    return ("WARNING: --unsandboxed: grading as root WITHOUT a sandbox "
            f"({found.missing}).\n"
            f"  WARNING: every submission's code runs {_exposure(found)}.\n"
            "  WARNING: grade only submissions you trust; install bubblewrap (make grade-setup) to "
            "grade safely.")


_SYSTEM = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")


def _inside(path: str, trees: list[str]) -> bool:
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in trees)


def _offline_nsswitch() -> int:
    """A pipe's read end holding this machine's ``/etc/nsswitch.conf`` with every database served
    from files: the sandbox has no network, and a DNS lookup there fails slowly and noisily."""
    try:
        lines = Path("/etc/nsswitch.conf").read_text().splitlines()
    except OSError:
        lines = []
    names = [ln.split(":", 1)[0].strip() for ln in lines if ":" in ln and not ln.lstrip().startswith("#")]
    text = "".join(f"{name}: files\n" for name in dict.fromkeys(names + ["passwd", "group", "hosts"]))
    read_fd, write_fd = os.pipe()
    os.write(write_fd, text.encode())
    os.close(write_fd)
    return read_fd


def _namespaced(workdir: Path, uid: int, argv: list[str], hide: Any, nsswitch_fd: int) -> list[str]:
    """``argv`` run by bubblewrap in namespaces of its own as ``uid``, seeing ``workdir`` writable.

    Read-only: the system directories, the interpreter's prefixes (the venv, the Python it was
    made from) and the project (the folder holding ``autograder/`` and ``kit/``). Each ``hide``
    path that lies inside one of them (the output folder, submissions) is covered by an empty
    folder or ``/dev/null``. ``nsswitch_fd``: from :func:`_offline_nsswitch` (pass it on).
    """
    # The host name is localhost: torchrun and c10d advertise it to ranks, and the only interface
    # in the namespace is the loopback (the host's own name may resolve to an address not there).
    cmd = ["bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--hostname",
           "localhost", "--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    # First the empty places, so that a tree below them (a project cloned under /tmp) stays visible.
    cmd += ["--dev", "/dev", "--proc", "/proc",
            "--perms", "1777", "--tmpfs", "/tmp", "--perms", "1777", "--tmpfs", "/dev/shm"]
    trees: list[str] = []
    for name in _SYSTEM:
        path = Path("/") / name
        if path.is_symlink():
            cmd += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            cmd += ["--ro-bind", str(path), str(path)]
            trees.append(str(path))
    project = Path(__file__).resolve().parents[2]
    wanted = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                            sys.base_exec_prefix, project)}
    made = {"/", "/tmp", "/dev"}
    for tree in sorted(wanted, key=lambda t: (t.count("/"), t)):
        if _inside(tree, trees) or not os.path.isdir(tree):
            continue
        for parent in reversed(Path(tree).parents):  # bwrap would make missing parents 0700
            if str(parent) not in made and not _inside(str(parent), trees):
                cmd += ["--perms", "0755", "--dir", str(parent)]
                made.add(str(parent))
        cmd += ["--ro-bind", tree, tree]
        trees.append(tree)
    gpus = sorted(str(p) for p in Path("/dev").glob("nvidia*"))
    for dev in gpus:  # CUDA cases need the devices and the driver's view of the hardware
        cmd += ["--dev-bind", dev, dev]
    if gpus:
        cmd += ["--ro-bind", "/sys", "/sys"]
    if os.path.exists("/etc/nsswitch.conf"):
        cmd += ["--perms", "0644", "--ro-bind-data", str(nsswitch_fd), "/etc/nsswitch.conf"]
    # The grader's answers (autograder/references/) are for the trusted parent only: the worker
    # runs each case's untrusted half, which never needs them, and cannot reach them at all.
    for path in (*hide, REFERENCES):
        real = os.path.realpath(path)
        if _inside(real, trees) and os.path.exists(real):
            cmd += ["--tmpfs", real] if os.path.isdir(real) else ["--ro-bind", "/dev/null", real]
    work = os.path.realpath(workdir)
    for parent in reversed(Path(work).parents):  # a TMPDIR of its own, under an umask of 077
        if str(parent) not in made and not _inside(str(parent), trees):
            cmd += ["--perms", "0755", "--dir", str(parent)]
            made.add(str(parent))
    cmd += ["--bind", work, work, "--chdir", work,
            "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--",
            "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", *argv]
    return cmd


REFERENCES = Path(__file__).resolve().parents[1] / "references"  # autograder/references/
_SERIAL = itertools.count()
# Join each cgroup given ($1 of them), then become the rest of the command line.
_JOIN = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" 2>/dev/null; shift; n=$((n - 1)); done; exec "$@"'


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
               keep_output: int = 4000, hide: Iterable[Path] = (), unsandboxed: bool = False) -> WorkerExit:
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
    argv = [sys.executable, "-I", "-m", "autograder.grade.sandbox", str(workdir / "job.json")]
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
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, pass_fds=fds, umask=0o077,
                            **drop)
    for fd in fds:
        os.close(fd)
    if not isolation().namespaces:
        cgroups.add(proc.pid)  # before any submission code: the worker first imports torch
    head, tail, count = bytearray(), deque(), [0]
    messages: list[tuple[float, str]] = []
    readers = [threading.Thread(target=_read_output, args=(proc.stdout, head, tail, count, keep_output),
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


# --------------------------------------------------------------------------- the worker side


def _limit_self(limits: dict[str, Any], cases: int) -> None:
    cpu = int(60 + limits["case_wall_s"] * cases)
    for which, value in [(resource.RLIMIT_AS, limits["memory"]), (resource.RLIMIT_CPU, cpu),
                         (resource.RLIMIT_FSIZE, limits["file_size"]), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_NPROC, limits["threads"])]:
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):
            pass
    # Past RLIMIT_FSIZE a write then fails with OSError (EFBIG), reported as the case's error,
    # instead of SIGXFSZ killing the worker.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _exhausted(e: BaseException) -> bool:
    """Out of memory or of processes: running the task's next case would only exhaust them again."""
    text = str(e)
    return isinstance(e, (MemoryError, BlockingIOError)) or "can't allocate memory" in text \
        or "Cannot allocate memory" in text or "Resource temporarily unavailable" in text


class _NoReferences:
    """A finder that refuses ``autograder.references`` (the grader's answers) in the worker."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname == "autograder.references" or fullname.startswith("autograder.references."):
            raise ModuleNotFoundError(f"{fullname} is not available to a submission", name=fullname)
        return None


_MADV_COLLAPSE = 25  # <linux/mman.h>, since Linux 6.1
_HUGE = 2 << 20


def _collapse_anonymous_memory() -> int:
    """Back this process's private anonymous memory (the malloc heap, Python's arenas, torch's
    blocks) with 2 MiB pages where the kernel can, with ``madvise(MADV_COLLAPSE)``; return the
    bytes of the ranges collapsed whole (0 where the kernel has no MADV_COLLAPSE: before 6.1).
    MADV_COLLAPSE leaves areas marked no-huge-pages alone (thread stacks since Linux 6.7).

    Every rank is forked from this worker. fork copies a page-table entry for each 4 KiB page the
    worker holds, and the rank's exit drops them again; a 2 MiB page takes one entry. With every
    lesson loaded (about 300 MB), a bare fork and exit went from 26 to 11 CPU-ms on 2 cores, and
    a 4-rank launch's ranks from 32 to 25 CPU-ms each. A full sandboxed submission, 10 alternating
    pairs, took 1.4 CPU-s less on average (about 4%). The first call copies ~250 MB into huge
    pages (0.6 CPU-s); later calls only collapse what grew or was split since.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        with open("/proc/self/maps") as f:
            maps = f.read().splitlines()
    except (OSError, AttributeError):
        return 0
    collapsed = 0
    for line in maps:
        fields = line.split()
        if len(fields) > 5 and fields[5] != "[heap]":
            continue  # a file, [stack], [vdso]: not the process's private heap
        if not fields[1].startswith("rw") or fields[1][3] != "p":
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        start, end = (lo + _HUGE - 1) & ~(_HUGE - 1), hi & ~(_HUGE - 1)
        if end - start < _HUGE:
            continue
        if madvise(start, end - start, _MADV_COLLAPSE) == 0:
            collapsed += end - start
    return collapsed


def _worker(job_path: str) -> int:
    os.dup2(1, 2)  # one stream: the parent caps its size
    job = json.loads(Path(job_path).read_text())
    _limit_self(json.loads(os.environ["KIT_SANDBOX_LIMITS"]), len(job["cases"]))
    control = os.fdopen(int(os.environ.pop(CONTROL_FD_ENV)), "w", buffering=1)
    out = Path(job_path).parent / "results"
    out.mkdir(exist_ok=True)

    # With namespaces, autograder/references/ is an empty folder here. Without them (a grader
    # without bubblewrap: kit doctor says so), at least no import of it succeeds in this process.
    sys.meta_path.insert(0, _NoReferences())

    import torch

    from autograder import gates
    from autograder.registry import get_task
    from autograder.results import FORBIDDEN, NOT_IMPLEMENTED, raised

    def save(key: str, record: dict[str, Any]) -> None:
        tmp = out / f".{key}.tmp"
        try:
            torch.save(record, tmp)
        except Exception as e:  # the data holds something torch cannot serialise
            torch.save({"status": "error", "message": "the result could not be sent back as plain "
                        f"data ({type(e).__name__}: {e})"}, tmp)
        os.replace(tmp, out / f"{key}.pt")

    from autograder.loading import load_tasks

    gates.trust_answer_fingerprints(job.get("reference_prints", {}), job.get("reference_shapes", {}))
    worker = os.getpid()
    modules: dict[int, Any] = {}

    def load(lesson: int, notebook: str) -> Any:
        control.write(f"load {lesson}\n")
        try:
            module = load_tasks(notebook, lesson=lesson)
            report = module.__load_report__
            info = {"missing": report.missing, "notes": report.notes}
        except BaseException as e:  # noqa: BLE001 - a submission may raise SystemExit at import
            if os.getpid() != worker:
                os._exit(1)
            module, info = None, {"error": f"{type(e).__name__}: {e}"}
        (Path(job_path).parent / f"load-{lesson}.json").write_text(json.dumps(info))
        # What exists now (torch, the libraries, the notebooks loaded so far) lives as long as
        # this worker: move it out of the collector's reach. A full collection walked all of it
        # (0.3 s with the fourteen lessons loaded), in this worker and in every rank forked from
        # it, writing to each object and so copying its page in a rank; frozen, the objects are
        # skipped (gc.freeze, as the gc docs advise before fork()). A sandboxed full submission
        # took 15% less CPU, 4 runs each on 2 cores. The young generations go first, so little
        # garbage is frozen with the rest; what is frozen is freed when the worker exits.
        gc.collect(1)
        gc.freeze()
        _collapse_anonymous_memory()  # cheaper forks for this lesson's ranks: see there
        return module

    # Each lesson is loaded just before its own cases run, not all of them first: a lesson's
    # imports (RDKit and PyG in Lesson 10) then do not grow the process that every earlier
    # lesson's ranks are forked from (fork copies the page tables: 12 ms per fork from torch
    # alone, 32 ms with all fourteen lessons loaded, on 2 cores), and no notebook's import-time
    # side effects reach an earlier lesson's cases.
    notebooks = {lesson: notebook for lesson, notebook in job["notebooks"]}
    skip: dict[str, dict[str, Any]] = {}  # task id -> the record its remaining cases get
    # A task's cases share its trampolines (gates.watching); they come off before the next task's
    # cases, and before a notebook is loaded, as check() does.
    watched, watch = None, contextlib.ExitStack()
    for task_id, index, key in job["cases"]:
        if task_id != watched:
            watch.close()
            watched = None
        task = get_task(task_id)
        case = task.cases[index]
        if task.lesson not in modules and task.lesson in notebooks:
            modules[task.lesson] = load(task.lesson, notebooks[task.lesson])
        module = modules.get(task.lesson)
        if module is None:
            continue
        if task_id in skip:  # a stub only raises again; a memory or fork bomb only explodes again
            save(key, skip[task_id])
            continue
        control.write(f"case {key}\n")
        impl = getattr(module, task.name, None)
        if watched is None:
            watch.enter_context(gates.watching())
            watched = task_id
        start = time.perf_counter()
        try:
            with gates.guard(task, impl):  # what the task re-implements scores it 0, as in check()
                record = {"status": "ok", "data": case.run(impl, job["seed"])}
        except BaseException as e:  # noqa: BLE001 - SystemExit too: it ends this case only
            # The same result model as check(): only its plain fields travel back.
            result = raised(task, case, e, time.perf_counter() - start)
            record = {"status": result.status, "message": result.message,
                      "details": result.details[-4000:]}
            if result.status in (NOT_IMPLEMENTED, FORBIDDEN):  # running it again changes nothing
                skip[task_id] = record
            elif _exhausted(e):
                skip[task_id] = {"status": "error", "message": "not run: an earlier case of this "
                                 f"task ran out of resources ({result.message[:300]})"}
        if os.getpid() != worker:  # a child the submission forked got back here: it must not report
            os._exit(1)
        record["seconds"] = time.perf_counter() - start
        save(key, record)
    watch.close()
    control.write("done\n")
    control.flush()
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    code = _worker(sys.argv[1])
    # Every result is on disk (each written whole with os.replace) and every stream flushed: skip
    # the interpreter's teardown (torch's, the libraries' and the submission's atexit work, and
    # threads it left behind), which took about 2 s of every submission's time.
    os._exit(code)
