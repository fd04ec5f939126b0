"""The CUDA dispatcher's algebra around torch's SDPA kernels, checked on CPU.

``dispatch.cuda_forward`` / ``cuda_backward`` add, on top of a backend kernel: sinks from the
kernel's LSE (``out * sigmoid(lse - sink)`` and the scaled dO/out in the backward), empty-row
clean-up, key trimming for sliding windows, and the output layout. Here the aten kernels are
replaced by emulations of their contracts written from scratch in float64 (forward: out and
scores-only lse; backward: the FlashAttention recurrence from out, dO and lse), each reproducing
its backend's empty-row behaviour (cuDNN: finite -65504 fill; flash: out 0, lse +inf; efficient:
NaN). Results must match the naive softmax to 1e-6: the glue keeps the kernels' float32 lse, so the
sink factors carry float32 rounding (1e-5 for gradients, where dsinks sums terms that cancel); a
mistake in the algebra shows as an O(1) error.
"""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kda_compile.ops.attention import kernels as dispatch, sdpa
from kda_compile.testing import assert_rel_close

from .naive import Case, assert_lse_close, cases, grad_inputs, make_inputs, naive_attention


def _masked_scores(backend, q, k, attn_mask, scale, is_causal, window):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    sq, sk = s.shape[-2:]
    pos = torch.arange(sq)[:, None] + sk - sq
    col = torch.arange(sk)[None, :]
    if is_causal:
        s = s.masked_fill(col > pos, -math.inf)
        if window:
            s = s.masked_fill(col <= pos - window, -math.inf)
    if attn_mask is not None:
        if backend == "cudnn":
            s = s + sdpa.cudnn_bias(attn_mask, q.dtype)
        elif attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, -math.inf)
        else:
            s = s + attn_mask
    return s


