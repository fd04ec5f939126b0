"""Tiny Hugging Face decoders, one per model family the softmax-attention rewrite targets.

Every model is built from a config with random weights (nothing is downloaded): hidden size 64, a
vocabulary of 128 tokens, one decoder layer, or two where the family alternates layer kinds
(sliding / full attention) -- Dynamo's tracing time grows with the layers, and CI runs on 2 CPU
cores. Each entry documents the attention variant it exercises.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import transformers

VOCAB = 128


@dataclass(frozen=True)
class Family:
    name: str
    make_config: Callable[[], object]  # a transformers config
    # attention sites per forward graph (softmax-attention layers of the model)
    attention_layers: int
    # what the family adds on top of plain causal GQA attention
    variant: str


def _config(class_name: str, **kwargs):
    """``transformers.<class_name>(**kwargs)``; the test is skipped on a transformers without it."""
    cls = getattr(transformers, class_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    return cls(**kwargs)


def _common(**extra):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
    base.update(extra)
    return base


def _llama():
    return _config("LlamaConfig", **_common())


def _mistral():
    # sliding_window smaller than the test prompts so the window clause changes the result
    return _config("MistralConfig", **_common(sliding_window=5))


def _qwen2():
    return _config("Qwen2Config", **_common())


def _qwen3():
    return _config("Qwen3Config", **_common(head_dim=16))


def _gemma2():
    return _config("Gemma2Config", **_common(
        head_dim=16, attn_logit_softcapping=50.0, sliding_window=5, query_pre_attn_scalar=16, num_hidden_layers=2))


def _gemma3():
    return _config("Gemma3TextConfig", **_common(
        head_dim=16, sliding_window=5, query_pre_attn_scalar=16, num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"]))


def _phi3():
    return _config("Phi3Config", **_common())


def _gpt_oss():
    # default RoPE: the YaRN defaults expect a long context and warn about the tiny one here
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    return _config("GptOssConfig", **_common(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5, rope_parameters=rope,
        num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]))


def _deepseek_v3():
    return _config("DeepseekV3Config", **_common(
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        moe_intermediate_size=32, first_k_dense_replace=1))


def _kimi_linear(layer_types=("full_attention",)):
    # The MLA layer with its real head sizes (q/k 128 + 64 = 192, v 128), alone: Hugging Face's
    # torch fallback of a KDA layer unrolls its chunk loop into a graph that takes minutes to
    # compile under dynamic shapes; KIMI_WITH_KDA adds one, for a static test.
    return _config("KimiLinearConfig", **_common(
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_local_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, linear_head_dim=16, linear_num_heads=2,
        num_hidden_layers=len(layer_types), layer_types=list(layer_types),
        mlp_layer_types=["dense"] * len(layer_types)))


FAMILIES = {f.name: f for f in [
    Family("llama", _llama, 1, "GQA, causal"),
    Family("mistral", _mistral, 1, "GQA, sliding window"),
    Family("qwen2", _qwen2, 1, "GQA, causal"),
    Family("qwen3", _qwen3, 1, "GQA, q/k norm"),
    Family("gemma2", _gemma2, 2, "softcap, alternating sliding window"),
    Family("gemma3", _gemma3, 2, "sliding + full layers"),
    Family("phi3", _phi3, 1, "fused qkv projection"),
    Family("gpt_oss", _gpt_oss, 2, "attention sinks, sliding + full layers"),
    Family("deepseek_v3", _deepseek_v3, 1, "MLA, Dqk != Dv"),
    Family("kimi_linear", _kimi_linear, 1, "MLA, Dqk 192 / Dv 128"),
]}
# Kimi-Linear as released: a KDA layer (HF's torch fallback) and an MLA layer.
KIMI_WITH_KDA = Family("kimi_linear_with_kda", lambda: _kimi_linear(("linear_attention", "full_attention")), 1,
                       "MLA beside a KDA layer")


def build_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0, **config_updates) -> torch.nn.Module:
    """A tiny eager-attention model of the family ``name`` with random weights, in eval mode
    (``config_updates``: config attributes to change, e.g. ``attention_dropout=0.1``)."""
    torch.manual_seed(seed)
    cfg = (KIMI_WITH_KDA if name == KIMI_WITH_KDA.name else FAMILIES[name]).make_config()
    for key, value in config_updates.items():
        setattr(cfg, key, value)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=dtype)
    return model.eval()


# ----------------------------------------------------------------------------------------------
# DeepSeek Sparse Attention (token-level indexer + top-k), tests/passes/test_dsa_attention.py.
# Two layers, MLA 16 + 8 / 16 with a 32 latent, indexer 8 heads x 16, top-k 6 (< the test prompts,
# so the selection matters). initializer_range 0.1 spreads the indexer scores: with 0.02 they
# bunch within float rounding and the k-th place becomes a near tie.
# ----------------------------------------------------------------------------------------------
_DSA = dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            index_topk=6, index_head_dim=16, index_n_heads=8, n_routed_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, moe_intermediate_size=32, initializer_range=0.1)
DSA_FAMILIES = {  # name -> (config class, model class, what the family adds)
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(first_k_dense_replace=2)),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",  # layer 1 reuses layer 0's selection
                    dict(first_k_dense_replace=2, indexer_types=["full", "shared"])),
}


def build_dsa_model(name: str, attn: str = "eager", **config_updates) -> torch.nn.Module:
    """A tiny two-layer DSA model of the family ``name`` (``DSA_FAMILIES``), fp32, eval mode. The pad
    token's embedding is random, not zero: a zero query scores every key 0 and ties the top-k."""
    config_class, model_class, extra = DSA_FAMILIES[name]
    cfg = _config(config_class, **_common(num_hidden_layers=2, num_key_value_heads=4, **_DSA, **extra))
    for key, value in config_updates.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)._from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_()
    return model.eval()


# ----------------------------------------------------------------------------------------------
# Qwen3-Next (GDN + softmax attention, MoE): the substitution tests of HF's experts and decode conv
# (tests/passes/test_moe_substitution.py, test_conv_update_substitution.py). One linear-attention layer
# (2 key heads, 4 value heads of 16) and one full-attention layer, 8 experts with 2 active.
# ----------------------------------------------------------------------------------------------
def build_qwen3_next() -> torch.nn.Module:
    config = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    return transformers.Qwen3NextForCausalLM(config).eval()
