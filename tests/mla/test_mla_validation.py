"""Argument errors of ``mla_attention`` (each names the argument, the value and what is accepted) and
the per-call choice between the absorbed and the expanded form (``path_choice.py``)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_compile.ops.mla import explain_mla_path, mla_attention
from kda_compile.ops.mla.path_choice import MLAShape, attended_pairs, estimate

from .naive import Case, make_inputs


def _inputs(**case):
    args, kwargs = make_inputs(Case(**case), torch.float32)
    return list(args), kwargs


def _call(args, kwargs):
    return mla_attention(*args, **kwargs)


@pytest.mark.parametrize("index, bad, error, words", [
    (0, "not a tensor", TypeError, ["q_nope", "torch.Tensor"]),
    (0, torch.zeros(2, 3, 4), ValueError, ["q_nope", "4-D"]),
    (1, torch.zeros(2, 3, 2, 8), ValueError, ["q_rope", "[B, H, Sq, Dr]"]),
    (2, torch.zeros(2, 2, 9, 32), ValueError, ["kv_latent", "[B, T, D] or [B, 1, T, D]"]),
    (2, torch.zeros(3, 9, 32), ValueError, ["kv_latent", "batch size 2"]),
    (3, torch.zeros(2, 8, 8), ValueError, ["k_rope", "[B, T, Dr]"]),
    (4, torch.zeros(3 * 28 + 1, 32), ValueError, ["kv_b_weight", "H * (Dn + Dv)"]),
    (4, torch.zeros(3 * 28, 31), ValueError, ["kv_b_weight", "R = 32"]),
    (4, torch.zeros(3 * 16, 32), ValueError, ["kv_b_weight", "Dv >= 1"]),
    (4, torch.zeros(3 * 28, 32, dtype=torch.float64), TypeError, ["kv_b_weight", "q_nope's dtype"]),
    (0, torch.zeros(2, 3, 1, 16, dtype=torch.int32), TypeError, ["q_nope", "float16"]),
])
def test_bad_tensors_name_argument_and_accepted(index, bad, error, words):
    args, kwargs = _inputs(hf_layout=False)
    args[index] = bad
    with pytest.raises(error) as info:
        _call(args, kwargs)
    for word in words:
        assert word in str(info.value), str(info.value)


@pytest.mark.parametrize("key, bad, error, words", [
    ("scale", None, TypeError, ["scale", "None", "finite float > 0"]),
    ("scale", math.nan, ValueError, ["scale", "nan"]),
    ("scale", -0.1, ValueError, ["scale", "-0.1"]),
    ("scale", True, TypeError, ["scale"]),
    ("is_causal", 1, TypeError, ["is_causal", "a bool"]),
    ("attn_mask", torch.zeros(2, 1, 1, 8), ValueError, ["attn_mask", "broadcastable to [B, H, Sq, T] = [2, 3, 1, 9]"]),
    ("attn_mask", torch.zeros(2, 1, 1, 9, dtype=torch.int64), TypeError, ["attn_mask", "bool or floating-point"]),
    ("path", "fast", ValueError, ["path", "'fast'", "auto"]),
])
def test_bad_options_name_argument_and_accepted(key, bad, error, words):
    args, kwargs = _inputs()
    kwargs[key] = bad
    with pytest.raises(error) as info:
        _call(args, kwargs)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_scale_is_required():
    args, kwargs = _inputs()
    kwargs.pop("scale")
    with pytest.raises(TypeError, match="scale"):
        _call(args, kwargs)


def test_hf_cache_layout_and_plain_layout_agree():
    args, kwargs = _inputs(hf_layout=True)
    flat = [a if a.dim() != 4 or a.shape[1] != 1 or i < 2 else a[:, 0].contiguous() for i, a in enumerate(args)]
    torch.testing.assert_close(_call(args, kwargs), _call(flat, kwargs), rtol=0, atol=0)


def _meta(b, h, sq, t, dn=128, dr=64, dv=128, r=512, dtype=torch.bfloat16):
    """Inputs on the meta device: the choice needs shapes only, so real model sizes cost nothing."""
    make = lambda *s: torch.empty(*s, device="meta", dtype=dtype)  # noqa: E731
    return make(b, h, sq, dn), make(b, h, sq, dr), make(b, 1, t, r), make(b, 1, t, dr), make(h * (dn + dv), r)


@pytest.mark.parametrize("b, h, sq, t, causal, form", [
    (1, 32, 1, 1, True, "absorbed"),  # decode, a one-token cache
    (64, 128, 1, 4096, True, "absorbed"),  # batched decode
    (8, 64, 4, 16384, True, "absorbed"),  # speculative verification
    (1, 32, 64, 8192, True, "absorbed"),  # a short chunk against a long cache
    (1, 32, 1024, 8192, True, "expanded"),  # a long chunk
    (1, 32, 4096, 4096, True, "expanded"),  # prefill
    (2, 128, 8192, 8192, True, "expanded"),
])
def test_auto_choice_on_model_sizes(b, h, sq, t, causal, form):
    chosen, reason, cost = explain_mla_path(*_meta(b, h, sq, t), is_causal=causal)
    assert chosen == form, reason
    assert cost.best == form and "estimated" in reason


def test_forced_path_is_reported():
    assert explain_mla_path(*_meta(1, 32, 1, 10), path="expanded")[:2] == ("expanded", "path='expanded' was requested")


@pytest.mark.parametrize("sq, t", [(1, 1), (1, 9), (4, 9), (9, 9), (9, 4), (12, 3)])
def test_attended_pairs_counts_the_causal_mask(sq, t):
    allowed = torch.arange(t)[None, :] <= torch.arange(sq)[:, None] + (t - sq)
    assert attended_pairs(sq, t, True) == int(allowed.sum())
    assert attended_pairs(sq, t, False) == sq * t


@settings(deadline=None)
@given(sq=st.integers(1, 4096), t=st.integers(1, 65536), h=st.sampled_from([16, 32, 64, 128]),
       b=st.integers(1, 64), causal=st.booleans())
def test_choice_is_monotonic_in_query_length(sq, t, h, b, causal):
    """Shorter queries against the same cache never leave the absorbed form; decode always takes it."""
    shape = lambda q: MLAShape(b, h, q, t, 128, 64, 128, 512, causal)  # noqa: E731
    assert estimate(shape(1)).best == "absorbed"
    if estimate(shape(sq)).best == "absorbed":
        assert estimate(shape(max(1, sq // 2))).best == "absorbed"
