"""Hard gates: a task whose code uses what it re-implements, or the grader's own code, scores 0.

A task names what it re-implements in ``Task.forbidden``: dotted names of functions, classes,
C++ builtins (``"torch._amp_update_scale_"``) or whole modules (``"torch.distributed.pipelining"``,
which forbids everything defined in it and its submodules, private helpers included). Every
runner wraps a case's ``run`` in :func:`guard`; a use raises :class:`ForbiddenUse`, which
:func:`autograder.results.raised` turns into the status ``forbidden`` and
:func:`autograder.results.settle` into 0 points for the whole task. The message names what was
used and where (``file:line``).

The nets, because code reaches a library by many routes:

* the source (:func:`check_source`): the task's function or class and the module-level helpers
  it calls, read as an AST with the module's imports resolved (``from torch.distributed import
  all_reduce``, ``dist.all_reduce``, ``getattr(dist, "all_reduce")``, ``import autograder``);
  a name under a forbidden module counts, and so does anything whose ``__module__`` is there;
* the class: a task class (or a class it uses) with a forbidden base, or a base defined in
  ``autograder`` (``class EGNNLayer(ReferenceEGNNLayer): pass``);
* code identity: a function of the student's module (the task itself, its methods, every
  function and class the module defines, copies made at load time with
  ``types.FunctionType(ref.__code__, ...)`` or ``f.__code__ = ref.__code__``) whose code is the
  grader's (its file is in ``autograder/``, or its bytecode and constants are those of one of the
  grader's references) or a forbidden library function's (its file or definition, or its
  bytecode and constants);
* calls at run time: each forbidden Python function (every method of a forbidden class, every
  function of a forbidden module) and every function of ``autograder`` gets a trampoline in place
  (same function object and signature, so names imported earlier are caught) that refuses a call
  made by the student's code;
* C++ builtins at run time: a :class:`torch.overrides.TorchFunctionMode`, active only while a case
  of a task that forbids builtins runs, sees every route to them (``torch._amp_update_scale_``,
  ``getattr(torch, "_amp_" + "update_scale_")``, ``torch.ops.aten._amp_update_scale_``);
* imports at run time: a finder first on ``sys.meta_path`` refuses the student's import of a
  forbidden module not yet loaded, or of the grader's (``importlib.import_module`` of a computed
  name);
* the recorder (:mod:`kit.recorder`): a collective the task forbids, whatever the route
  (``ProcessGroup`` methods, functional collectives), and an all-reduce issued by torch's C++
  DDP reducer when the task forbids ``DistributedDataParallel``.

What a task forbids is resolved once per process (again when modules it names are imported
later); the grader's own fingerprints are computed once per loaded ``autograder`` module. The
run-time nets are set in the process that runs the case and inherited by the ranks it forks. A
use found anywhere (a rank, a DataLoader worker, a caught exception) is appended to a file the
guard reads when the case ends, so swallowing the exception does not hide it.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import os
import sys
import sysconfig
import tempfile
import textwrap
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from autograder import likeness

__all__ = ["ForbiddenUse", "check_source", "guard", "resolve", "watching"]

_HERE = Path(__file__).resolve().parent  # autograder/
_KIT = _HERE.parent / "kit"
_AUTOGRADER = str(_HERE) + os.sep
_GRADER = (_AUTOGRADER, str(_KIT) + os.sep)
_LIBRARIES = tuple({str(Path(p).resolve()) + os.sep for key in ("stdlib", "platstdlib", "purelib",
                                                                 "platlib")
                    if (p := sysconfig.get_paths().get(key))})
_TORCH = str(Path(importlib.import_module("torch").__file__).resolve().parent) + os.sep
_GRADER_NAME = "the grader's own code (autograder)"
# The runners themselves: the student's code never gets to call them, so they get no trampoline.
_RUNNERS = ("autograder.gates", "autograder.registry", "autograder.results", "autograder.checking",
            "autograder.loading")
# A copy of code smaller than this (bytes of bytecode, about 40 instructions) counts only when
# its file or definition gives it away: bytecode alone is shared by too many small functions
# (``return x``, ``[x for x in y]``, a one-line ``__inc__``, the formula 1.4 asks for, which
# kit.lessons.costmodel.ring_all_reduce_time also is).
_MIN_COPY_BYTES = 128

# Collectives by the name the recorder gives them; a task forbidding one of these dotted names
# forbids that operation on every route.
_DIST_PREFIXES = ("torch.distributed.", "torch.distributed.distributed_c10d.",
                  "torch.distributed._functional_collectives.")


class ForbiddenUse(Exception):
    """The task's code used ``what`` (a forbidden name, or the grader's code) at ``where``."""

    forbidden_use = True  # autograder.results.raised: the status is "forbidden"

    def __init__(self, task_id: str, what: str, where: str) -> None:
        self.task_id, self.what, self.where = task_id, what, where
        super().__init__(f"Task {task_id} uses {what} at {where}. This task asks you to build it "
                         "yourself, so the task scores 0: remove that use and check again.")


# --------------------------------------------------------------------------- whose frame


_kinds: dict[str, str] = {}


def _kind(filename: str) -> str:
    """"grader" (kit/, autograder/), "library" (torch, stdlib, site-packages) or "student"."""
    kind = _kinds.get(filename)
    if kind is None:
        path = str(Path(filename).resolve()) if filename.startswith(os.sep) else filename
        if path.startswith(_GRADER):
            kind = "grader"
        elif path.startswith((_TORCH, *_LIBRARIES)) or filename.startswith("<frozen"):
            kind = "library"
        else:  # the student's files, notebook cells ("cell 3", "<ipython-input-...>"), tests/bugs
            kind = "student"
        _kinds[filename] = kind
    return kind


def _in_autograder(filename: str) -> bool:
    return filename.startswith(os.sep) and str(Path(filename).resolve()).startswith(_AUTOGRADER)


def _where(frame: Any) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _student_caller(frame: Any) -> Any | None:
    """The student's frame that (through library code) made this call, or None if the grader
    did, or a library module's body did while being imported. A stack with neither is a thread
    the kernel or a library runs (Jupyter's own threads call into torch while a case runs): not
    the student's (a thread the student starts runs the student's function, a student frame)."""
    f = frame
    while f is not None:
        kind = _kind(f.f_code.co_filename)
        if kind == "student":
            return f
        if kind == "grader" or (kind == "library" and f.f_code.co_name == "<module>"):
            return None  # the grader's call, or an import's side effect (a library's top level)
        f = f.f_back
    # Neither (a thread of Jupyter's kernel, a library's own thread): not the student's call.
    return None


# --------------------------------------------------------------------------- resolving names


def resolve(dotted: str, *, load: bool = False) -> Any:
    """The object a dotted name stands for, or None.

    Without ``load`` nothing is imported whose top-level package is not imported already (the
    student's code cannot use a library nobody imported); with it, everything needed is.
    """
    parts = dotted.split(".")
    if parts[0] not in sys.modules and not load:
        return None
    for i in range(len(parts), 0, -1):
        module = sys.modules.get(".".join(parts[:i]))
        if module is None:
            try:
                module = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
        obj: Any = module
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


def _module_name(obj: Any) -> str | None:
    try:
        name = (obj.__name__ if isinstance(obj, types.ModuleType)
                else getattr(obj, "__module__", None))
    except Exception:  # noqa: BLE001 - a proxy whose attributes raise
        return None
    return name if isinstance(name, str) else None


def _is_builtin(obj: Any) -> bool:
    if isinstance(obj, (types.BuiltinFunctionType, types.MethodDescriptorType,
                        types.WrapperDescriptorType, types.ClassMethodDescriptorType)):
        return True
    ops = sys.modules.get("torch._ops")
    return ops is not None and isinstance(obj, (ops.OpOverload, ops.OpOverloadPacket))


def _op_name(obj: Any) -> str | None:
    """The dispatcher's name of a C++ builtin (``"aten::_amp_update_scale_"``), or None."""
    ops = sys.modules.get("torch._ops")
    if ops is not None and isinstance(obj, ops.OpOverload):
        return obj._schema.name
    if ops is not None and isinstance(obj, ops.OpOverloadPacket):
        return obj._qualified_op_name
    name = getattr(obj, "__name__", None)
    if not isinstance(name, str):
        return None
    import torch

    try:
        getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None
    return f"aten::{name}"


def _functions(value: Any) -> list[types.FunctionType]:
    """The Python functions a function or class stands for: itself and what it wraps
    (``functools.wraps``, NumPy's dispatchers), or every function in the class's own body."""
    if isinstance(value, type):
        found = []
        for member in list(vars(value).values()):
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if getattr(member, "__module__", value.__module__) != value.__module__:
                # not the class's own: a metaclass planted it (every Enum subclass holds
                # enum.Enum.__new__ itself); wrapping it would catch every enum's construction
                continue
            if isinstance(member, property):
                found += [f for f in (member.fget, member.fset, member.fdel)
                          if isinstance(f, types.FunctionType)]
            elif isinstance(member, types.FunctionType):
                found += _functions(member)
        return found
    found, seen = [], set()
    while value is not None and id(value) not in seen:
        seen.add(id(value))
        if isinstance(value, types.FunctionType):
            found.append(value)
        value = getattr(value, "__wrapped__", None) if not isinstance(value, type) else None
    return found


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and the code objects nested in it (functions, classes, comprehensions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


_prints: dict[types.CodeType, int] = {}


def _stable(value: Any) -> str:
    """``repr`` of a constant, the same in every process (sets sorted: their order follows the
    string hash, which differs between processes)."""
    if isinstance(value, (frozenset, set)):
        return "{" + ",".join(sorted(_stable(v) for v in value)) + "}"
    if isinstance(value, tuple):
        return "(" + ",".join(_stable(v) for v in value) + ")"
    return f"{type(value).__name__}:{value!r}"


def _print(code: types.CodeType) -> int:
    """A fingerprint of what ``code`` does: its bytecode, names and constants (nested code by its
    own fingerprint; the docstring left out), not its file, lines or local variable names. It is
    the same in every process, so the trusted parent can hand the references' fingerprints to
    the batch worker, which never sees the references themselves."""
    found = _prints.get(code)
    if found is None:
        digest = hashlib.blake2b(code.co_code, digest_size=8)
        for i, c in enumerate(code.co_consts):
            part = (f"<code {_print(c)}>" if isinstance(c, types.CodeType)
                    else "<doc>" if i == 0 and isinstance(c, str) else _stable(c))
            digest.update(b"\0" + part.encode("utf-8", "surrogatepass"))
        digest.update(b"\1" + "\0".join(code.co_names).encode())
        found = _prints[code] = int.from_bytes(digest.digest(), "big")
    return found


def answer_fingerprints() -> dict[str, str]:
    """``{fingerprint: name}`` of every reference loaded in this (trusted) process: what the
    batch worker needs to recognise a pasted reference (see :func:`trust_answer_fingerprints`)."""
    with _grader._lock:
        _grader.update()
        return {f"{fp:016x}": name for fp, name in _grader.prints.items()}


def answer_shapes() -> dict[str, dict[str, int]]:
    """``{name: shape}`` of every reference loaded in this (trusted) process
    (:func:`autograder.likeness.shape`: statement hashes and sizes, no source): what the batch
    worker needs to recognise a reference rewritten with other names or another order."""
    with _grader._lock:
        _grader.update()
        return {name: dict(found) for name, found in _grader.shapes.items()}


def trust_answer_fingerprints(prints: dict[str, str],
                              shapes: dict[str, dict[str, int]] | None = None) -> None:
    """Judge copies against these references too: the batch worker gets them from the parent,
    since ``autograder/references/`` is hidden from it. Only hashes, sizes and names travel."""
    _grader.update()
    for fp, name in prints.items():
        _grader.prints.setdefault(int(fp, 16), name)
    for name, found in (shapes or {}).items():
        if name not in SOLUTION_SHAPED:
            _grader.shapes.setdefault(name, {str(h): int(w) for h, w in found.items()})


def _code_of(fn: types.FunctionType) -> types.CodeType:
    """``fn``'s own code, also while a guard has put a trampoline in its place."""
    swapped = _swapped.get(id(fn))
    return swapped[3] if swapped is not None and swapped[0] is fn else fn.__code__


def _place(code: types.CodeType) -> tuple[str, int, str]:
    return code.co_filename, code.co_firstlineno, code.co_name


# --------------------------------------------------------------------------- what a task forbids


class _Forbidden:
    """What a task's forbidden names stand for in this process (objects, module prefixes, C++
    builtins, and the Python functions, files and fingerprints under them)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.objects: dict[int, str] = {}  # id -> the forbidden name it resolves to
        self.prefixes: dict[str, str] = {}  # module name -> the forbidden name
        self.builtins: dict[int, str] = {}  # C++ builtins: the TorchFunctionMode's net
        self.op_names: dict[str, str] = {}  # "aten::..." -> the forbidden name
        self.missing: set[str] = set()  # top-level packages not imported yet
        self._resolved: list[tuple[Any, str]] = []  # also keeps their ids theirs
        for name in names:
            obj = resolve(name)
            if obj is None:
                if name.split(".")[0] not in sys.modules:
                    self.missing.add(name.split(".")[0])
                continue
            self._resolved.append((obj, name))
            self.objects[id(obj)] = name
            if isinstance(obj, types.ModuleType):
                self.prefixes[name] = self.prefixes[obj.__name__] = name
            elif _is_builtin(obj) and (op := _op_name(obj)) is not None:
                # an operator of torch's (the others, pybind functions such as
                # torch.distributed._broadcast_coalesced, never reach a TorchFunctionMode)
                self.builtins[id(obj)] = name
                self.op_names[op] = name
        self.dist_ops = {name.rsplit(".", 1)[1] for name in names
                         if name.rsplit(".", 1)[0] + "." in _DIST_PREFIXES
                         and name not in self.prefixes}
        self.no_ddp = any(name.endswith("DistributedDataParallel") for name in names)
        self._indexed_at: Any = None

    def stale(self) -> bool:
        """A package it names was imported since: resolve again."""
        return any(head in sys.modules for head in self.missing)

    def module_of(self, module_name: str) -> str | None:
        for prefix, name in self.prefixes.items():
            if module_name == prefix or module_name.startswith(prefix + "."):
                return name
        return None

    def named(self, dotted: str) -> str | None:
        """The forbidden name ``dotted`` is, or is reached through (``torch.amp.grad_scaler.X``)."""
        for name in self.names:
            if dotted == name or dotted.startswith(name + "."):
                return name
        return None

    def of(self, obj: Any) -> str | None:
        """The forbidden name ``obj`` is, or is defined under (a module prefix), else None."""
        name = self.objects.get(id(obj))
        if name is None and self.prefixes and (module := _module_name(obj)) is not None:
            name = self.module_of(module)
        return name

    def index(self) -> None:
        """The Python functions under the forbidden names, their files, definitions and
        fingerprints; computed again when modules were imported since."""
        seen = frozenset(list(sys.modules))  # not a count: one can come back with other modules
        if self._indexed_at == seen:
            return
        self._indexed_at = seen
        functions: dict[int, tuple[types.FunctionType, str]] = {}
        for obj, name in self._resolved:
            if not isinstance(obj, types.ModuleType):
                for fn in _functions(obj):
                    functions.setdefault(id(fn), (fn, name))
        self.files: dict[str, str] = {}
        if self.prefixes:
            for module_name, module in list(sys.modules.items()):
                name = self.module_of(module_name)
                if name is None or module is None:
                    continue
                if isinstance(getattr(module, "__file__", None), str):
                    self.files[module.__file__] = name
                for value in list(vars(module).values()):
                    if (isinstance(value, (types.FunctionType, type))
                            and getattr(value, "__module__", None) == module_name):
                        for fn in _functions(value):
                            functions.setdefault(id(fn), (fn, name))
        self.functions = list(functions.values())
        self.originals = set(functions)
        self.places: dict[tuple[str, int, str], str] = {}
        self.prints: dict[int, str] = {}
        for fn, name in self.functions:
            code = _code_of(fn)
            module = sys.modules.get(getattr(fn, "__module__", None) or "")
            if getattr(fn, "__wrapped__", None) is not None and \
                    getattr(module, "__file__", None) != code.co_filename:
                continue  # a decorator's wrapper, shared by every function it decorates
            self.places[_place(code)] = name
            if len(code.co_code) >= _MIN_COPY_BYTES:
                self.prints.setdefault(_print(code), f"{name} ({fn.__module__}.{fn.__qualname__})")
        self._shapes: dict[str, likeness.Shape] | None = None

    def shapes(self) -> dict[str, likeness.Shape]:
        """The source shapes of the forbidden Python functions big enough to copy, read on first
        use (after :meth:`index`)."""
        if self._shapes is None:
            self._shapes = {}
            for fn, name in self.functions:
                found = likeness.shape(fn)
                if found is not None and likeness.weight(found) >= likeness.MIN_WEIGHT:
                    self._shapes.setdefault(f"{name} ({fn.__module__}.{fn.__qualname__})", found)
        return self._shapes


_specs: dict[tuple[str, ...], _Forbidden] = {}


def _spec(names: tuple[str, ...]) -> _Forbidden:
    spec = _specs.get(names)
    if spec is None or spec.stale():
        spec = _specs[names] = _Forbidden(names)
    return spec


# --------------------------------------------------------------------------- the grader's own code


class _GraderCode:
    """Every function and class ``autograder`` defines (its originals), where each is defined,
    and the fingerprints of its references (each task's ``reference``, in
    ``autograder.references`` or given as an object, and ``_reference_*``/``Reference*``): what a
    copy of the grader's code matches. Not the rest: the trusted helpers re-state the lessons'
    setup code (Lesson 02's ``make_model``), which the student's module holds too."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self.originals: set[int] = set()
        self.places: dict[tuple[str, int, str], str] = {}
        self.prints: dict[int, str] = {}
        self.shapes: dict[str, likeness.Shape] = {}  # reference name -> its statements' shape
        self.functions: list[tuple[types.FunctionType, str]] = []  # what gets a trampoline
        self._keep: list[Any] = []
        self._references: set[int] = set()
        self._seen_at: Any = None
        # A batch grades submissions from several threads: one must not read the fingerprints
        # while another, having marked them current, is still adding to them.
        self._lock = threading.RLock()

    def update(self) -> None:
        with self._lock:
            self._update()

    def _update(self) -> None:
        from autograder.registry import TASKS

        # The grader's modules and tasks as they are now (a count of sys.modules alone can come
        # back to an earlier value with another module in it).
        seen = (frozenset(m for m in list(sys.modules) if m == "autograder"
                          or m.startswith("autograder.")),
                len(TASKS))
        if self._seen_at == seen:
            return
        self._seen_at = seen
        for module_name, module in list(sys.modules.items()):
            if module is None or module_name in self.modules or not (
                    module_name == "autograder" or module_name.startswith("autograder.")):
                continue
            self.modules.add(module_name)
            for key, value in list(vars(module).items()):
                if not (isinstance(value, (types.FunctionType, type))
                        and getattr(value, "__module__", None) == module_name):
                    continue
                self._keep.append(value)
                self.originals.add(id(value))
                if isinstance(value, types.FunctionType) and module_name not in _RUNNERS:
                    self.functions.append((value,
                                           f"{_GRADER_NAME}: {module_name}.{value.__name__}"))
                for fn in _functions(value):
                    self.originals.add(id(fn))
                    for inner in _codes(_code_of(fn)):
                        self.places.setdefault(_place(inner), f"{module_name}.{inner.co_qualname}")
                if "reference" in key.lower():
                    self._reference(value)
        for t in list(TASKS.values()):
            ref = t.reference
            if isinstance(ref, str):
                ref = getattr(sys.modules.get(f"autograder.references.lesson{t.lesson:02d}"), ref,
                              None)
            if ref is not None and _is_grader(ref):
                self._reference(ref)

    def _reference(self, value: Any) -> None:
        if id(value) in self._references:
            return
        self._references.add(id(value))
        self._keep.append(value)
        name = f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
        if name not in SOLUTION_SHAPED and (found := likeness.shape(value)) is not None \
                and likeness.weight(found) >= likeness.MIN_WEIGHT:
            self.shapes.setdefault(name, found)
        for fn in _functions(value):
            code = _code_of(fn)
            # A reference's constructor is the task's scaffolding: the stub hands it out;
            # generated code (a dataclass's __repr__) is the same for every dataclass.
            if fn.__name__ != "__init__" and _in_autograder(code.co_filename) \
                    and len(code.co_code) >= _MIN_COPY_BYTES:
                self.prints.setdefault(_print(code), f"{fn.__module__}.{fn.__qualname__}")


# References an honest solution writes statement for statement (reading four environment
# variables; the EGNN layer's equations, as the paper writes them): a rewritten copy of them
# cannot be told from the task done, so only their bytecode counts. tests/test_gates.py keeps
# this list to exactly the references the solutions match.
SOLUTION_SHAPED = frozenset({"autograder.references.lesson02.dist_info_from_env",
                             "autograder.references.lesson10.ReferenceEGNNLayer"})

_grader = _GraderCode()


# --------------------------------------------------------------------------- state of a guard


class _Gate:
    def __init__(self, task: Any, log: str, spec: _Forbidden) -> None:
        self.task_id = task.id
        self.log = log
        self.forbidden = tuple(task.forbidden)
        self.spec = spec
        self.ops = spec.dist_ops
        self.no_ddp = spec.no_ddp

    def found(self, what: str, where: str) -> ForbiddenUse:
        try:  # O_APPEND: ranks and workers may write at once
            fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.write(fd, f"{what}\t{where}\n".encode())
            os.close(fd)
        except OSError:
            pass
        return ForbiddenUse(self.task_id, what, where)


_gate: _Gate | None = None


def _on_call(key: int, args: tuple, kwargs: dict) -> Any:
    original, what = _swapped[key][1], _swapped[key][2]
    gate = _gate
    if gate is not None:
        caller = _student_caller(sys._getframe(2))  # 0 here, 1 the trampoline, 2 its caller
        if caller is not None:
            raise gate.found(what, _where(caller))
    return original(*args, **kwargs)


def _observe(record: Any) -> None:
    gate = _gate
    if gate is None:
        return
    if record.kind == "collective" and record.route == "c++" and gate.no_ddp:
        caller = _student_caller(record.frame)
        where = _where(caller if caller is not None else record.frame)
        raise gate.found(f"torch.nn.parallel.DistributedDataParallel (its C++ reducer issued a "
                         f"{record.op} of {record.nbytes} bytes)", where)
    if record.op in gate.ops:
        caller = _student_caller(record.frame)
        if caller is not None:
            raise gate.found(f"torch.distributed.{record.op} (through {record.route})",
                             _where(caller))


_IMPORTING = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>",
              importlib.__file__)


class _ImportNet:
    """A finder first on ``sys.meta_path`` while a case runs: it refuses the student's own import
    of a forbidden module (or of the grader's) not loaded yet, by any route, computed names
    included (``importlib.import_module("autograder." + "references.lesson01")``), and finds
    nothing itself."""

    @staticmethod
    def find_spec(fullname: str, path: Any = None, target: Any = None) -> None:
        gate = _gate
        if gate is None:
            return None
        if fullname == "autograder" or fullname.startswith("autograder."):
            what = f"{_GRADER_NAME}: {fullname}"
        elif (what := gate.spec.module_of(fullname)) is None:
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename in _IMPORTING:
            frame = frame.f_back
        if frame is not None and _kind(frame.f_code.co_filename) == "student":
            raise gate.found(f"{what} (imported at run time: {fullname})", _where(frame))
        return None


def _builtin_net(gate: _Gate) -> Any:
    """A TorchFunctionMode that refuses the student's calls of the task's forbidden builtins."""
    from torch._ops import OpOverload, OpOverloadPacket
    from torch.overrides import TorchFunctionMode

    spec = gate.spec

    class _BuiltinNet(TorchFunctionMode):
        def __torch_function__(self, func: Any, _types: Any, args: tuple = (),
                               kwargs: Any = None) -> Any:
            what = spec.builtins.get(id(func))
            if what is None and spec.op_names and isinstance(func, (OpOverload, OpOverloadPacket)):
                what = spec.op_names.get(_op_name(func) or "")
            if what is not None:
                caller = _student_caller(sys._getframe(1))
                if caller is not None:
                    raise gate.found(f"{what} (a C++ builtin, called at run time)", _where(caller))
            return func(*args, **(kwargs or {}))

    return _BuiltinNet()


# --------------------------------------------------------------------------- trampolines

# id -> (function, the original's copy, the dotted name, the original code)
_swapped: dict[int, tuple[Any, Any, str, Any]] = {}
# id -> (function, its trampoline's code): compiled once per function and process
_trampolines: dict[int, tuple[Any, types.CodeType]] = {}
# What the installed trampolines watch for: (the task's forbidden names, their index, the grader's
# code), or None when none is installed. Inside watching(), they stay between the cases that
# watch for the same things.
_installed: tuple[Any, ...] | None = None
_keeping = 0  # depth of watching() blocks


def _trampoline(fn: types.FunctionType, key: int) -> types.CodeType:
    """Code for ``fn`` with ``fn``'s parameters (so its signature and defaults stay) and free
    variables (so it can replace ``fn.__code__`` in place) that calls ``_on_call(key, args,
    kwargs)`` with the arguments as bound."""
    code = fn.__code__
    names = code.co_varnames
    n_pos, n_kw = code.co_argcount, code.co_kwonlyargcount
    positional, keyword = list(names[:n_pos]), list(names[n_pos:n_pos + n_kw])
    at = n_pos + n_kw
    star = names[at] if code.co_flags & inspect.CO_VARARGS else None
    at += bool(star)
    starstar = names[at] if code.co_flags & inspect.CO_VARKEYWORDS else None
    params = positional[:code.co_posonlyargcount] + (["/"] if code.co_posonlyargcount else [])
    params += positional[code.co_posonlyargcount:]
    params += [f"*{star}"] if star else (["*"] if keyword else [])
    params += keyword + ([f"**{starstar}"] if starstar else [])
    args = "(" + "".join(f"{p}, " for p in positional + ([f"*{star}"] if star else [])) + ")"
    kwargs = "{" + ", ".join([f"{k!r}: {k}" for k in keyword]
                             + ([f"**{starstar}"] if starstar else [])) + "}"
    free = code.co_freevars
    body = "".join(f"    {v} = None\n" for v in free)
    uses = f"        ({', '.join(free)},)\n" if free else ""
    source = (f"def _outer():\n{body}    def _t({', '.join(params)}):\n{uses}"
              f"        return __kit_gate_call__({key}, {args}, {kwargs})\n    return _t\n")
    scope: dict[str, Any] = {}
    exec(compile(source, code.co_filename, "exec"), scope)  # noqa: S102 - our own code
    return scope["_outer"]().__code__.replace(co_name=code.co_name, co_qualname=code.co_qualname,
                                              co_firstlineno=code.co_firstlineno)


def _swap(obj: Any, what: str) -> None:
    for fn in _functions(obj):
        if id(fn) in _swapped:
            continue
        cached = _trampolines.get(id(fn))
        if cached is None or cached[0] is not fn:
            try:
                cached = _trampolines[id(fn)] = (fn, _trampoline(fn, id(fn)))
            except (ValueError, TypeError, SyntaxError):
                continue
        copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                                  fn.__closure__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        fn.__globals__.setdefault("__kit_gate_call__", _on_call)
        _swapped[id(fn)] = (fn, copy, what, fn.__code__)
        try:
            fn.__code__ = cached[1]
        except (ValueError, TypeError):
            del _swapped[id(fn)]


def _restore() -> None:
    global _installed
    for fn, _, _, code in _swapped.values():
        fn.__code__ = code
    _swapped.clear()
    _installed = None


def _watch(spec: _Forbidden) -> None:
    global _installed
    spec.index()
    _grader.update()
    wanted = (spec, spec._indexed_at, _grader._seen_at)
    if _installed is not None and _installed[0] is spec:  # kept by watching(): the same task's
        if all(a is b for a, b in zip(_installed, wanted)):
            return  # nothing imported since: the same functions
        # Modules were imported since: swap what is new (the swapped ones are skipped)
    else:
        _restore()
    for fn, name in spec.functions + _grader.functions:
        _swap(fn, name)
    _installed = wanted


@contextmanager
def watching() -> Iterator[None]:
    """Keep each case's trampolines installed after its :func:`guard` ends, until a case that
    watches for other functions, or the end of this block: a task's cases then swap the
    functions once, and again only for what was imported since, not once per case (over every
    task's 240 cases: 30,393 swaps and 0.42 s instead of 110,238 and 0.72 s). Between cases no
    gate is active, so a trampoline just calls its
    original: code that runs there (the trusted expectation, saving a result) behaves the same.
    On leaving, every function gets its own code back, as after a plain :func:`guard`."""
    global _keeping
    _keeping += 1
    try:
        yield
    finally:
        _keeping -= 1
        if not _keeping and _gate is None:
            _restore()


# --------------------------------------------------------------------------- the source


def _source_of(impl: Any) -> tuple[str, int, str] | None:
    try:
        lines, start = inspect.getsourcelines(impl)
        return textwrap.dedent("".join(lines)), start, inspect.getsourcefile(impl) or "<unknown>"
    except (OSError, TypeError):
        return None


def _aliases(tree: ast.AST) -> dict[str, str]:
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    names[a.asname] = a.name
                else:
                    names[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)):
        base = _dotted(node.args[0])
        return f"{base}.{node.args[1].value}" if base else None
    return None


_parses: dict[int, tuple[Any, Any, Any]] = {}  # id(obj) -> (obj, its code, its parse)


def _parsed(obj: Any) -> tuple[ast.Module, int, str, dict[str, str]] | None:
    """``obj``'s source as an AST, its first line, its file and its imports; read once per
    object (and again once a function's code was replaced)."""
    code = getattr(obj, "__code__", None)
    hit = _parses.get(id(obj))
    if hit is not None and hit[0] is obj and hit[1] is code:
        return hit[2]
    parsed = None
    if (found := _source_of(obj)) is not None:
        text, start, path = found
        try:
            body = ast.parse(text)
            parsed = (body, start, path, _aliases(body))
        except SyntaxError:
            pass
    _parses[id(obj)] = (obj, code, parsed)
    return parsed


_trees: dict[int, tuple[Any, Any, Any]] = {}  # id(module) -> (module, its file's stat, its parse)


def _module_tree(impl: Any) -> tuple[types.ModuleType | None, ast.Module | None, dict[str, Any]]:
    module = sys.modules.get(getattr(impl, "__module__", "") or "")
    if module is None:
        return None, None, {}
    try:
        stat = os.stat(module.__file__)
        stamp: Any = (stat.st_mtime_ns, stat.st_size)
    except (AttributeError, TypeError, OSError):
        stamp = None
    hit = _trees.get(id(module))
    if hit is None or hit[0] is not module or hit[1] != stamp:
        try:
            tree = ast.parse(inspect.getsource(module))
        except (OSError, TypeError, SyntaxError):
            tree = None
        hit = _trees[id(module)] = (module, stamp, tree)
    return module, hit[2], vars(module)


def _is_grader(obj: Any) -> bool:
    module = _module_name(obj)
    return module is not None and (module == "autograder" or module.startswith("autograder."))


def _base_class_use(task: Any, spec: _Forbidden, cls: type) -> ForbiddenUse | None:
    for base in cls.__mro__[1:]:
        what = spec.of(base)
        if what is None and _is_grader(base):
            what = f"{_GRADER_NAME}: {base.__module__}.{base.__qualname__}"
        if what is not None:
            line = _source_of(cls)
            where = f"{line[2]}:{line[1]}" if line else cls.__qualname__
            return ForbiddenUse(task.id, f"{what} (as a base class of {cls.__name__})", where)
    return None


def _binding(module: types.ModuleType | None, tree: ast.Module | None, fn: Any) -> str:
    """Where the student's module makes ``fn`` (a function whose code came from elsewhere):
    the line binding its name, or the first line that touches a ``__code__``."""
    path = getattr(module, "__file__", None) or "<unknown>"
    if tree is None:
        return f"{path}:1"
    names = {fn.__name__} | {k for k, v in vars(module).items() if v is fn}
    fallback = None
    for node in ast.walk(tree):
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and node.name in names):
            return f"{path}:{node.lineno}"
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id in names:
                    return f"{path}:{node.lineno}"
                if (isinstance(t, ast.Attribute) and t.attr == "__code__"
                        and _dotted(t.value) in names):
                    return f"{path}:{node.lineno}"
        if isinstance(node, ast.Attribute) and node.attr == "__code__":
            fallback = node.lineno if fallback is None else min(fallback, node.lineno)
    return f"{path}:{fallback or 1}"


