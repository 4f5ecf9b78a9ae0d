"""Run real ``torchrun`` from a notebook cell, with its output streamed into the cell.

Lesson 02 leaves the notebook launcher for the one clusters use. :func:`write_script` writes
training code (strings, or functions and classes defined in the notebook) to a ``.py`` file;
:func:`torchrun` starts ``python -m torch.distributed.run`` on it (the kernel's own Python, so
the same torch) and prints every line the agent and its workers write, as stdout (nbgrader
zeroes a cell that writes stderr). :func:`torchrun_nodes` starts several agents on this
machine, each playing one node, joined by one c10d rendezvous on a free loopback port.

A run that fails raises :class:`TorchrunError` quoting torchrun's ``ChildFailedError``
summary (which rank, exit code, signal, error file). On failure, timeout or a kernel
interrupt every agent and every worker it started is stopped: workers live in their own
sessions, so they are found as descendants (psutil) and killed by pid, never by name.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import linecache
import os
import re
import select
import selectors
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import psutil

__all__ = ["TorchrunError", "TorchrunResult", "TorchrunTimeout", "free_port",
           "elastic_run", "init_process_group_per_attempt", "torchrun", "torchrun_command",
           "torchrun_nodes", "write_script"]

_SUMMARY_RE = re.compile(r"ChildFailedError:?\s*\n(=+\n.*?\n=+)", re.S)


class TorchrunError(RuntimeError):
    """torchrun exited with an error. ``summary`` is its ChildFailedError report, if any."""

    def __init__(self, message: str, *, returncodes: list[int], output: str, summary: str):
        super().__init__(message)
        self.returncodes = returncodes
        self.output = output
        self.summary = summary


class TorchrunTimeout(TorchrunError):
    """torchrun did not finish in time; every process it started has been stopped."""


@dataclass
class TorchrunResult:
    """A finished run: each agent's exit code, everything printed, and the wall time."""

    returncodes: list[int]
    output: str
    wall_time: float
    commands: list[list[str]] = field(default_factory=list)

    @property
    def lines(self) -> list[str]:
        return self.output.splitlines()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``host`` now (for a rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def write_script(path: str | os.PathLike[str], *parts: Any) -> Path:
    """Write a Python script made of ``parts`` (source strings, or functions and classes whose
    source is copied, e.g. from the notebook) and return its path.

    Strings are dedented, so a triple-quoted block can be indented like the cell around it.
    """
    if not parts:
        raise ValueError("write_script needs at least one part: a string of code or a function")
    chunks = []
    for part in parts:
        if isinstance(part, str):
            chunks.append(textwrap.dedent(part).strip("\n"))
        elif inspect.isfunction(part) or inspect.isclass(part):
            chunks.append(textwrap.dedent(_source_of(part)).rstrip())
        else:
            raise TypeError(f"write_script: cannot write a {type(part).__name__}; pass source code "
                            "as a string, or a function or class defined in the notebook")
    path = Path(path)
    path.write_text("\n\n\n".join(chunks) + "\n", encoding="utf-8")
    return path


def _source_of(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        if not inspect.isclass(obj):
            raise
    # A class defined in a notebook cell: Python < 3.13 cannot find its source, but the kernel
    # keeps every cell in linecache. The most recent cell defining it wins.
    for filename in reversed(list(linecache.cache)):
        text = "".join(linecache.getlines(filename))
        if f"class {obj.__name__}" not in text:
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == obj.__name__:
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                return "".join(text.splitlines(keepends=True)[first - 1:node.end_lineno])
    raise OSError(f"write_script: cannot find the source of class {obj.__name__}; pass it as a "
                  "string")


def init_process_group_per_attempt(backend: str = "gloo") -> None:
    """``dist.init_process_group(backend)`` for a worker torchrun may restart: the group's keys in
    the agent's store are namespaced by ``TORCHELASTIC_RESTART_COUNT``.

    Here (torch 2.13) the restarted workers get the same agent store (same ``MASTER_PORT``) that
    still holds the first attempt's gloo addresses; a new worker can read a dead peer's address
    and fail ("connectFullMesh failed ... Connection refused"). Self-contained, so
    :func:`write_script` can copy it into a script.
    """
    import os

    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)  # not under torchrun's agent: the usual env:// path
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                world_size, is_master=False)  # the agent hosts it
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt{attempt}", agent_store),
                            rank=rank, world_size=world_size)


