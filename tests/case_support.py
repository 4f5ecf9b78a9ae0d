"""Shared by the lesson tests: which cases of a task an implementation fails."""

from __future__ import annotations

from typing import Any

from autograder.registry import get_task


def failed_cases(task_id: str, impl: Any, seed: int = 0) -> list[str]:
    """Names of the cases ``impl`` fails: ``run`` raised (a stub, a crash) or ``compare`` did."""
    task = get_task(task_id)
    failed = []
    for case in task.cases:
        try:
            case.compare(case.run(impl, seed), task.expected(case, seed))
        except Exception:  # noqa: BLE001 - CheckFailed, NotImplementedError, or a crash
            failed.append(case.name)
    return failed
