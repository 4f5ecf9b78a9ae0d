"""Lesson 13's checks rest on trusted pieces that are right, and measure what they claim.

The generic tests (tests/test_checks.py) prove every task passes on its solution and fails on its
stub and on every seeded bug. These prove the rest: the reference router against an independent
sort (numpy's lexsort) and against the solution on random shapes, capacities and ties
(hypothesis); the reference loss against its closed-form gradient; the single-process MoE
against the dense mixture it equals when nothing is dropped; the solution's expert-parallel
layer against it on world sizes the checks do not use (1 and 3, with a rank holding no token);
what the recorder and the meter report for the quantities the 13.3 checks read; which case
catches which cheat; and the lesson's own claims, run headless.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from case_support import failed_cases
from hypothesis import given, settings
from hypothesis import strategies as st
from lesson_support import check_outputs, pass_with_spawned_ranks, printed_text, run_headless

from autograder import course, gates
from autograder.lesson13 import ALL_GATHERS, MOE_RUNS, param_bytes
from autograder.references import lesson13 as ref
from autograder.registry import get_task
from kit.launcher import run_ranks
from kit.lessons import moe as props
from kit.lessons.moe import Routing, expert_range, make_experts, make_router, skewed_tokens

LESSON = 13
SOURCE = course.lesson(LESSON).source


def test_every_forbidden_name_of_13_3_resolves_and_covers_every_all_gather_route():
    assert get_task("13.3").forbidden == ALL_GATHERS
    for name in ALL_GATHERS:
        assert gates.resolve(name) is not None, name
    # the recorder's names for an all-gather on every route: dist.*, functional, ProcessGroup
    ops = {name.rsplit(".", 1)[1] for name in ALL_GATHERS}
    assert {"all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object"} <= ops


def test_the_helpers_hold_no_answer():
    assert not {"route", "load_balancing_loss", "ExpertParallelMoE", "AllToAll"} & set(dir(props))
    assert Routing._fields == ("expert", "weight", "slot", "kept")


def test_an_expert_has_the_same_weights_whichever_others_a_rank_builds():
    every = make_experts(8, 4, 6, seed=3)
    some = make_experts(8, 4, 6, seed=3, which=expert_range(8, 4, 2))
    for a, b in zip(every[4:6].parameters(), some.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="do not split evenly"):
        expert_range(6, 4, 0)


# --------------------------------------------------------------------------- 13.1


def _lexsorted_experts(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The k best experts per row by (-probability, index), with numpy's lexsort."""
    p = torch.softmax(logits, dim=-1).double().numpy()  # ties as the logits' dtype sees them
    index = np.arange(p.shape[1])
    return torch.from_numpy(np.stack([np.lexsort((index, -p[t]))[:k] for t in range(len(p))]))


@st.composite
def routing_problems(draw):
    """(T, E) float32 logits (random, or small integers full of ties), k and a capacity."""
    T, E = draw(st.integers(1, 24)), draw(st.integers(1, 8))
    k = draw(st.integers(1, E))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if draw(st.booleans()):
        logits = torch.randint(0, 3, (T, E), generator=g).float()
    else:
        logits = 4 * torch.randn(T, E, generator=g)
    return logits, k, draw(st.integers(0, 2 * T))


@settings(max_examples=50, deadline=None)
@given(problem=routing_problems())
def test_reference_route_keeps_every_rule(problem):
    logits, k, cap = problem
    r = ref.route(logits, k, cap)
    T, E = logits.shape
    assert torch.equal(r.expert.view(T, k), _lexsorted_experts(logits, k))  # ties to the lower
    probs = torch.softmax(logits, dim=-1).gather(1, r.expert)
    weight = probs if k == 1 else probs / probs.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(r.weight, weight * r.kept, rtol=1e-6, atol=1e-7)
    assert torch.equal(r.kept, r.slot >= 0) and int(r.slot.max()) < cap
    for e in range(E):  # slots 0..n-1 per expert, in priority order: choice-major, token order
        order = [(j, t) for j in range(k) for t in range(T) if r.expert[t, j] == e]
        slots = [int(r.slot[t, j]) for j, t in order]
        n = min(len(order), cap)
        assert slots == list(range(n)) + [-1] * (len(order) - n)


