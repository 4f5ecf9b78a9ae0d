"""Drive the course in JupyterLab in a real browser: what ``tests/test_browser.py`` runs on.

:class:`LabServer` starts JupyterLab the way ``kit lab`` does (same command, from
:func:`kit.lab.lab_command`), on loopback with a random token and throw-away config, runtime,
settings and workspace folders, so nothing of the user's is read or written. The notebooks it
serves are copies in a temporary folder (:func:`solved_lesson` fills in each task's solution,
as a student who finished the lesson has it), so running cells never writes outputs into
``lessons/``. The page helpers open a notebook, run cells through the UI, wait for the kernel,
and read back what the page shows; the ``assert_*`` functions state what a student must see.
Chromium is Debian's (``shutil.which("chromium")``), never a browser downloaded by a tool.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat
import pytest

from kit.lab import lab_command, lab_environment

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts" / "screenshots"
# --disable-dev-shm-usage: containers often give /dev/shm 64 MB, too little for a Lab page.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-dev-shm-usage"]
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_EXTENSION = "@jupyter-widgets/jupyterlab-manager"
# What JupyterLab's widget manager writes in place of a widget it cannot show.
WIDGET_FAILURES = ("Loading widget...", "Error displaying widget")

# User settings for the throw-away JupyterLab: every cell stays in the DOM (the default
# windowing leaves off-screen cells unrendered, so their outputs could not be read), no news
# or update checks (no network), no autosave.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
}


def browser_unavailable_reason() -> str | None:
    """Why the browser tests cannot run here (no Chromium, no Playwright), or None if they can."""
    if shutil.which("chromium") is None:
        return ("Debian's chromium is not on PATH; install it with `apt-get install chromium` "
                "(.ci/run does) to run the browser tests")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return ("the playwright Python package is missing; `pip install -e .[dev]` installs it "
                "(never `playwright install`: the tests use Debian's chromium)")
    return None


def in_ci() -> bool:
    """True under CI (``CI=true``, as GitHub Actions, GitLab and most runners set it)."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_browser(ci: bool | None = None) -> None:
    """Skip the calling test when the browser tests cannot run here; under CI, fail it."""
    import pytest

    reason = browser_unavailable_reason()
    if reason:
        if in_ci() if ci is None else ci:
            pytest.fail(f"CI must run the browser tests, but {reason}", pytrace=False)
        pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LabServer:
    """JupyterLab on 127.0.0.1 serving ``root``; use as a context manager.

    ``disabled_extensions`` lists lab extensions to switch off in this server's page config
    (a test uses it to show what a lab without the widget extension looks like).
    ``open_first`` and ``browser_command`` run ``kit lab`` exactly: the first lesson is opened
    in the "browser" given by ``browser_command`` (a program called with the page's URL).
    ``instructor`` runs ``kit lab --instructor`` (nbgrader's instructor tools shown).
    """

    root: Path
    disabled_extensions: list[str] = field(default_factory=list)
    open_first: bool = False
    browser_command: str | None = None
    instructor: bool = False
    port: int = field(default_factory=_free_port)
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    startup_timeout: float = 90.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LabServer:
        self._home = Path(tempfile.mkdtemp(prefix="kit-lab-"))
        config, settings = self._home / "config", self._home / "settings"
        for name, value in LAB_SETTINGS.items():
            path = settings / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value))
        (config / "labconfig").mkdir(parents=True)
        (config / "labconfig" / "page_config.json").write_text(json.dumps(
            {"disabledExtensions": {name: True for name in self.disabled_extensions}}))
        env = lab_environment(dict(os.environ, JUPYTER_CONFIG_DIR=str(config),
                                   JUPYTER_RUNTIME_DIR=str(self._home / "runtime"),
                                   JUPYTERLAB_SETTINGS_DIR=str(settings),
                                   JUPYTERLAB_WORKSPACES_DIR=str(self._home / "workspaces"),
                                   PYTHONUNBUFFERED="1"), instructor=self.instructor)
        cmd = lab_command(self.root, [
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
            "--LabApp.news_url=None",
            *([f"--ServerApp.browser={self.browser_command} %s"] if self.browser_command
              else ["--ServerApp.open_browser=False"]),
            ], open_first=self.open_first, instructor=self.instructor)  # + --allow-root as root
        self._log = open(self._home / "server.log", "wb")
        self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}:\n{self.log()}")
            try:
                self.api("GET", "/api/status")
                return self
            except OSError:
                time.sleep(0.3)
        self.__exit__(None, None, None)
        raise RuntimeError(
            f"JupyterLab did not answer within {self.startup_timeout} s:\n{self.log()}"
        )

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            # the server and the kernels it started share its session: stop them together
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self._home, ignore_errors=True)

    def log(self) -> str:
        return (self._home / "server.log").read_text(errors="replace")[-4000:]

    def api(self, method: str, path: str) -> Any:
        req = urllib.request.Request(self.url + path, method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        """Stop every kernel, so the next lesson has the CPU to itself."""
        for kernel in self.api("GET", "/api/kernels"):
            self.api("DELETE", f"/api/kernels/{kernel['id']}")

    def notebook_url(self, name: str) -> str:
        # reset: a fresh workspace, so tabs of earlier tests are not restored beside this one
        return f"{self.url}/lab/tree/{name}?reset&token={self.token}"


def code_notebook(cells: list[str]) -> nbformat.NotebookNode:
    """A notebook of these code cells, on the kernel JupyterLab starts by default."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    return nb


def solved_lesson(lesson: Path, dest: Path) -> Path:
    """Copy ``lessons/NN_slug.ipynb`` to ``dest`` with each task cell holding its solution.

    The solution comes from the cell with the same ``task-L.N`` tag in ``solutions/NN_slug.py``:
    the student's notebook as it looks once every task is done.
    """
    import jupytext

    nb = nbformat.read(lesson, as_version=4)
    source = jupytext.read(ROOT / "solutions" / (lesson.stem + ".py"))
    solutions = {tag: cell.source for cell in source.cells
                 for tag in cell.metadata.get("tags", []) if tag.startswith("task-")}
    for cell in nb.cells:
        for tag in cell.metadata.get("tags", []):
            if tag in solutions:
                cell.source = solutions[tag]
    out = dest / lesson.name
    nbformat.write(nb, out)
    return out


def cell_index(notebook: Path, tag: str) -> int:
    """Position of the cell tagged ``tag`` (every cell counts, as in the page)."""
    nb = nbformat.read(notebook, as_version=4)
    for i, cell in enumerate(nb.cells):
        if tag in cell.metadata.get("tags", []):
            return i
    raise KeyError(f"no cell tagged {tag!r} in {notebook.name}")


# ---- the page ----------------------------------------------------------------------------

def open_notebook(page: Any, server: LabServer, name: str, timeout: float = 120.0) -> None:
    """Open ``name`` in JupyterLab and wait until its kernel has started and is idle."""
    page.goto(server.notebook_url(name))
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=timeout * 1000)
    deadline = time.monotonic() + timeout
    # The toolbar says "idle" before a kernel is attached; the server knows when it really is.
    while not any(s["path"] == name and s["kernel"]["execution_state"] == "idle"
                  for s in server.api("GET", "/api/sessions")):
        if time.monotonic() > deadline:
            raise AssertionError(f"the kernel for {name} did not start within {timeout:.0f} s")
        time.sleep(0.3)
    wait_kernel_idle(page, timeout)
    # Fold the file browser away (Ctrl+B): a wider notebook reads better in screenshots.
    if page.locator("#jp-left-stack").is_visible():
        page.locator(".jp-Notebook").first.click(position={"x": 5, "y": 5})
        page.keyboard.press("Escape")
        page.keyboard.press("Control+b")


def wait_kernel_idle(page: Any, timeout: float) -> None:
    page.wait_for_selector(
        ".jp-NotebookPanel-toolbar .jp-Notebook-ExecutionIndicator[data-status='idle']",
        timeout=timeout * 1000)


def run_all_cells(page: Any) -> None:
    """Run > Run All Cells, through the menu bar as a student would."""
    _until_prompts_change(page, lambda: (
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click(),
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()))


def run_cell(page: Any, index: int) -> None:
    """Select the cell at ``index`` and run it with Ctrl+Enter (the cursor stays on it)."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)

    def press() -> None:
        cell.locator(".jp-InputPrompt").first.click()
        page.keyboard.press("Escape")  # command mode: the shortcut runs the selected cell
        page.keyboard.press("Control+Enter")

    _until_prompts_change(page, press)


def run_cells(page: Any, indices: list[int], timeout: float) -> None:
    """Run the cells at ``indices`` in order, as a student pressing Ctrl+Enter on each would:
    each is queued behind the one before; then wait once until all are done, and fail naming any
    that never got an execution count."""
    for i in indices:
        run_cell(page, i)
    wait_until_done(page, timeout=timeout)
    prompts = page.eval_on_selector_all(
        ".jp-Notebook .jp-Cell", "els => els.map(e => { const p = e.querySelector("
        "'.jp-InputArea .jp-InputPrompt'); return p ? p.textContent.trim() : ''; })")
    never = [i for i in indices if not re.fullmatch(r"\[\d+\]:", prompts[i])]
    assert not never, f"cells {never} did not run: prompts {[prompts[i] for i in never]}"


def _until_prompts_change(page: Any, action: Any, tries: int = 3) -> None:
    """Do ``action`` until some execution prompt changes (a click can land before the page is
    ready to take it), at most ``tries`` times."""
    before = code_prompts(page)
    for _ in range(tries):
        action()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if code_prompts(page) != before:
                return
            time.sleep(0.2)
        page.keyboard.press("Escape")  # close a menu left open
    raise AssertionError(f"no cell started running after {tries} tries")


def wait_until_done(page: Any, timeout: float, settle: float = 2.0) -> None:
    """Wait until no cell is queued or running (``[*]``) and the kernel has been idle a while.

    ``settle`` seconds of quiet cover the moment between a click and the first cell starting.
    """
    deadline = time.monotonic() + timeout
    quiet_since = None
    while time.monotonic() < deadline:
        busy = page.evaluate(
            "() => [...document.querySelectorAll('.jp-Notebook .jp-InputPrompt')]"
            ".some(p => p.textContent.includes('*')) || !document.querySelector("
            "'.jp-NotebookPanel-toolbar .jp-Notebook-ExecutionIndicator[data-status=\"idle\"]')")
        if busy:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= settle:
            return
        time.sleep(0.25)
    raise AssertionError(f"cells were still running after {timeout:.0f} s")


def code_prompts(page: Any) -> list[str]:
    """The execution prompt of every code cell: ``[3]:`` once run, ``[ ]:`` if never run."""
    return page.eval_on_selector_all(
        ".jp-Notebook .jp-CodeCell .jp-InputArea .jp-InputPrompt",
        "els => els.map(e => e.textContent.trim())")


def cell_outputs(page: Any, index: int) -> str:
    """All the output text the page shows under the cell at ``index``."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    return "\n".join(cell.locator(".jp-OutputArea-output").all_inner_texts())


def all_outputs(page: Any) -> list[str]:
    """The text of every output area on the page, one entry per code cell with output."""
    return page.eval_on_selector_all(
        ".jp-Notebook .jp-CodeCell", "cells => cells.map(c => [...c.querySelectorAll("
        "'.jp-OutputArea-output')].map(o => o.innerText).join('\\n')).filter(t => t.trim())")


def widget_report(page: Any, cell: int | None = None) -> dict[str, Any]:
    """What became of the widgets on the page (or in one cell): how many are live, what failed.

    A live widget is an output whose content is a ``.jupyter-widgets`` view; ``failures`` are the
    texts the widget manager leaves instead ("Loading widget...", "Error displaying widget").
    """
    return page.evaluate(f"""([index]) => {{
        const cells = [...document.querySelectorAll('.jp-Notebook .jp-Cell')];
        const scope = index === null ? cells : [cells[index]];
        const outs = scope.flatMap(c => [...c.querySelectorAll('.jp-OutputArea-output')]);
        return {{
            rendered: outs.filter(o => o.querySelector(':scope > .jupyter-widgets')).length,
            failures: outs.map(o => o.innerText).filter(
                t => {json.dumps(list(WIDGET_FAILURES))}.some(f => t.includes(f))),
        }};
    }}""", [cell])


def saved_widget_count(page: Any, server: LabServer, name: str) -> int:
    """Save the notebook (Ctrl+S) and count the widget outputs the kernel produced."""
    page.locator(".jp-Notebook").first.click(position={"x": 5, "y": 5})
    page.keyboard.press("Escape")
    before = server.api("GET", f"/api/contents/{name}?content=0")["last_modified"]
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + 20
    while server.api("GET", f"/api/contents/{name}?content=0")["last_modified"] == before:
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} was not saved within 20 s of Ctrl+S")
        time.sleep(0.3)
    nb = nbformat.reads(json.dumps(server.api("GET", f"/api/contents/{name}")["content"]),
                        as_version=4)
    return sum(WIDGET_MIME in out.get("data", {}) for cell in nb.cells if cell.cell_type == "code"
               for out in cell.get("outputs", []))


def screenshot(page: Any, name: str, focus_index: int | None = None) -> Path:
    """Save the visible page as ``artifacts/screenshots/<name>.png``, scrolled to a cell."""
    if focus_index is not None:
        page.locator(".jp-Notebook .jp-Cell").nth(focus_index).scroll_into_view_if_needed()
        page.locator(".jp-Notebook .jp-Cell").nth(focus_index).evaluate(
            "el => el.scrollIntoView({block: 'start'})")
        time.sleep(0.3)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path))
    if os.environ.get("KIT_UPDATE_SCREENSHOTS") == "1" and re.fullmatch(r"\d\d_\w+", name):
        (ROOT / "docs" / "screenshots").mkdir(parents=True, exist_ok=True)
        shutil.copy(path, ROOT / "docs" / "screenshots" / path.name)
    return path


# ---- what a student must see ---------------------------------------------------------------

RANK_LINE = re.compile(r"^\[rank (\d+)\] (.*)$")
# Terminal colour codes and carriage returns show up as litter in a notebook page.
GARBAGE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]|\[[0-9;]+m|\r")


def assert_rank_output(text: str, world_size: int) -> None:
    """Every rank ``0..world_size-1`` printed at least one line of its own, labelled and clean.

    A line counts when it starts with ``[rank N] `` followed by text; ``N`` must be in range,
    and no line may carry terminal escape codes or carriage returns.
    """
    lines = text.splitlines()
    ranks: dict[int, list[str]] = {}
    for line in lines:
        m = RANK_LINE.match(line)
        if m:
            ranks.setdefault(int(m.group(1)), []).append(m.group(2))
    assert ranks, f"no '[rank N] ...' line in the cell's output:\n{text[:2000]}"
    assert set(ranks) == set(range(world_size)), (
        f"expected output labelled by ranks {list(range(world_size))}, "
        f"got ranks {sorted(ranks)}:\n{text[:2000]}")
    assert all(body.strip() for bodies in ranks.values() for body in bodies), (
        f"a '[rank N]' label with nothing after it:\n{text[:2000]}")
    assert_readable(text)


def assert_readable(text: str) -> None:
    """No terminal colour codes or carriage returns: they show as litter in a page."""
    garbage = [line for line in text.splitlines() if GARBAGE.search(line)]
    assert not garbage, f"terminal escape codes in the page: {garbage[:3]}"


def assert_widgets_rendered(report: dict[str, Any], expected: int) -> None:
    """The kernel produced ``expected`` widgets and the page shows every one of them live."""
    assert not report["failures"], (
        f"widget placeholders or errors in the page: {report['failures']}"
    )
    assert report["rendered"] == expected, (
        f"the kernel produced {expected} widget(s) but the page shows {report['rendered']} live: "
        "without the widget extension JupyterLab falls back to the text repr")


def copy_lessons(dest: Path, solved: bool = True) -> list[Path]:
    """Every ``lessons/NN_*.ipynb`` copied into ``dest`` (solved, unless ``solved=False``)."""
    out = []
    for lesson in sorted((ROOT / "lessons").glob("[0-9][0-9]_*.ipynb")):
        if solved and (ROOT / "solutions" / (lesson.stem + ".py")).exists():
            out.append(solved_lesson(lesson, dest))
        else:
            out.append(Path(shutil.copy(lesson, dest / lesson.name)))
    return out



def lab_fixtures() -> tuple[Any, Any]:
    """The fixtures ``server`` and ``page`` for a test module that defines ``course`` (the folder
    to serve): ``server, page = lab_fixtures()`` at the module's top level."""
    return _server, _page


@pytest.fixture(scope="module", name="server")
def _server(browser: Any, course: Path) -> Any:
    """A JupyterLab serving the test module's ``course`` folder (a fixture the module defines)."""
    with LabServer(course) as srv:
        yield srv


@pytest.fixture(name="page")
def _page(browser: Any, server: LabServer) -> Any:
    """A fresh browser page; the server's kernels are shut down after each test."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    yield context.new_page()
    context.close()
    server.shutdown_kernels()


def code_cell(notebook: Path, text: str) -> int:
    """Index of the first code cell whose source contains ``text``."""
    nb = nbformat.read(notebook, as_version=4)
    return next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and text in c.source)
