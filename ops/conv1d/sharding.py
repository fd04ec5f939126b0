"""DTensor placements of ``causal_conv1d_update``. docs/distributed.md has the table.

The conv is depthwise and per sequence: each output channel of each sequence reads its own channel's state, taps
and bias only. So the batch splits (x, conv_state and the output on dim 0, the weights replicated), and so do
the channels (x, conv_state and the output on dim 1, weight and bias on dim 0: a tensor-parallel layer's local
heads). Anything else runs replicated. conv_state is written in place: pass it in the placement of x, since a
state DTensor has to redistribute is a copy, and the copy would be the tensor that gets written.
"""
from __future__ import annotations

from torch.distributed.tensor import Shard

from kda_compile.ops._sharding import OpCall, Strategy, replicated


def forward(call: OpCall) -> list[Strategy]:
    """``out`` ``[B, C, T]`` on its sequences or on its channels."""
    by_sequence = Strategy((Shard(0),), {"x": Shard(0), "conv_state": Shard(0)})
    channels = {"x": Shard(1), "conv_state": Shard(1), "weight": Shard(0)}
    if call.spec("bias") is not None:
        channels["bias"] = Shard(0)
    return [replicated(call), by_sequence, Strategy((Shard(1),), channels)]


RULES = {"causal_conv1d_update": forward}
