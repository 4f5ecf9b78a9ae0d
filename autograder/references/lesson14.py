"""The grader's answers for Lesson 14 (trusted only).

The four tasks' references are the lesson's own solutions: torch's DeviceMesh, tensor-parallel
styles, FSDP2, pipelining and DCP composed as torchtitan composes them. The expectations that
are not a reference run are computed in one process: the loss curve of the whole encoder trained
without any parallelism, and the parameter bytes each rank of a layout may keep, from the
encoder's shapes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autograder.lesson14 import (
    BATCH,
    PARALLEL_LAYOUT,
    PARAM_SHARES,
    PIPE_LAYERS,
    PIPE_LAYOUT,
    RESUMED,
    SAVE_AT,
    TRAIN_STEPS,
)
from kit.lessons.composition import (
    PeptideEncoder,
    axis_of,
    encoder,
    masked_batches,
    one_process_losses,
)

# --------------------------------------------------------------------------- references


def build_mesh(world_size: int, dp: int, tp: int, pp: int = 1) -> Any:
    """14.1: the mesh from its array of ranks, (pp, dp, tp) with tp varying fastest."""
    from torch.distributed.device_mesh import DeviceMesh

    sizes = {"pp": pp, "dp": dp, "tp": tp}
    bad = [k for k, v in sizes.items() if type(v) is not int or v < 1]
    if bad or pp * dp * tp != world_size:
        raise ValueError(f"cannot lay {world_size} ranks out as {sizes}")
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    ranks = torch.arange(world_size).view(pp, dp, tp)
    return DeviceMesh("cuda" if backend == "nccl" else "cpu", ranks,
                      mesh_dim_names=tuple(sizes))


def _block_plan(prefix: str) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {}
    for norm, module, inner, outer in (("attn_norm", "attn", ("q", "k", "v"), "out"),
                                       ("mlp_norm", "mlp", ("fc1",), "fc2")):
        plan[prefix + norm] = SequenceParallel()
        plan[prefix + module] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),))
        plan.update({f"{prefix}{module}.{name}": ColwiseParallel() for name in inner})
        plan[f"{prefix}{module}.{outer}"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def parallelize(model: PeptideEncoder, mesh: Any) -> PeptideEncoder:
    """14.2: one plan for the whole model (every block's styles and the two ends), then FSDP2."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleOutput,
        parallelize_module,
    )

    keys = list(model.blocks)
    if keys and mesh["tp"].size() != 1:
        plan: dict[str, Any] = {}
        for key in keys:
            plan.update(_block_plan(f"blocks.{key}."))
        parallelize_module(model, mesh["tp"], plan)
        first, last = model.blocks[keys[0]], model.blocks[keys[-1]]
        parallelize_module(first, mesh["tp"], PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
            use_local_output=True))
        parallelize_module(last, mesh["tp"], PrepareModuleOutput(
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),),
            use_local_output=True))
    units = [model.blocks[k] for k in keys] + [model]
    for unit in units:
        fully_shard(unit, mesh=mesh["dp"])
    return model


