"""Rank output, labelled: ``[rank 2] loss 0.31``, live, in a notebook cell or a terminal.

Each rank's stdout and stderr arrive on pipes (see ``kit/_rank.py``). In Jupyter everything is
written to the cell as stdout, because nbgrader scores a test cell 0 as soon as it sees a stderr
stream; in a terminal a rank's stderr stays stderr. Used by :func:`kit.launch` and ``kit run``.
"""

from __future__ import annotations

import codecs
import sys
from typing import TextIO


def in_jupyter_kernel() -> bool:
    """True when running inside an IPython kernel (its stdout goes to a notebook cell)."""
    stream = sys.stdout
    return type(stream).__module__.startswith("ipykernel")


class RankOutput:
    """Splits each rank's byte stream into labelled lines and keeps a per-rank transcript."""

    def __init__(self, world_size: int, *, echo: bool = True, stdout: TextIO | None = None,
                 stderr: TextIO | None = None):
        self.width = len(str(world_size - 1))
        self.echo = echo
        self.stdout = stdout or sys.stdout
        jupyter = in_jupyter_kernel() if stderr is None else False
        self.stderr = self.stdout if jupyter else (stderr or sys.stderr)
        self._decoders = {}
        self._partial: dict[tuple[int, str], str] = {}
        self.transcripts: list[list[str]] = [[] for _ in range(world_size)]
        self.stderr_tails: list[list[str]] = [[] for _ in range(world_size)]

    def label(self, rank: int) -> str:
        return f"[rank {rank:>{self.width}}] "

    def feed(self, rank: int, stream: str, data: bytes) -> None:
        key = (rank, stream)
        if key not in self._decoders:
            self._decoders[key] = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text = self._partial.pop(key, "") + self._decoders[key].decode(data)
        *lines, rest = text.split("\n")
        if rest:
            self._partial[key] = rest
        self._emit(rank, stream, lines)

    def flush(self) -> None:
        """Emit partial lines (a rank that printed without a final newline)."""
        for (rank, stream), rest in sorted(self._partial.items()):
            self._emit(rank, stream, [rest])
        self._partial.clear()

    def _emit(self, rank: int, stream: str, lines: list[str]) -> None:
        if not lines:
            return
        self.transcripts[rank].extend(lines)
        if stream == "err":
            tail = self.stderr_tails[rank]
            tail.extend(lines)
            del tail[:-40]
        if self.echo:
            target = self.stderr if stream == "err" else self.stdout
            label = self.label(rank)
            target.write("".join(f"{label}{line.rstrip(chr(13))}\n" for line in lines))
            target.flush()

    def text(self, rank: int) -> str:
        return "\n".join(self.transcripts[rank]) + ("\n" if self.transcripts[rank] else "")


class Progress:
    """A progress line: redrawn in place on a terminal, one line per step in a log (CI).

    ``kit run`` counts cells with it and ``kit grade --out`` counts submissions.
    """

    def __init__(self, total: int, stream: TextIO | None = None, *, width: int = 30):
        self.total, self.width = total, width
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.done = 0

    def update(self, text: str, *, done: int | None = None) -> None:
        """One more step done (or ``done`` steps in all), described by ``text``."""
        self.done = self.done + 1 if done is None else done
        if self.tty:
            filled = self.width * self.done // max(self.total, 1)
            bar = f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {text}"
            self.stream.write("\r" + bar[:120].ljust(120))
        else:
            self.stream.write(f"[{self.done:>3}/{self.total}] {text}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

