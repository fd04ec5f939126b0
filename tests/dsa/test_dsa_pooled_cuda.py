"""glm5_next's pooled indexer on CUDA at its config widths (32 heads x 128, pools of 16, top-k 2048; bf16 /
fp16 / fp32): the op's Triton kernels against its torch path on the same GPU. Quantised inputs (exact fp32
scores) must give the same selection index for index; random bf16 inputs a true top-k; a decode call captured
in a CUDA graph replays new inputs. Run on the GPU box."""
import pytest
import torch

from kda_compile.ops import dsa_pooled_indexer_topk
from kda_compile.ops._common import clear_fallback_events, fallback_events
from kda_compile.ops.dsa.pooled.reference import pooled_indexer_topk_reference

from .pooled_naive import assert_true_pooled_topk, quantised_pooled_inputs

pytestmark = pytest.mark.cuda

# Glm5NextTextConfig's index_n_heads, index_head_dim, index_kpool, index_topk
HEADS, DIM, POOL, TOPK = 32, 128, 16, 2048


def _no_fallback():
    events = {e: n for e, n in fallback_events().items() if e.op.startswith("dsa_")}
    assert events == {}, events


def _op(a, topk=TOPK, tail=True, scale=0.5):
    return dsa_pooled_indexer_topk(a["q"], a["k"], a["weights"], a["gate"], a["ape"], topk, scale=scale,
                                   key_valid=a["key_valid"], query_mask=a["query_mask"], q_offset=a["q_offset"],
                                   select_tail=tail)


def _reference(a, topk=TOPK, tail=True, scale=0.5):
    return pooled_indexer_topk_reference(a["q"], a["k"], a["gate"], a["weights"], a["key_valid"], a["ape"],
                                         a["query_mask"], topk, scale, a["q_offset"], tail)


