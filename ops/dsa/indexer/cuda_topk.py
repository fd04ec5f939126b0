"""The DSA top-k of a few rows of at most ``MAX_WIDTH`` codes (decode) in one CUDA launch: ``cuda_topk.cu``,
compiled at run time with NVRTC; this module chooses its specialisation and launches it.

The select is the one of ``indexer/triton_topk.py`` (its docstring): an exact radix select over the int32 score codes,
most significant 8-bit digit first, then a compaction in ascending key order with the tie rule (equal codes: lower
key index first), -1 up to ``topk``. The result is defined by that rule alone, so it equals the Triton kernels'
bit for bit (tested). Here one CTA (``THREADS`` threads, twice as many for rows wider than ``WIDE_ROW``) owns
one row, or on sm_90 a cluster of two CTAs owns it (rows wider than ``CLUSTER_MIN_WIDTH`` when two CTAs per row
fit one wave: ``cluster_size``), and keeps it in registers: thread ``t`` of CTA ``r`` holds the codes of columns
``lo + (r * threads + t) * per`` onwards (``per`` = 16 or 32 by the row's width; 16-byte loads where the row
allows), so the key order is the (CTA, thread) order and the compaction is one block-wide scan (plus, in a
cluster, the first CTA's counts added to the second's offsets). A round's 256-bin histogram is built in shared
memory, one per warp (summed after the round), so warps never contend for a bin; a cluster adds its two CTAs'
histograms through distributed shared memory; a round whose chosen bin is wholly in the top-k ends the select.
The Triton row split pays a launch per round (seven launches; the times of both: docs/dsa.md, section 4, "Tuning
measurements", "top-k paths").

Parameters: ``codes, Lo, Hi, out`` (pointers: int32 ``[B, rows, width]``, int64 ``[S]`` visible ranges, int32
``[B, rows, topk]``), the codes' and the output's element strides (long long), ``row0`` (long long: row
``local`` reads ``Lo[row0 + local]``), ``topk`` (int, at least 1), and ``queries, keys`` (long long), ``causal``
(int): with ``Lo`` null the ranges ``reference.visible_ranges`` gives a call without ``cu_seqlens`` (``[0, T)``,
causal rows cut after ``i + T - S``) are computed in the kernel. Grid ``(rows * cluster, B)``.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from kda_compile.ops._common import cdiv, cuda_index, device_capability, on_device, sm_count
from kda_compile.ops._nvrtc import cuda_source, load_kernel

KERNEL_NAME = "dsa_topk_resident"
THREADS = 512
PER_THREAD = (16, 32)  # codes a thread holds
MAX_WIDTH = 32768  # widest row (2 * THREADS threads x 32 codes)
CLUSTER_MIN_WIDTH = 8192  # rows up to this many codes stay on one CTA
WIDE_ROW = 16384  # rows wider than this take CTAs of 2 * THREADS threads (``threads_for``)

def per_thread(width: int, threads: int = THREADS) -> int:
    """Codes a thread holds for rows of ``width`` codes (at most ``MAX_WIDTH``) in one CTA of ``threads``."""
    return next(p for p in PER_THREAD if threads * p >= width)


def threads_for(width: int) -> int:
    """Threads of a CTA for rows of ``width`` codes: ``THREADS``, twice as many for rows wider than
    ``WIDE_ROW`` (at 16k and below the smaller CTA is as fast or faster; docs/dsa.md, section 4, "Tuning measurements",
    "top-k paths")."""
    return 2 * THREADS if width > WIDE_ROW else THREADS


def cluster_size(width: int, grid_rows: int, sms: int) -> int:
    """CTAs per row: two (a cluster, the row's halves, histograms and counts exchanged through distributed shared
    memory) for rows wider than ``CLUSTER_MIN_WIDTH`` when two CTAs per row still fit one wave, else one."""
    return 2 if width > CLUSTER_MIN_WIDTH and 2 * grid_rows <= sms else 1


@functools.lru_cache(maxsize=None)
def kernel_source(per: int, cluster: int = 1, threads: int = THREADS) -> str:
    if per not in PER_THREAD:
        raise ValueError(f"per must be one of {PER_THREAD}, got {per}")
    if cluster not in (1, 2):
        raise ValueError(f"cluster must be 1 or 2, got {cluster}")
    return f"#define THREADS {threads}\n#define PER {per}\n#define CLUSTER {cluster}\n" + cuda_source(
        __package__, "cuda_topk.cu")


def topk_kernel(device_index: int, width: int, cluster: int = 1):
    """The compiled kernel for rows of ``width`` codes cut among ``cluster`` CTAs; the caller has made the device
    current. Raises NvrtcUnavailable."""
    major, minor = device_capability(device_index)
    threads = threads_for(width)
    return load_kernel(kernel_source(per_thread(cdiv(width, cluster), threads), cluster, threads), KERNEL_NAME,
                       device_index, arch=f"{major}{minor}", shared_bytes=0)


def launch(codes: torch.Tensor, lo: torch.Tensor | None, hi: torch.Tensor | None, row0: int, topk: int,
           out: torch.Tensor, *, implicit: tuple[int, int, bool] | None = None) -> None:
    """``out`` (int32 ``[B, rows, topk]``, any strides) = the top-k of ``codes`` (int32 ``[B, rows, width]``, width at
    most ``MAX_WIDTH``, any strides) as ``triton_topk.topk_from_codes`` defines it; row ``r`` sees the columns
    ``[lo[row0 + r], hi[row0 + r])`` (``[S]``, at most ``width``), or, with ``lo`` and ``hi`` None, the ranges
    ``reference.visible_ranges(S, T, causal, None)`` for ``implicit = (S, T, causal)``, computed in the kernel.
    Raises NvrtcUnavailable."""
    b, rows, width = codes.shape
    if codes.dtype != torch.int32 or out.dtype != torch.int32 or width > MAX_WIDTH or topk < 1:
        raise ValueError(f"the CUDA top-k takes int32 codes of at most {MAX_WIDTH} columns, an int32 output and "
                         f"topk >= 1, got {codes.dtype} codes of {width} columns, {out.dtype} output, topk={topk}")
    if lo is None:
        if implicit is None:
            raise ValueError("the CUDA top-k needs lo / hi or implicit = (queries, keys, causal)")
        queries, keys, causal = implicit
        range_ptrs = [ctypes.c_void_p(0), ctypes.c_void_p(0)]
    else:
        lo, hi = (t.to(torch.int64).contiguous() for t in (lo, hi))  # (already so from the indexer: no copy)
        queries, keys, causal = 0, 0, False
        range_ptrs = [ctypes.c_void_p(lo.data_ptr()), ctypes.c_void_p(hi.data_ptr())]
    index = cuda_index(codes.device)
    major = device_capability(index)[0]
    cluster = cluster_size(width, b * rows, sm_count(index)) if major >= 9 else 1  # clusters: sm_90 and later
    with on_device(index):
        kernel = topk_kernel(index, width, cluster)
        args = [ctypes.c_void_p(codes.data_ptr()), *range_ptrs, ctypes.c_void_p(out.data_ptr()),
                *[ctypes.c_longlong(s) for s in (*codes.stride(), *out.stride())], ctypes.c_longlong(row0),
                ctypes.c_int(topk), ctypes.c_longlong(queries), ctypes.c_longlong(keys), ctypes.c_int(int(causal))]
        kernel.launch((rows * cluster, b, 1), threads_for(width), args)
