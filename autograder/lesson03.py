"""Checks for Lesson 03, "The data plane": tasks 3.1, 3.2 and 3.3.

Task 3.1 ``ShardSampler`` is compared index for index with torch's own
``torch.utils.data.DistributedSampler``, on fixed cases and on a hypothesis search over
dataset lengths, replicas, ranks, shuffle, seeds, ``drop_last`` and epochs. Task 3.2
``seed_worker`` runs as the ``worker_init_fn`` of real ``DataLoader`` workers on two real
ranks, two epochs each; its streams must be distinct and reproducible (a property: no
reference): one shared launch serves four of its cases; a loader of one worker in this
process with RANK unset (world size 1) must draw rank 0's streams. Task 3.3
``gather_unpadded`` runs on real ranks; its result must equal the single-process data in
dataset order, computed by :mod:`autograder.references.lesson03` (trusted only).
"""

from __future__ import annotations

import builtins
import math
import random
import re
import sys
from functools import partial
from typing import Any

import cloudpickle
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from autograder.compare import CheckFailed, assert_same, describe, per_rank, short
from autograder.registry import task

# --------------------------------------------------------------------------- task 3.1

SAMPLER = task(
    "3.1", reference=DistributedSampler,
    # DistributedSampler's module, and torchelastic's subclass of it.
    forbidden=("torch.utils.data.DistributedSampler", "torch.utils.data.distributed",
               "torch.distributed.elastic.utils.data.ElasticDistributedSampler"),
    hint="Every rank must draw the same number of indices per epoch (or the ranks' collectives "
         "fall out of step), all ranks together must see the whole dataset, and every rank must "
         "agree on one order, new each epoch yet reproducible: the contract of torch's "
         "DistributedSampler, index for index.",
    recipe="Without drop_last each rank gets ceil(len / num_replicas) indices; with it, "
           "floor(len / num_replicas). In __iter__ build the index list: the identity, or with "
           "shuffle a permutation drawn by randperm from a fresh torch.Generator seeded with "
           "seed + epoch. Without drop_last pad it to num_samples * num_replicas by repeating it "
           "from the start as often as needed; with drop_last cut it to that length. Rank r "
           "takes every num_replicas-th index starting at r. set_epoch only stores the epoch; "
           "num_replicas and rank left as None come from the process group.",
)


