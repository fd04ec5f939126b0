"""``kda_compile.optimize``: torch.compile with the kda_compile backend and a rewrite config.

Recompile budget. Dynamo keeps the compiled entries of a function in a cache on its code object,
shared by everything that runs that code: every instance of a model class, and with Hugging Face
models every model class (their ``forward`` goes through the same decorator ``wrapper``). Each
``optimize()`` result has a backend of its own (its report is its own), so it adds its own
entries: a result called at several prompt lengths, or running ``generate``, needs a few entries
(how many was measured: docs/usage.md, section "The recompile budget"), and Dynamo's default
``recompile_limit`` of 8 entries a code object fills after a few models, after which the next
optimized model of that class would run eagerly, silently.

So each call of an ``optimize()`` result runs with ``torch._dynamo.config.recompile_limit`` raised
to :data:`ENTRIES_PER_OPTIMIZE` (8: Dynamo's own default, the budget a lone ``torch.compile`` of
that code would have, leaving room for recompiles on a dtype, a train/eval switch or a batch size)
times the number of ``optimize()`` results made in this process, or the user's value if that is
higher. The bound stays finite:
``torch._dynamo.config.accumulated_recompile_limit`` (Dynamo's cap per code object, 256 by
default, checked before ``recompile_limit``) is left alone, since a program needing more entries
than that on one code object is recompiling without end; it is reported like any fallback.
The limit is read when Dynamo evaluates a frame, so setting it for the duration of the call
covers every frame the call compiles; it is restored afterwards, so code outside these calls sees
Dynamo's config as the user left it (torch 2.13 keeps Dynamo's config per thread; under torch
2.11, whose config is process-wide, another thread compiling during such a call sees the raised
value too).

Data-dependent MoE code. Hugging Face's MoE blocks route tokens with ``nonzero`` /
``torch.where(mask)`` (a data-dependent output shape) and read ``.item()`` / ``.tolist()`` of
expert ids or counts (a data-dependent scalar): by default Dynamo breaks the graph at each. With
``Config.capture_data_dependent_ops`` (default on) the frames a call traces see Dynamo's
``capture_scalar_outputs`` and ``capture_dynamic_output_shape_ops`` switched on: a
kda_compile.compile_scope scope, applied when Dynamo starts compiling a frame of the call and undone
when that compile ends, so a call Dynamo serves from its cache sets nothing. The routing is captured
with unbacked sizes, which Inductor compiles (what that did to tiny MoE models: docs/usage.md, section "The
recompile budget"). Breaks that
remain (a Python branch on such a value, a loop over a tensor of data-dependent length) are
listed by ``report()`` with Dynamo's reason and the model line (``report.GraphBreak``). Known
limit: where an op's output shape needs the data to be traced further (e.g. ``torch.split`` by the
``.tolist()`` of a ``bincount``), Dynamo raises ``GuardOnDataDependentSymNode`` instead of breaking
the graph; the error then carries a note naming ``Config(capture_data_dependent_ops=False)``.
``torch.compile(model, backend="kda_compile")`` captures them too: the backend's ``backend_ctx_ctor`` (the
context Dynamo enters around each call of a compiled callable) enters the same scope, and
kda_compile.backend forwards it through ``torch._TorchCompileWrapper``, which would drop it.
"""
from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable

import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from kda_compile import (cache_checks, compile_scope, cuda_graphs, decode_guards, packed_documents, process_hooks,
                         sliding_window_cache, strict)
from kda_compile.ops._common import strict_fallbacks
from kda_compile.backend import CAPTURE_SCOPE, KdaCompileBackend
from kda_compile.config import Config
from kda_compile.report import attach, enter_calls_of, exit_calls_of, install_fallback_handler, report

logger = logging.getLogger("kda_compile.optimize")

ENTRIES_PER_OPTIMIZE = 8  # Dynamo's default recompile_limit: the entries one optimize() result may add

_made = [0]  # optimize() results made in this process
_made_lock = threading.Lock()
_logged_limit = [0]


