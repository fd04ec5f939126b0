"""Spellings of eager softmax attention that passes/attention/normalize.py brings to the matched form,
and the clamp and per-query sinks of attention/softmax.py: an in-place ``masked_fill_`` of the scores
read again after it (xlm), ``einsum`` products (prophetnet), a softmax / dropout of [B*H, Sq, Sk] views
of 4-D scores between two ``bmm`` (mvp, trocr, xglm), a clamp of the masked scores at the dtype minimum
(xglm) and a sink logit per query as an extra softmax column (inkling2). Each becomes one
``kda_compile.attention`` call equal to eager (fp32: relative error < 1e-5; fp64 where fully masked rows
are compared), and a variant differing in meaning is left alone with its reason.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kda_compile.ops.attention import attention, attention_with_lse

from .graph_capture import GraphCapture
from .test_attention_spellings import check_left_alone, compile_capture
from .test_softmax_attention import B, D, FP32_TOL, H, SK, SQ, inputs, rel_err, repeat_kv


def inplace_fill(q, k, v, mask):  # xlm: the fill mutates the scores, which are read again after it
    scores = torch.matmul(q / math.sqrt(D), k.transpose(2, 3))
    drop = (mask != 0).view(B, 1, SQ, -1).expand_as(scores)
    scores.masked_fill_(drop, torch.finfo(scores.dtype).min)
    weights = F.softmax(scores.float(), dim=-1).type_as(scores)
    return torch.matmul(F.dropout(weights, p=0.0, training=False), v)


def einsum_products(q, k, v, mask):  # prophetnet's main stream: k transposed by hand
    w = torch.einsum("bntc,bncs->bnts", q, k.transpose(2, 3)) * 0.3
    return torch.einsum("bntc,bncs->bnts", F.softmax(w + mask, dim=-1), v)


def einsum_implicit_transpose(q, k, v, mask):  # q . k^T written with the key letters swapped
    w = torch.einsum("bhqd,bhkd->bhqk", (q, k)) * 0.3
    return torch.einsum("bhqk,bhkd->bhqd", F.softmax(w + mask, dim=-1), v)


def batched_views(q, k, v, mask):  # mvp / trocr: the softmax reads the [B*H, Sq, Sk] view
    b, h, sq, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, -1, d) for t in (q * 0.3, k, v))
    w = torch.bmm(q3, k3.transpose(1, 2))
    w = (w.view(b, h, sq, -1) + mask).view(b * h, sq, -1)
    p = F.dropout(F.softmax(w, dim=-1), p=0.0, training=False)
    return torch.bmm(p, v3).view(b, h, sq, d)


def clamped_between_views(q, k, v, mask):  # xglm: bmm scores clamped at the dtype minimum between views
    b, h, sq, d = q.shape
    w = torch.bmm(q.reshape(b * h, sq, d), k.reshape(b * h, -1, d).transpose(1, 2))
    w = torch.max(w.view(b, h, sq, -1) + mask, torch.full((), torch.finfo(w.dtype).min, dtype=w.dtype))
    w = F.softmax(w.view(b * h, sq, -1), dim=-1)
    w = F.dropout(w.view(b, h, sq, -1).view(b * h, sq, -1), p=0.0, training=False)
    return torch.bmm(w, v.reshape(b * h, -1, d)).view(b, h, sq, d)


def clamp_min_4d(q, k, v, mask):  # the same clamp as clamp_min, on 4-D scores
    w = torch.matmul(q, k.transpose(-1, -2)) * 0.3 + mask
    return torch.matmul(F.softmax(w.clamp_min(torch.finfo(w.dtype).min), dim=-1), v)


SINK_W = torch.linspace(-0.5, 0.5, H * D).view(H, D)


def query_sinks(q, k, v, mask):  # inkling2: one sink logit per query, from the query side's states
    w = torch.matmul(q, k.transpose(2, 3)) * 0.3 + mask
    sinks = torch.einsum("bhqd,hd->bqh", q, SINK_W).transpose(1, 2).unsqueeze(-1)
    logits = torch.cat([w, sinks], dim=-1).float()
    p = F.softmax(logits, dim=-1)[..., :-1].to(q.dtype)
    return torch.matmul(F.dropout(p, p=0.0, training=False), v)


CASES = {f.__name__: f for f in (inplace_fill, einsum_products, einsum_implicit_transpose, batched_views,
                                  clamped_between_views, clamp_min_4d, query_sinks)}


def op_calls(cap: GraphCapture) -> int:
    """Calls of the attention op: ``attention``, or ``attention_with_lse`` (per-query sinks)."""
    return cap.after[-1].count(attention, attention_with_lse)


@pytest.mark.parametrize("case", sorted(CASES))
def test_spelling_is_rewritten_and_exact(case):
    fn = CASES[case]
    q, k, v, mask = inputs()
    k, v = repeat_kv(k, 2), repeat_kv(v, 2)
    compiled, cap = compile_capture(fn)
    out = compiled(q, k, v, mask)
    report = cap.reports[-1]
    assert op_calls(cap) == 1 and cap.softmaxes() == 0, cap.after[-1].code
    assert len(report.rewritten) == 1 and not report.left_alone, report.left_alone
    # no score product is left to compute beside the op (xlm's expand_as read the scores' shape)
    assert "matmul" not in cap.after[-1].code.replace("attention", "") and "bmm" not in cap.after[-1].code
    assert rel_err(out, fn(q, k, v, mask)) < FP32_TOL


@pytest.mark.parametrize("fn", [inplace_fill, batched_views, clamped_between_views], ids=lambda f: f.__name__)
def test_spelling_under_dynamic_shapes(fn):
    """Sizes come from the graph (xlm's expand_as becomes an expand to the query / key sizes)."""
    def run(q, k, v, mask):  # the module-level B / SQ of inplace_fill, as sizes of the inputs
        b, _, sq, _ = q.shape
        if fn is inplace_fill:
            scores = torch.matmul(q / math.sqrt(D), k.transpose(2, 3))
            scores.masked_fill_((mask != 0).view(b, 1, sq, -1).expand_as(scores), torch.finfo(scores.dtype).min)
            return torch.matmul(F.softmax(scores.float(), dim=-1).type_as(scores), v)
        return fn(q, k, v, mask)

    compiled, cap = compile_capture(run, dynamic=True)
    for sq, sk in ((5, 7), (3, 9)):
        g = torch.Generator().manual_seed(sq)
        q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (sq, sk, sk))
        mask = torch.where(torch.rand(B, 1, sq, sk, generator=g) < 0.3, torch.finfo(torch.float32).min, 0.0)
        mask[..., 0] = 0.0
        out = compiled(q, k, v, mask)
        assert cap.attention_calls() == 1 and not cap.reports[-1].left_alone, cap.reports[-1].left_alone
        assert rel_err(out, run(q, k, v, mask)) < FP32_TOL
    assert len(cap.reports) == 1


