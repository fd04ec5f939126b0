"""The DSA Triton kernels (``ops/dsa/indexer/triton_indexer.py``, ``triton_sparse.py``, ``triton_sparse_bwd.py``)
against the blockwise reference and the dense oracle.

Runs on CUDA, or on CPU under the Triton interpreter (one small fixed config; float32 / float16 there,
bfloat16 dots are unreliable in the interpreter). Tolerances (relative RMS): float32 1e-5, float16 5e-3;
the indexer's selection is exact on quantised inputs and a true top-k (fp32 slack) otherwise.
"""
import pytest
import torch
from hypothesis import given, settings

from kda_compile.testing import (
    DSAAttentionCase,
    assert_rel_close,
    dsa_attention_inputs,
    dsa_indexer_inputs,
    make_dsa_attention_args,
)

from .naive import assert_true_topk, dense_scores, dense_sparse_attention, dense_topk, dense_visible

from triton_device import triton_device  # noqa: E402

DEVICE = triton_device("the DSA Triton kernels")

from kda_compile.ops.dsa.indexer.triton_indexer import indexer_topk_triton  # noqa: E402
from kda_compile.ops.dsa.sparse.triton_forward import (  # noqa: E402
    INTERPRETED_SMS,
    SparseConfig,
    choose_topk_splits,
    default_config,
    effective_splits,
    sparse_attention_fwd_triton,
)
from kda_compile.ops.dsa.sparse.triton_backward import sparse_attention_bwd_triton  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 5e-3}


@settings(max_examples=10)
@given(dsa_indexer_inputs(dtypes=(torch.float32, torch.float16), device=DEVICE, max_t=36, max_heads=3,
                          dims=(8, 16)))
def test_indexer_kernel(args):
    case = args.case
    got = indexer_topk_triton(args["q"], args["k"], args["weights"], args["key_mask"], args["cu_seqlens"],
                              case.topk, case.scale, case.causal)
    scores = dense_scores(args["q"], args["k"], args["weights"], case.scale)
    visible = dense_visible(case.b, case.s, case.t, case.causal, args["key_mask"], args["cu_seqlens"])
    if case.quantised:
        assert torch.equal(got.cpu(), dense_topk(scores, visible, case.topk))
    else:
        assert_true_topk(got, scores, visible, case.topk)


@pytest.mark.parametrize("descriptor", [True, False])
def test_indexer_decode_key_descriptor(descriptor, monkeypatch):
    """Decode (fewer than SHORT_QUERIES queries) with the keys loaded through a TMA descriptor or by pointers:
    the same exact selection on integer-valued inputs (exact scores), a causal range and a key mask included;
    keys past T inside the last tile are zero-filled by the descriptor and coded hidden."""
    from kda_compile.ops.dsa.indexer import triton_indexer

    monkeypatch.setattr(triton_indexer, "DECODE_KEY_DESCRIPTOR", descriptor)
    g = torch.Generator().manual_seed(1)
    b, s_len, t_len, heads, dim, topk = 2, 3, 70, 4, 16, 9
    q = torch.randint(-2, 3, (b, s_len, heads, dim), generator=g).half()
    k = torch.randint(-2, 3, (b, t_len, dim), generator=g).half()
    w = torch.randint(-2, 3, (b, s_len, heads), generator=g).half()
    key_mask = torch.rand(b, t_len, generator=g) > 0.2
    assert (triton_indexer.key_descriptor(k.to(DEVICE), 16, dim) is not None) is (
        descriptor and (torch.device(DEVICE).type == "cpu" or torch.cuda.get_device_capability()[0] >= 9))
    for mask in (None, key_mask):
        got = indexer_topk_triton(q.to(DEVICE), k.to(DEVICE), w.to(DEVICE), None if mask is None else mask.to(DEVICE),
                                  None, topk, 0.5, True)
        want = dense_topk(dense_scores(q, k, w, 0.5), dense_visible(b, s_len, t_len, True, mask), topk)
        assert torch.equal(got.cpu(), want)


