"""The MLA rewrite (passes/mla/absorb.py) on a small module written as Hugging Face writes MLA.

``TinyMLA`` is DeepseekV3Attention / KimiLinearAttention (transformers 5.15-5.23) cut to what the
rewrite reads: a latent cache and a rope-key cache given as inputs, ``expand_kv`` (new_empty +
copy_, or the older torch.cat), eager attention, the output reshape and o_proj. Checked: the
rewritten graph holds one ``mla_attention`` and no ``kv_b_proj``, copy_, softmax or attention op;
outputs match eager (fp32: relative error < 1e-5, gradients < 1e-4) with the ``softmax_attention``
rewrite on and off; the scale in the graph reaches the op unchanged; every unsupported variant is
left alone with its reason and still gives eager's result; the rewrite is idempotent.
Real models (DeepseekV3, DeepSeek-V2-Lite-like, KimiLinear, generate()): tests/models/test_mla_models.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_compile.config import Config
from kda_compile.ops.attention import attention
from kda_compile.ops.mla import mla_attention
from kda_compile.passes import PassManager
from kda_compile.testing import rel_error
from mla_capture import MLACapture, kv_b_linears

FP32_TOL, GRAD_TOL = 1e-5, 1e-4
YARN_LIKE_SCALE = 0.13523377  # not (Dn + Dr) ** -0.5: the rewrite must copy it, not recompute it


class TinyMLA(torch.nn.Module):
    """MLA as transformers 5.15+ write it, with switches for the variants the rewrite must handle
    (``keys_by``: "copy" (5.15+) or "cat" (<= 5.14); ``query``: "cat" (DeepSeek: q_pass and q_rot
    concatenated) or "view" (Kimi-Linear: never split)) and for variants it must leave alone."""

    def __init__(self, heads=3, nope=16, rope=8, value=12, rank=20, hidden=32, scaling=YARN_LIKE_SCALE,
                 keys_by="copy", query="cat", dropout=0.0, kv_b_bias=False, variant=None):
        super().__init__()
        self.h, self.dn, self.dr, self.dv, self.r = heads, nope, rope, value, rank
        self.scaling, self.keys_by, self.query, self.dropout, self.variant = scaling, keys_by, query, dropout, variant
        self.q_proj = torch.nn.Linear(hidden, heads * (nope + rope), bias=False)
        self.kv_a_proj_with_mqa = torch.nn.Linear(hidden, rank + rope, bias=False)
        self.kv_b_proj = torch.nn.Linear(rank, heads * (nope + value), bias=kv_b_bias)
        self.o_proj = torch.nn.Linear(heads * value, hidden, bias=False)
        self.sinks = torch.nn.Parameter(torch.randn(heads)) if variant == "sinks" else None  # hy_v4, gpt_oss

    def expand_kv(self, latent, k_rot):
        b, _, t, _ = latent.shape
        kv = self.kv_b_proj(latent).view(b, t, -1, self.dn + self.dv).transpose(1, 2)
        k_nope, value_states = torch.split(kv, [self.dn, self.dv], dim=-1)
        if self.variant != "rope_broadcast":
            k_rot = k_rot.expand(-1, k_nope.shape[1], -1, -1)
        if self.keys_by == "cat":
            return torch.cat((k_nope, k_rot), dim=-1), value_states
        key_states = kv.new_empty(*kv.shape[:-1], self.dn + self.dr)
        key_states[..., : self.dn].copy_(k_nope)
        key_states[..., self.dn:].copy_(k_rot)
        return key_states, value_states

    def forward(self, x, latent_cache, rope_cache, mask):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.dn + self.dr).transpose(1, 2)
        if self.query == "cat":
            q_pass, q_rot = torch.split(q, [self.dn, self.dr], dim=-1)
            q = torch.cat((q_pass, q_rot * 1.0), dim=-1)  # (rotary stands here in DeepSeek)
        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [self.r, self.dr], dim=-1)
        latent = torch.cat([latent_cache, latent.view(b, 1, s, self.r)], dim=-2)  # the cache update
        k_rot = torch.cat([rope_cache, k_rot.view(b, 1, s, self.dr)], dim=-2)
        key_states, value_states = self.expand_kv(latent, k_rot)
        extra = 0.0
        if self.variant == "mutation":  # a slice: q.mul_ of the whole fresh q is made out-of-place
            q[..., :1].mul_(1.0)        # (passes/attention/normalize.py), this one cannot be
        elif self.variant == "keys_used":
            extra = key_states.sum()
        elif self.variant == "values_used":
            extra = value_states.mean()
        out, weights = eager_attention(q, key_states, value_states, mask, self.scaling,
                                       self.dropout if self.training else 0.0, self.sinks)
        if self.variant == "weights_used":
            extra = weights.sum()
        return self.o_proj(out.reshape(b, s, -1)) + extra


def eager_attention(query, key, value, mask, scaling, dropout, sinks=None):
    """transformers' eager_attention_forward (num_key_value_groups 1); with ``sinks`` as gpt_oss /
    hy_v4 write it (a per-head logit joins each softmax row, then its column is dropped)."""
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if mask is not None:
        weights = weights + mask
    if sinks is not None:
        column = sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
        combined = torch.cat([weights, column], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        weights = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(query.dtype)
    else:
        weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=dropout > 0)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def inputs(module: TinyMLA, batch=2, queries=3, cached=4, masked=True, seed=0):
    """x [B, S, hidden], the caches [B, 1, T0, R] / [B, 1, T0, Dr], and an additive causal +
    padding mask [B, 1, S, T0 + S] (row 0 of batch 0 sees only its own key: no empty row)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, queries, module.o_proj.out_features, generator=g)
    latent = torch.randn(batch, 1, cached, module.r, generator=g)
    rope = torch.randn(batch, 1, cached, module.dr, generator=g)
    if not masked:
        return x, latent, rope, None
    t = cached + queries
    allowed = torch.arange(t)[None, :] <= torch.arange(queries)[:, None] + cached
    allowed = allowed.expand(batch, 1, queries, t).clone()
    allowed[0, ..., : min(cached, 2)] = False  # left padding in batch 0
    return x, latent, rope, torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


