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
# So far `launch` started your ranks inside the notebook. On a cluster the launcher is
# [`torchrun`](https://pytorch.org/docs/stable/elastic/run.html): one *agent* per machine
# starts one worker process per GPU, restarts them when one dies, and lets agents on
# different machines find each other. This lesson runs real `torchrun` from cells, kills a
# worker mid-training and watches the run resume, plays two machines on one laptop, and
# takes apart the failures that cost real teams days: hangs and mismatched collectives.
#
# **Prerequisites:** Lessons 00 and 01 (ranks, `launch`, collectives, process groups);
# `torch.save`/`torch.load` and a basic training loop.
#
# **You will be able to:**
# - say what `torchrun` and its elastic agent do, and which environment variables every
#   worker receives (`RANK`, `LOCAL_RANK`, `GROUP_RANK`, `TORCHELASTIC_RESTART_COUNT`...);
# - read that environment safely ({{task 2.1}});
# - write a training loop that survives a worker crash and resumes *exactly* ({{task 2.2}});
# - run two "nodes" with one rendezvous endpoint, and launch on SLURM with `srun torchrun`;
# - debug a hang: timeouts, `monitored_barrier`, `TORCH_DISTRIBUTED_DEBUG=DETAIL`, error files
#   and the NCCL variables that matter, and find the first mismatched collective
#   ({{task 2.3}}).
#
# Replace each `raise NotImplementedError(...)` with your code, run the cell, then the
# `check(...)` cell under it. Each real `torchrun` takes a few seconds to start.

# %% tags=["setup"]
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from kit import LaunchError, LaunchTimeout, check, launch
from kit.lessons.debugging import record_collectives
from kit.torchrun import (
    TorchrunError,
    init_process_group_per_attempt,
    torchrun,
    torchrun_nodes,
    write_script,
)


@dataclass
class DistInfo:
    """Where this process sits in the world, as torchrun describes it."""

    rank: int  # global rank, 0 .. world_size - 1
    local_rank: int  # rank on this node: which GPU to use
    world_size: int
    local_world_size: int  # processes on this node
    node_rank: int  # torchrun's GROUP_RANK
    master_addr: str
    master_port: int
    is_distributed: bool  # launched by torchrun or kit.launch (WORLD_SIZE is set)


@dataclass
class Mismatch:
    """Where ranks first disagree on the collectives they call."""

    index: int  # the call number, counted from 0 on every rank
    ranks: list[int]  # the ranks whose call differs from the most common one, sorted
    calls: dict[int, tuple[str, tuple[int, ...]] | None]  # every rank's call there (None: no call)


# The training run of Task 2.2: a small model, a fixed batch per step, SGD with momentum.
GLOBAL_BATCH = 8
MICROBATCHES = 2  # one per rank on 2 ranks; both accumulated in one process


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights in every process
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batch_at(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of training step `step`: inputs (8, 4) and targets (8, 1)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 4, generator=g)
    return x, x.sin().sum(dim=1, keepdim=True)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    """One optimizer step on batch `step`, data parallel when a process group is up.

    One process accumulates the gradients of both micro-batches; two ranks take one each and
    all-reduce. Either way every gradient is g0 + g1, so both runs agree bit for bit.
    """
    x, y = batch_at(step)
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if MICROBATCHES % world_size:
        raise ValueError(f"train_step runs on 1 or 2 ranks, not {world_size}")
    optimizer.zero_grad()
    loss = torch.zeros(())
    for micro in range(rank, MICROBATCHES, world_size):
        xb, yb = x.chunk(MICROBATCHES)[micro], y.chunk(MICROBATCHES)[micro]  # (4, 4), (4, 1)
        loss = ((model(xb) - yb) ** 2).sum() / GLOBAL_BATCH
        loss.backward()  # adds into .grad
    if world_size > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad)
    optimizer.step()
    return loss.item()


# %%
# %load_ext kit

# %% [markdown]
# ## 1. The launch model
#
# `torchrun` does not run your training code itself. It starts an **agent** on each machine
# (a *node*); the agents meet at a **rendezvous**, agree on how many nodes take part and
# which is which, and then each agent starts `--nproc-per-node` **workers**: one process per
# GPU, each running your script from the top with its place in the world in environment
# variables. The agent then watches its workers. If one dies, it stops the others and, while
# restarts are left (`--max-restarts`), runs a new rendezvous and starts them all again.

