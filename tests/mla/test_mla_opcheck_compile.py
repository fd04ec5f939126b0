"""``torch.library.opcheck`` on the MLA ops (contiguous and Hugging Face's non-contiguous views),
and the public function under ``torch.compile``: no graph break, one dynamic graph for decode and
prefill, gradients through the compiled graph, the Inductor backend on CPU."""
import pytest
import torch

from kda_compile.ops.mla import explain_mla_path, mla_attention
from kda_compile.testing import assert_rel_close

from .naive import Case, make_inputs

OPCHECK_CASES = {
    "decode-padding-contiguous": Case(b=2, t=9, mask="padding", hf_layout=False),
    "decode-hf-views": Case(b=2, t=9, mask="padding", hf_layout=True, transposed_weight=True),
    "chunk-causal-bool": Case(sq=3, t=8, causal=True, mask="bool", dead_rows=True),
    "prefill-causal-hf-views": Case(sq=6, t=6, causal=True, transposed_weight=True),
}


def _op_args(case, dtype, device, path, requires_grad):
    args, kwargs = make_inputs(case, dtype, device, requires_grad=requires_grad)
    q_nope, q_rope, kv_latent, k_rope, w = args
    # The op takes the 3-D latent: the public function squeezes HF's [B, 1, T, D] into a strided view.
    if kv_latent.dim() == 4:  # strided views, made leaves again
        kv_latent, k_rope = (t[:, 0].detach().requires_grad_(requires_grad) for t in (kv_latent, k_rope))
    return (q_nope, q_rope, kv_latent, k_rope, w, kwargs["attn_mask"], kwargs["scale"], kwargs["is_causal"], path)


@pytest.mark.parametrize("path", ["absorbed", "expanded", "auto"])
@pytest.mark.parametrize("name", list(OPCHECK_CASES))
def test_opcheck_forward(name, path, device):
    args = _op_args(OPCHECK_CASES[name], torch.float64, device, path, requires_grad=True)
    torch.library.opcheck(torch.ops.kda_compile.mla_attention_fwd.default, args)


@pytest.mark.parametrize("path", ["absorbed", "expanded"])
def test_opcheck_forward_float_mask_grad(path, device):
    q_nope, q_rope, kv_latent, k_rope, w, mask, scale, causal, _ = _op_args(
        Case(sq=2, t=5, causal=True, mask="float", hf_layout=False), torch.float64, device, path, True)
    mask = mask.detach().requires_grad_(True)
    torch.library.opcheck(torch.ops.kda_compile.mla_attention_fwd.default,
                          (q_nope, q_rope, kv_latent, k_rope, w, mask, scale, causal, path))


@pytest.mark.parametrize("name", ["decode-hf-views", "prefill-causal-hf-views"])
def test_opcheck_backward(name, device):
    q_nope, q_rope, kv_latent, k_rope, w, mask, scale, causal, path = _op_args(
        OPCHECK_CASES[name], torch.float64, device, "auto", requires_grad=False)
    b, h, sq, _ = q_nope.shape
    dv = w.shape[0] // h - q_nope.shape[3]
    grad_out = torch.randn(b, sq, h, dv, dtype=torch.float64, device=device).transpose(1, 2)
    torch.library.opcheck(torch.ops.kda_compile.mla_attention_bwd.default,
                          (grad_out, q_nope, q_rope, kv_latent, k_rope, w, mask, scale, causal, path, False))


def _calls(sizes):
    """Inputs of one layer at several (Sq, T); sizes avoid the other dims' values (Dynamo's duck
    sizing would otherwise tie their symbols together)."""
    return [make_inputs(Case(b=2, sq=sq, t=t, causal=True, mask="padding", hf_layout=False), torch.float32, seed=i)
            for i, (sq, t) in enumerate(sizes)]


def test_compile_fullgraph_dynamic_one_graph():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()

    def layer(q_nope, q_rope, kv_latent, k_rope, w, attn_mask, scale, is_causal):
        out = mla_attention(q_nope, q_rope, kv_latent, k_rope, w, scale=scale, attn_mask=attn_mask,
                            is_causal=is_causal)
        b, h, sq, dv = out.shape
        return out.transpose(1, 2).reshape(b, sq, h * dv)

    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    # A chunk against a cache (absorbed), a prefill (expanded), another chunk: the form is chosen
    # inside the op at run time, so no guard on the sizes and no recompile.
    forms = []
    for args, kwargs in _calls([(5, 19), (1024, 1024), (7, 29)]):
        forms.append(explain_mla_path(*args, is_causal=True)[0])
        got = compiled(*args, kwargs["attn_mask"], kwargs["scale"], kwargs["is_causal"])
        want = layer(*args, kwargs["attn_mask"], kwargs["scale"], kwargs["is_causal"])
        assert_rel_close(got, want, 1e-6, name="compiled vs eager")
    assert forms == ["absorbed", "expanded", "absorbed"]
    assert counter.frame_count == 1, "the op must not force a recompile between prefill and chunk shapes"


def test_compile_graph_holds_the_op_and_trains():
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def layer(q_nope, q_rope, kv_latent, k_rope, w, attn_mask):
        return mla_attention(q_nope, q_rope, kv_latent, k_rope, w, scale=0.3, attn_mask=attn_mask, is_causal=True)

    args, kwargs = make_inputs(Case(sq=4, t=9, causal=True, mask="padding"), torch.float64, requires_grad=True)
    torch.compile(layer, backend=capture, fullgraph=True)(*args, kwargs["attn_mask"])
    targets = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    op = torch.ops.kda_compile.mla_attention_fwd
    assert op in targets or op.default in targets, targets
    assert not any("matmul" in str(t) or "softmax" in str(t) for t in targets), "nothing is expanded in the graph"
    # Training through AOTAutograd: the backward comes from the op's register_autograd.
    torch._dynamo.reset()
    out = torch.compile(layer, backend="aot_eager", fullgraph=True)(*args, kwargs["attn_mask"])
    out.sum().backward()
    ref_args = [a.detach().clone().requires_grad_(True) for a in args]
    layer(*ref_args, kwargs["attn_mask"]).sum().backward()
    for a, r in zip(args, ref_args):
        assert_rel_close(a.grad, r.grad, 1e-12, name="grad through the compiled graph")


@pytest.mark.slow
def test_inductor_cpu_decode_and_prefill():
    torch._dynamo.reset()

    def layer(q_nope, q_rope, kv_latent, k_rope, w, attn_mask, scale, is_causal):
        return mla_attention(q_nope, q_rope, kv_latent, k_rope, w, scale=scale, attn_mask=attn_mask,
                             is_causal=is_causal)

    compiled = torch.compile(layer, fullgraph=True)
    for args, kwargs in _calls([(1, 11), (5, 19), (1024, 1024)]):  # decode, chunk, prefill
        got = compiled(*args, kwargs["attn_mask"], kwargs["scale"], kwargs["is_causal"])
        want = layer(*args, kwargs["attn_mask"], kwargs["scale"], kwargs["is_causal"])
        assert got.stride() == want.stride()
        assert_rel_close(got, want, 1e-6, name="inductor vs eager")