@settings(max_examples=60, deadline=None)
@given(problem=routing_problems())
def test_solution_route_equals_the_reference_on_random_problems(solution, problem):
    logits, k, cap = problem
    got, want = solution.route(logits, k, cap), ref.route(logits, k, cap)
    for field in Routing._fields:
        g, w = getattr(got, field), getattr(want, field)
        if field == "weight":
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(g, w), field


def test_plain_topk_on_this_machine_does_not_give_ties_to_the_lower_index():
    # What the 13.1 tie case and the lesson's claim rest on (torch's docs promise no order).
    assert torch.topk(torch.zeros(1, 4), 2).indices.tolist() != [[0, 1]]


# --------------------------------------------------------------------------- 13.2


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 20), E=st.integers(1, 8), data=st.data())
def test_reference_loss_and_its_gradient_match_the_closed_form(solution, T, E, data):
    k = data.draw(st.integers(1, E))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 10_000)))
    logits = torch.randn(T, E, generator=g, dtype=torch.float64, requires_grad=True)
    expert = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    kept = torch.rand(T, k, generator=g) > 0.3
    routing = Routing(
        expert, torch.zeros(T, k, dtype=torch.float64), torch.where(kept, 0, -1), kept
    )
    loss = ref.load_balancing_loss(logits, routing, E)
    f = torch.bincount(expert.reshape(-1), minlength=E).double() / (T * k)
    p = torch.softmax(logits.detach(), dim=-1)
    assert loss.item() == pytest.approx(E * (f * p.mean(0)).sum().item(), abs=1e-12)
    loss.backward()
    # d/dlogits of E * sum_i f_i mean_t p_ti: (E / T) * p_t * (f - p_t . f), row by row
    closed = (E / T) * p * (f - (p * f).sum(dim=1, keepdim=True))
    torch.testing.assert_close(logits.grad, closed, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(solution.router_gradient(logits, routing, E), closed, rtol=1e-10,
                               atol=1e-13)  # and the solution's gradient by hand is that form


# --------------------------------------------------------------------------- 13.3


def test_single_process_reference_is_the_dense_mixture_when_nothing_is_dropped():
    torch.manual_seed(0)
    d, E = 6, 4
    router = make_router(d, E, dtype=torch.float64)
    experts = make_experts(E, d, 8, dtype=torch.float64)
    x = torch.randn(10, d, dtype=torch.float64)
    out, routing = ref._moe(x, router, experts, E, cap=10 * E)  # k = E: every expert, all kept
    p = torch.softmax(router(x), dim=-1)
    dense = sum(p[:, e, None] * experts[e](x) for e in range(E))
    assert routing.kept.all()
    torch.testing.assert_close(out, dense, rtol=1e-12, atol=1e-12)


def _ep_against_one_process(impl, tokens, k, capacity_factor, E=6, d=8, h=12):
    """Each rank: the solution's layer and the reference MoE on the same tokens; both outputs,
    input gradients, its experts' gradients and its router gradient."""
    rank, W = dist.get_rank(), dist.get_world_size()
    router = make_router(d, E, seed=1, dtype=torch.float64)
    mine = expert_range(E, W, rank)
    experts = make_experts(E, d, h, seed=1, which=mine, dtype=torch.float64)
    layer = impl(router, experts, k, capacity_factor)
    x = skewed_tokens(tokens[rank], d, router, skew=1.0, seed=rank, dtype=torch.float64)
    x.requires_grad_()
    out = layer(x)
    out.sum().backward()
    all_experts = make_experts(E, d, h, seed=1, dtype=torch.float64)
    router_1 = make_router(d, E, seed=1, dtype=torch.float64)
    x1 = x.detach().clone().requires_grad_()
    cap = math.ceil(k * tokens[rank] * capacity_factor / E)
    out1, _ = ref._moe(x1, router_1, all_experts, k, cap)
    if out1.requires_grad:  # a rank without tokens has nothing to differentiate
        out1.sum().backward()
    def grads(params):  # an expert no token reached has no gradient: zero
        return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]

    zero = torch.zeros_like(router.weight)
    return {"out": (out.detach(), out1.detach()),
            "x_grad": (x.grad, torch.zeros_like(x) if x1.grad is None else x1.grad),
            "mine": list(mine), "expert_grads": grads(experts.parameters()),
            "every_expert_grads": [grads(expert.parameters()) for expert in all_experts],
            "router_grad": (zero if router.weight.grad is None else router.weight.grad,
                            zero if router_1.weight.grad is None else router_1.weight.grad)}


