"""Fail closed: as root without a namespaced sandbox, ``kit grade`` refuses and writes nothing.

A fresh machine where the grader runs as root without bubblewrap (or in a container that forbids
namespaces) would otherwise run every submission as root, outside any namespace: a notebook could
rewrite ``kit/`` and ``autograder/``, read the run's secret and write into the output folder. So
there the batch is refused (exit code 2, a message naming bubblewrap and its install command, no
output file created or changed) unless ``--unsandboxed`` (Python: ``unsandboxed=True``) asks
for it, with a loud warning; an ordinary user still grades with its one line; ``kit doctor``
fails its "grading isolation" row. The decision is ``autograder.grade.sandbox.require_sandbox``.

"Root without bubblewrap" is simulated (the euid check and the bwrap lookup are monkeypatched),
so every test runs on any machine, root or not, with bubblewrap or without.
"""

from __future__ import annotations

import csv
import json
import os
import secrets
from pathlib import Path

import pytest
from grading_corpus import LESSON, write_corpus

from autograder.grade import batch, sandbox
from autograder.grade.batch import BatchConfig, grade_batch
from autograder.grade.sandbox import Isolation, Limits, SandboxUnavailable
from autograder.grade.submissions import discover
from kit import cli

ROOT = Path(__file__).resolve().parents[1]
LIMITS = Limits(case_wall_s=30.0, memory=2 << 30, output=1 << 20, file_size=16 << 20)
# What the probe finds as root on a machine without bubblewrap and whose sandbox uid cannot run
# this Python: the worst case, every submission would run as root.
NO_BWRAP = Isolation(
    False,
    False,
    "no namespaces: bubblewrap is not installed (apt-get install bubblewrap)"
    "; and uid 61000 cannot run python, so workers run as root",
)


@pytest.fixture
def as_root_without_bwrap(monkeypatch):
    monkeypatch.setattr(sandbox, "_is_root", lambda: True)
    monkeypatch.setattr(sandbox, "_ISOLATION", [NO_BWRAP])


@pytest.fixture
def as_a_user_without_bwrap(monkeypatch):
    monkeypatch.setattr(sandbox, "_is_root", lambda: False)
    monkeypatch.setattr(
        sandbox,
        "_ISOLATION",
        [
            Isolation(
                False,
                False,
                "not root: workers run as your user, with no namespaces and no uid of their own",
            )
        ],
    )


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]] | None:
    """Every file and folder under ``folder`` with its bytes and mtime (None: it does not exist)."""
    if not folder.exists():
        return None
    return {
        str(p.relative_to(folder)): (
            p.read_bytes() if p.is_file() else b"<dir>",
            p.stat().st_mtime_ns,
        )
        for p in sorted(folder.rglob("*"))
    }


def _grade(*args: str) -> int:
    return cli.main(["grade", *args])


def _assert_refused(code: int, err: str) -> None:
    assert code == 2, err
    assert "refusing to grade as root without a sandbox" in err, err
    assert (
        "bubblewrap" in err and "apt-get install bubblewrap" in err and "make grade-setup" in err
    ), err
    assert "--unsandboxed" in err and "Nothing was graded or written" in err, err


def test_as_root_without_bwrap_kit_grade_refuses_names_the_fix_and_writes_nothing(
    tmp_path, monkeypatch, capsys
):
    # From the bwrap lookup up: the real probe runs, on a machine that seems to have no bubblewrap.
    real_which = sandbox.shutil.which
    monkeypatch.setattr(
        sandbox.shutil,
        "which",
        lambda name, *a, **k: None if name == "bwrap" else real_which(name, *a, **k),
    )
    monkeypatch.setattr(sandbox, "_is_root", lambda: True)
    monkeypatch.setattr(sandbox, "_ISOLATION", [])
    started = []
    monkeypatch.setattr(
        batch, "run_worker", lambda *a, **k: started.append(a) or pytest.fail("a worker started")
    )
    write_corpus(tmp_path / "subs", tmp_path / "out", ["correct"])
    code = _grade(str(tmp_path / "subs"), "--out", str(tmp_path / "out"), "--lessons", "00")
    captured = capsys.readouterr()
    _assert_refused(code, captured.err)
    assert "bubblewrap is not installed" in captured.err
    assert (
        not (tmp_path / "out").exists() and not started
    )  # no grades.csv, records/, secret, nothing
    assert not (tmp_path / "grading-out").exists()
    assert sandbox.isolation().namespaces is False


