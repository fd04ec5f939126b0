"""Delta-rule entry points recognised by what they compute, not by their identity.

Several transformers families carry their own copy of a delta-rule function (Bailing-Hybrid and
GLM-5-Next copy Kimi-Linear's, models/bailing_hybrid/modeling_bailing_hybrid.py, transformers 5.23)::

    @use_kernel_func_from_hub_with_fallback("chunk_kda", "fla")
    def chunk_kimi_delta_attention(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                   output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        ...   # a torch chunk loop: Dynamo unrolls it (hundreds of nodes a layer)

A list of known function objects misses every new copy. Instead, every module-level function of a
``transformers.models.*.modeling_*`` module whose signature reads like a delta-rule entry point
(``query/q, key/k, value/v, g, beta`` first, then ``initial_state`` and ``output_final_state``;
anything else optional) gets a trace-time substitute. The first time Dynamo meets a call of it, the
function is PROBED (plain Python at trace time, once per function object and process): called on
tiny random float64 CPU inputs and compared with ``kda_compile.ops.kda.kda_reference``:

- KDA: per-channel gate ``g [B, T, H, K]``, with and without ``use_qk_l2norm_in_kernel``, with an
  initial state and ``output_final_state=True``, and without both (the state must come back None);
  a ``chunk_size`` of 2 (T = 5: three chunks) where the function takes one;
- GDN: per-head gate ``g [B, T, H]`` (the reference on the gate broadcast over K);
- grouped value heads (``HV = 2 H``), and a non-default ``scale`` when the function takes one.

Each case passes when the output has the query's shape and dtype, the final state is float32 (what
our ops return) and both are within :data:`PROBE_TOLERANCE` relative error of the reference (NaN
fails). A call is then traced as our op only for the cases its verdict covers (gate kind, grouped
heads, a given scale); any other call, and every call of a function that failed the probe, is
traced as written, with the verdict's reason logged once and shown in the rewrite report. The
chunk entry point (a ``chunk_size`` parameter, or no ``recurrent`` in its name) becomes
``chunk_kda`` (``chunk_gated_delta_rule`` for a per-head gate when ``kda_compile.ops`` has it),
the other ``fused_recurrent_kda`` (``fused_recurrent_gated_delta_rule``); without the GDN ops the
per-head gate is broadcast over K, which is GDN exactly.

Why a probe and not a comparison of source or bytecode: copies differ in names, comments, casts and
loop forms while computing the same thing; a probe checks the one property that matters (same
outputs) and costs a few calls on tiny CPU inputs, once per function. The inputs are random, so a
function that agrees on them and differs elsewhere (a branch on a shape or value the probe did not take)
is possible in principle; the cases above cover the branches HF's call sites take (both flag values, state or not,
several chunks, T not a multiple of the chunk size, K != V so a transposed state fails).

Functions substituted by identity (substitution/install.py: FLA's and Kimi-Linear's / Qwen3-Next's
known entry points) are not probed. Eager execution never changes.
"""
from __future__ import annotations

import dis
import inspect
import logging
import os
import re
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kda_compile import ops
from kda_compile.ops import chunk_kda, fused_recurrent_kda
from kda_compile.passes.substitution import registry, substitutes
from kda_compile.passes.substitution.substitutes import CHUNK_SIZES, _as_state, _copy_of, _per_channel

logger = logging.getLogger("kda_compile.passes.delta_rule_probe")

MODEL_MODULE = re.compile(r"transformers\.models\.\w+\.modeling_\w+$")  # the modules scanned for candidates
LEADING = (("query", "q"), ("key", "k"), ("value", "v"), ("g",), ("beta",))
KNOWN_OPTIONAL = frozenset({"chunk_size", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
                            "scale"})
PROBE_TOLERANCE = 1e-5  # copies compute in fp32 even for fp64 inputs (~1e-7); other math is off by >= 1e-2
_CONSTANTS = (type(None), bool, int, float, str)  # defaults a traced call can be compared with
_B, _T, _H, _K, _V = 2, 5, 2, 4, 3  # K != V: a transposed state fails; T = 5: not a chunk multiple


