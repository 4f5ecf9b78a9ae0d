"""The student's Lab shows the course; the instructor's shows nbgrader's tools; the terminal is
quiet.

``kit lab`` switches off nbgrader's Create Assignment panel, formgrader, course and assignment
lists and their menu for the session and keeps Validate; ``kit lab --instructor`` shows them.
The browser tests open a lesson in each Lab (started with ``kit lab``'s own command and
environment) and look for those pieces in the page; screenshots of both go to
``artifacts/screenshots/`` (``KIT_UPDATE_SCREENSHOTS=1``: also ``docs/screenshots/``). The
terminal test runs ``kit lab`` itself, opens a lesson's kernel through the server's API and
reads everything the command printed. The feedback test draws check() reports in the page:
expected and got in boxes of one width, code spans as code, dependent failures saying so. A
failure here means a student meets instructor tools, a wall of log lines they cannot act on, or
feedback that reads wrong.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from browser_support import (
    ARTIFACTS,
    ROOT,
    LabServer,
    open_notebook,
    screenshot,
)

from kit import lab

LESSON = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.ipynb"))[0]


@pytest.fixture(scope="module")
def course(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lab")
    shutil.copy(LESSON, folder / LESSON.name)
    return folder


def what_the_lab_shows(page: Any) -> dict[str, Any]:
    """The menus, side-panel tabs and notebook toolbar buttons the page shows."""
    page.wait_for_selector(".jp-NotebookPanel-toolbar", timeout=60_000)
    page.wait_for_timeout(1500)  # plugins add their menus and panels once the app has started
    return page.evaluate("""() => ({
        menus: [...document.querySelectorAll('.lm-MenuBar-itemLabel')]
            .map(e => e.textContent.trim()),
        tabs: [...document.querySelectorAll('.jp-SideBar .lm-TabBar-tab')].map(
            e => (e.getAttribute('title') || '') + ' ' + e.innerText.trim()),
        toolbar: [...document.querySelectorAll('.jp-NotebookPanel-toolbar .jp-Toolbar-item')].map(
            e => e.innerText.trim()).filter(t => t),
    })""")


def save(page: Any, name: str) -> None:
    screenshot(page, name)
    if os.environ.get("KIT_UPDATE_SCREENSHOTS") == "1":
        (ROOT / "docs" / "screenshots").mkdir(parents=True, exist_ok=True)
        shutil.copy(ARTIFACTS / f"{name}.png", ROOT / "docs" / "screenshots" / f"{name}.png")


def open_lab(browser: Any, course: Path, instructor: bool, name: str) -> dict[str, Any]:
    with LabServer(course, instructor=instructor) as server:
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        page = context.new_page()
        try:
            open_notebook(page, server, LESSON.name)
            shown = what_the_lab_shows(page)
            save(page, name)
            formgrader = _status(server, "/formgrader/")
        finally:
            context.close()
    return {**shown, "formgrader": formgrader}


def _status(server: LabServer, path: str) -> int:
    try:
        req = urllib.request.Request(
            server.url + path, headers={"Authorization": f"token {server.token}"}
        )
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def has_create_assignment(tabs: list[str]) -> bool:
    return any("Create Assignment" in t for t in tabs)


@pytest.mark.browser
def test_the_students_lab_shows_the_course_and_validate_but_no_instructor_tools(
        browser: Any, course: Path) -> None:
    shown = open_lab(browser, course, instructor=False, name="lab_student")
    assert "Nbgrader" not in shown["menus"], shown["menus"]
    assert not has_create_assignment(shown["tabs"]), shown["tabs"]
    assert "Validate" in shown["toolbar"], shown["toolbar"]
    assert shown["formgrader"] == 404  # the server extension is off too, not only its panel


@pytest.mark.browser
def test_the_instructors_lab_shows_nbgrader_s_tools(browser: Any, course: Path) -> None:
    shown = open_lab(browser, course, instructor=True, name="lab_instructor")
    assert "Nbgrader" in shown["menus"], shown["menus"]
    assert has_create_assignment(shown["tabs"]), shown["tabs"]
    assert "Validate" in shown["toolbar"], shown["toolbar"]
    assert shown["formgrader"] == 200


# ---- the terminal ------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_kit_lab(*flags: str, seconds_after_kernel: float = 8.0) -> str:
    """Everything ``kit lab FLAGS`` prints while a lesson opens and its kernel starts, with
    throw-away Jupyter folders. The token is the one the server makes and prints, as a student's."""
    home = Path(tempfile.mkdtemp(prefix="kit-lab-terminal-"))
    port = _free_port()
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-c", "import sys; from kit.cli import main; sys.exit(main())", "lab",
           *flags, "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           "--LabApp.news_url=None"]
    with open(home / "out", "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            def api(method: str, path: str, body: Any = None) -> Any:
                req = urllib.request.Request(
                    f"http://127.0.0.1:{port}{path}", method=method,
                    data=None if body is None else json.dumps(body).encode(),
                    headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=30) as resp:
                    return json.loads(resp.read() or b"null")

            deadline = time.monotonic() + 90
            while not (
                m := re.search(r"/lab\?token=(\w+)", (home / "out").read_text(errors="replace"))
            ):
                if proc.poll() is not None or time.monotonic() > deadline:
                    return (home / "out").read_text(errors="replace")  # the caller's asserts say
                time.sleep(0.3)
            token = m.group(1)
            lesson = f"lessons/{LESSON.name}"
            api("GET", f"/api/contents/{lesson}")  # opening an unsigned notebook: "not trusted"
            api("POST", "/api/sessions", {"path": lesson, "type": "notebook", "name": LESSON.name,
                                          "kernel": {"name": "python3"}})
            time.sleep(seconds_after_kernel)  # the kernel starts and prints its warnings, if any
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    text = (home / "out").read_text(errors="replace")
    shutil.rmtree(home, ignore_errors=True)
    return text


# What a quiet start may print: kit's own line, the server's URL banner, and its stop on SIGTERM.
ALLOWED = re.compile(
    r"^(Starting JupyterLab on .*|\[C [\d\- :.]+ ServerApp\] ?(received signal 15, "
    r"stopping)?|\s*|\s+To access the server, open this file in a browser:|"
    r"\s+file://\S+|\s+Or copy and paste one of these URLs:|\s+http://\S+)$"
)


def test_kit_lab_prints_the_url_and_nothing_a_student_cannot_act_on() -> None:
    printed = run_kit_lab()
    assert re.search(r"http://127\.0\.0\.1:\d+/lab\?token=", printed), printed
    extra = [line for line in printed.splitlines() if not ALLOWED.match(line)]
    assert not extra, "kit lab printed more than the URL:\n" + "\n".join(extra)
    for noise in ("nbgrader_config.py", "not trusted", "TCP"):
        assert noise not in printed


def test_a_warning_the_user_can_act_on_still_shows() -> None:
    # A mistyped option is the user's to fix: the quiet log must still say so.
    printed = run_kit_lab("--ServerApp.no_such_option=1", seconds_after_kernel=0)
    assert "no_such_option" in printed and "not recognized" in printed, printed


def test_the_session_config_hides_only_the_instructor_plugins_and_keeps_validate() -> None:
    env = lab.lab_environment({}, instructor=False)
    folder = Path(env["JUPYTER_CONFIG_PATH"].split(os.pathsep)[0])
    assert json.loads((folder / "labconfig" / "page_config.json").read_text())[
        "disabledExtensions"
    ] == {name: True for name in lab.INSTRUCTOR_PLUGINS}
    assert "@jupyter/nbgrader:validate-assignment" not in lab.INSTRUCTOR_PLUGINS
    instructor = Path(
        lab.lab_environment({}, instructor=True)["JUPYTER_CONFIG_PATH"].split(os.pathsep)[0]
    )
    assert (
        json.loads((instructor / "labconfig" / "page_config.json").read_text())[
            "disabledExtensions"
        ]
        == {}
    )
    assert not any("jpserver_extensions" in a for a in lab.lab_command(ROOT, instructor=True))
    assert sum("jpserver_extensions" in a for a in lab.lab_command(ROOT)) == len(
        lab.INSTRUCTOR_SERVER_EXTENSIONS)


# ---- check() feedback as the page draws it ---------------------------------------------------

FEEDBACK_CELLS = [
    # a stub: the headline's `raise NotImplementedError(...)` is a code span
    "from kit import check\n"
    "def shard_range(n, rank, world_size):\n"
    "    raise NotImplementedError('Task 0.1: todo')\n"
    "check('0.1', shard_range)",
    # the remainder dropped: expected [0, 1, 2], got [0, 1]
    "def shard_range(n, rank, world_size):\n"
    "    base = n // world_size\n"
    "    return range(rank * base, (rank + 1) * base)\n"
    "check('0.1', shard_range)",
    # 9.1 with special tokens selected: three cases follow the first failure
    "import sys\n"
    f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
    "from bugs.lesson09 import mask_special_tokens\n"
    "check('9.1', mask_special_tokens)",
]


@pytest.mark.browser
def test_feedback_boxes_align_code_spans_render_and_dependent_failures_say_so(
        browser: Any, course: Path) -> None:
    import nbformat
    from browser_support import cell_outputs, code_notebook, run_all_cells, wait_until_done

    nbformat.write(code_notebook(FEEDBACK_CELLS), course / "feedback.ipynb")

    with LabServer(course) as server:
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        try:
            open_notebook(page, server, "feedback.ipynb")
            run_all_cells(page)
            wait_until_done(page, timeout=180)
            stub, bug, masked = (cell_outputs(page, i) for i in range(3))
            assert "not implemented yet" in stub and "`" not in stub, stub
            code = (
                page.locator(".jp-Notebook .jp-Cell")
                .nth(0)
                .locator(".kit-check code", has_text="raise NotImplementedError(...)")
            )
            assert code.count() == 1
            boxes = page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".kit-expected-got code")
            assert boxes.count() >= 2, bug
            widths = [boxes.nth(i).bounding_box()["width"] for i in range(boxes.count())]
            assert max(widths) - min(widths) < 1, widths  # expected and got: one width
            assert masked.count("follows from the failure above: fix that first") == 3, masked
            assert "fixed" not in masked and "`" not in masked, masked
            page.locator(".jp-Notebook .jp-Cell").nth(2).scroll_into_view_if_needed()
            screenshot(page, "feedback_9_1_special_tokens", focus_index=2)
        finally:
            context.close()
