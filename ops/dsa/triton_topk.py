"""Triton top-k selection for the DSA indexer: an exact radix select over int32 score codes, written in
ascending key order.

Kernel and launcher only (no torch.compile, no dispatch). The indexer's score kernels write one int32
*code* per (query, key): the float32 score's bits made order-preserving as a signed integer (``bits`` for
non-negative floats, ``bits ^ 0x7FFFFFFF`` for negative ones, -0.0 folded onto +0.0), and ``CODE_HIDDEN``
(``INT32_MIN``) for a key the query may not see. Larger code = higher score.

The select, for one query row:

1. Radix select: four rounds over the row's visible range ``[lo, hi)``, one byte of the code each, most
   significant first. A round builds the 256-bin histogram of that byte among the keys that still match the
   prefix chosen so far and keeps the bin holding the ``remaining``-th best key (``_radix_step``). After four
   rounds the prefix is the exact code ``tau`` of the top-k's smallest member, and ``remaining`` says how many
   keys of code ``tau`` belong to the top-k. A round whose chosen bin belongs to the top-k whole ends the
   select early (``exact``): every key at or above that bin is in (with distinct scores this is the usual
   case after two or three rounds).
2. Compaction: one more pass writes, in index order, every key with code > ``tau`` and the first
   ``remaining`` keys with code == ``tau`` (the tie rule: equal scores, lower key index first), then -1 up
   to ``topk``.

So a row costs five reads of its ``hi - lo`` codes (4 bytes each) and one write of its ``topk`` indices:
no ``[rows, T]`` int64 buffer and no sort. The result equals ``reference.topk_from_keys`` (``torch.topk``
over ``reference.order_keys``, listed in ascending key order) bit for bit.

Two paths run this select (``topk_from_codes`` picks one with ``row_split_chunks``):

- **One program per row** (``radix_topk_kernel``, one launch): the program streams its row five times,
  keeping the histograms in registers. Used whenever the grid of rows (``B * rows``) fills the GPU (prefill:
  thousands of rows) or rows are short.
- **Row split** (few long rows: decode, where ``B * rows`` is 1 to 64 and a row holds 8k to 128k keys, so
  one program per row would leave most SMs idle): one program per (chunk, row, batch), a row's tiles from
  ``lo``'s tile to ``hi`` cut into ``chunks`` contiguous runs of whole tiles (runs are empty when a row has
  fewer tiles than chunks). A memset and six launches of grid (chunks, rows, B), with no host
  synchronisation and no data-dependent launch size (a CUDA graph can capture it):

  1. zero an int32 ``[4, B, rows, 256]`` histogram buffer (one per round);
  2. four launches of ``split_hist_kernel``, one per round ``r``: each program takes the row's select state
     (prefix, prefix mask, remaining, total, exact) one ``_radix_step`` further with round ``r - 1``'s
     histogram, now complete (chunk 0 stores the new state in an int32 ``[5, 5, B, rows]`` buffer for the
     next launch), histograms its chunk's matching codes and adds them into round ``r``'s histogram with one
     256-wide atomic add. Programs of a row whose select ended early skip their codes;
  3. ``split_count_kernel``: each program finishes the select with round 3's histogram (chunk 0 stores
     ``tau``, ties and ``exact``) and counts its chunk's codes selected for sure and its codes equal to
     ``tau`` into an int32 ``[2, B, rows, chunks]`` buffer;
  4. ``split_write_kernel``: each program sums its row's counts over the chunks before it (its output offset,
     and the tie rank of its first code equal to ``tau``: the tie rule holds across chunks) and compacts its
     chunk there; chunk 0 writes the -1 padding.

  The histograms summed over chunks are those the one-program kernel builds, and both paths step through
  them with the same ``_radix_step`` / ``_select_rule`` / ``_compact``, so they write the same indices. A
  row's codes are read five times in all, as in the one-program kernel, plus a few 256-wide histogram loads
  and atomic adds per program.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from kda_compile.ops._common import arg_error, cdiv, cuda_index, next_power_of_2, sm_count
from kda_compile.ops._common import triton_interpreted as interpreted

CODE_HIDDEN = -(2**31)  # the code of a key the query may not see: below every visible code
MAX_TILE = 4096  # codes per loaded tile (16 per thread at 8 warps)
MIN_TILE = 1024

# Row split (few long rows). Chosen from the costs of the one-program kernel (one row of 32k keys: 76 us on an
# H200, about 2 us per 4096-wide tile and round); measured with these values (H200, CUDA graph): one row of
# 32k 28 us, 64 rows of 32k 72 us (99 with one program per row). Not swept further.
SPLIT_TILE = 1024  # codes per loaded tile of the row-split kernels (8 per thread at 4 warps)
SPLIT_BELOW_PROGRAMS_PER_SM = 2  # split while B * rows < this many programs per SM
SPLIT_PROGRAMS_PER_SM = 3  # aim for about this many (chunk, row) programs per SM
SPLIT_MIN_ROW_TILES = 4  # rows narrower than this many tiles stay one program per row
SPLIT_MIN_CHUNK_TILES = 2  # each chunk streams at least this many tiles
INTERPRETER_SMS = 4  # the SM count assumed under the Triton interpreter (so CPU tests take both paths)
INTERPRETER_SPLIT_TILE = 16


@triton.jit
def score_codes(score, visible):
    """int32 codes of float32 ``score`` (see the module docstring); ``CODE_HIDDEN`` where not ``visible``."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)  # + 0.0 folds -0.0 onto +0.0
    code = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    hidden = -2147483647 - 1
    code = tl.maximum(code, hidden + 1)  # only the all-ones NaN pattern maps onto the hidden code
    return tl.where(visible, code, hidden)


