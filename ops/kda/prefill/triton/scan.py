"""Kernel 2 of our fused KDA prefill: the inter-chunk recurrence, plain or as an affine-segment scan.

Triton only (``prefill/run.py`` launches it). Inputs come from the prepare kernel
(``prefill/triton/prepare.py``): ``w, qg, kd`` ``[TT, HV, K]``, ``u`` ``[TT, HV, V]``, ``A_qk``
``[TT, HV, BT]`` and ``decay = 2^G_last`` ``[chunks, HV, K]``. Per chunk, with the fp32 state
``S [K, BV]`` on chip (kda.md section 4)::

    v_new = u - w S
    o     = qg S + A_qk v_new
    S     = diag(decay) S + kd^T v_new

One long sequence with few heads gives ``N * HV * cdiv(V, BV)`` programs: too few to fill the GPU
(kda.md section 8). The state update over a stretch of chunks is affine in the incoming state,
``S_out = M S_in + C``, so each sequence is cut into ``P`` segments of whole chunks:

1. ``kda_segment_summary_kernel``: every segment but the last composes its chunks' ``(M, C)`` in
   parallel. ``X = [M | C]`` ``[K, K + V]`` obeys the same update as the state with ``u = 0`` in the M
   columns, starting from ``[I | 0]``; programs split the K + V columns like value blocks.
2. ``kda_chunk_scan_kernel`` with ``P > 1``: the program of segment p first applies the summaries of
   segments 0..p-1 to the initial state (p small ``K x K`` products, fp32 with ``COMBINE_PRECISION``),
   then runs its own chunks and writes their outputs. Only the last segment writes the final state.
   Without an initial state segment 0's ``M`` is neither computed nor applied (it multiplies zero).

With ``P = 1`` the scan kernel is the plain recurrence (no summaries). The products inside the chunk
loop take the state rounded to the input dtype for bf16 inputs (as FLA does), fp32 operands
(``DOT_PRECISION``) otherwise. No atomics: every output element has one writer, so repeated runs are
bitwise identical.
"""
import triton
import triton.language as tl

from kda_compile.ops.kda.triton_common import dot_operand


