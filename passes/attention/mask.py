"""Read what an eager attention mask means from the Dynamo graph that builds it.

Hugging Face builds the eager mask with index arithmetic (transformers/masking_utils.py,
``sdpa_mask`` without vmap, then ``eager_mask``; the same in 5.17 to 5.23)::

    q_idx  = (torch.arange(q_length) + q_offset)[None, None, :, None]
    kv_idx = (torch.arange(kv_length) + kv_offset)[None, None, None, :]
    allowed = (kv_idx <= q_idx)                                  # causal_mask_function
    allowed = allowed & (kv_idx > q_idx - sliding_window)        # sliding_window_overlay
    allowed = allowed & padding_mask[batch_idx, kv_idx]          # padding_mask_function (2-D mask given)
    mask = torch.where(allowed.expand(B, -1, q_length, kv_length), zeros(()), finfo(dtype).min)

Without a cache and a 2-D mask (``use_cache=False``, training), 5.17 to 5.23 also add the
packed-sequence terms while tracing, computed from ``position_ids``
(``find_packed_sequence_indices``, ``packed_sequence_compatibility_function``)::

    position_ids = (torch.arange(S) + past_seen_tokens).unsqueeze(0)     # the model, when none is given
    rows = position_ids.expand(B, -1)
    diff = torch.diff(rows, prepend=rows[:, :1] - 1, dim=-1)
    packed = (diff != 1).cumsum(-1)                                      # sequence index of each token
    allowed = allowed & (packed[batch_idx, q_idx] == packed[batch_idx, kv_idx])
    # 5.23 only: the mask function sees remapped positions
    q_idx, kv_idx = rows[batch_idx, q_idx], rows[batch_idx, kv_idx]

When ``position_ids`` comes from ``arange`` in the graph, ``diff`` is 1 everywhere, ``packed`` is 0
everywhere, the sequence-equality term is all-true and drops out of the ``&``, and the remapped
positions are positions again: the mask is the plain causal one. When ``position_ids`` is a graph
input (the caller packed sequences) its values are unknown and the mask is not understood.

:func:`read_additive_mask` interprets that subgraph abstractly (positions as ``arange + offset``
laid along an axis, tables whose rows are all ``arange + offset``, tensors holding one value
everywhere, comparisons as bounds on ``kv_position - q_position``) and returns
:class:`MaskMeaning`: whether the mask is exactly the bottom-right aligned causal mask of the
attention it feeds, its sliding window, and the ``[B, 1, 1, Sk]`` key-padding tensor, if any.
Proofs hold for every value of the symbolic sizes (``statically_known_true``), so they are valid
under ``dynamic=True``. Anything else (a custom 4-D mask, vmap-built masks, really packed
sequences) is not understood, and the caller keeps the mask tensor.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx

from kda_compile.passes.toolkit.graph_tools import describe_node, example_value, is_last_dim, known_equal, static_int
from kda_compile.passes.toolkit.matching import ADD, EXPAND, GETITEM, SUB, family

ARANGE = family("arange", ("end",), functions=(torch.arange,),
                defaults={"dtype": None, "device": None, "layout": None, "pin_memory": False,
                          "requires_grad": False})
ARANGE_RANGE = family("arange", ("start", "end", "step"), functions=(torch.arange,),
                      defaults={"step": 1, "dtype": None, "device": None, "layout": None, "pin_memory": False,
                                "requires_grad": False})
COMPARE = {
    op: family(name, ("input", "other"), functions=(op, torch_fn), methods=(name, f"__{name}__"))
    for name, op, torch_fn in [("le", operator.le, torch.le), ("lt", operator.lt, torch.lt),
                               ("ge", operator.ge, torch.ge), ("gt", operator.gt, torch.gt),
                               ("eq", operator.eq, torch.eq), ("ne", operator.ne, torch.ne)]
}
AND = family("and", ("input", "other"), functions=(operator.and_, torch.logical_and, torch.bitwise_and),
             methods=("__and__", "logical_and", "bitwise_and"))
CUMSUM = family("cumsum", ("input", "dim"), functions=(torch.cumsum,), methods=("cumsum",),
                defaults={"dtype": None})
DIFF = family("diff", ("input", "n", "dim", "prepend", "append"), functions=(torch.diff,), methods=("diff",),
              defaults={"n": 1, "dim": -1, "prepend": None, "append": None})
NEW_ONES = family("new_ones", ("input", "*size"), methods=("new_ones",),
                  defaults={"dtype": None, "device": None, "requires_grad": False})
TO = family("to", ("input", "*args"), methods=("to",),
            defaults={"device": None, "dtype": None, "non_blocking": False, "copy": False})
UNSQUEEZE = family("unsqueeze", ("input", "dim"), functions=(torch.unsqueeze,), methods=("unsqueeze",))
WHERE = family("where", ("condition", "input", "other"), functions=(torch.where,))
ZEROS = family("zeros", ("*size",), functions=(torch.zeros,),
               defaults={"dtype": None, "device": None, "layout": None, "pin_memory": False,
                         "requires_grad": False})

AXES = ("b", "h", "q", "kv")  # the 4 dims of a [B, H, Sq, Sk] mask
ALL = slice(None, None, None)


@dataclass(frozen=True)
class Positions:
    """``arange(length) + offset``, laid along one of :data:`AXES` (``axis=None``: still 1-D)."""

    length: Any
    offset: Any = 0
    axis: str | None = None


@dataclass(frozen=True)
class PositionRows:
    """A 2-D ``[R, length]`` table whose every row is ``arange(length) + offset`` (``position_ids``
    made in the graph, ``.unsqueeze(0)`` and ``.expand(B, -1)``)."""

    length: Any
    offset: Any = 0


@dataclass(frozen=True)
class Uniform:
    """A tensor holding ``value`` (a Python int or bool) in every element."""

    value: int | bool


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
        check_fill(where, mask)
    except NotUnderstood as exc:
        return f"the mask construction is not understood: {exc}"
    return read_bool_mask(where["condition"], q_length, kv_length)


def read_bool_mask(mask: Any, q_length: Any, kv_length: Any) -> MaskMeaning | str:
    """Interpret the boolean mask ``mask`` (True = attend: ``sdpa_mask``'s output, or the condition
    of the additive mask's ``torch.where``) like :func:`read_additive_mask`."""
    try:
        allowed = _as_allowed(_evaluate(mask, {}))
    except NotUnderstood as exc:
        return f"the mask construction is not understood: {exc}"
    if allowed is None:
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


def mask_keywords(mask: torch.fx.Node, q_length: Any, kv_length: Any, to_flags: bool,
                  additive: bool) -> tuple[dict, dict]:
    """Keyword arguments of ``kda_compile.ops.attention`` for ``mask`` (``additive``: added to the
    scores; else a bool mask, True = attend), and the details a report shows. A mask proven causal
    becomes ``is_causal`` / ``sliding_window`` (and the key-padding mask); any other stays the tensor."""
    if not to_flags:
        meaning: MaskMeaning | str = "attention_mask_to_flags is off"
    else:
        meaning = (read_additive_mask if additive else read_bool_mask)(mask, q_length, kv_length)
    kwargs: dict[str, Any] = {}
    details: dict[str, Any] = {}
    if isinstance(meaning, MaskMeaning):
        kwargs.update(is_causal=meaning.causal, attn_mask=meaning.key_padding)
        details.update(is_causal=meaning.causal)
        if meaning.sliding_window is not None:
            kwargs["sliding_window"] = details["sliding_window"] = meaning.sliding_window
        details["mask"] = "key padding [B, 1, 1, Sk]" if meaning.key_padding is not None else "none"
    else:
        kwargs["attn_mask"] = mask
        details["mask"] = f"tensor ({meaning})"
    return kwargs, details


def check_fill(where: dict, node: torch.fx.Node) -> None:
    """The mask must add 0 where allowed and -inf or the dtype minimum elsewhere (so a masked key
    gets exactly zero weight whenever its row has an allowed key)."""
    dtype = getattr(example_value(node), "dtype", None)
    zero, fill = where["input"], where["other"]
    if not (_is_zero(zero) and isinstance(fill, float) and dtype is not None and dtype.is_floating_point):
        raise NotUnderstood("torch.where does not select between 0 and a float constant")
    if not (fill == -math.inf or fill <= float(torch.finfo(dtype).min)):
        raise NotUnderstood(f"the masked value {fill} is not -inf or the dtype minimum")


def is_scalar_tensor_literal(value: Any) -> bool:
    """``torch.tensor(<python number>, ...)``: a 0-d tensor holding a constant."""
    return (isinstance(value, torch.fx.Node) and value.op == "call_function" and value.target is torch.tensor
            and len(value.args) == 1 and isinstance(value.args[0], (int, float))
            and not isinstance(value.args[0], bool))


def _is_zero(value: Any) -> bool:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    if is_scalar_tensor_literal(value):  # transformers 5.17: torch.tensor(0.0, device=..., dtype=...)
        return _is_zero(value.args[0])
    bound = ZEROS.bind(value)
    return bound is not None and tuple(bound["size"]) in ((), ((),))


def _known(condition: Any) -> bool:
    """True only when ``condition`` (a bool or SymBool) holds for every value of its symbols."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(condition))


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def _as_allowed(value: Any) -> Allowed | None:
    """An all-true tensor is the mask that allows everything."""
    if isinstance(value, Uniform) and value.value is True:
        return Allowed()
    return value if isinstance(value, Allowed) else None


def _evaluate(node: Any, memo: dict) -> Any:
    """Abstract value of ``node``: :class:`Positions`, :class:`PositionRows`, :class:`Uniform`,
    :class:`Allowed`, or an integer."""
    if not isinstance(node, torch.fx.Node):
        if _is_int(node):
            return node
        raise NotUnderstood(f"constant {node!r}")
    if node in memo:
        return memo[node]
    if isinstance(example_value(node), (int, torch.SymInt)):
        return example_value(node)  # a size computed from symbols (the cache length, a max(...))
    if node.op == "placeholder":
        raise NotUnderstood(f"{node.name} is a graph input, its values are unknown")
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
    if _is_int(result):
        return result
    raise NotUnderstood(f"{describe_node(value)} is not an integer")


def _arange(node, b, memo):
    return Positions(_scalar(b["end"], memo))


def _arange_range(node, b, memo):
    """``torch.arange(start, end)``: ``arange(end - start) + start``."""
    if b["step"] != 1:
        return None
    start, end = _scalar(b["start"], memo), _scalar(b["end"], memo)
    return Positions(end - start, offset=start) if _known(start <= end) else None


def _shift(sign):
    def rule(node, b, memo):
        left, right = _evaluate(b["input"], memo), _evaluate(b["other"], memo)
        if isinstance(left, (Positions, PositionRows)) and _is_int(right):
            return replace(left, offset=left.offset + sign * right)
        if sign > 0 and isinstance(right, (Positions, PositionRows)) and _is_int(left):
            return replace(right, offset=right.offset + left)
        if _is_int(left) and _is_int(right):
            return example_value(node)
        return None
    return rule


def _unsqueeze(node, b, memo):
    """``positions.unsqueeze(0)``: a table of one row."""
    source = _evaluate(b["input"], memo)
    if isinstance(source, Positions) and source.axis is None and b["dim"] in (0, -2):
        return PositionRows(source.length, source.offset)
    return None


def _index(node, b, memo):
    index = b["index"]
    if isinstance(index, tuple) and len(index) == 2 and all(isinstance(i, torch.fx.Node) for i in index):
        return _gather(node, b["input"], index, memo)
    source = _evaluate(b["input"], memo)
    if isinstance(source, Positions) and source.axis is None:
        return _place(source, index)
    if isinstance(source, PositionRows) and isinstance(index, tuple) and len(index) == 2 and index[0] == ALL:
        return _slice_columns(source, index[1])
    return None


def _place(source: Positions, index: Any) -> Positions | PositionRows | None:
    """``positions[None, None, :, None]`` puts a 1-D position vector on one axis of a 4-D mask;
    ``positions[None, :]`` makes a table of one row."""
    if index in ((None, ALL), (None,), None):
        return PositionRows(source.length, source.offset)
    if isinstance(index, tuple) and len(index) == 4:
        full = [i for i, item in enumerate(index) if item == ALL]
        if len(full) == 1 and all(item is None for i, item in enumerate(index) if i != full[0]):
            return replace(source, axis=AXES[full[0]])
    return None


def _slice_columns(rows: PositionRows, columns: Any) -> PositionRows | None:
    """``rows[:, start:stop]`` with non-negative constant bounds inside the table."""
    if not isinstance(columns, slice) or columns.step not in (None, 1):
        return None
    start = 0 if columns.start is None else columns.start
    stop = rows.length if columns.stop is None else columns.stop
    if not (_is_int(start) and _is_int(stop) and _known(start >= 0) and _known(start < stop)
            and _known(stop <= rows.length)):
        return None
    return PositionRows(stop - start, rows.offset + start)


def _gather(node, source, index, memo):
    """``table[batch_idx, col_idx]`` with index vectors laid along the mask's axes: a key-padding
    term when ``table`` is the 2-D bool padding mask; positions again when ``table`` is a
    :class:`PositionRows` (the rows are all alike, so the batch index does not matter); the value
    of a :class:`Uniform` table. The indices must provably stay inside the table."""
    rows, cols = (_evaluate(i, memo) for i in index)
    val = example_value(source)
    if not (isinstance(rows, Positions) and rows.axis == "b" and known_equal(rows.offset, 0)
            and isinstance(cols, Positions) and cols.axis in ("q", "kv")
            and isinstance(val, torch.Tensor) and val.dim() == 2):
        return None
    if val.dtype == torch.bool and cols.axis == "kv":
        return Allowed(key_padding=node, kv_length=cols.length)
    table = _evaluate(source, memo)
    inside = (_known(rows.length <= val.shape[0]) and _known(cols.offset >= 0)
              and _known(cols.offset + cols.length <= val.shape[1]))
    if not inside:
        raise NotUnderstood(f"{describe_node(node)} may index outside {describe_node(source)}")
    if isinstance(table, PositionRows):
        return Positions(cols.length, table.offset + cols.offset, cols.axis)
    if isinstance(table, Uniform):
        return table
    return None


def _diff(node, b, memo):
    """``torch.diff(rows, prepend=p, dim=-1)`` of a position table whose ``prepend`` continues
    into it (its last column is one less than the table's first): 1 everywhere."""
    source = _evaluate(b["input"], memo)
    if not (isinstance(source, PositionRows) and b["n"] == 1 and is_last_dim(b["dim"], 2)
            and b["append"] is None):
        return None
    if b["prepend"] is not None:
        before = _evaluate(b["prepend"], memo)
        if not (isinstance(before, PositionRows) and known_equal(before.offset + before.length, source.offset)):
            return None
    return Uniform(1)


def _cumsum(node, b, memo):
    """A running sum of zeros is zero."""
    source = _evaluate(b["input"], memo)
    return Uniform(0) if isinstance(source, Uniform) and source.value == 0 else None


def _compare(op):
    def rule(node, b, memo):
        left, right = _evaluate(b["input"], memo), _evaluate(b["other"], memo)
        if any(isinstance(x, Uniform) for x in (left, right)):
            if all(isinstance(x, Uniform) or (_is_int(x) and static_int(x) is not None) for x in (left, right)):
                values = [x.value if isinstance(x, Uniform) else static_int(x) for x in (left, right)]
                return Uniform(bool(op(*values)))
            return None
        if op in (operator.eq, operator.ne):
            return None
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
    """Intersect two masks; an all-true operand drops out."""
    left, right = (_as_allowed(_evaluate(b[k], memo)) for k in ("input", "other"))
    if left is None or right is None:
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
    return source if isinstance(source, (Allowed, Positions, PositionRows, Uniform)) else None


def _expand(node, b, memo):
    source = _evaluate(b["input"], memo)
    if isinstance(source, PositionRows):  # more rows alike: .expand(B, -1)
        sizes = b["sizes"]
        return source if len(sizes) == 2 and (sizes[1] == -1 or known_equal(sizes[1], source.length)) else None
    return source if isinstance(source, (Allowed, Uniform)) else None


_RULES = [
    (ARANGE, _arange), (ARANGE_RANGE, _arange_range), (ADD, _shift(+1)), (SUB, _shift(-1)),
    (UNSQUEEZE, _unsqueeze), (GETITEM, _index), (DIFF, _diff), (CUMSUM, _cumsum),
    *[(fam, _compare(op)) for op, fam in COMPARE.items()],
    (NEW_ONES, _ones), (AND, _and), (TO, _to_device), (EXPAND, _expand),
]