# ----------------------------------------------------------------------------------------------
# The select's steps, shared by both paths.
# ----------------------------------------------------------------------------------------------
@triton.jit
def _radix_init(TOPK):
    """The select's state before round 0: (prefix, prefix_mask, remaining, total, exact)."""
    prefix = tl.zeros([], dtype=tl.int32)
    prefix_mask = tl.zeros([], dtype=tl.int32)
    remaining = tl.zeros([], dtype=tl.int32) + TOPK
    total = tl.zeros([], dtype=tl.int32)
    exact = tl.zeros([], dtype=tl.int1)
    return prefix, prefix_mask, remaining, total, exact


@triton.jit
def _round_hist(row, stride_ct, lo, hi, start, stop, prefix, prefix_mask, RND: tl.constexpr,
                BLOCK: tl.constexpr):
    """Round ``RND``'s 256-bin histogram of the code byte ``3 - RND`` over the tiles ``[start, stop)`` of a
    row, among its codes in ``[lo, hi)`` that are visible and match ``prefix`` under ``prefix_mask``. ``u`` is
    the code with its sign bit flipped: the same order, unsigned, so its bytes can be binned."""
    hidden = -2147483647 - 1
    shift = 24 - 8 * RND
    hist = tl.zeros([256], dtype=tl.int32)
    for tile in range(start, stop, BLOCK):
        offs = tile + tl.arange(0, BLOCK)
        code = tl.load(row + offs * stride_ct, mask=(offs >= lo) & (offs < hi), other=hidden)
        u = code ^ hidden
        match = (code != hidden) & ((u & prefix_mask) == prefix)
        hist += tl.histogram((u >> shift) & 255, 256, mask=match)
    return hist


@triton.jit
def _radix_step(hist, prefix, prefix_mask, remaining, total, exact, RND: tl.constexpr):
    """The state after round ``RND`` given its histogram ``hist`` (all zero once ``exact``): keep the bin
    holding the ``remaining``-th best matching key. ``exact``: the chosen bin is wholly in the top-k (every
    key with ``u >= prefix`` is), so later rounds change nothing."""
    shift = 24 - 8 * RND
    bins = tl.arange(0, 256)
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
    prefix_mask = prefix_mask | ((tl.zeros([], dtype=tl.int32) + 255) << shift)
    exact = exact | (left == in_bin)
    return prefix, prefix_mask, remaining, total, exact


