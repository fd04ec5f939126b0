"""Collapse a KDA recurrence written token by token (and unrolled by Dynamo) into one KDA op call.

Matches the delta-rule loop the way FLA's naive reference (fla/ops/kda/naive.py,
``naive_recurrent_kda``), Hugging Face's ``recurrent_kimi_delta_attention`` torch body
(models/kimi_linear/modeling_kimi_linear.py, transformers 5.17 to 5.23) or a user writes it::

    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))       # optional casts
    q = q * scale                                                      # optional (else scale = 1)
    q, k = q.repeat_interleave(G, 2), k.repeat_interleave(G, 2)        # optional (GVA, FLA reference)
    S = torch.zeros(B, H, K, V)            # or new_zeros(...).to(q), zeros + h0, zeros += h0, a given state
    o = torch.zeros(B, T, H, V)            # or a list gathered by torch.stack / torch.cat
    for t in range(T):                     # x[:, t] ([B, T, H, K]) or x[:, :, t] ([B, H, T, K])
        S = S * g[:, t][..., None].exp()
        kv = (S * k[:, t][..., None]).sum(-2)
        S = S + k[:, t][..., None] * ((v[:, t] - kv) * beta[:, t][..., None])[..., None, :]
        o[:, t] = (S * q[:, t][..., None]).sum(-2)
    return o, S

(one step in all its spellings: ``delta_rule/step.py``) and replaces the T unrolled steps with::

    o_, S_T = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=h0_or_None,
                        output_final_state=<S read afterwards>)       # fused_recurrent_kda when T == 1
    o = o_ with the time dim moved where the loop gathered it, in the gather's dtype

The op gets the inputs the loop slices (casts stay in the graph), with the time dim moved to 1;
a number multiplying q before the loop becomes ``scale``; q/k repeated per value head with
``repeat_interleave`` are passed un-repeated (the op's GVA). The state is read only after the
loop's last step, so ``o`` is gathered, the final state used, where the loop did.

Left alone, and reported: steps that do not run over tokens 0..T-1 of the same inputs (a step
that differs ends the chain there), steps spelled differently from step 0, a state or a per-step
value read outside the recurrence, outputs gathered other than by stores into a fresh buffer /
``torch.stack`` / ``torch.cat`` in token order, a buffer read between the stores, inputs modified
in place, arguments the op refuses.
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from kda_compile.ops import chunk_kda, fused_recurrent_kda
from kda_compile.passes.delta_rule.step import (IADD, ROLES, Step, TokenSlice, find_output, match_step,
                                                parse_token_index, unit_dim_source)
from kda_compile.passes.report import LeftAlone, Rewritten
from kda_compile.passes.rewrite import GraphRewrite, RewriteLog
from kda_compile.passes.toolkit.graph_tools import (concrete_number, describe_node, erase_unused, example_value,
                                                    insert_call, is_inplace, known_shape_equal, module_path,
                                                    source_line, static_int, tensor_of)
from kda_compile.passes.toolkit.matching import ADD, CAST, CAT, DIV, MUL, REPEAT_INTERLEAVE, OpFamily, family

logger = logging.getLogger("kda_compile.passes.kda_recurrence")

# Loops of at most this many tokens become fused_recurrent_kda (decode), longer ones chunk_kda.
RECURRENT_MAX_T = 1

STACK = family("stack", ("tensors", "dim"), functions=(torch.stack,), defaults={"dim": 0})
SETITEM = family("setitem", ("input", "index", "value"), functions=(operator.setitem,))
ZEROS = OpFamily("zeros", {torch.zeros: ("*size",), "new_zeros": ("input", "*size"), torch.zeros_like: ("input",)},
                 defaults={"dtype": None, "device": None, "layout": None, "requires_grad": False,
                           "pin_memory": False, "memory_format": None, "out": None})
FRESH_BUFFERS = (torch.zeros, torch.zeros_like, torch.empty, torch.empty_like, "new_zeros", "new_empty")


# ----------------------------------------------------------------------------------------------
# Chains of steps
# ----------------------------------------------------------------------------------------------
def build_chains(steps: list[Step]) -> list[list[Step]]:
    """Link the steps through the state, first token first."""
    by_prev = {step.prev: step for step in steps}
    news = {step.new for step in steps}
    chains = []
    for start in (s for s in steps if s.prev not in news):
        chain = [start]
        while chain[-1].new in by_prev:
            chain.append(by_prev[chain[-1].new])
        chains.append(chain)
    return chains


def _name(node: torch.fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def _names(nodes) -> str:
    return ", ".join(describe_node(n) for n in nodes)


def check_steps(chain: list[Step], position: dict) -> str | None:
    """Why the chain is not one recurrence over tokens 0..T-1 of fixed inputs, or None."""
    first, tokens = chain[0], [step.token for step in chain]
    if tokens != list(range(len(chain))):
        shown = ", ".join(map(str, tokens[:4])) + (", ..." if len(tokens) > 4 else "")
        return (f"the steps update with tokens {shown} in this order, not 0, 1, 2, ... (the state entering the "
                f"first comes from {describe_node(first.prev)})")
    for j, step in enumerate(chain):
        if step.out is None and not find_output(step):
            return f"token {step.token}: no output is read from the updated state (expected S^T q_t)"
        for role in ROLES:
            ref, ref0 = step.ref(role), first.ref(role)
            if ref.source is not ref0.source or ref.dim != ref0.dim:
                return (f"token {step.token} reads {role} from {describe_node(ref.source)} (dim {ref.dim}), "
                        f"token {first.token} from {describe_node(ref0.source)} (dim {ref0.dim})")
            if ref.index != j:
                return f"step {j} reads {role} at token {ref.index} but k at token {step.token}"
    for role in ROLES:
        ref = first.ref(role)
        length = static_int(tensor_of(ref.source).shape[ref.dim])
        if length != len(chain):
            after = [u for u in chain[-1].new.users if u not in chain[-1].nodes]
            why = (f"; the state after token {len(chain) - 1} goes to {_names(after)}, which does not continue "
                   f"the delta-rule update" if after else "")
            return f"the steps cover tokens 0..{len(chain) - 1} of {role}'s {length} tokens{why}"
    reference = [_name(n) for n in sorted(first.nodes, key=position.__getitem__)]
    for step in chain[1:]:
        spelled = [_name(n) for n in sorted(step.nodes, key=position.__getitem__)]
        if spelled != reference:
            diff = next((f"{a} where step 0 has {b}" for a, b in zip(spelled, reference) if a != b),
                        f"{len(spelled)} calls where step 0 has {len(reference)}")
            return f"step {step.token} is spelled differently from step 0: {diff}"
    for j, step in enumerate(chain):
        for node in step.nodes - {step.out, step.new}:
            outside = [u for u in node.users if u not in step.nodes]
            if outside:
                return f"{describe_node(node)} of token {step.token} is also used by {_names(outside)}"
        if j + 1 < len(chain):
            outside = [u for u in step.new.users if u not in step.nodes | chain[j + 1].nodes]
            if outside:
                return f"the state after token {step.token} is also read by {_names(outside)}"
    return None


# ----------------------------------------------------------------------------------------------
# How the outputs are gathered
# ----------------------------------------------------------------------------------------------
@dataclass
class Gather:
    """How the per-token outputs become one tensor: ``kind``, the time dim of the result, the
    nodes that gather (erased), the node whose reads become the op output and those reads."""

    kind: str
    dim: int
    nodes: list[torch.fx.Node]
    result: torch.fx.Node
    readers: list[torch.fx.Node]


def find_gather(chain: list[Step], position: dict) -> Gather | str:
    outs = [s.out for s in chain]
    for step in chain:
        if len(step.out.users) != 1:
            return (f"the output of token {step.token} ({describe_node(step.out)}) has {len(step.out.users)} users, "
                    f"expected one store, stack or cat")
    first = next(iter(outs[0].users))
    ndim = tensor_of(outs[0]).dim() + 1
    stored = SETITEM.bind(first)
    if stored is not None:
        return _gather_into_buffer(chain, stored["input"], ndim, position)
    stacked = STACK.bind(first)
    if stacked is not None and list(stacked["tensors"]) == outs and isinstance(stacked["dim"], int):
        return Gather("stack", stacked["dim"] % ndim, [first], first, list(first.users))
    units = [next(iter(o.users)) for o in outs]
    for dim in range(ndim):
        if all(unit_dim_source(u, dim - ndim) is o and len(u.users) == 1 for u, o in zip(units, outs)):
            node = next(iter(units[0].users))
            cat = CAT.bind(node)
            if cat is not None and list(cat["tensors"]) == units and isinstance(cat["dim"], int) \
                    and cat["dim"] % ndim == dim:
                return Gather("cat", dim, units + [node], node, list(node.users))
    return (f"the outputs are gathered by {describe_node(first)}, not by stores into a buffer, torch.stack or "
            f"torch.cat in token order")


def _gather_into_buffer(chain: list[Step], buf: Any, ndim: int, position: dict) -> Gather | str:
    """``o = zeros(...); o[:, t] = o_t`` for every token (in-place setitem nodes): the stores fill
    the whole fresh buffer and nothing reads it between the first and the last store."""
    if not isinstance(buf, torch.fx.Node) or buf.op not in ("call_function", "call_method") \
            or buf.target not in FRESH_BUFFERS:
        return f"the outputs are stored into {describe_node(buf)}, not into a fresh zeros / empty buffer"
    stores, dim = [], None
    for step in chain:
        store = next(iter(step.out.users))
        bound = SETITEM.bind(store)
        where = parse_token_index(bound["index"], ndim) if bound and bound["input"] is buf else None
        if where is None or where[1] != step.token or dim not in (None, where[0]):
            return f"token {step.token} is stored by {describe_node(store)}, not into {buf.name}[:, ..., t]"
        stores.append(store)
        dim = where[0]
    per_token = list(tensor_of(chain[0].out).shape)
    if not known_shape_equal(tensor_of(buf).shape, per_token[:dim] + [len(chain)] + per_token[dim:]):
        return (f"the output buffer {describe_node(buf)} of shape {list(tensor_of(buf).shape)} is not filled "
                f"exactly by the {len(chain)} token outputs")
    start, end = position[stores[0]], position[stores[-1]]
    between = [u for u in buf.users if u not in stores and start < position[u] < end]
    if between:
        return f"the output buffer is read between the steps by {_names(between)}"
    readers = [u for u in buf.users if u not in stores and position[u] > end]
    return Gather("setitem", dim, stores, buf, readers)


# ----------------------------------------------------------------------------------------------
# The op's inputs
# ----------------------------------------------------------------------------------------------
def writers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The in-place calls that modify ``node`` (their first argument)."""
    return [u for u in node.users if is_inplace(u) and u.args and u.args[0] is node]


