"""Every registered check can fail: it passes on the solution, fails on the stub and on every
seeded bug. Parametrized over all tasks of all lessons, so a new lesson is covered by adding
its source, its checks and its seeded bugs (tests/bugs/lessonNN.py).

Also: what check() shows a student and how nbgrader reads its score.
"""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import SOURCES, caught_by, seeded_bugs, solutions, stubs
from hypothesis import given
from hypothesis import strategies as st
from nbformat.v4 import new_code_cell, new_output
from nbgrader.utils import determine_grade

from autograder.checking import ERROR, FAILED, NOT_IMPLEMENTED, PASSED, check, run_checks
from autograder.registry import get_task, lesson_tasks

CHECKED_LESSONS = sorted(SOURCES)  # the spec's lessons (a check module without one fails below)
TASK_IDS = [t.id for lesson in CHECKED_LESSONS for t in lesson_tasks(lesson)]


def test_every_lesson_registers_tasks():
    assert TASK_IDS, "no task is registered"
    for lesson in SOURCES:
        assert lesson_tasks(lesson), f"solutions/ has lesson {lesson:02d} but it registers no task"


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_solution_passes_every_case(task_id):
    task = get_task(task_id)
    module = solutions(task.lesson)
    assert task.id in module.__load_report__.found, str(module.__load_report__)
    report = run_checks(task_id, getattr(module, task.name))
    assert report.passed, report.to_text()
    assert report.score == pytest.approx(task.points)


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_stub_fails_as_not_implemented(task_id):
    task = get_task(task_id)
    report = run_checks(task_id, getattr(stubs(task.lesson), task.name))
    assert report.score == 0
    assert report.status == NOT_IMPLEMENTED, report.to_text()
    assert f"Task {task_id}:" in report.cases[0].message


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_every_seeded_bug_fails(task_id):
    task = get_task(task_id)
    bugs = seeded_bugs(task.lesson).get(task_id, [])
    assert bugs, \
        f"task {task_id} has no seeded bug: add one to tests/bugs/lesson{task.lesson:02d}.py"
    for description, impl in bugs:
        # the first failing case proves the bug is caught; what each case then says of a bug is
        # tested case by case (tests/test_feedback*.py, the lessons' own tests)
        report = run_checks(task_id, impl, stop_at_failure=True)
        assert report.cases and report.cases[-1].status != PASSED
        assert not report.passed, f"seeded bug {description!r} of task {task_id} passes every check"
        assert report.status != NOT_IMPLEMENTED
        assert report.score < task.points
        # a bug with the right values: every case before the measurement that catches it passed
        words = caught_by(task.lesson).get(description)
        assert words is None or words in report.cases[-1].name, \
            f"seeded bug {description!r} of task {task_id} should first fail on {words!r}, " \
            f"but first failed on {report.cases[-1].name!r}"


@pytest.mark.parametrize("lesson", CHECKED_LESSONS)
def test_caught_by_names_seeded_bugs(lesson):
    named = {description for entries in seeded_bugs(lesson).values() for description, _ in entries}
    assert set(caught_by(lesson)) <= named


@pytest.mark.parametrize("lesson", CHECKED_LESSONS)
def test_seeded_bugs_name_registered_tasks(lesson):
    registered = {t.id for t in lesson_tasks(lesson)}
    assert set(seeded_bugs(lesson)) <= registered


# --------------------------------------------------------------------------- what students see


def _global_mean_of_means():
    return dict(seeded_bugs(0)["0.2"])["averages the per-rank means"]


def test_mean_of_means_gets_partial_credit_with_expected_got_and_hint():
    report = run_checks("0.2", _global_mean_of_means())
    # Equal shards hide the bug; uneven, empty and 2-D shards expose it.
    assert [c.status for c in report.cases] == ["passed", FAILED, FAILED, FAILED]
    assert report.score == pytest.approx(0.75)
    uneven = report.cases[1]
    assert uneven.expected is not None and uneven.got is not None and uneven.expected != uneven.got
    assert "count" in uneven.hint


