"""torch.library registration of the DSA ops (``torch.ops.kda_compile.dsa_*``).

``dsa_indexer_topk(q, k, weights, key_mask?, cu_seqlens?, topk, scale, is_causal) -> indices``
    int32 [B, S, topk], contiguous; no autograd (the selection is discrete).

``dsa_pooled_indexer_topk(q, k, gate, weights, key_valid?, ape, query_mask?, topk, scale, q_offset, select_tail)``
    int32 [B, S, topk (+ P - 1)], contiguous; glm5_next's pooled indexer (``pooled/reference.py``; CUDA: the fused
    pool-score kernels of ``pooled/triton_indexer.py``); no autograd.

``dsa_sparse_attention_fwd(q, k, v?, indices, scale, d_v) -> (o, lse)``
    o [B, S, Hq, d_v] contiguous in q's dtype, lse [B, S, Hq] float32 contiguous. ``v`` None is the
    absorbed MQA form (the value is ``k[..., :d_v]``).

``dsa_sparse_attention_bwd(grad_o, grad_lse?, q, k, v?, indices, o, lse, scale, d_v) -> (dq, dk, dv)``
    (o, lse: the forward's outputs, which the kernels reuse rather than recompute) contiguous, each in
    its input's shape and dtype; dv empty when v is None (its gradient is added into dk's first d_v
    columns). No double backward.

Values of ``indices``: checked on the CPU on every call (-1 or ``[0, T)``; ValueError naming the first entry outside),
on CUDA only with ``KDA_COMPILE_CHECK_INPUTS=1`` (``indices_checked``). No key (T = 0): o = 0, lse = -inf, zero
gradients, without a kernel; both indexers then return all -1.

The default kernels (any device; what runs on CPU) are the blockwise torch references; CUDA runs the
Triton kernels (``kernels.py`` chooses, and logs any fallback). ``*_impl`` are those per-device choices as plain
functions: the ops run them, and so do eager calls that need no dispatcher (``api.py``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kda_compile.ops._common import empty_like_absent, values_checked
from kda_compile.ops.dsa import kernels
from kda_compile.ops.dsa.pooled.reference import output_width, pooled_indexer_topk_reference
from kda_compile.ops.dsa.reference import (
    check_cu_seqlens_values,
    check_index_values,
    indexer_topk_reference,
    sparse_attention_backward_reference,
    sparse_attention_reference,
)


def _fresh(t: Tensor, inputs) -> Tensor:
    """``t``, cloned if it shares storage with any of ``inputs`` (op outputs may not alias inputs)."""
    ptr = t.untyped_storage().data_ptr()
    if any(x is not None and x.numel() and x.untyped_storage().data_ptr() == ptr for x in inputs):
        return t.clone()
    return t


# ----------------------------------------------------------------------------------------------
# Indexer + top-k
# ----------------------------------------------------------------------------------------------
def indexer_topk_impl(q, k, weights, key_mask, cu_seqlens, topk, scale, is_causal):
    """What the op runs on the inputs' device; eager calls that need no dispatcher call it directly (``api``)."""
    if k.shape[1] == 0:  # no key to select (T = 0): every slot is padding, on any device, without a kernel
        if cu_seqlens is not None and values_checked(cu_seqlens):
            check_cu_seqlens_values(cu_seqlens, 0)  # as the reference and the CUDA kernels check them
        return torch.full((q.shape[0], q.shape[1], topk), -1, dtype=torch.int32, device=q.device)
    if q.device.type == "cuda":
        return kernels.indexer_topk_cuda(q, k, weights, key_mask, cu_seqlens, topk, scale, is_causal)
    return indexer_topk_reference(q, k, weights, key_mask, cu_seqlens, topk, scale, is_causal)


@torch.library.custom_op("kda_compile::dsa_indexer_topk", mutates_args=())
def dsa_indexer_topk_op(q: Tensor, k: Tensor, weights: Tensor, key_mask: Optional[Tensor],
                        cu_seqlens: Optional[Tensor], topk: int, scale: float, is_causal: bool) -> Tensor:
    return indexer_topk_impl(q, k, weights, key_mask, cu_seqlens, topk, scale, is_causal)


@dsa_indexer_topk_op.register_fake
def _dsa_indexer_topk_fake(q, k, weights, key_mask, cu_seqlens, topk, scale, is_causal):
    b, s = q.shape[0], q.shape[1]
    return q.new_empty((b, s, topk), dtype=torch.int32)


# ----------------------------------------------------------------------------------------------
# Pooled indexer + top-k (glm5_next)
# ----------------------------------------------------------------------------------------------
def pooled_indexer_topk_impl(q, k, gate, weights, key_valid, ape, query_mask, topk, scale, q_offset, select_tail):
    """What the op runs on the inputs' device; eager calls that need no dispatcher call it directly (``api``)."""
    if k.shape[1] == 0:  # no key to select (T = 0): every slot is padding, on any device, without a kernel
        width = output_width(topk, ape.shape[0], select_tail)
        return torch.full((q.shape[0], q.shape[1], width), -1, dtype=torch.int32, device=q.device)
    run = kernels.pooled_indexer_topk_cuda if q.device.type == "cuda" else pooled_indexer_topk_reference
    return run(q, k, gate, weights, key_valid, ape, query_mask, topk, scale, q_offset, select_tail)


