"""Seeded bugs: the typical wrong implementations every task's checks must catch.

``tests/bugs/lessonNN.py`` defines ``BUGS = {"N.M": [("what the bug does", buggy_impl), ...]}``
where ``buggy_impl`` is the same kind of object a student writes (a function or a class).
``tests/test_checks.py`` fails when a registered task has no entry here or a bug passes.
"""
