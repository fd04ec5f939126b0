"""Test oracle for the MLA op: Hugging Face's expansion and a float64 softmax written plainly, plus
input builders and a hypothesis strategy shared by the MLA test files.

The naive version expands the latent exactly as ``DeepseekV3Attention.expand_kv`` does (``kv_b_proj``
over every cached token, view per head, split into k_nope and v, the rope key repeated over heads),
then runs a materialised float64 softmax; it shares no code with ``ops/mla``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

MASK_KINDS = ("none", "bool", "float", "padding", "float_inf")
MASK_SHAPES = ("b1", "full", "2d", "row")  # [B,1,Sq,T], [B,H,Sq,T], [Sq,T], [B,1,1,T]


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


@dataclass(frozen=True)
class Case:
    b: int = 2
    h: int = 3
    sq: int = 1
    t: int = 9
    dn: int = 16
    dr: int = 8
    dv: int = 12
    r: int = 32
    causal: bool = False
    mask: str = "none"  # MASK_KINDS; "padding": HF's left padding, finfo.min in the input dtype
    mask_shape: str = "b1"
    dead_rows: bool = False  # some rows get every key masked out (bool / float_inf masks)
    hf_layout: bool = True  # q as split views of [B, Sq, H, Dn + Dr]; [B, 1, T, D] latent cache
    transposed_weight: bool = False  # kv_b_weight stored transposed (non-contiguous)
    scale: float | None = None  # None: (Dn + Dr) ** -0.5 * 1.3 (a YaRN-like mscale factor)


def case_scale(case: Case) -> float:
    return (case.dn + case.dr) ** -0.5 * 1.3 if case.scale is None else case.scale


def _mask(case: Case, dtype, gen) -> torch.Tensor | None:
    b, h, sq, t = case.b, case.h, case.sq, case.t
    shape = {"b1": (b, 1, sq, t), "full": (b, h, sq, t), "2d": (sq, t), "row": (b, 1, 1, t)}[case.mask_shape]
    if case.mask == "none":
        return None
    if case.mask == "padding":  # left padding of batched generation: the first keys of a sequence
        pad = torch.randint(0, t, (b,), generator=gen)
        keys = torch.arange(t)[None, :] >= pad[:, None]  # [B, T]
        m = torch.zeros((b, t), dtype=dtype).masked_fill(~keys, torch.finfo(dtype).min)
        return m.view(b, 1, 1, t).expand(b, 1, sq, t).contiguous()
    allowed = torch.rand(shape, generator=gen) > 0.3
    if case.dead_rows:
        allowed[..., 0, :] = False
    if case.mask == "bool":
        return allowed
    if case.mask == "float_inf":
        return torch.where(allowed, 0.0, -math.inf).to(dtype)
    return (torch.randn(shape, generator=gen) * 0.5).to(dtype)


def make_inputs(case: Case, dtype=torch.float64, device="cpu", seed: int = 0, requires_grad: bool = False):
    """(args, kwargs) for ``mla_attention(*args, **kwargs)``; values drawn on CPU from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    b, h, sq, t = case.b, case.h, case.sq, case.t
    if case.hf_layout:  # HF: q viewed [B, Sq, H, Dn + Dr], transposed, split; latent [B, 1, T, R]
        q = torch.randn(b, sq, h, case.dn + case.dr, generator=gen).transpose(1, 2)
        q_nope, q_rope = q[..., :case.dn], q[..., case.dn:]
        kv_latent = torch.randn(b, 1, t, case.r, generator=gen)
        k_rope = torch.randn(b, 1, t, case.dr, generator=gen)
    else:
        q_nope = torch.randn(b, h, sq, case.dn, generator=gen)
        q_rope = torch.randn(b, h, sq, case.dr, generator=gen)
        kv_latent = torch.randn(b, t, case.r, generator=gen)
        k_rope = torch.randn(b, t, case.dr, generator=gen)
    w_shape = (h * (case.dn + case.dv), case.r)
    w = torch.randn(w_shape[::-1], generator=gen).T if case.transposed_weight else torch.randn(w_shape, generator=gen)
    w = w * case.r ** -0.5
    mask = _mask(case, dtype, gen)

    def prep(x):
        x = x.to(device=device, dtype=dtype)
        return x.detach().requires_grad_(True) if requires_grad else x

    args = [prep(x) for x in (q_nope, q_rope, kv_latent, k_rope, w)]
    if mask is not None:
        mask = mask.to(device)
    return args, dict(scale=case_scale(case), attn_mask=mask, is_causal=case.causal)


@st.composite
def cases(draw, max_t: int = 40):
    """Small random cases: decode, speculative / chunk against a cache, and prefill (Sq = T)."""
    t = draw(st.one_of(st.sampled_from([1, 2, 16, 17, 33]), st.integers(1, max_t)))
    kind = draw(st.sampled_from(["decode", "chunk", "prefill"]))
    sq = {"decode": 1, "chunk": draw(st.integers(1, 6)), "prefill": t}[kind]
    mask = draw(st.sampled_from(MASK_KINDS))
    return Case(
        b=draw(st.integers(1, 3)), h=draw(st.integers(1, 4)), sq=sq, t=t,
        dn=draw(st.sampled_from([8, 16, 24])), dr=draw(st.sampled_from([4, 8, 16])),
        dv=draw(st.sampled_from([8, 12, 16])), r=draw(st.sampled_from([16, 32, 48])),
        causal=draw(st.booleans()), mask=mask, mask_shape=draw(st.sampled_from(MASK_SHAPES)),
        dead_rows=mask in ("bool", "float_inf") and draw(st.booleans()),
        hf_layout=draw(st.booleans()), transposed_weight=draw(st.booleans()),
    )
