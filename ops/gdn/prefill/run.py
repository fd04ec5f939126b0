"""GDN prefill forward on our KDA chunk kernels with the scalar gate.

KDA's prefill launcher (``kda_compile.ops.kda.prefill.run.chunk_kda_prefill``) with the gate's form as its
parameter (``scalar_gate=True``); allocation, chunk planning, kernel choice and the scan are that launcher's:

1. prepare, grid (chunks, HV), with the gate's form a compile-time parameter (``SCALAR_GATE``): the CUDA kernel
   (``ops/kda/prefill/cuda/prepare*.py``, bf16, K = V = 128) or the Triton one (``ops/kda/prefill/triton/prepare.py``,
   any dtype, K / V <= 256). With one decay per (token, value head), ``A_qk`` / ``A_kk`` are the plain
   ``q k^T`` / ``k k^T`` products scaled by a decay matrix of span sums
   (``ops/kda/prefill/triton/prepare_scalar.py``): exact for any gate, with no exact-diagonal pass, so the speed
   does not depend on the data;
2. the scan (the CUDA scan with its state in registers, or the Triton scan with its segments), unchanged: the
   prepare writes the chunk decay ``2^G_last`` on every key channel, the layout it reads.

Inference only: FLA's GDN backward needs residuals in its own formats, which this forward does not write.
Device-agnostic (runs under ``TRITON_INTERPRET=1`` on CPU tensors with the Triton prepare); on CUDA the caller
makes the inputs' device current (Triton launches there).
"""
from __future__ import annotations

import torch
from kda_compile.ops.kda.prefill.run import chunk_kda_prefill


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
    o, final, _ = chunk_kda_prefill(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale=scale,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, segments=segments, cu_seqlens_cpu=cu_seqlens_cpu, scalar_gate=True)
    return o, final
