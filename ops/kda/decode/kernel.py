"""Fused KDA decode step in Triton: the ``fused_recurrent_kda`` path for small T (decode T = 1, a few
draft tokens, packed sequences with ``cu_seqlens``), and with the gate's form as a compile-time parameter
(``SCALAR_GATE``) GDN's decode step (``fused_recurrent_gated_delta_rule``: one gate per token and value head).

Kernel and launcher only: nothing here knows of torch.compile, custom ops or backends
(``decode/backend.py`` plugs this into the op layer). The launcher is device-agnostic, so the same
code runs on CPU tensors under ``TRITON_INTERPRET=1``.

One program owns the ``[K, BV]`` fp32 slice ``S[:, v0:v0 + BV]`` of one (sequence, value head) state.
It loads that tile once (or starts from zeros), walks the sequence's tokens with the tile in
registers, and stores it once at the end, only when the final state is requested. Per token::

    q, k  <- l2norm(q), l2norm(k)                          (optional; eps inside the sqrt)
    g     <- -exp(A_log) * softplus(g + dt_bias)           (optional; or the lower-bound form)
    beta  <- sigmoid(beta) (x2 with negative eigenvalues)  (optional)
    S     <- diag(exp(g)) S                                (GDN's scalar gate: exp(g) S)
    S     <- S + k (beta (v - S^T k))^T
    o     <- S^T (scale * q)

Every program of a head recomputes the prologue over the full K (cheap: K loads per token), so the
V-split costs no extra state traffic: each state element is still read once and written once. A
token's q / k / g / beta / v loads are all issued before its prologue math: loaded one at a time
between the L2-norm reductions, their round trips queued behind each other (docs/kda-decode.md).
Grid: ``(cdiv(V, BV), N * HV)``. ``BV`` and ``num_warps`` come from a shipped table by grid size class
(``shipped_config``; a small grid, batch 1, favours a small ``BV`` to spread the state over more SMs), so the
first call compiles one kernel and times nothing, seconds less than autotuning over the 13 candidates in a fresh
process (docs/kda-decode.md). ``KDA_COMPILE_DECODE_AUTOTUNE=1``
autotunes instead, per (K, V, grid size class, dtypes), at the first call of each.

Gate forms (``SCALAR_GATE``, compile-time): KDA's gate is a ``[K]`` row per token and value head (``g``
``[B, T, HV, K]``, ``dt_bias`` ``[HV * K]``); GDN's is one value (``g`` ``[B, T, HV]``, ``dt_bias`` ``[HV]``),
so its prologue takes one softplus and the update one ``exp`` per token instead of K, and nothing is
broadcast in memory. Everything else (norms, beta, state layouts, packing, grouped heads) is shared; KDA's
variant compiles to what it was before the parameter existed.

Conventions: inputs take any strides; ``o`` ``[B, T, HV, V]`` (q's dtype) and the final state
``[N, HV, K, V]`` (fp32) are fresh contiguous tensors, or the final state goes to a given tensor of any strides
(``final_state``), which may be the initial state itself: a program reads its ``[K, BV]`` tile of the state before
it writes that tile and no other program touches it, so decode updates a cache's state in place, with no copy.
Batch, head and token offsets are int64 (states beyond 2**31 elements).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kda_compile.ops import envs
from kda_compile.ops._common import cdiv, next_power_of_2, triton_interpreted as _interpreted
from kda_compile.ops.kda.triton_common import GATE_LOWER_BOUND, GATE_PRECOMPUTED, GATE_SOFTPLUS

MAX_HEAD_DIM = 256
L2NORM_EPS = tl.constexpr(1e-6)  # inside the sqrt (FLA, HF); a plain global is rejected by the compiler


AUTOTUNE_ENV = envs.DECODE_AUTOTUNE
# (BV, num_warps) by grid size class for K = 128: each class's fastest config, or within 5% of it, for the GDN and
# the KDA step at every batch size of the class (bf16, V = 128, 32 value heads, fp32 state; one step replayed from a
# CUDA graph, every candidate of ``_configs``; the times: docs/kda-decode.md). The kernel streams its state (a
# memory-bound step), so GPUs of the same SM design and count take the same table; autotuning (``AUTOTUNE_ENV``) is
# there for a GPU where it is not best.
SHIPPED_CONFIGS = {64: (16, 4), 256: (32, 2), 1024: (64, 4), 4096: (64, 4)}
INTERPRETER_CONFIG = (32, 1)  # (BV, num_warps) under the Triton interpreter, which cannot benchmark


def shipped_config(BK: int, V: int, nh_class: int) -> dict:
    """The launch config without autotuning: the table's ``BV`` (at most V rounded up to a power of 2) and its
    warps scaled with K, so each thread keeps the table's share of the ``[BK, BV]`` state tile (16-64 fp32
    elements: what ``_prune_configs`` allows)."""
    # interpreted: the interpreter's one config (fewer, wider programs are faster there)
    bv, warps = INTERPRETER_CONFIG if _interpreted() else SHIPPED_CONFIGS[nh_class]
    bv = min(bv, max(16, next_power_of_2(V)))
    return {"BV": bv, "num_warps": max(1, min(8, warps * BK // 128)), "num_stages": 1}


def _configs() -> list:
    """Autotune candidates (BV, num_warps), tried under ``AUTOTUNE_ENV`` only. On CUDA the test suite runs only
    the first surviving config (see tests/conftest.py), so the list starts with a safe default: BV = 32 with 4
    warps gives each thread 32 state elements of a K = 128 tile (about 92 registers on sm_90)."""
    if _interpreted():
        return [triton.Config({"BV": INTERPRETER_CONFIG[0]}, num_warps=INTERPRETER_CONFIG[1], num_stages=1)]
    shapes = [(32, 4), (16, 1), (16, 2), (16, 4), (16, 8), (32, 1), (32, 2), (32, 8), (64, 2), (64, 4), (64, 8),
              (128, 4), (128, 8)]
    return [triton.Config({"BV": bv}, num_warps=w, num_stages=1) for bv, w in shapes]


def _prune_configs(configs, named_args, **kwargs):
    """Keep configs whose state tile fits: at most 64 fp32 state elements per thread and at least 8
    (below that threads idle), and BV no wider than V needs. ptxas for sm_90 (triton 3.6, bf16
    inputs, every prologue option on): 32 elements per thread take about 92 registers, 64 take
    150-185, 128 spill (the q/k/decay vectors are replicated along each thread's K rows)."""
    args = {**named_args, **kwargs}
    BK, V = args["BK"], args["V"]
    bv_max = max(16, next_power_of_2(V))
    kept = [c for c in configs
            if c.kwargs["BV"] <= bv_max and 8 <= BK * c.kwargs["BV"] // (32 * c.num_warps) <= 64]
    return kept or [min(configs, key=lambda c: (c.kwargs["BV"], c.num_warps))]


def grid_class(state_heads: int) -> int:
    """Config key for the grid size: ``state_heads = N * HV`` rounded up to a power of 4 in
    [64, 4096]. Four classes (batch 1-2, up to 8, up to 32, more, at 32 heads) bound re-tuning as
    batch sizes vary, while batch 1 and batch 64 still get their own tiles."""
    c = 64
    while c < state_heads and c < 4096:
        c *= 4
    return c


@triton.jit
def kda_token_prologue(b_q, b_k, b_g, b_beta, b_bias, decay, scale, lower_bound,
                       USE_QK_L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_A_LOG: tl.constexpr,
                       HAS_DT_BIAS: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr, ALLOW_NEG_EIGVAL: tl.constexpr):
    """One token's fused prologue in fp32: ``(scale * l2norm(q), l2norm(k), log-decay g, beta)``.

    ``b_q`` / ``b_k`` / ``b_g`` are ``[BK]`` rows (padded lanes 0), ``b_beta`` a scalar, any float dtype;
    ``b_bias`` the head's ``[BK]`` dt_bias row (fp32, unused without HAS_DT_BIAS), ``decay`` = exp(A_log).
    The gate math is elementwise: a scalar ``b_g`` with a scalar ``b_bias`` (GDN's gate) gives a scalar.
    """
    b_q = b_q.to(tl.float32)
    b_k = b_k.to(tl.float32)
    b_g = b_g.to(tl.float32)
    b_beta = b_beta.to(tl.float32)
    if USE_QK_L2NORM:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=0) + L2NORM_EPS)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=0) + L2NORM_EPS)
    b_q = b_q * scale
    if GATE != GATE_PRECOMPUTED:
        x = b_g
        if HAS_DT_BIAS:
            x = x + b_bias
        if GATE == GATE_SOFTPLUS:
            # softplus with torch's threshold (x > 20 -> x); exp(x) itself below -15, where
            # log(1 + exp(x)) would round to 0 in fp32. Padded lanes (x = 0) stay finite.
            e = tl.exp(tl.minimum(x, 20.0))
            soft = tl.where(x > 20.0, x, tl.where(x < -15.0, e, tl.log(1.0 + e)))
            b_g = -decay * soft
        else:
            if HAS_A_LOG:
                x = decay * x
            b_g = lower_bound * tl.sigmoid(x)
    if USE_BETA_SIGMOID:
        b_beta = tl.sigmoid(b_beta)
        if ALLOW_NEG_EIGVAL:
            b_beta = b_beta * 2.0
    return b_q, b_k, b_g, b_beta


