"""Big-graph helpers for Lesson 11: the tasks' data types, graphs to run them on, and PyG's
loader driven by a sampler you wrote.

* Types: :class:`SampledSubgraph` (Task 11.1's output), :class:`HaloPlan` (Task 11.2's),
  :class:`LocalGraph` with :func:`local_graph` (what a rank holds of a partitioned graph) and
  :class:`FeatureCache` (the remote feature rows a rank keeps, Task 11.4's input).
* Graphs: :func:`peptide_graph`, a k-nearest-neighbour graph of the 5,200 labelled peptides
  that ship in the ``modlamp`` wheel, by k-mer profile; :func:`power_law_graph`, a generated
  degree-corrected graph with planted classes, up to about a million nodes in seconds;
  :func:`amazon_products` and :func:`ogbn_products`, the real benchmarks, which only load
  files you fetched yourself (nothing here downloads).
* Structure: :func:`in_neighbour_csr` (the CSR a sampler reads), :func:`metis_partition`
  (METIS through ``pymetis``), :func:`random_partition` and :func:`partition_stats` (edge cut,
  balance and halo sizes, counted on the whole graph).
* Loading: :class:`FunctionSampler`, a ``torch_geometric.sampler.BaseSampler`` that runs a
  ``sample_neighbors``-style function, so PyG's own ``NodeLoader`` batches with it, and
  :func:`neighbor_loader`, which is PyG's ``NeighborLoader`` where ``pyg-lib`` (or
  ``torch-sparse``) is installed and ``NodeLoader`` with your sampler where not.

No task's answer lives here: sampling, halo plans, the halo layer and feature fetching are the
student's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

__all__ = [
    "AMAZON_PRODUCTS",
    "OGBN_PRODUCTS",
    "FeatureCache",
    "FunctionSampler",
    "HaloPlan",
    "LocalGraph",
    "SampledSubgraph",
    "amazon_products",
    "in_neighbour_csr",
    "local_graph",
    "metis_partition",
    "neighbor_loader",
    "ogbn_products",
    "partition_stats",
    "peptide_graph",
    "power_law_graph",
    "pyg_lib_available",
    "random_partition",
]

# Sizes from the datasets' own documentation (PyG's AmazonProducts page; OGB's node property
# prediction page, which counts each undirected edge once).
AMAZON_PRODUCTS = {"nodes": 1_569_960, "edges": 264_339_468, "features": 200, "classes": 107}
OGBN_PRODUCTS = {"nodes": 2_449_029, "edges": 61_859_140, "features": 100, "classes": 47}


class SampledSubgraph(NamedTuple):
    """A neighbour-sampled mini-batch (Task 11.1), with PyG ``NeighborLoader``'s meanings.

    ``n_id``: (n,) global ids, the seeds first; ``edge_index``: (2, e) local ids into ``n_id``,
    row 0 the sources (the sampled neighbours), row 1 the nodes they were sampled for;
    ``num_sampled_nodes``: hops + 1 counts, the seeds first; ``num_sampled_edges``: one per hop.
    """

    n_id: torch.Tensor
    edge_index: torch.Tensor
    num_sampled_nodes: list[int]
    num_sampled_edges: list[int]


class HaloPlan(NamedTuple):
    """What one rank exchanges with every other (Task 11.2): one int64 tensor per rank each.

    ``recv[s]``: the global ids this rank needs from rank s; ``send[s]``: the ids rank s needs
    from this rank. Each sorted ascending; the entries for the rank itself are empty.
    """

    recv: list[torch.Tensor]
    send: list[torch.Tensor]


class LocalGraph(NamedTuple):
    """What one rank holds of a partitioned graph.

    ``own``: (n_own,) the sorted global ids of its nodes; ``edge_index``: (2, e) global ids,
    every edge whose target is in ``own``, row 0 the sources.
    """

    own: torch.Tensor
    edge_index: torch.Tensor


class FeatureCache(NamedTuple):
    """Feature rows of remote nodes that one rank keeps, so a batch need not fetch them.

    ``ids``: (c,) sorted distinct global ids, none owned by the rank; ``rows``: (c, F) their
    features, row i for ``ids[i]``. Filled once, before training: a static cache.
    """

    ids: torch.Tensor
    rows: torch.Tensor

    def hit_rate(self, remote: torch.Tensor) -> float:
        """The share of the distinct remote ids ``remote`` that this cache holds (0 if none)."""
        remote = torch.unique(remote)
        return torch.isin(remote, self.ids).float().mean().item() if remote.numel() else 0.0


def local_graph(edge_index: torch.Tensor, part: torch.Tensor, rank: int) -> LocalGraph:
    """This rank's part of a graph: its nodes (``part == rank``) and the edges into them."""
    own = (part == rank).nonzero().flatten()
    return LocalGraph(own, edge_index[:, part[edge_index[1]] == rank])


