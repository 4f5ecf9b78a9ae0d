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
# Lessons 04-13 taught one technique at a time. Real training runs compose them: Llama 3 405B
# trained on a 4-D mesh (tensor, context, pipeline and data parallel), torchtitan and Megatron
# build the same layouts from a config. This capstone puts FSDP2, tensor and sequence parallel
# and a 1F1B pipeline on **one `DeviceMesh`**, trains an ESM-2-style encoder on the real
# peptides of Lesson 09, checks every layout against a single process, and resumes a
# checkpoint at a different layout on the same loss curve.
#
# **Prerequisites:** Lesson 05 (FSDP2 and `DeviceMesh`), Lesson 06 (Distributed Checkpoint),
# Lesson 08 (tensor, sequence and pipeline parallel), Lesson 09 (ESM-2 and masked language
# modelling) and Lesson 12 (bytes per layout).
#
# **You will be able to:**
# - lay ranks out on a named 3-D mesh and say why tensor parallel stays inside a node
#   ({{task 14.1}});
# - apply tensor and sequence parallel to every block, then FSDP2 over the data-parallel axis,
#   and predict the bytes each mesh axis carries per step to the byte ({{task 14.2}});
# - split the model into pipeline stages over the `pp` axis, each stage still tensor and data
#   parallel, driven by the 1F1B schedule ({{task 14.3}});
# - save a sharded checkpoint at one layout and resume it at another, continuing the same loss
#   curve ({{task 14.4}}).
#
# Replace each `raise NotImplementedError(...)` with your code, run the cell, then the
# `check(...)` cell under it.

# %% tags=["setup"]
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch import nn

from kit import check, launch
from kit.lessons.composition import (
    SEQ_LEN,
    PeptideEncoder,
    axis_of,
    encoder,
    layout_explorer,
    masked_batches,
    masked_lm_loss,
    one_process_losses,
    optimizer_for,
    plot_layouts,
    plot_mesh,
    train_steps,
)
from kit.meter import track
from kit.trace import trace

# %% [markdown]
# ## 0. The model and the curve every layout must follow
#
# `PeptideEncoder` is ESM-2 in miniature: token embedding, four pre-norm blocks with rotary
# attention, a final norm and a language-model head, 0.2 M parameters. It trains by masked
# language modelling on windows cut from modlamp's 5,200 peptides, 5 of every 32 tokens
# masked. Every window holds the same number of masked tokens, so the mean loss of a batch is
# the mean of its shards' means: however a layout splits a batch (over data-parallel ranks,
# over micro-batches), it trains on exactly the same loss. One process gives the curve:

# %%
BATCHES = masked_batches(steps=6, batch=4)
REFERENCE = one_process_losses(BATCHES)
model = encoder(0)
print(model)
print(f"{sum(p.numel() for p in model.parameters()):,} parameters;",
      "losses of one process:", [round(x, 4) for x in REFERENCE])

# %% [markdown]
# ## 1. One mesh, three axes
#
# A `DeviceMesh` is an n-dimensional array of ranks with a name per axis; `mesh["tp"]` is the
# 1-D slice through this rank along that axis, and its process group is the group a
# collective on that axis runs in
# ([DeviceMesh recipe](https://pytorch.org/tutorials/recipes/distributed_device_mesh.html)).
# The order of the axes decides which ranks share a group. Rank $r$ of a `(pp, dp, tp)` mesh
# sits at $r = (s \cdot dp + d) \cdot tp + t$: the **last** axis varies fastest, so a `tp`
# group is $tp$ consecutive ranks, which `torchrun` places on one node. That is the rule:
#
# - **tp innermost**: tensor parallel all-gathers and reduce-scatters activations twice per
#   block, forward and backward, on the critical path; it needs NVLink (hundreds of GB/s), not
#   the network between nodes (tens of GB/s per GPU).
# - **dp next**: FSDP's gathers and reduce-scatters of weights overlap compute and tolerate
#   the slower links.
# - **pp outermost**: a pipeline sends one activation per micro-batch between neighbours, the
#   least traffic of all, so it may cross the slowest links.
#
# ### Task 14.1: `build_mesh`
#
# Write `build_mesh(world_size, dp, tp, pp=1)`: a mesh of shape `(pp, dp, tp)` with axis names
# `("pp", "dp", "tp")`, on the device the process group uses (CUDA under NCCL, CPU under
# gloo). A layout that does not multiply to the world size, or an axis below 1, is a
# `ValueError` that names the sizes. Axes of size 1 stay in the mesh, so the later tasks can
# always ask for `mesh["tp"]`.

