"""Triton kernels for absorbed MLA decode: split-KV MQA over the latent cache, plus an LSE merge.

Kernels and their launcher only (no torch.compile, no dispatch). The absorbed form (docs/mla.md §3)
is MQA with one key/value head shared by every query head: for a query row (query i, head h)

    s_t = scale * (q_lat[h, i] . c_t + q_rope[h, i] . r_t),    o_lat[h, i] = sum_t softmax(s)_t c_t

where c_t [R] is the cached latent (it is both key and value) and r_t [Dr] the rope key.

Structure (flash decoding):
- ``mla_decode_split_kernel``, grid (row blocks, KV splits, B). A program owns BLOCK_M rows of the
  flattened (query, head) axis (row = i * H + h, so a block is many heads of one query) and walks its
  split of the cache in BLOCK_N-token tiles with an online softmax. Each latent tile is loaded once
  and used for both the scores and the value product, for every row of the block; programs sharing
  a KV slice are adjacent in the grid (row block varies fastest), so a tile re-read by another head
  block comes from L2. Accumulation is fp32. Writes per split the normalised partial output with
  its row max and exp-sum, or, with one split, the final output directly (no merge).
- ``mla_decode_merge_kernel``, grid (Sq * H, B): combines the splits, weighting each by its
  exp-sum rescaled to the common max (the flash-decoding log-sum-exp merge).
Any batch, cache length and query length (tails masked), causal (bottom-right) and bool / additive
masks broadcast to [B, H, Sq, T] by strides (Hugging Face's padding masks). Rows with every key
masked return 0 and lse -inf.

Under ``TRITON_INTERPRET=1`` one small fixed config is used so the kernels run on CPU tensors (tests
use float32 / float16 there; bfloat16 dots are unreliable in the 3.6 interpreter).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kda_compile.ops._common import cdiv, next_power_of_2, sm_count, triton_interpreted as interpreted

LOG2E = tl.constexpr(1.4426950408889634)  # a plain global is rejected by the compiler (not by the interpreter)


@triton.jit
def mla_decode_split_kernel(
    QLat, QRope, Latent, KRope, Mask, Out, Lse, RowMax, RowSum,
    stride_qb, stride_qh, stride_qs, stride_qr,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_cb, stride_ct, stride_cr,
    stride_kb, stride_kt, stride_kd,
    stride_mb, stride_mh, stride_ms, stride_mt,
    stride_ob, stride_oh, stride_os, stride_osplit, stride_or,
    stride_lb, stride_lh, stride_ls, stride_lsplit,
    H, Sq, T, R, Dr, tiles_per_split, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, PARTIAL: tl.constexpr, PRECISION: tl.constexpr,
):
    """o_lat of one KV split for BLOCK_M (query, head) rows, normalised by the split's own sum.

    QLat [B, H, Sq, R], QRope [B, H, Sq, Dr], Latent [B, T, R], KRope [B, T, Dr], Mask [B, H, Sq, T]
    (MASK_KIND 0 none, 1 bool as uint8, 2 additive float), Out [B, H, Sq, splits, R]: all by
    strides. With PARTIAL, the row max and the sum of exp(s - max) go to RowMax / RowSum
    [B, H, Sq, splits] float32 (kept apart, not as max + log(sum): rows whose keys all carry a huge
    finite mask such as finfo.min would lose the sum there and misweigh the splits). Without it
    (one split) the output is final and Lse [B, H, Sq] gets the log-sum-exp (-inf: nothing attended).
    """
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Sq * H
    qi = rows // H
    h = rows % H
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_DR)
    r_ok = offs_r < R
    d_ok = offs_d < Dr

    q = tl.load(QLat + b * stride_qb + h[:, None] * stride_qh + qi[:, None] * stride_qs + offs_r[None, :] * stride_qr,
                mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    qp = tl.load(QRope + b * stride_pb + h[:, None] * stride_ph + qi[:, None] * stride_ps + offs_d[None, :] * stride_pd,
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    c_base = Latent + b * stride_cb
    k_base = KRope + b * stride_kb
    m_base = Mask + b * stride_mb + h[:, None] * stride_mh + qi[:, None] * stride_ms

    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, T)
    if IS_CAUSAL:  # no row of this block sees past the last row's position
        last_row = tl.minimum(pid_m * BLOCK_M + BLOCK_M, Sq * H) - 1
        hi = tl.minimum(hi, T - Sq + last_row // H + 1)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < hi
        c = tl.load(c_base + offs_n[:, None] * stride_ct + offs_r[None, :] * stride_cr,
                    mask=col_ok[:, None] & r_ok[None, :], other=0.0)
        kr = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                     mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(c), input_precision=PRECISION)
        s = s + tl.dot(qp, tl.trans(kr), input_precision=PRECISION)
        s = s * scale
        keep = row_ok[:, None] & col_ok[None, :]
        if IS_CAUSAL:
            keep = keep & (offs_n[None, :] <= (T - Sq + qi)[:, None])
        if MASK_KIND == 1:
            keep = keep & (tl.load(m_base + offs_n[None, :] * stride_mt, mask=keep, other=0) != 0)
        elif MASK_KIND == 2:
            s = s + tl.load(m_base + offs_n[None, :] * stride_mt, mask=keep, other=0.0).to(tl.float32)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with every key masked so far keep m = -inf; shift them by 0 so no inf - inf appears.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2((m_i - m_use) * LOG2E)
        p = tl.exp2((s - m_use[:, None]) * LOG2E)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
        m_i = m_new

    alive = l_i > 0
    safe_l = tl.where(alive, l_i, 1.0)
    o = acc / safe_l[:, None]
    tl.store(Out + b * stride_ob + h[:, None] * stride_oh + qi[:, None] * stride_os + split * stride_osplit
             + offs_r[None, :] * stride_or, o.to(Out.dtype.element_ty), mask=row_ok[:, None] & r_ok[None, :])
    row_offset = b * stride_lb + h * stride_lh + qi * stride_ls + split * stride_lsplit
    if PARTIAL:
        tl.store(RowMax + row_offset, m_i, mask=row_ok)
        tl.store(RowSum + row_offset, l_i, mask=row_ok)
    else:
        lse = tl.where(alive, tl.where(m_i == float("-inf"), 0.0, m_i) + tl.log(safe_l), float("-inf"))
        tl.store(Lse + row_offset, lse, mask=row_ok)


@triton.jit
def mla_decode_merge_kernel(
    OPart, RowMax, RowSum, Out, Lse,
    stride_pb, stride_ph, stride_ps, stride_psplit, stride_pr,
    stride_qb, stride_qh, stride_qs, stride_qsplit,
    stride_ob, stride_oh, stride_os, stride_or,
    stride_lb, stride_lh, stride_ls,
    H, R, num_splits,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """out = sum_s w_s o_s / sum_s w_s with w_s = l_s exp(m_s - max_s m_s), for one (query, head) row.

    OPart [B, H, Sq, splits, R] float32, RowMax / RowSum [B, H, Sq, splits] float32 (a split that
    saw no key: max -inf, sum 0) -> Out [B, H, Sq, R] (output dtype), Lse [B, H, Sq] float32.
    Grid (Sq * H, B).
    """
    row = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    qi = row // H
    h = row % H
    offs_r = tl.arange(0, BLOCK_R)
    offs_s = tl.arange(0, BLOCK_S)
    stat_offset = b * stride_qb + h * stride_qh + qi * stride_qs
    m_all = tl.load(RowMax + stat_offset + offs_s * stride_qsplit, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(m_all, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    part_base = OPart + b * stride_pb + h * stride_ph + qi * stride_ps
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    total = tl.sum(tl.zeros([BLOCK_S], dtype=tl.float32), 0)  # a float32 scalar, carried by the loop
    for s in range(0, num_splits):
        stat = stat_offset + s * stride_qsplit
        w = tl.load(RowSum + stat) * tl.exp2((tl.load(RowMax + stat) - m_use) * LOG2E)
        acc += w * tl.load(part_base + s * stride_psplit + offs_r * stride_pr, mask=offs_r < R, other=0.0)
        total += w
    o = acc / tl.where(total > 0, total, 1.0)
    lse = tl.where(total > 0, m_use + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    tl.store(Out + b * stride_ob + h * stride_oh + qi * stride_os + offs_r * stride_or, o.to(Out.dtype.element_ty),
             mask=offs_r < R)
    tl.store(Lse + b * stride_lb + h * stride_lh + qi * stride_ls, lse)


# ----------------------------------------------------------------------------------------------
# Launcher.
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeConfig:
    block_m: int  # (query, head) rows per program
    block_n: int  # cached tokens per tile
    num_warps: int
    num_stages: int


INTERPRET_CONFIG = DecodeConfig(16, 16, 1, 1)
MAX_SPLITS = 64


def default_config(rows: int, latent_block: int, dtype: torch.dtype) -> DecodeConfig:
    """Fixed config per problem (no autotuning: deterministic launches, and the interpreter cannot tune).

    rows = Sq * H. Half types with >= 64 rows take 64-row blocks: one latent tile then serves 64
    heads, and M = 64 lets Triton use Hopper's warpgroup MMA (the kernel nears the compute ridge at
    128 heads). The [64, R] fp32 accumulator is 128 registers per thread over 8 warps; the 64-row
    fp16/bf16 query (64 KB) plus two 64 KB latent stages fit an sm_90 SM's shared memory, fp32 ones do
    not (32 rows there). BLOCK_N makes one latent tile ~64 KB. Stages and split counts follow the
    sweep of ``python -m kda_compile.bench mla --modes configs`` (docs/mla-decode-kernels.md, section 2, "Tuning
    measurements").
    """
    if interpreted():
        return INTERPRET_CONFIG
    if rows >= 64 and dtype != torch.float32:
        block_m = 64
    else:
        block_m = 16 if rows <= 16 else 32
    tokens = 64 * 1024 // (latent_block * (4 if dtype == torch.float32 else 2))
    block_n = max(16, min(64, 1 << (max(1, tokens).bit_length() - 1)))  # a power of two <= tokens
    # Three stages for 32-row half blocks (docs/mla-decode-kernels.md, section 2, "Tuning measurements").
    stages = 3 if block_m == 32 and dtype != torch.float32 else 2
    return DecodeConfig(block_m, block_n, 4 if block_m == 16 else 8, stages)


SPLIT_COST_TILES = 0.1  # one split's partial write and merge share, in units of one latent tile


def choose_num_splits(programs_per_split: int, num_tiles: int, num_sms: int, min_tiles_per_split: int, *,
                      program_tiles: float = 0.0, partial_tiles: float = 0.0) -> int:
    """KV splits minimising a wave model of the kernel's time, keeping >= min_tiles_per_split tiles
    per split. ``program_tiles`` (every program) and ``partial_tiles`` (every program of a split call)
    are fixed per-program costs in units of one latent tile (0 for this kernel; see the wgmma launcher).

    The half-precision configs use most of an SM's shared memory (one resident program per SM), so
    programs run in waves of ``num_sms`` and a split count that leaves a last wave nearly empty costs
    a whole wave (docs/mla-decode-kernels.md, section 2, "Tuning measurements"). Time ~ waves x tiles per split, plus a
    small per-split cost; ties go to fewer splits. Two full waves without splitting stay unsplit."""
    if programs_per_split >= 2 * num_sms:  # splitting would only add merges
        return 1
    most = max(1, min(MAX_SPLITS, num_tiles // max(1, min_tiles_per_split)))

    def cost(splits: int) -> float:
        waves = cdiv(max(1, programs_per_split) * splits, max(1, num_sms))
        fixed = program_tiles + (partial_tiles if splits > 1 else 0.0)
        return waves * (cdiv(num_tiles, splits) + fixed) + SPLIT_COST_TILES * (splits - 1)

    return min(range(1, most + 1), key=lambda s: (cost(s), s))


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs keep full fp32 products (no tf32); half types use tensor cores either way.
    return "ieee" if dtype == torch.float32 else "tf32"


def mask_for_kernel(attn_mask, b: int, h: int, sq: int, t: int):
    """(tensor, kind, strides) of a mask broadcast to [B, H, Sq, T] without copying
    (kind 0 none, 1 bool reinterpreted as uint8, 2 additive float)."""
    if attn_mask is None:
        return None, 0, (0, 0, 0, 0)
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    m = m.expand(b, h, sq, t)
    if m.dtype == torch.bool:
        return m.view(torch.uint8), 1, tuple(m.stride())
    return m, 2, tuple(m.stride())


def mla_decode_attention(q_lat, q_rope, kv_latent, k_rope, attn_mask, scale: float, is_causal: bool, *,
                         num_splits: int | None = None, config: DecodeConfig | None = None):
    """Absorbed MLA attention over the latent cache (MQA: one latent head shared by every query head).

    Args:
        q_lat: [B, H, Sq, R], the absorbed query ``q_nope @ W_UK``; q_rope: [B, H, Sq, Dr].
        kv_latent: [B, T, R]; k_rope: [B, T, Dr]. All four of one dtype (float16, bfloat16, float32),
            any strides.
        attn_mask: None, bool (True = attend) or additive float, broadcastable to [B, H, Sq, T].
        scale: multiplies ``q_lat . c + q_rope . r`` (passed explicitly: YaRN's mscale is in it).
        is_causal: query i sees keys ``t <= T - Sq + i``.
        num_splits, config: override the split count / tile config (tests and tuning).
    Returns:
        o_lat [B, H, Sq, R] in the input dtype, stored as [H, B, Sq, R] (so the per-head
        ``@ W_UV^T`` that follows is one batched matmul over H without a copy), and
        lse [B, H, Sq] float32 (-inf for rows with nothing to attend).
    """
    b, h, sq, r = q_lat.shape
    t, dr = kv_latent.shape[1], q_rope.shape[3]
    block_r = max(16, next_power_of_2(r))
    block_dr = max(16, next_power_of_2(dr))
    cfg = config or default_config(sq * h, block_r, kv_latent.dtype)
    row_blocks = cdiv(sq * h, cfg.block_m)
    num_tiles = cdiv(t, cfg.block_n)
    if num_splits is None:
        if kv_latent.is_cuda:
            index = kv_latent.device.index
            sms = sm_count(torch.cuda.current_device() if index is None else index)
        else:  # the interpreter: a pretend 4-SM device, so moderate caches already split
            sms = 4
        num_splits = choose_num_splits(b * row_blocks, num_tiles, sms, 1 if interpreted() else 4)
    tiles_per_split = cdiv(num_tiles, max(1, min(num_splits, num_tiles)))
    num_splits = cdiv(num_tiles, tiles_per_split)  # no split left without a tile

    partial = num_splits > 1
    o_lat, lse, out_buf, row_max, row_sum, stats = allocate_decode_outputs(b, h, sq, r, num_splits, kv_latent.dtype,
                                                                           kv_latent.device)
    mask, kind, mask_strides = mask_for_kernel(attn_mask, b, h, sq, t)
    mla_decode_split_kernel[(row_blocks, num_splits, b)](
        q_lat, q_rope, kv_latent, k_rope, mask if mask is not None else kv_latent, out_buf, lse, row_max, row_sum,
        *q_lat.stride(), *q_rope.stride(), *kv_latent.stride(), *k_rope.stride(), *mask_strides,
        *out_buf.stride(), *stats.stride(),
        h, sq, t, r, dr, tiles_per_split, float(scale),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=block_r, BLOCK_DR=block_dr,
        IS_CAUSAL=bool(is_causal), MASK_KIND=kind, PARTIAL=partial, PRECISION=_precision(kv_latent.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if partial:
        merge_decode_splits(out_buf, row_max, row_sum, o_lat, lse, h, r, num_splits)
    return o_lat, lse


def allocate_decode_outputs(b: int, h: int, sq: int, r: int, num_splits: int, dtype: torch.dtype, device):
    """(o_lat, lse, out_buf, row_max, row_sum, stats) of a split kernel launch.

    o_lat [B, H, Sq, R] stored as [H, B, Sq, R]; lse [B, H, Sq] float32. With several splits the
    kernel writes float32 partials out_buf [B, H, Sq, splits, R] and row_max / row_sum [B, H, Sq,
    splits] (stats: the tensor whose strides index them); with one it writes o_lat and lse directly
    (out_buf is o_lat with a unit split axis, the stats pointers are unused)."""
    o_lat = torch.empty((h, b, sq, r), dtype=dtype, device=device).permute(1, 0, 2, 3)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=device)
    if num_splits > 1:
        out_buf = torch.empty((b, h, sq, num_splits, r), dtype=torch.float32, device=device)
        row_max = torch.empty((b, h, sq, num_splits), dtype=torch.float32, device=device)
        return o_lat, lse, out_buf, row_max, torch.empty_like(row_max), row_max
    return o_lat, lse, o_lat.unsqueeze(3), lse, lse, lse.unsqueeze(3)


def merge_decode_splits(out_buf, row_max, row_sum, o_lat, lse, h: int, r: int, num_splits: int) -> None:
    """Combine the splits' partials into o_lat and lse (``mla_decode_merge_kernel``)."""
    b, _, sq = lse.shape
    mla_decode_merge_kernel[(sq * h, b)](
        out_buf, row_max, row_sum, o_lat, lse, *out_buf.stride(), *row_max.stride(), *o_lat.stride(),
        *lse.stride(), h, r, num_splits, BLOCK_R=max(16, next_power_of_2(r)),
        BLOCK_S=max(2, next_power_of_2(num_splits)), num_warps=1 if interpreted() else 4,
    )