def recompile_limit() -> int:
    """The ``torch._dynamo.config.recompile_limit`` a call of an ``optimize()`` result runs under:
    :data:`ENTRIES_PER_OPTIMIZE` per ``optimize()`` result made in this process, or the user's
    value if higher. Dynamo checks ``accumulated_recompile_limit`` first, so that stays the cap."""
    return max(torch._dynamo.config.recompile_limit, ENTRIES_PER_OPTIMIZE * _made[0])


def _scopes(config: Config) -> dict[str | None, compile_scope.Scope]:
    """What the frames a call traces see (kda_compile.compile_scope), by the call's phase; ``"static decode"``
    for a decode step into a static cache under CUDA graphs (traced with static shapes: a new batch size is a
    new captured graph, not a dynamic one that CUDA graphs would record per size)."""
    capture = CAPTURE_SCOPE.dynamo if config.capture_data_dependent_ops else ()
    scopes = {phase: compile_scope.Scope(capture, phase) for phase in (None, cuda_graphs.PREFILL, cuda_graphs.DECODE)}
    scopes[STATIC_DECODE] = compile_scope.Scope(capture + (("automatic_dynamic_shapes", False),), cuda_graphs.DECODE)
    return scopes


STATIC_DECODE = "static decode"


def _run_compiled(compiled: Callable[..., Any], backend: KdaCompileBackend,
                  cudagraphs_requested: bool = False, module: Any = None,
                  strict_target: Any = None) -> Callable[..., Any]:
    """``compiled`` run with the recompile budget raised for the call and Dynamo's eager-fallback
    warnings attributed to ``backend``'s report; a static cache passed to the call is checked against it
    first (kda_compile.cache_checks; ``module``'s input embeddings give the dtype). What the call's compiles
    need (captured data-dependent ops, the phase, static shapes for a CUDA-graph decode step) is a
    kda_compile.compile_scope scope, applied only if Dynamo compiles. On every call's path: reading or setting a
    Dynamo config value costs microseconds, so this reads one and sets it only to raise it. With
    ``Config.strict`` the call runs under kda_compile.strict's checks (``strict_target``: what ``report()``
    answers for). A call that packs documents into one row gets their offsets for the linear-attention layers
    (kda_compile.packed_documents; docs/packed-documents.md)."""

    capture = backend.config.capture_data_dependent_ops
    scopes = _scopes(backend.config)
    warm = decode_guards.WarmDecodeSteps() if backend.config.skip_decode_guards else None
    if backend.config.strict:
        compiled = _strictly(compiled, strict_target)
    cuda_graphs.attach_skip_handler()

    @functools.wraps(compiled)  # keeps _torchdynamo_orig_callable and the signature (generate reads it)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced from inside another compiled region
            return compiled(*args, **kwargs)
        if module is not None:  # packed documents: their offsets for the linear-attention layers
            kwargs = packed_documents.with_document_offsets(module, kwargs)
        cache = cuda_graphs.cache_of_call(kwargs, None)
        phase = cuda_graphs.phase_of_call(args, kwargs) if cache is not None or cudagraphs_requested else None
        compileable = cache is not None and phase is not None and cuda_graphs.is_compileable_cache(cache)
        if compileable:
            cache_checks.check_static_cache(cache, args, kwargs, lambda: _embedding_dtype(module),
                                            prefill=phase == cuda_graphs.PREFILL)
        dynamo = torch._dynamo.config
        prior = dynamo.recompile_limit
        limit = ENTRIES_PER_OPTIMIZE * _made[0]
        raise_it = limit > prior
        if raise_it and limit != _logged_limit[0]:
            _logged_limit[0] = limit
            logger.debug("calls of optimize() results run with torch._dynamo.config.recompile_limit=%d "
                         "(%d per optimize() result x %d; was %d; accumulated_recompile_limit=%d stays the cap)",
                         limit, ENTRIES_PER_OPTIMIZE, _made[0], prior, dynamo.accumulated_recompile_limit)
        install_fallback_handler()
        enter_calls_of(backend)
        if raise_it:
            dynamo.recompile_limit = limit
        try:
            if cudagraphs_requested:
                return _run_for_cuda_graphs(compiled, args, kwargs, phase, cache if compileable else None, scopes,
                                            warm, module)
            with compile_scope.entered(scopes[phase]):
                return compiled(*args, **kwargs)
        except GuardOnDataDependentSymNode as exc:
            if capture:  # Dynamo raises, instead of breaking the graph, where an op's result shape needs the data
                exc.add_note("kda_compile.optimize traced this call with torch._dynamo.config.capture_scalar_outputs "
                             "and capture_dynamic_output_shape_ops on; Config(capture_data_dependent_ops=False) "
                             "leaves them off (Dynamo then breaks the graph there instead)")
            raise
        finally:
            if raise_it:
                dynamo.recompile_limit = prior
            exit_calls_of()

    return run


