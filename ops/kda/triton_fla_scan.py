"""Our recurrence kernel (``triton_chunk_scan.py``) over FLA 0.6's chunk intermediates.

FLA's chunk_kda forward runs the gate cumsum, the intra-chunk pass (``w, u, kg, A_qk, A_kk``),
then ``chunk_gated_delta_rule_fwd_h`` (the chunk states ``h`` and ``v_new``, written to memory) and
``chunk_gla_fwd_o_gk`` (reads them back for ``o``). Our scan kernel keeps the state on chip and writes
``o`` as it walks the chunks, and cuts long sequences into segments that run in parallel
(``choose_segments``). This launcher runs it on FLA's intermediates as they are:

- ``qg = q 2^G`` (unscaled; FLA's intra pass writes it when asked, ``disable_recompute``) and the
  chunk-local gate cumsum ``G`` (fp32, log2 units), whose last row per chunk gives the chunk decay
  (``GATE_CUMSUM``); the inter-chunk product is scaled as in FLA's output kernel;
- ``A_qk`` as FLA leaves it: scaled, upper triangles unwritten (masked in the kernel);
- it can also write what FLA's backward reads, the chunk states ``h [B, chunks, HV, K, V]`` and ``v_new``
  (``disable_recompute``: besides ``o``; or instead of it, as FLA's recompute step).

Device-agnostic like ``triton_chunk.py`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import torch
import triton

from kda_compile.ops.kda.triton_chunk import (
    CHUNK, MAX_HEAD_DIM, _chunk_offsets, _interpreted, _pow2, _precisions, _state_block, _tuned, scan_segments,
)
from kda_compile.ops.kda.triton_chunk_scan import kda_chunk_scan_kernel, kda_segment_summary_kernel


def scan_fla_intermediates(
    qg: torch.Tensor | None, w: torch.Tensor, u: torch.Tensor, kg: torch.Tensor, Aqk: torch.Tensor,
    g_cumsum: torch.Tensor, initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, *,
    scale: float, output_final_state: bool, store_o: bool = True, store_states: bool = False,
    segments: int | None = None,
):
    """The KDA recurrence over FLA 0.6's chunk intermediates (chunk size 64).

    Args:
        qg: ``[B, T, HV, K]`` FLA's unscaled ``q 2^G`` (None with ``store_o=False``); w, kg: ``[B, T, HV, K]``;
            u: ``[B, T, HV, V]``; Aqk: ``[B, T, HV, 64]`` (scaled, lower triangles read); g_cumsum:
            ``[B, T, HV, K]`` fp32 chunk-local gate cumsum in log2 units. All contiguous.
        initial_state: ``[N, HV, K, V]`` (any strides) or None; N = B, or the sequence count of
            ``cu_seqlens`` (B = 1).
        store_o / store_states: write ``o``; write FLA's ``h`` and ``v_new``.
    Returns:
        ``(o, final_state, h, v_new)``, each None unless asked for: ``o`` ``[B, T, HV, V]`` in w's dtype,
        ``final_state`` ``[N, HV, K, V]`` fp32, ``h`` ``[B, chunks, HV, K, V]`` in kg's dtype (with
        ``cu_seqlens``: ``[1, cdiv(T, 64) + N, ...]``, chunk ``i`` of the packed sequences at ``h[0, i]``,
        the rest unwritten) and ``v_new`` like u.
    """
    B, T, HV, K = w.shape
    V = u.shape[3]
    if store_o and qg is None:
        raise ValueError("scan_fla_intermediates: store_o=True needs qg (FLA's q 2^G), got None")
    qg = w if qg is None else qg  # not read without store_o
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"K and V must be <= {MAX_HEAD_DIM} for the Triton scan kernel, got K={K}, V={V}")
    for name, t in (("qg", qg), ("w", w), ("u", u), ("kg", kg), ("Aqk", Aqk), ("g_cumsum", g_cumsum)):
        if not t.is_contiguous():
            raise ValueError(f"scan_fla_intermediates: {name} must be contiguous (FLA's layout), got strides "
                             f"{tuple(t.stride())}")
    if g_cumsum.dtype != torch.float32:
        raise ValueError(f"scan_fla_intermediates: g_cumsum must be float32, got {g_cumsum.dtype}")
    varlen = cu_seqlens is not None
    N = B if not varlen else cu_seqlens.shape[0] - 1
    if varlen:
        chunk_offsets = _chunk_offsets(cu_seqlens)
        slots = triton.cdiv(T, CHUNK) + N  # an upper bound on the total chunk count: no host sync
    else:
        chunk_offsets = cu_seqlens = w.new_empty(0, dtype=torch.int32)
        slots = triton.cdiv(T, CHUNK)
    dummy = w.new_empty(1, dtype=torch.float32)
    o = h = v_new = final = None
    if store_o:
        o = w.new_zeros(B, T, HV, V) if varlen else w.new_empty(B, T, HV, V)
    if store_states:
        h = kg.new_empty(B, slots, HV, K, V)
        v_new = u.new_zeros(u.shape) if varlen else u.new_empty(u.shape)
    if output_final_state:
        final = w.new_empty(N, HV, K, V, dtype=torch.float32)
    if B * T == 0 or N == 0:
        if final is not None:
            final = initial_state.float().clone() if initial_state is not None else final.zero_()
        return o, final, h, v_new

    dot_bf16, dot_precision, _, combine_precision = _precisions(w.dtype)
    BK, BV = _pow2(K), _state_block(K, V, dot_bf16)
    v_blocks, x_blocks = triton.cdiv(V, BV), triton.cdiv(K + V, BV)
    P = scan_segments(w.device, N, HV, v_blocks, x_blocks, T, varlen, segments)
    common = dict(HV=HV, K=K, V=V, BT=CHUNK, BK=BK, IS_VARLEN=varlen, DOT_BF16=dot_bf16,
                  DOT_PRECISION=dot_precision, GATE_CUMSUM=True)
    fixed = dict(num_warps=1) if _interpreted() else {}
    summary = scratch = dummy
    if P > 1:
        summary = w.new_empty(N * P, HV, K, K + V, dtype=torch.float32)
        scratch = w.new_empty(v_blocks * HV * N * P, BK, BV, dtype=torch.float32)
        kernel = kda_segment_summary_kernel if _interpreted() else _tuned("summary")
        kernel[(x_blocks * HV * N * (P - 1),)](w, u, kg, g_cumsum, summary, cu_seqlens, chunk_offsets, T, P, BX=BV,
                                                **common, **fixed)
    h0 = initial_state if initial_state is not None else dummy
    h0_strides = initial_state.stride() if initial_state is not None else (0, 0, 0, 0)
    kernel = kda_chunk_scan_kernel if _interpreted() else _tuned("scan")
    kernel[(v_blocks * HV * N * P,)](
        w, u, qg, kg, Aqk, g_cumsum, o if store_o else dummy, h0, final if output_final_state else dummy, summary,
        scratch, cu_seqlens, chunk_offsets, T, P, *h0_strides, BV=BV, BKM=min(32, BK),
        HAS_H0=initial_state is not None, STORE_HT=output_final_state, COMBINE_PRECISION=combine_precision,
        H_STATES=h if store_states else dummy, V_NEW=v_new if store_states else dummy, scale=float(scale),
        STORE_O=store_o, STORE_STATES=store_states, **common, **fixed)
    return o, final, h, v_new
