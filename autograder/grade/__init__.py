"""Batch grading: find submissions, run each in a sandbox, judge and sign its results, write
reports.

``kit grade NOTEBOOK`` (one notebook, in this process) is :mod:`autograder.grade.notebook`;
``kit grade PATH... --out DIR`` is :mod:`autograder.grade.batch` with the worker of
:mod:`autograder.grade.sandbox`, the discovery of :mod:`autograder.grade.submissions` and the
files of :mod:`autograder.grade.reports`.
"""
