"""The ``kit`` command: each subcommand lives in its own module and parses its own arguments.

    kit lab                 open the course in JupyterLab
    kit doctor              preflight check of this machine
    kit build [--check]     build lessons/ from solutions/
    kit course DIR          write an nbgrader course directory
    kit run NOTEBOOK        execute a lesson headless
    kit grade SUBMISSION    grade notebooks
    kit progress [FOLDER]   where you stand in every lesson
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, function, one-line help). The function takes argv (list[str]) and returns an exit
# code.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "lab": ("kit.lab", "main", "open the course in JupyterLab"),
    # The doctor's table includes the grader's isolation row, so it starts from autograder.
    "doctor": ("autograder.grade.doctor", "main", "check this machine can run the course"),
    "build": ("autograder.build", "main_build",
              "build lessons/ from solutions/ (--check: fail if stale)"),
    "course": ("autograder.build", "main_course", "write a ready nbgrader course directory"),
    "run": ("kit.runner", "main", "execute a lesson notebook headless"),
    "grade": ("autograder.grade.notebook", "main", "grade notebooks or submission folders"),
    "progress": ("autograder.progress", "main",
                 "where you stand in every lesson, and what to do next"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: kit COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "Run `kit COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"kit: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
