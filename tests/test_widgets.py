"""The ring all-reduce stepper shows the real algorithm: its states end where dist.all_reduce
ends, and every intermediate state is the one the ring schedule of Lesson 01 produces.

A failure here means the picture students step through disagrees with what they implement.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from kit.launcher import run_ranks
from kit.lessons.widgets import render_step, ring_all_reduce_steps, ring_stepper


@st.composite
def rank_chunk_grids(draw):
    p = draw(st.integers(1, 8))
    return [[draw(st.integers(-1000, 1000)) for _ in range(p)] for _ in range(p)]


@given(rank_chunk_grids())
def test_every_rank_ends_with_every_chunks_sum(data):
    p = len(data)
    steps = ring_all_reduce_steps(data)
    assert len(steps) == 2 * (p - 1) + 1
    sums = [sum(data[r][c] for r in range(p)) for c in range(p)]  # one process, the oracle
    assert steps[-1].values == [sums] * p
    assert all(parts == frozenset(range(p)) for row in steps[-1].parts for parts in row)


@given(rank_chunk_grids())
def test_after_reduce_scatter_rank_r_holds_the_full_sum_of_chunk_r_plus_1(data):
    p = len(data)
    state = ring_all_reduce_steps(data)[p - 1]
    assert state.phase == ("start" if p == 1 else "reduce-scatter")
    for r in range(p):
        c = (r + 1) % p
        assert state.values[r][c] == sum(data[q][c] for q in range(p))
        assert state.parts[r][c] == frozenset(range(p))


@given(rank_chunk_grids())
def test_each_step_every_rank_sends_one_chunk_right_and_receives_one_from_the_left(data):
    p = len(data)
    for step in ring_all_reduce_steps(data)[1:]:
        assert sorted(src for src, _, _ in step.sends) == list(range(p))
        assert all(dst == (src + 1) % p for src, dst, _ in step.sends)
    # in reduce-scatter a chunk's contributors only ever grow: no partial sum is overwritten
    for before, after in zip(ring_all_reduce_steps(data), ring_all_reduce_steps(data)[1:p]):
        assert all(b <= a for rb, ra in zip(before.parts, after.parts) for b, a in zip(rb, ra))


def _stepper_vs_all_reduce(n):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    local = torch.randn(n, generator=g, dtype=torch.float64)
    everyone = [torch.empty(n, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(everyone, local)
    steps = ring_all_reduce_steps([list(t.tensor_split(world_size)) for t in everyone])
    mine = torch.cat(steps[-1].values[rank])
    dist.all_reduce(local)  # torch's own, on the same data
    return torch.allclose(mine, local, rtol=1e-12, atol=1e-12), mine.numel()


@pytest.mark.parametrize("world_size, n", [(4, 10), (3, 2), (5, 17)])
def test_stepper_on_tensor_chunks_matches_a_real_all_reduce(world_size, n):
    result = run_ranks(_stepper_vs_all_reduce, (n,), {}, world_size=world_size, echo=False)
    assert list(result) == [(True, n)] * world_size


@settings(max_examples=10)
@given(rank_chunk_grids())
def test_rendered_step_labels_name_the_contributing_ranks(data):
    p = len(data)
    html = render_step(ring_all_reduce_steps(data)[-1])
    full = "+".join(f"{'abcdefgh'[r]}0" for r in range(p))
    assert html.count(f">{full}<") == p  # chunk 0 sums every rank, on every rank
    assert html.count("<tr>") == p + 1


def test_bad_grid_is_refused_with_the_row_lengths():
    with pytest.raises(ValueError, match=r"\[2, 1\]"):
        ring_all_reduce_steps([[1, 2], [3]])


def test_stepper_widget_redraws_the_chosen_step():
    box = ring_stepper(3)
    (play, slider), view = box.children[0].children, box.children[1]
    steps = ring_all_reduce_steps([[10 * r + c + 1 for c in range(3)] for r in range(3)])
    assert slider.max == play.max == len(steps) - 1 == 4
    assert view.value == render_step(steps[0])
    slider.value = 3
    assert view.value == render_step(steps[3])
    assert "all-gather, step 1 of 2" in view.value
    with pytest.raises(ValueError, match="world_size"):
        ring_stepper(9)
