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
# # {{title}}
#
# Lesson 02's `resumable_train` saved a small model from rank 0 with `torch.save`. That stops
# working as models grow: the full state has to be gathered onto one rank, which then needs
# memory for all of it and writes it alone while every other rank waits. PyTorch's
# [Distributed Checkpoint](https://pytorch.org/docs/stable/distributed.checkpoint.html) (DCP)
# lets every rank write its own shards in parallel, loads them back onto any number of ranks,
# and can save in the background while training continues. This lesson builds DCP's core idea
# by hand, then uses DCP to make a sharded FSDP2 run survive `SIGKILL` and end bit-identical to
# a run that never crashed.
#
# **Prerequisites:** Lesson 02 (`torchrun`, restarts, `resumable_train`), Lesson 03
# (`DistributedSampler`, seeding), Lessons 04-05 (DDP, FSDP2's `fully_shard` and DTensor
# parameters).
#
# **You will be able to:**
# - measure why rank 0's `torch.save` of the full state does not scale;
# - write sharded save and load by hand: per-rank files, a metadata map, loads that read only
#   the pieces they need, onto any world size ({{task 6.1}});
# - use `get_state_dict`/`set_state_dict` and the `Stateful` protocol to capture *everything*
#   an exact resume needs: model, optimizer, step, each rank's RNG states, the sampler's
#   position ({{task 6.2}});
# - save with `dcp.async_save` without stopping training, commit checkpoints atomically and
#   resume from the newest complete one under real `torchrun` restarts ({{task 6.3}});
# - convert between DCP and `torch.save` files, and pick a checkpoint interval from the failure
#   rate.
#
# Replace each `raise NotImplementedError(...)` with your code, run the cell, then the
# `check(...)` cell under it.

# %% tags=["setup"]
import json
import os
import random
import tempfile
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
from kit.lessons.resume import (
    DropoutTransformer,
    full_parameters,
    make_model,
    make_optimizer,
    make_sampler,
    seed_everything,
    shard_model,
    train_step,
)
from kit.torchrun import TorchrunError, init_process_group_per_attempt, torchrun, write_script

# %% [markdown]
# The setup cell's helpers come from [`kit/lessons/resume.py`](../kit/lessons/resume.py):
# `make_model()` (a small transformer with dropout, the same initial weights in every process),
# `shard_model` (FSDP2's `fully_shard` on each block, then the root), `make_optimizer` (AdamW),
# `make_sampler()` (a shuffling `DistributedSampler` that also remembers its `position` in the
# epoch), `seed_everything(seed)` (torch, Python and NumPy seeded with `seed + rank`),
# `train_step(state)` (one step; it draws from all three RNGs and adds 1 to `state.step`) and
# `full_parameters(model)` (the unsharded state dict on every rank).
#
# ## 1. Why rank 0's `torch.save` does not scale
#
# The simplest distributed checkpoint gathers the full state onto rank 0 and writes one file.
# With FSDP2 each rank holds 1/W of the parameters and of AdamW's two state tensors per
# parameter; gathering means rank 0 suddenly holds *all* of them, and writes them alone while
# the other ranks wait. Let us measure both on 4 ranks as the model grows: the bytes of
# checkpoint state the busiest rank materialises, and the wall time of the save.

# %%
def tensor_bytes(tree) -> int:
    """Bytes of the tensors in a nested state dict; a DTensor counts its local shard only."""
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    if hasattr(tree, "to_local"):
        tree = tree.to_local()
    return tree.numel() * tree.element_size() if isinstance(tree, torch.Tensor) else 0


def save_costs(folder: str, dims: list[int]) -> list[dict]:
    rows = []
    for dim in dims:
        torch.manual_seed(0)
        model = shard_model(DropoutTransformer(vocab=256, dim=dim, layers=4, heads=4, context=16))
        optimizer = make_optimizer(model)
        model(torch.randint(0, 256, (2, 16))).sum().backward()
        optimizer.step()  # AdamW now holds exp_avg and exp_avg_sq for every parameter

        # (a) gather the full state on rank 0, which writes one file
        dist.barrier()
        start = time.perf_counter()
        full = get_state_dict(model, optimizer,
                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            torch.save(full, f"{folder}/full-{dim}.pt")
        dist.barrier()
        full_s, full_bytes = time.perf_counter() - start, tensor_bytes(full)
        del full

        # (b) DCP: every rank writes its own shards
        start = time.perf_counter()
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=f"{folder}/dcp-{dim}")
        dcp_s, dcp_bytes = time.perf_counter() - start, tensor_bytes((model_state, optim_state))
        rows.append({"dim": dim, "full_s": full_s, "full_bytes": full_bytes, "dcp_s": dcp_s,
                     "dcp_bytes": dcp_bytes})
    return rows