# --------------------------------------------------------------------------- structure


def in_neighbour_csr(edge_index: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rowptr, col)``: node v's in-neighbours (sources of edges into v) are
    ``col[rowptr[v]:rowptr[v + 1]]``, in the order the edges appear in ``edge_index``.

    This is PyG's CSC layout (``colptr``, ``row``) under the names Task 11.1 uses.
    """
    src, dst = edge_index
    order = torch.argsort(dst, stable=True)
    counts = torch.bincount(dst, minlength=num_nodes)
    rowptr = torch.zeros(num_nodes + 1, dtype=torch.long)
    rowptr[1:] = torch.cumsum(counts, 0)
    return rowptr, src[order].contiguous()


def _symmetric_simple(edge_index: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Both directions of every edge, without self-loops or duplicates, sorted by target."""
    src, dst = edge_index
    keep = src != dst
    src, dst = torch.cat([src[keep], dst[keep]]), torch.cat([dst[keep], src[keep]])
    key = torch.unique(dst * num_nodes + src)  # sorted by target, then source
    return torch.stack([key % num_nodes, key // num_nodes])


def metis_partition(edge_index: torch.Tensor, num_nodes: int, parts: int,
                    seed: int = 0) -> torch.Tensor:
    """(num_nodes,) the owning part of each node, from METIS (``pymetis.part_graph``) run on
    the graph made undirected. Deterministic for a given seed."""
    if parts == 1:
        return torch.zeros(num_nodes, dtype=torch.long)
    try:
        import pymetis
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("Lesson 11 partitions with METIS from the pymetis wheel: "
                                  "pip install pymetis") from e
    sym = _symmetric_simple(edge_index, num_nodes)
    rowptr, col = in_neighbour_csr(sym, num_nodes)
    result = pymetis.part_graph(parts, pymetis.CSRAdjacency(rowptr.tolist(), col.tolist()),
                                options=pymetis.Options(seed=seed))
    return torch.tensor(list(result.vertex_part), dtype=torch.long)


def random_partition(num_nodes: int, parts: int, seed: int = 0) -> torch.Tensor:
    """(num_nodes,) a balanced random owner for each node (sizes differ by at most one)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(num_nodes, generator=g) % parts


def partition_stats(edge_index: torch.Tensor, part: torch.Tensor, parts: int) -> dict[str, Any]:
    """Edge cut (fraction of edges between parts), balance (largest part / mean part) and, per
    part, its nodes and its halo: the distinct remote sources of edges into it."""
    src, dst = edge_index
    cut = part[src] != part[dst]
    sizes = torch.bincount(part, minlength=parts)
    halo = []
    for r in range(parts):
        into = cut & (part[dst] == r)
        halo.append(int(torch.unique(src[into]).numel()))
    return {"edge_cut": cut.double().mean().item() if cut.numel() else 0.0,
            "balance": (sizes.max() / sizes.double().mean()).item(),
            "nodes": sizes.tolist(), "halo": halo}


# --------------------------------------------------------------------------- graphs


@functools.cache
def _peptide_graph(k: int, kmer: int) -> Any:
    from torch_geometric.data import Data

    from kit.lessons.proteins import CANONICAL, load_peptides

    sequences, labels, _ = load_peptides("AMPvsUniProt")
    table = torch.full((128,), -1, dtype=torch.long)  # ASCII -> amino-acid code, -1 elsewhere
    table[torch.tensor([ord(a) for a in CANONICAL])] = torch.arange(len(CANONICAL))
    codes = table[torch.tensor(list("".join(sequences).encode()), dtype=torch.long)]
    lengths = torch.tensor([len(s) for s in sequences])
    owner = torch.arange(len(sequences)).repeat_interleave(lengths)
    # k-mer j of position i: codes i .. i + kmer - 1 read as base-20 digits, within one peptide
    span = codes.numel() - kmer + 1
    index, valid = torch.zeros(span, dtype=torch.long), owner[:span] == owner[kmer - 1:]
    for d in range(kmer):
        index = index * len(CANONICAL) + codes[d:d + span]
        valid &= codes[d:d + span] >= 0
    x = torch.zeros(len(sequences) * len(CANONICAL) ** kmer)
    x.index_add_(0, owner[:span][valid] * len(CANONICAL) ** kmer + index[valid],
                 torch.ones(int(valid.sum())))
    x = x.view(len(sequences), -1)
    x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)  # cosine similarity = dot product
    neighbours = []
    for start in range(0, len(x), 1024):  # (1024, N) similarities at a time
        sim = x[start:start + 1024] @ x.T
        sim[torch.arange(sim.shape[0]), torch.arange(start, start + sim.shape[0])] = -2.0
        neighbours.append(sim.topk(k, dim=1).indices)
    nbr = torch.cat(neighbours)  # (N, k)
    src = nbr.reshape(-1)
    dst = torch.arange(len(x)).repeat_interleave(k)
    edge_index = _symmetric_simple(torch.stack([src, dst]), len(x))
    return Data(x=x, y=labels, edge_index=edge_index, num_nodes=len(x))


def peptide_graph(k: int = 8, kmer: int = 2) -> Any:
    """A real graph from shipped data: modlamp's 5,200 peptides (2,600 antimicrobial, label 1;
    2,600 random UniProt fragments, label 0), each joined to its ``k`` most similar peptides by
    cosine similarity of their ``kmer``-mer counts, made undirected.

    Returns a PyG ``Data`` with ``x`` (5200, 20**kmer) unit-length k-mer profiles, ``y`` (5200,)
    and ``edge_index`` (2, E) sorted by target.
    """
    return _peptide_graph(k, kmer).clone()


def power_law_graph(num_nodes: int = 100_000, avg_degree: float = 10.0, *, exponent: float = 2.5,
                    classes: int = 8, homophily: float = 0.8, features: int = 32,
                    seed: int = 0) -> Any:
    """A generated undirected graph with power-law degrees and planted classes (Chung-Lu with
    communities), for scale and timing: a million nodes take a few seconds.

    Node i gets an expected degree proportional to (i + 1) ** (-1 / (exponent - 1)) (ids are
    shuffled); each edge draws its source by that weight and its target by weight too, from
    the source's class with probability ``homophily``. ``x`` is (num_nodes, features): a class
    mean plus unit noise; ``y`` the class.
    """
    from torch_geometric.data import Data

    g = torch.Generator().manual_seed(seed)
    w = (torch.arange(num_nodes, dtype=torch.float64) + 1) ** (-1.0 / (exponent - 1.0))
    w = w[torch.randperm(num_nodes, generator=g)]
    y = torch.randint(classes, (num_nodes,), generator=g)
    m = int(num_nodes * avg_degree / 2)
    src = torch.multinomial(w, m, replacement=True, generator=g)
    dst = torch.multinomial(w, m, replacement=True, generator=g)
    # the homophilous share: a target of the source's class, drawn by weight within the class
    same = torch.rand(m, generator=g) < homophily
    order = torch.argsort(y, stable=True)
    cum = torch.cumsum(w[order], 0)
    ends = cum[torch.cumsum(torch.bincount(y, minlength=classes), 0) - 1]
    starts = torch.cat([torch.zeros(1, dtype=torch.float64), ends[:-1]])
    c = y[src[same]]
    u = starts[c] + (torch.rand(int(same.sum()), generator=g, dtype=torch.float64)
                     * (ends[c] - starts[c]))
    dst[same] = order[torch.searchsorted(cum, u).clamp_max(num_nodes - 1)]
    edge_index = _symmetric_simple(torch.stack([src, dst]), num_nodes)
    means = torch.randn(classes, features, generator=g)
    x = means[y] + torch.randn(num_nodes, features, generator=g)
    return Data(x=x, y=y, edge_index=edge_index, num_nodes=num_nodes)


def _need_files(root: Path, names: Sequence[str], what: str, how: str) -> None:
    missing = [n for n in names if not (root / n).exists()]
    if missing:
        raise FileNotFoundError(
            f"{what} is not on this machine: {', '.join(str(root / n) for n in missing)} "
            f"missing. Nothing in this course downloads it. {how}")


def amazon_products(root: str | Path) -> Any:
    """PyG's ``AmazonProducts`` (GraphSAINT's Amazon graph: 1,569,960 nodes, 264,339,468 edges,
    200 features, 107 classes), from files already under ``root/raw`` (or ``root/processed``)."""
    root = Path(root)
    raw = ("adj_full.npz", "feats.npy", "class_map.json", "role.json")
    if not (root / "processed" / "data.pt").exists():
        _need_files(root / "raw", raw, "AmazonProducts",
                    "On a machine with internet access run `python -c \"from torch_geometric."
                    f"datasets import AmazonProducts; AmazonProducts('{root}')\"` (about 2 GB), "
                    f"or copy GraphSAINT's amazon files {', '.join(raw)} into {root / 'raw'}.")
    from torch_geometric.datasets import AmazonProducts

    return AmazonProducts(str(root))[0]


def ogbn_products(root: str | Path) -> Any:
    """OGB's ``ogbn-products`` (2,449,029 nodes, 61,859,140 undirected edges, 100 features, 47
    classes) through ``ogb``'s PyG loader, from files already under ``root/ogbn_products``."""
    root = Path(root)
    folder = root / "ogbn_products"
    _need_files(folder, ("processed/geometric_data_processed.pt",), "ogbn-products",
                "On a machine with internet access run `pip install ogb` and `python -c \"from "
                "ogb.nodeproppred import PygNodePropPredDataset; PygNodePropPredDataset("
                f"'ogbn-products', root='{root}')\"` (about 1.4 GB), then copy {folder} here.")
    try:
        from ogb.nodeproppred import PygNodePropPredDataset
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("ogbn-products loads through OGB's own loader: "
                                  "pip install ogb") from e
    return PygNodePropPredDataset("ogbn-products", root=str(root))[0]


