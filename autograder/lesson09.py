"""Checks for Lesson 09, "Protein language models at scale": tasks 9.1-9.4.

* 9.1 ``mask_tokens``: ESM/BERT masking checked by its invariants, exactly, on real peptides;
  by its frequencies within binomial bounds (6 standard deviations) on a large batch; by
  per-sequence counts that vary as independent draws do; and by determinism under a generator.
* 9.2 ``token_budget_batches``: against fair-esm's own ``get_batch_indices`` (the batches) and
  ``DistributedSampler``'s padding rule (every rank the same count, repeats spread evenly).
* 9.3 ``ring_attention``: on real ranks against ``F.scaled_dot_product_attention`` on the whole
  sequence in one process; the recorder (:mod:`kit.trace`) must see only point-to-point
  traffic to the right neighbour, W-1 chunks of K and V; the meter (:mod:`kit.meter`) must
  never see an allocation as large as the gathered K/V or a full row of logits, nor a peak that
  grows with L at a fixed L/W.
* 9.4 ``chunked``: the student's own row-chunked triangle attention against the module's
  output; the meter measures the largest tensor the call allocates (one block's logits at most)
  and its peak bytes. The module's forward and pair_bias are forbidden.

One shared run per implementation, seed and world size serves every case reading it. The
answers (fair-esm's batches, SDPA on the whole sequence, the unchunked module) and the bounds
live in :mod:`autograder.references.lesson09`, named here by string.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from autograder.compare import per_rank, short
from autograder.registry import CheckFailed, assert_same, plain, task

SIGMAS = 6.0  # binomial bounds: a correct implementation fails about once in 5e8 draws


@functools.cache
def _alphabet() -> Any:
    from kit.lessons.proteins import alphabet

    return alphabet()


def _specials(alphabet: Any) -> list[int]:
    return [alphabet.cls_idx, alphabet.eos_idx, alphabet.padding_idx]


def _canonical(alphabet: Any) -> list[int]:
    from kit.lessons.proteins import CANONICAL

    return [alphabet.get_idx(a) for a in CANONICAL]


def _within(count: int, n: int, p: float) -> bool:
    return abs(count - n * p) <= SIGMAS * math.sqrt(n * p * (1 - p)) + 1


# --------------------------------------------------------------------------- task 9.1

# bounds nothing: masking is a sampling policy (which positions, what they become); it saves no
# memory or compute, and its checks are its invariants and its frequencies.
# forbids nothing: fair-esm has no masking code, and no installed library masks ESM tokens
# (transformers' DataCollatorForLanguageModeling is not a dependency).
MASK = task(
    "9.1",
    hint="BERT/ESM masking: every residue is chosen independently with probability mask_prob "
         "(special tokens never); a chosen one becomes <mask> 80% of the time, a random amino "
         "acid 10% and stays itself 10%, and only chosen positions carry a label. All "
         "randomness comes from the generator given, so the masking is reproducible.",
    recipe="Find the special positions (cls, eos, pad). Draw one uniform number per position "
           "with the generator; select the positions where it is below mask_prob and that are "
           "not special. Draw a second uniform number per position: below 0.8 a selected "
           "position becomes alphabet.mask_idx; from 0.8 to 0.9 it becomes a token drawn "
           "uniformly, with the generator, from the indices of the 20 canonical amino acids; "
           "otherwise it stays. Change a copy of the tokens. The labels are the original tokens "
           "where selected and -100 elsewhere; both results int64, shaped like the tokens.",
)


@functools.lru_cache(maxsize=8)
def _peptide_tokens(seed: int, n: int = 256) -> torch.Tensor:
    """``(n, L)`` real peptides from modlamp, tokenised with <cls>, <eos> and <pad>."""
    from kit.lessons.proteins import load_peptides, tokenize

    sequences, _, _ = load_peptides("AMPvsUniProt")
    pick = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(seed))[:n]
    return tokenize([sequences[i] for i in pick.tolist()], _alphabet())


@functools.lru_cache(maxsize=8)
def _uniform_tokens(seed: int, rows: int = 512, length: int = 130) -> torch.Tensor:
    """``(rows, length)``: uniform canonical amino acids between <cls> and <eos>, random padding."""
    alphabet = _alphabet()
    g = torch.Generator().manual_seed(seed + 1)
    canonical = torch.tensor(_canonical(alphabet))
    tokens = canonical[torch.randint(20, (rows, length), generator=g)]
    lengths = torch.randint(length // 2, length - 1, (rows,), generator=g)
    positions = torch.arange(length)
    tokens[:, 0] = alphabet.cls_idx
    tokens[positions[None, :] == lengths[:, None] + 1] = alphabet.eos_idx
    tokens[positions[None, :] > lengths[:, None] + 1] = alphabet.padding_idx
    return tokens


def _masked(mask_tokens: Any, tokens: torch.Tensor, seed: int, **kwargs: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    out = mask_tokens(tokens.clone(), _alphabet(), g, **kwargs)
    if not isinstance(out, tuple) or len(out) != 2:
        return {"result": f"a {type(out).__name__}", "inputs": None, "labels": None}
    return {"result": "a pair", "inputs": plain(out[0]), "labels": plain(out[1])}


def _check_pair(
    got: dict[str, Any], tokens: torch.Tensor, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if got["result"] != "a pair":
        raise CheckFailed(f"{where}: mask_tokens must return (inputs, labels)", expected="a pair",
                          got=got["result"])
    for name in ("inputs", "labels"):
        t = got[name]
        if not isinstance(t, torch.Tensor) or t.shape != tokens.shape or t.dtype != torch.int64:
            raise CheckFailed(f"{where}: {name} must be an int64 tensor shaped like tokens",
                              expected=f"int64 {tuple(tokens.shape)}",
                              got=f"{getattr(t, 'dtype', type(t).__name__)} "
                                  f"{tuple(getattr(t, 'shape', ()))}")
    return got["inputs"], got["labels"]


def _check_selection(
    inputs: torch.Tensor, labels: torch.Tensor, tokens: torch.Tensor, where: str
) -> None:
    """What labels say was selected: never a special token (and not simply everything)."""
    # Each failure names its cause, so a later case that trips on the same one is shown as
    # following from the first (results.settle), and says which tensor holds the mistake.
    alphabet = _alphabet()
    special = torch.isin(tokens, torch.tensor(_specials(alphabet)))
    chosen = labels != -100
    labelled = chosen[~special].float().mean().item() if (~special).any() else 0.0
    if ((chosen & special).any() and labelled > 0.9
            and torch.equal(inputs[special], tokens[special])):
        # Every position labelled and no special token touched: labels were never set to -100.
        raise CheckFailed(f"{where}: labels hold a token at {labelled:.0%} of the residues and at "
                          "every special token, where inputs left them alone",
                          expected="-100 where nothing was selected (about 85% of positions)",
                          got="the original token everywhere", cause="labels everywhere",
                          hint="labels mark what the model must predict: the selected positions "
                               "only. Everywhere else the label is -100, which the loss ignores.",
                          recipe="Start labels as a tensor of -100 shaped like the tokens and copy "
                                 "the original tokens into it at the selected positions only.")
    if (chosen & special).any():
        i = (chosen & special).nonzero()[0].tolist()
        raise CheckFailed(f"{where}: a special token (cls, eos or pad) was selected at {i}",
                          expected=-100, got=labels[tuple(i)].item(), cause="special selected",
                          hint="cls, eos and pad are not residues: they are never selected, so "
                               "the model is never asked to predict them.",
                          recipe="Exclude positions holding alphabet.cls_idx, eos_idx or "
                                 "padding_idx before choosing.")


def _check_invariants(
    inputs: torch.Tensor, labels: torch.Tensor, tokens: torch.Tensor, where: str
) -> None:
    alphabet = _alphabet()
    _check_selection(inputs, labels, tokens, where)
    special = torch.isin(tokens, torch.tensor(_specials(alphabet)))
    chosen = labels != -100
    labelled = chosen[~special].float().mean().item() if (~special).any() else 0.0
    if not torch.equal(labels[chosen], tokens[chosen]):
        raise CheckFailed(f"{where}: labels at selected positions must hold the original token",
                          expected="the original tokens", got="other values",
                          cause="labels not the original",
                          hint="Labels are what the model must predict: the original token at "
                               "every selected position.",
                          recipe="Take the labels from the tokens before you replace any.")
    bad = labels[~chosen]
    if (bad != -100).any():
        raise CheckFailed(f"{where}: labels must be -100 where nothing was selected",
                          expected=-100, got=bad[bad != -100][0].item(), cause="labels not -100")
    unlabelled_changes = ~chosen & (inputs != tokens)
    if unlabelled_changes.any():
        masked_only = bool(chosen.any()) and bool((inputs[chosen] == alphabet.mask_idx).all())
        became = inputs[unlabelled_changes]
        if masked_only and not (became == alphabet.mask_idx).any():
            # The changes without a label are all random residues: the 10% replaced positions
            # were selected, and only their labels are missing.
            raise CheckFailed(f"{where}: labels carry a token only where inputs became <mask>; "
                              f"{int(unlabelled_changes.sum())} positions replaced by a random "
                              "amino acid have label -100",
                              expected="labels at every selected position (about 15%)",
                              got=f"labels at the <mask> positions only ({labelled:.1%})",
                              cause="labels only at <mask>",
                              hint="labels mark every selected position, whatever inputs shows "
                                   "there: <mask> (80%), a random amino acid (10%) or the token "
                                   "itself (10%). The model must predict all of them.",
                              recipe="Set the labels from the selection itself, before the "
                                     "80/10/10 split: the original token wherever a position was "
                                     "selected, -100 elsewhere. Do not derive them from inputs.")
        raise CheckFailed(f"{where}: {int(unlabelled_changes.sum())} positions changed in inputs "
                          "but have label -100",
                          expected="inputs unchanged wherever the label is -100", got="changed",
                          cause="unlabelled change",
                          hint="labels and inputs describe one selection: a position that changes "
                               "in inputs was selected, so it needs its label; one that was not "
                               "selected must keep its token.",
                          recipe="Compute one boolean selection and use it for both: inputs change "
                                 "only inside it, labels are set exactly on it.")
    allowed = torch.tensor([alphabet.mask_idx, *_canonical(alphabet)])
    changed = chosen & (inputs != tokens)
    outside = changed & ~torch.isin(inputs, allowed)
    if outside.any():
        tok = inputs[outside][0].item()
        raise CheckFailed(f"{where}: a selected position became {alphabet.get_tok(tok)!r} "
                          f"(index {tok}), which is neither <mask> nor a canonical amino acid",
                          expected="<mask> or one of ACDEFGHIKLMNPQRSTVWY",
                          got=alphabet.get_tok(tok),
                          cause="replacement outside the amino acids",
                          hint="A random replacement is a plausible residue: one of the 20 "
                               "canonical amino acids, never a special or rare token.",
                          recipe="Draw the random replacement from the 20 canonical amino acids "
                                 "(their indices in the alphabet), not from the whole vocabulary.")


def _compare_invariants(got: Any, tokens: torch.Tensor) -> None:
    inputs, labels = _check_pair(got, tokens, "256 peptides")
    _check_invariants(inputs, labels, tokens, "256 peptides")
    if not (labels != -100).any():
        raise CheckFailed("256 peptides: nothing was selected", expected="about 15% of residues",
                          got=0)


@MASK.case("the invariants, exactly, on 256 real peptides (cls, eos and pad never selected)",
           compare=_compare_invariants, expect=lambda seed: _peptide_tokens(seed))
def _(mask_tokens: Any, seed: int) -> dict[str, Any]:
    return _masked(mask_tokens, _peptide_tokens(seed), seed)


def _compare_frequencies(got: Any, expected: dict[str, Any]) -> None:
    alphabet = _alphabet()
    for key, tokens in expected.items():
        p = float(key.split("=")[1])
        inputs, labels = _check_pair(got[key], tokens, key)
        _check_invariants(inputs, labels, tokens, key)
        eligible = ~torch.isin(tokens, torch.tensor(_specials(alphabet)))
        chosen = labels != -100
        n, k = int(eligible.sum()), int(chosen.sum())
        if not _within(k, n, p):
            raise CheckFailed(f"{key}: {k} of {n} eligible positions selected ({k / n:.4f})",
                              expected=f"{p} within binomial bounds", got=round(k / n, 4),
                              hint="Each eligible position is selected with probability "
                                   "mask_prob, the argument passed in.",
                              recipe="Compare one uniform draw per position with mask_prob (the "
                                     "argument, not a constant).")
        masked = int((inputs[chosen] == alphabet.mask_idx).sum())
        same = int((inputs[chosen] == tokens[chosen]).sum())
        replaced = k - masked - same
        # A random canonical token equals the original 1 time in 20: "unchanged" is 10% + 0.5%.
        for what, count, q in (("became <mask>", masked, 0.8), ("stayed unchanged", same, 0.105),
                               ("became another amino acid", replaced, 0.095)):
            if not _within(count, k, q):
                raise CheckFailed(f"{key}: {count / k:.4f} of the selected positions {what}",
                                  expected=q, got=round(count / k, 4),
                                  hint="Of the selected positions, 80% become <mask>, 10% a "
                                       "random amino acid and 10% stay unchanged.",
                                  recipe="Split the selected positions 80/10/10 with a second "
                                         "uniform draw: < 0.8 mask, 0.8-0.9 random, else keep.")
        draws = inputs[chosen & (inputs != tokens) & (inputs != alphabet.mask_idx)]
        counts = torch.bincount(draws, minlength=len(alphabet.all_toks))[_canonical(alphabet)]
        for aa, c in zip(_canonical(alphabet), counts.tolist()):
            if not _within(c, len(draws), 1 / 20):
                raise CheckFailed(f"{key}: the random replacements are not uniform over the 20 "
                                  f"amino acids ({alphabet.get_tok(aa)} drawn {c} times of "
                                  f"{len(draws)})", expected=round(len(draws) / 20, 1), got=c)


@MASK.case("frequencies within binomial bounds on 66,000 residues (mask_prob 0.15 and 0.3)",
           compare=_compare_frequencies, weight=2,
           expect=lambda seed: {"mask_prob=0.15": _uniform_tokens(seed),
                                "mask_prob=0.3": _uniform_tokens(seed + 7)})
def _(mask_tokens: Any, seed: int) -> dict[str, Any]:
    return {"mask_prob=0.15": _masked(mask_tokens, _uniform_tokens(seed), seed),
            "mask_prob=0.3": _masked(mask_tokens, _uniform_tokens(seed + 7), seed + 1,
                                     mask_prob=0.3)}


def _compare_independent(got: Any, tokens: torch.Tensor) -> None:
    inputs, labels = _check_pair(got, tokens, "per-sequence counts")
    # Counts mean nothing if the selection itself is wrong (specials chosen, labels everywhere):
    # that failure is the one to report, and it names the same cause as the case above.
    _check_selection(inputs, labels, tokens, "per-sequence counts")
    eligible = ~torch.isin(tokens, torch.tensor(_specials(_alphabet())))
    counts = (labels != -100).sum(1).double()
    sizes = eligible.sum(1).double()
    # Independent draws: each count is Binomial(size, 0.15); its variance is size * p * (1 - p).
    expected_var = (sizes * 0.15 * 0.85).mean().item()
    var = ((counts - sizes * 0.15) ** 2).mean().item()
    if var <= expected_var / 2:
        raise CheckFailed("the number of selected positions per sequence varies too little for "
                          "independent draws", expected=f"variance about {expected_var:.1f}",
                          got=round(var, 2), cause="counts vary too little",
                          hint="Positions are selected independently, so the count per "
                               "sequence varies like a binomial; a fixed share of every "
                               "sequence does not vary at all.",
                          recipe="Select each position on its own (a uniform draw < mask_prob); do "
                                 "not pick a fixed 15% of every sequence.")
    if var >= expected_var * 2:
        raise CheckFailed("the number of selected positions per sequence varies too much for "
                          "independent draws", expected=f"variance about {expected_var:.1f}",
                          got=round(var, 2), cause="counts vary too much",
                          hint="Independent draws with one probability give binomial counts; "
                               "more spread means positions are chosen together or with a "
                               "probability that differs from sequence to sequence.",
                          recipe="Draw one uniform number for every position (the tokens' full "
                                 "shape, not one per sequence or per batch) and select where it "
                                 "is below mask_prob, the same for every sequence.")


@MASK.case("each position independently (per-sequence counts vary as binomials do)",
           compare=_compare_independent, expect=lambda seed: _uniform_tokens(seed + 3))
def _(mask_tokens: Any, seed: int) -> dict[str, Any]:
    return _masked(mask_tokens, _uniform_tokens(seed + 3), seed + 2)


@MASK.case("the same generator state gives the same output; another seed another one",
           expect=lambda seed: {"same seed, same output": True,
                                "another seed, another output": True},
           hint="Reproducible masking: the output depends only on the generator given, not on "
                "torch's global random state.",
           recipe="Pass generator=generator to every torch.rand / torch.randint call.")
def _(mask_tokens: Any, seed: int) -> dict[str, Any]:
    tokens = _peptide_tokens(seed, 64)
    torch.manual_seed(seed + 11)
    first = _masked(mask_tokens, tokens, seed)
    torch.manual_seed(seed + 12)  # another global state: must not matter
    again = _masked(mask_tokens, tokens, seed)
    other = _masked(mask_tokens, tokens, seed + 1)
    return {"same seed, same output": _same(first, again),
            "another seed, another output": not _same(first, other)}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(isinstance(a[k], torch.Tensor) and isinstance(b[k], torch.Tensor)
               and torch.equal(a[k], b[k])
               for k in ("inputs", "labels"))


# --------------------------------------------------------------------------- 9.1 at the edges

OUT_OF_RANGE = (-0.1, 1.5)  # mask_prob values that are no probability


def _nothing_maskable(seed: int) -> dict[str, torch.Tensor]:
    """A batch whose second and third rows hold nothing maskable (<cls><eos> and padding, only
    padding), beside a real peptide; and a batch of no sequences (a rank that holds nothing)."""
    alphabet = _alphabet()
    row = _peptide_tokens(seed, 1)[0]
    specials = torch.full((2, len(row)), alphabet.padding_idx)
    specials[0, :2] = torch.tensor([alphabet.cls_idx, alphabet.eos_idx])
    return {"rows of only cls, eos and pad": torch.cat([row[None], specials]),
            "a batch of no sequences": torch.empty(0, len(row), dtype=torch.int64)}


def _guarded_mask(
    mask_tokens: Any, tokens: torch.Tensor, seed: int, **kwargs: Any
) -> dict[str, Any]:
    try:
        return _masked(mask_tokens, tokens, seed, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported by the edge's case
        return {"result": f"raised {type(e).__name__}: {e}"[:300], "inputs": None, "labels": None}


@MASK.shared
def _mask_edges(mask_tokens: Any, seed: int) -> dict[str, Any]:
    out = {"mask_prob = 0": _guarded_mask(mask_tokens, _peptide_tokens(seed), seed, mask_prob=0.0)}
    for name, tokens in _nothing_maskable(seed).items():
        out[name] = _guarded_mask(mask_tokens, tokens, seed)
    for prob in OUT_OF_RANGE:
        out[f"mask_prob = {prob}"] = _outcome(
            mask_tokens, _peptide_tokens(seed, 4).clone(), _alphabet(),
            torch.Generator().manual_seed(seed), mask_prob=prob)
    return out


def _nothing_selected(where: str, got: Any, tokens: torch.Tensor) -> None:
    inputs, labels = _check_pair(got, tokens, where)
    _check_invariants(inputs, labels, tokens, where)
    chosen = labels != -100
    if chosen.any():
        rows = sorted(set(chosen.nonzero()[:, 0].tolist()))
        raise CheckFailed(f"{where}: {int(chosen.sum())} positions selected, in rows {rows[:8]}",
                          expected="nothing selected: labels all -100, inputs equal to the tokens",
                          got=int(chosen.sum()), cause=f"selected at {where}",
                          hint="Every position is selected on its own draw, with probability "
                               "mask_prob: with mask_prob = 0 nothing is, and a sequence may end "
                               "up with no selected position at all. Forcing one per sequence "
                               "changes the probabilities the model is trained with.",
                          recipe="Select exactly the eligible positions whose draw is below "
                                 "mask_prob, and nothing else: no position added afterwards.")


def _compare_mask_prob_zero(got: Any, tokens: torch.Tensor) -> None:
    _nothing_selected("mask_prob = 0", got["mask_prob = 0"], tokens)


def _compare_nothing_maskable(got: Any, expected: dict[str, torch.Tensor]) -> None:
    for name, tokens in expected.items():
        have = got[name]
        if name == "a batch of no sequences":
            _check_pair(have, tokens, name)  # int64 (0, L) pairs
            continue
        inputs, labels = _check_pair(have, tokens, name)
        _check_invariants(inputs, labels, tokens, name)
        for row in (1, 2):
            if (labels[row] != -100).any():
                raise CheckFailed(f"{name}: row {row} holds nothing maskable, yet a position was "
                                  "selected", expected="labels all -100 in that row",
                                  got=labels[row].tolist(),
                                  hint="A sequence of only special tokens has nothing to mask: "
                                       "its labels stay -100 and its tokens unchanged.")


def _outcome(fn: Any, *args: Any, **kwargs: Any) -> dict[str, str]:
    """What ``fn(*args, **kwargs)`` did with an argument it must refuse: returned, or raised
    (and said what)."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - what it raised is the answer
        return {"raised": type(e).__name__, "message": str(e)[:300]}
    return {"returned": "a result"}


