"""A batch of 36 generated Lesson 00 submissions survives a SIGKILL of its grader.

The submissions mix the correct functions, every seeded bug of tests/bugs/lesson00.py, the
released stubs and syntax errors. Their expected scores come from the in-notebook checker
(:func:`autograder.checking.run_checks`, same seed) run once per distinct function. The batch is
graded with 2 workers, its process group SIGKILLed partway, then re-run: every student ends with
exactly one row holding the expected grade, and the first run's finished records are kept.
"""

from __future__ import annotations

import csv
import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from bugs.lesson00 import BUGS
from grading_corpus import LESSON, MEAN_OK, SHARD_OK
from grading_support import need_grading_sandbox

from autograder.checking import run_checks

KIT = Path(sys.executable).with_name("kit")
SEED = 7
N = 36  # every variant of both tasks appears at least twice
KILL_AFTER = 12  # records on disk when the grader is killed
SYNTAX_ERROR = "def shard_range(n, rank, world_size)\n    return range(n)\n"


def _variants(task: str, name: str, correct: str) -> list[tuple[str, str]]:
    """(label, source defining `name`) for the correct version, every seeded bug and the stub."""
    out = [("correct", correct)]
    for label, fn in BUGS[task]:
        out.append((label, textwrap.dedent(inspect.getsource(fn)).replace(fn.__name__, name, 1)))
    out.append(("stub", None))
    return out


SHARDS = _variants("0.1", "shard_range", SHARD_OK) + [("syntax error", SYNTAX_ERROR)]
MEANS = _variants("0.2", "global_mean", MEAN_OK)


def _score(task: str, source: str | None) -> float:
    if source is None or source == SYNTAX_ERROR:
        return 0.0
    namespace: dict = {}
    exec("import torch\nimport torch.distributed as dist\n" + source, namespace)
    name = "shard_range" if task == "0.1" else "global_mean"
    return run_checks(task, namespace[name], seed=SEED).score


def _write(folder: Path) -> dict[str, float]:
    released = json.loads(LESSON.read_text())
    shard_scores = {label: _score("0.1", src) for label, src in SHARDS}
    mean_scores = {label: _score("0.2", src) for label, src in MEANS}
    expected = {}
    folder.mkdir()
    for i in range(N):
        (s_label, s_src), (m_label, m_src) = SHARDS[i % len(SHARDS)], MEANS[i % len(MEANS)]
        nb = json.loads(json.dumps(released))
        for cell in nb["cells"]:
            if cell.get("id") == "task-0-1" and s_src is not None:
                cell["source"] = s_src
            if cell.get("id") == "task-0-2" and m_src is not None:
                cell["source"] = m_src
        student = f"student{i:03d}"
        (folder / f"{student}.ipynb").write_text(json.dumps(nb))
        expected[student] = shard_scores[s_label] + mean_scores[m_label]
    return expected


@pytest.mark.slow
def test_a_killed_batch_resumes_with_every_grade_exactly_once(tmp_path):
    need_grading_sandbox()
    expected = _write(tmp_path / "subs")
    assert len(set(expected.values())) > 5  # the mix really spreads the grades
    out = tmp_path / "out"
    cmd = [str(KIT), "grade", str(tmp_path / "subs"), "--out", str(out), "--lessons", "00",
           "--workers", "2", "--seed", str(SEED), "--timeout", "30"]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    deadline = time.monotonic() + 400
    while len(list((out / "records").glob("*.json"))) < KILL_AFTER and time.monotonic() < deadline:
        assert first.poll() is None, "the grader ended before it could be killed"
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    kept = len(list((out / "records").glob("*.json")))
    assert KILL_AFTER <= kept < N and not (out / "grades.csv").exists()

    second = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"resuming: {kept} of {N} submission(s) already graded" in second.stdout
    rows = list(csv.DictReader((out / "grades.csv").open()))
    assert len(rows) == N and len({r["student"] for r in rows}) == N
    got = {r["student"]: float(r["score"]) for r in rows}
    assert got == pytest.approx(expected)
    assert len(list((out / "records").glob("*.json"))) == N
    assert not list((out / "records").glob(".*.tmp"))
