"""Seeded bugs for Lesson 04: the typical mistakes each check of tasks 4.1-4.4 must catch.

``BUGS[task_id]`` lists ``(what is wrong, implementation)``; tests/test_lesson04.py (and the
pipeline's generic tests) prove every one of them fails its task's checks. Each bug is a
correct wrapper with one step replaced.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from bugs import edited_solution


def _broadcast(module: nn.Module) -> None:
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t, src=0)


def _tied_twice(module: nn.Module) -> list[nn.Parameter]:
    """Parameters module by module: a tied parameter is listed once per module using it."""
    return [p for m in module.modules() for p in m.parameters(recurse=False)]


# --------------------------------------------------------------------------- task 4.1


class _Naive(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        self._broadcast()

    def _broadcast(self):
        _broadcast(self.module)

    def _params(self):
        return list(self.module.parameters())

    def _average(self, grad):
        grad /= dist.get_world_size()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for p in self._params():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                self._average(p.grad)


class NaiveSums(_Naive):
    def _average(self, grad):
        pass


class NaiveNoBroadcast(_Naive):
    def _broadcast(self):
        pass


class NaiveParametersOnly(_Naive):
    def _broadcast(self):
        with torch.no_grad():
            for p in self.module.parameters():
                dist.broadcast(p, src=0)


class NaiveTiedTwice(_Naive):
    def _params(self):
        return _tied_twice(self.module)


# --------------------------------------------------------------------------- task 4.2


class _Overlapped(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        self._pending = []
        self._broadcast()
        for p in self._params():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _broadcast(self):
        _broadcast(self.module)

    def _params(self):
        return list(self.module.parameters())

    def _on_grad_ready(self, param):
        self._pending.append((dist.all_reduce(param.grad, async_op=True), param.grad))

    def _average(self, grad):
        grad /= dist.get_world_size()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for work, grad in self._pending:
            work.wait()
            self._average(grad)
        self._pending.clear()


class OverlappedSums(_Overlapped):
    def _average(self, grad):
        pass


class OverlappedNoBroadcast(_Overlapped):
    def _broadcast(self):
        pass


class OverlappedTiedTwice(_Overlapped):
    def _params(self):
        return _tied_twice(self.module)


class ReducesAfterBackward(_Overlapped):
    """Hooks only remember the parameter; the all-reduces start in finish: no overlap."""

    def _on_grad_ready(self, param):
        self._pending.append(param)

    def finish_gradient_synchronization(self):
        works = [(dist.all_reduce(p.grad, async_op=True), p.grad) for p in self._pending]
        for work, grad in works:
            work.wait()
            grad /= dist.get_world_size()
        self._pending.clear()


# --------------------------------------------------------------------------- tasks 4.3 and 4.4


class _Bucketed(nn.Module):
    def __init__(self, module, bucket_size_mb=25.0):
        super().__init__()
        self.module = module
        self.require_backward_grad_sync = True
        self._broadcast()
        self.buckets = self._plan(bucket_size_mb * 2**20)
        self._bucket_of = {}
        for i, bucket in enumerate(self.buckets):
            for p in bucket:
                self._bucket_of.setdefault(p, i)
        self._ready = [0] * len(self.buckets)
        self._pending = {}
        for p in self._bucket_of:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _broadcast(self):
        _broadcast(self.module)

    def _params(self):
        return [p for p in self.module.parameters() if p.requires_grad]

    def _order(self):
        return list(reversed(self._params()))  # the order backward produces gradients in

    def _plan(self, cap):
        buckets, current, size = [], [], 0
        for p in self._order():
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > cap:
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        return buckets + [current] if current else buckets

    def _is_ready(self, i):
        return self._ready[i] == len(self.buckets[i])

    def _on_grad_ready(self, param):
        if not self.require_backward_grad_sync:
            return
        i = self._bucket_of[param]
        self._ready[i] += 1
        if self._is_ready(i):
            self._start(i)

    def _scale(self):
        return 1 / dist.get_world_size()

    def _start(self, i):
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.buckets[i]])
        flat *= self._scale()
        self._pending[i] = (dist.all_reduce(flat, async_op=True), flat)

    def _start_late_buckets(self):
        for i in range(len(self.buckets)):
            if i not in self._pending:
                self._start(i)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        if not self.require_backward_grad_sync:
            return
        self._start_late_buckets()
        for i, (work, flat) in sorted(self._pending.items()):
            work.wait()
            offset = 0
            for p in self.buckets[i]:
                if p.grad is not None:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self._pending.clear()
        self._ready = [0] * len(self.buckets)

    @contextmanager
    def no_sync(self):
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous


class BucketFiresEarly(_Bucketed):
    """Fires when all but one of the bucket's parameters are ready."""

    def _is_ready(self, i):
        return self._ready[i] == max(1, len(self.buckets[i]) - 1)


