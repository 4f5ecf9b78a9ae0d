"""kit run executes notebooks headless and names the failing cell; kit grade scores a notebook
per task and writes JSON; Lesson 00 runs end to end with its solutions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest
from conftest import executed_lesson
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from autograder import course
from autograder.grade.notebook import main as grade_main
from kit.runner import main as run_main
from kit.runner import run_notebook

LESSON00_SOURCE = course.lesson(0).source
LESSON00 = course.lesson(0).notebook


def _notebook(tmp_path: Path, *sources: str) -> Path:
    nb = new_notebook(cells=[new_markdown_cell("# a test notebook")] +
                      [new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    return path


def test_run_reports_the_failing_cell_with_its_error(tmp_path, capsys):
    path = _notebook(tmp_path, "x = 1", "def f():\n    return 1 / 0\n\nf()", "print('never')")
    assert run_main([str(path), "-o", str(tmp_path / "out.ipynb")]) == 1
    err = capsys.readouterr().err
    assert "cell 3 (def f():) failed: ZeroDivisionError: division by zero" in err
    assert "return 1 / 0" in err  # the traceback, without colour codes
    assert "\x1b[" not in err.split("failed:", 1)[1]
    assert "FAILED at cell 3" in err and "[  1/3] cell 2" in err
    executed = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    assert executed.cells[1].outputs == [] and executed.cells[2].outputs[0].output_type == "error"


def test_run_reports_a_cell_timeout(tmp_path):
    path = _notebook(tmp_path, "import time\ntime.sleep(30)")
    result = run_notebook(path, timeout=2)
    assert result.failure is not None and result.failure.kind == "timeout"
    assert "did not finish within 2 s" in result.failure.summary


def test_run_succeeds_and_never_overwrites_its_input(tmp_path, capsys):
    path = _notebook(tmp_path, "print('ok')")
    before = path.read_text()
    assert run_main([str(path), "-q"]) == 0
    assert "all 1 code cells ran" in capsys.readouterr().out
    assert run_main([str(path), "-o", str(path)]) == 2
    assert path.read_text() == before


@pytest.mark.parametrize(("name", "content", "message"), [
    ("missing.ipynb", None, "no such notebook"),
    ("broken.ipynb", '{"cells": [', "cannot be read as a notebook"),
    ("notes.txt", "hello", "expected a .ipynb notebook or a .py lesson source"),
])
def test_run_rejects_bad_input_with_a_clear_message(tmp_path, capsys, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    assert run_main([str(path)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_lesson00_runs_headless_with_its_solutions_in_under_two_minutes():
    result = executed_lesson(LESSON00_SOURCE)  # the run tests/test_lesson00_by_hand.py reads too
    assert result.ok, str(result.failure)
    assert result.seconds < 120, f"Lesson 00 took {result.seconds:.0f} s"
    outputs = [o for c in result.notebook.cells for o in c.get("outputs", [])]
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "LaunchError:" in printed and "corrupt batch" in printed  # the crash demo was caught
    assert "LaunchTimeout" in printed  # so did the hang demo
    # Nothing reached stderr: nbgrader would zero a graded cell that shows it.
    assert {o.name for o in outputs if o.output_type == "stream"} == {"stdout"}
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the figure


def test_grade_scores_the_untouched_lesson_zero_and_writes_json(tmp_path, capsys):
    out = tmp_path / "grade.json"
    assert grade_main([str(LESSON00), "--unsandboxed", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "0.1   shard_range" in table and "not implemented" in table and "total" in table
    report = json.loads(out.read_text())
    assert report["score"] == 0 and report["max_score"] == 5
    assert [t["task"] for t in report["tasks"]] == ["0.1", "0.2"]


def test_grade_scores_the_solutions_full_marks(capsys):
    assert grade_main([str(LESSON00_SOURCE), "--unsandboxed", "--json", "-"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{"):])
    assert report["score"] == report["max_score"] == 5
    assert all(t["status"] == "passed" for t in report["tasks"])


def test_grade_reports_a_missing_task_and_takes_the_lesson_from_an_option(tmp_path, capsys):
    nb = json.loads(LESSON00.read_text())
    nb["cells"] = [c for c in nb["cells"] if c["id"] != "task-0-2"]
    path = tmp_path / "alice.ipynb"
    path.write_text(json.dumps(nb))
    assert grade_main([str(path), "--unsandboxed", "--json", str(tmp_path / "a.json")]) == 2
    assert "pass --lessons 00" in capsys.readouterr().err
    assert (
        grade_main(
            [str(path), "--unsandboxed", "--lessons", "00", "--json", str(tmp_path / "a.json")]
        )
        == 0
    )
    assert "missing 0.2: global_mean" in capsys.readouterr().out
    task = json.loads((tmp_path / "a.json").read_text())["tasks"][1]
    assert task["score"] == 0 and task["status"] == "missing"
    assert "could not load it from the notebook" in task["cases"][0]["message"]


def test_grade_never_overwrites_the_submission(tmp_path, capsys):
    path = shutil.copy(LESSON00, tmp_path / f"{course.lesson(0).stem}.ipynb")
    before = Path(path).read_text()
    assert grade_main([str(path), "--unsandboxed", "--json", str(path)]) == 2
    assert Path(path).read_text() == before
