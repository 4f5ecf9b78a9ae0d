"""kit.launch from plain Python: results, environment, failures, hangs, validation, leaks.

The same behaviours are proven through a real Jupyter kernel in test_launcher_kernel.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import kit
from kit.launcher import LaunchError, LaunchTimeout, run_ranks


def _rank_info():
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: os.environ.get(k) for k in keys}
    return env, dist.get_rank(), dist.get_world_size(), dist.get_backend()


def test_returns_every_rank_value_in_rank_order():
    def square_sum():
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return dist.get_rank() ** 2, t.item()

    result = kit.launch(square_sum, world_size=4)
    assert list(result) == [(0, 6.0), (1, 6.0), (4, 6.0), (9, 6.0)]
    assert len(result.durations) == 4 and all(d >= 0 for d in result.durations)
    assert result.start_method == "fork"


def test_args_and_kwargs_reach_fn():
    result = kit.launch(lambda a, b=0: a * dist.get_rank() + b, 10, b=1, world_size=3)
    assert list(result) == [1, 11, 21]


def test_ranks_get_torchrun_environment_and_initialised_group():
    result = kit.launch(_rank_info, world_size=3)
    ports = {r[0]["MASTER_PORT"] for r in result}
    assert len(ports) == 1 and ports.pop().isdigit()
    for rank, (env, group_rank, group_size, backend) in enumerate(result):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert (group_rank, group_size, backend) == (rank, 3, "gloo")


def test_each_launch_gets_its_own_os_chosen_port():
    ports = {kit.launch(lambda: os.environ["MASTER_PORT"], world_size=1)[0] for _ in range(3)}
    assert len(ports) == 3


def test_kernel_environment_and_signal_handlers_are_untouched():
    env_before = dict(os.environ)
    handlers = {
        s: signal.getsignal(s)
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGCHLD)
    }
    kit.launch(lambda: os.environ["RANK"], world_size=2)
    with pytest.raises(LaunchError):
        kit.launch(lambda: 1 / 0, world_size=2)
    assert dict(os.environ) == env_before
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    assert not dist.is_initialized()  # the kernel itself never joins the group


def test_group_is_destroyed_after_fn_even_on_error(tmp_path, monkeypatch):
    marker = tmp_path / "destroyed"
    original = dist.destroy_process_group

    def recording_destroy(*a, **k):
        with open(marker, "a") as f:
            f.write(f"{dist.get_rank()}\n")
        return original(*a, **k)

    monkeypatch.setattr(dist, "destroy_process_group", recording_destroy)  # inherited by fork
    kit.launch(lambda: None, world_size=2)
    assert sorted(marker.read_text().split()) == ["0", "1"]
    marker.unlink()

    def fail_on_rank_1():
        if dist.get_rank() == 1:
            raise ValueError("boom")
        return 0

    with pytest.raises(LaunchError):
        kit.launch(fail_on_rank_1, world_size=2)
    assert "1" in marker.read_text().split()


def test_output_is_labelled_by_rank_and_captured(capsys):
    def talk():
        print(f"hello from {dist.get_rank()}")
        print("to stderr", file=sys.stderr)
        os.write(2, b"from C level\n")
        return None

    result = kit.launch(talk, world_size=2)
    out, err = capsys.readouterr()
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
    assert (
        "[rank 1] to stderr" in err and "[rank 0] from C level" in err
    )  # terminal: stderr stays stderr
    assert "hello from 1" in result.outputs[1] and "from C level" in result.outputs[1]


def test_echo_false_keeps_output_off_the_terminal(capsys):
    result = run_ranks(lambda: print("quiet"), world_size=2, echo=False)
    out, err = capsys.readouterr()
    assert "quiet" not in out + err
    assert result.outputs == ["quiet\n", "quiet\n"]


# ----------------------------------------------------------------------------- failures


def _sleep_except(rank_to_fail, how):
    def fn():
        if dist.get_rank() == rank_to_fail:
            how()
        time.sleep(60)  # the others would hang here without the launcher stopping them

    return fn


def _raise():
    raise ValueError("bad shard")


def _segfault():
    import ctypes

    ctypes.string_at(0)


FAILURES = {
    "exception": (_raise, "raised ValueError: bad shard"),
    "sys.exit(3)": (lambda: sys.exit(3), "called sys.exit(3)"),
    "os._exit(7)": (lambda: os._exit(7), "exited with code 7 without returning"),
    "SIGKILL": (lambda: os.kill(os.getpid(), signal.SIGKILL), "killed by signal SIGKILL"),
    "segfault": (_segfault, "killed by signal SIGSEGV"),
}


@pytest.mark.parametrize("kind", list(FAILURES))
def test_rank_failure_stops_all_ranks_within_5_s(kind):
    how, expected = FAILURES[kind]
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        kit.launch(_sleep_except(2, how), world_size=4, timeout=60)
    err = info.value
    # From the failure to the error in the cell: the others were stopped, not waited for.
    stopped_after = time.monotonic() - start - err.failures[0].after_s
    assert stopped_after < 5, f"other ranks kept running for {stopped_after:.1f} s"
    assert [f.rank for f in err.failures if not f.consequence] == [2]
    assert str(err).startswith("rank 2 of 4 failed")
    assert expected in str(err)
    # A peer still finishing gloo's handshake may notice rank 2 vanish before it is stopped.
    echoed = {f.rank for f in err.failures if f.consequence}
    stopped = [r for r in (0, 1, 3) if r not in echoed]
    if stopped:
        assert (
            f"{', '.join(map(str, stopped))} {'was' if len(stopped) == 1 else 'were'} stopped"
            in str(err)
        )


def test_exception_traceback_points_at_user_code():
    def broken():
        if dist.get_rank() == 1:
            {}["missing"]  # noqa: B018
        return 1

    with pytest.raises(LaunchError) as info:
        kit.launch(broken, world_size=2)
    text = str(info.value)
    assert "KeyError" in text and 'in broken' in text and '{}["missing"]' in text
    assert "_rank.py" not in text  # the launcher's own frame is not shown


def test_segfault_report_shows_the_rank_stack_not_the_kernel_stack():
    with pytest.raises(LaunchError) as info:
        kit.launch(_sleep_except(1, _segfault), world_size=2)
    text = str(info.value)
    assert "in _segfault" in text and "string_at" in text
    assert "popen_fork" not in text and "run_ranks" not in text


def test_every_failing_rank_is_named():
    def all_fail():
        raise RuntimeError(f"rank {dist.get_rank()} is broken")

    with pytest.raises(LaunchError) as info:
        kit.launch(all_fail, world_size=3)
    assert sorted(info.value.failed_ranks) == [0, 1, 2]
    for r in range(3):
        assert f"rank {r} is broken" in str(info.value)


def test_peer_errors_caused_by_a_failure_are_reported_as_consequences():
    def one_fails():
        if dist.get_rank() == 0:
            raise ValueError("root cause")
        dist.barrier()

    with pytest.raises(LaunchError) as info:
        kit.launch(one_fails, world_size=3)
    text = str(info.value)
    assert text.startswith("rank 0 of 3 failed")
    assert "root cause" in text
    assert "GLHF" not in text  # gloo's long consequence messages are summarised, not dumped


def test_unpicklable_return_value_is_a_clear_error():
    with pytest.raises(LaunchError) as info:
        kit.launch(lambda: threading.Lock(), world_size=1)
    assert "cannot be sent back" in str(info.value)


def test_exit_zero_counts_as_returning_none():
    assert list(kit.launch(lambda: sys.exit(0), world_size=2)) == [None, None]


# ----------------------------------------------------------------------------- hangs


def _skip_on_rank_1():
    """Every rank but 1 all-reduces: rank 1 returns while the others wait in the collective."""
    t = torch.ones(1)
    if dist.get_rank() != 1:
        dist.all_reduce(t)
    return "done"


def test_skipped_collective_times_out_with_diagnosis():
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        kit.launch(_skip_on_rank_1, world_size=4, timeout=3)
    assert time.monotonic() - start < 3 + 4  # timeout + stack collection + teardown
    text = str(info.value)
    assert "waiting in all_reduce" in text
    assert "rank 1 already returned from the function" in text
    assert set(info.value.stacks) == {0, 2, 3}
    assert "dist.all_reduce(t)" in text  # the user's line, with its source
    assert isinstance(info.value, TimeoutError)


def test_deadlock_after_a_rank_returned_is_reported_long_before_the_timeout():
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        kit.launch(_skip_on_rank_1, world_size=3, timeout=120)
    took = time.monotonic() - start
    assert took < 15, f"the deadlock took {took:.1f} s to report"
    text = str(info.value)
    assert text.startswith("Deadlock after "), text[:300]
    assert "ranks 0, 2 are waiting in all_reduce, but rank 1 already returned" in text, text[:600]
    assert set(info.value.stacks) == {0, 2}


def test_a_busy_subgroup_after_a_rank_returned_is_not_a_deadlock():
    def ranks_1_2_keep_reducing():
        group = dist.new_group([1, 2])
        if dist.get_rank() == 0:
            return 0
        t = torch.ones(8_000_000)
        start, more = time.monotonic(), torch.ones(1)
        while more.item():  # long transfers, same line, past the probes
            dist.all_reduce(t, group=group)
            # Ranks 1 and 2 agree on when to stop: each reading its own clock, one of them would
            # reduce once more than the other, a real deadlock the launcher rightly reports.
            more.fill_(time.monotonic() - start < 2.5)
            dist.all_reduce(more, op=dist.ReduceOp.MIN, group=group)
        return 1

    assert kit.launch(ranks_1_2_keep_reducing, world_size=3, timeout=60) == [0, 1, 1]


def test_mismatched_collectives_are_named():
    def mismatch():
        t = torch.ones(1)
        if dist.get_rank() == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, src=1)

    with pytest.raises(LaunchTimeout) as info:
        kit.launch(mismatch, world_size=2, timeout=3)
    text = str(info.value)
    assert "different collectives" in text
    assert "rank 0 in all_reduce" in text and "rank 1 in broadcast" in text


def test_slow_code_outside_collectives_is_told_to_raise_timeout():
    with pytest.raises(LaunchTimeout) as info:
        kit.launch(lambda: time.sleep(30), world_size=2, timeout=1)
    assert "No rank is inside a collective" in str(info.value)
    assert "timeout=" in str(info.value)


# ----------------------------------------------------------------------------- validation


def _children():
    return psutil.Process().children(recursive=True)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(world_size=0), ValueError, "world_size must be an integer >= 1"),
        (dict(world_size=2.0), ValueError, "world_size must be an integer"),
        (dict(backend="bogus"), ValueError, "unknown backend 'bogus'"),
        (dict(backend="nccl"), ValueError, "needs one GPU per rank"),
        (dict(timeout=0), ValueError, "timeout must be a positive"),
        (dict(start_method="thread"), ValueError, "start_method must be"),
    ],
)
def test_invalid_input_fails_before_any_process_starts(kwargs, error, words):
    before = len(_children())
    with pytest.raises(error, match=words):
        kit.launch(lambda: None, **kwargs)
    assert len(_children()) == before


def test_non_callable_is_rejected_with_the_fix():
    with pytest.raises(TypeError, match="needs a function"):
        kit.launch("train")


def test_unpicklable_argument_under_spawn_names_the_argument():
    with pytest.raises(TypeError, match="argument 1 .*cannot be sent to spawned ranks"):
        kit.launch(lambda a, b: None, 1, threading.Lock(), start_method="spawn")


def test_fork_with_cuda_initialised_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is already initialised.*start_method='spawn'"):
        kit.launch(lambda: None, start_method="fork")
    from kit.launcher import default_start_method

    assert default_start_method("gloo") == "spawn"


def test_nccl_ranks_are_spawned_and_never_forked(monkeypatch):
    """Seen on an H200 with torch 2.11: forked NCCL ranks died in torch.cuda.set_device with
    "Cannot re-initialize CUDA in forked subprocess", because the GPU count check had called
    torch.cuda.is_available() (cudaGetDeviceCount) in the parent first."""
    from kit.launcher import default_start_method

    if sys.platform == "linux":
        assert default_start_method("gloo") == "fork"
    assert default_start_method("nccl") == "spawn"

    def driver_touched():
        raise AssertionError("torch.cuda.is_available() initialises CUDA in the kernel")

    monkeypatch.setattr(torch.cuda, "is_available", driver_touched)
    with pytest.raises(ValueError, match="needs one GPU per rank"):  # counted by NVML alone
        kit.launch(lambda: None, world_size=2, backend="nccl")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.distributed, "is_backend_available", lambda backend: True)
    before = len(_children())
    with pytest.raises(ValueError, match="cannot be forked.*start_method='spawn'"):
        kit.launch(lambda: None, world_size=2, backend="nccl", start_method="fork")
    assert len(_children()) == before


# ----------------------------------------------------------------------------- spawn


def test_spawn_runs_lambdas_and_closures():
    offset = 100

    def closure():
        return dist.get_rank() + offset

    assert list(kit.launch(closure, world_size=2, start_method="spawn")) == [100, 101]
    result = kit.launch(lambda x: x * (dist.get_rank() + 1), 3, world_size=2, start_method="spawn")
    assert list(result) == [3, 6] and result.start_method == "spawn"


# ----------------------------------------------------------------------------- leaks


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.slow
def test_50_consecutive_launches_leak_no_process_or_fd():
    kit.launch(lambda: None, world_size=4)  # warm up lazy imports and caches
    fds, procs = _open_fds(), len(_children())
    for i in range(50):
        fn = (lambda: None) if i % 5 else (lambda: 1 / 0)
        try:
            kit.launch(fn, world_size=4)
        except LaunchError:
            pass
    assert len(_children()) == procs
    assert _open_fds() <= fds + 2, f"{_open_fds() - fds} file descriptors leaked"


INTERRUPT_SCRIPT = textwrap.dedent("""
    import faulthandler, os, signal, sys, time
    import torch.distributed as dist
    import kit

    # What a Jupyter kernel does before it runs a cell: SIGINT raises KeyboardInterrupt, whatever
    # disposition the process inherited (a shell's `cmd &` or nohup starts it ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # If this script ever hangs, its own stack reaches the test's report before the test gives up.
    faulthandler.dump_traceback_later(75, exit=True)

    def work(path):
        with open(path + str(dist.get_rank()), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)

    if __name__ == "__main__":
        try:
            kit.launch(work, sys.argv[1], world_size=4, timeout=300)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            # A hang here is reported with every rank's stack after 30 s, within the test's wait.
            print(kit.launch(lambda: dist.get_rank(), world_size=2, timeout=30), flush=True)
