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
# - start 4 ranks yourself with `torch.multiprocessing` (`spawn`, `Process`), and say why a
#   notebook function cannot be spawned and how fork and cloudpickle get around it;
# - split work across ranks ({{task 0.1}}) and combine a result from all of them
#   ({{task 0.2}}).
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
TORCHRUN_VARIABLES = [
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
]


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
# ## 4. Starting ranks by hand
#
# `launch` hides how ranks come to exist. Here is the whole story with nothing but torch. Each
# rank is a separate Python process that must
#
# 1. learn its `rank` and `world_size` (here: passed as arguments; under `torchrun`: the
#    environment variables above);
# 2. meet the others: rank 0 hosts a
#    [`TCPStore`](https://pytorch.org/docs/stable/distributed.html#torch.distributed.TCPStore),
#    a small key-value server, and every rank connects to it (the *rendezvous*; Lesson 01 looks
#    inside);
# 3. join the group with
#    [`init_process_group(store=...)`](https://pytorch.org/docs/stable/distributed.html#torch.distributed.init_process_group);
# 4. work (one `all_reduce`), send its result back, leave the group and exit.
#
# The parent starts the ranks with
# [`torch.multiprocessing.spawn`](https://pytorch.org/docs/stable/multiprocessing.html#spawning-subprocesses),
# which starts `nprocs` fresh Python interpreters, calls `rank_main(i, *args)` in the `i`-th,
# waits for all of them and raises if one failed. The cell below writes the script to a file
# in a scratch folder, and the next one runs it with `subprocess`, as you would from a terminal.
# (Why a file, and not a function in this notebook? Section 4c shows what goes wrong.)

# %%
import ast
import re
import subprocess
import sys
import tempfile
from pathlib import Path

BY_HAND = Path(tempfile.mkdtemp(prefix="by-hand-"))  # the scripts of this section go here
sys.path.insert(0, str(BY_HAND))  # so that this notebook can import them too


