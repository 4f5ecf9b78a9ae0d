"""Build the student notebooks and nbgrader course folders from the lesson sources.

    kit build                 solutions/NN_slug.py -> lessons/NN_slug.ipynb
    kit build --check         fail (exit 1) if lessons/ is not what the sources build (CI)
    kit course DIR            write an nbgrader course: DIR/nbgrader_config.py, DIR/source/...

A source's tagged cells become nbgrader cells: ``setup`` a locked read-only cell,
``task-L.N`` a solution cell, ``check-L.N`` an autograded test cell worth the task's points
in :mod:`autograder`. nbgrader's own preprocessors then make the student version; the only
addition is :class:`TaskStubs`, which writes each task's message into the stub nbgrader's
``ClearSolutions`` leaves, so stubs raise ``NotImplementedError("Task 0.1: ...")``.
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import nbformat
from nbformat import NotebookNode
from nbgrader.preprocessors import NbGraderPreprocessor

from autograder import course
from autograder.loading import Cell, cell_role, definitions_only, grade_id, lesson_of, lessons_arg
from autograder.registry import get_task, lesson_tasks

__all__ = [
    "BuildError",
    "CODE_STUB",
    "TaskStubs",
    "build_lessons",
    "lesson_sources",
    "release_preprocessors",
    "render",
    "source_notebook",
    "student_notebook",
    "write_course",
]

STUB_MARK = "__KIT_TASK_STUB__"
# nbgrader's ClearSolutions puts this in place of every solution region; TaskStubs then
# replaces the marker by the task's message.
CODE_STUB = f'# YOUR CODE HERE\nraise NotImplementedError("{STUB_MARK}")'
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
COURSE_ID = "torchdist-course"
# nbgrader's default per-cell timeout is 30 s; distributed cells start processes and may sit
# out a launch timeout (60 s by default) before they report.
EXECUTE_TIMEOUT_S = 300


class BuildError(ValueError):
    """A lesson source is malformed; the message names the file, the cell and the fix."""


# --------------------------------------------------------------------------- nbgrader glue


def _first_doc_line(node: ast.AST) -> str:
    lines = (ast.get_docstring(node) or "").strip().splitlines()
    return lines[0] if lines else ""


def stub_message(task_id: str | None, source: str, line: int | None = None) -> str:
    """``"Task 0.1: <first docstring line>"`` (else the task's hint) for a stubbed cell.

    With ``line``, the docstring is that of the innermost documented function or class around
    that line, so a task of two functions (Task 1.4) gets a message per function.
    """
    if task_id is None:
        return "Task: replace this line with your code"
    task = get_task(task_id)
    doc = ""
    try:
        defs = [n for n in ast.walk(ast.parse(source))
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    except SyntaxError:
        defs = []
    if line is not None:
        around = [n for n in defs if n.lineno <= line <= (n.end_lineno or n.lineno)
                  and _first_doc_line(n)]
        if around:
            doc = _first_doc_line(max(around, key=lambda n: n.lineno))
    if not doc:
        doc = next((_first_doc_line(n) for n in defs if n.name == task.name), "")
    return f"Task {task_id}: {doc or task.hint or f'implement {task.name}'}"


class TaskStubs(NbGraderPreprocessor):
    """Name the task in the stub ``ClearSolutions`` left (configure ``code_stub=CODE_STUB``)."""

    def preprocess_cell(self, cell: NotebookNode, resources: dict[str, Any],
                        cell_index: int) -> tuple[NotebookNode, dict[str, Any]]:
        if cell.cell_type == "code" and STUB_MARK in cell.source:
            role, task_id = cell_role(Cell(cell_index + 1, cell.cell_type, cell.source,
                                           cell.metadata))
            task_id = task_id if role == "task" else None
            lines = cell.source.split("\n")
            for i, text in enumerate(lines):
                if f'"{STUB_MARK}"' in text:
                    message = stub_message(task_id, cell.source, i + 1)
                    lines[i] = text.replace(f'"{STUB_MARK}"',
                                            json.dumps(message, ensure_ascii=False))
            cell.source = "\n".join(lines)
        return cell, resources


def release_preprocessors() -> list[type]:
    """nbgrader's ``GenerateAssignment`` preprocessors with :class:`TaskStubs` after
    ClearSolutions."""
    from nbgrader.converters import GenerateAssignment
    from nbgrader.preprocessors import ClearSolutions

    out: list[type] = []
    for pp in GenerateAssignment.class_traits()["preprocessors"].default():
        out.append(pp)
        if pp is ClearSolutions:
            out.append(TaskStubs)
    return out


DEMO_KEY = "kit_demo_source"  # cell metadata: a demo cell's source while autograde runs
DEMO_NOT_RUN = ("(not run by nbgrader autograde: grading runs the setup, task and check cells and "
                "only the definitions of other cells, as `kit grade` does)\n")


class DemoDefinitionsOnly(NbGraderPreprocessor):
    """Before autograde executes a submission: every demo cell (neither setup, task nor check;
    a cell the student added counts as one) keeps only its definitions (defs, classes, literal
    assignments), the code :func:`autograder.loading.load_tasks` may take from it.

    So nbgrader grades the code ``kit grade`` grades, and does not spend each submission's time
    on the lesson's demos (Lesson 00's start ranks by hand, wait out a hang and time spawns:
    about 30 s). The source is kept in the cell's metadata for :class:`DemoSourcesRestored`.
    """

    def preprocess_cell(self, cell: NotebookNode, resources: dict[str, Any],
                        cell_index: int) -> tuple[NotebookNode, dict[str, Any]]:
        if cell.cell_type == "code" and cell_role(
                Cell(cell_index + 1, cell.cell_type, cell.source, cell.metadata))[0] == "demo":
            cell.metadata[DEMO_KEY] = cell.source
            cell.source = definitions_only(cell.source)
        return cell, resources


class DemoSourcesRestored(NbGraderPreprocessor):
    """After autograde executed a submission: each demo cell gets its own source back, and a
    one-line output saying it was not run (the autograded notebook and its feedback show the
    student's code as written)."""

    def preprocess_cell(self, cell: NotebookNode, resources: dict[str, Any],
                        cell_index: int) -> tuple[NotebookNode, dict[str, Any]]:
        if cell.cell_type == "code" and DEMO_KEY in cell.metadata:
            cell.source = cell.metadata.pop(DEMO_KEY)
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=DEMO_NOT_RUN)]
            cell.execution_count = None
        return cell, resources


