"""Seeded bugs for Lesson 05: the typical mistakes each check of tasks 5.1-5.5 must catch.

``BUGS[task_id]`` lists ``(what is wrong, implementation)``; tests/test_checks.py proves every
one of them fails its task's checks. Each bug is the solution with one step changed
(edited_solution), and a few simply wrap what the task re-implements (the hard gates).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from bugs import edited_solution


def _bug(name: str, *edits: tuple[str, str]):
    """The solution's ``name`` with each (old, new) edit made."""
    return getattr(edited_solution(5, *edits), name)


# --------------------------------------------------------------------------- task 5.1

_DISTINCT = ("            storage = t.untyped_storage()\n"
             "            if storage.nbytes() and storage.data_ptr() not in seen:\n")

state_bytes_counts_numel = _bug(  # views of one padded buffer miss its padding
    "state_bytes", (_DISTINCT + "                seen.add(storage.data_ptr())\n"
                    "                total += storage.nbytes()\n",
                    "            if id(t) not in seen:\n"
                    "                seen.add(id(t))\n"
                    "                total += t.numel() * t.element_size()\n"))
state_bytes_module_by_module = _bug(  # the tied embedding/output weight counts twice
    "state_bytes",
    ("params = list(module.parameters())",
     "params = [p for m in module.modules() for p in m.parameters(recurse=False)]"),
    (_DISTINCT, "            storage = t.untyped_storage()\n            if storage.nbytes():\n"))
state_bytes_global_dtensor = _bug(  # as if every rank held all of it
    "state_bytes", ("            if isinstance(t, DTensor):\n                t = t.to_local()\n",
                    "            if isinstance(t, DTensor):\n"
                    "                total += t.numel() * t.element_size()\n"
                    "                continue\n"))
state_bytes_ignores_wrapped_optimizer = _bug(  # ZeroRedundancyOptimizer keeps its state in .optim
    "state_bytes", ('for o in (opt, getattr(opt, "optim", None)):', "for o in (opt,):"))

# --------------------------------------------------------------------------- task 5.2

_STEP_ALL = (  # every rank all-reduces and steps every parameter: DDP, with W copies of the state
    ('mine = [{**g, "params": [p for p in g["params"] if self.owner[p] == self.rank]}',
     'mine = [{**g, "params": list(g["params"])}'),
    ("reduces.append((dist.reduce(flat, dst=r, async_op=True), r, with_grad, flat))",
     "reduces.append((dist.all_reduce(flat, async_op=True), self.rank, with_grad, flat))"))

ShardedOptimizerSums = _bug(  # reduces to the owners but never divides by the world size
    "ShardedOptimizer", ("(flat / self.world_size).split(", "flat.split("))
ShardedOptimizerStepsEverything = _bug("ShardedOptimizer", *_STEP_ALL)


class ShardedOptimizerKeepsAllState(ShardedOptimizerStepsEverything):
    """Every rank steps every parameter (its state for all of them stays in self.optim) but
    shows only the state of the parameters it owns in self.state: right values, W copies."""

    def step(self, closure=None):
        loss = super().step(closure)
        self.state = {p: s for p, s in self.optim.state.items() if self.owner[p] == self.rank}
        return loss


ShardedOptimizerNoBroadcast = _bug(  # owners never send their parameters: the others fall behind
    "ShardedOptimizer",
    ("broadcasts.append((dist.broadcast(flat, src=r, async_op=True), mine, flat))",
     "pass  # the new values stay with their owner"))
ShardedOptimizerLocalState = _bug(  # the owner's state on the inner optimizer only
    "ShardedOptimizer", ("self.state = self.optim.state  # this rank's state is the local",
                         "self.state = {}  # this rank's state is the local"))


