"""Checks for Lesson 10, "Molecular graphs at scale": tasks 10.1-10.4.

The trusted references live in :mod:`autograder.references.lesson10`, named here by string:
PyG's own ``Batch.from_data_list`` on a ``Data`` subclass that declares ``triplet_index``
(10.1); an EGNN layer written from equations (3)-(6) of Satorras et al. (2021), loaded with the
same seeded weights as the student's layer (10.2); DeepChem's ``ScaffoldSplitter``
(``deepchem/splits/splitters.py``: ``_generate_scaffold``, ``generate_scaffolds``, ``split``)
re-stated line for line, since DeepChem is not installed (10.3); RDKit's
``rdkit.ML.Scoring.Scoring.CalcEnrichment`` and ``CalcBEDROC`` (10.4). Real molecules come from
the wheels (:mod:`kit.lessons.molecules`). Tasks 10.1 and 10.4 define several names in one cell:
their companions (``MolData``; ``enrichment_factor``, ``bedroc``) are declared with the task and
found beside the graded function. No task of this lesson bounds a resource (each says why).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from autograder.compare import per_rank
from autograder.registry import CheckFailed, Task, assert_same, plain, task

# --------------------------------------------------------------------------- shared


def _companion(graded: Task, impl: Any, name: str) -> Any:
    """The task's companion ``name`` defined beside ``impl`` (the same notebook cell or module)."""
    found = graded.companion(impl, name)
    if found is None:
        raise NameError(f"{name} is not defined next to {getattr(impl, '__name__', impl)}: "
                        f"run the cell that defines {name} first")
    return found


@contextmanager
def _calls_into(watched: dict[str, tuple[str, ...]]) -> Iterator[list[str]]:
    """Records calls of watched Python functions ({file suffix: function names}) meanwhile,
    however they were imported (``sys.setprofile`` sees every Python frame)."""
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            path = code.co_filename.replace("\\", "/")
            for suffix, names in watched.items():
                if path.endswith(suffix) and code.co_name in names:
                    label = f"{suffix[:-3].replace('/', '.')}.{code.co_name}"
                    if label not in seen:
                        seen.append(label)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(previous)


def real_molecules() -> list[Any]:
    """A few EGFR ligands (3-D coordinates from the SDF) of different sizes."""
    from kit.lessons.molecules import egfr_actives

    actives = egfr_actives()
    return [actives[i] for i in (0, 17, 101, 250)]


@functools.cache
def _smiles_mol(smiles: str) -> Any:
    from rdkit import Chem

    return Chem.MolFromSmiles(smiles)


# --------------------------------------------------------------------------- task 10.1

FIELDS = ("x", "edge_index", "edge_attr", "pos", "y", "triplet_index")


def graph_fields(kind: str, seed: int) -> list[dict[str, torch.Tensor]]:
    """Fields of the graphs of a case: real ligands, graphs without edges, or one graph."""
    from kit.lessons.molecules import mol_graph

    g = torch.Generator().manual_seed(seed)
    if kind == "real":
        out = [mol_graph(m) for m in real_molecules()]
    elif kind == "edgeless":
        # Single atoms and ions: no bonds, so empty (2, 0) edges and (3, 0) triplets.
        out = [mol_graph(_smiles_mol(s), pos=False) for s in ("[Na+]", "CCO", "C", "[Cl-]", "O")]
    else:
        out = [mol_graph(real_molecules()[1])]
    for f in out:
        if "pos" not in f:
            f["pos"] = torch.randn(f["x"].shape[0], 3, generator=g)
        f["y"] = torch.randn(1, generator=g)
    return out


def _collate_run(kind: str) -> Any:
    def run(collate: Any, seed: int) -> dict[str, Any]:
        from torch_geometric.data import Batch

        mol_data = _companion(COLLATE, collate, "MolData")
        graphs = [mol_data(**f) for f in graph_fields(kind, seed)]
        with _calls_into(COLLATE_WATCH) as called:
            batch = collate(graphs)
        out: dict[str, Any] = {"called": list(called), "is a Batch": isinstance(batch, Batch)}
        for key in (*FIELDS, "batch", "ptr"):
            out[key] = plain(getattr(batch, key, None))
        num_graphs = getattr(batch, "num_graphs", None)
        out["num_graphs"] = num_graphs if isinstance(num_graphs, int) else plain(num_graphs)
        return out

    return run


# PyG's collation: Batch.from_data_list and the DataLoader's Collater both end in collate().
COLLATE_WATCH = {"torch_geometric/data/collate.py": ("collate",),
                 "torch_geometric/data/batch.py": ("from_data_list",),
                 "torch_geometric/loader/dataloader.py": ("__call__", "collate_fn")}

COLLATE_HINTS = {
    "edge_index": "Edge indices are node numbers: in the batch, graph g's nodes come after all "
                  "the nodes of the graphs before it, and edges are columns.",
    "triplet_index": "triplet_index holds atom indices, like edge_index, as columns of a (3, T) "
                     "tensor: it needs the same shift and the same concatenation dimension.",
    "batch": "batch[n] is the index of the graph that node n belongs to: graph g contributes "
             "num_nodes copies of g.",
    "ptr": "ptr has num_graphs + 1 entries: 0, then the running total of nodes.",
}
COLLATE_RECIPES = {
    "edge_index": "Add to each graph's edge_index the number of nodes of the graphs before it "
                  "(data.__inc__('edge_index', ...) says so), then concatenate along dim -1.",
    "triplet_index": "MolData.__inc__ must return the graph's number of nodes for "
                     "'triplet_index', __cat_dim__ must return -1 for it, and collate must use "
                     "both.",
}


