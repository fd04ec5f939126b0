"""The experts of routed tokens through ``torch._grouped_mm`` (CUTLASS grouped GEMM, CUDA, bfloat16, sm_90+):
the kernel for large groups (prefill), where tensor-core tiles fill. The pairs are gathered in expert order, both
projections run as one grouped GEMM each, and the weighted results go back to their pairs. Fixed shapes, no host
synchronisation. Pairs outside every expert (the sentinel, ``routing.py``) sit past the last offset, where the
GEMM writes nothing: they are masked to 0. As in Hugging Face's ``grouped_mm`` path, the activations and the
weighted results stay in bfloat16 and a token's K results are summed in float32."""
from __future__ import annotations

import torch

from kda_compile.ops.moe.routing import pairs_by_expert


def grouped_mm_problem(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> str | None:
    """None when this call can run on ``torch._grouped_mm``, else why not."""
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm"
    if hidden_states.device.type != "cuda":
        return f"torch._grouped_mm runs on CUDA; the inputs are on {hidden_states.device}"
    if hidden_states.dtype != torch.bfloat16:
        return f"torch._grouped_mm takes bfloat16; the inputs are {hidden_states.dtype}"
    if torch.cuda.get_device_capability(hidden_states.device) < (9, 0):
        return "torch._grouped_mm needs compute capability 9.0 or newer"
    if any(dim * 2 % 16 for dim in (hidden_states.shape[1], down_proj.shape[2])):
        return "torch._grouped_mm needs H and I to be multiples of 8 (16-byte rows)"
    return None


def moe_experts_grouped_mm(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                           gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    tokens, width = hidden_states.shape
    top_k = top_k_index.shape[1]
    experts, inter = gate_up_proj.shape[0], down_proj.shape[2]
    order, offsets = pairs_by_expert(top_k_index, experts)
    order = order.long()
    ends = offsets[1:]
    gate_up = torch._grouped_mm(hidden_states[order // top_k], gate_up_proj.transpose(-2, -1), offs=ends)
    act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    down = torch._grouped_mm(act, down_proj.transpose(-2, -1), offs=ends)
    inside = torch.arange(order.numel(), device=order.device) < offsets[experts]
    weights = torch.where(inside, top_k_weights.reshape(-1)[order].to(down.dtype), 0.0)
    weighted = torch.where(inside[:, None], down, 0.0) * weights[:, None]
    back = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
    return weighted[back].view(tokens, top_k, width).sum(dim=1, dtype=torch.float32).to(hidden_states.dtype)
