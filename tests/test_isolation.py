"""Grading as root: student code never runs as root and cannot touch the grader.

A batch of hostile Lesson 00 submissions (tests/isolation_corpus: one attack each, then honest
answers) is graded with 2 workers, as root, next to three honest bystanders. Every attack must
fail, judged from outside: the project's autograder/ and kit/ are byte-identical, the output
folder holds only what the grader wrote, the secret and the victim's notebook appear in no
record, the host's loopback port never sees a connection, and nothing is left running. Every
submission still gets the points its honest tasks deserve.

These tests need what CI has: root and bubblewrap. Elsewhere they skip; with ``CI=true`` they fail.
On a clean clone (CI) every file of autograder/ and kit/ must be byte-identical; on a working
copy that people edit while the batch runs, their files are told apart from what the attacks aim at.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import secrets
import socket
import stat
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
from pathlib import Path

import pytest
from isolation_corpus import ATTACKS, BYSTANDERS, Targets, write_corpus

from autograder.grade import sandbox
from autograder.grade.batch import BatchConfig, grade_batch, load_records
from autograder.grade.reports import feedback_text, write_outputs
from autograder.grade.sandbox import UID_BASE, Isolation, Limits, isolation, isolation_note
from autograder.grade.submissions import discover

ROOT = Path(__file__).resolve().parents[1]
LIMITS = Limits(case_wall_s=30.0, memory=2 << 30, output=1 << 20, file_size=16 << 20)
WORKERS = 2


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _need_namespaces() -> None:
    found = isolation()
    if found.namespaces:
        return
    reason = f"no namespaced sandbox on this machine: {found.missing}"
    if _in_ci():
        pytest.fail(f"CI runs as root with bubblewrap: {reason}", pytrace=False)
    pytest.skip(reason)


def _tree_digest() -> dict[str, tuple[str, int]]:
    """Every file under autograder/ and kit/: (mode and bytes, owner), bytecode caches left out:
    the grader and other test runs write those legitimately."""
    digest = {}
    for top in ("autograder", "kit"):
        for path in sorted((ROOT / top).rglob("*")):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            info = path.stat()
            digest[str(path.relative_to(ROOT))] = (
                f"{stat.S_IMODE(info.st_mode):o} " + hashlib.sha256(path.read_bytes()).hexdigest(),
                info.st_uid,
            )
    return digest


TARGETED = {
    "autograder/registry.py",
    "autograder/lesson00.py",
    "autograder/grade/batch.py",
    "kit/__init__.py",
}


def _being_edited() -> set[str]:
    """Files of autograder/ and kit/ that differ from the last commit: on a shared checkout, people
    may save them while the batch runs. A clean clone (CI) has none, and every file counts."""
    try:
        done = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all", "--", "autograder", "kit"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return set()
    return (
        {line[3:].strip() for line in done.stdout.splitlines()} if done.returncode == 0 else set()
    )


class _Listener:
    """A TCP port on the host's 127.0.0.1 that counts the connections it accepts."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.port = self.server.getsockname()[1]
        self.accepted: list[bytes] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.server.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(1.0)
                try:
                    self.accepted.append(conn.recv(100))
                except OSError:
                    self.accepted.append(b"")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.server.close()


