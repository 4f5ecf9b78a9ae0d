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
# The largest open models (Mixtral, DeepSeek-V3, Qwen3-MoE, Llama 4) are mixtures of experts:
# the feed-forward block of each layer is replaced by many small MLPs, the *experts*, and a
# *router* sends every token to only a few of them. The model holds far more parameters than a
# token ever uses. That brings a new parallelism: **expert parallelism** (EP) puts different
# experts on different ranks, and tokens travel to the rank holding their expert and back,
# with `all_to_all` messages whose sizes nobody knows in advance. It is the one collective the
# course has only named so far.
#
# **Prerequisites:** Lesson 01 (collectives, the tracer), Lesson 05 (`DeviceMesh`) and Lesson 08
# (model parallelism, custom `torch.autograd.Function`s with collectives in backward).
#
# **You will be able to:**
# - route tokens to their top-k experts with a capacity per expert, dropping what does not fit,
#   with the same answer on every machine ({{task 13.1}});
# - write Switch Transformer's load-balancing loss, derive its gradient by hand, and show what
#   goes wrong without it ({{task 13.2}});
# - write an expert-parallel MoE layer: one all-to-all of counts, then tokens out and results
#   back with uneven all-to-alls, differentiable end to end ({{task 13.3}});
# - count the bytes a token costs under EP and why top-k multiplies them; combine EP with data
#   parallelism on a 2-D `DeviceMesh` and reduce each gradient over the right group; measure
#   the load on real ranks: token histograms, dropped tokens, the slowest expert's rank;
# - write the dropless layer: tokens sorted by expert, one grouped matrix product per layer,
#   un-permuted and combined, and weigh its memory against padding and capacity
#   ({{task 13.4}}).
#
# Replace each `raise NotImplementedError(...)` with your code, run the cell, then the
# `check(...)` cell under it.

# %% tags=["setup"]
import math
import statistics
import time

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from kit import check, launch
from kit.lessons.moe import (
    Routing,
    capacity,
    expert_range,
    make_experts,
    make_router,
    plot_token_histogram,
    skewed_tokens,
    stack_experts,
    token_histogram,
)
from kit.meter import count_flops, count_ops, track
from kit.trace import launch_traced, plot_timeline, region, trace

# %% [markdown]
# ## 1. Routing: top-k, weights and capacity
#
# An MoE layer has $E$ experts, each an MLP from $d_\text{model}$ to $d_\text{model}$, and a
# router: a linear layer giving each token $E$ logits. For a token $x$ the layer computes
#
# $$y = \sum_{j=1}^{k} w_j \, \mathrm{expert}_{e_j}(x), \qquad
#   p = \mathrm{softmax}(\mathrm{router}(x)),$$
#
# where $e_1, \dots, e_k$ are the $k$ experts with the largest probabilities $p$ and $w_j$
# their weights. Switch Transformer ([Fedus et al., 2021](https://arxiv.org/abs/2101.03961))
# uses $k = 1$ and $w_1 = p_{e_1}$, the raw probability, so that the router learns through the
# weight. Mixtral ([Jiang et al., 2024](https://arxiv.org/abs/2401.04088)) uses $k = 2$ and
# renormalises over the chosen: $w_j = p_{e_j} / \sum_{i \le k} p_{e_i}$; this lesson does
# the same for $k > 1$. Not every model does: DeepSeek-V2, Qwen1.5-MoE and OLMoE keep the raw
# top-$k$ probabilities (`norm_topk_prob=False` in their Hugging Face configs), and
# DeepSeek-V3 normalises sigmoid scores instead of a softmax.
#
# **Capacity.** In the capacity design (GShard, Switch Transformer, this lesson) every expert
# gets a fixed buffer of $C = \lceil k \, T \, c / E \rceil$ slots for $T$ tokens, where $c$
# is the *capacity factor* ($c = 1$: exactly the average load), so every tensor, and every
# all-to-all, has a size known in advance. The formulas vary: Switch's $T c / E$ is for
# $k = 1$, DeepSpeed-MoE adds a minimum capacity, GShard computes it per group of tokens.
# Much of today's training is **dropless** instead: MegaBlocks
# ([Gale et al., 2022](https://arxiv.org/abs/2211.15841)), Megatron-Core by default,
# DeepSeek-V3 and torchtitan sort the tokens by expert and run one *grouped* matrix product
# whose groups have whatever sizes the router chose (`torch._grouped_mm` in torch 2.13), so
# nothing is dropped and no slot is padding; the price is all-to-alls whose sizes change every
# step. Slots are handed out first come, first served, and a
# choice that finds its expert full is **dropped**: it contributes nothing, and the block's
# residual connection carries the token on unchanged. Who comes first matters: the rule here
# (GShard's, [Lepikhin et al., 2020](https://arxiv.org/abs/2006.16668)) gives every token's
# *first* choice, in token order, before any token's second choice, so a token loses its
# second choice before another loses its first.
#
# **Ties.** Two experts with exactly equal probabilities (zero logits at initialisation,
# rounded low-precision logits) must be ordered the same way on every rank and every machine,
# or two ranks disagree about where a token goes. `torch.topk` makes no promise
# ([its docs](https://pytorch.org/docs/stable/generated/torch.topk.html): "the indices of tied
# elements are not guaranteed to be stable"); here is what it returns on this machine for four
# equal logits:

# %%
print("torch.topk of four equal values, k=2:", torch.topk(torch.zeros(1, 4), 2).indices.tolist())
print("a stable descending sort:           ",
      torch.zeros(1, 4).sort(dim=-1, descending=True, stable=True).indices[:, :2].tolist())


# %% [markdown]
# A stable sort ([`torch.sort(..., stable=True)`](https://pytorch.org/docs/stable/generated/torch.sort.html))
# keeps equal values in their original order, so the lower expert index wins.
#
# ### Task 13.1: `route`
#
# Write `route(logits, k, capacity)`. It returns a `Routing` (a NamedTuple from
# `kit.lessons.moe`) of four `(T, k)` tensors: `expert`, `weight`, `slot` and `kept`. Slots
# are counted per expert in priority order (all first choices in token order, then all second
# choices, ...); a choice past `capacity` gets `kept=False`, `slot=-1` and `weight=0`, and the
# kept weights are *not* renormalised again.

# %% tags=["task-13.1"]
def route(logits: torch.Tensor, k: int, capacity: int) -> Routing:
    """Route each token to its k most likely experts, each expert holding at most `capacity`.

    Args:
        logits: (T, E) router logits of T tokens over E experts.
        k: choices per token.
        capacity: slots per expert.
    Returns a Routing of four (T, k) tensors, column j the j-th choice:
        expert: the experts, most likely first; equal probabilities go to the lower index.
        weight: for k = 1 the softmax probability, for k > 1 the k probabilities divided by
            their sum; 0 for a dropped choice (the kept ones are not renormalised again).
        slot: the choice's place in its expert's buffer, counted per expert in priority
            order: every token's first choice, in token order, then every second choice, ...;
            -1 for a dropped choice.
        kept: whether the choice got a slot (slot < capacity).
    T = 0 (no tokens) gives four empty (0, k) tensors. Raises ValueError unless 1 <= k <= E.
    """
    ### BEGIN SOLUTION
    num_tokens, num_experts = logits.shape
    if not 1 <= k <= num_experts:
        raise ValueError(f"k = {k} choices per token, but there are {num_experts} experts: k "
                         "must be between 1 and the number of experts")
    probs = logits.softmax(dim=-1)  # (T, E)
    # A stable sort keeps equal probabilities in index order: ties go to the lower expert.
    top, expert = probs.sort(dim=-1, descending=True, stable=True)
    top, expert = top[:, :k], expert[:, :k]  # (T, k)
    weight = top if k == 1 else top / top.sum(dim=-1, keepdim=True)
    # Priority order: choice 0 of every token, then choice 1, ...: the transpose, flattened.
    order = expert.t().reshape(-1)  # (k * T,)
    seen = F.one_hot(order, num_experts).cumsum(dim=0)  # (k * T, E): running count per expert
    position = seen.gather(1, order[:, None]).squeeze(1) - 1  # earlier choices of that expert
    position = position.view(k, num_tokens).t()  # back to (T, k)
    kept = position < capacity
    slot = torch.where(kept, position, -1)
    weight = torch.where(kept, weight, torch.zeros_like(weight))
    return Routing(expert, weight, slot, kept)
    ### END SOLUTION