def _compare_batch(got: Any, expected: dict[str, Any]) -> None:
    if not isinstance(got, dict):
        raise CheckFailed("collate's result could not be read", got=repr(got)[:200])
    if got.get("called"):
        raise CheckFailed(f"collate called PyG's own collation ({', '.join(got['called'])}): "
                          "Task 10.1 re-implements it", expected="no call", got=got["called"],
                          hint="Task 10.1 is PyG's collation itself: it must be built from the "
                               "graphs' own declarations, not by calling PyG's.",
                          recipe="Build the batch yourself: concatenate each attribute along "
                                 "data.__cat_dim__(key, value) after adding the sum of "
                                 "data.__inc__(key, value) over the graphs before it, then build "
                                 "a Batch from the attributes.")
    if not got.get("is a Batch"):
        raise CheckFailed("collate must return a torch_geometric.data.Batch",
                          expected="Batch", got="something else",
                          hint="Batch(x=..., edge_index=..., ..., batch=..., ptr=...) builds one.")
    for key in (*FIELDS, "batch", "ptr", "num_graphs"):
        try:
            assert_same(got.get(key), expected[key], path=key)
        except CheckFailed as e:
            raise CheckFailed(f"batch.{e.message}", expected=e.expected, got=e.got,
                              hint=COLLATE_HINTS.get(key, ""),
                              recipe=COLLATE_RECIPES.get(key, "")) from None


def declarations(mol_data: Any, seed: int) -> list[dict[str, Any]]:
    out = []
    for f in graph_fields("real", seed)[:2] + graph_fields("edgeless", seed)[:1]:
        data = mol_data(**f)
        row = {}
        for key in FIELDS:
            inc = data.__inc__(key, data[key])
            dim = data.__cat_dim__(key, data[key])
            row[key] = [int(inc) if isinstance(inc, (int, torch.Tensor)) else repr(inc),
                        int(dim) if isinstance(dim, (int, torch.Tensor)) else repr(dim)]
        out.append(row)
    return out


def _compare_declarations(got: Any, expected: list[dict[str, Any]]) -> None:
    for g, (have, want) in enumerate(zip(got, expected)):
        for key, (inc, dim) in want.items():
            h_inc, h_dim = have[key]
            if h_inc != inc:
                raise CheckFailed(f"graph {g}: MolData.__inc__({key!r}) is {h_inc}, expected {inc}",
                                  expected=inc, got=h_inc, hint=COLLATE_HINTS["triplet_index"]
                                  if key == "triplet_index" else "Leave other keys to super().",
                                  recipe=COLLATE_RECIPES["triplet_index"]
                                  if key == "triplet_index" else "")
            if h_dim != dim and not (dim == -1 and h_dim == 1) and not (dim == 1 and h_dim == -1):
                raise CheckFailed(f"graph {g}: MolData.__cat_dim__({key!r}) is {h_dim}, expected "
                                  f"{dim}", expected=dim, got=h_dim,
                                  hint=COLLATE_HINTS["triplet_index"],
                                  recipe=COLLATE_RECIPES["triplet_index"])


# bounds nothing: collation is bookkeeping (index offsets, batch and ptr); a batch holds exactly
# its graphs' tensors, and the checks compare every one of them with PyG's.
COLLATE = task(
    "10.1",
    hint="A batch of graphs is one disconnected graph: attributes that hold node indices "
         "(edge_index, triplet_index) are shifted past the nodes of the graphs before them, and "
         "batch and ptr record which graph each node came from. Each graph's __inc__ and "
         "__cat_dim__ declare how its attributes combine.",
    recipe="In MolData, for the key 'triplet_index' return the graph's number of nodes from "
           "__inc__ and -1 from __cat_dim__; leave every other key to super(). In collate, for "
           "each key of the first graph, go over the graphs with a running offset: add the "
           "offset to the graph's value, then grow the offset by that graph's __inc__ for the "
           "key; concatenate the shifted values along __cat_dim__. Add batch (each graph's "
           "index repeated once per node) and ptr (0, then the running total of nodes: "
           "num_graphs + 1 entries), and return a Batch built from these attributes, without "
           "calling PyG's own collation.",
    # PyG's batching: its collate module (the private helpers too), the loader's Collater and
    # InMemoryDataset's collate, which call it.
    forbidden=("torch_geometric.data.Batch.from_data_list", "torch_geometric.data.collate.collate",
               "torch_geometric.loader.dataloader.Collater", "torch_geometric.data.collate",
               "torch_geometric.loader.dataloader", "torch_geometric.data.InMemoryDataset.collate"),
)


@COLLATE.case("MolData declares triplet_index: incremented by the number of nodes, "
              "concatenated along the last dimension", compare=_compare_declarations,
              expect=lambda seed: declarations(COLLATE.trusted("reference_mol_data")(), seed))
def _(collate: Any, seed: int) -> list[dict[str, Any]]:
    return declarations(_companion(COLLATE, collate, "MolData"), seed)


def _from_data_list(kind: str) -> Any:
    """The expected batch of the ``kind`` graphs: the trusted Batch.from_data_list of them."""
    return lambda seed: COLLATE.trusted("batch_from_data_list")(kind, seed)


COLLATE.case("4 EGFR ligands: every attribute, batch and ptr equal Batch.from_data_list's",
             compare=_compare_batch, weight=2, expect=_from_data_list("real"))(_collate_run("real"))
COLLATE.case("graphs without edges (an ion, methane, water): empty edge_index and triplet_index",
             compare=_compare_batch,
             hint="A graph with no bonds has edge_index of shape (2, 0) and triplet_index (3, 0); "
                  "its nodes still count in the offsets, batch and ptr.",
             expect=_from_data_list("edgeless"))(_collate_run("edgeless"))
COLLATE.case("a single graph", compare=_compare_batch,
             expect=_from_data_list("single"))(_collate_run("single"))


# --------------------------------------------------------------------------- task 10.2


HIDDEN = 16


