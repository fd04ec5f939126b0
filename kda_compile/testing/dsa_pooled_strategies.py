"""Hypothesis strategies for glm5_next's pooled DSA indexer (``kda_compile.ops.dsa_pooled_indexer_topk``), drawn
under bounds.

``dsa_pooled_cases`` draws a :class:`DSAPooledCase`: prefill, a chunk against a cache, decode, or a static cache
whose slots past the filled length are invalid; pools of 1 to 16 tokens with T around their edges; left padding
and holes among the keys; padded queries; ``topk`` above the number of pools; the key flags as None, a bool mask
or HF's cache layout (keys, gates and floating flags as views of one ``cat([k, gate, valid])`` tensor, the flags
nonzero values of either sign); quantised inputs whose pool keys and fp32 scores are exact (a gate whose softmax
picks one token per channel), so ties are frequent and the tie rule is exercised. ``make_dsa_pooled_args`` builds
the keyword arguments of one call (``hf_cache_rows`` the cache's views); ``dsa_pooled_inputs`` draws both.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
from hypothesis import strategies as st

from kda_compile.testing.options import FLOAT_DTYPES, choices, draw_call, positive_ints

DSA_POOLED_QUERY_KINDS = ("prefill", "chunk", "decode", "static cache")
KEY_FLAG_FORMS = ("none", "bool", "hf rows")


@dataclass(frozen=True)
class DSAPooledCase:
    """One pooled indexer call: ``b`` batch, ``s`` queries ending at the ``filled`` keys of a ``t``-slot cache
    (``filled`` = T but for a static cache), ``heads`` x ``dim`` indexer heads, pools of ``pool`` tokens,
    ``topk`` tokens; ``padding`` (left padding in rows 1..), ``holes`` (random invalid keys), ``key_flags`` (one
    of ``KEY_FLAG_FORMS``; "none" needs neither padding nor holes nor a static cache), ``query_padding`` (padded
    queries masked), ``select_tail``, ``quantised`` and the dot product's ``scale``."""

    b: int = 1
    s: int = 4
    t: int = 20
    filled: int = 20
    heads: int = 2
    dim: int = 8
    pool: int = 4
    topk: int = 8
    padding: bool = False
    holes: bool = False
    key_flags: str = "bool"
    query_padding: bool = False
    select_tail: bool = True
    quantised: bool = True
    scale: float = 0.5

    def with_(self, **changes) -> "DSAPooledCase":
        return replace(self, **changes)


class DSAPooledArgs(dict):
    """The arguments of ``dsa_pooled_indexer_topk(**args)`` (q, k, weights, gate, ape, topk, scale, key_valid,
    query_mask, q_offset, select_tail), with the draw that made them as ``case`` and ``seed``."""

    case: DSAPooledCase
    seed: int

    def __repr__(self) -> str:
        return f"DSAPooledArgs({self.case}, dtype={self['q'].dtype}, seed={self.seed})"


def hf_cache_rows(k: torch.Tensor, gate: torch.Tensor, flags: torch.Tensor | None,
                  lead: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k, gate, flags) as views of one ``cat([k, gate, flags])`` tensor in k's dtype, the rows HF's glm5_next cache
    keeps (``flags`` [B, T] of any dtype, None: every key valid); ``lead`` extra columns in front of the keys move
    every row's alignment."""
    b, t, d = k.shape
    flags = torch.ones(b, t, device=k.device) if flags is None else flags
    parts = [k.new_zeros(b, t, lead)] if lead else []
    rows = torch.cat(parts + [k, gate.to(k.dtype), flags.to(k.dtype)[..., None]], dim=-1)
    return rows[..., lead:lead + d], rows[..., lead + d:lead + 2 * d], rows[..., lead + 2 * d]


