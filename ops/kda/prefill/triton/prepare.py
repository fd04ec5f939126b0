"""Kernel 1 of our fused KDA and GDN prefills: the chunk-parallel "prepare" pass (kda.md sections 4 and 5).

Triton only: nothing here knows of torch.compile, custom ops or backends (``prefill/run.py`` launches
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
(``prefill/triton/scan.py``). When asked, it also writes what FLA's backward needs, in FLA 0.6's
formats: ``T`` (``Akk``, unit lower triangular, k's dtype) and the chunk-local ``G`` (fp32, log2 units).

Pass 1 depends on the gate's form, a compile-time parameter; everything after it (the inverse, pass 2) is shared:

- per-channel gate (KDA, ``prefill/triton/prepare_channel.py``): the decay differs per channel, so it is folded into the
  operands of the ``A`` products through per-block anchors, with an exact-diagonal pass for extreme gates;
- scalar gate per (token, value head) (GDN, ``SCALAR_GATE``, ``prefill/triton/prepare_scalar.py``): the decay between
  two tokens is one number, so ``A_qk`` / ``A_kk`` are the plain ``q k^T`` / ``k k^T`` products scaled by a
  ``[64, 64]`` decay matrix of span sums: exact for any gate, at a cost that does not depend on the data.

Every decay exponent is a sum over its own span, never a difference of cumulative sums (after a huge gate both
sums carry it). Gates are floored at ``GATE_FLOOR`` (log2 units, ``prefill/triton/prepare_gates.py``), the saturating
value of ``-inf``: a reset. The triangular inverse (``prefill/triton/prepare_solve.py``): forward substitution on the
16 x 16 diagonal blocks, then an exact block series on 3xTF32 products; never an element-level Neumann series.
The L2 norms are computed from the loaded tiles when K fits one slice, else in a first pass over K.

Layouts: q, k ``[TT, H, K]``; v ``[TT, HV, V]``; g ``[TT, HV, K]`` (scalar: ``[TT, HV]``); beta ``[TT, HV]``
(TT = B * T packed tokens, contiguous). Outputs ``w, qg, kd`` ``[TT, HV, K]``, ``u`` ``[TT, HV, V]``, ``A_qk`` and
``Akk`` ``[TT, HV, BT]`` (row t holds its chunk's row; zeros above the diagonal), ``G`` ``[TT, HV, K]``,
``decay`` ``[chunks, HV, K]``. ``W`` doubles as scratch: pass 1 stores ``beta 2^G k`` there and pass 2
overwrites it with ``T`` times it (same program, after a barrier).
"""
import triton
import triton.language as tl
from kda_compile.ops.kda.triton_common import dot_operand
from kda_compile.ops.kda.prefill.triton.prepare_channel import (  # noqa: F401
    DIAG_RANGE_LIMIT,
    MAX_BOUNDED_DECAY,
    channel_gate_pass,
    exact_diagonal_needed,
)
from kda_compile.ops.kda.prefill.triton.prepare_gates import GATE_FLOOR  # noqa: F401
from kda_compile.ops.kda.prefill.triton.prepare_scalar import scalar_gate_pass
from kda_compile.ops.kda.prefill.triton.prepare_solve import (
    horner,
    solve_dot,
    split_tf32,
    unit_lower_inverse_blocks,
)
from kda_compile.ops.kda.prefill.triton.prepare_tiles import assemble, load_beta, store_stripe

