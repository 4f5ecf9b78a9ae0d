"""Lesson 10's claims against trusted references, beyond the checks (tests/test_checks.py runs
solution, stub and seeded bugs through them).

PyG's own Batch.from_data_list for any list of graphs (hypothesis), E(3) symmetry of the EGNN
solution for any orthogonal matrix, DeepChem's scaffold-split invariants (no scaffold in two
splits, cutoffs respected), RDKit's CalcEnrichment/CalcBEDROC for any screen with ties, the
same global metrics for any sharding over 1-4 ranks, the DUD-E decoy rules, and the lesson
running headless.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lesson_support import check_outputs, printed_text, run_headless

from autograder import course
from autograder.references.lesson10 import (
    reference_bedroc,
    reference_enrichment_factor,
    reference_scaffold_split,
    reference_screen,
)
from kit.launcher import run_ranks

LESSON = 10
SOURCE = course.lesson(LESSON).source


# --------------------------------------------------------------------------- 10.1


def _random_graph(cls, n, e, t, seed):
    g = torch.Generator().manual_seed(seed)
    return cls(x=torch.randint(0, 5, (n, 9), generator=g),
               edge_index=torch.randint(0, max(n, 1), (2, e), generator=g) if n else
               torch.zeros(2, 0, dtype=torch.long),
               edge_attr=torch.randint(0, 3, (e, 3), generator=g),
               pos=torch.randn(n, 3, generator=g), y=torch.randn(1, generator=g),
               triplet_index=torch.randint(0, max(n, 1), (3, t), generator=g) if n else
               torch.zeros(3, 0, dtype=torch.long))


@settings(max_examples=25, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 20), st.integers(0, 15)),
                       min_size=1, max_size=6), seed=st.integers(0, 1000))
def test_collate_equals_pyg_batch_from_data_list_for_any_graphs(solution, shapes, seed):
    from torch_geometric.data import Batch

    graphs = [_random_graph(solution.MolData, n, e if n else 0, t if n else 0, seed + i)
              for i, (n, e, t) in enumerate(shapes)]
    ours, pygs = solution.collate(graphs), Batch.from_data_list(graphs)
    for key in ("x", "edge_index", "edge_attr", "pos", "y", "triplet_index", "batch", "ptr"):
        assert torch.equal(ours[key], pygs[key]), key
    assert ours.num_graphs == pygs.num_graphs == len(graphs)
    # and the triplets point at the same atoms as before batching
    for g, graph in enumerate(graphs):
        lo = int(pygs.ptr[g])
        cols = slice(sum(x.triplet_index.shape[1] for x in graphs[:g]),
                     sum(x.triplet_index.shape[1] for x in graphs[:g + 1]))
        assert torch.equal(ours.triplet_index[:, cols] - lo, graph.triplet_index)


# --------------------------------------------------------------------------- 10.2


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), reflect=st.booleans())
def test_egnn_solution_is_e3_equivariant_for_any_orthogonal_matrix(solution, seed, reflect):
    from kit.lessons.molecules import egfr_actives, mol_graph

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    layer = solution.EGNNLayer(8, edge_dim=2).double()
    graph = mol_graph(egfr_actives()[seed % 365])
    h = torch.randn(graph["x"].shape[0], 8, generator=g, dtype=torch.float64)
    a = torch.randn(graph["edge_index"].shape[1], 2, generator=g, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))
    if reflect != bool(torch.linalg.det(q) < 0):
        q = -q
    t = torch.randn(3, generator=g, dtype=torch.float64) * 5
    pos = graph["pos"].double()
    with torch.no_grad():
        h1, x1 = layer(h, pos, graph["edge_index"], a)
        h2, x2 = layer(h, pos @ q.T + t, graph["edge_index"], a)
    assert (h2 - h1).abs().max() < 1e-9
    assert (x2 - (x1 @ q.T + t)).abs().max() < 1e-9


# --------------------------------------------------------------------------- 10.3


def test_scaffold_split_never_puts_one_scaffold_in_two_splits_and_respects_the_cutoffs(solution):
    from rdkit.Chem.Scaffolds import MurckoScaffold

    from kit.lessons.molecules import freesolv

    smiles = freesolv()[0]
    scaffold = [MurckoScaffold.MurckoScaffoldSmiles(smiles=s) for s in smiles]
    for fracs in ((0.8, 0.1, 0.1), (0.5, 0.25, 0.25), (0.9, 0.05, 0.05)):
        train, valid, test = solution.scaffold_split(smiles, *fracs)
        assert sorted(train + valid + test) == list(range(len(smiles)))
        owners = [{scaffold[i] for i in part} for part in (train, valid, test)]
        assert not (owners[0] & owners[1] or owners[0] & owners[2] or owners[1] & owners[2])
        assert len(train) <= fracs[0] * len(smiles)
        # (train + valid may pass the valid cutoff: a small set can still join train later)
        assert (train, valid, test) == reference_scaffold_split(smiles, *fracs)


def test_the_lessons_worked_example_is_deepchems_split():
    import re

    text = SOURCE.read_text(encoding="utf-8")
    smiles = re.findall(r"^# \| \d+ \| `([^`]+)` \|", text, flags=re.MULTILINE)  # index | SMILES
    train, valid, test = (_json_list(x) for x in re.search(
        r"DeepChem gives train `(\[[\d, ]*\])`, valid `(\[[\d, ]*\])`, test `(\[[\d, ]*\])`",
        " ".join(text.replace("# ", "").split())).groups())
    assert len(smiles) == 10
    assert reference_scaffold_split(smiles, 0.6, 0.2, 0.2) == (train, valid, test)


def _json_list(text):
    import json

    return json.loads(text)


def test_deepchem_order_puts_the_later_of_two_equal_sets_first():
    # Two singleton scaffolds: DeepChem's key (len, first index) with reverse=True ranks index 1
    # (cyclohexane) before index 0 (benzene), so with room for one molecule, 1 goes to train.
    assert reference_scaffold_split(["c1ccccc1", "C1CCCCC1"], 0.5, 0.5, 0.0) == ([1], [0], [])


# --------------------------------------------------------------------------- 10.4


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 300), levels=st.integers(1, 6), p=st.floats(0.01, 0.9),
       fraction=st.sampled_from([0.01, 0.02, 0.05, 0.1, 0.3]),
       alpha=st.sampled_from([1.0, 20.0, 80.0]), seed=st.integers(0, 10_000))
def test_metrics_equal_rdkit_for_any_screen_with_ties(
    solution, n, levels, p, fraction, alpha, seed
):
    # n >= 2 and fraction <= 0.3 keep ceil(n * fraction) < n, where RDKit returns a value.
    g = torch.Generator().manual_seed(seed)
    labels = torch.rand(n, generator=g) < p
    scores = torch.randint(0, levels, (n,), generator=g).double() + labels * 0.5
    assert solution.enrichment_factor(scores, labels, fraction) == pytest.approx(
        reference_enrichment_factor(scores, labels, fraction), rel=1e-9, abs=1e-12)
    assert solution.bedroc(scores, labels, alpha) == pytest.approx(
        reference_bedroc(scores, labels, alpha), rel=1e-9, abs=1e-12)


def _sharded_metrics(screen_metrics, shards):
    import torch.distributed as dist

    return screen_metrics(*shards[dist.get_rank()])


@settings(max_examples=6, deadline=None)
@given(world_size=st.integers(1, 4), n=st.integers(120, 400), seed=st.integers(0, 1000))
def test_screen_metrics_equal_one_process_for_any_sharding(solution, world_size, n, seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.rand(n, generator=g) < 0.1
    scores = torch.randint(0, 8, (n,), generator=g).double() + labels.double()
    ids = torch.randperm(10 * n, generator=g)[:n]
    cuts = sorted(torch.randint(0, n + 1, (world_size - 1,), generator=g).tolist())
    bounds = [0, *cuts, n]
    shards = [(scores[a:b], labels[a:b], ids[a:b]) for a, b in zip(bounds, bounds[1:])]
    got = run_ranks(_sharded_metrics, (solution.screen_metrics, shards), world_size=world_size,
                    echo=False)
    want = reference_screen(scores, labels, ids)
    for result in got:
        assert result["top100"] == want["top100"]
        assert result["ef1"] == pytest.approx(want["ef1"], rel=1e-9)
        assert result["bedroc"] == pytest.approx(want["bedroc"], rel=1e-9)


# --------------------------------------------------------------------------- data


def test_decoys_follow_the_dude_rules_on_a_slice():
    from rdkit import Chem, DataStructs
    from rdkit.Chem import rdFingerprintGenerator

    from kit.lessons.molecules import decoy_pool, egfr_actives, properties, property_matched_decoys

    actives = list(egfr_actives()[:20])
    decoys = property_matched_decoys(actives, decoy_pool()[:3000], per_active=3)
    assert 0 < len(decoys) <= 60 and len(set(decoys)) == len(decoys)
    morgan = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=2048)
    refs = [morgan.GetFingerprint(m) for m in actives]
    charges = {properties(m)[5] for m in actives}
    for smi in decoys:
        mol = Chem.MolFromSmiles(smi)
        assert max(DataStructs.BulkTanimotoSimilarity(morgan.GetFingerprint(mol), refs)) < 0.3
        assert properties(mol)[5] in charges


def test_data_files_ship_in_the_wheels():
    from kit.lessons.molecules import decoy_pool, egfr_actives, freesolv

    smiles, energies = freesolv()
    assert len(smiles) == len(energies) == 642
    actives = egfr_actives()
    assert len(actives) == 365 and actives[0].GetConformer().Is3D()
    assert len(decoy_pool()) == 14999


# --------------------------------------------------------------------------- the lesson


@pytest.mark.slow
def test_lesson10_runs_headless_with_its_solutions_and_shows_what_it_claims():
    result = run_headless(LESSON, timeout=600, budget=300)  # the lesson's budget on 2 cores
    printed = printed_text(result)
    assert (
        "scaffold   sizes" in printed and " 0.0% of test molecules have a scaffold seen" in printed
    )
    assert "same on every rank: True" in printed
    for n in (1, 2, 4):
        assert f"{n} rank(s):" in printed
    check_outputs(result)
