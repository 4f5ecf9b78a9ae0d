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
# A training step spends memory on four things (weights, gradients, optimizer state and the
# activations kept for backward) and time on arithmetic and on moving bytes. This lesson
# shrinks both with the three tools every large run uses: lower-precision arithmetic,
# recomputing activations instead of keeping them, and compiling the model into fused
# kernels. Each one has a distributed twist, and you will meet it.
#
# **Prerequisites:** Lesson 04 (DDP, buckets, communication hooks) and Lesson 05 (sharded
# gradients, FSDP2's `fully_shard`); a PyTorch training loop and `torch.autograd.Function`.
#
# **You will be able to:**
# - read fp32, tf32, fp16 and bf16 as exponent and mantissa bits, and say which one
#   underflows, which one overflows and which one rounds;
# - say which ops `torch.autocast` runs in low precision on CPU and on CUDA, and why the
#   weights stay in fp32;
# - write a dynamic loss scaler that skips a step on every rank together ({{task 7.1}});
# - count the bytes autograd saves for backward and check them against the per-layer formula
#   ({{task 7.2}});
# - write activation checkpointing as an `autograd.Function`, dropout included, and apply it
#   to every k-th block ({{task 7.3}});
# - find and remove graph breaks so `torch.compile` captures a model in one graph
#   ({{task 7.4}}), and measure what Inductor's fusion buys on CPU.
#
# Everything runs on CPU. Where a GPU behaves differently, the text says so.

# %% tags=["setup"]
import contextlib
import logging
import time

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from kit import check, launch
from kit.lessons.models import TinyTransformer, token_batch
from kit.lessons.precision import GraphBreakNet, format_table, padded_batch

# %% [markdown]
# ## 1. Floating-point formats
#
# A float is a sign, an exponent and a mantissa. The exponent bits set the **range** (how
# large and how small a number can be), the mantissa bits set the **precision** (the gap
# between 1 and the next number, *epsilon*). `torch.finfo` knows every format:

# %%
print(f"{'format':7}{'bits':>5}{'exp':>5}{'mant':>6}{'max':>11}{'min normal':>12}{'eps':>10}")
for row in format_table():
    print(f"{row['format']:7}{row['bits']:>5}{row['exponent']:>5}{row['mantissa']:>6}"
          f"{row['max']:>11.3g}{row['smallest normal']:>12.3g}{row['eps']:>10.3g}")

# %% [markdown]
# - **fp16** has 5 exponent bits: nothing above 65504, and nothing below about 6e-8 (the
#   smallest *subnormal*; normal numbers stop at 6.1e-5). Small gradients become 0.
# - **bf16** keeps fp32's 8 exponent bits and only 7 mantissa bits: the same range of normal
#   numbers as fp32 (gradients do not underflow in practice), but coarse rounding
#   (eps = 1/128).
# - **tf32** is not a storage type: it is how NVIDIA tensor cores (Ampere and newer) read
#   fp32 inputs of a matmul or a convolution when TF32 is on: fp32's range with fp16's 10
#   mantissa bits. torch 2.13 switches it per backend and op:
#   `torch.backends.cuda.matmul.fp32_precision = "tf32"` for matmuls (off by default),
#   `torch.backends.cudnn.conv.fp32_precision` for convolutions (`"tf32"` by default) and
#   `torch.backends.cudnn.rnn.fp32_precision`, or all of them with `torch.backends.fp32_precision`
#   ([docs](https://pytorch.org/docs/stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices)).
#   The older flags, `torch.backends.cuda.matmul.allow_tf32` and `torch.backends.cudnn.allow_tf32`,
#   still work; do not mix the two (reading an old flag after setting a new one raises).
#
# Here is what happens to the real gradients of a small transformer if they are stored in
# fp16: the histogram of their magnitudes against fp16's limits.

# %%
torch.manual_seed(0)
model = TinyTransformer(vocab=64, dim=64, layers=2, heads=4, context=32)
x, y = token_batch(8, 32, 64, seed=0)  # (B=8, T=32) inputs and next-token targets
F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
grads = torch.cat([p.grad.flatten() for p in model.parameters()])  # every gradient, fp32
fp16 = torch.finfo(torch.float16)
for scale in (1.0, 2.0**8, 2.0**16):
    g16 = (grads * scale).half()
    lost = ((g16 == 0) & (grads != 0)).float().mean().item()
    inf = torch.isinf(g16).float().mean().item()
    print(f"loss scaled by {scale:>7g}: {100 * lost:.3f}% of gradients flush to 0 in fp16, "
          f"{100 * inf:.4f}% overflow to inf")

nonzero = grads[grads != 0].abs()
plt.figure(figsize=(7, 2.6))
plt.hist(nonzero.log2().numpy(), bins=80, color="tab:blue")
plt.axvline(-24, color="tab:red", ls="--", label="fp16 smallest subnormal (2^-24)")
plt.axvline(-14, color="tab:orange", ls="--", label="fp16 smallest normal (2^-14)")
plt.axvline(-16, color="tab:green", ls=":", label="what scaling by 2^8 lifts above 2^-24")
plt.xlabel("log2 |gradient|")
plt.ylabel("count")
plt.title("Gradients of a 2-layer transformer against fp16's range")
plt.legend(fontsize="small")
plt.show()

# %% [markdown]
# The tail left of the red line is lost in fp16; the part between red and orange keeps only
# a few bits. Multiplying the loss by $S$ multiplies every gradient by $S$ (backward is
# linear), which moves the whole histogram right: that is **loss scaling**. Too large an
# $S$ pushes the right tail past 65504 to inf, which is why the scale must adapt.
#
# ## 2. autocast: which ops run in low precision
#
# [`torch.autocast`](https://pytorch.org/docs/stable/amp.html) does not convert the model. It
# intercepts each op and casts its inputs, following one list per device. Ops that are fast
# and safe in low precision (matmuls, convolutions, linear layers) run in bf16 or fp16 on
# every device. Which ops are cast up to fp32 differs: CUDA's list holds the ops that need
# range or add up many terms (`exp`, `log`, `sum`, `softmax`, `log_softmax`, `layer_norm`,
# `group_norm` and the losses), while CPU's holds mostly the losses. Every op on neither list
# runs in the dtype of its inputs (the widest, when they differ). The weights stay fp32
# (**master weights**): the optimizer adds small updates to them, which bf16 would round away
# (1 + 1/256 is 1 in bf16). Watch each module's output dtype:

