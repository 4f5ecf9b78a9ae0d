"""The registry of graded tasks: each task's checks live here once, used by every runner.

A *task* (id ``"L.N"``) is the student's function or class with a fixed name. Its checks are
*cases*. A case is split in two halves so that the batch grader never trusts student code:

* ``run(impl, seed) -> data`` exercises an implementation and returns **plain data**
  (tensors, numbers, strings, lists/tuples/dicts of them). It is the only half that touches
  student code, so the batch grader runs it in a sandboxed process.
* ``compare(got, expected)`` runs in the trusted process and raises :class:`CheckFailed`
  (with expected vs got and a hint) when the data is wrong. ``expected`` is ``run`` applied
  to the task's trusted ``reference`` (torch's own implementation where one exists) with the
  same seed, or ``None`` when the task has no reference (property checks). A case may instead
  compute it itself with a trusted ``expect(seed)`` (see :meth:`Task.expected`).

Lessons use it like this (``autograder/lesson00.py``)::

    T = task("0.1", "shard_range", points=2, reference=_reference_shard_range,
             hint="Balanced and contiguous: shard sizes differ by at most one.",
             recipe="Each rank gets n // world_size items; the first n % world_size get one more.")

    @T.case("12 items on 4 ranks")
    def _(shard_range, seed):
        return [list(shard_range(12, r, 4)) for r in range(4)]

Points are split evenly over a task's cases (nbgrader partial credit); a case may carry a
``weight`` to count more.

Hints come in two levels. ``hint`` names the *concept* a failing case tests (what property is
broken, why it matters); ``recipe`` says how to get there, step by step, in words. Neither
contains solution code. A task's ``hint``/``recipe`` apply to every case that gives none of its
own, and a :class:`CheckFailed` may carry a more precise pair. ``check()`` in a notebook shows
the concept on the first failure and the recipe from the second failure of the same task on (or
at once with ``check(..., hint="recipe")``); the batch grader's feedback shows both.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "Case",
    "CheckFailed",
    "Task",
    "TASKS",
    "assert_same",
    "get_task",
    "lesson_tasks",
    "plain",
    "task",
]


class CheckFailed(AssertionError):
    """A case found wrong data. Carries what a student needs to fix it."""

    def __init__(self, message: str, *, expected: Any = None, got: Any = None, hint: str = "",
                 recipe: str = ""):
        super().__init__(message)
        self.message = message
        self.expected = expected
        self.got = got
        self.hint = hint  # the concept this failure breaks (shown first)
        self.recipe = recipe  # how to fix it, in words (shown after repeated failures)


def _describe(x: Any, limit: int = 200) -> str:
    if isinstance(x, torch.Tensor):
        body = repr(x.detach().cpu()) if x.numel() <= 16 else f"tensor of shape {tuple(x.shape)}"
        return f"{body} (dtype={x.dtype})" if x.numel() <= 16 else f"{body}, dtype={x.dtype}"
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def plain(x: Any) -> Any:
    """What an implementation returned, as plain data the trusted side can compare: a tensor is
    detached and copied, a scalar kept, anything else replaced by a description of its type."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().clone()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return f"<a {type(x).__name__} object>"


def assert_same(got: Any, expected: Any, *, rtol: float = 1e-5, atol: float = 1e-6, path: str = "") -> None:
    """Default comparison: same structure, same types, tensors equal up to tolerance.

    Only plain data is accepted on either side (the batch grader guarantees it for ``got``),
    so an object with a rigged ``__eq__`` never reaches this function.
    """
    where = path or "result"
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise CheckFailed(f"{where}: expected a tensor, got {type(got).__name__}",
                              expected=_describe(expected), got=_describe(got))
        if got.shape != expected.shape:
            raise CheckFailed(f"{where}: wrong shape {tuple(got.shape)}, expected {tuple(expected.shape)}",
                              expected=tuple(expected.shape), got=tuple(got.shape))
        if got.dtype != expected.dtype:
            raise CheckFailed(f"{where}: wrong dtype {got.dtype}, expected {expected.dtype}",
                              expected=expected.dtype, got=got.dtype)
        if expected.is_floating_point() or expected.is_complex():
            ok = torch.allclose(got, expected, rtol=rtol, atol=atol, equal_nan=True)
        else:
            ok = torch.equal(got, expected)
        if not ok:
            diff = (got.double() - expected.double()).abs()
            raise CheckFailed(f"{where}: values differ (max abs difference {diff.max().item():.3g})",
                              expected=_describe(expected), got=_describe(got))
        return
    if isinstance(expected, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        if not math.isclose(got, expected, rel_tol=rtol, abs_tol=atol) and not (
            math.isnan(got) and math.isnan(expected)
        ):
            raise CheckFailed(f"{where}: expected {expected!r}, got {got!r}", expected=expected, got=got)
        return
    if type(got) is not type(expected):
        raise CheckFailed(f"{where}: expected a {type(expected).__name__}, got {type(got).__name__}",
                          expected=_describe(expected), got=_describe(got))
    if isinstance(expected, (list, tuple)):
        if len(got) != len(expected):
            raise CheckFailed(f"{where}: expected {len(expected)} items, got {len(got)}",
                              expected=_describe(expected), got=_describe(got))
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, rtol=rtol, atol=atol, path=f"{where}[{i}]")
        return
    if isinstance(expected, dict):
        if set(got) != set(expected):
            raise CheckFailed(f"{where}: expected keys {sorted(map(str, expected))}, got {sorted(map(str, got))}",
                              expected=sorted(map(str, expected)), got=sorted(map(str, got)))
        for k in expected:
            assert_same(got[k], expected[k], rtol=rtol, atol=atol, path=f"{where}[{k!r}]")
        return
    if got != expected:
        raise CheckFailed(f"{where}: expected {_describe(expected)}, got {_describe(got)}",
                          expected=_describe(expected), got=_describe(got))


