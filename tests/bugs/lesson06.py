"""Seeded bugs of Lesson 06: save_shards/load_shards (6.1), TrainingState (6.2),
train_with_checkpoints (6.3).

The lesson's helpers (``make_model``, ``train_step``, ``TrainingState``...) come from its source
through ``load_tasks``, exactly as a student's notebook provides them; 6.3's bugs keep the names
``TrainingState`` and ``train_step`` in their globals, as a student's cell does.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from autograder import course
from autograder.loading import load_tasks
from bugs import edited_solution

_lesson = load_tasks(course.lesson(6).source)
save_shards = _lesson.save_shards  # the correct saver, for the loader bugs
load_shards = _lesson.load_shards  # the correct loader, for the saver bugs
TrainingState = _lesson.TrainingState
make_model, make_optimizer, make_sampler = _lesson.make_model, _lesson.make_optimizer, _lesson.make_sampler
shard_model, train_step, seed_everything = _lesson.shard_model, _lesson.train_step, _lesson.seed_everything
full_parameters = _lesson.full_parameters

# --------------------------------------------------------------------------- 6.1 save/load_shards


def _meta(ckpt_dir, name):
    return json.loads((Path(ckpt_dir) / f"{name}.metadata.json").read_text())


def _load_reading_every_file(ckpt_dir, name, offset, numel):
    meta = _meta(ckpt_dir, name)
    full = torch.cat([torch.load(Path(ckpt_dir) / p["file"], weights_only=True) for p in meta["pieces"]])
    return full[offset:offset + numel].clone()  # right values, every file read


def _load_off_by_one(ckpt_dir, name, offset, numel):
    meta = _meta(ckpt_dir, name)
    out = torch.zeros(numel, dtype=getattr(torch, meta["dtype"]))
    for p in meta["pieces"]:
        last = p["offset"] + p["numel"] - 1  # the piece's last element, inclusive...
        lo, hi = max(offset, p["offset"]), min(offset + numel, last)  # ...used as an exclusive end
        if lo < hi:
            data = torch.load(Path(ckpt_dir) / p["file"], weights_only=True)
            out[lo - offset:hi - offset] = data[lo - p["offset"]:hi - p["offset"]]
    return out


def _save_correctly(ckpt_dir, name, local, offset, global_numel):
    return save_shards(ckpt_dir, name, local, offset, global_numel)


def _save_offsets_inside(ckpt_dir, name, local, offset, global_numel):
    rank = dist.get_rank()
    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    torch.save({"offset": offset, "data": local.clone()}, Path(ckpt_dir) / f"{name}.{rank}.pt")
    dist.barrier()


def _load_offsets_inside(ckpt_dir, name, offset, numel):
    pieces = [torch.load(f, weights_only=True) for f in sorted(Path(ckpt_dir).glob(f"{name}.*.pt"))]
    out = torch.empty(numel, dtype=pieces[0]["data"].dtype)
    for p in pieces:  # every file must be opened to learn its offset
        lo = max(offset, p["offset"])
        hi = min(offset + numel, p["offset"] + p["data"].numel())
        if lo < hi:
            out[lo - offset:hi - offset] = p["data"][lo - p["offset"]:hi - p["offset"]]
    return out


def _save_everything_on_rank_0(ckpt_dir, name, local, offset, global_numel):
    """Rank 0 gathers every piece and writes them all, in the correct loader's layout."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    folder = Path(ckpt_dir)
    folder.mkdir(parents=True, exist_ok=True)
    pieces = [None] * world_size if rank == 0 else None
    dist.gather_object((int(offset), local.detach().clone()), pieces, dst=0)
    if rank == 0:
        meta = {"global_numel": int(global_numel), "dtype": str(local.dtype).removeprefix("torch."),
                "pieces": []}
        for r, (o, piece) in enumerate(pieces):
            torch.save(piece.contiguous(), folder / f"{name}.piece{r}.pt")
            meta["pieces"].append({"file": f"{name}.piece{r}.pt", "offset": o, "numel": piece.numel()})
        meta["pieces"].sort(key=lambda p: p["offset"])
        (folder / f"{name}.metadata.json").write_text(json.dumps(meta))
    dist.barrier()


