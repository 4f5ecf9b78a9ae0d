"""The isolated process in which ``kit grade`` runs a submission's code (the batch grader only).

The grading parent never imports a submission. It writes a job (notebook copies, seed, the cases
to run) into a fresh folder and starts ``python -m autograder.grade.sandbox JOB`` in a new session.
The worker loads the notebooks with :func:`autograder.loading.load_tasks`, runs each case's
untrusted half
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
  says, in one line, what is missing (documented in README.md, reported by ``kit doctor``).

Split by concern: this module decides which isolation a worker gets (the probe, the uids, the
fail-closed refusal); :mod:`.namespaces` builds bubblewrap's command line; :mod:`.processes`
counts, caps and kills a worker's processes (cgroups, ``/proc``); :mod:`.run` is the grading
parent's side (starting a worker, its limits, its folder); :mod:`.worker` is the worker itself
(``python -m autograder.grade.sandbox JOB``).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Isolation", "Limits", "SandboxUnavailable", "WorkerExit", "isolation", "isolation_note",
           "make_workdir", "refusal", "remove_stale_workdirs", "remove_workdir", "require_sandbox",
           "run_worker", "sandbox_uid", "unsandboxed_warning"]

UID_BASE = 61000  # unprivileged uids used for sandboxes when grading as root: UID_BASE and up
UID_COUNT = 1000
CONTROL_FD_ENV = "KIT_SANDBOX_CONTROL_FD"

@dataclass(frozen=True)
class Isolation:
    """What separates a sandboxed worker from the grader on this machine (see :func:`isolation`)."""

    namespaces: bool  # own mount, PID, network and IPC namespaces (bubblewrap)
    own_uid: bool  # an unprivileged uid of its own (UID_BASE and up)
    missing: str | None  # None, or one line: the isolation this machine does not give, and why

    def describe(self) -> str:
        if self.namespaces:
            return (f"bubblewrap: each worker runs as a uid of its own (from {UID_BASE}) in mount, "
                    "PID and network namespaces of its own (read-only project, own loopback)")
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
    lines = [ln.strip() for ln in (done.stderr or done.stdout).decode(errors="replace").splitlines()
             if ln.strip()]
    return lines[-1][:200] if lines else f"exit code {done.returncode}"


def isolation() -> Isolation:
    """Probe (once) which isolation this machine gives a worker; the probe imports torch there."""
    with _ISOLATION_LOCK:
        if not _ISOLATION:
            _ISOLATION.append(_probe_isolation())
        return _ISOLATION[0]


def _probe_isolation() -> Isolation:
    if not _is_root():
        found = Isolation(False, False,
                          "not root: workers run as your user, with no namespaces and "
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
                why = _probe(_namespaced(work, _uid(0), python_argv(_PROBE), (), nss),
                             pass_fds=(nss,))
            finally:
                os.close(nss)
                shutil.rmtree(work, ignore_errors=True)
            why = None if why is None else f"bubblewrap could not start a sandbox here ({why})"
        if why is None:
            found = Isolation(True, True, None)
        else:
            uid = _probe(python_argv(_PROBE), user=_uid(0), group=_uid(0), extra_groups=[])
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


# slot -> (uid, fd of its lock, held while this process lives)
_UIDS: dict[int, tuple[int, int]] = {}
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
        raise RuntimeError(f"all {UID_COUNT} sandbox uids from {UID_BASE} are held by other "
                           "graders")


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
    """Grading as root where no namespaced sandbox can be made: refused (see
    :func:`require_sandbox`)."""


def _exposure(found: Isolation) -> str:
    if found.own_uid:
        return (f"as uid {UID_BASE} and up with no namespaces: it could read this machine's files "
                "(other students' notebooks included), see its processes and reach its network")
    return ("as root: it could rewrite kit/ and autograder/, read the run's secret and write into "
            "the output folder")


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
            "  Fix: install bubblewrap (apt-get install bubblewrap, or make grade-setup) on a "
            "machine or container that may create namespaces (Docker: --privileged; or grade in a "
            "VM); `kit doctor` then shows grading isolation ok.\n"
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



# What the probe needs, and the parent's side (which uses the isolation above).
from autograder.grade.sandbox.namespaces import (  # noqa: E402
    _namespaced,
    _offline_nsswitch,
    python_argv,
)
from autograder.grade.sandbox.run import (  # noqa: E402
    Limits,
    WorkerExit,
    make_workdir,
    remove_stale_workdirs,
    remove_workdir,
    run_worker,
)
