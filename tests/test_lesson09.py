"""Lesson 09's claims against trusted references, beyond the checks (tests/test_checks.py runs
the solutions, stubs and seeded bugs through them).

The kit's triangle attention equals Algorithm 13 written out with einsum; the solutions agree
with fair-esm's batching, torch's SDPA and the unchunked module for many shapes (hypothesis),
also on a process subgroup; LiveBytes counts what it claims; the fast tokeniser equals
fair-esm's; the ESM-2 parameter counts match the published names; and the lesson runs
headless with the numbers it prints in its prose.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from lesson_support import (
    check_outputs,
    fails_exactly,
    fails_only_its_bounds,
    printed_text,
    run_headless,
)
from torch.nn import functional as F

from autograder import course
from autograder.checking import run_checks
from autograder.registry import get_task
from kit.launcher import run_ranks
from kit.lessons.proteins import (
    ESM2_FAMILY,
    LiveBytes,
    TriangleAttentionStartingNode,
    alphabet,
    alphafold_pair_memory,
    esm2_parameter_count,
    load_peptides,
    load_pretrained_esm2,
    tokenize,
)

LESSON = 9
SOURCE = course.lesson(LESSON).source


# --------------------------------------------------------------------------- kit.lessons.proteins


def _algorithm_13(module: TriangleAttentionStartingNode, z: torch.Tensor) -> torch.Tensor:
    """AF2 supplement Algorithm 13, line by line with einsum (no chunking, no reshapes)."""
    h, c = module.heads, module.c
    x = module.norm(z)  # (i, j, c_z)
    q, k, v = module.qkv(x).unflatten(-1, (3, h, c)).unbind(-3)  # (i, j, h, c) each
    b = module.bias(x)  # (j, k, h)
    g = torch.sigmoid(module.gate(x)).unflatten(-1, (h, c))  # (i, j, h, c)
    a = torch.einsum("ijhc,ikhc->ijkh", q, k) / math.sqrt(c) + b[None]  # (i, j, k, h)
    a = a.softmax(dim=2)
    o = g * torch.einsum("ijkh,ikhc->ijhc", a, v)
    return module.out(o.flatten(-2))


def test_triangle_attention_is_algorithm_13():
    module = TriangleAttentionStartingNode(c_z=8, c=4, heads=3, dtype=torch.float64)
    z = torch.randn(11, 11, 8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(module(z), _algorithm_13(module, z), rtol=0, atol=1e-12)


def test_triangle_attention_rejects_a_block_of_columns_with_a_message_naming_rows():
    module = TriangleAttentionStartingNode()
    z = torch.randn(10, 10, 16)
    with pytest.raises(ValueError, match="first axis"):
        module(z[:, :4], module.pair_bias(z))


def test_live_bytes_counts_allocations_once_and_releases_them():
    with LiveBytes() as live:
        a = torch.zeros(1000)  # 4000 bytes
        view = a.view(10, 100)  # the same storage: not counted again
        b = torch.ones(500)  # 2000 bytes: 6000 alive
        del b
        c = torch.ones(250)  # 1000 bytes: 5000 alive
    assert (live.peak, live.largest, live.live) == (6000, 4000, 5000)
    del a, view, c
    assert live.live == 0


def test_live_bytes_ignores_tensors_made_before_the_block():
    x = torch.zeros(1000)
    with LiveBytes() as live:
        y = x.view(-1)
        x.add_(1)
    assert live.peak == 0 and y is not None


@pytest.mark.parametrize("length", [32, 48])
def test_calculator_predicts_the_largest_triangle_tensor(length):
    module = TriangleAttentionStartingNode(c_z=16, c=8, heads=4)
    with torch.no_grad(), LiveBytes() as live:
        module(torch.randn(length, length, 16))
    assert live.largest == alphafold_pair_memory(length, c_z=16, heads=4, c=8)["logits"]
    assert module.peak_logits * 4 == live.largest


def test_fast_tokenize_equals_fair_esm_batch_converter_on_every_peptide():
    vocab = alphabet()
    sequences = load_peptides("AMPvsUniProt")[0] + load_peptides("AMPvsTMset")[0]
    _, _, reference = vocab.get_batch_converter()([(str(i), s) for i, s in enumerate(sequences)])
    assert torch.equal(tokenize(sequences, vocab), reference)


def test_peptide_sets_have_both_classes_in_equal_numbers():
    for name, n in (("AMPvsUniProt", 5200), ("AMPvsTMset", 412)):
        sequences, labels, classes = load_peptides(name)
        assert len(sequences) == n and labels.sum().item() == n // 2 and classes[1] == "AMP"
        assert all(s.isalpha() and s.isupper() for s in sequences)


def test_esm2_parameter_counts_match_the_published_sizes():
    published = {"8M": 8e6, "35M": 35e6, "150M": 150e6, "650M": 650e6, "3B": 3e9, "15B": 15e9}
    for name in ESM2_FAMILY:
        size = name.split("_")[2]
        assert abs(esm2_parameter_count(name) / published[size] - 1) < 0.1, name


def test_pretrained_weights_are_never_downloaded(tmp_path):
    with pytest.raises(
        FileNotFoundError, match="dl.fbaipublicfiles.com/fair-esm/models/esm2_t6_8M_UR50D.pt"
    ):
        load_pretrained_esm2("esm2_t6_8M_UR50D", path=tmp_path / "missing.pt")


# ------------------------------------------------------------------------ solutions vs references


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 80), min_size=0, max_size=60),
    max_tokens=st.integers(1, 300),
    world_size=st.integers(1, 5),
    seed=st.integers(0, 3),
    epoch=st.integers(0, 3),
)
def test_token_budget_batches_are_fair_esm_batches_dealt_evenly(solution, lengths, max_tokens,
                                                                world_size, seed, epoch):
    from esm.data import FastaBatchedDataset

    fair = FastaBatchedDataset([str(i) for i in range(len(lengths))], ["A" * n for n in lengths])
    want = {tuple(b) for b in fair.get_batch_indices(max_tokens)}
    dealt = [solution.token_budget_batches(lengths, max_tokens, r, world_size, seed, epoch)
             for r in range(world_size)]
    assert {tuple(b) for r in dealt for b in r} == want
    assert len({len(r) for r in dealt}) == 1
    assert len(dealt[0]) == math.ceil(len(want) / world_size)


def test_mask_tokens_at_probability_0_and_1(solution):
    vocab = alphabet()
    tokens = tokenize(load_peptides("AMPvsTMset")[0][:50], vocab)
    special = (tokens == vocab.cls_idx) | (tokens == vocab.eos_idx) | (tokens == vocab.padding_idx)
    inputs, labels = solution.mask_tokens(
        tokens, vocab, torch.Generator().manual_seed(0), mask_prob=0.0
    )
    assert torch.equal(inputs, tokens) and (labels == -100).all()
    inputs, labels = solution.mask_tokens(
        tokens, vocab, torch.Generator().manual_seed(0), mask_prob=1.0
    )
    assert torch.equal(labels != -100, ~special)


def _ring_in_groups(ring_attention, length_per_rank, dtype):
    """Ranks {0, 1} and {2, 3} each run ring attention in their own subgroup."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    g = torch.Generator().manual_seed(rank // 2)
    q, k, v = (
        torch.randn(2, 3, 2 * length_per_rank, 4, generator=g, dtype=dtype) for _ in range(3)
    )
    mask = torch.zeros(2, 2 * length_per_rank, dtype=torch.bool)
    mask[0, -3:] = True
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask[:, None, None, :])
    mine = slice((rank % 2) * length_per_rank, (rank % 2 + 1) * length_per_rank)
    got = ring_attention(
        q[:, :, mine], k[:, :, mine], v[:, :, mine], key_padding_mask=mask[:, mine], group=group
    )
    return (got - want[:, :, mine]).abs().max().item()


