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
# Data parallelism is the workhorse of distributed training: every rank holds the whole
# model, trains on its own slice of each batch, and the ranks average their gradients so that
# every copy takes the same step. You will build it three times, each version faster than
# the last, then meet `torch.nn.parallel.DistributedDataParallel` (DDP) and recognise every
# part of it.
#
# **Prerequisites:** Lesson 01 (`dist.all_reduce`, `dist.broadcast`, async work, the
# collective tracer and its timeline), Lesson 03 (`DistributedSampler`), and a PyTorch
# training loop (`loss.backward()`, `optimizer.step()`).
#
# **You will be able to:**
# - say why averaging gradients over ranks equals one step on the global batch, and when it
#   does not;
# - write data parallelism that all-reduces after backward ({{task 4.1}}), that
#   overlaps the all-reduces with backward through gradient hooks ({{task 4.2}}),
#   and that groups gradients into buckets ({{task 4.3}});
# - accumulate gradients over micro-batches without communication ({{task 4.4}});
# - read torch DDP's options (`bucket_cap_mb`, `no_sync`, `find_unused_parameters`,
#   `static_graph`, communication hooks) as the pieces you built.
#
# All three classes share one API: `Wrapper(model, ...)` keeps the model as `.module`,
# calling it runs the model, and `finish_gradient_synchronization()` is called after
# `loss.backward()` and before `optimizer.step()`.

# %% tags=["setup"]
import time
from contextlib import contextmanager

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from kit import LaunchError, check, launch
from kit.lessons.models import AwkwardNet, TinyTransformer, token_batch
from kit.trace import launch_traced, plot_timeline, region, trace

# %% [markdown]
# ## 1. Why averaging gradients works
#
# Take a loss that is a mean over a batch of $B$ samples, split into $W$ equal slices of
# $B/W$, one per rank. The gradient is linear, so the gradient of the global mean is the mean
# of the slices' gradients:
#
# $$\nabla \frac{1}{B}\sum_{i=1}^{B} \ell_i = \frac{1}{W}\sum_{r=0}^{W-1} \nabla
# \underbrace{\frac{W}{B}\sum_{i \in \text{slice } r} \ell_i}_{\text{rank } r\text{'s loss}}$$
#
# So if every rank starts from the same weights, computes its own loss, and the ranks
# replace each gradient by its average over ranks, every rank takes exactly the step one
# process would take on the whole batch. Let us check it in one process, with 4 slices:

# %%
torch.manual_seed(0)
model = TinyTransformer(vocab=32, dim=32, layers=1, heads=2, context=16)
x, y = token_batch(8, 16, 32, seed=0)  # (B=8, T=16) inputs and next-token targets


def loss_of(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())  # mean over B * T tokens


loss_of(model, x, y).backward()
whole = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
for xs, ys in zip(x.chunk(4), y.chunk(4)):  # 4 "ranks", 2 sequences each
    (loss_of(model, xs, ys) / 4).backward()  # .grad accumulates: the sum of the 4 means / 4
print("same gradients:", all(torch.allclose(a, p.grad, atol=1e-6)
                             for a, p in zip(whole, model.parameters())))

# %% [markdown]
# The identity rests on three assumptions, and each has a well-known failure:
#
# - **Samples are independent.** Batch norm normalises with the statistics of the batch it
#   sees, so 4 ranks with 2 samples each normalise differently from one process with 8
#   (`nn.SyncBatchNorm` all-reduces the statistics instead). Layer norm is per sample: fine.
# - **Slices are equal.** With 3 samples on one rank and 1 on another, the mean of the two
#   means weights the lonely sample 3 times too much (Lesson 00's `global_mean` lesson again).
#   `DistributedSampler` pads so that slices are equal.
# - **Every rank reduces the same parameters.** If a layer is unused on one rank, that rank
#   has no gradient to contribute, while the others wait in the all-reduce for it.

# %%
bn = nn.BatchNorm1d(3)
samples = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
one_process = bn(samples)
four_ranks = torch.cat([bn(s) for s in samples.chunk(4)])
print("batch norm, 1 process vs 4 slices: max difference",
      f"{(one_process - four_ranks).abs().max().item():.2f}")

