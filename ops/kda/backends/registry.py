"""Implementations behind the KDA ops, and how one is chosen per call.

The custom ops in ``custom_ops.py`` never name a kernel: they ask ``select_backend`` for the
fastest registered backend that supports the call. A backend is a small object with

- ``unsupported_reason(device, dtype, K, V, opts) -> str | None``: ``None`` when it can serve the call;
- ``residual_meta(q, k, v, opts, save)``: the shapes/dtypes of what its forward saves for its backward
  (at most ``MAX_RESIDUALS`` tensors); used by the fake implementation, so it must be exact;
- ``chunk_forward(...)``, ``chunk_backward(...)`` and ``recurrent_forward(...)``;
- optionally ``input_stand_ins(q, k, v, opts, save) -> {"q": i, ...}``: inputs its backward reads only
  through residual ``i`` (same shape and dtype, e.g. the L2-normalised q); the op then does not keep
  the input itself for the backward and hands the backend the residual in its place;
- optionally ``preferred_reason(device, dtype, K, V, opts) -> str | None``: not ``None`` when this
  backend should serve the call ahead of higher-priority ones (it is then tried first; the reason says
  why, e.g. a gate form whose speed on its kernels cannot depend on the data);
- optionally ``serves``: which of ``"chunk_kda"`` (forward, its fake and its backward: the backend
  chosen for a forward also runs that call's backward, possibly by delegating) and
  ``"fused_recurrent_kda"`` it implements; a backend without it implements both.

Backends, best first: our fused decode step (``decode/backend.py``, decode only); FLA's Triton kernels on
CUDA when fla-core 0.6 is importable, with our scan kernel in place of FLA's last two forward kernels
(``backends/fla.py``); our own Triton prefill (``prefill/backend.py``: below FLA, but preferred for the
bounded lower-bound gate; otherwise opt-in, unless FLA is missing); then the reference math (any
device). When CUDA ends up on the reference, the reason is logged once and recorded for the rewrite
report (``record_fallback``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kda_compile.ops._backend_registry import BackendRegistry
from kda_compile.ops._common import grads_by_autograd
from kda_compile.ops.kda.reference import kda_reference

MAX_RESIDUALS = 13  # FLA's 7 (gate cumsum, Aqk, Akk, normalised q/k and rstd) + its 6 kept intermediates


@dataclass(frozen=True)
class KDAOptions:
    """The non-tensor arguments of a KDA call, after validation and defaulting."""

    scale: float
    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    lower_bound: float | None = None
    safe_gate: bool = False
    chunk_size: int = 64
    # FLA's ``disable_recompute``: a training forward keeps the intermediates its backward would otherwise
    # recompute (more activation memory, a faster backward). Backends that cannot keep them ignore it.
    keep_intermediates: bool = False


class ReferenceBackend:
    """Plain-torch chunked math (``reference.py``). Any device; backward by autograd of the forward."""

    name = "reference"

    def unsupported_reason(self, device, dtype, K, V, opts) -> str | None:
        return None

    def residual_meta(self, q, k, v, opts, save):
        return []  # the backward recomputes the forward: nothing to keep

    def chunk_forward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts, output_final_state, save,
                      cu_seqlens_cpu=None):
        o, final = self._forward(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts)
        return o, (final.float() if output_final_state else None), []

    def recurrent_forward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts, output_final_state):
        o, final = self._forward(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts)
        return o, (final.float() if output_final_state else None)

    def chunk_backward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, residuals, do, dht, opts):
        inputs = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias, "h0": h0}
        return grads_by_autograd(lambda x: self._forward(x["q"], x["k"], x["v"], x["g"], x["beta"], x.get("A_log"),
                                                         x.get("dt_bias"), x.get("h0"), cu_seqlens, opts),
                                 inputs, do, dht)

    @staticmethod
    def _forward(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts):
        return kda_reference(
            q, k, v, g, beta, scale=opts.scale, initial_state=h0, cu_seqlens=cu_seqlens, A_log=A_log,
            dt_bias=dt_bias, use_qk_l2norm_in_kernel=opts.use_qk_l2norm_in_kernel,
            use_gate_in_kernel=opts.use_gate_in_kernel, use_beta_sigmoid_in_kernel=opts.use_beta_sigmoid_in_kernel,
            allow_neg_eigval=opts.allow_neg_eigval, lower_bound=opts.lower_bound, chunk_size=opts.chunk_size,
        )


REFERENCE = ReferenceBackend()

# (priority, backend), higher priority tried first, and the only_backends restriction (process-wide).
REGISTRY = BackendRegistry("KDA", REFERENCE, recorded="on the reference")
register_backend = REGISTRY.register
registered_backends = REGISTRY.names
backend_named = REGISTRY.named
# e.g. ``only_backends("fla")`` measures the FLA path while faster backends are registered
only_backends = REGISTRY.only


def restricted_to() -> frozenset[str] | None:
    """The backends ``only_backends`` allows now (the reference among them), or None when unrestricted."""
    return REGISTRY.allowed


def select_backend(op: str, device: torch.device, dtype: torch.dtype, K: int, V: int, opts: KDAOptions):
    """The backend that serves this call. Falling to the reference on CUDA is logged once per reason."""
    return REGISTRY.select(op, device, dtype, K, V, opts)