def _cmdlines() -> dict[int, tuple[int, str]]:
    """{pid: (uid, command line)} of every live process on this machine (zombies left out)."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().decode(errors="replace").rsplit(")", 1)[1].split()[0]
            if state == "Z":
                continue
            cmd = (
                Path(f"/proc/{name}/cmdline")
                .read_bytes()
                .replace(b"\0", b" ")
                .decode(errors="replace")
            )
            found[int(name)] = (os.stat(f"/proc/{name}").st_uid, cmd)
        except (OSError, IndexError):
            continue
    return found


def _planted(token: str, site: Path) -> list[Path]:
    """Files an attack created, anywhere it aimed."""
    hits = [p for top in ("autograder", "kit") for p in (ROOT / top).rglob(f"*{token}*")]
    hits += list(ROOT.glob(f"*{token}*")) + list(site.glob(f"*{token}*"))
    return hits


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    if not (hasattr(os, "geteuid") and os.geteuid() == 0):
        pytest.skip("needs root, as CI and Gradescope grade")
    _need_namespaces()
    root = tmp_path_factory.mktemp("isolation")
    token = secrets.token_hex(6)
    site = Path(sysconfig.get_paths()["purelib"])
    listener = _Listener()
    targets = Targets(root=ROOT, site_packages=site, out=root / "out", submissions=root / "subs",
                      victim="victim", grader_pid=os.getpid(), port=listener.port, token=token)
    expected = write_corpus(targets)
    tree_before, editing = _tree_digest(), _being_edited()
    subs_before = {p.name: p.read_bytes() for p in targets.submissions.iterdir()}
    procs_before = set(_cmdlines())
    start = time.monotonic()
    try:
        records = grade_batch(
            discover([targets.submissions]),
            BatchConfig(targets.out, [0], workers=WORKERS, limits=LIMITS, seed=99),
        )
        seconds = time.monotonic() - start
        out_listing = sorted(str(p.relative_to(targets.out)) for p in targets.out.rglob("*"))
        time.sleep(0.5)  # a process killed with its namespace is gone within the kernel's teardown
        procs_after = _cmdlines()
    finally:
        listener.close()
        planted = _planted(token, site)
        for path in planted:  # never leave an attack's file behind, even when the test fails
            path.unlink(missing_ok=True)
    secret = json.loads((targets.out / ".kit-grade" / "secret.json").read_text())
    write_outputs(targets.out, discover([targets.submissions]), records, gradescope=False)
    return {
        "targets": targets,
        "expected": expected,
        "records": records,
        "secret": secret,
        "tree_before": tree_before,
        "tree_after": _tree_digest(),
        "editing": editing,
        "subs_before": subs_before,
        "listener": listener,
        "out_listing": out_listing,
        "procs_before": procs_before,
        "procs_after": procs_after,
        "planted": planted,
        "seconds": seconds,
    }


def _attack_lines(record: dict) -> str:
    return "\n".join(ln for ln in record["output"].splitlines() if "ATTACK" in ln)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*ATTACKS, *BYSTANDERS])
def test_every_submission_gets_the_points_its_honest_tasks_deserve(graded, name):
    record = graded["records"][name]
    assert record["score"] == pytest.approx(graded["expected"][name]), feedback_text(record)
    if name in ATTACKS:
        assert [t["status"] for t in record["tasks"]] == ["passed", "passed"], feedback_text(record)
        # The attack really ran in the worker (so its failure below is the sandbox's doing).
        assert f"ATTACK {name}:" in record["output"], record["output"][-3000:]


@pytest.mark.slow
def test_the_project_is_byte_identical_and_nothing_was_planted(graded):
    before, after = graded["tree_before"], graded["tree_after"]
    changed = {k for k in before if k not in graded["editing"] and before[k] != after.get(k)}
    # A file that appeared is the batch's doing if a non-root uid (a worker) owns it.
    changed |= {k for k in after.keys() - before.keys() if after[k][1] != 0}
    if graded["editing"]:
        # A shared working copy (people saving files while the batch runs): a changed file counts
        # when an attack aimed at it or it carries the run's token; the rest are people's edits.
        others = {k for k in changed if k not in TARGETED and not (
            (ROOT / k).is_file() and graded["targets"].token.encode() in (ROOT / k).read_bytes())}
        if others:
            warnings.warn(
                f"changed during grading in this shared checkout, by people: {sorted(others)}",
                stacklevel=1,
            )
        changed -= others
    assert not changed, f"changed during grading: {sorted(changed)}"
    assert not graded["planted"], f"attack files (now removed): {graded['planted']}"
    lines = _attack_lines(graded["records"]["writes_project"])
    assert "cannot create" in lines and "could " not in lines and "created" not in lines, lines


@pytest.mark.slow
def test_the_secret_stays_secret(graded):
    key = graded["secret"]["key"]
    for name, record in graded["records"].items():
        assert key not in json.dumps(record), name
    assert "ATTACK reads_secret: read" not in graded["records"]["reads_secret"]["output"]


@pytest.mark.slow
def test_the_output_folder_holds_only_what_the_grader_wrote(graded):
    targets, records = graded["targets"], graded["records"]
    students = set(graded["expected"])
    assert graded["out_listing"] == sorted([".kit-grade", ".kit-grade/secret.json", "records"]
                                           + [f"records/{s}.json" for s in students])
    signed = load_records(targets.out, graded["secret"]["key"])
    assert set(signed) == students and signed["victim"]["score"] == 5.0
    assert "writes_output" in records and records["writes_output"]["score"] == 5.0
    rows = {r["student"]: r for r in csv.DictReader((targets.out / "grades.csv").open())}
    assert set(rows) == students and float(rows["writes_output"]["score"]) == 5.0
    assert "ATTACK writes_output: wrote" not in records["writes_output"]["output"]
    assert "cannot write" in _attack_lines(records["writes_output"])


@pytest.mark.slow
def test_no_signal_reaches_the_grader_or_another_worker(graded):
    lines = _attack_lines(graded["records"]["signals"])
    assert "killed" not in lines.replace("cannot kill", ""), lines
    # It saw only its own PID namespace: neither the grader nor the other worker's processes.
    seen = json.loads(lines.split("visible pids ", 1)[1].splitlines()[0])
    assert max(seen, default=0) < 50 and os.getpid() not in seen, seen
    for name in BYSTANDERS:
        assert graded["records"][name]["score"] == BYSTANDERS[name]


@pytest.mark.slow
def test_the_host_loopback_port_never_sees_a_connection(graded):
    assert graded["listener"].accepted == []
    lines = _attack_lines(graded["records"]["connects"])
    assert "cannot connect to 127.0.0.1" in lines and "connected to" not in lines.replace(
        "cannot connect to", ""
    ), lines


@pytest.mark.slow
def test_no_submission_reads_another(graded):
    marker = f"VICTIM_{graded['targets'].token}"
    for name, record in graded["records"].items():
        if name != "victim":
            assert marker not in json.dumps(record), name
    assert "STOLE" not in graded["records"]["reads_others"]["output"]
    # and the submissions themselves are untouched
    subs = graded["targets"].submissions
    assert {p.name: p.read_bytes() for p in subs.iterdir()} == graded["subs_before"]


@pytest.mark.slow
def test_nothing_is_left_running(graded):
    token = graded["targets"].token
    sandbox_uids = {sandbox.sandbox_uid(slot) for slot in range(WORKERS)}
    left = {pid: v for pid, v in graded["procs_after"].items()
            if token in v[1] or v[0] in sandbox_uids
            or (pid not in graded["procs_before"] and "bwrap" in v[1])}
    assert not left, left
    assert "left a sleeper behind" in graded["records"]["lingers"]["output"]  # the attack did run


# --------------------------------------------------------------------------- the sandbox itself


def _sandboxed(work: Path, code: str, hide: tuple[Path, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``code`` with this interpreter in a worker's sandbox (slot 0) in the fresh folder
    ``work``."""
    work.mkdir()
    os.chmod(work, 0o711)
    uid = sandbox.sandbox_uid(0)
    os.chown(work, uid, uid)
    fd = sandbox.namespaces._offline_nsswitch()
    try:
        cmd = sandbox.namespaces._namespaced(
            work, uid, [sys.executable, "-I", "-c", code], hide, fd
        )
        return subprocess.run(
            cmd,
            pass_fds=(fd,),
            capture_output=True,
            text=True,
            timeout=300,
            env={
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "HOME": str(work),
                "TMPDIR": str(work),
                "GLOO_SOCKET_IFNAME": "lo",
            },
        )
    finally:
        os.close(fd)