def _is_zeros(node: Any, written_by: Any = None) -> bool:
    """A zeros tensor (through casts) that no in-place op other than ``written_by`` modifies."""
    while CAST.bind(node) is not None:
        node = CAST.bind(node)["input"]
    return ZEROS.bind(node) is not None and all(u is written_by for u in writers(node))


def initial_state(prev: torch.fx.Node) -> tuple[torch.fx.Node | None, str]:
    """The state entering token 0: None for zeros (``zeros``, ``new_zeros(...).to(q)``), ``h0`` for
    ``zeros + h0`` / ``zeros += h0`` (FLA's reference), else the state tensor itself."""
    if _is_zeros(prev):
        return None, "zeros"
    for fam in (ADD, IADD):
        bound = fam.bind(prev)
        for zeros, h0 in ((bound["input"], bound["other"]), (bound["other"], bound["input"])) if bound else ():
            h0_t = tensor_of(h0)
            if _is_zeros(zeros, written_by=prev) and h0_t is not None and \
                    known_shape_equal(h0_t.shape, tensor_of(prev).shape):
                return h0, "given"
    return prev, "given"


def _is_number(value: Any) -> bool:
    val = example_value(value)
    return isinstance(val, (int, float, torch.SymFloat, torch.SymInt)) and not isinstance(val, bool)


