"""Comparing what an implementation produced with what it should have, and saying why it differs.

Every lesson's checks use these, so a mismatch reads the same everywhere: a tensor that differs
names its shape, dtype, tolerance and largest difference, and recognises the classic slips (the
sum over ranks instead of the mean: "is 4x the expected value"); a per-rank result that is not
one value per rank says so; a resource above the bound its technique promises names the saving
that was lost and by how much. Trusted code only: it never runs student code, and it only ever
sees plain data (tensors, numbers, strings, and lists/tuples/dicts of them).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "CheckFailed",
    "assert_same",
    "describe",
    "one_thread",
    "per_rank",
    "scale_factor",
    "short",
    "tensor_mismatch",
    "within_bound",
]


class CheckFailed(AssertionError):
    """A case found wrong data. Carries what a student needs to fix it."""

    def __init__(self, message: str, *, expected: Any = None, got: Any = None, hint: str = "",
                 recipe: str = "", cause: str = ""):
        super().__init__(message)
        self.message = message
        self.expected = expected
        self.got = got
        self.hint = hint  # the concept this failure breaks (shown first)
        self.recipe = recipe  # how to fix it, in words (shown after repeated failures)
        # A short key naming the mistake found (e.g. "special token selected"). A later case that
        # fails with the cause of an earlier one fails only because of it: it is shown as
        # following from that failure, without hints of its own (results.settle).
        self.cause = cause


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run on one intra-op thread, then restore the count; also a decorator (``@one_thread()``).

    Two reasons the checks use it: a bit-for-bit comparison across processes needs one summation
    order (some CPU kernels, layer norm's bf16 backward among them, split their sums by thread
    count; the grader's process and a sandboxed worker may run with different counts), and on a
    loaded 2-core machine a second thread makes each small op wait for a core.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def describe(x: Any, limit: int = 200) -> str:
    """``x`` in at most ``limit`` characters: a small tensor in full, a large one by its shape."""
    if isinstance(x, torch.Tensor):
        body = repr(x.detach().cpu()) if x.numel() <= 16 else f"tensor of shape {tuple(x.shape)}"
        return f"{body} (dtype={x.dtype})" if x.numel() <= 16 else f"{body}, dtype={x.dtype}"
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short(t: Any, digits: int = 4) -> str:
    """A tensor's shape and first four values (``shape (4, 8): [0.1, ...]``); else its repr."""
    if not isinstance(t, torch.Tensor):
        return repr(t)[:120]
    flat = t.detach().flatten()
    values = [round(v, digits) for v in flat[:4].double().tolist()]
    return f"shape {tuple(t.shape)}: {values}" + (" ..." if flat.numel() > 4 else "")


# Factors a wrong result is most often off by, and what each says about the mistake.
def _factor_names(world_size: int | None) -> dict[float, str]:
    names = {2.0: "", 0.5: "", 3.0: "", 4.0: ""}
    if world_size and world_size > 1:
        names[float(world_size)] = "the sum over ranks, not the mean (divide by the world size)"
        names[1.0 / world_size] = "divided by the world size once too often"
    return names


def scale_factor(got: torch.Tensor, want: torch.Tensor, world_size: int | None = None, *,
                 rtol: float = 1e-4, atol: float = 1e-5) -> str | None:
    """``"is 4x the expected value: <why>"`` when ``got`` is ``want`` scaled by a telling
    factor (the world size, its inverse, 2, 3, 4); else None."""
    if not want.is_floating_point() or not want.any():
        return None
    g, w = got.double(), want.double()
    for k, why in _factor_names(world_size).items():
        if torch.allclose(g, w * k, rtol=rtol, atol=atol):
            text = f"{k:g}x" if k >= 1 else f"1/{round(1 / k)} of"
            return f"is {text} the expected value" + (f": {why}" if why else "")
    return None


def tensor_mismatch(got: Any, want: torch.Tensor, *, rtol: float = 1e-5, atol: float = 1e-6,
                    world_size: int | None = None, dtype: bool = False) -> str | None:
    """None if ``got`` equals ``want`` within ``rtol``/``atol``; else what is wrong, as a phrase
    to follow a name (``"weight has shape (4,), expected (4, 8)"``).

    Args:
        world_size: also recognise the sum over ranks where the mean was due (and the reverse).
        dtype: the dtype must match too (default: values are compared in float64).
    """
    if not isinstance(got, torch.Tensor):
        return f"is {describe(got, 80)}, expected a tensor of shape {tuple(want.shape)}"
    if got.shape != want.shape:
        return f"has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if dtype and got.dtype != want.dtype:
        return f"has dtype {got.dtype}, expected {want.dtype}"
    if want.is_floating_point() or want.is_complex() or got.is_floating_point():
        if torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol, equal_nan=True):
            return None
    elif torch.equal(got, want):
        return None
    diff = (got.double() - want.double()).abs().max().item()
    scaled = scale_factor(got, want, world_size, rtol=max(rtol, 1e-4), atol=max(atol, 1e-5))
    if scaled:
        return f"{scaled} (max abs difference {diff:.3g})"
    return f"differs (max abs difference {diff:.3g}, tolerance rtol={rtol:g}, atol={atol:g})"


