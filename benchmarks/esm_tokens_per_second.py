"""Tokens per second of Lesson 09's small ESM-2 under torch DDP and FSDP2, side by side.

    .venv/bin/python benchmarks/esm_tokens_per_second.py                  # 4 ranks, bf16,
    checkpointing .venv/bin/python benchmarks/esm_tokens_per_second.py --steps 40 --fp32
    --no-checkpointing .venv/bin/python benchmarks/esm_tokens_per_second.py --layers 4 --dim 128
    --max-tokens 2048

One launch. Every rank builds fair-esm's ``ESM2`` twice from the same seed (2 layers of width
64 by default, as in the lesson), wraps each layer in an activation checkpoint, and shards one
copy with FSDP2 (``fully_shard`` per layer, then the root) and wraps the other in
``DistributedDataParallel``. The two then alternate, step by step, on the same token-budget
batches of real peptides (modlamp's AMPvsUniProt, masked 80/10/10), each step (bf16 autocast
forward, fp32 loss, backward, AdamW) started by a barrier so that a noisy neighbour slows both
alike. A step lasts as long as its slowest rank; tokens per second is the non-padding tokens
all ranks processed in a step divided by that time. Reported: the median over steps (the first
``--warmup`` dropped) and the ratio FSDP2 / DDP. Batching and masking are the lesson's
solutions (Tasks 9.1 and 9.2). Timing only: correctness is tests/test_lesson09.py's job.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

from autograder import course
from autograder.loading import load_tasks
from kit.launcher import run_ranks
from kit.lessons.proteins import alphabet, load_peptides, small_esm2, tokenize

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("DDP", "FSDP2")


def _models(layers: int, dim: int, heads: int, checkpointing: bool) -> dict[str, Any]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    out = {}
    for name in NAMES:
        model = small_esm2(layers, dim, heads, seed=0)  # the same initial weights for both
        if checkpointing:
            for i, layer in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(layer)
        if name == "FSDP2":
            for layer in model.layers:
                fully_shard(layer)
            fully_shard(model)
            out[name] = model
        else:
            out[name] = DistributedDataParallel(model)
    return out


def _time_both(tasks: Any, args: argparse.Namespace) -> dict[str, list[tuple[float, int]]]:
    """One rank: (seconds, non-padding tokens) of every step of each model."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    vocab = alphabet()
    sequences = load_peptides("AMPvsUniProt")[0]
    lengths = [len(s) + 2 for s in sequences]
    models = _models(args.layers, args.dim, args.heads, not args.no_checkpointing)
    optimizers = {n: torch.optim.AdamW(m.parameters(), lr=1e-3) for n, m in models.items()}
    batches = tasks.token_budget_batches(lengths, args.max_tokens, rank, world_size, seed=0,
                                         epoch=0)
    generator = torch.Generator().manual_seed(rank)
    times: dict[str, list[tuple[float, int]]] = {n: [] for n in NAMES}
    for step in range(args.steps):
        tokens = tokenize([sequences[i] for i in batches[step % len(batches)]], vocab)
        inputs, targets = tasks.mask_tokens(tokens, vocab, generator)
        real = int((tokens != vocab.padding_idx).sum())
        for name in NAMES if step % 2 == 0 else NAMES[::-1]:  # alternate who goes first
            dist.barrier()
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.fp32):
                logits = models[name](inputs)["logits"]
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
            times[name].append((time.perf_counter() - start, real))
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=1024,
                        help="token budget per rank and step")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    parser.add_argument("--no-checkpointing", action="store_true")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")

    tasks = load_tasks(course.lesson(9).source)
    load = os.getloadavg()[0]
    wall = time.perf_counter()
    per_rank = run_ranks(_time_both, (tasks, args), world_size=args.world_size, timeout=1800,
                         echo=False)
    wall = time.perf_counter() - wall
    print(f"small ESM-2 ({args.layers} layers x {args.dim}), {args.world_size} ranks, "
          f"{args.max_tokens} tokens per rank and step, "
          f"{'fp32' if args.fp32 else 'bf16 autocast'}, checkpointing "
          f"{'off' if args.no_checkpointing else 'on'}; {args.steps} steps each, first "
          f"{args.warmup} dropped; load average {load:.1f} at start, {wall:.0f} s in all")
    rates = {}
    for name in NAMES:
        steps = []
        for step in range(args.warmup, args.steps):
            seconds = max(r[name][step][0] for r in per_rank)  # the slowest rank ends the step
            tokens = sum(r[name][step][1] for r in per_rank)
            steps.append((seconds, tokens))
        rates[name] = statistics.median(t / s for s, t in steps)
        median_ms = 1000 * statistics.median(s for s, _ in steps)
        print(f"  {name:6} {rates[name]:9.0f} tokens/s   median step {median_ms:7.1f} ms")
    print(f"  FSDP2 / DDP: {rates['FSDP2'] / rates['DDP']:.2f}x tokens per second")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