with tempfile.TemporaryDirectory() as folder:
    costs = launch(save_costs, folder, [64, 128, 256, 384], world_size=4, timeout=240)
for dim_rows in zip(*costs):
    r0 = dim_rows[0]
    print(f"dim {r0['dim']:3d}: rank 0 holds {r0['full_bytes'] / 2**20:6.1f} MiB to torch.save "
          f"({max(r['full_s'] for r in dim_rows):.2f} s); with DCP the busiest rank holds "
          f"{max(r['dcp_bytes'] for r in dim_rows) / 2**20:5.1f} MiB "
          f"({max(r['dcp_s'] for r in dim_rows):.2f} s)")

# %%
import matplotlib.pyplot as plt

dims = [r["dim"] for r in costs[0]]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
ax1.plot(dims, [r["full_bytes"] / 2**20 for r in costs[0]], "o-",
         label="rank 0: gather + torch.save")
ax1.plot(dims, [max(c[i]["dcp_bytes"] for c in costs) / 2**20 for i in range(len(dims))], "s-",
         label="busiest rank: DCP")
ax1.set(xlabel="model width (dim)", ylabel="checkpoint state held (MiB)",
        title="Memory: one rank holds everything")
ax2.plot(dims, [max(c[i]["full_s"] for c in costs) for i in range(len(dims))], "o-",
         label="gather + torch.save")
ax2.plot(dims, [max(c[i]["dcp_s"] for c in costs) for i in range(len(dims))], "s-",
         label="dcp.save")
ax2.set(xlabel="model width (dim)", ylabel="seconds", title="Time on 4 ranks (CPU, gloo)")
for ax in (ax1, ax2):
    ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# Rank 0's memory grows with the *whole* model, three times over with AdamW (parameters plus
# two moments), while each DCP rank holds only its quarter. The times on one laptop say little:
# the four ranks share one disk and a couple of cores, and at these sizes DCP's collective
# planning (every rank sends its plan to rank 0 and gets its final plan back) can cost more
# than the write itself, so DCP may well come out slower here. On a cluster each node writes
# to a parallel filesystem at its own bandwidth: DCP's write is spread over every node, while
# the rank-0 save pushes all bytes through one process and one network link.
# `benchmarks/dcp_save_load.py` measures save, load and peak memory side by side.
#
# ## 2. What DCP writes
#
# [`dcp.save(state_dict, checkpoint_id=folder)`](https://pytorch.org/docs/stable/distributed.checkpoint.html#torch.distributed.checkpoint.state_dict_saver.save)
# is called on every rank. Each rank writes the pieces it owns to its own file
# (`__{rank}_0.distcp`); rank 0 then writes `.metadata`, a map from every global tensor to its
# pieces: each piece's offset and size in the global tensor, and which file, at which byte
# offset, holds it. Replicated values (a DDP model, the same step number on every rank) are
# written once. Let us save an FSDP2 model on 4 ranks and read the map.

# %%
def save_fsdp_model(folder: str) -> None:
    model = shard_model(make_model())
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=folder)


layout_dir = tempfile.mkdtemp(prefix="dcp-layout-")
launch(save_fsdp_model, layout_dir, world_size=4)
for name in sorted(os.listdir(layout_dir)):
    print(f"{name:14s} {os.path.getsize(os.path.join(layout_dir, name)):7,d} bytes")
metadata = dcp.FileSystemReader(layout_dir).read_metadata()
tok = metadata.state_dict_metadata["model.tok.weight"]
print("\nmodel.tok.weight", tuple(tok.size), "is stored as", len(tok.chunks), "pieces:")
for chunk in tok.chunks:
    where = next(info for index, info in metadata.storage_data.items()
                 if index.fqn == "model.tok.weight" and tuple(index.offset) == tuple(chunk.offsets))
    print(f"  rows {chunk.offsets[0]:2d}..{chunk.offsets[0] + chunk.sizes[0]:2d} -> "
          f"{where.relative_path}, bytes {where.offset}..{where.offset + where.length}")

# %% [markdown]
# At load time every rank says which pieces *it* needs (its own shards, for its own world size
# and sharding), the planner intersects those requests with the map, and each rank reads only
# the byte ranges that overlap. That is why a checkpoint saved on 4 ranks loads on 2, or on 3,
# or into an unsharded model: the saver never needs to know the loader's layout. Here is the
# whole flow, with the pieces of `model.tok.weight` saved above and the rows FSDP2 gives each
# of 3 loading ranks (it splits dimension 0 as `torch.chunk` does):

