"""The Hopper wgmma DSA sparse-attention forward (``ops/dsa/sparse/wgmma_forward.py``) against the blockwise reference
in float64 (relative RMS error: bfloat16 1e-2, float16 3e-3 on o; lse within 2e-3 absolute, -inf where a row sees
no index) and against the Triton kernel. Its choice and switch on the CPU; the kernel on an sm_90 GPU: decode and
prefill, split and unsplit, 512 and 576 channel rows, -1 and repeated indices, top-k not a multiple of 64,
strided inputs, several KV heads, rows with no valid index, a CUDA-graph capture."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_compile.ops import _common
from kda_compile.ops._common import clear_fallback_events, fallback_events
from kda_compile.ops.dsa.sparse import wgmma_forward as wgmma_sparse
from kda_compile.ops.dsa.reference import sparse_attention_reference
from kda_compile.testing import assert_rel_close

cuda = pytest.mark.cuda
sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                          reason="needs an sm_90 GPU")
O_TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3}


# ---- CPU ---------------------------------------------------------------------------------------
def _shapes(hq=128, hkv=1, d_qk=576, device="cpu", dtype=torch.bfloat16):
    q = torch.zeros(1, 1, hq, d_qk, dtype=dtype, device=device)
    k = torch.zeros(1, 8, hkv, d_qk, dtype=dtype, device=device)
    return q, k, torch.zeros(1, 1, 4, dtype=torch.int32, device=device)


def test_outside_design_names_the_reason(monkeypatch):
    q, k, idx = _shapes()
    assert wgmma_sparse.outside_design(q, k, None, 512) == "not a CUDA tensor"
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(_common, "cuda_index", lambda device: 0)
    monkeypatch.setattr(_common, "device_capability", lambda index: (9, 0))
    assert wgmma_sparse.outside_design(q, k, None, 512) is None
    assert wgmma_sparse.outside_design(*_shapes(d_qk=512)[:2], None, 512) is None
    assert wgmma_sparse.outside_design(*_shapes(hq=128, hkv=2)[:2], None, 512) is None
    assert "float32" in wgmma_sparse.outside_design(*_shapes(dtype=torch.float32)[:2], None, 512)
    assert "separate value tensor" in wgmma_sparse.outside_design(q, k, k, 512)
    assert "d_qk 192 / d_v 128" in wgmma_sparse.outside_design(*_shapes(d_qk=192)[:2], None, 128)
    assert "32 query heads per KV head" in wgmma_sparse.outside_design(*_shapes(hq=32)[:2], None, 512)
    monkeypatch.setattr(_common, "device_capability", lambda index: (8, 0))
    assert wgmma_sparse.outside_design(q, k, None, 512) == "needs an sm_90 GPU (warpgroup MMA), got sm_80"


def test_layout_problems_are_named():
    q, k, idx = _shapes()
    assert wgmma_sparse.layout_problem(q, k, idx) is None
    assert "int64" in wgmma_sparse.layout_problem(q, k, idx.long())
    assert "k is torch.float16" in wgmma_sparse.layout_problem(q, k.half(), idx)
    odd = torch.zeros(1, 1, 128, 580, dtype=torch.bfloat16)[..., 1:577]
    assert "q's rows are not contiguous and 16-byte aligned" in wgmma_sparse.layout_problem(odd, k, idx)


def test_choice_and_switch(monkeypatch):
    q, k, idx = _shapes()
    clear_fallback_events()
    assert wgmma_sparse.choose_kernel(q, k, None, idx, 512) == "triton"  # CPU: outside the design, not recorded
    assert not fallback_events()
    monkeypatch.setenv(wgmma_sparse.KERNEL_ENV, "cuda")
    assert wgmma_sparse.choose_kernel(q, k, None, idx, 512) == "triton"
    (event,) = fallback_events()
    assert event.op == "dsa_sparse_attention" and "not a CUDA tensor" in event.reason
    monkeypatch.setenv(wgmma_sparse.KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="KDA_COMPILE_SPARSE_ATTENTION_KERNEL must be one of auto, triton, cuda"):
        wgmma_sparse.choose_kernel(q, k, None, idx, 512)
    clear_fallback_events()


# ---- CUDA --------------------------------------------------------------------------------------
def _indices(b, s, t, topk, *, empty_rows=0, repeats=False, generator=None):
    """Random distinct key indices per query, about a quarter -1, the last ``empty_rows`` queries all -1."""
    keys = torch.rand(b, s, t, generator=generator).argsort(-1)[..., :topk].to(torch.int32)
    if topk > t:
        keys = torch.cat([keys, torch.full((b, s, topk - t), -1, dtype=torch.int32)], -1)
    keys = keys.where(torch.rand(keys.shape, generator=generator) > 0.25, torch.full_like(keys, -1))
    if repeats:
        keys[..., 1::7] = keys[..., 0:1]
    if empty_rows:
        keys[:, s - empty_rows:] = -1
    return keys


def _check(b, s, hq, hkv, t, topk, d_qk, dtype, *, splits=None, empty_rows=0, repeats=False, strided=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, d_qk, generator=g).to(dtype)
    k = torch.randn(b, t, hkv, d_qk, generator=g).to(dtype)
    idx = _indices(b, s, t, topk, empty_rows=empty_rows, repeats=repeats, generator=g)
    scale = d_qk ** -0.5
    want_o, want_lse = sparse_attention_reference(q.double(), k.double(), None, idx.long(), scale, 512)
    qc, kc, ic = q.cuda(), k.cuda(), idx.cuda()
    if strided:  # rows of wider buffers, heads / tokens not packed, indices every other column
        qc = torch.zeros(b, s, hq + 64, d_qk + 64, dtype=dtype, device="cuda")[:, :, 64:, 32:32 + d_qk]
        qc.copy_(q)
        kc = torch.zeros(b, t, hkv, d_qk + 128, dtype=dtype, device="cuda")[..., :d_qk]
        kc.copy_(k)
        ic = torch.full((b, s, 2 * topk), 7, dtype=torch.int32, device="cuda")[..., ::2]
        ic.copy_(idx)
    assert wgmma_sparse.choose_kernel(qc, kc, None, ic, 512) == "cuda"
    o, lse = wgmma_sparse.sparse_attention_fwd_wgmma(qc, kc, ic, scale, topk_splits=splits)
    assert o.dtype == dtype and o.shape == (b, s, hq, 512) and lse.shape == (b, s, hq)
    assert_rel_close(o.cpu(), want_o, O_TOL[dtype], name="o")
    dead = torch.isneginf(want_lse)
    assert torch.equal(torch.isneginf(lse.cpu()), dead)
    assert not torch.isnan(lse).any()
    torch.testing.assert_close(lse.cpu()[~dead], want_lse.float()[~dead], rtol=0, atol=2e-3)
    assert not o.cpu()[dead].any()
    return o, lse


CASES = {  # name: (b, s, hq, hkv, t, topk, d_qk, dtype, keywords)
    "decode-deepseek-batch4": (4, 1, 128, 1, 3000, 2048, 576, torch.bfloat16, {}),
    "decode-glm5-64-heads": (2, 1, 64, 1, 2500, 2048, 576, torch.bfloat16, {}),
    "decode-no-rope": (2, 1, 64, 1, 900, 512, 512, torch.bfloat16, {}),
    "decode-fp16-repeats": (2, 1, 128, 1, 700, 1000, 576, torch.float16, {"repeats": True}),
    "mtp-two-queries-split": (2, 2, 128, 1, 5000, 2048, 576, torch.bfloat16, {"splits": 5}),
    "prefill-unsplit": (1, 40, 128, 1, 300, 256, 576, torch.bfloat16, {"splits": 1, "empty_rows": 3}),
    "topk-above-t": (1, 3, 64, 1, 50, 130, 576, torch.bfloat16, {}),
    "two-kv-heads": (1, 2, 256, 2, 400, 192, 576, torch.bfloat16, {"splits": 2}),
    "strided": (2, 3, 128, 1, 600, 320, 576, torch.bfloat16, {"strided": True, "splits": 3}),
    "all-dead-split": (1, 1, 64, 1, 100, 256, 576, torch.bfloat16, {"empty_rows": 1, "splits": 4}),
}


@cuda
@sm90
@pytest.mark.parametrize("name", CASES)
def test_against_reference(name):
    *shape, keywords = CASES[name]
    _check(*shape, **keywords)


@cuda
@sm90
@settings(max_examples=15, deadline=None)
@given(b=st.integers(1, 3), s=st.integers(1, 4), heads=st.sampled_from([(64, 1), (128, 1), (128, 2)]),
       t=st.integers(1, 3000), topk=st.integers(1, 2100), rope=st.booleans(), splits=st.sampled_from([None, 1, 3]),
       seed=st.integers(0, 2 ** 16))
def test_fuzzed_shapes(b, s, heads, t, topk, rope, splits, seed):
    _check(b, s, heads[0], heads[1], t, topk, 576 if rope else 512, torch.bfloat16, splits=splits, seed=seed)


@cuda
@sm90
def test_matches_the_triton_kernel_and_the_op_routes_here(monkeypatch):
    from kda_compile.ops.dsa import kernels
    from kda_compile.ops.dsa.sparse.triton_forward import sparse_attention_fwd_triton

    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(8, 1, 128, 576, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(8, 4096, 1, 576, device="cuda", generator=g, dtype=torch.bfloat16)
    idx = torch.randint(-1, 4096, (8, 1, 2048), device="cuda", generator=g, dtype=torch.int32)
    o, lse = wgmma_sparse.sparse_attention_fwd_wgmma(q, k, idx, 0.07)
    o_t, lse_t = sparse_attention_fwd_triton(q, k, None, idx, 0.07, 512)
    assert_rel_close(o.float(), o_t.float(), 1e-2, name="o vs Triton")
    torch.testing.assert_close(lse, lse_t, rtol=0, atol=2e-3)
    clear_fallback_events()
    o_op, _ = kernels.sparse_attention_fwd_cuda(q, k, None, idx, 0.07, 512)
    assert torch.equal(o_op, o) and not fallback_events()
    monkeypatch.setenv(wgmma_sparse.KERNEL_ENV, "triton")
    assert torch.equal(kernels.sparse_attention_fwd_cuda(q, k, None, idx, 0.07, 512)[0], o_t)


@cuda
@sm90
def test_cuda_graph_capture_and_replay():
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(2, 1, 128, 576, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(2, 2048, 1, 576, device="cuda", generator=g, dtype=torch.bfloat16)
    idx = torch.randint(0, 2048, (2, 1, 2048), device="cuda", generator=g, dtype=torch.int32)
    wgmma_sparse.sparse_attention_fwd_wgmma(q, k, idx, 0.1)  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = wgmma_sparse.sparse_attention_fwd_wgmma(q, k, idx, 0.1)
    q.copy_(torch.randn(q.shape, device="cuda", generator=g, dtype=q.dtype))
    idx.copy_(torch.randint(-1, 2048, idx.shape, device="cuda", generator=g, dtype=torch.int32))
    graph.replay()
    want_o, want_lse = wgmma_sparse.sparse_attention_fwd_wgmma(q, k, idx, 0.1)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
    assert math.isfinite(float(lse.max()))
