"""Lesson 01's checks measure what they claim, and the lesson's solutions and model are right.

The generic tests (tests/test_checks.py) prove every task passes on the solution and fails on
the stub and on every seeded bug. These prove the pieces the checks rest on: the round count
of a broadcast, the cost model against independent references, and the solutions against
torch's own collectives on inputs the checks do not use.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import solutions
from hypothesis import given
from hypothesis import strategies as st

from autograder.lesson01 import count_rounds
from autograder.references.lesson01 import fit_alpha_beta as reference_fit
from autograder.registry import CheckFailed
from kit.launcher import run_ranks
from kit.lessons import costmodel
from kit.trace import launch_traced

LESSON = 1


def solution():
    return solutions(LESSON)


# --------------------------------------------------------------------------- round counting


def _binomial_messages(p: int, src: int) -> list[list[tuple[str, int]]]:
    """The (op, peer) calls of each rank in a binomial-tree broadcast, without any ranks."""
    calls: list[list[tuple[str, int]]] = [[] for _ in range(p)]
    for rank in range(p):
        vrank, mask = (rank - src) % p, 1
        while mask < p:
            if vrank & mask:
                calls[rank].append(("recv", (vrank - mask + src) % p))
                break
            mask <<= 1
        mask >>= 1
        while mask > 0:
            if vrank + mask < p:
                calls[rank].append(("send", (vrank + mask + src) % p))
            mask >>= 1
    return calls


def _loop_messages(p: int, src: int) -> list[list[tuple[str, int]]]:
    return [[("send", d) for d in range(p) if d != src] if r == src else [("recv", src)]
            for r in range(p)]


@given(st.integers(1, 64), st.data())
def test_binomial_tree_takes_ceil_log2_p_rounds(p, data):
    src = data.draw(st.integers(0, p - 1))
    assert count_rounds(_binomial_messages(p, src), src) == math.ceil(math.log2(p))


@given(st.integers(1, 64), st.data())
def test_sending_from_src_in_a_loop_takes_p_minus_1_rounds(p, data):
    src = data.draw(st.integers(0, p - 1))
    assert count_rounds(_loop_messages(p, src), src) == p - 1


def test_a_receive_without_its_send_is_reported_not_counted():
    with pytest.raises(CheckFailed, match="no matching send"):
        count_rounds([[], [("recv", 0)]], 0)


def _traced_broadcast(tree_broadcast, src):
    t = torch.full((5,), float(dist.get_rank()))
    tree_broadcast(t, src)
    return t.tolist()


@pytest.mark.parametrize("p, src", [(6, 4), (8, 1)])
def test_solution_broadcast_traced_on_real_ranks_takes_exactly_ceil_log2_p_rounds(p, src):
    result = launch_traced(_traced_broadcast, solution().tree_broadcast, src, world_size=p,
                           echo=False)
    assert list(result) == [[float(src)] * 5] * p
    messages = [[(e.op, e.peer) for e in lane] for lane in result.events]
    assert count_rounds(messages, src) == math.ceil(math.log2(p))
    assert sum(op == "send" for lane in messages for op, _ in lane) == p - 1  # a tree: p-1 edges


# --------------------------------------------------------------------------- ring all-reduce


def _ring_vs_torch(ring_all_reduce, n, dtype):
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    x = (torch.randn(n, generator=g) * 50).to(dtype)
    mine, theirs = x.clone(), x.clone()
    ring_all_reduce(mine)
    dist.all_reduce(theirs)
    return mine, theirs


@pytest.mark.parametrize("p, n, dtype", [(6, 40, torch.float32), (7, 5, torch.int64),
                                         (3, 0, torch.float32), (4, 9, torch.int64)])
def test_solution_ring_equals_torch_all_reduce(p, n, dtype):
    result = run_ranks(_ring_vs_torch, (solution().ring_all_reduce, n, dtype), {}, world_size=p,
                       echo=False)
    for mine, theirs in result:
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-4)


# --------------------------------------------------------------------------- cost model


@given(st.floats(1e-6, 1e-2), st.floats(1e-12, 1e-8))
def test_fits_recover_alpha_and_beta_from_exact_times(alpha, beta):
    sizes = [2.0**k for k in range(8, 28, 3)]
    seconds = [alpha + beta * n for n in sizes]
    for fit in (reference_fit, solution().fit_alpha_beta):
        a, b = fit(sizes, seconds)
        assert a == pytest.approx(alpha, rel=1e-6, abs=1e-12)
        assert b == pytest.approx(beta, rel=1e-6)


def test_fits_agree_with_numpy_polyfit_on_noisy_times():
    rng = np.random.default_rng(0)
    sizes = np.geomspace(1e3, 1e8, 12)
    seconds = (5e-5 + 2e-10 * sizes) * rng.uniform(0.7, 1.3, sizes.size)
    beta, alpha = np.polyfit(sizes, seconds, 1)  # an independent least-squares implementation
    for fit in (reference_fit, solution().fit_alpha_beta):
        a, b = fit(sizes.tolist(), torch.tensor(seconds))
        assert (a, b) == pytest.approx((alpha, beta), rel=1e-6)


def test_fit_refuses_a_single_message_size():
    with pytest.raises(ValueError, match="two different message sizes"):
        reference_fit([1024, 1024], [1e-4, 2e-4])


@given(st.integers(1, 1024), st.floats(1, 1e10))
def test_ring_prediction_has_bus_bandwidth_one_over_beta_when_latency_is_zero(p, nbytes):
    # The point of bus bandwidth: a bandwidth-bound ring reports the link speed for any p.
    beta = 1e-9
    for model in (costmodel.ring_all_reduce_time, solution().ring_all_reduce_time):
        seconds = model(nbytes, p, 0.0, beta)
        if p == 1:
            assert seconds == 0.0
        else:
            assert costmodel.bus_bandwidth("all_reduce", nbytes, seconds, p) == pytest.approx(
                1 / beta
            )


def test_ring_prediction_pays_latency_once_per_step():
    assert costmodel.ring_all_reduce_time(0, 8, 1e-5, 1e-9) == pytest.approx(14 * 1e-5)
    assert solution().ring_all_reduce_time(0, 8, 1e-5, 1e-9) == pytest.approx(14 * 1e-5)


def test_bus_bandwidth_names_the_known_ops_for_an_unknown_one():
    with pytest.raises(ValueError, match="all_reduce"):
        costmodel.bus_bandwidth("allreduce", 1, 1, 2)


# --------------------------------------------------------------------------- store barrier


def _barrier_leaves(store_barrier, port, uses):
    import time
    from datetime import timedelta

    rank, world_size = dist.get_rank(), dist.get_world_size()
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=timedelta(seconds=10))
    log = []
    for use in range(uses):
        if rank == use % world_size:
            time.sleep(0.03)
        arrived = time.perf_counter()
        store_barrier(store, rank, world_size, "epoch")
        log.append((arrived, time.perf_counter()))
    return log


def test_solution_barrier_holds_every_rank_until_the_last_arrives_use_after_use():
    from datetime import timedelta

    master = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10),
                           wait_for_workers=False)
    logs = run_ranks(_barrier_leaves, (solution().store_barrier, master.port, 5), {},
                     world_size=3, echo=False)
    for use in range(5):
        assert min(log[use][1] for log in logs) >= max(log[use][0] for log in logs)
