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
# Every distributed training method (DDP, FSDP, tensor parallelism) is built from a handful of
# operations that move tensors between ranks. This lesson takes them apart: how ranks find each
# other, how one rank sends to another, what each collective computes, and what it costs. You
# will rebuild two collectives from plain sends and receives, watch them run on a timeline, and
# predict their time with a two-number model.
#
# **Prerequisites:** Lesson 00 (`launch`, `%%distributed`, ranks and worlds); PyTorch tensors.
#
# **You will be able to:**
# - explain what a *store* is and why every `init_process_group` needs one (`env://`,
#   `tcp://`, `file://`, an explicit `TCPStore` or `FileStore`);
# - create subgroups with `new_group` and tell a rank from a group rank;
# - use `send`/`recv` and `isend`/`irecv`, and explain why two blocking sends deadlock;
# - state exactly what broadcast, reduce, all_reduce, all_gather, reduce_scatter, all_to_all,
#   gather, scatter and barrier compute, in place or out of place, blocking or async;
# - build a broadcast tree ({{task 1.1}}) and a ring all-reduce ({{task 1.2}}) from
#   point-to-point calls, and a barrier from a store ({{task 1.3}});
# - fit the alpha-beta cost model and predict an all-reduce ({{task 1.4}}).
# - write the same all-reduce with MPI (`mpi4py` under `mpirun`), compare the two programming
#   models, and measure `MPI_Allreduce` against gloo.
#
# Replace each `raise NotImplementedError(...)` with your code, run the cell, then the
# `check(...)` cell under it.

# %% tags=["setup"]
import os
import socket
import tempfile
import time
from datetime import timedelta

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

from kit import LaunchTimeout, check, launch
from kit.lessons import costmodel
from kit.lessons.widgets import ring_stepper
from kit.trace import launch_traced, plot_timeline, summarize

# %%
# %load_ext kit

# %% [markdown]
# ## 1. How ranks find each other: stores and rendezvous
#
# Before two processes can exchange tensors they need each other's addresses, and they need to
# agree on who is rank 0, 1, 2... That meeting is the **rendezvous**, and it happens through a
# **store**: a small key-value server every rank can reach. One process hosts it; everyone
# else connects to its address. A store offers five operations:
#
# | call | what it does |
# | --- | --- |
# | `store.set(key, value)` | write bytes under a key |
# | `store.get(key)` | read them; *blocks* until the key exists (up to the store's timeout) |
# | `store.add(key, n)` | add `n` to an integer counter, atomically, and return the new value |
# | `store.wait([keys], timeout)` | block until all keys exist |
# | `store.check([keys])` | do they exist yet? (never blocks) |
#
# `init_process_group` uses one to publish each rank's network address and count the ranks
# that have arrived. `get` and `wait` on a key nobody writes block until the store's
# `timeout`, then raise `DistStoreError`: that is the error you see when one rank of a job
# never starts. Here the notebook hosts a
# [`TCPStore`](https://pytorch.org/docs/stable/distributed.html#torch.distributed.TCPStore)
# (port 0: let the OS choose a free one) and uses it directly:

# %%
store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5),
                      wait_for_workers=False)
store.set("greeting", "hello")
print("get:", store.get("greeting"))  # bytes
print("add:", store.add("arrived", 1), store.add("arrived", 1))  # a counter: 1, then 2
print("check:", store.check(["greeting"]), store.check(["never-set"]))  # exists yet? no waiting

# %% [markdown]
# Ranks started by `launch` can connect to the same store as clients (`is_master=False`) and
# count themselves in, exactly what rendezvous does:

# %%
def check_in(port):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    arrived = client.add("checked-in", 1)  # atomic: every rank gets a different number
    client.set(f"address/{rank}", f"process {os.getpid()}")
    client.wait([f"address/{r}" for r in range(world_size)])  # until everyone has published
    return arrived


print("arrival order per rank:", list(launch(check_in, store.port, world_size=4)))
print("rank 2 published:", store.get("address/2"))

# %% [markdown]
# A [`FileStore`](https://pytorch.org/docs/stable/distributed.html#torch.distributed.FileStore)
# does the same through a file on a shared file system: no port, no host. Handy on a cluster
# where every node sees the same disk.
#
# %%
with tempfile.TemporaryDirectory() as tmp:
    file_store = dist.FileStore(os.path.join(tmp, "store"), 1)  # 1: how many processes use it
    file_store.set("epoch", "3")
    print("FileStore:", file_store.get("epoch"), file_store.add("steps", 10))
    del file_store

# %% [markdown]
# You rarely create a store yourself: `init_process_group` makes one from its `init_method`.
#
# | `init_method` | who hosts the store | typical use |
# | --- | --- | --- |
# | `"env://"` (default) | rank 0, at `$MASTER_ADDR:$MASTER_PORT` | `torchrun`, `kit.launch` |
# | `"tcp://10.0.0.1:29500"` | rank 0, at that address | scripts started by hand |
# | `"file:///shared/init"` | a file every rank can open | shared file systems |
# | `store=` a store you built | whoever built it | full control (what `kit.launch` does) |
#
# The ranks below leave the group `launch` created and rebuild it twice, once with `tcp://` and
# once with `file://`. Only the address changes; the group works the same.

# %%
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rebuild_group(port, path):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sums = {}
    for init_method in (f"tcp://127.0.0.1:{port}", f"file://{path}"):
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
        t = torch.ones(1)
        dist.all_reduce(t)
        sums[init_method.split(":")[0]] = t.item()
    return sums


with tempfile.TemporaryDirectory() as tmp:
    print(launch(rebuild_group, free_port(), os.path.join(tmp, "init"), world_size=3)[0])

# %% [markdown]
# ## 2. Process groups: rank and group rank
#
# The default group holds every rank. [`dist.new_group(ranks)`](https://pytorch.org/docs/stable/distributed.html#torch.distributed.new_group)
# makes a smaller one; collectives then run among its members only. **Every** rank must call
# `new_group` for every group, in the same order, even for groups it is not in (group
# creation is itself a collective on the default group). Inside a group, ranks are renumbered
# from 0: rank 3 of the world is rank 1 of the group `[2, 3]`. Point-to-point calls and
# `src=`/`dst=` arguments take *global* ranks; `group_src=`/`group_dst=` take group ranks.

