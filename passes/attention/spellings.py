"""Batched 3-D spellings of eager softmax attention, turned into the 4-D form attention/softmax.py matches.

bloom (transformers 5.23, models/bloom/modeling_bloom.py) folds batch and heads into one dimension
and adds its ALiBi bias inside ``baddbmm``::

    q3 = query.reshape(B * H, Sq, D); k3t = key.reshape(B * H, Sk, D).transpose(-1, -2)
    scores = alibi.baddbmm(batch1=q3, batch2=k3t, beta=1.0, alpha=inv_norm_factor)   # [B*H, Sq, Sk]
    scores = scores.view(B, H, Sq, Sk) + attention_mask
    probs = softmax(scores, dim=-1, dtype=torch.float32).to(dtype); probs = dropout(probs)
    out3 = torch.bmm(probs.view(B * H, Sq, Sk), value.reshape(B * H, Sk, Dv))

:func:`unfold_batched_attention` rewrites, in place and exactly (same values, other association
only where ``baddbmm`` fused its multiply-add), the score product into
``matmul(q4, k4.transpose(-1, -2)) * alpha + alibi.reshape(B, H, Sq or 1, Sk)`` and the value product
into ``matmul(probs, v4).reshape(B * H, Sq, Dv)``, where ``q4`` / ``k4`` / ``v4`` are the 4-D tensors the
3-D ones were reshaped from (or a reshape of them). The ALiBi term then reaches the matcher as an
additive bias broadcastable to [B, H, Sq, Sk], which ``kda_compile.ops.attention`` takes as a float
``attn_mask``. ``baddbmm`` with ``beta`` other than 1 or a non-constant ``alpha`` is left as written
(the softmax is then reported as not matching).

cpmant (models/cpmant/modeling_cpmant.py) masks with ``masked_fill`` on both sides of the softmax::

    score = torch.masked_fill(score, drop, torch.scalar_tensor(float("-inf")))   # drop: True = masked
    score = torch.masked_fill(softmax(score), drop, torch.scalar_tensor(0))

:data:`MASKED_FILL` and :func:`fill_value` let attention/softmax.py read the first as the bool mask
``~drop`` and the second as neutral (the op already gives a masked key zero weight, and a row with
every key masked 0, where eager attention gave NaN then 0), provided both conditions compute the
same tensor (:func:`same_computation`: Dynamo keeps the two ``mask.view(...) == False`` apart).

Both unfoldings only read the shapes of the example values; they change nothing when a shape is not
the folded [B*H, ...] of a 4-D tensor.
"""
from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from kda_compile.passes.toolkit.graph_tools import (describe_node, insert_call, is_last_dim, known_equal,
                                                    known_shape_equal, same_value, tensor_of)
from kda_compile.passes.toolkit.matching import (ADD, CAST, DIV, GETITEM, MATMUL, MUL, RESHAPE, SUB, TRANSPOSE,
                                                 cast_dtype, family)

logger = logging.getLogger("kda_compile.passes.attention_spellings")

MASKED_FILL = family("masked_fill", ("input", "mask", "value"), functions=(torch.masked_fill,),
                     methods=("masked_fill",))
_SCALAR_LITERALS = (torch.tensor, torch.scalar_tensor)


def fill_value(value: Any) -> float | None:
    """The number a fill argument holds: a Python number, ``torch.tensor(x)``, ``torch.scalar_tensor(x)``
    or ``torch.full((), x)``."""
    if isinstance(value, torch.fx.Node):
        if value.op == "call_function" and value.target in _SCALAR_LITERALS and len(value.args) == 1:
            value = value.args[0]
        elif value.op == "call_function" and value.target is torch.full and len(value.args) == 2 \
                and isinstance(value.args[0], (tuple, list)) and len(value.args[0]) == 0:
            value = value.args[1]
        else:
            return None
    return float(value) if _number(value) else None


def same_computation(a: Any, b: Any, depth: int = 8) -> bool:
    """True when ``a`` and ``b`` are the same value, or nodes computing it by the same pure calls on
    the same inputs (placeholders and attributes must be the very same node)."""
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
            return len(a) == len(b) and all(same_computation(x, y, depth) for x, y in zip(a, b))
        return same_value(a, b)
    if a is b:
        return True
    if depth == 0 or a.op not in ("call_function", "call_method") or a.op != b.op or a.target != b.target:
        return False
    if a.is_impure() or b.is_impure() or set(a.kwargs) != set(b.kwargs):
        return False
    return (same_computation(a.args, b.args, depth - 1)
            and all(same_computation(a.kwargs[k], b.kwargs[k], depth - 1) for k in a.kwargs))


