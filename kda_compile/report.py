"""The rewrite report: which sites of each compiled graph became which op, which candidates were
left alone and why, and which ops fell back to a slower implementation.

Every graph the ``kda_compile`` backend compiles is logged at INFO on ``kda_compile.report`` and
kept as data:

- ``kda_compile.report(model)``: the graphs of a model returned by :func:`kda_compile.optimize`
  (or of the model it was made from);
- ``kda_compile.report()``: every graph compiled in this process, latest last (the most recent
  :data:`HISTORY` graphs), e.g. after ``torch.compile(model, backend="kda_compile")``.

It also lists the graph breaks Dynamo made during calls of an :func:`kda_compile.optimize` result
(:class:`GraphBreak`: the model line and Dynamo's reason), read from Dynamo's ``graph_breaks`` log
artifact (the one ``TORCH_LOGS="graph_breaks"`` shows): while such a call runs, that logger is set
to DEBUG with its propagation off (unless the user enabled it already, in which case it is only
listened to), then restored, so nothing is printed. A break Dynamo already reported in this
process for the same code location is reported again in a shorter form, still recorded.

It also lists the frames Dynamo ran eagerly during a call of a :func:`kda_compile.optimize` result
instead of compiling them (:class:`EagerFallback`): a recompile limit hit (Dynamo then runs that
code object's new inputs eagerly for the rest of the process) or a compile error Dynamo suppressed.
They are read from the warning Dynamo logs on ``torch._dynamo.convert_frame`` (the one log line
every torch version since 2.1 emits for these events) by a handler kda_compile installs there,
which records only what happens inside calls of an ``optimize()`` result; each code object is
also logged once at WARNING on ``kda_compile.report``. A Dynamo log level above WARNING
(``TORCH_LOGS="-dynamo"``) silences that warning, and with it this record.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from kda_compile.cuda_graphs import PREFILL_REASON, clear_inductor_skips, inductor_skips
from kda_compile.ops._common import FallbackEvent, fallback_events
from kda_compile.passes.manager import GraphReport, LeftAlone, Rewritten

logger = logging.getLogger("kda_compile.report")

HISTORY = 256  # graphs kept for report() without a model

_history: collections.deque[GraphReport] = collections.deque(maxlen=HISTORY)
_history_lock = threading.Lock()
_sources: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class EagerFallback:
    """Dynamo ran a frame eagerly during calls of an ``optimize()`` result instead of compiling it.

    Attributes:
        function: the code object, as Dynamo names it: ``'forward' (path/to/file.py:123)``.
        kind: ``"recompile_limit"`` or ``"accumulated_recompile_limit"`` (the
            ``torch._dynamo.config`` limit that was hit), or ``"compile error"`` (Dynamo suppressed
            an error, ``torch._dynamo.config.suppress_errors``).
        limit: the limit's value when it was hit (None for a compile error).
        reason: Dynamo's last recompile reason, or the error.
        count: how many times Dynamo reported it. After a limit hit Dynamo stops compiling that
            code object (inputs no compiled graph accepts run eagerly, unreported), so this counts
            the reports, not the eager calls.
    """

    function: str
    kind: str
    limit: int | None
    reason: str
    count: int = 1

    def summary(self) -> str:
        reason = self.reason if len(self.reason) <= 300 else self.reason[:297] + "..."
        if self.limit is None:
            return (f"eager fallback: {self.function} ran eagerly ({self.kind}, reported {self.count}x): {reason}")
        return (f"eager fallback: {self.function} runs eagerly for inputs no compiled graph accepts: Dynamo hit "
                f"torch._dynamo.config.{self.kind} ({self.limit}) (reported {self.count}x); last reason: {reason}")


@dataclass(frozen=True)
class GraphBreak:
    """Dynamo broke the graph at ``location`` (model file:line) during calls of an ``optimize()``
    result, for ``reason`` (Dynamo's graph-break type and explanation), ``count`` times."""

    location: str
    reason: str
    count: int = 1

    def summary(self) -> str:
        return f"graph break at {self.location} (x{self.count}): {self.reason}"


@dataclass(frozen=True)
class Report:
    """The rewrite report of some compiled graphs.

    Attributes:
        graphs: one :class:`~kda_compile.passes.GraphReport` per compiled graph, in compile order.
        fallbacks: every op fallback seen in this process (op, implementation run, reason) with
            its call count; process-wide, since ops do not know which model called them.
        eager_fallbacks: the frames Dynamo ran eagerly instead of compiling during calls of this
            model (or, for ``report()``, of any ``optimize()`` result), one per code object and kind.
        graph_breaks: the graph breaks Dynamo made during those calls, one per location and reason.
        inductor_cudagraph_skips: Inductor's own "skipping cudagraphs due to ..." messages seen while
            our graphs compiled or ran, with their counts (process-wide, like ``fallbacks``).
    """

    graphs: tuple[GraphReport, ...]
    fallbacks: tuple[tuple[FallbackEvent, int], ...] = ()
    eager_fallbacks: tuple[EagerFallback, ...] = ()
    graph_breaks: tuple[GraphBreak, ...] = ()
    inductor_cudagraph_skips: tuple[tuple[str, int], ...] = ()

    @property
    def cuda_graph_fallbacks(self) -> tuple[str, ...]:
        """Graphs compiled with CUDA graphs asked for that run without them for a reason other than
        being a prefill (which is never captured, by design), and Inductor's own skips."""
        left_out = tuple(f"graph {g.graph}: {g.cuda_graphs}" for g in self.graphs
                         if g.cuda_graphs.startswith("cuda graphs: not captured")
                         and PREFILL_REASON not in g.cuda_graphs)
        return left_out + tuple(f"Inductor ({count}x): {msg}" for msg, count in self.inductor_cudagraph_skips)

    @property
    def rewritten(self) -> tuple[Rewritten, ...]:
        return tuple(r for g in self.graphs for r in g.rewritten)

    @property
    def left_alone(self) -> tuple[LeftAlone, ...]:
        return tuple(c for g in self.graphs for c in g.left_alone)

    def __str__(self) -> str:
        if self.graphs:
            lines = [g.summary() for g in self.graphs]
        elif self.eager_fallbacks:
            lines = ["no graph compiled by kda_compile: Dynamo ran the calls eagerly (eager fallback below)"]
        else:
            lines = ["no graph compiled by kda_compile yet"]
        lines.extend(e.summary() for e in self.eager_fallbacks)
        lines.extend(b.summary() for b in self.graph_breaks)
        for event, count in self.fallbacks:
            lines.append(f"fallback: {event.op} ran {event.chosen} ({count} calls): {event.reason}")
        lines.extend(f"cuda graphs fallback: {entry}" for entry in self.cuda_graph_fallbacks)
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
            return Report(tuple(_history), fallbacks, tuple(_all_eager.values()), tuple(_all_breaks.values()),
                          inductor_skips())
    backend = _sources.get(model) if _weakrefable(model) else None
    if backend is None:
        raise ValueError(
            f"model must be a model returned by kda_compile.optimize (or the model given to it), got "
            f"{type(model).__name__}; for torch.compile(..., backend='kda_compile') call kda_compile.report()")
    with _history_lock:
        eager = tuple(_eager.get(backend, {}).values())
        breaks = tuple(_breaks.get(backend, {}).values())
    return Report(tuple(backend.reports), fallbacks, eager, breaks, inductor_skips())


def clear_reports() -> None:
    """Forget the graphs and eager fallbacks kept for ``report()`` without a model (tests,
    long-running processes)."""
    with _history_lock:
        _history.clear()
        _last_key[0] = None
        _all_eager.clear()
        _all_breaks.clear()
        _warned.clear()
    clear_inductor_skips()


# ---------------------------------------------------------------------------------------------
# Eager fallbacks: Dynamo's warnings during calls of an optimize() result
# ---------------------------------------------------------------------------------------------
DYNAMO_LOGGER = "torch._dynamo.convert_frame"  # where Dynamo warns of a limit hit / suppressed error

_eager: "weakref.WeakKeyDictionary[Any, dict[tuple[str, str], EagerFallback]]" = weakref.WeakKeyDictionary()
_all_eager: dict[tuple[str, str], EagerFallback] = {}
_warned: set[tuple[str, str]] = set()
_calls = threading.local()  # .owners: the backends of the optimize() results being called, innermost last

_LIMIT_RE = re.compile(r"torch\._dynamo hit config\.(\w+) \((\d+)\)\s*\n\s*function: (.*)\n\s*last reason: (.*)")
_WONT_RE = re.compile(r"WON'T CONVERT (\S+) (.+) line (\d+)")


def parse_dynamo_warning(record: logging.LogRecord) -> EagerFallback | None:
    """The eager fallback a Dynamo warning announces, or None for any other record."""
    msg = record.msg if isinstance(record.msg, str) else ""
    args = record.args if isinstance(record.args, tuple) else ()
    if msg.startswith("torch._dynamo hit config.") and len(args) >= 4:
        kind, value, function, reason = args[:4]
        limit = value if isinstance(value, int) else None
        return EagerFallback(str(function), str(kind), limit, str(reason).strip())
    try:
        text = record.getMessage()
    except Exception:  # noqa: BLE001  (a malformed record is not ours to report)
        return None
    match = _LIMIT_RE.match(text)
    if match:
        kind, value, function, reason = match.groups()
        return EagerFallback(function.strip(), kind, int(value), reason.strip())
    match = _WONT_RE.match(text)
    if match:
        name, filename, line = match.groups()
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return EagerFallback(f"'{name}' ({filename}:{line})", "compile error", None, lines[-1] if lines else "")
    return None


def record_eager_fallback(owner: Any, event: EagerFallback) -> None:
    """Count ``event`` for ``owner`` (an optimize() result's backend) and process-wide; log the
    first one of each code object and kind at WARNING."""
    key = (event.function, event.kind)
    with _history_lock:
        per_owner = _eager.setdefault(owner, {})
        for table in (per_owner, _all_eager):
            seen = table.get(key)
            table[key] = event if seen is None else dataclasses.replace(
                event, count=seen.count + 1)
        first = key not in _warned
        _warned.add(key)
    if first:
        logger.warning("kda_compile: %s; kda_compile.report(model) lists it", event.summary())


class _DynamoFallbackHandler(logging.Handler):
    """Records Dynamo's eager-fallback warnings emitted during calls of an optimize() result."""

    def emit(self, record: logging.LogRecord) -> None:
        owners = getattr(_calls, "owners", None)
        if not owners:
            return  # not inside a call of ours: not our frame
        try:
            event = parse_dynamo_warning(record)
            if event is not None:
                record_eager_fallback(owners[-1], event)
        except Exception:  # noqa: BLE001  (a report must never break the user's call)
            self.handleError(record)


_handler = _DynamoFallbackHandler(logging.WARNING)


_dynamo_logger = logging.getLogger(DYNAMO_LOGGER)


def install_fallback_handler() -> None:
    """Attach the handlers to Dynamo's loggers (again, should something have removed them)."""
    if _handler not in _dynamo_logger.handlers:
        _dynamo_logger.addHandler(_handler)
    if _break_handler not in _break_logger.handlers:
        _break_logger.addHandler(_break_handler)


def enter_calls_of(owner: Any) -> None:
    """Attribute Dynamo's eager-fallback warnings and graph breaks to ``owner`` (a backend) until
    :func:`exit_calls_of`; a pair around each call of an optimize() result (no context manager:
    this is on every call's path)."""
    owners = getattr(_calls, "owners", None)
    if owners is None:
        owners = _calls.owners = []
    owners.append(owner)
    with _listen_lock:
        _listening[0] += 1
        if _listening[0] == 1 and not _break_logger.isEnabledFor(logging.DEBUG):
            _restore_break_logger[:] = [(_break_logger.level, _break_logger.propagate)]
            _break_logger.propagate = False  # recorded here only, never printed
            _break_logger.setLevel(logging.DEBUG)


def exit_calls_of() -> None:
    """Ends the innermost :func:`enter_calls_of`."""
    _calls.owners.pop()
    with _listen_lock:
        _listening[0] -= 1
        if _listening[0] == 0 and _restore_break_logger:
            level, propagate = _restore_break_logger.pop()
            _break_logger.setLevel(level)
            _break_logger.propagate = propagate


# ---------------------------------------------------------------------------------------------
# Graph breaks: Dynamo's graph_breaks log artifact during calls of an optimize() result
# ---------------------------------------------------------------------------------------------
BREAK_LOGGER = "torch._dynamo.symbolic_convert.__graph_breaks"  # torch._logging.getArtifactLogger's name
_break_logger = logging.getLogger(BREAK_LOGGER)
_breaks: "weakref.WeakKeyDictionary[Any, dict[tuple[str, str], GraphBreak]]" = weakref.WeakKeyDictionary()
_all_breaks: dict[tuple[str, str], GraphBreak] = {}
_listening = [0]  # calls of optimize() results in progress (all threads)
_restore_break_logger: list[tuple[int, bool]] = []
_listen_lock = threading.Lock()
_BREAK_RE = re.compile(r"in user code at ([^\n]*):(\d+)\nGraph Break Reason: (.*?)(?:\nUser code traceback|$)",
                       re.DOTALL)
_BREAK_NOISE = ("Encountered graph break when attempting", "Developer debug context", "For more details")


def parse_graph_break(text: str) -> GraphBreak | None:
    """The graph break a Dynamo ``graph_breaks`` log message announces (the break type, Dynamo's
    explanation and hint, without the generic preamble and links), or None."""
    match = _BREAK_RE.search(text)
    if match is None:
        return None
    path, line, reason = match.groups()
    parts = [part.strip() for part in reason.splitlines() if part.strip()]
    reason = " | ".join(part for part in parts if not part.startswith(_BREAK_NOISE)) or " | ".join(parts)
    reason = reason if len(reason) <= 400 else reason[:397] + "..."
    return GraphBreak(f"{os.path.basename(path)}:{line}", reason)


def record_graph_break(owner: Any, event: GraphBreak) -> None:
    key = (event.location, event.reason)
    with _history_lock:
        for table in (_breaks.setdefault(owner, {}), _all_breaks):
            seen = table.get(key)
            table[key] = event if seen is None else dataclasses.replace(seen, count=seen.count + 1)
    logger.debug("kda_compile: %s", event.summary())


class _GraphBreakHandler(logging.Handler):
    """Records Dynamo's graph-break log lines emitted during calls of an optimize() result."""

    def emit(self, record: logging.LogRecord) -> None:
        owners = getattr(_calls, "owners", None)
        if not owners:
            return
        try:
            event = parse_graph_break(record.getMessage())
            if event is not None:
                record_graph_break(owners[-1], event)
        except Exception:  # noqa: BLE001  (a report must never break the user's call)
            self.handleError(record)


_break_handler = _GraphBreakHandler(logging.DEBUG)


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
        return True
    except TypeError:
        return False
