"""The course's helper package: start ranks from a notebook, trace them, check tasks.

``from kit import launch, check`` is all a lesson needs; ``%load_ext kit`` adds the
``%%distributed`` cell magic.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

__all__ = ["launch", "check", "progress", "LaunchError", "LaunchTimeout", "LaunchResult", "load_ipython_extension"]


def __getattr__(name: str) -> Any:
    # Lazy: `import kit` stays cheap (the CLI and spawned ranks import it).
    if name in {"launch", "LaunchError", "LaunchTimeout", "LaunchResult", "RankFailure"}:
        from kit import launcher

        return getattr(launcher, name)
    if name == "check":
        from autograder.checking import check

        return check
    if name == "progress":  # where the learner stands in every lesson (``kit progress``)
        from autograder.progress import progress

        return progress
    raise AttributeError(f"module 'kit' has no attribute {name!r}")


# The lesson helpers moved into ``kit.lessons``; a notebook released before the move imports
# them by their old names (``from kit.models import TinyTransformer``), so those still resolve
# to the same module objects.
_MOVED = frozenset({"costmodel", "data", "debugging", "models", "molecules", "parallelism",
                    "precision", "proteins", "resume", "sharding", "widgets"})


class _MovedHelpers(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        head, _, name = fullname.partition(".")
        if head == "kit" and name in _MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(f"kit.lessons.{spec.name.split('.', 1)[1]}")
        spec.loader_state = module.__spec__  # importlib replaces it with this alias's spec
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = module.__spec__.loader_state  # it already ran, under its new name


if not any(isinstance(f, _MovedHelpers) for f in sys.meta_path):
    sys.meta_path.append(_MovedHelpers())


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext kit``: registers ``%%distributed``."""
    from kit.magic import DistributedMagics

    ipython.register_magics(DistributedMagics)
