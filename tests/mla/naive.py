"""Test oracle for the MLA op: Hugging Face's expansion and a float64 softmax written plainly, plus
the input builders of ``kda_compile.testing`` under short names, shared by the MLA test files.

The naive version expands the latent exactly as ``DeepseekV3Attention.expand_kv`` does (``kv_b_proj``
over every cached token, view per head, split into k_nope and v, the rope key repeated over heads),
then runs a materialised float64 softmax; it shares no code with ``ops/mla``.
"""
from __future__ import annotations

import math

import torch

from kda_compile.testing import MLACase, make_mla_args, mla_cases


def naive_mla(q_nope, q_rope, kv_latent, k_rope, kv_b_weight, *, scale, attn_mask=None, is_causal=False):
    """out [B, H, Sq, Dv] in float64. kv_latent / k_rope: [B, T, D] or Hugging Face's [B, 1, T, D]."""
    q_nope, q_rope, kv_b_weight = q_nope.double(), q_rope.double(), kv_b_weight.double()
    b, h, sq, dn = q_nope.shape
    latent = kv_latent.double().reshape(b, 1, -1, kv_latent.shape[-1])
    rope = k_rope.double().reshape(b, 1, -1, k_rope.shape[-1])
    t = latent.shape[2]
    kv = (latent @ kv_b_weight.T).view(b, t, h, -1).transpose(1, 2)  # [B, H, T, Dn + Dv]
    k_nope, v = kv[..., :dn], kv[..., dn:]
    k = torch.cat([k_nope, rope.expand(b, h, t, rope.shape[-1])], dim=-1)
    q = torch.cat([q_nope, q_rope], dim=-1)
    s = (q @ k.transpose(-1, -2)) * scale
    if is_causal:
        row = torch.arange(sq, device=s.device)[:, None] + (t - sq)
        s = s.masked_fill(torch.arange(t, device=s.device)[None, :] > row, -math.inf)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else s + attn_mask.double()
    dead = (s == -math.inf).all(dim=-1, keepdim=True)
    p = torch.where(dead, torch.zeros_like(s), torch.softmax(torch.where(dead, torch.zeros_like(s), s), dim=-1))
    return p @ v


Case = MLACase  # the fixed cases of the test files read better short


def make_inputs(case: Case, dtype=torch.float64, device="cpu", seed: int = 0, requires_grad: bool = False):
    """(args, kwargs) for ``mla_attention(*args, **kwargs)``; values drawn on CPU from ``seed``."""
    kwargs = dict(make_mla_args(case, dtype, device, seed=seed, requires_grad=requires_grad))
    args = [kwargs.pop(name) for name in ("q_nope", "q_rope", "kv_latent", "k_rope", "kv_b_weight")]
    return args, kwargs


def cases(max_t: int = 40):
    """Small random cases (``kda_compile.testing.mla_cases``): decode, a chunk against a cache, prefill."""
    return mla_cases(max_t=max_t)
