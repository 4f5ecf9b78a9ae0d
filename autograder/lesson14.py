"""Checks for Lesson 14, the capstone: tasks 14.1 to 14.4 on one ``DeviceMesh``.

Task 14.1 ``build_mesh`` runs on 4 gloo ranks (three layouts and two refusals) and on one rank;
each rank reports the global ranks of its process group on every axis, read from the groups
themselves (``dist.get_process_group_ranks``). Task 14.2 ``parallelize`` trains the lesson's
encoder at ``(dp=2, tp=2)`` on 4 ranks: the model is built and parallelized under
:func:`kit.meter.track` (the parameter bytes each rank keeps), the third step runs under
:mod:`kit.trace` (the bytes each mesh axis carries), and the losses are compared with one
process; its companion ``axis_traffic`` is compared with the reference formula on layouts,
sizes that do not divide and bf16. Task 14.3 ``build_pipeline`` trains a 5-block encoder on
``(pp=2, tp=2)`` with 4 micro-batches: losses, parameter bytes per stage, the blocks each stage
kept, and the order of stage 0's point-to-point messages (1F1B, not GPipe). Task 14.4 saves at
``(dp=2, tp=2)`` and resumes at ``(dp=4, tp=1)``: the resumed losses continue the one-process
curve, and the save's peak memory shows nothing was gathered.
"""

from __future__ import annotations

import tempfile
from functools import partial
from typing import Any

import torch

from autograder.compare import CheckFailed, describe, per_rank
from autograder.registry import task
from kit.lessons import composition as comp

PRELOAD = ("torch.distributed.tensor", "torch.distributed.tensor.parallel",
           "torch.distributed.fsdp", "torch.distributed.pipelining",
           "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
           "torch.distributed.checkpoint._fsspec_filesystem", "kit.meter",
           "kit.lessons.composition")
RANK_TIMEOUT_S = 60.0
LOSS_TOL = 1e-4  # fp32: every layout measured here is within 1e-6 of one process
BATCH = 4  # windows per step over all dp ranks
AXES = ("pp", "dp", "tp")


def _error(call: Any, *args: Any) -> str | None:
    """None if ``call(*args)`` raised nothing; else ``"ValueError: ..."`` (its type and
    message)."""
    try:
        call(*args)
    except Exception as e:  # noqa: BLE001 - the type is the answer
        return f"{type(e).__name__}: {e}"
    return None


# --------------------------------------------------------------------------- task 14.1

MESH_LAYOUTS = {  # name -> (dp, tp, pp) on 4 ranks
    "(dp=2, tp=2)": (2, 2, 1),
    "(pp=2, tp=2)": (1, 2, 2),
    "(pp=2, dp=2)": (2, 1, 2),
}
MESH_REFUSALS = {  # name -> (world_size, dp, tp, pp): each must be a ValueError
    "3 x 1 x 1 on 4 ranks": (4, 3, 1, 1),
    "an axis of 0": (4, 0, 4, 1),
}


def _mesh_facts(mesh: Any) -> dict[str, Any]:
    import torch.distributed as dist

    names = tuple(mesh.mesh_dim_names or ())
    groups = {}
    for axis in names:
        groups[axis] = sorted(dist.get_process_group_ranks(mesh[axis].get_group()))
    return {"names": list(names), "shape": list(mesh.shape), "device": mesh.device_type,
            "groups": groups}


def _meshes_on_rank(build_mesh: Any, seed: int) -> dict[str, Any]:
    import torch.distributed as dist

    world = dist.get_world_size()
    out: dict[str, Any] = {}
    if world == 1:
        out["world size 1"] = _mesh_facts(build_mesh(1, 1, 1, 1))
        return out
    for name, (dp, tp, pp) in MESH_LAYOUTS.items():
        out[name] = _mesh_facts(build_mesh(world, dp, tp, pp))
    for name, (w, dp, tp, pp) in MESH_REFUSALS.items():
        out[name] = _error(build_mesh, w, dp, tp, pp)
    return out


