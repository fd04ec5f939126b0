"""The DSA indexer's radix top-k (``ops/dsa/indexer/triton_topk.py``) against ``torch.topk`` over the reference's
int64 sort keys (``reference.topk_from_keys``): equal index lists, bit for bit (the same set, the same tie
rule, ascending key order).

Runs on CUDA, or on CPU under the Triton interpreter (small tiles there). Scores are drawn with many ties
(quantised), signed zeros, infinities and the extremes of float32, over visible ranges that are empty,
partial or wider than one tile, with top-k below, at and above the visible count. Every path is checked: the
register-resident row (at each digit width), one program per row over tiles and the row split (forced with
``chunks``, including more chunks than a row has tiles), and the functions that choose between them.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_compile.ops.dsa.reference import order_keys, topk_from_keys

from triton_device import triton_device  # noqa: E402

DEVICE = triton_device("the DSA top-k kernel")

from kda_compile.ops.dsa.indexer import triton_topk  # noqa: E402

SPECIAL = (0.0, -0.0, float("inf"), float("-inf"), 3.4028235e38, -3.4028235e38, 1e-45, -1e-45)


def reference_codes(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The int32 codes ``score_codes`` writes, computed with torch (the oracle of the code layout)."""
    bits = (scores.float() + 0.0).view(torch.int32)
    code = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).clamp_min(triton_topk.CODE_HIDDEN + 1)
    return torch.where(visible, code, torch.full_like(code, triton_topk.CODE_HIDDEN))


@st.composite
def topk_cases(draw):
    b = draw(st.integers(1, 2))
    rows = draw(st.integers(1, 4))
    width = draw(st.integers(1, 200))
    topk = draw(st.integers(1, 48))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(b, rows, width, generator=g)
    form = draw(st.sampled_from(["quantised", "continuous", "special"]))
    if form == "quantised":  # many equal scores: the tie rule decides
        scores = (scores * 2).round() / 2
    elif form == "special":
        pick = torch.randint(0, len(SPECIAL) + 1, scores.shape, generator=g)
        table = torch.tensor((*SPECIAL, 0.5))
        scores = torch.where(torch.rand(scores.shape, generator=g) < 0.5, table[pick], scores)
    lo = torch.randint(0, width + 1, (rows,), generator=g)
    hi = torch.minimum(lo + torch.randint(0, width + 1, (rows,), generator=g), torch.tensor(width))
    col = torch.arange(width)
    visible = ((col >= lo[:, None]) & (col < hi[:, None]))[None] & (torch.rand(b, 1, width, generator=g) > 0.2)
    return scores, visible, lo, hi, topk


def _check(scores, visible, lo, hi, topk, chunks=None, resident=None):
    want = topk_from_keys(order_keys(scores, visible), topk)
    codes = reference_codes(scores, visible).to(DEVICE)
    out = torch.full((*scores.shape[:2], topk), 7, dtype=torch.int32, device=DEVICE)
    triton_topk.topk_from_codes(codes, lo.to(DEVICE), hi.to(DEVICE), 0, topk, out, chunks=chunks,
                                resident=resident)
    assert torch.equal(out.cpu(), want)


@settings(max_examples=16, deadline=None)
@given(topk_cases(), st.sampled_from(["resident", "tiles"]))
def test_radix_topk_equals_torch_topk(case, path):
    _check(*case, chunks=1 if path == "tiles" else None, resident=path == "resident")


PATHS = {"resident": ("RESIDENT_BITS", dict(resident=True)), "tiles": ("TILED_BITS", dict(chunks=1)),
         "split": ("SPLIT_BITS", dict(chunks=3))}


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_digit_widths(path, bits, monkeypatch):
    """Every digit width each kernel can run (32 / bits rounds at most) selects the same keys: quantised
    scores (ties at the threshold), the special values, a batch with nothing visible."""
    constant, kwargs = PATHS[path]
    monkeypatch.setattr(triton_topk, constant, bits)
    g = torch.Generator().manual_seed(bits)
    table = torch.tensor(SPECIAL)
    special = table[torch.randint(0, len(SPECIAL), (2, 2, 120), generator=g)]
    quantised = (torch.randn(2, 2, 120, generator=g) * 2).round()
    lo = torch.tensor([0, 13])
    hi = torch.tensor([120, 101])
    keep = torch.ones(2, 1, 120, dtype=torch.bool)
    keep[1] = False
    for scores in (special, quantised):
        case = _range_case(scores, lo, hi, keep)
        for topk in (1, 7, 40, 130):
            _check(*case, topk, **kwargs)


