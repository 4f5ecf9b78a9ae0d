"""Seeded bugs for Lesson 09: the typical mistakes each check of tasks 9.1-9.4 must catch.

``BUGS[task_id]`` lists ``(what is wrong, implementation)``; tests/test_checks.py proves every
one of them fails its task's checks. Each bug is a correct implementation with one step
replaced, written as a student would write it.
"""

from __future__ import annotations

import math
import types

import torch
import torch.distributed as dist
from torch.nn import functional as F

from bugs import edited_solution

CANONICAL = "ACDEFGHIKLMNPQRSTVWY"

# --------------------------------------------------------------------------- task 9.1

_SELECT = "    selected = (torch.rand(tokens.shape, generator=generator) < mask_prob) & ~special\n"
_LABELS = "labels = torch.where(selected, tokens, torch.full_like(tokens, -100))"


def _masking(*edits):
    return edited_solution(9, *edits).mask_tokens


mask_special_tokens = _masking((_SELECT, _SELECT.replace(" & ~special", "")))


# --------------------------------------------------------------------------- task 9.2

_SORTED = "    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):\n"
_SHUFFLE = ("    order = torch.randperm(len(batches),\n"
            "                           generator=torch.Generator().manual_seed(seed + "
            "epoch)).tolist()\n")
_PAD = ("    order = (order * math.ceil(total / len(order)))[:total]  # pad with the start of "
        "the order\n")
_BUILT = "    if current:\n        batches.append(current)\n"


def _batching(*edits):
    return edited_solution(9, *edits).token_budget_batches


def _dealt(make):
    """The solution's dealing of the batches ``make(batches, lengths, max_tokens, seed)`` gives
    instead of its own."""
    solution = edited_solution(9, (_BUILT, _BUILT + "    batches = _BATCHES(batches, lengths, "
                                   "max_tokens, seed)\n"))
    solution._BATCHES = make
    return solution.token_budget_batches


def _sixteen_by_length(batches, lengths, max_tokens, seed):
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[i:i + 16] for i in range(0, len(order), 16)]


def _random_of_the_same_mean_size(batches, lengths, max_tokens, seed):
    size = max(1, round(len(lengths) / max(1, len(batches))))
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    return [order[i:i + size] for i in range(0, len(order), size)]


def _from_fair_esm(batches, lengths, max_tokens, seed):
    """fair-esm's own FastaBatchedDataset.get_batch_indices builds the batches."""
    from esm.data import FastaBatchedDataset

    data = FastaBatchedDataset([str(i) for i in range(len(lengths))], ["A" * n for n in lengths])
    return data.get_batch_indices(max_tokens)


# --------------------------------------------------------------------------- task 9.3


def _ring(*edits):
    return edited_solution(9, *edits).ring_attention


_RETURN = "    return o / torch.where(s == 0, torch.ones_like(s), s)\n"
_HOARD = (("    block = [t.contiguous() for t in block]  # gloo sends contiguous tensors only\n",
           "    block = [t.contiguous() for t in block]  # gloo sends contiguous tensors only\n"
           "    kept = [block]\n"),
          ("            block = incoming\n",
           "            block = incoming\n"
           "            kept.append(block)  # kept, though the online softmax never looks again\n"))
_CONCATENATED = (  # attends over every block kept, put back in sequence order
    "    order = sorted(range(world_size), key=lambda i: (rank - i) % world_size)\n"
    "    k_all, v_all = (torch.cat([kept[i][j] for i in order], 2) for j in (0, 1))\n"
    "    scores = q @ k_all.transpose(-1, -2) / math.sqrt(dim)\n"
    "    if key_padding_mask is not None:\n"
    "        pad = torch.cat([kept[i][2] for i in order], 1)\n"
    "        scores = scores.masked_fill(pad[:, None, None, :], -math.inf)\n"
    "    return scores.softmax(-1).nan_to_num(0.0) @ v_all  # no real key: 0, as SDPA\n")


