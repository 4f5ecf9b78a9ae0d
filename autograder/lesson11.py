"""Checks for Lesson 11, "Graphs that do not fit one machine": tasks 11.1-11.4.

Task 11.1 ``sample_neighbors`` is judged by its invariants, exactly, against the graph it
sampled (every edge exists and points into the node it was drawn for, min(fanout, degree)
distinct draws per frontier node, PyG ``NeighborLoader``'s id order), by the per-hop sizes at
full fan-out (PyG's ``NeighborLoader`` where ``pyg-lib`` is installed, else the trusted loop
sampler), by binomial bounds on how often each neighbour and each pair of neighbours is drawn,
by replay from its generator, and by running PyG's own ``NodeLoader`` and ``GraphSAGE`` on its
batches (equal to the full graph's output when every neighbour is taken). Task 11.2
``halo_plan`` runs on 4 ranks and must equal a brute-force plan built from the whole graph,
agree across ranks and use exactly two ``all_to_all_single`` calls (the recorder). Task 11.3
``HaloGCNConv`` runs on 2 and 4 ranks with uneven parts against PyG's ``GCNConv`` on the whole
graph with the same weights (float64); the recorder sees its exchanges and their bytes, the
meter its bytes per local row. Task 11.4 ``fetch_features`` runs on 3 ranks (float32, a cache,
a rank asking nothing beside one owning nothing, bfloat16) and on one: its rows must equal the
whole matrix's, bit for bit, and the bytes the recorder sees a rank send must not exceed a
count per rank, the distinct ids it lacks and the rows the others lack of it. Answers live in
:mod:`autograder.references.lesson11` (trusted only), named here by string.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from autograder.compare import CheckFailed, describe, per_rank, tensor_mismatch
from autograder.registry import plain, task
from kit.lessons.graphs import in_neighbour_csr, local_graph, metis_partition, random_partition

# --------------------------------------------------------------------------- shared


def _plain_subgraph(sub: Any) -> dict[str, Any]:
    """A SampledSubgraph (or anything like it) as plain data; a missing field is a string."""
    names = ("n_id", "edge_index", "num_sampled_nodes", "num_sampled_edges")
    if isinstance(sub, tuple) and hasattr(sub, "_fields"):
        values = {n: getattr(sub, n, f"<no field {n}>") for n in names}
    elif isinstance(sub, (tuple, list)) and len(sub) == 4:
        values = dict(zip(names, sub))
    else:
        return {"returned": describe(sub, 80)}
    out: dict[str, Any] = {}
    for n, v in values.items():
        if n.startswith("num_") and isinstance(v, (list, tuple, torch.Tensor)):
            out[n] = [int(c) for c in v]
        else:
            out[n] = plain(v)
    return out


def _tensor(got: dict[str, Any], name: str, rows: int | None = None) -> torch.Tensor:
    value = got.get(name)
    if not isinstance(value, torch.Tensor) or value.is_floating_point():
        raise CheckFailed(f"{name} is {describe(value, 80)}, expected an int64 tensor",
                          expected="an integer tensor", got=describe(value, 80))
    if rows is not None and (value.dim() != 2 or value.shape[0] != rows):
        raise CheckFailed(f"{name} has shape {tuple(value.shape)}, expected ({rows}, E)",
                          expected=f"({rows}, E)", got=tuple(value.shape))
    return value.long()


def _counts(got: dict[str, Any], name: str, length: int) -> list[int]:
    value = got.get(name)
    if not isinstance(value, list) or len(value) != length:
        raise CheckFailed(f"{name} is {describe(value, 80)}, expected {length} counts",
                          expected=f"{length} counts, one per hop" if name.endswith("edges")
                          else f"{length} counts: the seeds, then one per hop",
                          got=describe(value, 80))
    return value


# --------------------------------------------------------------------------- task 11.1


def directed_graph(seed: int, num_nodes: int = 300, most: int = 12) -> torch.Tensor:
    """(2, E) a random directed graph without self-loops or duplicate edges: node v has
    0..most in-neighbours, listed in a random order (so ``col`` is not sorted by id)."""
    g = torch.Generator().manual_seed(seed)
    sources, targets = [], []
    for v in range(num_nodes):
        d = int(torch.randint(0, most + 1, (1,), generator=g))
        nbrs = torch.randperm(num_nodes - 1, generator=g)[:d]
        nbrs = nbrs + (nbrs >= v).long()  # never v itself
        sources.append(nbrs)
        targets.append(torch.full((d,), v))
    return torch.stack([torch.cat(sources), torch.cat(targets)])


# (seeds, fanouts) of the configurations sampled from ``directed_graph``.
CONFIGS = {"24 seeds, fanouts [4, 3, 2]": (24, [4, 3, 2]),
           "1 seed, fanouts [5, 5]": (1, [5, 5]),
           "10 seeds, fanouts [2, 0, 3]": (10, [2, 0, 3])}
FULL = "16 seeds, fan-out at least every degree [12, 12]"
STARS, STAR_DEGREE, STAR_FANOUT = 3000, 20, 5
LOADER_SEEDS, LOADER_BATCH, SAGE_IN, SAGE_HIDDEN = 48, 16, 6, 5


def _seeds(seed: int, n: int, num_nodes: int) -> torch.Tensor:
    return torch.randperm(num_nodes, generator=torch.Generator().manual_seed(seed + 1))[:n]


def star_graph(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``STARS`` disjoint stars: centre i < STARS has ``STAR_DEGREE`` in-neighbours, listed in a
    random order. Returns (rowptr, col, position): ``position[u]`` is u's place in its centre's
    list, so counts by position show whether every place is drawn alike."""
    g = torch.Generator().manual_seed(seed + 7)
    leaves = torch.arange(STARS, STARS * (STAR_DEGREE + 1)).view(STARS, STAR_DEGREE)
    order = torch.argsort(torch.rand(STARS, STAR_DEGREE, generator=g), dim=1)
    leaves = leaves.gather(1, order)
    position = torch.zeros(STARS * (STAR_DEGREE + 1), dtype=torch.long)
    position[leaves.reshape(-1)] = torch.arange(STAR_DEGREE).repeat(STARS)
    edge_index = torch.stack([leaves.reshape(-1),
                              torch.arange(STARS).repeat_interleave(STAR_DEGREE)])
    rowptr, col = in_neighbour_csr(edge_index, STARS * (STAR_DEGREE + 1))
    return rowptr, col, position


def sage_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """(edge_index, x, seeds, model): the graph, float64 features, the loader's seeds and a
    2-layer PyG GraphSAGE with seeded weights."""
    from torch_geometric.nn import GraphSAGE

    edge_index = directed_graph(seed + 3)
    x = torch.randn(300, SAGE_IN, generator=torch.Generator().manual_seed(seed + 4),
                    dtype=torch.float64)
    seeds = _seeds(seed + 5, LOADER_SEEDS, 300)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed + 6)
    model = GraphSAGE(SAGE_IN, SAGE_HIDDEN, num_layers=2).double()
    torch.random.set_rng_state(state)
    return edge_index, x, seeds, model


# The edges real batches reach, on a 6-node graph: node 0 <- 1, 2; 1 <- 2; 2 has no
# in-neighbour; 3 is isolated; 4 <- 5 and 5 <- 4 (a cycle). Every fan-out here is at least
# every degree (or 0), so each sample is fixed.
EDGE_NEIGHBOURS = [[1, 2], [2], [], [], [5], [4]]
EDGE_SAMPLES = {
    "an isolated seed: no edge in any hop": ([3], [4, 4]),
    "no seeds at all: every hop empty": ([], [4]),
    "the frontier runs dry after hop 1 (node 2 has no in-neighbour)": ([1], [4, 4, 4]),
    "fan-out 0 in hop 1 (hop 2 has nothing to expand)": ([0, 4], [0, 4]),
    "a cycle: nodes seen before are not added again": ([4, 0], [4, 4]),
}


def edge_graph() -> tuple[torch.Tensor, torch.Tensor]:
    """EDGE_NEIGHBOURS as in-neighbour CSR (rowptr, col)."""
    rowptr = torch.tensor([0] + [len(n) for n in EDGE_NEIGHBOURS]).cumsum(0)
    col = torch.tensor([u for n in EDGE_NEIGHBOURS for u in n], dtype=torch.long)
    return rowptr, col


