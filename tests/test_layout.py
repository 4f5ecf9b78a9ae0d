"""The code has one direction: ``kit`` runs ranks, ``autograder`` decides grades.

``autograder`` uses ``kit``; ``kit`` never imports ``autograder`` except in the two places a
lesson or the command line needs it: the lazy ``kit.check`` and ``kit.progress`` re-exports (every
notebook handed in calls ``from kit import check``) and the CLI's command table, which names
modules as strings.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

# (file, function) pairs of kit allowed to import autograder; None: at module level.
ALLOWED = {("__init__.py", "__getattr__")}


def _autograder_imports(path: Path) -> list[tuple[int, str | None]]:
    """(line, enclosing function) of every import of autograder in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []

    def visit(node: ast.AST, func: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = (
                child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            )
            names = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0:
                names = [child.module or ""]
            if any(n == "autograder" or n.startswith("autograder.") for n in names):
                found.append((child.lineno, func))
            visit(child, inner)

    visit(tree, None)
    return found


def test_kit_never_imports_autograder_outside_the_lazy_check_reexport():
    offenders = [f"kit/{name}:{line} (in {func or 'module level'})"
                 for p in sorted((ROOT / "kit").rglob("*.py"))
                 if (name := p.relative_to(ROOT / "kit").as_posix())
                 for line, func in _autograder_imports(p) if (name, func) not in ALLOWED]
    assert not offenders, ("kit must not import autograder (grading depends on kit, never the "
                           "reverse); move the code to autograder/: " + ", ".join(offenders))


def test_the_detector_finds_an_import_of_autograder(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import os\nfrom autograder.registry import task\n\ndef f():\n"
                      "    import autograder.checking\n")
    assert _autograder_imports(sample) == [(2, None), (5, "f")]


def test_the_cli_names_grading_commands_as_strings_only():
    from kit.cli import COMMANDS

    assert {name for name, (module, _, _) in COMMANDS.items() if module.startswith("autograder.")} \
        == {"build", "course", "grade", "doctor", "progress"}
    assert _autograder_imports(ROOT / "kit" / "cli.py") == []


def test_from_kit_import_check_still_gives_the_graders_check():
    import kit
    from autograder.checking import check

    assert kit.check is check


def test_the_engine_holds_no_lesson_helper():
    helpers = {p.stem for p in (ROOT / "kit" / "lessons").glob("*.py")} - {"__init__"}
    engine = {p.stem for p in (ROOT / "kit").glob("*.py")}
    assert helpers and not helpers & engine, f"in both kit/ and kit/lessons/: {helpers & engine}"
