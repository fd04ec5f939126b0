"""Rewrite torch's ``scaled_dot_product_attention`` calls into ``kda_compile.ops.attention``.

A model loaded the default way (``attn_implementation`` unset, i.e. ``"sdpa"``) attends through
``sdpa_attention_forward`` as transformers 5.17 to 5.23 write it in integrations/sdpa_attention.py::

    if module.num_key_value_groups > 1:
        if use_gqa_in_sdpa(attention_mask, key, value):    # no mask (and head dim <= 256)
            sdpa_kwargs["enable_gqa"] = True
        else:
            key = repeat_kv(key, module.num_key_value_groups)       # key[:, :, None].expand(...).reshape(...)
            value = repeat_kv(value, module.num_key_value_groups)
    is_causal = q_length > 1 and attention_mask is None and is_causal   # a Python bool in the graph
    if is_causal and attention_mask is None and q_length > 1 and kv_length > q_length:
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    attn_output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=is_causal, **sdpa_kwargs)
    attn_output = attn_output.reshape(B, -1, q_length, Dv).transpose(1, 2).contiguous()   # kept

where ``attention_mask`` is None or the bool mask of ``masking_utils.sdpa_mask`` (True = attend;
``allowed.expand(B, -1, Sq, Sk)``, see ``attention/mask.py``), or a float additive mask. Dynamo
records the call as ``torch._C._nn.scaled_dot_product_attention`` (``F.scaled_dot_product_attention``
is the same function). It replaces the call with::

    attn_output = attention(query, key, value, scale=scaling, dropout_p=dropout,
                            attn_mask=..., is_causal=..., sliding_window=...)

with the un-repeated ``key`` / ``value`` (GQA without repeat_kv, the same head grouping as
``enable_gqa=True``). A mask the graph proves causal (with a sliding window, with key padding)
becomes ``is_causal`` / ``sliding_window`` plus, for padding, the ``[B, 1, 1, Sk]`` bool padding
mask (``attention_mask_to_flags``); any other mask is passed as is (bool or additive). ``scale=None``
stays None (both default to ``Dqk ** -0.5``). The reshape / transpose / contiguous after the call
are kept: on the op's ``[B, Sq, H, Dv]`` storage they are free. A query row whose keys are all
masked gives 0, as torch's SDPA does on CPU (only padding positions have such rows).

Left alone, and reported: ``is_causal=True`` when the query and key lengths are not provably
equal (torch aligns that diagonal top-left, the op bottom-right), ``is_causal`` not a Python bool,
``is_causal=True`` with a mask, shapes that do not pair up as [batch, heads, seq, dim] attention
(broadcast batch or heads included), a dropout probability or scale that is not a constant,
arguments the op refuses. Every SDPA call is a candidate.

As in ``softmax_attention``, the new node calls the public function ``attention`` (its argument
checks turn a site the op cannot take into a reported candidate).
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx

from kda_compile.ops.attention import attention
from kda_compile.passes.attention.mask import mask_keywords
from kda_compile.passes.report import LeftAlone
from kda_compile.passes.rewrite import GraphRewrite, RewriteLog
from kda_compile.passes.toolkit.graph_tools import (concrete_number, describe_node, erase_unused, example_value,
                                                    insert_call, is_real_number, known_equal, module_path, source_line,
                                                    tensor_of)
from kda_compile.passes.toolkit.matching import SDPA, unrepeat_kv

logger = logging.getLogger("kda_compile.passes.sdpa_attention")

OP_NAME = "kda_compile.attention"


def _number(value: Any) -> float | None:
    """A Python number, or the value of a node holding a SymFloat / SymInt (a float module attribute
    Dynamo left unspecialised under ``dynamic=True``: specialised here, with a guard), else None."""
    if isinstance(value, torch.fx.Node):
        if isinstance(example_value(value), (torch.SymFloat, torch.SymInt)):
            return float(concrete_number(value))
        return None
    return float(value) if is_real_number(value) else None


def _lengths_agree(value_length: Any, key_length: Any) -> bool:
    """Whether the values have as many positions as the keys. A KV cache's two lengths are often
    separate symbols Dynamo cannot prove equal (torch's SDPA fails at run time when they differ,
    but records no guard); when they are equal now, a guard makes it hold for this graph."""
    if known_equal(value_length, key_length):
        return True
    if not isinstance(value_length, torch.SymInt) and not isinstance(key_length, torch.SymInt):
        return False
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    return bool(guard_or_false(value_length == key_length))


def check_call(bound: dict) -> str | None:
    """Why the SDPA call with arguments ``bound`` must be left alone, or None."""
    q, k, v = (tensor_of(bound[n]) for n in ("query", "key", "value"))
    if any(t is None or t.dim() != 4 for t in (q, k, v)):
        return "query, keys and values are not all 4-D [batch, heads, seq, dim] tensors"
    (b, h, sq, dqk), (_, hkv, sk, _) = q.shape, k.shape
    # one key / value head broadcast over the query heads (SDPA broadcasts its batch dims: Falcon's multi-query
    # attention passes keys [B, 1, T, D] with enable_gqa=False) is grouped-query attention with one group
    same_heads = known_equal(hkv, h) or known_equal(hkv, 1)
    if not (known_equal(k.shape[0], b) and known_equal(v.shape[0], b) and known_equal(k.shape[3], dqk)
            and known_equal(v.shape[1], hkv) and _lengths_agree(v.shape[2], sk)
            and (same_heads or bound["enable_gqa"] is True)):
        return (f"the shapes do not pair up as attention (enable_gqa={bound['enable_gqa']}): query {list(q.shape)}, "
                f"keys {list(k.shape)}, values {list(v.shape)}")
    causal, mask = bound["is_causal"], bound["attn_mask"]
    if not isinstance(causal, bool):
        return f"is_causal is {describe_node(causal)}, not a Python bool"
    if causal and mask is not None:
        return "is_causal=True with an attn_mask (torch refuses both)"
    if causal and not known_equal(sq, sk):
        return (f"is_causal=True with query length {sq} and key length {sk} not provably equal: torch aligns "
                f"the diagonal top-left, {OP_NAME} bottom-right")
    if mask is not None and tensor_of(mask) is None:
        return f"the attn_mask {describe_node(mask)} is not a tensor"
    p = _number(bound["dropout_p"])
    if p is None or not 0.0 <= p < 1.0:
        return f"the dropout probability {describe_node(bound['dropout_p'])} is not a number in [0, 1)"
    scale = bound["scale"]
    if scale is not None and _number(scale) is None:
        return f"the scale {describe_node(scale)} is not a number"
    return None


def attention_arguments(bound: dict, mask_to_flags: bool) -> tuple[dict, dict]:
    """Keyword arguments of ``attention`` for a checked SDPA call, and the details the report shows."""
    q, k = tensor_of(bound["query"]), tensor_of(bound["key"])
    scale = None if bound["scale"] is None else _number(bound["scale"])
    kwargs: dict[str, Any] = dict(scale=scale, dropout_p=_number(bound["dropout_p"]), is_causal=bound["is_causal"])
    details: dict[str, Any] = dict(scale=round(scale, 6) if scale is not None else "default",
                                   is_causal=bound["is_causal"])
    if kwargs["dropout_p"]:
        details["dropout_p"] = kwargs["dropout_p"]
    mask = bound["attn_mask"]
    if mask is not None:
        additive = tensor_of(mask).dtype != torch.bool
        mask_kwargs, mask_details = mask_keywords(mask, q.shape[2], k.shape[2], mask_to_flags, additive=additive)
        kwargs.update(mask_kwargs)
        details.update(mask_details)
    return kwargs, details


class SdpaAttentionRewrite(GraphRewrite):
    """Replace every ``scaled_dot_product_attention`` call with one call of ``kda_compile.ops.attention``."""

    name = "sdpa_attention"
    options = ("attention_mask_to_flags",)

    def apply(self, gm: torch.fx.GraphModule, log: RewriteLog) -> int:
        graph = gm.graph
        rewritten = 0
        for call in [n for n in graph.nodes if SDPA.bind(n) is not None]:
            bound = SDPA.bind(call)
            where = (module_path(call), source_line(call))
            reason = check_call(bound)
            if reason is not None:
                logger.debug("%s left alone: %s", call.name, reason)
                log.left_alone.append(LeftAlone(self.name, *where, reason))
                continue
            rewritten += self.replace_site(log, where, OP_NAME, lambda: self._replace(graph, call, bound))
        return rewritten

    def _replace(self, graph: torch.fx.Graph, call: torch.fx.Node, bound: dict) -> dict:
        kwargs, details = attention_arguments(bound, self.config.attention_mask_to_flags)
        key, value = bound["key"], bound["value"]
        if not bound["enable_gqa"]:  # repeat_kv'd keys and values: attend on the kv heads
            kv_key, kv_value = unrepeat_kv(key), unrepeat_kv(value)
            if known_equal(tensor_of(kv_key).shape[1], tensor_of(kv_value).shape[1]):
                key, value = kv_key, kv_value
        details["heads"] = f"{tensor_of(bound['query']).shape[1]}/{tensor_of(key).shape[1]}"
        new = insert_call(graph, call, attention, (bound["query"], key, value), kwargs, meta_from=call)
        want = tensor_of(call).dtype
        if tensor_of(new).dtype != want:
            new = insert_call(graph, call, "to", (new, want), meta_from=call)
        call.replace_all_uses_with(new)
        erase_unused(graph, [call])
        return details