# %%
import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch


def draw_launch_model(ax):
    def box(x, y, w, h, text, colour):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=colour, ec="black"))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=9)

    box(3.6, 4.2, 2.8, 0.8, "rendezvous (c10d store)\nHOST:29500", "#fff3c4")
    for node, x0 in enumerate([0.3, 5.3]):
        ax.add_patch(FancyBboxPatch((x0, 0.2), 4.4, 3.3, boxstyle="round,pad=0.05", fc="#f4f4f4",
                                    ec="gray", ls="--"))
        ax.text(x0 + 0.1, 3.25, f"node {node}  (--node-rank={node})", fontsize=9, color="gray")
        box(x0 + 1.2, 2.2, 2.0, 0.7, "elastic agent\n(torchrun)", "#d6e6ff")
        ax.annotate("", xy=(5.0, 4.2), xytext=(x0 + 2.2, 2.9), arrowprops={"arrowstyle": "<->"})
        for local in range(2):
            rank = node * 2 + local
            wx = x0 + 0.3 + 2.1 * local
            box(wx, 0.5, 1.8, 0.9, f"worker\nRANK={rank} LOCAL_RANK={local}", f"C{rank}")
            ax.annotate("", xy=(wx + 0.9, 1.4), xytext=(x0 + 2.2, 2.2),
                        arrowprops={"arrowstyle": "->"})
    ax.set(xlim=(0, 10), ylim=(0, 5.2),
           title="torchrun --nnodes=2 --nproc-per-node=2: 2 agents, 4 workers")
    ax.axis("off")


fig, ax = plt.subplots(figsize=(10, 4.2))
draw_launch_model(ax)
plt.show()

# %% [markdown]
# The flags you will use:
#
# - `--standalone`: one node: torchrun starts its own rendezvous on a free local port
# - `--nproc-per-node=N`: workers on this node (one per GPU; `gpu` means all of them)
# - `--nnodes=2` (or `1:4` elastic): how many nodes must join before training starts
# - `--rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --rdzv-id=JOB`: where the agents meet: a
#   TCP store on `HOST`, the same on every node
# - `--node-rank=K`: only for the *static* rendezvous (`--master-addr`); with c10d each node's
#   `GROUP_RANK` is its place in the sorted list of participants (host name, then the agent's
#   process id), whatever `K` says and whoever came first
# - `--max-restarts=R`: restart all workers up to R times after a failure
#
# Every worker receives `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`
# (the node's rank), `MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_RESTART_COUNT` (0 on the
# first attempt), `TORCHELASTIC_MAX_RESTARTS` and `TORCHELASTIC_RUN_ID`. The old launcher,
# `python -m torch.distributed.launch`, passed `--local-rank=N` as a *command-line argument*
# instead; scripts written for it break under torchrun unless they read `LOCAL_RANK` from the
# environment. Read the environment.

# %% [markdown]
# ## 2. Task 2.1: read the environment, safely
#
# Every training script starts by finding out where it runs, and a wrong answer here is
# silent and expensive: two ranks that both believe they are rank 0 overwrite each other's
# checkpoints. Implement `dist_info_from_env(env=None) -> DistInfo` (the dataclass is in the
# setup cell) reading `env` (default: `os.environ`):
#
# - unset variables take single-process defaults: `WORLD_SIZE` 1, `RANK` 0,
#   `LOCAL_WORLD_SIZE` = world size (one node), `LOCAL_RANK` = `rank % local_world_size`,
#   `GROUP_RANK` (the `node_rank`) = `rank // local_world_size`, `MASTER_ADDR` `"127.0.0.1"`,
#   `MASTER_PORT` 29500; `is_distributed` is whether `WORLD_SIZE` is set at all;
# - raise `ValueError` naming the variable when a value is not an integer, is negative,
#   `WORLD_SIZE` or `LOCAL_WORLD_SIZE` is below 1, or the port is outside 1-65535;
# - raise `ValueError` when the values contradict each other: `rank >= world_size`,
#   `local_rank >= local_world_size`, `local_world_size` not dividing `world_size`, or
#   `rank != node_rank * local_world_size + local_rank`.

