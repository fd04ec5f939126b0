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
from unittest import mock

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

import kda_compile
from kda_compile import cuda_graphs, optimize
from kda_compile.bench import e2e_kimi
from kda_compile.report import clear_reports
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
CPU_FAMILIES = ("kimi_linear", "qwen3_next", "llama", "deepseek_v3", "deepseek_v32")
SLIDING = ("gemma3", "gpt_oss")  # HF's sliding-window static layers: not captured yet (see the test below)
ALL_FAMILIES = ("kimi_linear", *(f for f in CONFIGS if f not in SLIDING))
HF_TORCH_FUNCTIONS = {  # HF's module-level kernels bound to FLA / causal-conv1d (CUDA-only) where installed
    "kimi_linear": ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
                    "causal_conv1d_update"),
    "qwen3_next": ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                   "causal_conv1d_update"),
}
PREFILL_PLAN = "cuda graphs: not captured: a prefill graph"


def build(family: str, device: str = "cpu") -> torch.nn.Module:
    if family == "kimi_linear":
        return e2e_kimi.build_model(e2e_kimi.TINY, 4, device, torch.float32)
    config_class, extra = CONFIGS[family]
    if not hasattr(transformers, config_class):
        pytest.skip(f"transformers {transformers.__version__} has no {config_class}")
    config = getattr(transformers, config_class)(**{**_COMMON, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # a zero (pad) embedding makes zero indexer queries: every DSA score ties
        model.get_input_embeddings().weight.normal_()
    return model.to(device).eval()


def batch(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, the first left-padded by three tokens (per-sequence positions in one batch)."""
    ids = torch.randint(3, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids.to(device), mask.to(device)


@contextlib.contextmanager
def hf_torch_path(family: str):
    """HF's torch path where the family's kernels bound FLA / causal-conv1d (CPU tensors need it)."""
    module = {"kimi_linear": "kimi_linear", "qwen3_next": "qwen3_next"}.get(family)
    if module is None:
        yield
        return
    modeling = pytest.importorskip(f"transformers.models.{module}.modeling_{module}")
    with torch_path(modeling, *HF_TORCH_FUNCTIONS[family]):
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


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    clear_reports()
    yield
    torch._dynamo.reset()


def cache_tensors(cache) -> list[torch.Tensor]:
    found = []
    for layer in cache.layers:
        for value in vars(layer).values():
            values = value.values() if isinstance(value, dict) else [value]
            found += [v for v in values if isinstance(v, torch.Tensor) and v.numel() > 1]
    return found


def generate(model, ids, mask, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


@pytest.mark.parametrize("family", CPU_FAMILIES)
def test_static_cache_generate_gives_eager_tokens_and_captures_only_decode(family):
    model = build(family)
    ids, mask = batch()
    with hf_torch_path(family):
        expected = generate(model, ids, mask)
        cache = StaticCache(config=model.config, max_cache_len=PROMPT + NEW_TOKENS)
        with aot_eager_for_inductor() as given:
            model.forward = optimize(model.forward, mode="reduce-overhead", fullgraph=True)
            got = generate(model, ids, mask, past_key_values=cache)
    assert torch.equal(got, expected)
    plans = [g.cuda_graphs for g in kda_compile.report(model.forward).graphs]
    assert len(plans) == 2 and plans[0].startswith(PREFILL_PLAN), plans
    assert plans[1].startswith("cuda graphs: captured"), plans
    assert [p.get(cuda_graphs.CUDAGRAPHS_OPTION) for p in given] == [False, True]
    # every cache tensor the decode graph reads or writes is a static address (none is copied per replay)
    tensors = cache_tensors(cache)
    assert tensors and all(getattr(t, "_dynamo_static_input_type", None) for t in tensors)
    assert kda_compile.report(model.forward).cuda_graph_fallbacks == ()


@pytest.mark.parametrize("family", SLIDING[:1])
def test_sliding_window_static_layers_are_not_captured_and_the_report_names_them(family):
    """HF's StaticSlidingWindowLayer keeps ``cumulative_length_int``, a Python int read inside the decode graph
    that changes every step: a CUDA graph would be recorded per value, so the graph runs without one, with the
    cause in the report; the tokens are still eager's."""
    model = build(family)
    ids, mask = batch()
    expected = generate(model, ids, mask)
    with aot_eager_for_inductor():
        model.forward = optimize(model.forward, mode="reduce-overhead")
        got = generate(model, ids, mask, past_key_values=StaticCache(config=model.config, max_cache_len=16))
    assert torch.equal(got, expected)
    fallbacks = kda_compile.report(model.forward).cuda_graph_fallbacks
    assert any("cumulative_length_int" in line for line in fallbacks), fallbacks


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
