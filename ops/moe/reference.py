"""Reference math of ``moe_experts``: each token's routed experts, one at a time, in float32 (float64 stays
float64).

For token t with experts ``e_j = top_k_index[t, j]`` and weights ``w_j = top_k_weights[t, j]``::

    gate, up = split(x_t @ gate_up_proj[e_j].T)            # gate_up_proj [E, 2I, H]: gate rows first
    out_t = sum_j w_j * ((silu(gate) * up) @ down_proj[e_j].T)   # down_proj [E, H, I]

the computation of Hugging Face's experts modules with concatenated gate / up weights (``grouped_mm``,
``batched_mm`` and the eager loop compute the same function). An index outside ``[0, E)`` selects no expert
(Hugging Face's expert-parallel sentinel): its term is 0.
"""
from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def moe_experts_reference(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                          gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    """[T, H] in hidden_states' dtype; loops over the experts that are hit (host-side, so it synchronises)."""
    dtype = compute_dtype(hidden_states.dtype)
    experts, inter = gate_up_proj.shape[0], down_proj.shape[2]
    x = hidden_states.to(dtype)
    out = torch.zeros_like(x)
    valid = (top_k_index >= 0) & (top_k_index < experts)
    for expert in torch.unique(top_k_index[valid]).tolist():
        tokens, slots = torch.nonzero(top_k_index == expert, as_tuple=True)
        gate_up = x[tokens] @ gate_up_proj[expert].to(dtype).T
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        hidden = torch.nn.functional.silu(gate) * up
        contribution = (hidden @ down_proj[expert].to(dtype).T) * top_k_weights[tokens, slots, None].to(dtype)
        out.index_add_(0, tokens, contribution)
    return out.to(hidden_states.dtype)
