"""Triton kernel for the DSA lightning indexer: fused blockwise scores, written as int32 codes, then an
exact top-k by radix select (``indexer/triton_topk.py``).

Kernel and launcher only (no torch.compile, no dispatch). For a tile of BLOCK_M queries x BLOCK_N keys
the kernel loads the key tile once, loops over the H_I indexer heads (one [BLOCK_M, D] x [D, BLOCK_N]
dot each) and accumulates ``w[i, h] * relu(scale * q[i, h] . k[s])`` in float32, so the
[S, H_I, T] logits never exist. It then writes, instead of the score, its order-preserving int32 code
(``triton_topk.score_codes``; ``CODE_HIDDEN`` for a key the query may not see: outside its [lo, hi) range
or masked by key_mask). ``triton_topk.topk_from_codes`` selects each row's top-k from the codes with the
tie rule (equal scores: lower index first), the same result as ``torch.topk`` over
``reference.order_keys`` on any GPU.

Fewer than ``SHORT_QUERIES`` queries (decode, short chunks) take ``indexer_codes_heads_kernel`` instead: one
query per program, its H_I heads as the MMA's rows; on an sm_90 GPU the CUDA kernel of ``indexer/wgmma_indexer.py``
(the same codes, a deeper key stream; ``wgmma_indexer.choose_kernel``) runs them where it can, and without
``cu_seqlens``, when the top-k takes its CUDA kernel too, both compute the visible ranges themselves
(``_few_queries_on_cuda``: two launches per call).

Queries are processed in blocks whose [B, S_blk, width] code buffer stays under ``KEY_BUFFER_BYTES`` (the
top-k writes its indices straight into the output); ``width`` stops at the last key the block can see (causal:
half the work in prefill), and key tiles wholly outside every row's range skip the head loop.

Under ``TRITON_INTERPRET=1`` a small fixed config runs the kernel on CPU tensors (fp32 / fp16).
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kda_compile.ops._common import (cdiv, cuda_index, device_capability, next_power_of_2, sm_count,
                                     triton_interpreted as interpreted)
from kda_compile.ops._nvrtc import NvrtcUnavailable
from kda_compile.ops.dsa.indexer import cuda_topk, wgmma_indexer
from kda_compile.ops.dsa.reference import visible_ranges
from kda_compile.ops.dsa.indexer.triton_topk import (cuda_select_takes, record_cuda_topk_unavailable, score_codes,
                                                     topk_from_codes)

KEY_BUFFER_BYTES = 256 << 20
PROGRAMS_PER_SM = 8  # decode: programs per SM the key stream is cut into
MAX_TILES = 16  # decode: key tiles streamed by one program at most
SHORT_QUERIES = 16  # below this many queries a query tile would be mostly padding: heads become the MMA's rows
DECODE_KEY_DESCRIPTOR = True  # the heads-as-rows kernel loads keys by TMA where it can (``key_descriptor``)


@triton.jit
def indexer_codes_kernel(
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
    """Out[b, i - row0, s] = int32 code of score[b, i, s] for queries row0 + [0, rows) and keys [0, width).

    Q [B, S, H, D], K [B, T, D], W [B, S, H], KeyMask [B, T] (uint8), Lo / Hi [S] int64 (query i sees
    keys lo <= s < hi), Out [B, rows, width] int32; all by strides. Grid (row tiles, key tiles, B)."""
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

    tl.store(Out + b * stride_ob + local[:, None] * stride_os + offs_n[None, :] * stride_ot,
             score_codes(acc, visible), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def indexer_codes_heads_kernel(
    Q, K, W, KeyMask, Lo, Hi, Out,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kd,
    stride_wb, stride_ws, stride_wh,
    stride_mb, stride_mt,
    stride_ob, stride_os, stride_ot,
    row0, width, H, D, scale, TILES,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr, K_DESCRIPTOR: tl.constexpr,
):
    """As ``indexer_codes_kernel`` for one query per program with its heads as the MMA's M dimension:
    decode and short chunks (a query tile would be mostly padding there). The program loads its query's
    [H_I, D] heads and weights once and streams ``TILES`` key tiles (pipelined loads): per tile one
    [H_I, D] x [D, BLOCK_N] dot, then the ReLU and the weighted sum over the head axis. With
    ``K_DESCRIPTOR`` ``K`` is a tensor descriptor of the keys [B, T, D] with block [1, BLOCK_N, BLOCK_D]
    (TMA loads; keys past T read as zeros, hidden keys are loaded and then coded hidden); the K strides are
    then unused. Grid (rows, key chunks of TILES * BLOCK_N, B)."""
    local = tl.program_id(0)
    chunk = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    qi = row0 + local
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    lo = tl.load(Lo + qi)
    hi = tl.load(Hi + qi)
    q = tl.load(Q + b * stride_qb + qi * stride_qs + offs_h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.load(W + b * stride_wb + qi * stride_ws + offs_h * stride_wh, mask=h_ok, other=0.0).to(tl.float32)
    for t in tl.range(0, TILES, num_stages=NUM_STAGES):
        offs_n = (chunk * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = offs_n < width
        visible = col_ok & (offs_n >= lo) & (offs_n < hi)
        if HAS_KEY_MASK:
            km = tl.load(KeyMask + b * stride_mb + offs_n * stride_mt, mask=col_ok, other=0)
            visible = visible & (km != 0)
        if K_DESCRIPTOR:
            k = tl.reshape(K.load([tl.program_id(2), (chunk * TILES + t) * BLOCK_N, 0]), [BLOCK_N, BLOCK_D])
        else:
            k = tl.load(K + b * stride_kb + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                        mask=(visible[:, None]) & d_ok[None, :], other=0.0)
        logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], 0)
        tl.store(Out + b * stride_ob + local * stride_os + offs_n * stride_ot, score_codes(score, visible),
                 mask=col_ok)


def _config(dim: int, dtype: torch.dtype):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). The fp32 score tile [BLOCK_M, BLOCK_N] stays in
    registers across the head loop; the key tile [BLOCK_N, D] is loaded once per program. bf16 / fp16 at
    D = 128: 64 x 128 with 4 warps, 3 stages, the fastest of the sweep (docs/dsa.md, section 4, "Tuning measurements",
    "indexer tiles")."""
    if interpreted():
        return 16, 16, 1, 1
    if dtype == torch.float32 or dim > 128:
        return 64, 64, 4, 2
    return 64, 128, 4, 3


