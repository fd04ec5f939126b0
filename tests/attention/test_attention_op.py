"""The attention op (``kda_compile.ops.attention``) against the naive fp64 softmax in ``naive.py``.

Runs on CPU (the reference path) and, where present, CUDA (the dispatcher). Tolerances (relative RMS
error ||a - b|| / ||b||, NaN never passes): float64 1e-10; float32 1e-5 (CPU), 2e-5 (CUDA);
float16 / bfloat16 (inputs rounded first, so the oracle sees the same numbers) 5e-3 / 2e-2 for
outputs and 1e-2 / 4e-2 for gradients.
"""
import math

import pytest
import torch
from hypothesis import given, settings

from kda_compile.ops.attention import attention, attention_with_lse
from kda_compile.testing import assert_rel_close

from .naive import Case, cases, check_against_naive, grad_inputs, make_inputs, naive_attention

FIXED = {
    "mha": Case(),
    "gqa-causal": Case(h=6, hkv=2, sq=7, sk=7, causal=True),
    "mqa-decode": Case(h=4, hkv=1, sq=1, sk=9, causal=True),
    "mla-shape-dv-ne-dqk": Case(h=2, hkv=2, sq=6, sk=6, dqk=24, dv=16, causal=True),
    "chunked-prefill-sq<sk": Case(sq=4, sk=11, causal=True),
    "sq>sk-empty-rows": Case(sq=9, sk=4, causal=True),
    "window": Case(h=4, hkv=2, sq=8, sk=12, causal=True, window=3),
    "window-decode": Case(sq=1, sk=10, causal=True, window=4),
    "bool-mask-broadcast": Case(b=2, mask="bool", mask_shape="b1", dead_rows=True),
    "float-mask-2d-causal": Case(mask="float", mask_shape="2d", causal=True, sq=6, sk=8),
    "float-inf-mask-row": Case(b=2, mask="float_inf", mask_shape="row", sq=3, sk=7),
    "softcap-window-mask": Case(h=4, hkv=2, sq=7, sk=9, causal=True, window=5, mask="float", softcap=2.0),
    "sinks-gqa-dead-rows": Case(h=4, hkv=2, mask="bool", dead_rows=True, sinks=True),
    "sinks-causal-noncontiguous": Case(sq=6, sk=6, causal=True, sinks=True, noncontiguous=True),
    "sk1": Case(sq=3, sk=1),
    "sk1-causal-sq3": Case(sq=3, sk=1, causal=True),
    "custom-scale": Case(scale=0.7, dqk=8, dv=4),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(FIXED))
def test_matches_naive(name, dtype, device):
    check_against_naive(FIXED[name], dtype, device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["gqa-causal", "softcap-window-mask", "sinks-gqa-dead-rows"])
def test_half_precision_matches_naive(name, dtype, device):
    check_against_naive(FIXED[name], dtype, device)


@settings(deadline=None)
@given(case=cases())
def test_fuzz_against_naive_fp64(case):
    check_against_naive(case, torch.float64, torch.device("cpu"))


@settings(deadline=None)
@given(case=cases())
def test_fuzz_against_naive_fp32_forward(case):
    check_against_naive(case, torch.float32, torch.device("cpu"), grads=False)


GRADCHECK = {  # tiny: gradcheck perturbs every element
    "gqa-causal-window-softcap": Case(h=4, hkv=2, sq=3, sk=4, dqk=4, dv=4, causal=True, window=2, softcap=2.0),
    "sinks-float-mask-dead-rows": Case(h=2, hkv=1, sq=3, sk=3, dqk=4, dv=4, mask="float_inf", dead_rows=True,
                                       mask_shape="b1", sinks=True),
}


@pytest.mark.parametrize("name", list(GRADCHECK))
def test_gradcheck_fp64(name):
    args, kwargs = make_inputs(GRADCHECK[name], torch.float64, requires_grad=True)
    leaves = grad_inputs(args, kwargs)
    names = list(leaves)

    def fn(*tensors):
        named = dict(zip(names, tensors))
        kw = dict(kwargs, attn_mask=named.get("attn_mask", kwargs["attn_mask"]), sinks=named.get("sinks", kwargs["sinks"]))
        return attention(named["query"], named["key"], named["value"], **kw)

    assert torch.autograd.gradcheck(fn, tuple(leaves.values()))


