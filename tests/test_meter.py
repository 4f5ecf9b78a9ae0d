"""kit.meter counts what torch's CPU allocator hands out, wherever the tensor is kept.

A failure here means a memory bound of Lessons 05-13 could be met by hiding a tensor from the
meter (in the autograd graph, on an object, in C++), that the numbers a rank reports are not its
own, or that the meter writes to stderr (nbgrader scores such a cell 0).
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
import warnings

import pytest
import torch
import torch.distributed as dist

from kit import meter
from kit.launcher import launch

MiB = 1 << 20
SLACK = 4096  # a few KiB: the scalars and small bookkeeping tensors torch adds around an op


def mib(n: int) -> torch.Tensor:
    return torch.empty(n * MiB, dtype=torch.uint8)


def test_a_tensor_saved_for_backward_counts_as_alive():
    x = torch.randn(MiB // 4, requires_grad=True)  # 1 MiB, allocated before the track
    with meter.track() as usage:
        loss = x.exp().sum()  # exp saves its 1 MiB output for backward; only the graph holds it
        usage.mark("graph built")
        del loss
    with torch.no_grad(), meter.track() as no_graph:
        x.exp().sum()
        no_graph.mark("no graph")
    assert MiB <= usage.marks["graph built"] < MiB + SLACK
    assert no_graph.marks["no graph"] < SLACK  # the same ops free the output when no graph keeps it
    assert usage.alive == 0  # dropping the loss frees the graph and what it saved


def _closure_over(tensor: torch.Tensor):
    return lambda: tensor.numel()


def test_tensors_kept_on_an_object_in_a_list_or_in_a_closure_count_as_alive():
    holder, box = types.SimpleNamespace(), []
    with meter.track() as usage:
        holder.tensor = mib(1)
        box.append(mib(2))
        closure = _closure_over(mib(3))  # only the closure's cell refers to it
    assert usage.alive == 6 * MiB
    assert (usage.count, usage.largest) == (3, 3 * MiB)
    assert closure() == 3 * MiB


def test_a_buffer_torch_allocates_in_cpp_counts():
    a = mib(1)
    with meter.track() as usage:
        joined = torch.cat([a, a])  # the 2 MiB output is allocated inside aten::cat
    assert usage.alive == 2 * MiB and joined.numel() == 2 * MiB


def test_a_distributed_checkpoint_load_counts_its_read_buffer(tmp_path):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"w": torch.randn(MiB // 4)}, checkpoint_id=tmp_path)
        target = {"w": torch.zeros(MiB // 4)}
        with meter.track() as usage:
            dcp.load(target, checkpoint_id=tmp_path)
    assert usage.peak >= MiB  # the tensor read from the file before it is copied in place
    assert usage.alive < SLACK and target["w"].abs().sum() > 0


def test_freeing_a_tensor_reduces_alive_and_an_older_tensor_is_ignored():
    older = mib(4)
    with meter.track() as usage:
        a, b = mib(1), mib(2)
        del a, older  # older was allocated before the track: its free is not counted
    assert usage.alive == 2 * MiB and b.numel() == 2 * MiB
    assert usage.peak == 3 * MiB


def test_peak_counts_a_temporary_freed_inside_the_block():
    x = torch.randn(MiB)  # 4 MiB
    with meter.track() as usage:
        total = (x * 2).sum()  # the 4 MiB product lives only inside this line
    assert 4 * MiB <= usage.peak < 4 * MiB + SLACK
    assert usage.alive < SLACK and total.numel() == 1


def test_marks_give_bytes_alive_and_the_peak_since_the_previous_mark():
    with meter.track() as usage:
        a = mib(1)
        usage.mark("one")
        temporary = mib(4)
        del temporary
        b = mib(2)
        usage.mark("two")
        del a  # allocated before the mark: its free is matched across the profiler's windows
        usage.mark("three")
    assert usage.marks == {"one": MiB, "two": 3 * MiB, "three": 2 * MiB}
    assert usage.peaks == {"one": MiB, "two": 5 * MiB, "three": 3 * MiB}
    assert (usage.peak, usage.alive) == (5 * MiB, 2 * MiB) and b.numel() == 2 * MiB


def test_usage_as_dict_is_plain_data():
    with meter.track() as usage:
        kept = mib(1)
        usage.mark("kept")
    data = usage.as_dict()
    assert json.loads(json.dumps(data)) == data
    assert data == {"peak": MiB, "alive": MiB, "largest": MiB, "count": 1,
                    "marks": {"kept": MiB}, "peaks": {"kept": MiB}} and kept.numel() == MiB


def test_a_mark_needs_a_new_name_and_a_running_block():
    with meter.track() as usage:
        usage.mark("step")
        with pytest.raises(ValueError, match="already has a mark named 'step'"):
            usage.mark("step")
    with pytest.raises(RuntimeError, match="outside its `with meter.track"):
        usage.mark("late")


def test_a_nested_track_raises_an_error_naming_the_problem():
    with meter.track() as outer:
        with pytest.raises(RuntimeError, match="Tracks do not nest"):
            with meter.track():
                pass
        kept = mib(1)
    assert outer.alive == MiB and kept.numel() == MiB
    with torch.profiler.profile(), pytest.raises(RuntimeError, match="already running"):
        with meter.track():
            pass


def test_an_exception_in_the_block_propagates_and_the_profiler_stops():
    level = meter._c10_log_level()
    before = level.value
    with pytest.raises(KeyError, match="boom"):
        with meter.track() as usage:
            kept = mib(1)
            raise KeyError("boom")
    assert not torch._C._autograd._profiler_enabled()
    assert level.value == before  # c10's log level is back to what it was
    assert usage.alive == MiB and kept.numel() == MiB
    with meter.track() as again:  # and a new track starts cleanly
        kept = mib(2)
    assert again.alive == 2 * MiB


def test_the_idle_meter_installs_nothing():
    # Nothing runs per op unless a block is open: no profiler, no mode, no Python hook, and
    # c10's log level (lowered while a track runs) is back where it was.
    level_before = meter._c10_log_level().value
    with meter.track():
        pass
    with meter.count_flops():
        pass
    assert not torch._C._autograd._profiler_enabled()
    assert torch._C._len_torch_dispatch_stack() == 0 and torch._C._len_torch_function_stack() == 0
    assert sys.getprofile() is None
    assert meter._c10_log_level().value == level_before


STDERR_SCRIPT = """
import sys, torch
from kit import meter
older = torch.empty(1 << 20)  # freed inside the block: the reporter's "unknown size" case
with meter.track() as usage:
    del older
    kept = torch.cat([torch.ones(8), torch.ones(8)])
    usage.mark("after cat")
