"""Hypothesis strategies for the block-sparse attention (``kda_compile.ops.block_sparse_attention``), drawn under
bounds.

``block_sparse_cases`` draws a :class:`BlockSparseCase` (prefill, a chunk against a cache, decode; GQA groups;
block sizes that do and do not divide T; selections with -1 padding, repeated blocks, and rows whose slots are
all empty; explicit query positions; padded keys; non-contiguous layouts); ``make_block_sparse_args`` builds the
keyword arguments of one call; ``block_sparse_inputs`` draws both.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
from hypothesis import strategies as st

from kda_compile.testing.options import FLOAT_DTYPES, choices, draw_call, positive_ints

BLOCK_SPARSE_QUERY_KINDS = ("prefill", "chunk", "decode")


@dataclass(frozen=True)
class BlockSparseCase:
    """One call: ``b`` batch rows, ``heads`` query heads in ``groups`` KV groups, ``sq`` queries, ``t`` keys, widths
    ``dim`` / ``dv``, ``block_size``, ``slots`` (K) per selection; ``positions``: explicit ``query_positions``
    (random, some before the first key) instead of the default; ``padding``: a random ``key_padding_mask``;
    ``repeats``: some selections name a block twice; ``transposed``: query, key and value as non-contiguous
    views; ``scale`` None: ``dim ** -0.5``."""

    b: int = 1
    heads: int = 4
    groups: int = 2
    sq: int = 4
    t: int = 40
    dim: int = 16
    dv: int = 16
    block_size: int = 16
    slots: int = 2
    positions: bool = False
    padding: bool = False
    repeats: bool = False
    transposed: bool = False
    scale: float | None = None

    def with_(self, **changes) -> "BlockSparseCase":
        return replace(self, **changes)


class BlockSparseArgs(dict):
    """The arguments of ``block_sparse_attention(**args)`` (query, key, value, block_indices, block_size, scale,
    query_positions, key_padding_mask), with the draw as ``case`` and ``seed``."""

    case: BlockSparseCase
    seed: int

    def __repr__(self) -> str:
        return f"BlockSparseArgs({self.case}, dtype={self['query'].dtype}, seed={self.seed})"


def random_block_indices(b: int, groups: int, sq: int, blocks: int, slots: int, gen: torch.Generator, *,
                         repeats: bool = False) -> torch.Tensor:
    """int64 [B, G, Sq, K]: per selection a random number of distinct blocks, left-packed in random order, -1
    after them (HF's layout; selection [0, 0, 0] is all -1); with ``repeats`` a selection with room names its
    first block again in its last slot."""
    idx = torch.full((b, groups, sq, slots), -1, dtype=torch.int64)
    for row in range(b):
        for g in range(groups):
            for i in range(sq):
                n = 0 if row == g == i == 0 else int(torch.randint(1, min(blocks, slots) + 1, (), generator=gen))
                idx[row, g, i, :n] = torch.randperm(blocks, generator=gen)[:n]
                if repeats and 0 < n < slots:
                    idx[row, g, i, -1] = idx[row, g, i, 0]
    return idx


def make_block_sparse_args(case: BlockSparseCase, dtype: torch.dtype = torch.float32,
                           device: str | torch.device = "cpu", seed: int = 0,
                           requires_grad: bool = False) -> BlockSparseArgs:
    """The tensors of one call for ``case`` (drawn on CPU from ``seed``, then moved); with ``requires_grad``
    query, key and value are leaves needing grad."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    if case.heads % case.groups:
        raise ValueError(f"case.groups must divide case.heads, got {case.groups} and {case.heads}")
    gen = torch.Generator().manual_seed(seed)
    b, t = case.b, case.t

    def tensor(*shape):
        if case.transposed:  # stored as [B, S, heads, D]: HF's layout before its transpose(1, 2)
            return torch.randn(shape[0], shape[2], shape[1], shape[3], generator=gen).transpose(1, 2)
        return torch.randn(*shape, generator=gen)

    query = tensor(b, case.heads, case.sq, case.dim)
    key, value = tensor(b, case.groups, t, case.dim), tensor(b, case.groups, t, case.dv)
    blocks = -(-t // case.block_size)
    idx = random_block_indices(b, case.groups, case.sq, blocks, case.slots, gen, repeats=case.repeats)
    positions = torch.randint(-2, t + 2, (b, case.sq), generator=gen) if case.positions else None
    padding = (torch.rand(b, t, generator=gen) > 0.25) if case.padding else None

    def prep(x):
        x = x.to(device=device, dtype=dtype)
        return x.detach().requires_grad_(True) if requires_grad else x

    args = BlockSparseArgs(query=prep(query), key=prep(key), value=prep(value), block_indices=idx.to(device),
                           block_size=case.block_size, scale=case.scale,
                           query_positions=None if positions is None else positions.to(device),
                           key_padding_mask=None if padding is None else padding.to(device))
    args.case, args.seed = case, seed
    return args


@st.composite
def block_sparse_cases(
    draw,
    *,
    max_batch: int = 2,
    max_queries: int = 6,
    max_keys: int = 80,
    max_groups: int = 3,
    max_heads_per_group: int = 3,
    max_slots: int = 5,
    block_sizes: Sequence[int] = (16, 32, 8, 12),
    head_dims: Sequence[int] = (8, 16, 24),
    kinds: str | Sequence[str] = BLOCK_SPARSE_QUERY_KINDS,
    transposed: bool | Sequence[bool] = (False, True),
) -> BlockSparseCase:
    """Draw a :class:`BlockSparseCase`: T from 1 to ``max_keys``; Sq by ``kinds`` ("prefill": Sq = T up to
    ``max_queries``, else a chunk of at most that many queries at the end of T, or one query: "decode"); G up to
    ``max_groups`` with up to ``max_heads_per_group`` heads each; widths from ``head_dims``; the block size from
    ``block_sizes``; K up to ``max_slots`` (may exceed the number of blocks)."""
    for name, value in (("max_batch", max_batch), ("max_queries", max_queries), ("max_keys", max_keys),
                        ("max_groups", max_groups), ("max_heads_per_group", max_heads_per_group),
                        ("max_slots", max_slots)):
        positive_ints(name, [value])
    kind = draw(st.sampled_from(choices("kinds", kinds, BLOCK_SPARSE_QUERY_KINDS)))
    t = draw(st.integers(1, max_keys if kind != "prefill" else min(max_keys, max_queries)))
    sq = {"prefill": t, "decode": 1}.get(kind) or draw(st.integers(1, min(t, max_queries)))
    groups = draw(st.integers(1, max_groups))
    return BlockSparseCase(
        b=draw(st.integers(1, max_batch)), heads=groups * draw(st.integers(1, max_heads_per_group)), groups=groups,
        sq=sq, t=t, dim=draw(st.sampled_from(positive_ints("head_dims", head_dims))),
        dv=draw(st.sampled_from(positive_ints("head_dims", head_dims))),
        block_size=draw(st.sampled_from(positive_ints("block_sizes", block_sizes))),
        slots=draw(st.integers(1, max_slots)), positions=draw(st.booleans()), padding=draw(st.booleans()),
        repeats=draw(st.booleans()), transposed=draw(st.sampled_from(choices("transposed", transposed))),
        scale=draw(st.sampled_from((None, 0.3))),
    )


@st.composite
def block_sparse_inputs(draw, *, dtypes: Sequence[torch.dtype] = (torch.float32,),
                        device: str | torch.device = "cpu", requires_grad: bool = False,
                        **case_bounds: Any) -> BlockSparseArgs:
    """Draw a case (``case_bounds``: the arguments of :func:`block_sparse_cases`), a dtype and a seed, and build
    the call's arguments with :func:`make_block_sparse_args`."""
    return draw_call(draw, block_sparse_cases(**case_bounds), make_block_sparse_args, dtypes, device,
                     requires_grad)
