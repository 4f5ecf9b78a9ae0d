# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lesson 09 · Protein language models at scale

# %% tags=["setup"]
import math

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch.nn import functional as F

from kit import LaunchError, check, launch
from kit.proteins import (
    CANONICAL,
    ESM2_FAMILY,
    LiveBytes,
    TriangleAttentionStartingNode,
    alphabet,
    alphafold_memory_widget,
    alphafold_pair_memory,
    esm2_parameter_count,
    load_peptides,
    load_pretrained_esm2,
    padded_tokens,
    small_esm2,
    tokenize,
)
from kit.trace import launch_traced, trace


# %% tags=["task-9.1"]
def mask_tokens(tokens, alphabet, generator, mask_prob=0.15):
    """Mask a (batch, length) int64 token batch for MLM: return (inputs, labels).

    Positions holding cls, eos or pad are never selected. Every other position is selected
    independently with probability ``mask_prob``. A selected position becomes
    ``alphabet.mask_idx`` with probability 0.8, a token drawn uniformly from the 20 canonical
    amino acids (``CANONICAL``) with probability 0.1, and stays unchanged otherwise.
    ``labels`` holds the original token at selected positions and -100 everywhere else.
    Every random number comes from ``generator``.
    """
    ### BEGIN SOLUTION
    special = (tokens == alphabet.cls_idx) | (tokens == alphabet.eos_idx) | (tokens == alphabet.padding_idx)
    selected = (torch.rand(tokens.shape, generator=generator) < mask_prob) & ~special
    split = torch.rand(tokens.shape, generator=generator)  # one draw decides 80 / 10 / 10
    canonical = torch.tensor([alphabet.get_idx(a) for a in CANONICAL])
    random_tokens = canonical[torch.randint(len(canonical), tokens.shape, generator=generator)]
    inputs = tokens.clone()
    inputs[selected & (split < 0.8)] = alphabet.mask_idx
    replace = selected & (split >= 0.8) & (split < 0.9)
    inputs[replace] = random_tokens[replace]
    labels = torch.where(selected, tokens, torch.full_like(tokens, -100))
    return inputs, labels
    ### END SOLUTION


# %% tags=["check-9.1"]
check("9.1", mask_tokens)


# %% tags=["task-9.2"]
def token_budget_batches(lengths, max_tokens, rank, world_size, seed=0, epoch=0):
    """This rank's token-budget batches (lists of dataset indices), dealt evenly to ranks.

    Build the batches from all the lengths as fair-esm's ``get_batch_indices(max_tokens)`` does:
    indices sorted by (length, index), a batch grows while (longest length) x (batch size) fits
    in ``max_tokens``. Then shuffle the list of batches with a generator seeded with
    ``seed + epoch``, repeat batches from the start of that order until the count divides by
    ``world_size`` (as ``DistributedSampler`` pads), and give this rank every
    ``world_size``-th batch starting at position ``rank``.
    """
    ### BEGIN SOLUTION
    batches, current, longest = [], [], 0
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        if current and max(longest, lengths[i]) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, lengths[i])
    if current:
        batches.append(current)
    if not batches:
        return []
    order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    total = math.ceil(len(order) / world_size) * world_size
    order = (order * math.ceil(total / len(order)))[:total]  # pad with the start of the order
    return [batches[b] for b in order[rank::world_size]]
    ### END SOLUTION


# %% tags=["check-9.2"]
check("9.2", token_budget_batches)


# %% tags=["task-9.3"]
def ring_attention(q, k, v, key_padding_mask=None, group=None):
    """This rank's chunk of softmax(q k^T / sqrt(d)) v over the whole ring-sharded sequence.

    ``q``, ``k``, ``v``: this rank's contiguous chunk ``(batch, heads, L / W, head_dim)``;
    ``key_padding_mask``: its chunk ``(batch, L / W)`` of the padding mask, True where the key
    is padding (ignored). K, V and the mask travel around the ring: in each of W - 1 steps a rank
    sends the block it holds to its right neighbour (rank + 1) and receives the next from its
    left neighbour, with point-to-point calls. Each block's scores merge into a running max, a
    running sum of exponentials and an unnormalised output (the online softmax). Forward only.
    """
    ### BEGIN SOLUTION
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    if group is not None:  # isend/irecv take global ranks
        right, left = dist.get_global_rank(group, right), dist.get_global_rank(group, left)
    batch, heads, chunk, dim = q.shape
    m = torch.full((batch, heads, chunk, 1), -math.inf, dtype=q.dtype)  # running max
    s = torch.zeros((batch, heads, chunk, 1), dtype=q.dtype)  # running sum of exp(score - m)
    o = torch.zeros_like(q)  # running unnormalised output
    block = [k, v] if key_padding_mask is None else [k, v, key_padding_mask]
    for step in range(world_size):
        if step < world_size - 1:  # pass the block on while computing with it
            incoming = [torch.empty_like(t) for t in block]
            works = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, t, right, group) for t in block]
                + [dist.P2POp(dist.irecv, t, left, group) for t in incoming])
        scores = q @ block[0].transpose(-1, -2) / math.sqrt(dim)  # (B, H, chunk, chunk)
        if key_padding_mask is not None:
            scores = scores.masked_fill(block[2][:, None, None, :], -math.inf)
        m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # all-pad rows so far
        p = torch.exp(scores - shift)
        rescale = torch.exp(m - shift)  # the old terms, re-expressed against the new max
        s = s * rescale + p.sum(dim=-1, keepdim=True)
        o = o * rescale + p @ block[1]
        m = m_new
        if step < world_size - 1:
            for w in works:
                w.wait()
            block = incoming
    return o / s
    ### END SOLUTION


# %% tags=["check-9.3"]
check("9.3", ring_attention)


# %% tags=["task-9.4"]
def chunked(module, z, chunk_size):
    """Triangle attention of the pair representation ``z`` ``(L, L, c_z)``, ``chunk_size`` rows at
    a time: the same ``(L, L, c_z)`` as ``module(z)``.

    ``module`` is a :class:`TriangleAttentionStartingNode`: ``module.pair_bias(z)`` is the bias
    ``(heads, L, L)`` from the whole of ``z``, and ``module(z_rows, bias)`` evaluates a block of
    rows ``z_rows = z[a:b]``. The module must never see more than ``chunk_size`` rows at once.
    """
    ### BEGIN SOLUTION
    bias = module.pair_bias(z)  # (heads, L, L), from every edge jk
    return torch.cat([module(z[start:start + chunk_size], bias)
                      for start in range(0, z.shape[0], chunk_size)])
    ### END SOLUTION


# %% tags=["check-9.4"]
check("9.4", chunked)
