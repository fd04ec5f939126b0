"""The reference math the delta-rule ops share (KDA's ``kda_compile.ops.kda.reference``, GDN's
``kda_compile.ops.gdn.reference``): the compute dtype, FLA's L2 norm, and the run of an op's chunked core over
equal-length rows or over packed sequences (``cu_seqlens``). Each op's chunked core and gate stay in its own
reference: the gate's form is what they differ in.

Packed sequences are padded to ``[N, T_max]``: a padded token has gate 0 and beta 0, which leaves the state
untouched, so final states stay exact. Their offsets are read to the host once (``cu_seqlens.tolist()``, as the
padding needs the longest length) and checked there, for free: a call on this path never computes on bad offsets.
"""
from __future__ import annotations

import torch

from kda_compile.ops.delta_rule.validation import check_cu_seqlens_values

L2NORM_EPS = 1e-6


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision inputs, fp64 stays fp64 (for gradcheck-grade tests)."""
    return torch.promote_types(dtype, torch.float32)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x * x) + eps)`` over the last dim (FLA's form: eps inside the sqrt; not F.normalize)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def reference_over_sequences(core, inputs: tuple, q: torch.Tensor, v: torch.Tensor, initial_state, cu_seqlens,
                             scale: float, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``core(q, k, v, g, beta, scale, state, chunk_size)`` (an op's chunked recurrence) on ``inputs``, the call's
    ``(q, k, v, g, beta)`` in the compute dtype with the in-kernel options applied; ``q`` / ``v``: the call's own
    (their dtype is the output's). Returns ``o`` in q's dtype and the final state ``[N, HV, K, V]`` in the
    compute dtype (zero initial states when ``initial_state`` is None)."""
    qf = inputs[0]
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu_seqlens is None:
        state = initial_state.to(qf.dtype, copy=True) if initial_state is not None else qf.new_zeros(B, HV, K, V)
        o, final = core(*inputs, scale, state, chunk_size)
        return o.to(q.dtype), final
    offsets = cu_seqlens.tolist()  # the one host read of this path (the padding needs the longest length)
    check_cu_seqlens_values(offsets, T)
    N = len(offsets) - 1
    state = initial_state.to(qf.dtype, copy=True) if initial_state is not None else qf.new_zeros(N, HV, K, V)
    o, final = run_packed(core, inputs, cu_seqlens, offsets, state, scale, chunk_size)
    return o.unsqueeze(0).to(q.dtype), final


def _pad_varlen(x: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, t_max: int) -> torch.Tensor:
    """Packed ``[1, T, ...]`` -> padded ``[N, t_max, ...]`` (zeros past each sequence's end)."""
    steps = torch.arange(t_max, device=x.device)
    valid = steps[None, :] < lengths[:, None]
    index = torch.where(valid, starts[:, None] + steps[None, :], 0)
    padded = x[0][index]
    mask = valid.view(*valid.shape, *([1] * (padded.dim() - 2)))
    return torch.where(mask, padded, torch.zeros((), dtype=x.dtype, device=x.device))


def run_packed(core, inputs: tuple, cu_seqlens: torch.Tensor, offsets: list[int], state: torch.Tensor,
               scale: float, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``core(q, k, v, g, beta, scale, state, chunk_size)`` (a chunked recurrence over equal-length rows) on the
    non-empty sequences of ``cu_seqlens`` (``offsets``: its checked host copy), padded to ``[n, t_max]``.
    Returns ``o`` ``[T, HV, V]`` scattered back by position and the final states of all N sequences (an
    empty one's is its initial state). Empty sequences are not padded: T + 1 offsets of which most are
    empty (how packed documents arrive, docs/packed-documents.md) cost what the documents alone cost."""
    starts, lengths = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    kept = [i for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])) if b > a]
    v = inputs[2]
    if not kept:
        return v.new_zeros(v.shape[1:]), state
    index = None
    if len(kept) < len(offsets) - 1:
        index = torch.tensor(kept, device=cu_seqlens.device)
        starts, lengths, state_kept = starts[index], lengths[index], state[index]
    else:
        state_kept = state
    t_max = max(offsets[i + 1] - offsets[i] for i in kept)
    padded = [_pad_varlen(x, starts, lengths, t_max) for x in inputs]
    o_pad, final = core(*padded, scale, state_kept, chunk_size)  # [n, t_max, HV, V]
    if index is not None:
        final = state.index_copy(0, index, final)
    steps = torch.arange(t_max, device=v.device)
    valid = steps[None, :] < lengths[:, None]
    positions = (starts[:, None] + steps[None, :])[valid]
    # Scatter back by position (the checked offsets cover every token exactly once).
    o = o_pad.new_zeros(v.shape[1:]).index_put((positions,), o_pad[valid])
    return o, final
