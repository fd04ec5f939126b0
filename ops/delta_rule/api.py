"""The path the public delta-rule functions share (KDA's ``chunk_kda`` / ``fused_recurrent_kda``, GDN's
``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``): FLA's keyword aliases and unsupported options,
the argument checks (their errors deferred to run time while Dynamo traces), the value checks that cost no device
synchronisation, the defaults (``scale``, the in-kernel gate's parameters), the state layout and context parallelism.

Which op serves a call (decode, eager inference, the differentiable chunked op) is each op's own: the op hands
:func:`run_delta_rule` its checks and its dispatch as two functions.
"""
from __future__ import annotations

import torch

from kda_compile.ops._argument_errors import deferred_error, sizes
from kda_compile.ops._common import arg_error, dispatcher_needed, gradients_needed
from kda_compile.ops.context_parallel import context_offsets, context_parallel_chunk
from kda_compile.ops.delta_rule.validation import (check_free_values, check_input_values, check_inputs_flag,
                                                   reject_unsupported_kwargs, state_layout_alias)


def run_delta_rule(validate, serve, q, k, v, g, beta, scale, initial_state, output_final_state,
                   use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                   state_v_first, cu_seqlens, A_log, dt_bias, *, decode=None, cu_seqlens_cpu=None,
                   check_inputs: bool = False, unsupported=None, cp=(None, None), inplace_final_state=False):
    """One public delta-rule call from its arguments to ``(o, final_state or None)``.

    ``validate(cu_seqlens, cu_seqlens_cpu, state_v_first)``: the op's argument checks (given the arguments this
    path may have changed: the context's offsets, FLA's alias of ``state_v_first``; the op binds the others),
    returning the op's own flags, which follow the delta rule's six in its ops' schemas (KDA: its lower bound).
    ``decode``: the op's decode ``(custom op, its kernel function, in-place custom op, its kernel function)`` for a
    decode call, which runs there when it needs no gradients (eager calls skip the dispatcher:
    ``ops._common.dispatcher_needed``); ``inplace_final_state`` takes the in-place pair, which writes the final
    state over ``initial_state`` (returned as the final state) instead of into a fresh tensor.
    ``serve(flags, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, state_v_first, tensors, needs_grad)``:
    the op's ``(o, final)`` of every other call, from the defaulted arguments (``flags``: scale,
    output_final_state, the four options and the op's own; ``initial_state`` in the ``[N, HV, K, V]`` layout,
    ``state_v_first`` the caller's layout; ``tensors``: q, k, v, g, beta, initial_state, A_log, dt_bias).
    ``unsupported``: ``(function name, extra keyword arguments, their accepted defaults)``; ``cp``: ``(cp_context,
    the one-process call each piece of the slice runs)``. Called by the op's helper that its public function calls:
    FLA's deprecation warning names the public function's caller (``stacklevel``).
    """
    compiling = torch.compiler.is_compiling()
    cp_context, one_process = cp
    try:
        if unsupported is not None:
            fn, extra, defaults = unsupported
            state_v_first, extra = state_layout_alias(fn, extra, state_v_first, stacklevel=5)
            reject_unsupported_kwargs(fn, extra, defaults)
        if cp_context is not None:
            cu_seqlens, cu_seqlens_cpu = context_offsets(cp_context, q, cu_seqlens, cu_seqlens_cpu)
        own_flags = validate(cu_seqlens, cu_seqlens_cpu, state_v_first)
        check_inputs_flag(check_inputs, compiling)
        if inplace_final_state:
            check_in_place(initial_state, cp_context, q, k, v, g, beta, A_log, dt_bias)
    except (ValueError, TypeError) as error:
        if not compiling:
            raise
        return deferred_argument_error(error, q, v, cu_seqlens, output_final_state, state_v_first)
    if not compiling:  # value checks that need no device synchronisation (host tensors); eager only
        check_free_values(q, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        if check_inputs:
            check_input_values(q, g, cu_seqlens=cu_seqlens, use_gate_in_kernel=use_gate_in_kernel,
                               cu_seqlens_cpu=cu_seqlens_cpu)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if not use_gate_in_kernel:  # A_log / dt_bias only feed the in-kernel gate
        A_log = dt_bias = None
    given_state = initial_state  # the caller's tensor (an in-place call writes it through the view below)
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    tensors = (q, k, v, g, beta, initial_state, A_log, dt_bias)
    needs_grad = gradients_needed(*tensors)
    flags = (float(scale), bool(output_final_state), bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel),
             bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval), *own_flags)
    if cp_context is not None:
        o, final = context_parallel_chunk(one_process, cp_context, q, k, v, g, beta, initial_state,
                                          output_final_state)
    elif decode is not None and inplace_final_state:
        op = decode[2] if dispatcher_needed(*tensors) else decode[3]
        o = op(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, flags[0], *flags[2:])
        return o, (given_state if output_final_state else None)
    elif decode is not None and not needs_grad:
        op = decode[0] if dispatcher_needed(*tensors) else decode[1]
        o, final = op(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *flags)
    else:
        o, final = serve(flags, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, state_v_first, tensors,
                         needs_grad)
    if not output_final_state:
        return o, None
    return o, (final.transpose(-1, -2) if state_v_first else final)


def check_in_place(initial_state, cp_context, *tensors) -> None:
    """The arguments ``inplace_final_state=True`` needs: a state to write over, no context parallelism, and no
    gradients (an inference step: the state it overwrites is what a backward would need)."""
    if initial_state is None:
        raise arg_error("initial_state", None, "a float32 tensor [N, HV, K, V] when inplace_final_state=True (the "
                        "final state is written over it)")
    if cp_context is not None:
        raise arg_error("cp_context", type(cp_context).__name__, "None when inplace_final_state=True (a decode step "
                        "on one process)")
    if gradients_needed(initial_state, *tensors):
        raise arg_error("inplace_final_state", True, "False when gradients are needed (grad mode on and an input "
                        "requires grad: the step would overwrite the state its backward reads)")


def deferred_argument_error(error, q, v, cu_seqlens, output_final_state, state_v_first):
    """A delta-rule call's (KDA's or GDN's) bad-argument ``error`` (``ops._argument_errors``): raised now in an
    eager call; while Dynamo traces, ``(o, final_state)`` placeholders of the shapes the call's outputs would
    have had where they are known, and the compiled function raises ``error`` when it runs."""
    qs, vs, offsets = sizes(q, 4), sizes(v, 4), sizes(cu_seqlens, 1)
    o_shape, state_shape = [0], [0]
    if qs is not None and vs is not None:
        o_shape = [qs[0], qs[1], vs[2], vs[3]]
        N = offsets[0] - 1 if offsets is not None and offsets[0] > 0 else qs[0]
        K, V = (vs[3], qs[3]) if state_v_first else (qs[3], vs[3])
        state_shape = [N, vs[2], K, V]
    o, final = deferred_error(error, q, o_shape, state_shape)
    return o, (final if output_final_state else None)