BMM = family("bmm", ("input", "other"), functions=(torch.bmm,), methods=("bmm",))
BADDBMM = family("baddbmm", ("input", "batch1", "batch2"), functions=(torch.baddbmm,), methods=("baddbmm",),
                 defaults={"beta": 1, "alpha": 1})


def is_batched_product(node: Any) -> bool:
    """A ``bmm`` / ``baddbmm`` (or a view of one): a softmax next to it is an attention candidate even
    when :func:`unfold_batched_attention` could not unfold it."""
    if not isinstance(node, torch.fx.Node):
        return False
    view = RESHAPE.bind(node)
    near = [node] + ([view["input"]] + list(node.users) if view is not None else [])
    return any(BMM.bind(n) is not None or BADDBMM.bind(n) is not None for n in near)


_PRODUCTS = (MATMUL, BMM, BADDBMM)
_EINSUM = (torch.einsum, torch.functional.einsum)  # variadic operands: matched by target
_PROJECTIONS = (torch.nn.functional.linear, torch._C._nn.linear)


def product_within(node: Any, hops: int, upward: bool) -> bool:
    """A matmul / bmm / baddbmm / einsum within ``hops`` nodes of ``node``: upward along first tensor
    arguments, downward along users; a linear projection or a module call ends the walk. A softmax with
    one on both sides is an attention candidate even where the spelling is not matched, so that it is
    reported with the reason (xglm: scores clamped by ``torch.max`` between views of a bmm; prophetnet:
    ``einsum``) instead of passed over like a MoE router (whose softmax reads a linear projection)."""
    frontier = [node]
    for _ in range(hops):
        nxt = []
        for n in frontier:
            if not isinstance(n, torch.fx.Node) or n.op not in ("call_function", "call_method") \
                    or n.target in _PROJECTIONS:
                continue
            if n.target in _EINSUM or any(f.bind(n) is not None for f in _PRODUCTS):
                return True
            if upward:
                nxt += [a for a in n.args[:1] if isinstance(a, torch.fx.Node)]
            else:
                nxt += list(n.users)
        frontier = nxt
    return False


def batched_reason(node: Any) -> str | None:
    """Why the batched product at or next to ``node`` was not unfolded, or None if there is none."""
    if not is_batched_product(node):
        return None
    view = RESHAPE.bind(node)
    for n in [node] + ([view["input"]] + list(node.users) if view is not None else []):
        fused = BADDBMM.bind(n)
        if fused is not None and fused["beta"] != 1:
            return f"baddbmm scales its bias by beta={fused['beta']}, not the additive bias (beta=1) the op takes"
        if fused is not None and not _number(fused["alpha"]):
            return f"baddbmm's alpha {fused['alpha']} is not a constant scale"
    return ("the bmm / baddbmm is not a [B*H, ...] folding of 4-D query, keys and values viewed as "
            "[B, H, Sq, Sk] scores")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _swapped_last_two(node: Any) -> torch.fx.Node | None:
    """``x`` when ``node`` is ``x.transpose(-1, -2)`` of a 3-D ``x`` (any spelling of the two dims)."""
    b = TRANSPOSE.bind(node)
    x = tensor_of(b["input"]) if b is not None else None
    if x is None or x.dim() != 3 or not all(isinstance(d, int) for d in (b["dim0"], b["dim1"])):
        return None
    return b["input"] if {b["dim0"] % 3, b["dim1"] % 3} == {1, 2} else None


def _static(shape: Any) -> tuple[int, ...] | None:
    """``shape`` as plain ints, or None when a size is symbolic (it then cannot be a graph constant)."""
    return tuple(shape) if all(type(d) is int for d in shape) else None


def _as_4d(node: torch.fx.Node, shape: tuple) -> torch.fx.Node | tuple | None:
    """``node`` ([B*H, S, D]) as [B, H, S, D]: the tensor it was reshaped from when that has this shape
    (bloom's ``query.reshape(B * H, -1, D)``), else the static shape to reshape it to, else None."""
    b = RESHAPE.bind(node)
    if b is not None and tensor_of(b["input"]) is not None and known_shape_equal(tensor_of(b["input"]).shape, shape):
        return b["input"]
    return _static(shape)