@triton.jit
def _select_rule(prefix, remaining, total, exact, TOPK):
    """(tau, ties, exact) after the four rounds: select codes > tau, the first ``ties`` codes == tau and, if
    ``exact``, every visible code >= tau. Fewer visible keys than TOPK: take them all."""
    hidden = -2147483647 - 1
    all_fit = total <= TOPK
    tau = tl.where(all_fit, hidden, prefix ^ hidden)
    ties = tl.where(all_fit | exact, 0, remaining)
    return tau, ties, exact & ~all_fit


@triton.jit
def _compact(row, stride_ct, out, stride_ok, lo, hi, start, stop, tau, ties, exact, taken, tied,
             BLOCK: tl.constexpr):
    """Write, in index order from ``out[taken]``, the selected keys of the tiles ``[start, stop)``; ``tied``
    codes equal to ``tau`` come before these tiles. Returns the new (taken, tied)."""
    hidden = -2147483647 - 1
    for tile in range(start, stop, BLOCK):
        offs = tile + tl.arange(0, BLOCK)
        code = tl.load(row + offs * stride_ct, mask=(offs >= lo) & (offs < hi), other=hidden)
        eq = ((code == tau) & (code != hidden)).to(tl.int32)
        tie_rank = tied + tl.cumsum(eq, 0) - eq
        sel = (code > tau) | ((eq != 0) & (tie_rank < ties)) | (exact & (code >= tau) & (code != hidden))
        sel = sel.to(tl.int32)
        pos = taken + tl.cumsum(sel, 0) - sel
        tl.store(out + pos * stride_ok, offs.to(tl.int32), mask=sel != 0)
        taken += tl.sum(sel, 0)
        tied += tl.sum(eq, 0)
    return taken, tied


