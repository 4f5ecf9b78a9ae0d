"""Checks for Lesson 04, "Data parallelism from scratch": tasks 4.1-4.4.

Every case trains :class:`kit.lessons.models.AwkwardNet` (a frozen layer, a never-used layer, a
branch used on some steps only, tied embedding/output weights and a buffer) on real ranks: each rank
starts from *different* weights and buffers, wraps the model in the student's class and takes
SGD steps on its own slice of every global batch. The trusted side trains one model in one
process on the whole batch from rank 0's initial weights; every rank's gradients after
``finish_gradient_synchronization()`` and its final weights must match it. The collective
tracer (:mod:`kit.trace`) counts the all-reduces of every step and when they started: during
``backward()`` (overlapped) or after it. Each distinct launch is a shared run that every case
of the task reading it judges; the single-process run and the bucket plan live in
:mod:`autograder.references.lesson04` (trusted only).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import torch
from torch.nn import functional as F

from autograder.compare import CheckFailed, short, tensor_mismatch
from autograder.registry import SharedRun, Task, task
from kit.lessons.models import AwkwardNet, token_batch

# Every rank builds a torch.optim optimizer, whose __init__ imports Dynamo on first use (about a
# second of CPU): imported once before the ranks fork, not once per rank.
PRELOAD = ("torch._dynamo",)

VOCAB, LENGTH, PER_RANK = 16, 5, 2  # token vocabulary, sequence length, sequences per rank
LR = 0.5
MIB = 2**20


# --------------------------------------------------------------------------- the experiment


def initial_model(seed: int, rank: int) -> AwkwardNet:
    """The model rank ``rank`` builds before wrapping: its own weights and its own buffer."""
    torch.manual_seed(seed * 1000 + rank)
    model = AwkwardNet(VOCAB)
    with torch.no_grad():
        model.scale.uniform_(0.5, 1.5)  # (dim,) a buffer that differs between ranks
    return model


def global_batch(seed: int, step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: ``(world_size * PER_RANK, LENGTH)`` inputs and targets."""
    return token_batch(world_size * PER_RANK, LENGTH, VOCAB, seed * 7919 + step)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))  # mean over (B * T) tokens


def grads_of(model: torch.nn.Module) -> dict[str, Any]:
    """``{name: grad or None}`` of every parameter (tied ones once, under their first name)."""
    return {n: None if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()}


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


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
# What Lesson 04 builds: torch's DDP (its Python class and its module's helpers, and its C++
# reducer, which the recorder sees issuing all-reduces during backward), its ready-made
# communication hooks, the private helpers it syncs the initial weights with, the composable
# DDP (replicate) and FSDP without sharding (FullyShardedDataParallel's NO_SHARD is DDP).
DDP = ("torch.nn.parallel.DistributedDataParallel", "torch.nn.parallel.distributed",
       "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook",
       "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook",
       "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook",
       "torch.distributed.algorithms.ddp_comm_hooks",
       "torch.distributed.utils._sync_module_states",
       "torch.distributed.utils._sync_params_and_buffers",
       "torch.distributed._broadcast_coalesced", "torch.distributed._composable.replicate",
       "torch.distributed._composable.replicate_with_fsdp",
       "torch.distributed.fsdp.FullyShardedDataParallel")


