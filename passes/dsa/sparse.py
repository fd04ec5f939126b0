"""The attention half of the DSA rewrite (passes/dsa/attention.py, docs/dsa-rewrite.md): the attention
Hugging Face runs over a top-k selection turned into a mask (the scatter of ``INDEX_MASK``, or glm5_next's
``COUNTS``), read from the graph and replaced with ``dsa_sparse_attention`` over the indices."""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx

from kda_compile.passes.attention.mask import AND, COMPARE, UNSQUEEZE, WHERE, ZEROS
from kda_compile.passes.attention.patterns import OUTPUT, PROBABILITY_STAGES, SCORE_STAGES, SCORES
from kda_compile.passes.attention.softmax import Site, check_site
from kda_compile.passes.dsa.absorb import insert_absorbed, read_latent_kv
from kda_compile.passes.dsa.patterns import INVERT, MASKED_FILL, NotDSA
from kda_compile.passes.toolkit.graph_tools import (concrete_number, describe_node, erase_unused, insert_call,
                                                    known_equal, known_shape_equal, tensor_of)
from kda_compile.passes.toolkit.matching import SDPA, SOFTMAX, Bindings, match_downward, match_upward, unrepeat_kv

logger = logging.getLogger("kda_compile.passes.dsa_sparse")


@dataclass
class AttentionSite:
    """An attention over a selection turned into a mask: where the mask starts, the indices, the attention's
    inputs (q, k, v as [B, H, S, D]), the node whose uses the op takes over and the nodes it replaces."""

    scatter: torch.fx.Node  # the [B, S, T] selection mask (glm5_next: its counts)
    indices: torch.fx.Node
    base_mask: torch.fx.Node | None  # the [B, 1, S, T] attention mask the selection is combined with
    kind: str  # "eager attention" or "sdpa"
    query: torch.fx.Node
    key: torch.fx.Node
    value: torch.fx.Node
    scale: float | None
    output: torch.fx.Node
    replaced: tuple[torch.fx.Node, ...]
    sinks: torch.fx.Node | None = None  # [H] sink logits (hy_v4), folded in through the op's lse
    valid: torch.fx.Node | None = None  # glm5_next: which indices are in range; the others become -1


def eager_sites_by_mask(graph: torch.fx.Graph) -> dict[torch.fx.Node, Any]:
    """Eager attentions by the additive mask added to their scores: the site, or why it is not one."""
    found: dict[torch.fx.Node, Site | str] = {}
    for softmax in (n for n in graph.nodes if SOFTMAX.bind(n) is not None):
        up = match_upward(SOFTMAX.bind(softmax)["input"], SCORE_STAGES, SCORES)
        if not up or "mask" not in up.bindings.values:
            continue
        down = match_downward(softmax, PROBABILITY_STAGES, OUTPUT)
        if not down:
            found[up.bindings["mask"]] = (f"the eager attention weights ({describe_node(down.stopped_at)}) do not "
                                          f"lead to one value product (e.g. output_attentions=True)")
            continue
        site = Site(softmax, up.bindings, down.bindings, frozenset(up.stages + down.stages))
        found[site["mask"]] = check_site(site) or site
    return found


def _combined_mask(index_mask: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, tuple]:
    """(combined mask, base mask, nodes): ``base.masked_fill(index_mask, min)`` or ``base & ~index_mask``."""
    users = list(index_mask.users)
    if len(users) == 1:
        user = users[0]
        filled = MASKED_FILL.bind(user)
        if filled is not None and filled["mask"] is index_mask and isinstance(filled["value"], float):
            base = tensor_of(filled["input"])
            if base is not None and filled["value"] <= float(torch.finfo(base.dtype).min):
                return user, filled["input"], (user,)
        if INVERT.bind(user) is not None and len(user.users) == 1:
            (anded,) = user.users
            bound = AND.bind(anded)
            if bound is not None and user in (bound["input"], bound["other"]):
                base = bound["other"] if bound["input"] is user else bound["input"]
                return anded, base, (user, anded)
    raise NotDSA(f"the top-k mask ({describe_node(index_mask)}) is not combined with the attention mask by "
                 f"masked_fill(min) or & ~ (users: {', '.join(map(describe_node, users))})")


def read_attention(scatter: torch.fx.Node, bindings: Bindings, eager: dict) -> AttentionSite:
    index_mask = bindings["index_mask"]
    for node in bindings.nodes:
        if node is not index_mask and len(node.users) != 1:
            raise NotDSA(f"the top-k mask ({describe_node(node)}) is also used elsewhere")
    if bindings["template"] is not bindings["indices"]:
        raise NotDSA(f"the top-k mask is shaped after {describe_node(bindings['template'])}, not the indices")
    combined, base, nodes = _combined_mask(index_mask)
    return attention_over(combined, eager, AttentionSite(scatter, bindings["indices"], base, "", *([None] * 5),
                                                          replaced=bindings.nodes + nodes))


