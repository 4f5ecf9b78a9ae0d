# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # {{title}}
#
# Data-parallel training gives every rank a different share of the data. `DistributedDataParallel`
# does not do that for you: it averages gradients, and whatever batches you feed it are what
# it averages over. If two ranks read the same samples, or every epoch reads them in the same
# order, or every worker draws the same "random" augmentation, training still runs and the
# loss still goes down. Nothing crashes. That is why most silent bugs of distributed training
# live here, in the data plane. This lesson makes them visible.
#
# **Prerequisites:** Lesson 00 (`launch`, ranks) and Lesson 01 (`dist.all_gather`,
# `dist.all_reduce`); a PyTorch `Dataset` returns one sample for an index.
#
# **You will be able to:**
# - tune a `DataLoader`: `num_workers`, `prefetch_factor`, `persistent_workers`, `pin_memory`,
#   `collate_fn`, and measure what each buys;
# - seed loader workers so that every worker of every rank in every epoch draws its own,
#   reproducible random numbers ({{task 3.2}});
# - say exactly which indices `DistributedSampler` gives each rank, padding, `drop_last` and
#   `set_epoch` included, by rebuilding it ({{task 3.1}});
# - compute a metric over a distributed evaluation set that equals the single-process metric
#   exactly ({{task 3.3}}).
#
# Each task is a function or class with a fixed name. Replace `raise NotImplementedError(...)`
# with your code, run the cell, then run the `check(...)` cell under it.

# %% tags=["setup"]
import math
import os
import random
import time
import warnings

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, get_worker_info

from kit import check, launch
from kit.lessons.data import SlowDataset, plot_index_streams, sampler_streams, time_loader

# %% [markdown]
# ## 1. `Dataset` and `DataLoader` in one page
#
# A map-style [`Dataset`](https://pytorch.org/docs/stable/data.html#dataset-types) answers two
# questions: how many samples (`__len__`) and what is sample `i` (`__getitem__`). A
# [`DataLoader`](https://pytorch.org/docs/stable/data.html#torch.utils.data.DataLoader) turns
# it into batches:
#
# 1. a **sampler** yields indices (in order, shuffled, or this rank's share);
# 2. `batch_size` indices are grouped and each sample is fetched with `dataset[i]`;
# 3. `collate_fn` turns the list of samples into one batch (by default: stack tensors);
# 4. with `num_workers > 0`, steps 2-3 run in that many **worker processes**, each started
#    when you call `iter(loader)` (every epoch), each with a copy of the dataset.
#
# `SlowDataset(n, delay_s)` from `kit.lessons.data` is a synthetic dataset whose every sample takes
# `delay_s` seconds to "load", standing in for reading and decoding a file:

# %%
dataset = SlowDataset(12, delay_s=0.005)
loader = DataLoader(dataset, batch_size=4, shuffle=False)
for x, y in loader:
    print(f"x: {tuple(x.shape)} {x.dtype}   y: {y.tolist()}")

# %% [markdown]
# Samples of different sizes cannot be stacked: a batch of protein or peptide sequences of
# different lengths needs a `collate_fn` that pads them to the longest one and keeps the
# lengths (or a mask). Here with random integer "residues" (20 amino acids, `0` is padding):