# %% tags=["task-2.1"]
def dist_info_from_env(env: Mapping[str, str] | None = None) -> DistInfo:
    """Read torchrun's variables from env (default os.environ) into a validated DistInfo.

    Unset variables take single-process defaults; malformed or inconsistent values raise a
    ValueError that names the variable and the rule it breaks.
    """
    ### BEGIN SOLUTION
    env = os.environ if env is None else env

    def number(name: str, default: int, low: int = 0) -> int:
        if name not in env:
            return default
        try:
            value = int(env[name])
        except ValueError:
            raise ValueError(f"{name}={env[name]!r} is not an integer") from None
        if value < low:
            raise ValueError(f"{name}={value} must be >= {low}")
        return value

    world_size = number("WORLD_SIZE", 1, low=1)
    rank = number("RANK", 0)
    local_world_size = number("LOCAL_WORLD_SIZE", world_size, low=1)
    local_rank = number("LOCAL_RANK", rank % local_world_size)
    node_rank = number("GROUP_RANK", rank // local_world_size)
    master_port = number("MASTER_PORT", 29500, low=1)
    if master_port > 65535:
        raise ValueError(f"MASTER_PORT={master_port} is not a TCP port (1-65535)")
    if rank >= world_size:
        raise ValueError(f"RANK={rank} must be < WORLD_SIZE={world_size}")
    if local_rank >= local_world_size:
        raise ValueError(f"LOCAL_RANK={local_rank} must be < LOCAL_WORLD_SIZE={local_world_size}")
    if world_size % local_world_size:
        raise ValueError(f"LOCAL_WORLD_SIZE={local_world_size} does not divide "
                         f"WORLD_SIZE={world_size}")
    if rank != node_rank * local_world_size + local_rank:
        raise ValueError(f"RANK={rank} != GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK "
                         f"({node_rank} * {local_world_size} + {local_rank})")
    return DistInfo(rank, local_rank, world_size, local_world_size, node_rank,
                    env.get("MASTER_ADDR", "127.0.0.1"), master_port, "WORLD_SIZE" in env)
    ### END SOLUTION


# %% tags=["check-2.1"]
check("2.1", dist_info_from_env)

# %% [markdown]
# ## 3. From notebook to script: real torchrun
#
# `write_script(path, *parts)` writes a script from strings and from functions defined in
# this notebook; `torchrun(script, nproc_per_node=2)` runs `python -m torch.distributed.run
# --standalone --nproc-per-node=2 script` with this kernel's Python and prints every line the
# agent and its workers write. Here each worker reports what your `dist_info_from_env` sees:

# %%
WORK = Path(tempfile.mkdtemp(prefix="lesson02-"))

HEADER = """
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

GLOBAL_BATCH = 8
MICROBATCHES = 2
"""

where_am_i = write_script(WORK / "where_am_i.py", HEADER, DistInfo, dist_info_from_env, """
    info = dist_info_from_env()
    dist.init_process_group("gloo")  # reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    print(f"rank {info.rank}/{info.world_size}: local_rank={info.local_rank} node={info.node_rank} "
          f"restart={os.environ['TORCHELASTIC_RESTART_COUNT']} "
          f"master={info.master_addr}:{info.master_port}")
    # init_process_group waits for no one (torch skips its init barrier unless
    # TORCH_DIST_INIT_BARRIER=1): a rank that left now could close its connections while a
    # slower peer still completes its handshake ("Connection closed by peer"). Leave together.
    dist.barrier()
    dist.destroy_process_group()
""")
result = torchrun(where_am_i, nproc_per_node=2)
print(f"torchrun finished in {result.wall_time:.1f} s")

# %% [markdown]
# The banner about `OMP_NUM_THREADS` is torchrun's: with several workers per node it limits
# each to one CPU thread so they do not fight over cores. On a real node you would start one
# worker per GPU and set it to the cores per GPU.

# %% [markdown]
# ## 4. Task 2.2: a training loop that survives a crash
#
# Long runs lose workers: a node reboots, a GPU throws an ECC error, the job is preempted.
# With `--max-restarts=R` the agent notices the dead worker, stops the others, and starts all
# of them again, up to R times. Your script starts **from the top** again, so it must find
# where it was. That is the checkpoint's job, and "resumed" must mean the same final weights
# an uninterrupted run would have reached: not roughly, exactly.
#
# Implement `resumable_train(ckpt_dir, total_steps)` with the setup cell's `make_model`,
# `make_optimizer` and `train_step(model, optimizer, step)`:
#
# - if `ckpt_dir` holds a checkpoint, restore the model, the optimizer (momentum is state
#   too) and the step to continue from;
# - run `train_step(model, optimizer, step)` for each remaining `step` up to `total_steps`,
#   passing the real step number (it selects the batch: counting from 0 again would replay
#   the data from the start);
# - after each step, save the model, the optimizer and the next step number, on rank 0 only,
#   atomically (write a temporary file, then `os.replace` it, so a crash mid-save never
#   leaves half a checkpoint), then `dist.barrier()` when distributed, so no rank runs ahead
#   of the last saved checkpoint;
# - return the final `model.state_dict()`.
#
# Load with `map_location="cpu"`: [`torch.load`](https://pytorch.org/docs/stable/generated/torch.load.html)
# puts every tensor back on the device it was saved from, so on GPUs a checkpoint rank 0 saved
# from `cuda:0` would land on `cuda:0` in every rank (memory there for all of them, and a
# device mismatch later); `load_state_dict` copies the values onto the model's own device.
#
# The check runs your function in this process, then under real `torchrun --max-restarts=1`
# on 2 ranks with rank 1 killed (`SIGKILL`, no chance to clean up) at step 3 of the first
# attempt, and compares the final weights with an uninterrupted run, bit for bit.

# %% tags=["task-2.2"]
def resumable_train(ckpt_dir: str, total_steps: int) -> dict[str, torch.Tensor]:
    """Train make_model() with train_step for total_steps steps, resuming from ckpt_dir exactly.

    If ckpt_dir holds a checkpoint, continue from it, so that the final state_dict equals that
    of an uninterrupted run bit for bit.
    """
    ### BEGIN SOLUTION
    model = make_model()
    optimizer = make_optimizer(model)
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    path = os.path.join(ckpt_dir, "checkpoint.pt")
    start = 0
    if os.path.exists(path):
        # map_location="cpu": torch.load puts each tensor back on the device it was saved
        # from, so on GPUs every rank would load rank 0's cuda:0 tensors onto cuda:0.
        # load_state_dict then copies the values onto wherever the model lives.
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]  # the first step not yet done
        print(f"rank {rank}: resuming at step {start}")
    for step in range(start, total_steps):
        train_step(model, optimizer, step)
        if rank == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "step": step + 1}
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)  # atomic: the old or the new checkpoint, never half
        if distributed:
            dist.barrier()  # nobody starts step + 1 before the checkpoint of step is on disk
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
    ### END SOLUTION


