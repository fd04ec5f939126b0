"""``torch.ops.kda_compile`` GDN ops: forward and backward as separate custom ops, fake implementations
with the real outputs' strides, autograd through ``register_autograd``.

- ``chunk_gdn_fwd(...) -> (o, final_state, res0, ..., res12)``: ``o`` ``[B, T, HV, V]`` in q's dtype;
  ``final_state`` ``[N, HV, K, V]`` float32 (empty when not requested); ``res*``: what the serving backend
  keeps for its backward (empty when ``save_for_backward`` is false or the slot is unused).
- ``chunk_gdn_bwd(...) -> (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0)``: an empty tensor stands for an
  absent input. When the forward did not save residuals, the reference recomputes (logged).
- ``fused_recurrent_gdn_fwd(...) -> (o, final_state)``: decode; no autograd (the public function takes
  the chunk op when gradients are needed).
- ``fused_recurrent_gdn_inplace(..., state, ...) -> o``: decode writing its final state over ``state`` (its
  initial state; ``mutates_args``): the public ``inplace_final_state=True``; inference only.

Every output is a fresh contiguous tensor and every fake returns ``new_empty(shape)``: fake and real
strides agree for non-contiguous inputs too.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kda_compile.ops.gdn.prefill import backend as chunk_backend  # noqa: F401  (registers our chunk kernels)
from kda_compile.ops.gdn.decode import backend as decode_backend  # noqa: F401  (registers our decode kernel)
from kda_compile.ops.gdn.backends import fla as fla_backend  # noqa: F401  (registers FLA's GDN kernels)
from kda_compile.ops.gdn.backends import kda as kda_backend  # noqa: F401  (registers the route through the KDA kernels)
from kda_compile.ops.gdn.backends.registry import REFERENCE, GDNOptions, backend_named, select_backend
from kda_compile.ops.delta_rule.custom_ops import (backward_fake, backward_source, chunk_backward,
                                                  fake_forward_outputs, gradient_outputs, keep_for_backward,
                                                  pad_residuals, recurrent_fake, recurrent_into_state,
                                                  recurrent_into_state_fake, run_time_checks, serving_backend)


def _options(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
             chunk_size=64, training=False) -> GDNOptions:
    return GDNOptions(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                      use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                      allow_neg_eigval=allow_neg_eigval, chunk_size=chunk_size, training=training)


def _backend(op: str, q: Tensor, v: Tensor, opts: GDNOptions):
    return serving_backend(select_backend, REFERENCE, op, q, v, opts)


@torch.library.custom_op("kda_compile::chunk_gdn_fwd", mutates_args=())
def chunk_gdn_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    scale: float, output_final_state: bool, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, chunk_size: int, save_for_backward: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
           Tensor, Tensor]:
    opts = _options(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                    allow_neg_eigval, chunk_size, training=save_for_backward)
    run_time_checks(q, g, cu_seqlens, use_gate_in_kernel)
    backend = _backend("chunk_gdn", q, v, opts)
    o, final, residuals = backend.chunk_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts,
                                                output_final_state, save_for_backward)
    final = final.float().contiguous() if output_final_state else q.new_empty(0, dtype=torch.float32)
    return (o.to(q.dtype).contiguous(), final, *(r.contiguous() for r in pad_residuals(q, residuals)))


def chunk_gdn_inference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    scale: float, output_final_state: bool, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, chunk_size: int, cu_seqlens_cpu: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """``chunk_gdn_fwd`` without saving for the backward, called directly by eager inference (as KDA's
    ``chunk_kda_inference``: no dispatcher, no empty residual outputs). ``cu_seqlens_cpu`` (the caller's host copy
    of ``cu_seqlens``) lets the backend plan packed sequences on the host: no synchronisation."""
    opts = _options(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                    allow_neg_eigval, chunk_size)
    run_time_checks(q, g, cu_seqlens, use_gate_in_kernel)
    backend = _backend("chunk_gdn", q, v, opts)
    host = {} if cu_seqlens_cpu is None or cu_seqlens is None else {"cu_seqlens_cpu": cu_seqlens_cpu}
    o, final, _ = backend.chunk_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts,
                                        output_final_state, False, **host)
    final = final.float().contiguous() if output_final_state else q.new_empty(0, dtype=torch.float32)
    return o.to(q.dtype).contiguous(), final


@chunk_gdn_fwd.register_fake
def _chunk_gdn_fwd_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, output_final_state,
                        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                        chunk_size, save_for_backward):
    opts = _options(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                    allow_neg_eigval, chunk_size, training=save_for_backward)
    return fake_forward_outputs(_backend("chunk_gdn", q, v, opts), q, k, v, cu_seqlens, opts, output_final_state,
                                save_for_backward)


@torch.library.custom_op("kda_compile::chunk_gdn_bwd", mutates_args=())
def chunk_gdn_bwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    res0: Tensor, res1: Tensor, res2: Tensor, res3: Tensor, res4: Tensor, res5: Tensor, res6: Tensor,
    res7: Tensor, res8: Tensor, res9: Tensor, res10: Tensor, res11: Tensor, res12: Tensor,
    do: Tensor, dht: Optional[Tensor],
    scale: float, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool, chunk_size: int, residuals_saved: bool = True, backend: str = "",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    # ``backend``: the backend the forward ran on (as chunk_kda_bwd's)
    opts = _options(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                    allow_neg_eigval, chunk_size, training=True)
    saved = [res0, res1, res2, res3, res4, res5, res6, res7, res8, res9, res10, res11, res12]
    ran_on = backend_named(backend) if backend else _backend("chunk_gdn", q, v, opts)
    runs_on, residuals = backward_source("chunk_gdn", ran_on, REFERENCE, q, k, v, opts, saved, residuals_saved)
    grads = runs_on.chunk_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, residuals, do, dht,
                                   opts)
    return gradient_outputs(grads, (q, k, v, g, beta, A_log, dt_bias, initial_state), q)


chunk_gdn_bwd.register_fake(backward_fake)


def _setup_context(ctx, inputs, output):
    scale, output_final_state, *flags, chunk_size, save_for_backward = inputs[9:]
    opts = _options(scale, *flags, chunk_size, training=save_for_backward)
    keep_for_backward(ctx, inputs[:9], output, _backend("chunk_gdn", inputs[0], inputs[2], opts), opts, scale=scale,
                      flags=tuple(flags), chunk_size=chunk_size, output_final_state=output_final_state,
                      save_for_backward=save_for_backward)


def _backward(ctx, do, dht, *residual_grads):
    return chunk_backward(ctx, do, dht, chunk_gdn_bwd, (), inputs=17)


torch.library.register_autograd("kda_compile::chunk_gdn_fwd", _backward, setup_context=_setup_context)


def fused_recurrent_gdn_impl(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    scale: float, output_final_state: bool, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool,
) -> tuple[Tensor, Tensor]:
    """The kernel of ``fused_recurrent_gdn_fwd``; eager decode calls it directly (see
    ``kda_compile.ops._common.dispatcher_needed``: the dispatcher's Python path costs more than a step)."""
    opts = _options(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                    allow_neg_eigval)
    run_time_checks(q, g, cu_seqlens, use_gate_in_kernel)
    backend = _backend("fused_recurrent_gdn", q, v, opts)
    o, final = backend.recurrent_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts,
                                         output_final_state)
    final = final.float().contiguous() if output_final_state else q.new_empty(0, dtype=torch.float32)
    return o.to(q.dtype).contiguous(), final


fused_recurrent_gdn_fwd = torch.library.custom_op("kda_compile::fused_recurrent_gdn_fwd", mutates_args=())(
    fused_recurrent_gdn_impl)


fused_recurrent_gdn_fwd.register_fake(recurrent_fake)


def fused_recurrent_gdn_inplace_impl(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor], state: Tensor, cu_seqlens: Optional[Tensor],
    scale: float, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
) -> Tensor:
    """The kernel of ``fused_recurrent_gdn_inplace``: the decode step with its final state written over ``state``
    (the initial state; ``mutates_args``), so a cache's state needs no copy after the step (docs/cuda-graphs.md)."""
    opts = _options(scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                    allow_neg_eigval)
    run_time_checks(q, g, cu_seqlens, use_gate_in_kernel)
    backend = _backend("fused_recurrent_gdn", q, v, opts)
    return recurrent_into_state(backend, q, k, v, g, beta, A_log, dt_bias, state, cu_seqlens, opts)


fused_recurrent_gdn_inplace = torch.library.custom_op("kda_compile::fused_recurrent_gdn_inplace",
                                                      mutates_args=("state",))(fused_recurrent_gdn_inplace_impl)


fused_recurrent_gdn_inplace.register_fake(recurrent_into_state_fake)
