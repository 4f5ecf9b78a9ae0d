"""What every test of a lesson needs, loaded once per session.

* :func:`solutions` (lesson) -> the graded code of ``solutions/NN_slug.py``;
* :func:`stubs` (lesson) -> the graded code of the released ``lessons/NN_slug.ipynb``;
* :func:`seeded_bugs` (lesson) -> ``tests/bugs/lessonNN.py``'s ``BUGS``: ``{task id: [(what, impl)]}``;
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

from autograder.loading import lesson_of, load_tasks

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {lesson_of(p): p for p in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.py"))}


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The site is built from the lessons the headless tests executed: build it last.
    items.sort(key=lambda item: item.nodeid.split("::")[0].endswith("test_site.py"))


@functools.cache
def solutions(lesson: int) -> ModuleType:
    assert lesson in SOURCES, f"lesson {lesson:02d} has checks but no solutions/{lesson:02d}_*.py"
    return load_tasks(SOURCES[lesson])


@functools.cache
def stubs(lesson: int) -> ModuleType:
    assert lesson in SOURCES, f"lesson {lesson:02d} has checks but no solutions/{lesson:02d}_*.py"
    notebook = ROOT / "lessons" / f"{SOURCES[lesson].stem}.ipynb"
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
def seeded_bugs(lesson: int) -> dict[str, list[tuple[str, Any]]]:
    try:
        return importlib.import_module(f"bugs.lesson{lesson:02d}").BUGS
    except ModuleNotFoundError as e:
        if e.name != f"bugs.lesson{lesson:02d}":
            raise
        return {}


def _lesson(request: pytest.FixtureRequest) -> int:
    lesson = getattr(request.module, "LESSON", None)
    assert lesson is not None, f"{request.module.__name__} needs LESSON = <lesson number> to use this fixture"
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
