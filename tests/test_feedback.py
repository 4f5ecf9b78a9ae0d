"""What a failing check tells a student: one mistake, one diagnosis, pointing the right way.

A case that fails only because of an earlier case's failure (the same cause, or the same error
from a shared run) says "follows from the failure above: fix that first" and gives no hint of
its own; a diagnosis matches the direction of the error; expected and got are two rows of one
table; `code spans` render as code. Lesson 9.1's seeded bugs show each rule on a real task. A
failure here means a student is sent after a mistake the code did not make.
"""

from __future__ import annotations

import functools
import re
from html.parser import HTMLParser

import pytest
from conftest import seeded_bugs

from autograder.checking import run_checks
from autograder.compare import CheckFailed
from autograder.results import FOLLOWS


@pytest.fixture
def scratch_task(scratch_task):
    """conftest's, with a hint and a recipe the feedback shows."""
    return functools.partial(scratch_task, hint="the task's concept", recipe="the task's recipe")


def _fails_with(cause):
    def compare(got, expected):
        raise CheckFailed(f"wrong because of {cause}", expected=1, got=2, cause=cause,
                          hint=f"about {cause}", recipe=f"fix {cause}")
    return compare


def _returns_seed(seed):
    return seed


def _boom(seed):
    raise ValueError("shared run broke")


def _stub(n, rank, world_size):
    raise NotImplementedError("Task 0.1: todo")


def test_a_case_failing_for_the_cause_of_an_earlier_one_follows_it(scratch_task):
    t = scratch_task(reference=_returns_seed)
    t.case("first", compare=_fails_with("A"))(lambda impl, seed: impl(seed))
    t.case("second", compare=_fails_with("A"))(lambda impl, seed: impl(seed))
    t.case("third", compare=_fails_with("B"))(lambda impl, seed: impl(seed))
    report = run_checks(t.id, _returns_seed)
    first, second, third = report.cases
    assert (first.follows, second.follows, third.follows) == ("", "first", "")
    assert report.score == 0  # the rule changes what is said, never the points
    text = report.to_text()
    assert text.count(FOLLOWS) == 1
    assert "about A" in text and text.count("about A") == 1 and "about B" in text
    page = report._repr_html_()
    assert page.count(FOLLOWS) == 1 and page.count("about A") == 1


def test_an_error_of_a_shared_run_is_diagnosed_once(scratch_task):
    t = scratch_task(reference=_returns_seed)
    shared = t.shared(lambda impl, seed: impl(seed))
    t.case("a")(lambda impl, seed: shared(impl, seed))
    t.case("b")(lambda impl, seed: shared(impl, seed))
    report = run_checks(t.id, _boom)
    assert [c.status for c in report.cases] == ["error", "error"]
    assert [c.follows for c in report.cases] == ["", "a"]
    assert report.to_text().count("hint: the task's concept") == 1


class _Tables(HTMLParser):
    """The expected/got tables of a report: each a list of rows, each row its cells' text."""

    def __init__(self):
        super().__init__()
        self.tables, self._in, self._cell = [], False, None

    def handle_starttag(self, tag, attrs):
        if tag == "table" and "kit-expected-got" in (dict(attrs).get("class") or ""):
            self._in = True
            self.tables.append([])
        elif self._in and tag == "tr":
            self.tables[-1].append([])
        elif self._in and tag == "td":
            self._cell = ""

    def handle_endtag(self, tag):
        if self._in and tag == "td":
            self.tables[-1][-1].append(self._cell)
            self._cell = None
        elif tag == "table":
            self._in = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def test_expected_and_got_are_two_rows_of_one_table_and_code_spans_render():
    report = run_checks("0.1", dict(seeded_bugs(0)["0.1"])["stops one item early (off by one)"])
    page = report._repr_html_()
    tables = _Tables()
    tables.feed(page)
    failed = [c for c in report.cases if c.expected is not None and not c.follows]
    assert failed and len(tables.tables) == len(failed)
    for table, case in zip(tables.tables, failed):
        assert [row[0] for row in table] == ["expected", "got"]
        assert [row[1] for row in table] == [case.expected, case.got]
    # both boxes fill the one value column: the same width whatever their text
    assert page.count("display:block;box-sizing:border-box;width:100%") == 2 * len(failed)

    stub = run_checks("0.1", _stub)
    assert "`" in stub.headline()  # the text form keeps Markdown's backticks ...
    html = stub._repr_html_()
    assert "`" not in html  # ... the page shows them as code
    assert re.search(r"<code[^>]*>raise NotImplementedError\(\.\.\.\)</code>", html)


