"""The one-launch routing and combine of the Triton experts (ops/moe/triton_routing.py) against routing.py's torch
sort and a sum in float64: on CUDA, or on CPU under the Triton interpreter. The order and offsets must be equal
(integers); the combine within 1e-6 relative error in float32 and one rounding in bfloat16 / float16."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.triton_device import triton_device

DEVICE = triton_device("the MoE routing kernels")

from kda_compile.ops.moe.routing import pairs_by_expert  # noqa: E402
from kda_compile.ops.moe.triton_routing import BLOCK, combine_pairs, route_pairs  # noqa: E402


def expert_ids(tokens, top_k, experts, *, seed, sentinels=0, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, experts, (tokens, top_k), generator=g)
    for n in range(sentinels):  # Hugging Face's expert-parallel sentinels: E, and a negative id
        index.view(-1)[(7 * n) % index.numel()] = experts if n % 2 == 0 else -1
    return index.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("tokens, top_k, experts, sentinels", [
    (1, 1, 1, 0), (1, 10, 512, 0), (3, 4, 16, 2), (64, 4, 16, 3), (40, 8, 5, 1), (2 * BLOCK + 3, 2, 70, 4)])
def test_route_pairs_equals_the_stable_sort(dtype, tokens, top_k, experts, sentinels):
    index = expert_ids(tokens, top_k, experts, seed=tokens + experts, sentinels=sentinels, dtype=dtype)
    order, offsets = route_pairs(index, experts)
    want_order, want_offsets = pairs_by_expert(index, experts)
    assert order.dtype == offsets.dtype == torch.int32
    assert torch.equal(order.cpu(), want_order.cpu())
    assert torch.equal(offsets.cpu(), want_offsets.cpu())


def test_every_pair_of_one_expert_keeps_its_index_order():
    index = torch.zeros(BLOCK + 5, 3, dtype=torch.int64, device=DEVICE)  # one expert takes every pair
    order, offsets = route_pairs(index, 4)
    assert torch.equal(order.cpu(), torch.arange(index.numel(), dtype=torch.int32))
    assert offsets.tolist() == [0] + [index.numel()] * 4


@settings(max_examples=15, deadline=None)
@given(tokens=st.integers(1, 40), top_k=st.integers(1, 6), experts=st.integers(1, 140), sentinels=st.integers(0, 3),
       seed=st.integers(0, 2 ** 16))
def test_any_routing_equals_the_stable_sort(tokens, top_k, experts, sentinels, seed):
    index = expert_ids(tokens, top_k, experts, seed=seed, sentinels=sentinels)
    order, offsets = route_pairs(index, experts)
    want_order, want_offsets = pairs_by_expert(index, experts)
    assert torch.equal(order.cpu(), want_order.cpu()) and torch.equal(offsets.cpu(), want_offsets.cpu())


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.float16, 1e-3)]
                         + ([(torch.bfloat16, 8e-3)] if DEVICE.type == "cuda" else []))
@pytest.mark.parametrize("tokens, top_k, width", [(1, 1, 1), (1, 10, 2048), (5, 4, 2304), (9, 3, 37)])
def test_combine_sums_the_routed_slots_and_skips_sentinels(dtype, tolerance, tokens, top_k, width):
    experts = 6
    index = expert_ids(tokens, top_k, experts, seed=width, sentinels=2 if top_k > 1 else 0)
    per_pair = torch.randn(tokens * top_k, width, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    routed = ((index >= 0) & (index < experts)).reshape(-1, 1)
    poisoned = torch.where(routed, per_pair, torch.nan)  # a sentinel's row must never be read
    out = combine_pairs(poisoned, index, experts, dtype)
    want = (per_pair.double() * routed).view(tokens, top_k, width).sum(1)
    assert out.dtype == dtype and out.shape == (tokens, width) and not out.isnan().any()
    error = ((out.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
    assert error < tolerance
