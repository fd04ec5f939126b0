"""DTensor placements of the KDA ops (and, through :func:`delta_rule_rules`, of the GDN ops, whose arguments
have the same names and head layout). docs/distributed.md has the table.

Every head of a delta rule is independent, so a rank holding a block of heads runs the op on that block
alone: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g ``[B, T, HV, (K)]``, beta ``[B, T, HV]``, o and do on
dim 2; the states ``[N, HV, K, V]`` on dim 1; A_log ``[HV]`` and dt_bias (``[HV * K]`` head-major for KDA,
``[HV]`` for GDN) on dim 0; cu_seqlens replicated. Grouped value heads (``HV = G * H``: value head ``j`` reads
q / k head ``j // G``) stay grouped when H and HV both divide into the same number of blocks: rank r holds
q / k heads ``[r H/n, (r+1) H/n)`` and exactly their value heads ``[r HV/n, (r+1) HV/n)``. The residuals a
backend keeps between forward and backward all carry their heads on dim 2 (FLA's ``[B, T, HV, .]``, its chunk
states ``[B, NT, HV, K, V]``, the normalised q / k and their ``[B, T, H]`` rstd), or are 1-D placeholders.
"""
from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard

from kda_compile.ops._sharding import (OpCall, Strategy, heads_split_evenly, output_shapes, placeholder, replicated,
                                       shard_unless_placeholder)

HEAD_DIMS = {"q": 2, "k": 2, "v": 2, "g": 2, "beta": 2, "do": 2, "A_log": 0, "dt_bias": 0, "initial_state": 1,
             "state": 1, "dht": 1}
RESIDUAL_HEAD_DIM = 2
RESIDUALS = tuple(f"res{i}" for i in range(13))
GRAD_HEAD_DIMS = (2, 2, 2, 2, 2, 0, 0, 1)  # dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0


def _heads_split(call: OpCall) -> bool:
    """Every head count the call carries (q / k heads, value heads, the states', A_log's...) splits into the
    blocks its inputs are sharded in; placeholders (absent inputs) carry none."""
    counts = [shape[dim] for shape, dim in ((call.shape(name), dim) for name, dim in HEAD_DIMS.items())
              if shape is not None and not placeholder(shape) and len(shape) > dim]
    return heads_split_evenly(call, HEAD_DIMS, counts)


def _head_inputs(call: OpCall) -> dict:
    inputs = {name: shard_unless_placeholder(call.shape(name), dim) for name, dim in HEAD_DIMS.items()
              if call.spec(name) is not None}
    inputs.update({name: shard_unless_placeholder(call.shape(name), RESIDUAL_HEAD_DIM)
                   for name in RESIDUALS if call.spec(name) is not None})
    return inputs


def forward(call: OpCall) -> list[Strategy]:
    """``(o, final_state[, res0..res12])``: o on its heads, the state on dim 1 (a placeholder when not asked
    for), each residual on dim 2 unless a placeholder."""
    if not _heads_split(call):
        return [replicated(call)]
    o, state, *residuals = output_shapes(call)
    outputs = (Shard(2), shard_unless_placeholder(state, 1),
               *(shard_unless_placeholder(r, RESIDUAL_HEAD_DIM) for r in residuals))
    return [replicated(call), Strategy(outputs, _head_inputs(call))]


def in_place(call: OpCall) -> list[Strategy]:
    """``o`` of the decode op that writes its state in place (``*_inplace``): o on its heads, the state (written
    where it lies) on dim 1. Pass the state in the placement of the other inputs' heads: a state DTensor has to
    redistribute is a copy, and the copy would be the tensor that gets written."""
    if not _heads_split(call):
        return [replicated(call)]
    return [replicated(call), Strategy((Shard(2),), _head_inputs(call))]


def backward(call: OpCall) -> list[Strategy]:
    """``(dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0)`` each placed as its input (placeholders for absent
    inputs replicated)."""
    if not _heads_split(call):
        return [replicated(call)]
    outputs = tuple(shard_unless_placeholder(shape, dim) for shape, dim in zip(output_shapes(call), GRAD_HEAD_DIMS))
    return [replicated(call), Strategy(outputs, _head_inputs(call))]


def argument_error(call: OpCall) -> list[Strategy]:
    """The op that raises a deferred argument error: its placeholder outputs are replicated and ``like`` is
    taken as it comes (no communication before the error)."""
    like = call.shape("like")
    placements = [Replicate()] + [Shard(d) for d in range(len(like))]
    return [Strategy((Replicate(), Replicate()), {"like": p}) for p in placements]


def delta_rule_rules(chunk: str, recurrent: str) -> dict:
    """The rules of a chunked delta-rule op pair (``<chunk>_fwd`` / ``<chunk>_bwd``) and its decode ops."""
    return {f"{chunk}_fwd": forward, f"{chunk}_bwd": backward, f"{recurrent}_fwd": forward,
            f"{recurrent}_inplace": in_place}


RULES = {**delta_rule_rules("chunk_kda", "fused_recurrent_kda"), "argument_error": argument_error}
