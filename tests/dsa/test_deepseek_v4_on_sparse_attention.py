"""DeepSeek-V4's attention is ``dsa_sparse_attention`` over chosen key indices, with its sinks applied from the
log-sum-exp (docs/dsa.md, section 6): the math a rewrite of its layers rests on, checked against Hugging Face's
own layers.

A tiny random ``DeepseekV4ForCausalLM`` (fp32, eager attention) runs one prefill of 24 tokens without a cache
through a sliding-window layer, a compressed sparse (CSA) layer and a heavily compressed (HCA) layer. For each,
HF's attention inputs (queries, the shared key/value rows: the window's tokens then the compressed entries, the
dense mask it built) and output are captured, and for the CSA layer its indexer's top-k. The same output comes
from ``dsa_sparse_attention`` in the absorbed MQA form (one KV head, K = V, ``d_v`` the full width) over, per
query ``i``: the window keys ``i - W + 1 .. i``; then the compressed entries: the indexer's picks (CSA) or every
entry whose window is closed by position ``i`` (HCA); and the output scaled by ``sigmoid(lse - sink_h)``.
Relative error (float64 ours against HF's float32) below 1e-5.
"""
from __future__ import annotations

import pytest
import torch

from kda_compile.ops import dsa_sparse_attention

hf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

TOKENS = 24
LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}


def tiny_model():
    config = hf.DeepseekV4Config(
        vocab_size=64, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        head_dim=32, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4, layer_types=list(LAYER_TYPES),
        compress_rates=dict(RATES), sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=2,
        index_head_dim=16, index_topk=3, hc_mult=2, num_nextn_predict_layers=0, partial_rotary_factor=0.5)
    torch.manual_seed(0)
    model = hf.DeepseekV4ForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()  # initialised to zeros: make the sinks matter
    return model.eval()


def captured_attention(model, monkeypatch):
    """Per layer: HF's attention inputs and output, and the CSA indexer's top-k (``picks``)."""
    calls, picks = {}, {}
    eager = hf.eager_attention_forward

    def recording(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        out, weights = eager(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        calls[module.layer_idx] = dict(q=query, kv=key, mask=attention_mask, out=out, sinks=module.sinks,
                                       scale=scaling)
        return out, weights

    monkeypatch.setattr(hf, "eager_attention_forward", recording)
    for index, layer in enumerate(model.model.layers):
        compressor = layer.self_attn.compressor
        if compressor is not None and hasattr(compressor, "indexer"):
            compressor.indexer.register_forward_hook(lambda m, a, out, index=index: picks.__setitem__(index, out))
    ids = torch.randint(0, 64, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    return calls, picks


def key_indices(kind: str, queries: int, keys: int, window: int, picks) -> torch.Tensor:
    """int32 [1, S, W (+ entries)]: the window's keys of each query, then its compressed entries (rows of the
    key/value tensor after the ``queries`` window rows), -1 for none."""
    i = torch.arange(queries)
    win = i[:, None] - torch.arange(window - 1, -1, -1)[None, :]
    parts = [torch.where(win >= 0, win, -1)[None]]
    if kind == "compressed_sparse_attention":
        parts.append(torch.where(picks >= 0, picks + queries, -1))
    elif kind == "heavily_compressed_attention":
        entries = torch.arange(keys - queries)
        closed = entries[None, :] < ((i + 1) // RATES[kind])[:, None]  # HF's causal threshold
        parts.append(torch.where(closed, entries[None, :] + queries, -1)[None])
    return torch.cat(parts, -1).to(torch.int32)


def test_each_deepseek_v4_attention_kind_is_sparse_attention_with_sinks(monkeypatch):
    model = tiny_model()
    calls, picks = captured_attention(model, monkeypatch)
    assert sorted(calls) == [0, 1, 2] and sorted(picks) == [1]
    for layer, kind in enumerate(LAYER_TYPES):
        c = calls[layer]
        q, kv, out = c["q"], c["kv"], c["out"]  # [1, H, S, D], [1, 1, S (+ entries), D], [1, S, H, D]
        assert c["mask"] is not None and c["mask"].shape[-1] == kv.shape[2]  # HF's dense path: a full mask
        idx = key_indices(kind, q.shape[2], kv.shape[2], model.config.sliding_window, picks.get(layer))
        o, lse = dsa_sparse_attention(q.transpose(1, 2).double(), kv.transpose(1, 2).double(), None, idx,
                                      c["scale"], d_v=q.shape[-1])
        o = o * torch.sigmoid(lse - c["sinks"].double()[None, None, :])[..., None]
        assert torch.isfinite(o).all()
        error = float((o - out.double()).norm() / out.double().norm())
        assert error < 1e-5, (kind, error)
