"""torch.library registration: ``torch.ops.kda_compile.attention_fwd`` and ``attention_bwd``.

``attention_fwd(query, key, value, attn_mask?, sinks?, scale, softcap, dropout_p, is_causal,
sliding_window, lse_grad) -> (out, lse, rng)``

- out [B, H, Sq, Dv] in the query dtype, stored as [B, Sq, H, Dv] (strides
  ``(Sq*H*Dv, Dv, H*Dv, 1)``): that is the layout flash / cuDNN / memory-efficient kernels write
  for Hugging Face's transposed q, and what the following ``transpose(1, 2).reshape`` wants, so no
  backend pays a copy. The fake returns exactly these strides.
- lse [B, H, Sq] float32, contiguous: log-sum-exp of the scores only (no sink), -inf for empty rows.
- rng: int64 tensor on the query's device, [2] (dropout seed) when dropout_p > 0 else [0]. On the
  device (not the CPU) so Inductor keeps CUDA graphs; kernels load the seed themselves (no sync).
- softcap 0.0 and sliding_window 0 mean "none". ``lse_grad`` says whether a gradient may flow back
  through ``lse`` (the caller returned it); only then does the backward take that (slower) path.

``attention_bwd(grad_out, grad_lse?, query, key, value, out, lse, rng, attn_mask?, sinks?, scale,
softcap, dropout_p, is_causal, sliding_window, mask_needs_grad) -> (dq, dk, dv, dmask, dsinks)``
with dq/dk/dv in the same BSHD-stored layout, dmask contiguous in the mask's shape and dtype and
dsinks [H] (each an empty tensor when not requested). No double backward.

Nothing to attend (B = 0, Sq = 0 or Sk = 0): out = 0 and lse = -inf (a softmax over zero keys is a fully masked
row), zero gradients, on every device without a kernel.

The default kernel (any device; what runs on CPU) is the reference; CUDA picks a fast kernel per
call (``kernels.py``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kda_compile.ops._common import empty_like_absent
from kda_compile.ops.attention.kernels import as_bshd, cuda_backward, cuda_forward
from kda_compile.ops.attention.reference import new_dropout_seed, reference_backward, reference_forward


def nothing_to_attend(query: Tensor, key: Tensor) -> bool:
    """No query row (B = 0 or Sq = 0) or no key (Sk = 0): the outputs are known without a kernel, and no kernel
    is asked to launch an empty grid or to reduce over zero keys."""
    return query.shape[0] == 0 or query.shape[2] == 0 or key.shape[2] == 0


def _empty_forward(query: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of a call with nothing to attend: a softmax over zero keys is read as every key masked
    out, so out = 0 (never NaN) and lse = -inf, as for a fully masked row (a sink, which joins only the
    denominator, changes neither; ``attention_with_lse`` then returns the sink's logit as lse)."""
    b, h, sq, _ = query.shape
    out = query.new_zeros((b, sq, h, value.shape[-1])).transpose(1, 2)
    return out, query.new_full((b, h, sq), float("-inf"), dtype=torch.float32)


@torch.library.custom_op("kda_compile::attention_fwd", mutates_args=())
def attention_fwd(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor],
                  sinks: Optional[Tensor], scale: float, softcap: float, dropout_p: float, is_causal: bool,
                  sliding_window: int, lse_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    rng = new_dropout_seed(dropout_p, query.device)
    if nothing_to_attend(query, key):
        return *_empty_forward(query, value), rng
    out, lse = reference_forward(query, key, value, attn_mask, sinks, scale, softcap, dropout_p, is_causal,
                                 sliding_window, rng)
    return as_bshd(out), lse, rng


@attention_fwd.register_kernel("cuda")
def _attention_fwd_cuda(query, key, value, attn_mask, sinks, scale, softcap, dropout_p, is_causal,
                        sliding_window, lse_grad):
    rng = new_dropout_seed(dropout_p, query.device)
    if nothing_to_attend(query, key):
        return *_empty_forward(query, value), rng
    out, lse = cuda_forward(query, key, value, attn_mask, sinks, scale, softcap, dropout_p, is_causal,
                            sliding_window, rng)
    return out, lse, rng


