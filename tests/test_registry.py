"""The registry runs an implementation once and judges it many times, and explains a mismatch.

Shared runs replace every lesson's private cache: one run per (implementation, seed), kept
with its exception, forgotten when ``run_checks`` starts again. Trusted expectations are
computed once per (case, seed). A bound case fails naming the saving that was lost, the
ratio and the formula. A failure here means checks would run twice, or explain wrongly.
"""

from __future__ import annotations

import pytest
import torch

from autograder import course, registry
from autograder.checking import run_checks
from autograder.compare import CheckFailed, per_rank, tensor_mismatch, within_bound
from autograder.registry import SharedRun, Task, fresh_runs


# Implementations under test live at module level: the gates read a lambda's whole source line,
# which here names the grader's own run_checks.
def _identity(s):
    return s


def _within():
    return [4000, 4096]


def _three_times():
    return [4000, 12288]


def _counting(result=None, error=None):
    calls = []

    def run(impl, seed):
        calls.append((impl, seed))
        if error is not None:
            raise error
        return impl(seed) if result is None else result

    return run, calls


def test_a_shared_run_runs_once_for_every_case_that_reads_it(scratch_task):
    run, calls = _counting()
    t = scratch_task(reference=lambda s: s * 2)
    shared = t.shared(run)
    t.case("a")(lambda impl, seed: shared(impl, seed))
    t.case("b")(lambda impl, seed: shared(impl, seed) + 0)
    t.case("c")(lambda impl, seed: [shared(impl, seed)])

    def impl(s):
        return s * 2

    report = run_checks(t.id, impl, seed=3)
    assert report.score == 3, report.to_text()
    student_runs = [c for c in calls if c[0] is impl]
    assert len(student_runs) == 1, calls  # three cases, one run of the student's code


def test_a_run_that_raised_fails_every_case_without_running_again(scratch_task):
    run, calls = _counting(error=ValueError("rank 2 crashed"))
    t = scratch_task(reference=None)
    shared = t.shared(run)
    for name in "abc":
        t.case(name, expect=lambda seed: 1)(lambda impl, seed: shared(impl, seed))
    report = run_checks(t.id, _identity)
    assert report.score == 0
    assert [c.status for c in report.cases] == ["error"] * 3, report.to_text()
    assert all("rank 2 crashed" in c.message for c in report.cases)
    assert len(calls) == 1


def test_run_checks_starts_afresh_so_a_changed_helper_is_seen(scratch_task):
    state = {"k": 1}
    run, calls = _counting()
    t = scratch_task(reference=None)
    shared = t.shared(run)
    t.case("doubles", expect=lambda seed: 2 * seed)(lambda impl, seed: shared(impl, seed))

    def impl(s):  # calls a module-level helper the student may redefine in another cell
        return state["k"] * s

    assert run_checks(t.id, impl, seed=5).score == 0
    state["k"] = 2
    assert run_checks(t.id, impl, seed=5).score == 3
    assert len(calls) == 2


def test_a_new_implementation_object_is_run_even_if_it_reuses_a_freed_id():
    run, calls = _counting()
    shared = SharedRun(run)
    for _ in range(5):
        shared(lambda s: s, 0)  # each lambda may land on the same address as the last
    assert len(calls) == 5
    fresh_runs()


def test_trusted_expectations_are_computed_once_per_case_and_seed(scratch_task):
    seen = []

    def expect(seed):
        seen.append(seed)
        return seed

    t = scratch_task(reference=None)
    t.case("identity", expect=expect)(lambda impl, seed: impl(seed))
    for _ in range(3):
        run_checks(t.id, _identity, seed=1)
    run_checks(t.id, _identity, seed=2)
    assert seen == [1, 2]


def test_a_reference_named_by_string_is_resolved_in_the_references_package(scratch_task):
    t = scratch_task(reference="no_such_reference")
    with pytest.raises(AttributeError, match="names 'no_such_reference' in autograder.references"):
        t.trusted(t.reference)


