"""Triton kernels for glm5_next's pooled DSA indexer: fused pool scores, written as exact top-k sort keys.

Kernels and launcher only (no torch.compile, no dispatch). The pooled keys ``pk [B, NP, D]`` and which pools
are complete and valid come from ``pooled.reference.prepare`` with the pools formed by one kernel (the CPU path's math
in one pass over the key cache: ``pooled/cuda_keys.py``, which copies whole token rows, for 16-bit keys on sm_80+, else
``pooled/triton_keys.py``). For a tile of BLOCK_M queries x
BLOCK_N pools the kernel loads the pool-key tile once, loops over the H_I indexer heads (one
``[BLOCK_M, D] x [D, BLOCK_N]`` dot each) and accumulates ``w[i, h] * relu(scale * q[i, h] . pk[p])`` in
float32: the ``[S, H_I, NP]`` logits never exist. It writes, instead of the score, the int64 order key of
``pooled.reference._order_keys`` (order-preserving fp32 bits << 31 | inverted pool index; -1 for a pool the query may
not take: incomplete, invalid, or with its last token ``first[b] + p * P + P - 1`` past the query's position). Tiles
no query can see skip the head loop.

The selection is the CPU path's merge: per query block, pool blocks of ``POOL_BLOCK`` pools are written into
an int64 buffer ``[B, S_blk, p_blk]`` (under ``KEY_BUFFER_BYTES``) and merged into a running ``torch.topk`` of
``slots`` keys (``pooled.reference.pool_slots``); the keys are distinct, so the result is exact with the tie rule (equal
scores: the lower pool) on any device. A block's pools stop at the last pool its queries can see from key 0
(causal prefill: half the work). Every launch and size is fixed by shapes and ``q_offset``: nothing is read
back from the device, so a call can be captured in a CUDA graph (after one call has compiled the kernels).
Each query block's rows are then written whole in HF's slot layout (the pools' tokens, the visible tail, -1 for
padding and padded queries) by one kernel, ``triton_layout.write_rows`` (the CPU path's ``write_pools`` and
``finish``, bit for bit).

Fewer than ``SHORT_QUERIES`` queries (decode, short chunks) take ``pooled_keys_heads_kernel``: one query per
program, its H_I heads as the MMA's rows. Under ``TRITON_INTERPRET=1`` a small fixed config runs the kernels
on CPU tensors (fp32 / fp16).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kda_compile.ops._common import cdiv, next_power_of_2
from kda_compile.ops._nvrtc import NvrtcUnavailable
from kda_compile.ops.dsa.pooled import cuda_keys
from kda_compile.ops.dsa.pooled.reference import (mask_first_and_pools, merge_best, output_width, pool_reach, prepare,
                                                  visible_count)
from kda_compile.ops.dsa.pooled.triton_layout import write_rows
from kda_compile.ops.dsa.indexer.triton_indexer import SHORT_QUERIES, interpreted
from kda_compile.ops.dsa.pooled.triton_keys import pooled_keys_triton

KEY_BUFFER_BYTES = 256 << 20  # one [B, S_blk, p_blk] int64 key buffer (plus the running top-k it merges into)
POOL_BLOCK = 16384  # pools scored per merge step (T = 256k tokens at P = 16 in one step; tests lower it)


def form_pools(k, gate, key_valid, ape):
    """(key_valid bool or None, first [B], pk, pool_valid): ``pooled.reference.mask_first_and_pools``'s contract from
    the CUDA kernels that read whole token rows (``pooled/cuda_keys.py``) where they serve the call, else from the
    Triton kernel. Floating key flags that lie in the copied rows (HF's cache) are read there: no separate pass makes
    the mask."""
    flags = key_valid if key_valid is not None and key_valid.dtype != torch.bool else None
    layout = cuda_keys.serving_layout(k, gate, ape.shape[0], flags)  # once per call (host time)
    if layout is not None:
        try:
            if layout.v_off >= 0:
                return cuda_keys.pools_from_rows(k, gate, key_valid, ape, layout)
            return mask_first_and_pools(k, gate, key_valid, ape,
                                        functools.partial(cuda_keys.pooled_keys_cuda, layout=layout))
        except NvrtcUnavailable as exc:
            cuda_keys.record_unavailable(exc)
    return mask_first_and_pools(k, gate, key_valid, ape, pooled_keys_triton)


@triton.jit
def _pool_candidates(PoolValid, First, b, offs_n, col_ok, stride_vb, stride_vp, POOL: tl.constexpr):
    """(ok, last) [BLOCK_N]: pool ``offs_n`` is complete and valid in row ``b``; its last token (int64). A query
    at position ``pos`` may take the pool when ``ok & (last <= pos)``."""
    first = tl.load(First + b)
    pv = tl.load(PoolValid + b * stride_vb + offs_n * stride_vp, mask=col_ok, other=0)
    return col_ok & (pv != 0), first + offs_n.to(tl.int64) * POOL + (POOL - 1)


@triton.jit
def _order_key(score, offs_n, visible):
    """int64 order keys: order-preserving bits of the fp32 score (sign bit flipped for non-negative values,
    every bit for negative ones; + 0.0 folds -0.0 onto +0.0) << 31 | the inverted pool index; -1 if hidden."""
    bits = (score + 0.0).to(tl.int32, bitcast=True).to(tl.int64)
    unsigned = bits & 0xFFFFFFFF
    ordered = tl.where(bits >= 0, unsigned | 0x80000000, unsigned ^ 0xFFFFFFFF)
    key = (ordered << 31) | (0x7FFFFFFF - offs_n.to(tl.int64))
    return tl.where(visible, key, -1)


@triton.jit
def pooled_keys_kernel(
    Q, PK, W, PoolValid, First, Out,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_pb, stride_pp, stride_pd,
    stride_wb, stride_ws, stride_wh,
    stride_vb, stride_vp,
    stride_ob, stride_os, stride_op,
    row0, rows, p0, width, H, D, scale, q_offset,
    POOL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Out[b, i - row0, p - p0] = order key of score[b, i, p] for queries row0 + [0, rows) and pools
    p0 + [0, width).

    Q [B, S, H, D], PK [B, NP, D], W [B, S, H] float32, PoolValid [B, NP] uint8, First [B] int64 (each row's
    first valid key), Out [B, rows, width] int64; all by strides. Grid (row tiles, pool tiles, B)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    local = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = local < rows
    qi = row0 + local
    tile = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = tile < width
    offs_n = p0 + tile
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    qpos = q_offset + qi.to(tl.int64)
    ok, last = _pool_candidates(PoolValid, First, b, offs_n, col_ok, stride_vb, stride_vp, POOL)
    visible = row_ok[:, None] & ok[None, :] & (last[None, :] <= qpos[:, None])
    # A tile no row can see skips the head loop (causal prefill: about half of them).
    any_visible = tl.max(tl.max(visible.to(tl.int32), 1), 0)
    heads = tl.where(any_visible > 0, H, 0)

    pk = tl.load(PK + b * stride_pb + offs_n[:, None] * stride_pp + offs_d[None, :] * stride_pd,
                 mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    q_base = Q + b * stride_qb + qi[:, None] * stride_qs + offs_d[None, :] * stride_qd
    w_base = W + b * stride_wb + qi * stride_ws
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for h in range(0, heads):
        q = tl.load(q_base + h * stride_qh, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_base + h * stride_wh, mask=row_ok, other=0.0)
        logits = tl.dot(q, tl.trans(pk), input_precision=PRECISION) * scale
        acc += tl.maximum(logits, 0.0) * w[:, None]
    key = _order_key(acc, offs_n[None, :], visible)
    tl.store(Out + b * stride_ob + local[:, None] * stride_os + tile[None, :] * stride_op, key,
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def pooled_keys_heads_kernel(
    Q, PK, W, PoolValid, First, Out,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_pb, stride_pp, stride_pd,
    stride_wb, stride_ws, stride_wh,
    stride_vb, stride_vp,
    stride_ob, stride_os, stride_op,
    row0, p0, width, H, D, scale, q_offset,
    POOL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """As ``pooled_keys_kernel`` for one query per program with its heads as the MMA's M dimension (decode
    and short chunks): one [H_I, D] x [D, BLOCK_N] dot, then the ReLU and the weighted sum over the head axis.
    Grid (rows, pool tiles, B)."""
    local = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    qi = row0 + local
    tile = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = tile < width
    offs_n = p0 + tile
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    ok, last = _pool_candidates(PoolValid, First, b, offs_n, col_ok, stride_vb, stride_vp, POOL)
    visible = ok & (last <= q_offset + qi)
    q = tl.load(Q + b * stride_qb + qi * stride_qs + offs_h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.load(W + b * stride_wb + qi * stride_ws + offs_h * stride_wh, mask=h_ok, other=0.0)
    pk = tl.load(PK + b * stride_pb + offs_n[:, None] * stride_pp + offs_d[None, :] * stride_pd,
                 mask=visible[:, None] & d_ok[None, :], other=0.0)
    logits = tl.dot(q, tl.trans(pk), input_precision=PRECISION) * scale
    score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], 0)
    key = _order_key(score, offs_n, visible)
    tl.store(Out + b * stride_ob + local * stride_os + tile * stride_op, key, mask=col_ok)


def _config(dim: int, dtype: torch.dtype):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): the token-level indexer's tiles (the same loop with pool
    keys in place of keys). The fp32 score tile stays in registers across the head loop."""
    if interpreted():
        return 16, 16, 1, 1
    if dtype == torch.float32 or dim > 128:
        return 64, 64, 4, 2
    return 64, 128, 8, 3


