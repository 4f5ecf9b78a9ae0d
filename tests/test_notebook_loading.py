"""load_tasks loads a lesson's graded code (setup + solution cells, never demos) from a source
or a student notebook, however its cells were deleted, reordered, retyped or stripped of
metadata, and says exactly what it could not find."""

from __future__ import annotations

import json
import operator
import random
import shutil
import sys
from pathlib import Path

import pytest

import kit
from autograder import course
from autograder.loading import NotebookError, load_tasks

SOURCE = course.lesson(0).source
LESSON = course.lesson(0).notebook


def _solved_notebook() -> dict:
    """The student notebook with the solutions pasted into the task cells, as JSON."""
    from autograder.build import source_notebook

    solved = {c.id: c.source for c in source_notebook(SOURCE).cells}
    nb = json.loads(LESSON.read_text())
    for cell in nb["cells"]:
        cell["source"] = (
            solved[cell["id"]] if cell["id"].startswith("task-") else "".join(cell["source"])
        )
    return nb


def _write(tmp_path: Path, nb: dict, name: str = "00_student.ipynb") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(nb))
    return path


def _task_cell(nb: dict, task_id: str) -> dict:
    return next(c for c in nb["cells"] if f"task-{task_id}" in c["metadata"].get("tags", []))


def test_source_loads_both_tasks_and_no_demo():
    module = load_tasks(SOURCE)
    report = module.__load_report__
    assert report.complete and set(report.found) == {"0.1", "0.2"}
    assert list(module.shard_range(10, 1, 4)) == [3, 4, 5]
    for demo_name in ("hello", "squares", "plot_shards", "crash_on_rank_2", "plt"):
        assert not hasattr(module, demo_name), f"demo code {demo_name} was loaded"


def test_module_is_registered_under_a_stable_name():
    first, second = load_tasks(SOURCE), load_tasks(SOURCE)
    assert first is second
    assert sys.modules[first.__name__] is first
    assert first.__name__ == first.__load_report__.module_name


def test_student_stub_loads_and_raises_the_task_message():
    module = load_tasks(LESSON)
    with pytest.raises(NotImplementedError, match=r"^Task 0\.1: "):
        module.shard_range(10, 0, 4)


def test_spawned_ranks_can_import_loaded_tasks():
    module = load_tasks(SOURCE)
    results = kit.launch(operator.call, module.shard_range, 10, 1, 4, world_size=2,
                         start_method="spawn", timeout=120)
    assert list(results) == [range(3, 6), range(3, 6)]


def test_deleted_metadata_falls_back_to_function_names(tmp_path):
    nb = _solved_notebook()
    for cell in nb["cells"]:
        cell["metadata"] = {}
    module = load_tasks(_write(tmp_path, nb))
    report = module.__load_report__
    assert set(report.found) == {"0.1", "0.2"}
    assert "found by name" in report.found["0.1"]
    assert "setup" in report.missing  # the setup cell cannot be told apart without its tag...
    assert (
        float(module.global_mean.__globals__["torch"].tensor(1.0)) == 1.0
    )  # ...its imports still load
    assert list(module.shard_range(3, 0, 5)) == [0]


def test_reordered_cells_still_load(tmp_path):
    nb = _solved_notebook()
    random.Random(0).shuffle(nb["cells"])
    module = load_tasks(_write(tmp_path, nb))
    assert module.__load_report__.complete
    assert list(module.shard_range(10, 3, 4)) == [8, 9]


def test_retyped_task_cell_is_loaded_with_a_note(tmp_path):
    nb = _solved_notebook()
    cell = _task_cell(nb, "0.1")
    cell["cell_type"] = "markdown"
    for key in ("outputs", "execution_count"):
        cell.pop(key, None)
    module = load_tasks(_write(tmp_path, nb))
    report = module.__load_report__
    assert report.complete
    assert any("markdown cell" in note for note in report.notes)


