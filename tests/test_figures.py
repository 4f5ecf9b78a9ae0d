"""The diagrams of Lessons 06, 08 and 09 (kit.lessons.figures): they draw headless, they draw
what the prose says (the collectives named at f, g and ḡ, the ring's rotation, DCP's overlaps),
and each lesson calls its figure where its prose explains it."""

from __future__ import annotations

import itertools
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from autograder import course
from kit.lessons import figures  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _texts(fig) -> str:
    return "\n".join(t.get_text() for ax in fig.axes for t in ax.texts + [ax.title])


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


def test_tensor_parallel_mlp_names_f_and_g_and_their_collectives():
    for t in (2, 4):
        text = _texts(figures.tensor_parallel_mlp(t))
        assert "f  forward: identity\n    backward: all-reduce dX" in text
        assert "g  forward: all-reduce\n    backward: identity" in text
        assert all(f"rank {r}" in text for r in range(t)) and f"rank {t}" not in text


def test_sequence_parallel_mlp_is_korthikantis_figure_5():
    text = _texts(figures.sequence_parallel_mlp(2))
    assert "g  forward: all-gather (sequence)\n    backward: reduce-scatter" in text
    assert "ḡ  forward: reduce-scatter (sequence)\n    backward: all-gather" in text
    assert "Korthikanti et al. 2022, Fig. 5" in text
    assert text.count("(b, s/t, h)") == 4  # LayerNorm and dropout on each rank's tokens only


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_ring_blocks_send_right_and_show_every_block_once(world_size):
    held = figures.ring_blocks(world_size)
    assert held[0] == list(range(world_size))  # each rank starts with its own block
    for rank in range(world_size):
        assert sorted(step[rank] for step in held) == list(range(world_size))
    for before, after in itertools.pairwise(held):  # what rank r held, rank r + 1 holds next
        assert all(after[(r + 1) % world_size] == before[r] for r in range(world_size))
    assert len(figures.ring_rotation(world_size).axes) == 2


def test_piece_overlaps_cover_each_loading_rank_once():
    saved = [(0, 8), (8, 8), (16, 8), (24, 8)]
    for world_size in (1, 2, 3, 5):
        loaded = [(int(r[0]), len(r)) for r in torch.arange(32).chunk(world_size)]
        overlaps = figures.piece_overlaps(saved, loaded)
        for rank, (lo, n) in enumerate(loaded):
            rows = [row for q, p, a, b in overlaps if q == rank for row in range(a, b)]
            assert rows == list(range(lo, lo + n))  # every row read once, in order
        for _, p, a, b in overlaps:
            so, sn = saved[p]
            assert so <= a < b <= so + sn  # from the piece that holds it
    assert figures.piece_overlaps([(0, 4), (4, 0), (4, 4)], [(2, 4)]) == [
        (0, 0, 2, 4),
        (0, 2, 4, 6),
    ]
    text = _texts(figures.dcp_flow(saved, [(0, 11), (11, 11), (22, 10)], 32, "model.tok.weight"))
    assert "load rank 1: rows 11..22\nreads files 1, 2" in text and ".metadata last" in text


def test_fsdp2_shards_rows_as_torch_chunk_does_as_lesson06_figure_says():
    from kit import launch
    from kit.lessons.resume import make_model, shard_model

    def rows():
        return shard_model(make_model()).tok.weight.to_local().shape[0]

    assert launch(rows, world_size=3) == [len(r) for r in torch.arange(32).chunk(3)] == [11, 11, 10]


def test_triangle_geometry_labels_the_three_edges():
    fig = figures.triangle_geometry(length=8, i=1, j=5, k=3)
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == [
        "z$_{ij}$: updated (query)",
        "z$_{ik}$: keys, values",
        "z$_{jk}$: bias b$_{jk}$",
    ]
    assert "output row i = 1 needs row i of z" in _texts(fig)


@pytest.mark.parametrize(
    "source, call, after, before",
    [
        (course.lesson(8).stem, "figures.tensor_parallel_mlp(", "### f and g", "### Task 8.1"),
        (
            course.lesson(8).stem,
            "figures.sequence_parallel_mlp(",
            "## 2. Sequence parallelism",
            "### Task 8.2",
        ),
        (
            course.lesson(6).stem,
            "figures.dcp_flow(",
            "At load time every rank says",
            "## 3. Task 6.1",
        ),
        (course.lesson(9).stem, "figures.ring_rotation(", "## 5. Long sequences", "### Task 9.3"),
        (course.lesson(9).stem, "figures.triangle_geometry(", "## 6. AlphaFold 2", "### Task 9.4"),
    ],
)
def test_each_lesson_draws_its_figure_where_its_prose_explains_it(source, call, after, before):
    text = (ROOT / "solutions" / f"{source}.py").read_text()
    assert text.count(call) == 1, f"{source} should call {call}...) once"
    assert text.index(after) < text.index(call) < text.index(before)
