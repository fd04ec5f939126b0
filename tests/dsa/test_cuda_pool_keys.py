"""glm5_next's CUDA pool-forming kernel (``ops/dsa/pooled/cuda_keys.py``), which copies whole token rows: on HF's
cache layout (keys, gates and the validity flag as views of one ``[B, T, 2 D + 1]`` tensor, rows 2-byte aligned)
and on separate key / gate tensors, against the torch reference ``pooled.pooled_keys`` (validity bits equal, pool
keys within rounding, as the Triton kernel's test bounds them) and against the Triton kernel; the op end to end on
HF's layout (exact selections on quantised inputs, no fallback, a CUDA-graph decode step). The layout rules run on
CPU tensors (no GPU needed), and so does the CUDA branch's plumbing, with recording stand-ins for the device."""
import contextlib
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_compile.ops import dsa_pooled_indexer_topk
from kda_compile.ops._common import clear_fallback_events, fallback_events
from kda_compile.ops.dsa.pooled import cuda_keys as cuda_pool_keys, cuda_keys_source as cuda_pool_keys_source
from kda_compile.ops.dsa.pooled import triton_indexer as triton_pooled
from kda_compile.ops.dsa.pooled.reference import first_valid, pooled_indexer_topk_reference, pooled_keys
from kda_compile.testing import assert_rel_close, hf_cache_rows

from .pooled_naive import KEY_MASK_FORMS, drawn_key_mask, quantised_pooled_inputs

cuda = pytest.mark.cuda  # (skipped without a GPU: tests/conftest.py)
TOL = {torch.bfloat16: 8e-3, torch.float16: 2e-3}  # one unit in the last place of the rounded products and sums


def test_row_layout_reads_hf_rows_as_one_span():
    k, gate = torch.zeros(2, 10, 64, dtype=torch.bfloat16), torch.zeros(2, 10, 64, dtype=torch.bfloat16)
    kv, gv, _ = hf_cache_rows(k, gate, None, lead=3)
    layout = cuda_pool_keys.row_layout(kv, gv)
    assert layout.spans == 1 and layout.widths == (256, 0) and layout.token_strides == (2 * 132, 0)
    assert (layout.k_off, layout.g_off, layout.bases[0]) == (0, 128, kv.data_ptr())
    assert layout.batch_strides == (10 * 132 * 2, 0)


def test_row_layout_reads_separate_tensors_as_two_spans():
    k, gate = torch.zeros(3, 10, 128, dtype=torch.float16), torch.zeros(3, 10, 128, dtype=torch.float16)
    layout = cuda_pool_keys.row_layout(k, gate)
    assert layout.spans == 2 and layout.widths == (256, 256) and layout.bases == (k.data_ptr(), gate.data_ptr())
    one = cuda_pool_keys.row_layout(k[:1], gate[:1])
    assert one.batch_strides == (0, 0)  # a single batch row's stride is never used


def test_row_layout_refuses_rows_it_cannot_copy_whole():
    wide = torch.zeros(2, 10, 512, dtype=torch.bfloat16)
    why = cuda_pool_keys.row_layout(wide[..., :128], wide[..., 384:])  # 256 bytes of gap in every row
    assert isinstance(why, str) and "1024" in why and "gap" in why
    strided = torch.zeros(2, 10, 256, dtype=torch.bfloat16)[..., ::2]
    assert "not contiguous" in cuda_pool_keys.row_layout(strided, strided)


def test_row_layout_finds_the_flags_in_hf_rows():
    k = torch.zeros(2, 10, 64, dtype=torch.bfloat16)
    kv, gv, flags = hf_cache_rows(k, k.clone(), None)
    layout = cuda_pool_keys.row_layout(kv, gv, flags)
    assert layout.spans == 1 and layout.v_off == 256 and layout.widths == (258, 0)
    elsewhere = torch.ones(2, 10, dtype=torch.bfloat16)
    assert cuda_pool_keys.row_layout(kv, gv, elsewhere).v_off == -1
    assert cuda_pool_keys.row_layout(kv, gv, flags.float()).v_off == -1  # not k's dtype: not read in the rows


