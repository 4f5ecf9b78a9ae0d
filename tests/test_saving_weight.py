"""The saving weighs at least half: in a task whose point is a saving (memory, bytes, FLOPs or
messages per rank), the cases that measure it (``saving=True``, every bound) are worth at least
half of its points, so that right values with the saving thrown away keep at most half.

Every task of Lessons 05 on is classified here, as a saving (what it saves) or not (why not): a
new task must be added to one list, and a saving task that forgets its marker, or weighs its
saving lightly, fails.
"""

from __future__ import annotations

import pytest
from conftest import seeded_bugs

from autograder import course
from autograder.checking import run_checks
from autograder.registry import Task, get_task, lesson_tasks

# Lesson 05 on: the lessons whose techniques save memory or bytes (the spec's list)
LESSONS = [spec.number for spec in course.LESSONS if spec.number >= 5]

# task -> what its technique saves, per rank
SAVING_TASKS = {
    "5.2": "optimizer state: each rank keeps only its own parameters' state (ZeRO-1)",
    "5.3": "parameters, gradients and state: 1/W per rank, one unit gathered at a time (ZeRO-3)",
    "5.4": "parameters: 1/shard-size per rank, each block freed after its forward (FSDP2)",
    "5.5": "bytes: one element per clip, one reduce-scatter per accumulated step",
    "6.1": "bytes written and read: each rank writes its pieces, a load reads what it overlaps",
    "7.3": "activation memory: a checkpointed block keeps only its input",
    "8.1": "weights and matmul FLOPs: 1/t per rank",
    "8.2": "activation memory (the LayerNorm on 1/t of the sequence), weights and FLOPs: 1/t",
    "8.4": "activation memory: num_stages - stage micro-batches, not all of them",
    "9.3": "memory and bytes: two K/V blocks per rank, sent to one neighbour",
    "9.4": "memory: one block's logits, not the whole pair representation's",
    "11.2": "bytes: each rank asks for the ids it needs, nobody gathers the graph",
    "11.3": "bytes and memory: lin's outputs of the halo rows only, tables of own + halo rows",
    "11.4": "bytes: each missing feature row once, none owned or cached, no gather of the matrix",
    "13.3": "bytes and memory: kept tokens to their expert's rank only, E/W experts per rank",
    "13.4": "kernels and memory: one matrix product per layer for every expert, rows per choice",
    "14.2": "bytes per mesh axis and parameters: 1/(dp tp) of the blocks, 1/dp of the rest",
    "14.3": "parameters: a stage's own blocks; activations in flight: 1F1B's, not all of them",
}

# task -> why its point is not a saving
NOT_A_SAVING = {
    "5.1": "a meter: it counts the bytes others save",
    "6.2": "exact resume: the state to save, bit for bit",
    "6.3": "fault tolerance: resuming from the newest complete checkpoint",
    "7.1": "numerics: a loss scaler's skips and scales",
    "7.2": "a meter: it counts saved activations",
    "7.4": "capture in one graph; its bound guards against a forward hidden from the compiler",
    "8.3": "a schedule: GPipe's order and its messages; each stage's layers are given",
    "8.5": "a schedule whose point is the bubble (idle time), cut by v",
    "9.1": "a data transform: masking statistics",
    "9.2": "fair-esm's exact batches: the budget is part of the values",
    "10.1": "a data structure: batching graphs",
    "10.2": "a layer's values and symmetries",
    "10.3": "a data split",
    "10.4": "metrics, the same as one process's",
    "11.1": "a sampler's distribution",
    "12.1": "a FLOP formula: it counts, it saves nothing",
    "12.2": "a traffic model: it predicts bytes, it saves nothing",
    "12.3": "a diagnosis: which rank is slow, and why",
    "13.1": "routing values",
    "13.2": "a loss's value and gradient",
    "14.1": "a layout: which ranks share a group",
    "14.4": "a resume at another layout; its bound guards against a gathering save",
}

