"""The Hopper wgmma indexer score kernel for a few queries (``ops/dsa/indexer/wgmma_indexer.py``). Its choice and switch
on the CPU; on an sm_90 GPU: the scores its codes hold against float64 (relative to the row's largest score:
1e-5), the exact selection of the whole op on integer inputs (every fp32 score exact), the true top-k at
DeepSeek-V3.2 widths, hidden codes outside the visible range and under a key mask, fewer heads than the MMA's
64 rows, keys past the cache's end, strided inputs, a negative scale, the visible ranges computed in the kernels
(decode without cu_seqlens) against explicit ones, and a CUDA-graph capture."""
import pytest
import torch

from kda_compile.ops import _common, dsa_indexer_topk
from kda_compile.ops._common import clear_fallback_events, fallback_events
from kda_compile.ops.dsa.indexer import wgmma_indexer
from kda_compile.ops.dsa.reference import indexer_topk_reference, visible_ranges

cuda = pytest.mark.cuda
sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                          reason="needs an sm_90 GPU")
CODE_HIDDEN = -(2**31)


# ---- CPU ---------------------------------------------------------------------------------------
def _shapes(heads=64, dim=128, dtype=torch.bfloat16):
    return torch.zeros(2, 1, heads, dim, dtype=dtype), torch.zeros(2, 100, dim, dtype=dtype)


def test_outside_design_names_the_reason(monkeypatch):
    q, k = _shapes()
    assert wgmma_indexer.outside_design(q, k) == "not a CUDA tensor"
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(_common, "cuda_index", lambda device: 0)
    monkeypatch.setattr(_common, "device_capability", lambda index: (9, 0))
    assert wgmma_indexer.outside_design(q, k) is None
    assert wgmma_indexer.outside_design(*_shapes(heads=1)) is None
    assert "float32" in wgmma_indexer.outside_design(*_shapes(dtype=torch.float32))
    assert "indexer head dim 64 (the kernel takes 128)" in wgmma_indexer.outside_design(*_shapes(dim=64))
    assert "65 indexer heads (the kernel takes at most 64)" in wgmma_indexer.outside_design(*_shapes(heads=65))
    monkeypatch.setattr(_common, "device_capability", lambda index: (8, 0))
    assert wgmma_indexer.outside_design(q, k) == "needs an sm_90 GPU (warpgroup MMA), got sm_80"


def test_layout_problems_are_named():
    q, k = _shapes()
    assert wgmma_indexer.layout_problem(q, k) is None
    assert "k is torch.float16" in wgmma_indexer.layout_problem(q, k.half())
    odd = torch.zeros(2, 100, 132, dtype=torch.bfloat16)[..., 1:129]
    assert "k's rows are not contiguous and 16-byte aligned" in wgmma_indexer.layout_problem(q, odd)
    odd_q = torch.zeros(2, 1, 64, 132, dtype=torch.bfloat16)[..., 1:129]
    assert "q's rows are not contiguous and 16-byte aligned" in wgmma_indexer.layout_problem(odd_q, k)


def test_choice_and_switch(monkeypatch):
    q, k = _shapes()
    clear_fallback_events()
    assert wgmma_indexer.choose_kernel(q, k) == "triton"  # CPU: outside the design, not recorded
    assert not fallback_events()
    monkeypatch.setenv(wgmma_indexer.KERNEL_ENV, "cuda")
    assert wgmma_indexer.choose_kernel(q, k) == "triton"
    (event,) = fallback_events()
    assert event.op == "dsa_indexer_topk" and "not a CUDA tensor" in event.reason
    monkeypatch.setenv(wgmma_indexer.KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="KDA_COMPILE_INDEXER_KERNEL must be one of auto, triton, cuda"):
        wgmma_indexer.choose_kernel(q, k)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(_common, "cuda_index", lambda device: 0)
    monkeypatch.setattr(_common, "device_capability", lambda index: (9, 0))
    monkeypatch.setenv(wgmma_indexer.KERNEL_ENV, "triton")
    assert wgmma_indexer.choose_kernel(q, k) == "triton"
    clear_fallback_events()
    monkeypatch.setenv(wgmma_indexer.KERNEL_ENV, "auto")
    assert wgmma_indexer.choose_kernel(q, k) == "cuda"
    assert wgmma_indexer.choose_kernel(q, k.half()) == "triton"  # a layout problem on a designed call: recorded
    (event,) = fallback_events()
    assert "k is torch.float16" in event.reason
    clear_fallback_events()


def test_one_wave_of_programs(monkeypatch):
    monkeypatch.setattr(wgmma_indexer, "sm_count", lambda index: 132)
    assert wgmma_indexer.tiles_per_program(512, 64, 0) == 64  # batch 64 x 32k keys: 64 x 8 programs <= 4 x 132
    assert wgmma_indexer.tiles_per_program(512, 600, 0) == 512  # more rows than a wave holds: a program per row
    assert wgmma_indexer.tiles_per_program(512, 1, 0) == 1
    assert wgmma_indexer.tiles_per_program(3, 1, 0) == 1


