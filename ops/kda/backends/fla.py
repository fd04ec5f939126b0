"""KDA on CUDA through flash-linear-attention's (FLA) Triton kernels.

We call FLA 0.6's internal, autograd-free functions (``chunk_kda_fwd`` / ``chunk_kda_bwd`` /
``fused_recurrent_kda_fwd`` and the beta-sigmoid helpers), never its public entry points: those are
marked for Dynamo to skip (a graph break at every call) and wrapped in an ``autograd.Function`` that
Dynamo cannot see through. Our custom ops own autograd instead.

The chunked forward runs FLA's gate cumsum and intra-chunk kernels (``w, u, qg, kg, A_qk, A_kk``), then
our recurrence kernel over those intermediates (``backends/fla_scan.py``) in place of FLA's last two kernels
(chunk states to memory, then the output from them): the same roundings in the same order, so in bf16
its outputs equal FLA's bitwise, and the forward takes no more time than FLA's ``chunk_kda`` (docs/kda-kernels.md
section 6).
Calls our scan kernel does not take (chunk size 32, K or V above 256) run FLA's whole forward, with a
logged reason that the rewrite report shows.

Around FLA's kernels, the in-kernel q/k L2 norm (forward and backward, so that its outputs can be kept)
and the zeroing of what FLA leaves unwritten in ``Aqk`` (its upper triangles: our op's outputs must not
depend on what the allocator held; FLA allocates ``Akk`` zero-filled) run in our own kernels
(``backends/fla_glue.py``). What the forward keeps for the backward is what FLA's own autograd
function keeps: the chunk-local gate cumsum (when the gate is not computed in the kernel), ``Aqk``,
``Akk``, and, with the in-kernel L2 norm, the normalised q/k and their ``rstd``; these stand in for the
raw q/k, which the op then does not keep (``input_stand_ins``), so activation memory is FLA's. The
activated beta (``[B, T, HV]``, one tiny launch) is recomputed. With ``keep_intermediates`` (FLA's
``disable_recompute``) the forward also keeps FLA's ``w, u, qg, kg, v_new, h`` (and the gate cumsum under
the in-kernel gate), and the backward takes them instead of recomputing them.

Finished gates (``use_gate_in_kernel=False``) are floored at ``GATE_FLOOR`` before FLA's kernels: FLA forms every
decay as a difference of chunk-local cumulative sums, so a gate of -inf gives inf - inf (NaN from the chunk start
on) and -1e30 swamps the sums (measured: relative error 1 on the following tokens). A step of ``GATE_FLOOR`` decays
the state by e^-40 (4e-18: a reset to well within every dtype's rounding), and 64 such steps sum to -2560, whose
fp32 spacing (2.4e-4) bounds the error they add to the decays of the tokens after them. The gradient of a floored
gate is 0, as the recurrence's is for a gate of -inf (and, to within e^-40, for any gate below the floor).

FLA is imported lazily on the first CUDA call; a missing or incompatible fla-core makes the
backend report itself unsupported (with the reason) and the reference serves instead.
"""
from __future__ import annotations

import importlib
import logging
from functools import cache

import torch

from kda_compile.ops._common import load_fla_internals, record_fallback
from kda_compile.ops.kda.backends.registry import KDAOptions, register_backend

logger = logging.getLogger("kda_compile.ops.kda")

NORMALISED_QK = 3  # residuals[3:7] = normalised q, its rstd, normalised k, its rstd (in-kernel L2 norm only)
FLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GATE_FLOOR = -40.0  # finished log gates below it are a reset (module docstring)
RCP_LN2 = 1.4426950408889634  # 1 / ln 2: FLA's gate cumsum is in log2 units
SCAN_CHUNK, SCAN_MAX_HEAD_DIM = 64, 256  # what our scan kernel takes (prefill/run.py)


@cache
def _load_fla():
    """Import FLA's internals once. Returns (namespace, None) or (None, reason)."""
    return load_fla_internals({
        "chunk_kda_fwd": "fla.ops.kda.chunk_fwd:chunk_kda_fwd",
        "chunk_kda_bwd": "fla.ops.kda.chunk_bwd:chunk_kda_bwd",
        "chunk_kda_fwd_intra": "fla.ops.kda.chunk_intra:chunk_kda_fwd_intra",
        "kda_gate_chunk_cumsum": "fla.ops.kda.gate:kda_gate_chunk_cumsum",
        "chunk_local_cumsum": "fla.ops.utils:chunk_local_cumsum",
        "fused_recurrent_kda_fwd": "fla.ops.kda.fused_recurrent:fused_recurrent_kda_fwd",
        "beta_sigmoid_fwd": "fla.ops.common.gate:fused_beta_sigmoid_fwd",
        "beta_sigmoid_bwd": "fla.ops.common.gate:fused_beta_sigmoid_bwd",
        "prepare_chunk_indices": "fla.ops.utils.index:prepare_chunk_indices",
    })