# A seeded bug that throws the saving away (its values right, at least on the main cases): (task,
# bug) -> words a failing saving case says of what was kept or sent that should not have been.
THROWS_THE_SAVING_AWAY = {
    (
        "5.2",
        "keeps every parameter's state on every rank, shows only its own in self.state",
    ): "optimizer state for parameters it does not own",
    ("5.5", "all-gathers the ranks' local sums"): "all_gather_into_tensor",
    (
        "7.3",
        "forward runs fn with grad and keeps its output on ctx: every activation stays alive",
    ): "activations are kept although backward recomputes them",
    (
        "8.1",
        "keeps the whole weights and multiplies by them on every rank",
    ): "keep the whole weights on every rank",
    (
        "8.2",
        "keeps the whole weights and runs the full-width MLP on every rank",
    ): "keeps both whole weights on every rank",
    ("8.4", "GPipe's order: all forwards, then all backwards"): "activations held at once",
    ("14.2", "no tensor parallel: blocks whole on every tp rank"): "a rank keeps weights",
    ("14.2", "plain tensor parallel: no sequence parallel, activations replicated"):
        "activations gathered and reduce-scattered by sequence",
    ("14.3", "GPipe: every forward before any backward"): "which holds every micro-batch's",
    (
        "9.3",
        "keeps every block and attends over their concatenation",
    ): "every K/V block the rank received stays alive",
    # one saving thrown away of several the task measures: the cap holds these to half
    (
        "5.3",
        "all-reduces the gradients instead of reduce-scattering",
    ): "an all-reduce sends every rank the whole gradient",
    (
        "5.3",
        "keeps the original full parameters after wrapping",
    ): "every rank still holds full parameters next to its shards",
    ("6.1", "rank 0 gathers every piece and writes them all"): "a rank writes other ranks' pieces",
    ("6.1", "the loader reads every file"): "files of pieces outside that range",
    (
        "9.3",
        "keeps every block it received (right values and traffic)",
    ): "every K/V block the rank received stays alive",
    (
        "11.2",
        "every rank's edges sent to every rank through all_to_all_single",
    ): "anything more is the graph's edges",
    ("11.3", "all_to_all_single of every row to every rank"): "neither owns nor receives",
    ("11.4", "all-gathers every rank's rows"): "(all_gather)",
    (
        "13.3",
        "sends every token to every rank through the all-to-alls (an all-gather by another name)",
    ): "expected one all-to-all of counts",
    ("13.4", "loops over experts: two matrix products per expert"): "matrix-product kernels",
    (
        "13.4",
        "gathers every choice's expert weights: one bmm per layer over a (T k, d, h) copy",
    ): "a copy of the experts' weights per choice",
}


def _tasks() -> dict[str, Task]:
    return {t.id: t for lesson in LESSONS for t in lesson_tasks(lesson)}


def test_every_task_of_lessons_05_on_is_classified_once():
    ids = set(_tasks())
    assert not set(SAVING_TASKS) & set(NOT_A_SAVING)
    assert set(SAVING_TASKS) | set(NOT_A_SAVING) == ids, (
        "classify each task as SAVING_TASKS (what it saves) or NOT_A_SAVING (why not): "
        f"unlisted {sorted(ids - set(SAVING_TASKS) - set(NOT_A_SAVING))}, "
        f"gone {sorted((set(SAVING_TASKS) | set(NOT_A_SAVING)) - ids)}")


@pytest.mark.parametrize(
    "task_id", sorted(SAVING_TASKS, key=lambda t: tuple(map(int, t.split("."))))
)
def test_a_saving_task_marks_its_saving_cases_and_they_weigh_at_least_half(task_id):
    task = get_task(task_id)
    assert task.saving_cases, f"task {task_id} marks no case saving=True (and states no bound)"
    share = task.saving_points() / task.points
    assert share >= 0.5 - 1e-9, (
        f"task {task_id}: its saving cases weigh {share:.0%} of its points, at least 50% is the "
        "rule: "
        + ", ".join(f"{c.name[:40]!r} {task.case_points(c):.2f}" for c in task.saving_cases)
    )
    # every bound of a saving task is one of its saving cases, and names what was lost
    saving = {c.name for c in task.saving_cases}
    for bound in task.bounds:
        assert f"{bound.what} is within {bound.formula}" in saving, bound.what
        assert bound.lost, bound.what