# %%
from kit.lessons import figures

saved = sorted((chunk.offsets[0], chunk.sizes[0]) for chunk in tok.chunks)  # (first row, rows)
loaded = [(int(rows[0]), len(rows)) for rows in torch.arange(tok.size[0]).chunk(3)]
figures.dcp_flow(saved, loaded, tok.size[0], name="model.tok.weight")
plt.show()

# %% [markdown]
# ## 3. Task 6.1: sharded save and load, by hand
#
# Build DCP's core idea for 1-D tensors.
#
# - `save_shards(ckpt_dir, name, local, offset, global_numel)` runs on every rank, each with its
#   piece `local` of a tensor of `global_numel` elements, starting at `offset`. Pieces have any
#   sizes, empty ones included. Write this rank's piece to a file of its own, plus metadata from
#   which a loader finds every piece (gather the offsets, or encode them in file names).
#   Several tensors (different `name`s) share one folder.
# - `load_shards(ckpt_dir, name, offset, numel)` returns elements `[offset, offset + numel)`,
#   with the saved dtype, and uses no collectives.
#
# The checks save on 1 to 4 ranks with uneven splits and load other uneven splits. An
# [audit hook](https://docs.python.org/3/library/sys.html#sys.addaudithook) inside the ranks
# records every file each load opens: only the metadata and the pieces that overlap the range
# are allowed. `/proc/self/io` counts the bytes each load reads.


# %% tags=["task-6.1"]
def save_shards(ckpt_dir: str, name: str, local: torch.Tensor, offset: int,
                global_numel: int) -> None:
    """Save this rank's piece of a 1-D tensor to its own file, and metadata finding every piece.

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
    """Return elements [offset, offset + numel) of a saved tensor, opening only overlapping pieces.

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


# %% [markdown]
# ## 4. Loading onto another world size
#
# With real DCP, resharding needs nothing from you: load into a state dict shaped for the new
# layout and the planner does the intersections you just wrote. A checkpoint of an FSDP2 model
# saved on 4 ranks (`layout_dir`, above) loads onto 2 ranks, and onto 3, where 32 rows do not
# split evenly:

# %%
from torch.distributed.checkpoint.state_dict import set_model_state_dict


def load_fsdp_model(folder: str) -> dict:
    model = shard_model(make_model())
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # prove the values come from the checkpoint
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state["model"])
    return full_parameters(model)


reference = make_model().state_dict()
for world_size in (2, 3):
    loaded = launch(load_fsdp_model, layout_dir, world_size=world_size)[0]
    print(f"saved on 4, loaded on {world_size}: equal to the saved model:",
          all(torch.equal(loaded[k], reference[k]) for k in loaded))

# %% [markdown]
# ## 5. State-dict APIs: the same code for DDP and FSDP2
#
# `model.state_dict()` depends on the wrapper: DDP prefixes every key with `module.`, FSDP2
# returns [DTensors](https://pytorch.org/docs/stable/distributed.tensor.html) (sharded), and
# `optimizer.state_dict()` names parameters by their position, not their name. The
# [`torch.distributed.checkpoint.state_dict`](https://pytorch.org/docs/stable/distributed.checkpoint.html#torch.distributed.checkpoint.state_dict.get_state_dict)
# functions hide all three: `get_state_dict(model, optimizer)` returns the model's and the
# optimizer's state keyed by parameter names (FQNs) without wrapper prefixes, and
# `set_state_dict` puts them back. `StateDictOptions` picks the form: `full_state_dict=True`
# gathers unsharded tensors (on every rank), `cpu_offload=True` moves the tensors to CPU, and
# the two together keep the gathered state on rank 0 only (the other ranks get an empty dict,
# so that W full copies do not fill the host's memory); `strict=False` tolerates missing
# keys, `broadcast_from_rank0=True` loads a full state dict that only rank 0 read.

# %%
def state_dict_keys(kind: str) -> dict:
    model = DDP(make_model()) if kind == "DDP" else shard_model(make_model())
    optimizer = make_optimizer(model)
    model_state, optim_state = get_state_dict(model, optimizer)
    first = next(iter(model_state))
    return {"model.state_dict()": next(iter(model.state_dict())),
            "optimizer.state_dict() names params by": type(next(iter(
                optimizer.state_dict()["param_groups"][0]["params"]))).__name__,
            "get_state_dict": f"{first} ({type(model_state[first]).__name__})",
            "optimizer state (fresh optimizer)": f"{len(optim_state['state'])} entries, e.g. "
                                                 f"{sorted(optim_state['state'][first])}"}