def _egnn_inputs(seed: int, edge_dim: int, dtype: torch.dtype = torch.float64) -> dict[str, Any]:
    """A batch of 3 molecules (2 EGFR ligands and an ion) with features and coordinates."""
    from torch_geometric.data import Batch, Data

    from kit.lessons.molecules import mol_graph

    graphs = [mol_graph(m) for m in real_molecules()[:2]]
    graphs.append({"x": torch.zeros(1, 9, dtype=torch.long),
                   "edge_index": torch.zeros(2, 0, dtype=torch.long),
                   "pos": torch.tensor([[1.0, -2.0, 0.5]])})  # an isolated atom
    batch = Batch.from_data_list([Data(x=f["x"], edge_index=f["edge_index"], pos=f["pos"])
                                  for f in graphs])
    g = torch.Generator().manual_seed(seed)
    e = batch.edge_index.shape[1]
    return {"h": torch.randn(batch.num_nodes, HIDDEN, generator=g, dtype=dtype),
            "pos": batch.pos.to(dtype), "edge_index": batch.edge_index,
            "edge_attr": torch.randn(e, edge_dim, generator=g, dtype=dtype) if edge_dim else None,
            "ptr": batch.ptr}


def layer_weights(seed: int, edge_dim: int) -> dict[str, torch.Tensor]:
    """Seeded float64 weights for the layer's three given MLPs, by the names and shapes the
    task's skeleton fixes, drawn as nn.Linear draws them: uniform in +-1/sqrt(fan_in)."""
    h = HIDDEN
    shapes = {"phi_e.0.weight": (h, 2 * h + 1 + edge_dim), "phi_e.0.bias": (h,),
              "phi_e.2.weight": (h, h), "phi_e.2.bias": (h,),
              "phi_x.0.weight": (h, h), "phi_x.0.bias": (h,), "phi_x.2.weight": (1, h),
              "phi_h.0.weight": (h, 2 * h), "phi_h.0.bias": (h,),
              "phi_h.2.weight": (h, h), "phi_h.2.bias": (h,)}
    g = torch.Generator().manual_seed(1000 + seed)
    weights, fan_in = {}, 1
    for name, shape in shapes.items():
        if name.endswith("weight"):
            fan_in = shape[1]  # a bias takes the fan-in of the weight before it
        uniform = torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1
        weights[name] = uniform / math.sqrt(fan_in)
    return weights


def _build_layer(impl: Any, seed: int, edge_dim: int) -> nn.Module:
    layer = impl(HIDDEN, edge_dim) if edge_dim else impl(HIDDEN)
    layer = layer.double()
    layer.load_state_dict(layer_weights(seed, edge_dim), strict=True)
    return layer


def _apply(layer: nn.Module, inputs: dict[str, Any]) -> tuple[Any, Any]:
    args = (inputs["h"], inputs["pos"], inputs["edge_index"])
    out = layer(*args, inputs["edge_attr"]) if inputs["edge_attr"] is not None else layer(*args)
    return plain(out[0]), plain(out[1])


def _egnn_reference_case(edge_dim: int) -> Any:
    def run(impl: Any, seed: int) -> dict[str, Any]:
        with torch.no_grad():
            h, pos = _apply(_build_layer(impl, seed, edge_dim), _egnn_inputs(seed, edge_dim))
        return {"h": h, "pos": pos}

    return run


def _compare_egnn(got: Any, expected: dict[str, Any]) -> None:
    for key, what in (("h", "features h'"), ("pos", "coordinates x'")):
        try:
            assert_same(got[key], expected[key], rtol=1e-9, atol=1e-10, path=what)
        except CheckFailed as e:
            raise CheckFailed(e.message + " with the reference's weights loaded",
                              expected=e.expected, got=e.got) from None


