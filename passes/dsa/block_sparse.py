"""MiniMax-M3's sparse attention layers rewritten into ``kda_compile.ops.block_sparse_attention``
(docs/block-sparse.md, section "The MiniMax-M3 rewrite"); part of the DSA rewrite (passes/dsa/attention.py).

Hugging Face's ``MiniMaxM3VLAttention.forward`` (models/minimax_m3_vl, transformers 5.23) runs its indexer, then,
for eager and SDPA attention, ``MiniMaxM3VLIndexer.build_block_mask``::

    safe = block_indices.masked_fill(block_indices < 0, NB)             # NB = ceil(T / block_size)
    bias = block_indices.new_full((B, G, Sq, NB + 1), -inf, dtype=dtype); bias.scatter_(-1, safe, 0.0)
    block_keep = (bias[..., :NB] == 0.0).repeat_interleave(block_size, dim=-1)[..., :T]
    block_keep = block_keep.repeat_interleave(H // G, dim=1)            # [B, H, Sq, T]
    keep = block_keep & (mask == 0)            # the model's 4-D mask (additive; a bool mask as it is)
    #   or, without one: keep = block_keep & ~(arange(T)[None, None, None, :] > position_ids[:, None, :, None])
    mask = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, finfo.min)

and dense attention over that mask (eager's matmul-softmax-matmul or SDPA, the keys repeated per group). This
module reads that subgraph back (:func:`read_block_mask`), and the attention it feeds (DSA's reader:
``sparse.attention_over``), and puts in their place::

    out = block_sparse_attention(q, k, v, block_indices, block_size=block_size, scale=scale,
                                 query_positions=position_ids,   # without a mask; with one: None
                                 key_padding_mask=key_padding)   # the mask's [B, T] padding, or None

The model's mask must be proved the bottom-right causal mask, with or without key padding
(``attention.mask.read_additive_mask`` / ``read_bool_mask``): that is exactly the op's default query positions
``T - Sq + i`` and its ``key_padding_mask``; or, for one query (a static cache's decode step), a [B, 1, 1, T]
mask of the keys it may see (the DSA rewrite's ``single_query_key_mask``). Anything else (a mask passed in by
the caller, packed sequences, a prefill into a static cache, whose queries are not the last Sq slots) keeps HF's
dense-masked attention, reported with the reason. Every node of ``build_block_mask`` is erased: no
[B, H, Sq, T] tensor is left. Rows that see no key, which only key padding makes (without it every selection
holds a block whose first slot the query sees), keep HF's value there (:func:`hf_rows_without_keys`, inserted
only with a ``key_padding_mask``: it reads every value of the cache).
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx

from kda_compile.passes.attention.mask import (AND, ARANGE, COMPARE, ZEROS, MaskMeaning, read_additive_mask,
                                               read_bool_mask)
from kda_compile.passes.dsa.patterns import INVERT, MASKED_FILL, NEW_FULL, SCATTER_, NotDSA
from kda_compile.passes.dsa.sparse import AttentionSite, attention_over, eager_sites_by_mask
from kda_compile.passes.report import LeftAlone, Rewritten
from kda_compile.passes.toolkit.graph_tools import (describe_node, erase_unused, insert_call, known_equal,
                                                    module_path, source_line, static_int, tensor_of)
from kda_compile.passes.toolkit.matching import GETITEM, REPEAT_INTERLEAVE

logger = logging.getLogger("kda_compile.passes.dsa_block_sparse")

OP = "kda_compile.block_sparse_attention"
HF_FILE = "modeling_minimax_m3_vl.py"  # where build_block_mask is (a copy elsewhere is not recognised)

EQ, LT, GT = COMPARE[operator.eq], COMPARE[operator.lt], COMPARE[operator.gt]


@dataclass
class BlockMask:
    """HF's ``build_block_mask`` as found in a graph: its output, its inputs and its nodes."""

    output: torch.fx.Node  # the [B, H, Sq, T] additive mask
    indices: torch.fx.Node  # the indexer's block_indices [B, n_idx, Sq, K]
    block_size: int
    heads_per_selection: int  # HF's repeat_interleave of the selections over the query heads
    base: torch.fx.Node | None  # the model's 4-D mask it was combined with, or None
    positions: torch.fx.Node | None  # without a base mask: position_ids [B, Sq], the causal bound
    nodes: tuple[torch.fx.Node, ...]


def _bind(fam, node: Any, what: str) -> dict:
    bound = fam.bind(node)
    if bound is None:
        raise NotDSA(f"{what} ({describe_node(node)}) is not HF's build_block_mask: expected {fam.name}")
    return bound


def _slice_to(index: Any) -> Any:
    """``n`` for the index ``(..., :n)``, else None."""
    if (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice)
            and index[1].start is None and index[1].step is None):
        return index[1].stop
    return None


