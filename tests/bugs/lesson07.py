"""Seeded bugs for Lesson 07: the typical mistakes each check of tasks 7.1-7.4 must catch.

``BUGS[task_id]`` lists ``(what is wrong, implementation)``; tests/test_checks.py proves every
one of them fails its task's checks. Each bug is a correct implementation with one step
replaced, plus the cheats that call torch's own scaler or checkpoint.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from bugs import edited_solution

# --------------------------------------------------------------------------- task 7.1


class _Scaler:
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.value, self.growth, self.backoff, self.interval = float(init_scale), growth_factor, backoff_factor, growth_interval
        self.tracker, self.found_inf, self.unscaled = 0, False, False

    def scale(self, loss):
        return loss * self.value

    def _bad(self, grad):
        return bool((~torch.isfinite(grad)).any())

    def _sync(self, found):
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([float(found)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            found = bool(flag.item())
        return found

    def unscale_(self, optimizer):
        if self.unscaled:
            return
        if any(p.grad is not None and p.grad.dtype == torch.float16
               for group in optimizer.param_groups for p in group["params"]):
            raise ValueError("fp16 gradients cannot be unscaled")
        found = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    found |= self._bad(p.grad)
                    p.grad.mul_(1.0 / self.value)
        self.found_inf = self._sync(found)
        self.unscaled = True

    def step(self, optimizer):
        self.unscale_(optimizer)
        if not self.found_inf:
            optimizer.step()

    def _after_bad_step(self):
        self.value *= self.backoff
        self.tracker = 0

    def update(self):
        if self.found_inf:
            self._after_bad_step()
        else:
            self.tracker += 1
            if self.tracker == self.interval:
                self.value *= self.growth
                self.tracker = 0
        self.found_inf = self.unscaled = False

    def get_scale(self):
        return self.value


class ScalerNoBackoff(_Scaler):
    def _after_bad_step(self):
        self.tracker = 0


class ScalerCountsSkippedSteps(_Scaler):
    def update(self):
        if self.found_inf:
            self.value *= self.backoff
        self.tracker += 1  # a skipped step counts toward growth too
        if self.tracker == self.interval:
            self.value *= self.growth
            self.tracker = 0
        self.found_inf = self.unscaled = False


class ScalerDecidesAlone(_Scaler):
    def _sync(self, found):
        return found


class ScalerMissesNaN(_Scaler):
    def _bad(self, grad):
        return bool(torch.isinf(grad).any())


class ScalerUnscalesTwice(_Scaler):
    def step(self, optimizer):
        self.unscaled = False  # unscales again after the user's unscale_()
        super().step(optimizer)


class ScalerWrapsGradScaler:
    def __init__(self, **kwargs):
        self.inner = torch.amp.GradScaler("cpu", **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class ScalerWrapsDeprecatedCudaGradScaler(ScalerWrapsGradScaler):
    def __init__(self, **kwargs):
        self.inner = torch.cuda.amp.GradScaler(**kwargs)  # the old alias of torch.amp.GradScaler


class ScalerUpdatesWithTorchsOp(_Scaler):
    """update() by torch's own C++ op, found by a computed name: no name in the source to see."""

    def update(self):
        scale = torch.tensor([self.value])
        tracker = torch.tensor([self.tracker], dtype=torch.int32)
        found = torch.tensor([float(self.found_inf)])
        getattr(torch, "_amp_" + "update_scale_")(scale, tracker, found, self.growth, self.backoff,
                                                  self.interval)
        self.value, self.tracker = scale.item(), int(tracker.item())
        self.found_inf = self.unscaled = False


class ScalerWrapsShardedGradScaler(ScalerWrapsGradScaler):
    def __init__(self, **kwargs):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        self.inner = ShardedGradScaler("cpu", **kwargs)


# --------------------------------------------------------------------------- task 7.2


