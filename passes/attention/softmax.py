"""Rewrite Hugging Face eager softmax attention into ``kda_compile.ops.attention``.

Matches ``eager_attention_forward`` as transformers 5.17 to 5.23 write it in
models/llama/modeling_llama.py (copied verbatim into mistral, qwen2, qwen3, phi3, deepseek_v3 and
kimi_linear), with the logit softcap of models/gemma2 and gemma3 and the sinks of models/gpt_oss::

    key_states = repeat_kv(key, n_rep)      # key[:, :, None].expand(B, Hkv, n_rep, S, D).reshape(B, H, S, D)
    value_states = repeat_kv(value, n_rep)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if softcap is not None:                                           # gemma2 / gemma3
        attn_weights = torch.tanh(attn_weights / softcap) * softcap
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    # gpt_oss: logits = torch.cat([attn_weights, sinks.reshape(1, -1, 1, 1).expand(B, -1, Sq, -1)], -1)
    #          logits = logits - logits.max(dim=-1, keepdim=True).values
    #          attn_weights = softmax(logits, dim=-1)[..., :-1]
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)

and replaces ``attn_output`` with::

    attn_output = attention(query, key, value, scale=scaling, softcap=softcap, sinks=sinks,
                            attn_mask=..., is_causal=..., sliding_window=...,
                            dropout_p=dropout if module.training else 0.0)

with the un-repeated ``key`` / ``value`` (GQA without repeat_kv). When the graph proves the mask
is the causal mask (with a sliding window, with key padding: see ``attention/mask.py``) it becomes
``is_causal`` / ``sliding_window`` plus, for padding, the ``[B, 1, 1, Sk]`` bool padding mask; any
other mask is passed as the additive tensor. A query row whose keys are all padding gives 0 where
eager attention gave a uniform average (both are unused: only padding positions have such rows).

Neutral spellings are read as the same attention: ``attn_weights.type(value.dtype)`` (gpt2) and
other pure casts of the probabilities, a cast of fp16 / bf16 / fp32 scores to fp32 before the
softmax (the op's softmax runs in fp32), in-place ``scores /= divisor`` / ``scores *= scale``
(falcon), keys and values with one head that both matmuls broadcast (falcon multi-query), and
``torch.where(keep, scores, finfo.min)`` before the mask (gpt_neo; ``keep`` a bool tensor, True =
attend, passed to the op as the bool mask, or combined with the additive mask), a positive scale
applied after the mask (codegen's ``(scores + mask) / scale_attn``: the op gets the product scale and
the mask scaled alike), and a second additive float term (bloom's ALiBi, once
``attention/spellings.py`` has unfolded its ``baddbmm`` / ``bmm`` over [B*H, ...] into 4-D matmuls),
combined with the mask into the op's float ``attn_mask``, ``masked_fill(scores, drop, -inf)`` with
``masked_fill(probabilities, drop, 0)`` after the softmax (cpmant: the bool mask ``~drop``), sinks
applied to the output as ``out * sigmoid(logsumexp(scores) - sinks)`` (granite_swa: the op's ``sinks``),
``torch.max(scores + mask, finfo.min)`` (xglm: the clamp is dropped and the float mask the op gets is
clamped alike, see ``attention/spellings.py``), and a sink logit per query as an extra [B, H, Sq, 1]
column (inkling2: ``attention_with_lse``, whose output is rescaled by ``sigmoid(lse - sink)``),
scores summed from several terms (xlnet's ``(content + position + 0) * scale - 1e30 * mask``: the
content product is the scores, the position term and the subtracted mask the op's float mask, the
literal 0 dropped) and ``scores * b + -1e4 * (1 - b)`` with ``b`` a 0/1 module buffer (openai-gpt: the
bool mask ``b != 0``; see ``attention/spellings.py`` for when that is exact).
Before matching, ``attention/normalize.py`` rewrites, exactly, an in-place ``masked_fill_`` of the
scores read again after it (xlm), ``einsum`` products (prophetnet, xlnet), pre-transposed keys
(openai-gpt) and softmax / dropout of
[B*H, Sq, Sk] views of the 4-D scores (mvp, trocr, xglm); reads of the scores' shape or dtype only
(xlm's ``mask.expand_as(scores)``) are rewritten to read the sizes of the query and keys. N-D attention
with batch-like leading dims (prophetnet's predict stream, [B, ngram, H, S, D]) is matched the same way and
folded into the op's batch dim (``attention/fold.py``).

Left alone, and reported: the attention weights or scores used elsewhere (``output_attentions``; the
weights as an output of the graph, which code after a graph break may read), a softmax not over the
key dimension, anything else between the two matmuls, shapes that do not pair up, in-place ops between the two matmuls (other than the in-place scale), any other multiplicative
mask (an argument, a buffer with values other than 0 / 1, a fill above -1e4), arguments the op refuses. A softmax with no matmul on either side (a MoE router)
is not a candidate; one with a matmul, bmm or einsum a few nodes away on both sides is, and is reported
with what was found where the spelling is not matched. So is a softmax spelled ``exp(x - logsumexp(x))``
between such products (reformer; ``attention/lse_softmax.py`` lists what stops each one).

The new node calls the public function ``attention``, not ``torch.ops.kda_compile.attention_fwd``.
Both pass AOTAutograd (a node of the op, then ``getitem``, was checked too, forward and backward
under dynamic shapes): AOTAutograd traces through the Python function to the custom op and its
registered autograd. The public function is chosen because a node of the op would tie this pass
to the op's private schema (lse / rng outputs, the lse_grad flag, 0-for-None encodings) and skip
its argument checks, which here turn a site the op cannot take into a reported candidate. Its example value comes from
running ``attention`` on the example values, i.e. from the op's fake implementation.
"""
from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from kda_compile.ops.attention import attention, attention_with_lse
from kda_compile.passes.attention.fold import fold_attention, leading_dims
from kda_compile.passes.attention.lse_softmax import exp_lse_candidates
from kda_compile.passes.attention.mask import mask_keywords
from kda_compile.passes.attention.normalize import metadata_read, normalize_attention, replace_metadata_reads
from kda_compile.passes.attention.patterns import ALL_PROBABILITY_STAGES, ALL_SCORE_STAGES, OUTPUT, SCORES
from kda_compile.passes.attention.spellings import (SinkRescale, batched_reason, clamp_bound, fill_value,
                                                    graph_input_behind, is_batched_product, keep_of_factor,
                                                    match_sink_rescale, multiplicative_mask_reason, multiplied_scores,
                                                    product_within, rescale_by_query_sinks, same_computation,
                                                    subtracted_reason, unfold_batched_attention, with_subtracted)
