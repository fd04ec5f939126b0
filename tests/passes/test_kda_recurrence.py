"""The inline-recurrence rewrite on hand-written token loops (cheap: aot_eager).

Each spelling below is a KDA recurrence written the way a reference or a user writes it; under
torch.compile Dynamo unrolls it into T copies of the step. The rewrite must collapse the copies
into ONE ``chunk_kda`` (``fused_recurrent_kda`` for T = 1) call with no per-step node left, and the
compiled result must match the eager loop, forward and backward. Loops that mean something else
must be left alone with their reason in the report (and still compute what they computed).

Tolerance: fp32 relative error ``||a - b|| / ||b||`` < 2e-5: the chunked op and the token loop add
the same terms in a different order (measured: about 1e-6).
"""
from __future__ import annotations

import math
import operator
import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_compile.config import Config
from kda_compile.ops import chunk_kda, fused_recurrent_kda
from kda_compile.passes import PassManager

from .graph_capture import GraphCapture

FP32_TOL = 2e-5
BF16_TOL = 2e-2
B, H, K, V = 2, 2, 4, 5
# What an unrolled step leaves in the graph: none of it may survive the rewrite.
STEP_TARGETS = (torch.exp, "exp", torch.functional.einsum, torch.einsum, "sum", torch.sum, operator.setitem,
                torch.stack, torch.cat, torch.matmul, operator.matmul, "unbind", "select")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error; for an all-zero reference (e.g. dg of the first token from a zero state)
    the absolute norm of ``a``."""
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all(), "NaN or inf in the compiled result"
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float(a.norm())


def make_inputs(t, *, b=B, h=H, hv=None, k=K, v=V, heads_first=False, dtype=torch.float32, seed=0,
                requires_grad=True):
    """q, k, v, g, beta as a KDA layer feeds them: unit-norm keys (a stable delta rule), log decays
    g < 0, beta in (0, 1). ``heads_first`` gives [B, H, T, ...] instead of [B, T, H, ...]."""
    gen = torch.Generator().manual_seed(seed)
    hv = hv or h
    q = torch.randn(b, t, h, k, generator=gen)
    key = F.normalize(torch.randn(b, t, h, k, generator=gen), dim=-1)
    val = torch.randn(b, t, hv, v, generator=gen)
    g = F.logsigmoid(torch.randn(b, t, hv, k, generator=gen) + 2.0)
    beta = torch.rand(b, t, hv, generator=gen)
    xs = [q, key, val, g, beta]
    if heads_first:
        xs = [x.transpose(1, 2).contiguous() for x in xs]
    return [x.to(dtype).requires_grad_(requires_grad) for x in xs]


def make_state(b=B, hv=H, k=K, v=V, seed=1, requires_grad=False):
    return torch.randn(b, hv, k, v, generator=torch.Generator().manual_seed(seed)).requires_grad_(requires_grad)


# ---------------------------------------------------------------------------------------------
# Spellings of the same recurrence
# ---------------------------------------------------------------------------------------------
def hf_loop(q, k, v, g, beta, h0):
    """Hugging Face's recurrent_kimi_delta_attention body: fp32 casts, pre-scaled q, a given
    state, a zeros output buffer filled by index assignment."""
    dtype = q.dtype
    q, k, v, g, beta = [x.to(torch.float32) for x in (q, k, v, g, beta)]
    bsz, t_len, heads, kd = k.shape
    q = q * (1 / kd ** 0.5)
    out = torch.zeros(bsz, t_len, heads, v.shape[-1], dtype=v.dtype, device=v.device)
    state = h0.to(v)
    for i in range(t_len):
        q_i, k_i, v_i = q[:, i], k[:, i], v[:, i]
        g_i = g[:, i][..., None].exp()
        b_i = beta[:, i][..., None]
        state = state * g_i
        kv = (state * k_i[..., None]).sum(dim=-2)
        delta = (v_i - kv) * b_i
        state = state + k_i.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, i] = (state * q_i.unsqueeze(-1)).sum(dim=-2)
    return out.to(dtype), state


def fla_loop(q, k, v, g, beta, h0=None):
    """FLA's naive reference shape: einsum, new_zeros(...).to(q), ``S += h0``, zeros_like buffer,
    the outer product of beta * k with the residual."""
    kd = q.shape[-1]
    q, k, v, g, beta = map(lambda x: x.to(torch.float), [q, k, v, g, beta])
    q = q * kd ** -0.5
    S = k.new_zeros(q.shape[0], q.shape[2], kd, v.shape[-1]).to(q)
    if h0 is not None:
        S += h0
    o = torch.zeros_like(v)
    for i in range(q.shape[1]):
        q_i, k_i, v_i, g_i, b_i = q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i]
        S = S * g_i[..., None].exp()
        S = S + torch.einsum("b h k, b h v -> b h k v", b_i[..., None] * k_i, v_i - (k_i[..., None] * S).sum(-2))
        o[:, i] = torch.einsum("b h k, b h k v -> b h v", q_i, S)
    return o, S


def heads_first_stack_loop(q, k, v, g, beta, h0=None):
    """[B, H, T, K] inputs sliced x[:, :, t], no casts, no scale, torch.exp(g)[..., None],
    outputs stacked along dim 2."""
    S = torch.zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3], dtype=q.dtype) if h0 is None else h0
    outs = []
    for t in range(q.shape[2]):
        S = torch.exp(g[:, :, t])[..., None] * S
        kv = torch.einsum("bhkv,bhk->bhv", S, k[:, :, t])
        u = beta[:, :, t].unsqueeze(-1) * (v[:, :, t] - kv)
        S = torch.einsum("bhv,bhk->bhkv", u, k[:, :, t]) + S
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(outs, dim=2), S


def select_cat_loop(q, k, v, g, beta, h0=None, inplace=False):
    """x.select(1, t), a matmul readout, outputs concatenated as [B, 1, H, V]; ``S += ...`` with
    ``inplace`` (inference code only: eager autograd refuses it, the readout saved S)."""
    S = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3]) if h0 is None else h0
    q = q / math.sqrt(q.shape[-1])
    outs = []
    for t in range(q.shape[1]):
        k_t = k.select(1, t)
        S = S * g.select(1, t).unsqueeze(-1).exp()
        kv = (k_t.unsqueeze(-2) @ S).squeeze(-2)
        u = (v.select(1, t) - kv) * beta.select(1, t)[:, :, None]
        if inplace:
            S += k_t[:, :, :, None] * u[:, :, None, :]
        else:
            S = S + k_t[:, :, :, None] * u[:, :, None, :]
        outs.append((q.select(1, t).unsqueeze(-2) @ S).squeeze(-2).unsqueeze(1))
    return torch.cat(outs, dim=1), S


def unbind_loop(q, k, v, g, beta, h0=None):
    """Token tuples from unbind(1) and an index assignment into torch.empty."""
    S = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3]) if h0 is None else h0
    o = torch.empty(v.shape)
    for t, (q_t, k_t, v_t, g_t, b_t) in enumerate(zip(*(x.unbind(1) for x in (q * 0.25, k, v, g, beta)))):
        S = S * g_t[..., None].exp()
        u = (v_t - (S * k_t[..., None]).sum(-2)) * b_t[..., None]
        S = S + k_t[..., None] * u[..., None, :]
        o[:, t] = (S * q_t[..., None]).sum(-2)
    return o, S


def gva_loop(q, k, v, g, beta, h0):
    """FLA's GVA reference: q and k repeated per value head with repeat_interleave."""
    groups = v.shape[2] // q.shape[2]
    q = q.repeat_interleave(groups, dim=2) * q.shape[-1] ** -0.5
    k = k.repeat_interleave(groups, dim=2)
    S = h0
    o = torch.zeros_like(v)
    for i in range(q.shape[1]):
        q_i, k_i, v_i, g_i, b_i = q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i]
        S = S * g_i[..., None].exp()
        S = S + torch.einsum("b h k, b h v -> b h k v", b_i[..., None] * k_i, v_i - (k_i[..., None] * S).sum(-2))
        o[:, i] = torch.einsum("b h k, b h k v -> b h v", q_i, S)
    return o, S


