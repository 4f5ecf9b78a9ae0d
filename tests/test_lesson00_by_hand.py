"""Lesson 00, "Starting ranks by hand": the scripts the lesson writes give kit.launch's results.

The scripts are taken from the lesson source's ``%%writefile`` cells, so these tests run exactly
what a student runs. The trusted reference is a single-process sum; kit.launch runs the script's
own ``work`` function. The section itself (the notebook function that cannot be spawned, the
timing table) is read from the lesson's one headless run, in the slow test.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import jupytext
import pytest
from conftest import executed_lesson

from autograder import course
from kit.launcher import run_ranks

SOURCE = course.lesson(0).source
WRITEFILE = re.compile(r"%%writefile \{BY_HAND\}/(\w+\.py)\n")
SECTION, NEXT_SECTION = "## 4. Starting ranks by hand", "## 5. "


def write_scripts(folder: Path) -> dict[str, Path]:
    """Write every script of the lesson's by-hand section into folder, as its cells do."""
    written = {}
    for cell in jupytext.read(SOURCE).cells:
        match = WRITEFILE.match(cell.source)
        if cell.cell_type == "code" and match:
            path = folder / match.group(1)
            path.write_text(cell.source[match.end():] + "\n")
            written[match.group(1)] = path
    assert set(written) == {"spawn_by_hand.py", "process_by_hand.py"}, written
    return written


def run(folder: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=folder, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"python {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def results_in(printed: str) -> list[float]:
    return ast.literal_eval(re.search(r"results by rank: (\[.*\])", printed).group(1))


def import_script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sum_of_squares(world_size: int) -> float:
    """What every rank of `work` must hold: sum of (rank + 1)^2, computed in one process."""
    return float(sum((rank + 1) ** 2 for rank in range(world_size)))


@pytest.fixture(scope="module")
def scripts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_scripts(tmp_path_factory.mktemp("by-hand"))


def test_spawn_by_hand_gives_kit_launch_result_on_the_same_function(scripts):
    folder = scripts["spawn_by_hand.py"].parent
    by_hand = results_in(run(folder, "spawn_by_hand.py", "4"))
    work = import_script(scripts["spawn_by_hand.py"]).work
    by_launch = list(run_ranks(work, world_size=4, echo=False))
    assert by_hand == by_launch == [sum_of_squares(4)] * 4


@pytest.mark.parametrize("world_size", [2, 4])
def test_process_and_join_with_fork_gives_kit_launch_result(scripts, world_size):
    folder = scripts["process_by_hand.py"].parent
    printed = run(folder, "process_by_hand.py", "fork", str(world_size))
    assert f"Process (fork): {world_size} ranks" in printed
    work = import_script(scripts["spawn_by_hand.py"]).work
    by_launch = list(run_ranks(work, world_size=world_size, echo=False))
    assert results_in(printed) == by_launch == [sum_of_squares(world_size)] * world_size


@pytest.mark.slow
def test_process_and_join_with_spawn_gives_the_same_result(scripts):
    printed = run(scripts["process_by_hand.py"].parent, "process_by_hand.py", "spawn", "3")
    assert results_in(printed) == [sum_of_squares(3)] * 3


@pytest.mark.slow
def test_section_runs_headless_and_shows_the_spawn_failure_and_the_timings():
    """The section's own cells, in the lesson's one headless run (shared with
    tests/test_runner.py)."""
    result = executed_lesson(SOURCE)
    assert result.ok, str(result.failure)
    cells = result.notebook.cells
    start = next(
        i for i, c in enumerate(cells) if c.cell_type == "markdown" and SECTION in c.source
    )
    stop = next(i for i, c in enumerate(cells) if i > start and c.cell_type == "markdown"
                and NEXT_SECTION in c.source)
    outputs = [o for c in cells[start:stop] for o in c.get("outputs", [])]
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "same as by hand: True" in printed
    # the real error of a spawned child that looks up a notebook function, caught
    assert "ProcessExitedException: process 0 terminated with exit code 1" in printed
    assert "Can't get attribute 'notebook_rank' on <module '__main__'" in printed
    assert "kit.launch, spawn: [30.0, 30.0, 30.0, 30.0]" in printed  # cloudpickle ships it
    assert "same result everywhere: True" in printed
    timings = dict(re.findall(r"^(mp\.spawn \(by hand\)|Process \+ fork \(by hand\)|"
                              r"kit\.launch \(fork\)|kit\.launch \(spawn \+ cloudpickle\))\s+"
                              r"([0-9.]+) s$", printed, re.MULTILINE))
    assert len(timings) == 4 and all(float(s) > 0 for s in timings.values()), printed
    assert {o.name for o in outputs if o.output_type == "stream"} == {"stdout"}
    assert any("image/png" in o.get("data", {}) for o in outputs)
