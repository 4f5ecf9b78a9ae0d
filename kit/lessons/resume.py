"""The training run Lesson 06 checkpoints and resumes: every piece of state a resume must restore.

A small transformer with dropout (torch's RNG), a shuffling sampler that remembers how far into
its epoch it got, and a training step that also draws from Python's and NumPy's RNGs (a random
crop and random token masking, the kind of augmentation real pipelines do). Resuming exactly
means restoring all of it. Lesson 06's setup cell, its checks and its benchmark import this;
none of it saves or loads anything.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F
from torch.utils.data import DistributedSampler

from kit.lessons.models import TinyTransformer

__all__ = ["DropoutTransformer", "ResumableSampler", "full_parameters", "make_model",
           "make_optimizer",
           "make_sampler", "seed_everything", "shard_model", "token_dataset", "train_step"]

VOCAB, LENGTH, CROP = 32, 20, 16  # tokens per stored sequence; the model sees a random crop
BATCH = 4  # sequences per rank per step


class DropoutTransformer(TinyTransformer):
    """:class:`kit.lessons.models.TinyTransformer` with dropout after the embeddings and each
    block."""

    def __init__(self, *args: Any, dropout: float = 0.1, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.drop(self.tok(x) + self.pos(torch.arange(t, device=x.device)))  # (B, T, D)
        for block in self.blocks:
            h = self.drop(block(h))
        return self.head(self.ln(h))  # (B, T, vocab)


def make_model(dim: int = 32, layers: int = 1) -> DropoutTransformer:
    """The same initial weights in every process (seeded here, not by the caller's RNG)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return DropoutTransformer(vocab=VOCAB, dim=dim, layers=layers, heads=2, context=CROP)


def shard_model(model: TinyTransformer) -> TinyTransformer:
    """FSDP2: each block is one all-gather unit, the root holds the embeddings and the head."""
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW: two state tensors per parameter and a step count, all of which a resume restores.

    ``foreach=True`` (torch picks it by default only for CUDA tensors): each step is a few
    operations over the list of parameters instead of a few per parameter, which matters for
    FSDP2's DTensors, where every operation goes through DTensor's dispatch (Lesson 06's checks
    took 10-15% less CPU). On CPU it updates bit for bit as the single-tensor AdamW does, and any
    split of a tensor as the whole (an exact resume on another number of ranks needs that);
    torch's fused AdamW does not (tests/test_lesson06.py).
    """
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, foreach=True)


def token_dataset(n: int = 48, seed: int = 0) -> torch.Tensor:
    """``(n, LENGTH)`` int64 token sequences, the same in every process."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, LENGTH), generator=g)


class ResumableSampler(DistributedSampler):
    """A shuffling :class:`~torch.utils.data.DistributedSampler` that remembers where it is.

    ``epoch`` picks the shuffle (as in DistributedSampler) and ``position`` counts the indices
    already handed out in this epoch; iterating starts at ``position``. Set both to resume
    mid-epoch; ``set_epoch`` starts a new epoch at position 0.
    """

    def __init__(self, dataset: Any, num_replicas: int | None = None, rank: int | None = None,
                 seed: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed,
                         drop_last=True)
        self.position = 0

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.position = 0

    def __iter__(self) -> Iterator[int]:
        order = list(super().__iter__())  # this rank's indices of the epoch's shuffle
        while self.position < len(order):
            self.position += 1
            yield order[self.position - 1]


def make_sampler(dataset: torch.Tensor | None = None) -> ResumableSampler:
    """This rank's sampler over :func:`token_dataset` (the process group gives rank and size)."""
    return ResumableSampler(token_dataset() if dataset is None else dataset)


def seed_everything(seed: int) -> None:
    """Seed torch, Python and NumPy with ``seed + rank``: each rank draws its own numbers."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(seed + rank)
    random.seed(seed + rank)
    np.random.seed(seed + rank)


def _next_indices(sampler: ResumableSampler, n: int) -> list[int]:
    indices: list[int] = []
    while len(indices) < n:
        for i in sampler:  # resumes at sampler.position
            indices.append(i)
            if len(indices) == n:
                break
        else:  # epoch exhausted: the next one reshuffles
            sampler.set_epoch(sampler.epoch + 1)
    return indices


def train_step(state: Any) -> float:
    """One optimizer step of ``state.model`` on the next batch of ``state.sampler``.

    Uses ``state.model``, ``state.optimizer``, ``state.sampler``, ``state.scaler`` (None, or a
    ``torch.amp.GradScaler``) and adds 1 to ``state.step``. Returns this rank's loss.
    """
    data = state.sampler.dataset  # (N, LENGTH)
    tokens = data[_next_indices(state.sampler, BATCH)]  # (B, LENGTH)
    start = random.randrange(LENGTH - CROP)  # Python's RNG: a random crop
    x = tokens[:, start:start + CROP - 1]  # (B, T) inputs
    y = tokens[:, start + 1:start + CROP]  # (B, T) next-token targets
    masked = torch.from_numpy(np.random.rand(*x.shape) < 0.1)  # NumPy's RNG: token masking
    x = x.masked_fill(masked, 0)
    logits = state.model(x)  # torch's RNG: dropout
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    state.optimizer.zero_grad()
    scaler = getattr(state, "scaler", None)
    if scaler is None:
        loss.backward()
        state.optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(state.optimizer)
        scaler.update()
    state.step += 1
    return loss.item()


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full, unsharded state dict on every rank (DDP, FSDP2 or a plain module)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in full.items()}
