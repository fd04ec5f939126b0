"""DTensor placements of the routed-experts ops. docs/distributed.md has the table.

Each token's result depends on its own row and its own routing only, so tokens split: hidden_states,
top_k_index and top_k_weights (and the output, grad_out and the token-side gradients) sharded on dim 0 with the
expert weights replicated; the weights' gradients are then partial sums over each rank's tokens. The expert
weights themselves do not split here: the indices name global experts, and gate and up rows are packed in one
tensor ([E, 2I, H]), so a block of either dimension is not a block of experts or of columns the op can serve on
its own. Anything else runs replicated.
"""
from __future__ import annotations

from torch.distributed.tensor import Partial, Shard

from kda_compile.ops._sharding import OpCall, Strategy, replicated

TOKEN_DIMS = {"hidden_states": 0, "top_k_index": 0, "top_k_weights": 0}


def forward(call: OpCall) -> list[Strategy]:
    """``out`` ``[T, H]`` on its tokens."""
    return [replicated(call), Strategy((Shard(0),), {name: Shard(0) for name in TOKEN_DIMS})]


def backward(call: OpCall) -> list[Strategy]:
    """``(d hidden_states, d top_k_weights, d gate_up_proj, d down_proj)``."""
    inputs = {**{name: Shard(0) for name in TOKEN_DIMS}, "grad_out": Shard(0)}
    return [replicated(call), Strategy((Shard(0), Shard(0), Partial(), Partial()), inputs)]


RULES = {"moe_experts": forward, "moe_experts_backward": backward}
