"""Small utilities shared by every op folder: uniform argument errors, logged fallbacks, and
running autograd inside an op's reference backward.

Kept free of model and compiler knowledge (ops layer).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import math
import numbers
import os
import threading
from dataclasses import dataclass

import torch
from torch.fx.experimental.symbolic_shapes import guard_scalar

from kda_compile.ops import envs

logger = logging.getLogger("kda_compile.ops")


# ----------------------------------------------------------------------------------------------
# Errors: name the argument, the value, and what is accepted.
# ----------------------------------------------------------------------------------------------
def arg_error(name: str, value, accepted: str, *, kind: type[Exception] = ValueError) -> Exception:
    """Build the error raised for a bad argument: ``"<name> must be <accepted>, got <value>"``.

    Safe to call while Dynamo traces (``torch.compile``): a symbolic int / float value is formatted as
    its concrete value (the error path may specialise), so the message stays a plain string."""
    return kind(f"{name} must be {accepted}, got {plain(value)}")


def plain(value):
    """``value`` for an error message: symbolic ints / floats (and lists / tuples of them, e.g. a
    shape) as plain numbers, joined into a string by this function, never by an f-string of a list (which
    Dynamo keeps as a lazy format it cannot turn into the message). A symbolic number is specialised to its
    value (``guard_scalar``, which Dynamo traces: the error path is guarded on it); ``int()`` would keep it
    symbolic (a dynamic Python int argument, a size other than 0 / 1), and Dynamo cannot format that. Traced
    code sees a symbolic int as an ``int`` (not a ``torch.SymInt``), so every number goes through it."""
    if isinstance(value, (list, tuple, torch.Size)):
        return "[" + ", ".join(f"{plain(x)}" for x in value) + "]"
    if isinstance(value, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(value, bool):
        return guard_scalar(value)
    return value


def shown(value) -> str:
    """``repr(value)`` for an error message, numbers through :func:`plain`: traced code cannot take the repr of a
    symbolic number (under ``dynamic=True`` a Python float argument is one)."""
    if isinstance(value, (int, float, torch.SymInt, torch.SymFloat)):
        return f"{plain(value)}"
    return repr(value)


def describe(t) -> str:
    """A compact description of a tensor (shape, dtype, device) or any other value for errors."""
    if isinstance(t, torch.Tensor):
        return f"a {t.dtype} tensor of shape {plain(t.shape)} on {t.device}"
    return shown(t)


def check_tensor(name: str, t, *, ndim: int | None = None, dtypes=None, allow_none: bool = False):
    """Check that ``t`` is a tensor of the given rank and one of ``dtypes``; raise otherwise."""
    if t is None:
        if allow_none:
            return
        raise arg_error(name, None, "a tensor", kind=TypeError)
    if not isinstance(t, torch.Tensor):
        raise arg_error(name, type(t).__name__, "a torch.Tensor", kind=TypeError)
    if ndim is not None and t.dim() != ndim:
        raise arg_error(name, describe(t), f"a {ndim}-D tensor")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise arg_error(name, describe(t), f"of dtype {names}", kind=TypeError)


def values_checked(t: torch.Tensor) -> bool:
    """Whether the values of the index tensor ``t`` (indices, offsets) are checked in this call
    (docs/op-input-errors.md): always on the CPU, where reading them is one pass over host memory; on CUDA only
    with ``KDA_COMPILE_CHECK_INPUTS=1``, since the check reads them to the host, a device synchronisation per call
    (and no CUDA-graph capture)."""
    return t.device.type == "cpu" or envs.check_inputs()


def out_of_range_error(name: str, values: torch.Tensor, bad: torch.Tensor, accepted: str) -> ValueError:
    """The error for the tensor argument ``name`` whose entries flagged in ``bad`` (a bool tensor of its shape, with
    at least one True) are outside what is ``accepted``: names the first such entry, its value and the count.
    Reads the values (a device-to-host copy on CUDA: call it only where value checks run)."""
    where = [int(i) for i in torch.nonzero(bad)[0].tolist()]
    position = ", ".join(map(str, where))
    return ValueError(f"{name} must be {accepted}, got {int(values[tuple(where)])} at {name}[{position}] "
                      f"({int(bad.sum())} entries out of range)")


def finite_float(name: str, value, accepted: str):
    """``value`` as a finite Python float (bools refused), else the error naming ``name`` and ``accepted``; a
    symbolic float (traced arithmetic) passes through unchecked."""
    if isinstance(value, (torch.SymFloat, torch.SymInt)):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise arg_error(name, shown(value), accepted, kind=TypeError)
    value = float(value)
    if not -math.inf < value < math.inf:  # also False for NaN; comparisons trace where math.isfinite does not
        raise arg_error(name, value, accepted)
    return value


def positive_scale(value):
    """An attention's ``scale`` (Hugging Face's ``module.scaling``) as a finite positive Python float, else the
    error naming it; a symbolic float (traced arithmetic) passes through unchecked."""
    accepted = "a finite float > 0 (Hugging Face's module.scaling)"
    if isinstance(value, torch.SymFloat):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise arg_error("scale", shown(value), accepted, kind=TypeError)
    value = float(value)
    if not 0.0 < value < math.inf:  # also False for NaN
        raise arg_error("scale", value, accepted)
    return value


def check_attn_mask(attn_mask, full: tuple, device: torch.device, *, device_owner: str, dims: str) -> None:
    """An attention mask: None, or a bool / floating tensor on ``device`` (named ``device_owner`` in
    errors) broadcastable to ``full`` (named ``dims``, e.g. "[B, H, Sq, Sk]")."""
    if attn_mask is None:
        return
    check_tensor("attn_mask", attn_mask)
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise arg_error("attn_mask", describe(attn_mask), "a bool or floating-point tensor", kind=TypeError)
    if attn_mask.device != device:
        raise arg_error("attn_mask", describe(attn_mask), f"on {device_owner}'s device {device}")
    # Explicit comparisons (not `n in (1, f)`): Dynamo evaluates them on symbolic sizes.
    if attn_mask.dim() > 4 or any(n != 1 and n != f for n, f in zip(reversed(attn_mask.shape), reversed(full))):
        raise arg_error("attn_mask", describe(attn_mask), f"broadcastable to {dims} = {plain(full)}")


# ----------------------------------------------------------------------------------------------
# Fallbacks: a slower path is allowed only when logged with its reason; the report shows them.
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FallbackEvent:
    op: str  # e.g. "chunk_kda"
    chosen: str  # the implementation that ran, e.g. "reference"
    reason: str  # why the fast path was not taken


_fallbacks: dict[FallbackEvent, int] = {}
_fallbacks_lock = threading.Lock()


class StrictModeError(RuntimeError):
    """Strict mode refused a slower path: an op fallback here; a rewrite left alone, an eager fallback or a graph
    break in kda_compile's code (raised by kda_compile's backend and ``optimize()``)."""


_strict = threading.local()  # .depth > 0 inside strict_fallbacks()


@contextlib.contextmanager
def strict_fallbacks():
    """Inside this block (and process-wide under ``KDA_COMPILE_STRICT=1``) a fallback to a slower
    implementation raises :class:`StrictModeError` instead of running it."""
    _strict.depth = getattr(_strict, "depth", 0) + 1
    try:
        yield
    finally:
        _strict.depth -= 1


def record_fallback(op: str, chosen: str, reason: str) -> None:
    """Count a fallback; log a WARNING the first time a given (op, path, reason) happens. In strict mode
    (:func:`strict_fallbacks`) raise :class:`StrictModeError` instead."""
    if getattr(_strict, "depth", 0) or envs.strict():
        raise StrictModeError(f"kda_compile strict mode: {op} would run the {chosen} implementation: {reason}")
    event = FallbackEvent(op, chosen, reason)
    with _fallbacks_lock:
        first = event not in _fallbacks
        _fallbacks[event] = _fallbacks.get(event, 0) + 1
    if first:
        logger.warning("%s: running the %s implementation: %s", op, chosen, reason)


def fallback_events() -> dict[FallbackEvent, int]:
    """Every fallback seen in this process, with how many calls took it."""
    with _fallbacks_lock:
        return dict(_fallbacks)


def clear_fallback_events() -> None:
    with _fallbacks_lock:
        _fallbacks.clear()


# ----------------------------------------------------------------------------------------------
# Autograd inside an op.
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def autograd_inside_op():
    """Re-enable autograd inside a custom op's kernel.

    The dispatcher runs an op's backend kernel with the autograd keys excluded, so a reference
    backward that differentiates the reference forward would record nothing. This puts the
    autograd keys back for the duration of the block (and turns grad mode on). Used only by the
    reference backward kernels; fast backends compute gradients with their own kernels.
    """
    keys = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView)
    with contextlib.ExitStack() as stack:
        for key in keys:
            stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(key, False))
        stack.enter_context(torch.enable_grad())
        yield


def grads_by_autograd(run, inputs: dict, do: torch.Tensor, dht) -> tuple:
    """A reference backward: autograd through ``run(leaves) -> (o, final_state)`` (plain torch math on
    ``leaves``, the non-None ``inputs`` as fresh leaves), inside an op's backward kernel. Returns one
    gradient per entry of ``inputs``, in order: None for an absent input, zeros for one the outputs do not
    depend on. ``dht``: the final state's gradient, or None."""
    with autograd_inside_op():
        leaves = {name: t.detach().requires_grad_() for name, t in inputs.items() if t is not None}
        o, final = run(leaves)
        pairs = [(o, do)] + ([(final, dht.to(final.dtype))] if dht is not None else [])
        pairs = [(out, grad) for out, grad in pairs if out.requires_grad]  # no tokens: o depends on nothing
        got = dict.fromkeys(leaves)
        if pairs:
            outputs, grads = zip(*pairs)
            got = dict(zip(leaves, torch.autograd.grad(outputs, list(leaves.values()), grads, allow_unused=True)))
    incoming = [t.untyped_storage().data_ptr() for t in (do, dht) if t is not None and t.numel()]

    def own(grad, like):  # a gradient passed straight through (the state with no tokens) must not alias it
        if grad is None:
            return torch.zeros_like(like)
        return grad.clone() if grad.numel() and grad.untyped_storage().data_ptr() in incoming else grad
    return tuple(None if t is None else own(got[name], t) for name, t in inputs.items())