def test_a_refused_run_leaves_an_existing_output_folder_as_it_was(
    tmp_path, as_root_without_bwrap, capsys
):
    out = tmp_path / "out"
    (out / "records").mkdir(parents=True)
    (out / "grades.csv").write_text("student,score\nalice,5\n")
    (out / "records" / "alice.json").write_text(json.dumps({"student": "alice", "score": 5}))
    before = _snapshot(out)
    write_corpus(tmp_path / "subs", out, ["correct"])
    code = _grade(str(tmp_path / "subs"), "--out", str(out), "--lessons", "00", "--gradescope")
    _assert_refused(code, capsys.readouterr().err)
    assert _snapshot(out) == before


def test_the_python_api_refuses_too_unless_asked_explicitly(tmp_path, as_root_without_bwrap):
    write_corpus(tmp_path / "subs", tmp_path / "out", ["correct"])
    with pytest.raises(
        SandboxUnavailable, match=r"(?s)bubblewrap.*apt-get install bubblewrap.*make grade-setup"
    ):
        grade_batch(
            discover([tmp_path / "subs"]),
            BatchConfig(tmp_path / "out", [0], workers=1, limits=LIMITS),
        )
    assert not (tmp_path / "out").exists()
    work = sandbox.make_workdir()
    try:
        with pytest.raises(SandboxUnavailable, match="unsandboxed=True"):
            sandbox.run_worker(work, LIMITS)  # the one place every worker starts from
    finally:
        sandbox.remove_workdir(work)
    assert sandbox.require_sandbox(unsandboxed=True) == NO_BWRAP


def test_with_unsandboxed_it_grades_and_warns_loudly(tmp_path, as_root_without_bwrap, capsys):
    write_corpus(tmp_path / "subs", tmp_path / "out", ["correct"])
    code = _grade(
        str(tmp_path / "subs"),
        "--out",
        str(tmp_path / "out"),
        "--lessons",
        "00",
        "--unsandboxed",
        "--workers",
        "1",
    )
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    warning = [ln for ln in captured.err.splitlines() if "WARNING" in ln]
    assert warning and "--unsandboxed" in warning[0] and "WITHOUT a sandbox" in warning[0], (
        captured.err
    )
    assert "rewrite kit/ and autograder/" in captured.err and "make grade-setup" in captured.err
    rows = list(csv.DictReader((tmp_path / "out" / "grades.csv").open()))
    assert [(r["student"], r["score"]) for r in rows] == [("correct", "5.0")]


def test_as_an_ordinary_user_without_bwrap_it_grades_with_one_line(
    tmp_path, as_a_user_without_bwrap, capsys
):
    write_corpus(tmp_path / "subs", tmp_path / "out", ["correct"])
    code = _grade(
        str(tmp_path / "subs"), "--out", str(tmp_path / "out"), "--lessons", "00", "--workers", "1"
    )
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    notes = [
        ln for ln in captured.out.splitlines() + captured.err.splitlines() if "isolation" in ln
    ]
    assert (
        len(notes) == 1 and notes[0].startswith("kit grade: note: ") and "not root" in notes[0]
    ), captured
    assert "WARNING" not in captured.err and "refusing" not in captured.err
    assert (tmp_path / "out" / "grades.csv").is_file()
    assert sandbox.require_sandbox() is sandbox.isolation()  # no flag needed


def test_kit_doctor_fails_the_grading_row_as_root_without_bwrap(
    as_root_without_bwrap, monkeypatch, capsys
):
    from autograder.grade import doctor as grader_doctor
    from kit import doctor

    finding = grader_doctor.check_isolation()
    assert (
        finding.status == doctor.FAIL
        and "refuses" in finding.detail
        and "bubblewrap" in finding.detail
    )
    assert "make grade-setup" in finding.fix and "apt-get install bubblewrap" in finding.fix
    launched = []
    monkeypatch.setattr(doctor, "check_launch", lambda n: launched.append(n) or doctor.Finding(
        "launch + all_reduce", doctor.OK, "skipped"))
    assert cli.main(["doctor", "-n", "2"]) == 1
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.startswith("grading isolation"))
    assert " FAIL " in row, out
    assert "fix: make grade-setup" in out and "blocking problem" in out
    assert launched == [2]  # the course's own launch check still runs beside the grading row


