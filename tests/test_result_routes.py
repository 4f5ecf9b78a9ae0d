"""One notebook, one grade: every route that grades gives each task the same status and points.

Six Lesson 00 notebooks (solved, untouched, a seeded bug, a task deleted, a task cell that
raises at import, a task that calls the student's helper from a cell the student added, next
to demo code that must never run when grading) are graded through

1. ``check()``: what a student's check cell runs, on the code the notebook defines;
2. ``kit grade NOTEBOOK`` (in this process, JSON report);
3. ``kit grade --out`` (the sandboxed batch);
4. nbgrader's ``generate_assignment`` + ``autograde`` (points only: nbgrader has no statuses),
   whose release must be exactly the ``lessons/`` notebook ``kit build`` wrote, and which
   runs no demo code: its graded notebooks show every demo cell as submitted, marked not run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import ROOT, run_nbgrader
from grading_support import need_grading_sandbox

from autograder import course as course_spec
from autograder.build import main_course, source_notebook
from autograder.checking import run_checks
from autograder.grade.notebook import main as grade_main
from autograder.grade.reports import run_batch
from autograder.loading import load_tasks
from autograder.registry import lesson_tasks
from autograder.results import unloaded

NAME = course_spec.lesson(0).stem
MEAN_OF_MEANS = '''def global_mean(local: torch.Tensor) -> torch.Tensor:
    mean = local.mean()
    dist.all_reduce(mean)
    return mean / dist.get_world_size()
'''
RENAMED = "def global_average(local):\n    return local.mean()\n"
# The definition itself raises when the cell runs (a default evaluated at definition time).
RAISES_AT_IMPORT = "def shard_range(n, rank, world_size=1 // 0):\n    return range(n)\n"
# A cell the student added before task 0.2: a helper the task calls, then demo code that fails
# the whole notebook's grading if any route runs it (all of Lesson 00's ranks would hang on it).
HELPER_CELL = """def _sum_and_count(local):
    total = torch.stack([local.sum(dtype=torch.float64),
                         torch.tensor(local.numel(), dtype=torch.float64, device=local.device)])
    dist.all_reduce(total)
    return total

WORLD = 4
raise SystemExit("demo code ran while grading")
"""
USES_HELPER = ("def global_mean(local):\n    total = _sum_and_count(local)\n"
               "    return (total[0] / total[1]).to(local.dtype)\n")

# notebook -> task -> (status, points) every route must give
FULL = {t.id: t.points for t in course_spec.lesson(0).tasks}  # full marks, from the spec
EXPECTED = {
    "solved": {"0.1": ("passed", FULL["0.1"]), "0.2": ("passed", FULL["0.2"])},
    "untouched": {"0.1": ("not implemented", 0.0), "0.2": ("not implemented", 0.0)},
    "seeded_bug": {"0.1": ("passed", FULL["0.1"]), "0.2": ("failed", 0.75)},
    "task_missing": {"0.1": ("passed", FULL["0.1"]), "0.2": ("missing", 0.0)},
    "crash_at_import": {"0.1": ("error", 0.0), "0.2": ("passed", FULL["0.2"])},
    "helper_in_added_cell": {"0.1": ("passed", FULL["0.1"]), "0.2": ("passed", FULL["0.2"])},
}


def _notebooks(folder: Path) -> dict[str, Path]:
    release = json.loads((ROOT / "lessons" / f"{NAME}.ipynb").read_text())
    solutions = {c.id: c.source for c in source_notebook(ROOT / "solutions" / f"{NAME}.py").cells}
    edits = {"solved": {}, "untouched": None, "seeded_bug": {"task-0-2": MEAN_OF_MEANS},
             "task_missing": {"task-0-2": RENAMED},
             "crash_at_import": {"task-0-1": RAISES_AT_IMPORT},
             "helper_in_added_cell": {"task-0-2": USES_HELPER}}
    paths = {}
    for student, edit in edits.items():
        nb = json.loads(json.dumps(release))
        if edit is not None:
            for cell in nb["cells"]:
                if cell["id"].startswith("task-"):
                    cell["source"] = edit.get(cell["id"], solutions[cell["id"]])
        if student == "helper_in_added_cell":  # a new cell, as JupyterLab adds it: no tags
            at = next(i for i, c in enumerate(nb["cells"]) if c["id"] == "task-0-2")
            nb["cells"].insert(at, {"cell_type": "code", "id": "added-by-student", "metadata": {},
                                    "execution_count": None, "outputs": [], "source": HELPER_CELL})
        paths[student] = (
            folder / "submitted" / student / NAME / f"{NAME}.ipynb"
        )  # nbgrader's layout
        paths[student].parent.mkdir(parents=True)
        paths[student].write_text(json.dumps(nb, indent=1))
    return paths


def _text(value: str | list[str]) -> str:
    """A notebook's text field: a string, or the list of lines nbformat writes."""
    return "".join(value) if isinstance(value, list) else value