""")


def _ignoring_sigint() -> None:  # what `cmd &` in a non-interactive shell, or nohup, hands down
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_interrupt_leaves_no_rank_behind_and_next_launch_works(tmp_path, inherited):
    script = tmp_path / "interrupt.py"
    script.write_text(INTERRUPT_SCRIPT)
    prefix = str(tmp_path / "pid")
    proc = subprocess.Popen([sys.executable, str(script), prefix], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=_ignoring_sigint if inherited == "ignored" else None)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid*"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)  # each rank opens its file, then writes its pid
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    assert len(pids) == 4
    proc.send_signal(signal.SIGINT)  # what the notebook's stop button does to the kernel
    try:
        out, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(
            f"the script did not exit within 90 s of SIGINT\nstdout:\n{out}\nstderr:\n{err}"
        )
    assert "interrupted" in out and "[0, 1]" in out, f"stdout:\n{out}\nstderr:\n{err}"
    time.sleep(0.2)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


IGNORED_SIGINT_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import torch.distributed as dist
    import kit

    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN

    def work(path):
        with open(path + str(dist.get_rank()), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(3)
        return dist.get_rank()

    if __name__ == "__main__":
        print(kit.launch(work, sys.argv[1], world_size=2, timeout=60), flush=True)
        print("disposition", signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)
""")


