"""A small toolkit to describe Dynamo FX graph patterns as data and match them.

The Dynamo graph is torch-level and not normalised: the same model code may appear as
``torch.matmul(a, b)``, ``a @ b`` or ``a.matmul(b)``, with positional or keyword arguments. This
module hides that behind three ideas, so a rewrite reads like the model code it matches:

- :class:`OpFamily`: every spelling of one operation (functions, Tensor methods), each bound to
  the same canonical parameter names. ``MATMUL.bind(node)`` gives ``{"input": a, "other": b}``
  whichever spelling the graph used.
- Patterns: :class:`Call` (a node of a family, with patterns for its parameters),
  :class:`Capture` (bind a value to a name; a name bound twice must hold the same value),
  :class:`Const` (a Python number), :class:`OneOf` (alternatives), :class:`Seq` (a list).
  ``Capture(LINK)`` marks where a chain continues. Matching is a generator of
  :class:`Bindings`, so alternatives backtrack.
- Chains: :func:`match_upward` walks from a node towards its inputs through a list of optional
  :class:`Stage` s and ends on an anchor pattern (e.g. softmax input -> mask -> scale -> q @ k^T);
  :func:`match_downward` walks through single-user nodes to an anchor (softmax -> casts ->
  dropout -> p @ v). A failed walk says where it stopped and what was expected there.

Example (the scale stage of eager attention, ``scores * scaling`` or ``scores / divisor``)::

    Stage("scale", OneOf(Call(MUL, input=Capture(LINK), other=Const("scale"), commutative=True),
                         Call(DIV, input=Capture(LINK), other=Const("divisor"))))
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.fx

from kda_compile.passes.toolkit.graph_tools import (example_value, is_real_number, is_tensor_node, known_shape_equal,
                                                    same_value, tensor_of)

LINK = "__link__"  # capture name marking where a chain continues (or came from)


# ----------------------------------------------------------------------------------------------
# Op families: every spelling of one operation, bound to canonical parameter names.
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpFamily:
    """All call spellings of one operation.

    ``signatures`` maps a ``call_function`` target (a callable) or a ``call_method`` name (a str)
    to its parameter names in positional order; for methods the first parameter is the tensor
    itself. A trailing ``"*name"`` collects the remaining positional arguments into a tuple (and
    unwraps a single tuple/list argument, so ``x.view(a, b)`` and ``x.view((a, b))`` agree).
    ``defaults`` fills parameters the call left out (and names the keyword-only parameters a call
    may pass); a keyword outside the parameters and defaults means "not this operation", so
    ``torch.add(a, b, alpha=2)`` is not an ADD. ``aliases`` renames keywords onto canonical names.
    """

    name: str
    signatures: Mapping[Any, tuple[str, ...]]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)

    def signature(self, node: torch.fx.Node) -> tuple[str, ...] | None:
        if node.op == "call_function" and not isinstance(node.target, str):
            try:
                return self.signatures.get(node.target)
            except TypeError:  # unhashable target
                return None
        if node.op == "call_method":
            return self.signatures.get(node.target)
        return None

    def bind(self, node: Any) -> dict[str, Any] | None:
        """The node's arguments by canonical name, or None if it is not a call of this family."""
        if not isinstance(node, torch.fx.Node):
            return None
        params = self.signature(node)
        if params is None:
            return None
        bound: dict[str, Any] = {}
        args = list(node.args)
        for i, name in enumerate(params):
            if name.startswith("*"):
                rest = args[i:]
                if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
                    rest = list(rest[0])
                bound[name[1:]] = tuple(rest)
                args = []
                break
            if i < len(args):
                bound[name] = args[i]
        if len(args) > len(params):
            return None
        plain = {p.lstrip("*") for p in params} | set(self.defaults)
        for key, value in node.kwargs.items():
            key = self.aliases.get(key, key)
            if key not in plain:
                return None
            bound[key] = value
        for key, value in self.defaults.items():
            bound.setdefault(key, value)
        if any(p.lstrip("*") not in bound for p in params):
            return None
        return bound

    def __repr__(self) -> str:
        return self.name


def family(name: str, params: Sequence[str], *, functions=(), methods=(), defaults=None, aliases=None,
           signatures=None) -> OpFamily:
    """Build an :class:`OpFamily` whose functions and methods share one parameter list
    (``signatures`` adds targets with a parameter list of their own)."""
    sigs: dict[Any, tuple[str, ...]] = {f: tuple(params) for f in functions}
    sigs.update({m: tuple(params) for m in methods})
    sigs.update({t: tuple(p) for t, p in (signatures or {}).items()})
    return OpFamily(name, sigs, dict(defaults or {}), dict(aliases or {}))


F = torch.nn.functional
MATMUL = family("matmul", ("input", "other"), functions=(torch.matmul, operator.matmul),
                methods=("matmul", "__matmul__"))
