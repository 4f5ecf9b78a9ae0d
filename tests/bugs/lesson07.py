"""Seeded bugs for Lesson 07: the typical mistakes each check of tasks 7.1-7.4 must catch.

``BUGS[task_id]`` lists ``(what is wrong, implementation)``; tests/test_checks.py proves every
one of them fails its task's checks. Each bug is the solution with one step changed
(``edited_solution``), plus the cheats that call torch's own scaler, checkpoint or a hidden op.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from bugs import edited_solution

SOLUTION = edited_solution(7)


def _scaler(*edits):
    return edited_solution(7, *edits).DynamicLossScaler


_REENTRANT = ("params = [p for p in fn.parameters() if p.requires_grad] if isinstance(fn, "
              "nn.Module) else []", "params = []")  # the parameters are not inputs


def _checkpointing(*edits):
    return edited_solution(7, *edits).apply_checkpointing


def _ready(*edits):
    return edited_solution(7, *edits).compile_ready


# --------------------------------------------------------------------------- task 7.1


class ScalerWrapsGradScaler:
    def __init__(self, **kwargs):
        self.inner = torch.amp.GradScaler("cpu", **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class ScalerWrapsDeprecatedCudaGradScaler(ScalerWrapsGradScaler):
    def __init__(self, **kwargs):
        self.inner = torch.cuda.amp.GradScaler(**kwargs)  # the old alias of torch.amp.GradScaler


class ScalerUpdatesWithTorchsOp(SOLUTION.DynamicLossScaler):
    """update() by torch's own C++ op, found by a computed name: no name in the source to see."""

    def update(self):
        scale = torch.tensor([self.scale_value])
        tracker = torch.tensor([self.growth_tracker], dtype=torch.int32)
        found = torch.tensor([float(self.found_inf)])
        getattr(torch, "_amp_" + "update_scale_")(scale, tracker, found, self.growth_factor,
                                                  self.backoff_factor, self.growth_interval)
        self.scale_value, self.growth_tracker = scale.item(), int(tracker.item())
        self.found_inf = self.unscaled = False


class ScalerWrapsShardedGradScaler(ScalerWrapsGradScaler):
    def __init__(self, **kwargs):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        self.inner = ShardedGradScaler("cpu", **kwargs)


# --------------------------------------------------------------------------- task 7.2


def _saved_bytes(old, new):
    return edited_solution(7, (old, new)).saved_activation_bytes


# --------------------------------------------------------------------------- task 7.4

_HIDDEN = {}  # the model the opaque op runs: one per process is enough for the checks