SPELLINGS = {"hf": hf_loop, "fla": fla_loop, "heads_first_stack": heads_first_stack_loop,
             "select_cat": select_cat_loop, "unbind": unbind_loop}


def call_args(name, t, *, with_state, seed=0, **kw):
    xs = make_inputs(t, heads_first=name == "heads_first_stack", seed=seed, **kw)
    hv = xs[2].shape[1 if name == "heads_first_stack" else 2]
    state = make_state(b=xs[0].shape[0], hv=hv, k=xs[0].shape[-1], v=xs[2].shape[-1], seed=seed + 1,
                       requires_grad=kw.get("requires_grad", True))
    if name == "hf":
        return xs + [state if with_state else torch.zeros_like(state)]
    return xs + ([state] if with_state else [])


def compile_and_compare(fn, args, *, tol=FP32_TOL, backward=True, dynamic=False):
    capture = GraphCapture()
    compiled = torch.compile(fn, backend=capture, dynamic=dynamic)
    got = compiled(*args)
    want = fn(*args)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rel_err(a, b) < tol
    if backward:
        leaves = [x for x in args if x.requires_grad]
        seeds = [torch.randn(w.shape, generator=torch.Generator().manual_seed(7)).to(w.dtype) for w in want]
        grads = torch.autograd.grad(got, leaves, seeds)
        refs = torch.autograd.grad(want, leaves, seeds)
        assert len(grads) == len(leaves)
        for name, a, b in zip(("q", "k", "v", "g", "beta", "h0"), grads, refs):
            assert rel_err(a, b) < tol, f"d{name}"
    return capture


