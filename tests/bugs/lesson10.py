"""Seeded bugs for Lesson 10: the typical mistakes the checks of tasks 10.1-10.4 must catch.

``BUGS[task_id]`` lists ``(what is wrong, implementation)``. Tasks 10.1 and 10.4 define several
names in one cell, and the checks find the companions (``MolData``; ``enrichment_factor``,
``bedroc``) beside the graded function, so each bug is the graded function bound to a module
namespace holding the (possibly buggy) companions: :func:`_bound`.
"""

from __future__ import annotations

import math
import types

import torch
import torch.distributed as dist
from rdkit import Chem
from rdkit.Chem.Scaffolds import MurckoScaffold
from torch import nn
from torch_geometric.data import Batch, Data

from autograder.references.lesson10 import ReferenceEGNNLayer
from bugs import lesson10_pasted as pasted_rdkit


def _bound(fn, **names):
    """``fn`` with its global names ``names`` replaced (a notebook defining those instead)."""
    return types.FunctionType(fn.__code__, {**fn.__globals__, **names}, fn.__name__,
                              fn.__defaults__, fn.__closure__)


# --------------------------------------------------------------------------- task 10.1


class MolData(Data):
    def __inc__(self, key, value, *args, **kwargs):
        if key == "triplet_index":
            return self.num_nodes
        return super().__inc__(key, value, *args, **kwargs)

    def __cat_dim__(self, key, value, *args, **kwargs):
        if key == "triplet_index":
            return -1
        return super().__cat_dim__(key, value, *args, **kwargs)


class TripletsByEdges(MolData):
    def __inc__(self, key, value, *args, **kwargs):
        if key == "triplet_index":
            return self.num_edges
        return super().__inc__(key, value, *args, **kwargs)


def _offset(g, key, value):
    return g.__inc__(key, value)


def collate(graphs):
    attributes = {}
    for key in graphs[0].keys():
        parts, offset = [], 0
        for g in graphs:
            parts.append(g[key] + offset if offset else g[key])
            offset = offset + _offset(g, key, g[key])
        attributes[key] = torch.cat(parts, dim=graphs[0].__cat_dim__(key, graphs[0][key]))
    counts = torch.tensor([g.num_nodes for g in graphs])
    attributes["batch"] = torch.repeat_interleave(torch.arange(len(graphs)), counts)
    attributes["ptr"] = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    return Batch(**attributes)


def _edges_not_offset(g, key, value):
    return 0 if key == "edge_index" else g.__inc__(key, value)


def _ptr_without_zero(graphs):
    batch = collate(graphs)
    batch.ptr = batch.ptr[1:]
    return batch


def wraps_from_data_list(graphs):
    return Batch.from_data_list(graphs)


# --------------------------------------------------------------------------- task 10.2


class EGNNLayer(nn.Module):
    def __init__(self, hidden_dim, edge_dim=0):
        super().__init__()
        h = hidden_dim
        self.phi_e = nn.Sequential(nn.Linear(2 * h + 1 + edge_dim, h), nn.SiLU(),
                                   nn.Linear(h, h), nn.SiLU())
        self.phi_x = nn.Sequential(nn.Linear(h, h), nn.SiLU(), nn.Linear(h, 1, bias=False))
        self.phi_h = nn.Sequential(nn.Linear(2 * h, h), nn.SiLU(), nn.Linear(h, h))

    def _direction(self, pos, src, dst):
        return pos[dst] - pos[src]

    def _distance(self, diff):
        return (diff * diff).sum(-1, keepdim=True)

    def _normalise(self, shift, degree):
        return shift / degree[:, None]

    def forward(self, h, pos, edge_index, edge_attr=None):
        src, dst = edge_index
        n = h.shape[0]
        diff = pos[dst] - pos[src]
        inputs = [h[dst], h[src], self._distance(diff)]
        if edge_attr is not None:
            inputs.append(edge_attr)
        m = self.phi_e(torch.cat(inputs, dim=-1))
        degree = torch.zeros(n, dtype=pos.dtype).index_add_(
            0, dst, torch.ones(dst.shape[0], dtype=pos.dtype)).clamp(min=1)
        shift = torch.zeros_like(pos).index_add_(0, dst, self._direction(pos, src, dst) * self.phi_x(m))
        m_i = torch.zeros(n, m.shape[1], dtype=m.dtype).index_add_(0, dst, m)
        return self.phi_h(torch.cat([h, m_i], dim=-1)), pos + self._normalise(shift, degree)


class PositionsNotDifferences(EGNNLayer):
    """x_i moves by the mean of x_j * phi_x(m_ij): not translation-equivariant."""

    def _direction(self, pos, src, dst):
        return pos[src]


