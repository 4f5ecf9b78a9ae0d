"""The course site (`make site`): every lesson is a page with its figures and outputs, its
task cells are the students' stubs, and no solution region's code appears anywhere in it.

It is built from the executed notebooks the headless lesson tests keep (``build/executed/``;
conftest moves this test to the end of the run). In CI every lesson must have one."""

from __future__ import annotations

import html
import os
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import ROOT

from autograder.build import lesson_sources, source_notebook, student_notebook
from autograder.site import build_site

pytest.importorskip("myst_nb")
_REGION = re.compile(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", re.S)


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []

    def handle_data(self, data: str) -> None:
        self.parts.append(data)


def _text(path: Path) -> str:
    raw = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix != ".html":
        return raw
    parser = _Text()
    parser.feed(raw)
    return html.unescape("".join(parser.parts))


def _released_text() -> str:
    """Everything the students' notebooks of all lessons hold (prose, stubs, demos)."""
    return "\n".join(c.source for src in lesson_sources(ROOT)
                     for c in student_notebook(source_notebook(src)).cells)


def _solution_lines(src: Path, released: str) -> set[str]:
    """Lines of the solution regions of ``src`` that no student's notebook holds anywhere."""
    lines = set()
    for region in _REGION.findall(src.read_text(encoding="utf-8")):
        for line in region.splitlines():
            line = line.strip()
            if len(line) >= 16 and not line.startswith("#") and line not in released:
                lines.add(line)
    return lines


def _leaks(files: list[Path], lines: set[str]) -> list[str]:
    found = []
    for path in files:
        text = _text(path)
        found += [f"{path.name}: {line}" for line in lines if line in text]
    return found


@pytest.mark.slow
def test_the_site_holds_every_lesson_with_figures_and_no_solution(tmp_path):
    report = build_site(out=tmp_path / "site", execute_missing=False)
    sources = lesson_sources(ROOT)
    pages = {src.stem: report.html / "lessons" / f"{src.stem}.html" for src in sources}
    assert sorted(report.pages) == sorted(pages)
    assert all(p.is_file() for p in pages.values()), [
        s for s, p in pages.items() if not p.is_file()
    ]
    index = (report.html / "index.html").read_text()
    assert all(f"lessons/{stem}.html" in index for stem in pages)
    if os.environ.get("CI"):
        assert not report.unexecuted, ("the headless tests of these lessons kept no executed "
                                       f"notebook: {report.unexecuted}")
    for stem in set(pages) - set(report.unexecuted):
        page = pages[stem].read_text()
        images = re.findall(r'<img[^>]+src="([^"]+)"', page)
        assert images, f"{stem}: no figure on its page"
        assert all((pages[stem].parent / src).resolve().is_file() for src in images), stem
    files = [p for p in report.html.rglob("*") if p.is_file() and p.suffix in
             {".html", ".txt", ".js", ".ipynb", ".json"}]
    released = _released_text()
    lines = set().union(*(_solution_lines(src, released) for src in sources))
    assert len(lines) > 100  # the detector has something to find
    assert _leaks(files, lines) == []
    print(f"site: {len(pages)} lessons, {report.seconds:.1f} s, {report.bytes / 1e6:.1f} MB, "
          f"{len(pages) - len(report.unexecuted)} with outputs")


def test_the_leak_detector_finds_a_solution_shown(tmp_path):
    """The detector above can fail: a lesson source (its solutions in) is caught."""
    src = next(s for s in lesson_sources(ROOT) if s.name.startswith("00_"))
    copy = tmp_path / "00.ipynb.txt"
    copy.write_text(src.read_text())
    assert _leaks([copy], _solution_lines(src, _released_text()))