ALL_REDUCE = """
import os, sys, socket
from kit.launcher import run_ranks
import torch, torch.distributed as dist

def rank_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item(), os.getuid()

print(list(run_ranks(rank_sum, world_size=4, timeout=120, echo=True)))
print("uid", os.getuid(), os.getgid(), os.getgroups())
print("interfaces", sorted(name for _, name in socket.if_nameindex()))
print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
"""


@pytest.mark.slow
def test_four_forked_ranks_all_reduce_inside_the_sandbox_on_its_own_loopback(tmp_path):
    if not (hasattr(os, "geteuid") and os.geteuid() == 0):
        pytest.skip("needs root")
    _need_namespaces()
    done = _sandboxed(tmp_path / "work", ALL_REDUCE)
    assert done.returncode == 0, done.stdout + done.stderr
    uid = sandbox.sandbox_uid(0)
    assert uid >= UID_BASE
    assert f"[(10.0, {uid}), (10.0, {uid}), (10.0, {uid}), (10.0, {uid})]" in done.stdout
    assert f"uid {uid} {uid} []" in done.stdout
    assert "interfaces ['lo']" in done.stdout
    pids = json.loads(done.stdout.split("pids ", 1)[1].splitlines()[0])
    assert max(pids) < 50, pids  # its own PID namespace: none of the host's processes
    assert "Warning" not in done.stdout + done.stderr and "[W" not in done.stdout + done.stderr, (
        done.stdout + done.stderr
    )


