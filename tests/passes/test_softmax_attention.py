"""The softmax-attention rewrite on small hand-written attention functions (cheap: aot_eager).

Each positive case spells eager attention a different way (as the Dynamo IR is not normalised)
and must become one ``kda_compile.ops.attention`` call with no softmax left, computing the same
values (fp32: relative error < 1e-5). Each negative case differs in meaning and must be left
alone with its reason in the report.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kda_compile.config import Config
from kda_compile.passes import PassManager

from .graph_capture import GraphCapture

B, H, HKV, SQ, SK, D = 2, 4, 2, 5, 7, 8
FP32_TOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "NaN or inf in the compiled result"
    return float((a - b).norm() / b.norm())


def repeat_kv(x, n):
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def inputs(dv=D, sq=SQ, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, sq, D, generator=g, dtype=dtype)
    k = torch.randn(B, HKV, SK, D, generator=g, dtype=dtype)
    v = torch.randn(B, HKV, SK, dv, generator=g, dtype=dtype)
    mask = torch.where(torch.rand(B, 1, sq, SK, generator=g) < 0.3, torch.finfo(dtype).min, 0.0).to(dtype)
    mask[..., 0] = 0.0  # every row keeps a key
    return q, k, v, mask


# ---------------------------------------------------------------------------------------------
# Spellings of the same attention
# ---------------------------------------------------------------------------------------------
def llama_style(q, k, v, mask):
    k, v = repeat_kv(k, 2), repeat_kv(v, 2)
    w = torch.matmul(q, k.transpose(2, 3)) * 0.3
    w = w + mask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    w = F.dropout(w, p=0.0, training=False)
    return torch.matmul(w, v)


def operator_style(q, k, v, mask):
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    w = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    w = mask + w  # mask first: the matcher must follow the other operand
    return w.softmax(-1) @ v


def method_style(q, k, v, mask):
    k, v = repeat_kv(k, 2), repeat_kv(v, 2)
    w = 0.5 * q.matmul(torch.transpose(k, -2, 3))
    w = torch.add(w, mask)
    return torch.softmax(w, -1).type_as(q).matmul(v)


def softcap_style(q, k, v, mask):
    k, v = repeat_kv(k, 2), repeat_kv(v, 2)
    w = torch.matmul(q, k.transpose(2, 3)) * 0.3
    w = torch.tanh(w / 2.0) * 2.0
    w = w + mask
    return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


def sinks_style(q, k, v, mask, sinks):
    k, v = repeat_kv(k, 2), repeat_kv(v, 2)
    w = torch.matmul(q, k.transpose(2, 3)) * 0.3 + mask
    column = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    logits = torch.cat([w, column], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(F.dropout(probs, p=0.0, training=False).to(v.dtype), v)


def no_mask_mla(q, k, v, mask):
    w = torch.matmul(q, k.transpose(2, 3)) * 0.2
    return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


CASES = {
    "llama": (llama_style, D),
    "operators": (operator_style, D),
    "methods": (method_style, D),
    "softcap": (softcap_style, D),
    "mla_dv_differs": (no_mask_mla, 6),
}


def compile_capture(fn, config=None, **compile_kwargs):
    cap = GraphCapture(config) if config is not None else GraphCapture()
    return torch.compile(fn, backend=cap, fullgraph=True, **compile_kwargs), cap


@pytest.mark.parametrize("case", sorted(CASES))
def test_spelling_is_rewritten_and_exact(case):
    fn, dv = CASES[case]
    q, k, v, mask = inputs(dv=dv)
    if fn is no_mask_mla:  # MHA with Dv != Dqk
        k, v = repeat_kv(k, 2), repeat_kv(v, 2)
    compiled, cap = compile_capture(fn)
    out = compiled(q, k, v, mask)
    assert cap.attention_calls() == 1 and cap.softmaxes() == 0, cap.after[-1].code
    assert cap.repeat_kv_expands() == 0 and "repeat_interleave" not in cap.after[-1].code
    assert len(cap.reports[-1].rewritten) == 1 and not cap.reports[-1].left_alone
    assert rel_err(out, fn(q, k, v, mask)) < FP32_TOL


def test_sinks_are_passed_as_per_head_logits():
    q, k, v, mask = inputs()
    sinks = torch.randn(H)
    compiled, cap = compile_capture(sinks_style)
    out = compiled(q, k, v, mask, sinks)
    assert cap.attention_calls() == 1 and cap.softmaxes() == 0
    assert cap.after[-1].attention_kwargs[0]["sinks"] is not None
    assert rel_err(out, sinks_style(q, k, v, mask, sinks)) < FP32_TOL


def test_gradients_match_in_fp64():
    """The gpt-oss spelling computes its softmax in the input dtype, so in fp64 eager is exact."""
    q, k, v, mask = (t.double() for t in inputs())
    sinks = torch.randn(H, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    compiled, cap = compile_capture(sinks_style)
    compiled(*leaves[:3], mask, leaves[3]).square().sum().backward()
    ref_leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    sinks_style(*ref_leaves[:3], mask, ref_leaves[3]).square().sum().backward()
    assert cap.attention_calls() == 1
    for got, ref in zip(leaves, ref_leaves):
        assert rel_err(got.grad, ref.grad) < 1e-10


def test_dropout_in_training_keeps_the_expectation():
    """dropout(p) on the probabilities, kept entries scaled by 1/(1-p): the mean over many draws
    approaches the dropout-free output (the op's RNG differs from eager's, so no exact match)."""
    def train_attention(q, k, v):
        w = F.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.3, dim=-1, dtype=torch.float32)
        return torch.matmul(F.dropout(w, p=0.25, training=True), v)

    q, k, v, _ = inputs()
    k, v = repeat_kv(k, 2), repeat_kv(v, 2)
    compiled, cap = compile_capture(train_attention)
    draws = torch.stack([compiled(q, k, v) for _ in range(400)])
    assert cap.after[-1].attention_kwargs[0]["dropout_p"] == 0.25
    no_dropout = torch.matmul(F.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.3, dim=-1), v)
    assert not torch.equal(draws[0], draws[1])
    assert rel_err(draws.mean(0), no_dropout) < 0.05


def test_dropout_off_in_eval_passes_zero():
    def eval_attention(q, k, v):
        w = F.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.3, dim=-1)
        return torch.matmul(F.dropout(w, p=0.5, training=False), v)

    q, k, v, _ = inputs()
    k, v = repeat_kv(k, 2), repeat_kv(v, 2)
    compiled, cap = compile_capture(eval_attention)
    assert rel_err(compiled(q, k, v), eval_attention(q, k, v)) < FP32_TOL
    assert cap.after[-1].attention_kwargs[0]["dropout_p"] == 0.0


def test_bf16_output_dtype_and_tolerance():
    q, k, v, mask = inputs(dtype=torch.bfloat16)
    compiled, cap = compile_capture(llama_style)
    out = compiled(q, k, v, mask)
    reference = llama_style(*(t.double() for t in (q, k, v, mask)))
    assert out.dtype == torch.bfloat16 and cap.attention_calls() == 1
    assert rel_err(out, reference) < 2e-2


# ---------------------------------------------------------------------------------------------
# Candidates that differ in meaning: left alone, and reported
# ---------------------------------------------------------------------------------------------
def weights_returned(q, k, v, mask):
    w = F.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.3 + mask, dim=-1)
    return torch.matmul(w, v), w


def scores_returned(q, k, v, mask):
    s = torch.matmul(q, k.transpose(2, 3)) * 0.3
    return torch.matmul(F.softmax(s + mask, dim=-1), v), s


def softmax_over_queries(q, k, v, mask):
    return torch.matmul(F.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.3 + mask, dim=-2), v)


def probabilities_rescaled(q, k, v, mask):
    w = F.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.3 + mask, dim=-1)
    return torch.matmul(w * 2.0, v)


def mask_before_softcap(q, k, v, mask):
    w = torch.matmul(q, k.transpose(2, 3)) * 0.3 + mask
    return torch.matmul(F.softmax(torch.tanh(w / 2.0) * 2.0, dim=-1), v)


def keys_mutated_between(q, k, v, mask):
    w = F.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.3 + mask, dim=-1)
    k.mul_(2.0)
    return torch.matmul(w, v)


def mask_grows_the_scores(q, k, v, mask):
    # batch-1 attention broadcast over B masks: the op would need B queries
    w = torch.matmul(q[:1], k[:1].transpose(2, 3)) * 0.3 + mask
    return torch.matmul(F.softmax(w, dim=-1), v[:1])


def integer_mask(q, k, v, mask):
    w = torch.matmul(q, k.transpose(2, 3)) * 0.3 + (mask < 0).long() * -1000  # int64 mask: type promotion
    return torch.matmul(F.softmax(w, dim=-1), v)


NEGATIVE = {
    weights_returned: "attention weights",
    scores_returned: "scores",
    softmax_over_queries: "dim -2",
    probabilities_rescaled: "do not follow eager attention",
    mask_before_softcap: "do not follow eager attention",
    keys_mutated_between: "mutates",
    mask_grows_the_scores: "broadcasts the scores",
    integer_mask: "refuses the arguments: attn_mask must be a bool or floating-point tensor",
}


@pytest.mark.parametrize("fn", list(NEGATIVE), ids=lambda f: f.__name__)
def test_candidates_differing_in_meaning_are_left_alone(fn):
    q, k, v, mask = inputs()
    k, v = repeat_kv(k, 2), repeat_kv(v, 2)
    compiled, cap = compile_capture(fn)
    out = compiled(q, k.clone(), v, mask)
    ref = fn(q, k.clone(), v, mask)
    assert cap.attention_calls() == 0 and cap.softmaxes() == cap.softmaxes(which="before") == 1
    report = cap.reports[-1]
    assert not report.rewritten and len(report.left_alone) == 1
    assert NEGATIVE[fn] in report.left_alone[0].reason, report.left_alone[0].reason
    for a, b in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
        assert rel_err(a, b) < FP32_TOL


def test_a_softmax_without_matmuls_is_not_a_candidate():
    def router(x, w):
        return F.softmax(torch.topk(x @ w, 2, dim=-1).values, dim=1)

    compiled, cap = compile_capture(router)
    compiled(torch.randn(6, 8), torch.randn(8, 4))
    assert cap.softmaxes() == 1 and not cap.reports[-1].rewritten and not cap.reports[-1].left_alone


# ---------------------------------------------------------------------------------------------
# Pass manager behaviour
# ---------------------------------------------------------------------------------------------
def test_rewrite_is_idempotent():
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(llama_style, backend=keep, fullgraph=True)(*inputs())
    gm = graphs[0]
    first = PassManager(Config()).run(gm)
    code = gm.code
    second = PassManager(Config()).run(gm)
    assert len(first.rewritten) == 1
    assert not second.rewritten and not second.left_alone and gm.code == code


def test_config_switches_the_rewrite_off():
    compiled, cap = compile_capture(llama_style, config=Config(softmax_attention=False, compiler="aot_eager"))
    compiled(*inputs())
    assert cap.attention_calls() == 0 and cap.softmaxes() == 1 and not cap.reports[-1].rewritten


class SoftcapAttention(torch.nn.Module):
    """Gemma 2's attention with its float attributes, as Hugging Face writes it."""

    def __init__(self):
        super().__init__()
        self.scaling, self.softcap = 0.25, 50.0

    def forward(self, q, k, v, mask):
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        w = torch.tanh(w / self.softcap) * self.softcap + mask
        return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