def _as_index(x: Any) -> Any:
    """An index as a plain int; anything else as its repr, so the comparison names it."""
    if isinstance(x, bool):
        return repr(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_floating_point():
        return int(x)
    return f"<{type(x).__name__} {x!r}>"[:80]


def _describe_sampler(n: int, replicas: int, rank: int, shuffle: bool, seed: int,
                      drop_last: bool) -> str:
    return (f"ShardSampler(range({n}), num_replicas={replicas}, rank={rank}, shuffle={shuffle}, "
            f"seed={seed}, drop_last={drop_last})")


def _sampler_streams(impl: Any, n: int, replicas: int, shuffle: bool, seed: int,
                     drop_last: bool, epochs: list[int]) -> dict[str, Any]:
    """``{describe(rank): {"len": len(sampler), "epoch e": [indices], ...}}`` for every rank."""
    out: dict[str, Any] = {}
    for rank in range(replicas):
        sampler = impl(range(n), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed,
                       drop_last=drop_last)
        entry: dict[str, Any] = {"len": int(len(sampler))}
        for epoch in epochs:
            sampler.set_epoch(epoch)
            entry[f"epoch {epoch}"] = [_as_index(i) for i in sampler]
        out[_describe_sampler(n, replicas, rank, shuffle, seed, drop_last)] = entry
    return out


def _compare_streams(got: Any, expected: dict[str, Any]) -> None:
    if not isinstance(got, dict) or set(got) != set(expected):
        raise CheckFailed("the sampler's indices could not be collected",
                          expected="indices for every rank", got=describe(got))
    for where, want in expected.items():
        have = got[where]
        if not isinstance(have, dict) or set(have) != set(want):
            raise CheckFailed(f"{where}: results are missing", expected=sorted(want),
                              got=repr(have)[:200])
        for key in sorted(want, key=lambda k: (k != "len", k)):
            if have[key] != want[key]:
                what = "len(sampler)" if key == "len" else f"indices in {key}"
                try:
                    hint, cause = _diagnose_stream(got, expected, where, key)
                except (IndexError, KeyError, TypeError, ValueError, AttributeError):
                    hint, cause = "", ""  # too malformed to diagnose: the mismatch still says what
                raise CheckFailed(f"{where}: wrong {what}", expected=want[key], got=have[key],
                                  hint=hint, cause=cause)


def _diagnose_stream(got: dict[str, Any], expected: dict[str, Any], where: str, key: str
                     ) -> tuple[str, str]:
    """(hint, cause) read from what every rank of this sampler drew, or ("", "") to leave the
    case's hint: the hint names the mistake the indices show, not the one the case targets."""
    if key == "len":
        if "drop_last=True" in where and got[where]["len"] > expected[where]["len"]:
            return ("len(sampler) counts padded slots: with drop_last the uneven tail is dropped "
                    "and nothing is padded.", "pads with drop_last")
        return ("", "")
    same = re.sub(r"rank=\d+", "rank=", where)
    ranks = sorted((w for w in expected if re.sub(r"rank=\d+", "rank=", w) == same),
                   key=lambda w: int(re.search(r"rank=(\d+)", w).group(1)))
    if not all(isinstance(got.get(w), dict) and isinstance(got[w].get(key), list) for w in ranks):
        return ("", "")
    epochs = [k for k in expected[where] if k.startswith("epoch")]

    def constant(streams: dict[str, Any]) -> bool:
        return all(streams[w].get(e) == streams[w][epochs[0]] for w in ranks for e in epochs)

    # Every rank the same full-length order in every epoch, where torch's changes (6+ distinct
    # indices: short shuffles agree by chance, and a hypothesis search shrinks to such cases).
    if (len(epochs) > 1 and constant(got) and not constant(expected)
            and all(len(got[w].get(e) or []) == len(expected[w][e]) for w in ranks for e in epochs)
            and len({i for w in ranks for i in expected[w][epochs[0]]}) >= 6):
        return ("The order is the same in every epoch: the permutation comes from seed + epoch, "
                "and set_epoch changes the epoch.", "ignores the epoch")
    drawn = [i for w in ranks for i in got[w][key]]
    wanted = [i for w in ranks for i in expected[w][key]]
    if len(drawn) == len(wanted) and len(set(drawn)) < len(set(wanted)):
        return ("The ranks' indices overlap and miss samples: each rank shuffled on its own. "
                "Every rank must draw the same permutation from seed + epoch, then take its share.",
                "ranks shuffle apart")
    # The dealt order: position i of the padded list went to rank i % R as its (i // R)-th index.
    per_rank = [expected[w][key] for w in ranks]
    size = len(per_rank[0])
    order = [per_rank[i % len(ranks)][i // len(ranks)] for i in range(size * len(ranks))
             if i // len(ranks) < len(per_rank[i % len(ranks)])]
    if size > 1 and all(got[w][key] == order[r * size:(r + 1) * size] for r, w in enumerate(ranks)):
        return ("Each rank got a contiguous block of the list: a distributed sampler deals the "
                "list out like cards, rank r taking positions r, r + num_replicas, ...",
                "contiguous blocks")
    lengths_right = all(len(got[w][key]) == len(expected[w][key]) for w in ranks)
    dealt = ([got[w][key][i // len(ranks)]
              for i in range(len(order)) for w in [ranks[i % len(ranks)]]]
             if lengths_right else [])
    distinct = len(set(wanted))
    if lengths_right and dealt[:distinct] == order[:distinct] and dealt != order:
        return ("The order is right and only the padded slots differ: padding repeats this "
                "epoch's list from its start until every rank has the same count.", "padding")
    # The same indices (up to the padding, which repeats the permutation's first ones), or with
    # drop_last a duplicate-free share of the same size: a permutation other than torch's.
    if "shuffle=True" in where and lengths_right and (
            set(drawn) == set(wanted)
            or ("drop_last=True" in where and len(set(drawn)) == len(drawn))):
        return ("The ranks draw the right indices in another order: the order is torch.randperm "
                "of the length with a torch.Generator seeded with seed + epoch, as torch's "
                "DistributedSampler draws it; another shuffle gives another order.",
                "another permutation")
    return ("", "")


def _sampler_case(name: str, grid: list[tuple[int, int, bool, int, bool, list[int]]],
                  hint: str = "", weight: float = 1.0, recipe: str = "") -> None:
    def run(impl: Any, seed: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for n, replicas, shuffle, s, drop_last, epochs in grid:
            out.update(_sampler_streams(impl, n, replicas, shuffle, s, drop_last, epochs))
        return out

    SAMPLER.case(name, compare=_compare_streams, hint=hint, weight=weight, recipe=recipe)(run)


_sampler_case("10 items on 4 replicas, no shuffle (2 padded indices)",
              [(10, 4, False, 0, False, [0])],
              hint="12 = 3 * 4 slots for 10 items: the 2 missing slots repeat indices 0 and 1, "
                   "then rank r takes every 4th index starting at r.")
_sampler_case("3 items on 8 replicas (the padding wraps around the dataset)",
              [(3, 8, False, 0, False, [0]), (1, 3, True, 5, False, [0, 1])],
              hint="With fewer items than replicas the padding repeats the whole index list "
                   "as many times as needed, then cuts it to num_samples * num_replicas.")
_sampler_case("10 items on 4 replicas with drop_last (the uneven tail is dropped)",
              [(10, 4, False, 0, True, [0]), (10, 4, True, 3, True, [0, 1]),
               (3, 4, False, 0, True, [0])],
              hint="With drop_last each rank gets floor(len / num_replicas) items: the tail of the "
                   "(shuffled) list is dropped, nothing is padded.")
_sampler_case("shuffle from seed + epoch, over epochs 0-3 (set_epoch)",
              [(23, 4, True, 0, False, [0, 1, 2, 3]), (23, 4, True, 7, False, [0, 3])],
              hint="All ranks must shuffle alike (or they overlap and miss samples) and "
                   "differently every epoch: the permutation depends on seed + epoch only.",
              recipe="On every __iter__ seed a fresh torch.Generator with seed + epoch and draw "
                     "the permutation of the dataset's length from it with randperm; set_epoch "
                     "only stores the epoch.")


def _defaults_on_rank(impl: Any, seed: int) -> list[Any]:
    sampler = impl(range(10), shuffle=True, seed=seed)  # num_replicas and rank left out
    return [_as_index(i) for i in sampler]


def _compare_defaults(got: Any, expected: list[list[int]]) -> None:
    """The default comparison; but where the ranks drew the right number of indices, wrong
    ones are diagnosed as the other cases' are (dealt in blocks, another permutation, ...):
    the mistake is then not in the defaults."""
    try:
        assert_same(got, expected)
    except CheckFailed as e:
        if isinstance(got, list) and len(got) == len(expected) and all(
                isinstance(g, list) and len(g) == len(w) for g, w in zip(got, expected)):
            def streams(lists: list[list[int]]) -> dict[str, Any]:
                return {_describe_sampler(10, len(lists), r, True, 0, False):
                        {"len": len(x), "epoch 0": x} for r, x in enumerate(lists)}

            where = next(w for w, g, x in zip(streams(expected), got, expected) if g != x)
            try:
                hint, cause = _diagnose_stream(streams(got), streams(expected), where, "epoch 0")
            except (IndexError, KeyError, TypeError, ValueError, AttributeError):
                hint, cause = "", ""
            if cause:
                e.hint, e.cause = hint, cause
        raise


# torch's DistributedSampler (the reference) runs on the same 3 ranks for the expectation.
SAMPLER.case("defaults num_replicas and rank to the process group (3 real ranks)",
             uses=SAMPLER.shared(_defaults_on_rank, world_size=3, timeout=20.0),
             compare=_compare_defaults,
             hint="Left out, num_replicas and rank come from the default process group, as in "
                  "torch's DistributedSampler.")


# A hypothesis search over every parameter. The search runs next to the student's code (it
# needs torch's sampler to find and shrink a counterexample), and every example it tried comes
# back as plain data that the trusted side checks again against torch's DistributedSampler.
SEARCH_EXAMPLES = 120


def _search(impl: Any, seed: int) -> dict[str, Any]:
    from hypothesis import HealthCheck, Verbosity, example, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    # A plain call first, outside hypothesis, so an unimplemented stub fails with its own message.
    _sampler_streams(impl, 10, 4, True, 0, False, [0])
    tried: list[dict[str, Any]] = []
    failing: list[dict[str, Any]] = []

    # Half the lengths are at most 2 * replicas: datasets smaller than the replicas and padding
    # longer than the dataset (N < W / 2) are the corners where samplers go wrong.
    sizes = st.integers(1, 8).flatmap(
        lambda w: st.tuples(st.integers(0, 2 * w) | st.integers(0, 200), st.just(w)))

    @settings(max_examples=SEARCH_EXAMPLES, deadline=None, database=None,
              verbosity=Verbosity.quiet, suppress_health_check=list(HealthCheck))
    @hypothesis_seed(seed)
    # The corners first, as explicit examples, so that every search covers them.
    @example(sizes=(1, 3), shuffle=False, s=0, drop_last=False, epochs=[0])
    @example(sizes=(2, 8), shuffle=True, s=1, drop_last=False, epochs=[0, 1])
    @example(sizes=(0, 4), shuffle=True, s=0, drop_last=False, epochs=[0])
    @example(sizes=(3, 8), shuffle=True, s=2, drop_last=True, epochs=[1])
    @given(sizes=sizes, shuffle=st.booleans(), s=st.integers(0, 2**31 - 1), drop_last=st.booleans(),
           epochs=st.lists(st.integers(0, 1000), min_size=1, max_size=3, unique=True))
    def search(sizes: tuple[int, int], shuffle: bool, s: int, drop_last: bool,
               epochs: list[int]) -> None:
        n, replicas = sizes
        record: dict[str, Any] = {"params": [n, replicas, shuffle, s, drop_last, epochs]}
        try:
            record["got"] = _sampler_streams(impl, n, replicas, shuffle, s, drop_last, epochs)
        except Exception as e:  # noqa: BLE001 - the student's error becomes the finding
            record["error"] = f"{type(e).__name__}: {e}"[:300]
        tried.append(record)
        if "error" in record or record["got"] != _sampler_streams(
                DistributedSampler, n, replicas, shuffle, s, drop_last, epochs):
            failing.append(record)
            raise AssertionError("differs from DistributedSampler")

    try:
        search()
    except AssertionError:
        pass  # hypothesis replays the shrunk (smallest) counterexample last: failing[-1]
    return {"smallest failure": failing[-1] if failing else None, "tried": tried}


def _compare_search(got: Any, expected: None) -> None:
    if not isinstance(got, dict) or not isinstance(got.get("tried"), list):
        raise CheckFailed("the search's examples could not be collected", got=describe(got))
    records = ([got["smallest failure"]] if got.get("smallest failure") else []) + got["tried"]
    if got.get("smallest failure") is None and len(records) < SEARCH_EXAMPLES // 2:
        raise CheckFailed(f"the search tried only {len(records)} examples",
                          expected=f"at least {SEARCH_EXAMPLES // 2}", got=len(records))
    for record in records:
        n, replicas, shuffle, s, drop_last, epochs = record["params"]
        if "error" in record:
            raise CheckFailed(f"{_describe_sampler(n, replicas, 0, shuffle, s, drop_last)} "
                              f"(or another rank) raised {record['error']}",
                              expected="the indices DistributedSampler yields", got=record["error"])
        _compare_streams(record["got"], _sampler_streams(DistributedSampler, n, replicas, shuffle,
                                                         s, drop_last, epochs))


# No expectation: the trusted compare checks every example against DistributedSampler itself
# (running the search on the reference would only find nothing).
SAMPLER.case(f"hypothesis: {SEARCH_EXAMPLES} random lengths 0-200, 1-8 replicas, every rank, "
             "shuffle, seed, drop_last and epochs", compare=_compare_search, weight=2,
             expect=lambda seed: None)(_search)


# The reference *is* torch's sampler: the expectation is the verdict an own implementation gets.
@SAMPLER.case("iterates on its own (does not wrap torch's DistributedSampler)", weight=0.5,
              expect=lambda seed: "own indices",
              hint="Build the index list yourself; the point of the task is to know exactly "
                   "what DistributedSampler does.")
def _(impl: Any, seed: int) -> str:
    original = DistributedSampler.__iter__

    def refuse(self: Any) -> Any:
        raise RuntimeError("torch's DistributedSampler was used")

    DistributedSampler.__iter__ = refuse  # type: ignore[method-assign]
    try:
        list(impl(range(10), num_replicas=4, rank=1, shuffle=True, seed=0))
    except RuntimeError as e:
        if "DistributedSampler was used" in str(e):
            return "wraps torch's DistributedSampler"
        raise
    finally:
        DistributedSampler.__iter__ = original  # type: ignore[method-assign]
    return "own indices"


# --------------------------------------------------------------------------- task 3.2

# forbids nothing: torch's DataLoader seeds each worker from base_seed + worker_id, the same on
# every rank; no library mixes in the rank (its own seeding runs in every worker it starts).
SEEDING = task(
    "3.2",
    hint="Every data-loader worker on every rank needs its own random streams, in torch, NumPy "
         "and Python's random alike, reproducible from torch's seed and new every epoch: the "
         "loader already gives each worker a fresh torch seed, but the same one on every rank.",
    recipe="In the worker, torch.initial_seed() is the loader's per-worker seed (new every "
           "epoch); read the rank from the RANK environment variable (0 when unset). Combine the "
           "two without collisions, for example with NumPy's SeedSequence over both numbers, "
           "ask it for three seeds, and seed torch, NumPy's legacy global generator (32 bits) "
           "and random with one each.",
)

LIBRARIES = ("random", "numpy", "torch")


# Set in a worker whose worker_init_fn raised: the worker then reports it with every item
# instead of crashing, so the loader shuts its workers down cleanly and the rank raises it.
_INIT_ERROR: tuple[str, str] | None = None


class _RandomDraws(Dataset):
    """Item ``i``: the drawing worker's id and one draw from each global random stream."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        info = torch.utils.data.get_worker_info()
        return {"worker": info.id if info else -1, "random": random.random(),
                "numpy": float(np.random.random()), "torch": float(torch.rand(())),
                "error": _INIT_ERROR}


class _Portable:
    """A ``worker_init_fn`` that survives spawned workers (the function travels cloudpickled)
    and turns its exception into data (see ``_INIT_ERROR``)."""

    def __init__(self, fn: Any):
        self.blob = cloudpickle.dumps(fn)

    def __call__(self, worker_id: int) -> None:
        global _INIT_ERROR
        try:
            cloudpickle.loads(self.blob)(worker_id)
        except Exception as e:  # noqa: BLE001 - re-raised in the rank by _draws
            _INIT_ERROR = (type(e).__name__, str(e))


def _raise_init_error(name: str, message: str) -> None:
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        raise kind(f"in a DataLoader worker's worker_init_fn: {message}")
    raise RuntimeError(f"{name} in a DataLoader worker's worker_init_fn: {message}")


def _draws(seed_worker: Any, seed: int, epochs: int, workers: int) -> list[Any]:
    """``[epoch][worker] -> {library: [draws]}`` for a loader over a fresh global seed."""
    # Every rank seeds torch identically, as a training script does to start from identical
    # weights; the loader then draws the same base seed on every rank.
    torch.manual_seed(seed)
    # Forked workers on Linux even in a spawned rank (whose default became spawn): a spawned
    # worker re-imports torch, seconds per worker and epoch. Elsewhere the platform's default.
    loader = DataLoader(_RandomDraws(4 * workers), batch_size=None, num_workers=workers,
                        worker_init_fn=_Portable(seed_worker),
                        multiprocessing_context="fork" if sys.platform == "linux" else None)
    out = []
    for _ in range(epochs):
        items = list(loader)
        for item in items:
            if item["error"] is not None:
                _raise_init_error(*item["error"])
        streams: dict[int, dict[str, list[float]]] = {}
        for item in items:
            stream = streams.setdefault(int(item["worker"]), {lib: [] for lib in LIBRARIES})
            for lib in LIBRARIES:
                stream[lib].append(float(item[lib]))
        out.append([streams[w] for w in sorted(streams)])
    return out


def _draws_on_rank(seed_worker: Any, seed: int) -> dict[str, Any]:
    return {"first run": _draws(seed_worker, seed, 2, 2),
            "same seed again": _draws(seed_worker, seed, 2, 2),
            "another seed": _draws(seed_worker, seed + 1, 1, 2)}


Streams = dict[tuple[int, str, int, int], dict[str, list[float]]]


def _streams(got: Any) -> Streams:
    """``{(rank, run, epoch, worker): {library: draws}}`` from what the ranks returned."""
    try:
        runs = {(rank, run, epoch, worker): stream
                for rank, per_rank in enumerate(got)
                for run, epochs in per_rank.items()
                for epoch, workers in enumerate(epochs)
                for worker, stream in enumerate(workers)}
        assert len(got) == 2 and len(runs) == 2 * (2 + 2 + 1) * 2
        assert all(sorted(s) == sorted(LIBRARIES) for s in runs.values())
    except (AssertionError, AttributeError, TypeError, ValueError) as e:
        raise CheckFailed("the workers' draws could not be collected",
                          expected="2 ranks x 5 epochs x 2 workers", got=describe(got)) from e
    return runs


def _first_duplicate(runs: Streams, same_epoch: bool) -> None:
    """Raise on two (rank, epoch, worker) of the first run drawing the same stream."""
    for lib in LIBRARIES:
        seen: dict[tuple[float, ...], tuple[int, int, int]] = {}
        for (rank, run, epoch, worker), stream in runs.items():
            key = tuple(stream[lib])
            if run != "first run":
                continue
            if key in seen and (seen[key][1] == epoch) == same_epoch:
                r0, e0, w0 = seen[key]
                raise CheckFailed(
                    f"rank {r0} worker {w0} in epoch {e0} and rank {rank} worker {worker} in epoch "
                    f"{epoch} draw the same {lib} stream",
                    expected="a different stream for every (rank, epoch, worker)",
                    got=f"both draw {list(key)[:2]} ...")
            seen.setdefault(key, (rank, epoch, worker))


def _compare_across_ranks(got: Any, expected: None) -> None:
    _first_duplicate(_streams(got), same_epoch=True)


def _compare_across_epochs(got: Any, expected: None) -> None:
    _first_duplicate(_streams(got), same_epoch=False)


def _compare_rerun(got: Any, expected: None) -> None:
    runs = _streams(got)
    for (rank, run, epoch, worker), stream in runs.items():
        again = runs[(rank, "same seed again", epoch, worker)]
        for lib in LIBRARIES:
            if run == "first run" and again[lib] != stream[lib]:
                raise CheckFailed(
                    f"rank {rank} worker {worker}, epoch {epoch}: the {lib} stream changed when "
                    "the loader ran again after the same torch.manual_seed",
                    expected=stream[lib][:2], got=again[lib][:2])


def _compare_other_seed(got: Any, expected: None) -> None:
    runs = _streams(got)
    for (rank, run, epoch, worker), other in runs.items():
        stream = runs[(rank, "first run", epoch, worker)]
        for lib in LIBRARIES:
            if run == "another seed" and other[lib] == stream[lib]:
                raise CheckFailed(
                    f"rank {rank} worker {worker}, epoch {epoch}: the {lib} stream stayed the same "
                    "when torch.manual_seed changed",
                    expected="a stream derived from torch's per-worker seed", got=stream[lib][:2])


# The four cases of task 3.2 judge the same draws: one launch on 2 ranks serves them all.
_draws_on_ranks = SEEDING.shared(_draws_on_rank, world_size=2, timeout=60.0)

for _name, _compare, _weight, _hint in [
    ("different streams on every rank and worker (each rank called torch.manual_seed alike)",
     _compare_across_ranks, 2,
     "Every rank seeds torch alike, so the loader gives worker k the same seed on every rank: "
     "mix the rank in, without collisions (adding it to the seed makes rank 1 worker 0 equal "
     "rank 0 worker 1), and seed all three libraries."),
    ("different streams in epochs 0 and 1 (2 workers per rank)", _compare_across_epochs, 0.5,
     "Derive the seeds from torch.initial_seed(), which the loader changes every epoch, not "
     "from constants such as the worker id and rank alone."),
    ("reproducible: the same torch seed gives the same streams again", _compare_rerun, 0.5,
     "Derive every seed from torch.initial_seed() and the rank only: no clock, no os.urandom, "
     "no state kept between calls."),
    ("derived from torch's seed: another torch.manual_seed gives other streams",
     _compare_other_seed, 0.5,
     "Seed from torch.initial_seed() (the loader's per-worker seed), not from constants."),
]:
    SEEDING.case(_name, uses=_draws_on_ranks, compare=_compare, weight=_weight, hint=_hint)


def _one_rank_draws(seed_worker: Any, seed: int) -> dict[str, Any]:
    """World size 1: a plain ``python train.py``, no launcher, so RANK is unset. One loader of
    one worker with RANK unset, then with RANK=0: the same streams (the rank is 0 if unset).
    An error in the worker comes back as its message, so the feedback can name the regime."""
    import os

    out: dict[str, Any] = {}
    saved = os.environ.get("RANK")
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's torch RNG is left as it was
            for label, rank in (("RANK unset", None), ("RANK=0", "0")):
                if rank is None:
                    os.environ.pop("RANK", None)
                else:
                    os.environ["RANK"] = rank
                try:
                    out[label] = _draws(seed_worker, seed, 1, 1)
                except NotImplementedError:
                    raise  # the stub: reported as not implemented
                except Exception as e:  # noqa: BLE001 - the student's error becomes the finding
                    out[label] = f"{type(e).__name__}: {e}"[:300]
    finally:
        if saved is None:
            os.environ.pop("RANK", None)
        else:
            os.environ["RANK"] = saved
    return out


def _compare_one_rank(got: Any, expected: None) -> None:
    where = "world size 1 (RANK unset: a plain python run, one worker)"
    if not isinstance(got, dict) or set(got) != {"RANK unset", "RANK=0"}:
        raise CheckFailed(f"{where}: the worker's draws could not be collected", got=describe(got))
    for label in ("RANK unset", "RANK=0"):
        if isinstance(got[label], str):
            raise CheckFailed(f"{where}: with {label}, seed_worker raised {got[label]}",
                              expected="the streams of rank 0", got=got[label],
                              hint="Without a launcher there is no RANK variable: read it with a "
                                   "default of 0, as the task says, instead of requiring it.")
    for lib in LIBRARIES:
        unset, zero = got["RANK unset"][0][0][lib], got["RANK=0"][0][0][lib]
        if unset != zero:
            raise CheckFailed(f"{where}: the {lib} stream with RANK unset differs from rank 0's",
                              expected=zero[:2], got=unset[:2],
                              hint="A process without RANK is rank 0: it must draw rank 0's "
                                   "streams.")


SEEDING.case("world size 1: RANK unset (a plain python run), one worker: rank 0's streams",
             compare=_compare_one_rank, weight=0.5, expect=lambda seed: None)(_one_rank_draws)


# --------------------------------------------------------------------------- task 3.3

# forbids nothing: it calls all_gather, the tool; no library undoes a distributed sampler's
# interleaving and padding.
GATHER = task(
    "3.3",
    hint="Undo the sampler: the ranks' results together, in dataset order, every sample once. "
         "A distributed sampler deals the samples out like cards (rank r holds positions r, "
         "r + W, r + 2W, ...) and pads the last round with duplicates.",
    recipe="All-gather every rank's (S, ...) shard. Put the shards side by side along a new "
           "second dimension (sample k of every rank together) and flatten the first two "
           "dimensions, keeping the trailing ones: that interleaves them back into dataset "
           "order. Then keep the first num_samples rows; the rest is padding.",
)


def dataset_results(seed: int, n: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Per-sample results of a whole dataset, as one process would compute them: (n, *shape)."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn((n, *shape), generator=g).to(dtype)
    return torch.randint(0, 10, (n, *shape), generator=g, dtype=dtype)


def _gather_on_rank(gather_unpadded: Any, seed: int, n: int, shape: tuple[int, ...],
                    dtype: torch.dtype) -> Any:
    import torch.distributed as dist

    results = dataset_results(seed, n, shape, dtype)  # (n, *shape), the same on every rank
    sampler = DistributedSampler(range(len(results)), dist.get_world_size(), dist.get_rank(),
                                 shuffle=False)
    local = results[list(sampler)]  # (ceil(n / W), *shape): this rank's shard, padding included
    out = gather_unpadded(local.clone(), len(results))
    return out.detach().clone() if isinstance(out, torch.Tensor) else f"<a {type(out).__name__}>"


def concatenated_order(n: int, world_size: int) -> list[int]:
    """The dataset positions a rank gets back when it concatenates the shards rank after rank
    (rank 0's samples, then rank 1's, ...) and keeps the first n: the order of that mistake."""
    per_rank_count = -(-n // world_size)
    padded = (list(range(n)) * (per_rank_count * world_size // max(n, 1) + 1))[
        :per_rank_count * world_size]  # DistributedSampler's padding repeats from the start
    return [i for r in range(world_size) for i in padded[r::world_size]][:n]


def _compare_gathered(got: Any, expected: list[torch.Tensor]) -> None:
    world_size = len(expected)
    for rank, (g, e) in enumerate(zip(per_rank(got, world_size), expected)):
        if isinstance(g, torch.Tensor) and g.dim() >= 1 and e.dim() >= 1 and len(g) != len(e):
            extra = len(g) - len(e)
            raise CheckFailed(
                f"rank {rank} returned {len(g)} samples for a dataset of {len(e)}",
                expected=len(e), got=len(g), cause="padding kept" if extra > 0 else "samples lost",
                hint=f"Drop the {extra} padded duplicate{'s' * (extra > 1)}: keep the first "
                     "num_samples rows."
                if extra > 0 else "Every sample of the dataset must come back, on every rank.")
        if (isinstance(g, torch.Tensor) and g.shape == e.shape and g.dtype == e.dtype
                and not torch.equal(g, e)
                and torch.equal(g, e[concatenated_order(len(e), world_size)])):
            raise CheckFailed(
                f"rank {rank}'s result is the shards concatenated rank after rank (all of rank "
                "0's, then rank 1's, ...) and cut to num_samples: not dataset order",
                expected=short(e), got=short(g), cause="concatenated",
                hint="A distributed sampler deals the samples out like cards: rank r's k-th "
                     "sample is dataset sample k * world_size + r. Interleave the shards, do not "
                     "concatenate them.")
        assert_same(g, e, path=f"rank {rank}'s result")


def _gather_case(name: str, n: int, world_size: int, shape: tuple[int, ...] = (),
                 dtype: torch.dtype = torch.float32, hint: str = "") -> None:
    on_ranks = GATHER.shared(partial(_gather_on_rank, n=n, shape=shape, dtype=dtype),
                             world_size=world_size, timeout=20.0)
    GATHER.case(name, uses=on_ranks, compare=_compare_gathered, hint=hint,
                expect=lambda seed: GATHER.trusted("dataset_in_order")(seed, n, world_size, shape,
                                                                       dtype))


_gather_case("10 per-sample losses on 4 ranks (2 padded duplicates)", 10, 4)
_gather_case("12 integer predictions on 4 ranks (no padding)", 12, 4, dtype=torch.int64,
             hint="Rank r's k-th sample is dataset sample k * world_size + r: interleave the "
                  "shards, do not concatenate them.")
_gather_case("7 per-sample logits (7 x 5) on 3 ranks", 7, 3, shape=(5,),
             hint="Per-sample results may have trailing dimensions (logits): keep them, only "
                  "the sample dimension is interleaved.")
_gather_case("3 samples on 4 ranks (rank 3 holds only a duplicate)", 3, 4)


def accuracy_data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictions and labels where the first samples (those padding repeats) are all correct."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (n,), generator=g)
    predictions = torch.where(torch.arange(n) < 3, labels, (labels + 1) % 3)
    return predictions, labels


def _accuracy_on_rank(gather_unpadded: Any, seed: int, n: int) -> Any:
    import torch.distributed as dist

    predictions, labels = accuracy_data(seed, n)
    sampler = DistributedSampler(range(n), dist.get_world_size(), dist.get_rank(), shuffle=False)
    idx = list(sampler)
    correct = (predictions[idx] == labels[idx]).to(torch.int64)  # (ceil(n / W),) 0/1 per sample
    every = gather_unpadded(correct, n)
    if not isinstance(every, torch.Tensor):
        return repr(every)[:80]
    return {"accuracy": every.double().mean().item(), "samples": len(every) if every.dim() else 1}


def _compare_accuracy(got: Any, expected: list[float]) -> None:
    """The accuracy each rank computed from what it gathered; a wrong one is named by the
    number of samples it averaged (padding counted, samples lost) where that shows the slip."""
    for rank, (g, e) in enumerate(zip(per_rank(got, len(expected)), expected)):
        if not isinstance(g, dict):
            raise CheckFailed(f"rank {rank}: gather_unpadded returned {g}, not a tensor")
        if math.isclose(g["accuracy"], e, rel_tol=1e-9, abs_tol=1e-12):
            continue
        samples, n = g["samples"], 9
        why = (("padding kept", f"it averaged {samples} samples for a dataset of {n}: the "
                f"{samples - n} padded slots repeat samples 0-{samples - n - 1}, all correct, so "
                "counting them inflates the accuracy") if samples > n else
               ("samples lost", f"it averaged {samples} samples for a dataset of {n}: real "
                "samples were lost") if samples < n else
               ("", f"it averaged {n} samples, but not each sample once"))
        raise CheckFailed(f"rank {rank}'s accuracy is {g['accuracy']:.4g}, expected {e:.4g}: "
                          f"{why[1]}", expected=e, got=g["accuracy"], cause=why[0])


GATHER.case("accuracy of 9 samples on 4 ranks equals the single-process accuracy",
            uses=GATHER.shared(partial(_accuracy_on_rank, n=9), world_size=4, timeout=20.0),
            compare=_compare_accuracy,
            expect=lambda seed: GATHER.trusted("accuracy_in_one_process")(seed, 9, 4),
            hint="Accuracy is the mean over the dataset, each sample once: the padded slots "
                 "repeat real samples and must not count.")