def _save_with_dcp(ckpt_dir, name, local, offset, global_numel):
    rank = dist.get_rank()
    dcp.save({f"piece{rank}": local.clone(), f"offset{rank}": offset},
             checkpoint_id=os.path.join(ckpt_dir, name))


def _load_with_dcp(ckpt_dir, name, offset, numel):
    from torch.distributed.checkpoint import FileSystemReader

    folder = os.path.join(ckpt_dir, name)
    meta = FileSystemReader(folder).read_metadata().state_dict_metadata
    pieces = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
              if k.startswith("piece")}
    state = {**pieces, **{f"offset{k[5:]}": 0 for k in pieces}}
    dcp.load(state, checkpoint_id=folder, no_dist=True)  # loads every piece
    out = torch.empty(numel, dtype=next(iter(pieces.values())).dtype)
    for k, data in pieces.items():
        o = state[f"offset{k[5:]}"]
        lo, hi = max(offset, o), min(offset + numel, o + data.numel())
        if lo < hi:
            out[lo - offset:hi - offset] = data[lo - o:hi - o]
    return out


def _save_with_deprecated_dcp(ckpt_dir, name, local, offset, global_numel):
    rank = dist.get_rank()  # DCP's old entry point, still exported (deprecated)
    dcp.save_state_dict({f"piece{rank}": local.clone(), f"offset{rank}": offset},
                        storage_writer=dcp.FileSystemWriter(os.path.join(ckpt_dir, name)))


