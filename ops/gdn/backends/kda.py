"""GDN through the KDA op: the per-head gate broadcast over the K key channels.

With ``g_t`` the same on every key channel, KDA's per-channel decay ``diag(exp(g_t))`` is GDN's scalar
``exp(g_t)``: the results are GDN's exactly. The call goes through ``torch.ops.kda_compile.chunk_kda_fwd``
/ ``chunk_kda_bwd`` / ``fused_recurrent_kda_fwd``, so KDA's own backend choice applies (on CUDA: FLA's KDA
kernels, or our Triton prefill and decode kernels when FLA is missing; ``kda_compile.ops.kda.backends.registry``).
Decode without FLA runs ``decode_kernel`` (``decode/backend.py``: the same decode kernel with the scalar gate) ahead of
this route; it comes here under ``only_backends("kda_kernels")`` or when that kernel fails to compile.

Costs of the route (why it ranks below FLA's GDN kernels, docs/gdn.md section 3):

- KDA's kernels do per-channel work (decay exponentials and gate cumsums over K channels) that a scalar
  gate does not need;
- the KDA kernels read the gate as a contiguous ``[B, T, HV, K]`` tensor, so the broadcast gate is
  materialised: ``K`` times the gate's memory (at K = 128 in fp32, 512 bytes per token and value head)
  and one extra write and read of it; its gradient comes back per channel and is summed over K here;
- the in-kernel gate's ``dt_bias`` ``[HV]`` is repeated to KDA's ``[HV * K]`` (tiny).

Ops layer only: this module uses the KDA ops and KDA's backend registry read-only.
"""
from __future__ import annotations

import torch
from kda_compile.ops.delta_rule.custom_ops import pad_residuals
from kda_compile.ops.gdn.backends.registry import (
    GDNOptions,
    explicitly_requested,
    register_backend,
)
from kda_compile.ops.kda import custom_ops as kda_ops
from kda_compile.ops.kda.backends.registry import KDAOptions
from kda_compile.ops.kda.backends.registry import select_backend as select_kda_backend

KDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def _kda_options(opts: GDNOptions) -> KDAOptions:
    return KDAOptions(scale=opts.scale, use_qk_l2norm_in_kernel=opts.use_qk_l2norm_in_kernel,
                      use_gate_in_kernel=opts.use_gate_in_kernel,
                      use_beta_sigmoid_in_kernel=opts.use_beta_sigmoid_in_kernel,
                      allow_neg_eigval=opts.allow_neg_eigval, chunk_size=opts.chunk_size)


def _flags(opts: GDNOptions) -> tuple:
    return (opts.use_qk_l2norm_in_kernel, opts.use_gate_in_kernel, opts.use_beta_sigmoid_in_kernel,
            opts.allow_neg_eigval, None)  # None: KDA's lower_bound (GDN's gate is the softplus form)


def per_channel_gate(g: torch.Tensor, K: int) -> torch.Tensor:
    """``[B, T, HV]`` -> contiguous ``[B, T, HV, K]``, the same decay on every key channel."""
    return g.unsqueeze(-1).expand(*g.shape, K).contiguous()


def per_channel_bias(dt_bias: torch.Tensor | None, K: int) -> torch.Tensor | None:
    """GDN's ``dt_bias`` ``[HV]`` as KDA's ``[HV * K]``."""
    return None if dt_bias is None else dt_bias.reshape(-1, 1).expand(-1, K).reshape(-1)


class KDAKernelsBackend:
    name = "kda_kernels"
    serves = frozenset({"chunk_gdn", "fused_recurrent_gdn"})

    def unsupported_reason(self, device, dtype, K, V, opts) -> str | None:
        if device.type != "cuda" and not explicitly_requested(self.name):
            return f"serves CUDA (on {device.type} GDN's own reference is cheaper than KDA's per-channel one)"
        if dtype not in KDA_DTYPES:
            return f"the KDA kernels take float16/bfloat16/float32, got {dtype}"
        if max(K, V) > MAX_HEAD_DIM:
            return f"the KDA kernels take K, V <= {MAX_HEAD_DIM}, got K={K}, V={V}"
        return None

    def residual_meta(self, q, k, v, opts, save):
        kda_opts = _kda_options(opts)
        backend = select_kda_backend("chunk_kda", q.device, q.dtype, q.shape[-1], v.shape[-1], kda_opts)
        return backend.residual_meta(q, k, v, kda_opts, save)

    def chunk_forward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts, output_final_state, save,
                      cu_seqlens_cpu=None):
        K = q.shape[-1]
        if not save and cu_seqlens_cpu is not None:  # eager inference: KDA's direct path plans on the host
            o, final = kda_ops.chunk_kda_inference(
                q, k, v, per_channel_gate(g, K), beta, A_log, per_channel_bias(dt_bias, K), h0, cu_seqlens,
                opts.scale, output_final_state, *_flags(opts), False, opts.chunk_size, cu_seqlens_cpu)
            return o, (final if output_final_state else None), []
        o, final, *residuals = torch.ops.kda_compile.chunk_kda_fwd(
            q, k, v, per_channel_gate(g, K), beta, A_log, per_channel_bias(dt_bias, K), h0, cu_seqlens,
            opts.scale, output_final_state, *_flags(opts), False, opts.chunk_size, save, False)
        used = len(self.residual_meta(q, k, v, opts, save))
        return o, (final if output_final_state else None), residuals[:used]

    def chunk_backward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, residuals, do, dht, opts):
        K = q.shape[-1]
        padded = pad_residuals(q, residuals)  # the KDA op's residual slots
        dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 = torch.ops.kda_compile.chunk_kda_bwd(
            q, k, v, per_channel_gate(g, K), beta, A_log, per_channel_bias(dt_bias, K), h0, cu_seqlens, *padded,
            do, dht, opts.scale, *_flags(opts), False, opts.chunk_size, True, False)
        dg = dg.float().sum(-1)  # the gate reached every key channel: its gradient is the sum over them
        ddt_bias = ddt_bias.float().view(-1, K).sum(-1) if dt_bias is not None else None
        return (dq, dk, dv, dg, dbeta, dA_log if A_log is not None else None, ddt_bias,
                dh0 if h0 is not None else None)

    def recurrent_forward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts, output_final_state):
        K = q.shape[-1]
        o, final = torch.ops.kda_compile.fused_recurrent_kda_fwd(
            q, k, v, per_channel_gate(g, K), beta, A_log, per_channel_bias(dt_bias, K), h0, cu_seqlens,
            opts.scale, output_final_state, *_flags(opts))
        return o, (final if output_final_state else None)


register_backend(KDAKernelsBackend(), priority=5)
