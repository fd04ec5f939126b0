"""The experts of routed tokens in two Triton launches, written for decode-sized groups (a few tokens per expert).

Every expert's weights are read once per launch whatever its number of tokens, and an expert no token chose costs
one load of its two offsets: decode is a stream of the hit experts' weights, and the grid runs over all experts so
its shape never depends on the routing (CUDA graphs capture it).

- ``_gate_up``: program (expert e, block of I): for each block of e's pairs (BLOCK_M rows), ``x @ W_gate^T`` and
  ``x @ W_up^T`` accumulated in float32 over H, ``silu(gate) * up`` rounded once to the activations' dtype and
  stored at the pair's sorted position: ``hidden [S, I]``.
- ``_down``: program (expert e, block of H): ``hidden @ W_down^T`` in float32, times the pair's routing weight,
  stored as float32 at the pair's own index: ``per_pair [S, H]``. The K pairs of a token are then summed in float32
  (a fixed order, no atomics: deterministic) and rounded once.

The grouping of pairs by expert and the final sum are one launch each (``triton_routing.py``) up to
``ONE_LAUNCH_PAIRS`` pairs, so a decode step's MoE layer is four launches; above it the grouping is
``routing.py``'s sort.

A group larger than BLOCK_M loops over row blocks, reading its weight tiles again (from L2 when the group is
small); large groups (prefill) are the grouped GEMM's job (``api.py`` chooses per call).
Device-agnostic: runs under ``TRITON_INTERPRET=1`` on CPU tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kda_compile.ops.moe.routing import pairs_by_expert
from kda_compile.ops.moe.triton_routing import ONE_LAUNCH_PAIRS, combine_pairs, route_pairs

BLOCK_M = 16  # rows per tile: the smallest tl.dot M


@triton.jit
def _expert_block(offsets_ptr, w_ptr, columns, stride_we, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's expert's pairs' range [start, end) in sorted order, its block of output columns (and their
    mask), the reduction offsets and the pointers to the block's weight rows."""
    expert = tl.program_id(0)
    start = tl.load(offsets_ptr + expert)
    end = tl.load(offsets_ptr + expert + 1)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    w = w_ptr + expert.to(tl.int64) * stride_we + n[:, None].to(tl.int64) * stride_wn + kk[None, :]
    return start, end, n, n < columns, kk, w


@triton.jit
def _pair_rows(order_ptr, row0, end, BLOCK_M: tl.constexpr):
    """The sorted rows [row0, row0 + BLOCK_M) of this expert, their mask and the (token, slot) pairs they hold."""
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    return rows, row_ok, tl.load(order_ptr + rows, mask=row_ok, other=0)


@triton.jit
def _dot_t(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b^T; IEEE float32 products for float32 inputs (no TF32)."""
    if IEEE:
        return tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(b), acc)


@triton.jit
def _gate_up(x_ptr, w_ptr, order_ptr, offsets_ptr, hidden_ptr, H, I, TOP_K,
             stride_x, stride_we, stride_wn, stride_h,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    start, end, n, n_ok, kk, w_gate = _expert_block(offsets_ptr, w_ptr, I, stride_we, stride_wn, BLOCK_N, BLOCK_K)
    w_up = w_gate + I * stride_wn
    for row0 in range(start, end, BLOCK_M):
        rows, row_ok, pair = _pair_rows(order_ptr, row0, end, BLOCK_M)
        token = pair // TOP_K
        x = x_ptr + token[:, None].to(tl.int64) * stride_x + kk[None, :]
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_ok = (k0 + kk) < H
            xv = tl.load(x + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            gate = _dot_t(xv, tl.load(w_gate + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0), gate, IEEE)
            up = _dot_t(xv, tl.load(w_up + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0), up, IEEE)
        act = gate * tl.sigmoid(gate) * up
        out = hidden_ptr + rows[:, None].to(tl.int64) * stride_h + n[None, :]
        tl.store(out, act.to(hidden_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down(hidden_ptr, w_ptr, order_ptr, offsets_ptr, weights_ptr, out_ptr, H, I,
          stride_h, stride_we, stride_wn, stride_o,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    start, end, n, n_ok, kk, w = _expert_block(offsets_ptr, w_ptr, H, stride_we, stride_wn, BLOCK_N, BLOCK_K)
    for row0 in range(start, end, BLOCK_M):
        rows, row_ok, pair = _pair_rows(order_ptr, row0, end, BLOCK_M)
        h = hidden_ptr + rows[:, None].to(tl.int64) * stride_h + kk[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k_ok = (k0 + kk) < I
            hv = tl.load(h + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _dot_t(hv, tl.load(w + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0), acc, IEEE)
        scale = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        out = out_ptr + pair[:, None].to(tl.int64) * stride_o + n[None, :]
        tl.store(out, acc * scale[:, None], mask=row_ok[:, None] & n_ok[None, :])


def _tiles(inner: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for an output block over ``inner`` reduced elements: 64-wide output blocks keep several
    programs per expert in flight; the reduction tile is at most 128 and never far past ``inner``."""
    return 64, max(16, min(128, triton.next_power_of_2(inner)))


def moe_experts_triton(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    """``moe_experts`` (reference.py) for float16 / bfloat16 / float32 inputs of one device; [T, H] in
    hidden_states' dtype. Weights and activations need unit stride along their last dimension (Hugging Face's
    parameters have it); the caller makes the device current."""
    tokens, width = hidden_states.shape
    top_k = top_k_index.shape[1]
    experts, inter = gate_up_proj.shape[0], down_proj.shape[2]
    pairs = tokens * top_k
    if not pairs:
        return hidden_states.new_zeros(tokens, width)
    top_k_index = top_k_index.contiguous()
    if pairs <= ONE_LAUNCH_PAIRS:
        order, offsets = route_pairs(top_k_index, experts)  # one launch (triton_routing.py)
    else:
        order, offsets = pairs_by_expert(top_k_index, experts)
    weights = top_k_weights.reshape(-1)
    ieee = hidden_states.dtype == torch.float32
    hidden = torch.empty(pairs, inter, device=hidden_states.device, dtype=hidden_states.dtype)
    per_pair = torch.empty(pairs, width, device=hidden_states.device, dtype=torch.float32)  # sentinel rows unread
    block_n, block_k = _tiles(width)
    _gate_up[(experts, triton.cdiv(inter, block_n))](
        hidden_states, gate_up_proj, order, offsets, hidden, width, inter, top_k,
        hidden_states.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), hidden.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, num_warps=4, num_stages=3)
    block_n, block_k = _tiles(inter)
    _down[(experts, triton.cdiv(width, block_n))](
        hidden, down_proj, order, offsets, weights, per_pair, width, inter,
        hidden.stride(0), down_proj.stride(0), down_proj.stride(1), per_pair.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, num_warps=4, num_stages=3)
    return combine_pairs(per_pair, top_k_index, experts, hidden_states.dtype)
