"""Checks for Lesson 00, "Launching ranks from a notebook": tasks 0.1 and 0.2.

Task 0.1 ``shard_range`` is checked against torch's own balanced split (``torch.tensor_split``).
Task 0.2 ``global_mean`` runs on real ranks, one shared run per case; its expected value is the
mean of the concatenation of every rank's data, computed in one process. Both answers live in
:mod:`autograder.references.lesson00`, which only the trusted side imports: this module names
them (``reference="shard_range"``) and holds only the untrusted runs and the comparisons.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from autograder.compare import CheckFailed, describe, per_rank
from autograder.registry import plain, task

# --------------------------------------------------------------------------- task 0.1

SHARD = task(
    "0.1", reference="shard_range",
    # DistributedSampler's module, and the balanced splits that answer in one call.
    forbidden=("torch.utils.data.DistributedSampler", "torch.utils.data.distributed",
               "torch.tensor_split", "torch.Tensor.tensor_split", "numpy.array_split"),
    hint="The shards split 0 .. n-1 into world_size contiguous pieces that cover every item "
         "exactly once, with sizes that differ by at most one (a balanced split).",
    recipe="Each rank gets n // world_size items, and the first n % world_size ranks get one "
           "more. Rank r starts where rank r - 1 stopped: at the sum of the sizes of the ranks "
           "before it. Return the range from that start to start plus its own size.",
)


def _all_shards(shard_range: Any, pairs: list[tuple[int, int]]) -> dict[str, list[list[int]]]:
    """``{"n=10, world_size=4": [items of rank 0, items of rank 1, ...]}`` for every pair."""
    return {f"n={n}, world_size={ws}": [list(shard_range(n, r, ws)) for r in range(ws)]
            for n, ws in pairs}


def _compare_shards(got: Any, expected: dict[str, list[list[int]]]) -> None:
    if not isinstance(got, dict) or set(got) != set(expected):
        raise CheckFailed("the shards could not be collected", expected="a list of items per rank",
                          got=repr(got)[:200])
    for key, want in expected.items():
        for rank, (g, e) in enumerate(zip(got[key], want)):
            if g != e:
                hint, cause = _diagnose_shards(got[key], want)
                raise CheckFailed(f"{key}: rank {rank} gets the wrong items", expected=e, got=g,
                                  hint=hint, cause=cause)


def _diagnose_shards(got: list[list[int]], want: list[list[int]]) -> tuple[str, str]:
    """(hint, cause) for shards that differ from the balanced split, read from what they hold:
    the hint names the mistake the data shows, not the one the case was written for."""
    sizes, wanted = [len(g) for g in got], [len(e) for e in want]
    items = [i for g in got for i in g]
    n = sum(wanted)
    if sorted(sizes) == sorted(wanted) and sizes != wanted and sorted(items) == list(range(n)):
        return ("The sizes are right but the extra items sit on the last ranks: the remainder goes "
                "to the first n % world_size ranks.", "remainder on the last ranks")
    if all(g == e[:-1] for g, e in zip(got, want) if e) and any(len(e) > 1 for e in want):
        return ("Every shard stops one item early: range(start, stop) excludes stop, so stop is "
                "where the next rank starts.", "stops one early")
    if len(items) < n and len(set(items)) == len(items):
        missing = sorted(set(range(n)) - set(items))
        return (f"{len(missing)} of the {n} items are in no shard ({missing[:6]}"
                f"{' ...' if len(missing) > 6 else ''}): every item belongs to exactly one rank, "
                "so the n % world_size leftover items go one each to the first ranks.",
                "items dropped")
    if len(set(items)) < len(items) or any(i not in range(n) for i in items):
        return ("Some items are in two shards, or past n - 1: the shards must cover 0 .. n-1 "
                "exactly once.", "items repeated")
    if max(sizes, default=0) - min(sizes, default=0) > 1:
        return (f"Shard sizes {sizes} differ by more than one: chunks of ceil(n / world_size) "
                "leave the last ranks short. Balanced means sizes differ by at most one.",
                "unbalanced")
    return ("", "")


def _shard_case(name: str, pairs: list[tuple[int, int]], hint: str = "") -> None:
    def run(shard_range: Any, seed: int) -> dict[str, list[list[int]]]:
        return _all_shards(shard_range, pairs)

    SHARD.case(name, compare=_compare_shards, hint=hint)(run)


_shard_case("12 items on 4 ranks (an even split)", [(12, 4)])
_shard_case("10 items on 4 ranks (ranks 0 and 1 get one extra)", [(10, 4)],
            hint="The remainder goes to the first n % world_size ranks, not the last ones.")
_shard_case("3 items on 5 ranks (more ranks than items)", [(3, 5)],
            hint="Ranks past the last item get an empty range.")
_shard_case("every n from 0 to 40 on 1 to 8 ranks",
            [(n, ws) for n in range(41) for ws in range(1, 9)])


@SHARD.case("returns a range object",
            hint="A shard is described by its bounds, not listed item by item: a range object "
                 "costs no memory for any n.",
            recipe="Return a range built from the shard's start and stop, not a list.")
def _(shard_range: Any, seed: int) -> str:
    return type(shard_range(10, 1, 4)).__name__


# --------------------------------------------------------------------------- task 0.2

# forbids nothing: no library computes a mean weighted by each rank's count; dist.all_reduce,
# which the task calls, is the tool, not the answer.
MEAN = task(
    "0.2",
    hint="A mean over all ranks weighs every element alike, so a rank holding more elements "
         "counts more. Averaging the per-rank means is wrong as soon as ranks hold different "
         "numbers of elements.",
    recipe="On every rank take the local sum and the local number of elements (in float64, on "
           "the tensor's own device), add both up over all ranks with one all_reduce (SUM), "
           "then divide the global sum by the global count and return a 0-d tensor of the "
           "input's dtype.",
)


def local_blocks(seed: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Each rank's data: float32 blocks of the given shapes, centred on different values."""
    g = torch.Generator().manual_seed(seed)
    # The per-rank offset makes the mean of means differ clearly from the true mean.
    return [torch.randn(shape, generator=g) + 3.0 * rank for rank, shape in enumerate(shapes)]


