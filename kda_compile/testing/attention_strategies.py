"""Hypothesis strategies for ``kda_compile.ops.attention``: shapes and options drawn under bounds,
and the tensors of one call built from them.

``attention_cases`` draws an :class:`AttentionCase` (GQA ratio, ``Sq != Sk``, ``Dv != Dqk``, masks and
their broadcasts, causal + sliding window, softcap, sinks, fully masked rows, transposed inputs);
``make_attention_args`` builds the keyword arguments of one call from a case, a dtype, a device and
a seed (no hypothesis needed: fixed regression cases); ``attention_inputs`` draws both at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
from hypothesis import strategies as st

from kda_compile.testing.options import check_case, choices, draw_call, positive_ints

MASK_KINDS = ("none", "bool", "float", "float_inf")
# [B, H, Sq, Sk], [B, 1, Sq, Sk], [1, 1, Sq, Sk], [Sq, Sk], [B, 1, 1, Sk]
MASK_SHAPES = ("full", "b1", "11", "2d", "row")


@dataclass(frozen=True)
class AttentionCase:
    """One attention call's shape and options, in the names of the attention literature.

    ``b`` batch, ``h`` query heads, ``hkv`` key/value heads (``h % hkv == 0``), ``sq`` / ``sk`` query /
    key lengths, ``dqk`` / ``dv`` head dims. ``causal`` and ``window`` (sliding window, causal only);
    ``mask`` one of :data:`MASK_KINDS` (``float_inf``: a float mask with -inf entries) broadcast as
    ``mask_shape`` (one of :data:`MASK_SHAPES`); ``dead_rows``: query row 0 attends nothing through
    the mask; ``softcap``, ``sinks`` (one logit per head), ``scale`` (None: ``dqk ** -0.5``);
    ``noncontiguous``: q, k, v as transposed views of ``[B, S, H, D]`` storage (k and v slices of one).
    """

    b: int = 1
    h: int = 2
    hkv: int = 2
    sq: int = 5
    sk: int = 5
    dqk: int = 16
    dv: int = 16
    causal: bool = False
    window: int | None = None
    mask: str = "none"
    mask_shape: str = "full"
    softcap: float | None = None
    sinks: bool = False
    scale: float | None = None
    dead_rows: bool = False
    noncontiguous: bool = False

    def with_(self, **changes) -> "AttentionCase":
        return replace(self, **changes)


class AttentionArgs(dict):
    """The keyword arguments of ``attention(**args)`` (query, key, value, attn_mask, is_causal, scale,
    softcap, sinks, sliding_window), with the draw that made them as ``case`` and ``seed``."""

    case: AttentionCase
    seed: int

    def __repr__(self) -> str:  # hypothesis prints this for a failing example: the case, not tensors
        return f"AttentionArgs({self.case}, dtype={self['query'].dtype}, seed={self.seed})"


def _mask(case: AttentionCase, dtype, device, gen) -> torch.Tensor:
    shape = {"full": (case.b, case.h, case.sq, case.sk), "b1": (case.b, 1, case.sq, case.sk),
             "11": (1, 1, case.sq, case.sk), "2d": (case.sq, case.sk), "row": (case.b, 1, 1, case.sk)}[case.mask_shape]
    if case.mask == "bool":
        m = torch.rand(shape, generator=gen, device=device) > 0.3
        if case.dead_rows:
            m[..., 0, :] = False
        return m
    m = torch.randn(shape, generator=gen, device=device, dtype=torch.float64)
    if case.mask == "float_inf":
        m = m.masked_fill(torch.rand(shape, generator=gen, device=device) < 0.3, -math.inf)
    if case.dead_rows:
        m[..., 0, :] = -math.inf
    return m.to(dtype)


def make_attention_args(case: AttentionCase, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", seed: int = 0,
                        requires_grad: bool = False) -> AttentionArgs:
    """The tensors of one call for ``case``: standard normal q, k, v (drawn in float64, then cast), the
    mask and sinks it asks for; with ``requires_grad`` every floating input is a leaf needing grad."""
    check_case(case, MASK_KINDS, MASK_SHAPES, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float64)

    if case.noncontiguous:  # [B, S, H, D] storage seen as [B, H, S, D]; K and V slices of one tensor
        q = randn(case.b, case.sq, case.h, case.dqk).transpose(1, 2)
        kv = randn(case.b, case.sk, case.hkv, case.dqk + case.dv).transpose(1, 2)
        k, v = kv[..., :case.dqk], kv[..., case.dqk:]
    else:
        q, k, v = (randn(case.b, case.h, case.sq, case.dqk), randn(case.b, case.hkv, case.sk, case.dqk),
                   randn(case.b, case.hkv, case.sk, case.dv))
    q, k, v = (t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v))
    mask = None if case.mask == "none" else _mask(case, dtype, device, gen)
    if mask is not None and mask.is_floating_point():
        mask.requires_grad_(requires_grad)
    sinks = (2.0 * randn(case.h)).to(dtype).requires_grad_(requires_grad) if case.sinks else None
    args = AttentionArgs(query=q, key=k, value=v, attn_mask=mask, is_causal=case.causal, scale=case.scale,
                         softcap=case.softcap, sinks=sinks, sliding_window=case.window)
    args.case, args.seed = case, seed
    return args


@st.composite
def attention_cases(
    draw,
    *,
    max_batch: int = 2,
    max_q_len: int = 9,
    max_kv_len: int = 9,
    kv_heads: Sequence[int] = (1, 2, 3),
    group_sizes: Sequence[int] = (1, 2, 3),
    head_dims: Sequence[int] = (4, 8, 16),
    value_dims: Sequence[int] = (4, 8, 12, 16),
    masks: str | Sequence[str] = MASK_KINDS,
    mask_shapes: str | Sequence[str] = MASK_SHAPES,
    causal: bool | Sequence[bool] = (False, True),
    max_window: int = 6,
    softcaps: Sequence[float | None] = (None, 1.5, 20.0),
    sinks: bool | Sequence[bool] = (False, True),
    scales: Sequence[float | None] = (None, 0.3),
    noncontiguous: bool | Sequence[bool] = (False, True),
) -> AttentionCase:
    """Draw an :class:`AttentionCase`.

    Args:
        max_batch, max_q_len, max_kv_len: B, Sq and Sk are drawn from 1 up to these.
        kv_heads, group_sizes: Hkv from ``kv_heads``, H = Hkv * a value of ``group_sizes``.
        head_dims, value_dims: Dqk and Dv candidates.
        masks, mask_shapes: mask kinds (:data:`MASK_KINDS`) and broadcasts (:data:`MASK_SHAPES`); a
            masked case may also have a fully masked query row.
        causal: whether causal masking is drawn; ``max_window``: causal cases draw a sliding window of
            1..max_window or none (0: never a window).
        softcaps, scales: candidates (None: no softcap / the default scale).
        sinks, noncontiguous: whether per-head sinks / transposed-view inputs are drawn.
    """
    for name, value in (("max_batch", max_batch), ("max_q_len", max_q_len), ("max_kv_len", max_kv_len)):
        positive_ints(name, [value])
    if not isinstance(max_window, int) or max_window < 0:
        raise ValueError(f"max_window must be an int >= 0, got {max_window!r}")
    hkv = draw(st.sampled_from(positive_ints("kv_heads", kv_heads)))
    is_causal = draw(st.sampled_from(choices("causal", causal)))
    mask = draw(st.sampled_from(choices("masks", masks, MASK_KINDS)))
    window = None
    if is_causal and max_window:
        window = draw(st.one_of(st.none(), st.integers(1, max_window)))
    return AttentionCase(
        b=draw(st.integers(1, max_batch)), hkv=hkv, h=hkv * draw(st.sampled_from(positive_ints("group_sizes", group_sizes))),
        sq=draw(st.integers(1, max_q_len)), sk=draw(st.integers(1, max_kv_len)),
        dqk=draw(st.sampled_from(positive_ints("head_dims", head_dims))),
        dv=draw(st.sampled_from(positive_ints("value_dims", value_dims))),
        causal=is_causal, window=window, mask=mask,
        mask_shape=draw(st.sampled_from(choices("mask_shapes", mask_shapes, MASK_SHAPES))),
        softcap=draw(st.sampled_from(choices("softcaps", softcaps))),
        sinks=draw(st.sampled_from(choices("sinks", sinks))),
        scale=draw(st.sampled_from(choices("scales", scales))),
        dead_rows=mask != "none" and draw(st.booleans()),
        noncontiguous=draw(st.sampled_from(choices("noncontiguous", noncontiguous))),
    )


@st.composite
def attention_inputs(draw, *, dtypes: Sequence[torch.dtype] = (torch.float32,), device: str | torch.device = "cpu",
                     requires_grad: bool = False, **case_bounds: Any) -> AttentionArgs:
    """Draw a case (``case_bounds``: the arguments of :func:`attention_cases`), a dtype and a seed, and
    build the call's arguments with :func:`make_attention_args`."""
    return draw_call(draw, attention_cases(**case_bounds), make_attention_args, dtypes, device, requires_grad)
