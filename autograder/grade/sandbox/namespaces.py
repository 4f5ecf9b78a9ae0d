"""bubblewrap's command line for one worker: what it sees, read-only or writable, and as whom."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

# The folder holding this grader's autograder/ and kit/ (a checkout, or site-packages).
PROJECT = Path(__file__).resolve().parents[3]


def python_argv(code: str, *args: str) -> list[str]:
    """This interpreter running ``code``, isolated (``-I``: no PYTHONPATH, user site or current
    folder on the path) but with this grader's own project first on ``sys.path``: a worker runs
    the very autograder that started it (a copy of the course, or an editable install that points
    elsewhere, cannot send it to other code), and nothing from the environment."""
    boot = f"import sys; sys.path.insert(0, {str(PROJECT)!r}); {code}"
    return [sys.executable, "-I", "-c", boot, *args]


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
    names = [ln.split(":", 1)[0].strip() for ln in lines if ":" in ln
             and not ln.lstrip().startswith("#")]
    text = "".join(f"{name}: files\n"
                   for name in dict.fromkeys(names + ["passwd", "group", "hosts"]))
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
    cmd = ["bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
           "--hostname",
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
    project = PROJECT
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



REFERENCES = PROJECT / "autograder" / "references"  # the grader's answers