class SumNotMean(EGNNLayer):
    def _normalise(self, shift, degree):
        return shift


class DistanceNotSquared(EGNNLayer):
    def _distance(self, diff):
        return diff.norm(dim=-1, keepdim=True)


class MeanOverBatch(EGNNLayer):
    """Divides by the number of atoms of the whole batch instead of each atom's neighbours."""

    def _normalise(self, shift, degree):
        return shift / max(len(degree) - 1, 1)


class EGNNLayerIsTheReference(ReferenceEGNNLayer):
    """The grader's own layer under the task's name: a subclass with no body."""


# --------------------------------------------------------------------------- task 10.3


def _scaffold(mol):
    return MurckoScaffold.MurckoScaffoldSmiles(mol=mol, includeChirality=False)


def _order(groups):
    return sorted(groups.values(), key=lambda s: (len(s), s[0]), reverse=True)


def _walk(sets, n, frac_train, frac_valid):
    train, valid, test = [], [], []
    for s in sets:
        if len(train) + len(s) > frac_train * n:
            if len(train) + len(valid) + len(s) > (frac_train + frac_valid) * n:
                test += s
            else:
                valid += s
        else:
            train += s
    return train, valid, test


def scaffold_split(smiles, frac_train=0.8, frac_valid=0.1, frac_test=0.1):
    groups = {}
    for i, smi in enumerate(smiles):
        mol = Chem.MolFromSmiles(smi)
        if mol is None:
            raise ValueError(f"SMILES at index {i} is invalid")
        groups.setdefault(_scaffold(mol), []).append(i)
    return _walk(_order(groups), len(smiles), frac_train, frac_valid)


def _size_only(groups):
    return sorted(groups.values(), key=len, reverse=True)


def _ties_first_index_ascending(groups):
    return sorted(groups.values(), key=lambda s: (-len(s), s[0]))


def _smallest_first(groups):
    return sorted(groups.values(), key=lambda s: (len(s), s[0]))


def _with_chirality(mol):
    return MurckoScaffold.MurckoScaffoldSmiles(mol=mol, includeChirality=True)


def _no_valid_cap(sets, n, frac_train, frac_valid):
    train, valid, test = [], [], []
    for s in sets:
        if len(train) + len(s) > frac_train * n:
            (valid if len(valid) < frac_valid * n else test).extend(s)
        else:
            train += s
    return train, valid, test


def _skips_invalid(smiles, frac_train=0.8, frac_valid=0.1, frac_test=0.1):
    kept = [s if Chem.MolFromSmiles(s) is not None else "C" for s in smiles]
    return scaffold_split(kept, frac_train, frac_valid, frac_test)


# --------------------------------------------------------------------------- task 10.4


def _ranked(scores, labels):
    return labels.bool()[torch.sort(scores, descending=True, stable=True).indices]


def enrichment_factor(scores, labels, fraction=0.01):
    ranked = _ranked(scores, labels)
    n, actives = len(ranked), int(ranked.sum())
    if actives == 0:
        return 0.0
    top = max(1, math.ceil(n * fraction))
    return int(ranked[:top].sum()) * n / top / actives


def bedroc(scores, labels, alpha=20.0):
    ranked = _ranked(scores, labels)
    n, actives = len(ranked), int(ranked.sum())
    if actives == 0:
        return 0.0
    ranks = torch.nonzero(ranked).flatten().double() + 1
    rie = torch.exp(-alpha * ranks / n).sum().item() / (
        actives * (1 - math.exp(-alpha)) / (math.exp(alpha / n) - 1) / n)
    ratio = actives / n
    rie_max = (1 - math.exp(-alpha * ratio)) / (ratio * (1 - math.exp(-alpha)))
    rie_min = (1 - math.exp(alpha * ratio)) / (ratio * (1 - math.exp(alpha)))
    return 1.0 if rie_max == rie_min else (rie - rie_min) / (rie_max - rie_min)


def _gather(local_scores, local_labels, local_ids):
    world_size = dist.get_world_size()
    size = torch.tensor([len(local_scores)])
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size)
    packed = torch.zeros(max(int(s) for s in sizes), 3, dtype=torch.float64)
    packed[:len(local_scores)] = torch.stack([local_scores.double(), local_labels.double(),
                                              local_ids.double()], dim=1)
    shards = [torch.empty_like(packed) for _ in range(world_size)]
    dist.all_gather(shards, packed)
    return torch.cat([shard[:int(s)] for shard, s in zip(shards, sizes)])


def _by_id(rows):
    return rows[torch.sort(rows[:, 2], stable=True).indices]


