"""``kda_compile.optimize``: torch.compile with the kda_compile backend and a rewrite config."""
from __future__ import annotations

from typing import Any

import torch

from kda_compile.backend import KdaCompileBackend
from kda_compile.config import Config
from kda_compile.report import attach


def _already_compiled(model: Any) -> str | None:
    """How ``model`` was already compiled, or None."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return "it is the result of torch.compile (an OptimizedModule); pass its _orig_mod"
    if hasattr(model, "_torchdynamo_orig_callable"):
        return "it is the result of torch.compile; pass the original function"
    if isinstance(model, torch.nn.Module):
        if getattr(model, "_compiled_call_impl", None) is not None:
            return "model.compile() was called on it"
        if hasattr(getattr(model, "forward", None), "_torchdynamo_orig_callable"):
            return "its forward was replaced by a torch.compile'd function"
    return None


def optimize(model: Any, config: Config | None = None, **compile_kwargs: Any) -> Any:
    """Compile ``model`` with the kda_compile rewrites (see :class:`Config`) and Inductor.

    Args:
        model: an ``nn.Module`` (e.g. a Hugging Face model with ``attn_implementation="eager"``)
            or a function / bound method (``model.forward``, so that ``model.generate`` runs the
            compiled forward: ``model.forward = optimize(model.forward)``). It must not be
            compiled already.
        config: which rewrites run and what compiles the result; default ``Config()``.
        **compile_kwargs: passed to ``torch.compile`` (``dynamic``, ``fullgraph``, ``mode``,
            ``options``, ...); ``backend`` is ours and cannot be given.

    Returns:
        ``torch.compile(model, backend=<kda_compile with config>, **compile_kwargs)``.
        ``kda_compile.report(result)`` lists what each compiled graph rewrote and left alone.
    """
    why = _already_compiled(model)
    if why is not None:
        raise TypeError(f"model must not be compiled already, got {type(model).__name__}: {why}")
    if not callable(model):
        raise TypeError(f"model must be an nn.Module or a callable, got {type(model).__name__}")
    if "backend" in compile_kwargs:
        raise TypeError(f"optimize() takes no backend (it uses kda_compile's), "
                        f"got backend={compile_kwargs['backend']!r}")
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a kda_compile.Config or None, got {type(config).__name__}")
    backend = KdaCompileBackend(config)
    compiled = torch.compile(model, backend=backend, **compile_kwargs)
    original = getattr(model, "__self__", None)  # a bound method's module also answers report()
    attach(compiled, backend, model, *([original] if original is not None else []))
    return compiled
