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
# # {{title}}
#
# A protein is a string over an alphabet of 20 amino acids, so the machinery of language
# models applies to it almost unchanged. ESM-2 (Lin et al., *Science* 2023) is a BERT-style
# transformer trained to fill in masked residues of tens of millions of UniRef sequences; its
# embeddings predict structure and function. In this lesson you train a small ESM-2, built
# from fair-esm's own architecture, on real peptides across 4 ranks, and meet the two
# memory problems that shape protein models at scale: attention over long sequences, and
# AlphaFold 2's pair representation, which grows as L² and whose triangle attention grows
# as L³.
#
# **Prerequisites:** Lesson 03 (`DistributedSampler`, padding so that every rank takes the
# same number of steps), Lesson 05 (FSDP2's `fully_shard`, and counting training state per
# rank), Lesson 07 (bf16 autocast, activation checkpointing) and Lesson 08 (Megatron
# sequence parallelism). Point-to-point calls (`dist.isend`, `dist.irecv`) from Lesson 01.
#
# **You will be able to:**
# - tokenise proteins with fair-esm's `Alphabet` and say which ESM-2 sizes need FSDP;
# - mask tokens for masked-language-model pretraining, the 80/10/10 way ({{task 9.1}});
# - batch variable-length sequences by a token budget and deal the batches so that every rank
#   takes the same number of steps ({{task 9.2}});
# - train a small ESM-2 on 4 ranks with FSDP2, bf16 autocast (where the hardware has bf16)
#   and activation checkpointing, and probe what it learned;
# - compute attention over a sequence split across ranks with ring attention: K and V travel
#   around the ring, and an online softmax merges the pieces ({{task 9.3}});
# - predict AlphaFold 2's pair memory and cut triangle attention's peak by chunking
#   ({{task 9.4}}).

# %% tags=["setup"]
import math

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch.nn import functional as F

