"""Seeded bugs of Lesson 06: save_shards/load_shards (6.1), TrainingState (6.2),
train_with_checkpoints (6.3).

``BUGS[task_id]`` lists ``(what is wrong, implementation)``. Each bug is the solution with one
step changed (edited_solution), loaded as a student's notebook is: its globals hold the cell's
other names (6.1's ``load_shards``, 6.3's ``TrainingState`` and ``train_step``). The exploits
(DCP's own entry points, the grader's reference) are small pieces of their own.
"""

from __future__ import annotations

import importlib
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from bugs import edited_solution


def _bug(name: str, *edits: tuple[str, str]):
    """The solution's ``name`` with each (old, new) edit made."""
    return getattr(edited_solution(6, *edits), name)


# --------------------------------------------------------------------------- 6.1 save/load_shards

_SKIP = "        if lo >= hi:\n            continue  # no overlap: never open its file\n"
_OPEN = '        data = torch.load(folder / piece["file"], weights_only=True)\n'
_WRITE = ("    torch.save(local.detach().contiguous().clone(), folder / file)"
          "  # only this rank's bytes\n")

saves_for_a_loader_reading_every_file = _bug("save_shards", (
    _SKIP + _OPEN, _OPEN + "        if lo >= hi:\n            continue  # opened all the same\n"))
saves_for_a_loader_off_by_one = _bug("save_shards", (  # the piece's last element used as its end
    'min(stop, piece["offset"] + piece["numel"])',
    'min(stop, piece["offset"] + piece["numel"] - 1)'))
saves_offsets_inside_the_files = _bug(  # the metadata's offsets unused: a load opens every file
    "save_shards",
    (_WRITE, '    torch.save({"offset": int(offset),\n'
             '                "data": local.detach().contiguous().clone()}, folder / file)\n'),
    ('    for piece in meta["pieces"]:\n',
     '    for piece in meta["pieces"]:\n'
     '        saved = torch.load(folder / piece["file"], weights_only=True)\n'
     '        piece, data = {**piece, "offset": saved["offset"]}, saved["data"]\n'),
    (_OPEN, ""))
saves_everything_on_rank_0 = _bug("save_shards", (  # rank 0 gathers every piece and writes them
    _WRITE,
    "    gathered = [None] * dist.get_world_size()\n"
    "    dist.all_gather_object(gathered, local.detach().clone())\n"
    "    for r, t in enumerate(gathered if rank == 0 else []):\n"
    '        torch.save(t.contiguous(), folder / f"{name}.piece{r}.pt")\n'))


def _pieces_via_dcp(folder, load):
    """Every piece DCP holds in ``folder`` (``load`` fills them all), concatenated by offset."""
    meta = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) if k.startswith("piece") else 0
             for k, m in meta.items()}
    load(state)
    pieces = sorted((k for k in state if k.startswith("piece")),
                    key=lambda k: state[f"offset{k[5:]}"])
    return torch.cat([state[k] for k in pieces])


def _save_with_dcp(ckpt_dir, name, local, offset, global_numel):
    rank = dist.get_rank()
    dcp.save({f"piece{rank}": local.clone(), f"offset{rank}": offset},
             checkpoint_id=os.path.join(ckpt_dir, name))


def _load_with_dcp(ckpt_dir, name, offset, numel):
    folder = os.path.join(ckpt_dir, name)
    full = _pieces_via_dcp(folder, lambda s: dcp.load(s, checkpoint_id=folder, no_dist=True))
    return full[offset:offset + numel].clone()


def _save_with_deprecated_dcp(ckpt_dir, name, local, offset, global_numel):
    rank = dist.get_rank()  # DCP's old entry point, still exported (deprecated)
    dcp.save_state_dict({f"piece{rank}": local.clone(), f"offset{rank}": offset},
                        storage_writer=dcp.FileSystemWriter(os.path.join(ckpt_dir, name)))


def _load_with_deprecated_dcp(ckpt_dir, name, offset, numel):
    folder = os.path.join(ckpt_dir, name)
    reader = dcp.FileSystemReader(folder)
    full = _pieces_via_dcp(folder, lambda s: dcp.load_state_dict(s, storage_reader=reader,
                                                                 no_dist=True))
    return full[offset:offset + numel].clone()


def _pair(save, load):
    """A save_shards whose cell's load_shards is ``load`` (the check finds it in its globals)."""
    return type(save)(save.__code__, {**globals(), "load_shards": load}, "save_shards")


# --------------------------------------------------------------------------- 6.2 TrainingState

_SAVE_RNG = ('"rng": {"torch": torch.get_rng_state(), "python": random.getstate(),\n'
             '                        "numpy": np.random.get_state()},\n')
_SET_OTHER_RNGS = ('        random.setstate(mine["rng"]["python"])\n'
                   '        np.random.set_state(mine["rng"]["numpy"])\n')
_SET_TORCH_RNG = '        torch.set_rng_state(mine["rng"]["torch"])\n'
_SET_BOTH = ('set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],\n'
             '                       optim_state_dict=state["optim"])')
_SET_MODEL = ("from torch.distributed.checkpoint.state_dict import set_model_state_dict\n"
              '        set_model_state_dict(self.model, state["model"])')

StateWithoutRng = _bug("TrainingState", (_SAVE_RNG, '"rng": {},\n'),
                       (_SET_TORCH_RNG + _SET_OTHER_RNGS, ""))
StateOnlyTorchRng = _bug("TrainingState",
                         (_SAVE_RNG, '"rng": {"torch": torch.get_rng_state()},\n'),
                         (_SET_OTHER_RNGS, ""))