def backward_phase(i: int, micro: int) -> str:
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
    model = initial_model(seed, rank)
    try:
        ddp = _wrap(impl, model, cap_mb)
    except NotImplementedError as e:
        if needs and needs not in str(e):
            raise NotImplementedError(f"{needs} no_sync builds on BucketedDDP: finish Task 4.3 "
                                      f"first ({e})") from e
        raise
    module = _module_of(ddp, model)
    initial = state_of(module)
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=LR)
    grads, calls = [], []
    for step in range(steps):
        x, y = global_batch(seed, step, world_size)
        x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
        xs, ys = x.chunk(micro), y.chunk(micro)  # micro-batches of PER_RANK // micro sequences
        phases: dict[str, tuple[float, float]] = {}
        with trace() as t:
            for i in range(micro):
                loss = loss_of(ddp(xs[i], use_extra=step in extra), ys[i]) / micro
                start = time.perf_counter()
                if i < micro - 1:
                    with ddp.no_sync():
                        loss.backward()
                else:
                    loss.backward()
                phases[backward_phase(i, micro)] = (start, time.perf_counter())
            start = time.perf_counter()
            ddp.finish_gradient_synchronization()
            phases[FINISH] = (start, time.perf_counter())
        calls.append({**{phase: _count(t.events, a, b) for phase, (a, b) in phases.items()},
                      BLOCKING: _blocking(t.events)})
        grads.append(grads_of(module))
        optimizer.step()
        optimizer.zero_grad()
    out = {"initial": initial, "grads": grads, "final": state_of(module), "calls": calls}
    if needs == "Task 4.4:":
        out["contract"] = _no_sync_contract(ddp)
    return out


class _Raised(Exception):
    """Raised inside a no_sync block by the check, to see the flag restored and the error kept."""


def _no_sync_contract(ddp: Any) -> dict[str, Any]:
    """The flag around the edges of a no_sync block: a raise inside, nesting, a flag already off."""
    flag = "require_backward_grad_sync"
    out: dict[str, Any] = {"before": getattr(ddp, flag, None)}
    try:
        with ddp.no_sync():
            out["inside"] = getattr(ddp, flag, None)
            raise _Raised("raised inside no_sync")
    except _Raised:
        out["the error came out"] = True
    else:
        out["the error came out"] = False
    out["after a raise"] = getattr(ddp, flag, None)
    with ddp.no_sync():
        with ddp.no_sync():
            pass
        out["after an inner no_sync"] = getattr(ddp, flag, None)
    out["after the outer no_sync"] = getattr(ddp, flag, None)
    setattr(ddp, flag, False)
    with ddp.no_sync():
        pass
    out["after no_sync with the flag already off"] = getattr(ddp, flag, None)
    setattr(ddp, flag, True)
    return out


NO_SYNC_CONTRACT = {"before": True, "inside": False, "the error came out": True,
                    "after a raise": True, "after an inner no_sync": False,
                    "after the outer no_sync": True,
                    "after no_sync with the flag already off": False}


def _compare_no_sync_contract(got: Any, expected: Any) -> None:
    for rank, r in enumerate(got if isinstance(got, list) else [got]):
        if not isinstance(r, dict):
            raise CheckFailed(f"rank {rank}: could not read the no_sync probe", got=repr(r)[:200])
        for key, want in NO_SYNC_CONTRACT.items():
            if r.get(key) != want:
                raise CheckFailed(
                    f"rank {rank}: require_backward_grad_sync {key}: {r.get(key)!r}",
                    expected=want, got=r.get(key),
                    hint="no_sync restores the value the flag had before the block, not True, "
                         "and restores it even when the block raises, without swallowing the "
                         "error: a nested no_sync leaves the outer one still off, and a no_sync "
                         "entered with the flag off leaves it off.",
                    recipe="Save the flag, set it to False, yield inside try, and restore the "
                           "saved value in finally; do not catch the exception.")


def _training(t: Task, world_size: int, steps: int, extra: list[int] | None = None,
              cap_mb: float | None = None, micro: int = 1, needs: str = "") -> SharedRun:
    """One launch of ``_train_on_rank`` on ``world_size`` ranks for task ``t``: a shared run,
    so every case of the task that reads it judges the same ranks."""
    return t.shared(partial(_train_on_rank, steps=steps, extra=list(extra or []), cap_mb=cap_mb,
                            micro=micro, needs=needs), world_size=world_size, timeout=30.0)


def _trusted(t: Task, name: str, *args: Any) -> Any:
    """``expect(seed)``: ``autograder.references.lesson04.<name>(seed, *args)``, looked up by the
    trusted side when it first needs the expectation (never by a run)."""
    return lambda seed: t.trusted(name)(seed, *args)


# --------------------------------------------------------------------------- comparing


