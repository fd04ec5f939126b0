"""Rewrite DeepSeek-V4's compressed attention layers into ``kda_compile.ops.compressed_sparse_attention``.

Hugging Face's ``DeepseekV4Attention.forward`` (transformers 5.23, models/deepseek_v4; docs/dsa.md, section 6)
concatenates the sliding window's key rows and the compressor's entries into one key / value tensor and widens the
sliding mask over the entries with the compressor's bias; ``softmax_attention`` turns its eager attention into
``kda_compile.attention`` with that dense mask::

    kv = torch.cat([kv, compressed_kv], dim=2)                          # [B, 1, Tw + Tc, D], keys = values
    attention_mask = torch.cat([mask, block_bias.to(mask.dtype)], -1)   # [B, 1, S, Tw + Tc]
    #   or, an HCA decode step (no bias): F.pad(mask, (0, Tc), value=0.0)
    attention(q, kv, kv, attn_mask=attention_mask, sinks=self.sinks, scale=self.scaling)

where ``mask`` is the sliding causal mask over the window rows and ``block_bias`` is, for CSA, the indexer's
top-k scattered into -inf (``new_full(..., -inf).scatter_(-1, where(idx >= 0, idx, full_like(idx, Tc))
.unsqueeze(1), 0.0)[..., :Tc]``) and, for HCA, the entries not yet closed (``new_zeros(...).masked_fill(
arange(Tc).view(1, 1, 1, -1) >= ((position_ids + 1) // rate).unsqueeze(1).unsqueeze(-1), -inf)``).

The attention becomes ``compressed_sparse_attention(q, window_kv, compressed_kv, sinks, scale=...,
sliding_window=W, selected=idx | compress_rate=rate, query_positions=position_ids, key_padding_mask=...)``: the
window and padding are read from ``mask`` by the mask reader (passes/attention/mask.py: it must be the bottom-right
causal mask with a constant window), the selection from the bias. No ``[S, Tw + Tc]`` tensor is left once the
graph no longer needs the bias (it is erased with the attention's other inputs). Sliding-only layers are
``softmax_attention``'s (``is_causal`` with a window on the SDPA kernels) and stay so.

Left alone, and reported, in DeepSeek-V4's attention modules: a mask or bias built otherwise, dropout, softcap, no
sinks, an implicit scale, keys that are not values, arguments the op refuses.
"""
from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx

from kda_compile.ops import compressed_sparse_attention
from kda_compile.passes.attention.mask import ARANGE, COMPARE, UNSQUEEZE, WHERE, MaskMeaning, read_additive_mask
from kda_compile.passes.attention.patterns import ATTENTION
from kda_compile.passes.dsa.patterns import MASKED_FILL, NEW_FULL, SCATTER_, is_minus_inf
from kda_compile.passes.report import LeftAlone
from kda_compile.passes.rewrite import GraphRewrite, RewriteLog
from kda_compile.passes.toolkit.graph_tools import (concrete_number, describe_node, erase_unused, insert_call,
                                                    is_last_dim, is_tensor_node, known_equal, module_path, source_line, static_int, tensor_of)
from kda_compile.passes.toolkit.matching import ADD, CAST, CAT, GETITEM, RESHAPE, cast_dtype, family

logger = logging.getLogger("kda_compile.passes.dsa_compressed")

OP_NAME = "kda_compile.compressed_sparse_attention"
MODELING = "transformers.models.deepseek_v4.modeling_deepseek_v4"

NEW_ZEROS = family("new_zeros", ("input", "*size"), methods=("new_zeros",),
                   defaults={"dtype": None, "device": None, "requires_grad": False})
FULL_LIKE = family("full_like", ("input", "fill_value"), functions=(torch.full_like,),
                   defaults={"dtype": None, "device": None, "layout": None, "requires_grad": False,
                             "memory_format": torch.preserve_format})
PAD = family("pad", ("input", "pad", "mode", "value"), functions=(torch.nn.functional.pad, torch._C._nn.pad),
             defaults={"mode": "constant", "value": None})
FLOORDIV = family("floordiv", ("input", "other"), functions=(operator.floordiv, torch.floor_divide),
                  methods=("__floordiv__", "floor_divide"))


class NotCompressed(Exception):
    """The candidate is not DeepSeek-V4's compressed attention as matched; the message says where."""


def _uncast(node: Any) -> Any:
    return CAST.bind(node)["input"] if isinstance(node, torch.fx.Node) and cast_dtype(node) is not None else node


def _two_parts(node: Any, dim_ndim: tuple[int, int], what: str) -> tuple[torch.fx.Node, torch.fx.Node]:
    b = CAT.bind(node)
    tensors = b["tensors"] if b is not None else None
    dim, ndim = dim_ndim
    if b is None or not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or not all(
            is_tensor_node(t) for t in tensors) or b.get("dim", 0) % ndim != dim:
        raise NotCompressed(f"the {what} is not torch.cat of two tensors along dim {dim} (found {describe_node(node)})")
    return tensors[0], tensors[1]


