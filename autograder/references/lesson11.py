"""The grader's answers for Lesson 11 (trusted only).

11.1: a neighbour sampler written as the plain loop of PyG's ``NeighborLoader`` semantics
(``replace=False``): the fixed sample at full fan-out, whose per-hop sizes come from PyG's own
``NeighborSampler`` where ``pyg-lib`` or ``torch-sparse`` is installed; and PyG's ``GraphSAGE``
on the whole graph. 11.2: halo plans read off the whole graph with Python sets. 11.3: PyG's
``GCNConv`` on the whole graph, in one process, with the weights the ranks load. 11.4: the rows
indexed out of the whole matrix, and each rank's bytes counted with Python sets.
"""

from __future__ import annotations

from typing import Any

import torch

from autograder.lesson11 import (
    CONV_IN,
    CONV_OUT,
    CONV_PARTS,
    EDGE_SAMPLES,
    FETCH_DIM,
    FETCH_RANKS,
    FETCH_SCENES,
    FULL,
    PLAN_RANKS,
    _seeds,
    conv_setup,
    directed_graph,
    edge_graph,
    fetch_setup,
    plan_graph,
    plan_partitions,
    sage_inputs,
)
from kit.lessons.graphs import SampledSubgraph, in_neighbour_csr, local_graph, pyg_lib_available

# --------------------------------------------------------------------------- 11.1


def sample_neighbors(rowptr: torch.Tensor, col: torch.Tensor, seeds: torch.Tensor,
                     fanouts: list[int], generator: torch.Generator) -> SampledSubgraph:
    """NeighborLoader's sampling, one node at a time: a random permutation's first
    min(fanout, degree) positions, visited in col order."""
    local = {int(v): i for i, v in enumerate(seeds.tolist())}
    n_id = [int(v) for v in seeds.tolist()]
    frontier = list(n_id)
    rows, cols, nodes, edges = [], [], [len(n_id)], []
    for fanout in fanouts:
        new = []
        count = 0
        for v in frontier:
            start, deg = int(rowptr[v]), int(rowptr[v + 1] - rowptr[v])
            take = min(fanout, deg) if fanout >= 0 else deg
            for p in sorted(torch.randperm(deg, generator=generator)[:take].tolist()):
                u = int(col[start + p])
                if u not in local:
                    local[u] = len(n_id)
                    n_id.append(u)
                    new.append(u)
                rows.append(local[u])
                cols.append(local[v])
                count += 1
        nodes.append(len(new))
        edges.append(count)
        frontier = new
    return SampledSubgraph(torch.tensor(n_id, dtype=torch.long),
                           torch.tensor([rows, cols], dtype=torch.long).view(2, -1), nodes, edges)


def neighbor_loader_sizes(edge_index: torch.Tensor, num_nodes: int, seeds: torch.Tensor,
                          fanouts: list[int]) -> tuple[list[int], list[int]]:
    """Per-hop sizes from PyG's own NeighborSampler (needs pyg-lib or torch-sparse)."""
    from torch_geometric.data import Data
    from torch_geometric.sampler import NeighborSampler, NodeSamplerInput

    sampler = NeighborSampler(Data(edge_index=edge_index, num_nodes=num_nodes), list(fanouts))
    out = sampler.sample_from_nodes(NodeSamplerInput(input_id=None, node=seeds))
    return [int(n) for n in out.num_sampled_nodes], [int(n) for n in out.num_sampled_edges]


def full_fanout_sample(seed: int) -> dict[str, Any]:
    """The one sample a fan-out of at least every degree allows, and its per-hop sizes."""
    edge_index = directed_graph(seed)
    rowptr, col = in_neighbour_csr(edge_index, 300)
    seeds = _seeds(seed, 16, 300)
    sub = sample_neighbors(rowptr, col, seeds, [12, 12], torch.Generator().manual_seed(0))
    nodes, edges = sub.num_sampled_nodes, sub.num_sampled_edges
    if pyg_lib_available():
        nodes, edges = neighbor_loader_sizes(edge_index, 300, seeds, [12, 12])
    return {"edge_index": edge_index, "seeds": seeds, "n_id": sub.n_id, "name": FULL,
            "num_sampled_nodes": nodes, "num_sampled_edges": edges}