def test_a_notebook_that_writes_into_kit_is_never_run_as_root_without_a_sandbox(
    tmp_path, as_root_without_bwrap, monkeypatch, capsys
):
    """The exploit class: as root with no sandbox, a setup cell that rewrites the grader's
    packages would run as root at load time. Refused before it runs, by every route."""
    token = secrets.token_hex(6)
    marker = tmp_path / "ran"
    marker.mkdir()
    targets = [ROOT / "kit", ROOT / "autograder", marker]
    attack = ("import pathlib as _pl\n"
              f"for _d in {[str(t) for t in targets]!r}:\n"
              "    try:\n"
              f"        (_pl.Path(_d) / '_pwned_{token}.py').write_text('raise SystemExit(1)\\n')\n"
              "    except OSError:\n"
              "        pass\n")
    nb = json.loads(LESSON.read_text())
    setup = next(c for c in nb["cells"] if c.get("id") == "setup")
    setup["source"] = "".join(setup["source"]) + "\n" + attack
    (tmp_path / "subs").mkdir()
    (tmp_path / "subs" / "mallory.ipynb").write_text(json.dumps(nb))
    popen = []
    real_popen = sandbox.subprocess.Popen
    monkeypatch.setattr(
        sandbox.subprocess, "Popen", lambda *a, **k: popen.append(a) or real_popen(*a, **k)
    )
    try:
        code = _grade(str(tmp_path / "subs"), "--out", str(tmp_path / "out"), "--lessons", "00")
        _assert_refused(code, capsys.readouterr().err)
        with pytest.raises(SandboxUnavailable):
            grade_batch(
                discover([tmp_path / "subs"]),
                BatchConfig(tmp_path / "out2", [0], workers=1, limits=LIMITS),
            )
        # one notebook, which kit grade checks in its own process: refused as root unless trusted
        code = _grade(str(tmp_path / "subs" / "mallory.ipynb"), "--lessons", "00",
                      "--json", str(tmp_path / "one.json"))
        err = capsys.readouterr().err
        assert code == 2 and "refusing to check" in err and "--out DIR" in err, err
        assert not (tmp_path / "one.json").exists()
        work = sandbox.make_workdir()  # a worker's job, ready to run the notebook: refused too
        try:
            copy = work / "lesson00.ipynb"
            copy.write_text(json.dumps(nb))
            (work / "job.json").write_text(
                json.dumps(
                    {
                        "seed": 0,
                        "notebooks": [[0, str(copy)]],
                        "cases": [["0.1", 0, "0-1-0"]],
                        "reference_prints": {},
                    }
                )
            )
            with pytest.raises(SandboxUnavailable):
                sandbox.run_worker(work, LIMITS, cases=1)
        finally:
            sandbox.remove_workdir(work)
    finally:
        planted = [p for t in targets for p in t.glob(f"_pwned_{token}*")]
        for path in planted:
            path.unlink()
    assert planted == [] and popen == [], (planted, popen)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()
    assert os.listdir(marker) == []


def test_one_notebook_is_checked_in_process_as_root_only_when_trusted(
    tmp_path, monkeypatch, capsys
):
    # Bubblewrap or not: one notebook is checked in kit grade's own process, so as root its code
    # would run as root. --unsandboxed (your own work) checks it; as another user, no flag needed.
    write_corpus(tmp_path / "subs", tmp_path / "out", ["correct"])
    notebook, report = tmp_path / "subs" / "correct.ipynb", tmp_path / "one.json"
    monkeypatch.setattr(sandbox, "_is_root", lambda: True)
    monkeypatch.setattr(sandbox, "_ISOLATION", [Isolation(True, True, None)])
    assert _grade(str(notebook), "--lessons", "00", "--json", str(report)) == 2
    assert "refusing to check" in capsys.readouterr().err and not report.exists()
    assert _grade(str(notebook), "--lessons", "00", "--json", str(report), "--unsandboxed") == 0
    assert json.loads(report.read_text())["score"] == 5
    report.unlink()
    monkeypatch.setattr(sandbox, "_is_root", lambda: False)
    assert _grade(str(notebook), "--lessons", "00", "--json", str(report)) == 0
    assert json.loads(report.read_text())["score"] == 5


def test_the_throughput_benchmark_refuses_before_any_work_unless_unsandboxed(
    as_root_without_bwrap, monkeypatch
):
    import importlib.util

    spec = importlib.util.spec_from_file_location("grading_throughput",
                                                  ROOT / "benchmarks" / "grading_throughput.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "_full_submission", lambda folder: pytest.fail("work started"))
    monkeypatch.setattr("sys.argv", ["grading_throughput.py", "--copies", "1"])
    with pytest.raises(SystemExit, match="refusing to grade as root without a sandbox"):
        bench.main()
    monkeypatch.setattr("sys.argv", ["grading_throughput.py", "--copies", "1", "--unsandboxed"])
    with pytest.raises(pytest.fail.Exception, match="work started"):  # past the refusal
        bench.main()
