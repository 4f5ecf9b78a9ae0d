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
# Data parallelism (Lesson 04) keeps a full copy of the model on every rank: its parameters,
# its gradients and the optimizer's state. With Adam that is 16 bytes per parameter on every
# rank, so a 7-billion-parameter model needs 112 GB per rank before a single activation,
# however many ranks you add. This lesson removes the copies, one kind at a time, as the ZeRO
# paper does: first the optimizer state, then the parameters and gradients too. You will
# build each step by hand, then meet PyTorch's `ZeroRedundancyOptimizer` and FSDP2
# (`fully_shard`) and recognise every part.
#
# **Prerequisites:** Lesson 01 (all-gather, reduce-scatter, broadcast, reduce, the tracer and
# the alpha-beta cost model), Lesson 04 (data parallelism, gradient hooks), and a PyTorch
# training loop with `torch.optim.AdamW`.
#
# **You will be able to:**
# - count the bytes of training state a rank really holds, storages once and DTensors by
#   their local shard ({{task 5.1}}), and predict them with the ZeRO formulas;
# - shard the optimizer state over ranks, ZeRO-1 ({{task 5.2}});
# - shard everything, ZeRO-3: flat padded units gathered before forward, freed after it,
#   gathered again for backward, gradients reduce-scattered ({{task 5.3}});
# - apply FSDP2 per block on a 1-D and a 2-D `DeviceMesh`, with mixed precision
#   ({{task 5.4}});
# - clip sharded gradients by their global norm with one all-reduce of one number, and
#   accumulate micro-batches with one reduce-scatter per step ({{task 5.5}});
# - say what each scheme costs in communication, and why ZeRO-3 costs 1.5x DDP.
#
# Every class here is called from ranks started with `launch` (Lesson 00), so that the
# checks and the demos run on 2-4 real gloo ranks on your laptop.

# %% tags=["setup"]
import math
import time

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from kit import LaunchError, check, launch
from kit.lessons.models import TinyTransformer, token_batch
from kit.lessons.sharding import memory_calculator, plot_stage_bars, stage_bytes, stage_traffic
from kit.trace import launch_traced, plot_timeline, region, trace

# %% [markdown]
# ## 1. Where the memory of training goes
#
# For every parameter, training with Adam keeps:
#
# | what | fp32 training | mixed precision (bf16 compute) |
# | --- | --- | --- |
# | parameter | 4 bytes | 2 (bf16 copy used in forward and backward) |
# | gradient | 4 | 2 |
# | optimizer state | 8 (Adam's two moments) | 12 (fp32 master weight + two moments) |
# | **total** | **16** | **16** |
#
# Mixed precision does not save state memory; it saves activation memory and time. The
# [ZeRO paper](https://arxiv.org/abs/1910.02054) (Rajbhandari et al., 2020) writes the
# optimizer state as $K\Psi$ for $\Psi$ parameters ($K = 12$ with mixed-precision Adam)
# and shards the three kinds over the $N_d$ data-parallel ranks in three stages:
#
# | stage | sharded | bytes per rank (mixed precision) |
# | --- | --- | --- |
# | DDP | nothing | $(2 + 2 + K)\Psi$ |
# | ZeRO-1 | optimizer state | $(2 + 2)\Psi + K\Psi / N_d$ |
# | ZeRO-2 | + gradients | $2\Psi + (2 + K)\Psi / N_d$ |
# | ZeRO-3 (FSDP) | + parameters | $(2 + 2 + K)\Psi / N_d$ |
#
# Activations are in none of these rows. They belong to the batch, not the model: each rank
# already computes only its own slice of the batch, so there is nothing redundant to shard.
# Activation checkpointing (Lesson 07) and sequence parallelism (Lesson 08) attack them.
#
# Move the sliders: a 7B model on 8 ranks, or a 70B one on 1024.

# %%
memory_calculator()

# %% [markdown]
# For the notebook's own small transformer the same formulas give (fp32, 4 ranks):

# %%
def untied(model):
    """Give the output layer its own weight: our FSDP shards units that share nothing."""
    model.head.weight = nn.Parameter(model.tok.weight.detach().clone())
    return model


def small_model(seed=0):
    torch.manual_seed(seed)
    return untied(TinyTransformer(vocab=256, dim=64, layers=4, heads=4, context=32))


n_params = sum(p.numel() for p in small_model().parameters())
print(f"{n_params:,} parameters")
for stage in range(4):
    per_rank = stage_bytes(n_params, 4, stage)
    print(f"stage {stage}: " + ", ".join(f"{k} {v / 2**10:7.1f} KiB" for k, v in per_rank.items()))

# %% [markdown]
# ### Task 5.1: `state_bytes`
#
# To check those numbers on real ranks you need a meter. Write `state_bytes(module,
# optimizer=None)`: the bytes of parameters, gradients and optimizer state this rank holds.
# Three details make it a meter of memory, not of tensors:
#
# - **Storages, not tensors.** Two tensors can share memory: a tied weight is one `Parameter`
#   reached twice, and FSDP-style code keeps parameters as *views* of one flat buffer.
#   `t.untyped_storage()` is the memory behind `t`; count each storage once (its
#   `data_ptr()` is a fine key), with all its `nbytes()`, padding included.
# - **DTensors.** FSDP2's parameters are `DTensor`s: `p.shape` is the global shape, while the
#   rank holds only `p.to_local()`. Count the local shard.
# - **Wrapped optimizers.** torch's `ZeroRedundancyOptimizer` keeps its state in the local
#   optimizer it wraps, `optimizer.optim`; count that too.

