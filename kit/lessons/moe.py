"""Props for Lesson 13 (mixture of experts): the routing record, experts, routers, token sets.

``Routing`` is the record a router hands to the rest of a mixture-of-experts layer (Task 13.1
returns one; 13.2 and 13.3 read it). The builders make experts and routers from a seed *per
expert*, so that a rank building only its own experts gets exactly the weights a single process
building all of them has: the lesson's demos, its checks and its benchmark compare the two.
``stack_experts`` stacks their weights for a grouped matrix product (Task 13.4's input).
``token_histogram`` and ``plot_token_histogram`` count and draw where a batch's choices went.
Nothing here routes, dispatches or combines tokens: those are the lesson's tasks.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = [
    "ExpertMLP",
    "Routing",
    "capacity",
    "expert_range",
    "make_experts",
    "make_router",
    "plot_token_histogram",
    "skewed_tokens",
    "stack_experts",
    "token_histogram",
]


class Routing(NamedTuple):
    """Where each token's k choices go: four (tokens, k) tensors, column j the j-th choice.

    ``expert`` (int64): the chosen expert, best first. ``weight`` (the logits' dtype): what the
    expert's output is multiplied by, 0 for a dropped choice. ``slot`` (int64): the choice's
    place in its expert's buffer, -1 when dropped. ``kept`` (bool): whether it fit the capacity.
    """

    expert: torch.Tensor
    weight: torch.Tensor
    slot: torch.Tensor
    kept: torch.Tensor


class ExpertMLP(nn.Module):
    """One expert: ``(n, d_model) -> (n, d_model)``, Linear(d, h), GELU, Linear(h, d)."""

    def __init__(self, d_model: int, d_hidden: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, d_hidden, dtype=dtype)
        self.down = nn.Linear(d_hidden, d_model, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


def expert_range(num_experts: int, world_size: int, rank: int) -> range:
    """The experts rank ``rank`` holds under expert parallelism: E/W consecutive ones."""
    if world_size < 1 or num_experts % world_size:
        raise ValueError(f"{num_experts} experts do not split evenly over {world_size} ranks "
                         f"({num_experts} % {world_size} = {num_experts % max(world_size, 1)}): "
                         "choose a number of experts that is a multiple of the world size")
    per_rank = num_experts // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def make_experts(num_experts: int, d_model: int, d_hidden: int, *, seed: int = 0,
                 which: range | list[int] | None = None,
                 dtype: torch.dtype = torch.float32) -> nn.ModuleList:
    """The experts listed in ``which`` (default: all ``num_experts``) as an ``nn.ModuleList``.

    Expert ``e`` is always initialised from the seed ``(seed, e)``, whichever others are built,
    so ``make_experts(8, ..., which=range(2, 4))`` equals ``make_experts(8, ...)[2:4]``.
    """
    which = range(num_experts) if which is None else which
    experts = []
    for e in which:
        if not 0 <= e < num_experts:
            raise ValueError(f"expert {e} does not exist: there are {num_experts} (0 to "
                             f"{num_experts - 1})")
        torch.manual_seed(1_000_003 * seed + e)
        experts.append(ExpertMLP(d_model, d_hidden, dtype))
    return nn.ModuleList(experts)


def stack_experts(experts: nn.ModuleList) -> tuple[torch.Tensor, ...]:
    """The experts' weights stacked for a grouped matrix product: ``(w1, b1, w2, b2)``.

    ``w1`` is ``(E, d_model, d_hidden)`` and ``w2`` ``(E, d_hidden, d_model)``, input dimension
    first, so that expert ``e`` computes ``gelu(x @ w1[e] + b1[e]) @ w2[e] + b2[e]``, which is
    ``experts[e](x)``. The stack is a copy, differentiable back to the experts' parameters.
    """
    return (torch.stack([e.up.weight.t() for e in experts]),
            torch.stack([e.up.bias for e in experts]),
            torch.stack([e.down.weight.t() for e in experts]),
            torch.stack([e.down.bias for e in experts]))


def make_router(d_model: int, num_experts: int, *, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> nn.Linear:
    """A router: ``(n, d_model) -> (n, num_experts)`` logits, a Linear without bias."""
    torch.manual_seed(7_000_001 + seed)
    return nn.Linear(d_model, num_experts, bias=False, dtype=dtype)


def skewed_tokens(num_tokens: int, d_model: int, router: nn.Linear, *, favourite: int = 0,
                  skew: float = 1.0, seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(num_tokens, d_model)`` random tokens, shifted towards the router's ``favourite`` expert.

    ``skew = 0`` gives plain normal tokens (balanced routing on average); a larger ``skew`` adds
    ``skew`` times the unit direction of the favourite's router row, so more and more tokens
    prefer it: the uneven load a real batch brings.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, d_model, generator=g, dtype=torch.float64)
    direction = router.weight.detach()[favourite].double()
    x = x + skew * direction / direction.norm().clamp_min(1e-12)
    return x.to(dtype)


def capacity(k: int, num_tokens: int, capacity_factor: float, num_experts: int) -> int:
    """Slots per expert: ``ceil(k * num_tokens * capacity_factor / num_experts)``."""
    return math.ceil(k * num_tokens * capacity_factor / num_experts)


def token_histogram(routing: Routing, num_experts: int) -> dict[str, list[int]]:
    """Per expert, how many choices it kept and how many it dropped."""
    expert = routing.expert.reshape(-1).long()
    kept = routing.kept.reshape(-1).bool()
    return {"kept": torch.bincount(expert[kept], minlength=num_experts).tolist(),
            "dropped": torch.bincount(expert[~kept], minlength=num_experts).tolist()}


def plot_token_histogram(histogram: dict[str, list[int]], ax: Any = None, *, title: str = "",
                         capacity: int | None = None, ranks: int | None = None) -> Any:
    """Bars of kept (solid) and dropped (hatched) choices per expert; return the Axes.

    ``capacity`` draws the slots per expert as a line; ``ranks`` colours experts by the rank
    that holds them (E/W consecutive experts per rank).
    """
    import matplotlib.pyplot as plt

    kept, dropped = histogram["kept"], histogram["dropped"]
    num_experts = len(kept)
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 2.6))
    colours = ["tab:blue"] * num_experts
    if ranks:
        palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
        colours = [palette[(e * ranks // num_experts) % len(palette)] for e in range(num_experts)]
    xs = range(num_experts)
    ax.bar(xs, kept, color=colours, edgecolor="black", linewidth=0.4, label="kept")
    ax.bar(xs, dropped, bottom=kept, color="white", edgecolor="tab:red", hatch="//",
           linewidth=0.6, label="dropped")
    if capacity is not None:
        ax.axhline(capacity, color="black", linestyle="--", linewidth=0.8, label="capacity")
    ax.set_xticks(list(xs))
    ax.set_xlabel("expert")
    ax.set_ylabel("choices")
    ax.legend(fontsize="small", frameon=False)
    if title:
        ax.set_title(title)
    return ax
