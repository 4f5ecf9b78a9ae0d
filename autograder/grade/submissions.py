"""Find the submissions ``kit grade`` was given, and which notebook holds which lesson.

A submission is one student's work. Accepted forms (``kit grade PATH...``):

* a notebook ``alice.ipynb``: one submission named after the file;
* a folder of one student's notebooks, each named ``NN_slug.ipynb`` (at most one per lesson),
  e.g. a Gradescope ``/autograder/submission`` folder: one submission named after the folder;
* a folder of several students' notebooks (names without a lesson number, or two for one
  lesson): one submission per notebook;
* an nbgrader course (a folder holding ``submitted/``) or its ``submitted/`` folder:
  one submission per ``submitted/<student>/``, its notebooks gathered from every assignment;
* a Gradescope export (a folder holding ``submission_metadata.yml``): one submission per
  ``submission_<id>/`` folder, named after the student's email or name where the metadata has it.

Submissions are only read. :func:`discover` fails with a clear message on what it cannot use.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from autograder.loading import NotebookError, lesson_of

__all__ = ["Submission", "discover"]


@dataclass
class Submission:
    """One student's notebooks by lesson (``None``: the same notebook serves every lesson)."""

    student: str
    notebooks: dict[int, Path] = field(default_factory=dict)
    any_lesson: Path | None = None  # a single notebook without a lesson number in its name
    source: Path | None = None
    notes: list[str] = field(default_factory=list)

    def notebook_for(self, lesson: int) -> Path | None:
        return self.notebooks.get(lesson, self.any_lesson)

    def digest(self, lessons: list[int]) -> str:
        """A hash of what is graded: changes when a graded notebook changes."""
        h = hashlib.sha256()
        for lesson in lessons:
            path = self.notebook_for(lesson)
            h.update(f"{lesson}:".encode())
            h.update(path.read_bytes() if path is not None else b"<none>")
        return h.hexdigest()


def _notebooks(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.ipynb")
                  if ".ipynb_checkpoints" not in p.parts and not p.name.startswith("."))


def _one_student(name: str, notebooks: list[Path], source: Path) -> Submission:
    sub = Submission(name, source=source)
    for nb in notebooks:
        lesson = lesson_of(nb)
        if lesson is None:
            sub.notes.append(f"ignored {nb.name}: its name does not start with a lesson number")
        elif lesson in sub.notebooks:
            sub.notes.append(f"two notebooks for lesson {lesson:02d}: graded "
                             f"{sub.notebooks[lesson].name}, ignored {nb.name}")
        else:
            sub.notebooks[lesson] = nb
    return sub


def _folder(folder: Path) -> list[Submission]:
    if (folder / "submitted").is_dir():
        folder = folder / "submitted"
    if folder.name == "submitted":  # nbgrader: submitted/<student>/<assignment>/*.ipynb
        return [_one_student(s.name, _notebooks(s), s) for s in sorted(folder.iterdir())
                if s.is_dir()]
    if (folder / "submission_metadata.yml").is_file():
        names = _gradescope_names(folder / "submission_metadata.yml")
        return [_one_student(names.get(s.name, s.name), _notebooks(s), s)
                for s in sorted(folder.iterdir())
                if s.is_dir() and s.name.startswith("submission_")]
    notebooks = _notebooks(folder)
    lessons = [lesson_of(nb) for nb in notebooks]
    if notebooks and None not in lessons and len(set(lessons)) == len(lessons):
        return [_one_student(folder.name, notebooks, folder)]
    return [Submission(nb.stem, any_lesson=nb, source=nb) for nb in notebooks]


def _gradescope_names(path: Path) -> dict[str, str]:
    """``submission_<id>`` -> the first submitter's email or name, when the metadata is readable."""
    try:
        import yaml

        meta = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except Exception:  # an unreadable file keeps the folder names
        return {}
    names = {}
    for key, value in meta.items() if isinstance(meta, dict) else []:
        people = (value.get(":submitters") or value.get("submitters")
                  if isinstance(value, dict) else None)
        if isinstance(people, list) and people and isinstance(people[0], dict):
            who = people[0].get(":email") or people[0].get(":name") or people[0].get("email")
            if isinstance(who, str) and who:
                names[str(key)] = who
    return names


def discover(paths: list[str | Path]) -> list[Submission]:
    """Every submission under ``paths``, in a stable order, each student once.

    Raises:
        NotebookError: a path is missing, holds no notebook, or two submissions share a name.
    """
    found: list[Submission] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            if path.suffix not in {".ipynb", ".py"}:
                raise NotebookError(f"{path} is not a notebook: give .ipynb files or folders of "
                                    "them")
            lesson = lesson_of(path)
            found.append(Submission(path.stem, {lesson: path} if lesson is not None else {},
                                    any_lesson=None if lesson is not None else path, source=path))
        elif path.is_dir():
            subs = _folder(path)
            if not subs:
                raise NotebookError(f"{path} holds no .ipynb notebook: give a notebook, a folder "
                                    "of notebooks, an nbgrader course (with submitted/) or a "
                                    "Gradescope export")
            found += subs
        else:
            raise NotebookError(f"no such submission: {path}")
    seen: dict[str, Path | None] = {}
    for sub in found:
        if sub.student in seen:
            raise NotebookError(f"two submissions are named {sub.student!r} ({seen[sub.student]} "
                                f"and {sub.source}): grade them in separate runs or rename one")
        seen[sub.student] = sub.source
    return found


def safe_name(student: str) -> str:
    """A file name for a student id; ids that need changing get a short hash to stay unique."""
    clean = re.sub(r"[^\w.@+-]", "_", student).lstrip(".") or "_"
    if clean != student:
        clean += "-" + hashlib.sha1(student.encode()).hexdigest()[:8]
    return clean[:120]
