"""The real nbgrader round trip: kit course -> nbgrader generate_assignment -> students submit
-> nbgrader autograde -> the gradebook gives full marks to a solved notebook, zero to an
untouched one, and partial credit where a task passes some of its cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_nbgrader

from autograder.build import main_course, source_notebook
from autograder.registry import lesson_tasks

ROOT = Path(__file__).resolve().parents[1]
NAME = "00_launching_ranks"

# Task 0.2 solved the typical wrong way: it passes 1 of its 4 cases (0.75 of 3 points).
MEAN_OF_MEANS = '''def global_mean(local: torch.Tensor) -> torch.Tensor:
    mean = local.mean()
    dist.all_reduce(mean)
    return mean / dist.get_world_size()
'''


def _submit(course: Path, student: str, nb: dict) -> None:
    folder = course / "submitted" / student / NAME
    folder.mkdir(parents=True)
    (folder / f"{NAME}.ipynb").write_text(json.dumps(nb, indent=1))


@pytest.mark.slow
def test_autograde_gives_full_zero_and_partial_marks(tmp_path):
    course = tmp_path / "course"
    assert main_course([str(course), "--root", str(ROOT), "--lessons", "00"]) == 0
    run_nbgrader(course, "generate_assignment", NAME, "--force")

    release = json.loads((course / "release" / NAME / f"{NAME}.ipynb").read_text())
    built = json.loads((ROOT / "lessons" / f"{NAME}.ipynb").read_text())
    # nbgrader's own release and kit build's lessons/ are the same notebook.
    assert [(c["id"], c["source"], c["metadata"]) for c in release["cells"]] == \
        [(c["id"], c["source"], c["metadata"]) for c in built["cells"]]

    solutions = {c.id: c.source for c in source_notebook(ROOT / "solutions" / f"{NAME}.py").cells}
    solved = json.loads(json.dumps(release))
    partial = json.loads(json.dumps(release))
    for nb in (solved, partial):
        for cell in nb["cells"]:
            if cell["id"].startswith("task-"):
                cell["source"] = solutions[cell["id"]]
    next(c for c in partial["cells"] if c["id"] == "task-0-2")["source"] = MEAN_OF_MEANS
    _submit(course, "solved", solved)
    _submit(course, "untouched", release)
    _submit(course, "partial", partial)

    run_nbgrader(course, "autograde", NAME, "--force")

    from nbgrader.api import Gradebook

    total = sum(t.points for t in lesson_tasks(0))
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        scores = {s: gb.find_submission(NAME, s).score for s in ("solved", "untouched", "partial")}
        assert gb.find_submission(NAME, "solved").max_score == total
        partial_cells = {g.name: g.score for g in gb.find_submission_notebook(NAME, NAME, "partial").grades}
    assert scores == {"solved": total, "untouched": 0, "partial": pytest.approx(2 + 0.75)}
    assert partial_cells["check-0-1"] == 2 and partial_cells["check-0-2"] == pytest.approx(0.75)
