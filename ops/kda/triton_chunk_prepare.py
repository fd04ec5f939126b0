"""Kernel 1 of our fused KDA prefill: the chunk-parallel "prepare" pass (kda.md sections 4 and 5).

Triton only: nothing here knows of torch.compile, custom ops or backends (``triton_chunk.py`` launches
it). One program owns one chunk of ``BT = 64`` tokens of one value head and does everything that needs
no recurrent state:

    q, k  <- l2norm(q), l2norm(k)                       (optional; eps inside the sqrt), q *= scale
    g     <- gate(g) in log2 units                      (precomputed, softplus or lower-bound form)
    G     <- cumsum(g) inside the chunk, fp32
    beta  <- sigmoid(beta) (x2 with negative eigenvalues) (optional)
    A_qk[i, j] = sum_d q_i k_j 2^(G_i - G_j)            j <= i
    A_kk[i, j] = beta_i sum_d k_i k_j 2^(G_i - G_j)      j <  i
    T    = (I + A_kk)^-1                                (fp32, on chip)
    w = T (beta 2^G k),  u = T (beta v),  qg = q 2^G,  kd = k 2^(G_last - G),  decay = 2^G_last

and writes ``w, u, qg, kd, A_qk`` (input dtype) and ``decay`` (fp32) for the recurrence kernel
(``triton_chunk_scan.py``). When asked, it also writes what FLA's backward needs, in FLA 0.6's
formats: ``T`` (``Akk``, unit lower triangular, k's dtype) and the chunk-local ``G`` (fp32, log2 units).

Work is on whole tiles: the chunk is held as ``[NB = 4, BC = 16, BKC]`` (16-row blocks x a K slice),
so per-block quantities (block sums, anchors) broadcast along the middle axis. Tiles are loaded and
stored as 2-D ``[64, BKC]`` and reshaped (``_load_tile``): with ``BKC = 16`` Triton then puts each block
in one warp, lanes along its rows, so the block scans and sums are shuffles; the block sums are
exchanged between warps once per slice (``_block_gates``). On an H100 this layout made the kernel 1.33-1.34x
faster, 2.5x with strong decays (2026-11-22; ``docs/kda-kernels.md`` section 2.1). The ``A`` matrices
are built as four column stripes ``[64, 16]`` (key block s), each from two ``[64, BKC] x [BKC, 16]``
tensor-core products per K slice (TF32, ``A_PRECISION``). Pass 1 (per K slice) reads q, k, g once;
pass 2 reads v and the ``beta 2^G k`` it left in ``W``.

Numerics (g <= 0, so G decreases along the chunk):
- ``2^(G_i - G_j)`` is never formed for ``j > i`` outside the diagonal blocks. Stripe s uses the anchor
  ``a_s`` (per channel): ``2^(G_i - G_j) = 2^(G_i - a_s) * 2^(a_s - G_j)``. The key factor is one exp2
  per element (each key row uses its own block's anchor); the query factor is
  ``2^(G_i - p_r) * 2^(p_r - a_s)`` (``p_r`` the cumulative gate before the query's block r), one exp2
  per element plus one per block and channel.
  For query blocks r > s every factor is <= 1 with ``a_s`` = the end of block s; a factor that
  underflows stands for a product that underflows too.
- Diagonal blocks (r = s): in channels where the block's decay range ``R = p_s - c_s`` is at most
  ``DIAG_RANGE_LIMIT`` = 120, ``a_s`` is the middle of that range: the query factor
  ``2^(G_i - p_s) * 2^(p_s - a_s)`` and the key factor lie in ``[2^-R/2, 2^R/2]``, and the first factor
  (>= 2^-120) is still a normal number (beyond about 126 it would underflow while the product does
  not). For r > s the query factor is then <= 2^-R/2 and the key factor <= 2^60, so a query factor
  that underflows loses less than ``2^-66 |q||k|``. The limit covers every block of the lower-bound
  gate with ``lower_bound >= -5`` (16 steps of at most 5 / ln 2 = 7.21: R <= 115.4), so that gate
  never takes the slow path below (``prefill_backend.py`` relies on it). Channels with a larger range
  (gates near -inf, strong softplus decays) take ``a_s = c_s`` and their diagonal block is summed
  exactly, element by element with the decay masked to ``-inf`` above the diagonal before exp2
  (``_exact_diagonal``: slow, in a second pass over K that runs only when some slice needs it and
  reloads its inputs). Launches that cannot need it (``exact_diagonal_needed``: the lower-bound gate
  with ``lower_bound >= -MAX_BOUNDED_DECAY``) compile without it (``EXACT_DIAGONAL``): its code alone cost
  6-8% of the kernel's time on an H100 (register allocation around it; docs/kda-kernels.md section 2.3).
- Every decay exponent is summed over its own span, never taken as a difference of cumulative sums
  from the chunk start (after a huge gate both sums carry it, and their difference keeps ``ulp(9600) =
  2^-10`` of a short span after it: 1e-4 relative). Inside a 16-row block a row's cumsum ``L`` runs from
  the block's start; across blocks the exponents are direct sums of block sums (``_block_gates``: ``P``,
  the stripes' ``p_r - a_s``, ``G_last``, the gate after a block). The key factor and ``kd`` take the gate
  from a row to its block's anchor / end as ``anchor - L``: within fp32 rounding of sums of at most
  ``DIAG_RANGE_LIMIT``; a slice with a wider block sums the gate after each row directly instead
  (``_tail_sums``), and the exact diagonal sums every span ``(j, i]`` directly. So gates of -inf or -1e30
  reset the state as exactly as fp32 can say (the outputs after a reset are bitwise independent of what
  came before), at no cost where no block exceeds the limit (launches that cannot, compile neither).
- Gates are floored at ``GATE_FLOOR`` (log2 units): the saturating value of ``-inf``. Any span containing
  such a step sums to <= -150 and decays by 2^-150, which is 0 in fp32; the floor keeps ``-inf`` from
  producing ``inf - inf``, and every sum finite (>= 64 * -150).
- The triangular inverse: forward substitution on the four 16 x 16 diagonal blocks at once (fp32),
  then ``T = (I + N)^-1 D^-1`` with ``N = D^-1 L_off`` strictly block-lower, so the block series
  ``I - N + N^2 - N^3`` is exact algebra; applied stripe by stripe in Horner form (``SOLVE_PRECISION``).
  Never an element-level Neumann series (NaN on 16 identical keys, kda.md section 5).
- The L2 norms are computed from the loaded tiles when K fits one slice, else in a first pass over K.

Layouts: q, k ``[TT, H, K]``; v ``[TT, HV, V]``; g ``[TT, HV, K]``; beta ``[TT, HV]`` (TT = B * T packed
tokens, contiguous). Outputs ``w, qg, kd`` ``[TT, HV, K]``, ``u`` ``[TT, HV, V]``, ``A_qk`` and ``Akk``
``[TT, HV, BT]`` (row t holds its chunk's row; zeros above the diagonal), ``G`` ``[TT, HV, K]``,
``decay`` ``[chunks, HV, K]``. ``W`` doubles as scratch: pass 1 stores ``beta 2^G k`` there and pass 2
overwrites it with ``T`` times it (same program, after a barrier).
"""
import math
import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

