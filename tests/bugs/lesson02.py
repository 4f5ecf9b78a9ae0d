"""Seeded bugs of Lesson 02: dist_info_from_env (2.1), resumable_train (2.2), first_mismatch (2.3).

The lesson's helpers (``DistInfo``, ``Mismatch``, ``make_model``, ``train_step``...) come from its
source through :func:`autograder.loading.load_tasks`, exactly as a student's notebook provides them.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from autograder.loading import load_tasks

_lesson = load_tasks(Path(__file__).resolve().parents[2] / "solutions" / "02_torchrun.py")
DistInfo, Mismatch = _lesson.DistInfo, _lesson.Mismatch
make_model, make_optimizer, train_step = _lesson.make_model, _lesson.make_optimizer, _lesson.train_step

# --------------------------------------------------------------------------- 2.1 dist_info_from_env


def _read(env, name: str, default: int) -> int:
    return int(env[name]) if name in env else default


def dist_info_without_checks(env=None):
    env = os.environ if env is None else env
    world_size, rank = _read(env, "WORLD_SIZE", 1), _read(env, "RANK", 0)
    lws = _read(env, "LOCAL_WORLD_SIZE", world_size)
    return DistInfo(rank, _read(env, "LOCAL_RANK", rank % lws), world_size, lws,
                    _read(env, "GROUP_RANK", rank // lws), env.get("MASTER_ADDR", "127.0.0.1"),
                    _read(env, "MASTER_PORT", 29500), "WORLD_SIZE" in env)


def dist_info_local_rank_is_rank(env=None):
    info = _lesson.dist_info_from_env({k: v for k, v in (os.environ if env is None else env).items()
                                       if k != "LOCAL_RANK"})
    return DistInfo(info.rank, info.rank, info.world_size, info.local_world_size, info.node_rank,
                    info.master_addr, info.master_port, info.is_distributed)


def dist_info_bare_int_errors(env=None):
    env = os.environ if env is None else env
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT"):
        if name in env:
            int(env[name])  # int()'s own message never names the variable
    return _lesson.dist_info_from_env(env)


def dist_info_distributed_only_above_one(env=None):
    info = _lesson.dist_info_from_env(env)
    info.is_distributed = info.world_size > 1
    return info


# --------------------------------------------------------------------------- 2.2 resumable_train


def _load(path, model, optimizer, with_optimizer=True) -> int:
    if not os.path.exists(path):
        return 0
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    if with_optimizer:
        optimizer.load_state_dict(state["optimizer"])
    return state["step"]


def _save(path, model, optimizer, next_step) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "step": next_step}, path + ".tmp")
        os.replace(path + ".tmp", path)
    if dist.is_initialized():
        dist.barrier()


def resumable_train_restarts_data(ckpt_dir, total_steps):
    model = make_model()
    optimizer = make_optimizer(model)
    path = os.path.join(ckpt_dir, "checkpoint.pt")
    start = _load(path, model, optimizer)
    for i in range(total_steps - start):
        train_step(model, optimizer, i)  # the step count restarts at 0: batches replayed
        _save(path, model, optimizer, start + i + 1)
    return model.state_dict()


def resumable_train_forgets_optimizer(ckpt_dir, total_steps):
    model = make_model()
    optimizer = make_optimizer(model)
    path = os.path.join(ckpt_dir, "checkpoint.pt")
    start = _load(path, model, optimizer, with_optimizer=False)  # momentum starts from zero
    for step in range(start, total_steps):
        train_step(model, optimizer, step)
        _save(path, model, optimizer, step + 1)
    return model.state_dict()


def resumable_train_never_resumes(ckpt_dir, total_steps):
    model = make_model()
    optimizer = make_optimizer(model)
    path = os.path.join(ckpt_dir, "checkpoint.pt")
    for step in range(total_steps):  # saves, but always starts over
        train_step(model, optimizer, step)
        _save(path, model, optimizer, step + 1)
    return model.state_dict()


# --------------------------------------------------------------------------- 2.3 first_mismatch


def _mismatch_at(calls, key):
    ranks = sorted(calls)
    longest = max((len(s) for s in calls.values()), default=0)
    for index in range(longest):
        at = {r: (calls[r][index] if index < len(calls[r]) else None) for r in ranks}
        keys = {r: key(c) for r, c in at.items()}
        if len(set(keys.values())) == 1:
            continue
        counts = Counter(keys.values())
        top = max(counts.values())
        common = next(keys[r] for r in ranks if counts[keys[r]] == top)
        return Mismatch(index, [r for r in ranks if keys[r] != common], at)
    return None


def first_mismatch_ignores_shapes(calls):
    return _mismatch_at(calls, lambda c: None if c is None else c[0])


def first_mismatch_zips(calls):
    shortest = min((len(s) for s in calls.values()), default=0)
    return _mismatch_at({r: seq[:shortest] for r, seq in calls.items()}, lambda c: c)  # like zip()


def first_mismatch_all_ranks(calls):
    found = _mismatch_at(calls, lambda c: c)
    if found is not None:
        found.ranks = sorted(calls)  # blames everybody
    return found


BUGS = {
    "2.1": [
        ("accepts inconsistent values (no range checks)", dist_info_without_checks),
        ("uses RANK as the local rank", dist_info_local_rank_is_rank),
        ("lets int() raise without naming the variable", dist_info_bare_int_errors),
        ("calls a one-worker torchrun not distributed", dist_info_distributed_only_above_one),
    ],
    "2.2": [
        ("restarts the data order after resuming", resumable_train_restarts_data),
        ("does not restore the optimizer state", resumable_train_forgets_optimizer),
        ("never loads the checkpoint", resumable_train_never_resumes),
    ],
    "2.3": [
        ("ignores shapes", first_mismatch_ignores_shapes),
        ("stops at the shortest sequence (zip)", first_mismatch_zips),
        ("blames every rank", first_mismatch_all_ranks),
    ],
}
