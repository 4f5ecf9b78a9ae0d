"""The grader's answers for Lesson 13 (trusted only).

13.1's ``route`` orders each token's experts with Python's own sort on the key (-probability,
expert index) over ``torch.softmax``'s probabilities, so ties go to the lower index whatever
``torch.topk`` does on this machine, and
hands out slots with one counter per expert, walking the choices in priority order (every
token's first choice, then every second choice, ...). 13.2's ``load_balancing_loss`` counts the
choices in Python and takes the probabilities from ``exp`` and a sum, not from
``torch.softmax``; its companion's expectation is autograd's gradient of that loss. 13.3's
expectation is the whole mixture of experts in one process: every
expert present, each rank's tokens routed on their own with that rank's capacity, the outputs
combined expert by expert; its gradients come from one backward through all of it. 13.4's
expectation loops over tokens and their choices in float64, one expert's MLP at a time, no
sorting and no grouped product.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from autograder.compare import one_thread
from autograder.lesson13 import (
    BALANCE_SETTINGS,
    BOUND_SLACK,
    GRADS,
    GROUPED_D,
    GROUPED_H,
    GROUPED_MEASURED,
    GROUPED_SETTINGS,
    GROUPED_SLACK,
    MOE_CONFIGS,
    MOE_RUNS,
    gradient_inputs,
    grouped_inputs,
    moe_inputs,
    moe_router,
    param_bytes,
)
from kit.lessons.moe import Routing, expert_range, make_experts, make_router

# --------------------------------------------------------------------------- 13.1


def route(logits: torch.Tensor, k: int, capacity: int) -> Routing:
    """Task 13.1's reference: softmax, top-k by (-p, index), slots in priority order."""
    probs = torch.softmax(logits, dim=-1)  # (T, E), torch's own: the values a tie is judged on
    num_tokens, num_experts = probs.shape
    if not 1 <= k <= num_experts:
        raise ValueError(f"k = {k} choices, {num_experts} experts: need 1 <= k <= E")
    table = probs.detach().tolist()
    chosen = [sorted(range(num_experts), key=lambda e, row=row: (-row[e], e))[:k] for row in table]
    expert = torch.tensor(chosen, dtype=torch.int64).reshape(num_tokens, k)
    top = probs.gather(1, expert)  # (T, k), differentiable
    weight = top if k == 1 else top / top.sum(dim=-1, keepdim=True)
    slot = torch.full((num_tokens, k), -1, dtype=torch.int64)
    used = [0] * num_experts  # one counter per expert
    for j in range(k):  # every first choice before any second choice
        for t in range(num_tokens):
            e = chosen[t][j]
            if used[e] < capacity:
                slot[t, j] = used[e]
            used[e] += 1
    kept = slot >= 0
    weight = weight * kept.to(weight.dtype)  # dropped choices weigh 0; kept ones as they were
    return Routing(expert, weight, slot, kept)


# --------------------------------------------------------------------------- 13.2


