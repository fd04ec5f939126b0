"""Triton flash-attention kernels: forward, and backward as dK/dV + dQ passes (FlashAttention-2 style).

Kernels only (no torch.compile, no dispatch); launchers live in ``triton_flash.py``.
One program owns a tile of query rows (forward, dQ) or of keys (dK/dV) and walks the other side in
tiles with an online softmax, so no [Sq, Sk] score matrix exists. Everything the SDPA backends
cannot do is here: softcap (Gemma 2), sliding window with masks, GQA with any layout, d_qk != d_v,
sinks, dropout (Philox, regenerated in the backward from the same seed, which the kernels load from
device memory), fully masked rows, a
float-mask gradient and a gradient through the log-sum-exp.

Conventions shared with ``reference.py``: ``p = Sk - Sq + i`` is the absolute position of query
row ``i`` (bottom-right causal); masked scores are ``-inf``; ``Lse`` holds the scores-only
log-sum-exp (no sink), ``-inf`` for rows with nothing to attend. Exponentials use ``exp2``.
Batch/head offsets are int64 (tensors beyond 2**31 elements); row offsets stay int32.
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # a plain global is rejected by the compiler (not by the interpreter)


@triton.jit
def _tanh(x):
    # tl has no tanh in the interpreter; this form never overflows (|error| ~ 1e-7, absolute).
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _scores(q, k, offs_m, offs_n, mask_base, stride_mm, stride_mn, Sq, Sk, window, scale, softcap,
            IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, MASK_KIND: tl.constexpr,
            HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """Scores of a [BLOCK_M, BLOCK_N] tile.

    Returns (x, s): x = the scaled (and soft-capped) q . k, needed by the softcap backward; s = x
    plus the additive mask, with -inf wherever the key is masked out or out of range.
    MASK_KIND: 0 none, 1 bool (loaded as uint8, nonzero = attend), 2 additive float.
    """
    x = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if HAS_SOFTCAP:
        x = softcap * _tanh(x / softcap)
    in_range = (offs_m[:, None] < Sq) & (offs_n[None, :] < Sk)
    keep = in_range
    if IS_CAUSAL:
        pos = offs_m[:, None] + (Sk - Sq)
        keep = keep & (offs_n[None, :] <= pos)
        if HAS_WINDOW:
            keep = keep & (offs_n[None, :] > pos - window)
    s = x
    if MASK_KIND != 0:
        ptrs = mask_base + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn
        if MASK_KIND == 1:
            keep = keep & (tl.load(ptrs, mask=in_range, other=0) != 0)
        else:
            s = s + tl.load(ptrs, mask=in_range, other=0.0).to(tl.float32)
    s = tl.where(keep, s, float("-inf"))
    return x, s


@triton.jit
def _key_range(start_m, Sq, Sk, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """[lo, hi) of the keys any row of [start_m, start_m + BLOCK_M) may see; lo is tile-aligned."""
    lo = 0
    hi = Sk
    if IS_CAUSAL:
        hi = tl.minimum(Sk, start_m + BLOCK_M + Sk - Sq)
        if HAS_WINDOW:
            lo = tl.maximum(0, start_m + Sk - Sq - window + 1)
            lo = (lo // BLOCK_N) * BLOCK_N
    return lo, hi


@triton.jit
def _dropout_keep(seed, bh, offs_m, offs_n, Sk, dropout_p):
    # One Philox stream per (batch, head); the counter is the flat (row, key) index.
    return tl.rand(seed + bh, offs_m[:, None] * Sk + offs_n[None, :]) >= dropout_p


@triton.jit
def attn_fwd_kernel(
    Q, K, V, Out, Lse, Mask, Sinks,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_mb, stride_mh, stride_mm, stride_mn,
    H, Sq, Sk, group, Dqk, Dv, scale, softcap, window, dropout_p, Seed,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Grid (cdiv(Sq, BLOCK_M), B * H). Writes Out [B, H, Sq, Dv] (any strides) and Lse [B, H, Sq]."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = (h // group).to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Sq

    q = tl.load(Q + b * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qm
                + offs_dq[None, :] * stride_qd, mask=row_ok[:, None] & (offs_dq[None, :] < Dqk), other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    mask_base = Mask + b * stride_mb + h.to(tl.int64) * stride_mh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(Seed)
    lo, hi = _key_range(start_m, Sq, Sk, window, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < Sk
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_dq[None, :] * stride_kd,
                    mask=col_ok[:, None] & (offs_dq[None, :] < Dqk), other=0.0)
        x, s = _scores(q, k, offs_m, offs_n, mask_base, stride_mm, stride_mn, Sq, Sk, window, scale,
                       softcap, IS_CAUSAL, HAS_WINDOW, MASK_KIND, HAS_SOFTCAP, PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with every key masked so far keeps m = -inf; shift by 0 there so no inf - inf appears.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2((m_i - m_use) * LOG2E)
        p = tl.exp2((s - m_use[:, None]) * LOG2E)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            keep = _dropout_keep(seed, bh, offs_m, offs_n, Sk, dropout_p)
            p = tl.where(keep, p / (1.0 - dropout_p), 0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                    mask=col_ok[:, None] & (offs_dv[None, :] < Dv), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
    denom = l_i
    if HAS_SINKS:
        sink = tl.load(Sinks + h).to(tl.float32)
        denom = denom + tl.exp2((sink - m_use) * LOG2E)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    lse = tl.where(l_i > 0, m_use + tl.log(l_i), float("-inf"))
    tl.store(Out + b * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om
             + offs_dv[None, :] * stride_od, out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < Dv))
    tl.store(Lse + bh.to(tl.int64) * Sq + offs_m, lse, mask=row_ok)


@triton.jit
def attn_bwd_delta_kernel(
    Out, dOut, Delta,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_gb, stride_gh, stride_gm, stride_gd,
    H, Sq, Dv, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Delta[b, h, i] = sum_d dOut * Out (float32). Grid (cdiv(Sq, BLOCK_M), B * H)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    ok = (offs_m[:, None] < Sq) & (offs_d[None, :] < Dv)
    o = tl.load(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                mask=ok, other=0.0).to(tl.float32)
    g = tl.load(dOut + b * stride_gb + h * stride_gh + offs_m[:, None] * stride_gm + offs_d[None, :] * stride_gd,
                mask=ok, other=0.0).to(tl.float32)
    tl.store(Delta + bh.to(tl.int64) * Sq + offs_m, tl.sum(o * g, 1), mask=offs_m < Sq)


@triton.jit
def attn_bwd_dq_kernel(
    Q, K, V, dOut, dQ, Lse, RowScale, RowBias, Mask, dMask,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    H, Sq, Sk, group, Dqk, Dv, scale, softcap, window, dropout_p, Seed,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_DMASK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dQ for a tile of query rows. Grid (cdiv(Sq, BLOCK_M), B * H).

    Per row: Lse = scores-only log-sum-exp (+inf where the row attends nothing, so p' = 0),
    RowScale a = fraction of the denominator not taken by the sink, RowBias = g_lse - a * Delta.
    Then ds = p' * (a * dP + RowBias) with p' = exp(s - Lse), which equals p (dP - Delta) + g_lse p'.
    With STORE_DMASK, ds (the gradient of an additive mask) is written to dMask [B, H, Sq, Sk].
    """
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = (h // group).to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Sq

    q = tl.load(Q + b * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qm
                + offs_dq[None, :] * stride_qd, mask=row_ok[:, None] & (offs_dq[None, :] < Dqk), other=0.0)
    do = tl.load(dOut + b * stride_gb + h.to(tl.int64) * stride_gh + offs_m[:, None] * stride_gm
                 + offs_dv[None, :] * stride_gd, mask=row_ok[:, None] & (offs_dv[None, :] < Dv), other=0.0)
    row = bh.to(tl.int64) * Sq + offs_m
    lse = tl.load(Lse + row, mask=row_ok, other=float("inf"))
    rs = tl.load(RowScale + row, mask=row_ok, other=0.0)
    rb = tl.load(RowBias + row, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    mask_base = Mask + b * stride_mb + h.to(tl.int64) * stride_mh

    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(Seed)
    lo, hi = _key_range(start_m, Sq, Sk, window, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < Sk
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_dq[None, :] * stride_kd,
                    mask=col_ok[:, None] & (offs_dq[None, :] < Dqk), other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                    mask=col_ok[:, None] & (offs_dv[None, :] < Dv), other=0.0)
        x, s = _scores(q, k, offs_m, offs_n, mask_base, stride_mm, stride_mn, Sq, Sk, window, scale,
                       softcap, IS_CAUSAL, HAS_WINDOW, MASK_KIND, HAS_SOFTCAP, PRECISION)
        pp = tl.exp2((s - lse[:, None]) * LOG2E)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        if HAS_DROPOUT:
            keep = _dropout_keep(seed, bh, offs_m, offs_n, Sk, dropout_p)
            dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
        ds = pp * (rs[:, None] * dp + rb[:, None])
        if STORE_DMASK:
            tl.store(dMask + bh.to(tl.int64) * Sq * Sk + offs_m[:, None] * Sk + offs_n[None, :], ds,
                     mask=row_ok[:, None] & col_ok[None, :])
        if HAS_SOFTCAP:
            t = x / softcap
            ds = ds * (1.0 - t * t)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    dq = dq * scale
    tl.store(dQ + b * stride_dqb + h.to(tl.int64) * stride_dqh + offs_m[:, None] * stride_dqm
             + offs_dq[None, :] * stride_dqd, dq.to(dQ.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dq[None, :] < Dqk))


@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, V, dOut, dK, dV, Lse, RowScale, RowBias, Mask,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    H, Hkv, Sq, Sk, group, Dqk, Dv, scale, softcap, window, dropout_p, Seed,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
):
    """dK, dV for a tile of keys of one KV head, summed over the query heads of its group.

    Grid (cdiv(Sk, BLOCK_N), B * Hkv). Same row vectors as the dQ kernel.
    """
    pid_n = tl.program_id(0)
    bkv = tl.program_id(1)
    b = (bkv // Hkv).to(tl.int64)
    hk = (bkv % Hkv).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_dq = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < Sk
    k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_kn + offs_dq[None, :] * stride_kd,
                mask=col_ok[:, None] & (offs_dq[None, :] < Dqk), other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                mask=col_ok[:, None] & (offs_dv[None, :] < Dv), other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # Query rows that can see this key tile: causal needs p >= start_n; the window needs
    # p < (last key) + window.
    m_lo = 0
    m_hi = Sq
    if IS_CAUSAL:
        m_lo = tl.maximum(0, start_n - (Sk - Sq))
        m_lo = (m_lo // BLOCK_M) * BLOCK_M
        if HAS_WINDOW:
            m_hi = tl.minimum(Sq, start_n + BLOCK_N - 1 + window - (Sk - Sq))
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(Seed)
    for g in range(0, group):
        h = hk * group + g
        bh = b * H + h
        mask_base = Mask + b * stride_mb + h * stride_mh
        for start_m in range(m_lo, m_hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < Sq
            q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm
                        + offs_dq[None, :] * stride_qd, mask=row_ok[:, None] & (offs_dq[None, :] < Dqk), other=0.0)
            do = tl.load(dOut + b * stride_gb + h * stride_gh + offs_m[:, None] * stride_gm
                         + offs_dv[None, :] * stride_gd, mask=row_ok[:, None] & (offs_dv[None, :] < Dv), other=0.0)
            row = bh * Sq + offs_m
            lse = tl.load(Lse + row, mask=row_ok, other=float("inf"))
            rs = tl.load(RowScale + row, mask=row_ok, other=0.0)
            rb = tl.load(RowBias + row, mask=row_ok, other=0.0)
            x, s = _scores(q, k, offs_m, offs_n, mask_base, stride_mm, stride_mn, Sq, Sk, window, scale,
                           softcap, IS_CAUSAL, HAS_WINDOW, MASK_KIND, HAS_SOFTCAP, PRECISION)
            pp = tl.exp2((s - lse[:, None]) * LOG2E)
            p = pp * rs[:, None]
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            if HAS_DROPOUT:
                keep = _dropout_keep(seed, bh, offs_m, offs_n, Sk, dropout_p)
                p = tl.where(keep, p / (1.0 - dropout_p), 0.0)
                dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            ds = pp * (rs[:, None] * dp + rb[:, None])
            if HAS_SOFTCAP:
                t = x / softcap
                ds = ds * (1.0 - t * t)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    dk = dk * scale
    tl.store(dK + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dkn + offs_dq[None, :] * stride_dkd,
             dk.to(dK.dtype.element_ty), mask=col_ok[:, None] & (offs_dq[None, :] < Dqk))
    tl.store(dV + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd,
             dv.to(dV.dtype.element_ty), mask=col_ok[:, None] & (offs_dv[None, :] < Dv))
