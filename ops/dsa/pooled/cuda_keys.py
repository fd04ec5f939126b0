"""Launcher of the CUDA pool-forming kernel (``pooled/cuda_keys_source.py``, NVRTC): glm5_next's pool keys read as whole
token rows, for the cache layout Hugging Face keeps (keys, gates and the validity flag side by side in one ``[B, T, 2D +
1]`` tensor) and for separate key and gate tensors with contiguous rows.

``pooled_keys_cuda`` has the contract of ``triton_keys.pooled_keys_triton``; ``pools_from_rows`` also reads the key
flags where they lie in the copied rows (the op's ``key_valid`` given as HF's cache column) and returns the bool mask
and each row's first valid key with the pools, so no separate pass over the flags makes them. ``serving_layout`` picks
the kernel of a call and works out its row layout, once, for the launch (``choose_kernel`` says only which kernel;
``KDA_COMPILE_POOL_KERNEL`` = auto | triton | cuda): this one for keys and gates in one row (HF's
layout; separate tensors only when forced: the Triton kernel is faster on them), float16 / bfloat16 (one dtype, as in
HF's cache) of at most 256 channels in pools of at most 32 tokens on an sm_80+ GPU, laid out as ``row_layout`` accepts;
else the Triton kernel, recorded as a fallback when the call was one this kernel is written for or ``cuda`` was forced.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from kda_compile.ops import envs
from kda_compile.ops._common import cdiv, cuda_index, device_capability, on_device, sm_count
from kda_compile.ops._kernel_choice import Choice, cuda_or_triton
from kda_compile.ops._nvrtc import load_kernel
from kda_compile.ops.dsa.pooled import cuda_keys_source as src
from kda_compile.ops.dsa.pooled.reference import empty_pools

KERNEL_ENV = envs.POOL_KERNEL
KERNELS = ("auto", "triton", "cuda")
_ELEM = {torch.bfloat16: "bf16", torch.float16: "f16"}
_OP = "dsa_pooled_indexer_topk"
# Bytes a token's span may hold beyond what the kernel reads (a gap between rows is copied too): HF's row holds
# one flag element past the gates.
MAX_GAP = 64
WARPS_PER_SM = 12  # 12 warps x 2 stages of ~8 KiB (HF's rows at D = 128): the copies in flight cover the latency


@dataclass(frozen=True)
class RowLayout:
    """Where a call's keys and gates are: one or two spans per token (``cuda_pool_keys_source``)."""

    bases: tuple[int, int]  # device addresses of the spans at b = 0, t = 0
    batch_strides: tuple[int, int]  # bytes
    token_strides: tuple[int, int]  # bytes
    widths: tuple[int, int]  # bytes read per token
    k_off: int  # bytes from the key span's start to k[b, t, 0]
    g_off: int  # bytes from the gate span's start to gate[b, t, 0]
    v_off: int = -1  # bytes from span 0's start to the flag element of the token (-1: the flags are not in it)

    @property
    def spans(self) -> int:
        return 1 if self.widths[1] == 0 else 2


def _batch_stride(t: torch.Tensor) -> int:
    return t.stride(0) * t.element_size() if t.shape[0] > 1 else 0


def row_layout(k: torch.Tensor, gate: torch.Tensor, flags: torch.Tensor | None = None) -> RowLayout | str:
    """The spans of k / gate [B, T, D] (channels contiguous), or why the kernel cannot read them as rows. ``flags``
    [B, T] (the key flags, k's dtype): the one span also holds each token's flag element where it lies in the same
    row (``v_off``; HF's ``cat([k, gate, valid])``)."""
    es = k.element_size()
    if k.stride(-1) != 1 or gate.stride(-1) != 1:
        return f"k / gate channels are not contiguous (strides {tuple(k.stride())} / {tuple(gate.stride())})"
    width = k.shape[-1] * es
    kp, gp = k.data_ptr(), gate.data_ptr()
    kst, gst = k.stride(1) * es, gate.stride(1) * es
    if kst == gst and _batch_stride(k) == _batch_stride(gate) and abs(kp - gp) < kst:
        lo, hi = min(kp, gp), max(kp, gp) + width  # both in one row: one span
        if kst <= 2 * width + MAX_GAP:
            v_off = -1
            if flags is not None and flags.dtype == k.dtype and flags.stride(1) * es == kst \
                    and _batch_stride(flags) == _batch_stride(k) and abs(flags.data_ptr() - lo) < kst:
                vp = flags.data_ptr()
                lo, hi = min(lo, vp), max(hi, vp + es)
                v_off = vp - lo
            return RowLayout((lo, 0), (_batch_stride(k), 0), (kst, 0), (hi - lo, 0), kp - lo, gp - lo, v_off)
    if kst <= width + MAX_GAP and gst <= width + MAX_GAP:
        return RowLayout((kp, gp), (_batch_stride(k), _batch_stride(gate)), (kst, gst), (width, width), 0, 0)
    return (f"k / gate rows are {kst} / {gst} bytes apart for {width}-byte rows (the kernel copies whole rows: at "
            f"most {MAX_GAP} bytes of gap)")


