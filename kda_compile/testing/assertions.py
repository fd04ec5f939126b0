"""Relative-error comparisons used to check kernels against a reference.

The metric is the one flash-linear-attention uses for its kernels: the relative RMS error
``||actual - expected|| / ||expected||`` over the whole tensor (Frobenius norms), computed in
float64 so that the check itself adds no rounding. NaN or inf in either tensor never passes: a
kernel that overflows must not hide behind a loose tolerance.
"""
from __future__ import annotations

import math

import torch

__all__ = ["rel_error", "assert_rel_close"]


def _as_fp64(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t.detach().to(device="cpu", dtype=torch.float64)


def rel_error(actual: torch.Tensor, expected: torch.Tensor, *, floor: float = 0.0) -> float:
    """Relative error ``||actual - expected|| / max(||expected||, floor)`` in float64.

    Args:
        actual, expected: tensors of the same shape (any dtype, any device).
        floor: smallest denominator; lets a check on a tensor that is (nearly) zero by
            construction fall back to an absolute error instead of dividing by ~0.
    Returns:
        The error as a Python float: ``nan`` when either tensor holds a NaN, ``inf`` when one holds
        an inf, when the denominator is 0 and the tensors differ; ``0.0`` when both are all zero.
    Raises:
        ValueError: the shapes differ.
    """
    a = _as_fp64("actual", actual)
    b = _as_fp64("expected", expected)
    if a.shape != b.shape:
        raise ValueError(
            f"actual and expected must have the same shape, got {list(a.shape)} and {list(b.shape)}"
        )
    if torch.isnan(a).any() or torch.isnan(b).any():
        return math.nan
    if torch.isinf(a).any() or torch.isinf(b).any():
        return math.inf
    diff = torch.linalg.vector_norm(a - b).item()
    denom = max(torch.linalg.vector_norm(b).item(), floor)
    if denom == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / denom


def _worst_element(a: torch.Tensor, b: torch.Tensor) -> str:
    """Where the largest absolute difference sits, for the failure message."""
    if a.numel() == 0:
        return "empty tensors"
    diff = (a - b).abs()
    # NaN compares as largest so a NaN position is reported first.
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    flat = int(torch.argmax(diff).item())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))
    return f"largest |diff| at index {list(index)}: actual {a[index].item():.6g}, expected {b[index].item():.6g}"


def assert_rel_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    tol: float,
    *,
    name: str = "tensor",
    floor: float = 0.0,
) -> float:
    """Assert ``rel_error(actual, expected) <= tol``; NaN and inf always fail.

    Args:
        actual: the tensor under test.
        expected: the reference (its norm is the denominator).
        tol: largest accepted relative error, e.g. ``5e-3``.
        name: what is compared; it starts the failure message (``"dq"``, ``"final_state"``).
        floor: smallest denominator (see :func:`rel_error`).
    Returns:
        The measured relative error, so a caller can log or aggregate it.
    Raises:
        AssertionError: with the error, the tolerance, both norms and the worst element.
        ValueError: the shapes differ, or ``tol`` is not a finite non-negative number.
    """
    if not (isinstance(tol, (int, float)) and math.isfinite(tol) and tol >= 0):
        raise ValueError(f"tol must be a finite number >= 0, got {tol!r}")
    err = rel_error(actual, expected, floor=floor)
    if err <= tol:  # False for NaN, so NaN never passes
        return err
    a = _as_fp64("actual", actual)
    b = _as_fp64("expected", expected)
    finite = "" if torch.isfinite(a).all() else f"; actual holds {int((~torch.isfinite(a)).sum())} non-finite values"
    if not torch.isfinite(b).all():
        finite += f"; expected holds {int((~torch.isfinite(b)).sum())} non-finite values"
    raise AssertionError(
        f"{name}: relative error {err:.3e} exceeds tolerance {tol:.1e} "
        f"(||actual-expected|| = {torch.linalg.vector_norm(a - b).item():.4e}, "
        f"||expected|| = {torch.linalg.vector_norm(b).item():.4e}, shape {list(a.shape)}, "
        f"actual dtype {actual.dtype}{finite}; {_worst_element(a, b)})"
    )
