"""The worker: load the notebooks, run each case's untrusted half, save the plain data.

Started by :func:`autograder.grade.sandbox.run_worker` as ``python -m autograder.grade.sandbox
JOB``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any

from autograder.grade.sandbox import CONTROL_FD_ENV


def _limit_self(limits: dict[str, Any], cases: int) -> None:
    cpu = int(60 + limits["case_wall_s"] * cases)
    for which, value in [(resource.RLIMIT_AS, limits["memory"]), (resource.RLIMIT_CPU, cpu),
                         (resource.RLIMIT_FSIZE, limits["file_size"]), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_NPROC, limits["threads"])]:
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):
            pass
    # Past RLIMIT_FSIZE a write then fails with OSError (EFBIG), reported as the case's error,
    # instead of SIGXFSZ killing the worker.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _exhausted(e: BaseException) -> bool:
    """Out of memory or of processes: running the task's next case would only exhaust them again."""
    text = str(e)
    return isinstance(e, (MemoryError, BlockingIOError)) or "can't allocate memory" in text \
        or "Cannot allocate memory" in text or "Resource temporarily unavailable" in text


class _NoReferences:
    """A finder that refuses ``autograder.references`` (the grader's answers) in the worker."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname == "autograder.references" or fullname.startswith("autograder.references."):
            raise ModuleNotFoundError(f"{fullname} is not available to a submission", name=fullname)
        return None


_MADV_COLLAPSE = 25  # <linux/mman.h>, since Linux 6.1
_HUGE = 2 << 20


def _collapse_anonymous_memory() -> int:
    """Back this process's private anonymous memory (the malloc heap, Python's arenas, torch's
    blocks) with 2 MiB pages where the kernel can, with ``madvise(MADV_COLLAPSE)``; return the
    bytes of the ranges collapsed whole (0 where the kernel has no MADV_COLLAPSE: before 6.1).
    MADV_COLLAPSE leaves areas marked no-huge-pages alone (thread stacks since Linux 6.7).

    Every rank is forked from this worker. fork copies a page-table entry for each 4 KiB page the
    worker holds, and the rank's exit drops them again; a 2 MiB page takes one entry. With every
    lesson loaded (about 300 MB), a bare fork and exit went from 26 to 11 CPU-ms on 2 cores, and
    a 4-rank launch's ranks from 32 to 25 CPU-ms each. A full sandboxed submission, 10 alternating
    pairs, took 1.4 CPU-s less on average (about 4%). The first call copies ~250 MB into huge
    pages (0.6 CPU-s); later calls only collapse what grew or was split since.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        with open("/proc/self/maps") as f:
            maps = f.read().splitlines()
    except (OSError, AttributeError):
        return 0
    collapsed = 0
    for line in maps:
        fields = line.split()
        if len(fields) > 5 and fields[5] != "[heap]":
            continue  # a file, [stack], [vdso]: not the process's private heap
        if not fields[1].startswith("rw") or fields[1][3] != "p":
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        start, end = (lo + _HUGE - 1) & ~(_HUGE - 1), hi & ~(_HUGE - 1)
        if end - start < _HUGE:
            continue
        if madvise(start, end - start, _MADV_COLLAPSE) == 0:
            collapsed += end - start
    return collapsed


