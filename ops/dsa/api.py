"""Public entry points of DeepSeek Sparse Attention: ``dsa_indexer_topk``, ``dsa_pooled_indexer_topk``
(glm5_next's pooled indexer) and ``dsa_sparse_attention``.

Plain Python (argument checks, then one custom-op call each), so Dynamo traces them without a graph
break; ``register_autograd`` on the attention op supplies its backward. Eager calls that need neither autograd
nor the dispatcher (``_common.dispatcher_needed``: no tracing, dispatch mode, functorch transform or tensor
subclass) call the op's implementation directly (``custom_ops.*_impl``, the same code the op runs), as KDA's and
GDN's do: the custom-op dispatcher's Python path costs about the GPU time of a whole decode layer in a CUDA graph
in host time per call (docs/dsa.md, section 4, "Tuning measurements", "host time").
"""
from __future__ import annotations

import torch

from kda_compile.ops._argument_errors import deferred_error, sizes
from kda_compile.ops._common import (arg_error, check_tensor, describe, dispatcher_needed, finite_float,
                                     gradients_needed, shown)
from kda_compile.ops.dsa import custom_ops  # registers torch.ops.kda_compile.dsa_*
from kda_compile.ops.dsa.pooled.reference import output_width

_ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEXER_DTYPES = _ATTENTION_DTYPES  # float64 runs the reference (on CUDA too, logged)
_POOLED_DTYPES = _ATTENTION_DTYPES


