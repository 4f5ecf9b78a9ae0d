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
# # Lesson 00 · Launching ranks from a notebook
#
# Distributed training runs one copy of your program per worker and lets the copies talk.
# This lesson starts such copies from a notebook cell, shows what each one sees, and what
# happens when one of them crashes or waits forever. Every later lesson builds on it.
#
# **Prerequisites:** Python functions, PyTorch tensors (`torch.tensor`, `.sum()`,
# `.mean()`). No GPU: everything runs on your laptop's CPU.
#
# **You will be able to:**
# - say what a *process*, a *rank* and a *world* are;
# - start ranks from a cell with `kit.launch` and `%%distributed`;
# - read the environment variables `torchrun` sets for every rank;
# - read per-rank output, a crashed rank and a hung collective;
# - split work across ranks (**Task 0.1**, 2 points) and combine a result from all of them
#   (**Task 0.2**, 3 points).
#
# Each task is a function with a fixed name. Replace `raise NotImplementedError(...)` with
# your code, run the cell, then run the `check(...)` cell under it for instant feedback.

# %% tags=["setup"]
import os

import torch
import torch.distributed as dist

from kit import LaunchError, LaunchTimeout, check, launch

# %%
# %load_ext kit

# %% [markdown]
# ## 1. Processes, ranks and a world
#
# A **process** is a running program with its own memory: one process cannot read another's
# variables. Data-parallel training starts several processes running the *same* code, each
# on its own share of the data, and has them exchange tensors through
# [`torch.distributed`](https://pytorch.org/docs/stable/distributed.html).
#
# The processes that work together form a **world** (in code, the default *process group*);
# `world_size` is how many there are. Each has a **rank**, its number `0 .. world_size - 1`,
# which is how it knows which share of the work is its own. Rank 0 usually also does the
# printing and checkpointing.
#
# `launch(fn, world_size=4)` starts 4 processes, joins them into one world and calls `fn()` in
# each. It returns the list of what each rank returned, indexed by rank:

# %%
def hello():
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    print(f"hello from rank {rank} of {world_size} (process id {os.getpid()})")
    return rank * rank


squares = launch(hello, world_size=4)
squares

# %% [markdown]
# Four different process ids: four separate programs, none of them your notebook. Each line
# is labelled `[rank N]` as it arrives, so the order changes from run to run: ranks run at
# the same time and nobody waits for anybody unless the code says so. The result, on the
# other hand, is always in rank order. `squares.outputs[rank]` keeps what each rank printed.

# %% [markdown]
# ## 2. What `torchrun` tells every rank
#
# On a cluster you start ranks with [`torchrun`](https://pytorch.org/docs/stable/elastic/run.html),
# which passes each rank its place in the world through environment variables.
# `kit.launch` sets exactly the same ones, so code written here runs unchanged under
# `torchrun`:

# %%
TORCHRUN_VARIABLES = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]


def read_environment():
    return {name: os.environ[name] for name in TORCHRUN_VARIABLES}


for rank, env in enumerate(launch(read_environment, world_size=4)):
    print(f"rank {rank}: " + "  ".join(f"{k}={v}" for k, v in env.items()))

# %% [markdown]
# | variable | meaning |
# | --- | --- |
# | `RANK` | this process's number in the whole world, `0 .. WORLD_SIZE - 1` |
# | `LOCAL_RANK` | its number on this machine: which GPU it should use |
# | `WORLD_SIZE` | how many ranks in total, over all machines |
# | `LOCAL_WORLD_SIZE` | how many ranks on this machine |
# | `MASTER_ADDR`, `MASTER_PORT` | where rank 0 listens, so the ranks can find each other |
#
# On one machine `RANK == LOCAL_RANK`. With two machines of 4 ranks each, the second machine
# has `RANK` 4 to 7 and `LOCAL_RANK` 0 to 3. `dist.init_process_group()` reads these
# variables to build the world; `launch` has already called it for you.

# %% [markdown]
# ## 3. A whole cell on every rank: `%%distributed`
#
# For quick experiments, `%%distributed -n 4` runs the body of a cell on 4 ranks. Inside,
# `rank`, `world_size`, `torch` and `dist` are ready to use, and the value of the last line
# comes back as a list indexed by rank. Here every rank contributes its rank number and
# `dist.all_reduce` sums them, in place, on every rank:

# %%
# %%distributed -n 4
x = torch.tensor([float(rank)])
dist.all_reduce(x)  # x becomes 0 + 1 + 2 + 3 on every rank
print(f"rank {rank} of {world_size}: sum of all ranks = {x.item():.0f}")
x.item()

# %% [markdown]
# A collective such as `all_reduce` is a meeting: every rank of the world must call it, and
# none can leave until all have arrived. Variables assigned inside a `%%distributed` cell
# live in the rank processes and vanish with them; return what you need as the last line.

