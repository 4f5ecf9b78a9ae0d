"""The course as a student sees it: JupyterLab in Chromium, cells run through the UI.

One JupyterLab (started with ``kit lab``'s own command) serves copies of every lesson with
the tasks solved; Playwright drives Debian's Chromium. Every lesson already runs end to end
headless (tests/test_lessonNN.py), so here each runs only the cells whose rendering is the
point: its setup, its first task and check, and in Lessons 00 and 01 the launcher's rank
output, errors and hang report, every check and the ring stepper widget. Run All Cells, through
the menu, runs the sabotage notebook. Each test asserts what the page shows (labelled rank
output, the launcher's errors, ``check()`` feedback, live widgets) and saves a screenshot under
``artifacts/screenshots/`` (``KIT_UPDATE_SCREENSHOTS=1`` also refreshes ``docs/screenshots/``).
The sabotage tests break a widget and swallow rank output on purpose and prove the same
assertions then fail.

Outside CI these tests skip when Chromium or Playwright is missing; with ``CI=true`` they fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nbformat
import pytest
from browser_support import (  # noqa: F401 - page, server: fixtures
    ROOT,
    WIDGET_EXTENSION,
    LabServer,
    assert_rank_output,
    assert_readable,
    assert_widgets_rendered,
    cell_index,
    cell_outputs,
    code_cell,
    code_notebook,
    copy_lessons,
    lab_fixtures,
    open_notebook,
    require_browser,
    run_all_cells,
    run_cell,
    run_cells,
    saved_widget_count,
    screenshot,
    wait_until_done,
    widget_report,
)

from autograder import course as course_spec
from kit import lab

LESSONS = [spec.stem for spec in course_spec.LESSONS]
# each has a test of its own below
OWN_TESTS = {course_spec.lesson(0).stem, course_spec.lesson(1).stem}
server, page = lab_fixtures()


@pytest.fixture(scope="module")
def course(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("course")
    copy_lessons(folder)
    nbformat.write(sabotage_notebook(), folder / "sabotage.ipynb")
    # the lesson as handed out, tasks still stubs
    shutil.copy(ROOT / "lessons" / f"{LESSONS[0]}.ipynb", folder / "student_00.ipynb")
    return folder


def check_cells(notebook: Path) -> list[int]:
    nb = nbformat.read(notebook, as_version=4)
    return [i for i, c in enumerate(nb.cells)
            if any(t.startswith("check-") for t in c.metadata.get("tags", []))]


def assert_every_check_passed(page: Any, notebook: Path, indices: list[int]) -> None:
    assert indices, f"{notebook.name} has no check cell"
    for i in indices:
        text = cell_outputs(page, i)
        assert re.search(r"Task \d+\.\d+ .*all \d+ checks? passed", text), (
            f"cell {i} of {notebook.name} does not show passing check() feedback:\n{text[:1500]}")


def open_and_run(page: Any, server: LabServer, course: Path, stem: str, cells: list[int]) -> Path:
    """Open ``stem`` and run its setup cell, then ``cells`` (indices), queued as a student would."""
    notebook = course / f"{stem}.ipynb"
    open_notebook(page, server, notebook.name)
    setup = cell_index(notebook, "setup")
    run_cells(page, [setup, *[i for i in cells if i != setup]], timeout=420)
    return notebook


def tasks_and_checks(notebook: Path) -> list[int]:
    """Every task cell and check cell, in order."""
    nb = nbformat.read(notebook, as_version=4)
    return [i for i, c in enumerate(nb.cells)
            if any(t.startswith(("task-", "check-")) for t in c.metadata.get("tags", []))]


@pytest.mark.browser
def test_lesson00_in_the_browser_shows_labelled_rank_output_errors_and_check_feedback(
        page: Any, server: LabServer, course: Path) -> None:
    notebook = course / course_spec.lesson(0).notebook.name
    shown = [
        code_cell(notebook, text)
        for text in (
            "%load_ext kit",
            "def hello",
            "def read_environment",
            "%%distributed -n 4",
            "def crash_on_rank_2",
            "def skip_a_collective_on_rank_0",
        )
    ]
    open_and_run(page, server, course, notebook.stem, sorted(shown + tasks_and_checks(notebook)))
    hello = code_cell(notebook, "def hello")
    assert_rank_output(cell_outputs(page, hello), world_size=4)
    assert_rank_output(cell_outputs(page, code_cell(notebook, "%%distributed -n 4")), world_size=4)

    crash = cell_outputs(page, code_cell(notebook, "def crash_on_rank_2"))
    assert "LaunchError" in crash and "rank 2" in crash and "corrupt batch" in crash, crash[:2000]
    hang = cell_outputs(page, code_cell(notebook, "def skip_a_collective_on_rank_0"))
    assert "LaunchTimeout" in hang and "Timed out after 5 s" in hang, hang[:2000]
    assert "all_reduce" in hang and "barrier" in hang, (
        f"the hang report names no collective:\n{hang}"
    )
    assert_readable(crash)
    assert_readable(hang)

    assert_every_check_passed(page, notebook, check_cells(notebook))
    assert_widgets_rendered(widget_report(page), expected=0)
    screenshot(page, notebook.stem, focus_index=hello - 1)


@pytest.mark.browser
def test_lesson01_ring_stepper_renders_and_answers_the_slider(
        page: Any, server: LabServer, course: Path) -> None:
    notebook = course / course_spec.lesson(1).notebook.name
    open_and_run(page, server, course, notebook.stem, sorted(
        [code_cell(notebook, "%load_ext kit"), code_cell(notebook, "ring_stepper(world_size=4)"),
         *tasks_and_checks(notebook)]))
    assert_every_check_passed(page, notebook, check_cells(notebook))
    produced = saved_widget_count(page, server, notebook.name)
    assert produced >= 1, "Lesson 01 displayed no widget: the ring stepper cell did not run"
    assert_widgets_rendered(widget_report(page), expected=produced)

    # The slider's observer runs in the kernel: a new step in the view proves the round trip.
    stepper = code_cell(notebook, "ring_stepper(world_size=4)")
    cell = page.locator(".jp-Notebook .jp-Cell").nth(stepper)
    cell.scroll_into_view_if_needed()
    assert "start: every rank holds its own data" in cell.inner_text()
    cell.locator(".widget-slider .noUi-handle, .widget-slider [role='slider']").first.focus()
    page.keyboard.press("ArrowRight")
    page.wait_for_function(
        "el => el.innerText.includes('reduce-scatter, step 1 of 3')",
        arg=cell.element_handle(), timeout=15_000)
    screenshot(page, notebook.stem, focus_index=stepper - 1)


@pytest.mark.parametrize("stem", [s for s in LESSONS if s not in OWN_TESTS])
@pytest.mark.browser
def test_later_lesson_opens_and_its_first_check_passes_in_the_browser(
        page: Any, server: LabServer, course: Path, stem: str) -> None:
    notebook = course / f"{stem}.ipynb"
    first_check = check_cells(notebook)[0]
    tag = next(t for t in nbformat.read(notebook, as_version=4).cells[first_check].metadata["tags"]
               if t.startswith("check-"))
    task = cell_index(notebook, tag.replace("check-", "task-"))
    open_and_run(page, server, course, stem, [task, first_check])
    assert_every_check_passed(page, notebook, [first_check])
    assert_widgets_rendered(widget_report(page), expected=0)
    screenshot(page, stem, focus_index=first_check)


STUDENT_BUG = (  # the typical mistake of task 0.1: the remainder n % world_size is dropped
    "def shard_range(n, rank, world_size):\n"
    "    base = n // world_size\n"
    "    return range(rank * base, (rank + 1) * base)\n")


@pytest.mark.browser
def test_check_feedback_in_the_browser_for_a_stub_and_for_a_typed_in_bug(
        page: Any, server: LabServer, course: Path) -> None:
    notebook = course / "student_00.ipynb"
    open_notebook(page, server, notebook.name)
    setup, task, check = (cell_index(notebook, tag) for tag in ("setup", "task-0.1", "check-0.1"))
    run_cells(page, [setup, task, check], timeout=120)
    feedback = cell_outputs(page, check)
    assert "not implemented yet (0/2 points)" in feedback, feedback[:1500]

    # Type an answer into the task cell as a student would, then run it and its check again.
    editor = page.locator(".jp-Notebook .jp-Cell").nth(task).locator(".cm-content")
    editor.click()
    page.keyboard.press("Control+a")
    page.keyboard.insert_text(STUDENT_BUG)
    run_cell(page, task)
    wait_until_done(page, timeout=60)
    run_cell(page, check)
    wait_until_done(page, timeout=120)
    feedback = cell_outputs(page, check)
    assert re.search(r"\d+ of \d+ checks failed, [\d.]+/2 points", feedback), feedback[:1500]
    assert "expected" in feedback.lower() and "got" in feedback.lower(), feedback[:1500]
    assert_readable(feedback)
    screenshot(page, "check_feedback_for_a_bug", focus_index=task)


# ---- the assertions fail when what the student sees is broken -------------------------------

SABOTAGE_CELLS = [
    # 0: a live widget, the control
    "import ipywidgets\nipywidgets.IntSlider(value=3, description='fine')",
    # 1: a widget view whose model the kernel never created
    "from IPython.display import display\n"
    "display({'application/vnd.jupyter.widget-view+json': {'model_id': 'no-such-model', "
    "'version_major': 2, 'version_minor': 0}, 'text/plain': 'IntSlider()'}, raw=True)",
    # 2: rank output as launch prints it, the control
    "from kit import launch\nfrom kit.launcher import run_ranks\n"
    "def hello():\n    import torch.distributed as dist\n"
    "    print(f'hello from rank {dist.get_rank()}')\n"
    "launch(hello, world_size=4);",
    # 3: the same ranks with their output kept off the cell
    "run_ranks(hello, (), {}, world_size=4, echo=False);",
    # 4: one rank silent
    "def quiet_rank_3():\n    import torch.distributed as dist\n"
    "    if dist.get_rank() != 3:\n        print('still here')\n"
    "launch(quiet_rank_3, world_size=4);",
]


def sabotage_notebook() -> nbformat.NotebookNode:
    return code_notebook(SABOTAGE_CELLS)


@pytest.mark.browser
def test_a_widget_without_a_model_or_rank_output_kept_off_the_cell_fails_the_assertions(
        page: Any, server: LabServer) -> None:
    open_notebook(page, server, "sabotage.ipynb")
    run_all_cells(page)
    wait_until_done(page, timeout=120)
    page.wait_for_timeout(1000)  # let the widget manager finish with the broken view
    screenshot(page, "sabotage_widget_and_rank_output")
    assert_widgets_rendered(widget_report(page, 0), expected=1)
    with pytest.raises(AssertionError, match="widget placeholders or errors"):
        assert_widgets_rendered(widget_report(page, 1), expected=1)
    with pytest.raises(AssertionError, match="widget placeholders or errors"):
        assert_widgets_rendered(widget_report(page), expected=2)

    assert_rank_output(cell_outputs(page, 2), world_size=4)
    with pytest.raises(AssertionError, match=r"no '\[rank N\] \.\.\.' line"):
        assert_rank_output(cell_outputs(page, 3), world_size=4)
    with pytest.raises(AssertionError, match=r"got ranks \[0, 1, 2\]"):
        assert_rank_output(cell_outputs(page, 4), world_size=4)


@pytest.mark.browser
def test_a_lab_without_the_widget_extension_fails_the_widget_assertion(
        browser: Any, course: Path) -> None:
    with LabServer(course, disabled_extensions=[WIDGET_EXTENSION]) as srv:
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        try:
            open_notebook(page, srv, "sabotage.ipynb")
            run_cell(page, 0)
            wait_until_done(page, timeout=120)
            text = cell_outputs(page, 0)
            assert "IntSlider(" in text, f"expected the text fallback of the widget, got {text!r}"
            with pytest.raises(AssertionError, match="falls back to the text repr"):
                assert_widgets_rendered(widget_report(page, 0), expected=1)
            screenshot(page, "sabotage_no_widget_extension")
        finally:
            context.close()


@pytest.mark.browser
def test_kit_lab_opens_the_first_lesson_and_the_sources_open_as_notebooks(
        browser: Any, tmp_path: Path) -> None:
    # A course folder laid out like the repository: lessons/ and solutions/.
    root = tmp_path / "course"
    first = course_spec.LESSONS[0].notebook
    for folder, name in (("lessons", first.name), ("solutions", first.stem + ".py")):
        (root / folder).mkdir(parents=True)
        shutil.copy(ROOT / folder / name, root / folder / name)
    # kit lab's own command with a stand-in browser that records the page Jupyter opens.
    opened = tmp_path / "opened.txt"
    recorder = tmp_path / "browser.sh"
    recorder.write_text(f'#!/bin/sh\necho "$1" > {opened}\n')
    recorder.chmod(0o755)
    with LabServer(root, open_first=True, browser_command=str(recorder)) as srv:
        deadline = time.monotonic() + 30
        while not opened.exists() and time.monotonic() < deadline:
            time.sleep(0.3)
        assert opened.exists(), f"kit lab's JupyterLab opened no browser page:\n{srv.log()}"
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        try:
            page.goto(opened.read_text().strip())
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=90_000)
            current = "#jp-main-dock-panel .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel"
            assert page.locator(current).inner_text().strip() == first.name
            heading = page.locator(".jp-NotebookPanel .jp-Cell").first.locator("h1")
            heading.wait_for(timeout=30_000)
            assert heading.inner_text().startswith("Lesson 00")

            # The lesson source, solutions/00_*.py, opens as a notebook with jupytext.
            listing = page.locator(".jp-DirListing-content")
            page.locator(".jp-BreadCrumbs-home").click()  # it shows lessons/ at first
            listing.locator(".jp-DirListing-item", has_text="solutions").dblclick()
            listing.locator(".jp-DirListing-item", has_text=first.stem + ".py").click(
                button="right")
            page.locator(".lm-Menu-itemLabel", has_text=re.compile("^Open With$")).hover()
            page.locator(".lm-Menu-itemLabel", has_text=re.compile("^Jupytext Notebook$")).click()
            page.locator(current, has_text=first.stem + ".py").wait_for(timeout=30_000)
            source_heading = page.locator(
                ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell").first.locator("h1")
            source_heading.wait_for(timeout=30_000)
            # the source states no fact of the spec's: the build fills in its title
            assert source_heading.inner_text().strip() == "{{title}}"
        finally:
            context.close()


# ---- kit lab without a browser ----------------------------------------------------------------

def test_kit_lab_command_serves_the_course_root_and_opens_the_first_lesson() -> None:
    cmd = lab.lab_command(ROOT, ["--port", "8890"])
    assert cmd[:3] == [sys.executable, "-m", "jupyterlab"]
    assert f"--ServerApp.root_dir={ROOT}" in cmd
    assert cmd[-3:] == [str(Path("lessons") / f"{LESSONS[0]}.ipynb"), "--port", "8890"]


CHECK = [sys.executable, "-c", "import sys; from kit.cli import main; sys.exit(main())", "lab",
         "--check"]


def test_kit_lab_check_reports_a_disabled_widget_extension(tmp_path: Path) -> None:
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path))
    ready = subprocess.run(CHECK, cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=60)
    assert ready.returncode == 0, ready.stderr
    assert "widgets and jupytext are ready" in ready.stdout
    (tmp_path / "labconfig").mkdir()
    (tmp_path / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {WIDGET_EXTENSION: True}}))
    broken = subprocess.run(CHECK, cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=60)
    assert broken.returncode == 1
    assert f"jupyter labextension enable {WIDGET_EXTENSION}" in broken.stderr


def test_without_chromium_the_browser_tests_skip_with_the_fix_but_fail_under_ci(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import browser_support

    monkeypatch.setattr(browser_support.shutil, "which", lambda name: None)
    with pytest.raises(pytest.skip.Exception, match="apt-get install chromium"):
        require_browser(ci=False)
    with pytest.raises(pytest.fail.Exception, match="CI must run the browser tests"):
        require_browser(ci=True)
