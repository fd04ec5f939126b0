"""The DSA Triton kernels (``ops/dsa/triton_indexer.py``, ``triton_sparse.py``, ``triton_sparse_bwd.py``)
against the blockwise reference and the dense oracle.

Runs on CUDA, or on CPU under the Triton interpreter (one small fixed config; float32 / float16 there,
bfloat16 dots are unreliable in the interpreter). Tolerances (relative RMS): float32 1e-5, float16 5e-3;
the indexer's selection is exact on quantised inputs and a true top-k (fp32 slack) otherwise.
"""
import pytest
import torch
from hypothesis import given, settings

from kda_compile.testing import (
    DSAAttentionCase,
    assert_rel_close,
    dsa_attention_inputs,
    dsa_indexer_inputs,
    make_dsa_attention_args,
)

from .naive import assert_true_topk, dense_scores, dense_sparse_attention, dense_topk, dense_visible

from triton_device import triton_device  # noqa: E402

DEVICE = triton_device("the DSA Triton kernels")

from kda_compile.ops.dsa.triton_indexer import indexer_topk_triton  # noqa: E402
from kda_compile.ops.dsa.triton_sparse import SparseConfig, sparse_attention_fwd_triton  # noqa: E402
from kda_compile.ops.dsa.triton_sparse_bwd import sparse_attention_bwd_triton  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 5e-3}


@settings(max_examples=10)
@given(dsa_indexer_inputs(dtypes=(torch.float32, torch.float16), device=DEVICE, max_t=36, max_heads=3,
                          dims=(8, 16)))
def test_indexer_kernel(args):
    case = args.case
    got = indexer_topk_triton(args["q"], args["k"], args["weights"], args["key_mask"], args["cu_seqlens"],
                              case.topk, case.scale, case.causal)
    scores = dense_scores(args["q"], args["k"], args["weights"], case.scale)
    visible = dense_visible(case.b, case.s, case.t, case.causal, args["key_mask"], args["cu_seqlens"])
    if case.quantised:
        assert torch.equal(got.cpu(), dense_topk(scores, visible, case.topk))
    else:
        assert_true_topk(got, scores, visible, case.topk)


def _check_kernels(args, config=None):
    case = args.case
    q, k, v, idx = args["q"], args["k"], args["v"], args["indices"]
    scale = case.dqk ** -0.5 if case.scale is None else case.scale
    o, lse = sparse_attention_fwd_triton(q, k, v, idx, scale, case.dv, config=config)
    refs = [x.detach().double().cpu().requires_grad_(True) if x is not None else None for x in (q, k, v)]
    o_ref, lse_ref = dense_sparse_attention(refs[0], refs[1], refs[2], idx.cpu(), scale, case.dv)
    tol = TOL[q.dtype]
    assert_rel_close(o, o_ref, tol, name="o", floor=1e-6)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse).cpu(), finite)
    assert_rel_close(lse.cpu()[finite], lse_ref[finite], 1e-5, name="lse", floor=1e-6)
    gen = torch.Generator().manual_seed(args.seed)
    g_o = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    g_l = torch.randn(lse.shape, generator=gen, dtype=torch.float64).masked_fill(~finite, 0)
    grads = sparse_attention_bwd_triton(g_o.to(DEVICE, q.dtype), g_l.float().to(DEVICE), q, k, v, idx, o, lse,
                                        scale, case.dv)
    used = [r for r in refs if r is not None]
    loss = (o_ref * g_o.to(q.dtype).double()).sum() + (lse_ref.masked_fill(~finite, 0) * g_l.float().double()).sum()
    grads_ref = torch.autograd.grad(loss, used)
    for name, g, r in zip("qkv", grads, grads_ref):
        assert_rel_close(g, r, tol * 4, name=f"d{name}", floor=1e-6)


@settings(max_examples=6)
@given(dsa_attention_inputs(dtypes=(torch.float32, torch.float16), device=DEVICE, max_s=3, max_t=30, max_topk=24,
                            qk_dims=(12, 24, 40), value_dims=(8, 16)))
def test_sparse_attention_kernels(args):
    _check_kernels(args)


@pytest.mark.parametrize("case,config", [
    # the value read from the key's main tile (576 = 512 + 64 in DeepSeek-V3.2, here 32 + 16)
    (DSAAttentionCase(b=1, s=3, t=40, hq=20, dqk=48, dv=32, topk=37, absorbed=True), None),
    # the value width split across programs
    (DSAAttentionCase(b=1, s=2, t=25, hq=6, hkv=2, dqk=24, dv=40, topk=9, absorbed=False),
     SparseConfig(16, 16, 2, 1, 1)),
    (DSAAttentionCase(b=1, s=2, t=25, hq=4, dqk=48, dv=32, topk=9, absorbed=True), SparseConfig(16, 16, 2, 1, 1)),
])
def test_sparse_attention_kernel_layouts(case, config):
    _check_kernels(make_dsa_attention_args(case, torch.float32, DEVICE, seed=3), config)