@dataclass(frozen=True)
class DeltaRuleSpec:
    """How to call a candidate: its parameter names and what they mean."""

    where: str  # module.function
    chunk: bool  # served by the chunk op (else the recurrent one)
    names: tuple[str, ...]  # positional parameter names, in order
    defaults: dict = field(hash=False, compare=False)
    tensors: tuple[str, str, str, str, str]  # the names of q, k, v, g, beta
    has_l2norm: bool
    has_scale: bool
    reads_var_keyword: bool  # False: extra keywords are ignored by the function's code


@dataclass(frozen=True)
class Verdict:
    """What the probe found: which calls compute KDA / GDN as our ops do."""

    where: str
    kda: bool = False  # per-channel gate
    gdn: bool = False  # per-head gate
    grouped: bool = False  # value heads a multiple of the q/k heads
    scale: bool = False  # a given scale multiplies q
    error: float = float("nan")  # the largest relative error of the passing cases
    reason: str = ""  # why a case failed (empty when all passed)

    @property
    def matches(self) -> bool:
        return self.kda or self.gdn

    def describe(self) -> str:
        if not self.matches:
            return f"{self.where} does not compute the delta rule as kda_compile does: {self.reason}"
        gates = "/".join(name for name, ok in (("KDA", self.kda), ("GDN", self.gdn)) if ok)
        extra = "".join((", grouped heads" if self.grouped else "", ", scale" if self.scale else ""))
        return f"{self.where}: recognised by computation ({gates}{extra}; probe rel. error {self.error:.1e})"