def compile_and_run(module, args, config=None, **compile_kwargs):
    cap = MLACapture(config or Config(compiler="aot_eager"))
    out = torch.compile(module, backend=cap, fullgraph=True, **compile_kwargs)(*args)
    return out, cap


def assert_rewritten(cap: MLACapture, module: TinyMLA, graph: int = -1):
    (site,) = cap.entries(graph)
    assert not cap.entries(graph, "left_alone"), cap.reports[graph].summary()
    (call,) = cap.calls(mla_attention, graph)
    assert call.kwargs["scale"] == module.scaling  # exactly the graph's constant
    assert (site.details["heads"], site.details["nope"], site.details["rope"], site.details["v"],
            site.details["kv_lora_rank"]) == (module.h, module.dn, module.dr, module.dv, module.r)
    assert not kv_b_linears(cap.graphs[graph]) and cap.kv_b_linears_before[graph] == 1
    for gone in (attention, "copy_", F.softmax):
        assert not cap.calls(gone, graph), cap.graphs[graph].code
    assert site.site and site.source.startswith("test_mla_absorb.py:")
    return site


@pytest.mark.parametrize("softmax_attention", [True, False], ids=["after_attention_rewrite", "eager_attention"])
@pytest.mark.parametrize("keys_by,query", [("copy", "cat"), ("copy", "view"), ("cat", "cat")])
def test_rewritten_into_one_mla_call(keys_by, query, softmax_attention):
    module = TinyMLA(keys_by=keys_by, query=query).eval()
    args = inputs(module)
    with torch.no_grad():
        out, cap = compile_and_run(module, args, Config(compiler="aot_eager", softmax_attention=softmax_attention))
        assert rel_error(out, module(*args)) < FP32_TOL
    site = assert_rewritten(cap, module)
    assert site.details["attention"] == ("kda_compile.attention" if softmax_attention else "eager attention")
    assert site.details["mask"].startswith("additive")


def test_bf16_matches_eager():
    """bf16 eager rounds the probabilities to bf16, the op does not: a bf16-sized tolerance."""
    module = TinyMLA().eval().to(torch.bfloat16)
    args = [t.to(torch.bfloat16) for t in inputs(module)]
    with torch.no_grad():
        out, cap = compile_and_run(module, args)
        assert out.dtype == torch.bfloat16 and rel_error(out, module(*args)) < 3e-2
    assert_rewritten(cap, module)


