"""Pass 1 of the prepare kernel (``prefill/triton/prepare.py``) for the per-channel gate (KDA): per K slice the
gates, their block-local cumsum, ``qg``, ``kd``, ``decay``, ``x = beta 2^G k`` and the ``A_qk`` / ``A_kk``
stripes, with the decay folded into the operands because it differs per channel.

Triton only. Numerics (g <= 0, so G decreases along the chunk):
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
  never takes the slow path below (``prefill/backend.py`` relies on it). Channels with a larger range
  (gates near -inf, strong softplus decays) take ``a_s = c_s`` and their diagonal block is summed
  exactly, element by element with the decay masked to ``-inf`` above the diagonal before exp2
  (``exact_diagonal``: slow, in a second pass over K that runs only when some slice needs it and
  reloads its inputs). Launches that cannot need it (``exact_diagonal_needed``: the lower-bound gate
  with ``lower_bound >= -MAX_BOUNDED_DECAY``) compile without it (``EXACT_DIAGONAL``): its code alone costs
  time through the register allocation around it (docs/kda-kernels.md section 8).
- Every decay exponent is summed over its own span, never taken as a difference of cumulative sums
  from the chunk start (after a huge gate both sums carry it, and their difference keeps ``ulp(9600) =
  2^-10`` of a short span after it: 1e-4 relative). Inside a 16-row block a row's cumsum ``L`` runs from
  the block's start; across blocks the exponents are direct sums of block sums (``block_gates``: ``P``,
  the stripes' ``p_r - a_s``, ``G_last``, the gate after a block). The key factor and ``kd`` take the gate
  from a row to its block's anchor / end as ``anchor - L``: within fp32 rounding of sums of at most
  ``DIAG_RANGE_LIMIT``; a slice with a wider block sums the gate after each row directly instead
  (``tail_sums``), and the exact diagonal sums every span ``(j, i]`` directly. So gates of -inf or -1e30
  reset the state as exactly as fp32 can say (the outputs after a reset are bitwise independent of what
  came before), at no cost where no block exceeds the limit (launches that cannot, compile neither).

Layout: the chunk is held as ``[NB = 4, BC = 16, BKC]`` (16-row blocks x a K slice), so per-block quantities
(block sums, anchors) broadcast along the middle axis. Tiles are loaded and stored as 2-D ``[64, BKC]`` and
reshaped (``load_tile``): with ``BKC = 16`` Triton then puts each block in one warp, lanes along its rows, so the
block scans and sums are shuffles; the block sums are exchanged between warps once per slice (``block_gates``).
Why this layout, and what it gained: ``docs/kda-kernels.md`` sections 2.1 and 8. The ``A`` matrices are built as
four column stripes ``[64, 16]`` (key block s), each from two ``[64, BKC] x [BKC, 16]`` tensor-core products per K
slice (TF32, ``A_PRECISION``).
"""
import math

import triton
import triton.language as tl
from kda_compile.ops.kda.triton_common import (
    GATE_LOWER_BOUND,
    GATE_PRECOMPUTED,
    tf32_round,
)
from kda_compile.ops.kda.prefill.triton.prepare_gates import log2_gate
from kda_compile.ops.kda.prefill.triton.prepare_tiles import (
    L2NORM_EPS,
    l2_sums,
    load_tile,
    store_tile,
)

DIAG_RANGE_LIMIT = tl.constexpr(120.0)  # beyond it (per block and channel), the exact diagonal

# The largest per-step decay (nats) of which 16 steps stay within DIAG_RANGE_LIMIT (log2 units), with a 1%
# margin for the fp32 rounding of the in-kernel gate and its cumsum: 5.147 (the exact bound is 5.199).
MAX_BOUNDED_DECAY = 0.99 * DIAG_RANGE_LIMIT.value * math.log(2.0) / 16


