"""The absorbed form of the DSA rewrite's attention (passes/dsa/attention.py, docs/dsa-rewrite.md): the
attention over the selected keys runs on the latent cache, so no ``kv_b_proj`` over the cache survives.

Hugging Face's DSA attention (deepseek_v32 and the families that copy it) expands the whole latent cache
every step (``expand_kv``, as passes/mla/absorb.py matches it)::

    kv = kv_b_proj(latent).view(B, T, H, Dn + Dv).transpose(1, 2)       # [B, H, T, Dn + Dv]: O(T) per step
    k_nope, v = torch.split(kv, [Dn, Dv], dim=-1)
    keys = [k_nope | k_rot.expand(-1, H, -1, -1)]                         # [B, H, T, Dn + Dr]

With W = kv_b_proj.weight.view(H, Dn + Dv, R) = [W_UK; W_UV], ``q_nope . k_nope[t] = (q_nope @ W_UK) .
latent[t]`` and ``p @ v = (p @ latent) @ W_UV^T``, so the attention over the selected keys becomes one MQA
over the latent rows (the rope part of the key is shared by all heads already)::

    q = cat(q_nope @ W_UK, q_rope)                                        # [B, H, S, R + Dr]
    k = cat(latent, k_rot)                                                # [B, 1, T, R + Dr]
    o, lse = dsa_sparse_attention(q^T, k^T, None, indices, scale, d_v=R)  # o [B, S, H, R]
    out = o^T @ W_UV^T                                                    # [B, H, S, Dv]

The scale is the attention's own (its default stays ``(Dn + Dr) ** -0.5``, the expanded key width); lse is
the same as the expanded form's, so sinks (hy_v4) gate ``o`` as before. RoPE layout (interleaved or
half-split) does not matter: it is applied to q_rot and k_rot before the cache, and the absorption only
touches the nope part.

Used for prefill and decode alike: one graph form, and a prefill (S = T) projects S queries instead of T
keys (the same FLOPs); the attention's inner products are R + Dr wide instead of Dn + Dr (and Dv instead
of R for the values), but its keys are one latent row shared by all H heads (MQA), the form DeepSeek's
sparse kernels take for both phases. Where the keys or values are not HF's ``expand_kv`` (or are used
elsewhere), the expanded form stays, with the reason in the rewrite's report (``form``).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from kda_compile.passes.mla.absorb import EXPAND_KV, ExpandKV, NotMLA, query_halves, read_expand_kv
from kda_compile.passes.toolkit.graph_tools import (_example, _fake_mode, describe_node, insert_call, known_equal,
                                                    static_int, tensor_of)
from kda_compile.passes.toolkit.matching import Bindings


@dataclass
class LatentKV:
    """HF's ``expand_kv`` feeding a DSA attention: the latent cache, the rope keys and kv_b_proj's weight."""

    region: ExpandKV
    heads: int
    nope: int
    value: int
    rank: int

    @property
    def latent(self) -> torch.fx.Node:
        return self.region["latent"]

    @property
    def k_rope(self) -> torch.fx.Node:
        return self.region.k_rope

    @property
    def weight(self) -> torch.fx.Node:
        return self.region["kv_b_weight"]


def read_latent_kv(query: torch.fx.Node, key: torch.fx.Node, value: torch.fx.Node,
                   replaced: tuple[torch.fx.Node, ...]) -> LatentKV | str:
    """The ``expand_kv`` whose keys and values the attention (``replaced``) takes, or why it cannot be absorbed."""
    if value.target is not operator.getitem or value.args[1] != 1 or not isinstance(value.args[0], torch.fx.Node):
        return f"the values ({describe_node(value)}) are not the second half of a split of kv_b_proj's output"
    split = value.args[0]
    region = None
    for bindings in EXPAND_KV.matches(split, Bindings()):
        try:
            region = read_expand_kv(split, bindings)
        except NotMLA as exc:
            return str(exc)
        if region is not None:
            break
    if region is None:
        return f"the values ({describe_node(value)}) are not split from kv_b_proj(latent) as HF's expand_kv does"
    if region.keys is not key or region.value is not value:
        return f"the attention's keys ({describe_node(key)}) are not the keys expand_kv assembles"
    allowed = set(replaced) | set(region.nodes)

    def feeds_only_the_attention(node: torch.fx.Node, depth: int = 3) -> bool:  # e.g. eager's k.transpose(2, 3)
        return node in allowed or (depth > 0 and bool(node.users)
                                   and all(feeds_only_the_attention(u, depth - 1) for u in node.users))

    for node in (region.keys, region.value):
        stray = [u for u in node.users if not feeds_only_the_attention(u)]
        if stray:
            return f"the expanded {describe_node(node)} are also used by {', '.join(map(describe_node, stray))}"
    q, latent, k_rope, w = (tensor_of(x) for x in (query, region["latent"], region.k_rope, region["kv_b_weight"]))
    keys = tensor_of(region.keys)
    if any(x is None for x in (q, latent, k_rope, w, keys)) or latent.dim() != 4 or k_rope.dim() != 4 \
            or w.dim() != 2 or q.dim() != 4:
        return "the latent, rope keys, kv_b_proj weight or query do not have the ranks expand_kv gives"
    nope, val = (static_int(s) for s in region["sections"])
    heads, rank, rope = static_int(keys.shape[1]), static_int(latent.shape[-1]), static_int(k_rope.shape[-1])
    if None in (nope, val, heads, rank, rope) or not (
            known_equal(latent.shape[1], 1) and known_equal(k_rope.shape[1], 1)
            and known_equal(latent.shape[2], k_rope.shape[2]) and known_equal(w.shape[0], heads * (nope + val))
            and known_equal(w.shape[1], rank) and known_equal(q.shape[1], heads)
            and known_equal(q.shape[-1], nope + rope)):
        return (f"the shapes do not pair up as MLA: latent {list(latent.shape)}, rope keys {list(k_rope.shape)}, "
                f"kv_b_proj weight {list(w.shape)}, query {list(q.shape)}, split {region['sections']}")
    return LatentKV(region, heads, nope, val, rank)


def absorbed_attention(dsa_sparse_attention, q_nope, q_rope, latent, k_rope, weight, indices, *, heads: int,
                       nope: int, scale: float, dtype: torch.dtype):
    """The absorbed attention as plain calls, (o [B, S, H, R], lse [B, S, H], W_UV [H, Dv, R]): the nodes
    :func:`insert_absorbed` inserts compute exactly this (it is run on the example values to check the op's
    arguments before anything is inserted)."""
    w = weight.view(heads, -1, weight.shape[-1])
    q = torch.cat((torch.matmul(q_nope, w[:, :nope]), q_rope), dim=-1).transpose(1, 2).to(dtype)
    k = torch.cat((latent, k_rope), dim=-1).transpose(1, 2).to(dtype)
    o, lse = dsa_sparse_attention(q, k, None, indices, scale, d_v=latent.shape[-1])
    return o, lse, w[:, nope:]


def absorbed_refusal(dsa_sparse_attention, args: tuple, kwargs: dict) -> str | None:
    """Why the op (or the absorbed form's shapes) refuses these arguments, on the example values, or None."""
    ex_args = _example(args)
    try:
        with _fake_mode(list(ex_args)):
            absorbed_attention(dsa_sparse_attention, *ex_args, **kwargs)
    except (TypeError, ValueError, RuntimeError) as exc:
        return str(exc)
    return None


def insert_absorbed(graph: torch.fx.Graph, out: torch.fx.Node, query: torch.fx.Node, kv: LatentKV,
                    indices: torch.fx.Node, scale: float | None, sinks: torch.fx.Node | None, dsa_sparse_attention,
                    with_sinks) -> tuple[torch.fx.Node, dict] | str:
    """Insert the absorbed attention before ``out`` (its [B, H, S, Dv] output, not yet replaced); returns the
    new output node and the report's details, or why the op refuses (nothing inserted then)."""
    if scale is None:  # SDPA's default: the expanded key width's, not the latent one's
        scale = float(tensor_of(query).shape[-1]) ** -0.5
    dtype = tensor_of(query).dtype
    q_nope, q_rope, added = query_halves(graph, query, kv.nope, out)
    kwargs = dict(heads=kv.heads, nope=kv.nope, scale=scale, dtype=dtype)
    why = absorbed_refusal(dsa_sparse_attention, (q_nope, q_rope, kv.latent, kv.k_rope, kv.weight, indices), kwargs)
    if why is not None:
        for node in reversed(added):
            graph.erase_node(node)
        return why

    def call(target, *args, **kw):
        return insert_call(graph, out, target, args, kw, meta_from=out)

    def as_dtype(node):
        return node if tensor_of(node).dtype == dtype else call("to", node, dtype)

    w = call("view", kv.weight, kv.heads, kv.nope + kv.value, kv.rank)
    w_uk = call(operator.getitem, w, (slice(None), slice(None, kv.nope)))
    w_uv = call(operator.getitem, w, (slice(None), slice(kv.nope, None)))
    q_latent = call(torch.matmul, q_nope, w_uk)  # [B, H, S, R]
    q = as_dtype(call("transpose", call(torch.cat, (q_latent, q_rope), dim=-1), 1, 2))
    k = as_dtype(call("transpose", call(torch.cat, (kv.latent, kv.k_rope), dim=-1), 1, 2))
    pair = call(dsa_sparse_attention, q, k, None, indices, scale, d_v=kv.rank)
    o = call(operator.getitem, pair, 0)  # [B, S, H, R]
    if sinks is not None:
        o = with_sinks(graph, out, o, call(operator.getitem, pair, 1), sinks)
    o = call("transpose", o, 1, 2)  # [B, H, S, R]
    if tensor_of(o).dtype != tensor_of(w_uv).dtype:
        o = call("to", o, tensor_of(w_uv).dtype)
    new = call(torch.matmul, o, call("transpose", w_uv, -1, -2))  # [B, H, S, Dv]
    if tensor_of(new).dtype != tensor_of(out).dtype:
        new = call("to", new, tensor_of(out).dtype)
    details: dict[str, Any] = dict(heads=f"{kv.heads}/1", d_qk=kv.rank + int(tensor_of(q_rope).shape[-1]),
                                   d_v=kv.rank, scale=round(scale, 6), form="absorbed",
                                   kv_lora_rank=kv.rank, nope=kv.nope, v_head_dim=kv.value)
    return new, details
