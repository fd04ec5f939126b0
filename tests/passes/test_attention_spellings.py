"""Neutral spellings of eager softmax attention: a ``.type(dtype)`` cast of
the probabilities (gpt2), an fp32 cast of the scores, an in-place ``/=`` / ``*=`` scale (falcon), key
and value with one head broadcast by the matmuls (falcon multi-query), and
``torch.where(keep, scores, finfo.min)`` (gpt_neo)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kda_compile.config import Config

from .graph_capture import GraphCapture
from .test_softmax_attention import B, D, FP32_TOL, H, SK, SQ, inputs, rel_err, repeat_kv


def _keep():
    # bottom-right causal (SK >= SQ), as a bool [1, 1, SQ, SK] buffer slice would give it
    return torch.ones(SK, SK, dtype=torch.bool).tril()[SK - SQ:].view(1, 1, SQ, SK)


def type_cast(q, k, v, mask):  # gpt2
    w = F.softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.3 + mask, dim=-1)
    w = w.type(v.dtype)
    return torch.matmul(w, v)


def inplace_div(q, k, v, mask):  # falcon
    w = q @ k.transpose(-1, -2)
    w /= math.sqrt(D)
    return F.softmax(w + mask, dim=-1, dtype=q.dtype) @ v


def inplace_mul(q, k, v, mask):
    w = torch.matmul(q, k.transpose(2, 3))
    w *= 0.3
    return torch.matmul(F.softmax(w + mask, dim=-1), v)


def multi_query(q, k, v, mask):  # falcon: one key / value head, broadcast by both matmuls
    w = q @ k[:, :1].transpose(-1, -2) / math.sqrt(D)
    return F.softmax(w + mask, dim=-1) @ v[:, :1]


def where_then_mask(q, k, v, mask):  # gpt_neo
    w = torch.matmul(q.to(torch.float32), k.to(torch.float32).transpose(-1, -2))
    w = torch.where(_keep(), w, torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype))
    w = F.softmax(w + mask, dim=-1).to(v.dtype)
    return torch.matmul(w, v)


def where_only(q, k, v, mask):
    w = torch.matmul(q, k.transpose(-1, -2)) * 0.3
    return torch.matmul(F.softmax(torch.where(_keep(), w, -math.inf), dim=-1), v)


def float_scores(q, k, v, mask):  # scores cast to fp32 before the softmax, probabilities cast back
    w = torch.matmul(q, k.transpose(-1, -2)) * 0.3 + mask
    return torch.matmul(F.softmax(w.float(), dim=-1).type_as(v), v)


CASES = {f.__name__: f for f in (type_cast, inplace_div, inplace_mul, multi_query, where_then_mask, where_only,
                                  float_scores)}


def compile_capture(fn):
    cap = GraphCapture()
    return torch.compile(fn, backend=cap, fullgraph=True), cap


@pytest.mark.parametrize("case", sorted(CASES))
def test_neutral_spelling_is_rewritten_and_exact(case):
    fn = CASES[case]
    q, k, v, mask = inputs()
    k, v = repeat_kv(k, 2), repeat_kv(v, 2)
    compiled, cap = compile_capture(fn)
    out = compiled(q, k, v, mask)
    report = cap.reports[-1]
    assert cap.attention_calls() == 1 and cap.softmaxes() == 0, cap.after[-1].code
    assert len(report.rewritten) == 1 and not report.left_alone, report.left_alone
    assert rel_err(out, fn(q, k, v, mask)) < FP32_TOL


def test_bf16_scores_cast_to_fp32():
    q, k, v, mask = inputs(dtype=torch.bfloat16)
    k, v = repeat_kv(k, 2), repeat_kv(v, 2)
    compiled, cap = compile_capture(float_scores)
    out = compiled(q, k, v, mask)
    reference = float_scores(*(t.double() for t in (q, k, v, mask)))
    assert out.dtype == torch.bfloat16 and cap.attention_calls() == 1
    assert rel_err(out, reference) < 2e-2


def where_fills_a_number(q, k, v, mask):
    w = torch.matmul(q, k.transpose(-1, -2)) * 0.3
    return torch.matmul(F.softmax(torch.where(_keep(), w, -1.0), dim=-1), v)


def inplace_scores_kept(q, k, v, mask):
    w = torch.matmul(q, k.transpose(-1, -2))
    raw = w
    w /= 2.0
    return torch.matmul(F.softmax(w + mask, dim=-1), v), raw


NEGATIVE = {
    where_fills_a_number: "not -inf or the dtype minimum",
    inplace_scores_kept: "also used by",
}


@pytest.mark.parametrize("fn", list(NEGATIVE), ids=lambda f: f.__name__)
def test_spelling_differing_in_meaning_is_left_alone(fn):
    q, k, v, mask = inputs()
    k, v = repeat_kv(k, 2), repeat_kv(v, 2)
    compiled, cap = compile_capture(fn)
    out = compiled(q, k, v, mask)
    ref = fn(q, k, v, mask)
    report = cap.reports[-1]
    assert cap.attention_calls() == 0 and not report.rewritten and len(report.left_alone) == 1
    assert NEGATIVE[fn] in report.left_alone[0].reason, report.left_alone[0].reason
    for a, b in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
        assert rel_err(a, b) < FP32_TOL


# gpt_neo: window_size 4 < 12 tokens, so its local layer's torch.where mask is a real sliding window.
FAMILIES = {"gpt2": {}, "falcon": {}, "gpt_neo": {"window_size": 4}}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_is_fully_rewritten(family):
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from kda_compile.backend import KdaCompileBackend
    from kda_compile.coverage.models import tiny_config

    cfg = tiny_config(family)
    for key, value in FAMILIES[family].items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    ids = torch.randint(3, 100, (B, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    torch._dynamo.reset()
    counters.clear()
    backend = KdaCompileBackend(Config(compiler="eager"))
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(input_ids=ids).logits
    torch._dynamo.reset()
    assert not counters.get("graph_break"), dict(counters["graph_break"])
    rewritten = [e for r in backend.reports for e in r.rewritten if e.rewrite == "softmax_attention"]
    left = [e for r in backend.reports for e in r.left_alone if e.rewrite == "softmax_attention"]
    assert len(rewritten) == cfg.num_hidden_layers == 2 and not left, left
    assert rel_err(got, expected) < 1e-4
