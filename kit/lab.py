"""``kit lab``: open the course in JupyterLab on the first lesson.

Runs ``jupyter lab`` from the repository root with the first lesson open; widgets
(ipywidgets 8) and jupytext (so ``solutions/*.py`` open as notebooks) come with the install.
Extra arguments go to JupyterLab unchanged (``kit lab --no-browser --port 8890``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def course_root() -> Path:
    """The folder holding ``lessons/``: the current directory, else the source checkout."""
    for candidate in (Path.cwd(), Path(__file__).resolve().parent.parent):
        if (candidate / "lessons").is_dir():
            return candidate
    raise FileNotFoundError(
        "no lessons/ folder here or next to the kit package. Run `kit lab` from the course "
        "repository (git clone it, then `make lab`).")


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
    lessons = sorted((root / "lessons").glob("[0-9][0-9]_*.ipynb"))
    first = [str(lessons[0].relative_to(root))] if lessons else []
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={root}", *first, *argv]
    print("Starting JupyterLab on", root / "lessons", flush=True)
    os.chdir(root)
    os.execv(sys.executable, cmd)
    return 0  # not reached
