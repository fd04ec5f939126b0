"""Strict mode (``Config(strict=True)`` or ``KDA_COMPILE_STRICT=1``): every slower path is an error.

By default kda_compile never fails a model it cannot fully rewrite: a candidate left alone runs as the
model wrote it, an op without a fast kernel for a call runs a slower one, Dynamo may run a frame eagerly,
and each of these is logged and listed by ``kda_compile.report()``. A CI that must know a model runs
entirely on our kernels would have to parse that report; strict mode raises
:class:`~kda_compile.ops._common.StrictModeError` instead, with the report's reason and site:

- when a graph compiles (the backend, both entry points): a candidate a rewrite left alone, or a graph
  left out of CUDA graphs (``mode="reduce-overhead"``) for a reason other than being a prefill;
- during a call of an :func:`kda_compile.optimize` result: an op fallback to a slower implementation
  (ops raise it themselves inside :func:`~kda_compile.ops._common.strict_fallbacks`), a frame Dynamo ran
  eagerly (a recompile limit, a suppressed compile error), or a graph break inside kda_compile's own code
  (breaks in the model's code, e.g. its MoE routing, are the model's and stay in the report).

Dynamo wraps an exception raised by a backend in ``BackendCompilerFailed``; an ``optimize()`` result
unwraps it, so its callers see the ``StrictModeError`` itself. Under ``torch.compile(...,
backend="kda_compile")`` it is the ``BackendCompilerFailed``'s ``inner_exception``.
"""
from __future__ import annotations

import functools
import os
from typing import Any

from kda_compile import ops, passes
from kda_compile.cuda_graphs import PREFILL_REASON
from kda_compile.ops._common import StrictModeError
from kda_compile.passes.report import GraphReport

__all__ = ["StrictModeError", "check_graph", "check_call_events", "unwrap"]


def check_graph(report: GraphReport) -> None:
    """Raise for a compiled graph's left-alone candidates and a CUDA-graph plan left out for a reason
    other than being a prefill."""
    problems = [f"{c.rewrite} left {c.site} ({c.source}) alone: {c.reason}" for c in report.left_alone]
    if report.cuda_graphs.startswith("cuda graphs: not captured") and PREFILL_REASON not in report.cuda_graphs:
        problems.append(report.cuda_graphs)
    if problems:
        shown = "\n  ".join(problems)
        raise StrictModeError(f"kda_compile strict mode: graph {report.graph} is not fully rewritten:\n  {shown}\n"
                              "(Config(strict=False) runs it with these sites as the model wrote them)")


@functools.lru_cache(maxsize=1)
def own_roots() -> tuple[str, ...]:
    """The folders of kda_compile's source (the package and its ops / passes folders, wherever they
    are installed), each ending with a path separator."""
    roots = {os.path.dirname(module.__file__) for module in (ops, passes)} | {os.path.dirname(__file__)}
    return tuple(sorted(os.path.join(os.path.realpath(root), "") for root in roots))


def is_own_break(path: str) -> bool:
    """Whether a graph break's file (its full path, as Dynamo logged it) is one of kda_compile's own.
    Base names would not do: many of ours (``api.py``, ``run.py``, ``plan.py``) are common in models."""
    if not path:
        return False
    return os.path.realpath(path).startswith(own_roots())


def check_call_events(report: Any) -> None:
    """Raise for the eager fallbacks and the graph breaks in kda_compile's code that ``report`` (the
    ``kda_compile.report`` of a strict optimize() result, after a call) holds. They stay in the report, so
    every later call raises too: the model does not run fully compiled."""
    problems = [e.summary() for e in report.eager_fallbacks]
    problems += [b.summary() for b in report.graph_breaks if is_own_break(b.path)]
    if problems:
        shown = "\n  ".join(problems)
        raise StrictModeError(f"kda_compile strict mode: this call did not run fully compiled:\n  {shown}")


def unwrap(exc: BaseException) -> BaseException:
    """The StrictModeError inside Dynamo's ``BackendCompilerFailed`` (or ``exc`` itself)."""
    inner = getattr(exc, "inner_exception", None)
    return inner if isinstance(inner, StrictModeError) else exc
