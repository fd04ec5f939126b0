"""Which kernel serves a ``causal_conv1d_update`` call (a menu, ops/_kernel_choice.py).

- CUDA, "auto": the Triton kernel (``triton_update.py``): one launch for the conv, the activation and the state.
  Triton missing is a fallback to the reference (logged, in ``kda_compile.report()``, an error in strict mode).
- CPU or float64: the reference (``reference.py``), which is Hugging Face's torch code.
- A kernel named explicitly runs, or raises ValueError saying why it cannot.
"""
from __future__ import annotations

import torch

from kda_compile.ops._common import module_unusable
from kda_compile.ops._kernel_choice import Kernel, KernelMenu

KERNELS = ("auto", "triton", "reference")
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _triton_outside_design(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> str | None:
    if x.device.type != "cuda":
        return f"the reference is the kernel on {x.device} (the Triton interpreter is slower)"
    if any(t.dtype not in TRITON_DTYPES for t in (x, conv_state, weight)):
        return "float64 runs the reference"
    return None


MENU = KernelMenu("causal_conv1d_update", (
    Kernel("triton", "Triton conv1d update kernel", outside_design=_triton_outside_design,
           cannot_run=lambda *_: module_unusable("triton")),
    Kernel("reference", "reference"),
))


def choose_kernel(kernel: str, x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> str:
    """The kernel of a call (``kernel``: "auto" or one of the menu's names, which must serve or raise)."""
    return MENU.choose(x, conv_state, weight, requested=kernel).name
