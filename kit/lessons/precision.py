"""Lesson 07 helpers (memory and speed): floating-point format tables and a model with graph breaks.

:func:`format_table` lists each format's bits, range and epsilon straight from ``torch.finfo``;
:class:`GraphBreakNet` is the model Task 7.4 makes ready for ``torch.compile``: a masked mean
over padded sequences written the way eager code often is, with a ``print``, a branch on
``.item()`` and a Python loop whose trip count comes from the data. Nothing here answers a task.
"""

from __future__ import annotations

import platform
import time

import torch
from torch import nn

__all__ = ["FORMATS", "GraphBreakNet", "cpu_has_native_bf16", "format_table", "padded_batch"]

# (name, dtype, exponent bits, mantissa bits). tf32 is not a storage dtype: it is fp32 read by
# the tensor cores with fp16's 10 mantissa bits and fp32's 8 exponent bits.
FORMATS = [
    ("fp32", torch.float32, 8, 23),
    ("tf32", None, 8, 10),
    ("fp16", torch.float16, 5, 10),
    ("bf16", torch.bfloat16, 8, 7),
]


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware, so that CPU autocast to bf16 pays.

    On x86 that takes AVX512-BF16 or AMX, as ``torch.cpu`` reports them; without either, the
    products widen each bf16 element to fp32 in software and round the result back, and a bf16
    step runs slower than an fp32 one (for Lesson 09's model, one thread: 7x on one AVX2-only
    CPU, 1.6x on another). Elsewhere (Arm) one 256x256 product in each dtype is timed once: bf16
    counts as native unless it is over twice as slow. A GPU is not asked: NVIDIA's have bf16
    tensor cores from Ampere (A100) on.
    """
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    a = torch.randn(256, 256)
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = a.to(dtype)
        x @ x  # warm-up
        start = time.perf_counter()
        for _ in range(3):
            x @ x
        seconds[dtype] = time.perf_counter() - start
    return seconds[torch.bfloat16] <= 2 * seconds[torch.float32]


def format_table() -> list[dict[str, object]]:
    """One row per format: bits, exponent and mantissa bits, largest, smallest normal, epsilon.

    Values come from ``torch.finfo``; tf32, which has no dtype, shares fp32's range and has
    fp16's precision (epsilon ``2**-10``).
    """
    rows = []
    for name, dtype, exp_bits, man_bits in FORMATS:
        info = torch.finfo(dtype if dtype is not None else torch.float32)
        eps = info.eps if dtype is not None else 2.0**-man_bits
        rows.append({"format": name, "bits": 1 + exp_bits + man_bits if dtype is not None else 19,
                     "exponent": exp_bits, "mantissa": man_bits, "max": info.max,
                     "smallest normal": info.tiny, "eps": eps})
    return rows


class GraphBreakNet(nn.Module):
    """Class logits ``(B, classes)`` from padded token ids ``(B, T)`` and lengths ``(B,)``.

    Embeds the tokens, mixes them with a linear layer and ``tanh``, averages each sequence over
    its first ``lengths[b]`` positions, rescales the batch of averages to norm ``max_norm``
    when it is larger, and classifies. Its ``forward`` breaks Dynamo's graph three times.
    """

    def __init__(self, vocab: int = 32, dim: int = 16, classes: int = 3, max_norm: float = 2.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)
        self.max_norm = max_norm

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.embed(tokens)))  # (B, T, D)
        print(f"pooling {tuple(h.shape)}")  # graph break 1: print is a side effect
        total = torch.zeros(h.shape[0], h.shape[2], dtype=h.dtype, device=h.device)  # (B, D)
        for t in range(int(lengths.max())):  # graph break 2: the trip count is data
            total = total + h[:, t] * (t < lengths).unsqueeze(1)
        pooled = total / lengths.unsqueeze(1)  # (B, D) mean over each sequence's real tokens
        norm = pooled.norm()
        if norm.item() > self.max_norm:  # graph break 3: Python branches on a tensor's value
            pooled = pooled * (self.max_norm / norm)
        return self.head(pooled)  # (B, classes)


def padded_batch(batch: int, length: int, vocab: int,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``(batch, length)`` and lengths ``(batch,)`` in ``[1, length]``, seeded; the
    first sequence is full length. Positions past a sequence's length hold padding (id 0)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    lengths[0] = length
    tokens = torch.randint(1, vocab, (batch, length), generator=g)
    tokens[torch.arange(length) >= lengths.unsqueeze(1)] = 0
    return tokens, lengths
