"""Llama decode end to end (``python -m kda_compile.bench e2e --model llama --decode-shapes ...``).

A Llama-3.1-8B-shaped ``LlamaForCausalLM`` from transformers, random weights, bf16, at the released model's widths
(hidden 4096; 32 heads / 8 KV heads of 128; MLP 14336; vocabulary 128256; RoPE theta 500000 with Llama 3.1's
frequency scaling) with few layers (``--layers 4``), through the runner of ``e2e_hybrid.py``: decode rows (and
prefill rows only when ``--prompts`` asks). HF's Llama code binds no kernels, so the configurations are
``hf_eager`` (the baseline), ``inductor``, ``kda_compile`` and ``kda_compile (cuda graphs)``.

``--model llama`` without ``--decode-shapes`` (or ``--smoke``) is the older prefill benchmark of a Llama-style 1B
decoder body (``e2e.py``), kept as it was.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kda_compile.bench import e2e_hybrid

# Llama 3.1's RoPE: theta 500000, long-context frequency scaling from its 8192-token pretraining length.
LLAMA_3_1_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class Shape:
    """Model widths (defaults: the released Llama-3.1-8B)."""

    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256


TINY = Shape(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=128)


def describe_layers(layers: int) -> list[str]:
    return ["full_attention"] * layers


def build_model(shape: Shape, layers: int, device: str, dtype: torch.dtype, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, rope_parameters=dict(LLAMA_3_1_ROPE), rms_norm_eps=1e-5,
        max_position_embeddings=131072, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, attn_implementation="eager", dtype=dtype)
    return model.eval()


MODEL = e2e_hybrid.HybridModel(name="llama_8b", title="Llama-3.1-8B", build=build_model, shape=Shape(), tiny=TINY,
                               prompts=(), describe_layers=describe_layers)
