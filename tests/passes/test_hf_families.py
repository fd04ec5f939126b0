"""The softmax-attention rewrite on tiny Hugging Face models of every targeted family.

For each family (see families.py): the compiled graph holds one attention op per attention layer
and no attention softmax or repeat_kv; logits match eager (fp32: relative error < 1e-5, bf16:
< 3e-2 since eager rounds the probabilities to bf16 and the op does not); a training step's
gradients match (fp32: < 1e-4 per parameter); greedy generate() gives eager's tokens; Dynamo
sees no graph break; prompts of other lengths under dynamic=True reuse the graph.
"""
from __future__ import annotations

import pytest
import torch

from kda_compile.config import Config

from hf_kda_binding import torch_path

from .families import FAMILIES, KIMI_WITH_KDA, VOCAB, build_model
from .graph_capture import GraphCapture

# This file checks the softmax-attention rewrite; the MLA layers of deepseek_v3 / kimi_linear would
# otherwise become mla_attention (tests/models/test_mla_models.py covers that).
SOFTMAX_ONLY = Config(compiler="aot_eager", mla_absorb=False)

NAMES = sorted(FAMILIES)
OTHER_SOFTMAXES = {"gpt_oss": 2}  # MoE router softmaxes: not attention, not candidates
FP32_TOL, BF16_TOL, GRAD_TOL = 1e-5, 3e-2, 1e-4
# Training under torch.compile: transformers 5.17's default fp32 MoE path (a grouped-mm fallback whose
# backward branches on each expert's token count) and its "eager" experts (a loop over data-dependent
# token counts) both fail AOT autograd with a data-dependent guard, whatever the backend (plain
# "aot_eager" too; passes with 5.23). The MoE is not what this file tests: train it through batched_mm.
TRAINING_CONFIG = {"gpt_oss": {"_experts_implementation": "batched_mm"}}


@pytest.fixture(autouse=True)
def constant_float_attributes():
    """Float module attributes (``scaling``, ``variance_epsilon``...) as constants: under dynamic
    shapes Dynamo otherwise traces them as symbols, then restarts its analysis once to specialise
    them, doubling the tracing time of every test here. The symbolic path is tested on a small
    module in test_softmax_attention.py (test_symbolic_float_attributes_are_specialised)."""
    with torch._dynamo.config.patch(specialize_float=True):
        yield


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "NaN or inf in the compiled result"
    return float((a - b).norm() / b.norm())


