"""Hypothesis over the public DSA ops (CPU path; CUDA too where present) against the dense float64 oracle:
S, T, topk > T, decode and chunks against a cache (S < T), packed sequences (cu_seqlens), padded keys,
ties (quantised scores: exact selection), GQA and the absorbed form, non-contiguous inputs, empty rows.
Tolerances (relative RMS): float64 1e-10, float32 1e-5; gradients 1e-6 / 1e-4 (the float32 lse's gradient
arrives rounded to fp32); NaN never passes."""
import torch
from hypothesis import given, settings

from kda_compile.ops import dsa_indexer_topk, dsa_sparse_attention
from kda_compile.testing import assert_rel_close, dsa_attention_inputs, dsa_indexer_inputs

from .naive import assert_true_topk, dense_scores, dense_sparse_attention, dense_topk, dense_visible

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def _oracle_inputs(args):
    case = args.case
    visible = dense_visible(case.b, case.s, case.t, case.causal, args["key_mask"], args["cu_seqlens"])
    return dense_scores(args["q"], args["k"], args["weights"], case.scale), visible


@settings(max_examples=16)
@given(dsa_indexer_inputs(dtypes=(torch.float32, torch.float16)))
def test_indexer_matches_dense_oracle(args):
    got = dsa_indexer_topk(**args)
    assert got.dtype == torch.int32 and got.shape == (args.case.b, args.case.s, args.case.topk)
    scores, visible = _oracle_inputs(args)
    if args.case.quantised:  # exact fp32 scores: the selection, order and tie rule are determined
        assert torch.equal(got.cpu(), dense_topk(scores, visible, args.case.topk))
    else:
        assert_true_topk(got, scores, visible, args.case.topk)


@given(dsa_attention_inputs(dtypes=(torch.float64, torch.float32), requires_grad=True))
def test_sparse_attention_matches_dense_oracle(args):
    case = args.case
    o, lse = dsa_sparse_attention(**args)
    leaves = [args[n] for n in ("q", "k", "v") if args[n] is not None]
    refs = [x.detach().double().requires_grad_(True) for x in leaves]
    q_ref, k_ref = refs[0], refs[1]
    v_ref = refs[2] if len(refs) == 3 else None
    scale = case.dqk ** -0.5 if case.scale is None else case.scale
    o_ref, lse_ref = dense_sparse_attention(q_ref, k_ref, v_ref, args["indices"], scale, case.dv)
    tol = TOL[o.dtype]
    assert o.shape == (case.b, case.s, case.hq, case.dv) and o.dtype == args["q"].dtype
    assert_rel_close(o, o_ref, tol, name="o", floor=1e-6)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite) and not torch.isnan(lse).any()
    assert_rel_close(lse[finite], lse_ref[finite], 1e-6, name="lse", floor=1e-6)
    gen = torch.Generator().manual_seed(args.seed)
    g_o = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    g_l = torch.randn(lse.shape, generator=gen, dtype=torch.float64).masked_fill(~finite, 0)
    grads = torch.autograd.grad((o.double() * g_o).sum() + (lse.double().masked_fill(~finite, 0) * g_l).sum(),
                                leaves)
    grads_ref = torch.autograd.grad((o_ref * g_o).sum() + (lse_ref.masked_fill(~finite, 0) * g_l).sum(), refs)
    for name, g, r in zip("qkv", grads, grads_ref):  # lse is float32: its gradient arrives rounded to fp32
        assert_rel_close(g, r, max(tol * 10, 1e-6), name=f"d{name}", floor=1e-6)