SUPPORTED_FLA = "0.6."  # the fla-core release whose internal functions the FLA backends call


def load_fla_internals(functions: dict[str, str], keywords: dict[str, set[str]] | None = None):
    """Import fla-core's internal functions, ``{name: "module.path:attribute"}``: ``(namespace, None)``, or
    ``(None, reason)`` when fla-core is missing, is another release than :data:`SUPPORTED_FLA`, lacks one of
    them, or (``keywords``: name -> the keyword arguments a caller passes) one lacks a keyword we pass (a
    release that renamed it is refused with the reason instead of failing inside a call)."""
    try:
        fla = importlib.import_module("fla")
    except Exception as exc:  # ImportError, or a broken install raising anything else
        return None, f"fla-core is not importable ({type(exc).__name__}: {exc}); install kda-compile[fla]"
    version = getattr(fla, "__version__", "unknown")
    if not version.startswith(SUPPORTED_FLA):
        return None, f"fla-core {version} found; the internals used here are those of fla-core {SUPPORTED_FLA}x"
    try:
        namespace = {}
        for name, where in functions.items():
            module, attribute = where.split(":")
            namespace[name] = getattr(importlib.import_module(module), attribute)
    except Exception as exc:
        return None, f"fla-core {version} is missing an internal function ({type(exc).__name__}: {exc})"
    for name, needed in (keywords or {}).items():
        missing = set(needed) - set(inspect.signature(namespace[name]).parameters)
        if missing:
            return None, f"fla-core {version}'s {name} lacks the arguments {sorted(missing)} this backend passes"
    logger.info("fla-core %s internals loaded: %s", version, ", ".join(functions))
    return namespace, None


