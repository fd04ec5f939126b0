"""Settings for the frames a call traces, applied when Dynamo starts a compile instead of around every call.

A call of an ``optimize()`` result, or of a callable ``torch.compile``'d with the kda_compile backend, needs a
few things while Dynamo traces its frames:

- Dynamo config values: ``capture_scalar_outputs`` / ``capture_dynamic_output_shape_ops``
  (``Config.capture_data_dependent_ops``: MoE routing traced into the graph), ``automatic_dynamic_shapes`` off
  for a decode step into a static cache (kda_compile.cuda_graphs: one static graph per batch size);
- the call's phase (prefill or decode), which the backend reads when it plans CUDA graphs;
- the graph-break logger switched on, so that kda_compile.report records the breaks.

Most calls trace nothing: Dynamo finds a compiled entry whose guards pass and runs it. Setting a Dynamo config
value costs microseconds (torch 2.13 keeps each in a context variable, and a set marks the config's hash and
dictionary dirty), and a CUDA-graph decode step has a few hundred microseconds of host time in all, so a call
only pushes a :class:`Scope` onto a thread-local stack (:func:`entered`). Dynamo runs its compile-start
callbacks (``torch._dynamo.callback_handler``) when it begins compiling a frame, before it traces; the callback
registered here (:func:`install`) applies the innermost scope of the compiling thread there, and the end
callback restores what it changed. Outside compiles the user's config is never touched.

Dynamo compiles one frame at a time in the whole process (its compile lock), and runs the callbacks in the thread
that compiles, so a compile sees the scope of the call that triggered it. Its other compile-time callbacks (a
CUDA-graph recording, a lazy backward compile) run ours too: inside a call they apply that call's scope for their
duration, which changes nothing they read; outside any call they find no scope and change nothing.

Limits:

- The recompile limit is not a trace-time setting (Dynamo checks it before the start callbacks run): the
  ``optimize()`` wrapper raises it around the call where needed (kda_compile.optimize).
- A torch without the callback handler gets the settings around each call instead (:data:`PER_CALL`, logged
  once at DEBUG).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

logger = logging.getLogger("kda_compile.compile_scope")


@dataclass(frozen=True)
class Scope:
    """What one call tells the compiles it triggers.

    Attributes:
        dynamo: ``(name, value)`` pairs of ``torch._dynamo.config`` that frames traced in the call see.
        phase: ``"prefill"`` / ``"decode"`` (kda_compile.cuda_graphs), or None when not known.
    """

    dynamo: tuple[tuple[str, Any], ...] = ()
    phase: str | None = None


_local = threading.local()  # .stack: the scopes entered in this thread; .applied: what each compile changed
_hooks: list[tuple[Callable[[], Any], Callable[[Any], None]]] = []  # (begin, end) around each compile in a scope
_install_lock = threading.Lock()
PER_CALL = [False]  # True where torch has no compile callbacks (or a test says so): settings made around every call


def _stack() -> list[Scope]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def current() -> Scope | None:
    """The innermost scope entered in this thread, or None outside any call of ours."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def add_compile_hook(begin: Callable[[], Any], end: Callable[[Any], None]) -> None:
    """Run ``begin()`` when a compile starts inside a scope and ``end(its result)`` when that compile ends
    (kda_compile.report: the graph-break logger). Registered once per hook, at import."""
    _hooks.append((begin, end))


def _apply(scope: Scope) -> list[tuple[Callable[[Any], None], Any]]:
    """Apply ``scope``; returns how to undo it."""
    undo: list[tuple[Callable[[Any], None], Any]] = []
    dynamo = torch._dynamo.config
    for name, value in scope.dynamo:
        prior = getattr(dynamo, name)
        if prior != value:
            setattr(dynamo, name, value)
            undo.append((lambda v, n=name: setattr(dynamo, n, v), prior))
    for begin, end in _hooks:
        undo.append((end, begin()))
    return undo


def _undo(undo: list[tuple[Callable[[Any], None], Any]]) -> None:
    for action, value in reversed(undo):
        action(value)


def _on_compile_start(_args: Any = None) -> None:
    applied = getattr(_local, "applied", None)
    if applied is None:
        applied = _local.applied = []
    scope = current()
    applied.append(_apply(scope) if scope is not None else [])


def _on_compile_end(_args: Any = None) -> None:
    applied = getattr(_local, "applied", None)
    if applied:  # a compile that started before install() has nothing to undo here
        _undo(applied.pop())


def _callback_lists() -> tuple[list, list] | None:
    """Dynamo's lists of compile start / end callbacks, or None where this torch has none."""
    handler = getattr(torch._dynamo, "callback_handler", None)
    starts, ends = getattr(handler, "start_callbacks", None), getattr(handler, "end_callbacks", None)
    return (starts, ends) if isinstance(starts, list) and isinstance(ends, list) else None


def install() -> bool:
    """Register the compile callbacks with Dynamo, again after ``torch._dynamo.reset()`` (which clears them);
    False (and :data:`PER_CALL` set) where this torch has no callback handler. A list scan once registered: it
    runs at every scope's entry."""
    lists = _callback_lists()
    if lists is None:
        if not PER_CALL[0]:
            PER_CALL[0] = True
            logger.debug("torch %s has no Dynamo compile callbacks: kda_compile applies its trace-time settings "
                         "around every call", torch.__version__)
        return False
    starts, ends = lists
    if _on_compile_start not in starts:
        with _install_lock:
            if _on_compile_start not in starts:
                torch._dynamo.callback_handler.register_start_callback(_on_compile_start)
                torch._dynamo.callback_handler.register_end_callback(_on_compile_end)
    return not PER_CALL[0]


class entered:
    """``with entered(scope):`` the block's compiles see ``scope`` (the module docstring); a plain class rather
    than a generator context, as it is on every call's path."""

    __slots__ = ("scope", "_undo")

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self._undo: list | None = None

    def __enter__(self) -> "entered":
        install()
        _stack().append(self.scope)
        if PER_CALL[0]:
            self._undo = _apply(self.scope)
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.stack.pop()
        if self._undo is not None:
            _undo(self._undo)
            self._undo = None
