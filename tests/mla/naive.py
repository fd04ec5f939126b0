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


def latent_oracle(q_lat, q_rope, kv_latent, k_rope, attn_mask, scale, is_causal):
    """(o_lat [B, H, Sq, R], lse [B, H, Sq]) in float64: MQA over the latent, materialised."""
    s = (torch.einsum("bhsr,btr->bhst", q_lat.double(), kv_latent.double())
         + torch.einsum("bhsd,btd->bhst", q_rope.double(), k_rope.double())) * scale
    sq, t = s.shape[-2:]
    if is_causal:
        s = s.masked_fill(torch.arange(t)[None, :] > torch.arange(sq)[:, None] + (t - sq), -math.inf)
    if attn_mask is not None:
        mask = attn_mask.cpu()
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.double()
    dead = (s == -math.inf).all(dim=-1, keepdim=True)
    safe = torch.where(dead, torch.zeros_like(s), s)
    p = torch.where(dead, torch.zeros_like(s), torch.softmax(safe, dim=-1))
    lse = torch.where(dead[..., 0], torch.full_like(dead[..., 0], -math.inf, dtype=torch.float64),
                      torch.logsumexp(safe, dim=-1))
    return p @ kv_latent.double()[:, None], lse


def kernel_inputs(case, dtype, seed=0):
    """Latent-form inputs on CPU (values) and on DEVICE, with HF's strided views where the case says."""
    gen = torch.Generator().manual_seed(seed)
    b, h, sq, t, r, dr = case.b, case.h, case.sq, case.t, case.r, case.dr
    q_lat = torch.randn(b, h, sq, r, generator=gen) * r ** -0.5
    if case.hf_layout:  # q_rope as HF's split view; the latent as the squeezed [B, 1, T, D] cache
        q_rope = torch.randn(b, sq, h, case.dn + dr, generator=gen).transpose(1, 2)[..., case.dn:]
        kv_latent = torch.randn(b, 1, t, r, generator=gen)[:, 0]
        k_rope = torch.randn(b, 1, t, dr, generator=gen)[:, 0]
    else:
        q_rope = torch.randn(b, h, sq, dr, generator=gen)
        kv_latent = torch.randn(b, t, r, generator=gen)
        k_rope = torch.randn(b, t, dr, generator=gen)
    _, kwargs = make_inputs(case, dtype, seed=seed)  # the mask (same generator rules as the op tests)
    mask = kwargs["attn_mask"]
    tensors = [x.to(dtype) for x in (q_lat, q_rope, kv_latent, k_rope)]
    return tensors, mask, kwargs["scale"]


def assert_matches_latent_oracle(o_lat, lse, ref_o, ref_lse, case, tol: float, lse_tol: float):
    """A decode kernel's (o_lat, lse) against ``latent_oracle``: shape, dtype-independent layout ([H, B, Sq,
    R] storage), relative error ``tol`` on o_lat, the same -inf rows, and lse within ``lse_tol`` relative."""
    from kda_compile.testing import assert_rel_close

    assert o_lat.shape == (case.b, case.h, case.sq, case.r)
    assert o_lat.permute(1, 0, 2, 3).is_contiguous(), "o_lat is stored as [H, B, Sq, R]"
    assert_rel_close(o_lat, ref_o, tol, name="o_lat")
    lse = lse.cpu().double()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows with nothing to attend must have lse -inf"
    finite = torch.isfinite(ref_lse)
    if finite.any():
        worst = (lse[finite] - ref_lse[finite]).abs().max().item()
        assert worst <= lse_tol * max(1.0, ref_lse[finite].abs().max().item()), f"lse off by {worst}"
