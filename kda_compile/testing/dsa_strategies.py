"""Hypothesis strategies for the DeepSeek Sparse Attention ops (``kda_compile.ops.dsa_indexer_topk`` and
``dsa_sparse_attention``), drawn under bounds.

``dsa_indexer_cases`` draws a :class:`DSAIndexerCase` (prefill, a chunk against a cache, decode; packed
sequences through ``cu_seqlens``; padded keys; ``topk`` above the number of keys; quantised inputs whose
fp32 scores are exact, so ties are frequent and the tie rule is exercised); ``make_dsa_indexer_args``
builds the keyword arguments of one call; ``dsa_indexer_inputs`` draws both.

``dsa_attention_cases`` / :class:`DSAAttentionCase` / ``make_dsa_attention_args`` /
``dsa_attention_inputs`` do the same for the sparse attention (absorbed MQA form with ``v=None`` or
expanded GQA heads; unique indices per row with -1 holes and rows without any key).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
from hypothesis import strategies as st

from kda_compile.testing.options import FLOAT_DTYPES, choices, draw_call, positive_ints

DSA_QUERY_KINDS = ("prefill", "chunk", "decode", "packed")


@dataclass(frozen=True)
class DSAIndexerCase:
    """One indexer call: ``b`` batch, ``s`` queries, ``t`` keys, ``heads`` x ``dim`` indexer heads,
    ``topk``; ``causal``; ``padding``: a random ``key_mask``; ``seq_lens``: packed sequence lengths
    (B == 1, S == T, summing to T) or None; ``quantised``: small-integer q / k / weights (exact scores,
    many ties) instead of normal ones; ``scale`` of the dot product."""

    b: int = 1
    s: int = 8
    t: int = 8
    heads: int = 2
    dim: int = 8
    topk: int = 4
    causal: bool = True
    padding: bool = False
    seq_lens: tuple[int, ...] | None = None
    quantised: bool = False
    scale: float = 0.5

    def with_(self, **changes) -> "DSAIndexerCase":
        return replace(self, **changes)


class DSAIndexerArgs(dict):
    """The arguments of ``dsa_indexer_topk(**args)`` (q, k, weights, topk, scale, is_causal, key_mask,
    cu_seqlens), with the draw that made them as ``case`` and ``seed``."""

    case: DSAIndexerCase
    seed: int

    def __repr__(self) -> str:
        return f"DSAIndexerArgs({self.case}, dtype={self['q'].dtype}, seed={self.seed})"


def make_dsa_indexer_args(case: DSAIndexerCase, dtype: torch.dtype = torch.float32,
                          device: str | torch.device = "cpu", seed: int = 0,
                          requires_grad: bool = False) -> DSAIndexerArgs:
    """The tensors of one indexer call for ``case`` (drawn on CPU from ``seed``, then moved); weights stay
    float32 (as DeepSeek-V3.2 keeps them). ``requires_grad`` is accepted for symmetry and ignored: the
    indexer has no gradient."""
    if dtype not in FLOAT_DTYPES[:3]:
        raise TypeError(f"dtype must be one of {FLOAT_DTYPES[:3]}, got {dtype}")
    gen = torch.Generator().manual_seed(seed)
    b, s, t, h, d = case.b, case.s, case.t, case.heads, case.dim
    if case.quantised:
        q = torch.randint(-2, 3, (b, s, h, d), generator=gen).float()
        k = torch.randint(-2, 3, (b, t, d), generator=gen).float()
        w = torch.randint(-2, 3, (b, s, h), generator=gen).float() / 4
    else:
        q, k = torch.randn(b, s, h, d, generator=gen), torch.randn(b, t, d, generator=gen)
        w = torch.randn(b, s, h, generator=gen) * h ** -0.5
    key_mask = torch.rand(b, t, generator=gen) > 0.25 if case.padding else None
    cu = None
    if case.seq_lens is not None:
        if b != 1 or s != t or sum(case.seq_lens) != t:
            raise ValueError(f"seq_lens needs b == 1 and s == t == sum(seq_lens), got {case}")
        cu = torch.tensor([0, *torch.tensor(case.seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = DSAIndexerArgs(
        q=q.to(device=device, dtype=dtype), k=k.to(device=device, dtype=dtype), weights=w.to(device),
        topk=case.topk, scale=case.scale, is_causal=case.causal,
        key_mask=None if key_mask is None else key_mask.to(device), cu_seqlens=None if cu is None else cu.to(device))
    args.case, args.seed = case, seed
    return args


@st.composite
def dsa_indexer_cases(
    draw,
    *,
    max_batch: int = 2,
    max_t: int = 40,
    max_chunk: int = 6,
    max_topk: int = 48,
    max_heads: int = 4,
    dims: Sequence[int] = (8, 16, 32),
    query_kinds: str | Sequence[str] = DSA_QUERY_KINDS,
    causal: bool | Sequence[bool] = (True, False),
    padding: bool | Sequence[bool] = (False, True),
    quantised: bool | Sequence[bool] = (True, False),
) -> DSAIndexerCase:
    """Draw a :class:`DSAIndexerCase`.

    Args:
        max_batch, max_heads: B and H_I from 1 up to these (packed cases: B = 1).
        max_t: key count T from 1 up to it (tile edges 1, 16, 17, 33 favoured).
        max_chunk: S of a ``"chunk"`` against a cache of T - S keys.
        max_topk: topk from 1 up to it (often above T).
        query_kinds: ``"prefill"`` (S = T), ``"chunk"``, ``"decode"`` (S = 1), ``"packed"`` (cu_seqlens,
            empty sequences allowed).
        dims: indexer head widths D; causal, padding, quantised: which values are drawn.
    """
    for name, value in (("max_batch", max_batch), ("max_t", max_t), ("max_chunk", max_chunk),
                        ("max_topk", max_topk), ("max_heads", max_heads)):
        positive_ints(name, [value])
    edges = [n for n in (1, 16, 17, 33) if n <= max_t]
    t = draw(st.one_of(st.sampled_from(edges), st.integers(1, max_t)))
    kind = draw(st.sampled_from(choices("query_kinds", query_kinds, DSA_QUERY_KINDS)))
    b = 1 if kind == "packed" else draw(st.integers(1, max_batch))
    s = {"prefill": t, "packed": t, "decode": 1, "chunk": min(t, draw(st.integers(1, max_chunk)))}[kind]
    seq_lens = None
    if kind == "packed":
        cuts = sorted(draw(st.lists(st.integers(0, t), max_size=3)))
        bounds = [0, *cuts, t]
        seq_lens = tuple(hi - lo for lo, hi in zip(bounds[:-1], bounds[1:]))
    return DSAIndexerCase(
        b=b, s=s, t=t, heads=draw(st.integers(1, max_heads)), dim=draw(st.sampled_from(positive_ints("dims", dims))),
        topk=draw(st.integers(1, max_topk)), causal=draw(st.sampled_from(choices("causal", causal))),
        padding=draw(st.sampled_from(choices("padding", padding))), seq_lens=seq_lens,
        quantised=draw(st.sampled_from(choices("quantised", quantised))),
        scale=draw(st.sampled_from((0.5, 1.0, 0.125))),
    )


@st.composite
def dsa_indexer_inputs(draw, *, dtypes: Sequence[torch.dtype] = (torch.float32,),
                       device: str | torch.device = "cpu", **case_bounds: Any) -> DSAIndexerArgs:
    """Draw a case (``case_bounds``: the arguments of :func:`dsa_indexer_cases`), a dtype and a seed, and
    build the call's arguments with :func:`make_dsa_indexer_args`."""
    return draw_call(draw, dsa_indexer_cases(**case_bounds), make_dsa_indexer_args, dtypes, device, False)