# %%
dtypes = []
hooks = [m.register_forward_hook(lambda m, i, o, name=name: dtypes.append((name, o.dtype)))
         for name, m in model.blocks[0].named_modules() if name and name != "mlp"]
with torch.autocast("cpu", dtype=torch.bfloat16):
    logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
for h in hooks:
    h.remove()
for name, dtype in dtypes:
    print(f"blocks.0.{name:6} -> {dtype}")
print(f"logits -> {logits.dtype}, loss -> {loss.dtype}")
loss.backward()
print("weights:", model.head.weight.dtype, "| their gradients:", model.head.weight.grad.dtype)
with torch.autocast("cpu", dtype=torch.bfloat16):  # on CPU, softmax keeps its input's dtype
    print("softmax on CPU under autocast: of bf16 ->", torch.softmax(logits, -1).dtype,
          "| of fp32 ->", torch.softmax(logits.float(), -1).dtype)

# %% [markdown]
# On CPU, linear layers and GELU run in bf16, the loss in fp32, and the gradients land in
# fp32 on the fp32 weights. LayerNorm's output is fp32 here, but not because of a list: its
# input, the residual stream `x + proj(...)`, is fp32 (fp32 plus bf16 gives fp32), and CPU
# autocast leaves `layer_norm` in its input's dtype. Side by side, for an op given a bf16
# input (the CPU column is measured in the next cell; the CUDA column is the
# ["CUDA ops that can autocast to float32"](https://pytorch.org/docs/stable/amp.html#cuda-ops-that-can-autocast-to-float32)
# list of the [op reference](https://pytorch.org/docs/stable/amp.html#autocast-op-reference)):
#
# | op | CPU autocast, bf16 | CUDA autocast |
# | --- | --- | --- |
# | `linear`, `matmul`, `conv2d` (even on fp32 inputs) | bf16 | bf16 / fp16 |
# | `layer_norm`, `group_norm` | bf16 (its input's dtype) | fp32 |
# | `softmax`, `log_softmax` | bf16 | fp32 |
# | `exp`, `sum` | bf16 | fp32 |
# | `cross_entropy`, `nll_loss`, `mse_loss` | fp32 | fp32 |
#
# A CPU kernel such as `sum` still accumulates a bf16 input in fp32 and rounds only the
# result. fp16 autocast works on CPU too (`dtype=torch.float16`); it needs the loss scaling
# below.

# %%
bf16_input, targets = torch.randn(4, 8, dtype=torch.bfloat16), torch.randint(0, 8, (4,))
ops = {"linear (fp32 in)": lambda t: F.linear(t.float(), torch.randn(8, 8)),
       "layer_norm": lambda t: F.layer_norm(t, (8,)), "group_norm": lambda t: F.group_norm(t, 2),
       "softmax": lambda t: t.softmax(-1), "log_softmax": lambda t: t.log_softmax(-1),
       "exp": torch.exp, "sum": torch.sum, "cross_entropy": lambda t: F.cross_entropy(t, targets),
       "mse_loss": lambda t: F.mse_loss(t, torch.zeros_like(t))}
with torch.autocast("cpu", dtype=torch.bfloat16):
    for name, op in ops.items():
        print(f"CPU autocast: {name:16} -> {op(bf16_input).dtype}")

# %% [markdown]
# ## 3. Loss scaling, on one rank and many
#
# Dynamic loss scaling (`torch.amp.GradScaler`) keeps a scale $S$:
#
# 1. `scaler.scale(loss).backward()`: backward on $S \cdot$ loss, so every gradient is $S$ times
#    too large;
# 2. `scaler.unscale_(optimizer)`: divide the gradients by $S$ and look for inf/NaN;
# 3. `scaler.step(optimizer)`: step only if all gradients are finite, else **skip**;
# 4. `scaler.update()`: after a skipped step, $S \leftarrow S \cdot$ `backoff_factor` (0.5);
#    after `growth_interval` finite steps in a row, $S \leftarrow S \cdot$ `growth_factor` (2).
#
# Clip *after* unscaling: the clipping threshold is meant for true gradients. That is why
# `unscale_` is public and `step` must not unscale a second time.
#
# **With sharded gradients** (ZeRO-2, FSDP) each rank holds only its shard, so only the rank
# whose shard overflowed sees the inf. If it skips and the others step, the replicas drift
# apart and their scales disagree forever. Every rank must decide together: all-reduce the
# found-inf flag. That is what `torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`
# adds to `GradScaler` (its `unscale_` all-reduces the flag).
#
# ### Task 7.1: `DynamicLossScaler`
#
# Write `DynamicLossScaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
# growth_interval=2000)` with `scale(loss)`, `unscale_(optimizer)`, `step(optimizer)`,
# `update()` and `get_scale()`, behaving like `torch.amp.GradScaler("cpu")` on one rank, and
# making every rank skip when any rank finds an inf or NaN (when a process group is
# initialised). Do not use torch's scalers: the checks compare against them. As `GradScaler`
# does, refuse fp16 *gradients* (a model cast to fp16, no fp32 weights: in torch 2.13 its
# `unscale_` raises `ValueError: Attempting to unscale FP16 gradients.`) with a `ValueError`
# naming fp16; bf16 gradients are unscaled like fp32 ones, and a frozen parameter (no `.grad`)
# is left alone.

