"""Tiny random GDN models of Hugging Face (qwen3_next, qwen3_5, qwen3_5_moe, qwen4_exp, olmo_hybrid) under
kda_compile (fp32, CPU, aot_eager): two layers, one GDN (2 q/k heads of 16, 4 value heads of 8: grouped) and
one full attention, hidden 64, MoE MLPs where the family has them.

Checked: prefill through ``kda_compile.optimize(fullgraph=True)`` (so zero graph breaks: qwen4_exp's
full-attention QSA indexer is traced branch-free, passes/dsa/qsa_indexer.py) gives eager's logits
(relative error < 1e-4: both sides compute the delta rule in fp32 with different chunkings) with one GDN op
per linear-attention layer, each listed in the rewrite report with its entry point, its gate and beta sigmoid
folded into the op's in-kernel options by the prologue rewrite. On qwen3_next (the
others share its GDN layer code) also: ``generate()`` tokens equal eager's with the chunk op in the prefill
graph and the recurrent op in the decode graph; a training step's gradients (dense MLP path excluded
where MoE, see below) match eager; ``dynamic=True`` compiles once for three prompt lengths.
HF's torch path runs whatever is installed (``torch_path``: FLA / causal-conv1d bind CUDA-only kernels).
"""
from __future__ import annotations

import pytest
import torch

import kda_compile
from kda_compile import Config, optimize
from kda_compile.backend import KdaCompileBackend
from kda_compile.testing import rel_error
from hf_kda_binding import torch_path

transformers = pytest.importorskip("transformers")

VOCAB = 128
QUICK = Config(compiler="aot_eager")
GDN_OPS = {"kda_compile::chunk_gdn_fwd": "chunk", "kda_compile::fused_recurrent_gdn_fwd": "recurrent"}
FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
             "causal_conv1d_update")
LOGITS_TOL = 1e-4
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
               max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
FAMILIES = {  # model_type -> (config class, config arguments)
    "qwen3_next": ("Qwen3NextConfig", dict(_COMMON, intermediate_size=96, **_MOE)),
    "qwen3_5": ("Qwen3_5TextConfig", dict(_COMMON, intermediate_size=96)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(_COMMON, **_MOE)),
    "qwen4_exp": ("Qwen4ExpTextConfig", dict(_COMMON, **_MOE, indexer_n_heads=2, indexer_kv_heads=1,
                                             indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4)),
    "olmo_hybrid": ("OlmoHybridConfig", dict(_COMMON, intermediate_size=96)),
}


# Families whose full-attention layers break the graph outside GDN (the GDN layer itself traces whole): none
# now (qwen4_exp's QSA indexer, `if num_complete_blocks > 0`, is traced branch-free: passes/dsa/qsa_indexer.py).
GRAPH_BREAKS_OUTSIDE_GDN: dict[str, str] = {}


def modeling(family: str):
    return pytest.importorskip(f"transformers.models.{family}.modeling_{family}")


def build_model(family: str, seed: int = 0) -> torch.nn.Module:
    name, kwargs = FAMILIES[family]
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    torch.manual_seed(seed)
    config = getattr(transformers, name)(**kwargs)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                         dtype=torch.float32).eval()