# ----------------------------------------------------------------------------------------------
# Sparse attention
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DSAAttentionCase:
    """One sparse attention call: ``b``, ``s`` queries, ``t`` keys, ``hq`` / ``hkv`` heads, ``dqk`` / ``dv``
    widths, ``topk``; ``absorbed``: the MQA form (``v=None``, ``hkv`` 1, value = k[..., :dv]);
    ``transposed``: q and k as non-contiguous views; ``scale`` None: Dqk ** -0.5."""

    b: int = 1
    s: int = 4
    t: int = 9
    hq: int = 4
    hkv: int = 1
    dqk: int = 24
    dv: int = 16
    topk: int = 5
    absorbed: bool = True
    transposed: bool = False
    scale: float | None = None

    def with_(self, **changes) -> "DSAAttentionCase":
        return replace(self, **changes)


class DSAAttentionArgs(dict):
    """The arguments of ``dsa_sparse_attention(**args)`` (q, k, v, indices, scale, d_v), with the draw as
    ``case`` and ``seed``."""

    case: DSAAttentionCase
    seed: int

    def __repr__(self) -> str:
        return f"DSAAttentionArgs({self.case}, dtype={self['q'].dtype}, seed={self.seed})"


def random_indices(b: int, s: int, t: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [B, S, topk]: per row a random number of unique keys at random slots, -1 elsewhere (row 0
    of batch 0 has none)."""
    idx = torch.full((b, s, topk), -1, dtype=torch.int32)
    for bi in range(b):
        for i in range(s):
            n = 0 if bi == i == 0 else int(torch.randint(0, min(t, topk) + 1, (), generator=gen))
            slots = torch.randperm(topk, generator=gen)[:n]
            idx[bi, i, slots] = torch.randperm(t, generator=gen)[:n].to(torch.int32)
    return idx


def make_dsa_attention_args(case: DSAAttentionCase, dtype: torch.dtype = torch.float32,
                            device: str | torch.device = "cpu", seed: int = 0,
                            requires_grad: bool = False) -> DSAAttentionArgs:
    """The tensors of one call for ``case`` (drawn on CPU from ``seed``, then moved); with
    ``requires_grad`` q, k (and v) are leaves needing grad."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    gen = torch.Generator().manual_seed(seed)
    b, s, t = case.b, case.s, case.t
    hkv = 1 if case.absorbed else case.hkv

    def tensor(*shape):
        if case.transposed:  # stored with the first two dims swapped: a non-contiguous view
            return torch.randn(shape[1], shape[0], *shape[2:], generator=gen).transpose(0, 1)
        return torch.randn(*shape, generator=gen)

    q, k = tensor(b, s, case.hq, case.dqk), tensor(b, t, hkv, case.dqk)
    v = None if case.absorbed else tensor(b, t, hkv, case.dv)
    idx = random_indices(b, s, t, case.topk, gen)

    def prep(x):
        if x is None:
            return None
        x = x.to(device=device, dtype=dtype)
        return x.detach().requires_grad_(True) if requires_grad else x

    args = DSAAttentionArgs(q=prep(q), k=prep(k), v=prep(v), indices=idx.to(device), scale=case.scale,
                            d_v=case.dv if case.absorbed else None)
    args.case, args.seed = case, seed
    return args


@st.composite
def dsa_attention_cases(
    draw,
    *,
    max_batch: int = 2,
    max_s: int = 6,
    max_t: int = 40,
    max_topk: int = 40,
    max_groups: int = 4,
    qk_dims: Sequence[int] = (12, 24, 40),
    value_dims: Sequence[int] = (8, 16),
    absorbed: bool | Sequence[bool] = (True, False),
    transposed: bool | Sequence[bool] = (False, True),
) -> DSAAttentionCase:
    """Draw a :class:`DSAAttentionCase`: B, S, T, topk from 1 up to their bounds (topk may exceed T); Hkv
    in 1..3 (absorbed: 1) times a group size in 1..max_groups; Dqk from ``qk_dims``; Dv from
    ``value_dims`` (absorbed: at most Dqk)."""
    for name, value in (("max_batch", max_batch), ("max_s", max_s), ("max_t", max_t), ("max_topk", max_topk),
                        ("max_groups", max_groups)):
        positive_ints(name, [value])
    is_absorbed = draw(st.sampled_from(choices("absorbed", absorbed)))
    hkv = 1 if is_absorbed else draw(st.integers(1, 3))
    dqk = draw(st.sampled_from(positive_ints("qk_dims", qk_dims)))
    dv = draw(st.sampled_from(positive_ints("value_dims", value_dims)))
    return DSAAttentionCase(
        b=draw(st.integers(1, max_batch)), s=draw(st.integers(1, max_s)), t=draw(st.integers(1, max_t)),
        hq=hkv * draw(st.integers(1, max_groups)), hkv=hkv, dqk=dqk, dv=min(dv, dqk) if is_absorbed else dv,
        topk=draw(st.integers(1, max_topk)), absorbed=is_absorbed,
        transposed=draw(st.sampled_from(choices("transposed", transposed))),
        scale=draw(st.sampled_from((None, 0.3))),
    )


@st.composite
def dsa_attention_inputs(draw, *, dtypes: Sequence[torch.dtype] = (torch.float32,),
                         device: str | torch.device = "cpu", requires_grad: bool = False,
                         **case_bounds: Any) -> DSAAttentionArgs:
    """Draw a case (``case_bounds``: the arguments of :func:`dsa_attention_cases`), a dtype and a seed, and
    build the call's arguments with :func:`make_dsa_attention_args`."""
    return draw_call(draw, dsa_attention_cases(**case_bounds), make_dsa_attention_args, dtypes, device,
                     requires_grad)