def _bug(description):
    return next(impl for d, impl in seeded_bugs(9)["9.1"] if d.startswith(description))


def test_9_1_special_tokens_selected_is_one_failure_the_others_follow():
    report = run_checks("9.1", _bug("special tokens"))
    invariants, frequencies, independent, determinism = report.cases[:4]
    nothing_maskable = next(c for c in report.cases if c.name.startswith("nothing maskable"))
    assert nothing_maskable.follows == invariants.name  # the same mistake at the edge
    assert "special token" in invariants.message and invariants.hint and not invariants.follows
    assert frequencies.follows == independent.follows == invariants.name
    text = report.to_text()
    # the per-sequence case no longer blames a fixed share of every sequence
    assert "fixed" not in text and "varies" not in text
    # 3 points; determinism (weight 1) and the edges mask_prob = 0 and out of range (0.5 each)
    # pass, of 6.5 in all
    assert determinism.passed and report.score == pytest.approx(3 * 2 / 6.5)


def test_9_1_count_diagnosis_follows_the_direction_of_the_error():
    too_little = run_checks("9.1", _bug("masks exactly 15%")).cases[2]
    too_much = run_checks("9.1", _bug("one draw per sequence")).cases[2]
    assert "too little" in too_little.message and "fixed" in too_little.recipe
    assert "too much" in too_much.message
    assert "fixed" not in too_much.hint + too_much.recipe
    assert "not one per sequence" in too_much.recipe


def test_9_1_labels_only_at_mask_points_at_labels_not_inputs():
    report = run_checks("9.1", _bug("labels only where <mask> went"))
    first = report.cases[0]
    assert first.message.split(": ", 1)[1].startswith("labels")
    assert "not selected changed in inputs" not in report.to_text()
    assert "labels" in first.hint and "before the 80/10/10 split" in first.recipe
    assert report.cases[1].follows == first.name


def test_9_1_labels_everywhere_is_not_called_selecting_special_tokens():
    first = run_checks("9.1", _bug("labels hold the original token everywhere")).cases[0]
    assert "special token (cls, eos or pad) was selected" not in first.message
    assert first.message.split(": ", 1)[1].startswith("labels hold a token")


def _bug0(task_id, description):
    return dict(seeded_bugs(0)[task_id])[description]


@pytest.mark.parametrize(("description", "says"), [
    ("gives the remainder to the last ranks", "extra items sit on the last ranks"),
    ("stops one item early (off by one)", "stops one item early"),
    ("drops the n % world_size leftover items", "are in no shard"),
    ("uses ceil-sized chunks", "differ by more than one"),
])
def test_0_1_hint_names_the_mistake_the_shards_show(description, says):
    report = run_checks("0.1", _bug0("0.1", description))
    failed = [c for c in report.cases if c.status == "failed"]
    first = failed[0]
    assert says in first.hint, first.hint
    assert all(c.follows == first.name for c in failed[1:] if c.cause == first.cause)
    # the case written for "remainder on the last ranks" says so only when that is the mistake
    wrong = "The remainder goes to the first n % world_size ranks, not the last ones."
    assert all(c.hint != wrong for c in failed)


@pytest.mark.parametrize(("description", "says"), [
    ("averages the per-rank means", "mean of the per-rank means"),
    ("counts rows with len() instead of elements", "number of rows"),
    ("returns the local mean without communicating", "nothing was added up across ranks"),
])
def test_0_2_a_wrong_mean_is_named_by_what_it_equals(description, says):
    report = run_checks("0.2", _bug0("0.2", description))
    first = next(c for c in report.cases if c.status == "failed")
    assert says in first.message
    if description.startswith("averages"):  # its 2-D case failed for the same reason, not rows
        assert report.cases[3].follows == first.name and "len()" not in report.to_text()