@pytest.mark.parametrize("fill", [-math.inf, "min"], ids=["-inf", "min"])
@pytest.mark.parametrize("fn", [clamped_between_views, clamp_min_4d], ids=lambda f: f.__name__)
def test_clamp_keeps_fully_masked_rows(fn, fill):
    """A row with every key masked: eager's clamp gives its keys equal weight (without the clamp a
    -inf mask would give NaN); the op gets the mask clamped alike, so the row matches, in fp64 too."""
    for dtype in (torch.float32, torch.float64):
        q, k, v = (repeat_kv(t, 2).to(dtype) if t.shape[1] != H else t.to(dtype) for t in inputs()[:3])
        value = torch.finfo(dtype).min if fill == "min" else fill
        mask = torch.zeros(B, 1, SQ, SK, dtype=dtype)
        mask[0, 0, 1, :] = value  # fully masked row
        mask[1, 0, 2, 3:] = value  # partly masked row
        torch._dynamo.reset()
        compiled, cap = compile_capture(fn)
        out, ref = compiled(q, k, v, mask), fn(q, k, v, mask)
        assert cap.attention_calls() == 1 and torch.isfinite(ref).all()
        assert torch.allclose(out[0, :, 1], v[0].mean(dim=-2), atol=1e-6)  # uniform weights
        assert rel_err(out, ref) < (FP32_TOL if dtype == torch.float32 else 1e-12)