# %% [markdown]
# ## 4. Task 0.1: give every rank its share
#
# Before ranks can work in parallel they must agree, without talking, on who does what.
# Split `n` items (numbered `0 .. n-1`) into `world_size` contiguous slices whose sizes differ
# by at most one: the first `n % world_size` ranks get one item more. With `n = 10` on 4
# ranks the sizes are 3, 3, 2, 2, so the slices are `range(0, 3)`, `range(3, 6)`,
# `range(6, 8)` and `range(8, 10)`. Every item belongs to exactly one rank; with more ranks
# than items, the last ranks get an empty range.
#
# Implement `shard_range(n, rank, world_size) -> range`. *Hint:* `divmod(n, world_size)`.

# %% tags=["task-0.1"]
def shard_range(n: int, rank: int, world_size: int) -> range:
    """Return the contiguous, balanced range of the n items that rank owns.

    The first n % world_size ranks get n // world_size + 1 items, the others n // world_size;
    the ranges of ranks 0, 1, ..., world_size - 1, in order, cover 0 .. n-1 exactly once.
    """
    ### BEGIN SOLUTION
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)  # each earlier rank r < extra took one item more
    return range(start, start + base + (1 if rank < extra else 0))
    ### END SOLUTION


# %% tags=["check-0.1"]
check("0.1", shard_range)

# %% [markdown]
# When a check fails, each failing case shows what it expected, what it got and a *hint* that
# names the idea it tests. Try again; if the same task fails a second time, its feedback adds
# a *recipe*: the steps, in words (never the code). Want the recipe at once? Run
# `check("0.1", shard_range, hint="recipe")`.
#
# Here is your `shard_range` drawn: one bar per rank, the number in the bar is how many items
# the rank owns.

# %%
import matplotlib.pyplot as plt


def plot_shards(ax, n, world_size):
    for rank in range(world_size):
        items = shard_range(n, rank, world_size)
        if len(items) == 0:
            ax.text(items.start, rank, "empty ", ha="right", va="center", color="gray")
            continue
        ax.barh(rank, len(items), left=items.start, color=f"C{rank}", edgecolor="black")
        ax.text(items.start + len(items) / 2, rank, str(len(items)), ha="center", va="center")
    ax.set(title=f"n={n} on {world_size} ranks", xlabel="item", ylabel="rank", xlim=(0, max(n, 1)))
    ax.set_xticks(range(n + 1))
    ax.set_yticks(range(world_size))
    ax.invert_yaxis()


fig, axes = plt.subplots(1, 3, figsize=(12, 2.8))
for ax, (n, world_size) in zip(axes, [(12, 4), (10, 4), (3, 5)]):
    plot_shards(ax, n, world_size)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 5. Task 0.2: a mean over all ranks
#
# Each rank now computes on its own slice, and the answer has to be combined. Suppose rank
# 0 holds `[1, 1, 1, 1]` and rank 1 holds `[10]`. The mean of all five numbers is
# `14 / 5 = 2.8`, but the mean of the two per-rank means is `(1 + 10) / 2 = 5.5`: averaging
# means weighs a rank holding one number like a rank holding a million. And a rank holding
# nothing has no mean at all (`torch.tensor([]).mean()` is `nan`), yet it must still take part.
#
# Implement `global_mean(local)`, called inside every rank with that rank's tensor (any
# shape, possibly empty). It returns, on every rank, the mean of all elements of all ranks,
# as a 0-d tensor like `torch.mean` returns. *Hint:* a sum and a count can be added up
# across ranks with
# [`dist.all_reduce`](https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce).

# %% tags=["task-0.2"]
def global_mean(local: torch.Tensor) -> torch.Tensor:
    """Return, on every rank, the mean of all elements held by all ranks.

    Called inside every rank; ranks may hold different numbers of elements, zero included.
    The result is a 0-d tensor of local's dtype, the same on every rank.
    """
    ### BEGIN SOLUTION
    # [sum, count] of this rank, in float64 so large counts stay exact, on local's device
    # (NCCL reduces GPU tensors only, and torch.stack refuses a mix of devices)
    total = torch.stack([local.sum(dtype=torch.float64),
                         torch.tensor(local.numel(), dtype=torch.float64, device=local.device)])
    dist.all_reduce(total)  # now [sum, count] over all ranks, on every rank
    return (total[0] / total[1]).to(local.dtype)
    ### END SOLUTION


# %% tags=["check-0.2"]
check("0.2", global_mean)

# %% [markdown]
# Side by side on 4 ranks where rank `r` holds `r + 1` copies of the number `r`: the true mean
# is `(0·1 + 1·2 + 2·3 + 3·4) / 10 = 2.0`, the mean of the per-rank means is `1.5`.

# %%
def compare_means():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local = torch.full((rank + 1,), float(rank))
    mean_of_means = local.mean()
    dist.all_reduce(mean_of_means)
    return global_mean(local).item(), (mean_of_means / world_size).item()


true_mean, mean_of_means = launch(compare_means, world_size=4)[0]
print(f"global_mean: {true_mean:.2f}   mean of per-rank means: {mean_of_means:.2f}")

