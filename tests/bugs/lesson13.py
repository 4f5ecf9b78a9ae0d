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
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from autograder.loading import load_tasks
from bugs import edited_solution
from kit.lessons.moe import Routing

_lesson = load_tasks(Path(__file__).resolve().parents[2] / "solutions" / "13_mixture_of_experts.py")
route = _lesson.route  # the 13.3 bugs route correctly: each breaks the layer, not the router
AllToAll = _lesson.AllToAll

# --------------------------------------------------------------------------- task 13.1


def _route(logits: torch.Tensor, k: int, capacity: int, *, ties: str = "lower",
           renormalise: bool = True, k1_renormalise: bool = False, priority: str = "choice",
           counter: str = "per expert", after_drop: bool = False) -> Routing:
    """The router with switches: each bug below flips one."""
    T, E = logits.shape
    probs = logits.softmax(dim=-1)
    if ties == "lower":
        top, expert = probs.sort(dim=-1, descending=True, stable=True)
        top, expert = top[:, :k], expert[:, :k]
    elif ties == "higher":  # sort the experts reversed: equal values keep the higher index first
        top, flipped = probs.flip(-1).sort(dim=-1, descending=True, stable=True)
        top, expert = top[:, :k], E - 1 - flipped[:, :k]
    else:  # torch.topk as it is
        top, expert = probs.topk(k, dim=-1)
    if (k > 1 and renormalise) or k1_renormalise:
        weight = top / top.sum(dim=-1, keepdim=True)
    else:
        weight = top
    slot = torch.full((T, k), -1, dtype=torch.int64)
    used = [0] * E
    total = 0
    pairs = ([(t, j) for j in range(k) for t in range(T)] if priority == "choice"
             else [(t, j) for t in range(T) for j in range(k)])
    for t, j in pairs:
        e = int(expert[t, j])
        if counter == "per expert":
            if used[e] < capacity:
                slot[t, j] = used[e]
            used[e] += 1
        else:  # one counter shared by all experts
            if total < capacity:
                slot[t, j] = total
            total += 1
    kept = slot >= 0
    weight = torch.where(kept, weight, torch.zeros_like(weight))
    if after_drop:
        weight = weight / weight.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    return Routing(expert, weight, slot, kept)


def route_token_by_token(logits, k, capacity):
    return _route(logits, k, capacity, priority="token")


def route_not_renormalised(logits, k, capacity):
    return _route(logits, k, capacity, renormalise=False)


def route_one_counter(logits, k, capacity):
    return _route(logits, k, capacity, counter="shared")


def route_ties_higher(logits, k, capacity):
    return _route(logits, k, capacity, ties="higher")


def route_plain_topk(logits, k, capacity):
    return _route(logits, k, capacity, ties="topk")


def route_k1_renormalised(logits, k, capacity):
    return _route(logits, k, capacity, k1_renormalise=True)


def route_renormalised_after_dropping(logits, k, capacity):
    return _route(logits, k, capacity, after_drop=True)


def route_vectorised_without_priority(logits, k, capacity):
    """A vectorised router that counts slots over the flattened (T, k) tensor: token by token."""
    T, E = logits.shape
    probs = logits.softmax(dim=-1)
    top, expert = probs.sort(dim=-1, descending=True, stable=True)
    top, expert = top[:, :k], expert[:, :k]
    weight = top if k == 1 else top / top.sum(dim=-1, keepdim=True)
    flat = expert.reshape(-1)  # token 0's choices, then token 1's: the wrong priority
    position = F.one_hot(flat, E).cumsum(0).gather(1, flat[:, None]).squeeze(1) - 1
    position = position.view(T, k)
    kept = position < capacity
    return Routing(expert, torch.where(kept, weight, torch.zeros_like(weight)),
                   torch.where(kept, position, -1), kept)


def route_from_the_grader(logits, k, capacity):
    import importlib

    return importlib.import_module("autograder.references.lesson13").route(logits, k, capacity)


# --------------------------------------------------------------------------- task 13.2


