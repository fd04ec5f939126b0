"""Argument errors that reach the caller unchanged under ``torch.compile``, shared by every public op.

Dynamo reports an exception raised in traced code as ``torch._dynamo.exc.Unsupported: Observed exception``,
with the message buried in its debug context. So the public functions (KDA, GDN, attention, MLA, DSA) check
their arguments in plain Python that Dynamo traces (types, ranks, shapes, dtypes, devices and Python
scalars: never a tensor value, so the checks become guards), catch their own ``ValueError`` / ``TypeError``
and hand it to :func:`deferred_error`: an eager call re-raises it at once; while compiling, the graph gets
the op ``kda_compile::argument_error`` in place of the real op, and the compiled function raises the same
exception (type and message) when it runs, ``fullgraph=True`` included. docs/op-input-errors.md has the
rules of every op in one table.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

import torch
from torch import Tensor

logger = logging.getLogger("kda_compile.ops")


@torch.library.custom_op("kda_compile::argument_error", mutates_args=())
def argument_error(like: Tensor, type_error: bool, message: str, o_shape: list[int],
                   state_shape: list[int]) -> tuple[Tensor, Tensor]:
    """Raises ``TypeError(message)`` / ``ValueError(message)`` when it runs.

    While compiling, a public function puts this op in the graph in place of its own op, with placeholder
    outputs of the shapes the call would have had (``o_shape`` in ``like``'s dtype, ``state_shape`` in
    float32; the caller derives its outputs from them), so that tracing the caller's code after the call
    goes on: the compiled function raises our own error, message and type unchanged, when it runs. The
    graph is guarded on the same shapes and flags, so calls with good arguments compile anew."""
    raise (TypeError if type_error else ValueError)(message)


@argument_error.register_fake
def _argument_error_fake(like, type_error, message, o_shape, state_shape):
    return like.new_empty(o_shape), like.new_empty(state_shape, dtype=torch.float32)


def _register_effect(qualname: str) -> None:
    """Mark the op as having a side effect, so that no graph pass drops it when its outputs are unused
    or empty (Inductor drops an op whose only output has no elements). The registration API moved between
    torch releases; without one the op still raises wherever its outputs are used."""
    try:
        from torch._higher_order_ops.effects import _EffectType
    except ImportError as exc:
        logger.debug("no effect registration for %s: %s", qualname, exc)
        return
    attempts = []
    register = getattr(torch.library, "_register_effectful_op", None)
    if register is not None:
        attempts.append(lambda: register(qualname, _EffectType.ORDERED))
    try:
        from torch._higher_order_ops import effects
        op = getattr(getattr(torch.ops, qualname.split("::")[0]), qualname.split("::")[1]).default
        attempts.append(lambda: effects._register_effectful_op(op, _EffectType.ORDERED))
    except (ImportError, AttributeError):
        pass
    for attempt in attempts:
        try:
            attempt()
            return
        except Exception as exc:  # an older or newer signature: try the next form
            logger.debug("effect registration of %s failed: %s", qualname, exc)


_register_effect("kda_compile::argument_error")


_raising = threading.local()  # .depth > 0 inside raising_argument_errors()


@contextlib.contextmanager
def raising_argument_errors() -> Iterator[None]:
    """Inside this block a public function raises its argument error at once, even while a compile is under way:
    a graph rewrite runs the function on its example values to learn whether the op takes the arguments (a
    refused site is left as the model wrote it), and a deferred error would read as a yes."""
    _raising.depth = getattr(_raising, "depth", 0) + 1
    try:
        yield
    finally:
        _raising.depth -= 1


def deferred_error(error: Exception, like, o_shape=(0,), state_shape=(0,)) -> tuple[Tensor, Tensor]:
    """The bad-argument ``error`` of a public function: raised now in an eager call; while Dynamo traces,
    returned as the placeholders ``(o, state)`` of :func:`argument_error`, which raises it when the compiled
    function runs. ``like``: a tensor argument of the call (placeholders take its device and, for ``o``, its
    dtype; anything else, e.g. the non-tensor that caused the error, gives a CPU float32 placeholder);
    ``o_shape`` / ``state_shape``: the shapes the call's outputs would have had where the arguments say
    them (``state`` is float32; a caller converts or views a placeholder into each of its outputs).

    Call it from the ``except`` clause that caught ``error``: the eager traceback then still points at the
    check that failed."""
    if not torch.compiler.is_compiling() or getattr(_raising, "depth", 0):
        raise error
    like = like.detach() if isinstance(like, Tensor) else torch.empty(0)
    return argument_error(like, isinstance(error, TypeError), str(error), list(o_shape), list(state_shape))


def sizes(t, ndim: int) -> tuple | None:
    """``t``'s shape when it is a tensor of rank ``ndim``, else None: what the placeholder shapes of a
    deferred error may be computed from (the bad argument may be anything)."""
    return tuple(t.shape) if isinstance(t, Tensor) and t.dim() == ndim else None
