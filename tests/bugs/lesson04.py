"""Seeded bugs for Lesson 04: the typical mistakes each check of tasks 4.1-4.4 must catch.

``BUGS[task_id]`` lists ``(what is wrong, implementation)``; tests/test_lesson04.py (and the
pipeline's generic tests) prove every one of them fails its task's checks. Each bug is the
solution with one step changed (edited_solution); the exploit wraps torch's own DDP.
"""

from __future__ import annotations

from torch import nn

from bugs import edited_solution

_TIED_TWICE = "[p for m in {}.modules() for p in m.parameters(recurse=False)]"  # module by module


def _bug(name: str, *edits: tuple[str, str]):
    """The solution's ``name`` with each (old, new) edit made."""
    return getattr(edited_solution(4, *edits), name)


# --------------------------------------------------------------------------- task 4.1

NaiveSums = _bug("NaiveDDP", ("                p.grad /= world_size\n", ""))
NaiveNoBroadcast = _bug("NaiveDDP", (
    "  # frozen ones too\n                dist.broadcast(t, src=0)\n",
    "  # frozen ones too\n                pass\n"))
NaiveParametersOnly = _bug("NaiveDDP", (
    "for t in [*module.parameters(), *module.buffers()]:  # frozen ones too",
    "for t in module.parameters():  # the buffers are forgotten"))
NaiveTiedTwice = _bug("NaiveDDP", (
    "for p in self.module.parameters():  # a tied parameter is listed once",
    f"for p in {_TIED_TWICE.format('self.module')}:"))

# --------------------------------------------------------------------------- task 4.2

_BROADCAST_42 = "dist.broadcast(t, src=0)\n        for p in module.parameters():"
_TIED_42 = "for p in module.parameters():  # a tied parameter once: one hook, one all-reduce"
_HOOK_42 = ("        work = dist.all_reduce(param.grad, async_op=True)\n"
            "        self._pending.append((work, param.grad))\n")

OverlappedSums = _bug("OverlappedDDP", (
    "            work.wait()\n            grad /= world_size\n", "            work.wait()\n"))
OverlappedNoBroadcast = _bug("OverlappedDDP", (
    _BROADCAST_42, "pass\n        for p in module.parameters():"))
OverlappedTiedTwice = _bug("OverlappedDDP", (
    _TIED_42, f"for p in {_TIED_TWICE.format('module')}:"))
ReducesAfterBackward = _bug(  # hooks only remember the parameter: the all-reduces start in finish
    "OverlappedDDP",
    (_HOOK_42, "        self._pending.append(param)\n"),
    ("for work, grad in self._pending:",
     "for work, grad in [(dist.all_reduce(p.grad, async_op=True), p.grad)\n"
     "                           for p in self._pending]:"))
BlockingHook = _bug(  # all-reduces in the hook but waits there: right numbers, no overlap
    "OverlappedDDP", (_HOOK_42,
                      "        dist.all_reduce(param.grad)  # blocking\n"
                      "        param.grad /= dist.get_world_size()\n"))

# --------------------------------------------------------------------------- tasks 4.3 and 4.4

_ORDER_43 = "for p in reversed([p for p in module.parameters() if p.requires_grad]):"

BucketFiresEarly = _bug(  # fires when all but one of the bucket's parameters are ready
    "BucketedDDP", ("if self._ready[i] == len(self.buckets[i]):",
                    "if self._ready[i] == max(1, len(self.buckets[i]) - 1):"))
BucketedSums = _bug("BucketedDDP", ("        flat /= dist.get_world_size()\n", ""))
BucketedNoBroadcast = _bug("BucketedDDP", (
    "dist.broadcast(t, src=0)\n        cap = ", "pass\n        cap = "))
OneBucketPerParameter = _bug("BucketedDDP", (
    "if current and size + nbytes > cap:\n                self.buckets.append(current)",
    "if current:\n                self.buckets.append(current)"))
BucketsInForwardOrder = _bug("BucketedDDP", (
    _ORDER_43, "for p in [p for p in module.parameters() if p.requires_grad]:"))
SkipsBucketsNeverReady = _bug(  # a bucket holding a parameter that got no gradient never reduces
    "BucketedDDP", ("if i not in self._pending:  # a parameter got no gradient this step",
                    "if False:  # only the buckets that became ready"))
BucketedTiedTwice = _bug("BucketedDDP", (
    _ORDER_43,
    f"for p in reversed([p for p in {_TIED_TWICE.format('module')}\n"
    "                           if p.requires_grad]):"))

_RESTORE = "            self.require_backward_grad_sync = previous\n"

NoSyncDoesNothing = _bug("BucketedDDP", (
    "        previous = self.require_backward_grad_sync\n"
    "        self.require_backward_grad_sync = False\n",
    "        previous = self.require_backward_grad_sync\n"))
NoSyncNeverRestores = _bug("BucketedDDP", (_RESTORE, "            pass\n"))
NoSyncDropsAccumulated = _bug(  # leaving the block throws away what was accumulated inside it
    "BucketedDDP", (_RESTORE, "            self.require_backward_grad_sync = True\n"
                              "            self.module.zero_grad()\n"))
NoSyncRestoresTrue = _bug("BucketedDDP", (
    "        finally:\n" + _RESTORE,
    "        finally:\n            self.require_backward_grad_sync = True\n"))
NoSyncWithoutFinally = _bug("BucketedDDP", (
    "        try:\n            yield\n        finally:\n" + _RESTORE,
    "        yield\n        self.require_backward_grad_sync = previous\n"))

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

    def no_sync(self):
        return self._ddp.no_sync()


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
         NoSyncRestoresTrue),
        ("no_sync without try/finally: a raise inside leaves sync off", NoSyncWithoutFinally),
    ],
}
