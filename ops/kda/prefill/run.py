"""The run of a KDA / GDN prefill forward (what ``plan.py`` decides, launched): launchers for the prepare kernel
(``prefill/triton/prepare.py``) and the recurrence / affine-segment scan (``prefill/triton/scan.py``).

``chunk_kda_prefill`` computes ``chunk_kda``'s forward (FLA contract, kda.md section 3), and with ``scalar_gate``
GDN's (``ops/gdn/prefill/run.py``: the gate's form selects the prepare kernel's pass 1, nothing else), in two
launches (three when the scan is split into segments):

1. prepare, grid (chunks, HV): q/k L2 norm, gate, beta sigmoid, chunk cumsum, the intra-chunk
   ``A`` blocks and their triangular inverse on chip; writes ``w, u, qg, kd, A_qk, decay`` (with the scalar gate
   and both CUDA kernels, the rows' q / k factors instead of ``qg, kd``: ``cuda_pair_served``);
2. (segments only) summaries ``[M | C]`` of every segment but the last, grid (columns, HV, N, P - 1);
3. scan, grid (V blocks, HV, N, P): the fp32 state walks the chunks and writes ``o`` and the final state.

The number of segments ``P`` and the choice of the CUDA scan are the plan's (``plan.py``: ``scan_segments``,
``cuda_pair_served``).

For bf16, K = V = 128 the prepare step (``prefill/cuda/prepare.py``) and the recurrence (``prefill/cuda/scan.py``,
one segment) have CUDA kernels; the recurrence takes it where the plan's cost model puts it ahead of the Triton scan's
segments (``plan.cuda_scan_is_faster``).

Device-agnostic (no ``torch.cuda`` calls beyond the SM count), so the same launchers run on CPU tensors
under ``TRITON_INTERPRET=1`` with one fixed small config; on CUDA a short autotune list per kernel.
Intermediates are in the input dtype (fp32 for fp32 inputs); bf16 inputs take bf16 tensor-core
products with fp32 accumulation (as FLA), fp16 and fp32 inputs take fp32 operands (TF32 on CUDA).
"""
from __future__ import annotations

import math
from functools import cache

import torch
import triton

from kda_compile.ops import envs
from kda_compile.ops._common import triton_interpreted as _interpreted
from kda_compile.ops.kda.prefill.chunks import CHUNK, chunks_in, first_chunk_slots, packed_slot_bound
from kda_compile.ops.kda.prefill.cuda.prepare import choose_prepare_kernel, launch_prepare, run_or_fall_back
from kda_compile.ops.kda.prefill.cuda.prepare_source import INLINE_SEQS
from kda_compile.ops.kda.prefill.cuda.scan import block_v_for as cuda_block_v
from kda_compile.ops.kda.prefill.cuda.scan import choose_scan_kernel, launch_scan_cuda
from kda_compile.ops.kda.prefill.cuda.scan import run_or_fall_back as run_scan_cuda
from kda_compile.ops.kda.prefill.plan import (SEGMENTS_ENV, cuda_pair_served, cuda_scan_is_faster, device_sms, pow2,
                                              scan_segments, state_block, summary_x_blocks)
from kda_compile.ops.kda.triton_common import GATE_LOWER_BOUND, GATE_PRECOMPUTED, GATE_SOFTPLUS
from kda_compile.ops.kda.prefill.triton.prepare import exact_diagonal_needed, kda_prepare_kernel
from kda_compile.ops.kda.prefill.triton.scan import kda_chunk_scan_kernel, kda_segment_summary_kernel

MAX_HEAD_DIM = 256


# ------------------------------------------------------------------------------------------------
# Launch configurations
# ------------------------------------------------------------------------------------------------


def _scan_configs(configs, named_args, **kwargs):
    """Launch configurations the scan and summary kernels may use, best first (``early_config_prune``).

    - bf16 products with a state block of <= 32 columns and ``num_stages=1`` are miscompiled by Triton
      3.6 on sm_90: wrong outputs (relative error ~1) or an illegal memory access
      for BK = 64 at 4 warps and BK = 128 at 8 warps, while 2 stages and BV = 64 are right everywhere
      (docs/kda-kernels.md section 3). Those configurations are never used.
    - bf16 with BK <= 128: 8 warps with 2 stages leads (docs/kda-kernels.md section 8).
    - BK = 256 needs one stage (two exceed the 227 KiB of shared memory).
    ``state_block`` gives bf16 BV = 64, so the first rule is a guard against a narrower choice there.
    """
    args = {**named_args, **kwargs}
    bf16, width, wide_k = bool(args["DOT_BF16"]), args.get("BV", args.get("BX")), args["BK"] > 128
    usable = [c for c in configs if not (bf16 and width <= 32 and c.num_stages == 1)
              and not (wide_k and c.num_stages > 1)]
    preferred = 2 if bf16 and not wide_k else 1
    return sorted(usable, key=lambda c: c.num_stages != preferred)  # stable: the list order otherwise


