"""Checks for Lesson 05, "Sharding training state": tasks 5.1-5.5.

Task 5.1 ``state_bytes`` is run on real ranks beside a trusted count on a model with tied
weights, on parameters that are views of one buffer, under torch DDP, DDP with torch's
``ZeroRedundancyOptimizer`` and FSDP2. Task 5.2 ``ShardedOptimizer`` trains on 3 ranks, each
on its own slice of every batch, and must end where one process on the whole batch ends with
the unsharded optimizer; each parameter's state must live on one rank only. Task 5.3 ``FSDP``
trains in fp32, bf16 and fp16 on 3 ranks against one process that casts the same way, while
the collective tracer counts every unit's all-gathers and reduce-scatters and a probe looks
for full parameters left after forward (as attributes or saved for backward). Task 5.4
``apply_fsdp2`` must give DTensors sharded on dim 0 of a 1-D and a 2-D mesh and the losses
of data parallelism. Task 5.5 ``clip_grad_norm_`` clips a float64 FSDP2 model with uneven (and
empty) shards and parameters without gradients on 2 and 4 ranks, against torch's clipping of the
unsharded model, with one all-reduce of one element; its companion ``train_step`` accumulates
micro-batches and must equal one unsharded step, reduce-scattering in the last backward only
(the grader's ``loss_fn`` marks the micro-batches on the recorder's timeline).

All the cases of a task judge one shared run on its ranks (``T.shared``); the trusted answers
(5.1's reference count, the one-process runs 5.2-5.5 must equal, the bounds) live in
:mod:`autograder.references.lesson05`. What each technique saves is measured below Python, by
:mod:`kit.meter` inside that same run, and held to the bound the technique promises: ZeRO-1's
optimizer state per rank, FSDP's shards after wrapping and its gathered units freed after
their forward, FSDP2's blocks resharded after theirs, and the bytes clipping sends.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from autograder.compare import CheckFailed, short, tensor_mismatch
from autograder.registry import task
from kit.lessons.models import TinyTransformer, token_batch

# --------------------------------------------------------------------------- shared

# FSDP2 and Dynamo (which DTensor pulls in), imported once before ranks fork: otherwise every
# rank of every launch pays seconds of imports.
PRELOAD = ("torch._dynamo", "torch.distributed.fsdp", "torch.distributed.optim",
           "torch.distributed.tensor")


def _slice(seed: int, step: int, rank: int, world_size: int, per_rank: int, length: int,
           vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``per_rank`` sequences of step ``step``'s global batch."""
    x, y = token_batch(world_size * per_rank, length, vocab, seed * 7919 + step)
    return x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float().flatten(0, 1), y.flatten())  # mean over tokens


def _storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors``: what a per-parameter state or a module's
    parameters() hold, each shared storage once (a DTensor: its local shard)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = getattr(t, "_local_tensor", t).untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _least(*path: str) -> Any:
    """A bound case's ``pick``: ``{"measured": {rank: bytes}}``, the least a rank measured over its
    repetitions and over the ranks (each rank returns a list of numbers under ``path``).

    Why the least: the meter misses a free made on one of gloo's worker threads (the staging
    copy of a collective, released there just after the call returns) and counts that block
    alive until its address is handed out again, so one rank's number is now and then a buffer
    or two high, at random. Memory the implementation itself keeps is kept on every rank, in
    every repetition: the least of them shows it all the same.
    """
    def pick(runs: Any) -> dict[str, Any]:
        least: dict[int, Any] = {}
        for rank, run in enumerate(runs):
            values = run
            for key in path:
                values = values[key]
            least[rank] = min(values)
        rank = min(least, key=least.get)
        return {"measured": {rank: least[rank]}}

    return pick


# --------------------------------------------------------------------------- task 5.1

BYTES_RANKS = 2


def _views_of_one_buffer() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A Linear whose weight and bias are views of one flat buffer, grads too (FSDP1's layout)."""
    layer = nn.Linear(8, 4)
    flat = torch.zeros(40)  # 36 elements, padded to 40
    layer.weight = nn.Parameter(flat[:32].view(4, 8))
    layer.bias = nn.Parameter(flat[32:36])
    grads = torch.ones(40)
    layer.weight.grad, layer.bias.grad = grads[:32].view(4, 8), grads[32:36]
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    optimizer.step()  # momentum buffers: two separate tensors
    return layer, optimizer


def _step(model: nn.Module, optimizer: Any, seed: int, rank: int) -> None:
    x, y = _slice(seed, 0, rank, BYTES_RANKS, 2, 8, 32)
    _loss(model(x), y).backward()
    optimizer.step()


def _bytes_on_rank(impl: Any, seed: int) -> dict[str, Any]:
    """Each scenario's ``impl(...)`` on this rank, as plain data."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()

    def model() -> TinyTransformer:
        torch.manual_seed(seed)
        return TinyTransformer(vocab=32, dim=16, layers=2, heads=2, context=8)

    def plain(result: Any) -> Any:
        if not isinstance(result, dict):
            return f"<a {type(result).__name__}, not a dict>"
        return {str(k): v if isinstance(v, int) and not isinstance(v, bool) else repr(v)[:80]
                for k, v in result.items()}

    out: dict[str, Any] = {}
    tied = model()
    out["tied weights, no gradients yet, no optimizer"] = plain(impl(tied))
    layer, sgd = _views_of_one_buffer()
    out["weight and bias views of one buffer, SGD with momentum"] = plain(impl(layer, sgd))
    m = model()
    adamw = torch.optim.AdamW(m.parameters(), lr=1e-3)
    _step(m, adamw, seed, rank)
    out["tied weights after an AdamW step"] = plain(impl(m, adamw))
    ddp = DDP(model())
    adamw = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    _step(ddp, adamw, seed, rank)
    out["DDP after an AdamW step"] = plain(impl(ddp, adamw))
    ddp = DDP(model())
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    _step(ddp, zero, seed, rank)
    out["DDP with ZeroRedundancyOptimizer(AdamW) after a step"] = plain(impl(ddp, zero))
    sharded = model()
    mesh = init_device_mesh("cpu", (BYTES_RANKS,))
    for block in sharded.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    # fused: DTensor plans a few fused ops in the first step, not each op for each parameter;
    # only the state's bytes are read from this run
    adamw = torch.optim.AdamW(sharded.parameters(), lr=1e-3, fused=True)
    _step(sharded, adamw, seed, rank)
    out["FSDP2 after an AdamW step"] = plain(impl(sharded, adamw))
    return out


BYTES_HINTS = {  # key -> (concept, recipe)
    "params": ("Memory is counted by storage, not by tensor: a tied weight and views of one "
               "buffer share one storage, which counts once, with all its bytes.",
               "Walk module.parameters() (a tied parameter is listed once) and add up "
               "t.untyped_storage().nbytes() for each storage not seen before (key: data_ptr())."),
    "grads": ("Gradients count like parameters: each storage once; a missing gradient counts 0.",
              "The same walk over p.grad for every parameter whose grad is not None."),
    "optimizer": ("The optimizer's memory is every tensor it keeps per parameter, including the "
                  "state of a local optimizer it wraps.",
                  "Every tensor value in optimizer.state[p] (exp_avg, exp_avg_sq, step, "
                  "momentum_buffer), and in optimizer.optim.state when the optimizer wraps one."),
}


def _bytes_compare(scenarios: list[str]) -> Any:
    def compare(got: Any, expected: list[Any]) -> None:
        for rank, (have, want) in enumerate(zip(got, expected)):
            for scenario in scenarios:
                g, w = have.get(scenario), want[scenario]
                if not isinstance(g, dict) or set(g) != set(w):
                    raise CheckFailed(f"rank {rank}, {scenario}: expected a dict with keys "
                                      f"{sorted(w)}", expected=w, got=g)
                for key, value in w.items():
                    if g[key] != value:
                        concept, recipe = BYTES_HINTS[key]
                        if "FSDP2" in scenario:
                            concept += " A DTensor costs this rank only its local shard."
                            recipe += " For a DTensor, take dtensor.to_local() first."
                        raise CheckFailed(
                            f"rank {rank}, {scenario}: {key!r} is {g[key]} bytes, this rank "
                            f"holds {value}", expected=value, got=g[key],
                            hint=concept, recipe=recipe)
    return compare


# bounds nothing: state_bytes is a meter; it saves no memory (its cases compare its counts with
# the reference's on the same objects, on the same ranks).
BYTES = task(
    "5.1", reference="state_bytes", preload=PRELOAD,
    # forbids nothing: no library counts the bytes a rank holds now, storages once, DTensors by
    # their local shard (torch's MemTracker attributes allocations while it watches a run).
    hint="Count memory, not tensors: tensors that share a storage (tied weights, views of one "
         "buffer) cost it once, and a sharded DTensor costs this rank only its local shard.",
    recipe="Write a helper that goes over some tensors and adds up the bytes of each storage "
           "behind them (untyped_storage().nbytes()) the first time it sees it, keyed by the "
           "storage's data_ptr(); for a DTensor, take its local tensor first. Apply it to the "
           "module's parameters, to the gradients that are not None, and to every tensor value "
           "in the optimizer's per-parameter state, plus the state of the optimizer it wraps "
           "(its .optim) when there is one; with no optimizer that count is 0. Return the three "
           "totals under 'params', 'grads' and 'optimizer'.",
)


# One launch of 2 ranks serves the three cases; the expectation is the reference through the
# same run (its own launch, once per seed).
BYTES_RUN = BYTES.shared(_bytes_on_rank, world_size=BYTES_RANKS)

BYTES.case("one rank's own tensors: tied weights once, views of one buffer once, AdamW state",
           uses=BYTES_RUN, compare=_bytes_compare(["tied weights, no gradients yet, no optimizer",
                                                   "weight and bias views of one buffer, SGD with "
                                                   "momentum",
                                                   "tied weights after an AdamW step"]))
BYTES.case("on 2 ranks: DDP (full copies) and ZeroRedundancyOptimizer (state on its owner)",
           uses=BYTES_RUN, compare=_bytes_compare(["DDP after an AdamW step",
                                                   "DDP with ZeroRedundancyOptimizer(AdamW) after "
                                                   "a step"]))
BYTES.case("on 2 ranks: FSDP2, where every parameter, gradient and state is a DTensor shard",
           uses=BYTES_RUN, compare=_bytes_compare(["FSDP2 after an AdamW step"]))


# --------------------------------------------------------------------------- task 5.2

ZERO_RANKS, ZERO_STEPS, ZERO_PER_RANK, ZERO_LENGTH, ZERO_VOCAB = 3, 10, 2, 8, 32
ADD_AT, HALVE_AT = 3, 6  # the step at which blocks.1 joins as a new group; lr halves
# Adam divides by sqrt(v) + eps: a gradient that is zero up to rounding (the key bias of
# attention) becomes a full +-lr step whose sign depends on summation order. A larger eps
# keeps such noise small, so sharded and unsharded runs agree to 1e-4.
EPS = 1e-4


def _zero_model(seed: int) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer(vocab=ZERO_VOCAB, dim=16, layers=2, heads=2, context=8)  # tied head


def _adamw_groups(model: TinyTransformer) -> tuple[list[dict], list[nn.Parameter]]:
    """Two groups (decayed matrices; undecayed vectors, faster) without blocks.1, which is
    frozen until it joins as a third group at step ADD_AT."""
    late = list(model.blocks[1].parameters())
    late_ids = {id(p) for p in late}
    early = [p for p in model.parameters() if id(p) not in late_ids]
    groups = [{"params": [p for p in early if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in early if p.dim() < 2], "weight_decay": 0.0, "lr": 2e-2}]
    for p in late:
        p.requires_grad_(False)
    return groups, late


def _zero_train(make: Any, seed: int, kind: str, rank: int, world_size: int,
                closure_losses: list[float] | None = None) -> tuple[TinyTransformer, Any]:
    """Train on ``rank``'s slices (``world_size`` > 1) or, with rank None, on whole batches."""
    model = _zero_model(seed)
    if kind == "adamw":
        groups, late = _adamw_groups(model)
        optimizer = make(groups, torch.optim.AdamW, lr=1e-2, weight_decay=0.05, eps=EPS)
    else:
        late = []
        optimizer = make(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    for step in range(ZERO_STEPS):
        if rank is None:
            x, y = token_batch(world_size * ZERO_PER_RANK, ZERO_LENGTH, ZERO_VOCAB,
                               seed * 7919 + step)
        else:
            x, y = _slice(seed, step, rank, world_size, ZERO_PER_RANK, ZERO_LENGTH, ZERO_VOCAB)
        if kind == "adamw":
            if step == ADD_AT:
                for p in late:
                    p.requires_grad_(True)
                optimizer.add_param_group({"params": late, "weight_decay": 0.2})
            if step == HALVE_AT:
                for group in optimizer.param_groups:
                    group["lr"] *= 0.5
            _loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        else:
            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                optimizer.zero_grad()
                loss = _loss(model(x), y)
                loss.backward()
                return loss

            loss = optimizer.step(closure)
            if closure_losses is not None:
                closure_losses.append(loss.item() if isinstance(loss, torch.Tensor) else loss)
    return model, optimizer


# The memory run: 24 equal tensors on the 3 ranks, so that ZeRO-1's owners hold 8 each. Its
# bound (total / W + one tensor) is 9 tensors' AdamW state: the correct optimizer keeps 8 (11%
# under the bound), one that keeps every tensor's state on every rank 24 (2.7x the bound).
ZERO_MEMORY_TENSORS, ZERO_MEMORY_NUMEL, ZERO_MEMORY_STEPS = 24, 1000, 3


def _zero_memory(impl: Any, seed: int, rank: int) -> list[int]:
    """Bytes this rank's optimizer keeps alive after each AdamW step over the memory run's
    tensors, as the meter sees them (the parameters exist before, the gradients are dropped)."""
    import torch.distributed as dist

    from kit import meter

    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(ZERO_MEMORY_NUMEL, generator=g))
              for _ in range(ZERO_MEMORY_TENSORS)]
    grads = torch.Generator().manual_seed(seed * 31 + rank)  # each rank its own gradients
    with meter.track() as usage:
        optimizer = impl(params, torch.optim.AdamW, lr=1e-2)
        for step in range(ZERO_MEMORY_STEPS):
            for p in params:
                p.grad = torch.randn(ZERO_MEMORY_NUMEL, generator=grads)
            optimizer.step()
            for p in params:
                p.grad = None  # gradients are not optimizer state
            dist.barrier()  # the step's collectives are over on every rank before the mark
            usage.mark(f"after step {step}")
    del optimizer
    return list(usage.marks.values())