# %% tags=["check-13.1"]
check("13.1", route)

# %% [markdown]
# Five tokens, four experts, $k = 2$ and 2 slots per expert. Token 0 comes first, yet its
# second choice (expert 1) is dropped: tokens 1 and 2 chose expert 1 *first*, and every first
# choice is served before any second choice. Token 4's logits are all equal, so it goes to
# experts 0 and 1, the lower indices; its first choice takes expert 0's last slot ahead of
# token 2's second choice.

# %%
example = torch.tensor([[3.0, 2.0, 0.0, 0.0],
                        [0.0, 3.0, 2.0, 0.0],
                        [2.0, 3.0, 0.0, 0.0],
                        [0.0, 0.0, 3.0, 2.0],
                        [1.0, 1.0, 1.0, 1.0]])  # four equal logits
r = route(example, k=2, capacity=2)
print("token  experts  weights          slots     kept")
for t in range(len(example)):
    rounded = [round(w, 3) for w in r.weight[t].tolist()]
    print(f"{t:5d}  {r.expert[t].tolist()!s:7s}  {rounded!s:15s}"
          f"  {r.slot[t].tolist()!s:8s}  {r.kept[t].tolist()}")

# %% [markdown]
# How many choices are dropped depends on the capacity factor and on how uneven the load is.
# `skewed_tokens` shifts random tokens towards one expert's router row, as a real batch leans
# towards some experts; with 1024 tokens and 8 experts:

# %%
def dropped_fraction(skew, k, capacity_factor, num_tokens=1024, num_experts=8, d_model=32):
    router = make_router(d_model, num_experts, seed=0)
    x = skewed_tokens(num_tokens, d_model, router, favourite=3, skew=skew, seed=1)
    with torch.no_grad():
        r = route(router(x), k, capacity(k, num_tokens, capacity_factor, num_experts))
    return 1.0 - r.kept.float().mean().item()


factors = [0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0]
fig, ax = plt.subplots(figsize=(6, 3))
for skew, style in ((0.0, "-"), (2.0, "--")):
    for k, colour in ((1, "tab:blue"), (2, "tab:orange")):
        ax.plot(factors, [100 * dropped_fraction(skew, k, c) for c in factors], style, marker="o",
                color=colour, label=f"k={k}, {'balanced' if skew == 0 else 'skewed'} tokens")
ax.set_xlabel("capacity factor c")
ax.set_ylabel("choices dropped (%)")
ax.legend(fontsize="small", frameon=False)
ax.set_title("Dropped choices against capacity factor (1024 tokens, 8 experts)")
plt.show()
print(f"balanced, k=1, c=1.25: {100 * dropped_fraction(0.0, 1, 1.25):.1f}% dropped; "
      f"skewed: {100 * dropped_fraction(2.0, 1, 1.25):.1f}%")
print(f"balanced, c=1: {100 * dropped_fraction(0.0, 1, 1.0):.1f}% dropped at k=1, "
      f"{100 * dropped_fraction(0.0, 2, 1.0):.1f}% at k=2")

# %% [markdown]
# Even balanced tokens lose some at $c = 1$ (the numbers printed below the figure): random
# loads are never exactly equal, and an expert over its average drops its excess.
# Switch Transformer compares capacity factors of 1.0, 1.25 and 2.0 and trains well at the
# low end; the next section's loss is what keeps the load close enough to balanced for that.
#
# ## 2. The layer, its parameters and its FLOPs
#
# Here is the whole layer in one process: route, run each expert on the tokens it kept, and
# add the weighted results into the tokens' rows. Section 4 distributes it; this version is
# the reference it must match.

# %%
class MoELayer(nn.Module):
    """Every expert in one process: (T, d_model) -> (T, d_model)."""

    def __init__(self, router, experts, k, capacity_factor):
        super().__init__()
        self.router, self.experts = router, experts
        self.k, self.capacity_factor = k, capacity_factor
        self.bias = None  # a per-expert bias on the logits that picks experts (section 3)

    def forward(self, x):
        logits = self.router(x)  # (T, E)
        cap = capacity(self.k, x.shape[0], self.capacity_factor, len(self.experts))
        routing = route(logits if self.bias is None else logits + self.bias, self.k, cap)
        if self.bias is not None:  # the bias chooses the experts; the weights stay the router's
            top = logits.softmax(dim=-1).gather(1, routing.expert)
            weight = top if self.k == 1 else top / top.sum(dim=-1, keepdim=True)
            routing = routing._replace(weight=weight * routing.kept)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, choice = torch.nonzero((routing.expert == e) & routing.kept, as_tuple=True)
            if token.numel():  # (n_e, d) -> (n_e, d), weighted, added to the tokens' rows
                out = out.index_add(0, token,
                                    routing.weight[token, choice, None] * expert(x[token]))
        self.logits, self.routing = logits, routing  # for the load-balancing loss and plots
        return out


# %% [markdown]
# An MoE decouples parameters from compute. With $E$ experts of hidden size $h$ and top-$k$
# routing, a token runs through $k$ experts: the FLOPs of a dense MLP of hidden size $k h$,
# for $E$ times the parameters of one of hidden size $h$. `kit.meter.count_flops` counts the
# FLOPs of one forward on 128 tokens (it wraps torch's `FlopCounterMode`):

# %%
d_model, hidden, num_experts, num_tokens = 64, 256, 8, 128
x = torch.randn(num_tokens, d_model)
layers = {
    "dense MLP, hidden h": make_experts(1, d_model, hidden)[0],
    "dense MLP, hidden 8h": make_experts(1, d_model, 8 * hidden)[0],
    "MoE, 8 experts of h, k=1": MoELayer(make_router(d_model, 8),
                                         make_experts(8, d_model, hidden), 1, 8.0),
    "MoE, 8 experts of h, k=2": MoELayer(make_router(d_model, 8),
                                         make_experts(8, d_model, hidden), 2, 8.0),
}
print(f"{'':26s} {'parameters':>11s} {'FLOPs per token':>16s}")
for name, layer in layers.items():
    with torch.no_grad(), count_flops() as flops:
        layer(x)
    params = sum(p.numel() for p in layer.parameters())
    print(f"{name:26s} {params:11,d} {flops.total / num_tokens:16,.0f}")

# %% [markdown]
# The MoE with $k = 1$ costs what the small dense MLP costs (plus the router's $2 \cdot d
# \cdot E$ FLOPs) and holds what the large one holds. At equal compute per token, an MoE can
# therefore be several times larger than a dense model; Switch Transformer reports up to 7x
# faster pre-training than T5-Base at the same FLOPs per token. The catch is memory: all
# $E$ experts must live somewhere, which is what expert parallelism is for.
#
# ## 3. Keeping the load balanced
#
# A router trained only on the task's loss tends to collapse: the experts that get more tokens
# early improve faster, so the router prefers them more, until a few experts do all the work
# and the rest are dead weight (and, with a capacity, the favourites drop most of their
# tokens). Switch Transformer adds an auxiliary loss
#
# $$\mathcal{L}_\text{aux} = E \sum_{i=1}^{E} f_i \, P_i,$$
#
# where $f_i$ is the fraction of the $T k$ routing choices that went to expert $i$ (counted
# before capacity, so dropped choices count; Switch has $k = 1$, and dividing top-$k$
# choices by $T k$ is Megatron-Core's form, which keeps the loss at 1 at balance for every $k$,
# where Hugging Face's Mixtral loss divides by $T$ and equals $k$ there) and $P_i$ is the mean
# router probability of expert $i$ over the $T$ tokens. $f$ is a count and has no gradient; the
# gradient flows through $P$ and pushes probability away from the experts that get more than
# their share.
# With $\sum_i f_i = \sum_i P_i = 1$, the loss is exactly 1 when either is uniform, and grows
# as both pile onto the same experts.
#
# **Why the gradient flows through $P$ only.** $f_i$ counts the choices `route` made: an
# argmax-like selection, piecewise constant in the logits, whose derivative is zero almost
# everywhere (and undefined at the jumps). $P_i = \frac{1}{T} \sum_t p_{ti}$ is smooth. With
# $p_t = \mathrm{softmax}(z_t)$ and the softmax's Jacobian
# $\partial p_{ti} / \partial z_{tj} = p_{ti} (\delta_{ij} - p_{tj})$,
#
# $$\frac{\partial \mathcal{L}_\text{aux}}{\partial z_{tj}}
#   = \frac{E}{T} \sum_i f_i \, p_{ti} (\delta_{ij} - p_{tj})
#   = \frac{E}{T} \, p_{tj} \Big( f_j - \sum_i f_i \, p_{ti} \Big).$$
#
# Token $t$'s logit for expert $j$ goes down (gradient descent) when $f_j$ is above the
# $p_t$-weighted mean load $\sum_i f_i p_{ti}$, and up when below: probability moves from
# overloaded experts to underloaded ones, in proportion to $p_{tj}$. An expert nobody chose
# ($f_j = 0$) still gets a push towards it.
#
# ### Task 13.2: `load_balancing_loss`
#
# Write `load_balancing_loss(logits, routing, num_experts)`: a 0-d tensor, differentiable
# through the logits' softmax only. Beside it write `router_gradient(logits, routing,
# num_experts)`: the $(T, E)$ gradient of that loss with respect to the logits, from the
# formula above, without autograd (`torch.autograd`, `.backward()` and `torch.func` are
# refused in this task); the check compares it with autograd's gradient of the loss.