def _no_tokens_is_zero(loss):
    """As the solution: no tokens gives 0 (so each bug keeps its one defect)."""
    def guarded(logits, routing, num_experts):
        if routing.expert.numel() == 0:
            return logits.sum() * 0.0
        return loss(logits, routing, num_experts)

    guarded.__name__ = guarded.__qualname__ = loss.__name__
    guarded.__doc__ = loss.__doc__
    return guarded


@_no_tokens_is_zero
def loss_straight_through(logits, routing, num_experts):
    """f's value from the counts, its gradient from the probabilities (straight through)."""
    probs = logits.softmax(dim=-1)
    choices = routing.expert.reshape(-1)
    counts = torch.bincount(choices, minlength=num_experts).to(logits.dtype) / choices.numel()
    soft = probs.mean(dim=0)
    f = counts + soft - soft.detach()
    return num_experts * (f * probs.mean(dim=0)).sum()


@_no_tokens_is_zero
def loss_counts_kept_only(logits, routing, num_experts):
    choices = routing.expert[routing.kept]
    f = torch.bincount(choices, minlength=num_experts).to(logits.dtype) / routing.expert.numel()
    return num_experts * (f * logits.softmax(dim=-1).mean(dim=0)).sum()


@_no_tokens_is_zero
def loss_divides_by_tokens(logits, routing, num_experts):
    choices = routing.expert.reshape(-1)
    f = torch.bincount(choices, minlength=num_experts).to(logits.dtype) / routing.expert.shape[0]
    return num_experts * (f * logits.softmax(dim=-1).mean(dim=0)).sum()


@_no_tokens_is_zero
def loss_detached(logits, routing, num_experts):
    choices = routing.expert.reshape(-1)
    f = torch.bincount(choices, minlength=num_experts).to(logits.dtype) / choices.numel()
    return num_experts * (f * logits.detach().softmax(dim=-1).mean(dim=0)).sum()


@_no_tokens_is_zero
def loss_p_squared(logits, routing, num_experts):
    P = logits.softmax(dim=-1).mean(dim=0)
    return num_experts * (P * P).sum()


@_no_tokens_is_zero
def loss_from_routing_weights(logits, routing, num_experts):
    """P taken from the routing's weights (the chosen, renormalised ones), not the softmax."""
    choices = routing.expert.reshape(-1)
    f = torch.bincount(choices, minlength=num_experts).to(logits.dtype) / choices.numel()
    P = torch.zeros(num_experts, dtype=logits.dtype).index_add(
        0, choices, routing.weight.reshape(-1)) / routing.expert.shape[0]
    return num_experts * (f * P).sum()


def loss_from_the_grader(logits, routing, num_experts):
    from autograder.references.lesson13 import load_balancing_loss

    return load_balancing_loss(logits, routing, num_experts)


# --------------------------------------------------------------------------- task 13.3


