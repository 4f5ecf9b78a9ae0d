"""Seeded bugs of Lesson 00: shard_range (0.1) and global_mean (0.2).

Each bug is the solution with one step changed (edited_solution), plus the cheat that asks
torch's own sampler.
"""

from __future__ import annotations

from bugs import edited_solution

# --------------------------------------------------------------------------- 0.1 shard_range

_START = "start = rank * base + min(rank, extra)"
_EXTRA = "(1 if rank < extra else 0)"


def _shard_range(*edits: tuple[str, str]):
    return edited_solution(0, *edits).shard_range


shard_range_extra_to_last_ranks = _shard_range(  # the remainder placed on the wrong end
    (_START, "start = rank * base + max(0, rank - (world_size - extra))"),
    (_EXTRA, "(1 if rank >= world_size - extra else 0)"))
shard_range_stop_off_by_one = _shard_range((_EXTRA, f"{_EXTRA} - 1"))  # the last item is lost
shard_range_drops_remainder = _shard_range((_START, "start = rank * base"), (_EXTRA, "0"))
shard_range_ceil_chunks = _shard_range((  # every rank takes the larger size, the last run short
    "    return range(start, start + base + (1 if rank < extra else 0))",
    "    size = -(-n // world_size)\n"
    "    return range(min(rank * size, n), min((rank + 1) * size, n))"))
shard_range_returns_list = _shard_range((
    "return range(start, start + base + (1 if rank < extra else 0))",
    "return list(range(start, start + base + (1 if rank < extra else 0)))"))


def shard_range_from_torch_sampler(n: int, rank: int, world_size: int) -> range:
    from torch.utils.data import DistributedSampler  # exploit: torch's own sharding

    indices = list(DistributedSampler(range(n), world_size, rank, shuffle=False, drop_last=True))
    return range(indices[0], indices[-1] + 1) if indices else range(0)


# --------------------------------------------------------------------------- 0.2 global_mean


def _global_mean(*edits: tuple[str, str]):
    return edited_solution(0, *edits).global_mean


global_mean_of_local_means = _global_mean(  # [sum of means, world size]
    ("local.sum(dtype=torch.float64)", "local.mean(dtype=torch.float64)"),
    ("torch.tensor(local.numel(),", "torch.tensor(1,"))
global_mean_counts_rows = _global_mean(("torch.tensor(local.numel(),", "torch.tensor(len(local),"))
global_mean_no_communication = _global_mean(("    dist.all_reduce(total)  # now", "    # not"))
global_mean_returns_float = _global_mean((
    "return (total[0] / total[1]).to(local.dtype)", "return (total[0] / total[1]).item()"))


BUGS = {
    "0.1": [
        ("gives the remainder to the last ranks", shard_range_extra_to_last_ranks),
        ("stops one item early (off by one)", shard_range_stop_off_by_one),
        ("drops the n % world_size leftover items", shard_range_drops_remainder),
        ("uses ceil-sized chunks", shard_range_ceil_chunks),
        ("returns a list, not a range", shard_range_returns_list),
        ("asks torch's DistributedSampler", shard_range_from_torch_sampler),
    ],
    "0.2": [
        ("averages the per-rank means", global_mean_of_local_means),
        ("counts rows with len() instead of elements", global_mean_counts_rows),
        ("returns the local mean without communicating", global_mean_no_communication),
        ("returns a Python float", global_mean_returns_float),
    ],
}
