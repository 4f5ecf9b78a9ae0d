"""What every test of a lesson needs, loaded once per session.

* :func:`solutions` (lesson) -> the graded code of ``solutions/NN_slug.py``;
* :func:`stubs` (lesson) -> the graded code of the released ``lessons/NN_slug.ipynb``;
* :func:`seeded_bugs` (lesson) -> ``tests/bugs/lessonNN.py``'s ``BUGS``:
  ``{task id: [(what, impl)]}``, and :func:`caught_by` (lesson) its ``CAUGHT_BY``;
* the fixtures ``solution``, ``stub`` and ``bugs`` give the same for the lesson a test module
  names in its ``LESSON`` constant.

``tests/test_checks.py`` runs every task's checks once per variant (solution, stub, each seeded
bug); a lesson's own test module tests only what is particular to it.
"""

from __future__ import annotations

import functools
import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from autograder import course
from autograder.loading import load_tasks

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {spec.number: spec.source for spec in course.LESSONS}


def _keeping_executed_lessons() -> None:
    """Every headless run of a lesson source keeps its executed notebook in build/executed/,
    so the course site (tests/test_site.py, `make site`) shows those outputs without running the
    lessons again. Installed before any test module imports ``run_notebook``."""
    import kit.runner
    from autograder.site import keep_executed

    real = kit.runner.run_notebook

    @functools.wraps(real)
    def run_and_keep(path: Any, **kwargs: Any) -> Any:
        result = real(path, **kwargs)
        keep_executed(result)
        return result

    kit.runner.run_notebook = run_and_keep


_keeping_executed_lessons()


# With pytest-xdist workers (``make test``: two; ``pytest -n 2``), one worker runs a test
# file whole, in order, with its module fixtures set up once; the files of each group below run
# together on one worker, in this order (see :func:`pytest_xdist_make_scheduler`):
GROUPS = {
    # every file that runs a lesson headless, then the site built from those runs (test_site
    # must come after all of them: build/executed/ is only complete on that worker);
    # Lesson 00's run is shared by test_runner and test_lesson00_by_hand (conftest.executed_lesson)
    # (each lesson's files are its spec's Lesson.test_files, autograder/course.py)
    "lessons": [*[name for spec in course.LESSONS for name in spec.test_files], "test_site.py"],
    # the sandboxed batch grader: test_isolation asserts that no sandbox process (bwrap, a
    # sandbox uid) outlives its batch, which another file's batch running beside it would break
    "sandbox": ["test_isolation.py", "test_grading.py", "test_grading_resume.py",
                "test_result_routes.py", "test_environment.py", "test_fail_closed.py",
                "test_shards.py", "test_slurm.py", "test_scaffold.py"],
}
# the longest units first, so that the last one to finish starts early (the rest keep the
# order they were collected in)
FIRST = ["lessons", "test_browser.py", "test_checks.py", "sandbox"]
_GROUP_OF = {name: group for group, names in GROUPS.items() for name in names}


def unit_of(nodeid: str) -> str:
    """The unit of work one xdist worker runs whole: a group of GROUPS, else the test's file."""
    name = nodeid.split("::")[0].rsplit("/", 1)[-1]
    return _GROUP_OF.get(name, name)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Schedule whole units (:func:`unit_of`), in the order the workers collected them.

    (xdist's own ``--dist loadgroup`` cannot do it on pytest 9.2: its ``xdist_group`` suffix goes
    to ``Item._nodeid``, which pytest no longer reads.)"""
    if config.getvalue("dist") not in ("load", "loadscope", "loadfile", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False  # keep FIRST's order
    return ByUnit(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The site is built from the lessons the headless tests executed: build it last.
    items.sort(key=lambda item: item.nodeid.split("::")[0].endswith("test_site.py"))
    if not hasattr(config, "workerinput"):  # not an xdist worker: one process runs everything
        return
    units = list(dict.fromkeys(unit_of(item.nodeid) for item in items))  # in collection order
    units.sort(key=lambda unit: FIRST.index(unit) if unit in FIRST else len(FIRST))
    place = {unit: i for i, unit in enumerate(units)}
    items.sort(key=lambda item: place[unit_of(item.nodeid)])


@functools.cache
def solutions(lesson: int) -> ModuleType:
    return load_tasks(course.lesson(lesson).source)


@functools.cache
def stubs(lesson: int) -> ModuleType:
    notebook = course.lesson(lesson).notebook
    assert notebook.exists(), f"{notebook.name} is missing: run `kit build`"
    return load_tasks(notebook)


@functools.cache
def executed_lesson(source: Path) -> Any:
    """One headless run of a lesson source per test session (kit.runner.run_notebook, 600 s at
    most), for every test that reads what the lesson shows: a lesson runs once, and each test
    asserts its own time budget on ``result.seconds``."""
    import kit.runner

    return kit.runner.run_notebook(source, timeout=600)


@functools.cache
def _bugs_module(lesson: int) -> ModuleType | None:
    try:
        return importlib.import_module(f"bugs.lesson{lesson:02d}")
    except ModuleNotFoundError as e:
        if e.name != f"bugs.lesson{lesson:02d}":
            raise
        return None


def seeded_bugs(lesson: int) -> dict[str, list[tuple[str, Any]]]:
    module = _bugs_module(lesson)
    return module.BUGS if module else {}


def caught_by(lesson: int) -> dict[str, str]:
    """A bugs module's ``CAUGHT_BY``: ``{bug: words of the case that must fail it first}``, for
    the bugs whose values are right and that only a measurement below Python catches."""
    return getattr(_bugs_module(lesson), "CAUGHT_BY", {})


def _lesson(request: pytest.FixtureRequest) -> int:
    lesson = getattr(request.module, "LESSON", None)
    assert lesson is not None, \
        f"{request.module.__name__} needs LESSON = <lesson number> to use this fixture"
    return lesson


@pytest.fixture(scope="module")
def solution(request: pytest.FixtureRequest) -> ModuleType:
    """The graded code of the module's lesson, with its solutions."""
    return solutions(_lesson(request))


@pytest.fixture(scope="module")
def stub(request: pytest.FixtureRequest) -> ModuleType:
    """The graded code of the module's lesson as students get it (stubs)."""
    return stubs(_lesson(request))


@pytest.fixture(scope="module")
def bugs(request: pytest.FixtureRequest) -> dict[str, list[tuple[str, Any]]]:
    """The seeded bugs of the module's lesson."""
    return seeded_bugs(_lesson(request))


@pytest.fixture
def scratch_task() -> Any:
    """``make(**kw)``: a throwaway task 99.N ("thing", 3 points) registered for one test, then
    removed. Keywords go to registry.task (reference=..., cases...)."""
    from autograder import registry

    made: list[str] = []

    def make(**kw: Any) -> Any:
        task_id = f"99.{len(made) + 1}"
        made.append(task_id)
        return registry.task(task_id, "thing", points=3, **kw)

    yield make
    for task_id in made:
        registry.TASKS.pop(task_id, None)


def run_nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    """``nbgrader ARGS`` in ``course``; fails the test with nbgrader's output if it fails."""
    # nbgrader runs `alembic` (its database migrations) from PATH: the environment's bin/ first.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "PATH": path, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def browser() -> Any:
    """Debian's Chromium driven by Playwright, one per test module (the browser tests' own).

    Skips (or, under CI, fails) with the fix when Chromium or Playwright is missing."""
    import shutil

    from browser_support import CHROMIUM_FLAGS, require_browser

    require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=shutil.which("chromium"),
                                     args=CHROMIUM_FLAGS, headless=True)
        yield chromium
        chromium.close()
