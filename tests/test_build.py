"""kit build / kit build --check / kit course: lessons/ is exactly what solutions/ builds."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import nbformat
import pytest

from autograder import course as course_spec
from autograder.build import (
    BuildError,
    build_lessons,
    lesson_sources,
    main_build,
    main_course,
    render,
    source_notebook,
    student_notebook,
)
from autograder.loading import Cell, cell_role, lesson_of, read_cells
from autograder.registry import get_task, lesson_tasks

ROOT = Path(__file__).resolve().parents[1]
SOURCES = lesson_sources(ROOT)
LESSON00 = course_spec.lesson(0).source


def _copy_course(tmp_path: Path, lessons: list[Path] = (LESSON00,)) -> Path:
    """A course root holding ``lessons``' sources (the others' built notebooks kept as they are,
    so that the spec finds every lesson and only ``lessons`` build anew)."""
    root = tmp_path / "repo"
    (root / "solutions").mkdir(parents=True)
    (root / "lessons").mkdir()
    for src in SOURCES:
        if src in lessons:
            shutil.copy(src, root / "solutions")
        else:
            (root / "solutions" / src.name).symlink_to(src)
            shutil.copy(ROOT / "lessons" / f"{src.stem}.ipynb", root / "lessons")
    return root


def test_committed_lessons_are_up_to_date():
    assert build_lessons(ROOT, check=True) == []


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_build_is_deterministic(source):
    assert render(student_notebook(source_notebook(source))) == \
        render(student_notebook(source_notebook(source)))


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_student_notebook_has_stubs_points_and_checksums(source):
    lesson = nbformat.reads(render(student_notebook(source_notebook(source))), as_version=4)
    solutions = source_notebook(source)
    seen = set()
    for cell, solved in zip(lesson.cells, solutions.cells):
        assert cell.id == solved.id
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
        role, task_id = cell_role(Cell(0, cell.cell_type, cell.source, cell.metadata))
        if role == "task":
            task = get_task(task_id)
            seen.add(task_id)
            assert "BEGIN SOLUTION" not in cell.source
            assert re.search(
                rf'raise NotImplementedError\("Task {re.escape(task_id)}: \w', cell.source
            )
            body = solved.source.split("### BEGIN SOLUTION")[1].split("### END SOLUTION")[0]
            for line in filter(str.strip, body.splitlines()):
                assert line not in cell.source, f"solution line leaked into {source.name}: {line}"
            assert cell.metadata.nbgrader["solution"] and "checksum" in cell.metadata.nbgrader
            assert f"def {task.name}" in cell.source or f"class {task.name}" in cell.source
        if role == "check":
            meta = cell.metadata.nbgrader
            assert meta["grade"] and meta["locked"] and meta["points"] == get_task(task_id).points
            assert cell.metadata["editable"] is False
        if role == "setup":
            assert cell.metadata.nbgrader["locked"] and cell.source == solved.source
    assert seen == {t.id for t in lesson_tasks(lesson_of(source))}


def test_stub_message_is_the_first_docstring_line():
    lesson = student_notebook(source_notebook(LESSON00))
    stub = next(c for c in lesson.cells if c.id == "task-0-1")
    assert 'raise NotImplementedError("Task 0.1: Return the contiguous, balanced range of the n ' \
           'items that rank owns.")' in stub.source


def test_check_reports_stale_missing_and_orphan_lessons_with_the_fix(tmp_path, capsys):
    root = _copy_course(tmp_path)
    assert main_build(["--root", str(root), "--check"]) == 1
    assert f"lessons/{course_spec.lesson(0).stem}.ipynb is missing" in capsys.readouterr().err

    assert main_build(["--root", str(root)]) == 0
    assert main_build(["--root", str(root), "--check"]) == 0
    assert "up to date" in capsys.readouterr().out

    source = root / "solutions" / LESSON00.name
    source.write_text(source.read_text() + "\n# %% [markdown]\n# One more paragraph.\n")
    assert main_build(["--root", str(root), "--check"]) == 1
    err = capsys.readouterr().err
    assert (
        f"lessons/{course_spec.lesson(0).stem}.ipynb is stale" in err and "Run `kit build`" in err
    )

    (root / "lessons" / "07_gone.ipynb").write_text("{}")
    assert main_build(["--root", str(root), "--check"]) == 1
    assert "07_gone.ipynb has no source solutions/07_gone.py" in capsys.readouterr().err


def test_an_edit_changes_only_the_edited_cell_ids(tmp_path):
    root = _copy_course(tmp_path)
    source = root / "solutions" / LESSON00.name
    before = [c.id for c in source_notebook(source).cells]
    text = source.read_text().replace("# ## 1. Processes, ranks and a world",
                                      "# ## 1. Processes, ranks and a world (edited)")
    source.write_text(text)
    after = [c.id for c in source_notebook(source).cells]
    assert sum(a != b for a, b in zip(before, after)) == 1


_BROKEN = [
    (
        'tags=["check-0.2"]',
        'tags=["check-0.9"]',
        "names no task of lesson 00.*autograder/lesson00.py",
    ),
    (
        '# %% tags=["check-0.2"]\ncheck("0.2", global_mean)',
        "# %%\nprint()",
        r"task 0.2 \(global_mean\) has no cell tagged check-0.2",
    ),
    (
        'check("0.2", global_mean)',
        'check("0.2", shard_range)',
        r'must call check\("0.2", global_mean\)',
    ),
    (
        "    ### BEGIN SOLUTION\n    base",
        "    base",
        "between ### BEGIN SOLUTION and ### END SOLUTION",
    ),
    ('# %% tags=["setup"]', "# %%", "no setup cell"),
    ("def shard_range(", "def shard_rnage(", "must define shard_range"),
]


@pytest.mark.parametrize(("old", "new", "message"), _BROKEN)
def test_malformed_source_names_the_cell_and_the_fix(tmp_path, capsys, old, new, message):
    root = _copy_course(tmp_path)
    source = root / "solutions" / LESSON00.name
    text = source.read_text()
    assert old in text
    source.write_text(text.replace(old, new, 1))
    with pytest.raises(BuildError, match=message):
        source_notebook(source)
    assert main_build(["--root", str(root)]) == 2
    assert f"{course_spec.lesson(0).stem}.py" in capsys.readouterr().err
    assert not (root / "lessons" / f"{course_spec.lesson(0).stem}.ipynb").exists()


def test_build_outside_a_course_repository_says_where_to_run(tmp_path, capsys):
    assert main_build(["--root", str(tmp_path)]) == 2
    assert "no lesson sources" in capsys.readouterr().err


def test_course_writes_config_and_source_notebooks(tmp_path, capsys):
    course = tmp_path / "course"
    assert main_course([str(course), "--root", str(ROOT), "--lessons", "00"]) == 0
    config = (course / "nbgrader_config.py").read_text()
    assert "c.Execute.timeout = 300" in config and "release_preprocessors()" in config
    source = course / "source" / course_spec.lesson(0).stem / f"{course_spec.lesson(0).stem}.ipynb"
    nb = nbformat.read(source, as_version=4)
    task = next(c for c in nb.cells if c.id == "task-0-1")
    assert "### BEGIN SOLUTION" in task.source  # the instructor's copy keeps the solutions
    assert f"nbgrader generate_assignment {course_spec.lesson(0).stem}" in capsys.readouterr().out
    # Running it again changes nothing; an instructor's edit is never overwritten silently.
    assert main_course([str(course), "--root", str(ROOT), "--lessons", "00"]) == 0
    source.write_text(source.read_text().replace("Lesson 00", "Lesson 00 (edited)"))
    assert main_course([str(course), "--root", str(ROOT), "--lessons", "00"]) == 2
    assert "--force" in capsys.readouterr().err
    assert "(edited)" in source.read_text()
    assert main_course([str(course), "--root", str(ROOT), "--lessons", "00", "--force"]) == 0
    assert "(edited)" not in source.read_text()


def test_autograde_runs_only_the_definitions_of_demo_cells_and_shows_them_as_submitted():
    from autograder.build import DEMO_NOT_RUN, DemoDefinitionsOnly, DemoSourcesRestored
    from autograder.loading import definitions_only

    demo = ("import os\n%matplotlib inline\nWORLD = 4\nSIZES = list(range(WORLD))\n"
            "@torch.no_grad()\ndef helper(x):\n    return x\n\nlaunch(helper, world_size=WORLD)\n"
            "class Box:\n    size = 2\n")
    assert definitions_only(demo) == ("WORLD = 4\n\n@torch.no_grad()\ndef helper(x):\n    return x"
                                      "\n\nclass Box:\n    size = 2")
    assert definitions_only("%%distributed -n 2\nprint(1)") == ""
    assert definitions_only("def broken(:\n") == ""
    graded = {
        "setup": "import torch\nprint('setup runs')",
        "task-0.1": "x = f()\ndef shard_range(): ...",
        "check-0.1": "check('0.1', shard_range)",
    }
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(src, metadata={"tags": [tag]}) for tag, src in graded.items()]
        + [nbformat.v4.new_code_cell(demo), nbformat.v4.new_markdown_cell("launch(x)"),
           nbformat.v4.new_code_cell("%%distributed -n 4\nprint(1)", metadata={"tags": ["demo"]})])
    for cell in nb.cells[3:]:
        cell.outputs = [] if cell.cell_type == "code" else None
    before = [c.source for c in nb.cells]
    nb, _ = DemoDefinitionsOnly().preprocess(nb, {})
    # graded cells and markdown as they were; the demos keep only their definitions
    assert [c.source for c in nb.cells] == [*before[:3], definitions_only(demo), before[4], ""]
    nb.cells[3].outputs = [nbformat.v4.new_output("stream", text="what ran")]
    nb, _ = DemoSourcesRestored().preprocess(nb, {})
    assert [c.source for c in nb.cells] == before
    for cell in (nb.cells[3], nb.cells[5]):
        assert cell.outputs == [nbformat.v4.new_output("stream", name="stdout", text=DEMO_NOT_RUN)]
        assert cell.execution_count is None and "kit_demo_source" not in cell.metadata
    assert all("outputs" not in c or c.outputs == [] for c in nb.cells[:3])


def test_course_never_overwrites_an_edited_config_without_force(tmp_path, capsys):
    from autograder.build import _CONFIG

    course = tmp_path / "course"
    assert main_course([str(course), "--root", str(ROOT), "--lessons", "00"]) == 0
    config = course / "nbgrader_config.py"
    assert config.read_text() == _CONFIG and "= autograde_preprocessors()" in _CONFIG
    assert (
        main_course([str(course), "--root", str(ROOT), "--lessons", "00"]) == 0
    )  # unchanged: fine
    config.write_text(_CONFIG + "c.Execute.timeout = 900  # an instructor's edit\n")
    assert main_course([str(course), "--root", str(ROOT), "--lessons", "00"]) == 2
    assert "--force" in capsys.readouterr().err and "900" in config.read_text()
    assert main_course([str(course), "--root", str(ROOT), "--lessons", "00", "--force"]) == 0
    assert config.read_text() == _CONFIG

def test_course_rejects_a_bad_lesson_list(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        main_course([str(tmp_path), "--root", str(ROOT), "--lessons", "zero"])
    assert exit.value.code == 2
    assert "--lessons: takes lesson numbers separated by commas" in capsys.readouterr().err
    assert main_course([str(tmp_path), "--root", str(ROOT), "--lessons", "42"]) == 2
    assert "no lesson source for 42" in capsys.readouterr().err


def test_read_cells_reads_sources_and_notebooks_alike():
    from_source = [c.source for c in read_cells(LESSON00) if c.cell_type == "markdown"]
    from_lesson = [c.source for c in read_cells(course_spec.lesson(0).notebook)
                   if c.cell_type == "markdown"]
    assert from_source == from_lesson


def test_each_stubbed_function_names_its_own_job():
    # Task 1.4 is two functions in one cell: each stub must say what *it* computes.
    from autograder.build import stub_message

    source = (
        'def fit_alpha_beta(nbytes, seconds):\n    """Fit the model."""\n    raise X\n\n\n'
        'def ring_all_reduce_time(nbytes, world_size, alpha, beta):\n'
        '    """Predict a ring all-reduce."""\n    raise X\n'
    )
    assert stub_message("1.4", source, 3) == "Task 1.4: Fit the model."
    assert stub_message("1.4", source, 8) == "Task 1.4: Predict a ring all-reduce."
    assert stub_message("1.4", source) == "Task 1.4: Fit the model."
