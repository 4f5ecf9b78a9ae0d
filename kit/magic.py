"""``%%distributed``: run a notebook cell's body on N ranks (``%load_ext kit`` first).

    %%distributed -n 4 [--timeout 60] [--backend gloo] [--start-method fork|spawn] [--out NAME]

What the ranks see: ``rank``, ``world_size``, ``torch`` and ``dist``, plus the kernel's
namespace as it was when the cell started (a forked copy; under spawn, the names that can be
pickled). What comes back: each rank's output, live; the value of the cell's last expression on
every rank, as a list indexed by rank (shown as the cell's result unless every value is
``None``; ``--out NAME`` also stores the full :class:`kit.LaunchResult` in ``NAME``).
Assignments made inside the cell stay in the rank processes and vanish with them: return what
you need as the last expression. Used from Lesson 00 on.

Persistent ranks (:class:`kit.Ranks`), for state that should live from one cell to the next:

    %distributed start 4 [--backend gloo] [--timeout 60]   # ranks that stay up
    %%distributed                                           # runs on them; names persist
    %distributed status | restart | stop

While they are up, every ``%%distributed`` cell runs on them (``-n``, if given, must match) in
one namespace per rank that lives on between cells: build a model in one cell, look at its
shards in the next, train it in a third. Kernel names defined or rebound since the last cell
are copied in (if they pickle); names only the ranks assigned stay the ranks'. ``--fresh`` runs
one cell on fresh ranks instead. See :mod:`kit.ranks` for what a failure, a hang or the stop
button does to the group.
"""

from __future__ import annotations

import ast
import hashlib
import linecache
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from kit.launcher import run_ranks

_SKIP = {"In", "Out", "exit", "quit", "get_ipython"}


def register_source(code: str) -> str:
    """Register ``code`` in linecache under a stable name so tracebacks and hang reports show it."""
    name = f"<distributed-cell-{hashlib.sha1(code.encode()).hexdigest()[:8]}>"
    linecache.cache[name] = (len(code), None, code.splitlines(keepends=True), name)
    return name


def run_cell(code: str, filename: str, namespace: dict[str, Any] | None,
             ns: dict[str, Any] | None = None) -> Any:
    """Executed on every rank: exec the cell, return the value of its last expression (in a copy
    of ``namespace``, or in ``ns`` itself when given: a persistent rank's state)."""
    import torch
    import torch.distributed as dist

    if filename not in linecache.cache:  # spawned rank, or one started before the cell
        register_source(code)
    if ns is None:
        ns = dict(namespace or {})
    ns.update(rank=dist.get_rank(), world_size=dist.get_world_size(), torch=torch, dist=dist)
    ns.setdefault("__name__", "__main__")
    tree = ast.parse(code, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), ns)
    if last is None:
        return None
    return eval(compile(ast.Expression(last.value), filename, "eval"), ns)


def _picklable_namespace(user_ns: dict[str, Any],
                         sent: dict[str, Any] | None = None) -> dict[str, Any]:
    """The kernel's names that pickle; with ``sent``, only those new or rebound since they were
    last sent (each is recorded there, also when it does not pickle: it is not tried again)."""
    import cloudpickle

    kept = {}
    for name, value in list(user_ns.items()):
        if name.startswith("_") or name in _SKIP:
            continue
        if sent is not None:
            if name in sent and sent[name] is value:
                continue
            sent[name] = value
        try:
            cloudpickle.dumps(value)
        except Exception:  # noqa: BLE001 - unpicklable names are simply not sent
            continue
        kept[name] = value
    return kept


def run_cell_in_state(code: str, filename: str, pushed: dict[str, Any]) -> Any:
    """Executed on every persistent rank: the cell runs in the rank's :data:`kit.ranks.state`,
    which lives on between cells; ``pushed`` are the kernel names new or rebound since the last."""
    from kit.ranks import state

    state.update(pushed)
    return run_cell(code, filename, None, ns=state)


def seed_state(namespace: dict[str, Any]) -> None:
    """Run once on each persistent rank as it starts: the kernel's names become its namespace."""
    from kit.ranks import state

    state.clear()
    state.update({k: v for k, v in namespace.items() if not k.startswith("_") and k not in _SKIP})


_group: Any = None  # the persistent kit.Ranks of this kernel, while %distributed start holds one
_sent: dict[str, Any] = {}


def current_ranks() -> Any:
    """The kernel's persistent :class:`kit.Ranks` (``%distributed start``), or None."""
    return _group


def _parse_start(line: str) -> Any:
    import argparse

    parser = argparse.ArgumentParser(prog="%distributed start", add_help=False,
                                     exit_on_error=False)
    parser.add_argument("nproc", type=int, nargs="?", default=4)
    parser.add_argument("-n", "--nproc-flag", type=int, default=None)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--start-method", default=None, choices=["fork", "spawn"])
    try:
        opts = parser.parse_args(line.split())
    except (argparse.ArgumentError, SystemExit) as e:
        raise UsageError(f"%distributed start [N] [--backend gloo] [--timeout 60]: {e}") from None
    if opts.nproc_flag is not None:
        opts.nproc = opts.nproc_flag
    return opts