from kit import LaunchError, check, launch
from kit.lessons.precision import cpu_has_native_bf16
from kit.lessons.proteins import (
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

# %% [markdown]
# ## 1. Proteins as token sequences
#
# fair-esm's [`Alphabet`](https://github.com/facebookresearch/esm/blob/main/esm/data.py)
# for ESM-2 has 33 tokens: four special tokens at the front (`<cls>`, `<pad>`, `<eos>`,
# `<unk>`), the 20 canonical amino acids, the rare and ambiguous letters (`X`, `B`, `U`, `Z`,
# `O`), two gap symbols, a filler `<null_1>` and `<mask>`. The filler pads the 31 tokens
# before it to 32, a multiple of 8; `<mask>` comes after the padding, so the vocabulary
# itself (33) is not a multiple of 8.
# A sequence becomes `<cls>` residues `<eos>`, padded with `<pad>` on the right.

# %%
esm_alphabet = alphabet()
print(len(esm_alphabet.all_toks), "tokens:", " ".join(esm_alphabet.all_toks))
print("cls", esm_alphabet.cls_idx, "| pad", esm_alphabet.padding_idx, "| eos", esm_alphabet.eos_idx,
      "| mask", esm_alphabet.mask_idx)
print("canonical amino acids:", [esm_alphabet.get_idx(a) for a in CANONICAL])
print(tokenize(["GLWSKIK", "ACD"], esm_alphabet))

# %% [markdown]
# The data are real: the `modlamp` package ships **AMPvsUniProt**, 2,600 antimicrobial
# peptides (AMPs) from the APD3 database and 2,600 random UniProt sequences of 10 to 50
# residues, labelled 1 and 0. We pretrain on the sequences alone and keep the labels for a
# probe at the end. Full-size training data (UniRef50, about 60 million sequences) loads with
# `kit.lessons.proteins.read_fasta(path)` once you have downloaded it; the course never downloads.

# %%
sequences, labels, class_names = load_peptides("AMPvsUniProt")
lengths = [len(s) + 2 for s in sequences]  # + <cls> and <eos>
print(f"{len(sequences)} peptides, classes {class_names}, "
      f"lengths {min(lengths)}-{max(lengths)} tokens")
fig, ax = plt.subplots(figsize=(6, 2.5))
for label, name in enumerate(class_names):
    ax.hist([n for n, y in zip(lengths, labels.tolist()) if y == label], bins=range(5, 180, 4),
            alpha=0.6, label=name)
ax.set_xlabel("tokens per sequence")
ax.set_ylabel("sequences")
ax.legend()
plt.show()

# %% [markdown]
# ### The ESM-2 family and FSDP
#
# fair-esm publishes six ESM-2 sizes. We count their parameters by building each on the
# `meta` device (shapes only, no memory), then apply the accounting of Lesson 05: training
# with Adam in mixed precision keeps about **16 bytes per parameter** (bf16 weights and
# gradients, fp32 master weights and two fp32 Adam moments). DDP keeps all of it on every
# GPU; FSDP (ZeRO-3) divides it by the number of GPUs. Activations come on top.

# %%
BYTES_PER_PARAMETER = 16  # 2 (bf16 weights) + 2 (bf16 grads) + 4 (fp32 master) + 8 (Adam m, v)
GPU_BYTES = 80e9  # one 80 GB GPU
print(f"{'model':22} {'params':>8} {'DDP / GPU':>10}  smallest FSDP group that fits in half a GPU")
for name in ESM2_FAMILY:
    params = esm2_parameter_count(name)
    state = params * BYTES_PER_PARAMETER
    gpus = next(n for n in (1, 2, 4, 8, 16, 32, 64, 128) if state / n < GPU_BYTES / 2)
    print(f"{name:22} {params / 1e6:7.0f}M {state / 1e9:8.1f} GB  "
          f"{gpus} GPU{'s' if gpus > 1 else ''}")

# %% [markdown]
# Up to 650M the training state fits on one 80 GB GPU with room for activations, so DDP
# works. The 3B model's 45 GB does not leave half the GPU for activations: shard it over 2 or
# more GPUs. The 15B model's 240 GB needs FSDP over at least 8 GPUs, before activations.
# ("Half a GPU" is a rule of thumb: activations of long sequences, Section 4, take the rest.)
#
# ## 2. Masked-language-model pretraining
#
# ESM-2 learns by filling in blanks (BERT's recipe, Devlin et al. 2019): choose 15% of the
# residues, ask the model for the original token there, and score it with cross-entropy on
# those positions only. Of the chosen positions, 80% are replaced by `<mask>`, 10% by a random
# amino acid and 10% are left alone, so that the model cannot learn that "the answer is only
# needed where `<mask>` is" (at inference there are no masks). Special tokens are never
# chosen. The labels are the original tokens at chosen positions and -100 elsewhere, the
# `ignore_index` of [`F.cross_entropy`](https://pytorch.org/docs/stable/generated/torch.nn.functional.cross_entropy.html).
#
# ### Task 9.1: `mask_tokens`
#
# Write `mask_tokens(tokens, alphabet, generator, mask_prob=0.15) -> (inputs, labels)` for a
# `(batch, length)` int64 tensor. Select each non-special position independently with
# probability `mask_prob` (one uniform draw per position), split the selected ones 80/10/10
# with a second draw, and draw random tokens from the 20 canonical amino acids. Take every
# random number from `generator` (`torch.rand(..., generator=generator)`), so that a run can
# be replayed. The checks test the invariants exactly, the frequencies within binomial bounds
# on 66,000 residues, and replay, and the edges: `mask_prob=0` selects nothing, a row of only
# special tokens has nothing to select, and a `mask_prob` outside [0, 1] is a `ValueError`.
#
# fair-esm's model expects this recipe. `small_esm2` keeps `ESM2`'s default
# `token_dropout=True`: its forward sets the embedding of every `<mask>` token to zero and
# multiplies all embeddings by (1 − 0.15 · 0.8) / (1 − the sequence's share of `<mask>`
# tokens), counting every non-padding token, `<cls>` and `<eos>` included
# ([`esm/model/esm2.py`](https://github.com/facebookresearch/esm/blob/main/esm/model/esm2.py)).
# The constant 0.15 · 0.8 = 0.12 is the share of `<mask>` that 15% masking with 80% `<mask>`
# produces, so the factor is about 1 in training, and 0.88 at inference, where no token is
# `<mask>` (dropout's rescaling, for whole tokens). The constant stays 0.12 whatever
# `mask_prob` you pass: with `mask_prob=0.3` about 24% of the tokens are `<mask>` and the
# others reach the first layer scaled by 0.88 / 0.76 ≈ 1.16 in training, 16% louder than the
# 0.15 recipe makes them (the demo below uses 0.3 only to show more masks). To mask at
# another rate, change the constant too, or build `ESM2(..., token_dropout=False)`.

# %% tags=["task-9.1"]
def mask_tokens(tokens, alphabet, generator, mask_prob=0.15):
    """Mask a (batch, length) int64 token batch for MLM: return (inputs, labels).

    Positions holding cls, eos or pad are never selected. Every other position is selected
    independently with probability ``mask_prob``. A selected position becomes
    ``alphabet.mask_idx`` with probability 0.8, a token drawn uniformly from the 20 canonical
    amino acids (``CANONICAL``) with probability 0.1, and stays unchanged otherwise.
    ``labels`` holds the original token at selected positions and -100 everywhere else.
    Every random number comes from ``generator``.

    Edges: with mask_prob = 0 nothing is selected, and a row of only special tokens (or a batch
    of no rows) has nothing to select: its labels are all -100. A sequence may end up with no
    selected position; none is forced. A mask_prob outside [0, 1] is a ValueError.
    """
    ### BEGIN SOLUTION
    if not 0 <= mask_prob <= 1:
        raise ValueError(f"mask_prob must be a probability in [0, 1], got {mask_prob}")
    special = ((tokens == alphabet.cls_idx) | (tokens == alphabet.eos_idx)
               | (tokens == alphabet.padding_idx))
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


# %%
g = torch.Generator().manual_seed(0)
demo_tokens = tokenize(sequences[:3], esm_alphabet)
demo_inputs, demo_labels = mask_tokens(demo_tokens, esm_alphabet, g, mask_prob=0.3)
for row in range(3):
    shown = "".join("_" if t == esm_alphabet.mask_idx else esm_alphabet.get_tok(t)[0]
                    if t > 3 else "" for t in demo_inputs[row].tolist())
    print(f"{sequences[row]:55} -> {shown}")

# %% [markdown]
# ## 3. The data plane for variable lengths
#
# Peptides here run from 9 to 176 tokens; UniRef50 from a few to thousands. A batch is a
# rectangle, padded to its longest sequence, and every padding token costs compute and
# memory for nothing. Random batches of fixed size pad heavily. ESM's recipe is
# **token-budget batching**: sort by length and fill each batch while
# (longest length) × (sequences) stays within `max_tokens`. Short sequences come many to a
# batch, long ones few, and each batch holds sequences of similar length, so little padding
# ([fair-esm's `get_batch_indices`](https://github.com/facebookresearch/esm/blob/main/esm/data.py)).
#
# The batches then have to be dealt to ranks. Lessons 03 and 04 showed the trap: a rank that
# runs out of batches stops calling the collectives while the others wait for it forever. So
# build *all* the batches first, from all the lengths, then deal them like
# `DistributedSampler` deals samples: shuffle the list of batches with a generator seeded by
# `seed + epoch`, pad the list with its own start until it divides by `world_size`, and give
# rank `r` the batches at positions `r, r + W, r + 2W, ...`.
#
# ### Task 9.2: `token_budget_batches`
#
# Write `token_budget_batches(lengths, max_tokens, rank, world_size, seed=0, epoch=0)`
# returning this rank's batches (lists of dataset indices). Over all ranks, the batches must
# be exactly fair-esm's; every rank gets the same number; the deal must depend only on
# `(seed, epoch)`.

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
    order = torch.randperm(len(batches),
                           generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    total = math.ceil(len(order) / world_size) * world_size
    order = (order * math.ceil(total / len(order)))[:total]  # pad with the start of the order
    return [batches[b] for b in order[rank::world_size]]
    ### END SOLUTION


# %% tags=["check-9.2"]
check("9.2", token_budget_batches)


# %%
budget, world_size = 1024, 4
ours = [token_budget_batches(lengths, budget, r, world_size) for r in range(world_size)]
distinct = {tuple(b) for rank_batches in ours for b in rank_batches}
mean_size = round(len(sequences) / len(distinct))
order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(0)).tolist()
fixed = [order[i:i + mean_size] for i in range(0, len(order), mean_size)]
real = sum(lengths)
waste = {"random, fixed size": padded_tokens(lengths, fixed),
         "token budget": padded_tokens(lengths, [list(b) for b in distinct])}
print(f"{len(distinct)} token-budget batches of {mean_size} sequences on average; "
      f"{[len(b) for b in ours]} batches per rank")
for name, pad in waste.items():
    print(f"{name:20} {pad:7d} padding tokens = {pad / (real + pad):.1%} of the tokens computed")
# Batching each rank's share separately instead: the counts drift apart.
shares = [order[r::world_size] for r in range(world_size)]
per_rank = [len(token_budget_batches([lengths[i] for i in share], budget, 0, 1))
            for share in shares]
print("batches per rank when each rank batches its own share:", per_rank)
fig, ax = plt.subplots(figsize=(5, 2.2))
ax.barh(list(waste), [100 * p / (real + p) for p in waste.values()], color=["tab:red", "tab:green"])
ax.set_xlabel("padding, % of tokens computed")
plt.show()

# %% [markdown]
# ## 4. Training a small ESM-2 on 4 ranks
#
# Now the pieces together. `small_esm2()` builds fair-esm's
# [`ESM2`](https://github.com/facebookresearch/esm/blob/main/esm/model/esm2.py) (rotary
# position embeddings, pre-norm layers, an LM head tied to the embedding) with 2 layers of
# width 64: about 100,000 parameters instead of 650 million, but the same code. Each rank:
#
# 1. wraps every transformer layer in an activation checkpoint (Lesson 07: keep only each
#    layer's input, recompute the inside during backward);
# 2. shards each layer, then the whole model, with FSDP2's
#    [`fully_shard`](https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html)
#    (Lesson 05), the order torchtitan uses;
# 3. runs forward under [`torch.autocast`](https://pytorch.org/docs/stable/amp.html) in
#    bf16 and computes the loss in fp32. That pays only where the hardware multiplies bf16:
#    NVIDIA GPUs from Ampere (A100) on, and CPUs with AVX512-BF16 or AMX. Elsewhere the CPU
#    emulates bf16 and a step runs slower than in fp32 (1.6x for this lesson's model on the
#    course's 2-core test CPU, one thread per rank), so `BF16` below turns
#    autocast on only where the CPU has those instructions (`bf16=True` forces it);
# 4. takes its token-budget batches from Task 9.2 and masks them with Task 9.1.
#
# The loss is averaged over the masked tokens of all ranks (one small all-reduce per step) and
# reported with its perplexity, `exp(loss)`: 20 would mean a uniform guess among the amino acids.
# (The first steps' loss is far above ln 33 ≈ 3.5: fair-esm initialises the embedding, which the
# LM head shares, with unit-variance normal weights, so the first logits are large.)

# %%
STEPS, SPEED_STEPS = 200, 20  # training steps; steps of each short run for tokens per second
BF16 = cpu_has_native_bf16()  # bf16 autocast only where this CPU multiplies bf16 in hardware
print("bf16 autocast:", "on" if BF16 else "off (this CPU has no AVX512-BF16 or AMX: bf16 would "
      "be emulated, slower than fp32; on a GPU, train with bf16=True)")
# 4 in 5 for pretraining (and the probe's training set)
TRAIN = [i for i in range(len(sequences)) if i % 5]
TEST = [i for i in range(len(sequences)) if i % 5 == 0]  # 1 in 5 held out for the probe


def train_mlm(strategy="fsdp2", steps=STEPS, max_tokens=1024, lr=4e-3, checkpointing=True,
              bf16=BF16, seed=0):
    """One rank's MLM training; returns per-step global losses, tokens/s and rank 0's full
    weights."""
    import time

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    rank, world_size = dist.get_rank(), dist.get_world_size()
    vocab = alphabet()
    model = small_esm2(seed=seed)
    if checkpointing:
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)  # state_dict names stay the same
    if strategy == "fsdp2":
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        trained = model
    else:
        trained = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(seed * 1000 + rank)  # each rank masks differently
    train_lengths = [lengths[i] for i in TRAIN]
    losses, tokens_seen, step, epoch = [], 0, 0, 0
    start = time.perf_counter()
    while step < steps:
        for batch in token_budget_batches(train_lengths, max_tokens, rank, world_size, seed, epoch):
            if step == steps:
                break
            tokens = tokenize([sequences[TRAIN[i]] for i in batch], vocab)
            inputs, targets = mask_tokens(tokens, vocab, generator)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = trained(inputs)["logits"]  # (B, T, 33)
            loss_sum = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                       reduction="sum")
            count = (targets != -100).sum()
            (loss_sum / count.clamp(min=1)).backward()
            optimizer.step()
            optimizer.zero_grad()
            total = torch.stack([loss_sum.detach(), count.float()])
            dist.all_reduce(total)  # the global mean over every rank's masked tokens
            losses.append((total[0] / total[1]).item())
            tokens_seen += int((tokens != vocab.padding_idx).sum())
            step += 1
        epoch += 1
    seconds = time.perf_counter() - start
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v
             for k, v in model.state_dict().items()}
    return {"losses": losses, "tokens": tokens_seen, "seconds": seconds,
            "state": state if rank == 0 else None}