def _compare_mesh(name: str, got: Any, expected: Any) -> None:
    ranks, want = per_rank(got, len(expected)), expected
    for rank, (g, e) in enumerate(zip(ranks, want)):
        g, e = g[name], e[name]
        if g["names"] != e["names"] or g["shape"] != e["shape"]:
            raise CheckFailed(f"{name}: the mesh has axes {g['names']} of sizes {g['shape']}; "
                              f"expected {e['names']} of sizes {e['shape']}",
                              expected=e["names"], got=g["names"], cause="mesh axes")
        if g["device"] != e["device"]:
            raise CheckFailed(f"{name}: the mesh is on {g['device']!r}; the group runs "
                              f"{'NCCL' if e['device'] == 'cuda' else 'gloo'}, so it belongs on "
                              f"{e['device']!r}", expected=e["device"], got=g["device"])
        for axis in e["names"]:
            if g["groups"][axis] != e["groups"][axis]:
                hint = ("tp groups must be consecutive ranks, one node: the last axis varies "
                        "fastest, so tp goes last" if axis == "tp" else
                        "pp is the outermost axis, dp the middle one")
                raise CheckFailed(f"{name}: rank {rank}'s {axis} group is ranks "
                                  f"{g['groups'][axis]}; expected {e['groups'][axis]}",
                                  expected=e["groups"][axis], got=g["groups"][axis], hint=hint)


def _compare_refusal(name: str, got: Any, expected: Any) -> None:
    for rank, g in enumerate(per_rank(got, len(expected))):
        if g[name] is None or not str(g[name]).startswith("ValueError"):
            raise CheckFailed(f"{name}: build_mesh on rank {rank} "
                              f"{'returned a mesh' if g[name] is None else 'raised ' + g[name]}; "
                              "expected a ValueError naming the sizes",
                              expected="ValueError", got=describe(g[name]))


# bounds nothing: a mesh holds no state; the point is which ranks share a group.
# forbids nothing: init_device_mesh builds the mesh; the task is the order of its axes.
MESH = task(
    "14.1", reference="build_mesh", preload=PRELOAD,
    hint="A mesh is an array of ranks; its last axis varies fastest. In (pp, dp, tp) order a tp "
         "group is tp consecutive ranks (one node, the fast links), a pp group the farthest "
         "apart. Sizes that do not multiply to the world size cannot be laid out.",
    recipe="Check every size is an int of at least 1 and that dp * tp * pp equals the world size "
           "(else raise ValueError); pick cuda under NCCL and cpu otherwise; build the mesh with "
           "shape (pp, dp, tp) and the names ('pp', 'dp', 'tp'), keeping axes of size 1.",
)
MESH_RUN = MESH.shared(_meshes_on_rank, world_size=4, timeout=RANK_TIMEOUT_S)
MESH_ONE = MESH.shared(_meshes_on_rank, world_size=1, timeout=RANK_TIMEOUT_S)
for _name in MESH_LAYOUTS:
    MESH.case(f"{_name} on 4 ranks: axes, shape and every rank's group per axis", uses=MESH_RUN,
              compare=partial(_compare_mesh, _name))
for _name in MESH_REFUSALS:
    MESH.case(f"{_name}: a ValueError", uses=MESH_RUN, compare=partial(_compare_refusal, _name))
MESH.case("world size 1: a (1, 1, 1) mesh with all three axes", uses=MESH_ONE,
          compare=partial(_compare_mesh, "world size 1"))


# --------------------------------------------------------------------------- task 14.2

TRAIN_STEPS = 3  # the last one traced, its loss not reported
PARALLEL_LAYOUT = (2, 2, 1)  # (dp, tp, pp) on 4 ranks
# (layers, dim, heads, dp, tp, batch, seq_len, dtype) that axis_traffic is asked about
TRAFFIC_CONFIGS: dict[str, tuple[int, int, int, int, int, int, int, str]] = {
    "dp=2 tp=2": (4, 64, 4, 2, 2, 4, 32, "float32"),
    "dp=4 tp=1": (4, 64, 4, 4, 1, 4, 32, "float32"),
    "dp=1 tp=4": (4, 64, 4, 1, 4, 4, 32, "float32"),
    "one rank": (4, 64, 4, 1, 1, 4, 32, "float32"),
    "dp=3: 33-token vocab and widths that do not divide": (2, 48, 4, 3, 1, 6, 16, "float32"),
    "dp=2 tp=2 in bf16": (3, 32, 2, 2, 2, 8, 16, "bfloat16"),
}
TRAFFIC_REFUSALS = {"a batch that does not split over dp": (4, 64, 4, 3, 1, 4, 32, "float32")}
# What a rank of (dp=2, tp=2) may keep after parallelize, in its shares: the norms and rowwise
# biases are replicated over tp, and sharding a tensor over tp scatters it from the axis's first
# rank, whose gloo buffers the meter sees (measured: 1.00-1.08 shares; a layout that skips FSDP2
# or TP keeps 1.9-2.0).
PARAM_SHARES = 1.5