def _graph_shape(args: Any, keep: int, static: Any) -> tuple | None:
    """A shape to pass in the graph: the first ``keep`` sizes of a view's own arguments (graph
    values, also under dynamic shapes) then -1; or ``static`` as ints; or None."""
    args = tuple(args)
    if len(args) > keep and all(a is not None for a in args[:keep]) and -1 not in args[:keep]:
        return args[:keep] + (-1,)
    return _static(static)


def _reshaped(graph: torch.fx.Graph, at: torch.fx.Node, node: torch.fx.Node, target: Any) -> torch.fx.Node:
    return target if isinstance(target, torch.fx.Node) else insert_call(graph, at, "reshape", (node, target),
                                                                          meta_from=at)


def _unfold_scores(graph: torch.fx.Graph, view: torch.fx.Node) -> bool:
    """``baddbmm(bias, q3, k3t, alpha=a).view(B, H, Sq, Sk)`` or ``bmm(q3, k3t).view(...)`` ->
    ``matmul(q4, k4^T) * a + bias4``. Every check comes before the first graph change."""
    src = RESHAPE.bind(view)
    mm = src["input"] if src is not None else None
    if not isinstance(mm, torch.fx.Node) or len(mm.users) != 1:
        return False
    fused, plain = BADDBMM.bind(mm), BMM.bind(mm)
    if fused is not None:
        q3, k3t, bias = fused["batch1"], fused["batch2"], fused["input"]
        if fused["beta"] != 1 or not _number(fused["alpha"]) or not isinstance(bias, torch.fx.Node):
            return False
        alpha = fused["alpha"]
    elif plain is not None:
        q3, k3t, bias, alpha = plain["input"], plain["other"], None, 1
    else:
        return False
    k3, out = _swapped_last_two(k3t), tensor_of(view)
    q = tensor_of(q3)
    if k3 is None or out is None or out.dim() != 4 or q is None or q.dim() != 3:
        return False
    b, h, sq, sk = out.shape
    k = tensor_of(k3)
    if not (known_equal(q.shape[0], b * h) and known_equal(q.shape[1], sq) and known_equal(k.shape[1], sk)):
        return False
    q4, k4 = _as_4d(q3, (b, h, sq, q.shape[2])), _as_4d(k3, (b, h, sk, k.shape[2]))
    bias_shape = None
    if bias is not None:
        t = tensor_of(bias)
        if t is None or t.dim() != 3 or not known_equal(t.shape[0], b * h) or not known_equal(t.shape[2], sk):
            return False
        rows = 1 if type(t.shape[1]) is int and t.shape[1] == 1 else None
        view_args = tuple(src["shape"])[:2] + ((rows,) if rows else tuple(src["shape"])[2:3])
        bias_shape = _graph_shape(view_args + (None,), 3, (b, h, t.shape[1], sk))
    if q4 is None or k4 is None or (bias is not None and bias_shape is None):
        return False
    q4, k4 = _reshaped(graph, view, q3, q4), _reshaped(graph, view, k3, k4)
    kt = insert_call(graph, view, "transpose", (k4, -1, -2), meta_from=view)
    new = insert_call(graph, view, torch.matmul, (q4, kt), meta_from=view)
    if alpha != 1:
        new = insert_call(graph, view, "__mul__", (new, alpha), meta_from=view)
    if bias is not None:
        bias4 = insert_call(graph, view, "reshape", (bias, bias_shape), meta_from=view)
        new = insert_call(graph, view, "__add__", (new, bias4), meta_from=view)
    view.replace_all_uses_with(new)
    graph.erase_node(view)
    graph.erase_node(mm)
    return True


