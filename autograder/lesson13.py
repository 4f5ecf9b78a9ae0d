"""Checks for Lesson 13, "Mixture of experts and expert parallelism": tasks 13.1 to 13.3.

Task 13.1 ``route`` and 13.2 ``load_balancing_loss`` run in this process, once per
implementation and seed, on logits built to hit each rule: random ones, a batch where every
token wants the same expert, exact ties, capacities of 0 and of more than any load, and a
perfectly balanced load. They are compared with :mod:`autograder.references.lesson13`, which
sorts, counts and normalises in plain Python. Task 13.3 ``ExpertParallelMoE`` runs on 2 and on
4 gloo ranks, one shared run per world size: each rank builds the router and only its own
experts under :func:`kit.meter.track` (the bytes it holds), then runs one forward and one
backward under :mod:`kit.trace` (every collective, its bytes, and whether it came in forward or
backward). Outputs, input, expert and router gradients are compared with the whole MoE in one
process; the recorder's bytes with the kept choices the single-process routing counts.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from autograder.compare import CheckFailed, describe, per_rank, tensor_mismatch
from autograder.registry import plain, task
from kit.lessons.moe import Routing, expert_range, make_experts, make_router, skewed_tokens

RANK_TIMEOUT_S = 30.0  # a dispatch whose splits disagree between ranks hangs: stop it here
ROUTING_FIELDS = ("expert", "weight", "slot", "kept")
A2A = ("all_to_all_single", "all_to_all")  # the recorder's names for an all-to-all
BOUND_SLACK = 1.25  # what a rank may hold beyond its router and experts: small buffers

# What 13.3 must not do (autograder.gates scores a use 0): gather every token, or every
# expert, onto every rank, on any route (dist.*, functional collectives, the autograd ones).
ALL_GATHERS = (
    "torch.distributed.all_gather", "torch.distributed.all_gather_into_tensor",
    "torch.distributed.all_gather_object", "torch.distributed.all_gather_coalesced",
    "torch.distributed._all_gather_base", "torch.distributed.all_gather_single",
    "torch.distributed.nn.functional.all_gather",
    "torch.distributed._functional_collectives.all_gather_tensor",
    "torch.distributed._functional_collectives.all_gather_tensor_autograd",
    "torch.distributed._functional_collectives.all_gather_into_tensor_coalesced",
)


def param_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


# --------------------------------------------------------------------------- task 13.1

# (tokens T, experts E, k, capacity, kind of logits, dtype) of each setting route() is run on
ROUTE_SETTINGS: dict[str, tuple[int, int, int, int, str, torch.dtype]] = {
    "k=1": (32, 8, 1, 5, "random", torch.float32),
    "k=2": (32, 8, 2, 8, "random", torch.float32),
    "k=3": (24, 6, 3, 10, "random", torch.float64),
    "one expert": (16, 4, 2, 5, "one", torch.float32),
    "ties": (24, 6, 2, 6, "ties", torch.float32),
    "capacity 0": (10, 4, 2, 0, "random", torch.float32),
    "huge capacity": (10, 4, 2, 1000, "random", torch.float32),
    "no tokens": (0, 4, 2, 3, "random", torch.float32),  # a rank whose batch is empty
    "k = E": (6, 3, 3, 6, "random", torch.float64),  # every expert chosen by every token
}


def route_logits(seed: int, setting: str) -> torch.Tensor:
    """The (T, E) logits of a setting: random, all wanting expert 3, or full of exact ties."""
    T, E, _, _, kind, dtype = ROUTE_SETTINGS[setting]
    g = torch.Generator().manual_seed(seed * 101 + len(setting))
    if kind == "random":
        return (2.0 * torch.randn(T, E, generator=g, dtype=torch.float64)).to(dtype)
    if kind == "one":  # expert 3 first for everyone; the second choices are spread
        logits = 0.5 * torch.randn(T, E, generator=g, dtype=torch.float64)
        logits[:, 3] += 6.0
        return logits.to(dtype)
    # Small integers: most rows hold equal logits, hence equal probabilities (a first row of
    # all zeros ties every expert).
    logits = torch.randint(0, 2, (T, E), generator=g).to(dtype)
    logits[0] = 0
    return logits


def _fields(routing: Any) -> dict[str, Any]:
    if not all(hasattr(routing, f) for f in ROUTING_FIELDS):
        return {"type": type(routing).__name__}
    return {f: plain(getattr(routing, f)) for f in ROUTING_FIELDS}


ROUTE = task(
    "13.1", reference="route",
    # forbids nothing: torch has no router; torch.topk and torch.sort are the tools it builds on
    hint="A router turns each token's logits into k choices: the softmax's k most likely experts "
         "(equal probabilities go to the lower expert index), weights that are the raw "
         "probability for k = 1 and the probabilities renormalised over the chosen k for k > 1, "
         "and a place in each expert's buffer given first come, first served, where all first "
         "choices come before any second choice. A choice that finds its expert's capacity full "
         "is dropped.",
    recipe="Take the softmax over the experts. Sort each row by probability, largest first, "
           "with a stable sort, so that equal probabilities keep the lower index first, and keep "
           "the first k columns. For k > 1 divide the k probabilities by their sum. Walk the "
           "choices column by column (choice 0 of tokens 0 .. T-1, then choice 1, ...) and give "
           "each the number of earlier choices of the same expert: a running count per expert. "
           "A count below the capacity is the slot; otherwise the choice is dropped: kept False, "
           "slot -1, weight 0.",
)


@ROUTE.shared
def _routings(route: Any, seed: int) -> dict[str, Any]:
    """route() on every setting, as plain data; and the type it returns."""
    out = {}
    for setting, (_, _, k, cap, _, _) in ROUTE_SETTINGS.items():
        result = route(route_logits(seed, setting), k, cap)
        out[setting] = _fields(result)
    result = route(route_logits(seed, "k=2"), 2, 8)
    out["type"] = {"name": type(result).__name__,
                   "fields": list(getattr(result, "_fields", ()))}
    return out


FIELD_HINTS = {
    "expert": ("The experts are the k most likely ones under the softmax, best first; equal "
               "probabilities go to the lower expert index.",
               "Sort each row of probabilities in descending order with stable=True (equal "
               "values keep their order, so the lower index comes first) and keep k columns; "
               "torch.topk alone does not promise any order among equal values on CPU."),
    "weight": ("A kept choice weighs its router probability, renormalised over the token's k "
               "choices when k > 1 (for k = 1 the raw probability, as in Switch); a dropped "
               "choice weighs 0, and the kept ones are not renormalised again after dropping.",
               "Divide the k chosen probabilities by their sum (only when k > 1), then set the "
               "weight of every dropped choice to 0 and leave the others as they are."),
    "slot": ("Each expert hands out its own slots 0, 1, 2, ... first come, first served: every "
             "token's first choice, in token order, before any token's second choice. A dropped "
             "choice has slot -1.",
             "Walk the choices column by column and keep one running count per expert: a "
             "choice's slot is how many choices of the same expert came before it, if that is "
             "below the capacity; -1 otherwise."),
}
FIELD_HINTS["kept"] = FIELD_HINTS["slot"]


def _compare_routing(got: Any, expected: dict[str, Any], settings: tuple[str, ...]) -> None:
    for setting in settings:
        want, have = expected[setting], got.get(setting) if isinstance(got, dict) else None
        T, E, k, cap, _, dtype = ROUTE_SETTINGS[setting]
        where = f"{setting} ({T} tokens, {E} experts, k={k}, capacity {cap})"
        if not isinstance(have, dict) or "type" in have:
            kind = have.get("type") if isinstance(have, dict) else describe(have, 60)
            raise CheckFailed(f"{where}: route returned a {kind}, not a Routing with fields "
                              f"{', '.join(ROUTING_FIELDS)}", expected="Routing(expert, weight, "
                              "slot, kept)", got=kind,
                              hint="Return the Routing NamedTuple the setup cell imports.",
                              recipe="Build Routing(expert=..., weight=..., slot=..., kept=...) "
                                     "from four (tokens, k) tensors.")
        for field in ROUTING_FIELDS:
            g, e = have[field], want[field]
            if not isinstance(g, torch.Tensor) or g.shape != e.shape:
                raise CheckFailed(f"{where}: {field} {tensor_mismatch(g, e.double())}",
                                  expected=f"shape {tuple(e.shape)}", got=describe(g, 80),
                                  hint="Every field is a (tokens, k) tensor, column j the j-th "
                                       "choice.", recipe=FIELD_HINTS[field][1])
            if field == "kept" and g.dtype != torch.bool:
                raise CheckFailed(f"{where}: kept has dtype {g.dtype}, expected torch.bool",
                                  expected="torch.bool", got=str(g.dtype),
                                  hint=FIELD_HINTS[field][0],
                                  recipe="Compare the running count with the capacity: the "
                                         "comparison is a bool tensor.")
            if field == "weight":
                tol = 1e-12 if dtype == torch.float64 else 1e-6
                wrong = tensor_mismatch(g, e, rtol=tol, atol=tol)
                bad = (g.double() - e.double()).abs() > tol + tol * e.double().abs()
            else:
                if g.is_floating_point() or g.is_complex():
                    raise CheckFailed(f"{where}: {field} has dtype {g.dtype}, expected integers",
                                      expected=str(e.dtype), got=str(g.dtype),
                                      hint=FIELD_HINTS[field][0], recipe=FIELD_HINTS[field][1])
                wrong = None if torch.equal(g.long(), e.long()) else "differs"
                bad = g.long() != e.long()
            if wrong:
                t, j = (int(i) for i in torch.nonzero(bad)[0])
                raise CheckFailed(f"{where}: {field} {wrong}; first at token {t}, choice {j}",
                                  expected={"expert": want["expert"][t].tolist(),
                                            field: want[field][t].tolist()},
                                  got={"expert": have["expert"][t].tolist()
                                       if isinstance(have["expert"], torch.Tensor) else None,
                                       field: g[t].tolist()},
                                  hint=FIELD_HINTS[field][0], recipe=FIELD_HINTS[field][1])


def _route_case(name: str, settings: tuple[str, ...], hint: str = "", recipe: str = "") -> None:
    ROUTE.case(name, uses=_routings, compare=partial(_compare_routing, settings=settings),
               hint=hint, recipe=recipe)


_route_case("random logits, k=1: the raw probability is the weight (Switch)", ("k=1",),
            hint="With one choice the weight is the router's probability itself, not 1: the "
                 "router learns through it.")
_route_case("random logits, k=2: weights renormalised over the two chosen", ("k=2",))
_route_case("random logits, k=3, float64, with dropped choices", ("k=3",))
_route_case("every token prefers one expert: its slots fill in token order, the rest is dropped",
            ("one expert",),
            hint="An expert that everyone wants fills its capacity with the first tokens' first "
                 "choices; every later choice of it is dropped, while the other experts still "
                 "count their own slots from 0.")
_route_case("exact ties go to the lower expert index", ("ties",),
            hint="Equal probabilities must be ordered by expert index, lower first, on every "
                 "machine: torch.topk on CPU returns equal values in no promised order.")
_route_case("capacity 0 drops every choice; a capacity above every load keeps all",
            ("capacity 0", "huge capacity"),
            hint="Capacity is the number of slots per expert: with 0 slots every choice is "
                 "dropped (slot -1, weight 0), and with enough slots none is.")

_route_case("no tokens gives four empty (0, k) tensors; k = E chooses every expert",
            ("no tokens", "k = E"),
            hint="A rank may have no tokens (an empty batch): route returns (0, k) tensors, not "
                 "an error. With k = E every token chooses every expert, best first.")


@ROUTE.case("k larger than the number of experts is a ValueError naming k and E")
def _(route: Any, seed: int) -> Any:
    try:
        result = route(route_logits(seed, "k=1")[:, :3], 4, 8)
    except ValueError as e:
        return ["ValueError", str(e)]
    except Exception as e:  # noqa: BLE001 - the wrong kind of error is an answer too
        return [type(e).__name__, str(e)[:200]]
    return ["returned", describe(result, 80)]


def _compare_k_too_large(got: Any, expected: Any) -> None:
    if not (isinstance(got, list) and got[0] == "ValueError" and "k" in got[1]):
        raise CheckFailed("route(logits of 3 experts, k=4, ...) must raise a ValueError naming "
                          "k and the number of experts", expected="ValueError: k = 4 ... 3 experts",
                          got=got if isinstance(got, list) else describe(got, 80),
                          hint="A token cannot choose more distinct experts than there are: k "
                               "must lie between 1 and E. Say so, rather than fail deep inside "
                               "with a shape error.",
                          recipe="Before routing, check 1 <= k <= E and raise ValueError with "
                                 "both numbers otherwise.")


ROUTE.cases[-1].compare = _compare_k_too_large


def _compare_type(got: Any, expected: Any) -> None:
    if got != expected:
        raise CheckFailed("route must return the Routing NamedTuple", expected=expected, got=got,
                          hint="The other layers read the routing by field name: return the "
                               "Routing the setup cell imports.",
                          recipe="Return Routing(expert, weight, slot, kept), in that order.")


ROUTE.case("returns a Routing(expert, weight, slot, kept)", uses=_routings, pick="type",
           compare=_compare_type)


# --------------------------------------------------------------------------- task 13.2

# (tokens, experts, k, kind): the perfectly balanced loads the loss must score exactly 1
BALANCE_SETTINGS = [(16, 4, 1, "uniform probabilities, every choice on expert 0"),
                    (16, 4, 2, "random logits, every expert chosen equally often"),
                    (8, 8, 4, "random logits, every expert chosen equally often")]


def balance_inputs(seed: int, T: int, E: int, k: int, *, dropped: float = 0.3, skew: float = 0.0,
                   attached: bool = False, avoid: int | None = None
                   ) -> tuple[torch.Tensor, Routing]:
    """float64 (T, E) logits that require grad, and a Routing of k distinct experts per token
    drawn at random (``skew`` favours expert 0, no choice is ``avoid``), about ``dropped`` of
    them dropped. With ``attached`` the weights are the logits' own probabilities, part of
    their autograd graph."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64).requires_grad_()
    scores = torch.rand(T, E, generator=g, dtype=torch.float64)
    scores[:, 0] += skew
    if avoid is not None:
        scores[:, avoid] = -1.0
    expert = scores.argsort(dim=1, descending=True)[:, :k]  # k distinct experts per token
    kept = torch.rand(T, k, generator=g) >= dropped
    probs = logits.softmax(-1) if attached else logits.detach().softmax(-1)
    weight = probs.gather(1, expert) * kept
    slot = torch.where(kept, torch.arange(T * k).view(T, k), -1)  # any slots: the loss ignores them
    return logits, Routing(expert, weight, slot, kept)


