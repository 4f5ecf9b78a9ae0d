"""The grader's answers for Lesson 07 (trusted only): torch's own GradScaler driven through the
same training runs as 7.1's scaler, task 7.2's count of the bytes saved for backward (and the
per-layer formula of Korthikanti et al.), a trusted checkpoint for 7.3 with what it saves, keeps
after forward and recomputes, and 7.4's GraphBreakNet in eager mode: its outputs, gradients and
FLOPs.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from autograder import lesson07 as L
from autograder.compare import one_thread
from kit import meter
from kit.lessons.models import token_batch

# --------------------------------------------------------------------------- task 7.1


def torch_scaler(**kwargs: Any) -> Any:
    """Task 7.1's reference: torch's own dynamic loss scaler for CPU."""
    return torch.amp.GradScaler("cpu", **kwargs)


def scaled_with_torch(seed: int) -> dict[str, Any]:
    return L._train_scaled(torch_scaler, seed)


def clipped_with_torch(seed: int) -> dict[str, Any]:
    return L._train_scaled(torch_scaler, seed, clip=0.5)


def frozen_with_torch(seed: int) -> dict[str, Any]:
    return L._train_scaled(torch_scaler, seed, frozen=L.FROZEN)


def bf16_with_torch(seed: int) -> dict[str, Any]:
    return L._train_scaled(torch_scaler, seed, dtype=torch.bfloat16)


def fp16_with_torch(seed: int) -> dict[str, Any]:
    return L._fp16_step(torch_scaler, seed)


def _train_with_inf_in(make: Callable[..., Any], seed: int, name: str, row: int = 0
                       ) -> dict[str, Any]:
    model = L._mlp(seed)
    params = dict(model.named_parameters())
    optimizer = torch.optim.SGD(params.values(), lr=0.05, momentum=0.9)
    scaler = make(**L.SCALER_ARGS)
    scales, stepped = [], []
    for step in range(L.STEPS):
        x, y = L._batch(seed, step)
        optimizer.zero_grad()
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if step in L.SHARD_INF_STEPS:
            params[name].grad[row] = float("inf")
        before = [p.detach().clone() for p in params.values()]
        scaler.step(optimizer)
        scaler.update()
        scales.append(float(scaler.get_scale()))
        stepped.append(any(not torch.equal(b, p) for b, p in zip(before, params.values())))
    return {"scales": scales, "stepped": stepped, "default scale": float(make().get_scale()),
            "params": {n: p.detach().clone() for n, p in params.items()}, "uses": []}


def fsdp2_with_torch(seed: int) -> dict[str, Any]:
    """GradScaler in one process, inf where FSDP2's rank 1 holds it: row 2 of the last weight
    (rows 0-1 are rank 0's shard of the (3, 8) weight, row 2 rank 1's)."""
    return _train_with_inf_in(torch_scaler, seed, "4.weight", row=2)


def sharded_with_torch(seed: int) -> list[dict[str, Any]]:
    """GradScaler in one process over the whole model, inf where rank 2 injects it; each rank
    must end with that run's values of the parameters it owns."""
    names = [n for n, _ in L._mlp(seed).named_parameters()]
    full = _train_with_inf_in(torch_scaler, seed, names[2::L.WORLD][-1])
    return [{**full, "params": {n: full["params"][n] for n in names[rank::L.WORLD]}}
            for rank in range(L.WORLD)]


# --------------------------------------------------------------------------- task 7.2