@magics_class
class DistributedMagics(Magics):
    @magic_arguments()
    @argument("-n", "--nproc", type=int, default=None,
              help="number of ranks (default 4, or the persistent group's size)")
    @argument("--timeout", type=float, default=None,
              help="seconds before a hang is reported (default 60)")
    @argument("--backend", default=None, help="gloo (CPU) or nccl (one GPU per rank)")
    @argument("--start-method", default=None, choices=["fork", "spawn"],
              help="default: fork where safe")
    @argument("--out", default=None, help="store the LaunchResult in this variable")
    @argument("--fresh", action="store_true",
              help="run on fresh ranks even while persistent ones are up")
    @line_cell_magic
    def distributed(self, line: str, cell: str | None = None) -> Any:
        """Run the cell on N ranks with ``rank``, ``world_size``, ``torch``, ``dist`` defined;
        ``%distributed start|stop|restart|status`` manages persistent ranks."""
        if cell is None:
            return self._manage(line)
        opts = parse_argstring(self.distributed, line)
        try:
            ast.parse(cell)
        except SyntaxError as e:
            raise SyntaxError("%%distributed runs plain Python (no %magics or !shell lines): "
                              f"{e.msg}",
                              (e.filename, e.lineno, e.offset, e.text)) from None
        filename = register_source(cell)
        user_ns = self.shell.user_ns
        group = _group
        if group is not None and not opts.fresh:
            result = self._on_group(group, opts, cell, filename, user_ns)
        else:
            from kit.launcher import default_start_method

            backend = opts.backend or "gloo"
            method = opts.start_method or default_start_method(backend)
            namespace = user_ns if method == "fork" else _picklable_namespace(user_ns)
            result = run_ranks(run_cell, (cell, filename, namespace), {},
                               world_size=opts.nproc or 4, backend=backend,
                               timeout=opts.timeout or 60.0, start_method=method)
        if opts.out:
            user_ns[opts.out] = result
        return None if all(v is None for v in result) else list(result)

    def _on_group(self, group: Any, opts: Any, cell: str, filename: str,
                  user_ns: dict[str, Any]) -> Any:
        if opts.nproc is not None and opts.nproc != group.world_size:
            raise UsageError(
                f"%%distributed -n {opts.nproc}, but the persistent group has "
                f"{group.world_size} ranks. Drop -n to run on them, add --fresh to run this cell "
                f"on {opts.nproc} fresh ranks, or %distributed stop first.")
        if opts.backend is not None and opts.backend != group.backend:
            raise UsageError(f"--backend {opts.backend}, but the persistent group runs "
                             f"{group.backend}: %distributed restart --backend {opts.backend}.")
        pushed = _picklable_namespace(user_ns, _sent)
        return group.run(run_cell_in_state, cell, filename, pushed, timeout=opts.timeout)

    def _manage(self, line: str) -> Any:
        global _group
        words = line.split()
        verb, rest = (words[0], " ".join(words[1:])) if words else ("status", "")
        if verb in ("start", "restart"):
            if verb == "start" and _group is not None and _group.alive:
                raise UsageError(f"{_group.world_size} persistent ranks are already up: "
                                 "%distributed restart [N] starts a fresh group, "
                                 "%distributed stop ends them.")
            if verb == "restart" and not rest and _group is not None:
                rest = f"{_group.world_size} --backend {_group.backend} --timeout {_group.timeout}"
            opts = _parse_start(rest)
            if _group is not None:
                _group.stop()
                _group = None
            from kit.launcher import default_start_method
            from kit.ranks import Ranks

            method = opts.start_method or default_start_method(opts.backend)
            user_ns = self.shell.user_ns
            namespace = user_ns if method == "fork" else _picklable_namespace(user_ns)
            _sent.clear()
            _sent.update({k: v for k, v in user_ns.items()
                          if not k.startswith("_") and k not in _SKIP})
            _group = Ranks(opts.nproc, backend=opts.backend, timeout=opts.timeout,
                           start_method=method, setup=(seed_state, (namespace,), {}))
            print(f"[kit] {opts.nproc} persistent ranks up ({opts.backend}, {method}); "
                  "%%distributed cells now run on them. %distributed stop ends them.")
            return None
        if verb == "stop":
            if _group is not None:
                _group.stop()
                print(f"[kit] the {_group.world_size} persistent ranks stopped.")
            _group = None
            _sent.clear()
            return None
        if verb == "status":
            return _group if _group is not None else "no persistent ranks (%distributed start N)"
        raise UsageError(f"%distributed {verb}: use %distributed start [N], stop, restart or "
                         "status; %%distributed (two %) runs a cell.")
