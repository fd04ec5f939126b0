"""N-D softmax attention with batch-like leading dims (prophetnet's ngram predict stream,
[B, ngram, H, S, D]): folded into the batch dim of ``kda_compile.attention`` (passes/attention/fold.py),
masks of every broadcast over the leading dims folded alike; keys broadcast over a leading dim and
a softmax over a leading dim are left alone with their reasons."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kda_compile
from kda_compile.report import clear_reports

from .graph_capture import GraphCapture
from .test_softmax_attention import FP32_TOL, rel_err

LEAD, H, SQ, SK, D = (2, 3), 4, 5, 7, 8


def _inputs(lead=LEAD, kv_heads=H, mask_shape=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, H, SQ, D, generator=g)
    k = torch.randn(*lead, kv_heads, SK, D, generator=g)
    v = torch.randn(*lead, kv_heads, SK, D, generator=g)
    shape = mask_shape if mask_shape is not None else (*lead, H, SQ, SK)
    mask = torch.where(torch.rand(*shape, generator=g) < 0.3, torch.finfo(torch.float32).min, 0.0)
    mask[..., 0] = 0.0  # every row keeps a key
    return q, k, v, mask


def predict_stream(q, k, v, mask):  # prophetnet: rel-pos bias + permuted mask, type_as, dropout
    w = torch.matmul(q, k.transpose(-1, -2)) * 0.3
    w = w + mask
    p = F.softmax(w, dim=-1, dtype=torch.float32).type_as(w)
    p = F.dropout(p, p=0.1, training=False)
    return torch.matmul(p, v)


def biased(q, k, v, mask):  # a second additive term over the full N-D scores, combined with the mask
    w = torch.matmul(q, k.transpose(-2, -1)) / 3.0
    bias = (torch.arange(SK, dtype=q.dtype) * 0.1).expand(*q.shape[:-1], SK)
    return torch.matmul(F.softmax(w + bias.contiguous() + mask, dim=-1), v)


def where_kept(q, k, v, mask):  # a bool mask over the last two dims only
    w = torch.matmul(q, k.transpose(-1, -2)) * 0.3
    keep = torch.ones(SQ, SK, dtype=torch.bool).tril(SK - SQ)
    w = torch.where(keep, w, torch.finfo(w.dtype).min)
    return torch.matmul(F.softmax(w + mask, dim=-1), v)


# name: (function, leading dims, kv heads, mask shape)
CASES = {
    "5d_full_mask": (predict_stream, LEAD, H, None),
    "5d_mask_broadcast_over_second_lead": (predict_stream, LEAD, H, (LEAD[0], 1, 1, SQ, SK)),
    "5d_mask_broadcast_over_first_lead": (predict_stream, LEAD, H, (LEAD[1], 1, SQ, SK)),
    "5d_mask_ones_over_leads": (predict_stream, LEAD, H, (1, 1, 1, SQ, SK)),
    "5d_mask_3d": (predict_stream, LEAD, H, (H, SQ, SK)),
    "5d_multi_query": (predict_stream, LEAD, 1, None),
    "5d_bias": (biased, LEAD, H, (LEAD[0], 1, H, SQ, SK)),
    "5d_where": (where_kept, LEAD, H, (LEAD[0], LEAD[1], 1, 1, SK)),
    "6d": (predict_stream, (2, 2, 3), H, (2, 1, 3, H, SQ, SK)),
}


def _compile(fn, **kwargs):
    cap = GraphCapture()
    return torch.compile(fn, backend=cap, fullgraph=True, **kwargs), cap


@pytest.mark.parametrize("case", sorted(CASES))
def test_nd_attention_is_folded_and_exact(case):
    fn, lead, kv_heads, mask_shape = CASES[case]
    q, k, v, mask = _inputs(lead, kv_heads, mask_shape)
    compiled, cap = _compile(fn)
    out = compiled(q, k, v, mask)
    assert cap.attention_calls() == 1 and cap.softmaxes() == 0, cap.after[-1].code
    (site,) = cap.reports[-1].rewritten
    assert not cap.reports[-1].left_alone
    assert site.details["folded"] == f"{q.dim()}-D, {len(lead)} leading dims into the batch dim", site.details
    assert "unflatten" in cap.after[-1].code
    assert out.shape == (*lead, H, SQ, D)
    assert rel_err(out, fn(q, k, v, mask)) < FP32_TOL


def test_nd_attention_under_dynamic_shapes():
    compiled, cap = _compile(predict_stream, dynamic=True)
    for seed, lead in enumerate(((2, 3), (3, 2))):
        q, k, v, mask = _inputs(lead, mask_shape=(lead[0], 1, H, SQ, SK), seed=seed)
        assert rel_err(compiled(q, k, v, mask), predict_stream(q, k, v, mask)) < FP32_TOL
    assert all(len(r.rewritten) == 1 and not r.left_alone for r in cap.reports)


def test_nd_attention_with_the_kda_compile_backend():
    clear_reports()
    torch._dynamo.reset()
    q, k, v, mask = _inputs()
    out = torch.compile(predict_stream, backend="kda_compile", fullgraph=True)(q, k, v, mask)
    graph = kda_compile.report().graphs[-1]
    assert [s.op for s in graph.rewritten] == ["kda_compile.attention"] and not graph.left_alone
    assert rel_err(out, predict_stream(q, k, v, mask)) < FP32_TOL


def keys_broadcast_over_a_lead(q, k, v, mask):  # one key set for every ngram: the fold would pair rows wrongly
    w = torch.matmul(q, k[:, :1].transpose(-1, -2)) * 0.3
    return torch.matmul(F.softmax(w + mask, dim=-1), v[:, :1])


def softmax_over_a_lead(q, k, v, mask):
    w = torch.matmul(q, k.transpose(-1, -2)) * 0.3
    return torch.matmul(F.softmax(w + mask, dim=1), v)


def bias_expanded_as_scores(q, k, v, mask):  # expand_as of N-D scores: not rewritten to read other sizes
    w = torch.matmul(q, k.transpose(-1, -2)) * 0.3
    bias = torch.arange(SK, dtype=q.dtype) * 0.1
    return torch.matmul(F.softmax(w + bias.expand_as(w) + mask, dim=-1), v)


def weights_returned(q, k, v, mask):
    p = F.softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.3 + mask, dim=-1)
    return torch.matmul(p, v), p


NEGATIVE = {
    keys_broadcast_over_a_lead: "the leading dims of the 5-D/5-D/5-D query [2, 3, 4, 5, 8], keys [2, 1, 4, 7, 8] "
                                "and values [2, 1, 4, 7, 8] differ",
    softmax_over_a_lead: "the softmax runs over dim 1, not over the keys (dim -1)",
    bias_expanded_as_scores: "are also used by expand_as",
    weights_returned: "are an output of the graph besides the value product",
}


@pytest.mark.parametrize("fn", list(NEGATIVE), ids=lambda f: f.__name__)
def test_nd_attention_that_does_not_fold_is_left_alone(fn):
    q, k, v, mask = _inputs()
    compiled, cap = _compile(fn)
    out = compiled(q, k, v, mask)
    report = cap.reports[-1]
    assert not report.rewritten and len(report.left_alone) == 1, report
    assert NEGATIVE[fn] in report.left_alone[0].reason, report.left_alone[0].reason
    torch.testing.assert_close(out, fn(q, k, v, mask), rtol=0, atol=0)
