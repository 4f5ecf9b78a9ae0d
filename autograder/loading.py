"""Read lesson notebooks and load a lesson's graded code as an importable module.

Every runner grades the same code: the lesson's setup cell plus its solution cells, never the
demos. :func:`load_tasks` finds them in a ``solutions/NN_slug.py`` source or in a student's
``.ipynb`` (first by the cell's tag ``task-L.N`` or nbgrader ``grade_id``, then by the task's
function name), so a notebook whose cells were deleted, reordered or retyped still loads
whatever can be found, and its :class:`LoadReport` says exactly what could not.
"""

from __future__ import annotations

import ast
import builtins
import getpass
import hashlib
import importlib
import json
import os
import re
import symtable
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from autograder.registry import Task, lesson_tasks
from kit.runner import NotebookError

__all__ = [
    "Cell",
    "LoadReport",
    "NotebookError",
    "cell_role",
    "definitions_only",
    "grade_id",
    "lesson_of",
    "lessons_arg",
    "load_tasks",
    "read_cells",
]

SETUP = "setup"


@dataclass
class Cell:
    """One cell as read from a notebook, however damaged: type, source text and metadata."""

    index: int  # position in the notebook, counted from 1 as JupyterLab shows it
    cell_type: str
    source: str
    metadata: dict[str, Any]


def grade_id(kind: str, task_id: str | None = None) -> str:
    """nbgrader ``grade_id`` (and cell id) of a lesson cell: ``setup``, ``task-0-1``, ``check-0-1``.

    Dots are not allowed in cell ids and break formgrader's HTML ids, hence dashes.
    """
    return kind if task_id is None else f"{kind}-{task_id.replace('.', '-')}"


_TAG = re.compile(r"^(task|check)-(\d+\.\d+)$")
_GRADE_ID = re.compile(r"^(task|check)-(\d+)-(\d+)$")


def cell_role(cell: Cell) -> tuple[str, str | None]:
    """``("setup", None)``, ``("task", "0.1")``, ``("check", "0.1")`` or ``("demo", None)``.

    Read from the cell's tags, else from its nbgrader ``grade_id`` (students' notebooks keep
    one even when JupyterLab's tag editor lost the other).
    """
    tags = cell.metadata.get("tags") or []
    for tag in tags if isinstance(tags, list) else []:
        if tag == SETUP:
            return SETUP, None
        if isinstance(tag, str) and (m := _TAG.match(tag)):
            return m.group(1), m.group(2)
    nbgrader = cell.metadata.get("nbgrader")
    gid = nbgrader.get("grade_id") if isinstance(nbgrader, dict) else None
    if gid == SETUP:
        return SETUP, None
    if isinstance(gid, str) and (m := _GRADE_ID.match(gid)):
        return m.group(1), f"{m.group(2)}.{m.group(3)}"
    return "demo", None


def lessons_arg(text: str) -> list[int]:
    """``"00,01"`` -> ``[0, 1]``: the ``--lessons`` option of ``kit grade`` and ``kit course``."""
    import argparse

    try:
        lessons = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        lessons = []
    if not lessons:
        raise argparse.ArgumentTypeError("takes lesson numbers separated by commas, like 00,01; "
                                         f"got {text!r}")
    return lessons


def lesson_of(path: str | os.PathLike[str]) -> int | None:
    """The lesson number a file name starts with (``00_launching_ranks.ipynb`` -> 0), or None."""
    m = re.match(r"(\d+)[_-]", Path(path).name)
    return int(m.group(1)) if m else None


def read_cells(path: str | os.PathLike[str]) -> list[Cell]:
    """The cells of a jupytext ``.py`` source or an ``.ipynb``, tolerating damaged metadata."""
    path = Path(path)
    if not path.is_file():
        raise NotebookError(f"no such notebook: {path}. Check the path; lessons live in "
                            "lessons/NN_slug.ipynb and their sources in solutions/NN_slug.py.")
    if path.suffix == ".py":
        import jupytext

        try:
            nb = jupytext.read(path, fmt="py:percent")
        except Exception as e:  # jupytext raises several types for malformed headers
            raise NotebookError(f"{path} is not a readable jupytext percent source ({e}); "
                                "cells start with '# %%'.") from e
        raw_cells = [dict(c) for c in nb.cells]
        from autograder.course import render_source_markdown

        render_source_markdown(raw_cells, path.stem)
    elif path.suffix == ".ipynb":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise NotebookError(
                f"{path} is not valid notebook JSON ({e}). Repair it in a text editor, or restore "
                "it from .ipynb_checkpoints/ (File > Revert Notebook to Checkpoint in JupyterLab)."
            ) from e
        raw_cells = data.get("cells") if isinstance(data, dict) else None
        if not isinstance(raw_cells, list):
            raise NotebookError(f"{path} has no list of 'cells': it is not a Jupyter notebook "
                                "(nbformat 4). Restore it from a checkpoint or re-download it.")
    else:
        raise NotebookError(f"{path}: expected a .ipynb notebook or a .py lesson source, "
                            f"got a {path.suffix or 'file without extension'}.")
    cells = []
    for i, raw in enumerate(raw_cells, start=1):
        if not isinstance(raw, dict):
            continue
        source = raw.get("source", "")
        source = "".join(source) if isinstance(source, list) else str(source or "")
        metadata = raw.get("metadata") if isinstance(raw.get("metadata"), dict) else {}
        cells.append(Cell(i, str(raw.get("cell_type", "code")), source, metadata))
    return cells


