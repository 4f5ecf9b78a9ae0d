"""Protein helpers for Lesson 09: real peptides, small ESM-2 models, AlphaFold's triangle
attention, and memory measured and predicted.

* Data: the labelled peptide sets that ship inside the ``modlamp`` wheel (no download), read
  with :func:`load_peptides` and tokenised with fair-esm's ESM-2 alphabet (:func:`tokenize`).
  :func:`read_fasta` reads a full-size FASTA (UniRef50) you fetched yourself.
* Models: :func:`small_esm2` builds fair-esm's own ``ESM2`` architecture with a tiny config,
  to be trained from scratch; :data:`ESM2_FAMILY` lists the published sizes, whose parameter
  counts :func:`esm2_parameter_count` computes on the meta device (no memory, no weights).
  :func:`load_pretrained_esm2` loads real weights only from a file you already have.
* AlphaFold 2: :class:`TriangleAttentionStartingNode` (Algorithm 13 of the AF2 supplement)
  with a record of the rows and logits each call saw; :func:`alphafold_pair_memory` and
  :func:`alphafold_memory_widget` predict its memory.
* :class:`LiveBytes` measures the peak bytes of tensors a block of code keeps alive (CPU has
  no ``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import math
import weakref
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "CANONICAL",
    "ESM2_FAMILY",
    "LiveBytes",
    "TriangleAttentionStartingNode",
    "alphabet",
    "alphafold_memory_widget",
    "alphafold_pair_memory",
    "esm2_parameter_count",
    "init_weights",
    "load_peptides",
    "load_pretrained_esm2",
    "padded_tokens",
    "read_fasta",
    "small_esm2",
    "tokenize",
]

CANONICAL = "ACDEFGHIKLMNPQRSTVWY"  # the 20 canonical amino acids

# The published ESM-2 models: name -> (layers, embedding dim, attention heads), from
# fair-esm's esm/pretrained.py and the ESM-2 paper (Lin et al., Science 2023).
ESM2_FAMILY: dict[str, tuple[int, int, int]] = {
    "esm2_t6_8M_UR50D": (6, 320, 20),
    "esm2_t12_35M_UR50D": (12, 480, 20),
    "esm2_t30_150M_UR50D": (30, 640, 20),
    "esm2_t33_650M_UR50D": (33, 1280, 20),
    "esm2_t36_3B_UR50D": (36, 2560, 40),
    "esm2_t48_15B_UR50D": (48, 5120, 40),
}

# modlamp/data/<name>.csv: a header "n,1,name of class 0,name of class 1", then "sequence,label".
PEPTIDE_SETS = ("AMPvsUniProt", "AMPvsTMset")


# --------------------------------------------------------------------------- data


def alphabet() -> Any:
    """fair-esm's ESM-2 alphabet (``esm.Alphabet`` "ESM-1b": <cls> first, <eos> last, 33 tokens)."""
    import esm

    return esm.Alphabet.from_architecture("ESM-1b")


def load_peptides(name: str = "AMPvsUniProt") -> tuple[list[str], torch.Tensor, list[str]]:
    """Real peptides with labels from the ``modlamp`` wheel: ``(sequences, labels, class_names)``.

    ``AMPvsUniProt``: 2,600 antimicrobial peptides from APD3 (label 1) and 2,600 random UniProt
    sequences of length 10-50 (label 0). ``AMPvsTMset``: 206 AMPs against 206 transmembrane
    helices.
    """
    if name not in PEPTIDE_SETS:
        raise ValueError(f"unknown peptide set {name!r}: choose one of {', '.join(PEPTIDE_SETS)}")
    try:
        text = resources.files("modlamp").joinpath("data", f"{name}.csv").read_text()
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("the peptide sets ship in the modlamp wheel: "
                                  "pip install modlamp") from e
    header, *rows = text.strip().splitlines()
    classes = header.split(",")[2:4]
    sequences, labels = [], []
    for row in rows:
        sequence, label = row.split(",")
        sequences.append(sequence.strip())
        labels.append(int(label))
    return sequences, torch.tensor(labels), classes


