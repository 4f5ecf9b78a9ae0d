"""Persistent ranks (``%distributed start``) through a real Jupyter kernel, as a notebook runs them:
a model built in one cell trains in the next, the stop button, a rank crash and a kernel restart."""

from __future__ import annotations

import time

import psutil
import pytest

from tests.test_launcher_kernel import Kernel


@pytest.fixture
def kernel():
    k = Kernel()
    shown = k.run("%load_ext kit\nimport kit, os, time\n%distributed start 4 --timeout 60")
    assert shown["status"] == "ok" and "4 persistent ranks up" in shown["stdout"], shown
    yield k
    k.stop()


def _rank_pids(k: Kernel) -> list[int]:
    shown = k.run("%%distributed\nos.getpid()")
    return [int(p) for p in shown["results"][0].strip("[]").split(",")]


def _gone(pids: list[int], timeout: float = 10) -> bool:
    procs = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def test_a_model_built_in_one_cell_trains_in_the_next(kernel):
    built = kernel.run("""
        %%distributed
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        type(model).__name__
    """)
    assert built["results"][0].count("DistributedDataParallel") == 4, built
    looked = kernel.run("%%distributed\nlist(model.module.weight.shape)")
    assert looked["results"] == ["[[2, 4], [2, 4], [2, 4], [2, 4]]"], looked
    kernel.run("steps = 3")  # a kernel name set after the start reaches the ranks
    trained = kernel.run("""
        %%distributed
        torch.manual_seed(rank)
        for _ in range(steps):
            loss = model(torch.randn(8, 4)).square().mean()
            opt.zero_grad(); loss.backward(); opt.step()
        round(model.module.weight.sum().item(), 6)
    """)
    values = trained["results"][0].strip("[]").split(",")
    assert len(values) == 4 and len(set(v.strip() for v in values)) == 1, trained  # DDP in sync
    before = kernel.run("%%distributed\ntorch.manual_seed(0)\n"
                        "round(torch.nn.Linear(4, 2).weight.sum().item(), 6)")
    assert values[0].strip() != before["results"][0].strip("[]").split(",")[0].strip()


def _wait_for(paths: list, timeout: float = 60) -> None:
    """Until every rank has written its marker: the cell is running on all of them (however
    loaded the machine), so the interrupt lands inside it."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"the ranks never started the cell: {paths}"
        time.sleep(0.05)
    time.sleep(0.3)


def test_the_stop_button_keeps_state_or_stops_a_blocked_group(kernel, tmp_path):
    pids = _rank_pids(kernel)
    kernel.run("%%distributed\ncounter = 0")
    marks = [tmp_path / f"loop-{r}" for r in range(4)]
    msg_id = kernel.kc.execute(f"%%distributed\nopen(f'{tmp_path}/loop-{{rank}}', 'w').close()\n"
                               "while True:\n    counter += 1\n    time.sleep(0.01)")
    _wait_for(marks)
    kernel.km.interrupt_kernel()
    reply = kernel.reply(msg_id, timeout=60)
    assert reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]
    kept = kernel.run("%%distributed\ncounter > 0")
    if kept["status"] == "aborted":  # ipykernel drops requests queued right after an error
        kept = kernel.run("%%distributed\ncounter > 0")
    assert kept["results"] == ["[True, True, True, True]"], kept
    assert _rank_pids(kernel) == pids  # the same ranks
    # A rank blocked in a collective cannot stop at a Python line: the group is stopped.
    marks = [tmp_path / f"block-{r}" for r in range(4)]
    msg_id = kernel.kc.execute(f"%%distributed --timeout 300\n"
                               f"open(f'{tmp_path}/block-{{rank}}', 'w').close()\n"
                               "if rank == 0:\n    time.sleep(300)\ndist.barrier()")
    _wait_for(marks)
    kernel.km.interrupt_kernel()
    kernel.reply(msg_id, timeout=60)
    assert _gone(pids)
    stopped = kernel.run("%%distributed\nrank")
    if stopped["status"] == "aborted":
        stopped = kernel.run("%%distributed\nrank")
    assert stopped["error"] and "%distributed restart" in stopped["error"]["evalue"], stopped
    again = kernel.run("%distributed restart")
    assert "4 persistent ranks up" in again["stdout"], again
    assert kernel.run("%%distributed\nrank")["results"] == ["[0, 1, 2, 3]"]


def test_a_rank_crash_is_reported_and_restart_is_one_command(kernel):
    pids = _rank_pids(kernel)
    crashed = kernel.run("%%distributed\nif rank == 2:\n    os._exit(7)\ndist.barrier()")
    assert crashed["status"] == "error", crashed
    text = crashed["stdout"] + str(crashed["error"])
    assert "rank 2" in text and "exited with code 7" in text and "restart" in text, text
    assert _gone(pids)
    kernel.run("%distributed restart")
    assert kernel.run("%%distributed\nworld_size")["results"] == ["[4, 4, 4, 4]"]


def test_a_kernel_restart_leaves_no_rank_behind(kernel):
    pids = _rank_pids(kernel)
    assert all(psutil.pid_exists(p) for p in pids)
    kernel.km.restart_kernel(now=True)
    assert _gone(pids, timeout=15)


def test_a_cell_asking_for_another_size_is_told_how(kernel):
    refused = kernel.run("%%distributed -n 2\nrank")
    assert "UsageError" in refused["stderr"] and "--fresh" in refused["stderr"], refused
    fresh = kernel.run("%%distributed -n 2 --fresh\nworld_size")
    assert fresh["results"] == ["[2, 2]"], fresh
    kernel.run("%distributed stop")
    assert kernel.run("%%distributed -n 2\nworld_size")["results"] == ["[2, 2]"]
