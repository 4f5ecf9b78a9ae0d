"""`make test` runs on two pytest-xdist workers; tests/conftest.py decides what shares a worker.

A file that runs a lesson headless must be in the ``lessons`` group (test_site builds the site
from those runs, after them, on the same worker), a file that runs the sandboxed batch grader in
the ``sandbox`` group (test_isolation counts the sandbox processes left on the machine), and a
real two-worker run must keep each file on one worker.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import FIRST, GROUPS, ROOT, unit_of

TESTS = ROOT / "tests"


def _files_using(pattern: str) -> set[str]:
    return {p.name for p in TESTS.glob("test_*.py")
            if p.name != "test_scheduling.py" and re.search(pattern, p.read_text(encoding="utf-8"))}


def test_every_grouped_file_exists_and_is_in_one_group():
    named = [name for names in GROUPS.values() for name in names]
    assert len(named) == len(set(named)), "a file is in two groups"
    assert not [n for n in named if not (TESTS / n).exists()], "GROUPS names a file that is gone"
    assert set(FIRST) <= set(GROUPS) | {p.name for p in TESTS.glob("test_*.py")}


def test_every_headless_lesson_run_is_in_the_lessons_group_and_the_site_comes_last():
    runners = _files_using(r"\b(run_notebook|executed_lesson|run_headless)\(")  # lesson_support
    assert "test_lesson09.py" in runners  # the pattern finds them
    assert runners - set(GROUPS["lessons"]) == set(), "add these files to GROUPS['lessons']"
    assert GROUPS["lessons"][-1] == "test_site.py"


def test_every_sandboxed_batch_is_in_the_sandbox_group():
    batches = _files_using(r"\b(grade_batch|run_batch)\(|\"--out\"")
    assert "test_isolation.py" in batches
    assert batches - set(GROUPS["sandbox"]) == set(), "add these files to GROUPS['sandbox']"


def test_a_unit_is_the_group_or_else_the_file():
    assert unit_of("tests/test_site.py::test_x") == "lessons"
    assert unit_of("tests/test_isolation.py::test_y[3]") == "sandbox"
    assert unit_of("tests/test_facts.py::test_z") == "test_facts.py"


@pytest.mark.slow
def test_two_workers_keep_each_file_on_one_worker():
    pytest.importorskip("xdist")
    files = ["tests/test_facts.py", "tests/test_registry.py"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-v", "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    workers: dict[str, set[str]] = {}
    for worker, path in re.findall(r"^\[(gw\d+)\] .*?(tests/test_\w+\.py)::", done.stdout, re.M):
        workers.setdefault(path, set()).add(worker)
    assert set(workers) == set(files), done.stdout[-3000:]
    assert all(len(w) == 1 for w in workers.values()), f"a file ran on two workers: {workers}"
    assert len(set().union(*workers.values())) == 2, f"one worker ran everything: {workers}"