def _is_original(fn: types.FunctionType) -> bool:
    """``fn`` is the function its module defines under its name (not a copy made elsewhere)."""
    obj: Any = sys.modules.get(fn.__module__ or "")
    for part in fn.__qualname__.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return False
    return any(f is fn for f in _functions(obj))


def _copy_use(task: Any, spec: _Forbidden, impl: Any, module: types.ModuleType | None,
              tree: ast.Module | None, reached: list[Any]) -> ForbiddenUse | None:
    """A function of the student's whose code is the grader's or a forbidden function's."""
    candidates: list[Any] = [impl, *reached]
    if isinstance(impl, type):
        candidates += [b for b in impl.__mro__[1:] if b.__module__ == impl.__module__]
    spaces = [vars(module)] if module is not None else []
    own = getattr(impl, "__globals__", None)
    if own is not None and all(own is not space for space in spaces):
        spaces.append(own)  # a function made at load time with globals of its own
    for space in spaces:
        candidates += [v for v in list(space.values())
                       if isinstance(v, (types.FunctionType, type))
                       and getattr(v, "__module__", None) == getattr(module, "__name__", None)]
    seen: set[int] = set()
    for candidate in candidates:
        for fn in _functions(candidate):
            if id(fn) in seen or id(fn) in _grader.originals or id(fn) in spec.originals:
                continue
            seen.add(id(fn))
            code = _code_of(fn)
            kind = _kind(code.co_filename)
            if kind in ("library", "grader") and _is_original(fn):
                continue  # the library's (or kit's) own function: the other nets judge a use of it
            for inner in _codes(code):
                what, own_file = None, False
                if _in_autograder(inner.co_filename):
                    what = f"{_GRADER_NAME}: a copy of " + _grader.places.get(
                        _place(inner), f"code from {inner.co_filename}")
                elif kind in ("library", "grader"):  # grader: a forbidden kit function (9.4)
                    name = spec.files.get(inner.co_filename) or spec.places.get(_place(inner))
                    if name is not None:
                        what = f"{name} (a copy of {inner.co_qualname} from {inner.co_filename})"
                elif kind == "student" and len(inner.co_code) >= _MIN_COPY_BYTES \
                        and inner.co_filename != "<string>":  # not generated (a dataclass's)
                    own_file = True
                    fp = _print(inner)
                    if fp in _grader.prints:
                        what = f"{_GRADER_NAME}: a copy of {_grader.prints[fp]}"
                    elif fp in spec.prints:
                        what = f"a copy of {spec.prints[fp]}"
                if what is not None:
                    where = (f"{inner.co_filename}:{inner.co_firstlineno}" if own_file
                             else _binding(module, tree, fn))
                    return ForbiddenUse(task.id, what, where)
    return _rewritten_copy(task, spec, candidates)


