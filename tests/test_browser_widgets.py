"""The widgets of Lessons 05, 08 and 09 in a real browser: they render, a control moved through
the page changes what they show, and the numbers shown are the lesson's own functions' for the
inputs the page shows.

Each test opens the lesson (solved copy) in JupyterLab started with ``kit lab``'s command, runs
its setup cell and the widget's cell through the UI, reads every control's label and readout
from the page, moves one control with the keyboard (the observer runs in the kernel, so a new
output proves the round trip) and recomputes the output here with :mod:`kit.lessons` from the
readouts. A label cut short by the page (an ellipsis) fails. Screenshots go to
``artifacts/screenshots/widget_*.png``. Skips like tests/test_browser.py without Chromium.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import nbformat
import pytest
from browser_support import (  # noqa: F401 - page, server: fixtures
    ROOT,
    LabServer,
    assert_widgets_rendered,
    cell_index,
    code_cell,
    lab_fixtures,
    open_notebook,
    run_cell,
    screenshot,
    solved_lesson,
    wait_until_done,
    widget_report,
)

from autograder import course as course_spec
from kit.lessons.parallelism import Model, layout_table
from kit.lessons.proteins import _format_bytes, alphafold_pair_memory
from kit.lessons.sharding import MODEL_SIZES, STAGES, params_label, stage_bytes

STEMS = {n: course_spec.lesson(n).stem for n in (5, 8, 9)}
server, page = lab_fixtures()


@pytest.fixture(scope="module")
def course(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("widgets")
    for n in STEMS:
        solved_lesson(course_spec.lesson(n).notebook, folder)
    return folder


def show_widget(page: Any, server: LabServer, notebook: Path, *needed: str) -> Any:
    """Run the setup cell, the cells defining ``needed[:-1]`` and the widget cell ``needed[-1]``;
    return the widget cell's locator once its widget is live."""
    open_notebook(page, server, notebook.name)
    for i in (cell_index(notebook, "setup"), *(code_cell(notebook, t) for t in needed)):
        run_cell(page, i)
        wait_until_done(page, timeout=300)
    index = code_cell(notebook, needed[-1])
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    cell.locator(".jupyter-widgets").first.wait_for(timeout=60_000)
    assert_widgets_rendered(widget_report(page, index), expected=1)
    cell.scroll_into_view_if_needed()
    return cell, index


_CONTROLS = """el => ({
    sliders: [...el.querySelectorAll('.widget-slider')].map(s => {
        const l = s.querySelector('.widget-label'), r = s.querySelector('.widget-readout');
        return {label: l ? l.textContent.trim() : '',
                cut: l ? l.scrollWidth > l.clientWidth + 1 : true,
                readout: r ? r.innerText.trim() : ''};
    }),
    toggles: [...el.querySelectorAll('.widget-toggle-buttons')].map(t => {
        const l = t.querySelector('.widget-label');
        return {label: l ? l.textContent.trim() : '',
                cut: l ? l.scrollWidth > l.clientWidth + 1 : true,
                active: (t.querySelector('.mod-active') || {}).textContent};
    }),
    dropdowns: [...el.querySelectorAll('.widget-dropdown')].map(d => ({
        label: (d.querySelector('.widget-label') || {}).textContent,
        value: (d.querySelector('select') || {}).value})),
    text: [...el.querySelectorAll('.widget-output, .widget-html-content')]
        .map(o => o.innerText).join('\\n'),
})"""


def controls(cell: Any) -> dict[str, Any]:
    return cell.evaluate(_CONTROLS)


def readouts(state: dict[str, Any]) -> dict[str, str]:
    return {s["label"]: s["readout"] for s in state["sliders"]}


def assert_labels_whole(state: dict[str, Any], labels: list[str]) -> None:
    shown = [c["label"] for c in state["sliders"] + state["toggles"]]
    assert shown == labels, f"control labels {shown}, expected {labels}"
    cut = [c["label"] for c in state["sliders"] + state["toggles"] if c["cut"]]
    assert not cut, f"labels cut short by the page: {cut}"


def move(cell: Any, label: str, key: str = "ArrowRight") -> None:
    """Focus the handle of the slider labelled ``label`` and press ``key`` once."""
    slider = cell.locator(".widget-slider", has=cell.page.locator(".widget-label", has_text=label))
    slider.locator(".noUi-handle, [role='slider']").first.focus()
    cell.page.keyboard.press(key)


