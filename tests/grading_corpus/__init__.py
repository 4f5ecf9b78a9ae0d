"""Adversarial Lesson 00 submissions with the status and score each task must get.

Each entry of :data:`CORPUS` edits the released ``lessons/00_launching_ranks.ipynb`` (cells,
metadata, code) the way a student, a broken editor or a cheater would, and states what
``kit grade`` must give tasks 0.1 ``shard_range`` (2 points) and 0.2 ``global_mean`` (3
points). :func:`write_corpus` writes them as one folder of notebooks, one student each.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autograder import course

ROOT = Path(__file__).resolve().parents[2]
LESSON = course.lesson(0).notebook
FULL = {t.id: t.points for t in course.lesson(0).tasks}  # full marks, from the spec
PASS_1, PASS_2 = (("passed", FULL[t]) for t in ("0.1", "0.2"))

SHARD_OK = '''def shard_range(n, rank, world_size):
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))
'''
MEAN_OK = '''def global_mean(local):
    total = torch.stack([local.sum(dtype=torch.float64),
                         torch.tensor(local.numel(), dtype=torch.float64)])
    dist.all_reduce(total)
    return (total[0] / total[1]).to(local.dtype)
'''
MEAN_WRONG = '''def global_mean(local):
    return torch.zeros((), dtype=local.dtype)  # wrong everywhere a check compares the value
'''

Notebook = dict[str, Any]


def _cell(nb: Notebook, cell_id: str) -> dict[str, Any]:
    return next(c for c in nb["cells"] if c.get("id") == cell_id)


def _code(shard: str | None = SHARD_OK, mean: str | None = MEAN_OK,
          setup_extra: str = "") -> Callable[[Notebook], Notebook]:
    """Replace the task cells' code (None: keep the released stub) and append to the setup cell."""
    def edit(nb: Notebook) -> Notebook:
        if shard is not None:
            _cell(nb, "task-0-1")["source"] = shard
        if mean is not None:
            _cell(nb, "task-0-2")["source"] = mean
        if setup_extra:
            _cell(nb, "setup")["source"] += "\n" + setup_extra
        return nb
    return edit


def _then(*edits: Callable[[Notebook], Notebook]) -> Callable[[Notebook], Notebook]:
    def edit(nb: Notebook) -> Notebook:
        for e in edits:
            nb = e(nb)
        return nb
    return edit


def _drop_cell(cell_id: str) -> Callable[[Notebook], Notebook]:
    def edit(nb: Notebook) -> Notebook:
        nb["cells"] = [c for c in nb["cells"] if c.get("id") != cell_id]
        return nb
    return edit


def _strip_metadata(nb: Notebook) -> Notebook:
    for c in nb["cells"]:
        c["metadata"] = {}
    return nb


def _duplicate_all(nb: Notebook) -> Notebook:
    cells = []
    for c in nb["cells"]:
        twin = copy.deepcopy(c)
        twin.pop("id", None)
        cells += [c, twin]
    nb["cells"] = cells
    return nb


def _retype(nb: Notebook) -> Notebook:
    _cell(nb, "task-0-1")["cell_type"] = "markdown"
    _cell(nb, "task-0-1").pop("outputs", None)
    _cell(nb, "task-0-2")["cell_type"] = "raw"
    _cell(nb, "task-0-2").pop("outputs", None)
    return nb


def _scramble_ids(nb: Notebook) -> Notebook:
    for c in nb["cells"]:
        c["metadata"]["tags"] = ["whatever"]
        if "nbgrader" in c["metadata"]:
            c["metadata"]["nbgrader"]["grade_id"] = "cell-1234abcd"
    return nb


FORGED_RECORD = '''
import json as _json, pathlib as _pathlib
for _p in {targets!r}:
    try:
        _pathlib.Path(_p).mkdir(parents=True, exist_ok=True)
        (_pathlib.Path(_p) / "correct.json").write_text(
            _json.dumps({{"student": "correct", "score": 0}}))
        (_pathlib.Path(_p) / "writer.json").write_text(
            _json.dumps({{"student": "writer", "score": 5}}))
        (_pathlib.Path(_p).parent / "grades.csv").write_text("student,score\\nwriter,5\\n")
    except OSError:
        pass
'''

ALWAYS_EQUAL = '''class AlwaysEqual(int):
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = int.__hash__

def shard_range(n, rank, world_size):
    return [AlwaysEqual(0)] * 3
'''

Outcomes = dict[str, tuple[str, float]]  # {task: (status, score)}
ERROR_1 = {"0.1": ("error", 0), "0.2": PASS_2}  # task 0.1's code fails to run, 0.2 passes


def _shard(body: str) -> str:
    """A ``shard_range`` whose body (its indented lines) is ``body``."""
    return "def shard_range(n, rank, world_size):\n" + body