from kda_compile.ops.kda.triton_common import (GATE_LOWER_BOUND, GATE_PRECOMPUTED, GATE_SOFTPLUS, dot_operand,
                                               tf32_round)

# Plain globals are rejected by the compiler (not by the interpreter): constexpr.
LOG2E = tl.constexpr(1.4426950408889634)
L2NORM_EPS = tl.constexpr(1e-6)
GATE_FLOOR = tl.constexpr(-150.0)  # log2 units: 2^-150 rounds to 0 in fp32
DIAG_RANGE_LIMIT = tl.constexpr(120.0)  # beyond it (per block and channel), the exact diagonal

# The largest per-step decay (nats) of which 16 steps stay within DIAG_RANGE_LIMIT (log2 units), with a 1%
# margin for the fp32 rounding of the in-kernel gate and its cumsum: 5.147 (the exact bound is 5.199).
MAX_BOUNDED_DECAY = 0.99 * DIAG_RANGE_LIMIT.value * math.log(2.0) / 16


def exact_diagonal_needed(gate: int, lower_bound: float | None) -> bool:
    """Whether a launch must compile the exact-diagonal pass: always, except for the lower-bound gate with
    ``lower_bound >= -MAX_BOUNDED_DECAY``, whose 16-token blocks cannot exceed ``DIAG_RANGE_LIMIT`` (each step
    decays by ``lower_bound * sigmoid(x)``, at most ``-lower_bound`` nats)."""
    return not (gate == GATE_LOWER_BOUND.value and lower_bound is not None and lower_bound >= -MAX_BOUNDED_DECAY)


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
def _log2_gate(x, A_log, Dt_bias, hv, cols, col_ok, lower_bound, K: tl.constexpr, GATE: tl.constexpr,
               HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """The log2 decay of a raw ``[NB, BC, BKC]`` fp32 gate tile (``cols`` ``[BKC]``), floored."""
    if GATE == GATE_PRECOMPUTED:
        x = x * LOG2E
    else:
        if HAS_DT_BIAS:
            x += tl.load(Dt_bias + hv * K + cols, mask=col_ok, other=0.0).to(tl.float32)[None, None, :]
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


@triton.jit
def _load_tile(ptr, rows, ok, cols, col_ok, stride, NB: tl.constexpr, BC: tl.constexpr):
    """The chunk's ``[BT, BKC]`` tile of a row-major tensor as fp32 ``[NB, BC, BKC]`` (0 outside). Loaded
    as a 2-D tile and reshaped: Triton then lays each 16-row block out inside one warp (lanes along
    the rows), so the block scans and sums below stay in registers and shuffles; a 3-D load puts the
    warps along the rows of every block instead."""
    return tl.reshape(_load_rows(ptr, rows, ok, cols, col_ok, stride), [NB, BC, cols.shape[0]])


@triton.jit
def _load_rows(ptr, rows, ok, cols, col_ok, stride):
    """The chunk's ``[BT, len(cols)]`` tile of a row-major tensor as fp32 (0 outside)."""
    x = tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0)
    return x.to(tl.float32)


