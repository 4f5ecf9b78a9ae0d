"""``kit doctor`` with the grader's row: which isolation ``kit grade`` gives each worker here.

The ``kit`` command runs this module for ``kit doctor`` (its command table names it as a string),
so :mod:`kit.doctor` stays free of grading code and this row still shows in one table.
"""

from __future__ import annotations

from autograder.grade.sandbox import isolation, refusal
from kit import doctor

__all__ = ["check_isolation", "main"]


def check_isolation() -> doctor.Finding:
    """Which isolation ``kit grade`` gives each submission's worker here (probed: imports torch
    once).

    A failing row as root without a namespaced sandbox: there ``kit grade`` refuses a batch
    (:func:`autograder.grade.sandbox.refusal`, the same decision)."""
    found = isolation()
    if refusal() is not None:
        return doctor.Finding("grading isolation", doctor.FAIL,
                              "kit grade refuses to grade a batch here: "
                              f"root without a sandbox ({found.missing})",
                              "make grade-setup (as root: apt-get install bubblewrap), on a "
                              "machine or container that may create namespaces (Docker: "
                              "--privileged; or grade in a VM); see README.md, Grading in detail")
    if found.missing is None:
        return doctor.Finding("grading isolation", doctor.OK, found.describe())
    # not root (a student's machine): workers run as this user, with one warning line; nothing to
    # fix
    return doctor.Finding("grading isolation", doctor.OK, f"{found.describe()} (instructors: grade "
                          "as root with bubblewrap for a uid and namespaces per worker: make "
                          "grade-setup)")


def main(argv: list[str] | None = None) -> int:
    return doctor.main(argv, extra=[check_isolation])