def cuda_index(device: torch.device) -> int:
    """The CUDA device's index (the current device for a bare ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def device_capability(index: int) -> tuple[int, int]:
    """``torch.cuda.get_device_capability`` of one device, asked once: a prefill call's kernel choices ask
    several times, and each ask costs microseconds of host time."""
    return torch.cuda.get_device_capability(index)


def hopper_problem(t: torch.Tensor) -> str | None:
    """Why ``t``'s device cannot run our sm_90a kernels (warpgroup MMA, TMA; compiled for exactly that target), or
    None."""
    if not t.is_cuda:
        return "not a CUDA tensor"
    capability = device_capability(cuda_index(t.device))
    if capability != (9, 0):
        return f"needs an sm_90 GPU (warpgroup MMA), got sm_{''.join(map(str, capability))}"
    return None


def half_rows_problem(name: str, t: torch.Tensor) -> str | None:
    """Why the 16-bit tensor ``t`` (argument ``name``) cannot be copied row by row in 16-byte pieces (rows along the
    last dim contiguous, every other stride and the address 16-byte aligned), or None."""
    if t.stride(-1) != 1 or any(s % 8 for s in t.stride()[:-1]) or t.data_ptr() % 16:
        return f"{name}'s rows are not contiguous and 16-byte aligned (strides {tuple(t.stride())})"
    return None


def triton_interpreted() -> bool:
    """True under ``TRITON_INTERPRET=1``, where Triton kernels run on CPU tensors (read at every call: tests set it)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def sm_count(index: int) -> int:
    """The device's streaming multiprocessor count, asked once (the kernels' launch policies read it per call)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def dispatcher_needed(*tensors) -> bool:
    """Whether a call must go through the custom op rather than straight to its kernel: while
    Dynamo traces (the op must appear in the graph), under a dispatch mode (fake tensors, tracing,
    profilers that count ops) or a functorch transform, or when an input is a tensor subclass (a
    DTensor: the op's sharding rule runs it on the local shards). Otherwise eager inference (decode, and
    prefill without gradients; KDA, GDN and DSA) skips the dispatcher's Python path, which costs more host time
    than a decode kernel takes on the GPU (and more than a short prefill's kernels with the KDA prefill op's empty
    residual outputs; docs/performance.md)."""
    return (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._are_functorch_transforms_active()
            or any(t is not None and type(t) not in _PLAIN_TENSORS for t in tensors))


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def gradients_needed(*tensors) -> bool:
    """Whether autograd will differentiate a call: grad mode on and an input (None allowed) requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def on_device(index: int):
    """``torch.cuda.device(index)``, or nothing when that device is already current (the usual case: the
    switch and switch back cost host time on every launch). Callers hold CUDA tensors, so CUDA is initialised
    and the current device is read straight from the binding ``torch.cuda.current_device`` wraps."""
    return contextlib.nullcontext() if _current_device() == index else torch.cuda.device(index)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints. Launchers that run per decode step use this and ``next_power_of_2``
    rather than triton's: in Triton 3.6 those are constexpr functions, whose host-side call goes through
    Triton's wrapper machinery on every launch."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, as ``triton.next_power_of_2`` (which gives 0 for n <= 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def module_unusable(module: str) -> str | None:
    """None when ``module`` (e.g. a Triton kernel module) imports, else why not. Call it through a
    cache: the answer does not change within a process."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, or a triton too old for the kernels
        return f"triton is not usable ({type(exc).__name__}: {exc})"
    return None


@functools.cache
def triton_compile_errors() -> tuple[type[BaseException], ...]:
    """Triton's compile-time failures (compiler front end, ptxas, resources, autotuner with no valid config)."""
    import triton.compiler.errors as compiler_errors
    import triton.runtime.errors as runtime_errors

    names = [(compiler_errors, "CompilationError"), (runtime_errors, "OutOfResources"),
             (runtime_errors, "PTXASError"), (runtime_errors, "AutotunerError")]
    return tuple(getattr(module, name) for module, name in names if hasattr(module, name))


