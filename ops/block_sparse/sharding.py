"""DTensor placements of the block-sparse attention ops. docs/distributed.md has the table.

Query heads are independent, and each KV group's selection serves exactly that group's query heads: query
``[B, H, Sq, D]``, out, lse and grad_out on dim 1 together with key, value and block_indices
``[B, G, ...]`` on their dim 1 (H and G must divide into the same number of blocks, so a rank's query heads go
with their own groups); query_positions and key_padding_mask (per batch row, shared by all heads) replicated.
Gradients follow their inputs. Anything else runs replicated.
"""
from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard

from kda_compile.ops._sharding import OpCall, Strategy, heads_split_evenly, replicated

HEAD_SIDE = ("query", "key", "value", "block_indices", "out", "lse", "grad_out")


def _head_inputs(call: OpCall) -> dict | None:
    """The head-sharded strategy's input placements, or None when the heads do not split evenly."""
    heads, groups = call.shape("query")[1], call.shape("key")[1]
    if not heads_split_evenly(call, {name: 1 for name in HEAD_SIDE}, (heads, groups)):
        return None
    return {**{name: Shard(1) for name in HEAD_SIDE}, "query_positions": Replicate(),
            "key_padding_mask": Replicate()}


def forward(call: OpCall) -> list[Strategy]:
    """``(out, lse)``."""
    inputs = _head_inputs(call)
    return [replicated(call)] if inputs is None else [replicated(call), Strategy((Shard(1), Shard(1)), inputs)]


def backward(call: OpCall) -> list[Strategy]:
    """``(dq, dk, dv)``."""
    inputs = _head_inputs(call)
    if inputs is None:
        return [replicated(call)]
    return [replicated(call), Strategy((Shard(1), Shard(1), Shard(1)), inputs)]


RULES = {"block_sparse_attention_fwd": forward, "block_sparse_attention_bwd": backward}
