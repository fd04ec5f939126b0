"""Public GDN functions: drop-in replacements for flash-linear-attention's ``chunk_gated_delta_rule`` and
``fused_recurrent_gated_delta_rule`` (fla-core 0.6 signatures; aliases ``chunk_gdn`` /
``fused_recurrent_gdn``), traceable by torch.compile with no graph break."""
from __future__ import annotations

import functools
from typing import Any

import torch

from kda_compile.ops._common import dispatcher_needed
from kda_compile.ops.context_parallel import CPContext
from kda_compile.ops.delta_rule.api import deferred_argument_error, run_delta_rule
from kda_compile.ops.delta_rule.validation import reject_unsupported_kwargs, state_layout_alias
from kda_compile.ops.gdn.backends import registry as gdn_backends
from kda_compile.ops.gdn import custom_ops
from kda_compile.ops.gdn.validation import reject_gk_gv, validate_gdn_arguments
from kda_compile.ops.kda.api import planned_call
from kda_compile.ops.kda.prefill import fast_path


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    cp_context: CPContext | None = None,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
    check_inputs: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Gated delta rule (GDN) over whole sequences (prefill and training), chunked.

    Per value head, with state ``S`` ``[K, V]`` (fp32) and per token ``t`` (one scalar decay per head)::

        S   = exp(g_t) S
        S   = S + k_t (beta_t (v_t - S^T k_t))^T
        o_t = S^T (scale * q_t)

    Args:
        q, k: ``[B, T, H, K]``, K <= 256.
        v: ``[B, T, HV, V]``; ``HV`` a multiple of ``H``: value head ``hv`` reads q/k head ``hv // (HV // H)``.
        g: ``[B, T, HV]`` log decays (<= 0); with ``use_gate_in_kernel`` the raw gate, turned into
            ``-exp(A_log[h]) * softplus(g + dt_bias[h])`` in the kernel.
        beta: ``[B, T, HV]``; with ``use_beta_sigmoid_in_kernel`` a logit (``sigmoid(beta)``, or
            ``2 * sigmoid(beta)`` with ``allow_neg_eigval``: eigenvalues of the transition may be negative).
        scale: multiplies q; default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` float32 (``[N, HV, V, K]`` with ``state_v_first``); ``N = B``, or the
            number of sequences with ``cu_seqlens``.
        output_final_state: return the final state (float32, same layout as ``initial_state``).
        use_qk_l2norm_in_kernel: normalise q and k as ``x / sqrt(sum(x^2) + 1e-6)``.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of sequences packed along T (B must be 1); empty sequences
            are allowed (their final state is their initial state).
        cu_seqlens_cpu: FLA's host copy of ``cu_seqlens`` (optional; its values are checked in eager calls). Eager
            inference plans packed sequences from it on the host (no device synchronisation).
        chunk_indices: FLA's precomputed chunk table for ``cu_seqlens``: accepted and not needed (every
            backend derives it from ``cu_seqlens``).
        cp_context: context parallelism (docs/context-parallel.md): a ``CPContext`` from
            ``kda_compile.ops.build_cp_context``; the inputs are then this rank's slice of the packed tokens and
            the states are per local sequence, exactly as for ``kda_compile.ops.chunk_kda``'s ``cp_context``.
        use_gate_in_kernel, A_log (``[HV]``), dt_bias (``[HV]``, optional): the in-kernel GDN gate.
        chunk_size: 16, 32 or 64.
        check_inputs: run the full value checks for this call (eager only; under torch.compile set
            ``KDA_COMPILE_CHECK_INPUTS=1``), as for ``kda_compile.ops.chunk_kda`` (docs/kda-input-checks.md).
    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, HV, V]`` in q's dtype; ``final_state`` or None.

    Input checks are KDA's (types, shapes, dtypes, devices and scalars on every call, free; errors are
    ``ValueError`` / ``TypeError`` naming the argument, raised unchanged by a ``torch.compile(fullgraph=True)``
    function when it runs). Differentiable w.r.t. q, k, v, g, beta, initial_state, A_log and dt_bias.
    Backends (docs/gdn.md): on CUDA, inference with bf16 / fp16 and K = V = 128 runs our chunk kernels with the
    scalar gate; other calls FLA's GDN kernels when fla-core 0.6 is installed, else the KDA kernels with the gate
    broadcast over K; elsewhere the reference math. The choice is logged
    (``kda_compile.ops.gdn.backends.registry``; ``only_backends`` overrides it).
    """
    plan_key = None
    if cp_context is None and not kwargs and not check_inputs:  # eager inference may skip the host work below
        options = ("chunk_gdn", scale, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                   use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, chunk_size,
                   gdn_backends.REGISTRY.allowed)  # GDN's only_backends (the signature holds KDA's)
        plan_key, out = planned_call(options, q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, A_log,
                                     dt_bias)
        if out is not None:
            return out
    one_process = None
    if cp_context is not None:  # each piece of this rank's slice runs as a one-process call with these options
        one_process = functools.partial(
            chunk_gated_delta_rule, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size,
            check_inputs=check_inputs)
    return _gdn(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, A_log,
                dt_bias, chunk_size, recurrent=False, cu_seqlens_cpu=cu_seqlens_cpu, check_inputs=check_inputs,
                unsupported=("chunk_gated_delta_rule", kwargs, {}), cp=(cp_context, one_process), plan_key=plan_key)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    check_inputs: bool = False,
    inplace_final_state: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Gated delta rule token by token, for decode (small T). Same math, arguments and checks as
    :func:`chunk_gated_delta_rule`, in FLA's order; ``g`` None means no decay and ``beta`` None means
    ``beta = 1``, as in FLA. FLA's per-key / per-value gates ``gk`` / ``gv`` are not supported (an error
    unless None; a per-key gate is KDA: ``kda_compile.ops.fused_recurrent_kda``).

    Inference runs our fused decode kernel with the scalar gate on CUDA (FLA's kernel, then the reference, for what
    it cannot serve; the reference on CPU). When gradients are needed the call takes the differentiable chunked op:
    same result. ``inplace_final_state=True`` writes the final state over ``initial_state``, as
    :func:`kda_compile.ops.fused_recurrent_kda`'s (``torch.ops.kda_compile.fused_recurrent_gdn_inplace``).
    """
    compiling = torch.compiler.is_compiling()
    try:
        state_v_first, kwargs = state_layout_alias("fused_recurrent_gated_delta_rule", kwargs, state_v_first)
        reject_unsupported_kwargs("fused_recurrent_gated_delta_rule", kwargs, {})
        reject_gk_gv(gk, gv)
        if use_gate_in_kernel and g is None:
            raise TypeError("g must be a tensor (the raw gate) when use_gate_in_kernel=True, got None")
    except (ValueError, TypeError) as error:
        if not compiling:
            raise
        return deferred_argument_error(error, q, v, cu_seqlens, output_final_state, state_v_first)
    if isinstance(q, torch.Tensor) and q.dim() == 4 and isinstance(v, torch.Tensor) and v.dim() == 4:
        if g is None:  # FLA's default: no decay
            g = q.new_zeros(v.shape[:3], dtype=torch.float32)
        if beta is None:  # FLA's default
            beta = q.new_ones(v.shape[:3])
    return _gdn(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, A_log,
                dt_bias, 64, recurrent=True, check_inputs=check_inputs, inplace_final_state=inplace_final_state)


chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule


def _learn_plan(key, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, flags, chunk_size,
                state_v_first):
    """A launch plan for this signature if the ordinary path ran our CUDA chunk kernels (``fast_path.learn``);
    ``flags``: the op's (scale, output_final_state, l2norm, in-kernel gate, beta sigmoid, negative eigenvalues)."""
    scale, output_final_state, l2norm, gate_in_kernel, beta_sigmoid, neg_eig = flags
    opts = gdn_backends.GDNOptions(scale=scale, use_qk_l2norm_in_kernel=l2norm, use_gate_in_kernel=gate_in_kernel,
                                   use_beta_sigmoid_in_kernel=beta_sigmoid, allow_neg_eigval=neg_eig,
                                   chunk_size=chunk_size)
    served = lambda: gdn_backends.select_backend(  # noqa: E731
        "chunk_gdn", q.device, q.dtype, q.shape[-1], v.shape[-1], opts).name == "chunk_kernels"
    fast_path.learn(key, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale=scale,
                    output_final_state=output_final_state, use_qk_l2norm_in_kernel=l2norm,
                    use_beta_sigmoid_in_kernel=beta_sigmoid, allow_neg_eigval=neg_eig, safe_gate=False,
                    lower_bound=None, chunk_size=chunk_size, state_v_first=state_v_first, scalar_gate=True,
                    served_by_our_kernels=served)


def _gdn(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
         use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, A_log, dt_bias, chunk_size, *,
         recurrent: bool, cu_seqlens_cpu=None, check_inputs: bool = False, unsupported=None, cp=(None, None),
         plan_key=None, inplace_final_state=False):
    decode = None if not recurrent else (custom_ops.fused_recurrent_gdn_fwd, custom_ops.fused_recurrent_gdn_impl,
                                         custom_ops.fused_recurrent_gdn_inplace,
                                         custom_ops.fused_recurrent_gdn_inplace_impl)

    def validate(cu_seqlens, cu_seqlens_cpu, state_v_first):
        validate_gdn_arguments(
            q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
            A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            state_v_first=state_v_first, scale=scale, chunk_size=chunk_size)
        return ()  # GDN's ops take the delta rule's flags only

    def serve(flags, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, state_v_first, tensors, needs_grad):
        if not needs_grad and not dispatcher_needed(*tensors):  # eager inference: straight to the backend
            out = custom_ops.chunk_gdn_inference(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *flags,
                                                 int(chunk_size), cu_seqlens_cpu)
            if plan_key is not None:  # later calls of this signature may skip the work above
                _learn_plan(plan_key, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, flags,
                            int(chunk_size), bool(state_v_first))
            return out
        o, final, *_ = custom_ops.chunk_gdn_fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *flags,
                                                int(chunk_size), needs_grad)
        return o, final

    return run_delta_rule(validate, serve, q, k, v, g, beta, scale, initial_state, output_final_state,
                          use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                          state_v_first, cu_seqlens, A_log, dt_bias, decode=decode, cu_seqlens_cpu=cu_seqlens_cpu,
                          check_inputs=check_inputs, unsupported=unsupported, cp=cp,
                          inplace_final_state=inplace_final_state)
