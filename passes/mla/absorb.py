"""Rewrite Hugging Face's MLA expand-then-attend into one ``kda_compile.ops.mla_attention`` call.

Matches ``expand_kv`` and the attention after it as transformers 5.15 to 5.23 write them in
models/deepseek_v2, models/deepseek_v3 and models/kimi_linear (``*Attention.expand_kv`` and
``forward``; docs/mla.md §2)::

    # latent [B, 1, T, R] and k_rot [B, 1, T, Dr]: what the cache holds (past_key_values.update)
    kv = self.kv_b_proj(latent).view(B, T, -1, Dn + Dv).transpose(1, 2)     # [B, H, T, Dn + Dv]
    k_nope, value_states = torch.split(kv, [Dn, Dv], dim=-1)
    k_rot = k_rot.expand(-1, H, -1, -1)
    key_states = kv.new_empty(B, H, T, Dn + Dr)                              # transformers >= 5.15
    key_states[..., :Dn].copy_(k_nope)
    key_states[..., Dn:].copy_(k_rot)
    #   or: key_states = torch.cat((k_nope, k_rot), dim=-1)                  # transformers <= 5.14
    attn_output = attention(query_states, key_states, value_states, scale=scaling,  # after softmax_attention
                            attn_mask=..., is_causal=...)
    #   or the eager attention itself (softmax(q @ k^T * scaling + mask) @ v) when that rewrite is off
    attn_output = attn_output.transpose(1, 2).reshape(B, Sq, H * Dv)         # kept: free on the op's layout

and replaces ``attn_output`` (the attention's output [B, H, Sq, Dv]) with::

    attn_output = mla_attention(q_nope, q_rope, latent, k_rot, kv_b_proj.weight, scale=scaling,
                                attn_mask=..., is_causal=...)

where ``q_nope`` / ``q_rope`` are the two halves DeepSeek concatenates into ``query_states``
(``torch.cat((q_pass, q_rot), -1)``), or slices ``query_states[..., :Dn]`` / ``[..., Dn:]``
(Kimi-Linear, which never splits its query). The op chooses per call between the absorbed form
(MQA over the latent: decode, speculative steps, short chunks) and the expanded one, so the
decode graph no longer runs ``kv_b_proj`` over the whole cache. The scale is the attention's own
(``scale=`` of the attention call, or the eager graph's ``* scaling`` constant, YaRN's mscale
included), never recomputed; the mask and ``is_causal`` are the attention's as well (for eager
attention, read as ``softmax_attention`` reads them: ``attention_mask_to_flags`` applies).

Left alone, and reported: expanded keys or values used anywhere else, the keys assembled in any
other way, another in-place op between ``kv_b_proj`` and the attention, a ``kv_b_proj`` with a
bias, shapes that do not pair up as MLA, an attention with dropout, softcap, sinks, a sliding
window or an implicit scale (the op has none of these), an eager attention that
``softmax_attention``'s matcher cannot read (e.g. ``output_attentions=True``), arguments the op
refuses. A candidate is a ``linear -> view -> transpose(1, 2) -> split`` chain whose first half
assembles keys (copied into a ``new_empty`` slice, or concatenated with an expanded tensor); a
query's nope/rope split is not one.

The new node calls the public function ``mla_attention`` (argument checks at rewrite time turn a
site the op cannot take into a reported candidate), as ``softmax_attention`` does with
``attention``.
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from kda_compile.ops.mla import explain_mla_path, mla_attention
from kda_compile.passes.attention.lse_softmax import input_name
from kda_compile.passes.attention.patterns import ATTENTION, OUTPUT, PROBABILITY_STAGES, SCORE_STAGES, SCORES
from kda_compile.passes.attention.softmax import Site, attention_arguments, check_site
from kda_compile.passes.attention.spellings import graph_input_behind
from kda_compile.passes.report import LeftAlone, Rewritten
from kda_compile.passes.rewrite import GraphRewrite, RewriteLog
from kda_compile.passes.toolkit.graph_tools import (alias_root, concrete_number, describe_node, erase_unused,
                                                    insert_call, is_inplace, is_tensor_node, known_equal,
                                                    known_shape_equal, module_path, source_line, static_int, tensor_of)
from kda_compile.passes.toolkit.matching import (CAT, EXPAND, GETITEM, RESHAPE, SOFTMAX, TRANSPOSE, Bindings, Call,
                                                 Capture, Const, Seq, family, match_downward, match_upward)

logger = logging.getLogger("kda_compile.passes.mla_absorb")

OP_NAME = "kda_compile.mla_attention"

LINEAR = family("linear", ("input", "weight", "bias"), functions=(torch.nn.functional.linear,),
                defaults={"bias": None})
SPLIT = family("split", ("input", "sections", "dim"), functions=(torch.split,), methods=("split",),
               defaults={"dim": 0}, aliases={"split_size_or_sections": "sections", "split_size": "sections"})
NEW_EMPTY = family("new_empty", ("input", "*size"), methods=("new_empty",),
                   defaults={"dtype": None, "device": None, "layout": None, "pin_memory": False,
                             "requires_grad": False})
COPY_ = family("copy_", ("input", "src", "non_blocking"), methods=("copy_",), defaults={"non_blocking": False})


def _is_last_dim_4d(dim: Any) -> bool:
    return dim in (-1, 3) and not isinstance(dim, bool)


def _swaps_1_2(node: torch.fx.Node) -> bool:
    """``x.transpose(1, 2)`` of a 4-D tensor, however the dims are spelled."""
    b = TRANSPOSE.bind(node)
    dims = {d % 4 if isinstance(d, int) else None for d in (b["dim0"], b["dim1"])} if b is not None else set()
    return dims == {1, 2}


def _two_sizes(sections: Any) -> bool:
    return isinstance(sections, (list, tuple)) and len(sections) == 2 and all(
        static_int(s) is not None for s in sections)


LAST_DIM = Const(where=_is_last_dim_4d)

# kv = kv_b_proj(latent).view(B, T, H, Dn + Dv).transpose(1, 2); torch.split(kv, [Dn, Dv], dim=-1)
EXPAND_KV = Call(SPLIT, name="split", dim=LAST_DIM, sections=Capture("sections", _two_sizes), input=Call(
    TRANSPOSE, name="kv", where=_swaps_1_2, input=Call(
        RESHAPE, name="kv_view", input=Call(
            LINEAR, name="kv_b_proj", bias=Capture("kv_b_bias"), input=Capture("latent", is_tensor_node),
            weight=Capture("kv_b_weight", is_tensor_node)))))
ROPE_OVER_HEADS = Call(EXPAND, name="rope_heads", input=Capture("k_rope", is_tensor_node))
# transformers <= 5.14: torch.cat((k_nope, k_rot.expand(...)), dim=-1)
KEYS_BY_CAT = Call(CAT, name="keys", dim=LAST_DIM, tensors=Seq(Capture("k_nope"), ROPE_OVER_HEADS))
# transformers >= 5.15: keys[..., a:b].copy_(src) into keys = kv.new_empty(...)
SLOT_COPY = Call(COPY_, name="copy", non_blocking=False, input=Call(
    GETITEM, name="slot", input=Call(NEW_EMPTY, name="keys", dtype=None, device=None),
    index=Capture("index")), src=Capture("src"))
QUERY_HALVES = Call(CAT, look_through=True, dim=LAST_DIM, tensors=Seq(Capture("q_nope", is_tensor_node),
                                                                     Capture("q_rope", is_tensor_node)))


def last_dim_slice(index: Any) -> tuple[Any, Any] | None:
    """(start, stop) when ``index`` selects ``[..., start:stop]`` of a 4-D tensor, else None."""
    if not isinstance(index, tuple) or not index or not isinstance(index[-1], slice) or index[-1].step not in (None, 1):
        return None
    head = index[:-1]
    if head in ((Ellipsis,), (slice(None),) * 3):
        return index[-1].start, index[-1].stop
    return None


def getitem_of(node: torch.fx.Node, i: int) -> torch.fx.Node | None:
    found = [u for u in node.users if GETITEM.bind(u) is not None and u.args[1] == i]
    return found[0] if len(found) == 1 else None


class NotMLA(Exception):
    """The candidate does not follow Hugging Face's expand-then-attend; the message says where."""


