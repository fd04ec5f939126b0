"""Triton top-k selection for the DSA indexer: an exact radix select over int32 score codes, written in
ascending key order.

Kernel and launcher only (no torch.compile, no dispatch). The indexer's score kernels write one int32
*code* per (query, key): the float32 score's bits made order-preserving as a signed integer (``bits`` for
non-negative floats, ``bits ^ 0x7FFFFFFF`` for negative ones, -0.0 folded onto +0.0), and ``CODE_HIDDEN``
(``INT32_MIN``) for a key the query may not see. Larger code = higher score.

One program per query row:

1. Radix select: four passes over the row's visible range ``[lo, hi)``, one byte of the code each, most
   significant first. A pass builds the 256-bin histogram of that byte among the keys that still match the
   prefix chosen so far and keeps the bin holding the ``remaining``-th best key. After four passes the
   prefix is the exact code ``tau`` of the top-k's smallest member, and ``remaining`` says how many keys of
   code ``tau`` belong to the top-k. A pass whose chosen bin belongs to the top-k whole ends the select
   early: every key at or above that bin is in (with distinct scores this is the usual case after two or
   three passes).
2. Compaction: one more pass writes, in index order, every key with code > ``tau`` and the first
   ``remaining`` keys with code == ``tau`` (the tie rule: equal scores, lower key index first), then -1 up
   to ``topk``.

So a row costs five reads of its ``hi - lo`` codes (4 bytes each) and one write of its ``topk`` indices:
no ``[rows, T]`` int64 buffer and no sort. The result equals ``reference.topk_from_keys`` (``torch.topk``
over ``reference.order_keys``, listed in ascending key order) bit for bit.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kda_compile.ops._common import next_power_of_2

CODE_HIDDEN = -(2**31)  # the code of a key the query may not see: below every visible code
MAX_TILE = 4096  # codes per loaded tile (16 per thread at 8 warps)
MIN_TILE = 1024


@triton.jit
def score_codes(score, visible):
    """int32 codes of float32 ``score`` (see the module docstring); ``CODE_HIDDEN`` where not ``visible``."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)  # + 0.0 folds -0.0 onto +0.0
    code = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    hidden = -2147483647 - 1
    code = tl.maximum(code, hidden + 1)  # only the all-ones NaN pattern maps onto the hidden code
    return tl.where(visible, code, hidden)


@triton.jit
def radix_topk_kernel(
    Codes, Lo, Hi, Out,
    stride_cb, stride_cs, stride_ct,
    stride_ob, stride_os, stride_ok,
    row0, TOPK,
    BLOCK: tl.constexpr,
):
    """Out[b, local, :TOPK] = the top-TOPK key indices of code row ``Codes[b, local, lo:hi]`` in ascending
    order, -1 padded, where [lo, hi) = [Lo[row0 + local], Hi[row0 + local]). Grid (rows, B)."""
    local = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    qi = row0 + local
    lo = tl.load(Lo + qi)
    hi = tl.load(Hi + qi)
    first = (lo // BLOCK) * BLOCK
    row = Codes + b * stride_cb + local * stride_cs
    hidden = -2147483647 - 1
    bins = tl.arange(0, 256)

    # 1. Radix select, one byte per pass, most significant first. ``u`` is the code with its sign bit
    # flipped: the same order, unsigned, so its bytes can be binned. ``exact``: the chosen bin is wholly in
    # the top-k (every key with ``u >= prefix`` is), so the remaining passes are skipped.
    prefix = tl.zeros([], dtype=tl.int32)
    prefix_mask = tl.zeros([], dtype=tl.int32)
    remaining = tl.zeros([], dtype=tl.int32) + TOPK
    total = tl.zeros([], dtype=tl.int32)
    exact = tl.zeros([], dtype=tl.int1)
    for rnd in tl.static_range(4):
        shift = 24 - 8 * rnd
        hist = tl.zeros([256], dtype=tl.int32)
        for start in range(first, tl.where(exact, first, hi), BLOCK):
            offs = start + tl.arange(0, BLOCK)
            code = tl.load(row + offs * stride_ct, mask=(offs >= lo) & (offs < hi), other=hidden)
            u = code ^ hidden
            match = (code != hidden) & ((u & prefix_mask) == prefix)
            hist += tl.histogram((u >> shift) & 255, 256, mask=match)
        matching = tl.sum(hist, 0)
        if rnd == 0:
            total = matching
        want = tl.minimum(remaining, matching)
        at_or_above = matching - (tl.cumsum(hist, 0) - hist)  # keys in bins >= d, non-increasing in d
        digit = tl.sum((at_or_above >= want).to(tl.int32), 0) - 1
        in_bin = tl.sum(tl.where(bins == digit, hist, 0), 0)
        left = want - tl.sum(tl.where(bins == digit, at_or_above - hist, 0), 0)
        remaining = tl.where(exact, remaining, left)
        prefix = tl.where(exact, prefix, prefix | (digit << shift))
        prefix_mask = prefix_mask | ((tl.zeros([], dtype=tl.int32) + 255) << shift)
        exact = exact | (left == in_bin)

    # Fewer visible keys than TOPK: take them all.
    all_fit = total <= TOPK
    tau = tl.where(all_fit, hidden, prefix ^ hidden)
    ties = tl.where(all_fit | exact, 0, remaining)
    exact = exact & ~all_fit

    # 2. Compaction in index order: codes above tau and the first ``ties`` codes equal to tau, then -1.
    out = Out + b * stride_ob + local * stride_os
    taken = tl.zeros([], dtype=tl.int32)
    tied = tl.zeros([], dtype=tl.int32)
    for start in range(first, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        code = tl.load(row + offs * stride_ct, mask=(offs >= lo) & (offs < hi), other=hidden)
        eq = ((code == tau) & (code != hidden)).to(tl.int32)
        tie_rank = tied + tl.cumsum(eq, 0) - eq
        sel = (code > tau) | ((eq != 0) & (tie_rank < ties)) | (exact & (code >= tau) & (code != hidden))
        sel = sel.to(tl.int32)
        pos = taken + tl.cumsum(sel, 0) - sel
        tl.store(out + pos * stride_ok, offs.to(tl.int32), mask=sel != 0)
        taken += tl.sum(sel, 0)
        tied += tl.sum(eq, 0)
    for start in range(taken, TOPK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(out + offs * stride_ok, tl.full([BLOCK], -1, tl.int32), mask=offs < TOPK)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def topk_from_codes(codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, row0: int, topk: int,
                    out: torch.Tensor) -> None:
    """Write into ``out`` (int32 [B, rows, topk], any strides) the top-k of ``codes`` (int32 [B, rows, width]
    from ``score_codes``) in ascending key order; row ``r`` sees columns ``lo[row0 + r] <= s < hi[row0 + r]``
    (int64 [S]; ``hi`` at most ``width``)."""
    b, rows, width = codes.shape
    if b * rows == 0:
        return
    # About eight tiles per row: a pass's fixed cost (merging the warps' histograms) against the padding of a
    # row's last tile (H200: 4k x 4k causal 251 us with 1024-wide tiles, 379 with 4096; one 32k row 122 us
    # with 4096, 194 with 1024).
    tile = min(MAX_TILE, max(MIN_TILE, next_power_of_2(width // 8)))
    if interpreted():
        tile = min(max(16, next_power_of_2(width)), 64)
    radix_topk_kernel[(rows, b)](
        codes, lo, hi, out, *codes.stride(), *out.stride(), row0, topk,
        BLOCK=tile, num_warps=1 if interpreted() else (8 if tile >= 2048 else 4),
    )