# %% [markdown]
# ## 2. Naive data parallelism
#
# The recipe, straight from the identity:
#
# 1. at construction, `dist.broadcast` every parameter and buffer from rank 0, so that all
#    ranks start equal (each rank initialised its model with its own random numbers);
# 2. forward and backward as usual, each rank on its own slice;
# 3. after backward, `dist.all_reduce` every gradient and divide by `world_size`.
#
# Three kinds of parameter need care, and the checks include all of them
# ([`kit.lessons.models.AwkwardNet`](../kit/lessons/models.py)):
#
# - **frozen** parameters (`requires_grad=False`) never get a gradient: skip them when
#   reducing (but broadcast them with the rest: they shape the forward pass too);
# - **unused** parameters (a branch that did not run this step) keep `p.grad is None`: skip
#   them too (every rank skips the same ones here, because every rank runs the same branches);
# - **tied** parameters, such as an embedding reused as the output layer, are *one*
#   `Parameter` reached from two modules. `model.parameters()` lists it once; walking module
#   by module finds it twice, and reducing it twice wastes a collective.

# %%
awkward = AwkwardNet()
print("named_parameters():", [n for n, _ in awkward.named_parameters()])
print("tied:", awkward.head.weight is awkward.embed.weight,
      "| frozen:", [n for n, p in awkward.named_parameters() if not p.requires_grad])


# %% [markdown]
# ### Task 4.1: `NaiveDDP`
#
# Write `NaiveDDP(module)`. `__init__` keeps `module` as `self.module` and broadcasts rank
# 0's parameters and buffers (`dist.broadcast(t, src=0)` under `torch.no_grad()`); `forward`
# runs the module; `finish_gradient_synchronization()` all-reduces each parameter's gradient
# and divides it by `dist.get_world_size()`.

# %% tags=["task-4.1"]
class NaiveDDP(nn.Module):
    """Data parallelism that all-reduces every gradient once backward has finished.

    Args:
        module: the model; every rank passes its own copy, rank 0's weights win.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        ### BEGIN SOLUTION
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:  # frozen ones too
                dist.broadcast(t, src=0)
        ### END SOLUTION

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Replace every parameter's .grad with its average over ranks (None stays None)."""
        ### BEGIN SOLUTION
        world_size = dist.get_world_size()
        for p in self.module.parameters():  # a tied parameter is listed once
            if p.grad is not None:
                dist.all_reduce(p.grad)  # sum over ranks, in place
                p.grad /= world_size
        ### END SOLUTION


# %% tags=["check-4.1"]
check("4.1", NaiveDDP)

# %% [markdown]
# Now watch one training step on the collective timeline from Lesson 01. Each rank builds
# the same small transformer, wraps it, and runs forward, backward and the synchronisation
# inside named regions; `launch_traced` brings back every rank's events.

# %%
def train_step(wrapper, steps=3, world_size=2, **options):
    """Each rank: wrap a small transformer, take `steps` SGD steps on its own batches.

    Returns the last step's loss; the trace shows forward, backward, synchronisation and
    every all-reduce of the last step.
    """
    torch.manual_seed(dist.get_rank())  # different weights everywhere: the broadcast fixes it
    model = wrapper(TinyTransformer(vocab=64, dim=64, layers=4, heads=4, context=32), **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = token_batch(4, 32, 64, seed=100 * step + dist.get_rank())  # this rank's slice
        trace_this = step == steps - 1
        with region("forward") if trace_this else _nothing():
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        with region("backward") if trace_this else _nothing():
            loss.backward()
        with region("synchronise") if trace_this else _nothing():
            model.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad()
    return loss.item()


@contextmanager
def _nothing():
    yield


def last_step(events):
    """Only the last step's events: from its forward region on, without the broadcasts."""
    out = []
    for lane in events:
        start = max(e.start for e in lane if e.op == "forward")
        out.append([e for e in lane if e.start >= start and e.op != "broadcast"])
    return out


PHASE_COLOURS = {"forward": "tab:green", "backward": "tab:orange", "synchronise": "tab:red"}


def plot_step(traced, title, ax=None):
    """One lane per rank: forward, backward and synchronise as bars, a tick per all-reduce start.

    The same tracer events as plot_timeline; an async all-reduce is drawn where it was started,
    since the tracer knows when it was waited for, not when the network finished it.
    """
    events = last_step(traced.events)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 1.6))
    t0 = min(e.start for lane in events for e in lane)
    for lane in events:
        for e in lane:
            if e.kind == "region":
                ax.barh(e.rank, 1e3 * e.duration, left=1e3 * (e.start - t0), height=0.5,
                        color=PHASE_COLOURS[e.op], label=e.op if e.rank == 0 else None)
            elif e.op == "all_reduce":
                x = 1e3 * (e.start - t0)
                ax.plot([x, x], [e.rank - 0.4, e.rank + 0.4], color="tab:blue", lw=1,
                        label="all_reduce starts" if e.rank == 0 and e.index == min(
                            f.index for f in lane if f.op == "all_reduce") else None)
    ax.set_yticks(range(len(events)), [f"rank {r}" for r in range(len(events))])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)
    return ax