def compile_failure_reason(kernels: str, error: BaseException) -> str:
    """The fallback reason for ``kernels`` that did not compile: the error's type and its last line (where
    Triton's messages say what failed)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{kernels} failed to compile: {type(error).__name__}: {lines[-1][:300] if lines else ''}"


def empty_like_absent(ref: torch.Tensor) -> torch.Tensor:
    """The tensor an op returns in place of an absent optional output (schemas cannot return None)."""
    return ref.new_empty(0)


# ----------------------------------------------------------------------------------------------
# torch.compile's caches and our ops
# ----------------------------------------------------------------------------------------------
CACHE_TAG_PREFIX = "kda_compile-ops-"


def ops_source_digest() -> str:
    """A digest of the source of every module and CUDA source under ``kda_compile.ops`` (schemas, fake and
    autograd code, kernels): it changes whenever what a compiled graph of our ops would do changes."""
    import hashlib
    import pathlib

    root = pathlib.Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cu", ".cuh")):  # kernels' CUDA too
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def tag_compile_caches() -> None:
    """Keep torch.compile's on-disk caches of different versions of our ops apart.

    AOTAutograd's and Inductor's caches key a custom op by its name only, not by its schema, fake or
    autograd code; a backward graph cached with one version of ``kda_compile`` would be replayed by
    another and call the op with the old arguments (seen: a changed residual count failed with
    "Expected a value of type 'Tensor' for argument 'res5'"). torch's ``cache_key_tag`` enters every
    compile cache key; we add the digest of our ops' source to it (once; other tags are kept).
    """
    config = getattr(torch.compiler, "config", None)
    if config is None or not hasattr(config, "cache_key_tag"):
        logger.warning("this torch has no torch.compiler.config.cache_key_tag: compile caches written by "
                       "another version of kda_compile's ops may be reused; clear them after upgrading")
        return
    tags = [t for t in config.cache_key_tag.split() if not t.startswith(CACHE_TAG_PREFIX)]
    config.cache_key_tag = " ".join(tags + [CACHE_TAG_PREFIX + ops_source_digest()])


def is_dtensor(tensor) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (without importing torch.distributed)."""
    cls = type(tensor)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed.tensor")
