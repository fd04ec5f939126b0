"""The substitutes Dynamo traces in place of the known KDA entry points (registered by
substitution/install.py, which describes the mapping and the switches).

One factory per kind of entry point: FLA's ``chunk_kda`` / ``fused_recurrent_kda`` and
``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``, HF's torch references (Kimi-Linear's
KDA, the gated-delta-rule models' GDN) and HF's ``use_kernel_func_from_hub_with_fallback`` wrappers.
Each substitute decides at trace time (``_substituting``, ``_declined``: constants to Dynamo) whether
the graph takes kda_compile's op or the original code (an unregistered copy, ``_copy_of``).

Also here, for the report and the registration: ``SUBSTITUTE_FRAMES`` (each substitute's frame name ->
the entry point it stands for; substitution/sites.py reads this file's frames in a graph's stack traces),
``HF_FAMILIES`` (the transformers modules whose references are substituted, with their factories) and
``HF_REFERENCE_FUNCTIONS``.
"""
from __future__ import annotations

import inspect
import logging
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from kda_compile.ops import chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule, fused_recurrent_kda

# The substitution's one logger (substitution/install.py logs there too): what a user enables to see it.
logger = logging.getLogger("kda_compile.passes.kda_substitution")

HF_KIMI_MODULE = "transformers.models.kimi_linear.modeling_kimi_linear"

