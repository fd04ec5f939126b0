"""Checks of a static cache against the call that writes it, before the compiled step runs.

A Hugging Face ``StaticCache`` allocates its tensors at its first write (batch, heads, dtype and device
of that call) and never again. A later call that does not fit it fails badly inside a compiled step:
an ``index_copy_`` past ``max_cache_len`` is a device-side assert on a GPU (or, replayed from a CUDA
graph, a write outside the cache), another batch size or device fails deep in Inductor's code, and a
cache of another dtype may be cast silently. So ``kda_compile.optimize``'s wrapper checks each call
that passes a static cache, on the host, and raises a ``ValueError`` naming ``past_key_values``, the
value and what fits:

- **device**: every allocated cache tensor on the device of ``input_ids`` / ``inputs_embeds``;
- **batch**: the batch the cache was allocated for equals the call's;
- **dtype**: the attention key / value tensors in the dtype of the model's input embeddings (checked
  only with autocast off, where the keys are made in that dtype);
- **room**: the positions the call writes fit ``max_cache_len`` of the cache's full-attention layers
  (sliding-window layers roll and linear-attention states have no length).

The position is tracked on the host so that decode steps cost no synchronisation: it is read from the
cache (one device read) at each prefill and whenever the tracked value would not fit, and advanced by
the call's tokens otherwise.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from kda_compile.cuda_graphs import token_input

logger = logging.getLogger("kda_compile.cache_checks")

_UNKNOWN = object()


@dataclass
class _Tracked:
    """What the checks remember about one cache between calls. Kept beside the cache, not on it: an attribute
    written at every step would change the cache object's ``__dict__``, which Dynamo's guards watch."""

    next_position: int | None = None  # its length after the last checked call
    checked: tuple | None = None  # the (batch, device) its allocated tensors passed
    capacity: Any = _UNKNOWN  # max_cache_len of its full-attention layers, or None


_tracked: "weakref.WeakKeyDictionary[Any, _Tracked]" = weakref.WeakKeyDictionary()


def _state(cache: Any) -> _Tracked:
    try:
        state = _tracked.get(cache)
        if state is None:
            state = _tracked[cache] = _Tracked()
        return state
    except TypeError:  # a cache that cannot be weakly referenced: nothing is remembered, every call checks in full
        return _Tracked()


# The cache tensors that carry the batch in dim 0 (HF's static, linear-attention and DSA indexer layers)
BATCHED_TENSORS = ("keys", "values", "conv_states", "recurrent_states", "indexer_keys")


def _layer_tensors(layer: Any) -> list[tuple[str, torch.Tensor]]:
    found = []
    for name, value in vars(layer).items():
        if name not in BATCHED_TENSORS:
            continue
        values = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else None
        if values is None:
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                found.append((name, value))
            continue
        found += [(f"{name}[{key}]", v) for key, v in values if isinstance(v, torch.Tensor) and v.dim() >= 2]
    return found


def _full_attention_capacity(cache: Any) -> int | None:
    """``max_cache_len`` of the cache's full-attention static layers (None when it has none)."""
    from transformers.cache_utils import StaticLayer

    lengths = [layer.max_cache_len for layer in getattr(cache, "layers", ())
               if isinstance(layer, StaticLayer) and not getattr(layer, "is_sliding", False)]
    return min(lengths) if lengths else None


def _seq_length(cache: Any) -> int:
    length = cache.get_seq_length()
    return int(length.item()) if isinstance(length, torch.Tensor) else int(length)


def check_static_cache(cache: Any, args: tuple, kwargs: dict, embedding_dtype: Callable[[], torch.dtype | None],
                       prefill: bool) -> None:
    """Raise ``ValueError`` when the call does not fit ``cache`` (module docstring); ``prefill`` when the
    call carries more than one token per sequence; ``embedding_dtype()`` the model's compute dtype (None when
    unknown), asked only when the cache's tensors are walked. A call without tokens we recognise is not
    checked."""
    tokens = token_input(args, kwargs)
    if tokens is None:
        return
    batch, length, device = tokens.shape[0], tokens.shape[1], tokens.device
    signature, state = (batch, device), _state(cache)
    if prefill or state.checked != signature:
        dtype = None if torch.is_autocast_enabled(device.type) else embedding_dtype()
        _check_tensors(cache, batch, device, dtype)
        if not prefill:  # a decode step's cache is fully allocated: later steps with this signature skip the walk
            state.checked = signature
    _check_room(cache, state, length, prefill)


def _check_tensors(cache: Any, batch: int, device: torch.device, dtype: torch.dtype | None) -> None:
    from transformers.cache_utils import StaticLayer

    for index, layer in enumerate(getattr(cache, "layers", ())):
        for name, tensor in _layer_tensors(layer):
            where = f"past_key_values.layers[{index}].{name}"
            if tensor.device != device:
                raise ValueError(f"past_key_values: {where} is on {tensor.device}, the call's inputs on {device}; "
                                 "a static cache is allocated on the device of its first call: make one per device")
            if tensor.shape[0] != batch:
                raise ValueError(f"past_key_values: the call's batch is {batch}, but {where} was allocated for batch "
                                 f"{tensor.shape[0]} by the cache's first call; a static cache serves one batch size "
                                 "(reset() keeps its allocation): make one per batch size")
            if dtype is not None and isinstance(layer, StaticLayer) and name in ("keys", "values") \
                    and tensor.dtype != dtype:
                raise ValueError(f"past_key_values: {where} is {tensor.dtype}, the model computes in {dtype}; make "
                                 "the cache with the model's dtype (or let its first call allocate it)")


def _check_room(cache: Any, state: _Tracked, length: int, prefill: bool) -> None:
    if state.capacity is _UNKNOWN:
        state.capacity = _full_attention_capacity(cache)
    capacity = state.capacity
    if capacity is None:
        return
    start = state.next_position
    if prefill or start is None:
        start = _seq_length(cache)
    elif start + length > capacity:
        start = _seq_length(cache)  # the cache may have been reset or cropped since: read it before refusing
    if start + length > capacity:
        raise ValueError(f"past_key_values: this call writes positions {start} to {start + length - 1}, past the "
                         f"static cache's max_cache_len={capacity}; make the cache with max_cache_len >= the prompt "
                         "plus max_new_tokens, or reset() it before a new prompt")
    state.next_position = start + length
