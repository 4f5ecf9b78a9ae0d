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
# # Lesson 06 · Distributed Checkpoint: sharded saves, resharding, async saves, exact resume

# %% tags=["setup"]
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel as DDP

from kit import LaunchError, check, launch
from kit.resume import (
    full_parameters,
    make_model,
    make_optimizer,
    make_sampler,
    seed_everything,
    shard_model,
    train_step,
)
from kit.torchrun import TorchrunError, init_process_group_per_attempt, torchrun, write_script


# %% tags=["task-6.1"]
def save_shards(ckpt_dir: str, name: str, local: torch.Tensor, offset: int, global_numel: int) -> None:
    """Save this rank's piece of a 1-D tensor to its own file, plus metadata that finds every piece.

    local holds elements offset .. offset + local.numel() of a tensor of global_numel elements.
    Called on every rank of the default process group, each with its own piece; pieces may have
    any size, including 0, and together cover 0 .. global_numel exactly once. Several tensors
    (different names) may share one ckpt_dir.
    """
    ### BEGIN SOLUTION
    rank = dist.get_rank() if dist.is_initialized() else 0
    folder = Path(ckpt_dir)
    folder.mkdir(parents=True, exist_ok=True)
    file = f"{name}.piece{rank}.pt"
    torch.save(local.detach().contiguous().clone(), folder / file)  # only this rank's bytes
    piece = {"file": file, "offset": int(offset), "numel": int(local.numel())}
    pieces = [piece]
    if dist.is_initialized():
        pieces = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, piece)
    if rank == 0:
        meta = {"global_numel": int(global_numel), "dtype": str(local.dtype).removeprefix("torch."),
                "pieces": sorted(pieces, key=lambda p: p["offset"])}
        tmp = folder / f"{name}.metadata.json.tmp"
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, folder / f"{name}.metadata.json")  # the metadata appears whole, last
    if dist.is_initialized():
        dist.barrier()  # nobody loads before the metadata exists
    ### END SOLUTION


def load_shards(ckpt_dir: str, name: str, offset: int, numel: int) -> torch.Tensor:
    """Return elements [offset, offset + numel) of the saved tensor, opening only overlapping pieces.

    Uses no collectives: any process may call it, with any range of the tensor.
    """
    ### BEGIN SOLUTION
    folder = Path(ckpt_dir)
    meta = json.loads((folder / f"{name}.metadata.json").read_text())
    if offset < 0 or numel < 0 or offset + numel > meta["global_numel"]:
        raise ValueError(f"range [{offset}, {offset + numel}) is outside the tensor's "
                         f"{meta['global_numel']} elements")
    out = torch.empty(numel, dtype=getattr(torch, meta["dtype"]))
    stop = offset + numel
    for piece in meta["pieces"]:
        lo, hi = max(offset, piece["offset"]), min(stop, piece["offset"] + piece["numel"])
        if lo >= hi:
            continue  # no overlap: never open its file
        data = torch.load(folder / piece["file"], weights_only=True)
        out[lo - offset:hi - offset] = data[lo - piece["offset"]:hi - piece["offset"]]
    return out
    ### END SOLUTION


# %% tags=["check-6.1"]
check("6.1", save_shards)


# %% tags=["task-6.2"]
class TrainingState(Stateful):
    """Everything an exact resume needs, as one Stateful for dcp.save / dcp.load.

    Holds model (DDP or FSDP2), optimizer, sampler (a kit.resume.ResumableSampler: epoch and
    position), an optional GradScaler, and step (0 at construction; train_step adds 1).
    state_dict() returns model and optimizer state through get_state_dict, the step, this rank's
    torch, Python and NumPy RNG states and the sampler's epoch and position (and the scaler's
    state); load_state_dict() puts all of it back.
    """

    def __init__(self, model, optimizer, sampler, scaler=None):
        self.model, self.optimizer, self.sampler, self.scaler = model, optimizer, sampler, scaler
        self.step = 0

    def state_dict(self) -> dict:
        """Model and optimizer (get_state_dict), step, this rank's RNGs and sampler, scaler."""
        ### BEGIN SOLUTION
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {
            "model": model_state,
            "optim": optim_state,
            "step": self.step,
            # Per-rank values need per-rank keys: DCP keeps one copy of a key all ranks share.
            f"rank{dist.get_rank()}": {
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                        "numpy": np.random.get_state()},
                "sampler": {"epoch": self.sampler.epoch, "position": self.sampler.position},
            },
        }
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state
        ### END SOLUTION

    def load_state_dict(self, state: dict) -> None:
        """Put back everything state_dict() returned (state as dcp.load filled it)."""
        ### BEGIN SOLUTION
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.step = int(state["step"])
        mine = state[f"rank{dist.get_rank()}"]
        torch.set_rng_state(mine["rng"]["torch"])
        random.setstate(mine["rng"]["python"])
        np.random.set_state(mine["rng"]["numpy"])
        self.sampler.set_epoch(int(mine["sampler"]["epoch"]))  # resets position to 0...
        self.sampler.position = int(mine["sampler"]["position"])  # ...so set it after
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        ### END SOLUTION


# %% tags=["check-6.2"]
check("6.2", TrainingState)


# %% tags=["task-6.3"]
def train_with_checkpoints(ckpt_root: str, total_steps: int, every: int) -> dict:
    """Train an FSDP2 model to total_steps, async-saving every `every` steps; resume on start.

    Runs on every rank (under torchrun or launch). Builds the run from the setup's helpers
    (shard_model(make_model()), make_optimizer, make_sampler, a TrainingState; seed_everything(0)
    first), resumes from the newest complete checkpoint under ckpt_root (a step-NNNNNN folder
    holding DCP's .metadata) if there is one, then calls train_step(state) until state.step ==
    total_steps. After each step where state.step % every == 0 it starts dcp.async_save into
    ckpt_root/step-{state.step:06d}, with at most one save in flight. Waits for the last save and
    returns full_parameters(model).
    """
    ### BEGIN SOLUTION
    seed_everything(0)
    model = shard_model(make_model())
    optimizer = make_optimizer(model)
    state = TrainingState(model, optimizer, make_sampler())
    root = Path(ckpt_root)
    # The step is in the name; a checkpoint is complete once DCP wrote .metadata (always last).
    complete = sorted(p for p in root.glob("step-*") if (p / ".metadata").exists())
    if complete:
        dcp.load({"train": state}, checkpoint_id=str(complete[-1]))
    # Saves run in a background thread: give them their own gloo group so their collectives
    # never interleave with the training's.
    ckpt_group = dist.new_group(backend="gloo")
    pending = None
    while state.step < total_steps:
        train_step(state)
        if state.step % every == 0:
            if pending is not None:
                pending.result()  # at most one save in flight
            pending = dcp.async_save({"train": state}, checkpoint_id=str(root / f"step-{state.step:06d}"),
                                     process_group=ckpt_group)
    if pending is not None:
        pending.result()
    return full_parameters(model)
    ### END SOLUTION


# %% tags=["check-6.3"]
check("6.3", train_with_checkpoints)