def _loss_and_grad(load_balancing_loss: Any, logits: torch.Tensor, routing: Routing,
                   num_experts: int) -> dict[str, Any]:
    loss = load_balancing_loss(logits, routing, num_experts)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()
    return {"value": plain(loss), "grad": plain(logits.grad)}


# What router_gradient derives by hand: autograd on any route is refused in Task 13.2 (the
# loss itself needs none; the grader's own backward of it is not the student's call).
AUTOGRAD = ("torch.autograd.grad", "torch.autograd.backward", "torch.autograd.functional",
            "torch.func")

LOSS = task(
    "13.2", reference="load_balancing_loss", forbidden=AUTOGRAD,
    # torch has no load-balancing loss; the task is the formula and its gradient by hand
    hint="Switch Transformer's auxiliary loss is num_experts times the sum over experts of f_i "
         "times P_i: f_i the fraction of all T*k routing choices (dropped ones too, since they "
         "were made before capacity) that went to expert i, a count with no gradient, and P_i "
         "the mean router probability of expert i over the tokens, through which the gradient "
         "flows. At perfect balance it is exactly 1, for any k.",
    recipe="Count each expert's choices in routing.expert (all of them, kept or not) and divide "
           "by the number of choices, tokens times k: that is f, a constant. Take the softmax of "
           "the logits and average it over the tokens: that is P. Return num_experts times the "
           "sum of f times P, as a 0-d tensor.",
)


