"""The course spec (autograder/course.py) is the one statement of each lesson fact.

Everything else agrees with it or derives from it: the registered tasks, the dependencies a
lesson needs, the seeded bugs (built from the solution, never a copy of it), and no code but
the spec names a lesson's slug. The spec itself refuses a malformed entry with the fix.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
from pathlib import Path

import pytest
import tomllib
from conftest import seeded_bugs

from autograder import course
from autograder.registry import lesson_tasks

ROOT = Path(__file__).resolve().parents[1]
LESSONS = [spec.number for spec in course.LESSONS]


@pytest.mark.parametrize("lesson", LESSONS)
def test_the_registered_tasks_are_the_specs(lesson):
    spec = course.lesson(lesson)
    registered = [(t.id, t.name, t.points, t.companions) for t in lesson_tasks(lesson)]
    stated = [(t.id, t.name, t.points, t.companions) for t in spec.tasks]
    assert registered == stated, f"autograder/lesson{lesson:02d}.py registers {registered}"
    for name in ("source", "notebook"):
        assert getattr(spec, name).is_file(), f"lesson {lesson:02d}: no {getattr(spec, name)}"
    for path in (f"autograder/lesson{lesson:02d}.py", f"tests/bugs/lesson{lesson:02d}.py"):
        assert (ROOT / path).is_file(), f"lesson {lesson:02d} has no {path}"


def _dependencies() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [*project["dependencies"], *(d for ds in project.get("optional-dependencies", {})
                                         .values() for d in ds)]
    return {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower() for d in names}


@pytest.mark.parametrize("lesson", [s.number for s in course.LESSONS if s.needs])
def test_what_a_lesson_needs_is_installed_by_every_install_path(lesson):
    deps, env = _dependencies(), (ROOT / "environment.yml").read_text().lower()
    for dist in course.lesson(lesson).needs:
        assert dist in deps, f"pyproject.toml does not list {dist} (lesson {lesson:02d} needs it)"
        assert dist in env, f"environment.yml does not list {dist} (lesson {lesson:02d} needs it)"


# ---------------------------------------------------------------- no code but the spec names a slug


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string in ``path``'s code; docstrings and comments left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.add(id(body[0].value))
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def _code_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                             "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in listed.split() if not p.startswith(("solutions/", "lessons/"))
            and p != "autograder/course.py" and (ROOT / p).is_file()]


# a stem, or a glob that lists the lesson sources (a student's notebooks may be globbed)
STEM = re.compile("|".join(re.escape(s.stem) for s in course.LESSONS) + r"|\[0-9\]\[0-9\]_\*\.py")


def test_no_code_but_the_spec_names_a_lesson_slug():
    """A lesson's files are found through autograder.course (``course.lesson(5).source``), so a
    new lesson is its spec entry and its own files: no list of lessons hides anywhere else."""
    found = [f"{path.relative_to(ROOT)}:{line}: {text[:60]!r}" for path in _code_files()
             for line, text in _code_strings(path) if STEM.search(text)]
    assert not found, "lesson stems named outside autograder/course.py:\n" + "\n".join(found)


def test_the_slug_scan_sees_a_path_and_skips_a_docstring(tmp_path):
    sample = tmp_path / "sample.py"
    five, nine, last = (course.lesson(n).stem for n in (5, 9, 13))
    sample.write_text(f'"""Run solutions/{five}.py."""\n# {nine}\n'
                      f'PATH = "solutions/{last}.py"\nGLOB = "[0-9][0-9]_' + '*.py"\n')
    assert [line for line, text in _code_strings(sample) if STEM.search(text)] == [3, 4]


# ---------------------------------------------------------------- seeded bugs built from solutions

MOST_SHARED = 12  # lines a bugs module may share with its solution and reference (imports...)


def _lines(text: str) -> set[str]:
    """The lines that say something: stripped, comments, docstring quotes and short lines out."""
    out = set()
    for line in text.splitlines():
        line = line.split("  #")[0].strip()
        if len(line) >= 16 and not line.startswith(("#", '"""', "return ", "def ", "class ",
                                                     "from ", "import ")):
            out.add(line)
    return out