def _rewritten_copy(task: Any, spec: _Forbidden, candidates: list[Any]) -> ForbiddenUse | None:
    """A function or class of the student's whose statements are a reference's or a forbidden
    function's with the names, constants, order or layout changed (:mod:`autograder.likeness`)."""
    known = [(f"{_GRADER_NAME}: a rewritten copy of {name}", found)
             for name, found in list(_grader.shapes.items())]
    known += [(f"a rewritten copy of {name}", found) for name, found in spec.shapes().items()]
    if not known:
        return None
    seen: set[int] = set()
    for candidate in candidates:
        objects = [candidate, *(_functions(candidate) if isinstance(candidate, type) else ())]
        for obj in objects:
            if id(obj) in seen or id(obj) in _grader.originals or id(obj) in spec.originals:
                continue
            seen.add(id(obj))
            code = getattr(obj, "__code__", None)
            if code is not None and _kind(_code_of(obj).co_filename) != "student":
                continue
            if code is None and not isinstance(obj, type):
                continue
            found = likeness.shape(obj)
            if not found:
                continue
            for what, reference in known:
                share = likeness.likeness(found, reference)
                if share >= likeness.THRESHOLD:
                    place = _source_of(obj)
                    where = f"{place[2]}:{place[1]}" if place else getattr(obj, "__qualname__", "?")
                    return ForbiddenUse(task.id, f"{what} ({share:.0%} of its statements, with "
                                                 "other names, constants or order)", where)
    return None