def _zero_on_rank(impl: Any, seed: int) -> dict[str, Any]:
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for kind in ("adamw", "sgd"):
        losses: list[Any] = []
        model, optimizer = _zero_train(impl, seed, kind, rank, world_size, losses)
        state = getattr(optimizer, "state", {})
        owned = []
        for p in model.parameters():
            held = state.get(p, {}) if hasattr(state, "get") else {}
            owned.append(_storage_bytes(v for v in held.values() if isinstance(v, torch.Tensor)))
        out[kind] = {"final": {n: t.detach().clone() for n, t in model.state_dict().items()},
                     "state bytes per parameter": owned,
                     "closure losses": [v if isinstance(v, float) else repr(v) for v in losses]}
    out["memory"] = {"optimizer state": _zero_memory(impl, seed, rank)}
    return out


BROADCAST_HINT = ("After the step only a parameter's owner holds its new value: every other "
                  "rank needs it before the next forward.")
BROADCAST_RECIPE = ("After the inner optimizer's step, let each owner broadcast its parameters "
                    "(one flat buffer per owner) and every rank copy them back.")


def _compare_final(kind: str) -> Any:
    def compare(got: Any, expected: dict[str, Any]) -> None:
        want = expected[kind]["final"]
        for rank, run in enumerate(got):
            have = run[kind]["final"]
            for name, tensor in want.items():
                problem = tensor_mismatch(have.get(name), tensor, rtol=1e-4, atol=1e-5,
                                          world_size=len(got))
                if problem is not None:
                    others = [r for r in range(len(got)) if r != rank]
                    same_elsewhere = all(
                        tensor_mismatch(got[r][kind]["final"].get(name), tensor, rtol=1e-4,
                                        atol=1e-5) is None
                        for r in others)
                    why = (" (the other ranks have it right: did every owner broadcast its "
                           "parameters after stepping?)" if same_elsewhere else "")
                    # ranks that hold different values of one parameter: the owner's update
                    # never reached the others (the same in both optimizers' cases)
                    disagree = any(
                        tensor_mismatch(got[r][kind]["final"].get(name), have.get(name),
                                        rtol=1e-6, atol=1e-7) is not None for r in others)
                    raise CheckFailed(
                        f"rank {rank}: {name} after {ZERO_STEPS} steps {problem}, compared with "
                        f"one process on the whole batch{why}" +
                        ("; the ranks hold different values of it" if disagree and not why else ""),
                        expected=short(tensor), got=short(have.get(name)),
                        cause="ranks disagree" if disagree else "",
                        hint=BROADCAST_HINT if disagree else "",
                        recipe=BROADCAST_RECIPE if disagree else "")
        if kind == "sgd":
            for rank, run in enumerate(got):
                losses = run[kind]["closure losses"]
                want_losses = expected[kind]["closure losses"]
                if len(losses) != len(want_losses) or not all(isinstance(v, float) for v in losses):
                    raise CheckFailed(f"rank {rank}: step(closure) must return the closure's loss",
                                      expected="a loss per step", got=losses[:3])
    return compare


def _compare_ownership(got: Any, expected: dict[str, Any]) -> None:
    for kind in ("adamw", "sgd"):
        want = expected[kind]["state bytes per parameter"]
        sizes = expected[kind]["sizes"]
        per_rank = [run[kind]["state bytes per parameter"] for run in got]
        for i, full in enumerate(want):
            holders = [r for r, owned in enumerate(per_rank) if owned[i]]
            if len(holders) != 1:
                raise CheckFailed(
                    f"{kind}: parameter {i} ({sizes[i]} elements) has optimizer state on "
                    f"{len(holders)} ranks {holders}; exactly one rank, its owner, keeps it",
                    expected=1, got=len(holders),
                    hint="Sharding the state means a parameter's optimizer state exists on its "
                         "owner only, and self.state is where it is looked for.",
                    recipe="Build the inner optimizer over this rank's parameters only, so it "
                           "steps only those, and make self.state refer to its state.")
            if per_rank[holders[0]][i] != full:
                raise CheckFailed(f"{kind}: parameter {i}'s state on rank {holders[0]} is "
                                  f"{per_rank[holders[0]][i]} bytes; the unsharded optimizer "
                                  f"keeps {full}", expected=full, got=per_rank[holders[0]][i])
        elements = [sum(n for n, b in zip(sizes, owned) if b) for owned in per_rank]
        bound = sum(sizes) / len(got) + max(sizes)
        for rank, n in enumerate(elements):
            if n > bound:
                raise CheckFailed(
                    f"{kind}: rank {rank} owns {n} of {sum(sizes)} elements; balanced ownership "
                    f"keeps every rank at most 1/{len(got)} of them plus the largest parameter "
                    f"({bound:.0f})", expected=f"at most {bound:.0f}", got=elements,
                    hint="Ownership balances memory: each rank should own about 1/W of the "
                         "elements.",
                    recipe="Assign parameters largest first, each to the rank owning the fewest "
                           "elements so far.")


ZERO = task(
    "5.2", preload=PRELOAD,
    # torch's ZeRO-1 (its module's helpers too) and the DDP hook that steps it.
    forbidden=("torch.distributed.optim.ZeroRedundancyOptimizer",
               "torch.distributed.optim.zero_redundancy_optimizer",
               "torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook"),
    hint="ZeRO-1: each parameter has one owner rank, which alone keeps its optimizer state and "
         "steps it; the owner needs the mean gradient over ranks, and afterwards every rank "
         "needs the owner's updated parameter.",
    recipe="Keep a map from parameter to owner and a count of elements owned per rank. In "
           "add_param_group, let the base class add the group, then go over its parameters "
           "largest first and give each to the rank owning the fewest elements so far (ties: "
           "the lowest rank); if the inner optimizer exists already, add the same group to it "
           "with only this rank's parameters. In __init__, once the base class has built the "
           "groups, build optimizer_cls over the same groups holding only this rank's "
           "parameters, and make self.state that optimizer's state. In step: run the closure "
           "(with gradients enabled) if there is one and keep its loss; for each owner, flatten "
           "the gradients of its parameters into one buffer and dist.reduce it to that owner, "
           "who divides by the world size and copies it back into the gradients; copy the "
           "hyperparameters of self.param_groups into the inner optimizer's groups; step the "
           "inner optimizer; then each owner broadcasts its parameters (one flat buffer per "
           "owner) and every rank copies them back. Return the loss.",
)