def test_key_descriptor_only_where_tma_can_load():
    """No descriptor for float32 keys, a non-unit last stride, a head width that is not the block's, or
    misaligned strides: those keep the pointer loads."""
    from kda_compile.ops.dsa.indexer.triton_indexer import key_descriptor

    k = torch.zeros(2, 40, 32, dtype=torch.float16, device=DEVICE)
    assert key_descriptor(k.float(), 16, 32) is None
    assert key_descriptor(k[:, :, ::2], 16, 16) is None
    assert key_descriptor(k[:, :, :24], 16, 32) is None
    assert key_descriptor(torch.zeros(2, 40, 36, dtype=torch.float16, device=DEVICE)[..., :32], 16, 32) is None


def _check_kernels(args, config=None):
    case = args.case
    q, k, v, idx = args["q"], args["k"], args["v"], args["indices"]
    scale = case.dqk ** -0.5 if case.scale is None else case.scale
    o, lse = sparse_attention_fwd_triton(q, k, v, idx, scale, case.dv, config=config)
    refs = [x.detach().double().cpu().requires_grad_(True) if x is not None else None for x in (q, k, v)]
    o_ref, lse_ref = dense_sparse_attention(refs[0], refs[1], refs[2], idx.cpu(), scale, case.dv)
    tol = TOL[q.dtype]
    assert_rel_close(o, o_ref, tol, name="o", floor=1e-6)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse).cpu(), finite)
    assert_rel_close(lse.cpu()[finite], lse_ref[finite], 1e-5, name="lse", floor=1e-6)
    gen = torch.Generator().manual_seed(args.seed)
    g_o = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    g_l = torch.randn(lse.shape, generator=gen, dtype=torch.float64).masked_fill(~finite, 0)
    grads = sparse_attention_bwd_triton(g_o.to(DEVICE, q.dtype), g_l.float().to(DEVICE), q, k, v, idx, o, lse,
                                        scale, case.dv)
    used = [r for r in refs if r is not None]
    loss = (o_ref * g_o.to(q.dtype).double()).sum() + (lse_ref.masked_fill(~finite, 0) * g_l.float().double()).sum()
    grads_ref = torch.autograd.grad(loss, used)
    for name, g, r in zip("qkv", grads, grads_ref):
        assert_rel_close(g, r, tol * 4, name=f"d{name}", floor=1e-6)


@settings(max_examples=6)
@given(dsa_attention_inputs(dtypes=(torch.float32, torch.float16), device=DEVICE, max_s=3, max_t=30, max_topk=24,
                            qk_dims=(12, 24, 40), value_dims=(8, 16)))
def test_sparse_attention_kernels(args):
    _check_kernels(args)


@pytest.mark.parametrize("case,config", [
    # the value read from the key's main tile (576 = 512 + 64 in DeepSeek-V3.2, here 32 + 16)
    (DSAAttentionCase(b=1, s=3, t=40, hq=20, dqk=48, dv=32, topk=37, absorbed=True), None),
    # the value width split across programs
    (DSAAttentionCase(b=1, s=2, t=25, hq=6, hkv=2, dqk=24, dv=40, topk=9, absorbed=False),
     SparseConfig(16, 16, 2, 1, 1)),
    (DSAAttentionCase(b=1, s=2, t=25, hq=4, dqk=48, dv=32, topk=9, absorbed=True), SparseConfig(16, 16, 2, 1, 1)),
])
def test_sparse_attention_kernel_layouts(case, config):
    _check_kernels(make_dsa_attention_args(case, torch.float32, DEVICE, seed=3), config)


