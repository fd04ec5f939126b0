"""The softmax-attention family on DTensors: ``attention``, ``mla_attention``, ``dsa_indexer_topk``,
``dsa_sparse_attention``, ``block_sparse_attention`` (ops/attention|mla|dsa|block_sparse/sharding.py,
docs/distributed.md).

On a 2-rank mesh (CPU over gloo in float64; 2 GPUs over NCCL in float32, marked ``cuda``), inputs sharded on
their heads give the one-process outputs and gradients to a relative error of 1e-10 (float64) / 1e-5 (float32),
eagerly with nothing communicated and under
``torch.compile(fullgraph=True)`` with the op in the graph and no collective (tests/distributed/dtensor_checks.py):
GQA attention with sinks and a per-head mask that takes a gradient; MQA attention (the key / value head
replicated, its gradients partial sums) with a broadcast mask; MLA in both forms (latent and rope key
replicated, ``kv_b_proj.weight`` sharded on its rows); DSA's sparse attention in the absorbed MQA form and with
grouped key heads; the block-sparse attention with query heads, their KV groups and the groups' selections
sharded together. DSA's indexer is replicated-only: replicated inputs communicate nothing; head-sharded ones
are gathered by DTensor and still give the one-process indices.
"""
from __future__ import annotations

import pytest
import torch

from distributed.dtensor_checks import BACKENDS, DEVICES
from distributed.spawn import run_in_processes

pytest.importorskip("torch.distributed.tensor.experimental")


def _randn(gen, dtype):
    return lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def _attention_cases(gen, dtype) -> list:
    from torch.distributed.tensor import Replicate, Shard

    from distributed.dtensor_checks import TOLERANCES, Case
    from kda_compile.ops import attention, attention_with_lse

    rand, tol = _randn(gen, dtype), TOLERANCES[dtype]
    B, H, S, D = 2, 4, 6, 16
    gqa = {"q": rand(B, H, S, D), "k": rand(B, 2, S, D), "v": rand(B, 2, S, 8),
           "sinks": rand(H), "mask": rand(B, H, S, S)}
    mqa = {"q": rand(B, H, S, D), "k": rand(B, 1, S, D), "v": rand(B, 1, S, D),
           "mask": rand(B, 1, S, S)}

    def gqa_call(t):
        return attention_with_lse(t["q"], t["k"], t["v"], attn_mask=t["mask"], sinks=t["sinks"], is_causal=True,
                                  softcap=20.0)

    def mqa_call(t):
        return (attention(t["q"], t["k"], t["v"], attn_mask=t["mask"]),)

    heads = Shard(1)
    return [
        Case("attention GQA", gqa_call, gqa, {"q": heads, "k": heads, "v": heads, "sinks": Shard(0), "mask": heads},
             output_placements=(heads, heads), ops=("attention_fwd",), tol=tol),
        Case("attention MQA", mqa_call, mqa, {"q": heads, "k": Replicate(), "v": Replicate(), "mask": Replicate()},
             output_placements=(heads,), ops=("attention_fwd",), tol=tol),
    ]


def _mla_cases(gen, dtype) -> list:
    from torch.distributed.tensor import Replicate, Shard

    from distributed.dtensor_checks import TOLERANCES, Case
    from kda_compile.ops import mla_attention

    rand, tol = _randn(gen, dtype), TOLERANCES[dtype]
    B, H, T, Dn, Dr, Dv, R = 2, 4, 7, 16, 8, 16, 32
    inputs = {"q_nope": rand(B, H, T, Dn), "q_rope": rand(B, H, T, Dr), "kv": rand(B, T, R),
              "k_rope": rand(B, T, Dr), "w": rand(H * (Dn + Dv), R)}
    placements = {"q_nope": Shard(1), "q_rope": Shard(1), "kv": Replicate(), "k_rope": Replicate(), "w": Shard(0)}

    def call(path, queries):
        def run(t):
            return (mla_attention(t["q_nope"][:, :, -queries:], t["q_rope"][:, :, -queries:], t["kv"], t["k_rope"],
                                  t["w"], scale=0.3, is_causal=True, path=path),)
        return run

    return [Case(f"mla_attention {path}", call(path, queries), inputs, placements, output_placements=(Shard(1),),
                 ops=("mla_attention_fwd",), tol=tol) for path, queries in (("expanded", T), ("absorbed", 2))]