@pytest.mark.parametrize("tokens", [[9], [5, 0, 9]], ids=["1 rank", "3 ranks, one empty"])
def test_solution_layer_equals_one_process_on_other_world_sizes(solution, tokens):
    results = run_ranks(_ep_against_one_process, (solution.ExpertParallelMoE, tokens, 2, 1.0),
                        world_size=len(tokens), echo=False)
    for r in results:
        for key in ("out", "x_grad"):
            torch.testing.assert_close(*r[key], rtol=1e-10, atol=1e-12)
        # an expert's gradient covers the tokens every rank sent it
        want = [[sum(s["every_expert_grads"][e][i] for s in results) for i in range(4)]
                for e in r["mine"]]
        torch.testing.assert_close(r["expert_grads"], [g for e in want for g in e],
                                   rtol=1e-10, atol=1e-12)
    # the per-rank router gradients add up to the single processes' (each saw one rank's tokens)
    torch.testing.assert_close(sum(r["router_grad"][0] for r in results),
                               sum(r["router_grad"][1] for r in results), rtol=1e-10, atol=1e-12)
    assert results[-1]["out"][0].abs().sum() > 0


@settings(max_examples=6, deadline=None)
@given(st.data())
def test_solution_layer_equals_one_process_on_random_world_sizes_and_skews(solution, data):
    # world size 1 to 4, ranks with no tokens, k and the capacity drawn, tokens leaning to an
    # expert or collapsing onto it: the distributed layer is the single-process one per rank.
    W = data.draw(st.integers(1, 4), label="world size")
    tokens = data.draw(st.lists(st.integers(0, 9), min_size=W, max_size=W), label="tokens")
    E = W * data.draw(st.integers(1, 2), label="experts per rank")
    k = data.draw(st.integers(1, min(2, E)), label="k")
    capacity_factor = data.draw(st.sampled_from([0.5, 1.0, 1.25, 8.0]), label="capacity factor")
    results = run_ranks(_ep_against_one_process, (solution.ExpertParallelMoE, tokens, k,
                                                  capacity_factor, E),
                        world_size=W, echo=False, timeout=60)
    for r in results:
        for key in ("out", "x_grad"):
            torch.testing.assert_close(*r[key], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(sum(r["router_grad"][0] for r in results),
                               sum(r["router_grad"][1] for r in results), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bug", ["skips a local expert that received no row",
                                 "ties an idle rank's output to the received rows only"])
def test_an_idle_rank_that_skips_the_backward_all_to_all_is_a_finding_not_a_timeout(bugs, bug):
    from autograder.checking import run_checks
    from autograder.lesson13 import EDGE_HANG
    from autograder.results import TIMEOUT

    impl = next(i for description, i in bugs["13.3"] if description.startswith(bug))
    report = run_checks("13.3", impl)
    hung = [c for c in report.cases if c.status == TIMEOUT]
    assert hung, report.to_text()
    for case in hung:
        assert case.message.startswith(EDGE_HANG), case.message
        assert "Deadlock after" in case.message and "already returned" in case.message
        assert "waiting in all_to_all_single" in case.message
        assert case.seconds < 5, f"{case.name} took {case.seconds:.1f} s to report its hang"
    collapse = [c.name for c in hung if c.name.startswith("an input without grad")]
    assert collapse, "the case with an input that needs no grad did not catch it"
    # both fixes pass every case of the friendly runs: only the edges see the defect
    assert all(
        c.status == "passed" for c in report.cases if c.name.startswith(("2 ranks", "4 ranks"))
    )


