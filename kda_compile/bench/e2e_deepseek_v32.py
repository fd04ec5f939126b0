"""DeepSeek-V3.2 end to end (``python -m kda_compile.bench e2e --model deepseek_v32``).

A DeepSeek-V3.2-shaped ``DeepseekV32ForCausalLM`` from transformers, random weights, bf16, at the released model's
widths (DeepSeek-V3.2-Exp, transformers' ``DeepseekV32Config`` defaults: hidden 7168; MLA 128 heads, q_lora_rank
1536, kv_lora_rank 512, nope 128, rope 64, v 128; the DSA indexer 64 heads of 128 selecting the top 2048 keys; MoE
256 routed experts / 8 active of 2048 in 8 groups (4 chosen) plus one shared expert, the first 3 layers dense with
an MLP of 18432; vocabulary 129280) with few layers: ``--layers 4`` gives 3 dense layers and 1 MoE layer, every
layer MLA + DSA. About 15B parameters (30 GB in bf16) at 4 layers, so the weights are made on the device itself.

HF's code binds no kernels here (the indexer and the sparse attention are torch in HF eager), so the configurations
are ``hf_eager`` (the baseline), ``inductor``, ``kda_compile`` and ``kda_compile (cuda graphs)``, and the runner
(``e2e_hybrid.py``) measures decode rows only unless ``--prompts`` asks for prefill too: HF eager's indexer
scores every query against every key in fp32 ([B, T, 64, T]), which a long prefill pays dearly for.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kda_compile.bench import e2e_hybrid


@dataclass(frozen=True)
class Shape:
    """Model widths (defaults: the released DeepSeek-V3.2, as transformers' ``DeepseekV32Config`` has them)."""

    hidden: int = 7168
    heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    nope: int = 128
    rope: int = 64
    v: int = 128
    experts: int = 256
    active_experts: int = 8
    groups: int = 8
    active_groups: int = 4
    moe_intermediate: int = 2048
    shared_experts: int = 1
    dense_layers: int = 3
    dense_intermediate: int = 18432
    index_topk: int = 2048
    index_heads: int = 64
    index_head_dim: int = 128
    vocab: int = 129280


# index_topk below the smoke run's 8-token prompts, so the indexer's selection matters; 8 indexer heads keep its
# scores (a ReLU sum over heads) from tying at zero, where a top-k may pick any of the tied keys.
TINY = Shape(hidden=64, heads=4, q_lora_rank=32, kv_lora_rank=32, nope=16, rope=8, v=16, experts=4, active_experts=2,
             groups=2, active_groups=1, moe_intermediate=32, dense_intermediate=96, index_topk=4, index_heads=8,
             index_head_dim=16, vocab=128)


def describe_layers(layers: int, shape: Shape = Shape()) -> list[str]:
    """Every layer is MLA + DSA; the first ``dense_layers`` have a dense MLP, the rest the MoE block."""
    return ["dsa+dense" if i < shape.dense_layers else "dsa+moe" for i in range(layers)]


def build_model(shape: Shape, layers: int, device: str, dtype: torch.dtype, seed: int = 0):
    """The causal LM with random weights made directly on ``device`` (a CPU copy first would need the whole model in
    host memory and a copy of it)."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    config = DeepseekV32Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.dense_intermediate,
        moe_intermediate_size=shape.moe_intermediate, num_hidden_layers=layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads, q_lora_rank=shape.q_lora_rank, kv_lora_rank=shape.kv_lora_rank,
        qk_nope_head_dim=shape.nope, qk_rope_head_dim=shape.rope, v_head_dim=shape.v,
        n_routed_experts=shape.experts, num_experts_per_tok=shape.active_experts, n_group=shape.groups,
        topk_group=shape.active_groups, n_shared_experts=shape.shared_experts,
        first_k_dense_replace=shape.dense_layers, index_topk=shape.index_topk, index_n_heads=shape.index_heads,
        index_head_dim=shape.index_head_dim, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    with torch.device(device):
        model = DeepseekV32ForCausalLM._from_config(config, attn_implementation="eager", dtype=dtype)
    return model.eval()


MODEL = e2e_hybrid.HybridModel(name="deepseek_v32", title="DeepSeek-V3.2", build=build_model, shape=Shape(),
                               tiny=TINY, prompts=(), describe_layers=describe_layers)
