"""Seeded bugs of Lesson 00: shard_range (0.1) and global_mean (0.2)."""

from __future__ import annotations

import torch
import torch.distributed as dist

# --------------------------------------------------------------------------- 0.1 shard_range


def shard_range_extra_to_last_ranks(n: int, rank: int, world_size: int) -> range:
    base, extra = divmod(n, world_size)
    first_with_extra = world_size - extra  # the remainder placed on the wrong end
    start = rank * base + max(0, rank - first_with_extra)
    return range(start, start + base + (1 if rank >= first_with_extra else 0))


def shard_range_stop_off_by_one(n: int, rank: int, world_size: int) -> range:
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0) - 1)  # the last item is lost


def shard_range_drops_remainder(n: int, rank: int, world_size: int) -> range:
    base = n // world_size
    return range(rank * base, (rank + 1) * base)


def shard_range_ceil_chunks(n: int, rank: int, world_size: int) -> range:
    size = -(-n // world_size)  # ceil: every rank takes the larger size, the last ones run short
    return range(min(rank * size, n), min((rank + 1) * size, n))


def shard_range_returns_list(n: int, rank: int, world_size: int) -> list[int]:
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (1 if rank < extra else 0)))


# --------------------------------------------------------------------------- 0.2 global_mean


def global_mean_of_local_means(local: torch.Tensor) -> torch.Tensor:
    mean = local.mean()
    dist.all_reduce(mean)
    return mean / dist.get_world_size()


def global_mean_counts_rows(local: torch.Tensor) -> torch.Tensor:
    total = torch.stack([local.sum(), torch.tensor(float(len(local)))])
    dist.all_reduce(total)
    return total[0] / total[1]


def global_mean_no_communication(local: torch.Tensor) -> torch.Tensor:
    return local.mean()


def global_mean_returns_float(local: torch.Tensor) -> float:
    total = torch.stack([local.sum(dtype=torch.float64), torch.tensor(float(local.numel()))])
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def shard_range_from_torch_sampler(n: int, rank: int, world_size: int) -> range:
    from torch.utils.data import DistributedSampler  # exploit: torch's own sharding

    indices = list(DistributedSampler(range(n), world_size, rank, shuffle=False, drop_last=True))
    return range(indices[0], indices[-1] + 1) if indices else range(0)


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
