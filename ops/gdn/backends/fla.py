"""GDN on CUDA through flash-linear-attention's (FLA) gated-delta-rule kernels (fla-core 0.6).

We call FLA's autograd-free internals (``chunk_gated_delta_rule_fwd`` / ``_bwd``,
``fused_recurrent_gated_delta_rule_fwd``, the L2-norm and beta-sigmoid helpers), never its public entry
points: those are ``torch.compiler.disable``d (a graph break at every call) and wrap an
``autograd.Function`` Dynamo cannot see through. Our custom ops own autograd.

What the forward keeps for the backward is what FLA's autograd function keeps: the chunk-local gate
cumsum (``[B, T, HV]`` fp32), the solved WY matrix ``A`` (``[B, T, HV, chunk]``), and with the in-kernel
L2 norm the normalised q / k with their ``rstd`` (the op then still keeps the raw q / k: GDN's are small
next to ``A``). The activated beta is recomputed in the backward (one tiny launch).

FLA is imported lazily on the first CUDA call and version-checked; a missing or other fla-core makes the
backend report itself unsupported with the reason, and the next backend serves (logged).
"""
from __future__ import annotations

import importlib.util
import logging
from functools import cache

import torch
from kda_compile.ops._common import load_fla_internals
from kda_compile.ops.gdn.backends.registry import GDNOptions, register_backend
from kda_compile.ops.kda.backends.fla import FLABackend as _KDAFLABackend

logger = logging.getLogger("kda_compile.ops.gdn")

FLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


@cache
def _load_fla():
    """FLA's internals, once: ``(namespace, None)`` or ``(None, reason)``."""
    return load_fla_internals({
        "chunk_fwd": "fla.ops.gated_delta_rule.chunk:chunk_gated_delta_rule_fwd",
        "chunk_bwd": "fla.ops.gated_delta_rule.chunk:chunk_gated_delta_rule_bwd",
        "recurrent_fwd": "fla.ops.gated_delta_rule.fused_recurrent:fused_recurrent_gated_delta_rule_fwd",
        "l2norm_fwd": "fla.modules.l2norm:l2norm_fwd",
        "l2norm_bwd": "fla.modules.l2norm:l2norm_bwd",
        "beta_sigmoid_fwd": "fla.ops.common.gate:fused_beta_sigmoid_fwd",
        "beta_sigmoid_bwd": "fla.ops.common.gate:fused_beta_sigmoid_bwd",
        "prepare_chunk_indices": "fla.ops.utils.index:prepare_chunk_indices",
    }, _KEYWORDS_USED)


