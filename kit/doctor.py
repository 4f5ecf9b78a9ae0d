"""``kit doctor``: can this machine run the course? A table of checks, each with its fix.

Exit code 1 when a blocking problem is found (the course cannot launch ranks, or, as root without a
sandbox, `kit grade` would refuse a batch), 0 otherwise.
Run it first on a new laptop, and when a launch fails in a way the error does not explain.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import platform
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass
class Finding:
    check: str
    status: str
    detail: str
    fix: str = ""


def _version(dist_name: str) -> str | None:
    try:
        return md.version(dist_name)
    except md.PackageNotFoundError:
        return None


def check_python() -> Finding:
    v = sys.version_info
    status = OK if v >= (3, 10) else FAIL
    return Finding("Python", status, platform.python_version(),
                   "" if status == OK else "install Python 3.10 or newer")


def check_torch() -> Finding:
    try:
        import torch
    except ImportError:
        return Finding("PyTorch", FAIL, "not installed",
                       "run `make lab` (it installs torch==2.13.0 first)")
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    return Finding("PyTorch", OK, f"{torch.__version__} ({build})")


def check_backends() -> list[Finding]:
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return [Finding("torch.distributed", FAIL, "not compiled in",
                        "install an official torch wheel")]
    gloo = Finding("gloo backend", OK if dist.is_gloo_available() else FAIL,
                   "available" if dist.is_gloo_available() else "missing",
                   "" if dist.is_gloo_available() else "install an official torch wheel")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dist.is_nccl_available() and gpus:
        nccl = Finding("nccl backend / GPUs", OK, f"{gpus} GPU(s); nccl available")
    elif gpus:
        nccl = Finding("nccl backend / GPUs", WARN, f"{gpus} GPU(s) but no nccl",
                       "install a CUDA build of torch to use backend='nccl'")
    else:
        nccl = Finding("nccl backend / GPUs", OK, "no GPU: lessons use gloo on CPU",
                       "optional: a GPU box runs the 'Running at scale' notes with nccl")
    return [gloo, nccl]


def check_fork() -> Finding:
    from kit.launcher import default_start_method

    method = default_start_method("gloo")
    if method == "fork":
        return Finding("start method", OK, "fork (fast launches)")
    return Finding("start method", WARN,
                   f"{method} (each launch re-imports torch: seconds, not ms)",
                   "expected on macOS/Windows or after CUDA init; launches still work")


def check_loopback() -> Finding:
    import socket

    try:
        with socket.create_server(("127.0.0.1", 0)) as server:
            port = server.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
    except OSError as e:
        return Finding("loopback + free port", FAIL, f"cannot connect on 127.0.0.1: {e}",
                       "allow local TCP connections (firewall/VPN), check `ping 127.0.0.1`")
    return Finding("loopback + free port", OK, f"127.0.0.1:{port} (OS-chosen)")


def check_shm() -> Finding:
    if not os.path.isdir("/dev/shm"):
        if sys.platform.startswith("linux"):
            return Finding("/dev/shm", WARN, "missing",
                           "DataLoader workers need shared memory: mount /dev/shm")
        return Finding("/dev/shm", OK, "not used on this platform")
    free = shutil.disk_usage("/dev/shm").free / 2**20
    if free < 256:
        return Finding("/dev/shm", WARN, f"{free:.0f} MiB free",
                       "give the container more shared memory (docker --shm-size=1g)")
    return Finding("/dev/shm", OK, f"{free:.0f} MiB free")


def check_cores(world_size: int) -> Finding:
    cores = os.cpu_count() or 1
    if cores < 2:
        return Finding("CPU cores", WARN, f"{cores} core for {world_size} ranks",
                       "lessons still run, slower; close other programs")
    return Finding("CPU cores", OK, f"{cores} cores for {world_size} ranks"
                   + (" (ranks share cores: fine for learning, not for timing)"
                      if cores < world_size else ""))


def check_widgets() -> Finding:
    lab, widgets = _version("jupyterlab"), _version("ipywidgets")
    labw = _version("jupyterlab_widgets")
    if not lab:
        return Finding("JupyterLab + widgets", FAIL, "jupyterlab not installed", "run `make lab`")
    problems = []
    if int(lab.split(".")[0]) < 4:
        problems.append(f"jupyterlab {lab} < 4")
    if not widgets or int(widgets.split(".")[0]) < 8:
        problems.append(f"ipywidgets {widgets or 'missing'} (need 8)")
    if not labw:
        problems.append("jupyterlab_widgets missing (widgets would show 'Loading widget...')")
    if problems:
        return Finding("JupyterLab + widgets", WARN, "; ".join(problems),
                       "pip install 'jupyterlab>=4' 'ipywidgets>=8'")
    return Finding("JupyterLab + widgets", OK, f"jupyterlab {lab}, ipywidgets {widgets}")


def _smoke(world_size: int):
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def check_launch(world_size: int) -> Finding:
    from kit.launcher import LaunchError, run_ranks

    try:
        got = run_ranks(_smoke, (world_size,), world_size=world_size, timeout=60, echo=False)
    except (LaunchError, ValueError, RuntimeError) as e:
        first = str(e).splitlines()[0]
        return Finding("launch + all_reduce", FAIL, first,
                       "see the message above; `kit doctor` rows show the cause")
    if list(got) != [float(world_size)] * world_size:
        return Finding("launch + all_reduce", FAIL, f"wrong all_reduce result {list(got)}",
                       "reinstall torch; report this machine")
    return Finding("launch + all_reduce", OK, f"{world_size} ranks in {got.wall_time:.2f} s")


def check_mpi() -> Finding:
    """Lesson 01's MPI cells: Open MPI's ``mpirun`` and ``mpi4py`` (optional: the cells skip)."""
    import subprocess

    mpirun, mpi4py = shutil.which("mpirun"), _version("mpi4py")
    if mpirun and mpi4py:
        try:  # "mpirun (Open MPI) 4.1.4"
            first = subprocess.run([mpirun, "--version"], capture_output=True, text=True,
                                   timeout=20).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            first = mpirun
        return Finding("MPI (optional)", OK, f"{first}, mpi4py {mpi4py}")
    missing = " and ".join(name for name, found in (("mpirun", mpirun), ("mpi4py", mpi4py))
                           if not found)
    return Finding("MPI (optional)", WARN, f"{missing} not found: Lesson 01's MPI cells will skip",
                   "apt-get install openmpi-bin libopenmpi-dev (macOS: brew install open-mpi), "
                   "then pip install -e '.[mpi]'")


def check_pyg_lib() -> Finding:
    """Lesson 11's sampler: PyG's ``NeighborLoader`` needs ``pyg-lib`` (optional: without it the
    lesson runs your sampler through PyG's ``NodeLoader``)."""
    import importlib.util

    import torch

    build = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    index = f"https://data.pyg.org/whl/torch-{torch.__version__.split('+')[0]}+{build}.html"
    if importlib.util.find_spec("pyg_lib") is None:
        return Finding("pyg-lib (optional)", WARN,
                       "not installed: Lesson 11 runs your sampler through PyG's NodeLoader, and "
                       "its NeighborLoader comparisons skip",
                       f"pip install pyg-lib -f {index} (not on PyPI; wheels exist only for "
                       "released torch and CUDA builds)")
    try:
        import pyg_lib
    except (ImportError, OSError) as e:  # a wheel built for another torch fails to load
        return Finding("pyg-lib (optional)", WARN, f"installed but does not load: {e}",
                       "reinstall pyg-lib for this torch: pip install --force-reinstall pyg-lib "
                       f"-f {index}")
    return Finding("pyg-lib (optional)", OK,
                   f"{getattr(pyg_lib, '__version__', 'installed')}: NeighborLoader samples in "
                   "C++; Lesson 11's neighbor_loader is NeighborLoader and its tests compare your "
                   "sampler with it")


def run_checks(world_size: int = 4, extra: Sequence[Callable[[], Finding]] = ()) -> list[Finding]:
    """Every check's finding; ``extra`` adds rows of other packages (the grader's isolation)."""
    findings = [check_python(), check_torch()]
    if findings[-1].status == FAIL:
        return findings
    findings += check_backends()
    findings += [check_fork(), check_loopback(), check_shm(), check_cores(world_size),
                 check_widgets()]
    extras = [check() for check in extra]
    # a failing extra row (grading as root without a sandbox) does not stop ranks from launching
    launchable = not any(f.status == FAIL for f in findings)
    findings += [*extras, check_pyg_lib(), check_mpi()]
    if launchable:
        findings.append(check_launch(world_size))
    return findings


def format_table(findings: list[Finding]) -> str:
    w1 = max(len(f.check) for f in findings)
    w2 = max(len(f.status) for f in findings)
    lines = []
    for f in findings:
        lines.append(f"{f.check:<{w1}}  {f.status:<{w2}}  {f.detail}")
        if f.fix and f.status != OK:
            lines.append(f"{'':<{w1}}  {'':<{w2}}  fix: {f.fix}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, *, extra: Sequence[Callable[[], Finding]] = ()) -> int:
    parser = argparse.ArgumentParser(prog="kit doctor", description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--world-size", type=int, default=4, help="ranks to test (default 4)")
    args = parser.parse_args(argv)
    findings = run_checks(args.world_size, extra)
    print(format_table(findings))
    blocking = [f for f in findings if f.status == FAIL]
    print()
    print(f"{len(blocking)} blocking problem(s)." if blocking
          else "Ready: this machine can run the course.")
    return 1 if blocking else 0
