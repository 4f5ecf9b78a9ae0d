"""Each fact is stated once: the registry says a task's name and points, everything else agrees.

A lesson's intro ("**Task 4.2**, 3 points"), the README's lesson table and the registration
tests of ``tests/test_lessonNN.py`` repeat what ``autograder/lessonNN.py`` registers; these
tests hold every copy against the registry, so a changed point value fails here until every
place says the same. CONTRIBUTING's example task is run as written and must pass the project's
own hint/recipe rule. A failure names the file and the fact that disagrees.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from autograder import course, registry
from autograder.registry import lesson_tasks

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {spec.number: spec.source for spec in course.LESSONS}


def _intro(lesson: int) -> str:
    """The built notebook's opening markdown cell, white space folded."""
    nb = json.loads(course.lesson(lesson).notebook.read_text(encoding="utf-8"))
    first = next(c for c in nb["cells"] if c["cell_type"] == "markdown")
    return " ".join("".join(first["source"]).split())


@pytest.mark.parametrize("lesson", sorted(SOURCES))
def test_the_lesson_intro_states_every_task_with_the_specs_points(lesson):
    """The source says {{task L.N}}; the notebook a student opens says the spec's points."""
    intro = _intro(lesson)
    found = re.findall(r"\*\*Task (\d+\.\d+)\*\*,\s*(\d+(?:\.\d+)?) points?", intro)
    stated = {tid: float(p) for tid, p in found}
    registered = {t.id: t.points for t in lesson_tasks(lesson)}
    assert stated == registered, (f"lessons/{course.lesson(lesson).stem}.ipynb's intro says "
                                  f"{stated}, autograder/course.py says {registered}")
    assert intro.startswith(f"# {course.lesson(lesson).heading}")


@pytest.mark.parametrize("lesson", sorted(SOURCES))
def test_the_readme_shows_a_screenshot_of_every_lesson(lesson):
    """The browser tests take them (KIT_UPDATE_SCREENSHOTS=1 refreshes docs/screenshots/)."""
    stem = SOURCES[lesson].stem
    shown = re.findall(r"!\[Lesson (\d\d)[^\]]*\]\((docs/screenshots/[^)]+)\)",
                       (ROOT / "README.md").read_text(encoding="utf-8"))
    paths = [path for n, path in shown if int(n) == lesson]
    assert paths == [f"docs/screenshots/{stem}.png"], \
        f"README shows {paths} for lesson {lesson:02d}"
    assert (ROOT / paths[0]).is_file(), \
        f"{paths[0]} is missing: run the browser tests with KIT_UPDATE_SCREENSHOTS=1"


def _readme_rows() -> dict[int, str]:
    rows = {}
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        m = re.match(r"\|\s*(\d\d)\s*\|.*\|(.*)\|\s*$", line)
        if m:
            rows[int(m.group(1))] = m.group(2)
    return rows


@pytest.mark.parametrize("lesson", sorted(SOURCES))
def test_the_readme_table_names_every_task_of_the_lesson(lesson):
    rows = _readme_rows()
    assert lesson in rows, f"README's lesson table has no row for lesson {lesson:02d}"
    named = set(re.findall(r"`([\w.]+)`", rows[lesson]))
    tasks = lesson_tasks(lesson)
    known = {t.name for t in tasks} | {c for t in tasks for c in t.companions}
    missing = {t.name for t in tasks} - {n.split(".")[0] for n in named}
    unknown = {n for n in named if n.split(".")[0] not in known}
    assert not missing and not unknown, (
        f"README row {lesson:02d}: missing tasks {sorted(missing)}, names that are neither a task "
        f"nor a declared companion (task(..., companions=...)) {sorted(unknown)}")