def axis_traffic(model: PeptideEncoder, dp: int, tp: int, batch: int,
                 seq_len: int) -> dict[str, int]:
    """14.2's formula, module by module: each linear's tp piece (colwise: its rows; rowwise:
    its weight's columns), padded to a multiple of dp rows."""
    if min(dp, tp) < 1 or batch % dp != 0:
        raise ValueError(f"no step of {batch} windows at dp={dp}, tp={tp}")

    def padded(t: torch.Tensor, rows: int | None = None, cols: int | None = None) -> int:
        r = t.shape[0] if rows is None else rows
        rest = t[0].numel() if cols is None else cols
        return (math.ceil(r / dp) * dp) * rest * t.element_size()

    root = sum(padded(p.reshape(p.shape[0] if p.dim() else 1, -1))
               for name, p in model.named_parameters() if not name.startswith("blocks."))
    blocks = norms = 0
    width = elem = 0
    for block in model.blocks.values():
        for linear in (block.attn.q, block.attn.k, block.attn.v, block.mlp.fc1):
            rows = math.ceil(linear.weight.shape[0] / tp)
            blocks += padded(linear.weight, rows) + padded(linear.bias, rows)
        for linear in (block.attn.out, block.mlp.fc2):
            blocks += padded(linear.weight, cols=math.ceil(linear.weight.shape[1] / tp))
            blocks += padded(linear.bias)
        for norm in (block.attn_norm, block.mlp_norm):
            blocks += padded(norm.weight) + padded(norm.bias)
            norms += (norm.weight.numel() + norm.bias.numel()) * norm.weight.element_size()
        width, elem = block.attn_norm.weight.numel(), block.attn_norm.weight.element_size()
    count = len(model.blocks)
    activation = (batch // dp) * seq_len * width * elem
    return {"dp": (3 * blocks + 2 * root) if dp > 1 else 0,
            "tp": (activation * (8 * count + 2) + norms) if tp > 1 and count else 0}


def build_pipeline(model: PeptideEncoder, mesh: Any, n_microbatches: int,
                   loss_fn: Any) -> tuple[nn.Module, Any]:
    """14.3: the stage's keys from ``torch.tensor_split`` (the first stages one more)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    pp, stage = axis_of(mesh, "pp")
    if len(model.blocks) < pp or n_microbatches < pp:
        raise ValueError(f"{len(model.blocks)} blocks and {n_microbatches} micro-batches "
                         f"for {pp} stages")
    keys = list(model.blocks)
    kept = {keys[i] for i in torch.tensor_split(torch.arange(len(keys)), pp)[stage].tolist()}
    model.blocks = nn.ModuleDict({k: v for k, v in model.blocks.items() if k in kept})
    model.tok = model.tok if stage == 0 else None
    last = stage == pp - 1
    model.norm, model.head = (model.norm, model.head) if last else (None, None)
    parallelize(model, mesh)
    device = torch.device("cpu") if mesh.device_type == "cpu" else torch.device(
        mesh.device_type, torch.cuda.current_device())
    return model, Schedule1F1B(PipelineStage(model, stage, pp, device,
                                             group=mesh.get_group("pp")),
                               n_microbatches, loss_fn=loss_fn)


class _Training:
    """DCP's ``Stateful`` of the tutorial: the model, its optimizer and the step, saved and loaded
    through ``get_state_dict`` / ``set_state_dict``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        self.model, self.optimizer, self.step = model, optimizer, step

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        weights, moments = get_state_dict(self.model, self.optimizer)
        return {"weights": weights, "moments": moments, "step": torch.tensor(self.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["weights"],
                       optim_state_dict=state["moments"])
        self.step = int(state["step"])


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    path: str | Path) -> None:
    """14.4: DCP saves a ``Stateful``."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"training": _Training(model, optimizer, step)}, checkpoint_id=str(path))


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | Path) -> int:
    """14.4: DCP loads into a ``Stateful`` and calls its ``load_state_dict``."""
    import torch.distributed.checkpoint as dcp

    training = _Training(model, optimizer, -1)
    dcp.load({"training": training}, checkpoint_id=str(path))
    return training.step


# --------------------------------------------------------------------------- expectations


def one_process(seed: int) -> dict[str, Any]:
    """14.2: the whole encoder's losses over the run's batches, in one process."""
    batches = masked_batches(TRAIN_STEPS, BATCH, seed=seed)[:-1]  # the traced step reports none
    return {"losses": one_process_losses(batches, seed)}


def pipeline_one_process(seed: int) -> dict[str, Any]:
    """14.3: the 5-block encoder's two losses in one process."""
    return {"losses": one_process_losses(masked_batches(2, BATCH, seed=seed), seed,
                                         layers=PIPE_LAYERS)}


def resume_curve(seed: int) -> dict[str, Any]:
    """14.4: the uninterrupted curve the save and the resume together must follow."""
    return {"losses": one_process_losses(masked_batches(SAVE_AT + RESUMED, BATCH, seed=seed),
                                         seed)}


def _nbytes(params: Any) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _split(model: nn.Module) -> tuple[int, int]:
    """(bytes of the blocks, bytes of the rest) of an encoder."""
    blocks = _nbytes(model.blocks.parameters())
    return blocks, _nbytes(model.parameters()) - blocks


def parameter_bound(seed: int) -> dict[str, Any]:
    """14.2: each rank keeps a 1/(dp tp) piece of the blocks and a 1/dp piece of the rest."""
    dp, tp, pp = PARALLEL_LAYOUT
    blocks, root = _split(encoder(seed))
    return {"bound": PARAM_SHARES * (blocks / (dp * tp) + root / dp)}


def pipeline_bound(seed: int) -> dict[str, Any]:
    """14.3: a stage's blocks over tp, its own root parts, per rank in (pp, dp, tp) order."""
    dp, tp, pp = PIPE_LAYOUT
    model = encoder(seed, layers=PIPE_LAYERS)
    keys = list(model.blocks.keys())
    share, extra = divmod(len(keys), pp)
    bounds = []
    for stage in range(pp):
        start = stage * share + min(stage, extra)
        mine = keys[start:start + share + (stage < extra)]
        blocks = sum(_nbytes(model.blocks[k].parameters()) for k in mine)
        root = (_nbytes(model.tok.parameters()) if stage == 0 else 0) + (
            _nbytes([*model.norm.parameters(), *model.head.parameters()])
            if stage == pp - 1 else 0)
        bounds += [PARAM_SHARES * (blocks / (dp * tp) + root / dp)] * (dp * tp)
    return {"bound": bounds}