def read_fasta(path: str | Path) -> tuple[list[str], list[str]]:
    """``(labels, sequences)`` of a FASTA file, e.g. UniRef50 (tens of millions of sequences)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist. This course never downloads data. For the set ESM-2 was "
            "trained on, fetch UniRef50 yourself on a machine with internet: "
            "https://ftp.uniprot.org/pub/databases/uniprot/uniref/uniref50/uniref50.fasta.gz "
            "(tens of GB), gunzip it, and pass its path here.")
    from esm.data import FastaBatchedDataset

    data = FastaBatchedDataset.from_file(str(path))
    return list(data.sequence_labels), list(data.sequence_strs)


def tokenize(sequences: list[str], alphabet: Any) -> torch.Tensor:
    """``(batch, 2 + longest)`` int64: <cls> sequence <eos>, padded with <pad> on the right."""
    if not all(s.isalpha() for s in sequences):  # "<mask>" and friends: fair-esm's own parser
        _, _, tokens = alphabet.get_batch_converter()([(str(i), s) for i, s in
                                                       enumerate(sequences)])
        return tokens
    # Plain residues: one token per letter, as fair-esm's converter gives, 30x faster.
    longest = max((len(s) for s in sequences), default=0)
    tokens = torch.full((len(sequences), longest + 2), alphabet.padding_idx, dtype=torch.int64)
    tokens[:, 0] = alphabet.cls_idx
    for row, s in enumerate(sequences):
        tokens[row, 1:len(s) + 1] = torch.tensor([alphabet.get_idx(c) for c in s],
                                                 dtype=torch.int64)
        tokens[row, len(s) + 1] = alphabet.eos_idx
    return tokens


def padded_tokens(lengths: list[int], batches: list[list[int]]) -> int:
    """How many padding tokens ``batches`` hold when each is padded to its longest sequence."""
    return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches
               if b)


# --------------------------------------------------------------------------- models


def small_esm2(layers: int = 2, embed_dim: int = 64, heads: int = 4, seed: int = 0) -> nn.Module:
    """fair-esm's ``ESM2`` with a tiny config and fresh weights (``seed``), ready to train.

    The contact-prediction head is frozen: masked-language-model training never uses it, and a
    parameter without a gradient would stall DDP.
    """
    from esm.model.esm2 import ESM2

    torch.manual_seed(seed)
    model = ESM2(num_layers=layers, embed_dim=embed_dim, attention_heads=heads, alphabet=alphabet())
    model.contact_head.requires_grad_(False)
    return model


def esm2_parameter_count(name: str) -> int:
    """Parameters of a published ESM-2 model, counted on the meta device (allocates nothing)."""
    from esm.model.esm2 import ESM2

    if name not in ESM2_FAMILY:
        raise ValueError(f"unknown ESM-2 model {name!r}: choose one of {', '.join(ESM2_FAMILY)}")
    layers, dim, heads = ESM2_FAMILY[name]
    with torch.device("meta"):
        model = ESM2(num_layers=layers, embed_dim=dim, attention_heads=heads, alphabet=alphabet())
    return sum(p.numel() for p in model.parameters())


def init_weights(module: nn.Module) -> None:
    """Initialise one module of an ESM-2 built on the meta device, after ``to_empty``: every
    parameter and buffer is uninitialised memory then. Use as ``model.apply(init_weights)``.

    Layers get torch's default initialisation (``reset_parameters``, what fair-esm's ``ESM2``
    gets when built on a device), sharded DTensors included; the rotary embedding's
    ``inv_freq`` buffer, computed in its ``__init__``, is computed again, and the LM head's
    bias starts at zero.
    """
    from esm.modules import RobertaLMHead
    from esm.rotary_embedding import RotaryEmbedding

    if isinstance(module, RotaryEmbedding):
        half = module.inv_freq.numel()  # head_dim / 2
        steps = torch.arange(0, 2 * half, 2, device=module.inv_freq.device).float()
        with torch.no_grad():
            module.inv_freq.copy_(1.0 / (10000 ** (steps / (2 * half))))
    elif isinstance(module, RobertaLMHead):  # its weight is the embedding's; its bias starts at 0
        with torch.no_grad():
            module.bias.zero_()
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


def load_pretrained_esm2(name: str, path: str | Path | None = None) -> tuple[nn.Module, Any]:
    """``(model, alphabet)`` of a published ESM-2 from a checkpoint file you already have."""
    if name not in ESM2_FAMILY:
        raise ValueError(f"unknown ESM-2 model {name!r}: choose one of {', '.join(ESM2_FAMILY)}")
    path = (Path(path) if path is not None
            else Path(torch.hub.get_dir()) / "checkpoints" / f"{name}.pt")
    if not path.exists():
        raise FileNotFoundError(
            f"no weights for {name} at {path}. This course never downloads weights: lessons "
            "train small ESM-2 models from scratch. To use the real ones, download "
            f"https://dl.fbaipublicfiles.com/fair-esm/models/{name}.pt and "
            f"https://dl.fbaipublicfiles.com/fair-esm/regression/{name}-contact-regression.pt "
            "into the same folder (or run `python -c \"import esm; "
            f"esm.pretrained.{name}()\"` where you have internet), then pass path=.")
    import esm

    return esm.pretrained.load_model_and_alphabet_local(str(path))


# --------------------------------------------------------------------------- AlphaFold 2


class TriangleAttentionStartingNode(nn.Module):
    """AlphaFold 2's triangle attention around the starting node (supplement, Algorithm 13).

    Pair representation ``z`` is ``(L, L, c_z)``. Edge ``ij`` attends to every edge ``ik`` that
    starts at the same node ``i``, with a bias from the third edge ``jk``::

        a_ijk^h = softmax_k( q_ij^h . k_ik^h / sqrt(c) + b_jk^h )
        o_ij^h  = g_ij^h * sum_k a_ijk^h v_ik^h

    Row ``i`` of the output needs only row ``i`` of ``z`` plus the bias ``b`` (``(heads, L, L)``,
    from the whole of ``z``), so ``forward(z_rows, bias)`` evaluates any block of rows:
    ``module(z)`` is the whole thing, ``module(z[a:b], module.pair_bias(z))`` rows ``a:b``.

    Each call appends the number of rows it saw to ``rows_seen`` and keeps the largest logits
    tensor (elements, ``rows * heads * L * L``) in ``peak_logits``.
    """

    def __init__(self, c_z: int = 16, c: int = 8, heads: int = 4, seed: int = 0,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.c_z, self.c, self.heads = c_z, c, heads
        self.norm = nn.LayerNorm(c_z, dtype=dtype)
        self.qkv = nn.Linear(c_z, 3 * heads * c, bias=False, dtype=dtype)
        self.bias = nn.Linear(c_z, heads, bias=False, dtype=dtype)
        self.gate = nn.Linear(c_z, heads * c, dtype=dtype)
        self.out = nn.Linear(heads * c, c_z, dtype=dtype)
        with torch.no_grad():  # fixed weights: the same module for every seed-0 caller
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator, dtype=dtype) / math.sqrt(c_z))
        self.rows_seen: list[int] = []
        self.peak_logits = 0

    def pair_bias(self, z: torch.Tensor) -> torch.Tensor:
        """``(heads, L, L)``: the bias ``b_jk^h`` from the whole pair representation ``(L, L,
        c_z)``."""
        return self.bias(self.norm(z)).permute(2, 0, 1)

    def forward(self, z: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``(rows, L, c_z)``: the output rows for the rows ``z`` ``(rows, L, c_z)`` of the pair
        representation; ``bias`` from :meth:`pair_bias` of the whole ``z`` (default: ``z`` is
        whole)."""
        if z.dim() != 3 or z.shape[-1] != self.c_z:
            raise ValueError(f"z must be (rows, L, c_z={self.c_z}), got {tuple(z.shape)}")
        rows, length, _ = z.shape
        if bias is None:
            if rows != length:
                raise ValueError(f"z of shape {tuple(z.shape)} is a block of rows: pass "
                                 "bias=module.pair_bias(whole_z) as well")
            bias = self.pair_bias(z)
        if bias.shape != (self.heads, length, length):
            raise ValueError(f"bias {tuple(bias.shape)} does not fit rows of length {length}: "
                             f"expected ({self.heads}, {length}, {length}); a block of rows is "
                             "z[a:b] (the first axis), with the bias of the whole z")
        h, c = self.heads, self.c
        x = self.norm(z)
        # (rows, L, 3*h*c) -> 3 x (rows, h, L, c)
        q, k, v = self.qkv(x).view(rows, length, 3, h, c).permute(2, 0, 3, 1, 4)
        logits = q @ k.transpose(-1, -2) / math.sqrt(c) + bias  # (rows, h, L_j, L_k)
        self.rows_seen.append(rows)
        self.peak_logits = max(self.peak_logits, logits.numel())
        o = logits.softmax(dim=-1) @ v  # (rows, h, L, c)
        g = torch.sigmoid(self.gate(x)).view(rows, length, h, c).transpose(1, 2)
        return self.out((g * o).transpose(1, 2).reshape(rows, length, h * c))  # (rows, L, c_z)