for kind in ("DDP", "FSDP2"):
    print(kind, launch(state_dict_keys, kind, world_size=2)[0])

# %% [markdown]
# Note the last line: on a *fresh* optimizer, `get_state_dict` creates AdamW's state, so that
# `dcp.load` has tensors of the right shapes to load into; `optimizer.state_dict()` of a fresh
# optimizer has no state at all, and a checkpoint loaded into it restores none. It creates
# the state by running one `optimizer.step()` with zero gradients and the learning rate set
# to 0 (`_init_optim_state` in `torch/distributed/checkpoint/state_dict.py`): the parameters
# do not move, but the optimizer has changed. Its moments are zeros and its `step` counter
# is 1, so the next real step uses Adam's bias correction for step 2. That is harmless
# before a load, which overwrites the state; before training from scratch, call
# `get_state_dict` after the first step, or not at all.
#
# ## 6. Everything else a resume needs: `Stateful`
#
# A bit-identical resume needs more than weights: the step counter, the position in the data
# (the sampler's epoch and how far into it), every random number generator that anything
# draws from (dropout uses torch's, augmentation often Python's `random` or NumPy's), and the
# loss scaler's scale. DCP saves any object that implements the
# [`Stateful`](https://pytorch.org/docs/stable/distributed.checkpoint.html#torch.distributed.checkpoint.stateful.Stateful)
# protocol: `dcp.save` calls its `state_dict()`; `dcp.load` calls `state_dict()` for a
# template, loads into it in place, then calls `load_state_dict()` with the result.
#
# One trap: RNG states and sampler positions differ per rank, and DCP treats a key that every
# rank saves as *one* value. Tensors and objects under a shared key are written once (by one
# rank), and every rank loads that copy:

# %%
def same_key_on_every_rank(folder: str) -> list:
    rank = dist.get_rank()
    dcp.save({"rng": torch.full((3,), float(rank)), "position": {"value": rank}},
             checkpoint_id=folder)
    back = {"rng": torch.zeros(3), "position": {"value": -1}}
    dcp.load(back, checkpoint_id=folder)
    return [back["rng"][0].item(), back["position"]["value"]]


with tempfile.TemporaryDirectory() as folder:
    print("each rank saved its rank, then loaded:",
          launch(same_key_on_every_rank, folder, world_size=3))

# %% [markdown]
# Every rank got one rank's values back. Put per-rank state under a key that names the rank
# (`f"rank{dist.get_rank()}"`).
#
# ## 7. Task 6.2: `TrainingState`
#
# Write `TrainingState(model, optimizer, sampler, scaler=None)`, a `Stateful` whose
# `state_dict()` and `load_state_dict()` cover:
#
# - model and optimizer, through `get_state_dict` / `set_state_dict` (DDP and FSDP2 alike);
# - `step`, the counter `train_step` advances;
# - this rank's torch (`torch.get_rng_state`), Python (`random.getstate`) and NumPy
#   (`np.random.get_state`) RNG states;
# - the sampler's `epoch` and `position` (restore with `set_epoch`, which resets the position,
#   then set `position`);
# - the scaler's `state_dict()` when a `GradScaler` is given.
#
# One edge: a parameter that has had no gradient yet (an unused head, a branch the forward
# has not reached) has no AdamW state, but a fresh optimizer's template from `get_state_dict`
# has state for every trainable parameter, so in torch 2.13 `dcp.load` raises
# `RuntimeError: Missing key in checkpoint state_dict: train.optim.state.<name>.step`. Save,
# for each such parameter, the state AdamW would start it with (zeros shaped like the
# parameter, step 0): loading that is the same as the optimizer creating it at the first
# gradient.
#
# The checks train k = 8 steps on 2 ranks (epoch 1, mid-epoch), `dcp.save({"train": state})`,
# start a *fresh* launch whose RNGs are seeded differently, `dcp.load`, train 3 more steps,
# and compare with 11 straight steps bit for bit: parameters, losses and every piece of state
# right after the load. Once with DDP and a `GradScaler`, once with FSDP2, once with FSDP2 and
# an unused head (2 steps, then 2; its shards on rank 1 are empty). Then an FSDP2
# checkpoint saved on 4 ranks must load on 2.