# One launch of 3 ranks: the AdamW and SGD training runs, self.state's ownership and the memory
# run all come from it.
ZERO_RUN = ZERO.shared(_zero_on_rank, world_size=ZERO_RANKS)

ZERO.case(f"{ZERO_STEPS} AdamW steps on {ZERO_RANKS} ranks (weight decay, two groups, a group "
          f"added at step {ADD_AT}, lr halved at step {HALVE_AT}, tied weights) equal one "
          "process on the whole batch", uses=ZERO_RUN, compare=_compare_final("adamw"), weight=2,
          expect="zero_expected")
ZERO.case(f"{ZERO_STEPS} SGD steps with momentum through step(closure) equal one process",
          uses=ZERO_RUN, compare=_compare_final("sgd"),
          hint="Every rank's .grad holds only its own slice's gradient, and the owner must step "
               "with the mean over ranks; step(closure) returns the closure's loss.",
          recipe="Call the closure first (with gradients enabled) and keep its loss; reduce each "
                 "owner's gradients to it and divide them by the world size there; step, "
                 "broadcast, and return the loss.",
          expect="zero_expected")
ZERO.case("each parameter's optimizer state lives on exactly one rank, in self.state, and "
          "ownership is balanced by elements", uses=ZERO_RUN, compare=_compare_ownership,
          expect="zero_expected")
# What ZeRO-1 saves, seen by the meter, not in self.state: 24 tensors of 1000 elements, AdamW.
ZERO.bound("optimizer state per rank", formula="total / W + the largest parameter's state",
           lost=f"a rank keeps optimizer state for parameters it does not own (the state of all "
                f"{ZERO_MEMORY_TENSORS} tensors on every rank is 2.7x the ZeRO-1 bound)",
           hint="Sharding the optimizer state saves memory only if no rank creates state for a "
                "parameter it does not own: the meter counts every tensor a rank allocates and "
                "keeps, wherever it is kept, not only what self.state shows.",
           recipe="Build the inner optimizer over this rank's own parameters only (and add only "
                  "those when a group is added later), so that it never creates state for the "
                  "others; reduce each gradient to its owner instead of all-reducing every "
                  "gradient to every rank; let each owner broadcast what it stepped.",
           expect="zero_state_bound", uses=ZERO_RUN, pick=_least("memory", "optimizer state"),
           # the saving ZeRO-1 exists for: half the task (the state in every rank's memory)
           weight=4)


# --------------------------------------------------------------------------- task 5.3

FSDP_RANKS, FSDP_STEPS, FSDP_PER_RANK, FSDP_LENGTH, FSDP_VOCAB = 3, 3, 2, 6, 29
DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
UNIT_TYPES = (nn.Linear, nn.Embedding)


def _fsdp_model(seed: int) -> TinyTransformer:
    """A small transformer with its output layer untied (units may not share parameters).

    29 tokens and 6 positions make flat sizes that 3 ranks do not divide (padding matters).
    """
    torch.manual_seed(seed)
    model = TinyTransformer(vocab=FSDP_VOCAB, dim=16, layers=1, heads=2, context=FSDP_LENGTH)
    model.head.weight = nn.Parameter(model.tok.weight.detach().clone())
    return model


def _units(model: nn.Module) -> dict[str, list[tuple[str, torch.Size]]]:
    """Trusted: ``{unit prefix: [(parameter name, shape), ...]}`` in module order."""
    return {prefix: [(n, p.shape) for n, p in m.named_parameters(recurse=False)]
            for prefix, m in model.named_modules()
            if isinstance(m, UNIT_TYPES) and any(True for _ in m.parameters(recurse=False))}


def _padded(numel: int, world_size: int) -> int:
    return math.ceil(numel / world_size) * world_size


def _fsdp_on_rank(impl: Any, seed: int) -> dict[str, Any]:
    import torch.distributed as dist

    from kit.trace import trace

    rank, world_size = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for label, dtype in DTYPES.items():
        model = _fsdp_model(seed)
        units = _units(model)
        unit_modules = {prefix: model.get_submodule(prefix) for prefix in units}
        weight_shapes = {tuple(s) for params in units.values() for _, s in params if len(s) == 2}
        weight_shapes |= {s[::-1] for s in weight_shapes}
        fsdp = impl(model, compute_dtype=dtype)
        if getattr(fsdp, "module", None) is not model:
            raise AttributeError(f"{type(fsdp).__name__} must keep the wrapped model as .module")
        optimizer = torch.optim.AdamW(fsdp.parameters(), lr=1e-2, weight_decay=0.1, eps=EPS)
        run: dict[str, Any] = {"params bytes": [], "collectives": [], "left after forward": []}
        for step in range(FSDP_STEPS):
            x, y = _slice(seed, step, rank, world_size, FSDP_PER_RANK, FSDP_LENGTH, FSDP_VOCAB)
            run["params bytes"].append(_storage_bytes(model.parameters()))
            saved: list[torch.Tensor] = []

            def probe(t: torch.Tensor, saved: list = saved, shapes: set = weight_shapes) -> Any:
                if t.dim() == 2 and tuple(t.shape) in shapes:
                    saved.append(t)  # what autograd keeps of a unit's weight, if anything
                return t

            with trace() as t:
                with torch.autograd.graph.saved_tensors_hooks(probe, lambda t: t):
                    logits = fsdp(x)
                left = _full_params_left(unit_modules, units, saved)
                _loss(logits, y).backward()
                fsdp.finish_gradient_synchronization()
            run["left after forward"].append(left)
            run["collectives"].append([(e.op, e.nbytes) for e in t.events
                                       if e.kind == "collective"])
            if step == 0:
                run["grads"] = _shard_grads(model, unit_modules)
            optimizer.step()
            optimizer.zero_grad()
        run["final"] = {str(k): v.detach().clone() if isinstance(v, torch.Tensor) else repr(v)
                        for k, v in fsdp.full_state_dict().items()}
        out[label] = run
    out["memory"] = _fsdp_memory(impl, seed)
    return out


# The memory run: 12 equal Linear units of 128 x 128 (66 KB each, gathered) and a batch of 2,
# whose activations are 12 KB: a gathered unit kept alive is unmistakable. Its bounds leave one
# unit (or one shard) of slack; the correct FSDP keeps 16% of the after-forward bound, peaks
# at 69% of the forward bound and holds 92% of the parameter bound, while one that keeps every
# gathered buffer is 10x and 4.1x over and one that keeps the original parameters 3.7x.
FSDP_MEMORY_UNITS, FSDP_MEMORY_DIM, FSDP_MEMORY_BATCH, FSDP_MEMORY_REPEATS = 12, 128, 2, 2


def _memory_model(seed: int) -> nn.Sequential:
    """FSDP_MEMORY_UNITS Linear layers (FSDP_MEMORY_DIM square) with a ReLU between each two."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(FSDP_MEMORY_UNITS):
        layers += [nn.Linear(FSDP_MEMORY_DIM, FSDP_MEMORY_DIM), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _memory_input(seed: int) -> torch.Tensor:
    return torch.randn(FSDP_MEMORY_BATCH, FSDP_MEMORY_DIM,
                       generator=torch.Generator().manual_seed(seed + 1))


def _fsdp_memory(impl: Any, seed: int) -> dict[str, list[int]]:
    """What the meter sees of one fp32 step of the memory model, per repetition: the bytes alive
    after wrapping (the parameters this rank keeps), and, above that, the bytes still alive after
    the forward and the peak during it."""
    import torch.distributed as dist

    from kit import meter

    x = _memory_input(seed)
    out: dict[str, list[int]] = {"parameters": [], "after forward": [], "forward peak": []}
    for _ in range(FSDP_MEMORY_REPEATS):
        with meter.track() as usage:
            fsdp = impl(_memory_model(seed))
            dist.barrier()
            usage.mark("wrapped")
            y = fsdp(x)
            dist.barrier()  # every rank's all-gathers are over before the mark
            usage.mark("after forward")
            y.square().sum().backward()
            fsdp.finish_gradient_synchronization()
            del y, fsdp
        wrapped = usage.marks["wrapped"]
        out["parameters"].append(wrapped)
        out["after forward"].append(usage.marks["after forward"] - wrapped)
        out["forward peak"].append(usage.peaks["after forward"] - wrapped)
    return out


def _full_params_left(unit_modules: dict[str, nn.Module], units: dict[str, Any],
                      saved: list[torch.Tensor]) -> list[str]:
    """What of the units' full parameters still holds memory right after the forward."""
    left = []
    for prefix, m in unit_modules.items():
        for name, shape in units[prefix]:
            value = getattr(m, name, None)
            if isinstance(value, torch.Tensor) and value.shape == shape \
                    and value.untyped_storage().nbytes() > 0:
                left.append(f"{prefix}.{name} (an attribute of the unit)")
    alive = {t.untyped_storage().data_ptr() for t in saved if t.untyped_storage().nbytes() > 0}
    if alive:
        left.append(f"{len(alive)} full weight(s) saved by autograd for backward")
    return left


def _shard_grads(model: nn.Module, unit_modules: dict[str, nn.Module]) -> dict[str, Any]:
    """Each unit's registered parameters' grads, and the other parameters' grads, by name."""
    grads: dict[str, Any] = {}
    unit_ids = set()
    for prefix, m in unit_modules.items():
        own = list(m.parameters(recurse=False))
        unit_ids |= {id(p) for p in own}
        grads[prefix] = [None if p.grad is None else p.grad.detach().clone() for p in own]
    for name, p in model.named_parameters():
        if id(p) not in unit_ids:
            grads[name] = None if p.grad is None else p.grad.detach().clone()
    return grads


TOLERANCE = {"float32": (1e-4, 1e-5), "bfloat16": (1e-4, 1e-5), "float16": (1e-4, 1e-5)}


