"""torch.library registration: ``torch.ops.kda_compile.mla_attention_fwd`` and ``mla_attention_bwd``.

``mla_attention_fwd(q_nope, q_rope, kv_latent, k_rope, kv_b_weight, attn_mask?, scale, is_causal,
path) -> out``

- shapes as in ``reference.py`` (kv_latent [B, T, R], k_rope [B, T, Dr]); ``path`` is "auto",
  "absorbed" or "expanded". With "auto" the form is chosen per call, at run time, by the cost model
  of ``path_choice.py``: the choice is not baked into a compiled graph, so one graph (dynamic=True)
  serves decode, chunked prefill and prefill without recompiling.
- out [B, H, Sq, Dv] in the query dtype, stored as [B, Sq, H, Dv] (strides
  ``(Sq*H*Dv, Dv, H*Dv, 1)``), the layout the following ``transpose(1, 2).reshape(B, Sq, H*Dv)``
  wants; the fake returns exactly these strides.

``mla_attention_bwd(grad_out, <the forward's inputs>, mask_needs_grad) -> (dq_nope, dq_rope,
dkv_latent, dk_rope, dkv_b_weight, dmask)``: contiguous, in each input's shape and dtype; dmask is
empty unless ``mask_needs_grad``. The backward recomputes the forward of the same form under
autograd: the expanded form through the attention op's own backward (fast kernels on CUDA; the
expanded K/V, 71x the latent, are never kept between forward and backward; the price is one
more attention forward), the absorbed form (short queries: inference shapes) by torch autograd in
float32, which materialises the [B, H, Sq, T] scores. No double backward.

Nothing to attend (B = 0, Sq = 0 or T = 0): out = 0 (a softmax over zero keys is a fully masked row) and zero
gradients, on every device without a kernel.

Kernels: the default one (any device) runs both forms in torch (the attention op serves the
expanded one); CUDA runs the absorbed form through a split-KV kernel: the Hopper wgmma one
(``decode/wgmma_decode.py``) or the Triton one (``decode/triton_decode.py``), as ``decode/kernels.py`` chooses.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from kda_compile.ops._common import autograd_inside_op, empty_like_absent, module_unusable, record_fallback
from kda_compile.ops.mla.path_choice import MLAShape, choose_form
from kda_compile.ops.mla.reference import absorbed_mla, compute_dtype, expanded_mla, split_kv_b_weight

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def mla_shape(q_nope, q_rope, kv_latent, kv_b_weight, is_causal) -> MLAShape:
    b, h, sq, dn = q_nope.shape
    return MLAShape(batch=b, heads=h, queries=sq, cache_len=kv_latent.shape[1], nope_dim=dn,
                    rope_dim=q_rope.shape[3], value_dim=kv_b_weight.shape[0] // h - dn,
                    latent_dim=kv_latent.shape[2], is_causal=bool(is_causal), element_bytes=q_nope.element_size())


def resolve_path(path: str, q_nope, q_rope, kv_latent, kv_b_weight, is_causal) -> str:
    return choose_form(path, mla_shape(q_nope, q_rope, kv_latent, kv_b_weight, is_causal))


def fresh(t: Tensor, inputs) -> Tensor:
    """``t``, cloned if it shares memory with any of ``inputs``: an op's outputs may alias neither its
    inputs nor each other (autograd can hand back views of ``grad_out``, or two slices of one
    gradient that count as contiguous when the other dims have size 1)."""
    ptr = t.untyped_storage().data_ptr()
    if any(x is not None and x.untyped_storage().data_ptr() == ptr for x in inputs):
        return t.clone()
    return t


def bshd(t: Tensor) -> Tensor:
    """``t`` [B, H, S, D] with exactly the op's output strides (a view of [B, S, H, D] storage)."""
    b, h, s, d = t.shape
    if tuple(t.stride()) == (s * h * d, d, h * d, 1):
        return t
    return torch.empty((b, s, h, d), dtype=t.dtype, device=t.device).transpose(1, 2).copy_(t)


