"""Which kernel serves a ``moe_experts`` call.

- CPU or float64: the reference (``reference.py``): the op's math in torch. On CUDA, a call the Triton kernels
  cannot take (Triton missing, weights without unit stride along their last dimension) runs the grouped GEMM where
  that serves it, else the reference, recorded as a fallback (logged, in ``kda_compile.report()``; an error in
  strict mode).
- CUDA, "auto": the Triton kernels (``triton_experts.py``) while the routed pairs are few per expert
  (``pairs <= PAIRS_PER_EXPERT * E``: decode and short chunks: every weight read once, nothing padded to a GEMM
  tile), else ``torch._grouped_mm`` where it runs (bfloat16, sm_90+), else the Triton kernels. The crossover
  constant: docs/moe.md, section 4.
- A kernel named explicitly runs, or raises ValueError saying why it cannot.

The kernels are a menu in that order of preference (``ops/_kernel_choice.py``): grouped GEMM (skipped by an
automatic choice for few pairs per expert), Triton (skipped off CUDA, where the interpreter would run it), reference.
"""
from __future__ import annotations

import torch

from kda_compile.ops._common import module_unusable, triton_interpreted
from kda_compile.ops._kernel_choice import Kernel, KernelMenu
from kda_compile.ops.moe.grouped_mm import grouped_mm_problem

KERNELS = ("auto", "triton", "grouped_mm", "reference")
PAIRS_PER_EXPERT = 8
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def triton_outside_design(hidden_states: torch.Tensor, top_k_index: torch.Tensor, gate_up_proj: torch.Tensor,
                          down_proj: torch.Tensor) -> str | None:
    """Why the call is not one the Triton kernels are written for (device, dtype), or None."""
    if hidden_states.device.type != "cuda" and not triton_interpreted():
        return f"the Triton kernels run on CUDA; the inputs are on {hidden_states.device}"
    if hidden_states.dtype not in _TRITON_DTYPES:
        return f"the Triton kernels take float16 / bfloat16 / float32; the inputs are {hidden_states.dtype}"
    return None


def triton_cannot_run(hidden_states: torch.Tensor, top_k_index: torch.Tensor, gate_up_proj: torch.Tensor,
                      down_proj: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot take a call they are written for, or None."""
    if any(t.shape[-1] > 1 and t.stride(-1) != 1 for t in (hidden_states, gate_up_proj, down_proj)):
        return "the Triton kernels need unit stride along the last dimension of hidden_states and the weights"
    return module_unusable("triton")


def _reference_is_the_kernel(hidden_states: torch.Tensor, *_) -> str | None:
    if hidden_states.device.type != "cuda":
        return f"the reference is the kernel on {hidden_states.device} (the Triton interpreter is slower)"
    return None


def _few_pairs(hidden_states: torch.Tensor, top_k_index: torch.Tensor, gate_up_proj: torch.Tensor, *_) -> str | None:
    if top_k_index.numel() <= PAIRS_PER_EXPERT * gate_up_proj.shape[0]:
        return (f"at most {PAIRS_PER_EXPERT} routed pairs per expert: the Triton kernels read each hit expert's "
                "weights once")
    return None


MENU = KernelMenu("moe_experts", (
    Kernel("grouped_mm", "torch._grouped_mm", outside_design=lambda x, index, gate_up, down:
           grouped_mm_problem(x, gate_up, down), costlier=_few_pairs),
    Kernel("triton", "Triton expert kernels", outside_design=triton_outside_design, cannot_run=triton_cannot_run,
           costlier=_reference_is_the_kernel),
    Kernel("reference", "reference"),
))


def choose_kernel(kernel: str, hidden_states: torch.Tensor, top_k_index: torch.Tensor, gate_up_proj: torch.Tensor,
                  down_proj: torch.Tensor) -> str:
    """The kernel of a call (``kernel``: "auto" or one of the menu's names, which must serve or raise)."""
    return MENU.choose(hidden_states, top_k_index, gate_up_proj, down_proj, requested=kernel).name
