"""Hostile Lesson 00 submissions: each attacks the grader once, then answers honestly.

Every entry of :data:`ATTACKS` is the released ``lessons/00_launching_ranks.ipynb`` with the
correct ``shard_range`` and ``global_mean`` and one attack appended to its setup cell, so it
runs in the sandboxed worker when the notebook is loaded, before any case. Each attack prints
what it tried (``ATTACK <name>: ...``) and goes on: the submission must still get its 5 points.
Whether an attack worked is judged from outside by tests/test_isolation.py (files, the output
folder, the loopback port, the process table), never from what the submission prints.

The attacks are written to do no harm if the isolation is missing: they never run as root,
never write into an existing file of the project (opening one for writing and changing its mode
to the mode it has prove the permission without changing a byte), and create only files named
with the run's token, which the test removes and reports.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

from grading_corpus import LESSON, MEAN_OK, SHARD_OK


@dataclass(frozen=True)
class Targets:
    """What the attacks aim at, known to the test when it writes the corpus."""

    root: Path  # the project: autograder/, kit/, .venv
    site_packages: Path  # the grader's venv: a .pth file there runs in every later grader
    out: Path  # the output folder (records, grades.csv, .kit-grade/secret.json)
    submissions: Path  # the folder of every student's notebook
    victim: str  # the student whose notebook the thieves try to read
    grader_pid: int
    port: int  # a TCP port the test listens on, on the host's 127.0.0.1
    token: str  # unique per run: names every file or process an attack creates


_UNPRIVILEGED = (
    "import os as _os\n"
    "if _os.getuid() == 0:  # never as root: a broken sandbox must not hurt this machine\n"
    "    raise SystemExit('refusing to attack as root')\n"
)

WRITES_PROJECT = '''
import os, pathlib, sys
for _d in [{root!r} + "/autograder", {root!r} + "/kit", {root!r} + "/autograder/__pycache__",
           {root!r}]:
    _p = pathlib.Path(_d) / ("_pwned_" + {token!r} + ".py")
    try:
        _p.write_text("raise SystemExit('pwned')\\n")
        print("ATTACK writes_project: created", _p)
    except OSError as _e:
        print("ATTACK writes_project: cannot create", _p, type(_e).__name__)
_pth = pathlib.Path({site!r}) / ("_pwned_" + {token!r} + ".pth")
try:
    _pth.write_text("import os\\n")
    print("ATTACK writes_project: created", _pth)
except OSError as _e:
    print("ATTACK writes_project: cannot create", _pth, type(_e).__name__)
for _f in ["autograder/registry.py", "autograder/lesson00.py", "autograder/grade/batch.py",
           "kit/__init__.py"]:
    _f = pathlib.Path({root!r}) / _f
    try:
        open(_f, "r+b").close()  # opening for writing changes nothing, but proves the permission
        print("ATTACK writes_project: could open for writing", _f)
    except OSError as _e:
        print("ATTACK writes_project: cannot open for writing", _f, type(_e).__name__)
    try:
        os.chmod(_f, os.stat(_f).st_mode)  # the same mode: no change, but proves ownership
        print("ATTACK writes_project: could chmod", _f)
    except OSError as _e:
        print("ATTACK writes_project: cannot chmod", _f, type(_e).__name__)
'''

READS_SECRET = '''
import os
for _p in [{out!r} + "/.kit-grade/secret.json", {out!r} + "/.kit-grade"]:
    try:
        _got = open(_p).read() if not os.path.isdir(_p) else str(os.listdir(_p))
        print("ATTACK reads_secret: read", _p, _got)
    except OSError as _e:
        print("ATTACK reads_secret: cannot read", _p, type(_e).__name__)
'''

WRITES_OUTPUT = '''
import json, pathlib
_out = pathlib.Path({out!r})
for _p, _text in [(_out / ("pwned_" + {token!r}), "x"),
                  (_out / "grades.csv", "student,score\\nwrites_output,100\\n"),
                  (_out / "records" / "writes_output.json",
                   json.dumps({{"student": "writes_output", "score": 100}})),
                  (_out / "records" / ({victim!r} + ".json"),
                   json.dumps({{"student": {victim!r}, "score": 0}}))]:
    try:
        _p.write_text(_text)
        print("ATTACK writes_output: wrote", _p)
    except OSError as _e:
        print("ATTACK writes_output: cannot write", _p, type(_e).__name__)
'''

SIGNALS = '''
import os, signal, time
_me = os.getpid()
_tried, _visible = set(), set()
_deadline = time.monotonic() + 4.0  # long enough to meet the other worker of the batch
while time.monotonic() < _deadline:
    _visible |= {{int(n) for n in os.listdir("/proc") if n.isdigit()}}
    _pids = {{{grader_pid}, os.getppid(), 1}} | _visible
    for _pid in sorted(_pids - {{_me}}):
        try:
            os.kill(_pid, signal.SIGKILL)
            print("ATTACK signals: killed", _pid)
        except OSError as _e:
            if _pid not in _tried:
                print("ATTACK signals: cannot kill", _pid, type(_e).__name__)
        _tried.add(_pid)
    try:
        os.killpg(os.getpgid({grader_pid}), signal.SIGKILL)
        print("ATTACK signals: killed the grader's process group")
    except OSError:
        pass
    try:
        os.kill(-1, signal.SIGKILL)  # every process this uid may signal (never the caller)
    except OSError:
        pass
    time.sleep(0.2)
print("ATTACK signals: visible pids", sorted(_visible - {{_me}}))
'''

CONNECTS = '''
import socket
for _host in ["127.0.0.1", "localhost"]:
    try:
        with socket.create_connection((_host, {port}), timeout=3) as _s:
            _s.sendall(b"pwned " + {token!r}.encode())
        print("ATTACK connects: connected to", _host, {port})
    except OSError as _e:
        print("ATTACK connects: cannot connect to", _host, {port}, type(_e).__name__)
'''

READS_OTHERS = '''
import glob, os
_marker = "VICTIM" + "_" + {token!r}  # built here: this notebook does not contain it
_seen = []
for _p in [{subs!r} + "/" + {victim!r} + ".ipynb", *glob.glob({subs!r} + "/*.ipynb"),
           *glob.glob("/tmp/*/*.ipynb"), *glob.glob("/tmp/kit-grade-*/*"),
           *glob.glob({out!r} + "/records/*.json")]:
    try:
        _text = open(_p, errors="replace").read()
    except OSError as _e:
        print("ATTACK reads_others: cannot read", _p, type(_e).__name__)
        continue
    _seen.append(_p)
    if _marker in _text:
        _i = _text.index(_marker)
        print("ATTACK reads_others: STOLE", _p, _text[max(0, _i - 40):_i + 80])
print("ATTACK reads_others: could read", _seen)
'''

LINGERS = '''
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:  # a grandchild, in a session of its own, outliving its parents
        os.closerange(3, 1024)
        try:
            os.execv("/bin/sleep", ["sleep_" + {token!r}, "600"])
        finally:
            os._exit(0)
    os._exit(0)
time.sleep(0.5)
print("ATTACK lingers: left a sleeper behind")
'''

ATTACKS = {
    "writes_project": WRITES_PROJECT,
    "reads_secret": READS_SECRET,
    "writes_output": WRITES_OUTPUT,
    "signals": SIGNALS,
    "connects": CONNECTS,
    "reads_others": READS_OTHERS,
    "lingers": LINGERS,
}
# Honest submissions graded in the same batch: their grades must not change.
BYSTANDERS = {"victim": 5.0, "correct": 5.0, "stub": 0.0}


def _notebook(shard: str | None, mean: str | None, setup_extra: str = "") -> str:
    nb = copy.deepcopy(json.loads(LESSON.read_text()))
    for cell in nb["cells"]:
        if cell.get("id") == "task-0-1" and shard is not None:
            cell["source"] = shard
        if cell.get("id") == "task-0-2" and mean is not None:
            cell["source"] = mean
        if cell.get("id") == "setup" and setup_extra:
            cell["source"] = "".join(cell["source"]) + "\n" + setup_extra
    return json.dumps(nb)


def write_corpus(targets: Targets) -> dict[str, float]:
    """Write one notebook per attack and per bystander; returns each student's expected score."""
    folder = targets.submissions
    folder.mkdir(parents=True, exist_ok=True)
    fields = {"root": str(targets.root), "site": str(targets.site_packages),
              "out": str(targets.out), "subs": str(folder), "victim": targets.victim,
              "grader_pid": targets.grader_pid, "port": targets.port, "token": targets.token}
    expected = {}
    for name, attack in ATTACKS.items():
        code = _UNPRIVILEGED + attack.format(**fields)
        (folder / f"{name}.ipynb").write_text(_notebook(SHARD_OK, MEAN_OK, code))
        expected[name] = 5.0
    victim = (f"# VICTIM_{targets.token}: this notebook's secret, which no other submission "
              "may read\n")
    (folder / f"{targets.victim}.ipynb").write_text(_notebook(SHARD_OK, MEAN_OK, victim))
    (folder / "correct.ipynb").write_text(_notebook(SHARD_OK, MEAN_OK))
    (folder / "stub.ipynb").write_text(_notebook(None, None))
    expected.update(BYSTANDERS)
    return expected
