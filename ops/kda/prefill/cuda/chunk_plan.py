"""The chunk plan of packed sequences on the GPU, in one launch (compiled with NVRTC).

From ``cu_seqlens`` (``[N + 1]`` int32 / int64, on the device) it writes ``chunk_offsets`` (``[N + 1]`` int32:
the first 64-token chunk slot of each sequence, ``chunk_offsets[i + 1] - chunk_offsets[i] = ceil(len_i / 64)``,
what ``chunks.first_chunk_slots`` computes with five small PyTorch kernels): one block of 1024 threads scans the
lengths a tile at a time, so any N. Launch plans run it before our CUDA prepare and scan with more than
``prepare_source.INLINE_SEQS`` sequences (with fewer the two kernels find their chunks from ``cu_seqlens``
alone). Offsets are not checked here (negative lengths count as empty; ``chunk_kda``'s
``check_inputs`` is the place for bad offsets).

Its launch (grid, block, parameters): ``launch.CHUNK_PLAN``.
"""
from __future__ import annotations

import functools

import torch

from kda_compile.ops._common import device_capability
from kda_compile.ops._nvrtc import cuda_source, load_kernel
from kda_compile.ops.kda.prefill.cuda.choice import CU_TYPES as _CU

KERNEL_NAME = "kda_chunk_plan"
THREADS = 1024

@functools.lru_cache(maxsize=None)
def _source(cu_type: str) -> str:
    return f"#define CU_T {cu_type}\n" + cuda_source(__package__, "chunk_plan.cu")


def chunk_plan_kernel(device_index: int, cu_dtype: torch.dtype):
    """The compiled kernel for offsets of ``cu_dtype`` (int32 / int64); the caller has made the device current.
    Raises NvrtcUnavailable."""
    major, minor = device_capability(device_index)
    return load_kernel(_source(_CU[cu_dtype]), KERNEL_NAME, device_index, arch=f"{major}{minor}", shared_bytes=0)

