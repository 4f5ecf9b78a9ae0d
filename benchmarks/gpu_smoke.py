"""Run the "Running at scale" code of Lessons 00-10, 12 and 13 with NCCL, one rank per GPU.

Each lesson ends with a note saying its functions run unchanged under ``torchrun`` with NCCL.
This script is that note, executed: it loads the lessons' solutions (``solutions/NN_*.py``,
setup and task cells only) and runs each snippet on CUDA tensors, checking the result against
torch's own collectives or an unsharded reference. Every call a snippet of Lessons 05-10 makes
is made here too (``tests/test_gpu_smoke.py`` holds them equal); sizes shrink on CPU only.
Lesson 11's note needs pyg-lib (not on PyPI) for its sampler, so it has no snippet here.
Run it on a machine with GPUs::

    python benchmarks/gpu_smoke.py                                   # one rank per visible GPU
    torchrun --standalone --nproc-per-node=gpu benchmarks/gpu_smoke.py

Without CUDA it says so and exits 0. ``--cpu N`` runs the same code on N CPU ranks with gloo
(the CUDA-only parts skipped, each saying so), to test this script where there is no GPU;
``--only 5,9`` runs those lessons' snippets alone. Every check prints one ``PASS``/``FAIL``
line from rank 0 with its seconds; the exit status is 1 if any failed.
"""

from __future__ import annotations

import inspect
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# --only 5,9: the lessons whose snippets run (all when empty)
ONLY = ({int(n) for n in sys.argv[sys.argv.index("--only") + 1].split(",")}
        if "--only" in sys.argv else set())


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")


def _lesson(n: int):
    from autograder.course import lesson
    from autograder.loading import load_tasks

    return load_tasks(lesson(n).source)


class Results:
    """PASS/FAIL lines, printed by rank 0; a check fails if it fails on any rank."""

    def __init__(self, rank: int) -> None:
        self.rank, self.failed = rank, 0

    def check(self, name: str, fn) -> None:
        lesson = int(name.split()[1].rstrip(":"))
        if ONLY and lesson not in ONLY:
            return
        start = time.perf_counter()
        try:
            detail = fn() or ""
            ok = torch.tensor([1], device=_device())
        except Exception:  # noqa: BLE001 - reported, then the next snippet runs
            detail = traceback.format_exc(limit=3).strip().splitlines()[-1]
            ok = torch.tensor([0], device=_device())
            print(f"[rank {self.rank}] {name}: {traceback.format_exc(limit=4)}", flush=True)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        passed = bool(ok.item())
        self.failed += not passed
        if self.rank == 0:
            seconds = time.perf_counter() - start
            print(f"{'PASS' if passed else 'FAIL'}  {name} [{seconds:.1f} s]"
                  + (f": {detail}" if detail else ""),
                  flush=True)


def lesson00(device: torch.device) -> str:
    """mean.py: shard_range + global_mean on GPU tensors, through NCCL."""
    m = _lesson(0)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    items = m.shard_range(1_000_000, rank, world_size)
    local = torch.arange(items.start, items.stop, dtype=torch.float64, device=device)
    mean = m.global_mean(local)
    assert mean.device == device, f"global_mean returned a tensor on {mean.device}"
    assert abs(mean.item() - 499999.5) < 1e-6, mean.item()
    return f"{mean.item()} on {mean.device} on every rank"