def prompt(length: int, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


class GraphCapture:
    """Keeps each Dynamo graph's call targets, then hands it to the kda_compile backend."""

    def __init__(self, config: Config = QUICK) -> None:
        self.backend = KdaCompileBackend(config)
        self.config = config
        self.traced: list[list] = []

    def __call__(self, gm, example_inputs, **kwargs):
        self.traced.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return self.backend(gm, example_inputs, **kwargs)

    def gdn_ops(self, graph: int = -1) -> list[str]:
        names = [getattr(getattr(t, "_schema", None), "name", None) for t in self.traced[graph]]
        return [GDN_OPS[n] for n in names if n in GDN_OPS]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(specialize_float=True):
        yield


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_with_a_gdn_op_per_linear_layer(family):
    module = modeling(family)
    model = build_model(family)
    ids = prompt(9)
    with torch.no_grad(), torch_path(module, *FUNCTIONS):
        # fullgraph: a graph break is an error (except where the model breaks outside GDN, listed above)
        compiled = optimize(model, QUICK, fullgraph=family not in GRAPH_BREAKS_OUTSIDE_GDN)
        out = compiled(ids).logits
        ref = model(ids).logits
    assert rel_error(out, ref) < LOGITS_TOL
    sites = [r for r in kda_compile.report(compiled).rewritten if r.rewrite == "kda_substitution"]
    linear = [f"model.layers.{i}.linear_attn" for i, t in enumerate(FAMILIES[family][1]["layer_types"])
              if t == "linear_attention"]
    # (after a graph break a layer is traced in its own frame: its site path is relative to it)
    assert len(sites) == len(linear) and all(full.endswith(s.site) for full, s in zip(linear, sites)), sites
    for site in sites:  # the prologue rewrite turned the op node into the public call with in-kernel options
        assert site.op == "kda_compile.ops.chunk_gated_delta_rule" and site.details["heads"] == "2/4", site
        assert "torch_chunk_gated_delta_rule" in site.details["entry"], site.details["entry"]
        assert site.details["use_gate_in_kernel"] and site.details["use_beta_sigmoid_in_kernel"], site.details
    folded = [r for r in kda_compile.report(compiled).rewritten if r.rewrite == "kda_prologue"]
    beta = "2 * sigmoid" if family == "olmo_hybrid" else "sigmoid"  # olmo_hybrid: linear_allow_neg_eigval
    assert [r.details for r in folded] == [{"gate": "softplus + dt_bias", "beta": beta}] * len(linear), folded


def test_generate_gives_eager_tokens_with_chunk_and_recurrent_gdn_ops():
    module = modeling("qwen3_next")
    model = build_model("qwen3_next")
    ids = prompt(6)
    ones = torch.ones_like(ids)
    with torch_path(module, *FUNCTIONS):
        expected = model.generate(ids, attention_mask=ones, max_new_tokens=4, do_sample=False)
        cap = GraphCapture()
        model.forward = torch.compile(model.forward, backend=cap, dynamic=True, fullgraph=True)
        try:
            got = model.generate(ids, attention_mask=ones, max_new_tokens=4, do_sample=False)
        finally:
            del model.forward
    assert torch.equal(got, expected)
    assert cap.gdn_ops(0) == ["chunk"] and cap.gdn_ops(-1) == ["recurrent"]


def test_dynamic_prompt_lengths_compile_once():
    module = modeling("qwen3_next")
    model = build_model("qwen3_next")
    cap = GraphCapture()
    compiled = torch.compile(model, backend=cap, dynamic=True, fullgraph=True)
    with torch.no_grad(), torch_path(module, *FUNCTIONS):
        for length in (7, 13, 30):
            ids = prompt(length, seed=length)
            assert rel_error(compiled(ids).logits, model(ids).logits) < LOGITS_TOL
    assert len(cap.traced) == 1, f"{len(cap.traced)} graphs for 3 prompt lengths"
    assert cap.gdn_ops() == ["chunk"]


def test_training_step_gradients_match():
    """qwen3_5 (dense MLP): a MoE backward under torch.compile fails on a data-dependent size in
    transformers' grouped-mm fallback, GDN or not (tests/models/test_kimi_linear.py)."""
    module = modeling("qwen3_5")
    model = build_model("qwen3_5").train()
    ids = prompt(12)
    with torch_path(module, *FUNCTIONS):
        optimize(model, QUICK, fullgraph=True)(ids, labels=ids, use_cache=False).loss.backward()
        got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        model(ids, labels=ids, use_cache=False).loss.backward()
    gdn_params = [n for n in got if ".linear_attn." in n]
    assert gdn_params and len(got) == len([p for p in model.parameters() if p.grad is not None])
    scale = torch.cat([model.get_parameter(n).grad.flatten() for n in got]).norm()
    for name, grad in got.items():
        ref = model.get_parameter(name).grad
        # A gradient a thousand times below the model's (dt_bias at initialisation: ~1e-7, a sum of
        # cancelling per-token terms) keeps fp32 cancellation noise of ~1e-3 of itself: 1e-2 there.
        tol = 1e-2 if ref.norm() < 1e-3 * scale else 1e-4
        assert rel_error(grad, ref) < tol, name


def test_qwen3_next_benchmark_smoke_run_on_cpu():
    """``python -m kda_compile.bench e2e --model qwen3_next`` at tiny widths on CPU (kda_compile on aot_eager;
    Inductor is left to the GPU run): every configuration either measures or records why it could not, and the
    compiled model agrees with HF's torch fallback, prefill logits and decode tokens."""
    from transformers.models.qwen3_next import modeling_qwen3_next

    from kda_compile.bench import e2e_hybrid, e2e_qwen3_next

    opts = e2e_hybrid.smoke_options(e2e_qwen3_next.MODEL)
    with torch_path(modeling_qwen3_next, "causal_conv1d_fn", "causal_conv1d_update"):  # the benchmark switches GDN's
        rows, failures, summary = e2e_hybrid.measure(e2e_qwen3_next.MODEL, opts)
    measured = {(r["op"], r["provider"]) for r in rows if r["p50"] > 0}
    for config in ("hf_eager_torch", "kda_compile"):
        assert {("qwen3_next_prefill", config), ("qwen3_next_decode", config)} <= measured, failures
    assert summary["tokens"]["kda_compile"] == summary["tokens"]["hf_eager_torch"]
    (T,) = opts.prompts
    assert rel_error(summary["logits"]["kda_compile"][T], summary["logits"]["hf_eager_torch"][T]) < 1e-4
    # hf_eager_fla needs FLA's Triton kernels on CUDA tensors: on CPU it records a failure, naming the missing FLA
    # where HF did not bind it
    assert "hf_eager_fla" in failures, failures
    if not e2e_hybrid.bound_implementation(e2e_qwen3_next.MODEL).startswith("fla."):
        assert "flash-linear-attention was not importable" in failures["hf_eager_fla"]
