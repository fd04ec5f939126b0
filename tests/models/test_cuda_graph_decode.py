"""``optimize(model.forward, mode="reduce-overhead")`` with a static cache: ``generate()`` gives eager's tokens,
the prefill graph runs without CUDA graphs and the decode graph is captured with the cache as static addresses
(kda_compile/cuda_graphs.py, docs/cuda-graphs.md).

Tiny random models of each family we rewrite (fp32, batch 2 with a left-padded row): KDA (kimi_linear),
GDN (qwen3_next, qwen3_5, olmo_hybrid), MLA (deepseek_v3), DSA (deepseek_v32, glm_moe_dsa), softmax (llama,
qwen3, gemma3 with sliding layers, gpt_oss with sinks). On CPU Inductor is replaced by aot_eager and the
Inductor config each graph would get is recorded (CUDA graphs cannot run there); the tests marked ``cuda``
run Inductor with its cudagraph trees and check that no graph of ours is skipped.
"""
from __future__ import annotations

import contextlib
import sys
from unittest import mock

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

import kda_compile
from kda_compile import cuda_graphs, optimize, sliding_window_cache
from kda_compile.bench import e2e_kimi
from kda_compile.testing import rel_error
from hf_kda_binding import torch_path

transformers = pytest.importorskip("transformers")
from transformers import StaticCache  # noqa: E402

VOCAB, PROMPT, NEW_TOKENS = 128, 9, 4
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_GDN = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"])
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
_MLA = dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            moe_intermediate_size=32)
_DSA = dict(_MLA, index_topk=6, index_head_dim=16, index_n_heads=8, initializer_range=0.1)
CONFIGS = {  # family -> (config class, arguments); kimi_linear is e2e_kimi.TINY
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                                        layer_types=["sliding_attention", "full_attention"])),
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                                     layer_types=["sliding_attention", "full_attention"],
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "deepseek_v3": ("DeepseekV3Config", dict(_MLA, first_k_dense_replace=1)),
    "deepseek_v32": ("DeepseekV32Config", dict(_DSA, first_k_dense_replace=2)),
    "glm_moe_dsa": ("GlmMoeDsaConfig", dict(_DSA, first_k_dense_replace=2, indexer_types=["full", "shared"])),
    "qwen3_next": ("Qwen3NextConfig", dict(_GDN, **_MOE)),
    "qwen3_5": ("Qwen3_5TextConfig", dict(_GDN)),
    "olmo_hybrid": ("OlmoHybridConfig", dict(_GDN)),
}
COVERAGE_FAMILIES = ("bailing_hybrid", "qwen3_5_moe", "deepseek_v2")  # kda_compile.coverage's tiny configs
ALL_FAMILIES = ("kimi_linear", *CONFIGS, *COVERAGE_FAMILIES, "glm5_next")
SLIDING = ("gemma3", "gpt_oss")  # HF's StaticSlidingWindowLayer (kda_compile.sliding_window_cache)
HF_TORCH_FUNCTIONS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "torch_chunk_gated_delta_rule",
                      "torch_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update")
PREFILL_PLAN = "cuda graphs: not captured: a prefill graph"


def _glm5_next() -> torch.nn.Module:
    """GLM-5-Next's text model at tiny widths: a KDA layer and a DSA (pooled indexer) layer."""
    from kda_compile.coverage.models import shrink

    if not hasattr(transformers, "Glm5NextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Glm5NextConfig")
    d = shrink(transformers.Glm5NextConfig().to_dict())
    d["text_config"].update(num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"],
                            mlp_layer_types=["dense", "dense"], indexer_types=["full", "full"], vocab_size=VOCAB,
                            pad_token_id=0, bos_token_id=1, eos_token_id=2)
    for key in ("transformers_version", "architectures", "_name_or_path"):
        d.pop(key, None)
    torch.manual_seed(0)
    config = transformers.Glm5NextConfig.from_dict(d)
    return transformers.Glm5NextForConditionalGeneration._from_config(config, attn_implementation="eager",
                                                                      dtype=torch.float32)