def _compare_fsdp_grads(got: Any, expected: dict[str, Any]) -> None:
    want_all = expected["float32"]["grads"]
    units = expected["float32"]["units"]
    world_size = len(got)
    for prefix, params in units.items():
        pieces = [run["float32"]["grads"].get(prefix) for run in got]
        for rank, piece in enumerate(pieces):
            if not (isinstance(piece, list) and len(piece) == 1):
                raise CheckFailed(
                    f"rank {rank}: unit {prefix} holds "
                    f"{len(piece) if isinstance(piece, list) else 0}"
                    " parameters of its own after wrapping; expected one, its flat shard",
                    expected=1, got=piece if not isinstance(piece, list) else len(piece),
                    hint="After wrapping, a unit's only parameter is its flat shard, so that any "
                         "optimizer trains the shard and nothing else.",
                    recipe="Remove the unit's own parameters from the module (from its "
                           "_parameters dict) and register the shard on the unit module in their "
                           "place.")
            if piece[0] is None:
                raise CheckFailed(f"rank {rank}: unit {prefix}'s shard has no .grad after "
                                  "backward and finish_gradient_synchronization()",
                                  hint="The shard gets its gradient through autograd: the "
                                       "backward of an all-gather is a reduce-scatter.",
                                  recipe="Gather through the autograd Function in the forward "
                                         "pre-hook, applied to the shard; its backward returns "
                                         "the reduce-scattered gradient (and None for the unit).")
        numel = sum(math.prod(s) for _, s in params)
        padded = _padded(numel, world_size)
        sizes = [p[0].numel() for p in pieces]
        if sizes != [padded // world_size] * world_size:
            raise CheckFailed(f"unit {prefix} ({numel} elements): shards of {sizes} elements on "
                              f"the {world_size} ranks; padded to {padded}, each holds "
                              f"{padded // world_size}",
                              expected=[padded // world_size] * world_size,
                              got=sizes, hint="Shards are equal: a flat size the world size does "
                                              "not divide is padded first.",
                              recipe="Pad the flat buffer with zeros to the next multiple of the "
                                     "world size, then split it in equal pieces.")
        flat = torch.cat([p[0].reshape(-1) for p in pieces])
        offset = 0
        for name, shape in params:
            n = math.prod(shape)
            grad = flat[offset:offset + n].view(shape)
            offset += n
            full = f"{prefix}.{name}"
            problem = tensor_mismatch(grad, want_all[full], rtol=1e-4, atol=1e-6,
                                      world_size=world_size)
            if problem is not None:
                raise CheckFailed(f"the shards' gradients of {full}, gathered from the ranks, "
                                  f"{problem}", expected=short(want_all[full]), got=short(grad))
    for rank, run in enumerate(got):
        for name, want in want_all.items():
            if name.rsplit(".", 1)[0] in units:
                continue
            have = run["float32"]["grads"].get(name)
            problem = tensor_mismatch(have, want, rtol=1e-4, atol=1e-6, world_size=world_size)
            if problem is not None:
                raise CheckFailed(f"rank {rank}: the replicated {name}.grad after "
                                  f"finish_gradient_synchronization() {problem}",
                                  expected=short(want), got=short(have),
                                  hint="Parameters outside the units are replicated, as in DDP: "
                                       "their gradients must be the mean over ranks.",
                                  recipe="In finish_gradient_synchronization, all-reduce every "
                                         "replicated parameter's gradient (skip None) and divide "
                                         "it by the world size.")


def _compare_fsdp_final(labels: list[str]) -> Any:
    def compare(got: Any, expected: dict[str, Any]) -> None:
        for label in labels:
            rtol, atol = TOLERANCE[label]
            want = expected[label]["final"]
            for rank, run in enumerate(got):
                have = run[label]["final"]
                if set(have) != set(want):
                    raise CheckFailed(f"rank {rank}, {label}: full_state_dict() has the wrong keys",
                                      expected=sorted(want), got=sorted(have),
                                      hint="full_state_dict() looks like the unwrapped model's: "
                                           "its original names, full shapes, fp32.",
                                      recipe="Key every full tensor by its name in the original "
                                             "model (prefix of the unit + '.' + parameter name).")
                for name, tensor in want.items():
                    problem = tensor_mismatch(have[name], tensor, rtol=rtol, atol=atol)
                    if problem is not None:
                        raise CheckFailed(
                            f"rank {rank}, compute_dtype={label}: {name} after {FSDP_STEPS} "
                            f"AdamW steps {problem}", expected=short(tensor),
                            got=short(have[name]))
                    if have[name].dtype != torch.float32:
                        raise CheckFailed(f"rank {rank}: full_state_dict()[{name!r}] is "
                                          f"{have[name].dtype}; the master weights are fp32")
    return compare


def _compare_fsdp_bytes(got: Any, expected: dict[str, Any]) -> None:
    world_size = len(got)
    units = expected["float32"]["units"]
    shards = sum(_padded(sum(math.prod(s) for _, s in params), world_size) // world_size
                 for params in units.values()) * 4
    bound = shards + expected["float32"]["replicated bytes"]
    model = sum(math.prod(s) for params in units.values() for _, s in params) * 4
    for label in DTYPES:
        for rank, run in enumerate(got):
            for step, nbytes in enumerate(run[label]["params bytes"]):
                if nbytes > bound:
                    raise CheckFailed(
                        f"rank {rank}, compute_dtype={label}, before step {step}: the model's "
                        f"parameters() hold {nbytes} bytes on this rank; its shards (1/"
                        f"{world_size} of the units' {model} bytes, padded) and the replicated "
                        f"parameters hold {bound}", expected=f"at most {bound}", got=nbytes,
                        hint="Sharding saves memory only if each rank holds just its 1/W piece: "
                             "a view of a slice keeps the whole buffer alive.",
                        recipe="Register a clone of this rank's piece (not a view of the padded "
                               "buffer) as the only parameter of the unit module, after "
                               "removing the originals from it.")


def _expected_collectives(units: dict[str, Any], world_size: int, dtype: torch.dtype | None
                          ) -> tuple[list[int], list[int]]:
    size = torch.empty(0, dtype=dtype or torch.float32).element_size()
    padded = [_padded(sum(math.prod(s) for _, s in params), world_size)
              for params in units.values()]
    return sorted(p * size for p in padded for _ in range(2)), sorted(p * 4 for p in padded)


def _compare_fsdp_collectives(got: Any, expected: dict[str, Any]) -> None:
    units = expected["float32"]["units"]
    for label, dtype in DTYPES.items():
        gathers, scatters = _expected_collectives(units, len(got), dtype)
        for rank, run in enumerate(got):
            for step, events in enumerate(run[label]["collectives"]):
                have_g = sorted(b for op, b in events if "all_gather" in op)
                have_s = sorted(b for op, b in events if "reduce_scatter" in op)
                if have_g != gathers or have_s != scatters:
                    reduces = sum(1 for op, _ in events if op == "all_reduce")
                    # what was sent that ZeRO-3 does not send, in the direction the data shows
                    sent = (": an all-reduce sends every rank the whole gradient, twice a "
                            "reduce-scatter's bytes, and leaves it a full gradient to keep, where "
                            "ZeRO-3 keeps 1/W" if reduces and len(have_s) < len(scatters) else
                            ": more bytes than ZeRO-3 sends" if sum(have_g) + sum(have_s)
                            > sum(gathers) + sum(scatters) else "")
                    raise CheckFailed(
                        f"rank {rank}, compute_dtype={label}, step {step}: expected each of the "
                        f"{len(units)} units all-gathered twice (forward, backward) in "
                        f"{label} and reduce-scattered once in float32, per step; the tracer saw "
                        f"{len(have_g)} all-gathers, {len(have_s)} reduce-scatters and "
                        f"{reduces} all-reduces{sent}", expected={"all-gather bytes": gathers,
                                                           "reduce-scatter bytes": scatters},
                        got={"all-gather bytes": have_g, "reduce-scatter bytes": have_s},
                        hint="FSDP's traffic per unit and step: two all-gathers (forward, "
                             "backward) in the compute dtype and one reduce-scatter in float32.",
                        recipe="Gather a unit in its forward pre-hook and again when its backward "
                               "starts (a hook on its output); reduce-scatter its flat gradient "
                               "(cast to float32) once, in the backward of the gather.")


# The cause of a gathered unit kept past its forward: the freed case names what holds it, and
# the two memory bounds after and during the forward exceed for that same reason.
GATHERED_KEPT = "gathered units kept after their forward"


def _compare_fsdp_freed(got: Any, expected: dict[str, Any]) -> None:
    for label in DTYPES:
        for rank, run in enumerate(got):
            for step, left in enumerate(run[label]["left after forward"]):
                if left:
                    # what holds the buffer decides the fix: the views left on the module, or
                    # the weights autograd saved for backward
                    saved = all("saved by autograd" in what for what in left)
                    raise CheckFailed(
                        f"rank {rank}, compute_dtype={label}, step {step}: right after the "
                        f"forward, full parameters still hold memory: {', '.join(left[:4])}",
                        expected="none", got=left[:4], cause=GATHERED_KEPT,
                        hint=("The views are gone, but what autograd saves for backward counts "
                              "too: a saved weight keeps the full buffer alive." if saved else
                              "A gathered unit must be freed after its forward: the views set "
                              "on the module keep the full buffer alive."),
                        recipe=("Make autograd save a note (torch.autograd.graph."
                                "saved_tensors_hooks) instead of the gathered parameters; gather "
                                "again when backward needs them." if saved else
                                "Delete the views in the forward hook, and make autograd save a "
                                "note (torch.autograd.graph.saved_tensors_hooks) instead of the "
                                "gathered parameters; gather again when backward needs them."))


FSDP_TASK = task(
    "5.3", preload=PRELOAD,
    # torch's FSDP, 1 and 2, everything in torch.distributed.fsdp (flat parameters, the runtime's
    # hooks) and the composable alias; DDP for the replicated parameters.
    forbidden=("torch.distributed.fsdp.fully_shard",
               "torch.distributed.fsdp.FullyShardedDataParallel",
               "torch.distributed.fsdp", "torch.distributed._composable.fsdp",
               "torch.nn.parallel.DistributedDataParallel"),
    hint="ZeRO-3: each unit's parameters live only as one flat shard per rank; a unit is "
         "all-gathered just before it computes (in forward, and again in backward) and freed "
         "right after, and its gradient is reduce-scattered back onto the shards.",
    recipe="FSDP: make a Unit for every submodule of a wrap type that has parameters of its own "
           "(ValueError if two units share one); all other parameters are replicated. Unit: "
           "flatten its own parameters into one fp32 buffer, pad it with zeros to a multiple of "
           "the world size, keep a clone of this rank's piece as an nn.Parameter registered on "
           "the module in place of the originals, and register a forward pre-hook and a forward "
           "hook. gather all-gathers the shard, cast to the dtype asked for, into a buffer of the "
           "padded length. The autograd Function's forward returns that gather (compute dtype), "
           "its backward the reduce-scatter. Pre-hook: apply the Function to the shard, set each "
           "original name on the module to its view of the result, remember that buffer's "
           "storage, and enter saved-tensor hooks. Forward hook: leave those hooks, delete the "
           "views, and register a hook on the output that gathers again when backward starts. "
           "pack turns a tensor in the gathered storage into a note (size, stride, offset); "
           "unpack rebuilds it from the buffer gathered for backward. reduce_scatter drops that "
           "buffer, reduce-scatters the gradient in fp32 and divides by the world size. "
           "finish_gradient_synchronization averages the replicated gradients; full_state_dict "
           "gathers each unit in fp32 and names each view after the unit's prefix and parameter.",
)


# One launch of 3 ranks: the fp32, bf16 and fp16 training runs, the tracer's collectives, the
# probes after forward and the memory run all come from it.
FSDP_RUN = FSDP_TASK.shared(_fsdp_on_rank, world_size=FSDP_RANKS)

FSDP_TASK.case(f"gradients after one backward on {FSDP_RANKS} ranks: each unit's shard holds "
               "its piece of the mean gradient (padded to a multiple of W); replicated "
               "parameters hold the mean", uses=FSDP_RUN, compare=_compare_fsdp_grads, weight=2,
               expect="fsdp_expected")
FSDP_TASK.case(f"{FSDP_STEPS} AdamW steps in fp32, different data per rank, equal one process "
               "on the whole batch (full_state_dict)", uses=FSDP_RUN,
               compare=_compare_fsdp_final(["float32"]), weight=2, expect="fsdp_expected")
FSDP_TASK.case("the same with compute_dtype bf16 and fp16, against one process that casts "
               "the units the same way", uses=FSDP_RUN,
               compare=_compare_fsdp_final(["bfloat16", "float16"]),
               hint="Mixed precision: parameters are gathered and used in compute_dtype, but "
                    "the shards (the master weights) and their gradients stay float32.",
               recipe="Cast the shard to compute_dtype before the all-gather; cast the gradient "
                      "back to float32 before the reduce-scatter; the shards stay float32.",
               expect="fsdp_expected")
FSDP_TASK.case("between steps, parameters per rank are 1/W of the units (plus padding) and "
               "the replicated ones", uses=FSDP_RUN, compare=_compare_fsdp_bytes,
               expect="fsdp_expected", saving=True)
FSDP_TASK.case("each unit is all-gathered twice per step and reduce-scattered once, as the "
               "tracer sees it", uses=FSDP_RUN, compare=_compare_fsdp_collectives, weight=2,
               expect="fsdp_expected", saving=True)
FSDP_TASK.case("no unit's full parameters survive its forward (not as attributes, not saved "
               "for backward)", uses=FSDP_RUN, compare=_compare_fsdp_freed, expect="fsdp_expected",
               saving=True)

# What ZeRO-3 saves, seen by the meter on the memory model (12 units of 128 x 128, 3 ranks).
FSDP_TASK.bound(
    "parameter bytes per rank after wrapping",
    formula="1/W of every unit's flat parameters (padded) + one shard of slack",
    lost="every rank still holds full parameters next to its shards (the original tensors kept "
         "alive: 3.7x the ZeRO-3 bound)",
    hint="ZeRO-3 saves memory only once nothing holds a unit's full parameters any more: a "
         "reference kept to the original tensors keeps every one of them alive beside the shard.",
    recipe="Copy the unit's parameters into the flat buffer inside __init__ using local names, "
           "keep only the clone of this rank's piece, and remove the originals from the module; "
           "do not store the original tensors on the Unit or anywhere else.",
    expect="fsdp_parameter_bound", uses=FSDP_RUN, pick=_least("memory", "parameters"))
FSDP_TASK.bound(
    "bytes alive after the forward",
    formula="the unwrapped model's activations + one gathered unit",
    lost="gathered units stay alive after their forward: ZeRO-3 frees each unit's full "
         "parameters as soon as it has computed",
    hint="A gathered unit is freed only when the last reference to its buffer goes: the views "
         "set on the module, the tensors autograd saves, and any attribute or list that still "
         "points at the buffer.",
    recipe="In the forward pre-hook, keep the gathered buffer in local variables only (remember "
           "its storage's address, not the tensor); in the forward hook, delete the views, so "
           "that nothing refers to the buffer any more.",
    cause=GATHERED_KEPT, expect="fsdp_after_forward_bound", uses=FSDP_RUN,
    pick=_least("memory", "after forward"))
FSDP_TASK.bound(
    "peak bytes during the forward",
    formula="the activations + 3 gathered units (the one computing, its all-gather's staging "
            "copy, one of slack)",
    lost="several units are whole at once: ZeRO-3 keeps only the unit computing gathered",
    hint="FSDP's peak is one unit's full parameters at a time on top of the shards and the "
         "activations; every unit still gathered when the next one gathers adds its full size.",
    recipe="Free each unit's gathered buffer in its forward hook (delete the views, keep no "
           "other reference), before the next unit's pre-hook gathers.",
    cause=GATHERED_KEPT, expect="fsdp_forward_peak_bound", uses=FSDP_RUN,
    pick=_least("memory", "forward peak"))


# --------------------------------------------------------------------------- task 5.4

FSDP2_RANKS, FSDP2_STEPS, FSDP2_PER_RANK, FSDP2_LENGTH, FSDP2_VOCAB = 4, 3, 2, 8, 32
MESHES = {"1-D mesh (4,)": ((4,), ("shard",)),
          "2-D mesh (2, 2) replicate x shard": ((2, 2), ("replicate", "shard"))}
PLACEMENTS = {"1-D mesh (4,)": "(Shard(dim=0),)",
              "2-D mesh (2, 2) replicate x shard": "(Replicate(), Shard(dim=0))"}


def _fsdp2_model(seed: int) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer(vocab=FSDP2_VOCAB, dim=16, layers=2, heads=2, context=FSDP2_LENGTH)


# The memory run: 4 blocks of dim 64 (200 KB each) and a batch of 1 x 4 tokens, whose
# activations are 0.4 block: a block left gathered after its forward is unmistakable. The
# bound after forward (activations + the root, which FSDP2 keeps gathered for backward, + one
# block of slack) is 1.45 blocks: the correct sharding keeps 31% of it, one that keeps every
# block gathered until backward 3.1x.
FSDP2_MEMORY_DIM, FSDP2_MEMORY_LAYERS, FSDP2_MEMORY_REPEATS = 64, 4, 1  # 4 ranks, once each


def _fsdp2_memory_model(seed: int) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer(vocab=FSDP2_VOCAB, dim=FSDP2_MEMORY_DIM, layers=FSDP2_MEMORY_LAYERS,
                           heads=2, context=4)


def _fsdp2_memory_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(1, 4, FSDP2_VOCAB, seed)


def _fsdp2_memory(impl: Any, seed: int, mesh: Any) -> list[int]:
    """Bytes alive after the forward of the memory model, sharded by ``impl`` on ``mesh``, per
    repetition, as the meter sees them (the sharded parameters exist before)."""
    import torch.distributed as dist

    from kit import meter

    x, y = _fsdp2_memory_batch(seed)
    after = []
    for _ in range(FSDP2_MEMORY_REPEATS):
        model = _fsdp2_memory_model(seed)
        returned = impl(model, mesh)
        model = returned if isinstance(returned, nn.Module) else model
        with meter.track() as usage:
            logits = model(x)
            dist.barrier()  # every rank's all-gathers are over before the mark
            usage.mark("after forward")
            _loss(logits, y).backward()
            del logits
        after.append(usage.marks["after forward"])
        del model
    return after


def _fsdp2_on_rank(impl: Any, seed: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from kit import meter

    rank, world_size = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for label, (shape, names) in MESHES.items():
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        with meter.track() as usage:  # what the rank holds once the model is built and sharded
            model = _fsdp2_model(seed)
            returned = impl(model, mesh)
            model = returned if isinstance(returned, nn.Module) else model
            usage.mark("sharded")
        run: dict[str, Any] = {
            "placements": {n: (str(tuple(p.placements)) if isinstance(p, DTensor)
                               else "a plain tensor")
                           for n, p in model.named_parameters()},
            "fully_shard applied to": [name or "the root" for name, m in model.named_modules()
                                       if isinstance(m, FSDPModule)],
            "params bytes": usage.marks["sharded"],
            "losses": [],
        }
        # fused, as the reference's: a fresh rank's first step then plans 9 DTensor ops, not
        # every op of the single-tensor update for every parameter (64 for 16 parameters).
        # Its last bits depend on how a tensor is split (vector loop against scalar tail), so
        # only where results are compared with a tolerance: here, losses at rel_tol 1e-4.
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
        for step in range(FSDP2_STEPS):
            x, y = _slice(seed, step, rank, world_size, FSDP2_PER_RANK, FSDP2_LENGTH, FSDP2_VOCAB)
            loss = _loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            run["losses"].append(loss.item())
        out[label] = run
    mesh = init_device_mesh("cpu", (world_size,))
    model = _fsdp2_model(seed)
    returned = impl(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = returned if isinstance(returned, nn.Module) else model
    seen: list[str] = []
    model.blocks[0].qkv.register_forward_pre_hook(lambda m, a: seen.append(str(m.weight.dtype)))
    x, y = _slice(seed, 0, rank, world_size, FSDP2_PER_RANK, FSDP2_LENGTH, FSDP2_VOCAB)
    logits = model(x)
    _loss(logits, y).backward()
    grad = model.blocks[0].qkv.weight.grad
    out["bf16"] = {"forward weight dtype": seen, "logits dtype": str(logits.dtype),
                   "grad dtype": str(grad.dtype) if grad is not None else "None"}
    memory_mesh = init_device_mesh("cpu", (world_size,))  # a mesh of its own, as before
    out["memory"] = {"after forward": _fsdp2_memory(impl, seed, memory_mesh)}
    return out


def _compare_placements(got: Any, expected: dict[str, Any]) -> None:
    for label in MESHES:
        for rank, run in enumerate(got):
            placed = run[label]["placements"]
            for name in expected["names"]:
                if placed.get(name) != PLACEMENTS[label]:
                    raise CheckFailed(
                        f"rank {rank}, {label}: {name} is {placed.get(name)}, expected a DTensor "
                        f"placed {PLACEMENTS[label]}", expected=PLACEMENTS[label],
                        got=placed.get(name),
                        hint="Every parameter must belong to some unit: the blocks hold theirs, "
                             "and the root holds the rest (embeddings, final norm, output layer).",
                        recipe="Shard each block with the mesh, then shard the root model with "
                               "the same mesh.")
            wrapped = set(run[label]["fully_shard applied to"])
            want = set(expected["blocks"]) | {"the root"}
            if wrapped != want:
                raise CheckFailed(f"rank {rank}, {label}: fully_shard applied to {sorted(wrapped)}",
                                  expected=sorted(want), got=sorted(wrapped),
                                  hint="Each block is its own unit (its own all-gather), and "
                                       "the root is one more.",
                                  recipe="One fully_shard call per block of model.blocks, then "
                                         "one on the model itself.")


def _compare_losses(got: Any, expected: dict[str, Any]) -> None:
    for label in MESHES:
        for rank, run in enumerate(got):
            have, want = run[label]["losses"], expected["losses"][rank]
            if len(have) != len(want) or not all(
                    math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5) for a, b in zip(have, want)):
                raise CheckFailed(f"rank {rank}, {label}: the losses of {FSDP2_STEPS} AdamW steps "
                                  "differ from data parallelism's (one process, mean gradient)",
                                  expected=[round(v, 5) for v in want],
                                  got=[round(v, 5) for v in have])


def _compare_fsdp2_bytes(got: Any, expected: dict[str, Any]) -> None:
    for label, (shape, _) in MESHES.items():
        shard = shape[-1]
        # The meter sees every allocation that outlives the sharding: 1 KiB of slack leaves room
        # for what an implementation's own bookkeeping allocates (a mesh's rank tensor: 16 bytes).
        bound = sum(math.ceil(rows / shard) * rest * 4 for rows, rest in expected["sizes"].values())
        bound += 1024
        total = sum(rows * rest * 4 for rows, rest in expected["sizes"].values())
        for rank, run in enumerate(got):
            nbytes = run[label]["params bytes"]
            if nbytes > bound:
                raise CheckFailed(f"rank {rank}, {label}: once built and sharded, the model holds "
                                  f"{nbytes} bytes on this rank (the meter); sharded over {shard} "
                                  f"ranks, at most {bound} (1/{shard} of {total}, rows padded)",
                                  expected=f"at most {bound}", got=nbytes)


def _compare_mixed(got: Any, expected: dict[str, Any]) -> None:
    for rank, run in enumerate(got):
        mixed = run["bf16"]
        dtypes = mixed["forward weight dtype"]
        if not dtypes or set(dtypes) != {"torch.bfloat16"}:
            raise CheckFailed(f"rank {rank}: with param_dtype=torch.bfloat16, blocks.0.qkv runs "
                              f"with weights of {mixed['forward weight dtype']}",
                              expected=["torch.bfloat16"], got=mixed["forward weight dtype"],
                              hint="FSDP2 casts parameters for compute through a mixed-precision "
                                   "policy that every unit must be given; shards and gradients "
                                   "stay fp32.",
                              recipe="Build a MixedPrecisionPolicy from param_dtype and "
                                     "reduce_dtype and pass it as mp_policy to every fully_shard "
                                     "call, the root's too.")
        if mixed["grad dtype"] != "torch.float32":
            raise CheckFailed(f"rank {rank}: the sharded gradient is {mixed['grad dtype']}; "
                              "FSDP2 keeps fp32 shards and gradients", expected="torch.float32",
                              got=mixed["grad dtype"])


FSDP2 = task(
    "5.4", preload=PRELOAD,
    # Lesson 06's kit.lessons.resume.shard_model wraps a TinyTransformer the same way: not an
    # answer here.
    forbidden=("kit.lessons.resume.shard_model",),
    hint="FSDP2 shards unit by unit: each block is its own unit of all-gather, the root takes "
         "the parameters no block holds, and mixed precision is a policy every unit is given.",
    recipe="Call fully_shard on every block of model.blocks with the mesh, then once on the "
           "model itself. When param_dtype or reduce_dtype is given, build one "
           "MixedPrecisionPolicy from them and pass it as mp_policy to every call. Return the "
           "model.",
)


# One launch of 4 ranks: both meshes' placements, losses and bytes, the bf16 run and the memory
# run all come from it.
FSDP2_RUN = FSDP2.shared(_fsdp2_on_rank, world_size=FSDP2_RANKS)

FSDP2.case("every parameter a DTensor sharded on dim 0: (Shard(0),) on a 1-D mesh, "
           "(Replicate(), Shard(0)) on a 2-D mesh; each block and the root wrapped",
           uses=FSDP2_RUN, compare=_compare_placements, weight=2, expect="fsdp2_expected")
FSDP2.case(f"{FSDP2_STEPS} AdamW steps on {FSDP2_RANKS} ranks, FSDP and HSDP, give the losses "
           "of data parallelism", uses=FSDP2_RUN, compare=_compare_losses, expect="fsdp2_expected")
FSDP2.case("parameter bytes per rank: 1/shard-size of the model", uses=FSDP2_RUN,
           compare=_compare_fsdp2_bytes, expect="fsdp2_expected", weight=2, saving=True)
FSDP2.case("param_dtype=bfloat16: blocks compute in bf16, shards and gradients stay fp32",
           uses=FSDP2_RUN, compare=_compare_mixed, expect="fsdp2_expected")
# What resharding after forward saves, seen by the meter on the memory model (4 ranks).
FSDP2.bound(
    "bytes alive after the forward",
    formula="the activations + the root's parameters + one block",
    lost="every block stays gathered between its forward and its backward "
         "(reshard_after_forward=False): FSDP keeps only the block computing whole",
    hint="FSDP2 frees a block's gathered parameters after its forward only when the block "
         "reshards after forward; kept, every block's full parameters stay until backward, as "
         "in ZeRO-2.",
    recipe="Shard each block with fully_shard's default resharding (do not pass "
           "reshard_after_forward=False), then the root.",
    expect="fsdp2_after_forward_bound", uses=FSDP2_RUN, pick=_least("memory", "after forward"),
    weight=2)


# --------------------------------------------------------------------------- task 5.5

# The clipping model, in float64 (the checks hold it to torch within 1e-12): units whose first
# dimensions (5, 7, 2) no world size here divides, so shards are uneven and on 4 ranks some are
# empty; a frozen unit and an unused one, whose parameters have no gradient.
CLIP_PER_RANK, CLIP_IN, CLIP_OUT = 4, 3, 2
CLIP_TINY, CLIP_HUGE = 1e-3, 1e6  # a max_norm every norm here exceeds; one none reaches
# (label, norm_type passed or None for the default, max_norm): the calls of one run, in order.
CLIP_CALLS = (("2", None, CLIP_TINY), ("inf", math.inf, CLIP_TINY), ("1", 1, CLIP_TINY),
              ("2, max_norm above the norm", 2.0, CLIP_HUGE))
STEP_RANKS, STEP_MICRO, STEP_MICRO_SIZE, STEP_LR = 2, 3, 2, 0.5
STEP_NORMS = (CLIP_HUGE, 0.05)  # the two steps: clipping idle, then clipping every gradient


class ClipModel(nn.Module):
    """out(tanh(frozen(tanh(b(tanh(a(x))))))); ``unused`` never runs, ``frozen`` never learns."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(CLIP_IN, 5)
        self.b = nn.Linear(5, 7)
        self.frozen = nn.Linear(7, 7).requires_grad_(False)
        self.unused = nn.Linear(2, 3)
        self.out = nn.Linear(7, CLIP_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.frozen(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def _clip_model(seed: int) -> ClipModel:
    torch.manual_seed(seed)
    return ClipModel().double()


def _clip_shard(model: ClipModel) -> ClipModel:
    """FSDP2 on every child and the root (which keeps ``out``), on all ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for child in (model.a, model.b, model.frozen, model.unused):
        fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _clip_batch(seed: int, world_size: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: ``rows`` per rank, rank r's are rows r * rows ... (r + 1) * rows - 1."""
    g = torch.Generator().manual_seed(seed * 7919 + world_size)
    x = torch.randn(world_size * rows, CLIP_IN, generator=g, dtype=torch.float64)
    return x, 3 * torch.randn(world_size * rows, CLIP_OUT, generator=g, dtype=torch.float64)


def _clip_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)  # a mean: equal slices average to the global batch's loss


def _full_grads(model: nn.Module) -> dict[str, Any]:
    """Every parameter's whole gradient (gathered by the grader, outside any trace), or None."""
    return {n: None if p.grad is None else
            (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in model.named_parameters()}


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _returned(value: Any) -> Any:
    """What the student's function returned, as plain data (a DTensor is not the 0-d tensor
    asked for)."""
    if isinstance(value, torch.Tensor) and type(value) is not torch.Tensor:
        return f"<a {type(value).__name__}, not a plain tensor>"
    return value.detach().clone() if isinstance(value, torch.Tensor) else repr(value)[:80]


def _collectives(events: Any) -> list[tuple[str, int]]:
    return [(e.op, e.nbytes) for e in events if e.kind == "collective"]


def _clip_on_rank(impl: Any, seed: int) -> dict[str, Any]:
    """Each call of CLIP_CALLS on fresh gradients: the returned norm, the clipped gradients and
    the collectives the recorder saw during the call."""
    import torch.distributed as dist

    from kit.trace import trace

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _clip_shard(_clip_model(seed))
    x, y = _clip_batch(seed, world_size, CLIP_PER_RANK)
    mine = slice(rank * CLIP_PER_RANK, (rank + 1) * CLIP_PER_RANK)
    x, y = x[mine], y[mine]
    out: dict[str, Any] = {}
    for label, norm_type, max_norm in CLIP_CALLS:
        model.zero_grad(set_to_none=True)
        _clip_loss(model(x), y).backward()
        with trace() as t:
            norm = impl(model, max_norm) if norm_type is None else impl(model, max_norm, norm_type)
        out[label] = {"norm": _returned(norm), "collectives": _collectives(t.events)}
        out[label]["grads"] = _full_grads(model)
    return out


def _step_on_rank(impl: Any, seed: int) -> dict[str, Any]:
    """Two calls of the companion ``train_step`` (STEP_MICRO micro-batches each, STEP_NORMS):
    parameters after each, the returned losses, the gradients left, and what the recorder saw
    between the calls of the grader's ``loss_fn``."""
    import torch.distributed as dist

    from kit.trace import trace

    rank, world_size = dist.get_rank(), dist.get_world_size()
    train_step = CLIP.companion(impl, "train_step")
    if train_step is None:
        raise NameError("train_step is not defined: Task 5.5's companion runs the clipped, "
                        "accumulated step")
    model = _clip_shard(_clip_model(seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=STEP_LR, momentum=0.9)
    out: dict[str, Any] = {"steps": []}
    rows = STEP_MICRO * STEP_MICRO_SIZE
    for step, max_norm in enumerate(STEP_NORMS):
        x, y = _clip_batch(seed + 101 * (step + 1), world_size, rows)
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        micro = list(zip(x.split(STEP_MICRO_SIZE), y.split(STEP_MICRO_SIZE)))
        marks: list[tuple[int, int]] = []  # (events so far, batch rows) at each loss_fn call
        # "loss i" at each loss_fn call, "backward i" when its backward starts
        order: list[str] = []

        with trace() as t:
            def loss_fn(out_: torch.Tensor, target: torch.Tensor, t: Any = t, marks: list = marks,
                        order: list = order) -> torch.Tensor:
                i = len(marks)
                marks.append((len(t.events), int(out_.shape[0])))
                order.append(f"loss {i}")
                value = _clip_loss(out_, target)
                if value.requires_grad:
                    value.register_hook(lambda g: order.append(f"backward {i}"))
                return value

            loss = train_step(model, optimizer, micro, loss_fn, max_norm)
        out["steps"].append({
            "loss": _returned(loss), "marks": marks, "order": order,
            "events": [(e.op, e.nbytes) for e in t.events],
            "params": _full_params(model),
            "grads left": sorted(n for n, p in model.named_parameters()
                                 if p.grad is not None and bool(p.grad.to_local().abs().sum() > 0)),
        })
    return out


# The cause of clipping that differs from torch's (the norm, or the gradients it scaled): the
# uneven-shard and below-max_norm cases, a call with no collective at all and train_step's
# clipped step fail for it too, so they follow the first case that names it.
CLIPPING_WRONG = "clip_grad_norm_ differs from torch's"
CLIP_TRAFFIC = "clip_grad_norm_ sends more than one number"


def _diagnose_norm(have: dict[str, Any], want: torch.Tensor) -> tuple[str, str, str]:
    """(what the returned norm shows, hint, recipe), read from its value and the collectives
    the call made: no collective is this rank's own norm; too small leaves gradient out; too
    large counts some twice."""
    norm = have["norm"]
    if not isinstance(norm, torch.Tensor) or norm.numel() != 1:
        return "", "", ""
    if not have["collectives"]:
        return ("; the call made no collective, so this is the norm of this rank's own shards "
                "only", "The norm of sharded gradients is global: every rank's shards take part, "
                "so the ranks must combine their local numbers before the root is taken.",
                "Reduce the local shards to one number on each rank (a sum of p-th powers, or a "
                "maximum), all-reduce that number, then take the root.")
    if norm.item() < want.item():
        return ("; it is smaller than the global norm, so gradient held on some rank is left "
                "out", "Every rank's shards take part in the global norm, each counted once: "
                "the ranks combine their local sums of p-th powers (or maxima), and only then is "
                "the root taken.",
                "All-reduce the local sum of p-th powers (a maximum for inf), not the local norm; "
                "take the p-th root after the all-reduce.")
    return ("; it is larger than the global norm, so some gradient is counted more than once",
            "Every element of every gradient counts once: a shard is this rank's piece only, "
            "and the ranks' local numbers are combined once.",
            "Sum the p-th powers of this rank's local shards (to_local()), all-reduce that one "
            "number once, then take the p-th root.")


def _compare_clip(labels: tuple[str, ...]) -> Any:
    def compare(got: Any, expected: dict[str, Any]) -> None:
        for label in labels:
            want = expected[label]
            for rank, run in enumerate(got):
                have = run[label]
                problem = tensor_mismatch(have["norm"], want["norm"], rtol=1e-12, atol=1e-12)
                if problem is not None:
                    what, hint, recipe = _diagnose_norm(have, want["norm"])
                    raise CheckFailed(
                        f"{len(got)} ranks, rank {rank}, norm type {label}: the returned norm "
                        f"{problem}; torch.nn.utils.clip_grad_norm_ on the unsharded model gives "
                        f"{want['norm'].item():.12g}{what}", expected=short(want["norm"], 12),
                        got=short(have["norm"], 12) if isinstance(have["norm"], torch.Tensor)
                        else have["norm"], hint=hint, recipe=recipe, cause=CLIPPING_WRONG)
                for name, grad in want["grads"].items():
                    mine = have["grads"].get(name)
                    if grad is None or mine is None:
                        if (grad is None) != (mine is None):
                            raise CheckFailed(
                                f"{len(got)} ranks, rank {rank}, norm type {label}: {name}.grad is "
                                f"{'None' if mine is None else 'a tensor'} after clipping, "
                                f"expected {'None' if grad is None else 'a tensor'}",
                                hint="A parameter without a gradient (frozen, or unused in this "
                                     "forward) takes no part in the norm and keeps no gradient.",
                                recipe="Skip every parameter whose grad is None.")
                        continue
                    problem = tensor_mismatch(mine, grad, rtol=1e-12, atol=1e-12)
                    if problem is not None:
                        idle = (want["norm"].item() < CLIP_CALLS[-1][2]
                                and label == CLIP_CALLS[-1][0])
                        raise CheckFailed(  # idle: the case's own hint (the factor capped at 1)
                            f"{len(got)} ranks, rank {rank}, norm type {label}: {name}.grad after "
                            f"clipping {problem}, compared with torch's clipping of the unsharded "
                            "model; the returned norm is right, so the scaling differs" +
                            (" (the norm is below max_norm: the gradients must stay as they are)"
                             if idle else ""),
                            expected=short(grad), got=short(mine), cause=CLIPPING_WRONG,
                            hint="" if idle else
                            "Every rank scales its shards by one factor, computed from the "
                            "global norm after the all-reduce, never from its own shards.",
                            recipe="" if idle else
                            "Scale every local shard in place by max_norm over the global norm "
                            "plus 1e-6, capped at 1.")
    return compare


def _compare_clip_calls(got: Any, expected: Any) -> None:
    for runs in got:  # the 2-rank run, then the 4-rank run
        for rank, run in enumerate(runs):
            for label, _, _ in CLIP_CALLS:
                ops = run[label]["collectives"]
                if [op for op, _ in ops] != ["all_reduce"] or ops[0][1] != 8:
                    raise CheckFailed(
                        f"{len(runs)} ranks, rank {rank}, norm type {label}: the recorder saw "
                        f"{_ops_text(ops)} during the call; the global norm needs one all-reduce "
                        "of one element (8 bytes in float64)", expected=[("all_reduce", 8)],
                        got=ops[:6],  # no collective at all: the local norm the values showed
                        cause=CLIPPING_WRONG if not ops else CLIP_TRAFFIC,
                        hint="Each rank can reduce its own shards to one number (a sum of powers, "
                             "or a maximum); only that number has to travel, once, whatever the "
                             "number of parameters.",
                        recipe="Accumulate one local scalar over every local shard, all-reduce it "
                               "once (a sum for norm types 1 and 2, a maximum for inf), then take "
                               "the root for finite norm types.")


def _ops_text(ops: list[tuple[str, int]]) -> str:
    if not ops:
        return "no collective"
    return ", ".join(f"{op} of {nbytes} bytes" for op, nbytes in ops[:6]) + (
        f" and {len(ops) - 6} more" if len(ops) > 6 else "")


def _clip_bytes(runs: Any) -> dict[str, Any]:
    """The bound's pick: bytes each rank sent through collectives per clip_grad_norm_ call (its
    worst call), across the 2- and 4-rank runs."""
    worst: dict[int, int] = {}
    for run in runs:
        for rank, calls in enumerate(run):
            sent = max(sum(b for _, b in calls[label]["collectives"]) for label, _, _ in CLIP_CALLS)
            worst[rank] = max(worst.get(rank, 0), sent)
    return {"measured": worst}


def _compare_step_values(got: Any, expected: dict[str, Any]) -> None:
    for step, want in enumerate(expected["steps"]):
        clipping = ("clipping idle" if STEP_NORMS[step] >= CLIP_HUGE
                    else f"max_norm {STEP_NORMS[step]}")
        for rank, run in enumerate(got):
            have = run["steps"][step]
            problem = tensor_mismatch(have["loss"], want["loss"][rank], rtol=1e-12, atol=1e-12)
            if problem is not None:
                raise CheckFailed(
                    f"rank {rank}, step {step + 1}: the returned loss {problem}; expected the "
                    f"mean of this rank's {STEP_MICRO} micro-batch losses",
                    expected=short(want["loss"][rank], 10), got=short(have["loss"], 10)
                    if isinstance(have["loss"], torch.Tensor) else have["loss"],
                    hint="train_step returns the loss of its batch: the mean over its "
                         "micro-batches (each loss_fn value is already a mean).",
                    recipe="Keep each micro-batch's loss, detached, and return their mean.")
            for name, param in want["params"].items():
                problem = tensor_mismatch(have["params"].get(name), param, rtol=1e-10, atol=1e-12)
                if problem is not None:
                    what, hint, recipe, cause = _diagnose_step(run["steps"], step)
                    raise CheckFailed(
                        f"rank {rank}, step {step + 1} ({clipping}): {name} after train_step "
                        f"{problem}, compared with one unsharded step on the concatenated batch of "
                        f"every rank's micro-batches{what}", expected=short(param), got=short(
                            have["params"].get(name)), hint=hint, recipe=recipe, cause=cause)


NO_SCATTER = "gradients never reduce-scattered"
GRADS_LEFT = "gradients left for the next step"


def _diagnose_step(steps: list[dict[str, Any]], step: int) -> tuple[str, str, str, str]:
    """(what the step's record shows, hint, recipe, cause) for parameters that differ after
    train_step ``step``, every earlier step having matched; all empty when nothing recorded
    points at one mistake (the case's own hint then stands)."""
    if not any("reduce_scatter" in op for op, _ in steps[step]["events"]):
        return ("; the recorder saw no reduce-scatter, so each rank stepped with the gradient of "
                "its own micro-batches only",
                "FSDP2 averages the gradients over ranks in the backward that runs with gradient "
                "sync on: turned off for the first micro-batches, it must be on for the last.",
                "Turn gradient sync off (set_requires_gradient_sync) before every micro-batch "
                "but the last, and on again before the last.", NO_SCATTER)
    if step and steps[step - 1]["grads left"]:
        return (f"; the gradients of step {step} were still there when this step began, and its "
                "backward added to them",
                "A step ends with the gradients cleared, so that the next accumulation starts "
                "from zero.", "Zero the optimizer's gradients after its step.", GRADS_LEFT)
    if step and STEP_NORMS[step] < CLIP_HUGE:  # step 1, clipping idle, matched
        return ("; step 1, with clipping idle, matched, so the accumulation is right and the "
                "clipped step differs",
                "train_step clips the accumulated, reduced gradients once, after the last "
                "micro-batch's backward and before the optimizer step, with your clip_grad_norm_ "
                "(the cases above hold it to torch's).",
                "After the last backward, call clip_grad_norm_(model, max_norm), then step the "
                "optimizer and zero the gradients.", CLIPPING_WRONG)
    return "", "", "", ""


def _compare_step_pattern(got: Any, expected: Any) -> None:
    for step in range(len(STEP_NORMS)):
        for rank, run in enumerate(got):
            have = run["steps"][step]
            marks, events = have["marks"], have["events"]
            sizes = [rows for _, rows in marks]
            if sizes != [STEP_MICRO_SIZE] * STEP_MICRO:
                raise CheckFailed(
                    f"rank {rank}, step {step + 1}: loss_fn saw batches of {sizes} rows; "
                    f"gradient accumulation runs one forward and backward per micro-batch "
                    f"({STEP_MICRO} of {STEP_MICRO_SIZE} rows)",
                    expected=[STEP_MICRO_SIZE] * STEP_MICRO, got=sizes,
                    hint="Accumulation exists so that only one micro-batch's activations are alive "
                         "at a time: each micro-batch has its own forward, loss and backward.",
                    recipe="Loop over the micro-batches: forward, loss_fn, backward of the loss "
                           "divided by their number.")
            interleaved = [f"{what} {i}" for i in range(STEP_MICRO)
                           for what in ("loss", "backward")]
            if have["order"] != interleaved:
                raise CheckFailed(
                    f"rank {rank}, step {step + 1}: losses and backwards ran in the order "
                    f"{have['order']}; accumulation runs each micro-batch's backward before the "
                    "next micro-batch's forward", expected=interleaved, got=have["order"],
                    hint="Accumulation exists so that only one micro-batch's activations are alive "
                         "at a time: each micro-batch's backward frees them before the next "
                         "forward.",
                    recipe="Inside the loop over micro-batches, call backward on each loss "
                           "(divided by their number) right after computing it.")
            last = marks[-1][0]  # events issued before the last loss_fn call
            scatters = [i for i, (op, _) in enumerate(events) if "reduce_scatter" in op]
            early = sum(1 for i in scatters if i < last)
            late = len(scatters) - early
            if early or not late:
                raise CheckFailed(  # none at all: the values case above names it
                    f"rank {rank}, step {step + 1}: the recorder saw {early} reduce-scatters "
                    f"before the last micro-batch's loss and {late} after it; FSDP2 should "
                    "reduce-scatter the accumulated gradients once, in the last micro-batch's "
                    "backward", expected={"before": 0, "after": "one per unit"},
                    got={"before": early, "after": late},
                    cause=NO_SCATTER if not scatters else "",
                    hint="FSDP2 reduce-scatters in every backward unless the module is told not "
                         "to sync: the gradients of all micro-batches can be summed unsharded and "
                         "reduced once.",
                    recipe="Turn gradient sync off on the model (set_requires_gradient_sync) "
                           "before every micro-batch but the last, and on again before the last.")
            reduces = [(op, nbytes) for op, nbytes in events if op == "all_reduce"]
            if reduces != [("all_reduce", 8)] or events.index(reduces[0]) < max(scatters):
                raise CheckFailed(
                    f"rank {rank}, step {step + 1}: the recorder saw {len(reduces)} all-reduces "
                    "in train_step; clipping the reduced gradients with your clip_grad_norm_ "
                    "makes one, of one element, after the reduce-scatters",
                    expected=[("all_reduce", 8)], got=reduces[:4],
                    # none: the clip made none (its cases above) or never ran (the values
                    # case above); more, or larger: the clip's own traffic, named above
                    cause=_clip_cause(events, scatters, reduces),
                    hint="train_step clips the accumulated, reduced gradients before the "
                         "optimizer steps, with the clip_grad_norm_ you wrote above.",
                    recipe="After the last backward, call clip_grad_norm_(model, max_norm), then "
                           "step the optimizer and zero the gradients.")


def _clip_cause(events: list[tuple[str, int]], scatters: list[int],
                reduces: list[tuple[str, int]]) -> str:
    """The cause of a train_step whose clip did not make one all-reduce of one element, read
    from what followed the last reduce-scatter (the clip's own traffic): nothing, the clip made
    none or never ran (the cases above name which); anything else, the clip sent more."""
    after = [op for op, _ in events[max(scatters) + 1:]] if scatters else []
    if not reduces and not after:
        return CLIPPING_WRONG
    if len(reduces) > 1 or any(op != "all_reduce" for op in after) or (
            reduces and reduces[0] != ("all_reduce", 8)):
        return CLIP_TRAFFIC
    return ""


def _compare_step_zeroed(got: Any, expected: Any) -> None:
    for step in range(len(STEP_NORMS)):
        for rank, run in enumerate(got):
            left = run["steps"][step]["grads left"]
            if left:
                raise CheckFailed(
                    f"rank {rank}, step {step + 1}: after train_step, {', '.join(left[:4])} still "
                    "hold gradients; the next step would add to them", expected="no gradients",
                    got=left[:4], cause=GRADS_LEFT,
                    hint="A step ends with the gradients cleared, so that the next "
                         "accumulation starts from zero.",
                    recipe="Zero the optimizer's gradients after its step.")


CLIP = task(
    "5.5", preload=PRELOAD,
    # torch's clipping (every helper of its module: get_total_norm, clip_grads_with_norm_, the
    # deprecated clip_grad_norm) and gathering a sharded gradient whole.
    forbidden=("torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad",
               "torch.nn.utils.get_total_norm", "torch.nn.utils.clip_grads_with_norm_",
               "torch.distributed.tensor.DTensor.full_tensor",
               "torch.distributed.tensor.DTensor.redistribute"),
    hint="The global norm of sharded gradients is built from every rank's shards: each rank "
         "reduces its own local pieces to one number, one all-reduce combines them, and every "
         "rank then scales its own shards by the same factor.",
    recipe="Take the local tensor of every gradient that exists (to_local()); for norm type p, "
           "add up the p-th powers of the absolute values over all of them (for inf, take the "
           "largest absolute value, 0 for an empty shard); all-reduce that one number (sum, or "
           "max for inf) and take its p-th root. Multiply every local shard in place by "
           "max_norm divided by the norm plus 1e-6, capped at 1, and return the norm.",
)

CLIP_RUNS = {world_size: CLIP.shared(_clip_on_rank, world_size=world_size) for world_size in (2, 4)}


def _both(runs: dict[int, Any]) -> Any:
    """A case's run reading the 2- and 4-rank runs."""
    def run(impl: Any, seed: int) -> list[Any]:
        return [runs[w](impl, seed) for w in sorted(runs)]
    run.__name__ = "clip runs on 2 and 4 ranks"
    return run


CLIP_BOTH = _both(CLIP_RUNS)
STEP_RUN = CLIP.shared(_step_on_rank, world_size=STEP_RANKS)

CLIP.case("2 ranks, norm types 2 (the default), inf and 1: the returned norm and the clipped "
          "gradients equal torch.nn.utils.clip_grad_norm_ on the unsharded model (float64, 1e-12)",
          uses=CLIP_RUNS[2], compare=_compare_clip(("2", "inf", "1")), expect="clip_expected_2")
CLIP.case("4 ranks, uneven shards (some ranks hold empty ones), a frozen and an unused "
          "parameter: the same for norm types 2, inf and 1", uses=CLIP_RUNS[4],
          compare=_compare_clip(("2", "inf", "1")), weight=2, expect="clip_expected_4",
          hint="Every rank holds a piece of the gradients, possibly an empty one, and a "
               "parameter without a gradient takes no part: the norm must come out the same "
               "whatever the split.",
          recipe="Skip parameters whose grad is None; reduce each local shard (to_local()), empty "
                 "ones included, into one local number that is neutral when empty (0 for a sum "
                 "of powers and for a maximum of absolute values), then all-reduce it.")
CLIP.case("a norm below max_norm: the gradients stay as they are, the norm is still returned",
          uses=CLIP_RUNS[4], compare=_compare_clip(("2, max_norm above the norm",)),
          expect="clip_expected_4",
          hint="Clipping only ever shrinks gradients: the scale factor (max_norm over the norm "
               "plus 1e-6) is capped at 1.",
          recipe="Cap the scale factor at 1 before multiplying the shards.")


@CLIP.case("each call makes one all-reduce of one element, and no other collective (the "
           "recorder, 2 and 4 ranks)", compare=_compare_clip_calls, weight=2, saving=True)
def _clip_calls(impl: Any, seed: int) -> list[Any]:
    return [CLIP_RUNS[w](impl, seed) for w in sorted(CLIP_RUNS)]


CLIP.bound("bytes each rank sends per clip_grad_norm_ call", formula="one float64 element",
           lost="gradients, or one norm per parameter, travel between ranks: clipping needs only "
                "the one number that makes the global norm",
           hint="Clipping a sharded model costs almost no communication: only one number per rank "
                "has to travel, however many parameters there are.",
           recipe="Reduce all local shards to one local scalar first; all-reduce that scalar only.",
           expect="clip_bytes_bound", uses=_both(CLIP_RUNS), pick=_clip_bytes, cause=CLIP_TRAFFIC,
           weight=2)
CLIP.case(f"train_step: {len(STEP_NORMS)} steps of {STEP_MICRO} micro-batches on {STEP_RANKS} "
          "ranks (clipping idle, then active) equal one unsharded step each on the concatenated "
          "batch, and return the mean loss", uses=STEP_RUN, compare=_compare_step_values,
          weight=2, expect="step_expected",
          hint="Accumulating micro-batches must give the gradient of the whole batch: the mean "
               "over micro-batches and ranks, clipped once, then one optimizer step.",
          recipe="Divide each micro-batch's loss by the number of micro-batches before its "
                 "backward; after the last, clip with your clip_grad_norm_, step, zero the "
                 "gradients, and return the mean of the losses.")
CLIP.case("train_step: one forward and backward per micro-batch, reduce-scatters only in the "
          "last one's backward, then one all-reduce of one element (the clip)", uses=STEP_RUN,
          compare=_compare_step_pattern, weight=3, saving=True)
CLIP.case("train_step leaves no gradient behind for the next step", uses=STEP_RUN,
          compare=_compare_step_zeroed)