_verdicts: dict[tuple, tuple[Any, tuple[str, str] | None]] = {}


def check_source(task: Any, impl: Any) -> ForbiddenUse | None:
    """The first forbidden name (or grader import), forbidden or grader base class, or copy of
    the grader's or a forbidden function's code the task's code uses, else None.

    Reads ``impl``'s source and the source of the module-level functions and classes of its
    module that it names (helpers), resolving names through the module's imports; then compares
    the code of every function the student's module defines with the grader's and the
    forbidden ones'. The verdict is kept until the module's names, what the task forbids or the
    grader's loaded code change.
    """
    if impl is None:
        return None
    spec = _spec(tuple(task.forbidden))
    spec.index()
    _grader.update()
    module = sys.modules.get(getattr(impl, "__module__", "") or "")
    names = tuple((k, id(v)) for k, v in list(vars(module).items())) if module is not None else ()
    key = (task.id, id(impl), id(getattr(impl, "__code__", None)),
           id(getattr(impl, "__globals__", None)), hash(names), id(spec), spec._indexed_at,
           _grader._seen_at)
    hit = _verdicts.get(key)
    if hit is None or hit[0] is not impl:
        found = _check(task, spec, impl)
        hit = _verdicts[key] = (impl, None if found is None else (found.what, found.where))
    return None if hit[1] is None else ForbiddenUse(task.id, *hit[1])


