"""Which kernel runs the KDA / GDN prefill's prepare step on CUDA, and the launcher of the CUDA one.

- ``cuda`` (``prefill/cuda/prepare_source.py``, compiled by NVRTC): sm_80 or newer, bf16 q / k / v, K = V = 128,
  gate and beta in bf16 or fp32; for KDA's per-channel gate the in-kernel gates: the lower-bound gate (with
  ``lower_bound >= -MAX_BOUNDED_DECAY`` the configuration FlashKDA's anchor measures) and, through the kernel's
  ``wide_blocks`` form, any lower bound and the softplus gate, at a cost that does not depend on the data; for
  GDN's scalar gate (``scalar_gate``) every gate form. KDA's finished gates (``use_gate_in_kernel=False``) take
  the Triton kernel: they may hold exact resets (``-inf``), which its exponents keep exact.
- ``triton`` (``prefill/triton/prepare.py``): every call (any dtype, K / V <= 256, every gate form).

Both write the same intermediates in the same layouts, so the scan kernel does not know which ran.
``KDA_COMPILE_PREPARE_KERNEL`` = ``auto`` (default) | ``triton`` | ``cuda`` overrides the choice (``cuda``
still runs Triton, logged, on calls outside the kernel's design). A call the CUDA kernel is written for
that cannot run it (NVRTC missing or failing) runs Triton and is recorded as a fallback (logged once,
shown by the rewrite report).
"""
from __future__ import annotations

import functools

import torch

from kda_compile.ops import envs
from kda_compile.ops._common import cuda_index, device_capability, on_device, record_fallback
from kda_compile.ops._nvrtc import NvrtcUnavailable, load_kernel
from kda_compile.ops.kda.prefill.cuda.choice import CU_TYPES as _CU
from kda_compile.ops.kda.prefill.cuda.choice import device_unsupported
from kda_compile.ops.kda.prefill.cuda import prepare_source as src
from kda_compile.ops.kda.prefill.cuda.launch import PREPARE
from kda_compile.ops.kda.triton_common import GATE_LOWER_BOUND, GATE_SOFTPLUS
from kda_compile.ops.kda.prefill.triton.prepare_channel import exact_diagonal_needed

KERNEL_ENV = envs.PREPARE_KERNEL
_OP = "chunk_kda"
_ELEM = {torch.bfloat16: "bf16", torch.float32: "f32"}


def requested_kernel() -> str:
    return envs.prepare_kernel()


def outside_design(q, k, v, g, beta, cu_seqlens, gate_in_kernel: bool, lower_bound: float | None, *,
                   scalar_gate: bool = False) -> str | None:
    """Why the call is not one the CUDA kernel is written for, or None. ``gate_in_kernel``: the kernel computes the
    gate from the raw projection (the lower-bound form with ``lower_bound``, else softplus); ``scalar_gate``: one
    gate per (token, value head) (GDN), which the kernel takes in every form (finished, or the in-kernel softplus
    gate). Its speed and exactness do not depend on the gate's values in any form it takes."""
    why = device_unsupported(q)
    if why is not None:
        return why
    if any(t.dtype != torch.bfloat16 for t in (q, k, v)):
        return f"q / k / v are {q.dtype} / {k.dtype} / {v.dtype} (the kernel takes bfloat16)"
    if q.shape[-1] != src.HEAD_DIM or v.shape[-1] != src.HEAD_DIM:
        return f"K = {q.shape[-1]}, V = {v.shape[-1]} (the kernel takes 128 / 128)"
    if not scalar_gate and not gate_in_kernel:
        return ("gate: a finished gate (use_gate_in_kernel=False); the kernel takes KDA's in-kernel gates (lower-bound "
                "or softplus), the Triton kernel finished ones, whose exact resets (-inf) it keeps exact")
    if g.dtype not in _ELEM or beta.dtype not in _ELEM:
        return f"g / beta are {g.dtype} / {beta.dtype} (the kernel takes bfloat16 or float32)"
    if cu_seqlens is not None and cu_seqlens.numel() and cu_seqlens.dtype not in _CU:
        return f"cu_seqlens is {cu_seqlens.dtype} (the kernel takes int32 or int64)"
    return None


def serves_in_kernel_gates(device: torch.device, dtype: torch.dtype, K: int, V: int) -> str | None:
    """Why calls of this device, dtype and sizes with an in-kernel per-channel gate (lower-bound or softplus, any
    strength) would not run the CUDA kernel, or None (read without tensors: the backend choice's question; the
    gate's and beta's dtypes are checked at the call)."""
    if device.type == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available"
    why = device_unsupported(device)
    if why is not None:
        return why
    if requested_kernel() == "triton":
        return f"{KERNEL_ENV}=triton"
    if dtype != torch.bfloat16 or K != src.HEAD_DIM or V != src.HEAD_DIM:
        return f"the kernel takes bfloat16 with K = V = {src.HEAD_DIM}, got {dtype}, K = {K}, V = {V}"
    return None