def lesson01(device: torch.device) -> str:
    """primitives.py: ring_all_reduce and tree_broadcast of GPU tensors; AVG on NCCL."""
    m = _lesson(1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    for n in (1 << 20, 1001, max(world_size - 1, 1)):  # large, uneven, fewer elements than ranks
        t = torch.randn(n, generator=g, dtype=torch.float64).to(device)
        want = t.clone()
        dist.all_reduce(want)
        m.ring_all_reduce(t)
        torch.testing.assert_close(t, want)
    b = torch.full((4096,), float(rank), device=device)
    m.tree_broadcast(b, src=world_size - 1)
    assert torch.all(b == world_size - 1)
    avg = torch.tensor([float(rank)], device=device)
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    assert abs(avg.item() - (world_size - 1) / 2) < 1e-6
    return f"ring (batch_isend_irecv) == dist.all_reduce on {world_size} rank(s), {device.type}"


def lesson02(device: torch.device, shared: str) -> str:
    """train.py: dist_info_from_env, the model on the rank's GPU, a checkpoint loaded on every
    rank."""
    m = _lesson(2)
    info = m.dist_info_from_env()
    assert info.world_size == dist.get_world_size()
    assert device.type == "cpu" or info.local_rank == device.index
    model = m.make_model().to(device)
    path = os.path.join(shared, "checkpoint.pt")
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict()}, path)
    dist.barrier()
    plain = torch.load(path, weights_only=True)  # without map_location: the saver's device
    where = {t.device for t in plain["model"].values()}
    mapped = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(mapped["model"])  # copies onto the model's own GPU
    assert all(p.device == device for p in model.parameters())
    if device.type == "cuda":  # what the lesson's correction says
        assert where == {torch.device("cuda", 0)}, where
    return f"rank {info.rank}/{info.world_size}, local_rank {info.local_rank}; torch.load " \
           f"without map_location puts rank 0's tensors on {sorted(map(str, where))} on every rank"


def lesson03(device: torch.device) -> str:
    """The data plane on GPUs: DistributedSampler, pinned memory, seeded workers,
    gather_unpadded."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    m = _lesson(3)
    world_size = dist.get_world_size()
    n = 103
    data = TensorDataset(torch.arange(n, dtype=torch.float32), torch.arange(n) % 7)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    mine = m.ShardSampler(data, shuffle=True, seed=0)
    sampler.set_epoch(1)
    mine.set_epoch(1)
    assert list(sampler) == list(mine), "ShardSampler differs from DistributedSampler"
    loader = DataLoader(data, batch_size=8, sampler=sampler, num_workers=2,
                        pin_memory=device.type == "cuda",
                        persistent_workers=True, prefetch_factor=4, worker_init_fn=m.seed_worker)
    seen = []
    for x, _ in loader:
        x = x.to(device, non_blocking=True)  # async copy from pinned memory
        seen.append(x)
    local = torch.cat(seen)  # (num_samples,) this rank's samples, in sampler order
    assert local.device == device
    # gather_unpadded expects the unshuffled sampler's order: evaluate without shuffle
    order = DistributedSampler(data, shuffle=False)
    values = torch.tensor([float(i) for i in order], device=device) * 2.0
    everything = m.gather_unpadded(values, n)
    torch.testing.assert_close(everything,
                               torch.arange(n, dtype=torch.float32, device=device) * 2.0)
    return f"{world_size} rank(s); gather_unpadded of {n} samples on {device.type}"


def lesson04(device: torch.device) -> str:
    """train.py: torch DDP with device_ids and gradient_as_bucket_view; your BucketedDDP agrees."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from kit.lessons.models import TinyTransformer, token_batch

    m = _lesson(4)
    rank = dist.get_rank()

    def grads(wrapper, **options):
        torch.manual_seed(0)
        model = wrapper(TinyTransformer(vocab=64, dim=64, layers=2, heads=4, context=32).to(device),
                        **options)
        x, y = token_batch(4, 32, 64, seed=rank)
        F.cross_entropy(model(x.to(device)).flatten(0, 1), y.to(device).flatten()).backward()
        if hasattr(model, "finish_gradient_synchronization"):
            model.finish_gradient_synchronization()
        inner = model.module
        return [p.grad.clone() for p in inner.parameters() if p.grad is not None]

    on_gpu = {"device_ids": [device.index]} if device.type == "cuda" else {}
    ref = grads(DDP, gradient_as_bucket_view=True, **on_gpu)
    for a, b in zip(ref, grads(m.BucketedDDP, bucket_size_mb=0.25)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    if device.type == "cpu":
        return "BucketedDDP gradients == torch DDP (gloo dry run: no bf16 hook on a CPU build)"
    torch.manual_seed(0)
    model = DDP(TinyTransformer(vocab=64, dim=64, layers=2, heads=4, context=32).to(device),
                device_ids=[device.index])
    model.register_comm_hook(None, bf16_compress_hook)  # accepted: a CUDA build with NCCL
    x, y = token_batch(4, 32, 64, seed=rank)
    F.cross_entropy(model(x.to(device)).flatten(0, 1), y.to(device).flatten()).backward()
    return "BucketedDDP gradients == torch DDP (device_ids, gradient_as_bucket_view); bf16 hook ran"


def _one_step(model, device, vocab: int, length: int = 32) -> float:
    """One forward, backward and SGD step of a token model on a batch of this rank's own."""
    from torch.nn import functional as F

    from kit.lessons.models import token_batch

    x, y = token_batch(2, length, vocab, seed=dist.get_rank())
    loss = F.cross_entropy(model(x.to(device)).flatten(0, 1).float(), y.to(device).flatten())
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=1e-3).step()
    return loss.item()