def _worker(job_path: str) -> int:
    os.dup2(1, 2)  # one stream: the parent caps its size
    job = json.loads(Path(job_path).read_text())
    limits = json.loads(os.environ["KIT_SANDBOX_LIMITS"])
    _limit_self(limits, len(job["cases"]))
    control = os.fdopen(int(os.environ.pop(CONTROL_FD_ENV)), "w", buffering=1)
    out = Path(job_path).parent / "results"
    out.mkdir(exist_ok=True)

    # With namespaces, autograder/references/ is an empty folder here. Without them (a grader
    # without bubblewrap: kit doctor says so), at least no import of it succeeds in this process.
    sys.meta_path.insert(0, _NoReferences())

    import torch

    from autograder import gates
    from autograder.registry import get_task
    from autograder.results import FORBIDDEN, NOT_IMPLEMENTED, raised

    def save(key: str, record: dict[str, Any]) -> None:
        tmp = out / f".{key}.tmp"
        try:
            torch.save(record, tmp)
        except Exception as e:  # the data holds something torch cannot serialise
            torch.save({"status": "error", "message": "the result could not be sent back as plain "
                        f"data ({type(e).__name__}: {e})"}, tmp)
        os.replace(tmp, out / f"{key}.pt")

    from autograder.loading import load_tasks

    gates.trust_answer_fingerprints(job.get("reference_prints", {}),
                                    job.get("reference_shapes", {}))
    worker = os.getpid()
    modules: dict[int, Any] = {}

    def load(lesson: int, notebook: str) -> Any:
        control.write(f"load {lesson}\n")
        try:
            module = load_tasks(notebook, lesson=lesson)
            report = module.__load_report__
            info = {"missing": report.missing, "notes": report.notes}
        except BaseException as e:  # noqa: BLE001 - a submission may raise SystemExit at import
            if os.getpid() != worker:
                os._exit(1)
            module, info = None, {"error": f"{type(e).__name__}: {e}"}
        (Path(job_path).parent / f"load-{lesson}.json").write_text(json.dumps(info))
        # What exists now (torch, the libraries, the notebooks loaded so far) lives as long as
        # this worker: move it out of the collector's reach. A full collection walked all of it
        # (0.3 s with the fourteen lessons loaded), in this worker and in every rank forked from
        # it, writing to each object and so copying its page in a rank; frozen, the objects are
        # skipped (gc.freeze, as the gc docs advise before fork()). A sandboxed full submission
        # took 15% less CPU, 4 runs each on 2 cores. The young generations go first, so little
        # garbage is frozen with the rest; what is frozen is freed when the worker exits.
        gc.collect(1)
        gc.freeze()
        _collapse_anonymous_memory()  # cheaper forks for this lesson's ranks: see there
        return module

    # Each lesson is loaded just before its own cases run, not all of them first: a lesson's
    # imports (RDKit and PyG in Lesson 10) then do not grow the process that every earlier
    # lesson's ranks are forked from (fork copies the page tables: 12 ms per fork from torch
    # alone, 32 ms with all fourteen lessons loaded, on 2 cores), and no notebook's import-time
    # side effects reach an earlier lesson's cases.
    notebooks = {lesson: notebook for lesson, notebook in job["notebooks"]}
    skip: dict[str, dict[str, Any]] = {}  # task id -> the record its remaining cases get
    # A task's cases share its trampolines (gates.watching); they come off before the next task's
    # cases, and before a notebook is loaded, as check() does.
    watched, watch = None, contextlib.ExitStack()
    # limits["rank_pool"]: a lesson's shared launches run on ranks forked once (autograder/pool.py)
    pooled, pool = None, contextlib.ExitStack()
    for task_id, index, key in job["cases"]:
        if task_id != watched:
            watch.close()
            watched = None
        task = get_task(task_id)
        case = task.cases[index]
        if task.lesson not in modules and task.lesson in notebooks:
            modules[task.lesson] = load(task.lesson, notebooks[task.lesson])
        module = modules.get(task.lesson)
        if module is None:
            continue
        if limits.get("rank_pool") and pooled != task.lesson:
            from autograder.pool import rank_pool
            from autograder.registry import lesson_tasks

            pool.close()
            pool.enter_context(rank_pool(lesson_tasks(task.lesson)))
            pooled = task.lesson
        if task_id in skip:  # a stub only raises again; a memory or fork bomb only explodes again
            save(key, skip[task_id])
            continue
        control.write(f"case {key}\n")
        impl = getattr(module, task.name, None)
        if watched is None:
            watch.enter_context(gates.watching())
            watched = task_id

        start = time.perf_counter()
        try:
            with gates.guard(task, impl):  # what the task re-implements scores it 0, as in check()
                record = {"status": "ok", "data": case.run(impl, job["seed"])}
        except BaseException as e:  # noqa: BLE001 - SystemExit too: it ends this case only
            # The same result model as check(): only its plain fields travel back.
            result = raised(task, case, e, time.perf_counter() - start)
            record = {"status": result.status, "message": result.message,
                      "details": result.details[-4000:]}
            if result.status in (NOT_IMPLEMENTED, FORBIDDEN):  # running it again changes nothing
                skip[task_id] = record
            elif _exhausted(e):
                skip[task_id] = {"status": "error", "message": "not run: an earlier case of this "
                                 f"task ran out of resources ({result.message[:300]})"}
        if os.getpid() != worker:  # a child the submission forked got back here: it must not report
            os._exit(1)
        record["seconds"] = time.perf_counter() - start
        save(key, record)
    watch.close()
    pool.close()
    control.write("done\n")
    control.flush()
    sys.stdout.flush()
    return 0



def main() -> None:
    """The worker's entry: ``JOB`` is ``sys.argv[1]``."""
    code = _worker(sys.argv[1])
    # Every result is on disk (each written whole with os.replace) and every stream flushed: skip
    # the interpreter's teardown (torch's, the libraries' and the submission's atexit work, and
    # threads it left behind), which took about 2 s of every submission's time.
    os._exit(code)
