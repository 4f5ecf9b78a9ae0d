"""benchmarks/gpu_smoke.py is the "Running at scale" code of every lesson whose spec names a
gpu_smoke, executed (autograder/course.py says why a lesson has none): each such lesson has its
check there, every call its snippet makes is made by its check, and (slow) the whole script
passes with gloo on 2 CPU ranks, CUDA-only parts skipped by name."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autograder import course

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_smoke.py"
# What the script's worker does for every lesson (process group, device), not a lesson's check.
SET_UP_BY_WORKER = {
    "init_process_group",
    "set_device",
    "destroy_process_group",
    "int",
}  # int(LOCAL_RANK)
# A snippet's call the script makes under another name, to run on CPU as well.
SAME_AS = {"cuda": "to"}  # model.cuda() is model.to(device) on a GPU rank


def _source(lesson: int) -> str:
    return course.lesson(lesson).source.read_text()


def snippet_code(lesson: int) -> str:
    """The Python of a lesson's "Running at scale" note: its ```python blocks, unquoted."""
    text = _source(lesson)
    note = text[text.index("# ## Running at scale"):]
    note = note[:note.index("\n# %%")] if "\n# %%" in note else note
    lines = [re.sub(r"^# ?(> ?)?", "", line) for line in note.splitlines()]
    blocks = re.findall(r"^```python\n(.*?)^```", "\n".join(lines), re.S | re.M)
    return "\n".join(blocks)


def calls(code: str) -> set[str]:
    """Names called in code (``f(`` and ``x.f(``), comments and strings left out."""
    code = "\n".join(line.split("#")[0] for line in code.splitlines())
    code = re.sub(r"(\"[^\"]*\"|'[^']*')", "''", code)
    return set(re.findall(r"([A-Za-z_]\w*)\s*\(", code)) - {"print"}


def _check_source(lesson: int) -> str:
    tree = ast.parse(SCRIPT.read_text())
    funcs = {n.name: ast.get_source_segment(SCRIPT.read_text(), n) for n in tree.body
             if isinstance(n, ast.FunctionDef)}
    return funcs[f"lesson{lesson:02d}"] + funcs["_one_step"]


SMOKED = [spec.number for spec in course.LESSONS if spec.gpu_smoke]


@pytest.mark.parametrize("lesson", SMOKED)
def test_every_lessons_running_at_scale_has_its_check(lesson):
    """The spec's gpu_smoke names what the script's lessonNN(device) runs for the lesson."""
    assert "## Running at scale" in _source(lesson)
    assert f"def lesson{lesson:02d}(device" in SCRIPT.read_text()


# Lessons 00-04's notes are launch commands (torchrun, srun): their Python is the lesson's own.
@pytest.mark.parametrize("lesson", [n for n in SMOKED if n >= 5])
def test_the_script_makes_every_call_of_the_lessons_snippet(lesson):
    code = snippet_code(lesson)
    assert code.strip(), f"Lesson {lesson:02d}'s Running at scale has no ```python block"
    made = calls(_check_source(lesson))
    missing = {
        c for c in calls(code) - SET_UP_BY_WORKER if c not in made and SAME_AS.get(c) not in made
    }
    assert not missing, (
        f"Lesson {lesson:02d}'s snippet calls {sorted(missing)}, which "
        f"benchmarks/gpu_smoke.py's lesson{lesson:02d} does not: keep them the same"
    )


def test_calls_finds_what_a_snippet_calls():
    assert calls('model = DDP(Net().cuda(), device_ids=[r])  # fully_shard(x)\nprint("a(b)")') == \
        {"DDP", "Net", "cuda"}


@pytest.mark.slow
def test_gpu_smoke_passes_on_two_gloo_ranks():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "2"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert [line[6:15] for line in lines] == [f"Lesson {n:02d}" for n in SMOKED], lines
    assert all(line.startswith("PASS") for line in lines), lines
    for n in (5, 7):  # the CUDA-only parts say what they skipped
        assert "CUDA only, skipped" in lines[n], lines[n]
