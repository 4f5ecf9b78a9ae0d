"""Seeded bugs of Lesson 01: tree_broadcast (1.1), ring_all_reduce (1.2), store_barrier (1.3),
fit_alpha_beta and ring_all_reduce_time (1.4). Each is a typical mistake; every one must fail."""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch.distributed import all_reduce as all_reduce_imported_early
from torch.distributed import broadcast as broadcast_imported_early

# --------------------------------------------------------------------------- 1.1 tree_broadcast


def broadcast_loop_from_src(tensor: torch.Tensor, src: int = 0) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == src:  # p - 1 sequential sends: correct data, linear time
        for dst in range(world_size):
            if dst != src:
                dist.send(tensor, dst)
    else:
        dist.recv(tensor, src)


def broadcast_chain(tensor: torch.Tensor, src: int = 0) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    vrank = (rank - src) % world_size  # a pipeline: each rank forwards to the next
    if vrank > 0:
        dist.recv(tensor, (rank - 1) % world_size)
    if vrank < world_size - 1:
        dist.send(tensor, (rank + 1) % world_size)


def broadcast_ignores_src(tensor: torch.Tensor, src: int = 0) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mask = 1  # a correct binomial tree, but always rooted at rank 0
    while mask < world_size:
        if rank & mask:
            dist.recv(tensor, rank - mask)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if rank + mask < world_size:
            dist.send(tensor, rank + mask)
        mask >>= 1


def broadcast_with_collective(tensor: torch.Tensor, src: int = 0) -> None:
    dist.broadcast(tensor, src)


# --------------------------------------------------------------------------- 1.2 ring_all_reduce


def _ring(tensor: torch.Tensor, chunks: list[torch.Tensor], *, gather: bool = True) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for step in range(world_size - 1):
        out, into = chunks[(rank - step) % world_size], chunks[(rank - step - 1) % world_size]
        incoming = torch.empty_like(into)
        for req in (dist.isend(out, right), dist.irecv(incoming, left)):
            req.wait()
        into.add_(incoming)
    for step in range(world_size - 1 if gather else 0):
        out, into = chunks[(rank + 1 - step) % world_size], chunks[(rank - step) % world_size]
        for req in (dist.isend(out, right), dist.irecv(into, left)):
            req.wait()


def ring_skips_last_chunk(tensor: torch.Tensor) -> None:
    world_size = dist.get_world_size()
    flat = tensor.view(-1)
    size = flat.numel() // world_size  # the n % p leftover elements are never reduced
    _ring(tensor, [flat[i * size:(i + 1) * size] for i in range(world_size)])


def ring_without_all_gather(tensor: torch.Tensor) -> None:
    _ring(tensor, list(tensor.view(-1).tensor_split(dist.get_world_size())), gather=False)


def ring_with_torch_chunk(tensor: torch.Tensor) -> None:
    # torch.chunk makes ceil(n / ceil(n / p)) chunks: fewer than p when n < p (3 on 5 ranks) or
    # for 42 elements on 8 ranks (7 of 6), so ranks index past the end
    _ring(tensor, list(tensor.view(-1).chunk(dist.get_world_size())))


def ring_averages(tensor: torch.Tensor) -> None:
    _ring(tensor, list(tensor.view(-1).tensor_split(dist.get_world_size())))
    if tensor.is_floating_point():
        tensor.div_(dist.get_world_size())  # all_reduce's default op is SUM, not mean


def ring_calls_all_reduce(tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor)


def ring_on_a_copy(tensor: torch.Tensor) -> torch.Tensor:
    result = tensor.clone()  # the caller's tensor is never changed
    _ring(result, list(result.view(-1).tensor_split(dist.get_world_size())))
    return result


# --------------------------------------------------------------------------- 1.3 store_barrier


def barrier_not_reusable(store: dist.Store, rank: int, world_size: int, name: str) -> None:
    count = store.add(name, 1)
    if count == world_size:  # only the first use ever sets the key; later uses pass at once
        store.set(f"{name}/done", "1")
    store.wait([f"{name}/done"])


def barrier_counts_ever(store: dist.Store, rank: int, world_size: int, name: str) -> None:
    store.add(name, 1)
    while store.add(name, 0) < world_size:  # true once, then never again
        pass