# ---- CUDA --------------------------------------------------------------------------------------
def _decode_codes(codes: torch.Tensor) -> torch.Tensor:
    """The float32 scores int32 codes stand for (NaN where hidden)."""
    bits = torch.where(codes >= 0, codes, codes ^ 0x7FFFFFFF)
    return bits.view(torch.float32).masked_fill(codes == CODE_HIDDEN, float("nan"))


def _codes(q, k, w, key_mask, lo, hi, scale):
    b, s = q.shape[:2]
    width = k.shape[1]
    codes = torch.full((b, s, width), 12345, dtype=torch.int32, device=q.device)
    wgmma_indexer.indexer_codes_wgmma(q, k, w, key_mask, lo, hi, codes, 0, width, scale)
    return codes


def _dense_scores(q, k, w, scale):
    logits = torch.einsum("bshd,btd->bsht", q.double(), k.double()) * scale
    return (logits.relu() * w.double()[..., None]).sum(2)


@cuda
@sm90
@pytest.mark.parametrize("heads, t, dtype, masked, scale", [
    (64, 3000, torch.bfloat16, False, 128 ** -0.5),
    (32, 777, torch.float16, True, 0.3),
    (1, 50, torch.bfloat16, False, 1.0),
    (8, 4100, torch.bfloat16, True, -0.2),
])
def test_scores_and_hidden_codes(heads, t, dtype, masked, scale):
    g = torch.Generator(device="cuda").manual_seed(heads + t)
    b, s = 3, 4
    q = torch.randn(b, s, heads, 128, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, t, 128, device="cuda", generator=g).to(dtype)
    w = torch.randn(b, s, heads, device="cuda", generator=g).to(dtype)
    key_mask = torch.rand(b, t, device="cuda", generator=g) > 0.3 if masked else None
    lo, hi = visible_ranges(s, t, True, None, "cuda")
    lo = lo + torch.tensor([0, 70, 0, 130], device="cuda").clamp_max(t - 1)  # ranges that skip whole tiles
    codes = _codes(q, k, w, key_mask, lo, hi, scale)
    got = _decode_codes(codes).double()
    want = _dense_scores(q, k, w.float(), scale)
    keys = torch.arange(t, device="cuda")
    visible = (keys >= lo[:, None]) & (keys < hi[:, None])
    visible = visible[None].expand(b, s, t)
    if masked:
        visible = visible & key_mask[:, None, :]
    assert torch.equal(codes == CODE_HIDDEN, ~visible)
    err = (got - want).abs().masked_fill(~visible, 0).amax(-1)
    assert not torch.isnan(got[visible]).any()
    assert (err <= 1e-5 * want.abs().amax(-1).clamp_min(1e-30)).all(), err.max()


