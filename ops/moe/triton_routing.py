"""The Triton experts' routing and combine in one launch each, for the few pairs of a decode step.

``routing.py`` groups the routed pairs by expert with torch ops: a dtype cast, the sentinel mask, a stable sort,
an arange and a search, about ten launches per call. At decode the experts' two launches read every hit expert's
weights in a few microseconds, so those small launches were most of the op's launches in a CUDA graph.

- ``route_pairs(top_k_index, experts) -> (order, offsets)``: ``routing.pairs_by_expert``'s result in one launch.
  Pair i's place in the stable order is the number of pairs that sort before it,
  ``#{j : e_j < e_i} + #{j < i : e_j == e_i}`` (a sentinel expert, outside ``[0, E)``, counts as E), and
  ``offsets[e] = #{j : e_j < e}``. Programs ``0 .. ceil(S / BLOCK) - 1`` each place BLOCK pairs, the rest each
  count BLOCK offsets; every program compares its block with all S pairs (S * S / BLOCK compares per program), so
  the launch is meant for at most ``ONE_LAUNCH_PAIRS`` pairs, where a sort's several launches cost more.
- ``combine_pairs(per_pair, top_k_index, experts, dtype)``: each token's K rows of float32 per-pair outputs summed
  in slot order (deterministic, no atomics) and rounded once to ``dtype``; a sentinel slot's row is never read, so
  ``per_pair`` needs no zeroing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 64  # pairs (or offsets) per routing program; a 64 x 64 comparison tile per step
ONE_LAUNCH_PAIRS = 8192  # the most pairs route_pairs is meant for (moe_experts_triton sorts above it)


@triton.jit
def _experts_of(index_ptr, pairs, ok, E):
    """The pairs' experts as int32, a sentinel (outside [0, E)) as E."""
    expert = tl.load(index_ptr + pairs, mask=ok, other=0)
    return tl.where((expert >= 0) & (expert < E), expert, E).to(tl.int32)


@triton.jit
def _route(index_ptr, order_ptr, offsets_ptr, S, E, PLACE_PROGRAMS, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if pid < PLACE_PROGRAMS:  # place BLOCK pairs in the stable order
        mine = pid * BLOCK + tl.arange(0, BLOCK)
        mine_ok = mine < S
        mine_expert = _experts_of(index_ptr, mine, mine_ok, E)
        place = tl.zeros((BLOCK,), dtype=tl.int32)
        for other0 in range(0, S, BLOCK):
            other = other0 + tl.arange(0, BLOCK)
            other_ok = other < S
            other_expert = _experts_of(index_ptr, other, other_ok, E)
            earlier = (other_expert[None, :] < mine_expert[:, None]) | (
                (other_expert[None, :] == mine_expert[:, None]) & (other[None, :] < mine[:, None]))
            place += tl.sum((earlier & other_ok[None, :]).to(tl.int32), axis=1)
        tl.store(order_ptr + place, mine, mask=mine_ok)
    else:  # count BLOCK of the E + 1 offsets
        bound = (pid - PLACE_PROGRAMS) * BLOCK + tl.arange(0, BLOCK)
        count = tl.zeros((BLOCK,), dtype=tl.int32)
        for other0 in range(0, S, BLOCK):
            other = other0 + tl.arange(0, BLOCK)
            other_ok = other < S
            other_expert = _experts_of(index_ptr, other, other_ok, E)
            below = (other_expert[None, :] < bound[:, None]) & other_ok[None, :]
            count += tl.sum(below.to(tl.int32), axis=1)
        tl.store(offsets_ptr + bound, count, mask=bound <= E)


@triton.jit
def _combine(per_pair_ptr, index_ptr, out_ptr, H, E, stride_p, stride_o, TOP_K: tl.constexpr,
             BLOCK_H: tl.constexpr):
    token = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for slot in range(TOP_K):
        pair = token * TOP_K + slot
        expert = tl.load(index_ptr + pair)
        routed = (expert >= 0) & (expert < E)
        acc += tl.load(per_pair_ptr + pair.to(tl.int64) * stride_p + h, mask=h_ok & routed, other=0.0)
    tl.store(out_ptr + token.to(tl.int64) * stride_o + h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


def route_pairs(top_k_index: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order [S] int32, offsets [E + 1] int32)`` of a contiguous ``top_k_index`` [T, K] (any integer dtype), as
    ``routing.pairs_by_expert`` gives them; one launch (S >= 1)."""
    flat = top_k_index.reshape(-1)
    pairs = flat.numel()
    order = torch.empty(pairs, device=flat.device, dtype=torch.int32)
    offsets = torch.empty(experts + 1, device=flat.device, dtype=torch.int32)
    place_programs = triton.cdiv(pairs, BLOCK)
    _route[(place_programs + triton.cdiv(experts + 1, BLOCK),)](
        flat, order, offsets, pairs, experts, place_programs, BLOCK=BLOCK, num_warps=4)
    return order, offsets


def combine_pairs(per_pair: torch.Tensor, top_k_index: torch.Tensor, experts: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """[T, H] in ``dtype``: the sum over each token's routed slots of ``per_pair`` [T * K, H] (float32, rows of
    sentinel slots unread), rounded once."""
    tokens, top_k = top_k_index.shape
    width = per_pair.shape[1]
    out = torch.empty(tokens, width, device=per_pair.device, dtype=dtype)
    block_h = min(1024, triton.next_power_of_2(width))
    _combine[(tokens, triton.cdiv(width, block_h))](
        per_pair, top_k_index, out, width, experts, per_pair.stride(0), out.stride(0), TOP_K=top_k,
        BLOCK_H=block_h, num_warps=4)
    return out
