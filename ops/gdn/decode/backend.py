"""GDN decode (``fused_recurrent_gdn``) on our fused Triton step with the scalar gate (``decode/kernel.py``): the
``decode_kernel`` backend.

Registered ABOVE FLA (priority 15 > 10): one step replayed from a CUDA graph takes less GPU time than FLA's,
called eagerly its host path is shorter than FLA's public function's, and its
first call in a fresh process compiles one shipped config (no autotuning): docs/gdn.md section 4. It replaced the
KDA route, which fed KDA's decode kernel a gate broadcast over the K channels (a ``[B, T, HV, K]`` tensor written
and read, K exponentials per row where one suffices). ``only_backends("decode_kernel")`` also runs it on CPU under
the Triton interpreter (tests).

A call variant whose kernel fails to compile is served by the next backend, recorded (``backends/own_kernels.py``).
"""
from __future__ import annotations


import torch
from kda_compile.ops.delta_rule.backends import own_kernel
from kda_compile.ops.gdn.backends.registry import GDNOptions, explicitly_requested, register_backend
from kda_compile.ops.gdn.backends.own_kernels import launch_or_fall_back

KERNEL_MODULE = "kda_compile.ops.gdn.decode.kernel"
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256  # the kernel keeps a [next_pow2(K), BV] fp32 state tile in registers
_failed_variants: dict[tuple, str] = {}  # call variants whose kernel did not compile -> the reason


_kernel_unusable, _launcher = own_kernel(KERNEL_MODULE, "fused_recurrent_gdn_triton")


class DecodeKernelBackend:
    name = "decode_kernel"
    serves = frozenset({"fused_recurrent_gdn"})
    writes_final_state_into = True  # recurrent_forward's final_state (ops/delta_rule/custom_ops.recurrent_into_state)

    def unsupported_reason(self, device, dtype, K, V, opts: GDNOptions) -> str | None:
        if device.type != "cuda" and not explicitly_requested(self.name):
            return f"needs CUDA, got {device.type}"
        if dtype not in KERNEL_DTYPES:
            return f"the decode kernel takes float16/bfloat16/float32, got {dtype}"
        if K > MAX_HEAD_DIM:
            return f"the decode kernel keeps K <= {MAX_HEAD_DIM} in registers, got K={K}"
        return _kernel_unusable()

    def recurrent_forward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts, output_final_state,
                          final_state=None):
        """``(o [B, T, HV, V] in q's dtype, final state [N, HV, K, V] fp32 or None)``; inputs as the op got them.
        ``final_state``: where the final state goes (``h0`` itself: the state updated in place), or a fresh tensor;
        a fallback backend (a variant that did not compile) returns a fresh one, which the caller copies over."""
        args = (q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens)
        return launch_or_fall_back(
            _failed_variants, "our Triton decode kernel (scalar gate)", "fused_recurrent_gdn",
            (*args, opts, output_final_state),
            lambda: _launcher()(*args, scale=opts.scale, output_final_state=output_final_state,
                                use_qk_l2norm_in_kernel=opts.use_qk_l2norm_in_kernel,
                                use_gate_in_kernel=opts.use_gate_in_kernel,
                                use_beta_sigmoid_in_kernel=opts.use_beta_sigmoid_in_kernel,
                                allow_neg_eigval=opts.allow_neg_eigval, final_state=final_state),
            lambda fallback: fallback.recurrent_forward(*args, opts, output_final_state))


register_backend(DecodeKernelBackend(), priority=15)