def barrier_off_by_one(store: dist.Store, rank: int, world_size: int, name: str) -> None:
    count = store.add(f"{name}/arrived", 1)
    use = (count - 1) // world_size
    if count >= use * world_size + world_size - 1:  # leaves when all but one arrived
        store.set(f"{name}/done/{use}", "1")
    store.wait([f"{name}/done/{use}"])


def barrier_only_rank0_waits(store: dist.Store, rank: int, world_size: int, name: str) -> None:
    count = store.add(f"{name}/arrived", 1)
    use = (count - 1) // world_size
    if count == (use + 1) * world_size:
        store.set(f"{name}/done/{use}", "1")
    if rank == 0:  # the others leave at once
        store.wait([f"{name}/done/{use}"])


# --------------------------------------------------------------------------- 1.4 cost model


def _good_fit(nbytes, seconds) -> tuple[float, float]:
    x = torch.as_tensor(nbytes, dtype=torch.float64)
    t = torch.as_tensor(seconds, dtype=torch.float64)
    beta = ((x - x.mean()) * (t - t.mean())).sum() / ((x - x.mean()) ** 2).sum()
    return (t.mean() - beta * x.mean()).item(), beta.item()


def _good_time(nbytes, world_size, alpha, beta) -> float:
    p = world_size
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta


def _pair(fit, time_model) -> types.FunctionType:
    """``fit`` with ``ring_all_reduce_time`` beside it, as one notebook cell defines both."""
    return types.FunctionType(fit.__code__, {**fit.__globals__, "ring_all_reduce_time": time_model},
                              fit.__name__, fit.__defaults__, fit.__closure__)


def _fit_through_origin(nbytes, seconds) -> tuple[float, float]:
    x = torch.as_tensor(nbytes, dtype=torch.float64)
    t = torch.as_tensor(seconds, dtype=torch.float64)
    return 0.0, ((x * t).sum() / (x * x).sum()).item()  # no latency term at all


def _fit_two_points(nbytes, seconds) -> tuple[float, float]:
    x, t = list(map(float, nbytes)), list(map(float, seconds))
    beta = (t[-1] - t[0]) / (x[-1] - x[0])  # the line through the end points
    return t[0] - beta * x[0], beta


def _fit_swapped(nbytes, seconds) -> tuple[float, float]:
    alpha, beta = _good_fit(nbytes, seconds)
    return beta, alpha


def _time_without_factor_two(nbytes, world_size, alpha, beta) -> float:
    p = world_size  # only the reduce-scatter half
    return (p - 1) * alpha + (p - 1) / p * nbytes * beta


def _time_whole_buffer_per_step(nbytes, world_size, alpha, beta) -> float:
    p = world_size  # each step sends the whole buffer, not one chunk of it
    return 2 * (p - 1) * (alpha + nbytes * beta)


def _time_one_latency(nbytes, world_size, alpha, beta) -> float:
    p = world_size  # latency paid once, not once per step
    return alpha + 2 * (p - 1) / p * nbytes * beta


# --------------------------------------------------------------------------- exploits
# Each uses what the task re-implements, or the grader's code, by another route: the gates
# score the task 0 (tests/test_gates.py), the recorder sees the routes below Python.


def broadcast_imported_before_checks(tensor: torch.Tensor, src: int = 0) -> None:
    broadcast_imported_early(tensor, src)  # bound at import: no dist.* patch would see it


def broadcast_through_process_group(tensor: torch.Tensor, src: int = 0) -> None:
    dist.group.WORLD.broadcast([tensor], src).wait()  # a ProcessGroup method, no dist.* call


def ring_imported_before_checks(tensor: torch.Tensor) -> None:
    all_reduce_imported_early(tensor)


def ring_star_through_rank_0(tensor: torch.Tensor) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:  # p2p only, but a star: rank 0 sums everything and sends it back
        incoming = torch.empty_like(tensor)
        for src in range(1, world_size):
            dist.recv(incoming, src)
            tensor.add_(incoming)
        for dst in range(1, world_size):
            dist.send(tensor, dst)
    else:
        dist.send(tensor, 0)
        dist.recv(tensor, 0)


def ring_through_process_group(tensor: torch.Tensor) -> None:
    dist.group.WORLD.allreduce([tensor]).wait()