# %%
class RandomPeptides(Dataset):
    """Sample i: a (length,) int64 sequence of residues 1..20, length 5..15, made from i."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        length = int(torch.randint(5, 16, (), generator=g))
        return torch.randint(1, 21, (length,), generator=g)


def pad_collate(sequences):
    lengths = torch.tensor([len(s) for s in sequences])
    padded = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True, padding_value=0)
    return padded, lengths  # (B, L_max) int64, (B,)


padded, lengths = next(iter(DataLoader(RandomPeptides(), batch_size=4, collate_fn=pad_collate)))
print(padded)
print("lengths:", lengths.tolist())

# %% [markdown]
# ## 2. Workers: how many, and what they cost
#
# With `num_workers=0` the training loop waits for every sample to load. With `num_workers=k`,
# `k` processes load batches ahead of time; each keeps up to `prefetch_factor` batches (default
# 2) in flight, so at most `k * prefetch_factor` batches sit in memory waiting.
#
# How much do workers help? It depends on what the loading waits for. Below, 64 samples of
# 10 ms each are loaded with 0, 1, 2 and 4 workers, twice: once when the 10 ms are spent
# *waiting* (sleep: like disk or network reads) and once when they are spent *computing* on
# the CPU (a busy loop: like a Python-heavy augmentation). This machine has
# `os.cpu_count()` cores; watch where the second curve stops climbing.

# %%
def throughput(num_workers, busy):
    data = SlowDataset(64, delay_s=0.01, busy=busy)
    loader = DataLoader(data, batch_size=8, num_workers=num_workers)
    return time_loader(loader).samples_per_s


workers = [0, 1, 2, 4]
with warnings.catch_warnings():  # torch warns when num_workers exceeds the cores: here on purpose
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    # Best of 3, interleaved: other programs on the machine slow some runs, never speed them up.
    runs = [{busy: [throughput(k, busy) for k in workers] for busy in (False, True)}
            for _ in range(3)]
speed = {busy: [max(r[busy][i] for r in runs) for i in range(len(workers))]
         for busy in (False, True)}

fig, ax = plt.subplots(figsize=(5.5, 3.2))
ax.plot(workers, speed[False], "o-", label="waiting (I/O-like)")
ax.plot(workers, speed[True], "s-", label="computing (CPU-bound)")
ax.set(xlabel="num_workers", ylabel="samples / s", xticks=workers,
       title=f"64 samples of 10 ms each, {os.cpu_count()} CPU cores")
ax.legend()
plt.show()
for busy, label in ((False, "waiting"), (True, "computing")):
    print(f"{label:9s}: " + ", ".join(f"{k} workers {s / speed[busy][0]:.1f}x"
                                      for k, s in zip(workers, speed[busy])))

# %% [markdown]
# Waiting overlaps in any number of processes; computing does not go faster than the number of
# free cores. On a GPU node the usual starting point is a few workers per GPU process, as many
# as the node's cores divided by its GPUs allow; measure, then adjust.
#
# **Start-up cost and `persistent_workers`.** Workers are started by `iter(loader)`, that is,
# at the start of *every* epoch, and stopped at its end; each start copies the dataset into
# the worker and runs `worker_init_fn`. When that is expensive (opening files, loading a
# tokenizer or an index), `persistent_workers=True` keeps the workers alive across epochs.
# Here each worker's start-up takes 0.3 s:

# %%
def slow_start(worker_id):
    time.sleep(0.3)  # e.g. open a large file and read its index


def first_batch_times(persistent):
    loader = DataLoader(SlowDataset(16, delay_s=0.002), batch_size=4, num_workers=2,
                        worker_init_fn=slow_start, persistent_workers=persistent)
    return time_loader(loader, epochs=3).first_batch_s


first = {p: first_batch_times(p) for p in (False, True)}
fig, ax = plt.subplots(figsize=(5.5, 3))
for shift, p in ((-0.2, False), (0.2, True)):
    ax.bar([e + shift for e in range(3)], first[p], width=0.4, label=f"persistent_workers={p}")
ax.set(xlabel="epoch", ylabel="seconds to first batch", xticks=range(3),
       ylim=(0, 1.5 * max(first[False])))
ax.legend(loc="upper right")
plt.show()

# %% [markdown]
# Two more knobs matter only on a GPU: `pin_memory=True` makes the loader put batches in
# page-locked memory, which the GPU can copy from asynchronously (see *Running at scale*).
# `collate_fn` and `worker_init_fn` run in the workers, so keep them cheap and picklable.

# %% [markdown]
# ## 3. Random numbers in workers
#
# Random augmentation (crops, noise, masking residues) draws from random number generators.
# A worker process starts as a copy of the main process, generators included. If nobody
# re-seeds them, every worker produces *the same* "random" numbers.
#
# Since PyTorch 1.9 the loader re-seeds the global generators of Python's `random`, NumPy and
# torch in every worker from a per-worker seed (`get_worker_info().seed`, also
# `torch.initial_seed()` inside the worker): `base_seed + worker_id`, with `base_seed` drawn
# from torch's generator at every `iter(loader)`. So the classic bug is gone for the global
# generators. It is alive and well in two places:
#
# 1. a generator the dataset owns, e.g. `self.rng = np.random.default_rng(0)`: copied as is;
# 2. across ranks: every rank calls `torch.manual_seed(0)` (to start from identical weights),
#    so every rank's loader draws the same `base_seed`, and worker `k` of rank 0 draws exactly
#    what worker `k` of rank 1 draws.
#
# First, a dataset with its own generator, drawing one "augmentation" per sample:

# %%
class NoisySamples(Dataset):
    """Sample i: (i, noise) where noise comes from a generator the dataset owns."""

    def __init__(self, n):
        self.n = n
        self.rng = np.random.default_rng(0)  # copied into every worker, state included

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i, round(float(self.rng.normal()), 3)


def noise_by_worker(worker_init_fn=None):
    loader = DataLoader(NoisySamples(6), batch_size=None, num_workers=2,
                        worker_init_fn=worker_init_fn)
    return [(i, noise) for i, noise in loader]


print("sample, noise:", noise_by_worker())

# %% [markdown]
# Samples 0 and 1 went to different workers and got the same noise; so did 2 and 3, 4 and 5.
# A `worker_init_fn` runs first thing in each worker and can re-create the generator from
# the worker's seed:

# %%
def reseed_dataset_rng(worker_id):
    info = get_worker_info()
    info.dataset.rng = np.random.default_rng(info.seed)  # info.dataset is this worker's copy


print("sample, noise:", noise_by_worker(reseed_dataset_rng))

# %% [markdown]
# Now the ranks. Each of 2 ranks seeds torch with 0, as training scripts do, and loads with
# 2 workers; each worker reports its seed and its first draw from NumPy's global generator:

# %%
class FirstDraw(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        info = get_worker_info()
        return {"worker": info.id, "seed": info.seed, "numpy": round(float(np.random.random()), 4)}


def draws_per_rank(worker_init_fn=None):
    torch.manual_seed(0)  # identical initial weights on every rank: a good idea, and the trap
    loader = DataLoader(FirstDraw(), batch_size=None, num_workers=2, worker_init_fn=worker_init_fn)
    return [(d["worker"], d["numpy"]) for d in loader]


for rank, draws in enumerate(launch(draws_per_rank, world_size=2)):
    print(f"rank {rank}: (worker, numpy draw) = {draws}")

# %% [markdown]
# Both ranks augment their (different) samples with identical random numbers: half the
# randomness you paid for, and a correlation between ranks that no loss curve will show.
#
# ## 4. Task 3.2: seed every worker of every rank
#
# Write `seed_worker(worker_id)`, a `worker_init_fn` that re-seeds Python's `random`, NumPy's
# global generator and torch's global generator so that
#
# - every worker of every rank in every epoch draws a different stream,
# - the same seeds give the same streams (a rerun reproduces the run),
# - everything derives from torch's per-worker seed `torch.initial_seed()` (which changes
#   every epoch) and the rank, read from the `RANK` environment variable (`torchrun` and
#   `launch` set it; 0 when it is absent).
#
# Beware of simple arithmetic: `torch.initial_seed() + rank` gives rank 1 worker 0 the seed
# of rank 0 worker 1. *Hint:*
# [`np.random.SeedSequence`](https://numpy.org/doc/stable/reference/random/bit_generators/generated/numpy.random.SeedSequence.html)
# mixes several numbers into independent seeds: `SeedSequence([a, b]).generate_state(3)`.
# Background: [randomness in multi-process data loading](https://pytorch.org/docs/stable/data.html#data-loading-randomness).

# %% tags=["task-3.2"]
def seed_worker(worker_id: int) -> None:
    """Seed random, NumPy and torch in a DataLoader worker from torch's per-worker seed and RANK.

    Called in each worker process as it starts. Every (rank, epoch, worker) must get distinct
    streams, the same ones again for the same torch seed; the rank is int(os.environ["RANK"])
    (0 if unset).

    At the edges: world size 1 (a plain python run, RANK unset) is rank 0 and draws rank 0's
    streams; a loader with one worker is the same contract, worker_id 0.
    """
    ### BEGIN SOLUTION
    rank = int(os.environ.get("RANK", "0"))
    # torch.initial_seed() = base_seed + worker_id, base_seed new every epoch: it separates
    # workers and epochs but not ranks that seeded alike. SeedSequence mixes both numbers
    # into three independent seeds, with no collisions between (seed, rank) pairs.
    torch_seed, numpy_seed, python_seed = np.random.SeedSequence(
        [torch.initial_seed(), rank]).generate_state(3, dtype=np.uint64)
    torch.manual_seed(int(torch_seed))
    np.random.seed(int(numpy_seed) % 2**32)  # the legacy global generator takes 32 bits
    random.seed(int(python_seed))
    ### END SOLUTION


# %% tags=["check-3.2"]
check("3.2", seed_worker)

# %% [markdown]
# The same experiment with your `seed_worker`: every (rank, worker) now draws its own numbers.

# %%
for rank, draws in enumerate(launch(draws_per_rank, seed_worker, world_size=2)):
    print(f"rank {rank}: (worker, numpy draw) = {draws}")

# %% [markdown]
# ## 5. `DistributedSampler`, exactly
#
# [`DistributedSampler`](https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler)
# gives each of `num_replicas` ranks its share of the indices `0 .. N-1`. Every rank runs the
# same arithmetic on its own, with no communication, so they must all agree on it:
#
# 1. **Order.** With `shuffle=True`, a permutation `torch.randperm(N, generator=g)` where `g`
#    is a `torch.Generator` seeded with `seed + epoch`; otherwise `0 .. N-1`. Same seed and
#    epoch on every rank, so the same permutation everywhere.
# 2. **Equal shares.** Every rank must take the same number of steps (a rank that runs out
#    early would leave the others waiting in a collective). So each rank gets
#    `num_samples = ceil(N / num_replicas)` indices, and `total_size = num_samples * num_replicas`.
# 3. **Padding.** The list is extended to `total_size` by repeating its own beginning (wrapping
#    around as often as needed when `N < num_replicas`). With `drop_last=True` it is cut to
#    `floor(N / num_replicas) * num_replicas` instead (the code writes that as
#    `ceil((N - num_replicas) / num_replicas)` per rank when `N` does not divide evenly).
# 4. **Split.** Rank `r` takes every `num_replicas`-th index starting at `r`:
#    `indices[r::num_replicas]`. So the sample at global position `p` goes to rank
#    `p % num_replicas` as its step `p // num_replicas`.
#
# `set_epoch(epoch)` only stores the epoch; the next `iter()` uses it. Forget to call it and
# every epoch repeats epoch 0's order.
#
# ## 6. Task 3.1: rebuild it
#
# Write `ShardSampler(dataset, num_replicas=None, rank=None, shuffle=True, seed=0,
# drop_last=False)` with `set_epoch(epoch)`, `__iter__` and `__len__`, yielding *exactly* the
# indices `DistributedSampler` yields, for every dataset length (including 0 and lengths
# smaller than `num_replicas`), every rank, shuffle, seed, `drop_last` and epoch.
# `num_replicas=None` and `rank=None` mean the world size and rank of the default process
# group. Do not wrap `DistributedSampler`; the check compares against it index for index,
# on fixed cases and on 120 random ones from a property-based search
# ([hypothesis](https://hypothesis.readthedocs.io/)), and shows the smallest case that differs.

# %% tags=["task-3.1"]
class ShardSampler(Sampler[int]):
    """Yield this rank's dataset indices exactly as torch.utils.data.DistributedSampler does.

    Order: torch.randperm(len(dataset)) seeded with seed + epoch (or 0..N-1); padded by
    repetition (or cut, with drop_last) to num_samples * num_replicas; rank r takes every
    num_replicas-th index from r. num_replicas / rank default to the process group's.
    """

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0,
                 drop_last=False):
        ### BEGIN SOLUTION
        self.num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        self.rank = dist.get_rank() if rank is None else rank
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is outside [0, {self.num_replicas - 1}]")
        self.dataset, self.shuffle, self.seed, self.drop_last = dataset, shuffle, seed, drop_last
        self.epoch = 0
        n = len(dataset)
        if drop_last:
            self.num_samples = n // self.num_replicas  # the uneven tail is dropped
        else:
            self.num_samples = math.ceil(n / self.num_replicas)  # the last shares get padded
        self.total_size = self.num_samples * self.num_replicas
        ### END SOLUTION

    def set_epoch(self, epoch: int) -> None:
        ### BEGIN SOLUTION
        self.epoch = epoch
        ### END SOLUTION

    def __iter__(self):
        ### BEGIN SOLUTION
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)  # same permutation on every rank, new each epoch
            indices = torch.randperm(n, generator=g).tolist()
        else:
            indices = list(range(n))
        if self.drop_last:
            indices = indices[: self.total_size]
        elif indices:
            # Repeat the list's own beginning, wrapping around when it is shorter than the gap.
            repeats = math.ceil(self.total_size / n)
            indices = (indices * repeats)[: self.total_size]
        return iter(indices[self.rank : self.total_size : self.num_replicas])
        ### END SOLUTION

    def __len__(self) -> int:
        ### BEGIN SOLUTION
        return self.num_samples
        ### END SOLUTION


# %% tags=["check-3.1"]
check("3.1", ShardSampler)

# %% [markdown]
# Here are 10 samples on 4 ranks over 3 epochs, drawn with your sampler: one grid per epoch,
# a row per rank, the number in each cell is the dataset index the rank reads at that step.
# A red frame marks a padded duplicate: 10 samples fill only 10 of the 12 slots, so the last
# two slots repeat the first two indices of the epoch's order.

# %%
def make_sampler(rank):
    return ShardSampler(range(10), num_replicas=4, rank=rank, shuffle=True, seed=0)


plot_index_streams(sampler_streams(make_sampler, 4, 3, set_epoch=True), 10,
                   title="sampler.set_epoch(epoch) called every epoch")
plt.show()
plot_index_streams(sampler_streams(make_sampler, 4, 3, set_epoch=False), 10,
                   title="set_epoch forgotten: every epoch is epoch 0")
plt.show()

# %% [markdown]
# Without `set_epoch`, each rank sees the same samples in the same order every epoch: no
# reshuffling across ranks, and the same samples always share a batch. For training that is
# a quiet loss of randomness. For evaluation the padding is the problem, next.

# %% [markdown]
# ## 7. Exact distributed evaluation
#
# Evaluating on 4 ranks with `DistributedSampler(shuffle=False)` is 4 times faster, but the
# padded slots are *real* samples evaluated twice. The usual recipe, "all-reduce the number
# correct and the number seen", counts them twice. Below, 10 samples where exactly the
# first two (the ones padding repeats) are predicted correctly:

# %%
N_EVAL = 10
labels = torch.arange(N_EVAL) % 3
predictions = torch.where(torch.arange(N_EVAL) < 2, labels, (labels + 1) % 3)


def padded_accuracy():
    sampler = DistributedSampler(range(N_EVAL), shuffle=False)  # 3 per rank: 12 slots
    idx = list(sampler)
    counts = torch.tensor([(predictions[idx] == labels[idx]).sum().item(), len(idx)],
                          dtype=torch.float64)
    dist.all_reduce(counts)  # [correct, seen] over all ranks, duplicates included
    return (counts[0] / counts[1]).item()


single = (predictions == labels).double().mean().item()
print(f"one process: {single:.3f}   "
      f"4 ranks, all_reduce of counts: {launch(padded_accuracy)[0]:.3f}")

# %% [markdown]
# 4 correct out of 12 instead of 2 out of 10. With a real validation set of 10,001 samples on 8
# GPUs the error is smaller, but it is there, it changes with the world size, and it makes
# runs on different numbers of GPUs disagree.
#
# ## 8. Task 3.3: gather without the padding
#
# Write `gather_unpadded(local, num_samples)`, called on every rank with the per-sample
# results (losses, predictions, logits: shape `(S, ...)`) of its `DistributedSampler` shard
# taken with `shuffle=False`, where `num_samples` is the dataset length `N`. It returns on every
# rank the results of the whole dataset, shape `(N, ...)`, in dataset order, padding removed.
# Any metric computed from it equals the single-process metric.
#
# Every shard has the same length `S = ceil(N / world_size)`, so
# [`dist.all_gather`](https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_gather)
# applies. Remember from section 5 where global position `p` went: rank `p % world_size`,
# step `p // world_size`.

# %% tags=["task-3.3"]
def gather_unpadded(local: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Return the whole dataset's (num_samples, ...) results, in order, from every rank's shard.

    local: (S, ...) results of this rank's DistributedSampler(shuffle=False) shard, padding
    included; S = ceil(num_samples / world_size). Called on every rank; same result everywhere.
    """
    ### BEGIN SOLUTION
    world_size = dist.get_world_size()
    local = local.contiguous()
    shards = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(shards, local)  # world_size x (S, ...)
    # Step s of rank r is global position s * world_size + r: stacking on dim 1 gives
    # (S, world_size, ...) whose row-major order is the global order.
    ordered = torch.stack(shards, dim=1).reshape(-1, *local.shape[1:])  # (S * world_size, ...)
    return ordered[:num_samples]  # positions >= num_samples are the padded duplicates
    ### END SOLUTION


