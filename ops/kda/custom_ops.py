"""``torch.ops.kda_compile`` KDA ops: forward and backward as separate custom ops, fake
implementations with the real outputs' strides, and autograd through ``register_autograd``.

Ops (schemas are inferred from the signatures below):

- ``chunk_kda_fwd(...) -> (o, final_state, res0, ..., res12)``: ``o`` ``[B, T, HV, V]`` in q's dtype;
  ``final_state`` ``[N, HV, K, V]`` float32 (empty when not requested); ``res*``: what the serving
  backend keeps for its backward (empty when ``save_for_backward`` is false or the slot is unused;
  never differentiable). ``keep_intermediates`` (the public ``disable_recompute``) lets a backend keep
  more, so that its backward recomputes less (FLA's: ``w, u, qg, kg, v_new, h``); the backward op gets
  the same flag.
- ``chunk_kda_bwd(...) -> (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0)``: gradients; an empty
  tensor stands for an input that was absent. ``residuals_saved`` says whether the forward ran with
  ``save_for_backward``: when it did not (the public functions never differentiate such a call, but a
  direct caller of the op may), the gradients are recomputed through the reference (logged). Its ``q``
  / ``k`` are the forward's, or the residuals the backend names as their stand-ins (same shape and
  dtype, e.g. the L2-normalised q/k): autograd then does not keep the raw ones alive.
- ``fused_recurrent_kda_fwd(...) -> (o, final_state)``: decode; no autograd (the public function
  takes the chunk op when gradients are needed).
- ``fused_recurrent_kda_inplace(..., state, ...) -> o``: decode writing its final state over ``state`` (its
  initial state; ``mutates_args``): the public ``inplace_final_state=True``; inference only.

Every output is a freshly allocated contiguous tensor, and every fake returns ``new_empty(shape)``,
so fake and real strides agree even for non-contiguous inputs.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kda_compile.ops.delta_rule.custom_ops import (backward_fake, backward_source, chunk_backward,
                                                  fake_forward_outputs, gradient_outputs, keep_for_backward,
                                                  pad_residuals, recurrent_fake, recurrent_into_state,
                                                  recurrent_into_state_fake, run_time_checks, serving_backend)
from kda_compile.ops.kda.backends import fla as fla_backend  # noqa: F401  (registers the FLA backend)
from kda_compile.ops.kda.prefill import backend as prefill_backend  # noqa: F401  (registers our Triton prefill backend)
from kda_compile.ops.kda.decode import backend as decode_backend  # noqa: F401  (registers our Triton decode backend)
from kda_compile.ops.kda.backends.registry import REFERENCE, KDAOptions, backend_named, select_backend


def _options(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
             allow_neg_eigval, lower_bound, safe_gate, chunk_size, keep_intermediates=False) -> KDAOptions:
    return KDAOptions(
        scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, safe_gate=safe_gate, chunk_size=chunk_size, keep_intermediates=keep_intermediates,
    )


def _backend(op: str, q: Tensor, v: Tensor, opts: KDAOptions):
    return serving_backend(select_backend, REFERENCE, op, q, v, opts)


def _check_keep_intermediates(keep_intermediates: bool, cu_seqlens: Optional[Tensor]) -> None:
    """Kept intermediates include one state per chunk: with packed sequences their number depends on the
    lengths (data), which the fake implementation cannot know. The public functions never ask for it."""
    if keep_intermediates and cu_seqlens is not None:
        raise ValueError("keep_intermediates=True needs cu_seqlens=None (the number of kept chunk states would "
                         "depend on the sequence lengths); got cu_seqlens with "
                         f"{cu_seqlens.shape[0] - 1} sequences")


# ------------------------------------------------------------------------------------------------
# chunk_kda_fwd
# ------------------------------------------------------------------------------------------------
@torch.library.custom_op("kda_compile::chunk_kda_fwd", mutates_args=())
def chunk_kda_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    scale: float, output_final_state: bool, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, lower_bound: Optional[float], safe_gate: bool,
    chunk_size: int, save_for_backward: bool, keep_intermediates: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
           Tensor, Tensor]:
    opts = _options(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                    allow_neg_eigval, lower_bound, safe_gate, chunk_size, keep_intermediates)
    _check_keep_intermediates(keep_intermediates, cu_seqlens)
    o, final, residuals = _chunk_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts,
                                         output_final_state, save_for_backward)
    return (o, final, *(r.contiguous() for r in pad_residuals(q, residuals)))


def _chunk_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts, output_final_state, save,
                   cu_seqlens_cpu=None):
    """``(o, final state (empty when not asked for), residuals)`` from the backend serving the call."""
    run_time_checks(q, g, cu_seqlens, opts.use_gate_in_kernel)
    backend = _backend("chunk_kda", q, v, opts)
    host = {} if cu_seqlens_cpu is None or cu_seqlens is None else {"cu_seqlens_cpu": cu_seqlens_cpu}
    o, final, residuals = backend.chunk_forward(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts, output_final_state, save, **host)
    final = final.contiguous() if output_final_state else q.new_empty(0, dtype=torch.float32)
    return o.contiguous(), final, residuals


def chunk_kda_inference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    scale: float, output_final_state: bool, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, lower_bound: Optional[float], safe_gate: bool,
    chunk_size: int, cu_seqlens_cpu: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """``chunk_kda_fwd`` without saving for the backward, called directly by eager inference (see
    ``ops._common.dispatcher_needed``): the same backend and kernels, without the custom-op dispatcher's Python
    path and the thirteen empty residual outputs the op's schema needs (host time per call that can exceed the
    kernels of a short prefill: docs/kda-kernels.md section 8). ``cu_seqlens_cpu`` (the caller's host copy
    of ``cu_seqlens``, same values) lets the backend plan packed sequences on the host: no device-side planning
    kernels, no synchronisation."""
    opts = _options(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                    allow_neg_eigval, lower_bound, safe_gate, chunk_size)
    o, final, _ = _chunk_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts,
                                 output_final_state, False, cu_seqlens_cpu)
    return o, final


@chunk_kda_fwd.register_fake
def _chunk_kda_fwd_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, output_final_state,
                        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                        lower_bound, safe_gate, chunk_size, save_for_backward, keep_intermediates=False):
    opts = _options(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                    allow_neg_eigval, lower_bound, safe_gate, chunk_size, keep_intermediates)
    _check_keep_intermediates(keep_intermediates, cu_seqlens)
    return fake_forward_outputs(_backend("chunk_kda", q, v, opts), q, k, v, cu_seqlens, opts, output_final_state,
                                save_for_backward)


# ------------------------------------------------------------------------------------------------
# chunk_kda_bwd
# ------------------------------------------------------------------------------------------------
@torch.library.custom_op("kda_compile::chunk_kda_bwd", mutates_args=())
def chunk_kda_bwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    res0: Tensor, res1: Tensor, res2: Tensor, res3: Tensor, res4: Tensor, res5: Tensor, res6: Tensor,
    res7: Tensor, res8: Tensor, res9: Tensor, res10: Tensor, res11: Tensor, res12: Tensor,
    do: Tensor, dht: Optional[Tensor],
    scale: float, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool, lower_bound: Optional[float], safe_gate: bool, chunk_size: int,
    residuals_saved: bool = True, keep_intermediates: bool = False, backend: str = "",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    # ``backend``: the backend the forward ran on (its residuals are that backend's); "" selects one as the
    # forward would now.
    opts = _options(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                    allow_neg_eigval, lower_bound, safe_gate, chunk_size, keep_intermediates)
    saved = [res0, res1, res2, res3, res4, res5, res6, res7, res8, res9, res10, res11, res12]
    ran_on = backend_named(backend) if backend else _backend("chunk_kda", q, v, opts)
    runs_on, residuals = backward_source("chunk_kda", ran_on, REFERENCE, q, k, v, opts, saved, residuals_saved)
    grads = runs_on.chunk_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                                   residuals, do, dht, opts)
    return gradient_outputs(grads, (q, k, v, g, beta, A_log, dt_bias, initial_state), q)


chunk_kda_bwd.register_fake(backward_fake)


def _setup_context(ctx, inputs, output):
    scale, output_final_state, *flags, chunk_size, save_for_backward, keep_intermediates = inputs[9:]
    opts = _options(scale, *flags, chunk_size, keep_intermediates)
    keep_for_backward(ctx, inputs[:9], output, _backend("chunk_kda", inputs[0], inputs[2], opts), opts, scale=scale,
                      flags=tuple(flags), chunk_size=chunk_size, output_final_state=output_final_state,
                      save_for_backward=save_for_backward)
    ctx.keep_intermediates = keep_intermediates


def _backward(ctx, do, dht, *residual_grads):
    return chunk_backward(ctx, do, dht, chunk_kda_bwd, (ctx.keep_intermediates,), inputs=20)


torch.library.register_autograd("kda_compile::chunk_kda_fwd", _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------------
# fused_recurrent_kda_fwd (decode)
# ------------------------------------------------------------------------------------------------
def fused_recurrent_kda_impl(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    scale: float, output_final_state: bool, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, lower_bound: Optional[float],
) -> tuple[Tensor, Tensor]:
    """The kernel of ``fused_recurrent_kda_fwd``. Eager decode may call it directly (see
    ``ops._common.dispatcher_needed``): one decode step is a few microseconds of GPU work, and the
    custom-op dispatcher's Python path costs more than that."""
    opts = _options(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                    allow_neg_eigval, lower_bound, False, 64)
    run_time_checks(q, g, cu_seqlens, use_gate_in_kernel)
    backend = _backend("fused_recurrent_kda", q, v, opts)
    o, final = backend.recurrent_forward(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts, output_final_state)
    final = final.contiguous() if output_final_state else q.new_empty(0, dtype=torch.float32)
    return o.contiguous(), final


