"""Hard gates: a task whose code uses what it re-implements, or the grader's own code, scores 0.

A task names what it re-implements in ``Task.forbidden`` (dotted names such as
``"torch.distributed.all_reduce"`` or ``"torch.nn.parallel.DistributedDataParallel"``). Every
runner wraps a case's ``run`` in :func:`guard`; a use raises :class:`ForbiddenUse`, which
:func:`autograder.results.raised` turns into the status ``forbidden`` and
:func:`autograder.results.settle` into 0 points for the whole task. The message names what was
used and where (``file:line``).

Four nets, because code reaches a library by many routes:

* the source (:func:`check_source`): the task's function or class and the module-level helpers
  it calls, read as an AST with the module's imports resolved (``from torch.distributed import
  all_reduce``, ``dist.all_reduce``, ``getattr(dist, "all_reduce")``, ``import autograder``);
* the class (a task class that subclasses a forbidden class, ``class S(DistributedSampler)``);
* calls at run time: each forbidden Python function (and ``__init__`` of a forbidden class) and
  every function of ``autograder`` gets a trampoline in place (same function object, so names
  imported earlier are caught) that refuses a call made by the student's code;
* the recorder (:mod:`kit.recorder`): a collective the task forbids, whatever the route
  (``ProcessGroup`` methods, functional collectives), and an all-reduce issued by torch's C++
  DDP reducer when the task forbids ``DistributedDataParallel``.

The run-time nets are set in the process that runs the case and inherited by the ranks it
forks. A use found anywhere (a rank, a DataLoader worker, a caught exception) is appended to a
file the guard reads when the case ends, so swallowing the exception does not hide it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import sys
import sysconfig
import tempfile
import textwrap
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["ForbiddenUse", "check_source", "guard"]

_HERE = Path(__file__).resolve().parent  # autograder/
_KIT = _HERE.parent / "kit"
_GRADER = (str(_HERE) + os.sep, str(_KIT) + os.sep)
_LIBRARIES = tuple({str(Path(p).resolve()) + os.sep for key in ("stdlib", "platstdlib", "purelib",
                                                                 "platlib")
                    if (p := sysconfig.get_paths().get(key))})
_TORCH = str(Path(importlib.import_module("torch").__file__).resolve().parent) + os.sep
_GRADER_NAME = "the grader's own code (autograder)"

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


def _where(frame: Any) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _student_caller(frame: Any) -> Any | None:
    """The student's frame that (through library code) made this call, or None if the grader
    did. A stack with neither (a thread the student started) counts as the student's."""
    f, last = frame, frame
    while f is not None:
        kind = _kind(f.f_code.co_filename)
        if kind == "student":
            return f
        if kind == "grader":
            return None
        last, f = f, f.f_back
    return last


# --------------------------------------------------------------------------- state of a guard


class _Gate:
    def __init__(self, task: Any, log: str) -> None:
        self.task_id = task.id
        self.log = log
        self.forbidden = tuple(task.forbidden)
        self.ops = {name.rsplit(".", 1)[1] for name in self.forbidden if name.startswith(_DIST_PREFIXES)}
        self.no_ddp = any(name.endswith("DistributedDataParallel") for name in self.forbidden)

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


# --------------------------------------------------------------------------- trampolines

# id -> (function, the original's copy, the dotted name, the original code)
_swapped: dict[int, tuple[Any, Any, str, Any]] = {}


def _trampoline(fn: types.FunctionType, key: int) -> types.CodeType:
    """Code for ``fn`` that calls ``_on_call(key, args, kwargs)``, with ``fn``'s free variables
    (so it can replace ``fn.__code__`` in place)."""
    free = fn.__code__.co_freevars
    body = "".join(f"    {v} = None\n" for v in free)
    uses = f"        ({', '.join(free)},)\n" if free else ""
    source = (f"def _outer():\n{body}    def _t(*__a, **__k):\n{uses}"
              f"        return __kit_gate_call__({key}, __a, __k)\n    return _t\n")
    scope: dict[str, Any] = {}
    exec(compile(source, fn.__code__.co_filename, "exec"), scope)  # noqa: S102 - our own code
    code = scope["_outer"]().__code__
    return code.replace(co_name=fn.__code__.co_name, co_qualname=fn.__code__.co_qualname,
                        co_firstlineno=fn.__code__.co_firstlineno)


