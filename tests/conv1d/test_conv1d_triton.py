"""The Triton conv1d update kernel (ops/conv1d/triton_update.py) against the float64 reference: on CUDA, or on CPU
under the Triton interpreter. The output within 1e-5 relative error (Frobenius) in float32 and one rounding in
float16 / bfloat16; the rolled state equal to the reference's (it is a copy of inputs)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.triton_device import triton_device

DEVICE = triton_device("the conv1d update kernel")

from kda_compile.ops.conv1d.reference import causal_conv1d_update_reference  # noqa: E402
from kda_compile.ops.conv1d.triton_update import causal_conv1d_update_triton  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
KIMI_CHANNELS = 12288 if DEVICE.type == "cuda" else 384  # the interpreter runs a program at a time


def conv_inputs(batch, channels, tokens, state_len, width, dtype, *, bias=True, seed=0, hf_layout=True):
    g = torch.Generator().manual_seed(seed)
    if hf_layout:  # Hugging Face's mixed_qkv.transpose(1, 2): channels contiguous, [B, C, T] with strides (TC, 1, C)
        x = torch.randn(batch, tokens, channels, generator=g).transpose(1, 2)
    else:
        x = torch.randn(batch, channels, tokens, generator=g)
    state = torch.randn(batch, channels, state_len, generator=g)
    weight = torch.randn(channels, width, generator=g) / width ** 0.5
    b = torch.randn(channels, generator=g) if bias else None
    return [None if t is None else t.to(DEVICE, dtype) for t in (x, state, weight, b)]


def check_against_reference(batch, channels, tokens, state_len, width, dtype, activation, **kw):
    x, state, weight, bias = conv_inputs(batch, channels, tokens, state_len, width, dtype, **kw)
    ref_state = state.double().clone()
    want = causal_conv1d_update_reference(x.double(), ref_state, weight.double(), None if bias is None else
                                          bias.double(), activation)
    out = causal_conv1d_update_triton(x, state, weight, bias, activation)
    assert out.shape == (batch, channels, tokens) and out.dtype == dtype and out.is_contiguous()
    assert not out.isnan().any()
    error = ((out.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
    assert error < TOLERANCE[dtype]
    torch.testing.assert_close(state.double(), ref_state.to(dtype).double(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, channels, tokens, state_len, width", [
    (1, KIMI_CHANNELS, 1, 4, 4),  # Kimi-Linear's q / k / v at decode (HF keeps W inputs)
    (2, 200, 1, 3, 4),      # a state of W - 1 inputs
    (3, 130, 3, 4, 4),      # several new tokens (speculative decoding)
    (1, 17, 6, 2, 3),       # more new tokens than the state holds
    (2, 5, 1, 6, 2),        # a state longer than the taps need
    (1, 8, 0, 4, 4)])       # no new token: the state stays
def test_the_kernel_matches_the_reference(dtype, batch, channels, tokens, state_len, width):
    check_against_reference(batch, channels, tokens, state_len, width, dtype, "silu")


@pytest.mark.parametrize("bias, activation, hf_layout", [(False, None, True), (True, None, False),
                                                          (False, "silu", False)])
def test_without_bias_or_activation(bias, activation, hf_layout):
    check_against_reference(2, 70, 2, 4, 4, torch.float32, activation, bias=bias, hf_layout=hf_layout)


def test_a_state_of_another_dtype_is_written_in_its_dtype():
    x, state, weight, bias = conv_inputs(1, 40, 1, 4, 4, torch.float32)
    state16 = state.to(torch.float16)
    ref = state16.clone()
    want = causal_conv1d_update_reference(x, ref, weight, bias, "silu")
    out = causal_conv1d_update_triton(x, state16, weight, bias, "silu")
    assert state16.dtype == torch.float16 and torch.equal(state16, ref)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 3), channels=st.integers(1, 300), tokens=st.integers(0, 5), width=st.integers(1, 5),
       extra=st.integers(0, 3), seed=st.integers(0, 2 ** 16))
def test_any_small_shape_matches_the_reference(batch, channels, tokens, width, extra, seed):
    check_against_reference(batch, channels, tokens, max(width - 1, 1) + extra, width, torch.float32, "silu",
                            seed=seed)
