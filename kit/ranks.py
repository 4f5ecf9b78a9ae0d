"""``kit.Ranks``: ranks that stay up between notebook cells, with their globals and process group.

    ranks = kit.Ranks(4)                 # or: %distributed start 4
    ranks.run(build_model)               # a call on every rank; each rank keeps what it built
    ranks.run(train_steps, 10)           # the next cell trains the same model on the same group
    ranks.stop()                         # or: %distributed stop

Every call gets what :func:`kit.launch` gives: rank-labelled live output, every failed rank's
traceback, the hang report naming the collective each rank waits in (at the timeout, or at once
when a returned rank leaves the others deadlocked), and the recorder. What differs is what
survives a call:

* a call where every rank raised (a typo, a shape error) leaves the ranks up, their state as it
  was at the error; a barrier checks the group is still whole before the next call runs;
* a rank that exits, crashes, hangs or is still inside a collective half a second after a peer
  failed breaks the group: every rank is stopped (nothing is left running) and ``restart()``
  starts a fresh group in one call (``%distributed restart``); the old state is gone;
* the kernel's interrupt (the stop button) raises KeyboardInterrupt on every rank at the Python
  line it is on: ranks that stop within ``INTERRUPT_GRACE_S`` keep their state; a rank blocked
  inside a collective cannot, and then the group is stopped, its stacks shown.

Ranks die with the kernel (``PR_SET_PDEATHSIG``, and ``stop()`` at exit): a kernel restart leaves
no process behind. The ranks are forked from the kernel, as :func:`kit.launch`'s are, so they
inherit its imports; later calls are sent with cloudpickle.
"""

from __future__ import annotations

import atexit
import linecache
import os
import selectors
import shutil
import signal
import socket
import tempfile
import time
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle

from kit import _rank
from kit.failures import (
    LaunchError,
    LaunchTimeout,
    clean_fatal_error,
    failure_message,
    timeout_message,
)
from kit.launcher import (
    EXIT_WAIT_S,
    LaunchResult,
    _drain,
    _kill,
    _mp,
    _Rank,
    _rank_env,
    _read,
    _start,
    _supervise,
    _validate,
    preload_modules,
)
from kit.output import RankOutput

__all__ = ["Ranks", "RanksStopped", "state"]

#: In a rank: what it keeps between calls (the namespace of ``%%distributed`` cells too). In the
#: kernel it stays empty; each rank has its own.
state: dict[str, Any] = {}

INTERRUPT_GRACE_S = 2.0  # after the stop button, how long ranks get to reach a Python line
HEALTH_TIMEOUT_S = 10.0  # the barrier that checks a group after a call where every rank raised


class RanksStopped(RuntimeError):
    """A call on ranks that are not running (never started, stopped, or broken by a failure)."""


def _noop() -> None:
    return None


def _barrier() -> bool:
    import torch.distributed as dist

    dist.barrier()
    return True


