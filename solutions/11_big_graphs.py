# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # {{title}}
#
# Lesson 10 batched many small molecules. The other half of graph learning is *one* graph with
# millions of nodes: products bought together, papers citing papers, proteins interacting.
# Full-batch training of such a graph needs activations for every node in every layer at
# once, and the graph itself may not fit one machine. The two standard answers are
# **neighbour-sampled mini-batches** (GraphSAGE: replicate the graph, split the seed nodes over
# ranks, train with DDP) and, once the graph itself is too big, **partitions** (METIS) with a
# **halo** of remote neighbours exchanged every layer. You will build the pieces of both.
#
# **Prerequisites:** Lesson 03 (equal step counts on every rank), Lesson 04 (DDP), Lesson 10
# (PyG's `Data`, message passing). Lesson 01's `all_to_all` helps.
#
# **You will be able to:**
# - say why full-batch training of one big graph runs out of memory, and measure how fast a
#   k-hop neighbourhood grows with fan-out and hops;
# - write PyG `NeighborLoader`'s sampler yourself and run it inside PyG's own `NodeLoader`
#   ({{task 11.1}});
# - train GraphSAGE data-parallel on sampled mini-batches with DDP;
# - partition a graph with METIS, measure edge cut, balance and halo, and build the halo plan
#   each rank needs by asking the others ({{task 11.2}});
# - write one GCN layer that runs on a partitioned graph, exchanging only the halo with
#   `all_to_all_single`, equal to PyG's `GCNConv` on the whole graph ({{task 11.3}});
# - compare sampling with partitioning: bytes moved, memory held and epoch time per rank;
# - fetch a sampled batch's feature rows from the ranks that own them, each missing row once,
#   with a degree-ordered cache in front ({{task 11.4}}), and measure that this traffic, not
#   the gradient all-reduce, is what sampled training across machines sends.
#
# PyG's `NeighborLoader` needs `pyg-lib` or `torch-sparse`. `pyg-lib` has no release on PyPI
# (its wheels come from data.pyg.org, one per torch and CUDA build) and `torch-sparse` is only
# a source distribution there, which has to compile against your torch; this course installs
# neither. So you write the sampler, and PyG's `NodeLoader` runs it through a small
# `BaseSampler` adapter (`kit.lessons.graphs.FunctionSampler`). With `pyg-lib` installed,
# `neighbor_loader(...)` below *is* `NeighborLoader`: the same code and batches of the same
# form, but not the same draws: `pyg-lib`'s C++ sampler takes no `torch.Generator` (the
# adapter drops `generator=` there), so its batches cannot be replayed from one.
# `kit doctor` tells you which one you have.

# %% tags=["setup"]
import time

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.data import Data
from torch_geometric.loader import NodeLoader
from torch_geometric.nn import GCNConv, GraphSAGE
from torch_geometric.utils import k_hop_subgraph

from kit import check, launch, meter
from kit.lessons.graphs import (
    AMAZON_PRODUCTS,
    OGBN_PRODUCTS,
    FeatureCache,
    FunctionSampler,
    HaloPlan,
    LocalGraph,
    SampledSubgraph,
    amazon_products,
    in_neighbour_csr,
    local_graph,
    metis_partition,
    neighbor_loader,
    partition_stats,
    peptide_graph,
    power_law_graph,
    pyg_lib_available,
    random_partition,
)
from kit.trace import trace

# %% [markdown]
# ## 1. Why one big graph breaks full-batch training
#
# A GCN layer updates every node from its neighbours, so full-batch training keeps, for every
# layer, one `hidden`-wide row per node for the backward pass: about N · hidden · layers ·
# 4 bytes of activations, before the features themselves and the per-edge messages. Here are
# the two standard benchmarks (sizes from [PyG's `AmazonProducts`](https://pytorch-geometric.readthedocs.io/en/latest/generated/torch_geometric.datasets.AmazonProducts.html)
# page and [OGB's node property prediction](https://ogb.stanford.edu/docs/nodeprop/) page):

# %%
def full_batch_bytes(nodes, edges, features, hidden=256, layers=3):
    """Activations of a full-batch GCN in float32: node rows per layer, one message per edge."""
    return {"features": nodes * features * 4, "node activations": nodes * hidden * layers * 4,
            "edge messages (one layer)": edges * hidden * 4}


for name, d in (("AmazonProducts", AMAZON_PRODUCTS), ("ogbn-products", OGBN_PRODUCTS)):
    sizes = full_batch_bytes(d["nodes"], d["edges"], d["features"])
    print(f"{name:15s} {d['nodes']:>10,} nodes {d['edges']:>12,} edges: "
          + ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in sizes.items()))

# %% [markdown]
# Gigabytes of node activations and, on `AmazonProducts`, hundreds of GiB of per-edge messages,
# for one forward pass; backward keeps them all. The real loaders are in
# `kit.lessons.graphs` (`amazon_products(root)`, `ogbn_products(root)`), but nothing in this
# course downloads data, so they only read files you fetched yourself:

# %%
try:
    amazon_products("data/AmazonProducts")
except FileNotFoundError as e:
    print(str(e)[:240], "...")

# %% [markdown]
# We work on two graphs instead. A **real** one from shipped data: modlamp's 5,200 peptides
# (2,600 antimicrobial, 2,600 random UniProt fragments, the set of Lesson 09), each joined to
# its 8 most similar peptides by dipeptide profile. And a **generated** one with power-law
# degrees, like real networks, up to a million nodes: a few hubs with thousands of
# neighbours, most nodes with a handful.

# %%
peptides = peptide_graph()
big = power_law_graph(200_000, avg_degree=10)
for name, d in (("peptides", peptides), ("power law", big)):
    deg = torch.bincount(d.edge_index[1], minlength=d.num_nodes)
    print(f"{name:10s} {d.num_nodes:>7,} nodes {d.edge_index.shape[1]:>9,} edges, degree median "
          f"{deg.median().item()}, max {deg.max().item():,}")
same = (peptides.y[peptides.edge_index[0]] == peptides.y[peptides.edge_index[1]]).float().mean()
print(f"peptide edges joining two peptides of the same class: {same:.0%}")

# %% [markdown]
# Mini-batches are the usual way out: take a few hundred **seed** nodes and only the nodes
# their L layers can see. But an L-layer GNN on a seed needs its whole L-hop neighbourhood, and
# on a power-law graph that is most of the graph after two or three hops:

# %%
seeds = torch.randperm(big.num_nodes, generator=torch.Generator().manual_seed(0))[:256]
for hops in (1, 2, 3):
    subset, *_ = k_hop_subgraph(seeds, hops, big.edge_index, num_nodes=big.num_nodes)
    print(f"{hops} hop(s) from 256 seeds: {subset.numel():>7,} nodes "
          f"({subset.numel() / big.num_nodes:.0%} of the graph)")