# ----------------------------------------------------------------------------------------------
# Split-K over the top-k list (decode): partials per range of the list, merged by log-sum-exp
# ----------------------------------------------------------------------------------------------
def _split_rows_args(case, dtype, seed=5):
    """``case``'s tensors with four index rows per batch entry that stress the merge: no valid index
    (o = 0, lse = -inf), valid only in the first slots (every later split empty), valid only in the last
    partial chunk (every earlier split empty), and unique keys at random slots. Needs ``case.s == 4``."""
    args = make_dsa_attention_args(case, dtype, DEVICE, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.full((case.b, case.s, case.topk), -1, dtype=torch.int32)
    last = case.topk - case.topk % 16 if case.topk % 16 else case.topk - 16
    for bi in range(case.b):
        idx[bi, 1, :5] = torch.randperm(case.t, generator=gen)[:5].to(torch.int32)
        idx[bi, 2, last:] = torch.randperm(case.t, generator=gen)[:case.topk - last].to(torch.int32)
        n = min(case.t, case.topk) - 7
        idx[bi, 3, torch.randperm(case.topk, generator=gen)[:n]] = torch.randperm(case.t, generator=gen)[:n].to(
            torch.int32)
    args["indices"] = idx.to(DEVICE)
    return args


# top-k 70 in chunks of 16: 5 chunks; 2 splits (3 + 2) and 3 splits (2 + 2 + 1) do not divide them, 4 is
# normalised to 3 (no empty split), 8 is capped at 5 (one chunk each)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 2, 3, 4, 8])
def test_sparse_attention_topk_splits(splits, dtype):
    case = DSAAttentionCase(b=1, s=4, t=80, hq=4, dqk=48, dv=32, topk=70, absorbed=True)
    _check_kernels(_split_rows_args(case, dtype), SparseConfig(16, 16, 1, 1, 1, splits))


@pytest.mark.parametrize("at_once", [False, True])
@pytest.mark.parametrize("splits", [2, 3])
def test_sparse_attention_topk_splits_layouts(splits, at_once, monkeypatch):
    # separate values, two KV heads, d_v split over two programs, more heads than one block: every program
    # coordinate of the folded split grid (value slice, head block, split, token) is non-trivial; the combine
    # loads the splits one after the other or all at once (its form above COMBINE_AT_ONCE_ABOVE splits)
    from kda_compile.ops.dsa.sparse import triton_forward as triton_sparse

    monkeypatch.setattr(triton_sparse, "COMBINE_AT_ONCE_ABOVE", 0 if at_once else 64)
    case = DSAAttentionCase(b=2, s=4, t=50, hq=20, hkv=2, dqk=24, dv=40, topk=40, absorbed=False)
    _check_kernels(_split_rows_args(case, torch.float32), SparseConfig(16, 16, 2, 1, 1, splits))


def test_sparse_attention_automatic_splits():
    """Decode-sized grids split by themselves (the interpreter pretends to have 4 SMs); the result is the
    same as the unsplit kernel's up to rounding."""
    case = DSAAttentionCase(b=1, s=1, t=300, hq=8, dqk=40, dv=16, topk=256, absorbed=True)
    args = make_dsa_attention_args(case, torch.float32, DEVICE, seed=7)
    args["indices"] = torch.randperm(case.t)[:case.topk].to(torch.int32).view(1, 1, -1).to(DEVICE)
    if DEVICE.type == "cpu":
        assert default_config(8, 40, 16, torch.float32).topk_splits is None
        assert choose_topk_splits(1, 16, INTERPRETED_SMS) == 4  # 1 token x 1 head block, 16 chunks of 16
    _check_kernels(args)
    o1, lse1 = sparse_attention_fwd_triton(args["q"], args["k"], None, args["indices"], 0.2, case.dv,
                                           config=SparseConfig(16, 16, 1, 1, 1, 1))
    o, lse = sparse_attention_fwd_triton(args["q"], args["k"], None, args["indices"], 0.2, case.dv)
    assert o.is_contiguous() and o.dtype == args["q"].dtype and lse.dtype == torch.float32
    assert_rel_close(o, o1, 1e-5, name="o", floor=1e-6)
    assert_rel_close(lse, lse1, 1e-6, name="lse", floor=1e-6)


def test_topk_split_policy():
    """The wave model's choices on a 132-SM GPU at DeepSeek-V3.2 decode widths (2 programs per token: 128
    heads in two blocks; top-k 2048 in 64 chunks of 32) and at 4k prefill; and its argument checks."""
    assert choose_topk_splits(2 * 1, 64, 132) == 32  # batch 1: 64 programs of two chunks (H200: 31 us, 64 splits 38)
    assert choose_topk_splits(2 * 16, 64, 132) == 4
    assert choose_topk_splits(2 * 64, 64, 132) == 1  # 128 programs already hold one SM each
    assert choose_topk_splits(2 * 4096, 64, 132) == 1  # prefill: launched as without splits
    assert choose_topk_splits(1, 1, 132) == 1  # a single chunk cannot split
    assert effective_splits(3, 5) == (3, 2) and effective_splits(4, 5) == (3, 2)
    assert effective_splits(8, 5) == (5, 1) and effective_splits(1, 5) == (1, 5) and effective_splits(2, 0) == (1, 1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="topk_splits must be None"):
            SparseConfig(16, 16, 1, 1, 1, bad)


@pytest.mark.parametrize("rows", [4, 20])
def test_empty_chunks_attended_or_skipped(rows):
    """Up to ``SHORT_QUERIES`` queries every chunk is attended (all -1 chunks masked, no branch); more queries
    skip all -1 chunks. Both give the oracle's o and lse on rows with no, few, trailing or scattered indices."""
    case = DSAAttentionCase(b=1, s=4, t=80, hq=4, dqk=48, dv=32, topk=70, absorbed=True)
    args = _split_rows_args(case, torch.float32)
    if rows > 4:  # repeat the four patterns over more query rows, past the short-query bound
        from kda_compile.ops.dsa.sparse.triton_forward import SHORT_QUERIES

        assert rows > SHORT_QUERIES
        case = DSAAttentionCase(b=1, s=rows, t=80, hq=4, dqk=48, dv=32, topk=70, absorbed=True)
        more = make_dsa_attention_args(case, torch.float32, DEVICE, seed=5)
        more["indices"] = args["indices"].repeat(1, rows // 4, 1)
        args = more
    _check_kernels(args, SparseConfig(16, 16, 1, 1, 1, 1))


def test_unchecked_bad_offsets_stay_in_range_and_checked_ones_raise(monkeypatch):
    """``cu_seqlens`` on the kernels' path: its values are read (and a bad set rejected, naming them) only with
    ``KDA_COMPILE_CHECK_INPUTS=1``; unchecked, offsets past T or decreasing give in-range indices (every range is
    clamped to the keys: the top-k never reads outside its code rows)."""
    from kda_compile.ops.dsa import kernels
    from kda_compile.ops.dsa.reference import visible_ranges

    gen = torch.Generator().manual_seed(3)
    t, heads, dim, topk = 12, 2, 8, 4
    q = torch.randn(1, t, heads, dim, generator=gen).to(DEVICE)
    k = torch.randn(1, t, dim, generator=gen).to(DEVICE)
    w = torch.randn(1, t, heads, generator=gen).to(DEVICE)
    bad = torch.tensor([0, 3, 30, 40], dtype=torch.int32, device=DEVICE)  # ends past T = 12
    for causal in (False, True):
        lo, hi = visible_ranges(t, t, causal, bad, DEVICE)
        assert bool(((lo >= 0) & (lo <= hi) & (hi <= t)).all()), (lo, hi)
        monkeypatch.setenv("KDA_COMPILE_CHECK_INPUTS", "0")
        got = kernels.indexer_topk_cuda(q, k, w, None, bad, topk, 1.0, causal)
        assert got.shape == (1, t, topk) and bool(((got >= -1) & (got < t)).all())
        monkeypatch.setenv("KDA_COMPILE_CHECK_INPUTS", "1")
        with pytest.raises(ValueError, match=r"non-decreasing offsets from 0 to T = 12, got \[0, 3, 30, 40\]"):
            kernels.indexer_topk_cuda(q, k, w, None, bad, topk, 1.0, causal)


def test_decode_takes_the_triton_kernels_when_the_cuda_score_kernel_cannot_be_built(monkeypatch):
    """The few-query route whose score kernel NVRTC cannot build: one recorded fallback, then the Triton kernels
    (here on the device the tests run on), the exact selection on integer inputs."""
    from kda_compile.ops._common import clear_fallback_events, fallback_events
    from kda_compile.ops._nvrtc import NvrtcUnavailable
    from kda_compile.ops.dsa.indexer import triton_indexer, wgmma_indexer

    def refuse(*args, **kwargs):
        raise NvrtcUnavailable("no NVRTC here")

    monkeypatch.setattr(wgmma_indexer, "choose_kernel", lambda q, k: "cuda")
    monkeypatch.setattr(triton_indexer, "cuda_select_takes", lambda *args: True)
    monkeypatch.setattr(wgmma_indexer, "indexer_codes_wgmma", refuse)
    clear_fallback_events()
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-2, 3, (2, 1, 4, 16), generator=g).half()
    k = torch.randint(-2, 3, (2, 40, 16), generator=g).half()
    w = torch.randint(-2, 3, (2, 1, 4), generator=g).half()
    got = indexer_topk_triton(q.to(DEVICE), k.to(DEVICE), w.to(DEVICE), None, None, 9, 0.5, True)
    assert torch.equal(got.cpu(), dense_topk(dense_scores(q, k, w, 0.5), dense_visible(2, 1, 40, True, None), 9))
    events = {e: n for e, n in fallback_events().items() if e.op == "dsa_indexer_topk"}
    assert len(events) == 1 and list(events.values()) == [1], events
    assert "wgmma indexer kernel could not be built: no NVRTC here" in next(iter(events)).reason
    clear_fallback_events()


@pytest.mark.parametrize("route", ["packed", "ranges-in-kernels", "range-tensors"])
def test_few_query_cuda_route_passes_the_ranges_of_each_call(route, monkeypatch):
    """The few-query CUDA route with its score kernel replaced by a torch one that writes the codes of the ranges
    it is given (tensors, or the call shape when the kernels compute them): packed sequences pass range tensors;
    without them the ranges go to the kernels when the CUDA top-k takes the rows (its build refused here, so the
    top-k finishes from range tensors, recorded), and range tensors otherwise. Exact on integer inputs."""
    from kda_compile.ops._common import clear_fallback_events, fallback_events
    from kda_compile.ops._nvrtc import NvrtcUnavailable
    from kda_compile.ops.dsa.indexer import cuda_topk, triton_indexer, wgmma_indexer
    from kda_compile.ops.dsa.reference import visible_ranges

    from .test_triton_topk import reference_codes

    g = torch.Generator().manual_seed(3)
    b, s, t, heads, topk = 2, 5, 40, 4, 9
    cu = None
    if route == "packed":
        b, t, cu = 1, s, torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    q = torch.randint(-2, 3, (b, s, heads, 16), generator=g).half()
    k = torch.randint(-2, 3, (b, t, 16), generator=g).half()
    w = torch.randint(-2, 3, (b, s, heads), generator=g).half()
    key_mask = torch.rand(b, t, generator=g) > 0.2
    given = []

    def torch_codes(q_, k_, w_, mask_, lo, hi, codes, row0, width, scale, *, implicit=None):
        given.append("implicit" if lo is None else "tensors")
        if lo is None:
            lo, hi = visible_ranges(implicit[0], implicit[1], implicit[2], None, codes.device)
        keys = torch.arange(width)
        visible = (keys >= lo.cpu()[:, None]) & (keys < hi.cpu()[:, None]) & mask_.cpu()[:, None, :width]
        codes.copy_(reference_codes(dense_scores(q_, k_, w_, scale)[..., :width], visible).to(codes.device))

    def refuse(*args, **kwargs):
        raise NvrtcUnavailable("no NVRTC here")

    monkeypatch.setattr(wgmma_indexer, "choose_kernel", lambda q_, k_: "cuda")
    monkeypatch.setattr(wgmma_indexer, "indexer_codes_wgmma", torch_codes)
    monkeypatch.setattr(triton_indexer, "cuda_select_takes", lambda *args: route == "ranges-in-kernels")
    if route == "ranges-in-kernels":
        monkeypatch.setattr(cuda_topk, "launch", refuse)
    clear_fallback_events()
    got = indexer_topk_triton(q.to(DEVICE), k.to(DEVICE), w.to(DEVICE), key_mask.to(DEVICE),
                              None if cu is None else cu.to(DEVICE), topk, 0.5, True)
    want = dense_topk(dense_scores(q, k, w, 0.5), dense_visible(b, s, t, True, key_mask, cu), topk)
    assert torch.equal(got.cpu(), want)
    assert given == ["implicit" if route == "ranges-in-kernels" else "tensors"]
    reasons = [e.reason for e in fallback_events() if e.op == "dsa_indexer_topk"]
    assert any("CUDA top-k kernel could not be built" in r for r in reasons) == (route == "ranges-in-kernels")
    clear_fallback_events()
