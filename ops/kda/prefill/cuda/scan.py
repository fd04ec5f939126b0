"""Which kernel runs the KDA prefill's recurrence on CUDA, and the launcher of the CUDA one.

- ``cuda`` (``prefill/cuda/scan_source.py``, compiled by NVRTC): sm_90 or newer (``stmatrix``), bf16 intermediates,
  K = V = 128, our own prepare kernel's formats (not FLA's), ``o`` and the final state as outputs (FLA's chunk
  states are not written), an fp32 initial state. One segment: the whole sequence in one program per value block.
- ``triton`` (``prefill/triton/scan.py``): every call; cuts long sequences into segments (``choose_segments``).

``KDA_COMPILE_SCAN_KERNEL`` = ``auto`` (default) | ``triton`` | ``cuda`` overrides the choice (``cuda`` still
runs Triton, logged, on calls outside the kernel's design). In ``auto`` the CUDA kernel takes the calls it is
written for where the segment cost model (``plan.cuda_scan_is_faster``) puts it ahead of the Triton
scan's segments (not when a segment count was asked for): every anchor shape but the single 65536-token
sequence with 16 heads. A call it would take that cannot run it (NVRTC missing or failing) runs Triton and is
recorded as a fallback (logged once, shown by the rewrite report).
"""
from __future__ import annotations

import functools

import torch

from kda_compile.ops import envs
from kda_compile.ops._common import cuda_index, device_capability, on_device, record_fallback
from kda_compile.ops._nvrtc import NvrtcUnavailable, load_kernel
from kda_compile.ops.kda.prefill.cuda.choice import CU_TYPES as _CU
from kda_compile.ops.kda.prefill.cuda.choice import device_unsupported
from kda_compile.ops.kda.prefill.cuda import scan_source as src
from kda_compile.ops.kda.prefill.cuda.launch import SCAN, scan_scalars

KERNEL_ENV = envs.SCAN_KERNEL
_OP = "chunk_kda"
MAX_SEQUENCES = 65535  # the grid's z dimension
STAGES = 2  # chunks of tiles in shared memory (scan_source.shared_bytes); 3 are no faster (docs/kda-kernels.md, 8)


# One chunk step of the kernel in the segment cost model's units (``plan.segment_cost``: one step of the Triton
# scan), per value columns a CTA, one CTA per SM: measured step times against the Triton scan's, docs/kda-kernels.md
# section 5.
STEP_COST = {32: 0.28, 64: 0.31, 128: 0.53}


def block_v_for(pairs: int, sm_count: int) -> int:
    """Value columns per CTA for ``pairs`` (sequence, head) pairs: the count whose waves of CTAs (one CTA per SM,
    ``128 / block_v`` CTAs a pair) cost least by ``STEP_COST`` (the smaller on a tie). Few pairs take 32 (more
    CTAs, shorter steps); up to two CTAs of 64 a pair per wave, 64; more pairs 128, one CTA of 8 warps a pair, whose
    w / qg / kd tiles are then loaded once instead of once per CTA (docs/kda-kernels.md section 8)."""
    return min(STEP_COST, key=lambda bv: (scan_waves(pairs, bv, sm_count) * STEP_COST[bv], bv))