def _mismatch(got: Any, want: torch.Tensor | None, world_size: int) -> str | None:
    """None if ``got`` matches ``want`` (None also matches zeros); else what is wrong."""
    if want is None:
        if got is None or (isinstance(got, torch.Tensor) and not got.any()):
            return None
        return "holds a gradient, but in one process it gets none (it is frozen or unused)"
    return tensor_mismatch(got, want, rtol=1e-4, atol=1e-5, world_size=world_size)


def _check_state(where: str, got: Any, want: dict[str, torch.Tensor], hint: str) -> None:
    if not isinstance(got, dict) or set(got) != set(want):
        raise CheckFailed(f"{where}: the model's state could not be read",
                          expected=sorted(want), got=short(got))
    for name, tensor in want.items():
        problem = _mismatch(got[name], tensor, 1)
        if problem is not None:
            raise CheckFailed(f"{where}: {name} {problem}", expected=short(tensor),
                              got=short(got[name]), hint=hint)


BROADCAST_HINT = ("Data parallelism only works if every rank starts from the same weights: each "
                  "rank's random initialisation differs, so the wrapper makes rank 0's "
                  "parameters and buffers everyone's before training.")
BROADCAST_RECIPE = ("In __init__, broadcast every parameter and every buffer of the module from "
                    "rank 0, in place, without recording gradients (frozen parameters too).")


def _compare_initial(got: Any, expected: dict[str, Any]) -> None:
    for rank, run in enumerate(got):
        try:
            _check_state(f"rank {rank} right after wrapping", run["initial"], expected["initial"],
                         BROADCAST_HINT)
        except CheckFailed as e:
            e.cause = "no broadcast"
            raise


# AwkwardNet's output layer reuses the embedding's weight: one Parameter, one gradient, which
# named_parameters() lists once, under this name.
TIED = "embed.weight"
TIED_HINT = ("Only the tied weight's gradient is wrong: embed.weight is the same Parameter as "
             "head.weight, with one gradient. Listing parameters module by module meets it "
             "twice, so it is hooked or reduced twice; take the module's parameters(), which "
             "gives it once.")

# What a wrong gradient's mismatch says -> (hint, cause): the slip it shows, not the task's idea.
_GRADIENT_SLIPS = {
    "the sum over ranks, not the mean": (
        "The gradient of one step on the global batch is the mean of the ranks' gradients: "
        "all_reduce sums them, so divide by the world size.", "sum not mean"),
    "divided by the world size once too often": (
        "Divide the all-reduced gradient by the world size once: every rank does it for its own "
        "copy, after the sum.", "divided twice"),
    "in one process it gets none": (
        "A parameter that is frozen or unused in this step has no gradient in one process, so "
        "it must have none here: skip parameters whose .grad is None.", "gradient where none"),
}


def _compare_training(got: Any, expected: dict[str, Any]) -> None:
    world_size = len(got)
    # Wrong starting weights on any rank make every later gradient wrong, rank 0's included:
    # name that first, not the gradients.
    for rank, run in enumerate(got):
        if isinstance(run, dict) and "initial" in run and "initial" in expected:
            try:
                _check_state(f"rank {rank} right after wrapping", run["initial"],
                             expected["initial"], BROADCAST_HINT)
            except CheckFailed as e:
                e.cause = "no broadcast"
                raise
    for rank, run in enumerate(got):
        if len(run["grads"]) != len(expected["grads"]):
            raise CheckFailed(f"rank {rank}: wrong number of steps recorded",
                              expected=len(expected["grads"]), got=len(run["grads"]))
    # Step by step across the ranks, not rank by rank: a rank whose gradient went wrong at step 0
    # trains on other weights, so at step 1 every rank's all-reduced gradients differ everywhere.
    # The earliest step names the slip; a later one shows only its consequences.
    for step, want in enumerate(expected["grads"]):
        for rank, run in enumerate(got):
            have = run["grads"][step]
            for name, tensor in want.items():
                problem = _mismatch(have.get(name), tensor, world_size)
                if problem is not None:
                    hint, cause = next((v for k, v in _GRADIENT_SLIPS.items() if k in problem),
                                       ("", ""))
                    if not cause and name == TIED and all(
                            _mismatch(have.get(n), t, world_size) is None
                            for n, t in want.items() if n != name):
                        hint, cause = TIED_HINT, "tied weight twice"
                    raise CheckFailed(
                        f"rank {rank}, step {step}: {name}.grad after "
                        f"finish_gradient_synchronization() {problem}",
                        expected=short(tensor), got=short(have.get(name)), hint=hint, cause=cause)
    for rank, run in enumerate(got):
        _check_state(f"rank {rank} after the last step", run["final"], expected["final"],
                     "Gradients matched but the weights did not: is every rank starting from "
                     "rank 0's weights and buffers?")