def pooled_indexer_topk_triton(q, k, gate, weights, key_valid, ape, query_mask, topk: int, scale: float,
                               q_offset: int, select_tail: bool) -> torch.Tensor:
    """int32 [B, S, topk (+ P - 1)]: ``dsa_pooled_indexer_topk`` with the fused pool-score kernels.

    q [B, S, H_I, D], k [B, T, D] (float16 / bfloat16 / float32, any strides), weights [B, S, H_I], gate
    [B, T, D], ape [P, D] floating, key_valid / query_mask None or bool. Same selection and layout as
    ``pooled.reference.pooled_indexer_topk_reference`` (bitwise where the float32 scores are exact)."""
    b, s_len, heads, dim = q.shape
    pool = ape.shape[0]
    out = torch.full((b, s_len, output_width(topk, pool, select_tail)), -1, dtype=torch.int32, device=q.device)
    if b == 0 or s_len == 0:
        return out
    key_valid, first, pos, pk, pool_valid, slots, n_sel = prepare(q, k, gate, key_valid, ape, topk, q_offset,
                                                                  form_pools=form_pools)
    n_pools = k.shape[1] // pool  # the pools that can be complete (pooled.pool_slots)
    # every row is written whole by write_rows (pooled/triton_layout.py): pools, tail, padding
    count = visible_count(key_valid, pos, q_offset, b, k.shape[1]) if select_tail and pool > 1 else None
    if slots > 0:
        weights = weights.float()  # the CPU path's rounding of the head weights
        valid_u8 = pool_valid.view(torch.uint8)
        block_m, block_n, warps, stages = _config(dim, q.dtype)
        block_d = max(16, next_power_of_2(dim))
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        pool_block = max(1, min(POOL_BLOCK, n_pools))
        # Rows per block: the key buffer and the merge's concatenation under KEY_BUFFER_BYTES, whole row tiles.
        row_bytes = b * (pool_block + 2 * slots) * 8
        step = max(block_m, (KEY_BUFFER_BYTES // max(1, row_bytes)) // block_m * block_m)
        for start in range(0, s_len, step):
            stop = min(s_len, start + step)
            reach = pool_reach(q_offset + stop - 1, pool, n_pools)
            best = None
            for p0 in range(0, reach, pool_block):
                width = min(reach, p0 + pool_block) - p0
                keys = torch.empty((b, stop - start, width), dtype=torch.int64, device=q.device)
                strides = (*q.stride(), *pk.stride(), *weights.stride(), *valid_u8.stride(), *keys.stride())
                if s_len < SHORT_QUERIES:  # decode / short chunks: heads as the MMA's rows
                    pooled_keys_heads_kernel[(stop - start, cdiv(width, block_n), b)](
                        q, pk, weights, valid_u8, first, keys, *strides, start, p0, width, heads, dim,
                        float(scale), q_offset, POOL=pool, BLOCK_H=max(16, next_power_of_2(heads)),
                        BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=precision, num_warps=warps, num_stages=stages,
                    )
                else:
                    pooled_keys_kernel[(cdiv(stop - start, block_m), cdiv(width, block_n), b)](
                        q, pk, weights, valid_u8, first, keys, *strides, start, stop - start, p0, width, heads, dim,
                        float(scale), q_offset, POOL=pool, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                        PRECISION=precision, num_warps=warps, num_stages=stages,
                    )
                best = merge_best(best, keys, slots)
            write_rows(out, start, stop, best, first, n_sel, count, key_valid, query_mask, pool, k.shape[1],
                       q_offset)
    else:  # no pool can be complete: the tail and the padding
        write_rows(out, 0, s_len, None, first, n_sel, count, key_valid, query_mask, pool, k.shape[1], q_offset)
    return out