@cache
def glue_kernels():
    """Our Triton kernels around FLA's (``backends/fla_glue.py``), imported on first use: triton is there
    whenever fla-core is, but importing kda_compile must not need it."""
    return importlib.import_module("kda_compile.ops.kda.backends.fla_glue")


@cache
def scan_kernels():
    """Our scan kernel over FLA's intermediates (``backends/fla_scan.py``), imported on first use."""
    return importlib.import_module("kda_compile.ops.kda.backends.fla_scan")


def our_scan_unsupported_reason(K: int, V: int, opts: KDAOptions) -> str | None:
    """Why a chunked call runs FLA's own recurrence and output kernels instead of our scan (None: it does not)."""
    if opts.chunk_size != SCAN_CHUNK:
        return f"our scan kernel takes chunk_size {SCAN_CHUNK}, got {opts.chunk_size}"
    if max(K, V) > SCAN_MAX_HEAD_DIM:
        return f"our scan kernel takes K and V <= {SCAN_MAX_HEAD_DIM}, got K={K}, V={V}"
    return None


def _contiguous(*tensors):
    return [t.contiguous() if t is not None else None for t in tensors]


_INDEX_CACHE_SIZE = 64
_index_cache: dict[tuple, torch.Tensor] = {}  # (offsets, chunk size, device) -> FLA's chunk indices