# The keywords each FLA internal is called with (checked at load: a release that renamed one is refused, with
# the reason, instead of failing inside a call).
_KEYWORDS_USED = {
    "chunk_fwd": {"q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "cu_seqlens",
                  "chunk_indices", "use_gate_in_kernel", "A_log", "dt_bias", "chunk_size"},
    "chunk_bwd": {"q", "k", "v", "g", "beta", "A", "scale", "initial_state", "do", "dht", "cu_seqlens",
                  "chunk_indices", "use_gate_in_kernel", "g_input", "A_log", "dt_bias", "chunk_size"},
    "recurrent_fwd": {"q", "k", "v", "g", "beta", "A_log", "dt_bias", "scale", "initial_state", "output_final_state",
                      "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "cu_seqlens"},
}


@cache
def _backward_refusal() -> str | None:
    """Why FLA's gated chunk backward would refuse to run here, or None. fla-core 0.6 raises in
    ``chunk_bwd_dqkwg`` on Hopper with Triton >= 3.4.0 and < 3.7.1 (its kernels give wrong results there)
    unless its tilelang backend serves the call; the check reads FLA's own flags, so a release that lifts
    it lifts ours."""
    try:
        from fla.ops.common import chunk_o
    except Exception as exc:  # _load_fla reports a broken FLA; this only decides training
        return f"import fla.ops.common.chunk_o failed ({type(exc).__name__}: {exc})"
    refused = (getattr(chunk_o, "IS_NVIDIA_HOPPER", False) and getattr(chunk_o, "TRITON_ABOVE_3_4_0", False)
               and not getattr(chunk_o, "TRITON_ABOVE_3_7_1", True))
    if not refused or importlib.util.find_spec("tilelang") is not None:
        return None
    import triton

    return (f"fla-core refuses its gated chunk backward on Hopper with Triton {triton.__version__} (>= 3.4.0 "
            "and < 3.7.1 give wrong results there) unless tilelang is installed: training runs elsewhere "
            "(install Triton >= 3.7.1 or tilelang for FLA's)")


_KDA_FLA = _KDAFLABackend()


def _contiguous(*tensors):
    return [t.contiguous() if t is not None else None for t in tensors]


class FLAGDNBackend:
    name = "fla"
    serves = frozenset({"chunk_gdn", "fused_recurrent_gdn"})

    def unsupported_reason(self, device, dtype, K, V, opts: GDNOptions) -> str | None:
        if device.type != "cuda":
            return f"needs CUDA, got {device.type}"
        if dtype not in FLA_DTYPES:
            return f"FLA kernels take float16/bfloat16/float32, got {dtype}"
        if max(K, V) > MAX_HEAD_DIM:
            return f"FLA's GDN kernels take K, V <= {MAX_HEAD_DIM}, got K={K}, V={V}"
        reason = _load_fla()[1]
        if reason is None and opts.training:
            reason = _backward_refusal()
        return reason

    def residual_meta(self, q, k, v, opts, save):
        if not save:
            return []
        B, T, H, K = q.shape
        HV = v.shape[2]
        metas = [((B, T, HV), torch.float32), ((B, T, HV, opts.chunk_size), k.dtype)]
        if opts.use_qk_l2norm_in_kernel:  # normalised q, its rstd, normalised k, its rstd
            metas += [(tuple(q.shape), q.dtype), ((B, T, H), torch.float32),
                      (tuple(k.shape), k.dtype), ((B, T, H), torch.float32)]
        return metas

    @staticmethod
    def _beta(fla, beta, opts):
        if not opts.use_beta_sigmoid_in_kernel:
            return beta
        return fla["beta_sigmoid_fwd"](beta, scale=2.0 if opts.allow_neg_eigval else 1.0)

    @staticmethod
    def _chunk_indices(fla, cu_seqlens, opts, cu_seqlens_cpu=None):
        """FLA's chunk indices of the packed sequences: KDA's (``ops/kda/backends/fla.py``), kept per (offsets, chunk
        size, device) when the host copy ``cu_seqlens_cpu`` is given, so a packed call does not synchronise and a
        CUDA graph capture reuses those of its warm-up call; without it FLA computes them (one synchronisation)."""
        return _KDA_FLA._chunk_indices(fla, cu_seqlens, opts, cu_seqlens_cpu)

    def chunk_forward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts, output_final_state, save,
                      cu_seqlens_cpu=None):
        fla = _load_fla()[0]
        q, k, v, g, beta, h0 = _contiguous(q, k, v, g, beta, h0)
        normalised = []
        if opts.use_qk_l2norm_in_kernel:
            (q, q_rstd), (k, k_rstd) = fla["l2norm_fwd"](q), fla["l2norm_fwd"](k)
            normalised = [q, q_rstd, k, k_rstd]
        g_cumsum, o, A, final, _, _ = fla["chunk_fwd"](
            q=q, k=k, v=v, g=g, beta=self._beta(fla, beta, opts), scale=opts.scale, initial_state=h0,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            chunk_indices=self._chunk_indices(fla, cu_seqlens, opts, cu_seqlens_cpu),
            use_gate_in_kernel=opts.use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, chunk_size=opts.chunk_size)
        residuals = [g_cumsum.float(), A.to(k.dtype), *normalised] if save else []
        return o.to(q.dtype), final, residuals

    def chunk_backward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, residuals, do, dht, opts):
        fla = _load_fla()[0]
        q, k, v, g, beta, h0, do, dht = _contiguous(q, k, v, g, beta, h0, do, dht)
        g_cumsum, A, *normalised = residuals
        qn, kn = (normalised[0], normalised[2]) if normalised else (q, k)
        dq, dk, dv, db, dg, dh0, dA_log, ddt_bias = fla["chunk_bwd"](
            q=qn, k=kn, v=v, g=g_cumsum, beta=self._beta(fla, beta, opts), A=A, scale=opts.scale,
            initial_state=h0, do=do, dht=dht, cu_seqlens=cu_seqlens,
            chunk_indices=self._chunk_indices(fla, cu_seqlens, opts), use_gate_in_kernel=opts.use_gate_in_kernel,
            g_input=g if opts.use_gate_in_kernel else None, A_log=A_log, dt_bias=dt_bias,
            chunk_size=opts.chunk_size)
        if normalised:
            dq = fla["l2norm_bwd"](normalised[0], normalised[1], dq)
            dk = fla["l2norm_bwd"](normalised[2], normalised[3], dk)
        if opts.use_beta_sigmoid_in_kernel:
            db = fla["beta_sigmoid_bwd"](beta, db, scale=2.0 if opts.allow_neg_eigval else 1.0)
        return dq, dk, dv, dg, db, dA_log, ddt_bias, dh0

    def recurrent_forward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts, output_final_state):
        fla = _load_fla()[0]
        q, k, v, g, beta, h0 = _contiguous(q, k, v, g, beta, h0)
        o, final = fla["recurrent_fwd"](
            q=q, k=k, v=v, g=g, beta=beta, A_log=A_log if opts.use_gate_in_kernel else None,
            dt_bias=dt_bias if opts.use_gate_in_kernel else None, scale=opts.scale, initial_state=h0,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=opts.use_qk_l2norm_in_kernel,
            use_beta_sigmoid_in_kernel=opts.use_beta_sigmoid_in_kernel, allow_neg_eigval=opts.allow_neg_eigval,
            cu_seqlens=cu_seqlens)
        return o.to(q.dtype), final  # FLA allocates o like v


register_backend(FLAGDNBackend(), priority=10)
