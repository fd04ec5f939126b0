"""Triton top-k selection for the DSA indexer: an exact radix select over int32 score codes, written in
ascending key order.

Kernel and launcher only (no torch.compile, no dispatch). The indexer's score kernels write one int32
*code* per (query, key): the float32 score's bits made order-preserving as a signed integer (``bits`` for
non-negative floats, ``bits ^ 0x7FFFFFFF`` for negative ones, -0.0 folded onto +0.0), and ``CODE_HIDDEN``
(``INT32_MIN``) for a key the query may not see. Larger code = higher score.

The select, for one query row:

1. Radix select: rounds over the row's visible range ``[lo, hi)``, one ``BITS``-wide digit of the code each,
   most significant first (``32 / BITS`` rounds: four of 8 bits, or eight of 4). A round builds the
   histogram of that digit among the keys that still match the prefix chosen so far and keeps the bin holding
   the ``remaining``-th best key (``radix_step``). After the last round the prefix is the exact code ``tau``
   of the top-k's smallest member, and ``remaining`` says how many keys of code ``tau`` belong to the top-k.
   A round whose chosen bin belongs to the top-k whole ends the select early (``exact``): every key at or
   above that bin is in (with distinct scores this is the usual case after about half the rounds).
2. Compaction: one more pass writes, in index order, every key with code > ``tau`` and the first
   ``remaining`` keys with code == ``tau`` (the tie rule: equal scores, lower key index first), then -1 up
   to ``topk``.

So a row costs a read of its ``hi - lo`` codes (4 bytes each) per round and one for the compaction (the
register-resident kernel: one read), and one write of its ``topk`` indices: no ``[rows, T]`` int64 buffer and
no sort. The result equals ``reference.topk_from_keys`` (``torch.topk`` over ``reference.order_keys``, listed
in ascending key order) bit for bit, whatever the digit width.

The digit width trades rounds against the cost of a histogram, which Triton builds from about ``BITS`` warp
ballots plus ``2**BITS / 32`` popcounts per code: a 16-bin round costs a few times less per resolved bit than a
256-bin one. Where a round is only another loop iteration (the two one-launch kernels) 4-bit digits win; the
row split pays a launch per round and keeps 8-bit digits (``TILED_BITS``, ``SPLIT_BITS``, ``RESIDENT_BITS``;
the measurements behind them: docs/dsa.md, section 4, "Tuning measurements").

On a GPU, a few rows of at most 32k codes (decode: ``B * rows`` under ``SPLIT_BELOW_PROGRAMS_PER_SM`` per SM) run
the same select in CUDA instead (``indexer/cuda_topk.py``: one CTA per row, one launch instead of the row split's
seven); ``KDA_COMPILE_TOPK_KERNEL=triton`` keeps them here. Three Triton kernels run this select
(``topk_from_codes`` picks one with ``choose_path``):

- **Register-resident row** (``resident_topk_kernel``, one launch, one program per row): the program loads its
  row once into registers (up to ``MAX_RESIDENT_WIDTH`` codes, 4 to 32 warps), runs the rounds from there and
  compacts with two scans of the row. Taken automatically for batched decode: rows of at most
  ``AUTO_RESIDENT_WIDTH`` codes, more than a few but too few to fill the GPU with the tiled kernel; outside a
  CUDA-graph capture also for many codes in rows of up to ``EAGER_RESIDENT_WIDTH`` (one launch instead of the
  row split's seven).
- **One program per row over tiles** (``radix_topk_kernel``, one launch): the program streams its row once per
  round and once to compact, keeping the histograms in registers. Used whenever the grid of rows
  (``B * rows``) fills the GPU (prefill) or rows are short.
- **Row split** (few long rows: decode, where ``B * rows`` is 1 to 64 and a row holds 8k to 128k keys, so
  one program per row would leave most SMs idle): one program per (chunk, row, batch), a row's tiles from
  ``lo``'s tile to ``hi`` cut into ``chunks`` contiguous runs of whole tiles (runs are empty when a row has
  fewer tiles than chunks). A memset and ``R + 2`` launches (``R = 32 / SPLIT_BITS`` rounds) of grid (chunks,
  rows, B), with no host synchronisation and no data-dependent launch size (a CUDA graph can capture it):

  1. zero an int32 ``[R, B, rows, 2**SPLIT_BITS]`` histogram buffer (one per round);
  2. ``R`` launches of ``split_hist_kernel``, one per round ``r``: each program takes the row's select state
     (prefix, prefix mask, remaining, total, exact) one ``radix_step`` further with round ``r - 1``'s
     histogram, now complete (chunk 0 stores the new state in an int32 ``[R, 5, B, rows]`` buffer for the
     next launch), histograms its chunk's matching codes and adds them into round ``r``'s histogram with one
     atomic add per bin. Programs of a row whose select ended early skip their codes;
  3. ``split_count_kernel``: each program finishes the select with the last round's histogram (chunk 0 stores
     ``tau``, ties and ``exact``) and counts its chunk's codes selected for sure and its codes equal to
     ``tau`` into an int32 ``[2, B, rows, chunks]`` buffer;
  4. ``split_write_kernel``: each program sums its row's counts over the chunks before it (its output offset,
     and the tie rank of its first code equal to ``tau``: the tie rule holds across chunks) and compacts its
     chunk there; chunk 0 writes the -1 padding.

  The histograms summed over chunks are those the one-program kernel builds, and both paths step through
  them with the same steps (``indexer/triton_radix_select.py``), so they write the same indices. A
  row's codes are read once per round and once more to count and to compact, plus a few histogram loads and
  atomic adds per program.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from kda_compile.ops import envs
from kda_compile.ops._common import (arg_error, cdiv, cuda_index, next_power_of_2, record_fallback,
                                     sm_count)
from kda_compile.ops._common import triton_interpreted as interpreted
from kda_compile.ops._nvrtc import NvrtcUnavailable
from kda_compile.ops.dsa.indexer import cuda_topk
from kda_compile.ops.dsa.indexer.triton_radix_select import (compact, compact_codes, digit_histogram, pad_to_topk,
                                                             radix_init, radix_step, round_hist, select_rule)

CODE_HIDDEN = -(2**31)  # the code of a key the query may not see: below every visible code
MAX_TILE = 4096  # codes per loaded tile of the tiled kernel's wide rows (16 per thread at 8 warps)
SMALL_TILE = 512  # ... and of rows up to SMALL_TILE_WIDTH codes
SMALL_TILE_WIDTH = 16384

# Row split (few long rows). Chosen from the costs of the one-program kernel per tile and round, and measured
# with these values (docs/dsa.md, section 4, "Tuning measurements", "top-k row split").
SPLIT_TILE = 1024  # codes per loaded tile of the row-split kernels (8 per thread at 4 warps)
SPLIT_BELOW_PROGRAMS_PER_SM = 2  # split while B * rows < this many programs per SM
SPLIT_PROGRAMS_PER_SM = 6  # aim for about this many (chunk, row) programs per SM
SPLIT_MIN_ROW_TILES = 4  # rows narrower than this many tiles stay one program per row
SPLIT_MIN_CHUNK_TILES = 2  # each chunk streams at least this many tiles
INTERPRETER_SMS = 4  # the SM count assumed under the Triton interpreter (so CPU tests take both paths)
INTERPRETER_SPLIT_TILE = 16

# Digit widths and the register-resident rows. A round's histogram costs about log2(bins) warp ballots plus
# bins / 32 popcounts per code, so 4-bit digits are cheaper per resolved bit than 8-bit ones where a round costs
# no launch (the tiled and resident kernels); the row split pays a launch per round and keeps 8-bit digits. The
# register-resident kernel wins for a few dozen rows of at most 8k keys and loses for wider rows and for prefill
# (docs/dsa.md, section 4, "Tuning measurements", "top-k digit widths").
MAX_RESIDENT_WIDTH = 65536  # widest row (codes, rounded up to a power of two) the resident kernel can hold
AUTO_RESIDENT_WIDTH = 8192  # widest row it takes when the path is chosen automatically
AUTO_RESIDENT_ROWS_PER_SM = 0.25  # ... for B * rows from this many per SM up to SPLIT_BELOW_PROGRAMS_PER_SM
RESIDENT_BITS = 4  # digit width of its radix rounds (32 / RESIDENT_BITS rounds at most)
TILED_BITS = 4  # digit width of the one-program-per-row tiled kernel
SPLIT_BITS = 8  # digit width of the row split (a launch per round)


@triton.jit
def score_codes(score, visible):
    """int32 codes of float32 ``score`` (see the module docstring); ``CODE_HIDDEN`` where not ``visible``."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)  # + 0.0 folds -0.0 onto +0.0
    code = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    hidden = -2147483647 - 1
    code = tl.maximum(code, hidden + 1)  # only the all-ones NaN pattern maps onto the hidden code
    return tl.where(visible, code, hidden)


