"""Fused softmax attention as a torch.compile-native custom op (``torch.ops.kda_compile.attention_*``).

Public: ``attention`` and ``attention_with_lse`` (the contract the FX rewrite targets);
``attention_backend(name)`` forces an implementation and ``explain_dispatch(...)`` says which one
serves a call and why (tests, benchmarks, debugging).

Folder: ``reference.py`` (the definition, runs on CPU), ``triton_flash_kernels.py`` + ``triton_flash.py``
(our fused flash-attention kernel and its launchers), ``sdpa.py`` (torch's cuDNN / flash /
memory-efficient kernels, with the table of which serves which case), ``kernels.py`` (which
implementation serves a CUDA call), ``custom_ops.py`` (torch.library registration, layouts),
``api.py`` (argument checks and the public functions).
"""
from kda_compile.ops.attention.api import attention, attention_with_lse
from kda_compile.ops.attention.kernels import attention_backend, explain_dispatch

__all__ = ["attention", "attention_with_lse", "attention_backend", "explain_dispatch"]