def all_gather_then_sdpa(q, k, v, key_padding_mask=None, group=None):
    """Wraps what the task re-implements: gathers K, V and the mask and calls torch's SDPA."""
    world_size = dist.get_world_size(group)
    ks = [torch.empty_like(k) for _ in range(world_size)]
    vs = [torch.empty_like(v) for _ in range(world_size)]
    dist.all_gather(ks, k.contiguous(), group=group)
    dist.all_gather(vs, v.contiguous(), group=group)
    attn_mask = None
    if key_padding_mask is not None:
        masks = [torch.empty_like(key_padding_mask) for _ in range(world_size)]
        dist.all_gather(masks, key_padding_mask.contiguous(), group=group)
        attn_mask = ~torch.cat(masks, dim=1)[:, None, None, :]
    return F.scaled_dot_product_attention(q, torch.cat(ks, 2), torch.cat(vs, 2),
                                          attn_mask=attn_mask)


def ring_by_direct_sends(q, k, v, key_padding_mask=None, group=None):
    """Point-to-point only, but every rank sends its block straight to every other rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    blocks = [t for t in (k, v, key_padding_mask) if t is not None]
    received = {rank: blocks}
    ops = []
    for peer in range(world_size):
        if peer != rank:
            received[peer] = [torch.empty_like(t) for t in blocks]
            ops += [dist.P2POp(dist.isend, t, peer) for t in blocks]
            ops += [dist.P2POp(dist.irecv, t, peer) for t in received[peer]]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    k_all = torch.cat([received[r][0] for r in range(world_size)], 2)
    v_all = torch.cat([received[r][1] for r in range(world_size)], 2)
    scores = q @ k_all.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if key_padding_mask is not None:
        mask = torch.cat([received[r][2] for r in range(world_size)], 1)
        scores = scores.masked_fill(mask[:, None, None, :], -math.inf)
    return scores.softmax(-1).nan_to_num(0.0) @ v_all  # a query with no real key: 0, as SDPA


# --------------------------------------------------------------------------- task 9.4


def _chunked(*edits):
    return edited_solution(9, *edits).chunked


_LOGITS = "logits = q @ k.transpose(-1, -2) / math.sqrt(c) + bias"
_LOOP = "        out[a:a + chunk_size] = attend(z[a:a + chunk_size])\n"


def calls_the_module(module, z, chunk_size):
    """The module's own forward on blocks of rows (what the task writes)."""
    bias = module.pair_bias(z)
    return torch.cat([module(z[a:a + chunk_size], bias) for a in range(0, z.shape[0], chunk_size)])


def _rows_forward(module, z_rows, bias):  # what _chunked_by_forward calls; swapped below
    raise NotImplementedError


def _chunked_by_forward(module, z, chunk_size):
    bias = module.bias(module.norm(z)).permute(2, 0, 1)
    return torch.cat([_rows_forward(module, z[a:a + chunk_size], bias)
                      for a in range(0, z.shape[0], chunk_size)])


def _with_copied_forward() -> types.FunctionType:
    """chunked whose _rows_forward is the module's own forward, copied at load time: a new
    function with its code (the source names neither forward nor the module's class)."""
    from kit.lessons import proteins

    code = proteins.TriangleAttentionStartingNode.forward.__code__
    copy = types.FunctionType(code, {**vars(proteins), "__name__": __name__}, "_rows_forward")
    return types.FunctionType(_chunked_by_forward.__code__, {**globals(), "_rows_forward": copy},
                              "chunked")


