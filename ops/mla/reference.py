"""MLA in plain torch: both forms of the same function, runnable on any device.

Inputs are what Hugging Face's DeepseekV3 / KimiLinear attention holds after its cache update
(docs/mla.md §2), with the latent made 3-D by the public function:

- q_nope [B, H, Sq, Dn], q_rope [B, H, Sq, Dr]: the query split (rotary already applied to q_rope);
- kv_latent [B, T, R]: ``kv_a_layernorm``-ed latent of every cached token (R = kv_lora_rank);
- k_rope [B, T, Dr]: the rope key shared by all heads;
- kv_b_weight [H * (Dn + Dv), R]: ``kv_b_proj.weight``; per head, rows [0, Dn) make k_nope and
  rows [Dn, Dn + Dv) make the value.

Semantics: ``s[h, i, t] = scale * (q_nope[h, i] . k_nope[h, t] + q_rope[h, i] . k_rope[t])`` with
``k_nope[h, t] = W_UK[h] c_t`` and value ``W_UV[h] c_t``; ``is_causal`` is aligned bottom-right
(query i sees keys ``t <= T - Sq + i``); ``attn_mask`` is bool (True = attend) or additive float,
broadcastable to [B, H, Sq, T]; a row with every key masked out (False or -inf) returns 0.

- ``absorbed_mla``: ``q_lat = q_nope @ W_UK`` (R values per head) scores against the latent
  directly (MQA, d_qk = R + Dr, d_v = R), then ``o = (p @ c) @ W_UV^T``. Materialises the
  [B, H, Sq, T] scores, so on CUDA it serves only what the Triton decode kernel cannot.
- ``expanded_mla``: Hugging Face's expansion (``kv_b_proj`` over every cached token) and the fused
  attention op ``kda_compile.ops.attention.attention`` with d_qk = Dn + Dr, d_v = Dv.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kda_compile.ops.attention import attention


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the torch absorbed form computes in: at least float32."""
    return torch.promote_types(dtype, torch.float32)


def split_kv_b_weight(kv_b_weight: torch.Tensor, heads: int, nope_dim: int):
    """Views (W_UK [H, Dn, R], W_UV [H, Dv, R]) of ``kv_b_proj.weight`` [H * (Dn + Dv), R]."""
    per_head = kv_b_weight.unflatten(0, (heads, kv_b_weight.shape[0] // heads))
    return per_head[:, :nope_dim], per_head[:, nope_dim:]


def causal_allowed(queries: int, cache_len: int, device) -> torch.Tensor:
    """Bool [Sq, T]: query i (absolute position T - Sq + i) may see key t."""
    position = torch.arange(queries, device=device)[:, None] + (cache_len - queries)
    return torch.arange(cache_len, device=device)[None, :] <= position


def masked_softmax(scores: torch.Tensor, attn_mask, is_causal: bool) -> torch.Tensor:
    """Softmax over the last dim of scores [B, H, Sq, T] under the masks; all-masked rows give 0."""
    if is_causal:
        scores = scores.masked_fill(~causal_allowed(scores.shape[-2], scores.shape[-1], scores.device),
                                    float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(scores.dtype)
    # Detached row max: it only shifts the exponent, and -inf rows shift by 0 (no inf - inf).
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
    e = torch.exp(scores - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    return e / torch.where(denom > 0, denom, torch.ones_like(denom))


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_lat [B, H, Sq, R] = q_nope [B, H, Sq, Dn] @ W_UK [H, Dn, R] (batched over heads, W not copied)."""
    return torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk)


def absorbed_mla(q_nope, q_rope, kv_latent, k_rope, kv_b_weight, attn_mask, scale: float, is_causal: bool):
    """The absorbed form, differentiable, in the compute dtype: out [B, H, Sq, Dv]."""
    ct = compute_dtype(q_nope.dtype)
    heads, nope_dim = q_nope.shape[1], q_nope.shape[3]
    w_uk, w_uv = split_kv_b_weight(kv_b_weight.to(ct), heads, nope_dim)
    latent = kv_latent.to(ct)
    q_lat = absorb_query(q_nope.to(ct), w_uk)
    scores = (torch.einsum("bhsr,btr->bhst", q_lat, latent)
              + torch.einsum("bhsd,btd->bhst", q_rope.to(ct), k_rope.to(ct))) * scale
    p = masked_softmax(scores, attn_mask, is_causal)
    o_lat = torch.einsum("bhst,btr->bhsr", p, latent)  # the latent is also the value
    return torch.einsum("bhsr,hvr->bhsv", o_lat, w_uv)


def expand_latent(kv_latent, k_rope, kv_b_weight, heads: int, nope_dim: int):
    """Hugging Face's ``expand_kv``: key [B, H, T, Dn + Dr] and value [B, H, T, Dv] (views of [B, T, H, D])."""
    b, t, _ = kv_latent.shape
    kv = F.linear(kv_latent, kv_b_weight).unflatten(-1, (heads, -1))  # [B, T, H, Dn + Dv]
    k_nope, value = kv[..., :nope_dim], kv[..., nope_dim:]
    key = torch.cat([k_nope, k_rope[:, :, None, :].expand(b, t, heads, k_rope.shape[-1])], dim=-1)
    return key.transpose(1, 2), value.transpose(1, 2)


def expanded_mla(q_nope, q_rope, kv_latent, k_rope, kv_b_weight, attn_mask, scale: float, is_causal: bool):
    """The expanded form through the fused attention op: out [B, H, Sq, Dv] in the input dtype
    (stored as [B, Sq, H, Dv]); differentiable through the attention op's autograd."""
    key, value = expand_latent(kv_latent, k_rope, kv_b_weight, q_nope.shape[1], q_nope.shape[3])
    query = torch.cat([q_nope, q_rope], dim=-1)
    return attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
