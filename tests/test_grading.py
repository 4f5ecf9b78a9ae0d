"""kit grade on a batch: the adversarial corpus gets exactly the statuses and scores it should.

The corpus (tests/grading_corpus) edits the released Lesson 00 notebook: damaged JSON and
metadata, renamed or missing functions, syntax errors, hangs, memory and fork bombs, exits at
import, fake "passed" output, monkeypatched torch and checks, always-equal objects, writes into
the output folder and floods of output. The whole corpus is graded once, with 2 workers.
"""

from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path

import pytest
import torch
from grading_corpus import CORPUS, write_corpus
from grading_support import need_grading_sandbox

from autograder import course
from autograder.grade.batch import (
    BLOCKED,
    BatchConfig,
    grade_batch,
    grade_submission,
    load_records,
    read_result,
)
from autograder.grade.reports import feedback_text, write_outputs
from autograder.grade.sandbox import Limits
from autograder.grade.submissions import Submission, discover
from autograder.registry import Task

LIMITS = Limits(case_wall_s=12.0, memory=2 << 30, output=1 << 20, file_size=16 << 20)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    need_grading_sandbox()
    root = tmp_path_factory.mktemp("corpus")
    out = root / "out"
    expected = write_corpus(root / "submissions", out)
    before = {p.name: p.read_bytes() for p in (root / "submissions").iterdir()}
    subs = discover([root / "submissions"])
    records = grade_batch(subs, BatchConfig(out, [0], workers=2, limits=LIMITS, seed=1234))
    write_outputs(out, subs, records, gradescope=True)
    return root, out, expected, records, before


@pytest.mark.parametrize("name", list(CORPUS))
def test_adversarial_submission_gets_its_expected_status_and_score(corpus, name):
    _, _, expected, records, _ = corpus
    got = {t["task"]: (t["status"], t["score"]) for t in records[name]["tasks"]}
    want = {
        task: (status, pytest.approx(score)) for task, (status, score) in expected[name].items()
    }
    assert got == want, json.dumps(records[name]["tasks"], indent=1)[:3000]


def test_every_submission_has_exactly_one_row_and_the_files_are_untouched(corpus):
    root, out, expected, records, before = corpus
    rows = list(csv.DictReader((out / "grades.csv").open()))
    assert sorted(r["student"] for r in rows) == sorted(expected)
    for row in rows:
        assert float(row["score"]) == pytest.approx(
            sum(s for _, s in expected[row["student"]].values())
        )
    assert {p.name: p.read_bytes() for p in (root / "submissions").iterdir()} == before


def test_a_submission_writing_into_the_output_folder_changes_no_grade(corpus):
    _, out, _, records, _ = corpus
    on_disk = json.loads((out / "records" / "correct.json").read_text())
    assert on_disk["score"] == records["correct"]["score"] == 5
    assert "writer" not in load_records(
        out, json.loads((out / ".kit-grade" / "secret.json").read_text())["key"]
    )


def test_feedback_and_gradescope_results_say_why_points_were_lost(corpus):
    _, out, _, _, _ = corpus
    text = (out / "feedback" / "infinite_loop.txt").read_text()
    assert (
        "Task 0.1 shard_range: timeout: 5 of 5 checks failed, 0/2 points" in text
        and "did not finish within 12 s" in text
    )
    results = json.loads((out / "gradescope" / "fork_bomb" / "results.json").read_text())
    assert results["score"] == 3 and [t["score"] for t in results["tests"]] == [0, 3]
    assert "processes" in results["tests"][0]["output"] or "signal" in results["tests"][0]["output"]


def test_a_resumed_run_keeps_signed_records_and_regrades_a_changed_submission(corpus, tmp_path):
    root, out, _, records, _ = corpus
    subs = discover([root / "submissions"])
    again = grade_batch(subs, BatchConfig(out, [0], workers=2, limits=LIMITS, seed=1234))
    assert again == {k: v for k, v in records.items()}  # nothing regraded: same records
    (out / "records" / "stub.json").write_text(json.dumps({**records["stub"], "score": 5}))
    assert "stub" not in load_records(
        out, json.loads((out / ".kit-grade" / "secret.json").read_text())["key"]
    )


