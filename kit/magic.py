"""``%%distributed``: run a notebook cell's body on N ranks (``%load_ext kit`` first).

    %%distributed -n 4 [--timeout 60] [--backend gloo] [--start-method fork|spawn] [--out NAME]

What the ranks see: ``rank``, ``world_size``, ``torch`` and ``dist``, plus the kernel's
namespace as it was when the cell started (a forked copy; under spawn, the names that can be
pickled). What comes back: each rank's output, live; the value of the cell's last expression on
every rank, as a list indexed by rank (shown as the cell's result unless every value is
``None``; ``--out NAME`` also stores the full :class:`kit.LaunchResult` in ``NAME``).
Assignments made inside the cell stay in the rank processes and vanish with them: return what
you need as the last expression. Used from Lesson 00 on.
"""

from __future__ import annotations

import ast
import hashlib
import linecache
from typing import Any

from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from kit.launcher import run_ranks

_SKIP = {"In", "Out", "exit", "quit", "get_ipython"}


def register_source(code: str) -> str:
    """Register ``code`` in linecache under a stable name so tracebacks and hang reports show it."""
    name = f"<distributed-cell-{hashlib.sha1(code.encode()).hexdigest()[:8]}>"
    linecache.cache[name] = (len(code), None, code.splitlines(keepends=True), name)
    return name


def run_cell(code: str, filename: str, namespace: dict[str, Any] | None) -> Any:
    """Executed on every rank: exec the cell, return the value of its last expression."""
    import torch
    import torch.distributed as dist

    if filename not in linecache.cache:  # spawned rank: a fresh interpreter
        register_source(code)
    ns: dict[str, Any] = dict(namespace or {})
    ns.update(rank=dist.get_rank(), world_size=dist.get_world_size(), torch=torch, dist=dist)
    ns.setdefault("__name__", "__main__")
    tree = ast.parse(code, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), ns)
    if last is None:
        return None
    return eval(compile(ast.Expression(last.value), filename, "eval"), ns)


def _picklable_namespace(user_ns: dict[str, Any]) -> dict[str, Any]:
    import cloudpickle

    kept = {}
    for name, value in user_ns.items():
        if name.startswith("_") or name in _SKIP:
            continue
        try:
            cloudpickle.dumps(value)
        except Exception:  # noqa: BLE001 - unpicklable names are simply not sent
            continue
        kept[name] = value
    return kept


@magics_class
class DistributedMagics(Magics):
    @magic_arguments()
    @argument("-n", "--nproc", type=int, default=4, help="number of ranks (default 4)")
    @argument("--timeout", type=float, default=60.0, help="seconds before a hang is reported")
    @argument("--backend", default="gloo", help="gloo (CPU) or nccl (one GPU per rank)")
    @argument("--start-method", default=None, choices=["fork", "spawn"],
              help="default: fork where safe")
    @argument("--out", default=None, help="store the LaunchResult in this variable")
    @cell_magic
    def distributed(self, line: str, cell: str) -> Any:
        """Run the cell on N ranks with ``rank``, ``world_size``, ``torch``, ``dist`` defined."""
        opts = parse_argstring(self.distributed, line)
        try:
            ast.parse(cell)
        except SyntaxError as e:
            raise SyntaxError("%%distributed runs plain Python (no %magics or !shell lines): "
                              f"{e.msg}",
                              (e.filename, e.lineno, e.offset, e.text)) from None
        filename = register_source(cell)
        user_ns = self.shell.user_ns
        from kit.launcher import default_start_method

        method = opts.start_method or default_start_method(opts.backend)
        namespace = user_ns if method == "fork" else _picklable_namespace(user_ns)
        result = run_ranks(run_cell, (cell, filename, namespace), {}, world_size=opts.nproc,
                           backend=opts.backend, timeout=opts.timeout, start_method=method)
        if opts.out:
            user_ns[opts.out] = result
        return None if all(v is None for v in result) else list(result)
