"""Attention whose softmax is spelled ``exp(x - logsumexp(x))``: reported, not rewritten.

Reformer's local and LSH self-attention (models/reformer/modeling_reformer.py, ``_attend`` and
``LocalSelfAttention.forward``) write the softmax without a softmax node::

    query_key_dots = torch.matmul(query_vectors, key_vectors.transpose(-1, -2))
    query_key_dots = torch.where(mask, query_key_dots, mask_value)            # mask_value: a module buffer (-1e9)
    query_key_dots = torch.where(self_mask, query_key_dots, self_mask_value)  # LSH only: -1e5, a penalty
    logits = torch.logsumexp(query_key_dots, dim=-1, keepdim=True)
    attention_probs = torch.exp(query_key_dots - logits)
    attention_probs = nn.functional.dropout(attention_probs, p=self.dropout, training=self.training)
    out_vectors = torch.matmul(attention_probs, value_vectors)

over [B, H, S, S] scores for a sequence no longer than a chunk, else over 5-D chunked scores
[B, H, chunks, chunk length, keys of this and the adjacent chunks] (LSH: of the queries sorted into hash
buckets; with several hash rounds the log-sum-exp is returned too, to weigh the rounds).

``softmax_attention`` anchors on softmax nodes, so these sites were neither rewritten nor reported. An
``exp(x - logsumexp(x, dim, keepdim=True))`` with a matmul, bmm or einsum a few nodes away on both sides is
now a candidate: :func:`exp_lse_candidates` lists each one with everything that stops the rewrite (the
spelling itself; scores that are not 4-D; a softmax not over the last dim; the log-sum-exp used
elsewhere; ``torch.where`` fills read from graph inputs such as module buffers; anything else in the chain
that the softmax matcher would not read). Nothing in the graph changes.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx

from kda_compile.passes.attention.patterns import ALL_PROBABILITY_STAGES, ALL_SCORE_STAGES, OUTPUT, SCORES
from kda_compile.passes.attention.spellings import (_EINSUM, _PRODUCTS, _PROJECTIONS, fill_value, graph_input_behind,
                                                    product_within)
from kda_compile.passes.toolkit.graph_tools import describe_node, is_last_dim, tensor_of
from kda_compile.passes.toolkit.matching import SUB, family, match_downward, match_upward

EXP = family("exp", ("input",), functions=(torch.exp,), methods=("exp",))
LOGSUMEXP = family("logsumexp", ("input", "dim", "keepdim"), functions=(torch.logsumexp,), methods=("logsumexp",),
                   defaults={"keepdim": False})
WHERE = family("where", ("condition", "input", "other"), functions=(torch.where,))

HOPS = 6  # as for a softmax candidate (softmax_attention._match)


def exp_lse_parts(exp: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(scores, sub, logsumexp) when ``exp`` is ``exp(scores - logsumexp(scores, dim, keepdim=True))``."""
    bound = EXP.bind(exp)
    sub = bound["input"] if bound is not None else None
    diff = SUB.bind(sub) if isinstance(sub, torch.fx.Node) else None
    if diff is None or not isinstance(diff["other"], torch.fx.Node):
        return None
    lse = LOGSUMEXP.bind(diff["other"])
    if lse is None or lse["input"] is not diff["input"] or lse["keepdim"] is not True:
        return None
    return diff["input"], sub, diff["other"]


def _product_above(node: Any, hops: int) -> bool:
    """A matmul / bmm / baddbmm / einsum within ``hops`` nodes above ``node``, along every tensor
    argument (the scores of ``torch.where(mask, scores, fill)`` are its second argument); a linear
    projection ends the walk."""
    frontier, seen = [node], set()
    for _ in range(hops):
        nxt = []
        for n in frontier:
            if not isinstance(n, torch.fx.Node) or n in seen or n.op not in ("call_function", "call_method") \
                    or n.target in _PROJECTIONS:
                continue
            seen.add(n)
            if n.target in _EINSUM or any(f.bind(n) is not None for f in _PRODUCTS):
                return True
            nxt += [a for a in n.all_input_nodes]
        frontier = nxt
    return False


