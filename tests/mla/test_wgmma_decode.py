"""The Hopper wgmma absorbed-MLA decode kernel (``ops/mla/decode/wgmma_decode.py``) against float64 oracles.

Runs only on an sm_90 GPU (the kernel is compiled by NVRTC for sm_90a); the kernel choice and the
source generation are tested on any machine by ``test_decode_kernel_choice.py``. Real widths (latent
512, rope 64). Tolerances (relative RMS error on o_lat): bfloat16 2e-2, float16 5e-3; lse within
1e-4 relative (float32 statistics over the same rounded inputs; hardware exp2 / log2).
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_compile.ops._common import clear_fallback_events, fallback_events
from kda_compile.testing import assert_rel_close

from .naive import Case, assert_matches_latent_oracle, kernel_inputs, latent_oracle

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU (run on the GPU box)")]

from kda_compile.ops.mla.decode import kernels as decode_kernels, wgmma_decode  # noqa: E402

TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2}


def real(**kw) -> Case:
    return Case(r=512, dr=64, dn=128, **kw)


def run_kernel(case, dtype, num_splits=None, seed=0):
    (q_lat, q_rope, kv_latent, k_rope), mask, scale = kernel_inputs(case, dtype, seed)
    on_device = [x.cuda() for x in (q_lat, q_rope, kv_latent, k_rope)]
    assert wgmma_decode.unsupported_reason(*on_device) is None
    out = wgmma_decode.mla_decode_attention_wgmma(*on_device, None if mask is None else mask.cuda(), scale,
                                                  case.causal, num_splits=num_splits)
    return out, latent_oracle(q_lat, q_rope, kv_latent, k_rope, mask, scale, case.causal)


def check(case, dtype, num_splits=None, seed=0):
    (o_lat, lse), (ref_o, ref_lse) = run_kernel(case, dtype, num_splits, seed)
    assert o_lat.dtype == dtype and not torch.isnan(o_lat).any()
    assert_matches_latent_oracle(o_lat, lse, ref_o, ref_lse, case, TOL[dtype], 1e-4)


CASES = {
    "128-heads-decode": real(b=2, h=128, sq=1, t=1000),
    "64-heads-padding": real(b=3, h=64, sq=1, t=300, mask="padding"),
    "cache-1": real(b=2, h=64, sq=1, t=1),
    "tile-minus-1": real(b=1, h=64, sq=1, t=63),
    "tile-plus-1": real(b=1, h=128, sq=1, t=65),
    "speculative-causal-32-heads": real(b=2, h=32, sq=2, t=200, causal=True),
    "rows-not-a-block-multiple": real(b=2, h=40, sq=3, t=150, causal=True),  # 120 rows: a half-empty block
    "chunk-causal-bool-dead-rows": real(b=2, h=16, sq=4, t=90, causal=True, mask="bool", dead_rows=True),
    "float-inf-full-mask": real(b=1, h=32, sq=2, t=70, mask="float_inf", mask_shape="full", dead_rows=True),
    "float-mask-2d": real(b=2, h=64, sq=1, t=129, mask="float", mask_shape="2d"),
    "sq>t-causal": real(b=1, h=16, sq=6, t=3, causal=True),
    "contiguous-inputs": real(b=2, h=64, sq=1, t=200, hf_layout=False),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_oracle(name, dtype):
    check(CASES[name], dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64])
def test_any_split_count_gives_the_same_answer(num_splits):
    check(real(b=2, h=64, sq=2, t=450, causal=True, mask="padding"), torch.bfloat16, num_splits)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_fully_padded_sequence_averages_like_eager(num_splits):
    """HF's finite padding value (finfo.min) on every key: a uniform average, as eager softmax gives."""
    case = real(b=2, h=64, sq=1, t=300, hf_layout=False)
    (q_lat, q_rope, kv_latent, k_rope), _, scale = kernel_inputs(case, torch.bfloat16)
    mask = torch.zeros(2, 1, 1, 300, dtype=torch.bfloat16)
    mask[0] = torch.finfo(torch.bfloat16).min
    mask[1, ..., :250] = torch.finfo(torch.bfloat16).min
    o_lat, _ = wgmma_decode.mla_decode_attention_wgmma(*(x.cuda() for x in (q_lat, q_rope, kv_latent, k_rope)),
                                                       mask.cuda(), scale, False, num_splits=num_splits)
    uniform = kv_latent[0].double().mean(dim=0).expand(64, 1, 512)
    assert_rel_close(o_lat[0], uniform, 1e-2, name="fully padded sequence")
    ref = latent_oracle(q_lat, q_rope, kv_latent, k_rope, mask.float(), scale, False)[0]
    assert_rel_close(o_lat, ref, TOL[torch.bfloat16], name="o_lat")


