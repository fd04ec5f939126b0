"""The DSA rewrite on tiny random models of the token-level DSA families (fp32, CPU).

Families: deepseek_v32 (half-split indexer RoPE), glm_moe_dsa (interleaved RoPE; layer 1 reuses layer 0's
selection), mistral_large4 (indexer queries from the hidden states; a shared layer; text model only:
transformers has no causal-LM head for it, so no generate()), dots3_note (a sliding-window layer beside
the indexed one, left to the softmax rewrite), hy_v4 (softmax scale folded into the weights, attention
sinks, a shared layer), axk2, and glm5_next (no RoPE; its pooled indexer becomes dsa_pooled_indexer_topk, the attention over its
selection and a shared layer's dsa_sparse_attention; its KDA layers are not built here). Two
layers, hidden 64, MLA 16 + 8 / 16, indexer 8 heads x 16, top-k 6.

Checked for each, through ``kda_compile.optimize(model.forward, fullgraph=True)`` (aot_eager) on a
left-padded batch: ``generate()`` gives eager's tokens and each step's logits within 1e-4 of eager's (the
prefill step, then a decode step reading HF's latent and indexer caches; mistral_large4: the prefill
outputs, padding rows excluded), no graph break (fullgraph), every graph holds one ``dsa_indexer_topk`` per
full indexer and one ``dsa_sparse_attention`` per indexed layer, in the absorbed form (no ``kv_b_proj`` over the
latent cache; a decode step's graph holds no matmul over the cache length, its outputs within 1e-4 of eager's),
and the rewrite left nothing alone. And once
through ``torch.compile(backend="kda_compile")`` with Inductor. Static shapes, but for one decode graph
with a symbolic cache length (Dynamo's automatic dynamic at the third token): under ``dynamic=True``
Dynamo alone takes about 45 s per model on 2 CPU cores. CUDA: three families with Inductor on the GPU.
"""
from __future__ import annotations

import operator

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

import kda_compile
import kda_compile.ops
from kda_compile import Config, optimize
from kda_compile.passes import PassManager
from kda_compile.report import clear_reports
from kda_compile.testing import rel_error

transformers = pytest.importorskip("transformers")

VOCAB, PROMPT, TOL, NEW_TOKENS = 128, 11, 1e-4, 2
QUICK = Config(compiler="aot_eager")
_DSA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            index_topk=6, index_head_dim=16, index_n_heads=8, n_routed_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, moe_intermediate_size=32, initializer_range=0.1)
# name -> (config class, model class, config additions, (full indexers, indexed layers))
FAMILIES = {
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(first_k_dense_replace=2), (2, 2)),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",
                    dict(first_k_dense_replace=2, indexer_types=["full", "shared"]), (1, 2)),
    "mistral_large4": ("MistralLarge4TextConfig", "MistralLarge4TextModel",
                       dict(first_k_dense_replace=2, indexer_types=["full", "shared"], head_dim=24), (1, 2)),
    "dots3_note": ("Dots3NoteTextConfig", "Dots3NoteForCausalLM",
                   dict(first_k_dense_replace=2, layer_types=["indexed_attention", "sliding_attention"],
                        sliding_window=4), (1, 1)),
    "hy_v4": ("HYV4Config", "HYV4ForCausalLM", dict(indexer_types=["full", "shared"]), (1, 2)),
    "axk2": ("AXK2Config", "AXK2ForCausalLM", dict(first_k_dense_replace=2), (2, 2)),
}


def build(name: str, **overrides) -> torch.nn.Module:
    config_class, model_class, extra, _ = FAMILIES[name]
    extra = {**extra, **overrides}
    if not hasattr(transformers, config_class):
        pytest.skip(f"transformers {transformers.__version__} has no {config_class}")
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**_DSA, **extra})
    model = getattr(transformers, model_class)._from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # a zero (pad) embedding makes a zero indexer query: every score 0, a tie
        model.get_input_embeddings().weight.normal_()
    return model.eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids, mask


def outputs(result) -> torch.Tensor:
    return result.logits if hasattr(result, "logits") else result.last_hidden_state


