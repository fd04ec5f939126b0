"""Hypothesis strategies for ``kda_compile.ops.compressed_sparse_attention`` (DeepSeek-V4's attention over a
sliding window, compressed entries and sinks), drawn under bounds.

``compressed_attention_cases`` draws a :class:`CompressedAttentionCase`: the layer kind (sliding only, CSA with
an indexer's picks, HCA with every closed entry, every entry), prefill / chunk / decode against a window of keys, windows wider
and narrower than the keys, no compressed entry at all, left padding, picks with -1 holes; ``make_compressed_
attention_args`` builds the arguments of one call; ``compressed_attention_inputs`` draws both.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
from hypothesis import strategies as st

from kda_compile.testing.options import FLOAT_DTYPES, choices, draw_call, positive_ints

COMPRESSED_KINDS = ("sliding", "csa", "hca", "all")
COMPRESSED_QUERY_KINDS = ("prefill", "chunk", "decode")


@dataclass(frozen=True)
class CompressedAttentionCase:
    """One call: ``b`` batch, ``heads`` query heads of width ``dim``, ``s`` queries ending a timeline of ``tw``
    window keys, ``tc`` compressed entries (0 for ``"sliding"``), ``window`` keys per query; CSA: ``topk`` picks
    per query; HCA: ``rate`` tokens per entry; ``"all"``: every entry seen; ``padding``: the first row's first
    keys masked out."""

    kind: str = "csa"
    b: int = 1
    heads: int = 2
    dim: int = 16
    s: int = 4
    tw: int = 6
    tc: int = 3
    window: int = 4
    topk: int = 2
    rate: int = 2
    padding: bool = False
    scale: float = 0.25

    def with_(self, **changes) -> "CompressedAttentionCase":
        return replace(self, **changes)


class CompressedAttentionArgs(dict):
    """The arguments of ``compressed_sparse_attention(**args)``, with the draw as ``case`` and ``seed``."""

    case: CompressedAttentionCase
    seed: int

    def __repr__(self) -> str:
        return f"CompressedAttentionArgs({self.case}, dtype={self['query'].dtype}, seed={self.seed})"


def _picks(b: int, s: int, tc: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [B, S, topk]: unique entries per row with -1 holes (as an indexer pads rows that see fewer)."""
    picks = torch.full((b, s, topk), -1, dtype=torch.int32)
    for row in range(b * s):
        n = int(torch.randint(0, min(tc, topk) + 1, (), generator=gen))
        slots = torch.randperm(topk, generator=gen)[:n]
        picks.view(-1, topk)[row, slots] = torch.randperm(tc, generator=gen)[:n].to(torch.int32)
    return picks


def make_compressed_attention_args(case: CompressedAttentionCase, dtype: torch.dtype = torch.float32,
                                   device: str | torch.device = "cpu", seed: int = 0,
                                   requires_grad: bool = False) -> CompressedAttentionArgs:
    """The tensors of one call for ``case`` (drawn on CPU from ``seed``, then moved); with ``requires_grad`` the
    query, both key tensors and the sinks are leaves needing grad."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    if case.kind not in COMPRESSED_KINDS:
        raise ValueError(f"case.kind must be one of {COMPRESSED_KINDS}, got {case.kind!r}")
    if case.s > case.tw:
        raise ValueError(f"case.s must be at most case.tw (the window keys end with the queries), got {case}")
    gen = torch.Generator().manual_seed(seed)
    b, h, s, d = case.b, case.heads, case.s, case.dim
    tc = 0 if case.kind == "sliding" else case.tc
    tensors = [torch.randn(b, h, s, d, generator=gen), torch.randn(b, 1, case.tw, d, generator=gen),
               torch.randn(b, 1, tc, d, generator=gen), torch.randn(h, generator=gen)]
    query, window_kv, compressed_kv, sinks = (
        t.to(device=device, dtype=dtype).requires_grad_(requires_grad) for t in tensors)
    args = CompressedAttentionArgs(query=query, window_kv=window_kv, compressed_kv=compressed_kv, sinks=sinks,
                                   scale=case.scale, sliding_window=case.window)
    if case.kind == "csa":
        args["selected"] = _picks(b, s, tc, case.topk, gen).to(device)
    elif case.kind == "hca":
        args["compress_rate"] = case.rate
        args["query_positions"] = torch.arange(case.tw - s, case.tw).expand(b, s).to(device)
    if case.padding:
        mask = torch.ones(b, case.tw, dtype=torch.bool)
        mask[0, : case.tw // 2] = False
        args["key_padding_mask"] = mask.to(device)
    args.case, args.seed = case, seed
    return args


@st.composite
def compressed_attention_cases(
    draw,
    *,
    max_batch: int = 2,
    max_heads: int = 4,
    max_keys: int = 24,
    max_entries: int = 8,
    max_window: int = 10,
    dims: Sequence[int] = (8, 16, 32),
    kinds: str | Sequence[str] = COMPRESSED_KINDS,
    query_kinds: str | Sequence[str] = COMPRESSED_QUERY_KINDS,
    padding: bool | Sequence[bool] = (False, True),
) -> CompressedAttentionCase:
    """Draw a :class:`CompressedAttentionCase`.

    Args:
        max_batch, max_heads: B and H from 1 up to these.
        max_keys: window keys Tw from 1 up to it; ``"prefill"`` has S = Tw, ``"chunk"`` S < Tw, ``"decode"``
            S = 1.
        max_entries: compressed entries Tc from 0 up to it (CSA picks from 1 up to it).
        max_window: the sliding window W from 1 up to it (often above Tw).
        dims, kinds, query_kinds, padding: which values are drawn.
    """
    for name, value in (("max_batch", max_batch), ("max_heads", max_heads), ("max_keys", max_keys),
                        ("max_entries", max_entries), ("max_window", max_window)):
        positive_ints(name, [value])
    tw = draw(st.integers(1, max_keys))
    query_kind = draw(st.sampled_from(choices("query_kinds", query_kinds, COMPRESSED_QUERY_KINDS)))
    s = {"prefill": tw, "decode": 1, "chunk": draw(st.integers(1, tw))}[query_kind]
    return CompressedAttentionCase(
        kind=draw(st.sampled_from(choices("kinds", kinds, COMPRESSED_KINDS))), b=draw(st.integers(1, max_batch)),
        heads=draw(st.integers(1, max_heads)), dim=draw(st.sampled_from(positive_ints("dims", dims))), s=s, tw=tw,
        tc=draw(st.integers(0, max_entries)), window=draw(st.integers(1, max_window)),
        topk=draw(st.integers(1, max_entries)), rate=draw(st.integers(1, 4)),
        padding=draw(st.sampled_from(choices("padding", padding))), scale=draw(st.sampled_from((0.25, 0.5, 1.0))))


@st.composite
def compressed_attention_inputs(draw, *, dtypes: Sequence[torch.dtype] = (torch.float32,),
                                device: str | torch.device = "cpu", requires_grad: bool = False,
                                **case_bounds: Any) -> CompressedAttentionArgs:
    """Draw a case (``case_bounds``: the arguments of :func:`compressed_attention_cases`), a dtype and a seed,
    and build the call's arguments with :func:`make_compressed_attention_args`."""
    return draw_call(draw, compressed_attention_cases(**case_bounds), make_compressed_attention_args, dtypes, device,
                     requires_grad)
