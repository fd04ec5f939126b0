"""GDN decode on our fused Triton step with the scalar gate.

KDA's decode kernel (``kda_compile.ops.kda.decode.kernel``) with the gate's form as its compile-time parameter
(``scalar_gate=True``, the kernel's ``SCALAR_GATE``): one program per (value block, sequence and value head) keeps
its ``[K, BV]`` fp32 state tile in registers over the sequence's tokens, and per token reads one gate, takes one
softplus (in-kernel gate ``-exp(A_log) * softplus(g + dt_bias)``, ``dt_bias`` ``[HV]``) and one ``exp``, and
scales the tile by it. No ``[B, T, HV, K]`` broadcast of the gate is written or read (the KDA route's cost,
``backends/kda.py``). The q / k L2 norm, the beta sigmoid, grouped heads, packed sequences and any state strides
are the KDA kernel's, unchanged.

Device-agnostic (runs under ``TRITON_INTERPRET=1`` on CPU tensors); on CUDA the caller makes the inputs' device
current (Triton launches there).
"""
from __future__ import annotations

import torch
from kda_compile.ops.kda.decode.kernel import fused_recurrent_kda_triton


def fused_recurrent_gdn_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, *, scale: float, output_final_state: bool,
    use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
    final_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GDN's recurrence (FLA's ``fused_recurrent_gated_delta_rule`` semantics) in one fused launch.

    Args:
        q, k: ``[B, T, H, K]``, K <= 256; v: ``[B, T, HV, V]`` (HV a multiple of H); g, beta: ``[B, T, HV]`` (log
            decay, or with ``use_gate_in_kernel`` the raw gate of ``-exp(A_log) * softplus(g + dt_bias)``).
            float16 / bfloat16 / float32, any strides.
        A_log, dt_bias: ``[HV]`` for the in-kernel gate (either may be None).
        initial_state: ``[N, HV, K, V]`` fp32, any strides (a transposed view serves ``state_v_first``);
            ``cu_seqlens`` ``[N + 1]`` packs sequences along T (B = 1, empty sequences allowed).
        final_state: where the final state is written (``initial_state`` itself updates it in place), or None.
    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, HV, V]`` in q's dtype (tokens outside every sequence are 0);
        ``final_state`` ``[N, HV, K, V]`` fp32, or None when ``output_final_state`` is False.
    """
    return fused_recurrent_kda_triton(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale=scale,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, scalar_gate=True, final_state=final_state)