naive = launch_traced(train_step, NaiveDDP, world_size=2, echo=False)
plot_timeline(last_step(naive.events), title="NaiveDDP: every all-reduce waits for backward")
plt.show()
plot_step(naive, "NaiveDDP: forward, backward, then one blocking all-reduce per parameter")
plt.show()

# %% [markdown]
# The first picture is Lesson 01's timeline: every all-reduce (blue) sits after the backward
# region (hatched). The second draws the same events by phase, with a tick where each
# all-reduce starts; we use it for the next versions. While the network is busy the processor
# is idle, and the other way round, and one blocking call per parameter pays the latency of
# a collective many times over.
#
# ## 3. Overlapping communication with backward
#
# Backward computes gradients from the last layer to the first. The last layer's gradient is
# final long before backward ends, so its all-reduce can start right away and run while
# backward works on earlier layers. Two tools make that possible:
#
# - [`Tensor.register_post_accumulate_grad_hook(hook)`](https://pytorch.org/docs/stable/generated/torch.Tensor.register_post_accumulate_grad_hook.html)
#   calls `hook(param)` once `param.grad` holds this backward's gradient (for a tied
#   parameter, after both uses have been added up);
# - `dist.all_reduce(t, async_op=True)` starts the collective and returns a `Work` at once;
#   `work.wait()` blocks until it is done (Lesson 01).

# %% [markdown]
# ### Task 4.2: `OverlappedDDP`
#
# Write `OverlappedDDP(module)`: broadcast as before, register a post-accumulate-grad hook on
# every parameter that requires grad, start an async all-reduce of its gradient in the hook
# and keep the `Work`; `finish_gradient_synchronization()` waits for each one and divides by
# the world size.

# %% tags=["task-4.2"]
class OverlappedDDP(nn.Module):
    """Data parallelism that starts each gradient's all-reduce as soon as backward produced it.

    Args:
        module: the model; every rank passes its own copy, rank 0's weights win.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self._pending = []  # (work, grad) of the all-reduces started during this backward
        ### BEGIN SOLUTION
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
        for p in module.parameters():  # a tied parameter once: one hook, one all-reduce
            if p.requires_grad:  # a hook on a frozen tensor is an error, and it has no grad
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        ### END SOLUTION

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """Called by autograd once param.grad is final for this backward."""
        ### BEGIN SOLUTION
        work = dist.all_reduce(param.grad, async_op=True)
        self._pending.append((work, param.grad))
        ### END SOLUTION

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every started all-reduce and turn the sums into averages."""
        ### BEGIN SOLUTION
        world_size = dist.get_world_size()
        for work, grad in self._pending:
            work.wait()
            grad /= world_size
        self._pending.clear()
        ### END SOLUTION


# %% tags=["check-4.2"]
check("4.2", OverlappedDDP)

# %%
overlapped = launch_traced(train_step, OverlappedDDP, world_size=2, echo=False)
plot_step(overlapped, "OverlappedDDP: all-reduces start inside backward")
plt.show()

# %% [markdown]
# The all-reduces now start inside the backward region, one per parameter. On a laptop CPU
# with gloo, communication and computation compete for the same cores, so the overlap buys
# little and can even cost time (see the step times in section 7); on GPUs NCCL runs on its
# own stream and the overlap hides most of the communication. The price is the number of
# calls: a transformer has many small parameters (biases, norms), and each collective pays
# a fixed latency.
#
# ## 4. Buckets
#
# Torch DDP groups gradients into **buckets** of about `bucket_cap_mb` megabytes (25 MiB by
# default) and all-reduces one flat buffer per bucket: few large messages instead of many
# small ones, still overlapped with backward. Two details make it work:
#
# - buckets are filled in **reverse** registration order (`reversed(list(parameters))`), the
#   order backward produces gradients in, so the first bucket is ready early;
# - a bucket is reduced **once**, when *all* its parameters have reported. A parameter that
#   got no gradient this step never reports, so whatever is still waiting is started in
#   `finish_gradient_synchronization()`.

# %%
def bucket_plan(model, bucket_size_mb):
    """Parameter names per bucket: reverse order, closed when the next one passes the cap."""
    cap = bucket_size_mb * 2**20
    buckets, current, size = [], [], 0
    for name, p in reversed(list(model.named_parameters())):
        if not p.requires_grad:
            continue
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    return buckets + [current] if current else buckets


