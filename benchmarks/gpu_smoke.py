"""Run the "Running at scale" code of Lessons 00-04 with NCCL, one rank per GPU.

Each lesson ends with a note saying its functions run unchanged under ``torchrun`` with NCCL.
This script is that note, executed: it loads the lessons' solutions (``solutions/0N_*.py``,
setup and task cells only) and runs each snippet on CUDA tensors, checking the result against
torch's own collectives. Run it on a machine with GPUs::

    python benchmarks/gpu_smoke.py                                   # one rank per visible GPU
    torchrun --standalone --nproc-per-node=gpu benchmarks/gpu_smoke.py

Without CUDA it says so and exits 0. ``--cpu N`` runs the same code on N CPU ranks with gloo
(the CUDA-only parts skipped), to test this script where there is no GPU. Every check prints
one ``PASS``/``FAIL`` line from rank 0; the exit status is 1 if any failed.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")


def _lesson(n: int):
    from autograder.loading import load_tasks

    return load_tasks(next((ROOT / "solutions").glob(f"{n:02d}_*.py")))


class Results:
    """PASS/FAIL lines, printed by rank 0; a check fails if it fails on any rank."""

    def __init__(self, rank: int) -> None:
        self.rank, self.failed = rank, 0

    def check(self, name: str, fn) -> None:
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
            print(f"{'PASS' if passed else 'FAIL'}  {name}" + (f": {detail}" if detail else ""), flush=True)


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
    """train.py: dist_info_from_env, the model on the rank's GPU, a checkpoint loaded on every rank."""
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
    return f"rank {info.rank}/{info.world_size}, local_rank {info.local_rank}; torch.load without " \
           f"map_location puts rank 0's tensors on {sorted(map(str, where))} on every rank"


def lesson03(device: torch.device) -> str:
    """The data plane on GPUs: DistributedSampler, pinned memory, seeded workers, gather_unpadded."""
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
    torch.testing.assert_close(everything, torch.arange(n, dtype=torch.float32, device=device) * 2.0)
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


def worker(local_rank: int, world_size: int, port: int, shared: str, backend: str = "nccl") -> int:
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # started by mp.spawn: set what torchrun sets
        os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
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
                 f"{torch.cuda.get_device_name(device)}" if backend == "nccl" else "gloo on CPU (dry run)")
        print(f"torch {torch.__version__}, {dist.get_world_size()} rank(s), {where}", flush=True)
    results.check("Lesson 00: shard_range + global_mean (mean.py)", lambda: lesson00(device))
    results.check("Lesson 01: ring_all_reduce, tree_broadcast, AVG (primitives.py)", lambda: lesson01(device))
    results.check("Lesson 02: dist_info_from_env, a checkpoint loaded on every rank (train.py)", lambda: lesson02(device, shared))
    results.check("Lesson 03: sampler, pinned loader, seed_worker, gather_unpadded", lambda: lesson03(device))
    results.check("Lesson 04: torch DDP and BucketedDDP (train.py)", lambda: lesson04(device))
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
        print(f"gpu_smoke: skipped, no CUDA device with NCCL here ({why}); run it on a GPU machine.")
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