@pytest.mark.slow
def test_paths_to_hide_inside_the_project_are_empty_in_the_sandbox(tmp_path):
    if not (hasattr(os, "geteuid") and os.geteuid() == 0):
        pytest.skip("needs root")
    _need_namespaces()
    hidden = (
        ROOT / f".kit-isolation-test-{os.getpid()}"
    )  # an output folder someone put in the project
    (hidden / "records").mkdir(parents=True)
    (hidden / "records" / "alice.json").write_text("{}")
    (hidden / "bob.ipynb").write_text('{"BOB": 1}')
    try:
        code = (f"import os; print(sorted(os.listdir({str(hidden)!r})));"
                f"print(os.path.exists({str(ROOT / 'autograder' / 'registry.py')!r}))")
        done = _sandboxed(tmp_path / "a", code, hide=(hidden,))
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["[]", "True"]
        # A hidden file is covered by /dev/null on a nodev mount: it cannot even be opened.
        bob = _sandboxed(tmp_path / "b", f"print(open({str(hidden / 'bob.ipynb')!r}).read())",
                         hide=(hidden / "bob.ipynb",))
        assert "PermissionError" in bob.stderr and "BOB" not in bob.stdout + bob.stderr, (
            bob.stdout + bob.stderr
        )
    finally:
        for path in sorted(hidden.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        hidden.rmdir()


REACHES_REFERENCES = """
import importlib, os, pkgutil, sys
import autograder
refs = os.path.join(os.path.dirname(autograder.__file__), "references")
print("listing", sorted(os.listdir(refs)))
names = [m.name for m in pkgutil.iter_modules([refs])]
print("modules", names)
for lesson in range(20):
    try:
        importlib.import_module(f"autograder.references.lesson{lesson:02d}")
        print("IMPORTED", lesson)
    except ImportError:
        pass
from autograder.registry import lesson_tasks
tasks = [t for lesson in range(20) for t in lesson_tasks(lesson)]
print("tasks", len(tasks))
for t in tasks:  # every lesson's checks load in the worker without a reference
    for c in t.cases:
        for what in (t.reference, c.expect):
            if isinstance(what, str):
                try:
                    t.trusted(what)
                    print("REACHED", t.id, what)
                except (ImportError, AttributeError):
                    pass
print("loaded", sorted(m for m in sys.modules if m.startswith("autograder.references.")))
"""


@pytest.mark.slow
def test_a_submissions_worker_cannot_import_any_reference(tmp_path):
    # The batch worker runs only each case's untrusted half; the grader's answers
    # (autograder/references/) are covered in its namespace: not called, subclassed or copied.
    if not (hasattr(os, "geteuid") and os.geteuid() == 0):
        pytest.skip("needs root")
    _need_namespaces()
    references = ROOT / "autograder" / "references"
    assert sorted(p.name for p in references.glob("lesson*.py")), "no references to hide"
    done = _sandboxed(tmp_path / "work", REACHES_REFERENCES)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "listing []" in done.stdout and "modules []" in done.stdout, done.stdout
    assert "IMPORTED" not in done.stdout and "REACHED" not in done.stdout, done.stdout
    assert "loaded []" in done.stdout, done.stdout
    tasks = int(done.stdout.split("tasks ", 1)[1].split()[0])
    assert tasks >= 40, done.stdout  # the checks themselves loaded: only the answers are missing
    # and outside the sandbox the same names resolve (the test would pass vacuously otherwise)
    from autograder.registry import lesson_tasks

    named = [(t, w) for lesson in range(20) for t in lesson_tasks(lesson)
             for c in t.cases for w in (t.reference, c.expect) if isinstance(w, str)]
    assert named, "no task names a reference in autograder/references/"
    for t, what in named:
        assert callable(t.trusted(what)), (t.id, what)


# --------------------------------------------------------------------------- without namespaces


def test_without_namespaces_grading_says_what_is_missing_in_one_line(monkeypatch):
    for found, words in [
        (
            Isolation(
                False,
                True,
                "no namespaces: bubblewrap is not installed (apt-get install bubblewrap)",
            ),
            ["bubblewrap is not installed", "files, processes and network"],
        ),
        (
            Isolation(
                False,
                False,
                "not root: workers run as your user, with no namespaces and no uid of their own",
            ),
            ["not root", "read or write your files"],
        ),
    ]:
        monkeypatch.setattr(sandbox, "_ISOLATION", [found])
        note = isolation_note()
        assert note is not None and "\n" not in note and all(w in note for w in words), note
        assert (sandbox.sandbox_uid(1) is not None) == found.own_uid
    monkeypatch.setattr(sandbox, "_ISOLATION", [Isolation(True, True, None)])
    assert isolation_note() is None


def test_kit_doctor_reports_the_isolation_this_machine_gives(monkeypatch, capsys):
    from autograder.grade import doctor as grader_doctor
    from kit import doctor

    monkeypatch.setattr(
        sandbox,
        "_ISOLATION",
        [Isolation(False, True, "no namespaces: bubblewrap is not installed")],
    )
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    finding = grader_doctor.check_isolation()  # kit grade refuses here (tests/test_fail_closed.py)
    assert finding.status == doctor.FAIL and "bubblewrap is not installed" in finding.detail
    assert "apt-get install bubblewrap" in finding.fix and "make grade-setup" in finding.fix
    monkeypatch.setattr(sandbox, "_ISOLATION", [Isolation(True, True, None)])
    finding = grader_doctor.check_isolation()
    assert finding.status == doctor.OK and "namespaces" in finding.detail
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(sandbox, "_ISOLATION", [Isolation(False, False, "not root: ...")])
    assert grader_doctor.check_isolation().status == doctor.OK  # a student's laptop: nothing to fix
    monkeypatch.setattr(
        doctor,
        "check_launch",
        lambda n: doctor.Finding("launch + all_reduce", doctor.OK, "skipped"),
    )
    grader_doctor.main(["-n", "2"])
    assert "grading isolation" in capsys.readouterr().out  # `kit doctor` shows the row


def test_two_graders_on_one_machine_never_share_a_uid(tmp_path):
    """Every process of a worker's uid is killed after it: a second grader must take other uids."""
    code = ("from autograder.grade import sandbox; import sys; "
            "print(sandbox._uid(0), sandbox._uid(1)); sys.stdout.flush(); sys.stdin.read()")
    first = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        held = set(map(int, first.stdout.readline().split()))
        second = subprocess.run(
            [sys.executable, "-c", code], input="", capture_output=True, text=True, timeout=120
        )
        assert second.returncode == 0, second.stderr
        assert len(held) == 2 and not held & set(map(int, second.stdout.split()))
    finally:
        first.communicate(input="", timeout=60)


class _FakeCgroups:
    def __init__(self, pids: list[int] | None):
        self.controllers = {} if pids is None else {"pids": Path("/nonexistent")}
        self.pids = pids or []

    def members_of(self, controller):
        return list(self.pids)

    def members(self):
        return list(self.pids)


def test_the_process_count_reads_the_pids_cgroup_once_the_worker_is_in_it(monkeypatch):
    """The poll loop's count: /proc is scanned until the worker's pids cgroup holds it, then
    never."""
    scans = []
    monkeypatch.setattr(
        sandbox.processes, "_members", lambda pid, uid: scans.append(pid) or [pid, 7, 8, 9]
    )
    waiting = _FakeCgroups([])  # the worker has not joined yet (or joining failed)
    counter = sandbox.processes._ProcessCounter(100, 61000, waiting)
    assert counter.count() == 4 and len(scans) == 1
    waiting.pids = [100, 101]  # joined: the cgroup's list is the count from now on
    assert [counter.count(), counter.count()] == [2, 2] and len(scans) == 1
    waiting.pids = [101]  # still trusted once joined: a worker that exited leaves its ranks counted
    assert counter.count() == 1 and len(scans) == 1
    no_cgroup = sandbox.processes._ProcessCounter(100, 61000, _FakeCgroups(None))
    assert [no_cgroup.count(), no_cgroup.count()] == [4, 4] and len(scans) == 3


def test_a_workers_pids_cgroup_counts_what_a_scan_of_proc_counts(tmp_path):
    """As root with cgroup v1's pids controller: the cgroup holds every process a worker forks."""
    cgroups = sandbox.processes._Cgroups(
        f"kit-grade-{os.getpid()}-test-{secrets.token_hex(3)}", Limits()
    )
    if "pids" not in cgroups.controllers:
        cgroups.remove()
        pytest.skip("no pids cgroup can be made here (needs root and cgroup v1's pids controller)")
    code = ("import os, sys, time\n"
            "for _ in range(5):\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(60); os._exit(0)\n"
            "print('ready', flush=True); time.sleep(60)\n")
    # Joins the cgroup before it runs any Python, as the sandbox's shell does before bwrap.
    proc = subprocess.Popen(
        [
            "/bin/sh",
            "-c",
            'echo $$ > "$1"; exec "$2" -c "$3"',
            "sh",
            str(cgroups.controllers["pids"] / "cgroup.procs"),
            sys.executable,
            code,
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        counter = sandbox.processes._ProcessCounter(proc.pid, None, cgroups)
        assert counter.count() == len(sandbox.processes._members(proc.pid, None)) == 6
        assert counter.joined
    finally:
        sandbox.processes._kill_all(proc.pid, None, cgroups)
        proc.wait()
        cgroups.remove()
    assert not any(p.exists() for p in cgroups.paths)


HUGE_PAGES = """
import os, sys
from autograder.grade.sandbox.worker import _collapse_anonymous_memory

def huge_kb():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))

data = bytearray(os.urandom(1 << 20) * 48)  # 48 MiB on the heap, every page written
digest = hash(bytes(data))
before = huge_kb()
collapsed = _collapse_anonymous_memory()
assert isinstance(collapsed, int) and collapsed >= 0, collapsed
assert collapsed == 0 or huge_kb() > before, (collapsed, before, huge_kb())
pid = os.fork()
if pid == 0:  # a rank: sees the same bytes, writes its own copy
    ok = hash(bytes(data)) == digest
    data[12345] ^= 0xFF
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
assert hash(bytes(data)) == digest  # the child's write stayed in the child
print("collapsed", collapsed)
"""


def test_huge_pages_for_the_worker_keep_its_memory_and_its_forks_intact():
    # Where the kernel has no MADV_COLLAPSE (before Linux 6.1, THP "never") it collapses nothing
    # and says 0; where it collapsed something, the process now holds huge pages.
    done = subprocess.run([sys.executable, "-c", HUGE_PAGES], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "collapsed " in done.stdout
