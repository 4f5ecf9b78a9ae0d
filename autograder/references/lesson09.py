"""The grader's answers for Lesson 09 (trusted only): fair-esm's own ``get_batch_indices`` for
the token-budget batches and the padding of random batches of the same mean size (9.2), torch's
``scaled_dot_product_attention`` on the whole sequence in one process (9.3), the unchunked
triangle-attention module (9.4), and the bounds ring attention and chunking promise, computed
from the sizes alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from autograder.lesson09 import (
    C_Z,
    CHUNK_RUNS,
    EDGE_RUNS,
    HEADS_TRI,
    METERED_CHUNK,
    METERED_L,
    RING_RUNS,
    kv_bytes,
    layouts,
    pair,
    peptide_lengths,
    ring_inputs,
    triangle,
)

# A bound's headroom over what the technique must hold: a correct variant's few extra buffers
# stay under it, the mistake it catches is several times over.
MARGIN = 1.25


# --------------------------------------------------------------------------- task 9.2


def fair_esm_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """fair-esm's own ``get_batch_indices`` on sequences of these lengths."""
    from esm.data import FastaBatchedDataset

    data = FastaBatchedDataset([str(i) for i in range(len(lengths))], ["A" * n for n in lengths])
    return data.get_batch_indices(max_tokens)


def fair_esm_layouts(seed: int, keys: list[str]) -> dict[str, tuple[list[list[int]], int]]:
    """For each named layout: fair-esm's batches and the world size they are dealt to."""
    named = layouts(seed)
    return {k: (fair_esm_batches(named[k][0], named[k][1]), named[k][2]) for k in keys}


def padding_of_random_batches(seed: int) -> dict[str, Any]:
    """AMPvsUniProt's lengths, fair-esm's batches under 1024 tokens, and the padding tokens of
    random fixed-size batches of the same mean size."""
    from kit.lessons.proteins import padded_tokens

    lengths = peptide_lengths("AMPvsUniProt")
    fair = fair_esm_batches(lengths, 1024)
    size = round(len(lengths) / len(fair))
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    random = padded_tokens(lengths, [order[i:i + size] for i in range(0, len(order), size)])
    return {"lengths": lengths, "fair": fair, "random": random}


# --------------------------------------------------------------------------- task 9.3


def sdpa(inputs: dict[str, Any]) -> torch.Tensor:
    """torch's SDPA on the whole sequence in one process. ``mask``: True = padding."""
    mask = inputs["mask"]
    attn_mask = None if mask is None else ~mask[:, None, None, :]  # True = take part
    return F.scaled_dot_product_attention(inputs["q"], inputs["k"], inputs["v"],
                                          attn_mask=attn_mask)


def sdpa_on_the_whole_sequence(seed: int, world_size: int) -> dict[str, Any]:
    """Every run's whole output and its tolerance."""
    return {name: (sdpa(ring_inputs(seed, world_size, dtype, padded)), tol)
            for name, (dtype, padded, tol) in RING_RUNS.items()}


def sdpa_edges(seed: int, world_size: int) -> dict[str, Any]:
    """SDPA's whole output on each edge run (a sequence all padding: 0 for its queries)."""
    return {name: (sdpa(ring_inputs(seed, world_size, dtype, padded)), tol)
            for name, (dtype, padded, tol) in EDGE_RUNS.items()}


def ring_growth_bound(seed: int) -> dict[str, float]:
    """A quarter of one K/V block pair: a ring's peak does not grow from W = 3 to 4 at a fixed
    L/W, one that keeps every block it received grows by a whole pair."""
    return {"bound": kv_bytes(4) / 4}


# --------------------------------------------------------------------------- task 9.4


def unchunked_outputs(seed: int) -> dict[str, Any]:
    """The module on the whole z for each run, with its length, chunk size and tolerance."""
    out = {}
    for name, (length, chunk, dtype, tol) in CHUNK_RUNS.items():
        with torch.no_grad():
            out[name] = (triangle(seed, dtype)(pair(seed, length, dtype)), length, chunk, tol)
    return out


def chunked_largest_bound(seed: int) -> dict[str, float]:
    """One block's logits: heads·chunk·L² values in float32, the largest tensor chunking needs."""
    return {"bound": HEADS_TRI * METERED_CHUNK * METERED_L**2 * 4}


def chunked_peak_bound(seed: int) -> dict[str, float]:
    """One block's logits and their softmax (heads·chunk·L² each), the output and its
    concatenation (L²·c_z each) and the bias (heads·L²), in float32."""
    length, chunk = METERED_L, METERED_CHUNK
    values = 2 * HEADS_TRI * chunk * length**2 + 2 * length**2 * C_Z + HEADS_TRI * length**2
    return {"bound": MARGIN * values * 4}