def _orthogonal(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random orthogonal Q with det -1 (a rotation times a reflection) and a translation t."""
    g = torch.Generator().manual_seed(seed + 7)
    q, _ = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))
    if torch.linalg.det(q) > 0:
        q = q @ torch.diag(torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64))
    return q, 10 * torch.randn(3, generator=g, dtype=torch.float64)


def _equivariance_run(impl: Any, seed: int) -> dict[str, Any]:
    layer = _build_layer(impl, seed, 4)
    inputs = _egnn_inputs(seed, 4)
    q, t = _orthogonal(seed)
    with torch.no_grad():
        h1, x1 = _apply(layer, inputs)
        h2, x2 = _apply(layer, {**inputs, "pos": inputs["pos"] @ q.T + t})
    return {"h": h1, "pos": x1, "h moved": h2, "pos moved": x2}


def _compare_equivariance(got: Any, expected: dict[str, Any]) -> None:
    q, t = expected["Q"], expected["t"]
    for key in ("h", "pos", "h moved", "pos moved"):
        if not isinstance(got.get(key), torch.Tensor) or got[key].dtype != torch.float64:
            raise CheckFailed(f"{key}: expected a float64 tensor "
                              "(the layer was cast with .double())", got=repr(got.get(key))[:100])
    dh = (got["h moved"] - got["h"]).abs().max().item()
    if not dh <= 1e-9:
        raise CheckFailed(f"features change by up to {dh:.3g} when the molecule is rotated, "
                          "reflected and translated: h' must be E(3)-invariant",
                          expected="< 1e-9", got=f"{dh:.3g}",
                          hint="Only invariant quantities may enter phi_e: squared distances "
                               "|x_i - x_j|^2, never coordinates themselves.")
    dx = (got["pos moved"] - (got["pos"] @ q.T + t)).abs().max().item()
    if not dx <= 1e-9:
        raise CheckFailed(f"coordinates are off by up to {dx:.3g} from Q x' + t: x' must be "
                          "E(3)-equivariant", expected="< 1e-9", got=f"{dx:.3g}",
                          hint="Update x_i with a weighted mean of the differences x_i - x_j: "
                               "differences rotate with the molecule and do not feel a "
                               "translation.")


def _permutation_run(impl: Any, seed: int) -> dict[str, Any]:
    layer = _build_layer(impl, seed, 4)
    inputs = _egnn_inputs(seed, 4)
    n = inputs["h"].shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 3))
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(n)
    edge_perm = torch.randperm(inputs["edge_index"].shape[1],
                               generator=torch.Generator().manual_seed(seed + 4))
    permuted = {"h": inputs["h"][perm], "pos": inputs["pos"][perm],
                "edge_index": inverse[inputs["edge_index"]][:, edge_perm],
                "edge_attr": inputs["edge_attr"][edge_perm]}
    with torch.no_grad():
        h1, x1 = _apply(layer, inputs)
        h2, x2 = _apply(layer, permuted)
    return {"h": h1, "pos": x1, "h permuted": h2, "pos permuted": x2}


def _compare_permutation(got: Any, expected: dict[str, Any]) -> None:
    perm = expected["perm"]
    for key in ("h", "pos"):
        diff = (got[f"{key} permuted"] - got[key][perm]).abs().max().item()
        if not diff <= 1e-9:
            raise CheckFailed(f"relabelling the atoms (and shuffling the edges) changes {key}' by "
                              f"up to {diff:.3g}: the layer must be permutation-equivariant",
                              expected="< 1e-9", got=f"{diff:.3g}",
                              hint="Aggregate messages by their target atom (index_add_ over "
                                   "edge_index[1]), never by position in the edge list.")


def _separate_run(impl: Any, seed: int) -> dict[str, Any]:
    layer = _build_layer(impl, seed, 0)
    inputs = _egnn_inputs(seed, 0)
    ptr = inputs["ptr"].tolist()
    with torch.no_grad():
        whole = _apply(layer, inputs)
        parts = []
        for g in range(len(ptr) - 1):
            lo, hi = ptr[g], ptr[g + 1]
            keep = (inputs["edge_index"][1] >= lo) & (inputs["edge_index"][1] < hi)
            parts.append(_apply(layer, {"h": inputs["h"][lo:hi], "pos": inputs["pos"][lo:hi],
                                        "edge_index": inputs["edge_index"][:, keep] - lo,
                                        "edge_attr": None}))
    return {"batched": list(whole), "alone": [list(p) for p in parts], "ptr": ptr,
            "isolated input": plain(inputs["pos"][-1])}


def _compare_separate(got: Any, expected: Any) -> None:
    ptr = got["ptr"]
    for g, (h, x) in enumerate(got["alone"]):
        lo, hi = ptr[g], ptr[g + 1]
        batched_h, batched_x = got["batched"][0][lo:hi], got["batched"][1][lo:hi]
        for name, whole, alone in (("h'", batched_h, h), ("x'", batched_x, x)):
            if (whole.shape != alone.shape
                    or not torch.allclose(whole, alone, rtol=1e-9, atol=1e-10)):
                raise CheckFailed(f"graph {g}: {name} in a batch of 3 graphs differs from {name} "
                                  "of the graph alone", hint="Normalise by each atom's own number "
                                  "of neighbours, not by anything computed over the whole batch.")
    isolated = got["batched"][1][-1]
    if not torch.allclose(isolated, got["isolated input"], rtol=0, atol=1e-12):
        raise CheckFailed("an atom without neighbours moved (or became nan)",
                          expected=got["isolated input"].tolist(), got=isolated.tolist(),
                          hint="An isolated atom has no neighbours: its mean is over zero terms, "
                               "and it must stay where it is.",
                          recipe="Clamp each atom's neighbour count to at least 1 before "
                                 "dividing the summed shifts by it.")


# bounds nothing: the layer's point is symmetry (E(3)- and permutation-equivariance by
# construction); it costs what one message per edge costs, and saves nothing to measure.
EGNN = task(
    "10.2", reference="ReferenceEGNNLayer",
    # forbids nothing: no installed library has an EGNN layer; the grader's own reference layer
    # is refused as the grader's code (a subclass, a call or a copy of its forward), while its
    # constructor is the task's given scaffolding
    forbidden=(),
    hint="EGNN: messages see only invariant quantities (features and squared distances), "
         "coordinates move along the differences x_i - x_j, and every sum or mean is taken per "
         "target atom, so the layer is E(3)- and permutation-equivariant by construction.",
    recipe="Column (j, i) of edge_index is the edge j -> i: sources in row 0, targets in row 1. "
           "For every edge take the difference x_i - x_j and its squared length, and compute "
           "the message m_ij = phi_e of [h_i, h_j, squared distance, a_ij if given], "
           "concatenated in that order. Move x_i by the mean over its incoming edges of "
           "(x_i - x_j) times phi_x(m_ij): sum into the targets with index_add_ and divide by "
           "each atom's number of incoming edges, at least 1. Sum the messages into their "
           "targets to get m_i, and return phi_h of [h_i, m_i] with the new coordinates.",
)

# The reference layer runs through the same two cases, on the same loaded weights.
EGNN.case("equals the reference layer on loaded weights (2 ligands and an ion, no edge features)",
          compare=_compare_egnn, weight=2)(_egnn_reference_case(0))
EGNN.case("equals the reference layer on loaded weights, with 4 edge features",
          compare=_compare_egnn)(_egnn_reference_case(4))
EGNN.case("float64: features invariant, coordinates equivariant under a random orthogonal Q "
          "(with a reflection) and a translation, within 1e-9", compare=_compare_equivariance,
          weight=2, expect=lambda seed: dict(zip(("Q", "t"), _orthogonal(seed))))(_equivariance_run)
EGNN.case("permutation-equivariant: relabelled atoms and shuffled edges give relabelled outputs",
          compare=_compare_permutation,
          expect=lambda seed: {"perm": torch.randperm(
              _egnn_inputs(seed, 0)["h"].shape[0],
              generator=torch.Generator().manual_seed(seed + 3))})(_permutation_run)
EGNN.case("batched graphs equal each graph alone; an isolated atom stays put",
          compare=_compare_separate, expect=lambda seed: None)(_separate_run)


# --------------------------------------------------------------------------- task 10.3


@functools.cache
def _egfr_smiles() -> tuple[str, ...]:
    from rdkit import Chem

    from kit.lessons.molecules import egfr_actives

    return tuple(Chem.MolToSmiles(m) for m in egfr_actives())


ADVERSARIAL = {
    "all one scaffold (benzene)": ["c1ccccc1C", "c1ccccc1O", "c1ccccc1N", "c1ccccc1Cl",
                                   "c1ccccc1CC", "c1ccccc1", "c1ccccc1F", "c1ccccc1Br"],
    "acyclic molecules only (empty scaffold)": ["CCO", "CC(=O)O", "CCCCN", "C=CC", "CCl", "O",
                                                "CC(C)C", "N#CC"],
    "duplicates and equal-sized scaffold sets": [
        "c1ccccc1C", "C1CCCCC1O", "c1ccncc1C", "c1ccccc1C", "C1CCCCC1N", "c1ccncc1O", "CCO",
        "c1ccc2ccccc2c1", "C1CC1C", "c1ccc2ccccc2c1O", "C1CC1O", "CCN", "c1ccoc1", "c1ccsc1",
        "C[C@H](N)c1ccccc1", "C[C@@H](N)c1ccccc1", "O=C1CCCN1", "c1ccoc1C", "c1ccsc1C", "CCCC"],
}


def _split_lists(split: Any) -> Any:
    if not isinstance(split, (tuple, list)) or len(split) != 3:
        return repr(split)[:200]
    return [[int(i) for i in part] for part in split]


def _compare_split(got: Any, expected: dict[str, Any]) -> None:
    for name, want in expected.items():
        have = got.get(name) if isinstance(got, dict) else None
        if not isinstance(have, list):
            raise CheckFailed(f"{name}: scaffold_split must return (train, valid, test), three "
                              "lists of indices", expected="a tuple of 3 lists", got=have)
        everything = sorted(i for part in have for i in part)
        if everything != sorted(i for part in want for i in part):
            raise CheckFailed(f"{name}: every index must appear in exactly one split",
                              expected=f"{sum(map(len, want))} indices once each",
                              got=f"{len(everything)} indices, {len(set(everything))} distinct")
        for part, h, w in zip(("train", "valid", "test"), have, want):
            if h != w:
                first = next((k for k, (a, b) in enumerate(zip(h, w)) if a != b),
                             min(len(h), len(w)))
                what, hint, recipe, cause = _diagnose_split(have, want)
                raise CheckFailed(
                    f"{name}: the {part} indices differ from DeepChem's ScaffoldSplitter "
                    f"(sizes {list(map(len, have))}, expected {list(map(len, want))}; first "
                    f"difference at position {first}){what}",
                    expected=w[max(0, first - 2):first + 6], got=h[max(0, first - 2):first + 6],
                    hint=hint, recipe=recipe, cause=cause)


# What a split that differs from DeepChem's shows, read from its sizes: a train (or valid) set
# smaller than DeepChem's took small sets first; a larger one put a set past its cutoff; equal
# sizes with other indices hand equal-sized sets out in another order (the case's own hint).
LARGEST_FIRST, CUTOFF, SET_ORDER = ("not the largest sets first", "the cutoffs",
                                   "the order of the sets")

# What a split that breaks the cumulative cutoffs, or the largest-first order, is told.
_CUTOFF_FEEDBACK = (
    "The cutoffs are cumulative: a set joins train while train stays within "
    "frac_train of all molecules, else valid while train and valid together stay "
    "within frac_train + frac_valid, else test.",
    "For each set in order: train if train and the set together stay within "
    "frac_train times the number of molecules; else valid if train, valid and the "
    "set together stay within frac_train + frac_valid times it; else test.", CUTOFF)
_LARGEST_FIRST_RECIPE = ("Order the scaffold sets by size, largest first (ties by first index, "
                         "descending), before handing them out.", LARGEST_FIRST)


def _diagnose_split(have: list[list[int]], want: list[list[int]]) -> tuple[str, str, str, str]:
    sizes, expected = list(map(len, have)), list(map(len, want))
    if sizes[0] < expected[0]:
        return ("; train is smaller, so it did not take the largest scaffold sets first",
                "Train takes the biggest scaffold sets first, so it fills its share with few, "
                "large sets and leaves the rare scaffolds to valid and test.",
                *_LARGEST_FIRST_RECIPE)
    if sizes != expected and sizes[0] > expected[0]:
        return ("; train is larger, so a set went past its cutoff",
                *_CUTOFF_FEEDBACK)
    if sizes != expected and sizes[1] < expected[1]:
        return ("; valid is smaller, so the sets did not come largest first",
                "Train takes the biggest scaffold sets first, then valid the next ones, and test "
                "what is left: the rare scaffolds.",
                *_LARGEST_FIRST_RECIPE)
    if sizes != expected:
        return ("; valid is larger, so a set went past its cutoff",
                *_CUTOFF_FEEDBACK)
    return "", "", "", SET_ORDER


def _split_case(name: str, sets: Any, hint: str = "", **fracs: float) -> None:
    def run(impl: Any, seed: int) -> dict[str, Any]:
        return {k: _split_lists(impl(list(smiles), **fracs)) for k, smiles in sets().items()}

    def expect(seed: int) -> dict[str, Any]:
        reference = SCAFFOLD.trusted(SCAFFOLD.reference)
        return {k: _split_lists(reference(list(smiles), **fracs)) for k, smiles in sets().items()}

    SCAFFOLD.case(name, compare=_compare_split, hint=hint, expect=expect)(run)


def _invalid_run(impl: Any, seed: int) -> dict[str, str]:
    from rdkit import RDLogger

    RDLogger.DisableLog("rdApp.*")  # RDKit's parse errors go to stderr (nbgrader scores that 0)
    try:
        impl(["CCO", "c1ccccc1", "C1CC(", "CCN"])
    except ValueError as e:
        return {"raised": "ValueError", "message": str(e)}
    except Exception as e:  # noqa: BLE001 - the type is what the check reports
        return {"raised": type(e).__name__, "message": str(e)}
    finally:
        RDLogger.EnableLog("rdApp.*")
    return {"raised": "nothing", "message": ""}


def _compare_invalid(got: Any, expected: Any) -> None:
    if got.get("raised") != "ValueError" or "2" not in got.get("message", ""):
        raise CheckFailed("an unparsable SMILES at index 2 must raise a ValueError naming index 2",
                          expected="ValueError('... index 2 ...')",
                          got=f"{got.get('raised')}: {got.get('message', '')[:120]}",
                          hint="Chem.MolFromSmiles returns None for bad SMILES: raise "
                               "ValueError with the index and the SMILES there.")


# bounds nothing: a scaffold split is about what the test set may contain (no scaffold seen in
# training), not about memory or compute.
SCAFFOLD = task(
    "10.3", reference="reference_scaffold_split",
    hint="A scaffold split keeps every molecule of one Bemis-Murcko scaffold in the same split, "
         "so the test set holds chemistry the model never saw; train takes the biggest scaffold "
         "sets that fit, valid and test what is left. Compare your order with DeepChem's split "
         "of the lesson's 10 molecules.",
    recipe="Group the indices by their Murcko scaffold SMILES without chirality; order the groups "
           "as DeepChem does (by size, ties by first index, both descending); give each group to "
           "train while train stays within its fraction of n, else to valid while train and "
           "valid together stay within their summed fraction, else to test; a group that does "
           "not fit does not stop the walk.",
    forbidden=("deepchem.splits.ScaffoldSplitter", "deepchem.splits.splitters.ScaffoldSplitter",
               "autograder.references.lesson10.reference_scaffold_split"),
)

ORDER_HINT = ("Equal-sized scaffold sets are not handed out in the order their first molecules "
              "appear: in the lesson's 10 molecules, pyridine (first at index 2) goes before "
              "cyclohexane (first at index 1).")
_split_case("FreeSolv (642 molecules), 80/10/10", lambda: {"FreeSolv": _freesolv_smiles()},
            hint=ORDER_HINT)
_split_case("365 EGFR ligands, 70/20/10", lambda: {"EGFR": _egfr_smiles()}, hint=ORDER_HINT,
            frac_train=0.7, frac_valid=0.2, frac_test=0.1)
_split_case("adversarial lists: one scaffold, acyclic only, duplicates and ties",
            lambda: ADVERSARIAL,
            hint="Acyclic molecules share the empty scaffold ''; duplicates share a set; "
                 "chirality is ignored. " + ORDER_HINT)
# Three big scaffold sets (benzene 8, pyridine 6, cyclohexane 2) fill train to exactly 80% of 20;
# four scaffolds occur once (naphthalene, thiophene, furan, cyclopropane): valid and test get them.
SINGLETONS = ["c1ccccc1C", "c1ccncc1C", "c1ccc2ccccc2c1", "c1ccccc1O", "C1CCCCC1C", "c1ccncc1O",
              "c1ccccc1N", "c1ccsc1C", "c1ccncc1N", "c1ccccc1Cl", "C1CCCCC1O", "c1ccccc1F",
              "c1ccncc1Cl", "c1ccoc1C", "c1ccccc1Br", "c1ccncc1F", "c1ccccc1CC", "C1CC1C",
              "c1ccncc1CC", "c1ccccc1OC"]


def _singletons_run(impl: Any, seed: int) -> Any:
    return _split_lists(impl(list(SINGLETONS)))


def _singletons_expected(seed: int) -> dict[str, Any]:
    from rdkit.Chem.Scaffolds import MurckoScaffold

    scaffolds = [MurckoScaffold.MurckoScaffoldSmiles(smiles=s) for s in SINGLETONS]
    reference = SCAFFOLD.trusted(SCAFFOLD.reference)
    return {"split": _split_lists(reference(list(SINGLETONS))),
            "singletons": sorted(i for i, sc in enumerate(scaffolds) if scaffolds.count(sc) == 1)}


def _compare_singletons(got: Any, expected: dict[str, Any]) -> None:
    if isinstance(got, list):  # the goal first, then DeepChem's exact lists
        crowded = [i for i in got[2] if i not in expected["singletons"]]
        if crowded:
            raise CheckFailed(f"test holds molecules {crowded}, whose scaffolds occur more than "
                              "once: the big scaffold sets belong in train",
                              expected=f"test within the singletons {expected['singletons']}",
                              got=got[2], cause=LARGEST_FIRST)
    _compare_split({"20 molecules": got} if isinstance(got, list) else {},
                   {"20 molecules": expected["split"]})


SCAFFOLD.case("the test set gets singleton scaffolds (3 big scaffold sets fill train, 4 unique "
              "scaffolds are left)", compare=_compare_singletons, expect=_singletons_expected,
              hint="The largest scaffold sets go to train; the scaffolds that occur once are what "
                   "is left for valid and test.")(_singletons_run)
SCAFFOLD.case("an invalid SMILES raises a ValueError naming its index", compare=_compare_invalid,
              expect=lambda seed: None)(_invalid_run)


def _freesolv_smiles() -> list[str]:
    from kit.lessons.molecules import freesolv

    return freesolv()[0]


# --------------------------------------------------------------------------- task 10.4

SCORING = "rdkit/ML/Scoring/Scoring.py"
SCORING_WATCH = {SCORING: ("CalcEnrichment", "CalcBEDROC", "CalcRIE", "_RIEHelper", "CalcAUC",
                           "CalcROC")}


def _random_screens(seed: int) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, float]]]:
    """Random screens: continuous scores, heavily tied scores, few actives, early actives."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, actives, ties, args in ((1000, 30, False, {"fraction": 0.01, "alpha": 20.0}),
                                   (777, 40, True, {"fraction": 0.05, "alpha": 20.0}),
                                   (250, 3, True, {"fraction": 0.1, "alpha": 5.0}),
                                   (333, 25, False, {"fraction": 0.02, "alpha": 80.0})):
        labels = torch.zeros(n, dtype=torch.bool)
        labels[torch.randperm(n, generator=g)[:actives]] = True
        scores = torch.randn(n, generator=g, dtype=torch.float64) + 1.5 * labels
        if ties:
            scores = scores.round()  # a handful of distinct values: ties everywhere
        out.append((scores, labels, args))
    return out


