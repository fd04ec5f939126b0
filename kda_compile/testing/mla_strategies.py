"""Hypothesis strategies for ``kda_compile.ops.mla_attention``: MLA calls as Hugging Face's DeepSeek /
Kimi attention makes them (a latent cache, the rotary key cache, ``kv_b_proj``'s weight), drawn under
bounds.

``mla_cases`` draws an :class:`MLACase` (decode, a chunk against a cache, or prefill; heads, head
dims, latent rank; masks including HF's left padding; HF's strided layouts); ``make_mla_args``
builds the keyword arguments of one call from a case, a dtype, a device and a seed;
``mla_inputs`` draws both at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
from hypothesis import strategies as st

from kda_compile.testing.options import check_case, choices, draw_call, positive_ints

# "padding": HF's left padding of batched generation (finfo.min in the input dtype, broadcast over rows)
MLA_MASK_KINDS = ("none", "bool", "float", "padding", "float_inf")
MLA_MASK_SHAPES = ("b1", "full", "2d", "row")  # [B, 1, Sq, T], [B, H, Sq, T], [Sq, T], [B, 1, 1, T]
QUERY_KINDS = ("decode", "chunk", "prefill")


@dataclass(frozen=True)
class MLACase:
    """One MLA call's shape and options.

    ``b`` batch, ``h`` heads, ``sq`` query length, ``t`` cache length, ``dn`` / ``dr`` / ``dv`` the
    nope / rope / value head dims, ``r`` the latent rank (``kv_lora_rank``). ``mask`` one of
    :data:`MLA_MASK_KINDS` broadcast as ``mask_shape`` (one of :data:`MLA_MASK_SHAPES`; padding masks
    are ``[B, 1, Sq, T]``); ``dead_rows``: query row 0 attends nothing (bool / float_inf masks).
    ``hf_layout``: q as split views of ``[B, Sq, H, Dn + Dr]`` and ``[B, 1, T, D]`` caches, as HF passes
    them (else contiguous ``[B, H, Sq, D]`` and ``[B, T, D]``); ``transposed_weight``: kv_b_proj's
    weight stored transposed. ``scale`` None: ``(Dn + Dr) ** -0.5 * 1.3`` (a YaRN-like mscale factor).
    """

    b: int = 2
    h: int = 3
    sq: int = 1
    t: int = 9
    dn: int = 16
    dr: int = 8
    dv: int = 12
    r: int = 32
    causal: bool = False
    mask: str = "none"
    mask_shape: str = "b1"
    dead_rows: bool = False
    hf_layout: bool = True
    transposed_weight: bool = False
    scale: float | None = None

    @property
    def softmax_scale(self) -> float:
        return (self.dn + self.dr) ** -0.5 * 1.3 if self.scale is None else self.scale

    def with_(self, **changes) -> "MLACase":
        return replace(self, **changes)


class MLAArgs(dict):
    """The keyword arguments of ``mla_attention(**args)`` (q_nope, q_rope, kv_latent, k_rope,
    kv_b_weight, scale, attn_mask, is_causal), with the draw that made them as ``case`` and ``seed``."""

    case: MLACase
    seed: int

    def __repr__(self) -> str:  # hypothesis prints this for a failing example: the case, not tensors
        return f"MLAArgs({self.case}, dtype={self['q_nope'].dtype}, seed={self.seed})"


def _mask(case: MLACase, dtype, gen) -> torch.Tensor | None:
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


def make_mla_args(case: MLACase, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0,
                  requires_grad: bool = False) -> MLAArgs:
    """The tensors of one call for ``case`` (drawn on CPU from ``seed``, then moved): standard normal
    queries and caches, kv_b_proj's weight scaled by ``r ** -0.5``; with ``requires_grad`` the five
    tensor inputs are leaves needing grad."""
    check_case(case, MLA_MASK_KINDS, MLA_MASK_SHAPES, dtype)
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

    q_nope, q_rope, kv_latent, k_rope, w = (prep(x) for x in (q_nope, q_rope, kv_latent, k_rope, w))
    args = MLAArgs(q_nope=q_nope, q_rope=q_rope, kv_latent=kv_latent, k_rope=k_rope, kv_b_weight=w,
                   scale=case.softmax_scale, attn_mask=None if mask is None else mask.to(device),
                   is_causal=case.causal)
    args.case, args.seed = case, seed
    return args


@st.composite
def mla_cases(
    draw,
    *,
    max_batch: int = 3,
    max_heads: int = 4,
    max_t: int = 40,
    max_chunk: int = 6,
    query_kinds: str | Sequence[str] = QUERY_KINDS,
    nope_dims: Sequence[int] = (8, 16, 24),
    rope_dims: Sequence[int] = (4, 8, 16),
    value_dims: Sequence[int] = (8, 12, 16),
    ranks: Sequence[int] = (16, 32, 48),
    masks: str | Sequence[str] = MLA_MASK_KINDS,
    mask_shapes: str | Sequence[str] = MLA_MASK_SHAPES,
    causal: bool | Sequence[bool] = (False, True),
    hf_layout: bool | Sequence[bool] = (False, True),
    transposed_weight: bool | Sequence[bool] = (False, True),
) -> MLACase:
    """Draw an :class:`MLACase`.

    Args:
        max_batch, max_heads: B and H are drawn from 1 up to these.
        max_t: cache length T from 1 to ``max_t`` (chunk boundaries 1, 2, 16, 17, 33 favoured).
        query_kinds: ``"decode"`` (Sq = 1), ``"chunk"`` (Sq in 1..max_chunk against the cache) and
            ``"prefill"`` (Sq = T).
        nope_dims, rope_dims, value_dims, ranks: candidates for Dn, Dr, Dv and the latent rank R.
        masks, mask_shapes: mask kinds (:data:`MLA_MASK_KINDS`) and broadcasts (:data:`MLA_MASK_SHAPES`).
        causal, hf_layout, transposed_weight: which values are drawn.
    """
    for name, value in (("max_batch", max_batch), ("max_heads", max_heads), ("max_t", max_t),
                        ("max_chunk", max_chunk)):
        positive_ints(name, [value])
    edges = [n for n in (1, 2, 16, 17, 33) if n <= max_t]
    t = draw(st.one_of(st.sampled_from(edges), st.integers(1, max_t)))
    kind = draw(st.sampled_from(choices("query_kinds", query_kinds, QUERY_KINDS)))
    sq = {"decode": 1, "chunk": draw(st.integers(1, max_chunk)), "prefill": t}[kind]
    mask = draw(st.sampled_from(choices("masks", masks, MLA_MASK_KINDS)))
    return MLACase(
        b=draw(st.integers(1, max_batch)), h=draw(st.integers(1, max_heads)), sq=sq, t=t,
        dn=draw(st.sampled_from(positive_ints("nope_dims", nope_dims))),
        dr=draw(st.sampled_from(positive_ints("rope_dims", rope_dims))),
        dv=draw(st.sampled_from(positive_ints("value_dims", value_dims))),
        r=draw(st.sampled_from(positive_ints("ranks", ranks))),
        causal=draw(st.sampled_from(choices("causal", causal))), mask=mask,
        mask_shape=draw(st.sampled_from(choices("mask_shapes", mask_shapes, MLA_MASK_SHAPES))),
        dead_rows=mask in ("bool", "float_inf") and draw(st.booleans()),
        hf_layout=draw(st.sampled_from(choices("hf_layout", hf_layout))),
        transposed_weight=draw(st.sampled_from(choices("transposed_weight", transposed_weight))),
    )


@st.composite
def mla_inputs(draw, *, dtypes: Sequence[torch.dtype] = (torch.float32,), device: str | torch.device = "cpu",
               requires_grad: bool = False, **case_bounds: Any) -> MLAArgs:
    """Draw a case (``case_bounds``: the arguments of :func:`mla_cases`), a dtype and a seed, and build
    the call's arguments with :func:`make_mla_args`."""
    return draw_call(draw, mla_cases(**case_bounds), make_mla_args, dtypes, device, requires_grad)