def scan_waves(pairs: int, block_v: int, sm_count: int) -> int:
    """Waves of the kernel's CTAs (one resident per SM) for ``pairs`` (sequence, head) pairs."""
    return -(-pairs * (src.HEAD_DIM // block_v) // sm_count)


def requested_kernel() -> str:
    return envs.scan_kernel()


def outside_design(w, u, initial_state, cu_seqlens, *, num_seqs: int, gate_cumsum: bool, writes_chunk_states: bool,
                   writes_o: bool) -> str | None:
    """Why the scan call is not one the CUDA kernel is written for, or None."""
    why = device_unsupported(w, min_capability=(9, 0), needs="bf16 mma.sync and stmatrix")
    if why is not None:
        return why
    if w.dtype != torch.bfloat16:
        return f"the intermediates are {w.dtype} (the kernel takes bfloat16)"
    if w.shape[-1] != src.HEAD_DIM or u.shape[-1] != src.HEAD_DIM:
        return f"K = {w.shape[-1]}, V = {u.shape[-1]} (the kernel takes 128 / 128)"
    if gate_cumsum:
        return "FLA's intermediates (gate cumsum format)"
    if writes_chunk_states or not writes_o:
        return "FLA's chunk states are asked for (the kernel writes o and the final state only)"
    if initial_state is not None and initial_state.dtype != torch.float32:
        return f"the initial state is {initial_state.dtype} (the kernel takes float32)"
    if cu_seqlens.numel() and cu_seqlens.dtype not in _CU:
        return f"cu_seqlens is {cu_seqlens.dtype} (the kernel takes int32 or int64)"
    if num_seqs > MAX_SEQUENCES:
        return f"{num_seqs} sequences (the kernel's grid takes at most {MAX_SEQUENCES})"
    return None


def choose_scan_kernel(w, u, initial_state, cu_seqlens, *, num_seqs: int, gate_cumsum: bool,
                       writes_chunk_states: bool, writes_o: bool, segments_asked: bool, cuda_faster) -> str:
    """"cuda" or "triton" for this scan (module docstring); a forced ``cuda`` outside the design is logged as
    a fallback. ``cuda_faster``: a callable, the cost model's verdict (asked only in ``auto``)."""
    requested = requested_kernel()
    if requested == "triton" or (requested == "auto" and segments_asked):
        return "triton"
    why = outside_design(w, u, initial_state, cu_seqlens, num_seqs=num_seqs, gate_cumsum=gate_cumsum,
                         writes_chunk_states=writes_chunk_states, writes_o=writes_o)
    if why is None:
        return "cuda" if requested == "cuda" or cuda_faster() else "triton"
    if requested == "cuda":
        record_fallback(_OP, "Triton scan kernel", f"the CUDA scan kernel cannot run this call: {why}")
    return "triton"


@functools.lru_cache(maxsize=None)
def _source(cu_dtype: str, varlen: bool, has_h0: bool, store_ht: bool, stages: int, block_v: int,
            row_factors: bool = False) -> str:
    return src.kernel_source(cu_dtype=cu_dtype, varlen=varlen, has_h0=has_h0, store_ht=store_ht, stages=stages,
                             block_v=block_v, row_factors=row_factors)


def scan_kernel(device_index: int, cu_dtype: torch.dtype | None, has_h0: bool, store_ht: bool, block_v: int,
                row_factors: bool = False):
    """The compiled kernel for one specialisation (compiled and loaded on first use; ``_nvrtc.load_kernel``);
    ``cu_dtype``: the offsets' dtype with packed sequences, else None; ``row_factors``: the scalar-gate form that
    reads the raw q / k and the rows' factors (``scan_source.kernel_source``). The caller has made the device
    current. Raises NvrtcUnavailable."""
    major, minor = device_capability(device_index)
    varlen = cu_dtype is not None
    source = _source(_CU.get(cu_dtype, "int") if varlen else "int", varlen, has_h0, store_ht, STAGES, block_v,
                     row_factors)
    return load_kernel(source, SCAN.kernel, device_index, arch=f"{major}{minor}",
                       shared_bytes=SCAN.shared_bytes(STAGES, block_v, row_factors))


def launch_scan_cuda(w, u, qg, kd, a_qk, decay, o, initial_state, final, cu_seqlens, chunk_offsets, *, T: int,
                     N: int, block_v: int, factors=None) -> None:
    """Run the CUDA scan: ``o`` (and ``final`` when given) from our prepare kernel's intermediates (the
    caller checked ``outside_design`` is None), ``block_v`` value columns per CTA (``block_v_for``). With
    ``factors`` (the scalar-gate prepare's ``row_factors`` output, ``[slots, HV, 2, 64]`` fp32) ``qg`` / ``kd`` are
    the raw, contiguous q / k ``[..., H, 128]``. With packed sequences the kernel zeroes ``o``'s rows past the last
    sequence (``o`` need not start zeroed); with at most ``INLINE_SEQS`` of them it counts their chunks from
    ``cu_seqlens`` and does not read ``chunk_offsets``. Raises NvrtcUnavailable when the kernel cannot be built."""
    device_index = cuda_index(w.device)
    HV = w.shape[-2]
    H = qg.shape[-2] if factors is not None else HV
    varlen = cu_seqlens.numel() > 0
    has_h0, store_ht = initial_state is not None, final is not None
    h0_strides = initial_state.stride() if has_h0 else (0, 0, 0, 0)
    with on_device(device_index):
        kernel = scan_kernel(device_index, cu_seqlens.dtype if varlen else None, has_h0, store_ht, block_v,
                             row_factors=factors is not None)
        params = SCAN.params([t.data_ptr() for t in (w, u, qg, kd, a_qk, decay, o, initial_state if has_h0 else w,
                                                     final if store_ht else w, cu_seqlens if varlen else w,
                                                     chunk_offsets if varlen else w,
                                                     factors if factors is not None else w)],
                             scan_scalars(T, HV, H, h0_strides))
        if N * HV:
            kernel.launch(SCAN.grid(block_v, HV, N), SCAN.threads(block_v), params)


def run_or_fall_back(*args, **kwargs) -> bool:
    """``launch_scan_cuda``; False (with the fallback recorded) when the kernel cannot be built."""
    try:
        launch_scan_cuda(*args, **kwargs)
        return True
    except NvrtcUnavailable as exc:
        record_fallback(_OP, "Triton scan kernel", f"the CUDA scan kernel could not be built: {exc}")
        return False