def make_dsa_pooled_args(case: DSAPooledCase, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                         seed: int = 0, requires_grad: bool = False) -> DSAPooledArgs:
    """The tensors of one pooled indexer call for ``case`` (drawn on CPU from ``seed``, then moved); weights and
    ``ape`` float32, as HF keeps them. ``requires_grad`` is accepted for symmetry and ignored: the indexer has no
    gradient."""
    if dtype not in FLOAT_DTYPES[:3]:
        raise TypeError(f"dtype must be one of {FLOAT_DTYPES[:3]}, got {dtype}")
    if case.key_flags not in KEY_FLAG_FORMS:
        raise ValueError(f"key_flags must be one of {KEY_FLAG_FORMS}, got {case.key_flags!r}")
    gen = torch.Generator().manual_seed(seed)
    b, s, t, h, d, p = case.b, case.s, case.t, case.heads, case.dim, case.pool
    if case.quantised:  # exact pools and scores: one leading token per channel (exp(-1000) is 0), small integers
        q = torch.randint(-2, 3, (b, s, h, d), generator=gen).float()
        k = torch.randint(-2, 3, (b, t, d), generator=gen).float()
        w = torch.randint(-2, 3, (b, s, h), generator=gen).float() / 4
        leader = torch.randint(0, p, (d,), generator=gen)
        ape = torch.where(torch.arange(p)[:, None] == leader[None, :], 0.0, -1000.0)
    else:
        q, k = torch.randn(b, s, h, d, generator=gen), torch.randn(b, t, d, generator=gen)
        w = torch.randn(b, s, h, generator=gen) * h ** -0.5
        ape = torch.randn(p, d, generator=gen)
    gate = torch.randn(b, t, d, generator=gen) * 2
    valid = torch.ones(b, t, dtype=torch.bool)
    if case.padding:
        for row in range(1, b):
            valid[row, :int(torch.randint(0, max(1, case.filled), (1,), generator=gen))] = False
    if case.holes:
        valid &= torch.rand(b, t, generator=gen) > 0.15
    valid[:, case.filled:] = False
    q_offset = case.filled - s
    query_mask = valid[:, q_offset:case.filled].clone() if case.query_padding else None
    k, gate = k.to(dtype), gate.to(dtype)
    key_valid = None if case.key_flags == "none" else valid
    if case.key_flags == "hf rows":  # nonzero flags of either sign, as any HF cache column may hold
        flags = valid.to(dtype) * torch.where(torch.rand(b, t, generator=gen) > 0.5, 1.0, -0.5).to(dtype)
        k, gate, key_valid = hf_cache_rows(k.to(device), gate.to(device), flags.to(device))
    move = (lambda x: x) if case.key_flags == "hf rows" else (lambda x: x.to(device))  # noqa: E731
    args = DSAPooledArgs(
        q=q.to(device=device, dtype=dtype), k=move(k), weights=w.to(device), gate=move(gate), ape=ape.to(device),
        topk=case.topk, scale=case.scale, key_valid=None if key_valid is None else move(key_valid),
        query_mask=None if query_mask is None else query_mask.to(device), q_offset=q_offset,
        select_tail=case.select_tail)
    args.case, args.seed = case, seed
    return args


@st.composite
def dsa_pooled_cases(
    draw,
    *,
    max_batch: int = 3,
    max_t: int = 60,
    max_chunk: int = 6,
    max_heads: int = 3,
    dims: Sequence[int] = (8, 16),
    pools: Sequence[int] = (1, 3, 4, 16),
    query_kinds: str | Sequence[str] = DSA_POOLED_QUERY_KINDS,
    key_flags: str | Sequence[str] = KEY_FLAG_FORMS,
    quantised: bool | Sequence[bool] = (True, False),
) -> DSAPooledCase:
    """Draw a :class:`DSAPooledCase`.

    Args:
        max_batch, max_heads: B and H_I from 1 up to these.
        max_t: cache slots T from 1 up to it (the pool's edges P - 1, P, P + 1 and 2P + 1 favoured).
        max_chunk: S of a ``"chunk"`` against a cache (and of a static cache's step).
        dims: indexer head widths D; pools: pool sizes P.
        query_kinds: ``"prefill"`` (S = T), ``"chunk"``, ``"decode"`` (S = 1), ``"static cache"`` (slots past a
            filled length, invalid; the queries end at it).
        key_flags: which of ``KEY_FLAG_FORMS`` are drawn; quantised: which values are drawn.
    """
    for name, value in (("max_batch", max_batch), ("max_t", max_t), ("max_chunk", max_chunk),
                        ("max_heads", max_heads)):
        positive_ints(name, [value])
    pool = draw(st.sampled_from(positive_ints("pools", pools)))
    edges = [n for n in (pool - 1, pool, pool + 1, 2 * pool + 1) if 1 <= n <= max_t]
    t = draw(st.one_of(st.sampled_from(edges), st.integers(1, max_t)) if edges else st.integers(1, max_t))
    kind = draw(st.sampled_from(choices("query_kinds", query_kinds, DSA_POOLED_QUERY_KINDS)))
    filled = draw(st.integers(1, t)) if kind == "static cache" else t
    s = {"prefill": t, "decode": 1, "chunk": min(t, draw(st.integers(1, max_chunk))),
         "static cache": min(filled, draw(st.integers(1, max_chunk)))}[kind]
    flags = draw(st.sampled_from(choices("key_flags", key_flags, KEY_FLAG_FORMS)))
    masked = flags != "none"
    return DSAPooledCase(
        b=draw(st.integers(1, max_batch)), s=s, t=t, filled=filled if masked else t,
        heads=draw(st.integers(1, max_heads)), dim=draw(st.sampled_from(positive_ints("dims", dims))), pool=pool,
        topk=pool * draw(st.integers(1, max(1, 2 * max_t // pool))), padding=masked and draw(st.booleans()),
        holes=masked and draw(st.booleans()), key_flags=flags, query_padding=draw(st.booleans()),
        select_tail=draw(st.booleans()), quantised=draw(st.sampled_from(choices("quantised", quantised))),
        scale=draw(st.sampled_from((0.5, 1.0, 0.125))),
    )


@st.composite
def dsa_pooled_inputs(draw, *, dtypes: Sequence[torch.dtype] = (torch.float32,),
                      device: str | torch.device = "cpu", **case_bounds: Any) -> DSAPooledArgs:
    """Draw a case (``case_bounds``: the arguments of :func:`dsa_pooled_cases`), a dtype and a seed, and build the
    call's arguments with :func:`make_dsa_pooled_args`."""
    return draw_call(draw, dsa_pooled_cases(**case_bounds), make_dsa_pooled_args, dtypes, device, False)
