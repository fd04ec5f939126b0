"""Checks of the options the strategies take: one value or a non-empty sequence of values, with a
clear error naming the option otherwise."""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from hypothesis import strategies as st

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def choices(name: str, value, allowed: Iterable | None = None) -> tuple:
    """Normalise an option given as one value or a non-empty sequence of values."""
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not values:
        raise ValueError(f"{name} must be a value or a non-empty sequence of values, got {value!r}")
    if allowed is not None:
        allowed = tuple(allowed)
        bad = [v for v in values if v not in allowed]
        if bad:
            raise ValueError(f"{name} must contain only {allowed}, got {bad}")
    return values


def positive_ints(name: str, values) -> tuple[int, ...]:
    values = choices(name, values)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise ValueError(f"{name} must be positive integers, got {values!r}")
    return values


def draw_call(draw, cases: st.SearchStrategy, make: Callable, dtypes, device, requires_grad: bool):
    """Draw a case, a dtype (from ``dtypes``) and a seed, and build one call's arguments with
    ``make(case, dtype, device, seed=..., requires_grad=...)``."""
    case = draw(cases)
    dtype = draw(st.sampled_from(choices("dtypes", dtypes, FLOAT_DTYPES)))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    return make(case, dtype, device, seed=seed, requires_grad=requires_grad)


def check_case(case, mask_kinds: tuple, mask_shapes: tuple, dtype) -> None:
    """The options of a hand-built case that the builders index by: its mask kind and broadcast, and
    the dtype asked for."""
    if case.mask not in mask_kinds:
        raise ValueError(f"case.mask must be one of {mask_kinds}, got {case.mask!r}")
    if case.mask_shape not in mask_shapes:
        raise ValueError(f"case.mask_shape must be one of {mask_shapes}, got {case.mask_shape!r}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")

