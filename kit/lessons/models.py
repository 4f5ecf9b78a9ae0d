"""Small models shared by lessons, checks and benchmarks: the awkward cases and a tiny transformer.

Lesson 04 (data parallelism) uses both. :class:`AwkwardNet` holds every kind of parameter a
data-parallel wrapper must get right: a frozen layer (``requires_grad=False``), a layer that
never gets a gradient, a branch used only on some steps, embedding weights tied to the output
layer (one ``Parameter`` reached twice in ``forward``) and a buffer. :class:`TinyTransformer`
is a GPT-style language model, big enough for a step-time benchmark and small enough for a
laptop CPU. Lesson 09's AlphaFold module, :class:`TriangleAttentionStartingNode`, lives with
the other protein helpers in :mod:`kit.lessons.proteins` and is reachable here too.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["AwkwardNet", "TinyTransformer", "TriangleAttentionStartingNode", "token_batch"]  # noqa: F822 - lazy, see __getattr__


def __getattr__(name: str) -> object:
    # Lazy: the protein helpers are only imported by the lessons that use them.
    if name == "TriangleAttentionStartingNode":
        from kit.lessons.proteins import TriangleAttentionStartingNode

        return TriangleAttentionStartingNode
    raise AttributeError(f"module 'kit.lessons.models' has no attribute {name!r}")


class AwkwardNet(nn.Module):
    """Next-token logits ``(B, T, vocab)`` from token ids ``(B, T)``, with awkward parameters.

    ``embed.weight`` is tied to the output layer; ``frozen`` never trains; ``unused`` is never
    called; ``extra`` runs only when ``forward(x, use_extra=True)``; the buffer ``scale``
    (``(dim,)``) multiplies the hidden state, so a rank holding another buffer computes
    something else.
    """

    def __init__(self, vocab: int = 16, dim: int = 8, hidden: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.extra = nn.Linear(dim, dim)
        self.unused = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter, two uses
        self.register_buffer("scale", torch.ones(dim))

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = self.frozen(self.embed(x)) * self.scale  # (B, T, dim)
        h = h + self.down(torch.tanh(self.up(h)))
        if use_extra:
            h = h + self.extra(h)
        return self.head(h)  # (B, T, vocab)


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then an MLP, each residual."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        # (B, T, D) -> (B, nh, T, hs)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """A GPT-style language model: logits ``(B, T, vocab)`` from token ids ``(B, T)``.

    Token and position embeddings, ``layers`` pre-norm blocks, a final LayerNorm and an output
    layer tied to the token embedding.
    """

    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 4, heads: int = 4,
                 context: int = 64):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim must be a multiple of heads ({dim} % {heads} != 0)")
        self.context = context
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if t > self.context:
            raise ValueError(f"sequence of {t} tokens is longer than the context ({self.context})")
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))  # (B, T, D)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))  # (B, T, vocab)


def token_batch(batch: int, length: int, vocab: int,
                seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, both ``(batch, length)`` int64, from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]
