"""Helpers for reading and editing Dynamo FX graphs: example values, facts about symbolic sizes
that hold without adding guards, in-place detection, inserting a call with its example value, and
removing nodes a rewrite left unused.

Dynamo graphs keep each node's example value (a fake tensor, a SymInt, ...) in
``node.meta["example_value"]``; every node a rewrite inserts gets one too, computed by running the
new call on the example values under the graph's fake mode.
"""
from __future__ import annotations

import contextlib
import importlib
import operator
import os
import re
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx

from kda_compile.passes.report import TOP_LEVEL


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
        return a is b
    return type(a) is type(b) and a == b


# ----------------------------------------------------------------------------------------------
def example_value(value: Any) -> Any:
    """The example value of a node (a fake tensor, SymInt, ...) or the constant itself."""
    if isinstance(value, torch.fx.Node):
        return value.meta.get("example_value", value.meta.get("val"))
    return value


def tensor_of(value: Any) -> torch.Tensor | None:
    val = example_value(value)
    return val if isinstance(val, torch.Tensor) else None


def is_real_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_tensor_node(value: Any) -> bool:
    return isinstance(value, torch.fx.Node) and tensor_of(value) is not None


def known_equal(a: Any, b: Any) -> bool:
    """True only when ``a == b`` holds for every value of the symbols involved (no guard added)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    a, b = example_value(a), example_value(b)
    if isinstance(a, (torch.SymInt, int)) and isinstance(b, (torch.SymInt, int)):
        return bool(statically_known_true(a == b))
    return same_value(a, b)


def known_shape_equal(shape_a: Sequence[Any], shape_b: Sequence[Any]) -> bool:
    return len(shape_a) == len(shape_b) and all(known_equal(x, y) for x, y in zip(shape_a, shape_b))


def is_last_dim(dim: Any, ndim: int) -> bool:
    return isinstance(dim, int) and not isinstance(dim, bool) and dim in (-1, ndim - 1)


def is_inplace(node: torch.fx.Node) -> bool:
    """Whether a call mutates one of its inputs (``x.add_(y)``, ``x.copy_(y)``, ``+=``)."""
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function":
        if node.target in (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem):
            return True
        if getattr(node.target, "__module__", None) in ("_operator", "operator"):
            return False  # operator.and_ / or_ / not_ are pure; its in-place forms are listed above
        name = getattr(node.target, "__name__", "")
    else:
        return False
    return name.endswith("_") and not name.endswith("__")


VIEW_METHODS = frozenset(("view", "reshape", "transpose", "permute", "expand", "unsqueeze", "squeeze", "flatten",
                          "unflatten", "contiguous", "narrow", "select", "split", "chunk", "unbind", "as_strided",
                          "view_as", "expand_as", "t", "mT", "to", "type", "type_as", "float", "half", "bfloat16",
                          "movedim", "swapaxes", "detach", "unfold", "diagonal", "view_as_real", "view_as_complex",
                          "real", "imag", "T", "H", "mH", "alias"))


def alias_root(value: Any, depth: int = 64) -> torch.fx.Node | None:
    """The node whose storage ``value`` may share: following views, casts (which may return their input),
    ``getitem`` and in-place calls (which return their input) back to a graph input (placeholder or
    attribute) or to the call that allocated it. Two values with different roots cannot alias; None when
    ``value`` is no node, or the chain is deeper than ``depth`` (then nothing can be concluded)."""
    for _ in range(depth):
        if not isinstance(value, torch.fx.Node):
            return None
        if value.op not in ("call_function", "call_method") or not value.args:
            return value
        name = value.target if value.op == "call_method" else getattr(value.target, "__name__", "")
        passes = (value.target is operator.getitem or name in VIEW_METHODS or is_inplace(value)
                  or value.target in _VIEW_FUNCTIONS)
        if not passes:
            return value
        value = value.args[0]
    return None


_VIEW_FUNCTIONS = frozenset((torch.reshape, torch.transpose, torch.permute, torch.squeeze, torch.unsqueeze,
                             torch.flatten, torch.narrow, torch.select, torch.split, torch.chunk, torch.unbind,
                             torch.as_strided, torch.movedim, torch.swapaxes, torch.t, torch.detach, torch.diagonal,
                             torch.view_as_real, torch.view_as_complex, torch.real, torch.imag))


def static_int(value: Any) -> int | None:
    """``value`` as a Python int when it is one for every value of its symbols, else None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, torch.SymInt):
        maybe = getattr(value.node, "maybe_as_int", None)
        as_int = maybe() if maybe is not None else None
        if as_int is not None:
            return int(as_int)
        expr = getattr(value.node, "expr", None)
        if expr is not None and getattr(expr, "is_number", False):
            return int(expr)
    return None


def concrete_number(value: Any) -> float | int:
    """A number from a constant or from a node holding a SymFloat / SymInt.

    For a symbolic value this specialises on its current value: the guard it adds makes Dynamo
    recompile if the value ever changes (e.g. a module's float attribute), so the constant baked
    into a rewritten call stays correct.
    """
    from torch.fx.experimental.symbolic_shapes import guard_scalar

    value = example_value(value)
    if isinstance(value, (torch.SymFloat, torch.SymInt)):
        return guard_scalar(value)
    return value