# %% [markdown]
# ## 6. When a rank crashes
#
# If one rank raises, the others are left waiting in their next collective for a partner that
# will never come. `launch` notices the failed rank, stops all the others and raises a single
# `LaunchError` naming every failed rank with its traceback. Here rank 2 fails; the `try`
# keeps the notebook going so you can read the error:

# %%
def crash_on_rank_2():
    rank = dist.get_rank()
    if rank == 2:
        raise ValueError(f"rank {rank} found a corrupt batch")
    t = torch.ones(1)
    dist.all_reduce(t)  # ranks 0, 1 and 3 wait here for rank 2
    return t.item()


try:
    launch(crash_on_rank_2, world_size=4)
except LaunchError as err:
    print(f"{type(err).__name__}: {err}")

# %% [markdown]
# Read it from the top: which rank failed, what it raised, and where. Ranks 0, 1 and 3 did
# nothing wrong; they were stopped because they could not go on without rank 2.

# %% [markdown]
# ## 7. When ranks hang
#
# Worse than a crash is a rank that skips a collective: nobody fails, everybody waits. Below,
# rank 0 skips the `all_reduce` and goes on to the `barrier`, while ranks 1 and 2 wait in the
# `all_reduce` for rank 0. `timeout=5` makes `launch` give up after 5 seconds and raise
# `LaunchTimeout`, showing where each rank was waiting:

# %%
def skip_a_collective_on_rank_0():
    t = torch.ones(1)
    if dist.get_rank() != 0:
        dist.all_reduce(t)  # rank 0 never arrives here
    dist.barrier()


try:
    launch(skip_a_collective_on_rank_0, world_size=3, timeout=5)
except LaunchTimeout as err:
    print(f"{type(err).__name__}: {err}")

# %% [markdown]
# The report shows the ranks waiting in *different* collectives: the tell-tale sign of a
# collective inside an `if rank ...` branch. Outside this course nobody gives up after 5
# seconds: `torch.distributed` waits 10 minutes (NCCL) or 30 minutes (gloo) by default before
# a stuck collective fails, and a whole cluster sits idle meanwhile. Every rank must call the
# same collectives in the same order.

# %% [markdown]
# ## Running at scale
#
# > The functions you wrote run unchanged under `torchrun`, on GPUs with the NCCL backend.
# > Save this as `mean.py` and start it with `torchrun --standalone --nproc_per_node=4 mean.py`
# > (one machine), or on each of two machines with
# > `torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 mean.py`:
# >
# > ```python
# > import os
# > import torch
# > import torch.distributed as dist
# >
# > # ... shard_range and global_mean from this lesson, pasted here ...
# >
# > backend = "nccl" if torch.cuda.is_available() else "gloo"
# > dist.init_process_group(backend)  # reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
# > local_rank = int(os.environ["LOCAL_RANK"])
# > device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
# > if backend == "nccl":
# >     torch.cuda.set_device(device)  # one GPU per rank: NCCL needs the tensors on it
# >
# > rank, world_size = dist.get_rank(), dist.get_world_size()
# > items = shard_range(1_000_000, rank, world_size)
# > local = torch.arange(items.start, items.stop, dtype=torch.float64, device=device)
# > print(rank, global_mean(local).item())  # 499999.5 on every rank
# > dist.destroy_process_group()
# > ```

# %% [markdown]
# ## Summary
#
# - A world is `world_size` processes running the same code; each knows its `rank`.
# - `launch(fn, world_size=N)` and `%%distributed -n N` start ranks from a notebook with the
#   environment `torchrun` sets (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`,
#   `MASTER_ADDR`, `MASTER_PORT`) and an initialised process group.
# - Ranks split work by rank number alone (`shard_range`) and combine results with
#   collectives (`global_mean`): combine sums and counts, never means.
# - A crash on one rank stops all of them with one `LaunchError`; a collective skipped by
#   one rank hangs all of them until a timeout.
#
# **Read more:** [torch.distributed overview](https://pytorch.org/docs/stable/distributed.html),
# [collective functions](https://pytorch.org/docs/stable/distributed.html#collective-functions),
# [backends: gloo and NCCL](https://pytorch.org/docs/stable/distributed.html#backends),
# [torchrun](https://pytorch.org/docs/stable/elastic/run.html), and the tutorial
# [Writing distributed applications with PyTorch](https://pytorch.org/tutorials/intermediate/dist_tuto.html).
#
# ## Exercises (not graded)
#
# 1. Run `read_environment` with `world_size=8`. Which variables change, and which do not?
# 2. Use `shard_range` and `dist.all_reduce` to compute `0 + 1 + ... + 999` on 4 ranks, each
#    adding up only its own slice. Compare with `999 * 1000 // 2`.
# 3. Fix `skip_a_collective_on_rank_0` so that it finishes, and check the result on every rank.
# 4. What does your `global_mean` return when *every* rank is empty? What would you want it to
#    return, and why?
# 5. Write `global_max(local)` with `dist.all_reduce(..., op=dist.ReduceOp.MAX)`. What should an
#    empty rank contribute?