def _not_refused(got: Any, key: str, name: str, returned: str = "returned a result") -> str | None:
    """None when ``got[key]`` (an :func:`_outcome`) is a ValueError whose message names ``name``,
    else what the code did instead."""
    did = got.get(key, {}) if isinstance(got, dict) else {}
    if did.get("raised") == "ValueError" and name in did.get("message", ""):
        return None
    if "returned" in did:
        return returned
    return f"raised {did.get('raised')}: {did.get('message', '')}"


def _compare_out_of_range(got: Any, expected: Any) -> None:
    for prob in OUT_OF_RANGE:
        did = _not_refused(got, f"mask_prob = {prob}", "mask_prob")
        if did is not None:
            raise CheckFailed(
                f"mask_prob = {prob} is not a probability",
                expected="a ValueError naming mask_prob and its range [0, 1]", got=did,
                hint="A selection probability outside [0, 1] is a mistake of the caller: "
                     "comparing draws with it would select nothing or everything silently.",
                recipe="First thing: if not 0 <= mask_prob <= 1, raise ValueError(...) naming "
                       "mask_prob and the value given.")


MASK.case("mask_prob = 0: nothing selected, inputs unchanged (256 real peptides)", weight=0.5,
          uses=_mask_edges, compare=_compare_mask_prob_zero,
          expect=lambda seed: _peptide_tokens(seed))
