"""The op's inputs are exactly what Hugging Face's MLA layers hold: run tiny DeepseekV3 / KimiLinear
attention layers (random weights, float64, eager attention, a DynamicCache, left-padded batched
generation), capture the latent cache that ``expand_kv`` receives plus the query, mask and scaling
that the attention function receives, and check that ``mla_attention`` on them reproduces the
layer's attention output in both forms: prefill, a decode step, a chunk (tolerances: check_call).
"""
import pytest
import torch

from kda_compile.ops.mla import mla_attention
from kda_compile.testing import assert_rel_close

from .naive import naive_mla

transformers = pytest.importorskip("transformers")


class Capture:
    """Wraps a layer's ``expand_kv`` and its module's eager attention function, recording the
    arguments (latent cache, query, mask, scaling) and the attention output of the last call."""

    def __init__(self, layer, modeling, monkeypatch):
        self.calls = []
        original_expand = layer.expand_kv
        original_attention = modeling.eager_attention_forward

        def expand_kv(kv_nope, k_rot):
            self.latent = (kv_nope, k_rot)
            return original_expand(kv_nope, k_rot)

        def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
            out, weights = original_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
            self.calls.append(dict(latent=self.latent, query=query, mask=attention_mask, scaling=scaling, out=out))
            return out, weights

        monkeypatch.setattr(layer, "expand_kv", expand_kv)
        monkeypatch.setattr(modeling, "eager_attention_forward", attention)


def check_call(call, nope_dim, kv_b_weight):
    """mla_attention on the captured HF inputs against HF's output ([B, Sq, H, Dv]).

    HF's eager softmax runs in float32 even in a float64 model, so HF is matched to 1e-6 and the
    float64 oracle on the same captured inputs to 1e-10. Query rows whose every key is padding are
    left out of the HF comparison: the float32 cast turns HF's ``finfo(float64).min`` mask into -inf
    there, and those rows are NaN in HF."""
    query, (kv_nope, k_rot) = call["query"], call["latent"]
    assert kv_nope.dim() == 4 and kv_nope.shape[1] == 1, "HF caches the latent as [B, 1, T, R]"
    mask = call["mask"]
    live = (mask > torch.finfo(mask.dtype).min).any(dim=-1)[:, 0]  # [B, Sq]: the row sees some key
    assert torch.isfinite(call["out"][live]).all() and torch.isnan(call["out"][~live]).all()
    for path in ("absorbed", "expanded", "auto"):
        out = mla_attention(query[..., :nope_dim], query[..., nope_dim:], kv_nope, k_rot, kv_b_weight,
                            scale=call["scaling"], attn_mask=mask, path=path)
        assert_rel_close(out.transpose(1, 2)[live], call["out"][live], 1e-6, name=f"vs HF ({path})")
        oracle = naive_mla(query[..., :nope_dim], query[..., nope_dim:], kv_nope, k_rot, kv_b_weight,
                           scale=call["scaling"], attn_mask=mask)
        assert_rel_close(out, oracle, 1e-10, name=f"vs the float64 oracle ({path})")


def _generate_steps(model, capture, vocab, hidden_input=False):
    """Prefill a left-padded batch of 2, then one decode step and a 3-token chunk."""
    gen = torch.Generator().manual_seed(0)
    cache = transformers.DynamicCache(config=model.config)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    ids = torch.randint(0, vocab, (2, 7), generator=gen)
    model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    for new in (1, 3):
        mask = torch.cat([mask, torch.ones(2, new, dtype=mask.dtype)], dim=1)
        ids = torch.randint(0, vocab, (2, new), generator=gen)
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert [c["query"].shape[2] for c in capture.calls] == [7, 1, 3]
    assert [c["latent"][0].shape[2] for c in capture.calls] == [7, 8, 11]
    return capture.calls


def test_deepseek_v3_attention_inputs(monkeypatch):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as modeling

    config = transformers.DeepseekV3Config(
        vocab_size=50, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, max_position_embeddings=256, attn_implementation="eager",
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                      "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    )
    torch.manual_seed(0)
    model = modeling.DeepseekV3Model(config).double().eval()
    layer = model.layers[0].self_attn
    assert layer.scaling != pytest.approx((16 + 8) ** -0.5), "YaRN's mscale must be in the scale under test"
    capture = Capture(layer, modeling, monkeypatch)
    with torch.no_grad():
        calls = _generate_steps(model, capture, config.vocab_size)
    assert calls[0]["mask"] is not None and calls[0]["mask"].dtype == torch.float64  # HF's additive padding mask
    for call in calls:
        check_call(call, layer.qk_nope_head_dim, layer.kv_b_proj.weight)


def test_kimi_linear_mla_layer_inputs(monkeypatch):
    modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

    config = transformers.KimiLinearConfig(
        vocab_size=50, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, attn_implementation="eager",
    )
    torch.manual_seed(0)
    layer = modeling.KimiLinearAttention(config, layer_idx=0).double().eval()
    capture = Capture(layer, modeling, monkeypatch)
    gen = torch.Generator().manual_seed(1)
    cache = transformers.DynamicCache()
    with torch.no_grad():
        total = 0
        for new in (6, 1, 2):  # prefill, decode, chunk; a hand-made causal additive mask as HF's eager one
            hidden = torch.randn(2, new, 64, generator=gen, dtype=torch.float64)
            total += new
            allowed = torch.arange(total)[None, :] <= torch.arange(new)[:, None] + (total - new)
            allowed = allowed[None, None].expand(2, 1, new, total).clone()
            allowed[0, :, :, :2] = False  # left padding of the first sequence
            mask = torch.zeros(2, 1, new, total, dtype=torch.float64)
            mask = mask.masked_fill(~allowed, torch.finfo(torch.float64).min)
            layer(hidden, attention_mask=mask, past_key_values=cache)
    assert [c["latent"][0].shape[2] for c in capture.calls] == [6, 7, 9]
    for call in capture.calls:
        check_call(call, layer.qk_nope_head_dim, layer.kv_b_proj.weight)
