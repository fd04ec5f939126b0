"""The pooled indexer's Triton kernels (``ops/dsa/pooled/triton_indexer.py``) against the op's torch path
(``pooled.pooled_indexer_topk_reference``) and the dense float64 oracle (``pooled_naive.py``).

Runs on CUDA, or on CPU under the Triton interpreter (small shapes, float32 / float16). Inputs are quantised so
that every float32 pool score is exact (small-integer queries and keys, head weights in quarters, a gate that
gives each pool key one token's key): the selection must then be the same, index for index, tie for tie.
Covered: pool sizes 1-8, left padding, batch > 1, top-k above the visible pool count, the tail on and off,
decode (S = 1), chunks over a cache, a static cache's unfilled slots, padded queries, blockwise merging (small
pool and query blocks), random (unquantised) inputs as a true top-k, also with negative scores in rows that see
fewer pools than slots; a launcher that reads no tensor value on the host.
"""
import pytest
import torch

from kda_compile.ops.dsa.pooled.reference import pooled_indexer_topk_reference

from .pooled_naive import assert_true_pooled_topk, dense_pooled, no_host_reads, quantised_pooled_inputs

from triton_device import triton_device  # noqa: E402

DEVICE = triton_device("the pooled DSA indexer kernels")

import kda_compile.ops.dsa.pooled.triton_indexer as triton_pooled  # noqa: E402
from kda_compile.ops.dsa.pooled.triton_indexer import pooled_indexer_topk_triton  # noqa: E402


def quantised_inputs(*shape, **kw):
    return quantised_pooled_inputs(*shape, device=DEVICE, **kw)


def _call(fn, a, topk, tail, scale=0.5):
    return fn(a["q"], a["k"], a["gate"], a["weights"], a["key_valid"], a["ape"], a["query_mask"], topk, scale,
              a["q_offset"], tail)


def _dense(a, topk, tail, scale=0.5):
    c = {n: (v.cpu() if torch.is_tensor(v) else v) for n, v in a.items()}
    return dense_pooled(c["q"], c["k"], c["gate"], c["weights"], c["key_valid"], c["ape"], c["query_mask"], topk,
                        scale, c["q_offset"], tail)


CASES = [  # (B, S, T, H_I, D, pool, topk, tail, length)
    (2, 12, 12, 3, 8, 1, 5, True, None),      # pools of one token (no tail)
    (2, 16, 16, 2, 8, 2, 6, True, None),
    (3, 17, 17, 3, 16, 3, 9, False, None),    # batch 3, the tail off
    (2, 20, 20, 2, 8, 4, 64, True, None),     # top-k above every visible pool count
    (2, 1, 29, 3, 8, 4, 8, True, None),       # decode (S = 1), T % P != 0
    (2, 1, 24, 3, 8, 8, 16, False, None),     # decode, T % P == 0, the tail off
    (2, 6, 27, 2, 8, 5, 10, True, None),      # a short chunk over a cache (heads kernel)
    (2, 18, 30, 2, 8, 6, 12, True, None),     # a chunk of 18 over a cache (query-tile kernel)
    (1, 17, 17, 2, 8, 7, 14, True, None),
    (2, 3, 26, 2, 8, 4, 8, True, 19),         # a static cache: slots past the filled length
    (2, 5, 5, 2, 8, 8, 8, True, None),        # T below one pool: only the tail
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,s,t,heads,dim,pool,topk,tail,length", CASES)
def test_kernel_equals_torch_path(b, s, t, heads, dim, pool, topk, tail, length, dtype):
    a = quantised_inputs(b, s, t, heads, dim, pool, dtype=dtype, seed=b + s + t + pool, length=length)
    got = _call(pooled_indexer_topk_triton, a, topk, tail)
    want = _call(pooled_indexer_topk_reference, a, topk, tail)
    assert got.dtype == torch.int32 and got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got, want)
    assert torch.equal(got.cpu(), _dense(a, topk, tail))


@pytest.mark.parametrize("s,length", [(1, None), (3, 15), (18, None)])  # decode, a static cache, the query tiles
def test_launcher_reads_no_tensor_value(s, length, monkeypatch):
    """Launches, blocks and the merge sized by shapes and ``q_offset`` alone (no synchronisation on CUDA: a
    decode call can be captured in a CUDA graph once its kernels are compiled); the same selection."""
    a = quantised_inputs(2, s, 30, 2, 8, 4, seed=s, length=length)
    want = _call(pooled_indexer_topk_reference, a, 16, True)
    _call(pooled_indexer_topk_triton, a, 16, True)  # compiles the kernels (CUDA) outside the guard
    monkeypatch.setattr(triton_pooled, "POOL_BLOCK", 3)
    with no_host_reads(monkeypatch):
        got = _call(pooled_indexer_topk_triton, a, 16, True)
    assert torch.equal(got, want)


def test_ties_take_the_lower_pool():
    """A zero query scores every pool 0 and zero head weights leave only ties: the lowest pools win."""
    a = quantised_inputs(2, 16, 40, 2, 8, 4, seed=11, pad=False)
    a["q"][0, 15] = 0
    a["weights"][1, 15] = 0
    got = _call(pooled_indexer_topk_triton, a, 12, True)
    assert torch.equal(got, _call(pooled_indexer_topk_reference, a, 12, True))
    assert got[0, 15, :12].tolist() == list(range(12)) and got[1, 15, :12].tolist() == list(range(12))