# %% tags=["task-6.2"]
class TrainingState(Stateful):
    """Everything an exact resume needs, as one Stateful for dcp.save / dcp.load.

    Holds model (DDP or FSDP2), optimizer, sampler (a kit.lessons.resume.ResumableSampler: epoch and
    position), an optional GradScaler, and step (0 at construction; train_step adds 1).
    state_dict() returns model and optimizer state through get_state_dict, the step, this rank's
    torch, Python and NumPy RNG states and the sampler's epoch and position (and the scaler's
    state); load_state_dict() puts all of it back.

    At the edges: a parameter without a gradient so far (so without optimizer state) is saved
    with the state the optimizer starts it with (zeros, step 0), so that a fresh optimizer can
    load the checkpoint; an FSDP2 parameter smaller than the world size (empty shards) needs
    nothing of its own.
    """

    def __init__(self, model, optimizer, sampler, scaler=None):
        self.model, self.optimizer, self.sampler, self.scaler = model, optimizer, sampler, scaler
        self.step = 0

    def state_dict(self) -> dict:
        """Model and optimizer (get_state_dict), step, this rank's RNGs and sampler, scaler."""
        ### BEGIN SOLUTION
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        # A parameter without a gradient so far has no optimizer state, but a fresh optimizer's
        # template (get_state_dict initialises every trainable parameter's) asks for it: save
        # the state the optimizer would start it with (zeros, step 0), as AdamW creates lazily.
        have = optim_state["state"]
        like = next(iter(have.values()), None)
        for fqn in (f for group in optim_state["param_groups"] for f in group["params"]):
            if like is not None and fqn not in have and fqn in model_state:
                have[fqn] = {k: torch.zeros_like(v if v.dim() == 0 else model_state[fqn])
                             for k, v in like.items()}
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


# %% [markdown]
# ## 8. Saving without stopping training
#
# `dcp.save` blocks until every byte is written. [`dcp.async_save`](https://pytorch.org/docs/stable/distributed.checkpoint.html#torch.distributed.checkpoint.state_dict_saver.async_save)
# returns a `Future` as soon as the state is *staged*, copied into memory the checkpoint
# owns, and writes in a background thread while training continues (so with its default
# stager; a stager of your own changes what it returns, see "Running at scale"). Let us time
# how long each blocks the loop, on a model large enough for the write to matter:

# %%
def blocked_by_save(folder: str, dim: int) -> dict:
    torch.manual_seed(0)
    model = shard_model(DropoutTransformer(vocab=256, dim=dim, layers=4, heads=4, context=16))
    optimizer = make_optimizer(model)
    model(torch.randint(0, 256, (2, 16))).sum().backward()
    optimizer.step()
    group = dist.new_group(backend="gloo")  # the background save's own collectives
    times = {}
    for mode in ("save", "async_save"):
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dist.barrier()
        start = time.perf_counter()
        if mode == "save":
            dcp.save(state, checkpoint_id=f"{folder}/{mode}")
            times[mode] = {"blocked": time.perf_counter() - start}
        else:
            future = dcp.async_save(state, checkpoint_id=f"{folder}/{mode}", process_group=group)
            blocked = time.perf_counter() - start
            future.result()
            times[mode] = {"blocked": blocked, "until written": time.perf_counter() - start}
    return times


with tempfile.TemporaryDirectory() as folder:
    blocked = launch(blocked_by_save, folder, 256, world_size=2)[0]
print(blocked)
fig, ax = plt.subplots(figsize=(8, 1.8))
ax.barh(["dcp.save"], [blocked["save"]["blocked"]], color="C3", label="training blocked")
ax.barh(["dcp.async_save"], [blocked["async_save"]["blocked"]], color="C3")
ax.barh(["dcp.async_save"],
        [blocked["async_save"]["until written"] - blocked["async_save"]["blocked"]],
        left=[blocked["async_save"]["blocked"]], color="C2", label="writing in the background")
ax.set(xlabel="seconds after the save starts (rank 0)")
ax.legend(loc="lower right")
plt.tight_layout()
plt.show()

# %% [markdown]
# What that costs, and what to get right:
#
# - **Staging copies.** `async_save` calls the `Stateful`s' `state_dict()` and copies every
#   tensor before it returns; the loop may then change the parameters in place and the
#   checkpoint still holds the values of the moment of the call (checked below). The copy
#   doubles the state's memory while a save is in flight, so keep **at most one save in
#   flight**: call the previous future's `.result()` before starting the next. (Two saves in
#   flight on one group also run their collectives from two threads at once; in this course's
#   checks, a loop that never waits hung until its timeout.)
# - **A CPU backend.** The background thread runs the save's collectives on the process group
#   you pass. `async_save` refuses a group without a CPU backend (in torch 2.13 it raises
#   `AssertionError: A CPU backend must be enabled for async save; try initializing process
#   group with 'cpu:gloo,cuda:nccl'`). On CPU, gloo is that backend.
# - **Its own group.** The save's collectives run in another thread while training runs its
#   own; on one shared group the two streams of collectives could interleave differently on
#   different ranks. Create a group for checkpointing once and pass it as `process_group=`
#   (on CPU: `dist.new_group(backend="gloo")`).