# --------------------------------------------------------------------------- loading


@dataclass
class LoadReport:
    """What :func:`load_tasks` found, and exactly what it could not find and why."""

    path: Path
    lesson: int
    module_name: str = ""
    found: dict[str, str] = field(default_factory=dict)  # task id -> where it came from
    missing: dict[str, str] = field(default_factory=dict)  # task id (or "setup") -> why
    notes: list[str] = field(default_factory=list)
    # task id -> the code it was loaded from; "setup" -> the setup cells and helpers every task
    # of the notebook shares. What ``kit progress`` keys its remembered results on.
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not self.missing

    def __str__(self) -> str:
        lines = [f"{self.path.name}: lesson {self.lesson:02d}"]
        lines += [f"  found   {tid}: {where}" for tid, where in self.found.items()]
        lines += [f"  MISSING {tid}: {why}" for tid, why in self.missing.items()]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


@dataclass
class _Chunk:
    label: str  # e.g. "cell 9 (task-0.1)"
    code: str
    task_ids: list[str]
    cell: int = 0


_KEEP = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
         ast.Assign, ast.AnnAssign)


def _as_python(source: str) -> str | None:
    """Cell source with IPython magics commented out; None for a whole-cell magic (``%%...``)."""
    if source.lstrip().startswith("%%"):
        return None
    return "\n".join(f"# {line}" if line.lstrip()[:1] in {"%", "!"} else line
                     for line in source.splitlines())


def _definitions(code: str) -> tuple[str, set[str]]:
    """The top-level imports, defs, classes and assignments of ``code`` and the names defined.

    Demo statements a student left in a task cell (calls, loops, prints) are dropped, so loading
    never runs them. Raises SyntaxError.
    """
    tree = ast.parse(code)
    lines = code.splitlines()
    kept, names = [], set()
    for node in tree.body:
        if not isinstance(node, _KEEP):
            continue
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        kept.append("\n".join(lines[start - 1:node.end_lineno]))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
    return "\n".join(kept), names


def _syntax_problem(e: SyntaxError) -> str:
    return f"SyntaxError at line {e.lineno}: {e.msg}"


def _find_task(task: Task, cells: list[Cell], report: LoadReport) -> _Chunk | None:
    tag = f"task-{task.id}"
    tagged = [c for c in cells if cell_role(c) == ("task", task.id)]
    problems = []
    for cell in reversed(tagged):  # the last definition wins, as when the notebook runs
        code = _as_python(cell.source)
        try:
            kept, names = _definitions(code or "")
        except SyntaxError as e:
            problems.append(f"the cell tagged {tag} (cell {cell.index}) has a {_syntax_problem(e)}")
            continue
        if task.name in names:
            if cell.cell_type != "code":
                report.notes.append(f"cell {cell.index} ({tag}) is a {cell.cell_type} cell; "
                                    "its code was loaded anyway")
            report.found[task.id] = f"{task.name} in cell {cell.index} (tagged {tag})"
            return _Chunk(f"cell {cell.index} ({tag})", kept, [task.id], cell.index)
        problems.append(f"the cell tagged {tag} (cell {cell.index}) does not define {task.name}")
    # The tag and grade_id may be gone (metadata deleted, cell copied): look for the name.
    for cell in reversed(cells):
        if cell in tagged or cell_role(cell)[0] in {SETUP, "check"}:
            continue
        try:
            kept, names = _definitions(_as_python(cell.source) or "")
        except SyntaxError:
            continue
        if task.name in names:
            report.found[task.id] = f"{task.name} in cell {cell.index} (found by name)"
            if not tagged:
                report.notes.append(f"no cell is tagged {tag}; used the definition of "
                                    f"{task.name} in cell {cell.index}")
            return _Chunk(f"cell {cell.index} ({task.name})", kept, [task.id], cell.index)
    if not problems:
        problems.append(f"no cell is tagged {tag} and no cell defines "
                        f"`def {task.name}` or `class {task.name}`")
    report.missing[task.id] = f"{task.name}: " + "; ".join(problems)
    return None