MUL = family("mul", ("input", "other"), functions=(operator.mul, torch.mul), methods=("mul", "__mul__"))
DIV = family("div", ("input", "other"), functions=(operator.truediv, torch.div, torch.true_divide),
             methods=("div", "__truediv__", "true_divide"))
ADD = family("add", ("input", "other"), functions=(operator.add, torch.add), methods=("add", "__add__"))
SUB = family("sub", ("input", "other"), functions=(operator.sub, torch.sub), methods=("sub", "__sub__"))
TANH = family("tanh", ("input",), functions=(torch.tanh,), methods=("tanh",))
TRANSPOSE = family("transpose", ("input", "dim0", "dim1"), functions=(torch.transpose,),
                   methods=("transpose",))
GETITEM = family("getitem", ("input", "index"), functions=(operator.getitem,))
CAT = family("cat", ("tensors", "dim"), functions=(torch.cat, torch.concat, torch.concatenate),
             defaults={"dim": 0})
MAX = family("max", ("input", "dim", "keepdim"), functions=(torch.max,), methods=("max",),
             defaults={"keepdim": False})
EXPAND = family("expand", ("input", "*sizes"), methods=("expand",))
RESHAPE = family("reshape", ("input", "*shape"), methods=("reshape", "view"),
                 signatures={torch.reshape: ("input", "shape")})
REPEAT_INTERLEAVE = family("repeat_interleave", ("input", "repeats", "dim"),
                           functions=(torch.repeat_interleave,), methods=("repeat_interleave",),
                           defaults={"dim": None, "output_size": None})
SOFTMAX = OpFamily("softmax", {
    F.softmax: ("input", "dim", "_stacklevel", "dtype"),
    torch.softmax: ("input", "dim", "dtype"),
    "softmax": ("input", "dim", "dtype"),
}, defaults={"dim": None, "dtype": None, "_stacklevel": 3})
DROPOUT = OpFamily("dropout", {
    F.dropout: ("input", "p", "training", "inplace"),
    torch.dropout: ("input", "p", "training"),
}, defaults={"p": 0.5, "training": True, "inplace": False}, aliases={"train": "training"})
SDPA = family("scaled_dot_product_attention", ("query", "key", "value", "attn_mask", "dropout_p", "is_causal",
                                               "scale"),
              functions={F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention},
              defaults={"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False})
# Casts that only change the dtype: x.to(dtype), x.type(dtype), x.float(), x.type_as(y), ...
CAST = OpFamily("cast", {
    "to": ("input", "*args"), "type": ("input", "*args"),
    "float": ("input",), "half": ("input",), "bfloat16": ("input",), "double": ("input",),
    "type_as": ("input", "other"),
}, defaults={"dtype": None, "non_blocking": False, "copy": False, "memory_format": None})


def cast_dtype(node: torch.fx.Node) -> torch.dtype | None:
    """The dtype a pure cast node converts to, or None if the node is not a pure cast.

    ``x.to(device)``, ``x.to(other_tensor)`` and casts that copy or change the memory format are
    not pure casts.
    """
    bound = CAST.bind(node)
    if bound is None:
        return None
    fixed = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}
    if node.target in fixed:
        return fixed[node.target]
    if node.target == "type_as":
        other = example_value(bound["other"])
        return other.dtype if isinstance(other, torch.Tensor) else None
    if bound["copy"] or bound["memory_format"] is not None:
        return None
    positional = bound.get("args", ())
    dtype = bound["dtype"]
    if len(positional) == 1 and isinstance(positional[0], torch.dtype) and dtype is None:
        dtype = positional[0]
    elif positional:
        return None
    return dtype if isinstance(dtype, torch.dtype) else None


# ----------------------------------------------------------------------------------------------
# Patterns
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bindings:
    """Captured values by name, plus the call nodes a match consumed (in match order)."""

    values: Mapping[str, Any] = field(default_factory=dict)
    nodes: tuple[torch.fx.Node, ...] = ()

    def bind(self, name: str, value: Any) -> "Bindings | None":
        if name in self.values:
            return self if same_value(self.values[name], value) else None
        return Bindings({**self.values, name: value}, self.nodes)

    def consume(self, node: torch.fx.Node) -> "Bindings":
        return Bindings(self.values, self.nodes + (node,))

    def without(self, name: str) -> "Bindings":
        return Bindings({k: v for k, v in self.values.items() if k != name}, self.nodes)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)