def _registration_literals(path: Path) -> list[tuple[int, str, tuple]]:
    """(line, task id, (name, points, ...)) of every dict literal mapping "L.N" to a tuple."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if (isinstance(key, ast.Constant) and isinstance(key.value, str)
                        and re.fullmatch(r"\d+\.\d+", key.value) and isinstance(value, ast.Tuple)):
                    try:
                        found.append((key.lineno, key.value, ast.literal_eval(value)))
                    except ValueError:
                        continue
    return found


TEST_FILES = sorted((ROOT / "tests").glob("test_lesson[0-9][0-9].py"))


@pytest.mark.parametrize("path", TEST_FILES, ids=[p.name for p in TEST_FILES])
def test_no_test_restates_a_tasks_name_or_points(path):
    """autograder/course.py states them once; a test that writes them again only goes stale."""
    restated = [
        f"{path.name}:{line}: {task_id}: {value[:2]}"
        for line, task_id, value in _registration_literals(path)
        if any(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value[:2])
    ]
    assert not restated, ("these restate the spec's task names or points (read course.task_spec "
                          "instead):\n" + "\n".join(restated))


def test_the_detector_reads_a_registration_literal(tmp_path):
    sample = tmp_path / "test_lesson99.py"
    sample.write_text('tasks = {"4.2": ("OverlappedDDP", 3.0), "x": 1}\n')
    assert _registration_literals(sample) == [(1, "4.2", ("OverlappedDDP", 3.0))]


def _contributing_example() -> str:
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    section = text.split("## 2. Register the checks", 1)[1]
    return section.split("```python", 1)[1].split("```", 1)[0]


def test_contributings_example_task_passes_the_hint_and_recipe_rule_as_written(monkeypatch):
    monkeypatch.setattr(registry, "TASKS", {})
    namespace: dict = {}
    exec(compile(_contributing_example(), "CONTRIBUTING.md", "exec"), namespace)  # noqa: S102
    (t,) = registry.TASKS.values()
    # the rule tests/test_checks.py applies to every real task
    assert t.hint and t.recipe and t.hint != t.recipe, t.id
    assert t.cases, "the example registers no case"
    for c in t.cases:
        assert c.hint and c.recipe and c.hint != c.recipe, (t.id, c.name)
    # and its cases run and pass on a correct shard_range
    from autograder.checking import run_checks

    monkeypatch.setattr(registry, "get_task", lambda task_id: t)
    import autograder.checking

    monkeypatch.setattr(autograder.checking, "get_task", lambda task_id: t)
    t.reference = _balanced
    report = run_checks(t.id, _balanced)
    assert report.passed, report.to_text()


def _balanced(n, rank, world_size):
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def _contributing_block(heading: str) -> str:
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    return text.split(heading, 1)[1].split("```python", 1)[1].split("```", 1)[0]


def test_contributings_spec_entry_is_one_the_spec_accepts():
    """The example entry, appended to the course as its next lesson, passes the spec's rules."""
    entry = eval(_contributing_block("## 0. The spec entry").strip().rstrip(","),  # noqa: S307
                 {"Lesson": course.Lesson, "_t": course._t})
    course._validate((*course.LESSONS, entry))
    assert entry.stem == f"{entry.number:02d}_{entry.slug}" and entry.points > 0


def test_contributings_seeded_bug_is_built_from_the_solution_and_fails():
    """The example bug's edits still apply to Lesson 00's solution, and its check fails."""
    from autograder.checking import run_checks

    namespace: dict = {}
    exec(compile(_contributing_block("## 3. Seed the typical bug"), "CONTRIBUTING.md", "exec"),
         namespace)  # noqa: S102
    (label, impl), = namespace["BUGS"]["0.2"]
    assert not run_checks("0.2", impl).passed, label


def test_the_files_allowed_long_lines_still_have_them():
    """pyproject's E501 exceptions only shrink: a file wrapped to 100 columns leaves the list."""
    import subprocess
    import sys

    import tomllib

    ignores = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"][
        "per-file-ignores"]
    listed = [path for path, codes in ignores.items() if codes == ["E501"]]
    wrapped = [path for path in listed if subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--select", "E501",
         "--line-length", "100", "--quiet", str(ROOT / path)], capture_output=True).returncode == 0]
    assert not wrapped, f"no line over 100 columns in {wrapped}: remove them from pyproject.toml"