@functools.cache
def _real_screen() -> tuple[torch.Tensor, torch.Tensor]:
    """365 EGFR actives and 2,000 NCI compounds scored by their number of nitrogen atoms (a weak
    score with 9 distinct values: ties galore, and a top 1% that mixes actives and decoys)."""
    from rdkit import Chem, RDLogger

    from kit.lessons.molecules import decoy_pool, egfr_actives

    RDLogger.DisableLog("rdApp.*")
    pool = [Chem.MolFromSmiles(s) for s in decoy_pool()[:2000]]
    mols = list(egfr_actives()) + [m for m in pool if m is not None]
    labels = torch.tensor([i < len(egfr_actives()) for i in range(len(mols))])
    scores = torch.tensor([float(sum(a.GetAtomicNum() == 7 for a in m.GetAtoms())) for m in mols],
                          dtype=torch.float64)
    perm = torch.randperm(len(mols), generator=torch.Generator().manual_seed(0))
    return scores[perm], labels[perm]


def _metric_inputs(seed: int) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, float]]]:
    scores, labels = _real_screen()
    return [*_random_screens(seed), (scores, labels, {"fraction": 0.01, "alpha": 20.0})]


def metrics_of(ef: Any, bedroc: Any, seed: int) -> list[dict[str, Any]]:
    out = []
    for scores, labels, args in _metric_inputs(seed):
        out.append({
            "enrichment_factor": plain(ef(scores.clone(), labels.clone(), args["fraction"])),
            "bedroc": plain(bedroc(scores.clone(), labels.clone(), args["alpha"]))})
    return out