def _traffic_model(layers: int, dim: int, heads: int, dtype: str) -> torch.nn.Module:
    return comp.encoder(0, layers=layers, dim=dim, heads=heads).to(getattr(torch, dtype))


def axis_bytes(events: list[Any], mesh: Any) -> dict[str, int]:
    """Bytes the recorder saw on each mesh axis of size > 1 ("other": any other group)."""
    import torch.distributed as dist

    groups = {axis: tuple(sorted(dist.get_process_group_ranks(mesh[axis].get_group())))
              for axis in mesh.mesh_dim_names if mesh[axis].size() > 1}
    out = dict.fromkeys(groups, 0) | {"other": 0}
    for e in events:
        if e.kind == "region":
            continue
        axis = next((a for a, r in groups.items() if tuple(sorted(e.group_ranks)) == r),
                    "other")
        out[axis] += int(e.nbytes)
    return out


def _parallel_on_rank(parallelize: Any, seed: int) -> dict[str, Any]:
    import torch.distributed as dist

    from kit import meter
    from kit.trace import trace

    axis_traffic = PARALLEL.companion(parallelize, "axis_traffic")
    dp, tp, pp = PARALLEL_LAYOUT
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=AXES)
    batches = comp.masked_batches(TRAIN_STEPS, BATCH, seed=seed)
    with meter.track() as usage:
        model = parallelize(comp.encoder(seed), mesh)
        usage.mark("parameters")
    if model is None:
        raise CheckFailed("parallelize returned None; return the model it parallelized")
    optimizer = comp.optimizer_for(model)
    losses = comp.train_steps(model, mesh, batches[:-1], optimizer)
    with trace() as t:  # the training's own messages: no loss report
        comp.train_steps(model, mesh, batches[-1:], optimizer, report=False)
    out: dict[str, Any] = {"losses": losses, "held": usage.marks["parameters"],
                           "traffic": axis_bytes(t.events, mesh)}
    if dist.get_rank() == 0:
        formulas: dict[str, Any] = {}
        if axis_traffic is None:
            formulas = {"missing": True}
        else:
            for name, (layers, dim, heads, d, t_, batch, seq, dtype) in TRAFFIC_CONFIGS.items():
                formulas[name] = axis_traffic(_traffic_model(layers, dim, heads, dtype), d, t_,
                                              batch, seq)
            for name, (layers, dim, heads, d, t_, batch, seq, dtype) in TRAFFIC_REFUSALS.items():
                formulas[name] = _error(axis_traffic, _traffic_model(layers, dim, heads, dtype),
                                        d, t_, batch, seq)
        out["formulas"] = {k: (dict(v) if isinstance(v, dict) else v)
                           for k, v in formulas.items()}
    return out


def _compare_losses(got: Any, expected: Any, *, what: str) -> None:
    ranks = per_rank(got, len(got) if isinstance(got, list) else 0)
    want = expected["losses"]
    for rank, g in enumerate(ranks):
        losses = g["losses"] if isinstance(g, dict) else g
        if not isinstance(losses, list) or len(losses) != len(want) or any(
                abs(a - b) > LOSS_TOL * max(1.0, abs(b)) for a, b in zip(losses, want)):
            first = next((i for i, (a, b) in enumerate(zip(losses, want))
                          if abs(a - b) > LOSS_TOL * max(1.0, abs(b))), None) \
                if isinstance(losses, list) else None
            raise CheckFailed(
                f"{what}: rank {rank}'s losses leave the one-process curve"
                + (f" at step {first + 1}" if first is not None else ""),
                expected=[round(x, 5) for x in want],
                got=[round(x, 5) for x in losses] if isinstance(losses, list) else describe(losses),
                cause="losses")


