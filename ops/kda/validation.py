"""Argument checks for the public KDA functions: every error names the argument, the value and
what is accepted. Checks read shapes, dtypes and devices only (never tensor values), so they are
free under torch.compile (they become guards) and never synchronise the GPU."""
from __future__ import annotations

import torch

from kda_compile.ops._common import arg_error, check_tensor, describe

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256
CHUNK_SIZES = (16, 32, 64)


def validate_kda_arguments(
    q, k, v, g, beta, *, initial_state, cu_seqlens, A_log, dt_bias, use_gate_in_kernel,
    use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, state_v_first, scale, chunk_size,
) -> None:
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    B, T, H, K = q.shape
    check_tensor("k", k, ndim=4, dtypes=FLOAT_DTYPES)
    if k.shape != q.shape:
        raise arg_error("k", describe(k), f"of q's shape [B, T, H, K] = {list(q.shape)}")
    check_tensor("v", v, ndim=4, dtypes=FLOAT_DTYPES)
    if v.shape[:2] != q.shape[:2]:
        raise arg_error("v", describe(v), f"of shape [B, T, HV, V] with [B, T] = {list(q.shape[:2])} as in q")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise arg_error("v", f"{HV} value heads for {H} q/k heads",
                        "a multiple of the q/k heads (HV % H == 0, grouped value attention)")
    if K > MAX_HEAD_DIM:
        raise arg_error("q", f"key head dim K={K}", f"K <= {MAX_HEAD_DIM}")
    check_tensor("g", g, ndim=4, dtypes=FLOAT_DTYPES)
    if g.shape != (B, T, HV, K):
        raise arg_error("g", describe(g), f"of shape [B, T, HV, K] = {[B, T, HV, K]}")
    check_tensor("beta", beta, ndim=3, dtypes=FLOAT_DTYPES)
    if beta.shape != (B, T, HV):
        raise arg_error("beta", describe(beta), f"of shape [B, T, HV] = {[B, T, HV]}")
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
            raise arg_error("initial_state", describe(initial_state), f"of shape {layout} = {expected}")
        if initial_state.device != q.device:
            raise arg_error("initial_state", f"a tensor on {initial_state.device}", f"on q's device {q.device}")

    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise arg_error("A_log", None, "a [HV] tensor when use_gate_in_kernel=True and lower_bound is None")
        if A_log is not None:
            check_tensor("A_log", A_log, dtypes=FLOAT_DTYPES)
            if A_log.numel() != HV:
                raise arg_error("A_log", describe(A_log), f"a tensor of HV={HV} elements")
        if dt_bias is not None:
            check_tensor("dt_bias", dt_bias, dtypes=FLOAT_DTYPES)
            if dt_bias.numel() != HV * K:
                raise arg_error("dt_bias", describe(dt_bias), f"a tensor of HV*K={HV * K} elements")
    if lower_bound is not None:
        if not isinstance(lower_bound, (int, float)) or not lower_bound < 0:
            raise arg_error("lower_bound", lower_bound, "a negative float (log-space lower bound, e.g. -5.0)")
        if safe_gate and use_gate_in_kernel and not -5 <= lower_bound < 0:
            raise arg_error("lower_bound", lower_bound, "in [-5, 0) when safe_gate=True")
    if safe_gate and use_gate_in_kernel and lower_bound is None:
        raise arg_error("lower_bound", None, "set when safe_gate=True and use_gate_in_kernel=True")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise arg_error("allow_neg_eigval", True, "False unless use_beta_sigmoid_in_kernel=True")
    if scale is not None and not isinstance(scale, (int, float, torch.SymFloat, torch.SymInt)):
        raise arg_error("scale", type(scale).__name__, "a float or None", kind=TypeError)
    if chunk_size not in CHUNK_SIZES:
        raise arg_error("chunk_size", chunk_size, f"one of {CHUNK_SIZES}")


def reject_unsupported_kwargs(fn: str, kwargs: dict, defaults: dict) -> None:
    """FLA options we accept only at their default (context parallelism, CUDA-graph varlen buffers,
    intermediate states), and keyword arguments FLA does not have."""
    for name, value in kwargs.items():
        if name not in defaults:
            raise TypeError(f"{fn}() got an unexpected keyword argument {name!r}")
        if value is not defaults[name] and value != defaults[name]:
            raise arg_error(name, value, f"{defaults[name]!r} (not supported by kda_compile)")