# %% [markdown]
# ## 2. Mini-batches by neighbour sampling
#
# GraphSAGE (Hamilton et al., 2017) caps the explosion: at hop h, each node keeps at most
# `fanouts[h]` of its neighbours, drawn at random. PyG's
# [`NeighborLoader`](https://pytorch-geometric.readthedocs.io/en/latest/modules/loader.html#torch_geometric.loader.NeighborLoader)
# does it with these conventions, which your sampler must keep:
#
# - the graph is read as **in-neighbours** in CSR form: node v's neighbours are
#   `col[rowptr[v]:rowptr[v + 1]]` (PyG calls it CSC: `colptr`, `row`), because messages flow
#   from a neighbour *into* v;
# - at hop h every node of the frontier draws min(`fanouts[h]`, degree) **distinct**
#   neighbours (`replace=False`); the frontier of hop 0 is the seeds, the frontier of hop
#   h + 1 the nodes first seen at hop h; a node seen before is not expanded again;
# - `n_id` holds the seeds first (so `out[:batch_size]` are the seeds' outputs), then new
#   nodes in the order they are first drawn; `edge_index` is `(neighbour, node)` in **local**
#   ids, positions in `n_id`, so the batch's features are `x[n_id]`;
# - `num_sampled_nodes` counts the seeds and then the new nodes of each hop,
#   `num_sampled_edges` the edges of each hop (PyG's
#   [`trim_to_layer`](https://pytorch-geometric.readthedocs.io/en/latest/advanced/hgam.html)
#   uses them to skip work in deeper layers).
#
# A tiny example: seed 0, fan-out 2, then 1.

# %%
toy = torch.tensor([[1, 2, 3, 4, 4, 5, 0],   # sources (neighbours)
                    [0, 0, 0, 1, 2, 3, 4]])  # targets: 0 <- 1, 2, 3; 1 <- 4; 2 <- 4; 3 <- 5; 4 <- 0
rowptr, col = in_neighbour_csr(toy, 6)
print("rowptr", rowptr.tolist(), "col", col.tolist())
print("in-neighbours of 0:", col[rowptr[0]:rowptr[1]].tolist())


# %% [markdown]
# ### Task 11.1: `sample_neighbors`
#
# Write `sample_neighbors(rowptr, col, seeds, fanouts, generator)` with the semantics above,
# returning a `SampledSubgraph(n_id, edge_index, num_sampled_nodes, num_sampled_edges)`.
# Take every random number from `generator` (`torch.rand(..., generator=generator)`), so a
# batch can be replayed. Frontier nodes are visited in `n_id` order and each node's draws in
# the order its neighbours appear in `col`: that last rule is this course's, so that a sample
# can be checked exactly (PyG keeps `col` order when every neighbour is taken; with fewer,
# `pyg-lib` may list a node's draws in the order it drew them). A loop over nodes with
# `torch.randperm` is a correct start; the solution draws for the whole frontier at once.

# %% tags=["task-11.1"]
def sample_neighbors(rowptr: torch.Tensor, col: torch.Tensor, seeds: torch.Tensor,
                     fanouts: list[int], generator: torch.Generator) -> SampledSubgraph:
    """Sample a NeighborLoader mini-batch (replace=False) around ``seeds``.

    Args:
        rowptr, col: in-neighbour CSR; node v's neighbours are col[rowptr[v]:rowptr[v + 1]].
        seeds: (B,) distinct global ids of the seed nodes.
        fanouts: neighbours to draw per node at each hop (len = number of hops).
        generator: the only source of random numbers.

    Returns:
        SampledSubgraph: n_id (seeds first, then new nodes in draw order), edge_index (2, E)
        of (neighbour, node) in local ids, num_sampled_nodes (hops + 1), num_sampled_edges (hops).
        A node without in-neighbours, an empty frontier (or no seeds) and a fan-out of 0 draw
        nothing: that hop still counts, with 0 new nodes and 0 edges.
    """
    ### BEGIN SOLUTION
    num_nodes = rowptr.numel() - 1
    local = torch.full((num_nodes,), -1, dtype=torch.long)  # global id -> local id; -1 unseen
    n_id = seeds.to(torch.long)
    local[n_id] = torch.arange(n_id.numel())
    frontier = torch.arange(n_id.numel())  # local ids of the nodes this hop expands
    rows, cols = [], []
    num_sampled_nodes, num_sampled_edges = [n_id.numel()], []
    for fanout in fanouts:
        start = rowptr[n_id[frontier]]
        deg = rowptr[n_id[frontier] + 1] - start
        take = deg.clamp(max=fanout)
        # Floyd's algorithm for the whole frontier at once: step j draws t uniformly in
        # [0, deg - take + j] and keeps it, or that upper end if t is already kept. Each
        # node ends with a uniformly random set of `take` distinct positions.
        most = int(take.max()) if take.numel() else 0
        picked = torch.full((frontier.numel(), most), -1, dtype=torch.long)  # (n, most)
        for j in range(most):
            upper = deg - take + j
            t = (torch.rand(frontier.numel(), generator=generator, dtype=torch.float64)
                 * (upper + 1)).long().clamp(max=upper)
            t = torch.where((picked == t[:, None]).any(1), upper, t)
            picked[:, j] = torch.where(j < take, t, -1)
        picked = picked.masked_fill(picked < 0, torch.iinfo(torch.long).max).sort(dim=1).values
        keep = torch.arange(most) < take[:, None]  # (n, most): each node's draws, in col order
        owner = torch.arange(frontier.numel())[:, None].expand_as(picked)[keep]
        nbr = col[start[owner] + picked[keep]]  # (E_h,) global ids, in draw order
        # nodes never seen before, in the order they were first drawn
        fresh = nbr[local[nbr] < 0]
        uniq, inverse = torch.unique(fresh, return_inverse=True)
        first = torch.full((uniq.numel(),), fresh.numel(), dtype=torch.long)
        first.scatter_reduce_(0, inverse, torch.arange(fresh.numel()), "amin")
        new = uniq[torch.argsort(first)]
        local[new] = torch.arange(n_id.numel(), n_id.numel() + new.numel())
        rows.append(local[nbr])
        cols.append(frontier[owner])
        n_id = torch.cat([n_id, new])
        frontier = local[new]
        num_sampled_nodes.append(new.numel())
        num_sampled_edges.append(nbr.numel())
    edge_index = torch.stack([torch.cat(rows), torch.cat(cols)]) if rows else \
        torch.empty(2, 0, dtype=torch.long)
    return SampledSubgraph(n_id, edge_index, num_sampled_nodes, num_sampled_edges)
    ### END SOLUTION


# %% tags=["check-11.1"]
check("11.1", sample_neighbors)

# %% [markdown]
# On the toy graph: seed 0 draws 2 of its neighbours 1, 2, 3; each of those draws 1.

# %%
sub = sample_neighbors(rowptr, col, torch.tensor([0]), [2, 1], torch.Generator().manual_seed(1))
print(sub)
print("edges in global ids:", sub.n_id[sub.edge_index].tolist())

# %% [markdown]
# Now PyG's own loader runs it. `neighbor_loader` is `NeighborLoader` when `pyg-lib` is
# installed, else `NodeLoader(data, node_sampler=FunctionSampler(sample_neighbors, ...))`:
# either way you get PyG `Data` batches whose first `batch_size` nodes are the seeds, and PyG's
# `GraphSAGE` runs on them as on any graph.

