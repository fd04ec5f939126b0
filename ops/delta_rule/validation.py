"""Argument checks of the delta-rule functions, KDA's and GDN's (``kda_compile.ops.kda``, ``kda_compile.ops.gdn``):
every error names the argument, the value and what is accepted (docs/kda-input-checks.md has the rules in one
place). The two ops share these rules; the gate's form (KDA: per key channel, GDN: one per value head) is the
parameter (``per_head_gate``), and the GDN-only rules are in ``kda_compile.ops.gdn.validation``.

Two kinds of checks:

- ``validate_delta_rule_arguments``: shapes, dtypes, devices and Python scalars. It never reads a tensor's
  values, so it is free under torch.compile (it becomes guards) and never synchronises the GPU.
- value checks (``check_cu_seqlens_values``, ``check_input_values``): read tensor values on the host.
  They run where that is free (a CPU ``cu_seqlens`` / ``cu_seqlens_cpu``, the reference path which reads
  the sequence lengths anyway), and everywhere when asked: ``check_inputs=True`` or the environment
  variable ``KDA_COMPILE_CHECK_INPUTS=1`` (a device-to-host copy per call, so off by default).
"""
from __future__ import annotations

import math
import warnings

import torch

from kda_compile.ops._common import arg_error, check_tensor, describe, plain

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256
CHUNK_SIZES = (16, 32, 64)


def check_inputs_flag(check_inputs, compiling: bool) -> None:
    """The public functions' ``check_inputs``: a bool, and False while torch.compile traces."""
    if check_inputs is not False and check_inputs is not True:
        raise TypeError(f"check_inputs must be a bool, got {type(check_inputs).__name__}")
    if check_inputs and compiling:
        raise ValueError("check_inputs must be False under torch.compile (its checks read tensor values, "
                         "which tracing cannot), got True; set KDA_COMPILE_CHECK_INPUTS=1 instead: the "
                         "compiled op then checks every call when it runs")


def _positive_dims(name: str, t: torch.Tensor, dims: tuple[str, ...], sizes) -> None:
    """Every named size of ``t`` at least 1 (``dims``: their names, e.g. ("H", "K"))."""
    for dim, size in zip(dims, sizes):
        if size < 1:
            raise arg_error(name, describe(t), f"a tensor with {dim} >= 1 (the {_DIM_NAMES[dim]})")


_DIM_NAMES = {"H": "q/k heads", "K": "key head dim", "V": "value head dim", "HV": "value heads"}


