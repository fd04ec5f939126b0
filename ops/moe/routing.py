"""Routed (token, slot) pairs grouped by expert, with fixed-shape torch ops (no host synchronisation, so a CUDA
graph captures it).

``pairs_by_expert(top_k_index, experts) -> (order, offsets)``: ``order`` [S] (S = T * K) lists the flat pair
indices ``t * K + j`` sorted by expert; ``offsets`` [E + 1] int32: expert e's pairs are
``order[offsets[e]:offsets[e + 1]]``. Pairs whose index lies outside ``[0, E)`` (Hugging Face's expert-parallel
sentinel) sort after every expert and belong to none.
"""
from __future__ import annotations

import torch


def pairs_by_expert(top_k_index: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = top_k_index.reshape(-1).to(torch.int32)
    flat = torch.where((flat >= 0) & (flat < experts), flat, experts)
    sorted_ids, order = torch.sort(flat, stable=True)
    bounds = torch.arange(experts + 1, device=flat.device, dtype=torch.int32)
    offsets = torch.searchsorted(sorted_ids, bounds, out_int32=True)
    return order.to(torch.int32), offsets