def outside_design(k: torch.Tensor, gate: torch.Tensor, pool: int) -> str | None:
    """Why a call is not one the kernel is written for (device, dtypes, widths), or None."""
    if not k.is_cuda:
        return "not a CUDA tensor"
    if device_capability(cuda_index(k.device))[0] < 8:
        return "needs an sm_80+ GPU (cp.async)"
    if k.dtype not in _ELEM or gate.dtype != k.dtype:
        return f"{k.dtype} keys and {gate.dtype} gates (the kernel takes both bfloat16 or both float16)"
    if k.shape[-1] > src.MAX_CHANNELS:
        return f"{k.shape[-1]} key channels (the kernel takes at most {src.MAX_CHANNELS})"
    if pool > src.MAX_POOL:
        return f"pools of {pool} tokens (the kernel takes at most {src.MAX_POOL})"
    return None


@functools.lru_cache(maxsize=None)
def _shared_limit(index: int) -> int:
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def warps_per_cta(layout: RowLayout, pool: int, index: int) -> int:
    """Warps a CTA holds: up to ``MAX_WARPS``, as many as two stages each of their spans fit the device's shared
    memory (0: not even one)."""
    return _warps_for(_stage_bytes(layout, pool)[0], index)


def _warps_for(stage: int, index: int) -> int:
    return min(src.MAX_WARPS, _shared_limit(index) // (2 * stage))


# The call's problems are worked out once in serving_layout (with its row layout) and handed to the menu.
MENU = cuda_or_triton(_OP, "CUDA pool-forming kernel", "Triton pool-forming kernel",
                      lambda design, why: design, lambda design, why: why)


def serving_layout(k, gate, pool: int, flags=None) -> RowLayout | None:
    """The row layout this kernel forms a call's pools with, or None where the Triton kernel forms them (recorded
    as a fallback as ``ops/_kernel_choice.py`` says). ``flags``: the key flags (``row_layout``); the layout then says in
    ``v_off`` whether ``pools_from_rows`` reads them in the rows. Computed once per call and passed to the launch."""
    requested = envs.pool_kernel()
    if requested == "triton":
        return None
    design = outside_design(k, gate, pool)
    why, layout = design, None
    if why is None:
        layout = row_layout(k, gate, flags)
        why = layout if isinstance(layout, str) else None
        if why is None and layout.spans == 2 and requested == "auto":
            # separate key and gate tensors with 16-byte aligned rows: the Triton kernel's own vector loads are
            # faster there (docs/dsa.md, section 4, "Tuning measurements", "pool keys")
            return None
    if why is None and warps_per_cta(layout, pool, cuda_index(k.device)) == 0:
        why = (f"two stages of a pool's rows ({2 * _stage_bytes(layout, pool)[0]} bytes) exceed the GPU's shared "
               f"memory per block")
    choice = MENU.choose(design, why, requested=requested, refused="fall back")
    return layout if choice.name == "cuda" else None


def choose_kernel(k, gate, pool: int) -> str:
    """"cuda" (this kernel) or "triton" for forming the pools of a call."""
    return "triton" if serving_layout(k, gate, pool) is None else "cuda"


@functools.lru_cache(maxsize=None)
def _source(elem: str, pool: int, d: int, spans: int, mask: int) -> str:
    """The kernels for keys of ``d`` channels: products in 16-bit pairs where D is a multiple of 64 and pools hold
    at most 16 tokens (two channels' weights stay in registers)."""
    return src.kernel_source(elem=elem, pool=pool, channels=32 * cdiv(d, 32), spans=spans, mask=mask,
                             pairs=d % 64 == 0 and pool <= 16)


def _stage_bytes(layout: RowLayout, pool: int) -> tuple[int, int]:
    """(bytes per warp and stage, where span 1 starts in a stage)."""
    first = src.span_area(pool, layout.token_strides[0], layout.widths[0])
    second = src.span_area(pool, layout.token_strides[1], layout.widths[1]) if layout.spans == 2 else 0
    return first + second, first


def pooled_keys_cuda(k, gate, key_valid, ape, first, layout: RowLayout | None = None):
    """(pk [B, NP, D] in k's dtype, pool_valid bool [B, NP]): ``triton_keys.pooled_keys_triton``'s result
    from this kernel, ``key_valid`` None or bool [B, T]. The caller checked ``choose_kernel`` is "cuda" (``layout``:
    the one ``serving_layout`` gave, else worked out here). Raises NvrtcUnavailable."""
    mode = src.MASK_NONE if key_valid is None else src.MASK_INPUT
    return _launch(k, gate, layout or row_layout(k, gate), key_valid, ape, first, mode)


def pools_from_rows(k, gate, flags, ape, layout: RowLayout | None = None):
    """(key_valid bool [B, T], first int64 [B], pk, pool_valid) with the keys' validity read from ``flags`` where
    the layout says they lie in the copied rows (``v_off >= 0``): the first-key kernel, then the pool kernel, which
    writes the mask as it reads the flags (no separate pass over the flags). ``layout``: ``serving_layout``'s with
    these flags, else worked out here. Raises NvrtcUnavailable."""
    b, t_len, _ = k.shape
    key_valid = torch.empty((b, t_len), dtype=torch.bool, device=k.device)
    first = torch.empty(b, dtype=torch.long, device=k.device)
    layout = layout or row_layout(k, gate, flags)
    if b == 0:
        return (key_valid, first, *_launch(k, gate, layout, key_valid, ape, first, src.MASK_FLAGS))
    index = cuda_index(k.device)
    with on_device(index):
        source = _source(_ELEM[k.dtype], ape.shape[0], k.shape[-1], 1, src.MASK_FLAGS)
        kernel = load_kernel(source, src.FIRST_NAME, index, arch=_arch(index), shared_bytes=0)
        kernel.launch((b, 1, 1), src.FIRST_THREADS, [
            ctypes.c_void_p(flags.data_ptr()), ctypes.c_void_p(key_valid.data_ptr()), ctypes.c_void_p(first.data_ptr()),
            ctypes.c_longlong(layout.batch_strides[0]), ctypes.c_longlong(layout.token_strides[0]),
            ctypes.c_int(t_len)])
    return (key_valid, first, *_launch(k, gate, layout, key_valid, ape, first, src.MASK_FLAGS))


def _arch(index: int) -> str:
    return "".join(map(str, device_capability(index)))


def _launch(k, gate, layout: RowLayout, key_valid, ape, first, mode: int):
    pool = ape.shape[0]
    pk, pool_valid = empty_pools(k, pool)
    if pool_valid.numel() == 0:
        return pk, pool_valid
    (b, n_pools), (t_len, d) = pool_valid.shape, k.shape[1:]
    stage, span1_at = _stage_bytes(layout, pool)
    mask = key_valid.view(torch.uint8) if key_valid is not None else pool_valid.view(torch.uint8)  # (unread)
    ape32 = ape.to(torch.float32).contiguous()
    index = cuda_index(k.device)
    warps = _warps_for(stage, index)
    with on_device(index):
        source = _source(_ELEM[k.dtype], pool, d, layout.spans, mode)
        kernel = load_kernel(source, src.KERNEL_NAME, index, arch=_arch(index),
                             shared_bytes=src.shared_bytes(stage, warps))
        ptr = ctypes.c_void_p
        longs = [ctypes.c_longlong(v) for v in (layout.batch_strides[0], layout.token_strides[0],
                                                layout.batch_strides[1], layout.token_strides[1], *mask.stride())]
        ints = [ctypes.c_int(v) for v in (*layout.widths, layout.k_off, layout.g_off, max(layout.v_off, 0), b, t_len,
                                          n_pools, d, stage, span1_at)]
        args = [ptr(layout.bases[0]), ptr(layout.bases[1] or layout.bases[0]), ptr(mask.data_ptr()),
                ptr(ape32.data_ptr()), ptr(first.data_ptr()), ptr(pk.data_ptr()), ptr(pool_valid.data_ptr()),
                *longs, *ints]
        ctas = min(cdiv(b * n_pools, warps), max(1, WARPS_PER_SM // warps) * sm_count(index))
        kernel.launch((ctas, 1, 1), 32 * warps, args)
    return pk, pool_valid


def record_unavailable(exc: Exception) -> None:
    """The chosen kernel could not be built: the call runs the Triton kernel, recorded as a fallback."""
    MENU.after_failure(Choice(MENU.named("cuda")), exc)
