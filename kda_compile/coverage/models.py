"""The causal-LM families of the installed transformers, each built tiny with random weights.

:func:`model_types` lists ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``. :func:`tiny_config` starts from the
family's default config (``AutoConfig.for_model``) and shrinks every size it knows by name (hidden
size 64, 4 heads of 16, 2 kv heads, intermediate sizes 128 / 32 for experts, vocabulary 256, 4
experts of which 2 per token, 256 positions), recursing into sub-configs (``text_config``...).
Layers: 2, or as many as it takes to keep one layer of every distinct kind of a hybrid model. A
layer's kind is the tuple of its entries in every per-layer list of the config (``layer_types``,
``mlp_layer_types``, ``layers_block_type``...: any list as long as the layer count), of a shorter list of
types repeated over the layers (recurrent_gemma's ``block_types``), whether it is named by index lists
(``full_attn_idxs``, ``hybrid_layer_ids``...) or dicts keyed by layer index (``per_layer_config``, whose
entries are shrunk too), and whether it is in the ``num_kv_shared_layers`` tail (gemma3n); the first
layer of each kind is kept and those lists and dicts are cut down to the kept layers. A per-layer list of
a size (gemma3n's ``intermediate_size``, laguna's ``num_attention_heads_per_layer``) is cut down and
shrunk, but is no kind. ``*_period`` / ``*_offset`` layer schedules become 2 / 1. Sizes that must agree
are derived again (MLA head sizes, Mamba heads x head size, an unset ``head_dim``, reformer's axial
position sizes, xlstm's dim factors). Settings beyond sizes a family's model needs are in
:data:`FAMILY_SETTINGS` (reformer as a decoder, blt without a cache); a default config transformers itself
rejects is built with :data:`DEFAULT_OVERRIDES` (gemma4_assistant). Where the causal-LM class takes a
sub-config of the family's config (musicgen's decoder), that part is built.
Nothing is downloaded; transformers is imported lazily.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger("kda_compile.coverage")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, POSITIONS = 64, 4, 2, 16, 256, 256
LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers",
              "num_decoder_layers", "num_encoder_layers")
TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk", "top_k", "num_selected_experts", "num_experts_per_token")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts",
               "n_experts", "n_shared_experts", "num_shared_experts", *TOP_K_KEYS)
SIZES = {  # config attribute -> tiny value (only set where the default config has a number there)
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "dim", "word_embed_proj_dim",
                     "embedding_size", "projection_dim",
                     "adapter_in_dim", "adapter_input_size", "adapter_out_dim", "lru_width",
                     "hidden_size_global"), HIDDEN),  # = hidden sizes (blt: its global transformer's, in the encoder)
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "attention_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num",
                     "num_key_value_groups"), KV_HEADS),
    **dict.fromkeys(("head_dim", "attention_head_dim", "kv_channels", "d_kv"), HEAD_DIM),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim",
                     "ffn_hidden_size", "d_ff", "dim_feedforward", "ffn_config_hidden"), 128),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
                     "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"), 32),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
                     "num_routed_experts", "n_experts"), 4),
    **dict.fromkeys(TOP_K_KEYS, 2),  # a top-1 router stays top-1 (zaya accepts only 1)
    **dict.fromkeys(("n_group", "topk_group", "n_shared_experts", "num_shared_experts", "num_expert_group"), 1),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len",
                     "seq_length"), POSITIONS),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 32),
    **dict.fromkeys(("qk_nope_head_dim", "v_head_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_head_dim", "index_head_dim", "mamba_d_head", "mamba_head_dim"), 16),
    **dict.fromkeys(("qk_rope_head_dim", "rotary_dim"), 8),  # rotary_dim: codegen's default 64 exceeds the head dim
    **dict.fromkeys(("linear_num_key_heads", "linear_num_value_heads", "linear_num_heads",
                     "mamba_n_heads", "n_mamba_heads", "mamba_n_groups", "n_groups"), 2),
    # DSA indexer heads: a key scores exactly 0 when every head's ReLU is 0 (1 in 2**H), and keys tied at
    # the top-k boundary may be chosen either way (torch.topk and our op differ), so more than 2
    **dict.fromkeys(("index_n_heads",), 8),
    **dict.fromkeys(("index_topk",), 8),
    **dict.fromkeys(("index_kpool",), 4),  # index_topk must be a multiple of it (glm5_next)
    **dict.fromkeys(("num_codebooks",), 2),  # musicgen: the sweep's 2 rows of ids are 1 sample x 2 codebooks
    **dict.fromkeys(("vocab_size", "vocab_size_per_layer_input", "encoder_hash_byte_group_vocab"), VOCAB),
    **dict.fromkeys(("hidden_size_per_layer_input",), 16),  # gemma3n / gemma4 per-layer embeddings
    **dict.fromkeys(("sliding_window", "attention_window", "attention_window_size"), 8),
    **dict.fromkeys(("first_k_dense_replace", "num_dense_layers"), 1),
}
TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
              "cls_token_id", "mask_token_id", "unk_token_id", "forced_eos_token_id", "forced_bos_token_id")


def model_types() -> list[str]:
    """Every model type with a causal-LM class in the installed transformers, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _layer_count(d: dict[str, Any]) -> tuple[str, int] | None:
    for key in LAYER_KEYS:
        value = d.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return key, value
    return None


