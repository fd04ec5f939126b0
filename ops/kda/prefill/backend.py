"""Our fused Triton prefill (``prefill/run.py``) as a KDA backend for ``chunk_kda``.

Registered BELOW FLA (priority 5 < 10) for the chunked op only (its forward, fake and backward), and
PREFERRED over it (``preferred_reason``) for the lower-bound gate with ``lower_bound >= -BOUNDED_GATE_LIMIT`` and
for every in-kernel gate (softplus, any lower bound) of the calls the CUDA prepare kernel serves (bf16, K = V = 128,
sm_80 or newer: ``cuda_prepare.serves_in_kernel_gates``).
Our forward is ahead of FLA's with the softplus gate, but the Triton prepare's cost depends on the data: with strong
decays (a 16-token block whose decay spans more than 2^120 in some channel, e.g. Mamba-style ``A_log = log U(1, 16)``
on raw gates ~ N(0, 1)) it adds its exact-diagonal pass and falls behind FLA's whole forward, whose cost does not
depend on the data (docs/kda-kernels.md section 8). The lower-bound gate bounds every step's decay by
``|lower_bound|`` nats, so with ``lower_bound >= -5`` no block can reach that limit (16 x 5 / ln 2 = 115.4 < 120, the
kernel's ``DIAG_RANGE_LIMIT``) and the speed cannot depend on the data: those calls come here first. So do softplus and
other in-kernel gates where the CUDA prepare kernel runs: its ``wide_blocks`` form takes any decay with no exact
pass (docs/kda-kernels.md section 4.1). Other calls opt in with ``only_backends("triton_chunk")``
(``kda_compile.ops.kda.backends.registry``); without FLA this backend serves CUDA instead of the reference.
Inference runs our two-to-three-launch forward. Training (the op saves residuals) depends on FLA's
backward kernels, which the forward must feed in FLA's formats:

- FLA usable and ``chunk_size == 64``: our forward also writes FLA's residuals (chunk-local gate
  cumsum, ``Aqk``, ``Akk = (I + A_kk)^-1``, chunk 64; with the in-kernel L2 norm, also the normalised
  q / k and their rstd from the FLA path's own kernel, kept as the FLA backend keeps them); the backward
  runs FLA's ``chunk_kda_bwd``.
- FLA usable, ``chunk_size`` 32, or ``keep_intermediates`` (FLA's ``disable_recompute``): FLA's residuals
  depend on its chunk size, and its kept intermediates are in its own formats, so FLA's own forward runs
  (logged through ``record_fallback`` with the reason); the backward is FLA's.
- FLA unusable (not installed, wrong version): our forward saves nothing and the backward is the
  reference's (autograd through the reference math; logged).

``unsupported_reason`` has no ``save`` argument, so these choices are made inside the backend, from
the same inputs at forward, fake and backward time. Calls the kernels cannot serve at all (not CUDA,
float64, K or V > 256, triton missing) say why; ``select_backend`` then tries FLA, then the reference.
"""
from __future__ import annotations

import logging

import torch

from kda_compile.ops._common import (
    compile_failure_reason,
    record_fallback,
    triton_compile_errors,
)
from kda_compile.ops.delta_rule.backends import own_kernel
from kda_compile.ops.kda.backends.registry import REFERENCE, KDAOptions, register_backend
from kda_compile.ops.kda.prefill.chunks import CHUNK  # our prepare's chunk: that of the FLA residuals it can write
from kda_compile.ops.kda.backends.fla import FLABackend, glue_kernels

logger = logging.getLogger("kda_compile.ops.kda")

KERNEL_MODULE = "kda_compile.ops.kda.prefill.run"
PREFILL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256  # the scan keeps a [next_pow2(K), BV] fp32 state tile on chip

