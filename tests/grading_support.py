"""What a test that runs the sandboxed batch grader needs: a machine where ``kit grade`` grades.

As root without a namespaced sandbox (no bubblewrap, or a container that forbids namespaces)
``kit grade`` refuses to grade (``autograder.grade.sandbox.refusal``). There the suite's batch
tests skip with the fix, and under ``CI=true`` they fail: CI grades as root with bubblewrap, so
its batches always run in the sandbox. tests/test_fail_closed.py tests the refusal itself.
"""

from __future__ import annotations

import os

import pytest

from autograder.grade import sandbox


def need_grading_sandbox() -> None:
    """Skip (CI: fail) where ``kit grade`` refuses to grade; return where it grades."""
    why = sandbox.refusal()
    if why is None:
        return
    first = why.splitlines()[0]
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI grades as root with bubblewrap, but kit grade is {first}", pytrace=False)
    pytest.skip(f"kit grade is {first} Fix: make grade-setup (apt-get install bubblewrap)")