@torch.library.custom_op("kda_compile::dsa_pooled_indexer_topk", mutates_args=())
def dsa_pooled_indexer_topk_op(q: Tensor, k: Tensor, gate: Tensor, weights: Tensor, key_valid: Optional[Tensor],
                               ape: Tensor, query_mask: Optional[Tensor], topk: int, scale: float, q_offset: int,
                               select_tail: bool) -> Tensor:
    return pooled_indexer_topk_impl(q, k, gate, weights, key_valid, ape, query_mask, topk, scale, q_offset,
                                    select_tail)


@dsa_pooled_indexer_topk_op.register_fake
def _dsa_pooled_indexer_topk_fake(q, k, gate, weights, key_valid, ape, query_mask, topk, scale, q_offset,
                                  select_tail):
    return q.new_empty((q.shape[0], q.shape[1], output_width(topk, ape.shape[0], select_tail)), dtype=torch.int32)


# ----------------------------------------------------------------------------------------------
# Sparse attention
# ----------------------------------------------------------------------------------------------
def indices_checked(indices: Tensor) -> bool:
    """Whether the values of ``indices`` are checked in this call (``ops._common.values_checked``). Unchecked
    indices outside ``[-1, T)`` are undefined behaviour on the CUDA kernels (a row past the keys is read)."""
    return values_checked(indices)


def _no_keys(q: Tensor, k: Tensor) -> bool:
    """T = 0: every valid index list is all -1, so every query has no key (o = 0, lse = -inf); served without a
    kernel (the gathers have no row to clamp -1 to)."""
    return k.shape[1] == 0


def sparse_attention_fwd_impl(q, k, v, indices, scale, d_v):
    """What the forward op runs on the inputs' device; eager calls that need neither autograd nor the dispatcher
    call it directly (``api``)."""
    if indices_checked(indices):
        check_index_values(indices, k.shape[1])
    if _no_keys(q, k):
        b, s, hq, _ = q.shape
        return q.new_zeros((b, s, hq, d_v)), q.new_full((b, s, hq), float("-inf"), dtype=torch.float32)
    if q.device.type == "cuda":
        return kernels.sparse_attention_fwd_cuda(q, k, v, indices, scale, d_v)
    o, lse = sparse_attention_reference(q, k, v, indices, scale, d_v)
    return o.to(q.dtype).contiguous(), lse.contiguous()


@torch.library.custom_op("kda_compile::dsa_sparse_attention_fwd", mutates_args=())
def dsa_sparse_attention_fwd(q: Tensor, k: Tensor, v: Optional[Tensor], indices: Tensor, scale: float,
                             d_v: int) -> tuple[Tensor, Tensor]:
    return sparse_attention_fwd_impl(q, k, v, indices, scale, d_v)


@dsa_sparse_attention_fwd.register_fake
def _dsa_sparse_attention_fwd_fake(q, k, v, indices, scale, d_v):
    b, s, hq, _ = q.shape
    return q.new_empty((b, s, hq, d_v)), q.new_empty((b, s, hq), dtype=torch.float32)


@torch.library.custom_op("kda_compile::dsa_sparse_attention_bwd", mutates_args=())
def dsa_sparse_attention_bwd(grad_o: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor,
                             v: Optional[Tensor], indices: Tensor, o: Tensor, lse: Tensor, scale: float,
                             d_v: int) -> tuple[Tensor, Tensor, Tensor]:
    if _no_keys(q, k):
        return _no_key_grads(q, k, v)
    dq, dk, dv = sparse_attention_backward_reference(grad_o, grad_lse, q, k, v, indices, scale, d_v)
    return _pack_grads(q, k, v, dq, dk, dv, (grad_o, grad_lse, q, k, v, indices))


@dsa_sparse_attention_bwd.register_kernel("cuda")
def _dsa_sparse_attention_bwd_cuda(grad_o, grad_lse, q, k, v, indices, o, lse, scale, d_v):
    if _no_keys(q, k):
        return _no_key_grads(q, k, v)
    dq, dk, dv = kernels.sparse_attention_bwd_cuda(grad_o, grad_lse, q, k, v, indices, o, lse, scale, d_v)
    return _pack_grads(q, k, v, dq, dk, dv, (grad_o, grad_lse, q, k, v, indices))


def _no_key_grads(q, k, v):
    """Zero gradients of a call without keys (its outputs depend on no input)."""
    zeros = lambda t: torch.zeros(t.shape, dtype=t.dtype, device=t.device)  # noqa: E731  (contiguous)
    return zeros(q), zeros(k), (empty_like_absent(q) if v is None else zeros(v))


def _pack_grads(q, k, v, dq, dk, dv, inputs):
    dq = _fresh(dq.to(q.dtype).contiguous(), inputs)
    dk = _fresh(dk.to(k.dtype).contiguous(), inputs)
    dv = empty_like_absent(q) if v is None else _fresh(dv.to(v.dtype).contiguous(), inputs)
    return dq, dk, dv


@dsa_sparse_attention_bwd.register_fake
def _dsa_sparse_attention_bwd_fake(grad_o, grad_lse, q, k, v, indices, o, lse, scale, d_v):
    dv = empty_like_absent(q) if v is None else v.new_empty(v.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), dv


def _setup_context(ctx, inputs, output):
    q, k, v, indices, scale, d_v = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, indices, o, lse)
    ctx.params = (scale, d_v)


def _backward(ctx, grad_o, grad_lse):
    q, k, v, indices, o, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.kda_compile.dsa_sparse_attention_bwd(grad_o, grad_lse, q, k, v, indices, o, lse,
                                                                *ctx.params)
    return dq, dk, (dv if v is not None else None), None, None, None


dsa_sparse_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
