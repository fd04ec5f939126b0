"""``torch.ops.kda_compile.causal_conv1d_update``: the op writes ``conv_state`` in place, declared to torch.library
(``mutates_args``), so Inductor keeps the write in the graph and CUDA-graph trees capture it (docs/cuda-graphs.md).
Inference only: it has no backward (Hugging Face's training forward runs ``causal_conv1d_fn``, not the update)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kda_compile.ops._common import cuda_index, on_device
from kda_compile.ops.conv1d.choice import choose_kernel
from kda_compile.ops.conv1d.reference import causal_conv1d_update_reference


def _triton_kernel(*args) -> Tensor:
    from kda_compile.ops.conv1d.triton_update import causal_conv1d_update_triton  # triton is optional

    return causal_conv1d_update_triton(*args)


_KERNELS = {"triton": _triton_kernel, "reference": causal_conv1d_update_reference}


@torch.library.custom_op("kda_compile::causal_conv1d_update", mutates_args=("conv_state",))
def causal_conv1d_update_op(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor],
                            activation: Optional[str], kernel: str) -> Tensor:
    run = _KERNELS[choose_kernel(kernel, x, conv_state, weight)]
    if x.device.type == "cuda":
        with on_device(cuda_index(x.device)):
            return run(x, conv_state, weight, bias, activation)
    return run(x, conv_state, weight, bias, activation)


@causal_conv1d_update_op.register_fake
def _causal_conv1d_update_fake(x, conv_state, weight, bias, activation, kernel):
    return x.new_empty(x.shape)  # contiguous, as the kernels return it