# ----------------------------------------------------------------------------------------------
# The matched region
# ----------------------------------------------------------------------------------------------
@dataclass
class ExpandKV:
    """expand_kv found in the graph: its inputs, its outputs (keys, value) and the nodes it adds."""

    bindings: Bindings  # EXPAND_KV's captures: split, kv, kv_view, kv_b_proj, latent, kv_b_weight, sections
    k_nope: torch.fx.Node
    value: torch.fx.Node
    keys: torch.fx.Node
    rope_heads: torch.fx.Node
    k_rope: torch.fx.Node
    copies: tuple[torch.fx.Node, ...]  # the two copy_ nodes (empty for the cat form)

    def __getitem__(self, name: str) -> Any:
        return self.bindings[name]

    @property
    def nodes(self) -> tuple[torch.fx.Node, ...]:
        slots = tuple(c.args[0] for c in self.copies)
        return (self.bindings.nodes + (self.k_nope, self.value, self.keys, self.rope_heads) + slots
                + self.copies)


@dataclass
class Consumer:
    """The attention the expanded keys and values feed: its query, the node whose uses the MLA op
    takes over, the nodes replaced with it, and its arguments as ``attention`` keywords."""

    kind: str
    query: torch.fx.Node
    output: torch.fx.Node
    nodes: tuple[torch.fx.Node, ...]
    key_users: frozenset[torch.fx.Node]  # the consumer's own users of the keys
    kwargs: dict