def _saved(fn, args, *, key, size, skip_params=True):
    found = {}

    def pack(t):
        if not (skip_params and (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter))):
            found[key(t)] = size(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(found.values())


def _storage(t):
    return t.untyped_storage().data_ptr()


def saved_bytes_per_tensor(fn, *args):
    return _saved(fn, args, key=id, size=lambda t: t.untyped_storage().nbytes())


def saved_bytes_with_parameters(fn, *args):
    return _saved(fn, args, key=_storage, size=lambda t: t.untyped_storage().nbytes(), skip_params=False)


def saved_bytes_of_views(fn, *args):
    return _saved(fn, args, key=_storage, size=lambda t: t.numel() * t.element_size())


# --------------------------------------------------------------------------- task 7.3


def _checkpointing(*, restore_rng=True, fork=True, detach=True, grad_inputs=True, no_grad=True,
                   first=False, torch_checkpoint=False, keep_graph=False):
    """An apply_checkpointing whose checkpoint has one of its steps changed."""

    class Checkpoint(torch.autograd.Function):
        @staticmethod
        def forward(ctx, fn, x):
            ctx.fn, ctx.rng = fn, torch.get_rng_state()
            ctx.save_for_backward(x)
            if no_grad:
                with torch.no_grad():
                    return fn(x)
            with torch.enable_grad():
                out = fn(x)
            if keep_graph:
                ctx.out = out  # "in case backward needs it": the block's whole graph stays alive
            return out.detach()

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            if detach:
                x = x.detach().requires_grad_(grad_inputs)
            if restore_rng and fork:
                with torch.random.fork_rng(devices=[]), torch.enable_grad():
                    torch.set_rng_state(ctx.rng)
                    out = ctx.fn(x)
            else:
                if restore_rng:
                    torch.set_rng_state(ctx.rng)
                with torch.enable_grad():
                    out = ctx.fn(x)
            if detach:
                out.backward(grad)
                return None, x.grad
            return None, torch.autograd.grad(out, x, grad)[0]

    def checkpoint(fn, x):
        if torch_checkpoint:
            from torch.utils.checkpoint import checkpoint as torch_ckpt

            return torch_ckpt(fn, x, use_reentrant=True)
        return Checkpoint.apply(fn, x)

    class Wrapped(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x):
            return checkpoint(self.block, x)

    def apply_checkpointing(model, every=1):
        for i, block in enumerate(model.blocks):
            if (i % every == 0) if first else ((i + 1) % every == 0):
                model.blocks[i] = Wrapped(block)
        return model

    return apply_checkpointing


# --------------------------------------------------------------------------- task 7.4


class _Ready(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def _pool(self, h, lengths):
        mask = torch.arange(h.shape[1]) < lengths.unsqueeze(1)  # (B, T)
        return (h * mask.unsqueeze(2)).sum(1) / lengths.unsqueeze(1)

    def _clip(self, pooled):
        norm = pooled.norm()
        return torch.where(norm > self.model.max_norm, pooled * (self.model.max_norm / norm), pooled)

    def forward(self, tokens, lengths):
        m = self.model
        h = torch.tanh(m.mix(m.embed(tokens)))
        return m.head(self._clip(self._pool(h, lengths)))


class ReadyKeepsItemBranch(_Ready):
    def _clip(self, pooled):
        norm = pooled.norm()
        if norm.item() > self.model.max_norm:
            pooled = pooled * (self.model.max_norm / norm)
        return pooled


class ReadyKeepsPrint(_Ready):
    def _pool(self, h, lengths):
        print("pooling", tuple(h.shape))
        return super()._pool(h, lengths)


class ReadyKeepsLengthLoop(_Ready):
    def _pool(self, h, lengths):
        total = torch.zeros(h.shape[0], h.shape[2])
        for t in range(int(lengths.max())):
            total = total + h[:, t] * (t < lengths).unsqueeze(1)
        return total / lengths.unsqueeze(1)


class ReadyMeansOverPadding(_Ready):
    def _pool(self, h, lengths):
        mask = torch.arange(h.shape[1]) < lengths.unsqueeze(1)
        return (h * mask.unsqueeze(2)).sum(1) / h.shape[1]  # divides by T, not the length


class ReadyRecompilesPerLength(_Ready):
    """Builds the positions from a Python range: the length becomes a constant of the graph,
    so every new sequence length compiles again."""

    def _pool(self, h, lengths):
        positions = torch.tensor(list(range(h.shape[1])))  # (T,) from Python ints
        mask = positions < lengths.unsqueeze(1)
        return (h * mask.unsqueeze(2)).sum(1) / lengths.unsqueeze(1)


class ReadyAlwaysClips(_Ready):
    def _clip(self, pooled):
        return pooled * (self.model.max_norm / pooled.norm())


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


class ReadyCopiesTheModel(_Ready):
    def __init__(self, model):
        import copy

        super().__init__(copy.deepcopy(model))  # gradients reach the copy, not the model


BUGS = {
    "7.1": [
        ("tests the whole gradient, plain or DTensor: under FSDP2 a plain flag plus a DTensor "
         "fails", edited_solution("07_memory_speed.py", (
             "p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad", "p.grad",
         )).DynamicLossScaler),
        ("a frozen parameter's .grad (None) is tested and unscaled: TypeError",
         edited_solution("07_memory_speed.py", (
             "for group in optimizer.param_groups for p in group[\"params\"]\n"
             "                 if p.grad is not None]",
             "for group in optimizer.param_groups for p in group[\"params\"]]",
         )).DynamicLossScaler),
        ("unscales fp16 gradients instead of refusing them as GradScaler does",
         edited_solution("07_memory_speed.py", (
             "if any(g.dtype == torch.float16 for g in grads):", "if False:",
         )).DynamicLossScaler),
        ("refuses every gradient that is not fp32: bf16 too",
         edited_solution("07_memory_speed.py", (
             "if any(g.dtype == torch.float16 for g in grads):",
             "if any(g.dtype != torch.float32 for g in grads):",
         )).DynamicLossScaler),
        ("no backoff: the scale stays after an overflow", ScalerNoBackoff),
        ("skipped steps count toward growth", ScalerCountsSkippedSteps),
        ("each rank decides alone whether to skip", ScalerDecidesAlone),
        ("NaN gradients are not detected (isinf only)", ScalerMissesNaN),
        ("step() unscales again after the user's unscale_()", ScalerUnscalesTwice),
        ("wraps torch.amp.GradScaler", ScalerWrapsGradScaler),
        ("wraps torch's ShardedGradScaler", ScalerWrapsShardedGradScaler),
        ("wraps the deprecated torch.cuda.amp.GradScaler", ScalerWrapsDeprecatedCudaGradScaler),
        ("updates the scale with torch's private _amp_update_scale_ op", ScalerUpdatesWithTorchsOp),
    ],
    "7.2": [
        ("counts every saved tensor, not every storage", saved_bytes_per_tensor),
        ("counts parameters", saved_bytes_with_parameters),
        ("counts the bytes of each view instead of its storage", saved_bytes_of_views),
    ],
    "7.3": [
        ("RNG state not restored before recomputing", _checkpointing(restore_rng=False)),
        ("RNG state restored without fork_rng: the generator is left rewound", _checkpointing(fork=False)),
        ("inputs detached without requires_grad: no gradient reaches earlier layers",
         _checkpointing(grad_inputs=False)),
        ("inputs not detached: recomputes on the originals", _checkpointing(detach=False)),
        ("forward runs fn with grad: activations are saved", _checkpointing(no_grad=False)),
        ("forward runs fn with grad and keeps its output on ctx: every activation stays alive",
         edited_solution("07_memory_speed.py", (
             "        with torch.no_grad():  # nothing inside fn is saved for backward\n"
             "            return fn(*args)\n",
             "        with torch.enable_grad():\n"
             "            ctx.out = fn(*args)  # \"in case backward needs it\": its graph stays alive\n"
             "        return ctx.out.detach()\n",
         )).apply_checkpointing),
        ("checkpoints blocks 0, k, 2k, ... instead of the k-th, 2k-th, ...", _checkpointing(first=True)),
        ("wraps torch.utils.checkpoint (reentrant)", _checkpointing(torch_checkpoint=True)),
        ("recomputes without the forward's autocast state: a bf16 forward, an fp32 recomputation",
         edited_solution("07_memory_speed.py", (
             "            for device, enabled, dtype in ctx.autocast:  # the forward's autocast, as it was\n"
             "                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled,\n"
             "                                                   cache_enabled=ctx.autocast_cache))\n",
             "")).apply_checkpointing),
        ("the block's parameters are not inputs of the Function (reentrant style): a block whose "
         "input needs no grad silently gets no gradient", _checkpointing()),
    ],
    "7.4": [
        ("a graph break left in: the .item() branch", ReadyKeepsItemBranch),
        ("a graph break left in: the print", ReadyKeepsPrint),
        ("a graph break left in: the loop up to the longest length", ReadyKeepsLengthLoop),
        ("averages over padding (divides by T)", ReadyMeansOverPadding),
        ("recompiles per sequence length (positions from a Python range)", ReadyRecompilesPerLength),
        ("always rescales to max_norm", ReadyAlwaysClips),
        ("copies the model: its parameters get no gradient", ReadyCopiesTheModel),
        ("returns the model unchanged", lambda model: model),
        ("hides the eager forward in one custom op", ReadyHidesItInACustomOp),
        ("hides the eager forward behind torch.compiler.allow_in_graph",
         ReadyAllowsTheEagerForwardInGraph),
    ],
}