def _swap(fn: Any, what: str) -> None:
    while isinstance(fn, types.FunctionType):
        if id(fn) not in _swapped:
            copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                                      fn.__closure__)
            copy.__kwdefaults__ = fn.__kwdefaults__
            fn.__globals__.setdefault("__kit_gate_call__", _on_call)
            _swapped[id(fn)] = (fn, copy, what, fn.__code__)
            try:
                fn.__code__ = _trampoline(fn, id(fn))
            except (ValueError, TypeError, SyntaxError):
                del _swapped[id(fn)]
        fn = getattr(fn, "__wrapped__", None)


def _restore() -> None:
    for fn, _, _, code in _swapped.values():
        fn.__code__ = code
    _swapped.clear()


def resolve(dotted: str) -> Any:
    """The object a dotted name stands for, or None (nothing is imported that is not already)."""
    parts = dotted.split(".")
    if parts[0] not in sys.modules:  # the student's code cannot use a library nobody imported
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


def _forbidden_objects(names: tuple[str, ...]) -> dict[int, str]:
    found = {}
    for name in names:
        obj = resolve(name)
        if obj is not None:
            found[id(obj)] = name
    return found


def _watch(names: tuple[str, ...]) -> None:
    for name in names:
        obj = resolve(name)
        if isinstance(obj, type):
            for attr in ("__init__", "__iter__", "forward", "__call__"):
                member = obj.__dict__.get(attr)
                if isinstance(member, types.FunctionType):
                    _swap(member, name)
        elif obj is not None:
            _swap(obj, name)
    for module_name, module in list(sys.modules.items()):
        if module_name == "autograder" or module_name.startswith("autograder."):
            if module_name in ("autograder.gates", "autograder.registry", "autograder.results",
                               "autograder.checking", "autograder.loading"):
                continue  # the runners themselves: the student's code never gets to call them
            for value in list(vars(module).values()):
                if isinstance(value, types.FunctionType) and value.__module__ == module_name:
                    _swap(value, f"{_GRADER_NAME}: {module_name}.{value.__name__}")


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


def _module_tree(impl: Any) -> tuple[ast.Module | None, dict[str, Any]]:
    module = sys.modules.get(getattr(impl, "__module__", "") or "")
    if module is None:
        return None, {}
    try:
        return ast.parse(inspect.getsource(module)), vars(module)
    except (OSError, TypeError, SyntaxError):
        return None, vars(module)


def check_source(task: Any, impl: Any) -> ForbiddenUse | None:
    """The first forbidden name (or grader import) the task's source uses, else None.

    Reads ``impl``'s source and the source of the module-level functions and classes of its
    module that it names (helpers), resolving names through the module's imports.
    """
    if impl is None:
        return None
    forbidden = _forbidden_objects(tuple(task.forbidden))
    tree, namespace = _module_tree(impl)
    aliases = _aliases(tree) if tree is not None else {}
    todo, seen = [impl], set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        found = _source_of(obj)
        if found is None:
            continue
        text, start, path = found
        try:
            body = ast.parse(text)
        except SyntaxError:
            continue
        local = {**aliases, **_aliases(body)}
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
                obj_ = resolve(full)
                if obj_ is not None and id(obj_) in forbidden:
                    return ForbiddenUse(task.id, forbidden[id(obj_)], where)
                if obj_ is not None and getattr(obj_, "__module__", "").startswith("autograder"):
                    return ForbiddenUse(task.id, f"{_GRADER_NAME}: {full}", where)
            elif isinstance(node, ast.Name) and head in namespace and head not in local:
                helper = namespace[head]  # a module-level helper of the student's: read it too
                if isinstance(helper, (types.FunctionType, type)) and \
                        getattr(helper, "__module__", None) == getattr(impl, "__module__", None):
                    todo.append(helper)
                elif id(helper) in forbidden:
                    return ForbiddenUse(task.id, forbidden[id(helper)], where)
    if isinstance(impl, type):
        for base in impl.__mro__[1:]:
            if id(base) in forbidden:
                line = _source_of(impl)
                where = f"{line[2]}:{line[1]}" if line else impl.__qualname__
                return ForbiddenUse(task.id, f"{forbidden[id(base)]} (as a base class of "
                                    f"{impl.__name__})", where)
    return None


# --------------------------------------------------------------------------- the guard


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
    _gate = _Gate(task, log)
    _watch(tuple(task.forbidden))
    recorder.observers.insert(0, _observe)
    error: BaseException | None = None
    try:
        yield
    except BaseException as e:  # noqa: BLE001 - re-raised below unless a gate explains it
        error = e
    finally:
        if _observe in recorder.observers:
            recorder.observers.remove(_observe)
        _restore()
        _gate = outer
        if outer is not None:
            _watch(outer.forbidden)
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