@triton.jit
def _store_tile(ptr, x3, rows, ok, cols, col_ok, stride):
    """Store an ``[NB, BC, BKC]`` tile as the chunk's ``[BT, BKC]`` rows (the inverse of ``_load_tile``)."""
    x = tl.reshape(x3, [rows.shape[0], cols.shape[0]])
    tl.store(ptr + rows[:, None] * stride + cols[None, :], x.to(ptr.dtype.element_ty),
             mask=ok[:, None] & col_ok[None, :])


@triton.jit
def _beta(Beta, rows, ok, beta_scale, HV: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """beta of the chunk rows ``rows`` (any shape; ``Beta`` points at the chunk's first row), 0 outside
    the sequence."""
    b = tl.load(Beta + rows * HV, mask=ok, other=0.0).to(tl.float32)
    if BETA_SIGMOID:
        b = tl.where(ok, tl.sigmoid(b) * beta_scale, 0.0)
    return b


@triton.jit
def _block_sums(L3, BC: tl.constexpr):
    """``[NB, BKC]`` gate sums of the blocks: the last row of the block-local cumsum ``L3``."""
    return tl.sum(tl.where(tl.arange(0, BC)[None, :, None] == BC - 1, L3, 0.0), 1)


@triton.jit
def _block_gates(L3, NB: tl.constexpr, BC: tl.constexpr):
    """Per-block gate quantities of a K slice from the block-local cumsum ``L3`` ``[NB, BC, BKC]``.

    Each 16-row block lives in one warp, so what combines blocks needs the other warps' block sums:
    they are exchanged once (``S_all[r, :, s] = S[s]`` in every warp r, one layout conversion; each
    thread holds the block axis) and the rest is computed in every warp from its copy, instead of one
    cross-warp reduction per quantity. Every exponent is a direct sum of the block sums of its own span,
    never a difference of prefix sums: after a huge gate (a floored ``-inf``) in an earlier block both
    prefixes carry it and their difference would keep only ``ulp(9600) = 2^-10`` of a small span.
    Returns, ``[NB, BKC]`` each: ``P`` (gate before the own block), ``to_end`` (gate from the own block's
    start to the chunk's end), ``later`` (gate after the own block), ``G_last`` (the chunk's total), ``alpha``
    and ``after`` (the own block's gate before and after its anchor: half the block's sum each when its range
    is within ``DIAG_RANGE_LIMIT``, else all of it before, the anchor at its end); ``slow`` ``[NB]`` (1 when
    some block of the slice needs the exact diagonal); and ``m0 .. m3``, stripe s's query factors
    ``2^(p_r - a_s)`` ``[NB, BKC]`` (0 for blocks r < s, and for r = s in channels that take the exact
    diagonal)."""
    S = _block_sums(L3, BC)
    S_all = tl.trans(S)[None, :, :] + tl.zeros([NB, S.shape[1], NB], dtype=tl.float32)
    r = tl.arange(0, NB)[:, None, None]  # the own block (warp)
    b = tl.arange(0, NB)[None, None, :]  # the other block, or stripe s
    fast_all = -S_all <= DIAG_RANGE_LIMIT
    after_all = tl.where(fast_all, 0.5 * S_all, 0.0)  # anchors: mid-range of fast blocks, the end of slow ones
    P = tl.sum(tl.where(b < r, S_all, 0.0), 2)
    to_end = tl.sum(tl.where(b >= r, S_all, 0.0), 2)
    later = tl.sum(tl.where(b > r, S_all, 0.0), 2)
    G_last = tl.sum(S_all, 2)
    alpha = tl.sum(tl.where(b == r, tl.where(fast_all, 0.5 * S_all, S_all), 0.0), 2)
    after = tl.sum(tl.where(b == r, after_all, 0.0), 2)
    slow = tl.max(tl.max(tl.where(fast_all, 0, 1), 2), 1)
    # p_r - a_s: for r > s the gate after s's anchor plus the blocks strictly between (summed directly);
    # for r = s in fast channels minus the gate before the anchor, -S_s / 2
    between = tl.zeros([NB, S.shape[1], NB], dtype=tl.float32)
    for m in tl.static_range(1, NB - 1):
        S_m = tl.sum(tl.where(b == m, S_all, 0.0), 2)[:, :, None]
        between += tl.where((b < m) & (m < r), S_m, 0.0)
    exponent = tl.where(r > b, after_all + between,
                        tl.where((r == b) & fast_all, after_all - S_all, float("-inf")))
    middle = tl.exp2(exponent)
    even, odd = tl.split(tl.reshape(middle, [NB, S.shape[1], 2, 2]))  # [..., s // 2, s % 2]
    m0, m2 = tl.split(even)
    m1, m3 = tl.split(odd)
    return P, to_end, later, G_last, alpha, after, slow, m0, m1, m2, m3


@triton.jit
def _tail_sums(g, BC: tl.constexpr):
    """The gate after each row inside its block, ``sum of g over rows (i, BC)`` ``[NB, BC, BKC]``: a reverse
    cumulative sum of the following rows' own gates. The block's sum minus ``L`` is the same number as a
    difference, which a huge gate at or before row i swamps (both sums carry it); this one never sees it."""
    rows = tl.arange(0, BC)[None, :, None]
    following = tl.gather(g, tl.minimum(rows + 1, BC - 1) + tl.zeros(g.shape, dtype=tl.int32), 1)
    return tl.cumsum(tl.where(rows < BC - 1, following, 0.0), 1, reverse=True)


@triton.jit
def _blocks(x, NB: tl.constexpr, BC: tl.constexpr, BKC: tl.constexpr):
    """The four ``[BC, BKC]`` blocks of a ``[NB, BC, BKC]`` tile, by two splits (one layout conversion
    of the tile, instead of a cross-lane reduction per block)."""
    x = tl.reshape(tl.permute(x, (1, 2, 0)), [BC, BKC, 2, 2])  # [..., b // 2, b % 2]
    even, odd = tl.split(x)
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def _stripe(aqk, akk, qe, ke, key, middle, PRECISION: tl.constexpr, DOT_BF16: tl.constexpr, NB: tl.constexpr,
            BC: tl.constexpr, BKC: tl.constexpr):
    """Column stripe s (keys of block s) of ``A_qk`` and ``A_kk`` ``[NB * BC, BC]`` (fp32) plus one K slice's
    products, accumulated in place on the tensor cores. ``qe, ke = q, k * 2^(G - p_own)`` ``[NB, BC, BKC]``,
    ``key = k * 2^(a_s - G)`` of the
    block's 16 keys ``[BC, BKC]``, ``middle = 2^(p_r - a_s)`` ``[NB, BKC]`` (0 for the blocks and
    channels the stripe leaves out; from ``_block_gates``).
    Diagonal entries of slow channels are left out (``_exact_diagonal`` adds them). For fp32 / fp16
    inputs the operands are rounded to TF32 (``tf32_round``); bf16 inputs skip it (pass 1 is
    instruction-bound, and their error is dominated by the bf16 intermediates)."""
    q_op = tl.reshape(qe * middle[:, None, :], [NB * BC, BKC])
    k_op = tl.reshape(ke * middle[:, None, :], [NB * BC, BKC])
    key_t = tl.trans(key)
    if not DOT_BF16:
        q_op, k_op, key_t = tf32_round(q_op), tf32_round(k_op), tf32_round(key_t)
    return (tl.dot(q_op, key_t, aqk, input_precision=PRECISION), tl.dot(k_op, key_t, akk, input_precision=PRECISION))


@triton.jit
def _gates(G_in, A_log, Dt_bias, rows, ok, m, hv, cols, col_ok, lower_bound, HV: tl.constexpr, K: tl.constexpr,
           NB: tl.constexpr, BC: tl.constexpr, GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """The floored log2 gates ``[NB, BC, BKC]`` of one K slice (``m`` ``[NB, BC, BKC]``: inside the sequence
    and K; 0 outside)."""
    g = _load_tile(G_in, rows, ok, cols, col_ok, HV * K, NB, BC)
    return tl.where(m, _log2_gate(g, A_log, Dt_bias, hv, cols, col_ok, lower_bound, K, GATE, HAS_A_LOG, HAS_DT_BIAS),
                    0.0)


@triton.jit
def _gate_cumsum(G_in, A_log, Dt_bias, rows, ok, m, hv, cols, col_ok, lower_bound, HV: tl.constexpr,
                 K: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr, GATE: tl.constexpr, HAS_A_LOG: tl.constexpr,
                 HAS_DT_BIAS: tl.constexpr):
    """The floored log2 gates ``g`` of one K slice and their block-local cumsum ``L`` (G = p_own + L), both
    ``[NB, BC, BKC]`` (``_gates``)."""
    g = _gates(G_in, A_log, Dt_bias, rows, ok, m, hv, cols, col_ok, lower_bound, HV, K, NB, BC, GATE, HAS_A_LOG,
               HAS_DT_BIAS)
    return g, tl.cumsum(g, 1)


@triton.jit
def _exact_diagonal(q3, k3, g, slow, NB: tl.constexpr, BC: tl.constexpr):
    """The diagonal 16 x 16 blocks ``[NB, BC, BC]`` of ``A_qk`` and ``A_kk`` summed over the channels
    where ``slow`` ``[NB, 1, BKC]``, element by element: ``2^(sum of g over (j, i])`` only where i >= j (masked
    to -inf before exp2), never a product of large and tiny factors. The span sums are direct: for j from the
    block's end down, ``span[i] = sum of g over (j, i]`` grows by row j + 1's gate, so no sum carries a gate
    outside its span (a floored ``-inf`` before row j + 1 cannot swamp it; a difference ``L_i - L_j`` would)."""
    rows = tl.arange(0, BC)[None, :, None]
    cols = tl.arange(0, BC)[None, None, :]
    d_qk = tl.zeros([NB, BC, BC], dtype=tl.float32)
    d_kk = tl.zeros([NB, BC, BC], dtype=tl.float32)
    span = tl.zeros(g.shape, dtype=tl.float32)
    for jj in range(0, BC):
        j = BC - 1 - jj
        g_next = tl.gather(g, tl.zeros(g.shape, dtype=tl.int32) + tl.minimum(j + 1, BC - 1), 1)
        span = tl.where(rows > j, span + g_next, 0.0)
        row_j = tl.zeros(k3.shape, dtype=tl.int32) + j  # row j of each block, broadcast by a gather
        k_j = tl.gather(k3, row_j, 1)  # (a shuffle inside the warp that holds the block)
        decay = tl.exp2(tl.where((rows >= j) & slow, span, float("-inf")))
        kd = decay * k_j
        d_qk = tl.where(cols == j, tl.sum(q3 * kd, 2)[:, :, None], d_qk)
        d_kk = tl.where(cols == j, tl.sum(k3 * kd, 2)[:, :, None], d_kk)
    return d_qk, d_kk


@triton.jit
def _unit_lower_inverse_blocks(D, NB: tl.constexpr, BC: tl.constexpr):
    """``(I + D_b)^-1`` for each strictly lower-triangular ``[BC, BC]`` block of ``D`` ``[NB, BC, BC]``
    (fp32): column-oriented forward substitution, after step j row j of ``Y`` is final and is
    eliminated from the rows below it."""
    rows = tl.arange(0, BC)[None, :, None]
    cols = tl.arange(0, BC)[None, None, :]
    Y = tl.where(rows == cols, 1.0, 0.0) + tl.zeros([NB, BC, BC], dtype=tl.float32)
    for j in range(0, BC - 1):
        y_j = tl.sum(tl.where(rows == j, Y, 0.0), 1)  # row j of Y, [NB, BC]
        d_j = tl.sum(tl.where(cols == j, D, 0.0), 2)  # column j of D, [NB, BC]
        Y -= d_j[:, :, None] * y_j[:, None, :]
    return Y


@triton.jit
def _assemble(s0, s1, s2, s3, BT: tl.constexpr):
    """Four ``[BT, BC]`` column stripes side by side: ``[BT, 4 * BC]``."""
    BC: tl.constexpr = s0.shape[1]
    x = tl.join(tl.join(s0, s1), tl.join(s2, s3))  # [BT, BC, 2 (stripe % 2), 2 (stripe // 2)]
    return tl.reshape(tl.permute(x, (0, 3, 2, 1)), [BT, 4 * BC])


@triton.jit
def _store_stripe(X, rows, ok, s: tl.constexpr, value, HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Columns ``[16 s, 16 s + 16)`` of the chunk's rows of ``X [TT, HV, BT]`` (``X`` points at the
    chunk's first row)."""
    cols = s * BC + tl.arange(0, BC)
    tl.store(X + rows[:, None] * (HV * BT) + cols[None, :], value.to(X.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _split_tf32(x):
    """``x = hi + lo`` with ``hi`` exact in TF32 (mantissa rounded to 10 bits) and ``lo`` the exact
    remainder (<= half a TF32 ulp): products of the parts on TF32 tensor cores carry about fp32 accuracy."""
    hi = ((x.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def _solve_dot(a_hi, a_lo, b, PRECISION: tl.constexpr):
    """``a @ b`` in fp32 accuracy: three TF32 products of the split operands when ``PRECISION`` is
    "tf32x3" (``a`` split once by the caller and reused), else one product in ``PRECISION``."""
    if PRECISION == "tf32x3":
        b_hi, b_lo = _split_tf32(b)
        y = tl.dot(a_hi, b_hi, input_precision="tf32")
        y = tl.dot(a_hi, b_lo, y, input_precision="tf32")
        y = tl.dot(a_lo, b_hi, y, input_precision="tf32")
    else:
        y = tl.dot(a_hi + a_lo, b, input_precision=PRECISION)
    return y


@triton.jit
def _horner(n_hi, n_lo, d, steps: tl.constexpr, PRECISION: tl.constexpr):
    """``(I + N)^-1 d`` for a strictly block-lower ``N = n_hi + n_lo`` whose ``steps + 1``-th power
    kills ``d``."""
    t = d
    for _ in tl.static_range(steps):
        t = d - _solve_dot(n_hi, n_lo, t, PRECISION)
    return t


@triton.jit(do_not_specialize=["T", "N"])
def kda_prepare_kernel(
    Q, Kt, Vt, G_in, Beta, A_log, Dt_bias,
    W, U, QG, KD, AQK, DECAY, AKK, G_OUT,
    cu_seqlens, chunk_offsets,
    T, N, scale, beta_scale, lower_bound,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BKC: tl.constexpr, BWC: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    IS_VARLEN: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr, EXACT_DIAGONAL: tl.constexpr,
    HAS_A_LOG: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, BETA_SIGMOID: tl.constexpr, SAVE_AKK: tl.constexpr, SAVE_G: tl.constexpr,
    DOT_BF16: tl.constexpr, A_PRECISION: tl.constexpr, SOLVE_PRECISION: tl.constexpr,
):
    """Grid ``(chunk slots, HV)``. Without varlen, slot = b * cdiv(T, BT) + chunk. With varlen, slots
    number the chunks of all sequences in order (``chunk_offsets[n]`` = first slot of sequence n,
    ``chunk_offsets[N]`` = total); slots past the total exit at once.

    ``BKC``: the K slice of pass 1 (gates, A); ``BWC``: the column slice of pass 2 (w and u).
    ``EXACT_DIAGONAL``: compile the exact-diagonal pass (``exact_diagonal_needed``)."""
    BT: tl.constexpr = 64
    BC: tl.constexpr = 16
    NB: tl.constexpr = 4
    slot = tl.program_id(0)
    hv = tl.program_id(1)
    h = hv // (HV // H)

    if IS_VARLEN:
        # The sequence of this slot: the smallest n with slot < chunk_offsets[n + 1].
        lo = slot * 0
        hi = lo + N
        for _ in range(SEARCH_STEPS):
            active = lo < hi
            mid = (lo + hi) // 2
            upper = tl.load(chunk_offsets + mid + 1, mask=active, other=0)
            left = slot < upper
            hi = tl.where(active & left, mid, hi)
            lo = tl.where(active & (~left), mid + 1, lo)
        if lo >= N:
            return
        n = lo
        bos = tl.load(cu_seqlens + n).to(tl.int64)
        seq_len = tl.load(cu_seqlens + n + 1).to(tl.int64) - bos
        chunk = slot - tl.load(chunk_offsets + n)
    else:
        num_chunks = tl.cdiv(T, BT)
        bos = (slot // num_chunks).to(tl.int64) * T
        seq_len = T
        chunk = slot % num_chunks
    start = chunk * BT  # the chunk's first token, within its sequence

    # Every pointer moves to the chunk's first row (64-bit scalars); offsets inside the chunk are int32.
    t0 = bos + start
    Q += (t0 * H + h) * K
    Kt += (t0 * H + h) * K
    Vt += (t0 * HV + hv) * V
    U += (t0 * HV + hv) * V
    G_in += (t0 * HV + hv) * K
    W += (t0 * HV + hv) * K
    QG += (t0 * HV + hv) * K
    KD += (t0 * HV + hv) * K
    G_OUT += (t0 * HV + hv) * K
    AQK += (t0 * HV + hv) * BT
    AKK += (t0 * HV + hv) * BT
    Beta += t0 * HV + hv
    DECAY += (slot.to(tl.int64) * HV + hv) * K

    # Rows of the chunk two ways: [NB, BC, 1] blocks (pass 1) and [BT] (stripes, pass 2).
    rows3 = tl.arange(0, NB)[:, None, None] * BC + tl.arange(0, BC)[None, :, None]
    ok3 = start + rows3 < seq_len
    rows = tl.arange(0, BT)
    ok = start + rows < seq_len
    beta3 = _beta(Beta, rows3, ok3, beta_scale, HV, BETA_SIGMOID)  # [NB, BC, 1]
    beta = _beta(Beta, rows, ok, beta_scale, HV, BETA_SIGMOID)  # [BT]

    # ---- the L2 norms, in a pass of their own when K spans several slices ---------------------------
    # 64-channel tiles in an unrolled loop: every load is issued before the first sum waits (a loop of
    # dependent BKC-wide iterations left each load's latency exposed: 12% of the kernel's stall samples
    # on an H100, 2026-11-22; docs/kda-kernels.md section 2.2).
    q_scale3 = tl.zeros([NB, BC, 1], dtype=tl.float32) + scale
    k_scale3 = tl.zeros([NB, BC, 1], dtype=tl.float32) + 1.0
    if L2NORM and K > BKC:
        q_sq = tl.zeros([BT], dtype=tl.float32)
        k_sq = tl.zeros([BT], dtype=tl.float32)
        for k0 in tl.static_range(0, K, 64):
            wide = k0 + tl.arange(0, 64)
            q_wide = _load_rows(Q, rows, ok, wide, wide < K, H * K)
            q_sq += tl.sum(q_wide * q_wide, 1)
            k_wide = _load_rows(Kt, rows, ok, wide, wide < K, H * K)
            k_sq += tl.sum(k_wide * k_wide, 1)
        q_sq = tl.reshape(q_sq, [NB, BC])[:, :, None]
        k_sq = tl.reshape(k_sq, [NB, BC])[:, :, None]
        q_scale3 = scale / tl.sqrt(q_sq + L2NORM_EPS)
        k_scale3 = 1.0 / tl.sqrt(k_sq + L2NORM_EPS)

    # ---- pass 1, per K slice: gates, cumsum, qg / kd / decay, x = beta 2^G k, the A stripes ----------
    zero = tl.zeros([BT, BC], dtype=tl.float32)
    aqk0, aqk1, aqk2, aqk3 = zero, zero, zero, zero
    akk0, akk1, akk2, akk3 = zero, zero, zero, zero
    block_of_row = rows[:, None] // BC
    slow_slices = tl.zeros([NB], dtype=tl.int32)  # K slices with a block range that needs the exact diagonal
    for k0 in range(0, K, BKC):
        cols = k0 + tl.arange(0, BKC)
        col_ok = cols < K
        m = ok3 & col_ok[None, None, :]
        L3 = tl.cumsum(_gates(G_in, A_log, Dt_bias, rows, ok, m, hv, cols, col_ok, lower_bound, HV, K, NB, BC, GATE,
                              HAS_A_LOG, HAS_DT_BIAS), 1)
        P, to_end, later, G_last, alpha, after, slow, m0, m1, m2, m3 = _block_gates(L3, NB, BC)
        slow_slices += slow

        q3 = _load_tile(Q, rows, ok, cols, col_ok, H * K, NB, BC)
        k3 = _load_tile(Kt, rows, ok, cols, col_ok, H * K, NB, BC)
        if L2NORM and K <= BKC:
            q_scale3 = scale / tl.sqrt(tl.sum(q3 * q3, 2)[:, :, None] + L2NORM_EPS)
            k_scale3 = 1.0 / tl.sqrt(tl.sum(k3 * k3, 2)[:, :, None] + L2NORM_EPS)
        e = tl.exp2(L3)  # 2^(G - p_own) <= 1
        qe = q3 * q_scale3 * e  # (left to right: the [NB, BC, 1] factors never broadcast on their own)
        k3 = k3 * k_scale3
        ke = k3 * e
        # The gates from each row to its block's anchor and to the chunk's end, as differences with the row's
        # block-local cumsum: exact to fp32 rounding where every block's range is within DIAG_RANGE_LIMIT. A slice
        # with a wider block (huge gates, where the difference would lose the digits of a short span after them)
        # sums the gate after each row inside its block directly, from reloaded gates (keeping them live through
        # the loop spilled). Launches that cannot have such blocks compile neither the check nor the sums.
        key_exp = alpha[:, None, :] - L3
        kd_exp = to_end[:, None, :] - L3
        if EXACT_DIAGONAL:
            if tl.max(slow, 0) > 0:
                tail = _tail_sums(_gates(G_in, A_log, Dt_bias, rows, ok, m, hv, cols, col_ok, lower_bound, HV, K, NB,
                                         BC, GATE, HAS_A_LOG, HAS_DT_BIAS), BC)
                key_exp = tail - after[:, None, :]
                kd_exp = tail + later[:, None, :]
        # What the recurrence reads, every factor <= 1 (one that underflows stands for a decay that
        # underflows too): qg = q 2^G, kd = k 2^(G_last - G), decay = 2^G_last; and x = beta 2^G k. Each
        # exponent is a sum over its own span, or a difference within one block (above).
        start_decay = tl.exp2(P)[:, None, :]
        _store_tile(QG, qe * start_decay, rows, ok, cols, col_ok, HV * K)
        _store_tile(KD, k3 * tl.exp2(kd_exp), rows, ok, cols, col_ok, HV * K)
        _store_tile(W, ke * beta3 * start_decay, rows, ok, cols, col_ok, HV * K)
        first = tl.arange(0, NB)[:, None] == 0  # (every warp holds G_last; one writes it)
        tl.store(DECAY + cols[None, :] + 0 * tl.arange(0, NB)[:, None], tl.exp2(G_last), mask=first & col_ok[None, :])
        if SAVE_G:
            _store_tile(G_OUT, L3 + P[:, None, :], rows, ok, cols, col_ok, HV * K)
        keys = k3 * tl.exp2(key_exp)  # k 2^(a_own - G)

        key0, key1, key2, key3 = _blocks(keys, NB, BC, BKC)
        aqk0, akk0 = _stripe(aqk0, akk0, qe, ke, key0, m0, A_PRECISION, DOT_BF16, NB, BC, BKC)
        aqk1, akk1 = _stripe(aqk1, akk1, qe, ke, key1, m1, A_PRECISION, DOT_BF16, NB, BC, BKC)
        aqk2, akk2 = _stripe(aqk2, akk2, qe, ke, key2, m2, A_PRECISION, DOT_BF16, NB, BC, BKC)
        aqk3, akk3 = _stripe(aqk3, akk3, qe, ke, key3, m3, A_PRECISION, DOT_BF16, NB, BC, BKC)

    if EXACT_DIAGONAL and tl.max(slow_slices, 0) > 0:
        # Rare (gates near -inf): the exact diagonal blocks of the slow channels, in a second pass that
        # reloads what it needs (nothing of it stays live through the fast loop).
        for k0 in range(0, K, BKC):
            cols = k0 + tl.arange(0, BKC)
            col_ok = cols < K
            m = ok3 & col_ok[None, None, :]
            g, L3 = _gate_cumsum(G_in, A_log, Dt_bias, rows, ok, m, hv, cols, col_ok, lower_bound, HV, K, NB, BC,
                                 GATE, HAS_A_LOG, HAS_DT_BIAS)
            slow = -_block_sums(L3, BC) > DIAG_RANGE_LIMIT
            if tl.max(tl.max(slow.to(tl.int32), 1), 0) > 0:
                q3 = _load_tile(Q, rows, ok, cols, col_ok, H * K, NB, BC) * q_scale3
                k3 = _load_tile(Kt, rows, ok, cols, col_ok, H * K, NB, BC) * k_scale3
                d_qk, d_kk = _exact_diagonal(q3, k3, g, slow[:, None, :], NB, BC)
                d_qk = tl.reshape(d_qk, [BT, BC])  # row 16 b + i of block b's diagonal
                d_kk = tl.reshape(d_kk, [BT, BC])
                aqk0 += tl.where(block_of_row == 0, d_qk, 0.0)
                aqk1 += tl.where(block_of_row == 1, d_qk, 0.0)
                aqk2 += tl.where(block_of_row == 2, d_qk, 0.0)
                aqk3 += tl.where(block_of_row == 3, d_qk, 0.0)
                akk0 += tl.where(block_of_row == 0, d_kk, 0.0)
                akk1 += tl.where(block_of_row == 1, d_kk, 0.0)
                akk2 += tl.where(block_of_row == 2, d_kk, 0.0)
                akk3 += tl.where(block_of_row == 3, d_kk, 0.0)

    # ---- A_qk, and L = beta A_kk (strictly lower) ------------------------------------------------------
    c16 = tl.arange(0, BC)[None, :]
    r64 = rows[:, None]
    _store_stripe(AQK, rows, ok, 0, tl.where(r64 >= c16, aqk0, 0.0), HV, BT, BC)
    _store_stripe(AQK, rows, ok, 1, tl.where(r64 >= c16 + BC, aqk1, 0.0), HV, BT, BC)
    _store_stripe(AQK, rows, ok, 2, tl.where(r64 >= c16 + 2 * BC, aqk2, 0.0), HV, BT, BC)
    _store_stripe(AQK, rows, ok, 3, tl.where(r64 >= c16 + 3 * BC, aqk3, 0.0), HV, BT, BC)
    L0 = tl.where(r64 > c16, akk0, 0.0) * beta[:, None]
    L1 = tl.where(r64 > c16 + BC, akk1, 0.0) * beta[:, None]
    L2 = tl.where(r64 > c16 + 2 * BC, akk2, 0.0) * beta[:, None]
    L3_ = tl.where(r64 > c16 + 3 * BC, akk3, 0.0) * beta[:, None]

    # ---- T = (I + L)^-1: diagonal blocks by substitution, then the exact block series ----------------
    b3 = tl.arange(0, NB)[:, None, None]
    D = (tl.where(b3 == 0, tl.reshape(L0, [NB, BC, BC]), 0.0) + tl.where(b3 == 1, tl.reshape(L1, [NB, BC, BC]), 0.0)
         + tl.where(b3 == 2, tl.reshape(L2, [NB, BC, BC]), 0.0) + tl.where(b3 == 3, tl.reshape(L3_, [NB, BC, BC]), 0.0))
    Dinv = _unit_lower_inverse_blocks(D, NB, BC)  # [NB, BC, BC]
    Dinv_rows = tl.reshape(Dinv, [BT, BC])  # row 16 b + i: row i of block b's inverse
    # N = D^-1 L_off, stripe by stripe (block-diagonal times stripe: one batched product each)
    dinv_hi, dinv_lo = _split_tf32(Dinv)
    N0 = tl.reshape(_solve_dot(dinv_hi, dinv_lo, tl.reshape(tl.where(block_of_row > 0, L0, 0.0), [NB, BC, BC]),
                               SOLVE_PRECISION), [BT, BC])
    N1 = tl.reshape(_solve_dot(dinv_hi, dinv_lo, tl.reshape(tl.where(block_of_row > 1, L1, 0.0), [NB, BC, BC]),
                               SOLVE_PRECISION), [BT, BC])
    N2 = tl.reshape(_solve_dot(dinv_hi, dinv_lo, tl.reshape(tl.where(block_of_row > 2, L2, 0.0), [NB, BC, BC]),
                               SOLVE_PRECISION), [BT, BC])
    Nm = _assemble(N0, N1, N2, zero, BT)  # [BT, BT]
    # stripe s of T = (I - N + N^2 - N^3) D^-1 e_s; N^(4 - s) D^-1 e_s = 0
    n_hi, n_lo = _split_tf32(Nm)
    T0 = _horner(n_hi, n_lo, tl.where(block_of_row == 0, Dinv_rows, 0.0), 3, SOLVE_PRECISION)
    T1 = _horner(n_hi, n_lo, tl.where(block_of_row == 1, Dinv_rows, 0.0), 2, SOLVE_PRECISION)
    T2 = _horner(n_hi, n_lo, tl.where(block_of_row == 2, Dinv_rows, 0.0), 1, SOLVE_PRECISION)
    T3 = tl.where(block_of_row == 3, Dinv_rows, 0.0)
    if SAVE_AKK:
        _store_stripe(AKK, rows, ok, 0, T0, HV, BT, BC)
        _store_stripe(AKK, rows, ok, 1, T1, HV, BT, BC)
        _store_stripe(AKK, rows, ok, 2, T2, HV, BT, BC)
        _store_stripe(AKK, rows, ok, 3, T3, HV, BT, BC)
    Tm = _assemble(T0, T1, T2, T3, BT)
    Tm = dot_operand(Tm, DOT_BF16)

    # ---- pass 2: w = T x (x read back from W), u = T (beta v) ------------------------------------------
    tl.debug_barrier()  # every thread's x is in W before any thread reads it
    for c0 in range(0, K, BWC):
        cols = c0 + tl.arange(0, BWC)
        m = ok[:, None] & (cols < K)[None, :]
        ptr = W + rows[:, None] * (HV * K) + cols[None, :]
        x = tl.load(ptr, mask=m, other=0.0)
        x = dot_operand(x, DOT_BF16)
        y = tl.dot(Tm, x, input_precision=A_PRECISION)
        tl.debug_barrier()  # every thread has read this slice of x before it is overwritten
        tl.store(ptr, y.to(W.dtype.element_ty), mask=m)
    for c0 in range(0, V, BWC):
        cols = c0 + tl.arange(0, BWC)
        m = ok[:, None] & (cols < V)[None, :]
        x = tl.load(Vt + rows[:, None] * (HV * V) + cols[None, :], mask=m, other=0.0).to(tl.float32)
        x = dot_operand(x * beta[:, None], DOT_BF16)
        y = tl.dot(Tm, x, input_precision=A_PRECISION)
        tl.store(U + rows[:, None] * (HV * V) + cols[None, :], y.to(U.dtype.element_ty), mask=m)
