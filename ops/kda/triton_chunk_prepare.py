"""Kernel 1 of our fused KDA prefill: the chunk-parallel "prepare" pass (kda.md sections 4 and 5).

Triton only: nothing here knows of torch.compile, custom ops or backends (``triton_chunk.py`` launches
it). One program owns one chunk of ``BT = 64`` tokens of one value head, split into four 16-row
sub-blocks, and does everything that needs no recurrent state:

    q, k  <- l2norm(q), l2norm(k)                       (optional; eps inside the sqrt), q *= scale
    g     <- gate(g) in log2 units                      (precomputed, softplus or lower-bound form)
    G     <- cumsum(g) inside the chunk, fp32
    beta  <- sigmoid(beta) (x2 with negative eigenvalues) (optional)
    A_qk[i, j] = sum_d q_i k_j 2^(G_i - G_j)            j <= i
    A_kk[i, j] = beta_i sum_d k_i k_j 2^(G_i - G_j)      j <  i
    T    = (I + A_kk)^-1                                (forward substitution on chip, fp32)
    w = T (beta 2^G k),  u = T (beta v),  qg = q 2^G,  kd = k 2^(G_last - G),  decay = 2^G_last

and writes ``w, u, qg, kd, A_qk`` (input dtype) and ``decay`` (fp32) for the recurrence kernel
(``triton_chunk_scan.py``). When asked, it also writes what FLA's backward needs, in FLA 0.6's
formats: ``T`` (``Akk``, unit lower triangular, k's dtype) and the chunk-local ``G`` (fp32, log2 units).

Numerics:
- ``2^(G_i - G_j)`` is never formed for ``j > i`` (it overflows). Off-diagonal 16 x 16 blocks (row
  block r, column block s < r) factor it as ``2^(G_i - n_r) * 2^(n_r - c_s) * 2^(c_s - G_j)`` with
  ``n_r`` the first row of block r and ``c_s`` the last row of block s: every factor <= 1, and the
  row factors ``2^(G - n)``, ``2^(c - G)`` of each block also give ``qg`` and ``kd`` (one exp2 per
  element and factor instead of one per element and block pair). A diagonal block uses the anchor
  ``n_r - ANCHOR_SHIFT`` when the block's decay range (per K slice) is at most ``DIAG_RANGE_LIMIT``
  (then every factor is a finite fp32 number and no kept product loses more than 2^-26 of |q||k| to
  underflow); otherwise (very negative gates) it computes the exact element-wise sum column by column.
  Anchors come from a block's first row, so no rounding depends on later tokens' gates except through
  the choice between the two diagonal paths.
- Gates are floored at ``GATE_FLOOR`` (log2 units): any span containing such a step decays by less
  than 2^-150, which is 0 in fp32 either way; the floor keeps ``-inf`` gates from producing NaN and
  keeps the cumulative sums small.
- The triangular inverse: forward substitution on each 16 x 16 diagonal block, then block merges in
  fp32 (``SOLVE_PRECISION``); never a Neumann series (NaN on 16 identical keys, kda.md section 5).

Layouts: q, k ``[TT, H, K]``; v ``[TT, HV, V]``; g ``[TT, HV, K]``; beta ``[TT, HV]`` (TT = B * T packed
tokens, contiguous). Outputs ``w, qg, kd`` ``[TT, HV, K]``, ``u`` ``[TT, HV, V]``, ``A_qk`` and ``Akk``
``[TT, HV, BT]`` (row t holds its chunk's row; zeros above the diagonal), ``G`` ``[TT, HV, K]``,
``decay`` ``[chunks, HV, K]``.
"""
import triton
import triton.language as tl

# Plain globals are rejected by the compiler (not by the interpreter): constexpr.
LOG2E = tl.constexpr(1.4426950408889634)
L2NORM_EPS = tl.constexpr(1e-6)
GATE_FLOOR = tl.constexpr(-150.0)  # log2 units: 2^-150 rounds to 0 in fp32
ANCHOR_SHIFT = tl.constexpr(30.0)  # diagonal blocks: query factors <= 2^30, key factors <= 2^(range - 30)
DIAG_RANGE_LIMIT = tl.constexpr(130.0)  # beyond it, the exact element-wise diagonal

GATE_PRECOMPUTED = tl.constexpr(0)
GATE_SOFTPLUS = tl.constexpr(1)
GATE_LOWER_BOUND = tl.constexpr(2)