def test_nbgrader_reads_the_report_as_the_cells_partial_score():
    report = run_checks("0.2", _global_mean_of_means())
    cell = new_code_cell("check('0.2', global_mean)", metadata={"nbgrader": {
        "grade": True, "solution": False, "points": 3, "grade_id": "check-0-2"}})
    cell.outputs = [new_output("execute_result", data={"text/plain": repr(report),
                                                      "text/html": report._repr_html_()},
                               execution_count=1)]
    assert determine_grade(cell) == (pytest.approx(0.75), 3.0)


def test_html_feedback_escapes_and_shows_every_case():
    report = run_checks("0.1", dict(seeded_bugs(0)["0.1"])["gives the remainder to the last ranks"])
    page = report._repr_html_()
    for case in report.cases:
        assert case.name in page
    assert "expected" in page and "Hint:" in page
    assert "<script" not in page


def test_check_prints_text_feedback_in_a_terminal(capsys):
    report = check("0.1", dict(seeded_bugs(0)["0.1"])["stops one item early (off by one)"])
    out = capsys.readouterr().out
    assert out.startswith("Task 0.1 shard_range:")
    assert "[FAIL]" in out and "expected:" in out and "got:" in out
    assert repr(report) == repr(round(report.score, 6))


def _noisy_shard_range(n, rank, world_size):
    print("to stderr", file=sys.stderr)
    os.write(2, b"to fd 2\n")
    raise NotImplementedError("Task 0.1: not yet")


def test_check_never_writes_to_stderr(capfd):
    report = check("0.1", _noisy_shard_range)
    captured = capfd.readouterr()
    assert captured.err == ""
    assert "to stderr" in captured.out and "to fd 2" in captured.out
    assert report.status == NOT_IMPLEMENTED


def test_stub_feedback_says_not_implemented_and_runs_once():
    calls = []

    def stub(n, rank, world_size):
        calls.append(n)
        raise NotImplementedError("Task 0.1: Return the contiguous range")

    report = run_checks("0.1", stub)
    assert len(calls) == 1
    assert "not implemented yet" in report.to_text()
    assert "Task 0.1: Return the contiguous range" in report.to_text()