def test_ring_attention_works_on_a_subgroup(solution):
    errors = run_ranks(
        _ring_in_groups, (solution.ring_attention, 5, torch.float64), world_size=4, echo=False
    )
    assert max(errors) < 1e-12


def _ring_vs_sdpa(ring_attention, chunk, heads, dim, seed, density=0.3):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    length = chunk * world_size
    q, k, v = (
        torch.randn(2, heads, length, dim, generator=g, dtype=torch.float64) * 3 for _ in range(3)
    )
    # skewed padding: none, some, nearly all, all (a sequence with no key: SDPA gives 0 there)
    mask = torch.rand(2, length, generator=g) < density
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask[:, None, None, :])
    mine = slice(rank * chunk, (rank + 1) * chunk)
    got = ring_attention(
        q[:, :, mine], k[:, :, mine], v[:, :, mine], key_padding_mask=mask[:, mine]
    )
    return (got - want[:, :, mine]).abs().max().item()


@settings(max_examples=8, deadline=None)
@given(world_size=st.integers(1, 4), chunk=st.integers(1, 6), heads=st.integers(1, 3),
       dim=st.sampled_from([1, 4, 16]), seed=st.integers(0, 100),
       density=st.sampled_from([0.0, 0.3, 0.9, 1.0]))
def test_ring_attention_equals_sdpa_for_any_shape_and_padding(
    solution, world_size, chunk, heads, dim, seed, density
):
    errors = run_ranks(_ring_vs_sdpa, (solution.ring_attention, chunk, heads, dim, seed, density),
                       world_size=world_size, echo=False)
    assert max(errors) < 1e-10  # nan fails it too


