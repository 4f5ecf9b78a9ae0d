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
# # Lesson 07 · Memory and speed: mixed precision, activation checkpointing and torch.compile

# %% tags=["setup"]
import time

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from kit import LaunchError, check, launch
from kit.models import TinyTransformer, token_batch
from kit.precision import GraphBreakNet, format_table, padded_batch


# %% tags=["task-7.1"]
class DynamicLossScaler:
    """Dynamic loss scaling for low-precision gradients, in step on every rank.

    Multiply the loss by the scale before backward; before the optimizer steps, divide the
    gradients by it and look for inf/NaN. A step with any inf/NaN gradient, on any rank, is
    skipped by every rank and the scale is multiplied by ``backoff_factor``; after
    ``growth_interval`` finite steps in a row it is multiplied by ``growth_factor``.

    Args:
        init_scale: the first scale.
        growth_factor: multiplies the scale after ``growth_interval`` finite steps in a row.
        backoff_factor: multiplies the scale after a step with an inf/NaN gradient.
        growth_interval: finite steps in a row before the scale grows.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        ### BEGIN SOLUTION
        self.scale_value = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0  # finite steps in a row since the scale last changed
        self.found_inf = False  # did this step find an inf/NaN gradient, on any rank?
        self.unscaled = False  # has unscale_() run since the last update()?
        ### END SOLUTION

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Return ``loss`` times the current scale (call ``.backward()`` on the result)."""
        ### BEGIN SOLUTION
        return loss * self.scale_value
        ### END SOLUTION

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of ``optimizer``'s parameters by the scale, in place, once per
        step, and find out whether any rank holds an inf/NaN gradient."""
        ### BEGIN SOLUTION
        if self.unscaled:
            return
        inv_scale = 1.0 / self.scale_value
        found = torch.zeros(1)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    found += (~torch.isfinite(p.grad)).any()
                    p.grad.mul_(inv_scale)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)  # one rank's overflow is everyone's
        self.found_inf = bool(found.item() > 0)
        self.unscaled = True
        ### END SOLUTION

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale (if not yet done this step) and step the optimizer unless some rank found
        an inf/NaN gradient. Returns whether the optimizer stepped."""
        ### BEGIN SOLUTION
        self.unscale_(optimizer)
        if self.found_inf:
            return False
        optimizer.step()
        return True
        ### END SOLUTION

    def update(self) -> None:
        """Back off after a skipped step, grow after ``growth_interval`` finite steps in a row;
        then get ready for the next step."""
        ### BEGIN SOLUTION
        if self.found_inf:
            self.scale_value *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale_value *= self.growth_factor
                self.growth_tracker = 0
        self.found_inf = False
        self.unscaled = False
        ### END SOLUTION

    def get_scale(self) -> float:
        """The current scale."""
        ### BEGIN SOLUTION
        return self.scale_value
        ### END SOLUTION


# %% tags=["check-7.1"]
check("7.1", DynamicLossScaler)


# %% tags=["task-7.2"]
def saved_activation_bytes(fn, *args) -> int:
    """Bytes that autograd saves for backward while ``fn(*args)`` runs.

    Record every tensor packed for backward (``torch.autograd.graph.saved_tensors_hooks``).
    Count each storage once, with all its bytes (``t.untyped_storage().nbytes()``), however
    many tensors view it, and leave out parameters: a saved tensor that is an
    ``nn.Parameter`` or a view of one (its ``._base`` is one). Inputs and intermediate results
    count.
    """
    ### BEGIN SOLUTION
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(storages.values())
    ### END SOLUTION


# %% tags=["check-7.2"]
check("7.2", saved_activation_bytes)


# %% tags=["task-7.3"]
class Checkpoint(torch.autograd.Function):
    """``fn(*args)`` without saving its activations: recomputed during backward."""

    @staticmethod
    def forward(ctx, fn, *args):
        ### BEGIN SOLUTION
        ctx.fn = fn
        ctx.rng_state = torch.get_rng_state()  # the CPU generator, as dropout will find it
        ctx.is_tensor = [torch.is_tensor(a) for a in args]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[a for a in args if torch.is_tensor(a)])
        with torch.no_grad():  # nothing inside fn is saved for backward
            return fn(*args)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, *grad_outputs):
        ### BEGIN SOLUTION
        saved = iter(ctx.saved_tensors)
        # Fresh leaves: the recomputation's graph ends here, so backward through it stops at
        # the inputs and hands their gradients back to the outer graph.
        args = [next(saved).detach().requires_grad_(ctx.needs_input_grad[i + 1]) if is_t else other
                for i, (is_t, other) in enumerate(zip(ctx.is_tensor, ctx.others))]
        with torch.random.fork_rng(devices=[]):  # leave the generator as backward found it
            torch.set_rng_state(ctx.rng_state)  # the same dropout masks as in forward
            with torch.enable_grad():
                outputs = ctx.fn(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, *[a.grad if torch.is_tensor(a) else None for a in args])
        ### END SOLUTION


def checkpoint(fn, *args):
    """``fn(*args)``, keeping only the inputs and the RNG state for backward.

    Forward runs ``fn`` without saving activations, keeps the tensor inputs with
    ``ctx.save_for_backward`` and the CPU RNG state; backward restores that RNG state,
    recomputes ``fn`` with grad on detached copies of the inputs and backpropagates through
    the recomputation.
    """
    ### BEGIN SOLUTION
    return Checkpoint.apply(fn, *args)
    ### END SOLUTION


class CheckpointedBlock(nn.Module):
    """Runs ``block`` through :func:`checkpoint`."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return checkpoint(self.block, *args)


def apply_checkpointing(model: nn.Module, every: int = 1) -> nn.Module:
    """Checkpoint every ``every``-th block of ``model.blocks`` in place and return ``model``.

    The k-th, 2k-th, ... blocks counting from 1 (indices ``every - 1``, ``2 * every - 1``,
    ...) are replaced by a module that runs them through :func:`checkpoint`.
    """
    ### BEGIN SOLUTION
    for i, block in enumerate(model.blocks):
        if (i + 1) % every == 0:
            model.blocks[i] = CheckpointedBlock(block)
    return model
    ### END SOLUTION


# %% tags=["check-7.3"]
check("7.3", apply_checkpointing)


# %% tags=["task-7.4"]
class CompileReady(nn.Module):
    """GraphBreakNet's computation with no graph break; shares the model's parameters."""

    def __init__(self, model: GraphBreakNet):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        m = self.model
        h = torch.tanh(m.mix(m.embed(tokens)))  # (B, T, D)
        mask = torch.arange(h.shape[1], device=h.device) < lengths.unsqueeze(1)  # (B, T)
        pooled = (h * mask.unsqueeze(2)).sum(1) / lengths.unsqueeze(1)  # (B, D)
        norm = pooled.norm()
        pooled = torch.where(norm > m.max_norm, pooled * (m.max_norm / norm), pooled)
        return m.head(pooled)
        ### END SOLUTION


def compile_ready(model: GraphBreakNet) -> nn.Module:
    """A module computing what ``model`` computes, with its parameters, and no graph break."""
    ### BEGIN SOLUTION
    return CompileReady(model)
    ### END SOLUTION


# %% tags=["check-7.4"]
check("7.4", compile_ready)