MASK.case("nothing maskable: rows of only cls, eos and pad keep labels -100, and a batch of no "
          "sequences gives empty int64 results", weight=0.5, uses=_mask_edges,
          compare=_compare_nothing_maskable, expect=_nothing_maskable)
MASK.case(f"mask_prob outside [0, 1] ({OUT_OF_RANGE[0]}, {OUT_OF_RANGE[1]}): a ValueError naming "
          "mask_prob", weight=0.5, uses=_mask_edges, compare=_compare_out_of_range,
          expect=lambda seed: None)


# --------------------------------------------------------------------------- task 9.2

# bounds nothing beyond its value checks: each batch's padded size (longest length x size) stays
# within max_tokens because the batches must equal fair-esm's exactly, and the saving, padding
# tokens, is counted from the indices themselves in the "2x less padding" case.
BUDGET = task(
    "9.2",
    # fair-esm's own token-budget batching and batch converter, and DistributedSampler's dealing.
    forbidden=("esm.data.FastaBatchedDataset.get_batch_indices", "esm.data.BatchConverter",
               "torch.utils.data.DistributedSampler", "torch.utils.data.distributed"),
    hint="Token-budget batching groups sequences of similar length so that each batch holds at "
         "most max_tokens tokens with little padding. The batches are built once, from all the "
         "lengths, then dealt as DistributedSampler deals samples: every rank the same number, "
         "in an order fixed by (seed, epoch).",
    recipe="Sort the indices by (length, index). Walk them: if the current batch is not empty "
           "and its longest length times its size, with this sequence added, would exceed "
           "max_tokens, close it and start a new one; then add the sequence (so one longer than "
           "max_tokens gets a batch of its own). Shuffle the list of batches with torch.randperm "
           "and a torch.Generator seeded with seed + epoch. Pad the shuffled list by repeating "
           "it from its start until its length is a multiple of world_size (cycling more than "
           "once if there are fewer batches than ranks). Rank r takes the batches at positions "
           "r, r + world_size, r + 2 * world_size, and so on.",
)