def autograde_preprocessors() -> list[type]:
    """nbgrader's ``Autograde`` preprocessors with the demo cells cut down to their definitions
    while ``Execute`` runs (:class:`DemoDefinitionsOnly`, :class:`DemoSourcesRestored`)."""
    from nbgrader.converters import Autograde
    from nbgrader.preprocessors import Execute

    out: list[type] = []
    for pp in Autograde.class_traits()["autograde_preprocessors"].default():
        out.extend([DemoDefinitionsOnly, pp, DemoSourcesRestored] if pp is Execute else [pp])
    return out


# --------------------------------------------------------------------------- source -> notebooks


def lesson_sources(root: Path) -> list[Path]:
    """The course spec's lesson sources under ``root`` (``solutions/NN_slug.py``), in order."""
    return [root / "solutions" / f"{spec.stem}.py" for spec in course.LESSONS]


def spec_problems(root: Path) -> list[str]:
    """What in ``root`` disagrees with the course spec: a spec lesson without its source, a
    source no spec lesson names."""
    problems = []
    for spec in course.LESSONS:
        if not (root / "solutions" / f"{spec.stem}.py").is_file():
            problems.append(f"solutions/{spec.stem}.py is missing: autograder/course.py lists "
                            f"lesson {spec.number:02d} ({spec.slug}); write its source, or "
                            "remove its entry")
    for path in sorted((root / "solutions").glob("*.py")):
        if course.by_stem(path.stem) is None:
            problems.append(f"solutions/{path.name} is no lesson of autograder/course.py: add "
                            "a Lesson(...) entry there (number, slug, title, tasks), or rename "
                            "the file to its lesson's NN_slug.py")
    return problems


_TASK_WORDS = re.compile(r"\bTasks? (\d+\.\d+)")
_HEADING_NAME = re.compile(r"^#+ .*\bTask (\d+\.\d+): `([\w.]+)`", re.M)


