"""``torch.library.opcheck`` on the DSA ops (contiguous and non-contiguous inputs), and the public functions
under ``torch.compile(fullgraph=True, dynamic=True)``: no graph break, one graph across S / T, gradients
through the compiled graph."""
import pytest
import torch

from kda_compile.ops import dsa_indexer_topk, dsa_sparse_attention
from kda_compile.testing import DSAAttentionCase, DSAIndexerCase, assert_rel_close, make_dsa_attention_args
from kda_compile.testing import make_dsa_indexer_args

INDEXER_CASES = {
    "causal-cache-padding": DSAIndexerCase(b=2, s=5, t=9, topk=4, padding=True),
    "packed-topk-above-t": DSAIndexerCase(b=1, s=7, t=7, topk=9, seq_lens=(3, 0, 4), quantised=True),
}


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("name", list(INDEXER_CASES))
def test_opcheck_indexer(name, transposed, device):
    args = make_dsa_indexer_args(INDEXER_CASES[name], torch.float32, device, seed=1)
    q, k, w = args["q"], args["k"], args["weights"]
    if transposed:  # non-contiguous views with the same values
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
        k = k.transpose(0, 1).contiguous().transpose(0, 1)
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    torch.library.opcheck(torch.ops.kda_compile.dsa_indexer_topk.default,
                          (q, k, w, args["key_mask"], args["cu_seqlens"], args["topk"], args["scale"],
                           args["is_causal"]))


ATTENTION_CASES = {
    "absorbed": DSAAttentionCase(b=2, s=3, t=7, hq=4, dqk=12, dv=8, topk=5, absorbed=True),
    "gqa-transposed": DSAAttentionCase(b=2, s=3, t=7, hq=4, hkv=2, dqk=12, dv=6, topk=9, absorbed=False,
                                       transposed=True),
}


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_opcheck_sparse_attention(name, device):
    case = ATTENTION_CASES[name]
    args = make_dsa_attention_args(case, torch.float64, device, seed=2, requires_grad=True)
    torch.library.opcheck(torch.ops.kda_compile.dsa_sparse_attention_fwd.default,
                          (args["q"], args["k"], args["v"], args["indices"], 0.4, case.dv))
    b, s, hq = case.b, case.s, case.hq
    grad_o = torch.randn(s, b, hq, case.dv, dtype=torch.float64, device=device).transpose(0, 1)
    grad_lse = torch.randn(b, s, hq, device=device)
    with torch.no_grad():
        o, lse = torch.ops.kda_compile.dsa_sparse_attention_fwd(args["q"], args["k"], args["v"], args["indices"],
                                                                0.4, case.dv)
    plain = [x.detach() if x is not None else None for x in (args["q"], args["k"], args["v"])]
    torch.library.opcheck(torch.ops.kda_compile.dsa_sparse_attention_bwd.default,
                          (grad_o, grad_lse, *plain, args["indices"], o, lse, 0.4, case.dv))


def _layer(qi, ki, w, q, kv):
    idx = dsa_indexer_topk(qi, ki, w, 6, scale=0.5, is_causal=True)
    o, lse = dsa_sparse_attention(q, kv, None, idx, d_v=8)
    return o.flatten(2) * lse.exp().sum(-1, keepdim=True)


def _inputs(s, t, seed, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q, kv = make(1, s, 4, 12), make(1, t, 1, 12)
    if requires_grad:
        q.requires_grad_(True), kv.requires_grad_(True)
    return make(1, s, 3, 8).float(), make(1, t, 8).float(), make(1, s, 3).float(), q, kv


def test_compile_fullgraph_dynamic_one_graph_and_gradients():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_layer, backend=counter, fullgraph=True, dynamic=True)
    for i, (s, t) in enumerate([(5, 11), (9, 23), (3, 30)]):  # prefill-like and chunk-against-cache shapes
        args = _inputs(s, t, i, requires_grad=True)
        got = compiled(*args)
        ref_args = [x.detach().clone().requires_grad_(x.requires_grad) for x in args]
        want = _layer(*ref_args)
        assert_rel_close(got, want, 1e-12, name="compiled vs eager")
        got.sum().backward()
        want.sum().backward()
        for a, r in zip(args[3:], ref_args[3:]):
            assert_rel_close(a.grad, r.grad, 1e-12, name="gradient through the compiled graph")
    assert counter.frame_count == 1, "dynamic S / T must not recompile"


def test_graph_holds_the_ops():
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(_layer, backend=capture, fullgraph=True)(*_inputs(4, 6, 0))
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("dsa_indexer_topk" in t for t in targets) and any("dsa_sparse_attention_fwd" in t for t in targets)
