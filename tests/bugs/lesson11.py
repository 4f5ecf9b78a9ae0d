"""Seeded bugs for Lesson 11: the typical mistakes (and cheats) each check of tasks 11.1-11.4
must catch.

``BUGS[task_id]`` lists ``(what is wrong, implementation)``. Each bug is a correct
implementation with one step replaced, written as a student would write it.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn

from bugs import edited_solution
from kit.lessons.graphs import HaloPlan, SampledSubgraph

# --------------------------------------------------------------------------- task 11.1


def _sampler(*edits):
    return edited_solution(11, *edits).sample_neighbors


_UPPER = "            upper = deg - take + j\n"
_DISTINCT = "            t = torch.where((picked == t[:, None]).any(1), upper, t)\n"
_EDGES = "        rows.append(local[nbr])\n        cols.append(frontier[owner])\n"


def _out_neighbours(rowptr, col, seeds, fanouts, generator):
    """The solution on the transposed CSR: v's list holds the nodes v points to."""
    n = rowptr.numel() - 1
    dst = torch.arange(n).repeat_interleave(rowptr[1:] - rowptr[:-1])
    out_ptr = torch.zeros(n + 1, dtype=torch.long)
    out_ptr[1:] = torch.cumsum(torch.bincount(col, minlength=n), 0)
    out_col = dst[torch.argsort(col, stable=True)]
    return edited_solution(11).sample_neighbors(out_ptr, out_col, seeds, fanouts, generator)


def pyg_neighbor_sampler(rowptr, col, seeds, fanouts, generator):
    """Uses PyG's own sampler (what the task re-implements)."""
    from torch_geometric.data import Data
    from torch_geometric.sampler import NeighborSampler, NodeSamplerInput

    n = rowptr.numel() - 1
    dst = torch.arange(n).repeat_interleave(rowptr[1:] - rowptr[:-1])
    sampler = NeighborSampler(Data(edge_index=torch.stack([col, dst]), num_nodes=n), fanouts)
    out = sampler.sample_from_nodes(NodeSamplerInput(None, seeds))
    return SampledSubgraph(out.node, torch.stack([out.row, out.col]), out.num_sampled_nodes,
                           out.num_sampled_edges)


# --------------------------------------------------------------------------- task 11.2


def _plan(*edits):
    return edited_solution(11, *edits).halo_plan


_REMOTE = "    remote = torch.unique(src[part[src] != rank])  # sorted and distinct\n"
_PLAN = ("    return HaloPlan(list(remote.split(asking.tolist())), "
         "list(wanted.split(asked.tolist())))\n")
_ASKED = ("    asked = torch.empty_like(asking)\n"
          "    dist.all_to_all_single(asked, asking)  # ids each rank wants from me\n"
          "    wanted = torch.empty(int(asked.sum()), dtype=torch.long)\n"
          "    dist.all_to_all_single(wanted, remote, output_split_sizes=asked.tolist(),\n"
          "                           input_split_sizes=asking.tolist())\n")


def _read_off(full, part, rank, world_size):
    """The plan read off the whole graph's edges ``full``: what each rank needs from each."""
    def needs(r, s):
        into = (part[full[1]] == r) & (part[full[0]] == s)
        return torch.unique(full[0][into]) if r != s else full[0][:0]

    return HaloPlan([needs(rank, s) for s in range(world_size)],
                    [needs(s, rank) for s in range(world_size)])


def gathers_every_rank_edges(part, edge_index, rank):
    """all_gather_object of every rank's edges, then the plan read off the whole graph."""
    world_size = dist.get_world_size()
    everyone = [None] * world_size
    dist.all_gather_object(everyone, edge_index)
    full = torch.cat(everyone, 1)
    return _read_off(full, part, rank, world_size)


def sends_edges_through_all_to_all(part, edge_index, rank):
    """A gather in disguise: two all_to_all_single calls, but the second carries this rank's
    whole edge list to every rank, and each rank reads the plan off the union."""
    world_size = dist.get_world_size()
    counts = torch.full((world_size,), edge_index.numel())
    theirs = torch.empty_like(counts)
    dist.all_to_all_single(theirs, counts)
    everyone = torch.empty(int(theirs.sum()), dtype=torch.long)
    dist.all_to_all_single(everyone, edge_index.reshape(-1).repeat(world_size), theirs.tolist(),
                           counts.tolist())
    full = torch.cat([block.view(2, -1) for block in everyone.split(theirs.tolist())], 1)
    return _read_off(full, part, rank, world_size)


# --------------------------------------------------------------------------- task 11.3


def _conv(*edits):
    return edited_solution(11, *edits).HaloGCNConv


