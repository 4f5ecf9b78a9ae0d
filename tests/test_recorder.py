"""kit.recorder sees every route to the wire, below Python, and looks like plain gloo.

A failure here means a check could be fooled by calling a collective another way (a name
imported before tracing, a ProcessGroup method, a functional collective, torch's DDP), or that
Lesson 04's timeline would miss torch DDP's buckets.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import all_reduce as early_all_reduce  # bound before any tracing

from kit.trace import launch_traced, trace


def _every_route():
    import torch.distributed._functional_collectives as fc

    world = dist.group.WORLD
    t = torch.ones(8)  # 32 bytes
    early_all_reduce(t)
    world.allreduce([t]).wait()
    fc.all_reduce(torch.ones(8), "sum", world).wait()
    gathered = fc.all_gather_tensor(torch.ones(4), 0, world)
    torch.ops._c10d_functional.wait_tensor(gathered)
    out = torch.empty(4 * dist.get_world_size())
    dist.all_gather_into_tensor(out, torch.ones(4))
    sub = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(2), group=sub)
    return dist.get_backend(), dist.get_backend(sub), float(t[0])


def test_every_route_is_recorded_and_the_backend_still_says_gloo():
    result = launch_traced(_every_route, world_size=2, echo=False)
    assert [r[:2] for r in result] == [("gloo", "gloo")] * 2
    assert result[0][2] == 4.0  # two all-reduces of ones on two ranks
    ops = [(e.op, e.route) for e in result.events[0]]
    assert ops[:2] == [("all_reduce", "dist"), ("all_reduce", "pg")]
    assert ("all_reduce", "functional") in ops
    assert any(op.startswith("all_gather") and route == "functional" for op, route in ops)
    assert ("all_gather_into_tensor", "dist") in ops
    assert ops[-1] == ("all_reduce", "dist") and result.events[0][-1].group_size == 2


def _ddp_step():
    # Two 1.6 MB layers, 1 MB buckets: DDP closes a bucket once it reaches the cap, so two.
    model = torch.nn.Sequential(torch.nn.Linear(640, 640), torch.nn.Linear(640, 640))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    for _ in range(2):  # the second step rebuilds the buckets in the order gradients arrived
        ddp(torch.randn(3, 640)).sum().backward()
    with trace() as t:
        ddp(torch.randn(3, 640)).sum().backward()
    return [e.to_dict() for e in t.events]


def test_torch_ddp_bucket_all_reduces_are_seen_from_its_cpp_reducer():
    result = launch_traced(_ddp_step, world_size=2, echo=False)
    buckets = [e for e in result[0] if e["op"] == "all_reduce"]
    assert len(buckets) >= 2
    assert all(e["route"] == "c++" and e["async_op"] for e in buckets)
    params = 2 * (640 * 640 + 640)
    assert sum(e["nbytes"] for e in buckets) == params * 4


def _blocking_and_async():
    t = torch.ones(4)
    with trace() as tr:
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
        dist.isend(t, 1 - dist.get_rank()).wait() if dist.get_rank() == 0 else \
            dist.irecv(t, 0).wait()
    return [(e.op, e.async_op) for e in tr.events]


def test_async_flag_is_what_the_caller_asked_for():
    result = launch_traced(_blocking_and_async, world_size=2, echo=False)
    assert list(result) == [[("all_reduce", False), ("all_reduce", True), ("isend", True)],
                            [("all_reduce", False), ("all_reduce", True), ("irecv", True)]]


def test_without_a_tracer_nothing_is_recorded_and_values_are_gloos():
    def run():
        t = torch.arange(4.0) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        return t

    from kit import launch

    got = launch(run, world_size=3)
    assert all(torch.equal(g, torch.arange(4.0) * 6) for g in got)
