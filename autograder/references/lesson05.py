"""The grader's answers for Lesson 05 (trusted only): task 5.1's count of the bytes a rank holds
(storages once, a DTensor by its local shard), the one-process runs the sharded trainers of 5.2,
5.3 and 5.4 must equal and torch's clipping of 5.5's unsharded model (each computed once per
seed while a check runs, on one thread as the ranks run), and the bounds each technique
promises, computed from the sizes of the models the memory runs use (the activations measured on
the unwrapped model, in this process).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autograder import lesson05 as L
from autograder.compare import one_thread
from autograder.registry import shared
from kit import meter

# --------------------------------------------------------------------------- shared


def _once_per_seed(compute: Callable[[int], Any]) -> Callable[[int], Any]:
    """``compute(seed)`` as a trusted shared run: every case of a task that reads it while a check
    runs gets the same result (the registry keeps each case's expectation afterwards)."""
    run = shared(lambda _compute, seed: _single_threaded(_compute, seed))
    return lambda seed: run(compute, seed)


def _single_threaded(compute: Callable[[int], Any], seed: int) -> Any:
    with one_thread():
        return compute(seed)


def _held(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor: its local shard)."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = 0
    for t in tensors:
        if isinstance(t, DTensor):
            t = t._local_tensor
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _activations(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes the unwrapped ``model`` keeps alive after a forward on ``x`` (what autograd saves and
    the output), measured by the meter in this process, where no collective runs."""
    with meter.track() as usage:
        out = model(x)
        usage.mark("after forward")
    del out
    return usage.marks["after forward"]


# --------------------------------------------------------------------------- task 5.1


def state_bytes(module: nn.Module, optimizer: Any = None) -> dict[str, int]:
    """Task 5.1's reference: params, grads and optimizer state held by this rank, storages once."""
    params = list(module.parameters())
    state = []
    if optimizer is not None:
        for owner in (optimizer, getattr(optimizer, "optim", None)):
            if owner is not None:
                state += [v for s in owner.state.values() for v in s.values()
                          if isinstance(v, torch.Tensor)]
    return {"params": _held(params), "grads": _held(p.grad for p in params if p.grad is not None),
            "optimizer": _held(state)}


# --------------------------------------------------------------------------- task 5.2


def _unsharded(params: Any, optimizer_cls: Any, **kwargs: Any) -> torch.optim.Optimizer:
    return optimizer_cls(params, **kwargs)


def _zero_compute(seed: int) -> dict[str, Any]:
    """One process on the whole batch with the unsharded optimizer, for AdamW and SGD."""
    out = {}
    for kind in ("adamw", "sgd"):
        losses: list[float] = []
        model, optimizer = L._zero_train(_unsharded, seed, kind, None, L.ZERO_RANKS, losses)
        sizes = [p.numel() for p in model.parameters()]
        per_param = [L._storage_bytes(v for v in optimizer.state[p].values()
                                      if isinstance(v, torch.Tensor))
                     for p in model.parameters()]
        out[kind] = {"final": {n: t.detach().clone() for n, t in model.state_dict().items()},
                     "state bytes per parameter": per_param, "sizes": sizes,
                     "closure losses": losses}
    return out


zero_expected = _once_per_seed(_zero_compute)


def zero_state_bound(seed: int) -> dict[str, int]:
    """ZeRO-1's promise for the memory run: each rank keeps the state of 1/W of the tensors, plus
    at most one tensor more (ownership goes by whole parameters)."""
    # AdamW keeps exp_avg and exp_avg_sq (fp32, the parameter's size) and a 0-d fp32 step.
    per_tensor = 2 * L.ZERO_MEMORY_NUMEL * 4 + 4
    total = L.ZERO_MEMORY_TENSORS * per_tensor
    return {"bound": total // L.ZERO_RANKS + per_tensor}


# --------------------------------------------------------------------------- task 5.3


def _fsdp_compute(seed: int) -> dict[str, Any]:
    """One process, AdamW on the mean of the per-slice gradients, each slice's forward with the
    units' parameters cast to the compute dtype (fp32 gradients, as FSDP reduces)."""
    from torch.func import functional_call

    out = {}
    for label, dtype in L.DTYPES.items():
        model = L._fsdp_model(seed)
        units = L._units(model)
        unit_names = {f"{prefix}.{n}" for prefix, params in units.items() for n, _ in params}
        params = dict(model.named_parameters())
        optimizer = torch.optim.AdamW(params.values(), lr=1e-2, weight_decay=0.1, eps=L.EPS)
        run: dict[str, Any] = {"units": {p: [(n, tuple(s)) for n, s in v]
                                         for p, v in units.items()}}
        for step in range(L.FSDP_STEPS):
            total = {n: torch.zeros_like(p) for n, p in params.items()}
            for rank in range(L.FSDP_RANKS):
                x, y = L._slice(seed, step, rank, L.FSDP_RANKS, L.FSDP_PER_RANK, L.FSDP_LENGTH,
                                L.FSDP_VOCAB)
                cast = {n: p.to(dtype) if dtype is not None and n in unit_names else p
                        for n, p in params.items()}
                loss = L._loss(functional_call(model, cast, (x,)), y)
                for n, g in zip(params, torch.autograd.grad(loss, list(params.values()))):
                    total[n] += g
            for n, p in params.items():
                p.grad = total[n] / L.FSDP_RANKS
            if step == 0:
                run["grads"] = {n: p.grad.clone() for n, p in params.items()}
            optimizer.step()
            optimizer.zero_grad()
        run["final"] = {n: p.detach().clone() for n, p in params.items()}
        run["replicated bytes"] = sum(p.numel() * 4 for n, p in params.items()
                                      if n not in unit_names)
        out[label] = run
    return out


fsdp_expected = _once_per_seed(_fsdp_compute)


def _unit_bytes() -> tuple[int, int]:
    """(one unit's gathered fp32 buffer, one unit's shard) of the memory run's model, padded."""
    numel = L.FSDP_MEMORY_DIM * L.FSDP_MEMORY_DIM + L.FSDP_MEMORY_DIM  # weight and bias
    padded = math.ceil(numel / L.FSDP_RANKS) * L.FSDP_RANKS
    return padded * 4, padded // L.FSDP_RANKS * 4


def _memory_activations(seed: int) -> int:
    model = L._memory_model(seed)
    return _activations(model, L._memory_input(seed))


def fsdp_parameter_bound(seed: int) -> dict[str, int]:
    """ZeRO-3's promise after wrapping: 1/W of every unit (padded), one shard of slack."""
    _, shard = _unit_bytes()
    return {"bound": (L.FSDP_MEMORY_UNITS + 1) * shard}


def fsdp_after_forward_bound(seed: int) -> dict[str, int]:
    """After forward: what the unwrapped model keeps (activations, output), one unit of slack."""
    full, _ = _unit_bytes()
    return {"bound": _memory_activations(seed) + full}


def fsdp_forward_peak_bound(seed: int) -> dict[str, int]:
    """During forward: the activations, the unit computing, the all-gather's staging copy of it
    (gloo's), and one unit of slack."""
    full, _ = _unit_bytes()
    return {"bound": _memory_activations(seed) + 3 * full}


# --------------------------------------------------------------------------- task 5.4


def _fsdp2_compute(seed: int) -> dict[str, Any]:
    """Data parallelism in one process: each rank's slice loss, AdamW on their mean."""
    model = L._fsdp2_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    losses = [[] for _ in range(L.FSDP2_RANKS)]
    for step in range(L.FSDP2_STEPS):
        for rank in range(L.FSDP2_RANKS):
            x, y = L._slice(seed, step, rank, L.FSDP2_RANKS, L.FSDP2_PER_RANK, L.FSDP2_LENGTH,
                            L.FSDP2_VOCAB)
            loss = L._loss(model(x), y) / L.FSDP2_RANKS
            loss.backward()
            losses[rank].append(loss.item() * L.FSDP2_RANKS)
        optimizer.step()
        optimizer.zero_grad()
    sizes = {n: (p.shape[0], p[0].numel()) for n, p in model.named_parameters()}
    return {"losses": losses, "sizes": sizes,
            "names": [n for n, _ in model.named_parameters()],
            "blocks": [f"blocks.{i}" for i in range(len(model.blocks))]}


fsdp2_expected = _once_per_seed(_fsdp2_compute)


def fsdp2_after_forward_bound(seed: int) -> dict[str, int]:
    """After forward: the activations, the root's parameters (FSDP2 keeps the root gathered for
    backward) and one block of slack; every other block is resharded."""
    model = L._fsdp2_memory_model(seed)
    x, _ = L._fsdp2_memory_batch(seed)
    blocks = {id(p) for p in model.blocks.parameters()}
    root = sum(p.numel() * 4 for p in model.parameters() if id(p) not in blocks)
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    return {"bound": _activations(model, x) + root + block}


# --------------------------------------------------------------------------- task 5.5


def _clip_compute(world_size: int, seed: int) -> dict[str, Any]:
    """torch's clip_grad_norm_ on the unsharded model, the loss on the whole global batch (the
    mean over equal slices is the mean of their means), each call of CLIP_CALLS afresh."""
    model = L._clip_model(seed)
    x, y = L._clip_batch(seed, world_size, L.CLIP_PER_RANK)
    out = {}
    for label, norm_type, max_norm in L.CLIP_CALLS:
        model.zero_grad(set_to_none=True)
        L._clip_loss(model(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm,
                                              2.0 if norm_type is None else norm_type)
        out[label] = {"norm": norm.detach().clone(),
                      "grads": {n: None if p.grad is None else p.grad.detach().clone()
                                for n, p in model.named_parameters()}}
    return out


clip_expected_2 = _once_per_seed(lambda seed: _clip_compute(2, seed))
clip_expected_4 = _once_per_seed(lambda seed: _clip_compute(4, seed))


def clip_bytes_bound(seed: int) -> dict[str, int]:
    """The global norm needs one number per rank: one float64 element, 8 bytes."""
    return {"bound": torch.empty((), dtype=torch.float64).element_size()}


def _step_compute(seed: int) -> dict[str, Any]:
    """One unsharded SGD step per train_step call on the concatenation of every rank's
    micro-batches, clipped by torch; each rank's loss is the mean of its micro-batch losses."""
    model = L._clip_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=L.STEP_LR, momentum=0.9)
    rows = L.STEP_MICRO * L.STEP_MICRO_SIZE
    steps = []
    for step, max_norm in enumerate(L.STEP_NORMS):
        x, y = L._clip_batch(seed + 101 * (step + 1), L.STEP_RANKS, rows)
        with torch.no_grad():
            per_row = (model(x) - y).square().mean(dim=1)  # (ranks * rows,)
            micro = per_row.view(L.STEP_RANKS, L.STEP_MICRO, L.STEP_MICRO_SIZE).mean(dim=2)
        L._clip_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad()
        steps.append({"loss": list(micro.mean(dim=1)),
                      "params": {n: p.detach().clone() for n, p in model.named_parameters()}})
    return {"steps": steps}


step_expected = _once_per_seed(_step_compute)