# ----------------------------------------------------------------------------------------------
# Candidates (by signature) and the probe (by computation)
# ----------------------------------------------------------------------------------------------
def candidate_spec(fn: Any, where: str) -> DeltaRuleSpec | None:
    """The spec of ``fn`` when its signature reads like a delta-rule entry point, else None."""
    if not isinstance(fn, types.FunctionType):
        return None
    code = fn.__code__
    names = code.co_varnames[:code.co_argcount]
    if "beta" not in names or "initial_state" not in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
        return None  # cheap filter before inspect.signature
    params = inspect.signature(fn).parameters
    ordered = list(params)
    if len(ordered) < 5 or any(ordered[i] not in LEADING[i] for i in range(5)) or "output_final_state" not in params:
        return None
    var_keyword = None
    for name, p in list(params.items())[5:]:
        if p.kind is p.VAR_POSITIONAL or (p.default is p.empty and p.kind is not p.VAR_KEYWORD):
            if name not in ("initial_state", "output_final_state"):
                return None
        if p.kind is p.VAR_KEYWORD:
            var_keyword = name
    positional = tuple(n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    defaults = {n: p.default for n, p in params.items() if p.default is not p.empty}
    if not all(isinstance(d, _CONSTANTS) for d in defaults.values()):
        return None  # a call could not be told to leave such a parameter at its default
    chunk = "chunk_size" in params or "recurrent" not in fn.__name__
    reads = var_keyword is not None and any(ins.argval == var_keyword for ins in dis.get_instructions(fn)
                                            if ins.opname.startswith("LOAD_FAST"))
    return DeltaRuleSpec(where, chunk, positional, defaults, tuple(ordered[:5]), "use_qk_l2norm_in_kernel" in params,
                         "scale" in params, reads)


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _probe_case(fn: Callable, spec: DeltaRuleSpec, gen: torch.Generator, *, per_head: bool, heads_v: int,
                l2norm: bool, with_state: bool, scale: float | None, chunk_size: int | None) -> tuple[float, str]:
    """(relative error, "") for one case, or (inf, why it failed)."""
    from kda_compile.ops.kda import kda_reference

    f64 = dict(dtype=torch.float64, generator=gen)
    q, k = torch.randn(_B, _T, _H, _K, **f64), torch.randn(_B, _T, _H, _K, **f64)
    v = torch.randn(_B, _T, heads_v, _V, **f64)
    g = -(0.05 + 0.5 * torch.rand(_B, _T, heads_v, *(() if per_head else (_K,)), **f64))
    beta = torch.rand(_B, _T, heads_v, **f64)
    state = torch.randn(_B, heads_v, _K, _V, **f64) if with_state else None
    call = dict(zip(spec.tensors, (q, k, v, g, beta)), initial_state=state, output_final_state=with_state)
    if spec.has_l2norm:
        call["use_qk_l2norm_in_kernel"] = l2norm
    if scale is not None:
        call["scale"] = scale
    if chunk_size is not None:
        call["chunk_size"] = chunk_size
    gate = g.unsqueeze(-1).expand(*g.shape, _K) if per_head else g
    want_o, want_state = kda_reference(q, k, v, gate, beta, scale=_K ** -0.5 if scale is None else scale,
                                       initial_state=state, use_qk_l2norm_in_kernel=l2norm and spec.has_l2norm)
    try:
        out = fn(**call)
    except Exception as exc:  # noqa: BLE001  (any failure is a verdict, never an error of the trace)
        return float("inf"), f"raised {type(exc).__name__}: {str(exc)[:200]}"
    if not isinstance(out, (tuple, list)) or len(out) != 2 or not isinstance(out[0], torch.Tensor):
        return float("inf"), f"returned {type(out).__name__}, not (output, final state)"
    o, final = out
    if o.shape != want_o.shape or o.dtype != q.dtype:
        return float("inf"), f"output {tuple(o.shape)} {o.dtype}, expected {tuple(want_o.shape)} {q.dtype}"
    errors = [_rel_error(o, want_o)]
    if not with_state:
        if final is not None:
            return float("inf"), "returned a final state with output_final_state=False"
    elif not isinstance(final, torch.Tensor) or final.shape != want_state.shape or final.dtype != torch.float32:
        what = f"{tuple(final.shape)} {final.dtype}" if isinstance(final, torch.Tensor) else type(final).__name__
        return float("inf"), f"final state {what}, expected {tuple(want_state.shape)} float32"
    else:
        errors.append(_rel_error(final, want_state))
    if max(errors) > PROBE_TOLERANCE:
        return max(errors), f"relative error {max(errors):.1e} > {PROBE_TOLERANCE:.0e} against kda_reference"
    return max(errors), ""


def probe(fn: Callable, spec: DeltaRuleSpec) -> Verdict:
    """Run ``fn`` on the probe cases (float64, CPU, its own random generator: the user's RNG state
    is untouched) and say which calls of it compute what our ops compute."""
    gen = torch.Generator().manual_seed(0x6b6461)
    labels = {"per_head": "GDN gate", "heads_v": "grouped heads", "scale": "scale"}

    def run(**case) -> tuple[bool, float, str]:
        full = dict(per_head=False, heads_v=_H, l2norm=True, with_state=True, scale=None, chunk_size=None) | case
        err, why = _probe_case(fn, spec, gen, **full)
        what = ", ".join(f"{labels.get(k, k)}={v}" for k, v in case.items())
        return not why, err, f"case ({what or 'KDA gate'}): {why}" if why else ""

    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        # chunk_size=2 < T: the state carried across chunks is checked too (our ops take any chunk size
        # as the same math, so a copy must be right across chunks to be substituted)
        chunked = dict(chunk_size=2) if "chunk_size" in spec.defaults else {}
        results = {"kda": [run(**chunked), run(l2norm=False, with_state=False)], "gdn": [run(per_head=True, **chunked)]}
        passed = {kind: all(ok for ok, _, _ in cases) for kind, cases in results.items()}
        gate = {} if passed["kda"] else {"per_head": True}
        if passed["kda"] or passed["gdn"]:
            results["grouped"] = [run(heads_v=2 * _H, **gate)]
            if spec.has_scale:
                results["scale"] = [run(scale=0.7, **gate)]
    ok = {kind: all(c[0] for c in cases) for kind, cases in results.items()}
    errors = [err for cases in results.values() for c_ok, err, _ in cases if c_ok]
    reasons = [why for cases in results.values() for _, _, why in cases if why]
    return Verdict(spec.where, ok["kda"], ok["gdn"], ok.get("grouped", False), ok.get("scale", False),
                   max(errors, default=float("nan")), "; ".join(reasons))


# ----------------------------------------------------------------------------------------------
# Trace-time decisions (plain Python while Dynamo traces; their results are constants)
# ----------------------------------------------------------------------------------------------
_candidates: dict[str, tuple[Callable, DeltaRuleSpec]] = {}  # where -> (function, spec)
_verdicts: dict[str, Verdict] = {}
_declined_once: set[tuple[str, str]] = set()
_lock = threading.RLock()


def verdict_of(where: str) -> Verdict:
    """The probe verdict of the candidate at ``where`` (probed on first use, then cached)."""
    with _lock:
        verdict = _verdicts.get(where)
        if verdict is None:
            fn, spec = _candidates[where]
            verdict = _verdicts[where] = probe(fn, spec)
            log = logger.info if verdict.matches else logger.warning
            log("%s", verdict.describe())
        return verdict


def verdicts() -> dict[str, Verdict]:
    """Every verdict reached in this process (for the report and tests)."""
    with _lock:
        return dict(_verdicts)


@torch._dynamo.assume_constant_result
def _serves(where: str, per_head: bool, grouped: bool, scaled: bool, foreign: str) -> bool:
    """Whether a call with these properties is traced as our op; logs (once) why not."""
    verdict = verdict_of(where)
    needs = (("a per-channel gate", not per_head, verdict.kda), ("a per-head gate", per_head, verdict.gdn),
             ("grouped value heads", grouped, verdict.grouped), ("a given scale", scaled, verdict.scale))
    missing = [what for what, asked, ok in needs if asked and not ok]
    if not verdict.matches:
        why = verdict.describe()
    elif missing:
        why = f"{where}: the probe did not confirm calls with {', '.join(missing)} ({verdict.reason})"
    elif foreign:
        why = f"{where}: argument(s) {foreign} the probe did not cover"
    else:
        return True
    with _lock:
        first = (where, why) not in _declined_once
        _declined_once.add((where, why))
    if first:
        logger.warning("traced as written: %s", why)
    return False


def _gdn_op(chunk: bool) -> Callable | None:
    return getattr(ops, "chunk_gated_delta_rule" if chunk else "fused_recurrent_gated_delta_rule", None)


def _same(value: Any, default: Any) -> bool:
    return value is default or (not isinstance(value, torch.Tensor) and value == default)


def _serve_probed(where: str, chunk: bool, names: tuple, tensors: tuple, defaults: dict, ignores_extra: bool,
                  twin: Callable, args: tuple, kwargs: dict):
    """Our op for a call of a recognised entry point, or the original code (traced as written)."""
    if not substitutes._substituting(f"probed {where}") or len(args) > len(names):
        return twin(*args, **kwargs)
    call = dict(zip(names, args))
    call.update(kwargs)
    q, k, v, g, beta = (call[name] if name in call else None for name in tensors)
    if q is None or k is None or v is None or g is None or beta is None:
        return twin(*args, **kwargs)
    # A probed option counts only as a parameter of the function; through **kwargs it is an extra keyword
    # (ignored when the function never reads **kwargs, as the function ignores it).
    options_taken = [name for name in KNOWN_OPTIONAL if name in names or name in defaults]
    foreign = [name for name in call if name not in tensors and name not in options_taken
               and ((name in defaults and not _same(call[name], defaults[name]))
                    or (name not in defaults and name not in names and not (ignores_extra or call[name] is None)))]
    call = {name: value for name, value in call.items() if name in tensors or name in options_taken}
    scale = call.get("scale", None)
    per_head = g.dim() == q.dim() - 1
    if not _serves(where, per_head, bool(v.shape[-2] != q.shape[-2]), scale is not None, ",".join(foreign)):
        return twin(*args, **kwargs)
    initial_state = call["initial_state"] if "initial_state" in call else defaults.get("initial_state", None)
    final = call["output_final_state"] if "output_final_state" in call else defaults.get("output_final_state", False)
    l2norm = call["use_qk_l2norm_in_kernel"] if "use_qk_l2norm_in_kernel" in call else defaults.get(
        "use_qk_l2norm_in_kernel", False)
    options = dict(scale=scale, initial_state=_as_state(initial_state), output_final_state=final,
                   use_qk_l2norm_in_kernel=l2norm)
    chunk_size = call["chunk_size"] if "chunk_size" in call else defaults.get("chunk_size", 64)
    if chunk:  # any chunk size is the same math; the ops take 16, 32 or 64
        options["chunk_size"] = chunk_size if chunk_size in CHUNK_SIZES else 64
    gdn = _gdn_op(chunk) if per_head else None
    if gdn is not None:  # by keyword: FLA's recurrent GDN order puts gk / gv before beta
        return gdn(q, k, v, g=g, beta=beta, **options)
    if per_head:
        g = _per_channel(g, k)
    return (chunk_kda if chunk else fused_recurrent_kda)(q, k, v, g, beta, **options)


# One factory per op kind, so the frame name in a node's stack trace says the site was probed.
def _chunk_substitute(spec: DeltaRuleSpec, original: Callable) -> Callable:
    twin, where, names, tensors = _copy_of(original), spec.where, spec.names, spec.tensors
    defaults, ignores_extra = _constant_defaults(spec), not spec.reads_var_keyword

    def probed_chunk_delta_rule(*args, **kwargs):
        return _serve_probed(where, True, names, tensors, defaults, ignores_extra, twin, args, kwargs)

    return probed_chunk_delta_rule


def _recurrent_substitute(spec: DeltaRuleSpec, original: Callable) -> Callable:
    twin, where, names, tensors = _copy_of(original), spec.where, spec.names, spec.tensors
    defaults, ignores_extra = _constant_defaults(spec), not spec.reads_var_keyword

    def probed_recurrent_delta_rule(*args, **kwargs):
        return _serve_probed(where, False, names, tensors, defaults, ignores_extra, twin, args, kwargs)

    return probed_recurrent_delta_rule


def _constant_defaults(spec: DeltaRuleSpec) -> dict[str, Any]:
    return dict(spec.defaults)  # constants only (candidate_spec)


SUBSTITUTE_FRAMES = {"probed_chunk_delta_rule": True, "probed_recurrent_delta_rule": False}  # -> chunk
PROBE_FILE = os.path.abspath(__file__)


# ----------------------------------------------------------------------------------------------
# Registration (from substitution/install.py, register_loaded_entry_points) and the report
# ----------------------------------------------------------------------------------------------
_seen: dict[str, set[str]] = {}  # module name -> the attributes already looked at


def register_probed_entry_points() -> None:
    """Register a probing substitute for each candidate of every imported transformers modeling
    module (each attribute looked at once; a module imported while another was still executing is
    read again later for the functions it has defined since). Identity-known functions keep their
    substitute."""
    known = {id(r.original) for r in registry.registered()}
    for module_name, module in list(sys.modules.items()):
        if not MODEL_MODULE.match(module_name) or module is None:
            continue
        with _lock:
            seen = _seen.setdefault(module_name, set())
            fresh = [(attr, value) for attr, value in list(vars(module).items()) if attr not in seen]
            seen.update(attr for attr, _ in fresh)
        for attr, value in fresh:
            fn = inspect.unwrap(value) if isinstance(value, types.FunctionType) else None
            if fn is None or getattr(fn, "__module__", None) != module_name or id(fn) in known:
                continue
            where = f"{module_name}.{fn.__name__}"
            spec = candidate_spec(fn, where)
            if spec is None:
                continue
            with _lock:
                _candidates[where] = (fn, spec)
            make = _chunk_substitute if spec.chunk else _recurrent_substitute
            registry.register(f"probed {where}", where, fn, lambda make=make, spec=spec, fn=fn: make(spec, fn))
            logger.debug("%s looks like a delta-rule entry point: probed when first traced", where)


def recognised_entry(frames: list[tuple[str, int, str]]) -> str | None:
    """How a KDA node traced through a probing substitute was recognised (for substitution/sites.py), or None.
    ``frames``: (file, line, function) of the node's stack trace, outermost first."""
    for i, (path, _, fn) in enumerate(frames):
        if fn in SUBSTITUTE_FRAMES and os.path.abspath(path) == PROBE_FILE:
            callers = {os.path.abspath(p) for p, _, _ in frames[:i]}  # the model file, HF's wrapper, ...
            chunk = SUBSTITUTE_FRAMES[fn]
            with _lock:
                found = [v for where, v in _verdicts.items() if v.matches and _candidates[where][1].chunk == chunk]
            mine = [v for v in found if _module_file(v.where) in callers] or found
            if len(mine) == 1:
                return mine[0].describe()
            return "recognised by computation: " + " or ".join(v.where for v in mine)
    return None


def _module_file(where: str) -> str:
    module = sys.modules.get(where.rsplit(".", 1)[0])
    path = getattr(module, "__file__", None)
    return os.path.abspath(path) if path else ""


def traced_as_written(function: str) -> list[str]:
    """Why calls of probed functions named ``function`` were traced as written in this process: a
    failed probe, or a call the verdict did not cover (for the left-alone reasons of substitution/sites.py)."""
    with _lock:
        reasons = [v.describe() for where, v in _verdicts.items()
                   if where.rsplit(".", 1)[1] == function and not v.matches]
        reasons += sorted(why for where, why in _declined_once if where.rsplit(".", 1)[1] == function)
    return list(dict.fromkeys(reasons))