class _Switched(_lesson.ExpertParallelMoE):
    """The lesson's layer with one step replaced (see each subclass)."""

    capacity_of_all = False  # capacity from every rank's tokens
    interleaved = False  # expert e on rank e % W
    send_dropped = False  # dropped choices are sent and computed too
    dropped_weight = "zero"  # ... weighted 0, or with their probability
    dispatch_order = False  # results added in dispatch order, as if in the tokens' order
    differentiable = True  # the all-to-alls carry gradients

    def forward(self, x):
        T = x.shape[0]
        W, n_local, E = self.world_size, self.num_local, self.num_experts
        tokens = T * (W if self.capacity_of_all else 1)
        cap = math.ceil(self.k * tokens * self.capacity_factor / E)
        logits = self.router(x)
        routing = route(logits, self.k, cap)
        chosen = torch.ones_like(routing.kept) if self.send_dropped else routing.kept
        token, choice = torch.nonzero(chosen, as_tuple=True)
        expert = routing.expert[token, choice]
        if self.send_dropped and self.dropped_weight == "probability":
            weight = torch.where(routing.kept, routing.weight,
                                 logits.softmax(-1).gather(1, routing.expert))[token, choice]
        else:
            weight = routing.weight[token, choice]
        owner = expert % W if self.interleaved else expert // n_local
        local_of = expert // W if self.interleaved else expert % n_local
        order = torch.argsort(owner * (n_local * (T * self.k + 1)) + local_of * (T * self.k + 1)
                              + torch.arange(len(expert)))
        sorted_token, sorted_weight = token[order], weight[order]
        owner, local_of = owner[order], local_of[order]
        send_counts = torch.bincount(owner * n_local + local_of, minlength=E)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits = send_counts.view(W, n_local).sum(1).tolist()
        recv_per = recv_counts.view(W, n_local)
        recv_splits = recv_per.sum(1).tolist()
        received = self._exchange(x[sorted_token], recv_splits, send_splits)
        local = torch.arange(n_local).repeat(W).repeat_interleave(recv_per.reshape(-1))
        results = torch.zeros_like(received)
        for i, module in enumerate(self.experts):
            rows = torch.nonzero(local == i).squeeze(1)
            if rows.numel():
                results = results.index_copy(0, rows, module(received[rows]))
        returned = self._exchange(results, send_splits, recv_splits)
        if self.dispatch_order:  # the rows are in dispatch order, not in (token, choice) order
            sorted_token, sorted_weight = token, weight
        return torch.zeros_like(x).index_add(0, sorted_token, sorted_weight[:, None] * returned)

    def _exchange(self, rows, output_splits, input_splits):
        if self.differentiable:
            return AllToAll.apply(rows, output_splits, input_splits, self.group)
        out = rows.new_empty((sum(output_splits), rows.shape[1]))
        dist.all_to_all_single(out, rows.detach().contiguous(), output_splits, input_splits,
                               group=self.group)
        return out


class MoEDispatchOrder(_Switched):
    dispatch_order = True


class MoESendsDroppedWeightedZero(_Switched):
    send_dropped = True


class MoESendsDroppedWithProbability(_Switched):
    send_dropped = True
    dropped_weight = "probability"


class MoECapacityOfAllRanks(_Switched):
    capacity_of_all = True


class MoEInterleavedExperts(_Switched):
    interleaved = True


class MoENotDifferentiable(_Switched):
    differentiable = False


class MoEFixedSplit(_lesson.ExpertParallelMoE):
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


class MoEReducesRouterGrads(_lesson.ExpertParallelMoE):
    """All-reduces the router's gradient itself (the caller then all-reduces it again)."""

    def __init__(self, router, experts_local, k, capacity_factor, group=None):
        super().__init__(router, experts_local, k, capacity_factor, group)
        for p in router.parameters():
            p.register_hook(lambda g: _summed(g, group))


def _summed(grad, group):
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


class MoEAllGathersTokens(_lesson.ExpertParallelMoE):
    """Gathers every rank's tokens everywhere, computes its experts on all of them and sums."""

    def forward(self, x):
        sizes = [None] * self.world_size
        dist.all_gather_object(sizes, x.shape[0], group=self.group)
        return super().forward(x)


class MoESendsEveryTokenEverywhere(_lesson.ExpertParallelMoE):
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


class MoEGathersThroughTheGroup(_lesson.ExpertParallelMoE):
    """Gathers the token counts with the process group's own all-gather method (forbidden on
    every route, not only as dist.all_gather)."""

    def forward(self, x):
        group = self.group if self.group is not None else dist.group.WORLD
        counts = torch.tensor([x.shape[0]])
        everyone = torch.empty(self.world_size, dtype=counts.dtype)
        group._allgather_base(everyone, counts).wait()
        return super().forward(x)


class MoECopiesEveryExpert(nn.Module):
    """Every rank broadcasts its experts to all: each holds all E and computes its own tokens."""

    def __init__(self, router, experts_local, k, capacity_factor, group=None):
        super().__init__()
        self.router, self.k, self.capacity_factor = router, k, capacity_factor
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
        self.experts = nn.ModuleList(experts)

    def forward(self, x):
        E = len(self.experts)
        cap = math.ceil(self.k * x.shape[0] * self.capacity_factor / E)
        routing = route(self.router(x), self.k, cap)
        out = torch.zeros_like(x)
        for e, module in enumerate(self.experts):
            token, choice = torch.nonzero((routing.expert == e) & routing.kept, as_tuple=True)
            if token.numel():
                out = out.index_add(0, token, routing.weight[token, choice, None] * module(x[token]))
        return out


