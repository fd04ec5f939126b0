"""The plan of a KDA / GDN prefill: how many segments the Triton scan takes, and whether the CUDA scan (with the
CUDA prepare before it) is ahead of it, by one cost model in units of the Triton scan's chunk step.

``run.py`` launches what this decides; ``fast_path.py`` asks the same questions once per plan. Segments: one long
sequence with few heads is cut into ``P`` pieces that run in parallel (their summaries first), so that the scan
fills the GPU; ``choose_segments`` picks the cheapest ``P`` by ``segment_cost`` from the SM count at run time, and
``KDA_COMPILE_PREFILL_SEGMENTS`` overrides it (tuning and benchmarks). The CUDA scan (one segment, one CTA per SM,
``cuda_scan_cost``) runs where the model puts it at or below the Triton scan's best (``cuda_scan_is_faster``).
Measurements behind the model's constants: docs/kda-kernels.md sections 3 and 5.
"""
from __future__ import annotations

import math

import torch
import triton

from kda_compile.ops import envs
from kda_compile.ops._common import cuda_index, sm_count, triton_interpreted as _interpreted
from kda_compile.ops._nvrtc import NvrtcUnavailable
from kda_compile.ops.kda.prefill.chunks import CHUNK
from kda_compile.ops.kda.prefill.cuda.prepare import kernel_for as prepare_kernel_for
from kda_compile.ops.kda.prefill.cuda.scan import STEP_COST as CUDA_STEP_COST
from kda_compile.ops.kda.prefill.cuda.scan import block_v_for as cuda_block_v
from kda_compile.ops.kda.prefill.cuda.scan import choose_scan_kernel, scan_kernel, scan_waves
from kda_compile.ops.kda.prefill.cuda.scan import outside_design as scan_outside_design

SEGMENTS_ENV = envs.PREFILL_SEGMENTS
# Programs of the scan / summary kernel counted per SM by the segment cost model: an effective value fitted to
# measured segment sweeps (docs/kda-kernels.md section 3), not an occupancy count (offline sm_90 compiles give one
# resident program of 8 warps, but the model with 1 picks too few segments for one long sequence).
SCAN_RESIDENT = 2
MAX_SEGMENTS = 16
MIN_SEGMENT_CHUNKS = 8  # shorter segments are not worth their summaries


def pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def state_block(K: int, V: int, bf16: bool) -> int:
    """BV of the scan (and BX of the segment summaries): the fp32 state tile ``[pow2(K), BV]`` stays at
    <= 32 KiB (64 regs/thread at 4 warps). Never below 32 columns (columns past V are masked): a fp32 (TF32)
    run with BV = 16 and two segments returned wrong outputs after the first segment on the GPU, right under
    the interpreter (docs/kda-kernels.md section 3). bf16 products always take 64: narrower bf16
    blocks need two pipeline stages (``_scan_configs``), which K = 256 cannot afford."""
    if _interpreted():
        return min(32, pow2(V))
    if bf16:
        return 64
    return max(32, min(pow2(V), 64 if pow2(K) <= 128 else 32))


def segment_cost(num_seqs: int, heads: int, v_blocks: int, x_blocks: int, chunks: int, sm_count: int, P: int, *,
                 first_x_blocks: int | None = None, resident: int = SCAN_RESIDENT) -> float:
    """The Triton scan with P segments in units of one of its chunk steps (4 products of ``[64, K] x [K, BV]``):
    a summary step costs about half of one (2 products; docs/kda-kernels.md section 3), applying
    one earlier segment's summary about one. Programs run in waves of ``sm_count * resident``.
    ``first_x_blocks``: the summary programs of segment 0 (fewer when it needs no ``M``, ``summary_x_blocks``;
    default ``x_blocks``)."""
    slots = sm_count * resident
    first = x_blocks if first_x_blocks is None else first_x_blocks
    per = math.ceil(chunks / P)
    scan = math.ceil(num_seqs * heads * v_blocks * P / slots) * (per + (P - 1))
    if P == 1:
        return float(scan)
    summaries = num_seqs * heads * (first + x_blocks * (P - 2))
    return scan + math.ceil(summaries / slots) * per * 0.5


def cuda_scan_cost(num_seqs: int, heads: int, chunks: int, sm_count: int) -> float:
    """The CUDA scan (one segment, one CTA per SM) in ``segment_cost``'s units."""
    block_v = cuda_block_v(num_seqs * heads, sm_count)
    return scan_waves(num_seqs * heads, block_v, sm_count) * chunks * CUDA_STEP_COST[block_v]


def _best_segments(num_seqs: int, heads: int, v_blocks: int, x_blocks: int, chunks: int, sm_count: int | None, *,
                   first_x_blocks: int | None, resident: int, max_segments: int, min_chunks: int) -> tuple[float, int]:
    """(cost, P) of the cheapest segment count by ``segment_cost``; (nan, 1) without an SM count."""
    if sm_count is None:
        return math.nan, 1
    candidates = [P for P in range(1, max_segments + 1)
                  if P == 1 or (chunks > min_chunks and math.ceil(chunks / P) >= min_chunks)]
    return min((segment_cost(num_seqs, heads, v_blocks, x_blocks, chunks, sm_count, P, first_x_blocks=first_x_blocks,
                             resident=resident), P) for P in candidates)