def test_symbolic_float_attributes_are_specialised():
    """Under dynamic=True Dynamo passes float attributes as SymFloats (its default): the rewrite
    bakes their values into the op call with a guard, so changing one recompiles."""
    module = SoftcapAttention()
    q, k, v, mask = inputs()
    k, v = repeat_kv(k, 2), repeat_kv(v, 2)
    with torch._dynamo.config.patch(specialize_float=False):
        compiled, cap = compile_capture(module, dynamic=True)
        assert rel_err(compiled(q, k, v, mask), module(q, k, v, mask)) < FP32_TOL
        assert "item()" in cap.before[0].code  # the attributes were symbolic (Dynamo may then restart)
        module.scaling, module.softcap = 0.5, 3.0
        assert rel_err(compiled(q, k, v, mask), module(q, k, v, mask)) < FP32_TOL
    first, last = cap.reports[0].rewritten[0].details, cap.reports[-1].rewritten[0].details
    assert (first["scale"], first["softcap"]) == (0.25, 50.0) and (last["scale"], last["softcap"]) == (0.5, 3.0)


def test_dynamic_shapes_do_not_recompile():
    compiled, cap = compile_capture(llama_style, dynamic=True)
    compiled(*inputs(sq=5))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for sq in (3, 9):
            q, k, v, mask = inputs(sq=sq)
            assert rel_err(compiled(q, k, v, mask), llama_style(q, k, v, mask)) < FP32_TOL
    assert cap.attention_calls() == 1