# %% tags=["task-7.1"]
class DynamicLossScaler:
    """Dynamic loss scaling for low-precision gradients, in step on every rank.

    Multiply the loss by the scale before backward; before the optimizer steps, divide the
    gradients by it and look for inf/NaN. A step with any inf/NaN gradient, on any rank, is
    skipped by every rank and the scale is multiplied by ``backoff_factor``; after
    ``growth_interval`` finite steps in a row it is multiplied by ``growth_factor``.

    Args:
        init_scale: the first scale.
        growth_factor: multiplies the scale after ``growth_interval`` finite steps in a row.
        backoff_factor: multiplies the scale after a step with an inf/NaN gradient.
        growth_interval: finite steps in a row before the scale grows.

    Gradients may be plain tensors or sharded DTensors (FSDP2): each rank tests and unscales
    the part it holds (a DTensor's local shard, possibly empty), and the ranks agree on the
    skip with one all-reduce. A parameter without a gradient (frozen) is left alone; bf16
    gradients are unscaled like fp32 ones; fp16 gradients (parameters kept in fp16) are a
    ValueError naming fp16, as in torch's GradScaler.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        ### BEGIN SOLUTION
        self.scale_value = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0  # finite steps in a row since the scale last changed
        self.found_inf = False  # did this step find an inf/NaN gradient, on any rank?
        self.unscaled = False  # has unscale_() run since the last update()?
        ### END SOLUTION

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Return ``loss`` times the current scale (call ``.backward()`` on the result)."""
        ### BEGIN SOLUTION
        return loss * self.scale_value
        ### END SOLUTION

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of ``optimizer``'s parameters by the scale, in place, once per
        step, and find out whether any rank holds an inf/NaN gradient."""
        ### BEGIN SOLUTION
        if self.unscaled:
            return
        inv_scale = 1.0 / self.scale_value
        # This rank's gradients: the local shard of a sharded (DTensor) one, as FSDP2 leaves
        # it. A plain tensor and a DTensor do not mix, and the shard is all this rank holds.
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                 for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        if any(g.dtype == torch.float16 for g in grads):  # checked before anything changes
            raise ValueError("DynamicLossScaler.unscale_: float16 (fp16) gradients cannot be "
                             "unscaled: scaled in fp16 they overflow. Keep the parameters in "
                             "float32 and run the forward under torch.autocast, as torch's "
                             "GradScaler requires")
        found = torch.zeros(1, device=grads[0].device if grads else "cpu")
        for g in grads:
            found += (~torch.isfinite(g)).any()
            g.mul_(inv_scale)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)  # one rank's overflow is everyone's
        self.found_inf = bool(found.item() > 0)
        self.unscaled = True
        ### END SOLUTION

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale (if not yet done this step) and step the optimizer unless some rank found
        an inf/NaN gradient. Returns whether the optimizer stepped."""
        ### BEGIN SOLUTION
        self.unscale_(optimizer)
        if self.found_inf:
            return False
        optimizer.step()
        return True
        ### END SOLUTION

    def update(self) -> None:
        """Back off after a skipped step, grow after ``growth_interval`` finite steps in a row;
        then get ready for the next step."""
        ### BEGIN SOLUTION
        if self.found_inf:
            self.scale_value *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale_value *= self.growth_factor
                self.growth_tracker = 0
        self.found_inf = False
        self.unscaled = False
        ### END SOLUTION

    def get_scale(self) -> float:
        """The current scale."""
        ### BEGIN SOLUTION
        return self.scale_value
        ### END SOLUTION


# %% tags=["check-7.1"]
check("7.1", DynamicLossScaler)

# %% [markdown]
# Your scaler at work: fp16 autocast on CPU, a scale that starts far too high (2^24) and a
# short growth interval, so that you see it back off, settle and grow.


