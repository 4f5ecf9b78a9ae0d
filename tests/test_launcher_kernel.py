"""kit.launch and %%distributed through a real Jupyter kernel, as a student's notebook runs them.

Each test talks to an IPython kernel over jupyter_client and reads the iopub messages the
notebook would render: rank output must arrive as stdout (nbgrader zeroes a test cell that
writes stderr), errors must be readable, and the stop button must leave no process behind.
"""

from __future__ import annotations

import queue
import textwrap
import threading
import time

import psutil
import pytest
from jupyter_client.manager import start_new_kernel


class Kernel:
    """A started kernel with a helper that runs a cell and collects what the notebook shows."""

    def __init__(self):
        # 180 s: on two cores shared with headless lesson runs a kernel's start once took over 60 s
        self.km, self.kc = start_new_kernel(kernel_name="python3", startup_timeout=180)

    def run(self, code: str, timeout: float = 120) -> dict:
        msg_id = self.kc.execute(textwrap.dedent(code))
        shown = {"stdout": "", "stderr": "", "results": [], "error": None, "status": None}
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty as e:
                raise TimeoutError(f"cell did not finish in {timeout} s: {shown}") from e
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                shown[content["name"]] += content["text"]
            elif kind == "execute_result":
                shown["results"].append(content["data"].get("text/plain", ""))
            elif kind == "error":
                shown["error"] = content
            elif kind == "status" and content["execution_state"] == "idle":
                break
        shown["status"] = self.reply(msg_id, timeout)["content"]["status"]
        return shown

    def reply(self, msg_id: str, timeout: float) -> dict:
        """The shell reply to ``msg_id``. Replies to other requests are skipped: on a loaded
        machine ``wait_for_ready`` sends a kernel_info request every second until one is answered,
        and the extra replies ({"status": "ok"}) wait on the shell channel ahead of ours."""
        deadline = time.monotonic() + timeout
        while True:
            reply = self.kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid

    def stop(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture
def kernel():
    k = Kernel()
    k.run("import kit, torch, torch.distributed as dist, os, sys, time")
    yield k
    k.stop()


def test_a_stale_shell_reply_is_not_read_as_the_cells(kernel):
    # What a slow kernel start leaves behind (wait_for_ready's repeated kernel_info requests):
    # a reply the cell's own must not be confused with, or a failing cell reads as "ok".
    kernel.kc.kernel_info()
    shown = kernel.run("1 / 0")
    assert shown["status"] == "error" and shown["error"]["ename"] == "ZeroDivisionError"


def test_rank_output_is_labelled_stdout_with_no_stderr_in_the_cell(kernel):
    shown = kernel.run("""
        def talk():
            print(f"hello from {dist.get_rank()}")
            print("a warning", file=sys.stderr)
            os.write(2, b"from C++\\n")
            return dist.get_rank()
        kit.launch(talk, world_size=4)
    """)
    assert shown["status"] == "ok"
    assert shown["stderr"] == ""
    for r in range(4):
        assert f"[rank {r}] hello from {r}" in shown["stdout"]
        assert f"[rank {r}] a warning" in shown["stdout"]
        assert f"[rank {r}] from C++" in shown["stdout"]
    assert shown["results"] == ["[0, 1, 2, 3]"]


def test_crashing_rank_shows_one_readable_error(kernel):
    shown = kernel.run("""
        def crash():
            if dist.get_rank() == 1:
                raise ValueError("shard 1 is empty")
            time.sleep(60)
        kit.launch(crash, world_size=3)
    """)
    assert shown["status"] == "error"
    err = shown["error"]
    assert err["ename"] == "LaunchError"
    text = "\n".join(err["traceback"])
    assert "rank 1 of 3 failed" in text and "ValueError: shard 1 is empty" in text
    assert "def crash" not in text or "crash" in text
    assert "_supervise" not in text  # launcher internals are hidden from the student
    assert shown["stderr"] == ""


def test_hang_is_diagnosed_in_the_cell(kernel):
    shown = kernel.run("""
        def skip():
            t = torch.ones(1)
            if dist.get_rank() != 0:
                dist.all_reduce(t)
        kit.launch(skip, world_size=2, timeout=3)
    """)
    text = "\n".join(shown["error"]["traceback"])
    assert shown["error"]["ename"] == "LaunchTimeout"
    assert "waiting in all_reduce" in text and "rank 0 already returned" in text
    assert "dist.all_reduce(t)" in text  # the notebook line, read from the cell's source


def test_spawn_runs_a_notebook_defined_function(kernel):
    shown = kernel.run("""
        scale = 7
        def notebook_fn(x):
            return (dist.get_rank() + 1) * x * scale
        list(kit.launch(notebook_fn, 2, world_size=2, start_method="spawn"))
    """)
    assert shown["status"] == "ok", shown
    assert shown["results"] == ["[14, 28]"]
    assert shown["stderr"] == ""


def test_distributed_magic_runs_cell_on_ranks_and_returns_last_expression(kernel):
    kernel.run("%load_ext kit")
    kernel.run("base = 10")
    shown = kernel.run("""
        %%distributed -n 4
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        print("sum", t.item())
        base + rank * world_size
    """)
    assert shown["status"] == "ok", shown
    assert "[rank 3] sum 6.0" in shown["stdout"]
    assert shown["results"] == ["[10, 14, 18, 22]"]
    assert kernel.run("'t' in dir()")["results"] == ["False"]  # rank variables do not come back


def test_distributed_magic_error_points_at_the_cell_line(kernel):
    kernel.run("%load_ext kit")
    shown = kernel.run("""
        %%distributed -n 2 --timeout 20
        x = 1
        if rank == 1:
            raise RuntimeError("only rank 1 breaks")
    """)
    text = "\n".join(shown["error"]["traceback"])
    assert "only rank 1 breaks" in text and 'raise RuntimeError("only rank 1 breaks")' in text
    assert "line 3" in text


def test_distributed_magic_stores_result_with_out(kernel):
    kernel.run("%load_ext kit")
    kernel.run("""
        %%distributed -n 2 --out res
        print("hi")
    """)
    shown = kernel.run("res.outputs, list(res)")
    assert shown["results"] == ["(['hi\\n', 'hi\\n'], [None, None])"]


def test_interrupt_leaves_no_process_and_next_launch_works(kernel):
    msg_id = kernel.kc.execute(textwrap.dedent("""
        def forever():
            print("started", os.getpid(), flush=True)
            time.sleep(300)
        kit.launch(forever, world_size=4, timeout=600)
    """))
    kernel_proc = psutil.Process(kernel.pid)
    deadline = time.monotonic() + 60
    while len(kernel_proc.children(recursive=True)) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    ranks = kernel_proc.children(recursive=True)
    assert len(ranks) >= 4
    time.sleep(0.5)
    kernel.km.interrupt_kernel()  # the notebook's stop button
    reply = kernel.reply(msg_id, timeout=60)
    assert (
        reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    )
    gone, alive = psutil.wait_procs(ranks, timeout=5)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    shown = kernel.run("list(kit.launch(lambda: dist.get_rank(), world_size=2))")
    if shown["status"] == "aborted":  # ipykernel drops requests queued right after an error
        shown = kernel.run("list(kit.launch(lambda: dist.get_rank(), world_size=2))")
    assert shown["results"] == ["[0, 1]"], shown


def test_four_kernels_launching_at_once():
    kernels = [Kernel() for _ in range(4)]
    try:
        results: dict[int, dict] = {}

        def go(i: int) -> None:
            results[i] = kernels[i].run("""
                import kit, torch, torch.distributed as dist
                def f():
                    t = torch.ones(1) * (dist.get_rank() + 1)
                    dist.all_reduce(t)
                    return t.item()
                list(kit.launch(f, world_size=4, timeout=120))
            """, timeout=240)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(results[i]["results"] == ["[10.0, 10.0, 10.0, 10.0]"] for i in range(4)), results
    finally:
        for k in kernels:
            k.stop()