@pytest.mark.parametrize(
    "task_id", sorted(NOT_A_SAVING, key=lambda t: tuple(map(int, t.split("."))))
)
def test_a_task_whose_point_is_not_a_saving_marks_no_saving_case(task_id):
    marked = [c.name for c in get_task(task_id).saving_cases]
    assert not marked, f"task {task_id} marks saving cases {marked}: move it to SAVING_TASKS"


def test_a_bound_is_a_saving_case_unless_it_says_otherwise():
    task = Task("99.1", "scratch", 4.0)
    task.case("values")(lambda impl, seed: 0)
    task.case("messages", saving=True)(lambda impl, seed: 0)
    task.bound("bytes per rank", formula="1/W", lost="everything on every rank")(
        lambda impl, seed: 0
    )
    task.bound("a cheat's FLOPs", formula="1%", lost="hidden", saving=False)(lambda impl, seed: 0)
    assert [c.name for c in task.saving_cases] == ["messages", "bytes per rank is within 1/W"]
    assert task.saving_points() == pytest.approx(2.0)


@pytest.mark.parametrize(("task_id", "bug"), list(THROWS_THE_SAVING_AWAY),
                         ids=[f"{t}: {b[:40]}" for t, b in THROWS_THE_SAVING_AWAY])
def test_a_bug_that_throws_the_saving_away_keeps_at_most_half_and_is_told_what_it_kept(
    task_id, bug
):
    task = get_task(task_id)
    report = run_checks(task_id, dict(seeded_bugs(task.lesson)[task_id])[bug])
    assert report.score <= task.points / 2 + 1e-9, report.to_text()
    saving = {c.name for c in task.saving_cases}
    failed = [c for c in report.cases if c.status != "passed" and c.name in saving]
    words = THROWS_THE_SAVING_AWAY[(task_id, bug)]
    assert any(words in c.message for c in failed), report.to_text()


def _scratch_report(statuses: dict[str, str]):
    from autograder.results import CaseResult, TaskReport, settle

    task = get_task("5.3")  # six points, three value cases, six saving ones
    return task, settle(TaskReport(task.id, task.name, [
        CaseResult(c.name, statuses.get(c.name, "passed"),
                   task.case_points(c) if statuses.get(c.name, "passed") == "passed" else 0.0,
                   task.case_points(c), "" if statuses.get(c.name, "passed") == "passed" else "x")
        for c in task.cases]))


def test_one_lost_saving_of_several_caps_the_task_at_half_and_the_case_says_why():
    from autograder.results import CAPPED

    task, whole = _scratch_report({})
    assert whole.score == pytest.approx(task.points)
    one = task.saving_cases[0].name
    task, capped = _scratch_report({one: "failed"})
    assert sum(task.case_points(c) for c in task.cases if c.name != one) > task.points / 2
    assert capped.score == pytest.approx(task.points / 2)
    lost = next(c for c in capped.cases if c.name == one)
    assert CAPPED in lost.message and lost.message.startswith("x")
    # a value case lost alone is not capped: its points go, the rest stay
    value = next(c for c in task.cases if not c.saving)
    _, values = _scratch_report({value.name: "failed"})
    assert values.score == pytest.approx(task.points - task.case_points(value))
    # under the cap already: nothing changes
    _, low = _scratch_report({c.name: "failed" for c in task.cases[:4]})
    assert low.score == pytest.approx(sum(task.case_points(c) for c in task.cases[4:]))