def emulated_forward(backend, q, k, v, attn_mask, scale, is_causal, window):
    s = _masked_scores(backend, q, k, attn_mask, scale, is_causal, window)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])  # NaN on empty rows, like a kernel that does not special-case them
    out = torch.matmul(p, v.repeat_interleave(q.shape[1] // k.shape[1], dim=1))
    empty = lse == -math.inf
    if backend == "flash":
        out, lse = out.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, math.inf)
    elif backend == "efficient":
        lse = lse.masked_fill(empty, math.nan)
    # Return the BHSD-contiguous layout (not the op's): the glue must fix it.
    return out.contiguous(), lse


def emulated_backward(backend, grad_out, q, k, v, out, lse_k, attn_mask, scale, is_causal, window):
    group = q.shape[1] // k.shape[1]
    s = _masked_scores(backend, q, k, attn_mask, scale, is_causal, window)
    p = torch.exp(s - lse_k[..., None])
    delta = (grad_out * out).sum(-1, keepdim=True)
    dp = torch.matmul(grad_out, v.repeat_interleave(group, dim=1).transpose(-1, -2))
    ds = p * (dp - delta)
    dq = torch.matmul(ds, k.repeat_interleave(group, dim=1)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    dv = torch.matmul(p.transpose(-1, -2), grad_out)
    b, h = q.shape[:2]
    fold = lambda t: t.reshape(b, h // group, group, *t.shape[2:]).sum(2)  # noqa: E731
    return dq, fold(dk), fold(dv)


@pytest.fixture
def emulated(monkeypatch):
    chosen = {}

    def use(backend):
        chosen["backend"] = backend

    monkeypatch.setattr(dispatch, "_FAST_DTYPES", (torch.float64,))
    monkeypatch.setattr(dispatch, "triton_unavailable", lambda: "emulated kernels in this test")
    monkeypatch.setattr(sdpa, "choose", lambda *a, **k: (chosen["backend"], {}))
    monkeypatch.setattr(sdpa, "sdpa_forward", emulated_forward)
    monkeypatch.setattr(sdpa, "sdpa_backward", emulated_backward)
    return use


def run_glue(case, seed=0):
    args, kwargs = make_inputs(case, torch.float64, seed=seed, requires_grad=True)
    q, k, v = (t.detach() for t in args)
    mask = None if kwargs["attn_mask"] is None else kwargs["attn_mask"].detach()
    sinks = None if kwargs["sinks"] is None else kwargs["sinks"].detach()
    scale = case.dqk ** -0.5 if case.scale is None else case.scale
    window = case.window or 0
    out, lse = dispatch.cuda_forward(q, k, v, mask, sinks, scale, 0.0, 0.0, case.causal, window, torch.empty(0))
    assert out.stride() == dispatch.bshd_strides(out.shape)
    ref_out, ref_lse = naive_attention(*args, **kwargs)
    assert_rel_close(out, ref_out, 1e-6, name="out")
    lse_with_sink = lse if sinks is None else torch.logaddexp(lse, sinks.view(1, -1, 1))
    assert_lse_close(lse_with_sink, ref_lse, 1e-6)

    gen = torch.Generator().manual_seed(seed + 1)
    g = torch.randn(ref_out.shape, generator=gen, dtype=torch.float64)
    dq, dk, dv, dmask, dsinks = dispatch.cuda_backward(
        g, None, q, k, v, out, lse, torch.empty(0), mask, sinks, scale, 0.0, 0.0, case.causal, window, False)
    assert dmask is None
    leaves = {n: t for n, t in grad_inputs(args, kwargs).items() if n != "attn_mask"}
    expected = torch.autograd.grad((ref_out * g).sum(), list(leaves.values()))
    got = dict(query=dq, key=dk, value=dv, sinks=dsinks)
    for name, e in zip(leaves, expected):
        assert_rel_close(got[name], e, 1e-5, name=f"d{name}", floor=1e-6)


GLUE_CASES = {
    "sinks-causal-gqa": Case(h=4, hkv=2, sq=6, sk=6, causal=True, sinks=True),
    "sinks-empty-rows-bool": Case(b=2, mask="bool", dead_rows=True, sinks=True),
    "float-inf-empty-rows": Case(mask="float_inf", dead_rows=True, mask_shape="b1"),
    "causal-sq>sk": Case(sq=7, sk=3, causal=True, sinks=True),
    "window-trimmed": Case(h=4, hkv=1, sq=3, sk=12, causal=True, window=4, sinks=True),
    "window-decode-vacuous": Case(sq=1, sk=9, causal=True, window=3, mask="float", mask_shape="row"),
    "window-with-mask": Case(sq=4, sk=10, causal=True, window=2, mask="bool", mask_shape="2d"),
}


@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient"])
@pytest.mark.parametrize("name", list(GLUE_CASES))
def test_glue_matches_naive(emulated, backend, name):
    emulated(backend)
    run_glue(GLUE_CASES[name])


# The fixture only installs the same patches; each example picks its backend through it.
@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases(), backend=st.sampled_from(["cudnn", "flash", "efficient"]))
def test_glue_fuzz(emulated, case, backend):
    emulated(backend)
    run_glue(case.with_(softcap=None))


def test_trim_keys_keeps_every_visible_key():
    k, v = torch.randn(1, 2, 12, 4), torch.randn(1, 2, 12, 4)
    mask = torch.rand(3, 12) > 0.5
    k2, v2, m2, causal, window, start = sdpa.trim_keys_for_window(k, v, mask, 3, True, 4)
    # rows sit at positions 9, 10, 11 and see keys from 9 - 4 + 1 = 6 on.
    assert start == 6 and k2.shape[2] == 6 and torch.equal(m2, mask[:, 6:]) and causal and window == 4
    _, _, _, causal, window, start = sdpa.trim_keys_for_window(k, v, None, 1, True, 4)
    assert (start, causal, window) == (8, False, 0)  # decode: the window is exactly the remaining keys


def test_efficient_bias_is_aligned_without_expanding_heads():
    mask = torch.rand(2, 1, 5, 7) > 0.5
    bias = sdpa.efficient_bias(mask, torch.float32, 2, 4, 5, 7)
    assert bias.shape == (2, 4, 5, 7) and bias.stride(1) == 0 and bias.stride(-1) == 1
    assert all(st % 16 == 0 for st in bias.stride()[:-1])
    expected = torch.zeros(2, 1, 5, 7).masked_fill(~mask, -math.inf).expand(2, 4, 5, 7)
    assert torch.equal(bias, expected)


def test_as_bshd_copies_only_when_memory_order_differs():
    bshd = torch.randn(2, 5, 3, 4).transpose(1, 2)
    assert dispatch.as_bshd(bshd) is bshd
    one_head = torch.randn(2, 5, 1, 4).transpose(1, 2).contiguous()  # size-1 head dim: any stride is fine
    assert dispatch.as_bshd(one_head).data_ptr() == one_head.data_ptr()
    bhsd = torch.randn(2, 3, 5, 4)
    fixed = dispatch.as_bshd(bhsd)
    assert fixed.stride() == dispatch.bshd_strides(bhsd.shape) and torch.equal(fixed, bhsd)


def test_floor_biased_rows_are_detected_from_the_mask():
    """Rows whose visible keys all carry finfo.min (HF left padding under causal masking) send the
    memory-efficient backward to the reference: their lse cannot carry log(#keys) (dispatch.py)."""
    sq = sk = 6
    lo = torch.finfo(torch.float32).min
    causal = torch.ones(sq, sk, dtype=torch.bool).tril()
    pad = torch.tensor([[False, False, True, True, True, True]])  # two left-padded keys
    mask = torch.where(causal & pad, 0.0, lo)[None, None]  # [1, 1, Sq, Sk], rows 0 and 1 all padding
    assert dispatch._has_floor_biased_rows(mask, False, 0, sq)
    bf16_mask = torch.where(causal & pad, 0.0, torch.finfo(torch.bfloat16).min).to(torch.bfloat16)[None, None]
    assert dispatch._has_floor_biased_rows(bf16_mask, False, 0, sq)
    assert not dispatch._has_floor_biased_rows(mask.to(torch.float16), False, 0, sq)  # -65504: representable
    no_pad = torch.where(causal, 0.0, lo)[None, None]
    assert not dispatch._has_floor_biased_rows(no_pad, False, 0, sq)
    # Causal hiding counts: a row whose only unmasked keys lie in its future is a floor row.
    future = torch.full((1, 1, sq, sk), lo)
    future[..., -1] = 0.0
    assert not dispatch._has_floor_biased_rows(future, False, 0, sq)
    assert dispatch._has_floor_biased_rows(future, True, 0, sq)
    # ... and so does a sliding window: row 5 sees keys 4..5 only.
    window = torch.zeros(1, 1, sq, sk)
    window[..., :4] = lo
    window[..., 4:] = torch.where(torch.arange(sq)[:, None] >= 4, 0.0, lo)
    assert dispatch._has_floor_biased_rows(window, True, 2, sq)
    assert not dispatch._has_floor_biased_rows(window[..., 4:, :], True, 2, 2)
    # Rows with nothing visible at all (-inf) are empty rows, handled elsewhere.
    assert not dispatch._has_floor_biased_rows(torch.full((1, 1, 2, 3), float("-inf")), False, 0, 2)
