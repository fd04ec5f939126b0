"""The attention custom ops under torch.library.opcheck and torch.compile.

opcheck runs on every op (forward and backward) with contiguous and non-contiguous (transposed
[B, S, H, D]) inputs; torch.compile(fullgraph=True) must trace the public functions without a graph
break, match eager (forward and gradients, relative error 1e-12 in float64, the same kernels run),
and with dynamic=True serve three sequence lengths from one compiled graph.
"""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from kda_compile.ops.attention import attention, attention_with_lse
from kda_compile.testing import assert_rel_close

from .naive import Case, grad_inputs, make_inputs

OPCHECK_CASES = {
    "causal-gqa": Case(h=4, hkv=2, sq=5, sk=7, causal=True),
    "window-softcap-dv": Case(sq=6, sk=6, dqk=8, dv=4, causal=True, window=2, softcap=3.0),
    "float-mask-sinks": Case(mask="float", mask_shape="b1", sinks=True, sq=4, sk=6),
    "bool-mask-dead-rows": Case(b=2, mask="bool", dead_rows=True, sq=3, sk=5),
}


def _op_args(case, noncontiguous, requires_grad):
    args, kw = make_inputs(case.with_(noncontiguous=noncontiguous), torch.float64, requires_grad=requires_grad)
    scale = case.dqk ** -0.5
    return (*args, kw["attn_mask"], kw["sinks"], scale, kw["softcap"] or 0.0, 0.0, kw["is_causal"],
            kw["sliding_window"] or 0, False)


@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("name", list(OPCHECK_CASES))
def test_opcheck_forward(name, noncontiguous):
    torch.library.opcheck(torch.ops.kda_compile.attention_fwd.default,
                          _op_args(OPCHECK_CASES[name], noncontiguous, requires_grad=True))


@pytest.mark.parametrize("lse_grad", [False, True])
def test_opcheck_forward_lse_grad(lse_grad):
    args = list(_op_args(OPCHECK_CASES["float-mask-sinks"], True, requires_grad=True))
    args[-1] = lse_grad
    torch.library.opcheck(torch.ops.kda_compile.attention_fwd.default, tuple(args))


def test_opcheck_forward_with_dropout_schema_and_fake():
    # Random outputs: only the tests that do not compare two runs.
    args = list(_op_args(OPCHECK_CASES["causal-gqa"], True, requires_grad=False))
    args[8] = 0.3
    torch.library.opcheck(torch.ops.kda_compile.attention_fwd.default, tuple(args),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("name", list(OPCHECK_CASES))
def test_opcheck_backward(name, noncontiguous):
    fwd_args = _op_args(OPCHECK_CASES[name], noncontiguous, requires_grad=False)
    q, k, v, mask, sinks, scale, softcap, dropout_p, is_causal, window, _ = fwd_args
    out, lse, rng = torch.ops.kda_compile.attention_fwd(*fwd_args)
    grad_out = torch.randn(out.shape[0], out.shape[2], out.shape[1], out.shape[3], dtype=out.dtype).transpose(1, 2)
    mask_grad = mask is not None and mask.is_floating_point()
    for grad_lse in (None, torch.randn_like(lse)):
        torch.library.opcheck(torch.ops.kda_compile.attention_bwd.default,
                              (grad_out, grad_lse, q, k, v, out, lse, rng, mask, sinks, scale, softcap, dropout_p,
                               is_causal, window, mask_grad))


def _case_fn(kwargs):
    def fn(q, k, v, mask, sinks):
        out, lse = attention_with_lse(q, k, v, **dict(kwargs, attn_mask=mask, sinks=sinks))
        return out * 2.0, lse
    return fn


@pytest.mark.parametrize("name", list(OPCHECK_CASES))
def test_compile_fullgraph_matches_eager(name):
    args, kwargs = make_inputs(OPCHECK_CASES[name].with_(noncontiguous=True), torch.float64, requires_grad=True)
    mask, sinks = kwargs["attn_mask"], kwargs["sinks"]
    fn = _case_fn(kwargs)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out_e, lse_e = fn(*args, mask, sinks)
    out_c, lse_c = compiled(*args, mask, sinks)
    assert_rel_close(out_c, out_e, 1e-12, name="out")
    assert torch.equal(lse_c, lse_e)
    leaves = list(grad_inputs(args, kwargs).values())
    g = torch.randn_like(out_e)
    for a, b in zip(torch.autograd.grad((out_c * g).sum() + lse_c[torch.isfinite(lse_c)].sum(), leaves),
                    torch.autograd.grad((out_e * g).sum() + lse_e[torch.isfinite(lse_e)].sum(), leaves)):
        assert_rel_close(a, b, 1e-12, name="grad")


def test_compile_dynamic_lengths_do_not_recompile():
    counter = CompileCounterWithBackend("aot_eager")

    def fn(q, k, v):
        return attention(q, k, v, is_causal=True, sliding_window=4).sum()

    compiled = torch.compile(fn, backend=counter, dynamic=True, fullgraph=True)
    frames_after_first = None
    for length in (5, 9, 17):
        args, _ = make_inputs(Case(h=4, hkv=2, sq=length, sk=length, noncontiguous=True), torch.float32,
                              requires_grad=True)
        loss = compiled(*args)
        loss.backward()
        assert_rel_close(loss, fn(*(a.detach() for a in args)), 1e-6, name=f"loss T={length}")
        # The first compile may count twice: Dynamo restarts once to specialise the float default
        # dropout_p=0.0 it first traced as symbolic. Later lengths must add nothing.
        frames_after_first = frames_after_first or counter.frame_count
    assert counter.frame_count == frames_after_first, f"recompiled: {counter.frame_count} frames"


def test_compile_does_not_graph_break_in_a_model_like_block():
    # q/k/v from projections, HF layout and reshape: the op must stay one node in one graph.
    torch.manual_seed(0)
    proj = torch.nn.Linear(32, 3 * 32).double()

    def block(x):
        b, t, _ = x.shape
        q, k, v = proj(x).view(b, t, 3, 4, 8).unbind(2)
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2).reshape(b, t, 32)

    explanation = torch._dynamo.explain(block)(torch.randn(2, 6, 32, dtype=torch.float64))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