def exact_diagonal_needed(gate: int, lower_bound: float | None) -> bool:
    """Whether a launch must compile the exact-diagonal pass: always, except for the lower-bound gate with
    ``lower_bound >= -MAX_BOUNDED_DECAY``, whose 16-token blocks cannot exceed ``DIAG_RANGE_LIMIT`` (each step
    decays by ``lower_bound * sigmoid(x)``, at most ``-lower_bound`` nats)."""
    return not (gate == GATE_LOWER_BOUND.value and lower_bound is not None and lower_bound >= -MAX_BOUNDED_DECAY)


@triton.jit
def channel_gate_pass(Q, Kt, G_in, A_log, Dt_bias, W, QG, KD, DECAY, G_OUT, rows, ok, rows3, ok3, beta3, hv, scale,
                      lower_bound, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BKC: tl.constexpr,
                      L2NORM: tl.constexpr, GATE: tl.constexpr, EXACT_DIAGONAL: tl.constexpr,
                      HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SAVE_G: tl.constexpr,
                      A_PRECISION: tl.constexpr):
    """Pass 1 for the per-channel gate ``[TT, HV, K]``: writes ``qg, kd`` and ``x = beta 2^G k`` (into ``W``),
    ``decay`` and with ``SAVE_G`` the chunk-local gate cumsum; returns the four column stripes ``[BT, BC]`` of
    ``A_qk`` and of ``A_kk`` (before beta and the triangle masks)."""
    BT: tl.constexpr = 64
    BC: tl.constexpr = 16
    NB: tl.constexpr = 4
    # ---- the L2 norms, in a pass of their own when K spans several slices (``l2_sums``) ----------------
    q_scale3 = tl.zeros([NB, BC, 1], dtype=tl.float32) + scale
    k_scale3 = tl.zeros([NB, BC, 1], dtype=tl.float32) + 1.0
    if L2NORM and K > BKC:
        q_sq, k_sq = l2_sums(Q, Kt, rows, ok, K, H * K)
        q_sq = tl.reshape(q_sq, [NB, BC])[:, :, None]
        k_sq = tl.reshape(k_sq, [NB, BC])[:, :, None]
        q_scale3 = scale / tl.sqrt(q_sq + L2NORM_EPS)
        k_scale3 = 1.0 / tl.sqrt(k_sq + L2NORM_EPS)

    # ---- per K slice: gates, cumsum, qg / kd / decay, x = beta 2^G k, the A stripes -----------------
    zero = tl.zeros([BT, BC], dtype=tl.float32)
    aqk0, aqk1, aqk2, aqk3 = zero, zero, zero, zero
    akk0, akk1, akk2, akk3 = zero, zero, zero, zero
    block_of_row = rows[:, None] // BC
    slow_slices = tl.zeros([NB], dtype=tl.int32)  # K slices with a block range that needs the exact diagonal
    for k0 in range(0, K, BKC):
        cols = k0 + tl.arange(0, BKC)
        col_ok = cols < K
        m = ok3 & col_ok[None, None, :]
        L3 = tl.cumsum(channel_gates(G_in, A_log, Dt_bias, rows, ok, m, hv, cols, col_ok, lower_bound, HV, K, NB, BC, GATE,
                              HAS_A_LOG, HAS_DT_BIAS), 1)
        P, to_end, later, G_last, alpha, after, slow, m0, m1, m2, m3 = block_gates(L3, NB, BC)
        slow_slices += slow

        q3 = load_tile(Q, rows, ok, cols, col_ok, H * K, NB, BC)
        k3 = load_tile(Kt, rows, ok, cols, col_ok, H * K, NB, BC)
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
                tail = tail_sums(channel_gates(G_in, A_log, Dt_bias, rows, ok, m, hv, cols, col_ok, lower_bound, HV, K, NB,
                                         BC, GATE, HAS_A_LOG, HAS_DT_BIAS), BC)
                key_exp = tail - after[:, None, :]
                kd_exp = tail + later[:, None, :]
        # What the recurrence reads, every factor <= 1 (one that underflows stands for a decay that
        # underflows too): qg = q 2^G, kd = k 2^(G_last - G), decay = 2^G_last; and x = beta 2^G k. Each
        # exponent is a sum over its own span, or a difference within one block (above).
        start_decay = tl.exp2(P)[:, None, :]
        store_tile(QG, qe * start_decay, rows, ok, cols, col_ok, HV * K)
        store_tile(KD, k3 * tl.exp2(kd_exp), rows, ok, cols, col_ok, HV * K)
        store_tile(W, ke * beta3 * start_decay, rows, ok, cols, col_ok, HV * K)
        first = tl.arange(0, NB)[:, None] == 0  # (every warp holds G_last; one writes it)
        tl.store(DECAY + cols[None, :] + 0 * tl.arange(0, NB)[:, None], tl.exp2(G_last), mask=first & col_ok[None, :])
        if SAVE_G:
            store_tile(G_OUT, L3 + P[:, None, :], rows, ok, cols, col_ok, HV * K)
        keys = k3 * tl.exp2(key_exp)  # k 2^(a_own - G)

        key0, key1, key2, key3 = split_blocks(keys, NB, BC, BKC)
        aqk0, akk0 = stripe_products(aqk0, akk0, qe, ke, key0, m0, A_PRECISION, NB, BC, BKC)
        aqk1, akk1 = stripe_products(aqk1, akk1, qe, ke, key1, m1, A_PRECISION, NB, BC, BKC)
        aqk2, akk2 = stripe_products(aqk2, akk2, qe, ke, key2, m2, A_PRECISION, NB, BC, BKC)
        aqk3, akk3 = stripe_products(aqk3, akk3, qe, ke, key3, m3, A_PRECISION, NB, BC, BKC)

    if EXACT_DIAGONAL and tl.max(slow_slices, 0) > 0:
        # Rare (gates near -inf): the exact diagonal blocks of the slow channels, in a second pass that
        # reloads what it needs (nothing of it stays live through the fast loop).
        for k0 in range(0, K, BKC):
            cols = k0 + tl.arange(0, BKC)
            col_ok = cols < K
            m = ok3 & col_ok[None, None, :]
            g, L3 = channel_gate_cumsum(G_in, A_log, Dt_bias, rows, ok, m, hv, cols, col_ok, lower_bound, HV, K, NB, BC,
                                 GATE, HAS_A_LOG, HAS_DT_BIAS)
            slow = -block_sums(L3, BC) > DIAG_RANGE_LIMIT
            if tl.max(tl.max(slow.to(tl.int32), 1), 0) > 0:
                q3 = load_tile(Q, rows, ok, cols, col_ok, H * K, NB, BC) * q_scale3
                k3 = load_tile(Kt, rows, ok, cols, col_ok, H * K, NB, BC) * k_scale3
                d_qk, d_kk = exact_diagonal(q3, k3, g, slow[:, None, :], NB, BC)
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
    return aqk0, aqk1, aqk2, aqk3, akk0, akk1, akk2, akk3


