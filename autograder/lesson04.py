"""Checks for Lesson 04, "Data parallelism from scratch": tasks 4.1-4.4.

Every case trains :class:`kit.lessons.models.AwkwardNet` (a frozen layer, a never-used layer, a branch
used on some steps only, tied embedding/output weights and a buffer) on real ranks: each rank
starts from *different* weights and buffers, wraps the model in the student's class and takes
SGD steps on its own slice of every global batch. The trusted side trains one model in one
process on the whole batch from rank 0's initial weights; every rank's gradients after
``finish_gradient_synchronization()`` and its final weights must match it. The collective
tracer (:mod:`kit.trace`) counts the all-reduces of every step and when they started: during
``backward()`` (overlapped) or after it.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.nn import functional as F

from autograder.registry import CheckFailed, task
from kit.lessons.models import AwkwardNet, token_batch

VOCAB, LENGTH, PER_RANK = 16, 5, 2  # token vocabulary, sequence length, sequences per rank
LR = 0.5
MIB = 2**20


# --------------------------------------------------------------------------- the experiment


def _initial_model(seed: int, rank: int) -> AwkwardNet:
    """The model rank ``rank`` builds before wrapping: its own weights and its own buffer."""
    torch.manual_seed(seed * 1000 + rank)
    model = AwkwardNet(VOCAB)
    with torch.no_grad():
        model.scale.uniform_(0.5, 1.5)  # (dim,) a buffer that differs between ranks
    return model


def _global_batch(seed: int, step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: ``(world_size * PER_RANK, LENGTH)`` inputs and targets."""
    return token_batch(world_size * PER_RANK, LENGTH, VOCAB, seed * 7919 + step)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))  # mean over (B * T) tokens


def _grads(model: torch.nn.Module) -> dict[str, Any]:
    """``{name: grad or None}`` of every parameter (tied ones once, under their first name)."""
    return {n: None if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()}


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _single_process(seed: int, world_size: int, steps: int, extra: list[int]) -> dict[str, Any]:
    """Trusted: one model, rank 0's initial weights, SGD on the whole global batch."""
    model = _initial_model(seed, 0)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    grads = []
    for step in range(steps):
        x, y = _global_batch(seed, step, world_size)
        _loss(model(x, use_extra=step in extra), y).backward()
        grads.append(_grads(model))
        optimizer.step()
        optimizer.zero_grad()
    return {"initial": _state(_initial_model(seed, 0)), "grads": grads, "final": _state(model)}


def _wrap(impl: Any, model: torch.nn.Module, cap_mb: float | None) -> Any:
    if cap_mb is None:
        return impl(model)
    return impl(model, bucket_size_mb=cap_mb)


def _module_of(ddp: Any, model: torch.nn.Module) -> torch.nn.Module:
    module = getattr(ddp, "module", None)
    if module is not model:
        raise AttributeError(f"{type(ddp).__name__} must keep the wrapped model as .module "
                             "(self.module = module), as torch's DistributedDataParallel does")
    return module


FINISH = "in finish_gradient_synchronization()"
# What Lesson 04 builds: torch's DDP (its Python class and its C++ reducer, which the recorder
# sees issuing all-reduces during backward) and its ready-made communication hooks.
DDP = ("torch.nn.parallel.DistributedDataParallel",
       "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook",
       "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook",
       "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook")


def _backward_phase(i: int, micro: int) -> str:
    """The name of micro-batch ``i``'s backward in the all-reduce counts."""
    return "during backward()" if micro == 1 else f"during backward() {i + 1} of {micro}"


BLOCKING = "blocking (not async_op) anywhere in the step"


def _count(events: list[Any], start: float, end: float) -> int:
    return sum(1 for e in events if e.op == "all_reduce" and start <= e.start < end)


def _blocking(events: list[Any]) -> int:
    """All-reduces the caller waited for inside the call: nothing can overlap them."""
    return sum(1 for e in events if e.op == "all_reduce" and not e.async_op)