def peptide_lengths(name: str) -> list[int]:
    """Token lengths of a modlamp peptide set's sequences."""
    from kit.lessons.proteins import load_peptides

    return [len(s) + 2 for s in load_peptides(name)[0]]  # + <cls> and <eos>


def layouts(seed: int) -> dict[str, tuple[list[int], int, int]]:
    """Name -> (lengths, max_tokens, world_size)."""
    g = torch.Generator().manual_seed(seed)
    mixed = (torch.randint(5, 60, (37,), generator=g)).tolist()
    return {
        "AMPvsUniProt (5,200 peptides), 1024 tokens, 4 ranks":
            (peptide_lengths("AMPvsUniProt"), 1024, 4),
        "AMPvsTMset (412 peptides), 600 tokens, 3 ranks": (peptide_lengths("AMPvsTMset"), 600, 3),
        "one sequence longer than max_tokens, 4 ranks": (mixed[:20] + [300] + mixed[20:], 120, 4),
        "all the same length, 4 ranks": ([17] * 45, 100, 4),
        "fewer batches than ranks (3 batches, 4 ranks)": (mixed[:9], 160, 4),
        "one batch, 2 ranks": ([12, 9, 30], 1000, 2),
        "37 random lengths, 64 tokens, 3 ranks": (mixed, 64, 3),
    }


def _deal(token_budget_batches: Any, lengths: list[int], max_tokens: int, world_size: int,
          seed: int, epoch: int) -> list[Any]:
    out = []
    for rank in range(world_size):
        got = token_budget_batches(list(lengths), max_tokens, rank, world_size, seed=seed,
                                   epoch=epoch)
        try:
            out.append([[int(i) for i in b] for b in got])
        except TypeError:
            out.append(f"a {type(got).__name__}, not a list of lists of indices")
    return out


def _check_deal(where: str, got: Any, fair: list[list[int]], world_size: int) -> None:
    if not isinstance(got, list) or len(got) != world_size:
        raise CheckFailed(f"{where}: one list of batches per rank expected", expected=world_size,
                          got=repr(got)[:200])
    for rank, batches in enumerate(got):
        if isinstance(batches, str):
            raise CheckFailed(f"{where}: rank {rank} returned {batches}")
    counts = [len(b) for b in got]
    per_rank = math.ceil(len(fair) / world_size)
    if len(set(counts)) != 1:
        raise CheckFailed(f"{where}: ranks get different numbers of batches {counts}: the rank "
                          "with fewer steps leaves the others waiting forever in a collective",
                          expected=[per_rank] * world_size, got=counts,
                          hint="Every rank must get the same number of batches: a rank with "
                               "fewer steps leaves the others waiting in a collective.",
                          recipe="Build all batches first, then deal them: pad the shuffled "
                                 "list by repeating its start until it divides by world_size.")
    want = {tuple(sorted(b)) for b in fair}
    have = [tuple(sorted(b)) for batches in got for b in batches]
    missing, extra = want - set(have), set(have) - want
    if missing or extra:
        sample = sorted(extra or missing)[0]
        raise CheckFailed(f"{where}: the batches are not fair-esm's get_batch_indices batches "
                          f"({len(missing)} of its {len(want)} batches missing, {len(extra)} "
                          "others)", expected=f"{len(want)} batches, e.g. {sorted(want)[0]}",
                          got=f"e.g. {'extra' if extra else 'missing'} batch {sample}",
                          hint="Over all ranks the batches must be exactly fair-esm's: a greedy "
                               "fill of the indices in length order under the token budget.",
                          recipe="Sort the indices by (length, index) and start a new batch when "
                                 "the longest length times the batch size would exceed max_tokens.")
    if counts[0] != per_rank:
        raise CheckFailed(f"{where}: {counts[0]} batches per rank for {len(fair)} batches on "
                          f"{world_size} ranks", expected=per_rank, got=counts[0])
    total = per_rank * world_size
    copies: dict[tuple[int, ...], int] = {}
    for b in have:
        copies[b] = copies.get(b, 0) + 1
    lo, hi = total // len(want), -(-total // len(want))
    if any(not lo <= c <= hi for c in copies.values()):
        raise CheckFailed(f"{where}: some batches are repeated more than others need",
                          expected=f"each batch {lo} or {hi} times",
                          got=sorted(set(copies.values())),
                          hint="Padding to a multiple of world_size repeats batches evenly, as "
                               "DistributedSampler does: no batch appears twice more than another.",
                          recipe="Pad as DistributedSampler does: repeat the start of the shuffled "
                                 "order, as often as needed, to reach a multiple of world_size.")


