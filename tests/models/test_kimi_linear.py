"""A tiny Hugging Face Kimi-Linear under kda_compile (random weights, fp32, CPU, aot_eager).

The model: three decoder layers, KDA / MLA (full attention) / KDA as the released model
interleaves them, hidden 64, 2 heads of 16 (KDA) and 2 MLA heads (kv_lora 32, nope 16, rope 8,
v 16), a MoE MLP with 4 experts (2 active) on the MLA layer (dense MLPs for the training test).
The model runs HF's torch path whatever is installed (the ``hf_torch_path`` fixture: an installed
flash-linear-attention binds HF's KDA functions to FLA's Triton kernels, which need CUDA tensors);
kda_compile substitutes HF's torch references at trace time (passes/substitution/install.py). Where
HF bound FLA, prefill is also compiled as installed (FLA's entry points substituted) and checked
against the torch path.

Checked: prefill logits match eager (relative error < 1e-5: both sides compute KDA in fp32, the
chunked algorithms differ only in rounding); ``generate()`` gives eager's tokens with prefill and
decode graphs holding our chunk and recurrent ops; a training step's gradients match (< 1e-4 per
parameter); ``torch._dynamo.explain`` finds one graph and no break for prefill and for decode;
three prompt lengths compile at most once after the first; the graphs hold one KDA op per KDA
layer and nothing of HF's unrolled chunk loop; the report lists the KDA sites with their entry
point and source line; the end-to-end benchmark's CPU smoke run. The MLA layer is left to
whatever MLA / attention rewrite is registered: nothing here depends on it.
"""
from __future__ import annotations

import pytest
import torch

import kda_compile
from kda_compile import Config, optimize
from kda_compile.backend import KdaCompileBackend
from kda_compile.testing import rel_error
from hf_kda_binding import binding, torch_bound, torch_path

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "KimiLinearConfig"):
    pytest.skip(f"transformers {transformers.__version__} has no KimiLinear", allow_module_level=True)
from transformers.models.kimi_linear import modeling_kimi_linear as modeling  # noqa: E402

KDA_FUNCTIONS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")
CONV_FUNCTIONS = ("causal_conv1d_fn", "causal_conv1d_update")  # causal-conv1d's CUDA kernels when installed

VOCAB = 128
LAYERS = ("linear_attention", "full_attention", "linear_attention")
KDA_LAYERS = LAYERS.count("linear_attention")
FP32_TOL, GRAD_TOL = 1e-5, 1e-4
QUICK = Config(compiler="aot_eager")
KDA_OPS = {"kda_compile::chunk_kda_fwd": "chunk", "kda_compile::fused_recurrent_kda_fwd": "recurrent"}
UNROLLED_CHUNK_LOOP = ("torch.eye", "torch.triu")  # in the traced code of HF's chunk reference only


