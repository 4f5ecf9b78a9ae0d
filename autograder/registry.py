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
  compute it itself with a trusted ``expect(seed)`` (see :meth:`Task.expected`). References
  and ``expect`` code live in ``autograder/references/lessonNN.py``, named here by string:
  the batch grader's sandboxed worker never sees that folder.

A run several cases judge is a :class:`SharedRun` (``@T.shared``, or ``@T.shared(world_size=4)``
for a function each rank runs): once per implementation and seed, its exception kept too. A
technique's saving is a :meth:`Task.bound`, a case that holds a measured resource (``kit.meter``,
the recorder) to the formula the technique promises. Lessons use it like this
(``autograder/lesson00.py``)::

    T = task("0.1", reference="shard_range",  # name and points: autograder/course.py
             hint="Balanced and contiguous: shard sizes differ by at most one.",
             recipe="Each rank gets n // world_size items; the first n % world_size get one more.")

    @T.case("12 items on 4 ranks")
    def _(shard_range, seed):
        return [list(shard_range(12, r, 4)) for r in range(4)]

Points are split evenly over a task's cases (nbgrader partial credit); a case may carry a
``weight`` to count more. A case that measures the saving its technique exists for is marked
``saving=True`` (every bound is one): in a task whose point is a saving, those cases together
weigh at least half of its points, so right values with the saving thrown away keep at most half.

Hints come in two levels. ``hint`` names the *concept* a failing case tests (what property is
broken, why it matters); ``recipe`` says how to get there, step by step, in words. Neither
contains solution code. A task's ``hint``/``recipe`` apply to every case that gives none of its
own, and a :class:`CheckFailed` may carry a more precise pair. ``check()`` in a notebook shows
the concept on the first failure and the recipe from the second failure of the same task on (or
at once with ``check(..., hint="recipe")``); the batch grader's feedback shows both.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from autograder.compare import CheckFailed, assert_same, within_bound

__all__ = [
    "Bound",
    "Case",
    "CheckFailed",
    "SharedRun",
    "Task",
    "TASKS",
    "assert_same",
    "checked_lessons",
    "fresh_runs",
    "get_task",
    "lesson_tasks",
    "plain",
    "shared",
    "task",
]


