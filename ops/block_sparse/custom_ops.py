"""torch.library registration of the block-sparse attention (``torch.ops.kda_compile.block_sparse_attention_*``).

``block_sparse_attention_fwd(query, key, value, block_indices, query_positions?, key_padding_mask?, block_size,
scale) -> (out, lse)``
    out [B, H, Sq, Dv] contiguous in query's dtype, lse [B, H, Sq] float32 contiguous (natural log; -inf for a
    row without a visible key, whose out is 0; a residual for the backward, not differentiable). CUDA float16 /
    bfloat16 / float32 with a block size the kernel accepts: the Triton kernel (``triton_forward.py``); CPU,
    float64, and other block sizes on CUDA (a recorded fallback; the kernel menu ``FORWARD``,
    ``ops/_kernel_choice.py``): the reference (``reference.py``).

``block_sparse_attention_bwd(grad_out, <the forward's tensors>, out, lse, block_size, scale) -> (dq, dk, dv)``
    each in its input's shape and dtype, contiguous. Where the forward ran the Triton kernel, the Triton backward
    (``triton_backward.py``: dq per program, dk / dv by float32 atomics, reusing the forward's lse); elsewhere
    autograd through the reference (on CUDA logged with the forward's reason; docs/block-sparse.md, section
    "Backward").

Values of ``block_indices``: -1 or a block in ``[0, ceil(T / block_size))``, else a ValueError naming the first
entry: checked on the CPU on every call, on CUDA with ``KDA_COMPILE_CHECK_INPUTS=1`` only
(``ops._common.values_checked``); unchecked entries outside that range are read by the kernel as empty slots.
No key (T = 0): out = 0, lse = -inf, zero gradients, without a kernel.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from kda_compile.ops._common import cuda_index, grads_by_autograd, module_unusable, on_device, values_checked
from kda_compile.ops._kernel_choice import Kernel, KernelMenu
from kda_compile.ops.block_sparse.reference import block_sparse_attention_reference, check_block_index_values

OP = "block_sparse_attention"
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def _triton_unusable() -> str | None:
    return module_unusable("kda_compile.ops.block_sparse.triton_forward")  # triton is optional


def _kernel_problem(query: Tensor, block_size: int) -> str | None:
    """Why a CUDA call cannot run the Triton kernel, or None."""
    if query.dtype not in _KERNEL_DTYPES:
        return f"{query.dtype} runs the reference (the kernel takes float16, bfloat16 and float32)"
    unusable = _triton_unusable()
    if unusable is not None:
        return unusable
    from kda_compile.ops.block_sparse.triton_forward import block_size_problem

    return block_size_problem(block_size)


def _off_cuda(query: Tensor, block_size: int) -> str | None:
    return None if query.device.type == "cuda" else f"the kernels run on CUDA; the inputs are on {query.device}"


def _menu(triton_label: str, reference_label: str) -> KernelMenu:
    return KernelMenu(OP, (Kernel("triton", triton_label, outside_design=_off_cuda, cannot_run=_kernel_problem),
                           Kernel("reference", reference_label)))


FORWARD = _menu("Triton block-sparse attention kernel", "torch reference")
BACKWARD = _menu("Triton block-sparse attention backward kernels", "torch reference backward")


def block_sparse_attention_fwd_impl(query, key, value, block_indices, query_positions, key_padding_mask,
                                    block_size, scale):
    """What the forward op runs on the inputs' device."""
    if values_checked(block_indices):
        check_block_index_values(block_indices, key.shape[2], block_size)
    batch, heads, queries, _ = query.shape
    if key.shape[2] == 0:
        return (query.new_zeros((batch, heads, queries, value.shape[-1])),
                query.new_full((batch, heads, queries), float("-inf"), dtype=torch.float32))
    if FORWARD.choose(query, block_size).name == "triton":
        from kda_compile.ops.block_sparse.triton_forward import block_sparse_attention_fwd_triton

        with on_device(cuda_index(query.device)):
            return block_sparse_attention_fwd_triton(query, key, value, block_indices, block_size, scale,
                                                     query_positions, key_padding_mask)
    out, lse = block_sparse_attention_reference(query, key, value, block_indices, block_size, scale,
                                                query_positions, key_padding_mask)
    return out.to(query.dtype).contiguous(), lse.float().contiguous()


@torch.library.custom_op("kda_compile::block_sparse_attention_fwd", mutates_args=())
def block_sparse_attention_fwd(query: Tensor, key: Tensor, value: Tensor, block_indices: Tensor,
                               query_positions: Optional[Tensor], key_padding_mask: Optional[Tensor], block_size: int,
                               scale: float) -> tuple[Tensor, Tensor]:
    return block_sparse_attention_fwd_impl(query, key, value, block_indices, query_positions, key_padding_mask,
                                           block_size, scale)


@block_sparse_attention_fwd.register_fake
def _block_sparse_attention_fwd_fake(query, key, value, block_indices, query_positions, key_padding_mask,
                                     block_size, scale):
    batch, heads, queries, _ = query.shape
    return (query.new_empty((batch, heads, queries, value.shape[-1])),
            query.new_empty((batch, heads, queries), dtype=torch.float32))


@torch.library.custom_op("kda_compile::block_sparse_attention_bwd", mutates_args=())
def block_sparse_attention_bwd(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, block_indices: Tensor,
                               query_positions: Optional[Tensor], key_padding_mask: Optional[Tensor], out: Tensor,
                               lse: Tensor, block_size: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv): the Triton backward on CUDA where the kernels take the call, else autograd through the
    reference (which recomputes the forward)."""
    if key.shape[2] and BACKWARD.choose(query, block_size).name == "triton":
        from kda_compile.ops.block_sparse.triton_backward import block_sparse_attention_bwd_triton

        with on_device(cuda_index(query.device)):
            return block_sparse_attention_bwd_triton(grad_out, query, key, value, block_indices, query_positions,
                                                     key_padding_mask, out, lse, block_size, scale)

    def run(leaves):
        return block_sparse_attention_reference(leaves["query"], leaves["key"], leaves["value"], block_indices,
                                                block_size, scale, query_positions, key_padding_mask)

    inputs = {"query": query, "key": key, "value": value}
    grads = grads_by_autograd(run, inputs, grad_out, None)
    return tuple(g.to(t.dtype).contiguous() for g, t in zip(grads, inputs.values()))


@block_sparse_attention_bwd.register_fake
def _block_sparse_attention_bwd_fake(grad_out, query, key, value, block_indices, query_positions,
                                     key_padding_mask, out, lse, block_size, scale):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx, inputs, output):
    query, key, value, block_indices, query_positions, key_padding_mask, block_size, scale = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(query, key, value, block_indices, query_positions, key_padding_mask, out, lse)
    ctx.params = (block_size, scale)


def _backward(ctx, grad_out, _grad_lse):  # lse is not differentiable
    dq, dk, dv = torch.ops.kda_compile.block_sparse_attention_bwd(grad_out, *ctx.saved_tensors,
                                                                  *ctx.params)
    return dq, dk, dv, None, None, None, None, None


block_sparse_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