def build(family: str, device: str = "cpu") -> torch.nn.Module:
    if family == "kimi_linear":
        return e2e_kimi.build_model(e2e_kimi.TINY, 4, device, torch.float32)
    if family == "glm5_next":
        model = _glm5_next()
    elif family in COVERAGE_FAMILIES:
        from kda_compile.coverage.models import build_model

        model = build_model(family)
    else:
        config_class, extra = CONFIGS[family]
        if not hasattr(transformers, config_class):
            pytest.skip(f"transformers {transformers.__version__} has no {config_class}")
        config = getattr(transformers, config_class)(**{**_COMMON, **extra})
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                              dtype=torch.float32)
    with torch.no_grad():  # a zero (pad) embedding makes zero indexer queries: every DSA score ties
        model.get_input_embeddings().weight.normal_()
    if model.get_input_embeddings().weight.shape[0] < VOCAB:
        pytest.skip(f"{family}'s tiny vocabulary is smaller than {VOCAB}")
    return model.to(device).eval()


def batch(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, the first left-padded by three tokens (per-sequence positions in one batch)."""
    ids = torch.randint(3, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids.to(device), mask.to(device)


@contextlib.contextmanager
def hf_torch_path(model: torch.nn.Module):
    """HF's torch path where the model's code bound FLA / causal-conv1d (CUDA-only) to its kernels."""
    modeling = sys.modules[type(model).__module__]
    with torch_path(modeling, *(name for name in HF_TORCH_FUNCTIONS if hasattr(modeling, name))):
        yield


@contextlib.contextmanager
def aot_eager_for_inductor():
    """The backend's Inductor step replaced by aot_eager; yields the Inductor config each graph was given."""
    given = []

    def compile_rewritten(gm, example_inputs, compiler, patches):
        given.append(dict(patches))
        return lookup_backend("aot_eager")(gm, example_inputs)

    with mock.patch("kda_compile.backend._compile_rewritten", compile_rewritten):
        yield given


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def cache_tensors(cache) -> list[torch.Tensor]:
    found = []
    for layer in cache.layers:
        for value in vars(layer).values():
            values = value.values() if isinstance(value, dict) else [value]
            found += [v for v in values if isinstance(v, torch.Tensor) and v.numel() > 1]
    return found


def generate(model, ids, mask, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_static_cache_generate_gives_eager_tokens_and_captures_only_decode(family):
    model = build(family)
    ids, mask = batch()
    with hf_torch_path(model):
        expected = generate(model, ids, mask)
        cache = StaticCache(config=model.config, max_cache_len=PROMPT + NEW_TOKENS)
        with aot_eager_for_inductor() as given:
            model.forward = optimize(model.forward, mode="reduce-overhead", fullgraph=True)
            got = generate(model, ids, mask, past_key_values=cache)
    assert torch.equal(got, expected)
    graphs = kda_compile.report(model.forward).graphs
    plans = [g.cuda_graphs for g in graphs]
    assert len(plans) == 2 and plans[0].startswith(PREFILL_PLAN), plans
    assert plans[1].startswith("cuda graphs: captured"), plans
    assert [p.get(cuda_graphs.CUDAGRAPHS_OPTION) for p in given] == [False, True]
    # the decode graph, reading the static cache and generate()'s precomputed masks, is rewritten in full; but
    # glm5_next's pooled indexer, whose query offset is then the cache's length tensor (the op takes an int)
    left = [c.reason for c in graphs[1].left_alone]
    if family == "glm5_next":
        assert len(left) == 1 and "query positions (current_length - S + arange(S))" in left[0], left
    else:
        assert graphs[1].rewritten and not left, graphs[1].summary()
    # every cache tensor the decode graph reads or writes is a static address (none is copied per replay)
    tensors = cache_tensors(cache)
    assert tensors and all(getattr(t, "_dynamo_static_input_type", None) for t in tensors)
    assert kda_compile.report(model.forward).cuda_graph_fallbacks == ()


@pytest.mark.parametrize("family", SLIDING)
@pytest.mark.parametrize("new_tokens", [4, 9], ids=["window-full-at-prefill", "window-fills-while-decoding"])
def test_sliding_window_layers_decode_in_one_static_graph(family, new_tokens):
    """HF's StaticSlidingWindowLayer, made capturable: one static decode graph for every step, whether the prompt
    filled the window (sliding_window 4 < prompt 9) or decode fills it (window 12); eager's tokens, and the
    layer's host and device lengths both count every token once."""
    window = 4 if new_tokens == 4 else 12
    model = build_sliding(family, window)
    ids, mask = batch()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    cache = StaticCache(config=model.config, max_cache_len=PROMPT + new_tokens)
    with aot_eager_for_inductor() as given:
        model.forward = optimize(model.forward, mode="reduce-overhead", fullgraph=True)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             past_key_values=cache)
    assert torch.equal(got, expected)
    assert [p.get(cuda_graphs.CUDAGRAPHS_OPTION) for p in given] == [False, True]
    assert kda_compile.report(model.forward).cuda_graph_fallbacks == ()
    sliding = [layer for layer in cache.layers if getattr(layer, "is_sliding", False)]
    assert sliding and all(sliding_window_cache.is_capturable(layer) for layer in sliding)
    seen = PROMPT + new_tokens - 1  # the last token is sampled, never written
    assert all(layer.cumulative_length_int == seen and int(layer.cumulative_length) == seen for layer in sliding)


def hand_written_decode(model, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decode by hand (no generate(): the model builds its masks in each step) into a static cache, eager
    and then through optimize(..., mode="reduce-overhead"); returns both token sequences."""

    def loop(cache):
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        tokens = [out.logits[:, -1:].argmax(-1)]
        for _ in range(NEW_TOKENS):
            out = model(input_ids=tokens[-1], past_key_values=cache, use_cache=True)
            tokens.append(out.logits[:, -1:].argmax(-1))
        return torch.cat(tokens, 1)

    with torch.no_grad():
        expected = loop(StaticCache(config=model.config, max_cache_len=16))
        with aot_eager_for_inductor():
            model.forward = optimize(model.forward, mode="reduce-overhead")
            return expected, loop(StaticCache(config=model.config, max_cache_len=16))


def test_a_hand_written_decode_loop_with_sliding_layers_is_reported_not_captured():
    """Without generate()'s precomputed masks the model builds its sliding mask inside the step from the layer's
    Python length: that graph cannot be replayed as one CUDA graph, so it is compiled without, and the report
    names the cause; the tokens are still eager's."""
    model = build_sliding("gemma3", 4)
    ids = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    expected, got = hand_written_decode(model, ids)
    assert torch.equal(got, expected)
    fallbacks = kda_compile.report(model.forward).cuda_graph_fallbacks
    assert any("cumulative_length_int" in line and "precomputed attention masks" in line for line in fallbacks), \
        fallbacks


def test_a_hand_written_dsa_decode_loop_into_a_static_cache_is_rewritten():
    """A decode loop without generate(): the model builds its mask in the step from the static cache's length
    tensor. With one query per sequence that mask only says which keys exist, so the DSA indexer and its sparse
    attention are still rewritten (the prefill's mask over the whole cache stays dense and is reported)."""
    model = build("deepseek_v32")
    ids = torch.randint(3, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(2))
    expected, got = hand_written_decode(model, ids)
    assert torch.equal(got, expected)
    prefill, decode = kda_compile.report(model.forward).graphs
    assert decode.cuda_graphs.startswith("cuda graphs: captured") and not decode.left_alone, decode.summary()
    ops = [r.op for r in decode.rewritten]
    assert ops.count("kda_compile.dsa_indexer_topk") == 2 and ops.count("kda_compile.dsa_sparse_attention") == 2, ops
    assert any("not provably the bottom-right causal diagonal" in c.reason for c in prefill.left_alone)


def build_sliding(family: str, window: int) -> torch.nn.Module:
    config_class, extra = CONFIGS[family]
    config = getattr(transformers, config_class)(**{**_COMMON, **extra, "sliding_window": window})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_()
    return model.eval()


# ----------------------------------------------------------------------------------------------
# A static cache that does not fit the call: a clear error before the step runs
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_a_position_past_max_cache_len_is_refused(mode):
    """A cache two tokens too short: the decode step that would write past max_cache_len raises, naming the
    cache, the positions and the length, instead of an index_copy_ out of bounds (a device-side assert, or a
    write outside the cache when replayed from a CUDA graph)."""
    model = build("llama")
    ids, mask = batch()
    with aot_eager_for_inductor():
        model.forward = optimize(model.forward, **({"mode": mode} if mode else {}))
        cache = StaticCache(config=model.config, max_cache_len=PROMPT + 1)
        with pytest.raises(ValueError, match=r"past_key_values: this call writes positions 10 to 10, past the "
                                             r"static cache's max_cache_len=10"):
            generate(model, ids, mask, past_key_values=cache)
        cache.reset()  # after a reset the same cache serves a prompt that fits
        short = generate(model, ids[:, :PROMPT - 3], mask[:, :PROMPT - 3], past_key_values=cache)
    assert short.shape == (2, PROMPT - 3 + NEW_TOKENS)


def test_a_cache_allocated_for_another_batch_size_is_refused():
    model = build("qwen3_next")
    ids, mask = batch()
    with hf_torch_path(model), aot_eager_for_inductor():
        model.forward = optimize(model.forward, mode="reduce-overhead")
        cache = StaticCache(config=model.config, max_cache_len=2 * PROMPT)
        generate(model, ids, mask, past_key_values=cache)
        cache.reset()
        with pytest.raises(ValueError, match=r"the call's batch is 1, but past_key_values\.layers\[0\]\.\w+.* "
                                             r"allocated for batch 2"):
            generate(model, ids[:1], mask[:1], past_key_values=cache)


@pytest.mark.parametrize("what", ["dtype", "device"])
def test_a_cache_of_another_dtype_or_device_is_refused(what):
    model = build("llama")
    ids, mask = batch()
    cache = StaticCache(config=model.config, max_cache_len=2 * PROMPT)
    dtype, device = (torch.bfloat16, "cpu") if what == "dtype" else (torch.float32, "meta")
    cache.early_initialization(2, model.config.num_key_value_heads, 16, dtype, torch.device(device))
    expected = r"is torch.bfloat16, the model computes in torch.float32" if what == "dtype" else \
        r"is on meta, the call's inputs on cpu"
    with aot_eager_for_inductor():
        model.forward = optimize(model.forward, mode="reduce-overhead")
        with pytest.raises(ValueError, match=r"past_key_values: past_key_values\.layers\[0\]\.keys " + expected):
            model(input_ids=ids, attention_mask=mask, past_key_values=cache)  # generate() reads a meta cache first


def test_second_generate_reuses_the_captured_decode_graph():
    """A second prompt of another length into the same static cache: one more prefill graph (dynamic), the
    decode graph unchanged."""
    model = build("llama")
    ids, mask = batch()
    cache = StaticCache(config=model.config, max_cache_len=PROMPT + 4 + NEW_TOKENS)
    with aot_eager_for_inductor() as given:
        model.forward = optimize(model.forward, mode="reduce-overhead")
        generate(model, ids, mask, past_key_values=cache)
        cache.reset()
        longer = torch.cat([ids, ids[:, :4]], 1)
        got = generate(model, longer, torch.ones_like(longer), past_key_values=cache)
    del model.forward
    assert torch.equal(got, generate(model, longer, torch.ones_like(longer)))
    assert [p.get(cuda_graphs.CUDAGRAPHS_OPTION) for p in given] == [False, True, False]


def test_each_batch_size_decodes_in_a_static_graph():
    """Decode at batch 2, then batch 3, each into its static cache: the second batch size compiles a new
    static decode graph (captured) instead of a dynamic one."""
    model = build("llama")
    with aot_eager_for_inductor() as given:
        model.forward = optimize(model.forward, mode="reduce-overhead")
        for rows in (2, 3):
            ids = torch.randint(3, VOCAB, (rows, PROMPT), generator=torch.Generator().manual_seed(rows))
            got = generate(model, ids, torch.ones_like(ids),
                           past_key_values=StaticCache(config=model.config, max_cache_len=PROMPT + NEW_TOKENS))
            assert got.shape == (rows, PROMPT + NEW_TOKENS)
    plans = [g.cuda_graphs for g in kda_compile.report(model.forward).graphs]
    assert sum(p.startswith("cuda graphs: captured") for p in plans) == 2, plans
    assert kda_compile.report(model.forward).cuda_graph_fallbacks == ()


def test_dynamic_cache_decode_is_not_captured_and_the_report_says_why():
    """HF's default DynamicCache grows its attention keys every step: the decode graph gets symbolic sizes
    from the second step on and would be recorded per size, so it runs without CUDA graphs; the report's
    fallback list names the cause and the cure."""
    model = build("llama")
    ids, mask = batch()
    expected = generate(model, ids, mask)
    with aot_eager_for_inductor() as given:
        model.forward = optimize(model.forward, mode="reduce-overhead")
        got = generate(model, ids, mask)
    assert torch.equal(got, expected)
    report = kda_compile.report(model.forward)
    symbolic = [g.cuda_graphs for g in report.graphs if "symbolic sizes" in g.cuda_graphs]
    assert symbolic and "cache_implementation='static'" in symbolic[0]
    assert any("symbolic sizes" in line for line in report.cuda_graph_fallbacks)
    assert "cuda graphs fallback:" in str(report)
    assert False in [p.get(cuda_graphs.CUDAGRAPHS_OPTION) for p in given[1:]]


def test_the_backend_entry_point_reads_the_phase_from_the_graph():
    """``torch.compile(model.forward, backend="kda_compile", mode="reduce-overhead")`` has no optimize() wrapper
    to say which call is a prefill: the plan reads the length of the graph's input_ids."""
    model = build("llama")
    ids, mask = batch()
    expected = generate(model, ids, mask)
    cache = StaticCache(config=model.config, max_cache_len=PROMPT + NEW_TOKENS)
    with aot_eager_for_inductor() as given:
        model.forward = torch.compile(model.forward, backend="kda_compile", mode="reduce-overhead")
        got = generate(model, ids, mask, past_key_values=cache)
    assert torch.equal(got, expected)
    assert [p.get(cuda_graphs.CUDAGRAPHS_OPTION) for p in given] == [False, True]
    assert all(getattr(t, "_dynamo_static_input_type", None) for t in cache_tensors(cache))


def test_without_reduce_overhead_nothing_changes():
    model = build("llama")
    ids, mask = batch()
    with aot_eager_for_inductor() as given:
        model.forward = optimize(model.forward)
        generate(model, ids, mask, cache_implementation="static")
    assert all(cuda_graphs.CUDAGRAPHS_OPTION not in p for p in given)
    assert all(g.cuda_graphs == "" for g in kda_compile.report(model.forward).graphs)


def test_optimize_keeps_generate_from_compiling_the_forward_again():
    """HF's generate() compiles ``__call__`` itself when it decodes into a static cache on a GPU; around an
    optimize()'d forward that would replace ours (plain Inductor, no rewrites), so optimize() switches it off."""
    model = build("llama")
    assert not model.generation_config.disable_compile
    model.forward = optimize(model.forward)
    assert model.generation_config.disable_compile is True


def test_the_example_runs(capsys):
    """examples/cuda_graph_decode.py, as the README shows it (CPU: aot_eager, no CUDA graphs)."""
    import pathlib
    import runpy

    runpy.run_path(str(pathlib.Path(__file__).parents[2] / "examples" / "cuda_graph_decode.py"), run_name="__main__")
    assert "tokens equal eager: True" in capsys.readouterr().out


def test_phase_of_a_call():
    one, many = torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long)
    assert cuda_graphs.phase_of_call((), {"input_ids": one}) == cuda_graphs.DECODE
    assert cuda_graphs.phase_of_call((many,), {}) == cuda_graphs.PREFILL
    assert cuda_graphs.phase_of_call((), {"inputs_embeds": torch.zeros(2, 3, 8)}) == cuda_graphs.PREFILL
    assert cuda_graphs.phase_of_call((), {"labels": many}) is None
    assert cuda_graphs.is_cache_source("L['kwargs']['past_key_values'].layers[0].conv_states[0]")
    assert cuda_graphs.is_cache_source("L['past_key_values'].layers[3].keys")
    assert not cuda_graphs.is_cache_source("L['self']._modules['model'].layers[0].weight")


# ----------------------------------------------------------------------------------------------
# On the GPU: Inductor's cudagraph trees
# ----------------------------------------------------------------------------------------------
EAGER_LOGITS_TOL = 5e-3  # our kernels against HF eager (FLA's where installed) on CUDA, fp32 with TF32 dots


@pytest.mark.cuda
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_cuda_decode_replays_its_cuda_graph_and_gives_eager_tokens(family):
    """The decode step captured and replayed (two generate() calls into one static cache: the second replays
    the graphs the first recorded) gives the tokens of the same compiled model without CUDA graphs, and logits
    within fp32 tolerance of HF's eager model at every step where the tokens agree."""
    model = build(family, "cuda")
    ids, mask = batch("cuda")
    expected = generate(model, ids, mask, output_logits=True, return_dict_in_generate=True)
    original = model.forward
    model.forward = optimize(original)
    plain = generate(model, ids, mask, past_key_values=StaticCache(config=model.config, max_cache_len=2 * PROMPT))
    torch._dynamo.reset()
    model.forward = optimize(original, mode="reduce-overhead")
    cache = StaticCache(config=model.config, max_cache_len=2 * PROMPT)
    for _ in range(2):
        cache.reset()
        got = generate(model, ids, mask, past_key_values=cache, output_logits=True, return_dict_in_generate=True)
        report = kda_compile.report(model.forward)
        assert torch.equal(got.sequences, plain), str(report)
    for step, (have, want) in enumerate(zip(got.logits, expected.logits)):
        if not torch.equal(got.sequences[:, :PROMPT + step], expected.sequences[:, :PROMPT + step]):
            break
        assert rel_error(have, want) < EAGER_LOGITS_TOL, (step, str(report))
    plans = [g.cuda_graphs for g in report.graphs]
    assert any(p.startswith("cuda graphs: captured") for p in plans), plans
    assert all(p.startswith(("cuda graphs: captured", PREFILL_PLAN)) for p in plans), plans
    assert report.cuda_graph_fallbacks == (), str(report)


RELEASED_LOGITS_TOL = 1e-2  # fp32 at the released widths: our kernels against HF eager with FLA's (both TF32 dots)


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["kimi_linear", "qwen3_next"])
def test_cuda_graph_decode_at_the_released_widths_gives_eager_tokens(family):
    """Kimi-Linear- and Qwen3-Next-shaped models at the released widths (4 layers, fp32, random weights), batch 2
    with a left-padded row: generate() with decode steps replayed from CUDA graphs gives HF eager's tokens (FLA's
    kernels where installed) wherever the two logits' difference cannot have swapped eager's top two, and logits
    within RELEASED_LOGITS_TOL while the tokens agree."""
    from kda_compile.bench import e2e_qwen3_next

    bench = e2e_kimi if family == "kimi_linear" else e2e_qwen3_next
    model = bench.build_model(bench.Shape(), 4, "cuda", torch.float32)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, bench.Shape().vocab, (2, 64), generator=gen).cuda()
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    expected = model.generate(ids, **kwargs)
    model.forward = optimize(model.forward, mode="reduce-overhead")
    got = model.generate(ids, past_key_values=StaticCache(config=model.config, max_cache_len=80), **kwargs)
    report = kda_compile.report(model.forward)
    assert report.cuda_graph_fallbacks == (), str(report)
    assert any(g.cuda_graphs.startswith("cuda graphs: captured") for g in report.graphs), str(report)
    # each of the 3 delta-rule layers writes its recurrent state in place (no copy after the step)
    in_place = {r.site for g in report.graphs for r in g.rewritten if r.rewrite == "delta_rule_state_in_place"}
    assert len(in_place) == 3, str(report)
    for step, (have, want) in enumerate(zip(got.logits, expected.logits)):
        position = ids.shape[1] + step
        if not torch.equal(got.sequences[:, :position], expected.sequences[:, :position]):
            break  # a near tie went the other way at an earlier step: this one decodes other tokens
        error = rel_error(have, want)
        assert error < RELEASED_LOGITS_TOL, (step, error)
        top2 = want.float().topk(2, dim=-1).values
        # a greedy token can flip only where the logits' difference closes the gap between eager's top two
        decided = (top2[:, 0] - top2[:, 1]) > 2 * (have.float() - want.float()).abs().amax(-1)
        assert torch.equal(got.sequences[decided, position], expected.sequences[decided, position]), (step, error)
        print(f"{family} step {step}: logits rel. error {error:.2e}, {int(decided.sum())} of 2 tokens decided")