def plain(x: Any) -> Any:
    """What an implementation returned, as plain data the trusted side can compare: a tensor is
    detached and copied, a scalar kept, anything else replaced by a description of its type."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().clone()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return f"<a {type(x).__name__} object>"


class SharedRun:
    """One run of an implementation that several cases judge.

    ``fn(impl, seed)`` runs once per (implementation, seed): in this process, or with
    ``world_size`` on that many ranks (``fn`` is then what each rank runs, and the run's value
    is the list of the ranks' return values). The value *or the exception* is kept, so every
    case reading a run that raised (a stub, a crash, a deadlock) reports the same failure
    without running it again. The implementation itself is kept with its result, so its ``id``
    cannot be reused by another object while the entry lives.

    :func:`fresh_runs` forgets every run: ``run_checks`` calls it first, so a notebook that
    redefines a helper the implementation calls is checked afresh.
    """

    def __init__(self, fn: Callable[[Any, int], Any], *, world_size: int | None = None,
                 timeout: float = 90.0, preload: Sequence[str] = (), keep: int = 4) -> None:
        self.fn, self.world_size, self.timeout = fn, world_size, timeout
        self.preload, self.keep = tuple(preload), keep
        self.__name__ = getattr(fn, "__name__", "run")
        self.__doc__ = fn.__doc__
        self._runs: OrderedDict[tuple[int, int], tuple[Any, bool, Any]] = OrderedDict()
        self._lock = threading.Lock()
        _SHARED_RUNS.append(self)

    def __call__(self, impl: Any, seed: int) -> Any:
        key = (id(impl), seed)
        with self._lock:
            entry = self._runs.get(key)
        if entry is None or entry[0] is not impl:
            try:
                entry = (impl, True, self._run(impl, seed))
            except Exception as e:  # noqa: BLE001 - kept and re-raised for every case reading it
                entry = (impl, False, e)
            with self._lock:
                self._runs[key] = entry
                while len(self._runs) > self.keep:
                    self._runs.popitem(last=False)
        _, ok, value = entry
        if not ok:
            raise value
        return value

    def _run(self, impl: Any, seed: int) -> Any:
        if self.world_size is None:
            return self.fn(impl, seed)
        from autograder import pool
        from kit.launcher import default_start_method, run_ranks

        # spawned ranks re-import torch and the lesson: give them the time that takes
        timeout = self.timeout * (1 if default_start_method("gloo") == "fork" else 4)
        ranks = pool.active()
        if ranks is not None:  # the batch grader's rank pool: ranks forked once for the task
            return ranks.run(self.world_size, self.fn, (impl, seed), timeout)
        return list(run_ranks(self.fn, (impl, seed), world_size=self.world_size, timeout=timeout,
                              echo=False, preload=self.preload))

    def forget(self) -> None:
        with self._lock:
            self._runs.clear()


_SHARED_RUNS: list[SharedRun] = []


def shared(fn: Callable[[Any, int], Any] | None = None, *, world_size: int | None = None,
           timeout: float = 90.0, preload: Sequence[str] = ()) -> Any:
    """Decorator: ``fn(impl, seed)`` as a :class:`SharedRun` that cases call instead of running
    the implementation themselves (``@shared`` or ``@shared(world_size=3, preload=(...))``)."""
    if fn is not None:
        return SharedRun(fn, world_size=world_size, timeout=timeout, preload=preload)
    return lambda f: SharedRun(f, world_size=world_size, timeout=timeout, preload=preload)


def fresh_runs() -> None:
    """Forget every shared run (the trusted expectations, which never change, are kept)."""
    for run in _SHARED_RUNS:
        run.forget()


class _Picked:
    """A case's run that reads part of a shared run: ``run(impl, seed)``, then ``pick``."""

    def __init__(self, run: SharedRun, pick: str | Callable[[Any], Any] | None) -> None:
        self.run, self.pick = run, pick
        self.__name__ = f"{run.__name__}[{pick!r}]" if isinstance(pick, str) else run.__name__

    def __call__(self, impl: Any, seed: int) -> Any:
        data = self.run(impl, seed)
        if self.pick is None:
            return data
        if callable(self.pick):
            return self.pick(data)
        if isinstance(data, list):  # one result per rank: the key of each
            return [d.get(self.pick) if isinstance(d, dict) else d for d in data]
        return data.get(self.pick) if isinstance(data, dict) else data


@dataclass
class Bound:
    """A resource a task's technique bounds, stated as a formula (see :meth:`Task.bound`)."""

    what: str  # "optimizer state per rank"
    formula: str  # "total / W + the largest parameter"
    lost: str  # what exceeding it means: "every rank keeps optimizer state for every parameter"
    unit: str = "bytes"


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
    # A name (a str) stands for that function in autograder.references.lessonNN (trusted only).
    expect: Callable[[int], Any] | str | None = None
    recipe: str = ""  # the steps, in words, shown after repeated failures or on request
    # What a hang of this case's ranks means, in the regime it tests ("a rank whose experts got
    # no token skipped the backward all-to-all"): it leads the feedback, before the launcher's
    # reading of who waited in which collective and who had returned.
    hang: str = ""
    # The case measures the saving its task's technique exists for (memory, bytes, FLOPs or
    # messages per rank, seen by kit.meter or the recorder): in a task whose point is a saving,
    # such cases weigh at least half of its points (tests/test_saving_weight.py). Every bound is
    # one.
    saving: bool = False


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
    # Other names the task's code defines and its checks use (6.1's ``load_shards`` beside
    # ``save_shards``): the loader keeps them, and a case reaches them with :meth:`companion`.
    companions: tuple[str, ...] = ()
    # Modules the task's launches need, imported once before ranks fork (kit.launch's preload).
    preload: tuple[str, ...] = ()
    bounds: list[Bound] = field(default_factory=list)  # the resources its technique bounds
    _expected: dict[tuple[Any, ...], tuple[bool, Any]] = field(default_factory=dict, repr=False)

    @property
    def lesson(self) -> int:
        return int(self.id.split(".")[0])

    def shared(self, fn: Callable[[Any, int], Any] | None = None, *, world_size: int | None = None,
               timeout: float = 90.0) -> Any:
        """:func:`shared` with this task's ``preload``: a run several of its cases judge."""
        if fn is not None:
            return SharedRun(fn, world_size=world_size, timeout=timeout, preload=self.preload)
        return lambda f: SharedRun(f, world_size=world_size, timeout=timeout, preload=self.preload)

    def companion(self, impl: Any, name: str) -> Any:
        """The task's companion ``name`` defined beside ``impl`` (its module's global), or None."""
        if name not in self.companions:
            raise KeyError(f"task {self.id} declares no companion {name!r} (companions=...)")
        for owner in (impl, getattr(impl, "__init__", None)):
            namespace = getattr(owner, "__globals__", None)
            if isinstance(namespace, dict) and name in namespace:
                return namespace[name]
        module = sys.modules.get(getattr(impl, "__module__", "") or "")
        return getattr(module, name, None)

    def bound(self, what: str, *, formula: str, lost: str, unit: str = "bytes", weight: float = 1.0,
              hint: str = "", recipe: str = "", expect: Callable[[int], Any] | str | None = None,
              uses: SharedRun | None = None, pick: str | Callable[[Any], Any] | None = None,
              cause: str = "", saving: bool = True):
        """Decorator registering a case that holds a resource to the bound the technique promises.

        The case's ``run(impl, seed)`` returns ``{"measured": [one number per rank], ...}`` (from
        :mod:`kit.meter` or the recorder, never from the implementation's attributes);
        ``expect(seed)`` (trusted) returns ``{"bound": number}``, or the bound is the reference's
        own ``measured`` maximum when ``expect`` is None. The case fails when any rank's number
        exceeds it, naming ``what``, the ratio, ``formula`` and what was ``lost``; ``cause`` is
        the key of the mistake an excess shows, so that it follows an earlier case naming it.
        A bound is a ``saving`` case unless it says otherwise (a bound that guards against a
        cheat, not a resource the technique saves: ``saving=False``).
        """
        spec = Bound(what, formula, lost, unit)
        self.bounds.append(spec)

        def compare(got: Any, expected: Any) -> None:
            if not isinstance(got, dict) or "measured" not in got:
                raise CheckFailed(f"{what}: the run returned no measurement",
                                  got=repr(got)[:200], hint=hint or self.hint,
                                  recipe=recipe or self.recipe)
            if isinstance(expected, dict) and "bound" in expected:
                limit = expected["bound"]  # one number, or one per rank
            else:
                limit = max(expected["measured"])
            within_bound(got["measured"], limit, what=what, formula=formula, lost=lost, unit=unit,
                         hint=hint or self.hint, recipe=recipe or self.recipe, cause=cause)

        return self.case(f"{what} is within {formula}", compare=compare, weight=weight, hint=hint,
                         expect=expect, recipe=recipe, uses=uses, pick=pick, saving=saving)

    def case(self, name: str, *, compare: Callable[[Any, Any], None] = assert_same,
             weight: float = 1.0, hint: str = "", needs: str | None = None,
             expect: Callable[[int], Any] | str | None = None, recipe: str = "",
             uses: SharedRun | None = None, pick: str | Callable[[Any], Any] | None = None,
             hang: str = "", saving: bool = False):
        """Decorator registering ``run(impl, seed) -> data`` as a case of this task.

        ``hint`` (the concept) and ``recipe`` (the steps) default to the task's; ``hang`` says
        what a hang of the case's ranks means in the regime it tests (see :class:`Case`);
        ``saving=True`` marks a case that measures the saving the technique exists for (see
        :class:`Case`; every :meth:`bound` is one). A case that
        judges a shared run needs no body: ``T.case("name", uses=run, pick="losses")`` registers
        ``run(impl, seed)`` (its ``pick`` key, or ``pick(data)``) and returns None.
        """

        def register(run: Callable[[Any, int], Any]) -> Callable[[Any, int], Any]:
            if any(c.name == name for c in self.cases):
                raise ValueError(f"task {self.id}: two cases named {name!r}")
            self.cases.append(Case(name, run, compare, weight, hint or self.hint, needs, expect,
                                   recipe or self.recipe, hang, saving))
            return run

        if uses is None:
            if pick is not None:
                raise TypeError(f"task {self.id}, case {name!r}: pick= needs uses=")
            return register
        register(_Picked(uses, pick))
        return None

    def expected(self, case: Case, seed: int) -> Any:
        """The trusted data ``case`` must produce: ``case.expect(seed)``, else ``run`` on the
        reference, else ``None`` (a property check).

        Computed once per (case, seed) in this process, and kept: trusted code is seeded, so
        its answer never changes (an expectation that raised raises the same again)."""
        key = (case.name, seed, id(case.expect), id(self.reference))
        if key not in self._expected:
            try:
                if case.expect is not None:
                    value = self.trusted(case.expect)(seed)
                elif self.reference is not None:
                    value = case.run(self.trusted(self.reference), seed)
                else:
                    value = None
                self._expected[key] = (True, value)
            except Exception as e:  # noqa: BLE001 - re-raised for every case asking
                self._expected[key] = (False, e)
        ok, value = self._expected[key]
        if not ok:
            raise value
        return value

    def trusted(self, what: Any) -> Any:
        """``what`` itself, or, for a name, that name in ``autograder.references.lessonNN``.

        References and trusted ``expect`` code live in ``autograder/references/``, which only
        the trusted side imports: the batch grader's sandboxed worker does not see that folder,
        so a submission can neither call, subclass nor copy them there.
        """
        if not isinstance(what, str):
            return what
        name = f"autograder.references.lesson{self.lesson:02d}"
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            raise AttributeError(f"task {self.id} names {what!r} in {name}, which does not exist "
                                 "here (the batch worker never sees autograder/references/)"
                                 ) from None
        try:
            return getattr(module, what)
        except AttributeError:
            raise AttributeError(f"task {self.id}: {module.__name__} has no {what!r}") from None

    def case_points(self, case: Case) -> float:
        total = sum(c.weight for c in self.cases)
        return self.points * case.weight / total if total else 0.0

    @property
    def saving_cases(self) -> list[Case]:
        """The cases that measure the saving the task's technique exists for (``saving=True``)."""
        return [c for c in self.cases if c.saving]

    def saving_points(self) -> float:
        """What the saving cases are worth together: at least half the points in a saving task."""
        return sum(self.case_points(c) for c in self.saving_cases)


TASKS: dict[str, Task] = {}


def task(id: str, name: str | None = None, *, points: float | None = None, reference: Any = None,
         hint: str = "", forbidden: tuple[str, ...] = (), recipe: str = "",
         companions: tuple[str, ...] | None = None, preload: tuple[str, ...] = ()) -> Task:
    """Register a task. ``id`` is ``"L.N"``; its entry name, points and companions (the other
    names its code defines, ``load_shards`` beside ``save_shards``) are the course spec's
    (:mod:`autograder.course`), stated there once: a lesson's checks pass only ``id``.
    ``forbidden`` names what the task re-implements (its use scores the task 0); ``hint`` is
    the concept shown on a first failure, ``recipe`` the steps shown after repeated failures;
    ``preload`` the modules its launches import before ranks fork.

    A task the spec does not list (a unit test's scratch task) must give ``name`` and ``points``
    itself; a spec task that repeats them is refused, so the two can never disagree."""
    from autograder import course

    lesson, _, number = id.partition(".")
    if not (lesson.isdigit() and number.isdigit()):
        raise ValueError(f"task id must look like '4.2', got {id!r}")
    if id in TASKS:
        raise ValueError(f"task {id} is registered twice")
    try:
        spec = course.task_spec(id)
    except KeyError:
        if name is None or points is None:
            raise
        spec = course.TaskSpec(id, name, float(points), tuple(companions or ()))
    else:
        if name is not None or points is not None or companions is not None:
            raise ValueError(f"task {id}: its name, points and companions are stated in "
                             "autograder/course.py; pass only the id here")
    TASKS[id] = Task(id, spec.name, spec.points, reference, hint, forbidden=tuple(forbidden),
                     recipe=recipe, companions=spec.companions, preload=tuple(preload))
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


def checked_lessons() -> list[int]:
    """Every lesson of the course spec (:data:`autograder.course.LESSONS`), in order."""
    from autograder import course

    return [spec.number for spec in course.LESSONS]


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
    by_value = (module is not None and module.__name__ != "__main__"
                and not module.__name__.startswith(("autograder", "kit", "torch")))
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(impl)
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)