def _setup_chunks(cells: list[Cell], report: LoadReport) -> list[_Chunk]:
    chunks = []
    for cell in cells:
        if cell_role(cell)[0] == SETUP and (code := _as_python(cell.source)):
            try:
                compile(code, f"cell {cell.index}", "exec")
            except SyntaxError as e:
                report.notes.append(f"setup cell {cell.index} has a {_syntax_problem(e)}; "
                                    "loaded the tasks without it")
                continue
            chunks.append(_Chunk(f"cell {cell.index} (setup)", code, []))
    if chunks:
        return chunks
    # No setup cell: keep every top-level import of the notebook so the tasks can still run, each
    # on its own, so that one that fails here (a module a demo wrote to disk) drops only itself.
    imports: dict[str, int] = {}
    for cell in cells:
        try:
            tree = ast.parse(_as_python(cell.source) or "")
        except SyntaxError:
            continue
        lines = cell.source.splitlines()
        for n in tree.body:
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                imports.setdefault("\n".join(lines[n.lineno - 1:n.end_lineno]), cell.index)
    report.missing[SETUP] = ("no setup cell (tag 'setup' or grade_id 'setup'); used the "
                             "notebook's import statements instead")
    return [_Chunk(f"an import of cell {index} (no setup cell)", code, [])
            for code, index in imports.items()]


def _free_names(code: str) -> set[str]:
    """Global names ``code`` reads but does not define itself (builtins excluded)."""
    found: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for sym in table.get_symbols():
            if table.get_type() == "module":
                if sym.is_referenced() and not (sym.is_assigned() or sym.is_imported()):
                    found.add(sym.get_name())
            elif sym.is_global() and sym.is_referenced():
                found.add(sym.get_name())
        for child in table.get_children():
            walk(child)

    walk(symtable.symtable(code, "<cell>", "exec"))
    return found - set(dir(builtins))


def _defined_names(code: str) -> set[str]:
    return {sym.get_name() for sym in symtable.symtable(code, "<cell>", "exec").get_symbols()
            if sym.is_assigned() or sym.is_imported()}