@cache
def _tuned(kernel_name: str):
    """The CUDA kernels wrapped in a small autotuner (compile time matters: 3 configs each).

    tests/conftest.py makes every autotuner run only the first config during tests, so each list
    starts with a safe default."""
    # The prepare kernel (offline sm_90 compiles with ptxas, all 4 warps): 16-channel K slices lay each
    # 16-row block inside one warp (docs/kda-kernels.md section 2.1) and spill at most
    # 56 B over every dtype, K <= 256, pass-2 slice and flag combination, so they lead; pass 2 in 64- or
    # 128-column slices; 32-channel slices with one stage as the third. Which is fastest is for the GPU to
    # say (autotuned).
    # The scan spills at 4 warps for K >= 128 and needs > 227 KiB of shared memory with 3 stages (and
    # for K = 256 bf16 with 2): 8 warps lead; the stage count depends on dtype and K (_scan_configs).
    if kernel_name == "prepare":
        configs = [triton.Config({"BKC": 16, "BWC": 64}, num_warps=4, num_stages=1),
                   triton.Config({"BKC": 16, "BWC": 128}, num_warps=4, num_stages=1),
                   triton.Config({"BKC": 32, "BWC": 128}, num_warps=4, num_stages=1)]
        key = ["H", "HV", "K", "V", "GATE", "EXACT_DIAGONAL", "L2NORM", "SAVE_AKK"]
        return triton.autotune(configs, key=key)(kda_prepare_kernel)
    stages = [triton.Config({}, num_warps=8, num_stages=1), triton.Config({}, num_warps=8, num_stages=2),
              triton.Config({}, num_warps=4, num_stages=1)]
    kernel = kda_chunk_scan_kernel if kernel_name == "scan" else kda_segment_summary_kernel
    key = ["HV", "K", "V", "BK", "DOT_BF16", "BV" if kernel_name == "scan" else "BX", "GATE_CUMSUM"]
    if kernel_name == "scan":
        key += ["STORE_O", "STORE_STATES"]
    return triton.autotune(stages, key=key, prune_configs_by={"early_config_prune": _scan_configs})(kernel)


def _precisions(dtype: torch.dtype):
    """(DOT_BF16, dot precision, solve precision, combine precision) for the input dtype."""
    if _interpreted():  # the interpreter computes every product in fp32; "tf32x3" runs the split code
        return dtype == torch.bfloat16, "ieee", "tf32x3", "ieee"
    # fp32 products of the chunk algorithm run as TF32 (FLA does the same); the block merges of the
    # triangular solve (they carry the ill-conditioned cases) and the segment combine use 3xTF32,
    # about fp32 accuracy on tensor cores.
    return dtype == torch.bfloat16, "tf32", "tf32x3", "tf32x3"


def _fp32_buffer(like: torch.Tensor, *shape: int) -> torch.Tensor:
    """Uninitialised fp32 workspace (the tests fill it with NaN to prove nothing unwritten is read)."""
    return like.new_empty(shape, dtype=torch.float32)


