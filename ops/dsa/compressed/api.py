"""``compressed_sparse_attention``: DeepSeek-V4's attention over a sliding window, compressed entries and sinks.

Each query's keys are listed as indices into one key tensor (the window keys, then the compressed entries), and
``dsa_sparse_attention`` (absorbed form: keys are the values) attends over exactly those; the sink enters through
the log-sum-exp. Memory is O(S x (W + K)) for the index lists (K: the selected entries, or every compressed entry
for HCA) instead of Hugging Face's [S, Tw + Tc] mask, and no score outside the lists is computed. The rules:
docs/dsa.md, section 6; the dense equivalent: ``reference.py``.
"""
from __future__ import annotations

import numbers

import torch

from kda_compile.ops._argument_errors import deferred_error, sizes
from kda_compile.ops._common import arg_error, check_tensor, describe, plain, positive_scale, shown
from kda_compile.ops.dsa.api import dsa_sparse_attention
from kda_compile.ops.dsa.compressed.custom_ops import compressed_selected_keys

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


def compressed_sparse_attention(
    query: torch.Tensor,
    window_kv: torch.Tensor,
    compressed_kv: torch.Tensor,
    sinks: torch.Tensor,
    *,
    scale: float,
    sliding_window: int,
    selected: torch.Tensor | None = None,
    compress_rate: int | None = None,
    query_positions: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of each query over its window keys, its compressed entries and its head's sink.

    DeepSeek-V4's three layer kinds: sliding only (``compressed_kv`` with Tc = 0), compressed sparse attention
    (CSA: ``selected``, the indexer's top-k compressed entries per query) and heavily compressed attention (HCA:
    ``compress_rate`` and ``query_positions``, every entry whose window closed before the query). With neither
    ``selected`` nor ``compress_rate`` every query sees every compressed entry (what Hugging Face's HCA layer
    does in a decode step, where every entry it holds has closed). One key head
    serves every query head, and the keys are the values (Hugging Face passes ``kv`` as both).

    Args:
        query: [B, H, S, D] (Hugging Face's layout; any strides), float16, bfloat16, float32 or float64.
        window_kv: [B, 1, Tw, D], the sliding layer's keys (= values) in time order, ending with the queries' own
            tokens: query i sits at slot ``Tw - S + i`` (Tw >= S) and sees window keys ``j`` with
            ``slot - sliding_window < j <= slot``.
        compressed_kv: [B, 1, Tc, D], the compressed entries (Tc >= 0), query's dtype and device.
        sinks: [H], one logit per head added to every query's softmax (its share of the weight is dropped).
        scale: multiplies the scores (Hugging Face's ``module.scaling``), a finite float > 0.
        sliding_window: W >= 1, the keys a query sees in the window, itself included.
        selected: CSA only: int32 / int64 [B, S, K], the compressed entries query i sees, each -1 (none) or in
            [0, Tc), unique within a row. Values are checked when the call runs, compiled or not, on the CPU
            always and on CUDA with ``KDA_COMPILE_CHECK_INPUTS=1`` (``custom_ops.py``).
        compress_rate: HCA only, with ``query_positions``: a query at position p sees the entries
            ``w < (p + 1) // compress_rate`` (windows closed at or before it).
        query_positions: HCA only: int [B, S], the queries' positions (Hugging Face's ``position_ids``).
        key_padding_mask: bool [B, Tw] or None: False marks a window key no query may see (left padding).

    A query that sees nothing gives 0 (its weight is all the sink's). Differentiable w.r.t. query, the keys and
    the sinks. Bad arguments raise ``ValueError`` / ``TypeError`` naming the argument, its value and what is
    accepted, eagerly and, unchanged, from a ``torch.compile(fullgraph=True)`` function when it runs
    (docs/op-input-errors.md).

    Returns:
        [B, H, S, D] in the query's dtype, stored as [B, S, H, D] (``.transpose(1, 2)`` is free).
    """
    try:
        b, h, s, d = _check(query, window_kv, compressed_kv, sinks, scale, sliding_window, selected, compress_rate,
                            query_positions, key_padding_mask)
    except (ValueError, TypeError) as error:
        return _deferred(error, query)
    tw = window_kv.shape[2]
    parts = [_window_indices(b, s, tw, sliding_window, key_padding_mask, query.device)]
    tc = compressed_kv.shape[2]
    if selected is not None:
        parts.append(compressed_selected_keys(selected, tw, tc))
    elif compress_rate is not None:
        parts.append(_closed_entries(tc, tw, compress_rate, query_positions))
    elif tc:  # every entry, e.g. an HCA decode step, whose entries have all closed
        parts.append(torch.arange(tw, tw + tc, device=query.device, dtype=torch.int32).expand(b, s, tc))
    indices = torch.cat(parts, dim=-1).contiguous()
    keys = torch.cat([window_kv, compressed_kv], dim=2).transpose(1, 2)  # [B, T, 1, D]
    out, lse = dsa_sparse_attention(query.transpose(1, 2), keys, None, indices, float(scale), d_v=d)
    wide = torch.promote_types(query.dtype, torch.float32)
    share = torch.sigmoid(lse.to(wide) - sinks.to(wide).view(1, 1, h))  # the keys' weight; the sink's is dropped
    return (out.to(wide) * share[..., None]).to(query.dtype).transpose(1, 2)


def _deferred(error, query):
    """The output of a call with a bad argument: ``error`` raised now (eager) or when the compiled function runs
    (``ops._argument_errors``), with a placeholder of the output's shape and layout where the query says it."""
    shape = sizes(query, 4)
    if shape is None:
        return deferred_error(error, query)[0]
    b, h, s, d = shape
    return deferred_error(error, query, (b, s, h, d))[0].transpose(1, 2)


def _window_indices(b: int, s: int, tw: int, window: int, key_padding_mask, device) -> torch.Tensor:
    """int32 [B, S, min(W, Tw)]: the window keys of each query in ascending order, -1 where there is none."""
    width = min(window, tw)
    slots = torch.arange(tw - s, tw, device=device, dtype=torch.int32)[:, None]  # [S, 1]
    keys = slots - torch.arange(width - 1, -1, -1, device=device, dtype=torch.int32)[None, :]  # [S, width]
    keys = torch.where(keys >= 0, keys, -1).expand(b, s, width)
    if key_padding_mask is None:
        return keys
    real = key_padding_mask.to(torch.bool).gather(1, keys.clamp_min(0).reshape(b, s * width).long())
    return torch.where(real.view(b, s, width), keys, -1)


def _closed_entries(tc: int, tw: int, rate: int, query_positions: torch.Tensor) -> torch.Tensor:
    """int32 [B, S, Tc]: HCA's entries closed at each query's position, offset past the window keys."""
    entries = torch.arange(tc, device=query_positions.device, dtype=torch.int64)
    closed = (query_positions.to(torch.int64) + 1) // rate
    return torch.where(entries[None, None, :] < closed[..., None], entries + tw, -1).to(torch.int32)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise arg_error(name, shown(value), "an int >= 1", kind=TypeError)
    if value < 1:
        raise arg_error(name, shown(value), "an int >= 1")
    return value


def _check(query, window_kv, compressed_kv, sinks, scale, sliding_window, selected, compress_rate, query_positions,
           key_padding_mask) -> tuple[int, int, int, int]:
    check_tensor("query", query, ndim=4, dtypes=_DTYPES)
    b, h, s, d = query.shape
    for name, t in (("window_kv", window_kv), ("compressed_kv", compressed_kv)):
        check_tensor(name, t, ndim=4, dtypes=_DTYPES)
        if t.dtype != query.dtype:
            raise arg_error(name, describe(t), f"of query's dtype {query.dtype}", kind=TypeError)
        if t.device != query.device:
            raise arg_error(name, describe(t), f"on query's device {query.device}")
        if t.shape[0] != b or t.shape[1] != 1 or t.shape[3] != d:
            raise arg_error(name, describe(t), f"[B, 1, T, D] with B = {b}, D = {d} (query's) and one key head")
    if window_kv.shape[2] < s:
        raise arg_error("window_kv", describe(window_kv),
                        f"[B, 1, Tw, D] with Tw >= S = {s}: the window keys end with the queries' own tokens")
    check_tensor("sinks", sinks, ndim=1, dtypes=_DTYPES)
    if sinks.shape[0] != h or sinks.device != query.device:
        raise arg_error("sinks", describe(sinks), f"[H] = [{h}] on query's device {query.device}")
    positive_scale(scale)
    _positive_int("sliding_window", sliding_window)
    if selected is not None and compress_rate is not None:
        raise arg_error("selected", describe(selected), "None when compress_rate is given (CSA selects, HCA "
                        "attends to every closed entry)")
    if (compress_rate is None) != (query_positions is None):
        raise arg_error("query_positions", describe(query_positions) if query_positions is not None else None,
                        "given exactly when compress_rate is (HCA)", kind=TypeError)
    tc = compressed_kv.shape[2]
    if selected is not None:
        _check_selected(selected, b, s, tc, query.device)
    if compress_rate is not None:
        _positive_int("compress_rate", compress_rate)
        check_tensor("query_positions", query_positions, ndim=2, dtypes=_INDEX_DTYPES)
        if tuple(query_positions.shape) != (b, s) or query_positions.device != query.device:
            raise arg_error("query_positions", describe(query_positions), f"[B, S] = {plain((b, s))} on query's "
                            f"device {query.device}")
    if key_padding_mask is not None:
        check_tensor("key_padding_mask", key_padding_mask, ndim=2, dtypes=(torch.bool,))
        tw = window_kv.shape[2]
        if tuple(key_padding_mask.shape) != (b, tw) or key_padding_mask.device != query.device:
            raise arg_error("key_padding_mask", describe(key_padding_mask),
                            f"[B, Tw] = {plain((b, tw))} on query's device {query.device}")
    return b, h, s, d


def _check_selected(selected, b: int, s: int, tc: int, device) -> None:
    """Its type and shape here; its values in ``compressed_selected_keys``, when the call runs."""
    check_tensor("selected", selected, ndim=3, dtypes=_INDEX_DTYPES)
    if tuple(selected.shape[:2]) != (b, s) or selected.device != device:
        raise arg_error("selected", describe(selected), f"[B, S, K] with [B, S] = {plain((b, s))} on query's "
                        f"device {device}")
