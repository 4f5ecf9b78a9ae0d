"""Seeded bugs for Lesson 13: the typical mistakes each check of tasks 13.1-13.3 must catch.

``BUGS[task_id]`` lists ``(what is wrong, implementation)``; tests/test_checks.py proves every one
fails its task's checks. Each bug is a correct implementation with one step replaced, written as
a student would write it, plus the cheats the checks must stop: the grader's own route, an
all-gather of every token, and a copy of every expert on every rank. The 13.3 bugs use the
lesson's own (correct) ``route`` and ``AllToAll``, loaded from the solutions as a student's
notebook provides them.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from bugs import edited_entry, edited_solution, solution_demo

SOLUTION = edited_solution(13)
route = SOLUTION.route  # the 13.3 bugs route correctly: each breaks the layer, not the router
AllToAll = SOLUTION.AllToAll
_route = partial(edited_entry, 13, "route")
_loss = partial(edited_entry, 13, "load_balancing_loss")
_moe = partial(edited_entry, 13, "ExpertParallelMoE")
_grouped = partial(edited_entry, 13, "grouped_experts")

_TOKEN_ORDER = (("order = expert.t().reshape(-1)  # (k * T,)", "order = expert.reshape(-1)"),
                ("position = position.view(k, num_tokens).t()",
                 "position = position.view(num_tokens, k)"))
_SORT = "    top, expert = probs.sort(dim=-1, descending=True, stable=True)\n"
_WEIGHT = "weight = top if k == 1 else top / top.sum(dim=-1, keepdim=True)"
_F = "f = torch.bincount(choices, minlength=num_experts).to(logits.dtype) / choices.numel()"
_P = "    P = logits.softmax(dim=-1).mean(dim=0)  # (E,)\n"
_KEPT = ("        token, _ = torch.nonzero(routing.kept, as_tuple=True)\n"
         "        expert, slot = routing.expert[routing.kept], routing.slot[routing.kept]\n"
         "        weight = routing.weight[routing.kept]\n")
_SENT = ("        token, _ = torch.nonzero(sent, as_tuple=True)\n"
         "        expert, slot = routing.expert[sent], routing.slot[sent]\n")
_ORDER = ("order = torch.argsort(expert * max(cap, 1) + slot)",
          "order = torch.argsort(expert, stable=True)")  # dropped choices have no slot
_PLAIN = ("    def _plain(rows, output_splits, input_splits, group):  # no autograd.Function\n"
          "        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))\n"
          "        dist.all_to_all_single(out, rows.detach().contiguous(), output_splits,\n"
          "                               input_splits, group=group)\n"
          "        return out\n\n"
          "    def forward(self, x: torch.Tensor) -> torch.Tensor:\n")

# --------------------------------------------------------------------------- task 13.1


def route_from_the_grader(logits, k, capacity):
    import importlib

    return importlib.import_module("autograder.references.lesson13").route(logits, k, capacity)


# --------------------------------------------------------------------------- task 13.2


def loss_from_the_grader(logits, routing, num_experts):
    from autograder.references.lesson13 import load_balancing_loss

    return load_balancing_loss(logits, routing, num_experts)


# --------------------------------------------------------------------------- task 13.3


class MoEFixedSplit(SOLUTION.ExpertParallelMoE):
    """No count exchange: every rank sends `capacity` rows per expert, padded with zeros, with
    even splits, assuming every rank has the same capacity."""

    def forward(self, x):
        T, d = x.shape
        W, n_local, E = self.world_size, self.num_local, self.num_experts
        cap = math.ceil(self.k * T * self.capacity_factor / E)
        routing = route(self.router(x), self.k, cap)
        token, choice = torch.nonzero(routing.kept, as_tuple=True)
        expert, slot = routing.expert[token, choice], routing.slot[token, choice]
        position = expert * cap + slot  # [destination rank][local expert][slot]
        send = torch.zeros(E * cap, d, dtype=x.dtype).index_copy(0, position, x[token])
        splits = [n_local * cap] * W
        received = AllToAll.apply(send, splits, splits, self.group)
        blocks = received.view(W, n_local, cap, d)
        results = torch.stack([module(blocks[:, i]) for i, module in enumerate(self.experts)], 1)
        returned = AllToAll.apply(results.reshape(-1, d), splits, splits, self.group)
        weight = routing.weight[token, choice]
        return torch.zeros_like(x).index_add(0, token, weight[:, None] * returned[position])


class MoEReducesRouterGrads(SOLUTION.ExpertParallelMoE):
    """All-reduces the router's gradient itself (the caller then all-reduces it again)."""

    def __init__(self, router, experts_local, k, capacity_factor, group=None):
        super().__init__(router, experts_local, k, capacity_factor, group)
        for p in router.parameters():
            p.register_hook(lambda g: _summed(g, group))