def per_rank(got: Any, world_size: int, what: str = "result") -> list[Any]:
    """``got`` as a list of one ``what`` per rank; raise :class:`CheckFailed` otherwise."""
    if not isinstance(got, (list, tuple)) or len(got) != world_size:
        count = len(got) if isinstance(got, (list, tuple)) else type(got).__name__
        raise CheckFailed(f"expected one {what} per rank ({world_size} ranks), got {count}",
                          expected=world_size, got=describe(got))
    return list(got)


def within_bound(measured: Sequence[float] | Mapping[int, float],
                 bound: float | Sequence[float], *, what: str, formula: str, lost: str,
                 unit: str = "bytes", hint: str = "", recipe: str = "", cause: str = "") -> None:
    """Fail unless every rank's ``measured`` ``what`` is at most ``bound`` (one number for all
    ranks, or one per rank where their shares differ: uneven partitions).

    The message names the saving that was lost and by how much, e.g. "optimizer state per rank:
    rank 1 holds 3.0x the ZeRO-1 bound (12,288 > 4,096 bytes = total / W + largest parameter):
    every rank keeps optimizer state for all 48 tensors".

    Args:
        measured: one number per rank (a list, or {rank: number}).
        bound: the most the technique allows, computed by trusted code from the sizes.
        formula: the bound in words or symbols, as the task states it.
        lost: what a rank over the bound has given up (the mistake's consequence).
        cause: the key of the mistake an excess shows (``CheckFailed.cause``), when an earlier
            case names the same one.
    """
    items = list(measured.items() if isinstance(measured, Mapping) else enumerate(measured))
    limits = dict(enumerate(bound)) if isinstance(bound, (list, tuple)) else None
    if limits is not None and set(limits) != {rank for rank, _ in items}:
        raise CheckFailed(f"{what}: expected one measurement per rank ({len(limits)} ranks), got "
                          f"{len(items)}", hint=hint, recipe=recipe)
    worst = None
    for rank, value in items:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            raise CheckFailed(f"{what}: rank {rank} reported {describe(value, 60)}, not a number",
                              hint=hint, recipe=recipe)
        limit = limits[rank] if limits is not None else bound
        ratio = value / limit if limit > 0 else (math.inf if value > 0 else 0.0)
        if value > limit and (worst is None or ratio > worst[2]):
            worst = (rank, value, ratio, limit)
    if worst is None:
        return
    rank, value, ratio, bound = worst
    raise CheckFailed(f"{what}: rank {rank} holds {ratio:.1f}x the bound ({value:,.0f} > "
                      f"{bound:,.0f} {unit} = {formula}): {lost}",
                      expected=f"at most {bound:,.0f} {unit}", got=f"{value:,.0f} {unit}",
                      hint=hint, recipe=recipe, cause=cause)


def assert_same(got: Any, expected: Any, *, rtol: float = 1e-5, atol: float = 1e-6,
                path: str = "") -> None:
    """Default comparison: same structure, same types, tensors equal up to tolerance.

    Only plain data is accepted on either side (the batch grader guarantees it for ``got``),
    so an object with a rigged ``__eq__`` never reaches this function.
    """
    where = path or "result"
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise CheckFailed(f"{where}: expected a tensor, got {type(got).__name__}",
                              expected=describe(expected), got=describe(got))
        if got.shape != expected.shape:
            raise CheckFailed(f"{where}: wrong shape {tuple(got.shape)}, expected "
                              f"{tuple(expected.shape)}",
                              expected=tuple(expected.shape), got=tuple(got.shape))
        if got.dtype != expected.dtype:
            raise CheckFailed(f"{where}: wrong dtype {got.dtype}, expected {expected.dtype}",
                              expected=expected.dtype, got=got.dtype)
        if expected.is_floating_point() or expected.is_complex():
            ok = torch.allclose(got, expected, rtol=rtol, atol=atol, equal_nan=True)
        else:
            ok = torch.equal(got, expected)
        if not ok:
            diff = (got.double() - expected.double()).abs()
            raise CheckFailed(f"{where}: values differ "
                              f"(max abs difference {diff.max().item():.3g})",
                              expected=describe(expected), got=describe(got))
        return
    if isinstance(expected, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        if not math.isclose(got, expected, rel_tol=rtol, abs_tol=atol) and not (
            math.isnan(got) and math.isnan(expected)
        ):
            raise CheckFailed(f"{where}: expected {expected!r}, got {got!r}", expected=expected,
                              got=got)
        return
    if type(got) is not type(expected):
        raise CheckFailed(f"{where}: expected a {type(expected).__name__}, "
                          f"got {type(got).__name__}",
                          expected=describe(expected), got=describe(got))
    if isinstance(expected, (list, tuple)):
        if len(got) != len(expected):
            raise CheckFailed(f"{where}: expected {len(expected)} items, got {len(got)}",
                              expected=describe(expected), got=describe(got))
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, rtol=rtol, atol=atol, path=f"{where}[{i}]")
        return
    if isinstance(expected, dict):
        if set(got) != set(expected):
            raise CheckFailed(f"{where}: expected keys {sorted(map(str, expected))}, got "
                              f"{sorted(map(str, got))}",
                              expected=sorted(map(str, expected)), got=sorted(map(str, got)))
        for k in expected:
            assert_same(got[k], expected[k], rtol=rtol, atol=atol, path=f"{where}[{k!r}]")
        return
    if got != expected:
        raise CheckFailed(f"{where}: expected {describe(expected)}, got {describe(got)}",
                          expected=describe(expected), got=describe(got))
