"""The Triton experts kernels (ops/moe/triton_experts.py) against the float64 reference: on CUDA, or on CPU under
the Triton interpreter. Relative error (Frobenius) within 1e-5 in float32 (IEEE dots), 3e-3 in float16, 2e-2 in
bfloat16 (one rounding of the activations and of the output)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.triton_device import triton_device

DEVICE = triton_device("the MoE Triton kernels")

from kda_compile.ops.moe.reference import moe_experts_reference  # noqa: E402
from kda_compile.ops.moe.triton_experts import moe_experts_triton  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# the interpreter has no bfloat16 arithmetic (numpy): bfloat16 runs on CUDA only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def routed(tokens, top_k, experts, width, inter, dtype, *, seed=0, sentinel=False, skew=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=g)
    index = torch.randint(0, experts, (tokens, top_k), generator=g)
    if skew and tokens:  # one expert takes a slot of every token: a group wider than a row tile
        index[:, 0] = 0
    if sentinel and tokens:
        index[0, -1] = experts
    weights = torch.rand(tokens, top_k, generator=g)
    gate_up = torch.randn(experts, 2 * inter, width, generator=g) / width ** 0.5
    down = torch.randn(experts, width, inter, generator=g) / inter ** 0.5
    return [t.to(DEVICE, dtype) if t.is_floating_point() else t.to(DEVICE) for t in (x, index, weights, gate_up, down)]


def relative_error(out, inputs):
    ref = moe_experts_reference(*[t.double() if t.is_floating_point() else t for t in inputs])
    assert not out.isnan().any()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, top_k, experts, width, inter", [
    (1, 1, 1, 16, 16), (3, 2, 5, 40, 24), (17, 3, 4, 64, 32), (5, 4, 32, 136, 72), (40, 2, 3, 32, 16)])
def test_triton_experts_match_the_reference(dtype, tokens, top_k, experts, width, inter):
    inputs = routed(tokens, top_k, experts, width, inter, dtype, sentinel=True, skew=tokens > 16)
    out = moe_experts_triton(*inputs)
    assert out.shape == (tokens, width) and out.dtype == dtype
    assert relative_error(out, inputs) < TOLERANCE[dtype]


def test_a_sentinel_expert_contributes_nothing():
    x, index, weights, gate_up, down = routed(4, 2, 3, 16, 16, torch.float32)
    index[:, 1] = 3  # every second slot selects no expert
    full = moe_experts_triton(x, index, weights, gate_up, down)
    single = moe_experts_triton(x, index[:, :1].contiguous(), weights[:, :1].contiguous(), gate_up, down)
    torch.testing.assert_close(full, single, rtol=1e-6, atol=1e-6)


def test_no_tokens_give_an_empty_output():
    inputs = routed(0, 2, 3, 16, 16, torch.float32)
    out = moe_experts_triton(*inputs)
    assert out.shape == (0, 16)


@settings(max_examples=12, deadline=None)
@given(tokens=st.integers(1, 20), top_k=st.integers(1, 4), experts=st.integers(1, 9), width=st.integers(1, 70),
       inter=st.integers(1, 40), seed=st.integers(0, 2 ** 16))
def test_any_small_shape_matches_the_reference(tokens, top_k, experts, width, inter, seed):
    inputs = routed(tokens, top_k, experts, width, inter, torch.float32, seed=seed)
    assert relative_error(moe_experts_triton(*inputs), inputs) < 1e-5