def alphafold_pair_memory(length: int, c_z: int = 128, heads: int = 4, chunk: int | None = None,
                          bytes_per_value: int = 4, c: int = 32) -> dict[str, int]:
    """Bytes of one triangle-attention call on an ``(L, L, c_z)`` pair representation.

    ``pair``: the representation itself (L² c_z); ``qkv``: queries, keys and values of the
    rows in flight (rows·L·3·heads·c); ``logits``: heads·rows·L² attention logits (and as
    many probabilities after the softmax), with rows = L unchunked, else ``chunk``.
    """
    rows = length if chunk is None else min(chunk, length)
    b = bytes_per_value
    return {
        "pair": length * length * c_z * b,
        "qkv": rows * length * 3 * heads * c * b,
        "logits": heads * rows * length * length * b,
    }


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def alphafold_memory_widget() -> Any:
    """Sliders for L, c_z, heads, chunk size and precision; shows the bytes of one triangle
    attention (see :func:`alphafold_pair_memory`). A text table where ipywidgets is missing."""
    def table(length: int, c_z: int, heads: int, chunk: int, precision: str) -> str:
        b = {"fp32": 4, "bf16": 2}[precision]
        full = alphafold_pair_memory(length, c_z, heads, None, b)
        cut = alphafold_pair_memory(length, c_z, heads, chunk or None, b)
        lines = [f"L={length}, c_z={c_z}, heads={heads}, {precision}",
                 f"  pair representation        {_format_bytes(full['pair'])}",
                 f"  triangle logits, unchunked {_format_bytes(full['logits'])}",
                 f"  triangle logits, chunk={chunk or length:<5} {_format_bytes(cut['logits'])}"]
        return "\n".join(lines)

    try:
        import ipywidgets as w
    except ImportError:
        return table(384, 128, 4, 64, "bf16")
    # Labels in full: the default description width (about 8 characters) cuts longer ones.
    label = {"style": {"description_width": "initial"}, "layout": w.Layout(width="420px")}
    sliders = {
        "length": w.IntSlider(384, min=64, max=4096, step=64, description="L (residues)", **label),
        "c_z": w.IntSlider(128, min=16, max=256, step=16, description="c_z (pair channels)",
                           **label),
        "heads": w.IntSlider(4, min=1, max=16, description="heads", **label),
        "chunk": w.IntSlider(64, min=0, max=1024, step=16, description="chunk rows (0 = unchunked)",
                             **label),
        "precision": w.ToggleButtons(options=["fp32", "bf16"], value="bf16",
                                     description="precision",
                                     style={"description_width": "initial"},
                                     tooltips=["4 bytes per value", "2 bytes per value"]),
    }
    out = w.HTML()

    def update(*_: Any) -> None:
        out.value = "<pre>" + table(**{k: s.value for k, s in sliders.items()}) + "</pre>"

    for s in sliders.values():
        s.observe(update, names="value")
    update()
    return w.VBox([*sliders.values(), out])


# --------------------------------------------------------------------------- measuring


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors created inside the block and still alive (CPU or GPU).

    ``with LiveBytes() as m: f(x)`` then ``m.peak`` (bytes alive at the worst moment) and
    ``m.largest`` (the largest single tensor). Tensors that existed before the block are not
    counted; a view counts once with its base. Use it under ``torch.no_grad()``: tensors that
    autograd saves for backward outlive their Python objects and are not counted.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Otherwise torch wraps __torch_dispatch__ in torch._disable_dynamo, whose first call
        # imports torch._dynamo (seconds, in every rank); nothing here is compiled.
        return False

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.largest = 0
        self._refs: dict[int, list[int]] = {}  # storage address -> [python refs, nbytes]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        before = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, before)
        return out

    def _track(self, t: torch.Tensor, before: set[int]) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0:
            return
        if key not in self._refs:
            if key in before:  # a view or in-place result of a tensor made outside the block
                return
            self._refs[key] = [0, storage.nbytes()]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            self.largest = max(self.largest, storage.nbytes())
        self._refs[key][0] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        ref = self._refs.get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self._refs[key]