def _compare_traffic(got: Any, expected: Any) -> None:
    ranks = per_rank(got, len(expected))
    for rank, (g, e) in enumerate(zip(ranks, expected)):
        have, should = g["traffic"], e["traffic"]
        for axis in ("dp", "tp"):
            if have.get(axis, 0) != should[axis]:
                lost = {"dp": "FSDP2 on the dp axis: gathers of every unit forward, of the blocks "
                              "again backward, one reduce-scatter of each gradient",
                        "tp": "tensor and sequence parallel on the tp axis: activations gathered "
                              "and reduce-scattered by sequence around attention and the MLP"}
                raise CheckFailed(
                    f"rank {rank} sent {have.get(axis, 0):,} bytes on the {axis} axis in one "
                    f"step; the layout sends {should[axis]:,} ({lost[axis]})",
                    expected={k: should[k] for k in ("dp", "tp")},
                    got={k: have.get(k, 0) for k in ("dp", "tp", "other")},
                    hint=_traffic_hint(axis, have.get(axis, 0), should[axis]))
        if have.get("other", 0):
            raise CheckFailed(f"rank {rank} sent {have['other']:,} bytes outside the mesh's dp "
                              "and tp groups (the default group or a group of its own)",
                              expected=0, got=have["other"],
                              hint="Every collective of this layout runs on a mesh axis: pass "
                                   "mesh['tp'] to the tensor-parallel plan and mesh['dp'] to "
                                   "fully_shard.")


def _traffic_hint(axis: str, have: int, should: int) -> str:
    if have == 0:
        what = "FSDP2 sharding" if axis == "dp" else "tensor parallel plan"
        return f"Nothing moved on {axis}: the {what} was not applied on mesh['{axis}']."
    if axis == "dp":
        return ("FSDP2's bytes follow its units: each block its own fully_shard (gathered "
                "forward, freed, gathered again backward), then the root. One unit for "
                "everything, or blocks kept gathered after forward, move other amounts.")
    return ("Sequence parallel moves activations by all-gather and reduce-scatter along the "
            "sequence; plain tensor parallel all-reduces whole activations instead, and a block "
            "outside the plan sends nothing.")


def _held_bound(got: Any) -> dict[str, Any]:
    return {"measured": [g["held"] if isinstance(g, dict) else g for g in got]}


def _compare_formulas(got: Any, expected: Any) -> None:
    g, e = got[0].get("formulas"), expected[0]["formulas"]
    if g is None or g.get("missing"):
        raise CheckFailed("no axis_traffic function was found next to parallelize",
                          hint="Define axis_traffic(model, dp, tp, batch, seq_len) in the task's "
                               "cell.")
    for name in TRAFFIC_REFUSALS:
        if not str(g.get(name)).startswith("ValueError"):
            raise CheckFailed(f"axis_traffic, {name}: expected a ValueError",
                              expected="ValueError", got=describe(g.get(name)))
    for name in TRAFFIC_CONFIGS:
        have, want = g.get(name), e[name]
        if not isinstance(have, dict) or any(int(have.get(k, -1)) != want[k] for k in want):
            raise CheckFailed(f"axis_traffic, {name}: expected {want}", expected=want,
                              got=describe(have),
                              hint=_formula_hint(have, want))


def _formula_hint(have: Any, want: dict[str, int]) -> str:
    if not isinstance(have, dict):
        return "Return a dict {'dp': bytes, 'tp': bytes}."
    if have.get("dp") and want["dp"] and have["dp"] != want["dp"]:
        return ("dp: 2 x the root's pieces + 3 x the blocks' (gathered forward and backward, "
                "reduce-scattered once), each parameter's tp piece with its first dimension "
                "padded to a multiple of dp, in the parameters' own dtype; 0 when dp is 1.")
    return ("tp: per block 4 all-gathers and 4 reduce-scatters of a (batch / dp, seq_len, dim) "
            "activation, 2 more all-gathers at the model's ends, and one all-reduce of the norms' "
            "gradients; 0 when tp is 1.")