def prompt(length: int, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_rewritten(cap: GraphCapture, name: str, graph: int = -1) -> None:
    layers = FAMILIES[name].attention_layers
    report = cap.reports[graph]
    assert cap.attention_calls(graph) == layers, report.summary()
    assert cap.softmaxes(graph) == OTHER_SOFTMAXES.get(name, 0), cap.after[graph].code
    assert cap.repeat_kv_expands(graph) == 0
    assert len(report.rewritten) == layers and not report.left_alone, report.summary()


@pytest.mark.parametrize("name", NAMES)
def test_fp32_logits_match_and_lengths_reuse_the_graph(name):
    model = build_model(name)
    cap = GraphCapture(SOFTMAX_ONLY)
    compiled = torch.compile(model, backend=cap, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for i, length in enumerate((5, 9, 13)):
            ids = prompt(length, seed=i)
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                out = compiled(ids).logits
            assert rel_err(out, model(ids).logits) < FP32_TOL
    assert_rewritten(cap, name)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_logits_match(name):
    model = build_model(name, dtype=torch.bfloat16)
    cap = GraphCapture(SOFTMAX_ONLY)
    ids = prompt(8)
    with torch.no_grad():
        out = torch.compile(model, backend=cap, fullgraph=True)(ids).logits
        ref = model(ids).logits
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < BF16_TOL
    assert_rewritten(cap, name)


@pytest.mark.parametrize("name", NAMES)
def test_training_step_gradients_match(name):
    model = build_model(name, **TRAINING_CONFIG.get(name, {})).train()
    ids = prompt(8)
    cap = GraphCapture(SOFTMAX_ONLY)
    torch.compile(model, backend=cap, fullgraph=True)(ids, labels=ids).loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    assert got, "no gradient reached the parameters"
    for n, p in model.named_parameters():
        if p.grad is not None and p.grad.norm() > 0:
            assert rel_err(got[n], p.grad) < GRAD_TOL, n
    assert_rewritten(cap, name)


def test_attention_dropout_in_training_reaches_the_op():
    model = build_model("qwen2", attention_dropout=0.2).train()
    ids = prompt(8)
    cap = GraphCapture(SOFTMAX_ONLY)
    compiled = torch.compile(model, backend=cap, fullgraph=True)
    losses = [compiled(ids, labels=ids).loss for _ in range(2)]
    losses[0].backward()
    assert cap.after[-1].attention_kwargs[0]["dropout_p"] == 0.2
    assert float(losses[0]) != float(losses[1])  # fresh dropout masks
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():  # in eval, dropout is off and the logits are eager's
        model.eval()
        assert rel_err(compiled(ids).logits, model(ids).logits) < FP32_TOL


@pytest.mark.parametrize("name", NAMES)
def test_generate_gives_eager_tokens(name):
    model = build_model(name)
    ids = prompt(6)
    ones = torch.ones_like(ids)
    expected = model.generate(ids, attention_mask=ones, max_new_tokens=3, do_sample=False)
    cap = GraphCapture(SOFTMAX_ONLY)
    model.forward = torch.compile(model.forward, backend=cap, dynamic=True, fullgraph=True)
    try:
        got = model.generate(ids, attention_mask=ones, max_new_tokens=3, do_sample=False)
    finally:
        del model.forward  # back to the class's forward
    assert torch.equal(got, expected)
    assert cap.graphs >= 2  # prefill and decode
    for graph in range(cap.graphs):
        assert cap.attention_calls(graph) == FAMILIES[name].attention_layers, cap.reports[graph].summary()


@pytest.mark.parametrize("name", NAMES)
def test_no_graph_break(name):
    explanation = torch._dynamo.explain(build_model(name))(prompt(8))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons


def test_kimi_linear_mla_layer_beside_a_kda_layer():
    # HF's torch KDA path whatever transformers bound (FLA's kernels cannot run these CPU tensors).
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    model = build_model(KIMI_WITH_KDA.name)
    cap = GraphCapture(SOFTMAX_ONLY)
    ids = prompt(8)
    with torch.no_grad(), torch_path(kimi, "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"):
        out = torch.compile(model, backend=cap, fullgraph=True)(ids).logits
        assert rel_err(out, model(ids).logits) < FP32_TOL
    assert cap.attention_calls() == 1 and cap.softmaxes() == 0
    (site,) = [r for r in cap.reports[-1].rewritten if r.rewrite == "softmax_attention"]
    assert site.site == "model.layers.1.self_attn" and site.details["heads"] == "2/2"


@pytest.mark.parametrize("name", ["llama", "gpt_oss"])
def test_output_attentions_is_left_alone_and_reported(name):
    model = build_model(name)
    ids = prompt(7)
    cap = GraphCapture(SOFTMAX_ONLY)
    with torch.no_grad():  # (HF breaks the graph to collect the attentions: no fullgraph)
        out = torch.compile(model, backend=cap)(ids, output_attentions=True)
        ref = model(ids, output_attentions=True)
    assert all(cap.attention_calls(g) == 0 for g in range(cap.graphs))
    assert not any(r.rewritten for r in cap.reports)
    left = [c for r in cap.reports for c in r.left_alone]
    assert len(left) == FAMILIES[name].attention_layers
    assert all("output_attentions" in c.reason and "(matmul)" in c.reason for c in left), left
    assert rel_err(out.logits, ref.logits) < FP32_TOL
    for a, b in zip(out.attentions, ref.attentions):
        assert rel_err(a, b) < FP32_TOL


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_left_padded_batch_uses_a_key_padding_mask(name):
    model = build_model(name)
    ids = prompt(9)
    padding = torch.ones_like(ids)
    padding[0, :4] = 0
    cap = GraphCapture(SOFTMAX_ONLY)
    with torch.no_grad():
        out = torch.compile(model, backend=cap, fullgraph=True)(ids, attention_mask=padding).logits
        ref = model(ids, attention_mask=padding).logits
    real = padding.bool()  # padding positions have no key to attend: their logits are unused
    assert rel_err(out[real], ref[real]) < FP32_TOL
    assert_rewritten(cap, name)
    for site in cap.reports[-1].rewritten:
        assert site.details["is_causal"] and site.details["mask"].startswith("key padding"), site