def _compare_layouts(got: Any, expected: dict[str, Any]) -> None:
    for key, (fair, world_size) in expected.items():
        _check_deal(key, got.get(key) if isinstance(got, dict) else None, fair, world_size)


def _budget_case(name: str, keys: list[str], hint: str = "", recipe: str = "") -> None:
    def run(token_budget_batches: Any, seed: int) -> dict[str, Any]:
        named = layouts(seed)
        return {k: _deal(token_budget_batches, *named[k], seed, 0) for k in keys}

    BUDGET.case(name, compare=_compare_layouts, hint=hint, recipe=recipe,
                expect=lambda seed: BUDGET.trusted("fair_esm_layouts")(seed, keys))(run)


_KEYS = list(layouts(0))
_budget_case("fair-esm's batches on the real peptide sets, the same count on every rank", _KEYS[:2])
_budget_case("adversarial lengths: one over-long sequence, all equal, fewer batches than ranks",
             _KEYS[2:],
             hint="A sequence longer than max_tokens still gets a batch of its own; with fewer "
                  "batches than ranks, repeat the batches until every rank has one.",
             recipe="Close a batch only when it holds something, so an over-long sequence opens "
                    "and fills a batch alone; when padding, cycle through the shuffled batches "
                    "as many times as needed to reach a multiple of world_size.")


_DETERMINISM = ("the same (seed, epoch) gives the same batches",
                "another epoch deals another order", "another seed deals another order",
                "not in length order")


@BUDGET.case("the deal is shuffled by (seed, epoch) and deterministic",
             expect=lambda seed: dict.fromkeys(_DETERMINISM, True),
             hint="The deal is a shuffle fixed by (seed, epoch): the same pair gives the same "
                  "batches, another pair another order, whatever the global random state.",
             recipe="Seed a torch.Generator with seed + epoch and use torch.randperm on the list "
                    "of batches; nothing else may be random.")
def _(token_budget_batches: Any, seed: int) -> dict[str, bool]:
    lengths, max_tokens, world_size = layouts(seed)["37 random lengths, 64 tokens, 3 ranks"]
    deal = functools.partial(_deal, token_budget_batches, lengths, max_tokens, world_size)
    first = deal(seed, 0)
    torch.manual_seed(seed + 5)  # the global random state must not matter
    return {"the same (seed, epoch) gives the same batches": first == deal(seed, 0),
            "another epoch deals another order": first != deal(seed, 1),
            "another seed deals another order": first != deal(seed + 1, 0),
            "not in length order": any(
                [max(lengths[i] for i in b) for b in r]
                != sorted(max(lengths[i] for i in b) for b in r)
                for r in first)}


def _compare_padding(got: Any, expected: dict[str, Any]) -> None:
    from kit.lessons.proteins import padded_tokens

    lengths = expected["lengths"]
    _check_deal("AMPvsUniProt", got, expected["fair"], 4)
    distinct = {tuple(sorted(b)) for r in got for b in r}
    ours = padded_tokens(lengths, [list(b) for b in distinct])
    if not ours * 2 <= expected["random"]:
        raise CheckFailed("token-budget batches must hold at least 2x fewer padding tokens than "
                          "random batches of the same mean size",
                          expected=f"<= {expected['random'] // 2}",
                          got=ours)


@BUDGET.case("at least 2x less padding than random fixed-size batches of the same mean size",
             compare=_compare_padding, expect="padding_of_random_batches")
def _(token_budget_batches: Any, seed: int) -> list[Any]:
    return _deal(token_budget_batches, peptide_lengths("AMPvsUniProt"), 1024, 4, seed, 1)


# --------------------------------------------------------------------------- task 9.3

RING = task(
    "9.3",
    forbidden=("torch.distributed.all_gather", "torch.distributed.all_gather_into_tensor",
               "torch.distributed.all_gather_object", "torch.distributed.all_to_all",
               "torch.distributed.all_to_all_single", "torch.distributed.broadcast",
               "torch.distributed.all_reduce",
               "torch.distributed._functional_collectives.all_gather_tensor",
               "torch.distributed._functional_collectives.all_gather_tensor_autograd",
               "torch.distributed.all_gather_single", "torch.distributed._all_gather_base",
               "torch.distributed.gather", "torch.distributed.broadcast_object_list",
               "torch.distributed.nn.functional",
               # torch's attention: sdpa, its C++ kernels (the flash one returns the log-sum-exp
               # an online softmax merges), flex_attention, and torch's own ring attention
               # (context parallelism)
               "torch.nn.functional.scaled_dot_product_attention",
               "torch._scaled_dot_product_flash_attention_for_cpu",
               "torch._scaled_dot_product_attention_math",
               "torch._scaled_dot_product_efficient_attention",
               "torch._scaled_dot_product_flash_attention",
               "torch._scaled_dot_product_cudnn_attention",
               "torch.nn.attention", "torch.distributed.tensor.experimental.context_parallel",
               "torch.distributed.tensor.experimental._attention",
               "torch.distributed.tensor.experimental._context_parallel"),
    hint="Ring attention: each rank keeps its queries while the blocks of keys and values "
         "travel around the ring, and merges every block into an online softmax (running max, "
         "running sum of exponentials, unnormalised output), so no rank ever holds all of K/V "
         "or a full row of scores.",
    recipe="Per query row start with a running max m of -inf, a running sum l of 0 and an "
           "output o of zeros. Do W steps, computing with the block you hold (your own K, V and "
           "mask first); in every step but the last, send that block (contiguous) to rank + 1 "
           "and receive the next from rank - 1 with isend/irecv (or batch_isend_irecv), waiting "
           "for them before the next step. For a block: scores = q k^T / sqrt(d), padded keys "
           "at -inf; m' = max(m, the block's row max); rescale o and l by exp(m - m'), then add "
           "exp(scores - m') times v to o and its row sums to l. Where m' is still -inf (every "
           "key so far is padding), subtract 0 instead, so no nan appears. Return o / l, "
           "dividing by 1 where l is 0 (a query with no real key: SDPA gives 0 there). With a "
           "group, turn the neighbours' group ranks into global ranks.",
)

