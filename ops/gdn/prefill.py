"""GDN prefill forward on our KDA chunk kernels with the scalar gate: the launcher.

Two launches, as KDA's prefill (``kda_compile.ops.kda.triton_chunk``):

1. prepare, grid (chunks, HV), with the gate's form a compile-time parameter (``SCALAR_GATE``): the CUDA kernel
   (``ops/kda/cuda_prepare*.py``, bf16, K = V = 128) or the Triton one (``ops/kda/triton_chunk_prepare.py``,
   any dtype, K / V <= 256). With one decay per (token, value head), ``A_qk`` / ``A_kk`` are the plain
   ``q k^T`` / ``k k^T`` products scaled by a decay matrix of span sums (``triton_prepare_scalar.py``): exact
   for any gate, with no exact-diagonal pass, so the speed does not depend on the data;
2. the scan (``triton_chunk.launch_scan``: the CUDA scan with its state in registers, or the Triton scan with
   its segments), unchanged: the prepare writes the chunk decay ``2^G_last`` on every key channel, the layout
   it reads.

Inference only: FLA's GDN backward needs residuals in its own formats, which this forward does not write.
Device-agnostic (runs under ``TRITON_INTERPRET=1`` on CPU tensors with the Triton prepare); on CUDA the caller
makes the inputs' device current (Triton launches there).
"""
from __future__ import annotations

import math

import torch
import triton
from kda_compile.ops.kda import triton_chunk as kda_chunk
from kda_compile.ops.kda.cuda_prepare import choose_prepare_kernel, run_or_fall_back
from kda_compile.ops.kda.triton_chunk_prepare import kda_prepare_kernel
from kda_compile.ops.kda.triton_common import GATE_PRECOMPUTED, GATE_SOFTPLUS

CHUNK = kda_chunk.CHUNK
MAX_HEAD_DIM = kda_chunk.MAX_HEAD_DIM


def chunk_gdn_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, *, scale: float, output_final_state: bool,
    use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False, segments: int | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GDN prefill forward (FLA's ``chunk_gated_delta_rule`` semantics) with our kernels.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (HV a multiple of H); g, beta: ``[B, T, HV]`` (log decay,
            or with ``use_gate_in_kernel`` the raw gate ``-exp(A_log) * softplus(g + dt_bias)``). float16 /
            bfloat16 / float32, K and V <= 256, any strides.
        A_log, dt_bias: ``[HV]`` for the in-kernel gate (dt_bias optional).
        initial_state: ``[N, HV, K, V]`` fp32, any strides; ``cu_seqlens`` ``[N + 1]`` packs sequences along T
            (B = 1, empty sequences allowed); ``cu_seqlens_cpu``: its host copy when the caller has one (the
            chunk plan is then made on the host: no planning kernels, no synchronisation).
        segments: force the Triton scan's segment count (tests).
    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, HV, V]`` in q's dtype; ``final_state`` ``[N, HV, K, V]`` fp32 or None.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"K and V must be <= {MAX_HEAD_DIM} for the prefill kernels, got K={K}, V={V}")
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    TT = B * T
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if TT == 0 or N == 0:  # no tokens (no launch): the states pass through unchanged
        final = None
        if output_final_state:
            final = (initial_state.float().clone() if initial_state is not None
                     else q.new_zeros(N, HV, K, V, dtype=torch.float32))
        return q.new_empty(B, T, HV, V), final
    varlen = cu_seqlens is not None
    tokens_past_last = varlen  # tokens after cu_seqlens[-1] belong to no sequence: o is zeroed there
    if varlen and cu_seqlens_cpu is not None and not kda_chunk._capturing(q.device):
        planned = kda_chunk._chunk_offsets(cu_seqlens_cpu)
        chunk_offsets = planned.to(cu_seqlens.device, non_blocking=True)
        slots = max(int(planned[-1]), 1)
        tokens_past_last = int(cu_seqlens_cpu[-1]) < T
    elif varlen:
        chunk_offsets = kda_chunk._chunk_offsets(cu_seqlens)
        slots = triton.cdiv(T, CHUNK) + N  # an upper bound on the chunk count: no host sync
    else:
        chunk_offsets = cu_seqlens = q.new_empty(0, dtype=torch.int32)
        slots = B * triton.cdiv(T, CHUNK)
    dot_bf16, dot_precision, solve_precision, _ = kda_chunk._precisions(q.dtype)

    w, qg, kd = q.new_empty(TT, HV, K), q.new_empty(TT, HV, K), q.new_empty(TT, HV, K)
    u = q.new_empty(TT, HV, V)
    a_qk = q.new_empty(B, T, HV, CHUNK)
    decay = q.new_empty(slots, HV, K, dtype=torch.float32)
    dummy = q.new_empty(1, dtype=torch.float32)
    gate = int(GATE_SOFTPLUS if use_gate_in_kernel else GATE_PRECOMPUTED)
    A_log_arg = A_log.reshape(-1).contiguous() if (use_gate_in_kernel and A_log is not None) else dummy
    dt_bias_arg = dt_bias.reshape(-1).contiguous() if (use_gate_in_kernel and dt_bias is not None) else dummy
    prepare_args = dict(
        T=T, N=N, scale=float(scale), beta_scale=2.0 if allow_neg_eigval else 1.0, lower_bound=0.0,
        H=H, HV=HV, K=K, V=V, SEARCH_STEPS=max(1, math.ceil(math.log2(N + 1)) + 1), IS_VARLEN=varlen,
        L2NORM=use_qk_l2norm_in_kernel, GATE=gate, EXACT_DIAGONAL=False, HAS_A_LOG=A_log_arg is not dummy,
        HAS_DT_BIAS=dt_bias_arg is not dummy, BETA_SIGMOID=use_beta_sigmoid_in_kernel, SAVE_AKK=False,
        SAVE_G=False, DOT_BF16=dot_bf16, A_PRECISION=dot_precision, SOLVE_PRECISION=solve_precision,
        SCALAR_GATE=True,
    )
    prepare_tensors = (q, k, v, g, beta, A_log_arg, dt_bias_arg, w, u, qg, kd, a_qk, decay, dummy, dummy,
                       cu_seqlens, chunk_offsets)
    kernel = choose_prepare_kernel(q, k, v, g, beta, cu_seqlens if varlen else None, False, None, scalar_gate=True,
                                   op="chunk_gdn")
    if kernel == "cuda" and run_or_fall_back(prepare_tensors, slots, prepare_args, op="chunk_gdn"):
        pass  # the CUDA prepare kernel ran
    elif kda_chunk._interpreted():
        kda_prepare_kernel[(slots, HV)](*prepare_tensors, **prepare_args, BKC=min(64, kda_chunk._pow2(K)),
                                        BWC=min(64, kda_chunk._pow2(max(K, V))), num_warps=1)
    else:
        kda_chunk._tuned("prepare")[(slots, HV)](*prepare_tensors, **prepare_args)

    o = q.new_zeros(B, T, HV, V) if tokens_past_last else q.new_empty(B, T, HV, V)
    final = q.new_empty(N, HV, K, V, dtype=torch.float32) if output_final_state else None
    kda_chunk.launch_scan(w, u, qg, kd, a_qk, decay, initial_state, cu_seqlens, chunk_offsets, T=T, N=N,
                          segments=segments, o=o, final=final)
    return o, final