def test_a_launch_under_an_ignored_sigint_ignores_it_and_cleans_up(tmp_path):
    # With SIGINT ignored there is no interrupt to obey: the launch runs to its end, returns
    # every rank's value, leaves no rank behind and leaves the disposition as it found it.
    script = tmp_path / "ignored.py"
    script.write_text(IGNORED_SIGINT_SCRIPT)
    prefix = str(tmp_path / "pid")
    proc = subprocess.Popen([sys.executable, str(script), prefix], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_ignoring_sigint)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    assert len(pids) == 2
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "[0, 1]" in out and "disposition True" in out, f"stdout:\n{out}\nstderr:\n{err}"
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def test_kernel_death_takes_the_ranks_with_it(tmp_path):
    script = tmp_path / "die.py"
    script.write_text(INTERRUPT_SCRIPT)
    prefix = str(tmp_path / "pid")
    proc = subprocess.Popen([sys.executable, str(script), prefix], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid*"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    proc.kill()  # a kernel restart: SIGKILL, no chance to clean up
    proc.wait()
    def alive(pid: int) -> bool:  # a killed orphan may stay a zombie if PID 1 does not reap
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], [
        (p, psutil.Process(p).status(), psutil.Process(p).ppid()) for p in pids if alive(p)
    ]


def _rank_with_a_worker_then_fail(pid_file):
    import multiprocessing

    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
    worker.start()  # like a DataLoader worker: a child of the rank, holding its pipes
    with open(pid_file + str(dist.get_rank()), "w") as f:
        f.write(str(worker.pid))
    if dist.get_rank() == 1:
        os._exit(3)  # the rank dies; its worker lives on unless the launcher kills the group
    time.sleep(120)


def test_rank_children_do_not_keep_the_launch_alive_or_outlive_it(tmp_path):
    start = time.monotonic()
    with pytest.raises(LaunchError, match="rank 1 of 2 failed"):
        kit.launch(_rank_with_a_worker_then_fail, str(tmp_path / "worker"), world_size=2)
    assert time.monotonic() - start < 10
    pids = [int(p.read_text()) for p in tmp_path.glob("worker*")]
    assert len(pids) == 2
    time.sleep(0.2)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