@attention_fwd.register_fake
def _attention_fwd_fake(query, key, value, attn_mask, sinks, scale, softcap, dropout_p, is_causal,
                        sliding_window, lse_grad):
    b, h, sq, _ = query.shape
    out = query.new_empty((b, sq, h, value.shape[-1])).transpose(1, 2)
    lse = query.new_empty((b, h, sq), dtype=torch.float32)
    rng = query.new_empty((2 if dropout_p > 0.0 else 0,), dtype=torch.int64)
    return out, lse, rng


@torch.library.custom_op("kda_compile::attention_bwd", mutates_args=())
def attention_bwd(grad_out: Tensor, grad_lse: Optional[Tensor], query: Tensor, key: Tensor, value: Tensor,
                  out: Tensor, lse: Tensor, rng: Tensor, attn_mask: Optional[Tensor], sinks: Optional[Tensor],
                  scale: float, softcap: float, dropout_p: float, is_causal: bool, sliding_window: int,
                  mask_needs_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    if nothing_to_attend(query, key):
        return _pack_grads(query, *_empty_backward(query, key, value, attn_mask, sinks, mask_needs_grad))
    dq, dk, dv, dmask, dsinks = reference_backward(grad_out, grad_lse, query, key, value, attn_mask, sinks,
                                                   scale, softcap, dropout_p, is_causal, sliding_window, rng,
                                                   mask_needs_grad)
    return _pack_grads(query, dq, dk, dv, dmask, dsinks)


@attention_bwd.register_kernel("cuda")
def _attention_bwd_cuda(grad_out, grad_lse, query, key, value, out, lse, rng, attn_mask, sinks, scale, softcap,
                        dropout_p, is_causal, sliding_window, mask_needs_grad):
    if nothing_to_attend(query, key):
        return _pack_grads(query, *_empty_backward(query, key, value, attn_mask, sinks, mask_needs_grad))
    dq, dk, dv, dmask, dsinks = cuda_backward(grad_out, grad_lse, query, key, value, out, lse, rng, attn_mask,
                                              sinks, scale, softcap, dropout_p, is_causal, sliding_window,
                                              mask_needs_grad)
    return _pack_grads(query, dq, dk, dv, dmask, dsinks)


def _empty_backward(query, key, value, attn_mask, sinks, mask_needs_grad):
    """Zero gradients of a call with nothing to attend (its outputs, zeros and -inf, depend on no input)."""
    dmask = torch.zeros_like(attn_mask) if mask_needs_grad else None
    dsinks = None if sinks is None else torch.zeros_like(sinks)
    return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value), dmask, dsinks


def _pack_grads(query, dq, dk, dv, dmask, dsinks):
    dmask = empty_like_absent(query) if dmask is None else dmask.contiguous()
    dsinks = empty_like_absent(query) if dsinks is None else dsinks.contiguous()
    return as_bshd(dq), as_bshd(dk), as_bshd(dv), dmask, dsinks


@attention_bwd.register_fake
def _attention_bwd_fake(grad_out, grad_lse, query, key, value, out, lse, rng, attn_mask, sinks, scale, softcap,
                        dropout_p, is_causal, sliding_window, mask_needs_grad):
    def bshd_like(t):
        b, h, s, d = t.shape
        return t.new_empty((b, s, h, d)).transpose(1, 2)

    dmask = attn_mask.new_empty(attn_mask.shape) if mask_needs_grad else empty_like_absent(query)
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else empty_like_absent(query)
    return bshd_like(query), bshd_like(key), bshd_like(value), dmask, dsinks


def _setup_context(ctx, inputs, output):
    query, key, value, attn_mask, sinks, scale, softcap, dropout_p, is_causal, sliding_window, lse_grad = inputs
    out, lse, rng = output
    ctx.save_for_backward(query, key, value, out, lse, rng, attn_mask, sinks)
    ctx.params = (scale, softcap, dropout_p, is_causal, sliding_window)
    ctx.lse_grad = lse_grad


def _backward(ctx, grad_out, grad_lse, _grad_rng):
    query, key, value, out, lse, rng, attn_mask, sinks = ctx.saved_tensors
    mask_needs_grad = attn_mask is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dmask, dsinks = torch.ops.kda_compile.attention_bwd(
        grad_out, grad_lse if ctx.lse_grad else None, query, key, value, out, lse, rng, attn_mask, sinks,
        *ctx.params, mask_needs_grad)
    return (dq, dk, dv, dmask if mask_needs_grad else None, dsinks if sinks is not None else None,
            None, None, None, None, None, None)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)
