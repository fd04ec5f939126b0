"""The chunk plan of packed sequences on the GPU, in one launch (compiled with NVRTC).

From ``cu_seqlens`` (``[N + 1]`` int32 / int64, on the device) it writes ``chunk_offsets`` (``[N + 1]`` int32:
the first 64-token chunk slot of each sequence, ``chunk_offsets[i + 1] - chunk_offsets[i] = ceil(len_i / 64)``,
what ``chunks.first_chunk_slots`` computes with five small PyTorch kernels): one block of 1024 threads scans the
lengths a tile at a time, so any N. Launch plans run it before our CUDA prepare and scan with more than
``cuda_prepare_source.INLINE_SEQS`` sequences (with fewer the two kernels find their chunks from ``cu_seqlens``
alone). Offsets are not checked here (negative lengths count as empty; ``chunk_kda``'s
``check_inputs`` is the place for bad offsets).

Parameters: ``cu_seqlens, chunk_offsets`` (pointers), ``N`` (int).
"""
from __future__ import annotations

import functools

import torch

from kda_compile.ops._common import device_capability
from kda_compile.ops._nvrtc import load_kernel
from kda_compile.ops.kda.chunks import CUDA_CHUNK_COUNT
from kda_compile.ops.kda.cuda_choice import CU_TYPES as _CU

KERNEL_NAME = "kda_chunk_plan"
THREADS = 1024

_BODY = r"""
extern "C" __global__ void kda_chunk_plan(const CU_T* __restrict__ cu_seqlens, int* __restrict__ chunk_offsets, int N)
{
    __shared__ int warp_prefix[32];
    __shared__ int carry;
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5, warps = blockDim.x >> 5;
    if (tid == 0) { chunk_offsets[0] = 0; carry = 0; }
    __syncthreads();
    for (int base = 0; base < N; base += blockDim.x) {
        const int i = base + tid;
        int x = 0;
        if (i < N) {
            x = chunk_count((long long)cu_seqlens[i + 1] - (long long)cu_seqlens[i]);
        }
        for (int off = 1; off < 32; off <<= 1) {  // inclusive scan in the warp
            const int y = __shfl_up_sync(0xffffffffu, x, off);
            if (lane >= off) x += y;
        }
        if (lane == 31) warp_prefix[wp] = x;
        __syncthreads();
        if (wp == 0) {  // inclusive scan of the warp totals
            int t = lane < warps ? warp_prefix[lane] : 0;
            for (int off = 1; off < 32; off <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, t, off);
                if (lane >= off) t += y;
            }
            if (lane < warps) warp_prefix[lane] = t;
        }
        __syncthreads();
        const int prefix = carry + (wp > 0 ? warp_prefix[wp - 1] : 0) + x;
        if (i < N) chunk_offsets[i + 1] = prefix;
        __syncthreads();  // every thread has read carry
        if (tid == blockDim.x - 1) carry = prefix;
        __syncthreads();
    }
}
"""


@functools.lru_cache(maxsize=None)
def _source(cu_type: str) -> str:
    return f"#define CU_T {cu_type}\n" + CUDA_CHUNK_COUNT + _BODY


def chunk_plan_kernel(device_index: int, cu_dtype: torch.dtype):
    """The compiled kernel for offsets of ``cu_dtype`` (int32 / int64); the caller has made the device current.
    Raises NvrtcUnavailable."""
    major, minor = device_capability(device_index)
    return load_kernel(_source(_CU[cu_dtype]), KERNEL_NAME, device_index, arch=f"{major}{minor}", shared_bytes=0)

