"""``make site``: the course as a static HTML book for self-paced readers (Sphinx with myst-nb).

    make site                                   build/site/html/index.html
    .venv/bin/python -m autograder.site --no-execute   fail instead of executing a lesson

Every lesson is a page with its prose, figures and outputs, but its task cells are the stubs a
student gets (the same ones ``kit build`` writes to ``lessons/``) and its check cells show no
result: no solution region's code reaches the site. The outputs come from the executed
notebooks the headless lesson tests already produce (kept in ``build/executed/``, each stamped
with the hash of the source it ran); a lesson with none, or a stale one, is executed once here,
unless ``--no-execute``. Sphinx with myst-nb was chosen over Jupyter Book 2 because it is pure
Python (Jupyter Book 2's MyST engine needs Node.js) and renders stored outputs as they are
(``nb_execution_mode = "off"``).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat

from autograder.build import lesson_sources, source_notebook, student_notebook
from autograder.loading import Cell, cell_role

__all__ = ["SiteReport", "build_site", "executed_dir", "keep_executed", "main"]

ROOT = Path(__file__).resolve().parents[1]
WIDGET = "application/vnd.jupyter.widget-view+json"
WIDGET_NOTE = ("[an interactive widget: open the notebook in JupyterLab (`make lab`) to use it]\n")


def executed_dir(root: Path = ROOT) -> Path:
    """Where executed lesson notebooks are kept: ``build/executed/`` (git-ignored)."""
    return root / "build" / "executed"


def _source_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def keep_executed(result: Any, root: Path = ROOT) -> Path | None:
    """Keep the notebook of a successful headless run of a lesson source (``solutions/NN_*.py``)
    for the site, stamped with the source's hash. Anything else is ignored; returns the path."""
    path = Path(result.path).resolve()
    if not result.ok or result.notebook is None or path.parent != (root / "solutions").resolve():
        return None
    nb = copy.deepcopy(result.notebook)
    nb.metadata.setdefault("kit", {})["source_sha256"] = _source_hash(path)
    out = executed_dir(root) / f"{path.stem}.ipynb"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    nbformat.write(nb, tmp)
    tmp.replace(out)
    return out


@dataclass
class SiteReport:
    html: Path
    pages: list[str] = field(default_factory=list)
    executed_here: list[str] = field(default_factory=list)  # lessons run by this build
    unexecuted: list[str] = field(default_factory=list)  # lessons shown without outputs
    seconds: float = 0.0
    bytes: int = 0


def _executed(src: Path, folder: Path) -> Any | None:
    path = folder / f"{src.stem}.ipynb"
    if not path.is_file():
        return None
    nb = nbformat.read(path, as_version=4)
    if nb.metadata.get("kit", {}).get("source_sha256") != _source_hash(src):
        return None  # stale: the lesson changed since it ran
    return nb


def _outputs(outputs: list[Any]) -> list[Any]:
    """Stored outputs for a static page: widgets (which need a kernel) become a note."""
    kept = []
    for out in outputs:
        data = out.get("data")
        if data and WIDGET in data:
            kept.append(nbformat.v4.new_output("stream", name="stdout", text=WIDGET_NOTE))
            continue
        kept.append(out)
    return kept


def _page(src: Path, executed: Any | None) -> Any:
    """The student's notebook of ``src`` with the executed demo cells' outputs."""
    page = student_notebook(source_notebook(src))
    if executed is None:
        return page
    if [c.cell_type for c in executed.cells] != [c.cell_type for c in page.cells]:
        raise ValueError(f"{src.name}: the executed notebook's cells do not match the source")
    for i, (cell, ran) in enumerate(zip(page.cells, executed.cells)):
        if cell.cell_type != "code":
            continue
        role, _ = cell_role(Cell(i + 1, cell.cell_type, cell.source, cell.metadata))
        if role in ("task", "check"):  # a stub and its check: no solution's result is shown
            cell.outputs, cell.execution_count = [], None
            continue
        cell.outputs = _outputs(ran.get("outputs", []))
        cell.execution_count = ran.get("execution_count")
    return page


def _title(nb: Any, fallback: str) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return fallback


_CONF = '''\
project = "Distributed PyTorch, hands on"
extensions = ["myst_nb"]
nb_execution_mode = "off"  # the stored outputs of the executed lessons, as they are
nb_output_stderr = "show"
html_theme = "alabaster"
html_title = project
exclude_patterns = ["_build"]
suppress_warnings = ["mystnb.unknown_mime_type", "myst.header"]
'''


def build_site(root: Path = ROOT, out: Path | None = None, *, execute_missing: bool = True,
               executed: Path | None = None, lessons: list[str] | None = None) -> SiteReport:
    """Write the site to ``out/html`` (default ``build/site``) and return what it holds.

    Args:
        execute_missing: run a lesson headless when it has no current executed notebook
            (else it is shown without outputs and listed in ``unexecuted``).
        executed: the folder of executed notebooks (default :func:`executed_dir`).
        lessons: stems to include (default: every lesson source).
    """
    start = time.perf_counter()
    out = out or root / "build" / "site"
    executed = executed or executed_dir(root)
    src_dir = out / "src"
    shutil.rmtree(out, ignore_errors=True)
    (src_dir / "lessons").mkdir(parents=True)
    report = SiteReport(out / "html")
    entries = []
    for src in lesson_sources(root):
        if lessons is not None and src.stem not in lessons:
            continue
        nb = _executed(src, executed)
        if nb is None and execute_missing:
            from kit.runner import run_notebook

            print(f"site: executing {src.name} (no current executed notebook)", flush=True)
            result = run_notebook(src, timeout=600)
            if not result.ok:
                raise RuntimeError(f"{src.name} failed at cell {result.failure.cell}: "
                                   f"{result.failure.message}")
            keep_executed(result, root)
            nb = _executed(src, executed)
            report.executed_here.append(src.stem)
        if nb is None:
            report.unexecuted.append(src.stem)
        page = _page(src, nb)
        nbformat.write(page, src_dir / "lessons" / f"{src.stem}.ipynb")
        entries.append((src.stem, _title(page, src.stem)))
        report.pages.append(src.stem)
    (src_dir / "conf.py").write_text(_CONF, encoding="utf-8")
    index = ["# Distributed PyTorch, hands on", "",
             "Every lesson of the course, with its figures and outputs. The graded tasks are "
             "shown as the stubs you get: open the notebooks in JupyterLab (`make lab`) to write "
             "and check them.", "", "```{toctree}", ":maxdepth: 1", ""]
    index += [f"lessons/{stem}" for stem, _ in entries] + ["```", ""]
    (src_dir / "index.md").write_text("\n".join(index), encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", str(src_dir),
                           str(report.html)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"sphinx failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report.seconds = time.perf_counter() - start
    report.bytes = sum(p.stat().st_size for p in report.html.rglob("*") if p.is_file())
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autograder.site",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="output folder (default: build/site)")
    parser.add_argument("--no-execute", action="store_true",
                        help="never run a lesson: one without an executed notebook has no outputs")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = build_site(out=args.out, execute_missing=not args.no_execute)
    if args.json:
        print(json.dumps({**report.__dict__, "html": str(report.html)}, indent=1))
    else:
        print(f"site: {len(report.pages)} lessons in {report.seconds:.1f} s, "
              f"{report.bytes / 1e6:.1f} MB: open {report.html / 'index.html'}")
        if report.unexecuted:
            print("site: shown without outputs (no executed notebook): "
                  + ", ".join(report.unexecuted))
    return 0


if __name__ == "__main__":
    sys.exit(main())