def assemble_keys(k_nope: torch.fx.Node) -> tuple[torch.fx.Node, Bindings] | None:
    """(user, bindings): the user of ``k_nope`` that assembles the keys (KEYS_BY_CAT or SLOT_COPY),
    or None. This is what makes a split an expand_kv candidate (a query's nope/rope split is not)."""
    for user in k_nope.users:
        for pattern, start in ((KEYS_BY_CAT, Bindings({"k_nope": k_nope})), (SLOT_COPY, Bindings({"src": k_nope}))):
            for b in pattern.matches(user, start):
                return user, b
    return None


def read_expand_kv(split: torch.fx.Node, bindings: Bindings) -> ExpandKV | None:
    """The whole expand_kv region from its split; None when the split's first half does not make
    keys (not a candidate); raises NotMLA saying what differs from Hugging Face's expand_kv."""
    k_nope, value = getitem_of(split, 0), getitem_of(split, 1)
    assembly = assemble_keys(k_nope) if k_nope is not None else None
    if assembly is None:
        return None
    if bindings["kv_b_bias"] is not None:
        raise NotMLA(f"kv_b_proj has a bias ({describe_node(bindings['kv_b_bias'])}), "
                     f"which mla_attention does not take")
    others = [u for u in split.users if u is not k_nope and u is not value]
    if value is None or others:
        raise NotMLA(f"the split of the expanded K/V ({describe_node(split)}) is not used as two halves "
                     f"(users: {', '.join(describe_node(u) for u in split.users)})")
    for node in (bindings["kv_b_proj"], bindings["kv_view"], bindings["kv"]):
        fold_static_sizes(node)
    for node in (bindings["kv_b_proj"], bindings["kv_view"]):
        if len(node.users) != 1:
            raise NotMLA(f"the expanded K/V ({describe_node(node)}) are also used by "
                         f"{', '.join(describe_node(u) for u in node.users if u not in bindings.nodes)}")
    user, b = assembly
    # kv.new_empty(...) (the keys) reads only kv's dtype and device
    kv_users = [u for u in bindings["kv"].users if u is not split and u is not b["keys"]]
    if kv_users:
        raise NotMLA(f"the expanded K/V ({describe_node(bindings['kv'])}) are also used by "
                     f"{', '.join(describe_node(u) for u in kv_users)}")
    if len(k_nope.users) != 1:
        raise NotMLA(f"k_nope ({describe_node(k_nope)}) is also used by "
                     f"{', '.join(describe_node(u) for u in k_nope.users if u is not user)}")
    if CAT.bind(user) is not None:
        return ExpandKV(bindings, k_nope, value, b["keys"], b["rope_heads"], b["k_rope"], ())
    return _read_slot_copies(bindings, k_nope, value, b)