BUGS = {
    "9.1": [
        ("special tokens (cls, eos, pad) can be masked", mask_special_tokens),
        ("the 10% random replacement is drawn from all 33 tokens", _masking((
            "canonical = torch.tensor([alphabet.get_idx(a) for a in CANONICAL])",
            "canonical = torch.arange(len(alphabet.all_toks))"))),
        ("random replacement on 10% of the remaining 20% (2% instead of 10%)", _masking((
            "replace = selected & (split >= 0.8) & (split < 0.9)",
            "replace = selected & (split >= 0.8) & (split < 0.82)"))),
        ("uses the global random state, not the generator", _masking(
            (_SELECT, _SELECT.replace(", generator=generator", "")),
            ("split = torch.rand(tokens.shape, generator=generator)",
             "split = torch.rand(tokens.shape)"),
            ("torch.randint(len(canonical), tokens.shape, generator=generator)",
             "torch.randint(len(canonical), tokens.shape)"))),
        ("masks exactly 15% of every sequence", _masking((_SELECT, (
            "    scores = torch.rand(tokens.shape, generator=generator).masked_fill(special, 2.0)\n"
            "    n = (~special).sum(1, keepdim=True)\n"
            "    selected = scores.argsort(1).argsort(1) < (n * mask_prob).round()\n")))),
        ("ignores mask_prob", _masking((_SELECT, _SELECT.replace("< mask_prob", "< 0.15")))),
        ("labels hold the original token everywhere",
         _masking((_LABELS, "labels = tokens.clone()"))),
        ("one draw per sequence: whole sequences selected", _masking((_SELECT, (
            "    selected = (torch.rand((tokens.shape[0], 1), generator=generator) < mask_prob)\n"
            "    selected = selected.expand(tokens.shape) & ~special\n")))),
        ("labels only where <mask> went (not at the random or unchanged 20%)", _masking((
            _LABELS,
            "labels = torch.where(inputs == alphabet.mask_idx, tokens, torch.full_like(tokens, "
            "-100))"
        ))),
        ("forces one target in every sequence that has a residue (even at mask_prob = 0)",
         edited_solution(9, (
             "    selected = (torch.rand(tokens.shape, generator=generator) < mask_prob) & "
             "~special\n",
             "    selected = (torch.rand(tokens.shape, generator=generator) < mask_prob) & "
             "~special\n"
             "    draw = torch.rand(tokens.shape, generator=generator) * ~special\n"
             "    lonely = ~selected.any(1) & (~special).any(1)  # residues, but no target\n"
             "    selected[lonely, draw[lonely].argmax(1)] = True\n",
         )).mask_tokens),
        ("forces one target in every sequence, a special token where it has no residue",
         edited_solution(9, (
             "    selected = (torch.rand(tokens.shape, generator=generator) < mask_prob) & "
             "~special\n",
             "    selected = (torch.rand(tokens.shape, generator=generator) < mask_prob) & "
             "~special\n"
             "    if mask_prob > 0:  # every sequence gets at least one target\n"
             "        lonely = ~selected.any(1)\n"
             "        draw = torch.rand(tokens.shape, generator=generator) * ~special\n"
             "        selected[lonely, draw[lonely].argmax(1)] = True\n",
         )).mask_tokens),
        ("mask_prob outside [0, 1]: no ValueError",
         edited_solution(9, (
             "    if not 0 <= mask_prob <= 1:\n        raise ValueError(f\"mask_prob",
             "    if False:\n        raise ValueError(f\"mask_prob",
         )).mask_tokens),
    ],
    "9.2": [
        ("batches built per rank before dealing: ranks get different counts", _batching(
            (_SORTED, "    order = torch.randperm(len(lengths), generator=torch.Generator()"
                      ".manual_seed(seed + epoch)).tolist()\n"
                      "    for i in sorted(order[rank::world_size], key=lambda i: (lengths[i], "
                      "i)):\n"),
            ("    return [batches[b] for b in order[rank::world_size]]",
             "    return batches  # each rank batched its own share"))),
        ("no padding: the last ranks get one batch fewer", _batching((_PAD, ""))),
        ("drops the batches that do not divide evenly", _batching((_PAD, (
            "    order = order[:len(order) // world_size * world_size]  # drop the remainder\n")))),
        ("deals in length order, never shuffled",
         _batching((_SHUFFLE, "    order = list(range(len(batches)))\n"))),
        ("shuffled with Python's global random state", _batching((_SHUFFLE, (
            "    order = list(range(len(batches)))\n    random.shuffle(order)\n")),
            ("import math\n", "import math\nimport random\n"))),
        ("fixed 16 sequences per batch, sorted by length", _dealt(_sixteen_by_length)),
        ("random fixed-size batches of the same mean size", _dealt(_random_of_the_same_mean_size)),
        ("fair-esm's get_batch_indices builds the batches", _dealt(_from_fair_esm)),
    ],
    "9.3": [
        ("the softmax merged without rescaling by exp(m_old - m_new)", _ring(
            ("m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))",
             "m_new = scores.amax(dim=-1, keepdim=True)"),
            ("rescale = torch.exp(m - shift)", "rescale = torch.ones_like(m)"))),
        ("the mask travels the ring the wrong way", _ring((
            "                [dist.P2POp(dist.isend, t, right, group) for t in block]\n"
            "                + [dist.P2POp(dist.irecv, t, left, group) for t in incoming])",
            "                [dist.P2POp(dist.isend, t, right if i < 2 else left, group)\n"
            "                 for i, t in enumerate(block)]\n"
            "                + [dist.P2POp(dist.irecv, t, left if i < 2 else right, group)\n"
            "                   for i, t in enumerate(incoming)])"))),
        ("ignores the padding mask", _ring((
            "        if key_padding_mask is not None:\n            scores.masked_fill_(",
            "        if False:\n            scores.masked_fill_("))),
        ("W steps instead of W - 1", _ring(
            ("    for step in range(world_size):\n", "    for step in range(world_size + 1):\n"),
            ("        if step < world_size - 1:  # pass", "        if step < world_size:  # pass"),
            ("        if step < world_size - 1:\n            for w",
             "        if step < world_size:\n            for w"))),
        ("keeps every block and attends over their concatenation",
         _ring(*_HOARD, (_RETURN, _CONCATENATED))),
        ("all-gathers K/V and calls scaled_dot_product_attention (the forbidden route)",
         all_gather_then_sdpa),
        ("sends its block straight to every rank", ring_by_direct_sends),
        ("keeps every block it received (right values and traffic)", _ring(*_HOARD)),
        ("divides by a running sum of 0 where a sequence is all padding (nan, not SDPA's 0)",
         _ring((_RETURN, "    return o / s\n"))),
    ],
    "9.4": [
        ("chunks along the wrong axis (columns)", _chunked(  # each block of columns alone
            ("    def attend(z_rows):", "    def attend(z_rows, bias):"),
            ("        rows = z_rows.shape[0]\n", "        rows, length = z_rows.shape[:2]\n"),
            (_LOOP, "        s = slice(a, a + chunk_size)\n"
                    "        out[:, s] = attend(z[:, s], bias[:, s, s])\n"))),
        ("the triangle bias dropped", _chunked((_LOGITS, _LOGITS.replace(" + bias", "")))),
        ("the bias transposed (b_kj for b_jk)",
         _chunked((_LOGITS, _LOGITS.replace("+ bias", "+ bias.transpose(1, 2)")))),
        ("the softmax over the queries, not the keys",
         _chunked(("o = logits.softmax(dim=-1) @ v", "o = logits.softmax(dim=-2) @ v"))),
        ("blocks of chunk_size + 1 rows", _chunked((
            _LOOP, "        out[a:a + chunk_size] = attend(z[a:a + chunk_size + "
                   "1])[:chunk_size]\n"))),
        ("every row's logits at once", _chunked((
            "    for a in range(0, length, chunk_size):\n" + _LOOP,
            "    out[:] = attend(z)  # every row at once\n"))),
        ("the logits as a broadcast product summed over c", _chunked((_LOGITS, (
            "logits = (q[:, :, :, None, :] * k[:, :, None, :, :]).sum(-1) / math.sqrt(c) "
            "+ bias")))),
        ("calls the module's own forward and pair_bias", calls_the_module),
        ("runs a load-time copy of the module's forward", _with_copied_forward()),
        ("chunk_size below 1: no ValueError",
         _chunked(("    if chunk_size < 1:\n        raise ValueError(",
                   "    if False:\n        raise ValueError("))),
    ],
}