class BucketedSums(_Bucketed):
    def _scale(self):
        return 1.0


class BucketedNoBroadcast(_Bucketed):
    def _broadcast(self):
        pass


class OneBucketPerParameter(_Bucketed):
    def _plan(self, cap):
        return [[p] for p in reversed(self._params())]


class BucketsInForwardOrder(_Bucketed):
    def _order(self):
        return self._params()


class SkipsBucketsNeverReady(_Bucketed):
    """Buckets holding a parameter that got no gradient are never reduced."""

    def _start_late_buckets(self):
        pass


class BucketedTiedTwice(_Bucketed):
    def _params(self):
        return [p for p in _tied_twice(self.module) if p.requires_grad]


class NoSyncDoesNothing(_Bucketed):
    @contextmanager
    def no_sync(self):
        yield


class NoSyncNeverRestores(_Bucketed):
    @contextmanager
    def no_sync(self):
        self.require_backward_grad_sync = False
        yield


class NoSyncDropsAccumulated(_Bucketed):
    """Leaving the block throws away what the micro-batches inside it accumulated."""

    @contextmanager
    def no_sync(self):
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = True
            self.module.zero_grad()


# --------------------------------------------------------------------------- exploits


class WrapsTorchDDP(nn.Module):
    """torch's DistributedDataParallel inside the task's class: its C++ reducer does the work."""

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0):
        super().__init__()
        self.module = module
        self._ddp = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_size_mb,
                                                        find_unused_parameters=True)

    def forward(self, *args, **kwargs):
        return self._ddp(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        pass

    @contextmanager
    def no_sync(self):
        with self._ddp.no_sync():
            yield


class BlockingHook(_Overlapped):
    """All-reduces in the hook, but waits for each there: correct numbers, no overlap at all."""

    def _on_grad_ready(self, param):
        dist.all_reduce(param.grad)
        param.grad /= dist.get_world_size()

    def finish_gradient_synchronization(self):
        pass


BUGS = {
    "4.1": [
        ("sums the gradients instead of averaging them", NaiveSums),
        ("no broadcast at construction", NaiveNoBroadcast),
        ("broadcasts the parameters but not the buffers", NaiveParametersOnly),
        ("reduces the tied weight twice (module by module)", NaiveTiedTwice),
        ("wraps torch's DistributedDataParallel", WrapsTorchDDP),
    ],
    "4.2": [
        ("sums the gradients instead of averaging them", OverlappedSums),
        ("no broadcast at construction", OverlappedNoBroadcast),
        ("hooks the tied weight twice (module by module)", OverlappedTiedTwice),
        ("starts the all-reduces after backward (no overlap)", ReducesAfterBackward),
        ("all-reduces in the hook but blocks there (no overlap)", BlockingHook),
        ("wraps torch's DistributedDataParallel", WrapsTorchDDP),
    ],
    "4.3": [
        ("a bucket fires before all its gradients are ready", BucketFiresEarly),
        ("sums the gradients instead of averaging them", BucketedSums),
        ("no broadcast at construction", BucketedNoBroadcast),
        ("one all-reduce per parameter (no buckets)", OneBucketPerParameter),
        ("buckets in forward order", BucketsInForwardOrder),
        ("never reduces a bucket holding a parameter without a gradient", SkipsBucketsNeverReady),
        ("puts the tied weight in a bucket twice", BucketedTiedTwice),
        ("wraps torch's DistributedDataParallel", WrapsTorchDDP),
    ],
    "4.4": [
        ("no_sync still communicates on every micro-batch", NoSyncDoesNothing),
        ("no_sync never switches synchronisation back on", NoSyncNeverRestores),
        ("no_sync drops the gradients accumulated inside it", NoSyncDropsAccumulated),
        ("no_sync restores True, not the previous value (a nested no_sync turns sync back on)",
         edited_solution(4, (
             "        finally:\n            self.require_backward_grad_sync = previous\n",
             "        finally:\n            self.require_backward_grad_sync = True\n",
         )).BucketedDDP),
        ("no_sync without try/finally: a raise inside leaves sync off",
         edited_solution(4, (
             "        try:\n            yield\n        finally:\n            self.require_backward_grad_sync = previous\n",
             "        yield\n        self.require_backward_grad_sync = previous\n",
         )).BucketedDDP),
    ],
}
