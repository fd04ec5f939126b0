"""Launcher of the Hopper warpgroup-MMA indexer score kernel for a few queries (``wgmma_indexer_source.py``, NVRTC).

Same contract as ``triton_indexer.indexer_codes_heads_kernel`` (the int32 score codes of one block of query rows,
``[B, rows, width]``) for the calls the kernel is written for: an sm_90 GPU, bfloat16 / float16 queries and keys,
at most 64 indexer heads of 128 channels, rows of q and k contiguous and 16-byte aligned (the keys are read by
TMA). ``outside_design`` / ``layout_problem`` say why a call is not one of them; ``choose_kernel`` picks the
kernel of a call (``KDA_COMPILE_INDEXER_KERNEL`` = auto | triton | cuda).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from kda_compile.ops import envs
from kda_compile.ops._common import cdiv, cuda_index, half_rows_problem, hopper_problem, on_device, sm_count
from kda_compile.ops._kernel_choice import Choice, cuda_or_triton
from kda_compile.ops._nvrtc import load_kernel, tensor_map_16bit
from kda_compile.ops.dsa.indexer import wgmma_indexer_source as src

ARCH = "90a"
KERNEL_ENV = envs.INDEXER_KERNEL
KERNELS = ("auto", "triton", "cuda")
_ELEM = {torch.bfloat16: "bf16", torch.float16: "f16"}
_WEIGHT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_OP = "dsa_indexer_topk"


def outside_design(q, k) -> str | None:
    """Why the call is not one the kernel is written for (device, dtype, widths), or None. q [B, S, H, D],
    k [B, T, D]."""
    why = hopper_problem(q)
    if why:
        return why
    if q.dtype not in _ELEM:
        return f"{q.dtype} (the kernel takes bfloat16 / float16)"
    if q.shape[-1] != src.DIM:
        return f"indexer head dim {q.shape[-1]} (the kernel takes {src.DIM})"
    if q.shape[2] > src.HEADS:
        return f"{q.shape[2]} indexer heads (the kernel takes at most {src.HEADS})"
    return None


def layout_problem(q, k) -> str | None:
    """Why a call the kernel is written for cannot run as laid out, or None."""
    if k.dtype != q.dtype:
        return f"k is {k.dtype}, q {q.dtype}"
    return half_rows_problem("q", q) or half_rows_problem("k", k)


MENU = cuda_or_triton(_OP, "wgmma indexer kernel", "Triton indexer kernel", outside_design, layout_problem)


def choose_kernel(q, k) -> str:
    """"cuda" (this kernel) or "triton" for the score codes of a few queries. Outside the kernel's design the
    Triton kernel is the call's kernel; a layout problem on a call it is written for, or a forced "cuda" it
    cannot take, is recorded as a fallback (``ops/_kernel_choice.py``)."""
    return MENU.choose(q, k, requested=envs.indexer_kernel(), refused="fall back").name


@functools.lru_cache(maxsize=None)
def _source(elem: str, has_key_mask: bool, weight: str) -> str:
    return src.kernel_source(elem=elem, has_key_mask=has_key_mask, weight=weight)


def compiled(dtype: torch.dtype, has_key_mask: bool, weight_dtype: torch.dtype, device_index: int):
    """The kernel for one specialisation on one device (NVRTC compile on first use, cached across processes)."""
    return load_kernel(_source(_ELEM[dtype], has_key_mask, _WEIGHT[weight_dtype]), src.KERNEL_NAME, device_index,
                       arch=ARCH, shared_bytes=src.shared_bytes())


def key_tensor_map(k: torch.Tensor):
    """The TMA descriptor of the keys [B, T, 128] seen as (channels, keys, batch), boxes of 64 x 64 x 1. Raises
    NvrtcUnavailable if the driver refuses the layout."""
    b, t, d = k.shape
    key_stride = k.stride(1) * 2
    batch_stride = k.stride(0) * 2 if b > 1 else max(t, 1) * key_stride  # any valid value for one batch row
    return tensor_map_16bit(k.data_ptr(), (d, max(t, 1), b), (key_stride, batch_stride),
                            (64, src.TILE_KEYS, 1))


def tiles_per_program(tiles: int, rows: int, device_index: int) -> int:
    """64-key tiles each program streams: as many programs per row as fit one wave (``src.programs_per_sm`` per SM)
    with every row cut alike, at least one tile each (each program loads its query's heads once)."""
    per_row = max(1, src.programs_per_sm() * sm_count(device_index) // max(1, rows))
    return cdiv(tiles, per_row)


def indexer_codes_wgmma(q, k, weights, key_mask, lo, hi, codes, row0: int, width: int, scale: float, *,
                        implicit: tuple[int, int, bool] | None = None) -> None:
    """Fill ``codes`` (int32 [B, rows, width], last stride 1) with the score codes of query rows ``row0 + [0,
    rows)``: q [B, S, H, 128], k [B, T, 128], weights [B, S, H] (any floating dtype; float32, bfloat16 and
    float16 are read as they are), key_mask None or bool [B, T], lo / hi int64 [S] visible ranges, or None
    with ``implicit = (S, T, causal)``: the ranges
    ``reference.visible_ranges`` gives without ``cu_seqlens``, computed in the kernel. The caller checked
    ``choose_kernel`` is "cuda". Raises NvrtcUnavailable."""
    b, rows = codes.shape[:2]
    if b * rows * width == 0:
        return
    if lo is None and implicit is None:
        raise ValueError("the wgmma indexer kernel needs lo / hi or implicit = (queries, keys, causal)")
    queries, keys, causal = implicit if lo is None else (0, 0, False)
    index = cuda_index(q.device)
    w = weights if weights.dtype in _WEIGHT else weights.float()  # (float64 weights: read as float32)
    mask = key_mask.view(torch.uint8) if key_mask is not None else None
    mask_strides = tuple(mask.stride()) if mask is not None else (0, 0)
    tiles = cdiv(width, src.TILE_KEYS)
    per_program = tiles_per_program(tiles, b * rows, index)
    with on_device(index):
        kernel = compiled(q.dtype, mask is not None, w.dtype, index)
        ptr = lambda x: ctypes.c_void_p(x.data_ptr())  # noqa: E731
        longs = [ctypes.c_longlong(s) for s in (*q.stride()[:3], *w.stride(), *mask_strides, *codes.stride()[:2],
                                                row0)]
        ranges = [ctypes.c_void_p(0)] * 2 if lo is None else [ptr(lo), ptr(hi)]
        args = [ptr(q), ptr(w), ptr(mask if mask is not None else codes), *ranges, ptr(codes), *longs,
                ctypes.c_int(q.shape[2]), ctypes.c_int(width), ctypes.c_int(per_program),
                ctypes.c_float(float(scale)), ctypes.c_longlong(queries), ctypes.c_longlong(keys),
                ctypes.c_int(int(causal)), key_tensor_map(k)]
        kernel.launch((cdiv(tiles, per_program), rows, b), src.THREADS, args)


def record_unavailable(exc: Exception) -> None:
    """The chosen kernel could not be built: the call runs the Triton kernel, recorded as a fallback."""
    MENU.after_failure(Choice(MENU.named("cuda")), exc)