@LOSS.shared
def _losses(load_balancing_loss: Any, seed: int) -> dict[str, Any]:
    """The loss and the logits' gradient on each input; and the value on balanced loads."""
    out = {"random": _loss_and_grad(load_balancing_loss, *balance_inputs(seed, 24, 6, 2), 6),
           "skewed": _loss_and_grad(load_balancing_loss,
                                    *balance_inputs(seed + 1, 30, 5, 1, skew=0.6, dropped=0.4), 5),
           "attached": _loss_and_grad(load_balancing_loss,
                                      *balance_inputs(seed + 2, 20, 4, 2, attached=True), 4)}
    # no tokens (a rank whose share of the batch is empty): 0, not nan, and backward works
    empty = torch.zeros(0, 4, dtype=torch.float64, requires_grad=True)
    none = torch.zeros(0, 2, dtype=torch.int64)
    out["no tokens"] = _loss_and_grad(load_balancing_loss, empty, Routing(
        none, torch.zeros(0, 2, dtype=torch.float64), none, none.bool()), 4)
    values = []
    for T, E, k, kind in BALANCE_SETTINGS:
        logits, routing = _balanced(seed, T, E, k, kind)
        value = load_balancing_loss(logits, routing, E)
        values.append(float(value) if isinstance(value, torch.Tensor) and value.numel() == 1
                      else plain(value))
    out["balanced"] = values
    return out


def _balanced(seed: int, T: int, E: int, k: int, kind: str) -> tuple[torch.Tensor, Routing]:
    """A perfectly balanced load: uniform probabilities, or every expert chosen T*k/E times."""
    g = torch.Generator().manual_seed(seed + 7)
    if kind.startswith("uniform"):
        logits = torch.zeros(T, E, dtype=torch.float64)
        expert = torch.zeros(T, k, dtype=torch.int64)
    else:
        logits = torch.randn(T, E, generator=g, dtype=torch.float64)
        # distinct per token
        expert = (torch.arange(T * k).view(T, k) + torch.arange(T)[:, None]) % E
    kept = torch.ones(T, k, dtype=torch.bool)
    weight = logits.softmax(-1).gather(1, expert)
    return logits, Routing(expert, weight, torch.zeros(T, k, dtype=torch.int64), kept)


def _compare_loss(got: Any, expected: dict[str, Any]) -> None:
    if not isinstance(got, dict) or not isinstance(got.get("value"), torch.Tensor):
        value = got.get("value") if isinstance(got, dict) else got
        raise CheckFailed(f"load_balancing_loss returned {describe(value, 80)}, not a tensor",
                          expected="a 0-d tensor that requires grad", got=describe(value, 80),
                          hint="Return the loss as a tensor built from the softmax, so that it "
                               "can be added to the model's loss and backpropagated.",
                          recipe="Keep every step in torch, in the logits' dtype; do not call "
                                 ".item() or float() on the result.")
    wrong = tensor_mismatch(got["value"].reshape(()), expected["value"], rtol=1e-12, atol=1e-12)
    if wrong:
        raise CheckFailed(f"the loss {wrong}", expected=expected["value"].item(),
                          got=got["value"].double().reshape(-1)[0].item())
    if got["grad"] is None:
        raise CheckFailed("the logits got no gradient from the loss", expected="a (T, E) gradient",
                          got=None,
                          hint="The gradient flows through P, the mean softmax probability: P "
                               "must be computed from the logits without detaching them.",
                          recipe="Compute P as the softmax of the logits (no .detach(), no "
                                 "torch.no_grad()), averaged over the tokens.")
    wrong = tensor_mismatch(got["grad"], expected["grad"], rtol=1e-10, atol=1e-12)
    if wrong:
        raise CheckFailed(f"the logits' gradient {wrong}", expected=describe(expected["grad"]),
                          got=describe(got["grad"]))


LOSS.case("value and gradient, k=2, with dropped choices (float64, within 1e-12)",
          uses=_losses, pick="random", compare=_compare_loss,
          hint="f counts every choice made before capacity: a dropped choice still went to its "
               "expert. Divide by all T*k choices, not by T, nor by the kept ones.")
LOSS.case("value and gradient, k=1, one expert favoured", uses=_losses, pick="skewed",
          compare=_compare_loss)
LOSS.case("the gradient flows through P only: f is a count, even when the weights require grad",
          uses=_losses, pick="attached", compare=_compare_loss,
          hint="f_i is a fraction of choices: a count with no gradient. Only P, the mean "
               "probability, carries the gradient back to the router; nothing may flow through "
               "the routing's weights or through f (no soft or straight-through count).",
          recipe="Build f from routing.expert alone (a count, converted to the logits' dtype) "
                 "and build P from the softmax of the logits; do not use routing.weight.")


