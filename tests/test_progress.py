"""``kit progress`` / ``kit.progress()``: a learner's folder with a solved task, a seeded bug,
an untouched lesson, a missing lesson and a broken notebook, shown task by task; results are
remembered by the task cell's source, so only changed tasks run again; nothing in the folder is
written."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import ROOT

import autograder.progress as progress_module
from autograder import course
from autograder.build import source_notebook
from autograder.progress import course_progress, default_cache, find_notebooks, main

MEAN_OF_MEANS = '''def global_mean(local: torch.Tensor) -> torch.Tensor:
    mean = local.mean()
    dist.all_reduce(mean)
    return mean / dist.get_world_size()
'''
LESSONS = [0, 1, 2, 4]


def _release(name: str) -> dict:
    return json.loads((ROOT / "lessons" / f"{name}.ipynb").read_text())


def _with_tasks(name: str, edits: dict[str, str]) -> dict:
    """The released notebook with its task cells solved, except ``edits`` (cell id -> source)."""
    nb = _release(name)
    solutions = {c.id: c.source for c in source_notebook(ROOT / "solutions" / f"{name}.py").cells}
    for cell in nb["cells"]:
        if cell["id"].startswith("task-"):
            cell["source"] = edits.get(cell["id"], solutions[cell["id"]])
    return nb


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "course" / "lessons"
    folder.mkdir(parents=True)
    (folder / f"{course.lesson(0).stem}.ipynb").write_text(
        json.dumps(_with_tasks(course.lesson(0).stem, {"task-0-2": MEAN_OF_MEANS}), indent=1))
    (folder / f"{course.lesson(1).stem}.ipynb").write_text(
        json.dumps(_release(course.lesson(1).stem), indent=1))
    # no Lesson 02 notebook: not started
    (folder / f"{course.lesson(4).stem}.ipynb").write_text('{"cells": [ this is not JSON')
    return folder.parent


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _states(report) -> dict[str, tuple[str, float]]:
    return {t.task_id: (t.state, t.score) for lp in report.lessons for t in lp.tasks}


@pytest.fixture
def counted_runs(monkeypatch):
    """How many tasks' checks really ran."""
    calls: list[str] = []
    real = progress_module._check

    def counting(task, impl, seed):
        calls.append(task.id)
        return real(task, impl, seed)

    monkeypatch.setattr(progress_module, "_check", counting)
    return calls


def test_a_mixed_folder_task_by_task_and_what_to_do_next(tmp_path, counted_runs):
    folder = _folder(tmp_path)
    cache = tmp_path / "memory" / "progress.json"
    before = _snapshot(folder)
    report = course_progress(folder, lessons=LESSONS, cache=cache)
    states = _states(report)
    assert states["0.1"] == ("passed", 2.0)
    assert states["0.2"] == ("failed", 0.75)
    assert {s for tid, (s, _) in states.items() if tid.startswith("1.")} == {"not implemented"}
    assert {s for tid, (s, _) in states.items() if tid.startswith(("2.", "4."))} == {"not started"}
    lesson = {lp.lesson: lp for lp in report.lessons}
    assert lesson[2].notebook is None
    assert "cannot be read" in lesson[4].problem
    assert report.score == 2.75
    assert report.max_score == sum(t.max_score for lp in report.lessons for t in lp.tasks) > 2.75
    # the first task that does not pass, in lesson order, with the check it fails
    nxt = report.next_step()
    assert nxt.startswith(
        f"Task 0.2 `global_mean` in lessons/{course.lesson(0).stem}.ipynb: fails '"
    ), nxt
    table = report.table()
    assert "not implemented" in table and "not started" in table and "next: Task 0.2" in table
    assert "total: 2.75/" in table
    page = report._repr_html_()
    assert page.count("Lesson 0") == len(LESSONS) and "width:" in page  # a bar per lesson
    # nothing the learner wrote changed, and nothing was written into the folder
    assert _snapshot(folder) == before
    assert cache.is_file()
    assert sorted(counted_runs) == ["0.1", "0.2"] + [t for t in states if t.startswith("1.")]


def test_only_changed_task_cells_run_again(tmp_path, counted_runs):
    folder = _folder(tmp_path)
    cache = tmp_path / "progress.json"
    first = course_progress(folder, lessons=[0, 1], cache=cache)
    ran_first = len(counted_runs)
    again = course_progress(folder, lessons=[0, 1], cache=cache)
    assert len(counted_runs) == ran_first, "nothing changed, so nothing may run again"
    assert again.ran == 0 and again.remembered == ran_first
    assert _states(again) == _states(first)
    # the learner fixes Task 0.2: only its checks run, and it now passes
    nb = folder / "lessons" / f"{course.lesson(0).stem}.ipynb"
    nb.write_text(json.dumps(_with_tasks(course.lesson(0).stem, {}), indent=1))
    fixed = course_progress(folder, lessons=[0, 1], cache=cache)
    assert counted_runs[ran_first:] == ["0.2"]
    assert _states(fixed)["0.2"] == ("passed", 3.0)
    assert fixed.next_step().startswith("Task 1.1 ")
    # a changed check forgets what it judged: the fingerprint covers the checks' source
    assert progress_module._checks_fingerprint(0) != progress_module._checks_fingerprint(1)


def test_cached_runs_nothing_and_says_what_changed(tmp_path, counted_runs):
    folder = _folder(tmp_path)
    report = course_progress(folder, lessons=[0], cache=tmp_path / "empty.json", run=False)
    assert counted_runs == []
    assert all(t.state == "failed" and "changed since" in t.detail for t in report.lessons[0].tasks)


def test_the_command(tmp_path, capsys, monkeypatch):
    folder = _folder(tmp_path)
    monkeypatch.setenv("KIT_PROGRESS_CACHE", str(tmp_path / "cli.json"))
    assert main([str(folder), "--lessons", "00,02"]) == 0
    out = capsys.readouterr().out
    assert "0.2" in out and "failed" in out and "not started" in out and "next: Task 0.2" in out
    assert main([str(folder), "--lessons", "00", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["score"] == 2.75 and data["lessons"][0]["tasks"][1]["remembered"] is True
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_notebooks_are_found_where_courses_put_them(tmp_path, monkeypatch):
    (tmp_path / course.lesson(5).stem).mkdir()  # nbgrader's release layout
    (tmp_path / course.lesson(5).stem / f"{course.lesson(5).stem}.ipynb").write_text("{}")
    (tmp_path / f"{course.lesson(0).stem}.ipynb").write_text("{}")
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / ".ipynb_checkpoints" / f"{course.lesson(1).stem}-checkpoint.ipynb").write_text("{}")
    found = find_notebooks(tmp_path)
    assert {k: v.relative_to(tmp_path).as_posix() for k, v in found.items()} == {
        0: f"{course.lesson(0).stem}.ipynb",
        5: f"{course.lesson(5).stem}/{course.lesson(5).stem}.ipynb"}
    monkeypatch.delenv("KIT_PROGRESS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache() == tmp_path / "xdg" / "kit" / "progress.json"


def test_kit_progress_in_a_notebook_is_the_same_report(tmp_path):
    import kit

    report = kit.progress(_folder(tmp_path), lessons=[2], cache=tmp_path / "m.json")
    assert [t.state for t in report.lessons[0].tasks] == ["not started"] * len(
        report.lessons[0].tasks
    )
    assert report.next_step().startswith("Start Lesson 02")
