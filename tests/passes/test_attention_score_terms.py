"""Scores built from several terms or masked by a 0/1 buffer, rewritten into ``kda_compile.attention``.

xlnet (transformers 5.23, models/xlnet/modeling_xlnet.py): content and position scores from einsum over
[S, B, H, D] tensors, summed with a literal 0 (no segment ids) or a segment term, scaled, a float mask
subtracted (``- 1e30 * einsum("ijbn->bnij", mask)``); the output einsum back to [S, B, H, D]. The content
einsum is q . k^T of permuted operands, the other terms become the op's float mask.

openai-gpt (models/openai/modeling_openai.py): keys pre-transposed by ``permute(0, 2, 3, 1)`` and the
scores masked by ``w * b + -1e4 * (1 - b)`` with ``b`` a slice of a tril buffer: the bool mask ``b != 0``
(exact for a 0/1 buffer whose rows keep their first key, checked when compiling; see
passes/attention/spellings.py). Left alone otherwise, with the reason.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kda_compile.passes.attention.normalize import MatmulPlan, matmul_plan

from .test_attention_spellings import compile_capture
from .test_softmax_attention import B, D, FP32_TOL, H, SQ, rel_err

S = 6  # xlnet: query and key lengths are equal


def _xlnet_inputs(seed=0, segments=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v, r = (torch.randn(S, B, H, D, generator=g) for _ in range(4))
    r = torch.randn(2 * S, B, H, D, generator=g)
    w_bias, r_bias = (torch.randn(H, D, generator=g) * 0.1 for _ in range(2))
    mask = (torch.rand(S, S, B, 1, generator=g) < 0.3).float()
    mask[:, 0] = 0.0  # every query keeps its first key
    seg = torch.randn(2, H, D, generator=g) if segments else None
    seg_mat = F.one_hot((torch.rand(S, S, B, generator=g) < 0.5).long(), 2).float() if segments else None
    return q, k, v, r, w_bias, r_bias, mask, seg, seg_mat


def _rel_shift_bnij(x, klen):  # xlnet's relative shift of the position scores
    b, n, i, j = x.shape
    x = x.reshape(b, n, j, i)[:, :, 1:, :].reshape(b, n, i, j - 1)
    return torch.index_select(x, 3, torch.arange(klen, device=x.device, dtype=torch.long))


def xlnet_core(q, k, v, r, w_bias, r_bias, mask, seg, seg_mat):  # XLNetRelativeAttention.rel_attn_core
    ac = torch.einsum("ibnd,jbnd->bnij", q + w_bias, k)
    bd = _rel_shift_bnij(torch.einsum("ibnd,jbnd->bnij", q + r_bias, r), klen=ac.shape[3])
    if seg is None:
        ef = 0
    else:
        ef = torch.einsum("ibnd,snd->ibns", q + w_bias, seg)
        ef = torch.einsum("ijbs,ibns->bnij", seg_mat, ef)
    score = (ac + bd + ef) * (1 / D ** 0.5)
    if mask is not None:
        score = score - 1e30 * torch.einsum("ijbn->bnij", mask)
    p = F.dropout(F.softmax(score, dim=3), 0.1, False)
    return torch.einsum("bnij,jbnd->ibnd", p, v)


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "subtracted-mask"])
@pytest.mark.parametrize("segments", [False, True], ids=["zero-segment", "segment-term"])
def test_xlnet_scores_are_rewritten_and_exact(masked, segments):
    q, k, v, r, w_bias, r_bias, mask, seg, seg_mat = _xlnet_inputs(segments=segments)
    mask = mask if masked else None
    compiled, cap = compile_capture(xlnet_core)
    out = compiled(q, k, v, r, w_bias, r_bias, mask, seg, seg_mat)
    report = cap.reports[-1]
    assert cap.attention_calls() == 1 and cap.softmaxes() == 0, cap.after[-1].code
    assert len(report.rewritten) == 1 and not report.left_alone, report.left_alone
    assert report.rewritten[0].details.get("subtracted_mask") == ("float" if masked else None)
    assert rel_err(out, xlnet_core(q, k, v, r, w_bias, r_bias, mask, seg, seg_mat)) < FP32_TOL


def test_xlnet_gradients_reach_the_position_term():
    """The position scores reach the op as its float mask: their gradient flows through it."""
    q, k, v, r, w_bias, r_bias, mask, seg, seg_mat = _xlnet_inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v, r, r_bias)]
    compiled, cap = compile_capture(xlnet_core)

    def grads(fn, ts):
        q_, k_, v_, r_, rb_ = ts
        fn(q_, k_, v_, r_, w_bias, rb_, mask, None, None).square().sum().backward()
        return [t.grad for t in ts]

    got = grads(compiled, leaves)
    want = grads(xlnet_core, [t.detach().clone().requires_grad_() for t in leaves])
    assert cap.attention_calls() == 1
    assert all(rel_err(a, b) < 1e-4 for a, b in zip(got, want))


@pytest.mark.parametrize("equation, plan", [
    ("bhqd,bhkd->bhqk", MatmulPlan(None, None, True, None)),
    ("bhqd,bhdk->bhqk", MatmulPlan(None, None, False, None)),
    ("ibnd,jbnd->bnij", MatmulPlan((1, 2, 0, 3), (1, 2, 0, 3), True, None)),
    ("bnij,jbnd->ibnd", MatmulPlan(None, (1, 2, 0, 3), False, (2, 0, 1, 3))),
    ("ijbs,ibns->bnij", MatmulPlan((2, 0, 1, 3), (1, 0, 2, 3), True, (0, 3, 1, 2))),
    ("bhqd,bhkd->bhkq", MatmulPlan(None, None, True, (0, 1, 3, 2))),
])
def test_einsum_matmul_plan(equation, plan):
    assert matmul_plan(equation) == plan
    g = torch.Generator().manual_seed(0)
    sizes = {c: 2 + i for i, c in enumerate(sorted(set(equation) - set(",->")))}
    a, b = (torch.randn(*(sizes[c] for c in op), generator=g) for op in equation.split("->")[0].split(","))
    x = a.permute(plan.first) if plan.first else a
    y = b.permute(plan.second) if plan.second else b
    out = torch.matmul(x, y.transpose(-1, -2) if plan.transposed else y)
    out = out.permute(plan.out) if plan.out else out
    assert torch.allclose(out, torch.einsum(equation, a, b), atol=1e-5)


@pytest.mark.parametrize("equation", ["ibh,hnd->ibnd", "ibnd,hnd->ibh", "ibnd,snd->ibns", "bij,bjk->bk",
                                      "bii,bij->bij", "ij,jk", "bnij->ijbn"])
def test_einsum_that_is_no_single_matmul_is_kept(equation):
    assert matmul_plan(equation) is None


class GptAttention(torch.nn.Module):
    """openai-gpt's Attention._attn, with its tril buffer (or another one) and fill."""

    def __init__(self, buffer=None, fill=-1e4, n=16):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(n, n)).view(1, 1, n, n) if buffer is None else buffer,
                             persistent=False)
        self.fill, self.custom_fill = fill, fill != -1e4  # the literal, as the model writes it, unless another

    def forward(self, q, k, v):  # [B, S, H, D]; the keys pre-transposed to [B, H, D, S]
        q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 3, 1), v.permute(0, 2, 1, 3)
        w = torch.matmul(q, k) / math.sqrt(v.size(-1))
        b = self.bias[:, :, : w.size(-2), : w.size(-1)]
        w = w * b + (self.fill if self.custom_fill else -1e4) * (1 - b)
        w = F.dropout(F.softmax(w, dim=-1), 0.1, False)
        return torch.matmul(w, v)


