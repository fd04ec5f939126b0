"""Reference math of ``causal_conv1d_update``: the conv over the state and the new tokens, then the state rolled.

With ``x`` [B, C, T] (T new tokens), ``conv_state`` [B, C, L] (the last L inputs, L >= max(W - 1, 1)) and ``weight``
[C, W]::

    window = cat([conv_state, x], -1).to(weight.dtype)               # [B, C, L + T]
    conv_state[:] = window[..., -L:]                                 # in place
    out[..., t] = bias + sum_j weight[:, j] * window[..., L + t - W + 1 + j]   # in weight's dtype
    out = activation(out).to(x.dtype)                                # None or SiLU

Hugging Face's ``causal_conv1d_update`` (kimi_linear, qwen3_next, qwen3_5, olmo_hybrid, mamba and others)
computes this with ``torch.cat``, ``conv_state.copy_`` and a grouped ``F.conv1d``; this function is that code, the
op's reference and its CPU kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu", "swish")  # "swish" is Hugging Face's other name of SiLU


def causal_conv1d_update_reference(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                                   bias: torch.Tensor | None, activation: str | None) -> torch.Tensor:
    channels, state_len, tokens = x.shape[1], conv_state.shape[-1], x.shape[-1]
    window = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
    conv_state.copy_(window[:, :, -state_len:])
    out = F.conv1d(window, weight.unsqueeze(1), bias, padding=0, groups=channels)[:, :, -tokens:]
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype).contiguous()