def _strictly(compiled: Callable[..., Any], target: Any) -> Callable[..., Any]:
    """``compiled`` under strict mode (kda_compile.strict): op fallbacks raise, a StrictModeError the backend
    raised reaches the caller unwrapped, and the eager fallbacks and our own graph breaks of the call raise."""

    @functools.wraps(compiled)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            with strict_fallbacks():
                result = compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as exc:
            inner = strict.unwrap(exc)
            if inner is exc:
                raise
            raise inner from None
        strict.check_call_events(report(target))
        return result

    return run


def _embedding_dtype(module: Any) -> torch.dtype | None:
    get = getattr(module, "get_input_embeddings", None)
    weight = getattr(get(), "weight", None) if callable(get) else None
    return weight.dtype if isinstance(weight, torch.Tensor) else None


def _precomputed_masks(kwargs: dict) -> bool:
    """Whether the call's attention masks were built outside it (``generate()`` does so for static caches:
    a dict of masks per attention kind, or one 4-D mask)."""
    mask = kwargs.get("attention_mask")
    return isinstance(mask, dict) or (isinstance(mask, torch.Tensor) and mask.dim() == 4)


def _run_for_cuda_graphs(compiled: Callable[..., Any], args: tuple, kwargs: dict, phase: str | None,
                         cache: Any, scopes: dict, warm: decode_guards.WarmDecodeSteps | None = None,
                         module: Any = None) -> Any:
    """One call of an ``optimize()`` result compiled with CUDA graphs (kda_compile.cuda_graphs): its phase
    told to the backend, a decode step into a static cache traced with static shapes (``scopes``:
    :func:`_scopes`), and after a prefill the cache it allocated marked static for the decode graphs. HF's
    sliding-window layers of the cache are made capturable (kda_compile.sliding_window_cache); a decode step that
    gets its masks from outside then replays one graph too, and their host lengths are advanced after it.
    ``phase``: the call's (:func:`cuda_graphs.phase_of_call`); ``cache``: its compileable cache
    (:func:`cuda_graphs.cache_of_call`, None when it has none), both found once by the caller. ``warm``
    (``Config.skip_decode_guards``): a static decode step that ran before runs with only the differentiating
    guards (kda_compile.decode_guards; ``module``'s training flag is part of its key)."""
    sliding = sliding_window_cache.make_capturable(cache)
    static_decode = (phase == cuda_graphs.DECODE and cuda_graphs.is_static_cache(cache)
                     and (not sliding or _precomputed_masks(kwargs)))
    lengths = sliding_window_cache.host_lengths(sliding) if sliding and phase == cuda_graphs.DECODE else None
    with compile_scope.entered(scopes[STATIC_DECODE if static_decode else phase]):
        if warm is not None and static_decode:
            result = warm.run(lambda: compiled(*args, **kwargs), cache, decode_guards.step_key(args, kwargs, module))
        else:
            result = compiled(*args, **kwargs)
    if lengths is not None:
        sliding_window_cache.advance_host_lengths(sliding, lengths, 1)
    if phase == cuda_graphs.PREFILL:
        cuda_graphs.mark_cache_static(cuda_graphs.cache_of_call(kwargs, result))
    return result