def _compare_edges(got: Any, expected: dict[str, Any]) -> None:
    edges = got.get("edges") if isinstance(got, dict) else None
    if not isinstance(edges, dict):
        raise CheckFailed("could not read the edge samples", got=describe(got, 120))
    for label, want in expected.items():
        have = edges.get(label, {})
        seeds, fanouts = EDGE_SAMPLES[label]
        where = f"{label} (seeds {seeds}, fanouts {fanouts})"
        if "raised" in have or "returned" in have:
            outcome = (f"raised {have['raised']}" if "raised" in have
                       else f"returned {have['returned']}")
            raise CheckFailed(f"{where}: sample_neighbors {outcome}",
                              expected="a SampledSubgraph with empty hops counted as 0",
                              hint="An empty frontier, a node without in-neighbours or a fan-out "
                                   "of 0 draws nothing: keep going, with 0 new nodes and 0 edges "
                                   "for that hop (torch.empty(0), .max() of nothing is an error).")
        for name in ("n_id", "edge_index", "num_sampled_nodes", "num_sampled_edges"):
            a, b = have.get(name), want[name]
            same = (torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    and a.shape == b.shape else a == b)
            if not same:
                raise CheckFailed(f"{where}: {name} differs from NeighborLoader's sampling",
                                  expected=describe(b, 120), got=describe(a, 120),
                                  hint="Empty hops still count: num_sampled_nodes has hops + 1 "
                                       "entries and num_sampled_edges one per hop, 0 where "
                                       "nothing was drawn; edge_index of no edge is (2, 0).")


