"""kit.trace records what ranks really call: op, bytes, order and time, and then steps aside.

Each test launches real gloo ranks (fork, so a few tenths of a second) unless it only needs
synthetic events. A failure here means the timelines of Lessons 01 and 03-05 would lie, or
Lesson 01's "no collectives" check would pass or fail the wrong code.
"""

from __future__ import annotations

import time

import matplotlib
import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from kit.trace import Event, launch_traced, match_messages, plot_timeline, region, summarize, trace

matplotlib.use("Agg")


def _collectives_of_every_kind():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    t = torch.ones(1200)  # (1200,) float32: 4800 bytes, divisible by 2, 3 and 4 ranks
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    out = torch.empty(1200 * world_size)
    dist.all_gather_single(out, t)
    small = torch.empty(1200 // world_size)
    dist.reduce_scatter_single(small, t)
    dist.barrier()
    return rank


def test_each_call_is_one_event_with_op_bytes_and_call_index():
    result = launch_traced(_collectives_of_every_kind, world_size=2, echo=False)
    assert list(result) == [0, 1]
    for rank, events in enumerate(result.events):
        assert [e.op for e in events] == ["all_reduce", "broadcast", "all_gather_single",
                                          "reduce_scatter_single", "barrier"]
        assert [e.index for e in events] == [0, 1, 2, 3, 4]
        assert all(e.rank == rank and e.kind == "collective" and e.group_size == 2 for e in events)
        # nccl-tests sizes: the buffer, the whole gathered output, the whole scattered input
        assert [e.nbytes for e in events] == [4800, 4800, 9600, 4800, 0]
        assert all(e.start <= e.end for e in events)
        assert all(a.end <= b.start for a, b in zip(events, events[1:]))


def _one_all_reduce_per_mesh_axis():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with trace() as t:
        dist.all_reduce(torch.ones(3), group=mesh.get_group("tp"))
        dist.all_reduce(torch.ones(5), group=mesh.get_group("dp"))
        dist.all_reduce(torch.ones(7))
    return [(e.nbytes, e.group_ranks) for e in t.events]


def test_each_event_names_the_global_ranks_of_its_group_so_mesh_axes_tell_apart():
    # Both axes of a (2, 2) mesh are groups of size 2: only their ranks say which axis it was.
    result = launch_traced(_one_all_reduce_per_mesh_axis, world_size=4, echo=False)
    for rank, seen in enumerate(result):
        tp = tuple(range(rank // 2 * 2, rank // 2 * 2 + 2))  # rows of arange(4).view(2, 2)
        dp = (rank % 2, rank % 2 + 2)  # columns
        assert seen == [(12, tp), (20, dp), (28, (0, 1, 2, 3))], (rank, seen)
    assert {e.group_ranks for e in result.events[3]} == {(2, 3), (1, 3), (0, 1, 2, 3)}


def _object_collective():
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"rank": dist.get_rank(), "pad": "x" * 100})
    return everyone


def test_object_collective_is_one_event_counting_its_inner_tensor_bytes():
    result = launch_traced(_object_collective, world_size=2, echo=False)
    events = result.events[0]
    assert [e.op for e in events] == ["all_gather_object"]  # the inner all_gathers fold into it
    assert events[0].nbytes > 2 * 100  # two pickled dicts of 100+ characters went round


def _late_sender():
    rank = dist.get_rank()
    t = torch.zeros(10)
    if rank == 0:
        time.sleep(0.3)
        dist.isend(torch.ones(10), 1).wait()
    else:
        handle = dist.irecv(t, 0)
        handle.wait()
    return t.sum().item()


def test_async_receive_ends_when_wait_returns_not_when_posted():
    result = launch_traced(_late_sender, world_size=2, echo=False)
    assert result[1] == 10.0
    (recv,) = result.events[1]
    (send,) = result.events[0]
    assert recv.op == "irecv" and recv.async_op and recv.peer == 0
    assert send.op == "isend" and send.peer == 1 and send.nbytes == 40
    assert recv.end >= send.start  # the data could not arrive before it was sent
    assert recv.duration >= 0.2  # posted at once, completed only after the 0.3 s sleep


def _batched_ring():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine, theirs = torch.full((4,), float(rank)), torch.empty(4)
    ops = [dist.P2POp(dist.isend, mine, (rank + 1) % world_size),
           dist.P2POp(dist.irecv, theirs, (rank - 1) % world_size)]
    for handle in dist.batch_isend_irecv(ops):
        handle.wait()
    return theirs[0].item()


def test_batch_isend_irecv_records_every_message_with_its_peer():
    result = launch_traced(_batched_ring, world_size=3, echo=False)
    assert list(result) == [2.0, 0.0, 1.0]  # P2POps built before tracing still work
    for rank, events in enumerate(result.events):
        assert [(e.op, e.peer) for e in events] == [("isend", (rank + 1) % 3),
                                                    ("irecv", (rank - 1) % 3)]
    assert len(match_messages(result.events)) == 3


def _p2p_only():
    rank = dist.get_rank()
    t = torch.ones(3)
    if rank == 0:
        dist.send(t, 1)
    else:
        dist.recv(t)  # any source: the tracer learns the sender from recv's return value
    return None


def test_point_to_point_code_reports_no_collectives_and_knows_any_source_sender():
    with_collective = launch_traced(_collectives_of_every_kind, world_size=2, echo=False)
    only_p2p = launch_traced(_p2p_only, world_size=2, echo=False)
    assert [e.op for e in only_p2p.events[1]] == ["recv"]
    assert only_p2p.events[1][0].peer == 0
    assert all(e.kind == "p2p" for lane in only_p2p.events for e in lane)
    assert any(e.kind == "collective" for e in with_collective.events[0])


def test_tracing_patches_no_torch_distributed_function_and_restores_wait():
    # The recorder sits below Python (kit/recorder.py): names bound before tracing are seen too.
    before = {name: getattr(dist, name) for name in ("all_reduce", "send", "isend", "barrier")}
    wait = torch._C._distributed_c10d.Work.wait
    with trace():
        assert {name: getattr(dist, name) for name in before} == before
        assert c10d.all_reduce is dist.all_reduce
        assert torch._C._distributed_c10d.Work.wait is not wait  # times async operations
    assert torch._C._distributed_c10d.Work.wait is wait


def test_nested_tracers_both_see_calls_and_recording_ends_with_the_outer():
    from kit import recorder

    with trace() as outer:
        with trace() as inner, region("inner-work"):
            pass
        assert recorder.observers  # the outer one is still active
        with region("outer-work"):
            pass
    assert not recorder.observers
    assert [e.op for e in inner.events] == ["inner-work"]
    assert [e.op for e in outer.events] == ["inner-work", "outer-work"]
    assert all(e.kind == "region" for e in outer.events)


def test_launch_traced_works_with_spawned_ranks():
    result = launch_traced(_collectives_of_every_kind, world_size=2, start_method="spawn",
                           echo=False, timeout=120)
    assert result.start_method == "spawn"
    assert [e.op for e in result.events[1]][:2] == ["all_reduce", "broadcast"]


def _event(rank, index, op, peer, start):
    return Event(rank, index, op, "p2p", 8, start, start + 1, peer=peer)


def test_match_messages_pairs_the_kth_send_with_the_kth_receive():
    events = [[_event(0, 0, "send", 1, 0.0), _event(0, 1, "send", 1, 2.0)],
              [_event(1, 0, "recv", 0, 0.5), _event(1, 1, "recv", 0, 2.5)]]
    pairs = match_messages(events)
    assert [(s.start, r.start) for s, r in sorted(pairs, key=lambda p: p[0].start)] == [
        (0.0, 0.5), (2.0, 2.5)]


def test_summarize_adds_calls_bytes_and_seconds_per_op():
    events = [_event(0, 0, "send", 1, 0.0), _event(0, 1, "send", 1, 2.0)]
    assert summarize(events) == {"send": {"calls": 2, "bytes": 16, "seconds": 2.0}}


def test_timeline_draws_one_lane_per_rank_and_a_bar_per_event():
    result = launch_traced(_collectives_of_every_kind, world_size=3, echo=False)
    ax = plot_timeline(result.events, title="t")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]
    assert len(ax.patches) == sum(len(lane) for lane in result.events)
    with pytest.raises(ValueError, match="unit"):
        plot_timeline(result.events, unit="s")
