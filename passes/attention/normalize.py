"""Exact graph normalisations that bring more spellings of eager attention to the form
attention/softmax.py matches. Each one changes how a value is computed, never the value (up to the
association of one reduction where a product changes its spelling), and is applied wherever its
conditions hold, attention or not.

In-place updates of a fresh tensor (xlm, transformers 5.23 models/xlm/modeling_xlm.py)::

    scores = torch.matmul(q, k.transpose(2, 3))
    mask = (mask == 0).view(mask_reshape).expand_as(scores)
    scores.masked_fill_(mask, torch.finfo(scores.dtype).min)
    weights = softmax(scores.float(), dim=-1).type_as(scores)

Dynamo records the in-place call and keeps reading ``scores`` (the matmul node) after it.
:func:`functionalize_inplace` replaces ``x.masked_fill_(...)`` (and the other elementwise in-place
methods of :data:`INPLACE`) with ``y = x.masked_fill(...)`` and points every node after it that read
``x`` (or the in-place call's result) at ``y``. That is exact when no node before the update shares
the storage of ``x``: none before ``x`` (an input, a parameter, a tensor ``x`` is a view of: ``x`` is a
new tensor) and none between ``x`` and the update (a view of ``x`` taken before it and read after it
would have seen the update); the storage is read from the fake tensors Dynamo keeps as example values,
which keep the aliasing of the ops that made them. ``y`` must also have the dtype and shape of ``x``
(the in-place call neither promotes nor broadcasts ``x``).

einsum products (prophetnet, models/prophetnet/modeling_prophetnet.py; xlnet, models/xlnet/modeling_xlnet.py)::

    weights = torch.einsum("bntc,bncs->bnts", query, key.transpose(2, 3))     # q @ k^T
    output = torch.einsum("bntc,bncs->bnts", probs, value)                    # p @ v
    ac = torch.einsum("ibnd,jbnd->bnij", q_head + self.r_w_bias, k_head_h)    # xlnet: [S, B, H, D] operands
    attn_vec = torch.einsum("bnij,jbnd->ibnd", attn_prob, v_head_h)

:func:`einsum_to_matmul` turns a two-operand einsum that is one batched matrix product into ``matmul``:
batch letters in both operands and the output, one row letter (first operand and output), one column
letter (second operand and output), one contracted letter (both operands), in any order
(:func:`matmul_plan`). The operands are permuted to [batch..., i, j] and [batch..., j, k] (or [batch...,
k, j] then ``transpose(-1, -2)`` when the contracted letter comes last, as keys are laid out: q . k
without the transpose written out), and the product is permuted to the output's order. Other equations
(projections with two contracted letters, ``"ibh,hnd->ibnd"``) stay.

Pre-transposed keys (openai-gpt, models/openai/modeling_openai.py)::

    key = x.view(B, S, H, D).permute(0, 2, 3, 1)                                # [B, H, D, S]
    w = torch.matmul(query, key)

:func:`transposed_keys` writes the permute as ``x.permute(0, 2, 1, 3).transpose(-1, -2)`` (the same view)
where a matmul reads it as its second operand and it puts the last dim of ``x`` second to last.

Row-wise ops of a folded tensor (mvp, trocr, xglm: models/mvp/modeling_mvp.py)::

    scores = torch.bmm(q3, k3.transpose(1, 2)).view(B, H, Sq, Sk) + mask       # 4-D
    probs = softmax(scores.view(B * H, Sq, Sk), dim=-1)                        # 3-D again
    probs = dropout(probs.view(B, H, Sq, Sk).view(B * H, Sq, Sk))              # xglm's two views
    out = torch.bmm(probs, v3)

:func:`sink_folds` rewrites ``f(x4.view(B * H, Sq, Sk))`` as ``f(x4).reshape(B * H, Sq, Sk)`` for
a softmax over the last dim, a dropout or a pure cast ``f``: the fold keeps each row of the last dim
whole (the last sizes are equal), so a softmax over it sees the same rows, and the others are
elementwise. A fold read back as the 4-D tensor it folded (``y4.reshape(B*H, ...).view(B, H, ...)``)
becomes ``y4``. The fold then sits right before the value ``bmm``, which
``attention_spellings.unfold_batched_attention`` turns into a 4-D matmul.

Unused views (prophetnet's ``attn_weights.view(...)`` read only for its shape) are erased, so that
they do not count as other users of the scores.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from kda_compile.passes.toolkit.graph_tools import (insert_call, is_inplace, is_last_dim, known_equal,
                                                    known_shape_equal, tensor_of)
from kda_compile.passes.toolkit.matching import DROPOUT, MATMUL, RESHAPE, SOFTMAX, cast_dtype, family

logger = logging.getLogger("kda_compile.passes.attention_normalize")

# In-place elementwise methods and their out-of-place forms.
INPLACE = {"masked_fill_": "masked_fill", "add_": "add", "sub_": "sub", "mul_": "mul", "div_": "div",
           "clamp_": "clamp", "clamp_min_": "clamp_min", "clamp_max_": "clamp_max"}
EINSUM = (torch.einsum, torch.functional.einsum)


def _aliases(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether the example values of ``a`` and ``b`` share storage (fake tensors keep the aliasing of the
    ops that made them: a view, a slice, ``x.float()`` of a float32 ``x``); False for non-tensors."""
    ta, tb = tensor_of(a), tensor_of(b)
    if ta is None or tb is None:
        return False
    try:
        return bool(torch._C._is_alias_of(ta, tb))
    except (RuntimeError, TypeError, NotImplementedError):
        return True  # unknown: as if it were an alias


