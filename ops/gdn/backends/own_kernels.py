"""What GDN's backends on our own Triton kernels (``prefill/backend.py``, ``decode/backend.py``) share: a launch on
the inputs' device that, when its kernel fails to compile, remembers the call variant and hands the call to the
next backend below them (FLA, the KDA route, the reference), recorded as a fallback.

A Triton kernel that fails to compile for a call variant is our bug, not the user's: the call is still served,
and that variant is not tried on our kernel again.
"""
from __future__ import annotations

import contextlib
from typing import Callable

from kda_compile.ops._common import compile_failure_reason, on_device, record_fallback, triton_compile_errors
from kda_compile.ops.gdn.backends.registry import REFERENCE


def call_variant(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts, output_final_state) -> tuple:
    """What selects one compiled kernel variant of a GDN call."""
    return (q.device, q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, tuple(q.shape[2:]), tuple(v.shape[2:]),
            cu_seqlens is not None and cu_seqlens.dtype, h0 is not None and h0.dtype, output_final_state,
            A_log is not None, dt_bias is not None, opts)


def launch_or_fall_back(failed: dict, kernels: str, op: str, variant_args: tuple, launch: Callable[[], object],
                        serve_elsewhere: Callable[[object], object]):
    """``launch()`` on the inputs' device unless this call's variant failed to compile before (``failed``:
    variant -> reason, updated here); otherwise ``serve_elsewhere(backend)`` with the next backend, recorded for
    ``op``. ``variant_args``: :func:`call_variant`'s arguments (q first, v third, opts tenth); the variant is built
    only once some variant has failed (decode is host-bound)."""
    q, v, opts = variant_args[0], variant_args[2], variant_args[9]
    reason = failed.get(call_variant(*variant_args)) if failed else None
    if reason is None:
        try:
            with on_device(q.device.index) if q.is_cuda else contextlib.nullcontext():
                return launch()
        except triton_compile_errors() as error:
            reason = compile_failure_reason(kernels, error)
            failed[call_variant(*variant_args)] = reason
    fallback = next_backend(q, v, opts)
    record_fallback(op, fallback.name, reason)
    return serve_elsewhere(fallback)


def next_backend(q, v, opts):
    """The backend that serves a call our kernels could not run: FLA's kernels, else the KDA route, else the
    reference (the registry's order below our kernels)."""
    from kda_compile.ops.gdn.backends.fla import FLAGDNBackend
    from kda_compile.ops.gdn.backends.kda import KDAKernelsBackend

    for backend in (FLAGDNBackend(), KDAKernelsBackend()):
        if backend.unsupported_reason(q.device, q.dtype, q.shape[-1], v.shape[-1], opts) is None:
            return backend
    return REFERENCE