def _train_on_rank(impl: Any, seed: int, steps: int, extra: list[int], cap_mb: float | None,
                   micro: int, needs: str) -> dict[str, Any]:
    """One rank's run: wrap, then ``steps`` SGD steps of ``micro`` micro-batches each.

    Returns the state right after wrapping, every step's gradients after
    ``finish_gradient_synchronization()``, the final state, and per step the all-reduces
    started during each micro-batch's backward and during finish.
    """
    import torch.distributed as dist

    from kit.trace import trace

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _initial_model(seed, rank)
    try:
        ddp = _wrap(impl, model, cap_mb)
    except NotImplementedError as e:
        if needs and needs not in str(e):
            raise NotImplementedError(f"{needs} no_sync builds on BucketedDDP: finish Task 4.3 "
                                      f"first ({e})") from e
        raise
    module = _module_of(ddp, model)
    initial = _state(module)
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=LR)
    grads, calls = [], []
    for step in range(steps):
        x, y = _global_batch(seed, step, world_size)
        x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
        xs, ys = x.chunk(micro), y.chunk(micro)  # micro-batches of PER_RANK // micro sequences
        phases: dict[str, tuple[float, float]] = {}
        with trace() as t:
            for i in range(micro):
                loss = _loss(ddp(xs[i], use_extra=step in extra), ys[i]) / micro
                start = time.perf_counter()
                if i < micro - 1:
                    with ddp.no_sync():
                        loss.backward()
                else:
                    loss.backward()
                phases[_backward_phase(i, micro)] = (start, time.perf_counter())
            start = time.perf_counter()
            ddp.finish_gradient_synchronization()
            phases[FINISH] = (start, time.perf_counter())
        calls.append({**{phase: _count(t.events, a, b) for phase, (a, b) in phases.items()},
                      BLOCKING: _blocking(t.events)})
        grads.append(_grads(module))
        optimizer.step()
        optimizer.zero_grad()
    return {"initial": initial, "grads": grads, "final": _state(module), "calls": calls}


def _launch(impl: Any, seed: int, world_size: int, steps: int, extra: list[int] | None = None,
            cap_mb: float | None = None, micro: int = 1, needs: str = "") -> list[Any]:
    from kit.launcher import run_ranks

    return list(run_ranks(_train_on_rank, (impl, seed, steps, extra or [], cap_mb, micro, needs),
                          world_size=world_size, timeout=30.0, echo=False))


# --------------------------------------------------------------------------- comparing


def _tensor_diff(got: Any, want: torch.Tensor | None, world_size: int) -> str | None:
    """None if ``got`` matches ``want`` (None also matches zeros); else what is wrong."""
    if want is None:
        if got is None or (isinstance(got, torch.Tensor) and not got.any()):
            return None
        return "holds a gradient, but in one process it gets none (it is frozen or unused)"
    if not isinstance(got, torch.Tensor):
        return f"is {got!r}, expected a tensor of shape {tuple(want.shape)}"
    if got.shape != want.shape:
        return f"has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        return None
    diff = (got - want).abs().max().item()
    if world_size > 1 and torch.allclose(got, want * world_size, rtol=1e-4, atol=1e-5):
        return f"is {world_size}x the expected value: the sum over ranks, not the mean"
    return f"differs (max abs difference {diff:.3g})"


def _check_state(where: str, got: Any, want: dict[str, torch.Tensor], hint: str) -> None:
    if not isinstance(got, dict) or set(got) != set(want):
        raise CheckFailed(f"{where}: the model's state could not be read",
                          expected=sorted(want), got=repr(got)[:200])
    for name, tensor in want.items():
        problem = _tensor_diff(got[name], tensor, 1)
        if problem is not None:
            raise CheckFailed(f"{where}: {name} {problem}", expected=_short(tensor),
                              got=_short(got[name]), hint=hint)