# ----------------------------------------------------------------------------------------------
# One program per row.
# ----------------------------------------------------------------------------------------------
@triton.jit
def radix_topk_kernel(
    Codes, Lo, Hi, Out,
    stride_cb, stride_cs, stride_ct,
    stride_ob, stride_os, stride_ok,
    row0, TOPK,
    BITS: tl.constexpr, BLOCK: tl.constexpr,
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

    prefix, prefix_mask, remaining, total, exact = radix_init(TOPK)
    for rnd in tl.static_range(32 // BITS):
        hist = round_hist(row, stride_ct, lo, hi, first, tl.where(exact, first, hi), prefix, prefix_mask,
                           rnd, BITS, BLOCK)
        prefix, prefix_mask, remaining, total, exact = radix_step(hist, prefix, prefix_mask, remaining, total,
                                                                   exact, rnd, BITS)
    tau, ties, exact = select_rule(prefix, remaining, total, exact, TOPK)

    out = Out + b * stride_ob + local * stride_os
    taken, _ = compact(row, stride_ct, out, stride_ok, lo, hi, first, hi, tau, ties, exact,
                        tl.zeros([], dtype=tl.int32), tl.zeros([], dtype=tl.int32), BLOCK)
    pad_to_topk(out, stride_ok, taken, TOPK, BLOCK)


# ----------------------------------------------------------------------------------------------
# One program per row, the row held in registers.
# ----------------------------------------------------------------------------------------------
@triton.jit
def resident_topk_kernel(
    Codes, Lo, Hi, Out,
    stride_cb, stride_cs, stride_ct,
    stride_ob, stride_os, stride_ok,
    row0, TOPK,
    WIDTH: tl.constexpr, BITS: tl.constexpr,
):
    """As ``radix_topk_kernel`` for rows of at most ``WIDTH`` codes (a power of two): the program loads its
    row once into registers (``u``: the code with its sign bit flipped, 0 for a hidden key), runs the radix
    rounds over ``BITS``-bit digits from there (a round is skipped once the select is exact) and compacts with
    two scans over the row. Grid (rows, B)."""
    local = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    qi = row0 + local
    lo = tl.load(Lo + qi)
    hi = tl.load(Hi + qi)
    hidden = -2147483647 - 1
    offs = tl.arange(0, WIDTH)
    row = Codes + b * stride_cb + local * stride_cs
    u = tl.load(row + offs * stride_ct, mask=(offs >= lo) & (offs < hi), other=hidden) ^ hidden

    prefix, prefix_mask, remaining, total, exact = radix_init(TOPK)
    for rnd in tl.static_range(32 // BITS):
        if exact == 0:
            hist = digit_histogram(u, prefix, prefix_mask, rnd, BITS)
            prefix, prefix_mask, remaining, total, exact = radix_step(hist, prefix, prefix_mask, remaining, total,
                                                                       exact, rnd, BITS)
    tau, ties, exact = select_rule(prefix, remaining, total, exact, TOPK)

    out = Out + b * stride_ob + local * stride_os
    zero = tl.zeros([], dtype=tl.int32)
    taken, _ = compact_codes(u ^ hidden, offs, out, stride_ok, tau, ties, exact, zero, zero)
    pad_to_topk(out, stride_ok, taken, TOPK, 1024)


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
        prefix, prefix_mask, remaining, total, exact = radix_init(TOPK)
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
    RND: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Round ``RND`` of the row-split select. Each program takes the row's state after round ``RND - 2``
    (``State[RND - 1]``) one ``radix_step`` further with round ``RND - 1``'s complete histogram, chunk 0
    stores it (``State[RND]``), and adds this chunk's round ``RND`` histogram into ``Hist[RND, b, local]``.
    Hist int32 [R, B, rows, 2**BITS] zeroed, State int32 [R + 1, 5, B, rows] (R = 32 / BITS rounds), both
    contiguous. Grid (CHUNKS, rows, B)."""
    chunk = tl.program_id(0).to(tl.int64)
    local = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    lo, hi, start, stop = _chunk_tiles(Lo, Hi, row0 + local, chunk, CHUNKS, BLOCK)
    row_id = b * tl.num_programs(1) + local
    hists = Hist + row_id * (1 << BITS)
    if RND == 0:
        prefix, prefix_mask, remaining, total, exact = radix_init(TOPK)
    else:
        prefix, prefix_mask, remaining, total, exact = _load_state(State, stride_sk, stride_sf, row_id, RND - 1,
                                                                   TOPK)
        hist = tl.load(hists + (RND - 1) * stride_hr + tl.arange(0, 1 << BITS))
        prefix, prefix_mask, remaining, total, exact = radix_step(hist, prefix, prefix_mask, remaining, total,
                                                                   exact, RND - 1, BITS)
        first = chunk == 0
        state = State + RND * stride_sk + row_id
        tl.store(state, prefix, mask=first)
        tl.store(state + stride_sf, prefix_mask, mask=first)
        tl.store(state + 2 * stride_sf, remaining, mask=first)
        tl.store(state + 3 * stride_sf, total, mask=first)
        tl.store(state + 4 * stride_sf, exact.to(tl.int32), mask=first)
    row = Codes + b * stride_cb + local * stride_cs
    hist = round_hist(row, stride_ct, lo, hi, start, tl.where(exact, start, stop), prefix, prefix_mask,
                       RND, BITS, BLOCK)
    tl.atomic_add(hists + RND * stride_hr + tl.arange(0, 1 << BITS), hist, mask=hist != 0, sem="relaxed")


@triton.jit
def split_count_kernel(
    Codes, Lo, Hi, Hist, State, Counts,
    stride_cb, stride_cs, stride_ct, stride_hr, stride_sk, stride_sf, stride_nk,
    row0, TOPK, CHUNKS,
    BITS: tl.constexpr, BLOCK: tl.constexpr,
):
    """After the rounds: each program finishes the select (the last round's histogram), chunk 0 stores the rule
    (tau, ties, exact) in ``State[0, :3]`` (slot 0 holds no state: the initial one is not stored), and
    Counts[0, b, local, chunk] = this chunk's codes selected for sure (> tau, or >= tau when ``exact``),
    Counts[1, ...] = its visible codes equal to tau (int32 [2, B, rows, CHUNKS], contiguous; ``stride_nk``
    between the two). Grid (CHUNKS, rows, B)."""
    chunk = tl.program_id(0).to(tl.int64)
    local = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    lo, hi, start, stop = _chunk_tiles(Lo, Hi, row0 + local, chunk, CHUNKS, BLOCK)
    row_id = b * tl.num_programs(1) + local
    last: tl.constexpr = 32 // BITS - 1
    prefix, prefix_mask, remaining, total, exact = _load_state(State, stride_sk, stride_sf, row_id, last, TOPK)
    hist = tl.load(Hist + row_id * (1 << BITS) + last * stride_hr + tl.arange(0, 1 << BITS))
    prefix, prefix_mask, remaining, total, exact = radix_step(hist, prefix, prefix_mask, remaining, total,
                                                               exact, last, BITS)
    tau, ties, exact = select_rule(prefix, remaining, total, exact, TOPK)
    first = chunk == 0
    state = State + row_id
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
    stride_cb, stride_cs, stride_ct, stride_sf, stride_nk,
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
    state = State + row_id
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
    compact(row, stride_ct, out, stride_ok, lo, hi, start, stop, tau, ties, exact, offset, tied, BLOCK)
    if chunk == 0:
        pad_to_topk(out, stride_ok, tl.sum(taken, 0), TOPK, BLOCK)


# ----------------------------------------------------------------------------------------------
# Launcher.
# ----------------------------------------------------------------------------------------------
def row_split_chunks(grid_rows: int, width: int, sm_count: int, tile: int = SPLIT_TILE) -> int:
    """How many chunks to cut each row into: 1 = one program per row.

    Split only while the grid of rows (``B * rows``) is under ``SPLIT_BELOW_PROGRAMS_PER_SM`` programs per SM
    and a row spans at least ``SPLIT_MIN_ROW_TILES`` tiles of ``tile`` codes; then aim for about
    ``SPLIT_PROGRAMS_PER_SM`` programs per SM, each chunk at least ``SPLIT_MIN_CHUNK_TILES`` tiles. On 132
    SMs: 64 rows x 32k keys -> 12 chunks, 1 x 32k -> 16, 4096 x 4096 -> 1, 1 x 100 -> 1."""
    tiles = cdiv(width, tile)
    if grid_rows >= SPLIT_BELOW_PROGRAMS_PER_SM * sm_count or tiles < SPLIT_MIN_ROW_TILES:
        return 1
    chunks = min(SPLIT_PROGRAMS_PER_SM * sm_count // max(1, grid_rows), tiles // SPLIT_MIN_CHUNK_TILES)
    return chunks if chunks >= 2 else 1


SPLIT_EAGER_MIN_CODES = 1 << 20  # outside a CUDA-graph capture, the row split runs from this many codes up
EAGER_RESIDENT_WIDTH = 32768  # ... and rows up to this many codes take the resident kernel instead


def _uncaptured(codes: torch.Tensor) -> bool:
    """True for a CUDA call that is not being captured into a CUDA graph: each launch then costs host time (eager
    calls, and compiled graphs run without CUDA graphs)."""
    if codes.device.type != "cuda" or interpreted():
        return False
    return not torch.cuda.is_current_stream_capturing()


def choose_path(width: int, grid_rows: int, sms: int, uncaptured: bool) -> tuple[str, int]:
    """("resident" | "tiles" | "split", chunks) for an automatic choice (neither ``chunks`` nor ``resident`` given).

    Batched decode over short rows takes the resident kernel (``_auto_resident``); a grid of rows that fills the
    GPU, or short rows, the tiled kernel; few long rows the row split. Outside a CUDA-graph capture the split's
    seven launches cost host time: under ``SPLIT_EAGER_MIN_CODES`` codes in all the tiled kernel runs instead (one
    launch), and rows of at most ``EAGER_RESIDENT_WIDTH`` codes take the resident kernel (one launch, more GPU time
    than the split but six launches fewer). In a CUDA graph the split wins at every decode shape (docs/dsa.md, section
    4, "Tuning measurements", "top-k paths")."""
    width_p2 = max(16, next_power_of_2(width))
    if _auto_resident(width_p2, grid_rows, sms):
        return "resident", 1
    chunks = row_split_chunks(grid_rows, width, sms, INTERPRETER_SPLIT_TILE if interpreted() else SPLIT_TILE)
    if chunks > 1 and uncaptured:
        if grid_rows * width < SPLIT_EAGER_MIN_CODES:
            return "tiles", 1
        if width_p2 <= EAGER_RESIDENT_WIDTH:
            return "resident", 1
    return ("split", chunks) if chunks > 1 else ("tiles", 1)


KERNEL_ENV = envs.TOPK_KERNEL  # auto | triton | cuda: the few-row select on ``cuda_topk``'s kernel or not


def cuda_kernel_serves(device_type: str, width: int, grid_rows: int, sms: int) -> str | None:
    """Why the CUDA kernel (``indexer/cuda_topk.py``, one CTA per row) does not take a select, or None when it does:
    rows of at most ``cuda_topk.MAX_WIDTH`` codes on a GPU, too few to fill it with the tiled kernel (decode: ``B *
    rows`` under ``SPLIT_BELOW_PROGRAMS_PER_SM`` per SM; 64 rows of 32k: docs/dsa.md section 4)."""
    if device_type != "cuda" or interpreted():
        return "not a CUDA tensor"
    if width > cuda_topk.MAX_WIDTH:
        return f"rows of {width} codes (the kernel holds at most {cuda_topk.MAX_WIDTH})"
    if grid_rows >= SPLIT_BELOW_PROGRAMS_PER_SM * sms:
        return f"{grid_rows} rows fill the GPU (the tiled kernel)"
    return None


def cuda_select_takes(device: torch.device, width: int, grid_rows: int) -> bool:
    """Whether ``topk_from_codes`` would hand rows of ``width`` codes (``grid_rows`` of them) to the CUDA kernel
    (the switch allows it and ``cuda_kernel_serves`` says yes)."""
    if envs.topk_kernel() == "triton":
        return False
    sms = INTERPRETER_SMS if interpreted() or device.type != "cuda" else sm_count(cuda_index(device))
    return cuda_kernel_serves(device.type, width, grid_rows, sms) is None


def _cuda_topk(codes, lo, hi, row0: int, topk: int, out) -> bool:
    """The select on the CUDA kernel; False (recorded) when NVRTC cannot build it."""
    try:
        cuda_topk.launch(codes, lo, hi, row0, topk, out)
    except NvrtcUnavailable as exc:
        record_cuda_topk_unavailable(exc)
        return False
    return True


def record_cuda_topk_unavailable(exc: Exception) -> None:
    record_fallback("dsa_indexer_topk", "Triton top-k kernels", f"the CUDA top-k kernel could not be built: {exc}")


def tiled_config(width: int) -> tuple[int, int]:
    """(codes per tile, warps) of the one-program-per-row tiled kernel for rows of ``width`` codes: rows up to 16k
    codes take 512-code tiles, 4 warps up to 8k and 8 above; wider rows 4096-code tiles with 8 warps (the sweep:
    docs/dsa.md, section 4, "Tuning measurements", "top-k tiles")."""
    if width <= SMALL_TILE_WIDTH:
        return SMALL_TILE, 4 if width <= 8192 else 8
    return min(MAX_TILE, next_power_of_2(width // 8)), 8


def resident_warps(width_p2: int) -> int:
    """Warps of the register-resident kernel for rows of ``width_p2`` codes: 16 warps at 8k and 16k (16 and 32 codes
    per thread), 32 warps at 32k (32 per thread; docs/dsa.md, section 4, "Tuning measurements", "top-k tiles")."""
    if width_p2 > 16384:
        return 32
    return max(4, min(16, width_p2 // 512))


def _auto_resident(width_p2: int, grid_rows: int, sms: int) -> bool:
    """Whether an automatic choice takes the register-resident kernel (see ``AUTO_RESIDENT_WIDTH``): rows of at
    most that many codes, more than a few per GPU but fewer than the tiled kernel needs to fill it (batched
    decode)."""
    return (width_p2 <= AUTO_RESIDENT_WIDTH
            and AUTO_RESIDENT_ROWS_PER_SM * sms <= grid_rows < SPLIT_BELOW_PROGRAMS_PER_SM * sms)


def topk_from_codes(codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, row0: int, topk: int,
                    out: torch.Tensor, *, chunks: int | None = None, resident: bool | None = None) -> None:
    """Write into ``out`` (int32 [B, rows, topk], any strides) the top-k of ``codes`` (int32 [B, rows, width]
    from ``score_codes``) in ascending key order; row ``r`` sees columns ``lo[row0 + r] <= s < hi[row0 + r]``
    (int64 [S]; ``hi`` at most ``width``).

    With neither ``chunks`` nor ``resident`` given, a few rows of at most ``cuda_topk.MAX_WIDTH`` codes on a GPU
    (decode) take the CUDA kernel (``indexer/cuda_topk.py``; ``KDA_COMPILE_TOPK_KERNEL=triton`` keeps them on Triton)
    and otherwise ``choose_path`` picks the Triton kernel. ``resident``: True forces
    the register-resident kernel (``width`` at most ``MAX_RESIDENT_WIDTH``), False the tiled kernels (then
    ``row_split_chunks`` chooses, one program per row for an uncaptured call over few codes). ``chunks`` forces a
    tiled kernel: 1 one program per row, more the row split into that many chunks per row."""
    b, rows, width = codes.shape
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise arg_error("chunks", chunks, "None or an int >= 1")
    if resident is not None and not isinstance(resident, bool):
        raise arg_error("resident", resident, "None, True or False")
    width_p2 = max(16, next_power_of_2(width))
    if resident and width_p2 > MAX_RESIDENT_WIDTH:
        raise arg_error("resident", resident, f"None or False for rows wider than {MAX_RESIDENT_WIDTH} codes")
    if b * rows == 0:
        return
    sms = INTERPRETER_SMS if interpreted() or codes.device.type != "cuda" else sm_count(cuda_index(codes.device))
    split_tile = INTERPRETER_SPLIT_TILE if interpreted() else SPLIT_TILE
    if resident is None and chunks is None:
        switch = envs.topk_kernel()
        if switch != "triton" and topk >= 1:
            why = cuda_kernel_serves(codes.device.type, width, b * rows, sms)
            if why is None:
                if _cuda_topk(codes, lo, hi, row0, topk, out):
                    return
            elif switch == "cuda":
                record_fallback("dsa_indexer_topk", "Triton top-k kernels", f"{KERNEL_ENV}=cuda but {why}")
        path, chunks = choose_path(width, b * rows, sms, _uncaptured(codes))
        resident = path == "resident"
    elif chunks is None:  # resident=False: the tiled kernels, their own choice
        chunks = row_split_chunks(b * rows, width, sms, split_tile)
        if chunks > 1 and _uncaptured(codes) and b * rows * width < SPLIT_EAGER_MIN_CODES:
            chunks = 1
    if resident:
        resident_topk_kernel[(rows, b)](
            codes, lo, hi, out, *codes.stride(), *out.stride(), row0, topk, WIDTH=width_p2, BITS=RESIDENT_BITS,
            num_warps=1 if interpreted() else resident_warps(width_p2),
        )
        return
    if chunks > 1:
        _row_split(codes, lo, hi, row0, topk, out, chunks, split_tile)
        return
    tile, warps = tiled_config(width)
    if interpreted():
        tile, warps = min(max(16, next_power_of_2(width)), 64), 1
    radix_topk_kernel[(rows, b)](
        codes, lo, hi, out, *codes.stride(), *out.stride(), row0, topk, BITS=TILED_BITS,
        BLOCK=tile, num_warps=warps,
    )


def _row_split(codes, lo, hi, row0: int, topk: int, out, chunks: int, tile: int) -> None:
    """The row-split path (module docstring): a memset and ``32 / SPLIT_BITS + 2`` launches of grid (chunks,
    rows, B). ``state`` slot ``r`` (1 to rounds - 1) holds the select state after rounds ``< r``, slot 0 the
    rule (tau, ties, exact) once the rounds are done (the initial state is not stored)."""
    b, rows, _ = codes.shape
    device = codes.device
    bits = SPLIT_BITS
    rounds = 32 // bits
    hist = torch.zeros((rounds, b, rows, 1 << bits), dtype=torch.int32, device=device)
    state = torch.empty((rounds, 5, b, rows), dtype=torch.int32, device=device)
    counts = torch.empty((2, b, rows, chunks), dtype=torch.int32, device=device)
    grid = (chunks, rows, b)
    warps = 1 if interpreted() else 4
    strides = (*codes.stride(), hist.stride(0), state.stride(0), state.stride(1))
    for rnd in range(rounds):
        split_hist_kernel[grid](
            codes, lo, hi, hist, state, *strides, row0, topk, chunks, RND=rnd, BITS=bits, BLOCK=tile,
            num_warps=warps,
        )
    split_count_kernel[grid](
        codes, lo, hi, hist, state, counts, *strides, counts.stride(0), row0, topk, chunks,
        BITS=bits, BLOCK=tile, num_warps=warps,
    )
    split_write_kernel[grid](
        codes, lo, hi, state, counts, out, *codes.stride(), state.stride(1), counts.stride(0),
        *out.stride(), row0, topk, chunks, BLOCK=tile, CHUNKS_P2=next_power_of_2(chunks), num_warps=warps,
    )
