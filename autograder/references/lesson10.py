"""The grader's answers for Lesson 10 (trusted only): PyG's own ``Batch.from_data_list`` on a
``Data`` subclass that declares ``triplet_index`` (10.1); an EGNN layer written from equations
(3)-(6) of Satorras et al. (2021) (10.2); DeepChem's ``ScaffoldSplitter`` re-stated line for line,
since DeepChem is not installed (10.3); RDKit's ``CalcEnrichment`` and ``CalcBEDROC`` on the
screens the checks build, one process on the whole list (10.4).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from autograder.lesson10 import FIELDS, graph_fields, metrics_of, shards

# --------------------------------------------------------------------------- task 10.1


def reference_mol_data() -> type:
    """A ``Data`` subclass whose triplet_index (3, T) holds atom indices, like edge_index."""
    from torch_geometric.data import Data

    class ReferenceMolData(Data):
        def __inc__(self, key: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            if key == "triplet_index":
                return self.num_nodes
            return super().__inc__(key, value, *args, **kwargs)

        def __cat_dim__(self, key: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            if key == "triplet_index":
                return -1
            return super().__cat_dim__(key, value, *args, **kwargs)

    return ReferenceMolData


def batch_from_data_list(kind: str, seed: int) -> dict[str, Any]:
    """PyG's own batch of a case's graphs: every attribute, batch, ptr and num_graphs."""
    from torch_geometric.data import Batch

    cls = reference_mol_data()
    batch = Batch.from_data_list([cls(**f) for f in graph_fields(kind, seed)])
    out = {k: batch[k] for k in (*FIELDS, "batch", "ptr")}
    out["num_graphs"] = batch.num_graphs
    out["is a Batch"] = True
    out["called"] = []
    return out


# --------------------------------------------------------------------------- task 10.2


class ReferenceEGNNLayer(nn.Module):
    """Equations (3)-(6) of Satorras et al. (2021), mean over neighbours for x.

    m_ij = phi_e([h_i, h_j, |x_i - x_j|^2, a_ij]);  x_i' = x_i + mean_j (x_i - x_j) phi_x(m_ij);
    m_i = sum_j m_ij;  h_i' = phi_h([h_i, m_i]).  Edge j -> i is column (j, i) of edge_index.
    """

    def __init__(self, hidden_dim: int, edge_dim: int = 0):
        super().__init__()
        h = hidden_dim
        self.phi_e = nn.Sequential(nn.Linear(2 * h + 1 + edge_dim, h), nn.SiLU(),
                                   nn.Linear(h, h), nn.SiLU())
        self.phi_x = nn.Sequential(nn.Linear(h, h), nn.SiLU(), nn.Linear(h, 1, bias=False))
        self.phi_h = nn.Sequential(nn.Linear(2 * h, h), nn.SiLU(), nn.Linear(h, h))

    def forward(self, h: torch.Tensor, pos: torch.Tensor, edge_index: torch.Tensor,
                edge_attr: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        src, dst = edge_index
        n = h.shape[0]
        diff = pos[dst] - pos[src]  # (E, 3) x_i - x_j
        parts = [h[dst], h[src], (diff * diff).sum(-1, keepdim=True)]
        if edge_attr is not None:
            parts.append(edge_attr)
        m = self.phi_e(torch.cat(parts, dim=-1))  # (E, H)
        degree = torch.zeros(n, dtype=pos.dtype).index_add_(
            0, dst, torch.ones(dst.shape[0], dtype=pos.dtype)).clamp(min=1)
        shift = torch.zeros_like(pos).index_add_(0, dst, diff * self.phi_x(m))
        m_i = torch.zeros(n, m.shape[1], dtype=m.dtype).index_add_(0, dst, m)
        return self.phi_h(torch.cat([h, m_i], dim=-1)), pos + shift / degree[:, None]


# --------------------------------------------------------------------------- task 10.3


def reference_scaffold_split(smiles: list[str], frac_train: float = 0.8, frac_valid: float = 0.1,
                             frac_test: float = 0.1) -> tuple[list[int], list[int], list[int]]:
    """DeepChem's ScaffoldSplitter.split on a dataset whose ids are ``smiles``."""
    from rdkit import Chem
    from rdkit.Chem.Scaffolds import MurckoScaffold

    if not math.isclose(frac_train + frac_valid + frac_test, 1.0, abs_tol=1e-7):
        raise ValueError("fractions must sum to 1")
    scaffolds: dict[str, list[int]] = {}
    for ind, smi in enumerate(smiles):
        mol = Chem.MolFromSmiles(smi)
        if mol is None:
            raise ValueError(f"SMILES at index {ind} ({smi!r}) could not be parsed")
        scaffold = MurckoScaffold.MurckoScaffoldSmiles(mol=mol, includeChirality=False)
        scaffolds.setdefault(scaffold, []).append(ind)
    scaffolds = {k: sorted(v) for k, v in scaffolds.items()}
    scaffold_sets = [s for _, s in sorted(scaffolds.items(), key=lambda x: (len(x[1]), x[1][0]),
                                          reverse=True)]
    n = len(smiles)
    train_cutoff = frac_train * n
    valid_cutoff = (frac_train + frac_valid) * n
    train, valid, test = [], [], []
    for s in scaffold_sets:
        if len(train) + len(s) > train_cutoff:
            if len(train) + len(valid) + len(s) > valid_cutoff:
                test += s
            else:
                valid += s
        else:
            train += s
    return train, valid, test


# --------------------------------------------------------------------------- task 10.4


def _ranked_rows(scores: torch.Tensor, labels: torch.Tensor,
                 ids: torch.Tensor | None = None) -> list[list[int]]:
    """Rows [id, label] sorted by score descending, ties by ascending id (position if no ids)."""
    ids = torch.arange(len(scores)) if ids is None else ids
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), int(ids[i])))
    return [[int(ids[i]), int(bool(labels[i]))] for i in order]


def reference_enrichment_factor(scores: torch.Tensor, labels: torch.Tensor,
                                fraction: float = 0.01) -> float:
    from rdkit.ML.Scoring.Scoring import CalcEnrichment

    return float(CalcEnrichment(_ranked_rows(scores, labels), 1, [fraction])[0])


def reference_bedroc(scores: torch.Tensor, labels: torch.Tensor, alpha: float = 20.0) -> float:
    from rdkit.ML.Scoring.Scoring import CalcBEDROC

    return float(CalcBEDROC(_ranked_rows(scores, labels), 1, alpha))


def reference_screen(scores: torch.Tensor, labels: torch.Tensor,
                     ids: torch.Tensor) -> dict[str, Any]:
    """The whole screen in one process: EF@1%, BEDROC(20) and the 100 best ids."""
    from rdkit.ML.Scoring.Scoring import CalcBEDROC, CalcEnrichment

    rows = _ranked_rows(scores, labels, ids)
    return {"ef1": float(CalcEnrichment(rows, 1, [0.01])[0]),
            "bedroc": float(CalcBEDROC(rows, 1, 20.0)), "top100": [r[0] for r in rows[:100]]}


def rdkit_metrics(seed: int) -> dict[str, Any]:
    """RDKit's EF and BEDROC on every screen the metrics case scores."""
    return {"values": metrics_of(reference_enrichment_factor, reference_bedroc, seed)}


def screen_of_every_shard(seed: int) -> dict[str, Any]:
    """The sharded screen put back together, scored in one process."""
    parts = shards(seed)
    scores, labels, ids = (torch.cat([s[i] for s in parts]) for i in range(3))
    return reference_screen(scores, labels, ids)
