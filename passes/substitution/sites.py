"""The KDA sites of a compiled graph, for the rewrite report (entries named ``kda_substitution``, after the
Config field of trace-time substitution).

Trace-time substitution (substitution/install.py) happens before the graph exists, so this is no rewrite: the
pass manager runs it as a report step (manager.PIPELINE), which reads the graph and reports, per KDA call::

    model.layers.0.self_attn (modeling_kimi_linear.py:695) -> kda_compile.chunk_kda_fwd(
        entry=transformers chunk_kimi_delta_attention, heads=2/2, K=16, V=16, scale=0.25,
        use_qk_l2norm_in_kernel=True, initial_state=False, output_final_state=True, ...)

for every node calling ``torch.ops.kda_compile.chunk_kda_fwd`` / ``fused_recurrent_kda_fwd`` or the
GDN ops ``chunk_gdn_fwd`` / ``fused_recurrent_gdn_fwd`` (what a substitute or a direct call of
``kda_compile.ops`` traces to), or the public ``chunk_kda`` / ``fused_recurrent_kda`` /
``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` (what other rewrites insert). A GDN
site reads e.g. ``-> kda_compile.chunk_gdn_fwd(entry=transformers torch_chunk_gated_delta_rule, ...)``.
``entry`` is the entry point the call stands
for, read from the node's stack trace: the frame of the substitute that produced it (substitution/substitutes.py; e.g.
``fla chunk_kda``, ``transformers recurrent_kimi_delta_attention``, with ``via HF wrapper`` when
HF's wrapper was substituted), else ``kda_compile.ops`` (called by the model) or ``graph rewrite``.
``source`` is the model line that called the entry point.

The routed experts a substitute made ``moe_experts`` (substitution/moe_experts.py) are reported the same way, as
entries named ``moe_experts``::

    model.layers.0.mlp.experts (modeling_qwen3_moe.py:212) -> kda_compile.moe_experts(
        entry=transformers grouped_mm_experts_forward, experts=4, top_k=2, H=64, I=32, dtype=torch.float32)

HF's grouped GEMM traced as written (training, or a form the op does not compute) is the model's own path, not a
left-alone candidate: the substitute logs its reason once at INFO.

A causal conv1d that keeps packed documents apart (substitution/documents.py, docs/packed-documents.md) is
reported as ``model.layers.0.linear_attn (modeling_qwen3_next.py:699) -> causal_conv1d_per_document(
entry=transformers causal_conv1d_fn, kernel_size=4)``; its delta-rule site reads ``cu_seqlens=True``.

Left alone (reported): a Hugging Face torch reference (``chunk_kimi_delta_attention`` /
``recurrent_kimi_delta_attention``, or a GDN model's ``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule``) traced as written and not collapsed by another rewrite,
e.g. with ``KDA_COMPILE_SUBSTITUTION=0``:
one entry per layer, with the number of nodes it unrolled into.

Not visible here: a call Dynamo did not trace. FLA's entry points are ``torch.compiler.disable``d,
so an unsubstituted FLA call is a graph break between two graphs, and no graph holds it
(``torch._dynamo.explain`` lists graph breaks).
"""
from __future__ import annotations

import inspect
import os
import re
from collections import Counter
from typing import Any

import torch
import torch.fx

from kda_compile.ops import chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule, fused_recurrent_kda
from kda_compile.passes.delta_rule import probe
from kda_compile.passes.report import LeftAlone, Rewritten
from kda_compile.passes.rewrite import RewriteLog
from kda_compile.passes.substitution import conv_update, documents, install
from kda_compile.passes.substitution import moe_experts as moe_substitute
from kda_compile.passes.substitution import substitutes as kda_substitutes
from kda_compile.passes.toolkit.graph_tools import example_value, is_our_file, module_path, source_line, tensor_of

KDA_OPS = {"kda_compile::chunk_kda_fwd": "chunk", "kda_compile::fused_recurrent_kda_fwd": "recurrent",
           "kda_compile::chunk_gdn_fwd": "chunk", "kda_compile::fused_recurrent_gdn_fwd": "recurrent"}
PUBLIC_FUNCTIONS = {chunk_kda: "chunk", fused_recurrent_kda: "recurrent", chunk_gated_delta_rule: "chunk",
                    fused_recurrent_gated_delta_rule: "recurrent"}
FLAGS = ("scale", "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
         "lower_bound", "output_final_state")

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_SUBSTITUTES_FILE = os.path.abspath(kda_substitutes.__file__)
_DOCUMENTS_FILE = os.path.abspath(documents.__file__)
_WRAPPER_DIRS = (os.sep + os.path.join("transformers", "integrations") + os.sep,)


def _frames(node: torch.fx.Node) -> list[tuple[str, int, str]]:
    """(file, line, function) of each frame of a node's stack trace, outermost first."""
    return [(path, int(line), fn) for path, line, fn in _FRAME.findall(node.meta.get("stack_trace") or "")]


