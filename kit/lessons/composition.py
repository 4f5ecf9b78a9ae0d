"""Lesson 14's props: an ESM-2-style peptide encoder whose parts a pipeline stage may drop, the
masked batches it trains on, the one-process run every layout must match, a training loop that
runs any layout, and the figure and widget that compare layouts.

None of this holds a task's answer: the mesh, the parallelization, the pipeline split and the
checkpoint are the lesson's tasks.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kit.lessons import proteins

__all__ = ["DIM", "HEADS", "LAYERS", "MASKED", "SEQ_LEN", "VOCAB", "Block", "PeptideEncoder",
           "masked_batches", "masked_lm_loss", "one_process_losses", "peptide_windows",
           "plot_layouts", "plot_mesh", "step_model", "train_steps"]

VOCAB = 33  # fair-esm's ESM-2 alphabet
DIM, HEADS, LAYERS = 64, 4, 4
SEQ_LEN = 32  # tokens per window: a multiple of every tp the lesson uses
MASKED = 5  # masked tokens per window: the same count everywhere, so every split averages alike
MASK_ID = 32  # <mask> in fair-esm's alphabet

# FSDP2 warns (torch 2.13, _fsdp_state.py) when a wrapped module returns a view, as a linear
# layer on a 3-D input and tensor parallel's local outputs do: an in-place op on it would skip
# the backward gather. Nothing here writes into a module's output in place.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP\w+\) returned a view",
                        category=UserWarning)


# --------------------------------------------------------------------------- the model


def _rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (RoFormer; ESM-2 uses it) over dim -2 of ``(b, h, s, d)``."""
    s, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10_000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    angles = torch.outer(torch.arange(s, dtype=torch.float32, device=x.device), inv)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Bidirectional self-attention with rotary positions. It reads its head count from the
    width of ``q``'s output, so it runs unchanged on a tensor-parallel rank's share of heads."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        y = F.scaled_dot_product_attention(_rotary(q), _rotary(k), v)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """ESM-2's pre-norm transformer layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.mlp_norm, self.mlp = nn.LayerNorm(dim), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class PeptideEncoder(nn.Module):
    """A small ESM-2-style masked language model over peptides.

    ``tok`` (embedding), ``blocks`` (an ``nn.ModuleDict`` keyed "0", "1", ...), ``norm`` and
    ``head``. A pipeline stage deletes what it does not run: ``tok``, ``norm`` and ``head`` may
    be ``None`` and ``blocks`` may hold a subset of its keys, and ``forward`` skips what is
    missing. Keys, not positions, name the blocks, so a stage's state-dict names are the full
    model's names (``blocks.2.attn.q.weight`` on whichever stage holds block 2) and a checkpoint
    saved at one pipeline split loads at another.
    """

    def __init__(self, layers: int = LAYERS, dim: int = DIM, heads: int = HEADS,
                 vocab: int = VOCAB) -> None:
        super().__init__()
        if heads < 1 or dim % heads or (dim // heads) % 2:
            raise ValueError(f"dim {dim} must split into {heads} heads of an even width")
        self.tok: nn.Module | None = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleDict({str(i): Block(dim, heads) for i in range(layers)})
        self.norm: nn.Module | None = nn.LayerNorm(dim)
        self.head: nn.Module | None = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) if self.tok is not None else x
        for block in self.blocks.values():
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h) if self.head is not None else h


def encoder(seed: int = 0, **config: int) -> PeptideEncoder:
    """A :class:`PeptideEncoder` with the weights ``seed`` gives: the same on every rank."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return PeptideEncoder(**config)


# --------------------------------------------------------------------------- the data


def peptide_windows(count: int, seq_len: int = SEQ_LEN, seed: int = 0) -> torch.Tensor:
    """``(count, seq_len)`` int64 token windows cut from modlamp's real antimicrobial peptides
    (each <cls> peptide <eos>, packed end to end, as ESM-2 packs UniRef): no padding, so every
    window has the same number of tokens on every layout."""
    sequences, labels, _ = proteins.load_peptides("AMPvsUniProt")
    alphabet = proteins.alphabet()
    g = torch.Generator().manual_seed(seed)
    stream: list[int] = []
    for i in torch.randperm(len(sequences), generator=g).tolist():
        stream += [alphabet.cls_idx, *map(alphabet.get_idx, sequences[i]), alphabet.eos_idx]
        if len(stream) >= count * seq_len:
            break
    if len(stream) < count * seq_len:
        raise ValueError(f"the peptide set holds {len(stream)} tokens, fewer than "
                         f"{count} windows of {seq_len}")
    return torch.tensor(stream[:count * seq_len]).view(count, seq_len)


def masked_batches(steps: int, batch: int, seq_len: int = SEQ_LEN, seed: int = 0
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` (tokens, targets) pairs of ``batch`` windows, :data:`MASKED` tokens of each
    window replaced by <mask>; targets hold the true token there and -100 elsewhere.

    Every window has the same number of masked tokens, so the mean loss over a batch equals the
    mean over its data-parallel shards and over its micro-batches: a layout changes how the
    batch is split, never the loss it trains on."""
    windows = peptide_windows(steps * batch, seq_len, seed)
    g = torch.Generator().manual_seed(seed + 1)
    picks = torch.rand(steps * batch, seq_len, generator=g).argsort(dim=1)[:, :MASKED]
    tokens, targets = windows.clone(), torch.full_like(windows, -100)
    rows = torch.arange(len(windows)).unsqueeze(1)
    targets[rows, picks] = windows[rows, picks]
    tokens[rows, picks] = MASK_ID
    return [(tokens[i * batch:(i + 1) * batch], targets[i * batch:(i + 1) * batch])
            for i in range(steps)]