@pytest.mark.parametrize(("description", "says"), [
    ("ignores the epoch", "same in every epoch"),
    ("gives each rank a contiguous block", "contiguous block"),
    ("pads even with drop_last", "counts padded slots"),
    ("shuffles with Python's random", "another order"),
    ("pads with the last indices", "only the padded slots differ"),
])
def test_3_1_hint_names_what_the_indices_show(description, says):
    impl = next(i for d, i in seeded_bugs(3)["3.1"] if d.startswith(description))
    report = run_checks("3.1", impl)
    first = next(c for c in report.cases if c.status == "failed")
    assert says in first.hint, first.hint
    # the drop_last case's own hint is given only for a drop_last mistake
    drop_last = "With drop_last each rank gets floor(len / num_replicas) items"
    assert description.startswith("pads even") or all(
        drop_last not in c.hint for c in report.cases if c.status == "failed" and not c.follows)


@pytest.mark.parametrize("task_id", ["4.1", "4.2", "4.3"])
def test_ddp_summed_gradients_are_named_as_such_not_as_the_tasks_idea(task_id):
    impl = dict(seeded_bugs(4)[task_id])["sums the gradients instead of averaging them"]
    report = run_checks(task_id, impl)
    first = next(c for c in report.cases if c.status == "failed")
    assert "the sum over ranks, not the mean" in first.message
    assert "divide by the world size" in first.hint and "Overlap" not in first.hint


def _first_failure(task_id, description):
    lesson = int(task_id.split(".")[0])
    report = run_checks(task_id, dict(seeded_bugs(lesson)[task_id])[description])
    return report, next(c for c in report.cases if c.status != "passed")


@pytest.mark.parametrize(("task_id", "description", "says", "wrong"), [
    ("1.1", "ignores src and broadcasts from rank 0", "every rank ended with rank 0's data",
     "Sending from src to every rank in turn takes p - 1 rounds"),
    ("1.2", "a star: every rank sends to rank 0, which sums and sends back",
     "a star through rank 0", "A ring: every rank sends only to its right neighbour"),
    ("1.2", "stops after reduce-scatter (no all-gather)",
     "the reduce-scatter ran and the all-gather that shares those chunks did not",
     "A ring: every rank sends only to its right neighbour"),
    ("1.2", "averages instead of summing", "divided by the world size",
     "With n < world_size some chunks are empty"),
    ("1.4", "returns (beta, alpha)", "the order is (alpha, beta)", "with an intercept"),
    ("1.4", "sends the whole buffer in every step", "it sends all n bytes in every message",
     "paying the latency alpha once; one rank sends nothing"),
    ("2.1", "uses RANK as the local rank", "LOCAL_RANK was not read",
     "int() raises on '1.5' and 'two'"),
    ("2.2", "restarts the data order after resuming", "the step count started again at 0",
     "Load the checkpoint at the start"),
    ("2.3", "blames every rank", "blamed every rank", "Compare the shape as well as the name"),
    ("3.1", "shuffles with Python's random instead of torch.randperm", "another order",
     "Left out, num_replicas and rank come from the default process group"),
    ("3.3", "concatenates the shards rank after rank: wrong order", "concatenated rank after rank",
     "trailing dimensions"),
    # Two async all-reduces of one gradient race in gloo's worker threads: mostly the sum comes
    # out wrong, but a step where they ran one after the other gives the right mean (sum twice,
    # divide twice). If every step came out right, the all-reduce count names the slip instead.
    ("4.2", "hooks the tied weight twice (module by module)",
     ("Only the tied weight's gradient", "is hooked and reduced twice"),
     "Overlap: each gradient's all-reduce"),
    ("4.3", "puts the tied weight in a bucket twice", "a tied weight counted twice",
     "One all-reduce per bucket per step, started during backward the moment"),
])
def test_lessons_1_to_4_name_the_mistake_the_data_shows(task_id, description, says, wrong):
    report, first = _first_failure(task_id, description)
    says = (says,) if isinstance(says, str) else says
    assert any(s in first.message + first.hint for s in says), (first.message, first.hint)
    assert not first.follows
    text = report.to_text()
    assert wrong not in text  # the hint about a mistake the code did not make is gone
    # every later failure of the same cause follows the first instead of repeating its hint
    assert all(c.follows == first.name for c in report.cases[report.cases.index(first) + 1:]
               if c.cause == first.cause and c.status == "failed")