for i, names in enumerate(bucket_plan(AwkwardNet(), bucket_size_mb=600 / 2**20)):
    print(f"bucket {i}: {names}")


# %% [markdown]
# ### Task 4.3: `BucketedDDP`
#
# Write `BucketedDDP(module, bucket_size_mb)`. In `__init__`: broadcast, then group the
# parameters that require grad into buckets with the walk of `bucket_plan` above (a parameter
# larger than the cap gets a bucket of its own), and register a hook on each. In the hook
# (its first two lines, given, skip everything inside `no_sync()` for Task 4.4), count the
# parameter as ready in its bucket; when the whole bucket is ready, flatten its gradients into
# one tensor (`torch.cat` of `g.reshape(-1)`, zeros for a gradient that is None), divide by the
# world size and start one async all-reduce. In `finish_gradient_synchronization()`: start the
# buckets that never became ready, wait for every bucket, copy each slice back into its
# `p.grad` (leave a None gradient None) and reset the counters for the next step.

# %% tags=["task-4.3"]
class BucketedDDP(nn.Module):
    """Data parallelism with one async all-reduce per bucket of gradients, in reverse order.

    Args:
        module: the model; every rank passes its own copy, rank 0's weights win.
        bucket_size_mb: most bytes per bucket, in MiB (2**20 bytes); a larger parameter gets
            a bucket of its own.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0):
        super().__init__()
        self.module = module
        self.require_backward_grad_sync = True  # no_sync() (Task 4.4) turns it off
        ### BEGIN SOLUTION
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
        cap = bucket_size_mb * 2**20
        self.buckets = []  # lists of parameters, in the order backward produces their grads
        current, size = [], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > cap:
                self.buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self.buckets.append(current)
        self._bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._ready = [0] * len(self.buckets)  # parameters of each bucket with a final grad
        self._pending = {}  # bucket index -> (work, flat buffer), this step
        for p in self._bucket_of:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        ### END SOLUTION

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """Called by autograd once param.grad is final for this backward."""
        if not self.require_backward_grad_sync:
            return  # inside no_sync(): the gradient only accumulates in param.grad
        ### BEGIN SOLUTION
        i = self._bucket_of[param]
        self._ready[i] += 1
        if self._ready[i] == len(self.buckets[i]):
            self._start(i)
        ### END SOLUTION

    def _start(self, i: int) -> None:
        """Flatten bucket i's gradients, divide by the world size, start one async all-reduce."""
        ### BEGIN SOLUTION
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.buckets[i]])  # (sum of numels,)
        flat /= dist.get_world_size()
        self._pending[i] = (dist.all_reduce(flat, async_op=True), flat)
        ### END SOLUTION

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Start the buckets still waiting, wait for all, write the averages into .grad."""
        if not self.require_backward_grad_sync:
            return
        ### BEGIN SOLUTION
        for i in range(len(self.buckets)):
            if i not in self._pending:  # a parameter got no gradient this step
                self._start(i)
        for i, (work, flat) in sorted(self._pending.items()):
            work.wait()
            offset = 0
            for p in self.buckets[i]:
                if p.grad is not None:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self._pending.clear()
        self._ready = [0] * len(self.buckets)
        ### END SOLUTION


# %% tags=["check-4.3"]
check("4.3", BucketedDDP)

# %%
bucketed = launch_traced(train_step, BucketedDDP, world_size=2, echo=False, bucket_size_mb=0.25)
plot_step(bucketed, "BucketedDDP (0.25 MiB buckets): few all-reduces, inside backward")
plt.show()

# %% [markdown]
# Count the calls of the last step in each version: the same bytes move in all three, in
# fewer and larger messages with buckets.

# %%
def all_reduces(traced):
    return [sum(e.op == "all_reduce" for e in lane) for lane in last_step(traced.events)][0]


for name, traced in [("NaiveDDP", naive), ("OverlappedDDP", overlapped), ("BucketedDDP", bucketed)]:
    print(f"{name:14s} {all_reduces(traced):4d} all-reduces in one step")

# %% [markdown]
# ## 5. Gradient accumulation and `no_sync`
#
# When a batch does not fit in memory, split it into `k` micro-batches, call `backward()` on
# each (divided by `k`): `.grad` adds them up, and one optimizer step follows. With data
# parallelism only the last micro-batch needs to communicate: the accumulated `.grad` holds
# the sum of all `k`, and one all-reduce of it does the work of `k`. Torch DDP's
# [`no_sync()`](https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html#torch.nn.parallel.DistributedDataParallel.no_sync)
# context manager switches communication off for the backward passes inside it:
#
# ```python
# for i, (x, y) in enumerate(micro_batches):
#     last = i == len(micro_batches) - 1
#     with contextlib.nullcontext() if last else model.no_sync():
#         (loss_fn(model(x), y) / len(micro_batches)).backward()
# model.finish_gradient_synchronization()   # torch DDP: nothing, backward already did it
# optimizer.step()
# ```

# %% [markdown]
# ### Task 4.4: `BucketedDDP.no_sync()`
#
# Add `no_sync()` to `BucketedDDP`: a context manager that sets
# `self.require_backward_grad_sync = False` for the duration of the `with` block and restores
# the previous value afterwards, even when the block raises. The cell below extends your
# class from Task 4.3 with it.

# %% tags=["task-4.4"]
class BucketedDDP(BucketedDDP):
    """Add no_sync(): a context manager under which backward accumulates gradients locally.

    Within the block, backward() adds into .grad with no communication; the next backward
    outside it all-reduces the accumulated gradients.
    """

    @contextmanager
    def no_sync(self):
        ### BEGIN SOLUTION
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous
        ### END SOLUTION


# %% tags=["check-4.4"]
check("4.4", BucketedDDP)

# %% [markdown]
# Count the all-reduces of each backward in a step of 4 micro-batches: the first three stay
# silent and the last one sends every bucket once.

# %%
def accumulate(micro=4):
    torch.manual_seed(dist.get_rank())
    model = BucketedDDP(TinyTransformer(vocab=64, dim=64, layers=2, heads=4, context=32),
                        bucket_size_mb=0.25)
    x, y = token_batch(8, 32, 64, seed=dist.get_rank())  # this rank's 8 sequences
    calls = []
    for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):  # 2 sequences each
        with trace() as t, model.no_sync() if i < micro - 1 else _nothing():
            (F.cross_entropy(model(xs).flatten(0, 1), ys.flatten()) / micro).backward()
        calls.append(t.collectives().count("all_reduce"))
    model.finish_gradient_synchronization()
    return calls


print("all-reduces in each micro-batch's backward:", launch(accumulate, world_size=2)[0])

# %% [markdown]
# ## 6. torch's `DistributedDataParallel`
#
# [`DistributedDataParallel`](https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html)
# is `BucketedDDP` written in C++ (the *Reducer*), with the same parts:
#
# | your code | torch DDP |
# | --- | --- |
# | broadcast in `__init__` | broadcasts parameters and buffers from rank 0 at construction, and buffers again before every forward (`broadcast_buffers=True`) |
# | `bucket_size_mb` | `bucket_cap_mb=25` (the first bucket is kept small, 1 MiB, so communication starts early) |
# | hooks + counters | autograd hooks mark parameters ready; a bucket's all-reduce starts when all are |
# | `finish_gradient_synchronization()` | nothing to call: `backward()` returns once every bucket is reduced and written back |
# | `no_sync()` | the same, same name |
# | unused parameters | `find_unused_parameters=True` walks the graph after forward and marks unused ones ready |
#
# DDP does **not** split your batch: each rank must feed its own slice, which is what
# `DistributedSampler` (Lesson 03) is for. Here it is on 2 ranks with both:

# %%
def torch_ddp(steps=3):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    torch.manual_seed(dist.get_rank())
    model = DDP(TinyTransformer(vocab=64, dim=64, layers=2, heads=4, context=32),
                bucket_cap_mb=0.25)
    x, y = token_batch(32, 32, 64, seed=0)  # the whole dataset: 32 sequences
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, shuffle=True, seed=0)  # this rank's 16 sequences
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _, (xb, yb) in zip(range(steps), loader):
        loss = F.cross_entropy(model(xb).flatten(0, 1), yb.flatten())
        loss.backward()  # the bucketed all-reduces happen in here
        optimizer.step()
        optimizer.zero_grad()
    # Every rank holds the same weights: compare a checksum.
    return sum(p.double().sum().item() for p in model.parameters())


print(launch(torch_ddp, world_size=2))

# %% [markdown]
# ### Look inside DDP between steps: persistent ranks
#
# `launch` and `%%distributed -n N` start fresh ranks for every cell: what they built is gone
# when the cell ends. To look at a model *between* steps, start ranks that stay up.
# `%distributed start 2` starts 2 ranks that keep their variables and their process group
# until `%distributed stop`; every `%%distributed` cell runs on them meanwhile, in one
# namespace per rank (`kit.Ranks(2)` does the same from Python). A cell where
# every rank raises (a typo) leaves them as they were; a crash or a hang stops them, and
# `%distributed restart` starts fresh ones.
#
# One cell wraps a model (each rank initialises it from its own seed), the next looks at what
# DDP did: the parameters are rank 0's on every rank (DDP broadcast them in its constructor),
# and the Reducer holds its gradient buckets.

# %%
# %load_ext kit
# %distributed start 2

# %%
# %%distributed
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(rank)  # a different initialisation on each rank...
model = DDP(TinyTransformer(vocab=64, dim=64, layers=2, heads=4, context=32), bucket_cap_mb=0.25)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def bucket_bytes():
    """The Reducer's gradient buckets, in bytes (a private API, for looking only)."""
    return [b.buffer().numel() * b.buffer().element_size()
            for b in model.reducer._get_zeros_like_grad_buckets()]