# %% tags=["task-5.1"]
def state_bytes(module: nn.Module,
                optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of training state this rank holds: {"params", "grads", "optimizer"}.

    - "params": the module's parameters; "grads": their .grad tensors (None counts 0);
      "optimizer": every tensor in optimizer.state (and in optimizer.optim.state when the
      optimizer wraps a local one, as torch's ZeroRedundancyOptimizer does); 0 without one.
    - Count memory, not tensors: each storage once, with all its bytes
      (t.untyped_storage().nbytes()), so tied weights and views of one buffer count once.
    - A DTensor counts only the local shard this rank holds (dtensor.to_local()).
    """
    ### BEGIN SOLUTION
    def held(tensors) -> int:
        seen, total = set(), 0
        for t in tensors:
            if isinstance(t, DTensor):
                t = t.to_local()
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    def optimizer_tensors(opt):
        for o in (opt, getattr(opt, "optim", None)):
            if o is None:
                continue
            for state in o.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    with torch.no_grad():
        params = list(module.parameters())
        return {
            "params": held(params),
            "grads": held(p.grad for p in params if p.grad is not None),
            "optimizer": held(optimizer_tensors(optimizer)) if optimizer is not None else 0,
        }
    ### END SOLUTION


# %% tags=["check-5.1"]
check("5.1", state_bytes)


# %% [markdown]
# ## 2. ZeRO-1: shard the optimizer state
#
# Data parallelism runs the same optimizer step on every rank, on the same averaged
# gradients, with the same state: W copies of the same work. ZeRO-1 gives each parameter an
# **owner**. Only the owner keeps that parameter's Adam moments and steps it; afterwards it
# sends the new values to everyone:
#
# 1. every rank computes gradients on its own slice of the batch, as in DDP;
# 2. each gradient is **reduced to its owner** (`dist.reduce(p.grad, dst=owner)`) and
#    divided by the world size there: only the owner needs the average;
# 3. the owner steps its parameters with an ordinary torch optimizer built over them alone;
# 4. each owner **broadcasts** its updated parameters (`dist.broadcast(p, src=owner)`).
#
# Every collective call pays a latency (Lesson 01's $\alpha$), so send one flat buffer per
# owner (`torch.cat` of its tensors, split back afterwards) rather than one call per
# parameter: $2W$ calls per step instead of two per parameter, as DDP's buckets do.
#
# Balance matters: the rank owning the most elements sets the memory. Assign parameters
# largest first, each to the rank that owns the fewest elements so far (the greedy rule
# torch's `ZeroRedundancyOptimizer` uses); no rank then holds more than $1/W$ of the
# elements plus one largest parameter.
#
# ### Task 5.2: `ShardedOptimizer`
#
# Write `ShardedOptimizer(params, optimizer_cls, **kwargs)`, a `torch.optim.Optimizer`. The
# base class's `__init__` calls `self.add_param_group` for every group, so assigning owners
# there also covers groups added later. Keep the owner's state in `self.state` (the state of
# the local optimizer you build over the owned parameters), so that `state_bytes` sees it.
# The hyperparameters live in `self.param_groups`: a learning-rate scheduler changes them
# there, so copy them to the local optimizer's groups before each step.

# %% tags=["task-5.2"]
class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1: every parameter is stepped by one owner rank, which alone keeps its state.

    Each rank's .grad holds its own (local) gradient. step() averages every gradient onto
    its owner (dist.reduce, then divide by the world size), the owner steps its parameters
    with optimizer_cls, and every owner broadcasts its updated parameters to all ranks.
    Collectives are slow per call: send one flat buffer per owner rather than one per
    parameter (torch.cat of the tensors, then split back).

    - Ownership: parameters are assigned group by group, largest first, each to the rank
      owning the fewest elements so far (ties: the lowest rank); every rank computes the
      same plan from the same parameters.
    - self.state holds the state of the parameters this rank owns, and nothing else.
    - param groups, add_param_group, zero_grad and step(closure=None) work as in any torch
      optimizer; hyperparameters changed in self.param_groups apply at the next step.

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        optimizer_cls: the optimizer each owner runs on its parameters (torch.optim.AdamW, ...).
        **kwargs: its hyperparameters (lr=..., weight_decay=...).
    """

    def __init__(self, params, optimizer_cls, **kwargs):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        ### BEGIN SOLUTION
        self.owner = {}  # parameter -> the rank that steps it
        self._elements = [0] * self.world_size  # elements owned by each rank so far
        self.optim = None  # the owner's optimizer, over this rank's parameters only
        super().__init__(params, kwargs)  # calls self.add_param_group for every group
        mine = [{**g, "params": [p for p in g["params"] if self.owner[p] == self.rank]}
                for g in self.param_groups]  # the same groups, with this rank's parameters
        self.optim = optimizer_cls(mine, **kwargs)
        self.state = self.optim.state  # this rank's state is the local optimizer's
        ### END SOLUTION

    def add_param_group(self, param_group: dict) -> None:
        """Add a group and assign an owner to each of its parameters."""
        ### BEGIN SOLUTION
        super().add_param_group(param_group)  # fills in the defaults, rejects duplicates
        group = self.param_groups[-1]
        for p in sorted(group["params"], key=lambda p: p.numel(), reverse=True):  # stable
            rank = min(range(self.world_size), key=lambda r: self._elements[r])
            self.owner[p] = rank
            self._elements[rank] += p.numel()
        if self.optim is not None:  # a group added after construction
            self.optim.add_param_group(
                {**group, "params": [p for p in group["params"] if self.owner[p] == self.rank]})
        ### END SOLUTION

    @torch.no_grad()
    def step(self, closure=None):
        """Average the gradients onto their owners, step the owned ones, broadcast them."""
        ### BEGIN SOLUTION
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # One flat buffer per owner: W reduces and W broadcasts per step, not two per parameter.
        params = [p for g in self.param_groups for p in g["params"]]
        by_owner = [[p for p in params if self.owner[p] == r] for r in range(self.world_size)]
        reduces = []
        for r, mine in enumerate(by_owner):
            with_grad = [p for p in mine if p.grad is not None]
            if with_grad:
                flat = torch.cat([p.grad.reshape(-1) for p in with_grad])  # (elements,)
                reduces.append((dist.reduce(flat, dst=r, async_op=True), r, with_grad, flat))
        for work, r, with_grad, flat in reduces:
            work.wait()
            if r == self.rank:  # the sum over ranks -> the mean, back into .grad
                for p, g in zip(with_grad,
                                (flat / self.world_size).split([p.numel() for p in with_grad])):
                    p.grad.copy_(g.view_as(p))
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})  # e.g. a new lr
        self.optim.step()
        broadcasts = []
        for r, mine in enumerate(by_owner):
            if mine:
                flat = torch.cat([p.detach().reshape(-1) for p in mine])
                broadcasts.append((dist.broadcast(flat, src=r, async_op=True), mine, flat))
        for work, mine, flat in broadcasts:
            work.wait()
            for p, new in zip(mine, flat.split([p.numel() for p in mine])):
                p.copy_(new.view_as(p))
        return loss
        ### END SOLUTION


# %% tags=["check-5.2"]
check("5.2", ShardedOptimizer)


# %% [markdown]
# ### What the traffic costs
#
# A reduce to one rank plus a broadcast from it moves each gradient's bytes about twice,
# like an all-reduce. Done for the whole flat gradient at once, the two halves are exactly
# a **reduce-scatter** (each rank receives the sum of its own slice) and an **all-gather**
# (each rank sends its updated slice to all), and a ring all-reduce *is* a reduce-scatter
# followed by an all-gather (Lesson 01). So ZeRO-1 and ZeRO-2 cost what DDP costs:
# $2\,\frac{W-1}{W}\Psi$ bytes per rank and step. ZeRO-3 all-gathers the parameters twice
# (forward and backward) and reduce-scatters the gradients once: $3\,\frac{W-1}{W}\Psi$,
# 1.5 times DDP. Lesson 01's cost model turns bytes into time:

# %%
from kit.lessons.costmodel import ring_all_reduce_time  # noqa: E402

alpha, beta = 20e-6, 1 / 25e9  # a 25 GB/s link with 20 us latency per message
billions = 7e9
for stage in (0, 1, 3):
    seconds = stage_traffic(billions, 64, stage, bytes_per_param=2) * beta
    print(f"{['DDP', 'ZeRO-1/2', '', 'ZeRO-3'][stage]:9s} 7B bf16 on 64 ranks: "
          f"{stage_traffic(billions, 64, stage, 2) / 1e9:5.1f} GB sent per rank and step, "
          f"{seconds:5.2f} s on the link")
print(f"check: one ring all-reduce of 14 GB on 64 ranks: "
      f"{ring_all_reduce_time(14e9, 64, alpha, beta):.2f} s")

# %% [markdown]
# torch ships ZeRO-1 as
# [`ZeroRedundancyOptimizer`](https://pytorch.org/docs/stable/distributed.optim.html#torch.distributed.optim.ZeroRedundancyOptimizer).
# It leaves the gradient averaging to DDP (a full all-reduce) and broadcasts each owner's
# parameters after its local step; `parameters_as_bucket_view=True` packs them into flat
# buckets first. The tracer shows both on 2 ranks:

# %%
def zero_traffic(which):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = small_model()
    x, y = token_batch(2, 32, 256, seed=dist.get_rank())
    if which == "torch":
        wrapped = DDP(model)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)
    else:
        wrapped, optimizer = model, ShardedOptimizer(model.parameters(), torch.optim.AdamW)
    with trace() as t:
        F.cross_entropy(wrapped(x).flatten(0, 1), y.flatten()).backward()
        optimizer.step()
    ops = {}
    for e in t.events:
        ops[e.op] = ops.get(e.op, 0) + e.nbytes
    return {op: f"{n / 2**10:.0f} KiB" for op, n in ops.items()}, state_bytes(model, optimizer)


for which in ("torch", "ours"):
    try:
        traffic, held = launch(zero_traffic, which, world_size=2)[0]
        print(f"{which:6s} traffic {traffic}; optimizer state on rank 0: "
              f"{held['optimizer'] / 2**10:.0f} KiB")
    except LaunchError as e:
        print(f"{which}: {e.failures[0].summary}")

# %% [markdown]
# ## 3. FSDP by hand: shard the parameters too
#
# ZeRO-3, which PyTorch calls **Fully Sharded Data Parallel**, keeps only $1/W$ of every
# parameter on each rank and rebuilds a layer's parameters just before they are needed:
#
# - The model is cut into **units** (here every `nn.Linear` and `nn.Embedding`). A unit's
#   parameters are flattened into one buffer, padded with zeros to a multiple of $W$ and
#   split into $W$ equal pieces; rank $r$ keeps piece $r$ as an fp32 `nn.Parameter`. Small
#   parameters of other modules (layer norms) stay replicated, DDP-style.
# - **Forward:** before a unit runs, **all-gather** its pieces into the full buffer (in the
#   compute dtype, e.g. bf16, to halve the bytes); set the parameters as views of it; run
#   the unit; **free** the buffer. At most one unit is whole at any time.
# - **Backward:** autograd needs the weights again (a linear layer's input gradient is
#   `grad_out @ W`), so **all-gather again** when the unit's backward starts. The unit's
#   gradient is a full buffer on every rank; **reduce-scatter** it, so that each rank gets
#   the sum of its own piece, and divide by $W$.
#
# Two PyTorch tools do the plumbing:
#
# - a custom [`torch.autograd.Function`](https://pytorch.org/docs/stable/notes/extending.html#extending-torch-autograd)
#   whose forward is the all-gather and whose backward is the reduce-scatter (the two are
#   each other's adjoint, like `broadcast` and `reduce`), so that autograd delivers the
#   shard's gradient into `shard.grad` by itself;
# - [`torch.autograd.graph.saved_tensors_hooks(pack, unpack)`](https://pytorch.org/docs/stable/autograd.html#hooks-for-saved-tensors):
#   while a unit runs, whatever autograd saves for backward goes through `pack`. For the
#   gathered weights, `pack` returns a small note instead of the tensor, so nothing holds
#   the buffer after forward; in backward, `unpack` turns the note back into a tensor, from
#   a fresh all-gather.
#
# Here is `saved_tensors_hooks` on its own: a linear layer saves its input and its weight.

# %%
seen = []
with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(tuple(t.shape)) or t,
                                              lambda t: t):
    layer = nn.Linear(4, 3)
    layer(torch.randn(5, 4, requires_grad=True)).sum().backward()
print("autograd saved tensors of shapes", seen)

# %% [markdown]
# The input `(5, 4)` and the weight, transposed, `(4, 3)`. In your `pack`, recognise the
# unit's own buffer by its storage (`t.untyped_storage().data_ptr()` is the gathered
# buffer's) and return `(size, stride, storage_offset)`; in `unpack`, gather again and
# rebuild the view with `full.as_strided(size, stride, offset)`.
#
# ### Task 5.3: `FSDP`
#
# The cell holds three classes: `GatherShards` (the autograd Function), `Unit` (one wrapped
# module: its shard and hooks) and `FSDP` (finds the units, averages the replicated
# gradients, rebuilds a full state dict). Fill in the bodies. Keep the shard on the unit
# module as `self.shard` (any registered name), so that `model.parameters()` yields it in
# place of the unit's parameters and any torch optimizer trains it. The unit's backward
# starts when the gradient of its output arrives: `output.register_hook(...)` in the forward
# hook is the place to start the second all-gather.

# %% tags=["task-5.3"]
class GatherShards(torch.autograd.Function):
    """Autograd's view of a unit's all-gather: shard (fp32) -> full flat buffer (padded,).

    forward(ctx, shard, unit) returns unit.gather(...) in the compute dtype; backward gets the
    gradient of the full buffer and returns the shard's gradient: the reduce-scatter.
    """

    @staticmethod
    def forward(ctx, shard, unit):
        ### BEGIN SOLUTION
        ctx.unit = unit
        return unit.gather(unit.compute_dtype)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad_full):
        ### BEGIN SOLUTION
        return ctx.unit.reduce_scatter(grad_full), None
        ### END SOLUTION