@pytest.fixture
def hf_torch_path():
    """HF's torch path for the test's duration, whatever is installed: each of the modeling
    module's KDA and causal-conv names whose wrapper bound FLA / causal-conv1d (CUDA-only kernels)
    points at HF's torch reference; wrappers bound to the reference stay (tests/hf_kda_binding.py)."""
    with torch_path(modeling, *KDA_FUNCTIONS, *CONV_FUNCTIONS):
        yield


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """An empty Dynamo cache per test, and float module attributes (``scaling``, eps...) as
    constants: under dynamic shapes Dynamo otherwise traces them as symbols, then restarts its
    analysis to specialise them, tracing every graph twice (see tests/passes/test_hf_families.py)."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(specialize_float=True):
        yield


def build_model(seed: int = 0, mlp: tuple[str, ...] = ("dense", "sparse", "dense")) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=len(LAYERS), layer_types=list(LAYERS), mlp_layer_types=list(mlp),
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4,
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    return model.eval()


def prompt(length: int, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


class GraphCapture:
    """A torch.compile backend keeping each Dynamo graph as traced (code, call targets) before
    handing it to the kda_compile backend (``config``: aot_eager). Like tests/passes/graph_capture.py,
    which this folder cannot import (tests/test_packaging.py forbids a top-level ``passes`` import)."""

    def __init__(self, config: Config = QUICK) -> None:
        self.backend = KdaCompileBackend(config)
        self.config = config  # what kda_compile's trace-time substitution consults
        self.traced: list[tuple[str, list]] = []

    def __call__(self, gm, example_inputs, **kwargs):
        self.traced.append((gm.code, [n.target for n in gm.graph.nodes if n.op == "call_function"]))
        return self.backend(gm, example_inputs, **kwargs)

    @property
    def graphs(self) -> int:
        return len(self.traced)


def kda_ops(cap: GraphCapture, graph: int = -1) -> list[str]:
    """The kinds ("chunk" / "recurrent") of the KDA ops Dynamo traced into a graph."""
    names = [getattr(getattr(t, "_schema", None), "name", None) for t in cap.traced[graph][1]]
    return [KDA_OPS[n] for n in names if n in KDA_OPS]


def assert_no_unrolled_loop(cap: GraphCapture, graph: int = -1) -> None:
    code = cap.traced[graph][0]
    assert not any(marker in code for marker in UNROLLED_CHUNK_LOOP), code


@pytest.mark.parametrize("compiled_binding", ["torch", "installed"])
def test_prefill_logits_match_and_report_lists_the_kda_sites(compiled_binding):
    """Compiled on HF's torch path, or as installed when HF bound FLA (FLA's entry points
    substituted); the eager reference is HF's torch path."""
    wrapper = modeling.chunk_kimi_delta_attention
    if compiled_binding == "installed" and torch_bound(wrapper):
        pytest.skip(f"HF's chunk_kimi_delta_attention is bound to {binding(wrapper)}: the torch case covers it")
    model = build_model()
    ids = prompt(9)
    compiled = optimize(model, QUICK, fullgraph=True)
    with torch.no_grad():
        with torch_path(modeling, *CONV_FUNCTIONS, *(KDA_FUNCTIONS if compiled_binding == "torch" else ())):
            out = compiled(ids).logits
        with torch_path(modeling, *KDA_FUNCTIONS, *CONV_FUNCTIONS):
            ref = model(ids).logits
    assert rel_error(out, ref) < FP32_TOL
    entry = ("transformers chunk_kimi_delta_attention" if compiled_binding == "torch"
             else "fla chunk_kda via HF wrapper")
    sites = [r for r in kda_compile.report(compiled).rewritten if r.rewrite == "kda_substitution"]
    assert [s.site for s in sites] == ["model.layers.0.self_attn", "model.layers.2.self_attn"], sites
    for site in sites:
        assert site.details["kind"] == "chunk" and site.details["heads"] == "2/2"
        assert site.details["entry"].startswith(entry), site.details["entry"]
        assert site.source.startswith("modeling_kimi_linear.py:")
    # One line per site: a KDA layer whose call was substituted and whose prologue was folded is one
    # site with two rewrites, not two sites.
    (graph,) = kda_compile.report(compiled).graphs
    assert set(graph.sites()) >= {"model.layers.0.self_attn", "model.layers.2.self_attn"}
    summary = graph.summary().splitlines()
    assert summary[0].startswith(f"graph {graph.graph} of KimiLinearForCausalLM.forward: "
                                 f"{len(graph.sites())} site(s) rewritten"), summary[0]
    assert sum(line.startswith("  rewritten   model.layers.0.self_attn") for line in summary) == 1, summary


def test_graph_holds_our_ops_and_no_unrolled_loop(hf_torch_path):
    model = build_model()
    cap = GraphCapture()
    with torch.no_grad():
        torch.compile(model, backend=cap, fullgraph=True)(prompt(70))  # two chunks of 64
    assert cap.graphs == 1
    assert kda_ops(cap) == ["chunk"] * KDA_LAYERS
    assert_no_unrolled_loop(cap)


def test_generate_gives_eager_tokens_with_chunk_and_recurrent_ops(hf_torch_path):
    model = build_model()
    ids = prompt(6)
    ones = torch.ones_like(ids)
    expected = model.generate(ids, attention_mask=ones, max_new_tokens=5, do_sample=False)
    cap = GraphCapture()
    model.forward = torch.compile(model.forward, backend=cap, dynamic=True, fullgraph=True)
    try:
        got = model.generate(ids, attention_mask=ones, max_new_tokens=5, do_sample=False)
    finally:
        del model.forward  # back to the class's forward
    assert torch.equal(got, expected)
    assert cap.graphs == 2, [kda_ops(cap, g) for g in range(cap.graphs)]  # prefill, then one decode graph
    assert kda_ops(cap, 0) == ["chunk"] * KDA_LAYERS and kda_ops(cap, 1) == ["recurrent"] * KDA_LAYERS
    for graph in range(cap.graphs):
        assert_no_unrolled_loop(cap, graph)