# %% tags=["task-14.1"]
def build_mesh(world_size: int, dp: int, tp: int, pp: int = 1):
    """Return a ``DeviceMesh`` of shape ``(pp, dp, tp)`` named ``("pp", "dp", "tp")``.

    Rank r sits at ``r = (stage * dp + d) * tp + t``: tp groups are consecutive ranks (one
    node), pp groups the farthest apart. Every axis is kept, size 1 too. The device is CUDA when
    the default group runs NCCL, else CPU. ``dp * tp * pp != world_size`` or any axis below 1
    (or not an int) is a ValueError naming the sizes.
    """
    ### BEGIN SOLUTION
    from torch.distributed.device_mesh import init_device_mesh

    for name, size in (("dp", dp), ("tp", tp), ("pp", pp)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be an int of at least 1; got {size!r}")
    if dp * tp * pp != world_size:
        raise ValueError(f"dp * tp * pp = {dp} * {tp} * {pp} = {dp * tp * pp}, but the world "
                         f"has {world_size} ranks: choose sizes whose product is the world size")
    device = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    ### END SOLUTION


# %% tags=["check-14.1"]
check("14.1", build_mesh)

# %% [markdown]
# Eight ranks as `(pp=2, dp=2, tp=2)`: each row of a stage is a tp group (two neighbours, one
# node's NVLink), each column a dp group, and the two stages sit on different nodes.

# %%
plot_mesh({"pp": 2, "dp": 2, "tp": 2}, ranks_per_node=4)
plt.show()


# %% [markdown]
# ## 2. Tensor and sequence parallel inside, FSDP2 outside
#
# Lesson 08 split one MLP by hand. `torch.distributed.tensor.parallel` does it for any module
# from a plan
# ([docs](https://pytorch.org/docs/stable/distributed.tensor.parallel.html)):
# `ColwiseParallel` shards a linear layer's output features, `RowwiseParallel` its input
# features and sums the partial outputs, `SequenceParallel` runs a norm on a sequence shard,
# and `PrepareModuleInput` / `PrepareModuleOutput` change a module's input or output layout.
# In a block:
#
# - `attn_norm`, `mlp_norm`: `SequenceParallel()`; nothing moves, each rank normalises its
#   own tokens.
# - `attn`, `mlp` (their inputs): `PrepareModuleInput(Shard(1) -> Replicate())`; an all-gather
#   of the sequence.
# - `attn.q/k/v`, `mlp.fc1`: `ColwiseParallel()`; nothing moves, each rank owns some heads or
#   hidden units.
# - `attn.out`, `mlp.fc2`: `RowwiseParallel(output_layouts=Shard(1))`; a reduce-scatter over the
#   sequence.
#
# Between the blocks, the residual stream stays **sharded by sequence**: each tp rank holds
# `seq / tp` tokens of it, which is the activation memory sequence parallel saves. The first
# block turns the replicated embedding into its shard (a slice: `Replicate -> Shard(1)` sends
# nothing) and the last gathers it back for the norm and head, which every tp rank runs whole.
# The attention module reads its head count from the width it is given, so it runs a rank's
# share of the heads unchanged.
#
# Then FSDP2: `fully_shard` each block, then the root, on `mesh["dp"]`. Tensor parallel comes
# **first**: `fully_shard` finds the blocks' parameters already `DTensor`s on the tp mesh and
# shards their local pieces again over dp, a 2-D `(Shard(0) on dp, tp placement)` DTensor.
# torchtitan applies them in this order
# ([parallelize.py](https://github.com/pytorch/torchtitan)).
#
# **What each axis carries per step** (the recorder's count, Lesson 12: the whole gathered or
# scattered buffer per call), for a batch of $B$ windows of $S$ tokens, width $D$, 4 bytes a
# value, $b = B / dp$ windows per rank:
#
# - **dp** (when $dp > 1$): FSDP2 gathers the root's and every block's parameters forward, the
#   blocks' again backward (they were freed after forward; the root is kept), and
#   reduce-scatters every gradient once: $3 \cdot \text{blocks} + 2 \cdot \text{root}$ bytes,
#   each parameter counted as this rank's tp piece with its first dimension padded up to a
#   multiple of $dp$.
# - **tp** (when $tp > 1$): per block, two all-gathers and two reduce-scatters of a
#   $b \cdot S \cdot D$ activation forward and the same backward; one more all-gather forward
#   (the last block's output) and backward (the gradient at the first block's input); and an
#   all-reduce of the norms' weight and bias gradients, which every tp rank computed on its own
#   tokens.
#
# ### Task 14.2: `parallelize` and `axis_traffic`
#
# Write `parallelize(model, mesh)` as above: tensor and sequence parallel on `mesh["tp"]` for
# every block the model holds (skip it when tp is 1), then `fully_shard` on `mesh["dp"]` for
# each block and the root. It returns the model. Write `axis_traffic(model, dp, tp, batch,
# seq_len)` with the formula above: `{"dp": bytes, "tp": bytes}` one rank sends per step,
# read from the (not yet parallelized) model's parameter shapes. The check measures both with
# the recorder and the meter, and trains against the one-process curve.

# %% tags=["task-14.2"]
def parallelize(model: PeptideEncoder, mesh) -> PeptideEncoder:
    """Apply tensor + sequence parallel on ``mesh["tp"]`` to every block ``model`` holds, then
    FSDP2 (``fully_shard``) on ``mesh["dp"]`` to each block and the root; return ``model``.

    Between blocks activations are sharded by sequence (dim 1) over tp; the first block takes
    a replicated input and the last returns a replicated output, so the embedding, norm and head
    run whole on every tp rank. With tp == 1 no tensor parallel is applied. ``model.tok``,
    ``norm``, ``head`` may be None and ``model.blocks`` may hold any subset (a pipeline stage).
    """
    ### BEGIN SOLUTION
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    blocks = list(model.blocks.values())
    tp_mesh = mesh["tp"]
    if tp_mesh.size() > 1:
        gather = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
        for block in blocks:
            parallelize_module(block, tp_mesh, {
                "attn_norm": SequenceParallel(), "attn": gather,
                "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(), "attn.out": RowwiseParallel(output_layouts=Shard(1)),
                "mlp_norm": SequenceParallel(), "mlp": gather,
                "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
            })
        if blocks:  # the residual stream enters as its sequence shard and leaves whole
            parallelize_module(blocks[0], tp_mesh, PrepareModuleInput(
                input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True))
            parallelize_module(blocks[-1], tp_mesh, PrepareModuleOutput(
                output_layouts=Shard(1), desired_output_layouts=Replicate(),
                use_local_output=True))
    for block in blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model
    ### END SOLUTION


def axis_traffic(model: PeptideEncoder, dp: int, tp: int, batch: int,
                 seq_len: int) -> dict[str, int]:
    """Bytes one rank sends in one steady training step of ``model`` parallelized on a
    ``(dp, tp)`` mesh: ``{"dp": ..., "tp": ...}``, as the recorder counts them.

    ``model`` is the whole, unparallelized encoder (read its parameters' shapes and dtypes);
    ``batch`` windows of ``seq_len`` tokens per step over all dp ranks. An axis of size 1 sends
    0. ``batch`` not divisible by dp, or dp or tp below 1, is a ValueError.
    """
    ### BEGIN SOLUTION
    if dp < 1 or tp < 1:
        raise ValueError(f"dp and tp must be at least 1; got dp={dp}, tp={tp}")
    if batch % dp:
        raise ValueError(f"a batch of {batch} windows does not split over dp={dp}")
    colwise = ("attn.q.", "attn.k.", "attn.v.", "mlp.fc1.")
    rowwise = ("attn.out.weight", "mlp.fc2.weight")

    def piece(name: str, p: torch.Tensor) -> int:
        shape = list(p.shape) or [1]
        if tp > 1 and any(k in name for k in colwise):
            shape[0] = -(-shape[0] // tp)
        if tp > 1 and any(name.endswith(k) for k in rowwise):
            shape[1] = -(-shape[1] // tp)
        shape[0] = -(-shape[0] // dp) * dp  # FSDP2 pads dim 0 to a multiple of dp
        return p.element_size() * int(torch.Size(shape).numel())

    root = sum(piece(n, p) for n, p in model.named_parameters() if not n.startswith("blocks."))
    blocks = sum(piece(n, p) for n, p in model.named_parameters() if n.startswith("blocks."))
    dim = next(model.blocks.values().__iter__()).attn_norm.weight
    activation = batch // dp * seq_len * dim.numel() * dim.element_size()
    norms = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if n.startswith("blocks.") and "_norm." in n)
    n_blocks = len(model.blocks)
    return {"dp": 0 if dp == 1 else 2 * root + 3 * blocks,
            "tp": 0 if tp == 1 or not n_blocks else
            (8 * n_blocks + 2) * activation + norms}
    ### END SOLUTION


# %% tags=["check-14.2"]
check("14.2", parallelize)


# %% [markdown]
# Train three layouts of four ranks for six steps and draw what each costs. Every curve lies
# on the one-process curve; the bars show what the layouts trade: tp=4 holds a quarter of the
# blocks on each rank but sends activations every block, dp=4 holds a quarter of everything
# and sends weights.

# %%
def compare_layout(layout: tuple[int, int, int], batches) -> dict:
    dp, tp, pp = layout
    mesh = build_mesh(dist.get_world_size(), dp, tp, pp)
    with track() as usage:
        model = parallelize(encoder(0), mesh)
        usage.mark("parameters")
    optimizer = optimizer_for(model)
    losses = train_steps(model, mesh, batches, optimizer)
    with trace() as t:  # one more step, without the loss report: the training's messages only
        train_steps(model, mesh, batches[:1], optimizer, report=False)
    groups = {axis: set(dist.get_process_group_ranks(mesh[axis].get_group()))
              for axis in ("dp", "tp")}
    traffic = {axis: sum(e.nbytes for e in t.events if len(ranks) > 1
                         and set(e.group_ranks) == ranks) for axis, ranks in groups.items()}
    return {"losses": losses, "param_bytes": usage.marks["parameters"], "traffic": traffic}


runs = {}
for layout in [(4, 1, 1), (2, 2, 1), (1, 4, 1)]:
    runs[f"dp={layout[0]} tp={layout[1]}"] = launch(compare_layout, layout, BATCHES,
                                                     world_size=4, timeout=120)[0]
for (dp, tp, _), run in zip([(4, 1, 1), (2, 2, 1), (1, 4, 1)], runs.values()):
    print(f"dp={dp} tp={tp}: max |loss - one process| = "
          f"{max(abs(a - b) for a, b in zip(run['losses'], REFERENCE)):.1e}; bytes per step "
          f"predicted {axis_traffic(encoder(0), dp, tp, 4, SEQ_LEN)}, measured {run['traffic']}")
plot_layouts(runs, REFERENCE)
plt.show()


# %% [markdown]
# ## 3. Pipeline stages on the third axis
#
# A pipeline puts different blocks on different ranks of the `pp` axis and streams
# micro-batches through them (Lesson 08). `torch.distributed.pipelining`
# ([docs](https://pytorch.org/docs/stable/distributed.pipelining.html)) runs it: a
# `PipelineStage` wraps the part of the model a rank runs, and `Schedule1F1B` interleaves one
# forward and one backward per micro-batch once the pipeline is full, so stage 0 holds at most
# `pp` micro-batches' activations instead of all of them (GPipe).
#
# The torchtitan way to cut a model: build it whole, then **delete** what a stage does not run.
# `PeptideEncoder` keys its blocks by name in a `ModuleDict`, so block 2 keeps the name
# `blocks.2` on whichever stage holds it: the stage's state dict is a slice of the full model's,
# which is what lets section 4 load a checkpoint at another split. Then each stage is
# parallelized with your `parallelize` on the same mesh: the stage's tp and dp groups are the
# tp and dp slices through its own ranks.
#
# ### Task 14.3: `build_pipeline`
#
# Write `build_pipeline(model, mesh, n_microbatches, loss_fn)`. On stage
# `s = mesh.get_local_rank("pp")` of `pp` stages: keep a contiguous, balanced run of the blocks
# (the first `len(blocks) % pp` stages one more), drop `tok` unless `s == 0` and `norm` and
# `head` unless `s == pp - 1` (set them to `None`), parallelize what is left, wrap it in a
# `PipelineStage` on the pp group and return `(stage_model, Schedule1F1B(...))`. Fewer blocks
# than stages, or fewer micro-batches than stages, is a `ValueError`.

# %% tags=["task-14.3"]
def build_pipeline(model: PeptideEncoder, mesh, n_microbatches: int, loss_fn):
    """Cut ``model`` into this rank's pipeline stage over ``mesh["pp"]``, parallelize it on the
    stage's dp and tp axes, and return ``(stage_model, schedule)``: a ``Schedule1F1B`` over a
    ``PipelineStage`` of ``n_microbatches`` micro-batches, computing ``loss_fn(output, target)``
    on the last stage.

    Stage s keeps a contiguous, balanced run of the blocks (the first ``len % pp`` stages one
    more), ``tok`` only on stage 0, ``norm`` and ``head`` only on the last; the rest is deleted
    (set to None, removed from ``model.blocks``). Fewer blocks or micro-batches than stages is a
    ValueError.
    """
    ### BEGIN SOLUTION
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    pp, stage = axis_of(mesh, "pp")
    keys = list(model.blocks.keys())
    if len(keys) < pp:
        raise ValueError(f"{len(keys)} blocks cannot fill {pp} pipeline stages")
    if n_microbatches < pp:
        raise ValueError(f"1F1B needs at least one micro-batch per stage: {n_microbatches} "
                         f"micro-batches for {pp} stages")
    share, extra = divmod(len(keys), pp)
    start = stage * share + min(stage, extra)
    mine = set(keys[start:start + share + (stage < extra)])
    for key in keys:
        if key not in mine:
            del model.blocks[key]
    if stage > 0:
        model.tok = None
    if stage < pp - 1:
        model.norm = model.head = None
    parallelize(model, mesh)
    device = (torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda"
              else torch.device("cpu"))
    pipe = PipelineStage(model, stage, pp, device, group=mesh["pp"].get_group())
    return model, Schedule1F1B(pipe, n_microbatches, loss_fn=loss_fn)
    ### END SOLUTION


# %% tags=["check-14.3"]
check("14.3", build_pipeline)


# %% [markdown]
# Eight ranks as `(pp=2, dp=2, tp=2)`, all three axes at once, on the one-process curve:

# %%
def train_3d(batches) -> list[float]:
    mesh = build_mesh(dist.get_world_size(), dp=2, tp=2, pp=2)
    stage_model, schedule = build_pipeline(encoder(0), mesh, 2, masked_lm_loss)
    return train_steps(stage_model, mesh, batches, optimizer_for(stage_model), schedule)


losses_3d = launch(train_3d, BATCHES[:3], world_size=8, timeout=240)[0]
print("3-D mesh:", [round(x, 4) for x in losses_3d])
print("max |loss - one process| =", max(abs(a - b) for a, b in zip(losses_3d, REFERENCE)))


# %% [markdown]
# ## 4. Save at one layout, resume at another
#
# Distributed Checkpoint (Lesson 06) saves each rank's shards with their global offsets and
# loads them into whatever shards the loading ranks hold. `get_state_dict(model, optimizer)`
# ([docs](https://pytorch.org/docs/stable/distributed.checkpoint.html)) names every
# parameter and its AdamW state by its fully qualified name, whatever wraps it (FSDP2, TP, a
# pipeline stage), and `set_state_dict` puts a loaded one back. Each rank writes only what it
# holds: nothing is gathered. Save the step too, so a resumed run knows where it is.
#
# ### Task 14.4: `save_checkpoint` and `load_checkpoint`
#
# Write `save_checkpoint(model, optimizer, step, path)` and `load_checkpoint(model, optimizer,
# path) -> int` (it returns the saved step). Called by every rank of a layout; the loading
# layout may differ from the saving one.

# %% tags=["task-14.4"]
def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    path: str | Path) -> None:
    """Save the model, its optimizer state and ``step`` to the directory ``path`` with DCP,
    each rank writing only the shards it holds (nothing gathered). Every rank calls it."""
    ### BEGIN SOLUTION
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "step": torch.tensor(step)},
             checkpoint_id=str(path))
    ### END SOLUTION


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer,
                    path: str | Path) -> int:
    """Load what :func:`save_checkpoint` wrote at ``path`` into ``model`` and ``optimizer``
    (parallelized at any layout), and return the saved step. Every rank calls it."""
    ### BEGIN SOLUTION
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return int(state["step"])
    ### END SOLUTION


