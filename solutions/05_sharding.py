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
# # Lesson 05 · Sharding training state: a ZeRO optimizer, FSDP from scratch, then FSDP2
#
# PROSE

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
from kit.models import TinyTransformer, token_batch
from kit.trace import launch_traced, plot_timeline, region, trace


# %% tags=["task-5.1"]
def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
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


# %% tags=["task-5.2"]
class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1: every parameter is stepped by one owner rank, which alone keeps its state.

    Each rank's .grad holds its own (local) gradient. step() averages every gradient onto
    its owner (dist.reduce, then divide by the world size), the owner steps its parameters
    with optimizer_cls, and every owner broadcasts its updated parameters to all ranks.

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
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        works = [dist.reduce(p.grad, dst=self.owner[p], async_op=True) for p in params]
        for p, work in zip(params, works):
            work.wait()
            if self.owner[p] == self.rank:
                p.grad /= self.world_size  # the sum over ranks -> the mean
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})  # e.g. a new lr
        self.optim.step()
        works = [dist.broadcast(p, src=self.owner[p], async_op=True)
                 for g in self.param_groups for p in g["params"]]
        for work in works:
            work.wait()
        return loss
        ### END SOLUTION


# %% tags=["check-5.2"]
check("5.2", ShardedOptimizer)


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
    """One wrapped submodule: its flat fp32 shard, and the hooks that gather and free it."""

    def __init__(self, module: nn.Module, prefix: str, compute_dtype=None):
        self.module, self.prefix = module, prefix
        self.compute_dtype = compute_dtype or torch.float32
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.names = [n for n, _ in module.named_parameters(recurse=False)]
        self.originals = [getattr(module, n) for n in self.names]
        self.shapes = [p.shape for p in self.originals]
        self.for_backward = None  # the buffer gathered again when backward reaches the unit
        ### BEGIN SOLUTION
        flat = torch.cat([p.detach().reshape(-1).float() for p in self.originals])  # (N,)
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
        dist.all_gather_into_tensor(full, self.shard.detach().to(dtype))
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
        dist.reduce_scatter_tensor(grad, grad_full.float().contiguous())  # sum over ranks
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