def _one_rank_without_experts(impl):
    router = make_router(8, 2, dtype=torch.float64)
    mine = range(2) if dist.get_rank() == 0 else range(0)  # rank 0: both, so E would be 4
    try:
        impl(router, make_experts(2, 8, 8, which=mine, dtype=torch.float64), 1, 1.0)
    except ValueError as e:
        return str(e)
    return None


def test_a_rank_without_experts_is_a_clear_error(solution):
    messages = run_ranks(_one_rank_without_experts, (solution.ExpertParallelMoE,), world_size=2,
                         echo=False)
    assert messages[0] is not None and "router scores 2 experts" in messages[0], messages
    assert messages[1] is not None and "experts_local is empty" in messages[1], messages


def _a2a_bytes():
    import torch.distributed._functional_collectives as funcol

    from kit.trace import trace

    rank = dist.get_rank()
    send = [[1, 3, 0], [2, 0, 4], [0, 5, 1]][rank]
    recv = [[1, 2, 0], [3, 0, 5], [0, 4, 1]][rank]
    x = torch.zeros(sum(send), 7, dtype=torch.float64)
    with trace() as t:
        dist.all_to_all_single(x.new_empty(sum(recv), 7), x, recv, send)
        funcol.wait_tensor(funcol.all_to_all_single(x, recv, send, dist.group.WORLD))
    return [(e.op, e.nbytes, e.route) for e in t.events]


def test_the_recorder_counts_an_uneven_all_to_all_as_the_rows_this_rank_sends():
    # 13.3's byte checks rest on this: each rank's all_to_all_single is its own input buffer
    # (its send splits times the row size), on the dist route and the functional one alike.
    events = run_ranks(_a2a_bytes, world_size=3, echo=False)
    for rank, sent in enumerate([4, 6, 6]):
        assert events[rank] == [("all_to_all_single", sent * 56, "dist"),
                                ("all_to_all_single", sent * 56, "functional")]


def test_the_meter_sees_exactly_the_router_and_local_experts_of_the_solution():
    from autograder.lesson13 import MOE_SHARED

    cfg = MOE_RUNS["4 ranks"]
    data = MOE_SHARED["4 ranks"](load_solution().ExpertParallelMoE, 0)
    router = make_router(cfg["d_model"], cfg["experts"], dtype=torch.float64)
    local = make_experts(cfg["experts"], cfg["d_model"], cfg["d_hidden"], which=range(2),
                         dtype=torch.float64)
    exact = param_bytes(router) + param_bytes(local)
    assert [r["held"] for r in data] == [exact] * 4


def load_solution():
    from conftest import solutions

    return solutions(LESSON)


@pytest.mark.parametrize("bug, caught_by", [
    ("exchanges no counts: a fixed split", "2 ranks: one count exchange"),
    ("sends and computes the dropped choices too (weighted 0)", "count exchange"),
    ("sends every token to every rank", "count exchange"),
    ("copies every expert onto every rank", "expert weights per rank"),
])
def test_what_only_the_recorder_or_the_meter_can_see(bugs, bug, caught_by):
    # Each of these gives every rank the right outputs on 2 ranks: only the communication
    # pattern or the bytes held give it away.
    impl = next(i for description, i in bugs["13.3"] if description.startswith(bug))
    failed = failed_cases("13.3", impl)
    assert failed and any(caught_by in name for name in failed), failed
    assert not any(name.startswith("2 ranks (12 tokens each): outputs") for name in failed)


