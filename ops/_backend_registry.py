"""The backend registry an op family (KDA, GDN) chooses its implementations from: ``(priority, backend)``
entries, highest priority first, the ``only_backends`` restriction, and the one selection loop both families use
(:meth:`BackendRegistry.select`; how it maps onto the kernel menu: docs/kernel-choice.md, section 3).

The restriction is process-wide, not thread-local: autograd runs a CUDA backward on its own device thread, and
a restriction that thread did not see sent the backward of a reference forward to FLA's kernels with no
residuals. (The forward's backend is also recorded for its backward: ``custom_ops.py``.)
"""
from __future__ import annotations

import contextlib
import logging

from kda_compile.ops._common import record_fallback

RECORDED = ("on the reference", "past any backend")


class BackendRegistry:
    def __init__(self, family: str, reference, recorded: str) -> None:
        """``recorded``: which CUDA calls are fallbacks: those that land "on the reference" (KDA: a faster
        backend of ours may serve what FLA does not without it counting), or those that pass "past any
        backend" (GDN: its backends are ordered by speed for every call they take)."""
        if recorded not in RECORDED:
            raise ValueError(f"recorded must be one of {RECORDED}, got {recorded!r}")
        self.family = family
        self.reference = reference  # serves every call; always allowed
        self.recorded = recorded
        self.entries: list[tuple[int, object]] = [(0, reference)]
        self.allowed: frozenset[str] | None = None  # the names ``only`` allows now; None: all
        self._logged_preferences: set[tuple[str, str, str]] = set()  # (op, backend, reason) already logged
        self._logger = logging.getLogger(f"kda_compile.ops.{family.lower()}")

    def register(self, backend, priority: int) -> None:
        """Add a backend; the highest-priority backend that supports a call serves it."""
        self.entries.append((priority, backend))
        self.entries.sort(key=lambda item: -item[0])

    def names(self) -> list[str]:
        return [backend.name for _, backend in self.entries]

    def named(self, name: str):
        """The registered backend called ``name`` (a backward runs on the backend its forward ran on)."""
        for _, backend in self.entries:
            if backend.name == name:
                return backend
        raise ValueError(f"backend must name a registered {self.family} backend ({', '.join(self.names())}), "
                         f"got {name!r}")

    @contextlib.contextmanager
    def only(self, *names: str):
        """Within the block, only the named backends (and the reference) may serve calls, in every thread
        (autograd's backward threads included). Meant for tests and benchmarks, not for concurrent use."""
        known = self.names()
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"names must be registered {self.family} backends ({', '.join(known)}), got {unknown}")
        previous = self.allowed
        self.allowed = frozenset(names) | {self.reference.name}
        try:
            yield
        finally:
            self.allowed = previous

    def select(self, op: str, device, dtype, K: int, V: int, opts):
        """The backend that serves this call of ``op``: the allowed backends that serve ``op``, those whose
        ``preferred_reason`` speaks first (logged once at INFO), then by priority; a backend whose ``in_design``
        is false is skipped silently, one whose ``unsupported_reason`` speaks is passed over with it. A CUDA call
        is recorded as a fallback as ``recorded`` says."""
        allowed = self.allowed
        candidates = [backend for _, backend in self.entries
                      if (allowed is None or backend.name in allowed) and op in getattr(backend, "serves", (op,))]
        preferred = {backend: why for backend in candidates if hasattr(backend, "preferred_reason")
                     and (why := backend.preferred_reason(device, dtype, K, V, opts))}
        reasons = []
        for backend in list(preferred) + [backend for backend in candidates if backend not in preferred]:
            in_design = getattr(backend, "in_design", None)
            if in_design is not None and not in_design(device, dtype, K, V, opts):
                continue  # an extra fast path that does not take this call: serving it elsewhere is no fallback
            reason = backend.unsupported_reason(device, dtype, K, V, opts)
            if reason is not None:
                reasons.append(f"{backend.name}: {reason}")
                continue
            if device.type == "cuda":
                if self.recorded == "on the reference" and backend is self.reference:
                    record_fallback(op, backend.name, "; ".join(reasons) or "no fast backend registered")
                elif self.recorded == "past any backend" and reasons:
                    record_fallback(op, backend.name, "; ".join(reasons))
            if backend in preferred and (op, backend.name, preferred[backend]) not in self._logged_preferences:
                self._logged_preferences.add((op, backend.name, preferred[backend]))
                self._logger.info("%s: %s serves this call ahead of its priority: %s", op, backend.name,
                                  preferred[backend])
            return backend
        raise AssertionError(f"the {self.family} reference backend supports every call")  # unreachable

    def explicitly_requested(self, name: str) -> bool:
        """Whether an ``only`` block names ``name`` (lets a backend serve beyond its usual devices)."""
        return self.allowed is not None and name in self.allowed