@triton.jit
def _row(x, i, BC: tl.constexpr):
    """Row ``i`` of a ``[BC, D]`` tile as a ``[D]`` vector (exact: the other rows add zeros)."""
    rows = tl.arange(0, BC)
    return tl.sum(tl.where(rows[:, None] == i, x, 0.0), 0)


@triton.jit
def _log2_gate(G_in, A_log, Dt_bias, tok, row_ok, hv, cols, col_ok, lower_bound,
               HV: tl.constexpr, K: tl.constexpr, GATE: tl.constexpr, HAS_A_LOG: tl.constexpr,
               HAS_DT_BIAS: tl.constexpr):
    """The log2 decay of a ``[BC, BKC]`` tile: 0 outside the sequence and past K (no decay there)."""
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(G_in + (tok * HV + hv)[:, None] * K + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if GATE != GATE_PRECOMPUTED:
        if HAS_DT_BIAS:
            x += tl.load(Dt_bias + hv * K + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATE == GATE_SOFTPLUS:
            # -exp(A_log) * softplus(x), softplus = x above 20 (as HF and torch), else log1p(exp(x)) with
            # the log1p that keeps full relative precision for tiny exp(x): log(u) * y / (u - 1).
            a = tl.exp(tl.load(A_log + hv).to(tl.float32))
            y = tl.exp(tl.minimum(x, 20.0))
            u = 1.0 + y
            log1p = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
            x = -a * tl.where(x > 20.0, x, log1p)
        else:
            if HAS_A_LOG:
                x = tl.exp(tl.load(A_log + hv).to(tl.float32)) * x
            x = lower_bound * tl.sigmoid(x)
    x = tl.maximum(x * LOG2E, GATE_FLOOR)
    return tl.where(ok, x, 0.0)


@triton.jit
def _rstd(X, tok, row_ok, head, L2NORM: tl.constexpr, NH: tl.constexpr, K: tl.constexpr,
          BKC: tl.constexpr, BC: tl.constexpr):
    """``1 / sqrt(sum(x^2) + eps)`` per row of a 16-row block (ones without the L2 norm)."""
    acc = tl.zeros([BC], dtype=tl.float32)
    if L2NORM:
        for k0 in range(0, K, BKC):
            cols = k0 + tl.arange(0, BKC)
            x = tl.load(X + (tok * NH + head)[:, None] * K + cols[None, :],
                        mask=row_ok[:, None] & (cols < K)[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(x * x, 1)
        acc = 1.0 / tl.sqrt(acc + L2NORM_EPS)
    else:
        acc += 1.0
    return acc


@triton.jit
def _load_rows(X, tok, row_ok, head, cols, col_ok, row_scale, NH: tl.constexpr, D: tl.constexpr):
    """A ``[BC, BD]`` fp32 tile of ``X [TT, NH, D]`` with each row multiplied by ``row_scale``."""
    x = tl.load(X + (tok * NH + head)[:, None] * D + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    return x * row_scale[:, None]


@triton.jit
def _store_rows(X, tok, row_ok, head, cols, col_ok, value, NH: tl.constexpr, D: tl.constexpr):
    tl.store(X + (tok * NH + head)[:, None] * D + cols[None, :], value.to(X.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _dot_nt(a, b, PRECISION: tl.constexpr):
    """``a @ b^T`` for fp32 ``[BC, BKC]`` tiles, fp32 accumulation."""
    return tl.dot(a, tl.trans(b), input_precision=PRECISION)


@triton.jit
def _block_factors(G, BC: tl.constexpr):
    """One 16-row block's first and last cumulative-gate rows ``n`` and ``c`` ``[BKC]``, and the row
    factors ``e = 2^(G - n)`` and ``f = 2^(c - G)`` ``[BC, BKC]`` (both <= 1) that every decay of the
    chunk is built from, times per-channel vectors: one exp2 per element and factor."""
    n = _row(G, 0, BC)
    c = _row(G, BC - 1, BC)
    return n, c, tl.exp2(G - n[None, :]), tl.exp2(c[None, :] - G)


@triton.jit
def _diag_block(q, k, qe, ke, G, n, acc_qk, acc_kk, PRECISION: tl.constexpr, BC: tl.constexpr):
    """Add one K slice of the diagonal block sums ``sum_d q_i k_j 2^(G_i - G_j)`` (and k_i k_j) to the
    accumulators; ``qe, ke = q, k * 2^(G - n)``. Entries above the diagonal are garbage (masked by the
    caller)."""
    rows = tl.arange(0, BC)
    spread = tl.max(tl.max(n[None, :] - G, 1), 0)
    if spread <= DIAG_RANGE_LIMIT:
        # anchor n - ANCHOR_SHIFT: query factors 2^(G - n) * 2^SHIFT, key factors 2^(n - G - SHIFT)
        kt = k * tl.exp2(n[None, :] - G - ANCHOR_SHIFT)
        acc_qk += _dot_nt(qe * tl.exp2(ANCHOR_SHIFT), kt, PRECISION)
        acc_kk += _dot_nt(ke * tl.exp2(ANCHOR_SHIFT), kt, PRECISION)
    else:
        # Exact: for each column j, 2^(G_i - G_j) only where i >= j (masked to -inf before exp2).
        for j in range(0, BC):
            kj = _row(k, j, BC)
            Gj = _row(G, j, BC)
            decay = tl.exp2(tl.where(rows[:, None] >= j, G - Gj[None, :], float("-inf")))
            kjd = decay * kj[None, :]
            col = rows[None, :] == j
            acc_qk += tl.where(col, tl.sum(q * kjd, 1)[:, None], 0.0)
            acc_kk += tl.where(col, tl.sum(k * kjd, 1)[:, None], 0.0)
    return acc_qk, acc_kk


@triton.jit
def _unit_lower_inverse(L, BC: tl.constexpr):
    """``(I + L)^-1`` for a strictly lower-triangular ``[BC, BC]`` fp32 tile, by forward substitution:
    row i of ``X = inverse - I`` is ``a + a X`` with ``a = -L[i, :]`` (rows < i of X are final)."""
    rows = tl.arange(0, BC)[:, None]
    X = -L
    for i in range(2, BC):  # rows 0 and 1 of -L are already final
        pick = rows == i
        a = tl.sum(tl.where(pick, -L, 0.0), 0)
        X = tl.where(pick, (a + tl.sum(a[:, None] * X, 0))[None, :], X)
    return X + tl.where(rows == tl.arange(0, BC)[None, :], 1.0, 0.0)


@triton.jit
def _mm(a, b, PRECISION: tl.constexpr):
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _apply_lower(T00, T10, T11, T20, T21, T22, T30, T31, T32, T33, x0, x1, x2, x3,
                 DOT_BF16: tl.constexpr, PRECISION: tl.constexpr):
    """``T @ x`` for a block lower-triangular ``T`` (4 x 4 blocks of 16 x 16) and four ``[16, D]`` tiles."""
    if DOT_BF16:
        T00, T10, T11 = T00.to(tl.bfloat16), T10.to(tl.bfloat16), T11.to(tl.bfloat16)
        T20, T21, T22 = T20.to(tl.bfloat16), T21.to(tl.bfloat16), T22.to(tl.bfloat16)
        T30, T31, T32, T33 = T30.to(tl.bfloat16), T31.to(tl.bfloat16), T32.to(tl.bfloat16), T33.to(tl.bfloat16)
        x0, x1, x2, x3 = x0.to(tl.bfloat16), x1.to(tl.bfloat16), x2.to(tl.bfloat16), x3.to(tl.bfloat16)
    y0 = _mm(T00, x0, PRECISION)
    y1 = _mm(T10, x0, PRECISION) + _mm(T11, x1, PRECISION)
    y2 = _mm(T20, x0, PRECISION) + _mm(T21, x1, PRECISION) + _mm(T22, x2, PRECISION)
    y3 = _mm(T30, x0, PRECISION) + _mm(T31, x1, PRECISION) + _mm(T32, x2, PRECISION) + _mm(T33, x3, PRECISION)
    return y0, y1, y2, y3


@triton.jit
def _store_block_row(X, tok, row_ok, hv, b0, b1, b2, b3, HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Write one 16-row stripe ``[b0 b1 b2 b3]`` of a ``[BT, BT]`` chunk matrix into ``X [TT, HV, BT]``."""
    cols = tl.arange(0, BC)
    base = X + (tok * HV + hv)[:, None] * BT + cols[None, :]
    ok = row_ok[:, None] & (cols < BC)[None, :]
    tl.store(base, b0.to(X.dtype.element_ty), mask=ok)
    tl.store(base + BC, b1.to(X.dtype.element_ty), mask=ok)
    tl.store(base + 2 * BC, b2.to(X.dtype.element_ty), mask=ok)
    tl.store(base + 3 * BC, b3.to(X.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["T", "N"])
def kda_prepare_kernel(
    Q, Kt, Vt, G_in, Beta, A_log, Dt_bias,
    W, U, QG, KD, AQK, DECAY, AKK, G_OUT,
    cu_seqlens, chunk_offsets,
    T, N, scale, beta_scale, lower_bound,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BKC: tl.constexpr, BVC: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    IS_VARLEN: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_A_LOG: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, BETA_SIGMOID: tl.constexpr, SAVE_AKK: tl.constexpr, SAVE_G: tl.constexpr,
    DOT_BF16: tl.constexpr, A_PRECISION: tl.constexpr, SOLVE_PRECISION: tl.constexpr,
):
    """Grid ``(chunk slots, HV)``. Without varlen, slot = b * cdiv(T, BT) + chunk. With varlen, slots
    number the chunks of all sequences in order (``chunk_offsets[n]`` = first slot of sequence n,
    ``chunk_offsets[N]`` = total); slots past the total exit at once."""
    BT: tl.constexpr = 64
    BC: tl.constexpr = 16
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
    r = tl.arange(0, BC)
    tok0 = bos + start + r
    tok1 = tok0 + BC
    tok2 = tok0 + 2 * BC
    tok3 = tok0 + 3 * BC
    ok0 = start + r < seq_len
    ok1 = start + BC + r < seq_len
    ok2 = start + 2 * BC + r < seq_len
    ok3 = start + 3 * BC + r < seq_len

    # ---- row statistics: L2 norms and beta ------------------------------------------------------
    rq0 = _rstd(Q, tok0, ok0, h, L2NORM, H, K, BKC, BC) * scale
    rq1 = _rstd(Q, tok1, ok1, h, L2NORM, H, K, BKC, BC) * scale
    rq2 = _rstd(Q, tok2, ok2, h, L2NORM, H, K, BKC, BC) * scale
    rq3 = _rstd(Q, tok3, ok3, h, L2NORM, H, K, BKC, BC) * scale
    rk0 = _rstd(Kt, tok0, ok0, h, L2NORM, H, K, BKC, BC)
    rk1 = _rstd(Kt, tok1, ok1, h, L2NORM, H, K, BKC, BC)
    rk2 = _rstd(Kt, tok2, ok2, h, L2NORM, H, K, BKC, BC)
    rk3 = _rstd(Kt, tok3, ok3, h, L2NORM, H, K, BKC, BC)
    b0 = tl.load(Beta + tok0 * HV + hv, mask=ok0, other=0.0).to(tl.float32)
    b1 = tl.load(Beta + tok1 * HV + hv, mask=ok1, other=0.0).to(tl.float32)
    b2 = tl.load(Beta + tok2 * HV + hv, mask=ok2, other=0.0).to(tl.float32)
    b3 = tl.load(Beta + tok3 * HV + hv, mask=ok3, other=0.0).to(tl.float32)
    if BETA_SIGMOID:
        b0 = tl.where(ok0, tl.sigmoid(b0) * beta_scale, 0.0)
        b1 = tl.where(ok1, tl.sigmoid(b1) * beta_scale, 0.0)
        b2 = tl.where(ok2, tl.sigmoid(b2) * beta_scale, 0.0)
        b3 = tl.where(ok3, tl.sigmoid(b3) * beta_scale, 0.0)

    # ---- pass 1, per K slice: gates, cumsum, qg / kd / decay, and the A blocks ----------------------
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    qk00, qk10, qk11, qk20, qk21, qk22 = zero, zero, zero, zero, zero, zero
    qk30, qk31, qk32, qk33 = zero, zero, zero, zero
    kk00, kk10, kk11, kk20, kk21, kk22 = zero, zero, zero, zero, zero, zero
    kk30, kk31, kk32, kk33 = zero, zero, zero, zero
    for k0 in range(0, K, BKC):
        cols = k0 + tl.arange(0, BKC)
        cok = cols < K
        G0 = tl.cumsum(_log2_gate(G_in, A_log, Dt_bias, tok0, ok0, hv, cols, cok, lower_bound,
                                  HV, K, GATE, HAS_A_LOG, HAS_DT_BIAS), 0)
        n0, c0, e0, f0 = _block_factors(G0, BC)
        G1 = tl.cumsum(_log2_gate(G_in, A_log, Dt_bias, tok1, ok1, hv, cols, cok, lower_bound,
                                  HV, K, GATE, HAS_A_LOG, HAS_DT_BIAS), 0) + c0[None, :]
        n1, c1, e1, f1 = _block_factors(G1, BC)
        G2 = tl.cumsum(_log2_gate(G_in, A_log, Dt_bias, tok2, ok2, hv, cols, cok, lower_bound,
                                  HV, K, GATE, HAS_A_LOG, HAS_DT_BIAS), 0) + c1[None, :]
        n2, c2, e2, f2 = _block_factors(G2, BC)
        G3 = tl.cumsum(_log2_gate(G_in, A_log, Dt_bias, tok3, ok3, hv, cols, cok, lower_bound,
                                  HV, K, GATE, HAS_A_LOG, HAS_DT_BIAS), 0) + c2[None, :]
        n3, c3, e3, f3 = _block_factors(G3, BC)
        q0 = _load_rows(Q, tok0, ok0, h, cols, cok, rq0, H, K)
        q1 = _load_rows(Q, tok1, ok1, h, cols, cok, rq1, H, K)
        q2 = _load_rows(Q, tok2, ok2, h, cols, cok, rq2, H, K)
        q3 = _load_rows(Q, tok3, ok3, h, cols, cok, rq3, H, K)
        k0_ = _load_rows(Kt, tok0, ok0, h, cols, cok, rk0, H, K)
        k1_ = _load_rows(Kt, tok1, ok1, h, cols, cok, rk1, H, K)
        k2_ = _load_rows(Kt, tok2, ok2, h, cols, cok, rk2, H, K)
        k3_ = _load_rows(Kt, tok3, ok3, h, cols, cok, rk3, H, K)
        qe0, qe1, qe2, qe3 = q0 * e0, q1 * e1, q2 * e2, q3 * e3
        ke0, ke1, ke2, ke3 = k0_ * e0, k1_ * e1, k2_ * e2, k3_ * e3
        kf0, kf1, kf2, kf3 = k0_ * f0, k1_ * f1, k2_ * f2, k3_ * f3

        # What the recurrence reads: qg = q 2^G, kd = k 2^(G_last - G), decay = 2^G_last. G <= 0 inside
        # a chunk and G_last <= G, so every factor is <= 1 and one that underflows stands for a decay
        # that underflows too.
        _store_rows(QG, tok0, ok0, hv, cols, cok, qe0 * tl.exp2(n0)[None, :], HV, K)
        _store_rows(QG, tok1, ok1, hv, cols, cok, qe1 * tl.exp2(n1)[None, :], HV, K)
        _store_rows(QG, tok2, ok2, hv, cols, cok, qe2 * tl.exp2(n2)[None, :], HV, K)
        _store_rows(QG, tok3, ok3, hv, cols, cok, qe3 * tl.exp2(n3)[None, :], HV, K)
        _store_rows(KD, tok0, ok0, hv, cols, cok, kf0 * tl.exp2(c3 - c0)[None, :], HV, K)
        _store_rows(KD, tok1, ok1, hv, cols, cok, kf1 * tl.exp2(c3 - c1)[None, :], HV, K)
        _store_rows(KD, tok2, ok2, hv, cols, cok, kf2 * tl.exp2(c3 - c2)[None, :], HV, K)
        _store_rows(KD, tok3, ok3, hv, cols, cok, kf3, HV, K)
        tl.store(DECAY + (slot.to(tl.int64) * HV + hv) * K + cols, tl.exp2(c3), mask=cok)
        if SAVE_G:
            _store_rows(G_OUT, tok0, ok0, hv, cols, cok, G0, HV, K)
            _store_rows(G_OUT, tok1, ok1, hv, cols, cok, G1, HV, K)
            _store_rows(G_OUT, tok2, ok2, hv, cols, cok, G2, HV, K)
            _store_rows(G_OUT, tok3, ok3, hv, cols, cok, G3, HV, K)

        # Off-diagonal blocks (row block r, column block s < r):
        # 2^(G_i - G_j) = 2^(G_i - n_r) * 2^(n_r - c_s) * 2^(c_s - G_j), every factor <= 1.
        kt = kf0 * tl.exp2(n1 - c0)[None, :]
        qk10 += _dot_nt(qe1, kt, A_PRECISION)
        kk10 += _dot_nt(ke1, kt, A_PRECISION)
        kt = kf0 * tl.exp2(n2 - c0)[None, :]
        qk20 += _dot_nt(qe2, kt, A_PRECISION)
        kk20 += _dot_nt(ke2, kt, A_PRECISION)
        kt = kf1 * tl.exp2(n2 - c1)[None, :]
        qk21 += _dot_nt(qe2, kt, A_PRECISION)
        kk21 += _dot_nt(ke2, kt, A_PRECISION)
        kt = kf0 * tl.exp2(n3 - c0)[None, :]
        qk30 += _dot_nt(qe3, kt, A_PRECISION)
        kk30 += _dot_nt(ke3, kt, A_PRECISION)
        kt = kf1 * tl.exp2(n3 - c1)[None, :]
        qk31 += _dot_nt(qe3, kt, A_PRECISION)
        kk31 += _dot_nt(ke3, kt, A_PRECISION)
        kt = kf2 * tl.exp2(n3 - c2)[None, :]
        qk32 += _dot_nt(qe3, kt, A_PRECISION)
        kk32 += _dot_nt(ke3, kt, A_PRECISION)
        # Diagonal blocks.
        qk00, kk00 = _diag_block(q0, k0_, qe0, ke0, G0, n0, qk00, kk00, A_PRECISION, BC)
        qk11, kk11 = _diag_block(q1, k1_, qe1, ke1, G1, n1, qk11, kk11, A_PRECISION, BC)
        qk22, kk22 = _diag_block(q2, k2_, qe2, ke2, G2, n2, qk22, kk22, A_PRECISION, BC)
        qk33, kk33 = _diag_block(q3, k3_, qe3, ke3, G3, n3, qk33, kk33, A_PRECISION, BC)

    incl = r[:, None] >= r[None, :]
    strict = r[:, None] > r[None, :]
    qk00 = tl.where(incl, qk00, 0.0)
    qk11 = tl.where(incl, qk11, 0.0)
    qk22 = tl.where(incl, qk22, 0.0)
    qk33 = tl.where(incl, qk33, 0.0)
    _store_block_row(AQK, tok0, ok0, hv, qk00, zero, zero, zero, HV, BT, BC)
    _store_block_row(AQK, tok1, ok1, hv, qk10, qk11, zero, zero, HV, BT, BC)
    _store_block_row(AQK, tok2, ok2, hv, qk20, qk21, qk22, zero, HV, BT, BC)
    _store_block_row(AQK, tok3, ok3, hv, qk30, qk31, qk32, qk33, HV, BT, BC)

    # ---- the unit lower-triangular inverse T = (I + beta A_kk)^-1, block by block ----------------------
    kk00 = tl.where(strict, kk00, 0.0) * b0[:, None]
    kk11 = tl.where(strict, kk11, 0.0) * b1[:, None]
    kk22 = tl.where(strict, kk22, 0.0) * b2[:, None]
    kk33 = tl.where(strict, kk33, 0.0) * b3[:, None]
    kk10 = kk10 * b1[:, None]
    kk20 = kk20 * b2[:, None]
    kk21 = kk21 * b2[:, None]
    kk30 = kk30 * b3[:, None]
    kk31 = kk31 * b3[:, None]
    kk32 = kk32 * b3[:, None]
    T00 = _unit_lower_inverse(kk00, BC)
    T11 = _unit_lower_inverse(kk11, BC)
    T22 = _unit_lower_inverse(kk22, BC)
    T33 = _unit_lower_inverse(kk33, BC)
    # T_ij = -T_ii sum_{j <= m < i} A_im T_mj
    T10 = -_mm(T11, _mm(kk10, T00, SOLVE_PRECISION), SOLVE_PRECISION)
    T21 = -_mm(T22, _mm(kk21, T11, SOLVE_PRECISION), SOLVE_PRECISION)
    T20 = -_mm(T22, _mm(kk20, T00, SOLVE_PRECISION) + _mm(kk21, T10, SOLVE_PRECISION), SOLVE_PRECISION)
    T32 = -_mm(T33, _mm(kk32, T22, SOLVE_PRECISION), SOLVE_PRECISION)
    T31 = -_mm(T33, _mm(kk31, T11, SOLVE_PRECISION) + _mm(kk32, T21, SOLVE_PRECISION), SOLVE_PRECISION)
    T30 = -_mm(T33, _mm(kk30, T00, SOLVE_PRECISION) + _mm(kk31, T10, SOLVE_PRECISION)
               + _mm(kk32, T20, SOLVE_PRECISION), SOLVE_PRECISION)
    if SAVE_AKK:
        _store_block_row(AKK, tok0, ok0, hv, T00, zero, zero, zero, HV, BT, BC)
        _store_block_row(AKK, tok1, ok1, hv, T10, T11, zero, zero, HV, BT, BC)
        _store_block_row(AKK, tok2, ok2, hv, T20, T21, T22, zero, HV, BT, BC)
        _store_block_row(AKK, tok3, ok3, hv, T30, T31, T32, T33, HV, BT, BC)

    # ---- pass 2: w = T (beta 2^G k) per K slice (gates recomputed), u = T (beta v) per V slice --------
    for k0 in range(0, K, BKC):
        cols = k0 + tl.arange(0, BKC)
        cok = cols < K
        G0 = tl.cumsum(_log2_gate(G_in, A_log, Dt_bias, tok0, ok0, hv, cols, cok, lower_bound,
                                  HV, K, GATE, HAS_A_LOG, HAS_DT_BIAS), 0)
        G1 = tl.cumsum(_log2_gate(G_in, A_log, Dt_bias, tok1, ok1, hv, cols, cok, lower_bound,
                                  HV, K, GATE, HAS_A_LOG, HAS_DT_BIAS), 0) + _row(G0, BC - 1, BC)[None, :]
        G2 = tl.cumsum(_log2_gate(G_in, A_log, Dt_bias, tok2, ok2, hv, cols, cok, lower_bound,
                                  HV, K, GATE, HAS_A_LOG, HAS_DT_BIAS), 0) + _row(G1, BC - 1, BC)[None, :]
        G3 = tl.cumsum(_log2_gate(G_in, A_log, Dt_bias, tok3, ok3, hv, cols, cok, lower_bound,
                                  HV, K, GATE, HAS_A_LOG, HAS_DT_BIAS), 0) + _row(G2, BC - 1, BC)[None, :]
        x0 = _load_rows(Kt, tok0, ok0, h, cols, cok, rk0 * b0, H, K) * tl.exp2(G0)
        x1 = _load_rows(Kt, tok1, ok1, h, cols, cok, rk1 * b1, H, K) * tl.exp2(G1)
        x2 = _load_rows(Kt, tok2, ok2, h, cols, cok, rk2 * b2, H, K) * tl.exp2(G2)
        x3 = _load_rows(Kt, tok3, ok3, h, cols, cok, rk3 * b3, H, K) * tl.exp2(G3)
        y0, y1, y2, y3 = _apply_lower(T00, T10, T11, T20, T21, T22, T30, T31, T32, T33, x0, x1, x2, x3,
                                      DOT_BF16, A_PRECISION)
        _store_rows(W, tok0, ok0, hv, cols, cok, y0, HV, K)
        _store_rows(W, tok1, ok1, hv, cols, cok, y1, HV, K)
        _store_rows(W, tok2, ok2, hv, cols, cok, y2, HV, K)
        _store_rows(W, tok3, ok3, hv, cols, cok, y3, HV, K)
    for v0 in range(0, V, BVC):
        cols = v0 + tl.arange(0, BVC)
        cov = cols < V
        x0 = _load_rows(Vt, tok0, ok0, hv, cols, cov, b0, HV, V)
        x1 = _load_rows(Vt, tok1, ok1, hv, cols, cov, b1, HV, V)
        x2 = _load_rows(Vt, tok2, ok2, hv, cols, cov, b2, HV, V)
        x3 = _load_rows(Vt, tok3, ok3, hv, cols, cov, b3, HV, V)
        y0, y1, y2, y3 = _apply_lower(T00, T10, T11, T20, T21, T22, T30, T31, T32, T33, x0, x1, x2, x3,
                                      DOT_BF16, A_PRECISION)
        _store_rows(U, tok0, ok0, hv, cols, cov, y0, HV, V)
        _store_rows(U, tok1, ok1, hv, cols, cov, y1, HV, V)
        _store_rows(U, tok2, ok2, hv, cols, cov, y2, HV, V)
        _store_rows(U, tok3, ok3, hv, cols, cov, y3, HV, V)
