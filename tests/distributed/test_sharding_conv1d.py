"""``causal_conv1d_update`` on DTensors (ops/conv1d/sharding.py, docs/distributed.md): sequences or channels split.

On a 2-rank mesh (CPU over gloo in float64; 2 GPUs over NCCL in float32, marked ``cuda``), x and the conv state
sharded on their sequences (weights replicated) or on their channels (weight and bias with them) give the
one-process output and rolled state, eagerly with nothing communicated and under ``torch.compile(fullgraph=True)``
with the op in the graph and no collective (tests/distributed/dtensor_checks.py). The op has no backward.
"""
from __future__ import annotations

import pytest
import torch

from distributed.dtensor_checks import BACKENDS, DEVICES
from distributed.spawn import run_in_processes

pytest.importorskip("torch.distributed.tensor.experimental")


def _conv_cases(dtype) -> list:
    from torch.distributed.tensor import Replicate, Shard

    from distributed.dtensor_checks import TOLERANCES, Case
    from kda_compile.ops import causal_conv1d_update

    gen = torch.Generator().manual_seed(0)
    inputs = {"x": torch.randn(4, 6, 1, generator=gen, dtype=torch.float64).to(dtype),
              "state": torch.randn(4, 6, 4, generator=gen, dtype=torch.float64).to(dtype),
              "weight": torch.randn(6, 4, generator=gen, dtype=torch.float64).to(dtype),
              "bias": torch.randn(6, generator=gen, dtype=torch.float64).to(dtype)}

    def call(t):
        out = causal_conv1d_update(t["x"], t["state"], t["weight"], t["bias"], "silu")
        return out, t["state"]  # the rolled state is compared too

    tol, rep = TOLERANCES[dtype], Replicate()
    return [
        Case("conv1d update sequence-sharded", call, inputs,
             {"x": Shard(0), "state": Shard(0), "weight": rep, "bias": rep},
             output_placements=(Shard(0), Shard(0)), ops=("causal_conv1d_update",), tol=tol, grad=False),
        Case("conv1d update channel-sharded", call, inputs,
             {"x": Shard(1), "state": Shard(1), "weight": Shard(0), "bias": Shard(0)},
             output_placements=(Shard(1), Shard(1)), ops=("causal_conv1d_update",), tol=tol, grad=False),
    ]


def conv_worker(rank: int, world_size: int, device: str) -> None:
    from torch.distributed.tensor import init_device_mesh

    from distributed.dtensor_checks import DTYPES, check_case

    mesh = init_device_mesh(device, (world_size,))
    for case in _conv_cases(DTYPES[device]):
        check_case(case, mesh)


@pytest.mark.parametrize("device", DEVICES)
def test_causal_conv1d_update_on_sharded_dtensors(device):
    run_in_processes(conv_worker, 2, device, backend=BACKENDS[device], timeout_s=180)