checksum = sum(p.double().sum().item() for p in model.parameters())
print(f"parameter checksum after wrapping {checksum:.6f}; buckets {bucket_bytes()} bytes")

# %% [markdown]
# The same checksum on both ranks: DDP replaced rank 1's initialisation with rank 0's. And one
# bucket of every parameter, over the 0.25 MiB cap: until the first backward, DDP does not know
# the order in which gradients arrive. Train two steps on each rank's own batch, looking after
# each:

# %%
# %%distributed
x, y = token_batch(8, 32, 64, seed=rank)  # each rank its own batch
for step in range(2):
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    checksum = sum(p.double().sum().item() for p in model.parameters())
    print(f"step {step}: loss {loss.item():.4f}, checksum {checksum:.6f}; buckets now "
          f"{bucket_bytes()} bytes")

# %% [markdown]
# Different losses (different data), the same weights after each step (averaged gradients).
# The first backward recorded the order in which gradients became ready, and the second
# forward rebuilt the buckets in that order, each near the cap (a bucket closes once it
# reaches the cap, so it may pass it by one parameter). `%distributed stop` ends the
# ranks:

# %%
# %distributed stop

# %% [markdown]
# The Reducer is C++: it calls the process group directly, never `dist.all_reduce`. The
# course's recorder sits *in* the process group, below Python, so it sees those calls too:
# here is torch DDP (0.25 MiB buckets) in the same training step as your three versions, on
# the same timeline. Each all-reduce is one bucket, issued from inside `backward()`; its
# event's `route` says `"c++"`. (Unless `find_unused_parameters=True`, torch 2.13 puts every
# parameter in one bucket for the first step, one large all-reduce, and after that step
# rebuilds the buckets under `bucket_cap_mb` in the order the gradients actually arrived; the
# timeline shows the last step.)