def test_an_all_padding_nan_loses_only_the_edge_cases_with_feedback_naming_the_regime(bugs):
    report = run_checks("9.3", dict(bugs["9.3"])[
        "divides by a running sum of 0 where a sequence is all padding (nan, not SDPA's 0)"])
    failed = [c for c in report.cases if c.status != "passed"]
    assert [c.name.split(":")[0] for c in failed] == [
        "a sequence that is all padding", "one rank (world size 1)"], report.to_text()
    for case in failed:
        assert "all padding" in case.message and "not finite" in case.message, case.message
        assert "SDPA" in case.hint, case.hint
    assert report.score == pytest.approx(get_task("9.3").points - sum(c.max_points for c in failed))


@settings(max_examples=25, deadline=None)
@given(length=st.integers(1, 12), chunk_size=st.integers(1, 14))
def test_chunked_equals_the_whole_module(solution, length, chunk_size):
    module = TriangleAttentionStartingNode(c_z=8, c=4, heads=2, dtype=torch.float64)
    z = torch.randn(length, length, 8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(
            solution.chunked(module, z, chunk_size), module(z), rtol=0, atol=1e-12
        )
    assert module.rows_seen == [length]  # only module(z) itself: chunked writes its own attention


# --------------------------------------------------------------------------- the meter's bounds

# Each mistake gives the right values (and, for the ring, the right traffic): only the meter sees
# it.
BOUND_ONLY = [("9.3", "keeps every block it received (right values and traffic)",
               "its memory grows with the whole sequence L"),
              ("9.4", "every row's logits at once",
               "chunking's heads·chunk·L² in place of heads·L³ is lost")]


@pytest.mark.parametrize("task_id,bug,lost", BOUND_ONLY, ids=["9.3", "9.4"])
def test_a_mistake_that_keeps_what_the_technique_frees_fails_only_its_bound(
    bugs, task_id, bug, lost
):
    fails_only_its_bounds(task_id, dict(bugs[task_id])[bug], lost, at_least=2.0)


# --------------------------------------------------------------------------- the lesson


@pytest.mark.slow
def test_lesson09_runs_headless_with_its_solutions_and_shows_what_it_claims():
    result = run_headless(LESSON, timeout=600, budget=360)  # the lesson's budget on 2 quiet cores
    printed = printed_text(result)
    loss = re.search(
        r"MLM loss ([\d.]+) \(first 10\) -> ([\d.]+) \(last 10\); perplexity ([\d.]+)", printed
    )
    assert loss and float(loss[2]) < float(loss[1]) and float(loss[3]) < 20  # better than uniform
    pads = dict(
        re.findall(r"^(random, fixed size|token budget)\s+(\d+) padding tokens", printed, re.M)
    )
    assert int(pads["token budget"]) * 2 <= int(pads["random, fixed size"])
    per_rank = re.search(r"(\[\d+, \d+, \d+, \d+\]) batches per rank", printed)
    assert len(set(json.loads(per_rank[1]))) == 1
    assert re.search(r"FSDP2 / DDP: [\d.]+x", printed)
    assert re.search(r"ESM-2, pretrained\s+test accuracy 0\.\d+", printed)
    peaks = {
        name: [float(x) for x in re.findall(r"L=\d+:\s+([\d.]+) MiB", line)]
        for name, line in re.findall(
            r"^(ring|all-gather K/V|one process, whole sequence)\s+(.*)$", printed, re.M
        )
    }
    assert all(r < a < w for r, a, w in zip(peaks["ring"], peaks["all-gather K/V"],
                                            peaks["one process, whole sequence"]))
    assert "never downloads weights" in printed
    from kit.lessons.precision import cpu_has_native_bf16

    assert re.search(r"^bf16 autocast: (on|off)\b", printed, re.M)[1] == (
        "on" if cpu_has_native_bf16() else "off"
    )
    check_outputs(result)


# --------------------------------------------------------------------------- the edges (issue 44)


@pytest.mark.parametrize(("task_id", "bug", "case", "regime"), [
    ("9.1", "forces one target in every sequence that has a residue", "mask_prob = 0",
     "mask_prob = 0"),
    ("9.1", "a special token where it has no residue", "nothing maskable",
     "rows of only cls, eos and pad"),
    ("9.1", "mask_prob outside [0, 1]: no ValueError", "mask_prob outside", "is not a probability"),
    ("9.4", "chunk_size below 1: no ValueError", "chunk_size below 1", "chunk_size 0"),
])
def test_a_seeded_bug_at_an_edge_fails_exactly_its_case_naming_the_regime(bugs, task_id, bug, case,
                                                                            regime):
    impl = next(impl for label, impl in bugs[task_id] if bug in label)
    failed, report = fails_exactly(task_id, impl, case)
    assert regime in failed[0].message, report.to_text()