def _calls_slip(calls: dict[str, int], want: dict[str, int], units: str) -> tuple[str, str, str]:
    """What the all-reduce counts of one step show, read from the counts in the direction they
    are off: (what happened, a hint about that, a cause key). ``units``: what one all-reduce
    stands for ("buckets", "parameters with a gradient")."""
    if set(calls) != set(want):
        return "the counts could not be read", "", ""
    backward = [k for k in want if k not in (FINISH, BLOCKING)]
    last, under_no_sync = backward[-1], backward[:-1]
    total = sum(calls[k] for k in backward + [FINISH])
    due = sum(want[k] for k in backward + [FINISH])
    if calls[BLOCKING]:
        return (f"{calls[BLOCKING]} of them blocked (not async_op)",
                "An all-reduce that blocks inside the hook stalls backward until it is done: "
                "start it asynchronously (async_op) and wait for its work only in finish.",
                "blocking")
    if any(calls[k] for k in under_no_sync):
        return ("all-reduces started during a backward() under no_sync",
                "Inside no_sync() backward must not communicate: the hook returns at once while "
                "the flag is off, and the gradients just accumulate.", "communicates under no_sync")
    if under_no_sync and not calls[last] and want[last]:
        return ("none started during the last backward(), outside no_sync",
                "no_sync() must switch synchronisation back on when its block ends (restore the "
                "flag in a finally clause), or the next backward never communicates.",
                "no_sync not restored")
    buckets = units == "buckets"
    if total > due:
        return (f"{total} all-reduces for {due} {units}: more than one per "
                f"{'bucket' if buckets else 'parameter'}",
                ("One all-reduce per bucket per step, of the bucket's flat buffer: reducing "
                 "parameter by parameter ignores the buckets, and a parameter listed twice (a "
                 "tied weight, met once per module) is reduced twice." if buckets else
                 "One all-reduce per parameter per step: a parameter listed twice (a tied "
                 "weight, met once per module) is hooked and reduced twice; the module's "
                 "parameters() gives it once."), "too many all-reduces")
    if total < due:
        return (f"{total} all-reduces for {due} {units}: {due - total} never reduced",
                "Every bucket is reduced every step: one holding a parameter that got no "
                "gradient cannot fire during backward, so finish starts it." if buckets else
                "Every parameter with a gradient is reduced every step.", "too few all-reduces")
    if calls[last] < want[last] and not calls[FINISH] < want[FINISH]:
        return (f"{want[last] - calls[last]} that could start during backward() waited for "
                "finish",
                ("A bucket is ready when its last gradient is, and gradients arrive in reverse "
                 "registration order: buckets filled in forward order complete only at the end, "
                 "and a bucket that waits for more gradients than it holds (a tied weight "
                 "counted twice) only in finish." if buckets else
                 "Start each all-reduce in the gradient's hook, during backward: started in "
                 "finish, it overlaps with nothing."), "started late")
    if calls[last] > want[last]:
        return (f"{calls[last] - want[last]} started during backward() before all the "
                "gradients they carry were ready",
                "A bucket (or parameter) that holds a parameter with no gradient this step can "
                "only be reduced in finish: firing earlier sends an unfinished gradient.",
                "started early")
    return "", "", ""


# Parameters that get no gradient in a step: the bucket holding one can only fire in finish.
NEVER_USED = ("unused.",)
SOMETIMES_USED = ("extra.",)

SEED_STEPS, SEED_EXTRA = 3, [1]


