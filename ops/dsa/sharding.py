"""DTensor placements of the DSA ops. docs/distributed.md has the table.

``dsa_indexer_topk`` (and glm5_next's ``dsa_pooled_indexer_topk``, for the same reason) is replicated only. Its
score ``sum_h w[h] * relu(q[h] . k)`` sums over the H_I indexer heads before the top-k, and the top-k of a sum is
not a function of per-rank partial sums: a rank holding some indexer heads can only produce a partial score
``[B, S, T]``, the very tensor the op exists to avoid. So head-sharded indexer inputs are gathered (DTensor
redistributes them to replicated) and every rank selects the same keys; the indices ``[B, S, topk]`` come out
replicated, which is what the sparse attention takes.

``dsa_sparse_attention_*``: query heads are independent. q ``[B, S, Hq, D]``, o, lse, grad_o, grad_lse on dim 2;
the key / value rows ``[B, T, Hkv, D]`` replicated when there is one key head (MQA: the absorbed form's latent
cache) and their gradients then partial sums over each rank's query heads, or sharded on dim 2 with their
query heads (``Hq`` and ``Hkv`` divide into the same number of blocks); indices replicated.

``compressed_selected_keys`` (DeepSeek-V4's CSA picks as key rows) is replicated, like the indices it makes.
"""
from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard

from kda_compile.ops._sharding import OpCall, Strategy, heads_split_evenly, replicated

QUERY_SIDE = ("q", "o", "lse", "grad_o", "grad_lse")


def indexer_topk(call: OpCall) -> list[Strategy]:
    return [replicated(call)]


def _head_inputs(call: OpCall) -> tuple[dict, object] | None:
    """(the head-sharded strategy's inputs, the key / value gradients' placement), or None."""
    heads, kv_heads = call.shape("q")[2], call.shape("k")[2]
    kv_shared = kv_heads == 1
    head_dims = {name: 2 for name in (*QUERY_SIDE, "k", "v")}
    if not heads_split_evenly(call, head_dims, (heads,) if kv_shared else (heads, kv_heads)):
        return None
    kv = Replicate() if kv_shared else Shard(2)
    inputs = {**{name: Shard(2) for name in QUERY_SIDE}, "k": kv, "v": kv, "indices": Replicate()}
    return inputs, (Partial() if kv_shared else Shard(2))


def sparse_forward(call: OpCall) -> list[Strategy]:
    """``(o, lse)``."""
    split = _head_inputs(call)
    if split is None:
        return [replicated(call)]
    return [replicated(call), Strategy((Shard(2), Shard(2)), split[0])]


def sparse_backward(call: OpCall) -> list[Strategy]:
    """``(dq, dk, dv)``; dv is a placeholder (replicated) in the absorbed form (v None)."""
    split = _head_inputs(call)
    if split is None:
        return [replicated(call)]
    inputs, kv_grad = split
    dv = kv_grad if call.spec("v") is not None else Replicate()
    return [replicated(call), Strategy((Shard(2), kv_grad, dv), inputs)]


RULES = {"dsa_indexer_topk": indexer_topk, "dsa_pooled_indexer_topk": indexer_topk,
         "compressed_selected_keys": indexer_topk,
         "dsa_sparse_attention_fwd": sparse_forward, "dsa_sparse_attention_bwd": sparse_backward}