def test_optimize_forward_for_generate(hf_torch_path):
    model = build_model()
    ids = prompt(5, batch=1)
    expected = model.generate(ids, max_new_tokens=4, do_sample=False)
    model.forward = optimize(model.forward, QUICK, dynamic=True)
    try:
        got = model.generate(ids, max_new_tokens=4, do_sample=False)
        report = kda_compile.report(model.forward)
    finally:
        del model.forward
    assert torch.equal(got, expected)
    kinds = {r.details["kind"] for r in report.rewritten if r.rewrite == "kda_substitution"}
    assert kinds == {"chunk", "recurrent"}, report


def test_training_step_gradients_match(hf_torch_path):
    # Dense MLPs: under torch.compile, transformers 5.17's MoE backward (integrations/moe.py,
    # _grouped_mm_fallback_backward) guards on a data-dependent size and fails, KDA or not.
    model = build_model(mlp=("dense",) * len(LAYERS)).train()
    ids = prompt(12)
    optimize(model, QUICK, fullgraph=True)(ids, labels=ids, use_cache=False).loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model(ids, labels=ids, use_cache=False).loss.backward()
    kda_params = [n for n in got if ".self_attn." in n and ("layers.0." in n or "layers.2." in n)]
    assert kda_params, "no gradient reached the KDA layers"
    for name, p in model.named_parameters():
        if p.grad is not None and p.grad.norm() > 0:
            assert rel_error(got[name], p.grad) < GRAD_TOL, name


def test_no_graph_break_for_prefill_and_decode(hf_torch_path):
    model = build_model()
    ids = prompt(7)
    explanation = torch._dynamo.explain(model)(ids)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    torch._dynamo.reset()
    step = prompt(1, seed=1)
    with torch.no_grad():  # as generate() runs (with gradients, decode takes the differentiable chunk op)
        explanation = torch._dynamo.explain(model)(step, past_key_values=cache, use_cache=True,
                                                   attention_mask=torch.ones(2, 8, dtype=torch.long))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    graph_code = "\n".join(g.code for g in explanation.graphs)
    assert graph_code.count("kda_compile.fused_recurrent_kda_fwd") == KDA_LAYERS


def test_three_prompt_lengths_compile_at_most_once_after_the_first(hf_torch_path):
    model = build_model()
    cap = GraphCapture()
    compiled = torch.compile(model, backend=cap, fullgraph=True)  # dynamic=None: automatic dynamic shapes
    with torch.no_grad():
        for i, length in enumerate((5, 11, 17)):
            ids = prompt(length, seed=i)
            out = compiled(ids, use_cache=False).logits
            assert rel_error(out, model(ids, use_cache=False).logits) < FP32_TOL, length
    assert cap.graphs <= 2, cap.graphs
    assert kda_ops(cap) == ["chunk"] * KDA_LAYERS


def test_benchmark_smoke_run_on_cpu():
    """``python -m kda_compile.bench e2e --model kimi_linear`` at tiny widths on CPU (kda_compile on
    aot_eager; Inductor is left to the GPU run): every configuration either measures or records why
    it could not, and the compiled model agrees with HF's torch fallback."""
    from kda_compile.bench import e2e_hybrid, e2e_kimi

    opts = e2e_hybrid.smoke_options(e2e_kimi.MODEL)
    with torch_path(modeling, *CONV_FUNCTIONS):  # the benchmark switches only the KDA functions
        rows, failures, summary = e2e_hybrid.measure(e2e_kimi.MODEL, opts)
    measured = {(r["op"], r["provider"]) for r in rows if r["p50"] > 0}
    for config in ("hf_eager_torch", "kda_compile"):
        assert {("kimi_linear_prefill", config), ("kimi_linear_decode", config)} <= measured, failures
    assert summary["tokens"]["kda_compile"] == summary["tokens"]["hf_eager_torch"]
    (T,) = opts.prompts
    assert rel_error(summary["logits"]["kda_compile"][T], summary["logits"]["hf_eager_torch"][T]) < FP32_TOL
    # hf_eager_fla runs FLA's Triton kernels, which need CUDA tensors: on CPU it records a failure,
    # naming the missing FLA where HF did not bind it (kda_compile above ran HF as installed)
    assert "hf_eager_fla" in failures, failures
    if not e2e_hybrid.bound_implementation(e2e_kimi.MODEL).startswith("fla."):
        assert "flash-linear-attention was not importable" in failures["hf_eager_fla"]