def _positions_bound(node: torch.fx.Node, keys: Any) -> torch.fx.Node:
    """``position_ids`` of ``~(arange(T)[None, None, None, :] > position_ids[:, None, :, None])``."""
    future = _bind(GT, _bind(INVERT, node, "the causal bound")["input"], "the causal bound")
    slots, rows = _bind(GETITEM, future["input"], "the key slots"), _bind(GETITEM, future["other"], "the positions")
    arange = ARANGE.bind(slots["input"])
    full = slice(None, None, None)
    if (arange is None or not known_equal(arange["end"], keys) or slots["index"] != (None, None, None, full)
            or rows["index"] != (full, None, full, None)):
        raise NotDSA(f"the causal bound ({describe_node(node)}) is not arange(T) > position_ids")
    return rows["input"]


def read_block_mask(output: torch.fx.Node) -> BlockMask:
    """The ``build_block_mask`` ending at ``output`` (``zeros(...).masked_fill(~keep, min)``); NotDSA if not."""
    filled = _bind(MASKED_FILL, output, "the block mask")
    zeros, keep = filled["input"], _bind(INVERT, filled["mask"], "the block mask's condition")["input"]
    value = tensor_of(output)
    if (ZEROS.bind(zeros) is None or value is None or value.dim() != 4 or not isinstance(filled["value"], float)
            or filled["value"] > float(torch.finfo(value.dtype).min)):
        raise NotDSA(f"{describe_node(output)} is not zeros([B, H, Sq, T]).masked_fill(~keep, finfo.min)")
    anded = _bind(AND, keep, "the kept keys")
    heads = REPEAT_INTERLEAVE.bind(anded["input"])
    block_keep, other = (anded["input"], anded["other"]) if heads is not None else (anded["other"], anded["input"])
    heads = _bind(REPEAT_INTERLEAVE, block_keep, "the kept blocks per head")
    cut = _bind(GETITEM, heads["input"], "the kept keys")
    keys = tensor_of(output).shape[-1]
    slots = _bind(REPEAT_INTERLEAVE, cut["input"], "the kept blocks per key")
    flags = _bind(EQ, slots["input"], "the kept blocks")
    sliced = _bind(GETITEM, flags["input"], "the kept blocks")
    bias = sliced["input"]
    full = _bind(NEW_FULL, bias, "the block bias")
    block_size, per_head = static_int(slots["repeats"]), static_int(heads["repeats"])
    if (heads["dim"] != 1 or slots["dim"] not in (-1, 3) or block_size is None or per_head is None
            or not known_equal(_slice_to(cut["index"]), keys) or flags["other"] != 0.0
            or full["fill_value"] != float("-inf")):
        raise NotDSA(f"{describe_node(output)} does not expand the selected blocks as HF's build_block_mask")
    indices = full["input"]
    blocks = -(-keys // block_size)
    scatters = [u for u in bias.users if u is not flags["input"]]
    fill = SCATTER_.bind(scatters[0]) if len(scatters) == 1 else None
    safe = MASKED_FILL.bind(fill["index"]) if fill is not None else None
    below = LT.bind(safe["mask"]) if safe is not None else None
    if (fill is None or fill["dim"] not in (-1, 3) or fill["value"] != 0.0 or scatters[0].users
            or safe["input"] is not indices or not known_equal(safe["value"], blocks) or below is None
            or below["input"] is not indices or below["other"] != 0 or not known_equal(_slice_to(sliced["index"]),
                                                                                        blocks)):
        raise NotDSA(f"the block bias ({describe_node(bias)}) is not HF's scatter of the selected blocks")
    nodes = (output, zeros, filled["mask"], keep, block_keep, heads["input"], cut["input"], slots["input"],
             flags["input"], bias, scatters[0], fill["index"], safe["mask"])
    if EQ.bind(other) is not None and EQ.bind(other)["other"] == 0:
        return BlockMask(output, indices, block_size, per_head, EQ.bind(other)["input"], None, nodes + (other,))
    value = tensor_of(other)
    if INVERT.bind(other) is not None:
        return BlockMask(output, indices, block_size, per_head, None, _positions_bound(other, keys), nodes)
    if value is not None and value.dtype == torch.bool:
        return BlockMask(output, indices, block_size, per_head, other, None, nodes)
    raise NotDSA(f"the selection is combined with {describe_node(other)}, neither the model's mask nor HF's "
                 f"causal bound")


def _key_padding(graph: torch.fx.Graph, at: torch.fx.Node, site: AttentionSite, mask: BlockMask, memo: dict,
                 single_query: Callable | None) -> tuple[torch.fx.Node | None, list[torch.fx.Node]]:
    """The op's ``key_padding_mask`` ([B, T] bool, or None) for the model's mask, and the nodes inserted for it;
    NotDSA when that mask is neither the bottom-right causal one (with or without key padding) nor, for one query,
    a mask ``single_query`` (the DSA rewrite's ``single_query_key_mask``) reads as the keys it may see."""
    q_len, keys = tensor_of(site.query).shape[2], tensor_of(site.key).shape[2]
    base = mask.base
    key = (base, str(q_len), str(keys))
    if key not in memo:
        read = read_bool_mask if tensor_of(base).dtype == torch.bool else read_additive_mask
        memo[key] = read(base, q_len, keys)
    meaning = memo[key]
    if not isinstance(meaning, MaskMeaning) and single_query is not None:
        meaning = single_query(base, q_len, keys, at, memo) or meaning
    if not isinstance(meaning, MaskMeaning):
        raise NotDSA(f"the model's mask ({describe_node(base)}) is not one block_sparse_attention expresses: "
                     f"{meaning}")
    # one query (a decode step) sees every slot its mask allows: the default position T - 1 bounds nothing
    if not (meaning.causal or known_equal(q_len, 1)) or meaning.sliding_window is not None:
        raise NotDSA(f"the model's mask ({describe_node(base)}) is not the bottom-right causal mask: causal="
                     f"{meaning.causal}, sliding_window={meaning.sliding_window}")
    if meaning.key_padding is None:
        return None, []
    full = slice(None, None, None)
    row = insert_call(graph, at, operator.getitem, (meaning.key_padding, (full, 0, 0, full)), meta_from=at)
    batch = tensor_of(site.query).shape[0]
    if known_equal(tensor_of(row).shape[0], batch):
        return row, [row]
    return insert_call(graph, at, "expand", (row, batch, keys), meta_from=at), [row]


def _per_group(graph: torch.fx.Graph, at: torch.fx.Node, site: AttentionSite, mask: BlockMask):
    """(key, value, block_indices) with one selection per KV group: HF's selections and groups agree, or one is
    a multiple of the other (the selections repeated per group, or the groups per selection: both exact)."""
    heads, groups = tensor_of(site.query).shape[1], tensor_of(site.key).shape[1]
    selections = tensor_of(mask.indices).shape[1]
    if not known_equal(selections * mask.heads_per_selection, heads):
        raise NotDSA(f"{selections} selections x {mask.heads_per_selection} heads each are not the {heads} "
                     f"query heads")
    ratio_groups, ratio_selections = static_int(groups // selections), static_int(selections // groups)
    if known_equal(selections, groups):
        return site.key, site.value, mask.indices
    if ratio_groups and known_equal(ratio_groups * selections, groups):
        indices = insert_call(graph, at, "repeat_interleave", (mask.indices, ratio_groups), dict(dim=1),
                              meta_from=at)
        return site.key, site.value, indices
    if ratio_selections and known_equal(ratio_selections * groups, selections):
        key, value = (insert_call(graph, at, "repeat_interleave", (x, ratio_selections), dict(dim=1), meta_from=at)
                      for x in (site.key, site.value))
        return key, value, mask.indices
    raise NotDSA(f"{selections} block selections and {groups} KV groups: neither divides the other")


def rewrite_block_sparse(graph: torch.fx.Graph, op: Callable | None, rewrite: str, log,
                         single_query: Callable | None = None) -> int:
    """Replace every MiniMax-M3 block-masked attention of ``graph`` by ``op`` (block_sparse_attention, None when
    the ops lack it); log each site as rewritten or left alone (with the reason, also logged). Returns the sites
    rewritten. ``single_query(mask, Sq, T, before, memo)``: a decode step's [B, 1, 1, T] mask (a static cache's)
    as a ``MaskMeaning`` of the keys it allows, or None (the DSA rewrite's reader, passed in: it imports this
    module)."""
    outputs = [n for n in graph.nodes if _from_build_block_mask(n)]
    eager = eager_sites_by_mask(graph) if outputs else {}
    rewritten, memo = 0, {}
    for output in outputs:
        where = (module_path(output), source_line(output))
        try:
            details = _replace(graph, output, op, eager, memo, single_query)
        except NotDSA as exc:
            logger.info("%s (%s) keeps HF's dense-masked attention: %s", *where, exc)
            log.left_alone.append(LeftAlone(rewrite, *where, f"block-sparse attention kept dense: {exc}"))
            continue
        log.rewritten.append(Rewritten(rewrite, *where, OP, details))
        rewritten += 1
    return rewritten


def _replace(graph: torch.fx.Graph, output: torch.fx.Node, op: Callable | None, eager: dict, memo: dict,
             single_query: Callable | None) -> dict:
    """Put ``op`` in place of the attention over the block mask ``output``; the report's details. NotDSA, with
    the graph as it was, when the site is not one the op computes."""
    if op is None:
        raise NotDSA("kda_compile.ops has no block_sparse_attention")
    mask = read_block_mask(output)
    site = attention_over(output, eager, AttentionSite(output, mask.indices, mask.base, "", *([None] * 5),
                                                        replaced=mask.nodes))
    if site.sinks is not None:
        raise NotDSA("the attention has sinks, which block_sparse_attention does not take")
    at, inserted = site.output, []
    try:
        padding, inserted = ((None, []) if mask.base is None
                             else _key_padding(graph, at, site, mask, memo, single_query))
        key, value, indices = _per_group(graph, at, site, mask)
        inserted += [n for n in (key, value, indices) if n not in (site.key, site.value, mask.indices)]
        kwargs = dict(block_size=mask.block_size, scale=site.scale, query_positions=mask.positions,
                      key_padding_mask=padding)
        try:
            out = insert_call(graph, at, op, (site.query, key, value, indices), kwargs, meta_from=at)
        except (TypeError, ValueError) as exc:
            raise NotDSA(f"{OP} refuses the arguments: {exc}") from exc
    except NotDSA:
        erase_unused(graph, inserted)
        raise
    if padding is not None:  # only key padding can hide every selected key of a row (hf_rows_without_keys)
        out = insert_call(graph, at, hf_rows_without_keys, (out, value, indices, mask.block_size, mask.positions,
                                                            padding), meta_from=at)
    if tensor_of(out).dtype != tensor_of(at).dtype:
        out = insert_call(graph, at, "to", (out, tensor_of(at).dtype), meta_from=at)
    at.replace_all_uses_with(out)
    erase_unused(graph, site.replaced)
    q, k, topk = tensor_of(site.query), tensor_of(site.key), tensor_of(mask.indices).shape[-1]
    return dict(heads=f"{q.shape[1]}/{k.shape[1]}", block_size=mask.block_size, topk=static_int(topk) or str(topk),
                scale=round(site.scale if site.scale is not None else float(q.shape[-1]) ** -0.5, 6),
                attention=site.kind, positions="position_ids" if mask.positions is not None else "last Sq slots",
                key_padding=padding is not None)


def hf_rows_without_keys(out: torch.Tensor, value: torch.Tensor, block_indices: torch.Tensor, block_size: int,
                         query_positions: torch.Tensor | None,
                         key_padding_mask: torch.Tensor | None) -> torch.Tensor:
    """``out`` [B, H, Sq, Dv] of ``block_sparse_attention`` with each row that sees no key replaced by HF's value
    there: the mean of every value of its group (HF's additive ``finfo.min`` mask leaves every score equal to
    ``finfo.min``, so its softmax is uniform over the T keys). The op gives 0 on such rows. HF's indexer makes
    them under left padding: a query whose content position lies in a block of padding slots selects only
    that block. Which selected block holds a visible key is read from each block's first unpadded slot, not
    from the keys: O(B * T + B * G * Sq * K); HF's value, the mean, reads every value: O(B * G * T * Dv)."""
    batch, heads, queries, _ = out.shape
    groups, keys = value.shape[1], value.shape[2]
    blocks = -(-keys // block_size)
    slots = torch.arange(blocks * block_size, device=out.device)
    if key_padding_mask is None:
        first = (torch.arange(blocks, device=out.device) * block_size).expand(batch, blocks)
    else:
        unpadded = torch.nn.functional.pad(key_padding_mask, (0, blocks * block_size - keys), value=False)
        first = torch.where(unpadded, slots, blocks * block_size).view(batch, blocks, block_size).amin(-1)
    if query_positions is None:
        query_positions = torch.arange(keys - queries, keys, device=out.device).expand(batch, queries)
    chosen = block_indices.long().clamp(min=0)
    firsts = first[:, None, None, :].expand(batch, groups, queries, blocks).gather(-1, chosen)
    seen = ((block_indices >= 0) & (firsts <= query_positions[:, None, :, None])).any(-1)  # [B, G, Sq]
    empty = (~seen).repeat_interleave(heads // groups, dim=1)[..., None]
    mean = value.float().mean(dim=2).to(out.dtype).repeat_interleave(heads // groups, dim=1)[:, :, None, :]
    return torch.where(empty, mean, out)


def _from_build_block_mask(node: torch.fx.Node) -> bool:
    """Whether ``node`` is the last node of a MiniMax-M3 ``build_block_mask`` call (its masked_fill)."""
    filled = MASKED_FILL.bind(node)
    if filled is None or ZEROS.bind(filled["input"]) is None or not node.meta.get("stack_trace"):
        return False
    last = node.meta["stack_trace"].strip().splitlines()
    frames = [line for line in last if line.lstrip().startswith("File ")]
    return bool(frames) and frames[-1].rstrip().endswith("in build_block_mask") and f"{HF_FILE}\"" in frames[-1]