from kda_compile.passes.report import LeftAlone
from kda_compile.passes.rewrite import GraphRewrite, RewriteLog
from kda_compile.passes.toolkit.graph_tools import (concrete_number, describe_node, erase_unused, insert_call,
                                                    is_inplace, is_last_dim, is_tensor_node, known_equal,
                                                    known_shape_equal, module_path, source_line, tensor_of)
from kda_compile.passes.toolkit.matching import SOFTMAX, Bindings, match_downward, match_upward, unrepeat_kv

logger = logging.getLogger("kda_compile.passes.softmax_attention")

OP_NAME = "kda_compile.attention"




@dataclass
class Site:
    """A matched attention: the captured inputs and the nodes the rewrite replaces."""

    softmax: torch.fx.Node
    scores: Bindings
    probabilities: Bindings
    stages: frozenset[str]  # the optional stages present (see SCORE_STAGES, PROBABILITY_STAGES)
    rescale: SinkRescale | None = None  # granite_swa's sinks, applied to the output (attention/spellings.py)

    def __getitem__(self, name: str) -> Any:
        if self.rescale is not None and name in ("sinks", "sink_view"):
            return self.rescale.sinks if name == "sinks" else self.rescale.view
        return self.probabilities.get(name, self.scores.get(name))

    def has(self, name: str) -> bool:
        if self.rescale is not None and name == "sinks":
            return True
        return name in self.scores.values or name in self.probabilities.values

    @property
    def output(self) -> torch.fx.Node:
        """The node the op's result replaces: the value product, or the sink-rescaled product."""
        return self.rescale.nodes[-1] if self.rescale is not None else self.probabilities["output"]

    @property
    def replaced(self) -> tuple[torch.fx.Node, ...]:
        extra = self.rescale.nodes if self.rescale is not None else ()
        return self.scores.nodes + (self.softmax,) + self.probabilities.nodes + extra


