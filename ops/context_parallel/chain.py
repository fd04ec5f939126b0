"""Context-parallel chunked delta rule: each rank runs its slice with the ordinary op, and the states that
cross rank boundaries are chained through one differentiable all-gather (docs/context-parallel.md).

The state update is affine in the incoming state, and each column of the ``[K, V]`` state evolves on its own
(``v`` enters column by column). So the piece of the sequence that continues from earlier ranks (local
sequence 0 when ``pre_num_ranks > 0``) runs as two column blocks of the state ``[0 | I]`` with values ``[v | 0]``,
each an ordinary call of the op: ``v`` from the zero state gives the piece's outputs ``o^0`` and state ``B`` as
if it started from zero; zero values from the identity give ``A`` (its final state is the ``[K, K]`` map of the
incoming state) and, per token, ``A_t^T q_t``. With the true incoming state ``S`` (composed from the earlier
ranks' ``[B | A]``)::

    o_t   = o^0_t + S^T (A_t^T q_t)
    final = B + A @ S

The other local sequences start on this rank and run as in a one-process call. Backward is autograd
through the ops, the all-gather (a reduce-scatter of the gradients) and these products: no custom code.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from kda_compile.ops.context_parallel.context import CPContext

# run(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, output_final_state) -> (o, final or None):
# the one-process chunked op (KDA's or GDN's public function with every other option bound), states [N, HV, K, V].
RunChunked = Callable[..., tuple[Tensor, Optional[Tensor]]]


def context_parallel_chunk(run: RunChunked, ctx: CPContext, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                           beta: Tensor, initial_state: Optional[Tensor],
                           output_final_state: bool) -> tuple[Tensor, Optional[Tensor]]:
    """This rank's ``(o, final_state or None)`` of a context-parallel call; arguments already checked.
    ``initial_state`` / the final state: ``[ctx.num_seqs, HV, K, V]`` (K first)."""
    carried, passes_on = not ctx.is_first_rank, not ctx.is_last_rank
    # (o, final) of local sequence 0 continued from earlier ranks, with the [zero-start | A] columns
    continued = _run_continued(run, q, k, v, g, beta, ctx.local_offsets[1]) if carried else None
    # (o, final) of the sequences starting on this rank, or None when there are none
    started = _run_started(run, ctx, q, k, v, g, beta, initial_state, output_final_state or passes_on)
    if any(ctx.crossings):  # every rank joins the all-gather, even one no sequence crosses into or out of
        dtype = _state_dtype(q)
        gathered = _all_gather(_summary(continued, started, passes_on, q, v, dtype), ctx, dtype)
        if carried:
            incoming = _incoming_state(gathered, ctx.rank, ctx.pre_num_ranks, v.shape[-1])
            continued = _apply_incoming(*continued, incoming, v.shape[-1])
        elif gathered.requires_grad:  # every rank must reach the all-gather's backward (a collective)
            started = tuple(None if t is None else _depending_on(t, gathered) for t in started)
    parts = [part for part in (continued, started) if part is not None]
    outputs = [o for o, _ in parts if o is not None]
    o = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    if not output_final_state:
        return o, None
    return o, (parts[0][1] if len(parts) == 1 else torch.cat([final for _, final in parts], dim=0))


def _run_continued(run: RunChunked, q, k, v, g, beta, end: int) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """Tokens ``[0, end)`` as two column blocks of the state ``[0 | I]`` with values ``[v | 0]``: ``((o^0, A_t^T
    q_t), [B | A])``. Two ordinary calls, not one with V + K value columns: each keeps the op's own widths, so the
    kernels that serve a one-process call of these widths serve both (our CUDA kernels need K = V = 128; with
    V + K = 256 columns the continued piece ran on the Triton kernels, and two GPUs were slower than one at
    equal slices: docs/context-parallel.md, section 3)."""
    pieces = q[:, :end], k[:, :end], g[:, :end], beta[:, :end]
    o0, b = run(pieces[0], pieces[1], v[:, :end], *pieces[2:], initial_state=None, cu_seqlens=None,
                cu_seqlens_cpu=None, output_final_state=True)
    HV, K = v.shape[2], q.shape[3]
    zeros = v.new_zeros(v.shape[0], end, HV, K)
    o_a, a = run(pieces[0], pieces[1], zeros, *pieces[2:], initial_state=_identity_state(q, HV), cu_seqlens=None,
                 cu_seqlens_cpu=None, output_final_state=True)
    return (o0, o_a), torch.cat([b, a], dim=-1)


def _run_started(run: RunChunked, ctx: CPContext, q, k, v, g, beta, initial_state, output_final_state: bool):
    """The local sequences after a continued one (all of them when none is continued), as one packed
    one-process call; None when there are none."""
    offsets, first = ctx.local_offsets, 0 if ctx.is_first_rank else 1
    if first == len(offsets) - 1:
        return None
    shift, h0 = offsets[first], None if initial_state is None else initial_state[first:]
    if shift == offsets[-1]:  # empty sequences only (the last rank's): their states are their initial states
        if not output_final_state:
            return None, None
        return None, (h0.to(torch.float32) if h0 is not None else
                      q.new_zeros(len(offsets) - 1 - first, v.shape[2], q.shape[3], v.shape[3], dtype=torch.float32))
    rest_cpu = torch.tensor([x - shift for x in offsets[first:]], dtype=ctx.cu_seqlens_cpu.dtype)
    return run(q[:, shift:], k[:, shift:], v[:, shift:], g[:, shift:], beta[:, shift:], initial_state=h0,
               cu_seqlens=ctx.cu_seqlens[first:] - shift, cu_seqlens_cpu=rest_cpu,
               output_final_state=output_final_state)


def _summary(continued, started, passes_on: bool, q: Tensor, v: Tensor, dtype: torch.dtype) -> Tensor:
    """``[HV, K, V + K]``: ``[B | A]`` of the last local sequence, where a later rank reads it."""
    if passes_on and started is None:  # a middle rank: the slice is one piece of one sequence
        return continued[1][0]
    if passes_on:  # the last sequence starts here: its A is 0
        last = started[1][-1]
        return torch.cat([last, last.new_zeros(*last.shape[:-1], q.shape[-1])], dim=-1)
    return _zero_summary(continued[1] if continued is not None else started[0], q, v, dtype)


def _identity_state(q: Tensor, HV: int) -> Tensor:
    """``[1, HV, K, K]``: the identity per value head."""
    K = q.shape[3]
    return torch.eye(K, dtype=_state_dtype(q), device=q.device).expand(1, HV, K, K).contiguous()


def _state_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _zero_summary(anchor: Tensor, q: Tensor, v: Tensor, dtype: torch.dtype) -> Tensor:
    """What a rank whose last sequence ends here sends (nobody reads it), tied to ``anchor`` so that it requires
    grad exactly when the other ranks' summaries do (then every rank joins the all-gather's backward)."""
    HV, V, K = v.shape[2], v.shape[3], q.shape[3]
    zeros = anchor.new_zeros(HV, K, V + K, dtype=dtype)
    return _depending_on(zeros, anchor) if anchor.requires_grad else zeros


def _depending_on(x: Tensor, other: Tensor) -> Tensor:
    """``x`` unchanged (plus an exact 0: the sum of no element of ``other``) with ``other`` in its autograd
    history. Reads no value of ``other``, so a NaN there cannot reach ``x``."""
    return x + other.flatten()[:0].sum().to(x.dtype)


def _all_gather(summary: Tensor, ctx: CPContext, dtype: torch.dtype) -> Tensor:
    """``[world_size, HV, K, V + K]``: every rank's ``[B | A]`` (in ``dtype``, the same on every rank).
    Differentiable: its backward reduce-scatters the gradients, so each rank receives the sum over ranks of the
    gradient of its own summary."""
    import torch.distributed._functional_collectives as funcol  # here: torch builds without distributed import us

    summary = summary.to(dtype).unsqueeze(0).contiguous()
    if not (torch.is_grad_enabled() and summary.requires_grad):
        # No gradient to carry: the plain collective. The differentiable one has only an autograd kernel in torch
        # 2.11, which inference mode excludes (the error it raises: docs/context-parallel.md, section 6).
        gathered = funcol.all_gather_tensor(summary, 0, ctx.group)
        wait = getattr(gathered, "wait", None)
        return wait() if wait is not None else funcol.wait_tensor(gathered)
    # torch 2.13 renamed the differentiable all-gather (the old name warns there); torch 2.11 has only the old one
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return gather(summary, 0, ctx.group)


def _incoming_state(gathered: Tensor, rank: int, pre_num_ranks: int, V: int) -> Tensor:
    """The state entering this rank: ``S = B_j + A_j S`` over the earlier ranks holding the sequence, from the
    one it starts on (whose ``A`` is 0: its ``B`` is the state). Float64: the chain may be long."""
    chain = gathered[rank - pre_num_ranks:rank].to(torch.float64)
    state = chain[0, ..., :V]
    for j in range(1, pre_num_ranks):
        state = chain[j, ..., :V] + chain[j, ..., V:] @ state
    return state


def _apply_incoming(outputs: tuple[Tensor, Tensor], final: Tensor, incoming: Tensor, V: int) -> tuple[Tensor, Tensor]:
    """Outputs and final state of the continued piece from its zero-start outputs and ``A_t^T q_t``, and its
    ``[B | A]``."""
    o0, o_a = outputs
    compute = torch.promote_types(o0.dtype, torch.float32)
    carried = torch.einsum("bthk,hkv->bthv", o_a.to(compute), incoming.to(compute))
    o = (o0.to(compute) + carried).to(o0.dtype)
    state = final[..., :V].to(torch.float64) + final[..., V:].to(torch.float64) @ incoming
    return o, state.to(final.dtype)
