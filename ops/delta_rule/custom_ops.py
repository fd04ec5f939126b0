"""The custom-op glue both delta-rule ops use (``kda_compile.ops.kda.custom_ops``, ``kda_compile.ops.gdn.custom_ops``):
their ops have the same inputs (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, then the scalars), the
same outputs (``o``, the final state, ``MAX_RESIDUALS`` residual slots; gradients in the inputs' order) and the same
contract with their backends (``kda_compile.ops.delta_rule.backends``). What is the same here to the letter: the
backend for an empty call, the fakes, the residual slots, the run-time value checks, and the autograd wiring (what
the forward keeps, the backward on the forward's backend). Each op keeps its schemas (its own options), its options
object and its registration.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kda_compile.ops import envs
from kda_compile.ops._common import is_dtensor, record_fallback
from kda_compile.ops.delta_rule.backends import MAX_RESIDUALS
from kda_compile.ops.delta_rule.validation import check_input_values


def serving_backend(select_backend, reference, op: str, q: Tensor, v: Tensor, opts):
    """The backend ``select_backend`` (the op's registry) picks for a call, or ``reference`` when the call has no
    tokens: nothing to compute, the reference returns the states as they are."""
    if q.shape[0] == 0 or q.shape[1] == 0:
        return reference
    return select_backend(op, q.device, q.dtype, q.shape[-1], v.shape[-1], opts)


def final_state_shape(q, v, cu_seqlens):
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (N, v.shape[2], q.shape[3], v.shape[3])


def run_time_checks(q: Tensor, g: Tensor, cu_seqlens: Optional[Tensor], use_gate_in_kernel: bool) -> None:
    """The full value checks when ``KDA_COMPILE_CHECK_INPUTS`` asks for them. Here, in the op's kernel, they
    see real tensors in eager calls and in compiled graphs alike (a host synchronisation: off by default)."""
    if envs.check_inputs():
        check_input_values(q, g, cu_seqlens=cu_seqlens, use_gate_in_kernel=use_gate_in_kernel)


def pad_residuals(q: Tensor, residuals: list) -> list:
    return list(residuals) + [q.new_empty(0) for _ in range(MAX_RESIDUALS - len(residuals))]


def fake_forward_outputs(backend, q, k, v, cu_seqlens, opts, output_final_state: bool, save: bool) -> tuple:
    """What a chunked delta-rule forward op returns, as empty tensors (its fake): ``o``, the final state (empty
    when not asked for) and ``backend``'s residuals padded to the schema's slots."""
    o = q.new_empty((*q.shape[:2], v.shape[2], v.shape[3]))
    final = q.new_empty(final_state_shape(q, v, cu_seqlens) if output_final_state else (0,), dtype=torch.float32)
    residuals = [q.new_empty(shape, dtype=dtype) for shape, dtype in backend.residual_meta(q, k, v, opts, save)]
    return (o, final, *pad_residuals(q, residuals))


def recurrent_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, output_final_state, *flags):
    """The fake of a decode op (``fused_recurrent_*_fwd``): ``o`` and the final state (empty when not asked for)."""
    o = q.new_empty((*q.shape[:2], v.shape[2], v.shape[3]))
    final_shape = final_state_shape(q, v, cu_seqlens) if output_final_state else (0,)
    return o, q.new_empty(final_shape, dtype=torch.float32)


def recurrent_into_state(backend, q, k, v, g, beta, A_log, dt_bias, state, cu_seqlens, opts) -> Tensor:
    """A decode op that updates its state in place (``fused_recurrent_*_inplace``): ``o``, with the final state
    written over ``state``. A backend that ``writes_final_state_into`` a given tensor (our decode kernels) is handed
    ``state`` and writes it in the launch that reads it; a final state that comes back elsewhere (any other backend,
    or one of ours falling back) is copied over: the same result, one more pass over the state (the backend choice
    itself is logged where it is a fallback)."""
    into = (state,) if getattr(backend, "writes_final_state_into", False) else ()
    o, final = backend.recurrent_forward(q, k, v, g, beta, A_log, dt_bias, state, cu_seqlens, opts, True, *into)
    if final is not state:
        state.copy_(final)
    return o.to(q.dtype).contiguous()


def recurrent_into_state_fake(q, k, v, g, beta, A_log, dt_bias, state, cu_seqlens, scale, *flags):
    """The fake of an in-place decode op: ``o`` (the state is written, not returned)."""
    return q.new_empty((*q.shape[:2], v.shape[2], v.shape[3]))


def backward_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, *rest):
    """The fake of a chunked backward op (``chunk_*_bwd``): one gradient per differentiable input, empty for an
    absent one."""
    like = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    return tuple(t.new_empty(t.shape) if t is not None else q.new_empty(0) for t in like)


def backward_source(op: str, backend, reference, q, k, v, opts, saved: list, residuals_saved: bool):
    """``(backend, residuals)`` a chunked delta-rule backward runs with: ``backend`` with the residuals its forward
    kept (the first of the schema's ``saved`` slots), or, when the forward saved none, ``reference`` recomputing
    the gradients (logged as the fallback of ``op``)."""
    if residuals_saved:
        return backend, saved[:len(backend.residual_meta(q, k, v, opts, True))]
    if backend is not reference:
        record_fallback(f"{op}_backward", reference.name,
                        "the forward ran with save_for_backward=False (no residuals): gradients recomputed")
    return reference, []


def gradient_outputs(grads, like, q: Tensor) -> tuple:
    """A backward op's outputs: each gradient in its input's dtype, contiguous; an empty tensor for an absent
    input (or a gradient the backend did not produce)."""
    return tuple(grad.to(ref.dtype).contiguous() if (ref is not None and grad is not None) else q.new_empty(0)
                 for grad, ref in zip(grads, like))


def _stand_ins(backend, q: Tensor, k: Tensor, v: Tensor, opts, save: bool) -> dict:
    """Inputs the backend's backward reads only through residuals: name -> residual index."""
    stand_ins = getattr(backend, "input_stand_ins", None)
    return stand_ins(q, k, v, opts, save) if stand_ins is not None else {}


def keep_for_backward(ctx, tensors: tuple, output: tuple, backend, opts, *, scale, flags: tuple, chunk_size,
                      output_final_state, save_for_backward) -> None:
    """A chunked forward op's ``setup_context``: ``tensors`` its nine tensor inputs, ``output`` its outputs,
    ``backend`` the backend that ran it (the backward runs there too, whatever is selected when it runs),
    ``flags`` the scalars its backward op takes between ``scale`` and ``chunk_size``. Inputs the backend's
    backward reads only through residuals (``input_stand_ins``) are not kept."""
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens = tensors
    o, _, *residuals = output
    ctx.mark_non_differentiable(*residuals)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the residuals (nor an unused state)
    # DTensor inputs keep q and k: the global metadata of a residual standing in for them is DTensor's own
    # (ops/_sharding.py output_shapes), which on some torch versions is another device's backend's
    stand_ins = {} if is_dtensor(q) else _stand_ins(backend, q, k, v, opts, save_for_backward)
    q_kept = None if "q" in stand_ins else q
    k_kept = None if "k" in stand_ins else k
    ctx.save_for_backward(q_kept, k_kept, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *residuals)
    ctx.stand_ins, ctx.o_meta = stand_ins, (o.shape, o.dtype)
    ctx.scale, ctx.flags, ctx.chunk_size = scale, flags, chunk_size
    ctx.output_final_state, ctx.residuals_saved = output_final_state, save_for_backward
    ctx.backend = backend.name


def chunk_backward(ctx, do, dht, backward_op, extra: tuple, inputs: int) -> tuple:
    """A chunked forward op's autograd backward through ``backward_op`` (its ``chunk_*_bwd``), called with what
    :func:`keep_for_backward` kept and ``extra`` (the op's scalars between ``residuals_saved`` and ``backend``).
    Returns one gradient per input of the forward op (``inputs`` of them; non-tensors and cu_seqlens get None)."""
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *residuals = ctx.saved_tensors
    if "q" in ctx.stand_ins:
        q = residuals[ctx.stand_ins["q"]]
    if "k" in ctx.stand_ins:
        k = residuals[ctx.stand_ins["k"]]
    if do is None:  # o unused: its gradient is zero (grads are not materialised)
        shape, dtype = ctx.o_meta
        do = v.new_zeros(shape, dtype=dtype)
    if dht is not None and not ctx.output_final_state:
        dht = None
    grads = backward_op(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *residuals, do.contiguous(), dht,
        ctx.scale, *ctx.flags, ctx.chunk_size, ctx.residuals_saved, *extra, ctx.backend)
    needed = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    return (*(grad if ref is not None else None for grad, ref in zip(grads, needed)), *([None] * (inputs - 8)))
