"""Trace-time substitution of Hugging Face's ``causal_conv1d_update``: the short convolution of a decode step.

The linear-attention layers of the delta-rule families (kimi_linear, bailing_hybrid, glm5_next, qwen3_next,
qwen3_5, qwen3_5_moe, olmo_hybrid, qwen4_exp) run, for each token they decode, HF's torch function::

    hidden_states_new = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)
    conv_state.copy_(hidden_states_new[:, :, -state_len:])
    out = F.conv1d(hidden_states_new, weight.unsqueeze(1), bias, padding=0, groups=hidden_size)[:, :, -seq_len:]
    out = ACT2FN[activation](out).to(hidden_states.dtype)

which Inductor compiles into a concatenation, the state copy, a convolution and the activation: three or four
launches per layer and step. Once kda_compile's substitutes are installed, Dynamo traces instead
``kda_compile.ops.causal_conv1d_update(hidden_states, conv_state, weight, bias, activation)``: the same function
(ops/conv1d/reference.py is HF's code) in one launch, the state written in place by the op (declared to
torch.library, so CUDA graphs capture it).

Taken when the op computes the call: activation None, "silu" or "swish", a state of at least max(W - 1, 1)
entries, and no gradient needed (the op has no backward; HF's training forward runs ``causal_conv1d_fn``).
Anything else traces HF's function, with the reason logged once at INFO. ``Config(kda_substitution=False)`` /
``KDA_COMPILE_SUBSTITUTION=0`` switch it off with the other substitutes.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from kda_compile.ops import causal_conv1d_update
from kda_compile.passes.substitution.substitutes import (_copy_of, _declined_once, _substituting,
                                                         register_hf_module_functions)

logger = logging.getLogger("kda_compile.passes.kda_substitution")

FAMILIES = ("kimi_linear", "bailing_hybrid", "glm5_next", "qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid",
            "qwen4_exp")
MODULES = tuple(f"transformers.models.{m}.modeling_{m}" for m in FAMILIES)
PARAMETERS = ("hidden_states", "conv_state", "weight", "bias", "activation")
ENTRY_POINT = "transformers causal_conv1d_update"
ACTIVATIONS = (None, "silu", "swish")


def why_not_substituted(hidden_states, conv_state, weight, bias, activation) -> str | None:
    """None when the op computes the call, else why not (plain Python on the traced tensors' metadata)."""
    if activation not in ACTIVATIONS:
        return f"activation={activation!r} (the op applies None or SiLU)"
    tensors = (hidden_states, conv_state, weight)
    if not all(isinstance(t, torch.Tensor) and t.dim() == d for t, d in zip(tensors, (3, 3, 2))):
        return "hidden_states / conv_state / weight are not [B, C, T] / [B, C, L] / [C, W] tensors"
    if conv_state.shape[-1] < max(weight.shape[-1] - 1, 1):
        return f"a conv state of {conv_state.shape[-1]} entries for {weight.shape[-1]} taps"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden_states, weight, bias)):
        return "gradients are needed (the op has no backward)"
    return None


def make_substitute(original: Callable) -> Callable:
    twin = _copy_of(original)

    def hf_causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None):
        reason = why_not_substituted(hidden_states, conv_state, weight, bias, activation)
        if reason is None and _substituting(ENTRY_POINT):
            return causal_conv1d_update(hidden_states, conv_state, weight, bias, activation)
        if reason is not None:
            _declined_once(ENTRY_POINT, reason)
        return twin(hidden_states, conv_state, weight, bias, activation)

    return hf_causal_conv1d_update


def register(register_fn: Callable) -> None:
    """Register the substitute of each loaded family module's ``causal_conv1d_update`` (HF's hub wrapper and the
    torch function it wraps) through ``register_fn(entry, found_at, original, make)``."""
    register_hf_module_functions(register_fn, MODULES, "causal_conv1d_update", PARAMETERS, ENTRY_POINT,
                                 make_substitute, "not substituted (its decode conv runs as written)")