# %%
def change_while_saving(folder: str) -> list:
    weights = torch.ones(1000)
    future = dcp.async_save({"w": weights}, checkpoint_id=folder,
                            process_group=dist.new_group(backend="gloo"))
    weights.mul_(0)  # the next optimizer step, at once
    future.result()
    back = {"w": torch.full((1000,), -1.0)}
    dcp.load(back, checkpoint_id=folder)
    return back["w"].unique().tolist()


with tempfile.TemporaryDirectory() as folder:
    print("values in the checkpoint after an in-place change during async_save:",
          launch(change_while_saving, folder, world_size=2)[0])

# %% [markdown]
# ### Atomic commits: `.metadata` is written last
#
# A save can die halfway: a rank is killed, a node fails, the job hits its time limit. A
# checkpoint therefore only counts once it is *complete*, and DCP gives you the marker: rank 0
# writes `.metadata` after every rank has reported its files written, into `.metadata.tmp`
# first (fsynced), then renames it into place (`_FileSystemWriter.finish` in
# [`torch/distributed/checkpoint/filesystem.py`](https://github.com/pytorch/pytorch/blob/main/torch/distributed/checkpoint/filesystem.py)).
# A rename is atomic on POSIX filesystems: a folder either has a complete `.metadata` or none.
# So: one folder per checkpoint, named by its step; resume from the highest step whose folder
# holds `.metadata`; never save into a folder that holds a complete checkpoint (the new
# data files would overwrite the old before the old `.metadata` is replaced). And do not
# order checkpoints by modification time: copies, restores from backup and coarse filesystem
# clocks reorder mtimes, while the step in the name is exact.
#
# ## 9. Task 6.3: `train_with_checkpoints`
#
# Write `train_with_checkpoints(ckpt_root, total_steps, every)`, run on every rank:
#
# 1. `seed_everything(0)`; build `state = TrainingState(model, optimizer, sampler)` with
#    `model = shard_model(make_model())`, `make_optimizer(model)` and `make_sampler()`;
# 2. if `ckpt_root` holds complete checkpoints (`step-NNNNNN` folders with `.metadata`),
#    `dcp.load` the newest into `{"train": state}`;
# 3. call `train_step(state)` until `state.step == total_steps`; after each step where
#    `state.step % every == 0`, start `dcp.async_save` into `ckpt_root/step-{state.step:06d}`,
#    with at most one save in flight;
# 4. wait for the last save and return `full_parameters(model)`.
#
# The checks replace your `TrainingState` with a trusted one (so this task grades the loop
# alone). First under `launch`: an uninterrupted run, then a rerun after the newest checkpoint
# lost its `.metadata` and the folders' mtimes were shuffled. Then under real
# `torchrun --nproc-per-node=2 --max-restarts=2`: one rank is SIGKILLed in the middle of a save
# and another at a step picked from a secret seed; after both restarts the final parameters
# must equal an uninterrupted run's bit for bit, and each attempt must have resumed from the
# newest complete checkpoint.


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

    At the edges: with no complete checkpoint (ckpt_root empty, or not there yet: the saves
    create it) it starts at step 0; resumed at total_steps (the
    newest complete checkpoint is the last step's) it trains nothing, saves nothing and returns
    the loaded parameters.
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
            pending = dcp.async_save({"train": state},
                                     checkpoint_id=str(root / f"step-{state.step:06d}"),
                                     process_group=ckpt_group)
    if pending is not None:
        pending.result()
    return full_parameters(model)
    ### END SOLUTION


# %% tags=["check-6.3"]
check("6.3", train_with_checkpoints)


# %% [markdown]
# ## 10. A crash under `torchrun`, end to end
#
# The same function runs unchanged under `torchrun`. The script below is made from the
# notebook's cells; rank 1 kills itself with `SIGKILL` at step 5 of the first attempt, and
# `--max-restarts=1` lets the agent restart both workers, which resume from `step-000004`.

# %%
demo_dir = Path(tempfile.mkdtemp(prefix="dcp-torchrun-"))
script = write_script(
    demo_dir / "train.py",
    """
    import os, random, signal, sys
    from pathlib import Path
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful
    import kit.lessons.resume
    from kit.lessons.resume import (full_parameters, make_model, make_optimizer, make_sampler,
                                    seed_everything, shard_model)
    from kit.torchrun import init_process_group_per_attempt
    """,
    TrainingState,
    train_with_checkpoints,
    """
    if __name__ == "__main__":
        init_process_group_per_attempt("gloo")
        attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), dist.get_rank()
        root = Path(sys.argv[1])

        def train_step(state):  # rank 1 dies at step 5 of the first attempt
            if attempt == 0 and rank == 1 and state.step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            return kit.lessons.resume.train_step(state)

        if rank == 0:
            done = sorted(p.name for p in root.glob("step-*") if (p / ".metadata").exists())
            print(f"attempt {attempt}: complete checkpoints {done}", flush=True)
        params = train_with_checkpoints(str(root), 8, 2)
        if rank == 0:
            torch.save(params, root / "final.pt")
        dist.destroy_process_group()
    """,
)
try:
    result = torchrun(script, demo_dir / "ckpt", nproc_per_node=2, max_restarts=1,
                      env={"PYTHONPATH": os.getcwd()}, timeout=240, echo=False)
    # The survivor's traceback ("Connection reset by peer") is long; show the story only.
    for line in result.lines:
        if "attempt" in line or "exitcode" in line:
            print(line)
    print(f"torchrun finished in {result.wall_time:.1f} s")
except TorchrunError as e:
    print(e)

# %% [markdown]
# Did the crash change the result? Compare with an uninterrupted run of the same function:

# %%
with tempfile.TemporaryDirectory() as folder:
    uninterrupted = launch(train_with_checkpoints, folder, 8, 2, world_size=2)[0]
resumed = torch.load(demo_dir / "ckpt" / "final.pt", weights_only=True)
print("bit-identical after a SIGKILL and a restart:",
      all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted))

