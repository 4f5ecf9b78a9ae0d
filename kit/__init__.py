"""The course's helper package: start ranks from a notebook, trace them, check tasks.

``from kit import launch, check`` is all a lesson needs; ``%load_ext kit`` adds the
``%%distributed`` cell magic and ``%distributed start`` (persistent ranks, ``kit.Ranks``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["launch", "check", "progress", "LaunchError", "LaunchTimeout", "LaunchResult",
           "Ranks", "load_ipython_extension"]


def __getattr__(name: str) -> Any:
    # Lazy: `import kit` stays cheap (the CLI and spawned ranks import it).
    if name in {"launch", "LaunchError", "LaunchTimeout", "LaunchResult", "RankFailure"}:
        from kit import launcher

        return getattr(launcher, name)
    if name == "Ranks":  # persistent ranks (``%distributed start``)
        from kit.ranks import Ranks

        return Ranks
    if name == "check":
        from autograder.checking import check

        return check
    if name == "progress":  # where the learner stands in every lesson (``kit progress``)
        from autograder.progress import progress

        return progress
    raise AttributeError(f"module 'kit' has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext kit``: registers ``%%distributed`` and ``%distributed``."""
    from kit.magic import DistributedMagics

    ipython.register_magics(DistributedMagics)
