"""The prologue rewrite: the gate, the beta sigmoid and the q/k L2 norm computed before a KDA call
fold into the op's in-kernel options (cheap: aot_eager).

Every positive case must end with one public KDA call taking the raw projections (flags set, no
gate / sigmoid / norm left in the graph) and match the unfolded eager code, forward and backward
(gradients of the raw projections, A_log and dt_bias included). Folding moves the same fp32 math
into the op, so only rounding differs: fp32 relative error ``||a - b|| / ||b||`` < 1e-5 for outputs
(measured: about 1e-7) and < 1e-4 for gradients (A_log's gradient sums B*T*K terms of both signs that
mostly cancel, which magnifies rounding: measured up to 1.4e-4 from the fp64 result, where the eager
fp32 code itself was 3.1e-5 off). A gradient beyond 1e-4 is therefore judged against a float64 run of
the same code: the compiled gradient must be within 10x the eager fp32 code's own error.
"""
from __future__ import annotations

import copy
import re
import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from kda_compile.config import Config
from kda_compile.ops import chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule, fused_recurrent_kda
from kda_compile.passes import PassManager

from .graph_capture import GraphCapture

FP32_TOL = 1e-5
FP32_GRAD_TOL = 1e-4
# A gradient that fails FP32_GRAD_TOL passes when its error from the fp64 result is within this
# factor of the eager fp32 code's own error (the op sums in another order; see the module note).
CANCELLATION_SLACK = 10
BF16_TOL = 2e-2
B, T, H, K, V, D = 2, 5, 2, 4, 6, 16
KDA_OPS = ("chunk_kda_fwd", "fused_recurrent_kda_fwd")
# What the folded prologue computed: none of it may survive.
PROLOGUE_TARGETS = (torch.sigmoid, "sigmoid", F.sigmoid, torch.where, torch.exp, "exp", F.softplus,
                    torch._C._nn.softplus, torch.log, torch.log1p, torch.sqrt, torch.rsqrt)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all(), "NaN or inf in the compiled result"
    return float((a - b).norm() / b.norm())


def ours(report, name="kda_prologue"):
    return [r for r in report.rewritten if r.rewrite == name], [c for c in report.left_alone if c.rewrite == name]


def compile_and_compare(fn, args, params=(), *, tol=FP32_TOL, grad_tol=FP32_GRAD_TOL, backward=True):
    capture = GraphCapture()
    got = torch.compile(fn, backend=capture)(*args)
    want = fn(*args)
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and rel_err(a, b) < tol
    if backward:
        leaves = [x for x in (*args, *params) if x.requires_grad]
        seeds = [torch.randn(w.shape, generator=torch.Generator().manual_seed(3)).to(w.dtype) for w in want]
        grads = zip(torch.autograd.grad(got, leaves, seeds, allow_unused=True),
                    torch.autograd.grad(want, leaves, seeds, allow_unused=True))
        truth = None
        for i, (a, b) in enumerate(grads):
            assert (a is None) == (b is None), f"gradient of input {i}"
            if b is None or rel_err(a, b) < grad_tol:
                continue
            # An ill-conditioned reduction (A_log's gradient): judge both fp32 results against fp64.
            assert a.dtype == torch.float32, f"gradient of input {i}: {rel_err(a, b):.2e}"
            truth = truth if truth is not None else fp64_grads(fn, args, params, seeds)
            ours_err, eager_err = rel_err(a, truth[i]), rel_err(b, truth[i])
            assert ours_err < max(grad_tol, CANCELLATION_SLACK * eager_err), \
                f"gradient of input {i}: {ours_err:.2e} from fp64 (eager fp32: {eager_err:.2e})"
    return capture


def fp64_grads(fn, args, params, seeds):
    """The same gradients computed in float64 (a double copy of the module and its inputs)."""
    if isinstance(fn, nn.Module):
        fn = copy.deepcopy(fn).double()
        params = list(fn.parameters()) if params else []  # the callers pass all of them, in order
    else:
        assert not params, "a plain function's parameters cannot be promoted to float64"
    args = [x.detach().double().requires_grad_(x.requires_grad) for x in args]
    out = fn(*args)
    out = out if isinstance(out, tuple) else (out,)
    leaves = [x for x in (*args, *params) if x.requires_grad]
    return torch.autograd.grad(out, leaves, [s.double() for s in seeds], allow_unused=True)