class Unit:
    """One wrapped submodule: its flat fp32 shard, and the hooks that gather and free it.

    Keep this rank's piece as self.shard (an nn.Parameter of padded / W elements, registered
    on self.module) and the padded length as self.padded.
    """

    def __init__(self, module: nn.Module, prefix: str, compute_dtype=None):
        self.module, self.prefix = module, prefix
        self.compute_dtype = compute_dtype or torch.float32
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.names = [n for n, _ in module.named_parameters(recurse=False)]
        originals = [getattr(module, n) for n in self.names]  # local: kept, they stay in memory
        self.shapes = [p.shape for p in originals]
        self.for_backward = None  # the buffer gathered again when backward reaches the unit
        ### BEGIN SOLUTION
        flat = torch.cat([p.detach().reshape(-1).float() for p in originals])  # (N,)
        self.padded = math.ceil(flat.numel() / self.world_size) * self.world_size
        flat = F.pad(flat, (0, self.padded - flat.numel()))  # (padded,) zeros at the end
        self.shard = nn.Parameter(flat.chunk(self.world_size)[self.rank].clone())  # (padded/W,)
        for n in self.names:
            del module._parameters[n]
        module.register_parameter("flat_shard", self.shard)
        self.storage = None  # data_ptr of the buffer gathered for this forward
        module.register_forward_pre_hook(self.before_forward)
        module.register_forward_hook(self.after_forward)
        ### END SOLUTION

    def gather(self, dtype) -> torch.Tensor:
        """All-gather the shards (cast to dtype): the full flat buffer, (padded,)."""
        ### BEGIN SOLUTION
        full = torch.empty(self.padded, dtype=dtype)
        dist.all_gather_single(full, self.shard.detach().to(dtype))
        return full
        ### END SOLUTION

    def views(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        """{name: the view of `full` holding that original parameter, in its shape}."""
        out, offset = {}, 0
        for name, shape in zip(self.names, self.shapes):
            out[name] = full[offset:offset + shape.numel()].view(shape)
            offset += shape.numel()
        return out

    def before_forward(self, module, args):
        """Forward pre-hook: gather the unit and set its parameters as views."""
        ### BEGIN SOLUTION
        full = GatherShards.apply(self.shard, self)  # (padded,), differentiable
        for name, view in self.views(full).items():
            setattr(module, name, view)  # a plain attribute: the Parameter is gone
        self.storage = full.untyped_storage().data_ptr()
        # What autograd saves from the unit's parameters becomes a note, not the tensor.
        self.saving = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.saving.__enter__()
        ### END SOLUTION

    def after_forward(self, module, args, output):
        """Forward hook: free the full parameters; arrange the gather for backward."""
        ### BEGIN SOLUTION
        self.saving.__exit__(None, None, None)
        for name in self.names:
            delattr(module, name)  # the last reference: the gathered buffer is freed
        if output.requires_grad:
            output.register_hook(self.before_backward)
        ### END SOLUTION

    def pack(self, t):
        """saved_tensors_hooks: what autograd keeps instead of the tensor t it saves."""
        ### BEGIN SOLUTION
        if t.untyped_storage().data_ptr() == self.storage:
            return ("unit parameter", t.size(), t.stride(), t.storage_offset())
        return t
        ### END SOLUTION

    def unpack(self, packed):
        """saved_tensors_hooks: the tensor backward uses, from what pack returned."""
        ### BEGIN SOLUTION
        if isinstance(packed, tuple):
            _, size, stride, offset = packed
            if self.for_backward is None:
                self.for_backward = self.gather(self.compute_dtype)
            return self.for_backward.as_strided(size, stride, offset)
        return packed
        ### END SOLUTION

    def before_backward(self, grad):
        """Hook on the unit's output: its backward starts, gather the unit again."""
        ### BEGIN SOLUTION
        if self.for_backward is None:
            self.for_backward = self.gather(self.compute_dtype)
        return grad
        ### END SOLUTION

    def reduce_scatter(self, grad_full: torch.Tensor) -> torch.Tensor:
        """The shard's gradient (padded/W,) fp32: the mean over ranks of grad_full's piece."""
        ### BEGIN SOLUTION
        self.for_backward = None  # the unit's backward is over: free its parameters
        grad = torch.empty_like(self.shard)
        dist.reduce_scatter_single(grad, grad_full.float().contiguous())  # sum over ranks
        return grad / self.world_size
        ### END SOLUTION


class FSDP(nn.Module):
    """ZeRO-3 by hand: each unit's parameters live as one flat fp32 shard per rank.

    - Units: every submodule that is an instance of a class in `wrap` (and has parameters of
      its own). Its own parameters (recurse=False) are flattened into one fp32 buffer of N
      elements, padded with zeros to a multiple of the world size W and split in W equal
      pieces; rank r keeps piece r as an nn.Parameter registered on the unit module in place
      of the originals (any name). Tied weights (one Parameter in two units) are not
      supported: raise ValueError.
    - Every other parameter is replicated; finish_gradient_synchronization() averages its
      gradient over ranks, as DDP does.
    - Forward: before a unit runs, all-gather its shards (cast to compute_dtype first when
      given) and set its parameters as views of the gathered buffer; after it ran, drop them,
      so that no full parameter of the unit stays in memory, not even inside autograd.
    - Backward: all-gather the unit again when its backward starts; its gradient (cast to
      fp32) is reduce-scattered and divided by W into the shard's .grad.
    - full_state_dict(): the full fp32 tensors, keyed by the original parameter names.

    Every rank passes the same initial weights (seed alike). The wrapped model is .module;
    its parameters() and this wrapper's are what this rank updates, so any optimizer works.
    """

    def __init__(self, module: nn.Module, wrap=(nn.Linear, nn.Embedding), compute_dtype=None):
        super().__init__()
        self.module = module
        self.compute_dtype = compute_dtype
        self.world_size = dist.get_world_size()
        self.units = []  # a Unit per wrapped submodule, in module order
        ### BEGIN SOLUTION
        seen = set()
        for prefix, m in module.named_modules():
            if isinstance(m, wrap) and any(True for _ in m.parameters(recurse=False)):
                mine = {id(p) for p in m.parameters(recurse=False)}
                if seen & mine:
                    raise ValueError(f"{prefix or 'the model'} shares a parameter with another "
                                     "unit: untie tied weights before wrapping")
                seen |= mine
                self.units.append(Unit(m, prefix, compute_dtype))
        shards = {id(u.shard) for u in self.units}
        self.replicated = [p for p in module.parameters() if id(p) not in shards]
        ### END SOLUTION

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Average the replicated parameters' gradients over ranks (units did it in backward)."""
        ### BEGIN SOLUTION
        for p in self.replicated:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= self.world_size
        ### END SOLUTION

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, full and fp32, under its original name (all ranks must call it)."""
        ### BEGIN SOLUTION
        shards = {id(u.shard) for u in self.units}
        state = {name: p.detach().clone() for name, p in self.module.named_parameters()
                 if id(p) not in shards}
        for u in self.units:
            for name, view in u.views(u.gather(torch.float32)).items():
                state[f"{u.prefix}.{name}" if u.prefix else name] = view.clone()
        return state
        ### END SOLUTION


# %% tags=["check-5.3"]
check("5.3", FSDP)


# %% [markdown]
# ### The timeline of one FSDP step, and prefetching
#
# Trace one step on 2 ranks: forward and backward as regions, every all-gather (green) and
# reduce-scatter (red) as the tracer saw it. Each of the 4 blocks has 4 units, plus the two
# embeddings and the output layer.

# %%
def fsdp_step(prefetch=False):
    model = small_model()
    fsdp = FSDP(model)
    if prefetch:
        enable_prefetch(fsdp)
    x, y = token_batch(4, 32, 256, seed=dist.get_rank())
    for _ in range(2):  # the first step warms up; trace the second
        with trace() as t:
            with region("forward"):
                loss = F.cross_entropy(fsdp(x).flatten(0, 1), y.flatten())
            with region("backward"):
                loss.backward()
                fsdp.finish_gradient_synchronization()
    return [e.to_dict() for e in t.events]


class PrefetchingUnit(Unit):
    """A Unit that, once gathered in forward, starts the next unit's all-gather at once."""

    next = None  # the unit that runs after this one in forward
    pending = None  # (work, buffer) of an all-gather the previous unit started for us

    def gather(self, dtype):
        if self.pending is not None:  # started while the previous unit computed
            work, full = self.pending
            self.pending = None
            work.wait()
            return full
        return super().gather(dtype)

    def prefetch_next(self, module, args):
        """Forward pre-hook, after the unit's own: start the next unit's all-gather."""
        nxt = self.next
        if nxt is not None:
            full = torch.empty(nxt.shard.numel() * dist.get_world_size(), dtype=nxt.compute_dtype)
            work = dist.all_gather_single(full, nxt.shard.detach().to(nxt.compute_dtype),
                                          async_op=True)
            nxt.pending = (work, full)


def enable_prefetch(fsdp):
    """Turn every unit into a PrefetchingUnit, chained in forward order (the model's order)."""
    for unit, nxt in zip(fsdp.units, fsdp.units[1:] + [None]):
        unit.__class__ = PrefetchingUnit  # gather() now takes a prefetched buffer when there is one
        unit.next = nxt
        unit.module.register_forward_pre_hook(unit.prefetch_next)  # runs after the gather hook


try:
    from kit.trace import Event  # noqa: E402

    fig, axes = plt.subplots(2, 1, figsize=(10, 4), sharex=True)
    for ax, prefetch in zip(axes, (False, True)):
        events = launch(fsdp_step, prefetch, world_size=2)
        plot_timeline([[Event(**e) for e in lane] for lane in events], ax=ax, arrows=False,
                      title=f"FSDP, {'with' if prefetch else 'without'} prefetching")
        gathers = [e for e in events[0] if "all_gather" in e["op"]]
        forward = next(e for e in events[0] if e["op"] == "forward")
        print(f"prefetch={prefetch}: {len(gathers)} all-gathers, "
              f"{sum(e['async_op'] for e in gathers)} of them started ahead (async); "
              f"forward {1e3 * (forward['end'] - forward['start']):.1f} ms on rank 0")
    plt.tight_layout()
    plt.show()
except LaunchError as e:
    print("Task 5.3 first:", e.failures[0].summary)

# %% [markdown]
# Without prefetching, each unit waits for its own all-gather before it can compute: the
# green bars sit in the forward's critical path. With prefetching, unit $i+1$'s all-gather
# is in flight while unit $i$ computes, and by the time it is needed it has (often) arrived.
# On one laptop CPU the collectives and the matrix products share the same cores, so how
# much the forward gains varies from run to run (compare the two printed forward times); on
# GPUs NCCL runs on its own stream and prefetching hides most of the communication. The price
# is memory: two units are whole at once instead of one. On GPUs,
# torch's FSDP2 issues all-gathers on their own CUDA stream ahead of the compute that needs
# them, prefetches the next module in backward by default, and takes explicit plans through
# `module.set_modules_to_forward_prefetch([...])` and `set_modules_to_backward_prefetch`.

# %% [markdown]
# ## 4. The formulas against real ranks
#
# With your meter and your two sharded trainers, check the formulas of section 1. The cell
# below trains one step on 4 ranks three ways: torch DDP with AdamW, your `ShardedOptimizer`
# and your `FSDP`, then counts rank 0's bytes with your `state_bytes`. The triangles on the
# bars are the totals counted.

# %%
def one_step(kind, world_size=4):
    """Each rank: wrap the small model as `kind`, one AdamW step, this rank's state bytes."""
    rank = dist.get_rank()
    model = small_model()
    if kind == "DDP":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped, optimizer = DDP(model), torch.optim.AdamW(model.parameters())
    elif kind == "ZeRO-1":
        wrapped, optimizer = model, ShardedOptimizer(model.parameters(), torch.optim.AdamW)
    else:
        wrapped = FSDP(model)
        optimizer = torch.optim.AdamW(wrapped.parameters())
    x, y = token_batch(2, 32, 256, seed=rank)  # this rank's 2 sequences
    F.cross_entropy(wrapped(x).flatten(0, 1), y.flatten()).backward()
    getattr(wrapped, "finish_gradient_synchronization", lambda: None)()
    optimizer.step()
    return state_bytes(model, optimizer)


measured = {}
for stage, kind in [(0, "DDP"), (1, "ZeRO-1"), (3, "FSDP")]:
    try:
        measured[stage] = launch(one_step, kind, world_size=4)[0]  # rank 0
    except LaunchError as e:
        print(f"{kind}: not yet ({e.failures[0].summary})")
print(f"{'':8s}{'':10s}{'counted':>10s}{'formula':>10s}   (KiB on rank 0 of 4)")
for stage, got in measured.items():
    formula = stage_bytes(n_params, 4, stage)
    for kind in ("params", "grads", "optimizer"):
        print(f"{['DDP', 'ZeRO-1', '', 'FSDP'][stage]:8s}{kind:10s}{got[kind] / 2**10:10.1f}"
              f"{formula[kind] / 2**10:10.1f}")
plot_stage_bars(n_params, 4, measured=measured)
plt.show()

# %% [markdown]
# The counts sit within a few percent of the formulas, and the differences are worth
# reading. Adam keeps a 4-byte `step` counter per parameter tensor besides its two moments.
# ZeRO-1's owners hold whole parameters, so the state splits by parameter, not exactly in
# quarters. FSDP pads each unit to a multiple of the world size and keeps the layer norms
# replicated.

# %% [markdown]
# ## 5. FSDP2: `fully_shard` on a `DeviceMesh`
#
# PyTorch's current FSDP,
# [`torch.distributed.fsdp.fully_shard`](https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html)
# ("FSDP2"), does what your `FSDP` does, with three design changes:
#
# | | your `FSDP` / FSDP1 (`FullyShardedDataParallel`) | FSDP2 (`fully_shard`) |
# | --- | --- | --- |
# | sharding | one flat buffer per unit (FSDP1's `FlatParameter`), padded, split in $W$ | each parameter on its own, split on dim 0 |
# | what the rank holds | a 1-D shard with no name or shape of its own | a `DTensor` per parameter: global shape, `Shard(0)` placement, a local piece |
# | unit | each wrapped module | each module you call `fully_shard` on: a group of parameters gathered together |
# | optimizer | works on the flat shards | works on DTensors, so per-parameter state and checkpoints keep their names |
#
# Call `fully_shard` on each transformer block (each becomes one all-gather), then on the
# root, which takes the remaining parameters (embeddings, final norm, output layer). The
# parameters become [`DTensor`s](https://pytorch.org/docs/stable/distributed.tensor.html)
# on a [`DeviceMesh`](https://pytorch.org/tutorials/recipes/distributed_device_mesh.html):
# `init_device_mesh("cpu", (4,))` is the 4 ranks in a row. With mixed precision,
# `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)` gathers
# bf16 parameters for compute and reduce-scatters fp32 gradients, while the shards stay fp32.
#
# A 2-D mesh `init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))` gives
# **HSDP** (hybrid sharding): parameters are sharded within each group of 2 ranks (in
# practice: the GPUs of one node, on fast links) and replicated across the groups (across
# nodes), whose gradients are all-reduced as in DDP. Each parameter is then placed
# `(Replicate(), Shard(0))`.
#
# ### Task 5.4: `apply_fsdp2`

# %% tags=["task-5.4"]
def apply_fsdp2(model: nn.Module, mesh, param_dtype=None, reduce_dtype=None) -> nn.Module:
    """Shard `model` with FSDP2: fully_shard each block of model.blocks, then the root.

    With a 1-D mesh this is FSDP; with a 2-D ("replicate", "shard") mesh it is HSDP. When a
    dtype is given, pass MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...). Returns
    the model (sharded in place).
    """
    ### BEGIN SOLUTION
    options = {"mesh": mesh}
    if param_dtype is not None or reduce_dtype is not None:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype,
                                                    reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model
    ### END SOLUTION


# %% tags=["check-5.4"]
check("5.4", apply_fsdp2)

# %% [markdown]
# Look at what `apply_fsdp2` did on a 1-D and a 2-D mesh of 4 ranks:

# %%
def placements(mesh_shape):
    names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = apply_fsdp2(TinyTransformer(vocab=256, dim=64, layers=4, heads=4, context=32), mesh)
    w = model.blocks[0].qkv.weight
    return (f"rank {dist.get_rank()}: {type(w).__name__} {tuple(w.shape)} placed "
            f"{w.placements}, local piece {tuple(w.to_local().shape)}, "
            f"params {state_bytes(model)['params'] / 2**10:.0f} KiB")


for shape in [(4,), (2, 2)]:
    print(f"mesh {shape}:")
    for line in launch(placements, shape, world_size=4):
        print("  ", line)

# %% [markdown]
# ### The shards between steps: persistent ranks
#
# `%distributed start 2` starts 2 ranks that stay up, with their variables and process group,
# until `%distributed stop`; every `%%distributed` cell runs on them meanwhile (Lesson 04
# introduced them). Shard a model in one cell, then look at what each rank holds:

# %%
# %load_ext kit
# %distributed start 2

# %%
# %%distributed
torch.manual_seed(0)
model = apply_fsdp2(TinyTransformer(vocab=256, dim=64, layers=4, heads=4, context=32),
                    init_device_mesh("cpu", (world_size,)))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
w = model.blocks[0].qkv.weight
print(f"qkv.weight {type(w).__name__} {tuple(w.shape)} {w.placements}: this rank holds "
      f"{tuple(w.to_local().shape)}")

# %% [markdown]
# One training step on each rank's own batch. The gradient arrives already reduce-scattered,
# a DTensor with the weight's placement, and Adam's moments are created with the shard's
# shape: the optimizer state is sharded for free.

# %%
# %%distributed
x, y = token_batch(2, 32, 256, seed=rank)
F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
g = w.grad
print(f"grad {type(g).__name__} {g.placements}, local {tuple(g.to_local().shape)}")
optimizer.step()
optimizer.zero_grad()
m = optimizer.state[w]["exp_avg"]
print(f"Adam exp_avg {type(m).__name__} {m.placements}, local {tuple(m.to_local().shape)}")

# %% [markdown]
# `full_tensor()` all-gathers a DTensor into the whole tensor on every rank: what a
# checkpoint written for one process needs, and what you should not do every step.

# %%
# %%distributed
full = w.full_tensor()
print(f"full {tuple(full.shape)}; row block {rank} of it is this rank's shard: "
      f"{torch.equal(full.chunk(world_size)[rank], w.to_local())}")

# %%
# %distributed stop

# %% [markdown]
# ### `reshard_after_forward`
#
# `fully_shard(module, reshard_after_forward=True)` frees a block's gathered parameters after
# its forward and gathers them again for backward, as your `FSDP` does. `False` keeps them
# until backward: one all-gather fewer per block and step, for the memory of every block's
# full parameters between forward and backward (ZeRO-2's memory for the parameters). The
# default, `None`, means `True` for every module you shard except the root and `False` for
# the root: backward starts with the root's parameters (the output layer), so freeing them
# would only gather them again at once
# ([`fully_shard`](https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html)).
# Below, the blocks and the root get the same value. Count the all-gathers of one step:

# %%
def count_gathers(reshard):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = TinyTransformer(vocab=256, dim=64, layers=4, heads=4, context=32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    x, y = token_batch(2, 32, 256, seed=dist.get_rank())
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()  # warm-up step
    with trace() as t:
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    return {op: sum(e.op == op for e in t.events) for op in sorted({e.op for e in t.events})}


for reshard in (True, False):
    print(f"reshard_after_forward={reshard}: {launch(count_gathers, reshard, world_size=2)[0]}")

# %% [markdown]
# ### A model that does not fit on one rank: meta-device initialisation
#
# To shard a model too large for one rank, never build it whole. Create it on the **meta
# device** (shapes and dtypes, no memory), shard it, then allocate only the local shards
# with `to_empty` and initialise them
# ([FSDP2 notes](https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html)):

# %%
def build_on_meta(dim=512, layers=8):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = TinyTransformer(vocab=256, dim=dim, layers=layers, heads=8, context=64)
    full = sum(p.numel() * 4 for p in model.parameters())
    apply_fsdp2(model, mesh)
    model.to_empty(device="cpu")  # allocates the local shards only
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()  # Linear, Embedding, LayerNorm init their own shards
    x, _ = token_batch(1, 8, 256, seed=0)
    return full, state_bytes(model)["params"], tuple(model(x).shape)


full, held, shape = launch(build_on_meta, world_size=4)[0]
print(f"the model: {full / 2**20:.0f} MiB of fp32 parameters; rank 0 holds "
      f"{held / 2**20:.0f} MiB, and its forward gives logits of shape {shape}")

# %% [markdown]
# (Initialising each shard by itself draws other random numbers than a model built whole
# would; real runs seed each rank's shard so that the result does not depend on $W$, or load
# a checkpoint, Lesson 06.)
#
# ## 6. Clipping and gradient accumulation on shards
#
# Two habits of every training loop change meaning once gradients are sharded.
#
# **Clipping by the global norm.** `torch.nn.utils.clip_grad_norm_` scales all gradients by
# `max_norm / (norm + 1e-6)` (capped at 1), where `norm` is the norm of *all* gradients
# together. Under FSDP2 each rank holds only a `Shard(0)` piece of each gradient, so no rank
# can compute that norm alone, and a norm per rank would clip each rank's piece differently.
# But a $p$-norm splits over pieces: $\|g\|_p^p = \sum_{\text{ranks}} \sum_{\text{local}} |g_i|^p$,
# and $\|g\|_\infty$ is the largest local maximum. Each rank reduces its pieces to **one
# number**; one all-reduce (a sum, or a max for $\infty$) gives every rank the same norm.
#
# ```
#   rank 0: |a0|^2 + |b0|^2 ─┐
#   rank 1: |a1|^2 + |b1|^2 ─┼─ all_reduce(SUM), 1 element ─> norm^2 on every rank
#   rank 2: |a2|^2 + ...    ─┘        each rank scales its own pieces by the same factor
# ```
#
# **Gradient accumulation.** A batch too big for memory runs as micro-batches, one forward
# and backward each, the gradients summed before one optimizer step. FSDP2 reduce-scatters
# the gradients in every backward, so $k$ micro-batches would cost $k$ reduce-scatters per
# unit. `model.set_requires_gradient_sync(False)` makes a backward keep its gradients
# unsharded and add them up instead; turned on again for the last micro-batch, one
# reduce-scatter sends the sum
# ([`set_requires_gradient_sync`](https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html)).
# The price is memory: until then every unit's full, unsharded gradient stays allocated
# (torch 2.13's `FSDPParamGroup.post_backward` keeps it as the parameter's
# `unsharded_accumulated_grad`).
#
# ### Task 5.5: `clip_grad_norm_` and `train_step`
#
# Write `clip_grad_norm_(model, max_norm, norm_type=2.0)` for a model sharded with FSDP2:
# the same norm and the same clipped gradients as torch's on the unsharded model, with one
# all-reduce of one element. Then `train_step(model, optimizer, micro_batches, loss_fn,
# max_norm)`: one step that accumulates over `micro_batches`, reduces once, clips with your
# `clip_grad_norm_`, steps and zeroes the gradients. The check compares both with torch on
# the unsharded model (float64, within $10^{-12}$), on 2 and 4 ranks, and reads the recorder.

# %% tags=["task-5.5"]
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip an FSDP2-sharded model's gradients in place by their global norm; return the norm.

    The norm and the clipped gradients equal torch.nn.utils.clip_grad_norm_(model.parameters(),
    max_norm, norm_type) on the unsharded model: the norm of all gradients together; when it
    exceeds max_norm, every gradient is multiplied by max_norm / (norm + 1e-6).

    - Each gradient is a DTensor; this rank holds only its local shard (to_local()), which may
      be empty. Parameters whose grad is None take no part.
    - norm_type is 2, 1 or math.inf.
    - One all-reduce of one element in all. torch's clipping functions and gathering a gradient
      whole (full_tensor, redistribute) are off limits.

    Returns the norm as a 0-d tensor of the gradients' dtype, the same on every rank.
    """
    ### BEGIN SOLUTION
    shards = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
              for p in model.parameters() if p.grad is not None]
    dtype = shards[0].dtype if shards else torch.float32
    p = float(norm_type)
    local = torch.zeros((), dtype=dtype)  # neutral for a sum of powers and for a max of |g|
    for g in shards:
        if g.numel() == 0:
            continue  # an uneven split leaves some ranks an empty piece
        if p == math.inf:
            local = torch.maximum(local, g.abs().max())
        else:
            local = local + g.abs().pow(p).sum()
    dist.all_reduce(local, op=dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM)
    norm = local if p == math.inf else local.pow(1.0 / p)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in shards:
        g.mul_(scale)  # the local tensor is the DTensor's own storage
    return norm
    ### END SOLUTION


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches, loss_fn,
               max_norm: float) -> torch.Tensor:
    """One optimizer step over micro_batches, a list of (inputs, targets); returns the mean loss.

    - Equals one step on the concatenation of every rank's micro-batches (all of one size,
      loss_fn a mean): accumulate their gradients, then clip them with clip_grad_norm_
      (max_norm), step the optimizer and zero the gradients.
    - One forward and backward per micro-batch; FSDP2 reduce-scatters the gradients only in
      the last one's backward (model.set_requires_gradient_sync).

    Returns the mean of the micro-batch losses, a detached 0-d tensor.
    """
    ### BEGIN SOLUTION
    losses = []
    for i, (inputs, targets) in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)  # reduce on the last only
        loss = loss_fn(model(inputs), targets)
        (loss / len(micro_batches)).backward()  # the sum of the parts is the batch's mean
        losses.append(loss.detach())
    clip_grad_norm_(model, max_norm)
    optimizer.step()
    optimizer.zero_grad()
    return torch.stack(losses).mean()
    ### END SOLUTION


# %% tags=["check-5.5"]
check("5.5", clip_grad_norm_)

# %% [markdown]
# torch's own `clip_grad_norm_` accepts FSDP2's DTensor gradients too. Trace both on the
# same sharded model, and one `train_step` of 3 micro-batches:

# %%
def clip_and_accumulate():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = apply_fsdp2(TinyTransformer(vocab=256, dim=64, layers=4, heads=4, context=32), mesh)
    x, y = token_batch(2, 32, 256, seed=dist.get_rank())
    out = {}
    for name, clip in (("yours", lambda: clip_grad_norm_(model, 1.0)),
                       ("torch", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))):
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        with trace() as t:
            norm = clip()
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        out[name] = (round(norm.item(), 6), [(e.op, e.nbytes) for e in t.events])
        model.zero_grad()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    micro = [token_batch(2, 32, 256, seed=10 * dist.get_rank() + i) for i in range(3)]
    with trace() as t:
        train_step(model, optimizer, micro, lambda logits, target: F.cross_entropy(
            logits.flatten(0, 1), target.flatten()), max_norm=1.0)
    out["events"] = [e.to_dict() for e in t.events]
    return out


try:
    from kit.trace import Event  # noqa: E402

    runs = launch(clip_and_accumulate, world_size=2)
    for name in ("yours", "torch"):
        norm, ops = runs[0][name]
        print(f"{name}: norm {norm}, collectives {ops}")
    lanes = [[Event(**e) for e in run["events"]] for run in runs]
    print("train_step, rank 0:", {op: sum(e.op == op for e in lanes[0])
                                  for op in sorted({e.op for e in lanes[0]})})
    fig, ax = plt.subplots(figsize=(10, 2.5))
    plot_timeline(lanes, ax=ax, arrows=False, title="train_step: 3 micro-batches, one sync")
    plt.show()
except LaunchError as e:
    print("Task 5.5 first:", e.failures[0].summary)

# %% [markdown]
# Both norms agree. Yours sends one number; torch's stacks one partial norm per gradient into
# a DTensor and all-reduces that vector (one element per gradient). On torch 2.13 torch's
# `norm_type=inf` also raises on a rank whose piece of some gradient is empty (5 rows on 4
# ranks leave the last rank none): the check's model has such pieces. In `train_step` the
# all-gathers repeat for every micro-batch (each forward and backward needs the weights),
# the reduce-scatters come once per unit, in the last backward, and one all-reduce clips.
#
# ## Running at scale
#
# > The same functions run under `torchrun` with NCCL on GPUs. Use FSDP2 there:
# >
# > ```python
# > # torchrun --standalone --nproc_per_node=8 train.py
# > import os
# > import torch
# > import torch.distributed as dist
# > from torch.distributed.device_mesh import init_device_mesh
# > from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
# >
# > dist.init_process_group("nccl")
# > torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
# > mesh = init_device_mesh("cuda", (dist.get_world_size(),))
# > with torch.device("meta"):
# >     model = TinyTransformer(dim=4096, layers=32)
# > apply_fsdp2(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# > model.to_empty(device="cuda")
# > # ... initialise or load a checkpoint, then the usual loop with a DistributedSampler ...
# > dist.destroy_process_group()
# > ```
# >
# > - **HSDP across nodes:** `init_device_mesh("cuda", (nnodes, 8), mesh_dim_names=("replicate",
# >   "shard"))` shards within a node over NVLink and all-reduces across nodes; launch with
# >   `torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d
# >   --rdzv_endpoint=HOST:29500 train.py`.
# > - **CPU offload:** `fully_shard(..., offload_policy=CPUOffloadPolicy())` keeps the shards,
# >   gradients and optimizer step in CPU memory and copies parameters to the GPU per unit.
# > - **Prefetching** runs on separate CUDA streams, so all-gathers overlap compute for real;
# >   `module.set_modules_to_forward_prefetch([...])` prefetches named modules ahead.
# > - ZeRO-3 costs 1.5x DDP's traffic: on slow inter-node links prefer HSDP, or
# >   `reshard_after_forward=False` for the last blocks.
# > - **Clipping and accumulation:** `clip_grad_norm_` and `train_step` run unchanged under
# >   NCCL. The norm's all-reduce is one element; each reduce-scatter that
# >   `set_requires_gradient_sync(False)` skips moves $\frac{W-1}{W}$ of the gradients. With
# >   HSDP the same call also skips the all-reduce across replicas.
#
# ## Summary
#
# - Adam training holds 16 bytes per parameter (params, grads, two moments; mixed precision
#   trades 4 bytes of parameter and gradient for a 4-byte master copy). DDP holds it on every
#   rank; ZeRO-1/2/3 shard the optimizer state, then the gradients, then the parameters.
#   Activations are in none of them.
# - Count memory by storages, once each, and a DTensor by its local piece (`state_bytes`).
# - ZeRO-1: an owner per parameter, balanced by elements; reduce gradients to owners, step
#   there, broadcast back. Same traffic as DDP.
# - FSDP: flat padded units, all-gathered before forward, freed after it, gathered again for
#   backward, gradients reduce-scattered: 1.5x DDP's traffic for 1/W of the memory.
#   `saved_tensors_hooks` keep autograd from holding the gathered weights.
# - FSDP2: `fully_shard` per block, then the root; DTensor parameters `Shard(0)` on a
#   `DeviceMesh`; HSDP on a 2-D mesh; `MixedPrecisionPolicy`; `reshard_after_forward`;
#   meta-device initialisation for models that do not fit.
# - Clipping by the global norm: each rank reduces its shards to one number, one all-reduce
#   (sum of powers, or max) combines them. Accumulation: `set_requires_gradient_sync(False)`
#   for all micro-batches but the last, so each unit reduce-scatters once per step.
#
# **Read more:** [FSDP2 `fully_shard`](https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html),
# [Getting started with FSDP2](https://pytorch.org/tutorials/intermediate/FSDP_tutorial.html),
# [`ZeroRedundancyOptimizer`](https://pytorch.org/docs/stable/distributed.optim.html),
# [DTensor](https://pytorch.org/docs/stable/distributed.tensor.html),
# [DeviceMesh](https://pytorch.org/tutorials/recipes/distributed_device_mesh.html), the ZeRO
# paper (Rajbhandari et al., SC 2020) and *PyTorch FSDP: Experiences on Scaling Fully
# Sharded Data Parallel* (Zhao et al., VLDB 2023).
#
# ## Exercises (not graded)
#
# 1. Turn `ShardedOptimizer` into ZeRO-2: after reducing a gradient to its owner, free it
#    (`p.grad = None`) on the other ranks. Check the gradient bytes with `state_bytes`.
# 2. Replace the per-parameter reduce and broadcast of `ShardedOptimizer` by one
#    `reduce_scatter_single` and one `all_gather_single` of flat buffers (pad to a
#    multiple of W). Compare the traced bytes with the cost model.
# 3. Make `FSDP` wrap whole transformer blocks (`wrap=(type(model.blocks[0]),)`) and compare
#    the number of all-gathers and the peak memory with per-layer units.
# 4. Give `PrefetchingUnit` a backward prefetch: when unit $i$'s backward starts, start
#    unit $i-1$'s all-gather.
# 5. Train with `apply_fsdp2(..., param_dtype=torch.bfloat16)` and with fp32 for 20 steps;
#    plot both loss curves.