def load_balancing_loss(logits: torch.Tensor, routing: Any, num_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, E * sum_i f_i P_i, with f counted in Python."""
    expert = routing.expert.reshape(-1).tolist()
    choices = len(expert)
    if choices == 0:  # no tokens: 0 with a zero gradient (the rank's share of a batch is empty)
        return (logits * 0.0).sum()
    f = torch.tensor([expert.count(i) / choices for i in range(num_experts)], dtype=logits.dtype)
    probs = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    P = probs.mean(dim=0)  # (E,): the mean router probability of each expert
    return num_experts * (f * P).sum()


def router_gradient_by_autograd(seed: int) -> dict[str, torch.Tensor]:
    """13.2's companion's expectation: autograd's gradient of the loss above, each input."""
    out = {}
    for name, (logits, routing, num_experts) in gradient_inputs(seed).items():
        leaf = logits.detach().clone().requires_grad_()
        grad = torch.autograd.grad(load_balancing_loss(leaf, routing, num_experts), leaf,
                                   allow_unused=True)[0]
        out[name] = torch.zeros_like(leaf) if grad is None else grad
    return out


def perfect_balance(seed: int) -> list[float]:
    """At perfect balance the loss is exactly 1, for every setting of the case."""
    return [1.0] * len(BALANCE_SETTINGS)


# --------------------------------------------------------------------------- 13.3


def _moe(x: torch.Tensor, router: torch.nn.Module, experts: torch.nn.ModuleList, k: int,
         cap: int) -> tuple[torch.Tensor, Routing]:
    """One rank's tokens through the whole MoE: route, every expert on its kept choices, combine."""
    routing = route(router(x), k, cap)
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        token, choice = torch.nonzero((routing.expert == e) & routing.kept, as_tuple=True)
        if token.numel():
            out = out.index_add(0, token, routing.weight[token, choice, None] * expert(x[token]))
    return out, routing


def moe_in_one_process(seed: int, name: str) -> dict[str, Any]:
    """Task 13.3's expectation: per rank, its outputs and gradients from the single-process MoE,
    and the bytes its two token all-to-alls must carry."""
    with one_thread():
        return _moe_in_one_process(seed, name)


def _moe_in_one_process(seed: int, name: str) -> dict[str, Any]:
    cfg = MOE_CONFIGS[name]
    E, W, k, d = cfg["experts"], cfg["world_size"], cfg["k"], cfg["d_model"]
    router = moe_router(seed, name)
    experts = make_experts(E, d, cfg["d_hidden"], seed=seed, dtype=torch.float64)
    inputs = [moe_inputs(seed, name, rank, router) for rank in range(W)]
    loss = torch.zeros((), dtype=torch.float64)
    outs, routings, xs = [], [], []
    for x, upstream in inputs:
        x = x.clone().requires_grad_(cfg.get("input_grad", True))
        cap = math.ceil(k * x.shape[0] * cfg["capacity_factor"] / E)
        out, routing = _moe(x, router, experts, k, cap)
        loss = loss + (out * upstream).sum()
        outs.append(out)
        routings.append(routing)
        xs.append(x)
    loss.backward()
    element = torch.empty((), dtype=torch.float64).element_size()
    ranks = []
    for rank in range(W):
        mine = expert_range(E, W, rank)
        sent = int(routings[rank].kept.sum())  # every kept choice of this rank's tokens leaves
        received = sum(int(((r.expert >= mine.start) & (r.expert < mine.stop) & r.kept).sum())
                       for r in routings)  # every kept choice of any rank for its experts
        ranks.append({
            "out": outs[rank].detach(),
            "x_grad": (None if not xs[rank].requires_grad else torch.zeros_like(xs[rank])
                       if xs[rank].grad is None else xs[rank].grad.clone()),
            "expert_grads": {e: [torch.zeros_like(p) if p.grad is None else p.grad.clone()
                                 for p in experts[e].parameters()]
                             for e in expert_range(E, W, rank)},
            "sent_bytes": sent * d * element,
            "received_bytes": received * d * element,
            "kept": sent,
            "dropped": int((~routings[rank].kept).sum()),
        })
    # An edge run must be in the regime its case names, or the case tests nothing.
    idle = [r for r in range(W) if ranks[r]["received_bytes"] == 0]
    empty = [r for r in range(W) if xs[r].shape[0] == 0]
    if idle != cfg.get("idle", idle) or empty != cfg.get("empty", empty):
        raise AssertionError(f"13.3 run {name!r} is out of its regime: ranks receiving no token "
                             f"{idle} (want {cfg.get('idle')}), ranks with no tokens {empty}")
    return {"ranks": ranks, "router_grad": router.weight.grad.clone(), "count_bytes": 8 * E}


def expert_bytes_bound(seed: int, name: str) -> dict[str, float]:
    """What a rank may hold once its MoE layer is built: the router and its E/W experts
    (plus a quarter for small buffers), never the other ranks' experts."""
    cfg = MOE_RUNS[name]
    E, W, d = cfg["experts"], cfg["world_size"], cfg["d_model"]
    router = make_router(d, E, seed=seed, dtype=torch.float64)
    experts = make_experts(E, d, cfg["d_hidden"], seed=seed, which=expert_range(E, W, 0),
                           dtype=torch.float64)
    return {"bound": BOUND_SLACK * (param_bytes(router) + param_bytes(experts))}


# --------------------------------------------------------------------------- 13.4


def grouped_by_token(seed: int, name: str) -> dict[str, Any]:
    """Task 13.4's expectation: token by token, choice by choice, each expert's MLP in float64;
    the gradients from one backward through that loop."""
    with one_thread():
        data = grouped_inputs(seed, GROUPED_SETTINGS[name])
        leaves = {n: data[n].clone().requires_grad_() for n in GRADS}
        x, weight = leaves["x"], leaves["weight"]
        rows = []
        for t, choices in enumerate(data["expert"].tolist()):
            row = torch.zeros(x.shape[1], dtype=torch.float64)
            for j, e in enumerate(choices):
                hidden = torch.nn.functional.gelu(x[t] @ leaves["w1"][e] + leaves["b1"][e])
                row = row + weight[t, j] * (hidden @ leaves["w2"][e] + leaves["b2"][e])
            rows.append(row)
        out = torch.stack(rows) if rows else torch.zeros_like(x)
        if rows:
            (out * data["upstream"]).sum().backward()
        return {"out": out.detach(),
                "grads": {n: torch.zeros_like(p) if p.grad is None else p.grad
                          for n, p in leaves.items()}}


def grouped_bytes_bound(seed: int) -> dict[str, float]:
    """What one forward of 13.4 may allocate: GROUPED_SLACK times T k rows of d_model and
    d_hidden float32 numbers (the grouped path allocates about 3 of those)."""
    T, _, k, _, _ = GROUPED_MEASURED
    return {"bound": GROUPED_SLACK * T * k * (GROUPED_D + GROUPED_H) * 4}