def check_site(site: Site, fold: bool = False) -> str | None:
    """Why ``site`` must be left alone, or None when replacing it keeps the meaning. ``fold``: N-D attention
    may be folded into 4-D (attention/fold.py; this rewrite only, not mla/absorb.py / dsa/sparse.py)."""
    soft = SOFTMAX.bind(site.softmax)
    q, k, v = (tensor_of(site[n]) for n in ("query", "key_states", "value_states"))
    lead, reason = leading_dims(q, k, v, fold)
    if reason is not None:
        return reason
    if not is_last_dim(soft["dim"], q.dim()):
        return f"the softmax runs over dim {soft['dim']}, not over the keys (dim -1)"
    if lead > 1 and (site.rescale is not None or site.has("sinks") or site.has("query_sinks")):
        return f"{q.dim()}-D attention with sink logits: the op's sinks are per head of 4-D attention"
    # N-D: the leading dims, equal in q, k and v (leading_dims), fold into the batch dim b
    q, k, v = (t.shape[lead - 1:] for t in (q, k, v))
    (b, h, sq, dqk), (_, _, sk, _) = q, k
    # The keys and values have every query head, or one head both matmuls broadcast (multi-query).
    kv_heads = 1 if known_equal(k[1], 1) and known_equal(v[1], 1) else h
    if not (known_equal(k[0], b) and known_equal(k[1], kv_heads) and known_equal(k[3], dqk)
            and known_equal(v[0], b) and known_equal(v[1], kv_heads) and known_equal(v[2], sk)):
        return (f"the shapes do not pair up as attention: query {list(tensor_of(site['query']).shape)}, keys "
                f"{list(tensor_of(site['key_states']).shape)}, values {list(tensor_of(site['value_states']).shape)}")
    sinks, per_query = "sinks" in site.stages, "query_sinks" in site.stages
    if (site.rescale is not None) + sinks + per_query > 1:
        return "sinks both as an extra softmax column and as a rescale of the output"
    if (sinks or per_query) != ("drop_sink_column" in site.stages) or (sinks and not _per_head(site, h)) \
            or (per_query and not _per_query(site, b, h, sq)):
        return "the extra softmax column is not a per-head or per-query sink logit dropped after the softmax"
    if site.has("softcap") and not concrete_number(site["softcap"]) > 0:
        return f"the softcap {concrete_number(site['softcap'])} is not positive"
    for term, added in (("mask", "masked_scores"), ("bias", "biased_scores")):
        if site.has(term):
            total = tensor_of(site[added])
            if total is None or not known_shape_equal(total.shape, tensor_of(site["scores"]).shape):
                return f"the added {term} broadcasts the scores to a larger shape"
    bias = tensor_of(site["bias"]) if site.has("bias") else None
    if bias is not None and not bias.dtype.is_floating_point:
        return f"the additive bias has dtype {bias.dtype}, not a float dtype the op adds to the scores"
    post = post_scale(site)
    masked = any(site.has(n) for n in ("mask", "bias", "keep", "drop"))
    if post is not None and masked and not post > 0:
        return f"the scale after the mask ({post}) is not positive, so it does not keep masked keys masked"
    if post is not None and site.has("softcap"):
        return "the scale after the mask also scales the softcapped scores, which the op cannot express"
    if site.has("clamp"):
        reason = _clamp_reason(site, post)
        if reason is not None:
            return reason
    for cond, result, how in (("keep", "kept_scores", "torch.where"), ("drop", "filled_scores", "masked_fill")):
        if not site.has(cond):
            continue
        flag, selected = tensor_of(site[cond]), tensor_of(site[result])
        if flag is None or flag.dtype != torch.bool:
            return f"{how} selects the scores by a condition that is not a bool tensor"
        if selected is None or not known_shape_equal(selected.shape, tensor_of(site["scores"]).shape):
            return f"the {how} mask broadcasts the scores to a larger shape"
        fill = fill_value(site["fill"])
        if fill is None or not (fill == -math.inf or fill <= float(torch.finfo(selected.dtype).min)):
            return f"{how} fills masked scores with {fill}, not -inf or the dtype minimum"
    scores = tensor_of(site["scores"])
    if site.has("subtracted"):
        reason = subtracted_reason(tensor_of(site["subtracted"]), tensor_of(site["mask_subtracted_scores"]), scores,
                                   site.has("clamp"))
        if reason is not None:
            return reason
    if site.has("keep_factor"):
        reason = multiplicative_mask_reason(site["keep_factor"], site["mult_fill"],
                                            tensor_of(site["mult_masked_scores"]), scores)
        if reason is not None:
            return reason
    if site.has("zeroed") and not (site.has("drop") and same_computation(site["zeroed"], site["drop"])):
        return "masked_fill zeroes attention weights where the scores were not masked by the same condition"
    outside = _used_outside(site)
    if outside is not None:
        return outside
    return _mutated_between(site)