def _compare_metrics(got: Any, expected: Any) -> None:
    if isinstance(got, dict) and got.get("called"):
        raise CheckFailed(f"calls RDKit's scoring ({', '.join(got['called'])}): Task 10.4 "
                          "re-implements it", expected="no call", got=got["called"])
    names = ["1000 molecules", "777 molecules with tied scores", "250 molecules, 3 actives, tied",
             "333 molecules, alpha=80", "the EGFR screen (nitrogen count, ties)"]
    for name, have, want in zip(names, got["values"], expected["values"]):
        for key, value in want.items():
            h = have[key]
            if isinstance(h, torch.Tensor) and h.numel() == 1:
                h = h.item()
            if (not isinstance(h, (int, float))
                    or not math.isclose(h, value, rel_tol=1e-9, abs_tol=1e-12)):
                counterpart = "CalcEnrichment" if key == "enrichment_factor" else "CalcBEDROC"
                raise CheckFailed(f"{name}: {key} differs from RDKit's {counterpart}",
                                  expected=value, got=h, hint=METRIC_HINTS[key],
                                  recipe=METRIC_RECIPES[key], cause=METRIC_WRONG)


# A metric that differs from RDKit's on one process differs on the sharded screen too: that case
# follows this one when its ranking is right.
METRIC_WRONG = "a metric differs from RDKit's"
METRIC_HINTS = {
    "enrichment_factor": "EF@x: how much richer in actives the top x of the ranked list is than "
                         "the whole list; ties are ranked by position.",
    "bedroc": "BEDROC: each active counts exp(-alpha * rank / N), normalised between the worst "
              "and the best possible placement of the actives, so it lies in [0, 1].",
}
METRIC_RECIPES = {
    "enrichment_factor": "Rank by score, descending, ties by ascending position (a stable sort); "
                         "n = ceil(N * fraction) molecules (at least 1); EF = (actives in the top "
                         "n / n) / (actives / N), and 0.0 when there are no actives.",
    "bedroc": "Rank as for EF; RIE = sum over actives of exp(-alpha * r / N) (r from 1) divided by "
              "its random expectation A/N * (1 - e^-alpha) / (e^(alpha/N) - 1), A the number of "
              "actives; with ra = A/N, RIEmax = (1 - e^(-alpha ra)) / (ra (1 - e^-alpha)) and "
              "RIEmin = (1 - e^(alpha ra)) / (ra (1 - e^alpha)); BEDROC = (RIE - RIEmin) / "
              "(RIEmax - RIEmin), 1.0 if the two are equal, 0.0 without actives (Truchon & "
              "Bayly 2007, eq. 36).",
}