def _functionalize(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    x = node.args[0] if node.args else None
    if not isinstance(x, torch.fx.Node) or x.op not in ("call_function", "call_method") or tensor_of(x) is None:
        return False
    # x owns its storage (no earlier node shares it) and no node before the update made a view of it
    order: dict[torch.fx.Node, int] = {}
    for i, other in enumerate(graph.nodes):
        order[other] = i
        if other is node:
            break
        if other is not x and _aliases(other, x):
            return False
    try:
        new = insert_call(graph, node, INPLACE[node.target], tuple(node.args), dict(node.kwargs), meta_from=node)
    except (TypeError, ValueError, RuntimeError):
        return False
    want, got = tensor_of(x), tensor_of(new)
    if got is None or got.dtype != want.dtype or not known_shape_equal(got.shape, want.shape):
        graph.erase_node(new)
        return False
    for user in [u for u in x.users if u not in order and u is not new]:  # the readers after the update
        user.replace_input_with(x, new)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return True


def functionalize_inplace(graph: torch.fx.Graph) -> int:
    """Replace in-place elementwise updates of fresh tensors (module docstring); the number replaced."""
    count = 0
    for node in list(graph.nodes):
        if node.op == "call_method" and node.target in INPLACE and is_inplace(node):
            count += _functionalize(graph, node)
    return count


_LETTERS = re.compile(r"^[A-Za-z]+$")


@dataclass(frozen=True)
class MatmulPlan:
    """How a two-operand einsum is one ``matmul``: permute the first operand to [batch..., i, j] and the
    second to [batch..., j, k] (or to [batch..., k, j], then ``transpose(-1, -2)``), multiply, and
    permute [batch..., i, k] to the output's order. A permutation is None where it is the identity."""

    first: tuple[int, ...] | None
    second: tuple[int, ...] | None
    transposed: bool
    out: tuple[int, ...] | None


def _permutation(letters: str, order: str) -> tuple[int, ...] | None:
    perm = tuple(letters.index(c) for c in order)
    return None if perm == tuple(range(len(perm))) else perm


def matmul_plan(equation: Any) -> MatmulPlan | None:
    """The :class:`MatmulPlan` of a two-operand einsum equation with batch letters (in both operands and
    the output), one letter only in the first operand and the output (i), one only in the second and the
    output (k), and one contracted letter in both operands only (j), in any order; else None.
    ``"bhqd,bhkd->bhqk"`` is ``q @ k^T``; ``"ibnd,jbnd->bnij"`` (xlnet) the same with permuted operands."""
    if not isinstance(equation, str) or "->" not in equation:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    operands = inputs.split(",")
    if len(operands) != 2:
        return None
    a, b = operands
    if not all(_LETTERS.match(s) and len(set(s)) == len(s) for s in (a, b, out)):
        return None
    rows, cols, contracted = set(a) & set(out) - set(b), set(b) & set(out) - set(a), set(a) & set(b) - set(out)
    batch = "".join(c for c in out if c in a and c in b)
    if not (len(rows) == len(cols) == len(contracted) == 1) or set(a) | set(b) != set(out) | contracted:
        return None
    (i,), (j,), (k,) = rows, contracted, cols
    transposed = b.index(j) > b.index(k)  # the contracted letter last, as keys [.., Sk, D] are laid out
    return MatmulPlan(_permutation(a, batch + i + j), _permutation(b, batch + (k + j if transposed else j + k)),
                      transposed, _permutation(batch + i + k, out))


def _einsum_operands(node: torch.fx.Node) -> tuple[str, list] | None:
    if node.kwargs or len(node.args) < 2:
        return None
    equation, rest = node.args[0], list(node.args[1:])
    if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
        rest = list(rest[0])
    return (equation, rest) if len(rest) == 2 and all(tensor_of(r) is not None for r in rest) else None


def _planned_matmul(graph: torch.fx.Graph, node: torch.fx.Node, plan: MatmulPlan, a: Any, b: Any,
                    inserted: list) -> None:
    """Insert the nodes of ``plan`` before ``node`` (recorded in ``inserted``; a call that fails raises)."""
    def call(target, args):
        inserted.append(insert_call(graph, node, target, args, meta_from=node))
        return inserted[-1]

    a = call("permute", (a, plan.first)) if plan.first else a
    b = call("permute", (b, plan.second)) if plan.second else b
    b = call("transpose", (b, -1, -2)) if plan.transposed else b
    product = call(torch.matmul, (a, b))
    if plan.out:
        call("permute", (product, plan.out))


def einsum_to_matmul(graph: torch.fx.Graph) -> int:
    """Replace einsum matrix products with ``matmul`` (module docstring); the number replaced."""
    count = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in EINSUM]:
        found = _einsum_operands(node)
        plan = matmul_plan(found[0]) if found is not None else None
        if plan is None or tensor_of(node) is None:
            continue
        inserted: list[torch.fx.Node] = []
        try:
            _planned_matmul(graph, node, plan, *found[1], inserted)
        except (TypeError, ValueError, RuntimeError):  # operands matmul does not broadcast like einsum
            inserted.append(None)
        new, want = inserted[-1], tensor_of(node)
        if new is None or tensor_of(new).dtype != want.dtype or not known_shape_equal(tensor_of(new).shape,
                                                                                       want.shape):
            for n in inserted[::-1]:
                if n is not None:
                    graph.erase_node(n)
            continue
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        count += 1
    return count


