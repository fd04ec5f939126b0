"""Hugging Face's static sliding-window cache layers, made capturable in a CUDA graph for decode.

``transformers.StaticSlidingWindowLayer`` (Gemma 2 / 3, GPT-OSS, Mistral, Cohere 2 ... under a
``StaticCache``) keeps how many tokens it has seen twice: as a tensor (``cumulative_length``, advanced
only while the window is not yet full) and as a Python int (``cumulative_length_int``) that its
``update`` branches on and advances. Inside a compiled decode step that int is read and written, so
Dynamo either specialises the graph on its value (a new graph at every token) or makes it a symbolic
input (a CUDA graph recorded again for every value). Either way decode cannot replay one graph.

:func:`make_capturable` switches each such layer of a cache to a subclass whose single-token update,
when traced, is tensor-only:

- the tensor length always holds the number of tokens seen (also after a prefill that filled the
  window, where HF's layer leaves it behind);
- the new token goes to slot ``min(length, window - 1)`` of the window, after a left shift by one when
  the window is full: HF's own layout (slot ``i`` holds position ``kv_offset + i``), so HF's sliding
  masks, which ``generate()`` builds outside the compiled region from ``cumulative_length_int``, stay
  right;
- the Python int is not touched inside the graph. The caller that ran the compiled step advances it
  afterwards (:func:`advance_host_lengths`; ``kda_compile.optimize``'s wrapper does), and only for the
  layers whose int did not move: a step that ran eagerly (a Dynamo fallback) advanced its own.

Everything else (prefill, eager calls, multi-token updates) is HF's code. The shift reads and writes
the window once per step, as HF's own full-window path does.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger("kda_compile.sliding_window_cache")

_MARK = "_kda_compile_sliding_layers"  # on a cache whose sliding layers were switched: those layers
_subclasses: dict[type, type] = {}


def _capturable_update(hf_update):
    """The single-token update of the module docstring, in front of HF's ``update`` (``hf_update``)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        keys = getattr(self, "keys", None)
        if not (torch.compiler.is_compiling() and isinstance(keys, torch.Tensor) and key_states.shape[-2] == 1):
            result = hf_update(self, key_states, value_states, *args, **kwargs)
            self.cumulative_length.fill_(self.cumulative_length_int)  # HF stops advancing it once full
            return result
        seen = self.cumulative_length  # tokens before this one (0-d, on the cache's device)
        full = seen >= self.max_cache_len
        slot = seen.clamp(max=self.max_cache_len - 1).reshape(1)
        for cached, new in ((self.keys, key_states), (self.values, value_states)):
            shifted = torch.where(full, cached.roll(-1, dims=-2), cached)
            shifted.index_copy_(2, slot, new)
            cached.copy_(shifted)  # in place: the cache tensors keep their static addresses
        self.cumulative_length.add_(1)
        return self.keys, self.values

    return update


def _capturable_class(cls: type) -> type:
    """``cls`` with the capturable update; no slots of its own, so a layer's class can be switched in place."""
    if cls not in _subclasses:
        _subclasses[cls] = type(f"Capturable{cls.__name__}", (cls,), {
            "__slots__": (), "__module__": __name__, "kda_compile_capturable": True,
            "update": _capturable_update(cls.update),
            "__doc__": f"{cls.__name__} with a tensor-only decode update under torch.compile "
                       "(kda_compile.sliding_window_cache)."})
    return _subclasses[cls]


def _hf_sliding_class() -> type | None:
    try:
        from transformers.cache_utils import StaticSlidingWindowLayer
    except ImportError:
        return None
    return StaticSlidingWindowLayer


def sliding_layers(cache: Any) -> list[Any]:
    """The cache's HF static sliding-window layers (switched or not)."""
    hf_class = _hf_sliding_class()
    layers = getattr(cache, "layers", None)
    if hf_class is None or not isinstance(layers, (list, tuple)):
        return []
    return [layer for layer in layers if isinstance(layer, hf_class)]


def make_capturable(cache: Any) -> list[Any]:
    """Switch every HF static sliding-window layer of ``cache`` to its capturable subclass (same state,
    same eager behaviour) and return those layers. Cheap on a cache seen before (the list is kept on it)."""
    if cache is None:
        return []
    known = getattr(cache, _MARK, None)
    if known is not None:
        return known
    layers = sliding_layers(cache)
    for layer in layers:
        if not is_capturable(layer):
            layer.__class__ = _capturable_class(type(layer))
    try:
        setattr(cache, _MARK, layers)
    except AttributeError:  # a cache class with __slots__: looked up again at the next call
        pass
    if layers:
        logger.debug("%d sliding-window cache layer(s) of %s made capturable", len(layers), type(cache).__name__)
    return layers


def is_capturable(layer: Any) -> bool:
    return bool(getattr(layer, "kda_compile_capturable", False))


def host_lengths(layers: list[Any]) -> list[int]:
    """``cumulative_length_int`` of each sliding layer, before a call (for :func:`advance_host_lengths`)."""
    return [layer.cumulative_length_int for layer in layers]


def advance_host_lengths(layers: list[Any], before: list[int], tokens: int) -> None:
    """After a compiled call of ``tokens`` tokens per sequence: advance the Python length of each sliding
    layer that the graph updated without touching it (its value is still ``before``'s)."""
    for layer, prior in zip(layers, before):
        if layer.cumulative_length_int == prior:
            layer.cumulative_length_int = prior + tokens
