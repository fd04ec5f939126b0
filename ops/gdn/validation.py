"""Argument checks for the public GDN functions. The delta-rule rules and messages KDA's functions have too
(``kda_compile.ops.delta_rule.validation``, docs/kda-input-checks.md) where the arguments are the same; what
differs is GDN's: ``g`` ``[B, T, HV]`` (one decay per value head), ``dt_bias`` ``[HV]``, no lower-bound
gate, and the decode function's optional ``g`` / ``beta`` and unsupported ``gk`` / ``gv``.

Never reads a tensor's values (free under torch.compile, where these checks become guards; no GPU
synchronisation). The value checks are the delta-rule core's (``check_free_values``, ``check_input_values``).
"""
from __future__ import annotations

from kda_compile.ops._common import arg_error, describe
from kda_compile.ops.delta_rule.validation import validate_delta_rule_arguments


def validate_gdn_arguments(q, k, v, g, beta, *, initial_state, cu_seqlens, cu_seqlens_cpu, A_log, dt_bias,
                           use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
                           scale, chunk_size) -> None:
    """Shapes, dtypes, devices and Python scalars of one GDN call: the delta-rule checks with the per-head gate
    layout (GDN has no lower-bound gate, so ``A_log`` is required with the in-kernel gate)."""
    validate_delta_rule_arguments(
        q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=False, lower_bound=None, state_v_first=state_v_first,
        scale=scale, chunk_size=chunk_size, cu_seqlens_cpu=cu_seqlens_cpu, per_head_gate=True)
    for name, flag in (("use_gate_in_kernel", use_gate_in_kernel), ("allow_neg_eigval", allow_neg_eigval),
                       ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel)):
        if not isinstance(flag, bool):
            raise arg_error(name, type(flag).__name__, "a bool", kind=TypeError)


def reject_gk_gv(gk, gv) -> None:
    """FLA's decode function also takes per-key (``gk``) and per-value (``gv``) gates; this op is GDN's
    per-head gate only (a per-key gate is KDA: kda_compile.ops.fused_recurrent_kda)."""
    for name, t in (("gk", gk), ("gv", gv)):
        if t is not None:
            raise arg_error(name, describe(t), "None (kda_compile's GDN takes the per-head gate g only; a per-key "
                            "gate is KDA: kda_compile.ops.fused_recurrent_kda)")
