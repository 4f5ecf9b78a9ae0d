"""Seeded bugs for Lesson 03: the typical mistakes each check of tasks 3.1-3.3 must catch.

``BUGS[task_id]`` lists ``(what is wrong, implementation)``; tests/test_lesson03.py (and the
pipeline's generic tests) prove every one of them fails its task's checks.
"""

from __future__ import annotations

import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

# --------------------------------------------------------------------------- task 3.1


class _Sampler:
    """A correct ShardSampler, split into steps so that each bug replaces one of them."""

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True,
                 seed=0, drop_last=False):
        self.num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        self.rank = dist.get_rank() if rank is None else rank
        self.dataset, self.shuffle, self.seed, self.drop_last = dataset, shuffle, seed, drop_last
        self.epoch = 0
        self.num_samples = self._num_samples(len(dataset))
        self.total_size = self.num_samples * self.num_replicas

    def _num_samples(self, n):
        return n // self.num_replicas if self.drop_last else math.ceil(n / self.num_replicas)

    def _order(self, n):
        if not self.shuffle:
            return list(range(n))
        return torch.randperm(
            n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()

    def _pad(self, indices):
        if not indices:
            return indices
        return (indices * math.ceil(self.total_size / len(indices)))[: self.total_size]

    def _split(self, indices):
        return indices[self.rank : self.total_size : self.num_replicas]

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        indices = self._order(len(self.dataset))
        indices = indices[: self.total_size] if self.drop_last else self._pad(indices)
        return iter(self._split(indices))

    def __len__(self):
        return self.num_samples


class PadsWithTheLastIndices(_Sampler):
    def _pad(self, indices):
        missing = self.total_size - len(indices)
        return indices + (indices * (missing + 1))[-missing:] if missing else indices


class PadsOnlyOnce(_Sampler):
    def _pad(self, indices):
        return indices + indices[: self.total_size - len(indices)]  # too short when N < padding


class IgnoresTheEpoch(_Sampler):
    def _order(self, n):
        if not self.shuffle:
            return list(range(n))
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.seed)).tolist()


class ContiguousBlocks(_Sampler):
    def _split(self, indices):
        return indices[self.rank * self.num_samples : (self.rank + 1) * self.num_samples]


class DropLastStillPads(_Sampler):
    def _num_samples(self, n):
        return math.ceil(n / self.num_replicas)

    def __iter__(self):
        return iter(self._split(self._pad(self._order(len(self.dataset)))))


class ShufflesWithPythonRandom(_Sampler):
    def _order(self, n):
        indices = list(range(n))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        return indices


class DefaultsToOneReplica(_Sampler):
    def __init__(self, dataset, num_replicas=None, rank=None, **kwargs):
        super().__init__(dataset, 1 if num_replicas is None else num_replicas,
                         0 if rank is None else rank, **kwargs)


class WrapsDistributedSampler(DistributedSampler):
    """Index for index right, but only because it is torch's own sampler."""


# --------------------------------------------------------------------------- task 3.2


def docs_recipe_same_on_every_rank(worker_id):
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def adds_the_rank_to_the_seed(worker_id):
    seed = torch.initial_seed() + int(os.environ.get("RANK", "0"))
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def fixed_seed_from_worker_and_rank(worker_id):
    seed = 1000 * int(os.environ.get("RANK", "0")) + worker_id
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def seeds_from_the_clock(worker_id):
    seed = time.time_ns() + worker_id
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def leaves_torch_alone(worker_id):
    rank = int(os.environ.get("RANK", "0"))
    numpy_seed, python_seed = np.random.SeedSequence([torch.initial_seed(), rank]).generate_state(2)
    np.random.seed(int(numpy_seed))
    random.seed(int(python_seed))


# --------------------------------------------------------------------------- task 3.3


def _gathered(local):
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, local.contiguous())
    return shards


def keeps_padded_duplicates(local, num_samples):
    return torch.stack(_gathered(local), dim=1).reshape(-1, *local.shape[1:])


def concatenates_rank_after_rank(local, num_samples):
    return torch.cat(_gathered(local))[:num_samples]


def cuts_every_shard_evenly(local, num_samples):
    keep = num_samples // dist.get_world_size()  # drops real samples along with the padding
    return torch.stack([s[:keep] for s in _gathered(local)], dim=1).reshape(-1, *local.shape[1:])


class ShardSampler(DistributedSampler):
    """Exploit: torch's sampler under the task's name, no code of its own."""


BUGS = {
    "3.1": [
        ("pads with the last indices instead of the first", PadsWithTheLastIndices),
        ("pads once only: too short when the dataset is smaller than the padding", PadsOnlyOnce),
        ("ignores the epoch: the same order every epoch", IgnoresTheEpoch),
        ("gives each rank a contiguous block instead of every num_replicas-th index",
         ContiguousBlocks),
        ("pads even with drop_last", DropLastStillPads),
        ("shuffles with Python's random instead of torch.randperm", ShufflesWithPythonRandom),
        ("treats num_replicas=None as a single replica", DefaultsToOneReplica),
        ("wraps torch's DistributedSampler", WrapsDistributedSampler),
        ("is torch's DistributedSampler (a subclass with no body)", ShardSampler),
    ],
    "3.2": [
        ("the docs recipe: numpy and random from torch's seed, the same on every rank",
         docs_recipe_same_on_every_rank),
        ("adds the rank to the seed: rank 1 worker 0 collides with rank 0 worker 1",
         adds_the_rank_to_the_seed),
        ("fixed seeds from worker id and rank: the same streams every epoch",
         fixed_seed_from_worker_and_rank),
        ("seeds from the clock: not reproducible", seeds_from_the_clock),
        ("seeds numpy and random per rank but leaves torch alone", leaves_torch_alone),
    ],
    "3.3": [
        ("keeps the padded duplicates", keeps_padded_duplicates),
        ("concatenates the shards rank after rank: wrong order", concatenates_rank_after_rank),
        ("cuts every shard to num_samples // world_size: loses real samples",
         cuts_every_shard_evenly),
    ],
}


def _requires_rank_variable():
    from bugs import edited_solution

    return edited_solution(3, ('rank = int(os.environ.get("RANK", "0"))',
                                                'rank = int(os.environ["RANK"])')).seed_worker


BUGS["3.2"].append(("requires RANK: a plain python run (world size 1) raises KeyError",
                    _requires_rank_variable()))