def torchrun_command(script: str | os.PathLike[str], *args: Any, nproc_per_node: int = 2,
                     nnodes: int = 1, node_rank: int | None = None, max_restarts: int = 0,
                     rdzv_endpoint: str | None = None, rdzv_id: str = "kit",
                     extra: Sequence[str] = ()) -> list[str]:
    """The argument list that runs ``script`` under torchrun with this Python.

    One node without an endpoint is ``--standalone`` (torchrun picks its own rendezvous port);
    otherwise a c10d rendezvous at ``rdzv_endpoint`` (``HOST:PORT``) joins ``nnodes`` agents.
    """
    if not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be a positive int, got {nproc_per_node!r}")
    if not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"nnodes must be a positive int, got {nnodes!r}")
    # --tee=3: the agent copies each worker's stdout and stderr to the console line by line,
    # labelled "[default0]:" (role and local rank), so lines of different workers never mix.
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}",
           f"--max-restarts={max_restarts}", "--tee=3"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ValueError(f"nnodes={nnodes} needs rdzv_endpoint='HOST:PORT' where the agents "
                             "meet (use torchrun_nodes to run several nodes on this machine)")
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                f"--rdzv-id={rdzv_id}"]
        if node_rank is not None:
            cmd.append(f"--node-rank={node_rank}")
    return [*cmd, *extra, str(script), *map(str, args)]


def torchrun(script: str | os.PathLike[str], *args: Any, nproc_per_node: int = 2,
             max_restarts: int = 0, env: Mapping[str, str] | None = None, timeout: float = 120.0,
             echo: bool = True, extra: Sequence[str] = ()) -> TorchrunResult:
    """Run ``torchrun --standalone --nproc-per-node=N script args...`` and stream its output.

    Args:
        script: the training script (see :func:`write_script`).
        nproc_per_node: worker processes to start (one per GPU on a real node).
        max_restarts: how many times the agent restarts all workers after one fails.
        env: extra environment variables for the agent and its workers.
        timeout: seconds before everything is stopped and :class:`TorchrunTimeout` raised.
        echo: print the output into the cell as it arrives.

    Raises:
        TorchrunError: torchrun exited non-zero; the message quotes its failure summary.
    """
    _require_script(script)
    cmd = torchrun_command(script, *args, nproc_per_node=nproc_per_node,
                           max_restarts=max_restarts, extra=extra)
    return _run([cmd], [""], env, timeout, echo)


def torchrun_nodes(script: str | os.PathLike[str], *args: Any, nnodes: int = 2,
                   nproc_per_node: int = 1, max_restarts: int = 0,
                   env: Mapping[str, str] | None = None, timeout: float = 120.0, echo: bool = True,
                   extra: Sequence[str] = ()) -> TorchrunResult:
    """Play ``nnodes`` machines on this one: one torchrun agent per "node", each with its own
    ``--node-rank``, all meeting at one c10d rendezvous endpoint on a free loopback port.

    Each output line is labelled ``[node N]``. Same errors as :func:`torchrun`.
    """
    _require_script(script)
    endpoint = f"127.0.0.1:{free_port()}"
    run_id = f"kit-{os.getpid()}-{time.monotonic_ns()}"
    commands = [torchrun_command(script, *args, nproc_per_node=nproc_per_node, nnodes=nnodes,
                                 node_rank=n, max_restarts=max_restarts, rdzv_endpoint=endpoint,
                                 rdzv_id=run_id, extra=extra) for n in range(nnodes)]
    return _run(commands, [f"[node {n}] " for n in range(nnodes)], env, timeout, echo)


# --------------------------------------------------------------------------- processes