def _gpt_inputs(seq=SQ, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, seq, H, D, generator=g) for _ in range(3))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_buffer_mask_is_rewritten_and_exact(dynamic):
    module = GptAttention()
    compiled, cap = compile_capture(module, dynamic=dynamic)
    for seq in (SQ, SQ + 3):
        q, k, v = _gpt_inputs(seq)
        out = compiled(q, k, v)
        report = cap.reports[-1]
        assert cap.attention_calls() == 1 and cap.softmaxes() == 0, cap.after[-1].code
        assert len(report.rewritten) == 1 and not report.left_alone, report.left_alone
        assert "permute(0, 2, 3, 1)" not in cap.after[-1].code
        assert (out - module(q, k, v)).abs().max() < 1e-6


def test_buffer_mask_reads_the_live_buffer():
    """Another 0/1 buffer set after compiling (rows keep their first key) is still masked exactly."""
    module = GptAttention()
    compiled, cap = compile_capture(module)
    q, k, v = _gpt_inputs()
    compiled(q, k, v)
    module.bias[..., 3:, 1:3] = 0.0
    assert (compiled(q, k, v) - module(q, k, v)).abs().max() < 1e-6 and len(cap.reports) == 1


def _left_alone(module, reason):
    compiled, cap = compile_capture(module)
    q, k, v = _gpt_inputs()
    out = compiled(q, k, v)
    report = cap.reports[-1]
    assert cap.attention_calls() == 0 and len(report.left_alone) == 1, report
    assert reason in report.left_alone[0].reason, report.left_alone[0].reason
    assert rel_err(out, module(q, k, v)) < FP32_TOL


@pytest.mark.parametrize("buffer, fill, reason", [
    (torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16) * 0.5, -1e4, "holds values other than 0 and 1"),
    (torch.triu(torch.ones(16, 16)).view(1, 1, 16, 16), -1e4, "a query could have every key masked"),
    (None, -10.0, "a fill above -10000"),
], ids=["not-0/1", "first-key-masked", "small-fill"])
def test_buffer_mask_that_is_not_a_0_1_mask_is_left_alone(buffer, fill, reason):
    _left_alone(GptAttention(buffer, fill), reason)


def test_mask_argument_is_left_alone():
    """A 0/1 tensor passed as an argument may hold other values at the next call: not taken."""
    def fn(q, k, v, b):
        w = torch.matmul(q.transpose(1, 2), k.permute(0, 2, 3, 1)) / math.sqrt(D)
        v = v.transpose(1, 2)
        return torch.matmul(F.softmax(w * b + -1e4 * (1 - b), dim=-1), v)

    q, k, v = _gpt_inputs()
    b = torch.tril(torch.ones(SQ, SQ)).view(1, 1, SQ, SQ)
    compiled, cap = compile_capture(fn)
    out = compiled(q, k, v, b)
    assert cap.attention_calls() == 0 and "no module buffer" in cap.reports[-1].left_alone[0].reason
    assert rel_err(out, fn(q, k, v, b)) < FP32_TOL


# The coverage sweep's families (optimize(), as the sweep runs them): every site rewritten, logits as eager.
FAMILIES = {"xlnet": 2, "openai-gpt": 2}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_attention_is_rewritten(family):
    from kda_compile.coverage.sweep import run_family

    row = run_family(family)
    assert row.status == "ok", row.reason
    assert row.rewritten == {"kda_compile.attention": FAMILIES[family]} and not row.left_alone, row.left_alone
    assert row.logits_error < 1e-6