def _unfold_values(graph: torch.fx.Graph, mm: torch.fx.Node) -> bool:
    """``bmm(p4.view(B*H, Sq, Sk), v3)`` -> ``matmul(p4, v4).reshape(B*H, Sq, Dv)``."""
    b = BMM.bind(mm)
    view = RESHAPE.bind(b["input"]) if b is not None else None
    if view is None or len(b["input"].users) != 1:
        return False
    p4, v3 = view["input"], b["other"]
    p, v, out = tensor_of(p4), tensor_of(v3), tensor_of(mm)
    if p is None or v is None or out is None or p.dim() != 4 or v.dim() != 3:
        return False
    bsz, h, sq, sk = p.shape
    if not (known_equal(v.shape[0], bsz * h) and known_equal(v.shape[1], sk)):
        return False
    v4 = _as_4d(v3, (bsz, h, sk, v.shape[2]))
    out_shape = _graph_shape(view["shape"], 2, out.shape)
    if v4 is None or out_shape is None:
        return False
    out4 = insert_call(graph, mm, torch.matmul, (p4, _reshaped(graph, mm, v3, v4)), meta_from=mm)
    new = insert_call(graph, mm, "reshape", (out4, out_shape), meta_from=mm)
    folded = b["input"]
    mm.replace_all_uses_with(new)
    graph.erase_node(mm)
    graph.erase_node(folded)
    return True


def unfold_batched_attention(graph: torch.fx.Graph) -> int:
    """Rewrite the 3-D batched spellings (module docstring) into 4-D matmuls; the number rewritten."""
    # Score products first: a score bmm would otherwise pass for a value product of the query.
    count = sum(_unfold_scores(graph, n) for n in list(graph.nodes) if RESHAPE.bind(n) is not None)
    count += sum(_unfold_values(graph, n) for n in list(graph.nodes) if BMM.bind(n) is not None)
    if count:
        logger.debug("unfolded %d batched attention products", count)
    return count


# ----------------------------------------------------------------------------------------------
# Sinks as a rescaled output (granite_swa, transformers 5.23 models/granite_swa/modeling_granite_swa.py):
#     lse = torch.logsumexp(scores, dim=-1)
#     sink_scale = (lse - sinks.view(1, -1, 1)).to(torch.float32).sigmoid()
#     out = softmax(scores) @ v * sink_scale.unsqueeze(-1).to(out.dtype)
# sigmoid(lse - s) = Z / (Z + e^s) with Z = sum_j e^{scores_j}, so ``out`` is attention with a sink
# logit s per head in the softmax denominator: ``kda_compile.ops.attention(..., sinks=sinks)``.
# ----------------------------------------------------------------------------------------------
LOGSUMEXP = family("logsumexp", ("input", "dim", "keepdim"), functions=(torch.logsumexp,), methods=("logsumexp",),
                   defaults={"keepdim": False})
SIGMOID = family("sigmoid", ("input",), functions=(torch.sigmoid, torch.nn.functional.sigmoid), methods=("sigmoid",))
UNSQUEEZE = family("unsqueeze", ("input", "dim"), functions=(torch.unsqueeze,), methods=("unsqueeze",))


@dataclass(frozen=True)
class SinkRescale:
    """The matched rescale: the sinks [H] tensor, its [1, H, 1] view, and the nodes from the
    logsumexp to the final product (the last one), which the rewrite replaces."""

    sinks: torch.fx.Node
    view: torch.fx.Node
    nodes: tuple[torch.fx.Node, ...]


def _single_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _through_casts(node: Any, taken: list) -> Any:
    """Walk down from ``node`` through single-user pure casts (recorded in ``taken``)."""
    while isinstance(node, torch.fx.Node):
        user = _single_user(node)
        if user is None or cast_dtype(user) is None or CAST.bind(user)["input"] is not node:
            return node
        taken.append(user)
        node = user
    return node


def match_sink_rescale(scores: torch.fx.Node, output: torch.fx.Node, heads: Any) -> SinkRescale | None:
    """The sink rescale (above) of ``output`` (softmax(scores) @ v) by a logsumexp of ``scores``, or None."""
    lses = [u for u in scores.users if LOGSUMEXP.bind(u) is not None]
    mul = _single_user(output)
    if len(lses) != 1 or mul is None or MUL.bind(mul) is None:
        return None
    lse, taken = lses[0], [lses[0]]
    lb = LOGSUMEXP.bind(lse)
    if lb["input"] is not scores or lb["keepdim"] or not is_last_dim(lb["dim"], 4):
        return None
    sub = _single_user(lse)
    sb = SUB.bind(sub) if sub is not None else None
    if sb is None or sb["input"] is not lse:
        return None
    view = RESHAPE.bind(sb["other"])
    sinks, shaped = (view["input"], tensor_of(sb["other"])) if view is not None else (None, None)
    if tensor_of(sinks) is None or tensor_of(sinks).dim() != 1 or not known_equal(tensor_of(sinks).shape[0], heads) \
            or shaped is None or not known_shape_equal(shaped.shape, (1, heads, 1)):
        return None
    taken.append(sub)
    sig = _through_casts(sub, taken)
    sig = _single_user(sig) if isinstance(sig, torch.fx.Node) else None
    if sig is None or SIGMOID.bind(sig) is None:
        return None
    taken.append(sig)
    unsq = _single_user(_through_casts(sig, taken))
    ub = UNSQUEEZE.bind(unsq) if unsq is not None else None
    if ub is None or not isinstance(ub["dim"], int) or ub["dim"] not in (-1, 3):
        return None
    taken.append(unsq)
    factor = _through_casts(unsq, taken)
    mb = MUL.bind(mul)
    if {mb["input"], mb["other"]} != {output, factor} or _single_user(factor) is not mul:
        return None
    return SinkRescale(sinks, sb["other"], tuple(taken) + (mul,))