class Pattern:
    def matches(self, value: Any, bindings: Bindings) -> Iterator[Bindings]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class Capture(Pattern):
    """Any value (a node or a constant) satisfying ``where``; bound to ``name``."""

    name: str
    where: Callable[[Any], bool] | None = None

    def matches(self, value, bindings):
        if self.where is not None and not self.where(value):
            return
        bound = bindings.bind(self.name, value)
        if bound is not None:
            yield bound

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class Const(Pattern):
    """A Python constant satisfying ``where`` (default: a real number). With ``symbolic``, also a
    node holding a SymFloat / SymInt (a float attribute Dynamo left unspecialised under
    ``dynamic=True``); ``where`` then applies only to plain constants, and the user turns the node
    into a number with :func:`~kda_compile.passes.toolkit.graph_tools.concrete_number` (which guards on it)."""

    name: str | None = None
    where: Callable[[Any], bool] | None = None
    symbolic: bool = False

    def matches(self, value, bindings):
        if isinstance(value, torch.fx.Node):
            if not (self.symbolic and isinstance(example_value(value), (torch.SymFloat, torch.SymInt))):
                return
        elif not (self.where or is_real_number)(value):
            return
        if self.name is None:
            yield bindings
            return
        bound = bindings.bind(self.name, value)
        if bound is not None:
            yield bound

    def describe(self) -> str:
        return f"constant {self.name or ''}".strip()


@dataclass(frozen=True)
class Call(Pattern):
    """A call node of ``family`` whose canonical arguments match ``args``.

    Arguments not named in ``args`` are not checked. ``commutative`` also tries the two
    operands swapped. The node is recorded in :attr:`Bindings.nodes` unless ``look_through``
    (nodes a rewrite reads past but does not replace, such as a transpose of the keys).
    """

    family: OpFamily
    args: Mapping[str, Any] = field(default_factory=dict)
    commutative: bool = False
    look_through: bool = False
    where: Callable[[torch.fx.Node], bool] | None = None
    name: str | None = None

    def __init__(self, family: OpFamily, *, commutative=False, look_through=False, where=None, name=None,
                 **args):
        object.__setattr__(self, "family", family)
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "commutative", commutative)
        object.__setattr__(self, "look_through", look_through)
        object.__setattr__(self, "where", where)
        object.__setattr__(self, "name", name)

    def matches(self, value, bindings):
        bound = self.family.bind(value)
        if bound is None or (self.where is not None and not self.where(value)):
            return
        orders = [bound]
        if self.commutative:
            orders.append({**bound, "input": bound["other"], "other": bound["input"]})
        for args in orders:
            start = bindings if self.name is None else bindings.bind(self.name, value)
            if start is None:
                continue
            if not self.look_through:
                start = start.consume(value)
            yield from _match_args(list(self.args.items()), args, start)

    def describe(self) -> str:
        inner = ", ".join(f"{k}={_describe(v)}" for k, v in self.args.items())
        return f"{self.family.name}({inner})"


@dataclass(frozen=True)
class Seq(Pattern):
    """A list or tuple whose items match ``items`` one to one."""

    items: tuple[Any, ...]

    def __init__(self, *items: Any):
        object.__setattr__(self, "items", tuple(items))

    def matches(self, value, bindings):
        if isinstance(value, (list, tuple)) and len(value) == len(self.items):
            yield from _match_args(list(enumerate(self.items)), dict(enumerate(value)), bindings)

    def describe(self) -> str:
        return "[" + ", ".join(_describe(i) for i in self.items) + "]"


def _match_args(items, args, bindings):
    if not items:
        yield bindings
        return
    (key, pattern), rest = items[0], items[1:]
    value = args.get(key)
    if isinstance(pattern, Pattern):
        for b in pattern.matches(value, bindings):
            yield from _match_args(rest, args, b)
    elif same_value(pattern, value):
        yield from _match_args(rest, args, bindings)


def _describe(pattern: Any) -> str:
    return pattern.describe() if isinstance(pattern, Pattern) else repr(pattern)


@dataclass(frozen=True)
class OneOf(Pattern):
    """The first alternatives first; every alternative is tried on backtracking."""

    alternatives: tuple[Pattern, ...]

    def __init__(self, *alternatives: Pattern):
        object.__setattr__(self, "alternatives", tuple(alternatives))

    def matches(self, value, bindings):
        for alternative in self.alternatives:
            yield from alternative.matches(value, bindings)

    def describe(self) -> str:
        return " or ".join(a.describe() for a in self.alternatives)


# ----------------------------------------------------------------------------------------------
# Chains
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stage:
    """One optional step of a chain. ``pattern`` holds a :data:`LINK` capture: towards the inputs
    (upward) it marks the node the chain continues from; towards the users (downward) it must be
    the previous node. ``repeat`` stages may match several times in a row (they must not capture
    names other than LINK, since a name bound twice must hold one value)."""

    name: str
    pattern: Pattern
    repeat: bool = False


