"""Rewrite Hugging Face's DeepSeek Sparse Attention (DSA) into ``kda_compile.ops.dsa_indexer_topk`` and
``kda_compile.ops.dsa_sparse_attention`` (docs/dsa-rewrite.md).

Matches what transformers 5.23 writes in models/deepseek_v32, glm_moe_dsa, mistral_large4, dots3_note,
hy_v4 and axk2 (``*Indexer.forward`` and the attention's ``forward``), keyed on what the code computes,
not on class names. The indexer's scoring tail::

    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * softmax_scale  # [B, S, H, T]
    scores = F.relu(scores)                                      # (hy_v4: no scale here, folded into weights)
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)                      # [B, S, T]
    index_scores = index_scores.masked_fill(~attention_mask, -inf)   # sdpa: bool mask
    #   or: index_scores = index_scores + attention_mask             # eager: additive mask
    topk_indices = index_scores.topk(min(index_topk, T), dim=-1).indices.to(torch.int32)

becomes (the mask read into flags: the bottom-right causal mask, plus key padding)::

    topk_indices = dsa_indexer_topk(q, k, weights, min(index_topk, T), scale=softmax_scale,
                                    is_causal=True, key_mask=padding)            # -1 = no key

and the selection turned into a mask, then attention over all keys::

    index_mask = topk_indices.new_ones((B, S, T), dtype=torch.bool).scatter(-1, topk_indices.long(), False)
    attention_mask = attention_mask.masked_fill(index_mask.unsqueeze(1), finfo.min)   # eager
    #   or: attention_mask = attention_mask & ~index_mask.unsqueeze(1)                # sdpa
    attn_output = eager_attention_forward(...) / F.scaled_dot_product_attention(...)  # [B, H, S, Dv]

becomes attention over the selected keys only, absorbed where the keys and values are HF's ``expand_kv``
of the latent cache (passes/dsa/absorb.py: ``kv_b_proj`` folded into the query and the output, MQA over the
latent + rope rows, no ``kv_b_proj`` over the cache; prefill and decode)::

    attn_output = dsa_sparse_attention(cat(q_nope @ W_UK, q_rope)^T, cat(latent, k_rot)^T, None,
                                       topk_indices, scale, d_v=kv_lora_rank)[0]^T @ W_UV^T
    #   else the expanded form HF computes (the report's ``form`` says why):
    attn_output = dsa_sparse_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       topk_indices, scale)[0].transpose(1, 2)

glm5_next's pooled indexer returns indices that are already visible-only and -1 padded; its attention
(``build_attention_mask_from_topk``: ``zeros(B, S, T).scatter_add_(-1, indices.clamp(0, T - 1), valid)
.ne(0)``, the selection alone as the mask) becomes the same op over those indices, out-of-range ones -1
(``dsa_patterns.COUNTS``); the indexer itself becomes ``dsa_pooled_indexer_topk`` (``dsa/pooled.py``, run first),
so no [B, S, T] tensor remains there either.

HF's attention sinks (hy_v4) are kept exactly: a sink only adds to the softmax's denominator, so the op's
output is scaled by ``sigmoid(lse - sink)`` from its log-sum-exp.

A layer that reuses another layer's selection ("shared" indexer layers: glm_moe_dsa, mistral_large4,
hy_v4) has only the second half; it is rewritten when the indices it reads come from a rewritten
indexer. The two halves are rewritten together or not at all: our indices pad with -1 where HF's
name masked keys, so HF's scatter cannot take them, and HF's indices name keys the causal mask hides,
so our attention cannot take those. The attention is exactly HF's because the indexer and the
attention read the same mask: HF attends to (top-k) AND (visible), our indices are the top-k of the
visible keys. Without the [B, S, T] mask, the [B, S, H, T] scores and the [B, H, S, T] weights, no
tensor with S x T elements is left in the graph.

A decode step over a static cache (one query per sequence) has a [B, 1, 1, T] mask that says only which keys
exist; it becomes the op's ``key_mask`` with ``is_causal=False`` (``single_query_key_mask``): a bool mask as
is, the condition of a ``torch.where(allowed, 0, min)`` built in the graph, or ``mask == 0`` for a mask
``generate()`` precomputed (docs/cuda-graphs.md, section 6).

Left alone, and reported: a mask the graph does not prove causal (a custom 4-D mask, packed
sequences, a sliding window: the indexer op has no window), scores or weights used elsewhere
(``output_attentions=True``), dropout in training, softcap on the attention, indices used
anywhere besides a rewritable attention, shapes that do not pair up, arguments an op refuses.
Block-sparse DSA variants listed in ``dsa_patterns.BLOCK_SPARSE_MODULES`` are reported as left alone (none in
transformers 5.23: DeepSeek-V4's indexer over compressed keys is ``dsa/compressed.py``'s, which runs after the
attention rewrites and turns their attention into ``compressed_sparse_attention``). MiniMax-M3's block selections become
``block_sparse_attention`` (``dsa/block_sparse.py``, run first: HF's ``build_block_mask`` and the attention
over it). qwen4_exp's QSA indexer is traced through
its branch-free substitute (``dsa/qsa_indexer.py``, switched by this rewrite's Config field): each indexer that
went through it is reported as rewritten into ``qsa_selection_mask``, one traced as written as left alone;
its attention, under the selection mask, is ``softmax_attention``'s.

Runs before ``softmax_attention``, ``sdpa_attention`` and ``mla_absorb``: those would otherwise take
the attention with its dense top-k mask.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from kda_compile.passes.attention.mask import (NEW_ONES, WHERE, MaskMeaning, NotUnderstood, check_fill,
                                               read_additive_mask, read_bool_mask)
from kda_compile.passes.dsa.block_sparse import rewrite_block_sparse
from kda_compile.passes.dsa.patterns import (COUNTS, INDEX_MASK, LONG, SCATTER, SCATTER_ADD_, SELECTION, TOPK, NotDSA,
                                             block_sparse_sites, is_mask_slice)
from kda_compile.passes.dsa.pooled import rewrite_pooled_indexers
from kda_compile.passes.dsa.qsa_indexer import report_qsa_indexers
from kda_compile.passes.dsa.sparse import (AttentionSite, check_attention, eager_sites_by_mask, read_attention,
                                           read_pooled_attention, replace_attention)
from kda_compile.passes.report import LeftAlone, Rewritten
from kda_compile.passes.rewrite import GraphRewrite, RewriteLog
from kda_compile.passes.toolkit.graph_tools import (_example, _fake_mode, concrete_number, describe_node, erase_unused,
                                                    example_value, insert_call, is_tensor_node, known_equal,
                                                    known_shape_equal, module_path, source_line, tensor_of)
from kda_compile.passes.toolkit.matching import GETITEM, Bindings, cast_dtype

logger = logging.getLogger("kda_compile.passes.dsa_attention")

INDEXER_OP, ATTENTION_OP = "kda_compile.dsa_indexer_topk", "kda_compile.dsa_sparse_attention"

# ----------------------------------------------------------------------------------------------
# The indexer: scores -> top-k
# ----------------------------------------------------------------------------------------------
@dataclass
class IndexerSite:
    topk: torch.fx.Node
    indices: torch.fx.Node  # HF's ``.to(torch.int32)`` of the top-k indices
    bindings: Bindings
    mask: torch.fx.Node  # the [B, 1, S, T] attention mask the indexer reads a [B, S, T] slice of
    meaning: MaskMeaning
    consumers: list["AttentionSite"] = field(default_factory=list)

    def __getitem__(self, name: str) -> Any:
        return self.bindings[name]


def read_mask(mask: torch.fx.Node, q_length: Any, kv_length: Any, memo: dict) -> MaskMeaning | str:
    key = (mask, str(q_length), str(kv_length))  # SymInts are not hashable
    if key not in memo:
        value = tensor_of(mask)
        if value is None:
            memo[key] = "the mask is not a tensor"
        else:
            read = read_bool_mask if value.dtype == torch.bool else read_additive_mask
            memo[key] = read(mask, q_length, kv_length)
    return memo[key]


def read_indexer(topk: torch.fx.Node, bindings: Bindings, memo: dict) -> IndexerSite:
    q, k, w = (tensor_of(bindings[n]) for n in ("q", "k", "weights"))
    if q.dim() != 4 or k.dim() != 3 or w.dim() != 3:
        raise NotDSA(f"the indexer's q {list(q.shape)}, k {list(k.shape)}, weights {list(w.shape)} are not "
                     f"[B, S, H, D], [B, T, D], [B, S, H]")
    b, s, h, d = q.shape
    t = k.shape[1]
    if not (known_shape_equal(w.shape, (b, s, h)) and known_equal(k.shape[0], b) and known_equal(k.shape[2], d)):
        raise NotDSA(f"the indexer's q {list(q.shape)}, k {list(k.shape)}, weights {list(w.shape)} do not pair up")
    inside = set(bindings.nodes)
    for node in bindings.nodes:
        if node is topk:
            continue
        others = [u for u in node.users if u not in inside]
        if others:
            raise NotDSA(f"the indexer scores ({describe_node(node)}) are also used by "
                         f"{', '.join(map(describe_node, others))}")
    picked = [u for u in topk.users if GETITEM.bind(u) is not None and u.args[1] == 1]
    if len(picked) != 1 or len(topk.users) != 1:
        raise NotDSA(f"the top-k ({describe_node(topk)}) is used for more than its indices")
    (as_int32,) = picked[0].users if len(picked[0].users) == 1 else (None,)
    if as_int32 is None or cast_dtype(as_int32) != torch.int32:
        raise NotDSA(f"the top-k indices ({describe_node(picked[0])}) are not cast to int32 once")
    mask_slice = bindings["mask_slice"]
    sliced = GETITEM.bind(mask_slice)
    if sliced is None or not is_mask_slice(sliced["index"]) or not is_tensor_node(sliced["input"]):
        raise NotDSA(f"the indexer's mask ({describe_node(mask_slice)}) is not the [B, S, T] slice of the "
                     f"attention mask")
    mask = sliced["input"]
    meaning = read_mask(mask, s, t, memo)
    if isinstance(meaning, str):
        meaning = single_query_key_mask(mask, s, t, topk, memo) or meaning
    if isinstance(meaning, str):
        raise NotDSA(f"the indexer's mask is not proven causal: {meaning}")
    if meaning.sliding_window is not None:
        raise NotDSA(f"the indexer's mask has a sliding window ({meaning.sliding_window}), which "
                     f"dsa_indexer_topk does not take")
    return IndexerSite(topk, as_int32, bindings, mask, meaning)


def _precomputed_mask(mask: torch.fx.Node) -> bool:
    """A graph input that is one of the masks ``generate()`` builds outside the model for a static cache
    (``attention_mask`` passed as a dict per attention kind, made by HF's mask functions: 0 where a key is
    attended, the dtype's minimum elsewhere)."""
    source = getattr(mask, "_dynamo_source", None)
    name = getattr(source, "name", "") if source is not None else ""
    return mask.op == "placeholder" and "['attention_mask']['" in str(name)


def single_query_key_mask(mask: torch.fx.Node, q_length: Any, kv_length: Any, before: torch.fx.Node,
                          memo: dict) -> MaskMeaning | None:
    """A decode step's mask as the op's key mask: with one query per sequence, a [B, 1, 1, T] mask says only
    which keys may be selected (the keys past the query are unwritten cache slots it masks). Taken for a bool
    mask, and for an additive one when it is a mask ``generate()`` precomputed (0 / min only, so ``== 0`` is
    exactly "attended"); None otherwise. The bool [B, 1, 1, T] node is made once per mask."""
    value = tensor_of(mask)
    if value is None or not known_equal(q_length, 1) or value.dim() != 4:
        return None
    if not (known_equal(value.shape[1], 1) and known_equal(value.shape[2], 1) and known_equal(value.shape[3], kv_length)):
        return None
    condition = _where_condition(mask) if value.dtype != torch.bool else None
    if value.dtype != torch.bool and condition is None and not _precomputed_mask(mask):
        return None
    key = ("single query", mask)
    if key not in memo:
        if value.dtype == torch.bool:
            allowed = mask
        elif condition is not None:  # torch.where(allowed, 0, min) built in the graph from the cache's length
            allowed = condition
        else:
            allowed = insert_call(mask.graph, before, torch.eq, (mask, 0), meta_from=before)
        memo[key] = MaskMeaning(causal=False, sliding_window=None, key_padding=allowed)
    return memo[key]


def _where_condition(mask: torch.fx.Node) -> torch.fx.Node | None:
    """The bool [B, 1, 1, T] condition of an additive ``torch.where(allowed, 0, min)`` mask, or None."""
    where = WHERE.bind(mask)
    if where is None:
        return None
    try:
        check_fill(where, mask)
    except NotUnderstood:
        return None
    condition = tensor_of(where["condition"])
    if condition is None or condition.dtype != torch.bool or not known_shape_equal(condition.shape,
                                                                                   tensor_of(mask).shape):
        return None
    return where["condition"]


def _key_mask(graph: torch.fx.Graph, meaning: MaskMeaning, before: torch.fx.Node) -> torch.fx.Node | None:
    """The [B, 1, 1, T] key-padding mask (True = attend) as the op's [B, T] ``key_mask``."""
    if meaning.key_padding is None:
        return None
    return insert_call(graph, before, "flatten", (meaning.key_padding, 1), meta_from=before)


def indexer_call(graph: torch.fx.Graph, site: IndexerSite) -> tuple[tuple, dict]:
    """``dsa_indexer_topk``'s arguments for ``site`` (inserting the key-mask view and, if needed, casts)."""
    q, k = site["q"], site["k"]
    if tensor_of(q).dtype != tensor_of(k).dtype:  # e.g. fp32 keys beside bf16 queries: both scored in fp32
        q, k = (insert_call(graph, site.topk, "float", (x,), meta_from=site.topk) for x in (q, k))
    kwargs = dict(scale=float(concrete_number(site.bindings.get("scale", 1.0))), is_causal=site.meaning.causal,
                  key_mask=_key_mask(graph, site.meaning, site.topk))
    return (q, k, site["weights"], site["topk_k"]), kwargs


def replace_indexer(graph: torch.fx.Graph, site: IndexerSite, args: tuple, kwargs: dict,
                    dsa_indexer_topk) -> tuple[torch.fx.Node, dict]:
    new = insert_call(graph, site.topk, dsa_indexer_topk, args, kwargs, meta_from=site.topk)
    site.indices.replace_all_uses_with(new)
    erase_unused(graph, (site.indices,) + site.bindings.nodes)
    qv = tensor_of(site["q"])
    return new, dict(heads=int(qv.shape[2]), head_dim=int(qv.shape[3]), topk=str(example_value(site["topk_k"])),
                     scale=round(kwargs["scale"], 6), is_causal=kwargs["is_causal"],
                     key_mask="padding [B, T]" if kwargs["key_mask"] is not None else "none")


def refusal(fn, args: tuple, kwargs: dict) -> str | None:
    """Why ``fn`` refuses these arguments (its checks, run on the example values), or None."""
    ex_args, ex_kwargs = _example(args), {k: _example(v) for k, v in kwargs.items()}
    try:
        with _fake_mode(list(ex_args) + list(ex_kwargs.values())):
            fn(*ex_args, **ex_kwargs)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


# ----------------------------------------------------------------------------------------------
# The rewrite
# ----------------------------------------------------------------------------------------------
def _dsa_ops():
    """The two ops, or the reason they cannot be used (imported late: the pass must load without them)."""
    try:
        from kda_compile.ops import dsa_indexer_topk, dsa_sparse_attention
    except ImportError as exc:
        return None, f"kda_compile.ops has no DSA ops ({exc})"
    return (dsa_indexer_topk, dsa_sparse_attention), None


def _block_sparse_op():
    try:
        from kda_compile.ops import block_sparse_attention
    except ImportError:
        return None
    return block_sparse_attention


def _pooled_op():
    try:
        from kda_compile.ops import dsa_pooled_indexer_topk
    except ImportError:
        return None
    return dsa_pooled_indexer_topk


class DSAAttentionRewrite(GraphRewrite):
    """Replace each matched DSA indexer with ``dsa_indexer_topk`` and each attention over its top-k mask with
    ``dsa_sparse_attention``."""

    name = "dsa_attention"

    def apply(self, gm: torch.fx.GraphModule, log: RewriteLog) -> int:
        graph = gm.graph
        for path, reason in block_sparse_sites(graph).items():
            log.left_alone.append(LeftAlone(self.name, path, "", f"block-sparse DSA, not rewritten: {reason}"))
        report_qsa_indexers(graph, self.name, log)
        block_sparse = rewrite_block_sparse(graph, _block_sparse_op(), self.name, log,
                                            single_query_key_mask)
        pooled = block_sparse + rewrite_pooled_indexers(graph, _pooled_op(), self.name, log)
        topks = [(n, b) for n in graph.nodes if TOPK.bind(n) is not None for b in SELECTION.matches(n, Bindings())]
        scatters = [(n, b) for n in graph.nodes if SCATTER.bind(n) is not None and len(n.users) == 1
                    for b in INDEX_MASK.matches(next(iter(n.users)), Bindings())]
        counts = [(n, b) for n in graph.nodes if SCATTER_ADD_.bind(n) is not None
                  for b in COUNTS.matches(n, Bindings())]
        if not topks and not scatters and not counts:
            return pooled
        ops, missing = _dsa_ops()
        rewritten = pooled + (self._pooled(graph, counts, ops, missing, log) if counts else 0)
        memo: dict = {}
        indexers: dict[torch.fx.Node, IndexerSite] = {}
        for topk, bindings in self._first_per_node(topks):
            where = (module_path(topk), source_line(topk))
            if missing:
                log.left_alone.append(LeftAlone(self.name, *where, missing))
                continue
            try:
                site = read_indexer(topk, bindings, memo)
            except NotDSA as exc:
                log.left_alone.append(LeftAlone(self.name, *where, str(exc)))
                continue
            indexers[site.indices] = site
        eager = eager_sites_by_mask(graph) if scatters else {}
        refused: dict[torch.fx.Node, str] = {}
        for scatter, bindings in self._first_per_node(scatters, key=lambda b: b["scatter"]):
            where = (module_path(scatter), source_line(scatter))
            try:
                site = read_attention(scatter, bindings, eager)
                check_attention(site)
                self._check_indices(site, indexers, memo)
            except NotDSA as exc:
                log.left_alone.append(LeftAlone(self.name, *where, str(exc)))
                refused.setdefault(bindings["indices"], str(exc))
                continue
            indexers[site.indices].consumers.append(site)
        return rewritten + self._replace_all(graph, indexers, refused, ops, log)

    def _pooled(self, graph, found: list, ops, missing: str | None, log: RewriteLog) -> int:
        """glm5_next: its own indexer's selection (visible keys only, -1 padded) feeds the op directly."""
        eager, rewritten = eager_sites_by_mask(graph), 0
        for scatter_add, bindings in self._first_per_node(found):
            where = (module_path(scatter_add), source_line(scatter_add))
            try:
                if missing:
                    raise NotDSA(missing)
                site = read_pooled_attention(scatter_add, bindings, eager)
                check_attention(site)
                why = refusal(_attention_on_heads_last(ops[1]), (site.query, site.key, site.value, site.indices),
                              dict(scale=site.scale))
                if why is not None:
                    raise NotDSA(f"{ATTENTION_OP} refuses the arguments: {why}")
            except NotDSA as exc:
                log.left_alone.append(LeftAlone(self.name, *where, str(exc)))
                continue
            source = module_path(site.indices)
            details = replace_attention(graph, site, site.indices, ops[1])
            details["indices"] = ("pooled indexer" if source.startswith(where[0] + ".")
                                  else f"pooled indexer, shared: {source}")
            log.rewritten.append(Rewritten(self.name, *where, ATTENTION_OP, details))
            rewritten += 1
        return rewritten

    @staticmethod
    def _first_per_node(found, key=None):
        seen = set()
        for node, bindings in found:
            anchor = key(bindings) if key else node
            if anchor not in seen:
                seen.add(anchor)
                yield anchor, bindings

    @staticmethod
    def _check_indices(site: AttentionSite, indexers: dict, memo: dict) -> None:
        indexer = indexers.get(site.indices)
        if indexer is None:
            raise NotDSA(f"the top-k indices ({describe_node(site.indices)}) do not come from a DSA indexer this "
                         f"rewrite takes (HF's indices name masked keys; dsa_sparse_attention would attend to them)")
        if site.base_mask is indexer.mask:
            return
        q_len, kv_len = tensor_of(site.query).shape[2], tensor_of(site.key).shape[2]
        meaning = read_mask(site.base_mask, q_len, kv_len, memo)
        if not (isinstance(meaning, MaskMeaning) and meaning.causal == indexer.meaning.causal
                and meaning.sliding_window is None and meaning.key_padding is indexer.meaning.key_padding):
            raise NotDSA(f"the attention's mask ({describe_node(site.base_mask)}) is not the mask the indexer "
                         f"selected under: {meaning}")

    def _replace_all(self, graph, indexers: dict, refused: dict, ops, log: RewriteLog) -> int:
        rewritten = 0
        for indices, site in indexers.items():
            where = (module_path(site.topk), source_line(site.topk))
            why = self._why_not(indices, site, refused)
            if why is None:
                args, kwargs = indexer_call(graph, site)
                why = refusal(ops[0], args, kwargs)
                why = why and f"{INDEXER_OP} refuses the arguments: {why}"
                for consumer in site.consumers if why is None else ():
                    why = refusal(_attention_on_heads_last(ops[1]), (consumer.query, consumer.key, consumer.value,
                                                                     indices), dict(scale=consumer.scale))
                    why = why and f"{ATTENTION_OP} refuses the arguments of {module_path(consumer.output)}: {why}"
                if why is not None:
                    erase_unused(graph, [a for a in (*args, kwargs["key_mask"]) if isinstance(a, torch.fx.Node)
                                         and a not in (site["q"], site["k"], site["weights"], site["topk_k"])])
            if why is not None:
                log.left_alone.append(LeftAlone(self.name, *where, f"indexer kept with its attention: {why}"))
                log.left_alone.extend(LeftAlone(self.name, module_path(c.output), source_line(c.output),
                                                f"attention kept with its indexer: {why}") for c in site.consumers)
                continue
            new_indices, details = replace_indexer(graph, site, args, kwargs, ops[0])
            log.rewritten.append(Rewritten(self.name, *where, INDEXER_OP, details))
            rewritten += 1
            for consumer in site.consumers:
                at = (module_path(consumer.output), source_line(consumer.output))
                details = replace_attention(graph, consumer, new_indices, ops[1])
                details["indices"] = "own indexer" if at[0] == where[0].rsplit(".", 1)[0] else f"shared: {where[0]}"
                log.rewritten.append(Rewritten(self.name, *at, ATTENTION_OP, details))
                rewritten += 1
        return rewritten

    @staticmethod
    def _why_not(indices: torch.fx.Node, site: IndexerSite, refused: dict) -> str | None:
        if indices in refused:
            return refused[indices]
        if not site.consumers:
            return "the indices feed no attention this rewrite takes"
        scatters = {c.scatter for c in site.consumers}
        stray = [u for u in indices.users if not (NEW_ONES.bind(u) is not None and u.args[0] is indices)
                 and not (LONG.bind(u) is not None and set(u.users) <= scatters)]
        if stray:
            return f"the indices are also used by {', '.join(map(describe_node, stray))}"
        return None


def _attention_on_heads_last(dsa_sparse_attention):
    def call(q, k, v, indices, scale):
        return dsa_sparse_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), indices, scale=scale)
    return call