def launch_scan(w, u, qg, kd, a_qk, decay, initial_state, cu_seqlens, chunk_offsets, *, T: int, N: int,
                segments: int | None, o=None, final=None, h=None, v_new=None, scale: float = 1.0,
                gate_cumsum: bool = False) -> None:
    """The recurrence over a chunk pass's tensors (ours, or FLA's with ``gate_cumsum``: ``decay`` is then
    the gate cumsum and ``scale`` scales the inter-chunk product; ``prefill/triton/scan.py``), cut into
    ``scan_segments`` segments (their summaries first). Writes the outputs given: ``o``, ``final``, and
    ``h`` with ``v_new`` (FLA's chunk states); ``qg`` / ``a_qk`` are read only for ``o``. ``cu_seqlens`` /
    ``chunk_offsets``: int tensors, or empty ones without packed sequences."""
    HV, K, V = w.shape[-2], w.shape[-1], u.shape[-1]
    varlen = cu_seqlens.numel() > 0
    segments_asked = segments is not None or envs.prefill_segments() is not None
    kernel_choice = choose_scan_kernel(
        w, u, initial_state, cu_seqlens, num_seqs=N, gate_cumsum=gate_cumsum, writes_chunk_states=h is not None,
        writes_o=o is not None, segments_asked=segments_asked,
        cuda_faster=lambda: cuda_scan_is_faster(w.device, N, HV, K, V, T, varlen, initial_state is not None))
    if kernel_choice == "cuda" and run_scan_cuda(w, u, qg, kd, a_qk, decay, o, initial_state, final, cu_seqlens,
                                                 chunk_offsets, T=T, N=N,
                                                 block_v=cuda_block_v(N * HV, device_sms(w.device))):
        return  # the CUDA scan ran (prefill/cuda/scan.py)
    dot_bf16, dot_precision, _, combine_precision = _precisions(w.dtype)
    BK, BV = pow2(K), state_block(K, V, dot_bf16)
    v_blocks, x_blocks = triton.cdiv(V, BV), triton.cdiv(K + V, BV)
    has_h0 = initial_state is not None
    P = scan_segments(w.device, N, HV, v_blocks, x_blocks, summary_x_blocks(K, V, BV, has_h0), T, varlen, segments)
    dummy = w.new_empty(1, dtype=torch.float32)
    common = dict(HV=HV, K=K, V=V, BT=CHUNK, BK=BK, IS_VARLEN=varlen, DOT_BF16=dot_bf16,
                  DOT_PRECISION=dot_precision, GATE_CUMSUM=gate_cumsum)
    fixed = dict(num_warps=1) if _interpreted() else {}
    summary = scratch = dummy
    if P > 1:
        summary = _fp32_buffer(w, N * P, HV, K, K + V)
        scratch = _fp32_buffer(w, v_blocks * HV * N * P, BK, BV)
        kernel = kda_segment_summary_kernel if _interpreted() else _tuned("summary")
        kernel[(x_blocks * HV * N * (P - 1),)](w, u, kd, decay, summary, cu_seqlens, chunk_offsets, T, P, BX=BV,
                                                SKIP_FIRST_M=not has_h0, **common, **fixed)
    h0_strides = initial_state.stride() if initial_state is not None else (0, 0, 0, 0)
    or_dummy = lambda t: dummy if t is None else t  # noqa: E731
    kernel = kda_chunk_scan_kernel if _interpreted() else _tuned("scan")
    kernel[(v_blocks * HV * N * P,)](
        w, u, or_dummy(qg), kd, or_dummy(a_qk), decay, or_dummy(o), or_dummy(initial_state), or_dummy(final),
        summary, scratch, cu_seqlens, chunk_offsets, T, P, *h0_strides, BV=BV, BKM=min(32, BK),
        HAS_H0=has_h0, STORE_HT=final is not None, COMBINE_PRECISION=combine_precision,
        H_STATES=or_dummy(h), V_NEW=or_dummy(v_new), scale=float(scale), STORE_O=o is not None,
        STORE_STATES=h is not None, **common, **fixed)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def chunk_kda_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, *, scale: float, output_final_state: bool,
    use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False, lower_bound: float | None = None,
    save_residuals: bool = False, segments: int | None = None, cu_seqlens_cpu: torch.Tensor | None = None,
    scalar_gate: bool = False,
):
    """KDA prefill forward (FLA's ``chunk_kda`` semantics) with our Triton kernels; with ``scalar_gate`` the GDN
    prefill forward (FLA's ``chunk_gated_delta_rule``: one gate per token and value head).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g: ``[B, T, HV, K]`` (log decay, or the raw gate
            projection with ``use_gate_in_kernel``), ``[B, T, HV]`` with ``scalar_gate``; beta: ``[B, T, HV]``.
            float16 / bfloat16 / float32, K and V <= 256, HV a multiple of H. Any strides (non-contiguous inputs
            are copied).
        A_log: ``[HV]``, dt_bias: ``[HV * K]`` (``[HV]`` with ``scalar_gate``) for the in-kernel gate (softplus
            form, or lower-bound form when ``lower_bound`` is given).
        initial_state: ``[N, HV, K, V]`` fp32, any strides; N = B, or the number of sequences with
            ``cu_seqlens`` (``[N + 1]`` offsets of sequences packed along T, B = 1, empty ones allowed).
        save_residuals: also return FLA 0.6's backward residuals for chunk size 64.
        segments: force the number of scan segments (default: ``choose_segments`` on CUDA, 1 elsewhere).
        cu_seqlens_cpu: the host copy of ``cu_seqlens`` (same values), when the caller has one: the chunk plan is
            made on the host and copied over (one copy instead of the planning kernels; the exact chunk count),
            except while a CUDA graph is being captured (a host copy cannot be captured).
        scalar_gate: the gate's form (a compile-time parameter of the prepare kernel, ``SCALAR_GATE``): one decay
            per (token, value head), exact for any gate with no exact-diagonal pass (docs/gdn.md section 4). No
            ``lower_bound`` and no residuals (FLA's GDN backward reads its own formats); fallbacks are recorded
            under ``chunk_gdn``.
    Returns:
        ``(o, final_state, residuals)``: ``o`` ``[B, T, HV, V]`` in q's dtype; ``final_state``
        ``[N, HV, K, V]`` fp32 or None; ``residuals`` None or ``[g_cumsum, Aqk, Akk]`` as FLA's forward
        returns them: ``g_cumsum`` ``[B, T, HV, K]`` fp32 chunk-local cumsum in log2 units (empty with
        ``use_gate_in_kernel``: FLA's backward recomputes it), ``Aqk`` (scaled, lower triangular per
        chunk) and ``Akk`` (``(I + A_kk)^-1``) ``[B, T, HV, 64]`` in k's dtype.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"K and V must be <= {MAX_HEAD_DIM} for the Triton prefill kernels, got K={K}, V={V}")
    if scalar_gate and (lower_bound is not None or save_residuals):
        raise ValueError("the scalar gate takes no lower_bound and saves no residuals, got "
                         f"lower_bound={lower_bound}, save_residuals={save_residuals}")
    op = "chunk_gdn" if scalar_gate else "chunk_kda"  # the public op whose fallbacks this call records
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    dtype = q.dtype
    TT = B * T
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if TT == 0 or N == 0:  # no tokens (no launch): the states pass through unchanged
        final = None
        if output_final_state:
            final = (initial_state.float().clone() if initial_state is not None
                     else q.new_zeros(N, HV, K, V, dtype=torch.float32))
        empty = [q.new_empty(0, dtype=torch.float32), q.new_empty(B, T, HV, CHUNK, dtype=k.dtype),
                 q.new_empty(B, T, HV, CHUNK, dtype=k.dtype)]
        return q.new_empty(B, T, HV, V), final, (empty if save_residuals else None)
    varlen = cu_seqlens is not None
    tokens_past_last = varlen  # tokens after cu_seqlens[-1] belong to no sequence: o must be zeroed there
    planned = None  # the chunk plan made on the host from cu_seqlens_cpu
    if varlen and cu_seqlens_cpu is not None and not _capturing(q.device):
        planned = first_chunk_slots(cu_seqlens_cpu)
        slots = max(int(planned[-1]), 1)  # a program with no chunk exits at once
        tokens_past_last = int(cu_seqlens_cpu[-1]) < T
    elif varlen:
        slots = packed_slot_bound(T, N)  # no host sync
    else:
        cu_seqlens = q.new_empty(0, dtype=torch.int32)
        slots = B * chunks_in(T)
    dot_bf16, dot_precision, solve_precision, _ = _precisions(dtype)

    w = q.new_empty(TT, HV, K)
    u = q.new_empty(TT, HV, V)
    a_qk = q.new_empty(B, T, HV, CHUNK)
    decay = q.new_empty(max(slots, 1), HV, K, dtype=torch.float32)
    save_g = save_residuals and not use_gate_in_kernel
    a_kk = q.new_empty(B, T, HV, CHUNK, dtype=k.dtype) if save_residuals else q.new_empty(1)
    g_cumsum = q.new_empty(B, T, HV, K, dtype=torch.float32) if save_g else q.new_empty(1, dtype=torch.float32)
    gate = int(GATE_PRECOMPUTED)
    if use_gate_in_kernel:
        gate = int(GATE_SOFTPLUS if lower_bound is None else GATE_LOWER_BOUND)
    dummy = q.new_empty(1, dtype=torch.float32)
    A_log_arg = A_log.reshape(-1).contiguous() if (use_gate_in_kernel and A_log is not None) else dummy
    dt_bias_arg = dt_bias.reshape(-1).contiguous() if (use_gate_in_kernel and dt_bias is not None) else dummy

    prepare_args = dict(
        T=T, N=N, scale=float(scale), beta_scale=2.0 if allow_neg_eigval else 1.0,
        lower_bound=float(lower_bound) if lower_bound is not None else 0.0,
        H=H, HV=HV, K=K, V=V, SEARCH_STEPS=max(1, math.ceil(math.log2(N + 1)) + 1), IS_VARLEN=varlen,
        L2NORM=use_qk_l2norm_in_kernel, GATE=gate,
        EXACT_DIAGONAL=not scalar_gate and exact_diagonal_needed(gate, lower_bound),
        HAS_A_LOG=A_log_arg is not dummy, HAS_DT_BIAS=dt_bias_arg is not dummy, BETA_SIGMOID=use_beta_sigmoid_in_kernel,
        SAVE_AKK=save_residuals, SAVE_G=save_g, DOT_BF16=dot_bf16, A_PRECISION=dot_precision,
        SOLVE_PRECISION=solve_precision, SCALAR_GATE=scalar_gate,
    )
    use_cuda = choose_prepare_kernel(q, k, v, g, beta, cu_seqlens if varlen else None, gate != int(GATE_PRECOMPUTED),
                                     lower_bound, scalar_gate=scalar_gate, op=op) == "cuda"
    # Both CUDA kernels (loaded): with a scalar gate in their row-factor form; with at most INLINE_SEQS packed
    # sequences they find their chunks from cu_seqlens alone (no chunk plan before them); the scan zeroes o past
    # the last sequence
    inline_offsets = varlen and N <= INLINE_SEQS
    pair_args = {**prepare_args, "ROW_FACTORS": scalar_gate, "INLINE_OFFSETS": inline_offsets}
    cuda_pair = use_cuda and cuda_pair_served(
        q, v, g, beta, initial_state, cu_seqlens, T=T, N=N, segments=segments, output_final_state=output_final_state,
        prepare_args=pair_args)
    inline_offsets = inline_offsets and cuda_pair
    if not varlen or inline_offsets:
        chunk_offsets = cu_seqlens  # (empty, or not read)
    elif planned is not None:
        chunk_offsets = planned.to(cu_seqlens.device, non_blocking=True)
    else:
        chunk_offsets = first_chunk_slots(cu_seqlens)
    factors = None
    if cuda_pair and scalar_gate:
        # the rows' q / k factors instead of the qg / kd tiles; both kernels are loaded
        factors = q.new_empty(max(slots, 1), HV, 2, CHUNK, dtype=torch.float32)
        launch_prepare((q, k, v, g, beta, A_log_arg, dt_bias_arg, w, u, factors, w, a_qk, decay, a_kk, g_cumsum,
                        cu_seqlens, chunk_offsets), slots, pair_args)
    else:
        qg = q.new_empty(TT, HV, K)
        kd = q.new_empty(TT, HV, K)
        prepare_tensors = (q, k, v, g, beta, A_log_arg, dt_bias_arg, w, u, qg, kd, a_qk, decay, a_kk, g_cumsum,
                           cu_seqlens, chunk_offsets)
        if cuda_pair:
            launch_prepare(prepare_tensors, slots, pair_args)  # (loaded: no fallback left to take)
        elif use_cuda and run_or_fall_back(prepare_tensors, slots, prepare_args, op=op):
            pass  # the CUDA prepare kernel ran (prefill/cuda/prepare.py)
        elif _interpreted():
            kda_prepare_kernel[(slots, HV)](*prepare_tensors, **prepare_args, BKC=min(64, pow2(K)),
                                            BWC=min(64, pow2(max(K, V))), num_warps=1)
        else:
            _tuned("prepare")[(slots, HV)](*prepare_tensors, **prepare_args)

    # ---- the recurrence ---------------------------------------------------------------------------
    # Tokens past cu_seqlens[-1] belong to no sequence and read 0 (as in the reference); which tokens
    # those are is on the device, so varlen output starts zeroed, except for the CUDA scan, which zeroes them.
    o = q.new_zeros(B, T, HV, V) if tokens_past_last and not cuda_pair else q.new_empty(B, T, HV, V)
    final = q.new_empty(N, HV, K, V, dtype=torch.float32) if output_final_state else None
    if cuda_pair:  # with a scalar gate the CUDA scan's row-factor form, on the raw q / k
        launch_scan_cuda(w, u, q if factors is not None else qg, k if factors is not None else kd, a_qk, decay, o,
                         initial_state, final, cu_seqlens, chunk_offsets, T=T, N=N,
                         block_v=cuda_block_v(N * HV, device_sms(q.device)), factors=factors)
    else:
        launch_scan(w, u, qg, kd, a_qk, decay, initial_state, cu_seqlens, chunk_offsets, T=T, N=N, segments=segments,
                    o=o, final=final)
    residuals = None
    if save_residuals:
        a_qk_res = a_qk if a_qk.dtype == k.dtype else a_qk.to(k.dtype)
        residuals = [g_cumsum if save_g else q.new_empty(0, dtype=torch.float32), a_qk_res, a_kk]
    return o, final, residuals
