"""The Triton flash-attention kernels against the naive fp64 softmax.

Runs on CUDA, or on CPU under the Triton interpreter (one small fixed tile config)::

    pip install -e ".[test]"     # brings triton; tests/conftest.py turns the interpreter on without CUDA
    python -m pytest tests/attention/test_triton_kernel.py

Skipped when triton is not importable or there is neither CUDA nor the interpreter. Interpreted runs
cover float32 and float16 (bfloat16 dots are unreliable there); CUDA adds bfloat16. Tolerances
(relative RMS error): float32 1e-5 (out, lse) / 3e-5 (gradients); float16 5e-3 / 1e-2;
bfloat16 2e-2 / 4e-2.
"""
import math
import os

import pytest
import torch
from hypothesis import given, settings

from kda_compile.testing import assert_rel_close

from .naive import Case, assert_lse_close, cases, make_inputs, naive_attention

triton = pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not (torch.cuda.is_available() or INTERPRETED):
    pytest.skip("the Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

import triton.language as tl  # noqa: E402

from kda_compile.ops.attention.triton_flash import (  # noqa: E402
    triton_attention_backward,
    triton_attention_forward,
)
from kda_compile.ops.attention.triton_flash_kernels import _dropout_keep  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
OUT_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
GRAD_TOL = {torch.float32: 3e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}

CASES = {
    "gqa-causal-odd-dims": Case(h=6, hkv=2, sq=19, sk=19, dqk=24, dv=40, causal=True),
    "mla-192-128-shape": Case(h=2, hkv=2, sq=33, sk=33, dqk=192, dv=128, causal=True),
    "decode-window-sinks": Case(h=4, hkv=1, sq=1, sk=37, causal=True, window=9, sinks=True),
    "chunk-window-bool-mask": Case(b=2, h=4, hkv=2, sq=17, sk=40, causal=True, window=11, mask="bool",
                                   mask_shape="b1", dead_rows=True),
    "softcap-float-mask-grad": Case(h=2, hkv=1, sq=21, sk=18, mask="float_inf", mask_shape="11", softcap=5.0,
                                    dead_rows=True, sinks=True),
    "sq>sk-causal": Case(sq=23, sk=6, causal=True, noncontiguous=True),
    # d_qk 24 / d_v 12 in 16-bit types once hit a Triton sm_90 miscompile (see MIN_HEAD_BLOCK).
    "narrow-masked-head-dims": Case(b=3, h=3, hkv=3, sq=1, sk=17, dqk=24, dv=12, mask="float", mask_shape="b1"),
    "narrow-head-dims-no-mask": Case(b=2, h=3, hkv=1, sq=5, sk=19, dqk=24, dv=12),
    "row-mask-transposed": Case(b=2, h=2, sq=5, sk=29, mask="float", mask_shape="row", noncontiguous=True),
}


def _window(case):
    return case.window or 0


def _scale(case):
    return case.dqk ** -0.5 if case.scale is None else case.scale


def check_kernel(case, dtype, seed=0, keep=None, dropout_p=0.0, dropout_seed=0):
    args, kwargs = make_inputs(case, dtype, DEVICE, seed, requires_grad=True)
    q, k, v = (t.detach() for t in args)
    mask = None if kwargs["attn_mask"] is None else kwargs["attn_mask"].detach()
    sinks = None if kwargs["sinks"] is None else kwargs["sinks"].detach()
    softcap = case.softcap or 0.0
    rng = torch.tensor([dropout_seed, 0], dtype=torch.int64, device=DEVICE)
    out, lse = triton_attention_forward(q, k, v, mask, sinks, _scale(case), softcap, dropout_p, case.causal,
                                        _window(case), rng)
    ref_out, _ = naive_attention(*args, **kwargs, keep=keep, dropout_p=dropout_p)
    ref_lse = naive_attention(*args, **dict(kwargs, sinks=None))[1]  # the kernel's lse is scores only
    assert_rel_close(out, ref_out, OUT_TOL[dtype], name="out")
    assert_lse_close(lse, ref_lse, max(OUT_TOL[dtype], 1e-6))

    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    g_out = torch.randn(ref_out.shape, generator=gen, device=DEVICE, dtype=torch.float64)
    g_lse = torch.randn(ref_lse.shape, generator=gen, device=DEVICE, dtype=torch.float32).double()
    mask_grad = mask is not None and mask.is_floating_point()
    dq, dk, dv, dmask, dsinks = triton_attention_backward(
        g_out.to(dtype), g_lse.float(), q, k, v, out, lse, mask, sinks, _scale(case), softcap, dropout_p,
        case.causal, _window(case), rng, mask_grad)
    finite = torch.isfinite(ref_lse)
    loss = (ref_out * g_out).sum() + (ref_lse[finite] * g_lse[finite]).sum()
    names = ["query", "key", "value"] + (["attn_mask"] if mask_grad else []) + (["sinks"] if sinks is not None else [])
    leaves = dict(query=args[0], key=args[1], value=args[2], attn_mask=kwargs["attn_mask"], sinks=kwargs["sinks"])
    expected = torch.autograd.grad(loss, [leaves[n] for n in names])
    got = dict(query=dq, key=dk, value=dv, sinks=dsinks,
               attn_mask=None if dmask is None else dmask.sum_to_size(mask.shape))
    for name, e in zip(names, expected):
        assert got[name].shape == leaves[name].shape, name
        assert_rel_close(got[name], e, GRAD_TOL[dtype], name=f"d{name}", floor=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_naive(name, dtype):
    check_kernel(CASES[name], dtype)


@settings(deadline=None)
@given(case=cases(max_seq=20, head_dims=(16, 32), value_dims=(16, 24)))
def test_kernel_fuzz_fp32(case):
    check_kernel(case, torch.float32)


@triton.jit
def _keep_mask_kernel(Keep, Seed, H, Sq, Sk, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)
    seed = tl.load(Seed)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    keep = _dropout_keep(seed, bh, offs_m, offs_n, Sk, dropout_p)
    ok = (offs_m[:, None] < Sq) & (offs_n[None, :] < Sk)
    tl.store(Keep + bh * Sq * Sk + offs_m[:, None] * Sk + offs_n[None, :], keep.to(tl.int8), mask=ok)


def triton_keep_mask(b, h, sq, sk, p, seed):
    """The keep-mask the kernels draw for (seed, p): same Philox stream and counters."""
    keep = torch.empty((b, h, sq, sk), dtype=torch.int8, device=DEVICE)
    seed_tensor = torch.tensor([seed, 0], dtype=torch.int64, device=DEVICE)
    _keep_mask_kernel[(b * h,)](keep, seed_tensor, h, sq, sk, p, BLOCK_M=triton.next_power_of_2(max(sq, 16)),
                                BLOCK_N=triton.next_power_of_2(max(sk, 16)))
    return keep.bool()


@pytest.mark.parametrize("p", [0.2, 0.6])
def test_dropout_matches_naive_with_the_kernel_mask(p):
    case = Case(h=4, hkv=2, sq=13, sk=21, causal=True, sinks=True, mask="float", mask_shape="b1")
    keep = triton_keep_mask(case.b, case.h, case.sq, case.sk, p, seed=1234)
    assert abs(keep.double().mean().item() - (1 - p)) < 0.1
    check_kernel(case, torch.float32, keep=keep, dropout_p=p, dropout_seed=1234)


def test_dropout_seed_changes_the_mask():
    a = triton_keep_mask(1, 2, 8, 8, 0.5, seed=1)
    b = triton_keep_mask(1, 2, 8, 8, 0.5, seed=2)
    assert not torch.equal(a, b) and not torch.equal(a[0, 0], a[0, 1])


def test_empty_rows_give_zero_and_minus_inf():
    case = Case(h=2, sq=6, sk=9, mask="bool", dead_rows=True)
    args, kwargs = make_inputs(case, torch.float32, DEVICE)
    out, lse = triton_attention_forward(*args, kwargs["attn_mask"], None, _scale(case), 0.0, 0.0, False, 0,
                                        torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.isfinite(out).all() and (out[:, :, 0] == 0).all() and (lse[:, :, 0] == -math.inf).all()
