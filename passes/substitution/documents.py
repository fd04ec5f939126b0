"""Packed documents at trace time: the boundaries of documents packed into one row, and the causal conv1d
that keeps them apart (docs/packed-documents.md).

Boundaries travel as FLA-style offsets ``cu_seqlens`` ``[N + 1]`` (``0 = o_0 <= o_1 <= ... <= o_N = T``),
under the name Hugging Face's linear-attention layers already forward to their conv and delta-rule functions:
the flash-attention keyword ``cu_seq_lens_q``. ``document_offsets`` derives them from position ids without a
data-dependent shape: always ``T + 1`` offsets, the unused trailing ones repeating ``T`` (empty documents).

Hugging Face's torch ``causal_conv1d_fn`` (kimi_linear, qwen3_next, qwen3_5, qwen3_5_moe, olmo_hybrid,
qwen4_exp) ignores the boundaries: a document's first tokens read the previous document's last ones. Once
kda_compile's substitutes are installed, a call that carries ``cu_seq_lens_q`` is traced as
:func:`causal_conv1d_per_document` instead (every tap that reaches before the token's document start is
zero, as if each document started from a zero conv state); a call without it traces the model's own code.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F

from kda_compile.passes.substitution.substitutes import (OFFSETS_KEYWORD, _copy_of, _not_kept_apart, _substituting,
                                                         register_hf_module_functions)

logger = logging.getLogger("kda_compile.passes.kda_substitution")

CONV_FAMILIES = ("kimi_linear", "qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "qwen4_exp")
CONV_MODULES = tuple(f"transformers.models.{m}.modeling_{m}" for m in CONV_FAMILIES)
CONV_PARAMETERS = ("hidden_states", "weight", "bias", "activation", "kwargs")
CONV_ENTRY = "transformers causal_conv1d_fn"
CONV_FRAME = "hf_causal_conv1d_fn"  # the substitute's frame name (substitution/sites.py reports its sites)
# HF's ACT2FN names of the activations the per-document conv applies (ACT2FN itself is no object Dynamo traces)
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu, "sigmoid": torch.sigmoid,
               "tanh": torch.tanh}


def document_offsets(position_ids: torch.Tensor) -> torch.Tensor:
    """The document offsets ``[B * T + 1]`` (int32) of packed rows of position ids ``[B, T]`` (or one row ``[T]``),
    over the rows' tokens laid end to end (the flattened layout of FLA's ``cu_seqlens`` and of HF's
    flash-attention keywords).

    A document starts where a position does not follow its predecessor by one (Hugging Face's rule,
    ``transformers.masking_utils.find_packed_sequence_indices``, so the linear-attention layers split
    the rows where the softmax-attention masks do), and at the first token of every row. Offset ``i`` is the
    number of tokens in documents before document ``i``; past the last document it is ``B * T``: a fixed shape,
    no host read."""
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be [batch, T] or [T], got shape {tuple(position_ids.shape)}")
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    document = starts.flatten().cumsum(0) - 1  # non-decreasing document index of each token
    every = torch.arange(document.shape[0] + 1, device=position_ids.device, dtype=document.dtype)
    return torch.searchsorted(document, every).to(torch.int32)


def document_starts(offsets: torch.Tensor, length: int) -> torch.Tensor:
    """The first token of each token's document, ``[length]`` int64, from offsets ``[N + 1]`` (empty
    documents, repeated offsets, allowed)."""
    tokens = torch.arange(length, device=offsets.device)
    offsets = offsets.to(torch.int64)
    return offsets[torch.searchsorted(offsets, tokens, right=True) - 1]


def causal_conv1d_per_document(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               offsets: torch.Tensor, activation: Callable | None = None) -> torch.Tensor:
    """Depthwise causal conv1d of ``x`` ``[B, C, T]`` with ``weight`` ``[C, W]`` (and ``bias`` ``[C]``), each
    document of ``offsets`` (``[N + 1]`` over the ``B * T`` tokens of the rows laid end to end, as for the
    delta-rule ops; no document spans two rows) on its own: the tap ``j`` of token ``t`` reads
    ``x[..., t - (W - 1) + j]`` only when that token is in ``t``'s document, else zero. Computed in ``weight``'s
    dtype as Hugging Face's ``causal_conv1d_fn`` does, returned in ``x``'s dtype."""
    C, W = weight.shape
    B, T = x.shape[0], x.shape[-1]
    windows = F.pad(x.to(weight.dtype), (W - 1, 0)).unfold(-1, W, 1)  # [B, C, T, W]
    reach = torch.arange(W - 1, -1, -1, device=x.device)  # how far back tap j reads
    tokens = torch.arange(T, device=x.device)
    row_start = torch.arange(B, device=x.device)[:, None] * T
    starts = document_starts(offsets, B * T).view(B, T) - row_start  # each token's document start in its row
    inside = (tokens[None, :, None] - reach) >= starts[:, :, None]  # [B, T, W]
    out = torch.einsum("bctw,cw->bct", windows * inside[:, None].to(weight.dtype), weight)
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = activation(out)
    return out.to(x.dtype)


def _conv_substitute(entry: str, original: Callable) -> Callable:
    twin = _copy_of(original)

    def hf_causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        offsets = kwargs.get(OFFSETS_KEYWORD)
        if offsets is None:
            return twin(hidden_states, weight, bias, activation, **kwargs)
        if not _substituting(entry):
            _not_kept_apart(entry, "Config(kda_substitution=False)")
            return twin(hidden_states, weight, bias, activation, **kwargs)
        if activation is not None and activation not in ACTIVATIONS:
            _not_kept_apart(entry, f"activation={activation!r}, the per-document conv applies {sorted(ACTIVATIONS)}")
            return twin(hidden_states, weight, bias, activation, **kwargs)
        return causal_conv1d_per_document(hidden_states, weight, bias, offsets, ACTIVATIONS.get(activation))

    return hf_causal_conv1d_fn


def register_conv_substitutes(register_fn: Callable) -> None:
    """Register the substitute of each loaded family module's ``causal_conv1d_fn`` (HF's wrapper and the torch
    function it wraps, which model code may call directly), through ``register_fn(entry, found_at, original,
    make)`` (the substitution registry)."""
    register_hf_module_functions(register_fn, CONV_MODULES, "causal_conv1d_fn", CONV_PARAMETERS, CONV_ENTRY,
                                 lambda original: _conv_substitute(CONV_ENTRY, original),
                                 "packed documents are not kept apart in its conv")
