"""Sharded DCP save/load against rank-0 torch.save/torch.load, and the training time async_save
blocks.

    .venv/bin/python benchmarks/dcp_save_load.py                 # about 1-2 minutes on 2 cores
    .venv/bin/python benchmarks/dcp_save_load.py --dims 128 512 --repeats 3

Lesson 06 claims that gathering the full state on rank 0 costs that rank memory for everything
and serialises the write, while DCP has every rank write (and read) only its own shards. On 4
ranks of an FSDP2 transformer with AdamW state, at each model width, in one launch and
alternating the two ways, this measures:

* **save**: rank 0 gathers ``get_state_dict(..., full_state_dict=True, cpu_offload=True)`` and
  ``torch.save``s one file, against ``dcp.save`` of the sharded state dicts;
* **load**: rank 0 ``torch.load``s the file and ``set_model_state_dict`` /
  ``set_optimizer_state_dict(..., broadcast_from_rank0=True)`` send each rank its shards,
  against ``dcp.load`` into the sharded state dicts;
* **bytes per rank**: the checkpoint state each rank materialises (tensor bytes; a DTensor
  counts its local shard), on rank 0 and the most on any rank, and the rise of the resident set
  above its level before the operation (Linux ``VmHWM`` after resetting it through
  ``/proc/self/clear_refs``; it understates, since the allocator reuses memory freed by the
  previous operation);
* **blocked**: how long the training loop waits in ``dcp.save`` against ``dcp.async_save``
  (staging only; the write continues in a background thread on a gloo group of its own).

Times are medians of ``--repeats`` runs, max over ranks (a collective save ends when the
slowest rank does). All ranks share this machine's disk and cores, so the absolute numbers say
little about a cluster, where each node has its own bandwidth; the ratios side by side are the
point.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from autograder import course
from autograder.loading import definitions_only, load_tasks, read_cells
from kit.launcher import run_ranks
from kit.lessons.resume import DropoutTransformer, make_optimizer, shard_model


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def _peak(fn):
    """Run ``fn``; return (seconds, its result, peak resident bytes above the start)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        before = _rss_kib("VmRSS:")
    except OSError:
        before = -1
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    dist.barrier()
    seconds = time.perf_counter() - start
    peak = (_rss_kib("VmHWM:") - before) * 1024 if before >= 0 else -1
    return seconds, out, peak


@functools.cache
def _lesson_helper(name: str):
    """``name``, a function of a demo cell of Lesson 06's source (the loader leaves it out: no
    task uses it), defined beside the lesson's setup: the bytes the lesson counts, counted alike."""
    source = course.lesson(6).source
    module = load_tasks(source)
    cell = next(c for c in read_cells(source) if f"def {name}(" in c.source)
    exec(definitions_only(cell.source), vars(module))
    return getattr(module, name)


def _operations(model, optimizer, full_path: str, sharded_path: str, rank: int) -> dict:
    """The four ways to save and load, in the order they run."""
    _state_bytes = _lesson_helper("tensor_bytes")  # a state dict's tensors (DTensor: its shard)

    def full_save():
        state = get_state_dict(model, optimizer,
                               options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(state, full_path)
        return _state_bytes(state)

    def dcp_save():
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=sharded_path)
        return _state_bytes((model_state, optim_state))

    def full_load():
        # Only rank 0 reads the file; the others pass empty dicts and receive their shards.
        state = torch.load(full_path, weights_only=True) if rank == 0 else ({}, {})
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, state[0], options=options)
        set_optimizer_state_dict(model, optimizer, state[1], options=options)
        return _state_bytes(state)

    def dcp_load():
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=sharded_path)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        return _state_bytes(state)

    return {"full save": full_save, "dcp save": dcp_save, "full load": full_load,
            "dcp load": dcp_load}


def _bench_on_rank(folder: str, dims: list[int], repeats: int) -> list[dict]:
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    rows = []
    for dim in dims:
        torch.manual_seed(0)
        model = shard_model(DropoutTransformer(vocab=256, dim=dim, layers=4, heads=4, context=16))
        optimizer = make_optimizer(model)
        model(torch.randint(0, 256, (2, 16))).sum().backward()
        optimizer.step()
        full_path = os.path.join(folder, f"full-{dim}.pt")
        sharded_path = os.path.join(folder, f"dcp-{dim}")
        results: dict[str, list] = {k: []
                                    for k in ("full save", "dcp save", "full load", "dcp load",
                                                    "save blocked", "async_save blocked")}

        ops = _operations(model, optimizer, full_path, sharded_path, rank)
        for _ in range(repeats):
            for name, fn in ops.items():
                seconds, held, peak = _peak(fn)
                results[name].append((seconds, peak, held))
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state}
            start = time.perf_counter()
            dcp.save(state, checkpoint_id=sharded_path + "-sync")
            results["save blocked"].append((time.perf_counter() - start, -1, -1))
            dist.barrier()
            start = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=sharded_path + "-async",
                                    process_group=group)
            results["async_save blocked"].append((time.perf_counter() - start, -1, -1))
            future.result()
            dist.barrier()
        params = sum(p.numel() for p in model.parameters())  # DTensors count global elements
        rows.append({"dim": dim, "params": params, "results": results})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 384], help="model widths")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each operation, alternated")
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-dcp-") as folder:
        per_rank = run_ranks(_bench_on_rank, (folder, args.dims, args.repeats),
                             world_size=args.world_size, timeout=900, echo=False)
    print(f"{args.world_size} ranks (gloo, CPU), FSDP2 transformer + AdamW state; medians of "
          f"{args.repeats} runs, time = slowest rank")
    print(f"{'dim':>4} {'params':>9} {'operation':<20} {'seconds':>8} {'state MiB rank 0':>17} "
          f"{'state MiB max':>14} {'RSS peak MiB max':>17}")
    for i, dim in enumerate(args.dims):
        params = per_rank[0][i]["params"]
        medians = {}
        for op in per_rank[0][i]["results"]:
            runs = [[rank_rows[i]["results"][op][k] for rank_rows in per_rank]
                    for k in range(args.repeats)]
            seconds = statistics.median(max(r[0] for r in run) for run in runs)
            held0 = statistics.median(run[0][2] for run in runs)
            held_max = statistics.median(max(r[2] for r in run) for run in runs)
            peak_max = statistics.median(max(r[1] for r in run) for run in runs)
            medians[op] = seconds
            peaks = (f"{held0 / 2**20:>17.1f} {held_max / 2**20:>14.1f} {peak_max / 2**20:>17.1f}"
                     if held0 >= 0 else f"{'':>17} {'':>14} {'':>17}")
            print(f"{dim:>4} {params:>9,d} {op:<20} {seconds:>8.3f} {peaks}")
        print(f"{'':>4} {'':>9} ratios: save full/dcp "
              f"{medians['full save'] / medians['dcp save']:.2f}x, load full/dcp "
              f"{medians['full load'] / medians['dcp load']:.2f}x, blocked save/async_save "
              f"{medians['save blocked'] / medians['async_save blocked']:.2f}x")


if __name__ == "__main__":
    main()