def _read_slot_copies(bindings: Bindings, k_nope, value, nope_copy: Bindings) -> ExpandKV:
    keys = nope_copy["keys"]
    rope_copies = []
    for slot in keys.users:
        if slot is nope_copy["slot"] or GETITEM.bind(slot) is None or len(slot.users) != 1:
            continue
        for b in SLOT_COPY.matches(next(iter(slot.users)), Bindings()):
            if b["keys"] is keys:
                rope_copies += [(b, r) for r in ROPE_OVER_HEADS.matches(b["src"], Bindings())]
    if len(rope_copies) != 1:
        raise NotMLA(f"the keys ({describe_node(keys)}) do not receive exactly one copy of the rope key "
                     f"expanded over heads (found {len(rope_copies)})")
    rope_copy, rope = rope_copies[0]
    nope_range, rope_range = last_dim_slice(nope_copy["index"]), last_dim_slice(rope_copy["index"])
    width = tensor_of(k_nope).shape[-1]
    if nope_range is None or rope_range is None or nope_range[0] not in (None, 0) or rope_range[1] is not None \
            or not known_equal(nope_range[1], width) or not known_equal(rope_range[0], width):
        raise NotMLA(f"the copies fill keys[..., {nope_range}] and keys[..., {rope_range}], not "
                     f"keys[..., :Dn] then keys[..., Dn:]")
    for copy in (nope_copy["copy"], rope_copy["copy"]):
        if copy.users:
            raise NotMLA(f"the result of {describe_node(copy)} is used")
    return ExpandKV(bindings, k_nope, value, keys, rope["rope_heads"], rope["k_rope"],
                    (nope_copy["copy"], rope_copy["copy"]))


# ----------------------------------------------------------------------------------------------
# The attention it feeds
# ----------------------------------------------------------------------------------------------
def eager_sites(graph: torch.fx.Graph) -> dict[torch.fx.Node, Site | str]:
    """Eager attentions by their key node: the site softmax_attention's matcher reads, or why not."""
    found: dict[torch.fx.Node, Site | str] = {}
    for softmax in (n for n in graph.nodes if SOFTMAX.bind(n) is not None):
        up = match_upward(SOFTMAX.bind(softmax)["input"], SCORE_STAGES, SCORES)
        if not up:
            continue
        down = match_downward(softmax, PROBABILITY_STAGES, OUTPUT)
        if not down:
            found[up.bindings["key_states"]] = (
                f"the eager attention weights ({describe_node(down.stopped_at)}) do not lead to one value product "
                f"({down.expected}; e.g. output_attentions=True)")
            continue
        site = Site(softmax, up.bindings, down.bindings, frozenset(up.stages + down.stages))
        found[site["key_states"]] = check_site(site) or site
    return found


def find_consumer(region: ExpandKV, eager: dict, mask_to_flags: bool) -> Consumer:
    keys, value = region.keys, region.value
    if len(value.users) != 1:
        raise NotMLA(f"the values ({describe_node(value)}) are used by "
                     f"{', '.join(describe_node(u) for u in value.users)}, expected one attention")
    (user,) = value.users
    bound = ATTENTION.bind(user)
    if bound is not None:
        if bound["key"] is not keys or bound["value"] is not value:
            raise NotMLA(f"{describe_node(user)} does not take the expanded keys and values as its key and value")
        kwargs = {k: bound[k] for k in ATTENTION.defaults}
        return Consumer("kda_compile.attention", bound["query"], user, (user,), frozenset({user}), kwargs)
    site = eager.get(keys)
    if site is None and any(getattr(u.target, "__name__", None) == "dsa_sparse_attention" for u in user.users):
        raise NotMLA("a DSA attention kept in the expanded form: its values feed kda_compile.dsa_sparse_attention "
                     "(the dsa_attention report says why it is not absorbed)")
    if site is None:
        raise NotMLA(f"the values feed {describe_node(user)}, neither kda_compile.ops.attention nor an eager "
                     f"softmax attention")
    if isinstance(site, str):
        raise NotMLA(site)
    if site["value_states"] is not value:
        raise NotMLA(f"the eager attention's values ({describe_node(site['value_states'])}) are not the expanded "
                     f"values (repeated over heads?)")
    kwargs, _ = attention_arguments(site, mask_to_flags)
    key_users = frozenset(u for u in keys.users if TRANSPOSE.bind(u) is not None and set(u.users) == {site["scores"]})
    return Consumer("eager attention", site["query"], site.output, site.replaced, key_users, kwargs)


