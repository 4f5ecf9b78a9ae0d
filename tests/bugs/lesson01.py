"""Seeded bugs of Lesson 01: tree_broadcast (1.1), ring_all_reduce (1.2), store_barrier (1.3),
fit_alpha_beta and ring_all_reduce_time (1.4). Each is a typical mistake; every one must fail."""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch.distributed import all_reduce as all_reduce_imported_early
from torch.distributed import broadcast as broadcast_imported_early

from bugs import edited_solution

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


broadcast_ignores_src = edited_solution(1, (  # a correct binomial tree, always rooted at rank 0
    "    vrank = (rank - src) % world_size  # the source is vrank 0\n",
    "    src = 0\n    vrank = rank\n")).tree_broadcast


def broadcast_with_collective(tensor: torch.Tensor, src: int = 0) -> None:
    dist.broadcast(tensor, src)


# --------------------------------------------------------------------------- 1.2 ring_all_reduce

_CHUNKS = ("    chunks = tensor.view(-1).tensor_split(world_size)"
           "  # p views (n,) -> sizes n//p or n//p + 1\n")
_END = "            handle.wait()\n    ### END SOLUTION"


def _ring(*edits: tuple[str, str]):
    return edited_solution(1, *edits).ring_all_reduce


ring_skips_last_chunk = _ring((_CHUNKS, (  # the n % p leftover elements are never reduced
    "    size = tensor.numel() // world_size\n"
    "    chunks = [tensor.view(-1)[i * size:(i + 1) * size] for i in range(world_size)]\n")))
ring_without_all_gather = _ring((
    "for step in range(world_size - 1):  # all-gather", "for step in range(0):  # all-gather"))
# torch.chunk makes ceil(n / ceil(n / p)) chunks: fewer than p when n < p (3 on 5 ranks) or
# for 42 elements on 8 ranks (7 of 6), so ranks index past the end
ring_with_torch_chunk = _ring((_CHUNKS, "    chunks = tensor.view(-1).chunk(world_size)\n"))
ring_averages = _ring((_END, (  # all_reduce's default op is SUM, not mean
    "            handle.wait()\n"
    "    if tensor.is_floating_point():\n"
    "        tensor.div_(world_size)\n"
    "    ### END SOLUTION")))


def ring_calls_all_reduce(tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor)


ring_on_a_copy = _ring(
    (_CHUNKS, "    tensor = tensor.clone()  # the caller's tensor is never changed\n" + _CHUNKS),
    (_END, "            handle.wait()\n    return tensor\n    ### END SOLUTION"))

# --------------------------------------------------------------------------- 1.3 store_barrier

_OPEN = ("    if arrived == (use + 1) * world_size:  # the last rank of this use opens the gate\n"
         '        store.set(f"{name}/open/{use}", "1")\n')
_WAIT = '    store.wait([f"{name}/open/{use}"])\n'


def _barrier(*edits: tuple[str, str]):
    return edited_solution(1, *edits).store_barrier


barrier_not_reusable = _barrier((  # only the first use ever sets the key; later ones pass
    "    use = (arrived - 1) // world_size", "    use = 0"))
barrier_counts_ever = _barrier((_OPEN + _WAIT, (  # true once, then never again
    '    while store.add(f"{name}/arrived", 0) < world_size:\n'
    "        pass\n")))
barrier_off_by_one = _barrier((  # leaves when all but one arrived
    "    if arrived == (use + 1) * world_size:",
    "    if arrived >= use * world_size + world_size - 1:"))
barrier_only_rank0_waits = _barrier(
    (_WAIT, "    if rank == 0:  # the others leave at once\n    " + _WAIT))

# --------------------------------------------------------------------------- 1.4 cost model
# The check finds ring_all_reduce_time beside fit_alpha_beta, as one notebook cell defines both:
# each bug is the solution's fit_alpha_beta, with one of the two functions edited.

_SOLVED = edited_solution(1)
_FIT = ("    beta = ((n - n.mean()) * (t - t.mean())).sum() / ((n - n.mean()) ** 2).sum()\n"
        "    alpha = t.mean() - beta * n.mean()\n")
_TIME = "    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta\n"


def _fit(*edits: tuple[str, str]):
    return edited_solution(1, *edits).fit_alpha_beta


def _pair(fit, time_model) -> types.FunctionType:
    """``fit`` with ``ring_all_reduce_time`` beside it, as one notebook cell defines both."""
    return types.FunctionType(fit.__code__, {**fit.__globals__, "ring_all_reduce_time": time_model},
                              fit.__name__, fit.__defaults__, fit.__closure__)


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


_BUGS_1_4 = [
    ("fits a line through the origin", _fit((_FIT, (  # no latency term at all
        "    beta = (n * t).sum() / (n * n).sum()\n    alpha = beta * 0\n")))),
    ("fits through the first and last point", _fit((_FIT, (  # the line through the end points
        "    beta = (t[-1] - t[0]) / (n[-1] - n[0])\n    alpha = t[0] - beta * n[0]\n")))),
    ("returns (beta, alpha)", _fit(("return alpha.item(), beta.item()",
                                   "return beta.item(), alpha.item()"))),
    ("predicts only the reduce-scatter half", _fit((
        _TIME, "    return (p - 1) * alpha + (p - 1) / p * nbytes * beta\n"))),
    ("sends the whole buffer in every step", _fit((  # not one chunk of it
        _TIME, "    return 2 * (p - 1) * (alpha + nbytes * beta)\n"))),
    ("pays the latency once", _fit((  # not once per step
        _TIME, "    return alpha + 2 * (p - 1) / p * nbytes * beta\n"))),
    ("calls the grader's least-squares reference",
     _pair(_fit_by_the_grader, _SOLVED.ring_all_reduce_time)),
    ("predicts with kit.lessons.costmodel.ring_all_reduce_time",
     _pair(_SOLVED.fit_alpha_beta, _time_from_kit)),
]

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
        ("copies the grader's reference code at load time",
         _copy_of_the_reference("ring_all_reduce")),
    ],
    "1.3": [
        ("not reusable: a key set on the first use lets later uses through", barrier_not_reusable),
        ("not reusable: waits for a count that only grows", barrier_counts_ever),
        ("lets ranks go when all but one arrived", barrier_off_by_one),
        ("only rank 0 waits", barrier_only_rank0_waits),
    ],
    "1.4": _BUGS_1_4,
}