def _load_with_deprecated_dcp(ckpt_dir, name, offset, numel):
    folder = os.path.join(ckpt_dir, name)
    meta = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    pieces = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
              if k.startswith("piece")}
    state = {**pieces, **{f"offset{k[5:]}": 0 for k in pieces}}
    dcp.load_state_dict(state, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    out = torch.empty(numel, dtype=next(iter(pieces.values())).dtype)
    for k, data in pieces.items():
        o = state[f"offset{k[5:]}"]
        lo, hi = max(offset, o), min(offset + numel, o + data.numel())
        if lo < hi:
            out[lo - offset:hi - offset] = data[lo - o:hi - o]
    return out


def _pair(save, load):
    """A save_shards whose cell's load_shards is ``load`` (the check finds it in its globals)."""
    return type(save)(save.__code__, {**globals(), "load_shards": load}, "save_shards")


# --------------------------------------------------------------------------- 6.2 TrainingState


class _State:
    def __init__(self, model, optimizer, sampler, scaler=None):
        self.model, self.optimizer, self.sampler, self.scaler = model, optimizer, sampler, scaler
        self.step = 0

    def _key(self):
        return f"rank{dist.get_rank()}"

    def _model_optim(self):
        return get_state_dict(self.model, self.optimizer)

    def _rng(self):
        return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}

    def _sampler(self):
        return {"epoch": self.sampler.epoch, "position": self.sampler.position}

    def state_dict(self):
        model, optim = self._model_optim()
        have = optim.get("state", {})
        like = next(iter(have.values()), None) if isinstance(have, dict) else None
        for group in optim.get("param_groups", []) if like is not None else []:
            for fqn in group["params"]:  # no gradient yet: the optimizer's initial state
                if fqn not in have and fqn in model:
                    have[fqn] = {k: torch.zeros_like(v if v.dim() == 0 else model[fqn])
                                 for k, v in like.items()}
        state = {"model": model, "optim": optim, "step": self.step,
                 self._key(): {"rng": self._rng(), "sampler": self._sampler()}}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def _set_model_optim(self, state):
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    def _set_rng(self, rng):
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])

    def _set_sampler(self, sampler):
        self.sampler.set_epoch(int(sampler["epoch"]))
        self.sampler.position = int(sampler["position"])

    def load_state_dict(self, state):
        self._set_model_optim(state)
        self.step = int(state["step"])
        mine = state[self._key()]
        self._set_rng(mine["rng"])
        self._set_sampler(mine["sampler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])


class StateWithoutRng(_State):
    def _rng(self):
        return {}

    def _set_rng(self, rng):
        pass


class StateOnlyTorchRng(_State):
    def _rng(self):
        return {"torch": torch.get_rng_state()}

    def _set_rng(self, rng):
        torch.set_rng_state(rng["torch"])


class StateRngUnderOneKey(_State):
    def state_dict(self):
        state = super().state_dict()
        state["rng"] = state[self._key()].pop("rng")  # one key on every rank: DCP keeps one copy
        return state

    def load_state_dict(self, state):
        state[self._key()]["rng"] = state.pop("rng")
        super().load_state_dict(state)


class StateWithoutSamplerPosition(_State):
    def _sampler(self):
        return {"epoch": self.sampler.epoch}

    def _set_sampler(self, sampler):
        self.sampler.set_epoch(int(sampler["epoch"]))


class StateWithoutOptimizer(_State):
    def state_dict(self):
        state = super().state_dict()
        del state["optim"]
        return state

    def _set_model_optim(self, state):
        set_model_state_dict(self.model, state["model"])


class StateWithPlainOptimizerStateDict(_State):
    def _model_optim(self):
        # A fresh optimizer's state_dict() has no state: at load time DCP has nothing to fill.
        return get_model_state_dict(self.model), self.optimizer.state_dict()

    def _set_model_optim(self, state):
        set_model_state_dict(self.model, state["model"])
        self.optimizer.load_state_dict(state["optim"])


class StateWithoutStep(_State):
    def load_state_dict(self, state):
        step = self.step
        super().load_state_dict(state)
        self.step = step


class StateWithoutScaler(_State):
    def state_dict(self):
        state = super().state_dict()
        state.pop("scaler", None)
        return state

    def load_state_dict(self, state):
        scaler, self.scaler = self.scaler, None
        super().load_state_dict(state)
        self.scaler = scaler


class StateWithLocalShards(_State):
    def _model_optim(self):
        model, optim = get_state_dict(self.model, self.optimizer)
        return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in model.items()}, optim

    def _set_model_optim(self, state):
        model, _ = get_state_dict(self.model, self.optimizer)
        for k, v in model.items():
            if hasattr(v, "to_local"):
                v.to_local().copy_(state["model"][k])
            else:
                v.copy_(state["model"][k])
        set_state_dict(self.model, self.optimizer, model_state_dict=model,
                       optim_state_dict=state["optim"])


def _the_graders_training_state() -> type:
    """The grader's trusted TrainingState, found by a computed name: no import of the grader in
    any task's source."""
    import importlib

    return getattr(importlib.import_module("autograder.references." + "lesson06"), "Training" + "State")


_GradersState = _the_graders_training_state()


class StateFromTheGradersReference(_GradersState):
    """The grader's own TrainingState, subclassed with nothing of its own."""


# --------------------------------------------------------------------------- 6.3 train_with_checkpoints


def _run(ckpt_root, total_steps, every, pick, wait_previous=True, wait_last=True, use_async=True):
    seed_everything(0)
    model = shard_model(make_model())
    state = TrainingState(model, make_optimizer(model), make_sampler())
    chosen = pick(Path(ckpt_root))
    if chosen is not None:
        dcp.load({"train": state}, checkpoint_id=str(chosen))
    group = dist.new_group(backend="gloo")
    pending = None
    while state.step < total_steps:
        train_step(state)
        if state.step % every == 0:
            folder = str(Path(ckpt_root) / f"step-{state.step:06d}")
            if not use_async:
                dcp.save({"train": state}, checkpoint_id=folder, process_group=group)
                continue
            if pending is not None and wait_previous:
                pending.result()
            pending = dcp.async_save({"train": state}, checkpoint_id=folder, process_group=group)
    if pending is not None and wait_last:
        pending.result()
    return full_parameters(model)


def _newest_complete(root):
    done = sorted(p for p in root.glob("step-*") if (p / ".metadata").exists())
    return done[-1] if done else None


def train_loading_half_written(ckpt_root, total_steps, every):
    return _run(ckpt_root, total_steps, every, lambda root: max(root.glob("step-*"), default=None))


def train_newest_by_mtime(ckpt_root, total_steps, every):
    def pick(root):
        done = [p for p in root.glob("step-*") if (p / ".metadata").exists()]
        return max(done, key=lambda p: p.stat().st_mtime, default=None)
    return _run(ckpt_root, total_steps, every, pick)


def train_two_saves_in_flight(ckpt_root, total_steps, every):
    return _run(ckpt_root, total_steps, every, _newest_complete, wait_previous=False)


def train_blocking_saves(ckpt_root, total_steps, every):
    return _run(ckpt_root, total_steps, every, _newest_complete, use_async=False)


def train_never_resumes(ckpt_root, total_steps, every):
    return _run(ckpt_root, total_steps, every, lambda root: None)


BUGS = {
    "6.1": [
        ("the loader reads every file", _pair(_save_correctly, _load_reading_every_file)),
        ("off by one at piece borders (inclusive end used as exclusive)", _pair(_save_correctly, _load_off_by_one)),
        ("offsets kept inside the piece files: every load opens every file",
         _pair(_save_offsets_inside, _load_offsets_inside)),
        ("wraps dcp.save/dcp.load and loads every piece", _pair(_save_with_dcp, _load_with_dcp)),
        ("wraps DCP's deprecated save_state_dict/load_state_dict",
         _pair(_save_with_deprecated_dcp, _load_with_deprecated_dcp)),
        ("rank 0 gathers every piece and writes them all",
         _pair(_save_everything_on_rank_0, load_shards)),
    ],
    "6.2": [
        ("the RNG states are not saved", StateWithoutRng),
        ("only torch's RNG is saved (Python's and NumPy's are lost)", StateOnlyTorchRng),
        ("the RNG states are saved under one key on every rank (DCP keeps one copy)",
         StateRngUnderOneKey),
        ("the sampler's position is lost (epoch only)", StateWithoutSamplerPosition),
        ("the optimizer state is missing", StateWithoutOptimizer),
        ("optimizer.state_dict() instead of get_state_dict", StateWithPlainOptimizerStateDict),
        ("the step counter is not restored", StateWithoutStep),
        ("the GradScaler's state is not saved", StateWithoutScaler),
        ("each rank's local FSDP shard is saved (to_local): no resharding", StateWithLocalShards),
        ("subclasses the grader's reference TrainingState", StateFromTheGradersReference),
        ("saves no optimizer state for a parameter without a gradient so far: a fresh load "
         "misses its keys", edited_solution(6, (
             "if like is not None and fqn not in have and fqn in model_state:",
             "if False:  # only what the optimizer holds",
         )).TrainingState),
    ],
    "6.3": [
        ("a half-written checkpoint loaded (newest folder, no .metadata check)",
         train_loading_half_written),
        ("the newest checkpoint chosen by modification time", train_newest_by_mtime),
        ("two saves in flight (never waits for the previous one)", train_two_saves_in_flight),
        ("blocking dcp.save instead of dcp.async_save", train_blocking_saves),
        ("never resumes", train_never_resumes),
        ("lists ckpt_root with os.listdir: a first run, before the folder exists, raises",
         edited_solution(6, (
             'complete = sorted(p for p in root.glob("step-*") if (p / ".metadata").exists())',
             'complete = sorted(root / n for n in os.listdir(root)\n'
             '                      if n.startswith("step-") and (root / n / ".metadata").exists())',
         )).train_with_checkpoints),
        ("tests for the end after the step: resumed at total_steps it trains one step more",
         edited_solution(6, (
             "    while state.step < total_steps:\n        train_step(state)\n",
             "    while True:  # one step, then see whether we are done\n        train_step(state)\n",
         ), (
             "                                     process_group=ckpt_group)\n",
             "                                     process_group=ckpt_group)\n"
             "        if state.step >= total_steps:\n            break\n",
         )).train_with_checkpoints),
    ],
}