def assert_sites(graphs, name: str) -> None:
    indexers, layers = FAMILIES[name][3]
    for graph in graphs:
        ops = [r.op for r in graph.rewritten if r.rewrite == "dsa_attention"]
        assert ops.count("kda_compile.dsa_indexer_topk") == indexers, graph.summary()
        assert ops.count("kda_compile.dsa_sparse_attention") == layers, graph.summary()
        assert not [c for c in graph.left_alone if c.rewrite == "dsa_attention"], graph.summary()
        forms = [r.details["form"] for r in graph.rewritten if r.op == "kda_compile.dsa_sparse_attention"]
        assert forms == ["absorbed"] * layers, graph.summary()
        # the absorbed form leaves mla_absorb no expand_kv to report at the DSA layers (dots3_note's sliding
        # layer is plain MLA, reported by mla_absorb for its window)
        dsa_layers = {r.site for r in graph.rewritten if r.op == "kda_compile.dsa_sparse_attention"}
        assert not [c for c in graph.left_alone if c.rewrite == "mla_absorb" and c.site in dsa_layers], \
            graph.summary()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield


def generate(model, ids, mask):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_prefill_and_decode_match_eager(name):
    model = build(name)
    ids, mask = batch()
    fast = optimize(model.forward, QUICK, fullgraph=True)
    if hasattr(model, "generate"):
        expected = generate(model, ids, mask)
        model.forward = fast
        try:
            got = generate(model, ids, mask)
        finally:
            del model.forward
        assert torch.equal(got.sequences, expected.sequences)
        assert len(got.logits) == NEW_TOKENS  # the prefill step, then decode steps reading HF's indexer cache
        for step, (have, want) in enumerate(zip(got.logits, expected.logits)):
            assert rel_error(have, want) < TOL, step
    else:
        with torch.no_grad():
            have, want = outputs(fast(ids, attention_mask=mask)), outputs(model(ids, attention_mask=mask))
        keep = mask.bool()  # padded queries attend to nothing here, to every key in eager: rows never used
        assert rel_error(have[keep], want[keep]) < TOL
    graphs = kda_compile.report(fast).graphs
    assert graphs
    assert_sites(graphs, name)


def s_by_t_values(gm: torch.fx.GraphModule, s_len: int, t_len: int) -> list[str]:
    """Nodes whose example value has S x T elements or more in two dims of sizes S and T (any order)."""
    found = []
    for node in gm.graph.nodes:
        values = node.meta.get("example_value")
        for value in values if isinstance(values, (tuple, list)) else (values,):
            if isinstance(value, torch.Tensor):
                dims = [d for d in value.shape if isinstance(d, int)]
                if s_len in dims and t_len in dims and (s_len != t_len or dims.count(s_len) >= 2):
                    found.append(node.format_node())
    return found


def _glm5_next_config(**extra):
    if not hasattr(transformers, "Glm5NextTextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Glm5NextTextConfig")
    return transformers.Glm5NextTextConfig(**{**_DSA, **dict(
        qk_rope_head_dim=0, index_topk=8, index_kpool=4, layer_types=["full_attention"] * 2,
        indexer_types=["full", "shared"], mlp_layer_types=["dense"] * 2, hc_mult=2, hc_sinkhorn_iters=2), **extra})