try:
    runs = launch(train_mlm, "fsdp2", world_size=4, timeout=600)
except LaunchError as e:
    print(e)
    raise
losses = runs[0]["losses"]
print(f"{len(losses)} steps: MLM loss {sum(losses[:10]) / 10:.3f} (first 10) -> "
      f"{sum(losses[-10:]) / 10:.3f} (last 10); perplexity {math.exp(sum(losses[-10:]) / 10):.1f}")

# %%
smooth = torch.tensor(losses).unfold(0, 10, 1).mean(1)
fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3))
left.plot(losses, alpha=0.3, label="per step")
left.plot(range(9, len(losses)), smooth, label="mean of 10")
left.axhline(math.log(20), color="grey", ls="--", label="uniform over 20 amino acids")
left.set_xlabel("step (4 ranks, 1024-token batches each)")
left.set_ylabel("MLM loss (nats)")
left.legend()
right.plot(range(9, len(losses)), smooth.exp())
right.set_xlabel("step")
right.set_ylabel("perplexity")
plt.tight_layout()
plt.show()

# %% [markdown]
# ### DDP against FSDP2
#
# The same function with `strategy="ddp"` keeps a whole copy of the model on every rank and
# all-reduces gradients once per step; FSDP2 all-gathers each layer's parameters before
# using them (in forward, and again in backward) and reduce-scatters the gradients. On a
# model this small FSDP2 only adds communication; it exists for models whose state does not
# fit on one device (the table in Section 1). `benchmarks/esm_tokens_per_second.py` runs the
# two side by side with repeats; here is one short run of each:

# %%
speed = {}
for strategy in ("ddp", "fsdp2"):
    result = launch(train_mlm, strategy, steps=SPEED_STEPS, world_size=4, timeout=300)
    speed[strategy] = sum(r["tokens"] for r in result) / max(r["seconds"] for r in result)
    print(f"{strategy:6} {speed[strategy]:8.0f} tokens/s over 4 ranks")
print(f"FSDP2 / DDP: {speed['fsdp2'] / speed['ddp']:.2f}x")

# %% [markdown]
# ### What did it learn? A linear probe
#
# A standard test of a protein language model: freeze it, average its last layer over each
# sequence's residues, and fit a logistic regression on those embeddings to predict a label
# it never saw: antimicrobial or not. We compare the pretrained weights with the same
# architecture at random initialisation, and with a probe on plain amino-acid composition
# (20 numbers per sequence), which is the bar any embedding has to clear on peptides.

# %%
def embed_on_rank(state, indices):
    """One rank's share of the embeddings: {dataset index: (dim,) mean over its residues of the
    last layer}. Inference needs no communication: deal token-budget batches (Task 9.2)."""
    model = small_esm2(seed=1)  # random initialisation, unless trained weights are given
    if state is not None:
        model.load_state_dict(state)
    model.eval()
    out = {}
    batches = token_budget_batches([lengths[i] for i in indices], 4096, dist.get_rank(),
                                   dist.get_world_size())
    for batch in batches:
        tokens = tokenize([sequences[indices[j]] for j in batch], esm_alphabet)
        with torch.no_grad():
            rep = model(tokens,
                        repr_layers=[len(model.layers)])["representations"][len(model.layers)]
        residue = (tokens > 3).unsqueeze(-1)  # not cls, pad, eos, unk
        for j, vector in zip(batch, (rep * residue).sum(1) / residue.sum(1)):
            out[indices[j]] = vector
    return out


def embed(state, indices):
    """(n, dim) embeddings of ``indices``, computed on 4 ranks."""
    found = {}
    for part in launch(embed_on_rank, state, indices, world_size=4):
        found.update(part)
    return torch.stack([found[i] for i in indices])


def composition(indices):
    tokens = tokenize([sequences[i] for i in indices], esm_alphabet)
    counts = torch.stack([(tokens == esm_alphabet.get_idx(a)).sum(1) for a in CANONICAL], 1).float()
    return counts / counts.sum(1, keepdim=True)