@triton.jit
def block_sums(L3, BC: tl.constexpr):
    """``[NB, BKC]`` gate sums of the blocks: the last row of the block-local cumsum ``L3``."""
    return tl.sum(tl.where(tl.arange(0, BC)[None, :, None] == BC - 1, L3, 0.0), 1)


@triton.jit
def block_gates(L3, NB: tl.constexpr, BC: tl.constexpr):
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
    S = block_sums(L3, BC)
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
def tail_sums(g, BC: tl.constexpr):
    """The gate after each row inside its block, ``sum of g over rows (i, BC)`` ``[NB, BC, BKC]``: a reverse
    cumulative sum of the following rows' own gates. The block's sum minus ``L`` is the same number as a
    difference, which a huge gate at or before row i swamps (both sums carry it); this one never sees it."""
    rows = tl.arange(0, BC)[None, :, None]
    following = tl.gather(g, tl.minimum(rows + 1, BC - 1) + tl.zeros(g.shape, dtype=tl.int32), 1)
    return tl.cumsum(tl.where(rows < BC - 1, following, 0.0), 1, reverse=True)


@triton.jit
def split_blocks(x, NB: tl.constexpr, BC: tl.constexpr, BKC: tl.constexpr):
    """The four ``[BC, BKC]`` blocks of a ``[NB, BC, BKC]`` tile, by two splits (one layout conversion
    of the tile, instead of a cross-lane reduction per block)."""
    x = tl.reshape(tl.permute(x, (1, 2, 0)), [BC, BKC, 2, 2])  # [..., b // 2, b % 2]
    even, odd = tl.split(x)
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def stripe_products(aqk, akk, qe, ke, key, middle, PRECISION: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr,
                    BKC: tl.constexpr):
    """Column stripe s (keys of block s) of ``A_qk`` and ``A_kk`` ``[NB * BC, BC]`` (fp32) plus one K slice's
    products, accumulated in place on the tensor cores. ``qe, ke = q, k * 2^(G - p_own)`` ``[NB, BC, BKC]``,
    ``key = k * 2^(a_s - G)`` of the
    block's 16 keys ``[BC, BKC]``, ``middle = 2^(p_r - a_s)`` ``[NB, BKC]`` (0 for the blocks and
    channels the stripe leaves out; from ``block_gates``).
    Diagonal entries of slow channels are left out (``exact_diagonal`` adds them). The operands are rounded to
    TF32 (``tf32_round``) for every input dtype: truncated (what the tensor cores do to fp32 bits), the biased
    products of ``A_kk`` gave bf16 inputs with nearly collinear keys a final state 1.26x FLA's error from the fp64
    recurrence (docs/kda-kernels.md section 8)."""
    q_op = tl.reshape(qe * middle[:, None, :], [NB * BC, BKC])
    k_op = tl.reshape(ke * middle[:, None, :], [NB * BC, BKC])
    key_t = tl.trans(key)
    q_op, k_op, key_t = tf32_round(q_op), tf32_round(k_op), tf32_round(key_t)
    return (tl.dot(q_op, key_t, aqk, input_precision=PRECISION), tl.dot(k_op, key_t, akk, input_precision=PRECISION))