# %%
def pairs():
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    mine = groups[rank // 2]
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)  # sums within the pair only
    return (f"global rank {rank} = group rank {dist.get_rank(mine)} of "
            f"{dist.get_world_size(mine)}, pair sum {t.item():.0f}")


for line in launch(pairs, world_size=4):
    print(line)

# %% [markdown]
# Later lessons build 2-D layouts this way: data-parallel groups across, tensor-parallel groups
# down ([`DeviceMesh`](https://pytorch.org/docs/stable/distributed.html#torch.distributed.device_mesh.DeviceMesh)
# makes the groups for you).

# %% [markdown]
# ## 3. Point to point: send and receive
#
# [`dist.send(tensor, dst)`](https://pytorch.org/docs/stable/distributed.html#torch.distributed.send)
# and `dist.recv(tensor, src)` move one tensor between two ranks; the receiver must pass a
# tensor of the right shape and dtype to fill (in place). Both **block**: with gloo, `send`
# returns only once the receiver has taken the data. `isend`/`irecv` return at once with a
# **work handle**; `handle.wait()` blocks until that transfer is done, and the tensor must not
# be touched before.

# %%
def ping_pong():
    rank = dist.get_rank()
    ball = torch.zeros(3)
    if rank == 0:
        ball += 1
        dist.send(ball, dst=1)
        dist.recv(ball, src=1)
    else:
        dist.recv(ball, src=0)
        ball *= 10
        dist.send(ball, dst=0)
    return ball.tolist()


print("blocking:", list(launch(ping_pong, world_size=2)))


def exchange():
    rank = dist.get_rank()
    peer = 1 - rank
    mine, theirs = torch.full((3,), float(rank)), torch.empty(3)
    handles = [dist.isend(mine, peer), dist.irecv(theirs, peer)]  # both in flight at once
    for handle in handles:
        handle.wait()  # only now is `theirs` filled, and `mine` free to change
    return theirs.tolist()


print("non-blocking exchange:", list(launch(exchange, world_size=2)))

# %% [markdown]
# Why did `exchange` need `isend`? Try it with blocking calls: both ranks `send` first, each
# waiting for the other to `recv`, which neither reaches. A **deadlock**: no error, no
# progress. The launch below gives up after 4 seconds and shows both ranks stuck in `send`:

# %%
def both_send_first():
    rank = dist.get_rank()
    peer = 1 - rank
    dist.send(torch.ones(3), peer)  # each waits for the other's recv...
    dist.recv(torch.empty(3), peer)  # ...which neither reaches


try:
    launch(both_send_first, world_size=2, timeout=4)
except LaunchTimeout as err:
    print(str(err).split("\n\n")[0])

# %% [markdown]
# Three fixes: order the calls by rank (even ranks send first, odd ranks receive first), post
# non-blocking calls (`exchange` above), or batch them with
# [`dist.batch_isend_irecv`](https://pytorch.org/docs/stable/distributed.html#torch.distributed.batch_isend_irecv).

# %% [markdown]
# ## 4. Collectives, one picture each
#
# A collective is called by **every** rank of a group. Below, 4 ranks start with rank `r`
# holding `[10r+1, 10r+2, 10r+3, 10r+4]` and each collective runs on fresh copies. Left of the
# arrow: what each rank held; right: what it holds after. Read the
# [collective functions](https://pytorch.org/docs/stable/distributed.html#collective-functions)
# docs alongside.
#
# | collective | result |
# | --- | --- |
# | `broadcast(t, src)` | every rank gets `src`'s `t` (in place) |
# | `reduce(t, dst, op)` | `dst` gets the reduction of all `t` (others: unspecified) |
# | `all_reduce(t, op)` | every rank gets the reduction (SUM, PRODUCT, MIN, MAX, AVG\*, ...) |
# | `all_gather(list, t)` / `all_gather_single(out, t)` | every rank gets all `t`, concatenated |
# | `reduce_scatter_single(out, t)` | rank `r` gets the sum of every rank's `r`-th slice |
# | `all_to_all_single(out, t)` | rank `r`'s slice `j` goes to rank `j`'s slot `r` (a transpose) |
# | `gather(t, list, dst)` / `scatter(t, list, src)` | one rank collects / hands out a slice each |
# | `barrier()` | nobody leaves until all have arrived |
#
# \*`ReduceOp.AVG` works on gloo too (for floating-point tensors: gloo sums, torch divides by
# the group size; an int64 tensor raises, since the mean is not an integer). `all_gather_single` and
# `reduce_scatter_single` are the current names of `all_gather_into_tensor` and
# `reduce_scatter_tensor`, which still work.

