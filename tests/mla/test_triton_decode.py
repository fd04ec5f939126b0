"""The Triton absorbed-MLA decode kernels (``ops/mla/decode/triton_decode.py``) against float64 oracles.

Runs on CUDA, or on CPU under the Triton interpreter (one small fixed config)::

    pip install -e ".[test]"     # brings triton; tests/conftest.py turns the interpreter on without CUDA
    python -m pytest tests/mla/test_triton_decode.py

Skipped when triton is not importable or there is neither CUDA nor the interpreter. Interpreted runs
cover float32 and float16 (bfloat16 dots are unreliable there); CUDA adds bfloat16. Tolerances
(relative RMS error): float32 1e-5, float16 5e-3, bfloat16 2e-2; lse: absolute 1e-5 (float32 math).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_compile.testing import assert_rel_close

from .naive import Case, assert_matches_latent_oracle, kernel_inputs, latent_oracle, make_inputs, naive_mla

from triton_device import triton_device  # noqa: E402

DEVICE = triton_device("the Triton kernels")

from kda_compile.ops.mla.custom_ops import absorbed_mla_cuda  # noqa: E402
from kda_compile.ops.mla.decode.triton_decode import choose_num_splits, mla_decode_attention  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def check_kernel(case, dtype, num_splits=None, seed=0):
    (q_lat, q_rope, kv_latent, k_rope), mask, scale = kernel_inputs(case, dtype, seed)
    on_device = [x.to(DEVICE) for x in (q_lat, q_rope, kv_latent, k_rope)]
    o_lat, lse = mla_decode_attention(*on_device, None if mask is None else mask.to(DEVICE), scale, case.causal,
                                      num_splits=num_splits)
    assert o_lat.dtype == dtype
    assert_matches_latent_oracle(o_lat, lse, *latent_oracle(q_lat, q_rope, kv_latent, k_rope, mask, scale, case.causal),
                                 case, TOL[dtype], 1e-5)


CASES = {
    "decode-multi-split": Case(b=2, h=4, sq=1, t=70, r=32, dr=8),
    "decode-cache-1": Case(b=1, h=2, sq=1, t=1, r=32, dr=8),
    "decode-padding-hf-views": Case(b=3, h=5, sq=1, t=37, r=48, dr=24, dn=16, mask="padding"),
    "heads-over-blocks": Case(b=1, h=20, sq=1, t=33, r=32, dr=16),  # 20 rows > BLOCK_M (16)
    "64-heads": Case(b=2, h=64, sq=1, t=100, r=64, dr=16, mask="padding"),  # 64-row blocks on CUDA
    "speculative-causal": Case(b=2, h=3, sq=4, t=45, r=32, dr=8, causal=True),
    "chunk-causal-bool-dead-rows": Case(b=2, h=2, sq=5, t=40, r=16, dr=8, causal=True, mask="bool", dead_rows=True),
    "float-inf-full-mask": Case(b=1, h=3, sq=2, t=19, r=32, dr=8, mask="float_inf", mask_shape="full", dead_rows=True),
    "float-mask-2d": Case(b=2, h=2, sq=3, t=17, r=32, dr=8, mask="float", mask_shape="2d"),
    "sq>t-causal": Case(b=1, h=2, sq=6, t=3, r=16, dr=8, causal=True),
    "prefill-causal": Case(b=1, h=2, sq=20, t=20, r=32, dr=8, causal=True, hf_layout=False),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_oracle(name, dtype):
    check_kernel(CASES[name], dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 64])
def test_any_split_count_gives_the_same_answer(num_splits):
    """1 split writes the output directly; more go through the LSE merge; more splits than tiles clamp."""
    check_kernel(Case(b=2, h=3, sq=2, t=75, r=32, dr=8, causal=True, mask="padding"), torch.float32, num_splits)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_fully_padded_sequence_averages_like_eager(num_splits):
    """A sequence whose every key carries HF's finite padding value (finfo.min) attends uniformly,
    as eager softmax does, however the cache is split (the merge weighs splits by their key count)."""
    case = Case(b=2, h=3, sq=1, t=61, r=16, dr=8, hf_layout=False)
    (q_lat, q_rope, kv_latent, k_rope), _, scale = kernel_inputs(case, torch.float32)
    mask = torch.zeros(2, 1, 1, 61)
    mask[0] = torch.finfo(torch.float32).min
    mask[1, ..., :50] = torch.finfo(torch.float32).min
    o_lat, _ = mla_decode_attention(*(x.to(DEVICE) for x in (q_lat, q_rope, kv_latent, k_rope)), mask.to(DEVICE),
                                    scale, False, num_splits=num_splits)
    uniform = kv_latent[0].double().mean(dim=0).expand(3, 1, 16)
    assert_rel_close(o_lat[0], uniform, 1e-5, name="fully padded sequence")
    assert_rel_close(o_lat, latent_oracle(q_lat, q_rope, kv_latent, k_rope, mask, scale, False)[0], 1e-5, name="o_lat")


@settings(deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 20), sq=st.integers(1, 4), t=st.integers(1, 80),
       causal=st.booleans(), mask=st.sampled_from(["none", "padding", "bool", "float_inf"]),
       splits=st.sampled_from([None, 1, 3]), hf=st.booleans())
def test_fuzz_kernel_fp32(b, h, sq, t, causal, mask, splits, hf):
    case = Case(b=b, h=h, sq=sq, t=t, r=16, dr=8, causal=causal, mask=mask, dead_rows=mask in ("bool", "float_inf"),
                hf_layout=hf)
    check_kernel(case, torch.float32, splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [Case(b=2, h=3, sq=1, t=29, mask="padding"),
                                  Case(b=1, h=4, sq=3, t=21, causal=True, transposed_weight=True)])
def test_absorbed_form_with_kernel_matches_expansion_oracle(case, dtype):
    """The whole absorbed form (absorption matmuls + kernel + W_UV) against HF's expansion, float64."""
    args, kwargs = make_inputs(case, dtype, DEVICE)
    q_nope, q_rope, kv_latent, k_rope, w = args
    out = absorbed_mla_cuda(q_nope, q_rope, kv_latent[:, 0], k_rope[:, 0], w, kwargs["attn_mask"],
                            kwargs["scale"], kwargs["is_causal"])
    b, h, sq, dv = out.shape
    assert out.stride() == (sq * h * dv, dv, h * dv, 1)
    assert_rel_close(out, naive_mla(*args, **kwargs), TOL[dtype], name="out")


@pytest.mark.parametrize("programs, tiles, sms, least, expected", [
    (1, 64, 132, 4, 16),  # batch 1: split as far as 4 tiles per split allows
    (1, 1000, 132, 4, 63),  # bounded by MAX_SPLITS (64 splits would also take 16 tiles each)
    (64, 64, 132, 4, 2),  # batch 64, one head block: two splits still fit one wave
    (64, 64, 100, 4, 3),  # on 100 SMs two splits already take two waves: three make them shorter
    (256, 64, 132, 4, 1),  # batch 64 x 4 head blocks: about two waves already
    (512, 64, 132, 4, 1),
    (8, 3, 132, 4, 1),  # a short cache is never split below the minimum
])
def test_split_count_rule(programs, tiles, sms, least, expected):
    assert choose_num_splits(programs, tiles, sms, least) == expected
