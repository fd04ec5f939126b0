"""torch.library registration: ``torch.ops.kda_compile.moe_experts``.

``moe_experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K], gate_up_proj [E, 2I, H],
down_proj [E, H, I], kernel) -> [T, H]`` in hidden_states' dtype (the math: ``reference.py``).

``kernel`` is "auto", "triton", "grouped_mm" or "reference". With "auto" the kernel is chosen per call, at run
time (``choice.py``), so one compiled graph serves decode and prefill. No tensor is mutated; the output aliases
no input.

Backward: ``torch.ops.kda_compile.moe_experts_backward(grad_out, <the forward's tensors>) -> (d hidden_states,
d top_k_weights, d gate_up_proj, d down_proj)``, by torch autograd through the reference math (a host-side loop
over the experts that are hit), inside its own op so that compiled graphs stay free of data-dependent shapes: a
training step can differentiate the op, but the kernels are inference kernels (docs/moe.md, section 3).
"""
from __future__ import annotations

import torch
from torch import Tensor

from kda_compile.ops._common import autograd_inside_op, cuda_index, on_device
from kda_compile.ops.moe.choice import choose_kernel
from kda_compile.ops.moe.grouped_mm import moe_experts_grouped_mm
from kda_compile.ops.moe.reference import moe_experts_reference


def _triton_kernels(*args) -> Tensor:
    from kda_compile.ops.moe.triton_experts import moe_experts_triton  # triton is optional: imported when used

    return moe_experts_triton(*args)


_KERNELS = {"triton": _triton_kernels, "grouped_mm": moe_experts_grouped_mm, "reference": moe_experts_reference}


@torch.library.custom_op("kda_compile::moe_experts", mutates_args=())
def moe_experts_op(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_proj: Tensor,
                   down_proj: Tensor, kernel: str) -> Tensor:
    chosen = choose_kernel(kernel, hidden_states, top_k_index, gate_up_proj, down_proj)
    run = _KERNELS[chosen]
    if hidden_states.device.type == "cuda" and chosen != "reference":
        with on_device(cuda_index(hidden_states.device)):
            return run(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)
    return run(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)


@moe_experts_op.register_fake
def _moe_experts_fake(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, kernel):
    return hidden_states.new_empty(hidden_states.shape)


@torch.library.custom_op("kda_compile::moe_experts_backward", mutates_args=())
def moe_experts_backward_op(grad_out: Tensor, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                            gate_up_proj: Tensor, down_proj: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(d hidden_states, d top_k_weights, d gate_up_proj, d down_proj), each in its input's shape and dtype."""
    floats = (hidden_states, top_k_weights, gate_up_proj, down_proj)
    with autograd_inside_op():
        leaves = [t.detach().requires_grad_() for t in floats]
        out = moe_experts_reference(leaves[0], top_k_index, *leaves[1:])
        grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True) if out.requires_grad else [None] * 4
    return tuple(torch.zeros_like(t) if g is None else g.to(t.dtype) for g, t in zip(grads, floats))


@moe_experts_backward_op.register_fake
def _moe_experts_backward_fake(grad_out, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj):
    return tuple(torch.empty_like(t) for t in (hidden_states, top_k_weights, gate_up_proj, down_proj))


def _setup_context(ctx, inputs, output):
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, _ = inputs
    ctx.save_for_backward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)


def _backward(ctx, grad_out):
    d_hidden, d_weights, d_gate_up, d_down = torch.ops.kda_compile.moe_experts_backward(grad_out, *ctx.saved_tensors)
    return d_hidden, None, d_weights, d_gate_up, d_down, None


moe_experts_op.register_autograd(_backward, setup_context=_setup_context)