def _heads_config(dim: int, dtype: torch.dtype):
    """(BLOCK_N, num_warps, num_stages) of the heads-as-rows kernel. bf16 / fp16 at 64 heads x 128: 64 keys per
    tile, 4 warps, 3 stages, the fastest of the sweep (docs/dsa.md, section 4, "Tuning measurements", "indexer
    tiles")."""
    if interpreted():
        return 16, 1, 1
    if dtype == torch.float32 or dim > 128:
        return 32, 4, 2
    return 64, 4, 3


def key_descriptor(k: torch.Tensor, block_n: int, block_d: int):
    """A TMA descriptor of the keys [B, T, D] for the heads-as-rows kernel, or None where the pointer loads run:
    ``DECODE_KEY_DESCRIPTOR`` off, keys not in half precision, a GPU before Hopper (sm_90), ``D`` not a power of
    two, or a layout TMA cannot address (last stride not 1, other strides or the base not 16-byte aligned).
    TMA streams the keys faster than the pointer loads (docs/dsa.md, section 4, "Tuning measurements", "indexer tiles").
    The Triton interpreter runs the descriptor path too."""
    if not DECODE_KEY_DESCRIPTOR or k.dtype not in (torch.float16, torch.bfloat16) or k.shape[2] != block_d:
        return None
    if not interpreted() and (k.device.type != "cuda" or device_capability(cuda_index(k.device))[0] < 9):
        return None
    size = k.element_size()
    if k.stride(2) != 1 or k.data_ptr() % 16 or any((st * size) % 16 for st in k.stride()[:2]):
        return None
    return TensorDescriptor(k, list(k.shape), list(k.stride()), [1, block_n, block_d])


