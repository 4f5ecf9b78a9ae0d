"""Adding a lesson is its spec entry plus its own files: proved on a throwaway Lesson 99.

A copy of the course gets one ``Lesson(99, ...)`` entry in autograder/course.py, one solution
source (solutions/99_scaffold.py), one check module (autograder/lesson99.py) and its reference
(autograder/references/lesson99.py), exactly as CONTRIBUTING's "Adding a lesson" says; nothing
else is edited. Then, in that copy, ``kit build`` writes the notebook and README's row, ``kit
build --check`` is clean, the checks pass on the solution and fail on the stub the build wrote,
and the sandboxed batch grader gives the solution full points and the stub none.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from grading_support import need_grading_sandbox

ROOT = Path(__file__).resolve().parents[1]

SPEC_ENTRY = '''
    Lesson(99, "scaffold", "A throwaway lesson: the sum over all ranks",
           (_t("99.1", "global_sum", 2),),
           grading_seconds=0.5, no_gpu_smoke="a scaffold, never run on a GPU"),
'''

SOURCE = '''\
# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # {{title}}
#
# Add up one tensor per rank ({{task 99.1}}).

# %% tags=["setup"]
import torch
import torch.distributed as dist

from kit import check

# %% [markdown]
# ## {{task 99.1}}: `global_sum`

# %% tags=["task-99.1"]
def global_sum(t):
    """The sum of ``t`` over every rank, on every rank."""
    ### BEGIN SOLUTION
    out = t.clone()
    dist.all_reduce(out)
    return out
    ### END SOLUTION


# %% tags=["check-99.1"]
check("99.1", global_sum)
'''

CHECKS = '''\
"""Checks of the scaffold lesson 99."""

import torch
import torch.distributed as dist

from autograder.registry import task

T = task("99.1", reference="global_sum",
         hint="Every rank ends with the same sum: the ranks' tensors added together.",
         recipe="Copy the tensor, all-reduce the copy with SUM, return it.")


@T.shared(world_size=2, timeout=60.0)
def _sums(global_sum, seed):
    rank = dist.get_rank()
    return global_sum(torch.arange(4.0) * (rank + 1 + seed % 3))


T.case("the sum on 2 ranks", uses=_sums)
'''

REFERENCE = '''\
"""Trusted answers of lesson 99."""

import torch.distributed as dist


def global_sum(t):
    out = t.clone()
    dist.all_reduce(out)
    return out
'''

IN_THE_COPY = '''
import sys
from pathlib import Path

import autograder
from autograder.checking import run_checks
from autograder.course import lesson
from autograder.loading import load_tasks

root = Path.cwd()
assert Path(autograder.__file__).resolve().is_relative_to(root), autograder.__file__
spec = lesson(99)
solution = load_tasks(spec.source).global_sum
stub = load_tasks(spec.notebook).global_sum
good, bad = run_checks("99.1", solution), run_checks("99.1", stub)
print("solution", good.passed, "stub", bad.passed, bad.cases[0].status, good.to_text())
sys.exit(0 if good.passed and not bad.passed else 1)
'''


def _copy_course(dest: Path) -> Path:
    """The course's code, sources, notebooks and README, in a folder of its own."""
    for name in ("autograder", "kit", "solutions", "lessons"):
        shutil.copytree(ROOT / name, dest / name,
                        ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
    shutil.copy(ROOT / "README.md", dest / "README.md")
    return dest


def _run(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_a_new_lesson_is_its_spec_entry_and_its_own_files(tmp_path):
    need_grading_sandbox()
    root = _copy_course(tmp_path / "course")
    spec_file = root / "autograder" / "course.py"
    text = spec_file.read_text()
    anchor = "\n)\n\n_SLUG = "
    assert text.count(anchor) == 1, "autograder/course.py's LESSONS no longer ends as expected"
    spec_file.write_text(text.replace(anchor, SPEC_ENTRY.rstrip("\n") + anchor))
    (root / "solutions" / "99_scaffold.py").write_text(SOURCE)
    (root / "autograder" / "lesson99.py").write_text(CHECKS)
    (root / "autograder" / "references" / "lesson99.py").write_text(REFERENCE)

    # kit build: the new notebook and README's row, nothing else changed
    built = _run(["-m", "kit.cli", "build"], root)
    assert built.returncode == 0, built.stdout + built.stderr
    assert sorted(built.stdout.splitlines()) == ["wrote README.md's lesson table",
                                                 "wrote lessons/99_scaffold.ipynb"], built.stdout
    notebook = (root / "lessons" / "99_scaffold.ipynb").read_text()
    assert "Lesson 99 · A throwaway lesson" in notebook and "**Task 99.1**, 2 points" in notebook
    assert "{{" not in notebook and "BEGIN SOLUTION" not in notebook
    assert "| 99 | A throwaway lesson: the sum over all ranks | `global_sum` |" in \
        (root / "README.md").read_text()
    checked = _run(["-m", "kit.cli", "build", "--check"], root)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    # check: the solution passes, the stub the build wrote fails
    ran = _run(["-c", IN_THE_COPY], root)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "solution True stub False" in ran.stdout

    # grade: the sandboxed batch grader on a student with the solution and one with the stub
    submissions = tmp_path / "submitted"
    for student, source in (("ada", None), ("bob", root / "lessons" / "99_scaffold.ipynb")):
        (submissions / student).mkdir(parents=True)
        target = submissions / student / "99_scaffold.ipynb"
        if source is None:
            nb = _run(["-c", textwrap.dedent('''
                from pathlib import Path
                from autograder.build import render, source_notebook
                print(render(source_notebook(Path("solutions/99_scaffold.py"))), end="")
            ''')], root)
            assert nb.returncode == 0, nb.stderr
            target.write_text(nb.stdout)
        else:
            shutil.copy(source, target)
    out = tmp_path / "graded"
    graded = _run(["-m", "kit.cli", "grade", str(submissions), "--out", str(out),
                   "--lessons", "99", "--workers", "1"], root)
    assert graded.returncode == 0, graded.stdout + graded.stderr
    with open(out / "grades.csv", newline="") as f:
        rows = {row["student"]: row for row in csv.DictReader(f)}
    assert float(rows["ada"]["99.1"]) == 2.0 and float(rows["bob"]["99.1"]) == 0.0, rows
