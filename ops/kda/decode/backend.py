"""Our fused Triton decode step (``decode/kernel.py``) as a KDA backend for ``fused_recurrent_kda``.

Registered above FLA (priority 20 > 10) for the decode op only: one launch does the q/k L2 norm, the
gate, the beta sigmoid and the state update, reading and writing each fp32 state element once.
Calls it cannot serve (not CUDA, float64, K > 256, triton missing) say why in
``unsupported_reason``; ``select_backend`` then tries FLA, then the reference (logged on CUDA).

Triton is imported lazily on the first CUDA call, so importing the op layer never needs it.
"""
from __future__ import annotations

import logging

import torch

from kda_compile.ops.delta_rule.backends import own_kernel
from kda_compile.ops.kda.backends.registry import KDAOptions, register_backend

logger = logging.getLogger("kda_compile.ops.kda")

KERNEL_MODULE = "kda_compile.ops.kda.decode.kernel"
DECODE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256  # the kernel keeps a [next_pow2(K), BV] fp32 tile in registers


_kernel_unusable, _launcher = own_kernel(KERNEL_MODULE, "fused_recurrent_kda_triton")


class TritonDecodeBackend:
    """``fused_recurrent_kda`` on CUDA through one fused Triton launch per call."""

    name = "triton_decode"
    serves = frozenset({"fused_recurrent_kda"})
    writes_final_state_into = True  # recurrent_forward's final_state (ops/delta_rule/custom_ops.recurrent_into_state)

    def unsupported_reason(self, device, dtype, K, V, opts: KDAOptions) -> str | None:
        if device.type != "cuda":
            return f"needs CUDA, got {device.type}"
        if dtype not in DECODE_DTYPES:
            return f"the decode kernel takes float16/bfloat16/float32 inputs, got {dtype}"
        if K > MAX_HEAD_DIM:
            return f"the decode kernel keeps K <= {MAX_HEAD_DIM} in registers, got K={K}"
        return _kernel_unusable()

    def recurrent_forward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts, output_final_state,
                          final_state=None):
        """``(o [B, T, HV, V] in q's dtype, final state [N, HV, K, V] fp32 or None)``; inputs as the op got them.
        ``final_state``: where the final state goes (``h0`` itself: the state updated in place), or a fresh tensor."""
        launch = _launcher()
        kwargs = dict(
            scale=opts.scale, output_final_state=output_final_state, final_state=final_state,
            use_qk_l2norm_in_kernel=opts.use_qk_l2norm_in_kernel, use_gate_in_kernel=opts.use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=opts.use_beta_sigmoid_in_kernel, allow_neg_eigval=opts.allow_neg_eigval,
            lower_bound=opts.lower_bound,
        )
        if q.device.type == "cuda" and q.device.index != torch.cuda.current_device():
            with torch.cuda.device(q.device):  # Triton launches on the current device
                return launch(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, **kwargs)
        return launch(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, **kwargs)



register_backend(TritonDecodeBackend(), priority=20)