# %% tags=["check-14.4"]
check("14.4", save_checkpoint)


# %% [markdown]
# Train three steps at `(dp=2, tp=2)`, save, and resume at `(dp=4, tp=1)` for three more:
# the six losses are the one-process curve.

# %%
def save_then_resume(path: str, batches) -> list[float]:
    losses = []
    for layout, part, seed in (((2, 2, 1), batches[:3], 0), ((4, 1, 1), batches[3:], 1)):
        mesh = build_mesh(dist.get_world_size(), *layout)
        model = parallelize(encoder(seed), mesh)  # seed 1: weights the checkpoint must replace
        optimizer = optimizer_for(model)
        if seed == 1:
            print(f"resumed at step {load_checkpoint(model, optimizer, path)} with layout "
                  f"dp={layout[0]} tp={layout[1]}")
        losses += train_steps(model, mesh, part, optimizer)
        if seed == 0:
            save_checkpoint(model, optimizer, 3, path)
    return losses


with tempfile.TemporaryDirectory() as root:
    resumed = launch(save_then_resume, f"{root}/step3", BATCHES, world_size=4, timeout=180)[0]
print("resumed run:", [round(x, 4) for x in resumed])
print("max |loss - one process| =", max(abs(a - b) for a, b in zip(resumed, REFERENCE)))


