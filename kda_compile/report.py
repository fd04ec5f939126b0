"""The rewrite report: which sites of each compiled graph became which op, which candidates were
left alone and why, which rewrites the Config switched off, and which ops fell back to a slower
implementation.

Every graph the ``kda_compile`` backend compiles is logged at INFO on ``kda_compile.report`` and
kept as data:

- ``kda_compile.report(model)``: the graphs of a model returned by :func:`kda_compile.optimize`
  (or of the model it was made from);
- ``kda_compile.report(compiled)`` for ``compiled = torch.compile(model, backend="kda_compile")`` (or
  ``model.compile(backend="kda_compile")``, or a function compiled so): the graphs that process-wide
  backend traced for that model (its frames and those of its submodules) or function (its frames and
  their continuations after a graph break). Dynamo runs another instance of the same class with the
  graphs it already has when their guards pass, without tracing it again: such an instance's report
  has no graph of its own and says so;
- ``kda_compile.report()``: every graph compiled in this process, latest last (the most recent
  :data:`HISTORY` graphs).

How it reads. ``print(report)`` (``str(report)``, ``report.format()``) is the default form: each graph
is headed by the callable Dynamo traced it from (``graph 0/1 of LlamaForCausalLM.forward: ...``), then
one line a site of at most :data:`~kda_compile.passes.report.WIDTH` (160) characters: the module path,
the model line, the op it became and its keywords; flags that are off and None values are left out,
flags that are on are named, and what does not fit is counted (``+5 more``). Sizes are numbers, or
``dynamic`` where the graph has a symbolic size (never a sympy expression such as ``Min(6, s50)``). The
rewrites the Config switched off are one line, ``disabled: sdpa_attention, ...``.
``report.format(verbose=True)`` is the full form: every rewrite of a site on its own line with all its
keywords, every reason uncut. The entries themselves (``report.rewritten``, ``Rewritten.details``) keep
the values the rewrites recorded.

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

import dataclasses
import logging
import os
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

from kda_compile.cuda_graphs import PREFILL_REASON, clear_inductor_skips, inductor_skips
from kda_compile.ops._common import FallbackEvent, fallback_events
from kda_compile.passes.report import WIDTH, GraphReport, LeftAlone, Rewritten, clip
from kda_compile import backend as backends
from kda_compile import compile_scope
from kda_compile.report_frames import reuse_note, torch_compiled, traced_for
from kda_compile.report_history import HISTORY  # noqa: F401  (report()'s docstring names it)
from kda_compile.report_history import history as _history, last_key as _last_key, lock as _history_lock

logger = logging.getLogger("kda_compile.report")

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
    result, for ``reason`` (Dynamo's graph-break type and explanation), ``count`` times. ``path`` is the
    full path of the file, as Dynamo logged it (strict mode tells kda_compile's own files by it)."""

    location: str
    reason: str
    count: int = 1
    path: str = dataclasses.field(default="", compare=False)

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
        notes: what the graphs alone do not say (a model Dynamo runs with another instance's graphs).

    ``str(report)`` is :meth:`format`'s default form; ``report.format(verbose=True)`` the full one.
    """

    graphs: tuple[GraphReport, ...]
    fallbacks: tuple[tuple[FallbackEvent, int], ...] = ()
    eager_fallbacks: tuple[EagerFallback, ...] = ()
    graph_breaks: tuple[GraphBreak, ...] = ()
    inductor_cudagraph_skips: tuple[tuple[str, int], ...] = ()
    notes: tuple[str, ...] = ()

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

    def format(self, verbose: bool = False, width: int = WIDTH) -> str:
        """The report as text: the default form (one line a site within ``width`` characters, sizes
        concrete or ``dynamic``), or with ``verbose`` every keyword and reason in full (module docstring)."""
        lines: list[str] = []
        shortened = 0
        for graph in self.graphs:
            block, cut = graph.render(verbose, width)
            lines += block
            shortened += cut
        if not self.graphs and not self.notes:
            lines.append("no graph compiled by kda_compile: Dynamo ran the calls eagerly (eager fallback below)"
                         if self.eager_fallbacks else "no graph compiled by kda_compile yet")
        lines += self.notes
        lines += disabled_lines(self.graphs)
        lines.extend(e.summary() for e in self.eager_fallbacks)
        lines.extend(b.summary() for b in self.graph_breaks)
        slower = [f"fallback: {event.op} ran {event.chosen} ({count} calls): {event.reason}"
                  for event, count in self.fallbacks]
        slower += [f"cuda graphs fallback: {entry}" for entry in self.cuda_graph_fallbacks]
        for line in slower:  # an op's reason may quote a compiler's whole message: cut in the default form
            line, cut = (line, 0) if verbose else clip(line, width)
            lines.append(line)
            shortened += cut
        if shortened:
            lines.append(f"(lines cut to {width} characters: report.format(verbose=True) has every keyword and reason)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def disabled_lines(graphs: Iterable[GraphReport]) -> list[str]:
    """``disabled: a, b``: the rewrites the graphs' Config switched off. Graphs compiled under several
    Configs (``report()`` of several optimize() results) get a line for each set that is not empty."""
    by_set: dict[tuple[str, ...], list[str]] = {}
    for graph in graphs:
        by_set.setdefault(graph.disabled, []).append(graph.graph)
    if len(by_set) == 1:
        (names,) = by_set
        return [f"disabled: {', '.join(names)}"] if names else []
    return [f"disabled in graph(s) {', '.join(labels)}: {', '.join(names)}"
            for names, labels in by_set.items() if names]


def attach(compiled: Any, backend: Any, *originals: Any) -> None:
    """Make ``report(x)`` answer with ``backend.reports`` for the compiled object and its originals."""
    for obj in (compiled, *originals):
        try:
            _sources[obj] = backend
        except TypeError:  # not weak-referenceable: report() without an argument still works
            pass


def compiled_by(model: Any) -> tuple[Any, Any]:
    """The kda_compile backend whose graphs ``model`` runs, and what they were traced for: the model or
    function torch.compile was given, or ``model`` itself if the default backend traced graphs for it."""
    found = torch_compiled(model)
    if found is not None:
        compiler, name, target = found
        if compiler is backends.kda_compile_backend:
            return backends._default_backend, target
        if isinstance(compiler, backends.KdaCompileBackend):
            return compiler, target
        raise ValueError(f"model must be compiled by kda_compile, got {type(model).__name__} compiled with "
                         f"backend {name!r}: kda_compile has no report of it")
    default, mine = backends._default_backend, traced_for(model)
    if any(mine(g.frame) for g in list(default.reports)):
        return default, model
    raise ValueError(
        f"model must be a model returned by kda_compile.optimize (or the model given to it) or compiled with "
        f"torch.compile(..., backend='kda_compile'), got {type(model).__name__}; kda_compile.report() lists "
        f"every graph compiled in this process")


def report(model: Any = None) -> Report:
    """The rewrite report of ``model``, or with no argument of every graph compiled in this process.

    ``model`` is a model (or function) returned by :func:`kda_compile.optimize` or the one it was made
    from; or a result of ``torch.compile(..., backend="kda_compile")`` (or of a ``KdaCompileBackend``), a
    module whose ``.compile()`` or ``forward`` was compiled so, or once it ran the model given to such a
    compile: then the report holds the graphs the backend traced for it (module docstring).
    """
    fallbacks = tuple(sorted(fallback_events().items(), key=lambda item: (item[0].op, item[0].chosen)))
    if model is None:
        with _history_lock:
            return Report(tuple(_history), fallbacks, tuple(_all_eager.values()), tuple(_all_breaks.values()),
                          inductor_skips())
    backend = _sources.get(model) if _weakrefable(model) else None
    if backend is not None:
        with _history_lock:
            eager = tuple(_eager.get(backend, {}).values())
            breaks = tuple(_breaks.get(backend, {}).values())
        return Report(tuple(backend.reports), fallbacks, eager, breaks, inductor_skips(), config_notes(backend))
    backend, target = compiled_by(model)
    mine = traced_for(target)
    graphs = tuple(g for g in list(backend.reports) if mine(g.frame))
    return Report(graphs, fallbacks, inductor_cudagraph_skips=inductor_skips(),
                  notes=reuse_note(backend, target, graphs) + data_dependent_break_note() + config_notes(backend))


def config_notes(backend: Any) -> tuple[str, ...]:
    """What a backend's Config turns on that trades a check for speed, so that a report says so."""
    if getattr(getattr(backend, "config", None), "skip_decode_guards", False):
        return ("skip_decode_guards: warm CUDA-graph decode steps run with only Dynamo's differentiating guards "
                "(a module, parameter or config attribute replaced between steps goes unseen; "
                "docs/cuda-graphs.md, section 9)",)
    return ()


DATA_DEPENDENT_BREAKS = ("capture_scalar_outputs=False", "capture_dynamic_output_shape_ops")


def data_dependent_break_note() -> tuple[str, ...]:
    """For a model compiled with ``torch.compile(..., backend=...)`` of ours: the graph breaks Dynamo made in this
    process at data-dependent ops (MoE routing's ``.item()``, ``nonzero``), which a backend with
    ``Config(capture_data_dependent_ops=False)`` (or a Dynamo whose hooks kda_compile could not adapt) leaves,
    with the two Dynamo options that capture them."""
    from torch._dynamo.utils import counters

    count = sum(n for reason, n in counters.get("graph_break", {}).items()
                if any(key in str(reason) for key in DATA_DEPENDENT_BREAKS))
    if not count:
        return ()
    return (f"note: Dynamo broke the graph {count}x in this process at data-dependent ops (.item(), nonzero: e.g. "
            "MoE routing), and an attention cut by a break is left as written; kda_compile.optimize() captures "
            "them, or set torch._dynamo.config.capture_scalar_outputs = True and capture_dynamic_output_shape_ops "
            "= True before torch.compile",)


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
    this is on every call's path). Dynamo logs graph breaks only while it traces, so the graph-break
    logger is switched on by the compiles of the call (:func:`_start_listening`, a
    kda_compile.compile_scope hook), not by the call itself."""
    owners = getattr(_calls, "owners", None)
    if owners is None:
        owners = _calls.owners = []
    owners.append(owner)


def exit_calls_of() -> None:
    """Ends the innermost :func:`enter_calls_of`."""
    _calls.owners.pop()


def _start_listening() -> None:
    """The graph-break logger on (and silent: its records come here only) while a compile inside a call of
    ours runs; nested and concurrent starts are counted, the first switches it on."""
    with _listen_lock:
        _listening[0] += 1
        if _listening[0] == 1 and not _break_logger.isEnabledFor(logging.DEBUG):
            _restore_break_logger[:] = [(_break_logger.level, _break_logger.propagate)]
            _break_logger.propagate = False  # recorded here only, never printed
            _set_break_level(logging.DEBUG)


def _stop_listening(_started: Any = None) -> None:
    """Ends a :func:`_start_listening`; the last one restores the logger as it was."""
    with _listen_lock:
        _listening[0] -= 1
        if _listening[0] == 0 and _restore_break_logger:
            level, propagate = _restore_break_logger.pop()
            _set_break_level(level)
            _break_logger.propagate = propagate


compile_scope.add_compile_hook(_start_listening, _stop_listening)


_known_loggers = [0, []]  # (size of logging's registry when last looked, the break logger's descendants)


def _set_break_level(level: int) -> None:
    """The break logger's level, without ``Logger.setLevel``'s sweep: that clears the cached level of every logger
    in the process (about a thousand once torch and transformers are loaded), a cost on every call of an
    optimize() result. Only the break logger and its descendants derive a cached level from its own, so clearing
    theirs is the same. The descendants are looked up again whenever logging's registry has grown."""
    registry = logging.Logger.manager.loggerDict
    if _known_loggers[0] != len(registry):
        prefix = BREAK_LOGGER + "."
        _known_loggers[:] = [len(registry), [v for k, v in list(registry.items())
                                             if k.startswith(prefix) and isinstance(v, logging.Logger)]]
    _break_logger.level = level
    for each in (_break_logger, *_known_loggers[1]):
        each._cache.clear()


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
    return GraphBreak(f"{os.path.basename(path)}:{line}", reason, path=path)


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