# %% tags=["check-2.2"]
check("2.2", resumable_train)

# %% [markdown]
# Now watch it yourself. The script below runs your `resumable_train`; on the first attempt
# rank 1 kills itself at step 3. Read the agent's log lines: the worker failure, the
# restart, and rank 0 resuming. At the end the weights are compared with a run in this
# notebook that was never interrupted.

# %%
TRAIN_MAIN = """
@record  # a worker that raises writes its traceback to an error file the agent reports
def main():
    info = dist_info_from_env()
    if info.is_distributed:
        init_process_group_per_attempt("gloo")  # see the note below
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    crash_at = int(os.environ.get("CRASH_AT_STEP", "-1"))
    if attempt == 0 and info.rank == 1 and crash_at >= 0:
        global train_step
        healthy_step = train_step

        def train_step(model, optimizer, step):  # rank 1 dies at crash_at on the first attempt
            if step == crash_at:
                print(f"rank 1: killed at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return healthy_step(model, optimizer, step)

    params = resumable_train(sys.argv[1], int(sys.argv[2]))
    if info.rank == 0:
        torch.save(params, os.path.join(sys.argv[1], "final.pt"))
    if info.is_distributed:
        # leave together: no rank tears its connections down while a peer still works
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""

train_script = write_script(WORK / "train.py", HEADER, DistInfo, dist_info_from_env, make_model,
                            make_optimizer, batch_at, train_step, resumable_train,
                            init_process_group_per_attempt, TRAIN_MAIN)
ckpt_dir = WORK / "run-with-crash"
ckpt_dir.mkdir()
torchrun(train_script, ckpt_dir, 6, nproc_per_node=2, max_restarts=1, env={"CRASH_AT_STEP": "3"})

(WORK / "uninterrupted").mkdir()
reference = resumable_train(str(WORK / "uninterrupted"), 6)  # the same 6 steps, never interrupted
resumed = torch.load(ckpt_dir / "final.pt", weights_only=True)
print("identical to the uninterrupted run:",
      all(torch.equal(resumed[k], reference[k]) for k in reference))

# %% [markdown]
# A note on `init_process_group_per_attempt` (from `kit.torchrun`, copied into the script):
# the restarted workers reuse the agent's key-value store, which still holds the first
# attempt's addresses, and with torch 2.13 a new worker can read a dead peer's address and
# fail to connect (`Gloo connectFullMesh failed ... Connection refused`) about half the time
# here. The helper calls `init_process_group` with the store's keys namespaced by
# `TORCHELASTIC_RESTART_COUNT`, so each attempt only sees its own.
#
# What made "exactly" possible: the checkpoint held *everything* the next step depends on
# (weights, momentum buffers, the step that picks the batch), the data for a step depends
# only on the step, and the two ranks add the same two gradients in any order. A real
# loader adds its own state (the epoch for `set_epoch`, the position in it), dropout adds
# the random generators (`torch.get_rng_state()`); forget one and the resumed run silently
# drifts. For large models, [torch.distributed.checkpoint](https://pytorch.org/docs/stable/distributed.checkpoint.html)
# saves sharded state from every rank in parallel.

# %% [markdown]
# ## 5. Two nodes on one machine
#
# A multi-node job is the same command on every node with the same rendezvous endpoint.
# `torchrun_nodes(script, nnodes=2, nproc_per_node=1)` starts two agents here, each with its
# own `--node-rank`, meeting at `--rdzv-endpoint=127.0.0.1:PORT` on a free port. Each line is
# labelled with the node that printed it. `GLOO_SOCKET_IFNAME=lo` tells gloo which network
# interface to use, as `NCCL_SOCKET_IFNAME` does for NCCL on a cluster with several.

# %%
two_nodes_dir = WORK / "two-nodes"
two_nodes_dir.mkdir()
torchrun_nodes(train_script, two_nodes_dir, 6, nnodes=2, nproc_per_node=1,
               env={"GLOO_SOCKET_IFNAME": "lo"})
on_two_nodes = torch.load(two_nodes_dir / "final.pt", weights_only=True)
print("two nodes == one process:",
      all(torch.equal(on_two_nodes[k], reference[k]) for k in reference))

# %% [markdown]
# Note the warning that `node_rank` is ignored: with the c10d rendezvous, once enough agents
# have joined, torch sorts the participants (each described by host name, agent process id and
# a counter) and gives each its place in that order as `GROUP_RANK`
# (`torch/distributed/elastic/rendezvous/dynamic_rendezvous.py`: `sorted(state.participants)`).
# Neither `--node-rank` nor the order of arrival decides it, so derive nothing from either.
#
# On SLURM the same thing is one `sbatch` file, kept in this course as `slurm/train.sbatch`
# (`sbatch slurm/train.sbatch train.py /shared/ckpt 1000`): `srun` starts one task per node,
# and each task runs one torchrun agent with the first node of the allocation as the
# rendezvous endpoint. Its heart:
#
# ```bash
# #SBATCH --nodes=2
# #SBATCH --ntasks-per-node=1          # one torchrun agent per node; it starts the workers
# #SBATCH --gpus-per-node=4
# #SBATCH --requeue                    # a preempted job comes back and resumes from its checkpoint
#
# head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# srun --kill-on-bad-exit=1 torchrun \
#     --nnodes="$SLURM_NNODES" \
#     --nproc-per-node="$gpus_per_node" \
#     --max-restarts=3 \
#     --rdzv-backend=c10d \
#     --rdzv-endpoint="$head_node:$rdzv_port" \
#     --rdzv-id="$SLURM_JOB_ID" \
#     "$@"
# ```

# %% [markdown]
# ## 6. Debugging: when ranks hang or disagree
#
# **Timeouts.** A collective waits for every rank of its group. The process group's
# `timeout` (`init_process_group(..., timeout=timedelta(minutes=10))`, the default for gloo is
# 30 minutes) bounds the wait; then the collective raises instead of hanging forever. A
# short timeout on a group makes a skipped collective fail in seconds:

# %%
def skip_with_short_timeout():
    group = dist.new_group(timeout=timedelta(seconds=2))  # a short-fused copy of the world
    t = torch.ones(1)
    if dist.get_rank() != 0:
        dist.all_reduce(t, group=group)  # rank 0 never comes: fails after 2 s
    time.sleep(4)


try:
    launch(skip_with_short_timeout, world_size=2, timeout=20)
except LaunchError as err:
    print(f"{type(err).__name__}: {err}"[:900])

# %% [markdown]
# **`monitored_barrier`** (gloo) is a barrier that names the ranks that did not arrive,
# where a plain barrier just waits: rank 0 collects everybody's arrival and reports the
# missing. Put one after a suspicious phase while debugging:

# %%
def one_slow_rank():
    if dist.get_rank() == 2:
        time.sleep(5)  # stuck somewhere: a slow filesystem, an infinite loop...
    dist.monitored_barrier(timeout=timedelta(seconds=2))


try:
    launch(one_slow_rank, world_size=3, timeout=20)
except LaunchError as err:
    print(next(f.summary for f in err.failures if f.rank == 0))  # rank 0 runs the check

# %% [markdown]
# **Mismatched collectives.** Worse than a hang is a collective that "works" with the wrong
# inputs. Plain gloo does not compare sizes across ranks: what happens depends on the sizes
# and the collective. Below, on 2 ranks, a broadcast of 3 numbers from rank 0 into rank 1's 4
# returns on both ranks with no error, rank 1 keeping a stale last value; an all-reduce of 4
# numbers against 3 returns garbage on rank 1 while rank 0 waits forever; and an all-reduce
# of 8 numbers against 7 aborts a rank (SIGABRT) inside gloo.

# %%
def mismatched(collective, sizes):
    rank = dist.get_rank()
    t = torch.arange(1.0, sizes[rank] + 1) * (rank + 1)  # rank 0: 1, 2, 3..., rank 1: 2, 4, 6...
    if collective == "broadcast":
        dist.broadcast(t, src=0)
    else:
        dist.all_reduce(t)
    print(f"{collective} {sizes}: returned {t.tolist()}")


for collective, sizes in [("broadcast", (3, 4)), ("all_reduce", (4, 3)), ("all_reduce", (8, 7))]:
    try:
        launch(mismatched, collective, sizes, world_size=2, timeout=5)
        print("  -> no error on any rank")
    except LaunchTimeout:
        print("  -> hung: a rank never returned")
    except LaunchError as err:
        cause = next(f for f in err.failures if not f.consequence)
        print(f"  -> rank {cause.rank} {cause.summary}")

# %% [markdown]
# With `TORCH_DISTRIBUTED_DEBUG=DETAIL` in the ranks'
# environment (it must be set *before* the process group is created), torch checks each
# collective's name, shapes and dtypes across ranks first and raises on the first mismatch.
# The script's `main` is wrapped in
# [`@record`](https://pytorch.org/docs/stable/elastic/errors.html), so each failed worker
# writes its traceback to an error file and the agent's `ChildFailedError` summary shows it.

# %%
mismatch_script = write_script(WORK / "mismatch.py", HEADER, """
    @record
    def main():
        dist.init_process_group("gloo")
        t = torch.ones(4 if dist.get_rank() == 0 else 3)  # the bug: shapes differ by rank
        dist.all_reduce(t)
        dist.destroy_process_group()


    if __name__ == "__main__":
        main()