@triton.jit
def _pad(out, stride_ok, taken, TOPK, BLOCK: tl.constexpr):
    """-1 into ``out[taken:TOPK]``."""
    for start in range(taken, TOPK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(out + offs * stride_ok, tl.full([BLOCK], -1, tl.int32), mask=offs < TOPK)


# ----------------------------------------------------------------------------------------------
# One program per row.
# ----------------------------------------------------------------------------------------------
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

    prefix, prefix_mask, remaining, total, exact = _radix_init(TOPK)
    for rnd in tl.static_range(4):
        hist = _round_hist(row, stride_ct, lo, hi, first, tl.where(exact, first, hi), prefix, prefix_mask,
                           rnd, BLOCK)
        prefix, prefix_mask, remaining, total, exact = _radix_step(hist, prefix, prefix_mask, remaining, total,
                                                                   exact, rnd)
    tau, ties, exact = _select_rule(prefix, remaining, total, exact, TOPK)

    out = Out + b * stride_ob + local * stride_os
    taken, _ = _compact(row, stride_ct, out, stride_ok, lo, hi, first, hi, tau, ties, exact,
                        tl.zeros([], dtype=tl.int32), tl.zeros([], dtype=tl.int32), BLOCK)
    _pad(out, stride_ok, taken, TOPK, BLOCK)


# ----------------------------------------------------------------------------------------------
# Row split: one program per (chunk, row, batch).
# ----------------------------------------------------------------------------------------------
@triton.jit
def _chunk_tiles(Lo, Hi, qi, chunk, CHUNKS, BLOCK: tl.constexpr):
    """(lo, hi, start, stop): the row's visible range and its chunk ``chunk`` of ``CHUNKS``, the tiles
    ``[start, stop)`` (tile-aligned from ``lo``'s tile; contiguous, ascending, as even as whole tiles
    allow; empty when the row has fewer tiles than chunks)."""
    lo = tl.load(Lo + qi)
    hi = tl.load(Hi + qi)
    first = (lo // BLOCK) * BLOCK
    tiles = (tl.maximum(hi - first, 0) + BLOCK - 1) // BLOCK
    start = first + (chunk * tiles // CHUNKS) * BLOCK
    stop = tl.minimum(first + ((chunk + 1) * tiles // CHUNKS) * BLOCK, hi)
    return lo, hi, start, stop


@triton.jit
def _load_state(State, stride_sk, stride_sf, row_id, SLOT: tl.constexpr, TOPK):
    """The row's select state after rounds ``< SLOT`` (``State[SLOT, field, row_id]``; the initial state for
    ``SLOT`` 0, which is not stored)."""
    if SLOT == 0:
        prefix, prefix_mask, remaining, total, exact = _radix_init(TOPK)
    else:
        base = State + SLOT * stride_sk + row_id
        prefix = tl.load(base)
        prefix_mask = tl.load(base + stride_sf)
        remaining = tl.load(base + 2 * stride_sf)
        total = tl.load(base + 3 * stride_sf)
        exact = tl.load(base + 4 * stride_sf) != 0
    return prefix, prefix_mask, remaining, total, exact


@triton.jit
def split_hist_kernel(
    Codes, Lo, Hi, Hist, State,
    stride_cb, stride_cs, stride_ct, stride_hr, stride_sk, stride_sf,
    row0, TOPK, CHUNKS,
    RND: tl.constexpr, BLOCK: tl.constexpr,
):
    """Round ``RND`` of the row-split select. Each program takes the row's state after round ``RND - 2``
    (``State[RND - 1]``) one ``_radix_step`` further with round ``RND - 1``'s complete histogram, chunk 0
    stores it (``State[RND]``), and adds this chunk's round ``RND`` histogram into ``Hist[RND, b, local]``.
    Hist int32 [4, B, rows, 256] zeroed, State int32 [5, 5, B, rows], both contiguous. Grid (CHUNKS, rows, B)."""
    chunk = tl.program_id(0).to(tl.int64)
    local = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    lo, hi, start, stop = _chunk_tiles(Lo, Hi, row0 + local, chunk, CHUNKS, BLOCK)
    row_id = b * tl.num_programs(1) + local
    hists = Hist + row_id * 256
    if RND == 0:
        prefix, prefix_mask, remaining, total, exact = _radix_init(TOPK)
    else:
        prefix, prefix_mask, remaining, total, exact = _load_state(State, stride_sk, stride_sf, row_id, RND - 1,
                                                                   TOPK)
        hist = tl.load(hists + (RND - 1) * stride_hr + tl.arange(0, 256))
        prefix, prefix_mask, remaining, total, exact = _radix_step(hist, prefix, prefix_mask, remaining, total,
                                                                   exact, RND - 1)
        first = chunk == 0
        state = State + RND * stride_sk + row_id
        tl.store(state, prefix, mask=first)
        tl.store(state + stride_sf, prefix_mask, mask=first)
        tl.store(state + 2 * stride_sf, remaining, mask=first)
        tl.store(state + 3 * stride_sf, total, mask=first)
        tl.store(state + 4 * stride_sf, exact.to(tl.int32), mask=first)
    row = Codes + b * stride_cb + local * stride_cs
    hist = _round_hist(row, stride_ct, lo, hi, start, tl.where(exact, start, stop), prefix, prefix_mask,
                       RND, BLOCK)
    tl.atomic_add(hists + RND * stride_hr + tl.arange(0, 256), hist, mask=hist != 0, sem="relaxed")


@triton.jit
def split_count_kernel(
    Codes, Lo, Hi, Hist, State, Counts,
    stride_cb, stride_cs, stride_ct, stride_hr, stride_sk, stride_sf, stride_nk,
    row0, TOPK, CHUNKS,
    BLOCK: tl.constexpr,
):
    """After the four rounds: each program finishes the select (round 3's histogram), chunk 0 stores the rule
    (tau, ties, exact) in ``State[4, :3]``, and Counts[0, b, local, chunk] = this chunk's codes selected for
    sure (> tau, or >= tau when ``exact``), Counts[1, ...] = its visible codes equal to tau (int32
    [2, B, rows, CHUNKS], contiguous; ``stride_nk`` between the two). Grid (CHUNKS, rows, B)."""
    chunk = tl.program_id(0).to(tl.int64)
    local = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    lo, hi, start, stop = _chunk_tiles(Lo, Hi, row0 + local, chunk, CHUNKS, BLOCK)
    row_id = b * tl.num_programs(1) + local
    prefix, prefix_mask, remaining, total, exact = _load_state(State, stride_sk, stride_sf, row_id, 3, TOPK)
    hist = tl.load(Hist + row_id * 256 + 3 * stride_hr + tl.arange(0, 256))
    prefix, prefix_mask, remaining, total, exact = _radix_step(hist, prefix, prefix_mask, remaining, total,
                                                               exact, 3)
    tau, ties, exact = _select_rule(prefix, remaining, total, exact, TOPK)
    first = chunk == 0
    state = State + 4 * stride_sk + row_id
    tl.store(state, tau, mask=first)
    tl.store(state + stride_sf, ties, mask=first)
    tl.store(state + 2 * stride_sf, exact.to(tl.int32), mask=first)

    hidden = -2147483647 - 1
    row = Codes + b * stride_cb + local * stride_cs
    above = tl.zeros([], dtype=tl.int32)
    equal = tl.zeros([], dtype=tl.int32)
    for tile in range(start, stop, BLOCK):
        offs = tile + tl.arange(0, BLOCK)
        code = tl.load(row + offs * stride_ct, mask=(offs >= lo) & (offs < hi), other=hidden)
        eq = (code == tau) & (code != hidden)
        above += tl.sum(((code > tau) | (exact & eq)).to(tl.int32), 0)
        equal += tl.sum(eq.to(tl.int32), 0)
    counts = Counts + row_id * CHUNKS + chunk
    tl.store(counts, above)
    tl.store(counts + stride_nk, equal)


@triton.jit
def split_write_kernel(
    Codes, Lo, Hi, State, Counts, Out,
    stride_cb, stride_cs, stride_ct, stride_sk, stride_sf, stride_nk,
    stride_ob, stride_os, stride_ok,
    row0, TOPK, CHUNKS,
    BLOCK: tl.constexpr, CHUNKS_P2: tl.constexpr,
):
    """Compact this chunk's selected keys into Out[b, local] at the offset the chunks before it fill; chunk 0
    writes the -1 padding. Grid (CHUNKS, rows, B)."""
    chunk = tl.program_id(0).to(tl.int64)
    local = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    lo, hi, start, stop = _chunk_tiles(Lo, Hi, row0 + local, chunk, CHUNKS, BLOCK)
    row_id = b * tl.num_programs(1) + local
    state = State + 4 * stride_sk + row_id
    tau = tl.load(state)
    ties = tl.load(state + stride_sf)
    exact = tl.load(state + 2 * stride_sf) != 0

    # The row's per-chunk counts: a chunk takes its codes above tau and those of its codes equal to tau whose
    # tie rank (over the whole row, in index order) is below ``ties``.
    ids = tl.arange(0, CHUNKS_P2)
    counts = Counts + row_id * CHUNKS + ids
    above = tl.load(counts, mask=ids < CHUNKS, other=0)
    equal = tl.load(counts + stride_nk, mask=ids < CHUNKS, other=0)
    tie_base = tl.cumsum(equal, 0) - equal
    taken = above + tl.minimum(tl.maximum(ties - tie_base, 0), equal)
    before = ids < chunk
    offset = tl.sum(tl.where(before, taken, 0), 0)
    tied = tl.sum(tl.where(before, equal, 0), 0)

    out = Out + b * stride_ob + local * stride_os
    row = Codes + b * stride_cb + local * stride_cs
    _compact(row, stride_ct, out, stride_ok, lo, hi, start, stop, tau, ties, exact, offset, tied, BLOCK)
    if chunk == 0:
        _pad(out, stride_ok, tl.sum(taken, 0), TOPK, BLOCK)


# ----------------------------------------------------------------------------------------------
# Launcher.
# ----------------------------------------------------------------------------------------------
def row_split_chunks(grid_rows: int, width: int, sm_count: int, tile: int = SPLIT_TILE) -> int:
    """How many chunks to cut each row into: 1 = one program per row.

    Split only while the grid of rows (``B * rows``) is under ``SPLIT_BELOW_PROGRAMS_PER_SM`` programs per SM
    and a row spans at least ``SPLIT_MIN_ROW_TILES`` tiles of ``tile`` codes; then aim for about
    ``SPLIT_PROGRAMS_PER_SM`` programs per SM, each chunk at least ``SPLIT_MIN_CHUNK_TILES`` tiles. On 132
    SMs: 64 rows x 32k keys -> 6 chunks, 1 x 32k -> 16, 4096 x 4096 -> 1, 1 x 100 -> 1."""
    tiles = cdiv(width, tile)
    if grid_rows >= SPLIT_BELOW_PROGRAMS_PER_SM * sm_count or tiles < SPLIT_MIN_ROW_TILES:
        return 1
    chunks = min(SPLIT_PROGRAMS_PER_SM * sm_count // max(1, grid_rows), tiles // SPLIT_MIN_CHUNK_TILES)
    return chunks if chunks >= 2 else 1


SPLIT_EAGER_MIN_CODES = 1 << 20  # outside a CUDA-graph capture, the row split runs from this many codes up


def _eager_and_small(codes: torch.Tensor, n_codes: int) -> bool:
    """True when the row split's seven launches would cost more host time than its GPU time saves: a CUDA call
    that is not being captured into a graph, over fewer than ``SPLIT_EAGER_MIN_CODES`` codes. H200, eager
    indexer call (do_bench): one row of 8k keys 0.17 ms with one program per row, 0.76 ms split (host-bound);
    64 rows of 32k 0.39 ms against 0.33 ms split; in a CUDA graph the split wins at every decode shape (one row
    of 32k: 76 -> 28 us; 64 rows of 32k: 99 -> 72 us)."""
    if codes.device.type != "cuda" or interpreted():
        return False
    return n_codes < SPLIT_EAGER_MIN_CODES and not torch.cuda.is_current_stream_capturing()


def topk_from_codes(codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, row0: int, topk: int,
                    out: torch.Tensor, *, chunks: int | None = None) -> None:
    """Write into ``out`` (int32 [B, rows, topk], any strides) the top-k of ``codes`` (int32 [B, rows, width]
    from ``score_codes``) in ascending key order; row ``r`` sees columns ``lo[row0 + r] <= s < hi[row0 + r]``
    (int64 [S]; ``hi`` at most ``width``).

    ``chunks``: None picks the path (``row_split_chunks``, and one program per row for an eager call over few
    codes: ``_eager_and_small``); 1 forces one program per row, more forces the row split into that many chunks
    per row."""
    b, rows, width = codes.shape
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise arg_error("chunks", chunks, "None or an int >= 1")
    if b * rows == 0:
        return
    split_tile = INTERPRETER_SPLIT_TILE if interpreted() else SPLIT_TILE
    if chunks is None:
        sms = INTERPRETER_SMS if interpreted() or codes.device.type != "cuda" else sm_count(cuda_index(codes.device))
        chunks = row_split_chunks(b * rows, width, sms, split_tile)
        if chunks > 1 and _eager_and_small(codes, b * rows * width):
            chunks = 1
    if chunks > 1:
        _row_split(codes, lo, hi, row0, topk, out, chunks, split_tile)
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


def _row_split(codes, lo, hi, row0: int, topk: int, out, chunks: int, tile: int) -> None:
    """The row-split path (module docstring): a memset and six launches of grid (chunks, rows, B). ``state``
    slot ``r`` (1 to 3) holds the select state after rounds ``< r``, slot 4 the rule (tau, ties, exact); slot 0
    is unused (the initial state is not stored)."""
    b, rows, _ = codes.shape
    device = codes.device
    hist = torch.zeros((4, b, rows, 256), dtype=torch.int32, device=device)
    state = torch.empty((5, 5, b, rows), dtype=torch.int32, device=device)
    counts = torch.empty((2, b, rows, chunks), dtype=torch.int32, device=device)
    grid = (chunks, rows, b)
    warps = 1 if interpreted() else 4
    strides = (*codes.stride(), hist.stride(0), state.stride(0), state.stride(1))
    for rnd in range(4):
        split_hist_kernel[grid](
            codes, lo, hi, hist, state, *strides, row0, topk, chunks, RND=rnd, BLOCK=tile, num_warps=warps,
        )
    split_count_kernel[grid](
        codes, lo, hi, hist, state, counts, *strides, counts.stride(0), row0, topk, chunks,
        BLOCK=tile, num_warps=warps,
    )
    split_write_kernel[grid](
        codes, lo, hi, state, counts, out, *codes.stride(), state.stride(0), state.stride(1), counts.stride(0),
        *out.stride(), row0, topk, chunks, BLOCK=tile, CHUNKS_P2=next_power_of_2(chunks), num_warps=warps,
    )