class FLABackend:
    name = "fla"

    def unsupported_reason(self, device, dtype, K, V, opts: KDAOptions) -> str | None:
        if device.type != "cuda":
            return f"needs CUDA, got {device.type}"
        if dtype not in FLA_DTYPES:
            return f"FLA kernels take float16/bfloat16/float32, got {dtype}"
        if opts.chunk_size not in (32, 64):
            return f"FLA takes chunk_size 32 or 64, got {opts.chunk_size}"
        return _load_fla()[1]

    # -- forward / backward (chunked) -------------------------------------------------------------
    def residual_meta(self, q, k, v, opts, save):
        if not save:
            return []
        B, T, _, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        bt = opts.chunk_size
        keep = opts.keep_intermediates
        # FLA keeps the gate cumsum under the in-kernel gate only when it keeps its intermediates
        g_cumsum = ((0,), torch.float32) if opts.use_gate_in_kernel and not keep else ((B, T, HV, K), torch.float32)
        metas = [g_cumsum, ((B, T, HV, bt), k.dtype), ((B, T, HV, bt), k.dtype)]
        if opts.use_qk_l2norm_in_kernel:  # the normalised q / k and their rstd (NORMALISED_QK)
            metas += [(tuple(q.shape), q.dtype), ((B, T, q.shape[2]), torch.float32),
                      (tuple(k.shape), k.dtype), ((B, T, k.shape[2]), torch.float32)]
        if keep:  # FLA 0.6's w, u, qg, kg, v_new [B, T, HV, .] and the chunk states h [B, chunks, HV, K, V]
            qk_like, v_like = ((B, T, HV, K), k.dtype), ((B, T, HV, V), v.dtype)
            metas += [qk_like, v_like, qk_like, qk_like, v_like, ((B, -(-T // bt), HV, K, V), k.dtype)]
        return metas

    def input_stand_ins(self, q, k, v, opts, save):
        """With the in-kernel L2 norm the backward reads q / k only through their normalised copies."""
        if not (save and opts.use_qk_l2norm_in_kernel):
            return {}
        return {"q": NORMALISED_QK, "k": NORMALISED_QK + 2}

    @staticmethod
    def _beta(fla, beta, opts):
        if not opts.use_beta_sigmoid_in_kernel:
            return beta
        return fla["beta_sigmoid_fwd"](beta, scale=2.0 if opts.allow_neg_eigval else 1.0)

    def _chunk_indices(self, fla, cu_seqlens, opts, cu_seqlens_cpu=None):
        """FLA's chunk indices; from the host copy of the offsets when the caller has one (no device sync).

        Their number depends on the offsets' values, so FLA computes them with a device synchronisation, which a
        CUDA graph capture forbids. With ``cu_seqlens_cpu`` they are kept per (offsets, chunk size, device)
        (``_INDEX_CACHE_SIZE`` entries): a capture reuses those of its warm-up call (torch.cuda.graphs asks for
        one), and a capture without one says so instead of failing inside FLA."""
        if cu_seqlens is None:
            return None
        capturing = cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()
        if cu_seqlens_cpu is None:
            if capturing:
                raise RuntimeError("chunk_kda with cu_seqlens on FLA's kernels cannot be captured in a CUDA graph "
                                   "without cu_seqlens_cpu: the chunk plan needs the offsets on the host (pass "
                                   "cu_seqlens_cpu, and make one call with the same offsets before the capture)")
            return fla["prepare_chunk_indices"](cu_seqlens, opts.chunk_size)
        key = (tuple(cu_seqlens_cpu.tolist()), opts.chunk_size, cu_seqlens.device)
        indices = _index_cache.get(key)
        if indices is None:
            if capturing:
                raise RuntimeError("chunk_kda with cu_seqlens on FLA's kernels: a CUDA graph capture needs one call "
                                   "with the same cu_seqlens_cpu before it (the chunk plan is copied to the device "
                                   "then, which a capture cannot do)")
            indices = fla["prepare_chunk_indices"](cu_seqlens, opts.chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)
            if len(_index_cache) >= _INDEX_CACHE_SIZE:
                del _index_cache[next(iter(_index_cache))]
            _index_cache[key] = indices
        return indices

    def chunk_forward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts, output_final_state, save,
                      cu_seqlens_cpu=None):
        fla = _load_fla()[0]
        q, k, v, g, beta, h0 = _contiguous(q, k, v, g, beta, h0)
        if not opts.use_gate_in_kernel:
            g = g.clamp_min(GATE_FLOOR)  # NaN stays NaN
        qn, kn, normalised = q, k, []
        if opts.use_qk_l2norm_in_kernel:
            (qn, q_rstd), (kn, k_rstd) = glue_kernels().l2norm_fwd(q), glue_kernels().l2norm_fwd(k)
            normalised = [qn, q_rstd, kn, k_rstd]
        beta_act = self._beta(fla, beta, opts)
        keep = save and opts.keep_intermediates
        chunk_indices = self._chunk_indices(fla, cu_seqlens, opts, cu_seqlens_cpu)
        reason = our_scan_unsupported_reason(q.shape[-1], v.shape[-1], opts)
        if reason is None:
            o, final, g_cumsum, Aqk, Akk, w, u, qg, kg, v_new, h = self._forward_with_our_scan(
                fla, qn, kn, v, g, beta_act, A_log, dt_bias, h0, cu_seqlens, chunk_indices, opts,
                output_final_state, keep)
        else:
            record_fallback("chunk_kda", "fla (FLA's own recurrence and output kernels)", reason)
            o, final, g_cumsum, Aqk, Akk, w, u, qg, kg, v_new, h, _ = fla["chunk_kda_fwd"](
                q=qn, k=kn, v=v, g=g, beta=beta_act, scale=opts.scale, initial_state=h0,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                chunk_size=opts.chunk_size, safe_gate=opts.safe_gate, lower_bound=opts.lower_bound,
                use_gate_in_kernel=opts.use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, disable_recompute=keep,
            )
        residuals = []
        if save:
            g_saved = q.new_empty(0, dtype=torch.float32) if g_cumsum is None else g_cumsum
            glue_kernels().zero_above_diagonal_(Aqk, cu_seqlens)  # FLA zero-fills Akk itself, not Aqk
            residuals = [g_saved, Aqk, Akk, *normalised]
            if keep:
                residuals += [w, u, qg, kg, v_new, h]
        return o.to(q.dtype), final, residuals

    @staticmethod
    def _forward_with_our_scan(fla, qn, kn, v, g, beta_act, A_log, dt_bias, h0, cu_seqlens, chunk_indices, opts,
                               output_final_state, keep):
        """FLA 0.6's ``chunk_kda_fwd`` (same arguments and results) with our scan kernel in place of its
        ``chunk_gated_delta_rule_fwd_h`` and ``chunk_gla_fwd_o_gk``. FLA's intra pass is asked for ``qg``
        (``disable_recompute``), which our scan reads instead of forming ``q 2^G`` per value block."""
        chunking = dict(chunk_size=opts.chunk_size, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
        if opts.use_gate_in_kernel:
            g_cumsum = fla["kda_gate_chunk_cumsum"](g=g, A_log=A_log, dt_bias=dt_bias, scale=RCP_LN2,
                                                   lower_bound=opts.lower_bound, **chunking)
        else:
            g_cumsum = fla["chunk_local_cumsum"](g=g, scale=RCP_LN2, **chunking)
        w, u, qg, kg, Aqk, Akk = fla["chunk_kda_fwd_intra"](
            q=qn, k=kn, v=v, gk=g_cumsum, beta=beta_act, scale=opts.scale, safe_gate=opts.safe_gate,
            disable_recompute=True, **chunking)
        o, final, h, v_new = scan_kernels().scan_fla_intermediates(
            qg, w, u, kg, Aqk, g_cumsum, h0, cu_seqlens, scale=opts.scale, output_final_state=output_final_state,
            store_states=keep)
        if not keep:  # what FLA's forward returns: the intermediates only when kept, the gate cumsum unless in-kernel
            w = u = qg = kg = None
            g_cumsum = None if opts.use_gate_in_kernel else g_cumsum
        return o, final, g_cumsum, Aqk, Akk, w, u, qg, kg, v_new, h

    def chunk_backward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, residuals, do, dht, opts):
        fla = _load_fla()[0]
        q, k, v, g, beta, h0, do, dht = _contiguous(q, k, v, g, beta, h0, do, dht)
        g_cumsum, Aqk, Akk, *rest = residuals
        # With the in-kernel L2 norm, q / k are the normalised copies standing in for the raw ones
        normalised, kept = (rest[:4], rest[4:]) if opts.use_qk_l2norm_in_kernel else ([], rest)
        qn, q_rstd, kn, k_rstd = normalised if opts.use_qk_l2norm_in_kernel else (q, None, k, None)
        beta_act = self._beta(fla, beta, opts)
        intermediates = dict(zip(("w", "u", "qg", "kg", "v_new", "h"), kept))  # with keep_intermediates
        dq, dk, dv, db, dg, dh0, dA, dbias = fla["chunk_kda_bwd"](
            q=qn, k=kn, v=v, beta=beta_act, Aqk=Aqk, Akk=Akk, scale=opts.scale, initial_state=h0, do=do,
            dht=dht, g=None if opts.use_gate_in_kernel and not kept else g_cumsum,
            g_org=g if opts.use_gate_in_kernel else None, cu_seqlens=cu_seqlens,
            chunk_indices=self._chunk_indices(fla, cu_seqlens, opts), chunk_size=opts.chunk_size,
            safe_gate=opts.safe_gate, lower_bound=opts.lower_bound, use_gate_in_kernel=opts.use_gate_in_kernel,
            A_log=A_log, dt_bias=dt_bias, disable_recompute=bool(kept), **intermediates,
        )
        if opts.use_qk_l2norm_in_kernel:
            dq, dk = glue_kernels().l2norm_bwd(qn, q_rstd, dq), glue_kernels().l2norm_bwd(kn, k_rstd, dk)
        if opts.use_beta_sigmoid_in_kernel:
            db = fla["beta_sigmoid_bwd"](x=beta, dy=db, scale=2.0 if opts.allow_neg_eigval else 1.0)
        if not opts.use_gate_in_kernel:
            dg = dg.masked_fill(g < GATE_FLOOR, 0.0)  # the floored gates (chunk_forward)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), db.to(beta.dtype),
                dA, dbias, dh0)

    # -- decode ----------------------------------------------------------------------------------
    def recurrent_forward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts, output_final_state):
        fla = _load_fla()[0]
        q, k, v, g, beta, h0 = _contiguous(q, k, v, g, beta, h0)
        o, final = fla["fused_recurrent_kda_fwd"](
            q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0, scale=opts.scale,
            output_final_state=output_final_state, inplace_final_state=False, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=opts.use_qk_l2norm_in_kernel, use_gate_in_kernel=opts.use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=opts.use_beta_sigmoid_in_kernel, allow_neg_eigval=opts.allow_neg_eigval,
            lower_bound=opts.lower_bound,
        )
        return o.to(q.dtype), final  # FLA allocates o like v


register_backend(FLABackend(), priority=10)