def _metrics_run(impl: Any, seed: int) -> dict[str, Any]:
    ef, bedroc = _companion(SCREEN, impl, "enrichment_factor"), _companion(SCREEN, impl, "bedroc")
    with _calls_into(SCORING_WATCH) as called:
        values = metrics_of(ef, bedroc, seed)
    return {"values": values, "called": list(called)}


# Shards of the EGFR screen on 4 ranks: very uneven, one of them empty; ids are global ids.
SHARD_SIZES = (0.55, 0.0, 0.1, 0.35)


def shards(seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    scores, labels = _real_screen()
    g = torch.Generator().manual_seed(seed + 11)
    ids = torch.randperm(len(scores), generator=g)  # global ids, not positions
    order = torch.randperm(len(scores), generator=g)  # who holds what: shuffled
    bounds = [0]
    for f in SHARD_SIZES:
        bounds.append(bounds[-1] + round(f * len(scores)))
    bounds[-1] = len(scores)
    return [(scores[order[a:b]], labels[order[a:b]], ids[order[a:b]])
            for a, b in zip(bounds, bounds[1:])]


def _screen_on_rank(screen_metrics: Any, seed: int) -> dict[str, Any]:
    import torch.distributed as dist

    from kit.trace import trace

    scores, labels, ids = shards(seed)[dist.get_rank()]
    with _calls_into(SCORING_WATCH) as called, trace() as t:
        out = screen_metrics(scores.clone(), labels.clone(), ids.clone())
    if not isinstance(out, dict):
        return {"result": repr(out)[:200], "called": list(called), "collectives": len(t.events)}
    result = {k: plain(out.get(k)) if not isinstance(out.get(k), list) else
              [plain(v) for v in out[k]] for k in ("ef1", "bedroc", "top100")}
    return {"result": result, "called": list(called),
            "collectives": sum(e.kind == "collective" for e in t.events)}


def _compare_screen(got: Any, expected: dict[str, Any]) -> None:
    for rank, run in enumerate(per_rank(got, len(SHARD_SIZES))):
        if run["called"]:
            raise CheckFailed(f"rank {rank} calls RDKit's scoring ({', '.join(run['called'])}): "
                              "Task 10.4 re-implements it", expected="no call", got=run["called"])
        if run["collectives"] == 0:
            raise CheckFailed(f"rank {rank}: no collective was traced; the global metrics need "
                              "every rank's scores", hint="The metrics are of the whole screen: "
                              "every rank needs every shard.", recipe="all_gather the shard sizes, "
                              "then the padded scores, labels and ids (or all_gather_object).")
        result = run["result"]
        if not isinstance(result, dict):
            raise CheckFailed(f"rank {rank}: screen_metrics must return a dict with keys ef1, "
                              "bedroc and top100", got=result)
        # the ranking first: a top100 that differs explains metrics that differ; a right
        # ranking with wrong metrics is the formula (the case above, same cause) or the shards
        top = result["top100"]
        top = top.tolist() if isinstance(top, torch.Tensor) else [int(v) if isinstance(v, int)
                                                                  else plain(v) for v in top]
        top = [int(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v for v in top]
        if top != expected["top100"]:
            first = next((i for i, (a, b) in enumerate(zip(top, expected["top100"])) if a != b),
                         min(len(top), 100))
            raise CheckFailed(f"rank {rank}: top100 differs from one process at position {first}",
                              expected=expected["top100"][first:first + 5],
                              got=top[first:first + 5],
                              hint="Ties are broken by ascending global id, so the ranking "
                                   "does not depend on which rank held which molecule.",
                              recipe="Sort by score descending and break ties by ascending id, "
                                     "not by the order the shards arrived in: sort by id first, "
                                     "then stably by score.")
        for key in ("ef1", "bedroc"):
            value = result[key].item() if isinstance(result[key], torch.Tensor) else result[key]
            if not isinstance(value, (int, float)) or not math.isclose(value, expected[key],
                                                                        rel_tol=1e-9):
                raise CheckFailed(f"rank {rank}: {key} of the whole screen differs from one "
                                  "process on the whole list", expected=expected[key], got=value,
                                  hint="A top fraction of each shard is not the top fraction "
                                       "of the screen: the metrics rank the whole list.",
                                  recipe="Gather every rank's scores, labels and ids first, then "
                                         "rank the whole list once and compute the metrics on it.",
                                  cause=METRIC_WRONG)


# bounds nothing: early-recognition metrics rank the whole screen, so every rank needs every
# shard; gathering them is the point, and nothing is saved to measure.
SCREEN = task(
    "10.4",
    hint="Early-recognition metrics depend only on where the actives land in the ranked list: "
         "EF@x compares their share of the top x with their share overall, BEDROC weights each "
         "one by an exponential of its rank. For a sharded screen the ranking is of the whole "
         "screen, so every rank needs every shard.",
    recipe="Rank by score descending, ties by ascending id (a stable sort; for a plain list the "
           "id is the position). enrichment_factor: N molecules, A actives (0.0 if none); take "
           "the top n = ceil(N * fraction), at least 1; EF = (actives in the top n / n) / "
           "(A / N). bedroc: r the 1-based ranks of the actives; RIE = sum of exp(-alpha r / N) "
           "divided by A/N * (1 - e^-alpha) / (e^(alpha/N) - 1); with ra = A/N, RIEmax = "
           "(1 - e^(-alpha ra)) / (ra (1 - e^-alpha)) and RIEmin = (1 - e^(alpha ra)) / "
           "(ra (1 - e^alpha)); BEDROC = (RIE - RIEmin) / (RIEmax - RIEmin), 1.0 if they are "
           "equal, 0.0 without actives. screen_metrics: all-gather the shard sizes; pad each "
           "shard's scores, labels and ids to the largest size and all-gather them; drop the "
           "padding; rank the whole list as above and return EF@1%, BEDROC(20) and the first "
           "100 ids.",
    # RDKit's scoring, the whole module (CalcROC, the private _RIEHelper too).
    forbidden=("rdkit.ML.Scoring.Scoring.CalcEnrichment", "rdkit.ML.Scoring.Scoring.CalcBEDROC",
               "rdkit.ML.Scoring.Scoring.CalcRIE", "rdkit.ML.Scoring.Scoring.CalcAUC",
               "rdkit.ML.Scoring",
               "autograder.references.lesson10.reference_enrichment_factor",
               "autograder.references.lesson10.reference_bedroc",
               "autograder.references.lesson10.reference_screen"),
)
_SCREEN_RANKS = SCREEN.shared(_screen_on_rank, world_size=len(SHARD_SIZES), timeout=30.0)

SCREEN.case("enrichment_factor and bedroc equal RDKit's CalcEnrichment and CalcBEDROC on random "
            "screens (with ties) and the EGFR screen", compare=_compare_metrics, weight=2,
            expect="rdkit_metrics")(_metrics_run)
SCREEN.case("screen_metrics on 4 uneven shards (one empty): every rank gets one process's EF@1%, "
            "BEDROC(20) and top-100 ids", uses=_SCREEN_RANKS, compare=_compare_screen, weight=2,
            expect="screen_of_every_shard")
