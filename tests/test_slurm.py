"""slurm/grade.sbatch under a real one-node Slurm: an array of 2 shards and a dependent merge
write the grades one unsharded run writes.

The cluster is Debian's munge, slurmctld and slurmd on localhost (``slurm/local-cluster.sh``,
which .ci/run starts): jobs really go through sbatch, the array and the dependency. Where it
cannot start (not root, no packages) the test is skipped with the reason, and fails under CI.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from grading_corpus import write_corpus
from grading_support import need_grading_sandbox

from autograder import course

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "slurm" / "local-cluster.sh"
KIT = Path(sys.executable).with_name("kit")
STUDENTS = ["correct", "stub", "cell_deleted", "function_renamed"]


def _unavailable(why: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI runs a one-node Slurm, but {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="module")
def slurm():
    if os.geteuid() != 0:
        _unavailable("the one-node Slurm starts as root (slurm/local-cluster.sh start)")
    ok = subprocess.run(["bash", str(CLUSTER), "status"], capture_output=True).returncode == 0
    if not ok:
        started = subprocess.run(["bash", str(CLUSTER), "start"], capture_output=True, text=True,
                                 timeout=600)
        if started.returncode != 0:
            _unavailable(
                f"slurm/local-cluster.sh start failed: {(started.stderr or started.stdout)[-800:]}"
            )


def _sbatch(*args: str, cwd: Path) -> str:
    done = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--chdir={cwd}",
            f"--output={cwd}/%x-%A_%a.out",
            f"--export=ALL,KIT={KIT}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def _wait(job_ids: list[str], cwd: Path, timeout: float = 420) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i %T %R"],
                                capture_output=True, text=True).stdout.strip()
        if not queued:
            return
        for line in queued.splitlines():  # a requeued job waits out a begin time: start it now
            if line.endswith("(BeginTime)"):
                subprocess.run(["scontrol", "update", f"JobId={line.split()[0]}", "StartTime=now"])
        if any(why in queued for why in ("DependencyNeverSatisfied", "PartitionConfig",
                                          "BadConstraints", "ReqNodeNotAvail")):
            break  # it will never run: say why now
        time.sleep(2)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(cwd.glob("*.out")))
    subprocess.run(["scancel", *job_ids])
    pytest.fail(f"the Slurm jobs {job_ids} did not finish: {queued}\n{logs}")


def _normalised(folder: Path) -> dict[str, str]:
    # As tests/test_shards.py: which rank reports first and Gradescope's timing vary per run.
    return {
        str(p.relative_to(folder)): re.sub(
            r'"execution_time": [\d.]+', "", re.sub(r"rank \d+", "rank N", p.read_text())
        )
        for p in sorted(folder.rglob("*"))
        if p.is_file()
        and p.suffix in {".csv", ".txt", ".json"}
        and not {"records", "shards", ".kit-grade"} & set(p.parts)
        and p.name != "run-secret.json"
    }


def test_grade_sbatch_shards_a_class_over_a_job_array_and_merges_it_as_one_run(slurm, tmp_path):
    need_grading_sandbox()
    from autograder.grade.notebook import main as grade_main

    write_corpus(tmp_path / "subs", tmp_path / "unused", STUDENTS)
    out = tmp_path / "grades"
    sbatch = str(ROOT / "slurm" / "grade.sbatch")
    array = _sbatch(
        "--array=1-2",
        "--cpus-per-task=1",
        sbatch,
        str(tmp_path / "subs"),
        str(out),
        "--lessons",
        "00",
        cwd=tmp_path,
    )
    merge = _sbatch(
        f"--dependency=afterok:{array}",
        "--cpus-per-task=1",
        sbatch,
        str(tmp_path / "subs"),
        str(out),
        cwd=tmp_path,
    )
    _wait([array, merge], tmp_path)
    logs = {p.name: p.read_text() for p in tmp_path.glob("*.out")}
    assert (out / "grades.csv").exists(), logs
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["1", "2"]
    assert any("merged 2 shard(s): 4 submission(s)" in text for text in logs.values()), logs
    # the same class, unsharded, with the seed the shards shared
    seed = json.loads((out / "run-secret.json").read_text())["seed"]
    assert grade_main([str(tmp_path / "subs"), "--lessons", "00", "--out", str(tmp_path / "one"),
                       "--seed", str(seed), "--gradescope"]) == 0
    merged, one = _normalised(out), _normalised(tmp_path / "one")
    assert merged["grades.csv"] == one["grades.csv"] and merged == one


# --------------------------------------------------------------------------- train.sbatch, requeued

# Appended to Lesson 02's train.py: on the job's first run, rank 0 has Slurm requeue the job at
# REQUEUE_AT_STEP (what a preemption does: every task killed, the job back in the queue); the
# second run (SLURM_RESTART_COUNT=1) trains on from the checkpoint.
REQUEUE_HOOK = """
import subprocess
import time