@pytest.mark.parametrize("task_id", ["4.1", "4.2", "4.3"])
def test_ddp_without_the_initial_broadcast_is_one_failure_the_training_cases_follow(task_id):
    report, first = _first_failure(task_id, "no broadcast at construction")
    assert first.cause == "no broadcast" and "right after wrapping" in first.message
    training = [
        c
        for c in report.cases
        if "equal one process" in c.name or c.name == "the same on 4 ranks" or "1500-byte" in c.name
    ]
    assert training and all(c.follows == first.name for c in training)
    text = report.to_text()
    assert "Overlap:" not in text and "Buckets: few large" not in text
    assert report.score == pytest.approx({"4.1": 0.75, "4.2": 1.8, "4.3": 1.6}[task_id])


def _bug6(task_id, description):
    return dict(seeded_bugs(6)[task_id])[description]


def test_6_1_a_loader_that_opens_every_file_is_told_so_once_and_is_not_called_forbidden():
    # It once scored 0 as "uses torch.distributed.checkpoint": the gate had wrapped
    # enum.Enum.__new__, which every Enum class of DCP holds, so torch.load's enums tripped it.
    report = run_checks(
        "6.1", _bug6("6.1", "offsets kept inside the piece files: every load opens every file")
    )
    # half of 4 points: its values are right, its loads read every piece (the saving lost)
    assert report.status == "failed" and report.score == pytest.approx(2.0)
    opened, read = report.cases[-3], report.cases[-2]
    assert "opened the same files as loading one element of any other piece" in opened.message
    assert read.follows == opened.name
    assert "torch.save of a view" not in report.to_text()


def test_6_1_forbidden_use_is_said_once_and_every_other_case_follows():
    report = run_checks("6.1", _bug6("6.1", "wraps dcp.save/dcp.load and loads every piece"))
    assert report.score == 0 and all(c.status == "forbidden" for c in report.cases)
    assert [c.follows for c in report.cases[1:]] == [report.cases[0].name] * (len(report.cases) - 1)
    assert report.to_text().count("This task asks you to build it yourself") == 1


def test_6_2_one_key_for_every_rank_is_named_as_another_ranks_state():
    report = run_checks(
        "6.2",
        _bug6("6.2", "the RNG states are saved under one key on every rank (DCP keeps one copy)"),
    )
    ddp, fsdp = report.cases[0], report.cases[1]
    assert "is rank 1's, not its own" in ddp.message and "names the rank" in ddp.hint
    assert fsdp.follows == ddp.name
    lost = run_checks("6.2", _bug6("6.2", "the RNG states are not saved")).cases[0]
    assert "is not what it was" in lost.message and "DCP keeps one copy" not in lost.hint


def test_a_wrong_gradient_is_reported_at_its_earliest_step_on_any_rank():
    """Rank 1's tied gradient goes wrong at step 0, so every rank's all-reduced gradients differ
    everywhere at step 1: rank 0's step 1 must not be what the student reads (it shows only the
    consequence, with no slip to name)."""
    import torch

    from autograder import lesson04

    want = {"embed.weight": torch.ones(4, 2), "fc.weight": torch.ones(3)}
    expected = {"grads": [want, want], "final": {}}
    off = {name: t + 1 for name, t in want.items()}
    rank0 = {"grads": [want, off], "final": {}}
    rank1 = {"grads": [{**want, "embed.weight": want["embed.weight"] * 3}, off], "final": {}}
    with pytest.raises(CheckFailed) as failed:
        lesson04._compare_training([rank0, rank1], expected)
    assert str(failed.value).startswith("rank 1, step 0: embed.weight.grad"), str(failed.value)
    assert failed.value.cause == "tied weight twice"