@functools.lru_cache(maxsize=None)
def triton_unavailable() -> str | None:
    """None when the Triton kernels import, else why not."""
    return module_unusable("kda_compile.ops.mla.decode.triton_decode")


def absorbed_mla_cuda(q_nope, q_rope, kv_latent, k_rope, kv_b_weight, attn_mask, scale, is_causal):
    """The absorbed form with a CUDA kernel (``decode/kernels.py`` picks the Hopper wgmma one or the
    Triton one): out [B, H, Sq, Dv], BSHD-stored, input dtype.

    The absorption matmuls are batched over heads with the weight viewed, never copied per batch:
    [H, B*Sq, Dn] @ W_UK [H, Dn, R] before the kernel, [H, B*Sq, R] @ W_UV^T [H, R, Dv] after it.
    """
    from kda_compile.ops.mla.decode.kernels import mla_decode

    b, h, sq, dn = q_nope.shape
    r = kv_latent.shape[2]
    w_uk, w_uv = split_kv_b_weight(kv_b_weight, h, dn)
    q_lat = torch.bmm(q_nope.permute(1, 0, 2, 3).reshape(h, b * sq, dn), w_uk)  # [H, B*Sq, R]
    o_lat, _ = mla_decode(q_lat.view(h, b, sq, r).permute(1, 0, 2, 3), q_rope, kv_latent, k_rope,
                                    attn_mask, scale, is_causal)
    out_h = torch.bmm(o_lat.permute(1, 0, 2, 3).reshape(h, b * sq, r), w_uv.transpose(1, 2))  # [H, B*Sq, Dv]
    return bshd(out_h.view(h, b, sq, -1).permute(1, 0, 2, 3))


def nothing_to_attend(q_nope: Tensor, kv_latent: Tensor) -> bool:
    """No query row (B = 0 or Sq = 0) or no cached token (T = 0): the output is known without a kernel."""
    return q_nope.shape[0] == 0 or q_nope.shape[2] == 0 or kv_latent.shape[1] == 0