OWN_RESIDUALS, FLA_FORWARD, REFERENCE_BACKWARD = "own", "fla", "reference"
# |lower_bound| (nats per step) up to which a block's decay range stays within the prepare kernel's
# DIAG_RANGE_LIMIT (120 log2 units over 16 steps: 120 ln 2 / 16 = 5.2); tests/kda/test_prefill_backend.py checks it.
BOUNDED_GATE_LIMIT = 5.0
_FLA = FLABackend()
_failed_variants: dict[tuple, str] = {}  # call variants whose kernels did not compile -> the reason


_kernel_unusable, _launcher = own_kernel(KERNEL_MODULE, "chunk_kda_prefill")


def training_path(device: torch.device, dtype: torch.dtype, K: int, V: int, opts: KDAOptions) -> tuple[str, str]:
    """How a call that saves for the backward runs: ``(path, reason)``, path one of
    ``OWN_RESIDUALS`` (our forward + FLA's backward), ``FLA_FORWARD``, ``REFERENCE_BACKWARD``."""
    fla_reason = _FLA.unsupported_reason(device, dtype, K, V, opts)
    if fla_reason is not None:
        return REFERENCE_BACKWARD, f"the backward needs FLA's kernels: {fla_reason}"
    if opts.chunk_size != CHUNK:
        return FLA_FORWARD, (f"training with chunk_size={opts.chunk_size}: FLA's backward needs residuals of its "
                             f"chunk size and our forward writes them for chunk_size={CHUNK} only")
    if opts.keep_intermediates:
        return FLA_FORWARD, ("training with disable_recompute=True: FLA's backward then takes FLA's forward "
                             "intermediates (w, u, qg, kg, v_new, h), which our kernels do not write in its formats")
    return OWN_RESIDUALS, ""