def post_scale(site: Site) -> float | None:
    """The factor ``(scores + mask) * factor`` applies after the mask, or None."""
    if site.has("post_scale"):
        return float(site["post_scale"])
    if site.has("post_scale_divisor"):
        divisor = float(site["post_scale_divisor"])
        return 1.0 / divisor if divisor != 0 else float("nan")
    return None


def _per_head(site: Site, heads: Any) -> bool:
    """sinks [H] viewed as [1, H, 1, 1] and expanded to one extra column [B, H, Sq, 1]."""
    sinks, view, column = (tensor_of(site[n]) for n in ("sinks", "sink_view", "sink_column"))
    return (sinks is not None and sinks.dim() == 1 and known_equal(sinks.shape[0], heads)
            and view is not None and known_shape_equal(view.shape, (1, sinks.shape[0], 1, 1))
            and column is not None and column.dim() == 4 and known_equal(column.shape[1], heads)
            and known_equal(column.shape[3], 1))


def _per_query(site: Site, batch: Any, heads: Any, queries: Any) -> bool:
    """Query sinks [B or 1, H, Sq, 1] of a float dtype."""
    t = tensor_of(site["query_sinks"])
    return (t is not None and t.dim() == 4 and t.dtype.is_floating_point
            and (known_equal(t.shape[0], batch) or known_equal(t.shape[0], 1)) and known_equal(t.shape[1], heads)
            and known_equal(t.shape[2], queries) and known_equal(t.shape[3], 1))


def _clamp_reason(site: Site, post: float | None) -> str | None:
    """Why the clamp of the scores is not neutral (attention/spellings.py), or None."""
    bound, clamped = clamp_bound(site["clamp"]), tensor_of(site["clamped_scores"])
    if clamped is None or not known_shape_equal(clamped.shape, tensor_of(site["scores"]).shape):
        return "the clamp broadcasts the scores to a larger shape"
    if not (bound == -math.inf or bound <= float(torch.finfo(clamped.dtype).min)):
        return f"the scores are clamped below at {bound}, above the dtype minimum: that changes finite scores"
    if post is not None:
        return "the clamped scores are scaled after the mask, which the op cannot express"
    return None