@torch.library.custom_op("kitbugs::graph_break_net", mutates_args=())
def _graph_break_net(tokens: torch.Tensor, lengths: torch.Tensor, embed: torch.Tensor,
                     mix_w: torch.Tensor, mix_b: torch.Tensor, head_w: torch.Tensor,
                     head_b: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return _eager(tokens, lengths, embed, mix_w, mix_b, head_w, head_b).clone()


def _eager(tokens, lengths, *weights):
    from torch.func import functional_call

    names = ("embed.weight", "mix.weight", "mix.bias", "head.weight", "head.bias")
    return functional_call(_HIDDEN["model"], dict(zip(names, weights)), (tokens, lengths))


@_graph_break_net.register_fake
def _(tokens, lengths, embed, mix_w, mix_b, head_w, head_b):
    return embed.new_empty((tokens.shape[0], head_w.shape[0]))


def _keep_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _recompute(ctx, grad):
    tokens, lengths, *weights = ctx.saved_tensors
    weights = [w.detach().requires_grad_() for w in weights]
    with torch.enable_grad():
        out = _eager(tokens, lengths, *weights)
    return (None, None, *torch.autograd.grad(out, weights, grad))


_graph_break_net.register_autograd(_recompute, setup_context=_keep_inputs)


class ReadyHidesItInACustomOp(nn.Module):
    """The eager forward, graph breaks and all, inside one custom op: one graph, right values."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        _HIDDEN["model"] = model

    def forward(self, tokens, lengths):
        m = self.model
        return _graph_break_net(tokens, lengths, m.embed.weight, m.mix.weight, m.mix.bias,
                                m.head.weight, m.head.bias)


def _eager_forward(tokens, lengths):
    """GraphBreakNet's own forward, graph breaks and all, called whole from the graph."""
    return _HIDDEN["allowed"](tokens, lengths)


torch.compiler.allow_in_graph(_eager_forward)


class ReadyAllowsTheEagerForwardInGraph(nn.Module):
    """The eager forward behind torch.compiler.allow_in_graph: Dynamo puts the call in the graph
    without tracing it, so fullgraph=True compiles and the values are right."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        _HIDDEN["allowed"] = model

    def forward(self, tokens, lengths):
        return _eager_forward(tokens, lengths)


BUGS = {
    "7.1": [
        ("tests the whole gradient, plain or DTensor: under FSDP2 a plain flag plus a DTensor "
         "fails", _scaler(("p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad",
                           "p.grad"))),
        ("a frozen parameter's .grad (None) is tested and unscaled: TypeError", _scaler((
            "for group in optimizer.param_groups for p in group[\"params\"]\n"
            "                 if p.grad is not None]",
            "for group in optimizer.param_groups for p in group[\"params\"]]"))),
        ("unscales fp16 gradients instead of refusing them as GradScaler does",
         _scaler(("if any(g.dtype == torch.float16 for g in grads):", "if False:"))),
        ("refuses every gradient that is not fp32: bf16 too",
         _scaler(("if any(g.dtype == torch.float16 for g in grads):",
                  "if any(g.dtype != torch.float32 for g in grads):"))),
        ("no backoff: the scale stays after an overflow",
         _scaler(("            self.scale_value *= self.backoff_factor\n", ""))),
        ("skipped steps count toward growth", _scaler((
            "            self.growth_tracker = 0\n        else:\n"
            "            self.growth_tracker += 1\n",
            "        if True:  # a skipped step counts toward growth too\n"
            "            self.growth_tracker += 1\n"))),
        ("each rank decides alone whether to skip", _scaler((
            "if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:",
            "if False:"))),
        ("NaN gradients are not detected (isinf only)",
         _scaler(("found += (~torch.isfinite(g)).any()", "found += torch.isinf(g).any()"))),
        ("step() unscales again after the user's unscale_()", _scaler((
            "        self.unscale_(optimizer)\n",
            "        self.unscaled = False  # unscales again after the user's unscale_()\n"
            "        self.unscale_(optimizer)\n"))),
        ("wraps torch.amp.GradScaler", ScalerWrapsGradScaler),
        ("wraps torch's ShardedGradScaler", ScalerWrapsShardedGradScaler),
        ("wraps the deprecated torch.cuda.amp.GradScaler", ScalerWrapsDeprecatedCudaGradScaler),
        ("updates the scale with torch's private _amp_update_scale_ op", ScalerUpdatesWithTorchsOp),
    ],
    "7.2": [
        ("counts every saved tensor, not every storage", _saved_bytes(
            "storages[storage.data_ptr()] = storage.nbytes()",
            "storages[id(t)] = storage.nbytes()")),
        ("counts parameters", _saved_bytes(
            "if not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):",
            "if True:")),
        ("counts the bytes of each view instead of its storage", _saved_bytes(
            "storages[storage.data_ptr()] = storage.nbytes()",
            "storages[storage.data_ptr()] = t.numel() * t.element_size()")),
    ],
    "7.3": [
        ("RNG state not restored before recomputing", _checkpointing(
            ("            torch.set_rng_state(ctx.rng_state)", "            pass"))),
        ("RNG state restored without fork_rng: the generator is left rewound", _checkpointing(
            ("stack.enter_context(torch.random.fork_rng(devices=[]))", "pass"))),
        ("inputs detached without requires_grad: no gradient reaches earlier layers",
         _checkpointing(("outputs = ctx.fn(*args)",
                         "outputs = ctx.fn(*[a.detach() if torch.is_tensor(a) else a "
                         "for a in args])"))),
        # Recomputing on the originals alone is harmless when backward takes autograd.grad of
        # the inputs; as in reentrant checkpointing, the parameters are not inputs here either.
        ("inputs not detached: recomputes on the originals", _checkpointing(
            ("next(saved).detach().requires_grad_(needs[i])", "next(saved)"), _REENTRANT)),
        ("forward runs fn with grad: activations are saved", _checkpointing((
            "        with torch.no_grad():  # nothing inside fn is saved for backward\n"
            "            return fn(*args)\n",
            "        with torch.enable_grad():\n"
            "            return fn(*args).detach()\n"))),
        ("forward runs fn with grad and keeps its output on ctx: every activation stays alive",
         _checkpointing((
             "        with torch.no_grad():  # nothing inside fn is saved for backward\n"
             "            return fn(*args)\n",
             "        with torch.enable_grad():\n"
             "            ctx.out = fn(*args)  # \"in case backward needs it\": its graph stays "
             "alive\n"
             "        return ctx.out.detach()\n"))),
        ("checkpoints blocks 0, k, 2k, ... instead of the k-th, 2k-th, ...",
         _checkpointing(("if (i + 1) % every == 0:", "if i % every == 0:"))),
        ("wraps torch.utils.checkpoint (reentrant)", _checkpointing((
            "        return checkpoint(self.block, *args)",
            "        from torch.utils.checkpoint import checkpoint as torch_checkpoint\n\n"
            "        return torch_checkpoint(self.block, *args, use_reentrant=True)"))),
        ("recomputes without the forward's autocast state: a bf16 forward, an fp32 recomputation",
         _checkpointing((
             "            for device, enabled, dtype in ctx.autocast:  # the forward's autocast, "
             "as it was\n"
             "                stack.enter_context(torch.autocast(device, dtype=dtype, "
             "enabled=enabled,\n"
             "                                                   "
             "cache_enabled=ctx.autocast_cache))\n",
             ""))),
        ("the block's parameters are not inputs of the Function (reentrant style): a block whose "
         "input needs no grad silently gets no gradient", _checkpointing(_REENTRANT)),
    ],
    "7.4": [
        ("a graph break left in: the .item() branch", _ready((
            "        pooled = torch.where(norm > m.max_norm, pooled * (m.max_norm / norm), "
            "pooled)\n",
            "        if norm.item() > m.max_norm:\n"
            "            pooled = pooled * (m.max_norm / norm)\n"))),
        ("a graph break left in: the print", _ready((
            "        mask = torch.arange(",
            "        print(\"pooling\", tuple(h.shape))\n        mask = torch.arange("))),
        ("a graph break left in: the loop up to the longest length", _ready((
            "        pooled = (h * mask.unsqueeze(2)).sum(1) / lengths.unsqueeze(1)  # (B, D)\n",
            "        pooled = torch.zeros(h.shape[0], h.shape[2])\n"
            "        for t in range(int(lengths.max())):\n"
            "            pooled = pooled + h[:, t] * (t < lengths).unsqueeze(1)\n"
            "        pooled = pooled / lengths.unsqueeze(1)\n"))),
        ("averages over padding (divides by T)", _ready(
            (".sum(1) / lengths.unsqueeze(1)  # (B, D)", ".sum(1) / h.shape[1]  # (B, D)"))),
        ("recompiles per sequence length (positions from a Python range)", _ready(
            ("torch.arange(h.shape[1], device=h.device)",
             "torch.tensor(list(range(h.shape[1])))"))),
        ("always rescales to max_norm", _ready((
            "torch.where(norm > m.max_norm, pooled * (m.max_norm / norm), pooled)",
            "pooled * (m.max_norm / norm)"))),
        ("copies the model: its parameters get no gradient",
         lambda model: SOLUTION.compile_ready(copy.deepcopy(model))),
        ("returns the model unchanged", lambda model: model),
        ("hides the eager forward in one custom op", ReadyHidesItInACustomOp),
        ("hides the eager forward behind torch.compiler.allow_in_graph",
         ReadyAllowsTheEagerForwardInGraph),
    ],
}