def edge_samples(seed: int) -> dict[str, dict[str, Any]]:
    """The one-at-a-time sampler on each edge of EDGE_SAMPLES (each sample is fixed)."""
    rowptr, col = edge_graph()
    out = {}
    for label, (seeds, fanouts) in EDGE_SAMPLES.items():
        sub = sample_neighbors(rowptr, col, torch.tensor(seeds, dtype=torch.long), list(fanouts),
                               torch.Generator().manual_seed(seed + 41))
        out[label] = {"n_id": sub.n_id, "edge_index": sub.edge_index,
                      "num_sampled_nodes": list(sub.num_sampled_nodes),
                      "num_sampled_edges": list(sub.num_sampled_edges)}
    return out


def sage_on_full_graph(seed: int) -> dict[str, torch.Tensor]:
    """PyG's GraphSAGE on the whole graph, read at the loader's seeds."""
    edge_index, x, seeds, model = sage_inputs(seed)
    with torch.no_grad():
        return {"seeds": seeds, "out": model(x, edge_index)[seeds]}


# --------------------------------------------------------------------------- 11.2


def brute_force_plans(seed: int) -> dict[str, list[dict[str, list[torch.Tensor]]]]:
    """Every partition's plan for every rank, from the whole edge list and Python sets."""
    edge_index = plan_graph(seed)
    pairs = list(zip(edge_index[0].tolist(), edge_index[1].tolist()))
    out = {}
    for name, part in plan_partitions(seed).items():
        owner = part.tolist()
        need = [[set() for _ in range(PLAN_RANKS)] for _ in range(PLAN_RANKS)]  # [r][s]
        for u, v in pairs:
            if owner[u] != owner[v]:
                need[owner[v]][owner[u]].add(u)

        def ids(s: set) -> torch.Tensor:
            return torch.tensor(sorted(s), dtype=torch.long)

        out[name] = [{"recv": [ids(need[r][s]) for s in range(PLAN_RANKS)],
                      "send": [ids(need[s][r]) for s in range(PLAN_RANKS)]}
                     for r in range(PLAN_RANKS)]
    return out


# --------------------------------------------------------------------------- 11.3


def gcn_conv_on_full_graph(seed: int) -> dict[int, dict[str, Any]]:
    """PyG's GCNConv on the whole graph with the ranks' weights: each rank's rows of the output
    and of x's gradient, and the weight gradients."""
    from torch_geometric.nn import GCNConv

    out: dict[int, dict[str, Any]] = {}
    for world_size in CONV_PARTS:
        setup = conv_setup(seed, world_size)
        conv = GCNConv(CONV_IN, CONV_OUT).double()
        with torch.no_grad():
            conv.lin.weight.copy_(setup["weight"])
            conv.bias.copy_(setup["bias"])
        x = setup["x"].clone().requires_grad_(True)
        y = conv(x, setup["edge_index"])
        y.backward(setup["grad"])
        owns = [local_graph(setup["edge_index"], setup["part"], r).own for r in range(world_size)]
        out[world_size] = {"out": [y.detach()[o] for o in owns],
                           "x.grad": [x.grad[o] for o in owns],
                           "lin.weight.grad": conv.lin.weight.grad.clone(),
                           "bias.grad": conv.bias.grad.clone()}
    return out


# --------------------------------------------------------------------------- 11.4


def _fetch_scene(seed: int, scene: str, world_size: int) -> dict[str, Any]:
    """Each rank's rows, read off the whole matrix, and the fewest bytes it can send."""
    setup = fetch_setup(seed, scene, world_size)
    x, owner = setup["x"], setup["part"].tolist()
    lacks = [{i for i in ids.tolist() if owner[i] != r} - set(setup["cached"][r].tolist())
             for r, ids in enumerate(setup["needed"])]
    width = FETCH_DIM * x.element_size()
    out: dict[str, Any] = {"rows": [x[ids] for ids in setup["needed"]],
                           "needed": setup["needed"], "bytes": []}
    for r in range(world_size):
        rows = sum(owner[i] == r for s in range(world_size) for i in lacks[s])
        out["bytes"].append({"counts": world_size * 8, "asks": len(lacks[r]), "rows": rows,
                             "rows_bytes": rows * width,
                             "total": world_size * 8 + len(lacks[r]) * 8 + rows * width})
    return out


def rows_of_whole_matrix(seed: int) -> dict[str, dict[str, Any]]:
    return {scene: _fetch_scene(seed, scene, FETCH_RANKS) for scene in FETCH_SCENES}


def rows_of_whole_matrix_alone(seed: int) -> dict[str, dict[str, Any]]:
    return {"float32": _fetch_scene(seed, "float32", 1)}