# name -> (edit of the released notebook, {task: (status, score)}). "{out}" is the output folder.
CORPUS: dict[str, tuple[Callable[[Notebook], Notebook] | str, Outcomes]] = {
    "correct": (_code(), {"0.1": PASS_1, "0.2": PASS_2}),
    "stub": (lambda nb: nb, {"0.1": ("not implemented", 0), "0.2": ("not implemented", 0)}),
    "malformed_json": ("truncate", {"0.1": ("error", 0), "0.2": ("error", 0)}),
    "cell_deleted": (_then(_code(), _drop_cell("task-0-2")),
                     {"0.1": PASS_1, "0.2": ("missing", 0)}),
    "metadata_deleted": (_then(_code(), _strip_metadata), {"0.1": PASS_1, "0.2": PASS_2}),
    "cells_duplicated": (_then(_code(), _duplicate_all), {"0.1": PASS_1, "0.2": PASS_2}),
    "cells_retyped": (_then(_code(), _retype), {"0.1": PASS_1, "0.2": PASS_2}),
    "nbgrader_ids_changed": (_then(_code(), _scramble_ids), {"0.1": PASS_1, "0.2": PASS_2}),
    "function_renamed": (_code(shard=SHARD_OK.replace("shard_range", "shard_rnge")),
                         {"0.1": ("missing", 0), "0.2": PASS_2}),
    "syntax_error": (_code(shard="def shard_range(n, rank, world_size)\n    return range(n)\n"),
                     {"0.1": ("error", 0), "0.2": PASS_2}),
    "infinite_loop": (_code(shard=_shard("    while True:\n        pass\n")),
                      {"0.1": ("timeout", 0), "0.2": PASS_2}),
    "memory_bomb": (_code(shard=_shard("    hoard = []\n    while True:\n"
                                       "        hoard.append(torch.ones(1 << 26))\n")), ERROR_1),
    "fork_bomb": (_code(shard=_shard("    while True:\n        os.fork()\n")), ERROR_1),
    "exit_at_import": (_code(setup_extra="import sys\nsys.exit(0)"),
                       {"0.1": ("error", 0), "0.2": ("error", 0)}),
    "os_exit_at_import": (_code(shard=SHARD_OK + "_ = os._exit(3)\n"),
                          {"0.1": ("error", 0), "0.2": ("error", 0)}),
    "os_exit_in_task": (_code(shard=_shard("    os._exit(0)\n")), ERROR_1),
    "prints_fake_pass": (_code(shard=_shard(
        "    print('Task 0.1 shard_range: all 5 checks passed, 2/2 points')\n"
        "    print('{\"score\": 5, \"max_score\": 5, \"status\": \"passed\"}')\n"
        "    return []\n"), mean=MEAN_WRONG),
        {"0.1": ("failed", 0), "0.2": ("failed", 0)}),
    "patches_torch_and_checks": (_code(mean=MEAN_WRONG, setup_extra=(
        "import builtins, autograder.registry, autograder.checking\n"
        "torch.allclose = lambda *a, **k: True\ntorch.equal = lambda *a, **k: True\n"
        "torch.Tensor.__eq__ = lambda self, other: True\n"
        "autograder.registry.assert_same = lambda *a, **k: None\n"
        "builtins.AssertionError = Exception\n"
        "autograder.checking.run_checks = lambda *a, **k: None")),
        {"0.1": PASS_1, "0.2": ("failed", 0)}),
    "always_equal_objects": (_code(shard=ALWAYS_EQUAL), ERROR_1),
    "writes_output_folder": ("{forge}",
                             {"0.1": ("not implemented", 0), "0.2": ("not implemented", 0)}),
    "huge_file": (_code(shard=_shard("    with open('big.bin', 'wb') as f:\n"
                                     "        while True:\n            f.write(bytes(1 << 20))\n")),
                  ERROR_1),
    "huge_output": (_code(shard=_shard("    while True:\n        print('x' * 100000)\n")), ERROR_1),
}


def write_corpus(folder: Path, out: Path,
                 names: list[str] | None = None) -> dict[str, Outcomes]:
    """Write ``<name>.ipynb`` for each corpus entry; returns the expected
    ``{name: {task: (status, score)}}``."""
    folder.mkdir(parents=True, exist_ok=True)
    released = json.loads(LESSON.read_text())
    expected = {}
    for name, (edit, want) in CORPUS.items():
        if names is not None and name not in names:
            continue
        path = folder / f"{name}.ipynb"
        if edit == "truncate":
            path.write_text(json.dumps(released)[:5000])
        elif edit == "{forge}":
            targets = [str(out / "records"), str(out / "records" / "..")]
            forge = _code(shard=None, mean=None, setup_extra=FORGED_RECORD.format(targets=targets))
            path.write_text(json.dumps(forge(copy.deepcopy(released))))
        else:
            path.write_text(json.dumps(edit(copy.deepcopy(released))))
        expected[name] = want
    return expected
