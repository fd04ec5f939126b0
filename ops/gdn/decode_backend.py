"""GDN decode (``fused_recurrent_gdn``) on our fused Triton step with the scalar gate (``decode.py``): the
``decode_kernel`` backend.

Registered BELOW FLA (priority 8 < 10) and above the KDA route (5): with fla-core installed FLA's fused
recurrent step stays the default (ours is not yet measured on a GPU); without it this backend serves CUDA decode
in place of the KDA route, which fed KDA's decode kernel a gate broadcast over the K channels (a
``[B, T, HV, K]`` tensor written and read, K exponentials per row where one suffices). ``only_backends
("decode_kernel")`` runs it anyway (benchmarks; on CPU under the Triton interpreter, tests).

A Triton kernel that fails to compile for a call variant is our bug, not the user's: the call is served by the
next backend (FLA, the KDA route, the reference), recorded, and the variant is not tried again.
"""
from __future__ import annotations

import importlib
from functools import cache

import torch
from kda_compile.ops._common import (
    compile_failure_reason,
    module_unusable,
    record_fallback,
    triton_compile_errors,
)
from kda_compile.ops.gdn.backends import REFERENCE, GDNOptions, explicitly_requested, register_backend

KERNEL_MODULE = "kda_compile.ops.gdn.decode"
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256  # the kernel keeps a [next_pow2(K), BV] fp32 state tile in registers
_failed_variants: dict[tuple, str] = {}  # call variants whose kernel did not compile -> the reason


@cache
def _kernel_unusable() -> str | None:
    return module_unusable(KERNEL_MODULE)


@cache
def _launcher():
    return importlib.import_module(KERNEL_MODULE).fused_recurrent_gdn_triton


class DecodeKernelBackend:
    name = "decode_kernel"
    serves = frozenset({"fused_recurrent_gdn"})

    def unsupported_reason(self, device, dtype, K, V, opts: GDNOptions) -> str | None:
        if device.type != "cuda" and not explicitly_requested(self.name):
            return f"needs CUDA, got {device.type}"
        if dtype not in KERNEL_DTYPES:
            return f"the decode kernel takes float16/bfloat16/float32, got {dtype}"
        if K > MAX_HEAD_DIM:
            return f"the decode kernel keeps K <= {MAX_HEAD_DIM} in registers, got K={K}"
        return _kernel_unusable()

    def recurrent_forward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts, output_final_state):
        """``(o [B, T, HV, V] in q's dtype, final state [N, HV, K, V] fp32 or None)``; inputs as the op got them."""
        reason = _failed_variants.get(_variant(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts,
                                               output_final_state)) if _failed_variants else None
        if reason is None:
            try:
                return _launch(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts, output_final_state)
            except triton_compile_errors() as error:
                reason = compile_failure_reason("our Triton decode kernel (scalar gate)", error)
                _failed_variants[_variant(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts,
                                          output_final_state)] = reason
        fallback = _next_backend(q, v, opts)
        record_fallback("fused_recurrent_gdn", fallback.name, reason)
        return fallback.recurrent_forward(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts, output_final_state)


def _variant(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts, output_final_state) -> tuple:
    """What selects one compiled kernel variant (built only once some variant has failed: decode is host-bound)."""
    return (q.device, q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, tuple(q.shape[2:]), tuple(v.shape[2:]),
            cu_seqlens is not None and cu_seqlens.dtype, h0 is not None and h0.dtype, output_final_state,
            A_log is not None, dt_bias is not None, opts)


def _launch(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts, output_final_state):
    launch = _launcher()
    kwargs = dict(scale=opts.scale, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=opts.use_qk_l2norm_in_kernel, use_gate_in_kernel=opts.use_gate_in_kernel,
                  use_beta_sigmoid_in_kernel=opts.use_beta_sigmoid_in_kernel, allow_neg_eigval=opts.allow_neg_eigval)
    if q.device.type == "cuda" and q.device.index != torch.cuda.current_device():
        with torch.cuda.device(q.device):  # Triton launches on the current device
            return launch(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, **kwargs)
    return launch(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, **kwargs)


def _next_backend(q, v, opts):
    """The backend that serves a call this one could not run: FLA's step, else the KDA route, else the reference."""
    from kda_compile.ops.gdn.fla_backend import FLAGDNBackend
    from kda_compile.ops.gdn.kda_backend import KDAKernelsBackend

    for backend in (FLAGDNBackend(), KDAKernelsBackend()):
        if backend.unsupported_reason(q.device, q.dtype, q.shape[-1], v.shape[-1], opts) is None:
            return backend
    return REFERENCE


register_backend(DecodeKernelBackend(), priority=8)
