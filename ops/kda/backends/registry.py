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
from kda_compile.ops.delta_rule.backends import MAX_RESIDUALS  # noqa: F401  (the schema's residual slots)
from kda_compile.ops.delta_rule.backends import DeltaRuleOptions
from kda_compile.ops.delta_rule.backends import ReferenceBackend as DeltaRuleReference
from kda_compile.ops.kda.reference import kda_reference


@dataclass(frozen=True)
class KDAOptions(DeltaRuleOptions):
    """The non-tensor arguments of a KDA call, after validation and defaulting: the delta rule's, and KDA's
    lower-bound gate and kept intermediates."""

    lower_bound: float | None = None
    safe_gate: bool = False
    # FLA's ``disable_recompute``: a training forward keeps the intermediates its backward would otherwise
    # recompute (more activation memory, a faster backward). Backends that cannot keep them ignore it.
    keep_intermediates: bool = False


class ReferenceBackend(DeltaRuleReference):
    """Plain-torch chunked math (``reference.py``). Any device; backward by autograd of the forward."""

    math = staticmethod(kda_reference)

    @staticmethod
    def gate_options(opts: KDAOptions) -> dict:
        return {"lower_bound": opts.lower_bound}


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