def _forward(q_nope, q_rope, kv_latent, k_rope, kv_b_weight, attn_mask, scale, is_causal, path, *, cuda: bool):
    if nothing_to_attend(q_nope, kv_latent):  # a softmax over zero keys: every key masked out, so 0
        b, h, sq, dn = q_nope.shape
        return q_nope.new_zeros((b, sq, h, kv_b_weight.shape[0] // h - dn)).transpose(1, 2)
    chosen = resolve_path(path, q_nope, q_rope, kv_latent, kv_b_weight, is_causal)
    args = (q_nope, q_rope, kv_latent, k_rope, kv_b_weight, attn_mask, scale, is_causal)
    if chosen == "expanded":
        return bshd(expanded_mla(*args))
    if cuda:
        if q_nope.dtype in _TRITON_DTYPES and not triton_unavailable():
            return absorbed_mla_cuda(*args)
        why = triton_unavailable() or f"{q_nope.dtype} inputs have no Triton kernel"
        record_fallback("mla_attention", "torch absorbed", why)
    return bshd(absorbed_mla(*args).to(q_nope.dtype))


@torch.library.custom_op("kda_compile::mla_attention_fwd", mutates_args=())
def mla_attention_fwd(q_nope: Tensor, q_rope: Tensor, kv_latent: Tensor, k_rope: Tensor, kv_b_weight: Tensor,
                      attn_mask: Optional[Tensor], scale: float, is_causal: bool, path: str) -> Tensor:
    args = (q_nope, q_rope, kv_latent, k_rope, kv_b_weight, attn_mask)
    return fresh(_forward(*args, scale, is_causal, path, cuda=False), args)


@mla_attention_fwd.register_kernel("cuda")
def _mla_attention_fwd_cuda(q_nope, q_rope, kv_latent, k_rope, kv_b_weight, attn_mask, scale, is_causal, path):
    args = (q_nope, q_rope, kv_latent, k_rope, kv_b_weight, attn_mask)
    return fresh(_forward(*args, scale, is_causal, path, cuda=True), args)


@mla_attention_fwd.register_fake
def _mla_attention_fwd_fake(q_nope, q_rope, kv_latent, k_rope, kv_b_weight, attn_mask, scale, is_causal, path):
    b, h, sq, dn = q_nope.shape
    return q_nope.new_empty((b, sq, h, kv_b_weight.shape[0] // h - dn)).transpose(1, 2)


@torch.library.custom_op("kda_compile::mla_attention_bwd", mutates_args=())
def mla_attention_bwd(grad_out: Tensor, q_nope: Tensor, q_rope: Tensor, kv_latent: Tensor, k_rope: Tensor,
                      kv_b_weight: Tensor, attn_mask: Optional[Tensor], scale: float, is_causal: bool, path: str,
                      mask_needs_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    if nothing_to_attend(q_nope, kv_latent):  # the output (zeros) depends on no input
        grads = [torch.zeros_like(t, memory_format=torch.contiguous_format)
                 for t in (q_nope, q_rope, kv_latent, k_rope, kv_b_weight)]
        dmask = torch.zeros_like(attn_mask, memory_format=torch.contiguous_format) if mask_needs_grad else None
        return (*grads, empty_like_absent(q_nope) if dmask is None else dmask)
    chosen = resolve_path(path, q_nope, q_rope, kv_latent, kv_b_weight, is_causal)
    # The expanded form keeps the input dtype so the attention op's fast kernels serve it.
    dtype = q_nope.dtype if chosen == "expanded" else compute_dtype(q_nope.dtype)
    if chosen == "absorbed" and q_nope.is_cuda:
        record_fallback("mla_attention_backward", "torch absorbed",
                        "the absorbed form (short queries) has no Triton backward")
    inputs = (q_nope, q_rope, kv_latent, k_rope, kv_b_weight)
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in inputs]
    mask = attn_mask
    if mask_needs_grad:
        mask = attn_mask.detach().to(dtype).requires_grad_(True)
        leaves.append(mask)
    form = expanded_mla if chosen == "expanded" else absorbed_mla
    with autograd_inside_op():
        out = form(*leaves[:5], mask, scale, is_causal)
        grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype), allow_unused=True)
    grads = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves)]
    seen = [grad_out, *inputs, attn_mask]
    result = []
    for g, t in zip(grads, (*inputs, attn_mask)):
        result.append(fresh(g.to(t.dtype).contiguous(), seen))
        seen.append(result[-1])
    if not mask_needs_grad:
        result.append(empty_like_absent(q_nope))
    return tuple(result)


@mla_attention_bwd.register_fake
def _mla_attention_bwd_fake(grad_out, q_nope, q_rope, kv_latent, k_rope, kv_b_weight, attn_mask, scale, is_causal,
                            path, mask_needs_grad):
    grads = [t.new_empty(t.shape) for t in (q_nope, q_rope, kv_latent, k_rope, kv_b_weight)]
    dmask = attn_mask.new_empty(attn_mask.shape) if mask_needs_grad else empty_like_absent(q_nope)
    return (*grads, dmask)


def _setup_context(ctx, inputs, output):
    q_nope, q_rope, kv_latent, k_rope, kv_b_weight, attn_mask, scale, is_causal, path = inputs
    ctx.save_for_backward(q_nope, q_rope, kv_latent, k_rope, kv_b_weight, attn_mask)
    ctx.params = (scale, is_causal, path)


def _backward(ctx, grad_out):
    q_nope, q_rope, kv_latent, k_rope, kv_b_weight, attn_mask = ctx.saved_tensors
    mask_needs_grad = attn_mask is not None and ctx.needs_input_grad[5]
    grads = torch.ops.kda_compile.mla_attention_bwd(grad_out, q_nope, q_rope, kv_latent, k_rope, kv_b_weight,
                                                    attn_mask, *ctx.params, mask_needs_grad)
    dmask = grads[5] if mask_needs_grad else None
    return (*grads[:5], dmask, None, None, None)


mla_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