# --------------------------------------------------------------------------- loading


def pyg_lib_available() -> bool:
    """Whether PyG's compiled samplers are here (``pyg-lib`` or ``torch-sparse``), which
    ``NeighborLoader`` needs."""
    import torch_geometric.typing as pyg_typing

    return bool(pyg_typing.WITH_PYG_LIB or pyg_typing.WITH_TORCH_SPARSE)


def _sampler_base() -> type:
    from torch_geometric.sampler import BaseSampler

    return BaseSampler


class FunctionSampler(_sampler_base()):  # type: ignore[misc]
    """PyG's ``BaseSampler`` around ``sample(rowptr, col, seeds, fanouts, generator)``.

    ``NodeLoader(data, node_sampler=FunctionSampler(sample, data, fanouts), batch_size=...)``
    then gives the same ``Data`` batches as ``NeighborLoader``: ``n_id``, ``batch_size`` (the
    seeds are the first ``batch_size`` nodes), local ``edge_index``, ``num_sampled_nodes`` and
    ``num_sampled_edges``, with every node attribute of ``data`` sliced by ``n_id``.
    """

    def __init__(self, sample: Callable[..., Any], data: Any, fanouts: Sequence[int],
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.sample = sample
        self.fanouts = list(fanouts)
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self.rowptr, self.col = in_neighbour_csr(data.edge_index, data.num_nodes)

    def sample_from_nodes(self, inputs: Any, **kwargs: Any) -> Any:
        from torch_geometric.sampler import SamplerOutput

        sub = self.sample(self.rowptr, self.col, inputs.node, self.fanouts, self.generator)
        return SamplerOutput(node=sub.n_id, row=sub.edge_index[0], col=sub.edge_index[1],
                             edge=None, num_sampled_nodes=[int(n) for n in sub.num_sampled_nodes],
                             num_sampled_edges=[int(n) for n in sub.num_sampled_edges],
                             metadata=(inputs.input_id, inputs.time))

    def sample_from_edges(self, inputs: Any, neg_sampling: Any = None) -> Any:
        raise NotImplementedError("FunctionSampler samples around seed nodes only "
                                  "(NodeLoader); link prediction needs LinkNeighborLoader")


def neighbor_loader(data: Any, num_neighbors: Sequence[int], *, sample: Callable[..., Any],
                    generator: torch.Generator | None = None, **kwargs: Any) -> Any:
    """PyG's ``NeighborLoader(data, num_neighbors, **kwargs)`` where ``pyg-lib`` is installed;
    elsewhere PyG's ``NodeLoader`` running ``sample`` (the same API, batches of the same form).

    ``kwargs`` are the loader's own (``input_nodes``, ``batch_size``, ``shuffle``, ...).
    ``generator`` feeds ``sample`` only: ``NeighborLoader`` takes none (pyg-lib draws with its
    own random numbers), so there the draws cannot be replayed from it.
    """
    if pyg_lib_available():
        from torch_geometric.loader import NeighborLoader

        return NeighborLoader(data, num_neighbors=list(num_neighbors), **kwargs)
    from torch_geometric.loader import NodeLoader

    return NodeLoader(data, node_sampler=FunctionSampler(sample, data, num_neighbors, generator),
                      **kwargs)