def _summed(grad, group):
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


class MoEAllGathersTokens(SOLUTION.ExpertParallelMoE):
    """Gathers every rank's tokens everywhere, computes its experts on all of them and sums."""

    def forward(self, x):
        sizes = [None] * self.world_size
        dist.all_gather_object(sizes, x.shape[0], group=self.group)
        return super().forward(x)


class MoESendsEveryTokenEverywhere(SOLUTION.ExpertParallelMoE):
    """An all-gather by another name: every rank's tokens go to every rank through the
    all-to-alls; each rank routes them all and sends back its experts' share of every output."""

    def forward(self, x):
        T, d = x.shape
        W, n_local, E = self.world_size, self.num_local, self.num_experts
        rank = dist.get_rank(self.group)
        sizes = torch.full((W,), T, dtype=torch.int64)
        theirs = torch.empty_like(sizes)
        dist.all_to_all_single(theirs, sizes, group=self.group)  # every rank's token count
        theirs = theirs.tolist()
        everything = AllToAll.apply(x.repeat(W, 1), theirs, [T] * W, self.group)
        shares = []
        for xs in everything.split(theirs):
            cap = math.ceil(self.k * xs.shape[0] * self.capacity_factor / E)
            routing = route(self.router(xs), self.k, cap)
            share = torch.zeros_like(xs)
            for i, module in enumerate(self.experts):
                hit = (routing.expert == rank * n_local + i) & routing.kept
                token, choice = torch.nonzero(hit, as_tuple=True)
                if token.numel():
                    share = share.index_add(0, token,
                                            routing.weight[token, choice, None] * module(xs[token]))
            shares.append(share)
        back = AllToAll.apply(torch.cat(shares), [T] * W, theirs, self.group)
        return back.view(W, T, d).sum(dim=0)


class MoEGathersThroughTheGroup(SOLUTION.ExpertParallelMoE):
    """Gathers the token counts with the process group's own all-gather method (forbidden on
    every route, not only as dist.all_gather)."""

    def forward(self, x):
        group = self.group if self.group is not None else dist.group.WORLD
        counts = torch.tensor([x.shape[0]])
        everyone = torch.empty(self.world_size, dtype=counts.dtype)
        group._allgather_base(everyone, counts).wait()
        return super().forward(x)


class MoECopiesEveryExpert(solution_demo(13, "MoELayer")):
    """Every rank broadcasts its experts to all: each holds all E and computes its own tokens
    with the lesson's single-process layer."""

    def __init__(self, router, experts_local, k, capacity_factor, group=None):
        W, rank = dist.get_world_size(group), dist.get_rank(group)
        n_local = len(experts_local)
        experts = []
        for owner in range(W):
            for i in range(n_local):
                module = experts_local[i] if owner == rank else _copy_of(experts_local[0])
                with torch.no_grad():
                    for p in module.parameters():
                        dist.broadcast(p, src=dist.get_global_rank(group, owner)
                                       if group is not None else owner, group=group)
                experts.append(module)
        super().__init__(router, nn.ModuleList(experts), k, capacity_factor)


def _copy_of(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)


# --------------------------------------------------------------------------- task 13.4