def probe_accuracy(train_x, test_x, steps=100):
    """Test accuracy of a logistic regression fitted on the training embeddings."""
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    train_x, test_x = (train_x - mean) / std, (test_x - mean) / std
    y_train, y_test = labels[TRAIN].float(), labels[TEST].float()
    w = torch.zeros(train_x.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = (F.binary_cross_entropy_with_logits(train_x @ w + b, y_train)
                + 1e-3 * w.square().sum())
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return ((test_x @ w + b > 0).float() == y_test).float().mean().item()


trained = runs[0]["state"]
probe = {"amino-acid composition": probe_accuracy(composition(TRAIN), composition(TEST)),
         "ESM-2, random init": probe_accuracy(embed(None, TRAIN), embed(None, TEST)),
         "ESM-2, pretrained": probe_accuracy(embed(trained, TRAIN), embed(trained, TEST))}
for name, accuracy in probe.items():
    print(f"{name:24} test accuracy {accuracy:.3f}")
fig, ax = plt.subplots(figsize=(5, 2.2))
ax.barh(list(probe), list(probe.values()), color=["grey", "tab:red", "tab:green"])
ax.set_xlim(0.5, 1.0)
ax.set_xlabel(f"AMP vs UniProt, test accuracy ({len(TEST)} peptides)")
plt.show()

# %% [markdown]
# Read the bars honestly. In our runs the pretrained embeddings beat random initialisation and
# composition by a few points only: a few hundred tiny steps teach the model little beyond
# residue statistics, and composition alone already separates these two sets well (AMPs are
# rich in K, R and hydrophobic residues). Real ESM-2 models train for 500,000 steps of about
# 2 million tokens each; what transfers from this lesson is the machinery, not the numbers.
#
# ## 5. Long sequences: ring attention
#
# Attention's scores for one head are an L × L matrix. For a 4,096-residue protein, 20
# heads and bf16 that is 640 MiB per layer and sequence, recomputed or stored for backward.
# FlashAttention avoids storing it on one GPU; beyond one GPU's memory, **context
# parallelism** splits the sequence itself across ranks. Each rank holds a contiguous chunk
# of L / W queries, keys and values.
#
# One way is to all-gather K and V: every rank then holds the whole K and V (O(L) memory per
# rank again) and, with plain attention, a chunk × L block of scores. **Ring attention**
# (Liu et al. 2023) never holds more than one block: in W − 1 steps each rank passes the K/V
# block it holds to its right neighbour and receives the next from its left, computing with
# each block as it arrives (left; torch's default, one all-gather, on the right):

# %%
from kit.lessons import figures

figures.ring_rotation(world_size=4)
plt.show()

# %% [markdown]
# Softmax is not computed block by block directly, but it can be
# merged with the **online softmax** trick (Milakov and Gimelshein 2018, the heart of
# FlashAttention): keep, per query row, the running max `m`, the running sum `l` of
# `exp(score - m)` and the unnormalised output `o`. A new block with scores `S` and values
# `V` updates them as
#
# $$m' = \max(m, \max_k S_k), \quad l' = l\,e^{m - m'} + \sum_k e^{S_k - m'}, \quad
# o' = o\,e^{m - m'} + \sum_k e^{S_k - m'} V_k,$$
#
# and the answer is `o / l` after the last block. The factor `exp(m - m')` rescales what was
# accumulated against the old max; forget it and every block's weights are on a different
# scale. Padded keys get a score of −∞; a row whose blocks so far are all padding has
# `m = −∞`, which must not turn into `nan`.
#
# How this ties to Lesson 08: Megatron **sequence parallelism** shards the sequence only in the
# layer norms and dropout between tensor-parallel regions and all-gathers it back before
# attention, so attention still sees the whole sequence. Context parallelism shards attention
# itself, and composes with tensor and sequence parallelism on a 2-D mesh. torch ships it as
# the experimental
# [`torch.distributed.tensor.experimental.context_parallel`](https://pytorch.org/docs/stable/distributed.tensor.html),
# which torchtitan uses with SDPA on GPUs. Its default way to move K and V is the all-gather:
# `set_rotate_method("allgather")` (the default in torch 2.13) gathers every rank's K/V in one
# collective, started while the rank computes with its own block, then runs SDPA block by
# block and merges the blocks' log-sum-exps, so no chunk × L score block exists either;
# `set_rotate_method("alltoall")` passes the blocks around the ring, one exchange per step, as
# you will. The all-gather wins while the whole sequence's K and V fit beside the rest (they
# are small: 2 · L · head_dim values per head, less with grouped-query attention): one
# collective, with a single latency. The ring wins when they do not, since a rank then holds
# only two K/V blocks at a time.
#
# ### Task 9.3: `ring_attention`
#
# Write `ring_attention(q, k, v, key_padding_mask=None, group=None)`. `q`, `k`, `v` are this
# rank's chunk `(batch, heads, L/W, head_dim)`; `key_padding_mask` its chunk `(batch, L/W)`,
# True at padding. K, V and the mask travel to the right with `dist.isend`/`dist.irecv` (or
# `dist.batch_isend_irecv`, which posts them together); return this rank's chunk of
# `softmax(q kᵀ / √d) v`. Forward only. The checks compare with
# [`F.scaled_dot_product_attention`](https://pytorch.org/docs/stable/generated/torch.nn.functional.scaled_dot_product_attention.html)
# on the whole sequence (fp32 within 1e-5, fp64 within 1e-10), record your traffic, and
# measure the largest tensor you create. Gathering K/V, or calling SDPA, scores 0.
#
# The checks also try the edges: a sequence that is all padding (a batch's empty slot), whose
# queries have no key at all, where SDPA returns 0 and a plain $o / \ell$ is $0/0$ = nan; and one
# rank, where the ring is the rank itself and nothing is sent. Every rank's chunk has the same
# length: pad the sequence to a multiple of $W$ and mark the pads in the mask.

# %% tags=["task-9.3"]
def ring_attention(q, k, v, key_padding_mask=None, group=None):
    """This rank's chunk of softmax(q k^T / sqrt(d)) v over the whole ring-sharded sequence.

    ``q``, ``k``, ``v``: this rank's contiguous chunk ``(batch, heads, L / W, head_dim)``;
    ``key_padding_mask``: its chunk ``(batch, L / W)`` of the padding mask, True where the key
    is padding (ignored). K, V and the mask travel around the ring: in each of W - 1 steps a rank
    sends the block it holds to its right neighbour (rank + 1) and receives the next from its
    left neighbour, with point-to-point calls. Each block's scores merge into a running max, a
    running sum of exponentials and an unnormalised output (the online softmax). Forward only.

    Every rank's chunk has the same length (pad the sequence to a multiple of W and mark the
    pads in ``key_padding_mask``). A query whose every key is padding gets 0, as
    ``F.scaled_dot_product_attention`` returns; with world size 1 nothing is sent and the result
    is plain attention over the rank's whole sequence.
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
    block = [t.contiguous() for t in block]  # gloo sends contiguous tensors only
    for step in range(world_size):
        if step < world_size - 1:  # pass the block on while computing with it
            incoming = [torch.empty_like(t) for t in block]
            works = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, t, right, group) for t in block]
                + [dist.P2POp(dist.irecv, t, left, group) for t in incoming])
        scores = (q @ block[0].transpose(-1, -2)).div_(math.sqrt(dim))  # (B, H, chunk, chunk)
        if key_padding_mask is not None:
            scores.masked_fill_(block[2][:, None, None, :], -math.inf)
        m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
        # all-pad rows so far
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = scores.sub_(shift).exp_()  # in place: one block-sized buffer per step
        rescale = torch.exp(m - shift)  # the old terms, re-expressed against the new max
        s = s * rescale + p.sum(dim=-1, keepdim=True)
        o = o * rescale + p @ block[1]
        m = m_new
        if step < world_size - 1:
            for w in works:
                w.wait()
            block = incoming
    # A query whose every key is padding has s = 0 and o = 0: return 0 there, as SDPA does.
    return o / torch.where(s == 0, torch.ones_like(s), s)
    ### END SOLUTION


# %% tags=["check-9.3"]
check("9.3", ring_attention)


# %% [markdown]
# ### Memory per rank as L grows
#
# `LiveBytes` counts the bytes of tensors alive inside a block (CPU has no
# `torch.cuda.max_memory_allocated`). Below, each of 4 ranks runs ring attention on its
# chunk, and, for comparison, the all-gather version; one process runs plain attention
# (`softmax(q kᵀ) v`, materialising the L × L scores) on the whole sequence.

# %%
def plain_attention(q, k, v):
    return (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1) @ v


def gather_attention(q, k, v):
    """All-gather K and V, then plain attention of this rank's queries over all of them."""
    world = dist.get_world_size()
    ks = [torch.empty_like(k) for _ in range(world)]
    vs = [torch.empty_like(v) for _ in range(world)]
    dist.all_gather(ks, k)
    dist.all_gather(vs, v)
    return plain_attention(q, torch.cat(ks, 2), torch.cat(vs, 2))


def attention_memory(length, heads=4, dim=16):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(1, heads, length, dim, generator=g) for _ in range(3))
    chunk = slice(rank * length // world, (rank + 1) * length // world)
    q, k, v = (t[:, :, chunk].contiguous() for t in (q, k, v))
    peaks = {}
    for name, fn in (("ring", ring_attention), ("all-gather K/V", gather_attention)):
        with torch.no_grad(), LiveBytes() as live:
            fn(q, k, v)
        peaks[name] = live.peak
    return peaks


LENGTHS = [256, 512, 1024, 2048]
memory = {"ring": [], "all-gather K/V": [], "one process, whole sequence": []}
for length in LENGTHS:
    per_rank = launch(attention_memory, length, world_size=4)
    for name in ("ring", "all-gather K/V"):
        memory[name].append(max(r[name] for r in per_rank))
    g = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(1, 4, length, 16, generator=g) for _ in range(3))
    with torch.no_grad(), LiveBytes() as live:
        plain_attention(q, k, v)
    memory["one process, whole sequence"].append(live.peak)
