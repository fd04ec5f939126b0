"""Triton kernel for the DSA lightning indexer: fused blockwise scores, written as exact top-k sort keys.

Kernel and launcher only (no torch.compile, no dispatch). For a tile of BLOCK_M queries x BLOCK_N keys
the kernel loads the key tile once, loops over the H_I indexer heads (one [BLOCK_M, D] x [D, BLOCK_N]
dot each) and accumulates ``w[i, h] * relu(scale * q[i, h] . k[s])`` in float32, so the
[S, H_I, T] logits never exist. It then writes, instead of the score, the int64 sort key of
``reference.order_keys`` (order-preserving fp32 bits << 31 | inverted key index; -1 for a key the query
may not see: outside its [lo, hi) range or masked by key_mask). ``torch.topk`` over these keys is the
exact top-k with the tie rule (equal scores: lower index first) on any GPU, without a custom select.

Fewer than ``SHORT_QUERIES`` queries (decode, short chunks) take ``indexer_keys_heads_kernel`` instead: one
query per program, its H_I heads as the MMA's rows.

Queries are processed in blocks whose [B, S_blk, width] key buffer stays under ``KEY_BUFFER_BYTES``;
``width`` stops at the last key the block can see (causal: half the work in prefill), and key tiles
wholly outside every row's range skip the head loop.

Under ``TRITON_INTERPRET=1`` a small fixed config runs the kernel on CPU tensors (fp32 / fp16).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kda_compile.ops._common import cdiv, next_power_of_2
from kda_compile.ops.dsa.reference import topk_from_keys, visible_ranges

KEY_BUFFER_BYTES = 256 << 20
SHORT_QUERIES = 16  # below this many queries a query tile would be mostly padding: heads become the MMA's rows


@triton.jit
def indexer_keys_kernel(
    Q, K, W, KeyMask, Lo, Hi, Out,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kd,
    stride_wb, stride_ws, stride_wh,
    stride_mb, stride_mt,
    stride_ob, stride_os, stride_ot,
    row0, rows, width, H, D, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, PRECISION: tl.constexpr,
):
    """Out[b, i - row0, s] = sort key of score[b, i, s] for queries row0 + [0, rows) and keys [0, width).

    Q [B, S, H, D], K [B, T, D], W [B, S, H], KeyMask [B, T] (uint8), Lo / Hi [S] int64 (query i sees
    keys lo <= s < hi), Out [B, rows, width] int64; all by strides. Grid (row tiles, key tiles, B)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    local = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = local < rows
    qi = row0 + local
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < width
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    lo = tl.load(Lo + qi, mask=row_ok, other=0)
    hi = tl.load(Hi + qi, mask=row_ok, other=0)
    visible = row_ok[:, None] & col_ok[None, :] & (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None])
    if HAS_KEY_MASK:
        km = tl.load(KeyMask + b * stride_mb + offs_n * stride_mt, mask=col_ok, other=0)
        visible = visible & (km != 0)[None, :]
    # A tile no row can see skips the head loop (causal prefill: about half of them).
    any_visible = tl.max(tl.max(visible.to(tl.int32), 1), 0)
    heads = tl.where(any_visible > 0, H, 0)

    k = tl.load(K + b * stride_kb + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    q_base = Q + b * stride_qb + qi[:, None] * stride_qs + offs_d[None, :] * stride_qd
    w_base = W + b * stride_wb + qi * stride_ws
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for h in range(0, heads):
        q = tl.load(q_base + h * stride_qh, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_base + h * stride_wh, mask=row_ok, other=0.0).to(tl.float32)
        logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        acc += tl.maximum(logits, 0.0) * w[:, None]

    # Order-preserving bits: flip the sign bit of non-negative floats, every bit of negative ones;
    # + 0.0 folds -0.0 onto +0.0 so equal scores share one pattern.
    bits = (acc + 0.0).to(tl.int32, bitcast=True).to(tl.int64)
    unsigned = bits & 0xFFFFFFFF
    ordered = tl.where(bits >= 0, unsigned | 0x80000000, unsigned ^ 0xFFFFFFFF)
    key = (ordered << 31) | (0x7FFFFFFF - offs_n.to(tl.int64))[None, :]
    key = tl.where(visible, key, -1)
    tl.store(Out + b * stride_ob + local[:, None] * stride_os + offs_n[None, :] * stride_ot, key,
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def indexer_keys_heads_kernel(
    Q, K, W, KeyMask, Lo, Hi, Out,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kd,
    stride_wb, stride_ws, stride_wh,
    stride_mb, stride_mt,
    stride_ob, stride_os, stride_ot,
    row0, width, H, D, scale,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, PRECISION: tl.constexpr,
):
    """As ``indexer_keys_kernel`` for one query per program with its heads as the MMA's M dimension:
    decode and short chunks (a query tile would be mostly padding there). One [H_I, D] x [D, BLOCK_N]
    dot, then the ReLU and the weighted sum over the head axis. Grid (rows, key tiles, B)."""
    local = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    qi = row0 + local
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < width
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    lo = tl.load(Lo + qi)
    hi = tl.load(Hi + qi)
    visible = col_ok & (offs_n >= lo) & (offs_n < hi)
    if HAS_KEY_MASK:
        km = tl.load(KeyMask + b * stride_mb + offs_n * stride_mt, mask=col_ok, other=0)
        visible = visible & (km != 0)
    q = tl.load(Q + b * stride_qb + qi * stride_qs + offs_h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.load(W + b * stride_wb + qi * stride_ws + offs_h * stride_wh, mask=h_ok, other=0.0).to(tl.float32)
    k = tl.load(K + b * stride_kb + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                mask=(visible[:, None]) & d_ok[None, :], other=0.0)
    logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], 0)
    bits = (score + 0.0).to(tl.int32, bitcast=True).to(tl.int64)
    unsigned = bits & 0xFFFFFFFF
    ordered = tl.where(bits >= 0, unsigned | 0x80000000, unsigned ^ 0xFFFFFFFF)
    key = (ordered << 31) | (0x7FFFFFFF - offs_n.to(tl.int64))
    key = tl.where(visible, key, -1)
    tl.store(Out + b * stride_ob + local * stride_os + offs_n * stride_ot, key, mask=col_ok)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _config(dim: int, dtype: torch.dtype):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). The fp32 score tile [BLOCK_M, BLOCK_N] stays in
    registers across the head loop; the key tile [BLOCK_N, D] is loaded once per program."""
    if interpreted():
        return 16, 16, 1, 1
    if dtype == torch.float32 or dim > 128:
        return 64, 64, 4, 2
    return 64, 128, 8, 3


def indexer_topk_triton(q, k, weights, key_mask, cu_seqlens, topk: int, scale: float, is_causal: bool):
    """int32 [B, S, topk]: ``dsa_indexer_topk`` with the fused score kernel and an exact top-k over its keys.

    q [B, S, H, D], k [B, T, D] (float16 / bfloat16 / float32, any strides), weights [B, S, H] floating,
    key_mask None or bool [B, T], cu_seqlens None or [N + 1] offsets (values already checked)."""
    b, s_len, heads, dim = q.shape
    t_len = k.shape[1]
    device = q.device
    out = torch.empty((b, s_len, topk), dtype=torch.int32, device=device)
    if s_len == 0:
        return out
    lo, hi = visible_ranges(s_len, t_len, is_causal, cu_seqlens, device)
    block_m, block_n, warps, stages = _config(dim, q.dtype)
    block_d = max(16, next_power_of_2(dim))
    mask = key_mask.view(torch.uint8) if key_mask is not None else lo
    mask_strides = tuple(key_mask.stride()) if key_mask is not None else (0, 0)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # Rows per block: the int64 key buffer [B, rows, T] under KEY_BUFFER_BYTES, a multiple of BLOCK_M.
    step = max(block_m, (KEY_BUFFER_BYTES // max(1, b * t_len * 8)) // block_m * block_m)
    for start in range(0, s_len, step):
        stop = min(s_len, start + step)
        # The last key this block can see (causal rows end at i + T - S); the rest is never written.
        width = min(t_len, stop - 1 + t_len - s_len + 1) if is_causal else t_len
        if width <= 0:
            out[:, start:stop] = -1
            continue
        keys = torch.empty((b, stop - start, width), dtype=torch.int64, device=device)
        strides = (*q.stride(), *k.stride(), *weights.stride(), *mask_strides, *keys.stride())
        if s_len < SHORT_QUERIES:  # decode / short chunks: heads as the MMA's rows
            grid = (stop - start, cdiv(width, block_n), b)
            indexer_keys_heads_kernel[grid](
                q, k, weights, mask, lo, hi, keys, *strides, start, width, heads, dim, float(scale),
                BLOCK_H=max(16, next_power_of_2(heads)), BLOCK_N=block_n, BLOCK_D=block_d,
                HAS_KEY_MASK=key_mask is not None, PRECISION=precision, num_warps=warps, num_stages=stages,
            )
        else:
            grid = (cdiv(stop - start, block_m), cdiv(width, block_n), b)
            indexer_keys_kernel[grid](
                q, k, weights, mask, lo, hi, keys, *strides, start, stop - start, width, heads, dim, float(scale),
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, HAS_KEY_MASK=key_mask is not None,
                PRECISION=precision, num_warps=warps, num_stages=stages,
            )
        out[:, start:stop] = topk_from_keys(keys, topk)
    return out