@triton.jit
def _sequence(cu_seqlens, chunk_offsets, n, T, IS_VARLEN: tl.constexpr, BT: tl.constexpr):
    """(first token, length, first chunk slot) of sequence ``n``."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + n).to(tl.int64)
        seq_len = tl.load(cu_seqlens + n + 1).to(tl.int64) - bos
        first_chunk = tl.load(chunk_offsets + n).to(tl.int64)
    else:
        bos = n.to(tl.int64) * T
        seq_len = bos * 0 + T
        first_chunk = n.to(tl.int64) * tl.cdiv(T, BT)
    return bos, seq_len, first_chunk


@triton.jit
def _segment(seq_len, p, P, BT: tl.constexpr):
    """Chunks ``[c0, c1)`` of segment ``p`` out of ``P`` (equal shares, the last ones may be empty)."""
    chunks = tl.cdiv(seq_len, BT)
    per = tl.cdiv(chunks, P)
    c0 = tl.minimum(p * per, chunks)
    c1 = tl.minimum(c0 + per, chunks)
    return c0, c1


@triton.jit
def _chunk_tiles(W, KD, DECAY, tok, rows_ok, last_tok, hv, slot, kcols, HV: tl.constexpr, K: tl.constexpr,
                 GATE_CUMSUM: tl.constexpr):
    """``w`` ``[BT, BK]``, ``kd`` transposed ``[BK, BT]`` and ``decay`` ``[BK]`` of one chunk.

    ``decay`` is read from ``DECAY [chunks, HV, K]`` (our prepare kernel), or with ``GATE_CUMSUM`` is
    ``2^G`` of the chunk's last token ``last_tok`` in FLA's chunk-local gate cumsum ``DECAY [TT, HV, K]``.

    ``kd`` is loaded in the transposed layout its product takes (``kd^T v_new``), as FLA does, instead
    of a ``tl.trans`` of a ``[BT, BK]`` tile. Both take the same time and are
    equally right or wrong per launch config: the bf16 errors came from the config, ``_scan_configs``."""
    kok = kcols < K
    ok = rows_ok[:, None] & kok[None, :]
    offs = (tok * HV + hv)[:, None] * K + kcols[None, :]
    w = tl.load(W + offs, mask=ok, other=0.0)
    kd_t = tl.load(KD + kcols[:, None] + (tok * HV + hv)[None, :] * K, mask=kok[:, None] & rows_ok[None, :],
                   other=0.0)
    if GATE_CUMSUM:
        decay = tl.exp2(tl.load(DECAY + (last_tok * HV + hv) * K + kcols, mask=kok, other=0.0))
    else:
        decay = tl.load(DECAY + (slot * HV + hv) * K + kcols, mask=kok, other=0.0)
    return w, kd_t, decay


@triton.jit(do_not_specialize=["T", "P"])
def kda_segment_summary_kernel(
    W, U, KD, DECAY, SUMMARY, cu_seqlens, chunk_offsets,
    T, P,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BX: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GATE_CUMSUM: tl.constexpr = False, SKIP_FIRST_M: tl.constexpr = False,
):
    """``SUMMARY[n * P + p, hv] = [M | C]`` ``[K, K + V]`` fp32 of segment p (< P - 1) of sequence n.

    Grid ``(cdiv(K + V, BX) * HV * N * (P - 1),)``: column block fastest, then head, then segment.
    ``SKIP_FIRST_M`` (no initial state: segment 0 starts from zero, so its ``M`` multiplies nothing):
    segment 0's column blocks that hold only ``M`` columns exit at once and leave them unwritten.
    """
    pid = tl.program_id(0)
    num_x = tl.cdiv(K + V, BX)
    ix = pid % num_x
    rest = pid // num_x
    hv = rest % HV
    rest = rest // HV
    p = rest % (P - 1)
    n = rest // (P - 1)
    if SKIP_FIRST_M and p == 0 and (ix + 1) * BX <= K:
        return
    bos, seq_len, first_chunk = _sequence(cu_seqlens, chunk_offsets, n, T, IS_VARLEN, BT)
    c0, c1 = _segment(seq_len, p, P, BT)

    kcols = tl.arange(0, BK)
    xcols = ix * BX + tl.arange(0, BX)  # columns of [M | C]: < K is M, >= K is C
    ucols = xcols - K
    uok = (xcols >= K) & (ucols < V)
    X = tl.where(kcols[:, None] == xcols[None, :], 1.0, 0.0)  # [I | 0]
    rows = tl.arange(0, BT)
    for c in range(c0, c1):
        tok = bos + c * BT + rows
        rows_ok = c * BT + rows < seq_len
        last_tok = bos + tl.minimum(seq_len, c * BT + BT) - 1
        w, kd_t, decay = _chunk_tiles(W, KD, DECAY, tok, rows_ok, last_tok, hv, first_chunk + c, kcols, HV, K,
                                      GATE_CUMSUM)
        u = tl.load(U + (tok * HV + hv)[:, None] * V + ucols[None, :], mask=rows_ok[:, None] & uok[None, :],
                    other=0.0).to(tl.float32)
        v_new = u - tl.dot(dot_operand(w, DOT_BF16), dot_operand(X, DOT_BF16), input_precision=DOT_PRECISION)
        X = X * decay[:, None] + tl.dot(dot_operand(kd_t, DOT_BF16), dot_operand(v_new, DOT_BF16),
                                        input_precision=DOT_PRECISION)
    base = SUMMARY + ((n * P + p).to(tl.int64) * HV + hv) * K * (K + V)
    tl.store(base + kcols[:, None] * (K + V) + xcols[None, :], X,
             mask=(kcols < K)[:, None] & (xcols < K + V)[None, :])


@triton.jit(do_not_specialize=["T", "P"])
def kda_chunk_scan_kernel(
    W, U, QG, KD, AQK, DECAY, O, H0, HT, SUMMARY, SCRATCH, cu_seqlens, chunk_offsets,
    T, P, stride_h0_n, stride_h0_h, stride_h0_k, stride_h0_v,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, BKM: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr,
    STORE_HT: tl.constexpr, DOT_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr,
    COMBINE_PRECISION: tl.constexpr,
    H_STATES=None, V_NEW=None, scale=1.0, GATE_CUMSUM: tl.constexpr = False,
    STORE_O: tl.constexpr = True, STORE_STATES: tl.constexpr = False,
):
    """``o`` ``[TT, HV, V]`` for the chunks of segment p of sequence n; the last segment stores the
    final state ``HT [N, HV, K, V]``. Grid ``(cdiv(V, BV) * HV * N * P,)``: value block fastest (the
    programs of one head read the same ``w / qg / kd`` tiles), then head, then segment.

    Inputs in FLA 0.6's formats (``GATE_CUMSUM``): ``QG`` is FLA's unscaled ``q 2^G`` and ``DECAY`` the
    chunk-local gate cumsum ``[TT, HV, K]`` fp32 (log2 units), whose last row per chunk gives ``decay``;
    the inter-chunk product is scaled by ``scale`` (``A_qk`` is already scaled), as FLA's output kernel
    does. ``STORE_STATES`` also writes the state at
    the start of every chunk, ``H_STATES [chunk slots, HV, K, V]`` (FLA's ``h``), and ``v_new``
    ``V_NEW [TT, HV, V]``; ``STORE_O = False`` skips ``o`` (FLA's backward only needs the states)."""
    pid = tl.program_id(0)
    num_v = tl.cdiv(V, BV)
    iv = pid % num_v
    rest = pid // num_v
    hv = rest % HV
    rest = rest // HV
    p = rest % P
    n = rest // P
    bos, seq_len, first_chunk = _sequence(cu_seqlens, chunk_offsets, n, T, IS_VARLEN, BT)
    c0, c1 = _segment(seq_len, p, P, BT)

    kcols = tl.arange(0, BK)
    vcols = iv * BV + tl.arange(0, BV)
    kok = kcols < K
    vok = vcols < V
    state_ok = kok[:, None] & vok[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(H0 + n.to(tl.int64) * stride_h0_n + hv * stride_h0_h + kcols[:, None] * stride_h0_k
                     + vcols[None, :] * stride_h0_v, mask=state_ok, other=0.0).to(tl.float32)

    # Segments before this one: S <- M_s S + C_s. S passes through this program's scratch tile so
    # that M can be read in column slices (a full [K, K] fp32 operand would not fit in registers).
    # Without an initial state S is zero entering segment 0's summary: S <- C_0, and M_0 (left unwritten
    # by the summary kernel's SKIP_FIRST_M) is never read.
    scratch = SCRATCH + pid.to(tl.int64) * BK * BV + kcols[:, None] * BV + tl.arange(0, BV)[None, :]
    for s in range(0, p):
        summary = SUMMARY + ((n * P + s).to(tl.int64) * HV + hv) * K * (K + V)
        tl.store(scratch, S)
        tl.debug_barrier()
        acc = tl.load(summary + kcols[:, None] * (K + V) + K + vcols[None, :], mask=state_ok, other=0.0)
        m_end = BK
        if not HAS_H0:
            m_end = tl.where(s == 0, 0, BK)
        for m0 in range(0, m_end, BKM):
            mcols = m0 + tl.arange(0, BKM)
            m = tl.load(summary + kcols[:, None] * (K + V) + mcols[None, :],
                        mask=kok[:, None] & (mcols < K)[None, :], other=0.0)
            part = tl.load(SCRATCH + pid.to(tl.int64) * BK * BV + mcols[:, None] * BV + tl.arange(0, BV)[None, :])
            acc += tl.dot(m, part, input_precision=COMBINE_PRECISION)
        tl.debug_barrier()  # every thread has read the scratch tile before the next store
        S = acc

    rows = tl.arange(0, BT)
    for c in range(c0, c1):
        tok = bos + c * BT + rows
        rows_ok = c * BT + rows < seq_len
        last_tok = bos + tl.minimum(seq_len, c * BT + BT) - 1
        w, kd_t, decay = _chunk_tiles(W, KD, DECAY, tok, rows_ok, last_tok, hv, first_chunk + c, kcols, HV, K,
                                      GATE_CUMSUM)
        if STORE_O:
            qk_ok = rows_ok[:, None] & kok[None, :]
            qg = tl.load(QG + (tok * HV + hv)[:, None] * K + kcols[None, :], mask=qk_ok, other=0.0)
            a_qk = tl.load(AQK + (tok * HV + hv)[:, None] * BT + rows[None, :], mask=rows_ok[:, None], other=0.0)
            if GATE_CUMSUM:  # FLA leaves A_qk's upper triangles unwritten
                a_qk = tl.where(rows[:, None] >= rows[None, :], a_qk, 0.0)
        u = tl.load(U + (tok * HV + hv)[:, None] * V + vcols[None, :], mask=rows_ok[:, None] & vok[None, :],
                    other=0.0).to(tl.float32)
        if STORE_STATES:  # FLA's h: the state the chunk starts from
            tl.store(H_STATES + (((first_chunk + c) * HV + hv) * K + kcols[:, None]) * V + vcols[None, :],
                     S.to(H_STATES.dtype.element_ty), mask=state_ok)
        S_op = dot_operand(S, DOT_BF16)
        v_new = u - tl.dot(dot_operand(w, DOT_BF16), S_op, input_precision=DOT_PRECISION)
        v_op = dot_operand(v_new, DOT_BF16)
        if STORE_STATES:
            tl.store(V_NEW + (tok * HV + hv)[:, None] * V + vcols[None, :], v_new.to(V_NEW.dtype.element_ty),
                     mask=rows_ok[:, None] & vok[None, :])
        if STORE_O:
            o = tl.dot(dot_operand(qg, DOT_BF16), S_op, input_precision=DOT_PRECISION)
            if GATE_CUMSUM:
                o *= scale
            o += tl.dot(dot_operand(a_qk, DOT_BF16), v_op, input_precision=DOT_PRECISION)
            tl.store(O + (tok * HV + hv)[:, None] * V + vcols[None, :], o.to(O.dtype.element_ty),
                     mask=rows_ok[:, None] & vok[None, :])
        S = S * decay[:, None] + tl.dot(dot_operand(kd_t, DOT_BF16), v_op, input_precision=DOT_PRECISION)

    if STORE_HT:
        if p == P - 1:
            tl.store(HT + ((n.to(tl.int64) * HV + hv) * K + kcols[:, None]) * V + vcols[None, :], S, mask=state_ok)
