"""``python -m autograder.grade.sandbox JOB``: the worker (see :mod:`.worker`)."""

from autograder.grade.sandbox.worker import main

if __name__ == "__main__":
    main()