def _layer_index(key: Any) -> int | None:
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    return int(key) if isinstance(key, str) and key.isdigit() else None


def _renumbered(key: Any, kept: list[int]) -> Any:
    new = kept.index(_layer_index(key))
    return new if isinstance(key, int) else str(new).zfill(len(key))


def _layer_maps(d: dict[str, Any], n: int) -> list[str]:
    """Keys of dicts keyed by layer index (dots3's ``per_layer_config``: ``{"02": {...}, ...}``)."""
    return [k for k, v in d.items() if isinstance(v, dict) and v and n > 1 and "layer" in k  # not id2label
            and all(_layer_index(i) is not None and 0 <= _layer_index(i) < n for i in v)]


def _cycled_types(d: dict[str, Any], n: int) -> list[str]:
    """Keys of layer-type patterns shorter than the layer count, repeated over the layers (recurrent_gemma's
    ``block_types``: recurrent, recurrent, attention)."""
    return [k for k, v in d.items() if isinstance(v, list) and 1 < len(v) < n and "type" in k
            and all(isinstance(x, str) for x in v)]


def _shared_tail(d: dict[str, Any]) -> int:
    """gemma3n: the last ``num_kv_shared_layers`` layers reuse earlier layers' keys and values."""
    shared = d.get("num_kv_shared_layers")
    return shared if isinstance(shared, int) and not isinstance(shared, bool) and shared > 0 else 0


def _size_lists(d: dict[str, Any], n: int) -> list[str]:
    """Keys of per-layer lists of a size :data:`SIZES` knows (gemma3n's ``intermediate_size``, laguna's
    ``num_attention_heads_per_layer``)."""
    return [k for k, v in d.items() if _size_key(k) in SIZES and isinstance(v, list) and len(v) == n
            and all(isinstance(x, int) and not isinstance(x, bool) for x in v)]


def _size_key(key: str) -> str:
    return key.removesuffix("_per_layer")


def _kept_layers(d: dict[str, Any], n: int) -> tuple[list[int], list[str], list[str]]:
    """The layers to keep (first of each kind), the per-layer list keys and the index-list keys."""
    per_layer = [k for k, v in d.items() if isinstance(v, list) and len(v) == n and n > 1
                 and all(isinstance(x, (str, int, float, bool, type(None))) for x in v)
                 and not all(isinstance(x, int) and not isinstance(x, bool) for x in v)]
    index_lists = [k for k, v in d.items() if isinstance(v, list) and v and k not in per_layer
                   and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < n for x in v)
                   and ("layer" in k or "idx" in k or "ids" in k)]
    maps = {k: {_layer_index(i): v for i, v in d[k].items()} for k in _layer_maps(d, n)}
    seen: dict[tuple, int] = {}
    for i in range(n):
        kind = (tuple(d[k][i] for k in per_layer) + tuple(i in d[k] for k in index_lists)
                + tuple(repr(m.get(i)) for m in maps.values()) + (i >= n - _shared_tail(d),)
                + tuple(d[k][i % len(d[k])] for k in _cycled_types(d, n)))
        seen.setdefault(kind, i)
    kept = sorted(seen.values())
    for i in range(n):  # at least 2 layers
        if len(kept) >= min(2, n):
            break
        if i not in kept:
            kept = sorted(kept + [i])
    return kept, per_layer, index_lists