def _csa_selection(bias: torch.fx.Node, entries: Any) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """The indexer's picks behind CSA's bias ``new_full(-inf).scatter_(-1, where(i >= 0, i, Tc).unsqueeze(1),
    0)[..., :Tc]`` and the in-place scatter with the tensor it fills (erased with the attention), or
    NotCompressed."""
    item = GETITEM.bind(bias)
    source = item["input"] if item is not None else None
    # the in-place scatter_ is a user of the tensor it fills; the slice may read either of the two nodes
    scatters = [u for u in getattr(source, "users", ()) if SCATTER_.bind(u) is not None] + (
        [source] if SCATTER_.bind(source) is not None else [])
    if len(scatters) != 1:
        raise NotCompressed(f"the compressor's bias is not one scatter into a tensor (found {describe_node(bias)})")
    scatter = SCATTER_.bind(scatters[0])
    if not is_last_dim(scatter["dim"], 4) or scatter["value"] != 0.0:
        raise NotCompressed(f"the compressor's bias is not a scatter of zeros (found {describe_node(scatters[0])})")
    full = NEW_FULL.bind(scatter["input"])
    if full is None or not is_minus_inf(full["fill_value"]) or (source is not scatters[0]
                                                                 and source is not scatter["input"]):
        raise NotCompressed("the scattered bias does not start as -inf everywhere")
    if any(u not in (scatters[0], bias) for u in scatter["input"].users):
        raise NotCompressed("the bias is read elsewhere before its slice")
    index = item["index"]
    if not (isinstance(index, tuple) and index[:-1] == (Ellipsis,) and isinstance(index[-1], slice)
            and index[-1].start is None and index[-1].step is None):
        raise NotCompressed(f"the bias is not cut to its first Tc columns (index {index!r})")
    unsqueezed = UNSQUEEZE.bind(scatter["index"])
    where = WHERE.bind(unsqueezed["input"]) if unsqueezed is not None and unsqueezed["dim"] == 1 else None
    if where is None:
        raise NotCompressed("the scattered positions are not torch.where(valid, picks, Tc).unsqueeze(1)")
    picks, spare = where["input"], FULL_LIKE.bind(where["other"])
    valid = COMPARE[operator.ge].bind(where["condition"])
    if (spare is None or spare["input"] is not picks or not known_equal(spare["fill_value"], entries)
            or valid is None or valid["input"] is not picks or valid["other"] != 0):
        raise NotCompressed("the picks' -1 are not sent to a spare column (torch.where(picks >= 0, picks, "
                            "full_like(picks, Tc)))")
    return picks, [scatters[0], scatter["input"]]


def _hca_positions(bias: torch.fx.Node) -> tuple[torch.fx.Node, int]:
    """(position_ids, rate) behind HCA's bias ``new_zeros(...).masked_fill(arange(Tc).view(1, 1, 1, -1) >=
    ((position_ids + 1) // rate).unsqueeze(1).unsqueeze(-1), -inf)``, or NotCompressed."""
    fill = MASKED_FILL.bind(bias)
    if fill is None or NEW_ZEROS.bind(fill["input"]) is None or not is_minus_inf(fill["value"]):
        raise NotCompressed(f"the compressor's bias is not zeros filled with -inf (found {describe_node(bias)})")
    compare = COMPARE[operator.ge].bind(fill["mask"])
    entries = RESHAPE.bind(compare["input"]) if compare is not None else None
    if entries is None or ARANGE.bind(entries["input"]) is None:
        raise NotCompressed("the filled entries are not arange(Tc) >= a threshold")
    threshold = compare["other"]
    for dim in (-1, 1):  # .unsqueeze(1).unsqueeze(-1), undone from the outside in
        step = UNSQUEEZE.bind(threshold)
        if step is None or step["dim"] != dim:
            raise NotCompressed("the threshold is not laid out as [B, 1, S, 1]")
        threshold = step["input"]
    divided = FLOORDIV.bind(threshold)
    added = ADD.bind(divided["input"]) if divided is not None else None
    rate = static_int(divided["other"]) if divided is not None else None
    if added is None or rate is None or rate < 1 or added["other"] != 1 or not is_tensor_node(added["input"]):
        raise NotCompressed("the threshold is not (position_ids + 1) // rate with a constant rate")
    return added["input"], rate


