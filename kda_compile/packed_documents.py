"""Documents packed into one row, kept apart by the linear-attention layers (docs/packed-documents.md).

A call of an ``optimize()`` result on a covered Hugging Face model (the delta-rule families whose conv and
delta-rule functions kda_compile substitutes: kimi_linear, qwen3_next, qwen3_5, qwen3_5_moe, olmo_hybrid,
qwen4_exp) that Hugging Face's masks split into documents (``position_ids`` given, no ``attention_mask``, no
cache) gets the documents' offsets as HF's flash-attention keywords ``cu_seq_lens_q`` / ``cu_seq_lens_k``,
which HF forwards to every layer: ``B * T + 1`` offsets over the batch's rows laid end to end (flash
attention's layout), derived from ``position_ids`` on the device (a fixed shape, no host read). Offsets the caller passes are kept. The substitutes then run each document's conv and
delta rule on its own (passes/substitution/documents.py, substitutes.py). Calls that HF's masks split but
that are not covered here are logged once, with the reason.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from kda_compile.passes.substitution.documents import CONV_MODULES, document_offsets

logger = logging.getLogger("kda_compile.packed_documents")

OFFSET_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k")
_logged: set[str] = set()
_covered: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()  # module -> covered model or None


def _covered_model(module: Any) -> Any:
    """``module`` when it is a model of a covered family, else the first such model it wraps (e.g. in a PEFT
    model), or None. Looked up once per module: a decode step must not walk the module tree."""
    if type(module).__module__ in CONV_MODULES:
        return module
    try:
        return _covered[module]
    except (KeyError, TypeError):  # TypeError: not weakly referenceable (a plain function)
        pass
    modules = getattr(module, "modules", None)
    found = next((m for m in modules() if type(m).__module__ in CONV_MODULES), None) if callable(modules) else None
    try:
        _covered[module] = found
    except TypeError:
        pass
    return found


def _batch_size(position_ids: torch.Tensor, kwargs: dict) -> int:
    for name in ("input_ids", "inputs_embeds"):
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value.shape[0]
    return position_ids.shape[0] if position_ids.dim() == 2 else 1


def _uses_cache(module: Any, kwargs: dict) -> bool:
    """Whether the call runs with a cache, as HF decides: ``use_cache`` from the call, else the config's, off
    when training with gradient checkpointing; or a cache passed."""
    if kwargs.get("past_key_values") is not None:
        return True
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(getattr(module, "config", None), "use_cache", False)
    if module.training and getattr(module, "is_gradient_checkpointing", False) is True:
        return False
    return bool(use_cache)


def _why_not_split(module: Any, position_ids: torch.Tensor, batch: int) -> str | None:
    """Why a call of ``batch`` rows that HF's masks split into documents is not split by the linear-attention
    layers, or None."""
    implementation = str(getattr(getattr(module, "config", None), "_attn_implementation", None))
    if "flash" in implementation:
        return (f"attn_implementation={implementation!r} derives its own flash-attention keywords: pass "
                f"cu_seq_lens_q / cu_seq_lens_k with the call to split the linear-attention layers too")
    if position_ids.dim() not in (1, 2):
        return f"position_ids has shape {tuple(position_ids.shape)}, not [batch, T]"
    if position_ids.dim() == 2 and position_ids.shape[0] not in (1, batch):
        return f"position_ids has {position_ids.shape[0]} rows for a batch of {batch}"
    return None


def _log_once(module: Any, reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logger.warning("%s called with position_ids that may pack several documents: its linear-attention "
                       "layers do not keep them apart (%s)", type(module).__name__, reason)


def with_document_offsets(module: Any, kwargs: dict) -> dict:
    """``kwargs`` of a call of ``module``, with ``cu_seq_lens_q`` / ``cu_seq_lens_k`` set to the offsets of the
    documents in ``position_ids`` when HF's masks split the call into documents and ``module`` is (or wraps) a
    model of a covered family; ``kwargs`` itself otherwise (offsets the caller gave are kept)."""
    position_ids = kwargs.get("position_ids")
    if not isinstance(position_ids, torch.Tensor) or any(kwargs.get(name) is not None for name in OFFSET_KEYWORDS):
        return kwargs
    model = _covered_model(module)  # its config says how HF runs the call
    if model is None:
        return kwargs
    if kwargs.get("attention_mask") is not None or _uses_cache(model, kwargs):
        return kwargs  # HF's masks do not split this call either: one sequence per row
    batch = _batch_size(position_ids, kwargs)
    reason = _why_not_split(model, position_ids, batch)
    if reason is not None:
        _log_once(model, reason)
        return kwargs
    offsets = document_offsets(position_ids.expand(batch, position_ids.shape[-1]))  # over the rows end to end
    return {**kwargs, **{name: offsets for name in OFFSET_KEYWORDS}}