@pytest.mark.parametrize("chunks", [None, 1, 3])
def test_row_offset_and_strided_output(chunks):
    """``row0`` picks the rows' ranges from [S]-long lo / hi; ``out`` may be a strided view (the launcher
    writes blocks of query rows into the full output). Both paths."""
    g = torch.Generator().manual_seed(5)
    scores = (torch.randn(1, 3, 90, generator=g) * 3).round()
    lo_all = torch.tensor([0, 0, 10, 0, 30])
    hi_all = torch.tensor([5, 90, 90, 40, 90])
    col = torch.arange(90)
    visible = ((col >= lo_all[2:, None]) & (col < hi_all[2:, None]))[None]
    want = topk_from_keys(order_keys(scores, visible), 24)
    out = torch.full((1, 5, 24), 7, dtype=torch.int32, device=DEVICE)
    triton_topk.topk_from_codes(reference_codes(scores, visible).to(DEVICE), lo_all.to(DEVICE), hi_all.to(DEVICE),
                                2, 24, out[:, 2:], chunks=chunks)
    assert torch.equal(out[:, 2:].cpu(), want)
    assert bool((out[:, :2] == 7).all())


# ----------------------------------------------------------------------------------------------
# The row split (few long rows): forced, so the interpreter's small tiles give many chunks.
# ----------------------------------------------------------------------------------------------
@settings(max_examples=10, deadline=None)
@given(topk_cases(), st.sampled_from([2, 3, 5, 20]))
def test_row_split_equals_torch_topk(case, chunks):
    """20 chunks: more than any drawn row has tiles (16 codes each under the interpreter), so some chunks
    are empty."""
    _check(*case, chunks=chunks)


def _range_case(scores, lo, hi, keep=None):
    col = torch.arange(scores.shape[-1])
    visible = ((col >= lo[:, None]) & (col < hi[:, None]))[None].expand(scores.shape)
    if keep is not None:
        visible = visible & keep
    return scores, visible, lo, hi


@pytest.mark.parametrize("chunks, topks", [(3, (1, 60, 160)), (7, (23, 140))])
def test_row_split_ties_across_chunks(chunks, topks):
    """Three distinct scores over 150 keys: the top-k's smallest score is shared by keys in many chunks, and
    only the lowest-indexed of them may be taken (the tie rank runs over the whole row, not per chunk). Rows
    start and end inside tiles, one row sees part of one tile only (most chunks empty), one sees nothing;
    top-k 160 is above every row's visible count."""
    g = torch.Generator().manual_seed(11)
    scores = torch.randint(0, 3, (1, 4, 150), generator=g).float()
    lo = torch.tensor([0, 7, 70, 40])
    hi = torch.tensor([150, 141, 75, 40])
    case = _range_case(scores, lo, hi, torch.rand(1, 1, 150, generator=g) > 0.1)
    for topk in topks:
        _check(*case, topk, chunks=chunks)


def test_row_split_special_and_hidden():
    """Signed zeros, infinities and the float32 extremes, many equal; a batch whose keys are all hidden."""
    g = torch.Generator().manual_seed(3)
    table = torch.tensor(SPECIAL)
    scores = table[torch.randint(0, len(SPECIAL), (2, 2, 120), generator=g)]
    lo = torch.tensor([0, 13])
    hi = torch.tensor([120, 101])
    keep = torch.ones(2, 1, 120, dtype=torch.bool)
    keep[1] = False
    case = _range_case(scores, lo, hi, keep)
    for topk in (7, 130):
        _check(*case, topk, chunks=4)


@pytest.mark.parametrize("grid_rows, width, sms, chunks", [
    (64, 32768, 132, 12),  # decode, batch 64: 6 x 132 // 64 programs per row
    (1, 32768, 132, 16),  # decode, batch 1: capped at 2 tiles of 1024 per chunk
    (1, 131072, 132, 64),
    (4096, 4096, 132, 1),  # prefill: the rows fill the GPU
    (264, 32768, 132, 1),  # 2 rows per SM: no split
    (1, 100, 132, 1),  # narrower than 4 tiles
    (1, 4096, 132, 2),
])
def test_row_split_choice(grid_rows, width, sms, chunks):
    assert triton_topk.row_split_chunks(grid_rows, width, sms, 1024) == chunks