def _compare_no_tokens(got: Any, expected: dict[str, Any]) -> None:
    value = got.get("value") if isinstance(got, dict) else None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not torch.isfinite(value).all():
        raise CheckFailed("no tokens (logits of shape (0, 4), routing of shape (0, 2)): the loss "
                          f"is {value.item()}", expected="0 (nothing to balance)",
                          got=value.item(),
                          hint="With no tokens both f (a count over 0 choices) and P (a mean over "
                               "0 tokens) are 0 / 0. A rank whose share of the batch is empty "
                               "adds its loss to the model's like any other: nan there makes "
                               "every gradient nan after the all-reduce.",
                          recipe="Return a 0 that stays in the logits' graph when there is no "
                                 "choice (logits.sum() * 0), before dividing.")
    _compare_loss(got, expected)


def _compare_balanced(got: Any, expected: list[float]) -> None:
    got = per_rank(got, len(expected), "value") if isinstance(got, list) else got
    for (T, E, k, kind), g in zip(BALANCE_SETTINGS, got):
        if not isinstance(g, float) or abs(g - 1.0) > 1e-12:
            raise CheckFailed(f"{T} tokens, {E} experts, k={k}, {kind}: the loss is "
                              f"{describe(g, 60)}, expected exactly 1", expected=1.0, got=g,
                              hint="When every expert gets the same share of the choices (f_i = "
                                   "1/E), or the router gives every expert the same probability "
                                   "(P_i = 1/E), the loss is E * sum(f_i P_i) = 1 whatever k is.",
                              recipe="Normalise f by the number of choices, tokens times k, so "
                                     "that it sums to 1; P is a mean of probabilities, so it sums "
                                     "to 1 too. Multiply by num_experts.")


def gradient_inputs(seed: int) -> dict[str, tuple[torch.Tensor, Routing, int]]:
    """The (logits, routing, num_experts) router_gradient is asked about."""
    logits, routing = balance_inputs(seed + 11, 12, 4, 1, avoid=2)
    empty = torch.zeros(0, 4, dtype=torch.float64)
    none = torch.zeros(0, 2, dtype=torch.int64)
    return {"k=2, with dropped choices": (*balance_inputs(seed + 9, 24, 6, 2), 6),
            "k=3, one expert favoured": (*balance_inputs(seed + 10, 15, 5, 3, skew=0.8), 5),
            "float32, an expert no choice reaches": (logits.detach().float(), routing, 4),
            "no tokens": (empty, Routing(none, none.double(), none, none.bool()), 4)}


@LOSS.shared
def _router_gradients(load_balancing_loss: Any, seed: int) -> dict[str, Any]:
    router_gradient = LOSS.companion(load_balancing_loss, "router_gradient")
    if router_gradient is None:
        return {"missing": True}
    return {name: plain(router_gradient(*args)) for name, args in gradient_inputs(seed).items()}


def _compare_router_gradients(got: Any, expected: dict[str, Any]) -> None:
    if not isinstance(got, dict) or got.get("missing"):
        raise CheckFailed("no router_gradient function was found next to load_balancing_loss",
                          hint="Define router_gradient(logits, routing, num_experts) in the "
                               "task's cell.")
    for name, want in expected.items():
        have = got.get(name)
        tol = 1e-5 if want.dtype == torch.float32 else 1e-10
        wrong = tensor_mismatch(have, want, rtol=tol, atol=tol * 1e-2)
        if wrong:
            raise CheckFailed(f"router_gradient, {name}: {wrong} (autograd's gradient of the "
                              "loss)", expected=describe(want), got=describe(have),
                              hint=_gradient_hint(have, want))


def _gradient_hint(have: Any, want: torch.Tensor) -> str:
    if isinstance(have, torch.Tensor) and have.shape == want.shape and want.numel():
        ratio = (have.double() * want.double()).sum() / want.double().square().sum()
        if abs(float(ratio) - 1) > 1e-3 and torch.allclose(have.double(), ratio * want.double(),
                                                            rtol=1e-6, atol=1e-12):
            return (f"Right direction, {float(ratio):.3g}x the size: P_i is a mean over the T "
                    "tokens, so each token's row carries E / T, whatever k is (k enters "
                    "through f only).")
    return ("Differentiate E * sum_i f_i P_i with f constant: P_i is the mean over tokens of "
            "the softmax, whose Jacobian has a diagonal part (p_tj) and a part every logit "
            "shares (-p_ti p_tj). Both parts count: each row is p_t times (f minus the "
            "p_t-weighted mean of f), times E / T.")


LOSS.case("router_gradient: the loss's gradient by hand equals autograd's (k = 2 and 3, "
          "float32, an expert no choice reaches, no tokens)", uses=_router_gradients,
          compare=_compare_router_gradients, expect="router_gradient_by_autograd", weight=2.5,
          recipe="Detach the logits; count f as in the loss; take the softmax p (T, E); per "
                 "token form the weighted mean of f under p_t; return E / T times p times (f "
                 "minus that mean). With no tokens return zeros of the logits' shape.")
LOSS.case("perfect balance gives exactly 1, for k = 1, 2 and 4", uses=_losses, pick="balanced",
          compare=_compare_balanced, expect="perfect_balance")
LOSS.case("no tokens (a rank whose share of the batch is empty): 0, not nan, and backward works",
          weight=0.5, uses=_losses, pick="no tokens", compare=_compare_no_tokens)


# --------------------------------------------------------------------------- task 13.3

# The two shared runs: 12 tokens on each of 2 ranks; 10, 7, 13 and 4 tokens on 4 ranks. The
# tokens lean towards one expert (skew), so loads are uneven and some choices are dropped.
MOE_RUNS: dict[str, dict[str, Any]] = {
    "2 ranks": {"world_size": 2, "experts": 4, "d_model": 16, "d_hidden": 32, "k": 2,
                "capacity_factor": 1.0, "tokens": [12, 12], "favourite": 1, "skew": 1.0},
    "4 ranks": {"world_size": 4, "experts": 8, "d_model": 16, "d_hidden": 32, "k": 2,
                "capacity_factor": 1.25, "tokens": [10, 7, 13, 4], "favourite": 5, "skew": 1.0},
}
# The edges real runs reach, one shared run each. ``lean`` puts the regime in, whatever the seed:
# every token's first feature is 1 and the router's first column gives those experts that
# logit (+30: every token's first choice, router collapse; -30: no token's choice at all).
# The trusted expectation checks that each run really is in its regime (``idle``, ``empty``).
MOE_EDGES: dict[str, dict[str, Any]] = {
    "router collapse, 2 ranks": {
        "world_size": 2, "experts": 4, "d_model": 16, "d_hidden": 32, "k": 1,
        "capacity_factor": 4.0, "tokens": [8, 8], "favourite": 0, "skew": 0.0, "lean": {0: 30.0},
        "regime": "every token picks expert 0, so rank 1's experts get no token",
        "idle": [1]},
    "an expert no token picks, 4 ranks": {
        "world_size": 4, "experts": 4, "d_model": 16, "d_hidden": 32, "k": 2,
        "capacity_factor": 2.0, "tokens": [6, 5, 7, 4], "favourite": 0, "skew": 0.0,
        "lean": {3: -30.0},
        "regime": "every token avoids expert 3, so rank 3, its only holder, gets no token",
        "idle": [3]},
    "a rank with no tokens, 4 ranks": {
        "world_size": 4, "experts": 8, "d_model": 16, "d_hidden": 32, "k": 2,
        "capacity_factor": 1.25, "tokens": [6, 0, 5, 3], "favourite": 2, "skew": 1.0,
        "regime": "rank 1 has 0 tokens (an empty (0, d_model) batch) but its experts get some",
        "empty": [1]},
    "an input without grad, 2 ranks": {
        "world_size": 2, "experts": 4, "d_model": 16, "d_hidden": 32, "k": 1,
        "capacity_factor": 4.0, "tokens": [8, 8], "favourite": 0, "skew": 0.0, "lean": {0: 30.0},
        "input_grad": False,
        "regime": "x needs no grad and every token picks expert 0: only the experts' parameters "
                  "tie rank 1's output to the combine all-to-all",
        "idle": [1]},
}
MOE_CONFIGS = {**MOE_RUNS, **MOE_EDGES}
EDGE_HANG = ("A rank whose experts got no token skipped the backward all-to-all: its output did "
             "not depend on the rows it received and its experts' parameters, so backward never "
             "reached the combine's all-to-all there.")


