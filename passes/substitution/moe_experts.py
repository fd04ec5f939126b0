"""Trace-time substitution of Hugging Face's grouped-GEMM experts (``transformers.integrations.moe``).

Every HF mixture-of-experts model whose experts class carries ``@use_experts_implementation`` (Qwen3-Next,
Qwen3.5-MoE, DeepSeek-V2 / V3 / V3.2, Kimi-Linear, Mixtral, GLM-4 MoE and about sixty more) runs
``grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)`` by default
(``config._experts_implementation == "grouped_mm"``). Once kda_compile's substitutes are installed, Dynamo
traces instead::

    kda_compile.ops.moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)

which computes the same function (ops/moe/reference.py) and chooses its kernel per call: decode streams each hit
expert's weights once (the Triton kernels), prefill keeps the grouped GEMM.

Taken only where the module is the plain gated-SiLU form the op computes, decided at trace time from the module's
attributes (constants to Dynamo, guarded): gate and up concatenated, weights not transposed, no bias, no post-expert
norm, not expert-parallel, HF's default gate with a SiLU activation, and no gradient needed (the op's backward is
a reference: training keeps HF's grouped GEMM and its backward). Anything else traces HF's own function, with the
reason logged once at INFO. ``Config(kda_substitution=False)`` / ``KDA_COMPILE_SUBSTITUTION=0`` switch it off with
the other substitutes.
"""
from __future__ import annotations

import logging
import sys
from typing import Callable

import torch

from kda_compile.ops import moe_experts
from kda_compile.passes.substitution.substitutes import _copy_of, _declined_once, _substituting

logger = logging.getLogger("kda_compile.passes.kda_substitution")

HF_MOE_MODULE = "transformers.integrations.moe"
ENTRY_POINT = "transformers grouped_mm_experts_forward"


def _is_silu(act) -> bool:
    if act is torch.nn.functional.silu or isinstance(act, torch.nn.SiLU):
        return True
    return type(act).__name__ == "SiLUActivation" and type(act).__module__.startswith("transformers.")


def why_not_substituted(module, default_gate: Callable | None) -> str | None:
    """None when ``module`` (an HF experts module) is the form ``moe_experts`` computes, else why not."""
    flags = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
             "has_post_expert_norm": False, "_is_expert_parallel": False}
    for name, wanted in flags.items():
        if getattr(module, name, None) is not wanted:
            return f"{type(module).__name__}.{name} is {getattr(module, name, None)!r} (the op takes {wanted!r})"
    if default_gate is None or getattr(type(module), "_apply_gate", None) is not default_gate:
        return f"{type(module).__name__} has its own _apply_gate"
    if not _is_silu(getattr(module, "act_fn", None)):
        return f"{type(module).__name__}.act_fn is {type(getattr(module, 'act_fn', None)).__name__}, not SiLU"
    weights = (getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None))
    if not all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights):
        return f"{type(module).__name__} has no 3-D gate_up_proj / down_proj"
    if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
        return "gradients are needed (training keeps the grouped GEMM and its backward)"
    return None


def make_substitute(original: Callable, default_gate: Callable | None) -> Callable:
    twin = _copy_of(original)

    def grouped_mm_experts_substitute(self, hidden_states, top_k_index, top_k_weights):
        reason = why_not_substituted(self, default_gate)
        if reason is None and _substituting(ENTRY_POINT):
            return moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)
        if reason is not None:
            _declined_once(ENTRY_POINT, reason)
        return twin(self, hidden_states, top_k_index, top_k_weights)

    return grouped_mm_experts_substitute


def register(register_fn: Callable) -> None:
    """Register the substitute of HF's ``grouped_mm_experts_forward`` once its module is imported, through
    ``register_fn(entry, found_at, original, make)`` (kda_substitution's registration)."""
    module = sys.modules.get(HF_MOE_MODULE)
    original = getattr(module, "grouped_mm_experts_forward", None) if module is not None else None
    if original is None:
        return
    default_gate = getattr(module, "_default_apply_gate", None)
    register_fn(ENTRY_POINT, f"{HF_MOE_MODULE}.grouped_mm_experts_forward", original,
                lambda: make_substitute(original, default_gate))