def peel_scale(node: torch.fx.Node) -> tuple[torch.fx.Node, float]:
    """``x * c``, ``c * x``, ``x / c`` with a number c -> (x, scale); else (node, 1.0)."""
    mul, div = MUL.bind(node), DIV.bind(node)
    if mul is not None:
        for x, c in ((mul["input"], mul["other"]), (mul["other"], mul["input"])):
            if isinstance(x, torch.fx.Node) and _is_number(c):
                return x, float(concrete_number(c))
    if div is not None and isinstance(div["input"], torch.fx.Node) and _is_number(div["other"]):
        return div["input"], 1.0 / float(concrete_number(div["other"]))
    return node, 1.0


def peel_head_repeat(node: torch.fx.Node, ref: TokenSlice) -> tuple[torch.fx.Node, int]:
    """``x.repeat_interleave(G, dim=<heads>)`` -> (x, G); else (node, 1). Heads are dim 1 of a
    token [B, H, K], so dim 1 or 2 of the input depending on where time is."""
    rep = REPEAT_INTERLEAVE.bind(node)
    heads = 1 if ref.dim > 1 else 2
    if rep is not None and isinstance(rep["repeats"], int) and isinstance(rep["dim"], int) \
            and rep["dim"] % 4 == heads and rep["output_size"] is None:
        return rep["input"], rep["repeats"]
    return node, 1


@dataclass
class Plan:
    """Everything the replacement needs, decided before the graph changes."""

    chain: list[Step]
    inputs: dict[str, tuple[torch.fx.Node, int]]  # role -> (node, time dim)
    scale: float
    state: torch.fx.Node | None
    gather: Gather
    final_users: list[torch.fx.Node]
    details: dict