# %% [markdown]
# ## 5. Choosing a layout
#
# On this machine every layout is slow in its own way: gloo on two cores. On a GPU cluster the
# cost model of Lessons 08 and 12 predicts a layout's memory per GPU, communication per axis
# and pipeline bubble. Pick (dp, tp, pp) for a 7 B model on 64 GPUs and compare; the last line
# shows the step measured here for the layouts section 2 ran.

# %%
def timed_step(layout: tuple[int, int, int], batches) -> float:
    dp, tp, pp = layout
    mesh = build_mesh(dist.get_world_size(), dp, tp, pp)
    model = parallelize(encoder(0), mesh)
    optimizer = optimizer_for(model)
    train_steps(model, mesh, batches[:1], optimizer)
    start = time.perf_counter()
    train_steps(model, mesh, batches[1:3], optimizer)
    return (time.perf_counter() - start) / 2


measured = {layout: launch(timed_step, layout, BATCHES, world_size=4, timeout=120)[0]
            for layout in [(4, 1, 1), (2, 2, 1), (1, 4, 1)]}
print({f"dp={k[0]} tp={k[1]}": f"{v * 1e3:.0f} ms" for k, v in measured.items()})
layout_explorer(64, measured={(dp * 16, tp, pp): s for (dp, tp, pp), s in measured.items()})