def _start_and_training_cases(t: Task, world_size: int, buckets: str = "",
                              start_cap_mb: float | None = None,
                              cap_mb: float | None = None) -> SharedRun:
    """The first two cases of tasks 4.1-4.3: rank 0's weights everywhere right after wrapping
    (3 ranks), then SEED_STEPS steps on ``world_size`` ranks equal one process on the whole
    batch. Returns that training run, which later cases of ``t`` judge too."""
    t.case("broadcasts rank 0's parameters and buffers at construction (3 ranks)",
           uses=_training(t, 3, steps=0, cap_mb=start_cap_mb), compare=_compare_initial,
           hint=BROADCAST_HINT, recipe=BROADCAST_RECIPE,
           expect=_trusted(t, "single_process", 3, 0, []))
    run = _training(t, world_size, SEED_STEPS, SEED_EXTRA, cap_mb=cap_mb)
    t.case(f"{SEED_STEPS} SGD steps on {world_size} ranks{buckets} equal one process on the "
           "whole batch (frozen, unused, tied parameters, a branch used on step 1 only)",
           uses=run, compare=_compare_training,
           expect=_trusted(t, "single_process", world_size, SEED_STEPS, SEED_EXTRA))
    return run


# --------------------------------------------------------------------------- task 4.1

NAIVE = task(
    "4.1", preload=PRELOAD, forbidden=DDP,
    hint="Averaging the gradients over ranks that hold the same weights equals one step on the "
         "global batch: after backward every gradient must be the mean over the ranks, each "
         "parameter reduced exactly once.",
    recipe="In finish_gradient_synchronization, go over the module's parameters (the list "
           "parameters() gives holds a tied parameter once); for each that has a gradient, "
           "all-reduce the gradient (a sum over ranks, in place) and divide it by the world "
           "size. Skip parameters whose gradient is None.",
)

_naive_on_2 = _start_and_training_cases(NAIVE, 2)
NAIVE.case("the same on 4 ranks", uses=_training(NAIVE, 4, 2, [0]), compare=_compare_training,
           expect=_trusted(NAIVE, "single_process", 4, 2, [0]))


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



NAIVE.case("at most one all-reduce per parameter with a gradient (the tied weight once)",
           uses=_naive_on_2, compare=_compare_at_most_one_per_grad,
           hint="A parameter shared by two modules (a tied weight) has one gradient: reduce "
                "it once, or it is summed twice.",
           recipe="Iterate over the whole module's parameters() (a tied parameter appears "
                  "once), not module by module (which visits it twice).",
           expect=_trusted(NAIVE, "gradients_per_step", SEED_STEPS, SEED_EXTRA))


# --------------------------------------------------------------------------- task 4.2

OVERLAPPED = task(
    "4.2", preload=PRELOAD, forbidden=DDP,
    hint="Overlap: each gradient's all-reduce must start during backward, as soon as that "
         "gradient is final, and run in the background while backward computes the rest; only "
         "finish_gradient_synchronization waits.",
    recipe="In __init__ register a post-accumulate-grad hook on every parameter that requires "
           "grad (one per parameter; a tied one once). In the hook, start an asynchronous "
           "all-reduce of that parameter's gradient and keep its work handle. In "
           "finish_gradient_synchronization wait for every handle, divide each gradient by the "
           "world size, and forget the handles.",
)

_overlapped_on_3 = _start_and_training_cases(OVERLAPPED, 3)


def _compare_one_per_grad_in_backward(got: Any, expected: list[int]) -> None:
    for rank, run in enumerate(got):
        for step, (calls, n) in enumerate(zip(run["calls"], expected)):
            want = {backward_phase(0, 1): n, FINISH: 0, BLOCKING: 0}
            if calls != want:
                slip, hint, cause = _calls_slip(calls, want, "parameters with a gradient")
                raise CheckFailed(
                    f"rank {rank}, step {step}: all-reduces started during backward() and in "
                    "finish_gradient_synchronization(): expected one per parameter with a "
                    f"gradient, each started as soon as it is ready; {slip}", expected=want,
                    got=calls, hint=hint, cause=cause)



