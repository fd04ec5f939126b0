"""Triton kernel writing the pooled indexer's output rows in Hugging Face's slot layout, in one launch.

The CPU path (``pooled.reference.write_pools`` then ``pooled.reference.finish``) expands the chosen pools into their
tokens, computes the visible tail, scatters it after the ``n_sel`` pools and blanks the padded queries: about thirty
small PyTorch kernels per call, most of a batch-1 decode step's GPU time and, in eager calls, far more host time. Here
one program writes one whole row of ``out`` ``[B, S, topk (+ P - 1)]`` (int32):

- columns ``< slots * P``: the token ``first[b] + pool * P + j`` of slot ``c // P`` (``j = c % P``), the pool read
  from the running top-k's int64 order key (``pooled.reference._order_keys``: the inverted pool index in the low 31
  bits; -1 where the slot holds no pool);
- with the tail, columns ``n_sel * P + j`` (``j < P - 1``, ``n_sel`` a device scalar) instead hold the visible
  tail: ``first[b] + count - count % P + j`` where ``j < count % P``, the token exists, the query sees it and it is
  a valid key (``count``: the query's visible valid keys, ``pooled.reference.visible_count``), else -1;
- every other column, and every column of a padded query (``query_mask`` False), -1.

The same values as the CPU path, bit for bit (tests/dsa/test_triton_pooled.py compares the whole op with it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kda_compile.ops._common import next_power_of_2
from kda_compile.ops.dsa.reference import ORDER_INDEX_MASK
from kda_compile.ops.dsa.indexer.triton_indexer import interpreted

BLOCK_COLUMNS = 1024  # columns a program writes per step of its row


@triton.jit
def pool_rows_kernel(
    Out, Best, First, NSel, Count, KeyValid, QueryMask,
    stride_ob, stride_os, stride_oc,
    stride_bb, stride_bs, stride_bk,
    stride_cb, stride_cs,
    stride_vb, stride_vt,
    stride_mb, stride_ms,
    row0, width, slots, T, q_offset,
    POOL: tl.constexpr, ORDER_INDEX_MASK: tl.constexpr, HAS_BEST: tl.constexpr, HAS_TAIL: tl.constexpr,
    HAS_KEY_VALID: tl.constexpr, HAS_QUERY_MASK: tl.constexpr, BLOCK: tl.constexpr,
):
    """Row ``row0 + local`` of batch row ``b`` (grid (rows, B)); Best [B, rows, slots] int64 holds the block's rows
    from its first (``local``); Count [B, S] int64, KeyValid [B, T] uint8, QueryMask [B, S] uint8, NSel a 0-dim
    int64; all by strides, each read only under its flag."""
    local = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    s = row0 + local
    first = tl.load(First + b)
    if HAS_TAIL:
        n_sel = tl.load(NSel)
        count = tl.load(Count + b * stride_cb + s * stride_cs)
        tail_count = count % POOL
        tail_start = first + count - tail_count
        pos = q_offset + s
    if HAS_QUERY_MASK:
        keep_row = tl.load(QueryMask + b * stride_mb + s * stride_ms) != 0
    for c0 in range(0, width, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        in_row = c < width
        value = tl.full([BLOCK], -1, tl.int64)
        if HAS_BEST:
            slot = c // POOL
            in_slots = in_row & (slot < slots)
            key = tl.load(Best + b * stride_bb + local * stride_bs + slot * stride_bk, mask=in_slots, other=-1)
            pool = tl.where(key >= 0, ORDER_INDEX_MASK - (key & ORDER_INDEX_MASK), -1)
            value = tl.where(in_slots & (pool >= 0), first + pool * POOL + c % POOL, value)
        if HAS_TAIL:
            j = c - n_sel * POOL
            in_tail = (j >= 0) & (j < POOL - 1)
            token = tail_start + j
            keep = in_tail & (j < tail_count) & (token < T) & (token <= pos)
            if HAS_KEY_VALID:
                safe = tl.where(keep, token, 0)
                keep = keep & (tl.load(KeyValid + b * stride_vb + safe * stride_vt, mask=keep, other=0) != 0)
            value = tl.where(in_tail, tl.where(keep, token, -1), value)
        if HAS_QUERY_MASK:
            value = tl.where(keep_row, value, -1)
        tl.store(Out + b * stride_ob + s * stride_os + c * stride_oc, value.to(tl.int32), mask=in_row)


def write_rows(out, start: int, stop: int, best, first, n_sel, count, key_valid, query_mask, pool: int, t_len: int,
               q_offset: int) -> None:
    """Rows ``start..stop`` of ``out`` [B, S, width] int32, whole (module docstring). ``best`` [B, stop - start,
    slots] int64 order keys or None (no pool in these rows), ``first`` [B] int64, ``n_sel`` 0-dim int64, ``count``
    [B, S] int64 visible counts or None (no tail), ``key_valid`` / ``query_mask`` bool or None."""
    b, width = out.shape[0], out.shape[2]
    rows = stop - start
    if b == 0 or rows <= 0:
        return
    placeholder = first
    best_t = best if best is not None else placeholder
    count_t = count if count is not None else placeholder
    valid_u8 = key_valid.view(torch.uint8) if key_valid is not None else placeholder
    mask_u8 = query_mask.view(torch.uint8) if query_mask is not None else placeholder
    strides = lambda t, n: t.stride() if t is not placeholder else (0,) * n  # noqa: E731
    on_interpreter = interpreted()
    block = 16 if on_interpreter else min(BLOCK_COLUMNS, max(16, next_power_of_2(width)))
    pool_rows_kernel[(rows, b)](
        out, best_t, first, n_sel, count_t, valid_u8, mask_u8,
        *out.stride(), *strides(best_t, 3), *strides(count_t, 2), *strides(valid_u8, 2), *strides(mask_u8, 2),
        start, width, best.shape[-1] if best is not None else 0, t_len, q_offset,
        POOL=pool, ORDER_INDEX_MASK=ORDER_INDEX_MASK, HAS_BEST=best is not None, HAS_TAIL=count is not None,
        HAS_KEY_VALID=key_valid is not None, HAS_QUERY_MASK=query_mask is not None, BLOCK=block,
        num_warps=1 if on_interpreter else 4,
    )
