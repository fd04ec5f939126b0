"""One token of the (gated) delta rule, as the Dynamo graph spells it: the pattern that
``delta_rule/recurrence.py`` finds T times in an unrolled KDA loop.

With state ``S`` [B, H, K, V] and the token's slices ``q_t, k_t, g_t`` [B, H, K], ``v_t`` [B, H, V],
``beta_t`` [B, H]::

    S = S * g_t[..., None].exp()                        # decay (DECAYED)
    kv = (S * k_t[..., None]).sum(-2)                   # readout(S, k_t) = S^T k_t
    S = S + outer(k_t, (v_t - kv) * beta_t[..., None])  # STEP (or outer(beta_t[..., None] * k_t, v_t - kv))
    o_t = (S * q_t[..., None]).sum(-2)                  # OUTPUT = readout(S, q_t)

Each building block accepts every spelling met in FLA's naive reference, Hugging Face's torch
fallback and hand-written loops: ``readout`` is a multiply-and-sum over the key dim, an einsum
``...k,...kv->...v`` or ``(x[..., None, :] @ S).squeeze(-2)``; ``outer`` is a broadcast product or
an einsum ``...k,...v->...kv``; ``x[..., None]`` may be indexing, ``unsqueeze`` or ``view`` (checked
on shapes, not spelling); a token slice may be ``x[:, t]``, ``x[:, :, t]``, ``x.select(d, t)`` or
``x.unbind(d)[t]``, and two slice nodes of the same token of the same input count as one.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from kda_compile.passes.toolkit.graph_tools import known_shape_equal, static_int, tensor_of
from kda_compile.passes.toolkit.matching import (ADD, GETITEM, MATMUL, MUL, RESHAPE, SUB, Bindings, Call, Capture,
                                                 Const, OneOf, Pattern, family)

# ----------------------------------------------------------------------------------------------
# Op families beyond toolkit/matching.py (candidates to move there)
# ----------------------------------------------------------------------------------------------
EXP = family("exp", ("input",), functions=(torch.exp,), methods=("exp",))
SUM = family("sum", ("input", "dim", "keepdim"), functions=(torch.sum,), methods=("sum",),
             defaults={"keepdim": False, "dtype": None})
SQUEEZE = family("squeeze", ("input", "dim"), functions=(torch.squeeze,), methods=("squeeze",))
UNSQUEEZE = family("unsqueeze", ("input", "dim"), functions=(torch.unsqueeze,), methods=("unsqueeze",))
SELECT = family("select", ("input", "dim", "index"), functions=(torch.select,), methods=("select",))
UNBIND = family("unbind", ("input", "dim"), functions=(torch.unbind,), methods=("unbind",), defaults={"dim": 0})
IADD = family("iadd", ("input", "other"), functions=(operator.iadd,))
EINSUMS = (torch.einsum, torch.functional.einsum)


# ----------------------------------------------------------------------------------------------
# Patterns over one step
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenSlice:
    """``source[:, ..., t]``: token ``index`` of ``source`` along ``dim`` (non-negative)."""

    source: torch.fx.Node
    dim: int
    index: int


def _is_full_slice(i: Any) -> bool:
    return isinstance(i, slice) and i == slice(None)


def parse_token_index(index: Any, ndim: int) -> tuple[int, int] | None:
    """``(dim, t)`` for an index that picks one token along one dim and keeps every other dim whole
    (``x[:, t]``, ``x[:, :, t]``, ``x[..., t, :]``), else None."""
    items = index if isinstance(index, tuple) else (index,)
    ints = [n for n, i in enumerate(items) if isinstance(i, int) and not isinstance(i, bool)]
    if len(ints) != 1 or not all(i is Ellipsis or _is_full_slice(i) for n, i in enumerate(items) if n != ints[0]):
        return None
    pos, t = ints[0], items[ints[0]]
    if Ellipsis in items[:pos]:
        dim = ndim - (len(items) - pos)
    else:
        dim = pos
    return (dim, t) if 0 <= dim < ndim else None


def token_slice(node: Any) -> TokenSlice | None:
    """The token slice a node takes: ``x[:, t]``, ``x.select(d, t)``, ``x.unbind(d)[t]``."""
    bound = GETITEM.bind(node)
    if bound is not None:
        src, index = bound["input"], bound["index"]
        unbound = UNBIND.bind(src)
        if unbound is not None and isinstance(index, int) and isinstance(unbound["dim"], int):
            src_t = tensor_of(unbound["input"])
            return _slice(unbound["input"], unbound["dim"], index, src_t)
        src_t = tensor_of(src)
        parsed = parse_token_index(index, src_t.dim()) if src_t is not None else None
        return _slice(src, parsed[0], parsed[1], src_t) if parsed else None
    bound = SELECT.bind(node)
    if bound is not None and isinstance(bound["dim"], int) and isinstance(bound["index"], int):
        return _slice(bound["input"], bound["dim"], bound["index"], tensor_of(bound["input"]))
    return None


def _slice(src: Any, dim: int, index: int, src_t: torch.Tensor | None) -> TokenSlice | None:
    if src_t is None or not isinstance(src, torch.fx.Node):
        return None
    dim = dim % src_t.dim()
    length = static_int(src_t.shape[dim])
    if length is None or not -length <= index < length:
        return None
    return TokenSlice(src, dim, index % length)


@dataclass(frozen=True)
class Token(Pattern):
    """A token slice of some input; binds ``name`` to its :class:`TokenSlice`, so two slice nodes
    of the same token of the same input match as one."""

    name: str

    def matches(self, value, bindings):
        ref = token_slice(value)
        if ref is not None:
            bound = bindings.bind(self.name, ref)
            if bound is not None:
                yield bound.consume(value)

    def describe(self) -> str:
        return f"token slice {self.name}"


def unit_dim_source(node: Any, dim: int) -> Any:
    """The tensor ``node`` views with one size-1 dim inserted at ``dim`` (negative, counted on the
    output): ``x[..., None]``, ``x.unsqueeze(-1)``, ``x[:, :, None]``, ``x.view(*x.shape, 1)``."""
    source = None
    bound = GETITEM.bind(node)
    if bound is not None:
        items = bound["index"] if isinstance(bound["index"], tuple) else (bound["index"],)
        if all(i is None or i is Ellipsis or _is_full_slice(i) for i in items):
            source = bound["input"]
    for fam in (UNSQUEEZE, RESHAPE):
        bound = fam.bind(node) if source is None else None
        if bound is not None:
            source = bound["input"]
    out, inp = tensor_of(node), tensor_of(source)
    if out is None or inp is None or out.dim() != inp.dim() + 1:
        return None
    p = dim % out.dim()
    return source if known_shape_equal(out.shape, (*inp.shape[:p], 1, *inp.shape[p:])) else None


@dataclass(frozen=True)
class UnitDim(Pattern):
    """``inner`` viewed with a size-1 dim inserted at ``dim``."""

    inner: Any
    dim: int

    def matches(self, value, bindings):
        source = unit_dim_source(value, self.dim)
        if source is not None:
            yield from self.inner.matches(source, bindings.consume(value))

    def describe(self) -> str:
        return f"{self.inner.describe()} with a unit dim at {self.dim}"


def einsum_roles(node: Any, kind: str) -> tuple[Any, Any] | None:
    """For an einsum computing ``S^T x`` (kind "readout": ``...k,...kv->...v``) the operands
    ``(x, S)``; for an outer product (kind "outer": ``...k,...v->...kv``) ``(k side, v side)``."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in EINSUMS):
        return None
    if not node.args or not isinstance(node.args[0], str) or node.kwargs:
        return None
    operands = list(node.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    equation = node.args[0].replace(" ", "").replace("...", "#")
    if len(operands) != 2 or equation.count("->") != 1:
        return None
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    if len(terms) != 2 or any(len(set(t)) != len(t) for t in terms + [out]):
        return None
    for (x, y), (a, b) in (((terms[0], terms[1]), (operands[0], operands[1])),
                           ((terms[1], terms[0]), (operands[1], operands[0]))):
        if kind == "readout" and y[:-1] == x and out == x[:-1] + y[-1]:
            return a, b
        if kind == "outer" and x[:-1] == y[:-1] and x[-1] != y[-1] and out == x + y[-1]:
            return a, b
    return None


@dataclass(frozen=True)
class Einsum(Pattern):
    """An einsum of kind "readout" (``first`` = x, ``second`` = S) or "outer" (``first`` = k side)."""

    kind: str
    first: Any
    second: Any

    def matches(self, value, bindings):
        roles = einsum_roles(value, self.kind)
        if roles is None:
            return
        for b in self.first.matches(roles[0], bindings.consume(value)):
            yield from self.second.matches(roles[1], b)

    def describe(self) -> str:
        return f"einsum {self.kind}"


def _is_key_dim(dim: Any) -> bool:  # dim -2 of a [B, H, K, V] state
    return dim in (-2, 2, (-2,), (2,), [-2], [2])


def readout(state: Pattern, vec: Pattern) -> Pattern:
    """``S^T x`` over the key dim of the state: ``(S * x[..., None]).sum(-2)``,
    ``einsum("bhk,bhkv->bhv", x, S)`` or ``(x[..., None, :] @ S).squeeze(-2)``."""
    return OneOf(
        Call(SUM, dim=Const(where=_is_key_dim), keepdim=False,
             input=Call(MUL, commutative=True, input=state, other=UnitDim(vec, -1))),
        Einsum("readout", vec, state),
        Call(SQUEEZE, dim=Const(where=_is_key_dim), input=Call(MATMUL, input=UnitDim(vec, -2), other=state)),
    )


def outer(k_side: Pattern, v_side: Pattern) -> Pattern:
    """``a b^T``: ``a[..., None] * b[..., None, :]`` or ``einsum("bhk,bhv->bhkv", a, b)``."""
    return OneOf(Call(MUL, commutative=True, input=UnitDim(k_side, -1), other=UnitDim(v_side, -2)),
                 Einsum("outer", k_side, v_side))


DECAY = OneOf(Call(EXP, input=UnitDim(Token("g"), -1)), UnitDim(Call(EXP, input=Token("g")), -1))
DECAYED = Call(MUL, commutative=True, name="decayed", input=Capture("prev"), other=DECAY)
BETA = UnitDim(Token("beta"), -1)
RESIDUAL = Call(SUB, input=Token("v"), other=readout(Capture("decayed"), Token("k")))
UPDATE = OneOf(
    outer(Token("k"), Call(MUL, commutative=True, input=RESIDUAL, other=BETA)),  # k (x) beta (v - S^T k)
    outer(Call(MUL, commutative=True, input=BETA, other=Token("k")), RESIDUAL),  # (beta k) (x) (v - S^T k)
)
STEP = OneOf(Call(ADD, commutative=True, input=DECAYED, other=UPDATE), Call(IADD, input=DECAYED, other=UPDATE))
OUTPUT = readout(Capture("state"), Token("q"))
ROLES = ("q", "k", "v", "g", "beta")


# ----------------------------------------------------------------------------------------------
# A matched step
# ----------------------------------------------------------------------------------------------
@dataclass
class Step:
    """One matched token update ``prev -> new`` (bindings of STEP) and its output ``out = new^T q_t``
    (bindings of OUTPUT), once found."""

    new: torch.fx.Node
    update: Bindings
    out: torch.fx.Node | None = None
    readout: Bindings = field(default_factory=Bindings)

    @property
    def prev(self) -> torch.fx.Node:
        return self.update["prev"]

    @property
    def token(self) -> int:
        return self.update["k"].index

    def ref(self, role: str) -> TokenSlice:
        return self.readout["q"] if role == "q" else self.update[role]

    @property
    def nodes(self) -> set[torch.fx.Node]:
        return set(self.update.nodes) | set(self.readout.nodes)


def per_token_shape(ref: TokenSlice) -> list:
    return [n for d, n in enumerate(tensor_of(ref.source).shape) if d != ref.dim]


def match_step(node: torch.fx.Node) -> Step | None:
    """The token update ending at ``node``, with shapes checked: state [B, H, K, V], k and g
    [B, H, K], v [B, H, V], beta [B, H] (so every product broadcasts the way the recurrence means)."""
    for b in STEP.matches(node, Bindings()):
        s = tensor_of(b["prev"])
        if s is None or s.dim() != 4:
            continue
        bsz, h, kd, vd = s.shape
        want = {"k": (bsz, h, kd), "g": (bsz, h, kd), "v": (bsz, h, vd), "beta": (bsz, h)}
        if all(known_shape_equal(per_token_shape(b[r]), shape) for r, shape in want.items()) and all(
                known_shape_equal(tensor_of(n).shape, s.shape) for n in (b["decayed"], node)):
            return Step(node, b)
    return None


def find_output(step: Step) -> bool:
    """Find ``o_t = S_new^T q_t`` among the readers of the new state (one or two nodes away)."""
    near = list(step.new.users)
    near += [u for user in near for u in user.users]
    k_shape, v_shape = per_token_shape(step.update["k"]), per_token_shape(step.update["v"])
    for node in near:
        for b in OUTPUT.matches(node, Bindings({"state": step.new})):
            if known_shape_equal(per_token_shape(b["q"]), k_shape) and known_shape_equal(tensor_of(node).shape,
                                                                                          v_shape):
                step.out, step.readout = node, b
                return True
    return False


