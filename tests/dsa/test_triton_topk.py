"""The DSA indexer's radix top-k (``ops/dsa/triton_topk.py``) against ``torch.topk`` over the reference's
int64 sort keys (``reference.topk_from_keys``): equal index lists, bit for bit (the same set, the same tie
rule, ascending key order).

Runs on CUDA, or on CPU under the Triton interpreter (small tiles there). Scores are drawn with many ties
(quantised), signed zeros, infinities and the extremes of float32, over visible ranges that are empty,
partial or wider than one tile, with top-k below, at and above the visible count.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_compile.ops.dsa.reference import order_keys, topk_from_keys

from triton_device import triton_device  # noqa: E402

DEVICE = triton_device("the DSA top-k kernel")

from kda_compile.ops.dsa import triton_topk  # noqa: E402

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


def _check(scores, visible, lo, hi, topk):
    want = topk_from_keys(order_keys(scores, visible), topk)
    codes = reference_codes(scores, visible).to(DEVICE)
    out = torch.full((*scores.shape[:2], topk), 7, dtype=torch.int32, device=DEVICE)
    triton_topk.topk_from_codes(codes, lo.to(DEVICE), hi.to(DEVICE), 0, topk, out)
    assert torch.equal(out.cpu(), want)


@settings(max_examples=16, deadline=None)
@given(topk_cases())
def test_radix_topk_equals_torch_topk(case):
    _check(*case)


def test_row_offset_and_strided_output():
    """``row0`` picks the rows' ranges from [S]-long lo / hi; ``out`` may be a strided view (the launcher
    writes blocks of query rows into the full output)."""
    g = torch.Generator().manual_seed(5)
    scores = (torch.randn(1, 3, 90, generator=g) * 3).round()
    lo_all = torch.tensor([0, 0, 10, 0, 30])
    hi_all = torch.tensor([5, 90, 90, 40, 90])
    col = torch.arange(90)
    visible = ((col >= lo_all[2:, None]) & (col < hi_all[2:, None]))[None]
    want = topk_from_keys(order_keys(scores, visible), 24)
    out = torch.full((1, 5, 24), 7, dtype=torch.int32, device=DEVICE)
    triton_topk.topk_from_codes(reference_codes(scores, visible).to(DEVICE), lo_all.to(DEVICE), hi_all.to(DEVICE),
                                2, 24, out[:, 2:])
    assert torch.equal(out[:, 2:].cpu(), want)
    assert bool((out[:, :2] == 7).all())
