"""Seeded bugs for Lesson 05: the typical mistakes each check of tasks 5.1-5.5 must catch.

``BUGS[task_id]`` lists ``(what is wrong, implementation)``; tests/test_checks.py proves every
one of them fails its task's checks. Each bug is a working implementation with one step
replaced, and a few simply wrap what the task re-implements (the hard gates).
"""

from __future__ import annotations

import math
import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

# --------------------------------------------------------------------------- task 5.1


def _storages(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _optimizer_tensors(optimizer, wrapped=True):
    owners = [optimizer, getattr(optimizer, "optim", None)] if wrapped else [optimizer]
    return [v for o in owners if o is not None for s in o.state.values() for v in s.values()
            if isinstance(v, torch.Tensor)]


def _bytes(params, optimizer, count=_storages, wrapped=True):
    return {"params": count(params), "grads": count(p.grad for p in params if p.grad is not None),
            "optimizer": count(_optimizer_tensors(optimizer, wrapped)) if optimizer else 0}


def state_bytes_counts_numel(module, optimizer=None):
    """numel * element_size per tensor: views of one padded buffer miss its padding."""
    def count(tensors):
        seen, total = set(), 0
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                t = t.to_local() if isinstance(t, DTensor) else t
                total += t.numel() * t.element_size()
        return total

    return _bytes(list(module.parameters()), optimizer, count)


def state_bytes_module_by_module(module, optimizer=None):
    """Walks module by module: the tied embedding/output weight counts twice."""
    params = [p for m in module.modules() for p in m.parameters(recurse=False)]

    def count(tensors):
        return sum(t.untyped_storage().nbytes() if not isinstance(t, DTensor)
                   else t.to_local().untyped_storage().nbytes() for t in tensors)

    return _bytes(params, optimizer, count)


def state_bytes_global_dtensor(module, optimizer=None):
    """A DTensor counted at its global size, as if every rank held all of it."""
    def count(tensors):
        seen, total = set(), 0
        for t in tensors:
            if isinstance(t, DTensor):
                total += t.numel() * t.element_size()
                continue
            s = t.untyped_storage()
            if s.nbytes() and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        return total

    return _bytes(list(module.parameters()), optimizer, count)


def state_bytes_ignores_wrapped_optimizer(module, optimizer=None):
    """Reads optimizer.state only: ZeroRedundancyOptimizer keeps its state in .optim."""
    return _bytes(list(module.parameters()), optimizer, wrapped=False)


# --------------------------------------------------------------------------- task 5.2


class _Sharded(torch.optim.Optimizer):
    """A correct ZeRO-1 with override points for the bugs."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.owner, self._elements, self.optim = {}, [0] * self.world_size, None
        super().__init__(params, kwargs)
        self.optim = optimizer_cls([self._mine(g) for g in self.param_groups], **kwargs)
        self.state = self.optim.state

    def _mine(self, group):
        return {**group, "params": [p for p in group["params"] if self._steps(p)]}

    def _steps(self, p):
        return self.owner[p] == self.rank

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in sorted(group["params"], key=lambda p: p.numel(), reverse=True):
            rank = min(range(self.world_size), key=lambda r: self._elements[r])
            self.owner[p] = rank
            self._elements[rank] += p.numel()
        if self.optim is not None:
            self.optim.add_param_group(self._mine(group))

    def _average(self, params):
        for p in params:
            dist.reduce(p.grad, dst=self.owner[p])
            if self.owner[p] == self.rank:
                p.grad /= self.world_size

    def _broadcast(self):
        for g in self.param_groups:
            for p in g["params"]:
                dist.broadcast(p, src=self.owner[p])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._average([p for g in self.param_groups for p in g["params"] if p.grad is not None])
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        self.optim.step()
        self._broadcast()
        return loss


class ShardedOptimizerSums(_Sharded):
    """Reduces the gradients to their owners but never divides by the world size."""

    def _average(self, params):
        for p in params:
            dist.reduce(p.grad, dst=self.owner[p])


class ShardedOptimizerStepsEverything(_Sharded):
    """Every rank all-reduces and steps every parameter: DDP, with W copies of the state."""

    def _steps(self, p):
        return True

    def _average(self, params):
        for p in params:
            dist.all_reduce(p.grad)
            p.grad /= self.world_size


class ShardedOptimizerKeepsAllState(ShardedOptimizerStepsEverything):
    """Every rank steps every parameter (its state for all of them stays in self.optim) but
    shows only the state of the parameters it owns in self.state: right values, W copies."""

    def step(self, closure=None):
        loss = super().step(closure)
        self.state = {p: s for p, s in self.optim.state.items() if self.owner[p] == self.rank}
        return loss


class ShardedOptimizerNoBroadcast(_Sharded):
    """Owners step their parameters but never send them: the other ranks fall behind."""

    def _broadcast(self):
        pass


class ShardedOptimizerLocalState(_Sharded):
    """Keeps the owner's state on the inner optimizer only; self.state stays empty."""

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        self.state = {}


def sharded_optimizer_wraps_zero(params, optimizer_cls, **kwargs):
    """torch's ZeroRedundancyOptimizer itself: no averaging, its state kept in .optim."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_cls, **kwargs)


# --------------------------------------------------------------------------- task 5.3


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, unit):
        ctx.unit = unit
        return unit.gather(unit.dtype)

    @staticmethod
    def backward(ctx, grad_full):
        return ctx.unit.reduce_scatter(grad_full), None


class _Unit:
    """A correct unit (see the solution) with override points."""

    keep_after_forward = False  # bug: the views stay attributes after forward
    save_full = False  # bug: autograd keeps the gathered parameters (no saved-tensor hooks)

    def __init__(self, module, prefix, dtype):
        self.module, self.prefix = module, prefix
        self.dtype = dtype or torch.float32
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.names = [n for n, _ in module.named_parameters(recurse=False)]
        originals = [getattr(module, n) for n in self.names]
        self.shapes = [p.shape for p in originals]
        flat = torch.cat([p.detach().reshape(-1).float() for p in originals])
        self.numel = flat.numel()
        self.shard = nn.Parameter(self.split(flat))
        for n in self.names:
            del module._parameters[n]
        module.register_parameter("flat_shard", self.shard)
        self.for_backward = None
        module.register_forward_pre_hook(self.before_forward)
        module.register_forward_hook(self.after_forward)

    def split(self, flat):
        padded = math.ceil(flat.numel() / self.world_size) * self.world_size
        return F.pad(flat, (0, padded - flat.numel())).chunk(self.world_size)[self.rank].clone()

    def gather(self, dtype):
        full = torch.empty(self.shard.numel() * self.world_size, dtype=dtype)
        dist.all_gather_single(full, self.shard.detach().to(dtype))
        return full

    def views(self, full):
        out, offset = {}, 0
        for name, shape in zip(self.names, self.shapes):
            out[name] = full[offset:offset + shape.numel()].view(shape)
            offset += shape.numel()
        return out

    def before_forward(self, module, args):
        full = _Gather.apply(self.shard, self)
        for name, view in self.views(full).items():
            setattr(module, name, view)
        self.storage = full.untyped_storage().data_ptr()
        if not self.save_full:
            self.saving = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self.saving.__enter__()

    def after_forward(self, module, args, output):
        if not self.save_full:
            self.saving.__exit__(None, None, None)
        if not self.keep_after_forward:
            for name in self.names:
                delattr(module, name)
        if output.requires_grad:
            output.register_hook(self.before_backward)

    def pack(self, t):
        if t.untyped_storage().data_ptr() == self.storage:
            return ("unit", t.size(), t.stride(), t.storage_offset())
        return t

    def unpack(self, packed):
        if isinstance(packed, tuple):
            if self.for_backward is None:
                self.for_backward = self.gather(self.dtype)
            return self.for_backward.as_strided(*packed[1:])
        return packed

    def before_backward(self, grad):
        if self.for_backward is None:
            self.for_backward = self.gather(self.dtype)
        return grad

    def reduce_scatter(self, grad_full):
        self.for_backward = None
        grad = torch.empty_like(self.shard)
        dist.reduce_scatter_single(grad, grad_full.float().contiguous())
        return grad / self.world_size


class _FSDP(nn.Module):
    unit = _Unit
    average_replicated = True

    def __init__(self, module, wrap=(nn.Linear, nn.Embedding), compute_dtype=None):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.units = [self.unit(m, prefix, compute_dtype) for prefix, m in module.named_modules()
                      if isinstance(m, wrap) and any(True for _ in m.parameters(recurse=False))]
        shards = {id(u.shard) for u in self.units}
        self.replicated = [p for p in module.parameters() if id(p) not in shards]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        if not self.average_replicated:
            return
        for p in self.replicated:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= self.world_size

    def full_state_dict(self):
        shards = {id(u.shard) for u in self.units}
        state = {n: p.detach().clone() for n, p in self.module.named_parameters()
                 if id(p) not in shards}
        for u in self.units:
            full = u.gather(torch.float32)
            for name, view in u.views(full).items():
                state[f"{u.prefix}.{name}" if u.prefix else name] = view.clone()
        return state


class _AllReduceUnit(_Unit):
    def reduce_scatter(self, grad_full):
        self.for_backward = None
        grad = grad_full.float().clone()
        dist.all_reduce(grad)  # every rank gets every gradient, then keeps its piece
        return grad.chunk(self.world_size)[self.rank] / self.world_size


class FSDPAllReducesGradients(_FSDP):
    """All-reduces each unit's full gradient and slices it: right values, W times the traffic."""

    unit = _AllReduceUnit


class _KeptUnit(_Unit):
    keep_after_forward = True
    save_full = True


class FSDPKeepsFullParameters(_FSDP):
    """Never frees the gathered parameters after forward (and so never gathers for backward)."""

    unit = _KeptUnit


class _KeptBufferUnit(_Unit):
    def before_forward(self, module, args):
        super().before_forward(module, args)
        self.gathered = getattr(module, self.names[0])._base  # "for later": the whole buffer


class FSDPKeepsGatheredBuffer(_FSDP):
    """Frees the views and saves notes, but each unit keeps a reference to its gathered buffer."""

    unit = _KeptBufferUnit


class _OriginalsUnit(_Unit):
    def __init__(self, module, prefix, dtype):
        self.originals = [getattr(module, n) for n, _ in module.named_parameters(recurse=False)]
        super().__init__(module, prefix, dtype)


class FSDPKeepsOriginalParameters(_FSDP):
    """Registers only the shards, but each unit keeps the original full parameters alive."""

    unit = _OriginalsUnit


class _SavedUnit(_Unit):
    save_full = True


class FSDPLetsAutogradKeepThem(_FSDP):
    """Deletes the attributes, but autograd still holds the gathered weights for backward."""

    unit = _SavedUnit


class _FloorUnit(_Unit):
    def split(self, flat):
        size = flat.numel() // self.world_size  # the tail of a size W does not divide is lost
        return flat[self.rank * size:(self.rank + 1) * size].clone()

    def views(self, full):
        full = F.pad(full, (0, max(0, self.numel - full.numel())))
        return super().views(full)


class FSDPDropsTheRemainder(_FSDP):
    """Splits numel // W elements per rank: a unit W does not divide loses its last elements."""

    unit = _FloorUnit


class FSDPReplicatedNotAveraged(_FSDP):
    """Forgets the replicated parameters: every rank's layer norms drift apart."""

    average_replicated = False


class _BF16ReduceUnit(_Unit):
    def reduce_scatter(self, grad_full):
        self.for_backward = None
        grad = torch.empty(self.shard.numel(), dtype=grad_full.dtype)
        dist.reduce_scatter_single(grad, grad_full.contiguous())  # in the compute dtype
        return grad.float() / self.world_size


class FSDPReducesInComputeDtype(_FSDP):
    """Reduce-scatters the gradients in bf16/fp16 instead of fp32."""

    unit = _BF16ReduceUnit


class FSDPWrapsFullyShard(nn.Module):
    """torch's FSDP2 on every unit and the root: the gate, and the wrong traffic."""

    def __init__(self, module, wrap=(nn.Linear, nn.Embedding), compute_dtype=None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        super().__init__()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        for m in module.modules():
            if isinstance(m, wrap):
                fully_shard(m, mesh=mesh, mp_policy=policy)
        fully_shard(module, mesh=mesh, mp_policy=policy)
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        pass

    def full_state_dict(self):
        return {n: p.full_tensor().detach().clone() for n, p in self.module.named_parameters()}


class FSDPWrapsDDP(nn.Module):
    """torch's DDP: right values, but every rank holds every parameter."""

    def __init__(self, module, wrap=(nn.Linear, nn.Embedding), compute_dtype=None):
        from torch.nn.parallel import DistributedDataParallel

        super().__init__()
        self.module = module
        self.ddp = DistributedDataParallel(module)

    def forward(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)

    def finish_gradient_synchronization(self):
        pass

    def full_state_dict(self):
        return {n: p.detach().clone() for n, p in self.module.named_parameters()}


# --------------------------------------------------------------------------- task 5.4


def apply_fsdp2_root_unsharded(model, mesh, param_dtype=None, reduce_dtype=None):
    """Shards the blocks only: embeddings, final norm and output layer stay whole everywhere."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return model


def apply_fsdp2_ignores_dtypes(model, mesh, param_dtype=None, reduce_dtype=None):
    """Never passes a MixedPrecisionPolicy: bf16 was asked for, fp32 runs."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def apply_fsdp2_root_only(model, mesh, param_dtype=None, reduce_dtype=None):
    """One fully_shard on the root: right values, but the whole model is gathered at once."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype,
                                                                  reduce_dtype=reduce_dtype))
    return model


def apply_fsdp2_flattens_the_mesh(model, mesh, param_dtype=None, reduce_dtype=None):
    """Shards over every rank of a 2-D mesh: FSDP where HSDP was asked for."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    flat = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=flat, mp_policy=policy)
    fully_shard(model, mesh=flat, mp_policy=policy)
    return model


def apply_fsdp2_keeps_blocks_gathered(model, mesh, param_dtype=None, reduce_dtype=None):
    """reshard_after_forward=False on every block: right values, every block whole until backward."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def apply_fsdp2_borrows_lesson06(model, mesh, param_dtype=None, reduce_dtype=None):
    from kit.lessons.resume import (
        shard_model,  # Lesson 06's helper: the same wrapping, without the mesh
    )

    return shard_model(model)


# --------------------------------------------------------------------------- task 5.5


def _local_shards(model):
    return [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for p in model.parameters() if p.grad is not None]


def _local_power(shards, p):
    """This rank's sum of |g|^p (p finite) or max |g| (p inf), 0 when it holds nothing."""
    local = torch.zeros((), dtype=shards[0].dtype if shards else torch.float64)
    for g in shards:
        if g.numel():
            local = torch.maximum(local, g.abs().max()) if p == math.inf else local + g.abs().pow(p).sum()
    return local


def _scale(shards, norm, max_norm, cap=True):
    scale = max_norm / (norm + 1e-6)
    scale = torch.clamp(scale, max=1.0) if cap else scale
    for g in shards:
        g.mul_(scale)
    return norm


def _global_norm(shards, p):
    local = _local_power(shards, p)
    dist.all_reduce(local, op=dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM)
    return local if p == math.inf else local.pow(1.0 / p)


def clip_correct(model, max_norm, norm_type=2.0):
    shards = _local_shards(model)
    return _scale(shards, _global_norm(shards, float(norm_type)), max_norm)


def clip_local_norm(model, max_norm, norm_type=2.0):
    """Each rank clips by the norm of its own shards: no rank sees the global norm."""
    shards, p = _local_shards(model), float(norm_type)
    local = _local_power(shards, p)
    return _scale(shards, local if p == math.inf else local.pow(1.0 / p), max_norm)


def clip_before_the_reduction(model, max_norm, norm_type=2.0):
    """Clips each rank's shards by their local norm, then reduces the norm it returns."""
    shards, p = _local_shards(model), float(norm_type)
    local = _local_power(shards, p)
    _scale(shards, local if p == math.inf else local.pow(1.0 / p), max_norm)
    dist.all_reduce(local, op=dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM)
    return local if p == math.inf else local.pow(1.0 / p)


def clip_all_reduce_per_parameter(model, max_norm, norm_type=2.0):
    """Right values, but one all-reduce for every parameter's partial norm."""
    shards, p = _local_shards(model), float(norm_type)
    parts = [_local_power([g], p) for g in shards]
    for part in parts:
        dist.all_reduce(part, op=dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM)
    total = torch.stack(parts).max() if p == math.inf else torch.stack(parts).sum().pow(1.0 / p)
    return _scale(shards, total, max_norm)


def clip_all_reduce_a_vector(model, max_norm, norm_type=2.0):
    """One all-reduce, as torch's own does: a vector of every parameter's partial norm."""
    shards, p = _local_shards(model), float(norm_type)
    parts = torch.stack([_local_power([g], p) for g in shards])
    dist.all_reduce(parts, op=dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM)
    total = parts.max() if p == math.inf else parts.sum().pow(1.0 / p)
    return _scale(shards, total, max_norm)


def clip_all_gather_the_sums(model, max_norm, norm_type=2.0):
    """All-gathers the ranks' local numbers and combines them on every rank: W elements, not one."""
    shards, p = _local_shards(model), float(norm_type)
    local = _local_power(shards, p)
    gathered = torch.empty(dist.get_world_size(), dtype=local.dtype)
    dist.all_gather_into_tensor(gathered, local.reshape(1))
    total = gathered.max() if p == math.inf else gathered.sum().pow(1.0 / p)
    return _scale(shards, total, max_norm)


def clip_sums_the_maxima(model, max_norm, norm_type=2.0):
    """The inf norm's local maxima added up over ranks instead of their maximum."""
    shards, p = _local_shards(model), float(norm_type)
    local = _local_power(shards, p)
    dist.all_reduce(local)
    return _scale(shards, local if p == math.inf else local.pow(1.0 / p), max_norm)


def clip_every_norm_as_2(model, max_norm, norm_type=2.0):
    """Ignores norm_type: always the 2-norm."""
    shards = _local_shards(model)
    return _scale(shards, _global_norm(shards, 2.0), max_norm)


def clip_scales_up(model, max_norm, norm_type=2.0):
    """No cap at 1: a small norm scales the gradients up to max_norm."""
    shards = _local_shards(model)
    return _scale(shards, _global_norm(shards, float(norm_type)), max_norm, cap=False)


def clip_max_of_every_shard(model, max_norm, norm_type=2.0):
    """Takes each shard's max, empty ones too: a rank with an empty piece raises."""
    shards, p = _local_shards(model), float(norm_type)
    if p == math.inf:
        local = torch.stack([g.abs().max() for g in shards]).max()
    else:
        local = sum(g.abs().pow(p).sum() for g in shards)
    dist.all_reduce(local, op=dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM)
    return _scale(shards, local if p == math.inf else local.pow(1.0 / p), max_norm)


def clip_gathers_full_gradients(model, max_norm, norm_type=2.0):
    """Gathers every gradient whole and clips the full copies' norm: W times the traffic."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    full = [g.full_tensor() for g in grads]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in full]),
                                    norm_type)
    return _scale(_local_shards(model), norm, max_norm)


def clip_wraps_torch(model, max_norm, norm_type=2.0):
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


clip_grad_norm_ = clip_correct  # what the train_step bugs call; _pair rebinds it per pair


def step_correct(model, optimizer, micro_batches, loss_fn, max_norm):
    losses = []
    for i, (x, y) in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        loss = loss_fn(model(x), y)
        (loss / len(micro_batches)).backward()
        losses.append(loss.detach())
    clip_grad_norm_(model, max_norm)
    optimizer.step()
    optimizer.zero_grad()
    return torch.stack(losses).mean()


def step_syncs_every_micro_batch(model, optimizer, micro_batches, loss_fn, max_norm):
    """Never turns gradient sync off: a reduce-scatter per unit in every micro-batch."""
    losses = []
    for x, y in micro_batches:
        loss = loss_fn(model(x), y)
        (loss / len(micro_batches)).backward()
        losses.append(loss.detach())
    clip_grad_norm_(model, max_norm)
    optimizer.step()
    optimizer.zero_grad()
    return torch.stack(losses).mean()


def step_never_syncs(model, optimizer, micro_batches, loss_fn, max_norm):
    """Turns gradient sync off and never on again: nothing is reduced."""
    model.set_requires_gradient_sync(False)
    losses = []
    for x, y in micro_batches:
        loss = loss_fn(model(x), y)
        (loss / len(micro_batches)).backward()
        losses.append(loss.detach())
    clip_grad_norm_(model, max_norm)
    optimizer.step()
    optimizer.zero_grad()
    return torch.stack(losses).mean()


def step_sums_the_losses(model, optimizer, micro_batches, loss_fn, max_norm):
    """Backward of each micro-batch's mean loss undivided: the gradient of k times the batch loss."""
    losses = []
    for i, (x, y) in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.detach())
    clip_grad_norm_(model, max_norm)
    optimizer.step()
    optimizer.zero_grad()
    return torch.stack(losses).mean()


def step_returns_the_last_loss(model, optimizer, micro_batches, loss_fn, max_norm):
    loss = None
    for i, (x, y) in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        loss = loss_fn(model(x), y)
        (loss / len(micro_batches)).backward()
    clip_grad_norm_(model, max_norm)
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def step_keeps_the_gradients(model, optimizer, micro_batches, loss_fn, max_norm):
    """No zero_grad: the next step adds its gradients to this one's."""
    losses = []
    for i, (x, y) in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        loss = loss_fn(model(x), y)
        (loss / len(micro_batches)).backward()
        losses.append(loss.detach())
    clip_grad_norm_(model, max_norm)
    optimizer.step()
    return torch.stack(losses).mean()


def step_one_big_batch(model, optimizer, micro_batches, loss_fn, max_norm):
    """Right values and one reduce-scatter: but one forward on the whole batch, no accumulation."""
    x = torch.cat([x for x, _ in micro_batches])
    y = torch.cat([y for _, y in micro_batches])
    loss = loss_fn(model(x), y)
    loss.backward()
    clip_grad_norm_(model, max_norm)
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def step_one_backward(model, optimizer, micro_batches, loss_fn, max_norm):
    """Right values and one reduce-scatter: every forward first, then one backward of the sum,
    so every micro-batch's activations are alive at once."""
    losses = [loss_fn(model(x), y) for x, y in micro_batches]
    (sum(losses) / len(losses)).backward()
    clip_grad_norm_(model, max_norm)
    optimizer.step()
    optimizer.zero_grad()
    return torch.stack([loss.detach() for loss in losses]).mean()


def step_clips_after_the_step(model, optimizer, micro_batches, loss_fn, max_norm):
    """Steps on the unclipped gradients, then clips them (too late)."""
    losses = []
    for i, (x, y) in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        loss = loss_fn(model(x), y)
        (loss / len(micro_batches)).backward()
        losses.append(loss.detach())
    optimizer.step()
    clip_grad_norm_(model, max_norm)
    optimizer.zero_grad()
    return torch.stack(losses).mean()


def _pair(clip, step=step_correct):
    """A clip_grad_norm_ whose train_step is ``step``, each calling the other by its task name
    (the check finds the companion in the clip function's globals)."""
    names = dict(globals())
    clip = types.FunctionType(clip.__code__, names, "clip_grad_norm_", clip.__defaults__)
    names["clip_grad_norm_"] = clip
    names["train_step"] = types.FunctionType(step.__code__, names, "train_step", step.__defaults__)
    return clip


BUGS = {
    "5.1": [
        ("counts numel * element_size per tensor, not storages", state_bytes_counts_numel),
        ("walks module by module: a tied weight counts twice", state_bytes_module_by_module),
        ("counts a DTensor at its global size", state_bytes_global_dtensor),
        ("ignores the state ZeroRedundancyOptimizer keeps in .optim",
         state_bytes_ignores_wrapped_optimizer),
    ],
    "5.2": [
        ("sums the gradients instead of averaging them", ShardedOptimizerSums),
        ("every rank steps every parameter", ShardedOptimizerStepsEverything),
        ("skips the broadcast after the step", ShardedOptimizerNoBroadcast),
        ("keeps the state off self.state", ShardedOptimizerLocalState),
        ("keeps every parameter's state on every rank, shows only its own in self.state",
         ShardedOptimizerKeepsAllState),
        ("wraps torch's ZeroRedundancyOptimizer", sharded_optimizer_wraps_zero),
    ],
    "5.3": [
        ("all-reduces the gradients instead of reduce-scattering", FSDPAllReducesGradients),
        ("keeps the full parameters after forward", FSDPKeepsFullParameters),
        ("deletes the attributes but lets autograd keep the full weights", FSDPLetsAutogradKeepThem),
        ("keeps a reference to each unit's gathered buffer after forward", FSDPKeepsGatheredBuffer),
        ("keeps the original full parameters after wrapping", FSDPKeepsOriginalParameters),
        ("drops the remainder when W does not divide a unit", FSDPDropsTheRemainder),
        ("does not average the replicated parameters", FSDPReplicatedNotAveraged),
        ("reduce-scatters in the compute dtype", FSDPReducesInComputeDtype),
        ("wraps torch's fully_shard", FSDPWrapsFullyShard),
        ("wraps torch's DistributedDataParallel", FSDPWrapsDDP),
    ],
    "5.4": [
        ("leaves the root unsharded", apply_fsdp2_root_unsharded),
        ("ignores param_dtype and reduce_dtype", apply_fsdp2_ignores_dtypes),
        ("wraps the root only, not each block", apply_fsdp2_root_only),
        ("shards over the whole 2-D mesh", apply_fsdp2_flattens_the_mesh),
        ("keeps every block gathered until backward (reshard_after_forward=False)",
         apply_fsdp2_keeps_blocks_gathered),
        ("calls Lesson 06's kit.lessons.resume.shard_model", apply_fsdp2_borrows_lesson06),
    ],
    "5.5": [
        ("a local norm per rank", _pair(clip_local_norm)),
        ("clips each rank's shards before the norm is reduced", _pair(clip_before_the_reduction)),
        ("one all-reduce per parameter", _pair(clip_all_reduce_per_parameter)),
        ("all-reduces a vector of per-parameter norms", _pair(clip_all_reduce_a_vector)),
        ("all-gathers the ranks' local sums", _pair(clip_all_gather_the_sums)),
        ("adds up the ranks' maxima for the inf norm", _pair(clip_sums_the_maxima)),
        ("ignores norm_type", _pair(clip_every_norm_as_2)),
        ("scales gradients up when the norm is below max_norm", _pair(clip_scales_up)),
        ("takes the max of every shard, empty ones too", _pair(clip_max_of_every_shard)),
        ("gathers every gradient whole (full_tensor)", _pair(clip_gathers_full_gradients)),
        ("wraps torch.nn.utils.clip_grad_norm_", _pair(clip_wraps_torch)),
        ("train_step: a reduce-scatter on every micro-step",
         _pair(clip_correct, step_syncs_every_micro_batch)),
        ("train_step: never turns gradient sync back on", _pair(clip_correct, step_never_syncs)),
        ("train_step: sums the micro-batch losses", _pair(clip_correct, step_sums_the_losses)),
        ("train_step: returns the last micro-batch's loss",
         _pair(clip_correct, step_returns_the_last_loss)),
        ("train_step: never zeroes the gradients", _pair(clip_correct, step_keeps_the_gradients)),
        ("train_step: one forward on the whole batch", _pair(clip_correct, step_one_big_batch)),
        ("train_step: every forward first, then one backward", _pair(clip_correct, step_one_backward)),
        ("train_step: clips after the optimizer step", _pair(clip_correct, step_clips_after_the_step)),
    ],
}