BATCH, HEADS, CHUNK, DIM = 2, 2, 8, 8  # q, k, v on each rank: (BATCH, HEADS, CHUNK, DIM)


def ring_inputs(
    seed: int, world_size: int, dtype: torch.dtype, padded: bool | str
) -> dict[str, Any]:
    """The whole sequence: q, k, v ``(B, H, W*CHUNK, D)`` and the key padding mask ``(B, L)``.

    Chunks get very different scales (uneven-looking content: the running max moves), and
    sequence 1 ends after 1.5 chunks, so whole chunks of keys are padding on the last ranks.
    ``padded="all"``: sequence 1 is padding from its first token (a batch's empty slot), so
    every query of it has no key to attend to; SDPA returns 0 there.
    """
    g = torch.Generator().manual_seed(seed * 31 + world_size)
    length = world_size * CHUNK
    q, k, v = (torch.randn(BATCH, HEADS, length, DIM, generator=g, dtype=torch.float64)
               for _ in range(3))
    scale = torch.tensor([0.2, 2.5, 0.7, 4.0, 1.0, 3.0][:world_size], dtype=torch.float64)
    k = k * scale.repeat_interleave(CHUNK)[None, None, :, None]
    mask = None
    if padded:
        mask = torch.zeros(BATCH, length, dtype=torch.bool)
        real = 0 if padded == "all" else CHUNK + CHUNK // 2  # sequence 1: 12 real tokens (or none)
        mask[1, real:] = True  # then padding
        mask[0, 3] = True  # a pad in the middle of sequence 0, as after a crop
    return {"q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype), "mask": mask}


RING_RUNS = {  # name -> (dtype, padded, tolerance)
    "fp32, no padding": (torch.float32, False, 1e-5),
    "fp32, padding": (torch.float32, True, 1e-5),
    "fp64, padding": (torch.float64, True, 1e-10),
}
METERED = "fp32, padding"  # the run whose traffic and memory the checks read
# The edge: a sequence with no key at all (every query of it sees only padding).
EDGE_RUNS = {"fp32, sequence 1 all padding": (torch.float32, "all", 1e-5)}


def _ring_on_rank(ring_attention: Any, seed: int) -> dict[str, Any]:
    import torch.distributed as dist

    from kit import meter
    from kit.trace import trace

    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = slice(rank * CHUNK, (rank + 1) * CHUNK)
    out: dict[str, Any] = {}
    for name, (dtype, padded, _) in {**RING_RUNS, **EDGE_RUNS}.items():
        inputs = ring_inputs(seed, world_size, dtype, padded)
        q, k, v = (inputs[n][:, :, mine].clone() for n in ("q", "k", "v"))
        mask = None if inputs["mask"] is None else inputs["mask"][:, mine].clone()
        # This rank's q, k, v and mask exist before the track: what the ring allocates counts.
        with torch.no_grad(), trace() as t, meter.track() as usage:
            result = ring_attention(q, k, v, key_padding_mask=mask)
        out[name] = plain(result)
        if name == METERED:
            out["events"] = [{"op": e.op, "kind": e.kind, "peer": e.peer, "nbytes": e.nbytes}
                             for e in t.events]
            out["largest"], out["peak"] = usage.largest, usage.peak
    return out


_RING_RUNS = {w: RING.shared(_ring_on_rank, world_size=w, timeout=30.0) for w in (1, 2, 3, 4)}


def _compare_ring(got: Any, expected: dict[str, Any]) -> None:
    for name, (want, tol) in expected.items():
        world_size = want.shape[2] // CHUNK
        got = per_rank(got, world_size)
        for rank in range(world_size):
            have = got[rank][name]
            chunk = want[:, :, rank * CHUNK:(rank + 1) * CHUNK]
            where = f"{world_size} ranks, {name}, rank {rank}"
            if not isinstance(have, torch.Tensor) or have.shape != chunk.shape:
                raise CheckFailed(f"{where}: expected this rank's chunk of the output",
                                  expected=f"{chunk.dtype} {tuple(chunk.shape)}",
                                  got=f"{getattr(have, 'dtype', type(have).__name__)} "
                                      f"{tuple(getattr(have, 'shape', ()))}")
            if have.dtype != chunk.dtype:
                raise CheckFailed(f"{where}: wrong dtype", expected=chunk.dtype, got=have.dtype)
            diff = (have.double() - chunk.double()).abs().max().item()
            if not diff <= tol:  # also catches nan
                raise CheckFailed(f"{where}: differs from scaled_dot_product_attention on the "
                                  f"whole sequence by {diff:.3g} (tolerance {tol:g})",
                                  expected=short(chunk), got=short(have))


def _ring_case(world_size: int, name: str, hint: str = "") -> None:
    RING.case(name, uses=_RING_RUNS[world_size], pick=lambda ranks: [
                  {k: r[k] for k in RING_RUNS} if isinstance(r, dict) else r for r in ranks],
              compare=_compare_ring, hint=hint,
              expect=lambda seed: RING.trusted("sdpa_on_the_whole_sequence")(seed, world_size))


_ring_case(4, "equals scaled_dot_product_attention on the whole sequence: 4 ranks, fp32 and fp64, "
              "with and without padding")
_ring_case(3, "the same on 3 ranks")
_ring_case(2, "the same on 2 ranks")


def _compare_all_padding(got: Any, expected: dict[str, Any]) -> None:
    """SDPA gives 0 for a query whose every key is padding: a nan there names the regime."""
    for name, (want, _) in expected.items():
        world_size = want.shape[2] // CHUNK
        for rank, r in enumerate(per_rank(got, world_size)):
            have = r.get(name) if isinstance(r, dict) else r
            if isinstance(have, torch.Tensor) and have.shape == want[:, :, :CHUNK].shape \
                    and not torch.isfinite(have[1]).all():
                raise CheckFailed(
                    f"{world_size} rank{'s' if world_size > 1 else ''}, rank {rank}: "
                    "sequence 1 is all padding, so its queries "
                    "have no key to attend to, and your output there is not finite",
                    expected="0 there, as scaled_dot_product_attention returns",
                    got=short(have[1]),
                    hint="A query whose every key is padding ends with a running sum of 0 and an "
                         "output of 0: 0/0 is nan. Divide by 1 where the sum is 0, so the output "
                         "is 0, as SDPA's is.")
    _compare_ring(got, expected)


RING.case("a sequence that is all padding: 0, as scaled_dot_product_attention returns, not nan "
          "(4 ranks)", weight=0.5, uses=_RING_RUNS[4],
          pick=lambda ranks: [{k: r[k] for k in EDGE_RUNS} if isinstance(r, dict) else r
                              for r in ranks],
          compare=_compare_all_padding,
          expect=lambda seed: RING.trusted("sdpa_edges")(seed, 4))


def _compare_one_rank(got: Any, expected: dict[str, Any]) -> None:
    """One rank: the ring is the rank itself, its block its whole sequence, and nothing moves."""
    r = per_rank(got, 1)[0]
    if isinstance(r, dict) and r.get("events"):
        raise CheckFailed(f"one rank sent or received {len(r['events'])} message(s): with world "
                          "size 1 the ring is the rank itself and its block is the whole sequence",
                          expected="no message (W - 1 = 0 steps)",
                          got=sorted({e["op"] for e in r["events"]}),
                          hint="Exchange blocks in every step but the last: with W = 1 there is "
                               "only the last.")
    _compare_all_padding([{k: r[k] for k in expected} if isinstance(r, dict) else r], expected)


RING.case("one rank (world size 1): plain attention on its whole sequence, no message",
          weight=0.5, uses=_RING_RUNS[1],
          pick=lambda ranks: [{k: r[k] for k in (*RING_RUNS, *EDGE_RUNS, "events")}
                              if isinstance(r, dict) else r for r in ranks],
          compare=_compare_one_rank,
          expect=lambda seed: {**RING.trusted("sdpa_on_the_whole_sequence")(seed, 1),
                               **RING.trusted("sdpa_edges")(seed, 1)})


def kv_bytes(world_size: int) -> int:
    """One chunk of K and one of V, fp32 (the metered run)."""
    return 2 * BATCH * HEADS * CHUNK * DIM * 4


def _compare_traffic(got: Any, world_size: int) -> None:
    kv, mask = kv_bytes(world_size), BATCH * CHUNK
    low, high = (world_size - 1) * (kv + mask), (world_size - 1) * (kv + 8 * mask)
    for rank, r in enumerate(per_rank(got, world_size)):
        events = r["events"]
        collectives = sorted({e["op"] for e in events if e["kind"] != "p2p"})
        if collectives:
            raise CheckFailed(f"rank {rank} called {', '.join(collectives)}: ring attention moves "
                              "K and V with point-to-point calls only", expected="isend/irecv",
                              got=collectives)
        right, left = (rank + 1) % world_size, (rank - 1) % world_size
        sends = [e for e in events if e["op"] in ("send", "isend")]
        recvs = [e for e in events if e["op"] in ("recv", "irecv")]
        if not sends:
            raise CheckFailed(f"rank {rank} sent nothing the recorder saw", expected="W-1 sends",
                              got=0, hint="Use dist.isend/dist.irecv (or dist.batch_isend_irecv).")
        for e in sends:
            if e["peer"] != right:
                raise CheckFailed(f"rank {rank} sent to rank {e['peer']}: K, V and the mask all go "
                                  f"to the right neighbour {right}", expected=right, got=e["peer"])
        for e in recvs:
            if e["peer"] != left:
                raise CheckFailed(f"rank {rank} received from rank {e['peer']}: blocks come from "
                                  f"the left neighbour {left}", expected=left, got=e["peer"])
        sent = sum(e["nbytes"] for e in sends)
        if not low <= sent <= high:
            raise CheckFailed(f"rank {rank} sent {sent} bytes: {world_size - 1} steps of one K "
                              f"chunk, one V chunk ({kv} bytes together) and one mask chunk",
                              expected=f"{low} to {high}", got=sent,
                              hint="Exactly W-1 steps: each step passes on the block you hold "
                                   "(K, V, mask) and receives the next one.")


RING.case("only point-to-point traffic: W-1 steps of K, V and mask to the right neighbour",
          uses=_RING_RUNS[4], pick=lambda ranks: [{"events": r["events"]} for r in ranks],
          compare=_compare_traffic, expect=lambda seed: 4, saving=True)


def _compare_memory(got: Any, world_size: int) -> None:
    unit = BATCH * HEADS * CHUNK * max(CHUNK, DIM) * 4  # one block of logits, one chunk of K
    for rank, r in enumerate(per_rank(got, world_size)):
        if r["largest"] > 2.5 * unit:
            raise CheckFailed(
                f"rank {rank} created a tensor of {r['largest']} bytes: as large as the gathered "
                f"K or V ({world_size * BATCH * HEADS * CHUNK * DIM * 4} bytes) or a full row of "
                "logits, which ring attention never holds", expected=f"<= {int(2.5 * unit)} bytes",
                got=r["largest"], hint="Work one received block at a time and merge it into the "
                                       "running max, sum and output; never concatenate blocks.")


# The largest single allocation the meter saw (torch's allocator, C++ buffers included).
RING.case("never holds all of K/V: no tensor larger than two blocks (4 ranks)",
          uses=_RING_RUNS[4], pick=lambda ranks: [{"largest": r["largest"]} for r in ranks],
          compare=_compare_memory, expect=lambda seed: 4, weight=2, saving=True)


def _peak_growth(ring_attention: Any, seed: int) -> dict[str, Any]:
    """Each 4-rank peak minus the largest 3-rank peak: the same L/W, one more block of L."""
    three, four = _RING_RUNS[3](ring_attention, seed), _RING_RUNS[4](ring_attention, seed)
    base = max(r["peak"] for r in three)
    return {"measured": [r["peak"] - base for r in four]}


# What ring attention saves: its memory follows L/W, not L. From 3 to 4 ranks at the same L/W
# (8 tokens a rank) a ring holds the same blocks (the one in use and the one arriving), so its
# peak does not grow; a rank that keeps every block it received grows by one K/V block pair
# (2 KiB), 4x the bound of a quarter pair. (At W <= 4 the absolute peak cannot show it: keeping
# 3 received pairs beside the ring's own working set is at most 1.3x the ring's peak.)
RING.bound("growth of the peak bytes per rank from 3 to 4 ranks at the same L/W (fp32, padding)",
           formula="¼ of one K/V block pair, 2·B·H·(L/W)·D·4 / 4 bytes: per-rank memory grows with "
                   "L/W, not with L",
           lost="every K/V block the rank received stays alive: its memory grows with the whole "
                "sequence L, the saving ring attention exists for",
           hint="Ring attention holds a bounded number of K/V blocks whatever the ring's length: "
                "the one it computes with and the one arriving. A rank that keeps the blocks it "
                "has used needs memory for the whole sequence.",
           recipe="Once a block is merged into the running max, sum and output, drop every "
                  "reference to it (do not append it to a list or keep it for later): the "
                  "incoming block replaces it.",
           expect="ring_growth_bound", weight=3)(_peak_growth)


# --------------------------------------------------------------------------- task 9.4

# The module's own attention is what the task writes: calling its forward (module(z)) or its
# pair_bias scores 0. Its layers (norm, qkv, bias, gate, out) are plain nn.Linear/LayerNorm.
TRIANGLE = ("kit.lessons.proteins.TriangleAttentionStartingNode.forward",
            "kit.lessons.proteins.TriangleAttentionStartingNode.pair_bias")
CHUNKED = task(
    "9.4", forbidden=TRIANGLE,
    hint="Attention around the starting node treats each row i of the pair representation "
         "independently, except for the bias b_jk, which comes from every edge: compute the "
         "bias for all rows first, then the logits, softmax and output one block of rows at a "
         "time, so that no block's logits exist beside another's.",
    recipe="Build the bias (heads, L, L) from the module's bias layer on the layer-normed z, block "
           "by block of rows. Then for each block of at most chunk_size rows (the first axis): "
           "layer-norm it, project it to q, k, v and the gate, take q against every k of the same "
           "row divided by the square root of c, add the bias (the same for every row i), softmax "
           "over the keys (the last axis), weight v, gate with the sigmoid, apply the output layer "
           "and write the block into the output.",
)

C_Z, HEADS_TRI, C_TRI = 16, 4, 8


def triangle(seed: int, dtype: torch.dtype) -> Any:
    """The triangle-attention module every case and the reference use."""
    from kit.lessons.proteins import TriangleAttentionStartingNode

    return TriangleAttentionStartingNode(C_Z, C_TRI, HEADS_TRI, seed=seed, dtype=dtype)


def pair(seed: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """A random ``(L, L, c_z)`` pair representation."""
    return torch.randn(length, length, C_Z, generator=torch.Generator().manual_seed(seed + length),
                       dtype=dtype)


CHUNK_RUNS = {  # name -> (L, chunk_size, dtype, tolerance)
    "L=13, chunk 4 (the last chunk holds 1 row), fp64": (13, 4, torch.float64, 1e-10),
    "L=16, chunk 5, fp32": (16, 5, torch.float32, 1e-5),
    "L=9, chunk 1": (9, 1, torch.float64, 1e-10),
    "L=7, chunk 32 (one chunk)": (7, 32, torch.float64, 1e-10),
}
# The metered run: long enough that the whole logits (heads·L³ = 442,368 floats) dwarf a
# block's (heads·chunk·L² = 36,864) and the output (L²·c_z = 36,864).
METERED_L, METERED_CHUNK = 48, 4
BAD_CHUNKS = (0, -2)  # chunk sizes that make no block of rows: a ValueError


@CHUNKED.shared
def _run_chunked(chunked: Any, seed: int) -> dict[str, Any]:
    from kit import meter

    out: dict[str, Any] = {}
    for name, (length, chunk, dtype, _) in CHUNK_RUNS.items():
        module, z = triangle(seed, dtype), pair(seed, length, dtype)
        with torch.no_grad():
            result = chunked(module, z.clone(), chunk)
        out[name] = {"output": plain(result)}
    module, z = triangle(seed, torch.float32), pair(seed, METERED_L, torch.float32)
    with torch.no_grad(), meter.track() as usage:  # z exists before the track: not counted
        result = chunked(module, z, METERED_CHUNK)
    out["peak bytes"], out["largest bytes"] = usage.peak, usage.largest
    module, z = triangle(seed, torch.float64), pair(seed, 5, torch.float64)
    for chunk in BAD_CHUNKS:  # no block of rows at all: refused, not an empty or endless loop
        with torch.no_grad():
            out[f"chunk_size {chunk}"] = _outcome(chunked, module, z.clone(), chunk)
    return out


def _compare_bad_chunks(got: Any, expected: Any) -> None:
    for chunk in BAD_CHUNKS:
        did = _not_refused(got, f"chunk_size {chunk}", "chunk_size",
                           returned="returned a result (the output's rows never written)")
        if did is not None:
            raise CheckFailed(
                f"chunk_size {chunk}: no block of rows has {chunk} rows",
                expected="a ValueError naming chunk_size (it must be a positive integer)", got=did,
                hint="The rows go in blocks of chunk_size: a size below 1 gives no block (a "
                     "step of 0 is no loop, a negative one runs no step and leaves the output "
                     "unwritten). Refuse it with a message that names chunk_size.",
                recipe="First thing: if chunk_size < 1, raise ValueError(...) naming chunk_size "
                       "and the value given.")


def _compare_values(got: Any, expected: dict[str, Any]) -> None:
    for name, (want, _, _, tol) in expected.items():
        have = got[name]["output"]
        if (not isinstance(have, torch.Tensor) or have.shape != want.shape
                or have.dtype != want.dtype):
            raise CheckFailed(f"{name}: expected the whole output (L, L, c_z)",
                              expected=f"{want.dtype} {tuple(want.shape)}",
                              got=f"{getattr(have, 'dtype', type(have).__name__)} "
                                  f"{tuple(getattr(have, 'shape', ()))}")
        assert_same(have, want, rtol=0, atol=tol, path=f"{name}: output")


CHUNKED.case("equal to the module's output (fp64 within 1e-10, fp32 within 1e-5; blocks of 4 rows "
             "with a last block of 1, of 5, of 1, one block for all)",
             uses=_run_chunked, compare=_compare_values, expect="unchunked_outputs", weight=2)
# What chunking saves, measured twice on the allocator. The largest tensor: the logits of one
# block, heads·chunk·L² values (at L = 48, chunk 4 exactly the output's L²·c_z too); the whole
# logits are heads·L³, 12x that. The peak adds what a chunked call must hold beside one block's
# logits and their softmax: the bias and the output (with a concatenation). The solution peaks
# at 0.78 of it and its largest tensor is the bound exactly (a block's logits, as big as the
# output here); all logits at once are 12x the largest-tensor bound and 6.6x the peak's.
CHUNKED.bound("largest tensor chunked(module, z, 4) allocates on an L = 48 pair representation "
              "(fp32)",
              formula="heads · chunk · L² · 4 bytes: one block's logits",
              lost="a tensor larger than one block's logits is alive: chunking's heads·chunk·L² "
                   "in place of heads·L³ is lost",
              hint="The logits of a block of rows are (rows, heads, L, L): only chunk_size rows' "
                   "worth may exist at once, and nothing else (q, k, v, the gate, a broadcast "
                   "product) may be bigger, measured from torch's allocator.",
              recipe="Project, layer-norm and attend block by block of rows; compute the logits "
                     "as one matrix product of the block's queries with its keys, never as a "
                     "broadcast product summed afterwards.",
              expect="chunked_largest_bound", uses=_run_chunked, weight=1.25,
              pick=lambda got: ({"measured": [got["largest bytes"]]} if isinstance(got, dict)
                                else got))
CHUNKED.bound("peak bytes of chunked(module, z, 4) on an L = 48 pair representation (fp32)",
              formula="1.25 · (2·heads·chunk·L² + 2·L²·c_z + heads·L²) · 4 bytes: one block's "
                      "logits and softmax, the output and its concatenation, the bias",
              lost="the logits of the whole pair representation are alive at once: chunking's "
                   "heads·chunk·L² in place of heads·L³ is lost",
              hint="Chunking saves memory only if no computation, inside the module or around it, "
                   "ever holds the logits of more than chunk_size rows: the bytes are measured "
                   "from torch's allocator while the whole call runs.",
              recipe="Compute the logits, their softmax and the output block by block of at "
                     "most chunk_size rows, writing each block into the output before the next; "
                     "only the bias is built for every row.",
              expect="chunked_peak_bound", uses=_run_chunked, weight=1.25,
              pick=lambda got: {"measured": [got["peak bytes"]]} if isinstance(got, dict) else got)
CHUNKED.case(f"chunk_size below 1 ({BAD_CHUNKS[0]}, {BAD_CHUNKS[1]}): "
             "a ValueError naming chunk_size",
             weight=0.5, uses=_run_chunked, compare=_compare_bad_chunks, expect=lambda seed: None)