def clamp_above_min(q, k, v, mask):  # clamps finite scores: not neutral
    w = torch.matmul(q, k.transpose(-1, -2)) * 0.3 + mask
    return torch.matmul(F.softmax(torch.max(w, torch.full((), -1.0)), dim=-1), v)


def inplace_fill_with_alias(q, k, v, mask):  # a view taken before the fill sees it: not functionalised
    scores = torch.matmul(q, k.transpose(2, 3))
    first = scores[..., :1]
    scores.masked_fill_(mask != 0, -math.inf)
    return torch.matmul(F.softmax(scores, dim=-1), v), first * 2


def einsum_transposed_output(q, k, v, mask):  # q . k^T with the result transposed: [B, H, Sk, Sq]
    w = torch.einsum("bhqd,bhkd->bhkq", q, k) * 0.3
    return torch.matmul(F.softmax(w.transpose(-1, -2) + mask, dim=-1), v)


def softmax_over_queries(q, k, v, mask):  # bmm attention with the softmax over the query axis
    b, h, sq, d = q.shape
    w = torch.bmm(q.reshape(b * h, sq, d), k.reshape(b * h, -1, d).transpose(1, 2))
    w = (w.view(b, h, sq, -1) + mask).view(b * h, sq, -1)
    p = F.softmax(w, dim=1)
    return torch.bmm(p.transpose(1, 2), q.reshape(b * h, sq, d)).view(b, h, -1, d)


def sink_column_first(q, k, v, mask):  # the dropped column is a score, the sink's weight is kept
    w = torch.matmul(q, k.transpose(2, 3)) * 0.3 + mask
    sinks = torch.einsum("bhqd,hd->bqh", q, SINK_W).transpose(1, 2).unsqueeze(-1)
    p = F.softmax(torch.cat([sinks, w], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(p, v)


def weights_returned(q, k, v, mask):  # the weights are an output of the graph
    p = F.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.3 + mask, dim=-1)
    return torch.matmul(p, v), p


NEGATIVE = {
    clamp_above_min: "above the dtype minimum",
    inplace_fill_with_alias: "also used by",
    einsum_transposed_output: "found transpose",
    softmax_over_queries: "found w_1 (view)",
    sink_column_first: "found sinks (unsqueeze) after query_sinks",
    weights_returned: "are an output of the graph",
}


@pytest.mark.parametrize("fn", list(NEGATIVE), ids=lambda f: f.__name__)
def test_spelling_differing_in_meaning_is_left_alone(fn):
    check_left_alone(fn, NEGATIVE[fn])


def test_inplace_fill_outside_attention_is_kept_exact():
    """functionalize_inplace applies wherever it is exact: readers after the fill see the filled
    tensor, readers before it the unfilled one."""
    def fn(x, y):
        z = x @ y
        before = z.sum()
        z.masked_fill_(z > 0, 0.0)
        return z * 2, before

    cap = GraphCapture()
    x, y = torch.randn(3, 4), torch.randn(4, 5)
    out = torch.compile(fn, backend=cap, fullgraph=True)(x, y)
    ref = fn(x, y)
    assert "masked_fill_" not in cap.after[-1].code and "masked_fill" in cap.after[-1].code
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


# Families whose attention these spellings are, run as the coverage sweep runs them (optimize(); xlm's
# length check reads .item()): every softmax attention site rewritten, logits as eager.
# prophetnet: its main stream (einsum) and its 5-D predict stream ([B, ngram, H, S, D], folded into the
# batch dim: test_attention_fold.py), counted per module: 2 sites of 2 attentions each.
# inkling2_text: 2 self-attention sites with per-query sinks, 4 sites without sinks.
FAMILIES = {"xlm": (2, 0), "mvp": (2, 0), "trocr": (2, 0), "xglm": (2, 0), "prophetnet": (2, 0),
            "inkling2_text": (6, 0)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_attention_is_rewritten(family):
    from kda_compile.coverage.sweep import run_family

    row = run_family(family)
    want_rewritten, want_left = FAMILIES[family]
    assert row.status == "ok", row.reason
    assert row.rewritten == {"kda_compile.attention": want_rewritten}, row.rewritten
    assert sum(row.left_alone.values()) == want_left, row.left_alone
    assert row.logits_error < 1e-5