@triton.jit
def kda_state_update(b_h, b_q, b_k, b_v, b_g, b_beta, SCALAR_GATE: tl.constexpr = False):
    """One token of the recurrence on a ``[BK, BV]`` fp32 state tile: decay, delta-rule write, read.
    ``b_g``: the ``[BK]`` log-decay row, or with ``SCALAR_GATE`` one log decay for the whole tile.
    Returns the new tile and the ``[BV]`` fp32 output row."""
    if SCALAR_GATE:
        b_h = b_h * tl.exp(b_g)
    else:
        b_h = b_h * tl.exp(b_g)[:, None]
    b_u = b_beta * (b_v.to(tl.float32) - tl.sum(b_h * b_k[:, None], axis=0))
    b_h = b_h + b_k[:, None] * b_u[None, :]
    return b_h, tl.sum(b_h * b_q[:, None], axis=0)


@triton.autotune(configs=_configs(), key=["BK", "V", "NH_CLASS", "SCALAR_GATE"],
                 prune_configs_by={"early_config_prune": _prune_configs})
@triton.jit
def fused_recurrent_kda_decode_kernel(
    q, k, v, g, beta, A_log, dt_bias, h0, o, ht, cu_seqlens,
    s_qb, s_qt, s_qh, s_qd,
    s_kb, s_kt, s_kh, s_kd,
    s_vb, s_vt, s_vh, s_vd,
    s_gb, s_gt, s_gh, s_gd,
    s_bb, s_bt, s_bh,
    s_hn, s_hh, s_hk, s_hv,
    s_tn, s_th, s_tk, s_tv,
    T, HV, K, V, GROUP, scale, lower_bound, NH_CLASS,
    BK: tl.constexpr, BV: tl.constexpr, USE_QK_L2NORM: tl.constexpr, GATE: tl.constexpr,
    HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
    ALLOW_NEG_EIGVAL: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr,
    SCALAR_GATE: tl.constexpr = False,
):
    """``SCALAR_GATE``: ``g`` ``[B, T, HV]`` and ``dt_bias`` ``[HV]``, one gate per token and value head (GDN;
    ``s_gd`` unused); otherwise ``g`` ``[B, T, HV, K]`` and ``dt_bias`` ``[HV * K]`` (KDA)."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1).to(tl.int64)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // GROUP  # GVA: GROUP value heads share one q/k head
    if IS_VARLEN:  # B == 1, sequence i_n is tokens [bos, eos) of the packed batch
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        i_b = i_n * 0
    else:
        bos = i_n * 0
        eos = bos + T
        i_b = i_n

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]

    p_q = q + i_b * s_qb + bos * s_qt + i_h * s_qh + o_k * s_qd
    p_k = k + i_b * s_kb + bos * s_kt + i_h * s_kh + o_k * s_kd
    p_v = v + i_b * s_vb + bos * s_vt + i_hv * s_vh + o_v * s_vd
    if SCALAR_GATE:
        p_g = g + i_b * s_gb + bos * s_gt + i_hv * s_gh
    else:
        p_g = g + i_b * s_gb + bos * s_gt + i_hv * s_gh + o_k * s_gd
    p_beta = beta + i_b * s_bb + bos * s_bt + i_hv * s_bh
    p_o = o + ((i_b * T + bos) * HV + i_hv) * V + o_v

    if HAS_H0:
        p_h0 = h0 + i_n * s_hn + i_hv * s_hh + o_k[:, None] * s_hk + o_v[None, :] * s_hv
        # The state streams through once: keep it from evicting the q/k/g rows that the other
        # V-blocks of this head are about to read from L2.
        b_h = tl.load(p_h0, mask=m_h, other=0.0, eviction_policy="evict_first").to(tl.float32)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)

    # Per-head gate parameters, loaded once for all tokens.
    decay = 1.0
    if HAS_A_LOG:
        decay = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    b_bias = 0.0
    if HAS_DT_BIAS:
        if SCALAR_GATE:
            b_bias = tl.load(dt_bias + i_hv).to(tl.float32)
        else:
            b_bias = tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)

    for _ in range(0, (eos - bos).to(tl.int32)):
        # Every load of the token first, then the math (see the module docstring).
        b_q = tl.load(p_q, mask=m_k, other=0.0)
        b_k = tl.load(p_k, mask=m_k, other=0.0)
        if SCALAR_GATE:
            b_g = tl.load(p_g)
        else:
            b_g = tl.load(p_g, mask=m_k, other=0.0)
        b_beta = tl.load(p_beta)
        b_v = tl.load(p_v, mask=m_v, other=0.0)
        b_q, b_k, b_g, b_beta = kda_token_prologue(b_q, b_k, b_g, b_beta, b_bias, decay, scale, lower_bound,
                                                   USE_QK_L2NORM, GATE, HAS_A_LOG, HAS_DT_BIAS, USE_BETA_SIGMOID,
                                                   ALLOW_NEG_EIGVAL)
        b_h, b_o = kda_state_update(b_h, b_q, b_k, b_v, b_g, b_beta, SCALAR_GATE)
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_v)

        p_q += s_qt
        p_k += s_kt
        p_v += s_vt
        p_g += s_gt
        p_beta += s_bt
        p_o += HV * V

    if STORE_HT:
        p_ht = ht + i_n * s_tn + i_hv * s_th + o_k[:, None] * s_tk + o_v[None, :] * s_tv
        tl.store(p_ht, b_h, mask=m_h, eviction_policy="evict_first")


# The gate codes as plain ints for the launcher (unwrapping a constexpr costs host time per call).
_GATE_PRECOMPUTED, _GATE_SOFTPLUS, _GATE_LOWER_BOUND = int(GATE_PRECOMPUTED), int(GATE_SOFTPLUS), int(GATE_LOWER_BOUND)

# launch key -> the launch kwargs of its config (BV, num_warps, ...): shipped, or the autotuner's pick
_TUNED: dict[tuple, dict] = {}


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    # A_log / dt_bias are indexed as flat arrays ([HV] and [HV * K]).
    return t if t is None or t.is_contiguous() else t.contiguous()


def fused_recurrent_kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    *,
    scale: float,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    scalar_gate: bool = False,
    final_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One fused launch of the KDA recurrence over every token of every sequence; with ``scalar_gate``, of
    GDN's (FLA's ``fused_recurrent_gated_delta_rule``).

    Args:
        q, k: ``[B, T, H, K]``, K <= 256; v: ``[B, T, HV, V]`` with ``HV % H == 0``;
            g: ``[B, T, HV, K]`` (log-decay, or the raw projection with ``use_gate_in_kernel``);
            beta: ``[B, T, HV]``. Any float dtypes, any strides.
        A_log: ``[HV]`` or None; dt_bias: ``HV * K`` elements or None (in-kernel gate only).
        initial_state: ``[N, HV, K, V]`` fp32, any strides (a transposed view serves ``state_v_first``).
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of sequences packed along T (B must be 1).
        scale, options: as ``fused_recurrent_kda`` (the caller has validated them).
        scalar_gate: the gate's form (the kernel's compile-time ``SCALAR_GATE``): g ``[B, T, HV]`` and dt_bias
            ``[HV]``, one gate per token and value head (GDN). No ``lower_bound`` (GDN's gate is the softplus form).
        final_state: ``[N, HV, K, V]`` fp32, any strides: where the final state is written (``initial_state``
            itself for an update in place); requires ``output_final_state``. None: a fresh tensor.
    Returns:
        ``o`` ``[B, T, HV, V]`` in q's dtype (tokens outside every sequence are 0) and the final state
        ``[N, HV, K, V]`` fp32 (``final_state`` when given), or None when ``output_final_state`` is False.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K > MAX_HEAD_DIM:
        raise ValueError(f"q must have key head dim K <= {MAX_HEAD_DIM}, got K={K}")
    if scalar_gate and lower_bound is not None:
        raise ValueError(f"the scalar gate takes no lower_bound (GDN's gate is the softplus form), got {lower_bound}")
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if final_state is not None:
        if not output_final_state:
            raise ValueError("final_state is where the final state is written: it needs output_final_state=True")
        if tuple(final_state.shape) != (N, HV, K, V) or final_state.dtype != torch.float32:
            raise ValueError(f"final_state must be a float32 tensor of shape [N, HV, K, V] = {[N, HV, K, V]}, got "
                             f"{final_state.dtype} {list(final_state.shape)}")
    # Packed sequences need not cover all T tokens: the uncovered ones must read 0, as in the reference.
    o = q.new_zeros((B, T, HV, V)) if cu_seqlens is not None else q.new_empty((B, T, HV, V))
    ht = final_state
    if ht is None and output_final_state:
        ht = q.new_empty((N, HV, K, V), dtype=torch.float32)
    if N * HV == 0 or T == 0:
        if ht is not None and initial_state is None:
            ht.zero_()
        elif ht is not None and ht is not initial_state:
            ht.copy_(initial_state)
        return o, ht

    gate = _GATE_PRECOMPUTED
    if use_gate_in_kernel:
        gate = _GATE_SOFTPLUS if lower_bound is None else _GATE_LOWER_BOUND
        A_log, dt_bias = _flat(A_log), _flat(dt_bias)
    else:
        A_log = dt_bias = None
    h0 = q if initial_state is None else initial_state  # placeholders for absent tensors: never read
    tensors = (q, k, v, g, beta, q if A_log is None else A_log, q if dt_bias is None else dt_bias, h0, o,
               o if ht is None else ht, q if cu_seqlens is None else cu_seqlens)
    BK = max(16, next_power_of_2(K))
    nh_class = grid_class(N * HV)
    args = (
        *tensors,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *((0,) if scalar_gate else ()), *beta.stride(),
        *(initial_state.stride() if initial_state is not None else (0, 0, 0, 0)),
        *(ht.stride() if ht is not None else (0, 0, 0, 0)),
        T, HV, K, V, HV // H, float(scale), 0.0 if lower_bound is None else float(lower_bound), nh_class,
    )
    flags = dict(
        BK=BK, USE_QK_L2NORM=bool(use_qk_l2norm_in_kernel), GATE=gate, HAS_A_LOG=A_log is not None,
        HAS_DT_BIAS=dt_bias is not None, USE_BETA_SIGMOID=bool(use_beta_sigmoid_in_kernel),
        ALLOW_NEG_EIGVAL=bool(use_beta_sigmoid_in_kernel and allow_neg_eigval),
        HAS_H0=initial_state is not None, STORE_HT=ht is not None, IS_VARLEN=cu_seqlens is not None,
        SCALAR_GATE=bool(scalar_gate),
    )
    # The autotuner's own key: its key arguments plus the dtype of every tensor argument.
    key = (BK, V, nh_class, bool(scalar_gate), *[t.dtype for t in tensors])
    tuned = _TUNED.get(key)
    if tuned is None:
        if envs.decode_autotune():
            fused_recurrent_kda_decode_kernel[lambda meta: (cdiv(V, meta["BV"]), N * HV)](*args, **flags)
            _TUNED[key] = fused_recurrent_kda_decode_kernel.best_config.all_kwargs()
            return o, ht
        tuned = _TUNED[key] = shipped_config(BK, V, nh_class)
    # The config is launched directly: the autotuner rebuilds its key from all ~45 arguments on every call,
    # microseconds of host time in a launch-bound batch-1 decode step.
    fused_recurrent_kda_decode_kernel.fn[(cdiv(V, tuned["BV"]), N * HV)](*args, **flags, **tuned)
    return o, ht