# %% [markdown]
# ## Running at scale
#
# > The same four functions run under `torchrun` with NCCL; only the device changes, and
# > `build_mesh` already picks CUDA when the group runs NCCL:
# >
# > ```python
# > # torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
# > #     --rdzv-endpoint=$HOST:29500 train.py
# > import os
# > import torch
# > import torch.distributed as dist
# >
# > dist.init_process_group("nccl")
# > torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
# > mesh = build_mesh(dist.get_world_size(), dp=4, tp=2, pp=2)  # tp inside a node
# > stage_model, schedule = build_pipeline(encoder(0).cuda(), mesh, 8, masked_lm_loss)
# > ```
# >
# > - **Keep tp within a node.** With 8 GPUs a node, tp=8 at most; torchtitan and Megatron
# >   place it innermost for the same reason as `build_mesh`.
# > - **Mixed precision.** On GPUs pass `mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
# >   reduce_dtype=torch.float32)` to `fully_shard` (Lesson 07): the dp bytes halve, the
# >   optimizer stays in fp32.
# > - **Initialise on meta.** A model too big for one GPU is built under
# >   `torch.device("meta")`, cut and parallelized, then materialised shard by shard with
# >   `to_empty` and an init function (Lesson 05), never whole.
# > - **More axes.** Context parallel (ring attention, Lesson 09) is a fourth axis between dp
# >   and tp; expert parallel (Lesson 13) usually borrows ranks from dp.