def _short(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(t)
    flat = t.flatten()
    return f"{[round(v, 4) for v in flat[:4].tolist()]}{' ...' if flat.numel() > 4 else ''}"


BROADCAST_HINT = ("Data parallelism only works if every rank starts from the same weights: each "
                  "rank's random initialisation differs, so the wrapper makes rank 0's "
                  "parameters and buffers everyone's before training.")
BROADCAST_RECIPE = ("In __init__, broadcast every parameter and every buffer of the module from "
                    "rank 0, in place, without recording gradients (frozen parameters too).")


def _compare_initial(got: Any, expected: dict[str, Any]) -> None:
    for rank, run in enumerate(got):
        _check_state(f"rank {rank} right after wrapping", run["initial"], expected["initial"],
                     BROADCAST_HINT)


def _compare_training(got: Any, expected: dict[str, Any]) -> None:
    world_size = len(got)
    for rank, run in enumerate(got):
        if len(run["grads"]) != len(expected["grads"]):
            raise CheckFailed(f"rank {rank}: wrong number of steps recorded",
                              expected=len(expected["grads"]), got=len(run["grads"]))
        for step, (have, want) in enumerate(zip(run["grads"], expected["grads"])):
            for name, tensor in want.items():
                problem = _tensor_diff(have.get(name), tensor, world_size)
                if problem is not None:
                    raise CheckFailed(
                        f"rank {rank}, step {step}: {name}.grad after "
                        f"finish_gradient_synchronization() {problem}",
                        expected=_short(tensor), got=_short(have.get(name)))
    for rank, run in enumerate(got):
        _check_state(f"rank {rank} after the last step", run["final"], expected["final"],
                     "Gradients matched but the weights did not: is every rank starting from "
                     "rank 0's weights and buffers?")


# --------------------------------------------------------------------------- bucket plans


def _bucket_plan(cap_mb: float) -> list[list[str]]:
    """Trusted: the buckets (parameter names) of ``AwkwardNet`` for a cap, in reverse order."""
    model = AwkwardNet(VOCAB)
    cap = cap_mb * MIB
    buckets: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, p in reversed(list(model.named_parameters())):
        if not p.requires_grad:
            continue
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


NEVER_USED = ("unused.",)
SOMETIMES_USED = ("extra.",)


def _expected_calls(cap_mb: float, steps: int, extra: list[int], micro: int) -> list[dict[str, int]]:
    """Per step: all-reduces per micro-batch backward and in finish, one per bucket.

    A bucket fires during the last backward once all its parameters have their gradient; a
    bucket holding a parameter that got none this step fires in finish."""
    out = []
    for step in range(steps):
        idle = NEVER_USED + (() if step in extra else SOMETIMES_USED)
        buckets = _bucket_plan(cap_mb)
        late = sum(any(n.startswith(idle) for n in b) for b in buckets)
        calls = {_backward_phase(i, micro): 0 for i in range(micro)}
        calls[_backward_phase(micro - 1, micro)] = len(buckets) - late
        calls[FINISH] = late
        calls[BLOCKING] = 0
        out.append(calls)
    return out


# --------------------------------------------------------------------------- task 4.1

NAIVE = task(
    "4.1", "NaiveDDP", points=3, forbidden=DDP,
    hint="Averaging the gradients over ranks that hold the same weights equals one step on the "
         "global batch: after backward every gradient must be the mean over the ranks, each "
         "parameter reduced exactly once.",
    recipe="In finish_gradient_synchronization, go over the module's parameters (the list "
           "parameters() gives holds a tied parameter once); for each that has a gradient, "
           "all-reduce the gradient (a sum over ranks, in place) and divide it by the world "
           "size. Skip parameters whose gradient is None.",
)

SEED_STEPS, SEED_EXTRA = 3, [1]


@NAIVE.case("broadcasts rank 0's parameters and buffers at construction (3 ranks)",
            compare=_compare_initial, hint=BROADCAST_HINT, recipe=BROADCAST_RECIPE,
            expect=lambda seed: _single_process(seed, 3, 0, []))
def _(impl: Any, seed: int) -> list[Any]:
    return _launch(impl, seed, 3, steps=0)


@NAIVE.case("3 SGD steps on 2 ranks equal one process on the whole batch "
            "(frozen, unused, tied parameters, a branch used on step 1 only)",
            compare=_compare_training,
            expect=lambda seed: _single_process(seed, 2, SEED_STEPS, SEED_EXTRA))
def _(impl: Any, seed: int) -> list[Any]:
    return _launch(impl, seed, 2, SEED_STEPS, SEED_EXTRA)


@NAIVE.case("the same on 4 ranks", compare=_compare_training,
            expect=lambda seed: _single_process(seed, 4, 2, [0]))
def _(impl: Any, seed: int) -> list[Any]:
    return _launch(impl, seed, 4, 2, [0])


def _with_grad(step: int, extra: list[int]) -> int:
    """How many parameters of AwkwardNet get a gradient in ``step`` (tied counted once)."""
    idle = NEVER_USED + (() if step in extra else SOMETIMES_USED)
    return sum(1 for n, p in AwkwardNet(VOCAB).named_parameters()
               if p.requires_grad and not n.startswith(idle))


def _compare_at_most_one_per_grad(got: Any, expected: list[int]) -> None:
    for rank, run in enumerate(got):
        for step, (calls, limit) in enumerate(zip(run["calls"], expected)):
            n = sum(v for k, v in calls.items() if k != BLOCKING)
            if n == 0:
                raise CheckFailed(f"rank {rank}, step {step}: no dist.all_reduce was traced",
                                  expected=f"1 to {limit}", got=0,
                                  hint="The gradients must be averaged over the ranks with "
                                       "an all-reduce: no all-reduce means no synchronisation.")
            if n > limit:
                raise CheckFailed(
                    f"rank {rank}, step {step}: {n} all-reduces for {limit} parameters holding "
                    "a gradient: some gradient was reduced twice", expected=f"at most {limit}",
                    got=n)


@NAIVE.case("at most one all-reduce per parameter with a gradient (the tied weight once)",
            compare=_compare_at_most_one_per_grad,
            hint="A parameter shared by two modules (a tied weight) has one gradient: reduce "
                 "it once, or it is summed twice.",
            recipe="Iterate over the whole module's parameters() (a tied parameter appears "
                   "once), not module by module (which visits it twice).",
            expect=lambda seed: [_with_grad(s, SEED_EXTRA) for s in range(SEED_STEPS)])
def _(impl: Any, seed: int) -> list[Any]:
    return _launch(impl, seed, 2, SEED_STEPS, SEED_EXTRA)


# --------------------------------------------------------------------------- task 4.2

OVERLAPPED = task(
    "4.2", "OverlappedDDP", points=3, forbidden=DDP,
    hint="Overlap: each gradient's all-reduce must start during backward, as soon as that "
         "gradient is final, and run in the background while backward computes the rest; only "
         "finish_gradient_synchronization waits.",
    recipe="In __init__ register a post-accumulate-grad hook on every parameter that requires "
           "grad (one per parameter; a tied one once). In the hook, start an asynchronous "
           "all-reduce of that parameter's gradient and keep its work handle. In "
           "finish_gradient_synchronization wait for every handle, divide each gradient by the "
           "world size, and forget the handles.",
)


@OVERLAPPED.case("broadcasts rank 0's parameters and buffers at construction (3 ranks)",
                 compare=_compare_initial, hint=BROADCAST_HINT, recipe=BROADCAST_RECIPE,
                 expect=lambda seed: _single_process(seed, 3, 0, []))
def _(impl: Any, seed: int) -> list[Any]:
    return _launch(impl, seed, 3, steps=0)


@OVERLAPPED.case("3 SGD steps on 3 ranks equal one process on the whole batch "
                 "(frozen, unused, tied parameters, a branch used on step 1 only)",
                 compare=_compare_training,
                 expect=lambda seed: _single_process(seed, 3, SEED_STEPS, SEED_EXTRA))
def _(impl: Any, seed: int) -> list[Any]:
    return _launch(impl, seed, 3, SEED_STEPS, SEED_EXTRA)


def _compare_one_per_grad_in_backward(got: Any, expected: list[int]) -> None:
    for rank, run in enumerate(got):
        for step, (calls, n) in enumerate(zip(run["calls"], expected)):
            want = {_backward_phase(0, 1): n, FINISH: 0, BLOCKING: 0}
            if calls != want:
                raise CheckFailed(
                    f"rank {rank}, step {step}: all-reduces started during backward() and in "
                    "finish_gradient_synchronization(): expected one per parameter with a "
                    "gradient, each started as soon as it is ready", expected=want, got=calls)


@OVERLAPPED.case("one async all-reduce per parameter with a gradient, each started during "
                 "backward; finish only waits", compare=_compare_one_per_grad_in_backward, weight=3,
                 hint="Each all-reduce must be started asynchronously, during backward, once per "
                      "parameter with a gradient: blocking in the hook stalls backward, and "
                      "starting them in finish does not overlap at all.",
                 expect=lambda seed: [_with_grad(s, SEED_EXTRA) for s in range(SEED_STEPS)])
def _(impl: Any, seed: int) -> list[Any]:
    return _launch(impl, seed, 2, SEED_STEPS, SEED_EXTRA)


# --------------------------------------------------------------------------- task 4.3

BUCKETED = task(
    "4.3", "BucketedDDP", points=4, forbidden=DDP,
    hint="Buckets: few large all-reduces instead of many small ones, still overlapped with "
         "backward. Gradients become ready in reverse registration order, so buckets follow "
         "that order, and each bucket is reduced once, as one flat buffer, as soon as all of "
         "its gradients are ready.",
    recipe="Plan the buckets in __init__: go over the parameters that require grad in reversed "
           "order and close a bucket when the next one would take it past bucket_size_mb MiB. "
           "In each parameter's post-accumulate-grad hook count the bucket's ready parameters; "
           "when the count reaches the bucket's size, flatten its gradients into one buffer "
           "(zeros for a missing gradient), divide by the world size and start one asynchronous "
           "all-reduce. In finish, start the buckets that never became ready, wait for all, "
           "copy each slice back into its parameter's gradient and reset the counters.",
)

SMALL_CAP = 600 / MIB  # 6 buckets of AwkwardNet, one of them holding the unused layer
LARGE_CAP = 1500 / MIB  # 4 buckets


@BUCKETED.case("broadcasts rank 0's parameters and buffers at construction (3 ranks)",
               compare=_compare_initial, hint=BROADCAST_HINT, recipe=BROADCAST_RECIPE,
               expect=lambda seed: _single_process(seed, 3, 0, []))
def _(impl: Any, seed: int) -> list[Any]:
    return _launch(impl, seed, 3, steps=0, cap_mb=LARGE_CAP)


@BUCKETED.case("3 SGD steps on 2 ranks, 600-byte buckets, equal one process on the whole batch "
               "(frozen, unused, tied parameters, a branch used on step 1 only)",
               compare=_compare_training,
               expect=lambda seed: _single_process(seed, 2, SEED_STEPS, SEED_EXTRA))
def _(impl: Any, seed: int) -> list[Any]:
    return _launch(impl, seed, 2, SEED_STEPS, SEED_EXTRA, cap_mb=SMALL_CAP)


@BUCKETED.case("the same on 4 ranks with 1500-byte buckets", compare=_compare_training,
               expect=lambda seed: _single_process(seed, 4, 2, [0]))
def _(impl: Any, seed: int) -> list[Any]:
    return _launch(impl, seed, 4, 2, [0], cap_mb=LARGE_CAP)


def _compare_bucket_calls(got: Any, expected: dict[str, Any]) -> None:
    plan = expected["plan"]
    for rank, run in enumerate(got):
        for step, (calls, want) in enumerate(zip(run["calls"], expected["calls"])):
            if calls != want:
                raise CheckFailed(
                    f"rank {rank}, step {step}: all-reduces started during backward() and in "
                    f"finish_gradient_synchronization(), for {len(plan)} buckets {plan}: "
                    "expected exactly one per bucket, during the last backward() unless a "
                    "parameter of the bucket got no gradient", expected=want, got=calls)


@BUCKETED.case("exactly one all-reduce per bucket per step, started when the bucket is ready "
               "(600-byte buckets, reverse order)", compare=_compare_bucket_calls, weight=2,
               hint="One all-reduce per bucket per step, started during backward the moment the "
                    "bucket's last gradient is ready; a bucket with a parameter that got no "
                    "gradient can only start in finish.",
               expect=lambda seed: {"plan": _bucket_plan(SMALL_CAP),
                                    "calls": _expected_calls(SMALL_CAP, SEED_STEPS, SEED_EXTRA, 1)})
def _(impl: Any, seed: int) -> list[Any]:
    return _launch(impl, seed, 2, SEED_STEPS, SEED_EXTRA, cap_mb=SMALL_CAP)


# --------------------------------------------------------------------------- task 4.4

NO_SYNC = task(
    "4.4", "BucketedDDP", points=2, forbidden=DDP,
    hint="Gradient accumulation: inside no_sync() backward only accumulates gradients locally, "
         "with no communication; the first backward outside it reduces the accumulated sum, "
         "and the previous setting comes back even if the block raises.",
    recipe="Make no_sync a context manager that switches the require_backward_grad_sync flag "
           "off for the duration of the block and restores its previous value in a finally "
           "clause; while the flag is off, the gradient hook returns without counting or "
           "starting anything.",
)

MICRO = 2  # micro-batches per step: PER_RANK sequences split in two


@NO_SYNC.case("2 micro-batches per step (the first under no_sync) equal one process on the "
              "whole batch, 3 steps on 2 ranks", compare=_compare_training,
              expect=lambda seed: _single_process(seed, 2, SEED_STEPS, SEED_EXTRA))
def _(impl: Any, seed: int) -> list[Any]:
    return _launch(impl, seed, 2, SEED_STEPS, SEED_EXTRA, cap_mb=SMALL_CAP, micro=MICRO,
                   needs="Task 4.4:")


@NO_SYNC.case("no all-reduce under no_sync; one per bucket on the last micro-batch",
              compare=_compare_bucket_calls,
              expect=lambda seed: {"plan": _bucket_plan(SMALL_CAP),
                                   "calls": _expected_calls(SMALL_CAP, SEED_STEPS, SEED_EXTRA,
                                                            MICRO)})
def _(impl: Any, seed: int) -> list[Any]:
    return _launch(impl, seed, 2, SEED_STEPS, SEED_EXTRA, cap_mb=SMALL_CAP, micro=MICRO,
                   needs="Task 4.4:")
