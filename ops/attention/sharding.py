"""DTensor placements of the softmax attention ops. docs/distributed.md has the table.

Heads are independent: query ``[B, H, Sq, D]``, key / value ``[B, Hkv, Sk, D]``, out, lse, grad_out,
grad_lse on dim 1, sinks ``[H]`` on dim 0. GQA groups stay whole when H and Hkv divide into the same number of
blocks (query head ``h`` reads key head ``h // (H / Hkv)``); a single key / value head (MQA) is replicated
instead, and its gradients are then partial sums over each rank's query heads (``Partial``). The mask
(broadcastable to ``[B, H, Sq, Sk]``) is sharded on its head dim when it has one per head, else replicated,
its gradient then a partial sum. ``rng`` (the dropout seed) is replicated: with dropout each rank draws its
own seed from its generator for its own heads, so the dropout pattern is not the one process's pattern.
"""
from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard

from kda_compile.ops._sharding import OpCall, Strategy, heads_split_evenly, replicated

HEADS_ON_DIM_1 = ("query", "key", "value", "out", "lse", "grad_out", "grad_lse")


def mask_head_dim(mask_shape) -> int | None:
    """The dim of a mask broadcastable to [B, H, Sq, Sk] that holds one entry per head, or None."""
    if mask_shape is None or len(mask_shape) < 3 or mask_shape[-3] == 1:
        return None
    return len(mask_shape) - 3


def head_strategy_inputs(call: OpCall, per_head: tuple, shared_kv: tuple) -> tuple[dict, bool] | None:
    """The inputs of the head-sharded strategy, and whether key / value are replicated (one shared head), or
    None when the heads do not split evenly. ``per_head``: argument names with heads on dim 1 (key / value
    included); ``shared_kv``: the key / value argument names."""
    heads, kv_heads = call.shape(per_head[0])[1], call.shape(shared_kv[0])[1]
    kv_shared = kv_heads == 1
    counts = (heads,) if kv_shared else (heads, kv_heads)
    if not heads_split_evenly(call, {name: 1 for name in per_head}, counts):
        return None
    inputs = {name: (Replicate() if kv_shared and name in shared_kv else Shard(1)) for name in per_head}
    return inputs, kv_shared


def _mask_placements(call: OpCall, inputs: dict) -> tuple:
    """(the mask's placement, its gradient's placement)."""
    dim = mask_head_dim(call.shape("attn_mask"))
    if dim is None:
        return Replicate(), Partial()
    inputs["attn_mask"] = Shard(dim)
    return Shard(dim), Shard(dim)


def forward(call: OpCall) -> list[Strategy]:
    """``(out, lse, rng)``."""
    split = head_strategy_inputs(call, ("query", "key", "value"), ("key", "value"))
    if split is None:
        return [replicated(call)]
    inputs, _ = split
    _mask_placements(call, inputs)
    inputs["sinks"] = Shard(0)
    return [replicated(call), Strategy((Shard(1), Shard(1), Replicate()), inputs)]


def backward(call: OpCall) -> list[Strategy]:
    """``(dq, dk, dv, dmask, dsinks)``; dmask / dsinks are placeholders (replicated) when not computed."""
    split = head_strategy_inputs(call, HEADS_ON_DIM_1, ("key", "value"))
    if split is None:
        return [replicated(call)]
    inputs, kv_shared = split
    _, mask_grad = _mask_placements(call, inputs)
    inputs["sinks"] = Shard(0)
    kv_grad = Partial() if kv_shared else Shard(1)
    dmask = mask_grad if call["mask_needs_grad"] else Replicate()
    dsinks = Shard(0) if call.spec("sinks") is not None else Replicate()
    return [replicated(call), Strategy((Shard(1), kv_grad, kv_grad, dmask, dsinks), inputs)]


RULES = {"attention_fwd": forward, "attention_bwd": backward}
