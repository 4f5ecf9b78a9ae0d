"""The grader's own answers: each lesson's references and trusted ``expect`` code.

Only the trusted side imports this package (``Task.trusted`` resolves a task's ``reference`` or
a case's ``expect`` given by name here). The batch grader's sandboxed worker runs only each
case's untrusted ``run``, and this folder is hidden from it, so a submission cannot call,
subclass or copy a reference there. In a notebook, ``check()`` runs both halves in one process;
the gates (``autograder.gates``) catch a task that uses these there.
"""