fused_recurrent_kda_fwd = torch.library.custom_op("kda_compile::fused_recurrent_kda_fwd", mutates_args=())(
    fused_recurrent_kda_impl)


fused_recurrent_kda_fwd.register_fake(recurrent_fake)


def fused_recurrent_kda_inplace_impl(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor], state: Tensor, cu_seqlens: Optional[Tensor],
    scale: float, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool, lower_bound: Optional[float],
) -> Tensor:
    """The kernel of ``fused_recurrent_kda_inplace``: the decode step with its final state written over ``state``
    (the initial state; ``mutates_args``), so a cache's state needs no copy after the step (docs/cuda-graphs.md)."""
    opts = _options(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                    allow_neg_eigval, lower_bound, False, 64)
    run_time_checks(q, g, cu_seqlens, use_gate_in_kernel)
    backend = _backend("fused_recurrent_kda", q, v, opts)
    return recurrent_into_state(backend, q, k, v, g, beta, A_log, dt_bias, state, cu_seqlens, opts)


fused_recurrent_kda_inplace = torch.library.custom_op("kda_compile::fused_recurrent_kda_inplace",
                                                      mutates_args=("state",))(fused_recurrent_kda_inplace_impl)


fused_recurrent_kda_inplace.register_fake(recurrent_into_state_fake)