@settings(deadline=None, max_examples=25)
@given(b=st.integers(1, 3), h=st.sampled_from([16, 32, 40, 64, 128]), sq=st.integers(1, 4), t=st.integers(1, 300),
       causal=st.booleans(), mask=st.sampled_from(["none", "padding", "bool", "float_inf"]),
       splits=st.sampled_from([None, 1, 3]), hf=st.booleans())
def test_fuzz_kernel(b, h, sq, t, causal, mask, splits, hf):
    check(real(b=b, h=h, sq=sq, t=t, causal=causal, mask=mask, dead_rows=mask in ("bool", "float_inf"),
               hf_layout=hf), torch.bfloat16, splits)


def test_repeated_runs_are_bitwise_identical():
    case = real(b=2, h=128, sq=1, t=777, mask="padding")
    (o1, l1), _ = run_kernel(case, torch.bfloat16, num_splits=3)
    (o2, l2), _ = run_kernel(case, torch.bfloat16, num_splits=3)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_replays_inside_a_cuda_graph():
    (q_lat, q_rope, kv_latent, k_rope), _, scale = kernel_inputs(real(b=4, h=128, sq=1, t=500), torch.bfloat16)
    args = [x.cuda() for x in (q_lat, q_rope, kv_latent, k_rope)]
    eager = wgmma_decode.mla_decode_attention_wgmma(*args, None, scale, False)[0].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = wgmma_decode.mla_decode_attention_wgmma(*args, None, scale, False)[0]
    args[2].mul_(0.5)  # new cache contents, same addresses
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(captured, eager), "the replay must read the new cache"
    assert_rel_close(captured, wgmma_decode.mla_decode_attention_wgmma(*args, None, scale, False)[0], 1e-6,
                     name="replay vs eager")


def test_choice_takes_wgmma_for_full_blocks_and_triton_for_32_heads(monkeypatch):
    monkeypatch.delenv(decode_kernels.KERNEL_ENV, raising=False)
    (q_lat, q_rope, kv_latent, k_rope), _, _ = kernel_inputs(real(b=1, h=128, sq=1, t=10), torch.bfloat16)
    cuda = [x.cuda() for x in (q_lat, q_rope, kv_latent, k_rope)]
    assert decode_kernels.choose_decode_kernel(*cuda)[0] == "wgmma"
    narrow = [cuda[0][:, :32], cuda[1][:, :32], cuda[2], cuda[3]]
    kernel, why = decode_kernels.choose_decode_kernel(*narrow)
    assert kernel == "triton" and "32 query rows" in why


def test_misaligned_rows_fall_back_to_triton_with_a_logged_reason(monkeypatch):
    monkeypatch.delenv(decode_kernels.KERNEL_ENV, raising=False)
    (q_lat, q_rope, kv_latent, k_rope), _, scale = kernel_inputs(real(b=2, h=64, sq=1, t=100), torch.bfloat16)
    store = torch.empty(2, 100, 513, dtype=torch.bfloat16, device="cuda")
    store[..., 1:].copy_(kv_latent)
    shifted = store[..., 1:]  # rows 2 bytes past 16-byte alignment
    args = [q_lat.cuda(), q_rope.cuda(), shifted, k_rope.cuda()]
    clear_fallback_events()
    o_lat, _ = decode_kernels.mla_decode(*args, None, scale, False)
    events = fallback_events()
    assert any("wgmma" in e.reason and "aligned" in e.reason for e in events), events
    ref = latent_oracle(q_lat, q_rope, kv_latent, k_rope, None, scale, False)[0]
    assert_rel_close(o_lat, ref, TOL[torch.bfloat16], name="o_lat")


def test_a_batch_broadcast_cache_is_right_on_either_kernel(monkeypatch):
    """One cache expanded over the batch (stride 0): the TMA descriptor may refuse it, then Triton runs it
    with the driver's refusal logged; either way the answer is the oracle's."""
    monkeypatch.delenv(decode_kernels.KERNEL_ENV, raising=False)
    (q_lat, q_rope, kv_latent, k_rope), _, scale = kernel_inputs(real(b=3, h=64, sq=1, t=200), torch.bfloat16)
    latent, rope = kv_latent[:1].cuda().expand(3, -1, -1), k_rope[:1].cuda().expand(3, -1, -1)
    clear_fallback_events()
    o_lat, lse = decode_kernels.mla_decode(q_lat.cuda(), q_rope.cuda(), latent, rope, None, scale, False)
    events = fallback_events()
    assert all("cuTensorMapEncodeTiled" in e.reason for e in events), events
    ref_o, ref_lse = latent_oracle(q_lat, q_rope, latent.cpu(), rope.cpu(), None, scale, False)
    assert_rel_close(o_lat, ref_o, TOL[torch.bfloat16], name="o_lat")
    assert_rel_close(lse, ref_lse, 1e-4, name="lse")