# %% tags=["check-3.3"]
check("3.3", gather_unpadded)

# %% [markdown]
# The same evaluation, exact:

# %%
def exact_accuracy():
    sampler = DistributedSampler(range(N_EVAL), shuffle=False)
    idx = list(sampler)
    correct = (predictions[idx] == labels[idx]).to(torch.int64)  # (3,) per rank
    every = gather_unpadded(correct, N_EVAL)  # (10,) on every rank
    return every.double().mean().item()


print(f"one process: {single:.3f}   4 ranks, gather_unpadded: {launch(exact_accuracy)[0]:.3f}")

# %% [markdown]
# Gathering costs memory proportional to the dataset (fine for per-sample scalars, think twice
# for per-sample logits over a huge vocabulary). When you only need sums, there is a cheaper
# exact way: each rank knows which of its slots are padding (step `s` of rank `r` is padding
# when `s * world_size + r >= N`), so it can mask them out before the `all_reduce` of counts.
# That is exercise 3.

# %% [markdown]
# ## Running at scale
#
# > Under `torchrun` on GPUs the data plane is the same code with three additions: each GPU
# > process runs its own loader and workers, batches go to the GPU from pinned memory, and the
# > copy overlaps the computation. Start it with
# > `torchrun --standalone --nproc_per_node=8 train.py`:
# >
# > ```python
# > import os
# > import torch
# > import torch.distributed as dist
# > from torch.utils.data import DataLoader, DistributedSampler
# >
# > dist.init_process_group("nccl")
# > local_rank = int(os.environ["LOCAL_RANK"])
# > device = torch.device("cuda", local_rank)
# > torch.cuda.set_device(device)
# > torch.manual_seed(0)  # identical initial weights; seed_worker keeps workers apart
# >
# > sampler = DistributedSampler(train_set, shuffle=True, seed=0, drop_last=True)
# > cores_per_gpu = os.cpu_count() // int(os.environ["LOCAL_WORLD_SIZE"])
# > loader = DataLoader(train_set, batch_size=64, sampler=sampler,   # no shuffle= with a sampler
# >                     num_workers=max(1, min(8, cores_per_gpu - 1)),  # a core for the rank
# >                     pin_memory=True, persistent_workers=True, prefetch_factor=4,
# >                     worker_init_fn=seed_worker)
# > for epoch in range(epochs):
# >     sampler.set_epoch(epoch)  # a new permutation every epoch, the same on every rank
# >     for x, y in loader:
# >         x = x.to(device, non_blocking=True)  # async copy from pinned memory
# >         y = y.to(device, non_blocking=True)
# >         ...
# > ```
# >
# > `non_blocking=True` only overlaps when the source is pinned (`pin_memory=True`); from
# > ordinary pageable memory the copy is synchronous. Every GPU process on a node starts its
# > own `num_workers` workers, so 8 GPUs with 8 workers each is 64 loader processes: size
# > `num_workers` per process from the node's cores. See
# > [pinned memory](https://pytorch.org/docs/stable/notes/cuda.html#use-pinned-memory-buffers),
# > [the pin-memory tutorial](https://pytorch.org/tutorials/intermediate/pinmem_nonblock.html)
# > and [DataLoader memory pinning](https://pytorch.org/docs/stable/data.html#memory-pinning).