def _render_markdown(spec: course.Lesson, nb: NotebookNode, path: Path) -> None:
    """Fill in every markdown cell's marks from the spec, and refuse facts stated by hand."""
    ids = {t.id: t for t in spec.tasks}
    first = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    if first is None or not first.source.lstrip().startswith("# {{title}}"):
        raise BuildError(f"{path}: the first markdown cell must start with the heading "
                         "`# {{title}}` (the title is autograder/course.py's)")
    missing = [t for t in ids if not re.search(r"\{\{\s*task " + re.escape(t) + r"\s*\}\}",
                                               first.source)]
    if missing:
        raise BuildError(f"{path}: the intro (first markdown cell) must name every task with "
                         f"its mark; add {', '.join('{{task ' + t + '}}' for t in missing)}")
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        where = f"{path}, cell {i + 1}"
        if (m := course.STATED_POINTS.search(cell.source)):
            raise BuildError(f"{where}: {m.group(0)!r} states points by hand; write "
                             f"{{{{task {m.group(1)}}}}}, which the build fills in from "
                             "autograder/course.py")
        for task_id in _TASK_WORDS.findall(cell.source):
            if task_id.split(".")[0] == str(spec.number) and task_id not in ids:
                raise BuildError(f"{where}: the text names Task {task_id}, which lesson "
                                 f"{spec.number:02d} does not have (its tasks: {', '.join(ids)})")
        for task_id, name in _HEADING_NAME.findall(cell.source):
            t = ids.get(task_id)
            if t is not None and name.split(".")[0] not in (t.name, *t.companions):
                raise BuildError(f"{where}: the heading calls Task {task_id} `{name}`; its "
                                 f"entry is `{t.name}` (autograder/course.py)")
        try:
            cell.source = course.render_marks(cell.source, spec)
        except course.MarkError as e:
            raise BuildError(f"{where}: {e}") from None


def _defines(source: str, name: str) -> bool:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
               and n.name == name
               for n in tree.body)


def _calls_check(source: str, task_id: str, name: str) -> bool:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "check"
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Constant)
                and node.args[0].value == task_id
                and isinstance(node.args[1], ast.Name) and node.args[1].id == name):
            return True
    return False


def _nbgrader_meta(role: str, task_id: str | None) -> dict[str, Any] | None:
    base = {"grade_id": grade_id(role, task_id), "schema_version": 3}
    if role == "setup":
        return {**base, "grade": False, "solution": False, "locked": True}
    if role == "task":
        return {**base, "grade": False, "solution": True, "locked": False}
    if role == "check":
        return {**base, "grade": True, "solution": False, "locked": True,
                "points": get_task(task_id).points}
    return None


def source_notebook(path: Path) -> NotebookNode:
    """The nbgrader *source* notebook of a lesson: solutions in, nbgrader metadata set.

    Raises:
        BuildError: a tag names an unregistered task, a task lacks its cell or check cell, ...
    """
    import jupytext

    spec = course.by_stem(path.stem)
    if spec is None:
        raise BuildError(f"{path}: no lesson of autograder/course.py has this stem; a lesson "
                         "source is named solutions/NN_slug.py after its Lesson(...) entry")
    lesson = spec.number
    try:
        nb = jupytext.read(path, fmt="py:percent")
    except Exception as e:
        raise BuildError(f"{path}: not a jupytext percent source ({e})") from e
    _render_markdown(spec, nb, path)
    tasks = {t.id: t for t in lesson_tasks(lesson)}
    positions: dict[tuple[str, str | None], int] = {}
    ids: set[str] = set()
    for i, cell in enumerate(nb.cells):
        where = f"{path}, cell {i + 1}"
        tags = cell.metadata.get("tags", [])
        role, task_id = cell_role(Cell(i + 1, cell.cell_type, cell.source, cell.metadata))
        if role != "demo":
            if (role, task_id) in positions:
                raise BuildError(f"{where}: a second cell tagged {tags}; each tag appears once")
            positions[role, task_id] = i
        if task_id is not None:
            task = tasks.get(task_id)
            if task is None:
                raise BuildError(
                    f"{where}: tag {role}-{task_id} names no task of lesson {lesson:02d} (known: "
                    f"{', '.join(tasks) or 'none'}); register it in "
                    f"autograder/lesson{lesson:02d}.py with task({task_id!r}, ...)")
            if role == "task" and not _defines(cell.source, task.name):
                raise BuildError(f"{where}: the cell tagged task-{task_id} must define {task.name}")
            if role == "task" and not ("BEGIN SOLUTION" in cell.source
                                       and "END SOLUTION" in cell.source):
                raise BuildError(f"{where}: put the solution of task {task_id} between "
                                 "### BEGIN SOLUTION and ### END SOLUTION")
            if role == "check" and not _calls_check(cell.source, task_id, task.name):
                raise BuildError(f'{where}: the check cell must call check("{task_id}", '
                                 f'{task.name})')
        if role != "demo" and cell.cell_type != "code":
            raise BuildError(f"{where}: a cell tagged {tags} must be a code cell")
        # Stable ids: tagged cells by role, others by content, so an edit moves no other id.
        if role != "demo":
            cell.id = grade_id(role, task_id)
        else:
            digest = hashlib.sha1(cell.source.encode()).hexdigest()[:8]
            cell.id = base = f"{cell.cell_type[:4]}-{digest}"
            n = 2
            while cell.id in ids:
                cell.id, n = f"{base}-{n}", n + 1
        ids.add(cell.id)
        cell.metadata = {"tags": tags} if tags else {}
        if (meta := _nbgrader_meta(role, task_id)) is not None:
            cell.metadata["nbgrader"] = meta
    if ("setup", None) not in positions:
        raise BuildError(f'{path}: no setup cell; tag the imports cell with # %% tags=["setup"]')
    for task_id, task in tasks.items():
        for role in ("task", "check"):
            if (role, task_id) not in positions:
                raise BuildError(f'{path}: task {task_id} ({task.name}) has no cell tagged '
                                 f'{role}-{task_id}; add # %% tags=["{role}-{task_id}"]')
        if positions["check", task_id] < positions["task", task_id]:
            raise BuildError(f"{path}: the check-{task_id} cell must come after the task-{task_id} "
                             "cell")
    nb.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": {"name": "python"}}
    nb.nbformat, nb.nbformat_minor = 4, 5
    nbformat.validate(nb)
    return nb


