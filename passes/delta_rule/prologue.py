"""Fold the gate, the beta sigmoid and the q/k L2 norm computed right before a KDA op into the op's
in-kernel options, so the op receives the raw projections (what a fused prologue kernel needs).

Matches, on the inputs of a KDA op call, the code of Hugging Face's ``KimiLinearForgetGate`` and
``KimiLinearDeltaAttention`` (models/kimi_linear/modeling_kimi_linear.py, transformers 5.17 to
5.23) and of FLA's ``naive_kda_gate`` / ``naive_kda_lowerbound_gate`` (fla/ops/kda/gate.py)::

    x = (f.float() + dt_bias.float().view(1, 1, -1)).view(B, T, -1, K)  # or f + dt_bias.view(H, K), or f
    g = -A_log.float().exp() * torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))  # or F.softplus(x)
    g = lower_bound * torch.sigmoid(A_log.exp() * x)                     # lower-bound gate (A_log optional)
    beta = torch.sigmoid(b)                                               # or 2 * sigmoid(b): allow_neg_eigval
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)              # same for k; or q * rsqrt(...)
    o, S = chunk_kda(q, k, v, g, beta, ...)                               # or fused_recurrent_kda

and replaces the call with::

    o, S = chunk_kda(q_raw, k_raw, v, f, b, ..., use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                     lower_bound=lower_bound, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)

The same for the gated delta rule (GDN: ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``),
as Hugging Face's Qwen3-Next family writes it (models/qwen3_next/modeling_qwen3_next.py, 5.23)::

    beta = b.sigmoid()                                                    # 2 * sigmoid(b) in olmo_hybrid
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # one decay per value head
    o, S = chunk_gated_delta_rule(q, k, v, g, beta, ...)                  # the GDN ops (kda_substitution)

becomes ``chunk_gated_delta_rule(q, k, v, a, b, ..., use_gate_in_kernel=True, A_log=A_log,
dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)``: ``A_log`` and ``dt_bias`` per value head ``[HV]``;
the lower-bound gate is KDA's only (left alone on a GDN call).

A KDA call is either a call of the public function (inserted by ``kda_recurrence``) or, where
Dynamo traced our public API (trace-time substitution, user code), a
``torch.ops.kda_compile.chunk_kda_fwd`` / ``fused_recurrent_kda_fwd`` node read through getitems; the
latter becomes a call of the public function with the same arguments (its ``(o, final_state)``
outputs keep their getitem readers). Each part folds on its own. Upcasts to float32 of the raw
gate projection and of the beta logits are dropped (the op computes both in float32 itself);
casts between the gate and the op are read through.

Left alone, and reported per part: a gate, beta or normalised q/k used elsewhere too, a gate
whose decay rate is not per head or whose softplus threshold is not 20, an L2 norm with another
eps or over another dim, ``F.normalize`` (it divides by ``max(||x||, eps)``, not by
``sqrt(||x||^2 + 1e-6)``), only one of q/k normalised, arguments the op refuses.
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx
import torch.nn.functional as F

from kda_compile.ops import chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule, fused_recurrent_kda
from kda_compile.passes.delta_rule.step import EXP, SUM
from kda_compile.passes.report import LeftAlone, Rewritten
from kda_compile.passes.rewrite import GraphRewrite, RewriteLog
from kda_compile.passes.toolkit.graph_tools import (concrete_number, describe_node, erase_unused, insert_call,
                                                    known_equal, known_shape_equal, module_path, source_line,
                                                    static_int, tensor_of)
from kda_compile.passes.toolkit.matching import (ADD, CAST, DIV, MUL, RESHAPE, Bindings, Call, Capture, Const, OneOf,
                                                 OpFamily, cast_dtype, family)

logger = logging.getLogger("kda_compile.passes.kda_prologue")

L2NORM_EPS = 1e-6  # the op's in-kernel L2 norm: x / sqrt(sum(x^2) + 1e-6)
SOFTPLUS_THRESHOLD = 20.0  # the op's softplus (F.softplus's default): x itself above it

# Op families beyond toolkit/matching.py and delta_rule/step.py (candidates to move to toolkit/matching.py)
LOG = family("log", ("input",), functions=(torch.log,), methods=("log",))
LOG1P = family("log1p", ("input",), functions=(torch.log1p,), methods=("log1p",))
NEG = family("neg", ("input",), functions=(operator.neg, torch.neg), methods=("neg", "__neg__"))
SIGMOID = family("sigmoid", ("input",), functions=(torch.sigmoid, F.sigmoid), methods=("sigmoid",))
SQRT = family("sqrt", ("input",), functions=(torch.sqrt,), methods=("sqrt",))
RSQRT = family("rsqrt", ("input",), functions=(torch.rsqrt,), methods=("rsqrt",))
SQUARE = family("square", ("input",), functions=(torch.square,), methods=("square",))
POW = family("pow", ("input", "exponent"), functions=(torch.pow, operator.pow), methods=("pow", "__pow__"))
GT = family("gt", ("input", "other"), functions=(operator.gt, torch.gt), methods=("gt", "__gt__"))
WHERE = family("where", ("condition", "input", "other"), functions=(torch.where,))
SOFTPLUS = family("softplus", ("input", "beta", "threshold"), functions=(F.softplus, torch._C._nn.softplus),
                  defaults={"beta": 1.0, "threshold": 20.0})
NORMALIZE = OpFamily("normalize", {F.normalize: ("input", "p", "dim", "eps")},
                     defaults={"p": 2.0, "dim": 1, "eps": 1e-12, "out": None})


def _equals(value: float) -> Callable[[Any], bool]:
    return lambda c: isinstance(c, (int, float)) and not isinstance(c, bool) and c == value


# ----------------------------------------------------------------------------------------------
# Patterns of the prologue, as the model code writes it
# ----------------------------------------------------------------------------------------------
X = Capture("x")
SOFTPLUS_OF_X = OneOf(
    Call(SOFTPLUS, input=X, beta=Const(where=_equals(1)), threshold=Const("threshold")),
    Call(WHERE, condition=Call(GT, input=X, other=Const("threshold")), input=X, other=OneOf(
        Call(LOG, input=Call(ADD, commutative=True, input=Const(where=_equals(1)), other=Call(EXP, input=X))),
        Call(LOG1P, input=Call(EXP, input=X)))),
)
RATE = Call(EXP, input=Capture("A_log"))  # exp(A_log): per-head decay rate
SOFTPLUS_GATE = OneOf(  # -exp(A_log) * softplus(x)
    Call(MUL, commutative=True, input=Call(NEG, input=RATE), other=SOFTPLUS_OF_X),
    Call(NEG, input=Call(MUL, commutative=True, input=RATE, other=SOFTPLUS_OF_X)),
)
LOWER_BOUND_GATE = Call(  # lower_bound * sigmoid(exp(A_log) * x), or lower_bound * sigmoid(x)
    MUL, commutative=True, input=Const("lower_bound", symbolic=True),
    other=Call(SIGMOID, input=OneOf(Call(MUL, commutative=True, input=RATE, other=X), X)))
BETA = OneOf(Call(SIGMOID, input=Capture("b")),
             Call(MUL, commutative=True, input=Const("two", where=_equals(2)), other=Call(SIGMOID, input=Capture("b"))))
LAST_DIM = Const(where=lambda d: d in (-1, 3, [-1], [3], (-1,), (3,)))
SUM_OF_SQUARES = Call(SUM, dim=LAST_DIM, keepdim=True, input=OneOf(
    Call(MUL, input=X, other=X), Call(POW, input=X, exponent=Const(where=_equals(2))), Call(SQUARE, input=X)))
DENOMINATOR = Call(ADD, commutative=True, input=SUM_OF_SQUARES, other=Const("eps"))
L2NORM = OneOf(Call(DIV, input=X, other=Call(SQRT, input=DENOMINATOR)),
               Call(MUL, commutative=True, input=X, other=Call(RSQRT, input=DENOMINATOR)))


def first_match(pattern, node) -> Bindings | None:
    return next(iter(pattern.matches(node, Bindings())), None)


# ----------------------------------------------------------------------------------------------
# KDA calls in the graph
# ----------------------------------------------------------------------------------------------
PUBLIC = {chunk_kda: chunk_kda, fused_recurrent_kda: fused_recurrent_kda,
          chunk_gated_delta_rule: chunk_gated_delta_rule,
          fused_recurrent_gated_delta_rule: fused_recurrent_gated_delta_rule}
GDN_FUNCTIONS = (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)  # g [B, T, HV]: one decay per head


@functools.cache
def _op_overloads() -> dict:
    ops = torch.ops.kda_compile
    return {ops.chunk_kda_fwd.default: chunk_kda, ops.fused_recurrent_kda_fwd.default: fused_recurrent_kda,
            ops.chunk_gdn_fwd.default: chunk_gated_delta_rule,
            ops.fused_recurrent_gdn_fwd.default: fused_recurrent_gated_delta_rule}


@dataclass
class KDACall:
    """A KDA call: the public function to call and its arguments by name (op nodes are mapped
    onto the public function's parameters, which carry the same names)."""

    node: torch.fx.Node
    fn: Callable
    args: dict[str, Any]
    outputs: dict[int, list[torch.fx.Node]] = field(default_factory=dict)  # op node: getitem readers by index

    @property
    def is_op(self) -> bool:
        return self.node.target not in PUBLIC

    @property
    def is_gdn(self) -> bool:
        return self.fn in GDN_FUNCTIONS


def kda_call(node: torch.fx.Node) -> KDACall | None:
    try:
        known = node.op == "call_function" and (node.target in PUBLIC or node.target in _op_overloads())
    except TypeError:  # an unhashable target
        known = False
    if not known:
        return None
    if node.target in PUBLIC:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
        bound.apply_defaults()
        args = dict(bound.arguments)
        args.update(args.pop("kwargs", {}))
        return KDACall(node, node.target, args)
    fn = _op_overloads()[node.target]
    names = [a.name for a in node.target._schema.arguments]
    values = dict(zip(names, node.args), **node.kwargs)
    params = inspect.signature(fn).parameters
    args = {name: value for name, value in values.items() if name in params}
    outputs: dict[int, list[torch.fx.Node]] = {}
    for user in node.users:
        index = user.args[1] if user.target is operator.getitem and len(user.args) == 2 else None
        outputs.setdefault(index if isinstance(index, int) else -1, []).append(user)
    return KDACall(node, fn, args, outputs)


def output_problem(call: KDACall) -> str | None:
    """Why the op node's outputs cannot be read from the public function's ``(o, final_or_None)``."""
    for index, readers in call.outputs.items():
        used = [r for r in readers if r.users]
        if index == -1:
            return f"the op's result is read by {', '.join(map(describe_node, readers))}, not by getitem"
        if used and (index > 1 or (index == 1 and not call.args["output_final_state"])):
            return f"output {index} of the op (not returned by the public function) is read"
    return None


# ----------------------------------------------------------------------------------------------
# Folding each part
# ----------------------------------------------------------------------------------------------
def _through_casts(node: Any, op_node: torch.fx.Node) -> tuple[Any, list, str | None]:
    """The value an op input was cast from (any casts, each read only by the next), the casts, and
    a reason when some node on the way has another reader."""
    casts, reader = [], op_node
    while True:
        if isinstance(node, torch.fx.Node) and set(node.users) != {reader}:
            others = [u for u in node.users if u is not reader]
            return node, casts, f"{describe_node(node)} is also used by {', '.join(map(describe_node, others))}"
        if CAST.bind(node) is None or cast_dtype(node) is None:
            return node, casts, None
        casts.append(node)
        node, reader = CAST.bind(node)["input"], node


def _not_computed_here(node: Any) -> str | None:
    """``"<node>, a graph input,"`` when ``node`` is a graph input (through casts), else None."""
    base = node
    while CAST.bind(base) is not None:
        base = CAST.bind(base)["input"]
    if isinstance(base, torch.fx.Node) and base.op == "placeholder":
        return f"{describe_node(node)}, a graph input,"
    return None


def _drop_upcast(node: Any) -> Any:
    """``x.float()`` of a half-precision x -> x (the op computes the gate and beta in float32)."""
    bound = CAST.bind(node)
    src = tensor_of(bound["input"]) if bound else None
    if src is not None and cast_dtype(node) == torch.float32 and src.dtype in (torch.float16, torch.bfloat16):
        return bound["input"]
    return node


def _flat(graph, node: torch.fx.Node, at: torch.fx.Node, inserted: list) -> torch.fx.Node:
    """A per-head / per-channel parameter as the 1-D tensor the op takes (views read through)."""
    while RESHAPE.bind(node) is not None:
        node = RESHAPE.bind(node)["input"]
    if tensor_of(node).dim() != 1:
        node = insert_call(graph, at, "reshape", (node, -1), meta_from=at)
        inserted.append(node)
    return node


def split_gate_input(x: torch.fx.Node, graph, at, inserted: list) -> tuple[torch.fx.Node, torch.fx.Node | None]:
    """``x`` = raw projection (+ dt_bias broadcast per channel) -> (raw [B, T, HV, K], dt_bias or None).

    Accepted: ``f + d`` with ``d`` shaped ``[..., HV, K]`` (leading ones), and HF's
    ``(f + d).view(B, T, HV, K)`` with ``f`` ``[B, T, HV * K]`` and ``d`` ``[..., HV * K]``.
    Anything else is the raw projection itself (any bias in it stays in it)."""
    xt = tensor_of(x)
    hv, kd = static_int(xt.shape[-2]), static_int(xt.shape[-1])
    view = RESHAPE.bind(x)
    added = ADD.bind(view["input"] if view is not None else x)
    if added is None or hv is None or kd is None:
        return x, None
    flat = view is not None
    at_shape = tensor_of(view["input"] if flat else x).shape
    if flat and not (len(at_shape) == 3 and known_shape_equal(at_shape[:2], xt.shape[:2])
                     and known_equal(at_shape[2], hv * kd)):
        return x, None
    for f, d in ((added["input"], added["other"]), (added["other"], added["input"])):
        ft, dt = tensor_of(f), tensor_of(d)
        if ft is None or dt is None or not known_shape_equal(ft.shape, at_shape):
            continue
        trailing = [hv * kd] if flat else [hv, kd]
        core = list(dt.shape)
        while core and static_int(core[0]) == 1 and len(core) > len(trailing):
            core = core[1:]
        if [static_int(n) for n in core] == trailing:
            raw = _drop_upcast(f)
            if flat:
                raw = insert_call(graph, at, "unflatten", (raw, -1, (hv, kd)), meta_from=at)
                inserted.append(raw)
            return raw, _flat(graph, d, at, inserted)
    return x, None


def split_gdn_gate_input(x: torch.fx.Node, graph, at, inserted: list) -> tuple[torch.fx.Node, torch.fx.Node | None]:
    """GDN: ``x`` = raw gate (+ dt_bias ``[HV]``, leading ones allowed) -> (raw [B, T, HV], dt_bias or None)."""
    xt, added = tensor_of(x), ADD.bind(x)
    if added is None:
        return x, None
    for f, d in ((added["input"], added["other"]), (added["other"], added["input"])):
        ft, dt = tensor_of(f), tensor_of(d)
        if ft is None or dt is None or not known_shape_equal(ft.shape, xt.shape):
            continue
        core = list(dt.shape)
        while len(core) > 1 and static_int(core[0]) == 1:
            core = core[1:]
        if len(core) == 1 and known_equal(core[0], xt.shape[-1]):
            return _drop_upcast(f), _flat(graph, d, at, inserted)
    return x, None


def per_value_head(a_log: torch.fx.Node, g_shape) -> bool:
    """GDN: exp(A_log) broadcast against g [B, T, HV] is one rate per value head: A_log is [..., HV]."""
    shape = list(tensor_of(a_log).shape)
    return 1 <= len(shape) <= 3 and all(static_int(n) == 1 for n in shape[:-1]) and known_equal(shape[-1], g_shape[-1])


def per_head(a_log: torch.fx.Node, g_shape) -> bool:
    """exp(A_log) broadcast against g [B, T, HV, K] scales whole heads: A_log is [..., HV, 1]."""
    shape = list(tensor_of(a_log).shape)
    if len(shape) < 2 or len(shape) > 4 or any(static_int(n) != 1 for n in shape[:-2]):
        return False
    return known_equal(shape[-2], g_shape[-2]) and static_int(shape[-1]) == 1


@dataclass
class Fold:
    """What folding found: new op arguments, the nodes the op no longer reads, report entries."""

    args: dict[str, Any] = field(default_factory=dict)
    replaced: list[torch.fx.Node] = field(default_factory=list)
    folded: dict[str, str] = field(default_factory=dict)
    kept: list[str] = field(default_factory=list)
    inserted: list[torch.fx.Node] = field(default_factory=list)


def fold_gate(call: KDACall, graph, fold: Fold) -> None:
    node, casts, busy = _through_casts(call.args["g"], call.node)
    gate = first_match(SOFTPLUS_GATE, node) or first_match(LOWER_BOUND_GATE, node)
    if gate is None:
        fold.kept.append(f"g: {_not_computed_here(node) or describe_node(node)} is not a recognised gate "
                         f"(softplus or lower-bound form)")
        return
    if busy:
        fold.kept.append(f"g: {busy}")
        return
    g_shape, x = tensor_of(node).shape, gate["x"]
    if not known_shape_equal(tensor_of(x).shape, g_shape):
        fold.kept.append(f"g: the gate input {describe_node(x)} is broadcast to g's shape {list(g_shape)}")
        return
    if "threshold" in gate.values and gate["threshold"] != SOFTPLUS_THRESHOLD:
        fold.kept.append(f"g: softplus threshold {gate['threshold']} differs from the kernel's {SOFTPLUS_THRESHOLD}")
        return
    a_log = gate.get("A_log")
    lower_bound = float(concrete_number(gate["lower_bound"])) if "lower_bound" in gate.values else None
    if call.is_gdn:
        if lower_bound is not None or a_log is None:
            fold.kept.append("g: the lower-bound gate is KDA's; the GDN op's in-kernel gate is the softplus form")
            return
        if not per_value_head(a_log, g_shape):
            fold.kept.append(f"g: exp(A_log) of shape {list(tensor_of(a_log).shape)} is not per value head "
                             f"(expected [HV])")
            return
        raw, dt_bias = split_gdn_gate_input(x, graph, call.node, fold.inserted)
        fold.args.update(g=raw, use_gate_in_kernel=True, dt_bias=dt_bias,
                         A_log=_flat(graph, a_log, call.node, fold.inserted))
        fold.replaced += [node, *casts]
        fold.folded["gate"] = "softplus" + (" + dt_bias" if dt_bias is not None else "") + \
            (" (through casts)" if casts else "")
        return
    if a_log is not None and not per_head(a_log, g_shape):
        fold.kept.append(f"g: exp(A_log) of shape {list(tensor_of(a_log).shape)} is not per head (expected [HV, 1])")
        return
    if lower_bound is not None and not lower_bound < 0:
        fold.kept.append(f"g: lower bound {lower_bound} is not negative")
        return
    raw, dt_bias = split_gate_input(x, graph, call.node, fold.inserted)
    fold.args.update(g=raw, use_gate_in_kernel=True, lower_bound=lower_bound, dt_bias=dt_bias,
                     A_log=_flat(graph, a_log, call.node, fold.inserted) if a_log is not None else None)
    fold.replaced += [node, *casts]
    form = "softplus" if lower_bound is None else f"lower_bound={lower_bound}"
    fold.folded["gate"] = form + (" + dt_bias" if dt_bias is not None else "") + (" (through casts)" if casts else "")


def fold_beta(call: KDACall, fold: Fold) -> None:
    node, casts, busy = _through_casts(call.args["beta"], call.node)
    beta = first_match(BETA, node)
    if beta is None:
        fold.kept.append(f"beta: {_not_computed_here(node) or describe_node(node)} is not sigmoid(b)")
        return
    if busy:
        fold.kept.append(f"beta: {busy}")
        return
    neg = "two" in beta.values
    fold.args.update(beta=_drop_upcast(beta["b"]), use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg)
    fold.replaced += [node, *casts]
    fold.folded["beta"] = "2 * sigmoid" if neg else "sigmoid"


def _l2norm_input(node: Any, call: KDACall) -> tuple[Any, str | None]:
    if NORMALIZE.bind(node) is not None:
        return None, (f"{describe_node(node)} is F.normalize, which divides by max(||x||, eps); the kernel divides "
                      f"by sqrt(||x||^2 + {L2NORM_EPS})")
    norm = first_match(L2NORM, node)
    if norm is None:
        return None, f"{describe_node(node)} is not an L2 norm over the last dim"
    if not math.isclose(float(norm["eps"]), L2NORM_EPS, rel_tol=1e-9):
        return None, f"the L2 norm's eps {norm['eps']} differs from the kernel's {L2NORM_EPS}"
    if set(node.users) != {call.node}:
        others = [u for u in node.users if u is not call.node]
        return None, f"{describe_node(node)} is also used by {', '.join(map(describe_node, others))}"
    return norm["x"], None


def fold_l2norm(call: KDACall, fold: Fold) -> None:
    q, k = call.args["q"], call.args["k"]
    (q_raw, q_why), (k_raw, k_why) = _l2norm_input(q, call), _l2norm_input(k, call)
    if q_why or k_why:
        if not (q_why and k_why and "not an L2 norm" in q_why and "not an L2 norm" in k_why):
            fold.kept.append(f"q/k L2 norm: q: {q_why or 'foldable'}; k: {k_why or 'foldable'} (both must fold)")
        return
    fold.args.update(q=q_raw, k=k_raw, use_qk_l2norm_in_kernel=True)
    fold.replaced += [q, k]
    fold.folded["qk_l2norm"] = "q and k"


# ----------------------------------------------------------------------------------------------
# The rewrite
# ----------------------------------------------------------------------------------------------
class KDAPrologueRewrite(GraphRewrite):
    """Fold the gate, beta sigmoid and q/k L2 norm feeding each KDA call into its options."""

    name = "kda_prologue"

    def apply(self, gm: torch.fx.GraphModule, log: RewriteLog) -> int:
        graph = gm.graph
        rewritten = 0
        for call in [c for n in graph.nodes if (c := kda_call(n)) is not None]:
            where = (module_path(call.node), source_line(call.node))
            fold = Fold()
            if not call.args["use_gate_in_kernel"]:
                fold_gate(call, graph, fold)
            if not call.args["use_beta_sigmoid_in_kernel"]:
                fold_beta(call, fold)
            if not call.args["use_qk_l2norm_in_kernel"]:
                fold_l2norm(call, fold)
            problem = output_problem(call) if call.is_op and fold.folded else None
            if not fold.folded or problem:
                erase_unused(graph, reversed(fold.inserted))
                if problem or fold.kept:
                    log.left_alone.append(LeftAlone(self.name, *where, problem or "; ".join(fold.kept)))
                continue
            op = f"kda_compile.ops.{call.fn.__name__}"
            try:
                self._replace(graph, call, fold)
            except (TypeError, ValueError) as exc:  # the op's argument checks (nothing was replaced)
                erase_unused(graph, reversed(fold.inserted))
                log.left_alone.append(LeftAlone(self.name, *where, f"{op} refuses the folded arguments: {exc}"))
                continue
            details = dict(fold.folded, **({"not folded": "; ".join(fold.kept)} if fold.kept else {}))
            log.rewritten.append(Rewritten(self.name, *where, op, details))
            rewritten += 1
        return rewritten

    @staticmethod
    def _replace(graph: torch.fx.Graph, call: KDACall, fold: Fold) -> None:
        replace_call(graph, call, dict(call.args, **fold.args), also_unused=fold.replaced)


def replace_call(graph: torch.fx.Graph, call: KDACall, args: dict, also_unused=()) -> torch.fx.Node:
    """Call ``call.fn`` (the public function) with ``args`` in place of ``call``'s node: an op node's ``o`` / final
    state readers read the new call's, then the old node (and ``also_unused``, where nothing reads them) is erased.
    The new call runs on fake inputs first (``insert_call``): when the op's checks raise, the graph is untouched."""
    args = dict(args)
    # (GDN's decode function takes gk / gv before beta: only q, k, v, g go by position)
    names = ("q", "k", "v", "g") if call.is_gdn else ("q", "k", "v", "g", "beta")
    positional = tuple(args.pop(name) for name in names)
    new = insert_call(graph, call.node, call.fn, positional, args, meta_from=call.node)
    gone = [call.node]
    if call.is_op:
        for index, readers in call.outputs.items():
            for reader in readers:
                if index in (0, 1) and reader.users:
                    reader.update_arg(0, new)
                else:
                    gone.append(reader)
    else:
        call.node.replace_all_uses_with(new)
    erase_unused(graph, [*gone, *also_unused])
    return new
