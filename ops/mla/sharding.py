"""DTensor placements of the MLA ops. docs/distributed.md has the table.

Each head's keys and values come from the latent shared by all heads through the head's own rows of
``kv_b_proj.weight`` ``[H * (Dn + Dv), R]`` (rows ``[h (Dn + Dv), (h + 1)(Dn + Dv))``). So a rank holding a
block of heads holds q_nope / q_rope ``[B, H, Sq, .]`` (and out, grad_out) on dim 1 and the weight's rows on
dim 0, which is what a column-wise parallel ``kv_b_proj`` gives; the latent ``[B, T, R]`` and the rope key
``[B, T, Dr]`` are replicated, and their gradients are partial sums over each rank's heads (``Partial``).
The mask is sharded on its head dim when it has one per head, else replicated (its gradient then partial).
Each rank chooses the absorbed or expanded form for its own heads: the same function either way.
"""
from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard

from kda_compile.ops._sharding import OpCall, Strategy, heads_split_evenly, replicated
from kda_compile.ops.attention.sharding import mask_head_dim

HEAD_DIMS = {"q_nope": 1, "q_rope": 1, "grad_out": 1, "kv_b_weight": 0}


def _head_inputs(call: OpCall) -> tuple[dict, object] | None:
    """(the head-sharded strategy's inputs, the mask gradient's placement), or None when the heads do not
    split evenly."""
    if not heads_split_evenly(call, HEAD_DIMS, (call.shape("q_nope")[1],)):
        return None
    inputs = {name: Shard(dim) for name, dim in HEAD_DIMS.items()}
    dim = mask_head_dim(call.shape("attn_mask"))
    if dim is None:
        return inputs, Partial()
    inputs["attn_mask"] = Shard(dim)
    return inputs, Shard(dim)


def forward(call: OpCall) -> list[Strategy]:
    """``out`` ``[B, H, Sq, Dv]`` on its heads."""
    split = _head_inputs(call)
    if split is None:
        return [replicated(call)]
    return [replicated(call), Strategy((Shard(1),), split[0])]


def backward(call: OpCall) -> list[Strategy]:
    """``(dq_nope, dq_rope, dkv_latent, dk_rope, dkv_b_weight, dmask)``."""
    split = _head_inputs(call)
    if split is None:
        return [replicated(call)]
    inputs, mask_grad = split
    dmask = mask_grad if call["mask_needs_grad"] else Replicate()
    return [replicated(call), Strategy((Shard(1), Shard(1), Partial(), Partial(), Shard(0), dmask), inputs)]


RULES = {"mla_attention_fwd": forward, "mla_attention_bwd": backward}