def kda_calls(capture, graph=-1):
    return capture.after[graph].count(chunk_kda), capture.after[graph].count(fused_recurrent_kda)


def assert_collapsed(capture, t):
    chunk, recurrent = kda_calls(capture)
    assert (chunk, recurrent) == ((0, 1) if t == 1 else (1, 0)), capture.after[-1].code
    assert capture.after[-1].count(*STEP_TARGETS) == 0, capture.after[-1].code
    rewritten = [r for r in capture.reports[-1].rewritten if r.rewrite == "kda_recurrence"]
    assert len(rewritten) == 1 and rewritten[0].details["steps"] == t


# ---------------------------------------------------------------------------------------------
# Positive cases
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SPELLINGS))
@pytest.mark.parametrize("t", [1, 7])
def test_each_spelling_becomes_one_kda_call(name, t):
    capture = compile_and_compare(SPELLINGS[name], call_args(name, t, with_state=True))
    assert_collapsed(capture, t)
    assert capture.before[-1].count(*STEP_TARGETS) >= t  # the loop really was unrolled


@settings(deadline=None)
@given(name=st.sampled_from(sorted(SPELLINGS)), t=st.integers(1, 24), b=st.integers(1, 2), h=st.integers(1, 3),
       k=st.integers(2, 9), v=st.integers(2, 9), with_state=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_random_shapes_and_spellings(name, t, b, h, k, v, with_state, seed):
    torch._dynamo.reset()
    args = call_args(name, t, with_state=with_state, seed=seed, b=b, h=h, k=k, v=v)
    capture = compile_and_compare(SPELLINGS[name], args)
    assert_collapsed(capture, t)
    details = capture.reports[-1].rewritten[0].details
    assert details["initial_state"] == ("given" if with_state or name == "hf" else "zeros")


def test_grouped_value_heads_pass_unrepeated_q_and_k():
    args = make_inputs(6, h=2, hv=4) + [make_state(hv=4)]
    capture = compile_and_compare(gva_loop, args)
    assert_collapsed(capture, 6)
    assert capture.reports[-1].rewritten[0].details["gva"] == 2
    assert "repeat_interleave" not in capture.after[-1].code


def test_decode_step_without_grad_uses_fused_recurrent_and_returns_the_state():
    args = call_args("hf", 1, with_state=True, requires_grad=False)
    with torch.no_grad():
        capture = compile_and_compare(hf_loop, args, backward=False)
    assert_collapsed(capture, 1)
    assert capture.reports[-1].rewritten[0].details["final_state"] is True


def test_inplace_state_update_in_inference_code():
    args = make_inputs(5, requires_grad=False)
    with torch.no_grad():
        capture = compile_and_compare(lambda *a: select_cat_loop(*a, inplace=True), args, backward=False)
    assert_collapsed(capture, 5)


def test_unused_final_state_is_not_requested():
    def only_outputs(*args):
        return (fla_loop(*args)[0],)

    capture = compile_and_compare(only_outputs, make_inputs(5))
    assert_collapsed(capture, 5)
    assert capture.reports[-1].rewritten[0].details["final_state"] is False


def test_bf16_inputs_cast_to_fp32_keep_the_output_dtype():
    args = make_inputs(9, dtype=torch.bfloat16) + [make_state()]
    capture = compile_and_compare(hf_loop, args, tol=BF16_TOL)
    assert_collapsed(capture, 9)


def test_dynamic_batch_is_rewritten_once():
    capture = GraphCapture()
    compiled = torch.compile(fla_loop, backend=capture, dynamic=True)
    for b in (3, 4, 5):  # not 2 = H: duck sizing would tie the batch to the heads
        args = make_inputs(5, b=b, requires_grad=False)
        for got, want in zip(compiled(*args), fla_loop(*args)):
            assert rel_err(got, want) < FP32_TOL
    assert capture.graphs == 1
    assert_collapsed(capture, 5)


def hf_recurrent_body():
    """The torch body of transformers' recurrent_kimi_delta_attention, as a new function object:
    the trace-time substitution replaces calls of the original, and this test is about the loop."""
    from transformers.models.kimi_linear import modeling_kimi_linear

    fn = getattr(modeling_kimi_linear.recurrent_kimi_delta_attention, "__wrapped__",
                 modeling_kimi_linear.recurrent_kimi_delta_attention)
    return types.FunctionType(fn.__code__, fn.__globals__, "hf_recurrent_body", fn.__defaults__, fn.__closure__)


@pytest.mark.parametrize("t", [1, 12])
def test_transformers_recurrent_body_then_prologue_folds_its_l2norm(t):
    """HF's own loop (with its q/k L2 norm): the recurrence becomes one op, then kda_prologue
    folds the L2 norm into use_qk_l2norm_in_kernel."""
    body = hf_recurrent_body()
    args = make_inputs(t) + [make_state()]

    def layer(q, k, v, g, beta, h0):
        return body(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)

    capture = compile_and_compare(layer, args)
    assert_collapsed(capture, t)
    ours = [r for r in capture.reports[-1].rewritten if r.rewrite in ("kda_recurrence", "kda_prologue")]
    assert [r.rewrite for r in ours] == ["kda_recurrence", "kda_prologue"]
    assert ours[1].details["qk_l2norm"] == "q and k"
    assert "sqrt" not in capture.after[-1].code and "use_qk_l2norm_in_kernel = True" in capture.after[-1].code


def test_rewrite_is_idempotent():
    seen = []

    def twice(gm, example_inputs):
        first = PassManager(Config(compiler="aot_eager")).run(gm)
        code = gm.code
        second = PassManager(Config(compiler="aot_eager")).run(gm)
        seen.append((first, second, code == gm.code))
        return gm.forward

    args = call_args("fla", 6, with_state=True)
    torch.compile(fla_loop, backend=twice)(*args)
    (first, second, unchanged), = seen
    assert [r.rewrite for r in first.rewritten if r.rewrite == "kda_recurrence"] == ["kda_recurrence"]
    assert not [r for r in second.rewritten if r.rewrite in ("kda_recurrence", "kda_prologue")] and unchanged


def test_inductor_compiles_the_rewritten_loop():
    import kda_compile

    args = call_args("hf", 8, with_state=True, requires_grad=False)
    compiled = kda_compile.optimize(hf_loop)
    for got, want in zip(compiled(*args), hf_loop(*args)):
        assert rel_err(got, want) < FP32_TOL
    assert any(r.rewrite == "kda_recurrence" for r in kda_compile.report(compiled).rewritten)


def test_switched_off_by_config():
    capture = GraphCapture(Config(compiler="aot_eager", kda_recurrence=False))
    torch.compile(fla_loop, backend=capture)(*make_inputs(4, requires_grad=False))
    assert kda_calls(capture) == (0, 0) and not capture.reports[-1].rewritten


# ---------------------------------------------------------------------------------------------
# Loops that mean something else: left alone, with the reason
# ---------------------------------------------------------------------------------------------
def step_differs(q, k, v, g, beta):
    S = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    o = torch.zeros_like(v)
    for t in range(q.shape[1]):
        S = S * g[:, t][..., None].exp()
        u = (v[:, t] - (S * k[:, t][..., None]).sum(-2)) * beta[:, t][..., None]
        if t == 3:
            u = u * 0.5  # not the delta rule at this token
        S = S + k[:, t][..., None] * u[..., None, :]
        o[:, t] = (S * q[:, t][..., None]).sum(-2)
    return o, S


def states_kept(q, k, v, g, beta):
    S = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    o, states = torch.zeros_like(v), []
    for t in range(q.shape[1]):
        S = S * g[:, t][..., None].exp()
        u = (v[:, t] - (S * k[:, t][..., None]).sum(-2)) * beta[:, t][..., None]
        S = S + k[:, t][..., None] * u[..., None, :]
        states.append(S)
        o[:, t] = (S * q[:, t][..., None]).sum(-2)
    return o, torch.stack(states)


def misses_last_token(q, k, v, g, beta):
    S = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[1] - 1):
        S = S * g[:, t][..., None].exp()
        u = (v[:, t] - (S * k[:, t][..., None]).sum(-2)) * beta[:, t][..., None]
        S = S + k[:, t][..., None] * u[..., None, :]
        outs.append((S * q[:, t][..., None]).sum(-2))
    return torch.stack(outs, 1), S