# %%
loader = neighbor_loader(peptides, [10, 5], sample=sample_neighbors, batch_size=128,
                         shuffle=True, generator=torch.Generator().manual_seed(0))
batch = next(iter(loader))
print(type(loader).__name__, "| pyg-lib:", pyg_lib_available())
print(batch)
sage = GraphSAGE(peptides.num_features, 64, num_layers=2, out_channels=2)
print("GraphSAGE output on the seeds:",
      tuple(sage(batch.x, batch.edge_index)[:batch.batch_size].shape))

# %% [markdown]
# How much does sampling save? Nodes touched by one batch of 256 seeds on the power-law
# graph, for fan-outs 5, 10 and 25 per hop, against the full k-hop neighbourhood:

# %%
big_rowptr, big_col = in_neighbour_csr(big.edge_index, big.num_nodes)
touched = {}
for fanout in (5, 10, 25):
    touched[fanout] = [sample_neighbors(big_rowptr, big_col, seeds, [fanout] * hops,
                                        torch.Generator().manual_seed(0)).n_id.numel()
                       for hops in (1, 2, 3)]
full = [k_hop_subgraph(seeds, hops, big.edge_index, num_nodes=big.num_nodes)[0].numel()
        for hops in (1, 2, 3)]
fig, ax = plt.subplots(figsize=(6, 3.2))
for fanout, counts in touched.items():
    ax.plot([1, 2, 3], counts, marker="o", label=f"fan-out {fanout}")
ax.plot([1, 2, 3], full, marker="s", color="black", label="every neighbour")
ax.set_yscale("log")
ax.set_xticks([1, 2, 3])
ax.set_xlabel("hops (layers)")
ax.set_ylabel("nodes touched")
ax.set_title(f"256 seeds on a {big.num_nodes:,}-node power-law graph")
ax.legend(fontsize="small")
plt.show()
print({f: c for f, c in touched.items()}, "full:", full)

# %% [markdown]
# Fan-out f over L hops touches at most B · (1 + f + ... + f^L) nodes, however big the
# graph; the full neighbourhood reaches most of it. The price: each batch's estimate of the
# aggregation is noisy, and hubs are seen far more often than their share.
#
# ## 3. Data-parallel training on sampled mini-batches
#
# With sampling, each batch is small, so the standard distributed recipe is **data
# parallelism**: every rank holds the whole graph (here a few MB; for `AmazonProducts` 1.2 GiB
# of features and 4 GiB of int64 edge indices, in host memory), takes its share of
# the training seeds, samples its own batches and trains a DDP replica. As in Lesson 03, every
# rank must take the **same number of steps**, or DDP's all-reduces fall out of step: each
# epoch all ranks draw the same permutation of the seeds, pad it to a multiple of
# `world_size · batch_size`, and rank r takes every `world_size`-th batch.

