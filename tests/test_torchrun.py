"""kit.torchrun runs real torchrun: one node, a restart after a killed worker, two nodes on
loopback, and it leaves no process behind on a timeout or an interrupt. Also the SLURM template.

Every torchrun start costs seconds on 2 cores, so each real run here proves several things.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kit.torchrun import (
    TorchrunError,
    TorchrunTimeout,
    _failure_summary,
    elastic_run,
    init_process_group_per_attempt,
    torchrun,
    torchrun_command,
    torchrun_nodes,
    write_script,
)

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "slurm" / "train.sbatch"

REPORT = """
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank={os.environ['RANK']} group={os.environ['GROUP_RANK']} "
      f"local={os.environ['LOCAL_RANK']} "
      f"world={os.environ['WORLD_SIZE']} sum={t.item():g}")
dist.destroy_process_group()
"""


def _processes_running(marker: str) -> list[int]:
    """Pids whose command line mentions ``marker`` (a unique script path)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmdline and int(entry) != os.getpid():
                found.append(int(entry))
    return found


def test_single_node_streams_every_worker_line_to_stdout(tmp_path, capfd):
    script = write_script(tmp_path / "report.py", REPORT)
    result = torchrun(script, nproc_per_node=2, timeout=120)
    out, err = capfd.readouterr()
    assert result.returncodes == [0]
    for rank in (0, 1):
        assert f"[default{rank}]:rank={rank} group=0 local={rank} world=2 sum=3" in out
    assert err == ""  # nbgrader zeroes a cell that writes stderr
    assert any("sum=3" in line for line in result.lines)


def test_a_failing_worker_raises_with_the_child_failed_summary_and_its_traceback(tmp_path):
    script = write_script(tmp_path / "fail.py", """
        import os
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def main():
            if os.environ["RANK"] == "1":
                raise ValueError("corrupt shard 17")

        main()
    """)
    with pytest.raises(TorchrunError) as info:
        torchrun(script, nproc_per_node=2, timeout=120, echo=False)
    err = info.value
    assert err.returncodes == [1]
    assert "FAILED" in err.summary and "Root Cause" in err.summary
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)", err.summary)
    assert "corrupt shard 17" in err.summary  # @record put the traceback in the error file
    assert err.summary in str(err)


def test_a_failing_worker_without_record_shows_its_own_last_lines_in_the_error(tmp_path):
    # Without @record the summary says only "exitcode: 1"; the error must quote the worker.
    script = write_script(tmp_path / "fail.py", """
        import os

        print(f"worker {os.environ['RANK']} here")
        if os.environ["RANK"] == "1":
            raise ValueError("corrupt shard 17")
    """)
    with pytest.raises(TorchrunError) as info:
        torchrun(script, nproc_per_node=2, timeout=120, echo=False)
    message = str(info.value)
    assert "corrupt shard 17" not in info.value.summary
    said = message.split("What the failed worker printed last:\n", 1)[1].splitlines()
    assert said and all(line.startswith("[default1]:") for line in said), said
    assert any("ValueError: corrupt shard 17" in line for line in said)


def test_the_agent_restarts_all_workers_after_a_kill_and_the_new_group_connects(tmp_path):
    # Killed on the first attempt; the second attempt must form a fresh group and finish.
    script = write_script(tmp_path / "restart.py", "import os\nimport signal\nimport torch\n"
                          "import torch.distributed as dist\n", init_process_group_per_attempt, """
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        init_process_group_per_attempt("gloo")
        for step in range(4):
            if attempt == "0" and dist.get_rank() == 1 and step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            t = torch.ones(1)
            dist.all_reduce(t)
        print(f"finished rank={dist.get_rank()} attempt={attempt} sum={t.item():g}")
        dist.destroy_process_group()
    """)
    result = torchrun(script, nproc_per_node=2, max_restarts=1, timeout=150, echo=False)
    finished = sorted(re.findall(r"finished rank=\d attempt=\d sum=\d", result.output))
    assert finished == ["finished rank=0 attempt=1 sum=2", "finished rank=1 attempt=1 sum=2"]


def test_two_nodes_meet_at_one_loopback_endpoint(tmp_path):
    script = write_script(tmp_path / "report.py", REPORT)
    result = torchrun_nodes(script, nnodes=2, nproc_per_node=1, timeout=150, echo=False,
                            env={"GLOO_SOCKET_IFNAME": "lo"})
    reports = sorted(
        re.findall(
            r"^\[node (\d)\] \[default0\]:rank=(\d) group=(\d) local=0 world=2 sum=3$",
            result.output,
            re.M,
        )
    )
    # One worker per node; c10d hands out GROUP_RANK by arrival, so only the set is fixed.
    assert len(reports) == 2
    assert {r[1] for r in reports} == {"0", "1"} and {r[2] for r in reports} == {"0", "1"}
    assert all(r[1] == r[2] for r in reports)  # one worker per node: rank == group rank
    assert len(result.commands) == 2
    endpoints = {
        next(a for a in cmd if a.startswith("--rdzv-endpoint=")) for cmd in result.commands
    }
    assert len(endpoints) == 1 and endpoints.pop().startswith("--rdzv-endpoint=127.0.0.1:")