# %%
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


class TorchDDP(DDP):
    """torch's DDP with the method train_step calls: nothing is left to do after backward."""

    def finish_gradient_synchronization(self):
        pass


torch_traced = launch_traced(train_step, TorchDDP, world_size=2, echo=False, bucket_cap_mb=0.25)
plot_timeline(last_step(torch_traced.events),
              title="torch DDP: the Reducer's bucket all-reduces, issued from C++ inside backward")
plt.show()
reducer = [e for e in last_step(torch_traced.events)[0] if e.op == "all_reduce"]
print(f"torch DDP      {len(reducer):4d} all-reduces in one step, "
      f"routes {sorted({e.route for e in reducer})}, "
      f"{sum(e.nbytes for e in reducer) / 1e6:.2f} MB")

# %% [markdown]
# A layer unused in forward is a hang waiting to happen: its bucket never becomes ready. DDP
# notices at the next iteration and raises rather than hang; `find_unused_parameters=True`
# fixes it at the cost of a graph walk each step, and `static_graph=True` says the set of
# used parameters never changes, so DDP can learn it once.

# %%
def unused_layer(options):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(AwkwardNet(), **options)
    x, y = token_batch(2, 5, 16, seed=dist.get_rank())
    for _ in range(2):
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    return "two steps done"


print("find_unused_parameters=True:", launch(unused_layer, {"find_unused_parameters": True},
                                             world_size=2))
print("static_graph=True:          ", launch(unused_layer, {"static_graph": True}, world_size=2))
try:
    launch(unused_layer, {}, world_size=2)
