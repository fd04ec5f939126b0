"""The DSA kernels on CUDA at model widths (bf16 / fp16 / fp32) against the blockwise reference: the
indexer's selection, the sparse attention forward (absorbed 576 / 512 and expanded GQA) and backward,
and the public ops under torch.compile. Run on the GPU box."""
import pytest
import torch

from kda_compile.ops import dsa_indexer_topk, dsa_sparse_attention
from kda_compile.ops._common import clear_fallback_events, fallback_events
from kda_compile.ops.dsa.reference import (
    indexer_topk_reference,
    sparse_attention_backward_reference,
    sparse_attention_reference,
)
from kda_compile.testing import assert_rel_close

pytestmark = pytest.mark.cuda


def _no_fallback():
    events = {e: n for e, n in fallback_events().items() if e.op.startswith("dsa_")}
    assert events == {}, events


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mode", ["causal-cache", "padding", "packed", "decode"])
def test_indexer_exact_on_quantised_scores(dtype, mode):
    """Small-integer inputs make every fp32 score exact: the kernel's selection must equal the reference's."""
    clear_fallback_events()
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, s, t, heads, dim, topk = (2, 300, 700, 8, 128, 64) if mode != "decode" else (8, 1, 3000, 8, 128, 512)
    cu = key_mask = None
    if mode == "packed":
        b, t, cu = 1, s, torch.tensor([0, 17, 17, 150, 300], device="cuda", dtype=torch.int32)
    if mode == "padding":
        key_mask = torch.rand(b, t, device="cuda", generator=gen) > 0.2
    q = torch.randint(-2, 3, (b, s, heads, dim), device="cuda", generator=gen).to(dtype)
    k = torch.randint(-2, 3, (b, t, dim), device="cuda", generator=gen).to(dtype)
    w = torch.randint(-2, 3, (b, s, heads), device="cuda", generator=gen).float() / 4
    got = dsa_indexer_topk(q, k, w, topk, scale=0.5, key_mask=key_mask, cu_seqlens=cu)
    want = indexer_topk_reference(q, k, w, key_mask, cu, topk, 0.5, True)
    assert torch.equal(got, want)
    _no_fallback()


def test_indexer_deepseek_widths_true_topk():
    """64 heads x 128, top-k 2048, bf16 random inputs: the kernel's keys score (in fp64) at least as well
    as any key left out, up to fp32 rounding."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    b, s, t, heads, dim, topk = 1, 256, 4096, 64, 128, 2048
    q = torch.randn(b, s, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(b, t, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(b, s, heads, device="cuda", generator=gen) * heads ** -0.5
    idx = dsa_indexer_topk(q, k, w, topk, scale=dim ** -0.5)
    scores = torch.einsum("bshd,btd->bsht", q.double(), k.double()).mul(dim ** -0.5).relu()
    scores = (scores * w.double()[..., None]).sum(2)
    pos = torch.arange(s, device="cuda")[:, None] + t - s
    visible = torch.arange(t, device="cuda")[None, :] <= pos
    chosen = torch.zeros_like(visible[None]).expand(b, s, t).clone()
    valid = idx >= 0
    bi, si, ji = valid.nonzero(as_tuple=True)
    chosen[bi, si, idx[bi, si, ji].long()] = True
    assert (chosen <= visible).all() and (valid.sum(-1) == visible.sum(-1).clamp_max(topk)).all()
    worst = scores.masked_fill(~chosen, float("inf")).amin(-1)
    best_left = scores.masked_fill(chosen | ~visible, float("-inf")).amax(-1)
    slack = 1e-5 * scores.abs().amax(-1)
    assert (best_left <= worst + slack).all()


def _indices(b, s, t, topk, gen):
    """Unique keys per row (a random permutation's head), with -1 tails of random length."""
    idx = torch.rand(b, s, t, device="cuda", generator=gen).argsort(-1)[..., :topk].to(torch.int32)
    keep = torch.rand(b, s, 1, device="cuda", generator=gen) * topk
    idx = torch.where(torch.arange(topk, device="cuda") < keep.ceil(), idx, -1)
    idx[:, 0] = -1  # rows with no key at all
    return idx


CASES = {
    "deepseek-absorbed": dict(hq=128, hkv=1, dqk=576, dv=512, absorbed=True, topk=2048, t=4096),
    "glm-expanded": dict(hq=16, hkv=16, dqk=256, dv=256, absorbed=False, topk=512, t=1024),
    "gqa-odd": dict(hq=24, hkv=4, dqk=192, dv=128, absorbed=False, topk=100, t=300),
    "absorbed-split-value": dict(hq=32, hkv=1, dqk=320, dv=192, absorbed=True, topk=64, t=200),
}


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("name", list(CASES))
def test_sparse_attention_forward_backward(name, dtype, tol):
    clear_fallback_events()
    c = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(2)
    b, s = 2, 48
    q = torch.randn(b, s, c["hq"], c["dqk"], device="cuda", generator=gen).to(dtype)
    k = torch.randn(b, c["t"], c["hkv"], c["dqk"], device="cuda", generator=gen).to(dtype)
    v = None if c["absorbed"] else torch.randn(b, c["t"], c["hkv"], c["dv"], device="cuda", generator=gen).to(dtype)
    idx = _indices(b, s, c["t"], c["topk"], gen)
    leaves = [x.requires_grad_(True) for x in (q, k, v) if x is not None]
    o, lse = dsa_sparse_attention(q, k, v, idx, d_v=c["dv"] if c["absorbed"] else None)
    o_ref, lse_ref = sparse_attention_reference(q.float(), k.float(), None if v is None else v.float(), idx,
                                                c["dqk"] ** -0.5, c["dv"])
    assert_rel_close(o, o_ref, tol, name="o")
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite)
    assert_rel_close(lse[finite], lse_ref[finite], 1e-3 if dtype != torch.float32 else 1e-6, name="lse")
    g_o = torch.randn(o.shape, device="cuda", generator=gen).to(dtype)
    g_l = torch.randn(lse.shape, device="cuda", generator=gen)
    grads = torch.autograd.grad((o * g_o).sum() + (lse.masked_fill(~finite, 0) * g_l).sum(), leaves)
    refs = sparse_attention_backward_reference(g_o.float(), g_l, q.detach().float(), k.detach().float(),
                                               None if v is None else v.detach().float(), idx, c["dqk"] ** -0.5,
                                               c["dv"])
    for n, g, r in zip("qkv", grads, refs):
        assert_rel_close(g, r, tol * 2, name=f"d{n}")
    _no_fallback()


def test_compile_fullgraph_dynamic_on_cuda():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")

    def layer(qi, ki, w, q, kv):
        idx = dsa_indexer_topk(qi, ki, w, 64, scale=0.1)
        return dsa_sparse_attention(q, kv, None, idx, d_v=512)[0]

    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for s in (77, 130):
        args = (torch.randn(1, s, 8, 64, device="cuda", dtype=torch.bfloat16),
                torch.randn(1, s, 64, device="cuda", dtype=torch.bfloat16),
                torch.rand(1, s, 8, device="cuda"),
                torch.randn(1, s, 16, 576, device="cuda", dtype=torch.bfloat16),
                torch.randn(1, s, 1, 576, device="cuda", dtype=torch.bfloat16))
        assert_rel_close(compiled(*args), layer(*args), 1e-6, name="compiled vs eager")
    assert counter.frame_count == 1
