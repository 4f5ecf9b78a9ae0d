"""Checks for every graded task of the course, one module per lesson (``lessonNN.py``).

The registry (:mod:`autograder.registry`) is the single place a task's checks and points live;
the notebook ``check()``, pytest and the batch grader all run the same cases.
"""

from autograder.registry import (
    TASKS,
    Case,
    CheckFailed,
    Task,
    assert_same,
    get_task,
    lesson_tasks,
    task,
)

__all__ = ["TASKS", "Case", "CheckFailed", "Task", "assert_same", "get_task", "lesson_tasks",
           "task"]
