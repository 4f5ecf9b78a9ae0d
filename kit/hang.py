"""Explain a hang in plain words from each rank's Python stack.

When a launch times out, :mod:`kit.launcher` asks every live rank to dump its stack
(``faulthandler`` on ``SIGUSR1``: it works even while the rank is blocked inside C++), then
this module finds, per rank, the collective it is waiting in and the user line that called it,
and says what the pattern across ranks usually means. Lessons 00 and 02 use it.
"""

from __future__ import annotations

import linecache
import os
import re
import sysconfig
from dataclasses import dataclass, field

import torch

from kit.recorder import PUBLIC_OPS

# The torch.distributed entry points a rank can block in, by the name of their Python frame:
# every operation the recorder knows (one list, kit.recorder), and the group set-up calls.
COLLECTIVES = PUBLIC_OPS | {"init_process_group", "new_group", "new_subgroups",
                            "_store_based_barrier"}

_THREAD_RE = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_FRAME_RE = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_KIT_DIR = os.path.dirname(__file__) + os.sep
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep


@dataclass
class Frame:
    file: str
    line: int
    func: str

    @property
    def source(self) -> str:
        return linecache.getline(self.file, self.line).strip()

    def where(self) -> str:
        name = os.path.basename(self.file) if not self.file.startswith("<") else self.file
        text = self.source
        return f"{self.func}() at {name}:{self.line}" + (f": `{text}`" if text else "")


@dataclass
class RankStack:
    """One rank's main-thread stack, innermost frame first."""

    rank: int
    frames: list[Frame] = field(default_factory=list)
    raw: str = ""

    @property
    def collective(self) -> str | None:
        for f in self.frames:
            if f.file.startswith(_TORCH_DIR) and "distributed" in f.file and f.func in COLLECTIVES:
                return f.func.lstrip("_")
        return None

    @property
    def user_frame(self) -> Frame | None:
        for f in self.frames:
            if not f.file.startswith((_TORCH_DIR, _KIT_DIR, _STDLIB_DIR)):
                return f
        return None

    def shown_frames(self) -> list[Frame]:
        """User frames plus the collective's own frame: torch's wrappers say nothing useful."""
        shown, seen_collective = [], False
        for f in self.frames:
            if f.file.startswith(_TORCH_DIR):
                if not seen_collective and f.func in COLLECTIVES:
                    shown.append(f)
                    seen_collective = True
                continue
            shown.append(f)
        return shown

    def describe(self) -> str:
        where = self.user_frame
        at = f" (called from {where.where()})" if where else ""
        if self.collective:
            return f"waiting in {self.collective}{at}"
        if where is not None:
            return f"not in any collective: running {where.where()}"
        return "not in any collective"


def parse_dump(rank: int, text: str) -> RankStack:
    """Parse a ``faulthandler`` all-threads dump, keeping the thread that runs the rank."""
    threads: list[list[Frame]] = []
    for line in text.splitlines():
        if _THREAD_RE.match(line):
            threads.append([])
        elif (m := _FRAME_RE.match(line)) and threads:
            threads[-1].append(Frame(m["file"], int(m["line"]), m["func"]))
    main = next((t for t in threads if any(f.func == "rank_main" for f in t)), None)
    if main is None:
        main = threads[0] if threads else []
    # Drop the launcher's own frames below the user's function.
    for i, f in enumerate(main):
        if f.func == "rank_main" and f.file.startswith(_KIT_DIR):
            main = main[:i]
            break
    return RankStack(rank, main, text)


def name_ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))


def diagnose(stacks: dict[int, RankStack], returned: list[int], world_size: int) -> str:
    """A plain-words reading of the stacks: who waits where, who is missing, what to check."""
    waiting = {r: s.collective for r, s in stacks.items() if s.collective}
    busy = [r for r, s in stacks.items() if not s.collective]
    silent = [r for r in range(world_size) if r not in stacks and r not in returned]
    ops = sorted(set(waiting.values()))
    if len(ops) > 1:
        listing = "; ".join(f"{name_ranks([r])} in {op}" for r, op in sorted(waiting.items()))
        return (f"The ranks are waiting in different collectives ({listing}). Every rank of a "
                "group must call the same collectives in the same order; look for a collective "
                "inside an `if rank == ...` branch.")
    if waiting and (returned or busy):
        missing = []
        if returned:
            missing.append(f"{name_ranks(returned)} already returned from the function")
        if busy:
            missing.append(f"{name_ranks(busy)} never reached it (still running other code)")
        return (f"{name_ranks(list(waiting))} {'is' if len(waiting) == 1 else 'are'} waiting in "
                f"{ops[0]}, but {' and '.join(missing)}. A collective completes only when every "
                "rank of the group calls it: one rank skipped it, or called it fewer times "
                "(a branch on rank, or a loop with a different length per rank).")
    if waiting:
        return (f"Every rank is in {ops[0]}, yet it did not finish: the ranks probably disagree on "
                "its arguments (tensor shape or dtype, src/dst, group), or called it a different "
                "number of times before. TORCH_DISTRIBUTED_DEBUG=DETAIL checks shapes and order.")
    if silent:
        return (f"{name_ranks(silent)} did not report a stack. If the ranks are only slow, pass a "
                "larger timeout=.")
    return ("No rank is inside a collective: the code is slow or loops forever. If it is only "
            "slow, pass a larger timeout= to kit.launch (or --timeout to %%distributed).")
