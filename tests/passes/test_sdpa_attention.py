"""The SDPA-attention rewrite: torch's ``scaled_dot_product_attention`` calls (Hugging Face's default
``"sdpa"`` attention) become ``kda_compile.ops.attention`` (cheap: aot_eager, tiny models).

Tiny Llama / Qwen3 / Gemma3 loaded with ``attn_implementation="sdpa"`` (or unset): every attention
layer rewritten, repeat_kv gone, the padding mask read into flags, logits within 1e-4 of the eager
model (fp32), no graph break (fullgraph), no recompile for a second prompt length under
dynamic=True; gradients and greedy generate() match. Hand-written calls check enable_gqa, a mask
the reader does not understand, and the calls left alone with their reason.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

import kda_compile
from kda_compile.config import Config

from .families import FAMILIES, VOCAB
from .graph_capture import GraphCapture

SDPA_TARGETS = (F.scaled_dot_product_attention,)
TOL = 1e-4


@pytest.fixture(autouse=True)
def constant_float_attributes():
    """Float module attributes as constants (as in test_hf_families.py): halves Dynamo's tracing."""
    with torch._dynamo.config.patch(specialize_float=True):
        yield


def sdpa_model(name: str, attn_implementation: str | None = "sdpa", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = FAMILIES[name].make_config()
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = transformers.AutoModelForCausalLM.from_config(cfg, **kwargs).eval()
    assert model.config._attn_implementation == "sdpa"
    return model


def prompt(length: int, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask with the first sequence left-padded by 2."""
    ids = torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return ids, mask


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all(), "NaN or inf in the compiled result"
    return float((a.double() - b.double()).abs().max())


def rewritten_sites(cap: GraphCapture, graph: int = -1) -> int:
    report = cap.reports[graph]
    return sum(1 for r in report.rewritten if r.rewrite == "sdpa_attention")


@pytest.mark.parametrize("name, impl", [("llama", None), ("qwen3", "sdpa"), ("gemma3", "sdpa")])
def test_hf_sdpa_models_are_rewritten(name, impl):
    model = sdpa_model(name, impl)
    layers = FAMILIES[name].attention_layers
    cap = GraphCapture()
    compiled = torch.compile(model, backend=cap, dynamic=True, fullgraph=True)
    for length in (7, 10):  # the second length reuses the graph
        ids, mask = prompt(length, seed=length)
        with torch.no_grad():
            expected, got = model(ids, attention_mask=mask).logits, compiled(ids, attention_mask=mask).logits
        assert max_err(got, expected) < TOL
    assert cap.graphs == 1, [r.summary() for r in cap.reports]
    report = cap.reports[-1]
    assert rewritten_sites(cap) == layers and not report.left_alone, report.summary()
    assert cap.attention_calls() == layers and cap.after[-1].count(*SDPA_TARGETS) == 0, cap.after[-1].code
    assert cap.repeat_kv_expands() == 0
    for entry in report.rewritten:
        assert entry.details["is_causal"] is True and entry.details["heads"] == "4/2"
        assert entry.details["mask"] == "key padding [B, 1, 1, Sk]", report.summary()
    if name == "gemma3":  # layer 0 slides, layer 1 attends fully
        assert [e.details.get("sliding_window") for e in report.rewritten] == [5, None]


def test_optimize_reports_every_site_without_a_mask():
    model = sdpa_model("gemma3", None)
    compiled = kda_compile.optimize(model, config=Config(compiler="aot_eager"), fullgraph=True)
    ids, _ = prompt(8)
    with torch.no_grad():
        assert max_err(compiled(ids).logits, model(ids).logits) < TOL
    (graph,) = kda_compile.report(compiled).graphs
    assert [e.site for e in graph.rewritten] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(e.rewrite == "sdpa_attention" and e.details["is_causal"] is True for e in graph.rewritten)
    assert "2 site(s) rewritten, 0 candidate(s) left alone" in str(kda_compile.report(compiled))


def test_gradients_match():
    model = sdpa_model("llama").train()
    ids, mask = prompt(7)
    cap = GraphCapture()
    compiled = torch.compile(model, backend=cap, fullgraph=True)
    model(ids, attention_mask=mask, labels=ids).loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compiled(ids, attention_mask=mask, labels=ids).loss.backward()
    assert rewritten_sites(cap) == 1, cap.reports[-1].summary()
    for n, p in model.named_parameters():
        assert max_err(p.grad, expected[n]) < TOL, n


def test_generate_tokens_match():
    model = sdpa_model("qwen3")
    ids, mask = prompt(6)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    expected = model.generate(ids, **kwargs)
    model.forward = kda_compile.optimize(model.forward, Config(compiler="aot_eager"), dynamic=True)
    try:
        got = model.generate(ids, **kwargs)
        graphs = kda_compile.report(model).graphs
    finally:
        del model.forward
    assert torch.equal(got, expected)
    assert graphs and all(len(g.rewritten) == 1 and not g.left_alone for g in graphs), \
        [str(g.summary()) for g in graphs]


def test_config_switches_the_rewrite_off():
    model = sdpa_model("llama")
    cap = GraphCapture(config=Config(compiler="aot_eager", sdpa_attention=False))
    with torch.no_grad():
        torch.compile(model, backend=cap, fullgraph=True)(prompt(5)[0])
    assert not cap.reports[-1].rewritten and not cap.reports[-1].left_alone
    assert cap.attention_calls() == 0 and cap.after[-1].count(*SDPA_TARGETS) == 1


# ----------------------------------------------------------------------------------------------
# Hand-written calls
# ----------------------------------------------------------------------------------------------
B, H, HKV, D = 2, 4, 2, 8


def qkv(sq: int, sk: int, hkv: int = HKV, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, sq, D, generator=g), torch.randn(B, hkv, sk, D, generator=g),
            torch.randn(B, hkv, sk, D, generator=g))


def run(fn, *args):
    cap = GraphCapture()
    got = torch.compile(fn, backend=cap, fullgraph=True)(*args)
    return cap, got, fn(*args)


def test_enable_gqa_and_a_mask_tensor():
    def fn(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True).transpose(1, 2).contiguous()

    q, k, v = qkv(5, 7)
    m = torch.rand(B, 1, 5, 7, generator=torch.Generator().manual_seed(1)) > 0.3
    m[..., 0] = True
    cap, got, expected = run(fn, q, k, v, m)
    assert max_err(got, expected) < TOL
    (entry,) = cap.reports[-1].rewritten
    assert entry.details["heads"] == "4/2" and entry.details["mask"].startswith("tensor")
    assert cap.after[-1].attention_kwargs[0]["attn_mask"] == "l_m_"


@pytest.mark.parametrize("fn, reason", [
    (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
     "aligns the diagonal top-left"),
    (lambda q, k, v: F.scaled_dot_product_attention(q, k[:1], v[:1], enable_gqa=True),
     "shapes do not pair up"),
])
def test_left_alone_with_reason(fn, reason):
    cap, got, expected = run(fn, *qkv(3, 7))
    assert max_err(got, expected) < TOL
    (left,) = cap.reports[-1].left_alone
    assert left.rewrite == "sdpa_attention" and reason in left.reason, left.reason
    assert not cap.reports[-1].rewritten and cap.attention_calls() == 0


def test_one_key_head_broadcast_over_the_query_heads_is_multi_query_attention():
    """SDPA broadcasts its head dim: keys and values [B, 1, T, D] under 4 query heads with enable_gqa=False (what
    Falcon's multi_query attention passes) are grouped-query attention with one group."""
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k[:, :1], v[:, :1], is_causal=True).transpose(1, 2).contiguous()

    cap, got, expected = run(fn, *qkv(5, 5))
    assert max_err(got, expected) < TOL
    (entry,) = cap.reports[-1].rewritten
    assert entry.details["heads"].endswith("/1") and cap.attention_calls() == 1


def test_falcon_multi_query_sdpa_is_rewritten():
    config = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       multi_query=True, new_decoder_architecture=False, alibi=False)
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    fast = kda_compile.optimize(model, Config(compiler="aot_eager"))
    with torch.no_grad():
        got, want = fast(ids).logits, model(ids).logits
    assert max_err(got, want) < TOL
    report = kda_compile.report(fast)
    assert len(report.rewritten) == 2 and not report.left_alone, str(report)
    assert all(r.details["heads"] == "4/1" for r in report.rewritten)