def masked_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the masked positions (targets of -100 are ignored)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


# --------------------------------------------------------------------------- training


def optimizer_for(model: nn.Module, lr: float = 3e-3) -> torch.optim.Optimizer:
    """AdamW over the model's parameters, one update per list (``foreach``), as the lesson uses
    it everywhere: on CPU it updates DTensors bit for bit as plain tensors."""
    return torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)


def one_process_losses(batches: Sequence[tuple[torch.Tensor, torch.Tensor]], seed: int = 0,
                       lr: float = 3e-3, **config: int) -> list[float]:
    """The loss of every step of the whole model trained in one process: what every layout must
    reproduce."""
    model = encoder(seed, **config)
    optimizer = optimizer_for(model, lr)
    losses = []
    for tokens, targets in batches:
        loss = masked_lm_loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def axis_of(mesh: Any, name: str) -> tuple[int, int]:
    """``(size, local rank)`` of ``mesh``'s axis ``name``; ``(1, 0)`` when it has none."""
    names = mesh.mesh_dim_names or ()
    if name not in names:
        return 1, 0
    return mesh.size(names.index(name)), mesh.get_local_rank(name)


def _shard(batch: tuple[torch.Tensor, torch.Tensor], mesh: Any
           ) -> tuple[torch.Tensor, torch.Tensor]:
    dp, rank = axis_of(mesh, "dp")
    tokens, targets = batch
    if len(tokens) % dp:
        raise ValueError(f"a batch of {len(tokens)} windows does not split over dp={dp}")
    share = len(tokens) // dp
    return tokens[rank * share:(rank + 1) * share], targets[rank * share:(rank + 1) * share]


def train_steps(model: nn.Module, mesh: Any, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                optimizer: torch.optim.Optimizer, schedule: Any = None,
                report: bool = True) -> list[float]:
    """Train on ``batches`` (whole batches: each data-parallel rank takes its share) and return
    each step's loss over the whole batch, the same list on every rank.

    Without ``schedule`` every rank runs the whole ``model``; with one (a pipeline schedule over
    the mesh's "pp" axis) the first stage feeds tokens, the last computes the loss, and the
    loss reaches every rank by a broadcast on "pp" and an average on "dp". ``report=False``
    skips those two collectives (a traced step then holds the training's messages only) and
    returns this rank's own losses (0.0 off the last pipeline stage)."""
    import torch.distributed as dist

    pp, stage = axis_of(mesh, "pp")
    dp, _ = axis_of(mesh, "dp")
    device = (torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda"
              else torch.device("cpu"))
    losses = []
    for batch in batches:
        tokens, targets = (t.to(device) for t in _shard(batch, mesh))
        if schedule is None:
            loss = masked_lm_loss(model(tokens), targets)
            loss.backward()
            value = loss.detach().reshape(1)
        else:
            parts: list[torch.Tensor] = []
            kwargs = {"target": targets, "losses": parts} if stage == pp - 1 else {}
            schedule.step(tokens, **kwargs) if stage == 0 else schedule.step(**kwargs)
            value = (torch.stack(parts).mean().detach().reshape(1) if parts
                     else torch.zeros(1, device=device))
            if pp > 1 and report:
                dist.broadcast(value, group=mesh["pp"].get_group(), group_src=pp - 1)
        optimizer.step()
        optimizer.zero_grad()
        if dp > 1 and report:
            dist.all_reduce(value, group=mesh["dp"].get_group())
            value /= dp
        losses.append(value.item())
    return losses


# --------------------------------------------------------------------------- pictures


