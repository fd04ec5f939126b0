"""Read what an eager attention mask means from the Dynamo graph that builds it.

Hugging Face builds the eager mask with index arithmetic (transformers/masking_utils.py,
``sdpa_mask`` without vmap, then ``eager_mask``; the same in 5.17 to 5.23)::

    q_idx  = (torch.arange(q_length) + q_offset)[None, None, :, None]
    kv_idx = (torch.arange(kv_length) + kv_offset)[None, None, None, :]
    allowed = (kv_idx <= q_idx)                                  # causal_mask_function
    allowed = allowed & (kv_idx > q_idx - sliding_window)        # sliding_window_overlay
    allowed = allowed & padding_mask[batch_idx, kv_idx]          # padding_mask_function (2-D mask given)
    mask = torch.where(allowed.expand(B, -1, q_length, kv_length), zeros(()), finfo(dtype).min)

:func:`read_additive_mask` interprets that subgraph abstractly (positions as ``arange + offset``
laid along an axis, comparisons as bounds on ``kv_position - q_position``) and returns
:class:`MaskMeaning`: whether the mask is exactly the bottom-right aligned causal mask of the
attention it feeds, its sliding window, and the ``[B, 1, 1, Sk]`` key-padding tensor, if any.
Proofs hold for every value of the symbolic sizes (``statically_known_true``), so they are valid
under ``dynamic=True``. Anything else (a custom 4-D mask, vmap-built masks, packed sequences)
is not understood, and the caller keeps the mask tensor.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx

from kda_compile.passes.graph_tools import describe_node, example_value, known_equal, static_int
from kda_compile.passes.matching import ADD, EXPAND, GETITEM, SUB, family

ARANGE = family("arange", ("end",), functions=(torch.arange,),
                defaults={"dtype": None, "device": None, "layout": None, "pin_memory": False,
                          "requires_grad": False})
COMPARE = {
    op: family(name, ("input", "other"), functions=(op, torch_fn), methods=(name, f"__{name}__"))
    for name, op, torch_fn in [("le", operator.le, torch.le), ("lt", operator.lt, torch.lt),
                               ("ge", operator.ge, torch.ge), ("gt", operator.gt, torch.gt)]
}
AND = family("and", ("input", "other"), functions=(operator.and_, torch.logical_and, torch.bitwise_and),
             methods=("__and__", "logical_and", "bitwise_and"))
NEW_ONES = family("new_ones", ("input", "*size"), methods=("new_ones",),
                  defaults={"dtype": None, "device": None, "requires_grad": False})
TO = family("to", ("input", "*args"), methods=("to",),
            defaults={"device": None, "dtype": None, "non_blocking": False, "copy": False})
WHERE = family("where", ("condition", "input", "other"), functions=(torch.where,))
ZEROS = family("zeros", ("*size",), functions=(torch.zeros,),
               defaults={"dtype": None, "device": None, "layout": None, "pin_memory": False,
                         "requires_grad": False})

AXES = ("b", "h", "q", "kv")  # the 4 dims of a [B, H, Sq, Sk] mask


@dataclass(frozen=True)
class Positions:
    """``arange(length) + offset``, laid along one of :data:`AXES` (``axis=None``: still 1-D)."""

    length: Any
    offset: Any = 0
    axis: str | None = None


@dataclass(frozen=True)
class Allowed:
    """A boolean mask: ``lower < kv_pos - q_pos <= upper`` (positions without offsets, i.e. the
    row and column index) and ``key_padding[b, kv]``. ``None`` bounds are absent."""

    upper: Any = None
    lower: Any = None
    key_padding: torch.fx.Node | None = None
    q_length: Any = None
    kv_length: Any = None


@dataclass(frozen=True)
class MaskMeaning:
    """What an additive mask computes, relative to the attention it feeds."""

    causal: bool
    sliding_window: int | None
    key_padding: torch.fx.Node | None  # bool [B, 1, 1, Sk], True = attend


class NotUnderstood(Exception):
    """The mask subgraph uses something outside the patterns above."""


def read_additive_mask(mask: Any, q_length: Any, kv_length: Any) -> MaskMeaning | str:
    """Interpret ``mask`` (the tensor added to the scores) for an attention with ``q_length``
    queries and ``kv_length`` keys. Returns the meaning, or a reason why it is not understood."""
    if not isinstance(mask, torch.fx.Node):
        return "the mask is not computed in the graph"
    where = WHERE.bind(mask)
    if where is None:
        return f"the mask is not built by torch.where(allowed, 0, min) (found {describe_node(mask)})"
    try:
        _check_fill(where, mask)
        allowed = _evaluate(where["condition"], {})
    except NotUnderstood as exc:
        return f"the mask construction is not understood: {exc}"
    if not isinstance(allowed, Allowed):
        return "the mask condition is not a comparison of query and key positions"
    for name, have, want in (("query", allowed.q_length, q_length), ("key", allowed.kv_length, kv_length)):
        if have is not None and not known_equal(have, want):
            return f"the mask's {name} length {have} is not provably the attention's {want}"
    delta = kv_length - q_length
    causal = allowed.upper is not None and known_equal(allowed.upper, delta)
    if allowed.upper is not None and not causal:
        return "the mask's diagonal is not provably the bottom-right causal diagonal"
    window = None
    if allowed.lower is not None:
        window = static_int(allowed.upper - allowed.lower) if causal else None
        if window is None or window <= 0:
            return "the mask's lower band is not a constant sliding window"
    return MaskMeaning(causal, window, allowed.key_padding)


def _check_fill(where: dict, node: torch.fx.Node) -> None:
    """The mask must add 0 where allowed and -inf or the dtype minimum elsewhere (so a masked key
    gets exactly zero weight whenever its row has an allowed key)."""
    dtype = getattr(example_value(node), "dtype", None)
    zero, fill = where["input"], where["other"]
    if not (_is_zero(zero) and isinstance(fill, float) and dtype is not None and dtype.is_floating_point):
        raise NotUnderstood("torch.where does not select between 0 and a float constant")
    if not (fill == -math.inf or fill <= float(torch.finfo(dtype).min)):
        raise NotUnderstood(f"the masked value {fill} is not -inf or the dtype minimum")


def _is_scalar_tensor_literal(value: Any) -> bool:
    """``torch.tensor(<python number>, ...)``: a 0-d tensor holding a constant."""
    return (isinstance(value, torch.fx.Node) and value.op == "call_function" and value.target is torch.tensor
            and len(value.args) == 1 and isinstance(value.args[0], (int, float))
            and not isinstance(value.args[0], bool))


def _is_zero(value: Any) -> bool:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    if _is_scalar_tensor_literal(value):  # transformers 5.17: torch.tensor(0.0, device=..., dtype=...)
        return _is_zero(value.args[0])
    bound = ZEROS.bind(value)
    return bound is not None and tuple(bound["size"]) in ((), ((),))


def _evaluate(node: Any, memo: dict) -> Any:
    """Abstract value of ``node``: a :class:`Positions`, an :class:`Allowed`, or a constant."""
    if not isinstance(node, torch.fx.Node):
        if isinstance(node, (int, torch.SymInt)) and not isinstance(node, bool):
            return node
        raise NotUnderstood(f"constant {node!r}")
    if node in memo:
        return memo[node]
    if isinstance(example_value(node), (int, torch.SymInt)):
        return example_value(node)  # a size computed from symbols (the cache length, a max(...))
    for fam, rule in _RULES:
        bound = fam.bind(node)
        if bound is not None:
            value = rule(node, bound, memo)
            if value is not None:
                memo[node] = value
                return value
    raise NotUnderstood(describe_node(node))


def _scalar(value: Any, memo: dict) -> Any:
    if isinstance(value, torch.fx.Node):
        val = example_value(value)
        if isinstance(val, (int, torch.SymInt)):
            return val
    result = _evaluate(value, memo)
    if isinstance(result, (int, torch.SymInt)):
        return result
    raise NotUnderstood(f"{describe_node(value)} is not an integer")


def _arange(node, b, memo):
    return Positions(_scalar(b["end"], memo))


def _shift(sign):
    def rule(node, b, memo):
        left, right = _evaluate(b["input"], memo), _evaluate(b["other"], memo)
        if isinstance(left, Positions) and isinstance(right, (int, torch.SymInt)):
            return replace(left, offset=left.offset + sign * right)
        if sign > 0 and isinstance(right, Positions) and isinstance(left, (int, torch.SymInt)):
            return replace(right, offset=right.offset + left)
        if isinstance(left, (int, torch.SymInt)) and isinstance(right, (int, torch.SymInt)):
            return example_value(node)
        return None
    return rule


def _place(node, b, memo):
    """``positions[None, None, :, None]`` puts a 1-D position vector on one axis of a 4-D mask."""
    index = b["index"]
    if isinstance(index, tuple) and len(index) == 2 and all(isinstance(i, torch.fx.Node) for i in index):
        return _key_padding(node, b["input"], index, memo)
    source = _evaluate(b["input"], memo)
    if isinstance(source, Positions) and source.axis is None and isinstance(index, tuple) and len(index) == 4:
        full = [i for i, item in enumerate(index) if item == slice(None, None, None)]
        if len(full) == 1 and all(item is None for i, item in enumerate(index) if i != full[0]):
            return replace(source, axis=AXES[full[0]])
    return None


def _key_padding(node, padding, index, memo):
    """``padding_mask[batch_idx, kv_idx]``: a [B, 1, 1, Sk] bool tensor (depends on batch and key only)."""
    rows, cols = (_evaluate(i, memo) for i in index)
    val = example_value(padding)
    if not (isinstance(rows, Positions) and rows.axis == "b" and known_equal(rows.offset, 0)
            and isinstance(cols, Positions) and cols.axis == "kv"
            and isinstance(val, torch.Tensor) and val.dtype == torch.bool and val.dim() == 2):
        return None
    return Allowed(key_padding=node, kv_length=cols.length)


def _compare(op):
    def rule(node, b, memo):
        left, right = _evaluate(b["input"], memo), _evaluate(b["other"], memo)
        if not (isinstance(left, Positions) and isinstance(right, Positions)):
            return None
        if {left.axis, right.axis} != {"q", "kv"}:
            return None
        flipped = {operator.le: operator.ge, operator.lt: operator.gt,
                   operator.ge: operator.le, operator.gt: operator.lt}
        kv, q, rel = (left, right, op) if left.axis == "kv" else (right, left, flipped[op])
        # kv_idx + kv.offset  REL  q_idx + q.offset   <=>   kv_idx - q_idx  REL  q.offset - kv.offset
        c = q.offset - kv.offset
        bounds = {operator.le: dict(upper=c), operator.lt: dict(upper=c - 1),
                  operator.gt: dict(lower=c), operator.ge: dict(lower=c - 1)}[rel]
        return Allowed(q_length=q.length, kv_length=kv.length, **bounds)
    return rule


def _ones(node, b, memo):
    if tuple(b["size"]) in ((), ((),)) and b["dtype"] == torch.bool:
        return Allowed()
    return None


def _and(node, b, memo):
    left, right = _evaluate(b["input"], memo), _evaluate(b["other"], memo)
    if not (isinstance(left, Allowed) and isinstance(right, Allowed)):
        return None
    merged = {}
    for name in ("upper", "lower", "key_padding", "q_length", "kv_length"):
        a, c = getattr(left, name), getattr(right, name)
        if a is not None and c is not None and not (a is c if name == "key_padding" else known_equal(a, c)):
            if name in ("key_padding", "upper", "lower"):
                raise NotUnderstood(f"two different {name.replace('_', ' ')} terms")
            raise NotUnderstood("mask terms of different lengths")
        merged[name] = a if a is not None else c
    return Allowed(**merged)


def _to_device(node, b, memo):
    """``x.to(device)`` keeps the values; a lone padding term then lives in the moved tensor."""
    if b["dtype"] is not None or b["copy"] or any(not isinstance(a, (torch.device, str)) for a in b["args"]):
        return None
    source = _evaluate(b["input"], memo)
    if isinstance(source, Allowed) and source.key_padding is not None and source.upper is None \
            and source.lower is None:
        return replace(source, key_padding=node)
    return source if isinstance(source, (Allowed, Positions)) else None


def _expand(node, b, memo):
    source = _evaluate(b["input"], memo)
    return source if isinstance(source, Allowed) else None


_RULES = [
    (ARANGE, _arange), (ADD, _shift(+1)), (SUB, _shift(-1)), (GETITEM, _place),
    *[(fam, _compare(op)) for op, fam in COMPARE.items()],
    (NEW_ONES, _ones), (AND, _and), (TO, _to_device), (EXPAND, _expand),
]
