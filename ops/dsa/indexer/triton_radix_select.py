"""The steps of the DSA top-k's exact radix select, shared by its kernels (``indexer/triton_topk.py``, whose docstring
has the select and the code layout): the select state, a round's digit histogram, the step to the next digit, the
rule at the threshold, and the compaction in key order with the tie rule.

Triton ``@jit`` helpers only. ``u`` is a code with its sign bit flipped (the same order, unsigned, so its digits
can be binned), 0 for a hidden key; digit ``RND`` of ``BITS`` bits is the code's bits
``[32 - BITS (RND + 1), 32 - BITS RND)``, most significant first.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def radix_init(TOPK):
    """The select's state before round 0: (prefix, prefix_mask, remaining, total, exact)."""
    prefix = tl.zeros([], dtype=tl.int32)
    prefix_mask = tl.zeros([], dtype=tl.int32)
    remaining = tl.zeros([], dtype=tl.int32) + TOPK
    total = tl.zeros([], dtype=tl.int32)
    exact = tl.zeros([], dtype=tl.int1)
    return prefix, prefix_mask, remaining, total, exact


@triton.jit
def round_hist(row, stride_ct, lo, hi, start, stop, prefix, prefix_mask, RND: tl.constexpr, BITS: tl.constexpr,
                BLOCK: tl.constexpr):
    """Round ``RND``'s ``2**BITS``-bin histogram of the code's digit ``RND`` (``BITS`` wide, most significant
    first) over the tiles ``[start, stop)`` of a row, among its codes in ``[lo, hi)`` that are visible and match
    ``prefix`` under ``prefix_mask``. ``u`` is the code with its sign bit flipped: the same order, unsigned, so
    its digits can be binned."""
    hidden = -2147483647 - 1
    hist = tl.zeros([1 << BITS], dtype=tl.int32)
    for tile in range(start, stop, BLOCK):
        offs = tile + tl.arange(0, BLOCK)
        code = tl.load(row + offs * stride_ct, mask=(offs >= lo) & (offs < hi), other=hidden)
        hist += digit_histogram(code ^ hidden, prefix, prefix_mask, RND, BITS)
    return hist


@triton.jit
def digit_histogram(u, prefix, prefix_mask, RND: tl.constexpr, BITS: tl.constexpr):
    """The ``2**BITS``-bin histogram of digit ``RND`` of ``u`` (codes with the sign bit flipped, 0 for a hidden
    key) among the visible ones matching ``prefix`` under ``prefix_mask``."""
    shift: tl.constexpr = 32 - BITS * (RND + 1)
    match = (u != 0) & ((u & prefix_mask) == prefix)
    return tl.histogram((u >> shift) & ((1 << BITS) - 1), 1 << BITS, mask=match)


@triton.jit
def radix_step(hist, prefix, prefix_mask, remaining, total, exact, RND: tl.constexpr, BITS: tl.constexpr):
    """The state after round ``RND`` (digit width ``BITS``: the code bits ``[32 - BITS (RND + 1), 32 - BITS
    RND)``) given its histogram ``hist`` (``2**BITS`` bins; all zero once ``exact``): keep the bin holding the
    ``remaining``-th best matching key. ``exact``: the chosen bin is wholly in the top-k (every key with
    ``u >= prefix`` is), so later rounds change nothing."""
    shift = 32 - BITS * (RND + 1)
    bins = tl.arange(0, 1 << BITS)
    matching = tl.sum(hist, 0)
    if RND == 0:
        total = matching
    want = tl.minimum(remaining, matching)
    at_or_above = matching - (tl.cumsum(hist, 0) - hist)  # keys in bins >= d, non-increasing in d
    digit = tl.sum((at_or_above >= want).to(tl.int32), 0) - 1
    in_bin = tl.sum(tl.where(bins == digit, hist, 0), 0)
    left = want - tl.sum(tl.where(bins == digit, at_or_above - hist, 0), 0)
    remaining = tl.where(exact, remaining, left)
    prefix = tl.where(exact, prefix, prefix | (digit << shift))
    prefix_mask = prefix_mask | ((tl.zeros([], dtype=tl.int32) + ((1 << BITS) - 1)) << shift)
    exact = exact | (left == in_bin)
    return prefix, prefix_mask, remaining, total, exact


@triton.jit
def select_rule(prefix, remaining, total, exact, TOPK):
    """(tau, ties, exact) after the last round: select codes > tau, the first ``ties`` codes == tau and, if
    ``exact``, every visible code >= tau. Fewer visible keys than TOPK: take them all."""
    hidden = -2147483647 - 1
    all_fit = total <= TOPK
    tau = tl.where(all_fit, hidden, prefix ^ hidden)
    ties = tl.where(all_fit | exact, 0, remaining)
    return tau, ties, exact & ~all_fit


@triton.jit
def compact(row, stride_ct, out, stride_ok, lo, hi, start, stop, tau, ties, exact, taken, tied,
             BLOCK: tl.constexpr):
    """Write, in index order from ``out[taken]``, the selected keys of the tiles ``[start, stop)``; ``tied``
    codes equal to ``tau`` come before these tiles. Returns the new (taken, tied)."""
    hidden = -2147483647 - 1
    for tile in range(start, stop, BLOCK):
        offs = tile + tl.arange(0, BLOCK)
        code = tl.load(row + offs * stride_ct, mask=(offs >= lo) & (offs < hi), other=hidden)
        taken, tied = compact_codes(code, offs, out, stride_ok, tau, ties, exact, taken, tied)
    return taken, tied


@triton.jit
def compact_codes(code, offs, out, stride_ok, tau, ties, exact, taken, tied):
    """Write, in index order from ``out[taken]``, the selected keys among ``code`` (at key indices ``offs``);
    ``tied`` codes equal to ``tau`` come before them. Returns the new (taken, tied)."""
    hidden = -2147483647 - 1
    eq = ((code == tau) & (code != hidden)).to(tl.int32)
    tie_rank = tied + tl.cumsum(eq, 0) - eq
    sel = (code > tau) | ((eq != 0) & (tie_rank < ties)) | (exact & (code >= tau) & (code != hidden))
    sel = sel.to(tl.int32)
    pos = taken + tl.cumsum(sel, 0) - sel
    tl.store(out + pos * stride_ok, offs.to(tl.int32), mask=sel != 0)
    return taken + tl.sum(sel, 0), tied + tl.sum(eq, 0)


@triton.jit
def pad_to_topk(out, stride_ok, taken, TOPK, BLOCK: tl.constexpr):
    """-1 into ``out[taken:TOPK]``."""
    for start in range(taken, TOPK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(out + offs * stride_ok, tl.full([BLOCK], -1, tl.int32), mask=offs < TOPK)
