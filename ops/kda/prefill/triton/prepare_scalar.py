"""Pass 1 of the prepare kernel (``prefill/triton/prepare.py``) for a scalar gate per (token, value head): GDN.

With one decay per token the decay between tokens ``j <= i`` of a chunk is one number, ``2^(span(j, i])``
(``span(j, i]`` the gate summed over the tokens after j up to i), the same for every channel. So::

    A_qk[i, j] = (q_i . k_j) s_q(i) s_k(j) 2^span(j, i]          j <= i
    A_kk[i, j] = (k_i . k_j) s_k(i) s_k(j) 2^span(j, i]          (beta_i and the strict triangle: the kernel)
    qg_i = q_i s_q(i) 2^G_i,   kd_j = k_j s_k(j) 2^span(j, last],   x_i = beta_i k_i s_k(i) 2^G_i

with ``s_q``, ``s_k`` the rows' L2-norm factors (``scale`` folded into ``s_q``) and ``G_i = span(-1, i]``. The
products are PLAIN ``q k^T`` / ``k k^T`` of the loaded tiles (bf16 operands are the inputs themselves: exact
products, fp32 accumulation), and everything that depends on the gate is a ``[64, 64]`` matrix or a per-row
scalar applied afterwards. No factor is ever above 1 and no exponent is a difference: ``span`` is a cumulative
sum down each column of the masked gates (``span[i, j] = sum of g_t over j < t <= i``), so it adds only its own
span's gates. Exact for any gate, ``-inf`` (floored at ``GATE_FLOOR``: a reset) and huge decays included, with no
exact-diagonal pass and no per-channel work: the cost does not depend on the data.

Inputs: the gate ``[TT, HV]`` (the pointer at the chunk's first row), ``dt_bias`` ``[HV]`` for the in-kernel gate.
"""
import triton
import triton.language as tl
from kda_compile.ops.kda.triton_common import GATE_PRECOMPUTED, dot_operand
from kda_compile.ops.kda.prefill.triton.prepare_gates import log2_gate
from kda_compile.ops.kda.prefill.triton.prepare_tiles import (
    L2NORM_EPS,
    column_stripes,
    l2_sums,
    load_rows,
)


@triton.jit
def scalar_gates(G_in, A_log, Dt_bias, rows, ok, hv, lower_bound, HV: tl.constexpr, GATE: tl.constexpr,
                 HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """The floored log2 gates ``[BT]`` of the chunk's rows (0 past the sequence)."""
    x = tl.load(G_in + rows * HV, mask=ok, other=0.0).to(tl.float32)
    if GATE != GATE_PRECOMPUTED and HAS_DT_BIAS:
        x += tl.load(Dt_bias + hv).to(tl.float32)
    return tl.where(ok, log2_gate(x, A_log, hv, lower_bound, GATE, HAS_A_LOG), 0.0)


@triton.jit
def scalar_gate_pass(Q, Kt, G_in, A_log, Dt_bias, W, QG, KD, DECAY, rows, ok, beta, hv, scale, lower_bound,
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BKC: tl.constexpr, L2NORM: tl.constexpr,
                     GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DOT_BF16: tl.constexpr,
                     A_PRECISION: tl.constexpr):
    """Pass 1 for the scalar gate: writes ``qg, kd``, ``x = beta 2^G k`` (into ``W``) and ``decay`` (the scalar
    ``2^G_last`` on every channel, the layout the scans read); returns the four column stripes ``[BT, BC]`` of
    ``A_qk`` and of ``A_kk`` (before beta and the triangle masks), as ``channel_gate_pass`` does."""
    BC: tl.constexpr = 16
    g = scalar_gates(G_in, A_log, Dt_bias, rows, ok, hv, lower_bound, HV, GATE, HAS_A_LOG, HAS_DT_BIAS)
    later = rows[:, None] > rows[None, :]  # [t, j]: token t comes after token j
    masked = tl.where(later, g[:, None], 0.0)
    span = tl.cumsum(masked, 0)  # span[i, j] = sum of g over (j, i] for i >= j (0 on the diagonal)
    decay = tl.exp2(tl.where(later | (rows[:, None] == rows[None, :]), span, float("-inf")))  # 0 above
    to_end = tl.sum(masked, 0)  # [BT] by column j: the gate after token j to the chunk's end
    G = tl.cumsum(g, 0)  # the gate from the chunk's start through each row
    G_last = tl.sum(g, 0)

    q_scale = tl.zeros([rows.shape[0]], dtype=tl.float32) + scale
    k_scale = tl.zeros([rows.shape[0]], dtype=tl.float32) + 1.0
    if L2NORM:
        q_sq, k_sq = l2_sums(Q, Kt, rows, ok, K, H * K)
        q_scale = scale / tl.sqrt(q_sq + L2NORM_EPS)
        k_scale = 1.0 / tl.sqrt(k_sq + L2NORM_EPS)
    start_decay = tl.exp2(G)
    q_factor = (q_scale * start_decay)[:, None]
    kd_factor = (k_scale * tl.exp2(to_end))[:, None]
    x_factor = (k_scale * beta * start_decay)[:, None]

    qk = tl.zeros([rows.shape[0], rows.shape[0]], dtype=tl.float32)
    kk = tl.zeros([rows.shape[0], rows.shape[0]], dtype=tl.float32)
    for k0 in range(0, K, BKC):
        cols = k0 + tl.arange(0, BKC)
        col_ok = cols < K
        m = ok[:, None] & col_ok[None, :]
        q = load_rows(Q, rows, ok, cols, col_ok, H * K)
        k = load_rows(Kt, rows, ok, cols, col_ok, H * K)
        out = rows[:, None] * (HV * K) + cols[None, :]
        tl.store(QG + out, (q * q_factor).to(QG.dtype.element_ty), mask=m)
        tl.store(KD + out, (k * kd_factor).to(KD.dtype.element_ty), mask=m)
        tl.store(W + out, (k * x_factor).to(W.dtype.element_ty), mask=m)
        tl.store(DECAY + cols, tl.exp2(G_last) + tl.zeros([BKC], dtype=tl.float32), mask=col_ok)
        key_t = dot_operand(tl.trans(k), DOT_BF16)
        qk = tl.dot(dot_operand(q, DOT_BF16), key_t, qk, input_precision=A_PRECISION)
        kk = tl.dot(dot_operand(k, DOT_BF16), key_t, kk, input_precision=A_PRECISION)
    pair = k_scale[None, :] * decay
    aqk0, aqk1, aqk2, aqk3 = column_stripes(qk * q_scale[:, None] * pair, BC)
    akk0, akk1, akk2, akk3 = column_stripes(kk * k_scale[:, None] * pair, BC)
    return aqk0, aqk1, aqk2, aqk3, akk0, akk1, akk2, akk3
