"""kit doctor and the kit command: a readable table, a fix per problem, a non-zero exit when
blocked."""

from __future__ import annotations

import subprocess
import sys

from autograder import course
from kit import cli, doctor


def test_doctor_passes_on_this_machine_and_lists_every_check():
    proc = subprocess.run([sys.executable, "-m", "kit.cli", "doctor", "-n", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for row in ("Python", "PyTorch", "gloo backend", "nccl backend / GPUs", "start method",
                "loopback + free port", "/dev/shm", "CPU cores", "JupyterLab + widgets",
                "MPI (optional)", "launch + all_reduce"):
        assert row in proc.stdout
    assert "2 ranks in" in proc.stdout and "Ready" in proc.stdout


def test_blocking_problem_exits_non_zero_with_its_fix(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "check_loopback", lambda: doctor.Finding(
        "loopback + free port", doctor.FAIL, "cannot connect on 127.0.0.1", "allow local TCP"))
    assert doctor.main(["-n", "2"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "fix: allow local TCP" in out and "1 blocking problem" in out
    assert "launch + all_reduce" not in out  # no launch attempted on a broken machine


def test_warnings_do_not_block(monkeypatch, capsys):
    monkeypatch.setattr(
        doctor,
        "check_cores",
        lambda n: doctor.Finding("CPU cores", doctor.WARN, "1 core", "close programs"),
    )
    assert doctor.main(["-n", "2"]) == 0
    assert "fix: close programs" in capsys.readouterr().out


def test_kit_command_lists_subcommands_and_rejects_unknown(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert name in out
    assert cli.main(["fly"]) == 2
    assert "unknown command 'fly'" in capsys.readouterr().err


def test_kit_lab_command_opens_the_first_lesson_and_starts_as_root(monkeypatch):
    from pathlib import Path

    from kit import lab

    root = Path(__file__).resolve().parents[1]
    monkeypatch.setattr(lab.os, "geteuid", lambda: 0)
    cmd = lab.lab_command(root, ["--no-browser"])
    assert "--allow-root" in cmd  # Jupyter refuses root (containers, CI) without it
    notebook = f"lessons/{course.lesson(0).stem}.ipynb"
    assert str(root / notebook) in cmd or notebook in " ".join(cmd)
    assert cmd[-1] == "--no-browser"
    monkeypatch.setattr(lab.os, "geteuid", lambda: 1000)
    assert "--allow-root" not in lab.lab_command(root)


def test_missing_mpi_is_a_warning_with_its_fix_and_never_blocks(monkeypatch, capsys):
    real_which = doctor.shutil.which
    monkeypatch.setattr(
        doctor.shutil, "which", lambda name: None if name == "mpirun" else real_which(name)
    )
    row = doctor.check_mpi()
    assert (
        row.status == doctor.WARN and "mpirun" in row.detail and "MPI cells will skip" in row.detail
    )
    assert "openmpi-bin" in row.fix and ".[mpi]" in row.fix
    assert doctor.main(["-n", "2"]) == 0
    assert "MPI (optional)" in capsys.readouterr().out


def test_mpi_row_names_the_versions_when_both_are_installed():
    import shutil

    import pytest

    mpi4py = doctor._version("mpi4py")
    if not (shutil.which("mpirun") and mpi4py):
        pytest.skip("mpirun or mpi4py not installed here")
    row = doctor.check_mpi()
    assert row.status == doctor.OK and f"mpi4py {mpi4py}" in row.detail
    assert "Open MPI" in row.detail or "mpirun" in row.detail