def _layer_entry(entry: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    """A per-layer MLA override keeps its head sizes consistent with the model's: ``head_dim`` = nope +
    rope (dots3's sliding layers check it), k/v on every head."""
    nope, rope = (entry.get(k, model.get(k)) for k in ("qk_nope_head_dim", "qk_rope_head_dim"))
    if "qk_nope_head_dim" in entry and isinstance(nope, int) and isinstance(rope, int):
        entry["head_dim"] = nope + rope
    if "kv_lora_rank" in entry and isinstance(entry.get("num_key_value_heads"), int):
        entry["num_key_value_heads"] = entry.get("num_attention_heads", HEADS)
    return entry


def shrink(d: dict[str, Any]) -> dict[str, Any]:
    """A copy of the config dict ``d`` with tiny sizes (see the module docstring)."""
    out = dict(d)
    for key, value in d.items():
        if not isinstance(key, str):  # a dict keyed by layer index: handled with the layers below
            continue
        if isinstance(value, dict) and ("config" in key or key.endswith("_cfg") or "model_type" in value):
            out[key] = shrink(value)
        elif key in SIZES and isinstance(value, int) and not isinstance(value, bool) and value != 0:
            out[key] = min(value, SIZES[key]) if key in TOP_K_KEYS else SIZES[key]  # a zero size switches a part off (glm5_next's NoPE: qk_rope_head_dim=0)
        elif (key.endswith("_period") or key.endswith("_freq")) and isinstance(value, int) and value > 1:
            out[key] = 2
        elif key.endswith("_offset") and isinstance(value, int) and value > 0:
            out[key] = 1
    counted = _layer_count(d)
    if counted is not None:
        count_key, n = counted
        kept, per_layer, index_lists = _kept_layers(d, n)
        for key in LAYER_KEYS:
            if isinstance(d.get(key), int) and d[key] == n:
                out[key] = len(kept)
        for key in per_layer:
            out[key] = [d[key][i] for i in kept]
        for key in _cycled_types(d, n):
            out[key] = [d[key][i % len(d[key])] for i in kept]
        if _shared_tail(d):
            out["num_kv_shared_layers"] = sum(i >= n - _shared_tail(d) for i in kept)
        for key in _size_lists(d, n):  # gemma3n: one intermediate_size per layer
            out[key] = [SIZES[_size_key(key)] if d[key][i] else 0 for i in kept]
        for key in index_lists:
            out[key] = [kept.index(i) for i in d[key] if i in kept]
        for key in _layer_maps(d, n):  # renumbered as written ("02" stays two digits wide), entries shrunk
            out[key] = {_renumbered(i, kept): (_layer_entry(shrink(v), out) if isinstance(v, dict) else v)
                        for i, v in d[key].items() if _layer_index(i) in kept}
    if isinstance(out.get("qk_rope_head_dim"), int):  # MLA: derived head sizes follow the tiny ones
        if "head_dim" in out:
            out["head_dim"] = out["qk_rope_head_dim"]
        if "num_key_value_heads" in out and "kv_lora_rank" in out:  # MLA expands k/v to every head
            out["num_key_value_heads"] = out.get("num_attention_heads", HEADS)
        if isinstance(out.get("qk_head_dim"), int) and isinstance(out.get("qk_nope_head_dim"), int):
            out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    if all(isinstance(out.get(k), int) for k in ("mamba_d_ssm", "mamba_n_heads", "mamba_d_head")):
        out["mamba_d_ssm"] = out["mamba_n_heads"] * out["mamba_d_head"]  # falcon_h1 checks it
    elif all(isinstance(out.get(k), int) for k in ("mamba_expand", "hidden_size", "mamba_n_heads", "mamba_d_head")):
        out["mamba_d_head"] = out["mamba_expand"] * out["hidden_size"] // out["mamba_n_heads"]  # granitemoehybrid
    if "state_size" in out and all(isinstance(out.get(k), int) for k in ("expand", "hidden_size", "num_heads",
                                                                          "head_dim")):
        out["head_dim"] = out["expand"] * out["hidden_size"] // out["num_heads"]  # mamba2: heads x head_dim
    for key in TOKEN_KEYS:
        value = out.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= VOCAB:
            out[key] = 2
        elif isinstance(value, list):
            out[key] = [x if not isinstance(x, int) or x < VOCAB else 2 for x in value]
    return out


# Sizes a default config leaves unset (None) but the model needs, by the config key they belong to.
QSA_INDEXER = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
               "indexer_compress_ratio": 4}  # qwen4_exp: an indexed layer needs all of them