def _require_script(script: str | os.PathLike[str]) -> None:
    if not Path(script).is_file():
        raise FileNotFoundError(f"no script at {script}: write one first, e.g. "
                                f"write_script({str(script)!r}, train_fn, 'train_fn()')")


def _run(commands: list[list[str]], labels: list[str], env: Mapping[str, str] | None,
         timeout: float, echo: bool, stdout: TextIO | None = None) -> TorchrunResult:
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}  # workers' lines arrive live
    out = stdout or sys.stdout
    procs: list[subprocess.Popen] = []
    lines: list[str] = []
    start = time.monotonic()
    sel = selectors.DefaultSelector()
    try:
        for cmd, label in zip(commands, labels):
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=full_env, start_new_session=True)
            procs.append(proc)
            sel.register(proc.stdout, selectors.EVENT_READ, (label, bytearray()))
        open_streams = len(procs)
        while open_streams:
            left = timeout - (time.monotonic() - start)
            if left <= 0:
                raise TorchrunTimeout(
                    f"torchrun did not finish within {timeout:g} s; every agent and worker was "
                    "stopped. A hang usually means ranks wait in different collectives (see the "
                    "output above) or a node never joined the rendezvous.",
                    returncodes=[p.poll() for p in procs], output="\n".join(lines),
                    summary="")
            for key, _ in sel.select(timeout=min(left, 0.5)):
                label, buf = key.data
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_streams -= 1
                    chunk = b"\n" if buf else b""
                buf += chunk
                *complete, rest = buf.split(b"\n")
                buf[:] = rest
                for raw in complete:
                    line = label + raw.decode("utf-8", "replace").rstrip("\r")
                    lines.append(line)
                    if echo:
                        print(line, file=out, flush=True)
        codes = [p.wait() for p in procs]
    except BaseException:  # timeout, KeyboardInterrupt (kernel interrupt), anything: stop them all
        _stop_all(procs)
        raise
    finally:
        sel.close()
        for p in procs:
            if p.stdout:
                p.stdout.close()
    output = "\n".join(lines)
    if any(codes):
        summary = _failure_summary(output)
        failed = ", ".join(f"{lab.strip() or 'torchrun'} exited with {c}"
                           for lab, c in zip(labels, codes) if c)
        message = f"torchrun failed ({failed})."
        message += f"\n{summary}" if summary else "\n" + "\n".join(lines[-15:])
        said = _root_cause_output(lines, labels)
        if said:
            message += "\nWhat the failed worker printed last:\n" + "\n".join(said)
        raise TorchrunError(message, returncodes=codes, output=output, summary=summary)
    return TorchrunResult(codes, output, time.monotonic() - start, commands)


def _failure_summary(output: str) -> str:
    """The ChildFailedError block torchrun prints (``==== script FAILED ... Root Cause ...
    ====``)."""
    # Agents of several nodes each print one; labels ("[node 1] ") are stripped to match.
    plain = re.sub(r"^\[node \d+\] ", "", output, flags=re.M)
    blocks = _SUMMARY_RE.findall(plain)
    return "\n\n".join(blocks)


_ROOT_CAUSE_RE = re.compile(r"Root Cause.*?local_rank:\s*(\d+)\)", re.S)


def _root_cause_output(lines: list[str], labels: list[str], last: int = 20) -> list[str]:
    """The last ``last`` lines the root-cause worker of each failed agent printed (``--tee``
    labels them ``[defaultL]:``). torchrun's summary names only its exit code unless the script
    used ``@record``, so the worker's own traceback is in these lines."""
    said: list[str] = []
    for label in labels:
        mine = [line[len(label):] for line in lines if line.startswith(label)]
        for local in dict.fromkeys(_ROOT_CAUSE_RE.findall("\n".join(mine))):
            tag = f"[default{local}]:"
            said += [label + line for line in mine if line.startswith(tag)][-last:]
    return said


