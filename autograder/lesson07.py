"""Checks for Lesson 07, "Memory and speed": tasks 7.1-7.4.

Task 7.1 ``DynamicLossScaler`` is run side by side with ``torch.amp.GradScaler("cpu")`` over
training runs with injected inf and NaN gradients (one process), and on 4 ranks that each hold
a shard of the gradients, where only rank 2's shard overflows: every rank must skip. Task 7.2
``saved_activation_bytes`` is compared with a trusted count on linear, MLP, attention and
layer-norm modules and with the per-layer formula of Korthikanti et al. (2022) on a transformer
block. Task 7.3 ``apply_checkpointing`` (with the student's ``checkpoint``) must give the
gradients of the plain model bit for bit with dropout on, save the bytes a trusted
checkpointing saves and run each checkpointed block twice. Task 7.4 ``compile_ready`` must
compile with ``fullgraph=True`` (``backend="eager"``: Dynamo's capture without Inductor's
code generation) in one graph across the lengths of one shape, in at most two across three
sequence lengths (none compiled for the third: dynamic shapes), and match
:class:`kit.lessons.precision.GraphBreakNet`.

The untrusted ``run`` halves also notice when torch's own scaler or checkpoint is called
(the registry's ``forbidden`` gate names them for the batch grader). The trusted answers
(torch's GradScaler runs, the saved-bytes count and formula, a reference checkpoint, the eager
GraphBreakNet) live in :mod:`autograder.references.lesson07`. Two tasks state what they bound,
measured below Python: 7.3 the bytes a checkpointed model keeps after its forward
(:mod:`kit.meter`), 7.4 the model FLOPs its captured graph does not show (``FlopCounterMode``).
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from autograder.compare import CheckFailed, assert_same, describe, one_thread, per_rank
from autograder.registry import task
from kit.lessons.models import TinyTransformer, token_batch
from kit.lessons.precision import GraphBreakNet, padded_batch

# --------------------------------------------------------------------------- watching torch's own


@contextlib.contextmanager
def _watch(targets: list[tuple[Any, str, str]]) -> Iterator[list[str]]:
    """Record the names of ``(owner, attribute, name)`` callables called meanwhile."""
    used: list[str] = []
    saved = []
    for owner, attr, name in targets:
        original = getattr(owner, attr)
        saved.append((owner, attr, owner.__dict__[attr]))

        def spy(
            *args: Any, _original: Callable = original, _name: str = name, **kwargs: Any
        ) -> Any:
            if _name not in used:
                used.append(_name)
            return _original(*args, **kwargs)

        is_static = isinstance(owner.__dict__[attr], staticmethod)
        setattr(owner, attr, staticmethod(spy) if is_static else spy)
    try:
        yield used
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)


def _torch_scalers() -> list[tuple[Any, str, str]]:
    from torch.amp.grad_scaler import GradScaler

    # ShardedGradScaler and the torch.cuda/torch.cpu aliases all run GradScaler.__init__.
    return [(GradScaler, "__init__", "torch.amp.GradScaler")]


def _torch_checkpoints() -> list[tuple[Any, str, str]]:
    import torch.utils.checkpoint as tc

    return [(tc.CheckpointFunction, "forward", "torch.utils.checkpoint.checkpoint"),
            (tc, "_checkpoint_without_reentrant_generator", "torch.utils.checkpoint.checkpoint")]


def _no_torch_helper(got: dict[str, Any], what: str) -> None:
    if got.get("uses"):
        raise CheckFailed(f"your code calls {', '.join(got['uses'])}: {what}",
                          expected="your own implementation", got=", ".join(got["uses"]),
                          hint="Build it from tensors, autograd and torch.distributed; the task is "
                               "to write what that function does.")


# --------------------------------------------------------------------------- task 7.1

# bounds nothing: loss scaling keeps small fp16 gradients from flushing to zero; it saves
# neither memory nor time (its cases compare its scales and steps with torch's GradScaler).
SCALER = task(
    "7.1",
    # torch's GradScaler under every name (its module, the deprecated cuda/cpu aliases, FSDP's
    # subclass) and the two C++ ops it is made of.
    forbidden=("torch.amp.GradScaler", "torch.cuda.amp.GradScaler", "torch.cpu.amp.GradScaler",
               "torch.amp.grad_scaler.GradScaler", "torch.amp.grad_scaler",
               "torch.cuda.amp.grad_scaler", "torch.cpu.amp.grad_scaler",
               "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler",
               "torch.distributed.fsdp.sharded_grad_scaler",
               "torch._amp_foreach_non_finite_check_and_unscale_", "torch._amp_update_scale_"),
    hint="Dynamic loss scaling: scale the loss up so that small low-precision gradients do not "
         "flush to zero, divide it out before the step, and skip any step whose gradients "
         "overflowed, on every rank together; the scale backs off after an overflow and grows "
         "after a run of good steps.",
    recipe="scale() returns the loss times the scale. unscale_() runs once per step: if it "
           "already ran, return; otherwise multiply every gradient of the optimizer's groups by "
           "1/scale, note whether any holds an inf or a NaN, all-reduce that flag (MAX) when a "
           "process group of several ranks is initialised, and remember that it ran. step() "
           "calls unscale_(), then steps the optimizer only when no rank found an inf or NaN. "
           "update() multiplies the scale by backoff_factor after a bad step and resets the count "
           "of good steps; otherwise it counts the step, and after growth_interval good steps in "
           "a row multiplies the scale by growth_factor and resets the count; then it clears the "
           "per-step flags. get_scale() returns the scale.",
)

STEPS = 12
SCALER_ARGS = {
    "init_scale": 2.0**10, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3,
}
INF_STEPS, NAN_STEPS = (2, 8), (4,)  # 3 good steps in a row before 2, 7 and 11: growth
SHARD_INF_STEPS = (3, 4, 9)  # on 4 ranks, only in rank 2's shard


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100 + step)
    return torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)


def _train_scaled(make: Callable[..., Any], seed: int, *, shard: tuple[int, int] | None = None,
                  inf_steps: tuple[int, ...] = INF_STEPS, nan_steps: tuple[int, ...] = NAN_STEPS,
                  clip: float | None = None, dtype: torch.dtype = torch.float32,
                  frozen: str | None = None) -> dict[str, Any]:
    """Train the MLP for STEPS steps with the scaler ``make(**SCALER_ARGS)``.

    With ``shard=(rank, world_size)`` the optimizer holds and the rank keeps gradients only of
    parameters ``rank::world_size`` (as after a reduce-scatter), and inf is injected only on
    rank 2. ``dtype`` is the parameters' (and so the gradients') dtype; ``frozen`` names a
    parameter that stays in the optimizer with ``requires_grad=False`` (its ``.grad`` is None).
    Returns per step the scale after ``update()`` and whether the optimizer stepped,
    the default scaler's first scale, and the final parameters this rank owns.
    """
    model = _mlp(seed).to(dtype)
    if frozen is not None:
        model.get_parameter(frozen).requires_grad_(False)
    named = list(model.named_parameters())
    owned = named if shard is None else named[shard[0]::shard[1]]
    optimizer = torch.optim.SGD([p for _, p in owned], lr=0.05, momentum=0.9)
    scaler = make(**SCALER_ARGS)
    inject = shard is None or shard[0] == 2
    scales, stepped = [], []
    for step in range(STEPS):
        x, y = _batch(seed, step)
        optimizer.zero_grad()
        scaler.scale(F.mse_loss(model(x.to(dtype)), y.to(dtype))).backward()
        if shard is not None:
            for _, p in named:
                if not any(p is q for _, q in owned):
                    p.grad = None  # another rank owns this gradient
        if inject and step in inf_steps:
            owned[-1][1].grad[0] = float("inf")
        if inject and step in nan_steps:
            owned[0][1].grad[0, 0] = float("nan")
        before = [p.detach().clone() for _, p in owned]
        if clip is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_([p for _, p in owned], clip)
        scaler.step(optimizer)
        scaler.update()
        scales.append(float(scaler.get_scale()))
        stepped.append(any(not torch.equal(b, p) for b, (_, p) in zip(before, owned)))
        if shard is not None:
            _share_updated(named, shard[1])
    default = float(make().get_scale())
    return {"scales": scales, "stepped": stepped, "default scale": default,
            "params": {n: p.detach().clone() for n, p in owned}, "uses": []}


def _share_updated(named: list[tuple[str, nn.Parameter]], world_size: int) -> None:
    """Every rank gets the parameters each owner just updated (ZeRO's all-gather, as broadcasts)."""
    import torch.distributed as dist

    with torch.no_grad():
        for i, (_, p) in enumerate(named):
            dist.broadcast(p, src=i % world_size)


def _watched_training(impl: Any, seed: int, **kwargs: Any) -> dict[str, Any]:
    with _watch(_torch_scalers()) as used:
        result = _train_scaled(impl, seed, **kwargs)
    result["uses"] = list(used)
    return result


# The causes every case of 7.1 shares: a wrong skip decision or a wrong scale schedule fails
# the clipping and the 4-rank cases in the same way, so they follow the first case's diagnosis.
SKIP_WRONG, SCALE_WRONG = "skip decision", "scale schedule"


def _first_difference(got: list, expected: list) -> tuple[int, Any, Any] | None:
    """The first step at which two per-step records differ, with both entries; else None."""
    return next(((step, g, e) for step, (g, e) in enumerate(zip(got, expected)) if g != e), None)


def _compare_scaled(got: Any, expected: dict[str, Any], where: str = "") -> None:
    _no_torch_helper(got, "the task is a loss scaler of your own")
    if got["default scale"] != expected["default scale"]:
        raise CheckFailed(f"{where}DynamicLossScaler() starts at the wrong scale",
                          expected=expected["default scale"], got=got["default scale"],
                          hint="DynamicLossScaler() with no arguments starts where torch's "
                               "GradScaler starts.",
                          recipe="The defaults are init_scale=2.0**16, growth_factor=2.0, "
                                 "backoff_factor=0.5, growth_interval=2000.")
    if (skip := _first_difference(got["stepped"], expected["stepped"])) is not None:
        step, g, e = skip
        raise CheckFailed(
            f"{where}step {step}: the optimizer {'stepped' if g else 'skipped'}, torch's "
            f"GradScaler {'stepped' if e else 'skipped'} (inf steps {list(INF_STEPS)}, NaN "
            f"steps {list(NAN_STEPS)})", expected=expected["stepped"], got=got["stepped"],
            hint="A step is skipped exactly when some gradient overflowed: an inf or a NaN.",
            cause=SKIP_WRONG,
            recipe="In unscale_(), test every gradient with torch.isfinite (it catches both "
                   "inf and NaN); in step(), skip the optimizer when any test failed.")
    if (scale := _first_difference(got["scales"], expected["scales"])) is not None:
        step, g, e = scale
        raise CheckFailed(
            f"{where}the scale after update() of step {step} is {g}, torch's GradScaler has {e}",
            expected=expected["scales"], got=got["scales"],
            hint="The scale backs off after every overflow and grows only after "
                 "growth_interval good steps in a row.", cause=SCALE_WRONG,
            recipe="After a skipped step: scale *= backoff_factor and the count of good steps "
                   "starts again from 0. After growth_interval good steps in a row: scale *= "
                   "growth_factor and the count starts again.")
    assert_same(got["params"], expected["params"], rtol=1e-6, atol=1e-7, path=f"{where}parameters")


@SCALER.case(f"12 steps with growth_interval=3, inf gradients at steps {list(INF_STEPS)} and a NaN "
             f"at step {NAN_STEPS[0]}: the scales, skipped steps and parameters of "
             "torch.amp.GradScaler('cpu')", compare=_compare_scaled, weight=2,
             expect="scaled_with_torch")
def _(impl: Any, seed: int) -> dict[str, Any]:
    return _watched_training(impl, seed)


def _compare_clipped(got: Any, expected: dict[str, Any]) -> None:
    try:
        _compare_scaled(got, expected)
    except CheckFailed as e:
        if e.cause in (SKIP_WRONG, SCALE_WRONG):  # not the double unscale: said as it is
            raise
        e.hint = ("unscale_() may be called by the user before step() (to clip the true "
                  "gradients): step() must then not unscale a second time. " + e.hint)
        e.recipe = ("Remember in unscale_() that it ran this step and return at once when it is "
                    "called again; update() clears that flag. " + (e.recipe or SCALER.recipe))
        raise


@SCALER.case("unscale_(), clip_grad_norm_ to 0.5, then step(): gradients unscaled once, as "
             "with GradScaler", compare=_compare_clipped, expect="clipped_with_torch")
def _(impl: Any, seed: int) -> dict[str, Any]:
    return _watched_training(impl, seed, clip=0.5)


# The edges the task names, each against torch's GradScaler in one process.
FROZEN = "2.weight"  # in the optimizer, requires_grad=False: no .grad, ever


def _compare_regime(where: str) -> Callable[[Any, Any], None]:
    def compare(got: Any, expected: dict[str, Any]) -> None:
        try:
            _compare_scaled(got, expected, where=f"{where}: ")
        except CheckFailed as e:
            e.cause = ""  # its own regime: not a consequence of the plain run's diagnosis
            raise

    return compare


def _edge_training(impl: Any, seed: int, **kwargs: Any) -> Any:
    try:
        return _watched_training(impl, seed, **kwargs)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - the student's error becomes the finding
        return f"{type(e).__name__}: {e}"[:300]


def _regime_case(name: str, where: str, expect: str, hint: str, **kwargs: Any) -> None:
    compare = _compare_regime(where)

    def judge(got: Any, expected: dict[str, Any]) -> None:
        if isinstance(got, str):
            raise CheckFailed(f"{where}: training raised {got}", expected="torch's GradScaler's "
                              "scales, skipped steps and parameters", got=got, hint=hint)
        compare(got, expected)

    SCALER.case(name, compare=judge, weight=0.5, expect=expect, hint=hint)(
        lambda impl, seed: _edge_training(impl, seed, **kwargs))


_regime_case(f"a frozen parameter in the optimizer ({FROZEN}, requires_grad=False: .grad is "
             "None): left alone, the rest as with GradScaler",
             f"a frozen parameter ({FROZEN}, .grad None)", "frozen_with_torch",
             "A parameter of the optimizer may have no gradient (frozen, or unused this step): "
             "there is nothing to test or unscale, so skip it.", frozen=FROZEN)
_regime_case("bf16 parameters and gradients: unscaled and skipped as with GradScaler",
             "bf16 gradients", "bf16_with_torch",
             "bf16 has fp32's range: its gradients are unscaled and tested like fp32 ones (torch's "
             "GradScaler accepts them); only fp16 gradients are refused.", dtype=torch.bfloat16)


def _fp16_step(make: Callable[..., Any], seed: int) -> dict[str, Any]:
    """One scaled step of the MLP cast to fp16 (fp16 parameters, so fp16 gradients): what
    ``step()`` raised, and whether the parameters changed."""
    model = _mlp(seed).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = make(**SCALER_ARGS)
    x, y = _batch(seed, 0)
    scaler.scale(F.mse_loss(model(x.half()), y.half())).backward()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        scaler.step(optimizer)
        raised, message = None, ""
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - what it raised is the finding
        raised, message = type(e).__name__, str(e)[:300]
    changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    return {"raised": raised, "message": message, "stepped": changed}


def _compare_fp16(got: Any, expected: dict[str, Any]) -> None:
    where = "fp16 gradients (the model cast to fp16, no fp32 weights)"
    if got["raised"] != "ValueError":
        if got["raised"]:
            did = "raised " + got["raised"] + ": " + got["message"]
        else:
            did = "stepped" if got["stepped"] else "returned"
        raise CheckFailed(
            f"{where}: step() {did}, where torch's GradScaler raises a ValueError",
            expected=f"ValueError: {expected['message']}",
            got=got["raised"] or "no error",
            hint="Scaled fp16 gradients overflow and unscaling them in fp16 loses what the scale "
                 "saved: torch's GradScaler refuses them. Raise a ValueError that names fp16 when "
                 "a gradient is float16 (bf16 and fp32 are fine).")
    if not re.search(r"fp16|float16|half", got["message"], re.IGNORECASE):
        raise CheckFailed(f"{where}: the ValueError does not name the constraint",
                          expected="a message naming fp16 / float16 gradients", got=got["message"],
                          hint="Say what is wrong: the gradients are fp16.")
    if got["stepped"]:
        raise CheckFailed(f"{where}: the parameters changed before the ValueError",
                          expected="unchanged", got="changed",
                          hint="Refuse before unscaling or stepping anything.")


SCALER.case("fp16 gradients (the model cast to fp16): step() raises a ValueError naming fp16, as "
            "GradScaler", compare=_compare_fp16, weight=0.5, expect="fp16_with_torch")(
    lambda impl, seed: _fp16_step(impl, seed))


WORLD = 4


def _sharded_on_rank(impl: Any, seed: int) -> dict[str, Any]:
    import torch.distributed as dist

    return _watched_training(impl, seed, shard=(dist.get_rank(), dist.get_world_size()),
                             inf_steps=SHARD_INF_STEPS, nan_steps=())


def _compare_sharded(got: Any, expected: list[dict[str, Any]]) -> None:
    got = per_rank(got, len(expected), "training run")
    for step in range(STEPS):
        decisions = [run["stepped"][step] for run in got]
        if len(set(decisions)) > 1:
            raise CheckFailed(
                f"step {step}: ranks disagree on skipping "
                f"({['stepped' if d else 'skipped' for d in decisions]}); "
                "only rank 2's shard held an inf", expected=[expected[0]["stepped"][step]] * WORLD,
                got=decisions,
                hint="Each rank sees only its own shard of the gradients, so an overflow on one "
                     "rank must stop the step on all of them.",
                recipe="In unscale_(), keep the found-inf flag in a tensor and all-reduce it "
                       "(op=MAX, or SUM) when a process group of several ranks is initialised, "
                       "before step() decides, so that every rank skips and backs off together.")
    for rank, (g, e) in enumerate(zip(got, expected)):
        _compare_scaled(g, e, where=f"rank {rank}: ")


SCALER.case(f"4 ranks, each holding a quarter of the gradients; inf only in rank 2's shard at "
            f"steps {list(SHARD_INF_STEPS)}: every rank skips and backs off",
            uses=SCALER.shared(_sharded_on_rank, world_size=WORLD, timeout=30.0),
            compare=_compare_sharded, weight=2, expect="sharded_with_torch")


FSDP_WORLD = 2


def _fsdp2_on_rank(impl: Any, seed: int) -> dict[str, Any]:
    """The MLP under FSDP2 (each Linear and the root fully_shard-ed: the gradients are DTensors
    sharded over 2 ranks); same batch on each rank, so the averaged gradients are one process's.
    At SHARD_INF_STEPS rank 1 puts an inf into its local shard of the last weight (global row 2)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = _mlp(seed)
    for i in (0, 2, 4):
        fully_shard(model[i])
    fully_shard(model)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    with _watch(_torch_scalers()) as used:
        scaler = impl(**SCALER_ARGS)
        scales, stepped = [], []
        for step in range(STEPS):
            x, y = _batch(seed, step)
            optimizer.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            if dist.get_rank() == 1 and step in SHARD_INF_STEPS:
                model[4].weight.grad.to_local()[0] = float("inf")
            before = [p.detach().to_local().clone() for p in params]
            scaler.step(optimizer)
            scaler.update()
            scales.append(float(scaler.get_scale()))
            stepped.append(any(not torch.equal(b, p.detach().to_local())
                               for b, p in zip(before, params)))
        default = float(impl().get_scale())
    return {"scales": scales, "stepped": stepped, "default scale": default, "uses": list(used),
            "params": {n: p.detach().full_tensor() for n, p in model.named_parameters()}}


def _compare_fsdp2(got: Any, expected: dict[str, Any]) -> None:
    got = per_rank(got, FSDP_WORLD, "training run")
    for rank, g in enumerate(got):
        try:
            _compare_scaled(g, expected, where=f"FSDP2, rank {rank}: ")
        except CheckFailed as e:
            e.cause = ""  # its own regime: not a consequence of the plain run's diagnosis
            raise


SCALER.case(f"FSDP2 on {FSDP_WORLD} ranks: gradients are sharded DTensors, inf only in rank 1's "
            f"shard at steps {list(SHARD_INF_STEPS)}; every rank skips, as torch's GradScaler "
            "over the whole model", uses=SCALER.shared(_fsdp2_on_rank, world_size=FSDP_WORLD,
                                                        timeout=30.0),
            compare=_compare_fsdp2, expect="fsdp2_with_torch",
            hint="Under FSDP2 each gradient is a DTensor: this rank holds one shard of it "
                 "(grad.to_local()). A plain tensor cannot be added to a DTensor, and the shard "
                 "is all this rank has to test and unscale.",
            recipe="For each gradient take g = grad.to_local() when it is a DTensor "
                   "(torch.distributed.tensor.DTensor), test and unscale g in place, keep the "
                   "found-inf flag in a plain tensor and all-reduce it (MAX) over the ranks.")


# --------------------------------------------------------------------------- task 7.2

# bounds nothing: saved_activation_bytes is a meter of what autograd saves; it saves nothing
# (its cases compare its count with the reference's and with the per-layer formula).
SAVED = task(
    "7.2",
    forbidden=("autograder.references.lesson07.saved_activation_bytes",),
    hint="Autograd can tell you every tensor it keeps for backward as it keeps it; what costs "
         "memory is the storage behind a tensor, and several saved tensors (views, a weight and "
         "its transpose) can share one storage. Parameters are not activations.",
    recipe="Run fn under saved-tensor hooks (torch.autograd.graph); the pack hook sees each saved "
           "tensor and returns it unchanged. Leave out parameters and views of parameters. "
           "Remember each remaining tensor's storage size keyed by the storage's address, so "
           "that a storage counts once, and add up what you remembered.",
)


class _Attention(nn.Module):
    """Causal self-attention ``(B, T, D) -> (B, T, D)``: fused qkv, SDPA, output projection."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


B, T, D, HEADS = 2, 16, 32, 4


def _modules(seed: int) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    torch.manual_seed(seed)
    x = torch.randn(B, T, D, requires_grad=True)
    return {
        "linear": (nn.Linear(D, 48), x),
        "mlp": (nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)), x),
        "attention": (_Attention(D, HEADS), x),
        "layer norm": (nn.LayerNorm(D), x),
        "frozen linear, input without grad": (nn.Linear(D, D).requires_grad_(False), x.detach()),
    }


