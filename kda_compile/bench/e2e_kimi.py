"""Kimi-Linear end to end (``python -m kda_compile.bench e2e --model kimi_linear``).

A Kimi-Linear-shaped ``KimiLinearForCausalLM`` from transformers, random weights, bf16, batch 1,
at the released model's widths (hidden 2304; KDA 32 heads x 128, conv 4; MLA 32 heads, kv_lora
512, nope 128, rope 64, v 128, no q LoRA; MoE 16 experts / 4 active of 1024 plus one shared, the
first layer dense; vocabulary 163840) with few layers: ``--layers 4`` gives KDA, KDA, KDA, MLA
(every fourth layer is MLA). The configurations (HF eager with FLA's kernels or HF's torch fallback,
Inductor, kda_compile) and the metrics (prefill tokens/s, decode ms per token) are ``e2e_hybrid.py``'s;
HF's torch fallback for KDA materialises a [H, T/64, 64, 64, K] decay tensor, hence its prompt limit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kda_compile.bench import e2e_hybrid

HF_KIMI_MODULE = "transformers.models.kimi_linear.modeling_kimi_linear"
KDA_FUNCTIONS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")


@dataclass(frozen=True)
class Shape:
    """Model widths (defaults: the released Kimi-Linear-48B)."""

    hidden: int = 2304
    kda_heads: int = 32
    kda_head_dim: int = 128
    mla_heads: int = 32
    kv_lora_rank: int = 512
    nope: int = 128
    rope: int = 64
    v: int = 128
    experts: int = 16
    active_experts: int = 4
    moe_intermediate: int = 1024
    dense_intermediate: int = 9216
    vocab: int = 163840


TINY = Shape(hidden=64, kda_heads=2, kda_head_dim=16, mla_heads=2, kv_lora_rank=32, nope=16, rope=8, v=16,
             experts=4, active_experts=2, moe_intermediate=32, dense_intermediate=96, vocab=128)


def build_model(shape: Shape, layers: int, device: str, dtype: torch.dtype, seed: int = 0):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    config = KimiLinearConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.dense_intermediate,
        moe_intermediate_size=shape.moe_intermediate, num_hidden_layers=layers,
        layer_types=e2e_hybrid.layer_types(layers),
        mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), num_attention_heads=shape.mla_heads,
        num_key_value_heads=shape.mla_heads, kv_lora_rank=shape.kv_lora_rank, q_lora_rank=None,
        qk_nope_head_dim=shape.nope, qk_rope_head_dim=shape.rope, v_head_dim=shape.v,
        num_local_experts=shape.experts, num_experts_per_tok=shape.active_experts, n_shared_experts=1,
        linear_num_heads=shape.kda_heads, linear_head_dim=shape.kda_head_dim, linear_conv_kernel_dim=4,
        max_position_embeddings=16384, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    with torch.device(device):
        model = KimiLinearForCausalLM._from_config(config, attn_implementation="eager", dtype=dtype)
    return model.eval()


MODEL = e2e_hybrid.HybridModel(name="kimi_linear", title="Kimi-Linear", hf_module=HF_KIMI_MODULE,
                               kernel_names=KDA_FUNCTIONS, build=build_model, shape=Shape(), tiny=TINY)