def _descendants(pid: int) -> list[psutil.Process]:
    """Every descendant of ``pid`` (workers run in their own sessions, so not by process group)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _stop_all(procs: list[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM each agent (it stops its workers), then SIGKILL whatever is left, by pid."""
    workers: set[psutil.Process] = set()
    for p in procs:
        if p.poll() is None:
            workers.update(_descendants(p.pid))
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            workers.update(_descendants(p.pid))
            p.kill()
            p.wait()
    for worker in workers:
        # psutil checks the process's start time: a pid reused meanwhile is never killed.
        with contextlib.suppress(psutil.Error):
            worker.kill()


# --------------------------------------------------------------------------- the agent, forked


def elastic_run(fn: Any, *args: Any, nproc_per_node: int = 2, max_restarts: int = 0,
                env: Mapping[str, str] | None = None, timeout: float = 120.0,
                echo: bool = False) -> TorchrunResult:
    """What ``torchrun --standalone --nproc-per-node=N --max-restarts=R`` runs, without starting
    a Python: torch's own elastic agent (``elastic_launch``, a ``LocalElasticAgent`` with a c10d
    rendezvous on a free port, as ``--standalone`` sets up) in a process forked from this one,
    starting its workers by fork, so neither the agent nor a worker imports torch again.

    ``fn(*args)`` runs on every worker with torchrun's environment (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``, ``TORCHELASTIC_RESTART_COUNT``, ...). A worker that
    dies (even by SIGKILL) makes the agent stop the others and restart them all, up to
    ``max_restarts`` times, exactly as under torchrun. Each output line is labelled like
    torchrun's ``--tee=3`` (``[default0]:``). The checks of Lessons 02 and 06 use it: the same
    restarts and kills as a torchrun command, at a fraction of its start-up cost. One difference:
    the agent joins the rendezvous without torch's random start-up sleep, which spreads many
    nodes' first requests and is of no use to one (:func:`_no_first_round_jitter`).

    Raises:
        TorchrunError: the workers still failed after the restarts (``summary``: the agent's
            ChildFailedError report); TorchrunTimeout: not done within ``timeout`` seconds
            (the agent and every worker are stopped).
    """
    if not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be a positive int, got {nproc_per_node!r}")
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    import tempfile

    log_dir = tempfile.mkdtemp(prefix="kit-elastic-")
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the agent: never returns into the caller's stack
        code = 1
        try:
            os.close(read_fd)
            os.setsid()  # its own session: an interrupt of the caller reaches it only through us
            os.dup2(write_fd, 1)
            os.dup2(write_fd, 2)
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            os.environ.update({"PYTHONUNBUFFERED": "1", **(env or {})})
            code = _agent(fn, args, nproc_per_node, max_restarts, log_dir)
        except BaseException:  # noqa: BLE001 - report anything, then leave
            import traceback

            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    os.close(write_fd)
    lines: list[str] = []
    start = time.monotonic()
    buf = bytearray()
    try:
        while True:
            left = timeout - (time.monotonic() - start)
            if left <= 0:
                raise TorchrunTimeout(
                    f"the elastic agent did not finish within {timeout:g} s; it and every worker "
                    "were stopped. A hang usually means ranks wait in different collectives.",
                    returncodes=[-1], output="\n".join(lines), summary="")
            ready, _, _ = select.select([read_fd], [], [], min(left, 0.5))
            if not ready:
                continue
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            buf += chunk
            *complete, rest = buf.split(b"\n")
            buf[:] = rest
            for raw in complete:
                line = raw.decode("utf-8", "replace").rstrip("\r")
                lines.append(line)
                if echo:
                    print(line, flush=True)
        if buf:
            lines.append(buf.decode("utf-8", "replace"))
        _, status = os.waitpid(pid, 0)
        pid = 0
        code = os.waitstatus_to_exitcode(status)
    except BaseException:
        if pid:
            _stop_pid(pid)
        raise
    finally:
        os.close(read_fd)
        import shutil

        shutil.rmtree(log_dir, ignore_errors=True)
    output = "\n".join(lines)
    if code:
        summary = _failure_summary(output)
        message = f"the elastic agent failed (exit code {code})."
        message += f"\n{summary}" if summary else "\n" + "\n".join(lines[-15:])
        raise TorchrunError(message, returncodes=[code], output=output, summary=summary)
    return TorchrunResult([0], output, time.monotonic() - start, [])