def validate_delta_rule_arguments(
    q, k, v, g, beta, *, initial_state, cu_seqlens, A_log, dt_bias, use_gate_in_kernel,
    use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, state_v_first, scale, chunk_size,
    cu_seqlens_cpu=None, per_head_gate: bool = False,
) -> None:
    """Shapes, dtypes, devices and Python scalars of one delta-rule call; errors name the argument.
    ``per_head_gate``: the gated delta rule's layout (``kda_compile.ops.gdn``): ``g`` ``[B, T, HV]`` (one decay
    per value head) and ``dt_bias`` ``[HV]``, instead of KDA's per-key-channel ``[B, T, HV, K]`` / ``[HV * K]``."""
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    B, T, H, K = q.shape
    _positive_dims("q", q, ("H", "K"), (H, K))
    check_tensor("k", k, ndim=4, dtypes=FLOAT_DTYPES)
    if k.shape != q.shape:
        raise arg_error("k", describe(k), f"of q's shape [B, T, H, K] = {plain(q.shape)}")
    check_tensor("v", v, ndim=4, dtypes=FLOAT_DTYPES)
    if v.shape[:2] != q.shape[:2]:
        raise arg_error("v", describe(v), f"of shape [B, T, HV, V] with [B, T] = {plain(q.shape[:2])} as in q")
    HV, V = v.shape[2], v.shape[3]
    _positive_dims("v", v, ("HV", "V"), (HV, V))
    # One dtype for q, k, v (the kernels' products and intermediates take it; FLA's kernels assume it).
    # g and beta may differ (FLA's layer feeds a float32 gate with bf16 q): every path converts them.
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise arg_error(name, describe(t), f"of q's dtype {q.dtype} (q, k and v share one dtype)",
                            kind=TypeError)
    if HV % H != 0:
        raise arg_error("v", f"{HV} value heads for {H} q/k heads",
                        "a multiple of the q/k heads (HV % H == 0, grouped value attention)")
    if K > MAX_HEAD_DIM:
        raise arg_error("q", f"key head dim K={K}", f"K <= {MAX_HEAD_DIM}")
    if per_head_gate:
        check_tensor("g", g, dtypes=FLOAT_DTYPES)  # any rank: the message explains a KDA-style gate
        if g.shape != (B, T, HV):
            raise arg_error("g", describe(g), f"of shape [B, T, HV] = {plain([B, T, HV])} (one log decay per value "
                            "head; a per-channel gate [B, T, HV, K] is KDA: kda_compile.ops.chunk_kda)")
    else:
        check_tensor("g", g, ndim=4, dtypes=FLOAT_DTYPES)
        if g.shape != (B, T, HV, K):
            raise arg_error("g", describe(g), f"of shape [B, T, HV, K] = {plain([B, T, HV, K])}")
    check_tensor("beta", beta, ndim=3, dtypes=FLOAT_DTYPES)
    if beta.shape != (B, T, HV):
        raise arg_error("beta", describe(beta), f"of shape [B, T, HV] = {plain([B, T, HV])}")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.device != q.device:
            raise arg_error(name, f"a tensor on {t.device}", f"on q's device {q.device}")

    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=INDEX_DTYPES)
        if B != 1:
            raise arg_error("q", describe(q), "of batch size 1 when cu_seqlens is given (pack sequences along T)")
        if cu_seqlens.shape[0] < 1:
            raise arg_error("cu_seqlens", describe(cu_seqlens), "[N + 1] offsets starting with 0")
        if cu_seqlens.device != q.device:
            raise arg_error("cu_seqlens", f"a tensor on {cu_seqlens.device}", f"on q's device {q.device}")
    if cu_seqlens_cpu is not None:
        if cu_seqlens is None:
            raise arg_error("cu_seqlens_cpu", describe(cu_seqlens_cpu), "None when cu_seqlens is None")
        check_tensor("cu_seqlens_cpu", cu_seqlens_cpu, ndim=1, dtypes=INDEX_DTYPES)
        if cu_seqlens_cpu.device.type != "cpu":
            raise arg_error("cu_seqlens_cpu", describe(cu_seqlens_cpu), "a CPU tensor (a host copy of cu_seqlens)")
        if cu_seqlens_cpu.shape[0] != cu_seqlens.shape[0]:
            raise arg_error("cu_seqlens_cpu", describe(cu_seqlens_cpu),
                            f"a copy of cu_seqlens ({cu_seqlens.shape[0]} offsets)")
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1

    if initial_state is not None:
        check_tensor("initial_state", initial_state, ndim=4)
        accepted = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
        if initial_state.dtype not in accepted:
            raise arg_error("initial_state", describe(initial_state),
                            "float32 (recurrent states are kept in fp32)", kind=TypeError)
        expected = [N, HV, V, K] if state_v_first else [N, HV, K, V]
        if list(initial_state.shape) != expected:
            layout = "[N, HV, V, K] (state_v_first)" if state_v_first else "[N, HV, K, V]"
            raise arg_error("initial_state", describe(initial_state), f"of shape {layout} = {plain(expected)}")
        if initial_state.device != q.device:
            raise arg_error("initial_state", f"a tensor on {initial_state.device}", f"on q's device {q.device}")

    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise arg_error("A_log", None, "a [HV] tensor when use_gate_in_kernel=True and lower_bound is None")
        bias = (HV, "HV") if per_head_gate else (HV * K, "HV*K")
        for name, t, numel, what in (("A_log", A_log, HV, "HV"), ("dt_bias", dt_bias, *bias)):
            if t is None:
                continue
            check_tensor(name, t, dtypes=FLOAT_DTYPES)
            if t.numel() != numel:
                per_head = " (one per value head)" if per_head_gate else ""
                raise arg_error(name, describe(t), f"a tensor of {what}={numel} elements{per_head}")
            if t.device != q.device:
                raise arg_error(name, f"a tensor on {t.device}", f"on q's device {q.device}")
    else:
        # Without the in-kernel gate they would be ignored: g is then the finished log decay.
        for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
            if t is not None:
                raise arg_error(name, describe(t), "None unless use_gate_in_kernel=True (g is then the final "
                                "log decay; pass the raw gate projection with use_gate_in_kernel=True to use it)")
    if lower_bound is not None:
        if not isinstance(lower_bound, (int, float)) or isinstance(lower_bound, bool) or not -math.inf < lower_bound < 0:
            raise arg_error("lower_bound", lower_bound, "a finite negative float (log-space lower bound, e.g. -5.0)")
        if safe_gate and use_gate_in_kernel and not -5 <= lower_bound < 0:
            raise arg_error("lower_bound", lower_bound, "in [-5, 0) when safe_gate=True")
    if safe_gate and use_gate_in_kernel and lower_bound is None:
        raise arg_error("lower_bound", None, "set when safe_gate=True and use_gate_in_kernel=True")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise arg_error("allow_neg_eigval", True, "False unless use_beta_sigmoid_in_kernel=True")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.SymFloat, torch.SymInt)):
            raise arg_error("scale", type(scale).__name__, "a float or None", kind=TypeError)
        if not 0 < scale < math.inf:  # NaN fails too
            raise arg_error("scale", scale, "a finite float > 0 (it multiplies q), or None for K ** -0.5")
    if isinstance(chunk_size, bool) or chunk_size not in CHUNK_SIZES:
        raise arg_error("chunk_size", chunk_size, f"one of {plain(CHUNK_SIZES)}")


