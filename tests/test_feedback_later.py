"""What a failing check tells a student in Lessons 05-13: the mistake the data shows, once.

Each test runs one seeded bug through its task's checks and holds the first failing case to the
phrase that names what the code did wrong (its direction too: a norm smaller than the global one,
gradients left over, no collective at all), and holds every later case that fails only because of
it to "follows from the failure above" with no hint of its own. Most also name the old hint that
sent the student after a mistake the code did not make (capping the clipping factor, dividing the
micro-batch losses, unscaling twice, an opaque custom op, the order of equal-sized scaffold sets,
a top fraction per shard, the halo's autograd), which must no longer be shown. Scores
are unchanged: the rule changes what is said, never the points.
"""

from __future__ import annotations

import pytest
from conftest import seeded_bugs

from autograder.checking import run_checks


def _report(lesson: int, task_id: str, description: str):
    impl = next(i for d, i in seeded_bugs(lesson)[task_id] if d.startswith(description))
    return run_checks(task_id, impl)


def _first_failure(report):
    return next(c for c in report.cases if c.status in ("failed", "error"))


def _later_ones_follow(report, names):
    first = _first_failure(report)
    for c in report.cases:
        if any(c.name.startswith(n) for n in names):
            assert c.follows == first.name, (c.name, c.message)