def lesson05(device: torch.device) -> str:
    """train.py: FSDP2 from the meta device with your apply_fsdp2 (bf16 params, fp32 reduce);
    HSDP on a ("replicate", "shard") mesh; CPUOffloadPolicy; forward prefetching."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from kit.lessons.models import TinyTransformer

    m = _lesson(5)
    world_size, cuda = dist.get_world_size(), device.type == "cuda"
    dim, layers = (4096, 32) if cuda else (64, 2)  # the lesson's size on GPUs, a small one on CPU
    mesh = init_device_mesh(device.type, (world_size,))
    with torch.device("meta"):
        model = TinyTransformer(dim=dim, layers=layers)
    m.apply_fsdp2(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model.to_empty(device=device.type)
    for module in model.modules():  # "initialise": every parameter is uninitialised after to_empty
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    loss = _one_step(model, device, vocab=256)
    params = sum(p.numel() for p in model.parameters())
    del model
    # HSDP: shard within a "node", replicate across them (here nodes of at most 2 ranks)
    shard = 2 if world_size % 2 == 0 else 1
    hsdp = init_device_mesh(device.type, (world_size // shard, shard),
                            mesh_dim_names=("replicate", "shard"))
    model = m.apply_fsdp2(TinyTransformer(dim=64, layers=2).to(device), hsdp)
    model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
    hsdp_loss = _one_step(model, device, vocab=256)
    if not cuda:
        return (f"FSDP2 from meta, {params:,} parameters: loss {loss:.2f}; HSDP "
                f"{tuple(hsdp.shape)}: {hsdp_loss:.2f}; CUDA only, skipped: CPUOffloadPolicy "
                "(it copies shards to an accelerator)")
    # CPU offload: shards, gradients and the optimizer step in CPU memory
    offloaded = TinyTransformer(dim=64, layers=2)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in offloaded.blocks:
        fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy(), mp_policy=policy)
    fully_shard(offloaded, mesh=mesh, offload_policy=CPUOffloadPolicy(), mp_policy=policy)
    offload_loss = _one_step(offloaded, device, vocab=256)
    where = {p.device.type for p in offloaded.parameters()}
    assert where == {"cpu"}, f"offloaded shards live on {where}"
    return (f"FSDP2 from meta, {params:,} parameters: loss {loss:.2f}; HSDP "
            f"{tuple(hsdp.shape)}: {hsdp_loss:.2f}; CPU offload: {offload_loss:.2f}")


def lesson06(device: torch.device, shared: str) -> str:
    """train.py: your TrainingState saved with dcp.async_save on a gloo group of its own
    (FileSystemWriter, thread_count=4), then with a DefaultStager (AsyncSaveResponse), reloaded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.nn.parallel import DistributedDataParallel as DDP

    from kit.lessons.resume import VOCAB, make_model, make_optimizer, make_sampler, token_dataset

    m = _lesson(6)
    cuda = device.type == "cuda"
    train_group = dist.new_group(backend="cpu:gloo,cuda:nccl" if cuda else "gloo")
    ckpt_group = dist.new_group(backend="gloo")  # the background saves' own group

    def training_state():
        model = DDP(make_model().to(device), device_ids=[device.index] if cuda else None,
                    process_group=train_group)
        return m.TrainingState(model, make_optimizer(model), make_sampler(token_dataset()))

    state = training_state()
    _one_step(state.model, device, vocab=VOCAB, length=16)
    state.optimizer.step()
    state.step = step = 7
    writer = dcp.FileSystemWriter(os.path.join(shared, f"step-{step:06d}"), thread_count=4)
    future = dcp.async_save({"train": state}, storage_writer=writer, process_group=ckpt_group)
    future.result()
    # A stager of your own: pinned buffers kept between saves, copies off the GPU in a thread
    options = StagingOptions(use_pinned_memory=cuda, use_non_blocking_copy=cuda)  # both need CUDA
    stager = DefaultStager(options)
    response = dcp.async_save({"train": state}, checkpoint_id=os.path.join(shared, "staged"),
                              process_group=ckpt_group, async_stager=stager)
    kind = type(response).__name__
    response.staging_completion.result()  # before the next optimizer step changes parameters
    response.upload_completion.result()  # before the next save
    stager.close()
    fresh = training_state()
    for folder in (f"step-{step:06d}", "staged"):
        dcp.load({"train": fresh}, checkpoint_id=os.path.join(shared, folder),
                 process_group=ckpt_group)
        assert fresh.step == step, fresh.step
        for a, b in zip(state.model.parameters(), fresh.model.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    note = "" if cuda else " (CPU: no pinned memory or non-blocking copy, they need CUDA)"
    return (f"async_save -> {type(future).__name__}, with a DefaultStager -> {kind}; both reload "
            f"exactly{note}")


def lesson07(device: torch.device) -> str:
    """train.py: checkpoint_wrapper on every second block, each block compiled then sharded with
    bf16 MixedPrecisionPolicy, one step; peak memory and the memory snapshot on CUDA."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from kit.lessons.models import TinyTransformer

    cuda = device.type == "cuda"
    if cuda:
        model = TinyTransformer(vocab=50257, dim=1024, layers=24, heads=16, context=1024).cuda()
    else:
        model = TinyTransformer(vocab=256, dim=64, layers=2, heads=4, context=32)
    for i, block in enumerate(model.blocks):  # as apply_checkpointing(model, every=2)
        if (i + 1) % 2 == 0:
            model.blocks[i] = checkpoint_wrapper(block)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        block.compile()  # compile each block first (in place) ...
        fully_shard(block, mp_policy=policy)  # ... then shard it
    fully_shard(model, mp_policy=policy)
    if not cuda:
        loss = _one_step(model, device, vocab=256)
        return (f"loss {loss:.2f}: compiled, checkpointed, bf16-sharded blocks; CUDA only, "
                "skipped: torch.cuda.max_memory_allocated, the memory snapshot")
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=10000)
    loss = _one_step(model, device, vocab=50257, length=1024)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated() / 2**30
    return (f"loss {loss:.2f}; {peak:.2f} GiB at peak; snapshot of {len(snapshot['segments'])} "
            "segments")


def lesson08(device: torch.device) -> str:
    """train.py: a ("dp", "tp") mesh, parallelize_module on each block's MLP then fully_shard on
    "dp"; your ColumnParallelLinear and RowParallelLinear on the "tp" group's tensors."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.nn import functional as F

    from kit.lessons.models import TinyTransformer

    m = _lesson(8)
    world_size = dist.get_world_size()
    tp = min(8, world_size) if world_size % min(8, world_size) == 0 else 1
    mesh = init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    size = (dict(dim=2048, layers=16, heads=16) if device.type == "cuda"
            else dict(dim=64, layers=2, heads=4))
    model = TinyTransformer(**size).to(device)  # each block: mlp.0, GELU, mlp.2
    for block in model.blocks:
        parallelize_module(block, mesh["tp"],
                           {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    loss = _one_step(model, device, vocab=256)
    # Your layers, on the rank's device, through the "tp" group
    group = mesh["tp"].get_group()
    torch.manual_seed(0)
    up, down = nn.Linear(64, 256).to(device), nn.Linear(256, 64).to(device)
    x = torch.randn(4, 16, 64, device=device)
    col, row = m.ColumnParallelLinear(up, group=group), m.RowParallelLinear(down, group=group)
    torch.testing.assert_close(row(F.gelu(col(x))), down(F.gelu(up(x))), rtol=1e-4, atol=1e-5)
    return (f"mesh {tuple(mesh.shape)} (dp, tp): FSDP x TP step, loss {loss:.2f}; your TP layers "
            "== nn.Linear")


def lesson09(device: torch.device) -> str:
    """train_esm.py: ESM-2 on the meta device, checkpoint_wrapper per layer, FSDP2 with bf16
    MixedPrecisionPolicy, to_empty, init_weights, one MLM step; load_pretrained_esm2's error."""
    from esm.model.esm2 import ESM2
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn import functional as F

    from kit.lessons.proteins import ESM2_FAMILY, alphabet, init_weights

    m = _lesson(9)
    name = "esm2_t33_650M_UR50D" if device.type == "cuda" else "esm2_t6_8M_UR50D"
    layers, dim, heads = ESM2_FAMILY[name]
    with torch.device("meta"):  # no memory until sharded
        model = ESM2(layers, dim, heads, alphabet=alphabet())
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device=device.type)  # each device allocates its shard
    model.apply(init_weights)  # then initialise (or load)
    vocab = alphabet()
    tokens = m.tokenize(["MKTAYIAKQRQISFVKSHFSRQ", "GIGKFLHSAKKFGKAFVGEIMNS"], vocab).to(device)
    g = torch.Generator().manual_seed(dist.get_rank())
    masked, labels = m.mask_tokens(tokens.cpu(), vocab, g)
    with torch.autocast(device.type, dtype=torch.bfloat16):  # fair-esm's rotary q, k come out fp32
        logits = model(masked.to(device))["logits"]  # (B, T, 33)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.to(device).flatten(),
                           ignore_index=-100)
    loss.backward()
    try:
        m.load_pretrained_esm2("esm2_t33_650M_UR50D", path="/nonexistent/esm2_t33_650M_UR50D.pt")
        raise AssertionError("load_pretrained_esm2 found weights at /nonexistent")
    except FileNotFoundError:
        pass
    assert torch.isfinite(loss), loss
    return f"{name} from meta, FSDP2 bf16 + checkpointing: MLM loss {loss.item():.2f}"


def lesson10(device: torch.device) -> str:
    """train_freesolv.py: DDP(MessagePassingNet) with device_ids, DistributedSampler, DataLoader
    with your collate, workers and pinned memory, batch.to(device); screen_metrics on the device."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from kit.lessons.molecules import MessagePassingNet, conformer, freesolv, mol_graph

    m = _lesson(10)
    cuda = device.type == "cuda"
    smiles, energies = freesolv()
    molecules, batch = (128, 64) if cuda else (16, 8)  # RDKit embeds every conformer: few on CPU
    train_graphs = [m.MolData(**mol_graph(conformer(s, seed=0)), y=energies[n:n + 1])
                    for n, s in enumerate(smiles[:molecules])]
    torch.manual_seed(0)
    model = DDP(MessagePassingNet().to(device), device_ids=[device.index] if cuda else None)
    sampler = DistributedSampler(train_graphs, shuffle=True, seed=0)
    # persistent workers start once, not every epoch: each one imports the lesson (PyG, RDKit) to
    # unpickle your collate, seconds apiece (the ranks are spawned, so their workers are too)
    loader = DataLoader(train_graphs, batch_size=batch, sampler=sampler, collate_fn=m.collate,
                        num_workers=4 if cuda else 1, pin_memory=cuda, persistent_workers=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = batch.to(device, non_blocking=True)
            loss = torch.nn.functional.mse_loss(model(batch), batch.y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    n = 1000
    scores = torch.linspace(1, 0, n, dtype=torch.float64)
    labels = torch.arange(n) % 50 == 0
    lo, hi = rank * n // world_size, (rank + 1) * n // world_size
    got = m.screen_metrics(scores[lo:hi].to(device), labels[lo:hi].to(device),
                           torch.arange(lo, hi, device=device))
    assert got["top100"] == list(range(100)), got["top100"][:5]
    return (f"DDP on {device.type}: last loss {loss.item():.2f}; screen_metrics EF@1% "
            f"{got['ef1']:.1f}")


def lesson12(device: torch.device) -> str:
    """train.py under the profiler: CPU and (on GPUs) CUDA activity, a schedule, one trace per
    rank through tensorboard_trace_handler; with NCCL on 2 or more GPUs the all-reduce shows up as
    an nccl kernel on a stream of its own, and the time it overlaps a matmul on the compute
    stream is measured from the trace; on one GPU NCCL runs none. Then a memory snapshot of one
    step (CUDA only): the caching allocator's segments and its allocations."""
    import json
    import pickle

    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    rank = dist.get_rank()
    model = torch.nn.Linear(256, 256).to(device)
    x = torch.randn(64, 256, device=device)

    def train_step(batch: torch.Tensor) -> None:
        model(batch).square().mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with tempfile.TemporaryDirectory(prefix="gpu-smoke-traces-") as root:
        with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=3),
                     on_trace_ready=tensorboard_trace_handler(f"{root}/traces/rank{rank}")) as prof:
            for _step, batch in enumerate([x] * 6):
                train_step(batch)
                prof.step()
        files = list(Path(root, "traces", f"rank{rank}").glob("*.json"))
        assert len(files) == 1, f"one trace per rank expected, found {files}"
        events = json.loads(files[0].read_text())["traceEvents"]
        if device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            train_step(x)
            torch.cuda.memory._dump_snapshot(f"{root}/snapshot_rank{rank}.pickle")
            torch.cuda.memory._record_memory_history(enabled=None)
            snapshot = pickle.loads(Path(root, f"snapshot_rank{rank}.pickle").read_bytes())
    names = {e.get("name", "") for e in events}
    assert any("all_reduce" in n for n in names), "no all_reduce op in the trace"
    if device.type != "cuda":
        return ("1 trace per rank, all_reduce recorded (CPU: no CUDA kernels); memory snapshot: "
                "CUDA only, skipped")
    segments = snapshot["segments"]
    allocs = [e for t in snapshot["device_traces"] for e in t if e["action"] == "alloc"]
    assert segments and allocs, "the snapshot holds no segment or no allocation"
    memory = (f"; snapshot: {len(segments)} segment(s), "
              f"{sum(s['total_size'] for s in segments) / 2**20:.0f} MiB reserved, "
              f"{len(allocs)} allocations with stacks")
    on_gpu = {(e["cat"], e["name"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy")}
    nccl = sorted({e["name"] for e in events if e.get("cat") == "kernel"
                   and "nccl" in e["name"].lower()})
    if dist.get_world_size() == 1:
        # One rank has nothing to send: NCCL launches no kernel (seen on an H200, NCCL 2.28.9:
        # an in-place all_reduce ran nothing on the GPU, an out-of-place collective one DtoD copy).
        assert not nccl, f"one rank, yet NCCL kernels ran: {nccl}"
        return ("1 rank: NCCL ran no kernel (nothing to send); GPU work in the trace: "
                f"{len(on_gpu)} kinds" + memory)
    assert nccl, f"no NCCL kernel in the CUDA trace, only {sorted(on_gpu)[:5]}"
    return _nccl_beside_a_matmul(device) + memory


def _nccl_beside_a_matmul(device: torch.device) -> str:
    """An all-reduce launched asynchronously, then a matmul: the trace's NCCL kernels run on a
    stream of their own, and the time they share with compute kernels is the overlap."""
    from torch.profiler import ProfilerActivity, profile

    grads = torch.ones(64 * 2**20 // 4, device=device)  # 64 MiB: long enough to overlap
    a = torch.randn(4096, 4096, device=device)
    dist.all_reduce(grads)  # warm-up: NCCL's communicator and a matmul kernel chosen
    a @ a
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        work = dist.all_reduce(grads, async_op=True)
        for _ in range(4):
            a @ a
        work.wait()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory(prefix="gpu-smoke-overlap-") as root:
        prof.export_chrome_trace(f"{root}/trace.json")
        import json

        kernels = [e for e in json.loads(Path(root, "trace.json").read_text())["traceEvents"]
                   if e.get("cat") == "kernel"]
    comm = [e for e in kernels if "nccl" in e["name"].lower()]
    comp = [e for e in kernels if "nccl" not in e["name"].lower()]
    assert comm and comp, f"kernels: {len(comm)} NCCL, {len(comp)} compute"
    streams = ({e["args"].get("stream") for e in comm}, {e["args"].get("stream") for e in comp})
    assert not streams[0] & streams[1], f"NCCL and compute kernels share a stream: {streams}"
    shared = sum(max(0.0, min(c["ts"] + c["dur"], k["ts"] + k["dur"]) - max(c["ts"], k["ts"]))
                 for c in comm for k in comp)
    busy = sum(c["dur"] for c in comm)
    return (f"NCCL kernels {sorted({e['name'] for e in comm})[:1]} on stream(s) "
            f"{sorted(streams[0])}, compute on {sorted(streams[1])}: {shared / 1e3:.2f} of "
            f"{busy / 1e3:.2f} ms of NCCL kernel time overlaps compute")


def lesson13(device: torch.device) -> str:
    """train_moe.py: a (dp, ep) mesh, the router and this rank's experts on the device,
    ExpertParallelMoE over the ep group; forward and backward equal MoELayer with every expert."""
    from torch.distributed.device_mesh import init_device_mesh

    from kit.lessons.moe import capacity, expert_range, make_experts, make_router

    m = _lesson(13)
    world_size = dist.get_world_size()
    ep = 4 if world_size % 4 == 0 else world_size  # the note's (W // 4, 4); else one ep group
    mesh = init_device_mesh(device.type, (world_size // ep, ep), mesh_dim_names=("dp", "ep"))
    ep_rank = mesh.get_local_rank("ep")
    d_model, num_experts, d_hidden = (1024, 16, 704) if device.type == "cuda" else (64, 8, 32)
    router = make_router(d_model, num_experts).to(device)
    experts = make_experts(num_experts, d_model, d_hidden,
                           which=expert_range(num_experts, ep, ep_rank)).to(device)
    moe = m.ExpertParallelMoE(router, experts, k=2, capacity_factor=1.25,
                              group=mesh.get_group("ep"))
    torch.manual_seed(dist.get_rank())
    x = torch.randn(256, d_model, device=device, requires_grad=True)
    out = moe(x)
    out.square().sum().backward()
    # Lesson 13's MoELayer (a demo cell, so written out here): every expert in this process.
    router_all = make_router(d_model, num_experts).to(device)
    experts_all = make_experts(num_experts, d_model, d_hidden).to(device)
    x_one = x.detach().clone().requires_grad_()
    routing = m.route(router_all(x_one), 2, capacity(2, len(x_one), 1.25, num_experts))
    expected = torch.zeros_like(x_one)
    for e, expert in enumerate(experts_all):
        token, choice = torch.nonzero((routing.expert == e) & routing.kept, as_tuple=True)
        if token.numel():
            expected = expected.index_add(0, token, routing.weight[token, choice, None]
                                          * expert(x_one[token]))
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x.grad, x_one.grad)
    return (f"mesh ({world_size // ep}, {ep}) (dp, ep), {len(experts)} of {num_experts} experts "
            f"here: forward and backward == MoELayer on {device.type}")


def lesson14(device: torch.device) -> str:
    """train.py: your build_mesh, parallelize and build_pipeline on a (pp, dp, tp) mesh under
    the rank's backend; the losses follow one process, and a checkpoint saved at that layout
    resumes at (dp=W, tp=1) on the same curve."""
    import tempfile

    from kit.lessons import composition as comp

    m = _lesson(14)
    world_size = dist.get_world_size()
    tp = 2 if world_size % 2 == 0 else 1
    pp = 2 if world_size % 4 == 0 else 1
    dp = world_size // (tp * pp)
    batches = comp.masked_batches(4, 4 * dp)
    want = comp.one_process_losses(batches)
    mesh = m.build_mesh(world_size, dp, tp, pp)
    if pp > 1:
        part, schedule = m.build_pipeline(comp.encoder(0).to(device), mesh, 2, comp.masked_lm_loss)
    else:
        part, schedule = m.parallelize(comp.encoder(0).to(device), mesh), None
    optimizer = comp.optimizer_for(part)
    losses = comp.train_steps(part, mesh, batches[:2], optimizer, schedule)
    with tempfile.TemporaryDirectory() as root:
        path = [f"{root}/ckpt" if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(path, src=0)  # every rank saves to rank 0's folder
        if pp == 1:
            m.save_checkpoint(part, optimizer, 2, path[0])
            mesh = m.build_mesh(world_size, world_size, 1, 1)
            part = m.parallelize(comp.encoder(1).to(device), mesh)
            optimizer = comp.optimizer_for(part)
            assert m.load_checkpoint(part, optimizer, path[0]) == 2
        losses += comp.train_steps(part, mesh, batches[2:], optimizer, schedule)
        dist.barrier()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-3, atol=1e-4)
    resumed = "; pipeline, no resume" if pp > 1 else f"; saved, resumed at (dp={world_size})"
    return f"mesh (pp={pp}, dp={dp}, tp={tp}): 4 steps on the one-process curve{resumed}"


def worker(local_rank: int, world_size: int, port: int, shared: str, backend: str = "nccl") -> int:
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # started by mp.spawn: set what torchrun sets
        os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank),
                          WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    local_rank = int(os.environ["LOCAL_RANK"])
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # one GPU per rank: NCCL needs the tensors on it
        dist.init_process_group("nccl", device_id=device)
    else:  # --cpu: the same code, gloo on CPU tensors
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    results = Results(dist.get_rank())
    if results.rank == 0:
        where = (f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))} on "
                 f"{torch.cuda.get_device_name(device)}" if backend == "nccl" else "gloo on CPU "
                                                                                   "(dry run)")
        print(f"torch {torch.__version__}, {dist.get_world_size()} rank(s), {where}", flush=True)
    # one check per lesson the course spec gives a gpu_smoke (autograder/course.py)
    from autograder import course

    for spec in course.LESSONS:
        if spec.gpu_smoke:
            run = globals()[f"lesson{spec.number:02d}"]
            extra = (shared,) if "shared" in inspect.signature(run).parameters else ()
            results.check(f"Lesson {spec.number:02d}: {spec.gpu_smoke}",
                          lambda run=run, extra=extra: run(device, *extra))
    failed = results.failed
    dist.destroy_process_group()
    if failed:
        sys.exit(1)
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    cpu_ranks = int(sys.argv[sys.argv.index("--cpu") + 1]) if "--cpu" in sys.argv else 0
    if cpu_ranks:
        return _spawn(cpu_ranks, "gloo")
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        why = "torch.cuda.is_available() is False" if not torch.cuda.is_available() else \
            "this torch build has no NCCL"
        print(f"gpu_smoke: skipped, no CUDA device with NCCL here ({why}); "
              "run it on a GPU machine.")
        return 0
    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: this process is one rank
        shared = os.environ.get("GPU_SMOKE_DIR", tempfile.gettempdir())
        return worker(int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]), 0, shared)
    return _spawn(torch.cuda.device_count(), "nccl")


def _spawn(world_size: int, backend: str) -> int:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="gpu-smoke-") as shared:
        try:
            mp.spawn(worker, args=(world_size, _free_port(), shared, backend), nprocs=world_size)
        except mp.ProcessRaisedException as e:
            print(f"gpu_smoke: a rank raised: {e}")
            return 1
        except mp.ProcessExitedException as e:
            print(f"gpu_smoke: {e}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