# forbids nothing: the task composes torch's own tensor-parallel styles and FSDP2.
PARALLEL = task(
    "14.2", reference="parallelize", preload=PRELOAD,
    hint="Tensor and sequence parallel inside each block on mesh['tp'] (the norms on sequence "
         "shards, the linears split by columns then rows, activations gathered before attention "
         "and the MLP and reduce-scattered after), then FSDP2 on mesh['dp']: each block its own "
         "fully_shard, then the root. TP first, so FSDP2 shards the TP pieces again over dp.",
    recipe="For each block: parallelize_module with SequenceParallel on both norms, "
           "PrepareModuleInput from Shard(1) to Replicate on attn and mlp, ColwiseParallel on q, "
           "k, v and fc1, RowwiseParallel with output Shard(1) on out and fc2. Give the first "
           "block a PrepareModuleInput from Replicate to Shard(1) and the last a "
           "PrepareModuleOutput from Shard(1) to Replicate (local outputs). Skip all of it when "
           "tp is 1. Then fully_shard every block and the model on mesh['dp'], and return it.",
)
PARALLEL_RUN = PARALLEL.shared(_parallel_on_rank, world_size=4, timeout=RANK_TIMEOUT_S)
PARALLEL.case("(dp=2, tp=2): two steps on the one-process loss curve", uses=PARALLEL_RUN,
              compare=partial(_compare_losses, what="(dp=2, tp=2)"), expect="one_process")
PARALLEL.case("(dp=2, tp=2): bytes per step on the dp and tp axes, as the recorder counts them",
              uses=PARALLEL_RUN, compare=_compare_traffic,
              weight=3, saving=True)
PARALLEL.bound("parameter bytes per rank", formula=f"{PARAM_SHARES} x (blocks / (dp x tp) + "
               "root / dp)",
               lost="a rank keeps weights the layout shards: the blocks whole on tp, or "
                    "everything whole on dp", uses=PARALLEL_RUN, pick=_held_bound, weight=2,
               expect="parameter_bound",
               hint="After parallelize each rank holds a 1/(dp*tp) piece of every block and a "
                    "1/dp piece of the embedding, norm and head; the full tensors are freed.")
PARALLEL.case("axis_traffic: layouts, a dp that does not divide the widths, bf16, refusals",
              uses=PARALLEL_RUN, compare=_compare_formulas,
              weight=2)


# --------------------------------------------------------------------------- task 14.3

PIPE_LAYERS = 5  # 3 blocks on stage 0, 2 on stage 1: sizes that do not divide
PIPE_LAYOUT = (1, 2, 2)  # (dp, tp, pp)
MICRO = 4


def _pipeline_on_rank(build_pipeline: Any, seed: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from kit import meter
    from kit.trace import trace

    dp, tp, pp = PIPE_LAYOUT
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=AXES)
    refusals = {
        "fewer blocks than stages": _error(build_pipeline, comp.encoder(seed, layers=1), mesh,
                                           MICRO, comp.masked_lm_loss),
        "fewer micro-batches than stages": _error(build_pipeline,
                                                  comp.encoder(seed, layers=PIPE_LAYERS), mesh,
                                                  1, comp.masked_lm_loss),
    }
    batches = comp.masked_batches(2, BATCH, seed=seed)
    with meter.track() as usage:
        built = build_pipeline(comp.encoder(seed, layers=PIPE_LAYERS), mesh, MICRO,
                               comp.masked_lm_loss)
        usage.mark("parameters")
    if not isinstance(built, tuple) or len(built) != 2:
        raise CheckFailed("build_pipeline must return (stage_model, schedule)",
                          got=describe(built))
    stage_model, schedule = built
    optimizer = comp.optimizer_for(stage_model)
    losses = comp.train_steps(stage_model, mesh, batches[:1], optimizer, schedule)
    with trace() as t:
        losses += comp.train_steps(stage_model, mesh, batches[1:], optimizer, schedule)
    parts = {"tok": getattr(stage_model, "tok", None) is not None,
             "norm": getattr(stage_model, "norm", None) is not None,
             "head": getattr(stage_model, "head", None) is not None}
    blocks = getattr(stage_model, "blocks", None)
    return {"losses": losses, "held": usage.marks["parameters"], "refusals": refusals,
            "blocks": sorted(blocks.keys(), key=int) if blocks is not None else None,
            "parts": parts,
            "p2p": [[e.op, int(e.nbytes), e.peer] for e in t.events if e.kind == "p2p"]}


