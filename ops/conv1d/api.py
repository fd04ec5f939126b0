"""Public entry point ``causal_conv1d_update``: argument checks, then one custom-op call (Dynamo traces it without a
graph break)."""
from __future__ import annotations

import torch

from kda_compile.ops._argument_errors import deferred_error
from kda_compile.ops._common import arg_error, check_tensor, describe, shown
from kda_compile.ops.conv1d import custom_ops  # noqa: F401  (registers torch.ops.kda_compile.causal_conv1d_update)
from kda_compile.ops.conv1d.choice import KERNELS
from kda_compile.ops.conv1d.reference import ACTIVATIONS

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None, *,
                         kernel: str = "auto") -> torch.Tensor:
    """A causal depthwise conv1d over ``conv_state`` and ``x``, with ``conv_state`` rolled forward in place.

    The decode step of the short convolution in front of the delta rule (Kimi-Linear, Qwen3-Next and the other
    hybrid models): ``out[..., t] = activation(bias + sum_j weight[:, j] * window[..., L + t - W + 1 + j])`` with
    ``window = cat([conv_state, x], -1)``, then ``conv_state`` holds the last L entries of ``window``. Math and
    roundings: ``reference.py`` (Hugging Face's own ``causal_conv1d_update``); kernels: ``choice.py``. One launch on
    CUDA, so a CUDA graph of a decode step holds one kernel per conv instead of a concatenation, a copy, a
    convolution and an activation.

    Args:
        x: [B, C, T] new tokens (T >= 0; T = 1 for decode), float16 / bfloat16 / float32 / float64, any strides.
        conv_state: [B, C, L], the last L inputs of each sequence, L >= max(W - 1, 1); written in place. Any floating
            dtype of the list, any strides; on x's device.
        weight: [C, W] depthwise taps (Hugging Face's ``conv1d.weight.squeeze(1)``), W >= 1; x's device.
        bias: [C] or None, weight's dtype.
        activation: None, "silu" or "swish" (SiLU).
        kernel: "auto", "triton" or "reference" (tests, benchmarks).

    Returns:
        [B, C, T] contiguous, in x's dtype.

    Bad arguments raise ValueError / TypeError naming the argument, its value and what is accepted, eagerly and,
    unchanged, from a ``torch.compile(fullgraph=True)`` function when it runs (docs/op-input-errors.md).
    """
    try:
        _check_arguments(x, conv_state, weight, bias, activation, kernel)
    except (ValueError, TypeError) as error:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) and x.dim() == 3 else (0, 0, 0)
        return deferred_error(error, x, o_shape=shape)[0]
    return torch.ops.kda_compile.causal_conv1d_update(x, conv_state, weight, bias, activation, kernel)


def _check_arguments(x, conv_state, weight, bias, activation, kernel) -> None:
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise arg_error("kernel", shown(kernel), "one of " + ", ".join(repr(k) for k in KERNELS))
    if activation not in ACTIVATIONS:
        raise arg_error("activation", shown(activation), "None, 'silu' or 'swish'")
    check_tensor("x", x, ndim=3, dtypes=_DTYPES)
    check_tensor("conv_state", conv_state, ndim=3, dtypes=_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=_DTYPES)
    check_tensor("bias", bias, ndim=1, dtypes=_DTYPES, allow_none=True)
    batch, channels, _ = x.shape
    if weight.shape[0] != channels or weight.shape[1] < 1:
        raise arg_error("weight", describe(weight), f"[C, W] with C = {channels} (x's channels) and W >= 1")
    width = weight.shape[1]
    if conv_state.shape[0] != batch or conv_state.shape[1] != channels or conv_state.shape[2] < max(width - 1, 1):
        raise arg_error("conv_state", describe(conv_state),
                        f"[B, C, L] = [{batch}, {channels}, L] with L >= {max(width - 1, 1)} (max(W - 1, 1), W from "
                        "weight)")
    if bias is not None and (bias.shape[0] != channels or bias.dtype != weight.dtype):
        raise arg_error("bias", describe(bias), f"[{channels}] of weight's dtype {weight.dtype}, or None")
    for name, t in (("conv_state", conv_state), ("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise arg_error(name, describe(t), f"on x's device {x.device}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        raise arg_error("x / weight / bias", "a tensor that requires grad",
                        "inputs without gradients (causal_conv1d_update has no backward: run it under "
                        "torch.no_grad() or torch.inference_mode(), as generate() does)")