def _used_outside(site: Site) -> str | None:
    inside = set(site.replaced)
    full = tensor_of(site["scores"]).shape
    # replace_metadata_reads rewrites expand_as of 4-D scores only, a dtype read (type_as) of any rank
    folded = len(full) != 4
    for node in site.replaced:
        if node is site.output:
            continue
        others = [u for u in node.users if u not in inside and not (
            metadata_read(u, node, full) and not (folded and u.target == "expand_as"))]
        if others:
            what = "attention weights" if node is site.softmax or node in site.probabilities.nodes else "scores"
            users = ", ".join(describe_node(u) for u in others)
            return f"the {what} ({describe_node(node)}) are also used by {users} (e.g. output_attentions=True)"
    return None


def _mutated_between(site: Site) -> str | None:
    """An in-place op between the two matmuls, other than a matched in-place stage (which mutates a
    node of the chain that _used_outside proved has no other user)."""
    node, matched = site["scores"], set(site.replaced)
    while node is not site.output:
        node = node.next
        if is_inplace(node) and node not in matched:
            return f"{describe_node(node)} mutates a tensor between the two matmuls"
    return None


def attention_arguments(site: Site, mask_to_flags: bool) -> tuple[dict, dict]:
    """Keyword arguments of ``attention`` for ``site``, and the details the report shows."""
    q, k = tensor_of(site["query"]), tensor_of(site["key_states"])
    scale = 1.0
    if site.has("scale"):
        scale = float(concrete_number(site["scale"]))
    elif site.has("scale_divisor"):
        scale = 1.0 / float(concrete_number(site["scale_divisor"]))
    post = post_scale(site)
    if post is not None:
        scale *= post
    dropout_p = float(site["dropout_p"]) if site.has("dropout_p") and site["training"] else 0.0
    kwargs: dict[str, Any] = dict(scale=scale, dropout_p=dropout_p)
    details: dict[str, Any] = dict(scale=round(scale, 6))
    if site.has("softcap"):
        kwargs["softcap"] = details["softcap"] = float(concrete_number(site["softcap"]))
    if site.has("sinks"):
        kwargs["sinks"], details["sinks"] = site["sinks"], True
    if site.has("query_sinks"):
        details["sinks"] = "per query (rescaled by the op's lse)"
    if site.has("clamp"):
        details["clamp"] = "neutral (mask clamped alike)"
    if dropout_p:
        details["dropout_p"] = dropout_p
    if site.has("mask") and q.dim() != 4:  # N-D (attention/fold.py): the mask tensor, folded
        kwargs["attn_mask"], details["mask"] = site["mask"], f"tensor (folded with the {q.dim() - 3} leading dims)"
    elif site.has("mask"):
        mask_kwargs, mask_details = mask_keywords(site["mask"], q.shape[2], k.shape[2], mask_to_flags, additive=True)
        kwargs.update(mask_kwargs)
        details.update(mask_details)
    if site.has("keep") or site.has("drop"):
        details["where_mask" if site.has("keep") else "fill_mask"] = "bool tensor"
    if site.has("bias"):
        details["bias"] = f"additive {list(tensor_of(site['bias']).shape)}"
    if site.has("keep_factor"):
        details["mult_mask"] = "0/1 graph input -> bool"
    if site.has("subtracted"):
        details["subtracted_mask"] = "float"
    return kwargs, details


def _scaled_mask(graph: torch.fx.Graph, site: Site, mask: Any) -> Any:
    """The additive mask as the scores see it when a scale follows the mask (codegen); a bool mask
    (or flags) is unchanged by a positive scale."""
    post = post_scale(site)
    if post is None or post == 1.0 or mask is None or tensor_of(mask).dtype == torch.bool:
        return mask
    return insert_call(graph, site.output, operator.mul, (mask, post), meta_from=site.output)


def _with_bias(graph: torch.fx.Graph, site: Site, mask: Any) -> Any:
    """``mask`` combined with the additive bias: the bias alone, the bias where a bool mask keeps a
    key (-inf elsewhere), or their sum."""
    bias, at = _scaled_mask(graph, site, site["bias"]), site.output
    if mask is None:
        return bias
    if tensor_of(mask).dtype == torch.bool:
        return insert_call(graph, at, torch.where, (mask, bias, -math.inf), meta_from=at)
    return insert_call(graph, at, operator.add, (bias, mask), meta_from=at)


