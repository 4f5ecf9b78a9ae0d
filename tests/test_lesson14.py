"""Lesson 14's own tests: the encoder and its data, the references against torch and one process
on the regimes the checks do not launch (tp=4, world size 1, bf16, a 3-D mesh), the traffic
formula against the recorder on every 4-rank layout, and the lesson run headless. The bugs only
the meter or the recorder sees are tests/bugs/lesson14.py's CAUGHT_BY, proven in test_checks.

The generic proofs (solution passes, stub and every seeded bug fail) are tests/test_checks.py's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lesson_support import check_outputs, printed_text, run_headless

from autograder.lesson14 import AXES, axis_bytes
from autograder.references import lesson14 as ref
from kit.launcher import run_ranks
from kit.lessons import composition as comp

LESSON = 14
PRELOAD = ("torch.distributed.tensor.parallel", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "kit.lessons.composition")


def test_the_helpers_hold_no_answer():
    answers = {"build_mesh", "parallelize", "axis_traffic", "build_pipeline", "save_checkpoint",
               "load_checkpoint"}
    assert not answers & set(dir(comp))


def test_every_window_masks_the_same_count_so_shards_and_micro_batches_average_alike():
    batches = comp.masked_batches(3, 4, seed=2)
    for tokens, targets in batches:
        assert tokens.shape == targets.shape == (4, comp.SEQ_LEN)
        assert ((targets != -100).sum(dim=1) == comp.MASKED).all()
        assert (tokens[targets != -100] == comp.MASK_ID).all()
    logits = torch.randn(4, comp.SEQ_LEN, comp.VOCAB)
    tokens, targets = batches[0]
    whole = comp.masked_lm_loss(logits, targets)
    halves = [comp.masked_lm_loss(logits[i:i + 2], targets[i:i + 2]) for i in (0, 2)]
    assert torch.allclose(whole, sum(halves) / 2)
    assert comp.peptide_windows(2, seed=0).tolist() == comp.peptide_windows(2, seed=0).tolist()


def test_a_stage_of_the_encoder_runs_what_it_holds_and_keeps_the_full_models_names():
    model = comp.encoder(0)
    names = {n for n, _ in model.named_parameters()}
    x = torch.randint(0, comp.VOCAB, (2, 8))
    full = model(x)
    first, second = comp.encoder(0), comp.encoder(0)
    del first.blocks["2"], first.blocks["3"]
    first.norm = first.head = None
    del second.blocks["0"], second.blocks["1"]
    second.tok = None
    assert torch.allclose(second(first(x)), full, atol=1e-6)
    stage_names = {n for m in (first, second) for n, _ in m.named_parameters()}
    assert stage_names == names


def _train(layout, steps, dtype_name, seed):
    dp, tp, pp = layout
    mesh = ref.build_mesh(dist.get_world_size(), dp, tp, pp)
    model = ref.parallelize(comp.encoder(seed).to(getattr(torch, dtype_name)), mesh)
    return comp.train_steps(model, mesh, comp.masked_batches(steps, 4, seed=seed),
                            comp.optimizer_for(model))


@pytest.mark.parametrize(("layout", "world_size"), [((1, 4, 1), 4), ((1, 1, 1), 1),
                                                    ((2, 1, 1), 2)],
                         ids=["tp=4", "world size 1", "dp=2 only"])
def test_reference_parallelize_matches_one_process_on_other_layouts(layout, world_size):
    got = run_ranks(_train, (layout, 3, "float32", 3), world_size=world_size, timeout=90,
                    echo=False, preload=PRELOAD)
    want = comp.one_process_losses(comp.masked_batches(3, 4, seed=3), 3)
    for losses in got:
        assert losses == pytest.approx(want, rel=1e-5)


def test_reference_parallelize_in_bf16_follows_the_bf16_one_process_curve():
    got = run_ranks(_train, ((2, 2, 1), 3, "bfloat16", 4), world_size=4, timeout=90,
                    echo=False, preload=PRELOAD)
    model = comp.encoder(4).to(torch.bfloat16)
    optimizer = comp.optimizer_for(model)
    want = []
    for tokens, targets in comp.masked_batches(3, 4, seed=4):
        loss = comp.masked_lm_loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        want.append(loss.item())
    for losses in got:
        assert losses == pytest.approx(want, rel=2e-2)  # bf16 sums in another order per layout


def _measured_traffic(layout):
    from kit.trace import trace

    dp, tp, pp = layout
    mesh = ref.build_mesh(dist.get_world_size(), dp, tp, pp)
    model = ref.parallelize(comp.encoder(0), mesh)
    optimizer = comp.optimizer_for(model)
    batches = comp.masked_batches(2, 4)
    comp.train_steps(model, mesh, batches[:1], optimizer)
    with trace() as t:
        comp.train_steps(model, mesh, batches[1:], optimizer, report=False)
    got = axis_bytes(t.events, mesh)
    return {axis: got.get(axis, 0) for axis in ("dp", "tp", "other")}


@pytest.mark.parametrize("layout", [(4, 1, 1), (1, 4, 1), (2, 2, 1)],
                         ids=["dp=4", "tp=4", "dp=2 tp=2"])
def test_the_traffic_formula_is_what_the_recorder_counts_on_every_layout(layout):
    dp, tp, _ = layout
    got = run_ranks(_measured_traffic, (layout,), world_size=4, timeout=90, echo=False,
                    preload=PRELOAD)
    want = ref.axis_traffic(comp.encoder(0), dp, tp, 4, comp.SEQ_LEN)
    for rank in got:
        assert rank == {"dp": want["dp"], "tp": want["tp"], "other": 0}


def _mesh_groups(world):
    mesh = ref.build_mesh(world, 2, 2, 2)
    assert mesh.mesh_dim_names == AXES
    return {axis: sorted(dist.get_process_group_ranks(mesh[axis].get_group())) for axis in AXES}


def test_a_3d_mesh_puts_tp_on_neighbours_and_pp_farthest_apart():
    got = run_ranks(_mesh_groups, (8,), world_size=8, timeout=90, echo=False)
    assert got[5] == {"pp": [1, 5], "dp": [5, 7], "tp": [4, 5]}
    assert all(r["tp"] == [2 * (i // 2), 2 * (i // 2) + 1] for i, r in enumerate(got))


def test_build_mesh_names_the_sizes_when_they_do_not_fit(solution):
    with pytest.raises(ValueError, match=r"2 \* 2 \* 1 = 4, but the world has 6 ranks"):
        solution.build_mesh(6, 2, 2, 1)
    with pytest.raises(ValueError, match="tp must be an int of at least 1"):
        solution.build_mesh(4, 4, 0, 1)


@pytest.mark.slow
def test_lesson14_runs_headless_and_shows_what_it_claims():
    result = run_headless(LESSON, timeout=600, budget=420)
    printed = printed_text(result)
    diffs = [float(line.rsplit("=", 1)[1]) for line in printed.splitlines()
             if line.startswith("max |loss - one process| =")]
    assert len(diffs) == 2 and max(diffs) < 1e-5, printed  # the 3-D mesh and the resumed run
    assert "resumed at step 3 with layout dp=4 tp=1" in printed
    for line in (x for x in printed.splitlines() if "bytes per step predicted" in x):
        predicted = line.split("predicted ")[1].split(", measured")[0]
        measured = eval(line.split("measured ")[1])  # noqa: S307 - the lesson's own dict
        assert eval(predicted) == {k: measured[k] for k in ("dp", "tp")}, line  # noqa: S307
    check_outputs(result)