# %% [markdown]
# ## Summary
#
# - A `DeviceMesh` names the axes; the last varies fastest, so `(pp, dp, tp)` puts tp groups on
#   consecutive ranks, inside a node, and pp across the slowest links.
# - Tensor + sequence parallel first (a plan per block, activations sharded by sequence between
#   blocks), then `fully_shard` over dp: the blocks' weights become 2-D DTensors.
# - Bytes per step: dp carries $3 \times$ the blocks' and $2 \times$ the root's parameter
#   pieces, tp carries activations, $8$ per block plus $2$, and the norms' gradients.
# - A pipeline stage is the full model with the other stages' parts deleted; FQNs stay, so a
#   stage's state dict is a slice of the model's. 1F1B bounds the activations in flight.
# - DCP saves shards by FQN and global offset and loads them at any layout: a run resumes on
#   the same curve at another (dp, tp, pp).
#
# **Read more:** [DeviceMesh](https://pytorch.org/tutorials/recipes/distributed_device_mesh.html),
# [tensor parallel](https://pytorch.org/docs/stable/distributed.tensor.parallel.html),
# [FSDP2](https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html),
# [pipelining](https://pytorch.org/docs/stable/distributed.pipelining.html),
# [Distributed Checkpoint](https://pytorch.org/docs/stable/distributed.checkpoint.html),
# [torchtitan](https://github.com/pytorch/torchtitan) (Liang et al., 2024),
# Megatron-LM's sequence parallelism ([Korthikanti et al., 2022](https://arxiv.org/abs/2205.05198))
# and the [Ultra-Scale Playbook](https://huggingface.co/spaces/nanotron/ultrascale-playbook).
#
# ## Exercises (not graded)
#
# 1. Swap the order: `fully_shard` first, then `parallelize_module`. What error does torch
#    give, and why?
# 2. Drop `SequenceParallel` and the `PrepareModuleInput` gathers (plain Megatron TP): the
#    residual stream is replicated. Measure the tp bytes and the activation memory per rank.
# 3. Pass `reshard_after_forward=False` to the blocks' `fully_shard`: which term of
#    `axis_traffic` changes, and what does the meter say about memory?
# 4. Run `build_pipeline` with `ScheduleGPipe` and 4 micro-batches; compare stage 0's peak
#    memory with 1F1B's.
# 5. Resume the section 4 checkpoint on a `(pp=2, dp=2)` mesh: does the curve continue?
