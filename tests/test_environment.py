"""The suite's results do not depend on the shell it was started from.

A developer's terminal hands a test run a umask of 022, a shared ``/tmp``, a ``HOME``, a UTF-8
locale, a controlling terminal and SIGINT handled. CI, ``nohup``, ``cmd &`` from a script and
cron hand down something else. Here a few tests that touch each of those (the sandboxed batch
grader, which hands files to other uids; the progress cache, which lives under ``HOME``; the
launcher, which installs signal handlers) run again in a subprocess under all of the other values
at once: umask 077, a private ``TMPDIR`` (mode 0700), no ``HOME``, ``TERM`` or ``COLUMNS``, the C
locale, no terminal (a new session, stdin from /dev/null) and SIGINT ignored. The interrupt tests
of tests/test_launcher.py run under ``nohup ... &`` in ``.ci/run``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from conftest import ROOT

SELECTION = [
    "tests/test_grading.py::test_the_command_grades_a_folder_with_progress_and_every_output",
    "tests/test_progress.py",
    "tests/test_launcher.py::test_a_launch_under_an_ignored_sigint_ignores_it_and_cleans_up",
    "tests/test_launcher.py::test_kernel_environment_and_signal_handlers_are_untouched",
]


def _hostile() -> None:  # in the child, before pytest starts
    os.umask(0o077)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow
def test_the_tests_pass_under_an_environment_unlike_a_terminal(tmp_path):
    missing = [s for s in SELECTION if not (ROOT / s.split("::")[0]).exists()]
    assert not missing, f"tests named here no longer exist: {missing}"
    private = tmp_path / "tmp"
    private.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items()
           if k not in {"HOME", "TERM", "COLUMNS", "LINES", "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST"}
           and not k.startswith("LC_")}
    env.update(LANG="C", LC_ALL="C", TMPDIR=str(private))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SELECTION],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        preexec_fn=_hostile,
        start_new_session=True,
        timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and "deselected" not in tail and "no tests ran" not in tail, tail
