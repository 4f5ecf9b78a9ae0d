"""``kit lab``: open the course in JupyterLab on the first lesson.

Runs JupyterLab from the course root with ``lessons/`` first lesson open. Before starting it
checks that what a student needs is installed and switched on: the ipywidgets lab extension
(Lesson 01's ring stepper is a widget; without it a cell shows ``VBox(...)`` text) and jupytext
(so ``solutions/*.py`` open as notebooks: right-click, Open With, Jupytext Notebook). Extra
arguments go to JupyterLab unchanged (``kit lab --no-browser --port 8890``); ``kit lab --check``
only reports. The browser tests (``tests/test_browser.py``) start JupyterLab with
:func:`lab_command`, the same command a student runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

__all__ = ["course_root", "first_lesson", "lab_command", "main", "missing_pieces"]

# lab extension -> (the Python package that ships it, why a student needs it)
REQUIRED_EXTENSIONS = {
    "@jupyter-widgets/jupyterlab-manager": (
        "ipywidgets", "renders widgets such as Lesson 01's ring stepper"),
    "jupyterlab-jupytext": ("jupytext", "opens the lesson sources solutions/*.py as notebooks"),
}


def course_root() -> Path:
    """The folder holding ``lessons/``: the current directory, else the source checkout."""
    for candidate in (Path.cwd(), Path(__file__).resolve().parent.parent):
        if (candidate / "lessons").is_dir():
            return candidate
    raise FileNotFoundError(
        "no lessons/ folder here or next to the kit package. Run `kit lab` from the course "
        "repository (git clone it, then `make lab`).")


def first_lesson(root: Path) -> Path | None:
    """``lessons/00_*.ipynb`` (the lowest-numbered lesson), relative to ``root``."""
    lessons = sorted((root / "lessons").glob("[0-9][0-9]_*.ipynb"))
    return lessons[0].relative_to(root) if lessons else None


def _disabled_extensions() -> set[str]:
    """Lab extensions switched off in any ``labconfig/page_config.json`` Jupyter reads."""
    from jupyter_core.paths import jupyter_config_path

    disabled: set[str] = set()
    for folder in jupyter_config_path():
        path = Path(folder) / "labconfig" / "page_config.json"
        if path.is_file():
            try:
                entries = json.loads(path.read_text()).get("disabledExtensions", {})
            except (OSError, ValueError):
                continue
            if isinstance(entries, list):  # the older list form
                entries = dict.fromkeys(entries, True)
            disabled |= {name for name, off in entries.items() if off}
    return disabled


def missing_pieces() -> list[str]:
    """What a student's JupyterLab lacks, one line each with the fix; empty when all is there."""
    from jupyter_core.paths import jupyter_path

    problems = []
    if importlib.util.find_spec("jupyterlab") is None:
        return ["JupyterLab is not installed: run `pip install -e .` (or `make lab`)"]
    folders = [Path(p) for p in jupyter_path("labextensions")]
    disabled = _disabled_extensions()
    for name, (package, why) in REQUIRED_EXTENSIONS.items():
        if importlib.util.find_spec(package) is None or not any(
                (f / name / "package.json").is_file() for f in folders):
            problems.append(f"the {name} lab extension is missing ({why}): "
                            f"run `pip install {package}` in this environment")
        elif any(d == name or d.startswith(name + ":") for d in disabled):
            problems.append(f"the {name} lab extension is disabled ({why}): "
                            f"run `jupyter labextension enable {name}`")
    return problems


def lab_command(root: Path, extra: list[str] | None = None, *, open_first: bool = True) -> list[str]:
    """The JupyterLab command line ``kit lab`` runs: served from ``root``, first lesson open."""
    lesson = first_lesson(root) if open_first else None
    # Jupyter refuses to start as root (containers, CI, cloud boxes) unless told it may.
    as_root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={root}", *as_root,
            *([str(lesson)] if lesson else []), *(extra or [])]


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    try:
        root = course_root()
    except FileNotFoundError as e:
        print(f"kit lab: {e}", file=sys.stderr)
        return 2
    problems = missing_pieces()
    for problem in problems:
        print(f"kit lab: {problem}", file=sys.stderr)
    if argv[:1] == ["--check"]:
        if not problems:
            print("kit lab: JupyterLab, widgets and jupytext are ready; the course opens on",
                  first_lesson(root))
        return 1 if problems else 0
    if problems:
        return 2
    cmd = lab_command(root, argv)
    print("Starting JupyterLab on", root / "lessons", flush=True)
    os.chdir(root)
    os.execv(sys.executable, cmd)
    return 0  # not reached