def _copy_of(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)


BUGS = {
    "13.1": [
        ("gives slots token by token (both choices of token 0, then token 1, ...)",
         route_token_by_token),
        ("counts slots over the flattened (T, k) choices: token by token, vectorised",
         route_vectorised_without_priority),
        ("does not renormalise the weights for k = 2", route_not_renormalised),
        ("renormalises the weight for k = 1 too (every weight 1)", route_k1_renormalised),
        ("keeps one capacity counter for all experts", route_one_counter),
        ("breaks ties to the higher expert index", route_ties_higher),
        ("uses torch.topk as it is (CPU ties in no promised order)", route_plain_topk),
        ("renormalises the kept weights again after dropping", route_renormalised_after_dropping),
        ("calls the grader's own route", route_from_the_grader),
    ],
    "13.2": [
        ("takes the gradient through f (a straight-through count)", loss_straight_through),
        ("counts only the kept choices in f", loss_counts_kept_only),
        ("divides the counts by T instead of T * k", loss_divides_by_tokens),
        ("detaches P: no gradient reaches the router", loss_detached),
        ("uses P for f too (E * sum P_i^2)", loss_p_squared),
        ("takes P from the routing weights instead of the softmax", loss_from_routing_weights),
        ("calls the grader's own load_balancing_loss", loss_from_the_grader),
        ("no tokens: 0 / 0, a nan loss", edited_solution("13_mixture_of_experts.py", (
            "    if choices.numel() == 0:  # nothing routed: nothing to balance (f and P would be 0 / 0)\n"
            "        return logits.sum() * 0.0\n", "")).load_balancing_loss),
    ],
    "13.3": [
        ("skips a local expert that received no row: an idle rank's output has no path to the "
         "combine all-to-all, so its backward skips it (router collapse deadlocks)",
         edited_solution("13_mixture_of_experts.py", (
             "            results = results.index_copy(0, rows, expert_module(received[rows]))",
             "            if rows.numel():\n"
             "                results = results.index_copy(0, rows, expert_module(received[rows]))",
         )).ExpertParallelMoE),
        ("ties an idle rank's output to the received rows only (received * 0): no path to the "
         "combine all-to-all once the input needs no grad",
         edited_solution("13_mixture_of_experts.py", (
             "        results = torch.zeros_like(received)\n",
             "        results = received * 0\n",
         ), (
             "            results = results.index_copy(0, rows, expert_module(received[rows]))",
             "            if rows.numel():\n"
             "                results = results.index_copy(0, rows, expert_module(received[rows]))",
         )).ExpertParallelMoE),
        ("exchanges no counts: a fixed split of capacity rows per expert, padded", MoEFixedSplit),
        ("adds the results in dispatch order instead of the tokens' order", MoEDispatchOrder),
        ("sends and computes the dropped choices too (weighted 0)", MoESendsDroppedWeightedZero),
        ("sends and computes the dropped choices, weighted by their probability",
         MoESendsDroppedWithProbability),
        ("computes the capacity from every rank's tokens", MoECapacityOfAllRanks),
        ("puts expert e on rank e % W", MoEInterleavedExperts),
        ("dispatches with a plain all_to_all_single: no gradient crosses it", MoENotDifferentiable),
        ("all-reduces the router's gradient itself", MoEReducesRouterGrads),
        ("all-gathers from every rank (forbidden)", MoEAllGathersTokens),
        ("all-gathers through ProcessGroup._allgather_base (forbidden)", MoEGathersThroughTheGroup),
        ("sends every token to every rank through the all-to-alls (an all-gather by another name)",
         MoESendsEveryTokenEverywhere),
        ("copies every expert onto every rank with broadcasts", MoECopiesEveryExpert),
    ],
}