""")
try:
    torchrun(mismatch_script, nproc_per_node=2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
             echo=False)
except TorchrunError as err:
    print(err.summary)

# %% [markdown]
# Read the summary from the bottom: *Root Cause* is the first worker that failed, with its
# rank, exit code and (thanks to `@record`) traceback; *Failures* lists the others. An exit
# code of `-9` means SIGKILL (often the kernel's out-of-memory killer), `-6` SIGABRT (often
# NCCL's watchdog tearing down a hung job).
#
# `DETAIL` costs an extra check per collective: use it to find a bug, not in production.
# To find one without it, record what each rank calls. `record_collectives(fn, world_size)`
# runs `fn` with the collectives replaced by recorders that note `(name, shape)` and return
# at once, so even code that would hang finishes:

# %%
def uneven_loop(num_batches=(3, 3, 2, 3)):
    rank = dist.get_rank()
    dist.broadcast(torch.zeros(10), src=0)  # the initial weights
    for _ in range(num_batches[rank]):  # rank 2 has one batch fewer: a classic uneven split
        dist.all_reduce(torch.zeros(10))
    dist.all_reduce(torch.zeros(1))  # the loss, for logging


calls = record_collectives(uneven_loop, world_size=4)
for rank, seq in calls.items():
    print(rank, seq)

# %% [markdown]
# ## 7. Task 2.3: find the first mismatch
#
# Implement `first_mismatch(calls)`: given each rank's sequence of `(collective, shape)`
# return `None` when all ranks call the same sequence, else a `Mismatch` (setup cell) with
#
# - `index`: the first call number where the ranks disagree; a rank whose sequence ended
#   before it has no call there (`None`), which is a disagreement too;
# - `calls`: every rank's call at that index (`None` for no call);
# - `ranks`: the ranks whose call differs from the most common one, sorted. When two calls
#   are equally common, the call of the lowest-numbered rank among them counts as the
#   common one.
#
# In the recording above, call 3 is the mismatch: ranks 0, 1 and 3 all-reduce 10 numbers,
# rank 2 all-reduces 1 (its loss) and so would add the wrong tensors together.

# %% tags=["task-2.3"]
def first_mismatch(calls: dict[int, list[tuple[str, tuple[int, ...]]]]) -> Mismatch | None:
    """Return where the ranks' (collective, shape) sequences first differ, or None if they agree.

    The Mismatch holds the call index, the odd ranks and every rank's call there (None: no call).
    """
    ### BEGIN SOLUTION
    ranks = sorted(calls)
    longest = max((len(seq) for seq in calls.values()), default=0)
    for index in range(longest):
        at = {r: (tuple(calls[r][index]) if index < len(calls[r]) else None) for r in ranks}
        at = {r: (c if c is None else (c[0], tuple(c[1]))) for r, c in at.items()}
        if len(set(at.values())) == 1:
            continue
        counts = Counter(at.values())
        top = max(counts.values())
        common = next(at[r] for r in ranks if counts[at[r]] == top)  # ties: the lowest rank's
        return Mismatch(index, [r for r in ranks if at[r] != common], at)
    return None
    ### END SOLUTION


# %% tags=["check-2.3"]
check("2.3", first_mismatch)

# %%
first_mismatch(calls)

# %% [markdown]
# **The kit's hang report.** When a `launch` times out, the kit dumps every rank's Python
# stack and says which collective each one waits in. Here two ranks call the same two
# collectives in opposite orders, a deadlock no single rank's log reveals:

# %%
from kit import LaunchTimeout


def opposite_orders():
    t = torch.ones(1)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
        dist.barrier()
    else:
        dist.barrier()
        dist.all_reduce(t)


try:
    launch(opposite_orders, world_size=2, timeout=5)
except LaunchTimeout as err:
    print("\n".join(str(err).splitlines()[:5]))

# %% [markdown]
# On a cluster, `py-spy dump --pid PID` on each worker gives the same picture, and for NCCL
# the *flight recorder* keeps the last collectives of every rank in a ring buffer and dumps
# them when the watchdog fires.
#
# The environment variables that matter when a job misbehaves, each with its gloo / CPU
# counterpart shown here:
#
# - `NCCL_DEBUG=INFO` (`WARN`): NCCL logs its setup: rings, transports, versions.
#   Gloo: `TORCH_CPP_LOG_LEVEL=INFO`.
# - `NCCL_DEBUG_SUBSYS=INIT,NET`: limits that log to subsystems. Gloo: none.
# - `NCCL_SOCKET_IFNAME=eth0`: the network interface NCCL's bootstrap and sockets use.
#   Gloo: `GLOO_SOCKET_IFNAME=lo` (section 5).
# - `NCCL_IB_DISABLE=1`: no InfiniBand: falls back to TCP sockets (to rule out the fabric).
#   Gloo: always uses TCP.
# - `TORCH_NCCL_ASYNC_ERROR_HANDLING=1`: the watchdog aborts the process when a collective times
#   out or fails, so torchrun can restart it (default on). Gloo: a collective raises at the
#   timeout (section 6).
# - `TORCH_NCCL_BLOCKING_WAIT=1`: the *calling* thread waits and raises at the timeout instead
#   of the watchdog. Gloo: always blocks the caller.
# - `TORCH_NCCL_TRACE_BUFFER_SIZE=2000`: the flight recorder: the last N collectives per rank,
#   dumped on timeout (`TORCH_NCCL_DUMP_ON_TIMEOUT=1`). Gloo: `record_collectives`, the kit's
#   hang report.
# - `TORCH_DISTRIBUTED_DEBUG=DETAIL`: checks every collective's shapes across ranks. Gloo: works
#   too (above).
#
# See [torch.distributed: debugging](https://pytorch.org/docs/stable/distributed.html#debugging-torch-distributed-applications)
# and the [NCCL environment variables](https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html).

# %% [markdown]
# ## Running at scale
#
# > The script this lesson wrote (`train.py`: `dist_info_from_env`, `resumable_train`) is
# > what you would launch on GPUs. The differences are the backend and the device:
# >
# > ```python
# > info = dist_info_from_env()
# > dist.init_process_group("nccl")               # reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
# > torch.cuda.set_device(info.local_rank)         # LOCAL_RANK picks this node's GPU
# > model = make_model().cuda()                    # ... and the batches go .cuda() too
# > ```
# >
# > Single node: `torchrun --standalone --nproc-per-node=8 train.py /ckpt 1000`. Two nodes,
# > on each: `torchrun --nnodes=2 --nproc-per-node=8 --max-restarts=3 --rdzv-backend=c10d
# > --rdzv-endpoint=HEAD:29500 --rdzv-id=job42 train.py /ckpt 1000`, or the `sbatch` file
# > above. The checkpoint directory must be on a filesystem every node sees, and a restarted
# > job (`--requeue` on SLURM, or `--max-restarts`) resumes from it.

# %% [markdown]
# ## Summary
#
# - `torchrun` runs one agent per node; agents meet at a rendezvous, start one worker per
#   GPU, give each its `RANK`/`LOCAL_RANK`/`WORLD_SIZE`/`GROUP_RANK`, and restart all of them
#   after a failure while `--max-restarts` allows.
# - Read that environment once, validated (`dist_info_from_env`); use `LOCAL_RANK`, never the
#   old `--local-rank` argument.
# - A restart runs the script from the top: checkpoint everything the next step depends on,
#   atomically on one rank, behind a barrier, and resume with the real step number.
# - Two nodes are the same command with one `--rdzv-endpoint`; SLURM runs it with
#   `srun torchrun`.
# - Hangs come from ranks disagreeing on collectives: bound them with timeouts, name the late
#   rank with `monitored_barrier`, catch mismatches with `TORCH_DISTRIBUTED_DEBUG=DETAIL`, and
#   read the `ChildFailedError` summary from its root cause.
#
# **Read more:** [torchrun](https://pytorch.org/docs/stable/elastic/run.html),
# [elastic agent](https://pytorch.org/docs/stable/elastic/agent.html),
# [error propagation and @record](https://pytorch.org/docs/stable/elastic/errors.html),
# [fault-tolerant training tutorial](https://pytorch.org/tutorials/beginner/ddp_series_fault_tolerance.html),
# [debugging torch.distributed](https://pytorch.org/docs/stable/distributed.html#debugging-torch-distributed-applications).
#
# ## Exercises (not graded)
#
# 1. Remove the `dist.barrier()` from your `resumable_train` and run the crash demo a few
#    times. Can the resumed run go wrong? Which rank's progress does the checkpoint reflect?
# 2. Save the checkpoint only every 2 steps. Is the final result still exact? What does a
#    crash cost now?
# 3. Run `torchrun` on `train.py` with `--max-restarts=0` and `CRASH_AT_STEP=3`. Read the
#    summary: which rank is the root cause, and what is its exit code?
# 4. Start the two-node run with `nnodes=2` but launch only one agent (use `torchrun_command`
#    and `subprocess`). What does the lone agent do, and for how long?
# 5. Extend `record_collectives`' output for `uneven_loop` with `first_mismatch` and write
#    the one-line fix that makes every rank run the same number of all-reduces.