def choose_segments(num_seqs: int, heads: int, v_blocks: int, x_blocks: int, chunks: int, sm_count: int | None,
                    *, first_x_blocks: int | None = None, resident: int = SCAN_RESIDENT,
                    max_segments: int = MAX_SEGMENTS, min_chunks: int = MIN_SEGMENT_CHUNKS) -> int:
    """How many segments to cut each sequence into (1 = the plain recurrence): the cheapest by
    ``segment_cost``. Segments shorter than ``min_chunks`` chunks are not worth their summaries."""
    return _best_segments(num_seqs, heads, v_blocks, x_blocks, chunks, sm_count, first_x_blocks=first_x_blocks,
                          resident=resident, max_segments=max_segments, min_chunks=min_chunks)[1]


def summary_x_blocks(K: int, V: int, BX: int, has_initial_state: bool) -> int:
    """Column blocks of segment 0's summary that run: all ``cdiv(K + V, BX)``, or without an initial
    state (the state entering segment 1 is then ``C_0`` alone) only those that hold ``C`` columns."""
    return triton.cdiv(K + V, BX) - (0 if has_initial_state else K // BX)


def chunks_per_sequence(T: int, N: int, varlen: bool) -> int:
    return triton.cdiv(T, CHUNK * N) if varlen else triton.cdiv(T, CHUNK)


def device_sms(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return sm_count(cuda_index(device))


def scan_segments(device: torch.device, N: int, HV: int, v_blocks: int, x_blocks: int, first_x_blocks: int, T: int,
                  varlen: bool, segments: int | None) -> int:
    """The Triton scan's segment count: ``segments`` if given, else ``KDA_COMPILE_PREFILL_SEGMENTS``, else
    ``choose_segments`` from the SM count (1 off CUDA)."""
    if segments is None:
        segments = envs.prefill_segments()
    if segments is None:
        segments = choose_segments(N, HV, v_blocks, x_blocks, chunks_per_sequence(T, N, varlen), device_sms(device),
                                   first_x_blocks=first_x_blocks)
    return max(1, int(segments))


def cuda_scan_is_faster(device: torch.device, N: int, HV: int, K: int, V: int, T: int, varlen: bool,
                        has_initial_state: bool) -> bool:
    """Whether the CUDA scan (one segment) beats the Triton scan at its automatic segment count by the cost
    model: it does unless few (sequence, head) pairs leave most SMs idle over a long sequence (1 x 65536 x 16:
    32 CTAs; docs/kda-kernels.md section 5)."""
    sm_count = device_sms(device)
    if sm_count is None:
        return False
    BX = state_block(K, V, bf16=True)  # the CUDA scan takes bf16 intermediates only
    v_blocks, x_blocks = triton.cdiv(V, BX), triton.cdiv(K + V, BX)
    chunks = chunks_per_sequence(T, N, varlen)
    triton_cost, _ = _best_segments(N, HV, v_blocks, x_blocks, chunks, sm_count,
                                    first_x_blocks=summary_x_blocks(K, V, BX, has_initial_state),
                                    resident=SCAN_RESIDENT, max_segments=MAX_SEGMENTS, min_chunks=MIN_SEGMENT_CHUNKS)
    return cuda_scan_cost(N, HV, chunks, sm_count) <= triton_cost


def cuda_pair_served(q, v, g, beta, initial_state, cu_seqlens, *, T: int, N: int, segments: int | None,
                     output_final_state: bool, prepare_args: dict) -> bool:
    """Whether a call whose prepare runs on the CUDA kernel (launch keywords ``prepare_args``) runs the CUDA scan
    after it: the scan it would choose (``choose_scan_kernel``, same cost model), with both kernels loaded. A kernel
    that cannot be built answers False (the ordinary pair then runs, or records its own fallback). The CUDA scan
    zeroes ``o``'s rows past the last sequence itself. With a scalar gate (GDN) the pair is asked in its
    ``row_factors`` form (``ROW_FACTORS`` in ``prepare_args``): the prepare writes each row's q / k factors instead
    of the ``qg`` / ``kd`` tiles (two of its five ``[T, HV, 128]`` outputs) and the scan reads the raw q / k, which
    the value heads of one q/k head share."""
    HV, K, V = v.shape[-2], q.shape[-1], v.shape[-1]
    varlen = cu_seqlens.numel() > 0
    segments_asked = segments is not None or envs.prefill_segments() is not None
    design = dict(num_seqs=N, gate_cumsum=False, writes_chunk_states=False, writes_o=True)
    if scan_outside_design(q, v, initial_state, cu_seqlens, **design) is not None:
        return False  # (a forced CUDA scan records its fallback once, in launch_scan)
    choice = choose_scan_kernel(
        q, v, initial_state, cu_seqlens, **design, segments_asked=segments_asked,
        cuda_faster=lambda: cuda_scan_is_faster(q.device, N, HV, K, V, T, varlen, initial_state is not None))
    if choice != "cuda":
        return False
    index = cuda_index(q.device)
    cu_dtype = cu_seqlens.dtype if varlen else None
    try:
        prepare_kernel_for(index, g.dtype, beta.dtype, cu_dtype, prepare_args)
        scan_kernel(index, cu_dtype, initial_state is not None, output_final_state,
                    cuda_block_v(N * HV, device_sms(q.device)), row_factors=bool(prepare_args.get("ROW_FACTORS")))
    except NvrtcUnavailable:
        return False
    return True
