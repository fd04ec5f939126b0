"""The DSA top-k's CUDA kernel for a few rows (``ops/dsa/indexer/cuda_topk.py``) against ``torch.topk`` over the
reference's int64 sort keys: equal index lists, bit for bit. Its choice and switch on the CPU; the kernel itself
on CUDA (rows of every per-thread width, on one CTA or cut between a cluster of two, ties at the threshold,
hidden keys, partial ranges, top-k above the visible count, strided codes and outputs, a CUDA-graph capture)."""
import pytest
import torch
from hypothesis import given, settings

from kda_compile.ops._common import clear_fallback_events, fallback_events
from kda_compile.ops.dsa.reference import order_keys, topk_from_keys

pytest.importorskip("triton")

from kda_compile.ops.dsa.indexer import cuda_topk, triton_topk  # noqa: E402

from .test_triton_topk import SPECIAL, reference_codes, topk_cases  # noqa: E402

cuda = pytest.mark.cuda
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# ---- CPU ---------------------------------------------------------------------------------------
def test_widths_and_sources():
    widths = (1, 8192, 8193, 16384, 16385, 32768)
    assert [cuda_topk.threads_for(w) for w in widths] == [512, 512, 512, 512, 1024, 1024]
    assert [cuda_topk.per_thread(w, cuda_topk.threads_for(w)) for w in widths] == [16, 16, 32, 32, 32, 32]
    assert cuda_topk.MAX_WIDTH == 32768
    with pytest.raises(ValueError, match="per must be one of"):
        cuda_topk.kernel_source(48)
    with pytest.raises(ValueError, match="cluster must be 1 or 2, got 4"):
        cuda_topk.kernel_source(16, 4)
    assert "#define CLUSTER 2" in cuda_topk.kernel_source(32, 2)


def test_two_ctas_per_row_only_for_wide_rows_that_fit_one_wave():
    assert cuda_topk.cluster_size(32768, 64, 132) == 2
    assert cuda_topk.cluster_size(32768, 67, 132) == 1  # 134 CTAs: more than one wave
    assert cuda_topk.cluster_size(cuda_topk.CLUSTER_MIN_WIDTH, 1, 132) == 1


def test_launch_checks_what_it_takes():
    codes, out = torch.zeros(1, 1, 40000, dtype=torch.int32), torch.zeros(1, 1, 5, dtype=torch.int32)
    with pytest.raises(ValueError, match="at most 32768 columns.*got torch.int32 codes of 40000 columns"):
        cuda_topk.launch(codes, torch.zeros(1), torch.zeros(1), 0, 5, out)
    with pytest.raises(ValueError, match="topk=0"):
        cuda_topk.launch(codes[..., :8], torch.zeros(1), torch.zeros(1), 0, 0, out)


def test_the_switch_is_checked_by_name(monkeypatch):
    monkeypatch.setenv(triton_topk.KERNEL_ENV, "fast")
    codes = torch.zeros(1, 1, 8, dtype=torch.int32)
    out = torch.empty(1, 1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="KDA_COMPILE_TOPK_KERNEL must be one of auto, triton, cuda, got 'fast'"):
        triton_topk.topk_from_codes(codes, torch.zeros(1, dtype=torch.int64), torch.full((1,), 8), 0, 2, out)


def test_which_selects_the_kernel_takes(monkeypatch):
    monkeypatch.setattr(triton_topk, "interpreted", lambda: False)
    serves = triton_topk.cuda_kernel_serves
    assert serves("cuda", 32768, 64, 132) is None  # decode, batch 64
    assert serves("cuda", 100, 1, 132) is None
    assert serves("cpu", 100, 1, 132) == "not a CUDA tensor"
    assert serves("cuda", 32769, 64, 132) == "rows of 32769 codes (the kernel holds at most 32768)"
    assert serves("cuda", 4096, 4096, 132) == "4096 rows fill the GPU (the tiled kernel)"


# ---- CUDA --------------------------------------------------------------------------------------
def _check(scores, visible, lo, hi, topk, *, row0=0, strided=False):
    want = topk_from_keys(order_keys(scores, visible), topk)
    codes = reference_codes(scores, visible).cuda()
    if strided:  # every other column of a wider buffer, and an output with gaps
        wide = torch.full((*codes.shape[:2], 2 * codes.shape[2]), 5, dtype=torch.int32, device="cuda")
        wide[..., ::2] = codes
        codes = wide[..., ::2]
    lo_all = torch.cat([torch.zeros(row0, dtype=torch.int64), lo]).cuda()
    hi_all = torch.cat([torch.zeros(row0, dtype=torch.int64), hi]).cuda()
    buffer = torch.full((*scores.shape[:2], 2 * topk if strided else topk), 7, dtype=torch.int32, device="cuda")
    out = buffer[..., ::2] if strided else buffer
    assert triton_topk._cuda_topk(codes, lo_all, hi_all, row0, topk, out)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), want)
    if strided:
        assert bool((buffer[..., 1::2] == 7).all())


@cuda
@needs_gpu
@settings(max_examples=40, deadline=None)
@given(topk_cases())
def test_equals_torch_topk(case):
    _check(*case)