def run_script(*args):
    """Run `python ARGS...` in BY_HAND, as a terminal would; return what it printed."""
    done = subprocess.run([sys.executable, *map(str, args)], cwd=BY_HAND, capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        print(done.stderr[-3000:])
        raise RuntimeError(f"{' '.join(map(str, args))} exited with code {done.returncode}")
    print(done.stdout, end="")
    return done.stdout


def results_in(printed):
    """The list after "results by rank:" in a script's output."""
    return ast.literal_eval(re.search(r"results by rank: (\[.*\])", printed).group(1))


def seconds_in(printed):
    """The seconds in "... joined in 1.23 s" in a script's output."""
    return float(re.search(r"joined in ([0-9.]+) s", printed).group(1))


# %%
# %%writefile {BY_HAND}/spawn_by_hand.py
"""Four ranks started by hand with torch.multiprocessing.spawn.

Run: python spawn_by_hand.py [world_size]
"""
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def work():
    """What every rank computes once it is in the group: the sum of (rank + 1)^2 over all ranks."""
    t = torch.tensor([float(dist.get_rank() + 1) ** 2])
    dist.all_reduce(t)  # 1 + 4 + 9 + 16 = 30 on 4 ranks, on every rank
    return t.item()


def rank_main(rank, world_size, port, results):
    """One rank's whole life: meet the others, join the group, work, leave."""
    torch.set_num_threads(1)  # the ranks share the cores: one thread each, as torchrun sets it
    # rendezvous: rank 0 hosts the store on the port, the others connect to it
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=(rank == 0),
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    results.put((rank, work()))  # a process has its own memory: a queue carries the result out
    dist.destroy_process_group()


def free_port():
    """A port nobody listens on now (the OS picks it).

    Another program could take it before rank 0 does.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":  # each spawned rank imports this file again: only the parent runs this
    world_size = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    start = time.perf_counter()
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(rank_main, args=(world_size, free_port(), results), nprocs=world_size)  # waits for all
    values = dict(results.get() for _ in range(world_size))
    print("results by rank:", [values[rank] for rank in range(world_size)])
    print(f"mp.spawn: {world_size} ranks started, done and joined in "
          f"{time.perf_counter() - start:.2f} s")

# %%
by_spawn = run_script("spawn_by_hand.py")

# %% [markdown]
# Look at the script's last block first, `if __name__ == "__main__":`. A spawned rank is a
# new interpreter that knows nothing of its parent; to find `rank_main` it *imports the script
# again*, under another name. Without that guard each of the 4 ranks would run the parent's
# code too and try to spawn 4 ranks of its own (Python stops it with a `RuntimeError`).
#
# Now the same rank code imported into this notebook and run by `launch`: `work` is the function
# both ran once their group existed, and the results agree.

# %%
import spawn_by_hand

by_launch = launch(spawn_by_hand.work, world_size=4)
print("kit.launch:", list(by_launch), "  same as by hand:", list(by_launch) == results_in(by_spawn))

# %% [markdown]
# ### 4b. The same with `Process` and `join`
#
# `mp.spawn` is a convenience. Underneath are
# [`Process`](https://docs.python.org/3/library/multiprocessing.html#multiprocessing.Process)
# objects: create one per rank, `start()` them all, then `join()` each one (wait until it
# exits). `get_context` chooses how a process starts: `"spawn"` starts a fresh interpreter,
# `"fork"` (Linux, macOS) copies the parent as it is, with everything it has imported.

# %%
# %%writefile {BY_HAND}/process_by_hand.py
"""The same ranks with torch.multiprocessing.Process and join.

Run: python process_by_hand.py [spawn|fork]
"""
import sys
import time

import torch.multiprocessing as mp
from spawn_by_hand import free_port, rank_main  # the same rank code as before

if __name__ == "__main__":
    method = sys.argv[1] if len(sys.argv) > 1 else "spawn"
    world_size = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    ctx = mp.get_context(method)  # "spawn": fresh interpreters; "fork": copies of this process
    start = time.perf_counter()
    results, port = ctx.SimpleQueue(), free_port()
    ranks = [ctx.Process(target=rank_main, args=(rank, world_size, port, results))
             for rank in range(world_size)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join()  # wait for this rank to exit (a rank stuck in a collective: forever)
    if any(p.exitcode != 0 for p in ranks):
        sys.exit(f"ranks exited with codes {[p.exitcode for p in ranks]}")
    values = dict(results.get() for _ in range(world_size))
    print("results by rank:", [values[rank] for rank in range(world_size)])
    print(f"Process ({method}): {world_size} ranks started, done and joined in "
          f"{time.perf_counter() - start:.2f} s")

# %%
by_fork = run_script("process_by_hand.py", "fork")

# %% [markdown]
# Forked ranks start in a fraction of the time: they are copies of a parent that has already
# imported torch, where each spawned rank imports it again. Note what `join` does *not* do: it
# never gives up. A rank that crashes closes its connections, and gloo fails its peers'
# `all_reduce` ("Connection closed by peer"), so all exit; but a rank that hangs without
# crashing leaves the others waiting in their collective, and `join` waiting for them,
# for as long as the collective's timeout (30 minutes on gloo). `launch` watches every rank,
# stops them all at the first failure or at its own timeout, and says which rank did what
# (sections 7 and 8).

# %% [markdown]
# ### 4c. Why not spawn a function defined in this notebook?
#
# To start a rank under spawn, the parent *pickles* the function to run, and pickle stores a
# function by reference: its module and its name, here `__main__.notebook_rank`. The new
# interpreter then looks that name up. A script can be imported again (that is what the
# `__main__` guard was for), but this notebook's `__main__` lives only in this kernel: the child
# has nothing to import, and fails before running a single line of ours. The cell below catches
# the failure, and what the child wrote to its error output (file descriptor 2, kept in a file):

# %%
import os
import pickle

import torch.multiprocessing as mp


def notebook_rank(rank):
    print(f"rank {rank} started")  # never printed: the child cannot find this function


print("what pickle sends for it:", pickle.dumps(notebook_rank))
with tempfile.TemporaryFile() as child_stderr:
    saved = os.dup(2)
    os.dup2(child_stderr.fileno(), 2)  # a child inherits file descriptor 2: send it to the file
    try:
        mp.spawn(notebook_rank, nprocs=1)
    except mp.ProcessExitedException as err:
        print(f"{type(err).__name__}: {err}")
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    child_stderr.seek(0)
    print("the child said:", child_stderr.read().decode().strip().splitlines()[-1])

# %% [markdown]
# `launch` avoids this in two ways. On Linux it **forks** by default: a forked rank is a copy of
# the kernel, your function is already in its memory, and nothing has to be pickled. Where fork
# is not safe (macOS and Windows; `backend="nccl"`, whose ranks must initialise CUDA themselves;
# or after this kernel has used CUDA, whose state a forked child cannot use) it **spawns**, but
# sends the function with
# [`cloudpickle`](https://github.com/cloudpipe/cloudpickle), which pickles functions of
# `__main__` *by value*: their code, and the globals they use. That is longer than pickle's
# name, and it works:

# %%
import cloudpickle


def square_and_sum():
    """work() again, defined in this notebook this time."""
    t = torch.tensor([float(dist.get_rank() + 1) ** 2])
    dist.all_reduce(t)
    return t.item()


print(f"pickle: {len(pickle.dumps(square_and_sum))} bytes (a name), "
      f"cloudpickle: {len(cloudpickle.dumps(square_and_sum))} bytes (the code)")
launch_spawn = launch(square_and_sum, world_size=4, start_method="spawn")
print(f"kit.launch, spawn: {list(launch_spawn)}")

# %% [markdown]
# ### 4d. Three launchers side by side
#
# How long does each way take to start 4 ranks, run one all-reduce and wait for them, on *your*
# machine? The by-hand numbers come from the runs above; `launch` is timed on the same work
# (best of 3 for fork).

# %%
import matplotlib.pyplot as plt

launch_fork = min((launch(square_and_sum, world_size=4) for _ in range(3)),
                  key=lambda r: r.wall_time)
seconds = {
    "mp.spawn (by hand)": seconds_in(by_spawn),
    "Process + fork (by hand)": seconds_in(by_fork),
    "kit.launch (fork)": launch_fork.wall_time,
    "kit.launch (spawn + cloudpickle)": launch_spawn.wall_time,
}
print("same result everywhere:",
      results_in(by_spawn) == results_in(by_fork) == list(launch_fork) == list(launch_spawn))
for name, s in seconds.items():
    print(f"{name:34s} {s:6.2f} s")

fig, ax = plt.subplots(figsize=(7, 2.4))
ax.barh(list(seconds), list(seconds.values()), color=["C0", "C1", "C2", "C3"])
ax.set(xlabel="seconds to start 4 ranks, all-reduce once and join", xscale="log")
ax.invert_yaxis()
fig.tight_layout()
plt.show()

# %% [markdown]
# Spawned ranks pay for a fresh interpreter and `import torch`, once per rank and once per
# launch: seconds, more when the ranks outnumber your cores. Forked ranks pay for copying a
# process: tenths of a second at most. Compare `launch` on fork with the bare fork script:
# capturing each rank's output and watching for crashes and hangs adds little to the cost of
# forking. On a cluster the start-up cost is paid once per job and hardly matters; in a notebook
# you launch dozens of times, which is why `launch` forks whenever it is safe. From here on,
# `launch` starts the ranks for you.


# %% [markdown]
# ## 5. Task 0.1: give every rank its share
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
# ## 6. Task 0.2: a mean over all ranks
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
# ## 7. When a rank crashes
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
# ## 8. When ranks hang
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
#
# One hang `launch` does not wait out: when a rank has already *returned* and every other rank
# sits in the same collective, using no CPU, nobody can ever complete that collective. `launch`
# checks for this from half a second after the first rank returns and raises `LaunchTimeout`
# at once, its message starting "Deadlock after ... s", with the same report.

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
# - By hand, each rank meets the others at a `TCPStore` hosted by rank 0 and joins with
#   `init_process_group(store=...)`; `mp.spawn` or `Process` + `join` starts the ranks. Spawned
#   ranks re-import your script (hence `if __name__ == "__main__":`) and find functions by
#   name, so a notebook function cannot be spawned; `launch` forks, or sends it with cloudpickle.
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
# 6. Run `run_script("process_by_hand.py", "spawn")` and `run_script("spawn_by_hand.py", 8)`.
#    How does the start-up time grow with the number of spawned ranks on your machine?
# 7. In `spawn_by_hand.py`'s `rank_main`, make rank 2 raise before `work()` and run
#    `process_by_hand.py fork`: what do the other ranks report? Then make rank 2
#    `time.sleep(600)` instead, give `join` a timeout and stop the stuck ranks with `p.kill()`:
#    you have begun to write `launch`.
