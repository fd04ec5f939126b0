"""Launcher of the Hopper warpgroup-MMA DSA sparse-attention forward (``sparse/wgmma_forward_source.py``, NVRTC).

Same contract as ``triton_forward.sparse_attention_fwd_triton`` (outputs, layouts, the split-K policy and its
combine kernel) for the calls the kernel is written for: an sm_90 GPU, bfloat16 / float16, the absorbed MQA form
(no separate value tensor: the value is the key row's first 512 channels), rows of 512 latent (+ 64 rope)
channels, query heads per KV head a multiple of 64, rows of q and k contiguous and 16-byte aligned.
``outside_design`` / ``layout_problem`` say why a call is not one of them; ``choose_kernel`` picks the kernel of
a call (``KDA_COMPILE_SPARSE_ATTENTION_KERNEL`` = auto | triton | cuda).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from kda_compile.ops import envs
from kda_compile.ops._common import cdiv, cuda_index, half_rows_problem, hopper_problem, on_device, sm_count
from kda_compile.ops._kernel_choice import Choice, cuda_or_triton
from kda_compile.ops._nvrtc import load_kernel
from kda_compile.ops.dsa.sparse import wgmma_forward_source as src

ARCH = "90a"
KERNEL_ENV = envs.SPARSE_ATTENTION_KERNEL
KERNELS = ("auto", "triton", "cuda")
_ELEM = {torch.bfloat16: "bf16", torch.float16: "f16"}
_LOG2E = 1.4426950408889634
_OP = "dsa_sparse_attention"


def outside_design(q, k, v, d_v: int) -> str | None:
    """Why the call is not one the kernel is written for (device, dtype, form, widths), or None."""
    why = hopper_problem(q)
    if why:
        return why
    if q.dtype not in _ELEM:
        return f"{q.dtype} (the kernel takes bfloat16 / float16)"
    if v is not None:
        return "a separate value tensor (the kernel's value is the key row's first 512 channels)"
    if q.shape[-1] not in (src.LATENT_DIM, src.LATENT_DIM + src.ROPE_DIM) or d_v != src.LATENT_DIM:
        return f"d_qk {q.shape[-1]} / d_v {d_v} (the kernel takes 512 or 576 / 512)"
    groups = q.shape[2] // k.shape[2]
    if groups % src.ROWS:
        return f"{groups} query heads per KV head (the kernel takes multiples of {src.ROWS})"
    return None


def layout_problem(q, k, indices) -> str | None:
    """Why a call the kernel is written for cannot run as laid out, or None."""
    if k.dtype != q.dtype:
        return f"k is {k.dtype}, q {q.dtype}"
    if indices.dtype != torch.int32:
        return f"indices are {indices.dtype}, not int32"
    return half_rows_problem("q", q) or half_rows_problem("k", k)


MENU = cuda_or_triton(_OP, "wgmma sparse attention kernel", "Triton sparse attention kernel",
                      lambda q, k, v, indices, d_v: outside_design(q, k, v, d_v),
                      lambda q, k, v, indices, d_v: layout_problem(q, k, indices))


def choose_kernel(q, k, v, indices, d_v: int) -> str:
    """"cuda" (this kernel) or "triton" for a call. Outside the kernel's design the Triton kernel is the call's
    kernel; a layout problem on a call it is written for, or a forced "cuda" it cannot take, is recorded as a
    fallback (``ops/_kernel_choice.py``). A call that selects no key runs the Triton kernel (nothing to stream)."""
    requested = envs.sparse_attention_kernel()
    if indices.shape[-1] == 0:
        return "triton"
    return MENU.choose(q, k, v, indices, d_v, requested=requested, refused="fall back").name


def record_unavailable(exc: Exception) -> None:
    """The chosen kernel could not be built: the call runs the Triton kernel, recorded as a fallback."""
    MENU.after_failure(Choice(MENU.named("cuda")), exc)


@functools.lru_cache(maxsize=None)
def _source(elem: str, rope: bool, partial: bool) -> str:
    return src.kernel_source(elem=elem, rope=rope, partial=partial)


def compiled(dtype: torch.dtype, rope: bool, partial: bool, device_index: int):
    """The kernel for one specialisation on one device (NVRTC compile on first use, cached across processes)."""
    return load_kernel(_source(_ELEM[dtype], rope, partial), src.KERNEL_NAME, device_index, arch=ARCH,
                       shared_bytes=src.shared_bytes(rope))


def sparse_attention_fwd_wgmma(q, k, indices, scale: float, *, topk_splits: int | None = None):
    """(o [B, S, Hq, 512] contiguous in q's dtype, lse [B, S, Hq] float32): q [B, S, Hq, D], k [B, T, Hkv, D]
    (D = 512 or 576; the value is k[..., :512]), indices int32 [B, S, topk] (-1: none), any strides. The caller
    checked ``choose_kernel`` is "cuda". ``topk_splits`` (None: ``triton_forward.choose_topk_splits``) > 1 writes
    float32 partials merged by the Triton combine kernel. Raises NvrtcUnavailable."""
    from kda_compile.ops.dsa.sparse.triton_forward import choose_topk_splits, combine_splits, effective_splits

    b, s_len, hq, d_qk = q.shape
    topk = indices.shape[-1]
    d_v = src.LATENT_DIM
    o = torch.empty((b, s_len, hq, d_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, s_len, hq), dtype=torch.float32, device=q.device)
    if b * s_len * hq == 0:
        return o, lse
    index = cuda_index(q.device)
    head_blocks = hq // src.ROWS
    tiles = cdiv(topk, src.TILE_TOKENS)
    splits = topk_splits or choose_topk_splits(b * s_len * head_blocks, tiles, sm_count(index))
    splits, tiles_per_split = effective_splits(splits, tiles)
    if splits > 1:
        out = torch.empty((b, s_len, splits, hq, d_v), dtype=torch.float32, device=q.device)
        out_lse = torch.empty((b, s_len, splits, hq), dtype=torch.float32, device=q.device)
        o_strides, l_strides = out.stride()[:4], out_lse.stride()
    else:
        out, out_lse = o, lse
        o_strides = (o.stride(0), o.stride(1), 0, o.stride(2))
        l_strides = (lse.stride(0), lse.stride(1), 0, lse.stride(2))
    rope = d_qk > src.LATENT_DIM
    with on_device(index):
        kernel = compiled(q.dtype, rope, splits > 1, index)
        ptr = lambda x: ctypes.c_void_p(x.data_ptr())  # noqa: E731
        longs = [ctypes.c_longlong(s) for s in (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
                                                k.stride(2), *indices.stride(), *o_strides, *l_strides)]
        args = [ptr(q), ptr(k), ptr(indices), ptr(out), ptr(out_lse), *longs, ctypes.c_int(s_len),
                ctypes.c_int(topk), ctypes.c_int(head_blocks), ctypes.c_int(head_blocks // k.shape[2]),
                ctypes.c_int(tiles_per_split * src.TILE_TOKENS), ctypes.c_float(float(scale) * _LOG2E)]
        kernel.launch((b * s_len * head_blocks, splits, 1), src.THREADS, args)
        if splits > 1:
            combine_splits(out, out_lse, o, lse)
    return o, lse