def test_timeout_stops_the_agent_and_every_worker(tmp_path):
    script = write_script(tmp_path / "hang_forever.py", """
        import time
        import torch.distributed as dist

        dist.init_process_group("gloo")
        print("worker up", flush=True)
        time.sleep(600)
    """)
    with pytest.raises(TorchrunTimeout) as info:
        torchrun(script, nproc_per_node=2, timeout=20, echo=False)
    assert "worker up" in info.value.output
    assert _processes_running(str(script)) == []


class _InterruptOnFirstLine(io.StringIO):
    def write(self, s: str) -> int:
        if "worker up" in s:
            raise KeyboardInterrupt  # what a kernel interrupt does to the streaming loop
        return super().write(s)


def test_an_interrupt_while_streaming_leaves_no_process_behind(tmp_path):
    from kit.torchrun import _run

    script = write_script(tmp_path / "sleeper.py", """
        import time
        print("worker up", flush=True)
        time.sleep(600)
    """)
    cmd = torchrun_command(script, nproc_per_node=2)
    with pytest.raises(KeyboardInterrupt):
        _run([cmd], [""], None, 120, True, stdout=_InterruptOnFirstLine())
    assert _processes_running(str(script)) == []


# --------------------------------------------------------------------------- the agent, forked

ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
            "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS")


def _killed_once(folder: str) -> None:
    """A worker: rank 1 SIGKILLs itself on the first attempt; every attempt records its env."""
    import signal

    import torch
    import torch.distributed as dist

    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    init_process_group_per_attempt("gloo")
    rank = dist.get_rank()
    seen = {k: os.environ.get(k) for k in ENV_KEYS}
    seen["threads"] = torch.get_num_threads()
    Path(folder, f"rank{rank}-attempt{attempt}.json").write_text(__import__("json").dumps(seen))
    for step in range(4):
        if attempt == "0" and rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        t = torch.ones(1)
        dist.all_reduce(t)
    print(f"finished rank={rank} attempt={attempt} sum={t.item():g}")
    dist.destroy_process_group()


def test_elastic_run_is_torchruns_agent_restarting_after_a_kill(tmp_path):
    import json

    result = elastic_run(_killed_once, str(tmp_path), nproc_per_node=2, max_restarts=1, timeout=120)
    finished = sorted(
        re.findall(r"\[default\d\]:finished rank=\d attempt=\d sum=\d", result.output)
    )
    assert finished == ["[default0]:finished rank=0 attempt=1 sum=2",
                        "[default1]:finished rank=1 attempt=1 sum=2"]
    second = [json.loads((tmp_path / f"rank{r}-attempt1.json").read_text()) for r in range(2)]
    assert [s["RANK"] for s in second] == ["0", "1"] and {s["WORLD_SIZE"] for s in second} == {"2"}
    assert {s["TORCHELASTIC_MAX_RESTARTS"] for s in second} == {"1"}
    assert all(v is not None for s in second for k, v in s.items()), second  # every variable set
    assert {s["OMP_NUM_THREADS"] for s in second} == {"1"} and {s["threads"] for s in second} == {1}
    # the same variables as a real torchrun worker gets
    script = write_script(tmp_path / "env.py", "import os\n", f"""
        keys = {ENV_KEYS!r}
        print("missing=" + ",".join(k for k in keys if k not in os.environ))
    """)
    real = torchrun(script, nproc_per_node=2, timeout=120, echo=False)
    assert re.findall(r"missing=(.*)", real.output) == ["", ""]


def test_elastic_run_joins_the_rendezvous_without_the_first_round_jitter(tmp_path, monkeypatch):
    # torch sleeps a random 0-0.3 s before joining round 0, once at the start and again at the
    # first restart; the agent of elastic_run is the only node, so it skips that sleep. What
    # reaches torch's own _delay is recorded (in the agent, forked from here).
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    calls = tmp_path / "delays.txt"

    def recorded(seconds):
        with open(calls, "a") as f:
            f.write(f"{seconds!r}\n")

    monkeypatch.setattr(dynamic_rendezvous, "_delay", recorded)
    work = tmp_path / "work"
    work.mkdir()
    result = elastic_run(_killed_once, str(work), nproc_per_node=2, max_restarts=1, timeout=120)
    assert len(re.findall(r"finished rank=\d attempt=1", result.output)) == 2  # it did restart
    assert not calls.exists() or "(" not in calls.read_text(), calls.read_text()


