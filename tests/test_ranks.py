"""kit.Ranks: persistent ranks keep their state and group between calls, and every way a call can
end (an error on every rank, a crash, a hang, a deadlock, the stop button) leaves the group either
whole and checked, or stopped with nothing left running and a one-call restart."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

import kit
from kit.ranks import Ranks, RanksStopped


def _build():
    import torch
    import torch.distributed as dist

    from kit.ranks import state

    state["w"] = torch.full((3,), float(dist.get_rank()))
    state["pid"] = os.getpid()
    return dist.get_rank()


def _step(scale):
    import torch.distributed as dist

    from kit.ranks import state

    dist.all_reduce(state["w"])
    return state["w"].tolist(), state["pid"] == os.getpid(), scale


def _raise_everywhere():
    import torch.distributed as dist

    raise ValueError(f"bad shape on rank {dist.get_rank()}")


def _crash_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _skip_barrier_on_0():
    import torch.distributed as dist

    if dist.get_rank() != 0:
        dist.barrier()


def _sleep_loop(marker):
    import torch.distributed as dist

    from kit.ranks import state

    state["steps"] = 0
    with open(f"{marker}.{dist.get_rank()}", "w"):
        pass
    while True:  # a Python loop: the interrupt lands between two of its lines
        state["steps"] += 1
        time.sleep(0.01)


def _steps():
    from kit.ranks import state

    return state["steps"] > 0


def _alive(pids):
    return [p for p in pids if psutil.pid_exists(p)
            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.fixture
def ranks():
    group = Ranks(4, timeout=30, echo=False)
    yield group
    group.stop()


def test_state_and_process_group_live_on_between_calls(ranks):
    pids = ranks.pids
    assert list(ranks.run(_build)) == [0, 1, 2, 3]
    first = ranks.run(_step, 1)
    second = ranks.run(_step, 2)
    assert [v[0] for v in first] == [[6.0] * 3] * 4  # 0+1+2+3
    assert [v[0] for v in second] == [[24.0] * 3] * 4  # the same tensors, reduced again
    assert all(v[1] for v in second) and ranks.pids == pids  # the same processes


def test_world_size_one_runs_collectives(tmp_path):
    assert kit.Ranks is Ranks
    with Ranks(1, echo=False) as one:
        assert list(one.run(_build)) == [0]
        assert one.run(_step, 3)[0][0] == [0.0] * 3


def test_an_error_on_every_rank_keeps_the_state_after_a_barrier_check(ranks):
    ranks.run(_build)
    with pytest.raises(kit.LaunchError) as err:
        ranks.run(_raise_everywhere)
    text = str(err.value)
    assert "ValueError: bad shape on rank" in text and "test_ranks.py" in text, text
    assert "still up and keep their state" in text
    assert ranks.alive
    assert ranks.run(_step, 1)[0][0] == [6.0] * 3


def test_a_crashed_rank_stops_the_group_and_restart_brings_it_back(ranks):
    pids = ranks.pids
    ranks.run(_build)
    with pytest.raises(kit.LaunchError) as err:
        ranks.run(_crash_rank_1)
    text = str(err.value)
    assert "rank 1" in text and "exited with code 3" in text, text
    assert "restart" in text and "not running" in text
    assert not ranks.alive and not _alive(pids)
    with pytest.raises(RanksStopped, match="restart"):
        ranks.run(_build)
    ranks.restart()
    assert list(ranks.run(_build)) == [0, 1, 2, 3] and ranks.restarts == 1


def test_a_deadlock_is_named_at_once_and_the_group_stopped(ranks):
    pids = ranks.pids
    started = time.monotonic()
    with pytest.raises(kit.LaunchTimeout) as err:
        ranks.run(_skip_barrier_on_0)
    assert time.monotonic() - started < 15  # the deadlock probe, not the 30 s timeout
    text = str(err.value)
    assert "barrier" in text and "rank 0" in text and "_skip_barrier_on_0" in text, text
    assert not ranks.alive and not _alive(pids)
    ranks.restart()
    assert list(ranks.run(_build)) == [0, 1, 2, 3]


def test_interrupt_in_python_keeps_the_state(ranks, tmp_path):
    """The kernel's interrupt is SIGINT to the kernel's process: here, to this process."""
    marker = str(tmp_path / "started")

    def interrupt_when_running():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all(os.path.exists(f"{marker}.{r}") for r in range(4)):
                break
            time.sleep(0.02)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)

    # As in a kernel: SIGINT raises KeyboardInterrupt (a test runner's worker may ignore it).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_when_running, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            ranks.run(_sleep_loop, marker)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert ranks.alive
    assert list(ranks.run(_steps)) == [True] * 4  # what the loop did before it stopped is kept


def test_stop_leaves_no_process_and_refuses_later_calls():
    group = Ranks(2, echo=False)
    pids = group.pids
    group.stop()
    group.stop()  # twice is fine
    assert not _alive(pids)
    with pytest.raises(RanksStopped):
        group.run(_build)