def _check(task: Any, spec: _Forbidden, impl: Any) -> ForbiddenUse | None:
    # The task's name bound to the grader's object or to a forbidden one (an import at load time)
    what = spec.of(impl) or (f"{_GRADER_NAME}: "
                             f"{impl.__module__}.{getattr(impl, '__qualname__', '')}"
                             if _is_grader(impl) and id(impl) in _grader.originals else None)
    if what is not None:
        return ForbiddenUse(task.id, what, f"{task.name} itself (it is that object)")
    module, tree, namespace = _module_tree(impl)
    aliases = _aliases(tree) if tree is not None else {}
    todo, seen, reached = [impl], set(), []
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, type) and (found := _base_class_use(task, spec, obj)) is not None:
            return found
        if isinstance(obj, types.FunctionType) and _kind(_code_of(obj).co_filename) != "student":
            reached.append(obj)  # its source is another file's (a copy): judged by its code below
            continue
        parsed = _parsed(obj)
        if parsed is None:
            continue
        body, start, path, own = parsed
        local = {**aliases, **own}
        # A function's names are its own globals' (a copy made with other globals has others).
        names = obj.__globals__ if isinstance(obj, types.FunctionType) else namespace
        for node in ast.walk(body):
            dotted = _dotted(node)
            if dotted is None:
                continue
            head, _, rest = dotted.partition(".")
            full = local.get(head, head) + (f".{rest}" if rest else "")
            where = f"{path}:{start + getattr(node, 'lineno', 1) - 1}"
            if full == "autograder" or full.startswith("autograder."):
                return ForbiddenUse(task.id, f"{_GRADER_NAME}: {full}", where)
            if head in local or head in ("torch",):
                what = spec.named(full)
                obj_ = resolve(full) if what is None else None
                if obj_ is not None:
                    what = spec.of(obj_)
                if what is not None:
                    return ForbiddenUse(task.id, what if what == full else f"{what} ({full})",
                                        where)
                if obj_ is not None and _is_grader(obj_):
                    return ForbiddenUse(task.id, f"{_GRADER_NAME}: {full}", where)
            elif isinstance(node, ast.Name) and head in names and head not in local:
                helper = names[head]  # a module-level helper of the student's: read it too
                if isinstance(helper, (types.FunctionType, type)) and \
                        getattr(helper, "__module__", None) == getattr(impl, "__module__", None):
                    todo.append(helper)
                elif (what := spec.of(helper)) is not None:
                    return ForbiddenUse(task.id, what, where)
                elif isinstance(helper, (types.FunctionType, type)):
                    if _is_grader(helper) and id(helper) in _grader.originals:
                        return ForbiddenUse(task.id, f"{_GRADER_NAME}: {helper.__module__}."
                                            f"{helper.__qualname__}", where)
                    reached.append(helper)  # another module's: maybe a copy made at load time
                    if isinstance(helper, type) and (
                            found := _base_class_use(task, spec, helper)) is not None:
                        return found
    return _copy_use(task, spec, impl, module, tree, reached)


