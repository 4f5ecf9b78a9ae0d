"""``kit run NOTEBOOK``: execute a lesson headless, as CI and instructors do.

    kit run solutions/00_launching_ranks.py            the lesson with its solutions
    kit run lessons/00_launching_ranks.ipynb -o out.ipynb

Runs every cell in a fresh kernel (nbclient), in the notebook's folder, with a progress bar,
and on failure names the cell (number, tag, first line) with its error and traceback. Accepts
a student ``.ipynb`` or a jupytext ``.py`` source.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kit.output import Progress

if TYPE_CHECKING:
    from nbformat import NotebookNode
# nbformat is imported where a notebook is read or written, not here: it validates with
# jsonschema, whose format checkers take over a second to import, and every grading worker and
# kernel imports this module only for NotebookError.

__all__ = ["CellFailure", "NotebookError", "RunResult", "read_notebook", "run_notebook"]

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class NotebookError(ValueError):
    """A notebook or source file cannot be read; the message names the file and the fix."""


@dataclass
class CellFailure:
    """The cell that stopped a run."""

    index: int  # 1-based, as JupyterLab counts
    label: str  # tag or first line
    kind: str  # error | timeout | kernel died
    summary: str  # e.g. "NameError: name 'x' is not defined"
    traceback: str = ""

    def __str__(self) -> str:
        text = f"cell {self.index} ({self.label}) failed: {self.summary}"
        return text + (f"\n{self.traceback}" if self.traceback else "")


@dataclass
class RunResult:
    path: Path
    seconds: float
    cells_run: int
    cells_total: int
    failure: CellFailure | None = None
    cell_seconds: dict[int, float] = field(default_factory=dict)
    notebook: NotebookNode | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    def slowest(self, n: int = 5) -> str:
        """The ``n`` slowest cells, one line each (``cell 12, 3.1 s: first line``), and what
        they printed that reads as a failed launch: for a time budget's failure message."""
        lines = []
        cells = self.notebook.cells if self.notebook is not None else []
        for index, seconds in sorted(self.cell_seconds.items(), key=lambda kv: -kv[1])[:n]:
            cell = cells[index - 1] if 0 < index <= len(cells) else None
            first = (cell.source.splitlines() or [""])[0][:70] if cell is not None else ""
            lines.append(f"cell {index}, {seconds:.1f} s: {first}")
            for out in cell.get("outputs", []) if cell is not None else []:
                text = out.get("text", "")
                if isinstance(text, str) and any(w in text for w in ("Error", "rank", "first")):
                    lines.append("    " + " | ".join(text.strip().splitlines()[:3])[:300])
        return f"{self.path.name} took {self.seconds:.0f} s; slowest cells:\n" + "\n".join(lines)


def read_notebook(path: Path) -> NotebookNode:
    """A ``.ipynb`` (validated) or a jupytext ``.py`` source, as an nbformat v4 notebook."""
    if not path.is_file():
        raise NotebookError(f"no such notebook: {path}")
    try:
        if path.suffix == ".py":
            import jupytext

            return jupytext.read(path, fmt="py:percent")
        if path.suffix == ".ipynb":
            import nbformat

            return nbformat.read(path, as_version=4)
    except Exception as e:
        raise NotebookError(f"{path} cannot be read as a notebook ({type(e).__name__}: {e}). "
                            "Restore it from .ipynb_checkpoints/ or re-download it.") from e
    raise NotebookError(f"{path}: expected a .ipynb notebook or a .py lesson source")


def _label(cell: NotebookNode) -> str:
    tags = cell.get("metadata", {}).get("tags") or []
    first = next((line for line in cell.source.splitlines() if line.strip()), "")
    first = first if len(first) <= 60 else first[:57] + "..."
    return f"{tags[0]}: {first}" if tags else first


def run_notebook(path: str | Path, *, timeout: float = 300, progress: Any = None,
                 kernel_name: str = "python3") -> RunResult:
    """Execute every code cell of ``path`` in a fresh kernel; stop at the first failing cell.

    Args:
        timeout: seconds one cell may run.
        progress: a stream for the progress bar (None: silent).
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    path = Path(path)
    nb = read_notebook(path)
    code_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    bar = Progress(len(code_cells), progress) if progress is not None else None
    state: dict[str, Any] = {"index": None, "started": 0.0}
    cell_seconds: dict[int, float] = {}

    def on_start(cell: NotebookNode, cell_index: int, **_: Any) -> None:
        state["index"], state["started"] = cell_index, time.perf_counter()

    def on_done(cell: NotebookNode, cell_index: int, **_: Any) -> None:
        seconds = time.perf_counter() - state["started"]
        cell_seconds[cell_index + 1] = seconds
        if bar and cell.cell_type == "code":
            bar.update(f"cell {cell_index + 1} ({seconds:.1f} s): {_label(cell)}")

    # The kernel's own start-up warnings (e.g. about TCP transport) are noise in a headless run.
    client = NotebookClient(nb, timeout=timeout, kernel_name=kernel_name, allow_errors=False,
                            extra_arguments=["--IPKernelApp.log_level=ERROR"],
                            resources={"metadata": {"path": str(path.resolve().parent)}},
                            on_cell_start=on_start, on_cell_executed=on_done)
    start = time.perf_counter()
    failure = None
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as e:
        index = state["index"] if state["index"] is not None else 0
        failure = _failure(nb.cells[index], index, e, timeout)
    finally:
        if bar:
            bar.close()
    ran = sum(1 for i in code_cells if i + 1 in cell_seconds)
    return RunResult(path, time.perf_counter() - start, ran, len(code_cells), failure, cell_seconds,
                     nb)


def _failure(cell: NotebookNode, index: int, e: Exception, timeout: float) -> CellFailure:
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    label = _label(cell)
    if isinstance(e, CellTimeoutError):
        return CellFailure(index + 1, label, "timeout",
                           f"did not finish within {timeout:g} s (raise it with --timeout)")
    if isinstance(e, DeadKernelError):
        return CellFailure(index + 1, label, "kernel died", "the kernel died while running this "
                           "cell (out of memory, or a crash in native code)")
    ename, evalue = getattr(e, "ename", type(e).__name__), getattr(e, "evalue", str(e))
    tb = ""
    for output in cell.get("outputs", []):
        if output.get("output_type") == "error":
            tb = _ANSI.sub("", "\n".join(output.get("traceback", [])))
    return CellFailure(index + 1, label, "error", f"{ename}: {evalue}", tb)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kit run",
                                     description="Execute a lesson notebook headless.")
    parser.add_argument("notebook", help="a lesson .ipynb, or a solutions/NN_slug.py source")
    parser.add_argument("-o", "--output", help="also write the executed notebook here")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per cell (default 300)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    path = Path(args.notebook)
    if args.output and Path(args.output).resolve() == path.resolve():
        print(f"kit run: --output would overwrite {path}; choose another file", file=sys.stderr)
        return 2
    try:
        result = run_notebook(path, timeout=args.timeout, progress=None if args.quiet
                              else sys.stderr)
    except NotebookError as e:
        print(f"kit run: {e}", file=sys.stderr)
        return 2
    if args.output and result.notebook is not None:
        import nbformat

        nbformat.write(result.notebook, args.output)
    if result.failure:
        print(f"kit run: {path}: {result.failure}", file=sys.stderr)
        print(f"kit run: {path}: FAILED at cell {result.failure.index} after {result.seconds:.1f} "
              f"s ({result.cells_run} of {result.cells_total} code cells ran)", file=sys.stderr)
        return 1
    print(f"kit run: {path}: all {result.cells_total} code cells ran in {result.seconds:.1f} s")
    return 0
