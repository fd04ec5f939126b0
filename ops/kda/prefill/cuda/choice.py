"""What the KDA prefill's CUDA kernels (``prefill/cuda/prepare.py``, ``prefill/cuda/scan.py``) share in choosing
themselves: the device conditions every such kernel has (their ``auto | triton | cuda`` switches are read by
``ops.envs``)."""
from __future__ import annotations


import torch

from kda_compile.ops._common import cuda_index, device_capability, triton_interpreted

# The C type of each ``cu_seqlens`` dtype the NVRTC kernels take (their sources are specialised on it).
CU_TYPES = {torch.int32: "int", torch.int64: "long long"}


def device_unsupported(x: torch.Tensor | torch.device, *, min_capability: tuple[int, int] = (8, 0),
                       needs: str = "bf16 mma.sync") -> str | None:
    """Why ``x``'s device (a tensor's, or a device asked of before any tensor exists) cannot run a bf16 ``mma.sync``
    kernel compiled by NVRTC (one that also uses what ``needs`` names from ``min_capability`` on), or None."""
    device = x if isinstance(x, torch.device) else x.device
    if device.type != "cuda":
        return "not a CUDA tensor" if isinstance(x, torch.Tensor) else f"not a CUDA device: {device}"
    if triton_interpreted():
        return "TRITON_INTERPRET=1"
    capability = device_capability(cuda_index(device))
    if capability < min_capability:
        return (f"needs sm_{min_capability[0]}{min_capability[1]} or newer ({needs}), "
                f"got sm_{''.join(map(str, capability))}")
    return None