@cuda
@sm90
@pytest.mark.parametrize("mode", ["decode", "short-chunk", "packed-chunk", "key-mask", "strided"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_selection_exact_on_integer_inputs(mode, dtype):
    """Integer inputs make every fp32 score exact: the op's selection (this kernel, then the top-k) equals the
    reference's, with no fallback."""
    clear_fallback_events()
    g = torch.Generator(device="cuda").manual_seed(7)
    b, s, t, heads, topk = (4, 1, 5000, 64, 2048) if mode == "decode" else (2, 9, 700, 48, 100)
    cu = key_mask = None
    if mode == "packed-chunk":
        b, t, cu = 1, s, torch.tensor([0, 4, 4, 9], device="cuda", dtype=torch.int32)
    if mode == "key-mask":
        key_mask = torch.rand(b, t, device="cuda", generator=g) > 0.5
    q = torch.randint(-2, 3, (b, s, heads, 128), device="cuda", generator=g).to(dtype)
    k = torch.randint(-2, 3, (b, t, 128), device="cuda", generator=g).to(dtype)
    w = torch.randint(-2, 3, (b, s, heads), device="cuda", generator=g).float() / 4
    if mode == "strided":  # heads of a wider buffer, keys of a [B, T, 2, 128] cache
        q = torch.zeros(b, s, heads + 16, 128, dtype=dtype, device="cuda")[:, :, 16:].copy_(q)
        k = torch.zeros(b, t, 2, 128, dtype=dtype, device="cuda")[:, :, 1].copy_(k)
    assert wgmma_indexer.choose_kernel(q, k) == "cuda"
    got = dsa_indexer_topk(q, k, w, topk, scale=0.5, key_mask=key_mask, cu_seqlens=cu)
    want = indexer_topk_reference(q, k, w, key_mask, cu, topk, 0.5, True)
    assert torch.equal(got, want)
    assert not {e: n for e, n in fallback_events().items() if e.op.startswith("dsa_")}


@cuda
@sm90
def test_true_topk_at_deepseek_widths_and_in_a_graph():
    """bf16 random inputs, 64 heads x 128, top-k 2048: the chosen keys score (fp64) at least as well as any key
    left out, up to fp32 rounding; a CUDA-graph replay returns the eager call's indices."""
    g = torch.Generator(device="cuda").manual_seed(3)
    b, t, heads, topk = 8, 8192 + 37, 64, 2048
    q = torch.randn(b, 1, heads, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(b, t, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(b, 1, heads, device="cuda", generator=g) * heads ** -0.5
    idx = dsa_indexer_topk(q, k, w, topk, scale=128 ** -0.5)
    scores = _dense_scores(q, k, w, 128 ** -0.5)[:, 0]
    chosen = torch.zeros(b, t, dtype=torch.bool, device="cuda")
    chosen.scatter_(1, idx[:, 0].long(), True)
    assert (idx >= 0).all() and chosen.sum(-1).eq(topk).all()
    worst = scores.masked_fill(~chosen, float("inf")).amin(-1)
    best_left = scores.masked_fill(chosen, float("-inf")).amax(-1)
    assert (best_left <= worst + 1e-5 * scores.abs().amax(-1)).all()

    out = torch.empty_like(idx)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.copy_(dsa_indexer_topk(q, k, w, topk, scale=128 ** -0.5))  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(dsa_indexer_topk(q, k, w, topk, scale=128 ** -0.5))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, idx)


@cuda
@sm90
def test_misaligned_queries_fall_back_to_triton_with_the_reason():
    clear_fallback_events()
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randint(-2, 3, (2, 1, 8, 130), device="cuda", generator=g).to(torch.bfloat16)[..., 1:129]
    k = torch.randint(-2, 3, (2, 300, 128), device="cuda", generator=g).to(torch.bfloat16)
    w = torch.ones(2, 1, 8, device="cuda")
    got = dsa_indexer_topk(q, k, w, 50, scale=0.5)
    assert torch.equal(got, indexer_topk_reference(q, k, w, None, None, 50, 0.5, True))
    reasons = [e.reason for e in fallback_events() if e.op == "dsa_indexer_topk"]
    assert any("q's rows are not contiguous and 16-byte aligned" in r for r in reasons), reasons
    clear_fallback_events()


def test_kernels_without_ranges_need_the_call_shape():
    codes = torch.zeros(1, 1, 8, dtype=torch.int32)
    q, k = _shapes()
    with pytest.raises(ValueError, match="needs lo / hi or implicit"):
        wgmma_indexer.indexer_codes_wgmma(q, k, torch.ones(2, 1, 64), None, None, None, codes, 0, 8, 1.0)
    from kda_compile.ops.dsa.indexer import cuda_topk

    with pytest.raises(ValueError, match="needs lo / hi or implicit"):
        cuda_topk.launch(codes, None, None, 0, 4, torch.zeros(1, 1, 4, dtype=torch.int32))


@cuda
@sm90
@pytest.mark.parametrize("s, t, causal", [(1, 3000, True), (9, 700, True), (9, 5, True), (4, 300, False)])
def test_ranges_computed_in_the_kernels_match_the_tensors(s, t, causal):
    """Decode without cu_seqlens: the score and top-k kernels compute the visible ranges themselves (fewer keys
    than queries included: the first rows see none); their codes and indices equal those of explicit ranges."""
    from kda_compile.ops.dsa.indexer import cuda_topk

    g = torch.Generator(device="cuda").manual_seed(s + t)
    b, heads, topk = 3, 16, 64
    q = torch.randn(b, s, heads, 128, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(b, t, 128, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(b, s, heads, device="cuda", generator=g)
    lo, hi = visible_ranges(s, t, causal, None, "cuda")
    want = _codes(q, k, w, None, lo, hi, 0.3)
    got = torch.full_like(want, 12345)
    wgmma_indexer.indexer_codes_wgmma(q, k, w, None, None, None, got, 0, t, 0.3, implicit=(s, t, causal))
    assert torch.equal(got, want)
    idx_want = torch.full((b, s, topk), 7, dtype=torch.int32, device="cuda")
    idx_got = torch.full_like(idx_want, 7)
    cuda_topk.launch(want, lo, hi, 0, topk, idx_want)
    cuda_topk.launch(want, None, None, 0, topk, idx_got, implicit=(s, t, causal))
    assert torch.equal(idx_got, idx_want)


@cuda
@sm90
def test_decode_falls_back_to_the_triton_topk_when_its_kernel_cannot_be_built(monkeypatch):
    from kda_compile.ops._nvrtc import NvrtcUnavailable
    from kda_compile.ops.dsa.indexer import cuda_topk

    def refuse(*args, **kwargs):
        raise NvrtcUnavailable("no NVRTC here")

    monkeypatch.setattr(cuda_topk, "launch", refuse)
    clear_fallback_events()
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randint(-2, 3, (2, 1, 8, 128), device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randint(-2, 3, (2, 900, 128), device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randint(-2, 3, (2, 1, 8), device="cuda", generator=g).float() / 4
    got = dsa_indexer_topk(q, k, w, 100, scale=0.5)
    assert torch.equal(got, indexer_topk_reference(q, k, w, None, None, 100, 0.5, True))
    reasons = [e.reason for e in fallback_events() if e.op == "dsa_indexer_topk"]
    assert any("CUDA top-k kernel could not be built: no NVRTC here" in r for r in reasons), reasons
    clear_fallback_events()