def test_deleted_task_cell_is_reported_missing_and_the_other_task_loads(tmp_path):
    nb = _solved_notebook()
    nb["cells"].remove(_task_cell(nb, "0.2"))
    module = load_tasks(_write(tmp_path, nb))
    report = module.__load_report__
    assert set(report.missing) == {"0.2"}
    assert "global_mean" in report.missing["0.2"] and "task-0.2" in report.missing["0.2"]
    assert not hasattr(module, "global_mean")
    assert list(module.shard_range(12, 0, 4)) == [0, 1, 2]


def test_syntax_error_in_one_task_cell_keeps_the_other(tmp_path):
    nb = _solved_notebook()
    cell = _task_cell(nb, "0.2")
    cell["source"] = cell["source"].replace("dist.all_reduce(total)", "dist.all_reduce(total")
    module = load_tasks(_write(tmp_path, nb))
    report = module.__load_report__
    assert "SyntaxError" in report.missing["0.2"] and "line" in report.missing["0.2"]
    assert list(module.shard_range(12, 3, 4)) == [9, 10, 11]


def test_a_task_cell_that_raises_on_import_is_dropped(tmp_path):
    nb = _solved_notebook()
    cell = _task_cell(nb, "0.2")
    cell["source"] = "LIMIT = 1 / 0\n" + cell["source"]
    module = load_tasks(_write(tmp_path, nb))
    report = module.__load_report__
    assert "ZeroDivisionError" in report.missing["0.2"]
    assert report.found.keys() == {"0.1"}
    assert list(module.shard_range(4, 0, 2)) == [0, 1]


def test_demo_statements_in_a_task_cell_do_not_run(tmp_path):
    nb = _solved_notebook()
    cell = _task_cell(nb, "0.1")
    cell["source"] += "\nraise SystemExit('a demo line ran')\nprint(shard_range(10, 0, 4))\n"
    module = load_tasks(_write(tmp_path, nb))
    assert module.__load_report__.complete


def test_magics_in_the_setup_cell_are_ignored(tmp_path):
    nb = _solved_notebook()
    setup = next(c for c in nb["cells"] if "setup" in c["metadata"].get("tags", []))
    setup["source"] = "%load_ext kit\n!echo hi\n" + setup["source"]
    module = load_tasks(_write(tmp_path, nb))
    assert "setup" not in module.__load_report__.missing


def test_missing_file_names_the_path():
    with pytest.raises(NotebookError, match="no such notebook: nowhere/00_x.ipynb"):
        load_tasks("nowhere/00_x.ipynb")


def test_broken_json_names_the_file_and_the_fix(tmp_path):
    path = tmp_path / "00_broken.ipynb"
    path.write_text('{"cells": [')
    with pytest.raises(
        NotebookError, match=r"00_broken.ipynb is not valid notebook JSON.*checkpoint"
    ):
        load_tasks(path)


def test_unknown_lesson_says_how_to_name_the_file(tmp_path):
    path = shutil.copy(LESSON, tmp_path / "homework.ipynb")
    with pytest.raises(NotebookError, match="NN_slug.ipynb"):
        load_tasks(path)
    module = load_tasks(path, lesson=0)
    assert module.__load_report__.complete


def test_a_helper_the_student_wrote_in_another_cell_is_loaded_without_running_demos(tmp_path):
    nb = _solved_notebook()
    cell = _task_cell(nb, "0.1")
    cell["source"] = ("def shard_range(n, rank, world_size):\n"
                      "    return range(*_bounds(n, rank, world_size))\n")
    helper = {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
              "source": "OFFSET = 0\n\ndef _bounds(n, rank, world_size):\n"
                        "    base, extra = divmod(n, world_size)\n"
                        "    start = OFFSET + rank * base + min(rank, extra)\n"
                        "    return start, start + base + (rank < extra)\n\n"
                        "raise SystemExit('a demo line ran')\n"}
    nb["cells"].insert(nb["cells"].index(cell), helper)
    module = load_tasks(_write(tmp_path, nb))
    report = module.__load_report__
    assert report.complete, str(report)
    assert list(module.shard_range(10, 1, 4)) == [3, 4, 5]
    assert any("_bounds" in note for note in report.notes)
    assert any("OFFSET" in note for note in report.notes)