def _keep_generate_from_compiling_again(module: Any) -> None:
    """Hugging Face's ``generate`` compiles the model's ``__call__`` itself (plain Inductor, CUDA graphs)
    whenever it decodes into a static cache on a GPU, unless ``generation_config.disable_compile``. Around an
    ``optimize()``'d forward that second compile traces through ours and replaces it: the decode graph then
    runs none of our rewrites and misses the static cache marking (Inductor skips its CUDA graphs). The forward
    is compiled already, so that auto-compile is switched off for this model (logged)."""
    config = getattr(module, "generation_config", None)
    if config is None or not hasattr(config, "disable_compile") or config.disable_compile:
        return
    config.disable_compile = True
    logger.info("kda_compile.optimize: %s.generation_config.disable_compile set to True: the forward is compiled "
                "by kda_compile, and generate() would otherwise compile it again with plain Inductor for decoding "
                "into a static cache (docs/cuda-graphs.md)", type(module).__name__)


def _asks_for_cuda_graphs(compile_kwargs: dict) -> bool:
    """Whether torch.compile's ``mode`` / ``options`` turn Inductor's CUDA graphs on."""
    from kda_compile.backend import inductor_config_patches

    mode, options = compile_kwargs.get("mode"), compile_kwargs.get("options")
    try:
        return cuda_graphs.cudagraphs_requested(inductor_config_patches(mode, options))
    except (TypeError, ValueError):
        return False  # torch.compile reports a bad mode or options itself


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
        ``torch.compile(model, backend=<kda_compile with config>, **compile_kwargs)`` (for a
        function, a wrapper of it), whose calls run with a raised Dynamo ``recompile_limit`` (see
        below). ``kda_compile.report(result)`` lists what each compiled graph rewrote and left
        alone, and the frames Dynamo ran eagerly instead (a recompile limit hit, a suppressed
        compile error); such a fallback is also logged once per code object at WARNING.

    Several models (or instances of one model class) optimized in one process share Dynamo's
    per-code-object cache, so each call raises ``torch._dynamo.config.recompile_limit`` for its
    duration to 8 entries per ``optimize()`` result made so far (or keeps the user's value if
    higher; ``accumulated_recompile_limit`` stays the cap) and restores it after; see the
    module docstring for why. Calls that still exceed it run eagerly and appear in the report.
    With ``Config.capture_data_dependent_ops`` (default) the calls also run with Dynamo's
    ``capture_scalar_outputs`` / ``capture_dynamic_output_shape_ops`` on, so MoE routing
    (``nonzero``, ``.item()``, ``.tolist()``) is captured; the graph breaks that remain are listed by
    ``report()`` with the model line and Dynamo's reason.
    ``dynamic`` keeps torch.compile's default (None: a second input shape recompiles once with
    dynamic shapes, after which further lengths reuse that graph).
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
    graphs = _asks_for_cuda_graphs(compile_kwargs)
    if config is not None and config.skip_decode_guards:
        decode_guards.require_available()
        if not graphs:
            raise ValueError("Config.skip_decode_guards=True applies to CUDA-graph decode steps: pass "
                             "mode='reduce-overhead' (or options turning Inductor's CUDA graphs on), got "
                             f"mode={compile_kwargs.get('mode')!r}, options={compile_kwargs.get('options')!r}")
    process_hooks.install()
    backend = KdaCompileBackend(config)
    compiled = torch.compile(model, backend=backend, **compile_kwargs)
    original = getattr(model, "__self__", None)  # a bound method's module also answers report()
    module = model if isinstance(model, torch.nn.Module) else original
    if isinstance(compiled, torch.nn.Module):  # an OptimizedModule: its forward runs Dynamo
        compiled.forward = _run_compiled(compiled.forward, backend, graphs, module, model)
    else:
        compiled = _run_compiled(compiled, backend, graphs, module, model)
    with _made_lock:
        _made[0] += 1
    install_fallback_handler()
    _keep_generate_from_compiling_again(module)
    attach(compiled, backend, model, *([original] if original is not None else []))
    return compiled