_TABLE = "table = torch.cat([h, received[:, :-1]])"
_EXCHANGE = ("received = HaloExchange.apply(payload, [len(t) for t in plan.recv],\n"
             "                                      [len(t) for t in plan.send])")


def _halo_from(cheat):
    """The solution's HaloGCNConv with its halo rows (features, then 1/sqrt(degree), in
    plan.recv order) got by ``cheat(h, dinv, plan, own, HaloExchange)``, written into the
    notebook beside it, instead of by HaloExchange."""
    defs = "".join(inspect.getsource(f) + "\n\n" for f in (_pick, cheat))
    return _conv(("class HaloGCNConv(nn.Module):", defs + "class HaloGCNConv(nn.Module):"),
                 (_EXCHANGE, f"received = {cheat.__name__}(h, dinv, plan, own, HaloExchange)"))


def _pick(rows, gids, plan):
    """The rows of ``rows`` (global ids ``gids``) in plan.recv order."""
    sort = gids.sort()
    return rows[sort.indices[torch.searchsorted(sort.values, torch.cat(plan.recv))]]


def all_gather_halo(h, dinv, plan, own, exchange):
    """Every rank's transformed rows all-gathered, then the halo rows picked out."""
    n = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([own.numel()]))
    most = int(max(s.item() for s in sizes))
    mine = torch.cat([h, dinv[:, None]], 1)
    padded = torch.cat([mine, mine.new_zeros(most - own.numel(), mine.shape[1])])
    rows = [torch.empty_like(padded) for _ in range(n)]
    ids = [torch.empty(most, dtype=torch.long) for _ in range(n)]
    dist.all_gather(rows, padded.detach())
    dist.all_gather(ids, torch.cat([own, own.new_zeros(most - own.numel())]))
    gids = torch.cat([i[:int(s)] for i, s in zip(ids, sizes)])
    return _pick(torch.cat([r[:int(s)] for r, s in zip(rows, sizes)]), gids, plan)


def every_row_to_every_rank(h, dinv, plan, own, exchange):
    """An all-gather in disguise: all_to_all_single sends every own row to every rank."""
    n = dist.get_world_size()
    counts = torch.tensor([own.numel()] * n)
    theirs = torch.empty_like(counts)
    dist.all_to_all_single(theirs, counts)
    row = torch.cat([h, dinv[:, None], own[:, None].to(h.dtype)], 1)
    rows = exchange.apply(torch.cat([row] * n), theirs.tolist(), counts.tolist())
    return _pick(rows[:, :-1], rows[:, -1].detach().long(), plan)


def point_to_point(h, dinv, plan, own, exchange):
    """The halo exchanged with isend/irecv per peer instead of all_to_all_single (no backward
    exchange either: the received rows are leaves)."""
    me = dist.get_rank()
    payload = torch.cat([h, dinv[:, None]], 1).detach()
    works, inbox = [], []
    for s in range(dist.get_world_size()):
        if s != me:
            box = payload.new_empty(len(plan.recv[s]), payload.shape[1])
            works += [dist.isend(payload[torch.searchsorted(own, plan.send[s])].contiguous(), s),
                      dist.irecv(box, s)]
            inbox.append(box)
    for w in works:
        w.wait()
    return torch.cat(inbox) if inbox else payload[:0]


# a table over all global ids (about N rows), indexed by global id, not the own + halo rows
_GLOBAL_TABLE = _conv((
    "order = torch.argsort(ids)\n        src_row = order[torch.searchsorted(ids[order], src)]\n"
    "        rows_src, rows_dst = torch.cat([src_row, loops]), torch.cat([dst_row, loops])",
    "n = int(torch.cat([ids, src]).max()) + 1  # every global id seen: about N\n"
    "        table = table.new_zeros(n, table.shape[1]).index_copy(0, ids, table)\n"
    "        dinv_all = dinv_all.new_zeros(n).index_copy(0, ids, dinv_all)\n"
    "        rows_src, rows_dst = torch.cat([src, own]), torch.cat([dst_row, loops])"))


class LocalGCNConv(nn.Module):
    """Exchanges the halo inputs, then runs PyG's GCNConv on the local subgraph."""

    def __init__(self, in_channels, out_channels):
        super().__init__()
        from torch_geometric.nn import GCNConv

        self.inner = GCNConv(in_channels, out_channels)
        self.lin, self.bias = self.inner.lin, self.inner.bias

    def forward(self, x_local, plan, local_graph):
        own, edges = local_graph
        sizes = [len(t) for t in plan.recv], [len(t) for t in plan.send]
        rows = x_local[torch.searchsorted(own, torch.cat(plan.send))]
        halo = edited_solution(11).HaloExchange.apply(rows, *sizes)
        order = torch.argsort(ids := torch.cat([own, *plan.recv]))
        local = order[torch.searchsorted(ids[order], edges)]
        return self.inner(torch.cat([x_local, halo]), local)[:own.numel()]