def student_notebook(source: NotebookNode) -> NotebookNode:
    """The student version: nbgrader's release preprocessors, minus the ones that need a course
    database or header files (SaveCells, IncludeHeaderFooter, InstantiateTests)."""
    from nbgrader.preprocessors import IncludeHeaderFooter, InstantiateTests, SaveCells
    from traitlets.config import Config

    config = Config()
    config.ClearSolutions.code_stub = {"python": CODE_STUB}
    nb = copy.deepcopy(source)
    resources: dict[str, Any] = {}
    for pp in release_preprocessors():
        if pp in (IncludeHeaderFooter, InstantiateTests, SaveCells):
            continue
        nb, resources = pp(config=config).preprocess(nb, resources)
    return nb


def render(nb: NotebookNode) -> str:
    """The exact text written to disk (sorted keys, one-space indent, trailing newline)."""
    return nbformat.writes(nb, version=4) + "\n"


def build_lessons(root: Path, *, check: bool = False) -> list[str]:
    """Write ``lessons/`` from ``solutions/``; with ``check``, write nothing and return problems."""
    if not (root / "solutions").is_dir():
        raise BuildError(f"no lesson sources (solutions/NN_slug.py) under {root}: run kit build "
                         "from the course repository's root, or pass --root")
    problems = spec_problems(root)
    sources = [s for s in lesson_sources(root) if s.is_file()]
    lessons = root / "lessons"
    problems += readme_problems(root, check=check)
    for src in sources:
        out = lessons / f"{src.stem}.ipynb"
        text = render(student_notebook(source_notebook(src)))
        current = out.read_text(encoding="utf-8") if out.exists() else None
        if current == text:
            continue
        if check:
            rel_out, rel_src = out.relative_to(root), src.relative_to(root)
            why = (f"is missing (built from {rel_src})" if current is None
                   else f"is stale: it differs from what {rel_src} builds")
            problems.append(f"{rel_out} {why}. Run `kit build` and commit lessons/.")
        else:
            lessons.mkdir(exist_ok=True)
            out.write_text(text, encoding="utf-8")
            print(f"wrote {out.relative_to(root)}")
    stems = {s.stem for s in sources}
    for orphan in sorted(lessons.glob("*.ipynb")) if lessons.is_dir() else []:
        if orphan.stem not in stems:
            problems.append(f"{orphan.relative_to(root)} has no source solutions/{orphan.stem}.py: "
                            "restore the source, or delete the notebook.")
    return problems


README_BEGIN = "<!-- lesson table: written by `kit build` from autograder/course.py -->"
README_END = "<!-- end of lesson table -->"


def readme_problems(root: Path, *, check: bool) -> list[str]:
    """Write README.md's lesson table from the spec (between its two markers); with ``check``,
    write nothing and say whether it is stale."""
    readme = root / "README.md"
    if not readme.is_file():
        return []
    text = readme.read_text(encoding="utf-8")
    if text.count(README_BEGIN) != 1 or text.count(README_END) != 1:
        return [f"README.md must hold the lesson table between the lines {README_BEGIN} and "
                f"{README_END}, once"]
    head, rest = text.split(README_BEGIN)
    _, tail = rest.split(README_END)
    new = f"{head}{README_BEGIN}\n{course.readme_table()}\n{README_END}{tail}"
    if new == text:
        return []
    if check:
        return ["README.md's lesson table is stale: it differs from autograder/course.py. Run "
                "`kit build` and commit README.md."]
    readme.write_text(new, encoding="utf-8")
    print("wrote README.md's lesson table")
    return []