def test_fully_masked_rows_are_zero_and_gradients_finite(device):
    case = Case(b=2, h=2, sq=4, sk=5, mask="bool", mask_shape="b1")
    args, kwargs = make_inputs(case, torch.float32, device, requires_grad=True)
    kwargs["attn_mask"][:, :, 1, :] = False
    kwargs["attn_mask"][1] = False
    out, lse = attention_with_lse(*args, **kwargs)
    assert torch.isfinite(out).all()
    assert (out[:, :, 1] == 0).all() and (out[1] == 0).all()
    assert (lse[:, :, 1] == -math.inf).all() and (lse[1] == -math.inf).all()
    out.sum().backward()
    for t in args:
        assert torch.isfinite(t.grad).all()
    assert (args[0].grad[1] == 0).all()


def test_output_layout_is_bshd_and_every_output_stays_on_the_device(device):
    args, kwargs = make_inputs(Case(b=2, h=3, hkv=1, sq=5, sk=6, dv=8), torch.float32, device)
    out = attention(*args, **kwargs)
    assert out.stride() == (5 * 3 * 8, 8, 3 * 8, 1)
    assert out.transpose(1, 2).is_contiguous()
    for p in (0.0, 0.5):  # the dropout seed too: a CPU output would make Inductor drop CUDA graphs
        outputs = torch.ops.kda_compile.attention_fwd(*args, None, None, 0.5, 0.0, p, False, 0, False)
        assert all(t.device == args[0].device for t in outputs)


@pytest.mark.parametrize("p", [0.25, 0.5])
def test_dropout_matches_naive_with_the_same_mask(p):
    from kda_compile.ops.attention.reference import dropout_keep_mask

    case = Case(h=4, hkv=2, sq=6, sk=7, causal=True, sinks=True, mask="float")
    args, kwargs = make_inputs(case, torch.float64, requires_grad=True)
    window = 0 if kwargs["sliding_window"] is None else kwargs["sliding_window"]
    out, lse, rng = torch.ops.kda_compile.attention_fwd(
        *args, kwargs["attn_mask"], kwargs["sinks"], case.dqk ** -0.5, 0.0, p, case.causal, window, False)
    keep = dropout_keep_mask(rng, (case.b, case.h, case.sq, case.sk), p, "cpu")
    assert abs(1.0 - keep.double().mean().item() - p) < 0.2
    ref_out, _ = naive_attention(*args, **kwargs, keep=keep, dropout_p=p)
    assert_rel_close(out, ref_out, 1e-10, name="out")
    g = torch.randn_like(ref_out)
    leaves = list(grad_inputs(args, kwargs).values())
    expected = torch.autograd.grad((ref_out * g).sum(), leaves)
    got = torch.autograd.grad((out * g).sum(), leaves)
    for e, a in zip(expected, got):
        assert_rel_close(a, e, 1e-9, name="grad")


def test_dropout_changes_output_and_zero_dropout_does_not():
    args, kwargs = make_inputs(Case(sq=8, sk=8), torch.float64)
    base = attention(*args, **kwargs)
    assert torch.equal(attention(*args, **kwargs, dropout_p=0.0), base)
    assert not torch.allclose(attention(*args, **kwargs, dropout_p=0.5), base)


def test_sinks_lower_the_output_weight():
    # With a sink the probabilities sum to 1 - exp(sink - lse): check against the closed form.
    args, kwargs = make_inputs(Case(sq=3, sk=4), torch.float64)
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    plain, lse_plain = attention_with_lse(*args, **kwargs)
    out, lse = attention_with_lse(*args, **dict(kwargs, sinks=sinks))
    share = torch.sigmoid(lse_plain - sinks.view(1, -1, 1))
    # lse is float32, hence 1e-6.
    assert_rel_close(out, plain * share[..., None], 1e-6, name="out")
    assert_rel_close(lse, torch.logaddexp(lse_plain, sinks.view(1, -1, 1)), 1e-6, name="lse")
