"""Checks for Lesson 01, "torch.distributed primitives": tasks 1.1 to 1.4.

The point-to-point tasks (1.1 ``tree_broadcast``, 1.2 ``ring_all_reduce``) run on real ranks
under :mod:`kit.trace`, so a check sees every ``torch.distributed`` call they make: they must
call no collective, and the broadcast must finish in ``ceil(log2 p)`` rounds, counted from the
messages the ranks really sent. Results are compared with torch's own ``dist.all_reduce`` on the
same random inputs (1.2) or with the source rank's data (1.1). Task 1.3 ``store_barrier`` is a
property check: with one rank arriving late in every round, no rank may leave before the last
one arrived. Task 1.4 compares with a least-squares fit and with
:func:`kit.lessons.costmodel.ring_all_reduce_time`. The answers live in
:mod:`autograder.references.lesson01` (trusted only), named here by string. The ranks of
1.1 and 1.2 run as shared runs; 1.2's reference, torch's all_reduce, runs through the very same
ones, so both sides see the same inputs and the same tracer.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import tempfile
import time
from datetime import timedelta
from functools import partial
from typing import Any

import torch

from autograder.compare import CheckFailed, assert_same, describe, per_rank, short
from autograder.registry import plain, task

# Every collective, by each name a route reaches it under (the recorder's op names, the
# functional collectives, the autograd-aware ones of torch.distributed.nn.functional, and the C++
# broadcast DDP syncs its buffers with): tasks 1.1 and 1.2 build theirs from point-to-point
# messages only.
_COLLECTIVE_OPS = (
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather",
    "all_gather_coalesced",
    "all_gather_single", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_single",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter",
    "barrier", "monitored_barrier", "all_gather_object", "gather_object", "broadcast_object_list",
    "scatter_object_list", "_all_gather_base", "_reduce_scatter_base", "_broadcast_coalesced",
)
COLLECTIVES = tuple(f"torch.distributed.{op}" for op in _COLLECTIVE_OPS) + tuple(
    f"torch.distributed._functional_collectives.{op}" for op in (
        "all_reduce", "broadcast", "all_gather_tensor", "reduce_scatter_tensor",
        "all_to_all_single", "all_reduce_coalesced", "all_gather_into_tensor_coalesced",
        "reduce_scatter_tensor_coalesced",
        "all_gather_tensor_autograd", "reduce_scatter_tensor_autograd",
        "all_to_all_single_autograd")) + ("torch.distributed.nn.functional",)

RANK_TIMEOUT_S = 30.0  # a deadlocked ring shows the launcher's hang report after this long
STORE_WAIT_S = 4.0  # how long store_barrier's waits may block before the check calls it stuck


def rank_tensor(seed: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s random input: normal floats, or integers in [-100, 100) for int64."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-100, 100, shape, generator=g, dtype=dtype)


def _no_collectives(collectives: list[list[str]], name: str) -> None:
    """Fail if any rank called a collective (``collectives``: each rank's op names)."""
    used = sorted({op for ops in collectives for op in ops})
    if used:
        raise CheckFailed(f"{name} called {', '.join(f'dist.{op}' for op in used)}: this task may "
                          "use only send/recv (or isend/irecv)", expected="no collective calls",
                          got=used,
                          hint="Build the operation from dist.send/dist.recv (or isend/irecv) "
                               "only.")


def _compare_tensors(got: list[Any], expected: list[torch.Tensor], what: str) -> None:
    for rank, (g, e) in enumerate(zip(got, expected)):
        if not isinstance(g, torch.Tensor):
            raise CheckFailed(f"{what}: rank {rank} ended with {describe(g, 80)}, not a tensor")
        # float sums in a different order than gloo's differ in the last bits only
        assert_same(g, e, rtol=1e-5, atol=1e-5, path=f"{what}, rank {rank}")


# --------------------------------------------------------------------------- task 1.1


def _broadcast_on_rank(tree_broadcast: Any, seed: int, src: int, shape: tuple[int, ...],
                       dtype: torch.dtype) -> dict[str, Any]:
    import torch.distributed as dist

    from kit.trace import trace

    rank = dist.get_rank()
    # Non-source ranks start from their own data: a broadcast must overwrite it.
    tensor = rank_tensor(seed, rank, shape, dtype)
    before = tensor.clone()
    with trace() as t:
        tree_broadcast(tensor, src)
    messages = [(e.op, e.peer) for e in t.events if e.kind == "p2p"]
    return {"tensor": plain(tensor), "input": before, "collectives": t.collectives(),
            "messages": messages}


def count_rounds(messages: list[list[tuple[str, int | None]]], src: int) -> int:
    """Rounds a broadcast took, from each rank's ordered (op, peer) p2p calls.

    A rank can send once per round, and only once it holds the data: its clock starts at 0 on
    ``src`` and at the round of the message that reached it elsewhere; each send happens in
    round clock + 1. The k-th send from a to b is the k-th receive on b from a (torch's ordering
    guarantee). A binomial tree needs ceil(log2 p) rounds; a loop of sends from src, p - 1.
    """
    p = len(messages)
    sends: dict[tuple[int, int], list[int]] = {}  # (from, to) -> round of each message sent
    taken: dict[tuple[int, int], int] = {}
    clock = [0] * p
    pos = [0] * p
    rounds = 0
    while True:
        progressed = False
        for r in range(p):
            while pos[r] < len(messages[r]):
                op, peer = messages[r][pos[r]]
                if peer is None or not 0 <= peer < p:
                    raise CheckFailed(f"rank {r} called {op} without a valid peer rank ({peer!r})",
                                      hint="Pass src= to recv/irecv and dst= to send/isend.")
                if op in ("send", "isend"):
                    clock[r] += 1
                    sends.setdefault((r, peer), []).append(clock[r])
                    rounds = max(rounds, clock[r])
                else:
                    k = taken.get((peer, r), 0)
                    sent = sends.get((peer, r), [])
                    if k >= len(sent):
                        break  # its matching send is not processed yet
                    taken[(peer, r)] = k + 1
                    clock[r] = max(clock[r], sent[k])
                pos[r] += 1
                progressed = True
        if all(pos[r] == len(messages[r]) for r in range(p)):
            return rounds
        if not progressed:
            raise CheckFailed("some receives have no matching send "
                              "(the ranks' calls do not pair up)")


def _broadcast_source(got: list[dict[str, Any]]) -> int | None:
    """The rank whose starting data every rank ended with, if one did (else None)."""
    finals = [g.get("tensor") for g in got]
    for r, g in enumerate(got):
        start = g.get("input")
        if isinstance(start, torch.Tensor) and all(
                isinstance(f, torch.Tensor) and f.shape == start.shape and torch.equal(f, start)
                for f in finals):
            return r
    return None


def _compare_broadcast(got: Any, expected: dict[str, Any]) -> None:
    got = per_rank(got, len(expected["tensors"]))
    _no_collectives([g["collectives"] for g in got], "tree_broadcast")
    src = expected["src"]
    source = _broadcast_source(got)
    if source is not None and source != src:
        raise CheckFailed(f"every rank ended with rank {source}'s data, not rank {src}'s: the "
                          f"broadcast went out from rank {source}, whatever src said",
                          expected=f"rank {src}'s data", got=f"rank {source}'s data",
                          cause="ignores src",
                          hint="The tree is the same whatever the source: only the numbering of "
                               "the ranks moves with src.",
                          recipe="Work with each rank's vrank, (rank - src) modulo world_size "
                                 "(the source is vrank 0), and turn a peer's vrank back into its "
                                 "rank by adding src modulo world_size.")
    _compare_tensors([g["tensor"] for g in got], expected["tensors"], f"broadcast from rank {src}")
    messages = [g["messages"] for g in got]
    rounds = count_rounds(messages, src)
    p = len(got)
    if rounds > expected["rounds"]:
        sends = [sum(op in ("send", "isend") for op, _ in m) for m in messages]
        shape = (f"rank {src} sent to all {p - 1} others itself, one a round"
                 if sends[src] == p - 1 and sum(sends) == p - 1 else
                 "every rank forwarded the data once, along a chain" if max(sends) == 1 else
                 "holders did not double every round")
        raise CheckFailed(f"the broadcast took {rounds} rounds on {p} ranks ({shape}); a binomial "
                          f"tree needs ceil(log2 {p}) = {expected['rounds']}",
                          expected=expected["rounds"], got=rounds, cause="too many rounds",
                          hint="In each round every rank that already holds the data sends it to "
                               "one rank that does not, so the number of holders doubles: a loop "
                               "of sends from src, or a chain, adds one holder a round.",
                          recipe="A rank that has received the data sends it on in every later "
                                 "round, to the rank 2^k places further in vrank order, largest "
                                 "k first, as in the lesson.")


BROADCAST = task(
    "1.1", reference="tree_broadcast", forbidden=COLLECTIVES,
    hint="A binomial tree: in every round each rank that already holds the data sends it to "
         "one rank that does not, so the number of holders doubles and p ranks are done in "
         "ceil(log2 p) rounds, with point-to-point messages only.",
    recipe="Number the ranks relative to the source: a rank's vrank is (rank - src) modulo p, "
           "so the source is vrank 0. Farthest subtree first, as in the lesson: every vrank but 0 "
           "first receives once, from the vrank that differs from it in its lowest set bit; then "
           "it sends to vrank + 2^k for each power of two 2^k below its lowest set bit (for "
           "vrank 0: below p), largest first, skipping targets >= p. Turn a vrank back into a "
           "rank with (vrank + src) % p.",
)


def _broadcast_case(name: str, world_size: int, src: int, shape: tuple[int, ...],
                    dtype: torch.dtype, hint: str = "", recipe: str = "") -> None:
    on_ranks = BROADCAST.shared(partial(_broadcast_on_rank, src=src, shape=shape, dtype=dtype),
                                world_size=world_size, timeout=RANK_TIMEOUT_S)
    BROADCAST.case(name, uses=on_ranks, compare=_compare_broadcast, hint=hint, recipe=recipe,
                   expect=lambda seed: BROADCAST.trusted("broadcast_from_src")(
                       seed, world_size, src, shape, dtype))


_broadcast_case("4 ranks from rank 0 (float32, 2 rounds)", 4, 0, (5, 3), torch.float32)
_broadcast_case("5 ranks from rank 3 (int64, 3 rounds)", 5, 3, (7,), torch.int64,
                hint="The tree is the same whatever the source: only the numbering of the ranks "
                     "moves with src.",
                recipe="Work with each rank's vrank, (rank - src) modulo world_size (the source "
                       "is vrank 0), and turn a peer's vrank back into its rank by adding src "
                       "modulo world_size.")
_broadcast_case("8 ranks from rank 6 (float64, 3 rounds)", 8, 6, (16,), torch.float64,
                hint="Sending from src to every rank in turn takes p - 1 rounds: let ranks that "
                     "already hold the data send too.")
_broadcast_case("7 ranks from rank 2 (not a power of two)", 7, 2, (4,), torch.float32,
                hint="When p is not a power of two, some subtrees of the tree are cut short: a "
                     "rank may have fewer children than its place in the tree allows.",
                recipe="Skip every child whose vrank is >= p: that rank does not exist.")
_broadcast_case("2 ranks from rank 1", 2, 1, (3,), torch.int64)
_broadcast_case("a single rank does nothing", 1, 0, (3,), torch.float32)


# --------------------------------------------------------------------------- task 1.2


def _ring_on_rank(ring_all_reduce: Any, seed: int,
                  configs: list[tuple[tuple[int, ...], torch.dtype]]) -> dict[str, Any]:
    import torch.distributed as dist

    from kit.trace import trace

    rank = dist.get_rank()
    tensors, inputs = [], []
    with trace() as t:
        for i, (shape, dtype) in enumerate(configs):
            tensor = rank_tensor(seed + 1000 * i, rank, shape, dtype)
            inputs.append(tensor.clone())
            ring_all_reduce(tensor)  # in place
            tensors.append(plain(tensor))
            t.events.append(None)  # a marker: the messages of the next config follow
    messages: list[list[tuple[str, int | None, int]]] = [[]]
    for e in t.events:
        if e is None:
            messages.append([])
        elif e.kind == "p2p":
            messages[-1].append((e.op, e.peer, e.nbytes))
    return {"tensors": tensors, "inputs": inputs, "collectives": [e.op for e in t.events
                                                if e is not None and e.kind == "collective"],
            "messages": messages[:-1]}


def _describe_config(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return f"{math.prod(shape)} elements of {str(dtype).replace('torch.', '')}"


def _compare_ring(got: Any, want: list[dict[str, Any]],
                  configs: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
    """One launch: ``got`` the student's ranks, ``want`` torch's all_reduce on the same inputs."""
    got = per_rank(got, len(want))
    _no_collectives([g["collectives"] for g in got], "ring_all_reduce")
    for i, (shape, dtype) in enumerate(configs):
        what = f"{len(got)} ranks, {_describe_config(shape, dtype)}"
        tensors, expected = [g["tensors"][i] for g in got], [w["tensors"][i] for w in want]
        try:
            _compare_ring_pattern([g["messages"][i] for g in got], math.prod(shape),
                                  torch.empty((), dtype=dtype).element_size(), what)
        except CheckFailed as e:
            if e.cause == "half a ring":
                _name_the_half(e, tensors, expected)
            raise
        _ring_values_slip(tensors, [g["inputs"][i] for g in got], expected, what)
        _compare_tensors(tensors, expected, what)


def _name_the_half(e: CheckFailed, tensors: list[Any], expected: list[torch.Tensor]) -> None:
    """A ring that took p - 1 steps ran one of its two halves: the values say which."""
    p = len(expected)
    full = []
    for g, want in zip(tensors, expected):
        if not isinstance(g, torch.Tensor) or g.shape != want.shape:
            return
        pairs = zip(g.reshape(-1).tensor_split(p), want.reshape(-1).tensor_split(p))
        full.append(sum(bool(a.numel()) and torch.allclose(a.double(), b.double(), rtol=1e-5,
                                                            atol=1e-5) for a, b in pairs))
    if full and all(f == 1 for f in full):
        e.message += (": each rank holds one fully reduced chunk, so the reduce-scatter ran and "
                      "the all-gather that shares those chunks did not")
        e.hint = ("A ring all-reduce is two rings in a row: after the p - 1 steps of "
                  "reduce-scatter each rank holds one chunk of the sum; p - 1 more steps of "
                  "all-gather pass those chunks round so that every rank holds them all.")


def _ring_values_slip(tensors: list[Any], inputs: list[Any], expected: list[torch.Tensor],
                      what: str) -> None:
    """Wrong values named by what they are: the input untouched (not in place), the sum divided
    by the world size, or right except for the n % p leftover elements at the end."""
    p = len(expected)
    for rank, (g, x, want) in enumerate(zip(tensors, inputs, expected)):
        if not isinstance(g, torch.Tensor) or g.shape != want.shape or g.dtype != want.dtype:
            return
        if torch.allclose(g.double(), want.double(), rtol=1e-5, atol=1e-5):
            continue
        n = want.numel()
        if isinstance(x, torch.Tensor) and torch.equal(g, x):
            # with n < p a split into n // p = 0 elements per chunk also leaves it untouched
            raise CheckFailed(f"{what}: rank {rank}'s tensor is unchanged: the result was not "
                              "written into the tensor passed in"
                              + ("" if n >= p else f" (or, with {n} elements on {p} ranks, every "
                                 "element fell outside chunks of n // p = 0)"),
                              expected=short(want), got=short(g), cause="unchanged",
                              hint="ring_all_reduce works in place, like dist.all_reduce: write "
                                   "every chunk into a flat view that shares the tensor's "
                                   "memory; a returned copy is never seen by the caller."
                                   + ("" if n >= p else " And the p chunks must cover every "
                                      "element, even when n < p."))
        if want.is_floating_point() and p > 1 and torch.allclose(
                g.double() * p, want.double(), rtol=1e-4, atol=1e-5):
            raise CheckFailed(f"{what}: rank {rank}'s tensor is 1/{p} of the sum: the result "
                              "was divided by the world size", expected=short(want),
                              got=short(g), cause="averaged",
                              hint="An all-reduce with ReduceOp.SUM (dist.all_reduce's default) "
                                   "leaves the sum on every rank: do not divide by the world "
                                   "size; whoever wants the mean divides afterwards.")
        wrong = (~torch.isclose(g.double().reshape(-1), want.double().reshape(-1), rtol=1e-5,
                                atol=1e-5)).nonzero().flatten()
        if n % p and len(wrong) and int(wrong.min()) >= n - n % p:
            raise CheckFailed(f"{what}: on rank {rank} only the last {len(wrong)} of {n} elements "
                              f"are wrong: the n % p = {n % p} leftover elements were never "
                              "reduced", expected=short(want), got=short(g), cause="leftover",
                              hint="When p does not divide n the chunks differ in size by one "
                                   "(and with n < p some are empty): the p chunks must cover "
                                   "every element, the leftover ones included.")


RING_PATTERN_HINT = ("A ring: every rank sends only to its right neighbour (rank + 1) % p and "
                     "receives only from its left (rank - 1) % p, one chunk of about n / p "
                     "elements per message, in 2(p - 1) steps (p - 1 to reduce-scatter, p - 1 "
                     "to all-gather).")


def _only_neighbour(what: str, rank: int, messages: list[tuple[int | None, int]], neighbour: int,
                    sending: bool) -> None:
    """Fail unless every one of ``rank``'s sends (``sending``) or receives names ``neighbour``,
    its right or its left neighbour in the ring."""
    others = sorted({peer for peer, _ in messages if peer != neighbour})
    if others:
        verb, past, only, side = (("sends to", "sent to", "sends only to", "right") if sending else
                                  ("receives from", "received from", "receives only from", "left"))
        raise CheckFailed(f"{what}: rank {rank} {past} rank(s) {others}; in a ring it {only} its "
                          f"{side} neighbour {neighbour}",
                          expected=f"{verb} rank {neighbour} only",
                          got=sorted({peer for peer, _ in messages}), hint=RING_PATTERN_HINT)


def _compare_ring_pattern(messages: list[list[tuple[str, int | None, int]]], n: int, size: int,
                          what: str) -> None:
    """Each rank's p2p messages of one call: 2(p-1) sends to the right neighbour and 2(p-1)
    receives from the left, none longer than ceil(n / p) elements."""
    p = len(messages)
    chunk = -(-n // p) * size if p else 0  # bytes of the largest chunk
    peers = [({peer for op, peer, _ in calls if op in ("send", "isend")},
              {peer for op, peer, _ in calls if op in ("recv", "irecv")}) for calls in messages]
    hub = next((r for r, (to, fr) in enumerate(peers)
                if max(len(to), len(fr)) > 1 and to | fr >= set(range(p)) - {r}), None)
    if hub is not None:
        raise CheckFailed(f"{what}: rank {hub} exchanged messages with every other rank (a star "
                          f"through rank {hub}); in a ring each rank sends only to its right "
                          "neighbour and receives only from its left",
                          expected="sends to (rank + 1) % p only",
                          got={f"rank {hub} sends to": sorted(peers[hub][0]),
                               f"rank {hub} receives from": sorted(peers[hub][1])},
                          cause="star",
                          hint=f"A star sends every rank's whole tensor through one rank: rank "
                               f"{hub}'s link carries (p - 1) n elements each way while the "
                               "others idle. A ring keeps every link busy with chunks of n / p, "
                               "so each rank moves 2(p - 1)/p n elements whatever p is.")
    for rank, calls in enumerate(messages):
        sends = [(peer, b) for op, peer, b in calls if op in ("send", "isend")]
        recvs = [(peer, b) for op, peer, b in calls if op in ("recv", "irecv")]
        if p > 1:
            _only_neighbour(what, rank, sends, (rank + 1) % p, sending=True)
            _only_neighbour(what, rank, recvs, (rank - 1) % p, sending=False)
        steps = 2 * (p - 1)
        too_big = [b for _, b in sends + recvs if b > chunk]
        if too_big:
            whole = max(too_big) >= n * size
            raise CheckFailed(f"{what}: rank {rank} moved a message of {max(too_big)} bytes"
                              + (" (the whole tensor)" if whole else "") + "; each step carries "
                              f"one chunk, at most ceil(n / p) elements = {chunk} bytes",
                              expected=f"<= {chunk} bytes a message", got=f"{max(too_big)} bytes",
                              cause="whole tensor per message" if whole else "messages too big",
                              hint="Split the tensor into p chunks and send one chunk a step: "
                                   "that is what makes the ring's traffic per rank "
                                   "2(p - 1)/p n elements instead of n per message.")
        if len(sends) != steps or len(recvs) != steps:
            half = len(sends) == len(recvs) == p - 1
            raise CheckFailed(f"{what}: rank {rank} sent {len(sends)} and received {len(recvs)} "
                              f"messages; a ring all-reduce on {p} ranks takes 2(p - 1) = {steps} "
                              "steps, one send and one receive each"
                              + (", and p - 1 is half of that" if half else ""), expected=steps,
                              got={"sends": len(sends), "receives": len(recvs)},
                              cause="half a ring" if half else "wrong number of steps",
                              hint=RING_PATTERN_HINT)


RING = task(
    "1.2", reference="ring_all_reduce", forbidden=COLLECTIVES,
    hint="A ring all-reduce is a reduce-scatter followed by an all-gather over p chunks: each "
         "rank only sends to its right neighbour and receives from its left, one chunk of about "
         "n / p elements per step, sending and receiving at the same time, 2(p - 1) steps.",
    recipe="Split a flat view of the tensor (it shares memory) into p chunks whose sizes differ "
           "by at most one; tensor_split does that, and some may be empty. Reduce-scatter, steps "
           "s = 0 .. p-2: send chunk (rank - s) % p to the right while receiving the left "
           "neighbour's chunk into a scratch buffer of the same size, then add it into your "
           "chunk (rank - s - 1) % p. All-gather, steps s = 0 .. p-2: send chunk "
           "(rank + 1 - s) % p and receive chunk (rank - s) % p straight into place. Post each "
           "step's send and receive together (batch_isend_irecv) and wait for both.",
)


def _ring_case(name: str, world_size: int, configs: list[tuple[tuple[int, ...], torch.dtype]],
               hint: str = "",
               also: tuple[int, list[tuple[tuple[int, ...], torch.dtype]]] | None = None,
               recipe: str = "") -> None:
    """A case on ``world_size`` ranks; ``also`` adds a second launch (world size, configs) that
    must pass too (a single rank, which any implementation passes, never stands alone). The
    expected data is the reference (torch's all_reduce) through the same runs, on real ranks."""
    launches = [(world_size, configs)] + ([also] if also else [])
    on_ranks = [RING.shared(partial(_ring_on_rank, configs=c), world_size=w, timeout=RANK_TIMEOUT_S)
                for w, c in launches]

    def run(ring_all_reduce: Any, seed: int) -> list[list[dict[str, Any]]]:
        return [launch(ring_all_reduce, seed) for launch in on_ranks]

    def compare(got: Any, expected: list[list[dict[str, Any]]]) -> None:
        if not isinstance(got, list) or len(got) != len(expected):
            raise CheckFailed("expected one result per launch", got=describe(got))
        for g, e, (_, c) in zip(got, expected, launches):
            _compare_ring(g, e, c)

    RING.case(name, compare=compare, hint=hint, recipe=recipe)(run)


_F32, _F64, _I64 = torch.float32, torch.float64, torch.int64
_ring_case("4 ranks, 1000 float32 elements", 4, [((1000,), _F32)])
_ring_case("3 ranks, 10 and 11 elements (not divisible by 3)", 3, [((10,), _F64), ((11,), _I64)],
           hint="When p does not divide n the chunks differ in size by one: every message "
                "must carry exactly the chunk it stands for.",
           recipe="Split with tensor_split (sizes n // p or n // p + 1) and size each receive "
                  "buffer to the chunk it will be added to.")
_ring_case("5 ranks, 3 elements (fewer elements than ranks)", 5,
           [((3,), _I64), ((1,), _F32), ((0,), _F64)],
           hint="With n < world_size some chunks are empty; every rank must still take part in "
                "every step, or its neighbours wait for it forever.",
           recipe="tensor_split always returns p chunks (torch.chunk returns fewer here); send "
                  "and receive the empty ones too: an empty message is fine.")
_ring_case("8 ranks, a 2-D 6x7 float64 tensor and 13 int64", 8, [((6, 7), _F64), ((13,), _I64)],
           hint="The result is in place, whatever the tensor's shape: work on a flat view that "
                "shares memory with it.",
           recipe="view(-1) of a contiguous tensor shares its memory: writing a chunk of it "
                  "writes the tensor.")
_ring_case("2 ranks, 64 float32 elements; and 1 rank (nothing to do)", 2, [((64,), _F32)],
           also=(1, [((5,), _F32)]))


# --------------------------------------------------------------------------- task 1.3


def _barrier_on_rank(store_barrier: Any, seed: int, host: str, port: int | None, path: str | None,
                     names: list[str], late: list[int]) -> list[tuple[float, float]]:
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    if path is not None:
        store: Any = dist.FileStore(path, world_size)
    else:
        store = dist.TCPStore(host, port, world_size, is_master=False,
                              timeout=timedelta(seconds=10))
    # A correct barrier waits ~50 ms here; a broken one that waits for a key nobody sets fails
    # after this long with DistStoreError instead of holding the check up.
    store.set_timeout(timedelta(seconds=STORE_WAIT_S))
    times = []
    for name, late_rank in zip(names, late):
        if rank == late_rank:
            time.sleep(0.05)  # everyone else must wait for this rank
        arrived = time.perf_counter()
        try:
            store_barrier(store, rank, world_size, name)
        except RuntimeError as e:
            if "timeout" not in str(e).lower():
                raise
            # kept as data: the check names what a wait for a key nobody set shows
            return [*times, f"store_barrier on rank {rank} waited {STORE_WAIT_S:g} s in use "
                            f"{len(times) + 1} of {len(names)} (name {name!r}) "
                            "for a key nobody set"]
        times.append((arrived, time.perf_counter()))
    return times


REUSE_HINT = ("Count arrivals with store.add; a rank may leave only once the count shows all "
              "world_size ranks of *this* use of the barrier (the count keeps growing across "
              "uses, so compare against a multiple of world_size).")


def _compare_barrier(got: Any, expected: None, names: list[str]) -> None:
    stuck = [t[-1] for t in got if isinstance(t, list) and t and isinstance(t[-1], str)] \
        if isinstance(got, list) else []
    if stuck:
        raise CheckFailed(f"{stuck[0]}: the ranks disagree about when a use of the barrier is "
                          "complete", expected="every rank leaves each use", got=stuck[0],
                          cause="waits for a key nobody set",
                          hint="Every rank must work out which use it is in from the count "
                               "store.add returned to it, and the "
                               "arrival that completes a use (a count that is a multiple of "
                               "world_size) sets that use's key; a rank waiting for a key of "
                               "another use, or one no arrival sets, waits for ever.")
    if not isinstance(got, list) or any(not isinstance(g, list) or len(g) != len(names)
                                        for g in got):
        raise CheckFailed("expected an (arrive, leave) time per rank and barrier",
                          got=repr(got)[:200])
    for i, name in enumerate(names):
        arrive = [g[i][0] for g in got]
        leave = [g[i][1] for g in got]
        last = max(range(len(got)), key=lambda r: arrive[r])
        first = min(range(len(got)), key=lambda r: leave[r])
        if leave[first] < arrive[last]:
            early = (arrive[last] - leave[first]) * 1e3
            gone = [r for r in range(len(got)) if leave[r] < arrive[last]]
            others = [r for r in range(len(got)) if r != last]
            if i == 0 and last != 0 and 0 not in gone and gone == [r for r in others if r != 0]:
                why, cause, hint = (
                    "; every rank but rank 0 left early, so only rank 0 waited", "only one waits",
                    "Every rank waits at a barrier, not only rank 0: each one leaves only once "
                    "all world_size have arrived.")
            elif i == 0:
                why, cause, hint = (
                    f"; {len(gone)} of {len(got)} ranks left before the last one arrived, on the "
                    "barrier's first use", "leaves before all arrived",
                    "Even on its first use the barrier let ranks go before all had arrived: "
                    "every rank, not only some, waits until the count reaches world_size (all "
                    "of them, not world_size - 1).")
            else:
                why, cause, hint = ("", "reuse", REUSE_HINT)
            raise CheckFailed(
                f"barrier {i + 1} of {len(names)} (name {name!r}): rank {first} left "
                f"{early:.0f} ms before rank {last} arrived{why}",
                expected="every rank leaves after the last arrives", got=f"rank {first} left early",
                hint=hint, cause=cause)


def _barrier_case(name: str, world_size: int, names: list[str], *, file_store: bool = False,
                  hint: str = "") -> None:
    def run(store_barrier: Any, seed: int) -> list[list[tuple[float, float]]]:
        import torch.distributed as dist

        from kit.launcher import run_ranks

        rng = random.Random(seed)
        late = [rng.randrange(world_size) for _ in names]
        tmp = tempfile.mkdtemp(prefix="kit-barrier-")
        host, master = "127.0.0.1", None
        try:
            if file_store:
                args = (store_barrier, seed, host, None, os.path.join(tmp, "store"), names, late)
            else:  # this process hosts the store the ranks share, as the launcher does
                master = dist.TCPStore(host, 0, None, True, timedelta(seconds=10),
                                       wait_for_workers=False)
                args = (store_barrier, seed, host, master.port, None, names, late)
            return list(run_ranks(_barrier_on_rank, args, world_size=world_size,
                                  timeout=RANK_TIMEOUT_S, echo=False))
        finally:
            del master
            shutil.rmtree(tmp, ignore_errors=True)

    # a property check: no expectation, the compare knows the barrier's names
    BARRIER.case(name, compare=partial(_compare_barrier, names=names), hint=hint)(run)


BARRIER = task(
    "1.3",
    # torch's barriers, and torchelastic's store helpers (barrier, synchronize, get_all, ...).
    forbidden=("torch.distributed.barrier", "torch.distributed.monitored_barrier",
               "torch.distributed.distributed_c10d._store_based_barrier",
               "torch.distributed.elastic.utils.store.barrier",
               "torch.distributed.elastic.utils.store"),
    hint="A barrier on a key-value store: every rank records its arrival in a shared, atomic "
         "counter and waits until all world_size ranks of this use of the barrier have arrived. "
         "It must work when reused, and two names must never interfere.",
    recipe="Count arrivals under a key of the barrier's own name with store.add (it returns the "
           "new count, atomically). From the count, work out which use of the barrier this "
           "arrival belongs to: uses are complete at multiples of world_size. The rank whose "
           "arrival completes a use sets a key naming that use; every rank then waits for that "
           "key with store.wait.",
)
_barrier_case("4 ranks on a TCPStore, used once", 4, ["sync"])
_barrier_case("4 ranks, the same name used 6 times, a different rank late each time", 4,
              ["sync"] * 6,
              hint="A barrier is reused: once the count reached world_size the first time, a "
                   "test that only asks whether the count is at least world_size lets every "
                   "later use through at once.")
_barrier_case("3 ranks, two names interleaved", 3, ["a", "b", "a", "b", "a"],
              hint="Keep every key under the barrier's own name, so two barriers never share a "
                   "counter.")
_barrier_case("5 ranks on a FileStore, reused 4 times", 5, ["epoch"] * 4, file_store=True)


# --------------------------------------------------------------------------- task 1.4


def _model_of(fit_alpha_beta: Any) -> Any:
    """The student's ``ring_all_reduce_time``: defined beside ``fit_alpha_beta`` (same cell)."""
    found = MODEL.companion(fit_alpha_beta, "ring_all_reduce_time")
    if not callable(found):
        raise CheckFailed("ring_all_reduce_time is not defined",
                          hint="Define ring_all_reduce_time in the same cell as fit_alpha_beta.")
    return found


def measurements(seed: int, noise: float) -> tuple[list[float], list[float], float, float]:
    """Synthetic timings: sizes from 1 KB to 64 MB, times alpha + beta n, times (1 + noise)."""
    rng = random.Random(seed)
    alpha = rng.uniform(20e-6, 200e-6)  # 20-200 us latency
    beta = 1.0 / rng.uniform(0.5e9, 20e9)  # 0.5-20 GB/s
    sizes = [float(2**k) for k in range(10, 27, 2)]
    times = [(alpha + beta * n) * (1 + rng.uniform(-noise, noise)) for n in sizes]
    return sizes, times, alpha, beta


def _as_float(v: Any) -> Any:
    """A number the student returned as a float (0-d tensors and numpy scalars included)."""
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1):
        return float(v)
    if type(v).__module__ == "numpy" and hasattr(v, "item"):
        return float(v.item())
    return plain(v)


def _pair(x: Any) -> Any:
    if isinstance(x, (tuple, list)) and len(x) == 2:
        return [_as_float(v) for v in x]
    return plain(x)


# The classic slips of the ring's cost, each as the formula it computes: (what it shows, hint).
_MODEL_SLIPS = {
    "half": (lambda n, p, a, b: (p - 1) * a + (p - 1) / p * n * b,
             "it is half the ring's time: the p - 1 messages of the reduce-scatter only",
             "A ring all-reduce is a reduce-scatter and then an all-gather, p - 1 messages each: "
             "2(p - 1) in all."),
    "whole tensor": (lambda n, p, a, b: 2 * (p - 1) * (a + n * b),
                     "it sends all n bytes in every message",
                     "Each of the 2(p - 1) messages carries one chunk, n / p bytes: the "
                     "bandwidth term is 2(p - 1)/p n beta."),
    "latency once": (lambda n, p, a, b: a + 2 * (p - 1) / p * n * b,
                     "it pays the latency alpha once",
                     "Every one of the 2(p - 1) messages pays the latency alpha: the latency "
                     "term is 2(p - 1) alpha, and 0 on one rank."),
}


def _compare_model(got: Any, expected: list[dict[str, Any]]) -> None:
    if not isinstance(got, list) or len(got) != len(expected):
        raise CheckFailed("expected one prediction per case", got=repr(got)[:200])
    values = [g.get("value") if isinstance(g, dict) else g for g in got]
    for value, e in zip(values, expected):
        if not isinstance(value, float):
            raise CheckFailed(f"{e['label']} returned {value!r}, not a number")
    for value, e in zip(values, expected):
        if not math.isclose(value, e["value"], rel_tol=1e-6, abs_tol=1e-15):
            slip = next((k for k, (f, _, _) in _MODEL_SLIPS.items() if all(
                math.isclose(v, f(n, p, *_MODEL_AB), rel_tol=1e-6, abs_tol=1e-15)
                for v, (n, p) in zip(values, _GRID))), None) if len(values) == len(_GRID) else None
            why, hint = _MODEL_SLIPS[slip][1:] if slip else ("", "")
            raise CheckFailed(f"{e['label']} is wrong" + (f": {why}" if why else ""),
                              expected=e["value"], got=value, hint=hint, cause=slip or "")


def _compare_fit(got: Any, expected: Any) -> None:
    if not (isinstance(got, list) and len(got) == 2 and all(isinstance(v, float) for v in got)):
        raise CheckFailed("fit_alpha_beta must return a tuple of two floats (alpha, beta)",
                          expected="(alpha, beta)", got=repr(got)[:200])
    # alpha is small next to the times of large messages, so allow it 1 ns of rounding.
    close = [math.isclose(g, e, rel_tol=1e-4, abs_tol=tol)
             for g, e, tol in zip(reversed(got), expected, (1e-9, 1e-18))]
    if all(close) and not math.isclose(got[0], expected[0], rel_tol=1e-4, abs_tol=1e-9):
        raise CheckFailed("returned (beta, alpha): the fit is right but the order is (alpha, beta)",
                          expected=expected, got=got, cause="swapped",
                          hint="fit_alpha_beta returns the latency first, then the seconds per "
                               "byte: (alpha, beta).")
    if got[0] == 0.0 and expected[0] != 0.0:
        raise CheckFailed("alpha is 0: the line was forced through the origin", expected=expected,
                          got=got, cause="through the origin",
                          hint="alpha is the line's intercept, the time of an empty message: fit "
                               "it, with the slope, by least squares (not a line through 0).")
    for name, g, e, tol in zip(("alpha", "beta"), got, expected, (1e-9, 1e-18)):
        if not math.isclose(g, e, rel_tol=1e-4, abs_tol=tol):
            raise CheckFailed(f"{name} is wrong", expected=e, got=g)


MODEL = task(
    "1.4", reference="fit_alpha_beta",
    # One-call answers (line fits and least-squares solvers);
    # kit.lessons.costmodel.ring_all_reduce_time stays in kit for Lesson 08's planner.
    forbidden=("numpy.polyfit", "numpy.polynomial.polynomial.polyfit", "numpy.polynomial",
               "numpy.linalg.lstsq", "torch.linalg.lstsq", "scipy.stats.linregress",
               "scipy.linalg.lstsq", "scipy.optimize.curve_fit", "sklearn.linear_model",
               "kit.lessons.costmodel.ring_all_reduce_time"),
    hint="Fit the straight line t = alpha + beta * n through all the measurements by least "
         "squares (with an intercept); the ring's time adds up 2(p-1) messages of n / p bytes.",
    recipe="In float64: beta is the covariance of sizes and times divided by the variance of the "
           "sizes, and alpha is the mean time minus beta times the mean size. "
           "ring_all_reduce_time is 2(p-1) alpha + 2(p-1)/p n beta, which is 0 on one rank.",
)


@MODEL.case("recovers alpha and beta from exact timings (lists)", compare=_compare_fit,
            expect="true_alpha_beta")
def _(fit_alpha_beta: Any, seed: int) -> Any:
    sizes, times, _, _ = measurements(seed, 0.0)
    return _pair(fit_alpha_beta(sizes, times))


@MODEL.case("least-squares fit of noisy timings (tensors)", compare=_compare_fit,
            expect="fit_of_noisy_timings",
            hint="Fit ordinary least squares on the seconds, with an intercept: not a line "
                 "through the origin, not through two points.")
def _(fit_alpha_beta: Any, seed: int) -> Any:
    sizes, times, _, _ = measurements(seed + 1, 0.2)
    return _pair(fit_alpha_beta(torch.tensor(sizes), torch.tensor(times)))


_GRID = [(n, p) for n in (1.0, 4096.0, 2.0**24, 1e9) for p in (1, 2, 3, 4, 8, 64)]
_MODEL_AB = (5e-5, 1e-9)  # the alpha and beta the predictions are made with


def predictions(model: Any, alpha: float, beta: float) -> list[dict[str, Any]]:
    return [{"label": f"ring_all_reduce_time({n:g} bytes, world_size={p})",
             "value": _as_float(model(n, p, alpha, beta))} for n, p in _GRID]


@MODEL.case("ring_all_reduce_time matches 2(p-1) alpha + 2(p-1)/p n beta", compare=_compare_model,
            expect="ring_predictions",
            hint="A ring all-reduce is 2(p-1) messages in a row, each of n / p bytes and each "
                 "paying the latency alpha once; one rank sends nothing.")
def _(fit_alpha_beta: Any, seed: int) -> Any:
    return predictions(_model_of(fit_alpha_beta), *_MODEL_AB)
