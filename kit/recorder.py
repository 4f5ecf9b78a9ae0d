"""The recorder: a gloo process group that reports every operation a rank makes.

:func:`kit.launch` uses it for ``backend="gloo"``; :mod:`kit.trace` reads it for the timelines of
Lessons 01 and 03-05, and the checks read it to grade communication patterns. It sits *below*
Python's ``torch.distributed`` functions: a ``ProcessGroup`` subclass, registered with
``torch.distributed.Backend.register_backend``, that forwards every call to a real
``ProcessGroupGloo`` and tells :mod:`kit.trace` what it forwarded. So it sees every route to
the wire: ``dist.*`` functions, names imported from ``torch.distributed`` before tracing began,
``ProcessGroup`` methods called directly, functional collectives
(``torch.distributed._functional_collectives``, which FSDP2 and DTensor use), and torch's own
C++ components that talk to the group, such as DDP's reducer and its bucketed all-reduces.

Code sees plain gloo: ``dist.get_backend()`` says ``"gloo"``, and groups made with
``dist.new_group()`` (or ``backend="gloo"``) are recorded too. With no tracer active a call costs
one Python method dispatch on top of gloo: ~1 us on a 1-element all-reduce, and DDP steps
within run-to-run noise of plain gloo (``benchmarks/ddp_step_time.py --recorder-overhead``;
launches: ``benchmarks/launch_latency.py``).

Only groups created after :func:`install` in the rank's own process are recorded; under
``torchrun`` nothing changes. One known way around it: a backend object fetched with the
private ``group._get_backend(device)`` is the inner gloo backend itself.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["COLLECTIVE_OPS", "NAME", "P2P_OPS", "PUBLIC_OPS", "RecordingProcessGroup", "Record",
           "install",
           "installed", "observers"]

NAME = "kitgloo"  # the registered backend name; code asking for the backend still sees "gloo"
_C = torch._C._distributed_c10d

# A hook of kit.trace (and of the grader's gates) receives every operation before it starts:
# ``hook(record)``; the record's ``event`` it may fill in and keep. Kept as a plain list so
# that forked ranks inherit it.
observers: list[Callable[[Record], None]] = []

_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_C10D_FILES = ("distributed_c10d.py", "c10d_logger.py")
_FUNCTIONAL_FILES = ("_functional_collectives.py", "_ops.py", "_functional_collectives_impl.py")
# The one list of torch.distributed's operations, by the names of their public functions;
# kit.trace, kit.hang and kit.lessons.debugging use it. The outermost one in a chain of c10d frames
# names the operation the user called.
P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "send_object_list", "recv_object_list"})
COLLECTIVE_OPS = frozenset({
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_single",
    "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "gather", "scatter", "barrier", "monitored_barrier",
    "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
    "all_reduce_coalesced", "all_gather_coalesced", "_all_gather_base", "_reduce_scatter_base",
    "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced",
})
PUBLIC_OPS = P2P_OPS | COLLECTIVE_OPS | {"batch_isend_irecv"}
P2P = P2P_OPS  # the name this module used first
_ASYNC_BY_NATURE = frozenset({"isend", "irecv"})


class Record:
    """One operation as the process group saw it, handed to each observer before it starts.

    ``op`` is the name the user called (``"all_reduce"``, ``"isend"``, ``"all_gather_object"``)
    or, for calls from C++ (DDP's reducer) and functional collectives, the collective's name.
    ``route`` says how it arrived: ``"dist"`` (a ``torch.distributed`` function), ``"functional"``
    (``torch.distributed._functional_collectives``), ``"c++"`` (a torch component below Python,
    such as DDP's reducer) or ``"pg"`` (a ``ProcessGroup`` method called from user code).
    ``frame`` is the Python frame that made the call (for reports of where it came from).
    ``group_ranks`` are the global ranks of the group it ran in, in group-rank order (which
    axis of a DeviceMesh carried it: each axis is its own group).
    """

    __slots__ = ("op", "kind", "nbytes", "peer", "async_op", "group_size", "route", "frame",
                 "start", "event", "fold", "group_ranks")

    def __init__(self, op: str, kind: str, nbytes: int, peer: int | None, async_op: bool,
                 group_size: int, route: str, frame: Any, fold: Any,
                 group_ranks: tuple[int, ...] = ()) -> None:
        self.op, self.kind, self.nbytes, self.peer = op, kind, nbytes, peer
        self.async_op, self.group_size, self.route, self.frame = async_op, group_size, route, frame
        self.group_ranks = group_ranks
        self.fold = fold  # the outer c10d frame of an object collective: its calls fold together
        self.start = time.perf_counter()
        self.event: Any = None


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _caller(depth: int) -> tuple[str, str, bool, Any, Any]:
    """How the current operation was called: (op name or "", route, async_op, fold frame, frame).

    Walks out of the recorder into the chain of c10d frames above it. The outermost public
    function names the op (``all_gather_object`` rather than the ``all_gather`` it calls);
    inside ``batch_isend_irecv`` each message keeps its own name (``isend``/``irecv``).
    """
    frame = sys._getframe(depth)
    name = frame.f_code.co_filename
    if name.endswith(_C10D_FILES):
        op, outer, inner_op = "", None, ""
        f = frame
        while f is not None and f.f_code.co_filename.endswith(_C10D_FILES):
            fn = f.f_code.co_name
            if fn in PUBLIC_OPS:
                if not inner_op:
                    inner_op = fn
                op, outer = fn, f
            f = f.f_back
        if op == "batch_isend_irecv":
            op, outer = inner_op, None
        if op in _ASYNC_BY_NATURE or inner_op == "batch_isend_irecv":
            async_op = True
        else:
            async_op = bool(outer.f_locals.get("async_op", False)) if outer is not None else False
        fold = outer if op.endswith(("_object", "_object_list")) else None
        return op, "dist", async_op, fold, f if f is not None else frame
    if name.endswith(_FUNCTIONAL_FILES):
        return "", "functional", True, None, frame
    if name.startswith(_TORCH_DIR):
        return "", "c++", True, None, frame
    return "", "pg", True, None, frame


class RecordingProcessGroup(_C.ProcessGroup):
    """A process group that forwards every operation to gloo and reports it first.

    Built by torch through the registered backend (see :func:`install`), one per group.
    """

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta,
                 global_ranks: list[int], group_name: str) -> None:
        super().__init__(rank, size)
        self._gloo = _C.ProcessGroupGloo(store, rank, size, timeout)
        self._gloo.options.global_ranks_in_group = list(global_ranks)
        self._gloo.options.group_name = group_name
        self._gloo._set_sequence_number_for_group()
        # Torch's helpers that ask the group for its backend object get gloo itself.
        self._register_backend(torch.device("cpu"), _C.ProcessGroup.BackendType.GLOO, self._gloo)
        self._global = list(global_ranks) or list(range(size))
        self._name = group_name
        self._desc = ""

    # ---------------------------------------------------------------- identity

    def getBackendName(self) -> str:  # noqa: N802 - the C++ name pybind11 looks up
        return "gloo"

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    # ---------------------------------------------------------------- recording

    def _run(self, fallback: str, kind: str, nbytes: int, peer: int | None,
             call: Callable[[], Any]) -> Any:
        if not observers:
            return call()
        op, route, async_op, fold, frame = _caller(3)
        record = Record(op or fallback, "p2p" if (op or fallback) in P2P else kind, nbytes,
                        None if peer is None else self._global[peer], async_op, self.size(),
                        route, frame, fold, tuple(self._global))
        for observe in list(observers):
            observe(record)
        work = call()
        for observe in list(_issued):
            observe(record, work)
        return work

    # Each method takes what the same ProcessGroup method takes (C++ passes options; Python
    # callers may use pybind's other overloads) and forwards it unchanged.

    def allreduce(self, *a, **k):
        return self._run("all_reduce", "collective", _nbytes(a[0]), None,
                         lambda: self._gloo.allreduce(*a, **k))

    def allreduce_coalesced(self, *a, **k):
        return self._run("all_reduce_coalesced", "collective", _nbytes(a[0]), None,
                         lambda: self._gloo.allreduce_coalesced(*a, **k))

    def broadcast(self, *a, **k):
        return self._run("broadcast", "collective", _nbytes(a[0]), None,
                         lambda: self._gloo.broadcast(*a, **k))

    def reduce(self, *a, **k):
        return self._run("reduce", "collective", _nbytes(a[0]), None,
                         lambda: self._gloo.reduce(*a, **k))

    def allgather(self, *a, **k):  # (output lists, inputs): the first gathered list's bytes
        return self._run("all_gather", "collective", _nbytes(a[0][:1]), None,
                         lambda: self._gloo.allgather(*a, **k))

    def allgather_coalesced(self, *a, **k):
        return self._run("all_gather_coalesced", "collective", _nbytes(a[0]), None,
                         lambda: self._gloo.allgather_coalesced(*a, **k))

    def all_gather_single(self, *a, **k):  # (output, input): the whole gathered output
        return self._run("all_gather_single", "collective", _nbytes(a[0]), None,
                         lambda: self._gloo._allgather_base(*a, **k))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, *a, **k):
        return self._run("all_gather_into_tensor_coalesced", "collective", _nbytes(outputs), None,
                         lambda: _all(self._gloo._allgather_base(o, i, *a, **k)
                                      for o, i in zip(outputs, inputs)))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, *a, **k):  # (outputs, input lists): the first scattered list
        return self._run("reduce_scatter", "collective", _nbytes(a[1][:1]), None,
                         lambda: self._gloo.reduce_scatter(*a, **k))

    def reduce_scatter_single(self, *a, **k):  # (output, input): the whole input
        return self._run("reduce_scatter_single", "collective", _nbytes(a[1]), None,
                         lambda: self._gloo._reduce_scatter_base(*a, **k))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, *a, **k):
        return self._run("reduce_scatter_tensor_coalesced", "collective", _nbytes(inputs), None,
                         lambda: _all(self._gloo._reduce_scatter_base(o, i, *a, **k)
                                      for o, i in zip(outputs, inputs)))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(self, *a, **k):
        return self._run("all_to_all", "collective", _nbytes(a[1]), None,
                         lambda: self._gloo.alltoall(*a, **k))

    def all_to_all_single(self, *a, **k):
        return self._run("all_to_all_single", "collective", _nbytes(a[1]), None,
                         lambda: self._gloo.alltoall_base(*a, **k))

    alltoall_base = all_to_all_single

    def gather(self, *a, **k):  # the full buffer the root holds
        return self._run("gather", "collective", _nbytes(a[1][:1]) * self.size(), None,
                         lambda: self._gloo.gather(*a, **k))

    def scatter(self, *a, **k):
        return self._run("scatter", "collective", _nbytes(a[0][:1]) * self.size(), None,
                         lambda: self._gloo.scatter(*a, **k))

    def barrier(self, *a, **k):
        return self._run("barrier", "collective", 0, None, lambda: self._gloo.barrier(*a, **k))

    def monitored_barrier(self, *a, **k):
        return self._run("monitored_barrier", "collective", 0, None,
                         lambda: self._gloo.monitored_barrier(*a, **k))

    def send(self, tensors, dst, *a, **k):
        return self._run("send", "p2p", _nbytes(tensors), dst,
                         lambda: self._gloo.send(tensors, dst, *a, **k))

    def recv(self, tensors, src, *a, **k):
        return self._run("recv", "p2p", _nbytes(tensors), src,
                         lambda: self._gloo.recv(tensors, src, *a, **k))

    def recv_anysource(self, tensors, *a, **k):
        return self._run("recv", "p2p", _nbytes(tensors), None,
                         lambda: self._gloo.recv_anysource(tensors, *a, **k))


class _AllOf(_C.Work):
    """One work standing for several (a coalesced call done as one op per tensor)."""

    def __init__(self, works: list[Any]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: Any = None) -> bool:
        for w in self._works:
            w.wait()
        return True

    def get_future(self) -> Any:
        return torch.futures.collect_all([w.get_future() for w in self._works])


def _all(works: Any) -> Any:
    return _AllOf(list(works))


# kit.trace's second hook: ``hook(record, work)`` once the operation is issued.
_issued: list[Callable[[Record, Any], None]] = []


def _create(opts: Any, backend_options: Any) -> RecordingProcessGroup:
    return RecordingProcessGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                                 opts.global_ranks_in_group, opts.group_id)


_lock = threading.Lock()
_state: dict[str, Any] = {}


def installed() -> bool:
    """Whether this process records its gloo groups."""
    return bool(_state)


def _register() -> None:
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])


# Done once where this module is imported (the launcher imports it before forking ranks), not
# in every rank: in a freshly forked rank these two cost ~0.8 ms of CPU (copy-on-write pages),
# most of what recording added to a launch. Registering a backend under a new name changes
# nothing for code that asks for "gloo"; only install() below makes gloo groups recording ones.
_register()
_HELPER_SIGNATURE = inspect.signature(c10d._new_process_group_helper)
_HELPER_CODE = c10d._new_process_group_helper.__code__


def install() -> None:
    """From now on, gloo process groups this process creates are recording groups.

    Makes ``init_process_group("gloo")`` and ``new_group`` build the registered backend, while
    ``dist.get_backend()`` still reports ``"gloo"``. Idempotent; called by each rank
    :func:`kit.launch` starts with ``backend="gloo"``.
    """
    with _lock:
        if _state:
            return
        _register()
        helper = c10d._new_process_group_helper
        signature = (_HELPER_SIGNATURE if helper.__code__ is _HELPER_CODE
                     else inspect.signature(helper))

        def new_process_group(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            wanted = str(bound.arguments.get("backend"))
            if wanted not in ("gloo", "cpu:gloo"):
                return helper(*args, **kwargs)
            bound.arguments["backend"] = dist.Backend(NAME)
            pg, store = helper(*bound.args, **bound.kwargs)
            if isinstance(pg, RecordingProcessGroup):  # what code asks about it says gloo
                c10d._world.pg_map[pg] = ("gloo", c10d._world.pg_map[pg][1])
                c10d._world.pg_backend_config[pg] = "cpu:gloo"
            return pg, store

        new_process_group.__wrapped__ = helper  # type: ignore[attr-defined]
        c10d._new_process_group_helper = new_process_group
        _state["helper"] = helper