def _samples(sample_neighbors: Any, seed: int) -> dict[str, Any]:
    """One run of the student's sampler, judged by every case of task 11.1."""
    from torch_geometric.data import Data
    from torch_geometric.loader import NodeLoader

    from kit.lessons.graphs import FunctionSampler

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a loaded 2-core machine makes 2 threads' small ops 100x slower
    try:
        edge_index = directed_graph(seed)
        rowptr, col = in_neighbour_csr(edge_index, 300)
        out: dict[str, Any] = {}
        for name, (n, fanouts) in {**CONFIGS, FULL: (16, [12, 12])}.items():
            g = torch.Generator().manual_seed(seed + 11)
            out[name] = _plain_subgraph(sample_neighbors(rowptr, col, _seeds(seed, n, 300),
                                                         list(fanouts), g))
        # replay: the same generator state twice (with the global RNG moved between), then
        # another state; the global RNG must be left as it was
        n, fanouts = CONFIGS["24 seeds, fanouts [4, 3, 2]"]
        seeds = _seeds(seed, n, 300)
        runs = []
        for state, global_seed in ((seed + 21, 1), (seed + 21, 2), (seed + 22, 1)):
            torch.manual_seed(global_seed)
            before = torch.random.get_rng_state()
            runs.append(_plain_subgraph(sample_neighbors(
                rowptr, col, seeds, list(fanouts), torch.Generator().manual_seed(state))))
            untouched = torch.equal(before, torch.random.get_rng_state())
            runs[-1]["global RNG untouched"] = bool(untouched)
        out["replay"] = runs
        e_rowptr, e_col = edge_graph()
        edges: dict[str, Any] = {}
        for label, (seeds, fanouts) in EDGE_SAMPLES.items():
            try:
                edges[label] = _plain_subgraph(sample_neighbors(
                    e_rowptr, e_col, torch.tensor(seeds, dtype=torch.long), list(fanouts),
                    torch.Generator().manual_seed(seed + 41)))
            except Exception as e:  # noqa: BLE001 - judged by the edges' case
                edges[label] = {"raised": f"{type(e).__name__}: {str(e)[:160]}"}
        out["edges"] = edges
        s_rowptr, s_col, _ = star_graph(seed)
        star = sample_neighbors(s_rowptr, s_col, torch.arange(STARS), [STAR_FANOUT],
                                torch.Generator().manual_seed(seed + 31))
        out["stars"] = _plain_subgraph(star)
        # PyG's own loader and model on the student's batches
        edge_index, x, seeds, model = sage_inputs(seed)
        data = Data(x=x, edge_index=edge_index, num_nodes=300)
        loader = NodeLoader(data, node_sampler=FunctionSampler(sample_neighbors, data, [12, 12]),
                            input_nodes=seeds, batch_size=LOADER_BATCH)
        seen, outputs = [], []
        try:
            with torch.no_grad():
                for batch in loader:
                    seen.append(batch.n_id[:batch.batch_size])
                    outputs.append(model(batch.x, batch.edge_index)[:batch.batch_size])
            out["loader"] = {"seeds": plain(torch.cat(seen)), "out": plain(torch.cat(outputs))}
        except (IndexError, RuntimeError, ValueError, TypeError, AttributeError) as e:
            # the other cases still judge their part of the run
            out["loader"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        return out
    finally:
        torch.set_num_threads(threads)


def check_invariants(got: dict[str, Any], edge_index: torch.Tensor, seeds: torch.Tensor,
                     fanouts: list[int], what: str, *, counts_only: bool = False,
                     num_nodes: int = 300) -> None:
    """Every invariant of a sampled subgraph, exactly (raises CheckFailed naming the first
    broken one). ``counts_only`` stops after the edge and per-node count checks.

    The failure's cause is the invariant broken, whatever the configuration and the numbers: the
    cases that sample other configurations and break the same one follow the first."""
    try:
        _invariants(got, edge_index, seeds, fanouts, what, counts_only=counts_only,
                    num_nodes=num_nodes)
    except CheckFailed as e:
        text = e.message.removeprefix(f"{what}: ")
        e.cause = e.cause or "invariant: " + re.sub(r"\d+", "#", re.sub(r"\[[^\]]*\]", "[]", text))
        raise


def _invariants(got: dict[str, Any], edge_index: torch.Tensor, seeds: torch.Tensor,
                fanouts: list[int], what: str, *, counts_only: bool, num_nodes: int) -> None:
    if "returned" in got:
        raise CheckFailed(f"{what}: sample_neighbors returned {got['returned']}, expected a "
                          "SampledSubgraph "
                          "(n_id, edge_index, num_sampled_nodes, num_sampled_edges)")
    n_id = _tensor(got, "n_id")
    ei = _tensor(got, "edge_index", rows=2)
    hops = len(fanouts)
    nodes = _counts(got, "num_sampled_nodes", hops + 1)
    edges = _counts(got, "num_sampled_edges", hops)
    if sum(nodes) != n_id.numel() or sum(edges) != ei.shape[1]:
        raise CheckFailed(f"{what}: the per-hop counts do not add up: num_sampled_nodes sums to "
                          f"{sum(nodes)} for {n_id.numel()} nodes in n_id, num_sampled_edges to "
                          f"{sum(edges)} for {ei.shape[1]} edges", expected="sums equal the sizes",
                          got={"num_sampled_nodes": nodes, "num_sampled_edges": edges})
    if ei.numel() and (ei.min() < 0 or ei.max() >= n_id.numel()):
        raise CheckFailed(f"{what}: edge_index holds ids outside 0..{n_id.numel() - 1}: it must "
                          "hold local ids, positions in n_id, not global node ids",
                          expected=f"ids in [0, {n_id.numel()})",
                          got=f"ids in [{int(ei.min())}, {int(ei.max())}]",
                          hint="edge_index is local: each id is a position in n_id, as PyG's "
                               "loaders give it, so a batch's x is data.x[n_id].")
    rowptr, col = in_neighbour_csr(edge_index, num_nodes)
    gsrc, gdst = n_id[ei[0]], n_id[ei[1]]
    # every sampled edge (neighbour -> node) is an edge of the graph, into the node
    ptr_of: dict[tuple[int, int], int] = {}
    for v in torch.unique(gdst).tolist():
        for p in range(int(rowptr[v]), int(rowptr[v + 1])):
            ptr_of[(int(col[p]), v)] = p
    for s, t in zip(gsrc.tolist(), gdst.tolist()):
        if (s, t) not in ptr_of:
            reverse = any(int(col[p]) == t for p in range(int(rowptr[s]), int(rowptr[s + 1]))) \
                if s < len(rowptr) - 1 else False
            raise CheckFailed(
                f"{what}: the sampled edge {s} -> {t} (global ids) is not an edge of the graph"
                + (f"; {t} -> {s} is: the draws come from out-neighbours, or row 0 and row 1 "
                   "are swapped" if reverse else ""),
                expected=f"{s} among the in-neighbours col[rowptr[{t}]:rowptr[{t} + 1]]",
                got=f"in-neighbours of {t}: {col[rowptr[t]:rowptr[t + 1]].tolist()}",
                hint="A node's neighbours are its in-neighbours, col[rowptr[v]:rowptr[v + 1]]; "
                     "each edge is (neighbour, node): row 0 the neighbour, row 1 the node.")
    if n_id[:seeds.numel()].tolist() != seeds.tolist():
        raise CheckFailed(f"{what}: n_id does not start with the seeds, in their order",
                          expected=seeds.tolist()[:12], got=n_id[:seeds.numel()].tolist()[:12])
    if torch.unique(n_id).numel() != n_id.numel():
        raise CheckFailed(f"{what}: a node appears twice in n_id", expected="distinct ids",
                          got=f"{n_id.numel() - torch.unique(n_id).numel()} repeated")
    start = [0]
    for c in nodes:
        start.append(start[-1] + c)
    e0 = 0
    for h, (fanout, ne) in enumerate(zip(fanouts, edges)):
        src, dst = ei[0, e0:e0 + ne], ei[1, e0:e0 + ne]
        frontier = range(start[h], start[h + 1])
        if ne and (dst.min() < frontier.start or dst.max() >= frontier.stop):
            raise CheckFailed(
                f"{what}: hop {h} has edges into nodes outside its frontier (local ids "
                f"{frontier.start}..{frontier.stop - 1}): each hop expands only the nodes first "
                "seen in the hop before (the seeds at hop 0), never a node seen earlier",
                expected=f"targets in [{frontier.start}, {frontier.stop})",
                got=f"targets in [{int(dst.min())}, {int(dst.max())}]",
                hint="A node already seen is not sampled again: the frontier of hop h + 1 is only "
                     "the nodes first drawn at hop h.")
        per_node = torch.bincount(dst - frontier.start, minlength=len(frontier)) if ne else \
            torch.zeros(len(frontier), dtype=torch.long)
        for j, v in enumerate(frontier):
            g = int(n_id[v])
            deg = int(rowptr[g + 1] - rowptr[g])
            want = min(fanout, deg)
            pairs = set(zip(src[dst == v].tolist(), [v] * int(per_node[j])))
            if int(per_node[j]) != want or len(pairs) != want:
                raise CheckFailed(
                    f"{what}: at hop {h}, node {g} (degree {deg}, fanout {fanout}) got "
                    f"{int(per_node[j])} draws, {len(pairs)} of them distinct; expected "
                    f"min(fanout, degree) = {want} distinct neighbours",
                    expected=want, got={"draws": int(per_node[j]), "distinct": len(pairs)},
                    hint="Sampling is without replacement: each frontier node draws min(fanout, "
                         "degree) different neighbours, once each.")
        e0 += ne
    if counts_only:
        return
    e0 = 0
    for h, ne in enumerate(edges):
        src, dst = ei[0, e0:e0 + ne], ei[1, e0:e0 + ne]
        ptrs = torch.tensor([ptr_of[(int(n_id[s]), int(n_id[t]))] for s, t in zip(src, dst)],
                            dtype=torch.long)
        key = dst * (len(col) + 1) + ptrs
        if ne and not bool((key[1:] > key[:-1]).all()):
            raise CheckFailed(
                f"{what}: the edges of hop {h} are not in draw order: frontier nodes in n_id "
                "order, and each node's neighbours in the order they appear in col",
                expected="targets non-decreasing, positions in col increasing per target",
                got=f"first edges {ei[:, e0:e0 + 6].tolist()}",
                hint="A hop's edges go node by node, in n_id order (PyG's order), and each "
                     "node's draws in col order (this task's rule, so that a sample can be "
                     "checked exactly); n_id's new nodes follow that same order.")
        new = n_id[start[h + 1]:start[h + 2]].tolist()
        first: list[int] = []
        seen = set(n_id[:start[h + 1]].tolist())
        for s in n_id[src].tolist():
            if s not in seen:
                seen.add(s)
                first.append(s)
        if new != first:
            raise CheckFailed(
                f"{what}: the nodes added at hop {h} are not the new neighbours in the order "
                "they were first drawn", expected=first[:12], got=new[:12],
                hint="n_id is the seeds, then every node the first time it is drawn, in draw "
                     "order; num_sampled_nodes[h + 1] counts the nodes first seen at hop h.")
        e0 += ne


def _invariant_case(counts_only: bool) -> Any:
    def compare(got: Any, expected: dict[str, Any]) -> None:
        if not isinstance(got, dict):
            raise CheckFailed("the run returned no samples", got=describe(got, 80))
        edge_index = expected["edge_index"]
        for name, (_, fanouts) in CONFIGS.items():
            check_invariants(got[name], edge_index, expected["seeds"][name], fanouts, name,
                             counts_only=counts_only)
    return compare


def _graph_and_seeds(seed: int) -> dict[str, Any]:
    """Trusted: the graph the configurations sample and each one's seeds."""
    return {"edge_index": directed_graph(seed),
            "seeds": {name: _seeds(seed, n, 300) for name, (n, _) in CONFIGS.items()}}


def _compare_full(got: Any, expected: dict[str, Any]) -> None:
    sub = got[FULL] if isinstance(got, dict) else got
    check_invariants(sub, expected["edge_index"], expected["seeds"], [12, 12], FULL,
                     counts_only=True)
    for name in ("num_sampled_nodes", "num_sampled_edges"):
        if sub[name] != expected[name]:
            raise CheckFailed(f"{FULL}: {name} is {sub[name]}, NeighborLoader's sampling gives "
                              f"{expected[name]}", expected=expected[name], got=sub[name])
    if sub["n_id"].tolist() != expected["n_id"].tolist():
        raise CheckFailed(f"{FULL}: with every neighbour taken the sample is fixed, and n_id "
                          "differs from it", expected=expected["n_id"].tolist()[:16],
                          got=sub["n_id"].tolist()[:16])


def binomial_bound(n: int, p: float, sds: float = 5.5) -> float:
    """How far a Binomial(n, p) count may stray from n p (``sds`` standard deviations)."""
    return sds * math.sqrt(n * p * (1 - p))


def _compare_uniform(got: Any, expected: dict[str, Any]) -> None:
    sub = got["stars"] if isinstance(got, dict) else got
    if "returned" in sub:
        raise CheckFailed(f"sample_neighbors returned {sub['returned']}")
    n_id, ei = _tensor(sub, "n_id"), _tensor(sub, "edge_index", rows=2)
    position = expected["position"]
    src, dst = n_id[ei[0]], n_id[ei[1]]
    per_centre = torch.bincount(dst, minlength=STARS)
    if ei.shape[1] != STARS * STAR_FANOUT or not bool((per_centre == STAR_FANOUT).all()):
        raise CheckFailed(f"{STARS} stars of {STAR_DEGREE} leaves, fanout {STAR_FANOUT}: expected "
                          f"{STAR_FANOUT} draws per centre", expected=STAR_FANOUT,
                          got=f"{per_centre.min().item()}..{per_centre.max().item()} draws")
    places = position[src]
    counts = torch.bincount(places, minlength=STAR_DEGREE)
    p = STAR_FANOUT / STAR_DEGREE
    slack = binomial_bound(STARS, p)
    worst = int((counts.double() - STARS * p).abs().argmax())
    if abs(counts[worst].item() - STARS * p) > slack:
        raise CheckFailed(
            f"place {worst} in the neighbour lists was drawn {counts[worst].item()} times in "
            f"{STARS} draws of {STAR_FANOUT} of {STAR_DEGREE}; uniform sampling draws each "
            f"place {STARS * p:.0f} ± {slack:.0f} times (5.5 standard deviations)",
            expected=f"{STARS * p:.0f} ± {slack:.0f}", got=counts.tolist(),
            hint="Every neighbour must be equally likely: not the first ones, not those near "
                 "one end of the list.")
    # every pair of places is drawn together alike (a random window of neighbours is not)
    order = torch.argsort(dst, stable=True)
    by_centre = places[order].view(STARS, STAR_FANOUT)
    pair = torch.zeros(STAR_DEGREE, STAR_DEGREE, dtype=torch.long)
    for a in range(STAR_FANOUT):
        for b in range(a + 1, STAR_FANOUT):
            i, j = by_centre[:, a], by_centre[:, b]
            pair.index_put_((torch.minimum(i, j), torch.maximum(i, j)),
                            torch.ones(STARS, dtype=torch.long), accumulate=True)
    q = STAR_FANOUT * (STAR_FANOUT - 1) / (STAR_DEGREE * (STAR_DEGREE - 1))
    slack = binomial_bound(STARS, q)
    upper = torch.triu(torch.ones(STAR_DEGREE, STAR_DEGREE, dtype=torch.bool), 1)
    deviation = (pair.double() - STARS * q).abs().masked_fill(~upper, 0)
    i, j = divmod(int(deviation.argmax()), STAR_DEGREE)
    if deviation[i, j] > slack:
        raise CheckFailed(
            f"places {i} and {j} were drawn together {pair[i, j].item()} times in {STARS} draws; "
            f"a uniform choice of {STAR_FANOUT} of {STAR_DEGREE} picks every pair "
            f"{STARS * q:.0f} ± {slack:.0f} times",
            expected=f"{STARS * q:.0f} ± {slack:.0f}", got=pair[i, j].item(),
            hint="Each set of fanout neighbours must be equally likely, not only each neighbour: "
                 "a random starting place followed by the next ones is not uniform.")


def _compare_replay(got: Any, expected: None) -> None:
    runs = got["replay"] if isinstance(got, dict) else got
    a, b, c = runs
    for r in runs:
        if "returned" in r:
            raise CheckFailed(f"sample_neighbors returned {r['returned']}")
    fields = ("n_id", "edge_index", "num_sampled_nodes", "num_sampled_edges")

    def same(x: dict[str, Any], y: dict[str, Any]) -> bool:
        return all(type(x[f]) is type(y[f])
                   and (torch.equal(x[f], y[f]) if isinstance(x[f], torch.Tensor)
                        else x[f] == y[f]) for f in fields)

    if not all(r["global RNG untouched"] for r in runs):
        raise CheckFailed("sampling changed torch's global random state: every random number "
                          "must come from the generator passed in",
                          expected="torch.random.get_rng_state() unchanged", got="changed",
                          hint="Pass generator= to every random call (torch.rand, torch.randint, "
                               "torch.randperm, torch.multinomial).")
    if not same(a, b):
        raise CheckFailed("two generators in the same state gave different samples: the draws "
                          "do not come from the generator alone", expected="identical samples",
                          got="different samples")
    if same(a, c):
        raise CheckFailed("generators in different states gave the same sample: the sampler "
                          "does not draw at random from the generator",
                          expected="different samples", got="identical samples")


def _compare_loader(got: Any, expected: dict[str, Any]) -> None:
    loader = got["loader"] if isinstance(got, dict) else got
    if "error" in loader:
        raise CheckFailed("PyG's NodeLoader or GraphSAGE failed on your batches: "
                          f"{loader['error']}",
                          expected="batches GraphSAGE runs on", got=loader["error"][:120])
    if not torch.equal(loader["seeds"], expected["seeds"]):
        raise CheckFailed("the first batch_size nodes of each NodeLoader batch are not its seeds",
                          expected=expected["seeds"].tolist()[:16],
                          got=loader["seeds"].tolist()[:16])
    problem = tensor_mismatch(loader["out"], expected["out"], rtol=1e-9, atol=1e-10)
    if problem:
        raise CheckFailed(f"GraphSAGE on the NodeLoader batches {problem}, against GraphSAGE on "
                          "the whole graph (every neighbour taken for 2 hops: the two must agree)",
                          expected=describe(expected["out"]), got=describe(loader["out"]))


SAMPLE = task(
    "11.1",
    # PyG's samplers, and the loaders that draw through them (the legacy NeighborSampler, the
    # link loader, the distributed one): the sampling is the task
    forbidden=("torch_geometric.sampler", "torch_geometric.loader.NeighborLoader",
               "torch_geometric.loader.LinkNeighborLoader",
               "torch_geometric.loader.NeighborSampler",
               "torch_geometric.distributed"),
    hint="PyG's NeighborLoader semantics without replacement: hop by hop, every frontier node "
         "draws min(fanout, degree) distinct in-neighbours uniformly, with every random number "
         "from the generator; nodes seen before are not expanded again; n_id is the seeds, then "
         "each node when first drawn; edge_index holds (neighbour, node) pairs in local ids.",
    recipe="Keep a map from global id to local id (a tensor of -1s works). The frontier starts "
           "as the seeds. For each hop and each frontier node in n_id order, read its degree "
           "from rowptr and choose min(fanout, degree) distinct positions among its neighbours "
           "uniformly (a random permutation's first ones, or Floyd's method), using the "
           "generator; visit the chosen positions in increasing order. A neighbour without a "
           "local id gets the next one and joins the next frontier. Record each edge as (local "
           "id of the neighbour, local id of the node), and count the new nodes and the edges "
           "of every hop.",
)

SAMPLES = SAMPLE.shared(_samples)
SAMPLE.case("every sampled edge is an in-edge of the graph, in local ids, with min(fanout, "
            "degree) distinct draws per frontier node", uses=SAMPLES,
            compare=_invariant_case(counts_only=True), expect=_graph_and_seeds)
SAMPLE.case("n_id: the seeds, then new nodes in draw order; edges node by node in col order",
            uses=SAMPLES, compare=_invariant_case(counts_only=False), expect=_graph_and_seeds,
            hint="The order is part of PyG's contract: the first batch_size nodes are the seeds, "
                 "new nodes follow in the order they are first drawn, frontier nodes are taken in "
                 "n_id order; and this task's rule: each node's draws in col order.",
            recipe="Visit frontier nodes in the order of n_id; sort each node's chosen positions "
                   "before reading col; append a neighbour to n_id the first time it appears in "
                   "that sequence, and make it part of the next frontier.")
SAMPLE.case("per-hop sizes at full fan-out are NeighborLoader's (PyG's own sampler where pyg-lib "
            "is installed, else the trusted loop)", uses=SAMPLES,
            compare=_compare_full, expect="full_fanout_sample",
            hint="With a fan-out at least every degree nothing is random: num_sampled_nodes has "
                 "the seeds then the new nodes of each hop, num_sampled_edges the edges of each "
                 "hop, exactly as NeighborLoader counts them.",
            recipe="num_sampled_nodes starts with the number of seeds and gets one entry per hop "
                   "(the nodes first seen in it); num_sampled_edges gets one entry per hop (every "
                   "edge drawn in it, to new and to old nodes alike).")
SAMPLE.case(f"uniform draws: every neighbour and every pair of neighbours within binomial "
            f"bounds ({STARS} nodes drawing {STAR_FANOUT} of {STAR_DEGREE})", uses=SAMPLES,
            compare=_compare_uniform, expect=lambda seed: {"position": star_graph(seed)[2]},
            recipe="For each node, choose the subset of positions uniformly: sort random keys "
                   "drawn from the generator and keep the smallest min(fanout, degree) of them, or "
                   "take the first entries of a random permutation of its degree.")
SAMPLE.case("the edges: an isolated seed, no seeds, a frontier that runs dry, fan-out 0, a cycle",
            weight=0.5, uses=SAMPLES, compare=_compare_edges, expect="edge_samples")
SAMPLE.case("replays from the same generator state; leaves the global RNG alone", uses=SAMPLES,
            compare=_compare_replay,
            hint="Reproducible sampling: the generator passed in is the only source of randomness, "
                 "so the same state gives the same batch and another state another batch.",
            recipe="Pass generator= to every random call and never call torch.manual_seed or the "
                   "global RNG (nor Python's random module).")
SAMPLE.case("PyG's NodeLoader batches it and GraphSAGE on them equals the full graph when every "
            "neighbour is taken", uses=SAMPLES, compare=_compare_loader,
            expect="sage_on_full_graph",
            hint="PyG's loaders slice data.x by n_id and run the model on the local edge_index; "
                 "the seeds come first, so out[:batch_size] are the seeds' outputs. With every "
                 "neighbour of 2 hops taken, a 2-layer GraphSAGE sees the whole 2-hop "
                 "neighbourhood.",
            recipe="Return a SampledSubgraph whose n_id starts with the seeds and whose edge_index "
                   "uses positions in n_id, row 0 the neighbour; the loader does the rest.")


# --------------------------------------------------------------------------- task 11.2

PLAN_RANKS, PLAN_NODES = 4, 240


def plan_graph(seed: int) -> torch.Tensor:
    """(2, E) a directed graph for the halo plans: nodes 0..29 take in-edges only from each
    other (so the rank owning them needs no halo), every other node from anywhere."""
    g = torch.Generator().manual_seed(seed + 41)
    src = torch.randint(0, PLAN_NODES, (4 * PLAN_NODES,), generator=g)
    dst = torch.randint(0, PLAN_NODES, (4 * PLAN_NODES,), generator=g)
    closed = dst < 30
    src[closed] = src[closed] % 30
    keep = src != dst
    key = torch.unique(dst[keep] * PLAN_NODES + src[keep])
    return torch.stack([key % PLAN_NODES, key // PLAN_NODES])


def plan_partitions(seed: int) -> dict[str, torch.Tensor]:
    """The partitions halo_plan is run on, by name (each node -> its rank)."""
    edge_index = plan_graph(seed)
    g = torch.Generator().manual_seed(seed + 43)
    empty = torch.randint(0, 3, (PLAN_NODES,), generator=g)
    empty[empty == 2] = 3  # rank 2 owns nothing
    closed = torch.randint(0, 3, (PLAN_NODES,), generator=g)
    closed[:30] = 3  # rank 3 owns nodes 0..29, whose sources are all its own: no halo
    return {"random": random_partition(PLAN_NODES, PLAN_RANKS, seed),
            "METIS": metis_partition(edge_index, PLAN_NODES, PLAN_RANKS, seed),
            "an empty part (rank 2)": empty, "a rank with no halo (rank 3)": closed,
            "all nodes on rank 0": torch.zeros(PLAN_NODES, dtype=torch.long)}


def _plain_plan(plan: Any) -> Any:
    if not (isinstance(plan, tuple) and len(plan) == 2):
        return describe(plan, 80)
    recv, send = (getattr(plan, "recv", plan[0]), getattr(plan, "send", plan[1]))
    def rows(side: Any) -> Any:
        return ([plain(t) for t in side] if isinstance(side, (list, tuple))
                else describe(side, 80))

    return {"recv": rows(recv), "send": rows(send)}


def _plans_on_rank(halo_plan: Any, seed: int) -> dict[str, Any]:
    import torch.distributed as dist

    from kit.trace import trace

    rank = dist.get_rank()
    edge_index = plan_graph(seed)
    out = {}
    for name, part in plan_partitions(seed).items():
        local = local_graph(edge_index, part, rank)
        with trace() as t:
            plan = halo_plan(part.clone(), local.edge_index.clone(), rank)
        out[name] = {"plan": _plain_plan(plan),
                     "ops": [(e.op, e.kind, e.nbytes) for e in t.events]}
    return out


def _plan_of(got: Any, name: str, world_size: int) -> list[dict[str, Any]]:
    ranks = per_rank(got, world_size, "set of plans")
    plans = []
    for rank, entry in enumerate(ranks):
        plan = entry[name]["plan"]
        if not isinstance(plan, dict):
            raise CheckFailed(f"{name}: rank {rank}'s halo_plan returned {plan}, expected a "
                              "HaloPlan(recv, send)")
        for field in ("recv", "send"):
            lists = plan[field]
            if not isinstance(lists, list) or len(lists) != world_size or not all(
                    isinstance(t, torch.Tensor) for t in lists):
                raise CheckFailed(f"{name}: rank {rank}'s plan.{field} is {describe(lists, 80)}, "
                                  f"expected a list of {world_size} tensors (one per rank)")
        plans.append(plan)
    return plans


def _compare_plans(names: tuple[str, ...]) -> Any:
    def compare(got: Any, expected: dict[str, Any]) -> None:
        for name in names:
            plans = _plan_of(got, name, PLAN_RANKS)
            for rank, (plan, want) in enumerate(zip(plans, expected[name])):
                for field in ("recv", "send"):
                    for s in range(PLAN_RANKS):
                        g, w = plan[field][s], want[field][s]
                        if g.is_floating_point() or g.tolist() != w.tolist():
                            other = "send" if field == "recv" else "recv"
                            swapped = plan[other][s].tolist() == w.tolist() and w.numel()
                            # the cause is what is wrong: the same in another partition follows
                            raise CheckFailed(
                                f"{name} partition: rank {rank}'s {field}[{s}] is wrong"
                                + (f" (it holds what {other}[{s}] should: recv and send are "
                                   "swapped)" if swapped else ""),
                                expected=w.tolist()[:16], got=g.tolist()[:16],
                                cause="recv and send swapped" if swapped else f"{field} wrong")
    return compare


def _compare_agree(got: Any, expected: None) -> None:
    for name in plan_partitions(0):
        plans = _plan_of(got, name, PLAN_RANKS)
        for r in range(PLAN_RANKS):
            if plans[r]["recv"][r].numel() or plans[r]["send"][r].numel():
                raise CheckFailed(f"{name}: rank {r}'s plan has entries for itself",
                                  expected="recv[rank] and send[rank] empty",
                                  got={"recv": plans[r]["recv"][r].tolist()[:8],
                                       "send": plans[r]["send"][r].tolist()[:8]})
            for s in range(PLAN_RANKS):
                a, b = plans[r]["send"][s].tolist(), plans[s]["recv"][r].tolist()
                if a != b:
                    raise CheckFailed(f"{name}: rank {r}'s send[{s}] is not rank {s}'s recv[{r}]: "
                                      "what one rank sends must be exactly what the other asked "
                                      "for",
                                      expected=b[:16], got=a[:16])


def _compare_pattern(got: Any, expected: None) -> None:
    ranks = per_rank(got, PLAN_RANKS, "set of plans")
    for name in plan_partitions(0):
        for rank, entry in enumerate(ranks):
            ops = entry[name]["ops"]
            plan = entry[name]["plan"]
            asked = sum(t.numel() for t in plan["recv"]) if isinstance(plan, dict) and isinstance(
                plan.get("recv"), list) else 0
            names = [op for op, _, _ in ops]
            if names != ["all_to_all_single", "all_to_all_single"]:
                raise CheckFailed(
                    f"{name} partition: rank {rank} called {names or 'no collective'}; the plan "
                    "takes one all_to_all_single of counts and one of ids, nothing else",
                    expected=["all_to_all_single", "all_to_all_single"], got=names,
                    hint="A rank cannot see the others' edges: it asks each rank for the ids it "
                         "needs. One exchange of counts tells every rank how many ids to expect, "
                         "one exchange of ids tells it which.")
            counts, ids = ops[0][2], ops[1][2]
            if counts > PLAN_RANKS * 8 or ids > asked * 8:
                raise CheckFailed(
                    f"{name} partition: rank {rank} sent {counts} + {ids} bytes; a count per rank "
                    f"is at most {PLAN_RANKS * 8} bytes and the ids it asks for {asked * 8}: "
                    "anything more is the graph's edges, not a request",
                    expected=f"<= {PLAN_RANKS * 8} and <= {asked * 8} bytes", got=[counts, ids])


PLAN = task(
    "11.2",
    # forbids nothing: no library builds a halo plan from one rank's edges; the recorder case
    # below rejects every collective but the two exchanges the plan needs.
    hint="A halo plan from local knowledge only: this rank's remote sources, grouped by the rank "
         "that owns them, are what it receives; what it sends it learns by asking, because "
         "only the other ranks know which of its nodes their edges need.",
    recipe="Take the distinct sources of this rank's edges whose owner (part) is another rank; "
           "group them by owner, each group sorted ascending: that is recv. Count the ids meant "
           "for each rank, exchange the counts with one all_to_all_single, then exchange the ids "
           "themselves with a second one, using the counts as the split sizes in both "
           "directions. What arrives from rank s is send[s].",
)
PLANS = PLAN.shared(_plans_on_rank, world_size=PLAN_RANKS, timeout=30.0)
PLAN.case("random partition: recv and send equal the brute-force plan", uses=PLANS,
          compare=_compare_plans(("random",)), expect="brute_force_plans")
PLAN.case("METIS partition: recv and send equal the brute-force plan", uses=PLANS,
          compare=_compare_plans(("METIS",)), expect="brute_force_plans")
PLAN.case("an empty part, a rank with no halo, all nodes on one rank", uses=PLANS,
          compare=_compare_plans(("an empty part (rank 2)", "a rank with no halo (rank 3)",
                                  "all nodes on rank 0")), expect="brute_force_plans",
          hint="Every rank takes part in both exchanges even when it owns nothing or needs "
               "nothing: its counts are zeros and its tensors empty.",
          recipe="Build the counts with a length of world_size (bincount's minlength), so empty "
                 "groups are zeros, and call both exchanges on every rank whatever it holds.")
PLAN.case("the plans agree: rank r's send[s] is rank s's recv[r]; nothing for the rank itself",
          uses=PLANS, compare=_compare_agree)
# the saving the plan exists for: no rank sees the others' edges, so it weighs half the task
PLAN.case("one exchange of counts and one of ids (all_to_all_single), no gather of edges",
          uses=PLANS, compare=_compare_pattern, weight=4, saving=True)


# --------------------------------------------------------------------------- task 11.3

CONV_IN, CONV_OUT = 24, 8  # in > out: exchanging lin's outputs, not its inputs, is cheaper
CONV_PARTS = {2: [230, 370], 4: [3820, 60, 60, 60]}
ROW_BOUND = 2 * (CONV_IN + CONV_OUT + 1) * 8  # bytes per local row, forward and backward


def conv_graph(seed: int, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(edge_index, ring order): an undirected ring through the nodes in a random order, plus
    num_nodes / 4 random chords; no self-loops. Parts are arcs of the ring, so ids of one part
    are scattered (a rank's nodes are not a contiguous range)."""
    from kit.lessons.graphs import _symmetric_simple

    g = torch.Generator().manual_seed(seed + 51)
    order = torch.randperm(num_nodes, generator=g)
    ring = torch.stack([order, order.roll(-1)])
    chords = torch.randint(0, num_nodes, (2, num_nodes // 4), generator=g)
    return _symmetric_simple(torch.cat([ring, chords], 1), num_nodes), order


def conv_setup(seed: int, world_size: int) -> dict[str, torch.Tensor]:
    """The graph, its partition, features, weights and upstream gradient of a 11.3 run."""
    sizes = CONV_PARTS[world_size]
    n = sum(sizes)
    edge_index, order = conv_graph(seed, n)
    part = torch.empty(n, dtype=torch.long)
    part[order] = torch.repeat_interleave(torch.arange(world_size), torch.tensor(sizes))
    g = torch.Generator().manual_seed(seed + 53)
    return {"edge_index": edge_index, "part": part,
            "x": torch.randn(n, CONV_IN, generator=g, dtype=torch.float64),
            "weight": 0.3 * torch.randn(CONV_OUT, CONV_IN, generator=g, dtype=torch.float64),
            "bias": 0.5 * torch.randn(CONV_OUT, generator=g, dtype=torch.float64),
            "grad": torch.randn(n, CONV_OUT, generator=g, dtype=torch.float64)}


def full_graph_plan(edge_index: torch.Tensor, part: torch.Tensor, rank: int,
                    world_size: int) -> Any:
    """The halo plan read off the whole graph (the run has it; the task's ranks do not)."""
    from kit.lessons.graphs import HaloPlan

    def needs(r: int, s: int) -> torch.Tensor:
        into = (part[edge_index[1]] == r) & (part[edge_index[0]] == s) if r != s else None
        if into is None:
            return torch.empty(0, dtype=torch.long)
        return torch.unique(edge_index[0][into])

    return HaloPlan([needs(rank, s) for s in range(world_size)],
                    [needs(s, rank) for s in range(world_size)])


def _conv_on_rank(conv_cls: Any, seed: int) -> dict[str, Any]:
    import torch.distributed as dist

    from kit import meter
    from kit.trace import trace

    rank, world_size = dist.get_rank(), dist.get_world_size()
    setup = conv_setup(seed, world_size)
    local = local_graph(setup["edge_index"], setup["part"], rank)
    plan = full_graph_plan(setup["edge_index"], setup["part"], rank, world_size)
    conv = conv_cls(CONV_IN, CONV_OUT).double()
    with torch.no_grad():
        conv.lin.weight.copy_(setup["weight"])
        conv.bias.copy_(setup["bias"])
    x = setup["x"][local.own].clone().requires_grad_(True)
    grad = setup["grad"][local.own].clone()
    with meter.track() as usage:
        with trace() as forward:
            out = conv(x, plan, local)
        with trace() as backward:
            out.backward(grad)
    sent = sum(len(t) for t in plan.send)
    received = sum(len(t) for t in plan.recv)
    rows = 2 * local.own.numel() + received + local.edge_index.shape[1]  # own, halo, edges, loops
    return {"out": plain(out), "x.grad": plain(x.grad),
            "lin.weight.grad": plain(conv.lin.weight.grad), "bias.grad": plain(conv.bias.grad),
            "forward": [(e.op, e.kind, e.nbytes) for e in forward.events],
            "backward": [(e.op, e.kind, e.nbytes) for e in backward.events],
            "sent": sent, "received": received, "rows": rows,
            "measured": usage.peak / rows, "peak": usage.peak}


CONV_RUNS = {}


def _both(impl: Any, seed: int) -> dict[int, Any]:
    return {ws: CONV_RUNS[ws](impl, seed) for ws in CONV_PARTS}


FORWARD_WRONG = "the forward differs"  # the gradients of a wrong forward differ for that reason


def _forward_wrong(ranks: list[Any], expected_out: list[torch.Tensor]) -> bool:
    """Whether some rank's out differs from GCNConv's: then a gradient differs because of it."""
    return any(not isinstance(r, dict) or tensor_mismatch(
        r.get("out"), want, rtol=1e-9, atol=1e-10) is not None
        for r, want in zip(ranks, expected_out))


def _grad_cause(ranks: list[Any], expected: dict[str, Any]) -> str:
    """The cause of a gradient that differs: the forward, when it differs too; else the input's
    gradient (the halo rows' gradients that did not go home), which lin's then follows."""
    if _forward_wrong(ranks, expected["out"]):
        return FORWARD_WRONG
    if _forward_wrong([{"out": r.get("x.grad")} if isinstance(r, dict) else r for r in ranks],
                      expected["x.grad"]):
        return HALO_GRADIENT
    return ""


HALO_GRADIENT = "x.grad differs"


def _compare_values(field: str, summed: bool = False) -> Any:
    def compare(got: Any, expected: dict[int, Any]) -> None:
        for ws in CONV_PARTS:
            ranks = per_rank(got[ws], ws)
            what = f"{ws} ranks (parts of {CONV_PARTS[ws]} nodes)"
            if summed:
                values = [r[field] for r in ranks]
                if not all(isinstance(v, torch.Tensor) for v in values):
                    raise CheckFailed(f"{what}: {field} is missing on some rank",
                                      got=[describe(v, 40) for v in values])
                problem = tensor_mismatch(torch.stack(values).sum(0), expected[ws][field],
                                          rtol=1e-9, atol=1e-10)
                if problem:
                    raise CheckFailed(f"{what}: {field}, summed over ranks, {problem}, against "
                                      "GCNConv on the whole graph with the same weights",
                                      expected=describe(expected[ws][field]),
                                      cause=_grad_cause(ranks, expected[ws]))
                continue
            for rank, r in enumerate(ranks):
                problem = tensor_mismatch(r[field], expected[ws][field][rank], rtol=1e-9,
                                          atol=1e-10)
                if problem:
                    raise CheckFailed(f"{what}: rank {rank}'s {field} {problem}, against GCNConv "
                                      "on the whole graph with the same weights",
                                      expected=describe(expected[ws][field][rank]),
                                      got=describe(r[field]),
                                      cause=FORWARD_WRONG if field == "out" else
                                      _grad_cause(ranks, expected[ws]))
    return compare


def _compare_ops(got: Any, expected: None) -> None:
    for ws in CONV_PARTS:
        for rank, r in enumerate(per_rank(got[ws], ws)):
            for phase in ("forward", "backward"):
                other = sorted({op for op, _, _ in r[phase] if op != "all_to_all_single"})
                if other:
                    raise CheckFailed(
                        f"{ws} ranks: rank {rank}'s {phase} called {other}: the halo travels in "
                        "all_to_all_single exchanges only, each rank sending each other rank "
                        "the rows it asked for", expected=["all_to_all_single"], got=other,
                        hint="A gather (all_gather, broadcast, all_reduce of a full matrix) moves "
                             "every rank's rows to every rank: N rows instead of the halo.")
            if r["sent"] and not any(op == "all_to_all_single" for op, _, _ in r["forward"]):
                raise CheckFailed(f"{ws} ranks: rank {rank} must send {r['sent']} rows in forward "
                                  "but made no exchange", expected="an all_to_all_single",
                                  got="no collective")
            if r["received"] and not any(op == "all_to_all_single" for op, _, _ in r["backward"]):
                raise CheckFailed(
                    f"{ws} ranks: rank {rank}'s backward made no exchange: the gradient of each "
                    "halo row must travel back to the rank that owns it (the mirror of forward)",
                    expected="an all_to_all_single in backward", got="none",
                    hint="The exchange is part of the autograd graph: its backward is the same "
                         "exchange with the split sizes swapped, sending gradients home.")


def _compare_bytes(got: Any, expected: None) -> None:
    for ws in CONV_PARTS:
        for rank, r in enumerate(per_rank(got[ws], ws)):
            for phase, rows in (("forward", r["sent"]), ("backward", r["received"])):
                total = sum(b for op, _, b in r[phase] if op == "all_to_all_single")
                limit = rows * (CONV_OUT + 1) * 8
                if total > limit:
                    raise CheckFailed(
                        f"{ws} ranks: rank {rank}'s {phase} exchanges sent {total:,} bytes; its "
                        f"{rows} halo rows after lin are {rows} x (out_channels + 1) x 8 = "
                        f"{limit:,}", expected=f"<= {limit:,} bytes", got=f"{total:,} bytes",
                        hint="Exchange the features after lin (out_channels wide, as GCNConv "
                             "propagates them) plus one degree column, only the rows each rank "
                             "asked for: not the inputs, not every row.")


HALO_CONV = task(
    "11.3",
    # GCN's normalisation and propagation wherever PyG has them (the layer, its norm, the dense
    # layer, the transform that normalises a graph), and every collective that gathers rows
    forbidden=("torch_geometric.nn.GCNConv", "torch_geometric.nn.conv.gcn_conv.gcn_norm",
               "torch_geometric.nn.DenseGCNConv", "torch_geometric.transforms.GCNNorm",
               "torch.distributed.all_gather", "torch.distributed.all_gather_into_tensor",
               "torch.distributed.all_gather_object", "torch.distributed.gather",
               "torch.distributed.gather_object", "torch.distributed.broadcast",
               "torch.distributed.broadcast_object_list", "torch.distributed.all_reduce",
               "torch.distributed._functional_collectives.all_gather_tensor",
               "torch.distributed.nn.functional.all_gather"),
    hint="One GCN layer over a partitioned graph: transform the own rows with lin, exchange only "
         "the halo rows (and their degrees, which only their owners know) with all_to_all_single, "
         "then aggregate with GCN's symmetric normalisation, self-loops included; the exchange's "
         "backward sends the halo gradients home.",
    recipe="Degree of an own node: its in-edges here plus one (the self-loop). Apply lin to the "
           "own rows; gather the rows each rank asked for (plan.send) with their inverse square "
           "root degrees as one extra column, and exchange them with an autograd-aware "
           "all_to_all_single whose split sizes are the plan's lengths (its backward: the same "
           "exchange with the sizes swapped). Stack own and received rows into one table, find "
           "each edge's source row in it by global id, add a self-loop per own node, weight each "
           "message by the product of its two inverse square root degrees, sum into the targets "
           "with index_add, and add the bias.",
)
for _ws in CONV_PARTS:
    CONV_RUNS[_ws] = HALO_CONV.shared(_conv_on_rank, world_size=_ws, timeout=40.0)
HALO_CONV.case("forward equals GCNConv on the whole graph (2 and 4 ranks, uneven parts)",
               compare=_compare_values("out"), expect="gcn_conv_on_full_graph")(_both)
HALO_CONV.case("the gradient of x_local equals GCNConv's (2 and 4 ranks)",
               compare=_compare_values("x.grad"), expect="gcn_conv_on_full_graph",
               hint="The gradient of a halo row belongs to the rank that owns the row: the "
                    "exchange must be part of the autograd graph, with a backward that sends "
                    "each halo row's gradient home and adds it there.",
               recipe="Wrap the exchange in a torch.autograd.Function (or use an autograd-aware "
                      "all_to_all_single) whose backward exchanges the incoming gradient with "
                      "the split sizes swapped; do not detach the received features.")(_both)
HALO_CONV.case("the weight gradients, summed over ranks, equal GCNConv's (2 and 4 ranks)",
               compare=_compare_values("lin.weight.grad", summed=True),
               expect="gcn_conv_on_full_graph")(_both)
HALO_CONV.case("forward and backward exchange with all_to_all_single only",
               compare=_compare_ops)(_both)
HALO_CONV.case("the exchanged rows are lin's outputs: at most the rows sent x (out_channels + 1) "
               "x 8 bytes each way", compare=_compare_bytes, weight=2, saving=True,
               recipe="Apply lin before the exchange, send only the rows plan.send names (one "
                      "block per rank, in plan order), and carry each row's degree as one "
                      "extra column of the same exchange, or send the degrees once and keep "
                      "them.")(_both)
HALO_CONV.bound("bytes held per local row (own + halo + edges + self-loops), forward and "
                "backward, 4 ranks", formula=f"2 x (in + out + 1) x 8 = {ROW_BOUND} bytes a row",
                lost="a rank holds rows for nodes it neither owns nor receives (a table of all N "
                     "nodes, or every rank's features)",
                hint="Partition parallelism saves memory only if no rank builds anything the size "
                     "of the whole graph: its tables index its own rows and its halo, never all "
                     "N global ids.",
                recipe="Index a table of own rows followed by halo rows: find each global id's "
                       "row by searching the sorted ids (searchsorted) instead of allocating an "
                       "array over all N nodes.",
                expect=lambda seed: {"bound": float(ROW_BOUND)}, uses=CONV_RUNS[4], weight=2,
                pick=lambda ranks: {"measured": [r["measured"] for r in ranks]
                                    if isinstance(ranks, list) else ranks})


# --------------------------------------------------------------------------- task 11.4

FETCH_RANKS, FETCH_NODES, FETCH_DIM = 3, 600, 8  # rows far wider than an id: a gather shows
FETCH_SCENES = ("float32", "a cache", "a rank that asks nothing, a rank that owns nothing",
                "bfloat16")


def fetch_setup(seed: int, scene: str, world_size: int = FETCH_RANKS) -> dict[str, Any]:
    """One 11.4 run: the whole feature matrix, its partition, each rank's ids (about 16
    distinct ones, drawn with repeats) and each rank's cached ids (half of the remote ones it
    asks for, and as many it does not)."""
    g = torch.Generator().manual_seed(seed + 61 + FETCH_SCENES.index(scene))
    x = torch.randn(FETCH_NODES, FETCH_DIM, generator=g)
    if scene == "bfloat16":
        x = x.bfloat16()
    part = torch.randint(0, world_size, (FETCH_NODES,), generator=g)
    if scene.startswith("a rank that"):
        part = part % 2  # rank 2 owns nothing
    needed, cached = [], []
    for rank in range(world_size):
        pool = torch.randperm(FETCH_NODES, generator=g)[:16]
        ids = pool[torch.randint(0, 16, (28,), generator=g)]  # repeats, local ids among them
        if scene.startswith("a rank that") and rank == 1:
            ids = ids[:0]
        needed.append(ids)
        remote = torch.unique(ids[part[ids] != rank])
        others = (part != rank).nonzero().flatten()
        extra = others[torch.randperm(others.numel(), generator=g)[:remote.numel() // 2 + 1]]
        keep = torch.unique(torch.cat([remote[::2], extra])) if scene == "a cache" else remote[:0]
        cached.append(keep)
    return {"x": x, "part": part, "needed": needed, "cached": cached}


def _fetch_on_rank(fetch_features: Any, seed: int) -> dict[str, Any]:
    import torch.distributed as dist

    from kit.lessons.graphs import FeatureCache
    from kit.trace import trace

    def inputs(scene: str) -> tuple[Any, ...]:  # this rank's inputs only: the whole matrix
        setup = fetch_setup(seed, scene, world_size)  # stays out of the caller's frame
        x, part, ids = setup["x"], setup["part"], setup["cached"][rank]
        cache = FeatureCache(ids, x[ids].clone()) if scene == "a cache" else None
        return setup["needed"][rank].clone(), part.clone(), x[part == rank].clone(), cache

    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for scene in FETCH_SCENES if world_size > 1 else ("float32",):
        args = inputs(scene)
        with trace() as t:
            rows = fetch_features(*args)
        del args
        out[scene] = {"rows": plain(rows), "ops": [(e.op, e.kind, e.nbytes) for e in t.events]}
    return out


def _compare_rows(scenes: tuple[str, ...]) -> Any:
    def compare(got: Any, expected: dict[str, Any]) -> None:
        for scene in scenes:
            for rank, (r, want) in enumerate(zip(per_rank(got, len(expected[scene]["rows"])),
                                                 expected[scene]["rows"])):
                rows, needed = r[scene]["rows"], expected[scene]["needed"][rank]
                problem = tensor_mismatch(rows, want, rtol=0, atol=0, dtype=True)
                if problem is None:
                    continue
                hint = ""
                if isinstance(rows, torch.Tensor) and rows.shape == want.shape and torch.equal(
                        rows.float().sort(0).values, want.float().sort(0).values):
                    hint = ("The right rows in another order: row i must be the features of "
                            "needed[i], repeats and all, whatever order they arrived in.")
                raise CheckFailed(f"{scene}: rank {rank}'s rows for {needed.numel()} ids "
                                  f"{problem}, against x[needed] of the whole matrix",
                                  expected=describe(want), got=describe(rows), hint=hint,
                                  cause="rows wrong")
    return compare


def _compare_fetch_bytes(got: Any, expected: dict[str, Any]) -> None:
    for scene in FETCH_SCENES:
        for rank, r in enumerate(per_rank(got, FETCH_RANKS)):
            sent = sum(b for op, _, b in r[scene]["ops"] if op != "recv")  # what leaves
            want = expected[scene]["bytes"][rank]
            if sent < want["rows_bytes"]:
                raise CheckFailed(
                    f"{scene}: rank {rank} sent {sent:,} bytes, fewer than the {want['rows']} rows "
                    f"the others lack of it ({want['rows_bytes']:,} bytes): those rows live only "
                    "here, so they must leave this rank", expected=f">= {want['rows_bytes']:,} "
                    "bytes", got=f"{sent:,} bytes",
                    hint="Each rank's rows exist only on that rank: the rows another rank asks "
                         "for must travel from here to there, through a collective.")
            if sent > want["total"]:
                names = sorted({op for op, _, _ in r[scene]["ops"]})
                gathered = any(op.startswith(("all_gather", "broadcast", "gather"))
                               for op in names)
                raise CheckFailed(
                    f"{scene}: rank {rank} sent {sent:,} bytes ({', '.join(names)}); a count per "
                    f"rank ({want['counts']} bytes), the {want['asks']} distinct ids it lacks "
                    f"({want['asks'] * 8} bytes) and the {want['rows']} rows the others lack of "
                    f"it ({want['rows_bytes']:,} bytes) are {want['total']:,}",
                    expected=f"<= {want['total']:,} bytes", got=f"{sent:,} bytes",
                    hint="Every rank's rows went to every rank: a gather moves the whole matrix, "
                         "not a batch's missing rows." if gathered else
                         "More than each missing row once: ask only for ids that are neither "
                         "this rank's own nor in its cache, each distinct id once, and send "
                         "only the rows asked of you.")


def _compare_alone(got: Any, expected: dict[str, Any]) -> None:
    ops = per_rank(got, 1)[0]["float32"]["ops"]
    if ops:
        raise CheckFailed(f"world size 1: fetch_features called {[op for op, _, _ in ops]}; every "
                          "row is this rank's own, so there is nothing to exchange",
                          expected="no collective", got=[op for op, _, _ in ops],
                          hint="With one rank every id is owned here: return the local rows "
                               "without any collective.")
    _compare_rows(("float32",))(got, expected)


FETCH = task(
    "11.4",
    # the distributed feature store PyG had (LocalFeatureStore, DistNeighborLoader over RPC)
    forbidden=("torch_geometric.distributed",),
    hint="A batch's rows live on their owners: look up the rows this rank owns and those its "
         "cache holds, ask each owner for the rest (each distinct id once, counts first), send "
         "the rows others ask of you, and put every row back where its id was asked.",
    recipe="Take the distinct ids with the index that maps them back to the request. Rows owned "
           "here come from x_local, found by searching the sorted ids this rank owns; rows in "
           "the cache from its rows, found the same way in its ids. Group the rest by owner, "
           "exchange their counts with one all_to_all_single, the ids with a second (counts as "
           "split sizes), and answer with a third carrying the rows asked of you, the split "
           "sizes swapped. Fill the distinct rows, then expand them to the request's order. On "
           "a world of one rank return before any exchange.",
)
FETCHES = FETCH.shared(_fetch_on_rank, world_size=FETCH_RANKS, timeout=30.0)
FETCH_ALONE = FETCH.shared(_fetch_on_rank, world_size=1, timeout=30.0)
FETCH.case("the rows equal x[needed], in the order asked (repeats and local ids, 3 ranks)",
           uses=FETCHES, compare=_compare_rows(("float32",)), expect="rows_of_whole_matrix")
FETCH.case("with a cache: the rows still equal x[needed]", uses=FETCHES,
           compare=_compare_rows(("a cache",)), expect="rows_of_whole_matrix")
FETCH.case("a rank that asks for nothing, a rank that owns nothing", uses=FETCHES,
           compare=_compare_rows((FETCH_SCENES[2],)), expect="rows_of_whole_matrix",
           hint="Every rank takes part in every exchange, even with nothing to ask or to give: "
                "its counts are zeros and its tensors empty, (0, F) rows included.",
           recipe="Build the counts with a length of world_size (bincount's minlength) and call "
                  "all three exchanges on every rank whatever it holds or needs.")
FETCH.case("bfloat16 features: bfloat16 rows, bit for bit", uses=FETCHES,
           compare=_compare_rows(("bfloat16",)), expect="rows_of_whole_matrix",
           hint="Rows are copied, never computed: keep x_local's dtype for every buffer.")
FETCH.case("world size 1: the rows, and no collective", uses=FETCH_ALONE,
           compare=_compare_alone, expect="rows_of_whole_matrix_alone")
# the saving the task exists for: only the missing rows travel, so it weighs half the task
FETCH.case("each rank sends its counts, the ids it lacks and the rows others lack of it, each "
           "once: not local, cached or repeated rows, not the whole matrix", uses=FETCHES,
           compare=_compare_fetch_bytes, expect="rows_of_whole_matrix", weight=5, saving=True)