print("the profiler alone:", file=sys.stderr, flush=True)
olders = [torch.empty(8) for _ in range(2000)]
with torch.profiler.profile(profile_memory=True):
    del olders[:]
"""


def test_nothing_reaches_stderr_even_when_an_older_tensor_is_freed():
    # A fresh process: the reporter warns at its first unknown free, then at every 1000th.
    run = subprocess.run([sys.executable, "-c", STDERR_SCRIPT], capture_output=True, text=True,
                         timeout=60)
    metered, alone = run.stderr.split("the profiler alone:\n")
    assert metered == ""
    assert "Memory block of unknown size" in alone and "profiler_start" in alone  # what it hid


def test_what_others_write_to_stderr_while_the_profiler_starts_is_kept(capfd):
    import os
    import tempfile

    def start() -> None:
        os.write(
            2, b"USDT:2026-01-01 00:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
        )
        os.write(2, b"a rank's own line\n")

    with tempfile.TemporaryFile(buffering=0) as spool:
        meter._quiet(spool, start)
    assert capfd.readouterr().err == "a rank's own line\n"


def _rank_usage() -> dict:
    rank = dist.get_rank()
    x = torch.full((MiB // 4,), float(rank))  # 1 MiB, allocated before the tracks
    with meter.track() as own:
        kept = mib(rank + 1)
    with meter.track() as gathered:
        outputs = [torch.empty(MiB // 4) for _ in range(dist.get_world_size())]
        dist.all_gather(outputs, x)  # gloo flattens the outputs into one buffer on its own thread
    assert kept.numel() == (rank + 1) * MiB and float(outputs[1][0]) == 1.0
    return {"own": own.as_dict(), "gathered": gathered.as_dict()}


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return list(launch(_rank_usage, world_size=2, timeout=60))


def test_each_rank_reports_its_own_bytes_under_launch(per_rank):
    for rank, usage in enumerate(per_rank):
        own = usage["own"]
        assert (rank + 1) * MiB <= own["alive"] <= own["peak"] < (rank + 1) * MiB + SLACK


def test_the_flattened_buffer_of_a_gloo_collective_counts(per_rank):
    for usage in per_rank:
        gathered = usage["gathered"]
        assert gathered["largest"] == 2 * MiB  # no output is bigger than 1 MiB: the flat buffer
        assert 2 * MiB <= gathered["alive"] < 2 * MiB + SLACK
        assert 4 * MiB <= gathered["peak"] < 4 * MiB + SLACK


def test_a_matmul_counts_2mnk_flops():
    m, k, n = 8, 16, 32
    with meter.count_flops() as flops:
        torch.randn(m, k) @ torch.randn(k, n)
    assert flops.total == 2 * m * n * k
    assert flops.by_op == {"aten.mm": 2 * m * n * k}
    assert flops.as_dict() == {"total": 2 * m * n * k, "by_op": {"aten.mm": 2 * m * n * k}}


def test_a_linear_forward_and_backward_count_three_times_the_forward():
    linear = torch.nn.Linear(16, 32)
    x = torch.randn(8, 16, requires_grad=True)
    with meter.count_flops() as forward:
        linear(x)
    with meter.count_flops() as step:
        linear(x).sum().backward()
    assert forward.total == 2 * 8 * 16 * 32
    assert step.total == 3 * forward.total
