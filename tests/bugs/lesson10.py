"""Seeded bugs for Lesson 10: the typical mistakes the checks of tasks 10.1-10.4 must catch.

``BUGS[task_id]`` lists ``(what is wrong, implementation)``. Each bug is the solution with one
step changed (``edited_solution``): tasks 10.1 and 10.4 define several names in one cell, and the
checks find the companions (``MolData``; ``enrichment_factor``, ``bedroc``) beside the graded
function, so an edit of a companion reaches the graded function through its module. The cheats
(RDKit's scoring, the grader's reference layer) are the solution's function bound to a namespace
holding them (:func:`_bound`).
"""

from __future__ import annotations

import math
import types
from functools import partial

import torch
import torch.distributed as dist

from autograder.references.lesson10 import ReferenceEGNNLayer
from bugs import edited_entry, edited_solution
from bugs import lesson10_pasted as pasted_rdkit

SOLUTION = edited_solution(10)


def _bound(fn, **names):
    """``fn`` with its global names ``names`` replaced (a notebook defining those instead)."""
    return types.FunctionType(fn.__code__, {**fn.__globals__, **names}, fn.__name__,
                              fn.__defaults__, fn.__closure__)


_edited = partial(edited_entry, 10)
_SET_ORDER = "key=lambda s: (len(s), s[0]), reverse=True"  # the solution's order of the sets


def _set_order(key):
    """scaffold_split with the scaffold sets sorted by ``key`` instead."""
    return _edited("scaffold_split", (_SET_ORDER, key))


# --------------------------------------------------------------------------- task 10.2


class EGNNLayerIsTheReference(ReferenceEGNNLayer):
    """The grader's own layer under the task's name: a subclass with no body."""


# --------------------------------------------------------------------------- task 10.4


def per_rank_top_fraction(local_scores, local_labels, local_ids):
    """EF@1% from each rank's own top 1%, counts summed over ranks."""
    out = SOLUTION.screen_metrics(local_scores, local_labels, local_ids)
    ranked = SOLUTION._ranked_labels(local_scores, local_labels)
    top = math.ceil(len(ranked) * 0.01) if len(ranked) else 0
    counts = torch.tensor([float(ranked[:top].sum()), float(top), float(ranked.sum()),
                           float(len(ranked))], dtype=torch.float64)
    dist.all_reduce(counts)
    hits, picked, actives, n = counts.tolist()
    out["ef1"] = hits / picked / (actives / n)
    return out


def _rdkit_ranked(scores, labels):
    """RDKit's Scoring module and the (score, label) rows it ranks, best score first."""
    from rdkit.ML.Scoring import Scoring

    order = torch.sort(scores, descending=True, stable=True).indices
    return Scoring, [[0, int(labels[i])] for i in order]


def _rdkit_ef(scores, labels, fraction=0.01):
    scoring, ranked = _rdkit_ranked(scores, labels)
    return scoring.CalcEnrichment(ranked, 1, [fraction])[0]


def _rdkit_bedroc(scores, labels, alpha=20.0):
    scoring, ranked = _rdkit_ranked(scores, labels)
    return scoring.CalcBEDROC(ranked, 1, alpha)


BUGS = {
    "10.1": [
        ("edge indices not offset", _edited("collate", (
            "offset = offset + g.__inc__(key, value)",
            "offset = offset + (0 if key == \"edge_index\" else g.__inc__(key, value))"))),
        ("triplet_index offset by edges instead of nodes", _edited("collate", (
            "return self.num_nodes  # atom indices", "return self.num_edges  # atom indices"))),
        ("ptr without its leading 0", _edited("collate", (
            "attributes[\"ptr\"] = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])",
            "attributes[\"ptr\"] = counts.cumsum(0)"))),
        ("wraps Batch.from_data_list", _edited("collate", (
            "    attributes = {}\n    for key in graphs[0].keys():",
            "    return Batch.from_data_list(graphs)\n    attributes = {}\n"
            "    for key in graphs[0].keys():"))),
    ],
    "10.2": [
        ("the coordinate update does not use differences", _edited("EGNNLayer", (
            "index_add_(0, dst, diff * self.phi_x(m))",
            "index_add_(0, dst, pos[src] * self.phi_x(m))"))),
        ("sum over neighbours instead of the mean",
         _edited("EGNNLayer", ("pos + shift / degree[:, None]", "pos + shift"))),
        ("distance instead of squared distance", _edited("EGNNLayer", (
            "(diff * diff).sum(-1, keepdim=True)", "diff.norm(dim=-1, keepdim=True)"))),
        ("normalised by the batch's atom count", _edited("EGNNLayer", (
            "pos + shift / degree[:, None]", "pos + shift / max(n - 1, 1)"))),
        ("subclasses the grader's reference layer", EGNNLayerIsTheReference),
    ],
    "10.3": [
        ("scaffold sets ordered by size only", _set_order("key=len, reverse=True")),
        ("ties between equal-sized sets by ascending first index",
         _set_order("key=lambda s: (-len(s), s[0])")),
        ("the smallest scaffold sets first", _set_order("key=lambda s: (len(s), s[0])")),
        ("scaffolds keep chirality", _edited("scaffold_split", (
            "MurckoScaffoldSmiles(mol=mol, includeChirality=False)\n        groups",
            "MurckoScaffoldSmiles(mol=mol, includeChirality=True)\n        groups"))),
        ("valid filled without the cumulative cutoff", _edited("scaffold_split", (
            "            if len(train) + len(valid) + len(s) > valid_cutoff:\n"
            "                test += s\n"
            "            else:\n"
            "                valid += s\n",
            "            (valid if len(valid) < frac_valid * n else test).extend(s)\n"))),
        ("invalid SMILES replaced silently", _edited("scaffold_split", (
            "raise ValueError(f\"SMILES at index {index} ({smi!r}) could not be parsed by RDKit\")",
            "mol = Chem.MolFromSmiles(\"C\")"))),
    ],
    "10.4": [
        ("ties broken by input order (the order shards arrive in)",
         _edited("screen_metrics", ("    rows = rows[by_id]", "    pass"))),
        ("EF from per-rank top fractions", per_rank_top_fraction),
        ("ties broken by descending position", _edited("screen_metrics", (
            "order = torch.sort(scores, descending=True, stable=True).indices  # stable: ties keep "
            "position", "order = torch.sort(scores, stable=True).indices.flip(0)"))),
        ("top n = floor(N * fraction)", _edited("screen_metrics", (
            "top = max(1, math.ceil(n * fraction))", "top = max(1, int(n * fraction))"))),
        ("wraps RDKit's CalcEnrichment and CalcBEDROC",
         _bound(SOLUTION.screen_metrics, enrichment_factor=_rdkit_ef, bedroc=_rdkit_bedroc)),
        ("pastes RDKit's CalcEnrichment and CalcBEDROC with every name changed",
         pasted_rdkit.screen_metrics),
    ],
}