# ----------------------------------------------------------------------------------------------
# Checks, then the replacement
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    heads: int
    nope: int
    rope: int
    value: int
    rank: Any


def check_region(region: ExpandKV, consumer: Consumer) -> Sizes:
    """Shapes, users and mutations; raises NotMLA when replacing would change the meaning."""
    latent, weight = tensor_of(region["latent"]), tensor_of(region["kv_b_weight"])
    k_rope, query, keys = tensor_of(region.k_rope), tensor_of(consumer.query), tensor_of(region.keys)
    k_nope, value = tensor_of(region.k_nope), tensor_of(region.value)
    single_head = latent.dim() == 4 and known_equal(latent.shape[1], 1)
    if not (single_head or latent.dim() == 3) or weight.dim() != 2:
        raise NotMLA(f"the latent {list(latent.shape)} is not a [B, 1, T, R] cache (or a [B, T, R] latent)")
    b, t, r = latent.shape[0], latent.shape[-2], latent.shape[-1]
    if k_rope is None or k_rope.dim() != 4 or not known_shape_equal(k_rope.shape[:3], (b, 1, t)):
        raise NotMLA(f"the rope key {list(getattr(k_rope, 'shape', []))} is not [B, 1, T, Dr] with the latent's B, T")
    if any(x is None or x.dim() != 4 for x in (k_nope, value, keys, tensor_of(region.rope_heads))):
        raise NotMLA("k_nope, the values, the keys and the rope key over heads are not all 4-D [B, H, T, D]")
    h, dn, dv, dr = keys.shape[1], k_nope.shape[3], value.shape[3], k_rope.shape[3]
    sizes = Sizes(static_int(h), static_int(dn), static_int(dr), static_int(dv), r)
    if None in (sizes.heads, sizes.nope, sizes.rope, sizes.value):
        raise NotMLA("the head count or head dims are not constants")
    expected = {
        "kv_b_proj.weight": (weight.shape, (h * (dn + dv), r)),
        "expanded K/V": (tensor_of(region["kv"]).shape, (b, h, t, dn + dv)),
        "k_nope": (k_nope.shape, (b, h, t, dn)), "values": (value.shape, (b, h, t, dv)),
        "keys": (keys.shape, (b, h, t, dn + dr)),
        "rope key over heads": (tensor_of(region.rope_heads).shape, (b, h, t, dr)),
    }
    for name, (have, want) in expected.items():
        if not known_shape_equal(have, want):
            raise NotMLA(f"the {name} have shape {list(have)}, expected {list(want)} for MLA")
    if query.dim() != 4 or not known_shape_equal((query.shape[0], query.shape[1], query.shape[3]), (b, h, dn + dr)):
        raise NotMLA(f"the query {list(query.shape)} is not [B, H, Sq, Dn + Dr] = [{b}, {h}, Sq, {dn + dr}]")
    if [static_int(s) for s in region["sections"]] != [sizes.nope, sizes.value]:
        raise NotMLA(f"the split sizes {list(region['sections'])} are not [Dn, Dv]")
    stray = [u for u in region.keys.users if u not in consumer.key_users
             and not any(u is c.args[0] for c in region.copies)]
    if stray:
        raise NotMLA(f"the keys ({describe_node(region.keys)}) are also used by {', '.join(map(describe_node, stray))}")
    _check_no_mutation(region, consumer)
    return sizes


def fold_static_sizes(node: torch.fx.Node) -> None:
    """Replace ``node.size(...)`` calls whose result is a static int (or tuple of ints) by that constant: a read of
    the expanded K/V's metadata (HF's DSA code asks their size; a static-shape decode graph knows it) is no use
    of their values, and the rewrite can then drop them."""
    for user in list(node.users):
        if not (user.op == "call_method" and user.target == "size" and user.args[0] is node):
            continue
        value = _static_size(user.meta.get("example_value"))
        if value is None:
            continue
        for reader in list(user.users):
            reader.replace_input_with(user, value)
        if not user.users:
            user.graph.erase_node(user)