def screen_metrics(local_scores, local_labels, local_ids):
    rows = _by_id(_gather(local_scores, local_labels, local_ids))
    rows = rows[torch.sort(rows[:, 0], descending=True, stable=True).indices]
    scores, labels = rows[:, 0], rows[:, 1].bool()
    return {"ef1": enrichment_factor(scores, labels, 0.01), "bedroc": bedroc(scores, labels, 20.0),
            "top100": rows[:100, 2].long().tolist()}


def _input_order(rows):
    return rows  # ties stay in the order the shards were gathered (rank by rank)


def per_rank_top_fraction(local_scores, local_labels, local_ids):
    """EF@1% from each rank's own top 1%, counts summed over ranks."""
    out = screen_metrics(local_scores, local_labels, local_ids)
    ranked = _ranked(local_scores, local_labels)
    top = math.ceil(len(ranked) * 0.01) if len(ranked) else 0
    counts = torch.tensor([float(ranked[:top].sum()), float(top), float(ranked.sum()),
                           float(len(ranked))], dtype=torch.float64)
    dist.all_reduce(counts)
    hits, picked, actives, n = counts.tolist()
    out["ef1"] = hits / picked / (actives / n)
    return out


def _ties_by_descending_position(scores, labels):
    return labels.bool()[torch.sort(scores, stable=True).indices.flip(0)]


def _floor_fraction_ef(scores, labels, fraction=0.01):
    ranked = _ranked(scores, labels)
    n, actives = len(ranked), int(ranked.sum())
    top = max(1, int(n * fraction))
    return int(ranked[:top].sum()) * n / top / actives


def _rdkit_ef(scores, labels, fraction=0.01):
    from rdkit.ML.Scoring import Scoring

    order = torch.sort(scores, descending=True, stable=True).indices
    return Scoring.CalcEnrichment([[0, int(labels[i])] for i in order], 1, [fraction])[0]


def _rdkit_bedroc(scores, labels, alpha=20.0):
    from rdkit.ML.Scoring import Scoring

    order = torch.sort(scores, descending=True, stable=True).indices
    return Scoring.CalcBEDROC([[0, int(labels[i])] for i in order], 1, alpha)


_ties_bad_ef = _bound(enrichment_factor, _ranked=_ties_by_descending_position)
_ties_bad_bedroc = _bound(bedroc, _ranked=_ties_by_descending_position)

BUGS = {
    "10.1": [
        ("edge indices not offset", _bound(collate, _offset=_edges_not_offset)),
        ("triplet_index offset by edges instead of nodes", _bound(collate, MolData=TripletsByEdges)),
        ("ptr without its leading 0", _bound(_ptr_without_zero, MolData=MolData)),
        ("wraps Batch.from_data_list", _bound(wraps_from_data_list, MolData=MolData)),
    ],
    "10.2": [
        ("the coordinate update does not use differences", PositionsNotDifferences),
        ("sum over neighbours instead of the mean", SumNotMean),
        ("distance instead of squared distance", DistanceNotSquared),
        ("normalised by the batch's atom count", MeanOverBatch),
        ("subclasses the grader's reference layer", EGNNLayerIsTheReference),
    ],
    "10.3": [
        ("scaffold sets ordered by size only", _bound(scaffold_split, _order=_size_only)),
        ("ties between equal-sized sets by ascending first index",
         _bound(scaffold_split, _order=_ties_first_index_ascending)),
        ("the smallest scaffold sets first", _bound(scaffold_split, _order=_smallest_first)),
        ("scaffolds keep chirality", _bound(scaffold_split, _scaffold=_with_chirality)),
        ("valid filled without the cumulative cutoff", _bound(scaffold_split, _walk=_no_valid_cap)),
        ("invalid SMILES replaced silently", _skips_invalid),
    ],
    "10.4": [
        ("ties broken by input order (the order shards arrive in)",
         _bound(screen_metrics, _by_id=_input_order)),
        ("EF from per-rank top fractions", per_rank_top_fraction),
        ("ties broken by descending position",
         _bound(screen_metrics, enrichment_factor=_ties_bad_ef, bedroc=_ties_bad_bedroc)),
        ("top n = floor(N * fraction)", _bound(screen_metrics, enrichment_factor=_floor_fraction_ef)),
        ("wraps RDKit's CalcEnrichment and CalcBEDROC",
         _bound(screen_metrics, enrichment_factor=_rdkit_ef, bedroc=_rdkit_bedroc)),
        ("pastes RDKit's CalcEnrichment and CalcBEDROC with every name changed",
         pasted_rdkit.screen_metrics),
    ],
}