_HIDDEN = "hidden = F.gelu(F.grouped_mm(x[token], w1, offs=offsets) + b1[sorted_expert])"
_ROWS = "rows = F.grouped_mm(hidden, w2, offs=offsets) + b2[sorted_expert]"
_WEIGHTED = "    rows = rows * weight.reshape(-1)[order, None]\n"


def grouped_with_a_capacity(x, expert, weight, w1, b1, w2, b2):
    """The capacity layer's answer: slots in priority order (every first choice, then every
    second ...), ceil(1.25 k T / E) per expert, the rest dropped (weight 0)."""
    expert = torch.as_tensor(expert)
    T, k = expert.shape
    E = len(w1)
    cap = math.ceil(1.25 * k * T / E)
    seen = nn.functional.one_hot(expert.t().reshape(-1), E).cumsum(0)  # (k T, E), choice-major
    position = seen.gather(1, expert.t().reshape(-1, 1)).view(k, T).t() - 1
    weight = torch.where(position < cap, torch.as_tensor(weight), 0.0)
    return SOLUTION.grouped_experts(x, expert, weight, w1, b1, w2, b2)


def grouped_padded_bmm(x, expert, weight, w1, b1, w2, b2):
    """A right answer by the other route: the groups padded to the busiest expert, one
    torch.bmm per layer over the (E, max rows, d) buffer."""
    expert, weight = torch.as_tensor(expert), torch.as_tensor(weight, dtype=x.dtype)
    w1, b1, w2, b2 = (p if isinstance(p, torch.Tensor) else torch.stack(list(p))
                      for p in (w1, b1, w2, b2))
    E, k = w1.shape[0], expert.shape[1]
    flat = expert.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    where = torch.arange(len(flat)) - (counts.cumsum(0) - counts)[flat[order]]  # row in group
    padded = x.new_zeros(E, int(counts.max()) if len(flat) else 0, x.shape[1])
    padded = padded.index_put((flat[order], where), x[order // k])
    hidden = nn.functional.gelu(torch.bmm(padded, w1) + b1[:, None])
    out = (torch.bmm(hidden, w2) + b2[:, None])[flat[order], where]
    return torch.zeros_like(x).index_add(0, order // k, out * weight.reshape(-1)[order, None])


BUGS = {
    "13.1": [
        ("gives slots token by token (both choices of token 0, then token 1, ...)",
         _route(*_TOKEN_ORDER)),
        ("counts slots over the flattened (T, k) choices: token by token, vectorised",
         _route(*_TOKEN_ORDER)),
        ("does not renormalise the weights for k = 2", _route((_WEIGHT, "weight = top"))),
        ("renormalises the weight for k = 1 too (every weight 1)",
         _route((_WEIGHT, "weight = top / top.sum(dim=-1, keepdim=True)"))),
        ("keeps one capacity counter for all experts", _route((
            "position = seen.gather(1, order[:, None]).squeeze(1) - 1",
            "position = torch.arange(len(order))  # one counter"))),
        ("breaks ties to the higher expert index", _route((_SORT, (
            "    top, expert = probs.flip(-1).sort(dim=-1, descending=True, stable=True)\n"
            "    expert = num_experts - 1 - expert\n")))),
        ("uses torch.topk as it is (CPU ties in no promised order)", _route((
            _SORT + "    top, expert = top[:, :k], expert[:, :k]",
            "    top, expert = probs.topk(k, dim=-1)"))),
        ("renormalises the kept weights again after dropping", _route((
            "    weight = torch.where(kept, weight, torch.zeros_like(weight))\n",
            "    weight = torch.where(kept, weight, torch.zeros_like(weight))\n"
            "    weight = weight / weight.sum(dim=-1, keepdim=True).clamp_min(1e-12)\n"))),
        ("calls the grader's own route", route_from_the_grader),
    ],
    "13.2": [
        ("takes the gradient through f (a straight-through count)",
         _loss((_P, _P + "    f = f + P - P.detach()  # straight through\n"))),
        ("counts only the kept choices in f", _loss((
            "f = torch.bincount(choices,", "f = torch.bincount(routing.expert[routing.kept],"))),
        ("divides the counts by T instead of T * k",
         _loss((_F, _F.replace("choices.numel()", "routing.expert.shape[0]")))),
        ("detaches P: no gradient reaches the router",
         _loss((_P, _P.replace("logits.softmax", "logits.detach().softmax")))),
        ("uses P for f too (E * sum P_i^2)", _loss((
            "return num_experts * (f * P).sum()", "return num_experts * (P * P).sum()"))),
        ("takes P from the routing weights instead of the softmax", _loss((_P, (
            "    P = torch.zeros(num_experts, dtype=logits.dtype).index_add(\n"
            "        0, choices, routing.weight.reshape(-1)) / routing.expert.shape[0]\n")))),
        ("calls the grader's own load_balancing_loss", loss_from_the_grader),
        ("router_gradient drops the softmax's shared part: (E / T) p f", _loss((
            "return num_experts / logits.shape[0] * p * (f - mean_load)",
            "return num_experts / logits.shape[0] * p * f"))),
        ("router_gradient keeps the Jacobian's diagonal only: (E / T) f p (1 - p)", _loss((
            "return num_experts / logits.shape[0] * p * (f - mean_load)",
            "return num_experts / logits.shape[0] * f * p * (1 - p)"))),
        ("router_gradient divides by the T * k choices instead of the T tokens", _loss((
            "return num_experts / logits.shape[0] *", "return num_experts / choices.numel() *"))),
        ("router_gradient asks autograd (forbidden)", _loss((
            "    logits = logits.detach()\n    choices = routing.expert.reshape(-1)\n",
            "    leaf = logits.detach().requires_grad_()\n"
            "    return torch.autograd.grad(load_balancing_loss(leaf, routing, num_experts), "
            "leaf)[0]\n"))),
        ("router_gradient calls backward on the loss (forbidden)", _loss((
            "    logits = logits.detach()\n    choices = routing.expert.reshape(-1)\n",
            "    leaf = logits.detach().requires_grad_()\n"
            "    load_balancing_loss(leaf, routing, num_experts).backward()\n"
            "    return leaf.grad\n"))),
        ("no tokens: 0 / 0, a nan loss", _loss((
            "    if choices.numel() == 0:  # nothing routed: nothing to balance (f and P would be "
            "0 / 0)\n"
            "        return logits.sum() * 0.0\n", ""))),
    ],
    "13.3": [
        ("skips a local expert that received no row: an idle rank's output has no path to the "
         "combine all-to-all, so its backward skips it (router collapse deadlocks)", _moe((
             "            results = results.index_copy(0, rows, expert_module(received[rows]))",
             "            if rows.numel():\n"
             "                results = results.index_copy(0, rows, "
             "expert_module(received[rows]))",
         ))),
        ("ties an idle rank's output to the received rows only (received * 0): no path to the "
         "combine all-to-all once the input needs no grad", _moe((
             "        results = torch.zeros_like(received)\n",
             "        results = received * 0\n",
         ), (
             "            results = results.index_copy(0, rows, expert_module(received[rows]))",
             "            if rows.numel():\n"
             "                results = results.index_copy(0, rows, "
             "expert_module(received[rows]))",
         ))),
        ("exchanges no counts: a fixed split of capacity rows per expert, padded", MoEFixedSplit),
        ("adds the results in dispatch order instead of the tokens' order", _moe((
            "        token, expert, weight = token[order], expert[order], weight[order]\n",
            "        unsorted_token, unsorted_weight = token, weight\n"
            "        token, expert, weight = token[order], expert[order], weight[order]\n",
        ), ("index_add(0, token, weight[:, None] * returned)",
            "index_add(0, unsorted_token, unsorted_weight[:, None] * returned)"))),
        ("sends and computes the dropped choices too (weighted 0)", _moe((_KEPT, (
            "        sent = torch.ones_like(routing.kept)  # the dropped choices too\n" + _SENT
            + "        weight = routing.weight[sent]\n")), _ORDER)),
        ("sends and computes the dropped choices, weighted by their probability", _moe((
            "routing = route(self.router(x), self.k, cap)",
            "logits = self.router(x)\n        routing = route(logits, self.k, cap)"), (_KEPT,
            "        sent = torch.ones_like(routing.kept)  # the dropped choices too\n" + _SENT
            + "        weight = torch.where(routing.kept, routing.weight,\n"
            "                             logits.softmax(-1).gather(1, routing.expert))[sent]\n"),
            _ORDER)),
        ("computes the capacity from every rank's tokens", _moe((
            "cap = math.ceil(self.k * num_tokens * self.capacity_factor / E)",
            "cap = math.ceil(self.k * num_tokens * W * self.capacity_factor / E)"))),
        ("puts expert e on rank e % W", _moe((
            "        send_counts = torch.bincount(expert, minlength=E)",
            "        expert = (expert % W) * n_local + expert // W  # expert e on rank e % W\n"
            "        order = torch.argsort(expert, stable=True)\n"
            "        token, expert, weight = token[order], expert[order], weight[order]\n"
            "        send_counts = torch.bincount(expert, minlength=E)"))),
        ("dispatches with a plain all_to_all_single: no gradient crosses it", _moe(
            ("    def forward(self, x: torch.Tensor) -> torch.Tensor:\n", _PLAIN),
            ("received = AllToAll.apply(", "received = self._plain("),
            ("returned = AllToAll.apply(", "returned = self._plain("))),
        ("all-reduces the router's gradient itself", MoEReducesRouterGrads),
        ("all-gathers from every rank (forbidden)", MoEAllGathersTokens),
        ("all-gathers through ProcessGroup._allgather_base (forbidden)", MoEGathersThroughTheGroup),
        ("sends every token to every rank through the all-to-alls (an all-gather by another name)",
         MoESendsEveryTokenEverywhere),
        ("copies every expert onto every rank with broadcasts", MoECopiesEveryExpert),
    ],
    "13.4": [
        ("does not sort: the choices stay in token order, cut by the experts' counts", _grouped((
            "order = torch.argsort(choices, stable=True)", "order = torch.arange(len(choices))"))),
        ("takes a sorted row's token as its index mod T (choice-major) though the choices were "
         "flattened token by token", _grouped((
             "token, sorted_expert = order // k,", "token, sorted_expert = order % len(x),"))),
        ("forgets to un-permute: adds the rows in sorted order", _grouped((
            "index_add(0, token, rows)", "index_add(0, torch.arange(len(rows)) // k, rows)"))),
        ("drops the choices past a capacity of 1.25 k T / E, as the capacity layer does",
         grouped_with_a_capacity),
        ("applies the routing weights before the second matrix product (the bias b2 unweighted)",
         _grouped((_WEIGHTED, ""), (_HIDDEN, _HIDDEN + " * weight.reshape(-1)[order, None]"))),
        ("detaches the routing weights: the router would learn nothing", _grouped((
            "weight = torch.as_tensor(weight, dtype=x.dtype, device=x.device)",
            "weight = torch.as_tensor(weight, dtype=x.dtype, device=x.device).detach()"))),
        ("loops over experts: two matrix products per expert", _grouped((_HIDDEN, (
            "counts = torch.bincount(choices, minlength=num_experts).tolist()\n"
            "    hidden = torch.cat([F.gelu(block @ w1[e] + b1[e]) for e, block\n"
            "                        in enumerate(x[token].split(counts))])")), (_ROWS, (
            "rows = torch.cat([block @ w2[e] for e, block in enumerate(hidden.split(counts))])"
            " + b2[sorted_expert]")))),
        ("gathers every choice's expert weights: one bmm per layer over a (T k, d, h) copy",
         _grouped((_HIDDEN, "hidden = F.gelu(torch.einsum('nd,ndh->nh', x[token], "
                            "w1[sorted_expert]) + b1[sorted_expert])"), (_ROWS, (
            "rows = torch.einsum('nh,nhd->nd', hidden, w2[sorted_expert]) "
            "+ b2[sorted_expert]")))),
        ("returns zeros: every choice dropped",
         lambda x, *args: torch.zeros_like(x)),
    ],
}