def _and_kept(graph: torch.fx.Graph, site: Site, mask: Any, keep: torch.fx.Node) -> torch.fx.Node:
    """The mask the op gets when ``torch.where(keep, scores, min)`` (or ``masked_fill(scores, ~keep,
    -inf)``) precedes the additive mask: a masked key gets zero weight either way (eager: min + mask;
    here: -inf)."""
    at = site.output
    if mask is None:
        return keep
    if tensor_of(mask).dtype == torch.bool:
        return insert_call(graph, at, operator.and_, (mask, keep), meta_from=at)
    return insert_call(graph, at, torch.where, (keep, mask, -math.inf), meta_from=at)


class SoftmaxAttentionRewrite(GraphRewrite):
    """Replace every matched eager attention with one call of ``kda_compile.ops.attention``."""

    name = "softmax_attention"
    options = ("attention_mask_to_flags",)

    def apply(self, gm: torch.fx.GraphModule, log: RewriteLog) -> int:
        graph = gm.graph
        normalized = normalize_attention(graph) + unfold_batched_attention(graph)
        rewritten, erased = 0, set()
        for softmax in [n for n in graph.nodes if SOFTMAX.bind(n) is not None]:
            if softmax in erased:
                continue
            site, reason = self._match(softmax)
            if site is None and reason is None:
                logger.debug("%s is not an attention softmax", softmax.name)
                continue
            where = (module_path(softmax), source_line(softmax))
            reason = reason or check_site(site, fold=True)
            if reason is not None:
                log.left_alone.append(LeftAlone(self.name, *where, reason))
                continue
            rewritten += self.replace_site(log, where, OP_NAME, lambda: self._replace(graph, site, erased))
        for exp, reason in exp_lse_candidates(graph):  # reformer: a softmax spelled exp(x - logsumexp(x))
            log.left_alone.append(LeftAlone(self.name, module_path(exp), source_line(exp), reason))
        if normalized and not rewritten:  # the pass manager recompiles only after a rewrite
            graph.lint()
            gm.recompile()
        return rewritten

    @staticmethod
    def _match(softmax: torch.fx.Node) -> tuple[Site | None, str | None]:
        """The site anchored on ``softmax``; (None, reason) for a candidate that does not match;
        (None, None) for a softmax with no matmul, bmm or einsum within a few nodes on either side (not
        attention: e.g. a router)."""
        up = match_upward(SOFTMAX.bind(softmax)["input"], ALL_SCORE_STAGES, SCORES)
        down = match_downward(softmax, ALL_PROBABILITY_STAGES, OUTPUT)
        if up and down:
            rescale = match_sink_rescale(SOFTMAX.bind(softmax)["input"], down.bindings["output"],
                                         tensor_of(up.bindings["query"]).shape[1]
                                         if is_tensor_node(up.bindings["query"]) else None)
            return Site(softmax, up.bindings, down.bindings, frozenset(up.stages + down.stages), rescale), None
        if not up and not down and not (is_batched_product(up.stopped_at) or is_batched_product(down.stopped_at)) \
                and not (product_within(SOFTMAX.bind(softmax)["input"], 6, upward=True)
                         and any(product_within(u, 6, upward=False) for u in softmax.users)):
            return None, None
        failed, side = (up, "scores") if not up else (down, "attention weights")
        if failed.other_users:
            users = ", ".join(describe_node(u) for u in failed.other_users)
            if any(u.op == "output" for u in failed.other_users):
                return None, (f"the attention weights ({describe_node(failed.stopped_at)}) are an output of the "
                              f"graph besides the value product ({users}): the caller may read them (code after a "
                              f"graph break, output_attentions=True) and {OP_NAME} does not return them")
            return None, (f"the attention weights ({describe_node(failed.stopped_at)}) have users besides one value "
                          f"product: {users} (e.g. output_attentions=True)")
        batched = batched_reason(up.stopped_at) or batched_reason(down.stopped_at)
        if batched:
            return None, f"batched attention left as written: {batched}"
        product = None if up else multiplied_scores(SOFTMAX.bind(softmax)["input"])
        if product is not None:
            source = graph_input_behind(product[1])
            kind = "a module buffer" if source is not None and "_buffers_" in source.name else "an input"
            unknown = (f": it reads {kind}, a graph input whose values the graph does not fix, so it is not "
                       f"provably a 0/1 causal mask" if source is not None else "")
            return None, (f"the scores are multiplied by a tensor ({describe_node(product[0])} by "
                          f"{describe_node(product[1])}{unknown}), not masked by an additive or bool mask the op "
                          f"takes, nor scores * b + fill * (1 - b) with a constant fill")
        after = f" after {' -> '.join(failed.stages)}" if failed.stages else ""
        return None, (f"the {side} do not follow eager attention: found {describe_node(failed.stopped_at)}{after}, "
                      f"expected {failed.expected}")

    def _replace(self, graph: torch.fx.Graph, site: Site, erased: set) -> dict:
        kwargs, details = attention_arguments(site, self.config.attention_mask_to_flags)
        key, value = unrepeat_kv(site["key_states"]), unrepeat_kv(site["value_states"])
        if not known_equal(tensor_of(key).shape[1], tensor_of(value).shape[1]):
            key, value = site["key_states"], site["value_states"]
        q, k = tensor_of(site["query"]), tensor_of(key)
        lead = q.dim() - 3  # 1, or the leading dims of N-D attention folded into the batch dim
        details["heads"] = f"{q.shape[lead]}/{k.shape[lead]}"
        if lead > 1:
            details["folded"] = f"{q.dim()}-D, {lead} leading dims into the batch dim"
        out = site.output
        given = kwargs.get("attn_mask")
        kwargs["attn_mask"] = _scaled_mask(graph, site, given)
        if site.has("keep"):
            kwargs["attn_mask"] = _and_kept(graph, site, kwargs["attn_mask"], site["keep"])
        if site.has("drop"):
            keep = insert_call(graph, out, torch.logical_not, (site["drop"],), meta_from=out)
            kwargs["attn_mask"] = _and_kept(graph, site, kwargs["attn_mask"], keep)
        if site.has("keep_factor"):
            kwargs["attn_mask"] = _and_kept(graph, site, kwargs["attn_mask"],
                                            keep_of_factor(graph, out, site["keep_factor"]))
        if site.has("bias"):
            kwargs["attn_mask"] = _with_bias(graph, site, kwargs["attn_mask"])
        mask = kwargs["attn_mask"]
        if site.has("clamp") and clamp_bound(site["clamp"]) > -math.inf and mask is not None \
                and tensor_of(mask).dtype.is_floating_point:
            kwargs["attn_mask"] = insert_call(graph, out, torch.clamp_min, (mask, clamp_bound(site["clamp"])),
                                              meta_from=out)
        if site.has("subtracted"):
            kwargs["attn_mask"] = with_subtracted(graph, out, kwargs["attn_mask"], site["subtracted"])
        per_query = site.has("query_sinks")
        try:
            if lead > 1:
                new = fold_attention(graph, out, attention, site["query"], key, value, kwargs, lead)
            else:
                new = insert_call(graph, out, attention_with_lse if per_query else attention,
                                  (site["query"], key, value), kwargs, meta_from=out)
        except (TypeError, ValueError):
            if isinstance(kwargs["attn_mask"], torch.fx.Node):  # the mask nodes inserted above, if any
                erase_unused(graph, [kwargs["attn_mask"]])
            raise
        if per_query:
            new = rescale_by_query_sinks(graph, out, new, site["query_sinks"])
        replace_metadata_reads(graph, site.replaced, tensor_of(site["scores"]).shape, site["query"], key)
        want = tensor_of(out).dtype
        if tensor_of(new).dtype != want:
            new = insert_call(graph, out, "to", (new, want), meta_from=out)
        out.replace_all_uses_with(new)
        erased |= erase_unused(graph, site.replaced)
        return details