@pytest.mark.parametrize("tail", [True, False])
def test_glm5_next_pooled_indexer_and_attention(tail):
    """glm5_next's pooled indexer becomes dsa_pooled_indexer_topk and the attention over its selection (its own
    and, on the shared layer, the previous layer's) dsa_sparse_attention, for eager and SDPA attention: the
    rewritten graph holds no tensor of S x T elements (every example value walked; the traced one did)."""
    config = _glm5_next_config(index_kpool_always_select_tail=tail, index_topk=12)  # widths 15 / 12, not T = 11
    ids, mask = batch()
    keep = mask.bool()
    for attn in ("eager", "sdpa"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = transformers.Glm5NextTextModel._from_config(config, attn_implementation=attn).eval()
        before, after = [], []

        def backend(gm, example_inputs):
            before.append(s_by_t_values(gm, PROMPT, PROMPT))
            PassManager(QUICK).run(gm)
            after.append(s_by_t_values(gm, PROMPT, PROMPT))
            return lookup_backend("aot_eager")(gm, example_inputs)

        with torch.no_grad():
            have = torch.compile(model, backend=backend, fullgraph=True)(ids, attention_mask=mask).last_hidden_state
            want = model(ids, attention_mask=mask).last_hidden_state
        # Without the tail a query's first index_kpool - 1 tokens select nothing: HF's eager softmax then spreads
        # over every key (future ones too), the op gives 0 (docs/dsa-rewrite.md, Limits); values only with it.
        assert not tail or rel_error(have[keep], want[keep]) < TOL, attn
        assert before[0], "the traced graph holds no S x T tensor: the check below cannot fail"
        assert after == [[]], after
        fast = optimize(model, QUICK, fullgraph=True)
        with torch.no_grad():
            again = fast(ids, attention_mask=mask).last_hidden_state
        assert not tail or rel_error(again[keep], want[keep]) < TOL, attn
        (graph,) = kda_compile.report(fast).graphs
        sites = [r.details["indices"] for r in graph.rewritten if r.op == "kda_compile.dsa_sparse_attention"]
        assert sites == ["pooled indexer", "pooled indexer, shared: layers.0.self_attn.indexer"], graph.summary()
        forms = [r.details["form"] for r in graph.rewritten if r.op == "kda_compile.dsa_sparse_attention"]
        assert forms == ["absorbed"] * 2, graph.summary()  # no rope part (qk_rope_head_dim=0)
        pooled = [r for r in graph.rewritten if r.op == "kda_compile.dsa_pooled_indexer_topk"]
        assert [r.site for r in pooled] == ["layers.0.self_attn.indexer"], graph.summary()
        assert pooled[0].details["select_tail"] is tail and pooled[0].details["topk"] == 12, graph.summary()
        assert not [c for c in graph.left_alone if c.rewrite == "dsa_attention"], graph.summary()


def test_glm5_next_generate_matches_eager():
    """generate() through the rewritten graphs (prefill, then decode steps reading HF's indexer cache with a
    query offset): eager's tokens, each step's logits within 1e-4, the pooled indexer rewritten in every graph."""
    config = _glm5_next_config(vocab_size=VOCAB)
    if not hasattr(transformers, "Glm5NextForCausalLM"):  # TODO: drive the text model through a causal-LM head
        pytest.skip(f"transformers {transformers.__version__} has no Glm5NextForCausalLM")
    torch.manual_seed(0)
    model = transformers.Glm5NextForCausalLM._from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_()
    ids, mask = batch()
    expected = generate(model, ids, mask)
    fast = optimize(model.forward, QUICK, fullgraph=True)
    model.forward = fast
    try:
        got = generate(model, ids, mask)
    finally:
        del model.forward
    assert torch.equal(got.sequences, expected.sequences)
    for step, (have, want) in enumerate(zip(got.logits, expected.logits)):
        assert rel_error(have, want) < TOL, step
    graphs = kda_compile.report(fast).graphs
    assert len(graphs) == NEW_TOKENS
    for graph in graphs:
        ops = [r.op for r in graph.rewritten if r.rewrite == "dsa_attention"]
        assert ops.count("kda_compile.dsa_pooled_indexer_topk") == 1, graph.summary()
        assert ops.count("kda_compile.dsa_sparse_attention") == 2, graph.summary()
        assert not [c for c in graph.left_alone if c.rewrite == "dsa_attention"], graph.summary()


_MATMULS = (torch.matmul, torch.nn.functional.linear, torch.bmm, torch.mm, torch.einsum, operator.matmul)


def matmuls_over(gm: torch.fx.GraphModule, length: int) -> list[str]:
    """Matmul-like nodes with an operand of ``length`` in a non-last dim (a matmul over the cache)."""
    found = []
    for node in gm.graph.nodes:
        if not (node.target in _MATMULS or (node.op == "call_method" and node.target in ("matmul", "__matmul__"))):
            continue
        for arg in node.all_input_nodes:
            value = arg.meta.get("example_value")
            if isinstance(value, torch.Tensor) and length in list(value.shape)[:-1]:
                found.append(node.format_node())
    return found


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_decode_graph_reads_only_the_latent_cache(name):
    """A decode step's graph has no matmul over the cache length T: kv_b_proj is absorbed into the query and
    the output, the attention reads the latent cache at the selected rows (the traced graph had kv_b_proj over
    the whole cache, so the check can fail). The decode step's outputs match eager's within 1e-4."""
    model = build(name)
    ids, mask = batch()
    before, graphs = [], []

    def keep(gm, example_inputs):
        t = PROMPT + 1
        before.append(matmuls_over(gm, t))
        PassManager(QUICK).run(gm)
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    step_ids = torch.randint(3, VOCAB, (2, 1), generator=torch.Generator().manual_seed(1))
    step_mask = torch.cat((mask, torch.ones(2, 1, dtype=mask.dtype)), dim=1)
    fast = torch.compile(model, backend=keep, fullgraph=True, dynamic=False)
    with torch.no_grad():  # eager prefills (test_prefill_and_decode_match_eager compiles those), one cache each
        steps = [forward(step_ids, attention_mask=step_mask, use_cache=True,
                         past_key_values=model(ids, attention_mask=mask, use_cache=True).past_key_values)
                 for forward in (fast, model)]
    assert rel_error(outputs(steps[0]), outputs(steps[1])) < TOL
    assert len(graphs) == 1  # the decode step (T = PROMPT + 1)
    assert before[0], "the traced decode graph has no matmul over the cache: the check below cannot fail"
    assert matmuls_over(graphs[0], PROMPT + 1) == [], graphs[0].code
    assert sum(n.target is kda_compile.ops.dsa_sparse_attention for n in graphs[0].graph.nodes) == FAMILIES[name][3][1]


@pytest.mark.slow
def test_kda_compile_backend_with_inductor():
    model = build("deepseek_v32", num_hidden_layers=1)
    ids, mask = batch()
    clear_reports()
    with torch.no_grad():
        got = torch.compile(model, backend="kda_compile", fullgraph=True)(ids, attention_mask=mask).logits
        want = model(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert rel_error(got[keep], want[keep]) < TOL
    graph = kda_compile.report().graphs[-1]
    ops = [r.op for r in graph.rewritten if r.rewrite == "dsa_attention"]
    assert ops == ["kda_compile.dsa_indexer_topk", "kda_compile.dsa_sparse_attention"], graph.summary()


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa", "hy_v4"])
def test_cuda_generate_matches_eager_with_inductor(name):
    """On the GPU the ops run their CUDA implementations; fp32 with TF32 off, against HF eager on the GPU."""
    model = build(name).cuda()
    ids, mask = (x.cuda() for x in batch())
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.backends.cudnn.flags(allow_tf32=False):
            expected = generate(model, ids, mask)
            fast = optimize(model.forward, fullgraph=True)
            model.forward = fast
            got = generate(model, ids, mask)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        model.__dict__.pop("forward", None)
    assert torch.equal(got.sequences, expected.sequences)
    for step, (have, want) in enumerate(zip(got.logits, expected.logits)):
        assert rel_error(have, want) < TOL, step
    assert_sites(kda_compile.report(fast).graphs, name)


def test_decode_graph_with_symbolic_key_length():
    """A third generated token makes Dynamo trace decode with a symbolic cache length: top-k is HF's
    ``min(index_topk, T)``, a symbolic size, and the rewrite still takes every site."""
    model = build("deepseek_v32")
    ids, mask = batch()
    fast = optimize(model.forward, QUICK, fullgraph=True)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    model.forward = fast
    try:
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    finally:
        del model.forward
    assert torch.equal(tokens, expected)
    graphs = kda_compile.report(fast).graphs
    assert_sites(graphs, "deepseek_v32")
    topks = {r.details["topk"] for r in graphs[-1].rewritten if r.op == "kda_compile.dsa_indexer_topk"}
    assert len(topks) == 1 and "Min(6" in topks.pop(), graphs[-1].summary()
    # the report shows that size as "dynamic", not as the sympy expression the entry keeps
    for text in (str(kda_compile.report(fast)), kda_compile.report(fast).format(verbose=True)):
        assert "topk=dynamic" in text and "Min(" not in text, text