class Rigged(int):
    """A result whose comparison always succeeds: it must never reach a comparison."""

    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_results_that_are_not_plain_data_are_never_unpickled(tmp_path):
    import pickle

    torch.save(
        {"status": "ok", "data": [torch.tensor([1.0]), {"a": (1, "x", None)}]}, tmp_path / "ok.pt"
    )
    assert read_result(tmp_path / "ok.pt")["data"][1] == {"a": (1, "x", None)}
    for name, data in [("rigged", [Rigged(3)]), ("parameter", torch.nn.Parameter(torch.ones(2)))]:
        with open(tmp_path / f"{name}.pt", "wb") as f:
            pickle.dump({"status": "ok", "data": data}, f)
        torch.save({"status": "ok", "data": data}, tmp_path / f"{name}2.pt")
        for path in (tmp_path / f"{name}.pt", tmp_path / f"{name}2.pt"):
            bad = read_result(path)
            assert bad["status"] == "error" and "not plain data" in bad["message"], (name, bad)


def test_a_case_that_needs_missing_hardware_is_blocked_and_runs_nothing(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    nb = tmp_path / "99_gpu.ipynb"
    nb.write_text("{}")
    gpu = Task("99.1", "fused_kernel", 2.0)
    gpu.case("runs on a GPU", needs="cuda")(lambda impl, seed: 1)
    record = grade_submission(Submission("alice", {99: nb}), [99], [gpu], {}, 0, LIMITS, 0)
    assert record["tasks"][0]["status"] == BLOCKED and record["score"] == 0
    assert "needs cuda" in record["tasks"][0]["cases"][0]["message"]


def test_submission_forms_are_discovered(tmp_path):
    nbgrader = tmp_path / "course" / "submitted"
    for student in ("alice", "bob"):
        (nbgrader / student / "lesson00").mkdir(parents=True)
        (nbgrader / student / "lesson00" / f"{course.lesson(0).stem}.ipynb").write_text("{}")
    assert [s.student for s in discover([tmp_path / "course"])] == ["alice", "bob"]
    gs = tmp_path / "export"
    (gs / "submission_1").mkdir(parents=True)
    (gs / "submission_1" / f"{course.lesson(0).stem}.ipynb").write_text("{}")
    (gs / "submission_metadata.yml").write_text(
        "submission_1:\n  :submitters:\n  - :email: carol@uni.edu\n"
    )
    [carol] = discover([gs])
    assert carol.student == "carol@uni.edu"
    assert carol.notebook_for(0).name == f"{course.lesson(0).stem}.ipynb"
    many = tmp_path / "many"
    many.mkdir()
    for name in ("dan", "eve"):
        (many / f"{name}.ipynb").write_text("{}")
    assert [s.student for s in discover([many])] == ["dan", "eve"]
    with pytest.raises(ValueError, match="two submissions are named"):
        discover([many / "dan.ipynb", many / "dan.ipynb"])
    assert os.path.exists(many / "dan.ipynb")


def test_a_grader_that_cannot_start_records_nothing_and_says_so(tmp_path, monkeypatch, capsys):
    need_grading_sandbox()
    import autograder.grade.batch
    from autograder.grade.notebook import main
    from autograder.grade.sandbox import WorkerExit

    write_corpus(tmp_path / "subs", tmp_path / "out", ["correct"])
    broken = WorkerExit(1, None, None, "IndentationError: expected an indented block", 50, 0.1)
    monkeypatch.setattr(autograder.grade.batch, "run_worker", lambda *a, **k: broken)
    assert main([str(tmp_path / "subs"), "--out", str(tmp_path / "out"), "--lessons", "00"]) == 3
    err = capsys.readouterr().err
    assert "failed before loading correct's notebooks" in err and "IndentationError" in err
    assert not list((tmp_path / "out" / "records").glob("*.json"))
    assert not (tmp_path / "out" / "grades.csv").exists()


def test_out_folder_overlapping_a_submission_is_refused(tmp_path, capsys):
    from autograder.grade.notebook import main

    write_corpus(tmp_path / "subs", tmp_path / "out", ["stub"])
    before = (tmp_path / "subs" / "stub.ipynb").read_bytes()
    assert main([str(tmp_path / "subs"), "--out", str(tmp_path / "subs" / "grades")]) == 2
    assert "overlap" in capsys.readouterr().err
    assert (tmp_path / "subs" / "stub.ipynb").read_bytes() == before
    assert not (tmp_path / "subs" / "grades").exists()


def _solved_submission(folder: Path, lessons, edit=None) -> Path:
    """A student folder holding the built solution notebook of each lesson; ``edit(lesson, nb)``
    may change a notebook (its JSON as a dict) before it is written."""
    from autograder.build import render, source_notebook

    folder.mkdir()
    for lesson in lessons:
        source = course.lesson(lesson).source
        nb = json.loads(render(source_notebook(source)))
        if edit is not None:
            edit(lesson, nb)
        (folder / f"{source.stem}.ipynb").write_text(json.dumps(nb))
    return folder


@pytest.mark.slow
def test_the_solutions_of_every_lesson_get_full_marks_in_the_sandbox(tmp_path):
    """Every lesson's cases run in the worker as they do in a notebook (ranks, spawn, torchrun),
    and a submission split over two workers adds up to the whole of it."""
    need_grading_sandbox()
    lessons = [spec.number for spec in course.LESSONS]
    student = _solved_submission(tmp_path / "alice", lessons)
    # Alone with 2 workers, the submission's lessons are split over both (split_lessons).
    records = grade_batch(
        discover([student]), BatchConfig(tmp_path / "out", lessons, workers=2, seed=3)
    )
    record = records["alice"]
    assert [t["status"] for t in record["tasks"]] == ["passed"] * len(record["tasks"]), \
        feedback_text(record)
    assert record["score"] == record["max_score"] > 0


def test_the_command_grades_a_folder_with_progress_and_every_output(tmp_path, capsys):
    need_grading_sandbox()
    from autograder.grade.notebook import main

    write_corpus(tmp_path / "subs", tmp_path / "out", ["correct", "stub"])
    args = [
        str(tmp_path / "subs"),
        "--out",
        str(tmp_path / "out"),
        "--lessons",
        "00",
        "--gradescope",
    ]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "graded 2 submission(s)" in captured.out and "2/2] graded, 0:00 left, " in captured.err
    assert re.search(r"graded, \d+:\d\d left, [\d.]+ per minute", captured.err), captured.err
    rows = list(csv.DictReader((tmp_path / "out" / "grades.csv").open()))
    assert [(r["student"], r["0.1"], r["0.2"]) for r in rows] == [
        ("correct", "2.0", "3.0"),
        ("stub", "0.0", "0.0"),
    ]
    nbgrader = list(csv.DictReader((tmp_path / "out" / "nbgrader-grades.csv").open()))
    assert [(r["assignment"], r["student_id"], r["score"]) for r in nbgrader] == \
        [("lesson00", "correct", "5.0"), ("lesson00", "stub", "0.0")]
    assert (
        json.loads((tmp_path / "out" / "gradescope" / "stub" / "results.json").read_text())["score"]
        == 0
    )
    assert main(args) == 0  # a second run regrades nothing
    assert "resuming: 2 of 2 submission(s) already graded" in capsys.readouterr().out


def test_a_later_lessons_notebook_cannot_reach_an_earlier_lessons_cases(tmp_path):
    """The worker loads each lesson just before its own cases run: Lesson 01's setup cell, which
    breaks dist.all_reduce for all code loaded after it, leaves Lesson 00's grade alone."""
    need_grading_sandbox()

    def break_all_reduce(lesson: int, nb: dict) -> None:
        if lesson == 1:
            setup = next(c for c in nb["cells"] if c.get("id") == "setup")
            setup["source"] = "".join(setup["source"]) + \
                "\nimport torch.distributed as _dist\n_dist.all_reduce = lambda *a, **k: None\n"

    student = _solved_submission(tmp_path / "bob", (0, 1), edit=break_all_reduce)
    records = grade_batch(discover([student]), BatchConfig(tmp_path / "out", [0, 1], workers=1,
                                                          limits=LIMITS, seed=5))
    status = {t["task"]: t["status"] for t in records["bob"]["tasks"]}
    assert status["0.1"] == status["0.2"] == "passed", feedback_text(records["bob"])
    assert "1.1" in status  # Lesson 01 was loaded and graded (all its cases after Lesson 00's)


def test_one_submission_alone_spreads_its_lessons_over_the_idle_workers(tmp_path, monkeypatch):
    """Alone in a 2-worker batch, a submission's lessons run in two workers at once, each with
    its own slot and its own lessons, and the record is the same as one worker gives."""
    need_grading_sandbox()
    import threading
    import time

    from autograder.grade import batch

    student = _solved_submission(tmp_path / "carol", (0, 1))
    calls, lock, real = [], threading.Lock(), batch.run_worker

    def spy(work, limits, *, slot, **kwargs):
        job = json.loads((work / "job.json").read_text())
        start = time.monotonic()
        try:
            return real(work, limits, slot=slot, **kwargs)
        finally:
            with lock:
                calls.append((slot, [n for n, _ in job["notebooks"]], start, time.monotonic()))

    monkeypatch.setattr(batch, "run_worker", spy)
    split = grade_batch(discover([student]), BatchConfig(tmp_path / "two", [0, 1], workers=2,
                                                        limits=LIMITS, seed=5))["carol"]
    assert sorted(c[0] for c in calls) == [0, 1], calls  # two slots
    assert sorted(c[1] for c in calls) == [[0], [1]], calls  # one lesson each
    (_, _, a0, a1), (_, _, b0, b1) = calls
    assert a0 < b1 and b0 < a1, calls  # the two workers ran at the same time
    calls.clear()
    whole = grade_batch(discover([student]), BatchConfig(tmp_path / "one", [0, 1], workers=1,
                                                        limits=LIMITS, seed=5))["carol"]
    assert [(slot, lessons) for slot, lessons, _, _ in calls] == [(0, [0, 1])]
    assert split["score"] == whole["score"] == split["max_score"] > 0, feedback_text(split)
    assert [t["task"] for t in split["tasks"]] == [t["task"] for t in whole["tasks"]]
    assert [(t["status"], t["score"]) for t in split["tasks"]] == \
        [(t["status"], t["score"]) for t in whole["tasks"]]


def test_split_lessons_balances_the_lessons_and_knows_every_lesson_with_checks():
    from autograder.grade.batch import LESSON_SECONDS, split_lessons

    graded = sorted(int(p.stem[6:]) for p in (Path(__file__).resolve().parents[1] / "autograder")
                    .glob("lesson[0-9][0-9].py"))
    assert sorted(LESSON_SECONDS) == graded  # a new lesson needs its seconds for a fair split
    for parts in (1, 2, 3, 4):
        groups = split_lessons(graded, parts)
        assert sorted(n for g in groups for n in g) == graded and all(
            g == sorted(g) for g in groups
        )
        assert len(groups) == parts
        loads = [sum(LESSON_SECONDS[n] for n in g) for g in groups]
        # longest-first greedy: no group exceeds the ideal share by more than the largest lesson
        assert max(loads) <= sum(loads) / parts + max(LESSON_SECONDS.values()), loads
    assert split_lessons([0, 99], 4) == [[99], [0]]  # an unknown lesson weighs the mean (2.4 s)
    assert split_lessons([], 2) == [] and split_lessons([3], 1) == [[3]]


def test_the_batch_grader_gives_the_same_records_with_the_rank_pool(tmp_path):
    """autograder/pool.py through the sandboxed worker (tests/test_pool.py: case by case)."""
    from autograder.build import render, source_notebook

    need_grading_sandbox()
    lessons = [0, 4]
    for n in lessons:  # a full-marks submission of both lessons
        spec = course.lesson(n)
        folder = tmp_path / "alice"
        folder.mkdir(exist_ok=True)
        (folder / f"{spec.stem}.ipynb").write_text(render(source_notebook(spec.source)))
    records = {}
    for use_pool in (False, True):
        out = tmp_path / f"out-{use_pool}"
        got = grade_batch(discover([tmp_path / "alice"]),
                          BatchConfig(out, lessons, workers=1, limits=Limits(rank_pool=use_pool),
                                      seed=7))
        records[use_pool] = [(t["task"], t["status"], t["score"]) for t in got["alice"]["tasks"]]
    assert records[True] == records[False]
    assert all(status == "passed" for _, status, _ in records[True]), records[True]
