"""CUDA-only checks of the MLA op at the real model sizes (R 512, Dn 128, Dr 64, Dv 128): the Triton
absorbed path against the float64 expansion oracle, no fallback on the fast path, opcheck, Inductor.

Tolerances (relative RMS error): float32 1e-4 (the absorption matmuls may use TF32 if enabled
globally; the kernel itself does not), float16 5e-3, bfloat16 2e-2.
"""
import pytest
import torch

from kda_compile.ops._common import clear_fallback_events, fallback_events
from kda_compile.ops.mla import explain_mla_path, mla_attention
from kda_compile.testing import assert_rel_close

from .naive import Case, make_inputs, naive_mla

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU box)")]
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def model_case(b, h, sq, t, **kw):
    return Case(b=b, h=h, sq=sq, t=t, dn=128, dr=64, dv=128, r=512, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", [
    model_case(4, 32, 1, 1000, mask="padding"),  # Kimi-Linear decode, batched with left padding
    model_case(2, 128, 1, 4097),  # DeepSeek-V3 heads, a cache one past a tile boundary
    model_case(3, 64, 4, 777, causal=True, mask="padding"),  # speculative verification
    model_case(1, 16, 1, 1),
])
def test_absorbed_triton_matches_oracle(case, dtype):
    args, kwargs = make_inputs(case, dtype, "cuda")
    assert explain_mla_path(*args, is_causal=case.causal)[0] == "absorbed"
    clear_fallback_events()
    out = mla_attention(*args, **kwargs)
    torch.cuda.synchronize()
    assert not fallback_events(), f"the fast path must not fall back: {fallback_events()}"
    assert_rel_close(out, naive_mla(*args, **kwargs), TOL[dtype], name="out")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_expanded_matches_oracle_and_trains(dtype):
    case = model_case(1, 8, 600, 600, causal=True)  # well past the crossover (fp32 moves it to ~560)
    args, kwargs = make_inputs(case, dtype, "cuda", requires_grad=True)
    assert explain_mla_path(*args, is_causal=True)[0] == "expanded"
    out = mla_attention(*args, **kwargs)
    leaves = [a.detach().double().requires_grad_(True) for a in args]
    ref = naive_mla(*leaves, **kwargs)
    assert_rel_close(out, ref, TOL[dtype], name="out")
    g = torch.randn_like(ref)
    out.backward(g.to(dtype))
    ref.backward(g)
    for name, a, leaf in zip(("dq_nope", "dq_rope", "dkv_latent", "dk_rope", "dkv_b_weight"), args, leaves):
        assert_rel_close(a.grad, leaf.grad, 2 * TOL[dtype], name=name)


def test_opcheck_cuda():
    for case in (model_case(2, 16, 1, 70, mask="padding"), Case(b=2, h=3, sq=6, t=6, causal=True)):
        args, kwargs = make_inputs(case, torch.float32, "cuda", requires_grad=True)
        q_nope, q_rope, kv_latent, k_rope, w = args
        kv_latent, k_rope = (t[:, 0].detach().requires_grad_(True) for t in (kv_latent, k_rope))
        torch.library.opcheck(torch.ops.kda_compile.mla_attention_fwd.default,
                              (q_nope, q_rope, kv_latent, k_rope, w, kwargs["attn_mask"], kwargs["scale"],
                               kwargs["is_causal"], "auto"))


def test_inductor_decode_step():
    torch._dynamo.reset()
    args, kwargs = make_inputs(model_case(8, 32, 1, 513, mask="padding"), torch.bfloat16, "cuda")

    def layer(q_nope, q_rope, kv_latent, k_rope, w, attn_mask):
        out = mla_attention(q_nope, q_rope, kv_latent, k_rope, w, scale=kwargs["scale"], attn_mask=attn_mask)
        return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)

    got = torch.compile(layer, fullgraph=True)(*args, kwargs["attn_mask"])
    assert_rel_close(got, layer(*args, kwargs["attn_mask"]), 1e-3, name="inductor vs eager")