def plot_mesh(shape: dict[str, int], ax: Any = None, ranks_per_node: int = 8) -> Any:
    """Draw the ranks of a ("pp", "dp", "tp") mesh: one box per rank, a row per tp group, the
    node each rank sits on shaded. ``shape`` maps axis names to sizes."""
    import matplotlib.pyplot as plt

    pp, dp, tp = (shape.get(k, 1) for k in ("pp", "dp", "tp"))
    if ax is None:
        _, ax = plt.subplots(figsize=(1.2 + 1.1 * tp * pp, 0.9 + 0.6 * dp))
    colours = plt.get_cmap("Pastel1")
    for s in range(pp):
        for d in range(dp):
            for t in range(tp):
                rank = (s * dp + d) * tp + t
                x, y = s * (tp + 0.6) + t, dp - 1 - d
                ax.add_patch(plt.Rectangle((x, y), 0.9, 0.8, color=colours(rank // ranks_per_node
                                                                             % 9)))
                ax.text(x + 0.45, y + 0.4, f"rank {rank}", ha="center", va="center", fontsize=8)
        ax.text(s * (tp + 0.6) + tp / 2 - 0.05, dp + 0.1, f"pp stage {s}", ha="center",
                fontsize=9)
    for d in range(dp):
        ax.text(-0.15, dp - 1 - d + 0.4, f"dp {d}", ha="right", va="center", fontsize=9)
    ax.set_xlim(-1.0, pp * (tp + 0.6))
    ax.set_ylim(-0.3, dp + 0.5)
    ax.set_axis_off()
    ax.set_title(f"mesh (pp={pp}, dp={dp}, tp={tp}): a row of a stage is one tp group, "
                 f"a column one dp group", fontsize=9)
    return ax


def plot_layouts(runs: dict[str, dict[str, Any]], reference: Sequence[float]) -> Any:
    """Loss curves of several layouts over the one-process curve, and each layout's parameter
    bytes per rank and bytes sent per step on each mesh axis. ``runs`` maps a layout's label to
    ``{"losses": [...], "param_bytes": int, "traffic": {"dp": int, "tp": int, "pp": int}}``."""
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(12, 3.2))
    a.plot(range(1, len(reference) + 1), reference, "k-", lw=4, alpha=0.25, label="one process")
    for label, run in runs.items():
        a.plot(range(1, len(run["losses"]) + 1), run["losses"], marker=".", label=label)
    a.set(xlabel="step", ylabel="masked-LM loss", title="every layout trains the same curve")
    a.legend(fontsize=7)
    labels = list(runs)
    b.bar(labels, [runs[k]["param_bytes"] / 1024 for k in labels], color="tab:blue")
    b.set(ylabel="KiB", title="parameter bytes per rank")
    bottom = [0.0] * len(labels)
    for axis, colour in (("dp", "tab:orange"), ("tp", "tab:green"), ("pp", "tab:purple")):
        heights = [runs[k]["traffic"].get(axis, 0) / 2**20 for k in labels]
        c.bar(labels, heights, bottom=bottom, color=colour, label=axis)
        bottom = [x + y for x, y in zip(bottom, heights)]
    c.set(ylabel="MiB per step", title="bytes sent per mesh axis (rank 0)")
    c.legend(fontsize=7)
    for ax in (b, c):
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    fig.tight_layout()
    return fig


def step_model(world_size: int, measured: dict[tuple[int, int, int], float] | None = None,
               model: Any = None) -> Callable[[int, int, int], str]:
    """A function of ``(dp, tp, pp)`` that describes Lesson 12's step-time model of that layout
    (Lesson 08's ``layout_costs``, on an H100-class node) beside this machine's measured step,
    when ``measured`` holds one for it: the widget's text."""
    from kit.lessons import parallelism

    model = model or parallelism.Model()

    def describe(dp: int, tp: int, pp: int) -> str:
        if dp * tp * pp != world_size:
            return f"dp * tp * pp = {dp * tp * pp}, not the world size {world_size}"
        cost = parallelism.layout_costs(model, world_size, dp, tp, pp)
        comm = sum(cost.comm_seconds.values())
        lines = [f"model: {model.params / 1e9:.1f} B parameters on {world_size} GPUs",
                 f"memory per GPU: {cost.memory_bytes / 2**30:.1f} GiB",
                 "communication per step: " + ", ".join(
                     f"{k} {v * 1e3:.1f} ms" for k, v in cost.comm_seconds.items() if v),
                 f"pipeline bubble: {cost.bubble:.0%}  ·  communication total {comm:.2f} s"]
        if measured and (dp, tp, pp) in measured:
            lines.append(f"measured here (gloo on CPU, the lesson's encoder): "
                         f"{measured[dp, tp, pp] * 1e3:.0f} ms per step")
        return "\n".join(lines)

    return describe


def layout_explorer(world_size: int, measured: dict[tuple[int, int, int], float] | None = None
                    ) -> Any:
    """Sliders for (dp, tp, pp): the predicted cost of the layout next to the measured step."""
    import ipywidgets as widgets

    describe = step_model(world_size, measured)
    powers = [2**i for i in range(int(math.log2(world_size)) + 1)]
    pick = {k: widgets.SelectionSlider(options=powers, value=1, description=k)
            for k in ("dp", "tp", "pp")}
    pick["dp"].value = world_size
    out = widgets.HTML()

    def show(*_: Any) -> None:
        text = describe(pick["dp"].value, pick["tp"].value, pick["pp"].value)
        out.value = "<pre>" + text + "</pre>"

    for w in pick.values():
        w.observe(show, names="value")
    show()
    return widgets.VBox([widgets.HBox(list(pick.values())), out])