def _stage(rank: int) -> int:
    dp, tp, _ = PIPE_LAYOUT
    return rank // (dp * tp)


def _compare_split(got: Any, expected: Any) -> None:
    for rank, (g, e) in enumerate(zip(per_rank(got, len(expected)), expected)):
        if g["blocks"] != e["blocks"] or g["parts"] != e["parts"]:
            raise CheckFailed(f"rank {rank} (stage {_stage(rank)}) kept blocks {g['blocks']} and "
                              f"{[k for k, v in g['parts'].items() if v]}; expected blocks "
                              f"{e['blocks']} and {[k for k, v in e['parts'].items() if v]}",
                              expected=e["blocks"], got=g["blocks"],
                              hint="5 blocks on 2 stages: a contiguous run each, the first stage "
                                   "one more; tok only on stage 0, norm and head only on the "
                                   "last, the rest deleted.")


def _compare_refusals(got: Any, expected: Any) -> None:
    for rank, g in enumerate(per_rank(got, len(expected))):
        for name, error in g["refusals"].items():
            if not str(error).startswith("ValueError"):
                raise CheckFailed(f"rank {rank}, {name}: expected a ValueError, got "
                                  f"{error or 'no error'}", expected="ValueError",
                                  got=describe(error))


def _compare_schedule(got: Any, expected: Any) -> None:
    """Stage 0's messages of one step: as many as 1F1B's, in 1F1B's order (at most pp forward
    sends before the first gradient arrives), of 1F1B's bytes."""
    for rank, (g, e) in enumerate(zip(per_rank(got, len(expected)), expected)):
        have, want = g["p2p"], e["p2p"]
        if [b for _, b, _ in have] == [b for _, b, _ in want] and \
                [op for op, _, _ in have] == [op for op, _, _ in want]:
            continue
        sends = [i for i, (op, _, _) in enumerate(have) if "send" in op]
        recvs = [i for i, (op, _, _) in enumerate(have) if "recv" in op]
        hint = "1F1B alternates one forward and one backward once the pipeline is full."
        early = len([i for i in sends if recvs and i < recvs[0]])
        detail = ""
        if _stage(rank) == 0 and early > PIPE_LAYOUT[2]:
            detail = (f": stage 0 sent {early} micro-batches before the first gradient came "
                      "back, all forwards then all backwards (GPipe), which holds every "
                      "micro-batch's activations at once")
            hint = "Use Schedule1F1B: stage 0 then holds at most pp micro-batches' activations."
        raise CheckFailed(f"rank {rank} (stage {_stage(rank)}) exchanged {len(have)} messages "
                          f"({sum(b for _, b, _ in have):,} bytes) on the pp axis; 1F1B with "
                          f"{MICRO} micro-batches exchanges {len(want)} "
                          f"({sum(b for _, b, _ in want):,} bytes) in its own order{detail}",
                          expected=[op for op, _, _ in want], got=[op for op, _, _ in have],
                          hint=hint)


# forbids nothing: torch.distributed.pipelining runs the stages; the task is the cut and the
# composition with parallelize.
PIPE = task(
    "14.3", reference="build_pipeline", preload=PRELOAD,
    hint="A pipeline stage is the model with the other stages' parts deleted: a contiguous run "
         "of blocks, the embedding on the first stage, the norm and head on the last. What is "
         "left is parallelized on the stage's own dp and tp groups, and a 1F1B schedule streams "
         "micro-batches through the pp group.",
    recipe="Read pp and this rank's stage from the mesh's 'pp' axis; refuse fewer blocks or "
           "micro-batches than stages; keep the stage's run of block keys (the first len % pp "
           "stages one more) and delete the others from model.blocks; set tok to None off stage "
           "0 and norm and head to None off the last; parallelize; wrap it in a PipelineStage "
           "over mesh['pp']'s group and return the stage's model with a 1F1B schedule of that "
           "stage over the given number of micro-batches, computing the loss with loss_fn.",
)
PIPE_RUN = PIPE.shared(_pipeline_on_rank, world_size=4, timeout=RANK_TIMEOUT_S)
PIPE.case("(pp=2, tp=2), 5 blocks, 4 micro-batches: two steps on the one-process curve",
          uses=PIPE_RUN, compare=partial(_compare_losses, what="(pp=2, tp=2)"),
          expect="pipeline_one_process")