def moe_router(seed: int, name: str) -> torch.nn.Linear:
    """The run's float64 router: ``make_router``'s, with the run's ``lean`` in its first column."""
    cfg = MOE_CONFIGS[name]
    router = make_router(cfg["d_model"], cfg["experts"], seed=seed, dtype=torch.float64)
    if cfg.get("lean"):
        with torch.no_grad():
            router.weight[:, 0] = 0.0
            for expert, logit in cfg["lean"].items():
                router.weight[expert, 0] = logit
    return router


def moe_inputs(seed: int, name: str, rank: int, router: torch.nn.Module
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s float64 tokens (T_r, d_model), leaning to the run's favourite expert, and
    the upstream gradient its outputs are multiplied by."""
    cfg = MOE_CONFIGS[name]
    T, d = cfg["tokens"][rank], cfg["d_model"]
    x = skewed_tokens(T, d, router, favourite=cfg["favourite"], skew=cfg["skew"],
                      seed=seed * 1009 + rank, dtype=torch.float64)
    if cfg.get("lean"):
        x[:, 0] = 1.0  # the feature the router's lean reads
    g = torch.Generator().manual_seed(seed * 1013 + rank + 500)
    return x, torch.randn(T, d, generator=g, dtype=torch.float64)


def _moe_on_rank(ExpertParallelMoE: Any, seed: int, name: str) -> dict[str, Any]:
    """One rank: build under the meter, one forward and one backward under the tracer."""
    import torch.distributed as dist

    from kit import meter
    from kit.trace import region, trace

    cfg = MOE_CONFIGS[name]
    rank, W = dist.get_rank(), dist.get_world_size()
    E, d = cfg["experts"], cfg["d_model"]
    mine = expert_range(E, W, rank)
    with meter.track() as usage:
        router = moe_router(seed, name)
        experts = make_experts(E, d, cfg["d_hidden"], seed=seed, which=mine, dtype=torch.float64)
        moe = ExpertParallelMoE(router, experts, cfg["k"], cfg["capacity_factor"])
    x, upstream = moe_inputs(seed, name, rank, make_router(d, E, seed=seed, dtype=torch.float64))
    x.requires_grad_(cfg.get("input_grad", True))
    with trace() as t:
        with region("forward"):
            out = moe(x)
        with region("backward"):
            (out * upstream).sum().backward()
    spans = {e.op: (e.start, e.end) for e in t.events if e.kind == "region"}

    def collectives(phase: str) -> list[list[Any]]:
        start, end = spans[phase]
        return [[e.op, int(e.nbytes)] for e in t.events
                if e.kind == "collective" and start <= e.start <= end]

    # The gradients of the objects this run built and passed in, never the module's attributes.
    return {"out": plain(out), "x_grad": plain(x.grad),
            "expert_grads": {e: [plain(p.grad) for p in experts[i].parameters()]
                             for i, e in enumerate(mine)},
            "router_grad": plain(router.weight.grad),
            "forward": collectives("forward"), "backward": collectives("backward"),
            "held": usage.alive}


def _compare_outputs(got: Any, expected: dict[str, Any]) -> None:
    ranks = per_rank(got, len(expected["ranks"]))
    for rank, (g, e) in enumerate(zip(ranks, expected["ranks"])):
        wrong = tensor_mismatch(g["out"], e["out"], rtol=1e-10, atol=1e-10)
        if wrong:
            raise CheckFailed(f"rank {rank}: the output of its {e['out'].shape[0]} tokens {wrong} "
                              f"(it kept {e['kept']} choices and dropped {e['dropped']})",
                              expected=describe(e["out"]), got=describe(g["out"]),
                              cause=OUTPUTS_WRONG)


# Gradients of a forward whose outputs differ differ for that reason: the outputs case names it.
OUTPUTS_WRONG = "the outputs differ"


def _outputs_wrong(ranks: list[Any], expected: dict[str, Any]) -> bool:
    return any(not isinstance(g, dict) or tensor_mismatch(g.get("out"), e["out"], rtol=1e-10,
                                                          atol=1e-10) is not None
               for g, e in zip(ranks, expected["ranks"]))


def _compare_grads(got: Any, expected: dict[str, Any]) -> None:
    ranks = per_rank(got, len(expected["ranks"]))
    try:
        _compare_grad_values(ranks, expected)
    except CheckFailed as e:
        if _outputs_wrong(ranks, expected):
            e.cause = OUTPUTS_WRONG
        raise


def _compare_grad_values(ranks: list[Any], expected: dict[str, Any]) -> None:
    for rank, (g, e) in enumerate(zip(ranks, expected["ranks"])):
        if e["x_grad"] is None:  # the input needs no grad: backward must not make one
            wrong = None if g["x_grad"] is None else "exists, though x does not require grad"
        elif g["x_grad"] is None and e["x_grad"].numel() == 0:
            wrong = None  # no tokens: an empty gradient and none alike
        else:
            wrong = tensor_mismatch(g["x_grad"], e["x_grad"], rtol=1e-10, atol=1e-10)
        if wrong:
            raise CheckFailed(f"rank {rank}: the gradient of its input tokens {wrong}",
                              expected=describe(e["x_grad"]), got=describe(g["x_grad"]))
        for expert, want in e["expert_grads"].items():
            have = g["expert_grads"].get(expert)
            for i, w in enumerate(want):
                h = have[i] if isinstance(have, list) and i < len(have) else None
                if h is None and not w.any():
                    continue  # an expert no token reached has no gradient: zero or None alike
                wrong = tensor_mismatch(h, w, rtol=1e-10, atol=1e-10)
                if wrong:
                    raise CheckFailed(f"rank {rank}: the gradient of expert {expert}'s parameter "
                                      f"{i} {wrong}", expected=describe(w),
                                      got=describe(h),
                                      hint=GRAD_HINT, recipe=GRAD_RECIPE)
    grads = [torch.zeros_like(expected["router_grad"]) if g["router_grad"] is None
             and e["out"].shape[0] == 0 else g["router_grad"]  # no tokens: no gradient, or 0
             for g, e in zip(ranks, expected["ranks"])]
    if any(not isinstance(g, torch.Tensor) for g in grads):
        raise CheckFailed("the router got no gradient on some rank",
                          expected="router.weight.grad on every rank",
                          got=[describe(g, 40) for g in grads],
                          hint="The routing weights multiply the experts' outputs: the router "
                               "learns through them.",
                          recipe="Multiply each returned expert output by its choice's weight "
                                 "from route(), without detaching it.")
    wrong = tensor_mismatch(sum(grads), expected["router_grad"], rtol=1e-10, atol=1e-10,
                            world_size=len(ranks))
    if wrong:
        raise CheckFailed(f"the router's gradient summed over ranks {wrong}",
                          expected=describe(expected["router_grad"]), got=describe(sum(grads)),
                          hint="The router is replicated and each rank's gradient covers its own "
                               "tokens only: the caller all-reduces it, as DDP would. The module "
                               "itself must not reduce it.",
                          recipe="Leave router.weight.grad as backward leaves it on each rank.")


GRAD_HINT = ("An expert's gradient gathers every token sent to it, from every rank: the "
             "all-to-all that brought the tokens must carry their gradients back, and the one "
             "that returned the results must bring the results' gradients in.")
GRAD_RECIPE = ("Make the dispatch differentiable: in backward, an all-to-all's gradient is the "
               "all-to-all of the output's gradient with the input and output splits swapped. "
               "Use the experts you were given, as they are (no copies).")


def _compare_pattern(got: Any, expected: dict[str, Any]) -> None:
    ranks = per_rank(got, len(expected["ranks"]))
    count_limit = expected["count_bytes"]
    for rank, (g, e) in enumerate(zip(ranks, expected["ranks"])):
        out, back = e["sent_bytes"], e["received_bytes"]
        want = (f"one all-to-all of counts (at most {count_limit} bytes), then the kept tokens out "
                f"({out} bytes = {e['kept']} kept choices x d_model x 8) and the results back "
                f"({back} bytes)")
        fwd = g["forward"]
        if (len(fwd) != 3 or any(op not in A2A for op, _ in fwd) or fwd[0][1] > count_limit
                or [b for _, b in fwd[1:]] != [out, back]):
            raise CheckFailed(f"rank {rank}'s forward made {_ops(fwd)}; expected {want}",
                              expected=[["counts", f"<= {count_limit}"], ["tokens", out],
                                        ["results", back]], got=fwd)
        bwd = g["backward"]
        if (len(bwd) != 2 or any(op not in A2A for op, _ in bwd)
                or [b for _, b in bwd] != [out, back]):
            raise CheckFailed(f"rank {rank}'s backward made {_ops(bwd)}; expected the mirror of "
                              f"the forward: the results' gradients ({out} bytes) and the tokens' "
                              f"gradients ({back} bytes), two all-to-alls and nothing else",
                              expected=[["results' gradients", out], ["tokens' gradients", back]],
                              got=bwd,
                              hint="Backward retraces the two token all-to-alls with their "
                                   "splits swapped; the counts need no gradient, and the "
                                   "router's gradient is the caller's to reduce.",
                              recipe=GRAD_RECIPE)


def _ops(events: list[list[Any]]) -> str:
    if not events:
        return "no collective"
    return ", ".join(f"{op} of {nbytes} bytes" for op, nbytes in events)


MOE = task(
    "13.3", forbidden=ALL_GATHERS,
    preload=("kit.meter",),
    hint="Expert parallelism: each rank holds E/W experts, rank r the experts r*E/W to "
         "(r+1)*E/W - 1. A rank routes its own tokens, tells every rank how many of them it will "
         "send to each of its experts (one all-to-all of counts), sends each kept choice's token "
         "to the rank holding its expert (an all-to-all with uneven splits), runs its experts on "
         "what arrived, and sends the results back the same way, where they are weighted and "
         "summed in the tokens' order. A dropped choice is never sent and contributes zero.",
    recipe="In forward: logits from the router, capacity = ceil(k * T * capacity_factor / E), "
           "route. Take the kept choices, sorted by expert (then slot): the order of the send "
           "buffer, grouped by destination rank. Count them per expert and exchange the counts "
           "with one all-to-all; the rows you send to and receive from each rank are sums of "
           "those counts. Send the chosen tokens with an all-to-all of those splits; what "
           "arrives is grouped by source rank, then by local expert, so cut it by the counts "
           "received and run each local expert on its rows. Send the results back with the "
           "splits swapped, multiply each by its choice's weight and add it into the output row "
           "of its token. Make both all-to-alls differentiable (backward: the same all-to-all "
           "with the splits swapped).",
)


# One shared run per world size: every case of that world size judges it.
MOE_SHARED = {name: MOE.shared(partial(_moe_on_rank, name=name), world_size=cfg["world_size"],
                               timeout=RANK_TIMEOUT_S) for name, cfg in MOE_RUNS.items()}

for _name, _run in MOE_SHARED.items():
    _expect = partial(lambda seed, n: MOE.trusted("moe_in_one_process")(seed, n), n=_name)
    _shape = "12 tokens each" if _name == "2 ranks" else "10, 7, 13 and 4 tokens, dropped choices"
    MOE.case(f"{_name} ({_shape}): outputs equal the single-process MoE", uses=_run,
             compare=_compare_outputs, expect=_expect)
    MOE.case(f"{_name}: input, expert and router gradients equal the single-process MoE",
             uses=_run, compare=_compare_grads, expect=_expect, hint=GRAD_HINT, recipe=GRAD_RECIPE)
    MOE.case(f"{_name}: one count exchange and two token all-to-alls of kept x d_model bytes "
             "per forward, mirrored in backward", uses=_run, compare=_compare_pattern,
             expect=_expect, weight=3, saving=True,  # with the bound, half the task
             hint="The recorder counts what each rank sends: one small all-to-all of counts, "
                  "then exactly one row of d_model values per kept choice out, and one per "
                  "received choice back. Dropped choices are not sent, nothing is padded to "
                  "the capacity, and nothing else is communicated.",
             recipe="Exchange the per-expert counts first (they give every rank its receive "
                    "splits), then send only the kept choices' rows with uneven splits, and "
                    "return exactly the rows you received.")



def _compare_edge(got: Any, expected: dict[str, Any]) -> None:
    _compare_outputs(got, expected)
    _compare_grad_values(per_rank(got, len(expected["ranks"])), expected)


for _name, _cfg in MOE_EDGES.items():
    _expect = partial(lambda seed, n: MOE.trusted("moe_in_one_process")(seed, n), n=_name)
    MOE.case(f"{_name} ({_cfg['regime']}): outputs and gradients equal the single-process MoE",
             uses=MOE.shared(partial(_moe_on_rank, name=_name), world_size=_cfg["world_size"],
                             timeout=RANK_TIMEOUT_S),
             compare=_compare_edge, expect=_expect, hang=EDGE_HANG,
             hint="Every rank joins every all-to-all, forward and backward, whatever its load: "
                  "a rank with no tokens or whose experts got none, and an input that needs no "
                  "grad, run the same collectives as their peers.",
             recipe="Run every local expert on its received rows, even zero of them (an empty "
                    "batch is a valid one): then each rank's output depends on the received "
                    "rows and its experts' parameters, and backward reaches both all-to-alls "
                    "on every rank. Never return early or skip an idle expert.")


MOE.bound("expert weights per rank", formula=f"{BOUND_SLACK} x (router + E/W experts)",
          lost="the rank holds other ranks' experts as well as its own",
          uses=MOE_SHARED["4 ranks"], weight=2,
          pick=lambda data: {"measured": [r["held"] if isinstance(r, dict) else r for r in data]},
          expect=partial(lambda seed, n: MOE.trusted("expert_bytes_bound")(seed, n), n="4 ranks"),
          hint="Expert parallelism keeps E/W experts per rank: building the layer must allocate "
               "no copy of the other ranks' experts (no broadcast, no gather, no bank of all E).",
          recipe="Keep the experts you are given as they are, and find the others by rank: "
                 "expert e lives on rank e // (E / W); send tokens there instead of fetching "
                 "weights.")


# --------------------------------------------------------------------------- task 13.4

# (tokens T, experts E, k, dtype, kind) of each setting grouped_experts is run on; d_model 16
# and d_hidden 32 keep every row a multiple of 16 bytes, which F.grouped_mm needs on CPU.
GROUPED_D, GROUPED_H = 16, 32
GROUPED_SETTINGS: dict[str, tuple[int, int, int, str, str]] = {
    "k=2, float32": (24, 4, 2, "float32", "random"),
    "k=1, bfloat16": (20, 4, 1, "bfloat16", "random"),
    "k=3, 13 tokens on 4 experts, bfloat16": (13, 4, 3, "bfloat16", "random"),
    "an expert no token chooses": (16, 4, 2, "float32", "avoid 2"),
    "one expert": (9, 1, 1, "float32", "random"),
    "skewed": (32, 4, 2, "float32", "skewed"),
    "no tokens": (0, 4, 2, "float32", "random"),
    "lists": (10, 3, 2, "float32", "random"),  # expert, weight and the experts as Python lists
}
# The run the kernels and bytes of one forward are measured on: 8 experts, balanced.
GROUPED_MEASURED = (64, 8, 2, "float32", "random")
MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._grouped_mm",
           "aten.matmul", "aten.dot", "aten.mv", "aten.addmv", "aten.addbmm",
           "aten._scaled_grouped_mm")
# What one forward may allocate: this times the bytes of the grouped path's activations (rows
# of d_model and d_hidden per choice: F.grouped_mm measured 2.9x, a padded bmm 3.5x);
# a copy of the weights per choice holds d_model x d_hidden per choice (24x).
GROUPED_SLACK = 5.0


def grouped_inputs(seed: int, setting: tuple[int, int, int, str, str]) -> dict[str, torch.Tensor]:
    """float64 tokens, k distinct experts per token, weights summing to 1, the stacked experts
    and an upstream gradient. ``skewed`` sends about 3/4 of the first choices to expert 0;
    ``avoid 2`` never chooses expert 2."""
    T, E, k, _, kind = setting
    g = torch.Generator().manual_seed(seed * 131 + T * 7 + E + k)
    f64 = {"generator": g, "dtype": torch.float64}
    scores = torch.rand(T, E, **f64)
    if kind == "skewed":
        scores[:, 0] += (torch.rand(T, **f64) < 0.75) * 2.0
    if kind == "avoid 2":
        scores[:, 2] = -1.0
    expert = scores.argsort(dim=1, descending=True)[:, :k]
    return {"x": torch.randn(T, GROUPED_D, **f64), "expert": expert,
            "weight": torch.randn(T, k, **f64).softmax(-1),
            "w1": torch.randn(E, GROUPED_D, GROUPED_H, **f64) / GROUPED_D ** 0.5,
            "b1": 0.5 * torch.randn(E, GROUPED_H, **f64),
            "w2": torch.randn(E, GROUPED_H, GROUPED_D, **f64) / GROUPED_H ** 0.5,
            "b2": 0.5 * torch.randn(E, GROUPED_D, **f64),
            "upstream": torch.randn(T, GROUPED_D, **f64)}


GRADS = ("x", "weight", "w1", "b1", "w2", "b2")


def _grouped_once(grouped_experts: Any, seed: int, name: str) -> dict[str, Any]:
    setting = GROUPED_SETTINGS[name]
    dtype = getattr(torch, setting[3])
    data = grouped_inputs(seed, setting)
    leaves = {n: data[n].to(dtype).requires_grad_() for n in GRADS}
    args = dict(leaves, expert=data["expert"])
    if name == "lists":  # nested lists of ints, and lists of per-expert tensors
        per_expert = {n: list(leaves[n].detach().unbind(0)) for n in ("w1", "b1", "w2", "b2")}
        for part in per_expert.values():
            for p in part:
                p.requires_grad_()
        args.update(per_expert, expert=data["expert"].tolist())
    out = grouped_experts(args["x"], args["expert"], args["weight"], args["w1"], args["b1"],
                          args["w2"], args["b2"])
    if isinstance(out, torch.Tensor) and out.requires_grad:
        (out * data["upstream"].to(out.dtype)).sum().backward()
    grads = {}
    for n in GRADS:
        if name == "lists" and n in per_expert:
            parts = [p.grad if p.grad is not None else torch.zeros_like(p)
                     for p in per_expert[n]]
            grads[n] = plain(torch.stack(parts))
        else:
            grads[n] = plain(leaves[n].grad)
    return {"out": plain(out), "grads": grads}


def _error(fn: Any, *args: Any) -> list[str]:
    try:
        result = fn(*args)
    except ValueError as e:
        return ["ValueError", str(e)[:300]]
    except Exception as e:  # noqa: BLE001 - the wrong kind of error is an answer too
        return [type(e).__name__, str(e)[:200]]
    return ["returned", describe(result, 80)]


def _grouped_measured(grouped_experts: Any, seed: int) -> dict[str, Any]:
    from kit import meter

    data = grouped_inputs(seed, GROUPED_MEASURED)
    args = [data[n].float().requires_grad_() if n in GRADS else data[n]
            for n in ("x", "expert", "weight", "w1", "b1", "w2", "b2")]
    with meter.count_ops() as ops:
        grouped_experts(*args)
    with meter.track() as usage:
        out = grouped_experts(*args)
    del out
    bad = [data[n].float() for n in ("x", "expert", "weight", "w1", "b1", "w2", "b2")]
    bad[1] = bad[1].long().clone()
    bad[1][0, 0] = GROUPED_MEASURED[1]  # an expert past E
    return {"matmuls": {op: n for op, n in ops.items() if op in MATMULS},
            "held": usage.peak, "refusal": _error(grouped_experts, *bad)}


GROUPED = task(
    "13.4", reference=None,
    # forbids nothing: torch has no MoE layer; F.grouped_mm and torch.bmm are the tools the task
    # builds on (the grader's own reference is refused by the gates as always)
    hint="Dropless experts: sort the T*k choices by expert with a stable sort (row i of the "
         "flattened choices is token i // k), count the rows of each expert, run each layer as "
         "ONE matrix product over all the sorted rows (a grouped product with the groups' "
         "offsets, or a batched one over a buffer padded to the busiest expert), then put "
         "every result back in its token's row, multiplied by its choice's weight. No choice "
         "is dropped.",
    recipe="Flatten the expert indices, argsort them with stable=True, and take the tokens of "
           "the sorted rows by integer division by k. Bincount the experts (minlength E) and "
           "turn the running sum into int32 offsets. Gather the sorted tokens' rows, multiply "
           "them by w1 in one grouped product, add each row's expert's b1, apply GELU, multiply "
           "by w2 in a second grouped product and add b2. Multiply each row by its weight (the "
           "flattened weights in the same sorted order) and index_add the rows into a zero "
           "output at their tokens.",
)
GROUPED_RUNS = {name: GROUPED.shared(partial(_grouped_once, name=name))
                for name in GROUPED_SETTINGS}
GROUPED_MEASURE = GROUPED.shared(_grouped_measured)


def _tolerance(dtype: str, want: torch.Tensor) -> tuple[float, float]:
    scale = float(want.abs().max()) if want.numel() else 1.0
    return (1e-5, 1e-5 * max(scale, 1.0)) if dtype == "float32" else (2e-2, 2e-2 * scale)


def _compare_grouped(got: Any, expected: dict[str, Any], *, name: str) -> None:
    T, E, k, dtype, _ = GROUPED_SETTINGS[name]
    where = f"{name} ({T} tokens, {E} experts, k={k}, {dtype})"
    have = got.get("out") if isinstance(got, dict) else got
    want = expected["out"]
    rtol, atol = _tolerance(dtype, want)
    wrong = tensor_mismatch(have, want, rtol=rtol, atol=atol)
    if wrong:
        hint = ""
        if isinstance(have, torch.Tensor) and have.shape == want.shape and T:
            zero = (have.double().abs().amax(dim=1) == 0) & (want.abs().amax(dim=1) > 0)
            if zero.any():
                hint = (f"{int(zero.sum())} of the {T} tokens came back as zeros: their choices "
                        "were dropped (a dropless layer keeps every one) or never put back in "
                        "their tokens' rows.")
        raise CheckFailed(f"{where}: the output {wrong}", expected=describe(want),
                          got=describe(have), cause="grouped outputs", hint=hint)
    for n in GRADS:
        g, w = got["grads"].get(n), expected["grads"][n]
        if g is None and not w.any():
            continue  # nothing depends on it (no tokens): no gradient and a zero one alike
        rtol, atol = _tolerance(dtype, w)
        wrong = tensor_mismatch(g, w, rtol=rtol, atol=atol)
        if wrong:
            raise CheckFailed(f"{where}: the gradient of {n} {wrong}", expected=describe(w),
                              got=describe(g),
                              hint="Backward must reach x, every expert's weights and biases "
                                   "and the routing weights: build the output from them with "
                                   "differentiable ops (no .detach(), no in-place writes into "
                                   "a leaf, no .tolist() of the weights).")


_GROUPED_CASES = {
    "k=2, float32": "values and gradients, k=2, float32, against a loop over tokens in float64",
    "k=1, bfloat16": "values and gradients, k=1, bfloat16",
    "k=3, 13 tokens on 4 experts, bfloat16":
        "k=3, 13 tokens on 4 experts (counts that do not divide), bfloat16",
    "an expert no token chooses": "an expert no token chooses: an empty group, a zero gradient",
    "one expert": "one expert (E = 1, k = 1): a single group",
    "skewed": "a skewed batch (3/4 on one expert, which a capacity would cut): nothing dropped",
    "no tokens": "no tokens (T = 0): an empty output, backward works",
    "lists": "expert and weight as nested lists, the experts as lists of per-expert tensors",
}
for _name, _title in _GROUPED_CASES.items():
    GROUPED.case(_title, uses=GROUPED_RUNS[_name],
                 compare=partial(_compare_grouped, name=_name),
                 expect=partial(lambda seed, n: GROUPED.trusted("grouped_by_token")(seed, n),
                                n=_name),
                 weight=0.5 if _name in ("no tokens", "lists") else 1.0,
                 hint={"skewed": "A dropless layer computes every choice however many go to one "
                                 "expert: there is no capacity, no slot and nothing dropped.",
                       "an expert no token chooses": "An expert with no rows is a group of "
                       "size 0: its offset equals the previous one, and its weights get a zero "
                       "gradient.",
                       }.get(_name, ""))


def _compare_kernels(got: Any, expected: Any) -> None:
    matmuls = got.get("matmuls") if isinstance(got, dict) else None
    T, E, k, _, _ = GROUPED_MEASURED
    if not isinstance(matmuls, dict) or sum(matmuls.values()) != 2:
        raise CheckFailed(f"one forward ({T} tokens, {E} experts, k={k}) dispatched "
                          f"{describe(matmuls, 120)} matrix-product kernels; expected 2: one "
                          "grouped (or batched) product per layer over every expert's rows",
                          expected={"aten._grouped_mm or aten.bmm": 2}, got=matmuls,
                          hint="A loop over experts runs 2 matrix products per expert (E "
                               "kernel launches per layer, each on a few rows): the grouped "
                               "product runs every expert of a layer in one kernel, from the "
                               "rows sorted by expert and the offsets where each group ends.",
                          recipe="Call F.grouped_mm once per layer with the stacked weights and "
                                 "int32 offsets (or pad the groups into an (E, max rows, d) "
                                 "buffer and call torch.bmm once per layer); do not loop over "
                                 "experts.")


GROUPED.case("one forward on 8 experts runs 2 matrix-product kernels (one per layer), not one "
             "per expert", uses=GROUPED_MEASURE, compare=_compare_kernels, weight=5, saving=True)
GROUPED.bound("bytes one forward allocates",
              formula=f"{GROUPED_SLACK} x the grouped path's rows (T k rows of d_model and "
                      "d_hidden)",
              lost="a copy of the experts' weights per choice (gathered weights), or buffers "
                   "padded far beyond the choices", weight=3,
              uses=GROUPED_MEASURE, pick=lambda d: {"measured": [d["held"]]
                                                    if isinstance(d, dict) else d},
              expect="grouped_bytes_bound",
              hint="The grouped product needs the choices' rows and the experts' stacked weights "
                   "as they are: gathering w1[e] for every row holds d_model x d_hidden numbers "
                   "per choice.")


def _compare_refusal(got: Any, expected: Any) -> None:
    refusal = got.get("refusal") if isinstance(got, dict) else got
    if not (isinstance(refusal, list) and refusal[0] == "ValueError"):
        raise CheckFailed("an expert index of 8 with 8 stacked experts must raise a ValueError "
                          "naming the indices and E", expected="ValueError", got=refusal,
                          hint="An index past the stacked experts would read another expert's "
                               "offsets or fail deep inside the kernel: say what is wrong.",
                          recipe="Before sorting, compare the indices' minimum and maximum with "
                                 "0 and E - 1 and raise ValueError with the numbers otherwise.")


GROUPED.case("an expert index past E is a ValueError", uses=GROUPED_MEASURE,
             compare=_compare_refusal, weight=0.5)
