"""Our recurrence kernel (``prefill/triton/scan.py``) over FLA 0.6's chunk intermediates.

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

Device-agnostic like ``prefill/run.py`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import torch

from kda_compile.ops.kda.prefill.chunks import chunks_in, first_chunk_slots, packed_slot_bound
from kda_compile.ops.kda.prefill.run import MAX_HEAD_DIM, launch_scan


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
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"K and V must be <= {MAX_HEAD_DIM} for the Triton scan kernel, got K={K}, V={V}")
    for name, t in (("qg", w if qg is None else qg), ("w", w), ("u", u), ("kg", kg), ("Aqk", Aqk), ("g_cumsum", g_cumsum)):
        if not t.is_contiguous():
            raise ValueError(f"scan_fla_intermediates: {name} must be contiguous (FLA's layout), got strides "
                             f"{tuple(t.stride())}")
    if g_cumsum.dtype != torch.float32:
        raise ValueError(f"scan_fla_intermediates: g_cumsum must be float32, got {g_cumsum.dtype}")
    varlen = cu_seqlens is not None
    N = B if not varlen else cu_seqlens.shape[0] - 1
    if varlen:
        chunk_offsets = first_chunk_slots(cu_seqlens)
        slots = packed_slot_bound(T, N)  # no host sync
    else:
        chunk_offsets = cu_seqlens = w.new_empty(0, dtype=torch.int32)
        slots = chunks_in(T)
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

    launch_scan(w, u, qg, kg, Aqk, g_cumsum, initial_state, cu_seqlens, chunk_offsets, T=T, N=N, segments=segments,
                o=o, final=final, h=h, v_new=v_new, scale=scale, gate_cumsum=True)
    return o, final, h, v_new
