"""Triton forward kernel of the block-sparse attention: each query attends to the key blocks its group selected.

Kernel and launcher only (no torch.compile, no dispatch). One program per (batch row, query, KV group, block of
that group's query heads): the group's heads share the selection, so they are the M dimension of the tile and
every key tile loaded serves all of them (docs/block-sparse.md, section "Kernel"). The program walks the K
selected blocks in ascending block order, each in key tiles of ``BLOCK_N`` slots, with an online softmax in
float32 (base 2); the causal bound and the padding mask are applied per key slot, and a tile that starts past
the query's position is skipped (with blocks in ascending order that is every tile after the first such one).

The selection is first put in that order by the launcher (``selection_in_block_order``: one sort of the small
[B, G, Sq, K] index tensor), with empty slots, -1, as ``num_blocks`` at the end; the kernel skips a block equal
to the one before it, so a repeated index counts once, as in Hugging Face's mask. An index the launcher is handed
outside ``[-1, num_blocks)`` (unchecked values on CUDA) is read as an empty slot, never as a row past the keys.

A call with too few programs to fill the GPU (decode: one query per sequence, a handful of KV groups) also splits
each selection into ``splits`` runs of consecutive slots, one program each (the grid's third axis): every program
writes its run's normalised output and log-sum-exp in float32, and ``combine_splits_kernel`` merges them by their
log-sum-exp weights (docs/block-sparse.md, section "Kernel"). ``split_count`` chooses the count from the grid and
the device's SM count.

Accepted block sizes: multiples of 16 (the key tile is the largest of 64, 32 and 16 that divides the block);
``block_size_problem`` says why another one is refused (the op then runs the reference, logged).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kda_compile.ops._common import cdiv, cuda_index, next_power_of_2, sm_count, triton_interpreted

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
KEY_TILES = (64, 32, 16)  # the key tile: the largest of these dividing block_size
MAX_HEADS_PER_PROGRAM = 64
PROGRAMS_PER_SM = 2  # a grid below this many programs per SM splits the selections (``split_count``)
INTERPRETER_SMS = 4  # the SM count assumed under the Triton interpreter (so CPU tests take the split path)


def key_tile(block_size: int) -> int | None:
    """The kernel's key tile for ``block_size``, or None when no accepted tile divides it."""
    return next((tile for tile in KEY_TILES if block_size % tile == 0), None)


def block_size_problem(block_size: int) -> str | None:
    """Why the kernel cannot run ``block_size`` (not a multiple of 16), or None."""
    if key_tile(block_size) is None:
        return f"block_size {block_size} is not a multiple of {KEY_TILES[-1]} (the Triton kernel's smallest key tile)"
    return None