def test_lengths_reuse_one_dynamic_graph_and_a_symbolic_scale_is_specialised():
    module = TinyMLA().eval()
    with torch.no_grad():
        cap = MLACapture()
        compiled = torch.compile(module, backend=cap, dynamic=True, fullgraph=True)
        for i, (queries, cached) in enumerate([(3, 4), (2, 9), (5, 2)]):  # (size 1 specialises)
            args = inputs(module, queries=queries, cached=cached, seed=i)
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                assert rel_error(compiled(*args), module(*args)) < FP32_TOL
    # Dynamo restarts its analysis once to specialise the float scaling: the last call is the graph
    assert all(len(cap.entries(g)) == 1 for g in range(len(cap.graphs)))
    assert_rewritten(cap, module)


def test_training_gradients_match():
    module = TinyMLA().train()
    args = [t.requires_grad_(True) if t is not None else t for t in inputs(module)]
    out, cap = compile_and_run(module, args)
    grads = torch.autograd.grad(out.square().sum(), [*module.parameters(), *args[:3]])
    expected = torch.autograd.grad(module(*args).square().sum(), [*module.parameters(), *args[:3]])
    names = [n for n, _ in module.named_parameters()] + ["x", "latent_cache", "rope_cache"]
    for name, got, want in zip(names, grads, expected):
        assert rel_error(got, want) < GRAD_TOL, name
    assert_rewritten(cap, module)


@pytest.mark.parametrize("variant,reason", [
    ("keys_used", "keys"),
    ("values_used", "values"),
    ("mutation", "mutates a tensor between kv_b_proj and the attention"),
    ("rope_broadcast", "rope key expanded over heads"),
    ("weights_used", "output_attentions"),
])
@pytest.mark.parametrize("softmax_attention", [True, False], ids=["after_attention_rewrite", "eager_attention"])
def test_unsupported_variants_are_left_alone_with_their_reason(variant, reason, softmax_attention):
    module = TinyMLA(variant=variant).eval()
    args = inputs(module)
    with torch.no_grad():
        out, cap = compile_and_run(module, args, Config(compiler="aot_eager", softmax_attention=softmax_attention))
        assert rel_error(out, module(*args)) < FP32_TOL
    (entry,) = cap.entries(kind="left_alone")
    assert reason in entry.reason, entry.reason
    assert not cap.entries() and not cap.calls(mla_attention) and len(kv_b_linears(cap.graphs[-1])) == 1


def test_kv_b_proj_with_a_bias_is_left_alone():
    module = TinyMLA(kv_b_bias=True).eval()
    args = inputs(module)
    with torch.no_grad():
        out, cap = compile_and_run(module, args)
        assert rel_error(out, module(*args)) < FP32_TOL
    (entry,) = cap.entries(kind="left_alone")
    assert "bias" in entry.reason and not cap.calls(mla_attention)


def test_attention_dropout_in_training_is_left_alone():
    module = TinyMLA(dropout=0.25).train()
    out, cap = compile_and_run(module, inputs(module))
    (entry,) = cap.entries(kind="left_alone")
    assert "dropout_p=0.25" in entry.reason and torch.isfinite(out).all()


def test_mask_to_flags_off_passes_the_additive_mask_and_no_mask_passes_none():
    module = TinyMLA().eval()
    for masked in (True, False):
        args = inputs(module, masked=masked)
        with torch.no_grad():
            out, cap = compile_and_run(module, args, Config(compiler="aot_eager", softmax_attention=False,
                                                            attention_mask_to_flags=False))
            assert rel_error(out, module(*args)) < FP32_TOL
        (call,) = cap.calls(mla_attention)
        assert (call.kwargs["attn_mask"] is None) == (not masked) and call.kwargs["is_causal"] is False
        assert_rewritten(cap, module)


def test_idempotent():
    module = TinyMLA().eval()
    with torch.no_grad():
        _, cap = compile_and_run(module, inputs(module))
    gm = cap.graphs[-1]
    code = gm.code
    again = PassManager(Config(compiler="aot_eager")).run(gm)
    assert not again.rewritten and not again.left_alone and gm.code == code