def _static_size(value: Any) -> int | tuple[int, ...] | None:
    """A size as Python ints: an int, a SymInt Dynamo specialised (no free symbols), or a tuple / torch.Size of
    those; None for a size that is still symbolic."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    def one(v):
        if isinstance(v, bool):
            return None
        if isinstance(v, int):
            return v
        if isinstance(v, torch.SymInt) and not free_symbols(v):
            return int(v)
        return None

    if isinstance(value, (tuple, list, torch.Size)):
        items = [one(v) for v in value]
        return None if any(i is None for i in items) else tuple(items)
    return one(value)


def _check_no_mutation(region: ExpandKV, consumer: Consumer) -> None:
    """The op reads the latent, rope key, weight and query where the attention ran: nothing may
    write to any tensor they may alias between kv_b_proj and the attention, besides the key copies
    themselves. A write into a tensor of another storage (a cache tensor of another kind: DSA's indexer keys
    and lengths in a static cache, graph inputs or allocated by a prefill) is harmless (graph_tools.alias_root
    tells them apart)."""
    node, end = region["kv_b_proj"], consumer.output
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    if any(order[c] > order[end] for c in region.copies):
        raise NotMLA("a key copy runs after the attention")
    read = None
    while node is not end:
        node = node.next
        if not is_inplace(node) or node in region.copies:
            continue
        written = alias_root(node.args[0]) if node.args else None
        if read is None:
            read = {alias_root(n) for n in (region["latent"], region.k_rope, region["kv_b_weight"], consumer.query)}
        if written is None or written in read:
            raise NotMLA(f"{describe_node(node)} mutates a tensor between kv_b_proj and the attention")


def mla_arguments(consumer: Consumer) -> tuple[dict, dict]:
    """``mla_attention`` keywords from the attention's, and the details the report shows."""
    kw = consumer.kwargs
    if kw.get("sinks") is not None:
        # A sink adds exp(sink[h]) to each softmax denominator: o_sink = o * sigmoid(lse - sink[h]). The op
        # could take it as a `sinks` [H] argument, or return its log-sum-exp for the pass to rescale by.
        sinks = kw["sinks"]
        source = graph_input_behind(sinks) if isinstance(sinks, torch.fx.Node) else None
        named = input_name(source) if source is not None else describe_node(sinks)
        raise NotMLA(f"the attention has per-head sinks ({named}): mla_attention takes no sinks argument and "
                     f"returns no log-sum-exp (either would serve: sinks [H], or lse [B, H, Sq] to rescale o by "
                     f"sigmoid(lse - sinks)); the site stays {consumer.kind} over the keys and values kv_b_proj "
                     f"expands from the whole cache (kda_compile.attention takes the sinks; an absorbed form built "
                     f"on it would fix one form for every call, where mla_attention picks one per call)")
    for name in ("softcap", "sliding_window"):
        if kw.get(name) is not None:
            raise NotMLA(f"the attention has {name}={describe_node(kw[name])}, which mla_attention does not take")
    if kw.get("dropout_p", 0.0) != 0.0:
        raise NotMLA(f"the attention has dropout_p={kw['dropout_p']} (training), which mla_attention does not take")
    if kw.get("scale") is None:
        raise NotMLA("the attention's scale is implicit (scale=None); the rewrite takes the scale only from the graph")
    scale = float(concrete_number(kw["scale"]))
    mask, causal = kw.get("attn_mask"), kw.get("is_causal", False)
    if not isinstance(causal, bool):
        raise NotMLA(f"is_causal is {describe_node(causal)}, not a constant bool")
    mask_value = tensor_of(mask) if mask is not None else None
    mask_kind = "none" if mask is None else ("bool" if mask_value is not None and mask_value.dtype == torch.bool
                                             else "additive") + f" {list(getattr(mask_value, 'shape', []))}"
    return dict(scale=scale, attn_mask=mask, is_causal=causal), dict(scale=round(scale, 6), is_causal=causal,
                                                                     mask=mask_kind)


