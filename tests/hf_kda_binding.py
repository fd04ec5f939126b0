"""What Hugging Face's KDA / gated-delta-rule wrappers call, and HF's torch references for CPU tests.

transformers decorates ``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention``
(Kimi-Linear) and ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``
(Qwen3-Next and relatives) with ``use_kernel_func_from_hub_with_fallback``: the module-level name
holds a wrapper that, at import, bound flash-linear-attention's function (``fla`` importable) or
else the torch reference it wraps (``wrapper.__wrapped__``). FLA's functions run Triton kernels on
CUDA tensors only, so a CPU test that needs HF's eager result takes it from the torch reference,
whatever is installed; a test of "the wrapper" tests what the wrapper bound (``binding``).

Imported by the tests as the top-level module ``hf_kda_binding`` (pytest puts ``tests/`` on
``sys.path``: ``tests/`` has no ``__init__.py``).
"""
from __future__ import annotations

from typing import Callable

from kda_compile.passes.substitution.install import hf_bound_implementation, hf_torch_path

# HF's wrapped name -> FLA's function it binds when ``fla`` is importable (HF's decorator arguments).
FLA_NAMES = {
    "chunk_kimi_delta_attention": "chunk_kda",
    "recurrent_kimi_delta_attention": "fused_recurrent_kda",
    "torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule",
}


def torch_reference(fn: Callable) -> Callable:
    """HF's torch reference behind ``fn`` (HF's wrapper, or the reference itself)."""
    return getattr(fn, "__wrapped__", fn)


def torch_bound(fn: Callable) -> bool:
    """Whether calling ``fn`` runs HF's torch reference (no FLA was bound)."""
    return hf_bound_implementation(fn) is torch_reference(fn)


def binding(fn: Callable) -> str:
    """``"torch"``, or the qualified name of the FLA function HF's wrapper bound (for skip reasons
    and assertion messages)."""
    if torch_bound(fn):
        return "torch"
    implementation = hf_bound_implementation(fn)
    return f"{implementation.__module__}.{implementation.__name__}"


def torch_entry(fn: Callable) -> Callable:
    """What a test calls to run HF's torch reference through HF's own entry: the wrapper when it
    bound the reference (so the wrapper is exercised too), else the reference itself."""
    return fn if torch_bound(fn) else torch_reference(fn)


#: HF's torch path for the duration of a ``with`` block (``kda_substitution.hf_torch_path``).
torch_path = hf_torch_path