@dataclass
class ChainMatch:
    """The result of a chain walk: ``bindings`` on success, else where and why it stopped."""

    bindings: Bindings | None
    stages: tuple[str, ...] = ()
    stopped_at: Any = None
    expected: str = ""
    other_users: tuple[torch.fx.Node, ...] = ()  # downward: the users beyond the one expected

    def __bool__(self) -> bool:
        return self.bindings is not None


def match_upward(start: torch.fx.Node, stages: Sequence[Stage], anchor: Pattern,
                 bindings: Bindings | None = None) -> ChainMatch:
    """Walk from ``start`` towards its inputs through optional ``stages`` (in order), ending with
    ``anchor`` matched on the node reached. The first complete match wins."""
    failure = ChainMatch(None, stopped_at=start, expected=anchor.describe())
    depth = [-1]

    def walk(i, node, b, taken):
        if i == len(stages):
            found = False
            for result in anchor.matches(node, b):
                found = True
                yield result, taken
            if not found and len(taken) > depth[0]:
                depth[0] = len(taken)
                failure.stopped_at, failure.stages = node, taken
            return
        stage = stages[i]
        for result in stage.pattern.matches(node, b.without(LINK)):
            nxt = result[LINK]
            step = taken + (stage.name,)
            if stage.repeat:
                yield from walk(i, nxt, result.without(LINK), step)
            yield from walk(i + 1, nxt, result.without(LINK), step)
        yield from walk(i + 1, node, b, taken)

    for result, taken in walk(0, start, bindings or Bindings(), ()):
        return ChainMatch(result, taken)
    return failure


def match_downward(start: torch.fx.Node, stages: Sequence[Stage], anchor: Pattern,
                   bindings: Bindings | None = None) -> ChainMatch:
    """Walk from ``start`` through its users: each node on the way must have exactly one user,
    matched by the next stage or by ``anchor`` (with LINK bound to the previous node)."""
    failure = ChainMatch(None, stopped_at=start, expected=anchor.describe())
    depth = [-1]

    def walk(i, node, b, taken):
        users = list(node.users)
        if len(users) != 1:
            if len(taken) > depth[0]:
                depth[0] = len(taken)
                failure.stopped_at, failure.stages, failure.other_users = node, taken, tuple(users)
                failure.expected = f"a single user (found {len(users)}: {', '.join(u.name for u in users)})"
            return
        user = users[0]
        linked = b.without(LINK).bind(LINK, node)
        found = False
        for result in anchor.matches(user, linked):
            found = True
            yield result.without(LINK), taken
        for j in range(i, len(stages)):
            for result in stages[j].pattern.matches(user, linked):
                found = True
                yield from walk(j if stages[j].repeat else j + 1, user, result.without(LINK),
                                taken + (stages[j].name,))
        if not found and len(taken) > depth[0]:
            depth[0] = len(taken)
            failure.stopped_at, failure.stages, failure.other_users = user, taken, ()
            failure.expected = anchor.describe()

    for result, taken in walk(0, start, bindings or Bindings(), ()):
        return ChainMatch(result, taken)
    return failure


# ----------------------------------------------------------------------------------------------
# Shared attention patterns
# ----------------------------------------------------------------------------------------------
# repeat_kv(x, n): x[:, :, None].expand(B, Hkv, n, S, D).reshape(B, Hkv * n, S, D), or repeat_interleave.
REPEATED_KV = OneOf(
    Call(RESHAPE, look_through=True, input=Call(EXPAND, look_through=True, name="groups", input=Call(
        GETITEM, look_through=True, input=Capture("kv", is_tensor_node),
        index=Const(where=lambda i: i == (slice(None),) * 2 + (None,) + (slice(None),) * 2)))),
    Call(REPEAT_INTERLEAVE, look_through=True, input=Capture("kv", is_tensor_node), dim=1,
         repeats=Const("repeats", where=lambda r: isinstance(r, int))),
)


def unrepeat_kv(node: torch.fx.Node) -> torch.fx.Node:
    """The [B, Hkv, S, D] tensor that ``repeat_kv`` expanded into ``node`` (head h reads kv head
    h // n_rep), or ``node`` itself."""
    for b in REPEATED_KV.matches(node, Bindings()):
        kv, rep = tensor_of(b["kv"]), tensor_of(node)
        if kv is None or rep is None or kv.dim() != 4 or rep.dim() != 4:
            continue
        bsz, hkv, s, d = kv.shape
        if "groups" in b.values:  # x[:, :, None].expand(B, Hkv, n, S, D).reshape(B, Hkv * n, S, D)
            groups = tensor_of(b["groups"]).shape
            n_rep = groups[2]
            ok = known_shape_equal(groups, (bsz, hkv, n_rep, s, d))
        else:
            n_rep, ok = b["repeats"], True
        if ok and known_shape_equal(rep.shape, (bsz, hkv * n_rep, s, d)):
            return b["kv"]
    return node