def sharded_optimizer_wraps_zero(params, optimizer_cls, **kwargs):
    """torch's ZeroRedundancyOptimizer itself: no averaging, its state kept in .optim."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_cls, **kwargs)


# --------------------------------------------------------------------------- task 5.3

_REDUCE_SCATTER = (
    "        grad = torch.empty_like(self.shard)\n"
    "        dist.reduce_scatter_single(grad, grad_full.float().contiguous())  # sum over ranks\n"
    "        return grad / self.world_size\n")
_SAVING = ("        self.saving = torch.autograd.graph.saved_tensors_hooks("
           "self.pack, self.unpack)\n"
           "        self.saving.__enter__()\n", "")
_SAVED = ("        self.saving.__exit__(None, None, None)\n", "")

FSDPAllReducesGradients = _bug(  # right values, W times the traffic
    "FSDP", (_REDUCE_SCATTER, "        grad = grad_full.float().clone()\n"
             "        dist.all_reduce(grad)  # every rank gets every gradient, keeps its piece\n"
             "        return grad.chunk(self.world_size)[self.rank] / self.world_size\n"))
FSDPKeepsFullParameters = _bug(  # never frees them after forward, never gathers for backward
    "FSDP", _SAVING,
    (_SAVED[0] + "        for name in self.names:\n"
     "            delattr(module, name)  # the last reference: the gathered buffer is freed\n",
     ""))
FSDPLetsAutogradKeepThem = _bug("FSDP", _SAVING, _SAVED)  # autograd holds the gathered weights
FSDPKeepsGatheredBuffer = _bug(  # frees the views, but each unit keeps its gathered buffer
    "FSDP", ("        self.storage = full.untyped_storage().data_ptr()\n",
             "        self.storage = full.untyped_storage().data_ptr()\n"
             "        self.gathered = full  # for later\n"))
FSDPKeepsOriginalParameters = _bug(  # registers the shards, keeps the originals alive
    "FSDP", ("        self.shapes = [p.shape for p in originals]\n",
             "        self.shapes = [p.shape for p in originals]\n"
             "        self.originals = originals\n"))
FSDPDropsTheRemainder = _bug(  # numel // W per rank: a unit W does not divide loses its tail
    "FSDP",
    ("self.padded = math.ceil(flat.numel() / self.world_size) * self.world_size",
     "self.padded = flat.numel() // self.world_size * self.world_size  # pad < 0 cuts"),
    ("        out, offset = {}, 0\n",
     "        out, offset = {}, 0\n"
     "        full = F.pad(full, (0, max(0, sum(s.numel() for s in self.shapes)"
     " - full.numel())))\n"))
FSDPReplicatedNotAveraged = _bug(  # every rank's layer norms drift apart
    "FSDP", ("        for p in self.replicated:\n            if p.grad is not None:\n",
             "        for p in []:\n            if p.grad is not None:\n"))
FSDPReducesInComputeDtype = _bug(  # bf16/fp16 instead of fp32
    "FSDP", (_REDUCE_SCATTER,
             "        grad = torch.empty(self.shard.numel(), dtype=grad_full.dtype)\n"
             "        dist.reduce_scatter_single(grad, grad_full.contiguous())\n"
             "        return grad.float() / self.world_size\n"))


class FSDPWrapsFullyShard(FSDPReplicatedNotAveraged):
    """torch's FSDP2 on every unit and the root: the gate, and the wrong traffic."""

    def __init__(self, module, wrap=(nn.Linear, nn.Embedding), compute_dtype=None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        nn.Module.__init__(self)
        self.module = module
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        for m in [*(m for m in module.modules() if isinstance(m, wrap)), module]:
            fully_shard(m, mesh=mesh, mp_policy=policy)

    def full_state_dict(self):
        return {n: p.full_tensor().detach().clone() for n, p in self.module.named_parameters()}


class FSDPWrapsDDP(FSDPReplicatedNotAveraged):
    """torch's DDP: right values, but every rank holds every parameter."""

    def __init__(self, module, wrap=(nn.Linear, nn.Embedding), compute_dtype=None):
        from torch.nn.parallel import DistributedDataParallel

        nn.Module.__init__(self)
        self.module, self.units = module, []
        self.ddp = DistributedDataParallel(module)

    def forward(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)


# --------------------------------------------------------------------------- task 5.4

apply_fsdp2_root_unsharded = _bug(  # embeddings, final norm and output stay whole everywhere
    "apply_fsdp2", ("    fully_shard(model, **options)\n", ""))
apply_fsdp2_ignores_dtypes = _bug(  # bf16 was asked for, fp32 runs
    "apply_fsdp2", ("    if param_dtype is not None or reduce_dtype is not None:\n",
                    "    if False:  # never a MixedPrecisionPolicy\n"))
apply_fsdp2_root_only = _bug(  # right values, but the whole model is gathered at once
    "apply_fsdp2", ("    for block in model.blocks:\n        fully_shard(block, **options)\n", ""))
apply_fsdp2_flattens_the_mesh = _bug(  # FSDP over every rank where HSDP was asked for
    "apply_fsdp2", ('    options = {"mesh": mesh}\n',
                    "    from torch.distributed.device_mesh import init_device_mesh\n\n"
                    '    options = {"mesh": init_device_mesh("cpu", (dist.get_world_size(),))}\n'))
apply_fsdp2_keeps_blocks_gathered = _bug(  # right values, every block whole until backward
    "apply_fsdp2", ("        fully_shard(block, **options)\n",
                    "        fully_shard(block, **options, reshard_after_forward=False)\n"))


def apply_fsdp2_borrows_lesson06(model, mesh, param_dtype=None, reduce_dtype=None):
    from kit.lessons.resume import (
        shard_model,  # Lesson 06's helper: the same wrapping, without the mesh
    )

    return shard_model(model)


# --------------------------------------------------------------------------- task 5.5
# The check finds train_step beside clip_grad_norm_ in the edited solution: a clip bug steps
# with the solution's train_step, a train_step bug clips with the solution's clip_grad_norm_.

_REDUCE = ("    dist.all_reduce(local, op=dist.ReduceOp.MAX if p == math.inf"
           " else dist.ReduceOp.SUM)\n")
_POWERS = ("    for g in shards:\n"
           "        if g.numel() == 0:\n"
           "            continue  # an uneven split leaves some ranks an empty piece\n"
           "        if p == math.inf:\n"
           "            local = torch.maximum(local, g.abs().max())\n"
           "        else:\n"
           "            local = local + g.abs().pow(p).sum()\n") + _REDUCE
_PART = ("torch.zeros((), dtype=dtype) if g.numel() == 0 else g.abs().max() if p == math.inf "
         "else g.abs().pow(p).sum()")
_SCALED = "        g.mul_(scale)  # the local tensor is the DTensor's own storage\n"


def _clip(*edits: tuple[str, str]):
    return _bug("clip_grad_norm_", *edits)


def _step(*edits: tuple[str, str]):
    return _bug("clip_grad_norm_", *edits)  # registered as the clip, its train_step edited


_SYNC = ("        model.set_requires_gradient_sync(i == len(micro_batches) - 1)"
         "  # reduce on the last only\n")
_LOOP = (_SYNC.join(["    for i, (inputs, targets) in enumerate(micro_batches):\n",
                     "        loss = loss_fn(model(inputs), targets)\n"
                     "        (loss / len(micro_batches)).backward()"
                     "  # the sum of the parts is the batch's mean\n"
                     "        losses.append(loss.detach())\n"]))

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
        ("deletes the attributes but lets autograd keep the full weights",
         FSDPLetsAutogradKeepThem),
        ("keeps a reference to each unit's gathered buffer after forward",
         FSDPKeepsGatheredBuffer),
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
        ("a local norm per rank", _clip((_REDUCE, ""))),
        ("clips each rank's shards before the norm is reduced", _clip(
            (_REDUCE, ""),
            (_SCALED + "    return norm\n",
             _SCALED + _REDUCE + "    return local if p == math.inf else local.pow(1.0 / p)\n"))),
        ("one all-reduce per parameter", _clip((_POWERS, (
            "    for g in shards:\n"
            f"        part = {_PART}\n"
            "        dist.all_reduce(part, op=dist.ReduceOp.MAX if p == math.inf"
            " else dist.ReduceOp.SUM)\n"
            "        local = torch.maximum(local, part) if p == math.inf else local + part\n")))),
        ("all-reduces a vector of per-parameter norms", _clip((_POWERS, (
            f"    parts = torch.stack([{_PART} for g in shards])\n"
            + _REDUCE.replace("local", "parts")
            + "    local = parts.max() if p == math.inf else parts.sum()\n")))),
        ("all-gathers the ranks' local sums", _clip((_REDUCE, (
            "    gathered = torch.empty(dist.get_world_size(), dtype=local.dtype)\n"
            "    dist.all_gather_into_tensor(gathered, local.reshape(1))\n"
            "    local = gathered.max() if p == math.inf else gathered.sum()\n")))),
        ("adds up the ranks' maxima for the inf norm",
         _clip((_REDUCE, "    dist.all_reduce(local)\n"))),
        ("ignores norm_type", _clip(("    p = float(norm_type)\n", "    p = 2.0\n"))),
        ("scales gradients up when the norm is below max_norm", _clip((
            "scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)",
            "scale = max_norm / (norm + 1e-6)"))),
        ("takes the max of every shard, empty ones too", _clip((
            "        if g.numel() == 0:\n"
            "            continue  # an uneven split leaves some ranks an empty piece\n", ""))),
        ("gathers every gradient whole (full_tensor)", _clip((
            _POWERS + "    norm = local if p == math.inf else local.pow(1.0 / p)\n",
            "    norm = torch.linalg.vector_norm(torch.stack([\n"
            "        torch.linalg.vector_norm(q.grad.full_tensor(), norm_type)\n"
            "        for q in model.parameters() if q.grad is not None]), norm_type)\n"))),
        ("wraps torch.nn.utils.clip_grad_norm_", _clip((
            "    shards = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad\n",
            "    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)\n"
            "    return norm.full_tensor() if isinstance(norm, DTensor) else norm\n"
            "    shards = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad\n"))),
        ("train_step: a reduce-scatter on every micro-step", _step((_SYNC, ""))),
        ("train_step: never turns gradient sync back on", _step((
            _SYNC, "        model.set_requires_gradient_sync(False)\n"))),
        ("train_step: sums the micro-batch losses", _step((
            "        (loss / len(micro_batches)).backward()  # the sum of the parts",
            "        loss.backward()  # the sum of the parts"))),
        ("train_step: returns the last micro-batch's loss", _step((
            "    return torch.stack(losses).mean()\n", "    return losses[-1]\n"))),
        ("train_step: never zeroes the gradients", _step((
            "    optimizer.zero_grad()\n    return torch.stack(losses).mean()\n",
            "    return torch.stack(losses).mean()\n"))),
        ("train_step: one forward on the whole batch", _step((_LOOP, (
            "    loss = loss_fn(model(torch.cat([x for x, _ in micro_batches])),\n"
            "                   torch.cat([y for _, y in micro_batches]))\n"
            "    loss.backward()\n"
            "    losses.append(loss.detach())\n")))),
        ("train_step: every forward first, then one backward", _step((_LOOP, (
            "    whole = [loss_fn(model(x), y) for x, y in micro_batches]\n"
            "    (sum(whole) / len(whole)).backward()\n"
            "    losses = [loss.detach() for loss in whole]\n")))),
        ("train_step: clips after the optimizer step", _step((
            "    clip_grad_norm_(model, max_norm)\n    optimizer.step()\n",
            "    optimizer.step()\n    clip_grad_norm_(model, max_norm)\n"))),
    ],
}