# %%
def counting_batch(batch, length, vocab, seed):
    """Sequences that count up from a random start (mod vocab): next-token prediction is
    learnable, so loss curves go down. Inputs and targets, both (batch, length)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    tokens = (start + torch.arange(length + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


torch.manual_seed(0)
model = TinyTransformer(vocab=64, dim=64, layers=2, heads=4, context=32)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = DynamicLossScaler(init_scale=2.0**24, growth_interval=4)
scales, skipped = [], []
for step in range(30):
    x, y = counting_batch(8, 32, 64, seed=step)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # on the true gradients
    if not scaler.step(optimizer):
        skipped.append(step)
    scaler.update()
    scales.append(scaler.get_scale())
print(f"skipped steps: {skipped}; final scale 2^{torch.tensor(scales[-1]).log2().item():.0f}; "
      f"last loss {loss.item():.3f}")
plt.figure(figsize=(7, 2.4))
plt.semilogy(scales, base=2, marker=".", label="scale after update()")
plt.scatter(skipped, [scales[s] for s in skipped], color="tab:red", zorder=3, label="skipped step")
plt.xlabel("step")
plt.ylabel("loss scale")
plt.title("Dynamic loss scaling with fp16 autocast: back off, then grow every 4 good steps")
plt.legend(fontsize="small")
plt.show()

# %% [markdown]
# ### Mixed precision with DDP and FSDP2
#
# - **DDP** all-reduces whatever dtype the gradients have (fp32 under autocast). A
#   [communication hook](https://pytorch.org/docs/stable/ddp_comm_hooks.html) can compress
#   each bucket to half precision for the wire: `fp16_compress_hook` works with any backend.
#   `bf16_compress_hook` is refused by the build of torch, not by the backend: when you
#   register it, DDP checks for a CUDA (or ROCm) build with NCCL 2.10 or newer, or an XPU
#   build with XCCL, and never looks at the process group, so on a CUDA build it registers
#   even on a gloo group. This CPU-only build refuses it:

# %%
def bf16_hook_on_gloo():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(nn.Linear(8, 8))
    try:
        ddp.register_comm_hook(dist.group.WORLD, default_hooks.bf16_compress_hook)
    except TypeError as e:
        return f"refused: {e}"
    return "registered"


print(launch(bf16_hook_on_gloo, world_size=2)[0])

# %% [markdown]
# - **FSDP2** takes a [`MixedPrecisionPolicy`](https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html):
#   `param_dtype` is the dtype the all-gathered weights are cast to for forward and backward
#   (compute and all-gather traffic halve), `reduce_dtype` the dtype of the gradient
#   reduce-scatter; the sharded parameters, the gradients the optimizer sees and the optimizer
#   state stay fp32. It runs on CPU with gloo too:


# %%
def fsdp2_bf16():
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model[0], mp_policy=policy)
    fully_shard(model[2], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    model(torch.randn(4, 8)).sum().backward()
    return (f"layer output {seen[0]}, sharded weight {model[0].weight.dtype} "
            f"{tuple(model[0].weight.to_local().shape)} of (32, 8), its gradient "
            f"{model[0].weight.grad.dtype}")


print(launch(fsdp2_bf16, world_size=2)[0])

# %% [markdown]
# ## 4. What autograd keeps for backward
#
# Backward needs some of forward's tensors: a linear layer needs its input to compute the
# weight's gradient, GELU needs its input, attention needs Q, K, V and its output. Autograd
# *saves* them when forward runs, and they stay alive until backward frees them: that is the
# activation memory, and for long sequences it dwarfs the weights.
# [`torch.autograd.graph.saved_tensors_hooks(pack, unpack)`](https://pytorch.org/docs/stable/autograd.html#torch.autograd.graph.saved_tensors_hooks)
# calls `pack(t)` on every tensor autograd saves, which lets us see them. Several saved
# tensors may be views of one storage (Q, K and V are three views of one `qkv` output), and
# weights are saved too (they are memory anyway): count storages once, skip parameters.
#
# ### Task 7.2: `saved_activation_bytes`
#
# Write `saved_activation_bytes(fn, *args) -> int`: the bytes of the storages autograd saves
# while `fn(*args)` runs, each storage once, parameters (and views of them) left out.

# %% tags=["task-7.2"]
def saved_activation_bytes(fn, *args) -> int:
    """Bytes of activation memory autograd keeps for backward while ``fn(*args)`` runs.

    Memory, not tensors: memory that several saved tensors share counts once, whole. Parameters
    are not activations; the inputs and intermediate results autograd keeps are.
    """
    ### BEGIN SOLUTION
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(storages.values())
    ### END SOLUTION


# %% tags=["check-7.2"]
check("7.2", saved_activation_bytes)

# %% [markdown]
# How much does one transformer layer keep? Derive it from your count. With fused attention
# nothing grows faster than the tokens, so the bytes should be $\alpha\,sbh + \beta\,sb$ for
# $s$ tokens, $b$ sequences and hidden size $h$ (4 heads). Two hidden sizes give two
# equations for the two constants:

# %%
def per_token(h, s=16, b=2):
    """Bytes one block keeps per token (s * b of them) at hidden size h."""
    block_h = TinyTransformer(vocab=8, dim=h, layers=1, heads=4, context=s).blocks[0]
    return saved_activation_bytes(block_h, torch.randn(b, s, h, requires_grad=True)) / (s * b)


alpha = (per_token(64) - per_token(32)) / (64 - 32)  # bytes per token and hidden unit
beta = per_token(32) - 32 * alpha  # bytes per token besides
print(f"derived: alpha = {alpha:g} bytes ({alpha / 4:g} fp32 values) per token and hidden unit, "
      f"beta = {beta:g} bytes per token")

# %% [markdown]
# Korthikanti et al., [*Reducing Activation Recomputation in Large Transformer Models*
# (2022)](https://arxiv.org/abs/2205.05198), count one layer as $sbh\,(34 + 5as/h)$ bytes in
# 16-bit with dropout ($a$ heads). Our block has no dropout (their $2sbh$ of two 1-byte masks
# goes) and fused attention, which keeps its output and a log-sum-exp per head instead of the
# $as^2$ attention matrix (their $5as/h$ goes): $32\,sbh$ bytes in 16-bit is 16 values per
# token and hidden unit, your $\alpha$ in fp32. Your $\beta$ is the per-token terms they
# neglect: each LayerNorm's mean and 1/std and the log-sum-exp of each head, $(2 \cdot 2 + a)$
# fp32 values. Which tensors make the 16? Exercise 5 asks. The formula against your count:

# %%
def block_formula(s, b, h, a):
    return 64 * s * b * h + 2 * 2 * s * b * 4 + a * s * b * 4  # bytes, fp32


lengths = [16, 32, 64, 128]
block = TinyTransformer(vocab=8, dim=64, layers=1, heads=4, context=128).blocks[0]
measured = [
    saved_activation_bytes(block, torch.randn(2, s, 64, requires_grad=True)) for s in lengths
]
predicted = [block_formula(s, 2, 64, 4) for s in lengths]
for s, m, p in zip(lengths, measured, predicted):
    print(f"T={s:4}: measured {m:8} bytes, formula {p:8} bytes")
plt.figure(figsize=(5, 2.6))
plt.plot(lengths, [m / 2**10 for m in measured], "o", label="saved_activation_bytes")
plt.plot(lengths, [p / 2**10 for p in predicted], "-", label="formula: 64sbh + small terms")
plt.xlabel("sequence length T")
plt.ylabel("KiB per block")
plt.title("Activation memory of one block (B=2, D=64, fp32)")
plt.legend(fontsize="small")
plt.show()

# %% [markdown]
# Linear in $s$ because attention is fused; with the attention matrix materialised it would
# grow as $s^2$. Under bf16 autocast the matmul inputs are saved in bf16, while LayerNorm's
# inputs stay fp32, so the bytes do not simply halve:

# %%
x32 = torch.randn(2, 64, 64, requires_grad=True)
with torch.autocast("cpu", dtype=torch.bfloat16):
    low = saved_activation_bytes(block, x32)
print(f"fp32: {saved_activation_bytes(block, x32)} bytes, bf16 autocast: {low} bytes")

# %% [markdown]
# ## 5. Activation checkpointing
#
# Checkpointing trades compute for memory: a checkpointed block keeps only its input; in
# backward it runs its forward again, with grad, and backpropagates through that
# recomputation. Three details make it exact:
#
# - **No saving in forward:** run the block under `torch.no_grad()`; keep the inputs with
#   `ctx.save_for_backward` (so they are counted, and torch catches in-place changes).
# - **The same randomness:** dropout must draw the same mask in the recomputation, so keep
#   the RNG state in forward and restore it before recomputing, inside
#   `torch.random.fork_rng` so the generator is afterwards where it would have been.
# - **A cut graph:** recompute on *detached* copies of the inputs that require grad; backward
#   through the recomputation then stops at them and their `.grad` is what the outer graph
#   needs.
#
# torch's version is [`torch.utils.checkpoint.checkpoint`](https://pytorch.org/docs/stable/checkpoint.html)
# (use `use_reentrant=False`: the non-reentrant variant, built on saved-tensor hooks, supports
# keyword arguments, inputs that do not require grad and `torch.autograd.grad`). Its
# *selective* form (`create_selective_checkpoint_contexts` with a policy) saves the outputs of
# chosen ops, typically matmuls, and recomputes only the cheap ones.
#
# ### Task 7.3: `checkpoint` and `apply_checkpointing`
#
# Write `checkpoint(fn, *args)` through the `torch.autograd.Function` `Checkpoint`, and
# `apply_checkpointing(model, every=k)`, which replaces the k-th, 2k-th, ... block of
# `model.blocks` (indices `k-1, 2k-1, ...`) by a module that runs it through `checkpoint`, and
# returns the model. The checks compare gradients bit for bit with dropout on, count the saved
# bytes with a trusted Task 7.2, and count how often each block runs.

# %% tags=["task-7.3"]
class Checkpoint(torch.autograd.Function):
    """``fn(*args)`` without saving its activations: recomputed during backward.

    ``apply(fn, num_args, *args, *params)``: the first ``num_args`` inputs are ``fn``'s
    arguments; ``params`` are the parameters ``fn`` uses, passed in so that the output needs
    grad (and backward runs) even when no argument does.
    """

    @staticmethod
    def forward(ctx, fn, num_args, *inputs):
        ### BEGIN SOLUTION
        args = inputs[:num_args]
        ctx.fn, ctx.num_args = fn, num_args
        ctx.params = inputs[num_args:]  # parameters stay reachable; they are not activations
        ctx.rng_state = torch.get_rng_state()  # the CPU generator, as dropout will find it
        # Autocast is thread-local state that backward does not inherit: recompute under the
        # same one, or a bf16 forward is recomputed in fp32 and the gradients change.
        devices = {"cpu"} | {a.device.type for a in args if torch.is_tensor(a)}
        ctx.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                        for d in sorted(devices)]
        ctx.autocast_cache = torch.is_autocast_cache_enabled()
        ctx.is_tensor = [torch.is_tensor(a) for a in args]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[a for a in args if torch.is_tensor(a)])
        with torch.no_grad():  # nothing inside fn is saved for backward
            return fn(*args)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, *grad_outputs):
        ### BEGIN SOLUTION
        saved = iter(ctx.saved_tensors)
        needs = ctx.needs_input_grad[2:]  # per input after fn and num_args
        # Fresh leaves: the recomputation's graph ends here, so backward through it stops at
        # the inputs and hands their gradients back to the outer graph.
        args = [next(saved).detach().requires_grad_(needs[i]) if is_t else other
                for i, (is_t, other) in enumerate(zip(ctx.is_tensor, ctx.others))]
        params = [p for p, need in zip(ctx.params, needs[ctx.num_args:]) if need]
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=[]))  # leave the generator be
            torch.set_rng_state(ctx.rng_state)  # the same dropout masks as in forward
            stack.enter_context(torch.enable_grad())
            for device, enabled, dtype in ctx.autocast:  # the forward's autocast, as it was
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled,
                                                   cache_enabled=ctx.autocast_cache))
            outputs = ctx.fn(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        wanted = [a for a, need in zip(args, needs) if torch.is_tensor(a) and need] + params
        grads = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                         allow_unused=True) if pairs and wanted else
                     [None] * len(wanted))
        return (None, None, *[next(grads) if need else None for need in needs])
        ### END SOLUTION


def checkpoint(fn, *args):
    """``fn(*args)``, keeping only the inputs, the RNG state and the autocast state for backward.

    Forward runs ``fn`` without saving activations, keeps the tensor inputs with
    ``ctx.save_for_backward``, the CPU RNG state and the autocast state; backward restores
    both, recomputes ``fn`` with grad on detached copies of the inputs and backpropagates
    through the recomputation, returning the gradients of the inputs and of ``fn``'s
    parameters (when ``fn`` is a module). So, as with ``torch.utils.checkpoint`` (non-reentrant):
    gradients are the same bit for bit under bf16/fp16 autocast, an input that needs no grad
    still gives the block's parameters their gradients, and a frozen parameter gets none.
    """
    ### BEGIN SOLUTION
    params = [p for p in fn.parameters() if p.requires_grad] if isinstance(fn, nn.Module) else []
    return Checkpoint.apply(fn, len(args), *args, *params)
    ### END SOLUTION


class CheckpointedBlock(nn.Module):
    """Runs ``block`` through :func:`checkpoint`."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return checkpoint(self.block, *args)