def _by_check(path: Path) -> dict[str, tuple[str, float]]:
    """check() on every task the notebook defines; in the notebook, a task whose cell failed or
    defines nothing never reaches check() (its check cell raises NameError)."""
    module = load_tasks(path)
    missing = module.__load_report__.missing
    reports = [
        unloaded(t, missing[t.id]) if t.id in missing else run_checks(t.id, getattr(module, t.name))
        for t in lesson_tasks(0)
    ]
    return {r.task_id: (r.status, r.score) for r in reports}


def _by_kit_grade(path: Path, tmp: Path) -> dict[str, tuple[str, float]]:
    out = tmp / f"{path.parent.name}.json"
    assert grade_main([str(path), "--unsandboxed", "--json", str(out)]) == 0
    return {t["task"]: (t["status"], t["score"]) for t in json.loads(out.read_text())["tasks"]}


@pytest.mark.slow
def test_every_route_gives_the_same_status_and_points(tmp_path):
    need_grading_sandbox()
    notebooks = _notebooks(tmp_path / "submissions")
    routes = {"check()": {s: _by_check(p) for s, p in notebooks.items()},
              "kit grade NOTEBOOK": {s: _by_kit_grade(p, tmp_path) for s, p in notebooks.items()}}

    out = tmp_path / "batch"
    assert (
        run_batch(
            [str(tmp_path / "submissions" / "submitted")], out=out, lessons=[0], workers=2, seed=0
        )
        == 0
    )
    routes["kit grade --out"] = {
        s: {t["task"]: (t["status"], t["score"]) for t in json.loads(
            (out / "records" / f"{s}.json").read_text())["tasks"]} for s in notebooks}

    for route, grades in routes.items():
        for student, want in EXPECTED.items():
            got = {tid: (status, pytest.approx(points)) for tid, (status, points) in want.items()}
            assert grades[student] == got, f"{route} grades {student} differently"

    course = tmp_path / "course"
    assert main_course([str(course), "--root", str(ROOT), "--lessons", "00"]) == 0
    run_nbgrader(course, "generate_assignment", NAME, "--force")
    release = json.loads((course / "release" / NAME / f"{NAME}.ipynb").read_text())
    built = json.loads((ROOT / "lessons" / f"{NAME}.ipynb").read_text())
    # nbgrader's own release and kit build's lessons/ are the same notebook.
    assert [(c["id"], c["source"], c["metadata"]) for c in release["cells"]] == \
        [(c["id"], c["source"], c["metadata"]) for c in built["cells"]]
    for student, path in notebooks.items():
        folder = course / "submitted" / student / NAME
        folder.mkdir(parents=True)
        shutil.copy(path, folder / f"{NAME}.ipynb")
    run_nbgrader(course, "autograde", NAME, "--force")

    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        for student, want in EXPECTED.items():
            cells = {
                g.name: g.score
                for g in gb.find_submission_notebook(NAME, NAME, student).grades
                if g.name.startswith("check-")
            }
            got = {f"0.{name[-1]}": score for name, score in cells.items()}
            assert got == {tid: pytest.approx(points) for tid, (_, points) in want.items()}, \
                f"nbgrader grades {student} differently"

    # autograde ran no demo code, and its graded notebook shows the demo cells as submitted
    graded = json.loads(
        (course / "autograded" / "helper_in_added_cell" / NAME / f"{NAME}.ipynb").read_text()
    )
    submitted = json.loads(notebooks["helper_in_added_cell"].read_text())
    demos = [(c, s) for c, s in zip(graded["cells"], submitted["cells"], strict=True)
             if s["cell_type"] == "code" and not s["metadata"].get("tags")
             and not s["metadata"].get("nbgrader", {}).get("grade_id")]
    assert len(demos) > 5 and any(s["id"] == "added-by-student" for _, s in demos)
    for cell, as_submitted in demos:
        assert _text(cell["source"]) == _text(as_submitted["source"])
        text = "".join(_text(o.get("text", "")) for o in cell["outputs"])
        assert "not run by nbgrader autograde" in text and "demo code ran" not in text, cell[
            "outputs"
        ]