MODES = {  # (B, S, T, filled length or None, pool, topk, tail)
    "prefill-padding": (2, 3000, 3000, None, POOL, TOPK, True),   # left padding in row 1; top-k > early rows' pools
    "chunk-cache": (2, 300, 5000, None, POOL, TOPK, True),        # a chunk over a cache (query offset)
    "static-cache": (2, 64, 6000, 4500, POOL, TOPK, True),        # unfilled slots past the filled length
    "decode": (8, 1, 20000, None, POOL, TOPK, True),              # S = 1, heads-as-rows kernel
    "decode-short": (4, 7, 4000, None, POOL, TOPK, False),        # a short chunk, the tail off
    "pool4-tail-off": (2, 1000, 1000, None, 4, 512, False),
    "pool8-over-topk": (3, 500, 700, None, 8, 4096, True),        # top-k above every visible pool count
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("mode", list(MODES))
def test_pooled_exact_on_quantised_scores(mode, dtype):
    clear_fallback_events()
    b, s, t, length, pool, topk, tail = MODES[mode]
    a = quantised_pooled_inputs(b, s, t, HEADS, DIM, pool, device="cuda", dtype=dtype, seed=len(mode), length=length)
    got = _op(a, topk, tail)
    want = _reference(a, topk, tail)
    assert got.shape == want.shape and got.dtype == torch.int32
    assert torch.equal(got, want)
    _no_fallback()


def test_pooled_small_blocks_merge_the_same(monkeypatch):
    """Pool blocks of 100 and query blocks of one row tile on the GPU: the running top-k gives the same answer."""
    import kda_compile.ops.dsa.pooled.triton_indexer as triton_pooled

    a = quantised_pooled_inputs(2, 700, 4000, HEADS, DIM, POOL, device="cuda", dtype=torch.bfloat16, seed=9)
    whole = _op(a)
    monkeypatch.setattr(triton_pooled, "POOL_BLOCK", 100)
    monkeypatch.setattr(triton_pooled, "KEY_BUFFER_BYTES", 1)
    assert torch.equal(_op(a), whole)
    assert torch.equal(whole, _reference(a))


@pytest.mark.parametrize("b,s,t", [(1, 8192, 8192), (16, 1, 32768)])
def test_pooled_glm5_next_widths_true_topk(b, s, t):
    """Random bf16 inputs at glm5_next's widths: rounding may order near-equal pools differently from the torch
    path; the kernel's pools are still a true top-k in score order."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    a = quantised_pooled_inputs(b, s, t, HEADS, DIM, POOL, device="cuda", dtype=torch.bfloat16, seed=3)
    a["q"] = torch.randn(a["q"].shape, device="cuda", generator=gen).to(torch.bfloat16)
    a["k"] = torch.randn(a["k"].shape, device="cuda", generator=gen).to(torch.bfloat16)
    a["weights"] = torch.randn(a["weights"].shape, device="cuda", generator=gen) * HEADS ** -0.5
    a["gate"] = torch.randn(a["gate"].shape, device="cuda", generator=gen).to(torch.bfloat16)
    a["ape"] = torch.randn(a["ape"].shape, device="cuda", generator=gen)
    got = _op(a, scale=DIM ** -0.5)
    want = _reference(a, scale=DIM ** -0.5)
    assert_true_pooled_topk(got, want, a, TOPK, DIM ** -0.5)


def test_pooled_compile_fullgraph_dynamic_on_cuda():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")

    def layer(q, k, weights, gate, ape, key_valid, query_mask):
        idx = dsa_pooled_indexer_topk(q, k, weights, gate, ape, 256, scale=0.5, key_valid=key_valid,
                                      query_mask=query_mask)
        return idx.long().clamp_min(0).sum(-1)

    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for s, t in ((77, 300), (130, 515)):
        a = quantised_pooled_inputs(2, s, t, 8, 64, POOL, device="cuda", dtype=torch.bfloat16, seed=s)
        args = (a["q"], a["k"], a["weights"], a["gate"], a["ape"], a["key_valid"], a["query_mask"])
        assert torch.equal(compiled(*args), layer(*args))
    assert counter.frame_count == 1


@pytest.mark.parametrize("s", [1, 4])
def test_pooled_decode_captured_in_a_cuda_graph(s):
    """A decode call (S = 1, and a short chunk; the heads kernel) captured in a CUDA graph: no host read in the
    op, so the capture succeeds, and replays after new inputs are copied into the captured tensors give the
    eager selection of those inputs, also where fewer pools are kept (unfilled cache slots: HF's tail moves
    from slot 93 to slot 62 on the device)."""
    clear_fallback_events()
    t, length = 4000, 1500
    a = quantised_pooled_inputs(4, s, t, HEADS, DIM, POOL, device="cuda", dtype=torch.bfloat16, seed=21,
                                length=length)
    fresh = quantised_pooled_inputs(4, s, t, HEADS, DIM, POOL, device="cuda", dtype=torch.bfloat16, seed=22,
                                    length=length)
    fresh["key_valid"][:, 1000:length - s] = False  # the queries see keys < 1000 and themselves: 62 pools kept
    static = {n: (v.clone() if torch.is_tensor(v) else v) for n, v in a.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiles the kernels, warms the allocator
        for _ in range(2):
            _op(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _op(static)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, _op(a)) and torch.equal(captured, _reference(a))
    for name, v in fresh.items():
        if torch.is_tensor(v):
            static[name].copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    want = _reference(fresh)
    assert torch.equal(captured, _op(fresh)) and torch.equal(captured, want)
    assert bool((want[..., 62 * POOL:63 * POOL - 1] >= 0).any())  # the tail right after the 62 kept pools
    _no_fallback()


def test_pooled_opcheck_on_cuda():
    """The CUDA implementation against the op's schema and fake tensor (non-contiguous q)."""
    a = quantised_pooled_inputs(2, 40, 100, 4, 32, 4, device="cuda", dtype=torch.bfloat16, seed=8)
    q = a["q"].transpose(1, 2).contiguous().transpose(1, 2)
    torch.library.opcheck(torch.ops.kda_compile.dsa_pooled_indexer_topk.default,
                          (q, a["k"], a["gate"], a["weights"], a["key_valid"], a["ape"], a["query_mask"], 16, 0.5,
                           a["q_offset"], True))