def _side_effect_free(node: ast.stmt) -> bool:
    """A def, a class, or an assignment of a literal: safe to run when loading."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return True
    if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
        try:
            ast.literal_eval(node.value)
        except ValueError:
            return False
        return True
    return False


def definitions_only(source: str) -> str:
    """The statements of a cell :func:`load_tasks` may take from it as helpers: its defs,
    classes and literal assignments, in order, as source text ("" for a whole-cell magic or a
    cell that does not parse). What grading runs of a demo cell, so that no demo code runs.
    """
    python = _as_python(source)
    try:
        tree = ast.parse(python or "")
    except SyntaxError:
        return ""
    lines = (python or "").splitlines()
    kept = []
    for node in tree.body:
        if _side_effect_free(node):
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            kept.append("\n".join(lines[start - 1:node.end_lineno]))
    return "\n\n".join(kept)


def _helper_chunks(chunks: list[_Chunk], cells: list[Cell], report: LoadReport) -> list[_Chunk]:
    """Definitions the tasks use from other cells (a student's helper function or constant).

    Only defs, classes and literal assignments are taken, so no demo code runs.
    """
    code = "\n".join(c.code for c in chunks)
    wanted = _free_names(code) - _defined_names(code)
    taken: dict[str, _Chunk] = {}
    loaded = {c.cell for c in chunks}
    while wanted:
        name = wanted.pop()
        for cell in reversed(cells):
            if cell.index in loaded or cell_role(cell)[0] in {SETUP, "check"}:
                continue
            try:
                source = _as_python(cell.source) or ""
                tree = ast.parse(source)
            except SyntaxError:
                continue
            lines = source.splitlines()
            node = next((n for n in reversed(tree.body) if _side_effect_free(n)
                         and name in _defined_names(ast.unparse(n))), None)
            if node is None:
                continue
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            helper = "\n".join(lines[start - 1:node.end_lineno])
            taken[name] = _Chunk(f"cell {cell.index} (helper {name})", helper, [])
            report.notes.append(f"loaded {name}, which the tasks use, from cell {cell.index}")
            wanted |= _free_names(helper) - _defined_names(code) - set(taken)
            break
    return list(taken.values())


def _modules_dir() -> Path:
    # One folder per user, on sys.path of this process and (through multiprocessing's
    # preparation data) of ranks started with spawn.
    uid = os.getuid() if hasattr(os, "getuid") else getpass.getuser()
    folder = Path(tempfile.gettempdir()) / f"kit-tasks-{uid}"
    folder.mkdir(mode=0o700, exist_ok=True)
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    return folder


def _module_name(path: Path, text: str) -> str:
    stem = re.sub(r"\W", "_", path.stem)
    digest = hashlib.sha1(f"{path.resolve()}\n{text}".encode()).hexdigest()[:12]
    return f"_kit_tasks_{stem}_{digest}"


def _render(chunks: list[_Chunk], path: Path) -> str:
    parts = [f"# Graded code of {path.name}, assembled by autograder.loading.load_tasks.\n"]
    parts += [f"# ---- {chunk.label}\n{chunk.code}\n" for chunk in chunks]
    return "\n".join(parts)


def _failing_chunk(exc: BaseException, file: Path, text: str, chunks: list[_Chunk]) -> int:
    """Index of the chunk whose code raised ``exc`` while the module was imported."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == file]
    if isinstance(exc, SyntaxError) and exc.lineno:
        line = exc.lineno
    elif frames:
        line = frames[0].lineno or 0
    else:
        return len(chunks) - 1
    header_lines = [i + 1 for i, row in enumerate(text.splitlines()) if row.startswith("# ---- ")]
    return max(0, sum(1 for h in header_lines if h <= line) - 1)


def load_tasks(path: str | os.PathLike[str], *, lesson: int | None = None) -> ModuleType:
    """Import the graded code of a lesson notebook or source as a module.

    The module holds the setup cell, each task's definition (found by the cell's tag
    ``task-L.N`` / nbgrader ``grade_id``, else by the task's function or class name) and the
    helpers those use from other cells (defs, classes, literal constants); demo code never runs. It
    is registered in ``sys.modules`` under a name derived from the path and content, from a file on
    ``sys.path``, so ranks started with spawn can import it too.
    ``module.__load_report__`` (a :class:`LoadReport`) lists what was found and what is missing.

    Args:
        path: ``solutions/NN_slug.py`` or a (student's) ``.ipynb``.
        lesson: the lesson whose tasks to look for; default: the number the file name starts with.

    Raises:
        NotebookError: the file is missing or unreadable, or its lesson cannot be told.
    """
    path = Path(path)
    cells = read_cells(path)
    lesson = lesson_of(path) if lesson is None else lesson
    if lesson is None:
        from autograder.course import LESSONS

        raise NotebookError(f"cannot tell which lesson {path.name} belongs to: name it "
                            f"NN_slug.ipynb (e.g. {LESSONS[0].stem}.ipynb) or pass lesson=NN.")
    tasks = lesson_tasks(lesson)
    if not tasks:
        raise NotebookError(f"lesson {lesson:02d} has no registered tasks "
                            f"(autograder/lesson{lesson:02d}.py); nothing to load from "
                            f"{path.name}.")
    report = LoadReport(path, lesson)
    chunks = _setup_chunks(cells, report)
    for task in tasks:
        chunk = _find_task(task, cells, report)
        if chunk is None:
            continue
        same = next((c for c in chunks if c.cell == chunk.cell), None)
        if same:  # one cell defining two tasks is loaded once
            same.task_ids += chunk.task_ids
        else:
            chunks.append(chunk)
    helpers = _helper_chunks(chunks, cells, report)
    setup = [c for c in chunks if not c.task_ids]
    ordered = setup + helpers + [c for c in chunks if c.task_ids]
    module = _import(ordered, path, report)  # drops the chunks that raised from ``ordered``
    report.sources = {tid: c.code for c in ordered for tid in c.task_ids}
    report.sources[SETUP] = "\n".join(c.code for c in ordered if not c.task_ids)
    return module


def _import(chunks: list[_Chunk], path: Path, report: LoadReport) -> ModuleType:
    folder = _modules_dir()
    while True:
        text = _render(chunks, path)
        name = _module_name(path, text)
        if name in sys.modules:
            module = sys.modules[name]
            break
        file = folder / f"{name}.py"
        if not file.exists():
            tmp = file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, file)  # atomic: a rank importing concurrently never sees half a file
        importlib.invalidate_caches()
        try:
            module = importlib.import_module(name)
            break
        except Exception as e:
            bad = chunks.pop(_failing_chunk(e, file, text, chunks))
            why = f"{bad.label} raised {type(e).__name__}: {e}"
            for tid in bad.task_ids:
                report.found.pop(tid, None)
                report.missing[tid] = why
            if not bad.task_ids:
                report.notes.append(f"{why}; loaded the tasks without it")
    report.module_name = name
    module.__load_report__ = report  # type: ignore[attr-defined]
    return module