def _fails_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 gives up")


def test_elastic_run_failure_names_the_rank_and_the_error():
    with pytest.raises(TorchrunError) as info:
        elastic_run(_fails_on_rank_1, nproc_per_node=2, timeout=60)
    summary = info.value.summary
    assert "_fails_on_rank_1 FAILED" in summary and "rank      : 1" in summary
    assert "ValueError: rank 1 gives up" in info.value.output


def _sleeps(folder: str) -> None:
    import time

    Path(folder, f"pid-{os.environ['RANK']}").write_text(str(os.getpid()))
    time.sleep(600)


def test_elastic_run_timeout_stops_the_agent_and_every_worker(tmp_path):
    import psutil

    with pytest.raises(TorchrunTimeout):
        elastic_run(_sleeps, str(tmp_path), nproc_per_node=2, timeout=10)
    pids = [int(p.read_text()) for p in tmp_path.glob("pid-*")]
    assert len(pids) == 2
    assert not [p for p in pids if psutil.pid_exists(p) and
                psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


# --------------------------------------------------------------------------- no torchrun needed


def test_command_is_standalone_for_one_node_and_c10d_for_several():
    one = torchrun_command("train.py", "a", 3, nproc_per_node=4, max_restarts=2)
    assert one[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in one and "--nproc-per-node=4" in one and "--max-restarts=2" in one
    assert one[-3:] == ["train.py", "a", "3"]
    two = torchrun_command("train.py", nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500")
    assert "--standalone" not in two
    assert {
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.1:29500",
        "--node-rank=1",
    } <= set(two)


@pytest.mark.parametrize("kwargs,problem", [
    ({"nnodes": 2}, "rdzv_endpoint"), ({"nproc_per_node": 0}, "nproc_per_node"),
    ({"nnodes": "2"}, "nnodes"),
])
def test_bad_arguments_name_the_problem(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        torchrun_command("train.py", **kwargs)


def test_a_missing_script_is_reported_before_starting_torchrun(tmp_path):
    with pytest.raises(FileNotFoundError, match="write_script"):
        torchrun(tmp_path / "nope.py")
    with pytest.raises(FileNotFoundError, match="no script"):
        torchrun_nodes(tmp_path / "nope.py")


def test_failure_summary_is_found_in_every_nodes_labelled_output():
    block = (
        "=" * 20
        + "\ntrain.py FAILED\n---\nRoot Cause (first observed failure):\n  rank : 3\n"
        + "=" * 20
    )
    output = "\n".join(
        [
            "[node 0] noise",
            *(
                f"[node 1] {line}"
                for line in [
                    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
                    *block.splitlines(),
                ]
            ),
        ]
    )
    assert _failure_summary(output) == block
    assert _failure_summary("all good\n") == ""


def _double(x: int) -> int:
    return 2 * x


class _Point:
    x: int = 1


def test_write_script_copies_functions_classes_and_dedented_code(tmp_path):
    path = write_script(tmp_path / "s.py", "import sys", _double, _Point, """
        if __name__ == "__main__":
            print(_double(int(sys.argv[1])), _Point.x)
    """)
    out = subprocess.run(
        [sys.executable, str(path), "21"], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["42", "1"]


def test_write_script_rejects_what_is_not_code(tmp_path):
    with pytest.raises(TypeError, match="string"):
        write_script(tmp_path / "s.py", 42)
    with pytest.raises(ValueError, match="at least one part"):
        write_script(tmp_path / "s.py")


# --------------------------------------------------------------------------- SLURM


def test_sbatch_template_is_valid_bash():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)


def test_sbatch_template_runs_one_torchrun_agent_per_node_via_srun():
    text = SBATCH.read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.M))
    assert directives["ntasks-per-node"] == "1"  # one agent per node: it starts the workers
    assert "nodes" in directives and "gpus-per-node" in directives
    # The srun line, with its backslash continuations joined.
    launch = re.search(r"^srun .*?torchrun(?:.*\\\n)*.*$", text, re.M).group(0).replace("\\\n", " ")
    flags = dict(re.findall(r"--([\w-]+)=(\S+)", launch))
    assert flags["nnodes"] == '"$SLURM_NNODES"'
    assert flags["rdzv-backend"] == "c10d"
    assert flags["rdzv-endpoint"] == '"$head_node:$rdzv_port"'
    assert flags["rdzv-id"] == '"$SLURM_JOB_ID"'
    assert "--standalone" not in launch and '"$@"' in launch
    assert re.search(
        r'^head_node=\$\(scontrol show hostnames "\$SLURM_JOB_NODELIST" \| head -n 1\)$', text, re.M
    )