PERMUTE = family("permute", ("input", "*dims"), functions=(torch.permute,), methods=("permute",))


def _pre_transposed(node: Any) -> tuple[torch.fx.Node, tuple[int, ...]] | None:
    """(x, p) when ``node`` is ``x.permute(p)`` of an N-D ``x`` (N >= 2) that puts the last dim of ``x``
    second to last (openai-gpt's keys: [B, S, H, D].permute(0, 2, 3, 1) is [B, H, D, S])."""
    b = PERMUTE.bind(node)
    x = tensor_of(b["input"]) if b is not None else None
    dims = tuple(b["dims"]) if b is not None else ()
    if x is None or x.dim() < 2 or len(dims) != x.dim() or not all(isinstance(d, int) for d in dims):
        return None
    dims = tuple(d % x.dim() for d in dims)
    return (b["input"], dims) if sorted(dims) == list(range(x.dim())) and dims[-2] == x.dim() - 1 else None


def transposed_keys(graph: torch.fx.Graph) -> int:
    """``matmul(q, x.permute(p))`` with ``p`` putting the last dim of ``x`` second to last ->
    ``matmul(q, x.permute(p').transpose(-1, -2))``, ``p'`` = ``p`` with its last two entries swapped (the
    same view of ``x``): the keys [.., Sk, D] then reach the score product as ``k.transpose(-1, -2)``,
    the form attention/softmax.py matches. The number rewritten."""
    count = 0
    for node in [n for n in graph.nodes if MATMUL.bind(n) is not None]:
        other = MATMUL.bind(node)["other"]
        found = _pre_transposed(other)
        if found is None or set(other.users) != {node} or MATMUL.bind(node)["input"] is other:
            continue
        x, dims = found
        keys = dims[:-2] + (dims[-1], dims[-2])
        if keys != tuple(range(len(keys))):
            x = insert_call(graph, node, "permute", (x, keys), meta_from=other)
        new = insert_call(graph, node, "transpose", (x, -1, -2), meta_from=other)
        other.replace_all_uses_with(new)
        graph.erase_node(other)
        count += 1
    return count