StateRngUnderOneKey = _bug(  # one key on every rank: DCP keeps one copy
    "TrainingState",
    ('            f"rank{dist.get_rank()}": {\n                ' + _SAVE_RNG,
     '            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),\n'
     '                    "numpy": np.random.get_state()},\n'
     '            f"rank{dist.get_rank()}": {\n'),
    ('mine = state[f"rank{dist.get_rank()}"]',
     'mine = {**state[f"rank{dist.get_rank()}"], "rng": state["rng"]}'))
StateWithoutSamplerPosition = _bug(
    "TrainingState",
    ('"sampler": {"epoch": self.sampler.epoch, "position": self.sampler.position},',
     '"sampler": {"epoch": self.sampler.epoch},'),
    ('        self.sampler.position = int(mine["sampler"]["position"])', "        pass"))
StateWithoutOptimizer = _bug("TrainingState", ('            "optim": optim_state,\n', ""),
                             (_SET_BOTH, _SET_MODEL))
StateWithPlainOptimizerStateDict = _bug(  # a fresh optimizer's state_dict() has nothing to fill
    "TrainingState",
    ("model_state, optim_state = get_state_dict(self.model, self.optimizer)",
     "model_state, optim_state = (get_model_state_dict(self.model),\n"
     "                                    self.optimizer.state_dict())"),
    (_SET_BOTH, _SET_MODEL + '\n        self.optimizer.load_state_dict(state["optim"])'))
StateWithoutStep = _bug("TrainingState", ('        self.step = int(state["step"])\n', ""))
StateWithoutScaler = _bug(
    "TrainingState",
    ('if self.scaler is not None:\n            state["scaler"] = self.scaler.state_dict()',
     "pass"),
    ('if self.scaler is not None:\n            self.scaler.load_state_dict(state["scaler"])',
     "pass"))
StateWithLocalShards = _bug(
    "TrainingState",
    ('            "model": model_state,\n',
     '            "model": {k: v.to_local() if hasattr(v, "to_local") else v\n'
     "                      for k, v in model_state.items()},\n"),
    (_SET_BOTH,
     "model, _ = get_state_dict(self.model, self.optimizer)\n"
     "        for k, v in model.items():  # each rank's shard copied back in place\n"
     '            (v.to_local() if hasattr(v, "to_local") else v).copy_(state["model"][k])\n'
     "        set_state_dict(self.model, self.optimizer, model_state_dict=model,\n"
     '                       optim_state_dict=state["optim"])'))

# The grader's trusted TrainingState, found by a computed name: no import of the grader in any
# task's source.
_GradersState = getattr(importlib.import_module("autograder.references." + "lesson06"),
                        "Training" + "State")


class StateFromTheGradersReference(_GradersState):
    """The grader's own TrainingState, subclassed with nothing of its own."""


# ------------------------------------------------------------------- 6.3 train_with_checkpoints

_COMPLETE = 'complete = sorted(p for p in root.glob("step-*") if (p / ".metadata").exists())'

BUGS = {
    "6.1": [
        ("the loader reads every file", saves_for_a_loader_reading_every_file),
        ("off by one at piece borders (inclusive end used as exclusive)",
         saves_for_a_loader_off_by_one),
        ("offsets kept inside the piece files: every load opens every file",
         saves_offsets_inside_the_files),
        ("wraps dcp.save/dcp.load and loads every piece", _pair(_save_with_dcp, _load_with_dcp)),
        ("wraps DCP's deprecated save_state_dict/load_state_dict",
         _pair(_save_with_deprecated_dcp, _load_with_deprecated_dcp)),
        ("rank 0 gathers every piece and writes them all", saves_everything_on_rank_0),
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
         "misses its keys", _bug("TrainingState", (
             "if like is not None and fqn not in have and fqn in model_state:",
             "if False:  # only what the optimizer holds",
         ))),
    ],
    "6.3": [
        ("a half-written checkpoint loaded (newest folder, no .metadata check)",
         _bug("train_with_checkpoints", (_COMPLETE, 'complete = sorted(root.glob("step-*"))'))),
        ("the newest checkpoint chosen by modification time", _bug("train_with_checkpoints", (
            _COMPLETE,
            'complete = sorted((p for p in root.glob("step-*") if (p / ".metadata").exists()),\n'
            "                      key=lambda p: p.stat().st_mtime)"))),
        ("two saves in flight (never waits for the previous one)", _bug("train_with_checkpoints", (
            "            if pending is not None:\n"
            "                pending.result()  # at most one save in flight\n", ""))),
        ("blocking dcp.save instead of dcp.async_save", _bug("train_with_checkpoints", (
            'pending = dcp.async_save({"train": state},', 'dcp.save({"train": state},'))),
        ("never resumes", _bug("train_with_checkpoints", (
            "    if complete:\n        dcp.load(", "    if False:\n        dcp.load("))),
        ("lists ckpt_root with os.listdir: a first run, before the folder exists, raises",
         _bug("train_with_checkpoints", (
             _COMPLETE,
             "complete = sorted(root / n for n in os.listdir(root)\n"
             '                      if n.startswith("step-")\n'
             '                      and (root / n / ".metadata").exists())',
         ))),
        ("tests for the end after the step: resumed at total_steps it trains one step more",
         _bug("train_with_checkpoints", (
             "    while state.step < total_steps:\n        train_step(state)\n",
             "    while True:  # one step, then see whether we are done\n"
             "        train_step(state)\n",
         ), (
             "                                     process_group=ckpt_group)\n",
             "                                     process_group=ckpt_group)\n"
             "        if state.step >= total_steps:\n            break\n",
         ))),
    ],
}