PIPE.case("each stage keeps its run of blocks, tok on the first, norm and head on the last",
          uses=PIPE_RUN, compare=_compare_split)
PIPE.bound("parameter bytes per rank", formula=f"{PARAM_SHARES} x (this stage's blocks / tp + "
           "its root parts)", lost="a stage keeps blocks or the embedding/head of other stages",
           uses=PIPE_RUN, pick=_held_bound, expect="pipeline_bound", weight=2)
PIPE.case("stage 0 and 1's messages on the pp axis: 1F1B's count, bytes and order",
          uses=PIPE_RUN, compare=_compare_schedule, weight=2,
          saving=True)
PIPE.case("fewer blocks or micro-batches than stages: a ValueError", uses=PIPE_RUN,
          compare=_compare_refusals)


# --------------------------------------------------------------------------- task 14.4

SAVE_LAYOUT, LOAD_LAYOUT = (2, 2, 1), (4, 1, 1)
SAVE_AT = 1  # steps before the save (AdamW's moments exist from the first)
RESUMED = 2  # steps after the resume: the second is the first the moments change
SAVE_PEAK_SHARES = 4.5  # a save may use this many times the rank's share of model + optimizer


def _their_load(save_checkpoint: Any) -> Any:
    """The companion ``load_checkpoint`` beside ``save_checkpoint``, or a CheckFailed."""
    found = CKPT.companion(save_checkpoint, "load_checkpoint")
    if found is None:
        raise CheckFailed("no load_checkpoint function was found next to save_checkpoint",
                          hint="Define load_checkpoint(model, optimizer, path) in the task's "
                               "cell.")
    return found


def _their_parallelize(fn: Any) -> Any:
    """The student's own ``parallelize`` (task 14.2) beside ``fn``: 14.4 checkpoints the layout
    it builds."""
    found = getattr(fn, "__globals__", {}).get("parallelize")
    if not callable(found):
        raise CheckFailed("task 14.4 checkpoints the model your parallelize (task 14.2) builds, "
                          "and none was found beside save_checkpoint",
                          hint="Run the cell of task 14.2 first.")
    return found


def _ckpt_on_rank(save_checkpoint: Any, load_checkpoint: Any, seed: int,
                  path: str) -> dict[str, Any]:
    """Train SAVE_AT steps at SAVE_LAYOUT and save; then, in the same ranks, a fresh model at
    LOAD_LAYOUT loads and trains RESUMED steps: two meshes, one launch."""
    from torch.distributed.device_mesh import init_device_mesh

    from kit import meter

    batches = comp.masked_batches(SAVE_AT + RESUMED, BATCH, seed=seed)
    dp, tp, pp = SAVE_LAYOUT
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=AXES)
    model = _their_parallelize(save_checkpoint)(comp.encoder(seed), mesh)
    optimizer = comp.optimizer_for(model)
    comp.train_steps(model, mesh, batches[:SAVE_AT], optimizer)
    local = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    share = sum(t.numel() * t.element_size() * 3 for t in local)  # + AdamW's two moments
    with meter.track() as usage:
        save_checkpoint(model, optimizer, SAVE_AT, path)
    del model, optimizer
    dp, tp, pp = LOAD_LAYOUT
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=AXES)
    model = _their_parallelize(load_checkpoint)(comp.encoder(seed + 1), mesh)  # to be replaced
    optimizer = comp.optimizer_for(model)
    step = load_checkpoint(model, optimizer, path)
    losses = comp.train_steps(model, mesh, batches[SAVE_AT:], optimizer)
    return {"peak": usage.peak, "share": share, "losses": losses,
            "step": step if isinstance(step, int) else describe(step)}


def _ckpt_run(save_checkpoint: Any, seed: int) -> list[dict[str, Any]]:
    from kit.launcher import run_ranks

    load_checkpoint = _their_load(save_checkpoint)
    with tempfile.TemporaryDirectory(prefix="kit-capstone-") as root:
        return list(run_ranks(_ckpt_on_rank, (save_checkpoint, load_checkpoint, seed,
                                              f"{root}/step{SAVE_AT}"), world_size=4,
                              timeout=RANK_TIMEOUT_S, echo=False, preload=CKPT.preload))


