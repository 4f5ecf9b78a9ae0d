"""What Lesson 12's instruments cost: a training step with and without the profiler, and the FLOP
count.

    .venv/bin/python benchmarks/profiler_overhead.py                 # the lesson's model, 2 ranks
    .venv/bin/python benchmarks/profiler_overhead.py --world-size 4 --dim 128 --steps 10

One launch; every rank runs the same DDP training step of ``TinyTransformer`` (a batch from a
``DataLoader``, forward, backward, SGD) five ways, in turn, each step started by a barrier and
the order rotating so that a noisy neighbour slows all alike: no profiler; ``torch.profiler``
with CPU activities (what ``kit.lessons.profiling.profiled`` uses by default); plus
``record_shapes``; plus ``profile_memory``; plus ``with_stack``. A step's time is the slowest
rank's; reported are medians and the ratio to the plain step, and the size of one step's
exported trace. Then, in this process: ``FlopCounterMode`` around a forward and backward under
the math attention backend, against the fused kernel's step and against the solutions'
``training_flops`` (Task 12.1), which needs no model at all. Timing only: correctness is
tests/test_lesson12.py's job.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F

from autograder import course
from autograder.loading import load_tasks
from kit.launcher import run_ranks
from kit.lessons.models import TinyTransformer, token_batch
from kit.lessons.profiling import warm_profiler

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "no profiler": None,
    "profiler (CPU)": {},
    "+ record_shapes": {"record_shapes": True},
    "+ profile_memory": {"record_shapes": True, "profile_memory": True},
    "+ with_stack": {"record_shapes": True, "profile_memory": True, "with_stack": True},
}


def on_rank(vocab: int, dim: int, layers: int, seq_len: int, batch: int, steps: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile

    from kit.lessons.profiling import _quietly

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyTransformer(vocab, dim, layers, 4, context=seq_len))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = token_batch(batch * 4, seq_len, vocab, seed=dist.get_rank())
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)

    def step() -> None:
        for xb, yb in loader:
            F.cross_entropy(model(xb).reshape(-1, vocab), yb.reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad()
            break

    for _ in range(3):
        step()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    trace_bytes: dict[str, int] = {}
    names = list(VARIANTS)
    folder = tempfile.mkdtemp(prefix="profiler-overhead-")
    for i in range(steps):
        for name in names[i % len(names):] + names[: i % len(names)]:
            dist.barrier()
            options = VARIANTS[name]
            if options is None:
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
                continue
            prof = profile(activities=[ProfilerActivity.CPU], **options)
            start = time.perf_counter()
            _quietly(prof.start)
            step()
            _quietly(prof.stop)
            times[name].append(time.perf_counter() - start)
            if i == 0:
                path = os.path.join(folder, f"{dist.get_rank()}.json")
                prof.export_chrome_trace(path)
                trace_bytes[name] = os.path.getsize(path)
    return {"times": times, "trace_bytes": trace_bytes}


def flop_count_cost(vocab: int, dim: int, layers: int, seq_len: int,
                    batch: int) -> dict[str, float]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    lesson = load_tasks(course.lesson(12).source)
    # One thread, as in the ranks: on a busy 2-core machine a second intra-op thread makes each
    # small op wait for a core (a 50 ms step took over a second).
    torch.set_num_threads(1)
    model = TinyTransformer(vocab, dim, layers, 4, context=seq_len)
    x, y = token_batch(batch, seq_len, vocab, seed=0)

    def step(backend: SDPBackend) -> None:
        with sdpa_kernel(backend):
            F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1)).backward()

    def best(fn, repeats: int = 5) -> float:
        fn()
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
        return min(out)

    def counted() -> None:
        with FlopCounterMode(display=False):
            step(SDPBackend.MATH)

    return {"fused step": best(lambda: step(SDPBackend.FLASH_ATTENTION)),
            "math step": best(lambda: step(SDPBackend.MATH)),
            "math step under FlopCounterMode": best(counted),
            "training_flops (no model)": best(
                lambda: lesson.training_flops(vocab, dim, layers, 4, batch, seq_len))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    shape = (args.vocab, args.dim, args.layers, args.seq_len, args.batch)
    import torch._dynamo  # noqa: F401 - DDP's constructor imports it: once, before the ranks fork

    warm_profiler()
    ranks = list(run_ranks(on_rank, (*shape, args.steps), world_size=args.world_size, echo=False,
                           timeout=600))
    print(f"DDP step of TinyTransformer(vocab={args.vocab}, dim={args.dim}, layers={args.layers}), "
          f"batch {args.batch} x {args.seq_len} per rank, {args.world_size} ranks, "
          f"{args.steps} steps each (slowest rank, median):")
    plain = None
    for name in VARIANTS:
        per_step = [max(r["times"][name][i] for r in ranks) for i in range(args.steps)]
        median = statistics.median(per_step)
        plain = plain or median
        size = ranks[0]["trace_bytes"].get(name)
        print(f"  {name:<18} {median * 1e3:8.1f} ms  {median / plain:5.2f}x"
              + (f"   trace {size / 1e6:6.2f} MB per rank and step" if size else ""))
    costs = flop_count_cost(*shape)
    print("Counting FLOPs in one process (best of 5):")
    for name, seconds in costs.items():
        print(f"  {name:<32} {seconds * 1e6:12.1f} us  {seconds / costs['fused step']:9.5f}x the "
              "fused step")
    print(json.dumps({"world_size": args.world_size, "shape": shape}))


if __name__ == "__main__":
    main()