CHUNK_SIZES = (16, 32, 64)
_OURS_PARAMS = {fn: frozenset(n for n, p in inspect.signature(fn).parameters.items()
                              if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
                for fn in (chunk_kda, fused_recurrent_kda, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)}
# FLA options our functions take only at their default: another value traces FLA's own function (logged).
_ONLY_AT_DEFAULT = {"cp_context": None, "gk": None, "gv": None}


# ----------------------------------------------------------------------------------------------
# Trace-time decisions (run as plain Python while Dynamo traces; their results are constants)
# ----------------------------------------------------------------------------------------------
def _compiling_config():
    """The kda_compile Config of the backend Dynamo is tracing for, or None (another backend, or
    not tracing). Follows Dynamo's wrappers of the backend (debug wrapper, torch.compile wrapper)."""
    from kda_compile.config import Config

    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        backend = tx.output.compiler_fn
    except Exception:  # noqa: BLE001  (not tracing, or a Dynamo without these internals)
        return None
    for _ in range(8):
        config = getattr(backend, "config", None)
        if isinstance(config, Config):
            return config
        inner = getattr(backend, "_torchdynamo_orig_backend", None) or getattr(backend, "compiler_fn", None)
        if inner is None or inner is backend:
            return None
        backend = inner
    return None


@torch._dynamo.assume_constant_result
def _substituting(entry_point: str) -> bool:
    """Whether the graph being traced takes kda_compile's op for ``entry_point``."""
    config = _compiling_config()
    if config is not None and not config.kda_substitution:
        logger.debug("%s: traced as written (Config(kda_substitution=False))", entry_point)
        return False
    return True


@torch._dynamo.assume_constant_result
def _declined(entry_point: str, reason: str) -> bool:
    logger.warning("%s traced as written (graph break at FLA's function): %s", entry_point, reason)
    return True


_declined_reasons: set[tuple[str, str]] = set()


@torch._dynamo.assume_constant_result
def _declined_once(entry_point: str, reason: str) -> bool:
    """Log at INFO, once per entry point and reason, why a site traces HF's function (the substitutes of
    moe_experts.py and conv_update.py); run while Dynamo traces, as a constant."""
    if (entry_point, reason) not in _declined_reasons:
        _declined_reasons.add((entry_point, reason))
        logger.info("%s traced as written: %s", entry_point, reason)
    return True


@torch._dynamo.assume_constant_result
def _not_kept_apart(entry_point: str, reason: str) -> bool:
    logger.warning("%s: packed documents are not kept apart, each token sees the documents before it: %s",
                   entry_point, reason)
    return True


# Packed documents (docs/packed-documents.md): HF's GDN layers pass the flash-attention offsets
# ``cu_seq_lens_q`` on as ``cu_seqlens``; Kimi-Linear's pass every keyword on, ``cu_seq_lens_q`` among them.
OFFSETS_KEYWORD = "cu_seq_lens_q"


def document_offsets_of(kwargs: dict) -> Any:
    """The packed documents' offsets a delta-rule call carries (``cu_seqlens``, else ``cu_seq_lens_q``), or None."""
    offsets = kwargs.get("cu_seqlens")
    return kwargs.get(OFFSETS_KEYWORD) if offsets is None else offsets


PER_TOKEN = ("q", "k", "v", "g", "beta")  # the chunk ops' [B, T, ...] inputs


def over_packed_rows(op: Callable, **call: Any) -> Any:
    """``op(**call)`` for a chunk delta-rule op. Offsets (``cu_seqlens``) of packed documents count the tokens of
    the batch's rows laid end to end (HF's flash-attention layout); the ops take them with one row, so a batch of
    ``B > 1`` rows goes in as the row ``[1, B * T, ...]`` and its output comes back as ``[B, T, ...]``
    (docs/packed-documents.md)."""
    q = call["q"]
    if call.get("cu_seqlens") is None or q.shape[0] == 1:
        return op(**call)
    b, t = q.shape[:2]
    for name in PER_TOKEN:
        if call.get(name) is not None:
            call[name] = call[name].reshape(1, b * t, *call[name].shape[2:])
    result = op(**call)
    if isinstance(result, tuple):
        return (result[0].reshape(b, t, *result[0].shape[2:]), *result[1:])
    return result.reshape(b, t, *result.shape[2:])


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    return not isinstance(value, torch.Tensor) and not isinstance(default, torch.Tensor) and value == default


# ----------------------------------------------------------------------------------------------
# The substitutes. One factory per kind of entry point, so every substitute's frame name (seen
# in the graph's stack traces, read by substitution/sites.py) says which entry point it stands for.
# ----------------------------------------------------------------------------------------------
def _copy_of(fn: Callable) -> Callable:
    """An unregistered function object with ``fn``'s code, closure and attributes: calling it
    makes Dynamo trace the original code (or, for a disabled function, break the graph as the
    original does) without meeting the substitute again."""
    twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    twin.__kwdefaults__ = fn.__kwdefaults__
    twin.__dict__.update(fn.__dict__)
    twin.__qualname__ = fn.__qualname__
    return twin


def register_hf_module_functions(register_fn: Callable, modules: tuple[str, ...], attribute: str,
                                 parameters: tuple[str, ...], entry: str, make: Callable[[Callable], Callable],
                                 mismatch: str) -> None:
    """Register ``make(original)`` as the substitute of ``attribute`` of each loaded module of ``modules``: HF's
    hub wrapper and the torch function it wraps (model code may call either), through
    ``register_fn(entry, found_at, original, make)``. A torch function whose parameters are not ``parameters`` is
    left alone, with a warning ending in ``mismatch`` (what then runs as written)."""
    for name in modules:
        module = sys.modules.get(name)
        wrapper = getattr(module, attribute, None) if module is not None else None
        if not callable(wrapper):
            continue
        torch_function = inspect.unwrap(wrapper)
        where = f"{name}.{attribute}"
        if not isinstance(torch_function, types.FunctionType):
            continue
        found = tuple(inspect.signature(torch_function).parameters)
        if found != parameters:
            logger.warning("%s has parameters %s, expected %s: %s", where, found, parameters, mismatch)
            continue
        for original, found_at in ((torch_function, f"{where}.__wrapped__"), (wrapper, where)):
            register_fn(entry, found_at, original, lambda original=original: make(original))


def _fla_signature(fn: Callable) -> tuple[tuple[str, ...], dict[str, Any]]:
    """FLA's positional parameter names (in order) and every parameter's default."""
    params = inspect.signature(fn).parameters.values()  # follows __wrapped__ through torch.compiler.disable
    positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    defaults = {p.name: p.default for p in params if p.default is not p.empty}
    return positional, defaults


def _serve_fla_call(entry: str, ours: Callable, original: Callable, positional: tuple, defaults: dict,
                    args: tuple, kwargs: dict):
    """Our function called with FLA's arguments bound by name, or the original when it cannot be."""
    if not _substituting(entry):
        return original(*args, **kwargs)
    if len(args) > len(positional):
        _declined(entry, f"{len(args)} positional arguments, FLA's function takes {len(positional)}")
        return original(*args, **kwargs)
    call = dict(zip(positional, args))
    call.update(kwargs)
    foreign = tuple(name for name, value in call.items()
                    if (name not in _OURS_PARAMS[ours] and not _is_default(value, defaults.get(name)))
                    or (name in _ONLY_AT_DEFAULT and not _is_default(value, _ONLY_AT_DEFAULT[name])))
    if foreign:
        _declined(entry, f"argument(s) {', '.join(foreign)} that kda_compile does not take")
        return original(*args, **kwargs)
    if ours in (fused_recurrent_kda, fused_recurrent_gated_delta_rule) and "initial_state" in call:
        # FLA's recurrent kernel reads any state dtype in fp32 and returns an fp32 final state (its chunk
        # entry asserts fp32); our op takes fp32 states only: the upcast is exact.
        call["initial_state"] = _as_state(call["initial_state"])
    return over_packed_rows(ours, **{name: value for name, value in call.items() if name in _OURS_PARAMS[ours]})


def _fla_chunk_substitute(entry: str, original: Callable) -> Callable:
    twin, (positional, defaults) = _copy_of(original), _fla_signature(original)

    def fla_chunk_kda(*args, **kwargs):
        return _serve_fla_call(entry, chunk_kda, twin, positional, defaults, args, kwargs)

    return fla_chunk_kda


def _fla_recurrent_substitute(entry: str, original: Callable) -> Callable:
    twin, (positional, defaults) = _copy_of(original), _fla_signature(original)

    def fla_fused_recurrent_kda(*args, **kwargs):
        return _serve_fla_call(entry, fused_recurrent_kda, twin, positional, defaults, args, kwargs)

    return fla_fused_recurrent_kda


def _fla_gdn_chunk_substitute(entry: str, original: Callable) -> Callable:
    twin, (positional, defaults) = _copy_of(original), _fla_signature(original)

    def fla_chunk_gated_delta_rule(*args, **kwargs):
        return _serve_fla_call(entry, chunk_gated_delta_rule, twin, positional, defaults, args, kwargs)

    return fla_chunk_gated_delta_rule


def _fla_gdn_recurrent_substitute(entry: str, original: Callable) -> Callable:
    twin, (positional, defaults) = _copy_of(original), _fla_signature(original)

    def fla_fused_recurrent_gated_delta_rule(*args, **kwargs):
        return _serve_fla_call(entry, fused_recurrent_gated_delta_rule, twin, positional, defaults, args, kwargs)

    return fla_fused_recurrent_gated_delta_rule


def _as_state(initial_state):
    # Our ops take fp32 states; HF's references do `initial_state.to(value)` with value already float32,
    # and FLA's recurrent kernel reads any state dtype in fp32: the upcast is what they compute with.
    if initial_state is not None and initial_state.dtype != torch.float32:
        initial_state = initial_state.to(torch.float32)
    return initial_state


def _hf_chunk_substitute(entry: str, original: Callable) -> Callable:
    twin = _copy_of(original)

    def hf_chunk_kimi_delta_attention(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                      output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        if not _substituting(entry):
            return twin(query, key, value, g, beta, chunk_size, initial_state, output_final_state,
                        use_qk_l2norm_in_kernel, **kwargs)
        return over_packed_rows(chunk_kda, q=query, k=key, v=value, g=g, beta=beta,
                                initial_state=_as_state(initial_state), output_final_state=output_final_state,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                chunk_size=chunk_size if chunk_size in CHUNK_SIZES else 64,
                                cu_seqlens=document_offsets_of(kwargs))

    return hf_chunk_kimi_delta_attention


def _hf_recurrent_substitute(entry: str, original: Callable) -> Callable:
    twin = _copy_of(original)

    def hf_recurrent_kimi_delta_attention(query, key, value, g, beta, initial_state, output_final_state,
                                          use_qk_l2norm_in_kernel=False, **kwargs):
        if not _substituting(entry):
            return twin(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                        **kwargs)
        return fused_recurrent_kda(query, key, value, g, beta, initial_state=_as_state(initial_state),
                                   output_final_state=output_final_state,
                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    return hf_recurrent_kimi_delta_attention


def _per_channel(g, key):
    # GDN decays once per head ([B, T, HV]); KDA per key channel ([B, T, HV, K]): the same decay on
    # every channel is GDN exactly (a stride-0 view, no copy here).
    return g.unsqueeze(-1).expand(*g.shape, key.shape[-1])


def _hf_gdn_chunk_substitute(entry: str, original: Callable) -> Callable:
    twin = _copy_of(original)

    def hf_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                  output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        if not _substituting(entry):
            return twin(query, key, value, g, beta, chunk_size, initial_state, output_final_state,
                        use_qk_l2norm_in_kernel, **kwargs)
        return over_packed_rows(chunk_gated_delta_rule, q=query, k=key, v=value, g=g, beta=beta,
                                initial_state=_as_state(initial_state), output_final_state=output_final_state,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                chunk_size=chunk_size if chunk_size in CHUNK_SIZES else 64,
                                cu_seqlens=document_offsets_of(kwargs))

    return hf_chunk_gated_delta_rule


def _hf_gdn_recurrent_substitute(entry: str, original: Callable) -> Callable:
    twin = _copy_of(original)

    def hf_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                                      use_qk_l2norm_in_kernel=False, **kwargs):
        if not _substituting(entry):
            return twin(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                        **kwargs)
        return fused_recurrent_gated_delta_rule(query, key, value, g, beta=beta, initial_state=_as_state(initial_state),
                                                output_final_state=output_final_state,
                                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    return hf_recurrent_gated_delta_rule


def _hf_wrapper_substitute(entry: str, wrapper: Callable, serve: Callable, applicable_params: tuple,
                           torch_bound: bool) -> Callable:
    """HF's wrapper: keep the keywords its bound implementation takes (as HF does), then call
    ``serve`` (the substitute of that implementation). Packed documents' offsets (``cu_seqlens``, or
    Kimi-Linear's ``cu_seq_lens_q``, which HF's filter drops) reach ``serve`` as ``cu_seqlens`` whatever
    is bound, so each document runs on its own (docs/packed-documents.md). ``seq_idx`` with the torch
    fallback bound goes through HF's own code, which refuses it."""
    twin = _copy_of(wrapper)

    def hf_kda_wrapper(*args, **kwargs):
        offsets = document_offsets_of(kwargs)
        if not _substituting(entry) or (torch_bound and kwargs.get("seq_idx") is not None):
            if offsets is not None and not torch_bound:
                _not_kept_apart(entry, "Config(kda_substitution=False)")
            return twin(*args, **kwargs)
        kept = {k: v for k, v in kwargs.items() if k in applicable_params}
        if offsets is not None:
            kept["cu_seqlens"] = offsets
        return serve(*args, **kept)

    return hf_kda_wrapper


# The frame name of each substitute -> the entry point it stands for (read by substitution/sites.py).
SUBSTITUTE_FRAMES = {
    "fla_chunk_kda": "fla chunk_kda",
    "fla_fused_recurrent_kda": "fla fused_recurrent_kda",
    "hf_chunk_kimi_delta_attention": "transformers chunk_kimi_delta_attention",
    "hf_recurrent_kimi_delta_attention": "transformers recurrent_kimi_delta_attention",
    "fla_chunk_gated_delta_rule": "fla chunk_gated_delta_rule",
    "fla_fused_recurrent_gated_delta_rule": "fla fused_recurrent_gated_delta_rule",
    "hf_chunk_gated_delta_rule": "transformers torch_chunk_gated_delta_rule",
    "hf_recurrent_gated_delta_rule": "transformers torch_recurrent_gated_delta_rule",
    "hf_kda_wrapper": "transformers use_kernel_func_from_hub_with_fallback wrapper",
}


@dataclass(frozen=True)
class HfFamily:
    """A transformers modeling module whose chunk / recurrent delta-rule functions we substitute."""

    module: str
    chunk: str
    recurrent: str
    substitutes: tuple[Callable, Callable]  # factories for (chunk, recurrent)
    gated_per_head: bool  # GDN: a FLA-bound wrapper binds FLA's gated-delta-rule functions (not chunk_kda)


_GDN_MODELS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "qwen4_exp")
HF_FAMILIES = (
    HfFamily(HF_KIMI_MODULE, "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention",
             (_hf_chunk_substitute, _hf_recurrent_substitute), False),
    *(HfFamily(f"transformers.models.{m}.modeling_{m}", "torch_chunk_gated_delta_rule",
               "torch_recurrent_gated_delta_rule", (_hf_gdn_chunk_substitute, _hf_gdn_recurrent_substitute), True)
      for m in _GDN_MODELS),
)
# HF's torch references, traced as written when not substituted (substitution/sites.py reports them).
HF_REFERENCE_FUNCTIONS = tuple(sorted({f.chunk for f in HF_FAMILIES} | {f.recurrent for f in HF_FAMILIES}))
