"""Seeded bugs: the typical wrong implementations every task's checks must catch.

``tests/bugs/lessonNN.py`` defines ``BUGS = {"N.M": [("what the bug does", buggy_impl), ...]}``
where ``buggy_impl`` is the same kind of object a student writes (a function or a class).
``tests/test_checks.py`` fails when a registered task has no entry here or a bug passes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import ModuleType

SOLUTIONS = Path(__file__).resolve().parents[2] / "solutions"
_EDITED = Path(tempfile.mkdtemp(prefix="kit-seeded-bugs-"))


def edited_solution(lesson: int | str, *edits: tuple[str, str]) -> ModuleType:
    """Lesson ``lesson``'s solution (its number, ``13``; or its source's file name) with each
    ``(old, new)`` text edit made, loaded as a student's notebook would be: a bug built from the
    solution itself, one step changed. Each ``old`` must occur exactly once, so a stale edit
    fails loudly."""
    if isinstance(lesson, int):
        from autograder.course import lesson as spec

        source = f"{spec(lesson).stem}.py"
    else:
        source = lesson
    text = (SOLUTIONS / source).read_text()
    for old, new in edits:
        if text.count(old) != 1:
            raise AssertionError(f"{source}: the seeded edit's text occurs {text.count(old)} "
                                 f"times, not once: {old!r}")
        text = text.replace(old, new)
    folder = Path(tempfile.mkdtemp(dir=_EDITED))
    (folder / source).write_text(text)
    from autograder.loading import load_tasks

    return load_tasks(folder / source)


def edited_entry(lesson: int | str, name: str, *edits: tuple[str, str]) -> object:
    """``name`` (a task's function or class, or a companion) of :func:`edited_solution`'s module
    for ``lesson`` with ``edits`` made."""
    return getattr(edited_solution(lesson, *edits), name)


def solution_demo(lesson: int, name: str) -> object:
    """``name``, a class or function of a demo cell of lesson ``lesson``'s solution (given code,
    which the loader leaves out when no task uses it), defined in a fresh load of the solution so
    that it sees the solution's names: for a bug built on the lesson's own code."""
    from autograder.course import lesson as spec
    from autograder.loading import definitions_only, read_cells

    module = edited_solution(lesson)
    cell = next(c for c in read_cells(spec(lesson).source)
                if f"class {name}(" in c.source or f"def {name}(" in c.source)
    exec(definitions_only(cell.source), vars(module))  # the trusted solution's own cell
    return getattr(module, name)