# --------------------------------------------------------------------------- 13.4


def test_grouped_experts_is_the_capacity_moe_when_nothing_drops(solution):
    # the dropless layer on stack_experts' weights equals the single-process capacity layer
    # (and so does the loop reference's formula) when the capacity keeps every choice
    torch.manual_seed(0)
    router, experts = make_router(16, 4, seed=2), make_experts(4, 16, 32, seed=2)
    x = skewed_tokens(40, 16, router, skew=1.5, seed=3)
    with torch.no_grad():
        want, routing = ref._moe(x, router, experts, 2, cap=80)
        got = solution.grouped_experts(x, routing.expert, routing.weight,
                                       *props.stack_experts(experts))
    assert routing.kept.all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bug, caught_by", [
    ("loops over experts", "2 matrix-product kernels"),
    ("gathers every choice's expert weights", "bytes one forward allocates"),
    ("a padded torch.bmm (a right answer by the other route)", "an expert index past E"),
])
def test_only_the_kernel_count_or_the_meter_sees_a_loop_or_copied_weights(bugs, bug, caught_by):
    # right values everywhere: one measured property fails, nothing else (the padded bmm, which
    # validates nothing, loses only the refusal: the kernel count and the bound accept it)
    from bugs.lesson13 import grouped_padded_bmm

    impl = grouped_padded_bmm if "padded" in bug else next(
        i for description, i in bugs["13.4"] if description.startswith(bug))
    failed = failed_cases("13.4", impl)
    assert len(failed) == 1 and caught_by in failed[0], failed


# --------------------------------------------------------------------------- the lesson


@pytest.mark.slow
def test_lesson13_runs_headless_and_shows_what_it_claims():
    result = run_headless(LESSON, timeout=300, budget=300)
    printed = printed_text(result)
    assert "a stable descending sort:            [[0, 1]]" in printed
    assert "every rank equals the single-process layer: True" in printed
    for k in (2, 3, 4):
        assert f"({k}.0x the bytes of k=1)" in printed
    without, with_aux = (
        line for line in printed.splitlines() if "aux loss" in line and "dropped" in line
    )
    drop = [int(line.split("% dropped")[0].rsplit(" ", 1)[1]) for line in (without, with_aux)]
    assert drop[0] > 5 * max(drop[1], 1)  # collapse drops far more without the aux loss
    biased = next(line for line in printed.splitlines() if line.startswith("bias balancing"))
    assert drop[0] > 5 * max(int(biased.split("% dropped")[0].rsplit(" ", 1)[1]), 1)
    assert (
        "divided by the world size: router as one process: True, experts as one process: True"
        in printed
    )
    assert "(their gradients 2.00x one process's)" in printed
    assert "grouped_mm equals the loop over experts: True" in printed
    assert printed.count("all of them tokens that lost a choice: True") == 2
    assert "capacity factor    8:    0 choices dropped; outputs differ on   0 tokens" in printed
    for E in (4, 8, 16):  # a loop of 2 per expert (all get rows here), one per layer grouped
        assert f"E={E:2d}: loop over experts {2 * E:2d} matrix products, grouped 2" in printed
    check_outputs(result)


@pytest.mark.slow
def test_13_3_passes_with_spawned_ranks_as_on_macos(solution, monkeypatch):
    pass_with_spawned_ranks(monkeypatch, solution, {"13.3": 0})


def test_a_nan_loss_on_no_tokens_loses_only_the_empty_case_with_feedback_naming_it(bugs):
    from autograder.checking import run_checks

    report = run_checks("13.2", dict(bugs["13.2"])["no tokens: 0 / 0, a nan loss"])
    failed = [c for c in report.cases if c.status != "passed"]
    assert [c.name.split(" (")[0] for c in failed] == ["no tokens"], report.to_text()
    assert "the loss is nan" in failed[0].message and "0 / 0" in failed[0].hint