# --------------------------------------------------------------------------- task 11.4


def _fetch(*edits):
    return edited_solution(11, *edits).fetch_features


_UNIQUE = "ids, inverse = torch.unique(needed.long(), return_inverse=True)"
_ALONE = ("    if world_size == 1:  # every row is local: nothing to ask\n"
          "        return rows[inverse]\n")


def all_gather_every_row(needed, part, x_local, cache=None):
    """Every rank's rows all-gathered (padded to the largest part), then indexed."""
    n = dist.get_world_size()
    most = int(torch.bincount(part, minlength=n).max())
    padded = torch.cat([x_local, x_local.new_zeros(most - x_local.shape[0], x_local.shape[1])])
    blocks = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(blocks, padded)
    x = torch.cat([b[:int((part == s).sum())] for s, b in enumerate(blocks)])
    order = torch.argsort(part, stable=True)  # the gathered rows' global ids, part by part
    return x[torch.argsort(order)][needed]


def through_pyg_feature_store(needed, part, x_local, cache=None):
    """PyG's LocalFeatureStore holds this rank's rows; the solution fetches the rest."""
    from torch_geometric.distributed import LocalFeatureStore

    store = LocalFeatureStore()
    own = (part == dist.get_rank()).nonzero().flatten()
    store.put_tensor(x_local, group_name=None, attr_name="x", index=own)
    return edited_solution(11).fetch_features(needed, part, store.get_tensor(None, "x"), cache)



def reads_the_graders_setup(needed, part, x_local, cache=None):
    """No exchange: the whole matrix rebuilt by the grader's own setup, found up the stack."""
    frame = inspect.currentframe().f_back
    while frame is not None and "scene" not in frame.f_locals:
        frame = frame.f_back
    setup = frame.f_globals["fetch_setup"](frame.f_locals["seed"], frame.f_locals["scene"],
                                           dist.get_world_size())
    return setup["x"][needed]