class Ranks:
    """``world_size`` persistent ranks with an initialised default process group.

    Args:
        world_size: number of ranks.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank; spawned).
        timeout: default seconds a call may take before it is reported hung (``run(timeout=)``).
        start_method: ``"fork"`` (default where safe) or ``"spawn"``.
        preload: modules imported before the ranks start, so forked ranks inherit them.
        setup: an optional ``(fn, args, kwargs)`` run on every rank as the group starts; under
            fork it is inherited, not pickled (the ``%distributed`` magic seeds each rank's
            namespace with the kernel's this way).
        echo: show rank output in the cell (``False`` keeps it only in the result).

    Raises:
        ValueError: a bad world size, backend or timeout (as :func:`kit.launch`).
        LaunchError: a rank failed while the group was starting; nothing is left running.
    """

    def __init__(self, world_size: int = 4, *, backend: str = "gloo", timeout: float = 60.0,
                 start_method: str | None = None, preload: Sequence[str] = (),
                 setup: tuple[Callable[..., Any], tuple, dict] | None = None, echo: bool = True):
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.echo = echo
        self.explain = True  # errors say what happened to the group (a grading pool says nothing)
        # After a call where every rank raised: keep the group (barrier-checked), or stop it (a
        # grading pool, where each case must start from ranks no failure has touched).
        self.keep_after_error = True
        self._preload = tuple(preload)
        self._requested_method = start_method
        self._setup = setup
        self._ranks: list[_Rank] = []
        self._tmp: str | None = None
        self.calls = 0  # calls run on the current group
        self.restarts = 0
        self.broken: str | None = None  # why the group was stopped, when a failure stopped it
        self._finalizer = weakref.finalize(self, _stop_all, self._ranks)
        atexit.register(self._finalizer)
        self._start()

    # ------------------------------------------------------------------ lifecycle

    @property
    def alive(self) -> bool:
        """Whether the group is up and accepts calls."""
        return bool(self._ranks) and all(r.process.exitcode is None for r in self._ranks)

    @property
    def pids(self) -> list[int]:
        return [r.process.pid for r in self._ranks]

    def _start(self) -> None:
        method = _validate(_noop, (), {}, self.world_size, self.backend, self.timeout,
                           self._requested_method)
        self.start_method = method
        if method == "fork":
            preload_modules(self._preload)
        ctx = _mp().get_context(method)
        setup = self._setup or (_noop, (), {})
        payload = setup if method == "fork" else cloudpickle.dumps(setup)
        self._tmp = tempfile.mkdtemp(prefix="kit-ranks-")
        addr = "127.0.0.1"
        listener = socket.create_server((addr, 0), backlog=max(128, self.world_size))
        port = listener.getsockname()[1]
        store_ready = ctx.Event()
        # The group outlives any one call: collectives across cells never wait, and each call's
        # own timeout reports a hang long before gloo's would.
        pg_timeout = 3600.0
        self.broken = None
        self.calls = 0
        try:
            for rank in range(self.world_size):
                spec = _rank.RankSpec(rank, self.world_size, self.backend, addr, port, pg_timeout,
                                      os.path.join(self._tmp, f"stack-{rank}.txt"), os.getpid(),
                                      _rank_env(rank, self.world_size, addr, port),
                                      persistent=True)
                r = _start(ctx, spec, payload, listener if rank == 0 else None, store_ready)
                if rank == 0:
                    listener.close()
                self._ranks.append(r)
        except BaseException:
            self._teardown()
            raise
        finally:
            listener.close()
        self._call_and_wait(self.timeout, what="starting the group")

    def stop(self) -> None:
        """End every rank (the group is destroyed first); safe to call twice."""
        ranks = self._ranks
        for r in ranks:
            if r.process.exitcode is None:
                try:
                    r.result.send_bytes(_rank.STOP)
                except OSError:
                    pass
        end = time.monotonic() + EXIT_WAIT_S
        for r in ranks:
            r.process.join(max(0.0, end - time.monotonic()))
        self._teardown()

    def restart(self) -> Ranks:
        """Stop the ranks (if any are up) and start a fresh group of the same size."""
        self.stop()
        self.restarts += 1
        self._start()
        return self

    def _teardown(self) -> None:
        _stop_all(self._ranks)
        self._ranks.clear()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "up" if self.alive else f"stopped ({self.broken})" if self.broken else "stopped"
        return (f"Ranks(world_size={self.world_size}, backend={self.backend!r}, {state}, "
                f"calls={self.calls})")

    # ------------------------------------------------------------------ calls

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            **kwargs: Any) -> LaunchResult:
        """Run ``fn(*args, **kwargs)`` on every rank; return every rank's return value.

        ``fn`` and its arguments are sent with cloudpickle (a notebook function is fine). What a
        rank keeps between calls goes in :data:`state`, the rank's own dict (``from kit.ranks
        import state``; ``state["model"] = model``); ``%%distributed`` cells run in that same
        dict, so a cell sees what a call stored and the other way round.

        Raises:
            RanksStopped: the group is not running; the message says why and how to restart.
            LaunchError: a rank failed; the message says whether the ranks kept their state.
            LaunchTimeout: the call hung; every rank's stack is shown and the group is stopped.
            KeyboardInterrupt: the kernel was interrupted (see the module docstring).
        """
        if not callable(fn):
            raise TypeError(f"Ranks.run needs a function to run on every rank, got "
                            f"{type(fn).__name__}.")
        if not self.alive:
            raise RanksStopped(self._stopped_message())
        try:
            payload = cloudpickle.dumps((_with_source, (fn, *_source_of(fn), args, kwargs), {}))
        except Exception as e:  # noqa: BLE001 - the message carries the cause
            raise TypeError(f"the call cannot be sent to the ranks: {e}. Pass plain data "
                            "(tensors, numbers, paths) or build it on the ranks.") from e
        return self._call_and_wait(self.timeout if timeout is None else timeout, payload)

    def _stopped_message(self) -> str:
        why = f" ({self.broken})" if self.broken else ""
        return (f"the {self.world_size} ranks are not running{why}. Start them again with "
                "ranks.restart() or %distributed restart; what they held is gone.")

    def _call_and_wait(self, timeout: float, payload: bytes | None = None, *,
                       what: str = "the call", check_after_error: bool = True) -> LaunchResult:
        ranks = self._ranks
        for r in ranks:
            r.message, r.noted, r.killed, r.released = None, False, False, False
        output = RankOutput(self.world_size, echo=self.echo)
        sel = selectors.DefaultSelector()
        started = time.monotonic()
        interrupted = False
        try:
            for r in ranks:
                sel.register(r.out_fd, selectors.EVENT_READ, (r, "out"))
                sel.register(r.err_fd, selectors.EVENT_READ, (r, "err"))
                sel.register(r.result.fileno(), selectors.EVENT_READ, (r, "result"))
                sel.register(r.process.sentinel, selectors.EVENT_READ, (r, "exit"))
            if payload is not None:
                for r in ranks:
                    r.result.send_bytes(payload)
            try:
                failures, stacks = _supervise(ranks, sel, output, started, timeout,
                                              persistent=True)
            except KeyboardInterrupt:
                interrupted = True
                failures, stacks = self._interrupt(sel, output)
        except BaseException:
            self.broken = "the launcher was stopped"
            self._teardown()
            raise
        finally:
            _drain(ranks, output)
            output.flush()
            sel.close()
        wall = time.monotonic() - started
        outputs = [output.text(r) for r in range(self.world_size)]
        returned = {r.rank: r.message.seconds for r in ranks
                    if r.message and r.message.kind == _rank.OK}
        whole = (stacks is None and all(r.message and r.process.exitcode is None and not r.killed
                                        for r in ranks))
        self.calls += 1
        if interrupted:
            if whole:
                print(f"[kit] interrupted: all {self.world_size} ranks stopped at a Python line "
                      "and keep their state.", flush=True)
            else:
                self._break("interrupted while a rank was inside a collective")
                print(f"[kit] interrupted: a rank was blocked below Python, so the group was "
                      f"stopped. {self._stopped_message()}", flush=True)
                if stacks:
                    print(timeout_message(stacks, returned, timeout, self.world_size,
                                          deadlock=wall), flush=True)
            raise KeyboardInterrupt
        if stacks is not None:
            hung_for = None if stacks.get("timeout", True) else wall
            stacks = {k: v for k, v in stacks.items() if k != "timeout"}
            self._break(f"{what} hung")
            raise LaunchTimeout(timeout_message(stacks, returned, timeout, self.world_size,
                                                deadlock=hung_for)
                                + ("\n\n" + self._stopped_message() if self.explain else ""),
                                {k: v.raw for k, v in stacks.items()}, outputs)
        if failures or not whole:
            crash = {r.rank: clean_fatal_error(_read(r.stack_path + ".crash")) for r in ranks}
            for f in failures:
                if not f.details and f.exception_type is None:
                    f.details = crash.get(f.rank) or "\n".join(output.stderr_tails[f.rank][-15:])
            failed = {f.rank for f in failures}
            stopped = [r.rank for r in ranks if r.killed and r.rank not in failed]
            text = failure_message(failures, self.world_size,
                                   [r for r in returned if r not in failed], stopped) \
                if failures else f"{what} did not complete on every rank."
            if whole and check_after_error:
                whole = self.keep_after_error and self.healthy()
            if whole:
                text += (f"\n\nThe {self.world_size} ranks are still up and keep their state as "
                         "it was when they raised.") if self.explain else ""
            else:
                self._break(f"{what} failed")
                text += "\n\n" + self._stopped_message() if self.explain else ""
            raise LaunchError(text, failures, outputs)
        values = [cloudpickle.loads(r.message.body) for r in ranks]
        durations = [float(r.message.seconds) for r in ranks]
        return LaunchResult(values, outputs, durations, wall, self.start_method)

    def _interrupt(self, sel: selectors.BaseSelector, output: RankOutput):
        """Forward the interrupt to every rank still working, then give them a moment to stop."""
        working = [r for r in self._ranks if r.message is None and r.process.exitcode is None]
        for r in working:
            try:
                os.kill(r.process.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        try:
            return _supervise(self._ranks, sel, output, time.monotonic(), INTERRUPT_GRACE_S,
                              persistent=True)
        except KeyboardInterrupt:  # interrupted twice: stop at once
            _stop_all(self._ranks)
            return [], {}

    def healthy(self) -> bool:
        """A barrier on the group (after a call where every rank raised; a grading pool's check
        before reuse): True, or False with the group stopped."""
        echo, self.echo = self.echo, False
        try:
            self._call_and_wait(HEALTH_TIMEOUT_S, cloudpickle.dumps((_barrier, (), {})),
                                what="the barrier after a failed call", check_after_error=False)
            self.calls -= 1
            return True
        except (LaunchError, RanksStopped):
            return False
        finally:
            self.echo = echo

    def _break(self, why: str) -> None:
        self.broken = why
        self._teardown()


def _source_of(fn: Any) -> tuple[str | None, list[str]]:
    """The file a function was written in and its lines: cloudpickle sends code as
    ``<dynamic-code>``, and a rank's traceback should show the notebook's line instead."""
    code = getattr(fn, "__code__", None)
    if code is None or code.co_filename.startswith("<dynamic"):
        return None, []
    return code.co_filename, linecache.getlines(code.co_filename)


def _refiled(code: types.CodeType, filename: str) -> types.CodeType:
    consts = tuple(_refiled(c, filename) if isinstance(c, types.CodeType) else c
                   for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _with_source(fn: Any, filename: str | None, lines: list[str], args: tuple,
                 kwargs: dict) -> Any:
    """On the rank: give ``fn``'s code its file back (tracebacks, hang reports), then call it."""
    if filename and isinstance(fn, types.FunctionType):
        if lines and filename not in linecache.cache:
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        fn.__code__ = _refiled(fn.__code__, filename)
    return fn(*args, **kwargs)


def _stop_all(ranks: list[_Rank]) -> None:
    """Kill every rank (and anything it started) and release its pipes; used at exit too."""
    for r in ranks:
        _kill(r)
    for r in ranks:
        try:
            r.process.join(5)
        except (AssertionError, ValueError):
            pass
        for fd in (r.out_fd, r.err_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            r.result.close()
        except OSError:
            pass
        try:
            r.process.close()
        except ValueError:
            pass
