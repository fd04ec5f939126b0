"""The rewrite report: which sites of each compiled graph became which op, which candidates were
left alone and why, and which ops fell back to a slower implementation.

Every graph the ``kda_compile`` backend compiles is logged at INFO on ``kda_compile.report`` and
kept as data:

- ``kda_compile.report(model)``: the graphs of a model returned by :func:`kda_compile.optimize`
  (or of the model it was made from);
- ``kda_compile.report()``: every graph compiled in this process, latest last (the most recent
  :data:`HISTORY` graphs), e.g. after ``torch.compile(model, backend="kda_compile")``.
"""
from __future__ import annotations

import collections
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from kda_compile.ops._common import FallbackEvent, fallback_events
from kda_compile.passes.manager import GraphReport, LeftAlone, Rewritten

logger = logging.getLogger("kda_compile.report")

HISTORY = 256  # graphs kept for report() without a model

_history: collections.deque[GraphReport] = collections.deque(maxlen=HISTORY)
_history_lock = threading.Lock()
_sources: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Report:
    """The rewrite report of some compiled graphs.

    Attributes:
        graphs: one :class:`~kda_compile.passes.GraphReport` per compiled graph, in compile order.
        fallbacks: every op fallback seen in this process (op, implementation run, reason) with
            its call count; process-wide, since ops do not know which model called them.
    """

    graphs: tuple[GraphReport, ...]
    fallbacks: tuple[tuple[FallbackEvent, int], ...] = ()

    @property
    def rewritten(self) -> tuple[Rewritten, ...]:
        return tuple(r for g in self.graphs for r in g.rewritten)

    @property
    def left_alone(self) -> tuple[LeftAlone, ...]:
        return tuple(c for g in self.graphs for c in g.left_alone)

    def __str__(self) -> str:
        if not self.graphs:
            lines = ["no graph compiled by kda_compile yet"]
        else:
            lines = [g.summary() for g in self.graphs]
        for event, count in self.fallbacks:
            lines.append(f"fallback: {event.op} ran {event.chosen} ({count} calls): {event.reason}")
        return "\n".join(lines)


_last_key: list[Any] = [None]


def record_graph(graph: GraphReport, key: Any = None) -> None:
    """Keep a compiled graph's report and log it (INFO). A report with the same ``key`` as the
    previous one (Dynamo restarted the analysis of that graph) replaces it."""
    with _history_lock:
        if key is not None and _last_key[0] == key and _history:
            _history[-1] = graph
        else:
            _history.append(graph)
        _last_key[0] = key
    logger.info("%s", graph.summary())


def attach(compiled: Any, backend: Any, *originals: Any) -> None:
    """Make ``report(x)`` answer with ``backend.reports`` for the compiled object and its originals."""
    for obj in (compiled, *originals):
        try:
            _sources[obj] = backend
        except TypeError:  # not weak-referenceable: report() without an argument still works
            pass


def report(model: Any = None) -> Report:
    """The rewrite report of ``model`` (a model returned by :func:`kda_compile.optimize`, or the
    model it was made from), or with no argument of every graph compiled in this process."""
    fallbacks = tuple(sorted(fallback_events().items(), key=lambda item: (item[0].op, item[0].chosen)))
    if model is None:
        with _history_lock:
            return Report(tuple(_history), fallbacks)
    backend = _sources.get(model) if _weakrefable(model) else None
    if backend is None:
        raise ValueError(
            f"model must be a model returned by kda_compile.optimize (or the model given to it), got "
            f"{type(model).__name__}; for torch.compile(..., backend='kda_compile') call kda_compile.report()")
    return Report(tuple(backend.reports), fallbacks)


def clear_reports() -> None:
    """Forget the graphs kept for ``report()`` without a model (tests, long-running processes)."""
    with _history_lock:
        _history.clear()
        _last_key[0] = None


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
        return True
    except TypeError:
        return False