def kda_call(node: torch.fx.Node) -> tuple[str, dict[str, Any]] | None:
    """``(kind, arguments by name)`` when ``node`` calls a KDA op or public KDA function, else None."""
    if node.op != "call_function":
        return None
    target = node.target
    if target in PUBLIC_FUNCTIONS:
        try:
            bound = inspect.signature(target).bind(*node.args, **node.kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        return PUBLIC_FUNCTIONS[target], dict(bound.arguments)
    schema = getattr(target, "_schema", None)
    if schema is None or schema.name not in KDA_OPS:
        return None
    arguments = dict(zip((a.name for a in schema.arguments), node.args))
    arguments.update(node.kwargs)
    return KDA_OPS[schema.name], arguments


def _caller_line(frames: list[tuple[str, int, str]], first_ours: int) -> str:
    """``file:line`` of the model code that called into kda_compile (HF's kernel wrappers skipped)."""
    callers = [(p, line) for p, line, _ in frames[:first_ours] if not any(d in p for d in _WRAPPER_DIRS)]
    return f"{os.path.basename(callers[-1][0])}:{callers[-1][1]}" if callers else ""


def _entry_and_source(node: torch.fx.Node) -> tuple[str, str]:
    """Which entry point a KDA node stands for, and the model line that called it."""
    frames = _frames(node)
    substitutes = [fn for path, _, fn in frames
                   if os.path.abspath(path) == _SUBSTITUTES_FILE and fn in kda_substitutes.SUBSTITUTE_FRAMES]
    first_ours = next((i for i, (path, _, _) in enumerate(frames) if is_our_file(path)), None)
    if first_ours is None:  # inserted by a rewrite, with the model node's metadata
        function = _reference_function(frames)
        unrolled = f" (transformers {function} unrolled, then collapsed)" if function else ""
        return "graph rewrite" + unrolled, source_line(node)
    source = _caller_line(frames, first_ours)
    probed = probe.recognised_entry(frames)
    if probed is not None:  # a look-alike function, recognised by what it computes
        return probed, source
    if not substitutes:
        return "kda_compile.ops", source
    entry = kda_substitutes.SUBSTITUTE_FRAMES[substitutes[-1]]
    if "hf_kda_wrapper" in substitutes[:-1]:
        entry += " via HF wrapper"
    return entry, source


def _flag(value: Any) -> Any:
    """A flag as a constant (a symbolic value, e.g. an unspecialised float, by its expression)."""
    return str(example_value(value)) if isinstance(value, torch.fx.Node) else value


def site_details(node: torch.fx.Node, kind: str, arguments: dict[str, Any], entry: str) -> dict[str, Any]:
    q, v = tensor_of(arguments.get("q")), tensor_of(arguments.get("v"))
    details: dict[str, Any] = {"kind": kind, "entry": entry}
    if q is not None and v is not None and q.dim() == 4 and v.dim() == 4:
        details.update(heads=f"{q.shape[2]}/{v.shape[2]}", K=q.shape[3], V=v.shape[3], dtype=str(q.dtype))
    details.update({flag: _flag(arguments[flag]) for flag in FLAGS if flag in arguments})
    details["initial_state"] = arguments.get("initial_state") is not None
    details["cu_seqlens"] = arguments.get("cu_seqlens") is not None
    return details


def _reference_function(frames: list[tuple[str, int, str]]) -> str | None:
    """The HF torch KDA reference a node was traced in (not through a substitute), or None."""
    if any(is_our_file(path) and os.path.abspath(path) != probe.PROBE_FILE for path, _, _ in frames):
        return None  # (a probing substitute that declined a call traces the original: still a reference)
    names = [fn for _, _, fn in frames
             if fn in kda_substitutes.HF_REFERENCE_FUNCTIONS or probe.traced_as_written(fn)]
    return names[-1] if names else None


def unsubstituted_references(gm: torch.fx.GraphModule) -> dict[tuple[str, str], int]:
    """(module path, function) -> node count, for HF torch KDA references traced as written and
    not collapsed into a KDA call by another rewrite (kda_recurrence)."""
    found: Counter = Counter()
    collapsed = set()
    for node in gm.graph.nodes:
        function = _reference_function(_frames(node))
        if function is not None:
            found[(module_path(node), function)] += 1
            if kda_call(node) is not None:
                collapsed.add((module_path(node), function))
    return {key: count for key, count in found.items() if key not in collapsed}


CONV_OP = "causal_conv1d_per_document"  # how the report names a conv that keeps packed documents apart


def per_document_convs(gm: torch.fx.GraphModule) -> dict[str, tuple[str, Any]]:
    """module path -> (model line, kernel size) of each conv traced by the per-document conv substitute
    (substitution/documents.py), read from the unfold of its taps."""
    found: dict[str, tuple[str, Any]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_method" or node.target != "unfold":  # only unfolds: no stack trace parsed for the rest
            continue
        frames = _frames(node)
        at = next((i for i, (path, _, fn) in enumerate(frames)
                   if fn == documents.CONV_FRAME and os.path.abspath(path) == _DOCUMENTS_FILE), None)
        if at is not None:
            found[module_path(node)] = (_caller_line(frames, at), node.args[2] if len(node.args) > 2 else None)
    return found


NAME = "kda_substitution"  # the Config field of trace-time substitution, and the name its entries carry
MOE_OP = "kda_compile::moe_experts"
MOE_NAME = "moe_experts"  # the name its entries carry (switched with the other substitutes by kda_substitution)
_MOE_SUBSTITUTE_FILE = os.path.abspath(moe_substitute.__file__)
_CONV_UPDATE_FILE = os.path.abspath(conv_update.__file__)


def moe_site(node: torch.fx.Node) -> Rewritten | None:
    """The report entry of a ``moe_experts`` call, or None for any other node."""
    if node.op != "call_function":
        return None
    schema = getattr(node.target, "_schema", None)  # an OpOverload; a packet (Dynamo's target) names itself
    if (schema.name if schema is not None else getattr(node.target, "_qualified_op_name", None)) != MOE_OP:
        return None
    x, index, _, gate_up = (tensor_of(a) for a in node.args[:4])
    by_substitute = any(os.path.abspath(path) == _MOE_SUBSTITUTE_FILE for path, _, _ in _frames(node))
    details: dict[str, Any] = {"entry": moe_substitute.ENTRY_POINT if by_substitute else "kda_compile.ops"}
    if x is not None and index is not None and gate_up is not None:
        details.update(experts=gate_up.shape[0], top_k=index.shape[-1], H=x.shape[-1], I=gate_up.shape[1] // 2,
                       dtype=str(x.dtype))
    return Rewritten(MOE_NAME, module_path(node), _entry_and_source(node)[1], "kda_compile.moe_experts", details)


CONV_UPDATE_OP = "kda_compile::causal_conv1d_update"
CONV_UPDATE_NAME = "causal_conv1d_update"  # the name its entries carry (switched by kda_substitution)


def conv_update_site(node: torch.fx.Node) -> Rewritten | None:
    """The report entry of a ``causal_conv1d_update`` call, or None for any other node."""
    if node.op != "call_function":
        return None
    schema = getattr(node.target, "_schema", None)
    if (schema.name if schema is not None else getattr(node.target, "_qualified_op_name", None)) != CONV_UPDATE_OP:
        return None
    x, state, weight = (tensor_of(a) for a in node.args[:3])
    by_substitute = any(os.path.abspath(path) == _CONV_UPDATE_FILE for path, _, _ in _frames(node))
    details: dict[str, Any] = {"entry": conv_update.ENTRY_POINT if by_substitute else "kda_compile.ops"}
    if x is not None and state is not None and weight is not None:
        details.update(channels=x.shape[1], kernel_size=weight.shape[-1], state_len=state.shape[-1],
                       dtype=str(x.dtype))
    return Rewritten(CONV_UPDATE_NAME, module_path(node), _entry_and_source(node)[1],
                     "kda_compile.causal_conv1d_update", details)


def report_substitution_sites(gm: torch.fx.GraphModule, log: RewriteLog) -> None:
    """Log the KDA sites of ``gm`` and the torch references traced as written (see the module docstring);
    the graph is not changed."""
    for node in gm.graph.nodes:
        call = kda_call(node)
        if call is None:
            site = moe_site(node) or conv_update_site(node)
            if site is not None:
                log.rewritten.append(site)
            continue
        kind, arguments = call
        entry, source = _entry_and_source(node)
        op = getattr(node.target, "__name__", None) if node.target in PUBLIC_FUNCTIONS else None
        op = f"kda_compile.ops.{op}" if op else str(getattr(node.target, "_schema").name).replace("::", ".")
        log.rewritten.append(Rewritten(NAME, module_path(node), source, op,
                                       site_details(node, kind, arguments, entry)))
    for site, (source, width) in per_document_convs(gm).items():
        log.rewritten.append(Rewritten(NAME, site, source, CONV_OP, {"entry": documents.CONV_ENTRY,
                                                                     "kernel_size": width}))
    for (site, function), count in unsubstituted_references(gm).items():
        probed = "; ".join(probe.traced_as_written(function))
        why = probed or (f"its substitute is not registered ({install.ENV_SWITCH}=0, or see the "
                         f"kda_compile.passes.kda_substitution log)")
        log.left_alone.append(LeftAlone(
            NAME, site, "",
            f"Hugging Face's torch reference {function} traced as written ({count} nodes, its loops "
            f"unrolled): {why}"))
