"""The MLA rewrite on tiny Hugging Face MLA models (random weights, fp32, CPU, aot_eager).

Models: DeepseekV3 with q LoRA and YaRN, a DeepSeek-V2-Lite-like
DeepseekV2 (no q LoRA: plain q_proj; YaRN; complex-number rotary) and KimiLinear's MLA layer
(no q LoRA, no rotary, the real 128 / 64 / 128 head dims). Kimi-Linear's KDA layers are another
rewrite's business: the model here has only its MLA layer.

Checked for each: ``generate()`` under ``torch.compile(model.forward)`` gives eager's tokens; every
graph holds one ``mla_attention`` per layer and no ``kv_b_proj``; in the decode graph (one query)
the op reads the latent and rope-key caches as Hugging Face caches them ([B, 1, T, R] and
[B, 1, T, Dr], the cache update's torch.cat); the scale is the module's ``scaling`` (YaRN mscale
included); prefill logits match eager (relative error < 1e-5) for several prompt lengths with one
dynamic graph; a training step's gradients match (< 1e-4 per parameter); a left-padded batch
generates eager's tokens. With the ``softmax_attention`` rewrite before it (the default), and for
one model each without it (the eager-attention path is fuzzed in tests/passes/test_mla_absorb.py);
one layer per model and few combinations: CI runs on 2 CPU cores.
"""
from __future__ import annotations

import pytest
import torch

from kda_compile.config import Config
from kda_compile.ops.mla import mla_attention
from kda_compile.testing import rel_error
from mla_capture import MLACapture, kv_b_linears

transformers = pytest.importorskip("transformers")

VOCAB = 96
FP32_TOL, GRAD_TOL = 1e-5, 1e-4
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def _config(class_name: str, **kwargs):
    cls = getattr(transformers, class_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    base.update(kwargs)
    return cls(**base)


def _moe(**kwargs):
    return dict(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32, **kwargs)


CONFIGS = {
    # DeepSeek-V3 / Kimi-K2 shape: q LoRA, interleaved rotary, YaRN mscale in the scale
    "deepseek_v3": lambda: _config("DeepseekV3Config", q_lora_rank=24, rope_parameters=dict(YARN),
                                   **_moe(first_k_dense_replace=1)),
    # DeepSeek-V2-Lite shape: no q LoRA (q_proj), complex rotary, YaRN
    "deepseek_v2_lite": lambda: _config("DeepseekV2Config", q_lora_rank=None, rope_parameters=dict(YARN),
                                        **_moe(first_k_dense_replace=1, n_shared_experts=1)),
    # Kimi-Linear's MLA layer: no q LoRA, no rotary (the 64 "rope" dims are never rotated)
    "kimi_linear": lambda: _config("KimiLinearConfig", num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None,
                                   qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_local_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=32, linear_head_dim=16,
                                   linear_num_heads=2, layer_types=["full_attention"], mlp_layer_types=["dense"]),
}
NAMES = sorted(CONFIGS)
# (model, softmax_attention rewrite on): every model after the attention rewrite, one on eager attention
WITH_AND_WITHOUT_ATTENTION_REWRITE = [*((n, True) for n in NAMES), ("deepseek_v2_lite", False)]


def build_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="eager",
                                                         dtype=torch.float32).eval()


def attention_modules(model) -> list:
    return [m for m in model.modules() if hasattr(m, "kv_b_proj")]