# %%
def train_sampled(epochs=4, batch_size=64, fanouts=(10, 5), hidden=64):
    """Each rank: GraphSAGE under DDP on its share of the peptide training seeds."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = peptide_graph()
    split = torch.randperm(data.num_nodes, generator=torch.Generator().manual_seed(0))
    train, test = split[:3600], split[3600:]
    torch.manual_seed(0)  # the same initial weights everywhere (DDP broadcasts rank 0's anyway)
    model = DDP(GraphSAGE(data.num_features, hidden, num_layers=2, out_channels=2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    history, seeds_seen, busy = [], 0, 0.0
    for epoch in range(epochs):
        order = train[torch.randperm(train.numel(), generator=torch.Generator().manual_seed(epoch))]
        per_step = world_size * batch_size
        steps = -(-order.numel() // per_step)
        order = torch.cat([order, order[: steps * per_step - order.numel()]])  # pad: equal steps
        mine = order.view(steps, world_size, batch_size)[:, rank]  # (steps, batch_size)
        loader = neighbor_loader(data, list(fanouts), sample=sample_neighbors,
                                 input_nodes=mine.flatten(), batch_size=batch_size,
                                 generator=torch.Generator().manual_seed(rank))
        start = time.perf_counter()
        for batch in loader:
            optimizer.zero_grad()
            out = model(batch.x, batch.edge_index)[:batch.batch_size]
            F.cross_entropy(out, batch.y[:batch.batch_size]).backward()
            optimizer.step()
            seeds_seen += batch.batch_size
        busy += time.perf_counter() - start
        with torch.no_grad():  # evaluate on the whole (small) graph
            pred = model.module(data.x, data.edge_index).argmax(1)
        history.append((pred[test] == data.y[test]).float().mean().item())
    return {"accuracy": history, "seeds per second": seeds_seen / busy, "steps": steps}


sampled = {ws: launch(train_sampled, world_size=ws) for ws in (1, 2, 4)}
for ws, runs in sampled.items():
    print(f"{ws} rank(s): {runs[0]['steps']} steps per epoch on every rank "
          f"({sorted({r['steps'] for r in runs})}), test accuracy by epoch "
          f"{[round(a, 3) for a in runs[0]['accuracy']]}, "
          f"{sum(r['seeds per second'] for r in runs):,.0f} seeds/s in all")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3))
for ws, runs in sampled.items():
    ax1.plot(range(1, len(runs[0]["accuracy"]) + 1), runs[0]["accuracy"], marker="o",
             label=f"{ws} rank(s)")
ax1.set_xlabel("epoch")
ax1.set_ylabel("test accuracy")
ax1.set_title("AMP or not, GraphSAGE on sampled batches")
ax1.legend(fontsize="small")
ax2.bar([str(ws) for ws in sampled],
        [sum(r["seeds per second"] for r in runs) for runs in sampled.values()])
ax2.set_xlabel("ranks")
ax2.set_ylabel("training seeds / s (all ranks)")
ax2.set_title("throughput (2 CPU cores shared)")
plt.tight_layout()
plt.show()

# %% [markdown]
# Every rank takes the same number of steps, and one epoch on W ranks is 1/W of the steps on
# each, each step with the same batch size: the global batch is W times larger, so the
# accuracy per epoch is what one rank reaches with W-times larger batches. On this laptop the
# ranks share two cores, so throughput cannot grow much; on W GPUs it grows nearly W-fold
# until sampling on the CPU becomes the bottleneck (PyG's `num_workers` runs it in DataLoader
# workers, Lesson 03).
#
# ## 4. Partitioning the graph
#
# Replication stops working when the graph does not fit one machine, or when the sampled
# neighbourhoods of deep models are themselves too big. Then each rank owns a **part** of the
# nodes, their features and the edges into them, and fetches the features of remote
# neighbours, its **halo**, when it needs them. How good a partition is decides how much
# travels:
#
# - the **edge cut**: the fraction of edges whose ends lie on different ranks;
# - the **balance**: the largest part over the mean part (the slowest rank sets the pace);
# - the **halo**: the distinct remote neighbours a rank needs, rows that cross the network
#   every layer.
#
# [METIS](https://github.com/KarypisLab/METIS) (Karypis & Kumar, 1998) minimises the edge cut
# under a balance constraint; `pymetis` wraps it. Against a random partition:

# %%
stats = {}
for name, d in (("peptides", peptides), ("power law", big)):
    for parts in (2, 4, 8):
        for method in ("random", "METIS"):
            start = time.perf_counter()
            part = (random_partition(d.num_nodes, parts) if method == "random"
                    else metis_partition(d.edge_index, d.num_nodes, parts))
            s = partition_stats(d.edge_index, part, parts)
            s["seconds"] = time.perf_counter() - start
            stats[name, parts, method] = s
            halo_share = sum(s["halo"]) / parts / (d.num_nodes / parts)
            print(f"{name:9s} {parts} parts {method:6s}: edge cut {s['edge_cut']:6.1%}, balance "
                  f"{s['balance']:.3f}, halo per rank {halo_share:5.0%} "
                  f"of its own nodes ({s['seconds']:.2f} s)")
for name in ("peptides", "power law"):
    print(f"{name}: METIS cuts " + ", ".join(
        f"{stats[name, p, 'random']['edge_cut'] / stats[name, p, 'METIS']['edge_cut']:.1f}x"
        for p in (2, 4, 8)) + " fewer edges than a random split (2, 4, 8 parts)")

# %%
fig, axes = plt.subplots(1, 2, figsize=(9, 3))
for ax, name, d in zip(axes, ("peptides", "power law"), (peptides, big)):
    for i, method in enumerate(("random", "METIS")):
        halo_mib = [sum(stats[name, p, method]["halo"]) * 256 * 4 / 2**20 for p in (2, 4, 8)]
        ax.bar([x + 0.4 * i for x in range(3)], halo_mib, width=0.4, label=method)
    ax.set_xticks([x + 0.2 for x in range(3)], ["2", "4", "8"])
    ax.set_xlabel("parts")
    ax.set_ylabel("halo MiB per layer (hidden 256, fp32)")
    ax.set_title(f"{name}: {d.num_nodes:,} nodes")
    ax.legend(fontsize="small")
plt.tight_layout()
plt.show()

# %% [markdown]
# On both graphs METIS cuts several times fewer edges than a random split (the ratios
# above): both have communities (similar peptides; the planted classes), and METIS finds
# them. The halo shrinks
# less than the cut: a hub's thousands of neighbours lie on every rank whatever the
# partition, so it is in every rank's halo. And the halo of a random partition grows towards
# every other node as the number of parts grows: each rank needs most of the graph.
#
# What rank r holds is a `LocalGraph`: `own`, the sorted global ids of its nodes, and
# `edge_index`, every edge whose **target** it owns (so each of its nodes sees all its
# in-neighbours, some of them remote). `local_graph(edge_index, part, rank)` cuts it out:

# %%
part4 = metis_partition(peptides.edge_index, peptides.num_nodes, 4)
for r in range(4):
    lg = local_graph(peptides.edge_index, part4, r)
    remote = lg.edge_index[0][part4[lg.edge_index[0]] != r].unique()
    print(f"rank {r}: {lg.own.numel():,} own nodes, {lg.edge_index.shape[1]:,} edges into them, "
          f"halo {remote.numel():,} nodes")


# %% [markdown]
# ### Task 11.2: `halo_plan`
#
# Before the first layer each rank must know which rows it **receives** from each other rank
# (the remote sources of its edges) and which of its own rows it **sends** (what the others'
# edges need). The first is local knowledge. The second is not: no rank sees the others'
# edges, so a rank learns what to send by **asking**. Each rank tells every rank how many ids
# it wants (one `all_to_all_single` of counts), then which (one `all_to_all_single` of ids,
# with uneven splits). See
# [`all_to_all_single`](https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_to_all_single):
# `output_split_sizes[s]` rows arrive from rank s, `input_split_sizes[s]` rows go to it.
#
# Write `halo_plan(part, edge_index, rank)` returning `HaloPlan(recv, send)`, each a list of
# one int64 tensor of global ids per rank, sorted ascending, empty for the rank itself. The
# checks compare it with a plan read off the whole graph and count your collectives.

# %% tags=["task-11.2"]
def halo_plan(part: torch.Tensor, edge_index: torch.Tensor, rank: int) -> HaloPlan:
    """Build this rank's halo plan by asking the other ranks.

    Args:
        part: (N,) the owning rank of every node (the same on every rank).
        edge_index: (2, E) this rank's edges (targets it owns), global ids, row 0 the sources.
        rank: this rank.

    Returns:
        HaloPlan: recv[s], the ids this rank needs from rank s; send[s], the ids rank s needs
        from this rank; each sorted ascending, empty for s == rank.
    """
    ### BEGIN SOLUTION
    world_size = dist.get_world_size()
    src = edge_index[0]
    remote = torch.unique(src[part[src] != rank])  # sorted and distinct
    remote = remote[torch.argsort(part[remote], stable=True)]  # grouped by owner, still sorted
    asking = torch.bincount(part[remote], minlength=world_size)  # ids I want from each rank
    asked = torch.empty_like(asking)
    dist.all_to_all_single(asked, asking)  # ids each rank wants from me
    wanted = torch.empty(int(asked.sum()), dtype=torch.long)
    dist.all_to_all_single(wanted, remote, output_split_sizes=asked.tolist(),
                           input_split_sizes=asking.tolist())
    return HaloPlan(list(remote.split(asking.tolist())), list(wanted.split(asked.tolist())))
    ### END SOLUTION


# %% tags=["check-11.2"]
check("11.2", halo_plan)

# %% [markdown]
# The plans of the METIS partition above, on 4 ranks: rows to receive and to send, per peer.

# %%
def show_plan(part):
    rank = dist.get_rank()
    lg = local_graph(peptide_graph().edge_index, part, rank)
    plan = halo_plan(part, lg.edge_index, rank)
    return [len(t) for t in plan.recv], [len(t) for t in plan.send]


for r, (recv, send) in enumerate(launch(show_plan, part4, world_size=4)):
    print(f"rank {r}: receives {recv}, sends {send}")

# %% [markdown]
# ## 5. Partition-parallel full-graph GCN
#
# A GCN layer ([Kipf & Welling, 2017](https://arxiv.org/abs/1609.02907);
# [PyG's `GCNConv`](https://pytorch-geometric.readthedocs.io/en/latest/generated/torch_geometric.nn.conv.GCNConv.html))
# computes, with self-loops added and $\hat d_i$ the degree of node i counting its self-loop,
#
# $$x'_i = b + \sum_{j \in \mathcal{N}(i) \cup \{i\}}
# \frac{1}{\sqrt{\hat d_j \hat d_i}} \, W x_j .$$
#
# `GCNConv` applies the linear map first and propagates `W x_j`, so on a partitioned graph
# each rank transforms its own rows, sends the transformed rows the others asked for, and
# aggregates locally. Two things need care:
#
# - **degrees.** The degree of an own node is its in-edges here plus one (every edge into an
#   own node is local). The degree of a *halo* node is known only to its owner, so it must
#   travel: once, cached, or as one extra column of the feature exchange;
# - **gradients.** The rows a rank received feed its loss, but their gradient belongs to their
#   owner. The exchange must be in the autograd graph: its backward is the **mirror**
#   exchange, the same `all_to_all_single` with the split sizes swapped, carrying the
#   gradients home, where autograd adds them to the local ones.
#
# The bytes per layer are the halo rows times the width, not N: that is the saving over an
# all-gather of the feature matrix.


# %% [markdown]
# ### Task 11.3: `HaloGCNConv`
#
# Write `HaloExchange`, an autograd function around `dist.all_to_all_single` (forward: send
# `rows` in blocks of `send_sizes`, receive blocks of `recv_sizes`; backward: the mirror), and
# `HaloGCNConv(in_channels, out_channels)`, holding `lin` (`nn.Linear(in_channels,
# out_channels, bias=False)`) and `bias` as `GCNConv` does, so weights copy between the two.
# `forward(x_local, plan, local_graph)` takes this rank's rows in the order of
# `local_graph.own` and returns `(len(own), out_channels)`: `GCNConv`'s output for those nodes
# on the whole (undirected, self-loop-free) graph. The checks compare with `GCNConv` in
# float64, watch the exchanges (only `all_to_all_single`, at most the sent rows ×
# (out_channels + 1) × 8 bytes) and measure the bytes each rank holds per local row.

# %% tags=["task-11.3"]
class HaloExchange(torch.autograd.Function):
    """Exchange rows with all_to_all_single: blocks of send_sizes out, recv_sizes in."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, recv_sizes: list[int],
                send_sizes: list[int]) -> torch.Tensor:
        ### BEGIN SOLUTION
        ctx.sizes = (recv_sizes, send_sizes)
        out = rows.new_empty(sum(recv_sizes), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv_sizes,
                               input_split_sizes=send_sizes)
        return out
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ### BEGIN SOLUTION
        recv_sizes, send_sizes = ctx.sizes
        home = grad.new_empty(sum(send_sizes), *grad.shape[1:])
        dist.all_to_all_single(home, grad.contiguous(), output_split_sizes=send_sizes,
                               input_split_sizes=recv_sizes)  # the mirror: gradients go home
        return home, None, None
        ### END SOLUTION