# --------------------------------------------------------------------------- the guard


def current() -> tuple[str, str] | None:
    """The active case's gate as plain data, ``(task id, log path)``, or None: what a persistent
    rank (:mod:`autograder.pool`) needs to watch a case as a rank forked inside :func:`guard`
    would."""
    return None if _gate is None else (_gate.task_id, _gate.log)


def forget_inherited() -> None:
    """In a persistent rank just forked (perhaps inside a case's :func:`guard`): drop the gate
    state it inherited, so that only :func:`in_rank` watches its calls. Torch function and
    dispatch modes entered in the parent (the builtin net, a meter) are popped too: a rank forked
    between cases has none."""
    global _gate
    from torch.overrides import _get_current_function_mode_stack
    from torch.overrides import _pop_mode as pop_function_mode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from torch.utils._python_dispatch import _pop_mode as pop_dispatch_mode

    from kit import recorder

    _gate = None
    while _observe in recorder.observers:
        recorder.observers.remove(_observe)
    while _ImportNet in sys.meta_path:
        sys.meta_path.remove(_ImportNet)
    while _get_current_function_mode_stack():
        pop_function_mode()
    while _get_current_dispatch_mode_stack():
        pop_dispatch_mode()


@contextmanager
def in_rank(gate: tuple[str, str] | None) -> Iterator[None]:
    """In a pooled rank, for one call: the case's gate, installed as :func:`guard` installs it
    (trampolines, the recorder's observer, the import net, the builtin net), logging to the
    case's file, which the parent's :func:`guard` reads. The rank raises what it finds where the
    student called it; the verdict is the parent's. Everything comes off at the end, so the next
    case's call starts with no gate but its own."""
    global _gate
    if gate is None:
        yield
        return
    from autograder.registry import get_task
    from kit import recorder

    task = get_task(gate[0])
    spec = _spec(tuple(task.forbidden))
    _gate = _Gate(task, gate[1], spec)
    _watch(spec)
    recorder.observers.insert(0, _observe)
    sys.meta_path.insert(0, _ImportNet)
    mode = _builtin_net(_gate) if spec.builtins or spec.op_names else None
    try:
        if mode is not None:
            with mode:
                yield
        else:
            yield
    finally:
        if _observe in recorder.observers:
            recorder.observers.remove(_observe)
        if _ImportNet in sys.meta_path:
            sys.meta_path.remove(_ImportNet)
        _gate = None