@pytest.fixture(autouse=True)
def fresh_dynamo_and_constant_floats():
    """A fresh Dynamo cache per test, and float attributes (``scaling``) as constants: otherwise
    Dynamo restarts its analysis once per graph to specialise them (the symbolic path is tested in
    tests/passes/test_mla_absorb.py)."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(specialize_float=True):
        yield


def capture_for(softmax_attention: bool) -> MLACapture:
    return MLACapture(Config(compiler="aot_eager", softmax_attention=softmax_attention))


def assert_every_graph_rewritten(cap: MLACapture, model) -> None:
    layers = attention_modules(model)
    for g in range(len(cap.graphs)):
        report = cap.reports[g]
        sites = [r for r in report.rewritten if r.rewrite == "mla_absorb"]
        assert len(sites) == len(layers), report.summary()
        assert not [c for c in report.left_alone if c.rewrite == "mla_absorb"], report.summary()
        assert cap.kv_b_linears_before[g] == len(layers) and not kv_b_linears(cap.graphs[g]), cap.graphs[g].code
        calls = cap.calls(mla_attention, g)
        assert len(calls) == len(layers)
        assert sorted(c.kwargs["scale"] for c in calls) == sorted(m.scaling for m in layers)  # the graph's own
        for site in sites:
            layer = layers[0]
            assert (site.details["heads"], site.details["nope"], site.details["rope"], site.details["v"],
                    site.details["kv_lora_rank"]) == (layer.num_heads, layer.qk_nope_head_dim,
                                                      layer.qk_rope_head_dim, layer.v_head_dim, layer.kv_lora_rank)


def assert_decode_reads_the_latent_cache(cap: MLACapture, model) -> None:
    """Some graph has one query per sequence; its op reads the cache update's [B, 1, T, R] / [B, 1, T, Dr]
    (torch.cat of the cache and the new token) directly."""
    layer = attention_modules(model)[0]
    decode = [g for g in range(len(cap.graphs)) if cap.calls(mla_attention, g)
              and cap.calls(mla_attention, g)[0].args[0].meta["example_value"].shape[2] == 1]
    assert decode, "no decode graph was compiled"
    for call in cap.calls(mla_attention, decode[-1]):
        latent, rope = call.args[2], call.args[3]
        for node, width in ((latent, layer.kv_lora_rank), (rope, layer.qk_rope_head_dim)):
            value = node.meta["example_value"]
            assert value.dim() == 4 and value.shape[1] == 1 and value.shape[3] == width
            assert node.target is torch.cat and node.args[0][0].op == "placeholder", node.format_node()


def generate(model, ids, mask, cap=None, new=3):
    if cap is None:
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    model.forward = torch.compile(model.forward, backend=cap, dynamic=True, fullgraph=True)
    try:
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    finally:
        del model.forward  # back to the class's forward


def prompt(length: int, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name,softmax_attention", WITH_AND_WITHOUT_ATTENTION_REWRITE)
def test_generate_gives_eager_tokens_and_decodes_from_the_latent_cache(name, softmax_attention):
    model = build_model(name)
    ids = prompt(6)
    mask = torch.ones_like(ids)
    expected = generate(model, ids, mask)
    cap = capture_for(softmax_attention)
    assert torch.equal(generate(model, ids, mask, cap), expected)
    assert len(cap.graphs) >= 2  # prefill and decode
    assert_every_graph_rewritten(cap, model)
    assert_decode_reads_the_latent_cache(cap, model)


@pytest.mark.parametrize("name", ["deepseek_v3"])
def test_left_padded_batch_generates_eager_tokens(name):
    model = build_model(name)
    ids = prompt(7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    expected = generate(model, ids, mask)
    cap = capture_for(True)
    assert torch.equal(generate(model, ids, mask, cap), expected)
    assert_every_graph_rewritten(cap, model)
    assert_decode_reads_the_latent_cache(cap, model)
    masks = {s.details["mask"].split(" ")[0] for r in cap.reports for s in r.rewritten if s.rewrite == "mla_absorb"}
    assert masks <= {"bool", "additive"} and masks, masks  # the padding reaches the op


@pytest.mark.parametrize("name", NAMES)
def test_prefill_logits_match_and_lengths_reuse_the_graph(name):
    model = build_model(name)
    cap = capture_for(True)
    compiled = torch.compile(model, backend=cap, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for i, length in enumerate((5, 9, 12)):
            ids = prompt(length, seed=i)
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                out = compiled(ids).logits
            assert rel_error(out, model(ids).logits) < FP32_TOL
    assert len(cap.graphs) == 1
    assert_every_graph_rewritten(cap, model)


@pytest.mark.parametrize("name,softmax_attention", [*((n, True) for n in NAMES), ("kimi_linear", False)])
def test_training_step_gradients_match(name, softmax_attention):
    model = build_model(name).train()
    ids = prompt(8)
    cap = capture_for(softmax_attention)
    torch.compile(model, backend=cap, fullgraph=True)(ids, labels=ids).loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    assert any("kv_b_proj" in n for n in got), "no gradient reached kv_b_proj"
    for n, p in model.named_parameters():
        if p.grad is not None and p.grad.norm() > 0:
            assert rel_error(got[n], p.grad) < GRAD_TOL, n
    assert_every_graph_rewritten(cap, model)


def test_yarn_scale_reaches_the_op_unchanged():
    """DeepSeek's YaRN multiplies the softmax scale by mscale**2: the op gets the module's value
    (checked for every site by assert_every_graph_rewritten), not (Dn + Dr) ** -0.5."""
    for name in ("deepseek_v3", "deepseek_v2_lite"):
        layer = attention_modules(build_model(name))[0]
        assert abs(layer.scaling - layer.qk_head_dim ** -0.5) > 1e-3, name