def test_a_bound_case_fails_naming_the_lost_saving_and_the_ratio(scratch_task):
    t = scratch_task(reference=None)
    t.bound("optimizer state per rank", formula="total / W + the largest parameter",
            lost="every rank keeps optimizer state for all 48 tensors",
            expect=lambda seed: {"bound": 4096})(lambda impl, seed: {"measured": impl()})
    ok = run_checks(t.id, _within)
    assert ok.score == 3, ok.to_text()
    over = run_checks(t.id, _three_times)
    assert over.score == 0
    message = over.cases[0].message
    assert "rank 1 holds 3.0x the bound" in message
    assert "total / W + the largest parameter" in message
    assert "every rank keeps optimizer state for all 48 tensors" in message
    assert t.bounds[0].formula == "total / W + the largest parameter"


def test_a_bound_a_small_overshoot_already_fails():
    with pytest.raises(CheckFailed, match="1.1x the bound"):
        within_bound([1070], 1000, what="peak", formula="f", lost="l")


def test_tensor_mismatch_names_shape_dtype_and_the_world_size_slip():
    want = torch.arange(1.0, 7.0).view(2, 3)
    assert tensor_mismatch(want.clone(), want) is None
    assert "has shape (3, 2)" in tensor_mismatch(want.view(3, 2), want)
    assert "has dtype torch.float64" in tensor_mismatch(want.double(), want, dtype=True)
    assert "is 4x the expected value: the sum over ranks" in tensor_mismatch(
        4 * want, want, world_size=4
    )
    assert "1/4 of the expected value" in tensor_mismatch(want / 4, want, world_size=4)
    assert "tolerance" in tensor_mismatch(want + 1, want)
    assert "expected a tensor" in tensor_mismatch([1, 2], want)


def test_per_rank_wants_exactly_one_result_per_rank():
    assert per_rank([1, 2, 3], 3) == [1, 2, 3]
    with pytest.raises(CheckFailed, match=r"one loss per rank \(4 ranks\), got 3"):
        per_rank([1, 2, 3], 4, "loss")
    with pytest.raises(CheckFailed, match="got dict"):
        per_rank({0: 1}, 1)


def test_the_registry_still_exports_what_lessons_import():
    from autograder.registry import CheckFailed as Again
    from autograder.registry import assert_same

    assert Again is CheckFailed and callable(assert_same)
    assert isinstance(registry.get_task("0.1"), Task)


def test_a_case_can_judge_part_of_a_shared_run_without_a_body(scratch_task):
    run, calls = _counting(result=[{"loss": 1.0, "steps": 3}, {"loss": 1.0, "steps": 3}])
    t = scratch_task(reference=None)
    shared = t.shared(run)
    assert t.case("losses", uses=shared, pick="loss", expect=lambda seed: [1.0, 1.0]) is None
    t.case("steps", uses=shared, pick=lambda d: [r["steps"] for r in d], expect=lambda seed: [3, 3])
    report = run_checks(t.id, _identity)
    assert report.score == 3, report.to_text()
    assert len(calls) == 1
    with pytest.raises(TypeError, match="pick= needs uses="):
        t.case("orphan", pick="loss")


def test_a_bound_may_differ_per_rank_where_their_shares_differ():
    within_bound([900, 95], [1000, 100], what="halo rows", formula="own + halo", lost="l")
    with pytest.raises(CheckFailed, match="rank 1 holds 1.5x the bound"):
        within_bound([900, 150], [1000, 100], what="halo rows", formula="own + halo", lost="l")
    with pytest.raises(CheckFailed, match="one measurement per rank"):
        within_bound([900], [1000, 100], what="halo rows", formula="own + halo", lost="l")


@pytest.mark.parametrize("spec", course.LESSONS, ids=lambda spec: f"lesson{spec.number:02d}")
def test_each_lesson_registers_exactly_the_tasks_of_its_spec_in_order(spec):
    """A task id the spec states but no check registers (or the reverse) fails here, per lesson."""
    assert [t.id for t in registry.lesson_tasks(spec.number)] == [t.id for t in spec.tasks]