def _fold_source(view: Any) -> torch.fx.Node | None:
    """``x4`` when ``view`` is ``x4.view(B * H, Sq, Sk)`` (or a reshape) of a 4-D ``x4``."""
    b = RESHAPE.bind(view)
    if b is None:
        return None
    x, folded = tensor_of(b["input"]), tensor_of(view)
    if x is None or folded is None or x.dim() != 4 or folded.dim() != 3:
        return None
    ok = (known_equal(folded.shape[0], x.shape[0] * x.shape[1]) and known_equal(folded.shape[1], x.shape[2])
          and known_equal(folded.shape[2], x.shape[3]))
    return b["input"] if ok else None


def _row_wise(node: torch.fx.Node) -> bool:
    """A softmax over the last dim, an out-of-place dropout or a pure cast, reading its input as first
    argument."""
    dropout = DROPOUT.bind(node)
    if SOFTMAX.bind(node) is not None:
        ok = is_last_dim(SOFTMAX.bind(node)["dim"], 3)
    else:
        ok = (dropout is not None and dropout["inplace"] is False) or cast_dtype(node) is not None
    return ok and bool(node.args) and isinstance(node.args[0], torch.fx.Node)


def _hoist(graph: torch.fx.Graph, node: torch.fx.Node, erased: set) -> bool:
    """``f(x4.view(B*H, Sq, Sk))`` -> ``f(x4).reshape(B*H, Sq, Sk)``."""
    if not _row_wise(node):
        return False
    view = node.args[0]
    x4 = _fold_source(view)
    if x4 is None:
        return False
    args, kwargs = (x4,) + tuple(node.args[1:]), dict(node.kwargs)
    if SOFTMAX.bind(node) is not None:  # the dim, wherever given, becomes -1 (still the last)
        if len(args) > 1 and not isinstance(args[1], torch.fx.Node) and "dim" not in kwargs:
            args = args[:1] + (-1,) + args[2:]
        else:
            kwargs["dim"] = -1
    new = insert_call(graph, node, node.target, args, kwargs, meta_from=node)
    fold = insert_call(graph, node, "reshape", (new, tuple(RESHAPE.bind(view)["shape"])), meta_from=view)
    node.replace_all_uses_with(fold)
    _erase(graph, [node, view], erased)
    return True


def _erase(graph: torch.fx.Graph, nodes: list, erased: set) -> None:
    """Erase ``nodes`` that have no users left (in order), recording them in ``erased``."""
    for node in nodes:
        if not node.users:
            graph.erase_node(node)
            erased.add(node)