def _fill_unset(d: dict[str, Any]) -> dict[str, Any]:
    out = {key: (_fill_unset(value) if isinstance(value, dict) and "config" in key else value)
           for key, value in d.items()}
    if "num_key_value_heads" in out and out["num_key_value_heads"] is None and isinstance(
            out.get("num_attention_heads"), int):  # unset means one per head (nemotron divides by it)
        out["num_key_value_heads"] = out["num_attention_heads"]
    if out.get("default_language") is None and out.get("languages"):  # xmod's adapters need a language
        out["default_language"] = out["languages"][0]
    n = out.get("num_hidden_layers")
    for key in ("layer_types", "layers_block_type"):  # a hybrid whose default has no attention layer (every
        types = out.get(key)  # layer linear: granitemoehybrid) gets one: HF's cache needs it for the length
        if isinstance(types, list) and len(types) >= 2 and set(types) == {"linear_attention"}:
            out[key] = types[:-1] + ["full_attention"]
    if "attn_layer_indices" in out and not out["attn_layer_indices"] and isinstance(n, int) and n >= 2:
        out["attn_layer_indices"] = [n - 1]  # bamba: unset means no attention layer
    types = out.get("layers_block_type")
    if out.get("model_type") == "zamba" and isinstance(types, list) and types.count("hybrid") == 1:
        out["layers_block_type"] = types + ["hybrid"]  # its shared transformer is tied from the first hybrid
        out["num_hidden_layers"] = len(types) + 1  # layer to the others: HF raises when there is no other
    if isinstance(out.get("moe_intermediate_size"), int):  # a MoE config: expert counts left unset (None)
        for key in EXPERT_KEYS:  # are read by the model (deepseek_v2's top-k, dots1's expert weights)
            if key in out and out[key] is None:
                out[key] = SIZES[key]
    if "head_dim" in out and out["head_dim"] is None and isinstance(out.get("num_attention_heads"), int):
        out["head_dim"] = out.get("hidden_size", HIDDEN) // out["num_attention_heads"]  # hunyuan_v1 reads it
    if isinstance(out.get("num_layers_per_stack"), int):  # hrm_text derives it (and the cache slots) again
        out["num_layers_per_stack"] = None
    if out.get("model_type") == "lfm2_moe" and out.get("layer_types") is None:  # its model indexes them
        n = out.get("num_hidden_layers", 2)
        out["layer_types"] = ["conv"] * (n - 1) + ["full_attention"]
    if out.get("model_type", "").startswith("qwen4_exp") and "indexer_budget" in out:
        out.update({key: value for key, value in QSA_INDEXER.items() if out.get(key) is None})
    if out.get("rope_parameters") == {} and isinstance(out.get("layer_types"), list):  # cohere_compass_text:
        out["rope_parameters"] = {t: {"rope_type": "default", "rope_theta": 10000.0}  # its rotary embedding reads
                                  for t in dict.fromkeys(out["layer_types"])}  # one entry per layer type
    hidden = out.get("hidden_size")
    for key in [k for k in out if k.endswith("_dim_factor")]:  # xlstm: the config rounds hidden * factor up to
        if isinstance(hidden, int) and isinstance(out[key], float) and (hidden * out[key]) % 64:  # a multiple of
            out[key] = 1.0  # 64 for its cache, its layers do not: the state shapes differ unless it is one
    if isinstance(out.get("axial_pos_embds_dim"), (list, tuple)) and isinstance(hidden, int):  # reformer: the
        out["axial_pos_embds_dim"] = (hidden // 4, hidden - hidden // 4)  # factors sum to the hidden size and
        positions = out.get("max_position_embeddings", POSITIONS)  # the axial shape multiplies to the positions
        out["axial_pos_shape"] = (16, positions // 16)
    out.update(FAMILY_SETTINGS.get(out.get("model_type"), {}))
    return out


# Settings a family's causal LM needs beyond sizes, by model type.
FAMILY_SETTINGS = {
    "reformer": {"is_decoder": True},  # ReformerModelWithLMHead asserts it
    # transformers 5.23's BltModel builds DynamicCache(config=BltConfig) when use_cache is on, which reads
    # num_hidden_layers, a field of BltConfig's sub-configs only; the sweep's one forward needs no cache
    "blt": {"use_cache": False},
}
# Keyword arguments for the default config where transformers' own default is invalid, by model type.
DEFAULT_OVERRIDES = {
    # Gemma4AssistantConfig validates its text config as an assistant's (no per-layer inputs, no MoE block,
    # no double-wide MLP); the default gemma4_text config is the backbone's
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
                                         "enable_moe_block": False, "use_double_wide_mlp": False}},
}