@settings(deadline=None)
@given(batch=st.integers(1, 3), heads=st.integers(1, 4), queries=st.integers(1, 5), cached=st.integers(0, 6),
       nope=st.sampled_from([8, 16]), rope=st.sampled_from([4, 8]), value=st.sampled_from([8, 12]),
       masked=st.booleans(), keys_by=st.sampled_from(["copy", "cat"]), query=st.sampled_from(["cat", "view"]),
       softmax_attention=st.booleans(), seed=st.integers(0, 2**16))
def test_fuzz_matches_eager(batch, heads, queries, cached, nope, rope, value, masked, keys_by, query,
                            softmax_attention, seed):
    torch._dynamo.reset()
    torch.manual_seed(seed)
    module = TinyMLA(heads=heads, nope=nope, rope=rope, value=value, keys_by=keys_by, query=query).eval()
    args = inputs(module, batch=batch, queries=queries, cached=cached, masked=masked, seed=seed)
    with torch.no_grad():
        out, cap = compile_and_run(module, args, Config(compiler="aot_eager", softmax_attention=softmax_attention))
        assert rel_error(out, module(*args)) < FP32_TOL
    assert_rewritten(cap, module)


@pytest.mark.slow
def test_inductor_runs_the_rewritten_graph():
    from kda_compile.backend import KdaCompileBackend

    module = TinyMLA().eval()
    args = inputs(module, queries=1, cached=7)
    backend = KdaCompileBackend(Config(compiler="inductor"))
    with torch.no_grad():
        out = torch.compile(module, backend=backend, fullgraph=True)(*args)
        assert rel_error(out, module(*args)) < FP32_TOL
    (report,) = backend.reports
    assert [r.rewrite for r in report.rewritten] == ["softmax_attention", "mla_absorb"], report.summary()


def test_sinks_are_left_alone_with_what_the_op_would_need():
    module = TinyMLA(variant="sinks").eval()
    args = inputs(module)
    with torch.no_grad():
        out, cap = compile_and_run(module, args)
        assert rel_error(out, module(*args)) < FP32_TOL
    (entry,) = cap.entries(kind="left_alone")
    assert "mla_attention takes no sinks argument" in entry.reason and "sigmoid(lse - sinks)" in entry.reason
    assert "per-head sinks (parameter sinks)" in entry.reason  # named by its attribute, the same in every layer
    assert "the site stays kda_compile.attention over the keys and values kv_b_proj expands" in entry.reason
    assert not cap.calls(mla_attention)


def test_static_size_reads_of_the_expanded_kv_are_folded_and_symbolic_ones_kept():
    """A ``size()`` of the expanded K/V whose value the graph knows (an int, or a SymInt Dynamo specialised) is a
    constant, not a use of the values: it is folded so that the rewrite can drop the expansion; a size that is
    still symbolic stays a node (the rewrite then reports the use)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from kda_compile.passes.mla.absorb import fold_static_sizes

    graph = torch.fx.Graph()
    kv = graph.placeholder("kv")
    kv.meta["example_value"] = torch.zeros(2, 3)
    static = graph.call_method("size", (kv, 1))
    static.meta["example_value"] = 3
    symbolic = graph.call_method("size", (kv, 0))
    symbolic.meta["example_value"] = ShapeEnv().create_unbacked_symint()
    graph.output((graph.call_function(torch.reshape, (kv, (static, -1))), symbolic))
    fold_static_sizes(kv)
    sizes = [n for n in graph.nodes if n.target == "size"]
    assert sizes == [symbolic]
    (reshape,) = [n for n in graph.nodes if n.target is torch.reshape]
    assert reshape.args[1] == (3, -1)


def test_alias_root_separates_storages_and_follows_views_and_in_place_calls():
    from kda_compile.passes.toolkit.graph_tools import alias_root

    graph = torch.fx.Graph()
    cache, other = graph.placeholder("cache"), graph.placeholder("other")
    written = graph.call_method("index_copy_", (cache, 2, other, other))
    view = graph.call_method("transpose", (written, 1, 2))
    fresh = graph.call_function(torch.zeros, (4,))
    filled = graph.call_method("add_", (fresh, 1))
    product = graph.call_function(torch.matmul, (view, other))
    assert alias_root(view) is cache and alias_root(written) is cache
    assert alias_root(filled) is fresh and alias_root(product) is product
    assert alias_root(other) is other and alias_root(3) is None