def test_student_exception_shows_the_students_frame_not_the_graders():
    def shard_range(n, rank, world_size):
        return range(n // (world_size - world_size))

    report = run_checks("0.1", shard_range)
    case = report.cases[0]
    assert case.status == ERROR
    assert case.message.startswith("raised ZeroDivisionError")
    assert "return range(n // (world_size - world_size))" in case.details
    assert "autograder" not in case.details and "checking.py" not in case.details


def _crash_on_rank_1(local):
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return local.mean()


def test_a_crashing_rank_is_reported_by_rank():
    report = run_checks("0.2", _crash_on_rank_1)
    assert report.score == 0
    first = report.cases[0]
    assert first.status == ERROR
    assert "rank 1" in first.message and "ValueError" in first.message


def test_not_a_function_gets_a_friendly_message():
    report = run_checks("0.1", None)
    assert report.score == 0
    assert "run the cell that defines shard_range first" in report.cases[0].message


def test_unknown_task_id_names_the_known_ones():
    with pytest.raises(KeyError, match=re.escape("known tasks")):
        check("0.99", lambda: None)


# --------------------------------------------------------------------------- the oracles


@given(st.integers(0, 5000), st.integers(1, 64))
def test_reference_shard_range_is_a_balanced_exact_cover(n, world_size):
    from autograder.references.lesson00 import shard_range

    shards = [shard_range(n, r, world_size) for r in range(world_size)]
    assert [i for s in shards for i in s] == list(range(n))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the extra items go to the first ranks


def test_expected_global_mean_is_the_mean_of_the_concatenation():
    from autograder.lesson00 import local_blocks
    from autograder.references.lesson00 import mean_in_one_process

    shapes = [(4,), (0,), (7,)]
    blocks = local_blocks(3, shapes)
    want = torch.cat(blocks).double().mean().item()
    assert mean_in_one_process(3, shapes) == pytest.approx([want] * 3)
    assert blocks[1].numel() == 0


def test_global_mean_case_runs_a_loaded_function_on_spawned_ranks():
    # Where fork is unsafe (macOS, CUDA in the kernel) ranks are spawned: the case's rank
    # function and the loaded task must then be importable in a fresh interpreter.
    import kit
    from autograder.lesson00 import _mean_on_rank
    from autograder.references.lesson00 import mean_in_one_process

    shapes = [(3,), (0,)]
    impl = solutions(0).global_mean
    got = kit.launch(_mean_on_rank, impl, 5, shapes, world_size=2, start_method="spawn",
                     timeout=120)
    assert [float(x) for x in got] == pytest.approx(mean_in_one_process(5, shapes))


# --------------------------------------------------------------------------- hint levels


@pytest.fixture
def fresh_hint_levels(monkeypatch):
    from autograder import checking

    monkeypatch.setattr(checking, "_failed_checks", {})
    return checking


def _off_by_one():
    return dict(seeded_bugs(0)["0.1"])["stops one item early (off by one)"]


def test_first_failure_shows_the_concept_and_the_second_the_recipe(fresh_hint_levels, capsys):
    first = check("0.1", _off_by_one())
    failing = [c for c in first.cases if c.status == FAILED]
    assert failing and all(c.hint and not c.recipe for c in failing)
    assert 'hint="recipe"' in first.note and 'hint="recipe"' in capsys.readouterr().out
    second = check("0.1", _off_by_one())
    assert all(c.recipe and c.recipe != c.hint for c in second.cases if c.status == FAILED)
    text = second.to_text()
    assert "hint:" in text and "recipe:" in text and "Recipe:" in second._repr_html_()
    assert second.score == first.score  # the hint level never changes the points


def test_asking_for_the_recipe_shows_it_on_the_first_failure(fresh_hint_levels, capsys):
    report = check("0.1", _off_by_one(), hint="recipe")
    assert all(c.recipe for c in report.cases if c.status == FAILED) and not report.note
    with pytest.raises(ValueError, match="recipe"):
        check("0.1", _off_by_one(), hint="solution")


def test_a_pass_or_a_stub_does_not_count_as_a_failed_try(fresh_hint_levels, capsys):
    check("0.1", _off_by_one())
    check("0.1", solutions(0).shard_range)  # passing starts the count again
    assert fresh_hint_levels.hint_level("0.1") == "concept"
    check("0.1", stubs(0).shard_range)  # the untouched stub is not an attempt
    assert fresh_hint_levels.hint_level("0.1") == "concept"
    assert all(not c.recipe for c in check("0.1", _off_by_one()).cases)


def test_run_checks_for_batch_feedback_carries_concept_and_recipe(fresh_hint_levels):
    report = run_checks("0.2", _global_mean_of_means())
    failing = [c for c in report.cases if c.status == FAILED]
    assert failing and all(c.hint and c.recipe for c in failing)
    assert all(c["recipe"] for c in report.to_dict()["cases"] if c["status"] == FAILED)


def _solution_code(lesson: int) -> str:
    source = SOURCES[lesson].read_text()
    blocks = re.findall(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", source, re.S)
    lines = [re.sub(r"\s+#.*$", "", line).strip() for b in blocks for line in b.splitlines()]
    return " ".join(" ".join(line for line in lines if line and not line.startswith("#")).split())


@pytest.mark.parametrize("lesson", sorted(SOURCES))
def test_every_task_has_a_concept_hint_and_a_separate_recipe(lesson):
    for t in lesson_tasks(lesson):
        assert t.hint and t.recipe and t.hint != t.recipe, t.id
        for c in t.cases:  # a case without its own falls back to the task's
            assert c.hint and c.recipe and c.hint != c.recipe, (t.id, c.name)


@pytest.mark.parametrize("lesson", sorted(SOURCES))
def test_no_hint_or_recipe_quotes_the_solution(lesson):
    from difflib import SequenceMatcher

    code = _solution_code(lesson)
    for t in lesson_tasks(lesson):
        assert t.hint, f"task {t.id} has no hint"
        texts = [t.hint, t.recipe] + [x for c in t.cases for x in (c.hint, c.recipe)]
        for text in texts:
            text = " ".join(text.split())
            m = SequenceMatcher(None, text, code, autojunk=False).find_longest_match(
                0, len(text), 0, len(code))
            quoted = text[m.a:m.a + m.size].strip()
            # 24 characters of the solution's code, unless it is one name (an attribute the
            # task's contract names, like require_backward_grad_sync)
            assert m.size < 24 or re.fullmatch(r"[\w.]+(\(\))?", quoted), (t.id, quoted)