def traced_form(args: tuple, is_causal: bool) -> str:
    """The form ``mla_attention`` takes at the sizes this graph was traced with (symbolic sizes
    read by their hint, so no guard is added); other sizes may take the other form."""
    def hinted(t):
        sizes = [static_int(s) if static_int(s) is not None else getattr(s.node, "hint", None) for s in t.shape]
        return None if None in sizes else torch.empty(sizes, dtype=t.dtype, device="meta")

    metas = [hinted(tensor_of(a)) for a in args]
    if any(m is None for m in metas):
        return "chosen per call"
    form, _, _ = explain_mla_path(*metas, is_causal=is_causal)
    return form


class MLAAbsorbRewrite(GraphRewrite):
    """Replace every matched MLA expand-then-attend with one call of ``kda_compile.ops.mla_attention``."""

    name = "mla_absorb"
    options = ("attention_mask_to_flags",)

    def apply(self, gm: torch.fx.GraphModule, log: RewriteLog) -> int:
        graph = gm.graph
        candidates = [(n, b) for n in graph.nodes for b in EXPAND_KV.matches(n, Bindings())]
        if not candidates:
            return 0
        eager = eager_sites(graph)
        rewritten, erased = 0, set()
        for split, bindings in candidates:
            if split in erased:
                continue
            where = (module_path(split), source_line(split))
            try:
                region = read_expand_kv(split, bindings)
                if region is None:
                    logger.debug("%s does not split K/V expanded from a latent", split.name)
                    continue
                consumer = find_consumer(region, eager, self.config.attention_mask_to_flags)
                sizes = check_region(region, consumer)
                kwargs, details = mla_arguments(consumer)
                details = self._replace(graph, region, consumer, sizes, kwargs, details, erased)
            except NotMLA as exc:
                log.left_alone.append(LeftAlone(self.name, *where, str(exc)))
                continue
            except (TypeError, ValueError) as exc:  # the op's argument checks (nothing was inserted)
                log.left_alone.append(LeftAlone(self.name, *where, f"{OP_NAME} refuses the arguments: {exc}"))
                continue
            log.rewritten.append(Rewritten(self.name, *where, OP_NAME, details))
            rewritten += 1
        return rewritten

    @staticmethod
    def _replace(graph, region: ExpandKV, consumer: Consumer, sizes: Sizes, kwargs: dict, details: dict,
                 erased: set) -> dict:
        out = consumer.output
        q_nope, q_rope, added = query_halves(graph, consumer.query, sizes.nope, out)
        args = (q_nope, q_rope, region["latent"], region.k_rope, region["kv_b_weight"])
        try:
            new = insert_call(graph, out, mla_attention, args, kwargs, meta_from=out)
        except (TypeError, ValueError):
            for node in reversed(added):  # leave the graph as it was
                graph.erase_node(node)
            raise
        want = tensor_of(out).dtype
        if tensor_of(new).dtype != want:
            new = insert_call(graph, out, "to", (new, want), meta_from=out)
        out.replace_all_uses_with(new)
        erased |= erase_unused(graph, consumer.nodes + region.nodes)
        if region["kv_b_proj"] not in erased:  # every user was checked: this would be a bug
            raise RuntimeError(f"{describe_node(region['kv_b_proj'])} survived the MLA rewrite")
        return dict(heads=sizes.heads, kv_lora_rank=static_int(sizes.rank) or str(sizes.rank), nope=sizes.nope,
                    rope=sizes.rope, v=sizes.value, **details, attention=consumer.kind, path="auto",
                    form_at_trace=traced_form(args, kwargs["is_causal"]))


def query_halves(graph, query: torch.fx.Node, nope: int, before: torch.fx.Node) -> tuple[Any, Any, list]:
    """(q_nope, q_rope, nodes inserted): the halves DeepSeek concatenated into the query
    (``torch.cat((q_pass, q_rot), -1)``), or slices of the query inserted before ``before``."""
    for b in QUERY_HALVES.matches(query, Bindings()):
        if known_equal(tensor_of(b["q_nope"]).shape[-1], nope):
            return b["q_nope"], b["q_rope"], []
    halves = [insert_call(graph, before, operator.getitem, (query, (Ellipsis, part)), meta_from=before)
              for part in (slice(None, nope), slice(nope, None))]
    return halves[0], halves[1], halves
