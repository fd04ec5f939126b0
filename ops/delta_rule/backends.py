"""What the delta-rule ops' backend registries share (KDA's ``kda_compile.ops.kda.backends.registry``, GDN's
``kda_compile.ops.gdn.backends.registry``; the selection loop itself is ``kda_compile.ops._backend_registry``):

- ``DeltaRuleOptions``: the options of every delta-rule call, which each op's options extend with its own
  (KDA: the lower-bound gate and kept intermediates; GDN: whether the forward trains);
- ``MAX_RESIDUALS``: the residual slots of every chunked forward op's schema;
- ``ReferenceBackend``: the plain-torch backend of any device, whose backward differentiates its forward;
  each op's subclass names its own reference math (``math``: the gate form is what differs);
- ``own_kernel``: the lazily imported launcher of a backend on our own kernels (KDA's and GDN's decode and
  prefill backends).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache

from kda_compile.ops._common import grads_by_autograd, module_unusable

MAX_RESIDUALS = 13  # FLA's KDA 7 (gate cumsum, Aqk, Akk, normalised q/k and rstd) + its 6 kept intermediates


@dataclass(frozen=True)
class DeltaRuleOptions:
    """The non-tensor arguments every delta-rule call has, after validation and defaulting."""

    scale: float
    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    chunk_size: int = 64


class ReferenceBackend:
    """Plain-torch chunked math (the op's ``reference.py``). Any device; backward by autograd of the forward.
    A subclass names its op's reference function (``math``, with the delta rule's keyword arguments) and the
    options of its gate form it takes (``gate_options``)."""

    name = "reference"
    math = None  # the op's reference function: (q, k, v, g, beta, *, scale, ...) -> (o, final state)

    @staticmethod
    def gate_options(opts) -> dict:
        """The keyword arguments of ``math`` beyond the delta rule's (KDA: its lower-bound gate)."""
        return {}

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

    def _forward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts):
        return self.math(
            q, k, v, g, beta, scale=opts.scale, initial_state=h0, cu_seqlens=cu_seqlens, A_log=A_log,
            dt_bias=dt_bias, use_qk_l2norm_in_kernel=opts.use_qk_l2norm_in_kernel,
            use_gate_in_kernel=opts.use_gate_in_kernel, use_beta_sigmoid_in_kernel=opts.use_beta_sigmoid_in_kernel,
            allow_neg_eigval=opts.allow_neg_eigval, chunk_size=opts.chunk_size, **self.gate_options(opts))


def own_kernel(module: str, launcher: str):
    """``(unusable, launch)`` of a backend on our own kernels, both cached: ``unusable()`` why ``module`` (the
    launcher's module, which needs triton) cannot be imported here, or None; ``launch()`` its function
    ``launcher``, imported on first use (importing the op layer never needs triton). A backend module binds them
    to its own names and calls them through those (tests replace them there)."""

    @cache
    def unusable() -> str | None:
        return module_unusable(module)

    @cache
    def launch():
        return getattr(importlib.import_module(module), launcher)

    return unusable, launch