@pytest.mark.parametrize(
    ("lesson", "task_id", "bug", "says", "follows", "not_shown"),
    [
        # 5.2: ranks that disagree after the step miss the broadcast, not the mean gradient
        (
            5,
            "5.2",
            "skips the broadcast after the step",
            "the ranks hold different values of it",
            ("10 SGD steps",),
            "the owner must step with the mean over ranks",
        ),
        # 5.3: the memory bounds after and during the forward exceed because the freed case failed
        (
            5,
            "5.3",
            "keeps the full parameters after forward",
            "the views set on the module",
            ("bytes alive after the forward", "peak bytes during the forward"),
            "A gathered unit is freed only when the last reference to its buffer goes",
        ),
        (
            5,
            "5.3",
            "deletes the attributes but lets autograd keep",
            "what autograd saves",
            ("bytes alive after the forward", "peak bytes during the forward"),
            "FSDP's peak is one unit's full parameters at a time",
        ),
        # 5.5: a local norm fails every clipping case and train_step; none of them blames the cap,
        # the uneven shards or the train_step code
        (
            5,
            "5.5",
            "a local norm per rank",
            "made no collective, so this is the norm of this rank's own",
            (
                "4 ranks, uneven shards",
                "a norm below max_norm",
                "each call makes one all-reduce",
                "train_step: 2 steps",
                "train_step: one forward",
            ),
            "Clipping only ever shrinks gradients",
        ),
        (
            5,
            "5.5",
            "clips each rank's shards before the norm",
            "the returned norm is right, so the scaling",
            ("4 ranks, uneven shards", "train_step: 2 steps"),
            "Accumulating micro-batches must give the gradient of the whole batch",
        ),
        (
            5,
            "5.5",
            "all-gathers the ranks' local sums",
            "all_gather_into_tensor",
            ("bytes each rank sends", "train_step: one forward"),
            "with the clip_grad_norm_ you wrote above",
        ),
        (
            5,
            "5.5",
            "train_step: never turns gradient sync back on",
            "the recorder saw no reduce-scatter",
            ("train_step: one forward",),
            "Accumulating micro-batches must give the gradient",
        ),
        (
            5,
            "5.5",
            "train_step: never zeroes the gradients",
            "were still there when this step began",
            ("train_step leaves no gradient",),
            "Accumulating micro-batches must give the gradient",
        ),
        (
            5,
            "5.5",
            "train_step: clips after the optimizer step",
            "step 1, with clipping idle, matched",
            (),
            "Divide each micro-batch's loss by the number of micro-batches",
        ),
        (
            5,
            "5.5",
            "scales gradients up when the norm is below max_norm",
            "the norm is below max_norm: the gradients must stay",
            (),
            "never from its own shards",
        ),
        # 7.1: a wrong scale schedule or skip decision is not a double unscale
        (
            7,
            "7.1",
            "no backoff",
            "the scale after update() of step 2",
            ("unscale_(), clip_grad_norm_", "4 ranks"),
            "must then not unscale a second time",
        ),
        (
            7,
            "7.1",
            "NaN gradients are not detected",
            "the optimizer stepped, torch's GradScaler skipped",
            ("unscale_(), clip_grad_norm_",),
            "must then not unscale a second time",
        ),
        # 7.4: a graph break leaves no graph (the FLOPs case follows); wrong values are not a break
        (
            7,
            "7.4",
            "a graph break left in: the print",
            "found a graph break",
            ("sequence lengths", "compiled outputs", "model FLOPs"),
            "a forward hidden in one opaque call",
        ),
        (
            7,
            "7.4",
            "averages over padding",
            "values differ",
            (),
            "Graph breaks come from Python that needs a value",
        ),
        (
            7,
            "7.4",
            "copies the model",
            "got no gradient",
            (),
            "Graph breaks come from Python that needs a value",
        ),
        # 8.1, 8.2: the same tensor wrong on more ranks is the same mistake
        (8, "8.1", "f forgotten", "input grad differs", ("the same on 4 ranks",), ""),
        (
            8,
            "8.2",
            "the LayerNorm gradients not reduced",
            "norm.weight.grad",
            ("the same on 4 ranks",),
            "",
        ),
        # 8.5: a deadlock or an ill-formed order fails every case that plays the orders
        (
            8,
            "8.5",
            "virtual stages in the wrong order: backwards",
            "the orders deadlock",
            ("the bubble", "at most"),
            "",
        ),
        (
            8,
            "8.5",
            "1F1B's warm-up, without",
            "goes backward before forward",
            ("all stages' orders", "the bubble", "at most"),
            "",
        ),
        # 10.3: sizes that differ are not a tie order; 10.4: a wrong metric is not a shard mistake
        (
            10,
            "10.3",
            "the smallest scaffold sets first",
            "did not take the largest scaffold sets first",
            ("365 EGFR", "adversarial", "the test set gets singleton"),
            "Equal-sized scaffold sets are not handed out in the order",
        ),
        (
            10,
            "10.3",
            "valid filled without the cumulative cutoff",
            "valid is larger",
            ("adversarial",),
            "Equal-sized scaffold sets are not handed out in the order",
        ),
        (
            10,
            "10.3",
            "scaffold sets ordered by size only",
            "Equal-sized scaffold sets",
            ("365 EGFR", "adversarial", "the test set gets singleton"),
            "the scaffolds that occur once are what is left",
        ),
        (
            10,
            "10.4",
            "top n = floor",
            "enrichment_factor differs from RDKit's",
            ("screen_metrics on 4",),
            "A top fraction of each shard is not the top fraction",
        ),
        (
            10,
            "10.4",
            "ties broken by input order",
            "top100 differs",
            (),
            "A top fraction of each shard is not the top fraction",
        ),
        # 11.1: a broken invariant breaks it in every configuration; 11.2: the same list wrong in
        # another partition; 11.3: the gradients of a wrong forward, and lin's of a wrong x.grad
        (
            11,
            "11.1",
            "num_sampled_nodes without the seeds' entry",
            "expected 4 counts",
            ("n_id: the seeds", "per-hop sizes"),
            "The order is part of PyG's contract",
        ),
        (
            11,
            "11.2",
            "the halo holds the boundary nodes",
            "recv[1] is wrong",
            ("METIS partition", "an empty part"),
            "Every rank takes part in both exchanges",
        ),
        (
            11,
            "11.3",
            "self-loops forgotten",
            "out differs",
            ("the gradient of x_local", "the weight gradients"),
            "The gradient of a halo row belongs to the rank that owns the row",
        ),
        (11, "11.3", "received rows detached", "x.grad differs", ("the weight gradients",), ""),
        # 12.1: one formula counted on several shapes is one mistake, named by its direction
        (
            12,
            "12.1",
            "backward counted as equal to the forward",
            "Too few FLOPs",
            ("long sequences", "a large vocabulary", "one layer", "three shapes"),
            "",
        ),
        # 13.3: the gradients of outputs that differ follow the outputs case
        (
            13,
            "13.3",
            "puts expert e on rank e % W",
            "the output of its 12 tokens differs",
            (
                "2 ranks: input, expert and router gradients",
                "4 ranks (10, 7",
                "4 ranks: input, expert and router gradients",
            ),
            "the all-to-all that brought the tokens must carry their gradients back",
        ),
    ],
)
def test_the_first_failure_names_the_mistake_and_the_rest_follow(lesson, task_id, bug, says,
                                                                 follows, not_shown):
    report = _report(lesson, task_id, bug)
    first = _first_failure(report)
    assert not first.follows
    assert says in first.message + " " + first.hint, (first.message, first.hint)
    _later_ones_follow(report, follows)
    assert not (not_shown and not_shown in report.to_text())


@pytest.mark.parametrize(("bug", "score"), [
    ("a local norm per rank", 5 * 3 / 14),
    ("train_step: never zeroes the gradients", 5 * 11 / 14),
])
def test_5_5_the_rule_changes_what_is_said_never_the_points(bug, score):
    assert _report(5, "5.5", bug).score == pytest.approx(score)