except LaunchError as e:
    message = e.failures[0].summary  # the first failed rank's error, as DDP wrote it
    for sentence in message.replace("\n", " ").split(". "):
        if "Expected to have finished" in sentence or "find_unused_parameters" in sentence \
                or "did not receive grad" in sentence:
            print("DDP:", " ".join(sentence.split())[:200])

# %% [markdown]
# ### Communication hooks: compress the gradients
#
# `model.register_comm_hook(state, hook)` replaces the all-reduce of every bucket with your
# own function of the bucket. torch ships `fp16_compress_hook` and `bf16_compress_hook`
# ([docs](https://pytorch.org/docs/stable/ddp_comm_hooks.html)): cast the bucket to 16 bits,
# divide by the world size, all-reduce, cast back. Half the bytes on the wire, for some
# rounding of the gradients. Both work with any backend whose all-reduce takes 16-bit tensors,
# gloo included, but `register_comm_hook` accepts torch's `bf16_compress_hook` only from a
# torch build with CUDA and NCCL >= 2.10 (or XPU with XCCL), whatever backend the group uses:
# on this CPU-only build it raises `TypeError`. They are a few lines each, so here is the same
# hook, accepted everywhere:

# %%
def compress_hook(dtype):
    """A DDP communication hook that all-reduces every bucket in `dtype` (the mean over ranks)."""

    def hook(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()  # (bucket numel,) the bucket's gradients, flat, fp32
        compressed = buffer.to(dtype).div_(group.size())
        work = dist.all_reduce(compressed, group=group, async_op=True)

        def decompress(fut):
            buffer.copy_(fut.value()[0])  # back to fp32, in place
            return buffer

        return work.get_future().then(decompress)

    return hook


def with_comm_hook(dtype, steps=4):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from kit.trace import trace

    torch.manual_seed(0)
    model = DDP(TinyTransformer(vocab=64, dim=64, layers=2, heads=4, context=32))
    model.register_comm_hook(None, compress_hook(dtype))
    x, y = token_batch(4, 32, 64, seed=dist.get_rank())
    start = time.perf_counter()
    for _ in range(steps):
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    seconds = (time.perf_counter() - start) / steps
    model.zero_grad()
    with trace() as t:  # one more backward, traced: what went over the wire?
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    grad = model.module.blocks[0].qkv.weight.grad.clone()
    return {"bytes": sum(e.nbytes for e in t.events if e.op == "all_reduce"),
            "step_ms": 1e3 * seconds, "grad": grad}


hooks = {str(dtype)[6:]: launch(with_comm_hook, dtype, world_size=2)[0]
         for dtype in [torch.float32, torch.float16, torch.bfloat16]}
for name, r in hooks.items():
    error = (r["grad"] - hooks["float32"]["grad"]).abs().max().item()
    print(f"{name}: {r['bytes'] / 1e3:7.1f} kB all-reduced per step, {r['step_ms']:6.1f} ms/step, "
          f"max gradient difference vs fp32 {error:.1e}")

# %% [markdown]
# On a laptop the bytes halve but the time barely moves (the model is small and the "network"
# is memory). Across machines, where bandwidth is the bottleneck, halving the bytes is real
# time. bf16 keeps fp32's range with fewer mantissa bits, so its rounding error is larger but
# it never overflows.
#
# ## 7. Step time, side by side
#
# The same small transformer, 2 ranks, 3 steps each: your three versions and torch DDP.
# (`benchmarks/ddp_step_time.py` runs the longer comparison on 2 and 4 ranks.)

# %%
def timed(wrapper, steps=4, **options):
    torch.manual_seed(0)
    model = wrapper(TinyTransformer(vocab=64, dim=64, layers=4, heads=4, context=32), **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = getattr(model, "finish_gradient_synchronization", lambda: None)
    times = []
    for step in range(steps):
        x, y = token_batch(4, 32, 64, seed=step + 10 * dist.get_rank())
        start = time.perf_counter()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        sync()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]  # median seconds per step


from torch.nn.parallel import DistributedDataParallel  # noqa: E402

versions = {"NaiveDDP": (NaiveDDP, {}), "OverlappedDDP": (OverlappedDDP, {}),
            "BucketedDDP": (BucketedDDP, {"bucket_size_mb": 0.25}),
            "torch DDP": (DistributedDataParallel, {"bucket_cap_mb": 0.25})}
step_ms = {name: 1e3 * max(launch(timed, cls, world_size=2, **opts)) for name, (cls, opts)
           in versions.items()}
plt.figure(figsize=(6, 2.5))
plt.barh(list(step_ms), list(step_ms.values()), color="tab:blue")
plt.xlabel("median step time on 2 ranks (ms)")
plt.gca().invert_yaxis()
plt.show()
for name, ms in step_ms.items():
    print(f"{name:14s} {ms:6.1f} ms/step, {ms / step_ms['torch DDP']:4.2f}x torch DDP")

# %% [markdown]
# Expect buckets to win by a wide margin over one call per parameter, and your `BucketedDDP`
# to land close to torch DDP, which does the same work in C++. The overlapped version's place
# depends on the machine: on a laptop CPU its many small calls can cost more than the overlap
# saves. A few steps on a busy laptop are noisy; the benchmark runs longer and alternates the
# four so that noise hits them alike.

# %% [markdown]
# ## Running at scale
#
# > On GPUs the same training loop runs under `torchrun` with NCCL; use torch's DDP there:
# >
# > ```python
# > # torchrun --standalone --nproc_per_node=8 train.py
# > import os
# > import torch
# > import torch.distributed as dist
# > from torch.nn.parallel import DistributedDataParallel as DDP
# >
# > dist.init_process_group("nccl")
# > local_rank = int(os.environ["LOCAL_RANK"])
# > torch.cuda.set_device(local_rank)
# > model = TinyTransformer().cuda(local_rank)
# > model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
# > # ... the loop above, with a DistributedSampler and batches moved to the GPU ...
# > dist.destroy_process_group()
# > ```
# >
# > - **NCCL streams.** NCCL does not get a stream per bucket: a process group runs all its
# >   collectives on one internal CUDA stream per device (`ProcessGroupNCCL`'s `ncclStreams_`),
# >   separate from the stream backward's kernels run on. The buckets' all-reduces queue on
# >   that stream one after another, while backward keeps computing on its own, so the
# >   communication really does run in parallel with the computation, unlike gloo on CPU
# >   where both compete for the same cores.
# > - **`device_ids=[local_rank]`** tells DDP which single GPU this process drives.
# > - **`gradient_as_bucket_view=True`** makes each `p.grad` a view into its bucket's flat
# >   buffer: no copy into the bucket before the all-reduce and none back after it, and one
# >   gradient-sized buffer less in memory. Your `BucketedDDP` copies both ways.
# > - Across nodes only the launch changes:
# >   `torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d
# >   --rdzv_endpoint=HOST:29500 train.py`.

# %% [markdown]
# ## Summary
#
# - Averaging gradients over ranks that started from the same weights equals one step on the
#   global batch, as long as samples are independent (no batch norm), slices are equal and
#   every rank reduces the same parameters.
# - `NaiveDDP`: broadcast at construction, all-reduce every gradient after backward.
# - `OverlappedDDP`: post-accumulate-grad hooks start async all-reduces during backward.
# - `BucketedDDP`: reverse-order buckets under a size cap, one all-reduce per bucket, started
#   when the bucket is complete; unfinished buckets start in finish.
# - `no_sync()`: accumulate micro-batches locally; only the last backward communicates.
# - torch DDP is the same design with `bucket_cap_mb`, `find_unused_parameters`,
#   `static_graph` and communication hooks, and it does not split your data: a
#   `DistributedSampler` does.
#
# **Read more:** [DDP notes](https://pytorch.org/docs/stable/notes/ddp.html),
# [`DistributedDataParallel`](https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html),
# [DDP communication hooks](https://pytorch.org/docs/stable/ddp_comm_hooks.html),
# [Getting started with DDP](https://pytorch.org/tutorials/intermediate/ddp_tutorial.html),
# and the paper *PyTorch Distributed: Experiences on Accelerating Data Parallel Training*
# (Li et al., VLDB 2020).
#
# ## Exercises (not graded)
#
# 1. Make `NaiveDDP` send one flat buffer instead of one tensor per parameter
#    (`torch.cat` then split back). How many all-reduces remain, and how does the step time
#    change?
# 2. Give `BucketedDDP` a small first bucket, as torch DDP does. Where does the first
#    all-reduce start on the timeline?
# 3. Train `AwkwardNet` with `OverlappedDDP` where rank 1 alone uses the `extra` branch. What
#    happens, and which torch DDP option exists for this case?
# 4. Replace `nn.LayerNorm` with `nn.BatchNorm1d` in a small model and compare 2-rank training
#    with one process. Then wrap it with `nn.SyncBatchNorm.convert_sync_batchnorm`.
# 5. Write `fp16_compress` for `BucketedDDP`: cast each flat bucket to `torch.float16` before
#    the all-reduce and back after it. How large is the gradient error?
