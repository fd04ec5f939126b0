"""A decode step that writes its recurrent state back into the cache it read it from, in place.

Hugging Face's delta-rule layers decode as::

    o, final = recurrent_gated_delta_rule(..., initial_state=state, output_final_state=True)
    cache.update_recurrent_state(final, layer)        # state.copy_(final): the cache keeps its address

(Kimi-Linear casts first: ``final.to(torch.float32)``, a no-op on an fp32 state.) Traced, that is our decode
op (``fused_recurrent_kda`` / ``fused_recurrent_gated_delta_rule``, or their ``torch.ops.kda_compile`` ops)
followed by ``copy_(state, final)``: the op writes a fresh ``[N, HV, K, V]`` fp32 state and the copy reads it
and writes it again, two more passes over the largest tensor of the step (at batch 64 with 32 heads of
128 x 128, 134 MB per layer). This rewrite calls the op with ``inplace_final_state=True`` instead, which
writes the final state over ``state`` in the launch that reads it, and drops the copy. The write is declared
to torch.library (``mutates_args``), so Inductor keeps it in place and CUDA graphs capture it
(docs/cuda-graphs.md).

A call is rewritten when the copy's destination is the call's own ``initial_state`` node and its source the
call's final state (through pure float32 casts), and nothing else uses ``state`` before the copy (a reader
after the call would see the new state; one before it is refused too, since a view it took would). Left alone,
and reported: such a use, and a step whose gradients are needed (a backward needs the state the step
overwrites). A call with no such copy
(a cache that assigns the new state, a final state used otherwise) is not a candidate.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from kda_compile.ops import fused_recurrent_gated_delta_rule, fused_recurrent_kda
from kda_compile.passes.delta_rule.prologue import KDACall, kda_call, output_problem, replace_call
from kda_compile.passes.report import LeftAlone
from kda_compile.passes.rewrite import GraphRewrite, RewriteLog
from kda_compile.passes.toolkit.graph_tools import describe_node, module_path, source_line, tensor_of
from kda_compile.passes.toolkit.matching import CAST, cast_dtype

DECODE_FUNCTIONS = (fused_recurrent_kda, fused_recurrent_gated_delta_rule)
COPY_TARGETS = ("copy_", torch.Tensor.copy_, torch.ops.aten.copy_.default)


def _final_state_readers(call: KDACall) -> list[torch.fx.Node]:
    """The nodes reading the call's final state (``getitem(call, 1)``)."""
    if call.is_op:
        return list(call.outputs.get(1, []))
    return [u for u in call.node.users if u.target is operator.getitem and u.args[1:] == (1,)]


def _through_float_casts(node: torch.fx.Node) -> list[torch.fx.Node]:
    """``node`` and the pure float32 casts of it, transitively (``final.to(torch.float32)``, ``final.float()``)."""
    found, pending = [], [node]
    while pending:
        current = pending.pop()
        found.append(current)
        pending += [u for u in current.users if CAST.bind(u) is not None and cast_dtype(u) == torch.float32]
    return found


def _copy_back(call: KDACall, state: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """The node copying the call's final state into ``state`` and the final-state nodes before it."""
    finals = [n for reader in _final_state_readers(call) for n in _through_float_casts(reader)]
    for node in finals:
        for user in node.users:
            if user.target in COPY_TARGETS and len(user.args) >= 2 and user.args[0] is state and user.args[1] is node:
                return user, finals
    return None


def _why_not(call: KDACall, state: torch.fx.Node, copy: torch.fx.Node, finals: list[torch.fx.Node]) -> str | None:
    # (nodes compare by their place in the graph)
    before_copy = [u for u in state.users if u is not call.node and u is not copy and u < copy]
    if before_copy:
        return (f"the state {describe_node(state)} is also used by {', '.join(map(describe_node, before_copy))} before "
                "the copy back: written in place by the step, it would be the new state there")
    final = tensor_of(finals[0])
    if final is None or tensor_of(state) is None:
        return "the state's shape is not known"
    if final.requires_grad:
        return "gradients flow through the step: a backward needs the state it would overwrite"
    if tensor_of(state).dtype != torch.float32:
        return f"the state is {tensor_of(state).dtype}, not float32"
    return output_problem(call) if call.is_op else None


class DecodeStateInPlaceRewrite(GraphRewrite):
    """Write each decode step's final state over its initial state and drop the copy back into the cache."""

    name = "delta_rule_state_in_place"

    def apply(self, gm: torch.fx.GraphModule, log: RewriteLog) -> int:
        graph = gm.graph
        rewritten = 0
        for call in [c for n in graph.nodes if (c := kda_call(n)) is not None]:
            state = call.args.get("initial_state")
            if (call.fn not in DECODE_FUNCTIONS or call.args.get("inplace_final_state")
                    or not call.args.get("output_final_state") or not isinstance(state, torch.fx.Node)):
                continue
            found = _copy_back(call, state)
            if found is None:
                continue
            copy, finals = found
            where = (module_path(call.node), source_line(call.node))
            problem = _why_not(call, state, copy, finals)
            if problem:
                log.left_alone.append(LeftAlone(self.name, *where, problem))
                continue
            op = f"kda_compile.ops.{call.fn.__name__}"
            if self.replace_site(log, where, op, lambda: self._replace(graph, call, state, copy)):
                rewritten += 1
        return rewritten

    @staticmethod
    def _replace(graph: torch.fx.Graph, call: KDACall, state: torch.fx.Node, copy: torch.fx.Node) -> dict:
        replace_call(graph, call, dict(call.args, inplace_final_state=True))  # raises before any change
        copy.replace_all_uses_with(state)
        graph.erase_node(copy)
        return {"final_state": "written over initial_state"}