# (DIAG_RANGE_LIMIT, MAX_BOUNDED_DECAY, exact_diagonal_needed and GATE_FLOOR are read from here by the launchers
# and tests.)


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
    SCALAR_GATE: tl.constexpr = False,
):
    """Grid ``(chunk slots, HV)``. Without varlen, slot = b * cdiv(T, BT) + chunk. With varlen, slots
    number the chunks of all sequences in order (``chunk_offsets[n]`` = first slot of sequence n,
    ``chunk_offsets[N]`` = total); slots past the total exit at once.

    ``BKC``: the K slice of pass 1 (gates, A); ``BWC``: the column slice of pass 2 (w and u).
    ``EXACT_DIAGONAL``: compile the exact-diagonal pass (``exact_diagonal_needed``). ``SCALAR_GATE``: the gate is
    one value per (token, value head), ``g`` ``[TT, HV]`` and ``dt_bias`` ``[HV]`` (GDN; no ``SAVE_G``, no exact
    diagonal)."""
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
    if SCALAR_GATE:  # the gate: [TT, HV] (one per token and value head) or [TT, HV, K]
        G_in += t0 * HV + hv
    else:
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
    beta3 = load_beta(Beta, rows3, ok3, beta_scale, HV, BETA_SIGMOID)  # [NB, BC, 1]
    beta = load_beta(Beta, rows, ok, beta_scale, HV, BETA_SIGMOID)  # [BT]

    # ---- pass 1: gates, qg / kd / decay, x = beta 2^G k (into W), the A stripes, by the gate's form -----
    if SCALAR_GATE:
        aqk0, aqk1, aqk2, aqk3, akk0, akk1, akk2, akk3 = scalar_gate_pass(
            Q, Kt, G_in, A_log, Dt_bias, W, QG, KD, DECAY, rows, ok, beta, hv, scale, lower_bound, H, HV, K, BKC,
            L2NORM, GATE, HAS_A_LOG, HAS_DT_BIAS, DOT_BF16, A_PRECISION)
    else:
        aqk0, aqk1, aqk2, aqk3, akk0, akk1, akk2, akk3 = channel_gate_pass(
            Q, Kt, G_in, A_log, Dt_bias, W, QG, KD, DECAY, G_OUT, rows, ok, rows3, ok3, beta3, hv, scale, lower_bound,
            H, HV, K, BKC, L2NORM, GATE, EXACT_DIAGONAL, HAS_A_LOG, HAS_DT_BIAS, SAVE_G, A_PRECISION)
    block_of_row = rows[:, None] // BC
    zero = tl.zeros([BT, BC], dtype=tl.float32)

    # ---- A_qk, and L = beta A_kk (strictly lower) ------------------------------------------------------
    c16 = tl.arange(0, BC)[None, :]
    r64 = rows[:, None]
    store_stripe(AQK, rows, ok, 0, tl.where(r64 >= c16, aqk0, 0.0), HV, BT, BC)
    store_stripe(AQK, rows, ok, 1, tl.where(r64 >= c16 + BC, aqk1, 0.0), HV, BT, BC)
    store_stripe(AQK, rows, ok, 2, tl.where(r64 >= c16 + 2 * BC, aqk2, 0.0), HV, BT, BC)
    store_stripe(AQK, rows, ok, 3, tl.where(r64 >= c16 + 3 * BC, aqk3, 0.0), HV, BT, BC)
    L0 = tl.where(r64 > c16, akk0, 0.0) * beta[:, None]
    L1 = tl.where(r64 > c16 + BC, akk1, 0.0) * beta[:, None]
    L2 = tl.where(r64 > c16 + 2 * BC, akk2, 0.0) * beta[:, None]
    L3_ = tl.where(r64 > c16 + 3 * BC, akk3, 0.0) * beta[:, None]

    # ---- T = (I + L)^-1: diagonal blocks by substitution, then the exact block series ----------------
    b3 = tl.arange(0, NB)[:, None, None]
    D = (tl.where(b3 == 0, tl.reshape(L0, [NB, BC, BC]), 0.0) + tl.where(b3 == 1, tl.reshape(L1, [NB, BC, BC]), 0.0)
         + tl.where(b3 == 2, tl.reshape(L2, [NB, BC, BC]), 0.0) + tl.where(b3 == 3, tl.reshape(L3_, [NB, BC, BC]), 0.0))
    Dinv = unit_lower_inverse_blocks(D, NB, BC)  # [NB, BC, BC]
    Dinv_rows = tl.reshape(Dinv, [BT, BC])  # row 16 b + i: row i of block b's inverse
    # N = D^-1 L_off, stripe by stripe (block-diagonal times stripe: one batched product each)
    dinv_hi, dinv_lo = split_tf32(Dinv)
    N0 = tl.reshape(solve_dot(dinv_hi, dinv_lo, tl.reshape(tl.where(block_of_row > 0, L0, 0.0), [NB, BC, BC]),
                               SOLVE_PRECISION), [BT, BC])
    N1 = tl.reshape(solve_dot(dinv_hi, dinv_lo, tl.reshape(tl.where(block_of_row > 1, L1, 0.0), [NB, BC, BC]),
                               SOLVE_PRECISION), [BT, BC])
    N2 = tl.reshape(solve_dot(dinv_hi, dinv_lo, tl.reshape(tl.where(block_of_row > 2, L2, 0.0), [NB, BC, BC]),
                               SOLVE_PRECISION), [BT, BC])
    Nm = assemble(N0, N1, N2, zero, BT)  # [BT, BT]
    # stripe s of T = (I - N + N^2 - N^3) D^-1 e_s; N^(4 - s) D^-1 e_s = 0
    n_hi, n_lo = split_tf32(Nm)
    T0 = horner(n_hi, n_lo, tl.where(block_of_row == 0, Dinv_rows, 0.0), 3, SOLVE_PRECISION)
    T1 = horner(n_hi, n_lo, tl.where(block_of_row == 1, Dinv_rows, 0.0), 2, SOLVE_PRECISION)
    T2 = horner(n_hi, n_lo, tl.where(block_of_row == 2, Dinv_rows, 0.0), 1, SOLVE_PRECISION)
    T3 = tl.where(block_of_row == 3, Dinv_rows, 0.0)
    if SAVE_AKK:
        store_stripe(AKK, rows, ok, 0, T0, HV, BT, BC)
        store_stripe(AKK, rows, ok, 1, T1, HV, BT, BC)
        store_stripe(AKK, rows, ok, 2, T2, HV, BT, BC)
        store_stripe(AKK, rows, ok, 3, T3, HV, BT, BC)
    Tm = assemble(T0, T1, T2, T3, BT)
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
