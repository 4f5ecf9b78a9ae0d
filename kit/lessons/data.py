"""Data-plane helpers: a deliberately slow dataset, loader timing and the index-stream picture.

Lesson 03 ("The data plane") uses them to measure ``DataLoader`` throughput against
``num_workers`` and ``persistent_workers`` and to draw what every rank reads in every epoch
under a ``DistributedSampler``; ``benchmarks/loader_throughput.py`` uses the same timing code.
Nothing here downloads data: every sample is synthetic and made from its index.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "LoaderTiming",
    "SlowDataset",
    "plot_index_streams",
    "sampler_streams",
    "time_loader",
]


class SlowDataset(Dataset):
    """``n`` synthetic samples ``(x, y)``, each taking ``delay_s`` seconds to "load".

    ``x`` is a ``(features,)`` float32 tensor made from the index and ``y`` its index. With
    ``busy=False`` the delay is a sleep, like waiting on a disk, a network file system or a
    decompression library that releases the GIL: workers overlap it even beyond the number of
    CPU cores. With ``busy=True`` the delay spins the CPU, like a Python-heavy transform: workers
    only help up to the number of free cores.
    """

    def __init__(self, n: int, delay_s: float = 0.01, *, busy: bool = False, features: int = 8):
        if n < 0 or delay_s < 0:
            raise ValueError(f"SlowDataset needs n >= 0 and delay_s >= 0, got n={n}, "
                             f"delay_s={delay_s}.")
        self.n, self.delay_s, self.busy, self.features = n, delay_s, busy, features

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range for a SlowDataset of {self.n} samples")
        if self.busy:
            # Spin until this process has *used* delay_s of CPU: a process waiting for a core
            # gets no closer, so workers beyond the free cores cannot help.
            end = time.process_time() + self.delay_s
            while time.process_time() < end:
                pass
        elif self.delay_s:
            time.sleep(self.delay_s)
        return torch.full((self.features,), float(i)), i


@dataclass
class LoaderTiming:
    """What :func:`time_loader` measured: seconds per epoch and to each epoch's first batch."""

    samples: int
    epoch_s: list[float] = field(default_factory=list)
    first_batch_s: list[float] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        """Throughput over every epoch, worker start-up included."""
        return self.samples * len(self.epoch_s) / sum(self.epoch_s)


def time_loader(loader: DataLoader, epochs: int = 1) -> LoaderTiming:
    """Iterate ``loader`` for ``epochs`` epochs, timing each epoch and its first batch.

    Each epoch starts with ``iter(loader)``: without ``persistent_workers`` that starts every
    worker again (and runs ``worker_init_fn`` again), which is what ``first_batch_s`` shows.
    """
    timing = LoaderTiming(samples=len(loader.dataset))  # type: ignore[arg-type]
    for _ in range(epochs):
        start = time.perf_counter()
        first = None
        for _batch in loader:
            if first is None:
                first = time.perf_counter() - start
        timing.epoch_s.append(time.perf_counter() - start)
        timing.first_batch_s.append(first if first is not None else timing.epoch_s[-1])
    return timing


def sampler_streams(make_sampler: Callable[[int], Any], world_size: int, epochs: int, *,
                    set_epoch: bool = True) -> list[list[list[int]]]:
    """``streams[epoch][rank]``: the indices each rank's sampler yields in each epoch.

    ``make_sampler(rank)`` builds rank ``rank``'s sampler once, as a training script does;
    ``set_epoch=False`` reproduces the forgotten ``sampler.set_epoch(epoch)``.
    """
    samplers = [make_sampler(rank) for rank in range(world_size)]
    streams = []
    for epoch in range(epochs):
        if set_epoch:
            for s in samplers:
                s.set_epoch(epoch)
        streams.append([[int(i) for i in s] for s in samplers])
    return streams


def plot_index_streams(streams: Sequence[Sequence[Sequence[int]]], n: int, *, title: str = "",
                       ax_width: float = 3.2) -> Any:
    """Draw ``streams[epoch][rank]`` as one grid per epoch: a row per rank, a cell per step.

    Cells show the dataset index, coloured by index; a red frame marks a padded duplicate
    (global position ``step * world_size + rank >= n``, see ``DistributedSampler``). Returns the
    matplotlib figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    epochs = len(streams)
    world_size = len(streams[0])
    steps = max((len(s) for epoch in streams for s in epoch), default=0)
    fig, axes = plt.subplots(1, epochs, figsize=(ax_width * epochs, 0.45 * world_size + 1.1),
                             squeeze=False)
    for epoch, ax in enumerate(axes[0]):
        grid = torch.full((world_size, steps), float("nan"))
        for rank, s in enumerate(streams[epoch]):
            grid[rank, : len(s)] = torch.tensor(s, dtype=torch.float32)
        ax.imshow(grid.numpy(), cmap="viridis", vmin=0, vmax=max(n - 1, 1), aspect="auto")
        for rank, s in enumerate(streams[epoch]):
            for step, index in enumerate(s):
                bright = index > 0.6 * (n - 1)  # viridis turns yellow: dark text reads better
                ax.text(step, rank, str(index), ha="center", va="center", fontsize=8,
                        color="black" if bright else "white")
                if step * world_size + rank >= n:
                    ax.add_patch(Rectangle((step - 0.5, rank - 0.5), 1, 1, fill=False,
                                           edgecolor="red", linewidth=2))
        ax.set_title(f"epoch {epoch}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)])
        ax.set_xticks(range(steps))
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