@contextmanager
def guard(task: Any, impl: Any = None) -> Iterator[None]:
    """Run a case of ``task`` on ``impl`` under the gates; raise :class:`ForbiddenUse` on a use.

    Checks the source first, then watches calls in this process and in the ranks it forks.
    """
    global _gate
    if not task.forbidden and impl is None:
        yield
        return
    found = check_source(task, impl)
    if found is not None:
        raise found
    from kit import recorder

    fd, log = tempfile.mkstemp(prefix="kit-gate-")
    os.close(fd)
    outer = _gate
    spec = _spec(tuple(task.forbidden))
    _gate = _Gate(task, log, spec)
    _watch(spec)
    recorder.observers.insert(0, _observe)
    sys.meta_path.insert(0, _ImportNet)
    mode = _builtin_net(_gate) if spec.builtins or spec.op_names else None
    error: BaseException | None = None
    try:
        if mode is not None:
            mode.__enter__()
        try:
            yield
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)
    except BaseException as e:  # noqa: BLE001 - re-raised below unless a gate explains it
        error = e
    finally:
        if _observe in recorder.observers:
            recorder.observers.remove(_observe)
        if _ImportNet in sys.meta_path:
            sys.meta_path.remove(_ImportNet)
        if not _keeping:
            _restore()
        _gate = outer
        if outer is not None:
            _watch(outer.spec)
        try:
            text = Path(log).read_text()
        except OSError:
            text = ""
        os.unlink(log)
    if text.strip():
        what, _, where = text.splitlines()[0].partition("\t")
        raise ForbiddenUse(task.id, what, where) from error
    if error is not None:
        raise error