# %% [markdown]
# ## 11. From DCP to one file, and back
#
# For inference, export, or a colleague without a cluster, convert a DCP folder into one
# `torch.save` file in a single process with
# [`dcp_to_torch_save`](https://pytorch.org/docs/stable/distributed.checkpoint.html#torch.distributed.checkpoint.format_utils.dcp_to_torch_save)
# (no process group needed), and back with `torch_save_to_dcp`. The nesting of the file is the
# nesting you saved: here `{"train": {"model": ..., "optim": ..., "step": ..., "rank0": ...}}`.

# %%
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

dcp_to_torch_save(demo_dir / "ckpt" / "step-000008", demo_dir / "model.pt")
saved = torch.load(demo_dir / "model.pt", weights_only=False)  # also holds RNG states (objects)
print("top-level keys:", list(saved["train"]))
inference_model = make_model().eval()
inference_model.load_state_dict(saved["train"]["model"])
print("same weights as the run's final parameters:",
      all(torch.equal(v, resumed[k]) for k, v in inference_model.state_dict().items()))
with torch.no_grad():
    tokens = torch.randint(0, 32, (1, 15), generator=torch.Generator().manual_seed(0))
    print("next token after the prompt:", inference_model(tokens)[0, -1].argmax().item())
torch_save_to_dcp(demo_dir / "model.pt", demo_dir / "back-to-dcp")
print("back to DCP:", sorted(os.listdir(demo_dir / "back-to-dcp")))