def _mean_on_rank(global_mean: Any, seed: int, shapes: list[tuple[int, ...]]) -> Any:
    """What one rank returns: ``global_mean`` of its own block, as plain data."""
    import torch.distributed as dist

    local = local_blocks(seed, shapes)[dist.get_rank()]
    return plain(global_mean(local))


def _wrong_means(seed: int, shapes: list[tuple[int, ...]]) -> dict[str, Any]:
    """The values the typical mistakes give on these blocks, so a wrong mean is named by what it
    equals (not an answer: each is a mistake)."""
    blocks = [b.double() for b in local_blocks(seed, shapes)]
    means = [b.mean().item() if b.numel() else float("nan") for b in blocks]
    full = [m for m in means if m == m]
    rows = [len(b) for b in blocks]
    return {"local means": means,
            "mean of the rank means": sum(full) / len(full),
            "rows for the count": sum(b.sum().item() for b in blocks) / max(sum(rows), 1)}


_DIAGNOSES = {
    "local means": ("every rank returned the mean of its own block: nothing was added up across "
                    "ranks", "The global mean needs every rank's sum and count: one all_reduce "
                    "adds them up, so every rank ends with the same value."),
    "mean of the rank means": ("the value is the mean of the per-rank means",
                               "Weight each rank by how many elements it holds: add up sums and "
                               "counts, then divide; the mean of means is right only for equal "
                               "counts."),
    "rows for the count": ("the value divides by the number of rows, not of elements",
                           "Count elements, not rows: len() of a 2-D tensor is its number of "
                           "rows."),
}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


def _compare_means(got: Any, expected: dict[str, Any]) -> None:
    want, wrong = expected["mean"], expected["wrong"]
    values = []
    for rank, g in enumerate(per_rank(got, len(want), "mean")):
        if not isinstance(g, torch.Tensor):
            raise CheckFailed(f"rank {rank} returned {describe(g, 80)}, not a tensor",
                              expected="a 0-d tensor", got=g, cause="not a tensor",
                              hint="Return a tensor, e.g. total / count, not .item().")
        if g.numel() != 1:
            raise CheckFailed(f"rank {rank} returned a tensor of shape {tuple(g.shape)}, not a "
                              "single value", expected="a 0-d tensor, like torch.mean returns",
                              got=f"shape {tuple(g.shape)}", cause="not one value")
        values.append(g.double().item())
    for rank, (value, e) in enumerate(zip(values, want)):
        if _close(value, e):
            continue
        shown = round(value, 6) if value == value else value
        if all(_close(v, m) or (v != v and m != m) for v, m in zip(values, wrong["local means"])):
            what, hint, cause = (*_DIAGNOSES["local means"], "local means")
        elif value != value:
            what, hint, cause = ("the mean is nan", "", "nan")  # the case's hint: an empty rank
        else:
            what, hint, cause = "", "", ""
            for name in ("mean of the rank means", "rows for the count"):
                if _close(value, wrong[name]):
                    what, hint, cause = (*_DIAGNOSES[name], name)
                    break
        raise CheckFailed(f"rank {rank} returned the wrong mean" + (f": {what}" if what else ""),
                          expected=round(e, 6), got=shown, hint=hint, cause=cause)


def _mean_case(name: str, shapes: list[tuple[int, ...]], hint: str = "", recipe: str = "") -> None:
    """A case on ``len(shapes)`` ranks, rank r holding a block of ``shapes[r]``."""
    on_ranks = MEAN.shared(partial(_mean_on_rank, shapes=shapes), world_size=len(shapes),
                           timeout=20.0)
    MEAN.case(name, uses=on_ranks, compare=_compare_means, hint=hint, recipe=recipe,
              expect=lambda seed: {"mean": MEAN.trusted("mean_in_one_process")(seed, shapes),
                                   "wrong": _wrong_means(seed, shapes)})


_mean_case("4 ranks holding 6 elements each", [(6,)] * 4)
_mean_case("4 ranks holding 5, 1, 3 and 8 elements", [(5,), (1,), (3,), (8,)],
           hint="Weight each rank by how many elements it holds: sum and count, not mean.")
_mean_case("3 ranks, one of them empty (4, 0 and 7 elements)", [(4,), (0,), (7,)],
           hint="An empty rank has sum 0 and count 0 and must still join every collective; "
                "the mean of an empty tensor is nan.")
_mean_case("2 ranks holding 2-D blocks (3x4 and 1x4)", [(3, 4), (1, 4)],
           hint="Count elements, not rows: len() of a 2-D tensor is its number of rows.",
           recipe="numel() counts every element of a tensor of any shape; weight each rank by it.")