def wait_for_change(cell: Any, before: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = controls(cell)
        if state["text"] != before and state["text"].strip():
            time.sleep(0.5)  # an Output widget clears, then draws: let it finish
            return controls(cell)
        time.sleep(0.2)
    raise AssertionError(f"the widget's output did not change within {timeout:.0f} s:\n{before}")


# ---- Lesson 05: the ZeRO memory calculator ------------------------------------------------

def calculator_lines(state: dict[str, Any]) -> dict[str, float]:
    found = {}
    for label in STAGES.values():
        m = re.search(rf"^{re.escape(label)}\s+([\d.]+) GiB per rank", state["text"], re.M)
        assert m, f"no line for {label} in the calculator's output:\n{state['text']}"
        found[label] = float(m.group(1))
    return found


def assert_calculator_agrees(state: dict[str, Any]) -> None:
    shown = readouts(state)
    params = {params_label(p): p for p in MODEL_SIZES}[shown["parameters"]]
    world, precision = int(shown["world size"]), state["dropdowns"][0]["value"]
    want = {label: round(sum(stage_bytes(params, world, stage, precision).values()) / 2**30, 2)
            for stage, label in STAGES.items()}
    assert calculator_lines(state) == pytest.approx(want, abs=0.006), (shown, state["text"])


@pytest.mark.browser
def test_lesson05_memory_calculator(page: Any, server: LabServer, course: Path) -> None:
    cell, index = show_widget(page, server, course / f"{STEMS[5]}.ipynb", "memory_calculator()")
    state = controls(cell)
    assert_labels_whole(state, ["parameters", "world size"])
    assert readouts(state) == {"parameters": "7B", "world size": "8"}  # "7B", not "7.00e+9"
    assert_calculator_agrees(state)
    # log-spaced: the default 8 ranks sits well inside the slider, not at its left end
    slider = cell.locator(
        ".widget-slider", has=page.locator(".widget-label", has_text="world size")
    )
    knob = slider.locator(".noUi-handle").first.bounding_box()
    track = slider.locator(".noUi-target").first.bounding_box()
    assert (knob["x"] + knob["width"] / 2 - track["x"]) / track["width"] > 0.2, (knob, track)

    move(cell, "world size")
    state = wait_for_change(cell, state["text"])
    assert readouts(state)["world size"] == "16"
    assert_calculator_agrees(state)
    screenshot(page, "widget_05_memory_calculator", focus_index=index)


# ---- Lesson 08: layouts of a 13B model ---------------------------------------------------

# The lesson's own model (its cell `model_13b = Model(...)`), checked below against the source.
MODEL_13B = (
    "model_13b = Model(layers=40, hidden=5120, heads=40, seq=2048, batch=512, micro_batch=1)"
)


def layout_rows(cell: Any) -> list[dict[str, Any]]:
    return cell.evaluate("""el => [...el.querySelectorAll('.widget-html-content table tr')].slice(1)
        .map(tr => ({cells: [...tr.querySelectorAll('td')].map(td => td.innerText.trim()),
                     grey: getComputedStyle(tr).color === 'rgb(153, 153, 153)'}))""")


def assert_layouts_agree(cell: Any, state: dict[str, Any]) -> None:
    shown = readouts(state)
    model = Model(layers=int(shown["layers"]), hidden=int(shown["hidden"]), heads=40,
                  seq=int(shown["sequence"]), batch=512, micro_batch=1)
    want = sorted(
        layout_table(model, int(shown["GPUs"])), key=lambda r: sum(r.comm_seconds.values())
    )
    rows = layout_rows(cell)
    assert len(rows) == len(want), (shown, rows)
    for row, r in zip(rows, want):
        assert row["cells"][:4] == [str(r.dp), str(r.tp), str(r.pp), f"{r.memory_bytes / 1e9:.1f}"]
        assert row["cells"][4:7] == [f"{r.comm_bytes[k] / 1e9:.2f}" for k in ("dp", "tp", "pp")]
        assert row["grey"] == (r.memory_bytes / 1e9 > 80), row
    assert any(r["grey"] for r in rows) and not all(r["grey"] for r in rows)


@pytest.mark.browser
def test_lesson08_layout_table(page: Any, server: LabServer, course: Path) -> None:
    notebook = course / f"{STEMS[8]}.ipynb"
    assert (
        MODEL_13B
        in nbformat.read(notebook, as_version=4).cells[code_cell(notebook, "model_13b =")].source
    )
    cell, index = show_widget(page, server, notebook, "model_13b =", "layout_widget(model_13b")
    state = controls(cell)
    assert_labels_whole(state, ["GPUs", "layers", "hidden", "sequence"])
    assert "grey rows: do not fit in 80 GB per GPU" in state["text"]
    assert_layouts_agree(cell, state)

    move(cell, "GPUs")
    state = wait_for_change(cell, state["text"])
    assert readouts(state)["GPUs"] == "128"
    assert_layouts_agree(cell, state)
    screenshot(page, "widget_08_layouts", focus_index=index)


# ---- Lesson 09: AlphaFold pair memory ----------------------------------------------------

def assert_pair_memory_agrees(state: dict[str, Any]) -> None:
    shown = readouts(state)
    length, c_z, heads = (int(shown[k]) for k in ("L (residues)", "c_z (pair channels)", "heads"))
    chunk, precision = int(shown["chunk rows (0 = unchunked)"]), state["toggles"][0]["active"]
    b = {"fp32": 4, "bf16": 2}[precision]
    full = alphafold_pair_memory(length, c_z, heads, None, b)
    cut = alphafold_pair_memory(length, c_z, heads, chunk or None, b)
    text = state["text"]
    assert f"L={length}, c_z={c_z}, heads={heads}, {precision}" in text, text
    assert re.search(rf"pair representation\s+{re.escape(_format_bytes(full['pair']))}", text), text
    assert re.search(rf"unchunked\s+{re.escape(_format_bytes(full['logits']))}", text), text
    assert re.search(
        rf"chunk={chunk or length}\s+{re.escape(_format_bytes(cut['logits']))}", text
    ), text


@pytest.mark.browser
def test_lesson09_pair_memory(page: Any, server: LabServer, course: Path) -> None:
    cell, index = show_widget(
        page, server, course / f"{STEMS[9]}.ipynb", "alphafold_memory_widget()"
    )
    state = controls(cell)
    assert_labels_whole(state, ["L (residues)", "c_z (pair channels)", "heads",
                                "chunk rows (0 = unchunked)", "precision"])
    assert state["toggles"][0]["active"] == "bf16"
    assert_pair_memory_agrees(state)

    move(cell, "chunk rows")
    state = wait_for_change(cell, state["text"])
    assert readouts(state)["chunk rows (0 = unchunked)"] == "80"
    assert_pair_memory_agrees(state)
    cell.locator(".widget-toggle-button", has_text="fp32").click()
    state = wait_for_change(cell, state["text"])
    assert state["toggles"][0]["active"] == "fp32"
    assert_pair_memory_agrees(state)
    screenshot(page, "widget_09_pair_memory", focus_index=index)