def choose_prepare_kernel(q, k, v, g, beta, cu_seqlens, gate_in_kernel: bool, lower_bound: float | None, *,
                          scalar_gate: bool = False, op: str = _OP) -> str:
    """"cuda" or "triton" for this call (see the module docstring); recorded as a fallback (under ``op``): a forced
    ``cuda`` outside the design, and an in-kernel gate that needs wide blocks (softplus, a lower bound below
    ``-MAX_BOUNDED_DECAY``) on a device, dtype and sizes the kernel serves (``serves_in_kernel_gates``: the backend
    choice preferred our kernels for that) whose own arguments it cannot take (e.g. an fp16 gate or beta): the
    Triton kernel then takes its exact pass, whose cost depends on the decays (up to 1.9x on strong ones)."""
    requested = requested_kernel()
    if requested == "triton":
        return "triton"
    why = outside_design(q, k, v, g, beta, cu_seqlens, gate_in_kernel, lower_bound, scalar_gate=scalar_gate)
    if why is None:
        return "cuda"
    if requested == "cuda":
        record_fallback(op, "Triton prepare kernel", f"the CUDA prepare kernel cannot run this call: {why}")
    elif (gate_in_kernel and not scalar_gate and channel_gate_form(lower_bound)[1]
          and serves_in_kernel_gates(q.device, q.dtype, q.shape[-1], v.shape[-1]) is None):
        record_fallback(op, "Triton prepare kernel with its exact pass (its cost depends on the decays)",
                        f"the CUDA prepare kernel serves this device, dtype and sizes but not this call: {why}")
    return "triton"


@functools.lru_cache(maxsize=None)
def _source(g_dtype: str, beta_dtype: str, cu_dtype: str, flags: tuple[bool, ...], scalar_gate: bool,
            row_factors: bool = False, softplus_gate: bool = False, wide_blocks: bool = False,
            inline_offsets: bool = False) -> str:
    varlen, l2norm, has_a_log, has_dt_bias, beta_sigmoid, save_akk = flags
    return src.kernel_source(g_dtype=g_dtype, beta_dtype=beta_dtype, cu_dtype=cu_dtype, varlen=varlen, l2norm=l2norm,
                             has_a_log=has_a_log, has_dt_bias=has_dt_bias, beta_sigmoid=beta_sigmoid,
                             save_akk=save_akk, scalar_gate=scalar_gate, row_factors=row_factors,
                             softplus_gate=softplus_gate, wide_blocks=wide_blocks, inline_offsets=inline_offsets)


def channel_gate_form(lower_bound: float | None) -> tuple[bool, bool]:
    """``(softplus_gate, wide_blocks)`` of the per-channel kernel for an in-kernel gate: softplus without
    ``lower_bound``; wide blocks unless the lower bound keeps every block within ``DIAG_RANGE_LIMIT``."""
    softplus = lower_bound is None
    return softplus, exact_diagonal_needed(int(GATE_SOFTPLUS if softplus else GATE_LOWER_BOUND), lower_bound)


def prepare_kernel(device_index: int, g_dtype: torch.dtype, beta_dtype: torch.dtype, cu_dtype: torch.dtype | None,
                   flags: tuple[bool, ...], *, scalar_gate: bool = False, row_factors: bool = False,
                   softplus_gate: bool = False, wide_blocks: bool = False, inline_offsets: bool = False):
    """The compiled kernel for one specialisation (compiled and loaded on first use; ``_nvrtc.load_kernel``):
    ``flags`` = (IS_VARLEN, L2NORM, HAS_A_LOG, HAS_DT_BIAS, BETA_SIGMOID, SAVE_AKK); ``cu_dtype`` the offsets'
    dtype with packed sequences; ``scalar_gate``: the gate is one value per (token, value head) (GDN);
    ``row_factors``: the scalar-gate kernel writes the rows' q / k factors instead of ``qg`` / ``kd`` (for the CUDA
    scan's ``row_factors`` form); ``softplus_gate`` / ``wide_blocks``: the per-channel gate's form
    (``channel_gate_form``); ``inline_offsets``: packed sequences (at most ``INLINE_SEQS``) found from ``cu_seqlens``
    alone, no ``chunk_offsets``. The caller has made the device current. Raises NvrtcUnavailable."""
    major, minor = device_capability(device_index)
    cu = _CU.get(cu_dtype, "int") if flags[0] else "int"
    source = _source(_ELEM[g_dtype], _ELEM[beta_dtype], cu, flags, scalar_gate, row_factors, softplus_gate, wide_blocks,
                     inline_offsets and flags[0])
    return load_kernel(source, PREPARE.kernel, device_index, arch=f"{major}{minor}",
                       shared_bytes=PREPARE.shared_bytes())