# --------------------------------------------------------------------------- nbgrader course

_CONFIG = f'''\
# nbgrader configuration of the torchdist course, written by `kit course`.
#   nbgrader generate_assignment {course.LESSONS[0].stem}     release/ from source/
#   nbgrader autograde {course.LESSONS[0].stem}               grade submitted/
c = get_config()  # noqa: F821

c.CourseDirectory.course_id = "{COURSE_ID}"

# Stubs name their task, NotImplementedError("Task 0.1: ..."), exactly as in lessons/.
from autograder.build import CODE_STUB, autograde_preprocessors, release_preprocessors  # noqa: E402

c.ClearSolutions.code_stub = {{"python": CODE_STUB}}
c.GenerateAssignment.preprocessors = release_preprocessors()
# autograde runs the setup, task and check cells, and only the definitions of the other cells
# (the demos), as `kit grade` does; the graded notebook shows every cell's source as submitted.
c.Autograde.autograde_preprocessors = autograde_preprocessors()

# Distributed cells start processes and may wait out a launch timeout before they report:
# nbgrader's default of 30 s per cell would cut them off.
c.Execute.timeout = {EXECUTE_TIMEOUT_S}
c.Execute.interrupt_on_timeout = True
c.Execute.startup_timeout = 120
'''


def write_course(dest: Path, root: Path, *, lessons: list[int] | None = None,
                 force: bool = False) -> list[Path]:
    """Write ``dest/nbgrader_config.py`` and ``dest/source/<lesson>/<lesson>.ipynb``.

    Files that exist with other content are left alone unless ``force`` (an instructor's edits
    are never lost silently). Returns the paths written.
    """
    sources = [s for s in lesson_sources(root) if lessons is None or lesson_of(s) in lessons]
    if not sources:
        wanted = "any lesson" if lessons is None else ", ".join(f"{n:02d}" for n in lessons)
        raise BuildError(f"no lesson source for {wanted} under {root / 'solutions'}")
    files = {dest / "nbgrader_config.py": _CONFIG}
    for src in sources:
        files[dest / "source" / src.stem / f"{src.stem}.ipynb"] = render(source_notebook(src))
    clashes = [p for p, text in files.items() if p.exists()
               and p.read_text(encoding="utf-8") != text]
    if clashes and not force:
        raise BuildError("these files exist with other content: "
                         + ", ".join(str(p) for p in clashes)
                         + ". Pass --force to overwrite them, or choose another DIR.")
    written = []
    for p, text in files.items():
        if not p.exists() or p.read_text(encoding="utf-8") != text:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text, encoding="utf-8")
            written.append(p)
    return written


# --------------------------------------------------------------------------- CLI


def _root(arg: str | None) -> Path:
    return Path(arg).resolve() if arg else Path.cwd()


def main_build(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kit build",
                                     description="Build lessons/ from solutions/.")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if lessons/ is stale (for CI)")
    parser.add_argument("--root", help="course repository root (default: the current directory)")
    args = parser.parse_args(argv)
    try:
        problems = build_lessons(_root(args.root), check=args.check)
    except BuildError as e:
        print(f"kit build: {e}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"kit build: {problem}", file=sys.stderr)
    if not problems and args.check:
        print("kit build --check: lessons/ and README's lesson table are up to date")
    return 1 if problems else 0


def main_course(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kit course",
                                     description="Write a ready nbgrader course directory.")
    parser.add_argument("dir", help="the course directory to write (created if missing)")
    parser.add_argument("--lessons", type=lessons_arg,
                        help="only these lessons, e.g. 00,01 (default: all)")
    parser.add_argument("--force", action="store_true", help="overwrite files that differ")
    parser.add_argument("--root", help="course repository root (default: the current directory)")
    args = parser.parse_args(argv)
    dest = Path(args.dir)
    try:
        written = write_course(dest, _root(args.root), lessons=args.lessons, force=args.force)
    except BuildError as e:
        print(f"kit course: {e}", file=sys.stderr)
        return 2
    for p in written:
        print(f"wrote {p}")
    names = sorted(p.name for p in (dest / "source").iterdir() if p.is_dir())
    print(f"\nNext: cd {dest} && nbgrader generate_assignment {names[0]}  "
          f"(assignments: {', '.join(names)})")
    return 0