def plan_chain(chain: list[Step], position: dict) -> Plan | str:
    reason = check_steps(chain, position)
    if reason is not None:
        return reason
    gather = find_gather(chain, position)
    if isinstance(gather, str):
        return gather
    last = chain[-1]
    final_users = [u for u in last.new.users if u not in last.nodes]
    if not gather.readers and not final_users:
        return "neither the outputs nor the final state are read afterwards"
    refs = {role: chain[0].ref(role) for role in ROLES}
    q, scale = peel_scale(refs["q"].source)
    (q_base, q_rep), (k_base, k_rep) = peel_head_repeat(q, refs["q"]), peel_head_repeat(refs["k"].source, refs["k"])
    grouped = q_rep == k_rep > 1
    inputs = {role: (ref.source, ref.dim) for role, ref in refs.items()}
    inputs["q"] = (q_base if grouped else q, refs["q"].dim)
    if grouped:
        inputs["k"] = (k_base, refs["k"].dim)
    state, state_kind = initial_state(chain[0].prev)
    for name, node in [*((r, n) for r, (n, _) in inputs.items()), ("initial state", state)]:
        mutated = writers(node) if node is not None else []
        if mutated:
            return f"the {name} ({describe_node(node)}) is modified in place by {_names(mutated)}"
    layout = {1: "[B, T, H, K]", 2: "[B, H, T, K]"}.get(refs["q"].dim, f"time at dim {refs['q'].dim}")
    details = dict(steps=len(chain), layout=layout, scale=round(scale, 6), initial_state=state_kind,
                   final_state=bool(final_users), gather=gather.kind)
    if grouped:
        details["gva"] = q_rep
    return Plan(chain, inputs, scale, state, gather, final_users, details)


# ----------------------------------------------------------------------------------------------
# The rewrite
# ----------------------------------------------------------------------------------------------
class KDARecurrenceRewrite(GraphRewrite):
    """Replace every unrolled delta-rule recurrence with one ``chunk_kda`` / ``fused_recurrent_kda`` call."""

    name = "kda_recurrence"

    def apply(self, gm: torch.fx.GraphModule, log: RewriteLog) -> int:
        graph = gm.graph
        steps = [step for node in graph.nodes if (step := match_step(node)) is not None]
        rewritten = 0
        for chain in build_chains(steps):
            where = (module_path(chain[0].new), source_line(chain[0].new))
            position = {n: i for i, n in enumerate(graph.nodes)}
            plan = plan_chain(chain, position)
            if isinstance(plan, str):
                log.left_alone.append(LeftAlone(self.name, *where, plan))
                continue
            op = fused_recurrent_kda if len(chain) <= RECURRENT_MAX_T else chunk_kda
            try:
                self._replace(graph, plan, op, position)
            except (TypeError, ValueError) as exc:  # the op's argument checks
                log.left_alone.append(LeftAlone(self.name, *where, f"kda_compile.ops.{op.__name__} refuses: {exc}"))
                continue
            log.rewritten.append(Rewritten(self.name, *where, f"kda_compile.ops.{op.__name__}", plan.details))
            rewritten += 1
        return rewritten

    @staticmethod
    def _replace(graph: torch.fx.Graph, plan: Plan, op, position: dict) -> None:
        consumers = plan.gather.readers + plan.final_users
        at = min(consumers, key=position.__getitem__)
        meta = plan.chain[0].new
        inserted: list[torch.fx.Node] = []

        def call(target, *args, **kwargs) -> torch.fx.Node:
            node = insert_call(graph, at, target, args, kwargs, meta_from=meta)
            inserted.append(node)
            return node

        try:
            args = []
            for role in ROLES:
                node, dim = plan.inputs[role]
                args.append(node if dim == 1 else call("movedim", node, dim, 1))
            q = tensor_of(args[0])
            state = plan.state
            want = torch.float64 if q.dtype == torch.float64 else torch.float32
            if state is not None and tensor_of(state).dtype != want:
                state = call("to", state, want)
            result = call(op, *args, scale=plan.scale, initial_state=state, output_final_state=bool(plan.final_users))
        except (TypeError, ValueError):
            erase_unused(graph, reversed(inserted))
            raise
        o = call(operator.getitem, result, 0)
        if plan.gather.dim != 1:
            o = call("movedim", o, 1, plan.gather.dim)
        if tensor_of(o).dtype != tensor_of(plan.gather.result).dtype:
            o = call("to", o, tensor_of(plan.gather.result).dtype)
        readers = set(plan.gather.readers)
        plan.gather.result.replace_all_uses_with(o, delete_user_cb=readers.__contains__)
        last = plan.chain[-1].new
        if plan.final_users:
            final = call(operator.getitem, result, 1)
            if tensor_of(final).dtype != tensor_of(last).dtype:
                final = call("to", final, tensor_of(last).dtype)
            finals = set(plan.final_users)
            last.replace_all_uses_with(final, delete_user_cb=finals.__contains__)
        doomed = [n for step in plan.chain for n in step.nodes] + plan.gather.nodes
        erase_unused(graph, doomed)