for name, values in memory.items():
    print(f"{name:28}", "  ".join(f"L={n}: {b / 2**20:6.2f} MiB" for n, b in zip(LENGTHS, values)))
fig, ax = plt.subplots(figsize=(5.5, 3))
for name, values in memory.items():
    ax.loglog(LENGTHS, [b / 2**20 for b in values], "o-", label=name)
ax.set_xlabel("sequence length L (4 ranks, 4 heads, head_dim 16)")
ax.set_ylabel("peak MiB (per rank)")
ax.legend()
plt.show()

# %% [markdown]
# All three grow as L², with different constants. One process holds L × L scores per head
# (and as many probabilities); a rank of the all-gather version holds (L / 4) × L scores plus
# all of K and V; a ring rank holds one (L / 4)² block of scores plus a few chunks of K, V and
# output. With 4 ranks the scores shrink 16 times; measured at L = 2,048 the ring rank's peak
# is about 15 times below one process and 4 times below the all-gather rank. Meanwhile the
# next block is already on its way: the sends overlap with the block being computed.
#
# ## 6. AlphaFold 2: the pair representation
#
# AlphaFold 2 (Jumper et al., *Nature* 2021) keeps, besides per-residue features, a **pair
# representation** `z` of shape (L, L, c_z) with c_z = 128: one feature vector per pair of
# residues, which becomes the distance map. Its trunk (the Evoformer) updates `z` with
# **triangle updates**: the edge i→j is updated from the edges i→k and j→k for every third
# residue k, because the three distances of a triangle constrain each other. The multiplicative
# updates cost L³·c operations; **triangle attention** (Algorithm 13 and 14 of the AF2
# supplement) lets edge ij attend to every edge ik with a bias from edge jk:
#
# $$a^h_{ijk} = \mathrm{softmax}_k\Big(\tfrac{1}{\sqrt c}\, q^h_{ij}\cdot k^h_{ik} + b^h_{jk}\Big),
# \qquad o^h_{ij} = g^h_{ij} \odot \textstyle\sum_k a^h_{ijk} v^h_{ik}.$$
#
# The logits `a` are **heads · L³** numbers: for L = 384, 4 heads in fp32 that is 864 MiB per
# triangle attention, for L = 1024 16 GiB, and the Evoformer has 48 blocks with two each.
# That is why AlphaFold **trains on crops** of 256 residues (384 in fine-tuning) and, at
# inference on long proteins, evaluates triangle attention a block of rows at a time
# (`chunk_size` in OpenFold and in AF2's `global_config.subbatch_size`): row i of the
# output needs row i of `z` and the bias, so the logits in flight shrink to
# heads · chunk · L².