def saved_activation_bytes(module: nn.Module, *args: Any) -> int:
    """Task 7.2's reference: bytes of the storages saved for backward that no parameter owns."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*args)
    return sum(storages.values())


def module_saved_bytes(seed: int, name: str) -> int:
    module, x = L._modules(seed)[name]
    return saved_activation_bytes(module, x)


def block_formula_bytes(s: int, b: int, h: int, a: int, bytes_per_value: int = 4) -> int:
    """Korthikanti et al. (2022), one transformer layer without dropout, with fused attention.

    Their ``sbh(34 + 5as/h)`` bytes (16-bit, dropout) loses ``5as/h`` (no attention matrix is
    kept: the fused kernel saves its output and a log-sum-exp instead) and ``2sbh`` (two 1-byte
    dropout masks): 16 values per token and hidden unit. Add the small per-token terms: each
    LayerNorm's mean and reciprocal std (fp32) and the attention's log-sum-exp per head.
    """
    return 16 * s * b * h * bytes_per_value + 2 * 2 * s * b * 4 + a * s * b * 4


def block_formula(seed: int) -> int:
    return block_formula_bytes(L.T, L.B, L.D, L.HEADS)


# --------------------------------------------------------------------------- task 7.3


class Checkpoint(torch.autograd.Function):
    """Task 7.3's reference checkpoint (one tensor input): keeps the input and the RNG state."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.rng = fn, torch.get_rng_state()
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.set_rng_state(ctx.rng)
            out = ctx.fn(x)
        out.backward(grad)
        return None, x.grad


class Checkpointed(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Checkpoint.apply(self.block, x)


def apply_checkpointing(model: nn.Module, every: int = 1) -> nn.Module:
    """Task 7.3's reference: the every-th blocks (counting from 1) through :class:`Checkpoint`."""
    for i, block in enumerate(model.blocks):
        if (i + 1) % every == 0:
            model.blocks[i] = Checkpointed(block)
    return model


def plain_grads(seed: int, regime: str | None = None) -> dict[str, Any]:
    """The model without checkpointing: every gradient and the next random numbers (in one of
    ``L.CHECKPOINT_REGIMES``: under bf16 autocast, or with frozen parameters)."""
    settings = L.CHECKPOINT_REGIMES[regime] if regime else {}
    with one_thread():
        model = L._dropout_model(seed, settings.get("frozen", False))
        return {**L._step_grads(model, list(model.named_parameters()), seed,
                                settings.get("autocast", False)), "uses": []}


def saved_bytes(records: list[list[int]]) -> int:
    """The bytes saved for backward, from what autograd handed the pack hook: each storage once,
    parameters' storages not at all (records of ``[storage address, its bytes, 1 if a
    parameter's]``, as :func:`autograder.lesson07._saved_storages` writes them)."""
    storages = {address: nbytes for address, nbytes, is_param in records if not is_param}
    return sum(storages.values())


def bytes_and_calls_expected(seed: int) -> dict[str, Any]:
    """Bytes saved for backward with the trusted checkpoint, per every, and the forward calls
    each block makes in a step (twice when checkpointed)."""
    x, _ = token_batch(L.B, L.T, L.VOCAB, seed)
    plain = saved_bytes(L._saved_storages(L._dropout_model(seed), x))
    saved = {every: saved_bytes(L._saved_storages(apply_checkpointing(L._dropout_model(seed),
                                                                      every), x))
             for every in L.EVERY}
    calls = {
        every: [2 if (i + 1) % every == 0 else 1 for i in range(L.LAYERS)] for every in L.EVERY
    }
    return {"saved": saved, "calls": calls, "uses": [], "plain": plain}


def kept_after_forward_bound(seed: int) -> dict[str, int]:
    """What checkpointing every block promises after the forward: each block keeps only its
    input (what the trusted checkpoint keeps, measured by the meter), plus one block's saved
    activations (the per-layer formula) of slack."""
    kept = L._kept_after_forward(apply_checkpointing(L._dropout_model(seed), every=1), seed)
    return {"bound": kept + block_formula_bytes(L.T, L.B, L.D, L.HEADS)}


# --------------------------------------------------------------------------- task 7.4


def eager_run(seed: int) -> dict[str, Any]:
    """GraphBreakNet in eager mode on the checks' batches: one graph's worth of values."""
    model = L._graph_break_model(seed)
    with contextlib.redirect_stdout(io.StringIO()):
        result = L._forward_backward(model, model, seed)
    return {"compiled": "yes", "graphs": 1, **result}


def hidden_flops_bound(seed: int) -> dict[str, int]:
    """1% of the eager model's forward FLOPs on the checks' batches (its two linear layers)."""
    model = L._graph_break_model(seed)
    with meter.count_flops() as flops, contextlib.redirect_stdout(io.StringIO()):
        L._forwards(model, seed)
    return {"bound": flops.total // 100}
