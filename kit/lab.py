"""``kit lab``: open the course in JupyterLab on the first lesson.

Runs JupyterLab from the course root with ``lessons/`` first lesson open. Before starting it
checks that what a student needs is installed and switched on: the ipywidgets lab extension
(Lesson 01's ring stepper is a widget; without it a cell shows ``VBox(...)`` text) and jupytext
(so ``solutions/*.py`` open as notebooks: right-click, Open With, Jupytext Notebook). Extra
arguments go to JupyterLab unchanged (``kit lab --no-browser --port 8890``); ``kit lab --check``
only reports. The browser tests (``tests/test_browser.py``) start JupyterLab with
:func:`lab_command` and :func:`lab_environment`, the same command a student runs.

A student's Lab shows the course, not nbgrader's instructor tools: ``kit lab`` switches off, for
that session only, nbgrader's Create Assignment panel, formgrader, course list, assignment list
(the exchange's fetch and submit, which a course run from this folder has no use for) and their
Nbgrader menu, keeping Validate. ``kit lab --instructor`` keeps them all. Either way the terminal
shows the URL and what the user can act on, not JupyterLab's start-up log.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

__all__ = ["INSTRUCTOR_PLUGINS", "INSTRUCTOR_SERVER_EXTENSIONS", "course_root", "first_lesson",
           "lab_command", "lab_environment", "main", "missing_pieces", "session_config_dir"]

# lab extension -> (the Python package that ships it, why a student needs it)
REQUIRED_EXTENSIONS = {
    "@jupyter-widgets/jupyterlab-manager": (
        "ipywidgets", "renders widgets such as Lesson 01's ring stepper"),
    "jupyterlab-jupytext": ("jupytext", "opens the lesson sources solutions/*.py as notebooks"),
}


# nbgrader's lab plugins a student's Lab leaves out (validate-assignment stays: the Validate
# button).
INSTRUCTOR_PLUGINS = (
    "@jupyter/nbgrader:create-assignment", "@jupyter/nbgrader:formgrader",
    "@jupyter/nbgrader:course-list", "@jupyter/nbgrader:assignment-list", "@jupyter/nbgrader:menu",
)
# ... and the server extensions behind them (formgrader warns at start without an nbgrader course).
INSTRUCTOR_SERVER_EXTENSIONS = (
    "nbgrader.server_extensions.formgrader", "nbgrader.server_extensions.course_list",
    "nbgrader.server_extensions.assignment_list",
)
# Loaded by the server from the session's config folder: warnings at WARN and above only, minus
# those nobody at the keyboard can act on (every lesson is unsigned, so each open says "not
# trusted"; language servers that are not installed).
_QUIET_SERVER_CONFIG = """\
# Written by `kit lab` for this session; rewritten at every start.
import logging
import os

_NOISE = {noise!r}


class _Quiet(logging.Filter):
    def filter(self, record):
        message = record.getMessage()
        return not any(n in message for n in _NOISE)


for _name in ("ServerApp", "LabApp", "NotebookApp", "tornado.access", "tornado.application"):
    logging.getLogger(_name).addFilter(_Quiet())
c.ServerApp.log_level = "WARN"
c.LabApp.log_level = "WARN"
if os.name == "posix":  # kernels on Unix sockets in the runtime folder: no unencrypted-TCP warning
    c.KernelManager.transport = "ipc"
"""
_NOISE = ("is not trusted", "Skipped non-installed server")


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


def lab_command(root: Path, extra: list[str] | None = None, *, open_first: bool = True,
                instructor: bool = False) -> list[str]:
    """The JupyterLab command line ``kit lab`` runs: served from ``root``, first lesson open;
    for a student (``instructor=False``) without nbgrader's instructor server extensions. Run it
    in :func:`lab_environment`, which hides their lab plugins and quiets the log."""
    lesson = first_lesson(root) if open_first else None
    # Jupyter refuses to start as root (containers, CI, cloud boxes) unless told it may.
    as_root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    # A command-line value wins over the extension's own enabling config (jupyter_server fills
    # in only the extensions this trait does not name).
    off = [] if instructor else [f"--ServerApp.jpserver_extensions={name}=False"
                                 for name in INSTRUCTOR_SERVER_EXTENSIONS]
    return [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={root}", *as_root, *off,
            *([str(lesson)] if lesson else []), *(extra or [])]


def session_config_dir(instructor: bool = False) -> Path:
    """A config folder for this kind of session, in Jupyter's runtime folder (per user):
    ``labconfig/page_config.json`` switching off :data:`INSTRUCTOR_PLUGINS` for a student, and
    the quiet-log server config. Rewritten at every start, so it never goes stale."""
    from jupyter_core.paths import jupyter_runtime_dir

    folder = Path(jupyter_runtime_dir()) / ("kit-lab-instructor" if instructor
                                            else "kit-lab-student")
    (folder / "labconfig").mkdir(parents=True, exist_ok=True)
    disabled = {} if instructor else dict.fromkeys(INSTRUCTOR_PLUGINS, True)
    (folder / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": disabled}, indent=1) + "\n")
    (folder / "jupyter_server_config.py").write_text(_QUIET_SERVER_CONFIG.format(noise=_NOISE))
    return folder


def lab_environment(env: dict[str, str] | None = None, *,
                    instructor: bool = False) -> dict[str, str]:
    """``env`` (default: this process's) with the session's config folder first on
    ``JUPYTER_CONFIG_PATH``, below the user's own ``JUPYTER_CONFIG_DIR``, which still wins."""
    env = dict(os.environ if env is None else env)
    paths = [str(session_config_dir(instructor))] + [
        p for p in env.get("JUPYTER_CONFIG_PATH", "").split(os.pathsep) if p]
    env["JUPYTER_CONFIG_PATH"] = os.pathsep.join(paths)
    return env


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    instructor = "--instructor" in argv
    argv = [a for a in argv if a != "--instructor"]
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
    cmd = lab_command(root, argv, instructor=instructor)
    env = lab_environment(instructor=instructor)
    print(f"Starting JupyterLab on {root / 'lessons'}"
          + (" with nbgrader's instructor tools" if instructor else "")
          + ": open the URL below; Ctrl+C twice stops it.", flush=True)
    os.chdir(root)
    os.execve(sys.executable, cmd, env)
    return 0  # not reached