def kda_calls(capture, graph=-1):
    """(public chunk_kda calls, public fused_recurrent_kda calls, torch.ops.kda_compile nodes)."""
    snap = capture.after[graph]
    ops = sum(1 for t in snap.targets if any(name in str(t) for name in KDA_OPS))
    return snap.count(chunk_kda), snap.count(fused_recurrent_kda), ops


def folded_flags(capture):
    code = capture.after[-1].code
    return {flag: f"{flag} = True" in code for flag in
            ("use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "use_qk_l2norm_in_kernel", "allow_neg_eigval")}


# ---------------------------------------------------------------------------------------------
# A Kimi-Linear KDA layer tail, shaped like transformers' KimiLinearDeltaAttention
# ---------------------------------------------------------------------------------------------
def hf_forget_gate(heads=H, head_dim=K, hidden=D, seed=0):
    """transformers' own KimiLinearForgetGate (its forward is the code the pass must fold)."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForgetGate

    torch.manual_seed(seed)
    gate = KimiLinearForgetGate(types.SimpleNamespace(hidden_size=hidden, linear_head_dim=head_dim,
                                                      linear_num_heads=heads))
    with torch.no_grad():
        gate.dt_bias.copy_(torch.randn(heads * head_dim))
        gate.A_log.copy_(torch.randn(1, 1, heads, 1) * 0.5)
    return gate


class DeltaTail(nn.Module):
    """Projections, HF's forget gate, beta = sigmoid(b_proj(x)), then kda_compile.ops.chunk_kda
    with use_qk_l2norm_in_kernel=True, as the substituted Kimi-Linear layer traces."""

    def __init__(self, heads=H, head_dim=K, v_dim=V, hidden=D, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.head_dim = head_dim
        self.q_proj, self.k_proj = nn.Linear(hidden, heads * head_dim), nn.Linear(hidden, heads * head_dim)
        self.v_proj = nn.Linear(hidden, heads * v_dim)
        self.b_proj = nn.Linear(hidden, heads)
        self.forget_gate = hf_forget_gate(heads, head_dim, hidden, seed)

    def forward(self, x, h0):
        bsz, t = x.shape[:2]
        q = self.q_proj(x).view(bsz, t, -1, self.head_dim)
        k = self.k_proj(x).view(bsz, t, -1, self.head_dim)
        v = self.v_proj(x).view(bsz, t, q.shape[2], -1)
        g = self.forget_gate(x)
        beta = torch.sigmoid(self.b_proj(x))
        return chunk_kda(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                         use_qk_l2norm_in_kernel=True)


def layer_inputs(b=B, t=T, heads=H, head_dim=K, v_dim=V, hidden=D, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, hidden, generator=gen).to(dtype).requires_grad_()
    h0 = torch.randn(b, heads, head_dim, v_dim, generator=gen).requires_grad_()
    return x, h0


def test_hf_layer_tail_folds_gate_and_beta():
    layer = DeltaTail()
    capture = compile_and_compare(layer, layer_inputs(), list(layer.parameters()))
    assert kda_calls(capture) == (1, 0, 0), capture.after[-1].code
    assert capture.before[-1].count(*PROLOGUE_TARGETS) > 0  # HF's gate code was there
    assert capture.after[-1].count(*PROLOGUE_TARGETS) == 0, capture.after[-1].code
    assert folded_flags(capture) == dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                         use_qk_l2norm_in_kernel=True, allow_neg_eigval=False)
    (rewritten,), left = ours(capture.reports[-1])
    assert rewritten.details == {"gate": "softplus + dt_bias", "beta": "sigmoid"} and not left
    assert rewritten.source.startswith("test_kda_prologue.py:")  # the model line, not our API's


@settings(deadline=None)
@given(b=st.integers(1, 3), t=st.integers(1, 20), heads=st.integers(1, 3), head_dim=st.integers(2, 8),
       v_dim=st.integers(2, 8), seed=st.integers(0, 2 ** 16))
@example(b=2, t=12, heads=1, head_dim=8, v_dim=2, seed=61410)  # A_log's gradient: 1.1e-4 from eager fp32 (CI)
def test_hf_layer_tail_random_shapes(b, t, heads, head_dim, v_dim, seed):
    torch._dynamo.reset()
    layer = DeltaTail(heads, head_dim, v_dim, seed=seed)
    capture = compile_and_compare(layer, layer_inputs(b, t, heads, head_dim, v_dim, seed=seed),
                                  list(layer.parameters()))
    assert kda_calls(capture) == (1, 0, 0)
    assert capture.after[-1].count(*PROLOGUE_TARGETS) == 0


def test_bf16_projections_reach_the_op_without_their_upcast():
    """HF computes the gate in fp32 from a bf16 projection: the op now gets the bf16 projection
    (it computes the gate in fp32 itself)."""
    layer = DeltaTail().to(torch.bfloat16)
    layer.forget_gate.to(torch.bfloat16)
    capture = compile_and_compare(layer, layer_inputs(dtype=torch.bfloat16), list(layer.parameters()),
                                  tol=BF16_TOL, grad_tol=BF16_TOL)
    assert kda_calls(capture) == (1, 0, 0)
    code = capture.after[-1].code
    raw = re.search(r"= (\w+)\.unflatten\(-1", code).group(1)
    assert ".float()" not in re.search(rf"\b{raw} = .*", code).group(0)


# ---------------------------------------------------------------------------------------------
# Other spellings: FLA's gates, the L2 norm, 2 * sigmoid, decode
# ---------------------------------------------------------------------------------------------
def raw_inputs(t=T, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, t, H, K, generator=gen), torch.randn(B, t, H, K, generator=gen)
    v, f = torch.randn(B, t, H, V, generator=gen), torch.randn(B, t, H, K, generator=gen)
    b = torch.randn(B, t, H, generator=gen)
    a_log, dt_bias = torch.randn(H, generator=gen) * 0.5, torch.randn(H * K, generator=gen)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, f, b, a_log, dt_bias)]


def l2(x, eps=1e-6):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def fla_softplus_gate(q, k, v, f, b, a_log, dt_bias):
    g = -a_log.view(H, 1).float().exp() * F.softplus(f + dt_bias.view(H, K))
    return chunk_kda(q, k, v, g, torch.sigmoid(b), use_qk_l2norm_in_kernel=True)[0]


def lower_bound_gate(q, k, v, f, b, a_log, dt_bias):
    g = -4.0 * torch.sigmoid(a_log.view(H, 1).exp() * (f + dt_bias.view(H, K)))
    return chunk_kda(q, k, v, g, torch.sigmoid(b), use_qk_l2norm_in_kernel=True)[0]


def lower_bound_gate_without_a_log(q, k, v, f, b, a_log, dt_bias):
    g = torch.sigmoid(f) * -3.0
    return chunk_kda(q, k, v, g, b.sigmoid(), use_qk_l2norm_in_kernel=True)[0]


def l2norm_and_neg_eigval(q, k, v, f, b, a_log, dt_bias):
    k = k * torch.rsqrt(k.pow(2).sum(dim=-1, keepdim=True) + 1e-6)
    g = F.logsigmoid(f)  # not a gate form: stays as it is
    return chunk_kda(l2(q), k, v, g, 2 * torch.sigmoid(b), scale=0.3)[0]


@pytest.mark.parametrize("fn, details", [
    (fla_softplus_gate, {"gate": "softplus + dt_bias", "beta": "sigmoid"}),
    (lower_bound_gate, {"gate": "lower_bound=-4.0 + dt_bias", "beta": "sigmoid"}),
    (lower_bound_gate_without_a_log, {"gate": "lower_bound=-3.0", "beta": "sigmoid"}),
    (l2norm_and_neg_eigval, {"beta": "2 * sigmoid", "qk_l2norm": "q and k"}),
])
def test_spellings_fold(fn, details):
    capture = compile_and_compare(fn, raw_inputs())
    assert kda_calls(capture) == (1, 0, 0)
    (rewritten,), _ = ours(capture.reports[-1])
    assert {k: v for k, v in rewritten.details.items() if k != "not folded"} == details
    flags = folded_flags(capture)
    assert flags["use_gate_in_kernel"] == ("gate" in details)
    assert flags["allow_neg_eigval"] == (details["beta"] == "2 * sigmoid")


def test_decode_call_folds_into_fused_recurrent():
    def decode(q, k, v, f, b, a_log, dt_bias, h0):
        g = -a_log.view(H, 1).exp() * F.softplus(f + dt_bias.view(H, K))
        return fused_recurrent_kda(q, k, v, g, torch.sigmoid(b), initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True)

    args = [x.detach() for x in raw_inputs(t=1)] + [torch.randn(B, H, K, V)]
    with torch.no_grad():
        capture = compile_and_compare(decode, args, backward=False)
    assert kda_calls(capture) == (0, 1, 0), capture.after[-1].code
    assert capture.after[-1].count(*PROLOGUE_TARGETS) == 0


def test_gate_and_beta_of_an_inline_recurrence_fold_after_kda_recurrence():
    """The gate and the sigmoid computed before a hand-written token loop: kda_recurrence inserts
    a public chunk_kda call, kda_prologue then folds both into it."""
    def loop(q, k, v, f, b, a_log, dt_bias):
        g = -a_log.view(H, 1).exp() * F.softplus(f + dt_bias.view(H, K))
        beta = torch.sigmoid(b)
        S = torch.zeros(B, H, K, V)
        o = torch.zeros(B, q.shape[1], H, V)
        for t in range(q.shape[1]):
            S = S * g[:, t][..., None].exp()
            u = (v[:, t] - (S * k[:, t][..., None]).sum(-2)) * beta[:, t][..., None]
            S = S + k[:, t][..., None] * u[..., None, :]
            o[:, t] = (S * q[:, t][..., None]).sum(-2)
        return o

    q, k, *rest = raw_inputs(t=6)
    k_unit = F.normalize(k.detach(), dim=-1).requires_grad_()  # a stable delta rule
    capture = compile_and_compare(loop, [q, k_unit, *rest])
    assert kda_calls(capture) == (1, 0, 0)
    assert [r.rewrite for r in capture.reports[-1].rewritten if r.rewrite.startswith("kda_")][:2] == [
        "kda_recurrence", "kda_prologue"]
    assert capture.after[-1].count(*PROLOGUE_TARGETS) == 0, capture.after[-1].code


def test_rewrite_is_idempotent():
    seen = []

    def twice(gm, example_inputs):
        first = PassManager(Config(compiler="aot_eager")).run(gm)
        code = gm.code
        second = PassManager(Config(compiler="aot_eager")).run(gm)
        seen.append((ours(first)[0], ours(second), code == gm.code))
        return gm.forward

    torch.compile(fla_softplus_gate, backend=twice)(*raw_inputs())
    (first, (second, second_left), unchanged), = seen
    assert len(first) == 1 and not second and not second_left and unchanged


# ---------------------------------------------------------------------------------------------
# Left alone, with the reason (the unfolded result stays exact)
# ---------------------------------------------------------------------------------------------
def gate_used_twice(q, k, v, f, b, a_log, dt_bias):
    g = -a_log.view(H, 1).exp() * F.softplus(f + dt_bias.view(H, K))
    return chunk_kda(q, k, v, g, b, use_qk_l2norm_in_kernel=True)[0], g.sum()


def normalize_differs(q, k, v, f, b, a_log, dt_bias):
    return chunk_kda(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, F.logsigmoid(f), b)[0]


def other_eps(q, k, v, f, b, a_log, dt_bias):
    return chunk_kda(l2(q, 1e-5), l2(k, 1e-5), v, F.logsigmoid(f), b)[0]


def only_q_normalised(q, k, v, f, b, a_log, dt_bias):
    return chunk_kda(l2(q), k, v, F.logsigmoid(f), b)[0]


def softplus_threshold_10(q, k, v, f, b, a_log, dt_bias):
    x = f + dt_bias.view(H, K)
    g = -a_log.view(H, 1).exp() * torch.where(x > 10.0, x, torch.log(1.0 + torch.exp(x)))
    return chunk_kda(q, k, v, g, b, use_qk_l2norm_in_kernel=True)[0]


def rate_per_channel(q, k, v, f, b, a_log, dt_bias):
    g = -dt_bias.view(H, K).exp() * F.softplus(f)
    return chunk_kda(q, k, v, g, b, use_qk_l2norm_in_kernel=True)[0]


@pytest.mark.parametrize("fn, reason", [
    (gate_used_twice, "is also used by sum"),
    (normalize_differs, "F.normalize, which divides by max(||x||, eps)"),
    (other_eps, "eps 1e-05 differs from the kernel's 1e-06"),
    (only_q_normalised, "(both must fold)"),
    (softplus_threshold_10, "softplus threshold 10.0 differs"),
    (rate_per_channel, "is not per head"),
])
def test_left_alone_with_the_reason(fn, reason):
    capture = compile_and_compare(fn, raw_inputs(), backward=False)
    rewritten, left = ours(capture.reports[-1])
    assert not rewritten and len(left) == 1 and reason in left[0].reason, [c.reason for c in left]
    assert capture.after[-1].code == capture.before[-1].code
    assert kda_calls(capture)[2] == 1  # the traced op node is kept as it was


# ---------------------------------------------------------------------------------------------
# The gated delta rule (GDN): Qwen3-Next's layer tail, the gate one decay per value head
# ---------------------------------------------------------------------------------------------
class GDNTail(nn.Module):
    """Shaped like transformers' Qwen3NextGatedDeltaNet after its conv: q/k heads 2, value heads 4,
    ``beta = b.sigmoid()`` (``2 * sigmoid`` with ``neg_eigval``, as olmo_hybrid) and
    ``g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)``, then the GDN op (what the substituted
    ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` trace to)."""

    def __init__(self, decode=False, neg_eigval=False, heads=2, value_heads=4, hidden=D, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.decode, self.neg_eigval = decode, neg_eigval
        self.q_proj, self.k_proj = nn.Linear(hidden, heads * K), nn.Linear(hidden, heads * K)
        self.v_proj = nn.Linear(hidden, value_heads * V)
        self.a_proj, self.b_proj = nn.Linear(hidden, value_heads), nn.Linear(hidden, value_heads)
        self.A_log = nn.Parameter(torch.rand(value_heads) * 2)
        self.dt_bias = nn.Parameter(torch.randn(value_heads))

    def forward(self, x, h0):
        bsz, t = x.shape[:2]
        q, k = self.q_proj(x).view(bsz, t, -1, K), self.k_proj(x).view(bsz, t, -1, K)
        v = self.v_proj(x).view(bsz, t, -1, V)
        beta = self.b_proj(x).sigmoid()
        if self.neg_eigval:
            beta = beta * 2.0
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias)
        fn = fused_recurrent_gated_delta_rule if self.decode else chunk_gated_delta_rule
        return fn(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("decode, neg_eigval", [(False, False), (True, True)], ids=["chunk", "decode-neg-eigval"])
def test_gdn_layer_tail_folds_gate_and_beta(decode, neg_eigval):
    layer = GDNTail(decode=decode, neg_eigval=neg_eigval)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, 1 if decode else 9, D, generator=gen).requires_grad_(not decode)
    h0 = torch.randn(B, 4, K, V, generator=gen).requires_grad_(not decode)
    with torch.set_grad_enabled(not decode):
        capture = compile_and_compare(layer, (x, h0), list(layer.parameters()), backward=not decode)
    fn = fused_recurrent_gated_delta_rule if decode else chunk_gated_delta_rule
    assert capture.after[-1].count(fn) == 1, capture.after[-1].code
    assert capture.before[-1].count(*PROLOGUE_TARGETS) > 0
    assert capture.after[-1].count(*PROLOGUE_TARGETS) == 0, capture.after[-1].code
    assert folded_flags(capture) == dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                         use_qk_l2norm_in_kernel=True, allow_neg_eigval=neg_eigval)
    (rewritten,), left = ours(capture.reports[-1])
    assert rewritten.op == f"kda_compile.ops.{fn.__name__}" and not left
    assert rewritten.details == {"gate": "softplus + dt_bias", "beta": "2 * sigmoid" if neg_eigval else "sigmoid"}


def test_gdn_lower_bound_gate_is_left_alone_with_the_reason():
    def tail(q, k, v, a, b):
        g = -5.0 * torch.sigmoid(a)  # KDA's lower-bound form: the GDN op has no such in-kernel gate
        return chunk_gated_delta_rule(q, k, v, g, torch.sigmoid(b), output_final_state=True)

    gen = torch.Generator().manual_seed(1)
    q, k = (F.normalize(torch.randn(B, 6, 2, K, generator=gen), dim=-1) for _ in range(2))
    args = (q, k, torch.randn(B, 6, 4, V, generator=gen), torch.randn(B, 6, 4, generator=gen),
            torch.randn(B, 6, 4, generator=gen))
    capture = compile_and_compare(tail, args, backward=False)
    (rewritten,), left = ours(capture.reports[-1])
    assert rewritten.details["beta"] == "sigmoid"
    assert "the lower-bound gate is KDA's" in rewritten.details["not folded"]