# %% [markdown]
# ## Summary
#
# - DDP averages gradients over whatever each rank loads: sharding the data is your job, and
#   its bugs are silent.
# - Workers overlap waiting for data without limit but computation only up to the free cores;
#   `persistent_workers` removes the per-epoch start-up; `pin_memory` plus
#   `non_blocking=True` overlaps the copy to the GPU.
# - The loader re-seeds `random`, NumPy and torch per worker and per epoch, but not a generator
#   your dataset owns, and not differently per rank: `seed_worker` mixes the rank in.
# - `DistributedSampler` shuffles with `seed + epoch` (call `set_epoch`!), pads by repeating
#   indices to equal shares (or drops the tail), and deals indices out round-robin.
# - The padded duplicates skew distributed metrics; gather in dataset order and drop them
#   (`gather_unpadded`), or mask them before reducing.
#
# **Read more:** [`torch.utils.data`](https://pytorch.org/docs/stable/data.html),
# [`DistributedSampler`](https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler),
# [DDP tutorial](https://pytorch.org/tutorials/intermediate/ddp_tutorial.html),
# [reproducibility](https://pytorch.org/docs/stable/notes/randomness.html#dataloader).
#
# ## Exercises (not graded)
#
# 1. Time `throughput(2, busy=True)` with `batch_size=1` and with `batch_size=32`. Why does the
#    batch size change the cost of workers?
# 2. Draw `sampler_streams` for `drop_last=True` with 10 samples on 4 ranks. Which samples are
#    never seen in epoch 0? In epoch 1?
# 3. Write `exact_mean_loss(local_losses, num_samples)` that masks the padded slots (step `s`
#    of rank `r` is padding when `s * world_size + r >= num_samples`) and uses one
#    `all_reduce` of `[sum, count]` instead of a gather. Compare it with `gather_unpadded`.
# 4. `ShardSampler` with `shuffle=True` deals a random permutation round-robin. Does
#    `gather_unpadded` still restore dataset order then? What would you have to gather as well?
# 5. With `persistent_workers=True`, is `seed_worker` called again in epoch 1? Are the streams of
#    epoch 1 still different from those of epoch 0? Try it with `FirstDraw`.