# ----------------------------------------------------------------------------------------------
# Editing
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _fake_mode(values: Sequence[Any]):
    """Run under the fake mode the example values belong to (the backend may run under a different one),
    with the Python dispatcher on, as Dynamo computes its own example values: composite ops (``matmul``,
    ``reshape``) then keep symbolic sizes symbolic. Without it torch 2.11's fake ``aten.size`` turns each
    size into an int, which guards every dynamic dimension to its example value (a recompile per length).
    A public op's argument error raises here at once (``raising_argument_errors``), not deferred into the graph as
    while Dynamo traces: the rewrites learn from it that the op refuses the site, and leave the site alone."""
    from torch._dispatch.python import enable_python_dispatcher

    from kda_compile.ops import raising_argument_errors

    mode = next((m for m in (getattr(v, "fake_mode", None) for v in values) if m is not None), None)
    with (mode if mode is not None else contextlib.nullcontext()), enable_python_dispatcher(), \
            raising_argument_errors():
        yield


def _example(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return example_value(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_example(v) for v in value)
    return value


def insert_call(graph: torch.fx.Graph, before: torch.fx.Node, target: Callable | str, args: tuple,
                kwargs: dict | None = None, *, meta_from: torch.fx.Node | None = None) -> torch.fx.Node:
    """Insert ``target(*args, **kwargs)`` (a function, or a method name) before ``before``.

    The call first runs on the arguments' example values under their fake mode (so a call that
    raises leaves the graph untouched); its result becomes the new node's example value. Source
    metadata (module stack, stack trace) is copied from ``meta_from`` so errors and profiles still
    point at the model code.
    """
    kwargs = dict(kwargs or {})
    ex_args, ex_kwargs = _example(args), {k: _example(v) for k, v in kwargs.items()}
    with _fake_mode(list(ex_args) + list(ex_kwargs.values())):
        if isinstance(target, str):
            value = getattr(ex_args[0], target)(*ex_args[1:], **ex_kwargs)
        else:
            value = target(*ex_args, **ex_kwargs)
    with graph.inserting_before(before):
        if isinstance(target, str):
            node = graph.call_method(target, args, kwargs)
        else:
            node = graph.call_function(target, args, kwargs)
    node.meta["example_value"] = value
    if meta_from is not None:
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in meta_from.meta:
                node.meta[key] = meta_from.meta[key]
    return node


_SIDE_EFFECT_FREE_OPS = ("call_function", "call_method")


def erase_unused(graph: torch.fx.Graph, nodes: Iterable[torch.fx.Node]) -> set[torch.fx.Node]:
    """Erase ``nodes`` that have no users, then their inputs that became unused, transitively.

    Only pure calls are erased: never placeholders, outputs, in-place calls or random ops (a
    dropout the rewrite replaced is erased because it is in ``nodes``, named by the caller).
    Returns the erased nodes.
    """
    named = set(nodes)
    pending = list(named)
    gone: set[torch.fx.Node] = set()
    while pending:
        node = pending.pop()
        if node in gone or node.users or node.op not in _SIDE_EFFECT_FREE_OPS:
            continue
        if node not in named and (is_inplace(node) or node.is_impure()):
            continue
        inputs = list(node.all_input_nodes)
        graph.erase_node(node)
        gone.add(node)
        pending.extend(inputs)
    return gone


# ----------------------------------------------------------------------------------------------
# Naming nodes and sites for the report
# ----------------------------------------------------------------------------------------------
def describe_node(node: Any) -> str:
    """``name (target)`` for a node, e.g. ``attn_weights_3 (dropout)``; repr for anything else."""
    if not isinstance(node, torch.fx.Node):
        return repr(node)
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{node.name} ({target})"


def module_path(node: torch.fx.Node) -> str:
    """The model path of the module a node came from, e.g. ``model.layers.0.self_attn``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return TOP_LEVEL
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['self'\]\.?", "", str(path))
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    return path or TOP_LEVEL


def source_line(node: torch.fx.Node) -> str:
    """``file.py:line`` of the model code that produced a node: the innermost frame outside
    kda_compile (a call Dynamo traced through our substitutes or ops points at the model)."""
    trace = node.meta.get("stack_trace") or ""
    found = re.findall(r'File "([^"]+)", line (\d+)', trace)
    outside = [(path, line) for path, line in found if not is_our_file(path)]
    if not (outside or found):
        return ""
    path, line = (outside or found)[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}"


def is_our_file(path: str) -> bool:
    """Whether ``path`` (a stack-trace frame's file) belongs to kda_compile, its ops or its passes."""
    return os.path.abspath(path).startswith(_OUR_DIRS)


_OUR_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (
    importlib.import_module("kda_compile"), importlib.import_module("kda_compile.ops"),
    importlib.import_module("kda_compile.passes")))
