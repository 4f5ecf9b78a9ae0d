"""Moved: building lessons and nbgrader courses is :mod:`autograder.build` now.

A course folder written by an earlier ``kit course`` has an ``nbgrader_config.py`` that imports
``kit.build``; this module tells the instructor how to refresh it instead of failing obscurely.
"""

raise ImportError(
    "kit.build moved to autograder.build. If this comes from an nbgrader_config.py written by an "
    "earlier `kit course`, re-run `kit course DIR` on that folder (it rewrites nbgrader_config.py "
    "and keeps source/ and submitted/), or change its import to "
    "`from autograder.build import CODE_STUB, release_preprocessors`."
)
