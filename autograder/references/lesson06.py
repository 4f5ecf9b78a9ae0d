"""The grader's answers for Lesson 06 (trusted only): the values a sharded load must return and
the bytes it may read or write (6.1), a trusted ``TrainingState`` (6.2's reference Stateful), the
uninterrupted runs 6.2's resumes must equal bit for bit, and the uninterrupted run of 6.3's loop
its checkpointed, killed and resumed runs must end at. The runs on ranks are trusted shared
runs: each is launched once per seed while a check runs, whichever of its cases asks first.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from autograder import lesson06 as L
from autograder.registry import shared

# --------------------------------------------------------------------------- task 6.1


def saved_slices(seed: int, chosen: list[int]) -> list[torch.Tensor]:
    """Elements [offset, offset + numel) of the saved tensor, for each chosen load of the checks."""
    jobs, tensors = L._load_jobs(), L._tensors(seed)
    return [tensors[jobs[i][1]][jobs[i][2]:jobs[i][2] + jobs[i][3]].clone() for i in chosen]


def allowed_read_bytes(seed: int) -> list[int]:
    """Per load: the bytes of the pieces it overlaps, plus BYTES_SLACK per file opened."""
    allowed = []
    for w, name, offset, numel, _ in L._load_jobs():
        sizes = L.SAVE_SPLITS[w][0 if name == "weight" else 1]
        itemsize = 4 if name == "weight" else 8
        overlap = [n for o, n in zip(L._offsets(sizes), sizes)
                   if max(offset, o) < min(offset + numel, o + n)]
        allowed.append(sum(overlap) * itemsize + L.BYTES_SLACK * (len(overlap) + 1))
    return allowed


def write_bound(seed: int) -> dict[str, int]:
    """What a rank may write beyond its own pieces: a header per piece file, and (rank 0) the
    metadata of each tensor."""
    return {"bound": L.WRITE_SLACK}


# --------------------------------------------------------------------------- task 6.2


def with_initial_optimizer_state(model_state: dict[str, Any], optim_state: dict[str, Any]) -> None:
    """Give every parameter that has no optimizer state yet (no gradient so far) the state AdamW
    starts it with, zeros and step 0: a fresh optimizer's template (``get_state_dict`` creates
    state for every trainable parameter) then finds each key in the checkpoint, and the loaded
    zeros are what the optimizer would have created at the parameter's first gradient."""
    known = optim_state["state"]
    if not known:
        return
    template = next(iter(known.values()))
    for group in optim_state["param_groups"]:
        for name in group["params"]:
            if name in known or name not in model_state:
                continue
            known[name] = {key: torch.zeros_like(value) if value.dim() == 0
                           else torch.zeros_like(model_state[name])
                           for key, value in template.items()}


class TrainingState:
    """Task 6.2's reference Stateful: model and optimizer via get_state_dict, step, per-rank RNGs
    and sampler, and the scaler's state when there is one."""

    def __init__(self, model: Any, optimizer: Any, sampler: Any, scaler: Any = None):
        self.model, self.optimizer, self.sampler, self.scaler = model, optimizer, sampler, scaler
        self.step = 0

    @staticmethod
    def _rank_key() -> str:
        return f"rank{dist.get_rank() if dist.is_initialized() else 0}"

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        with_initial_optimizer_state(model_state, optim_state)
        state = {"model": model_state, "optim": optim_state, "step": self.step,
                 self._rank_key(): {
                     "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()},
                     "sampler": {"epoch": self.sampler.epoch, "position": self.sampler.position}}}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.step = int(state["step"])
        mine = state[self._rank_key()]
        torch.set_rng_state(mine["rng"]["torch"])
        random.setstate(mine["rng"]["python"])
        np.random.set_state(mine["rng"]["numpy"])
        self.sampler.set_epoch(int(mine["sampler"]["epoch"]))
        self.sampler.position = int(mine["sampler"]["position"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])


def _straight_on_rank(kind: str, seed: int, total: int, at: int) -> dict[str, Any]:
    """``total`` straight steps with the reference state: the snapshot before step ``at``, the
    losses from there on and the final parameters."""
    from kit.lessons.resume import full_parameters, seed_everything, train_step

    seed_everything(seed)
    state = L._build(kind, TrainingState)
    losses, snap = [], None
    for _ in range(total):
        if state.step == at:
            snap = L._snapshot(state)
        losses.append(train_step(state))
    return {"snapshot": snap, "losses": losses[at:], "final": full_parameters(state.model)}


def _straight_both(seed: int) -> dict[str, Any]:
    out = {kind: _straight_on_rank(kind, seed, L.TOTAL, L.SAVE_AT) for kind in ("ddp", "fsdp")}
    unused = _straight_on_rank("fsdp-unused", seed, L.UNUSED_AT + L.UNUSED_MORE, L.UNUSED_AT)
    out["unused"] = {"losses": unused["losses"], "final": unused["final"]}
    return out


def _straight(_key: Any, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from kit.launcher import run_ranks

    preload = L.STATE.preload
    two = list(run_ranks(_straight_both, (seed,), world_size=2, timeout=60.0, echo=False,
                         preload=preload))
    four = list(run_ranks(_straight_on_rank, ("fsdp", seed, L.SAVE_AT_4, L.SAVE_AT_4),
                          world_size=4, timeout=60.0, echo=False, preload=preload))
    return two, four


_STRAIGHT = shared(_straight)


def straight_runs(seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """6.2's expectations: DDP and FSDP2 on 2 ranks, FSDP2 on 4, uninterrupted, per rank."""
    return _STRAIGHT(_straight, seed)


# --------------------------------------------------------------------------- task 6.3


def _reference_run_on_rank(totals: tuple[int, ...]) -> list[dict[str, torch.Tensor]]:
    from kit.lessons.resume import (
        full_parameters,
        make_model,
        make_optimizer,
        make_sampler,
        seed_everything,
        shard_model,
        train_step,
    )

    seed_everything(0)
    model = shard_model(make_model())
    state = TrainingState(model, make_optimizer(model), make_sampler())
    out = []
    for total in totals:
        while state.step < total:
            train_step(state)
        out.append(full_parameters(model))
    return out


def _uninterrupted(_key: Any, seed: int) -> dict[int, dict[str, torch.Tensor]]:
    from kit.launcher import run_ranks

    totals = tuple(sorted({L.QUICK_FIRST, L.QUICK_TOTAL, L.RUN_TOTAL}))
    got = run_ranks(_reference_run_on_rank, (totals,), world_size=2, timeout=60.0, echo=False,
                    preload=L.LOOP.preload)
    return dict(zip(totals, got[0]))


_UNINTERRUPTED = shared(_uninterrupted)


def uninterrupted_params(seed: int) -> dict[int, dict[str, torch.Tensor]]:
    """The full parameters of an uninterrupted trusted run on 2 ranks after each step count the
    checks stop at (the loop seeds itself with 0, so every seed gets the same numbers)."""
    return _UNINTERRUPTED(_uninterrupted, seed)
