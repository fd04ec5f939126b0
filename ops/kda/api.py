"""Public KDA functions: drop-in replacements for flash-linear-attention's ``chunk_kda`` and
``fused_recurrent_kda`` (fla-core 0.6 signatures), traceable by torch.compile with no graph break."""
from __future__ import annotations

import functools
from typing import Any

import torch

from kda_compile.ops._common import dispatcher_needed, gradients_needed, record_fallback  # noqa: F401  (re-exported)
from kda_compile.ops.context_parallel import CPContext
from kda_compile.ops.delta_rule.api import run_delta_rule
from kda_compile.ops.delta_rule.validation import check_free_values, validate_delta_rule_arguments
from kda_compile.ops.kda import custom_ops
from kda_compile.ops.kda.prefill import fast_path

# FLA options accepted only at their default value.
_CHUNK_ONLY_DEFAULTS = {"return_intermediate_states": False, "use_graph": False, "max_num_seqs": None}


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    cp_context: CPContext | None = None,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
    check_inputs: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Kimi Delta Attention over whole sequences (prefill and training), chunked.

    Per value head, with state ``S`` ``[K, V]`` (fp32) and per token ``t``::

        S   = diag(exp(g_t)) S
        S   = S + k_t (beta_t (v_t - S^T k_t))^T
        o_t = S^T (scale * q_t)

    Args:
        q, k: ``[B, T, H, K]``, K <= 256.
        v: ``[B, T, HV, V]``; ``HV`` a multiple of ``H``: value head ``hv`` reads q/k head ``hv // (HV // H)``.
        g: ``[B, T, HV, K]`` log decays (<= 0); with ``use_gate_in_kernel`` the raw gate projection.
        beta: ``[B, T, HV]``; with ``use_beta_sigmoid_in_kernel`` a logit.
        scale: multiplies q; default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` float32 (``[N, HV, V, K]`` with ``state_v_first``); ``N = B``, or the
            number of sequences with ``cu_seqlens``.
        output_final_state: return the final state (float32, same layout as ``initial_state``).
        state_v_first: states in the ``[N, HV, V, K]`` layout (FLA's deprecated name ``transpose_state_layout``
            is accepted too, with a DeprecationWarning).
        use_qk_l2norm_in_kernel: normalise q and k as ``x / sqrt(sum(x^2) + 1e-6)``.
        use_gate_in_kernel: ``g = -exp(A_log[h]) * softplus(g + dt_bias[h])``, or, with ``lower_bound``,
            ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))`` (``A_log`` may then be None).
        use_beta_sigmoid_in_kernel: ``beta = sigmoid(beta)`` (``2 * sigmoid(beta)`` with ``allow_neg_eigval``).
        safe_gate: FLA's fast path for bounded gates; requires ``lower_bound`` in [-5, 0) with the in-kernel gate.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of sequences packed along T (B must be 1); zero-length
            sequences are allowed (their final state is their initial state).
        A_log: ``[HV]``; dt_bias: ``[HV * K]`` (float32), for the in-kernel gate.
        chunk_size: 16, 32 or 64 (FLA kernels take 32 or 64).
        disable_recompute: in training, keep FLA's forward intermediates (``w, u, qg, kg, v_new`` and the
            per-chunk states ``h``) for the backward instead of recomputing them there, as FLA does: a
            faster backward (docs/kda-kernels.md section 8) for more memory (at
            K = V = 128 in bf16, about 2.25 KB more per token and value head with the in-kernel gate, whose
            cumsum is kept too, 1.8 KB without, against 0.75 KB of FLA's default residuals). Honoured on
            FLA's kernels; with ``cu_seqlens`` (the number of saved states depends on the sequence lengths)
            and on the reference math it is ignored, the former with a logged reason.
        cu_seqlens_cpu: FLA's host copy of ``cu_seqlens`` (optional): CPU, int32/int64, as many offsets as
            ``cu_seqlens``; its values are checked (eager calls), and compared with ``cu_seqlens`` where that
            needs no device synchronisation (both on the host) or ``check_inputs`` asks for it. Eager inference
            plans the packed chunks from it on the host (as FLA does): fewer launches and no synchronisation, so
            it must hold the same values as ``cu_seqlens``.
        cp_context: context parallelism (docs/context-parallel.md): a ``CPContext`` from
            ``kda_compile.ops.build_cp_context``. q, k, v, g, beta are then this rank's slice ``[1, T_rank, ...]``
            of the packed tokens; ``cu_seqlens`` / ``cu_seqlens_cpu`` are the context's (None, or exactly
            ``cp_context.cu_seqlens``); ``initial_state`` and the final state are per LOCAL sequence
            ``[cp_context.num_seqs, HV, K, V]`` (local sequence ``i`` is global sequence
            ``cp_context.first_seq_index + i``). A sequence continued from an earlier rank takes its state from
            there (its ``initial_state`` entry here is not read); a final state is the state after this rank's
            tokens, the sequence's own final state on the rank holding its last token. Every rank of the group
            must make the call (and its backward). Forward and gradients equal a one-process call's.
        check_inputs: run the full value checks for this call (eager only; under torch.compile set
            ``KDA_COMPILE_CHECK_INPUTS=1``, which the op reads when it runs): see "Input checks" below.
    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, HV, V]`` in q's dtype; ``final_state`` or None.

    Input checks (docs/kda-input-checks.md): every argument's type, shape, dtype, device and every Python
    scalar is checked on every call, free (never a tensor value, so no GPU synchronisation; under
    torch.compile these checks become guards). Errors are ``ValueError`` / ``TypeError`` naming the argument,
    its value and what is accepted; under ``torch.compile(fullgraph=True)`` the compiled function raises the
    same error when it runs (not Dynamo's "Observed exception"). Rules beyond the shapes: q, k and v share
    one floating dtype (g and beta may differ); H, K, HV, V >= 1 (T = 0, B = 0 and empty sequences are
    fine); ``scale`` finite and > 0; ``A_log`` / ``dt_bias`` only with ``use_gate_in_kernel``.
    Tensor VALUES are checked where reading them costs no device synchronisation: ``cu_seqlens`` on the CPU
    or on the reference path (which reads the lengths anyway), and ``cu_seqlens_cpu`` (eager): offsets from
    0 to T, non-decreasing. Everywhere else (CUDA kernels) only with ``check_inputs=True`` or
    ``KDA_COMPILE_CHECK_INPUTS=1``, which also require a finished gate ``g <= 0``. Bad offsets on an unchecked
    CUDA call are undefined behaviour (out-of-range reads). NaN / Inf in q, k, v, g or beta are data, not
    errors: they stay within their own sequence (packed or batched); inside it they may reach every token
    of their chunk (``chunk_size`` tokens from the sequence start) and everything after it, never a token
    of an earlier chunk. ``g = -inf`` (or any very negative gate) is an exact reset of the state.

    Differentiable w.r.t. q, k, v, g, beta, initial_state, A_log and dt_bias. On CUDA the work runs in
    FLA's kernels when fla-core 0.6 is installed, otherwise in our Triton prefill forward (backward by the
    reference math); on CPU in the reference math. Which backend serves a call, and why a faster one
    could not, is logged once and shown by the rewrite report (``kda_compile.ops.kda.backends.registry``).
    """
    plan_key = None
    if cp_context is None and not kwargs and not return_intermediate_states and not check_inputs:
        options = (scale, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                   allow_neg_eigval, safe_gate, lower_bound, disable_recompute, state_v_first, chunk_size)
        plan_key, out = planned_call(options, q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, A_log,
                                     dt_bias)
        if out is not None:
            return out
    unsupported = {"return_intermediate_states": return_intermediate_states, **kwargs}
    one_process = None
    if cp_context is not None:  # each piece of this rank's slice runs as a one-process call with these options
        one_process = functools.partial(
            chunk_kda, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
            disable_recompute=disable_recompute, A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size,
            check_inputs=check_inputs)
    return _kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
                state_v_first, cu_seqlens, A_log, dt_bias, chunk_size, recurrent=False,
                disable_recompute=bool(disable_recompute), cu_seqlens_cpu=cu_seqlens_cpu, check_inputs=check_inputs,
                unsupported=("chunk_kda", unsupported, _CHUNK_ONLY_DEFAULTS), cp=(cp_context, one_process),
                plan_key=plan_key)


def planned_call(options, q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, A_log, dt_bias):
    """``(key, outputs)``: the call's launch-plan signature (``fast_path.signature`` with ``options``; None where no
    plan can serve it) and its outputs through that plan, or None when it has none or needs what a plan does not
    do (gradients, the dispatcher). Shared by ``chunk_kda`` and GDN's ``chunk_gated_delta_rule``."""
    key = fast_path.signature(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, A_log, dt_bias, options)
    plan = None if key is None else fast_path.lookup(key)
    if plan is None:
        return key, None
    tensors = (q, k, v, g, beta, initial_state, A_log, dt_bias)
    if gradients_needed(*tensors) or dispatcher_needed(*tensors):
        return key, None
    if cu_seqlens_cpu is not None:
        check_free_values(q, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    return key, plan(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)  # states in the caller's layout


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    check_inputs: bool = False,
    inplace_final_state: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Kimi Delta Attention token by token, for decode (small T). Same math, arguments and input checks as
    :func:`chunk_kda` (note FLA's order: ``A_log`` and ``dt_bias`` come before ``scale``).

    Inference runs our fused Triton decode step on CUDA (FLA's kernel, then the reference, for what it
    cannot serve; the reference on CPU). When gradients are needed (grad mode on and an input requires
    grad), the call takes the differentiable chunked op instead: same result, with a backward.

    ``inplace_final_state=True`` writes the final state over ``initial_state`` (returned as the final state
    when ``output_final_state``): a cache's state is updated by the step itself, with no fresh state and no copy
    after it (``torch.ops.kda_compile.fused_recurrent_kda_inplace``, which declares the write to torch.library,
    so CUDA graphs capture it). Inference only: an error when gradients are needed or ``initial_state`` is None.
    """
    return _kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, False, lower_bound,
                state_v_first, cu_seqlens, A_log, dt_bias, 64, recurrent=True, check_inputs=check_inputs,
                unsupported=("fused_recurrent_kda", kwargs, {}), inplace_final_state=inplace_final_state)


def _kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
         use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, state_v_first, cu_seqlens, A_log,
         dt_bias, chunk_size, *, recurrent: bool, disable_recompute: bool = False, cu_seqlens_cpu=None,
         check_inputs: bool = False, unsupported=None, cp=(None, None), plan_key=None, inplace_final_state=False):
    decode = None if not recurrent else (custom_ops.fused_recurrent_kda_fwd, custom_ops.fused_recurrent_kda_impl,
                                         custom_ops.fused_recurrent_kda_inplace,
                                         custom_ops.fused_recurrent_kda_inplace_impl)

    def validate(cu_seqlens, cu_seqlens_cpu, state_v_first):
        validate_delta_rule_arguments(
            q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias,
            use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
            state_v_first=state_v_first, scale=scale, chunk_size=chunk_size, cu_seqlens_cpu=cu_seqlens_cpu,
        )
        return (None if lower_bound is None else float(lower_bound),)  # KDA's flag after the delta rule's

    def serve(flags, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, state_v_first, tensors, needs_grad):
        if not needs_grad and not dispatcher_needed(*tensors):  # eager inference: straight to the backend
            out = custom_ops.chunk_kda_inference(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *flags,
                                                 bool(safe_gate), int(chunk_size), cu_seqlens_cpu)
            if plan_key is not None and use_gate_in_kernel:  # later calls of this signature may skip the work above
                fast_path.learn(plan_key, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale=flags[0],
                                output_final_state=bool(output_final_state),
                                use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
                                use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid_in_kernel),
                                allow_neg_eigval=bool(allow_neg_eigval), safe_gate=bool(safe_gate),
                                lower_bound=flags[-1], chunk_size=int(chunk_size), state_v_first=bool(state_v_first))
            return out
        keep = disable_recompute and needs_grad
        if keep and cu_seqlens is not None:
            record_fallback("chunk_kda_backward", "recomputing", "disable_recompute=True is not honoured with "
                            "cu_seqlens: the number of chunk states FLA keeps depends on the sequence lengths")
            keep = False
        o, final, *_ = custom_ops.chunk_kda_fwd(
            q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *flags, bool(safe_gate), int(chunk_size),
            needs_grad, keep)
        return o, final

    return run_delta_rule(validate, serve, q, k, v, g, beta, scale, initial_state, output_final_state,
                          use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                          state_v_first, cu_seqlens, A_log, dt_bias, decode=decode, cu_seqlens_cpu=cu_seqlens_cpu,
                          check_inputs=check_inputs, unsupported=unsupported, cp=cp,
                          inplace_final_state=inplace_final_state)
