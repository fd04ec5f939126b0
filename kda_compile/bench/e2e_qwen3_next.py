"""Qwen3-Next end to end (``python -m kda_compile.bench e2e --model qwen3_next``).

A Qwen3-Next-shaped ``Qwen3NextForCausalLM`` from transformers, random weights, bf16, batch 1, at the released
model's widths (Qwen3-Next-80B-A3B, transformers' defaults: hidden 2048; gated delta rule with 16 q/k heads and 32
value heads of 128, conv 4; softmax attention 16 heads / 2 KV heads of 256, a quarter of each rotated; MoE 512
experts / 10 active of 512 plus a shared expert of 512; vocabulary 151936) with few layers: ``--layers 4`` gives
GDN, GDN, GDN, attention (every fourth layer is softmax attention). The configurations (HF eager with FLA's GDN
kernels or HF's torch fallback, Inductor, kda_compile) and the metrics (prefill tokens/s, decode ms per token) are
``e2e_hybrid.py``'s. HF's attention layers run eagerly (``attn_implementation="eager"``), which kda_compile
rewrites too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kda_compile.bench import e2e_hybrid

HF_QWEN3_NEXT_MODULE = "transformers.models.qwen3_next.modeling_qwen3_next"
GDN_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


@dataclass(frozen=True)
class Shape:
    """Model widths (defaults: the released Qwen3-Next-80B-A3B)."""

    hidden: int = 2048
    heads: int = 16
    kv_heads: int = 2
    head_dim: int = 256
    gdn_key_heads: int = 16
    gdn_value_heads: int = 32
    gdn_head_dim: int = 128
    experts: int = 512
    active_experts: int = 10
    moe_intermediate: int = 512
    shared_intermediate: int = 512
    vocab: int = 151936


TINY = Shape(hidden=64, heads=2, kv_heads=1, head_dim=16, gdn_key_heads=1, gdn_value_heads=2, gdn_head_dim=16,
             experts=4, active_experts=2, moe_intermediate=32, shared_intermediate=32, vocab=128)


def build_model(shape: Shape, layers: int, device: str, dtype: torch.dtype, seed: int = 0):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=layers,
        layer_types=e2e_hybrid.layer_types(layers),
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        linear_num_key_heads=shape.gdn_key_heads, linear_num_value_heads=shape.gdn_value_heads,
        linear_key_head_dim=shape.gdn_head_dim, linear_value_head_dim=shape.gdn_head_dim, linear_conv_kernel_dim=4,
        num_experts=shape.experts, num_experts_per_tok=shape.active_experts,
        moe_intermediate_size=shape.moe_intermediate, shared_expert_intermediate_size=shape.shared_intermediate,
        max_position_embeddings=16384, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3NextForCausalLM._from_config(config, attn_implementation="eager", dtype=dtype)
    return model.eval()


MODEL = e2e_hybrid.HybridModel(name="qwen3_next", title="Qwen3-Next", hf_module=HF_QWEN3_NEXT_MODULE,
                               kernel_names=GDN_FUNCTIONS, build=build_model, shape=Shape(), tiny=TINY)
