"""What went wrong in a launch, told for a student: failed ranks, consequences, hangs.

:mod:`kit.launcher` collects the facts (who raised, who was killed, each rank's stack at a
timeout); this module turns them into one readable error. Every lesson's launches use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kit import hang


@dataclass
class RankFailure:
    """Why one rank did not return."""

    rank: int
    summary: str  # one line, e.g. "raised ValueError: bad shard"
    details: str = ""  # traceback, or the last lines the rank printed to stderr
    after_s: float = 0.0  # seconds after the launch started
    exception_type: str | None = None
    exitcode: int | None = None
    consequence: bool = False  # only reports that a failed peer vanished


class LaunchError(RuntimeError):
    """One or more ranks failed. ``failures`` lists them, first failure first."""

    def __init__(self, message: str, failures: list[RankFailure], outputs: list[str]):
        super().__init__(message)
        self.failures = failures
        self.outputs = outputs

    @property
    def failed_ranks(self) -> list[int]:
        return [f.rank for f in self.failures]

    def _render_traceback_(self) -> list[str]:  # IPython shows this instead of launcher internals
        return [f"{type(self).__name__}: {self}"]


class LaunchTimeout(LaunchError, TimeoutError):
    """The ranks did not finish in time. ``stacks`` maps rank to its Python stack text."""

    def __init__(self, message: str, stacks: dict[int, str], outputs: list[str]):
        super().__init__(message, [], outputs)
        self.stacks = stacks


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "Socket closed", "Connection refused")


def _is_consequence(f: RankFailure, first: RankFailure) -> bool:
    """A peer's failure that only reports another one (gloo noticing a vanished peer)."""
    return f is not first and f.exception_type is not None and any(
        m in f.summary for m in _PEER_GONE)


def _first_line(text: str, limit: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def failure_message(failures: list[RankFailure], world_size: int, returned: list[int],
                    stopped: list[int]) -> str:
    """The error text for failed ranks (``failures`` in the order they happened)."""
    # The first failure that is not just "my peer vanished" is the root cause.
    first = next((f for f in failures if not any(m in f.summary for m in _PEER_GONE)), failures[0])
    for f in failures:
        f.consequence = _is_consequence(f, first)
    causes = [f for f in failures if not f.consequence]
    echoes = [f for f in failures if f.consequence]
    head = ", ".join(f"rank {f.rank}" for f in causes)
    if len(causes) == 1:
        lines = [f"rank {first.rank} of {world_size} failed, {first.after_s:.2f} s after launch."]
    else:
        lines = [f"{head} failed ({len(causes)} of {world_size} ranks); rank {first.rank} failed "
                 f"first, {first.after_s:.2f} s after launch."]
    for f in causes:
        lines += ["", f"rank {f.rank} {f.summary}"]
        if f.details:
            lines.append(_indent(f.details.rstrip()))
    if echoes:
        lines += ["", f"{hang.name_ranks([f.rank for f in echoes])} then failed because a peer was "
                  f"gone (a consequence, not a cause): {_first_line(echoes[0].summary)}"]
    if returned:
        lines += ["", f"{hang.name_ranks(returned)} had returned normally."]
    if stopped:
        lines += ["",
                  f"{hang.name_ranks(stopped)} {'was' if len(stopped) == 1 else 'were'} stopped "
                  "by the launcher."]
    return "\n".join(lines).rstrip()


def clean_fatal_error(text: str) -> str:
    """Trim a faulthandler crash report to the rank's own frames (a forked rank's stack also
    shows the kernel frames it was forked from, below ``rank_main``)."""
    kept, skipping = [], False
    for line in text.splitlines():
        if line.startswith("Extension modules:"):
            continue
        if skipping and line.strip().startswith("File "):
            continue
        skipping = False
        kept.append(line)
        if "in rank_main" in line:
            kept.pop()
            skipping = True
    return "\n".join(kept).strip()


def timeout_message(stacks: dict[int, hang.RankStack], returned: dict[int, float], timeout: float,
                    world_size: int, deadlock: float | None = None) -> str:
    """The error text for a hang; ``returned`` maps ranks that returned to their run time.

    ``deadlock``: the seconds after which the launcher saw a certain deadlock (a rank returned
    while every other one sat in a collective), when it stopped before the timeout."""
    first = (f"Deadlock after {deadlock:.1f} s: a rank returned while the others wait in a "
             "collective it will never call." if deadlock is not None
             else f"Timed out after {timeout:g} s: the ranks did not finish.")
    lines = [first,
             hang.diagnose(stacks, list(returned), world_size), ""]
    for rank in range(world_size):
        if rank in returned:
            lines.append(f"  rank {rank}: returned from the function after {returned[rank]:.2f} s")
        elif rank in stacks:
            lines.append(f"  rank {rank}: {stacks[rank].describe()}")
        else:
            lines.append(f"  rank {rank}: no stack (it did not answer)")
    for rank, st in sorted(stacks.items()):
        lines += ["", f"rank {rank} stack (most recent call last):"]
        for f in reversed(st.shown_frames()):
            lines.append(f'  File "{f.file}", line {f.line}, in {f.func}')
            if f.source:
                lines.append(f"    {f.source}")
    return "\n".join(lines)


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())