# %%
figures.triangle_geometry(length=8, i=1, j=5, k=3)
plt.show()

# %%
alphafold_memory_widget()

# %% [markdown]
# The calculator's numbers follow from shapes; the measured bytes below check them on small L.
# The kit's `TriangleAttentionStartingNode` (c_z = 16, c = 8, 4 heads) is Algorithm 13 with
# fixed weights. `module(z)` evaluates it all; `module(z[a:b], module.pair_bias(z))` rows
# `a:b`, with the bias computed once from the whole of `z`.

# %%
module = TriangleAttentionStartingNode(c_z=16, c=8, heads=4)
print(f"{'L':>4} {'chunk':>5}  {'predicted logits':>16}  {'largest tensor measured':>23}  "
      f"{'peak measured':>13}")
for length in (32, 64, 96):
    z = torch.randn(length, length, 16)
    predicted = alphafold_pair_memory(length, c_z=16, heads=4, c=8)
    with torch.no_grad(), LiveBytes() as live:
        module(z)
    print(f"{length:4} {'-':>5}  {predicted['logits']:16,d}  {live.largest:23,d}  {live.peak:13,d}")

# %% [markdown]
# The largest tensor is the logits tensor, to the byte; the peak holds it twice (logits and
# softmax) plus the smaller q, k, v and gates. Now chunk it yourself.
#
# ### Task 9.4: `chunked`
#
# Write `chunked(module, z, chunk_size)`: Algorithm 13 on the whole pair representation `z`
# (L, L, c_z), computed `chunk_size` rows at a time, with the module's weights. Write the
# attention yourself: the module's layers are yours to use (`module.norm`, `module.qkv`,
# `module.bias`, `module.gate`, `module.out`, and `module.heads`, `module.c`), its `forward`
# (`module(z)`) and `pair_bias` are not. The checks compare your output with the module's
# (float64 within 1e-10) and measure, from torch's allocator, the largest tensor your call
# allocates: at most one block's logits, heads · chunk_size · L² values. A `chunk_size` below 1
# makes no block of rows: raise a `ValueError` naming it.

# %% tags=["task-9.4"]
def chunked(module, z, chunk_size):
    """Triangle attention around the starting node of ``z`` ``(L, L, c_z)``, ``chunk_size`` rows
    at a time: the same ``(L, L, c_z)`` as ``module(z)``.

    ``module`` is a :class:`TriangleAttentionStartingNode` (AlphaFold 2, Algorithm 13); use its
    layers, not its forward or pair_bias. No tensor larger than one block's logits
    (heads · chunk_size · L² values) may be allocated, besides the output.

    Edges: a chunk_size of L or more is one block; one that does not divide L leaves a smaller
    last block. A chunk_size below 1 makes no block at all: a ValueError.
    """
    ### BEGIN SOLUTION
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size}")
    length = z.shape[0]
    h, c = module.heads, module.c
    bias = z.new_empty(h, length, length)  # b_jk^h for every edge jk, built by rows j
    for a in range(0, length, chunk_size):
        bias[:, a:a + chunk_size] = module.bias(module.norm(z[a:a + chunk_size])).permute(2, 0, 1)

    def attend(z_rows):  # a function, so that one block's tensors are freed before the next's
        rows = z_rows.shape[0]
        x = module.norm(z_rows)  # (rows, L, c_z)
        # (rows, h, L, c)
        q, k, v = module.qkv(x).view(rows, length, 3, h, c).permute(2, 0, 3, 1, 4)
        logits = q @ k.transpose(-1, -2) / math.sqrt(c) + bias  # (rows, h, L_j, L_k)
        o = logits.softmax(dim=-1) @ v  # over the edges ik of each row i: (rows, h, L, c)
        g = torch.sigmoid(module.gate(x)).view(rows, length, h, c).transpose(1, 2)
        return module.out((g * o).transpose(1, 2).reshape(rows, length, h * c))

    out = torch.empty_like(z)
    for a in range(0, length, chunk_size):
        out[a:a + chunk_size] = attend(z[a:a + chunk_size])
    return out
    ### END SOLUTION


# %% tags=["check-9.4"]
check("9.4", chunked)
# %%
length = 96
z = torch.randn(length, length, 16)
with torch.no_grad():
    whole = module(z)
print(f"{'chunk':>5}  {'predicted logits':>16}  {'largest measured':>16}  "
      f"{'peak measured':>13}  max |diff|")
for chunk in (96, 32, 8, 1):
    fresh = TriangleAttentionStartingNode(c_z=16, c=8, heads=4)
    with torch.no_grad(), LiveBytes() as live:
        out = chunked(fresh, z, chunk)
    predicted = alphafold_pair_memory(length, c_z=16, heads=4, c=8, chunk=chunk)["logits"]
    print(f"{chunk:5}  {predicted:16,d}  {live.largest:16,d}  {live.peak:13,d}  "
          f"{(out - whole).abs().max().item():.1e}")