def check_cu_seqlens_values(offsets: list[int], T: int, name: str = "cu_seqlens") -> None:
    """Host values of ``cu_seqlens``: 0 first, non-decreasing (empty sequences are fine), ``T`` last."""
    if offsets[0] != 0:
        raise arg_error(name, _offsets(offsets), "offsets starting at 0")
    for n in range(len(offsets) - 1):
        if offsets[n + 1] < offsets[n]:
            raise arg_error(name, _offsets(offsets), f"non-decreasing offsets (sequence {n} has length "
                            f"{offsets[n + 1] - offsets[n]}; empty sequences are allowed, negative ones are not)")
    if offsets[-1] != T:
        raise arg_error(name, _offsets(offsets), f"offsets ending at T={T}, the number of packed tokens")


def _offsets(offsets: list[int], limit: int = 12) -> str:
    if len(offsets) <= limit:
        return f"{offsets}"
    return f"[{', '.join(map(str, offsets[:limit // 2]))}, ..., {', '.join(map(str, offsets[-limit // 2:]))}]" \
           f" ({len(offsets)} offsets)"


def check_input_values(q, g, *, cu_seqlens, use_gate_in_kernel, cu_seqlens_cpu=None) -> None:
    """The full value checks of ``check_inputs``: reads ``cu_seqlens`` and (for a finished gate) ``g`` on the
    host, synchronising the device. NaN / Inf inside q, k, v, g or beta are not errors: they stay in
    their own sequence (docs/kda-input-checks.md)."""
    if cu_seqlens is not None:
        _check_offsets(cu_seqlens, cu_seqlens_cpu, q.shape[1])
    if not use_gate_in_kernel and g.numel() > 0:
        positive = g > 0  # log decays: a positive one grows the state (NaN compares False: not flagged)
        if bool(positive.any()):
            count = int(positive.sum())
            index = [int(i) for i in torch.nonzero(positive)[0].tolist()]
            raise arg_error("g", f"{count} positive value(s), the first g{index} = {float(g[tuple(index)])}",
                            "<= 0 (log decays; -inf is a full reset) when use_gate_in_kernel=False")


def check_free_values(q, *, cu_seqlens, cu_seqlens_cpu) -> None:
    """The value checks that cost no device synchronisation: a CPU ``cu_seqlens`` and ``cu_seqlens_cpu``
    (compared with each other when both are on the host). Eager only: their values are data to Dynamo."""
    T = q.shape[1]
    if cu_seqlens_cpu is not None:
        check_cu_seqlens_values(cu_seqlens_cpu.tolist(), T, "cu_seqlens_cpu")
    if cu_seqlens is not None and cu_seqlens.device.type == "cpu":
        _check_offsets(cu_seqlens, cu_seqlens_cpu, T)


def _check_offsets(cu_seqlens, cu_seqlens_cpu, T: int) -> None:
    """``cu_seqlens``'s values (read to the host), and ``cu_seqlens_cpu`` equal to them when given."""
    offsets = cu_seqlens.tolist()
    check_cu_seqlens_values(offsets, T)
    if cu_seqlens_cpu is not None and cu_seqlens_cpu.tolist() != offsets:
        raise arg_error("cu_seqlens_cpu", _offsets(cu_seqlens_cpu.tolist()), f"equal to cu_seqlens {_offsets(offsets)}")


STATE_LAYOUT_ALIAS = "transpose_state_layout"


def state_layout_alias(fn: str, kwargs: dict, state_v_first: bool, *, stacklevel: int = 3) -> tuple[bool, dict]:
    """FLA 0.6's deprecated name of ``state_v_first``, accepted as FLA accepts it: ``(state_v_first, the other
    keyword arguments)``; a DeprecationWarning in eager calls; both names given is an error."""
    if STATE_LAYOUT_ALIAS not in kwargs:
        return state_v_first, kwargs
    kwargs = dict(kwargs)
    alias = kwargs.pop(STATE_LAYOUT_ALIAS)
    if state_v_first:
        raise arg_error(STATE_LAYOUT_ALIAS, alias, f"absent when state_v_first=True is given ({fn}: "
                        f"{STATE_LAYOUT_ALIAS} is the deprecated name of state_v_first)")
    if not isinstance(alias, bool):
        raise arg_error(STATE_LAYOUT_ALIAS, alias, "a bool (the deprecated name of state_v_first)")
    if not torch.compiler.is_compiling():
        warnings.warn(f"{fn}: `{STATE_LAYOUT_ALIAS}` is deprecated, use `state_v_first`", DeprecationWarning,
                      stacklevel=stacklevel)
    return alias, kwargs


def reject_unsupported_kwargs(fn: str, kwargs: dict, defaults: dict) -> None:
    """FLA options we accept only at their default (context parallelism, CUDA-graph varlen buffers,
    intermediate states), and keyword arguments FLA does not have."""
    for name, value in kwargs.items():
        if name not in defaults:
            raise TypeError(f"{fn}() got an unexpected keyword argument {name!r}")
        if value is not defaults[name] and value != defaults[name]:
            raise arg_error(name, value, f"{defaults[name]!r} (not supported by kda_compile)")