def multiplied_scores(start: torch.fx.Node, depth: int = 6) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(product, factor) when, within ``depth`` arithmetic steps above the softmax input ``start``, the
    scores (a matmul) are multiplied elementwise by another tensor in a form the ``mult_mask`` stage
    (``w * b + fill * (1 - b)``, below) does not match: the reason of a site left alone."""
    frontier = [start]
    for _ in range(depth):
        nxt = []
        for node in frontier:
            b = MUL.bind(node)
            if b is not None and all(isinstance(x, torch.fx.Node) and tensor_of(x) is not None
                                     for x in (b["input"], b["other"])):
                for scores, factor in ((b["input"], b["other"]), (b["other"], b["input"])):
                    if _from_matmul(scores, depth):
                        return node, factor
            for fam in (MUL, ADD, SUB, DIV, CAST):
                fb = fam.bind(node)
                if fb is not None:
                    nxt.extend(v for v in fb.values() if isinstance(v, torch.fx.Node))
        frontier = nxt
    return None


def _from_matmul(node: torch.fx.Node, depth: int) -> bool:
    for _ in range(depth):
        if MATMUL.bind(node) is not None:
            return True
        b = (MUL.bind(node) or DIV.bind(node) or CAST.bind(node))
        if b is None or not isinstance(b["input"], torch.fx.Node):
            return False
        node = b["input"]
    return False


# ----------------------------------------------------------------------------------------------
# A clamp of the masked scores at the dtype minimum (xglm, models/xglm/modeling_xglm.py):
#     scores = torch.max(scores + mask, torch.full((), torch.finfo(scores.dtype).min))
# max(y, min) changes only the entries of y below the dtype minimum, i.e. -inf (an overflowed sum or a
# -inf mask value), into min (NaN stays NaN). softmax subtracts the row max m; where m > min + 104 (745 when
# the softmax runs in fp64) exp(min - m) underflows to exactly 0, like exp(-inf): the probabilities are
# unchanged. In fp32 any entry above min is that far above it (the spacing of fp32 floats near min is
# 2**104), so only a row with every entry at min or -inf can differ (fp16 / bf16 scores with the softmax
# in fp32: also a row whose best score is within 104 of min): eager gives those keys equal weight.
# attention/softmax.py drops the clamp and clamps the additive mask it passes to the op alike, so such a
# row comes out uniform too (s + min rounds to min in fp32 for |s| < 2**103).
# ----------------------------------------------------------------------------------------------
MAXIMUM = family("maximum", ("input", "other"), functions=(torch.maximum, torch.max), methods=("maximum", "max"))
CLAMP_MIN = family("clamp_min", ("input", "min"), functions=(torch.clamp_min, torch.clamp, torch.clip),
                   methods=("clamp_min", "clamp", "clip"), defaults={"max": None})


def clamp_bound(value: Any) -> float | None:
    """The lower bound a clamp stage applies: a float, or a 0-d tensor literal holding one."""
    if isinstance(value, int):  # bools too
        return None
    return fill_value(value)


# ----------------------------------------------------------------------------------------------
# Sinks per query (inkling2, models/inkling2/modeling_inkling2.py): one extra logit column computed from
# the hidden states, [B, H, Sq, 1], instead of one logit per head:
#     logits = torch.cat([scores, sink_proj(hidden).transpose(1, 2).unsqueeze(-1)], dim=-1).float()
#     probs = softmax(logits, dim=-1)[..., :-1].to(dtype)
# With Z = sum_j exp(s_j) and sink t, probs @ v = (softmax(s) @ v) * Z / (Z + e^t), and
# Z / (Z + e^t) = sigmoid(lse - t), lse = log Z: the op's output rescaled by its own log-sum-exp
# (kda_compile.ops.attention_with_lse). A row with no key to attend has out 0 and lse -inf: 0, as in eager.
# ----------------------------------------------------------------------------------------------
def rescale_by_query_sinks(graph: torch.fx.Graph, at: torch.fx.Node, call: torch.fx.Node,
                           sinks: torch.fx.Node) -> torch.fx.Node:
    """``out * sigmoid(lse - sinks)`` in fp32, cast to ``out``'s dtype, for ``call`` = (out, lse) of
    ``attention_with_lse`` and ``sinks`` [B or 1, H, Sq, 1]."""
    out = insert_call(graph, at, operator.getitem, (call, 0), meta_from=at)
    lse = insert_call(graph, at, operator.getitem, (call, 1), meta_from=at)
    column = insert_call(graph, at, "float", (insert_call(graph, at, "squeeze", (sinks, -1), meta_from=at),),
                         meta_from=at)
    factor = insert_call(graph, at, torch.sigmoid, (insert_call(graph, at, operator.sub, (lse, column),
                                                                meta_from=at),), meta_from=at)
    factor = insert_call(graph, at, "unsqueeze", (factor, -1), meta_from=at)
    scaled = insert_call(graph, at, operator.mul, (insert_call(graph, at, "float", (out,), meta_from=at), factor),
                         meta_from=at)
    return insert_call(graph, at, "to", (scaled, tensor_of(out).dtype), meta_from=at)


def graph_input_behind(node: Any, depth: int = 6) -> torch.fx.Node | None:
    """The placeholder ``node`` is a view, slice or cast of (within ``depth`` steps), or None."""
    for _ in range(depth):
        if not isinstance(node, torch.fx.Node):
            return None
        if node.op == "placeholder":
            return node
        if node.op not in ("call_function", "call_method") or not node.args:
            return None
        passes_through = (RESHAPE.bind(node) is not None or CAST.bind(node) is not None
                          or node.target in (operator.getitem, "expand", "contiguous"))
        if not passes_through:
            return None
        node = node.args[0]
    return None


def is_zero(value: Any) -> bool:
    """A literal 0 (xlnet's segment term without segment ids: ``(content + position + 0) * scale``); the
    stage that reads it drops the addition, exact but for the sign of a zero score, which the softmax
    does not see."""
    return _number(value) and value == 0


# ----------------------------------------------------------------------------------------------
# A float mask subtracted after the scale (xlnet, models/xlnet/modeling_xlnet.py):
#     attn_score = (ac + bd + ef) * self.scale - 1e30 * torch.einsum("ijbn->bnij", attn_mask)
# s - m is s + (-m) in IEEE arithmetic, so the op gets -m added to the mask it already has (not scaled by
# a scale after the mask, which this term follows), or -m where a bool mask keeps a key.
# ----------------------------------------------------------------------------------------------
def subtracted_reason(subtracted: Any, result: Any, scores: Any, clamped: bool) -> str | None:
    """Why ``scores - subtracted`` (``result``) cannot become part of the op's float mask, or None."""
    if subtracted is None or not subtracted.dtype.is_floating_point:
        return "a tensor subtracted from the scores is not a float mask"
    if result is None or not known_shape_equal(result.shape, scores.shape):
        return "the subtracted mask broadcasts the scores to a larger shape"
    return "a mask is subtracted after the clamp of the scores, which the op cannot express" if clamped else None


def with_subtracted(graph: torch.fx.Graph, at: torch.fx.Node, mask: Any, subtracted: torch.fx.Node) -> torch.fx.Node:
    """The op's mask once ``subtracted`` is subtracted from the masked scores."""
    if mask is None:
        return insert_call(graph, at, operator.neg, (subtracted,), meta_from=at)
    if tensor_of(mask).dtype == torch.bool:
        negated = insert_call(graph, at, operator.neg, (subtracted,), meta_from=at)
        return insert_call(graph, at, torch.where, (mask, negated, float("-inf")), meta_from=at)
    return insert_call(graph, at, operator.sub, (mask, subtracted), meta_from=at)


# ----------------------------------------------------------------------------------------------
# A multiplicative 0/1 mask with a finite fill (openai-gpt, models/openai/modeling_openai.py):
#     b = self.bias[:, :, : w.size(-2), : w.size(-1)]       # torch.tril(torch.ones(n, n)), a buffer
#     w = w * b + -1e4 * (1 - b)
# Where b is 1: w * 1 + -1e4 * 0 = w + -0 = w, bit for bit; where b is 0: w * 0 + -1e4 = -1e4 (finite w).
# So for a 0/1 b the scores are torch.where(b != 0, w, -1e4), and the op gets the bool mask b != 0, read
# from the live buffer in the graph. A key masked with -1e4 gets weight exp(-1e4 - m) / Z, where m is the
# row's largest score: exactly 0 in fp32 once m > -1e4 + 104 (e^-104 rounds to 0), in fp64 once
# m > -1e4 + 745, sooner in fp16 / bf16; the op gives it exactly 0 weight. A row with every key masked would
# differ (eager: equal weights on all keys; the op: 0), so every row of the buffer must keep its first
# key and the slice must start at the first key. Only a module buffer is taken (not an argument, whose
# values change from call to call): a graph input, its values are read when compiling (Dynamo's example
# of the input) and not guarded, so a later buffer with other 0/1 values of that kind stays exact; one with
# values other than 0 and 1 would not.
# ----------------------------------------------------------------------------------------------
MULT_FILL_MAX = -1e4


def _first_key_kept(factor: torch.fx.Node, source: torch.fx.Node) -> bool:
    """``factor`` is ``source`` or ``source[..slices..]`` whose last slice starts at the first key."""
    if factor is source:
        return True
    b = GETITEM.bind(factor)
    index, src = (b["index"], tensor_of(source)) if b is not None and b["input"] is source else (None, None)
    if not isinstance(index, tuple) or src is None or len(index) != src.dim() \
            or not all(isinstance(i, slice) for i in index):
        return False
    return index[-1].start in (None, 0) and index[-1].step in (None, 1)


def _buffer_value(placeholder: torch.fx.Node) -> torch.Tensor | None:
    """The real tensor Dynamo compiled a graph input for (its example), when that input is a module
    buffer (``..._buffers['bias']``: an argument may hold other values at the next call); else None."""
    try:
        arg = placeholder.meta["grapharg"]
        value, source = arg.example, arg.source.name
        source = source() if callable(source) else source
    except (KeyError, AttributeError, RuntimeError, TypeError):
        return None
    if "._buffers[" not in str(source) or not isinstance(value, torch.Tensor) \
            or isinstance(value, torch._subclasses.FakeTensor):
        return None
    return value


def multiplicative_mask_reason(factor: Any, fill: Any, result: Any, scores: Any) -> str | None:
    """Why ``scores * factor + fill * (1 - factor)`` (``result``) is not the bool mask ``factor != 0``
    (the comment above), or None."""
    what = f"the scores are multiplied by {describe_node(factor)} and masked with {fill}"
    if not (_number(fill) and math.isfinite(fill) and fill <= MULT_FILL_MAX):
        return f"{what}: a fill above {MULT_FILL_MAX:g} (or not finite) does not give masked keys zero weight"
    if result is None or not known_shape_equal(result.shape, scores.shape):
        return f"{what}: the mask broadcasts the scores to a larger shape"
    source = graph_input_behind(factor)
    value = _buffer_value(source) if source is not None else None
    if value is None:
        return (f"{what}: it is no module buffer whose values are known when compiling (an input may change "
                f"from call to call), so it is not provably a 0/1 mask")
    if not bool(((value == 0) | (value == 1)).all()):
        return f"{what}: {source.name} holds values other than 0 and 1"
    if value.dim() < 2 or not bool((value[..., 0] == 1).all()) or not _first_key_kept(factor, source):
        return f"{what}: a query could have every key masked ({source.name} or its slice drops the first key)"
    return None


def keep_of_factor(graph: torch.fx.Graph, at: torch.fx.Node, factor: torch.fx.Node) -> torch.fx.Node:
    """The bool mask ``factor != 0`` (True = attend), read from the live factor."""
    return insert_call(graph, at, operator.ne, (factor, 0), meta_from=at)