def _dsa_cases(gen, dtype) -> list:
    from torch.distributed.tensor import Replicate, Shard

    from distributed.dtensor_checks import TOLERANCES, Case
    from kda_compile.ops import dsa_indexer_topk, dsa_sparse_attention

    rand, tol = _randn(gen, dtype), TOLERANCES[dtype]
    B, S, HI, DI, Hq, D, TOPK = 2, 6, 4, 16, 4, 24, 4
    index = {"q": rand(B, S, HI, DI), "k": rand(B, S, DI), "w": rand(B, S, HI)}
    index = {name: t.float() for name, t in index.items()}  # the indexer takes half precision or float32
    indices = dsa_indexer_topk(index["q"], index["k"], index["w"], TOPK)

    def indexer(t):
        return (dsa_indexer_topk(t["q"], t["k"], t["w"], TOPK),)

    absorbed = {"q": rand(B, S, Hq, D), "k": rand(B, S, 1, D), "idx": indices}
    grouped = {"q": rand(B, S, Hq, D), "k": rand(B, S, 2, D), "v": rand(B, S, 2, 8), "idx": indices}
    heads, rep = Shard(2), Replicate()
    return [
        Case("dsa_indexer_topk replicated", indexer, index, dict.fromkeys(index, rep), grad=False,
             output_placements=(rep,), ops=("dsa_indexer_topk",)),
        Case("dsa_indexer_topk head-sharded", indexer, index, {"q": heads, "k": rep, "w": heads}, grad=False,
             expect_comms=True, output_placements=(rep,), ops=("dsa_indexer_topk",)),
        Case("dsa_sparse_attention absorbed", lambda t: dsa_sparse_attention(t["q"], t["k"], None, t["idx"], d_v=16),
             absorbed, {"q": heads, "k": rep, "idx": rep}, output_placements=(heads, heads),
             ops=("dsa_sparse_attention_fwd",), tol=tol),
        Case("dsa_sparse_attention grouped", lambda t: dsa_sparse_attention(t["q"], t["k"], t["v"], t["idx"]),
             grouped, {"q": heads, "k": heads, "v": heads, "idx": rep}, output_placements=(heads, heads),
             ops=("dsa_sparse_attention_fwd",), tol=tol),
    ]


def _block_sparse_cases(gen, dtype) -> list:
    from torch.distributed.tensor import Replicate, Shard

    from distributed.dtensor_checks import TOLERANCES, Case
    from kda_compile.ops import block_sparse_attention

    rand, tol = _randn(gen, dtype), TOLERANCES[dtype]
    B, H, G, S, T, D = 2, 4, 2, 5, 20, 16
    idx = torch.randint(-1, 3, (B, G, S, 2), generator=gen)
    inputs = {"q": rand(B, H, S, D), "k": rand(B, G, T, D), "v": rand(B, G, T, 8), "idx": idx,
              "positions": torch.randint(0, T, (B, S), generator=gen)}

    def call(t):
        return (block_sparse_attention(t["q"], t["k"], t["v"], t["idx"], block_size=8,
                                       query_positions=t["positions"]),)

    heads = Shard(1)
    return [Case("block_sparse_attention", call, inputs,
                 {"q": heads, "k": heads, "v": heads, "idx": heads, "positions": Replicate()},
                 output_placements=(heads,), ops=("block_sparse_attention_fwd",), tol=tol)]


def attention_family_worker(rank: int, world_size: int, device: str) -> None:
    from torch.distributed.tensor import init_device_mesh

    from distributed.dtensor_checks import DTYPES, check_case

    mesh = init_device_mesh(device, (world_size,))
    gen = torch.Generator().manual_seed(0)
    for cases in (_attention_cases, _mla_cases, _dsa_cases, _block_sparse_cases):
        for case in cases(gen, DTYPES[device]):
            check_case(case, mesh)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_family_on_head_sharded_dtensors(device):
    """One process group for the three families: each spawn costs two fresh imports of torch and kda_compile."""
    run_in_processes(attention_family_worker, 2, device, backend=BACKENDS[device], timeout_s=180)