@dataclass
class Case:
    """One checked behaviour of a task (see the module docstring)."""

    name: str
    run: Callable[[Any, int], Any]
    compare: Callable[[Any, Any], None] = assert_same
    weight: float = 1.0
    hint: str = ""  # the concept the case tests, shown on the first failure
    needs: str | None = None  # e.g. "cuda": the batch grader marks the case "blocked" without it
    # Trusted ``expect(seed) -> data`` computing the expected data directly (e.g. the mean of the
    # concatenation in one process) instead of running ``reference`` through ``run``.
    expect: Callable[[int], Any] | None = None
    recipe: str = ""  # the steps, in words, shown after repeated failures or on request


@dataclass
class Task:
    """A graded exercise: a function or class with a fixed name, and its cases."""

    id: str
    name: str
    points: float
    reference: Any = None
    hint: str = ""  # the concept, for cases that give none of their own
    cases: list[Case] = field(default_factory=list)
    # Dotted names of what the task re-implements ("torch.distributed.all_reduce",
    # "torch.nn.parallel.DistributedDataParallel"): code of the task that uses one scores 0.
    forbidden: tuple[str, ...] = ()
    recipe: str = ""  # the recipe, for cases that give none of their own

    @property
    def lesson(self) -> int:
        return int(self.id.split(".")[0])

    def case(self, name: str, *, compare: Callable[[Any, Any], None] = assert_same,
             weight: float = 1.0, hint: str = "", needs: str | None = None,
             expect: Callable[[int], Any] | None = None, recipe: str = ""):
        """Decorator registering ``run(impl, seed) -> data`` as a case of this task.

        ``hint`` (the concept) and ``recipe`` (the steps) default to the task's.
        """

        def register(run: Callable[[Any, int], Any]) -> Callable[[Any, int], Any]:
            if any(c.name == name for c in self.cases):
                raise ValueError(f"task {self.id}: two cases named {name!r}")
            self.cases.append(Case(name, run, compare, weight, hint or self.hint, needs, expect,
                                   recipe or self.recipe))
            return run

        return register

    def expected(self, case: Case, seed: int) -> Any:
        """The trusted data ``case`` must produce: ``case.expect(seed)``, else ``run`` on the
        reference, else ``None`` (a property check)."""
        if case.expect is not None:
            return case.expect(seed)
        if self.reference is not None:
            return case.run(self.reference, seed)
        return None

    def case_points(self, case: Case) -> float:
        total = sum(c.weight for c in self.cases)
        return self.points * case.weight / total if total else 0.0


TASKS: dict[str, Task] = {}


def task(id: str, name: str, *, points: float, reference: Any = None, hint: str = "",
         forbidden: tuple[str, ...] = (), recipe: str = "") -> Task:
    """Register a task. ``id`` is ``"L.N"``; ``name`` is the student's function/class name;
    ``forbidden`` names what the task re-implements (its use scores the task 0); ``hint`` is
    the concept shown on a first failure, ``recipe`` the steps shown after repeated failures."""
    lesson, _, number = id.partition(".")
    if not (lesson.isdigit() and number.isdigit()):
        raise ValueError(f"task id must look like '4.2', got {id!r}")
    if id in TASKS:
        raise ValueError(f"task {id} is registered twice")
    TASKS[id] = Task(id, name, float(points), reference, hint, forbidden=tuple(forbidden),
                     recipe=recipe)
    return TASKS[id]


def _import_lesson(lesson: int) -> None:
    try:
        importlib.import_module(f"autograder.lesson{lesson:02d}")
    except ModuleNotFoundError as e:
        if e.name != f"autograder.lesson{lesson:02d}":
            raise


def get_task(task_id: str) -> Task:
    """The registered task ``task_id``, importing its lesson's checks on first use."""
    if task_id not in TASKS:
        lesson = task_id.split(".")[0]
        if lesson.isdigit():
            _import_lesson(int(lesson))
    if task_id not in TASKS:
        known = ", ".join(sorted(TASKS)) or "none"
        raise KeyError(f"no task {task_id!r} (known tasks: {known}); task ids look like '0.2'")
    return TASKS[task_id]


def lesson_tasks(lesson: int) -> list[Task]:
    """All tasks of a lesson, in id order."""
    _import_lesson(lesson)
    found = [t for t in TASKS.values() if t.lesson == lesson]
    return sorted(found, key=lambda t: int(t.id.split(".")[1]))


def pickle_for_worker(impl: Any) -> bytes:
    """``impl`` as bytes a separate Python process (a ``torchrun`` worker) can load.

    Functions of a notebook-loaded or test module travel by value, since the worker cannot
    import that module by name; those of ``autograder``, ``kit`` and ``torch`` by reference.
    """
    import cloudpickle

    module = sys.modules.get(getattr(impl, "__module__", "") or "")
    by_value = module is not None and module.__name__ != "__main__" and not module.__name__.startswith(
        ("autograder", "kit", "torch"))
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(impl)
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)
