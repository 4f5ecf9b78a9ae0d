"""Lesson 07's memory and speed trade-offs, measured side by side in one run on CPU.

    .venv/bin/python benchmarks/memory_speed.py                    # everything
    .venv/bin/python benchmarks/memory_speed.py --rounds 10 --no-model-compile

Three comparisons on ``TinyTransformer`` (4 blocks, D=128, B=8, T=64 unless told otherwise),
each timed in interleaved rounds (every variant once per round, so a noisy neighbour slows all
alike); reported is each variant's best round (the first round only warms up) and its ratio to
the first variant:

1. activation checkpointing: none, every 4th, 2nd and every block with the lesson's
   ``checkpoint`` (solutions/07), and every block with ``torch.utils.checkpoint`` (non-reentrant):
   forward + backward time and bytes saved for backward (counted with saved-tensor hooks);
2. precision: one AdamW training step in fp32 and under bf16 autocast;
3. torch.compile: eager against Inductor, first-call (compile) time and steady time, on a
   pointwise chain and, unless ``--no-model-compile``, on the model's forward + backward.

Timing only: correctness is tests/test_lesson07.py's job.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from autograder import course
from autograder.references.lesson07 import saved_activation_bytes as _reference_saved_bytes
from kit.lessons.models import TinyTransformer, token_batch

try:
    from autograder.loading import load_tasks
except ImportError:  # before the grading modules moved to autograder/
    from kit.notebook import load_tasks

ROOT = Path(__file__).resolve().parents[1]


def interleaved_best(variants: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Best seconds of each variant over ``rounds`` rounds after one warm-up round."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds + 1):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: min(t[1:]) for name, t in times.items()}


def report(title: str, seconds: dict[str, float], extra: dict[str, str] | None = None) -> None:
    base = next(iter(seconds.values()))
    print(f"\n{title}")
    for name, s in seconds.items():
        more = f"  {extra[name]}" if extra and name in extra else ""
        print(f"  {name:28} {1e3 * s:9.1f} ms  {s / base:5.2f}x{more}")


def _model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    return TinyTransformer(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=4,
                           context=args.length)


class _TorchCheckpointed(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=False)


def checkpointing(lesson, args: argparse.Namespace) -> None:
    x, y = token_batch(args.batch, args.length, args.vocab, 0)
    models = {}
    for name, every in [("none", None), ("every 4 (lesson)", 4), ("every 2 (lesson)", 2),
                        ("every 1 (lesson)", 1)]:
        models[name] = _model(args)
        if every:
            lesson.apply_checkpointing(models[name], every=every)
    models["every 1 (torch, non-reentrant)"] = _model(args)
    models["every 1 (torch, non-reentrant)"].blocks = nn.ModuleList(
        _TorchCheckpointed(b) for b in models["every 1 (torch, non-reentrant)"].blocks)

    def step(model: nn.Module) -> Callable[[], None]:
        def run() -> None:
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            model.zero_grad()
        return run

    seconds = interleaved_best({n: step(m) for n, m in models.items()}, args.rounds)
    saved = {n: _reference_saved_bytes(m, x) for n, m in models.items()}
    report("activation checkpointing: forward + backward", seconds,
           {n: f"{saved[n] / 2**20:7.2f} MiB saved ({saved[n] / saved['none']:.2f}x)"
            for n in saved})


def precision(args: argparse.Namespace) -> None:
    x, y = token_batch(args.batch, args.length, args.vocab, 1)
    runs = {}
    for name, dtype in [("fp32", None), ("bf16 autocast", torch.bfloat16)]:
        model = _model(args)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def run(model=model, optimizer=optimizer, dtype=dtype) -> None:
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        runs[name] = run
    report(f"precision: one AdamW step (CPU capability {torch.backends.cpu.get_cpu_capability()})",
           interleaved_best(runs, args.rounds))


def _gated_gelu(x: torch.Tensor) -> torch.Tensor:
    return x + F.gelu(x) * torch.sigmoid(x) * 0.5


def compile_vs_eager(args: argparse.Namespace) -> None:
    import torch._dynamo

    x = torch.randn(1024, 1024)
    torch._dynamo.reset()
    fused = torch.compile(_gated_gelu)
    start = time.perf_counter()
    fused(x)
    first = time.perf_counter() - start
    seconds = interleaved_best({"eager": lambda: _gated_gelu(x), "inductor": lambda: fused(x)},
                               args.rounds * 5)
    report("torch.compile: x + gelu(x) * sigmoid(x) * 0.5 on (1024, 1024)", seconds,
           {"inductor": f"first call {first:.1f} s"})
    if args.no_model_compile:
        return
    tokens, targets = token_batch(args.batch, args.length, args.vocab, 2)
    eager_model, compiled_model = _model(args), _model(args)
    compiled = torch.compile(compiled_model)

    def step(model: Callable[[torch.Tensor], torch.Tensor],
             params: nn.Module) -> Callable[[], None]:
        def run() -> None:
            F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
            params.zero_grad()
        return run

    start = time.perf_counter()
    step(compiled, compiled_model)()
    first = time.perf_counter() - start
    seconds = interleaved_best({"eager": step(eager_model, eager_model),
                                "inductor": step(compiled, compiled_model)}, args.rounds)
    report("torch.compile: TinyTransformer forward + backward", seconds,
           {"inductor": f"first step {first:.1f} s"})
    torch._dynamo.reset()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--no-model-compile", action="store_true",
                        help="skip compiling the model (the slowest first compile)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; TinyTransformer "
          f"layers={args.layers} dim={args.dim}, batch {args.batch} x {args.length} tokens")
    lesson = load_tasks(course.lesson(7).source)
    checkpointing(lesson, args)
    precision(args)
    compile_vs_eager(args)


if __name__ == "__main__":
    main()
