"""The gate forms of the prepare kernel (``prefill/triton/prepare.py``), in log2 units: what both the per-channel
gate (KDA, ``prefill/triton/prepare_channel.py``) and the per-head scalar gate (GDN,
``prefill/triton/prepare_scalar.py``) apply to their raw tiles.

Triton only. ``GATE_FLOOR`` is the saturating value of ``-inf``: any span containing such a step sums to <= -150
and decays by 2^-150, which is 0 in fp32; the floor keeps ``-inf`` from producing ``inf - inf`` and every sum of a
chunk's gates finite (>= 64 * -150).
"""
import os

import triton
import triton.language as tl
from kda_compile.ops.kda.triton_common import GATE_PRECOMPUTED, GATE_SOFTPLUS
from triton.language.extra import libdevice

# Plain globals are rejected by the compiler (not by the interpreter): constexpr.
LOG2E = tl.constexpr(1.4426950408889634)
GATE_FLOOR = tl.constexpr(-150.0)  # log2 units: 2^-150 rounds to 0 in fp32

# The hardware log2 (MUFU) instead of libdevice's polynomial log2f, and the approximate division; the
# interpreter has no libdevice.
HARDWARE_MATH = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def _log2(x):
    if HARDWARE_MATH:
        y = libdevice.fast_log2f(x)
    else:
        y = tl.log2(x)
    return y


@triton.jit
def log2_gate(x, A_log, hv, lower_bound, GATE: tl.constexpr, HAS_A_LOG: tl.constexpr):
    """The log2 decay of a raw fp32 gate tile of any shape, floored at ``GATE_FLOOR``. ``x`` is the finished
    log decay (``GATE_PRECOMPUTED``) or the raw projection with ``dt_bias`` already added."""
    if GATE == GATE_PRECOMPUTED:
        x = x * LOG2E
    else:
        if GATE == GATE_SOFTPLUS:
            # -exp(A_log) * softplus(x) / ln 2, softplus = x above 20 (as HF and torch), else log1p(exp(x)).
            # log2(1 + y) = log2(u) + log2(1 + c / u) with u = 1 + y rounded and c = y - (u - 1) its rounding
            # error: for y < 1, u - 1 is exact, |c| <= 2^-24 and log2(1 + c / u) = c / ln 2 to within
            # |c| y / (1 + y); for tiny y (u = 1) that is the whole value, y / ln 2. For y >= 1 the rounding
            # of u moves log2(u) by at most 2^-24 / ln 2 and c is dropped. One exp2 and one log2 (MUFU),
            # no division: libdevice's log1p and a division cost tens of instructions per element in the
            # kernel's busiest loop.
            a = 1.0
            if HAS_A_LOG:  # (the op layer requires A_log here; no read of the 1-element dummy otherwise)
                a = tl.exp2(tl.load(A_log + hv).to(tl.float32) * LOG2E)
            y = tl.exp2(tl.minimum(x, 20.0) * LOG2E)
            u = 1.0 + y
            c = tl.where(y < 1.0, y - (u - 1.0), 0.0)
            log2_1p = _log2(u) + c * LOG2E
            x = -a * tl.where(x > 20.0, x * LOG2E, log2_1p)
        else:
            # lb * sigmoid(a x) / ln 2 = (lb / ln 2) / (1 + 2^(-a x / ln 2)): one scalar factor, two MUFU
            # operations and an approximate division per element (``_divide``).
            slope = -LOG2E
            if HAS_A_LOG:
                slope = -tl.exp2(tl.load(A_log + hv).to(tl.float32) * LOG2E) * LOG2E
            x = _divide(lower_bound * LOG2E, 1.0 + tl.exp2(x * slope))
    return tl.maximum(x, GATE_FLOOR)


@triton.jit
def _divide(a, b):
    """``a / b`` for ``b >= 1``: the hardware reciprocal (2 ulp; 0 for ``b > 2^126``, where the exact
    quotient is below 2^-123 |a|) instead of IEEE division's range checks; exact when interpreted."""
    if HARDWARE_MATH:
        y = libdevice.fast_dividef(a, b)
    else:
        y = a / b
    return y
