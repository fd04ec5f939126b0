"""The MLA op (``kda_compile.ops.mla.mla_attention``) against the naive fp64 expansion in ``naive.py``.

Both forms (absorbed, expanded) and the automatic choice, on CPU and, where present, CUDA.
Tolerances (relative RMS error ||a - b|| / ||b||, NaN never passes): float64 1e-10 (outputs) and
1e-9 (gradients); float32 2e-5 / 5e-5 (CUDA: 5e-5 / 1e-4, TF32 is off but summation orders differ);
float16 / bfloat16 (inputs rounded first, so the oracle sees the same numbers) 5e-3 / 2e-2.
"""
import pytest
import torch
from hypothesis import given, settings

from kda_compile.ops.mla import mla_attention
from kda_compile.testing import assert_rel_close

from .naive import Case, cases, make_inputs, naive_mla

PATHS = ("absorbed", "expanded", "auto")
FIXED = {
    "decode": Case(),
    "decode-cache-1": Case(t=1),
    "decode-padding": Case(b=3, t=17, mask="padding"),
    "speculative-causal": Case(sq=4, t=21, causal=True),
    "chunk-causal-padding": Case(b=2, sq=5, t=19, causal=True, mask="padding"),
    "prefill-causal": Case(sq=13, t=13, causal=True),
    "prefill-causal-padding": Case(b=2, sq=11, t=11, causal=True, mask="padding"),
    "bool-mask-dead-rows": Case(sq=3, t=10, mask="bool", dead_rows=True),
    "float-inf-mask-full-shape": Case(sq=2, t=8, mask="float_inf", mask_shape="full", dead_rows=True),
    "float-mask-2d-causal": Case(sq=6, t=8, causal=True, mask="float", mask_shape="2d"),
    "row-mask-contiguous-inputs": Case(sq=2, t=12, mask="float", mask_shape="row", hf_layout=False),
    "sq>t-causal-empty-rows": Case(sq=7, t=4, causal=True),
    "transposed-weight-odd-dims": Case(h=5, dn=24, dr=4, dv=8, r=48, sq=3, t=15, transposed_weight=True),
    "one-head": Case(h=1, sq=2, t=5, causal=True),
}
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
GRAD_TOL = {torch.float64: 1e-9, torch.float32: 5e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _tol(table, dtype, device):
    return table[dtype] * (2.5 if dtype == torch.float32 and device.type == "cuda" else 1.0)


def check_against_naive(case, dtype, device, path, *, grads=True, seed=0):
    args, kwargs = make_inputs(case, dtype, device, seed, requires_grad=grads)
    out = mla_attention(*args, **kwargs, path=path)
    assert out.dtype == dtype and out.shape == (case.b, case.h, case.sq, case.dv)
    b, h, sq, dv = out.shape
    assert out.stride() == (sq * h * dv, dv, h * dv, 1), "out must be a view of [B, Sq, H, Dv] storage"
    # The oracle sees the same (rounded) numbers, in float64.
    leaves = [a.detach().double().requires_grad_(grads) for a in args]
    mask = kwargs["attn_mask"]
    ref = naive_mla(*leaves, scale=kwargs["scale"], attn_mask=mask, is_causal=kwargs["is_causal"])
    assert_rel_close(out, ref, _tol(TOL, dtype, device), name=f"out ({path})")
    if not grads:
        return
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    out.backward(g.to(device=device, dtype=dtype))
    ref.backward(g.to(device))
    for name, a, leaf in zip(("dq_nope", "dq_rope", "dkv_latent", "dk_rope", "dkv_b_weight"), args, leaves):
        assert a.grad is not None and a.grad.shape == a.shape, name
        # A gradient that is 0 by construction (one cached key: the softmax is constant, dq = 0) comes
        # back as rounding noise (~1e-7 on CUDA): divide by an RMS floor of 1e-2, far below the O(1)
        # RMS of the real gradients here.
        assert_rel_close(a.grad, leaf.grad, _tol(GRAD_TOL, dtype, device), name=f"{name} ({path})",
                         floor=1e-2 * a.numel() ** 0.5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(FIXED))
def test_matches_naive(name, dtype, path, device):
    check_against_naive(FIXED[name], dtype, device, path)


@pytest.mark.parametrize("path", ["absorbed", "expanded"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["decode-padding", "chunk-causal-padding", "bool-mask-dead-rows"])
def test_half_precision_matches_naive(name, dtype, path, device):
    check_against_naive(FIXED[name], dtype, device, path, grads=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", ["decode-padding", "prefill-causal", "transposed-weight-odd-dims"])
def test_absorbed_and_expanded_agree(name, dtype, device):
    args, kwargs = make_inputs(FIXED[name], dtype, device, seed=3)
    absorbed = mla_attention(*args, **kwargs, path="absorbed")
    expanded = mla_attention(*args, **kwargs, path="expanded")
    assert_rel_close(absorbed, expanded, _tol(TOL, dtype, device), name="absorbed vs expanded")


def test_float_mask_gradient_matches_naive():
    case = Case(sq=3, t=7, causal=True, mask="float", mask_shape="b1")
    for path in ("absorbed", "expanded"):
        args, kwargs = make_inputs(case, torch.float64, requires_grad=True)
        mask = kwargs["attn_mask"].clone().requires_grad_(True)
        out = mla_attention(*args, **dict(kwargs, attn_mask=mask), path=path)
        mask_ref = mask.detach().clone().requires_grad_(True)
        ref = naive_mla(*[a.detach() for a in args], **dict(kwargs, attn_mask=mask_ref))
        g = torch.randn(out.shape, dtype=torch.float64)
        out.backward(g)
        ref.backward(g)
        assert_rel_close(mask.grad, mask_ref.grad, 1e-9, name=f"dmask ({path})")


@pytest.mark.parametrize("path", ["absorbed", "expanded"])
def test_gradcheck_fp64(path):
    case = Case(b=1, h=2, sq=2, t=3, dn=4, dr=2, dv=3, r=5, causal=True, mask="float", mask_shape="row")
    args, kwargs = make_inputs(case, torch.float64, requires_grad=True)
    mask = kwargs.pop("attn_mask").requires_grad_(True)

    def fn(*tensors):
        return mla_attention(*tensors[:5], attn_mask=tensors[5], **kwargs, path=path)

    assert torch.autograd.gradcheck(fn, (*args, mask), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_no_gradient_requested_runs_no_backward_graph():
    args, kwargs = make_inputs(Case(), torch.float32)
    out = mla_attention(*args, **kwargs)
    assert not out.requires_grad and out.grad_fn is None


@settings(deadline=None)
@given(case=cases())
def test_fuzz_against_naive_fp64(case):
    for path in PATHS:
        check_against_naive(case, torch.float64, torch.device("cpu"), path)


@settings(deadline=None)
@given(case=cases())
def test_fuzz_absorbed_vs_expanded_fp32(case):
    args, kwargs = make_inputs(case, torch.float32, seed=7)
    absorbed = mla_attention(*args, **kwargs, path="absorbed")
    expanded = mla_attention(*args, **kwargs, path="expanded")
    assert_rel_close(absorbed, expanded, 2e-5, name="absorbed vs expanded", floor=1e-6)