def apply_checkpointing(model: nn.Module, every: int = 1) -> nn.Module:
    """Checkpoint every ``every``-th block of ``model.blocks`` in place and return ``model``.

    The k-th, 2k-th, ... blocks counting from 1 (indices ``every - 1``, ``2 * every - 1``,
    ...) are replaced by a module that runs them through :func:`checkpoint`.
    """
    ### BEGIN SOLUTION
    for i, block in enumerate(model.blocks):
        if (i + 1) % every == 0:
            model.blocks[i] = CheckpointedBlock(block)
    return model
    ### END SOLUTION


# %% tags=["check-7.3"]
check("7.3", apply_checkpointing)

# %% [markdown]
# ### The trade-off, measured
#
# A 4-block transformer, trained a few steps without checkpointing and with every 4th, 2nd
# and every block checkpointed: the bytes saved for backward (your Task 7.2) and the step time.


# %%
def loss_of(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


x, y = counting_batch(8, 64, 128, seed=0)
configs = {"none": None, "every 4": 4, "every 2": 2, "every 1": 1}
models, memory = {}, {}
for label, every in configs.items():
    torch.manual_seed(0)
    models[label] = TinyTransformer(vocab=128, dim=64, layers=4, heads=4, context=64)
    if every is not None:
        apply_checkpointing(models[label], every=every)
    memory[label] = saved_activation_bytes(loss_of, models[label], x, y) / 2**20
# Interleaved rounds, best of each: a busy machine slows some steps, never speeds one up.
times = {label: [] for label in configs}
for _ in range(4):
    for label, model in models.items():
        start = time.perf_counter()
        loss_of(model, x, y).backward()
        times[label].append(time.perf_counter() - start)
        model.zero_grad()
seconds = {label: min(t[1:]) for label, t in times.items()}  # the first round warms up
for label in configs:
    print(f"{label:8}: {memory[label]:6.2f} MiB saved for backward, "
          f"{1e3 * seconds[label]:6.1f} ms per step")

fig, (left, right) = plt.subplots(1, 2, figsize=(9, 2.6))
left.bar(list(memory), list(memory.values()), color="tab:blue")
left.set_ylabel("MiB saved for backward")
right.bar(list(seconds), [1e3 * s for s in seconds.values()], color="tab:orange")
right.set_ylabel("ms per forward + backward")
fig.suptitle("Activation checkpointing on a 4-block transformer (B=8, T=64, D=64)")
plt.tight_layout()
plt.show()

# %% [markdown]
# Saved bytes fall with every block you checkpoint, down to the block inputs plus the
# embeddings and the output layer; the price is one more forward per checkpointed block, at
# most about a third more time (backward costs about twice a forward). On a busy laptop the
# timings are noisy; the bytes are exact.
#
# ## 6. bf16 autocast against fp32
#
# The same model trained twice from the same weights on the counting sequences: in fp32 and
# under bf16 autocast (no loss scaler needed: bf16 has fp32's range).

# %%
curves, step_seconds = {}, {}
for label, dtype in [("fp32", None), ("bf16 autocast", torch.bfloat16)]:
    torch.manual_seed(0)
    model = TinyTransformer(vocab=64, dim=64, layers=2, heads=4, context=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, times = [], []
    for step in range(25):
        x, y = counting_batch(8, 32, 64, seed=step)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    curves[label] = losses
    step_seconds[label] = min(times[1:])  # the fastest step: other processes only slow steps down
    print(f"{label:14}: final loss {losses[-1]:.3f}, "
          f"fastest step {1e3 * step_seconds[label]:.1f} ms")

fig, (left, right) = plt.subplots(1, 2, figsize=(9, 2.6), gridspec_kw={"width_ratios": [2, 1]})
for label, losses in curves.items():
    left.plot(losses, label=label)
left.set_xlabel("step")
left.set_ylabel("loss")
left.legend(fontsize="small")
right.bar(list(step_seconds), [1e3 * s for s in step_seconds.values()],
          color=["tab:blue", "tab:orange"])
right.set_ylabel("ms per step")
fig.suptitle("bf16 autocast vs fp32 on this CPU")
plt.tight_layout()
plt.show()
print("CPU capability:", torch.backends.cpu.get_cpu_capability())

# %% [markdown]
# The loss curves lie almost on top of each other: bf16's coarse rounding costs little
# because the weights, their updates and the loss stay in fp32 (and here the LayerNorms too,
# fed by the fp32 residual stream). Speed is another story and depends on the hardware. A
# CPU without native bf16 matrix units (AMX on recent Xeons, or AVX512-BF16) converts bf16
# in software and is often *slower* than fp32, as it may be here;
# GPU tensor cores (Ampere and newer) run bf16 matmuls several times faster than fp32.
# Memory falls everywhere: activations saved in bf16 take half the bytes.
#
# ## 7. torch.compile
#
# [`torch.compile`](https://pytorch.org/docs/stable/torch.compiler.html) has two halves.
# **Dynamo** reads your Python bytecode as it runs and records the tensor operations into an
# FX graph, with **guards** (the shapes, dtypes and Python values it assumed); a later call
# that fails a guard **recompiles**. **Inductor** turns the graph into fused kernels (C++/
# OpenMP on CPU, Triton on GPU). Where Dynamo cannot follow the Python (a side effect such
# as `print`, a Python `if` on a tensor's value, a loop whose length comes from data) it ends
# the graph there, runs that bit in Python, and starts a new graph: a **graph break**. Each
# break costs a round trip to Python and stops fusion across it; `fullgraph=True` turns a
# break into an error. [`torch._dynamo.explain`](https://pytorch.org/docs/stable/torch.compiler_faq.html)
# lists them:

# %%
torch._logging.set_logs(dynamo=logging.ERROR)  # explain() reports the breaks; no warnings too
graph_breaks = GraphBreakNet()
tokens, lens = padded_batch(4, 7, 32, seed=0)
explanation = torch._dynamo.explain(graph_breaks)(tokens, lens)
print(f"{explanation.graph_count} graphs, {explanation.graph_break_count} graph breaks")
for reason in explanation.break_reasons:
    print(" -", str(reason.reason).splitlines()[0][:100])
torch._dynamo.reset()

# %% [markdown]
# ### Task 7.4: `compile_ready`
#
# `kit.lessons.precision.GraphBreakNet` pools padded sequences with three graph breaks in its
# `forward`: a `print`, a loop up to `int(lengths.max())` and an `if` on `.item()`. Write
# `compile_ready(model)`, returning a module that computes the same thing with the model's own
# parameters and no graph break (`CompileReady` is a start). The checks compile it with
# `fullgraph=True` and `backend="eager"` (Dynamo's capture only, fast), call it on batches of
# one shape with different lengths inside, then on sequence lengths 9 and 12, and compare
# outputs and gradients with the eager model. One graph must serve every batch of one shape;
# across the three sequence lengths at most two may exist (the second length makes the
# sequence dimension dynamic, see "Guards and recompiles" below), so the third length must
# not compile again: nothing in your forward may need the length as a Python number.
# Hiding the breaks instead of removing them (the eager forward inside a
# `torch.library.custom_op`, or behind `torch.compiler.allow_in_graph`) gives the compiler one
# opaque call and nothing to optimize: the checks read the captured graph, and an opaque call
# there scores the task 0.

# %% tags=["task-7.4"]
class CompileReady(nn.Module):
    """GraphBreakNet's computation with no graph break; shares the model's parameters."""

    def __init__(self, model: GraphBreakNet):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        m = self.model
        h = torch.tanh(m.mix(m.embed(tokens)))  # (B, T, D)
        mask = torch.arange(h.shape[1], device=h.device) < lengths.unsqueeze(1)  # (B, T)
        pooled = (h * mask.unsqueeze(2)).sum(1) / lengths.unsqueeze(1)  # (B, D)
        norm = pooled.norm()
        pooled = torch.where(norm > m.max_norm, pooled * (m.max_norm / norm), pooled)
        return m.head(pooled)
        ### END SOLUTION


def compile_ready(model: GraphBreakNet) -> nn.Module:
    """A module computing what ``model`` computes, with its parameters, and no graph break."""
    ### BEGIN SOLUTION
    return CompileReady(model)
    ### END SOLUTION


# %% tags=["check-7.4"]
check("7.4", compile_ready)

# %% [markdown]
# ### Guards and recompiles
#
# A backend is just a function that receives each captured graph; this one counts them. A
# Python float in the arguments first becomes a constant of the graph, with a guard
# (`scale == 2.0`), so the first new value compiles again. That recompile makes `scale` an
# input of the graph instead (*automatic dynamic*; `torch._dynamo.config.specialize_float`
# is False), and every later value reuses it: 2.0, 3.0, 4.0 compile, compile, reuse. A new
# shape does the same: it compiles once more with that dimension dynamic, and later sizes
# reuse that graph.


# %%
def scaled_gelu(x, scale):
    return F.gelu(x) * scale


compiled_graphs = []


def counting_backend(gm, example_inputs):
    compiled_graphs.append(gm)
    return gm.forward  # run the captured graph as is


torch._dynamo.reset()
fast = torch.compile(scaled_gelu, backend=counting_backend)
for shape, scale in [((8, 4), 2.0), ((8, 4), 2.0), ((8, 4), 3.0), ((8, 4), 4.0), ((16, 4), 4.0),
                     ((32, 4), 5.0)]:
    before = len(compiled_graphs)
    fast(torch.randn(shape), scale)
    print(f"x {shape}, scale={scale}: {'compiled' if len(compiled_graphs) > before else 'reused'}")
torch._dynamo.reset()

# %% [markdown]
# `TORCH_LOGS=recompiles` prints the guard that failed each time; `torch._dynamo.config.
# recompile_limit` (8) caps recompiles per function, after which it runs eagerly.
#
# ### Inductor's fusion, measured on CPU
#
# Eager PyTorch runs `x + gelu(x) * sigmoid(x) * 0.5` as five kernels, each reading and
# writing a full tensor. Inductor fuses them into one loop that reads `x` once and writes the
# result once. The first call pays for the compilation (Dynamo, Inductor, and a C++ compiler
# building the kernel); later calls reuse it, and the kernel cache on disk
# (`/tmp/torchinductor_<user>`) makes the next Python session's first call faster.


# %%
def gated_gelu(x):
    return x + F.gelu(x) * torch.sigmoid(x) * 0.5


def best_seconds(fn, x, repeats=15):
    """The fastest of ``repeats`` calls after a warm-up: other processes only slow calls down."""
    fn(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return min(times)


x = torch.randn(2048, 2048)
torch._dynamo.reset()
fused = torch.compile(gated_gelu)  # backend="inductor", the default
start = time.perf_counter()
fused(x)
first_call = time.perf_counter() - start
eager_s, fused_s = best_seconds(gated_gelu, x), best_seconds(fused, x)
print(f"first compiled call {first_call:.1f} s; eager {1e3 * eager_s:.2f} ms, "
      f"compiled {1e3 * fused_s:.2f} ms per call ({eager_s / fused_s:.1f}x); same result: "
      f"{torch.allclose(gated_gelu(x), fused(x), atol=1e-5)}")
if fused_s < eager_s:
    print(f"the compilation pays for itself after {first_call / (eager_s - fused_s):.0f} calls")
else:
    print("no speed-up measured on this machine right now: is it busy? Run the cell again")
fig, (left, right) = plt.subplots(1, 2, figsize=(8, 2.4))
left.bar(["eager", "inductor"], [1e3 * eager_s, 1e3 * fused_s], color=["tab:blue", "tab:green"])
left.set_ylabel("ms per call")
right.bar(["first compiled call"], [first_call], color="tab:red")
right.set_ylabel("seconds")
fig.suptitle("torch.compile (Inductor) vs eager on a (2048, 2048) pointwise chain")
plt.tight_layout()
plt.show()

# %% [markdown]
# Pointwise chains gain most, because they are bound by memory traffic; a large matmul gains
# nothing (both call the same BLAS). A whole training step can be compiled too
# (`torch.compile(model)`; backward is compiled ahead of time by AOTAutograd), at the price
# of a longer first step: profile before and after.
#
# ### Compile with DDP and FSDP2
#
# DDP overlaps each bucket's all-reduce with the rest of backward (Lesson 04). One compiled
# graph for the whole model would produce all gradients at its end and lose that overlap, so
# Dynamo's *DDPOptimizer* (`torch._dynamo.config.optimize_ddp`, on by default) splits the
# graph at bucket boundaries: one graph per bucket. The first bucket is capped at 1 MiB
# (`dist._DEFAULT_FIRST_BUCKET_BYTES`), so `bucket_cap_mb` must be at least 1. Counted with
# the counting backend, on a 3.2 MiB transformer:


# %%
def ddp_graphs(bucket_cap_mb):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(TinyTransformer(vocab=256, dim=128, layers=4, heads=4, context=32),
              bucket_cap_mb=bucket_cap_mb)
    sizes = []

    def backend(gm, example_inputs):  # MiB of parameters each graph uses
        sizes.append(sum(p.numel() * p.element_size() for p in example_inputs
                         if isinstance(p, nn.Parameter)) / 2**20)
        return gm.forward

    torch._dynamo.reset()
    torch._logging.set_logs(all=logging.ERROR)  # DDP's profiler note under compile is noise here
    x, y = token_batch(2, 32, 256, seed=dist.get_rank())
    loss_of(torch.compile(ddp, backend=backend), x, y).backward()
    return [round(s, 2) for s in sizes]


for cap in (25, 1):
    print(f"bucket_cap_mb={cap}: graphs holding "
          f"{launch(ddp_graphs, cap, world_size=2)[0]} MiB of parameters")

# %% [markdown]
# With the default 25 MiB buckets the model is split in two (the 1 MiB first bucket, at the
# output end, and the rest); with 1 MiB buckets, in four. With FSDP2 the usual recipe
# (torchtitan's) is to compile each transformer block and then apply `fully_shard` to each
# block and to the model: the all-gathers and reduce-scatters FSDP2 issues at block
# boundaries then fall between compiled graphs
# ([`fully_shard`](https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html)).
#
# ## Running at scale
#
# > The same code on GPUs under `torchrun`, with NCCL:
# >
# > ```python
# > # torchrun --standalone --nproc_per_node=8 train.py
# > import os
# > import torch
# > import torch.distributed as dist
# > from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
# >
# > dist.init_process_group("nccl")
# > torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
# > model = TinyTransformer(vocab=50257, dim=1024, layers=24, heads=16, context=1024).cuda()
# > from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
# > for i, block in enumerate(model.blocks):     # as apply_checkpointing(model, every=2), with
# >     if (i + 1) % 2 == 0:                      # torch.utils.checkpoint (non-reentrant)
# >         model.blocks[i] = checkpoint_wrapper(block)
# > policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# > for block in model.blocks:
# >     block.compile()                           # compile each block first (in place) ...
# >     fully_shard(block, mp_policy=policy)      # ... then shard it: FSDP2's collectives
# > fully_shard(model, mp_policy=policy)          # fall between the compiled graphs
# > torch.cuda.reset_peak_memory_stats()
# > # ... the training loop; bf16 needs no scaler, fp16 needs ShardedGradScaler ...
# > print(torch.cuda.max_memory_allocated() / 2**30, "GiB at peak")
# > dist.destroy_process_group()
# > ```
# >
# > - **bf16** runs at full tensor-core speed on Ampere (A100) and newer; on older GPUs
# >   (V100) use fp16 with a loss scaler. On H100 and newer, **fp8** is the next step:
# >   matmuls in 8-bit floats with per-tensor or per-block scales (torchao's `float8`
# >   training, Transformer Engine).
# > - **Measure memory, do not count it:** `torch.cuda.max_memory_allocated()` and
# >   `torch.cuda.memory._record_memory_history()` (the memory snapshot viewer) replace
# >   counting saved tensors, and include the allocator's fragmentation.
# > - **Checkpointing on GPU** also preserves the CUDA RNG state (torch's checkpoint does it
# >   for every device its inputs live on); yours keeps only the CPU one.
# > - **Inductor on GPU** generates Triton kernels; `mode="max-autotune"` tries several
# >   kernel configurations and CUDA graphs, at a longer compile time.
#
# ## Summary
#
# - Exponent bits set the range, mantissa bits the precision. fp16 underflows and needs a
#   loss scaler; bf16 has fp32's range and needs none.
# - autocast casts per op, from a list per device: matmuls low everywhere, losses fp32
#   everywhere; norms, softmax, `exp` and sums fp32 on CUDA but in their input's dtype on
#   CPU. The weights stay fp32.
# - Dynamic loss scaling skips steps with inf/NaN gradients and adapts the scale; with
#   sharded gradients every rank must skip together (all-reduce the flag).
# - Saved activations are what memory grows with; `saved_tensors_hooks` shows them, and the
#   per-layer formula predicts them.
# - Checkpointing keeps only block inputs and recomputes; restoring the RNG makes it exact.
# - `torch.compile` captures graphs with Dynamo and fuses kernels with Inductor; graph breaks
#   and recompiles are what to remove first. DDP's compiled graphs split at buckets.
#
# Docs: [AMP](https://pytorch.org/docs/stable/amp.html) ·
# [checkpoint](https://pytorch.org/docs/stable/checkpoint.html) ·
# [autograd saved tensors](https://pytorch.org/docs/stable/notes/autograd.html#saved-tensors) ·
# [torch.compile](https://pytorch.org/docs/stable/torch.compiler.html) ·
# [DDP communication hooks](https://pytorch.org/docs/stable/ddp_comm_hooks.html) ·
# [FSDP2](https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html)
#
# ## Exercises (ungraded)
#
# 1. Make `checkpoint` also save and restore the autocast state, so a block checkpointed
#    under `torch.autocast` recomputes in the same dtype. Check with Task 7.2 that the saved
#    bytes match.
# 2. Write a selective policy: in the checkpointed block, save the outputs of the linear
#    layers and recompute only LayerNorm and GELU (hint:
#    `torch.utils.checkpoint.create_selective_checkpoint_contexts`). Plot memory against time
#    for none, selective and full checkpointing.
# 3. Use your `DynamicLossScaler` on 2 ranks with DDP and fp16 autocast; compare the scale
#    trajectory with torch's `GradScaler` on each rank. Why do DDP ranks agree even without
#    your all-reduce?
# 4. Compile `TinyTransformer`'s whole training step with Inductor and measure the first step
#    and the steady step against eager on your machine.
# 5. Name the tensors behind the 16 values per token and hidden unit of Task 7.2's block
#    (print the shape and `grad_fn` of the tensor each pack call sees), and say which of them
#    a bf16 autocast saves in bf16.