@triton.jit
def channel_gates(G_in, A_log, Dt_bias, rows, ok, m, hv, cols, col_ok, lower_bound, HV: tl.constexpr,
                  K: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr, GATE: tl.constexpr, HAS_A_LOG: tl.constexpr,
                  HAS_DT_BIAS: tl.constexpr):
    """The floored log2 gates ``[NB, BC, BKC]`` of one K slice (``m`` ``[NB, BC, BKC]``: inside the sequence
    and K; 0 outside)."""
    g = load_tile(G_in, rows, ok, cols, col_ok, HV * K, NB, BC)
    if GATE != GATE_PRECOMPUTED and HAS_DT_BIAS:
        g += tl.load(Dt_bias + hv * K + cols, mask=col_ok, other=0.0).to(tl.float32)[None, None, :]
    return tl.where(m, log2_gate(g, A_log, hv, lower_bound, GATE, HAS_A_LOG), 0.0)


@triton.jit
def channel_gate_cumsum(G_in, A_log, Dt_bias, rows, ok, m, hv, cols, col_ok, lower_bound, HV: tl.constexpr,
                        K: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr, GATE: tl.constexpr, HAS_A_LOG: tl.constexpr,
                        HAS_DT_BIAS: tl.constexpr):
    """The floored log2 gates ``g`` of one K slice and their block-local cumsum ``L`` (G = p_own + L), both
    ``[NB, BC, BKC]`` (``channel_gates``)."""
    g = channel_gates(G_in, A_log, Dt_bias, rows, ok, m, hv, cols, col_ok, lower_bound, HV, K, NB, BC, GATE, HAS_A_LOG,
               HAS_DT_BIAS)
    return g, tl.cumsum(g, 1)


@triton.jit
def exact_diagonal(q3, k3, g, slow, NB: tl.constexpr, BC: tl.constexpr):
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
