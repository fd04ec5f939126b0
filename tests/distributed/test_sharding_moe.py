"""``moe_experts`` on DTensors (ops/moe/sharding.py, docs/distributed.md): tokens split, expert weights replicated.

On a 2-rank mesh (CPU over gloo in float64; 2 GPUs over NCCL in float32, marked ``cuda``), hidden states and the
routing sharded on their tokens with the expert weights replicated give the one-process output (sharded on its
tokens) and gradients (the weights' as partial sums over each rank's tokens) to a relative error of 1e-10
(float64) / 1e-5 (float32), eagerly with nothing communicated and under ``torch.compile(fullgraph=True)`` with
the op in the graph and no collective (tests/distributed/dtensor_checks.py). Replicated inputs run replicated.
"""
from __future__ import annotations

import pytest
import torch

from distributed.dtensor_checks import BACKENDS, DEVICES
from distributed.spawn import run_in_processes

pytest.importorskip("torch.distributed.tensor.experimental")


def _moe_cases(dtype) -> list:
    from torch.distributed.tensor import Replicate, Shard

    from distributed.dtensor_checks import TOLERANCES, Case
    from kda_compile.ops import moe_experts

    gen = torch.Generator().manual_seed(0)
    tokens, top_k, experts, hidden, inter = 6, 2, 4, 8, 6
    scores = torch.randn(tokens, experts, generator=gen, dtype=torch.float64)
    weights, index = scores.softmax(-1).topk(top_k, dim=-1)
    index[0, 1] = experts  # a sentinel slot (HF marks dropped pairs with E): contributes nothing
    inputs = {"x": torch.randn(tokens, hidden, generator=gen, dtype=torch.float64).to(dtype),
              "index": index, "weights": weights.to(dtype),
              "gate_up": torch.randn(experts, 2 * inter, hidden, generator=gen, dtype=torch.float64).to(dtype),
              "down": torch.randn(experts, hidden, inter, generator=gen, dtype=torch.float64).to(dtype)}

    def call(t):
        return (moe_experts(t["x"], t["index"], t["weights"], t["gate_up"], t["down"]),)

    tol, rep, split = TOLERANCES[dtype], Replicate(), Shard(0)
    return [
        Case("moe_experts token-sharded", call, inputs,
             {"x": split, "index": split, "weights": split, "gate_up": rep, "down": rep},
             output_placements=(split,), ops=("moe_experts",), tol=tol),
        Case("moe_experts replicated", call, inputs, dict.fromkeys(inputs, rep), output_placements=(rep,),
             ops=("moe_experts",), tol=tol),
    ]


def moe_worker(rank: int, world_size: int, device: str) -> None:
    from torch.distributed.tensor import init_device_mesh

    from distributed.dtensor_checks import DTYPES, check_case

    mesh = init_device_mesh(device, (world_size,))
    for case in _moe_cases(DTYPES[device]):
        check_case(case, mesh)


@pytest.mark.parametrize("device", DEVICES)
def test_moe_experts_on_token_sharded_dtensors(device):
    run_in_processes(moe_worker, 2, device, backend=BACKENDS[device], timeout_s=180)