def _rows(b, rows, width, seed, form, ranges=True):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(b, rows, width, generator=g)
    if form == "quantised":
        scores = (scores * 4).round()
    elif form == "special":
        table = torch.tensor(SPECIAL)
        pick = table[torch.randint(0, len(SPECIAL), scores.shape, generator=g)]
        scores = torch.where(torch.rand(scores.shape, generator=g) < 0.3, pick, scores)
    elif form == "relu":  # the indexer's scores: weighted sums of ReLUs, many exact zeros
        scores = torch.relu(scores) * (torch.rand(b, rows, 1, generator=g) * 3)
    if ranges:
        lo = torch.randint(0, width // 4 + 1, (rows,), generator=g)
        hi = torch.maximum(lo, width - torch.randint(0, width // 4 + 1, (rows,), generator=g))
    else:
        lo, hi = torch.zeros(rows, dtype=torch.int64), torch.full((rows,), width)
    col = torch.arange(width)
    visible = ((col >= lo[:, None]) & (col < hi[:, None]))[None] & (torch.rand(b, 1, width, generator=g) > 0.05)
    return scores, visible, lo, hi


@cuda
@needs_gpu
@settings(max_examples=25, deadline=None)
@given(topk_cases())
def test_equals_torch_topk_with_rows_cut_between_two_ctas(case):
    """The cluster form (each row's halves on two CTAs) forced on every draw, narrow rows included."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cuda_topk, "cluster_size", lambda *args: 2)
        _check(*case)


@cuda
@needs_gpu
@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("width", [8192, 12000, 16384, 32768])
@pytest.mark.parametrize("form", ["continuous", "quantised", "special", "relu"])
def test_wide_rows(width, form, cluster, monkeypatch):
    """Rows of each per-thread width (16, 32, 64 codes a thread), on one CTA or cut between two, partial ranges,
    top-k 2048 (DeepSeek's) and top-k above every row's visible count."""
    monkeypatch.setattr(cuda_topk, "cluster_size", lambda *args: cluster)
    case = _rows(2, 3, width, width + len(form), form)
    for topk in (1, 2048, width + 5):
        _check(*case, topk)


@cuda
@needs_gpu
def test_row_offset_strided_codes_and_output():
    case = _rows(1, 4, 3000, 1, "quantised")
    _check(*case, 300, row0=3, strided=True)


@cuda
@needs_gpu
def test_nothing_visible_and_exactly_topk_visible():
    scores = torch.randn(1, 2, 500)
    lo, hi = torch.tensor([0, 100]), torch.tensor([0, 164])
    col = torch.arange(500)
    visible = ((col >= lo[:, None]) & (col < hi[:, None]))[None]
    _check(scores, visible, lo, hi, 64)


@cuda
@needs_gpu
@pytest.mark.parametrize("switch", ["auto", "cuda", "triton"])
def test_decode_rows_take_the_cuda_kernel_by_default(switch, monkeypatch):
    """64 rows of 32k (batch 64 decode): the automatic choice runs the CUDA kernel, ``triton`` keeps the Triton
    kernels; the same indices either way, no fallback; and the automatic call is captured in a CUDA graph."""
    monkeypatch.setenv(triton_topk.KERNEL_ENV, switch)
    scores, visible, lo, hi = _rows(64, 1, 32768, 9, "relu", ranges=False)
    want = topk_from_keys(order_keys(scores, visible), 2048)
    codes = reference_codes(scores, visible).cuda()
    lo, hi = lo.cuda(), hi.cuda()
    calls = []
    real = triton_topk._cuda_topk
    monkeypatch.setattr(triton_topk, "_cuda_topk", lambda *a: calls.append(1) or real(*a))
    clear_fallback_events()
    out = torch.full((64, 1, 2048), 7, dtype=torch.int32, device="cuda")
    triton_topk.topk_from_codes(codes, lo, hi, 0, 2048, out)
    assert torch.equal(out.cpu(), want)
    assert bool(calls) is (switch != "triton")
    assert not fallback_events()
    graph = torch.cuda.CUDAGraph()
    out.fill_(7)
    with torch.cuda.graph(graph):
        triton_topk.topk_from_codes(codes, lo, hi, 0, 2048, out)
    out.fill_(7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), want)


@cuda
@needs_gpu
def test_forced_cuda_outside_its_rows_is_recorded(monkeypatch):
    monkeypatch.setenv(triton_topk.KERNEL_ENV, "cuda")
    scores, visible, lo, hi = _rows(1, 1, 40000, 3, "continuous", ranges=False)
    clear_fallback_events()
    out = torch.empty(1, 1, 64, dtype=torch.int32, device="cuda")
    triton_topk.topk_from_codes(reference_codes(scores, visible).cuda(), lo.cuda(), hi.cuda(), 0, 64, out)
    assert torch.equal(out.cpu(), topk_from_keys(order_keys(scores, visible), 64))
    (event,) = fallback_events()
    assert event.chosen == "Triton top-k kernels" and "40000 codes" in event.reason
