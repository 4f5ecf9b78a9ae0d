"""Copies with the names changed: a fingerprint of a function's source that renaming,
reordering statements and reformatting all keep.

The code-identity gate (:mod:`autograder.gates`) recognises a reference or a library function
by its bytecode, which changes as soon as a global is renamed or two lines swap. This module
reads the source instead. A function becomes a multiset of *statements*: every simple statement
(and the header of every ``if``/``for``/``while``/``with``/``try``), each normalised on its own:

* every name (variables, arguments, globals, the function's own name) becomes a placeholder
  numbered in its order of appearance inside that statement, so renaming changes nothing;
* every constant becomes its type (``<int>``, ``<str>``...), so ``1e-9`` for ``1e-8`` does not
  hide a copy;
* docstrings and bare strings are dropped; formatting, comments and line numbers never reach the
  AST;
* attribute names (``.sum``, ``.masked_fill``) and operators are kept: they are what the code
  does.

Each statement is hashed with its size (its count of AST nodes). A reference's statements,
matched one for one in a student's function (a multiset intersection, so reordering changes
nothing), weigh ``matched / total`` of the reference: a function holding at least
:data:`THRESHOLD` of a reference of at least :data:`MIN_WEIGHT` nodes is a copy of it. Small
statements (fewer than :data:`MIN_STATEMENT` nodes: ``return x``, ``i += 1``) count for
neither side: every function has them.

Only hashes travel: :func:`shape` is computed where the reference is (the trusted process), and
the sandboxed worker, which never sees ``autograder/references/``, compares against hashes.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
from collections import Counter
from collections.abc import Iterable
from typing import Any

__all__ = ["MIN_WEIGHT", "THRESHOLD", "Shape", "likeness", "shape", "shape_of_source"]

THRESHOLD = 0.85  # the share of a reference's statements (by size) a copy holds
MIN_WEIGHT = 40  # a reference smaller than this (AST nodes) is too generic to call a copy of
MIN_STATEMENT = 6  # statements smaller than this are shared by all code: ignored

Shape = dict[str, int]  # statement hash -> its weight summed over its occurrences


class _Normaliser(ast.NodeVisitor):
    """One statement as a token string: node types, attribute names and operators kept, names
    numbered by first appearance, constants reduced to their type."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.names: dict[str, int] = {}
        self.size = 0

    def _name(self, name: str) -> str:
        return f"v{self.names.setdefault(name, len(self.names))}"

    def generic_visit(self, node: ast.AST) -> None:
        self.size += 1
        self.tokens.append(type(node).__name__)
        for field, value in ast.iter_fields(node):
            if field in ("ctx", "type_comment", "kind"):
                continue
            if isinstance(node, (ast.Name,)) and field == "id":
                self.tokens.append(self._name(value))
            elif isinstance(node, ast.arg) and field == "arg":
                self.tokens.append(self._name(value))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                    and field == "name":
                self.tokens.append(self._name(value))
            elif isinstance(node, ast.keyword) and field == "arg":
                self.tokens.append(f"kw:{value}")  # a keyword argument names the callee's API
            elif isinstance(node, ast.Attribute) and field == "attr":
                self.tokens.append(f".{value}")
            elif isinstance(node, ast.Constant) and field == "value":
                self.tokens.append(f"<{type(value).__name__}>")
            elif isinstance(node, (ast.Global, ast.Nonlocal)) and field == "names":
                self.tokens += [self._name(n) for n in value]
            elif isinstance(node, ast.alias):
                self.tokens.append(str(value))
            elif isinstance(value, list):
                self.tokens.append("[")
                for item in value:
                    if isinstance(item, ast.AST):
                        self.visit(item)
                    else:
                        self.tokens.append(repr(item))
                self.tokens.append("]")
            elif isinstance(value, ast.AST):
                self.visit(value)
            elif value is not None:
                self.tokens.append(repr(value))


_COMPOUND_HEADERS = {ast.If: ("test",), ast.While: ("test",), ast.For: ("target", "iter"),
                     ast.AsyncFor: ("target", "iter"), ast.With: ("items",),
                     ast.AsyncWith: ("items",), ast.Try: (), ast.FunctionDef: ("args",),
                     ast.AsyncFunctionDef: ("args",), ast.ClassDef: ("bases",)}


def _is_bare_string(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str))


def _units(body: Iterable[ast.stmt]) -> Iterable[tuple[str, list[ast.AST]]]:
    """Every statement of ``body``, nested ones included, as (kind, the nodes to normalise): a
    compound statement gives its header, and its bodies give their own statements."""
    for node in body:
        if _is_bare_string(node):
            continue
        header = _COMPOUND_HEADERS.get(type(node))
        if header is None:
            yield type(node).__name__, [node]
            continue
        parts: list[ast.AST] = []
        for field in header:
            value = getattr(node, field)
            parts += value if isinstance(value, list) else [value]
        yield type(node).__name__, parts
        for field in ("body", "orelse", "finalbody"):
            yield from _units(getattr(node, field, []) or [])
        for handler in getattr(node, "handlers", []) or []:
            yield "except", [handler.type] if handler.type is not None else []
            yield from _units(handler.body)


def _shape_of_tree(fn: ast.AST) -> Shape:
    weights: Counter[str] = Counter()
    body = (fn.body if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            else [fn])
    for kind, nodes in _units(body):
        normaliser = _Normaliser()
        normaliser.tokens.append(kind)
        for node in nodes:
            normaliser.visit(node)
        if normaliser.size < MIN_STATEMENT:
            continue
        digest = hashlib.blake2b(" ".join(normaliser.tokens).encode(), digest_size=8).hexdigest()
        weights[digest] += normaliser.size
    return dict(weights)


def shape_of_source(source: str) -> Shape | None:
    """The shape of the first function or class defined in ``source``, else None."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return _shape_of_tree(node)
    return None


_cache: dict[Any, tuple[Any, Shape | None]] = {}


def shape(obj: Any) -> Shape | None:
    """The shape of a function's or class's source, None where there is no source. Kept per
    code object (a function whose code is replaced is read again)."""
    key = getattr(obj, "__code__", None) or obj
    try:
        hit = _cache.get(id(key))
    except TypeError:
        return None
    if hit is not None and hit[0] is key:
        return hit[1]
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError):
        found = None
    else:
        found = shape_of_source(source)
    _cache[id(key)] = (key, found)
    return found


def weight(s: Shape) -> int:
    return sum(s.values())


def likeness(student: Shape, reference: Shape) -> float:
    """The share of ``reference``'s statements (by size) that ``student`` holds: 1.0 for a
    copy however renamed, reordered or reformatted. 0 for a reference below MIN_WEIGHT."""
    total = weight(reference)
    if total < MIN_WEIGHT:
        return 0.0
    return sum(min(w, student.get(h, 0)) for h, w in reference.items()) / total