def _saved_case(name: str) -> None:
    def run(impl: Any, seed: int) -> Any:
        module, x = _modules(seed)[name]
        got = impl(module, x)
        return got if isinstance(got, int) and not isinstance(got, bool) else repr(got)[:100]

    def expect(seed: int) -> int:
        return SAVED.trusted("module_saved_bytes")(seed, name)

    def compare(got: Any, expected: int) -> None:
        if not isinstance(got, int):
            raise CheckFailed(f"{name}: expected a Python int of bytes", expected=expected, got=got,
                              hint="Return sum(...) of ints, not a tensor.")
        if got != expected:
            raise CheckFailed(f"{name} on a (2, 16, 32) fp32 input: wrong number of saved bytes",
                              expected=expected, got=got)

    SAVED.case(f"{name} block", compare=compare, expect=expect)(run)


for _name in ("linear", "mlp", "attention", "layer norm", "frozen linear, input without grad"):
    _saved_case(_name)


@SAVED.case("a TinyTransformer block (T=16, B=2, D=32, 4 heads): the per-layer formula of "
            "Korthikanti et al. (2022)", expect="block_formula")
def _(impl: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    block = TinyTransformer(vocab=8, dim=D, layers=1, heads=HEADS, context=T).blocks[0]
    got = impl(block, torch.randn(B, T, D, requires_grad=True))
    return got if isinstance(got, int) and not isinstance(got, bool) else repr(got)[:100]


# --------------------------------------------------------------------------- task 7.3

CHECKPOINT = task(
    "7.3",
    # torch's checkpointing: all of torch.utils.checkpoint (its private generator and hooks too),
    # the distributed checkpoint_wrapper's module and the composable checkpoint.
    forbidden=("torch.utils.checkpoint.checkpoint", "torch.utils.checkpoint.checkpoint_sequential",
               "torch.utils.checkpoint.CheckpointFunction", "torch.utils.checkpoint",
               "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper",
               "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
               "torch.distributed._composable.checkpoint_activation",
               "autograder.references.lesson07.Checkpoint",
               "autograder.references.lesson07.apply_checkpointing"),
    hint="Checkpointing trades compute for memory: forward keeps only the inputs, backward "
         "recomputes the block with grad on and backpropagates through the recomputation. "
         "Dropout must draw the same mask both times, and nothing else may notice.",
    recipe="In forward, keep the function, the CPU RNG state and the inputs, and run the block "
           "without grad. In backward, take detached copies of the inputs that require grad as "
           "the originals did; inside a forked RNG set the saved state and recompute with grad "
           "on; backpropagate the incoming gradients and return the inputs' gradients (none for "
           "the function). apply_checkpointing swaps every every-th block of model.blocks (the "
           "last of each group of every) for a module whose forward calls checkpoint.",
)

LAYERS, VOCAB, DROPOUT = 4, 32, 0.3


def _dropout_model(seed: int, frozen: bool = False) -> nn.Module:
    """A 4-block TinyTransformer whose blocks end in dropout, in training mode. ``frozen``:
    the embeddings need no grad (so the first block's input needs none) and neither does the
    second block's qkv weight."""
    torch.manual_seed(seed)
    model = TinyTransformer(vocab=VOCAB, dim=D, layers=LAYERS, heads=HEADS, context=T)
    model.blocks = nn.ModuleList(
        nn.Sequential(block, nn.Dropout(DROPOUT)) for block in model.blocks
    )
    if frozen:
        for p in (model.tok.weight, model.pos.weight, model.blocks[1][0].qkv.weight):
            p.requires_grad_(False)
    return model.train()


# The regimes a real run reaches beyond fp32 with every input needing grad: each a case.
CHECKPOINT_REGIMES = {
    "bf16 autocast": {"autocast": True},
    "frozen embeddings and a frozen weight": {"frozen": True},
}


def _step_grads(model: nn.Module, named: list[tuple[str, nn.Parameter]], seed: int,
                autocast: bool = False) -> dict[str, Any]:
    """One forward and backward with a fixed RNG (under CPU bf16 autocast if ``autocast``);
    every original parameter's gradient and the next random number (the RNG must be where it
    would be without checkpointing)."""
    x, y = token_batch(B, T, VOCAB, seed)
    torch.manual_seed(seed + 1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(x)
    F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
    after = torch.rand(3)
    return {"grads": {n: None if p.grad is None else p.grad.clone() for n, p in named},
            "rng after backward": after}


def _apply(impl: Any, model: nn.Module, every: int) -> nn.Module:
    out = impl(model, every=every)
    if out is not model:
        raise TypeError(f"apply_checkpointing must return the model it was given (it changes "
                        f"model.blocks in place), got {type(out).__name__}")
    return model


def _checkpointed_grads(impl: Any, seed: int, every: int, autocast: bool = False,
                        frozen: bool = False) -> dict[str, Any]:
    with one_thread():
        model = _dropout_model(seed, frozen)
        named = list(model.named_parameters())  # names before wrapping: wrapping renames them
        with _watch(_torch_checkpoints()) as used:
            result = _step_grads(_apply(impl, model, every), named, seed, autocast)
    return {**result, "uses": list(used)}


def _compare_bitwise(got: Any, expected: dict[str, Any]) -> None:
    _no_torch_helper(got, "the task is a checkpoint of your own")
    for name, want in expected["grads"].items():
        have = got["grads"].get(name)
        if want is None:  # a frozen parameter
            if have is not None:
                raise CheckFailed(f"{name} needs no grad, yet got a gradient", expected=None,
                                  got=describe(have, 60),
                                  hint="Return a gradient only for what needs one "
                                       "(ctx.needs_input_grad).")
            continue
        if have is None:
            raise CheckFailed(f"{name} got no gradient", expected="a gradient", got=None,
                              hint="Backward must hand each input's gradient back to the outer "
                                   "graph, and must accumulate into the model's own parameters "
                                   "(do not copy the block).")
        if not torch.equal(have, want):
            diff = (have - want).abs().max().item()
            raise CheckFailed(f"{name}.grad differs from the model without checkpointing "
                              f"(max abs difference {diff:.3g}): it must be equal bit for bit",
                              expected="the same gradient", got=f"max abs difference {diff:.3g}",
                              hint="Dropout must draw the same mask when the block is recomputed: "
                                   "save torch.get_rng_state() in forward and set it before "
                                   "recomputing. Detach the saved inputs and set requires_grad "
                                   "so that backward through the recomputation stops at them.")
    if not torch.equal(got["rng after backward"], expected["rng after backward"]):
        raise CheckFailed("after backward, the random number generator is not where it would be "
                          "without checkpointing", expected=expected["rng after backward"],
                          got=got["rng after backward"],
                          hint="Restore the RNG state inside a forked RNG (torch.random), "
                               "so that the generator continues afterwards as if nothing happened.")


for _every in (1, 2):
    CHECKPOINT.case(f"every={_every}, dropout {DROPOUT} after each block: gradients bit for bit "
                    "equal to no checkpointing, RNG left untouched", compare=_compare_bitwise,
                    weight=1.5, expect="plain_grads")(
        lambda impl, seed, _every=_every: _checkpointed_grads(impl, seed, _every))

_REGIME_HINTS = {
    "bf16 autocast": ("Autocast is thread-local state, and backward runs outside the forward's "
                      "autocast region: a recomputation that does not restore it runs in fp32, "
                      "and the gradients change (torch's checkpoint saves and restores it).",
                      "In forward, keep torch.is_autocast_enabled(device), "
                      "torch.get_autocast_dtype(device) and torch.is_autocast_cache_enabled() for "
                      "'cpu' (and the inputs' device); recompute inside torch.autocast(device, "
                      "dtype=..., enabled=..., cache_enabled=...) with them."),
    "frozen embeddings and a frozen weight": (
        "When no input of an autograd.Function needs grad, its output needs none and its "
        "backward never runs: a block whose input comes from frozen embeddings silently gets no "
        "gradient for its parameters, nor does any later checkpointed block.",
        "Make the block's trainable parameters inputs of the Function too (they are not saved, "
        "only passed), differentiate the recomputed "
        "output with respect to whichever inputs and parameters need a gradient, and return "
        "those; a frozen parameter gets "
        "none."),
}


def _compare_regime(got: Any, expected: dict[str, Any], regime: str) -> None:
    """:func:`_compare_bitwise`, its feedback naming the regime and what it takes."""
    try:
        _compare_bitwise(got, expected)
    except CheckFailed as e:
        if getattr(e, "forbidden_use", None):
            raise
        e.message = f"with {regime}: {e.message}"
        e.args = (e.message,)
        e.hint, e.recipe = _REGIME_HINTS[regime]
        raise


for _regime, _settings in CHECKPOINT_REGIMES.items():
    CHECKPOINT.case(f"every=1 with {_regime}: gradients bit for bit equal to no checkpointing "
                    "(as torch's checkpoint gives them)",
                    compare=partial(_compare_regime, regime=_regime),
                    expect=partial(lambda seed, r: CHECKPOINT.trusted("plain_grads")(seed, r),
                                   r=_regime),
                    hint=_REGIME_HINTS[_regime][0], recipe=_REGIME_HINTS[_regime][1])(
        lambda impl, seed, _settings=_settings: _checkpointed_grads(impl, seed, 1, **_settings))


EVERY = (1, 2, 3, 4)


def _saved_storages(module: nn.Module, x: torch.Tensor) -> list[list[int]]:
    """What autograd saves for backward in a forward of ``module`` on ``x``: per saved tensor,
    ``[its storage's address, the storage's bytes, 1 if a parameter owns it]`` (the trusted side
    adds them up)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    records: list[list[int]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        records.append([s.data_ptr(), s.nbytes(), int(s.data_ptr() in params)])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return records


def _kept_after_forward(model: nn.Module, seed: int) -> int:
    """Bytes alive after a forward of ``model`` on the check's batch, as the meter sees them:
    everything kept for backward (wherever it is kept) and the logits."""
    from kit import meter

    x, _ = token_batch(B, T, VOCAB, seed)
    with meter.track() as usage:
        out = model(x)
        usage.mark("after forward")
        del out
    return usage.marks["after forward"]


def _bytes_and_calls(impl: Any, seed: int) -> dict[str, Any]:
    """Per ``every``: what a forward saves for backward and each block's forward calls in one
    forward and backward; with every block checkpointed, the bytes kept after the forward."""
    x, y = token_batch(B, T, VOCAB, seed)
    saved, calls = {}, {}
    # One intra-op thread: nothing here depends on the summation order, and on a loaded 2-core
    # machine a thread pool's barriers make these small ops many times slower.
    with one_thread(), _watch(_torch_checkpoints()) as used:
        for every in EVERY:
            model = _apply(impl, _dropout_model(seed), every)
            saved[every] = _saved_storages(model, x)
            model = _dropout_model(seed)
            counts = [0] * LAYERS
            for i, block in enumerate(model.blocks):
                block[0].mlp.register_forward_hook(
                    lambda *_, i=i, counts=counts: counts.__setitem__(i, counts[i] + 1))
            _apply(impl, model, every)
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            calls[every] = counts
        kept = _kept_after_forward(_apply(impl, _dropout_model(seed), 1), seed)
    return {"saved": saved, "calls": calls, "uses": list(used), "kept after forward": kept}


def _compare_bytes(got: Any, expected: dict[str, Any]) -> None:
    _no_torch_helper(got, "the task is a checkpoint of your own")
    count = CHECKPOINT.trusted("saved_bytes")
    for every in EVERY:
        g, e = count(got["saved"][every]), expected["saved"][every]
        if g != e:
            n = LAYERS // every
            # what was kept that a checkpoint frees, in the direction the data shows
            kept = (f": {g - e} bytes beyond the checkpointed blocks' inputs are kept for "
                    "backward (activations it recomputes)" if g > e else "")
            raise CheckFailed(
                f"every={every} ({n} of {LAYERS} blocks checkpointed): {g} bytes saved for "
                f"backward, expected {e} (without checkpointing: {expected['plain']}){kept}",
                expected=e, got=g,
                hint="A checkpointed block keeps only its input, with ctx.save_for_backward (so "
                     "it is counted, and in-place changes are caught); fn runs under "
                     "torch.no_grad() so none of its activations are saved. Wrap the blocks "
                     "with (i + 1) % every == 0.")


# One run serves the saved-bytes, forward-calls and kept-after-forward cases.
BYTES_AND_CALLS = CHECKPOINT.shared(_bytes_and_calls)

CHECKPOINT.case(f"saved bytes for every={list(EVERY)}: each checkpointed block keeps only its "
                "input (measured as in Task 7.2)", uses=BYTES_AND_CALLS, compare=_compare_bytes,
                expect="bytes_and_calls_expected", weight=3, saving=True)


def _compare_calls(got: Any, expected: dict[str, Any]) -> None:
    _no_torch_helper(got, "the task is a checkpoint of your own")
    for every in EVERY:
        if got["calls"][every] != expected["calls"][every]:
            raise CheckFailed(
                f"every={every}: forward calls per block in one training step "
                f"(blocks 1..{LAYERS})", expected=expected["calls"][every], got=got["calls"][every],
                hint="A checkpointed block runs twice (forward, then the recomputation in "
                     "backward), the others once. Checkpoint the every-th, 2*every-th, ... "
                     "block counting from 1, and recompute once per backward.")


CHECKPOINT.case(f"each checkpointed block's forward runs exactly twice per step, the others "
                f"once (every={list(EVERY)})", uses=BYTES_AND_CALLS, compare=_compare_calls,
                expect="bytes_and_calls_expected")
# What checkpointing saves, seen by the meter (not by saved-tensor hooks): with every block
# checkpointed, the model keeps 49 KB after the forward, 43% of the bound (what the trusted
# checkpoint keeps + one block's 67 KB of activations by the formula); keeping every block's
# activations (295 KB without checkpointing) is 2.6x the bound.
CHECKPOINT.bound(
    "bytes kept after the forward with every block checkpointed",
    formula="what a checkpoint keeps (each block's input) + one block's activations",
    lost="the blocks' activations are kept although backward recomputes them: checkpointing "
         "saves memory only if nothing of fn but its inputs outlives the forward",
    hint="Memory is saved only by what is freed: a block run with grad keeps its whole graph "
         "(every saved activation) alive for as long as anything refers to its output, on ctx or "
         "elsewhere.",
    recipe="In forward, run fn under torch.no_grad() and keep nothing of its result but what "
           "you return; keep only the inputs (save_for_backward) and the RNG state, and build "
           "the graph again in backward.",
    expect="kept_after_forward_bound", uses=BYTES_AND_CALLS, weight=3,
    pick=lambda run: {"measured": [run["kept after forward"]]})


# --------------------------------------------------------------------------- task 7.4

# bounds: the model FLOPs the captured graph does not show (FlopCounterMode, per node of
# Dynamo's graph): a graph of the model's real operators shows them all, a forward hidden in one
# opaque call (a custom op, an allow_in_graph function) shows none.
# forbids nothing: no library removes graph breaks. The escape hatches that hide them (a custom
# op, allow_in_graph, a module kept whole) put an opaque node in the graph: the compiled run
# refuses it as a ForbiddenUse (the task scores 0), and the bound shows the FLOPs it hid.
READY = task(
    "7.4",
    hint="Graph breaks come from Python that needs a value Dynamo cannot know while tracing: a "
         "side effect (print), a loop whose trip count is data, an if on .item(). Written as "
         "tensor operations instead, one graph serves every batch.",
    recipe="Make a module that keeps the model and recomputes its forward with the model's own "
           "layers (embed, mix with tanh, head), so that gradients reach its parameters. Drop "
           "the print. Replace the loop up to the longest length by a (B, T) boolean mask that "
           "compares each position with its sequence's length, then a masked sum over positions "
           "divided by the lengths. Replace the Python if on .item() by torch.where between the "
           "rescaled and the plain averages: it computes both sides and picks one. "
           "compile_ready returns that module.",
)

# Three batches of one shape (different lengths inside), then two more sequence lengths: with
# automatic dynamic shapes the second length compiles once more with T symbolic, and the third
# reuses that graph.
BATCHES = [(4, 7, 11), (4, 7, 12), (4, 7, 13), (4, 9, 14), (4, 12, 15)]
SAME_SHAPE = 3  # the first SAME_SHAPE batches share (B, T)
# Scaling the embeddings between batches puts the pooled norm below, above, then far above
# max_norm, so both sides of the branch are taken.
EMBED_FACTORS = (0.05, 40.0, 2.0, 0.1, 10.0)


def _graph_break_model(seed: int) -> GraphBreakNet:
    torch.manual_seed(seed)
    return GraphBreakNet()


def _forward_backward(
    module: Callable[..., torch.Tensor], model: nn.Module, seed: int
) -> dict[str, Any]:
    out = []
    for (b, t, s), factor in zip(BATCHES, EMBED_FACTORS):
        tokens, lengths = padded_batch(b, t, 32, seed * 31 + s)
        model.zero_grad()
        with torch.no_grad():
            model.embed.weight.mul_(factor)
        logits = module(tokens, lengths)
        logits.square().sum().backward()
        out.append({"logits": logits.detach().clone(),
                    "grads": {n: None if p.grad is None else p.grad.clone()
                              for n, p in model.named_parameters()}})
    return {"batches": out}


def _forwards(module: Callable[..., torch.Tensor], seed: int,
              after: Callable[[], None] = lambda: None) -> None:
    """The forwards of the checks' batches alone (what the FLOPs are counted on); ``after`` runs
    after each."""
    for b, t, s in BATCHES:
        module(*padded_batch(b, t, 32, seed * 31 + s))
        after()


def _opaque(node: torch.fx.Node) -> bool:
    """Whether a node of Dynamo's graph hides its operators: a custom op (an op of a namespace
    other than aten's or prims'), or a function of the student's code placed in the graph whole
    (allow_in_graph), or a module that is not torch's."""
    target = node.target
    if node.op == "call_function":
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return target.namespace not in ("aten", "prims")
        module = getattr(target, "__module__", None) or ""
        return callable(target) and hasattr(target, "__code__") and not module.startswith(
            ("torch", "_operator", "operator", "math"))
    if node.op == "call_module":
        owner = node.graph.owning_module
        sub = owner.get_submodule(target) if owner is not None else None
        return sub is not None and not type(sub).__module__.startswith("torch.")
    return False


def _describe(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        name = target._opname if hasattr(target, "_opname") else target
        return f"the custom op {target.namespace}::{name}"
    if node.op == "call_module":
        return f"the module {target!r} placed in the graph whole"
    return f"{getattr(target, '__qualname__', target)!s} placed in the graph whole (allow_in_graph)"


class _ShownFlops(torch.fx.Interpreter):
    """Runs a captured graph node by node, counting the FLOPs of the nodes that are operators
    the compiler can see (FlopCounterMode); an opaque node runs uncounted."""

    def __init__(self, gm: torch.fx.GraphModule, shown: list[int]) -> None:
        super().__init__(gm)
        self.shown = shown

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op not in ("call_function", "call_method", "call_module") or _opaque(n):
            return super().run_node(n)
        from kit import meter

        with meter.count_flops() as flops:
            out = super().run_node(n)
        self.shown[0] += flops.total
        return out


def _compiled_run(compile_ready: Any, seed: int) -> dict[str, Any]:
    import torch._dynamo

    from kit import meter

    with meter.count_flops() as eager, contextlib.redirect_stdout(io.StringIO()):
        _forwards(_graph_break_model(seed), seed)
    model = _graph_break_model(seed)
    ready = compile_ready(model)
    graphs: list[int] = []
    shown = [0]

    hidden: list[str] = []  # the opaque calls of every captured graph

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        graphs.append(len(gm.graph.nodes))
        hidden.extend(_describe(n) for n in gm.graph.nodes if _opaque(n))
        return _ShownFlops(gm, shown).run  # the captured graph as is, as backend="eager" runs it

    torch._dynamo.reset()
    compiled = torch.compile(ready, fullgraph=True, backend=backend)
    flops = {"eager flops": eager.total, "flops in the graph": 0}
    per_batch: list[int] = []  # graphs compiled so far, after each batch's forward
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            # counted: forwards only, as the eager model's
            _forwards(compiled, seed, after=lambda: per_batch.append(len(graphs)))
            flops["flops in the graph"] = shown[0]
            result = _forward_backward(compiled, model, seed)
    except Exception as e:  # Dynamo's Unsupported / UserError: a graph break under fullgraph
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return {"compiled": f"{type(e).__name__}: {first[:300]}", "graphs": len(graphs),
                "graphs after each batch": per_batch, **flops}
    finally:
        torch._dynamo.reset()
    if hidden:  # the breaks are not removed, only hidden from the compiler: the task is not done
        from autograder.gates import ForbiddenUse

        raise ForbiddenUse("7.4", f"an opaque call in the captured graph, {hidden[0]}, which hides "
                                  "the forward from the compiler (the graph breaks are still "
                                  "inside it)", "compile_ready's module, as torch.compile "
                                                "captured it")
    return {"compiled": "yes", "graphs": len(graphs), "graphs after each batch": per_batch,
            **flops, **result}


# One compile serves the task's cases.
COMPILED = READY.shared(_compiled_run)


def _lengths() -> str:
    return ", ".join(str(t) for t in dict.fromkeys(t for _, t, _ in BATCHES))


# A graph break under fullgraph=True leaves no graph: the cases that read the compiled run and
# the FLOPs the graph does not show (all of them) fail for it, after the case that names it.
NO_GRAPH = "no graph of the model's operators"


def _compare_graph(got: Any, expected: dict[str, Any]) -> None:
    if got["compiled"] != "yes":
        raise CheckFailed("torch.compile(fullgraph=True) found a graph break", expected="one graph",
                          got=got["compiled"], cause=NO_GRAPH,
                          hint="print, .item() / int() on a tensor that decides Python control "
                               "flow, and loops whose trip count comes from tensor data all break "
                               "the graph. torch._dynamo.explain(module)(tokens, lengths) lists "
                               "them.")
    counts = got["graphs after each batch"]
    if counts[SAME_SHAPE - 1] != 1:
        raise CheckFailed(f"Dynamo compiled {counts[SAME_SHAPE - 1]} graphs for {SAME_SHAPE} "
                          "batches of the same shape with different lengths: it recompiled",
                          expected=1, got=counts[SAME_SHAPE - 1],
                          hint="A guard on a tensor's value (a Python int or bool taken from "
                               "lengths) fails for the next batch; keep lengths a tensor.")


def _compare_dynamic(got: Any, expected: dict[str, Any]) -> None:
    _compare_graph(got, expected)
    counts = got["graphs after each batch"]
    if got["graphs"] > 2 or counts[-1] != counts[-2]:
        raise CheckFailed(
            f"sequence lengths {_lengths()}: after each batch Dynamo had compiled {counts} graphs; "
            "with dynamic shapes the second length makes the sequence dimension symbolic (at "
            "most 2 graphs) and the third length reuses that graph",
            expected=[1] * SAME_SHAPE + [2] * (len(BATCHES) - SAME_SHAPE), got=counts,
            hint="Dynamo compiles once more for a new size and then treats that dimension as a "
                 "symbol; code that needs the size as a plain Python number (a list or a Python "
                 "range built from it) pins it again, and every new length compiles again.",
            recipe="Build everything that depends on the sequence length with tensor operations "
                   "that take the size directly (torch.arange of the dimension, comparisons, "
                   "masked sums), never through Python lists or loops over range(T).")


READY.case("torch.compile(fullgraph=True, backend='eager') captures it in one graph, reused "
           f"for {SAME_SHAPE} batches of one shape with different lengths", uses=COMPILED,
           compare=_compare_graph, expect="eager_run")
READY.case(f"sequence lengths {_lengths()}: at most 2 graphs, no recompile on the third length "
           "(dynamic shapes)", uses=COMPILED, compare=_compare_dynamic, expect="eager_run")


def _compare_values(got: Any, expected: dict[str, Any]) -> None:
    _compare_graph(got, expected)
    for i, (g, e) in enumerate(zip(got["batches"], expected["batches"])):
        if isinstance(g.get("grads"), dict) and isinstance(e.get("grads"), dict):
            missing = sorted(n for n, t in e["grads"].items()
                             if t is not None and g["grads"].get(n) is None)
            if missing:  # a copy of the model computed: the values differ for that reason
                raise CheckFailed(
                    f"batch {i}: the model's {', '.join(missing[:3])} got no gradient: the "
                    "compiled module computes with parameters that are not the model's",
                    expected="a gradient for every parameter", got=f"None for {missing[:3]}",
                    hint="The compiled module must reuse the model's own layers, so that "
                         "training it trains the model.",
                    recipe="Keep the model on the module and call its embedding, layers and head "
                           "in the forward; do not copy or rebuild them.")
        try:
            assert_same(g["logits"], e["logits"], rtol=1e-5, atol=1e-5, path=f"batch {i}: logits")
            assert_same(g["grads"], e["grads"], rtol=1e-4, atol=1e-5, path=f"batch {i}: gradients")
        except CheckFailed as failed:  # one graph was captured: what it computes differs
            failed.hint = ("One graph is captured, but it computes something else: the rewrite "
                           "must give GraphBreakNet's values, not only remove its breaks.")
            failed.recipe = ("Average each sequence over its real positions only (the masked "
                             "sum divided by its length, not by T), and rescale the average to "
                             "max_norm only where its norm is above max_norm (torch.where).")
            raise


READY.case("compiled outputs and gradients equal GraphBreakNet's in eager mode (pooled norm "
           "below and above max_norm)", uses=COMPILED, compare=_compare_values, weight=2,
           expect="eager_run")
# A graph of the model's own operators shows all its FLOPs (0 hidden); one opaque call shows
# none (all 44,160 of the eager forwards hidden: 100x the bound of 1%).
READY.bound(
    "model FLOPs the captured graph does not show", unit="FLOPs",
    formula="1% of the eager model's FLOPs",
    lost="the graph holds too few of the model's operators to optimize: a forward hidden in "
         "an opaque call (a custom op, an allow_in_graph function), or one that does not "
         "compile at all, gives the compiler nothing to fuse or reorder",
    hint="torch.compile optimizes only what it can see: a forward hidden in one opaque call "
         "compiles without a graph break, yet the graph holds none of the model's operators.",
    recipe="Write the forward as the model's own operations on tensors (the embedding, the linear "
           "layers, tanh, the masked mean, torch.where), so that Dynamo traces each into the "
           "graph; wrap nothing in a custom op or allow_in_graph.",
    expect="hidden_flops_bound", uses=COMPILED, cause=NO_GRAPH,
    saving=False,  # it guards against a forward hidden from the compiler, not a saving
    pick=lambda run: {"measured": [run["eager flops"] - run["flops in the graph"]]})