def selection_in_block_order(block_indices: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """int32 [B, G, Sq, K], contiguous: each selection sorted ascending, empty slots (and any entry outside
    ``[0, num_blocks)``) as ``num_blocks`` at the end, so that repeats sit side by side."""
    empty = (block_indices < 0) | (block_indices >= num_blocks)
    ordered = torch.where(empty, num_blocks, block_indices).to(torch.int32)
    return torch.sort(ordered, dim=-1).values.contiguous()


@triton.jit
def program_rows(Pos, stride_pb, stride_ps, SQ, T, HEADS_PER_GROUP, HEAD_BLOCKS, BLOCK_M: tl.constexpr,
                 HAS_POS: tl.constexpr):
    """(b, i, g, heads, h_ok, pos) of this program of the grid (B * Sq, G * HEAD_BLOCKS): its batch row, query and
    group, its block of the group's heads (and which of those rows are heads), and the query's position (Pos
    [B, Sq] with HAS_POS, else ``T - Sq + i``)."""
    token = tl.program_id(0)
    b = (token // SQ).to(tl.int64)
    i = (token % SQ).to(tl.int64)
    g = tl.program_id(1) // HEAD_BLOCKS
    in_group = (tl.program_id(1) % HEAD_BLOCKS) * BLOCK_M + tl.arange(0, BLOCK_M)
    h_ok = in_group < HEADS_PER_GROUP
    heads = (g * HEADS_PER_GROUP + in_group).to(tl.int64)
    if HAS_POS:
        pos = tl.load(Pos + b * stride_pb + i * stride_ps).to(tl.int64)
    else:
        pos = T - SQ + i
    return b, i, g, heads, h_ok, pos


@triton.jit
def selected_tile(i_base, stride_ik, tile, pos, T, NUM_BLOCKS, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(start, active) of key tile ``tile`` of a selection walk (``BLOCK_SIZE // BLOCK_N`` tiles per slot): its first
    key slot, and whether it has anything to attend: not an empty slot, not a repeat of the slot before (the
    selection is in block order), not past the keys, not wholly in the query's future."""
    slot = tile // (BLOCK_SIZE // BLOCK_N)
    block = tl.load(i_base + slot * stride_ik)
    before = tl.load(i_base + (slot - 1) * stride_ik, mask=slot > 0, other=-1)
    start = block.to(tl.int64) * BLOCK_SIZE + (tile % (BLOCK_SIZE // BLOCK_N)) * BLOCK_N
    return start, (block < NUM_BLOCKS) & (block != before) & (start < T) & (start <= pos)


@triton.jit
def _attend_tile(q, k_base, v_base, pad_base, start, pos, T, offs_n, offs_d, d_ok, offs_dv, dv_ok, m_i, l_i, acc,
                 qk_scale, stride_kt, stride_kd, stride_vt, stride_vd, stride_pt,
                 HAS_PAD: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile [start, start + BLOCK_N): scores, causal / padding mask per slot, online softmax, acc += p @ v."""
    slots = start + offs_n
    ok = (slots < T) & (slots <= pos)
    if HAS_PAD:
        ok &= tl.load(pad_base + slots * stride_pt, mask=slots < T, other=0) != 0
    rows = slots.to(tl.int64)
    k = tl.load(k_base + rows[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                mask=(slots < T)[:, None] & d_ok[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no inf - inf on rows with nothing yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    v = tl.load(v_base + rows[:, None] * stride_vt + offs_dv[None, :] * stride_vd,
                mask=(slots < T)[:, None] & dv_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def block_sparse_attention_fwd_kernel(
    Q, K, V, Idx, Pos, Pad, Out, Lse,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kg, stride_kt, stride_kd,
    stride_vb, stride_vg, stride_vt, stride_vd,
    stride_ib, stride_ig, stride_is, stride_ik,
    stride_pb, stride_ps, stride_mb, stride_mt,
    stride_ob, stride_oh, stride_os, stride_od, stride_osplit,
    stride_lb, stride_lh, stride_ls, stride_lsplit,
    SQ, T, SLOTS, HEADS_PER_GROUP, HEAD_BLOCKS, D, DV, NUM_BLOCKS, scale, SLOTS_PER_SPLIT,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_POS: tl.constexpr, HAS_PAD: tl.constexpr, PRECISION: tl.constexpr,
):
    """Out[b, heads, i] and Lse[b, heads, i] for one query, one block of one group's heads and one run of
    ``SLOTS_PER_SPLIT`` selection slots (the split ``program_id(2)``; one run of all slots when unsplit).

    Q [B, H, Sq, D], K [B, G, T, D], V [B, G, T, DV], Idx int32 [B, G, Sq, SLOTS] in block order
    (``selection_in_block_order``), Pos int [B, Sq] (HAS_POS; else position ``T - Sq + i``), Pad [B, T] uint8
    (HAS_PAD), all by strides; Out / Lse gain a split stride (0 when unsplit). Grid (B * Sq, G * HEAD_BLOCKS,
    splits)."""
    b, i, g, heads, h_ok, pos = program_rows(Pos, stride_pb, stride_ps, SQ, T, HEADS_PER_GROUP, HEAD_BLOCKS, BLOCK_M,
                                             HAS_POS)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + i * stride_qs + offs_d[None, :] * stride_qd,
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b * stride_kb + g * stride_kg
    v_base = V + b * stride_vb + g * stride_vg
    pad_base = Pad + b * stride_mb
    i_base = Idx + b * stride_ib + g * stride_ig + i * stride_is
    qk_scale = scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    split = tl.program_id(2)
    first_tile = split * SLOTS_PER_SPLIT * (BLOCK_SIZE // BLOCK_N)
    end_tile = tl.minimum(SLOTS, (split + 1) * SLOTS_PER_SPLIT) * (BLOCK_SIZE // BLOCK_N)
    for tile in range(first_tile, end_tile):
        start, active = selected_tile(i_base, stride_ik, tile, pos, T, NUM_BLOCKS, BLOCK_SIZE, BLOCK_N)
        if active:
            m_i, l_i, acc = _attend_tile(q, k_base, v_base, pad_base, start, pos, T, offs_n, offs_d, d_ok, offs_dv,
                                         dv_ok, m_i, l_i, acc, qk_scale, stride_kt, stride_kd, stride_vt, stride_vd,
                                         stride_mt, HAS_PAD, PRECISION)

    alive = l_i > 0
    safe_l = tl.where(alive, l_i, 1.0)
    o = acc / safe_l[:, None]
    tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + i * stride_os + split * stride_osplit
             + offs_dv[None, :] * stride_od, o.to(Out.dtype.element_ty), mask=h_ok[:, None] & dv_ok[None, :])
    lse = tl.where(alive, (m_i + tl.log2(safe_l)) * LN2, float("-inf"))
    tl.store(Lse + b * stride_lb + heads * stride_lh + i * stride_ls + split * stride_lsplit, lse, mask=h_ok)


@triton.jit
def combine_splits_kernel(Part, PartLse, Out, Lse, SPLITS, DV, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Out[r] and Lse[r] of one (batch row, head, query) r from its splits' float32 partials: Part [R, SPLITS, DV]
    (each normalised over its own keys) and PartLse [R, SPLITS] (natural log, -inf for a split without a key),
    weighted by ``exp(lse_s - lse)``. A row with no key in any split gives 0 and -inf. Contiguous tensors; grid
    (R,)."""
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < SPLITS
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    lse_s = tl.load(PartLse + row * SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse_s, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no inf - inf on a row without keys
    weight = tl.exp(lse_s - top)
    total = tl.sum(weight, 0)
    part = tl.load(Part + (row * SPLITS + offs_s)[:, None] * DV + offs_dv[None, :],
                   mask=s_ok[:, None] & dv_ok[None, :], other=0.0)
    alive = total > 0
    o = tl.sum(part * weight[:, None], 0) / tl.where(alive, total, 1.0)
    tl.store(Out + row * DV + offs_dv, o.to(Out.dtype.element_ty), mask=dv_ok)
    tl.store(Lse + row, tl.where(alive, top + tl.log(tl.where(alive, total, 1.0)), float("-inf")))


def precision(dtype: torch.dtype) -> str:
    """The dots' input precision: IEEE in float32 (the reference's rounding), the default for half types."""
    return "ieee" if dtype == torch.float32 else "tf32"


def padded_width(width: int) -> int:
    """A head width's tile: the next power of two, at least 16 (the dots' smallest)."""
    return max(16, next_power_of_2(width))


def head_block_rows(heads_per_group: int) -> tuple[int, int]:
    """(rows of a program's head block, head blocks per group): a group's heads padded to a power of two of 16
    to ``MAX_HEADS_PER_PROGRAM`` rows, more heads over several programs."""
    rows = min(MAX_HEADS_PER_PROGRAM, padded_width(heads_per_group))
    return rows, cdiv(heads_per_group, rows)


@dataclass(frozen=True)
class SelectionWalk:
    """What both kernels take first, in their order: the tensors (query, key, value, the selection in block order,
    the positions and the padding mask, or unread stand-ins), their strides, the sizes, the launch grid and the
    compile-time constants."""

    tensors: tuple
    strides: tuple
    sizes: tuple
    grid: tuple
    meta: dict


def selection_walk(query, key, value, block_indices, block_size: int, query_positions, key_padding_mask):
    """The :class:`SelectionWalk` of one call (query, key, value at the strides the kernel reads them)."""
    batch, heads, queries, dim = query.shape
    groups, keys, d_v = key.shape[1], key.shape[2], value.shape[-1]
    num_blocks = cdiv(keys, block_size)
    selection = selection_in_block_order(block_indices, num_blocks)
    per_group = heads // groups
    block_m, head_blocks = head_block_rows(per_group)
    positions = query_positions if query_positions is not None else selection  # an unread stand-in
    padding = key_padding_mask.view(torch.uint8) if key_padding_mask is not None else selection
    position_strides = query_positions.stride() if query_positions is not None else (0, 0)
    padding_strides = padding.stride() if key_padding_mask is not None else (0, 0)
    return SelectionWalk(
        tensors=(query, key, value, selection, positions, padding),
        strides=(*query.stride(), *key.stride(), *value.stride(), *selection.stride(), *position_strides,
                 *padding_strides),
        sizes=(queries, keys, selection.shape[-1], per_group, head_blocks, dim, d_v, num_blocks),
        grid=(batch * queries, groups * head_blocks),
        meta=dict(BLOCK_SIZE=block_size, BLOCK_N=key_tile(block_size), BLOCK_M=block_m, BLOCK_D=padded_width(dim),
                  BLOCK_DV=padded_width(d_v), HAS_POS=query_positions is not None,
                  HAS_PAD=key_padding_mask is not None, PRECISION=precision(query.dtype)),
    )


def split_count(programs: int, slots: int, device: torch.device) -> int:
    """How many runs of consecutive slots to split each selection into: 1 when the unsplit grid of ``programs``
    already gives ``PROGRAMS_PER_SM`` programs per SM, else enough runs to reach that, at most one per slot (the
    launcher evens the runs out)."""
    sms = INTERPRETER_SMS if triton_interpreted() or device.type != "cuda" else sm_count(cuda_index(device))
    return max(1, min(slots, cdiv(PROGRAMS_PER_SM * sms, programs)))


def block_sparse_attention_fwd_triton(query, key, value, block_indices, block_size: int, scale: float,
                                      query_positions=None, key_padding_mask=None, splits: int | None = None):
    """(out [B, H, Sq, Dv] contiguous in query's dtype, lse [B, H, Sq] float32, natural log, -inf without a key).

    query [B, H, Sq, D], key [B, G, T, D], value [B, G, T, Dv], block_indices [B, G, Sq, K] int32 / int64,
    query_positions None or int [B, Sq], key_padding_mask None or bool [B, T]; any strides. ``block_size`` must
    pass ``block_size_problem``. ``splits``: runs per selection (default ``split_count``; 1 is the unsplit
    kernel alone), at most K."""
    batch, heads, queries, _ = query.shape
    out = torch.empty((batch, heads, queries, value.shape[-1]), dtype=query.dtype, device=query.device)
    lse = torch.empty((batch, heads, queries), dtype=torch.float32, device=query.device)
    if out.numel() == 0:
        return out, lse
    walk = selection_walk(query, key, value, block_indices, block_size, query_positions, key_padding_mask)
    slots = walk.sizes[2]
    if splits is None:
        splits = split_count(walk.grid[0] * walk.grid[1], slots, query.device)
    per_split = cdiv(slots, max(1, min(splits, slots)))
    splits = cdiv(slots, per_split)  # runs of per_split slots, none of them empty
    if splits == 1:
        target, target_lse, split_strides = out, lse, (0, 0)
    else:
        target = torch.empty((batch, heads, queries, splits, out.shape[-1]), dtype=torch.float32, device=out.device)
        target_lse = torch.empty((batch, heads, queries, splits), dtype=torch.float32, device=out.device)
        split_strides = (target.stride(3), target_lse.stride(3))
    o_strides = (*target.stride()[:3], target.stride(-1))
    block_sparse_attention_fwd_kernel[(*walk.grid, splits)](
        *walk.tensors, target, target_lse, *walk.strides, *o_strides, split_strides[0], *target_lse.stride()[:3],
        split_strides[1], *walk.sizes, float(scale), per_split, **walk.meta, num_warps=4, num_stages=2,
    )
    if splits > 1:
        combine_splits_kernel[(batch * heads * queries,)](
            target, target_lse, out, lse, splits, out.shape[-1], BLOCK_S=max(2, next_power_of_2(splits)),
            BLOCK_DV=walk.meta["BLOCK_DV"], num_warps=4)
    return out, lse
