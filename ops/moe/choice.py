"""Which kernel serves a ``moe_experts`` call.

- CPU or float64: the reference (``reference.py``): the op's math in torch. On CUDA, a call the Triton kernels
  cannot take (Triton missing, weights without unit stride along their last dimension) runs the reference too,
  recorded as a fallback (logged, in ``kda_compile.report()``; an error in strict mode).
- CUDA, "auto": the Triton kernels (``triton_experts.py``) while the routed pairs are few per expert
  (``pairs <= PAIRS_PER_EXPERT * E``: decode and short chunks: every weight read once, nothing padded to a GEMM
  tile), else ``torch._grouped_mm`` where it runs (bfloat16, sm_90+), else the Triton kernels. The crossover
  constant: docs/moe.md, section 4.
- A kernel named explicitly runs, or raises ValueError saying why it cannot.
"""
from __future__ import annotations

import torch

from kda_compile.ops._common import module_unusable, record_fallback, triton_interpreted
from kda_compile.ops.moe.grouped_mm import grouped_mm_problem

KERNELS = ("auto", "triton", "grouped_mm", "reference")
PAIRS_PER_EXPERT = 8
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def triton_problem(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> str | None:
    """None when the Triton kernels can run this call, else why not."""
    if hidden_states.device.type != "cuda" and not triton_interpreted():
        return f"the Triton kernels run on CUDA; the inputs are on {hidden_states.device}"
    if hidden_states.dtype not in _TRITON_DTYPES:
        return f"the Triton kernels take float16 / bfloat16 / float32; the inputs are {hidden_states.dtype}"
    if any(t.shape[-1] > 1 and t.stride(-1) != 1 for t in (hidden_states, gate_up_proj, down_proj)):
        return "the Triton kernels need unit stride along the last dimension of hidden_states and the weights"
    unusable = module_unusable("triton")
    if unusable:
        return unusable
    return None


def choose_kernel(kernel: str, hidden_states: torch.Tensor, top_k_index: torch.Tensor, gate_up_proj: torch.Tensor,
                  down_proj: torch.Tensor) -> str:
    if kernel == "reference":
        return kernel
    if kernel == "triton":
        why = triton_problem(hidden_states, gate_up_proj, down_proj)
        if why:
            raise ValueError(f"kernel='triton' cannot run this call: {why}")
        return kernel
    if kernel == "grouped_mm":
        why = grouped_mm_problem(hidden_states, gate_up_proj, down_proj)
        if why:
            raise ValueError(f"kernel='grouped_mm' cannot run this call: {why}")
        return kernel
    if hidden_states.device.type != "cuda" or hidden_states.dtype == torch.float64:
        return "reference"
    why = triton_problem(hidden_states, gate_up_proj, down_proj)
    if why:
        record_fallback("moe_experts", "reference", why)
        return "reference"
    few = top_k_index.numel() <= PAIRS_PER_EXPERT * gate_up_proj.shape[0]
    if few or grouped_mm_problem(hidden_states, gate_up_proj, down_proj) is not None:
        return "triton"
    return "grouped_mm"