def read_pooled_attention(scatter_add: torch.fx.Node, bindings: Bindings, eager: dict) -> AttentionSite:
    """glm5_next's ``build_attention_mask_from_topk`` (see dsa_patterns.COUNTS) and the attention it feeds."""
    counts, indices = bindings["counts"], bindings["indices"]
    value = tensor_of(counts)
    if ZEROS.bind(counts) is None or value.dtype != torch.int32 or value.dim() != 3:
        raise NotDSA(f"the selection counts ({describe_node(counts)}) are not a fresh int32 [B, S, T] torch.zeros")
    others = [u for u in counts.users if u is not scatter_add]
    ne = COMPARE[operator.ne].bind(others[0]) if len(others) == 1 else None
    if ne is None or ne["other"] != 0 or len(others[0].users) != 1:
        raise NotDSA(f"the selection counts are read by {', '.join(map(describe_node, others))}, not one != 0")
    order = {n: i for i, n in enumerate(counts.graph.nodes)}
    if order[others[0]] < order[scatter_add] or scatter_add.users:
        raise NotDSA("the selection counts are read before scatter_add_ fills them")
    (mask,) = others[0].users
    if UNSQUEEZE.bind(mask) is None or UNSQUEEZE.bind(mask)["dim"] != 1:
        raise NotDSA(f"the selection mask ({describe_node(mask)}) is not counts.ne(0).unsqueeze(1)")
    for node in bindings.nodes:
        if node not in (bindings["valid"], scatter_add) and len(node.users) != 1:
            raise NotDSA(f"the selection mask ({describe_node(node)}) is also used elsewhere")
    nodes = bindings.nodes + (counts, others[0], mask)
    combined = mask
    if len(mask.users) == 1 and WHERE.bind(next(iter(mask.users))) is not None:
        where = next(iter(mask.users))  # eager: torch.where(mask, torch.full((), 0.0), finfo.min)
        bound = WHERE.bind(where)
        zero, fill = bound["input"], bound["other"]
        if not (bound["condition"] is mask and isinstance(fill, float)
                and fill <= float(torch.finfo(tensor_of(where).dtype).min)
                and isinstance(zero, torch.fx.Node) and zero.target is torch.full and zero.args[1:2] == (0.0,)):
            raise NotDSA(f"the selection mask becomes {describe_node(where)}, not torch.where(mask, 0, min)")
        combined, nodes = where, nodes + (where, zero)
    site = AttentionSite(counts, indices, None, "", *([None] * 5), replaced=nodes, valid=bindings["valid"])
    site = attention_over(combined, eager, site)
    lt = COMPARE[operator.lt].bind(bindings["lt"])
    if not known_equal(lt["other"], tensor_of(site.key).shape[2]):
        raise NotDSA(f"the indices are checked against {lt['other']}, not the key length")
    return site


def attention_over(combined: torch.fx.Node, eager: dict, site: AttentionSite) -> AttentionSite:
    """``site`` completed with the attention ``combined`` (its mask, and nothing else's) feeds."""
    if len(combined.users) != 1:
        raise NotDSA(f"the combined mask ({describe_node(combined)}) is used by more than one attention")
    (user,) = combined.users
    sdpa = SDPA.bind(user)
    if sdpa is not None:
        if sdpa["attn_mask"] is not combined or sdpa["is_causal"] is not False:
            raise NotDSA(f"{describe_node(user)} does not take the top-k mask as its only mask")
        if sdpa["dropout_p"] != 0.0:
            raise NotDSA(f"the attention has dropout_p={sdpa['dropout_p']} (training), which "
                         f"dsa_sparse_attention does not take")
        scale = None if sdpa["scale"] is None else float(concrete_number(sdpa["scale"]))
        k, v = _unrepeated(sdpa["key"], sdpa["value"])
        return replace(site, kind="sdpa", query=sdpa["query"], key=k, value=v, scale=scale, output=user,
                       replaced=site.replaced + (user,))
    found = eager.get(combined)
    if found is None:
        raise NotDSA(f"the top-k mask feeds {describe_node(user)}, neither an eager softmax attention nor SDPA")
    if isinstance(found, str):
        raise NotDSA(found)
    for stage in ("softcap", "keep"):
        if found.has(stage):
            raise NotDSA(f"the attention has {stage}, which dsa_sparse_attention does not take")
    if found.has("dropout_p") and found["training"] and found["dropout_p"]:
        raise NotDSA(f"the attention has dropout_p={found['dropout_p']} (training), which dsa_sparse_attention "
                     f"does not take")
    scale = 1.0
    if found.has("scale"):
        scale = float(concrete_number(found["scale"]))
    elif found.has("scale_divisor"):
        scale = 1.0 / float(concrete_number(found["scale_divisor"]))
    k, v = _unrepeated(found["key_states"], found["value_states"])
    return replace(site, kind="eager attention", query=found["query"], key=k, value=v, scale=scale,
                   output=found.output, replaced=site.replaced + found.replaced,
                   sinks=found["sinks"] if found.has("sinks") else None)