# %% tags=["task-13.2"]
def load_balancing_loss(logits: torch.Tensor, routing: Routing, num_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss: num_experts * sum_i f_i * P_i, a 0-d tensor.

    f_i: the fraction of the T * k routing choices (kept or dropped) that chose expert i;
    a count, without gradient. P_i: the mean softmax probability of expert i over the T
    tokens; the gradient flows through it. At perfect balance the loss is 1. No tokens (a rank
    that got none): 0, still in the logits' graph (a zero gradient), not nan.
    """
    ### BEGIN SOLUTION
    choices = routing.expert.reshape(-1)
    if choices.numel() == 0:  # nothing routed: nothing to balance (f and P would be 0 / 0)
        return logits.sum() * 0.0
    f = torch.bincount(choices, minlength=num_experts).to(logits.dtype) / choices.numel()
    P = logits.softmax(dim=-1).mean(dim=0)  # (E,)
    return num_experts * (f * P).sum()
    ### END SOLUTION


def router_gradient(logits: torch.Tensor, routing: Routing, num_experts: int) -> torch.Tensor:
    """d load_balancing_loss / d logits, (T, E), from the formula, without autograd.

    Row t is (E / T) * p_t * (f - sum_i f_i p_ti), with p_t the softmax of logits[t] and f the
    fraction of the T * k choices per expert (a constant). No tokens: a (0, E) tensor. Same
    dtype as the logits; no autograd (torch.autograd, .backward, torch.func) inside.
    """
    ### BEGIN SOLUTION
    logits = logits.detach()
    choices = routing.expert.reshape(-1)
    if choices.numel() == 0:
        return torch.zeros_like(logits)
    counts = torch.bincount(choices, minlength=num_experts)
    f = counts.to(logits.dtype) / choices.numel()  # (E,), a constant
    p = logits.softmax(dim=-1)  # (T, E)
    mean_load = (p * f).sum(dim=-1, keepdim=True)  # (T, 1): the p_t-weighted load
    return num_experts / logits.shape[0] * p * (f - mean_load)
    ### END SOLUTION


# %% tags=["check-13.2"]
check("13.2", load_balancing_loss)

# %% [markdown]
# Now the collapse itself. A small MoE (8 experts, $k = 1$, capacity factor 1.25) learns a
# fixed nonlinear map of tokens that all lean the same way (the mean of real hidden states is
# not zero either), once with the task's loss alone and once with $0.5 \,
# \mathcal{L}_\text{aux}$ added. The two runs go on two ranks at once, one each; every rank
# returns, step by step, the share of first choices each expert got (before capacity) and the
# share of tokens dropped.

# %%
def train_router(alpha, steps=240, batch=256, d_model=16, hidden=32, num_experts=8,
                 bias_rate=0.0):
    """Adam on a mean-squared error (+ alpha * aux loss); each expert's share of tokens per step.
    With a bias_rate, a per-expert bias steers the choices (DeepSeek-V3's rule, below)."""
    g = torch.Generator().manual_seed(123)
    target = torch.randn(d_model, d_model, generator=g) / math.sqrt(d_model)
    lean = torch.randn(d_model, generator=g)
    lean = lean / lean.norm()  # every token is shifted by this unit vector
    moe = MoELayer(make_router(d_model, num_experts), make_experts(num_experts, d_model, hidden),
                   k=1, capacity_factor=1.25)
    if bias_rate:
        moe.bias = torch.zeros(num_experts)
    optimizer = torch.optim.Adam(moe.parameters(), lr=1e-2)
    shares, losses, dropped = [], [], []
    for _ in range(steps):
        x = torch.randn(batch, d_model, generator=g) + lean
        y = 2 * torch.tanh(x @ target.T)
        loss = (moe(x) - y).pow(2).mean()
        aux = load_balancing_loss(moe.logits, moe.routing, num_experts)
        (loss + alpha * aux).backward()
        optimizer.step()
        optimizer.zero_grad()
        first_choices = torch.bincount(moe.routing.expert[:, 0], minlength=num_experts)
        if bias_rate:  # raise the bias of experts under their share, lower it over, by sign
            moe.bias += bias_rate * torch.sign(batch / num_experts - first_choices)
        shares.append((first_choices / batch).tolist())
        losses.append(loss.item())
        dropped.append(1.0 - moe.routing.kept.float().mean().item())
    return {"shares": shares, "loss": statistics.mean(losses[-20:]), "aux": aux.item(),
            "dropped": statistics.mean(dropped[-20:])}


def two_runs():
    return train_router(alpha=[0.0, 0.5][dist.get_rank()])


runs = launch(two_runs, world_size=2, timeout=300)
fig, axes = plt.subplots(1, 2, figsize=(10, 3), sharey=True)
for ax, run, title in zip(axes, runs, ("task loss only", "task loss + 0.5 aux loss")):
    shares = torch.tensor(run["shares"]).T  # (E, steps)
    ax.stackplot(range(shares.shape[1]), shares.numpy(), labels=[f"expert {e}" for e in range(8)])
    ax.set_title(f"{title}: final aux {run['aux']:.2f}")
    ax.set_xlabel("step")
axes[0].set_ylabel("share of tokens")
axes[1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)
plt.show()
for run, name in zip(runs, ("without aux loss", "with aux loss   ")):
    top2 = sum(sorted(run["shares"][-1])[-2:])
    print(f"{name}: the two busiest experts are wanted by {100 * top2:.0f}% of the tokens, "
          f"{100 * run['dropped']:.0f}% dropped, aux {run['aux']:.2f}, task loss {run['loss']:.3f}")

# %% [markdown]
# Without the auxiliary loss a few experts end up wanted by most tokens: they drop what does
# not fit their capacity, the other experts' parameters learn little, and the task's loss
# stays several times higher. With it every expert keeps about its eighth and almost nothing
# is dropped. (With unlimited capacity the collapsed router would fit this easy map about as
# well; the damage is the dropped tokens and the idle experts.) The coefficient matters: Switch uses
# 0.01 on a language-model loss of a few nats; this toy's loss is smaller, so it needs more.
# Newer models add other tools (ST-MoE's router z-loss; DeepSeek-V3 steers the routing with a
# per-expert bias and keeps only a tiny auxiliary loss), but the diagnosis is the same: watch
# $f$.
#
# **Balancing without an auxiliary loss.** DeepSeek-V3
# ([DeepSeek-AI, 2024](https://arxiv.org/abs/2412.19437), section 2.1.2) adds a bias $b_i$ to
# each expert's score *for choosing only*: the top-$k$ is taken over $s_{ti} + b_i$, the
# weights still come from $s_{ti}$, so the bias never enters the gradient. After each step,
# $b_i \leftarrow b_i + \gamma \, \mathrm{sign}(\bar{n} - n_i)$, with $n_i$ the tokens expert
# $i$ got and $\bar{n}$ the mean: an overloaded expert becomes harder to choose, an idle one
# easier. The same toy, task loss only, with that bias ($\gamma = 0.02$ on the logits):

# %%
biased = train_router(alpha=0.0, bias_rate=0.02)
fig, ax = plt.subplots(figsize=(5, 3))
shares = torch.tensor(biased["shares"]).T
ax.stackplot(range(shares.shape[1]), shares.numpy(), labels=[f"expert {e}" for e in range(8)])
ax.set(title="task loss only, bias balancing", xlabel="step", ylabel="share of tokens")
plt.show()
top2 = sum(sorted(biased["shares"][-1])[-2:])
print(f"bias balancing, no auxiliary term: the two busiest experts are wanted by "
      f"{100 * top2:.0f}% of the tokens, {100 * biased['dropped']:.0f}% dropped, task loss "
      f"{biased['loss']:.3f}")

# %% [markdown]
# The load evens out with no auxiliary term in the loss: the bias corrects the counts $f$
# directly, step by step, instead of pushing the probabilities $P$ through the gradient.
# (DeepSeek-V3 keeps a very small sequence-wise auxiliary loss besides.) **Expert-choice
# routing** ([Zhou et al., 2022](https://arxiv.org/abs/2202.09368)) turns the choice around:
# each expert takes its top-$C$ tokens by score, so every expert is exactly full by
# construction; the price is that a token may get several experts or none, and that the
# choice needs the whole batch at once, which autoregressive decoding does not have.
#
# ## 4. Expert parallelism
#
# With $W$ ranks, expert parallelism gives each rank $E/W$ experts: rank $r$ holds experts
# $rE/W$ to $(r+1)E/W - 1$. The router is small and replicated. Each rank routes *its own*
# tokens, then:
#
# 1. **counts**: it counts how many of its kept choices go to each of the $E$ experts, and one
#    `all_to_all_single` of those $E$ numbers tells every rank how many rows to expect from
#    each other rank, expert by expert;
# 2. **dispatch**: it sends each kept choice's token to the rank holding its expert with an
#    `all_to_all_single` with uneven `input_split_sizes` / `output_split_sizes`;
# 3. **experts**: each rank runs its experts on what arrived (rows grouped by source rank,
#    then by local expert);
# 4. **combine**: a second all-to-all, with the splits swapped, sends the results back, and
#    each rank adds them into its tokens' rows with their weights.
#
# [`dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes)`](https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_to_all_single)
# sends `input_split_sizes[j]` rows of `input` to rank `j` and receives `output_split_sizes[i]`
# rows from rank `i` into `output`, in rank order. The receive sizes must be known before the
# call, hence the count exchange. It is not differentiable: its backward is the same exchange
# reversed (what came from rank $i$ goes back to rank $i$), which `AllToAll` below writes as an
# autograd function, as Lesson 08 did for tensor parallelism's f and g.
#
# **Bytes per token.** Every kept choice sends one row of $d_\text{model}$ values out and one
# back, and backward does the same again with gradients: $4 k \, d_\text{model}$ values per
# token and layer, of which a fraction $(W - 1)/W$ leaves the rank when routing is uniform. So
# top-$k$ multiplies the traffic by $k$, and top-2 routing on a model with $d_\text{model} =
# 4096$ in bf16 moves 64 KiB per token and layer.
#
# ### Task 13.3: `ExpertParallelMoE`
#
# Write `AllToAll` (a differentiable `all_to_all_single` of rows) and
# `ExpertParallelMoE(router, experts_local, k, capacity_factor, group=None)`. `forward(x)` takes
# this rank's `(T_r, d_model)` tokens, routes them with your `route` and
# $C = \lceil k \, T_r \, c / E \rceil$, and returns their outputs. A dropped choice is not
# sent and contributes zero. Leave the router's gradient on each rank as backward leaves it:
# the caller all-reduces it, as DDP would. The check compares outputs and gradients with the
# single-process layer on 2 and 4 ranks, reads the recorder (one count exchange, two token
# all-to-alls of exactly the kept rows, the mirror in backward) and the meter (each rank holds
# its $E/W$ experts only). All-gathering tokens or experts is forbidden.
#
# **A collective behind a gradient path.** The backward all-to-alls run only where autograd
# reaches them, and autograd reaches the combine's backward only if this rank's output depends
# on what its experts computed. Under router collapse (the very regime of section 2) some
# rank's experts receive no token; if that rank skips its idle experts and returns
# `torch.zeros_like(received)`, its output has no path back to the combine all-to-all: in
# backward it calls one all-to-all fewer than its peers, returns, and they wait for it forever.
# `received * 0` is not enough either: when `x` needs no grad, `received` has no grad history
# on any rank. Run every local expert, on however many rows it got (zero rows is a valid
# batch), so the output depends on the received rows *and* the experts' parameters everywhere.
# The check runs the collapse on 2 ranks, an expert no token picks on 4, a rank with no tokens
# and an input without grad; a hang there is reported within seconds, with the rank that
# returned and the collective its peers wait in.

# %% tags=["task-13.3"]
class AllToAll(torch.autograd.Function):
    """A differentiable all_to_all_single of rows: in backward, the same exchange reversed."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ### BEGIN SOLUTION
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        output_splits, input_splits = ctx.splits
        # What came from rank r goes back to rank r: the splits swap places.
        back = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), input_splits, output_splits,
                               group=ctx.group)
        return back, None, None, None
        ### END SOLUTION


class ExpertParallelMoE(nn.Module):
    """A mixture-of-experts layer whose E experts are spread over the ranks of `group`.

    Rank r of the group holds experts r * E/W to (r + 1) * E/W - 1 (`experts_local`); the
    router is replicated. forward((T_r, d_model)) -> (T_r, d_model): each token's kept
    choices, computed on the ranks holding their experts, weighted and summed. Router
    gradients stay per rank (the caller all-reduces them).

    Every rank joins every all-to-all, forward and backward, whatever its load: a rank with no
    tokens (T_r = 0), a rank whose experts receive no token (router collapse), and an input
    that needs no grad all run the same collectives as their peers, so the output must depend
    on the received rows and the local experts' parameters on every rank. Raises ValueError
    when `experts_local` is empty (each rank holds E/W >= 1 experts) or when the router's
    width is not E = len(experts_local) * W.
    """

    def __init__(self, router: nn.Module, experts_local: nn.ModuleList, k: int,
                 capacity_factor: float, group=None):
        super().__init__()
        self.router = router
        self.experts = experts_local
        self.k, self.capacity_factor, self.group = k, capacity_factor, group
        ### BEGIN SOLUTION
        self.world_size = dist.get_world_size(group)
        self.num_local = len(experts_local)
        self.num_experts = self.num_local * self.world_size
        if self.num_local == 0:
            raise ValueError("experts_local is empty: expert parallelism gives every rank E/W >= 1 "
                             "experts; choose at least as many experts as ranks")
        width = getattr(router, "out_features", self.num_experts)
        if width != self.num_experts:
            raise ValueError(f"the router scores {width} experts, but {self.num_local} local "
                             f"experts on {self.world_size} ranks make {self.num_experts}: pass "
                             "each rank its E/W experts of a router over all E")
        ### END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        num_tokens = x.shape[0]
        W, n_local, E = self.world_size, self.num_local, self.num_experts
        cap = math.ceil(self.k * num_tokens * self.capacity_factor / E)
        routing = route(self.router(x), self.k, cap)
        # The kept choices in dispatch order: by expert (so by destination rank), then slot.
        token, _ = torch.nonzero(routing.kept, as_tuple=True)
        expert, slot = routing.expert[routing.kept], routing.slot[routing.kept]
        weight = routing.weight[routing.kept]
        order = torch.argsort(expert * max(cap, 1) + slot)
        token, expert, weight = token[order], expert[order], weight[order]
        # 1. How many rows I send to each expert; back: how many each rank sends to mine.
        send_counts = torch.bincount(expert, minlength=E)  # (E,): rank-major
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits = send_counts.view(W, n_local).sum(dim=1).tolist()
        recv_per_expert = recv_counts.view(W, n_local)  # [source rank, local expert]
        recv_splits = recv_per_expert.sum(dim=1).tolist()
        # 2. Dispatch: each kept choice's token to the rank holding its expert.
        received = AllToAll.apply(x[token], recv_splits, send_splits, self.group)
        # 3. My experts on what arrived: grouped by source rank, then by local expert.
        local = torch.arange(n_local, device=x.device).repeat(W).repeat_interleave(
            recv_per_expert.reshape(-1))
        # Every local expert runs, on its rows even when it has none: an empty batch still ties
        # `results` to the received rows and the expert's parameters, so backward reaches the
        # return all-to-all on this rank as on every other (skipping it deadlocks the peers).
        results = torch.zeros_like(received)
        for i, expert_module in enumerate(self.experts):
            rows = torch.nonzero(local == i).squeeze(1)
            results = results.index_copy(0, rows, expert_module(received[rows]))
        # 4. Combine: the results come back in dispatch order; weight and add to their tokens.
        returned = AllToAll.apply(results, send_splits, recv_splits, self.group)
        return torch.zeros_like(x).index_add(0, token, weight[:, None] * returned)
        ### END SOLUTION


# %% tags=["check-13.3"]
check("13.3", ExpertParallelMoE)

# %% [markdown]
# One forward and backward on 4 ranks, 8 experts, under the tracer. Every rank also runs the
# single-process `MoELayer` on its own tokens with all 8 experts (built from the same seeds)
# and compares. The timeline shows the pattern: a tiny all-to-all of counts, the dispatch and
# the combine in forward, and their mirror images in backward (the hatched bars are the
# forward and backward regions). The first all-to-all is long on every rank because it is the
# first moment the ranks meet: each waits there for the last one to arrive.

# %%
def ep_step(k=2, capacity_factor=1.25, num_tokens=256, d_model=64, d_hidden=128, num_experts=8):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    router = make_router(d_model, num_experts, seed=0)
    mine = expert_range(num_experts, world_size, rank)
    moe = ExpertParallelMoE(router, make_experts(num_experts, d_model, d_hidden, which=mine), k,
                            capacity_factor)
    # the input requires grad, as it does inside a model: backward returns its gradient too
    x = skewed_tokens(num_tokens, d_model, router, favourite=2, skew=1.0,
                      seed=rank).requires_grad_()
    with region("forward"):
        out = moe(x)
    with region("backward"):
        out.square().mean().backward()
    dense = MoELayer(router, make_experts(num_experts, d_model, d_hidden), k, capacity_factor)
    with torch.no_grad():
        same = torch.allclose(out, dense(x), atol=1e-5)
        counts = torch.bincount(dense.routing.expert[dense.routing.kept], minlength=num_experts)
    # kept rows this rank sends to each rank: the experts of rank j are a contiguous block
    to_rank = counts.view(world_size, -1).sum(dim=1).tolist()
    return {"same as one process": same, "to_rank": to_rank}


traced = launch_traced(ep_step, world_size=4)
print("every rank equals the single-process layer:", all(r["same as one process"] for r in traced))
plot_timeline(traced.events, title="One EP forward and backward, 4 ranks, 8 experts")
plt.show()
for rank, events in enumerate(traced.events):
    print(f"rank {rank}:", [(e.op.replace("all_to_all_single", "a2a"), e.nbytes) for e in events
                            if e.kind == "collective"])

# %% [markdown]
# Each rank makes exactly five all-to-alls: counts (8 int64 = 64 bytes), tokens out, results
# back, then in backward the results' gradients out and the tokens' gradients back, each with
# the bytes of the rows it sends. The sizes differ from rank to rank: the matrix of kept rows
# sent from each rank to each other rank is the real communication pattern.

# %%
traffic = torch.tensor([r["to_rank"] for r in traced])
fig, ax = plt.subplots(figsize=(3.6, 3))
image = ax.imshow(traffic, cmap="Blues")
for i in range(4):
    for j in range(4):
        ax.text(j, i, int(traffic[i, j]), ha="center", va="center", fontsize="small")
ax.set_xticks(range(4))
ax.set_yticks(range(4))
ax.set_xlabel("to rank j (holds experts 2j, 2j+1)")
ax.set_ylabel("from rank")
ax.set_title("Kept rows sent, rank to rank")
fig.colorbar(image, ax=ax)
plt.show()

# %% [markdown]
# The diagonal is a rank's tokens for its own experts: they never leave the rank, but the
# recorder counts them, as part of the buffer each rank hands to the collective. No two
# entries need be equal: the router decides the traffic, and the capacity caps what any
# expert takes from each rank (expert 2, the one these tokens lean to, is full on every rank).
#
# ### Bytes and time against top-k
#
# Four ranks, 512 tokens each, $d_\text{model} = 256$, a capacity large enough to keep every
# choice: the dispatch of top-$k$ routing carries $k \cdot 512 \cdot 256 \cdot 4$ bytes per
# rank, and its time grows with it.

# %%
def a2a_cost(k_values=(1, 2, 3, 4), num_tokens=512, d_model=256, num_experts=8, reps=7):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    router = make_router(d_model, num_experts, seed=0)
    experts = make_experts(num_experts, d_model, 32,
                           which=expert_range(num_experts, world_size, rank))
    x = skewed_tokens(num_tokens, d_model, router, skew=0.0, seed=rank).requires_grad_()
    rows = []
    for k in k_values:
        moe = ExpertParallelMoE(router, experts, k, capacity_factor=num_experts)  # keeps all
        seconds, sent = [], 0
        for _ in range(reps):
            with trace() as t:
                moe(x).sum().backward()
            tokens = [e for e in t.events
                      if e.op == "all_to_all_single" and e.nbytes > 8 * num_experts]
            seconds.append(sum(e.duration for e in tokens))
            sent = sum(e.nbytes for e in tokens)
        rows.append({"k": k, "bytes": sent, "seconds": min(seconds)})  # the least disturbed
    return rows


cost = launch(a2a_cost, world_size=4, timeout=300)
ks = [row["k"] for row in cost[0]]
mib = [statistics.mean(r[i]["bytes"] for r in cost) / 2**20 for i in range(len(ks))]
ms = [max(r[i]["seconds"] for r in cost) * 1e3 for i in range(len(ks))]
fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3))
left.bar(ks, mib, color="tab:cyan")
left.set(xlabel="top-k", ylabel="MiB per rank (mean)", title="Bytes of the 4 token all-to-alls")
right.plot(ks, ms, marker="o", color="tab:cyan")
right.set(xlabel="top-k", ylabel="ms per forward + backward", title="Time in the token all-to-alls",
          ylim=(0, None))
plt.show()
for k, m, s in zip(ks, mib, ms):
    print(f"k={k}: {m:5.2f} MiB, {s:6.1f} ms  ({m / mib[0]:.1f}x the bytes of k=1)")

# %% [markdown]
# The bytes are exactly $k$ times those of $k = 1$ (four all-to-alls of $k \cdot T \cdot
# d_\text{model} \cdot 4$ bytes); the time follows, plus a fixed cost per call. On a GPU
# cluster the same ratio holds, with a bandwidth that depends on where the peers are: within
# a node over NVLink, across nodes over the network, which is why DeepSeek-V3 limits each
# token to experts on at most 4 nodes.
#
# ## 5. Expert parallelism with data parallelism on a 2-D mesh
#
# Real jobs combine EP with data parallelism. On a mesh of shape (dp, ep) = (2, 2), the
# experts are sharded over `ep` (each rank holds half of them) and replicated over `dp`; the
# router (and the rest of the model) is replicated over all four ranks. Each parameter's
# gradient must be reduced over the ranks that hold a copy of it, and divided by the right
# number:
#
# - the **router** is on all 4 ranks, and each rank's gradient covers its own tokens: average
#   over the world, as DDP would;
# - an **expert** is on the 2 ranks of its `dp` group, but each copy's gradient already covers
#   the tokens of its whole `ep` group (the all-to-all brought them): *sum* over `dp` and
#   divide by the world size, not by the size of `dp`. Averaging over `dp` (FSDP2's and DDP's
#   default for that group) would make every expert's gradient `ep` times too large; FSDP2 has
#   [`set_gradient_divide_factor`](https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html)
#   for exactly this.
#
# The run below checks both against one process holding every token and every expert.

# %%
def ep_dp_step(divide_experts_by, num_tokens=64, d_model=32, d_hidden=64, num_experts=8, k=2):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ep_rank, ep_size = mesh.get_local_rank("ep"), mesh.size(1)
    router = make_router(d_model, num_experts, seed=0)
    mine = expert_range(num_experts, ep_size, ep_rank)
    experts = make_experts(num_experts, d_model, d_hidden, which=mine)
    moe = ExpertParallelMoE(router, experts, k, capacity_factor=2.0, group=mesh.get_group("ep"))
    xs = [skewed_tokens(num_tokens, d_model, router, skew=1.0, seed=r) for r in range(world_size)]
    moe(xs[rank]).square().mean().backward()  # this rank's loss: the mean over its tokens
    for p in router.parameters():  # replicated on every rank
        dist.all_reduce(p.grad)
        p.grad /= world_size
    for p in experts.parameters():  # replicated over dp only
        dist.all_reduce(p.grad, group=mesh.get_group("dp"))
        p.grad /= {"world": world_size, "dp": mesh.size(0)}[divide_experts_by]
    # The same step in one process: the objective is the mean of the four ranks' losses.
    router_1 = make_router(d_model, num_experts, seed=0)
    experts_1 = make_experts(num_experts, d_model, d_hidden)
    one = MoELayer(router_1, experts_1, k, capacity_factor=2.0)
    (sum(one(x).square().mean() for x in xs) / world_size).backward()
    ours = torch.cat([p.grad.flatten() for p in experts.parameters()])
    theirs = torch.cat([q.grad.flatten() for e in mine for q in experts_1[e].parameters()])
    return {"router": torch.allclose(router.weight.grad, router_1.weight.grad, atol=1e-6),
            "experts": torch.allclose(ours, theirs, atol=1e-6),
            "expert scale": (ours.norm() / theirs.norm()).item()}


for divide in ("world", "dp"):
    results = launch(ep_dp_step, divide, world_size=4)
    print(f"experts summed over dp, divided by the {divide:5s} size: router as one process: "
          f"{all(r['router'] for r in results)}, experts as one process: "
          f"{all(r['experts'] for r in results)} (their gradients "
          f"{statistics.mean(r['expert scale'] for r in results):.2f}x one process's)")

# %% [markdown]
# Divided by the world size, both match one process to float32 rounding; divided by the
# size of `dp`, the experts' gradients are twice too large (`ep` = 2), and nothing else in
# training would tell you.
#
# ## 6. Load on real ranks
#
# Expert parallelism runs at the pace of its busiest rank: every rank waits in the combine
# all-to-all until the slowest one has run its experts. Four ranks, 1024 tokens each, 8
# experts, $k = 2$, tokens leaning towards expert 5 (on rank 2), with capacity factors from
# tight to loose. Each rank returns its token histogram, the CPU time its experts took (from
# forward hooks on them: CPU time, so that four ranks sharing two cores do not blur it) and
# the wall time of its forward.

# %%
def load_on_ranks(skew, capacity_factors, num_tokens=1024, d_model=128, d_hidden=512,
                  num_experts=8, k=2, reps=3):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    router = make_router(d_model, num_experts, seed=0)
    experts = make_experts(num_experts, d_model, d_hidden,
                           which=expert_range(num_experts, world_size, rank))
    busy = [0.0]

    def started(module, args):
        module.started = time.thread_time()

    def finished(module, args, out):
        busy[0] += time.thread_time() - module.started

    for expert in experts:  # add up the CPU time of every expert's forward
        expert.register_forward_pre_hook(started)
        expert.register_forward_hook(finished)
    x = skewed_tokens(num_tokens, d_model, router, favourite=5, skew=skew, seed=rank)
    rows = []
    for c in capacity_factors:
        moe = ExpertParallelMoE(router, experts, k, c)
        cpu, wall = [], []
        for _ in range(reps):
            busy[0], start = 0.0, time.perf_counter()
            with torch.no_grad():
                moe(x)
            cpu.append(busy[0])
            wall.append(time.perf_counter() - start)
        with torch.no_grad():
            routing = route(router(x), k, capacity(k, num_tokens, c, num_experts))
        rows.append({"histogram": token_histogram(routing, num_experts),
                     "expert cpu": min(cpu), "forward": min(wall)})
    return rows


factors = [0.75, 1.0, 1.25, 2.0, 4.0, 8.0]
loads = {skew: launch(load_on_ranks, skew, factors, world_size=4, timeout=300)
         for skew in (0.0, 1.5)}


def total(rows_by_rank, i, key):
    """Choices per expert over the 4 ranks, kept or dropped, at capacity factor factors[i]."""
    return [sum(r[i]["histogram"][key][e] for r in rows_by_rank) for e in range(8)]


fig, axes = plt.subplots(1, 2, figsize=(10, 3), sharey=True)
for ax, skew in zip(axes, loads):
    i = factors.index(1.25)
    hist = {key: total(loads[skew], i, key) for key in ("kept", "dropped")}
    plot_token_histogram(hist, ax=ax, ranks=4, capacity=4 * capacity(2, 1024, 1.25, 8),
                         title=f"{'balanced' if skew == 0 else 'skewed'} tokens, c = 1.25")
fig.suptitle("Choices per expert over 4 ranks (colour: the rank holding the expert; the line: "
             "its 4 ranks' slots)", fontsize="medium")
fig.tight_layout()
plt.show()

fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3))
for skew, style in ((0.0, "-"), (1.5, "--")):
    name = "balanced" if skew == 0 else "skewed"
    dropped = [sum(total(loads[skew], i, "dropped")) / (4 * 1024 * 2) for i in range(len(factors))]
    left.plot(factors, [100 * d for d in dropped], style, marker="o", label=name)
    for rank in range(4):
        right.plot(factors, [1e3 * loads[skew][rank][i]["expert cpu"] for i in range(len(factors))],
                   style, marker=".", color=f"C{rank}", label=f"rank {rank}, {name}")
left.set(xlabel="capacity factor", ylabel="choices dropped (%)", title="Dropped choices, 4 ranks")
right.set(xlabel="capacity factor", ylabel="expert CPU ms per forward",
          title="Each rank's expert time")
for ax in (left, right):
    ax.set_xscale("log")
    ax.set_xticks(factors, [f"{c:g}" for c in factors])
    ax.minorticks_off()
left.legend(fontsize="small", frameon=False)
right.legend(fontsize="x-small", frameon=False, ncol=2)
plt.show()
for skew in loads:
    ratios = []
    for i, c in enumerate(factors):
        cpu = [r[i]["expert cpu"] for r in loads[skew]]
        ratios.append(f"c={c:g} {max(cpu) / statistics.mean(cpu):.1f}x")
    print(f"{'balanced' if skew == 0 else 'skewed  '}: slowest rank's expert time / mean:",
          ", ".join(ratios))

# %% [markdown]
# With balanced tokens every rank does about the same work and few choices are dropped once
# $c \ge 1.25$. With skewed tokens, rank 2 (experts 4 and 5) is wanted far more than the
# others: with a loose capacity its experts compute much longer than the mean rank's (the
# ratios above), and every rank's forward waits for it in the combine; a tight capacity caps
# its work, at the price of dropping the tokens that did not fit. That is the trade the
# capacity factor sets, and why the load-balancing loss matters twice under expert
# parallelism: for the quality of the model and for the speed of the slowest rank.

# %% [markdown]
# ## 7. Dropless: sort by expert, one grouped matrix product, un-permute
#
# A capacity buys fixed shapes with dropped tokens. Dropless layers (MegaBlocks, Megatron-Core,
# DeepSeek-V3, torchtitan's `GroupedExperts`) keep every choice and let each expert take
# however many rows the router sent it:
#
# 1. **permute**: flatten the $(T, k)$ choices and sort them by expert with a *stable* sort
#    (`torch.argsort(..., stable=True)`), so the rows of expert 0 come first, then expert 1's,
#    each group in token order; row $i$ of the flattened choices belongs to token $i // k$;
# 2. **count**: `torch.bincount` gives each expert's rows, their running sum the offsets
#    where each group ends;
# 3. **one grouped matrix product per layer**: `torch.nn.functional.grouped_mm(rows, w1,
#    offs=offsets)` multiplies group $e$ by `w1[e]`, every expert in one kernel (torch 2.13
#    runs it on CPU for float32 and bfloat16 when each row is a multiple of 16 bytes; float64
#    is refused). Where it does not run, a padded `torch.bmm` over an $(E, n_\max, d)$ buffer
#    does the same with zeros in the short groups;
# 4. **un-permute and combine**: multiply each result row by its choice's weight and add it
#    into its token's row (`index_add` with the sorted rows' tokens).
#
# The experts' weights come stacked: `stack_experts` (from `kit.lessons.moe`) turns the
# `ExpertMLP`s into `w1` $(E, d, h)$, `b1` $(E, h)$, `w2` $(E, h, d)$ and `b2` $(E, d)$,
# input dimension first, so that expert $e$ computes
# $\mathrm{gelu}(x W_1^{(e)} + b_1^{(e)}) W_2^{(e)} + b_2^{(e)}$.
#
# ### Task 13.4: `grouped_experts`
#
# Write `grouped_experts(x, expert, weight, w1, b1, w2, b2)`. The check compares values and
# gradients (of `x`, the weights and the routing weights) with a loop over tokens in float64,
# in float32 and bfloat16, with $k = 1, 2, 3$, an expert nobody chooses, a single expert, no
# tokens and a skewed batch that a capacity would cut; and it counts the matrix-product
# kernels of one forward below Python (`kit.meter.count_ops`) and the bytes it allocates
# (`kit.meter.track`): one product per layer, whatever $E$, and rows for the choices, not
# weights copied per token.

# %% tags=["task-13.4"]
def grouped_experts(x: torch.Tensor, expert, weight, w1, b1, w2, b2) -> torch.Tensor:
    """Dropless experts: every choice computed, one grouped matrix product per layer.

    Args:
        x: (T, d_model) tokens.
        expert: (T, k) int expert of each choice (Routing.expert), a tensor or nested lists.
        weight: (T, k) weight of each choice (Routing.weight), a tensor or nested lists.
        w1, b1, w2, b2: the stacked experts (stack_experts): (E, d_model, d_hidden),
            (E, d_hidden), (E, d_hidden, d_model), (E, d_model); tensors, or lists of E
            per-expert tensors.
    Returns (T, d_model): out[t] = sum_j weight[t, j] * f_e(x[t]) with e = expert[t, j] and
    f_e(v) = gelu(v @ w1[e] + b1[e]) @ w2[e] + b2[e], in x's dtype, differentiable in x, the
    weights and the routing weights. No choice is dropped; an expert nobody chose, or T = 0,
    is fine. The choices are sorted by expert (a stable sort), counted, and each layer is ONE
    matrix-product kernel over all of them (F.grouped_mm, or torch.bmm over a padded buffer);
    no loop over experts. Raises ValueError when an expert index is outside 0 .. E-1 or the
    shapes of expert and weight differ.
    """
    ### BEGIN SOLUTION
    w1, b1, w2, b2 = (p if isinstance(p, torch.Tensor) else torch.stack(list(p))
                      for p in (w1, b1, w2, b2))
    num_experts = w1.shape[0]
    expert = torch.as_tensor(expert, dtype=torch.int64, device=x.device)
    weight = torch.as_tensor(weight, dtype=x.dtype, device=x.device)
    if expert.shape != weight.shape or expert.dim() != 2:
        raise ValueError(f"expert {tuple(expert.shape)} and weight {tuple(weight.shape)} must "
                         "both be (T, k): one expert and one weight per choice")
    if expert.numel() and not 0 <= int(expert.min()) <= int(expert.max()) < num_experts:
        raise ValueError(f"expert indices run from {int(expert.min())} to {int(expert.max())}, "
                         f"but w1 stacks {num_experts} experts (0 to {num_experts - 1})")
    k = expert.shape[1]
    choices = expert.reshape(-1)  # (T * k,), token by token: choice i belongs to token i // k
    order = torch.argsort(choices, stable=True)  # grouped by expert, token order within
    token, sorted_expert = order // k, choices[order]
    offsets = torch.bincount(choices, minlength=num_experts).cumsum(0).to(torch.int32)
    hidden = F.gelu(F.grouped_mm(x[token], w1, offs=offsets) + b1[sorted_expert])
    rows = F.grouped_mm(hidden, w2, offs=offsets) + b2[sorted_expert]  # (T * k, d_model)
    rows = rows * weight.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add(0, token, rows)
    ### END SOLUTION


# %% tags=["check-13.4"]
check("13.4", grouped_experts)

# %% [markdown]
# When the capacity drops nothing, the dropless layer is the capacity layer: the same routing,
# the same experts. On a skewed batch with capacity factor 1.25, `MoELayer` drops choices and
# `grouped_experts` keeps them; the difference sits exactly in the tokens that lost a choice.

# %%
d_model, hidden, num_experts, num_tokens, k = 64, 128, 8, 512, 2
router = make_router(d_model, num_experts, seed=0)
experts = make_experts(num_experts, d_model, hidden, seed=0)
stacked = stack_experts(experts)
x = skewed_tokens(num_tokens, d_model, router, favourite=3, skew=2.0, seed=1)
with torch.no_grad():
    for factor in (float(num_experts), 1.25):
        capped = MoELayer(router, experts, k, factor)
        out_capacity = capped(x)
        everything = route(router(x), k, k * num_tokens)  # a capacity no expert reaches
        out_dropless = grouped_experts(x, everything.expert, everything.weight, *stacked)
        lost = (~capped.routing.kept).any(dim=1)  # tokens that lost a choice
        differs = (out_capacity - out_dropless).abs().amax(dim=1) > 1e-4
        print(f"capacity factor {factor:4g}: {int((~capped.routing.kept).sum()):4d} choices "
              f"dropped; outputs differ on {int(differs.sum()):3d} tokens, all of them "
              f"tokens that lost a choice: {not bool((differs & ~lost).any())}")

# %% [markdown]
# **Kernels.** `kit.meter.count_ops` counts the aten ops one forward dispatches: the loop of
# `MoELayer` runs two matrix products per expert that got rows (`aten.addmm`, from each
# `nn.Linear`), the grouped layer two in all, whatever $E$.

# %%
MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._grouped_mm")
with torch.no_grad():
    for E in (4, 8, 16):
        experts_E = make_experts(E, d_model, hidden, seed=0)
        router_E = make_router(d_model, E, seed=0)
        r = route(router_E(x), k, k * num_tokens)
        with count_ops() as loop_ops:
            MoELayer(router_E, experts_E, k, float(E))(x)
        with count_ops() as grouped_ops:
            grouped_experts(x, r.expert, r.weight, *stack_experts(experts_E))
        loop_n = sum(loop_ops.get(op, 0) for op in MATMULS) - 1  # minus the router's own
        grouped_n = sum(grouped_ops.get(op, 0) for op in MATMULS)
        print(f"E={E:2d}: loop over experts {loop_n:2d} matrix products, grouped {grouped_n}")

# %% [markdown]
# **Memory.** Each layout holds a different buffer of rows for the experts' hidden layer,
# $(\text{rows}, h)$ per layer: the grouped layer exactly the $T k$ choices; a padded `bmm`
# $E \cdot n_\max$ rows, every expert padded to the busiest one; a capacity buffer $E \cdot C$
# rows, fixed in advance, with the overflow dropped. The table computes each from the routing
# of a balanced and a skewed batch, and measures the peak bytes one forward of
# `grouped_experts` allocates (`kit.meter.track`, inputs requiring grad, so the activations
# autograd keeps are counted).

# %%
element = torch.empty((), dtype=x.dtype).element_size()
print(f"{'':9s} {'layout':22s} {'rows':>6s} {'(rows, h) buffer':>17s} {'dropped':>8s}")
for skew in (0.0, 2.0):
    x_s = skewed_tokens(num_tokens, d_model, router, favourite=3, skew=skew, seed=1)
    with torch.no_grad():
        r = route(router(x_s), k, k * num_tokens)
    counts = torch.bincount(r.expert.reshape(-1), minlength=num_experts)
    cap = capacity(k, num_tokens, 1.25, num_experts)
    dropped = int((counts - cap).clamp_min(0).sum())
    name = "balanced" if skew == 0 else "skewed"
    for layout, rows, lost in (("grouped (dropless)", num_tokens * k, 0),
                               ("padded bmm", num_experts * int(counts.max()), 0),
                               ("capacity buffer c=1.25", num_experts * cap, dropped)):
        print(f"{name:9s} {layout:22s} {rows:6d} {rows * hidden * element / 2**10:13.0f} KiB "
              f"{100 * lost / (num_tokens * k):7.1f}%")
    leaves = [p.detach().requires_grad_() for p in stacked]
    with track() as usage:
        grouped_experts(x_s.requires_grad_(), r.expert, r.weight, *leaves)
    print(f"{name:9s} grouped_experts forward: {usage.peak / 2**10:.0f} KiB peak measured "
          f"(its activations for backward: a few (T k, d) and (T k, h) tensors)")

# %% [markdown]
# Balanced, the three are close; skewed, the padded buffer grows with the busiest expert
# (up to $E$ times the grouped one when one expert takes everything) while the capacity
# buffer stays fixed and drops instead. The grouped product pays neither: its only cost is
# shapes that change every step, which is why its kernels (and the all-to-alls of expert
# parallelism around it) need the counts first.

# %% [markdown]
# ## Running at scale
#
# > The layer you wrote runs unchanged under `torchrun` with NCCL; only the device changes:
# >
# > ```python
# > # torchrun --standalone --nproc_per_node=8 train_moe.py
# > import os
# > import torch
# > import torch.distributed as dist
# > from torch.distributed.device_mesh import init_device_mesh
# >
# > dist.init_process_group("nccl")
# > local_rank = int(os.environ["LOCAL_RANK"])
# > torch.cuda.set_device(local_rank)
# > mesh = init_device_mesh("cuda", (dist.get_world_size() // 4, 4), mesh_dim_names=("dp", "ep"))
# > ep_rank = mesh.get_local_rank("ep")
# > router = make_router(4096, 64).cuda()
# > experts = make_experts(64, 4096, 1408, which=expert_range(64, 4, ep_rank)).cuda()
# > moe = ExpertParallelMoE(router, experts, k=2, capacity_factor=1.25, group=mesh.get_group("ep"))
# > ```
# >
# > - **Splits live on the host.** `all_to_all_single` takes its split sizes as Python lists, so
# >   the counts that arrive on the GPU must be copied to the CPU before the dispatch: one
# >   device-to-host synchronisation per layer. torchtitan's `ExpertParallel`
# >   (`torchtitan/distributed/expert_parallel.py`) does what you wrote: one `all_to_all_single`
# >   of `num_tokens_per_expert`, then `all_to_all_single_autograd` (from
# >   `torch.distributed._functional_collectives`) for the dispatch and the combine, with the
# >   splits swapped. It is a `ParallelStyle`, so a model's plan applies it to the experts
# >   module with `parallelize_module`, as Lesson 08's tensor-parallel plans apply
# >   `ColwiseParallel`; it shards the experts' stacked weights along the expert dimension
# >   (`Shard(0)` on the `ep` mesh).
# > - **Grouped GEMMs.** A loop over experts launches two small matrix multiplications per
# >   expert. `torch.nn.functional.grouped_mm` (torch's `_grouped_mm`, which torchtitan's
# >   `GroupedExperts` calls) runs every expert of a rank in one kernel, from the rows sorted by
# >   expert and the offsets where each expert's rows end; its docs expect bf16 on CUDA GPUs of
# >   compute capability 8.0 or newer. The cell below runs it on CPU in float32 against the loop.
# > - **Where the all-to-all goes.** Inside a node NCCL sends over NVLink; across nodes over
# >   the network, far slower, so large jobs keep `ep` within a node or limit the nodes a token
# >   may visit, and overlap the dispatch of one micro-batch with the experts of another.
# > - **Sharding the rest.** Experts are sharded over `ep` and usually FSDP-sharded over the
# >   data-parallel dimension too; every other weight is FSDP-sharded over all ranks. The
# >   expert gradients then need the divide factor of section 5.

# %%
rows_per_expert = torch.tensor([5, 0, 7, 4])  # rows already sorted by expert
a = torch.randn(int(rows_per_expert.sum()), 16)
weights = torch.randn(4, 16, 8)  # (experts, in, out)
offsets = rows_per_expert.cumsum(0).to(torch.int32)  # where each expert's rows end
grouped = F.grouped_mm(a, weights, offs=offsets)
loop = torch.cat([block @ w for block, w in zip(a.split(rows_per_expert.tolist()), weights)])
print("grouped_mm equals the loop over experts:", torch.allclose(grouped, loop, atol=1e-5))

# %% [markdown]
# ## Summary
#
# - A router picks each token's top-$k$ experts from a softmax; ties must go to the lower index
#   on every machine (a stable sort; `torch.topk` promises nothing). Weights here are the raw
#   probability for $k = 1$ and renormalised over the $k$ chosen for $k > 1$ (as Mixtral; some
#   models keep the raw top-$k$ probabilities).
# - With a capacity, each expert has $\lceil k T c / E \rceil$ slots, handed out first choices
#   first; what does not fit is dropped and carried by the residual. Skew and a low capacity
#   factor drop more. Dropless layers (MegaBlocks, Megatron-Core, DeepSeek-V3, torchtitan) sort
#   the choices by expert and run one grouped matrix product per layer instead: nothing dropped,
#   no padding, shapes that change every step.
# - An MoE has $E$ experts' parameters for $k$ experts' FLOPs per token.
# - Without Switch's auxiliary loss $E \sum_i f_i P_i$ the router collapses onto a few experts;
#   the gradient flows through $P$ only, $\frac{E}{T} p_t (f - p_t \cdot f)$ per token, and the
#   loss is 1 at perfect balance. A per-expert selection bias nudged by the sign of the load
#   error (DeepSeek-V3) balances without the auxiliary term.
# - Expert parallelism: one all-to-all of counts, one of tokens, the experts, one of results;
#   $4 k d_\text{model}$ values per token and layer through the all-to-alls, forward and
#   backward. The slowest rank sets the pace.
# - On a (dp, ep) mesh, replicated weights are averaged over the world, experts are summed
#   over `dp` and divided by the world size.
#
# **Read more:** [`torch.distributed.all_to_all_single`](https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_to_all_single),
# [DeviceMesh](https://pytorch.org/tutorials/recipes/distributed_device_mesh.html),
# Switch Transformers ([Fedus et al., 2021](https://arxiv.org/abs/2101.03961)),
# GShard ([Lepikhin et al., 2020](https://arxiv.org/abs/2006.16668)),
# DeepSpeed-MoE ([Rajbhandari et al., 2022](https://arxiv.org/abs/2201.05596)),
# Mixtral ([Jiang et al., 2024](https://arxiv.org/abs/2401.04088)),
# MegaBlocks ([Gale et al., 2022](https://arxiv.org/abs/2211.15841)),
# DeepSeek-V3 ([DeepSeek-AI, 2024](https://arxiv.org/abs/2412.19437)),
# [`torch.nn.functional.grouped_mm`](https://docs.pytorch.org/docs/main/generated/torch.nn.functional.grouped_mm.html),
# the [Ultra-Scale Playbook](https://huggingface.co/spaces/nanotron/ultrascale-playbook)'s
# expert-parallelism chapter, and [torchtitan](https://github.com/pytorch/torchtitan)'s MoE.
#
# ## Exercises (not graded)
#
# 1. Replace the loop over local experts in `ExpertParallelMoE` with one `F.grouped_mm` per
#    linear layer (stack the experts' weights). Check it still passes `check("13.3", ...)`'s
#    values, then think about what the meter would say about the stacked copy.
# 2. Add the router z-loss of ST-MoE (Zoph et al., 2022), the mean of
#    $(\log \sum_e e^{\text{logit}_e})^2$, to the collapse experiment. Does it balance the load
#    on its own?
# 3. Make dispatch overlap compute: split the tokens in two halves and start the second half's
#    dispatch (`async_op=True`) before running the experts on the first. Look at the timeline.
# 4. Route with $k = 2$ but give the second choice no slot when the first one was dropped
#    (some implementations do). How do the dropped fractions of section 1 change?
# 5. Dispatch by all-gather instead: every rank gathers every token and computes its experts'
#    share of all of them. Count its bytes against the all-to-all's for W = 2, 4 and 8
#    (`benchmarks/moe_dispatch.py` measures both).