def reads_before_update(q, k, v, g, beta):
    S = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t][..., None].exp()
        outs.append((S * q[:, t][..., None]).sum(-2))  # o_t from the state before the update
        u = (v[:, t] - (S * k[:, t][..., None]).sum(-2)) * beta[:, t][..., None]
        S = S + k[:, t][..., None] * u[..., None, :]
    return torch.stack(outs, 1), S


def buffer_read_between(q, k, v, g, beta):
    S = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    o, running = torch.zeros_like(v), []
    for t in range(q.shape[1]):
        S = S * g[:, t][..., None].exp()
        u = (v[:, t] - (S * k[:, t][..., None]).sum(-2)) * beta[:, t][..., None]
        S = S + k[:, t][..., None] * u[..., None, :]
        o[:, t] = (S * q[:, t][..., None]).sum(-2)
        running.append(o.sum())
    return o, torch.stack(running)


def backwards_in_time(q, k, v, g, beta):
    S = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    o = torch.zeros_like(v)
    for t in reversed(range(q.shape[1])):
        S = S * g[:, t][..., None].exp()
        u = (v[:, t] - (S * k[:, t][..., None]).sum(-2)) * beta[:, t][..., None]
        S = S + k[:, t][..., None] * u[..., None, :]
        o[:, t] = (S * q[:, t][..., None]).sum(-2)
    return o, S


@pytest.mark.parametrize("fn, reason", [
    (step_differs, "the steps cover tokens 0..2 of"),
    (states_kept, "the state after token 0 is also read by"),
    (misses_last_token, "the steps cover tokens 0..4 of q's 6 tokens"),
    (reads_before_update, "no output is read from the updated state"),
    (buffer_read_between, "the output buffer is read between the steps"),
    (backwards_in_time, "the steps update with tokens 5, 4, 3, 2, ..."),
])
def test_other_loops_are_left_alone_with_the_reason(fn, reason):
    capture = compile_and_compare(fn, make_inputs(6), backward=False)
    assert kda_calls(capture) == (0, 0)
    left = [c for c in capture.reports[-1].left_alone if c.rewrite == "kda_recurrence"]
    assert left and any(reason in c.reason for c in left), [c.reason for c in left]
    assert capture.after[-1].code == capture.before[-1].code