# The same 3 ranks as the training case: the count per step does not depend on the world size.
OVERLAPPED.case("one async all-reduce per parameter with a gradient, each started during "
                "backward; finish only waits", uses=_overlapped_on_3,
                compare=_compare_one_per_grad_in_backward, weight=3,
                hint="Each all-reduce must be started asynchronously, during backward, once per "
                     "parameter with a gradient: blocking in the hook stalls backward, and "
                     "starting them in finish does not overlap at all.",
                expect=_trusted(OVERLAPPED, "gradients_per_step", SEED_STEPS, SEED_EXTRA))


# --------------------------------------------------------------------------- task 4.3

BUCKETED = task(
    "4.3", preload=PRELOAD, forbidden=DDP,
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
_bucketed_on_2 = _start_and_training_cases(BUCKETED, 2, ", 600-byte buckets,",
                                           start_cap_mb=LARGE_CAP, cap_mb=SMALL_CAP)
BUCKETED.case("the same on 4 ranks with 1500-byte buckets",
              uses=_training(BUCKETED, 4, 2, [0], cap_mb=LARGE_CAP),
              compare=_compare_training, expect=_trusted(BUCKETED, "single_process", 4, 2, [0]))


def _compare_bucket_calls(got: Any, expected: dict[str, Any]) -> None:
    plan = expected["plan"]
    for rank, run in enumerate(got):
        for step, (calls, want) in enumerate(zip(run["calls"], expected["calls"])):
            if calls != want:
                slip, hint, cause = _calls_slip(calls, want, "buckets")
                raise CheckFailed(
                    f"rank {rank}, step {step}: all-reduces started during backward() and in "
                    f"finish_gradient_synchronization(), for {len(plan)} buckets {plan}: "
                    "expected exactly one per bucket, during the last backward() unless a "
                    f"parameter of the bucket got no gradient; {slip}", expected=want, got=calls,
                    hint=hint, cause=cause)



BUCKETED.case("exactly one all-reduce per bucket per step, started when the bucket is ready "
              "(600-byte buckets, reverse order)", uses=_bucketed_on_2,
              compare=_compare_bucket_calls, weight=2,
              hint="One all-reduce per bucket per step, started during backward the moment the "
                   "bucket's last gradient is ready; a bucket with a parameter that got no "
                   "gradient can only start in finish.",
              expect=_trusted(BUCKETED, "bucket_calls", SMALL_CAP, SEED_STEPS, SEED_EXTRA, 1))


# --------------------------------------------------------------------------- task 4.4

NO_SYNC = task(
    "4.4", preload=PRELOAD, forbidden=DDP,
    hint="Gradient accumulation: inside no_sync() backward only accumulates gradients locally, "
         "with no communication; the first backward outside it reduces the accumulated sum, "
         "and the previous setting comes back even if the block raises.",
    recipe="Make no_sync a context manager that switches the require_backward_grad_sync flag "
           "off for the duration of the block and restores its previous value in a finally "
           "clause; while the flag is off, the gradient hook returns without counting or "
           "starting anything.",
)

MICRO = 2  # micro-batches per step: PER_RANK sequences split in two
_accumulating = _training(NO_SYNC, 2, SEED_STEPS, SEED_EXTRA, cap_mb=SMALL_CAP, micro=MICRO,
                          needs="Task 4.4:")

NO_SYNC.case("2 micro-batches per step (the first under no_sync) equal one process on the "
             "whole batch, 3 steps on 2 ranks", uses=_accumulating, compare=_compare_training,
             expect=_trusted(NO_SYNC, "single_process", 2, SEED_STEPS, SEED_EXTRA))
NO_SYNC.case("no all-reduce under no_sync; one per bucket on the last micro-batch",
             uses=_accumulating, compare=_compare_bucket_calls,
             expect=_trusted(NO_SYNC, "bucket_calls", SMALL_CAP, SEED_STEPS, SEED_EXTRA, MICRO))
NO_SYNC.case("the flag at the edges: restored after a raise inside the block (the error kept), "
             "a nested no_sync, a flag already off", weight=0.5, uses=_accumulating,
             pick="contract", compare=_compare_no_sync_contract, expect=lambda seed: None)
