"""Public entry point ``moe_experts``: argument checks, then one custom-op call (Dynamo traces it without a graph
break)."""
from __future__ import annotations

import torch

from kda_compile.ops._argument_errors import deferred_error, sizes
from kda_compile.ops._common import arg_error, check_tensor, describe, plain, shown
from kda_compile.ops.moe import custom_ops  # noqa: F401  (registers torch.ops.kda_compile.moe_experts)
from kda_compile.ops.moe.choice import KERNELS

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


def moe_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, *, kernel: str = "auto") -> torch.Tensor:
    """Routed experts with gated SiLU: what Hugging Face's experts modules compute from their router's choice.

    ``out[t] = sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(hidden_states[t])`` with
    ``expert_e(x) = (silu(x @ G_e^T) * (x @ U_e^T)) @ down_proj[e]^T`` and ``gate_up_proj[e] = [G_e; U_e]``
    (gate rows first, HF's concatenated layout). Math: ``reference.py``; kernels and their choice: ``choice.py``.

    Args:
        hidden_states: [T, H] tokens (float16, bfloat16, float32, float64).
        top_k_index: [T, K] int32 / int64 experts per token. An index outside ``[0, E)`` selects no expert
            (Hugging Face's expert-parallel sentinel): its term is 0. Values are not checked (that would
            synchronise the host with the device).
        top_k_weights: [T, K] floating routing weights (any floating dtype; read in float32).
        gate_up_proj: [E, 2I, H], hidden_states' dtype and device.
        down_proj: [E, H, I], the same.
        kernel: "auto" (per call), "triton", "grouped_mm" or "reference" (tests, benchmarks).

    Returns:
        [T, H] in hidden_states' dtype. T = 0 or K = 0 gives zeros of that shape.

    Bad arguments raise ValueError / TypeError naming the argument, its value and what is accepted, eagerly and,
    unchanged, from a ``torch.compile(fullgraph=True)`` function when it runs (docs/op-input-errors.md).
    """
    try:
        _check_arguments(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, kernel)
    except (ValueError, TypeError) as error:
        shape = sizes(hidden_states, 2) or (0, 0)
        return deferred_error(error, hidden_states, o_shape=shape)[0]
    return torch.ops.kda_compile.moe_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                             kernel)


def _check_arguments(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, kernel) -> None:
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise arg_error("kernel", shown(kernel), "one of " + ", ".join(repr(k) for k in KERNELS))
    check_tensor("hidden_states", hidden_states, ndim=2, dtypes=_DTYPES)
    check_tensor("top_k_index", top_k_index, ndim=2, dtypes=_INDEX_DTYPES)
    check_tensor("top_k_weights", top_k_weights, ndim=2)
    check_tensor("gate_up_proj", gate_up_proj, ndim=3, dtypes=_DTYPES)
    check_tensor("down_proj", down_proj, ndim=3, dtypes=_DTYPES)
    if not top_k_weights.dtype.is_floating_point:
        raise arg_error("top_k_weights", describe(top_k_weights), "a floating tensor", kind=TypeError)
    tokens, width = hidden_states.shape
    if top_k_index.shape[0] != tokens:
        raise arg_error("top_k_index", describe(top_k_index), f"[T, K] with T = {tokens} (hidden_states' rows)")
    if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise arg_error("top_k_weights", describe(top_k_weights),
                        f"of top_k_index's shape {plain(tuple(top_k_index.shape))}")
    experts, double_inter, gate_width = gate_up_proj.shape
    if gate_width != width or double_inter % 2 or experts == 0:
        raise arg_error("gate_up_proj", describe(gate_up_proj),
                        f"[E, 2I, H] with E >= 1, an even middle size and H = {width} (hidden_states' width)")
    if tuple(down_proj.shape) != (experts, width, double_inter // 2):
        raise arg_error("down_proj", describe(down_proj),
                        f"[E, H, I] = [{experts}, {width}, {double_inter // 2}] (from gate_up_proj)")
    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if t.dtype != hidden_states.dtype:
            raise arg_error(name, describe(t), f"of hidden_states' dtype {hidden_states.dtype}", kind=TypeError)
    for name, t in (("top_k_index", top_k_index), ("top_k_weights", top_k_weights), ("gate_up_proj", gate_up_proj),
                    ("down_proj", down_proj)):
        if t.device != hidden_states.device:
            raise arg_error(name, describe(t), f"on hidden_states' device {hidden_states.device}")