# %% [markdown]
# Once the chunk is small the largest tensor is no longer the logits but the inputs and outputs
# of size L²·c_z, which chunking cannot shrink: that is the pair representation itself, and
# the reason for crops.
#
# ## Running at scale
#
# > The training function above is the whole recipe for real ESM-2 sizes on GPUs. Written as
# > a script, it runs under `torchrun` with NCCL:
# >
# > ```bash
# > torchrun --standalone --nproc_per_node=8 train_esm.py                  # one node
# > torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d \
# >          --rdzv_endpoint=$HEAD:29500 train_esm.py                        # 32 GPUs
# > ```
# >
# > ```python
# > from esm.model.esm2 import ESM2
# > from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
# > from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
# > from kit.lessons.proteins import ESM2_FAMILY, alphabet, init_weights
# >
# > dist.init_process_group("nccl")
# > torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
# > layers, dim, heads = ESM2_FAMILY["esm2_t36_3B_UR50D"]      # or esm2_t33_650M_UR50D
# > with torch.device("meta"):                                 # no memory until sharded
# >     model = ESM2(layers, dim, heads, alphabet=alphabet())
# > for i, layer in enumerate(model.layers):
# >     model.layers[i] = checkpoint_wrapper(layer)
# > mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# > for layer in model.layers:
# >     fully_shard(layer, mp_policy=mp)
# > fully_shard(model, mp_policy=mp)
# > model.to_empty(device="cuda")                              # each GPU allocates its shard
# > model.apply(init_weights)                                  # then initialise (or load)
# > with torch.autocast("cuda", dtype=torch.bfloat16):         # see below
# >     logits = model(tokens.cuda())["logits"]                # (B, T, 33)
# > ```
# >
# > - FSDP2's `MixedPrecisionPolicy` casts the gathered parameters to bf16 and reduce-scatters
# >   gradients in fp32; the fp32 shards stay the optimizer's master weights. Keep
# >   `torch.autocast` around the forward all the same: fair-esm's rotary embedding multiplies
# >   q and k by fp32 cos/sin tables, so they come out fp32 beside a bf16 v, and `torch.bmm`
# >   refuses the mix ("expected m1 and m2 to have the same dtype"). `init_weights` (in
# >   `kit.lessons.proteins`) initialises what `to_empty` left uninitialised, the rotary
# >   tables included. `benchmarks/gpu_smoke.py` runs this code.
# > - ESM-2 650M (33 layers × 1280) trains with DDP on 80 GB GPUs; 3B (36 × 2560) wants FSDP
# >   over at least 2 GPUs, 15B over 8 or more (Section 1's table). Use
# >   `reshard_after_forward=False` on the last layer, as torchtitan does, to skip one
# >   all-gather.
# > - Token budgets scale per GPU: ESM-2 was trained with about 2 million tokens per step,
# >   e.g. 64 GPUs × 32,768 tokens, sequences cropped to 1,024 residues.
# > - Real weights never download in this course. Loading them is one call once the file is
# >   on disk:

# %%
try:
    load_pretrained_esm2("esm2_t33_650M_UR50D", path="/nonexistent/esm2_t33_650M_UR50D.pt")
except FileNotFoundError as e:
    print(e)

# %% [markdown]
# ## Summary
#
# - A protein language model is a BERT over amino acids: fair-esm's `Alphabet` adds `<cls>`,
#   `<eos>`, `<pad>` and `<mask>`, and `ESM2` is a pre-norm transformer with rotary positions.
# - MLM masking chooses 15% of residues independently, never special tokens, and replaces
#   them 80/10/10 (mask / random canonical amino acid / unchanged); labels are -100 elsewhere.
# - Token-budget batching wastes far less padding than fixed-size batches. Build all batches
#   first, then deal them with `DistributedSampler`'s shuffle-and-pad, so every rank takes the
#   same number of steps.
# - FSDP2 (`fully_shard` per layer, then the root), bf16 autocast and activation checkpointing
#   compose on fair-esm's own model; on a tiny model FSDP2 is slower than DDP, and it becomes
#   necessary from ESM-2 3B on.
# - Ring attention passes K/V blocks around the ring in W − 1 point-to-point steps and merges
#   them with an online softmax. Per rank, a materialised score block drops by W² (chunk²
#   instead of L²); Q, K, V and the output drop by W; flash-style kernels, which never
#   materialise the scores, have no L² term at all, so their memory drops by W.
# - AlphaFold's pair representation is L²·c_z, triangle attention's logits heads·L³; crops
#   and row chunking keep them in memory.
#
# **Read more:** [FSDP2 `fully_shard`](https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html),
# [automatic mixed precision](https://pytorch.org/docs/stable/amp.html),
# [`torch.utils.checkpoint`](https://pytorch.org/docs/stable/checkpoint.html),
# [point-to-point communication](https://pytorch.org/docs/stable/distributed.html#point-to-point-communication),
# [fair-esm](https://github.com/facebookresearch/esm), the ESM-2 paper (Lin et al., *Science*
# 2023), *Ring Attention with Blockwise Transformers* (Liu, Zaharia and Abbeel, 2023), the
# AlphaFold 2 supplement (Jumper et al., *Nature* 2021) and OpenFold (Ahdritz et al., 2024).
#
# ## Exercises (not graded)
#
# 1. Train `train_mlm` with `checkpointing=False` and `bf16=False`. Is the loss curve the same?
#    Measure tokens per second for each of the four combinations on CPU; which would you
#    expect to change on a GPU, and why?
# 2. Change `token_budget_batches` to put sequences in buckets of similar length and shuffle
#    *within* buckets, so that batches differ between epochs. How much padding does it cost?
# 3. Make `ring_attention` causal. Which blocks can a rank skip entirely, and why does that
#    leave ranks with unequal work? (Look up the "zig-zag" layout in torch's context parallel.)
# 4. Add a backward pass to ring attention: what must each rank keep from the forward pass,
#    and which tensors travel around the ring in backward?
# 5. With the widget: at L = 2,048 in bf16, which chunk size keeps triangle attention's logits
#    under 1 GiB? How much memory is left for the pair representation itself?