def _copied(lesson: int) -> list[str]:
    """The lines tests/bugs/lessonNN.py writes out again from the lesson's solution or reference."""
    trusted = _lines(course.lesson(lesson).source.read_text())
    reference = ROOT / "autograder" / "references" / f"lesson{lesson:02d}.py"
    if reference.is_file():
        trusted |= _lines(reference.read_text())
    bugs = _lines((ROOT / "tests" / "bugs" / f"lesson{lesson:02d}.py").read_text())
    return sorted(bugs & trusted)


@pytest.mark.parametrize("lesson", LESSONS)
def test_seeded_bugs_are_built_from_the_solution_not_copied(lesson):
    """A bug is the loaded solution with one named edit (bugs.edited_solution), a small wrapper
    of it, or a cheat of its own (the forbidden library, the stub): not a copy of the solution's
    or the reference's code, which goes stale when they change."""
    seeded_bugs(lesson)  # the module imports and lists its bugs
    shared = _copied(lesson)
    assert len(shared) <= MOST_SHARED, (
        f"tests/bugs/lesson{lesson:02d}.py writes out {len(shared)} lines of the solution or "
        "reference again: build those bugs from the solution with edited_solution(...):\n"
        + "\n".join(shared))


# ---------------------------------------------------------------- the spec refuses what is wrong


def _with(spec: course.Lesson, **changes) -> tuple[course.Lesson, ...]:
    lessons = list(course.LESSONS)
    lessons[lessons.index(spec)] = dataclasses.replace(spec, **changes)
    return tuple(lessons)


@pytest.mark.parametrize(("changes", "message"), [
    ({"number": 4}, "each once, in increasing order"),
    ({"slug": "Sharding-Lesson"}, "lowercase words"),
    ({"gpu_smoke": ""}, "give gpu_smoke"),
    ({"tasks": (course.TaskSpec("5.2", "x", 1.0),)}, "found 5.2 where 5.1 belongs"),
    ({"tasks": (course.TaskSpec("5.1", "x", 0.0),)}, "worth some points"),
])
def test_a_malformed_spec_entry_is_refused_with_the_fix(changes, message):
    with pytest.raises(ValueError, match=message):
        course._validate(_with(course.lesson(5), **changes))


def test_marks_are_filled_in_and_an_unknown_one_is_refused():
    spec = course.lesson(0)
    assert course.render_marks("# {{title}}\n({{ task 0.2 }})", spec) == \
        f"# Lesson 00 · {spec.title}\n(**Task 0.2**, 3 points)"
    with pytest.raises(course.MarkError, match="names no task of lesson 00"):
        course.render_marks("{{task 0.3}}", spec)
    with pytest.raises(course.MarkError, match="unknown mark"):
        course.render_marks("{{points}}", spec)
    with pytest.raises(KeyError, match="autograder/course.py"):
        course.lesson(99)


def test_every_lesson_file_belongs_to_a_spec_lesson():
    """A check module, reference, bugs module or lesson test without its Lesson(...) entry is a
    lesson half added: the spec names the fix."""
    known = {f"{n:02d}" for n in LESSONS}
    files = [*ROOT.glob("autograder/lesson[0-9][0-9].py"),
             *ROOT.glob("autograder/references/lesson[0-9][0-9].py"),
             *ROOT.glob("tests/bugs/lesson[0-9][0-9].py"),
             *ROOT.glob("tests/test_lesson[0-9][0-9].py")]
    stray = [str(p.relative_to(ROOT)) for p in files if p.stem[-2:] not in known]
    assert not stray, f"no Lesson(...) in autograder/course.py for {stray}: add its entry there"