def read_site(node: torch.fx.Node, b: dict) -> dict:
    """The keyword arguments of ``compressed_sparse_attention`` for the attention ``node`` (bound as ``b``)."""
    if b["key"] is not b["value"]:
        raise NotCompressed("the keys are not the values")
    for name in ("softcap", "sliding_window"):
        if b[name] is not None:
            raise NotCompressed(f"the attention has {name}={describe_node(b[name])}")
    if b["dropout_p"] != 0.0:
        raise NotCompressed(f"the attention has dropout_p={b['dropout_p']} (training)")
    if b["sinks"] is None or b["scale"] is None or b["is_causal"] is not False:
        raise NotCompressed("the attention has no sinks, an implicit scale or is_causal set")
    window_kv, compressed_kv = _two_parts(b["key"], (2, 4), "key")
    mask, tc = b["attn_mask"], tensor_of(compressed_kv).shape[2]
    kwargs: dict[str, Any] = {}
    filled: list[torch.fx.Node] = []  # an in-place fill of the bias, erased by hand (erase_unused keeps those)
    pad = PAD.bind(mask)
    if pad is not None:  # an HCA decode step: every entry is seen
        if pad["mode"] != "constant" or pad["value"] != 0.0 or len(pad["pad"]) != 2 or pad["pad"][0] != 0:
            raise NotCompressed(f"the mask is padded otherwise than with zeros on the right ({describe_node(mask)})")
        sliding = pad["input"]
    else:
        sliding, extra = _two_parts(mask, (3, 4), "mask")
        bias = _uncast(extra)
        if MASKED_FILL.bind(bias) is not None:
            kwargs["query_positions"], kwargs["compress_rate"] = _hca_positions(bias)
        else:
            kwargs["selected"], filled = _csa_selection(bias, tc)
    q, w = tensor_of(b["query"]), tensor_of(window_kv)
    meaning = read_additive_mask(sliding, q.shape[2], w.shape[2])
    if not isinstance(meaning, MaskMeaning):
        raise NotCompressed(f"the window's mask is not understood: {meaning}")
    if not meaning.causal or meaning.sliding_window is None:
        raise NotCompressed("the window's mask is not the bottom-right causal mask with a sliding window")
    kwargs.update(scale=float(concrete_number(b["scale"])), sliding_window=meaning.sliding_window)
    return dict(window_kv=window_kv, compressed_kv=compressed_kv, padding=meaning.key_padding, kwargs=kwargs,
                filled=filled)


def _in_deepseek_v4_attention(node: torch.fx.Node) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return any(getattr(cls, "__module__", "") == MODELING and getattr(cls, "__name__", "").endswith("Attention")
               for _, cls in stack.values())


class CompressedAttentionRewrite(GraphRewrite):
    """Replace DeepSeek-V4's compressed attention (CSA, HCA) with ``compressed_sparse_attention``."""

    name = "compressed_attention"
    options = ("attention_mask_to_flags",)

    def apply(self, gm: torch.fx.GraphModule, log: RewriteLog) -> int:
        graph, rewritten = gm.graph, 0
        for node in list(graph.nodes):
            b = ATTENTION.bind(node)
            # a compressed layer widens the window's mask over its entries (a cat with the compressor's bias, or a
            # zero pad); a sliding layer's attention, over the window alone, is softmax_attention's as it stands
            if (b is None or (CAT.bind(b["attn_mask"]) is None and PAD.bind(b["attn_mask"]) is None)
                    or not _in_deepseek_v4_attention(node)):
                continue
            where = (module_path(node), source_line(node))
            try:
                if not self.config.attention_mask_to_flags:
                    raise NotCompressed("attention_mask_to_flags is off: the window's mask is not read")
                site = read_site(node, b)
            except NotCompressed as exc:
                log.left_alone.append(LeftAlone(self.name, *where, str(exc)))
                continue
            # the op's argument checks run before anything is inserted; a refusal is logged as left alone
            rewritten += self.replace_site(log, where, OP_NAME, lambda: self._replace(graph, node, b, site))
        return rewritten

    @staticmethod
    def _replace(graph: torch.fx.Graph, node: torch.fx.Node, b: dict, site: dict) -> dict:
        kwargs, added = dict(site["kwargs"]), []
        if site["padding"] is not None:  # [B, 1, 1, Tw] -> [B, Tw]
            rows = insert_call(graph, node, operator.getitem,
                               (site["padding"], (slice(None), 0, 0, slice(None))), meta_from=node)
            added.append(rows)
            kwargs["key_padding_mask"] = rows
        args = (b["query"], site["window_kv"], site["compressed_kv"], b["sinks"])
        try:
            new = insert_call(graph, node, compressed_sparse_attention, args, kwargs, meta_from=node)
        except (TypeError, ValueError):
            for extra in reversed(added):
                graph.erase_node(extra)
            raise
        node.replace_all_uses_with(new)
        erase_unused(graph, [node, b["attn_mask"], b["key"]])
        if site["filled"]:  # CSA's [B, 1, S, Tc + 1] bias: the scatter_ into it (named, so erased), once the slice
            scatter, full = site["filled"]  # that read it is gone
            if set(full.users) == {scatter}:
                erase_unused(graph, site["filled"])
        kind = "csa" if "selected" in kwargs else "hca" if "compress_rate" in kwargs else "every entry"
        details = dict(kind=kind, sliding_window=kwargs["sliding_window"], scale=round(kwargs["scale"], 6),
                       padding=site["padding"] is not None)
        if "compress_rate" in kwargs:
            details["compress_rate"] = kwargs["compress_rate"]
        return details