def dsa_indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    *,
    scale: float = 1.0,
    is_causal: bool = True,
    key_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepSeek-V3.2's lightning indexer and its top-k selection, without the [S, H_I, T] scores.

    ``score[b, i, s] = sum_h weights[b, i, h] * relu(scale * (q[b, i, h] . k[b, s]))`` in float32; each
    query keeps the ``topk`` best visible keys (docs/dsa.md).

    Args:
        q: [B, S, H_I, D] indexer queries, RoPE already applied; float16, bfloat16, float32 or float64
            (float64 runs the blockwise reference, on CUDA too: logged).
        k: [B, T, D] indexer keys (one head shared by all query heads); one of the same dtypes.
        weights: [B, S, H_I] per-head weights, any softmax / head scale already folded in; floating.
        topk: how many keys each query keeps, >= 1; may exceed the number of visible keys.
        scale: multiplies the dot product inside the ReLU.
        is_causal: query i sees keys ``s <= i + (T - S)`` (bottom-right aligned, as with a KV cache).
        key_mask: None or bool [B, T], True = the key may be selected (padding).
        cu_seqlens: None or int32 / int64 [N + 1] offsets of packed sequences (B == 1, S == T): a query
            sees only the keys of its own sequence (causal within it when ``is_causal``).

    Returns:
        int32 [B, S, topk] key indices into T: the ``topk`` best visible keys (equal scores: the lower key
        index wins, so the set is deterministic) in ascending key order, then -1 padding for rows with fewer
        than ``topk`` visible keys (T = 0: all -1). No gradient.

    Bad arguments raise ``ValueError`` / ``TypeError`` naming the argument, its value and what is accepted,
    eagerly and, unchanged, from a ``torch.compile(fullgraph=True)`` function when it runs
    (docs/op-input-errors.md; the same for the other DSA functions).
    """
    try:
        scale = _check_indexer(q, k, weights, topk, scale, is_causal, key_mask, cu_seqlens)
    except (ValueError, TypeError) as error:
        return _deferred_indices(error, q, topk)
    if _direct(q, k, weights, key_mask, cu_seqlens):
        return custom_ops.indexer_topk_impl(q, k, weights, key_mask, cu_seqlens, topk, scale, is_causal)
    return torch.ops.kda_compile.dsa_indexer_topk(q, k, weights, key_mask, cu_seqlens, topk, scale, is_causal)


def dsa_pooled_indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    topk: int,
    *,
    scale: float,
    key_valid: torch.Tensor | None = None,
    query_mask: torch.Tensor | None = None,
    q_offset: int | None = None,
    select_tail: bool = True,
) -> torch.Tensor:
    """glm5_next's pooled DSA indexer (HF's ``Glm5NextTextIndexer``) without its [B, S, T] tensors.

    Keys are grouped into pools of ``P = ape.shape[0]`` tokens from each row's first valid key; a pool's key
    is the softmax(``gate + ape``)-weighted sum of its tokens' keys. Each query scores the complete valid
    pools whose last token it sees, ``sum_h weights[h] * relu(scale * q[h] . pool_key)`` in float32, keeps
    the best ``topk // P`` pools (at most the number of pools some row has, as HF), expands them to their
    tokens and, with ``select_tail``, appends the visible tokens past the last complete pool. Math and
    layout: ``ops/dsa/pooled/reference.py``.

    Args:
        q: [B, S, H_I, D] indexer queries (HF's ``wq_b(q_resid)``); float16, bfloat16, float32 or float64.
        k: [B, T, D] indexer keys (HF's cached ``k_norm(wk(x))``); q's dtype.
        weights: [B, S, H_I] head weights, ``n_heads ** -0.5`` already folded in; floating.
        gate: [B, T, D] pool gate scores (HF's cached ``index_kpool_compress_gate`` projection); floating.
        ape: [P, D] the per-position gate bias ``index_kpool_compress_ape``, P >= 1; floating.
        topk: HF's ``index_topk`` (tokens), >= 1; ``topk // P`` pools are selected.
        scale: multiplies the dot product inside the ReLU (HF: ``head_dim ** -0.5``).
        key_valid: None (all valid), a bool [B, T] mask, or floating [B, T] flags whose nonzero entries (NaN
            included, as ``Tensor.bool`` reads them) mark the valid keys: HF's cached padding channel as it lies
            in the cache, the last element of each ``cat([k, gate, valid])`` row, which the CUDA path then reads
            in the rows it copies instead of making the mask in a separate pass.
        query_mask: None or bool [B, S]; False rows (padded queries) come back all -1.
        q_offset: position of query 0 (query i sees keys ``s <= q_offset + i``); default ``T - S`` (HF:
            ``current_length - S``; a static cache passes its filled length).
        select_tail: append the visible tail (``index_kpool_always_select_tail``).

    Returns:
        int32 [B, S, topk + (P - 1 if select_tail else 0)], HF's layout: the selected pools' tokens (pools by
        score descending, equal scores by the lower pool index: deterministic), then the tail, -1 elsewhere.
        Only visible keys are named. No gradient.
    """
    try:
        scale, q_offset = _check_pooled(q, k, weights, gate, ape, topk, scale, key_valid, query_mask, q_offset,
                                        select_tail)
    except (ValueError, TypeError) as error:
        known = sizes(ape, 2) is not None and _width(topk) is not None and isinstance(select_tail, bool)
        return _deferred_indices(error, q, output_width(topk, ape.shape[0], select_tail) if known else None)
    if _direct(q, k, gate, weights, key_valid, ape, query_mask):
        return custom_ops.pooled_indexer_topk_impl(q, k, gate, weights, key_valid, ape, query_mask, topk, scale,
                                                   q_offset, select_tail)
    return torch.ops.kda_compile.dsa_pooled_indexer_topk(q, k, gate, weights, key_valid, ape, query_mask, topk,
                                                         scale, q_offset, select_tail)


def dsa_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    indices: torch.Tensor,
    scale: float | None = None,
    *,
    d_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each query over its own selected keys (DSA's sparse MLA, any head layout).

    ``s[b, i, h, j] = scale * q[b, i, h] . k[b, indices[b, i, j], h // G]`` (G = Hq / Hkv),
    ``o[b, i, h] = softmax_j(s) @ v[b, indices[b, i, j], h // G]`` over the valid (>= 0) indices.

    Args:
        q: [B, S, Hq, Dqk]; float16, bfloat16, float32 or float64.
        k: [B, T, Hkv, Dqk] with Hq % Hkv == 0, q's dtype. The absorbed MQA form of MLA: Hkv == 1 and
            Dqk = latent + rope (576 in DeepSeek-V3.2).
        v: [B, T, Hkv, Dv], or None for the absorbed form, where the value is ``k[..., :d_v]`` (the
            latent part of the same rows, read once for both products).
        indices: int32 [B, S, topk] key indices into T (from ``dsa_indexer_topk``), shared by all heads;
            -1 = no key. Valid indices of one row are assumed unique. Every entry must be -1 or in [0, T):
            anything else is a ValueError naming the first such entry, checked on every call on the CPU and,
            on CUDA, with ``KDA_COMPILE_CHECK_INPUTS=1`` only (reading them costs a device synchronisation);
            unchecked entries outside [-1, T) are undefined behaviour on CUDA (the kernels read past k).
        scale: multiplies the scores; default ``Dqk ** -0.5``.
        d_v: the value width; required when ``v`` is None (1 <= d_v <= Dqk), else v's last dim.

    Returns:
        (o, lse): o [B, S, Hq, Dv] in q's dtype; lse [B, S, Hq] float32, the natural-log log-sum-exp of
        the scaled scores over the selected keys. A query without a valid index gives o = 0 and
        lse = -inf (so does every query when T = 0). Differentiable w.r.t. q, k and v (and through lse); not
        w.r.t. indices.
    """
    try:
        scale, d_v = _check_sparse(q, k, v, indices, scale, d_v)
    except (ValueError, TypeError) as error:
        return _deferred_attention(error, q, v, d_v)
    if not gradients_needed(q, k, v) and _direct(q, k, v, indices):
        return custom_ops.sparse_attention_fwd_impl(q, k, v, indices, scale, d_v)
    return torch.ops.kda_compile.dsa_sparse_attention_fwd(q, k, v, indices, scale, d_v)


def _width(value):
    """``value`` when it can be a placeholder's last dim (an int >= 0), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)) or value < 0:
        return None
    return value


def _deferred_indices(error, q, width):
    """The int32 ``[B, S, width]`` indices of a call with a bad argument: ``error`` raised now (eager) or when
    the compiled function runs (``ops._argument_errors``), with a placeholder of that shape where the arguments
    say it, so that Dynamo traces the caller's code after the call."""
    shape, width = sizes(q, 4), _width(width)
    if shape is None or width is None:
        return deferred_error(error, q)[0].to(torch.int32)
    return deferred_error(error, q, (shape[0], shape[1], width))[0].to(torch.int32)


def _deferred_attention(error, q, v, d_v):
    """``(o, lse)`` of a sparse attention call with a bad argument, as :func:`_deferred_indices`."""
    shape = sizes(q, 4)
    width = _width(v.shape[-1] if isinstance(v, torch.Tensor) else d_v)
    if shape is None or width is None:
        return deferred_error(error, q)
    b, s_len, hq, _ = shape
    return deferred_error(error, q, (b, s_len, hq, width), (b, s_len, hq))


def _check_indexer(q, k, weights, topk, scale, is_causal, key_mask, cu_seqlens):
    """``dsa_indexer_topk``'s arguments (shapes, dtypes, devices, Python values; no tensor value): ``scale`` as a
    float."""
    check_tensor("q", q, ndim=4, dtypes=_INDEXER_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=_INDEXER_DTYPES)
    check_tensor("weights", weights, ndim=3)
    if not weights.is_floating_point():
        raise arg_error("weights", describe(weights), "a floating-point tensor", kind=TypeError)
    b, s_len, heads, dim = q.shape
    t_len = k.shape[1]
    for name, t in (("k", k), ("weights", weights)):
        if t.device != q.device:
            raise arg_error(name, describe(t), f"on q's device {q.device}")
    if k.shape[0] != b or k.shape[2] != dim:
        raise arg_error("k", describe(k), f"[B, T, D] with B = {b} and D = {dim} (q's)")
    if weights.shape[0] != b or weights.shape[1] != s_len or weights.shape[2] != heads:
        raise arg_error("weights", describe(weights), f"[B, S, H_I] = [{b}, {s_len}, {heads}] (q's)")
    if heads == 0 or dim == 0:
        raise arg_error("q", describe(q), "a tensor with H_I >= 1 heads of width D >= 1")
    checked_scale = _check_topk_and_scale(topk, scale)
    _check_bool("is_causal", is_causal)
    if key_mask is not None:
        check_tensor("key_mask", key_mask, ndim=2, dtypes=(torch.bool,))
        if key_mask.shape[0] != b or key_mask.shape[1] != t_len or key_mask.device != q.device:
            raise arg_error("key_mask", describe(key_mask), f"bool [B, T] = [{b}, {t_len}] on {q.device}")
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32, torch.int64))
        if cu_seqlens.shape[0] < 2 or cu_seqlens.device != q.device:
            raise arg_error("cu_seqlens", describe(cu_seqlens), f"[N + 1] offsets (N >= 1) on {q.device}")
        if b != 1 or s_len != t_len:
            raise arg_error("cu_seqlens", describe(cu_seqlens),
                            f"used only with packed inputs (B == 1 and S == T), but B = {b}, S = {s_len}, "
                            f"T = {t_len}")
    return checked_scale


def _check_pooled(q, k, weights, gate, ape, topk, scale, key_valid, query_mask, q_offset, select_tail):
    """``dsa_pooled_indexer_topk``'s arguments (shapes, dtypes, devices, Python values; no tensor value):
    ``(scale, q_offset)`` with their defaults resolved."""
    check_tensor("q", q, ndim=4, dtypes=_POOLED_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=_POOLED_DTYPES)
    for name, t, ndim in (("weights", weights, 3), ("gate", gate, 3), ("ape", ape, 2)):
        check_tensor(name, t, ndim=ndim)
        if not t.is_floating_point():
            raise arg_error(name, describe(t), "a floating-point tensor", kind=TypeError)
    b, s_len, heads, dim = q.shape
    t_len = k.shape[1]
    for name, t in (("k", k), ("weights", weights), ("gate", gate), ("ape", ape), ("key_valid", key_valid),
                    ("query_mask", query_mask)):
        if t is not None and t.device != q.device:
            raise arg_error(name, describe(t), f"on q's device {q.device}")
    if k.dtype != q.dtype:
        raise arg_error("k", describe(k), f"of q's dtype {q.dtype}", kind=TypeError)
    if heads == 0 or dim == 0:
        raise arg_error("q", describe(q), "a tensor with H_I >= 1 heads of width D >= 1")
    if k.shape[0] != b or k.shape[2] != dim:
        raise arg_error("k", describe(k), f"[B, T, D] with B = {b} and D = {dim} (q's)")
    if weights.shape[0] != b or weights.shape[1] != s_len or weights.shape[2] != heads:
        raise arg_error("weights", describe(weights), f"[B, S, H_I] = [{b}, {s_len}, {heads}] (q's)")
    if gate.shape[0] != b or gate.shape[1] != t_len or gate.shape[2] != dim:
        raise arg_error("gate", describe(gate), f"[B, T, D] = [{b}, {t_len}, {dim}] (k's)")
    if ape.shape[0] < 1 or ape.shape[1] != dim:
        raise arg_error("ape", describe(ape), f"[P, D] with P >= 1 and D = {dim} (q's)")
    checked_scale = _check_topk_and_scale(topk, scale)
    _check_bool("select_tail", select_tail)
    if key_valid is not None:
        check_tensor("key_valid", key_valid, ndim=2)
        if not (key_valid.dtype == torch.bool or key_valid.is_floating_point()):
            raise arg_error("key_valid", describe(key_valid), "None, a bool mask or floating flags", kind=TypeError)
        if key_valid.shape[0] != b or key_valid.shape[1] != t_len:
            raise arg_error("key_valid", describe(key_valid), f"None or [B, T] = [{b}, {t_len}]")
    if query_mask is not None:
        check_tensor("query_mask", query_mask, ndim=2, dtypes=(torch.bool,))
        if query_mask.shape[0] != b or query_mask.shape[1] != s_len:
            raise arg_error("query_mask", describe(query_mask), f"None or bool [B, S] = [{b}, {s_len}]")
    q_offset = t_len - s_len if q_offset is None else _int("q_offset", q_offset)
    return checked_scale, q_offset


def _check_sparse(q, k, v, indices, scale, d_v):
    """``dsa_sparse_attention``'s arguments (shapes, dtypes, devices, Python values): ``(scale, d_v)`` with their
    defaults resolved. The VALUES of ``indices`` are checked by the op where that is free (``custom_ops``)."""
    check_tensor("q", q, ndim=4, dtypes=_ATTENTION_DTYPES)
    check_tensor("k", k, ndim=4, dtypes=_ATTENTION_DTYPES)
    check_tensor("v", v, ndim=4, dtypes=_ATTENTION_DTYPES, allow_none=True)
    check_tensor("indices", indices, ndim=3, dtypes=(torch.int32,))
    b, s_len, hq, dqk = q.shape
    t_len, hkv = k.shape[1], k.shape[2]
    for name, t in (("k", k), ("v", v), ("indices", indices)):
        if t is not None and t.device != q.device:
            raise arg_error(name, describe(t), f"on q's device {q.device}")
    for name, t in (("k", k), ("v", v)):
        if t is not None and t.dtype != q.dtype:
            raise arg_error(name, describe(t), f"of q's dtype {q.dtype}", kind=TypeError)
    if k.shape[0] != b or k.shape[3] != dqk or hkv == 0 or hq % hkv != 0:
        raise arg_error("k", describe(k), f"[B, T, Hkv, Dqk] with B = {b}, Dqk = {dqk} and Hkv dividing Hq = {hq}")
    if dqk == 0 or hq == 0:
        raise arg_error("q", describe(q), "a tensor with Hq >= 1 heads of width Dqk >= 1")
    if indices.shape[0] != b or indices.shape[1] != s_len or indices.shape[2] < 1:
        raise arg_error("indices", describe(indices), f"int32 [B, S, topk] = [{b}, {s_len}, topk >= 1]")
    if v is None:
        if d_v is None:
            raise arg_error("d_v", None, "an int when v is None (the absorbed form: v = k[..., :d_v])",
                            kind=TypeError)
        d_v = _int("d_v", d_v)
        if not 1 <= d_v <= dqk:
            raise arg_error("d_v", d_v, f"1 <= d_v <= Dqk = {dqk}")
    else:
        if v.shape[0] != b or v.shape[1] != t_len or v.shape[2] != hkv or v.shape[3] == 0:
            raise arg_error("v", describe(v), f"[B, T, Hkv, Dv] with [B, T, Hkv] = [{b}, {t_len}, {hkv}] (k's)")
        if d_v is not None and _int("d_v", d_v) != v.shape[3]:
            raise arg_error("d_v", d_v, f"None or v's last dim {v.shape[3]}")
        d_v = v.shape[3]
    return (dqk ** -0.5 if scale is None else finite_float("scale", scale, "None or a finite float")), d_v


def _direct(q: torch.Tensor, *tensors) -> bool:
    """Whether an eager call runs the op's implementation without the dispatcher (module docstring): plain CPU /
    CUDA tensors, nothing that needs the op itself (tracing, a dispatch mode, a transform, a subclass)."""
    return q.device.type in ("cpu", "cuda") and not dispatcher_needed(q, *tensors)


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise arg_error(name, shown(value), "a bool", kind=TypeError)


def _int(name: str, value):
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise arg_error(name, shown(value), "an int", kind=TypeError)
    return value


def _check_topk_and_scale(topk, scale) -> float:
    """An indexer's ``topk`` (an int >= 1) and ``scale`` (a finite float, returned as one)."""
    if isinstance(topk, bool) or not isinstance(topk, (int, torch.SymInt)):
        raise arg_error("topk", shown(topk), "an int >= 1", kind=TypeError)
    if topk < 1:
        raise arg_error("topk", topk, "an int >= 1")
    return finite_float("scale", scale, "a finite float")