def _derive_again(cls: type, full: dict[str, Any], tiny: dict[str, Any]) -> dict[str, Any]:
    """Sizes the config derives itself go back to unset where :func:`shrink` left them as they were, so that
    the config derives them again from the tiny sizes: a field declared ``None`` or ``"auto"`` that is a
    number in the default config (rwkv's ``attention_hidden_size``, xlstm's ``embedding_dim`` /
    ``num_blocks``, xlnet's ``d_head``, zamba's ``attention_hidden_size`` / ``mamba_dt_rank``), and a number
    that is no declared field but that the config sets when it is absent (zamba2's ``mamba_headdim``,
    ``attention_hidden_size``: an extra keyword would override what it derives). A derived size
    :func:`shrink` set (``head_dim``, ``num_key_value_heads``...) is kept, and so are lists (layer patterns)."""
    import dataclasses

    if not dataclasses.is_dataclass(cls):
        return tiny
    declared = {f.name: f.default for f in dataclasses.fields(cls)}
    out = dict(tiny)
    stale = [key for key, value in full.items()
             if isinstance(value, int) and not isinstance(value, bool) and tiny.get(key) == value
             and key not in TOKEN_KEYS and key not in LAYER_KEYS]
    for key in stale:
        if key in declared and (declared[key] is None or declared[key] == "auto"):
            out[key] = declared[key]
    undeclared = [key for key in stale if key not in declared]
    if undeclared:
        try:
            rebuilt = cls.from_dict({k: v for k, v in out.items() if k not in undeclared}).to_dict()
        except Exception:  # noqa: BLE001  (then keep them as they are)
            return out
        for key in undeclared:
            if rebuilt.get(key) is not None:
                del out[key]
    return out


def _fix_built(cfg: Any) -> Any:
    for key in ("axial_pos_shape", "axial_pos_embds_dim"):  # reformer adds them to tuples
        if isinstance(getattr(cfg, key, None), list):
            setattr(cfg, key, tuple(getattr(cfg, key)))
    # transformers 5.23's DbrxAttentionConfig has no rope_theta, which DbrxAttention reads.
    attn = getattr(cfg, "attn_config", None)
    if getattr(cfg, "model_type", "") == "dbrx" and attn is not None and not hasattr(attn, "rope_theta"):
        attn.rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    if getattr(cfg, "model_type", "") == "dbrx" and attn is not None and attn.clip_qkv is None:
        attn.clip_qkv = 8.0  # the default None reaches clamp(min=None, max=None), which raises; DBRX uses 8
    return cfg


def tiny_config(model_type: str) -> Any:
    """The tiny config of ``model_type`` (eager attention, fp32)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type, **DEFAULT_OVERRIDES.get(model_type, {}))
    full = default.to_dict()
    d = _derive_again(type(default), full, _fill_unset(shrink(full)))
    for key in ("transformers_version", "architectures", "_name_or_path"):
        d.pop(key, None)
    return _fix_built(type(default).from_dict(d))


ATTN_IMPLEMENTATIONS = ("eager", "sdpa")


def build_model(model_type: str, seed: int = 0, attn: str = "eager") -> torch.nn.Module:
    """A tiny causal LM of ``model_type`` with random weights, fp32, in eval mode, its attention the HF
    implementation ``attn`` (``"eager"``: the model's own matmul-softmax code; ``"sdpa"``: its
    ``scaled_dot_product_attention`` call; transformers raises for a family without one)."""
    from transformers import AutoModelForCausalLM

    if attn not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn must be one of {ATTN_IMPLEMENTATIONS}, got {attn!r}")
    cfg = tiny_config(model_type)
    torch.manual_seed(seed)
    part = _causal_lm_part(model_type, cfg)
    if part is not None:  # musicgen: the causal LM is the decoder of a composite config
        cls, cfg = part
        return cls._from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    return model.eval()


def _causal_lm_part(model_type: str, cfg: Any) -> tuple[type, Any] | None:
    """The causal-LM class and the sub-config it takes, where that class does not take ``cfg`` itself."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, ""), None)
    wanted = getattr(cls, "config_class", None)
    if not isinstance(wanted, type) or isinstance(cfg, wanted):
        return None
    for value in vars(cfg).values():
        if isinstance(value, wanted):
            return cls, value
    return None


def vocab_size(model: torch.nn.Module) -> int:
    """The number of token ids the model's input embedding accepts."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    n = getattr(emb, "num_embeddings", None)
    if isinstance(n, int):
        return n
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    return int(getattr(cfg, "vocab_size", VOCAB) or VOCAB)