def input_name(node: torch.fx.Node) -> str:
    """A graph input by what it is in the model: ``module buffer mask_value_float32``, ``parameter sinks``
    (the last attribute name: one reason per kind across layers); else its node name."""
    name = node.name
    for kind, marker in (("module buffer", "_buffers_"), ("parameter", "_parameters_")):
        if marker in name:
            return f"{kind} {name.rsplit(marker, 1)[1].strip('_')}"
    return f"graph input {name}"


def _where_fills(scores: torch.fx.Node) -> tuple[torch.fx.Node, list[str]]:
    """Walk up ``torch.where(cond, x, fill)`` nodes from the scores: the node below them, and what each
    fill that is not a constant reads."""
    found = []
    node = scores
    while isinstance(node, torch.fx.Node):
        bound = WHERE.bind(node)
        if bound is None or not isinstance(bound["input"], torch.fx.Node):
            break
        fill = bound["other"]
        if fill_value(fill) is None:
            source = graph_input_behind(fill)
            found.append(input_name(source) if source is not None else describe_node(fill))
        node = bound["input"]
    return node, found


def exp_lse_reason(exp: torch.fx.Node) -> str | None:
    """Why the attention around ``exp(x - logsumexp(x))`` is left alone, or None when ``exp`` is no such
    candidate (another spelling, or no matmul, bmm or einsum within a few nodes on either side)."""
    parts = exp_lse_parts(exp)
    if parts is None:
        return None
    scores, sub, lse = parts
    if not (_product_above(scores, HOPS) and any(product_within(u, HOPS, upward=False) for u in exp.users)):
        return None
    dim = LOGSUMEXP.bind(lse)["dim"]
    reasons = [f"the softmax is spelled exp(x - logsumexp(x, dim={dim}, keepdim=True)) ({describe_node(exp)}), "
               f"which the rewrite does not read as a softmax (it matches softmax nodes)"]
    value = tensor_of(scores)
    rank = value.dim() if value is not None else None
    if rank is not None and rank != 4:
        chunked = " (chunked attention: [batch, heads, chunks, chunk length, keys of this and adjacent chunks])" \
            if rank == 5 else ""
        reasons.append(f"the scores are {rank}-D {list(value.shape)}{chunked}; the op takes 4-D [batch, heads, "
                       f"seq, dim] query, keys and values over the whole sequence")
    if rank is not None and not is_last_dim(dim, rank):
        reasons.append(f"the log-sum-exp runs over dim {dim}, not over the keys (dim -1)")
    others = [u for u in lse.users if u is not sub]
    if others:
        reasons.append(f"the log-sum-exp ({describe_node(lse)}) is also used by "
                       f"{', '.join(describe_node(u) for u in others)}")
    below, fills = _where_fills(scores)
    if fills:
        what = "a graph input whose value the graph does not fix" if len(fills) == 1 else \
            "graph inputs whose values the graph does not fix"
        reasons.append(f"torch.where fills the masked scores with {' and '.join(fills)}: {what}, not a constant "
                       f"-inf or dtype minimum, which the op's masks stand for")
    up = match_upward(below, ALL_SCORE_STAGES, SCORES)
    if not up:
        after = f" after {' -> '.join(up.stages)}" if up.stages else ""
        reasons.append(f"the scores do not follow eager attention: found {describe_node(up.stopped_at)}{after}, "
                       f"expected {up.expected}")
    down = match_downward(exp, ALL_PROBABILITY_STAGES, OUTPUT)
    if not down:
        after = f" after {' -> '.join(down.stages)}" if down.stages else ""
        reasons.append(f"the attention weights do not follow eager attention: found "
                       f"{describe_node(down.stopped_at)}{after}, expected {down.expected}")
    return "; ".join(reasons)


def exp_lse_candidates(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, str]]:
    """Every ``exp(x - logsumexp(x))`` attention candidate of ``graph`` with the reason it is left alone."""
    found = []
    for node in graph.nodes:
        if EXP.bind(node) is None:
            continue
        reason = exp_lse_reason(node)
        if reason is not None:
            found.append((node, reason))
    return found