class HaloGCNConv(nn.Module):
    """GCNConv on a partitioned graph: own rows in, own rows out, the halo exchanged."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.lin = nn.Linear(in_channels, out_channels, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_channels))

    def forward(self, x_local: torch.Tensor, plan: HaloPlan,
                local_graph: LocalGraph) -> torch.Tensor:
        """One GCN layer (self-loops, symmetric normalisation) for this rank's nodes.

        Args:
            x_local: (len(own), in_channels) features of own nodes, in the order of own.
            plan: this rank's HaloPlan.
            local_graph: LocalGraph(own, edge_index), edges into own nodes, global ids.

        Returns:
            (len(own), out_channels).
        """
        ### BEGIN SOLUTION
        own, edge_index = local_graph
        src, dst = edge_index
        n_own = own.numel()
        dst_row = torch.searchsorted(own, dst)
        loops = torch.arange(n_own)
        deg = torch.bincount(dst_row, minlength=n_own).to(x_local.dtype) + 1  # + the self-loop
        dinv = deg.rsqrt()
        h = self.lin(x_local)  # (n_own, out): transform first, as GCNConv does
        send_rows = torch.searchsorted(own, torch.cat(plan.send))
        payload = torch.cat([h[send_rows], dinv[send_rows, None]], dim=1)  # (S, out + 1)
        received = HaloExchange.apply(payload, [len(t) for t in plan.recv],
                                      [len(t) for t in plan.send])  # (R, out + 1)
        table = torch.cat([h, received[:, :-1]])  # own rows, then halo rows
        dinv_all = torch.cat([dinv, received[:, -1].detach()])
        ids = torch.cat([own, *plan.recv])  # the global id of each table row
        order = torch.argsort(ids)
        src_row = order[torch.searchsorted(ids[order], src)]
        rows_src, rows_dst = torch.cat([src_row, loops]), torch.cat([dst_row, loops])
        norm = dinv_all[rows_src] * dinv[rows_dst]
        out = h.new_zeros(n_own, h.shape[1]).index_add(0, rows_dst, table[rows_src] * norm[:, None])
        return out + self.bias
        ### END SOLUTION


# %% tags=["check-11.3"]
check("11.3", HaloGCNConv)

# %% [markdown]
# On the peptide graph, 4 ranks, METIS parts: the same output as `GCNConv` on the whole graph.

# %%
def halo_vs_gcnconv(part):
    rank = dist.get_rank()
    data = peptide_graph()
    lg = local_graph(data.edge_index, part, rank)
    plan = halo_plan(part, lg.edge_index, rank)
    torch.manual_seed(0)
    ref = GCNConv(data.num_features, 16)
    conv = HaloGCNConv(data.num_features, 16)
    conv.load_state_dict(ref.state_dict())  # lin.weight and bias, the same names
    with torch.no_grad():
        diff = conv(data.x[lg.own], plan, lg) - ref(data.x, data.edge_index)[lg.own]
        return diff.abs().max().item()


print("max |HaloGCNConv - GCNConv| per rank:", launch(halo_vs_gcnconv, part4, world_size=4))

# %% [markdown]
# ## 6. Partitions against sampling: bytes, memory and time per rank
#
# Now a whole epoch both ways on the peptide graph, on 1, 2 and 4 ranks. Partition-parallel:
# a 2-layer GCN on the full graph, each rank its METIS part, the weight gradients summed over
# ranks by hand (not DDP's job: DDP averages, and a loss split over parts needs the sum, since
# each rank's loss is its own nodes' share of one loss over the whole graph). Sampled: the
# GraphSAGE of section 3. For each, the recorder counts the bytes a rank sends, the meter the
# peak bytes it allocates, and a clock the epoch time.

# %%
class HaloGCN(nn.Module):
    def __init__(self, in_channels, hidden, classes):
        super().__init__()
        self.conv1, self.conv2 = HaloGCNConv(in_channels, hidden), HaloGCNConv(hidden, classes)

    def forward(self, x, plan, lg):
        return self.conv2(F.relu(self.conv1(x, plan, lg)), plan, lg)


def epoch_partitioned(epochs=3, hidden=64):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = peptide_graph()
    part = metis_partition(data.edge_index, data.num_nodes, world_size)
    lg = local_graph(data.edge_index, part, rank)
    plan = halo_plan(part, lg.edge_index, rank)
    train = torch.zeros(data.num_nodes, dtype=torch.bool)
    train[torch.randperm(data.num_nodes, generator=torch.Generator().manual_seed(0))[:3600]] = True
    mine = train[lg.own]
    x, y = data.x[lg.own], data.y[lg.own]
    torch.manual_seed(0)
    model = HaloGCN(data.num_features, hidden, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(epochs):
        start = time.perf_counter()
        with meter.track() as usage, trace() as t:
            optimizer.zero_grad()
            out = model(x, plan, lg)
            # the mean over all training nodes of the graph: local sum / global count
            loss = F.cross_entropy(out[mine], y[mine], reduction="sum") / int(train.sum())
            loss.backward()
        for p in model.parameters():  # sum of the ranks' gradients (not the mean)
            dist.all_reduce(p.grad)
        optimizer.step()
        seconds = time.perf_counter() - start
    sent = sum(e.nbytes for e in t.events if e.op == "all_to_all_single")
    return {"bytes sent": sent, "peak bytes": usage.peak, "seconds": seconds,
            "own": lg.own.numel(), "halo": sum(len(r) for r in plan.recv)}


def epoch_sampled(batch_size=64, fanouts=(10, 5), hidden=64):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = peptide_graph()
    train = torch.randperm(data.num_nodes, generator=torch.Generator().manual_seed(0))[:3600]
    torch.manual_seed(0)
    model = DDP(GraphSAGE(data.num_features, hidden, num_layers=2, out_channels=2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    per_step = world_size * batch_size
    steps = -(-train.numel() // per_step)
    order = torch.cat([train, train[: steps * per_step - train.numel()]])
    mine = order.view(steps, world_size, batch_size)[:, rank].flatten()
    loader = neighbor_loader(data, list(fanouts), sample=sample_neighbors, input_nodes=mine,
                             batch_size=batch_size, generator=torch.Generator().manual_seed(rank))
    start = time.perf_counter()
    with meter.track() as usage, trace() as t:
        for batch in loader:
            optimizer.zero_grad()
            out = model(batch.x, batch.edge_index)[:batch.batch_size]
            F.cross_entropy(out, batch.y[:batch.batch_size]).backward()
            optimizer.step()
    seconds = time.perf_counter() - start
    return {"bytes sent": sum(e.nbytes for e in t.events), "peak bytes": usage.peak,
            "seconds": seconds, "steps": steps}


compared = {}
for ws in (1, 2, 4):
    compared["partitioned", ws] = launch(epoch_partitioned, world_size=ws)
    compared["sampled", ws] = launch(epoch_sampled, world_size=ws)
for (how, ws), runs in compared.items():
    print(f"{how:11s} {ws} rank(s): sent {max(r['bytes sent'] for r in runs) / 2**20:6.2f} MiB, "
          f"peak {max(r['peak bytes'] for r in runs) / 2**20:6.1f} MiB, "
          f"epoch {max(r['seconds'] for r in runs):5.2f} s (the slowest rank)")

# %%
fig, axes = plt.subplots(1, 3, figsize=(11, 3))
for ax, key, unit, scale in zip(axes, ("bytes sent", "peak bytes", "seconds"),
                                ("MiB sent per rank", "peak MiB per rank", "epoch seconds"),
                                (2**20, 2**20, 1)):
    for i, how in enumerate(("partitioned", "sampled")):
        ax.bar([x + 0.4 * i for x in range(3)],
               [max(r[key] for r in compared[how, ws]) / scale for ws in (1, 2, 4)],
               width=0.4, label=how)
    ax.set_xticks([x + 0.2 for x in range(3)], ["1", "2", "4"])
    ax.set_xlabel("ranks")
    ax.set_title(unit)
axes[0].legend(fontsize="small")
plt.tight_layout()
plt.show()

# %% [markdown]
# What the bars say, on this graph:
#
# - **bytes.** The partitioned GCN sends halo rows, twice per layer (forward, and the mirror in
#   backward), so its traffic follows the halo: zero on one rank, growing with the cut. The
#   sampled model sends only DDP's gradient all-reduces, the model's size per step, many
#   steps per epoch (DDP all-reduces even on one rank; its share of steps halves with each
#   doubling of ranks).
# - **memory.** A partition holds its own rows, its halo and its edges: it shrinks as ranks
#   are added. A sampled batch is bounded by fan-out, whatever the graph, but every rank keeps
#   the whole graph (not counted here: it was allocated before the meter started).
# - **time.** One full-graph step per epoch against many small steps. Full-graph training
#   takes fewer, larger steps; sampling more, noisier ones. Which converges faster per second
#   depends on the graph and the hardware, which is why both are used.


# %% [markdown]
# ## 7. Sampled training across machines: fetching features
#
# Sections 3 and 6 kept the whole graph on every rank. At `AmazonProducts`' scale the
# features (1.2 GiB there, tens of GiB for the bigger benchmarks) are what stops fitting, so
# they are **partitioned with the graph**: rank r keeps the rows of its METIS part, and the
# sampler still reads the (replicated, or itself partitioned) structure. A sampled batch's
# `n_id` spans every part, so before each step a rank fetches the rows it lacks from their
# owners. It is the halo pattern of Tasks 11.2 and 11.3 in one call: one `all_to_all_single`
# of counts, one of the ids asked for, and one of the rows going back, with uneven splits.
#
# Those rows are the traffic that matters. DDP all-reduces the model once per step, a few
# hundred KB for a GraphSAGE; a batch touches thousands of nodes, each a feature row. On a
# power-law graph most touched nodes are the same few hubs, so a **static cache** of the
# highest-degree remote rows, filled once before training (PaGraph, Lin et al. 2020; GNNLab,
# Yang et al. 2022), serves many of them locally: `FeatureCache(ids, rows)` in
# `kit.lessons.graphs`.

# %% [markdown]
# ### Task 11.4: `fetch_features`
#
# Write `fetch_features(needed, part, x_local, cache=None)`: the feature rows of the global ids
# `needed`, in the order asked (repeats allowed), equal to `x[needed]` of the whole matrix.
# Every rank calls it at once, each with its own `needed`; a rank may ask for nothing and may
# own nothing. Fetch each distinct row once, and only the rows neither owned nor cached: the
# checks hold the bytes each rank sends, as the recorder sees them, to exactly that (a count
# per rank, the int64 ids it asks for, the rows asked of it), and want at least those rows to
# leave it. On one rank nothing is fetched, so make no collective call there. Keep the rows in
# `x_local`'s dtype (bf16 included): they are copied, never computed.

# %% tags=["task-11.4"]
def fetch_features(needed: torch.Tensor, part: torch.Tensor, x_local: torch.Tensor,
                   cache: FeatureCache | None = None) -> torch.Tensor:
    """Return x[needed] (len(needed), F) of the partitioned feature matrix x; collective.

    Args:
        needed: (B,) int64 global ids, in any order, repeats allowed; B may be 0.
        part: (N,) the owning rank of every node (the same on every rank).
        x_local: (n_own, F) this rank's rows: row i is node i of the sorted ids with
            part == rank (LocalGraph.own's order); n_own may be 0.
        cache: remote rows this rank keeps (FeatureCache(ids, rows)), served without asking.

    Returns:
        (B, F) in x_local's dtype, row i the features of needed[i]. Each distinct id that is
        neither owned nor cached is asked of its owner once: one all_to_all_single of counts,
        one of ids, one of rows; on a world of one rank, no collective at all.
    """
    ### BEGIN SOLUTION
    rank, world_size = dist.get_rank(), dist.get_world_size()
    own = (part == rank).nonzero().flatten()  # sorted: x_local's row order
    ids, inverse = torch.unique(needed.long(), return_inverse=True)  # each distinct id once
    rows = x_local.new_empty(ids.numel(), x_local.shape[1])  # (U, F), row u for ids[u]
    local = part[ids] == rank
    rows[local] = x_local[torch.searchsorted(own, ids[local])]
    missing = ~local
    if cache is not None and cache.ids.numel():
        at = torch.searchsorted(cache.ids, ids).clamp(max=cache.ids.numel() - 1)
        hit = missing & (cache.ids[at] == ids)
        rows[hit] = cache.rows[at[hit]].to(rows.dtype)
        missing &= ~hit
    if world_size == 1:  # every row is local: nothing to ask
        return rows[inverse]
    where = missing.nonzero().flatten()
    where = where[torch.argsort(part[ids[where]], stable=True)]  # grouped by owner
    asking = torch.bincount(part[ids[where]], minlength=world_size)  # rows I want from each
    asked = torch.empty_like(asking)
    dist.all_to_all_single(asked, asking)  # rows each rank wants from me
    wanted = torch.empty(int(asked.sum()), dtype=torch.long)
    dist.all_to_all_single(wanted, ids[where], output_split_sizes=asked.tolist(),
                           input_split_sizes=asking.tolist())
    received = rows.new_empty(where.numel(), rows.shape[1])
    dist.all_to_all_single(received, x_local[torch.searchsorted(own, wanted)],
                           output_split_sizes=asking.tolist(), input_split_sizes=asked.tolist())
    rows[where] = received
    return rows[inverse]
    ### END SOLUTION


# %% tags=["check-11.4"]
check("11.4", fetch_features)

# %% [markdown]
# Now a sampled step across 4 ranks on the peptide graph, features on their METIS part: each
# rank samples 64 of its own nodes as seeds, fetches its batch's rows, checks them against the
# whole matrix and takes a DDP step of section 3's GraphSAGE. The recorder splits the bytes
# each rank sends into the feature exchanges (`all_to_all_single`) and DDP's gradient
# all-reduce, without a cache and with one of the 256 highest-degree remote nodes.

# %%
def degree_cache(degree, part, rank, x_local, size):
    """A static cache: the `size` highest-degree nodes this rank does not own, fetched once."""
    remote = (part != rank).nonzero().flatten()
    ids = remote[torch.argsort(degree[remote], descending=True, stable=True)[:size]].sort().values
    return FeatureCache(ids, fetch_features(ids, part, x_local))


def step_traffic(part, cache_size, steps=4, batch_size=64, fanouts=(10, 5)):
    rank = dist.get_rank()
    data = peptide_graph()
    rowptr, col = in_neighbour_csr(data.edge_index, data.num_nodes)
    own = local_graph(data.edge_index, part, rank).own
    x_local = data.x[own]  # the only features this rank holds
    degree = rowptr[1:] - rowptr[:-1]
    cache = degree_cache(degree, part, rank, x_local, cache_size) if cache_size else None
    torch.manual_seed(0)
    model = DDP(GraphSAGE(data.num_features, 64, num_layers=2, out_channels=2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    fetched, reduced, hits, exact = 0, 0, [], True
    for _ in range(steps):  # the same number of steps on every rank
        seeds = own[torch.randperm(own.numel(), generator=g)[:batch_size]]
        sub = sample_neighbors(rowptr, col, seeds, list(fanouts), g)
        with trace() as t:
            x = fetch_features(sub.n_id, part, x_local, cache)
            optimizer.zero_grad()
            out = model(x, sub.edge_index)[:batch_size]
            F.cross_entropy(out, data.y[seeds]).backward()
        optimizer.step()
        exact &= torch.equal(x, data.x[sub.n_id])
        fetched += sum(e.nbytes for e in t.events if e.op == "all_to_all_single")
        reduced += sum(e.nbytes for e in t.events if e.op.startswith("all_reduce"))
        remote = sub.n_id[part[sub.n_id] != rank]
        hits.append(cache.hit_rate(remote) if cache else 0.0)
    return {"features": fetched / steps, "gradients": reduced / steps, "exact": exact,
            "hit rate": sum(hits) / steps, "batch nodes": sub.n_id.numel()}


traffic = {size: launch(step_traffic, part4, size, world_size=4) for size in (0, 256)}
for size, runs in traffic.items():
    print(f"cache {size:3d} rows: per step and rank, features "
          f"{max(r['features'] for r in runs) / 2**10:7.1f} KiB, gradient all-reduce "
          f"{max(r['gradients'] for r in runs) / 2**10:5.1f} KiB; rows equal x[n_id] on every "
          f"rank: {all(r['exact'] for r in runs)}; cache hit rate "
          f"{sum(r['hit rate'] for r in runs) / len(runs):.0%}")
print(f"feature rows outweigh the gradients "
      f"{max(r['features'] for r in traffic[0]) / max(r['gradients'] for r in traffic[0]):.0f}x "
      "without a cache")

# %% [markdown]
# The peptide graph's degrees are nearly even (a k-NN graph: every node has at least 8), so a
# degree-ordered cache helps little there. A power-law graph is where it pays: the same
# question on section 2's 200,000-node graph, 4 METIS parts, counted in one process (which
# rows a batch needs does not depend on who fetches them). Rank 0 samples 20 batches of 256
# of its own nodes; for each cache size, the share of the batches' remote rows the cache
# holds, by degree and, for contrast, chosen at random.

# %%
big_part = metis_partition(big.edge_index, big.num_nodes, 4)
big_degree = big_rowptr[1:] - big_rowptr[:-1]
big_own = (big_part == 0).nonzero().flatten()
g = torch.Generator().manual_seed(0)
batches = [sample_neighbors(big_rowptr, big_col,
                            big_own[torch.randperm(big_own.numel(), generator=g)[:256]],
                            [10, 5], g).n_id for _ in range(20)]
remote_rows = [n_id[big_part[n_id] != 0] for n_id in batches]
big_remote = (big_part != 0).nonzero().flatten()
by_degree = big_remote[torch.argsort(big_degree[big_remote], descending=True, stable=True)]
at_random = big_remote[torch.randperm(big_remote.numel(), generator=g)]
shares = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
hit_rates = {}
for name, ranked in (("highest degree", by_degree), ("random", at_random)):
    hit_rates[name] = []
    for share in shares:
        cached = FeatureCache(ranked[:int(share * big.num_nodes)].sort().values, torch.empty(0))
        hit_rates[name].append(sum(cached.hit_rate(r) for r in remote_rows) / len(remote_rows))
print(f"remote rows per batch: {sum(r.unique().numel() for r in remote_rows) / 20:,.0f} of "
      f"{sum(b.numel() for b in batches) / 20:,.0f} nodes")
for name, rates in hit_rates.items():
    print(f"{name:14s} cache: hit rate " + ", ".join(
        f"{rate:.0%} at {share:.1%}" for share, rate in zip(shares, rates)) + " of the nodes")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
kinds = ("features", "gradients")
for i, kind in enumerate(kinds):
    ax1.bar([x + 0.4 * i for x in range(2)],
            [max(r[kind] for r in runs) / 2**10 for runs in traffic.values()], width=0.4,
            label="feature rows (all_to_all_single)" if i == 0 else "gradients (DDP all-reduce)")
ax1.set_xticks([0.2, 1.2], [f"cache {size}" for size in traffic])
ax1.set_ylabel("KiB sent per step, per rank")
ax1.set_title("peptides, 4 ranks, 64 seeds, fan-out (10, 5)")
ax1.legend(fontsize="small")
for name, rates in hit_rates.items():
    ax2.plot([100 * s for s in shares], [100 * r for r in rates], marker="o", label=name)
ax2.set_xscale("log")
ax2.set_xlabel("cache size (% of all nodes)")
ax2.set_ylabel("hit rate (% of remote rows)")
ax2.set_title(f"power law, {big.num_nodes:,} nodes, 4 METIS parts")
ax2.legend(fontsize="small")
plt.tight_layout()
plt.show()

# %% [markdown]
# Feature rows, not gradients, are the traffic of sampled training across machines: each
# step moves a row for every remote node of the batch, while the gradient all-reduce stays
# the model's size whatever the batch. METIS already keeps most of a batch's nodes at home
# (the remote rows above are a minority of the batch); of those that remain, a cache chosen
# by degree serves several times the share a random cache of the same size does, most of all
# when it is small: the hubs that every batch reaches are the rows it keeps. Each row it
# serves is a row less per step, for `size` rows of memory on every rank.
#
# DGL ships this design as `dgl.distributed` (`DistGraph`, with `DistTensor` features fetched
# from the partitions' servers; DGL is not installed here). PyG's `torch_geometric.distributed`
# (`LocalFeatureStore`, `DistNeighborLoader`) is deprecated since 2.7, as the Running at
# scale note below says, and PyG points to cuGraph-PyG for features sharded over GPUs.
#
# ## Running at scale
#
# > **Sampling on GPUs.** With `pyg-lib` installed (`pip install pyg-lib -f
# > https://data.pyg.org/whl/torch-${TORCH}+${CUDA}.html`, the index of your torch and CUDA
# > build; `kit doctor` prints the one for this machine),
# > `NeighborLoader` samples in C++, and the loop of section 3 runs unchanged under
# > `torchrun --standalone --nproc_per_node=8 train_sage.py`: `dist.init_process_group("nccl")`,
# > `torch.cuda.set_device(local_rank)`, `DDP(model.cuda(), device_ids=[local_rank])`, and
# > `batch = batch.to(local_rank, non_blocking=True)` before the forward. Sampling stays on the
# > CPU, in loader workers (`num_workers=4, persistent_workers=True`), while the GPU trains.
# > PyG's `examples/multi_gpu/distributed_sampling.py` is this recipe on `Reddit` (started
# > with `mp.spawn`; equal steps on every rank come from equal seed shares and `drop_last=True`).
# >
# > ```python
# > share = train_idx.size(0) // world_size  # the same number of seeds on every rank
# > loader = NeighborLoader(data, num_neighbors=[15, 10], batch_size=1024, shuffle=True,
# >                         input_nodes=train_idx[rank * share:(rank + 1) * share],
# >                         drop_last=True, num_workers=4, persistent_workers=True)
# > for batch in loader:
# >     batch = batch.to(local_rank)
# >     out = model(batch.x, batch.edge_index)[:batch.batch_size]
# > ```
# >
# > **Graphs partitioned over machines.** Sampling that crosses machines keeps one part of
# > the graph and its features per machine and fetches a batch's remote neighbours and feature
# > rows from their owners, as `fetch_features` does; with NCCL its three exchanges run GPU
# > to GPU once `x_local`, the ids and the cache live on the device. PyG had this as
# > `torch_geometric.distributed` (`Partitioner`, `DistNeighborLoader` over RPC), but it is
# > deprecated since PyG 2.7: in 2.8.1 its samplers and loaders warn that it "will no longer
# > be maintained" and point to PyG's
# > [distributed training tutorials](https://pytorch-geometric.readthedocs.io/en/latest/tutorial/distributed.html)
# > (one `NeighborLoader` per GPU under DDP, the pattern above) and to
# > [cuGraph-PyG](https://github.com/rapidsai/cugraph-gnn) (graph and features sharded over
# > GPUs, sampled on the GPU) for graphs beyond one machine. The halo exchange you
# > wrote is the other design, used for full-graph training (DistGNN, BNS-GCN, PipeGCN):
# > with NCCL, `all_to_all_single` moves the halo GPU to GPU, and the features never leave
# > device memory.
#
# ## Summary
#
# - Full-batch training of one big graph needs activations for every node in every layer;
#   k-hop mini-batches explode on power-law graphs.
# - Neighbour sampling (NeighborLoader, `replace=False`) caps a batch at B · (1 + f + ... +
#   f^L) nodes: seeds
#   first, new nodes in draw order, local `edge_index` of (neighbour, node).
# - Data-parallel GNN training replicates the graph, splits the seeds with equal step counts
#   on every rank, and all-reduces gradients with DDP.
# - Partitioning (METIS) keeps each rank's nodes, features and in-edges; the halo, the remote
#   neighbours, is planned once by asking (two `all_to_all_single` calls) and exchanged every
#   layer, with degrees, and mirrored in backward.
# - The partitioned GCN equals `GCNConv` on the whole graph, moves bytes proportional to the
#   halo, and holds memory proportional to its own part.
# - Sampled training with partitioned features fetches each missing row once (counts, ids,
#   rows: three `all_to_all_single`); those rows outweigh the gradient all-reduce, and a
#   static cache of the highest-degree remote rows serves many of them on a power-law graph.
#
# Docs: [NeighborLoader](https://pytorch-geometric.readthedocs.io/en/latest/modules/loader.html#torch_geometric.loader.NeighborLoader),
# [BaseSampler](https://pytorch-geometric.readthedocs.io/en/latest/modules/sampler.html),
# [GCNConv](https://pytorch-geometric.readthedocs.io/en/latest/generated/torch_geometric.nn.conv.GCNConv.html),
# [PyG's distributed training](https://pytorch-geometric.readthedocs.io/en/latest/tutorial/distributed.html),
# [all_to_all_single](https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_to_all_single),
# [torch.autograd.Function](https://pytorch.org/docs/stable/autograd.html#function),
# [pymetis](https://documen.tician.de/pymetis/).
#
# ## Exercises (ungraded)
#
# 1. Make `HaloGCNConv` send the degrees once: cache them on the module the first time, and
#    check with the recorder that later forwards send `out_channels` columns only.
# 2. Overlap: start the halo exchange with `async_op=True`, aggregate the edges between own
#    nodes while it is in flight, then the halo edges. Plot the timeline (Lesson 01's tracer).
# 3. Sampled training's memory does not depend on the graph; partitioned training's does. Find
#    the power-law graph size at which one rank's partition needs more memory than a sampled
#    batch, for fan-out (10, 5).
# 4. Train the 2-layer `HaloGCN` to convergence on 4 ranks and compare its test accuracy with
#    the sampled GraphSAGE of section 3.
# 5. Replace the degree-ordered cache by one filled from a few sampled warm-up epochs (the
#    rows sampled most often, GNNLab's pre-sampling policy) and compare the hit rates of
#    section 7 at the same size.