class TritonChunkBackend:
    """``chunk_kda`` on CUDA through our fused Triton prefill forward."""

    name = "triton_chunk"
    serves = frozenset({"chunk_kda"})

    def unsupported_reason(self, device, dtype, K, V, opts: KDAOptions) -> str | None:
        if device.type != "cuda":
            return f"needs CUDA, got {device.type}"
        if dtype not in PREFILL_DTYPES:
            return f"the prefill kernels take float16/bfloat16/float32 inputs, got {dtype}"
        if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
            return f"the prefill kernels keep K, V <= {MAX_HEAD_DIM} on chip, got K={K}, V={V}"
        if dtype == torch.float32 and K > 128:  # the scan's fp32 tiles overflow shared memory
            return f"float32 inputs with K > 128 need more shared memory than the scan kernel has, got K={K}"
        return _kernel_unusable()

    def preferred_reason(self, device, dtype, K, V, opts: KDAOptions) -> str | None:
        if not opts.use_gate_in_kernel:
            return None
        if opts.lower_bound is not None and opts.lower_bound >= -BOUNDED_GATE_LIMIT:
            return (f"lower-bound gate with lower_bound={opts.lower_bound} >= -{BOUNDED_GATE_LIMIT}: no block takes "
                    f"the exact-diagonal pass, so our kernels' speed does not depend on the data")
        if _kernel_unusable() is not None:
            return None
        from kda_compile.ops.kda.prefill.cuda.prepare import serves_in_kernel_gates  # (needs triton)
        if serves_in_kernel_gates(device, dtype, K, V) is None:
            gate = ("softplus gate" if opts.lower_bound is None
                    else f"lower-bound gate with lower_bound={opts.lower_bound}")
            return (f"{gate}, bfloat16, K = V = 128: the CUDA prepare kernel forms every block without an exact pass, "
                    f"so our kernels' speed does not depend on the data")
        return None

    def residual_meta(self, q, k, v, opts, save):
        if not save:
            return []
        path, _ = training_path(q.device, q.dtype, q.shape[-1], v.shape[-1], opts)
        return [] if path == REFERENCE_BACKWARD else _FLA.residual_meta(q, k, v, opts, save)

    def input_stand_ins(self, q, k, v, opts, save):
        if not save:
            return {}
        path, _ = training_path(q.device, q.dtype, q.shape[-1], v.shape[-1], opts)
        return {} if path == REFERENCE_BACKWARD else _FLA.input_stand_ins(q, k, v, opts, save)

    def chunk_forward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts, output_final_state, save,
                      cu_seqlens_cpu=None):
        """``(o, final state or None, residuals)``; inputs as the op got them (any strides). ``cu_seqlens_cpu``:
        the host copy of ``cu_seqlens`` when the caller has one (eager inference): plans the chunks on the host."""
        path = None
        if save:
            path, reason = training_path(q.device, q.dtype, q.shape[-1], v.shape[-1], opts)
            if path == FLA_FORWARD:
                record_fallback("chunk_kda", "fla", reason)
                return _FLA.chunk_forward(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts,
                                          output_final_state, save, cu_seqlens_cpu=cu_seqlens_cpu)
            if path == REFERENCE_BACKWARD:
                record_fallback("chunk_kda_backward", REFERENCE.name, reason)
        normalised = []
        if path == OWN_RESIDUALS and opts.use_qk_l2norm_in_kernel:
            # FLA's backward takes the normalised q / k, kept in q's dtype as FLA keeps them. Our forward
            # still normalises in fp32 in its kernel: feeding it the rounded copies instead cost accuracy
            # (docs/kda-kernels.md section 8).
            l2norm_fwd = glue_kernels().l2norm_fwd
            (qn, q_rstd), (kn, k_rstd) = l2norm_fwd(q.contiguous()), l2norm_fwd(k.contiguous())
            normalised = [qn, q_rstd, kn, k_rstd]
        kwargs = dict(
            scale=opts.scale, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=opts.use_qk_l2norm_in_kernel, use_gate_in_kernel=opts.use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=opts.use_beta_sigmoid_in_kernel, allow_neg_eigval=opts.allow_neg_eigval,
            lower_bound=opts.lower_bound, save_residuals=path == OWN_RESIDUALS,
        )
        if cu_seqlens_cpu is not None:
            kwargs["cu_seqlens_cpu"] = cu_seqlens_cpu
        # What selects the kernels' compile-time constants (all but the sequence length).
        variant = (q.device, q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, tuple(q.shape[2:]), tuple(v.shape[2:]),
                   cu_seqlens is not None and cu_seqlens.dtype, h0 is not None and h0.dtype, output_final_state,
                   A_log is not None, dt_bias is not None, path, opts)
        reason = _failed_variants.get(variant)
        if reason is None:
            try:
                with torch.cuda.device(q.device):  # Triton launches on the current device
                    o, final, residuals = _launcher()(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, **kwargs)
                return o, final, (residuals + normalised if residuals else [])
            except triton_compile_errors() as error:
                # A kernel that does not compile for this GPU / configuration is our bug, not the user's.
                # Nothing was written yet (compilation precedes each kernel's first launch); later calls
                # of this variant skip the failing compile.
                reason = compile_failure_reason("our Triton prefill kernels", error)
                _failed_variants[variant] = reason
        # Serve the call as the backend order would have without us: FLA, else the reference.
        fallback = _FLA if path != REFERENCE_BACKWARD and _FLA.unsupported_reason(
            q.device, q.dtype, q.shape[-1], v.shape[-1], opts) is None else REFERENCE
        record_fallback("chunk_kda", fallback.name, reason)
        o, final, residuals = fallback.chunk_forward(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts,
                                                     output_final_state, save, cu_seqlens_cpu=cu_seqlens_cpu)
        return o, final, residuals or []

    def chunk_backward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, residuals, do, dht, opts):
        if residuals:  # FLA's formats, from our forward or FLA's
            return _FLA.chunk_backward(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, residuals, do, dht, opts)
        return REFERENCE.chunk_backward(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, residuals, do, dht, opts)


register_backend(TritonChunkBackend(), priority=5)  # below FLA, preferred for bounded gates: see the docstring
