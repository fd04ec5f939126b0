"""Which graphs of a backend belong to a ``torch.compile`` result: the frame each graph was traced from
(``graph 0/1 of LlamaForCausalLM.forward``), and the backend and target behind a compiled object, so that
``kda_compile.report(torch.compile(model, backend="kda_compile"))`` answers for that model only. Read from
Dynamo's internals, each behind a fallback (kda_compile.report's docstring)."""
from __future__ import annotations

import inspect
import re
import types
import weakref
from typing import Any, Callable

import torch

from kda_compile.passes.report import GraphReport, TracedFrame

_RESUME = re.compile(r"^(?:torch_dynamo_resume_in_)+(.+?)(?:_at_(\d+))+$")  # Dynamo's names for resume functions


def traced_frame() -> TracedFrame | None:
    """The root frame of the graph Dynamo is compiling, read from Dynamo's current instruction translator
    (the backend runs inside the trace). None outside a Dynamo trace (a backend called on an FX graph by
    hand) or where a torch version keeps it elsewhere: the graph is then only left unnamed."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        root = InstructionTranslator.current_tx().output.root_tx
        code, self_obj = root.f_code, root.f_locals.get("self")
    except Exception:  # noqa: BLE001  (only the report's naming depends on it)
        return None
    return frame_of(code, self_obj)


def frame_of(code: types.CodeType, self_obj: Any = None) -> TracedFrame:
    """The :class:`TracedFrame` of a frame running ``code`` with ``self_obj`` as its ``self``.

    A method is named ``Class.attribute`` after the attribute of ``self``'s class that runs the code:
    Hugging Face's forward runs its decorator's ``wrapper`` code, yet is ``LlamaForCausalLM.forward``.
    A function is named by its qualified name. A resume function (Dynamo's continuation of a frame
    after a graph break) is named after the code it continues, with the line it resumes at."""
    match = _RESUME.match(code.co_name)
    code_name = match.group(1) if match else code.co_name
    if self_obj is not None:
        cls = type(self_obj)
        name = f"{cls.__name__}.{_method_name(cls, code, code_name, resumed=match is not None)}"
    else:
        name = code_name if match else getattr(code, "co_qualname", code.co_name)
    if match:
        name += f", resumed at line {match.group(2)}"
    return TracedFrame(name, code_name, code.co_filename, match is not None, _weak(self_obj), _weak(code))


def _method_name(cls: type, code: types.CodeType, code_name: str, resumed: bool) -> str:
    """The attribute of ``cls`` whose function runs ``code`` (or, for a resume function, the code it
    continues), ``forward`` first since decorated methods share their decorator's code; else ``code_name``."""

    def runs(value: Any) -> bool:
        own = getattr(value, "__code__", None)
        if not isinstance(own, types.CodeType):
            return False
        if resumed:
            return own.co_name == code_name and own.co_filename == code.co_filename
        return own is code

    for name in ("forward", code_name):
        if runs(inspect.getattr_static(cls, name, None)):
            return name
    for klass in cls.__mro__:
        for name, value in vars(klass).items():
            if runs(value):
                return name
    return code_name


def traced_for(target: Any) -> Callable[[TracedFrame | None], bool]:
    """Whether a graph traced from a frame belongs to ``target``: for a module, its frames and its
    submodules' (a graph break inside a layer makes Dynamo compile that layer's frame on its own); for a
    function, its frames and their continuations after a graph break; for another object, its methods."""
    if isinstance(target, torch.nn.Module):
        modules = {id(m) for m in target.modules()}
        return lambda frame: _owner(frame) is not None and id(_owner(frame)) in modules
    code = getattr(target, "__code__", None)
    if isinstance(code, types.CodeType):
        return lambda frame: frame is not None and frame.owner is None and (
            _deref(frame.code) is code
            or (frame.resumed and frame.code_name == code.co_name and frame.filename == code.co_filename))
    return lambda frame: _owner(frame) is not None and _owner(frame) is target


def torch_compiled(obj: Any) -> tuple[Any, str, Any] | None:
    """(the backend, its name, the model or function compiled) for a result of ``torch.compile``, a module
    whose ``.compile()`` was called, or a module whose ``forward`` attribute is a torch.compile result;
    None for anything else. Read from the Dynamo context torch.compile wraps around the callable."""
    candidates = [(obj, _original(obj))]
    if isinstance(obj, torch.nn.Module):
        candidates += [(getattr(obj, "_compiled_call_impl", None), obj), (vars(obj).get("forward"), obj)]
    for candidate, target in candidates:
        callback = _dynamo_callback(candidate)
        if callback is not None:
            compiler, name = _innermost_backend(callback)
            return compiler, name, target
    return None


def _original(compiled: Any) -> Any:
    """What torch.compile was given: an OptimizedModule's module, a compiled function's function (a
    bound method's object: its frames have it as ``self``)."""
    original = getattr(compiled, "_orig_mod", None)
    if original is not None:
        return original
    while hasattr(compiled, "_torchdynamo_orig_callable"):
        compiled = compiled._torchdynamo_orig_callable
    return getattr(compiled, "__self__", compiled) if inspect.ismethod(compiled) else compiled


def _dynamo_callback(fn: Any) -> Any:
    """The frame callback of the Dynamo context around ``fn`` (an OptimizedModule keeps its context;
    a compiled function holds it in its closure), or None."""
    context = getattr(fn, "dynamo_ctx", None)
    if context is not None:
        return getattr(context, "callback", None)
    if not hasattr(fn, "_torchdynamo_orig_callable"):
        return None
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        for candidate in (value, getattr(value, "callback", None)):
            if hasattr(candidate, "_torchdynamo_orig_backend"):
                return candidate
    return None


def _innermost_backend(callback: Any) -> tuple[Any, str]:
    """The backend torch.compile was given, under Dynamo's wrappers, and its name."""
    while hasattr(callback, "_torchdynamo_orig_backend"):
        callback = callback._torchdynamo_orig_backend
    compiler = getattr(callback, "compiler_fn", callback)  # torch.compile's _TorchCompileWrapper
    name = getattr(callback, "compiler_name", None) or getattr(compiler, "__name__", type(compiler).__name__)
    return compiler, str(name)


def reuse_note(backend: Any, target: Any, graphs: tuple[GraphReport, ...]) -> tuple[str, ...]:
    """Dynamo runs a module with the graphs it traced for another instance of its class whenever their
    guards pass, and traces nothing for it: say so instead of leaving a compiled model's report empty."""
    if graphs or not isinstance(target, torch.nn.Module):
        return ()
    cls = type(target)
    if not any(type(_owner(g.frame)) is cls for g in list(backend.reports)):
        return ()
    return (f"no graph was traced for this {cls.__name__}: Dynamo runs it with the graphs it traced for another "
            f"{cls.__name__} where their guards pass (kda_compile.report() lists every graph)",)


def _owner(frame: TracedFrame | None) -> Any:
    return _deref(frame.owner) if frame is not None else None


def _deref(ref: Callable[[], Any] | None) -> Any:
    return ref() if ref is not None else None


def _weak(obj: Any) -> Callable[[], Any] | None:
    if obj is None:
        return None
    try:
        return weakref.ref(obj)
    except TypeError:
        return None