def _ckpt_one_process(save_checkpoint: Any, seed: int) -> dict[str, Any]:
    """World size 1, no process group: a plain encoder saved after SAVE_AT steps, loaded into a
    fresh one (DCP saves in one process when torch.distributed is not initialized)."""
    import warnings

    load_checkpoint = _their_load(save_checkpoint)
    batches = comp.masked_batches(SAVE_AT + RESUMED, BATCH, seed=seed)
    model = comp.encoder(seed)
    optimizer = comp.optimizer_for(model)
    comp.train_steps(model, _NO_MESH, batches[:SAVE_AT], optimizer)
    with tempfile.TemporaryDirectory(prefix="kit-capstone-") as root, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        save_checkpoint(model, optimizer, SAVE_AT, f"{root}/one")
        model = comp.encoder(seed + 1)
        optimizer = comp.optimizer_for(model)
        step = load_checkpoint(model, optimizer, f"{root}/one")
    losses = comp.train_steps(model, _NO_MESH, batches[SAVE_AT:], optimizer)
    return [{"step": step if isinstance(step, int) else describe(step), "losses": losses}]


class _NoMesh:
    """What train_steps reads of a mesh, for one process: no axes, on the CPU."""

    mesh_dim_names = ()
    device_type = "cpu"


_NO_MESH = _NoMesh()


def _compare_resume(got: Any, expected: Any) -> None:
    want = expected["losses"]
    for rank, g in enumerate(per_rank(got, len(got) if isinstance(got, list) else 4)):
        if g["step"] != SAVE_AT:
            raise CheckFailed(f"rank {rank}: load_checkpoint returned {g['step']!r}; the run was "
                              f"saved at step {SAVE_AT}", expected=SAVE_AT, got=g["step"],
                              hint="Save the step with the state and return it from the load.")
    _compare_losses([g["losses"] for g in got], {"losses": want[SAVE_AT:]},
                    what=f"resumed at (dp={LOAD_LAYOUT[0]}, tp={LOAD_LAYOUT[1]})")


def _save_peak(got: Any) -> dict[str, Any]:
    return {"measured": [g["peak"] / max(g["share"], 1) for g in got]}


# bounds the save's peak against a gather (saving=False: a guard; DCP's own promise).
# forbids nothing: DCP is the tool the task teaches to use at another layout.
CKPT = task(
    "14.4", preload=PRELOAD,
    hint="DCP names every parameter and optimizer state by its fully qualified name and saves "
         "each rank's shards with their place in the whole tensor; a load at any layout reads "
         "the pieces its shards overlap. Both the weights and AdamW's moments must travel, and "
         "the step with them.",
    recipe="To save, take the model's and the optimizer's state dicts from DCP's get_state_dict "
           "and hand DCP's save one dict holding both and the step (as a tensor), with the path "
           "as the checkpoint id. To load, build the same dict from the new model and optimizer "
           "as the template, with a placeholder step, load into it in place, put both states "
           "back with set_state_dict and return the step.",
)
CKPT_RUN = CKPT.shared(_ckpt_run)
CKPT.case("one process, no process group: saved after a step, loaded into a fresh model",
          uses=CKPT.shared(_ckpt_one_process), compare=_compare_resume, expect="resume_curve")
CKPT.case("saved at (dp=2, tp=2), resumed at (dp=4, tp=1): the step and the rest of the "
          "one-process curve", uses=CKPT_RUN, compare=_compare_resume, expect="resume_curve",
          weight=3)
CKPT.bound("peak bytes while saving, in shares of the rank's parameters and AdamW state",
           formula=f"{SAVE_PEAK_SHARES} shares", unit="shares", saving=False,
           lost="the save gathered full tensors onto a rank (full_state_dict, a state_dict() "
                "turned to full tensors) instead of writing each rank's shards",
           uses=CKPT_RUN, pick=_save_peak, expect=lambda seed: {"bound": SAVE_PEAK_SHARES},
           hint="DCP writes the shards each rank holds; nothing needs to be gathered.")
