"""Neutral spellings of eager softmax attention: a ``.type(dtype)`` cast of
the probabilities (gpt2), an fp32 cast of the scores, an in-place ``/=`` / ``*=`` scale (falcon), key
and value with one head broadcast by the matmuls (falcon multi-query), and
``torch.where(keep, scores, finfo.min)`` (gpt_neo), a scale after the mask (codegen), ``baddbmm`` / ``bmm``
over [B*H, ...] with an additive ALiBi bias (bloom), ``masked_fill`` on both sides of the softmax (cpmant) and
sinks applied as ``out * sigmoid(logsumexp(scores) - sinks)`` (granite_swa). A router's softmax over a
linear projection is no candidate. test_attention_normalize.py has the spellings passes/attention/normalize.py
brings to this form (xlm, prophetnet, mvp, trocr, xglm) and the per-query sinks of inkling2."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kda_compile.config import Config
from kda_compile.ops.attention import attention, attention_with_lse

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


def scale_after_mask(q, k, v, mask):  # codegen
    w = torch.matmul(q.to(torch.float32), k.to(torch.float32).transpose(-1, -2))
    w = (w + mask) / math.sqrt(D)
    return torch.matmul(torch.nn.Softmax(dim=-1)(w).to(v.dtype), v)


def _alibi(heads, sk):  # bloom's per-head linear bias over key positions, [B*H, 1, Sk]
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)
    return (slopes[:, None] * torch.arange(sk)[None]).repeat(B, 1)[:, None, :]


def batched_alibi(q, k, v, mask):  # bloom: heads folded into the batch, ALiBi inside baddbmm
    b, h, sq, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, -1, d) for t in (q, k, v))
    w = _alibi(h, k.shape[2]).baddbmm(batch1=q3, batch2=k3.transpose(-1, -2), beta=1.0, alpha=0.3)
    p = F.softmax(w.view(b, h, sq, -1) + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.bmm(p.view(b * h, sq, -1), v3)
    return out.view(b, h, sq, d)


def batched_plain(q, k, v, mask):  # bmm on both sides, no bias
    b, h, sq, d = q.shape
    w = torch.bmm(q.reshape(b * h, sq, d), k.reshape(b * h, -1, d).transpose(1, 2)).view(b, h, sq, -1) * 0.3
    return torch.bmm(F.softmax(w, dim=-1).view(b * h, sq, -1), v.reshape(b * h, -1, d)).view(b, h, sq, d)


def _dropped(mask):  # recomputed at each use, as cpmant writes it
    return mask.view(B, 1, SQ, SK) == torch.tensor(False)


def fill_both_sides(q, k, v, mask):  # cpmant: masked_fill -inf before the softmax, 0 after
    keep = mask == 0
    w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D) + _alibi(H, SK).view(B, H, 1, SK)
    w = torch.masked_fill(w, _dropped(keep), torch.scalar_tensor(float("-inf"), dtype=w.dtype))
    p = torch.masked_fill(F.softmax(w, dim=-1), _dropped(keep), torch.scalar_tensor(0, dtype=w.dtype))
    return torch.matmul(p, v)


SINKS = torch.linspace(-1.0, 2.0, H)


def lse_sinks(q, k, v, mask):  # granite_swa: the sinks rescale the output by sigmoid(lse - sink)
    w = torch.matmul(q, k.transpose(2, 3)) * 0.3 + mask
    scale = (torch.logsumexp(w, dim=-1) - SINKS.view(1, -1, 1)).to(torch.float32).sigmoid()
    out = torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)
    return out * scale.unsqueeze(-1).to(out.dtype)


CASES = {f.__name__: f for f in (type_cast, inplace_div, inplace_mul, multi_query, where_then_mask, where_only,
                                  float_scores, scale_after_mask, batched_alibi, batched_plain, fill_both_sides,
                                  lse_sinks)}


def compile_capture(fn, dynamic=False):
    cap = GraphCapture()
    return torch.compile(fn, backend=cap, fullgraph=True, dynamic=dynamic), cap


def check_left_alone(fn, reason: str) -> None:
    """``fn(q, k, v, mask)`` compiles with no attention op (nor ``attention_with_lse``), its one site reported left
    alone with ``reason`` in its text, and the compiled function still computes what ``fn`` does."""
    q, k, v, mask = inputs()
    k, v = repeat_kv(k, 2), repeat_kv(v, 2)
    compiled, cap = compile_capture(fn)
    out = compiled(q, k, v, mask)
    ref = fn(q, k, v, mask)
    report = cap.reports[-1]
    calls = cap.after[-1].count(attention, attention_with_lse)
    assert calls == 0 and not report.rewritten and len(report.left_alone) == 1, report
    assert reason in report.left_alone[0].reason, report.left_alone[0].reason
    for a, b in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
        assert rel_err(a, b) < FP32_TOL


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


@pytest.mark.parametrize("fn", [batched_alibi, batched_plain], ids=lambda f: f.__name__)
def test_batched_spelling_under_dynamic_shapes(fn):
    """The unfolded reshapes take their sizes from the graph, so one graph serves two lengths."""
    cap = GraphCapture()
    compiled = torch.compile(fn, backend=cap, fullgraph=True, dynamic=True)
    for sq, sk in ((5, 7), (3, 9)):
        g = torch.Generator().manual_seed(sq)
        q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (sq, sk, sk))
        mask = torch.where(torch.rand(B, 1, sq, sk, generator=g) < 0.3, -math.inf, 0.0)
        mask[..., 0] = 0.0
        out = compiled(q, k, v, mask)
        assert cap.attention_calls() == 1 and not cap.reports[-1].left_alone, cap.reports[-1].left_alone
        assert rel_err(out, fn(q, k, v, mask)) < FP32_TOL
    assert len(cap.reports) == 1


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


def negative_scale_after_mask(q, k, v, mask):
    return torch.matmul(F.softmax((torch.matmul(q, k.transpose(-1, -2)) + mask) * -0.3, dim=-1), v)


def zeroed_elsewhere(q, k, v, mask):  # the weights are zeroed where the scores were not masked
    keep = mask == 0
    w = torch.masked_fill(torch.matmul(q, k.transpose(-1, -2)), ~keep, float("-inf"))
    return torch.matmul(torch.masked_fill(F.softmax(w, dim=-1), ~keep.roll(1, -1), 0.0), v)


def baddbmm_beta(q, k, v, mask):  # beta scales the bias: not the additive bias the op takes as it is
    b, h, sq, d = q.shape
    w = _alibi(h, k.shape[2]).baddbmm(q.reshape(b * h, sq, d), k.reshape(b * h, -1, d).transpose(-1, -2),
                                      beta=0.5, alpha=0.3)
    return torch.bmm(F.softmax(w, dim=-1), v.reshape(b * h, -1, d)).view(b, h, sq, d)


def lse_sinks_flipped(q, k, v, mask):  # sigmoid(sink - lse): not a softmax-denominator logit
    w = torch.matmul(q, k.transpose(2, 3)) * 0.3 + mask
    scale = (SINKS.view(1, -1, 1) - torch.logsumexp(w, dim=-1)).sigmoid()
    return torch.matmul(F.softmax(w, dim=-1), v) * scale.unsqueeze(-1)


def einsum_outer(q, k, v, mask):  # an einsum that is no matrix product: not matched, but reported
    w = torch.einsum("bhqd,bhkd->bhqkd", q, k).sum(-1) * 0.3
    return torch.einsum("bhqk,bhkd->bhqd", F.softmax(w + mask, dim=-1), v)


NEGATIVE = {
    einsum_outer: "found sum",
    where_fills_a_number: "not -inf or the dtype minimum",
    inplace_scores_kept: "also used by",
    negative_scale_after_mask: "is not positive",
    zeroed_elsewhere: "not masked by the same condition",
    baddbmm_beta: "beta=0.5",
    lse_sinks_flipped: "(logsumexp)",
}


@pytest.mark.parametrize("fn", list(NEGATIVE), ids=lambda f: f.__name__)
def test_spelling_differing_in_meaning_is_left_alone(fn):
    check_left_alone(fn, NEGATIVE[fn])


def test_a_router_softmax_is_no_candidate():
    # softmax over a linear projection (a MoE router): no product a few nodes up, so not reported
    w = torch.randn(8, 4 * D)

    def router(q, k, v, mask):
        probs = F.softmax(F.linear(q.transpose(1, 2).flatten(-2), w), dim=-1)
        top = probs.topk(2, dim=-1).values
        return torch.matmul(top.unsqueeze(-1), top.unsqueeze(-2))

    q, k, v, mask = inputs()
    compiled, cap = compile_capture(router)
    compiled(q, k, v, mask)
    assert not cap.reports[-1].left_alone and not cap.reports[-1].rewritten


# gpt_neo: window_size 4 < 12 tokens, so its local layer's torch.where mask is a real sliding window.
# codegen: the tiny config's default rotary_dim 64 exceeds its head dim 16 (eager forward fails).
FAMILIES = {"gpt2": {}, "falcon": {}, "gpt_neo": {"window_size": 4}, "bloom": {}, "codegen": {"rotary_dim": 8},
            "cpmant": {}, "granite_swa": {}, "openai-gpt": {}}


def _compile_family(family, updates):
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from kda_compile.backend import KdaCompileBackend
    from kda_compile.coverage.models import tiny_config

    cfg = tiny_config(family)
    for key, value in updates.items():
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
    return cfg, got, expected, rewritten, left


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_is_fully_rewritten(family):
    cfg, got, expected, rewritten, left = _compile_family(family, FAMILIES[family])
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    assert len(rewritten) == layers == 2 and not left, left
    assert {e.op for e in rewritten} == {"kda_compile.attention"}
    assert rel_err(got, expected) < 1e-4