def test_small_blocks_merge_the_same(monkeypatch):
    """Pool blocks of 3 pools and query blocks of one row tile: the running top-k merges to the same answer."""
    a = quantised_inputs(2, 40, 48, 2, 8, 2, seed=5)
    whole = _call(pooled_indexer_topk_triton, a, 10, True)
    monkeypatch.setattr(triton_pooled, "POOL_BLOCK", 3)
    monkeypatch.setattr(triton_pooled, "KEY_BUFFER_BYTES", 1)
    blocked = _call(pooled_indexer_topk_triton, a, 10, True)
    assert torch.equal(blocked, whole)
    assert torch.equal(blocked, _call(pooled_indexer_topk_reference, a, 10, True))


def test_no_key_valid_no_query_mask():
    """Without a key mask (no [B, T] mask is made, the pools start at token 0): the same selection as with a mask
    that keeps every key, on both paths."""
    a = quantised_inputs(2, 9, 21, 2, 8, 3, seed=2, pad=False)
    a["key_valid"] = a["query_mask"] = None
    got = _call(pooled_indexer_topk_triton, a, 9, True)
    assert torch.equal(got, _call(pooled_indexer_topk_reference, a, 9, True))
    a["key_valid"] = torch.ones(2, 21, dtype=torch.bool, device=DEVICE)
    assert torch.equal(got, _call(pooled_indexer_topk_triton, a, 9, True))
    assert torch.equal(got, _call(pooled_indexer_topk_reference, a, 9, True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_random_inputs_true_topk(dtype):
    """Unquantised inputs: rounding may order near-equal pools differently; the selection is still a top-k."""
    g = torch.Generator().manual_seed(4)
    a = quantised_inputs(2, 20, 44, 3, 16, 4, dtype=dtype, seed=4)
    a["q"] = torch.randn(a["q"].shape, generator=g).to(dtype).to(DEVICE)
    a["k"] = torch.randn(a["k"].shape, generator=g).to(dtype).to(DEVICE)
    a["weights"] = torch.randn(a["weights"].shape, generator=g).to(DEVICE)
    a["ape"] = torch.randn(a["ape"].shape, generator=g).to(DEVICE)
    got = _call(pooled_indexer_topk_triton, a, 16, True, scale=0.3)
    want = _call(pooled_indexer_topk_reference, a, 16, True, scale=0.3)
    assert_true_pooled_topk(got, want, a, 16, 0.3)


def test_negative_scores_fewer_visible_pools_true_topk():
    """Signed head weights (``randn * H ** -0.5``) and queries that see fewer pools than the slots (the first
    topk / P - 1 of them): the kernel takes every visible pool, negative ones too, in score order."""
    g = torch.Generator().manual_seed(9)
    heads, dim, pool, topk, scale = 2, 16, 4, 32, 0.25
    a = quantised_inputs(2, 48, 48, heads, dim, pool, seed=9)
    for name in ("q", "k", "gate", "ape"):
        a[name] = torch.randn(a[name].shape, generator=g).to(DEVICE)
    a["weights"] = (torch.randn(a["weights"].shape, generator=g) * heads ** -0.5).to(DEVICE)
    got = _call(pooled_indexer_topk_triton, a, topk, True, scale=scale)
    want = _call(pooled_indexer_topk_reference, a, topk, True, scale=scale)
    assert_true_pooled_topk(got, want, a, topk, scale)
    assert_true_pooled_topk(want, want, a, topk, scale)
    # row 0 is unpadded: queries 7..26 see 2 to 6 of the 8 slots' pools; all are taken, the last two slots empty
    assert bool((got[0, 7:27, :8] >= 0).all()) and bool((got[0, 7:27, 24:32] == -1).all())


def test_cuda_dispatch_runs_the_kernel_or_says_why():
    """``kernels.pooled_indexer_topk_cuda`` (the op's CUDA implementation) takes the Triton path for the kernel
    dtypes and falls back, recorded, for float64."""
    from kda_compile.ops._common import clear_fallback_events, fallback_events
    from kda_compile.ops.dsa import kernels

    a = quantised_inputs(2, 9, 21, 2, 8, 3, seed=6)
    clear_fallback_events()
    assert torch.equal(_call(kernels.pooled_indexer_topk_cuda, a, 9, True),
                       _call(pooled_indexer_topk_reference, a, 9, True))
    assert not [e for e in fallback_events() if e.op == "dsa_pooled_indexer_topk"]
    a64 = {**a, "q": a["q"].double(), "k": a["k"].double()}
    assert torch.equal(_call(kernels.pooled_indexer_topk_cuda, a64, 9, True),
                       _call(pooled_indexer_topk_reference, a, 9, True))
    assert [e.reason for e in fallback_events() if e.op == "dsa_pooled_indexer_topk"] == [
        "torch.float64 inputs have no Triton kernel"]
