"""Trace-time substitution: Dynamo traces ``kda_compile.ops`` wherever model code calls a known
KDA entry point.

Hugging Face's Kimi-Linear (models/kimi_linear/modeling_kimi_linear.py, transformers 5.17 to
5.23) writes::

    core_attn_out, last_recurrent_state = chunk_kimi_delta_attention(       # prefill, training
        query, key, value, g=g, beta=beta, initial_state=recurrent_state,
        output_final_state=cache_params is not None, use_qk_l2norm_in_kernel=True, **kwargs)
    core_attn_out, last_recurrent_state = recurrent_kimi_delta_attention(   # decode: one token, a cache
        query, key, value, g=g, beta=beta, initial_state=recurrent_state, ...same keywords...)

Each name holds HF's wrapper (``use_kernel_func_from_hub_with_fallback``), which bound at import
either FLA's ``chunk_kda`` / ``fused_recurrent_kda`` (when ``fla`` was importable: a graph break
at every call, FLA marks them ``torch.compiler.disable``) or the torch reference kept as
``wrapper.__wrapped__`` (Dynamo unrolls its chunk loop, specialised on the length). Once
kda_compile is in use (its hooks installed: kda_compile/process_hooks.py), Dynamo traces instead::

    core_attn_out, last_recurrent_state = kda_compile.ops.chunk_kda(           # or fused_recurrent_kda
        query, key, value, g, beta, initial_state=recurrent_state.float(),
        output_final_state=cache_params is not None, use_qk_l2norm_in_kernel=True)

Entry points substituted (each object once; an alias is the same object):

- FLA's ``chunk_kda`` / ``fused_recurrent_kda`` (``fla.ops.kda`` and its submodules, ``fla.ops``,
  ``fla``) -> ``chunk_kda`` / ``fused_recurrent_kda`` with the same arguments.
- HF's ``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention`` torch references
  (``wrapper.__wrapped__``) -> ``chunk_kda`` / ``fused_recurrent_kda``: pre-activated g and beta,
  scale ``K ** -0.5``, ``chunk_size`` kept when 16/32/64 (any other size is the same math: 64), the
  initial state cast to float32 as HF does, HF's extra keywords ignored as HF ignores them.
- FLA's ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` and their aliases
  ``chunk_gdn`` / ``fused_recurrent_gdn`` (``fla.ops.gated_delta_rule`` and its submodules, ``fla.ops``,
  ``fla``) -> kda_compile's GDN functions of the same names, same arguments (``gk`` / ``gv`` and
  ``cp_context`` other than None trace FLA's own function: logged).
- HF's gated-delta-rule torch references ``torch_chunk_gated_delta_rule`` /
  ``torch_recurrent_gated_delta_rule`` (qwen3_next, qwen3_5, qwen3_5_moe, olmo_hybrid, qwen4_exp)
  -> ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` with the per-head gate
  ``g [B, T, HV]`` as it is; grouped value heads read q/k head ``h // (HV // H)``, as HF's
  ``repeat_interleave`` does. (The GDN ops choose their kernels per call: FLA's GDN kernels on CUDA,
  docs/gdn.md.)
- HF's wrappers (the module-level names) -> what the wrapper bound, mapped as above, after HF's
  filtering of the keywords; a GDN wrapper bound to FLA becomes the GDN ops too.
- HF's ``causal_conv1d_update`` of the same families (the decode step's short convolution) ->
  ``causal_conv1d_update``, one launch with the state rolled in place (substitution/conv_update.py).

Returns are the entry points': ``(o in q's dtype, float32 final state, or None unless
output_final_state)``. FLA arguments given by position are bound by FLA's own parameter order, so
a FLA release that reorders parameters is still mapped by name; a FLA argument kda_compile does
not take, at a value other than its default, makes the call trace the original (a logged graph
break).

Switches:

- ``KDA_COMPILE_SUBSTITUTION=0`` (or false/off/no) when kda_compile installs its hooks (first ``optimize()``
  or backend use: kda_compile/process_hooks.py): nothing is registered; Dynamo traces every entry
  point as it would without kda_compile.
- ``Config(kda_substitution=False)``: registration is process-wide (Dynamo has no per-compile
  registry), so each substitute asks, while Dynamo traces, which backend the graph is being
  compiled for. For a ``kda_compile`` backend (``optimize()``, ``KdaCompileBackend``) whose config
  has the switch off, the substitute calls the original function (an unregistered copy of it),
  so Dynamo traces exactly the original code. No extra guard or recompilation: Dynamo's cache
  entries are already per backend. Any other backend (Inductor, aot_eager, ``explain``) gets the
  substitution.

Eager execution is never changed: substitution only tells Dynamo what to trace.

Modules imported after kda_compile (``fla``, the HF modeling modules above) are registered as soon
as they finish executing, through an import hook that watches only those module names.

This module registers the substitutes (``install``, the import hook; registry.py keeps what is
registered) and reads HF's wrappers (``hf_bound_implementation``, ``hf_torch_path``); the substitutes
themselves, with the trace-time decisions above, are in substitution/substitutes.py.

The backend lookup (substitution/substitutes.py) reads Dynamo internals (the tracer's ``output.compiler_fn`` and the
``_torchdynamo_orig_backend`` / ``compiler_fn`` wrappers, present in torch 2.1 to 2.13); when they
are missing it answers "no kda_compile config" and the substitution stays on.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import inspect
import logging
import sys
import types
from typing import Any, Callable, Iterator

from kda_compile.ops import envs
from kda_compile.passes.delta_rule import probe as delta_rule_probe  # look-alike functions, probed
from kda_compile.passes.dsa import qsa_indexer  # QSA indexers, registered with the entry points below
from kda_compile.passes.substitution import conv_update  # HF's causal_conv1d_update: the decode conv
from kda_compile.passes.substitution import moe_experts  # HF's grouped-GEMM experts, likewise
from kda_compile.passes.substitution.documents import register_conv_substitutes  # per-document causal conv1d
from kda_compile.passes.substitution.registry import lock, register
from kda_compile.passes.substitution.substitutes import (HF_FAMILIES, HfFamily, _fla_chunk_substitute,
                                                         _fla_gdn_chunk_substitute, _fla_gdn_recurrent_substitute,
                                                         _fla_recurrent_substitute, _hf_wrapper_substitute)

logger = logging.getLogger("kda_compile.passes.kda_substitution")

ENV_SWITCH = envs.SUBSTITUTION

FLA_MODULES = ("fla.ops.kda", "fla.ops.kda.chunk", "fla.ops.kda.fused_recurrent", "fla.ops", "fla")
FLA_GDN_MODULES = ("fla.ops.gated_delta_rule", "fla.ops.gated_delta_rule.chunk",
                   "fla.ops.gated_delta_rule.fused_recurrent", "fla.ops", "fla")


def substitution_enabled_by_env() -> bool:
    """Whether ``KDA_COMPILE_SUBSTITUTION`` allows registering the substitutes (default: yes). An unknown value is
    logged and leaves substitution on: the switch only turns an optimisation off."""
    try:
        return envs.substitution()
    except ValueError as error:
        logger.warning("%s; substitution stays on", error)
        return True


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------
def _register_fla() -> None:
    kda_makers = {"chunk_kda": _fla_chunk_substitute, "fused_recurrent_kda": _fla_recurrent_substitute}
    gdn_makers = {"chunk_gated_delta_rule": _fla_gdn_chunk_substitute, "chunk_gdn": _fla_gdn_chunk_substitute,
                  "fused_recurrent_gated_delta_rule": _fla_gdn_recurrent_substitute,
                  "fused_recurrent_gdn": _fla_gdn_recurrent_substitute}
    for module_name, makers in [*((m, kda_makers) for m in FLA_MODULES), *((m, gdn_makers) for m in FLA_GDN_MODULES)]:
        module = sys.modules.get(module_name)
        for name, make in makers.items():
            fn = getattr(module, name, None) if module is not None else None
            if fn is not None:
                entry = f"fla {name}"
                register(entry, f"{module_name}.{name}", fn, lambda make=make, fn=fn, entry=entry: make(entry, fn))


_CHUNK_PARAMETERS = ("query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state",
                     "use_qk_l2norm_in_kernel", "kwargs")
_RECURRENT_PARAMETERS = ("query", "key", "value", "g", "beta", "initial_state", "output_final_state",
                         "use_qk_l2norm_in_kernel", "kwargs")
_HF_DEFAULTS = {"chunk_size": 64, "initial_state": None, "output_final_state": False,
                "use_qk_l2norm_in_kernel": False}


def _closure_values(fn: Callable) -> dict[str, Any]:
    cells = fn.__closure__ or ()
    values = {}
    for name, cell in zip(fn.__code__.co_freevars, cells):
        try:
            values[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    return values


def hf_bound_implementation(fn: Callable) -> Callable:
    """What a call of ``fn`` runs when ``fn`` is one of HF's ``use_kernel_func_from_hub_with_fallback``
    wrappers: the implementation it bound at import (FLA's function, or the torch reference it wraps),
    read from its closure; ``fn`` itself otherwise."""
    if not isinstance(fn, types.FunctionType):
        return fn
    return _closure_values(fn).get("implementation", fn)


@contextlib.contextmanager
def hf_torch_path(module: types.ModuleType, *names: str) -> Iterator[None]:
    """HF's torch path for the duration: each of ``module``'s ``names`` (HF wrappers) whose wrapper bound
    another implementation (FLA, causal-conv1d) points at the torch reference it wraps; model code looks
    the names up at call time. Wrappers bound to the torch reference are kept (same path). Restored
    afterwards. For benchmarks and tests that need HF's eager torch path whatever is installed."""
    saved = {name: getattr(module, name) for name in names}
    try:
        for name, fn in saved.items():
            if hf_bound_implementation(fn) is not getattr(fn, "__wrapped__", fn):
                setattr(module, name, fn.__wrapped__)
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def _expected_signature(fn: Callable, parameters: tuple[str, ...], where: str) -> bool:
    params = inspect.signature(fn).parameters
    defaults = {n: p.default for n, p in params.items() if p.default is not p.empty}
    if tuple(params) == parameters and all(defaults.get(k, v) == v for k, v in _HF_DEFAULTS.items()):
        return True
    logger.warning("%s has parameters %s, expected %s: not substituted", where, tuple(params), parameters)
    return False


def _register_hf_function(family: HfFamily, name: str, make: Callable, parameters: tuple[str, ...]) -> None:
    module = sys.modules.get(family.module)
    wrapper = getattr(module, name, None)
    torch_function = inspect.unwrap(wrapper) if callable(wrapper) else None
    where = f"{family.module}.{name}"
    if not isinstance(torch_function, types.FunctionType) or not _expected_signature(torch_function, parameters,
                                                                                       where):
        return
    entry = f"transformers {name}"
    serve_torch = register(entry, f"{where}.__wrapped__", torch_function,
                            lambda: make(entry, torch_function))
    if wrapper is torch_function:
        return
    # The wrapper: substituted only when it is HF's, whose closure says what it bound.
    bound = _closure_values(wrapper)
    implementation, applicable = bound.get("implementation"), bound.get("applicable_params")
    if bound.get("torch_function") is not torch_function or implementation is None or applicable is None:
        logger.debug("%s: unknown wrapper; Dynamo traces it and meets the functions it calls", where)
        return
    if implementation is torch_function:
        serve = serve_torch
    else:
        if family.gated_per_head:  # FLA's GDN functions, which the GDN ops replace
            fla_name = "chunk_gated_delta_rule" if name == family.chunk else "fused_recurrent_gated_delta_rule"
            fla_make = _fla_gdn_chunk_substitute if name == family.chunk else _fla_gdn_recurrent_substitute
        else:
            fla_name = "chunk_kda" if name == family.chunk else "fused_recurrent_kda"
            fla_make = _fla_chunk_substitute if name == family.chunk else _fla_recurrent_substitute
        serve = register(f"fla {fla_name}", f"{where} (bound by the wrapper)", implementation,
                          lambda: fla_make(f"fla {fla_name}", implementation))
    if serve is not None:
        register(f"{entry} (HF wrapper)", where, wrapper,
                  lambda: _hf_wrapper_substitute(entry, wrapper, serve, tuple(applicable),
                                                 implementation is torch_function))


def _register_hf() -> None:
    for family in HF_FAMILIES:
        if family.module in sys.modules:
            _register_hf_function(family, family.chunk, family.substitutes[0], _CHUNK_PARAMETERS)
            _register_hf_function(family, family.recurrent, family.substitutes[1], _RECURRENT_PARAMETERS)


def register_loaded_entry_points() -> None:
    """Register the substitutes of every known entry point whose module is imported, then the probing
    substitutes of look-alike functions of transformers modeling modules (delta_rule/probe.py), the
    QSA indexers' (dsa/qsa_indexer.py), HF's grouped-GEMM experts (moe_experts.py), HF's causal conv1d of the
    delta-rule families for packed documents (documents.py) and their decode conv (conv_update.py)."""
    with lock:
        _register_fla()
        _register_hf()
        delta_rule_probe.register_probed_entry_points()
        qsa_indexer.register_loaded_indexers()
        moe_experts.register(register)
        register_conv_substitutes(register)
        conv_update.register(register)


# ----------------------------------------------------------------------------------------------
# Modules imported later
# ----------------------------------------------------------------------------------------------
class _NotifyingLoader(importlib.abc.Loader):
    """Runs the real loader, gives the module its real loader back, then registers."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        try:
            self._loader.exec_module(module)
        finally:
            module.__loader__ = self._loader
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = self._loader
        try:
            register_loaded_entry_points()
        except Exception:  # noqa: BLE001  (never break the user's import)
            logger.exception("registering the KDA substitutes after importing %s failed", module.__name__)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _WatchKdaModules(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module it asks the finders after it and wraps the loader."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in WATCHED_MODULES and not _PROBED_MODULES.match(fullname):
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _NotifyingLoader(spec.loader)
                return spec
        return None


WATCHED_MODULES = frozenset(FLA_MODULES + FLA_GDN_MODULES + tuple(f.module for f in HF_FAMILIES))
_PROBED_MODULES = delta_rule_probe.MODEL_MODULE  # the modules delta_rule/probe.py scans
_watcher = _WatchKdaModules()


def install() -> bool:
    """Register the substitutes (now, and for the watched modules when they are imported), unless
    ``KDA_COMPILE_SUBSTITUTION`` turns substitution off. Idempotent. Returns whether it is on."""
    if not substitution_enabled_by_env():
        logger.info("%s is off: KDA entry points are traced as written", ENV_SWITCH)
        return False
    with lock:
        if _watcher not in sys.meta_path:
            sys.meta_path.insert(0, _watcher)
        register_loaded_entry_points()
    return True