def _agent(fn: Any, args: tuple, nproc_per_node: int, max_restarts: int, log_dir: str) -> int:
    """In the forked agent: ``torchrun --standalone``'s launch, with a function as entry point."""
    import logging
    import uuid

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, force=True)
    # torch's loggers may hold handlers bound to the caller's sys.stderr (in a Jupyter kernel, a
    # stream that forwards to the notebook): point every one at this process's pipe instead.
    # torch's own formatter imports torch._dynamo (about 1.8 s) the first time it formats an
    # exception, which the agent logs for every failed worker: a plain formatter of the same
    # layout keeps a restart as quick as torchrun's second one.
    plain = logging.Formatter("%(levelname).1s%(asctime)s %(process)d %(pathname)s:%(lineno)d] "
                              "%(message)s")
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):
            if (isinstance(handler, logging.StreamHandler)
                    and not isinstance(handler, logging.FileHandler)):
                handler.setStream(sys.stderr)
                if type(handler.formatter).__module__.startswith("torch._logging"):
                    handler.setFormatter(plain)
    _no_first_round_jitter()
    threads = None
    if nproc_per_node > 1:
        # torchrun sets OMP_NUM_THREADS=1 for several workers unless it is set, so they do not
        # oversubscribe the cores; forked workers already run torch, so they are told directly.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        with contextlib.suppress(ValueError):
            threads = max(1, int(os.environ["OMP_NUM_THREADS"]))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc_per_node, run_id=str(uuid.uuid4()),
        role="default",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", rdzv_configs={"rank": 0},
        max_restarts=max_restarts, monitor_interval=0.1, start_method="fork",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL))
    try:
        elastic_launch(config, entrypoint=_Worker(fn, threads))(*args)
    except ChildFailedError as e:
        print(f"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
              f"{e.format_msg()}", flush=True)
        return 1
    return 0


def _no_first_round_jitter() -> None:
    """In the forked agent only: join round 0 of the rendezvous without a random 0-0.3 s sleep.

    torch's ``DynamicRendezvousHandler.next_rendezvous`` sleeps that long before joining round 0,
    so that many nodes do not reach the store at once. This agent is the only node, and it joins
    round 0 twice (at the start and at the first restart), so each run paid 0-0.6 s for nothing.
    The 1 s pause between polls of a rendezvous that waits for other nodes is kept.
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    delay = getattr(dynamic_rendezvous, "_delay", None)
    if delay is None:  # a torch without this private helper: keep whatever it does instead
        return

    def no_jitter(seconds: float | tuple[float, float]) -> None:
        if not isinstance(seconds, tuple):  # (low, high) is the jitter; a number is a real wait
            delay(seconds)

    dynamic_rendezvous._delay = no_jitter


class _Worker:
    """A forked worker starts as a fresh torchrun worker would: with the default signal
    dispositions, not the handlers the agent installed (which would turn the agent's SIGTERM into
    a Python exception that waits for a blocked collective to return)."""

    def __init__(self, fn: Any, threads: int | None = None) -> None:
        self.fn = fn
        self.threads = threads
        self.__name__ = getattr(fn, "__name__", "worker")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __call__(self, *args: Any) -> Any:
        for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        if self.threads:  # torchrun's OMP_NUM_THREADS=1, for a process that already runs torch
            import torch

            torch.set_num_threads(self.threads)
        return self.fn(*args)


def _stop_pid(pid: int, grace: float = 5.0) -> None:
    """SIGTERM the forked agent (it stops its workers), then SIGKILL whatever is left."""
    workers = set(_descendants(pid))
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        workers.update(_descendants(pid))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    for worker in workers:
        with contextlib.suppress(psutil.Error):
            worker.kill()
