"""``Config.skip_decode_guards``: a CUDA-graph decode step that has run once runs its next calls with only
Dynamo's differentiating guards (docs/cuda-graphs.md, section 9).

Every call of a compiled function first evaluates the guards of its cached entries: for a Hugging Face model
a thousand or more checks of the module tree, the config and the inputs, a large part of a captured batch-1
decode step's host time (measured in that section). ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``
makes Dynamo evaluate, per entry, only its differentiating guards instead: every tensor guard (shape, stride, dtype, device of each input) and
every guard that has failed before (what told the entries apart when they were compiled). What it no longer
sees are changes of the Python state the graph was traced with: a module, parameter or config attribute
replaced, ``train()`` / ``eval()``, a hook added. A decode loop over one model changes none of these; a caller
who does so between steps must leave the option off.

Here the stance is set only around a static decode step (one token per sequence into a static cache, under
CUDA graphs) whose key (the cache, the batch size, grad and inference mode, the module's training flag) has
been called before: that first call ran every guard and compiled or found its entry, so the skipped calls pick
an entry Dynamo already chose for the same inputs. A new batch size, a new cache, a prefill or another mode
runs every guard again.
"""
from __future__ import annotations

import inspect
import logging
import weakref
from typing import Any, Callable

import torch

from kda_compile.cuda_graphs import token_input

logger = logging.getLogger("kda_compile.decode_guards")

OPTION = "skip_guard_eval_unsafe"


def available() -> bool:
    """Whether this torch's ``torch.compiler.set_stance`` takes ``skip_guard_eval_unsafe`` (torch >= 2.7)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance is not None and OPTION in inspect.signature(set_stance).parameters


def require_available() -> None:
    """Raise when ``Config.skip_decode_guards`` cannot be honoured by this torch."""
    if not available():
        raise ValueError(f"Config.skip_decode_guards needs torch.compiler.set_stance({OPTION}=...) (torch >= 2.7), "
                         f"and torch {torch.__version__} has none; leave it False")


def step_key(args: tuple, kwargs: dict, module: Any) -> tuple:
    """What a warm decode step must share with the call that warmed it, beyond its tensors' shapes (which
    Dynamo's differentiating guards still check): the batch size, grad and inference mode, the training flag."""
    tokens = token_input(args, kwargs)
    rows = None if tokens is None else tokens.shape[0]
    return (rows, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            bool(getattr(module, "training", False)))


class WarmDecodeSteps:
    """The static decode steps one ``optimize()`` result has run, per cache (held weakly: a cache that is gone
    takes its keys with it)."""

    def __init__(self) -> None:
        self._keys: "weakref.WeakKeyDictionary[Any, set[tuple]]" = weakref.WeakKeyDictionary()
        self._logged = False

    def run(self, call: Callable[[], Any], cache: Any, key: tuple) -> Any:
        """``call()``, with only the differentiating guards evaluated when ``key`` ran before into ``cache``."""
        try:
            keys = self._keys.setdefault(cache, set())
        except TypeError:  # a cache that cannot be referenced weakly: every guard, every call
            return call()
        if key not in keys:
            result = call()
            keys.add(key)  # after the call: a call that raised compiled nothing to skip to
            return result
        if not self._logged:
            self._logged = True
            logger.info("kda_compile.optimize: warm CUDA-graph decode steps run with only Dynamo's differentiating "
                        "guards (Config.skip_decode_guards; docs/cuda-graphs.md section 9)")
        with _skipping_stance():
            return call()


def _skipping_stance():
    """The caller's compiler stance (``"default"`` unless they set another), with the guards skipped."""
    current = getattr(torch._dynamo.eval_frame, "_stance", None)
    stance = getattr(current, "stance", "default")
    backend = getattr(current, "backend", None) if stance == "default" else None
    return torch.compiler.set_stance(stance, skip_guard_eval_unsafe=True, force_backend=backend)
