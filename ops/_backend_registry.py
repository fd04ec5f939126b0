"""The backend registry an op family (KDA, GDN) chooses its implementations from: ``(priority, backend)``
entries, highest priority first, and the ``only_backends`` restriction.

The restriction is process-wide, not thread-local: autograd runs a CUDA backward on its own device thread, and
a restriction that thread did not see sent the backward of a reference forward to FLA's kernels with no
residuals. (The forward's backend is also recorded for its backward: ``custom_ops.py``.)
"""
from __future__ import annotations

import contextlib


class BackendRegistry:
    def __init__(self, family: str, reference) -> None:
        self.family = family
        self.reference = reference  # serves every call; always allowed
        self.entries: list[tuple[int, object]] = [(0, reference)]
        self.allowed: frozenset[str] | None = None  # the names ``only`` allows now; None: all

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

    def explicitly_requested(self, name: str) -> bool:
        """Whether an ``only`` block names ``name`` (lets a backend serve beyond its usual devices)."""
        return self.allowed is not None and name in self.allowed
