"""Public entry point ``block_sparse_attention``: argument checks, then one custom-op call (Dynamo traces it without
a graph break; ``register_autograd`` on the op supplies its backward)."""
from __future__ import annotations

import torch

from kda_compile.ops._argument_errors import deferred_error, sizes
from kda_compile.ops._common import arg_error, check_tensor, describe, finite_float, shown
from kda_compile.ops.block_sparse import custom_ops  # noqa: F401  (registers torch.ops.kda_compile.block_sparse_*)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


def block_sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_indices: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    query_positions: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of each query over the key blocks its KV group selected (MiniMax-M3's sparse layers).

    Block ``n`` covers the key slots ``[n * block_size, (n + 1) * block_size)`` (the last one cut at T). Query
    ``i`` of head ``h`` (group ``g = h // (H / G)``) sees key slot ``j`` when ``j`` lies in a block of
    ``block_indices[b, g, i]``, ``j <= query_positions[b, i]`` and ``key_padding_mask[b, j]``; then
    ``out = softmax(scale * q . k_visible) @ v_visible``. This is what Hugging Face's MiniMax-M3 computes from
    ``MiniMaxM3VLIndexer.build_block_mask`` and dense attention, without the [B, H, Sq, T] mask
    (math: ``ops/block_sparse/reference.py``; kernel: docs/block-sparse.md).

    Args:
        query: [B, H, Sq, D] (HF's layout after RoPE); float16, bfloat16, float32 or float64 (float64 runs the
            reference, on CUDA too: logged).
        key: [B, G, T, D] with ``H % G == 0`` (after the cache update), query's dtype and device.
        value: [B, G, T, Dv], the same.
        block_indices: int32 / int64 [B, G, Sq, K], K >= 1: the selected blocks of each (group, query), HF's
            indexer output; -1 is an empty slot, anywhere in the row. A block named twice counts once (as in HF's
            mask), in any order. Every entry must be -1 or in ``[0, ceil(T / block_size))``: anything else is a
            ValueError naming ``block_indices``, its first such entry and the range, checked on every call on
            the CPU and, on CUDA, only with ``KDA_COMPILE_CHECK_INPUTS=1`` (the check synchronises the device);
            an unchecked entry outside the range is read as an empty slot.
        block_size: key slots per block, an int >= 1 (MiniMax-M3: 128). The CUDA kernel takes multiples of 16;
            any other size runs the reference (logged by ``record_fallback``, shown by ``kda_compile.report()``).
        scale: multiplies the scores; default ``D ** -0.5``.
        query_positions: None or int32 / int64 [B, Sq]: query i's position, the last key slot it may see (HF's
            ``position_ids`` over the cache's slots). Default ``T - Sq + i`` (bottom-right aligned: a chunk or a
            decode step after ``T - Sq`` cached keys). A negative position sees nothing. Values are not checked.
        key_padding_mask: None or bool [B, T]; False = a padded key slot, never visible.

    Returns:
        out [B, H, Sq, Dv] in query's dtype. A row with no visible key (all its slots empty, or every key of its
        blocks in its future or padded; T = 0 too) gives 0, never NaN (internally its log-sum-exp is -inf).
        Differentiable w.r.t. query, key and value: on CUDA a Triton backward (dk / dv summed by atomics, so
        not bitwise reproducible run to run) wherever the forward kernel runs, else autograd through the reference.

    Bad arguments raise ValueError / TypeError naming the argument, its value and what is accepted, eagerly and,
    unchanged, from a ``torch.compile(fullgraph=True)`` function when it runs (docs/op-input-errors.md).
    """
    try:
        scale = _check_arguments(query, key, value, block_indices, block_size, scale, query_positions,
                                 key_padding_mask)
    except (ValueError, TypeError) as error:
        return _deferred_out(error, query, value)
    out, _ = torch.ops.kda_compile.block_sparse_attention_fwd(query, key, value, block_indices, query_positions,
                                                              key_padding_mask, block_size, scale)
    return out


def _deferred_out(error, query, value):
    """The output placeholder of a call with a bad argument (``ops._argument_errors``), of the call's shape where
    the arguments say it, so that Dynamo traces the caller's code after the call."""
    shape, width = sizes(query, 4), sizes(value, 4)
    if shape is None or width is None:
        return deferred_error(error, query)[0]
    return deferred_error(error, query, (*shape[:3], width[3]))[0]


def _check_arguments(query, key, value, block_indices, block_size, scale, query_positions, key_padding_mask):
    """Shapes, dtypes, devices and Python values (no tensor value): the scale as a float, its default resolved."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t, ndim=4, dtypes=_DTYPES)
    check_tensor("block_indices", block_indices, ndim=4, dtypes=_INDEX_DTYPES)
    batch, heads, queries, dim = query.shape
    groups, keys = key.shape[1], key.shape[2]
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise arg_error(name, describe(t), f"of query's dtype {query.dtype}", kind=TypeError)
    for name, t in (("key", key), ("value", value), ("block_indices", block_indices),
                    ("query_positions", query_positions), ("key_padding_mask", key_padding_mask)):
        if t is not None and isinstance(t, torch.Tensor) and t.device != query.device:
            raise arg_error(name, describe(t), f"on query's device {query.device}")
    if heads == 0 or dim == 0:
        raise arg_error("query", describe(query), "a tensor with H >= 1 heads of width D >= 1")
    if key.shape[0] != batch or key.shape[3] != dim or groups == 0 or heads % groups != 0:
        raise arg_error("key", describe(key), f"[B, G, T, D] with B = {batch}, D = {dim} and G >= 1 dividing "
                                              f"H = {heads} (query's)")
    if value.shape[0] != batch or value.shape[1] != groups or value.shape[2] != keys or value.shape[3] == 0:
        raise arg_error("value", describe(value), f"[B, G, T, Dv] with [B, G, T] = [{batch}, {groups}, {keys}] "
                                                  "(key's) and Dv >= 1")
    if (block_indices.shape[0] != batch or block_indices.shape[1] != groups or block_indices.shape[2] != queries
            or block_indices.shape[3] == 0):
        raise arg_error("block_indices", describe(block_indices),
                        f"[B, G, Sq, K] with [B, G, Sq] = [{batch}, {groups}, {queries}] and K >= 1")
    if isinstance(block_size, bool) or not isinstance(block_size, (int, torch.SymInt)):
        raise arg_error("block_size", shown(block_size), "an int >= 1", kind=TypeError)
    if block_size < 1:
        raise arg_error("block_size", block_size, "an int >= 1")
    if query_positions is not None:
        check_tensor("query_positions", query_positions, ndim=2, dtypes=_INDEX_DTYPES)
        if query_positions.shape[0] != batch or query_positions.shape[1] != queries:
            raise arg_error("query_positions", describe(query_positions), f"[B, Sq] = [{batch}, {queries}]")
    if key_padding_mask is not None:
        check_tensor("key_padding_mask", key_padding_mask, ndim=2, dtypes=(torch.bool,))
        if key_padding_mask.shape[0] != batch or key_padding_mask.shape[1] != keys:
            raise arg_error("key_padding_mask", describe(key_padding_mask), f"bool [B, T] = [{batch}, {keys}]")
    return dim ** -0.5 if scale is None else finite_float("scale", scale, "None or a finite float")