def _unfold_back(graph: torch.fx.Graph, node: torch.fx.Node, erased: set) -> bool:
    """``y4.reshape(B*H, Sq, Sk).view(B, H, Sq, Sk)`` -> ``y4``: the same elements in the same storage
    (the fold is a view of ``y4``, and ``.view`` never copies), so also the same under any later in-place
    update. (The outer view's example value may still be that of the tensor a hoisted op replaced, so
    its aliasing is read from the call, not from the example values.)"""
    b = RESHAPE.bind(node)
    inner = b["input"] if b is not None else None
    y4 = _fold_source(inner)
    if y4 is None or node.op != "call_method" or node.target != "view" or not _aliases(inner, y4):
        return False
    if tensor_of(node) is None or not known_shape_equal(tensor_of(node).shape, tensor_of(y4).shape):
        return False
    node.replace_all_uses_with(y4)
    _erase(graph, [node, inner], erased)
    return True


def sink_folds(graph: torch.fx.Graph) -> int:
    """Move [B*H, Sq, Sk] folds below the row-wise ops that read them (module docstring); the number of
    nodes rewritten."""
    count, changed = 0, True
    while changed:
        changed, erased = False, set()
        for node in list(graph.nodes):
            if node not in erased and (_hoist(graph, node, erased) or _unfold_back(graph, node, erased)):
                changed, count = True, count + 1
    return count


def erase_unused_views(graph: torch.fx.Graph) -> int:
    """Erase views and reshapes nothing reads (and the views they read that nothing else reads); the
    number erased."""
    count = 0
    for node in reversed(list(graph.nodes)):
        if RESHAPE.bind(node) is not None and not node.users:
            graph.erase_node(node)
            count += 1
    return count


def normalize_attention(graph: torch.fx.Graph) -> int:
    """Every normalisation of this module, in order; the number of changes."""
    count = (erase_unused_views(graph) + functionalize_inplace(graph) + einsum_to_matmul(graph)
             + transposed_keys(graph) + sink_folds(graph))
    if count:
        logger.debug("normalised %d attention spellings", count)
    return count


# ----------------------------------------------------------------------------------------------
# Reads of a tensor's shape or dtype only: ``mask.expand_as(scores)`` (xlm), ``x.type_as(scores)``.
# They keep the scores alive after the attention is replaced unless rewritten to read the sizes
# elsewhere: ``mask.expand(B, H, Sq, Sk)`` with the sizes from the query and keys, ``x.to(dtype)``.
# ----------------------------------------------------------------------------------------------
def metadata_read(user: torch.fx.Node, node: torch.fx.Node, full: Any) -> bool:
    """Whether ``user`` reads only the shape (of ``full`` size) or the dtype of ``node``."""
    if user.op != "call_method" or len(user.args) != 2 or user.kwargs or user.args[1] is not node \
            or user.args[0] is node:
        return False
    if user.target == "expand_as":
        return tensor_of(node) is not None and known_shape_equal(tensor_of(node).shape, full)
    return user.target == "type_as" and tensor_of(node) is not None


def replace_metadata_reads(graph: torch.fx.Graph, nodes: Any, full: Any, query: torch.fx.Node,
                           key: torch.fx.Node) -> None:
    """Rewrite the :func:`metadata_read` users of ``nodes`` (scores of shape ``full`` = [B, H, Sq, Sk],
    ``query`` [B, H, Sq, D], ``key`` [B, Hkv, Sk, D]) so that they no longer read them."""
    inside = set(nodes)
    for node in nodes:
        for user in [u for u in node.users if u not in inside and metadata_read(u, node, full)]:
            if user.target == "expand_as":
                sizes = tuple(_size(graph, user, query if d < 3 else key, d if d < 3 else 2, full[d])
                              for d in range(4))
                new = insert_call(graph, user, "expand", (user.args[0], *sizes), meta_from=user)
            else:
                new = insert_call(graph, user, "to", (user.args[0], tensor_of(node).dtype), meta_from=user)
            user.replace_all_uses_with(new)
            graph.erase_node(user)


def _size(graph: torch.fx.Graph, at: torch.fx.Node, tensor: torch.fx.Node, dim: int, size: Any) -> Any:
    """``size`` as a graph value: the int, or ``tensor.size(dim)`` for a symbolic size."""
    return size if type(size) is int else insert_call(graph, at, "size", (tensor, dim), meta_from=at)