if os.environ.get("SLURM_RESTART_COUNT", "0") == "0" and os.environ.get("REQUEUE_AT_STEP"):
    _requeue_at = int(os.environ["REQUEUE_AT_STEP"])
    _train_step = train_step

    def train_step(model, optimizer, step):
        if step == _requeue_at:
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"requeueing job {os.environ['SLURM_JOB_ID']} at step {step}", flush=True)
                subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True)
            time.sleep(600)  # killed by the requeue
        return _train_step(model, optimizer, step)
"""


def _lesson02_train_script(path: Path) -> Path:
    """train.py as Lesson 02 writes it (its setup and task code, its HEADER and TRAIN_MAIN)."""
    import ast

    from autograder.loading import load_tasks
    from kit.torchrun import init_process_group_per_attempt, write_script

    source = course.lesson(2).source
    texts = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in ast.parse(source.read_text()).body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id in ("HEADER", "TRAIN_MAIN")
    }
    lesson = load_tasks(source)
    return write_script(
        path,
        texts["HEADER"],
        lesson.DistInfo,
        lesson.dist_info_from_env,
        lesson.make_model,
        lesson.make_optimizer,
        lesson.batch_at,
        lesson.train_step,
        lesson.resumable_train,
        init_process_group_per_attempt,
        REQUEUE_HOOK,
        texts["TRAIN_MAIN"],
    )


def test_train_sbatch_on_cpu_resumes_from_its_checkpoint_after_the_job_is_requeued(slurm, tmp_path):
    import torch

    from autograder.loading import load_tasks

    script = _lesson02_train_script(tmp_path / "train.py")
    # The CPU/gloo variant: the same file without its GPU request, 2 workers on the one node.
    text = (ROOT / "slurm" / "train.sbatch").read_text()
    cpu = tmp_path / "train-cpu.sbatch"
    cpu.write_text(re.sub(r"^#SBATCH --gpus-per-node=.*\n", "", text, flags=re.M))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    done = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={tmp_path}", f"--output={tmp_path}/train-%j.out",
         "--open-mode=append", "--nodes=1", "--cpus-per-task=2",
         f"--export=ALL,NPROC_PER_NODE=2,REQUEUE_AT_STEP=3,PATH={Path(sys.executable).parent}:{os.environ['PATH']}",
         str(cpu), str(script), str(ckpt), "6"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip()
    _wait([job], tmp_path, timeout=420)
    log = (tmp_path / f"train-{job}.out").read_text()
    assert f"requeueing job {job} at step 3" in log, log[-3000:]
    assert "rank 0: resuming at step 3" in log, log[-3000:]  # the second run, from the checkpoint
    assert (ckpt / "final.pt").exists(), log[-3000:]
    lesson = load_tasks(course.lesson(2).source)
    (tmp_path / "uninterrupted").mkdir()
    reference = lesson.resumable_train(str(tmp_path / "uninterrupted"), 6)
    resumed = torch.load(ckpt / "final.pt", weights_only=True)
    assert all(torch.equal(resumed[k], reference[k]) for k in reference), log[-3000:]