@st.composite
def pool_cases(draw):
    b = draw(st.integers(1, 3))
    pool = draw(st.sampled_from([1, 3, 16, 32]))
    t = draw(st.integers(1, 5 * pool + 7))
    d = draw(st.sampled_from([32, 96, 128, 256]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    k = torch.randn(b, t, d, generator=g).to(dtype)
    gate = (torch.randn(b, t, d, generator=g) * 3).to(dtype)
    ape = torch.randn(pool, d, generator=g)
    form = draw(st.sampled_from((*KEY_MASK_FORMS, "no mask")))
    valid = None if form == "no mask" else drawn_key_mask(form, b, t, g)
    layout = draw(st.sampled_from(["hf rows", "hf rows, shifted", "separate"]))
    return k, gate, valid, ape, layout


@cuda
@settings(max_examples=40, deadline=None)
@given(pool_cases())
def test_pool_keys_match_the_reference_and_the_triton_kernel(case):
    from kda_compile.ops.dsa.pooled.triton_keys import pooled_keys_triton

    k, gate, valid, ape, layout = case
    first = first_valid(valid) if valid is not None else torch.zeros(k.shape[0], dtype=torch.long)
    ref_pk, ref_valid = pooled_keys(k, gate, valid, ape, first)
    dev = lambda x: None if x is None else x.cuda()  # noqa: E731
    kc, gc = k.cuda(), gate.cuda()
    if layout != "separate":
        kc, gc, _ = hf_cache_rows(kc, gc, dev(valid), lead=1 if layout.endswith("shifted") else 0)
    assert cuda_pool_keys.choose_kernel(kc, gc, ape.shape[0]) == ("triton" if layout == "separate" else "cuda")
    pk, pool_valid = cuda_pool_keys.pooled_keys_cuda(kc, gc, dev(valid), dev(ape), dev(first))
    assert pk.dtype == k.dtype and pk.shape == ref_pk.shape
    assert torch.equal(pool_valid.cpu(), ref_valid)
    assert not torch.isnan(pk).any()
    assert_rel_close(pk.cpu(), ref_pk, TOL[k.dtype], name="pk", floor=1e-3)
    tri_pk, tri_valid = pooled_keys_triton(kc, gc, dev(valid), dev(ape), dev(first))
    assert torch.equal(tri_valid, pool_valid)
    assert_rel_close(pk, tri_pk, TOL[k.dtype], name="pk vs Triton", floor=1e-3)


@cuda
def test_nan_in_an_excluded_token_takes_no_part():
    """A NaN key or gate of an invalid token (HF's cache slot of a padded position may hold any bits) does not
    reach the pool's key; the same NaN in a valid token does."""
    g = torch.Generator().manual_seed(5)
    k = torch.randn(1, 32, 128, generator=g).to(torch.bfloat16)
    gate = torch.randn(1, 32, 128, generator=g).to(torch.bfloat16)
    valid = torch.ones(1, 32, dtype=torch.bool)
    valid[0, 20] = False
    k[0, 20, 5] = float("nan")
    gate[0, 20, 7] = float("nan")
    ape = torch.randn(16, 128, generator=g)
    kc, gc, _ = hf_cache_rows(k.cuda(), gate.cuda(), valid.cuda())
    pk, pool_valid = cuda_pool_keys.pooled_keys_cuda(kc, gc, valid.cuda(), ape.cuda(), first_valid(valid).cuda())
    assert not torch.isnan(pk).any() and pool_valid.tolist() == [[True, False]]
    valid[0, 20] = True
    pk, _ = cuda_pool_keys.pooled_keys_cuda(kc, gc, valid.cuda(), ape.cuda(), first_valid(valid).cuda())
    assert torch.isnan(pk[0, 1]).any()


@cuda
@pytest.mark.parametrize("t", [0, 5, 16, 17, 3000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flags_in_the_rows_give_the_mask_first_keys_and_pools(t, dtype):
    """``pools_from_rows`` (the first-key kernel, then the pool kernel reading the flags it copies): the mask is
    ``flags != 0`` (NaN valid, -0.0 not), the first keys ``first_valid``'s, the pools bit for bit those of the pool
    kernel given that mask. Rows: unpadded, left padding past a whole first round (1100 tokens), holes, none valid,
    odd flag values."""
    g = torch.Generator().manual_seed(t)
    b, d = 5, 128
    k = torch.randn(b, t, d, generator=g).to(dtype)
    gate = torch.randn(b, t, d, generator=g).to(dtype)
    flags = torch.ones(b, t)
    flags[1, :1100] = 0
    flags[2] = (torch.rand(t, generator=g) > 0.3).float()
    flags[3] = 0
    if t > 4:
        flags[4, :4] = torch.tensor([-0.0, float("nan"), 0.5, -2.0])
    ape = torch.randn(16, d, generator=g).cuda()
    kv, gv, fv = hf_cache_rows(k.cuda(), gate.cuda(), None)
    fv.copy_(flags.to(dtype))
    assert cuda_pool_keys.serving_layout(kv, gv, 16, fv).v_off >= 0
    mask, first, pk, pool_valid = cuda_pool_keys.pools_from_rows(kv, gv, fv, ape)
    want_mask = fv != 0
    assert torch.equal(mask, want_mask) and torch.equal(first, first_valid(want_mask))
    want_pk, want_valid = cuda_pool_keys.pooled_keys_cuda(kv, gv, want_mask, ape, first)
    assert torch.equal(pk, want_pk) and torch.equal(pool_valid, want_valid)


@cuda
def test_pair_products_equal_the_per_channel_form(monkeypatch):
    """D a multiple of 64: two channels' products in one 16-bit pair multiply round exactly as one at a time."""
    g = torch.Generator().manual_seed(11)
    k = (torch.randn(3, 700, 128, generator=g) * 4).to(torch.bfloat16).cuda()
    gate = (torch.randn(3, 700, 128, generator=g) * 3).to(torch.bfloat16).cuda()
    ape = torch.randn(16, 128, generator=g).cuda()
    kv, gv, fv = hf_cache_rows(k, gate, (torch.rand(3, 700, generator=g) > 0.1).cuda())
    paired = cuda_pool_keys.pools_from_rows(kv, gv, fv, ape)
    one_by_one = functools.lru_cache(None)(lambda *a: cuda_pool_keys_source.kernel_source(
        elem=a[0], pool=a[1], channels=32 * -(-a[2] // 32), spans=a[3], mask=a[4], pairs=False))
    monkeypatch.setattr(cuda_pool_keys, "_source", one_by_one)
    single = cuda_pool_keys.pools_from_rows(kv, gv, fv, ape)
    for x, y in zip(paired, single):
        assert torch.equal(x, y)


def _hf_layout(a):
    k, gate, _ = hf_cache_rows(a["k"], a["gate"], a["key_valid"])
    return {**a, "k": k, "gate": gate}


def _op(a, topk, tail):
    return dsa_pooled_indexer_topk(a["q"], a["k"], a["weights"], a["gate"], a["ape"], topk, scale=0.5,
                                   key_valid=a["key_valid"], query_mask=a["query_mask"], q_offset=a["q_offset"],
                                   select_tail=tail)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mode", [(2, 700, 3000, None), (2, 64, 6000, 4500), (8, 1, 20000, None)],
                         ids=["chunk-padding", "static-cache", "decode"])
def test_op_on_hf_rows_is_exact_on_quantised_scores(mode, dtype):
    """The op over HF's row layout (the CUDA pool kernel, no fallback) selects what the torch path selects, given
    a bool mask or the cache's flag column."""
    clear_fallback_events()
    b, s, t, length = mode
    a = _hf_layout(quantised_pooled_inputs(b, s, t, 32, 128, 16, device="cuda", dtype=dtype, seed=s, length=length))
    assert cuda_pool_keys.choose_kernel(a["k"], a["gate"], 16) == "cuda"
    got = _op(a, 2048, True)
    want = pooled_indexer_topk_reference(a["q"], a["k"], a["gate"], a["weights"], a["key_valid"], a["ape"],
                                         a["query_mask"], 2048, 0.5, a["q_offset"], True)
    assert torch.equal(got, want)
    flags = hf_cache_rows(a["k"].contiguous(), a["gate"].contiguous(), a["key_valid"])
    with_flags = {**a, "k": flags[0], "gate": flags[1], "key_valid": flags[2]}  # HF's cache column, as rewritten
    assert cuda_pool_keys.serving_layout(flags[0], flags[1], 16, flags[2]).v_off >= 0
    assert torch.equal(_op(with_flags, 2048, True), want)
    assert {e: n for e, n in fallback_events().items() if e.op.startswith("dsa_")} == {}


@cuda
def test_decode_on_hf_rows_replays_from_a_cuda_graph():
    a = _hf_layout(quantised_pooled_inputs(4, 1, 5000, 32, 128, 16, device="cuda", dtype=torch.bfloat16, seed=2))
    b = _hf_layout(quantised_pooled_inputs(4, 1, 5000, 32, 128, 16, device="cuda", dtype=torch.bfloat16, seed=9))
    live = {n: (v.clone() if torch.is_tensor(v) else v) for n, v in a.items()}
    live["k"], live["gate"], live["key_valid"] = hf_cache_rows(a["k"].contiguous(), a["gate"].contiguous(),
                                                               a["key_valid"])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _op(live, 2048, True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _op(live, 2048, True)
    for src in (b, a):
        for name in ("q", "weights", "key_valid", "query_mask", "ape"):
            live[name].copy_(src[name])
        live["k"].copy_(src["k"])
        live["gate"].copy_(src["gate"])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _op(src, 2048, True))


@cuda
def test_separate_tensors_take_the_triton_kernel_unless_forced(monkeypatch):
    k = torch.zeros(2, 64, 128, dtype=torch.bfloat16, device="cuda")
    assert cuda_pool_keys.choose_kernel(k, k.clone(), 16) == "triton"
    monkeypatch.setenv(cuda_pool_keys.KERNEL_ENV, "cuda")
    assert cuda_pool_keys.choose_kernel(k, k.clone(), 16) == "cuda"


def test_forced_kernel_outside_its_layout_is_recorded(monkeypatch):
    """``KDA_COMPILE_POOL_KERNEL=cuda`` on a call it cannot take runs the Triton kernel and says why."""
    monkeypatch.setenv(cuda_pool_keys.KERNEL_ENV, "cuda")
    clear_fallback_events()
    k = torch.zeros(1, 4, 32)
    assert cuda_pool_keys.choose_kernel(k, k, 16) == "triton"
    (event,) = [e for e in fallback_events() if e.op == "dsa_pooled_indexer_topk"]
    assert "not a CUDA tensor" in event.reason
    monkeypatch.setenv(cuda_pool_keys.KERNEL_ENV, "triton")
    clear_fallback_events()
    assert cuda_pool_keys.choose_kernel(k, k, 16) == "triton" and not fallback_events()


class _RecordedKernel:
    """Stands in for a compiled kernel on CPU tensors: records (kernel name, launch arguments as ints)."""

    def __init__(self, launches: list, name: str):
        self.launches, self.name = launches, name

    def launch(self, grid, block, args):
        self.launches.append((self.name, [a.value for a in args]))


def _fake_device(monkeypatch) -> tuple[list, list]:
    """The CUDA pool formers' device calls replaced on CPU tensors: (launches, row_layout's calls)."""
    launches, layouts = [], []
    row_layout = cuda_pool_keys.row_layout
    monkeypatch.setattr(cuda_pool_keys, "outside_design", lambda k, gate, pool: None)
    monkeypatch.setattr(cuda_pool_keys, "cuda_index", lambda device: 0)
    monkeypatch.setattr(cuda_pool_keys, "_shared_limit", lambda index: 227 * 1024)
    monkeypatch.setattr(cuda_pool_keys, "sm_count", lambda index: 132)
    monkeypatch.setattr(cuda_pool_keys, "_arch", lambda index: "90")
    monkeypatch.setattr(cuda_pool_keys, "on_device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(cuda_pool_keys, "load_kernel", lambda source, name, *a, **kw: _RecordedKernel(launches, name))
    monkeypatch.setattr(cuda_pool_keys, "row_layout", lambda *a: layouts.append(a) or row_layout(*a))
    return launches, layouts


@pytest.mark.parametrize("flags_form", ["in_rows", "bool", "none"])
def test_cuda_branch_works_out_the_layout_once_and_launches_with_it(monkeypatch, flags_form):
    """The CUDA branch of ``triton_pooled.form_pools``, run on CPU with recording stand-ins for the device: one
    ``row_layout`` per call, and the launches carry that layout's spans (the flags' offset where they are read in
    the rows: the first-key kernel, then the pool kernel in its flags mode)."""
    launches, layouts = _fake_device(monkeypatch)
    k, gate = torch.randn(2, 40, 128).bfloat16(), torch.randn(2, 40, 128).bfloat16()
    flags = torch.ones(2, 40, dtype=torch.bfloat16)
    kv, gv, fv = hf_cache_rows(k, gate, flags)
    key_valid = {"in_rows": fv, "bool": fv != 0, "none": None}[flags_form]
    triton_pooled.form_pools(kv, gv, key_valid, torch.randn(16, 128))
    assert len(layouts) == 1
    layout = cuda_pool_keys.row_layout(kv, gv, fv if flags_form == "in_rows" else None)
    names = [name for name, _ in launches]
    assert names == ([cuda_pool_keys_source.FIRST_NAME] if flags_form == "in_rows" else []) + [
        cuda_pool_keys_source.KERNEL_NAME]
    args = launches[-1][1]
    assert args[0] == layout.bases[0] and args[7:9] == [layout.batch_strides[0], layout.token_strides[0]]
    assert args[13:17] == [*layout.widths, layout.k_off, layout.g_off]
    assert args[17] == max(layout.v_off, 0) and (layout.v_off >= 0) == (flags_form == "in_rows")
