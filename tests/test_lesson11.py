"""Lesson 11's claims, proved against trusted references independently of the checks.

The solution's sampler equals the trusted loop sampler wherever the sample is fixed (full
fan-out) and keeps every invariant on random graphs and fan-outs (hypothesis); where pyg-lib is
importable, both give PyG NeighborLoader's per-hop sizes (skipped otherwise, with the reason).
PyG's own NodeLoader runs it through kit's adapter. The solution's halo plans equal the plan read
off the whole graph for any partition on 2-4 ranks; HaloGCNConv equals GCNConv on the real
peptide graph; the metered bound holds the solution well under it and a whole-graph table far
over it. The bytes 11.4 allows are exactly what the solution sends. The graphs and loaders in
kit.lessons.graphs keep their contracts; kit doctor reports pyg-lib; the lesson runs headless.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import seeded_bugs
from hypothesis import given, settings
from hypothesis import strategies as st
from lesson_support import check_outputs, pass_with_spawned_ranks, printed_text, run_headless

from autograder import course
from autograder.checking import run_checks
from autograder.lesson11 import (
    ROW_BOUND,
    check_invariants,
    directed_graph,
    full_graph_plan,
)
from autograder.references import lesson11 as reference
from autograder.registry import lesson_tasks
from kit import doctor
from kit.launcher import run_ranks
from kit.lessons.graphs import (
    FunctionSampler,
    amazon_products,
    in_neighbour_csr,
    local_graph,
    metis_partition,
    neighbor_loader,
    ogbn_products,
    partition_stats,
    peptide_graph,
    power_law_graph,
    pyg_lib_available,
    random_partition,
)

LESSON = 11
BUGS = seeded_bugs(LESSON)
SOURCE = course.lesson(LESSON).source
NEEDS_PYG_LIB = pytest.mark.skipif(
    not pyg_lib_available(), reason="pyg-lib (or torch-sparse) is not importable: PyG's "
    "NeighborLoader cannot sample here; neither installs from PyPI")


@pytest.mark.parametrize(
    ("task_id", "name"), [(t.id, n) for t in lesson_tasks(11) for n in t.forbidden]
)
def test_every_forbidden_name_of_lesson11_resolves(task_id, name):
    from autograder import gates

    assert gates.resolve(name, load=True) is not None, f"task {task_id} forbids {name!r}: nothing"


# --------------------------------------------------------------------------- 11.1


def _csr(seed: int, num_nodes: int = 300):
    edge_index = directed_graph(seed, num_nodes)
    return edge_index, *in_neighbour_csr(edge_index, num_nodes)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), seeds=st.integers(1, 40),
       fanouts=st.lists(st.integers(0, 14), min_size=1, max_size=3))
def test_solution_sampler_keeps_every_invariant_on_random_graphs(solution, seed, seeds, fanouts):
    edge_index, rowptr, col = _csr(seed)
    chosen = torch.randperm(300, generator=torch.Generator().manual_seed(seed))[:seeds]
    for sampler in (solution.sample_neighbors, reference.sample_neighbors):
        sub = sampler(rowptr, col, chosen, fanouts, torch.Generator().manual_seed(seed))
        check_invariants(sub._asdict(), edge_index, chosen, fanouts, "random graph")


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), seeds=st.integers(1, 30), hops=st.integers(1, 3))
def test_full_fanout_sample_equals_the_trusted_loop_sampler(solution, seed, seeds, hops):
    _, rowptr, col = _csr(seed)
    chosen = torch.randperm(300, generator=torch.Generator().manual_seed(seed))[:seeds]
    ours = solution.sample_neighbors(rowptr, col, chosen, [12] * hops, torch.Generator())
    trusted = reference.sample_neighbors(rowptr, col, chosen, [12] * hops, torch.Generator())
    assert torch.equal(ours.n_id, trusted.n_id)
    assert torch.equal(ours.edge_index, trusted.edge_index)
    assert ours.num_sampled_nodes == trusted.num_sampled_nodes
    assert ours.num_sampled_edges == trusted.num_sampled_edges


def test_every_subset_is_drawn_as_often_as_by_the_trusted_sampler(solution):
    # one node with 6 neighbours, fan-out 2: 15 subsets, each 1/15 of 3000 draws
    edge_index = torch.stack([torch.arange(1, 7), torch.zeros(6, dtype=torch.long)])
    rowptr, col = in_neighbour_csr(edge_index, 7)
    g = torch.Generator().manual_seed(0)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(3000):
        sub = solution.sample_neighbors(rowptr, col, torch.tensor([0]), [2], g)
        key = tuple(sorted(sub.n_id[1:].tolist()))
        counts[key] = counts.get(key, 0) + 1
    assert len(counts) == 15
    assert all(abs(c - 200) < 5.5 * (3000 * (1 / 15) * (14 / 15)) ** 0.5 for c in counts.values())


@NEEDS_PYG_LIB
def test_per_hop_sizes_equal_pyg_neighbor_loader_at_full_fanout(solution):
    for seed in range(5):
        edge_index, rowptr, col = _csr(seed)
        chosen = torch.randperm(300, generator=torch.Generator().manual_seed(seed))[:20]
        ours = solution.sample_neighbors(rowptr, col, chosen, [12, 12], torch.Generator())
        nodes, edges = reference.neighbor_loader_sizes(edge_index, 300, chosen, [12, 12])
        assert (ours.num_sampled_nodes, ours.num_sampled_edges) == (nodes, edges)


@NEEDS_PYG_LIB
def test_hop_zero_edges_equal_pyg_neighbor_loader_with_random_fanouts(solution):
    edge_index, rowptr, col = _csr(1)
    chosen = torch.arange(40)
    ours = solution.sample_neighbors(rowptr, col, chosen, [3, 2], torch.Generator())
    _, edges = reference.neighbor_loader_sizes(edge_index, 300, chosen, [3, 2])
    assert ours.num_sampled_edges[0] == edges[0]


@NEEDS_PYG_LIB
def test_neighbor_loader_is_pygs_own_where_pyg_lib_is_installed(solution):
    from torch_geometric.loader import NeighborLoader

    loader = neighbor_loader(
        peptide_graph(), [5, 5], sample=solution.sample_neighbors, batch_size=32
    )
    assert isinstance(loader, NeighborLoader)


def test_without_pyg_lib_pygs_node_loader_runs_the_students_sampler(solution, monkeypatch):
    from torch_geometric.loader import NodeLoader

    import kit.lessons.graphs as graphs

    monkeypatch.setattr(graphs, "pyg_lib_available", lambda: False)
    data = peptide_graph()
    seeds = torch.arange(0, 5200, 37)
    loader = neighbor_loader(data, [4, 3], sample=solution.sample_neighbors, input_nodes=seeds,
                             batch_size=50)
    assert isinstance(loader, NodeLoader) and isinstance(loader.node_sampler, FunctionSampler)
    seen = []
    for batch in loader:
        seen.append(batch.n_id[:batch.batch_size])
        assert torch.equal(batch.x, data.x[batch.n_id]) and torch.equal(batch.y, data.y[batch.n_id])
        assert sum(batch.num_sampled_nodes) == batch.num_nodes
        assert sum(batch.num_sampled_edges) == batch.edge_index.shape[1]
    assert torch.equal(torch.cat(seen), seeds)
    with pytest.raises(NotImplementedError, match="seed nodes only"):
        loader.node_sampler.sample_from_edges(None)


# --------------------------------------------------------------------------- 11.2


def _plans(halo_plan, part, edge_index):
    rank = dist.get_rank()
    plan = halo_plan(part, local_graph(edge_index, part, rank).edge_index, rank)
    return [[t.tolist() for t in plan.recv], [t.tolist() for t in plan.send]]


@settings(max_examples=6, deadline=None)
@given(world_size=st.integers(2, 4), seed=st.integers(0, 1000), skew=st.integers(0, 3))
def test_solution_plans_equal_the_whole_graph_plan_for_any_partition(
    solution, world_size, seed, skew
):
    edge_index = directed_graph(seed, 120, most=6)
    g = torch.Generator().manual_seed(seed)
    part = torch.randint(0, world_size, (120,), generator=g)
    part[: 30 * skew] = 0  # more and more of the nodes on rank 0
    got = run_ranks(
        _plans, (solution.halo_plan, part, edge_index), world_size=world_size, echo=False
    )
    for rank in range(world_size):
        want = full_graph_plan(edge_index, part, rank, world_size)
        assert got[rank] == [[t.tolist() for t in want.recv], [t.tolist() for t in want.send]]


def test_the_two_whole_graph_plans_agree():
    from autograder.lesson11 import PLAN_RANKS, plan_graph, plan_partitions

    brute = reference.brute_force_plans(0)
    edge_index = plan_graph(0)
    for name, part in plan_partitions(0).items():
        for rank in range(PLAN_RANKS):
            fast = full_graph_plan(edge_index, part, rank, PLAN_RANKS)
            assert [t.tolist() for t in fast.recv] == [
                t.tolist() for t in brute[name][rank]["recv"]
            ]
            assert [t.tolist() for t in fast.send] == [
                t.tolist() for t in brute[name][rank]["send"]
            ]


# --------------------------------------------------------------------------- 11.3


def _on_peptides(conv_cls, part):
    from torch_geometric.nn import GCNConv

    from autograder.lesson11 import full_graph_plan

    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = peptide_graph()
    lg = local_graph(data.edge_index, part, rank)
    plan = full_graph_plan(data.edge_index, part, rank, world_size)
    torch.manual_seed(0)
    ref = GCNConv(data.num_features, 16).double()
    conv = conv_cls(data.num_features, 16).double()
    conv.load_state_dict(ref.state_dict())
    x = data.x.double()
    return (conv(x[lg.own], plan, lg) - ref(x, data.edge_index)[lg.own]).abs().max().item()


@pytest.mark.parametrize("world_size", [2, 3])
def test_halo_gcn_conv_equals_gcn_conv_on_the_peptide_graph(solution, world_size):
    data = peptide_graph()
    part = metis_partition(data.edge_index, data.num_nodes, world_size)
    diffs = run_ranks(_on_peptides, (solution.HaloGCNConv, part), world_size=world_size, echo=False)
    assert max(diffs) < 1e-12


def test_the_memory_bound_holds_the_solution_under_half_and_a_whole_graph_table_far_over(solution):
    from autograder.lesson11 import CONV_RUNS
    from autograder.registry import fresh_runs

    fresh_runs()
    ours = max(r["measured"] for r in CONV_RUNS[4](solution.HaloGCNConv, 0))
    table = dict(BUGS["11.3"])["a table over all N global ids"]
    theirs = max(r["measured"] for r in CONV_RUNS[4](table, 0))
    assert ours < 0.5 * ROW_BOUND < 2 * ROW_BOUND < theirs
    report = run_checks("11.3", table)
    bound = next(c for c in report.cases if "bytes held per local row" in c.name)
    assert not bound.passed and "a table of all N nodes" in bound.message


def test_exchanging_inputs_fails_only_the_bytes_case():
    report = run_checks("11.3", dict(BUGS["11.3"])["exchanges the inputs before lin"])
    assert [c.name for c in report.cases if not c.passed] == [
        c.name for c in report.cases if "lin's outputs" in c.name]


# --------------------------------------------------------------------------- kit.lessons.graphs


def test_peptide_graph_is_the_real_undirected_knn_graph():
    data = peptide_graph()
    src, dst = data.edge_index
    assert data.num_nodes == 5200 and data.y.sum().item() == 2600
    assert not bool((src == dst).any())
    pairs = set(zip(src.tolist(), dst.tolist()))
    assert all((b, a) in pairs for a, b in pairs)  # undirected
    assert torch.bincount(dst, minlength=5200).min().item() >= 8  # its own 8, at least
    assert torch.allclose(data.x.norm(dim=1), torch.ones(5200))
    assert (data.y[src] == data.y[dst]).float().mean() > 0.7  # similar peptides share a class


def test_power_law_graph_has_a_heavy_tail_and_is_reproducible():
    a, b = power_law_graph(20_000, 8, seed=3), power_law_graph(20_000, 8, seed=3)
    assert torch.equal(a.edge_index, b.edge_index) and torch.equal(a.x, b.x)
    src, dst = a.edge_index
    assert not bool((src == dst).any())
    assert torch.equal(torch.sort(dst * 20_000 + src).values, torch.sort(src * 20_000 + dst).values)
    deg = torch.bincount(dst, minlength=20_000)
    assert deg.max() > 50 * deg.float().median()
    assert (a.y[src] == a.y[dst]).float().mean() > 0.5  # homophily 0.8 of the drawn edges


def test_metis_cuts_fewer_edges_than_a_random_partition_and_stays_balanced():
    data = peptide_graph()
    metis = partition_stats(data.edge_index, metis_partition(data.edge_index, data.num_nodes, 4), 4)
    rand = partition_stats(data.edge_index, random_partition(data.num_nodes, 4), 4)
    assert metis["edge_cut"] < rand["edge_cut"] / 3
    assert metis["balance"] < 1.05 and sum(metis["halo"]) < sum(rand["halo"])


def test_local_graph_holds_the_sorted_own_nodes_and_every_edge_into_them():
    data = peptide_graph()
    part = random_partition(data.num_nodes, 3)
    total = 0
    for r in range(3):
        lg = local_graph(data.edge_index, part, r)
        assert torch.equal(lg.own, torch.sort(lg.own).values) and bool((part[lg.own] == r).all())
        assert bool((part[lg.edge_index[1]] == r).all())
        total += lg.edge_index.shape[1]
    assert total == data.edge_index.shape[1]


@pytest.mark.parametrize("loader", [amazon_products, ogbn_products])
def test_real_loaders_say_how_to_get_the_data_and_download_nothing(loader, tmp_path):
    with pytest.raises(FileNotFoundError, match="Nothing in this course downloads it") as e:
        loader(tmp_path)
    assert "internet" in str(e.value) and str(tmp_path) in str(e.value)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- kit doctor


def test_doctor_says_whether_pyg_lib_is_there_and_what_it_changes(monkeypatch):
    import importlib.util

    finding = doctor.check_pyg_lib()
    assert finding.check == "pyg-lib (optional)"
    if pyg_lib_available():
        assert finding.status == doctor.OK and "NeighborLoader" in finding.detail
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    missing = doctor.check_pyg_lib()
    assert missing.status == doctor.WARN and "NodeLoader" in missing.detail
    assert "data.pyg.org" in missing.fix and torch.__version__.split("+")[0] in missing.fix
    assert "pyg-lib (optional)" in doctor.format_table([missing])


# --------------------------------------------------------------------------- 11.4


def test_the_bytes_bound_is_exactly_what_the_solution_sends_and_every_scene_can_fail(solution):
    from autograder.lesson11 import FETCH_RANKS, FETCH_SCENES, _fetch_on_rank, fetch_setup

    ranks = run_ranks(_fetch_on_rank, (solution.fetch_features, 0), world_size=FETCH_RANKS)
    expected = reference.rows_of_whole_matrix(0)
    for scene in FETCH_SCENES:
        sent = [sum(b for _, _, b in r[scene]["ops"]) for r in ranks]
        assert sent == [b["total"] for b in expected[scene]["bytes"]], scene
        setup = fetch_setup(0, scene)
        for rank, ids in enumerate(setup["needed"]):  # repeats and local ids in every request
            empty = scene.startswith("a rank that") and rank == 1
            owns = (setup["part"] == rank).any()
            assert empty or (ids.unique().numel() < ids.numel()
                             and (setup["part"][ids] == rank).any() == owns), (scene, rank)
            cached = torch.isin(ids, setup["cached"][rank]).any()
            assert bool(cached) == (scene == "a cache"), (scene, rank)
    assert not (fetch_setup(0, FETCH_SCENES[2])["part"] == 2).any()  # rank 2 owns nothing


# --------------------------------------------------------------------------- the lesson


@pytest.mark.slow
def test_lesson11_runs_headless_with_its_solutions_and_shows_what_it_claims():
    import re

    result = run_headless(LESSON, timeout=300, budget=300)
    printed = printed_text(result)
    diffs = re.search(r"max \|HaloGCNConv - GCNConv\| per rank: \[(.*)\]", printed).group(1)
    assert max(float(d) for d in diffs.split(",")) < 1e-5
    # equal step counts on every rank, for every world size
    assert all(
        len(set(m.split(", "))) == 1 for m in re.findall(r"on every rank \(\[(.*?)\]\)", printed)
    )
    assert "AmazonProducts is not on this machine" in printed
    ratios = re.findall(r"METIS cuts (.*) fewer edges than a random split", printed)
    assert len(ratios) == 2 and all(float(r.rstrip("x")) > 2.5 for line in ratios
                                    for r in line.split(", ")), ratios
    # 11.4's demo: the fetched rows are x[n_id]; they outweigh the gradients; a degree-ordered
    # cache hits more than twice as often as a random one of the same size, more as it grows
    assert printed.count("rows equal x[n_id] on every rank: True") == 2
    assert int(re.search(r"feature rows outweigh the gradients (\d+)x", printed).group(1)) > 1
    rates = {name: [int(p) for p in re.findall(r"(\d+)% at", line)] for name, line in
             re.findall(r"^(highest degree|random) +cache: hit rate (.*)$", printed, re.M)}
    by_degree, at_random = rates["highest degree"], rates["random"]
    assert by_degree == sorted(by_degree) and all(d > 2 * r for d, r in zip(by_degree, at_random))
    check_outputs(result)


@pytest.mark.slow
def test_checks_pass_with_spawned_ranks_as_on_macos(solution, monkeypatch):
    pass_with_spawned_ranks(monkeypatch, solution, {"11.2": -1, "11.3": -1})


def test_a_sampler_that_stops_at_an_empty_frontier_fails_the_edges_case_naming_the_regime(bugs):
    from autograder.checking import run_checks

    report = run_checks("11.1", dict(bugs["11.1"])[
        "stops at a hop with an empty frontier: fewer hops counted"])
    edges = next(c for c in report.cases if c.name.startswith("the edges"))
    assert edges.status == "failed" and "an isolated seed" in edges.message, report.to_text()
    assert "Empty hops still count" in edges.hint