BUGS = {
    "11.1": [
        ("stops at a hop with an empty frontier: fewer hops counted", edited_solution(11, (
            "    for fanout in fanouts:\n        start = rowptr[n_id[frontier]]\n",
            "    for fanout in fanouts:\n        if frontier.numel() == 0:\n"
            "            break\n        start = rowptr[n_id[frontier]]\n",
        )).sample_neighbors),
        ("samples with replacement", _sampler(
            (_UPPER, "            upper = deg - 1  # every draw from all the neighbours\n"),
            (_DISTINCT, ""))),
        ("draws out-neighbours instead of in-neighbours", _out_neighbours),
        ("global ids in edge_index", _sampler((
            _EDGES, "        rows.append(nbr)\n        cols.append(n_id[frontier[owner]])\n"))),
        ("edge_index rows swapped: (node, neighbour)", _sampler((
            _EDGES, "        rows.append(frontier[owner])\n        cols.append(local[nbr])\n"))),
        ("takes the first min(fanout, degree) neighbours", _sampler((
            "picked[:, j] = torch.where(j < take, t, -1)",
            "picked[:, j] = torch.where(j < take, j, -1)"))),
        ("a random window of consecutive neighbours", _sampler(  # a random start, then the next
            (_UPPER, "            upper = deg - 1\n"),
            (_DISTINCT, "            t = t if j == 0 else (picked[:, 0] + j) % "
                        "deg.clamp(min=1)\n"))),
        ("draws from torch's global RNG, not the generator", _sampler((
            "torch.rand(frontier.numel(), generator=generator, dtype=torch.float64)",
            "torch.rand(frontier.numel(), dtype=torch.float64)"))),
        ("expands nodes seen before again", _sampler((
            "        frontier = local[new]\n",
            "        frontier = local[torch.unique(nbr)]  # every node drawn, seen before or "
            "not\n"))),
        ("num_sampled_nodes without the seeds' entry", _sampler((
            "num_sampled_nodes, num_sampled_edges = [n_id.numel()], []",
            "num_sampled_nodes, num_sampled_edges = [], []"))),
        ("new nodes sorted by id, not in draw order", _sampler((
            "        new = uniq[torch.argsort(first)]\n", "        new = uniq  # sorted by id\n"))),
        ("each node's draws in draw order, not col order", _sampler((
            "picked = picked.masked_fill(picked < 0, "
            "torch.iinfo(torch.long).max).sort(dim=1).values",
            "picked = picked  # in draw order"))),
        ("uses PyG's NeighborSampler", pyg_neighbor_sampler),
    ],
    "11.2": [
        ("the halo holds the boundary nodes, not their remote neighbours", _plan((
            _REMOTE, "    remote = torch.unique(edge_index[1][part[src] != rank])  # boundary\n"
                     "    remote = remote[part[remote] != rank]  # asked of their owners: "
                     "none\n"))),
        ("only the first remote neighbour of each boundary node", _plan((
            "    src = edge_index[0]\n",
            "    first = {}\n"
            "    for s, t in edge_index[:, part[edge_index[0]] != rank].t().tolist():\n"
            "        first.setdefault(t, s)  # one remote neighbour per boundary node\n"
            "    src = torch.tensor(sorted(set(first.values())), dtype=torch.long)\n"))),
        ("send and recv swapped", _plan((_PLAN, (
            "    return HaloPlan(list(wanted.split(asked.tolist())), "
            "list(remote.split(asking.tolist())))\n")))),
        ("infers send from its own edges, asks nothing", _plan((_ASKED + _PLAN, (
            "    dst = edge_index[1]  # asks nothing: every edge taken to have its reverse\n"
            "    send = [torch.unique(dst[part[src] == s]) if s != rank else dst[:0]\n"
            "            for s in range(world_size)]\n"
            "    return HaloPlan(list(remote.split(asking.tolist())), send)\n")))),
        ("all_gather_object of every rank's edges", gathers_every_rank_edges),
        ("ids in edge order, not sorted", _plan((_REMOTE, (
            "    remote = torch.tensor(list(dict.fromkeys(src[part[src] != rank].tolist())),\n"
            "                          dtype=torch.long)  # distinct, in edge order\n")))),
        ("every rank's edges sent to every rank through all_to_all_single",
         sends_edges_through_all_to_all),
    ],
    "11.3": [
        ("degrees computed on the local part only", _conv((
            "dinv_all = torch.cat([dinv, received[:, -1].detach()])",
            "partial = (src[None, :] == torch.cat(plan.recv)[:, None]).sum(1).to(h.dtype) + 1\n"
            "        dinv_all = torch.cat([dinv, partial.rsqrt()])  # this rank's edges only"))),
        ("the halo all-gathered", _halo_from(all_gather_halo)),
        ("self-loops forgotten", _conv(
            ("loops = torch.arange(n_own)", "loops = torch.arange(0)"),
            ("minlength=n_own).to(x_local.dtype) + 1  # + the self-loop",
             "minlength=n_own).to(x_local.dtype).clamp_min(1)"))),
        ("exchanges the inputs before lin", _conv(
            ("h = self.lin(x_local)  # (n_own, out): transform first, as GCNConv does",
             "h = x_local  # lin after the exchange"),
            (_TABLE, "table = self.lin(torch.cat([h, received[:, :-1]]))"),
            ("out = h.new_zeros(n_own, h.shape[1])", "out = h.new_zeros(n_own, table.shape[1])"))),
        ("a table over all N global ids", _GLOBAL_TABLE),
        ("received rows detached: no gradient goes home", _conv(
            (_TABLE, "table = torch.cat([h, received[:, :-1].detach()])"))),
        ("bias forgotten", _conv(("        return out + self.bias\n", "        return out\n"))),
        ("all_to_all_single of every row to every rank", _halo_from(every_row_to_every_rank)),
        ("PyG's GCNConv on the local subgraph", LocalGCNConv),
        ("the halo exchanged with isend/irecv", _halo_from(point_to_point)),
    ],    "11.4": [
        ("all-gathers every rank's rows", all_gather_every_row),
        ("fetches a repeated id once per repeat", _fetch((
            _UNIQUE, "ids, inverse = needed.long(), torch.arange(needed.numel())  # as asked"))),
        ("rows sorted by id, not in the order asked", _fetch((
            "    rows[where] = received\n    return rows[inverse]\n",
            "    rows[where] = received\n    return rows[inverse.sort().values]\n"))),
        ("cache hits still fetched", _fetch(("        missing &= ~hit\n", ""))),
        ("asks for its own rows too", _fetch((
            "    missing = ~local\n", "    missing = torch.ones_like(local)  # all asked\n"))),
        ("local rows one place off (searchsorted right=True)", _fetch((
            "rows[local] = x_local[torch.searchsorted(own, ids[local])]",
            "rows[local] = x_local[torch.searchsorted(own, ids[local], right=True)]"))),
        ("exchanges on a world of one rank", _fetch((_ALONE, ""))),
        ("PyG's LocalFeatureStore", through_pyg_feature_store),
        ("rows read from the grader's own setup, nothing sent", reads_the_graders_setup),
    ],
}