# %%
def every_collective():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    start = torch.arange(1.0, 5.0) + 10 * rank  # (4,)
    after = {}

    t = start.clone()
    dist.broadcast(t, src=0)
    after["broadcast(src=0)"] = t

    t = start.clone()
    dist.reduce(t, dst=0)  # only rank 0's result is defined
    after["reduce(dst=0)"] = t if rank == 0 else None

    t = start.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    after["all_reduce(SUM)"] = t

    t = start.clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    after["all_reduce(MAX)"] = t

    out = torch.empty(4 * world_size)  # (p * 4,): every rank's tensor, in rank order
    dist.all_gather_single(out, start)
    after["all_gather"] = out

    out = torch.empty(4 // world_size)  # (4 / p,): my slice of the sum
    dist.reduce_scatter_single(out, start)
    after["reduce_scatter"] = out

    out = torch.empty(4)
    dist.all_to_all_single(out, start)  # slice j of rank r -> slot r of rank j
    after["all_to_all"] = out

    parts = [torch.empty(4) for _ in range(world_size)] if rank == 0 else None
    dist.gather(start, parts, dst=0)
    after["gather(dst=0)"] = torch.cat(parts) if rank == 0 else None

    out = torch.empty(1)
    dist.scatter(out, list(start.chunk(world_size)) if rank == 0 else None, src=0)
    after["scatter(src=0)"] = out
    return start, after


results = launch(every_collective, world_size=4)

# %%
def draw_collective(ax, before, after, title):
    """Rows are ranks; each cell one element. Before on the left, after on the right."""
    width = len(before[0])
    gap = 1.5
    for rank, (b, a) in enumerate(zip(before, after)):
        for x, v in enumerate(b.tolist()):
            ax.add_patch(plt.Rectangle((x, rank), 1, 1, facecolor=f"C{int(v) // 10}", alpha=0.35,
                                       edgecolor="black"))
            ax.text(x + 0.5, rank + 0.5, f"{v:g}", ha="center", va="center", fontsize=7)
        if a is None:
            ax.text(width + gap, rank + 0.5, "(undefined)", va="center", fontsize=7, color="gray")
            continue
        for x, v in enumerate(a.tolist()):
            colour = f"C{int(v) // 10}" if v < 40 else "lightgray"  # sums have no single owner
            ax.add_patch(plt.Rectangle((width + gap + x, rank), 1, 1, facecolor=colour, alpha=0.35,
                                       edgecolor="black"))
            ax.text(width + gap + x + 0.5, rank + 0.5, f"{v:g}", ha="center", va="center",
                    fontsize=7)
    ax.annotate("", xy=(width + gap - 0.2, -0.4), xytext=(width + 0.2, -0.4),
                arrowprops={"arrowstyle": "->"})
    ax.set_xlim(-0.2, width + gap + max(len(a) for a in after if a is not None) + 0.2)
    ax.set_ylim(len(before) + 0.1, -0.9)
    ax.set_yticks([r + 0.5 for r in range(len(before))], [f"rank {r}" for r in range(len(before))],
                  fontsize=7)
    ax.set_xticks([])
    ax.set_title(title, fontsize=9)


before = [start for start, _ in results]
names = list(results[0][1])
fig, axes = plt.subplots(3, 3, figsize=(13, 7.5), gridspec_kw={"width_ratios": [1, 1, 1.6]})
order = ["broadcast(src=0)", "reduce(dst=0)", "all_gather", "all_reduce(SUM)", "all_reduce(MAX)",
         "gather(dst=0)", "reduce_scatter", "scatter(src=0)", "all_to_all"]
for ax, name in zip(axes.flat, order):
    draw_collective(ax, before, [after[name] for _, after in results], name)
fig.tight_layout()
plt.show()

# %% [markdown]
# Three things to notice. `all_reduce` is `reduce` followed by `broadcast`, and also
# `reduce_scatter` followed by `all_gather`: section 6 builds it the second way. `all_to_all`
# transposes the (rank, slice) grid, which is how expert parallelism routes tokens.
# `gather` and `scatter` funnel everything through one rank: avoid them in a hot loop.
#
# **In place or not.** `broadcast`, `reduce` and `all_reduce` overwrite their input; the
# gather/scatter family writes into output tensors you allocate (`out` above), so the input
# is kept. **Async.** Every collective takes `async_op=True` and then returns a work handle,
# like `isend`: start the communication, compute meanwhile, `wait()` before reading the result.
# This is how DDP overlaps gradient all-reduces with the backward pass (Lesson 04).

# %%
def overlap():
    grads = torch.ones(1_000_000)
    handle = dist.all_reduce(grads, async_op=True)  # returns at once
    busy = torch.randn(200, 200) @ torch.randn(200, 200)  # compute while bytes move
    handle.wait()  # grads is now the sum; reading it earlier would be a race
    return grads[0].item(), busy.shape


print(launch(overlap, world_size=2)[0])

# %% [markdown]
# **Python objects.** `all_gather_object`, `broadcast_object_list`, `gather_object` and
# `scatter_object_list` move any picklable object (a config dict, a list of file names): they
# pickle it into a byte tensor and run the tensor collective. Convenient, slow, and they run
# `pickle.loads` on what other ranks sent: only use them within a trusted job.

# %%
def share_configs():
    mine = {"rank": dist.get_rank(), "host": socket.gethostname()[:12]}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


print(launch(share_configs, world_size=3)[0])

# %% [markdown]
# ## 5. Seeing collectives happen: the tracer
#
# `kit.trace` records every `torch.distributed` call a rank makes: the op, its bytes, its start
# and end time, and its position in the rank's sequence. `launch_traced` is `launch` with every
# rank traced; `plot_timeline` draws one lane per rank. Later lessons use the same picture to
# watch DDP and FSDP.

# %%
def a_little_of_everything():
    rank = dist.get_rank()
    t = torch.ones(250_000)  # 1 MB of float32
    dist.broadcast(t, src=0)
    dist.all_reduce(t)
    time.sleep(0.005 * rank)  # rank 3 arrives late at the barrier: the others wait for it
    dist.barrier()
    out = torch.empty(4 * 250_000)
    dist.all_gather_single(out, t)
    return None


traced = launch_traced(a_little_of_everything, world_size=4)
traced.timeline(title="one collective after another, on 4 ranks")
plt.show()
for op, row in summarize(traced.events[0]).items():
    print(f"rank 0  {op:<18} {row['calls']} call(s)  {row['bytes'] / 1e6:6.2f} MB  "
          f"{row['seconds'] * 1e3:6.2f} ms")

# %% [markdown]
# Look at the barrier: ranks 0-2 spend longest in it, waiting for rank 3. Time inside a
# collective is often *waiting for the slowest rank*, not moving bytes. Keep that in mind
# whenever you time one.

# %% [markdown]
# ## 6. Task 1.1: broadcast along a binomial tree
#
# The simplest broadcast is a loop on `src` sending to every other rank: `p - 1` sends, one
# after another. A **binomial tree** does better: in every round each rank that already holds
# the data sends it to one that does not, so the number of holders doubles each round and `p`
# ranks are done in `ceil(log2 p)` rounds (3 rounds instead of 7 on 8 ranks).
#
# Number the ranks relative to the source, `vrank = (rank - src) % p`, so the source is 0.
# With `p = 8`: round 1, vrank 0 sends to 4; round 2, vranks 0 and 4 send to 2 and 6; round 3,
# 0, 2, 4 and 6 send to 1, 3, 5 and 7. A rank receives from the vrank that differs in its
# lowest set bit, then sends to vrank + 2^k for each smaller power of two while that is < p.
#
# Implement `tree_broadcast(tensor, src=0)`: called on every rank, in place, with only
# `dist.send`/`dist.recv` (or `isend`/`irecv`), for any `src` and any world size from 1 to 8.
# The check runs it under the tracer: it fails if you call a collective, or if your sends take
# more than `ceil(log2 p)` rounds.

# %% tags=["task-1.1"]
def tree_broadcast(tensor: torch.Tensor, src: int = 0) -> None:
    """Broadcast tensor from src to every rank, in place, along a binomial tree of send/recv.

    Called on every rank; uses only point-to-point calls and finishes in ceil(log2 p) rounds.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ### BEGIN SOLUTION
    vrank = (rank - src) % world_size  # the source is vrank 0
    mask = 1
    while mask < world_size:  # receive once, from the vrank without my lowest set bit
        if vrank & mask:
            dist.recv(tensor, src=(vrank - mask + src) % world_size)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:  # then send to vrank + 2^k, largest k first (the farthest subtree first)
        if vrank + mask < world_size:
            dist.send(tensor, dst=(vrank + mask + src) % world_size)
        mask >>= 1
    ### END SOLUTION


# %% tags=["check-1.1"]
check("1.1", tree_broadcast)

# %% [markdown]
# Your broadcast on 8 ranks from rank 0, traced. Each arrow is one message, from the start of
# the send to the end of the matching receive: three waves of arrows, three rounds.

# %%
def traced_tree():
    t = torch.full((1_000_000,), float(dist.get_rank()))
    tree_broadcast(t, src=0)
    return t[0].item()


tree = launch_traced(traced_tree, world_size=8)
tree.timeline(title="tree_broadcast on 8 ranks: 3 rounds")
plt.show()

# %% [markdown]
# ## 7. Task 1.2: ring all-reduce
#
# `all_reduce` on large tensors runs as a **ring**: rank `r` only ever sends to `r + 1` and
# receives from `r - 1`. Split the tensor into `p` chunks. In the **reduce-scatter** phase,
# `p - 1` steps: in step `s` every rank sends chunk `(r - s) % p` to its right neighbour and
# adds the chunk `(r - s - 1) % p` arriving from its left to its own. Afterwards rank `r`
# holds the complete sum of chunk `(r + 1) % p`. In the **all-gather** phase, `p - 1` more
# steps: each rank passes complete chunks around (send chunk `(r + 1 - s) % p`, receive chunk
# `(r - s) % p` and keep it as is) until everyone has every sum.
#
# Step through it below: every cell is one chunk on one rank; the letters say whose data it
# already sums (a = rank 0, b = rank 1, ...). Press play, or drag the slider.

# %%
ring_stepper(world_size=4)

# %% [markdown]
# Every rank sends `2(p - 1)` chunks of `n / p` elements: `2(p-1)/p · n` in total, under twice
# the buffer however many ranks join, and all links are busy at once. That is why ring
# all-reduce is *bandwidth-optimal*.
#
# In every step each rank sends right and receives left *at the same time*; two blocking calls
# in a row deadlock as in section 3. Post the pair with
# [`dist.batch_isend_irecv`](https://pytorch.org/docs/stable/distributed.html#torch.distributed.batch_isend_irecv)
# (a list of two `dist.P2POp`s, one `isend` and one `irecv`; wait on every handle it returns).
# On gloo an `isend` and an `irecv` posted one after the other would work as well, but not
# reliably on NCCL: there a send is a GPU kernel that may not finish until its peer has posted
# the matching receive, so separately issued sends and receives around a ring can wait on each
# other. NCCL asks for the sends and receives of one step to be issued as one group
# ([NCCL group calls](https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/groups.html)),
# which is what `batch_isend_irecv` does there; torch documents that the order of sends and
# receives inside one batch "does not matter and will not cause deadlocks".
#
# Implement `ring_all_reduce(tensor)`: an in-place sum over all ranks, by reduce-scatter then
# all-gather, with point-to-point messages only. It must work for any world size from 1 to 8,
# any number of elements (also fewer than the ranks, and not divisible by them), and float32,
# float64 and int64. *Hints:* `flat = tensor.view(-1)` shares memory with `tensor`;
# `flat.tensor_split(p)` gives `p` views whose sizes differ by at most one (some may be
# empty; an empty send/recv is fine). Receive into a scratch buffer, then `add_`.

# %% tags=["task-1.2"]
def ring_all_reduce(tensor: torch.Tensor) -> None:
    """Sum tensor over all ranks in place: ring reduce-scatter, then ring all-gather, by send/recv.

    Works for any world size, any number of elements, float32/float64/int64.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ### BEGIN SOLUTION
    chunks = tensor.view(-1).tensor_split(world_size)  # p views (n,) -> sizes n//p or n//p + 1
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    scratch = torch.empty_like(chunks[0])  # the largest chunk: every incoming chunk fits
    for step in range(world_size - 1):  # reduce-scatter
        outgoing = chunks[(rank - step) % world_size]
        mine = chunks[(rank - step - 1) % world_size]
        incoming = scratch[: mine.numel()]
        # send right and receive left as one batch: safe on NCCL, where a lone send may block
        for handle in dist.batch_isend_irecv([dist.P2POp(dist.irecv, incoming, left),
                                              dist.P2POp(dist.isend, outgoing, right)]):
            handle.wait()
        mine.add_(incoming)
    for step in range(world_size - 1):  # all-gather: receive straight into the chunk
        outgoing = chunks[(rank + 1 - step) % world_size]
        mine = chunks[(rank - step) % world_size]
        for handle in dist.batch_isend_irecv([dist.P2POp(dist.irecv, mine, left),
                                              dist.P2POp(dist.isend, outgoing, right)]):
            handle.wait()
    ### END SOLUTION


# %% tags=["check-1.2"]
check("1.2", ring_all_reduce)

# %% [markdown]
# Your ring next to gloo's `all_reduce` on the same 16 MB, traced: `2(p-1) = 6` exchanges per
# rank, each a quarter of the buffer.

# %%
def ring_vs_gloo():
    a = torch.randn(4_000_000)  # 16 MB of float32
    b = a.clone()
    dist.barrier()  # start together, so the lanes line up
    ring_all_reduce(a)
    dist.barrier()
    dist.all_reduce(b)
    return torch.allclose(a, b, rtol=1e-4, atol=1e-4)


ring = launch_traced(ring_vs_gloo, world_size=4)
print("same result as dist.all_reduce on every rank:", all(ring))
ring.timeline(title="ring_all_reduce (batched isend/irecv pairs), then gloo's all_reduce",
              arrows=False)
plt.show()

# %% [markdown]
# ## 8. Task 1.3: a barrier from a store
#
# `dist.barrier()` needs a process group. Before one exists (or outside one: a launcher, a
# checkpoint writer), ranks can synchronise through the store alone; torch does exactly this
# inside `init_process_group`. Implement `store_barrier(store, rank, world_size, name)`: no
# rank returns before all `world_size` ranks have called it with the same `name`, and the same
# name can be used again and again (every epoch, say).
#
# *Hints:* `store.add(key, 1)` returns the new count atomically, so every arrival learns its
# position. The counter keeps growing across uses: the `k`-th use is complete when it reaches
# `k * world_size`. The rank that completes a use can `set` a key for that use, and everyone
# `wait`s for it. Think about what goes wrong with `count >= world_size` on the second use.

# %% tags=["task-1.3"]
def store_barrier(store: dist.Store, rank: int, world_size: int, name: str) -> None:
    """Block until all world_size ranks have called store_barrier with this name; reusable.

    Uses only the store's add/set/get/wait; every use of the same name is a new barrier.
    """
    ### BEGIN SOLUTION
    arrived = store.add(f"{name}/arrived", 1)  # 1, 2, ... across every use of this name
    use = (arrived - 1) // world_size  # which use of the barrier this arrival belongs to
    if arrived == (use + 1) * world_size:  # the last rank of this use opens the gate
        store.set(f"{name}/open/{use}", "1")
    store.wait([f"{name}/open/{use}"])
    ### END SOLUTION


# %% tags=["check-1.3"]
check("1.3", store_barrier)

# %% [markdown]
# ## 9. What a collective costs: the alpha-beta model
#
# Sending `n` bytes takes about `T(n) = α + β·n`: a fixed **latency** `α` (seconds per message:
# system calls, the network stack, a round trip) plus `n` times the **inverse bandwidth** `β`
# (seconds per byte). Small messages are latency-bound, large ones bandwidth-bound; the cross-over
# is at `n = α / β` bytes.
#
# A ring all-reduce sends `2(p-1)` messages in sequence, each of `n / p` bytes, so
#
# $$T_\text{ring}(n, p) = 2(p-1)\,\alpha + \frac{2(p-1)}{p}\, n\, \beta.$$
#
# Two bandwidths are quoted for collectives (see nccl-tests'
# [performance notes](https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md)):
# **algorithm bandwidth** `n / T` (what the user sees) and **bus bandwidth**, algorithm bandwidth
# times `2(p-1)/p` for all-reduce: the rate each link actually carried, comparable to the
# hardware's link speed whatever `p` is.
#
# First measure `α` and `β` on this machine: time a one-way send of each size between two ranks
# (half a ping-pong round trip).

# %%
SIZES = [2**k for k in range(10, 25, 2)]  # 1 KB ... 16 MB


def ping_pong_times(sizes, repeats=5):
    rank = dist.get_rank()
    times = []
    for nbytes in sizes:
        ball = torch.empty(nbytes // 4)  # float32

        def round_trip(ball=ball):
            if rank == 0:
                dist.send(ball, 1)
                dist.recv(ball, 1)
            else:
                dist.recv(ball, 0)
                dist.send(ball, 0)

        times.append(costmodel.measure_seconds(round_trip, repeats=repeats) / 2)
    return times


one_way = launch(ping_pong_times, SIZES, world_size=2)[0]
for nbytes, seconds in zip(SIZES, one_way):
    print(f"{nbytes / 1024:8.0f} KB  {seconds * 1e6:9.1f} us  {nbytes / seconds / 1e9:6.2f} GB/s")

# %% [markdown]
# ## Task 1.4: fit the model, predict a ring
#
# Implement `fit_alpha_beta(nbytes, seconds)`: the least-squares line `seconds ≈ α + β·nbytes`
# through the measurements (lists or 1-D tensors), returned as two floats `(alpha, beta)`; and
# `ring_all_reduce_time(nbytes, world_size, alpha, beta)`: the ring formula above, in seconds.
# *Hint:* for a line, least squares gives `β = cov(n, t) / var(n)` and `α = mean(t) − β·mean(n)`
# (`torch.linalg.lstsq` works too).

# %% tags=["task-1.4"]
def fit_alpha_beta(nbytes, seconds) -> tuple[float, float]:
    """Fit seconds = alpha + beta * nbytes by least squares; return (alpha, beta) as floats.

    alpha is in seconds per message, beta in seconds per byte.
    """
    ### BEGIN SOLUTION
    n = torch.as_tensor(nbytes, dtype=torch.float64).reshape(-1)
    t = torch.as_tensor(seconds, dtype=torch.float64).reshape(-1)
    beta = ((n - n.mean()) * (t - t.mean())).sum() / ((n - n.mean()) ** 2).sum()
    alpha = t.mean() - beta * n.mean()
    return alpha.item(), beta.item()
    ### END SOLUTION


def ring_all_reduce_time(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Predicted seconds of a ring all-reduce of nbytes on world_size ranks (alpha-beta model)."""
    ### BEGIN SOLUTION
    p = world_size
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta
    ### END SOLUTION


# %% tags=["check-1.4"]
check("1.4", fit_alpha_beta)

# %% [markdown]
# Now fit this machine's `α` and `β`, time `dist.all_reduce` and your ring on 4 ranks, and
# compare with the prediction.

# %%
alpha, beta = fit_alpha_beta(SIZES, one_way)
print(f"alpha = {alpha * 1e6:.1f} us per message, 1/beta = {1 / beta / 1e9:.2f} GB/s")

ALL_REDUCE_SIZES = [2**k for k in range(14, 25, 2)]  # 16 KB ... 16 MB


def all_reduce_times(sizes, repeats=5):
    measured = {"gloo all_reduce": [], "your ring_all_reduce": []}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        for name, op in (("gloo all_reduce", dist.all_reduce),
                         ("your ring_all_reduce", ring_all_reduce)):
            def step(op=op, t=t):
                dist.barrier()  # start together: time the collective, not a late rank
                op(t)

            measured[name].append(costmodel.measure_seconds(step, repeats=repeats))
    return measured


measured = launch(all_reduce_times, ALL_REDUCE_SIZES, world_size=4)[0]
predicted = [ring_all_reduce_time(n, 4, alpha, beta) for n in ALL_REDUCE_SIZES]

fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
for name, times in measured.items():
    left.loglog(ALL_REDUCE_SIZES, times, "o-", label=f"{name} (measured)")
    right.semilogx(ALL_REDUCE_SIZES, [costmodel.bus_bandwidth("all_reduce", n, s, 4) / 1e9
                                      for n, s in zip(ALL_REDUCE_SIZES, times)], "o-", label=name)
left.loglog(ALL_REDUCE_SIZES, predicted, "k--", label="alpha-beta prediction")
left.set(xlabel="bytes", ylabel="seconds", title="all-reduce on 4 ranks")
right.axhline(1 / beta / 1e9, color="k", ls="--", label="1/beta from ping-pong")
right.set(xlabel="bytes", ylabel="GB/s", title="bus bandwidth = n/T · 2(p-1)/p")
left.legend(fontsize="small")
right.legend(fontsize="small")
fig.tight_layout()
plt.show()

# %% [markdown]
# How close is the prediction? On a laptop all 4 ranks share a few cores and one memory bus, so
# "links" are memory copies that compete with each other, and the model, which assumes
# independent links, is optimistic for large buffers. On a real network (or NVLink) with one
# rank per device it is usually within tens of percent, which is what you need to decide, for
# example, how large DDP's gradient buckets should be (Lesson 04): big enough that `α` is paid
# rarely, small enough to start communicating early.

# %% [markdown]
# ## 10. MPI side by side
#
# Everything in this lesson existed before PyTorch. The **Message Passing Interface**
# ([MPI](https://www.mpi-forum.org/docs/), a standard since 1994) is how supercomputer programs
# have always talked, and `torch.distributed` borrowed its vocabulary: rank, world size,
# send/recv, broadcast, all-reduce, reduce-scatter, barrier. Below, the same all-reduce, a ring
# and a subgroup are written twice, once with [`mpi4py`](https://mpi4py.readthedocs.io/)
# (Python on top of Open MPI) and started by `mpirun`, once with `torch.distributed` on gloo
# and started by `torchrun`; then both all-reduces are timed on the same sizes.
#
# The MPI cells need Open MPI's `mpirun` and `mpi4py`. On Debian or Ubuntu:
# `sudo apt-get install openmpi-bin libopenmpi-dev`, then `pip install -e ".[mpi]"` in the
# course folder (macOS: `brew install open-mpi`). Without them the cells below say so and skip.

# %%
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

MPIRUN = shutil.which("mpirun")
HAVE_MPI = MPIRUN is not None and importlib.util.find_spec("mpi4py") is not None
MPI_DIR = Path(tempfile.mkdtemp(prefix="mpi-"))  # the scripts of this section go here
if not HAVE_MPI:
    print("MPI cells skipped: " + ("mpirun" if MPIRUN is None else "mpi4py") + " not found. "
          "Install openmpi-bin and libopenmpi-dev (apt) and `pip install mpi4py` to run them.")


def run_ranks_with(launcher, script, *args, n=4):
    """Start `script ARGS` on n processes with "mpirun" or "torchrun"; return rank 0's JSON line."""
    if launcher == "mpirun":
        # python -m mpi4py: an uncaught exception on one rank aborts them all (MPI_Abort)
        cmd = [MPIRUN, "-n", str(n), "--oversubscribe", "-x", "OMP_NUM_THREADS=1"]
        cmd += ["--allow-run-as-root"] if os.geteuid() == 0 else []  # containers run as root
        cmd += [sys.executable, "-m", "mpi4py", script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={n}", script]
    done = subprocess.run([*cmd, *map(str, args)], cwd=MPI_DIR, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        print(done.stdout[-2000:], done.stderr[-3000:])
        raise RuntimeError(f"{launcher} {script} exited with code {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])

# %%
# %%writefile {MPI_DIR}/mpi_allreduce.py
"""All-reduce, a ring and a subgroup with MPI.

Run: mpirun -n 4 python -m mpi4py mpi_allreduce.py [NBYTES ...]
"""
import json
import sys
import time

import torch
from mpi4py import MPI  # importing it calls MPI_Init: this process joins the world mpirun made

comm = MPI.COMM_WORLD  # the communicator of every process mpirun started
rank, world_size = comm.Get_rank(), comm.Get_size()

# all-reduce: MPI reduces buffers (an address, a count, a datatype); t.numpy() is t's memory
t = torch.tensor([float(rank + 1) ** 2])
comm.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM)  # in place, like dist.all_reduce(t)

# a ring: pass a message to the right and receive from the left, p - 1 times, adding up
right, left = (rank + 1) % world_size, (rank - 1) % world_size
message, incoming = torch.tensor([float(rank)]), torch.empty(1)
ring = message.clone()
for _ in range(world_size - 1):
    comm.Sendrecv(message.numpy(), dest=right, recvbuf=incoming.numpy(), source=left)
    ring += incoming
    message, incoming = incoming, message

# a subgroup: each rank names the group it joins (color) and its place in it (key)
pairs = comm.Split(color=rank // 2, key=rank)
pair_sum = torch.tensor([float(rank)])
pairs.Allreduce(MPI.IN_PLACE, pair_sum.numpy(), op=MPI.SUM)

# time MPI_Allreduce: best of 5 per size on each rank, then the slowest rank's best
seconds = {}
for nbytes in map(int, sys.argv[1:]):
    buf = torch.ones(nbytes // 4)  # float32
    best = float("inf")
    for _ in range(5):
        comm.Barrier()  # start together: time the collective, not a late rank
        start = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM)
        best = min(best, time.perf_counter() - start)
    seconds[nbytes] = comm.allreduce(best, op=MPI.MAX)  # lower case: any picklable object

if rank == 0:
    print(json.dumps({"all_reduce": t.item(), "ring": ring.item(), "pair_sum": pair_sum.item(),
                      "pair_rank": pairs.Get_rank(), "seconds": seconds}))

# %%
# %%writefile {MPI_DIR}/gloo_allreduce.py
"""The same with torch.distributed on gloo.

Run: torchrun --standalone --nproc-per-node=4 gloo_allreduce.py [NBYTES ...]
"""
import json
import sys
import time

import torch
import torch.distributed as dist

# rendezvous: every rank meets at the store on MASTER_ADDR:MASTER_PORT
dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()

# all-reduce: torch reduces tensors
t = torch.tensor([float(rank + 1) ** 2])
dist.all_reduce(t, op=dist.ReduceOp.SUM)

# a ring: send right and receive left as one batch, p - 1 times, adding up
right, left = (rank + 1) % world_size, (rank - 1) % world_size
message, incoming = torch.tensor([float(rank)]), torch.empty(1)
ring = message.clone()
for _ in range(world_size - 1):
    for handle in dist.batch_isend_irecv([dist.P2POp(dist.isend, message, right),
                                          dist.P2POp(dist.irecv, incoming, left)]):
        handle.wait()
    ring += incoming
    message, incoming = incoming, message

# a subgroup: every rank creates every group, in the same order, listing its members
groups = [dist.new_group([r, r + 1]) for r in range(0, world_size, 2)]  # an even world size
pairs = groups[rank // 2]
pair_sum = torch.tensor([float(rank)])
dist.all_reduce(pair_sum, group=pairs)

# time gloo's all_reduce: best of 5 per size on each rank, then the slowest rank's best
seconds = {}
for nbytes in map(int, sys.argv[1:]):
    buf = torch.ones(nbytes // 4)  # float32
    best = float("inf")
    for _ in range(5):
        dist.barrier()  # start together: time the collective, not a late rank
        start = time.perf_counter()
        dist.all_reduce(buf)
        best = min(best, time.perf_counter() - start)
    slowest = torch.tensor([best])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    seconds[nbytes] = slowest.item()

if rank == 0:
    print(json.dumps({"all_reduce": t.item(), "ring": ring.item(), "pair_sum": pair_sum.item(),
                      "pair_rank": dist.get_rank(pairs), "seconds": seconds}))
dist.destroy_process_group()

# %% [markdown]
# Both scripts compute the same things on 4 processes: the all-reduce of `(rank + 1)²`
# (`1 + 4 + 9 + 16 = 30`), the ring sum of the ranks (`0 + 1 + 2 + 3 = 6`) and the sum within
# the pair `{0, 1}` (`1`). Run them with the sizes of section 9:

# %%
if HAVE_MPI:
    by_mpi = run_ranks_with("mpirun", "mpi_allreduce.py", *SIZES)
    by_gloo = run_ranks_with("torchrun", "gloo_allreduce.py", *SIZES)
    for key in ("all_reduce", "ring", "pair_sum", "pair_rank"):
        print(f"{key:10s}  MPI: {by_mpi[key]:4g}   gloo: {by_gloo[key]:4g}")
else:
    print("skipped: the MPI side by side needs mpirun and mpi4py (see above)")

# %% [markdown]
# Same numbers, two programming models:
#
# - **start**
#   - MPI (`mpi4py`): `mpirun -n 4 python ...` starts the copies (SPMD: single program,
#     multiple data) *and* hands each its place: `MPI_Init` asks `mpirun`, launcher and
#     library are one system
#   - `torch.distributed`: any launcher starts the copies (`torchrun`, `mp.spawn`,
#     `kit.launch`, Lesson 00 by hand); each then finds the others itself, through a store
#     (`init_process_group`, section 1)
# - **the world**
#   - MPI: `MPI.COMM_WORLD`, there from the start
#   - `torch.distributed`: the default process group, once `init_process_group` returns
# - **subgroups**
#   - MPI: a **communicator**: `comm.Split(color, key)`, each rank names only the group it joins
#   - `torch.distributed`: a **process group**: `dist.new_group(ranks)`, every rank creates
#     every group, in the same order
# - **data**
#   - MPI: **buffers**: an address, a count and a datatype (a NumPy array; `t.numpy()` shares a
#     CPU tensor's memory); lower-case methods (`comm.allreduce`) pickle any Python object
#   - `torch.distributed`: **tensors**, on CPU or GPU; `all_gather_object` and friends pickle
#     objects
# - **a send and a receive at once**
#   - MPI: `comm.Sendrecv(...)`
#   - `torch.distributed`: `dist.batch_isend_irecv([...])`
# - **a rank raises**
#   - MPI: with `python -m mpi4py`, `MPI_Abort` kills every rank; with plain `python` the
#     others wait in their collective
#   - `torch.distributed`: gloo fails the peers' collective when the rank's connections close;
#     a rank that hangs makes the others wait until the timeout (Lesson 00)
# - **GPUs**
#   - MPI: CUDA-aware MPI builds
#   - `torch.distributed`: NCCL
#
# Note the ring: MPI's `Sendrecv` posts both halves of the exchange in one call, exactly what
# `batch_isend_irecv` does for your `ring_all_reduce`, and for the same reason (no deadlock).

# %% [markdown]
# ### Why not `init_process_group("mpi")`?
#
# `torch.distributed` has an MPI backend, but not in the wheels you install with pip:

# %%
print("torch.distributed.is_mpi_available():", dist.is_mpi_available())
try:
    dist.init_process_group("mpi")
except RuntimeError as err:
    print(f"RuntimeError: {err}")
print("a process group was left behind:", dist.is_initialized())

# %% [markdown]
# The [backends section](https://pytorch.org/docs/stable/distributed.html#backends) of the docs
# says it: "MPI is an optional backend that can only be included if you build PyTorch from
# source." An MPI program is compiled against one implementation's `mpi.h` and linked to its
# `libmpi`, and the two big families are not binary compatible: Open MPI on one side, MPICH and
# the MPIs built on it (Intel MPI, Cray MPICH, MVAPICH) on the other. A cluster's MPI is also
# built for its own network. Rather than ship a backend per MPI, PyTorch leaves it out of its
# wheels: you compile it against yours (`USE_MPI`, on by default when the build finds an MPI).
# `mpi4py` answers the same problem differently:
# its wheel carries two compiled builds (look in its folder: `MPI.openmpi...so` and
# `MPI.mpich...so`, one per family of binary-compatible MPIs) and picks the one that matches
# the MPI library it finds at run time.

# %% [markdown]
# ### `MPI_Allreduce` against gloo's `all_reduce`
#
# The two scripts timed the all-reduce of a float32 buffer on 4 processes, best of 5 per size.
# Above 1 the ratio means MPI was faster; below 1, gloo.

# %%
if HAVE_MPI:
    mpi_s = [by_mpi["seconds"][str(n)] for n in SIZES]
    gloo_s = [by_gloo["seconds"][str(n)] for n in SIZES]
    print(f"{'bytes':>10s} {'MPI_Allreduce':>14s} {'gloo all_reduce':>16s} {'gloo / MPI':>11s}")
    for n, m, g in zip(SIZES, mpi_s, gloo_s):
        print(f"{n:10d} {m * 1e6:11.0f} us {g * 1e6:13.0f} us {g / m:10.2f}x")
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.8))
    left.loglog(SIZES, mpi_s, "o-", label="MPI_Allreduce (Open MPI)")
    left.loglog(SIZES, gloo_s, "s-", label="gloo all_reduce")
    left.set(xlabel="bytes", ylabel="seconds", title="all-reduce on 4 processes")
    left.legend(fontsize="small")
    right.loglog(SIZES, [g / m for m, g in zip(mpi_s, gloo_s)], "o-", color="C2")
    right.axhline(1, color="k", ls="--")
    right.set(xlabel="bytes", ylabel="gloo time / MPI time", title="above 1: MPI faster")
    fig.tight_layout()
    plt.show()
else:
    print("skipped: the timing needs mpirun and mpi4py (see above)")

# %% [markdown]
# How to read it. Open MPI's processes on one machine exchange data through **shared memory**,
# while gloo goes through the **TCP stack** on loopback: for small buffers, where each message
# costs latency (`α` of section 9), MPI is usually many times faster. For large buffers both
# are copying bytes and the gap shrinks; it can even turn around on a laptop. An MPI rank waits
# for its data by *polling*, spinning on a core, which is the fastest way to wait when each
# rank owns a core and the slowest when 4 ranks share 2 cores: the spinning rank takes the
# core from the one it waits for. gloo waits in the operating system, which hands the core
# over. Run `kit doctor` to see your core count, and measure with `-n 2` to compare.
#
# On GPU clusters neither is used for the gradients: NCCL is. MPI is still everywhere in HPC,
# often as the launcher (`mpirun` or Slurm's `srun` starting the ranks, and `torchrun`-style
# variables read from `OMPI_COMM_WORLD_RANK` or `SLURM_PROCID`), and `mpi4py` is a quick way to
# try an idea before writing it for `torch.distributed`.

# %% [markdown]
# ## Running at scale
#
# > Everything here runs unchanged under `torchrun`; on GPUs swap the backend:
# >
# > ```python
# > # torchrun --standalone --nproc_per_node=4 primitives.py
# > import os, torch, torch.distributed as dist
# > backend = "nccl" if torch.cuda.is_available() else "gloo"
# > dist.init_process_group(backend)  # env://: reads MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
# > device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else "cpu"
# > if backend == "nccl":
# >     torch.cuda.set_device(device)
# > t = torch.ones(1 << 20, device=device)
# > ring_all_reduce(t)  # your function: tensors on the rank's GPU
# > dist.destroy_process_group()
# > ```
# >
# > | | gloo | NCCL |
# > | --- | --- | --- |
# > | tensors | CPU; CUDA for broadcast and all_reduce only, slowly | CUDA only, one GPU per rank |
# > | ops | every op of this lesson | every op of this lesson |
# > | `ReduceOp.AVG` | yes (floating-point tensors) | yes |
# > | `ReduceOp.PREMUL_SUM` | no ("Cannot use ReduceOp.PREMUL_SUM with Gloo") | yes |
# > | where | CPU jobs, CI, laptops | every GPU cluster |
# >
# > NCCL picks ring or tree algorithms per message size and topology itself (NVLink inside a
# > node, InfiniBand/RoCE between nodes); set `NCCL_DEBUG=INFO` to see its choice. Measure your
# > cluster with [nccl-tests](https://github.com/NVIDIA/nccl-tests) (`all_reduce_perf`), which
# > reports exactly the algorithm and bus bandwidth defined above. Across nodes, rendezvous uses
# > torchrun's c10d store: `torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d
# > --rdzv_endpoint=HOST:29500 primitives.py`. See the
# > [backends table](https://pytorch.org/docs/stable/distributed.html#backends).

# %% [markdown]
# ## Summary
#
# - A **store** (TCPStore, FileStore) is the key-value meeting point of rendezvous;
#   `init_process_group` builds one from `env://`, `tcp://` or `file://`, or takes yours.
# - `new_group` makes subgroups (every rank calls it); group ranks count from 0 inside a group.
# - `send`/`recv` block and pair up; `isend`/`irecv` return work handles to `wait()` on. Two
#   ranks that both block in `send` first deadlock.
# - Each collective has an exact contract: in place (`broadcast`, `all_reduce`) or into an
#   output (`all_gather_single`, `reduce_scatter_single`), blocking or `async_op=True`.
# - A binomial tree broadcasts in `ceil(log2 p)` rounds; a ring all-reduce is a
#   reduce-scatter plus an all-gather and sends `2(p-1)/p` of the buffer per rank.
# - `T = α + β·n` per message; a ring all-reduce costs `2(p-1)α + 2(p-1)/p·n·β`. Bus
#   bandwidth makes measurements comparable across `p`.
# - `kit.trace` shows every collective on a per-rank timeline.
# - MPI has the same collectives: `mpirun` starts *and* connects the ranks, communicators
#   split by color, and it moves buffers; PyTorch's own MPI backend needs a source build.
#
# **Read more:** [torch.distributed](https://pytorch.org/docs/stable/distributed.html),
# [point-to-point communication](https://pytorch.org/docs/stable/distributed.html#point-to-point-communication),
# [collective functions](https://pytorch.org/docs/stable/distributed.html#collective-functions),
# [stores](https://pytorch.org/docs/stable/distributed.html#distributed-key-value-store),
# [writing distributed applications](https://pytorch.org/tutorials/intermediate/dist_tuto.html),
# [mpi4py](https://mpi4py.readthedocs.io/en/stable/tutorial.html).
#
# ## Exercises (not graded)
#
# 1. Trace `dist.broadcast` on 8 ranks with `launch_traced`. The tracer sees one call per rank:
#    why can it not show gloo's internal messages the way it shows yours?
# 2. Make `tree_broadcast` send to the *nearest* child first instead of the farthest. Does the
#    round count change? Look at the timeline.
# 3. Replace the batched `isend`/`irecv` pair in your ring with `dist.send` then `dist.recv`. On
#    how many ranks does it deadlock, and how would ordering by rank parity fix it?
# 4. Use your fitted `α` and `β` to find the message size at which a ring all-reduce on 8 ranks
#    spends as long on latency as on bandwidth.
# 5. Build `ring_all_gather(out, tensor)` from the second half of your ring, and check it
#    against `dist.all_gather_single`.
# 6. Run the MPI and gloo scripts with `n=2` (`run_ranks_with("mpirun", "mpi_allreduce.py",
#    *SIZES, n=2)`), and with as many processes as your machine has cores. How do the
#    ratios change when no two ranks share a core?