def tiles_per_program(tiles: int, rows: int, device: torch.device) -> int:
    """Key tiles each program of the heads-as-rows kernel streams: as many as keep about
    ``PROGRAMS_PER_SM`` programs per SM busy (each loads its query's heads once), at most ``MAX_TILES``."""
    if interpreted() or device.type != "cuda":
        return 2
    target = PROGRAMS_PER_SM * sm_count(cuda_index(device))
    return max(1, min(MAX_TILES, (tiles * rows) // target))


def _few_queries_on_cuda(q, k, weights, key_mask, cu_seqlens, topk: int, scale: float, is_causal: bool, out) -> None:
    """Fewer than ``SHORT_QUERIES`` queries (one block of rows, each ending by T) on the CUDA score kernel, then the
    top-k. Without ``cu_seqlens``, when the top-k takes its CUDA kernel too, both compute the visible ranges
    themselves: no range tensors, two launches in all. Raises NvrtcUnavailable, with ``out`` untouched, when the
    score kernel cannot be built."""
    b, s_len = q.shape[:2]
    t_len = k.shape[1]
    codes = torch.empty((b, s_len, t_len), dtype=torch.int32, device=q.device)
    if cu_seqlens is None and topk >= 1 and cuda_select_takes(q.device, t_len, b * s_len):
        implicit = (s_len, t_len, is_causal)
        wgmma_indexer.indexer_codes_wgmma(q, k, weights, key_mask, None, None, codes, 0, t_len, scale,
                                          implicit=implicit)
        try:
            cuda_topk.launch(codes, None, None, 0, topk, out, implicit=implicit)
            return
        except NvrtcUnavailable as exc:
            record_cuda_topk_unavailable(exc)
        lo, hi = visible_ranges(s_len, t_len, is_causal, None, q.device)
    else:
        lo, hi = visible_ranges(s_len, t_len, is_causal, cu_seqlens, q.device)
        wgmma_indexer.indexer_codes_wgmma(q, k, weights, key_mask, lo, hi, codes, 0, t_len, scale)
    topk_from_codes(codes, lo, hi, 0, topk, out)


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
    if s_len < SHORT_QUERIES and t_len > 0 and wgmma_indexer.choose_kernel(q, k) == "cuda":
        try:
            _few_queries_on_cuda(q, k, weights, key_mask, cu_seqlens, topk, scale, is_causal, out)
            return out
        except NvrtcUnavailable as exc:
            wgmma_indexer.record_unavailable(exc)
    lo, hi = visible_ranges(s_len, t_len, is_causal, cu_seqlens, device)
    block_m, block_n, warps, stages = _config(dim, q.dtype)
    block_d = max(16, next_power_of_2(dim))
    mask = key_mask.view(torch.uint8) if key_mask is not None else lo
    mask_strides = tuple(key_mask.stride()) if key_mask is not None else (0, 0)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # Rows per block: the int32 codes [B, rows, T] under KEY_BUFFER_BYTES, a multiple of BLOCK_M.
    step = max(block_m, (KEY_BUFFER_BYTES // max(1, b * t_len * 4)) // block_m * block_m)
    for start in range(0, s_len, step):
        stop = min(s_len, start + step)
        # The last key this block can see (causal rows end at i + T - S); the rest is never written.
        width = min(t_len, stop - 1 + t_len - s_len + 1) if is_causal else t_len
        if width <= 0:
            out[:, start:stop] = -1
            continue
        codes = torch.empty((b, stop - start, width), dtype=torch.int32, device=device)
        strides = (*q.stride(), *k.stride(), *weights.stride(), *mask_strides, *codes.stride())
        if s_len < SHORT_QUERIES:  # decode / short chunks: heads as the MMA's rows
            block_n, warps, stages = _heads_config(dim, q.dtype)
            tiles = tiles_per_program(cdiv(width, block_n), (stop - start) * b, device)
            grid = (stop - start, cdiv(width, block_n * tiles), b)
            k_desc = key_descriptor(k, block_n, block_d)
            indexer_codes_heads_kernel[grid](
                q, k if k_desc is None else k_desc, weights, mask, lo, hi, codes, *strides, start, width, heads,
                dim, float(scale), tiles,
                BLOCK_H=max(16, next_power_of_2(heads)), BLOCK_N=block_n, BLOCK_D=block_d,
                HAS_KEY_MASK=key_mask is not None, PRECISION=precision, NUM_STAGES=stages,
                K_DESCRIPTOR=k_desc is not None, num_warps=warps,
            )
        else:
            grid = (cdiv(stop - start, block_m), cdiv(width, block_n), b)
            indexer_codes_kernel[grid](
                q, k, weights, mask, lo, hi, codes, *strides, start, stop - start, width, heads, dim, float(scale),
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, HAS_KEY_MASK=key_mask is not None,
                PRECISION=precision, num_warps=warps, num_stages=stages,
            )
        topk_from_codes(codes, lo, hi, start, topk, out[:, start:stop])
    return out