def prepare_flags(args: dict) -> tuple[bool, ...]:
    """``prepare_kernel``'s ``flags`` from the prepare's launch keywords (``launch_prepare``'s ``args``)."""
    return tuple(bool(args[name]) for name in ("IS_VARLEN", "L2NORM", "HAS_A_LOG", "HAS_DT_BIAS", "BETA_SIGMOID",
                                               "SAVE_AKK"))


def kernel_for(device_index: int, g_dtype: torch.dtype, beta_dtype: torch.dtype, cu_dtype: torch.dtype | None,
               args: dict):
    """The compiled kernel ``launch_prepare`` runs for its launch keywords ``args`` (``prepare_kernel``'s
    specialisation read from them). The caller has made the device current. Raises NvrtcUnavailable."""
    scalar_gate = bool(args.get("SCALAR_GATE", False))
    return prepare_kernel(device_index, g_dtype, beta_dtype, cu_dtype, prepare_flags(args), scalar_gate=scalar_gate,
                          row_factors=bool(args.get("ROW_FACTORS", False)),
                          softplus_gate=not scalar_gate and args["GATE"] == int(GATE_SOFTPLUS),
                          # (the launch's own choice: exact_diagonal_needed, False for the scalar gate)
                          wide_blocks=bool(args["EXACT_DIAGONAL"]), inline_offsets=bool(args.get("INLINE_OFFSETS")))


def launch_prepare(tensors: tuple, slots: int, args: dict) -> None:
    """Run the CUDA prepare kernel with the Triton kernel's launch: ``tensors`` its tensor arguments in its order
    (``q, k, v, g, beta, A_log, dt_bias, w, u, qg, kd, a_qk, decay, a_kk, g_cumsum, cu_seqlens, chunk_offsets``;
    ``g_cumsum`` is not written: the in-kernel gates save none), ``args`` its scalar and constexpr keywords
    (``T, N, H, HV, scale, beta_scale, lower_bound, GATE, EXACT_DIAGONAL, IS_VARLEN, L2NORM, HAS_A_LOG, HAS_DT_BIAS,
    BETA_SIGMOID, SAVE_AKK`` are read, and ``SCALAR_GATE`` when present: then ``g`` is ``[TT, HV]``, ``dt_bias``
    ``[HV]``; with ``ROW_FACTORS`` also present and true, ``qg`` is the ``[slots, HV, 2, 64]`` fp32 buffer of the rows'
    factors and ``kd`` is not written; without it, ``GATE`` and ``EXACT_DIAGONAL`` pick the per-channel gate's form;
    ``INLINE_OFFSETS`` present and true, with at most ``INLINE_SEQS`` packed sequences: the kernel finds its chunks
    from ``cu_seqlens`` alone and does not read ``chunk_offsets``).
    The caller checked ``outside_design`` is None. Raises NvrtcUnavailable when the kernel cannot be built."""
    (q, k, v, g, beta, a_log, dt_bias, w, u, qg, kd, a_qk, decay, a_kk, _g_cumsum, cu_seqlens, chunk_offsets) = tensors
    varlen, HV = args["IS_VARLEN"], args["HV"]
    if varlen and args.get("INLINE_OFFSETS") and args["N"] > src.INLINE_SEQS:
        raise ValueError(f"INLINE_OFFSETS takes at most {src.INLINE_SEQS} sequences, got N={args['N']}")
    device_index = cuda_index(q.device)
    a_log = a_log.float().contiguous() if args["HAS_A_LOG"] else a_log
    dt_bias = dt_bias.float().contiguous() if args["HAS_DT_BIAS"] else dt_bias
    with on_device(device_index):
        kernel = kernel_for(device_index, g.dtype, beta.dtype, cu_seqlens.dtype if varlen else None, args)
        params = PREPARE.params([t.data_ptr() for t in (q, k, v, g, beta, a_log, dt_bias, w, u, qg, kd, a_qk, decay,
                                                        a_kk, cu_seqlens if varlen else q,
                                                        chunk_offsets if varlen else q)], args)
        if slots * HV:
            kernel.launch(PREPARE.grid(slots, HV), PREPARE.threads(), params)


def run_or_fall_back(tensors: tuple, slots: int, args: dict, *, op: str = _OP) -> bool:
    """Launch the CUDA kernel (``launch_prepare``); False (with the fallback recorded under ``op``) when it cannot
    be built."""
    try:
        launch_prepare(tensors, slots, args)
        return True
    except NvrtcUnavailable as exc:
        record_fallback(op, "Triton prepare kernel", f"the CUDA prepare kernel could not be built: {exc}")
        return False
