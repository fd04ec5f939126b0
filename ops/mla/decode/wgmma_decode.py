"""Launcher of the Hopper warpgroup-MMA absorbed-MLA decode kernel (``wgmma_decode_source.py``), compiled by NVRTC.

Same contract as ``triton_decode.mla_decode_attention`` (same outputs, layouts and split merge), for the
shapes the kernel is written for: an sm_90 GPU, bfloat16 / float16, latent 512 + rope 64 (every
DeepSeek-V2/V3 and Kimi MLA layer), rows of the query and cache contiguous and 16-byte aligned.
``unsupported_reason`` says why a call is outside that set; ``decode/kernels.py`` chooses between the
kernels. The caches are read through TMA descriptors (``cache_tensor_maps``), cached per layout and address.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from kda_compile.ops._common import cdiv, cuda_index, half_rows_problem, hopper_problem
from kda_compile.ops._nvrtc import load_kernel, tensor_map_16bit
from kda_compile.ops.mla.decode import wgmma_decode_source as src
from kda_compile.ops.mla.decode.triton_decode import (allocate_decode_outputs, choose_num_splits, mask_for_kernel,
                                                      merge_decode_splits, sm_count)

ARCH = "90a"
_ELEM = {torch.bfloat16: "bf16", torch.float16: "f16"}
_LOG2E = 1.4426950408889634
# Fixed costs of one program in the split model, in latent tiles (72 KB): loading the query block (72 KB),
# and when the call is split, the fp32 partial o (128 KB) written and read back by the merge. Without them
# the wave model split batch 64 / cache 16k / 128 heads 37 ways, twice as slow as unsplit
# (docs/mla-decode-kernels.md section 4).
QUERY_TILES, PARTIAL_TILES = 1.0, 4.0


def unsupported_reason(q_lat, q_rope, kv_latent, k_rope) -> str | None:
    """None when the wgmma kernel can run this call, else why not (for logs and the rewrite report)."""
    return outside_design(q_lat, q_rope, kv_latent) or layout_problem(q_lat, q_rope, kv_latent, k_rope)


def outside_design(q_lat, q_rope, kv_latent) -> str | None:
    """Why the call is not one the kernel is written for (device, dtype, widths), or None."""
    why = hopper_problem(kv_latent)
    if why:
        return why
    if kv_latent.dtype not in _ELEM:
        return f"{kv_latent.dtype} (the kernel takes bfloat16 / float16)"
    if q_lat.shape[-1] != src.LATENT_DIM or q_rope.shape[-1] != src.ROPE_DIM:
        return f"latent {q_lat.shape[-1]} / rope {q_rope.shape[-1]} channels (the kernel takes 512 / 64)"
    return None


def layout_problem(q_lat, q_rope, kv_latent, k_rope) -> str | None:
    """Why a call the kernel is written for cannot run as laid out (mixed dtypes, rows not contiguous and
    16-byte aligned), or None."""
    for name, t in (("q_lat", q_lat), ("q_rope", q_rope), ("kv_latent", kv_latent), ("k_rope", k_rope)):
        if t.dtype != kv_latent.dtype:
            return f"{name} is {t.dtype}, kv_latent {kv_latent.dtype}"
        why = half_rows_problem(name, t)
        if why:
            return why
    return None


@functools.lru_cache(maxsize=None)
def _source(elem: str, is_causal: bool, mask_kind: int, partial: bool) -> str:
    return src.kernel_source(elem=elem, is_causal=is_causal, mask_kind=mask_kind, partial=partial)


def compiled(dtype: torch.dtype, is_causal: bool, mask_kind: int, partial: bool, device_index: int):
    """The kernel for one specialisation on one device (NVRTC compile on first use, ~1 s)."""
    source = _source(_ELEM[dtype], bool(is_causal), mask_kind, bool(partial))
    return load_kernel(source, src.KERNEL_NAME, device_index, arch=ARCH, shared_bytes=src.SHARED_BYTES)


def cache_tensor_maps(kv_latent, k_rope) -> list:
    """The kernel's TMA descriptors of the latent and rope caches: [B, T, C] seen as (C, T, B) 16-bit
    elements, copied in boxes of 64 channels x 64 tokens. Raises NvrtcUnavailable if the driver refuses."""
    b, t = kv_latent.shape[:2]
    maps = []
    for cache in (kv_latent, k_rope):
        token_stride = cache.stride(1) * 2
        batch_stride = cache.stride(0) * 2 if b > 1 else t * token_stride  # any valid value for one batch
        maps.append(tensor_map_16bit(cache.data_ptr(), (cache.shape[2], t, b), (token_stride, batch_stride),
                                     src.TMA_BOX + (1,)))
    return maps


def mla_decode_attention_wgmma(q_lat, q_rope, kv_latent, k_rope, attn_mask, scale: float, is_causal: bool, *,
                               num_splits: int | None = None):
    """Absorbed MLA attention with the wgmma kernel: (o_lat [B, H, Sq, 512] stored [H, B, Sq, 512], lse
    [B, H, Sq] float32), as ``triton_decode.mla_decode_attention``. The caller checked
    ``unsupported_reason`` is None."""
    b, h, sq, r = q_lat.shape
    t = kv_latent.shape[1]
    rows = sq * h
    row_blocks = cdiv(rows, src.ROWS)
    num_tiles = cdiv(t, src.TILE_TOKENS)
    device_index = cuda_index(kv_latent.device)
    if num_splits is None:
        num_splits = choose_num_splits(b * row_blocks, num_tiles, sm_count(device_index), 4,
                                       program_tiles=QUERY_TILES, partial_tiles=PARTIAL_TILES)
    tiles_per_split = cdiv(num_tiles, max(1, min(num_splits, num_tiles)))
    num_splits = cdiv(num_tiles, tiles_per_split)
    partial = num_splits > 1
    o_lat, lse, out_buf, row_max, row_sum, stats = allocate_decode_outputs(b, h, sq, r, num_splits, kv_latent.dtype,
                                                                           kv_latent.device)
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.dtype != torch.float32:
        attn_mask = attn_mask.float()  # the un-broadcast mask: small; the kernel reads float32
    mask, kind, mask_strides = mask_for_kernel(attn_mask, b, h, sq, t)
    kernel_scale = float(scale) * (_LOG2E if kind != 2 else 1.0)  # scores in base 2 unless a mask is added
    with torch.cuda.device(device_index):
        kernel = compiled(kv_latent.dtype, is_causal, kind, partial, device_index)
        ptr = lambda x: ctypes.c_void_p(x.data_ptr())  # noqa: E731
        longs = [ctypes.c_longlong(s) for s in (*q_lat.stride()[:3], *q_rope.stride()[:3], *mask_strides,
                                                *out_buf.stride()[:4], *stats.stride()[:4])]
        args = [ptr(q_lat), ptr(q_rope), ptr(mask if mask is not None else kv_latent), ptr(out_buf), ptr(lse),
                ptr(row_max), ptr(row_sum), *longs, ctypes.c_int(h), ctypes.c_int(sq), ctypes.c_int(t),
                ctypes.c_int(tiles_per_split), ctypes.c_float(kernel_scale), *cache_tensor_maps(kv_latent, k_rope)]
        if b * row_blocks * num_splits:
            kernel.launch((row_blocks, num_splits, b), src.THREADS, args)
        if partial:
            merge_decode_splits(out_buf, row_max, row_sum, o_lat, lse, h, r, num_splits)
    return o_lat, lse


def flops_and_bytes(b: int, h: int, sq: int, t: int) -> tuple[float, float]:
    """Tensor-core work and latent-cache bytes of one call (for benchmarks)."""
    flops = 2.0 * b * h * sq * t * (src.LATENT_DIM * 2 + src.ROPE_DIM)
    return flops, float(b * t * (src.LATENT_DIM + src.ROPE_DIM) * 2)