def ring_functional_collective(tensor: torch.Tensor) -> None:
    import torch.distributed._functional_collectives as funcol

    tensor.copy_(funcol.all_reduce(tensor, "sum", dist.group.WORLD))


def ring_found_by_name(tensor: torch.Tensor) -> None:
    getattr(dist, "all_" + "reduce")(tensor)  # no name in the source to find


def ring_swallows_the_gate(tensor: torch.Tensor) -> None:
    try:
        op = getattr(dist, "all_" + "reduce")
        op(tensor)
    except Exception:  # noqa: BLE001 - hides whatever stopped it, then tries again
        dist.group.WORLD.allreduce([tensor]).wait()


def ring_calls_the_graders_reference(tensor: torch.Tensor) -> None:
    import importlib

    grader = importlib.import_module("autograder.references.lesson01")
    grader.ring_all_reduce(tensor)


def _copy_of_the_reference(name: str) -> types.FunctionType:
    """The grader's reference made the student's at load time: a new function with the
    reference's code (no name of the grader in any task's source, and its frames look like the
    grader's to the run-time nets)."""
    import importlib

    reference = getattr(importlib.import_module("autograder.references." + "lesson01"), name)
    return types.FunctionType(reference.__code__, globals(), name, reference.__defaults__)


def _fit_by_the_grader(nbytes, seconds) -> tuple[float, float]:
    from autograder.references.lesson01 import fit_alpha_beta

    return fit_alpha_beta(nbytes, seconds)


def _time_from_kit(nbytes, world_size, alpha, beta) -> float:
    from kit.lessons import costmodel

    return costmodel.ring_all_reduce_time(nbytes, world_size, alpha, beta)


BUGS = {
    "1.1": [
        ("sends from src to every rank in turn (p - 1 rounds)", broadcast_loop_from_src),
        ("forwards along a chain (p - 1 rounds)", broadcast_chain),
        ("ignores src and broadcasts from rank 0", broadcast_ignores_src),
        ("calls dist.broadcast", broadcast_with_collective),
        ("calls broadcast imported before the checks started", broadcast_imported_before_checks),
        ("calls ProcessGroup.broadcast", broadcast_through_process_group),
    ],
    "1.2": [
        ("skips the last chunk (drops the n % p leftover)", ring_skips_last_chunk),
        ("stops after reduce-scatter (no all-gather)", ring_without_all_gather),
        ("uses torch.chunk (fewer chunks than ranks)", ring_with_torch_chunk),
        ("averages instead of summing", ring_averages),
        ("calls dist.all_reduce", ring_calls_all_reduce),
        ("works on a copy, not in place", ring_on_a_copy),
        ("calls all_reduce imported before the checks started", ring_imported_before_checks),
        ("a star: every rank sends to rank 0, which sums and sends back", ring_star_through_rank_0),
        ("calls ProcessGroup.allreduce", ring_through_process_group),
        ("calls a functional collective", ring_functional_collective),
        ("finds all_reduce by a computed name", ring_found_by_name),
        ("catches the gate's exception and tries another route", ring_swallows_the_gate),
        ("calls the grader's reference", ring_calls_the_graders_reference),
        ("copies the grader's reference code at load time", _copy_of_the_reference("ring_all_reduce")),
    ],
    "1.3": [
        ("not reusable: a key set on the first use lets later uses through", barrier_not_reusable),
        ("not reusable: waits for a count that only grows", barrier_counts_ever),
        ("lets ranks go when all but one arrived", barrier_off_by_one),
        ("only rank 0 waits", barrier_only_rank0_waits),
    ],
    "1.4": [
        ("fits a line through the origin", _pair(_fit_through_origin, _good_time)),
        ("fits through the first and last point", _pair(_fit_two_points, _good_time)),
        ("returns (beta, alpha)", _pair(_fit_swapped, _good_time)),
        ("predicts only the reduce-scatter half", _pair(_good_fit, _time_without_factor_two)),
        ("sends the whole buffer in every step", _pair(_good_fit, _time_whole_buffer_per_step)),
        ("pays the latency once", _pair(_good_fit, _time_one_latency)),
        ("calls the grader's least-squares reference", _pair(_fit_by_the_grader, _good_time)),
        ("predicts with kit.lessons.costmodel.ring_all_reduce_time", _pair(_good_fit, _time_from_kit)),
    ],
}
