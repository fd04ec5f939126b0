"""Implementations behind the GDN ops, and how one is chosen per call.

Same contract as KDA's (``kda_compile.ops.kda.backends.registry``): the custom ops in ``custom_ops.py`` ask
``select_backend`` for the highest-priority registered backend that can serve the call. A backend has

- ``name`` and ``serves`` (a subset of ``{"chunk_gdn", "fused_recurrent_gdn"}``);
- ``unsupported_reason(device, dtype, K, V, opts) -> str | None`` (None: it can serve the call);
- optionally ``in_design(device, dtype, K, V, opts) -> bool``: a backend registered ahead of others for some calls
  only says which; the calls it leaves are not recorded as fallbacks;
- ``residual_meta(q, k, v, opts, save)``: shapes / dtypes of what its forward keeps for its backward
  (at most ``MAX_RESIDUALS``; the fake implementation allocates them, so they must be exact);
- ``chunk_forward`` (with an optional ``cu_seqlens_cpu``, the host copy of the offsets in eager inference),
  ``chunk_backward`` (for ``chunk_gdn``) and ``recurrent_forward`` (for decode).

Backends, best first (docs/gdn.md, section 3):

1. ``chunk_kernels`` (priority 20, ``prefill/backend.py``): our KDA chunk kernels with the scalar gate
   (``prefill/run.py``) for CUDA inference with bf16 / fp16 and K = V = 128: plain ``q k^T`` / ``k k^T`` products
   scaled by a decay matrix, exact for any gate at a cost that does not depend on the data. Inference only.
2. ``decode_kernel`` (priority 15, ``decode/backend.py``): decode only, KDA's fused Triton decode step with the
   scalar gate (``decode/kernel.py``): one gate load, softplus and ``exp`` per token and value head, no broadcast
   tensor. Faster than FLA's fused step in a CUDA graph and called eagerly (docs/gdn.md section 4).
3. ``fla`` (priority 10, ``backends/fla.py``): fla-core 0.6's gated-delta-rule kernels on CUDA. They use
   the per-head gate as a scalar: the intra-chunk work has no per-channel exponentials, which makes them
   cheaper than any KDA kernel fed a broadcast gate.
4. ``kda_kernels`` (priority 5, ``backends/kda.py``): the KDA op (``torch.ops.kda_compile.chunk_kda_fwd``
   / ``fused_recurrent_kda_fwd``) with the gate broadcast over the K channels, on CUDA: our Triton prefill
   kernels when FLA is missing (decode goes to ``decode_kernel`` first). Exact, but pays KDA's per-channel cost.
5. ``reference`` (priority 0): the chunked torch math of ``reference.py``, any device.

A call served on CUDA by anything but the first candidate records a fallback with the reasons
(``record_fallback``; the rewrite report shows it). ``only_backends`` restricts the choice (tests,
benchmarks); naming a backend there also lets it serve devices it would normally leave to a cheaper
one (the KDA route on CPU, for tests of its plumbing).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kda_compile.ops._backend_registry import BackendRegistry
from kda_compile.ops.delta_rule.backends import DeltaRuleOptions
from kda_compile.ops.delta_rule.backends import ReferenceBackend as DeltaRuleReference
from kda_compile.ops.gdn.reference import gdn_reference


@dataclass(frozen=True)
class GDNOptions(DeltaRuleOptions):
    """The non-tensor arguments of a GDN call, after validation and defaulting: the delta rule's, and whether the
    forward trains."""

    training: bool = False  # the forward keeps residuals for a backward: the backend must serve both


class ReferenceBackend(DeltaRuleReference):
    """Plain-torch chunked math (``reference.py``). Any device; backward by autograd of the forward (the delta
    rule's reference backend with GDN's math)."""

    serves = frozenset({"chunk_gdn", "fused_recurrent_gdn"})

    math = staticmethod(gdn_reference)


REFERENCE = ReferenceBackend()
# (priority, backend), higher priority tried first, and the only_backends restriction (process-wide).
REGISTRY = BackendRegistry("GDN", REFERENCE, recorded="past any backend")
register_backend = REGISTRY.register
registered_backends = REGISTRY.names
backend_named = REGISTRY.named
explicitly_requested = REGISTRY.explicitly_requested
# e.g. ``only_backends("kda_kernels")`` measures GDN through the KDA kernels while FLA is installed
only_backends = REGISTRY.only


def select_backend(op: str, device: torch.device, dtype: torch.dtype, K: int, V: int, opts: GDNOptions):
    """The backend that serves this call; on CUDA, a call the first candidate cannot serve is logged."""
    return REGISTRY.select(op, device, dtype, K, V, opts)
