"""``kit doctor`` with the grader's row: which isolation ``kit grade`` gives each worker here.

The ``kit`` command runs this module for ``kit doctor`` (its command table names it as a string),
so :mod:`kit.doctor` stays free of grading code and this row still shows in one table.
"""

from __future__ import annotations

import os

from autograder.grade.sandbox import isolation
from kit import doctor

__all__ = ["check_isolation", "main"]


def check_isolation() -> doctor.Finding:
    """Which isolation ``kit grade`` gives each submission's worker here (probed: imports torch once)."""
    found = isolation()
    if found.missing is None:
        return doctor.Finding("grading isolation", doctor.OK, found.describe())
    if not (hasattr(os, "geteuid") and os.geteuid() == 0):  # a student's machine: nothing to fix
        return doctor.Finding("grading isolation", doctor.OK, f"{found.describe()} (instructors: grade "
                              "as root with bubblewrap for a uid and namespaces per worker)")
    return doctor.Finding("grading isolation", doctor.WARN, f"{found.describe()}; {found.missing}",
                          "apt-get install bubblewrap, and let the container create namespaces "
                          "(Docker: --privileged; or grade in a VM); see CONTRIBUTING.md, Isolation")


def main(argv: list[str] | None = None) -> int:
    return doctor.main(argv, extra=[check_isolation])
