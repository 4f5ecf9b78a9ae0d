"""Checks for Lesson 06, "Distributed Checkpoint": tasks 6.1 to 6.3.

Task 6.1 ``save_shards``/``load_shards`` saves 1-D tensors on 1 to 4 ranks with uneven pieces
(some empty) and loads other uneven splits: values must be exact, a load may open only the files
of the pieces it overlaps (seen by an audit hook on ``open`` inside the ranks) and may read no
more bytes than those pieces (``/proc/self/io``). Task 6.2 ``TrainingState`` must make k steps,
``dcp.save``, a fresh launch, ``dcp.load`` and N - k steps bit-identical to N straight steps of a
trusted loop, for DDP (with a GradScaler) and FSDP2, with dropout, three RNGs and a shuffling
sampler; an FSDP2 checkpoint of 4 ranks must load on 2. Task 6.3 ``train_with_checkpoints``
runs with the notebook's own TrainingState (Task 6.2's, its companion): under ``kit.launch``
with a half-written newest checkpoint and lying mtimes, then under torchrun's own elastic agent
(``kit.torchrun.elastic_run``: ``torchrun --standalone --max-restarts=2``'s agent and rendezvous,
forked, with forked workers) with one rank SIGKILLed mid-save and one at a step picked from the
seed; it must end bit-identical to an uninterrupted trusted run.

Each task's cases judge shared runs (the saves and loads of 6.1, the saves and resumes of 6.2,
6.3's launch and its torchrun run), each made once per implementation and seed; the trusted
answers (the values, the byte budgets, a reference TrainingState and the uninterrupted runs)
live in :mod:`autograder.references.lesson06`. 6.1 bounds the bytes each rank writes (the
kernel's count, ``/proc/self/io``): a sharded save writes each piece once, where it lies.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import tempfile
import threading
import types
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from autograder.compare import CheckFailed, assert_same
from autograder.registry import pickle_for_worker, task

# DDP's Dynamo, FSDP2's, DCP's and the lesson's modules, imported once before ranks fork (the
# elastic agent's workers are forked too, so they start with them).
PRELOAD = ("torch._dynamo", "torch.distributed.checkpoint",
           "torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp",
           "kit.lessons.resume",
           "torch.distributed.checkpoint._fsspec_filesystem")  # dcp.save/load import it lazily
# DCP's save and load entry points, new and old (deprecated aliases, the private functions under
# them, the checkpointer class, the torch.save converters): 6.1 builds them; 6.2's TrainingState
# is saved by the checks' dcp.save and must not save or load itself.
DCP_ENTRY_POINTS = tuple(f"torch.distributed.checkpoint.{name}" for name in (
    "save", "load", "async_save", "save_state_dict", "load_state_dict",
    "load_sharded_optimizer_state_dict", "state_dict_saver.save", "state_dict_saver.async_save",
    "state_dict_saver.save_state_dict", "state_dict_saver._save_state_dict",
    "state_dict_loader.load", "state_dict_loader.load_state_dict",
    "state_dict_loader._load_state_dict", "state_dict_loader._load_state_dict_from_keys",
    "_checkpointer._Checkpointer", "format_utils.dcp_to_torch_save",
    "format_utils.torch_save_to_dcp"))

# --------------------------------------------------------------------------- task 6.1

# Save layouts: piece sizes per rank (0 = an empty piece). Float pieces are large (tens of
# thousands of elements) so that reading one extra piece shows in the bytes read.
WEIGHT_NUMEL, STEPS_NUMEL = 100_000, 777
SAVE_SPLITS = {
    1: ([100_000], [777]),
    2: ([61_000, 39_000], [0, 777]),
    3: ([7, 69_993, 30_000], [300, 300, 177]),
    4: ([30_000, 0, 45_000, 25_000], [1, 500, 276, 0]),
}
# Load layouts: ranges per rank for W' = 1..4, with borders one element off the saved ones.
LOAD_SPLITS = {
    1: [100_000],
    2: [50_000, 50_000],
    3: [29_999, 31_002, 38_999],
    4: [1, 29_999, 45_001, 24_999],
}
STEPS_LOAD_SPLITS = {1: [777], 2: [301, 476], 3: [0, 600, 177], 4: [1, 299, 200, 277]}
# per piece file and for the metadata: headers, buffers (torch.load: ~20 KB)
BYTES_SLACK = 32 * 1024
# What a rank may write beyond its own pieces: each piece file's zip header and directory
# (torch.save: ~1.5 KiB), on rank 0 the metadata of the two tensors, and what the collectives
# send through gloo's sockets (the kernel counts those writes too): 16 KiB. The correct save
# writes at most 9 KiB beyond its pieces here (56% of the bound); rank 0 writing every piece
# writes 25x the bound (the 3-rank layout gives it 28 bytes of its own and 400 KB of others').
WRITE_SLACK = 16 * 1024


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(WEIGHT_NUMEL, generator=g),
            "steps": torch.randint(-2**40, 2**40, (STEPS_NUMEL,), generator=g)}


def _offsets(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def _load_jobs() -> list[tuple[int, str, int, int, str]]:
    """Every load the checks make: (saved on W ranks, tensor, offset, numel, purpose)."""
    jobs = []
    for w in SAVE_SPLITS:
        for splits, name in ((LOAD_SPLITS, "weight"), (STEPS_LOAD_SPLITS, "steps")):
            for sizes in splits.values():
                jobs += [(w, name, o, n, "split") for o, n in zip(_offsets(sizes), sizes)]
        # One element in the middle of each non-empty weight piece: which files does each need?
        sizes = SAVE_SPLITS[w][0]
        jobs += [(w, "weight", o + n // 2, 1, "probe") for o, n in zip(_offsets(sizes), sizes) if n]
    return jobs


# Audit hooks cannot be removed, so each rank installs one, once, and switches it with a flag.
_OPENED: list[str] | None = None
_HOOK_INSTALLED = False


def _install_audit_hook() -> None:
    global _HOOK_INSTALLED
    if _HOOK_INSTALLED:
        return

    # A closure, not a module-level function: the hard gates put a trampoline on every function
    # of autograder that refuses calls from student code, and an audit hook runs in the frame
    # of whatever code opened the file.
    def audit(event: str, args: tuple) -> None:
        if (_OPENED is not None and event == "open" and args
                and isinstance(args[0], (str, bytes, os.PathLike))):
            try:
                _OPENED.append(os.path.abspath(os.fsdecode(os.fspath(args[0]))))
            except (TypeError, ValueError):
                pass

    sys.addaudithook(audit)
    _HOOK_INSTALLED = True


def _io_count(field: str) -> int:
    """Bytes this process has passed to read() (``rchar``) or write() (``wchar``) so far, as the
    kernel counts them (Linux's /proc/self/io), or -1 where there is no such count."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:"))
    except (OSError, StopIteration, ValueError):
        return -1


def _bytes_read() -> int:
    return _io_count("rchar")


def _save_on_rank(save_shards: Any, root: str, seed: int) -> dict[str, int]:
    """Save this rank's pieces of both tensors; the bytes they hold and the bytes written
    meanwhile."""
    w, rank = dist.get_world_size(), dist.get_rank()
    tensors = _tensors(seed)
    pieces = {}
    for name, sizes in zip(("weight", "steps"), SAVE_SPLITS[w]):
        o, n = _offsets(sizes)[rank], sizes[rank]
        pieces[name] = (tensors[name][o:o + n].clone(), o, tensors[name].numel())
    own = sum(t.numel() * t.element_size() for t, _, _ in pieces.values())
    before = _io_count("wchar")
    for name, (piece, o, total) in pieces.items():
        save_shards(os.path.join(root, f"saved-on-{w}"), name, piece, o, total)
    after = _io_count("wchar")
    return {"own": own, "written": after - before if before >= 0 and after >= 0 else -1}


def _load_on_rank(load_shards: Any, root: str, jobs: list[tuple]) -> list[dict[str, Any]]:
    global _OPENED
    _install_audit_hook()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    load_shards(os.path.join(root, "saved-on-1"), "steps", 0, STEPS_NUMEL)  # warm up (imports)
    out = []
    for i, (w, name, offset, numel, _) in enumerate(jobs):
        if i % world_size != rank:
            continue
        folder = os.path.abspath(os.path.join(root, f"saved-on-{w}"))
        opened: list[str] = []
        before = _bytes_read()
        _OPENED = opened
        try:
            value = load_shards(folder, name, offset, numel)
        finally:
            _OPENED = None
        after = _bytes_read()
        files = sorted({os.path.relpath(p, folder) for p in opened
                        if p == folder or p.startswith(folder + os.sep)})
        out.append({"job": i, "value": value.detach().clone() if isinstance(value, torch.Tensor)
                    else f"<a {type(value).__name__}, not a tensor>",
                    "opened": files, "bytes": after - before if before >= 0 and after >= 0 else -1})
    return out


def _shards_run(save_shards: Any, seed: int) -> dict[str, Any]:
    """Save on 1, 2, 3 and 4 ranks, then every load of :func:`_load_jobs` on 4 ranks: the loads
    in job order, and per layout each rank's bytes held and written by its save."""
    from kit.launcher import run_ranks

    load_shards = SHARDS.companion(save_shards, "load_shards")
    if load_shards is None:
        raise CheckFailed("no load_shards function was found next to save_shards",
                          hint="Define load_shards(ckpt_dir, name, offset, numel) in the task's "
                               "cell.")
    jobs = _load_jobs()
    writes = {}
    with tempfile.TemporaryDirectory(prefix="kit-shards-") as root:
        for w in SAVE_SPLITS:
            writes[w] = list(run_ranks(_save_on_rank, (save_shards, root, seed), world_size=w,
                                       timeout=30.0, echo=False, preload=SHARDS.preload))
        per_rank = run_ranks(_load_on_rank, (load_shards, root, jobs), world_size=4, timeout=30.0,
                             echo=False, preload=SHARDS.preload)
    loads = sorted((r for rank in per_rank for r in rank), key=lambda r: r["job"])
    return {"loads": loads, "writes": writes}


def _written_beyond_own(run: dict[str, Any]) -> dict[str, Any]:
    """The write bound's ``pick``: per rank, the most it wrote beyond its own pieces in any layout
    (ranks without the kernel's count report nothing)."""
    beyond: dict[int, int] = {}
    for per_rank in run["writes"].values():
        for rank, save in enumerate(per_rank):
            if save["written"] >= 0:
                beyond[rank] = max(beyond.get(rank, 0), save["written"] - save["own"])
    return {"measured": beyond}


# bounds: the bytes each rank writes (/proc/self/io: the kernel's count, below Python); the
# bytes each load reads is bounded by a case of its own, against the pieces it overlaps.
SHARDS = task(
    "6.1", preload=PRELOAD,
    # All of DCP (its planners, storage writers and metadata too): the task is a sharded
    # checkpoint by hand, with torch.save and torch.load.
    forbidden=DCP_ENTRY_POINTS + ("torch.distributed.checkpoint",),
    hint="A sharded checkpoint: each rank writes only its own piece, and metadata records where "
         "every piece lies in the whole tensor, so a load on any number of ranks finds and reads "
         "just the pieces that overlap its range.",
    recipe="save_shards: create the folder; save a contiguous clone of this rank's piece, alone, "
           "to a file named after the tensor and the rank; gather every rank's file name, offset "
           "and size to rank 0 (or encode them in the file names), which writes the tensor's "
           "metadata (total size, dtype, the pieces) to a temporary file and renames it into "
           "place; end with a barrier, so that nobody loads before the metadata exists. "
           "load_shards: read the tensor's metadata, make an empty result of numel elements in "
           "the saved dtype, and for each piece work out where its range meets [offset, offset "
           "+ numel); skip a piece that does not meet it without opening its file, and copy the "
           "overlap of each other piece into place.",
)


# One set of launches (saves on 1 to 4 ranks, the loads on 4) serves every case of the task.
SHARDS_RUN = SHARDS.shared(_shards_run)


def _value_case(name: str, select: Callable[[tuple], bool], hint: str = "",
                recipe: str = "") -> None:
    jobs = _load_jobs()
    chosen = [i for i, job in enumerate(jobs) if select(job)]

    def values(run: dict[str, Any]) -> list[Any]:
        return [run["loads"][i]["value"] for i in chosen]

    def expect(seed: int) -> list[torch.Tensor]:
        return SHARDS.trusted("saved_slices")(seed, chosen)

    def compare(got: Any, expected: list[torch.Tensor]) -> None:
        for i, g, e in zip(chosen, got, expected):
            w, tname, offset, numel, _ = jobs[i]
            where = f"saved on {w} ranks, load_shards({tname!r}, offset={offset}, numel={numel})"
            if not isinstance(g, torch.Tensor):
                raise CheckFailed(f"{where} returned {g}", expected="a 1-D tensor", got=g)
            assert_same(g, e, rtol=0.0, atol=0.0, path=where)

    SHARDS.case(name, uses=SHARDS_RUN, pick=values, compare=compare, expect=expect, hint=hint,
                recipe=recipe)


_value_case("saved on 2 ranks, loaded on 2 ranks with another split: exact values",
            lambda j: j[0] == 2 and j[1] == "weight" and j[4] == "split" and j[3] in LOAD_SPLITS[2])
_value_case("saved on 4 ranks (one piece empty), loaded on 1, 2, 3 and 4 ranks with uneven "
            "splits whose borders are one element off the saved ones",
            lambda j: j[0] == 4 and j[1] == "weight" and j[4] == "split",
            hint="Borders are where off-by-one errors live: ranges are half-open, so a piece "
                 "and a range that only touch do not overlap.",
            recipe="The range [offset, offset + numel) and a piece [start, start + n) overlap on "
                   "[max(offset, start), min(offset + numel, start + n)) when that is not empty; "
                   "both ends are exclusive.")
_value_case("saved on 1 and on 3 ranks (a 7-element piece), loaded on 1 to 4 ranks",
            lambda j: j[0] in (1, 3) and j[1] == "weight" and j[4] == "split")
_value_case("an int64 tensor in the same folder, with empty pieces and empty ranges: its dtype "
            "and values", lambda j: j[1] == "steps",
            hint="Several tensors share one folder, and a load gives back the saved dtype, even "
                 "for an empty range.",
            recipe="Name each piece file and the metadata after the tensor; store the dtype in "
                   "the metadata and build the result in it (an empty range gives an empty "
                   "tensor of that dtype).")


def _probe_files(got: list[dict[str, Any]], jobs: list[tuple],
                 w: int) -> tuple[set[str], list[set[str]]]:
    """What loading one element of each non-empty piece opened: files common to all (metadata)
    and, per piece, the files only some loads opened (its own data)."""
    probes = [set(got[i]["opened"]) for i, j in enumerate(jobs) if j[0] == w and j[4] == "probe"]
    common = set.intersection(*probes) if probes else set()
    return common, [p - common for p in probes]


_OPENS_OTHERS = "a load opens the files of pieces outside its range"


def _opened_beyond(got: list[dict[str, Any]], jobs: list[tuple]) -> dict[int, set[str]]:
    """Per load (index), the files it opened that belong to pieces outside its range."""
    extra: dict[int, set[str]] = {}
    for w, sizes in ((w, s[0]) for w, s in SAVE_SPLITS.items()):
        pieces = [(o, n) for o, n in zip(_offsets(sizes), sizes) if n]
        common, own = _probe_files(got, jobs, w)
        if len(own) != len(pieces):
            continue
        everything = len(pieces) > 1 and not any(own)  # every load opened every file
        for i, (sw, _, offset, numel, _) in enumerate(jobs):
            if sw != w:
                continue
            if everything:
                overlapping = sum(max(offset, o) < min(offset + numel, o + n) for o, n in pieces)
                if overlapping < len(pieces):
                    extra[i] = set(got[i]["opened"])
                continue
            needed = set(common).union(*[own[k] for k, (o, n) in enumerate(pieces)
                                         if max(offset, o) < min(offset + numel, o + n)])
            if set(got[i]["opened"]) - needed:
                extra[i] = set(got[i]["opened"]) - needed
    return extra


def _compare_opened(got: Any, expected: Any) -> None:
    jobs = _load_jobs()
    for w, sizes in ((w, s[0]) for w, s in SAVE_SPLITS.items()):
        pieces = [(o, n) for o, n in zip(_offsets(sizes), sizes) if n]
        if len(pieces) < 2:
            continue
        common, own = _probe_files(got, jobs, w)
        for k, files in enumerate(own):
            o, n = pieces[k]
            if not files:
                raise CheckFailed(
                    f"saved on {w} ranks: loading one element of the piece [{o}, {o + n}) opened "
                    f"the same files as loading one element of any other piece: {sorted(common)}",
                    expected="each load opens the metadata and only the files of the pieces it "
                             "overlaps", got=sorted(common), cause=_OPENS_OTHERS,
                    hint="Where the pieces lie must be known without opening them: from the "
                         "metadata (or the file names) alone.",
                    recipe="Keep the offsets and sizes in the metadata, not only inside the piece "
                           "files; read the metadata first and open a piece's file only if the "
                           "piece intersects the requested range.")
            for m, other in enumerate(own):
                if m != k and files & other:
                    raise CheckFailed(
                        f"saved on {w} ranks: loads of one element in two different pieces both "
                        f"opened {sorted(files & other)}", expected="disjoint files per piece",
                        got=sorted(files & other), cause=_OPENS_OTHERS,
                        hint="Check the overlap test: a load must not open a neighbouring piece.",
                        recipe="A piece overlaps the range only when the larger of the two "
                               "starts is below the smaller of the two ends; ends are "
                               "exclusive, so touching is not overlapping.")
        for i, (sw, name, offset, numel, purpose) in enumerate(jobs):
            if sw != w or name != "weight" or purpose != "split":
                continue
            needed = set(common)
            for k, (o, n) in enumerate(pieces):
                if max(offset, o) < min(offset + numel, o + n):
                    needed |= own[k]
            extra = set(got[i]["opened"]) - needed
            if extra:
                raise CheckFailed(
                    f"saved on {w} ranks, load_shards('weight', offset={offset}, numel={numel}) "
                    f"opened {sorted(extra)}, which belong to pieces outside that range",
                    expected=sorted(needed), got=sorted(got[i]["opened"]), cause=_OPENS_OTHERS,
                    hint="Open only the pieces that overlap [offset, offset + numel).",
                    recipe="Before opening a piece's file, compute its overlap with the range "
                           "and skip the piece when the overlap is empty.")


SHARDS.case("a load opens only the metadata and the files of the pieces it overlaps (an audit "
            "hook sees every open)", uses=SHARDS_RUN, compare=_compare_opened, weight=2,
            pick=lambda run: [{"opened": r["opened"]} for r in run["loads"]], saving=True)


def _compare_bytes(got: Any, expected: list[int]) -> None:
    jobs = _load_jobs()
    beyond = _opened_beyond(got, jobs)
    for i, (job, g, allowed) in enumerate(zip(jobs, [r["bytes"] for r in got], expected)):
        if g < 0:  # no /proc/self/io here: the audit-hook case still grades the files opened
            continue
        if g > allowed:
            w, name, offset, numel, _ = job
            if i in beyond:  # the bytes of pieces it had no need to open
                raise CheckFailed(
                    f"saved on {w} ranks, load_shards({name!r}, offset={offset}, numel={numel}) "
                    f"read {g:,} bytes: it opened {sorted(beyond[i])}, files of pieces outside "
                    "that range",
                    expected=f"at most {allowed:,} bytes", got=f"{g:,} bytes", cause=_OPENS_OTHERS,
                    hint="Open only the pieces that overlap [offset, offset + numel): where they "
                         "lie comes from the metadata.")
            raise CheckFailed(
                f"saved on {w} ranks, load_shards({name!r}, offset={offset}, numel={numel}) read "
                f"{g:,} bytes, more than the pieces it overlaps plus {BYTES_SLACK // 1024} KiB "
                "per file for headers and metadata",
                expected=f"at most {allowed:,} bytes", got=f"{g:,} bytes",
                hint="A load should cost the pieces it needs, no more: torch.save of a view writes "
                     "the whole storage behind it.",
                recipe="Save a contiguous clone of the local piece, so that its file holds only "
                       "its own elements, and read only the pieces that overlap the range.")


SHARDS.case("no load reads more bytes than the pieces it overlaps (plus 32 KiB per file for "
            "headers and metadata; /proc/self/io)", uses=SHARDS_RUN, compare=_compare_bytes,
            expect="allowed_read_bytes", saving=True,
            pick=lambda run: [{"bytes": r["bytes"], "opened": r["opened"]} for r in run["loads"]])
SHARDS.bound(
    "bytes a rank writes beyond its own pieces",
    formula="16 KiB (each piece file's header, rank 0's metadata)",
    lost="a rank writes other ranks' pieces: a sharded save writes each piece once, on the rank "
         "that holds it, so that no rank writes (or holds) the whole tensor",
    hint="A sharded checkpoint scales because every rank writes only what it holds, in "
         "parallel; gathering the pieces to one rank makes that rank hold and write everything.",
    recipe="Let every rank torch.save its own piece to its own file; send to rank 0 only what "
           "the metadata needs (each piece's file name, offset and size), never the data.",
    expect="write_bound", uses=SHARDS_RUN, pick=_written_beyond_own)


# --------------------------------------------------------------------------- task 6.2

SAVE_AT, TOTAL = 8, 11  # 6 batches per epoch on 2 ranks: the save lands mid-epoch 1
SAVE_AT_4 = 3  # FSDP2 on 4 ranks, then loaded on 2


def _build(kind: str, state_cls: Any) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    from kit.lessons.resume import make_model, make_optimizer, make_sampler, shard_model

    if kind == "ddp":
        model = DistributedDataParallel(make_model())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    elif kind == "fsdp-unused":  # a head the forward never uses: no gradient, no AdamW state
        model = make_model()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model.unused = torch.nn.Linear(4, 1)  # (1, 4) and (1,): rank 1's shards are empty
        model, scaler = shard_model(model), None
    else:
        model, scaler = shard_model(make_model()), None
    return state_cls(model, make_optimizer(model), make_sampler(), scaler)


def _snapshot(state: Any) -> dict[str, Any]:
    """Everything a resume must restore, as plain data, taken right before the next step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from kit.lessons.resume import full_parameters

    optim = get_optimizer_state_dict(state.model, state.optimizer,
                                     options=StateDictOptions(full_state_dict=True))
    optim_tensors = {f"{fqn}.{k}": torch.as_tensor(v).detach().clone()
                     for fqn, per in optim["state"].items() for k, v in per.items()}
    py = random.getstate()
    np_state = np.random.get_state()
    scaler = getattr(state, "scaler", None)
    return {
        "step": int(getattr(state, "step", -1)),
        "params": full_parameters(state.model),
        "optimizer": optim_tensors,
        "sampler": [int(state.sampler.epoch), int(state.sampler.position)],
        "torch_rng": torch.get_rng_state(),
        "python_rng": torch.tensor([*py[1], -1 if py[2] is None else 1]),
        "numpy_rng": torch.from_numpy(np.array([*np_state[1], np_state[2]], dtype=np.int64)),
        "scaler": None if scaler is None else [float(scaler.get_scale()),
                                               int(scaler.state_dict()["_growth_tracker"])],
    }


def _save_on_rank_62(impl: Any, kind: str, seed: int, steps: int, ckpt: str) -> None:
    import torch.distributed.checkpoint as dcp

    from kit.lessons.resume import seed_everything, train_step

    seed_everything(seed)
    state = _build(kind, impl)
    for _ in range(steps):
        train_step(state)
    dcp.save({"train": state}, checkpoint_id=ckpt)


def _resume_on_rank(impl: Any, kind: str, seed: int, steps: int, ckpt: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from kit.lessons.resume import full_parameters, seed_everything, train_step

    seed_everything(seed + 1000)  # a fresh process draws other numbers until the load
    state = _build(kind, impl)
    dcp.load({"train": state}, checkpoint_id=ckpt)
    snap = _snapshot(state)
    losses = [train_step(state) for _ in range(steps)]
    return {"snapshot": snap, "losses": losses, "final": full_parameters(state.model)}


UNUSED_AT, UNUSED_MORE = 2, 2  # the unused head's run: steps before the save, after the load
_UNUSED = "a parameter without a gradient so far (an unused head; rank 1 holds empty shards)"


def _edge_error(e: BaseException, what: str) -> str:
    """An error of the unused-head run as one line (DCP wraps each rank's traceback)."""
    import re

    errors = re.findall(r"\w+(?:Error|Exception): [^\n]*", str(e))
    return f"{what} raised " + (errors[-1] if errors else f"{type(e).__name__}: {e}")[:300]


def _save_both(impl: Any, seed: int, root: str) -> str | None:
    from torch.distributed.checkpoint.api import CheckpointException

    for kind in ("ddp", "fsdp"):
        _save_on_rank_62(impl, kind, seed, SAVE_AT, os.path.join(root, kind))
    try:
        _save_on_rank_62(impl, "fsdp-unused", seed, UNUSED_AT, os.path.join(root, "unused"))
    except NotImplementedError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - its own case's finding
        return _edge_error(e, "dcp.save")
    return None


def _resume_all(impl: Any, seed: int, root: str, unused_error: str | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.api import CheckpointException

    out: dict[str, Any] = {kind: _resume_on_rank(impl, kind, seed, TOTAL - SAVE_AT,
                                                 os.path.join(root, kind))
                           for kind in ("ddp", "fsdp")}
    resharded = _resume_on_rank(impl, "fsdp", seed, 0, os.path.join(root, "fsdp4"))
    out["reshard"] = resharded["snapshot"]["params"]
    out["unused"] = unused_error
    if unused_error is None:
        try:
            resumed = _resume_on_rank(impl, "fsdp-unused", seed, UNUSED_MORE,
                                      os.path.join(root, "unused"))
            out["unused"] = {"losses": resumed["losses"], "final": resumed["final"]}
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - its own case's finding
            out["unused"] = _edge_error(e, "dcp.load")
    return out


def _resume_run(impl: Any, seed: int) -> list[dict[str, Any]]:
    """Save DDP and FSDP2 after SAVE_AT steps on 2 ranks (and FSDP2 with an unused head after
    UNUSED_AT) and FSDP2 after SAVE_AT_4 on 4 ranks, then resume all in one fresh 2-rank launch."""
    from kit.launcher import run_ranks

    options = {"timeout": 60.0, "echo": False, "preload": STATE.preload}
    with tempfile.TemporaryDirectory(prefix="kit-resume-") as root:
        unused_errors = run_ranks(_save_both, (impl, seed, root), world_size=2, **options)
        run_ranks(_save_on_rank_62, (impl, "fsdp", seed, SAVE_AT_4, os.path.join(root, "fsdp4")),
                  world_size=4, **options)
        unused_error = next((e for e in unused_errors if e), None)
        return list(run_ranks(_resume_all, (impl, seed, root, unused_error), world_size=2,
                              **options))


# bounds nothing: an exact resume is about what is saved, not how much; what each rank writes
# is dcp.save's own business (each rank writes its own shards), and 6.1 bounds it by hand.
STATE = task(
    "6.2", preload=PRELOAD,
    forbidden=DCP_ENTRY_POINTS,
    hint="An exact resume needs everything the next step reads: the weights and the optimizer's "
         "moments, the step, every random generator this rank draws from, and where the "
         "sampler is in its epoch. Random state differs per rank, so it must be saved per rank.",
    recipe="state_dict() holds the model and optimizer from DCP's get_state_dict, the step, and, "
           "under a key naming this rank, the torch, Python and NumPy generator states and the "
           "sampler's epoch and position (and the scaler's state when there is one). "
           "load_state_dict() hands the first two to set_state_dict and puts each other piece "
           "back where it came from.",
)

_SNAPSHOT_PARTS = [
    ("step", "the step counter", "Save self.step and set it back in load_state_dict."),
    ("params", "the model's parameters",
     "Put get_state_dict's model state in state_dict() and pass it to set_state_dict."),
    ("optimizer", "the optimizer's state (AdamW's exp_avg, exp_avg_sq and step)",
     "A fresh optimizer has no state to load into: optimizer.state_dict() of it is empty. "
     "get_state_dict(model, optimizer) initialises it and names it by parameter, for DDP and "
     "FSDP2 alike; give its optimizer half to set_state_dict."),
    ("sampler", "the sampler's [epoch, position]",
     "Save sampler.epoch and sampler.position; restore with set_epoch(epoch), then position "
     "(set_epoch resets it to 0)."),
    ("torch_rng", "torch's RNG state (dropout masks)",
     "Save torch.get_rng_state() (per rank) and restore it with torch.set_rng_state()."),
    ("python_rng", "Python's RNG state (the random crop)",
     "Save random.getstate() (per rank) and restore it with random.setstate()."),
    ("numpy_rng", "NumPy's RNG state (the token masking)",
     "Save np.random.get_state() (per rank) and restore it with np.random.set_state()."),
    ("scaler", "the GradScaler's [scale, growth tracker]",
     "When a scaler is given, save scaler.state_dict() and load it back."),
]


_ONE_KEY = "every rank loads one rank's random state"


def _whose(got: Any, per_rank: list[Any], rank: int) -> int | None:
    """The other rank whose saved value ``got`` is exactly, if any (tensors only)."""
    if not isinstance(got, torch.Tensor):
        return None
    for other, value in enumerate(per_rank):
        if other != rank and isinstance(value, torch.Tensor) and value.shape == got.shape \
                and value.dtype == got.dtype and torch.equal(value, got):
            return other
    return None


def _compare_resume(kind: str) -> Callable[[Any, Any], None]:
    steps = TOTAL - SAVE_AT

    def compare(got: Any, expected: Any) -> None:
        for rank, (g, e) in enumerate(zip(got, expected)):
            for part, what, hint in _SNAPSHOT_PARTS:
                try:
                    assert_same(g["snapshot"][part], e["snapshot"][part], rtol=0.0, atol=0.0)
                except CheckFailed as f:
                    owner = _whose(g["snapshot"][part], [x["snapshot"][part] for x in expected],
                                   rank)
                    if owner is not None:  # the state came back, but another rank's
                        raise CheckFailed(
                            f"rank {rank}: right after dcp.load, {what} is rank {owner}'s, not its "
                            "own: every rank was given one rank's state", expected=f"rank {rank}'s",
                            got=f"rank {owner}'s", cause=_ONE_KEY,
                            hint="Random state differs per rank: save it under a key that names "
                                 "the rank. DCP keeps one copy of a key every rank saves, so all "
                                 "ranks load the same one.") from None
                    raise CheckFailed(
                        f"rank {rank}: right after dcp.load, {what} is not what it was when the "
                        f"checkpoint was saved ({f.message})", expected=f.expected, got=f.got,
                        hint=hint, cause=f"{what} is not restored") from None
            assert_same(g["losses"], e["losses"], rtol=0.0, atol=0.0,
                        path=f"rank {rank}: losses of the {steps} resumed steps")
            assert_same(g["final"], e["final"], rtol=0.0, atol=0.0,
                        path=f"rank {rank}: parameters after {TOTAL} steps")

    return compare


# Three launches (saves on 2 and on 4 ranks, the resumes on 2) serve the task's three cases.
RESUME_RUN = STATE.shared(_resume_run)


def _resume_case(kind: str, label: str) -> None:
    STATE.case(f"{label}: {SAVE_AT} steps, dcp.save, a fresh launch, dcp.load and "
               f"{TOTAL - SAVE_AT} more steps equal {TOTAL} straight steps bit for bit (dropout, "
               "3 RNGs, a shuffling sampler)", uses=RESUME_RUN, pick=kind,
               compare=_compare_resume(kind), weight=2,
               expect=lambda seed: [r[kind] for r in STATE.trusted("straight_runs")(seed)[0]])


_resume_case("ddp", "DDP with a GradScaler on 2 ranks")
_resume_case("fsdp", "FSDP2 on 2 ranks")
STATE.case(f"FSDP2 saved on 4 ranks after {SAVE_AT_4} steps, loaded on 2: equal full parameters",
           uses=RESUME_RUN, pick="reshard",
           expect=lambda seed: [STATE.trusted("straight_runs")(seed)[1][0]["final"]] * 2,
           compare=lambda got, expected: assert_same(
               got, expected, rtol=0.0, atol=0.0, path="full parameters after loading on 2 ranks"),
           hint="get_state_dict gives FSDP2's DTensors, and DCP reshards them at load time: save "
                "those, not each rank's local shard.")


def _compare_unused(got: Any, expected: list[dict[str, Any]]) -> None:
    for rank, (g, e) in enumerate(zip(got, expected)):
        if isinstance(g, str):
            raise CheckFailed(
                f"{_UNUSED}: rank {rank}: {g}", expected="an exact resume", got=g,
                hint="A fresh optimizer's template (get_state_dict creates AdamW state for every "
                     "trainable parameter) asks for state that a parameter without a gradient so "
                     "far never had: save, for each such parameter, the state the optimizer starts "
                     "it with (zeros and step 0, shaped like the parameter).")
        assert_same(g["losses"], e["losses"], rtol=0.0, atol=0.0,
                    path=f"{_UNUSED}: rank {rank}: losses of the {UNUSED_MORE} resumed steps")
        assert_same(g["final"], e["final"], rtol=0.0, atol=0.0,
                    path=f"{_UNUSED}: rank {rank}: parameters after {UNUSED_AT + UNUSED_MORE} "
                         "steps")


STATE.case(f"FSDP2 on 2 ranks with an unused head (no gradient, so no optimizer state, at the "
           f"save; empty shards on rank 1): {UNUSED_AT} steps, dcp.save, a fresh launch, dcp.load "
           f"and {UNUSED_MORE} more steps equal straight steps", uses=RESUME_RUN, pick="unused",
           compare=_compare_unused, weight=0.5,
           expect=lambda seed: [r["unused"] for r in STATE.trusted("straight_runs")(seed)[0]])


# --------------------------------------------------------------------------- task 6.3

QUICK_FIRST, QUICK_TOTAL, EVERY = 6, 8, 2
RUN_TOTAL = 10


def _is_function(impl: Any) -> bool:
    return (isinstance(impl, types.FunctionType)
            and isinstance(getattr(impl, "__globals__", None), dict))


_NOT_A_FUNCTION = ("train_with_checkpoints must be a function that calls the setup's "
                   "train_step(state) once per step (the check watches those calls)")


_GATE_S = 3.0  # a save's handle completes by itself this long after it started


class _GatedSave(Future):
    """The handle the student's loop gets from ``dcp.async_save``.

    It completes once the real save has and the loop has waited on it (``result()`` or
    ``exception()``), or, for loops that wait some other way, ``_GATE_S`` seconds after the
    save started. So a loop that starts the next save without waiting always finds this one
    still in flight, however fast the machine writes: the check no longer depends on timing.
    """

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self._waited = threading.Event()

        def settle() -> None:
            try:
                value, error = inner.result(), None
            except BaseException as e:  # noqa: BLE001 - handed to the loop unchanged
                value, error = None, e
            self._waited.wait(_GATE_S)
            if error is not None:
                self.set_exception(error)
            else:
                self.set_result(value)

        threading.Thread(target=settle, name="kit-gated-save", daemon=True).start()

    def result(self, timeout: float | None = None) -> Any:
        self._waited.set()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._waited.set()
        return super().exception(timeout)


class _Watch:
    """What a rank's run did: steps started, saves started (and whether one was in flight),
    loads (and whether the folder held .metadata)."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.saves: list[str] = []
        self.overlapping = 0
        self.pending: Any = None
        self.loads: list[list[Any]] = []

    def install(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import state_dict_loader, state_dict_saver

        original_async, original_load = state_dict_saver.async_save, state_dict_loader.load

        def async_save(*args: Any, **kwargs: Any) -> Any:
            if self.pending is not None and not self.pending.done():
                self.overlapping += 1
                # Recorded; the real saves still run one at a time. Two in flight would issue
                # collectives on one gloo group from two threads, which can interleave
                # differently on each rank and hang the run instead of failing this case.
                try:
                    getattr(self.pending, "inner", self.pending).result()
                except BaseException:  # noqa: BLE001 - the loop sees it through its own handle
                    pass
            self.saves.append(_checkpoint_name(args, kwargs))
            response = original_async(*args, **kwargs)
            if isinstance(response, Future):
                self.pending = _GatedSave(response)
            else:  # an AsyncSaveResponse (a custom async_stager): watched as it is
                self.pending = getattr(response, "upload_completion", response)
                return response
            return self.pending

        def load(*args: Any, **kwargs: Any) -> Any:
            folder = _checkpoint_name(args, kwargs, full=True)
            complete = os.path.exists(os.path.join(folder, ".metadata"))
            self.loads.append([os.path.basename(folder), complete])
            if not complete:  # every rank sees the same folder, so every rank stops here alike
                raise RuntimeError(f"dcp.load({os.path.basename(folder)}): that folder has no "
                                   ".metadata, so its save never finished; resume from the newest "
                                   "folder that has one")
            return original_load(*args, **kwargs)

        for module in (dcp, state_dict_saver):
            module.async_save = async_save
        for module in (dcp, state_dict_loader):
            module.load = load

    def train_step(self, original: Callable[[Any], float],
                   before: Callable[[Any], None] = lambda s: None) -> Callable[[Any], float]:
        def train_step(state: Any) -> float:
            self.steps.append(int(state.step))
            before(state)
            return original(state)
        return train_step


def _checkpoint_name(args: tuple, kwargs: dict, full: bool = False) -> str:
    where = kwargs.get("checkpoint_id")
    if where is None and kwargs.get("storage_writer") is not None:
        where = getattr(kwargs["storage_writer"], "path", None)
    if where is None and kwargs.get("storage_reader") is not None:
        where = getattr(kwargs["storage_reader"], "path", None)
    where = os.fspath(where) if where is not None else "?"
    return where if full else os.path.basename(where)


def _prepared(impl: Any, watch: _Watch, before: Callable[[Any], None] = lambda s: None) -> Any:
    """Inside a rank: a watched train_step in place of the lesson's, in the namespace of ``impl``
    (so its helpers see it too) and in kit.lessons.resume. The loop keeps its own TrainingState."""
    from kit.lessons import resume

    step = watch.train_step(resume.train_step, before)
    impl.__globals__.update(train_step=step)
    resume.train_step = step
    return impl


def _complete_steps(root: str) -> list[int]:
    return sorted(int(p.name[5:]) for p in Path(root).glob("step-*")
                  if p.name[5:].isdigit() and (p / ".metadata").exists())


def _lie_about_mtimes(root: str) -> None:
    """Make older checkpoints look newer, as a restore from a backup or a copy without -p does."""
    folders = sorted(Path(root).glob("step-*"))
    for i, folder in enumerate(folders):
        t = 1_700_000_000 + 1000 * (len(folders) - i)
        for f in folder.iterdir():
            os.utime(f, (t, t))
        os.utime(folder, (t, t))


def _quick_on_rank(impl: Any, parent: str) -> dict[str, Any]:
    watch = _Watch()
    watch.install()
    fn = _prepared(impl, watch)
    # A first run: ckpt_root does not exist yet (DCP creates the step folders with parents).
    # A loop that needs it is told so by its own case; the rest runs once it exists.
    root, missing_root = os.path.join(parent, "ckpts"), None
    try:
        first = fn(root, QUICK_FIRST, EVERY)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - its own case's finding
        missing_root = f"{type(e).__name__}: {e}"[:300]
        if os.path.exists(root) or watch.steps:
            raise  # not a missing folder: the error is the run's
        dist.barrier()
        os.makedirs(root, exist_ok=True)
        first = fn(root, QUICK_FIRST, EVERY)
    done = watch.pending is None or watch.pending.done()
    complete = _complete_steps(root)
    dist.barrier()
    if dist.get_rank() == 0:  # the newest checkpoint loses its metadata; mtimes lie
        meta = Path(root) / f"step-{QUICK_FIRST:06d}" / ".metadata"
        if meta.exists():
            meta.unlink()
        _lie_about_mtimes(root)
    dist.barrier()
    resume_steps_from = len(watch.steps)
    second = fn(root, QUICK_TOTAL, EVERY)
    saves, loads = list(watch.saves), list(watch.loads)
    resumed_steps = watch.steps[resume_steps_from:]
    # After the last step: the newest complete checkpoint is step QUICK_TOTAL; a rerun to
    # QUICK_TOTAL loads it, trains nothing, saves nothing and returns the same parameters.
    steps_from, saves_from, loads_from = len(watch.steps), len(watch.saves), len(watch.loads)
    third = fn(root, QUICK_TOTAL, EVERY)
    return {"missing root": missing_root,
            "first": _plain_state(first), "complete": complete, "saves": saves,
            "overlapping": watch.overlapping, "done_at_return": done,
            "resumed_steps": resumed_steps, "loads": loads, "second": _plain_state(second),
            "finished": {"steps": watch.steps[steps_from:], "saves": watch.saves[saves_from:],
                         "loads": watch.loads[loads_from:], "params": _plain_state(third)}}


def _plain_state(params: Any) -> Any:
    if isinstance(params, dict) and all(isinstance(v, torch.Tensor) for v in params.values()):
        return {str(k): v.detach().clone() for k, v in params.items()}
    return f"<a {type(params).__name__}, not a dict of tensors>"


def _same_params(params: Any, expected: Any, who: str, path: str) -> None:
    """A rank's returned parameters (``_plain_state``'s: a str names what came back instead)
    equal the uninterrupted run's, bit for bit."""
    if isinstance(params, str):
        raise CheckFailed(f"{who} returned {params}", expected="a dict of tensors")
    assert_same(params, expected, rtol=0.0, atol=0.0, path=path)


def _quick_run(impl: Any, seed: int) -> list[dict[str, Any]]:
    """The loop on 2 ranks under kit.launch: a run, a half-written checkpoint, a resumed run."""
    from kit.launcher import run_ranks

    if not _is_function(impl):
        raise CheckFailed(_NOT_A_FUNCTION)
    if LOOP.companion(impl, "TrainingState") is None:
        raise CheckFailed(_NO_TRAINING_STATE)
    with tempfile.TemporaryDirectory(prefix="kit-ckpts-") as root:
        return list(run_ranks(_quick_on_rank, (impl, root), world_size=2, timeout=60.0,
                              echo=False, preload=LOOP.preload))


_NO_TRAINING_STATE = ("train_with_checkpoints runs with the notebook's own TrainingState (Task "
                      "6.2): define it in its cell first")


# bounds nothing beyond what its cases count: each async save in flight holds a staged CPU copy
# of the state, and "at most one in flight" is counted on dcp.async_save itself (the copies live
# on DCP's background thread, where the meter does not look).
# forbids nothing: the loop is made of dcp.async_save and dcp.load, which it must call; no
# library picks the newest complete checkpoint or keeps one save in flight.
LOOP = task(
    "6.3", preload=PRELOAD,
    hint="A checkpoint counts only once it is complete, and DCP writes its metadata last; the "
         "newest is the one with the highest step in its name, not the newest file on disk. At "
         "most one asynchronous save may be in flight. (The loop runs with your own "
         "TrainingState of Task 6.2: a resume can be exact only if it is.)",
    recipe="On start, look through ckpt_root's step folders, keep those whose metadata file "
           "exists, and load the one with the highest step number. In the loop, after every "
           "every-th step, wait for the previous save to finish, then start an asynchronous "
           "save (on a gloo group of its own) into the folder named after the step. Wait for the "
           "last save before returning.",
)

# One launch under kit.launch (three of the cases) and one torchrun run of three attempts (two).
QUICK_RUN = LOOP.shared(_quick_run)


def _uninterrupted(steps: int) -> Callable[[int], Any]:
    """The expectation: the trusted uninterrupted run's full parameters after ``steps`` steps."""
    return lambda seed: LOOP.trusted("uninterrupted_params")(seed)[steps]


def _compare_quick_first(got: Any, expected: Any) -> None:
    want = [EVERY * i for i in range(1, QUICK_FIRST // EVERY + 1)]
    for rank, g in enumerate(got):
        if isinstance(g["first"], str):
            raise CheckFailed(f"rank {rank} returned {g['first']}",
                              expected="full_parameters(model): a dict of tensors", got=g["first"])
        assert_same(g["first"], expected, rtol=0.0, atol=0.0,
                    path=f"rank {rank}: parameters after {QUICK_FIRST} steps")
        if g["complete"] != want:
            raise CheckFailed(f"after train_with_checkpoints(root, {QUICK_FIRST}, {EVERY}) the "
                              f"complete checkpoints are at steps {g['complete']}",
                              expected=[f"step-{s:06d}" for s in want],
                              got=[f"step-{s:06d}" for s in g["complete"]],
                              hint="Save after every every-th step into the folder named after "
                                   "that step (six digits), and wait for the last save.")


LOOP.case(f"an uninterrupted run on 2 ranks (launch) ends with the reference parameters and "
          f"complete checkpoints step-000002 .. step-{QUICK_FIRST:06d}", uses=QUICK_RUN,
          pick=lambda runs: [{"first": r["first"], "complete": r["complete"]} for r in runs],
          compare=_compare_quick_first, expect=_uninterrupted(QUICK_FIRST))


def _compare_missing_root(got: Any, expected: None) -> None:
    for rank, g in enumerate(got):
        if g["missing root"] is not None:
            raise CheckFailed(
                f"a first run (ckpt_root does not exist yet): rank {rank}'s "
                f"train_with_checkpoints raised {g['missing root']}",
                expected="a fresh start at step 0", got=g["missing root"],
                hint="On the very first run there is nothing to resume from, not even the folder: "
                     "a missing ckpt_root means no checkpoint (dcp.async_save creates the "
                     "folders it writes into).")


LOOP.case("a first run: ckpt_root does not exist yet, so it starts at step 0", uses=QUICK_RUN,
          compare=_compare_missing_root, weight=0.5, expect=lambda seed: None,
          pick=lambda runs: [{"missing root": r["missing root"]} for r in runs])


def _compare_async(got: Any, expected: Any) -> None:
    for rank, g in enumerate(got):
        if not g["saves"]:
            raise CheckFailed(f"rank {rank} never called dcp.async_save", expected="async saves",
                              got="none", hint="dcp.save blocks training; dcp.async_save returns "
                                               "a future at once.")
        if g["overlapping"]:
            raise CheckFailed(f"rank {rank} started {g['overlapping']} async save(s) while the "
                              "previous one was still running", expected="at most one in flight",
                              got=g["saves"], hint="Call .result() on the previous save's future "
                                                   "before starting the next.")
        if not g["done_at_return"]:
            raise CheckFailed(f"rank {rank} returned while its last save was still running",
                              expected="the last future waited for", got="still running",
                              hint="A process that exits mid-save leaves an incomplete checkpoint.")


LOOP.case("saves with dcp.async_save, at most one in flight, the last one finished on return",
          uses=QUICK_RUN, compare=_compare_async,
          pick=lambda runs: [{k: r[k] for k in ("saves", "overlapping", "done_at_return")}
                             for r in runs])


def _compare_quick_resume(got: Any, expected: Any) -> None:
    newest = QUICK_FIRST - EVERY
    for rank, g in enumerate(got):
        bad = [name for name, has_meta in g["loads"] if not has_meta]
        if bad:
            raise CheckFailed(f"rank {rank} loaded {bad[0]}, which has no .metadata: a "
                              "half-written checkpoint", expected=f"step-{newest:06d}", got=bad[0],
                              hint="A checkpoint is complete only once DCP has written .metadata "
                                   "(last, by rank 0): skip folders without it.")
        first = g["resumed_steps"][0] if g["resumed_steps"] else None
        if first != newest:
            raise CheckFailed(
                f"rank {rank}: with step-{QUICK_FIRST:06d} half-written (no .metadata) and the "
                f"folders' modification times shuffled, the rerun started at step {first}",
                expected=f"resume at step {newest} (the newest complete checkpoint)", got=first,
                hint="Order checkpoints by the step in their name, not by modification time: "
                     "copies, restores and coarse clocks reorder mtimes.")
        _same_params(g["second"], expected, f"rank {rank}",
                     f"rank {rank}: parameters after resuming and training to {QUICK_TOTAL}")


LOOP.case(f"with step-{QUICK_FIRST:06d} half-written and mtimes that lie, a rerun to "
          f"{QUICK_TOTAL} resumes from step-{QUICK_FIRST - EVERY:06d} and ends exactly as the "
          "reference", uses=QUICK_RUN, compare=_compare_quick_resume,
          pick=lambda runs: [{k: r[k] for k in ("loads", "resumed_steps", "second")} for r in runs],
          expect=_uninterrupted(QUICK_TOTAL), weight=2)


def _compare_finished(got: Any, expected: Any) -> None:
    where = (f"after the last step (the newest complete checkpoint is step-{QUICK_TOTAL:06d}, "
             f"total_steps={QUICK_TOTAL})")
    for rank, g in enumerate(got):
        f = g["finished"]
        if [name for name, _ in f["loads"]] != [f"step-{QUICK_TOTAL:06d}"]:
            loaded = [n for n, _ in f["loads"]] or "nothing"
            raise CheckFailed(f"{where}: rank {rank}'s rerun loaded {loaded}",
                              expected=f"step-{QUICK_TOTAL:06d}", got=f["loads"],
                              hint="Resume from the newest complete checkpoint, even when it is "
                                   "the last step's.")
        if f["steps"]:
            raise CheckFailed(
                f"{where}: rank {rank}'s rerun called train_step at steps {f['steps']}",
                expected="no step: the run is already done", got=f["steps"],
                hint="Test for the end before each step, not after it: a run resumed at "
                     "total_steps has nothing left to train.")
        if f["saves"]:
            raise CheckFailed(f"{where}: rank {rank}'s rerun saved {f['saves']}",
                              expected="no save", got=f["saves"],
                              hint="Save only after a step that was taken; never write into a "
                                   "folder that holds a complete checkpoint.")
        _same_params(f["params"], expected, f"{where}: rank {rank}",
                     f"{where}: rank {rank}'s parameters")


LOOP.case(f"after the last step: a rerun to {QUICK_TOTAL} with step-{QUICK_TOTAL:06d} complete "
          "loads it, trains and saves nothing, and returns the same parameters", uses=QUICK_RUN,
          compare=_compare_finished, pick=lambda runs: [{"finished": r["finished"]} for r in runs],
          expect=_uninterrupted(QUICK_TOTAL), weight=0.5)


# ---- under torchrun's elastic agent: two kills, three attempts

def _kill_plan(seed: int) -> dict[str, int]:
    """Secret from the seed: kill which rank during which save, then which at which step."""
    rng = random.Random(seed * 7919 + 6)
    save_step = rng.choice([4, 6])
    return {"save_victim": rng.randrange(2), "save_step": save_step,
            "step_victim": rng.randrange(2), "kill_step": save_step + 1 + rng.randrange(3)}


def torchrun_worker(workdir: str) -> None:
    """Inside a torchrun worker: run the pickled train_with_checkpoints with the kills of the
    plan; log steps, loads and the newest complete checkpoint at start; save final parameters."""
    import cloudpickle
    from torch.distributed.checkpoint import filesystem

    from kit.torchrun import init_process_group_per_attempt

    work = Path(workdir)
    plan = json.loads((work / "plan.json").read_text())
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_process_group_per_attempt("gloo")
    rank = dist.get_rank()
    root = str(work / "ckpt")
    if rank == 0:
        if attempt > 0:
            _lie_about_mtimes(root)
        _write_json(work / f"start-attempt{attempt}.json", _complete_steps(root))
    dist.barrier()
    impl = cloudpickle.loads((work / "impl.pkl").read_bytes())
    watch = _Watch()
    watch.install()

    def kill() -> None:
        _log(work, rank, attempt, watch)
        os.kill(os.getpid(), signal.SIGKILL)  # a hard crash: no Python cleanup at all

    if attempt == 0 and rank == plan["save_victim"]:
        original_write = filesystem._FileSystemWriter.write_data

        def write_data(self: Any, *args: Any, **kwargs: Any) -> Any:
            future = original_write(self, *args, **kwargs)
            if os.path.basename(os.fspath(self.path)) == f"step-{plan['save_step']:06d}":
                future.wait()  # this rank's data is on disk; .metadata never will be
                kill()
            return future

        filesystem._FileSystemWriter.write_data = write_data

    def before(state: Any) -> None:
        if attempt == 1 and rank == plan["step_victim"] and state.step == plan["kill_step"]:
            kill()

    fn = _prepared(impl, watch, before)
    try:
        params = _plain_state(fn(root, RUN_TOTAL, EVERY))
    finally:
        _log(work, rank, attempt, watch)
    torch.save(params, work / f"params-rank{rank}.pt")
    dist.destroy_process_group()


def _log(work: Path, rank: int, attempt: int, watch: _Watch) -> None:
    _write_json(work / f"log-rank{rank}-attempt{attempt}.json",
                {"steps": watch.steps, "loads": watch.loads})


def _write_json(path: Path, data: Any) -> None:
    """Whole or not at all: the agent may stop a worker in the middle of the write (a rank that
    wrote half its log made the parent's json.loads fail on a loaded machine)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _torchrun_run(impl: Any, seed: int) -> dict[str, Any]:
    """The loop under torchrun --max-restarts=2 with the seed's two kills: each attempt's log and
    the final parameters of both ranks."""
    from kit.torchrun import TorchrunError, elastic_run

    QUICK_RUN(impl, seed)  # a stub or a crash is reported from there, without torchrun
    plan = _kill_plan(seed)
    with tempfile.TemporaryDirectory(prefix="kit-torchrun-") as tmp:
        work = Path(tmp)
        (work / "ckpt").mkdir()
        (work / "plan.json").write_text(json.dumps(plan))
        (work / "impl.pkl").write_bytes(pickle_for_worker(impl))
        result: dict[str, Any] = {"error": None}
        try:
            # torchrun's own agent and restart policy, forked from this process (no new Python)
            elastic_run(torchrun_worker, str(work), nproc_per_node=2, max_restarts=2, timeout=150.0)
        except TorchrunError as e:
            result["error"] = "torchrun failed:\n" + (e.summary or e.output[-2000:])
        result["attempts"] = []
        for attempt in range(3):
            start = work / f"start-attempt{attempt}.json"
            if not start.exists():
                break
            logs = {}
            for rank in range(2):
                log = work / f"log-rank{rank}-attempt{attempt}.json"
                logs[rank] = (json.loads(log.read_text()) if log.exists()
                              else {"steps": [], "loads": []})
            result["attempts"].append({"complete_at_start": json.loads(start.read_text()),
                                       "logs": logs})
        params = [work / f"params-rank{r}.pt" for r in range(2)]
        result["params"] = ([torch.load(p, weights_only=True) for p in params]
                            if result["error"] is None and all(p.exists() for p in params)
                            else None)
    return result


TORCHRUN_RUN = LOOP.shared(_torchrun_run)


def _compare_torchrun_params(got: Any, expected: Any) -> None:
    if got["error"]:
        raise CheckFailed(got["error"])
    if len(got["attempts"]) < 3:
        raise CheckFailed(f"torchrun ran {len(got['attempts'])} attempt(s), expected 3 (two kills)",
                          expected=3, got=len(got["attempts"]))
    for rank, params in enumerate(got["params"]):
        _same_params(params, expected, f"rank {rank}",
                     f"rank {rank}: final parameters after two kills")


LOOP.case("under torchrun's elastic agent, 2 workers, --max-restarts=2: a rank SIGKILLed in the "
          "middle of a save, then one at a secret step; the final parameters equal an "
          "uninterrupted run's bit for bit", uses=TORCHRUN_RUN, compare=_compare_torchrun_params,
          expect=_uninterrupted(RUN_TOTAL), weight=2)


def _compare_torchrun_resumes(got: Any, expected: Any) -> None:
    if len(got["attempts"]) < 2:
        raise CheckFailed(got["error"] or "torchrun never restarted the workers")
    for attempt, a in enumerate(got["attempts"]):
        complete = a["complete_at_start"]
        newest = complete[-1] if complete else 0
        for rank, log in a["logs"].items():
            bad = [name for name, has_meta in log["loads"] if not has_meta]
            if bad:
                raise CheckFailed(f"attempt {attempt}, rank {rank} loaded {bad[0]}, which had no "
                                  ".metadata: an incomplete checkpoint",
                                  expected=f"step-{newest:06d}", got=bad[0],
                                  hint="Skip folders without .metadata.")
            if log["steps"] and log["steps"][0] != newest:
                raise CheckFailed(
                    f"attempt {attempt}, rank {rank} started training at step {log['steps'][0]}, "
                    f"but the newest complete checkpoint then was step {newest}",
                    expected=newest, got=log["steps"][0],
                    hint="Resume from the highest step whose folder holds .metadata; the folders' "
                         "modification times are not the steps.")
    if got["error"]:
        raise CheckFailed(got["error"])


LOOP.case("under torchrun: every attempt resumed from the newest complete checkpoint and "
          "never loaded an incomplete one", uses=TORCHRUN_RUN, compare=_compare_torchrun_resumes,
          pick=lambda run: {"error": run["error"], "attempts": run["attempts"]})