@pytest.mark.parametrize("width_p2, grid_rows, resident", [
    (8192, 64, True),  # decode, batch 64 x 8k
    (4096, 200, True),
    (8192, 4096, False),  # prefill: the tiled kernel fills the GPU
    (16384, 64, False),  # wider rows: the row split
    (32768, 64, False),
    (8192, 16, False),  # too few rows for the SMs: the row split
])
def test_resident_auto_choice(width_p2, grid_rows, resident):
    assert triton_topk._auto_resident(width_p2, grid_rows, 132) is resident


@pytest.mark.parametrize("width, grid_rows, uncaptured, path", [
    (8192, 64, False, ("resident", 1)),  # batched decode over 8k keys
    (8192, 64, True, ("resident", 1)),
    (32768, 64, False, ("split", 12)),  # in a CUDA graph: the row split
    (32768, 64, True, ("resident", 1)),  # uncaptured, 2M codes: one launch instead of seven
    (32768, 1, False, ("split", 16)),
    (32768, 1, True, ("tiles", 1)),  # uncaptured, few codes: one program per row
    (65536, 64, True, ("split", 12)),  # wider than the resident kernel's uncaptured limit
    (16384, 4096, False, ("tiles", 1)),  # prefill
    (100, 4, False, ("tiles", 1)),
])
def test_choose_path(width, grid_rows, uncaptured, path, monkeypatch):
    monkeypatch.setattr(triton_topk, "interpreted", lambda: False)  # the GPU's tile sizes
    assert triton_topk.choose_path(width, grid_rows, 132, uncaptured) == path


def test_tiled_config():
    assert [triton_topk.tiled_config(w) for w in (100, 4096, 8192, 16384, 32768, 131072)] == [
        (512, 4), (512, 4), (512, 4), (512, 8), (4096, 8), (4096, 8)]


def test_resident_warps():
    assert [triton_topk.resident_warps(w) for w in (16, 2048, 8192, 16384, 32768, 65536)] == [4, 4, 16, 16, 32, 32]


def test_resident_choice(monkeypatch):
    """Rows up to AUTO_RESIDENT_WIDTH codes take the register-resident kernel unless ``chunks`` names a tiled
    path or the rows are too few; wider rows take the tiled kernels, and forcing the resident kernel beyond
    MAX_RESIDENT_WIDTH is an error (the Triton kernels' own choice: the CUDA kernel for few rows is switched off)."""
    monkeypatch.setenv(triton_topk.KERNEL_ENV, "triton")
    launched = []
    monkeypatch.setattr(triton_topk, "MAX_RESIDENT_WIDTH", 64)
    monkeypatch.setattr(triton_topk, "AUTO_RESIDENT_WIDTH", 64)
    monkeypatch.setattr(triton_topk, "AUTO_RESIDENT_ROWS_PER_SM", 0.0)  # any row count
    real = triton_topk.resident_topk_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(triton_topk, "resident_topk_kernel", Spy())
    scores = torch.randn(1, 2, 60)
    case = _range_case(scores, torch.tensor([0, 3]), torch.tensor([60, 50]))
    _check(*case, 10)
    assert launched == [(2, 1)]
    _check(*case, 10, chunks=1)
    assert launched == [(2, 1)]
    wide = _range_case(torch.randn(1, 2, 70), torch.tensor([0, 3]), torch.tensor([70, 50]))
    _check(*wide, 10)
    assert launched == [(2, 1)]
    with pytest.raises(ValueError, match="resident must be None or False for rows wider than 64 codes"):
        _check(*wide, 10, resident=True)
    monkeypatch.setattr(triton_topk, "AUTO_RESIDENT_ROWS_PER_SM", 1.0)  # 2 rows: fewer than one per SM
    _check(*case, 10)
    assert launched == [(2, 1)]


@pytest.mark.parametrize("option, value, message", [
    ("resident", "yes", "resident must be None, True or False"),
    ("resident", 1, "resident must be None, True or False"),
    *[("chunks", value, "chunks must be None or an int >= 1") for value in (0, -2, 2.0, True)],
])
def test_bad_option_rejected(option, value, message):
    codes = torch.zeros(1, 1, 8, dtype=torch.int32, device=DEVICE)
    out = torch.empty(1, 1, 4, dtype=torch.int32, device=DEVICE)
    bounds = torch.tensor([0, 8], device=DEVICE)
    with pytest.raises(ValueError, match=message):
        triton_topk.topk_from_codes(codes, bounds[:1], bounds[1:], 0, 4, out, **{option: value})