def _unrepeated(key: torch.fx.Node, value: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    k, v = unrepeat_kv(key), unrepeat_kv(value)
    return (k, v) if known_equal(tensor_of(k).shape[1], tensor_of(v).shape[1]) else (key, value)


def check_attention(site: AttentionSite) -> None:
    q, k, v, idx = (tensor_of(x) for x in (site.query, site.key, site.value, site.indices))
    if any(x is None or x.dim() != 4 for x in (q, k, v)) or idx is None or idx.dim() != 3:
        raise NotDSA("query, keys, values are not 4-D [B, H, S, D] or the indices are not [B, S, topk]")
    b, h, s, d = q.shape
    t = k.shape[2]
    if not (known_equal(k.shape[0], b) and known_equal(k.shape[3], d) and known_equal(v.shape[0], b)
            and known_equal(v.shape[2], t) and known_equal(idx.shape[0], b) and known_equal(idx.shape[1], s)):
        raise NotDSA(f"the shapes do not pair up: query {list(q.shape)}, keys {list(k.shape)}, values "
                     f"{list(v.shape)}, indices {list(idx.shape)}")
    scattered = tensor_of(site.scatter)
    if not known_shape_equal(scattered.shape, (b, s, t)):
        raise NotDSA(f"the top-k mask {list(scattered.shape)} is not [B, S, T] = [{b}, {s}, {t}]")


def _with_sinks(graph, at: torch.fx.Node, o: torch.fx.Node, lse: torch.fx.Node, sinks: torch.fx.Node) -> torch.fx.Node:
    """A per-head sink logit joins the softmax's denominator only: the output over the selected keys is
    scaled by exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink); a row with no key (lse = -inf) stays 0."""
    def call(target, *args):
        return insert_call(graph, at, target, args, meta_from=at)
    gate = call(torch.sigmoid, call(operator.sub, lse, call("float", sinks)))
    return call(operator.mul, o, call("to", call("unsqueeze", gate, -1), tensor_of(o).dtype))


def replace_attention(graph: torch.fx.Graph, site: AttentionSite, indices: torch.fx.Node,
                      dsa_sparse_attention) -> dict:
    """Insert ``dsa_sparse_attention`` over ``indices`` for ``site`` (checked by :func:`refusal` first)."""
    out = site.output
    if site.valid is not None:  # out-of-range indices (a static cache's empty slots) select no key
        indices = insert_call(graph, out, torch.where, (site.valid, indices, -1), meta_from=out)
    absorbed = _replace_absorbed(graph, site, indices, dsa_sparse_attention)
    if isinstance(absorbed, dict):
        return absorbed
    q, k, v = (insert_call(graph, out, "transpose", (x, 1, 2), meta_from=out)
               for x in (site.query, site.key, site.value))
    call = insert_call(graph, out, dsa_sparse_attention, (q, k, v, indices), dict(scale=site.scale), meta_from=out)
    o = insert_call(graph, out, operator.getitem, (call, 0), meta_from=out)
    if site.sinks is not None:
        o = _with_sinks(graph, out, o, insert_call(graph, out, operator.getitem, (call, 1), meta_from=out), site.sinks)
    new = insert_call(graph, out, "transpose", (o, 1, 2), meta_from=out)
    want = tensor_of(out).dtype
    if tensor_of(new).dtype != want:
        new = insert_call(graph, out, "to", (new, want), meta_from=out)
    out.replace_all_uses_with(new)
    erase_unused(graph, site.replaced)
    qv, kv, vv = (tensor_of(x) for x in (site.query, site.key, site.value))
    scale = site.scale if site.scale is not None else float(qv.shape[-1]) ** -0.5
    details = dict(heads=f"{qv.shape[1]}/{kv.shape[1]}", d_qk=int(qv.shape[-1]), d_v=int(vv.shape[-1]),
                   scale=round(scale, 6), attention=site.kind)
    if site.sinks is not None:
        details["sinks"] = True
    details["form"] = f"expanded: {absorbed}"
    return details


def _replace_absorbed(graph: torch.fx.Graph, site: AttentionSite, indices: torch.fx.Node,
                      dsa_sparse_attention) -> dict | str:
    """The attention over the latent cache (passes/dsa/absorb.py), with no kv_b_proj over the cache: the
    report's details, or why the expanded form stays (nothing inserted then)."""
    kv = read_latent_kv(site.query, site.key, site.value, site.replaced)
    if isinstance(kv, str):
        logger.debug("%s keeps the expanded form: %s", site.output.name, kv)
        return kv
    done = insert_absorbed(graph, site.output, site.query, kv, indices, site.scale, site.sinks,
                           dsa_sparse_attention, _with_sinks)
    if isinstance(done, str):
        logger.debug("%s keeps the expanded form: %s", site.output.name, done)
        return f"the absorbed form is refused: {done}"
    new, details = done
    site.output.replace_all_uses_with(new)
    erased = erase_unused(graph, site.replaced + kv.region.nodes)
    if kv.region["kv_b_proj"] not in erased:  # every user was checked: this would be a bug
        raise RuntimeError(f"{describe_node(kv.region['kv_b_proj'])} survived the absorbed DSA rewrite")
    details["attention"] = site.kind
    if site.sinks is not None:
        details["sinks"] = True
    return details