# %% [markdown]
# ## Running at scale
#
# > The training function does not change on a GPU cluster; the process group does, and the
# > storage matters:
# >
# > ```python
# > # srun torchrun --nnodes=$SLURM_NNODES --nproc-per-node=8 --max-restarts=3 \
# > #      --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29500 train.py
# > dist.init_process_group("cpu:gloo,cuda:nccl")  # NCCL for training, gloo for CPU collectives
# > torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
# > ckpt_group = dist.new_group(backend="gloo")     # the background saves' own group
# > writer = dcp.FileSystemWriter(f"/lustre/run42/step-{step:06d}", thread_count=4)
# > future = dcp.async_save({"train": state}, storage_writer=writer, process_group=ckpt_group)
# > ```
# >
# > - **Storage layout.** One folder per checkpoint on a shared parallel filesystem (Lustre,
# >   GPFS, or an object store through `FsspecWriter`), written by every rank at once: the
# >   aggregate bandwidth grows with the number of nodes. Keep the last few folders and
# >   delete older ones only after a newer one is complete.
# > - **`FileSystemWriter` options.** `thread_count` writes several files per rank in parallel,
# >   `single_file_per_rank=True` (the default) keeps the file count at one per rank and
# >   thread, `sync_files=True` fsyncs before `.metadata` is written (keep it: without it a
# >   power loss can leave a "complete" checkpoint with missing bytes), `overwrite` refuses or
# >   allows an existing folder, `per_thread_copy_ahead` bounds the bytes each thread copies off
# >   the GPU ahead of writing.
# > - **Staging from GPU.** On GPUs `async_save` copies device tensors to host memory first.
# >   A stager of your own, `stager = DefaultStager(StagingOptions(use_pinned_memory=True, ...))`
# >   (`torch.distributed.checkpoint.staging`), keeps pinned buffers between saves so the copy
# >   runs at full PCIe speed, and with `use_async_staging=True` (its default) copies in a
# >   background thread too. `dcp.async_save(..., async_stager=stager)` then returns an
# >   `AsyncSaveResponse`, not a `Future`: wait on `response.staging_completion.result()`
# >   before the next optimizer step changes the parameters, and on
# >   `response.upload_completion.result()` where this lesson calls `.result()` (before the
# >   next save). The stager is yours: call `stager.close()` after the last save.
# >   `async_checkpointer_type=AsyncCheckpointerType.PROCESS` writes from a separate process
# >   instead of a thread.
# > - **How often to save.** A checkpoint costing δ seconds every τ seconds wastes δ/τ of the
# >   time; a failure, on average every M seconds (the job's mean time between failures,
# >   roughly one node's MTBF divided by the number of nodes), loses τ/2 of work plus the
# >   restart. Young's approximation minimises the sum at τ ≈ √(2δM) (Daly refines it for
# >   larger δ/M). Async saves shrink δ to the blocked time, so you can afford to save more
# >   often.

# %%
import numpy as np

cost_s, mtbf_h = 30.0, [24.0, 4.0, 1.0]
interval_min = np.linspace(2, 240, 400)
fig, ax = plt.subplots(figsize=(7, 3.4))
for m in mtbf_h:
    waste = cost_s / (interval_min * 60) + interval_min * 60 / (2 * m * 3600)
    best = np.sqrt(2 * cost_s * m * 3600) / 60
    ax.plot(interval_min, 100 * waste, label=f"MTBF {m:g} h: best every {best:.0f} min")
ax.set(xlabel="checkpoint interval (minutes)", ylabel="time lost (%)", ylim=(0, 25),
       title=f"Young's interval for a {cost_s:.0f} s checkpoint")
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Summary
#
# - Gathering the full state on rank 0 costs that rank memory for the whole model and
#   optimizer and serialises the write; DCP has every rank write its own pieces and a
#   `.metadata` map of where each piece lives.
# - Loading intersects what each rank needs with that map, so a checkpoint loads onto any
#   world size or sharding, reading only the overlapping pieces (Task 6.1).
# - `get_state_dict`/`set_state_dict` give wrapper-independent keys for DDP and FSDP2;
#   a `Stateful` carries the rest of an exact resume: step, per-rank RNG states under per-rank
#   keys, sampler epoch and position, scaler (Task 6.2).
# - `dcp.async_save` blocks only while staging; keep one save in flight, give it a gloo group
#   of its own, and treat a folder as a checkpoint only once `.metadata` exists. Choose the
#   newest by step, never by mtime (Task 6.3).
# - `dcp_to_torch_save` turns a DCP folder into one file for single-process use.
#
# **Read more:** [Distributed Checkpoint docs](https://pytorch.org/docs/stable/distributed.checkpoint.html),
# [Getting started with DCP](https://pytorch.org/tutorials/recipes/distributed_checkpoint_recipe.html),
# [Asynchronous saving with DCP](https://pytorch.org/tutorials/recipes/distributed_async_checkpoint_recipe.html),
# [torchrun](https://pytorch.org/docs/stable/elastic/run.html), J. W. Young, *A first order
# approximation to the optimum checkpoint interval* (CACM 1974) and J. T. Daly, *A higher
# order estimate of the optimum checkpoint interval for restart dumps* (FGCS 2006).
#
# ## Exercises (not graded)
#
# 1. Save `TrainingState` on 2 ranks and load it on 4. Which parts reshard, which do not
#    (`rank2`'s RNG state?), and what would a sensible policy for them be?
# 2. Give `save_shards` a `thread_count`: write each piece in chunks from several threads.
#    Does the save get faster on your machine? Why might it on a parallel filesystem?
# 3. Start two `async_save`s without waiting for the first. Watch the process's memory (RSS)
#    and explain what you see.
# 4. Measure δ (the blocked time) for `save` and `async_save` in section 8 at `dim=512`, then
#    compute Young's interval for both with an MTBF of 4 hours.
