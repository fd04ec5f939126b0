"""Every ``KDA_COMPILE_*`` environment switch, in one place: its meaning, type, default and accepted values.

Each switch has one accessor here, and every reader in ops/, passes/ and kda_compile/ goes through it. An accessor
reads the environment when it is called, not at import: a switch that steers a kernel choice is honoured by a
process that sets it late, by compiled graphs (the op reads it when it runs) and by tests that monkeypatch it. A
value outside the accepted ones raises a ``ValueError`` naming the variable, the value and what is accepted.

This module is the lowest layer (it imports nothing of kda_compile), so ops, passes and the public API can all use
it. docs/environment.md lists the switches; tests/test_envs.py checks that page against :data:`SWITCHES`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

CHECK_INPUTS = "KDA_COMPILE_CHECK_INPUTS"
STRICT = "KDA_COMPILE_STRICT"
SUBSTITUTION = "KDA_COMPILE_SUBSTITUTION"
CACHE_DIR = "KDA_COMPILE_CACHE_DIR"
PREPARE_KERNEL = "KDA_COMPILE_PREPARE_KERNEL"
SCAN_KERNEL = "KDA_COMPILE_SCAN_KERNEL"
PREFILL_SEGMENTS = "KDA_COMPILE_PREFILL_SEGMENTS"
LAUNCH_PLANS = "KDA_COMPILE_LAUNCH_PLANS"
DECODE_AUTOTUNE = "KDA_COMPILE_DECODE_AUTOTUNE"
MLA_DECODE_KERNEL = "KDA_COMPILE_MLA_DECODE_KERNEL"
TOPK_KERNEL = "KDA_COMPILE_TOPK_KERNEL"
POOL_KERNEL = "KDA_COMPILE_POOL_KERNEL"
INDEXER_KERNEL = "KDA_COMPILE_INDEXER_KERNEL"
SPARSE_ATTENTION_KERNEL = "KDA_COMPILE_SPARSE_ATTENTION_KERNEL"

TRITON_OR_CUDA = ("auto", "triton", "cuda")
TRITON_OR_WGMMA = ("auto", "triton", "wgmma")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
_SUBSTITUTION_OFF, _SUBSTITUTION_ON = ("0", "false", "off", "no"), ("", "1", "true", "on", "yes")


def _bad(name: str, value: str, accepted: str) -> ValueError:
    # The wording of ops._common.arg_error, which this module cannot import (it is the layer below).
    return ValueError(f"{name} must be {accepted}, got {value!r}")


def _choice(name: str, choices: tuple[str, ...]) -> str:
    """A kernel override: one of ``choices`` (case and blanks ignored; unset or empty is ``auto``)."""
    value = os.environ.get(name, "auto").strip().lower() or "auto"
    if value not in choices:
        raise _bad(name, value, "one of " + ", ".join(choices))
    return value


def _one_or_zero(name: str, default: bool) -> bool:
    """A switch spelled ``1`` (on) or ``0`` (off); unset or empty is ``default``."""
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value in ("0", "1"):
        return value == "1"
    raise _bad(name, value, "1, 0 or unset")


# ----------------------------------------------------------------------------------------------
# One accessor per switch
# ----------------------------------------------------------------------------------------------
def check_inputs() -> bool:
    """``KDA_COMPILE_CHECK_INPUTS``: whether the ops run the value checks that read tensor values on the host (a
    device-to-host copy per call on CUDA, so off by default; read on every call, so a compiled graph honours it)."""
    value = os.environ.get(CHECK_INPUTS, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise _bad(CHECK_INPUTS, value, "one of 1, true, yes, on, 0, false, no, off or unset")


def strict() -> bool:
    """``KDA_COMPILE_STRICT``: strict mode for the whole process (every slower path is an error)."""
    return _one_or_zero(STRICT, False)


def substitution() -> bool:
    """``KDA_COMPILE_SUBSTITUTION``: whether the trace-time substitutes of FLA's / HF's KDA and GDN functions are
    registered (default: yes)."""
    value = os.environ.get(SUBSTITUTION, "1").strip().lower()
    if value in _SUBSTITUTION_OFF:
        return False
    if value in _SUBSTITUTION_ON:
        return True
    raise _bad(SUBSTITUTION, value, f"one of {'/'.join(_SUBSTITUTION_OFF)} (off) or "
                                    f"{'/'.join(v for v in _SUBSTITUTION_ON if v)} (on)")


def cache_dir() -> str | None:
    """``KDA_COMPILE_CACHE_DIR``: the folder under which compiled cubins are kept across processes; by default
    ``$XDG_CACHE_HOME/kda_compile`` (``~/.cache/kda_compile``), None (no disk cache) when set empty."""
    root = os.environ.get(CACHE_DIR)
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                            "kda_compile")
    return root or None


def prepare_kernel() -> str:
    """``KDA_COMPILE_PREPARE_KERNEL``: the KDA / GDN prefill's prepare kernel, ``auto``, ``triton`` or ``cuda``."""
    return _choice(PREPARE_KERNEL, TRITON_OR_CUDA)


def scan_kernel() -> str:
    """``KDA_COMPILE_SCAN_KERNEL``: the KDA / GDN prefill's state scan, ``auto``, ``triton`` or ``cuda``."""
    return _choice(SCAN_KERNEL, TRITON_OR_CUDA)


def prefill_segments() -> int | None:
    """``KDA_COMPILE_PREFILL_SEGMENTS``: the Triton scan's segment count forced (values below 1 count as 1), or
    None (unset or empty): the scan chooses it from the SM count."""
    value = os.environ.get(PREFILL_SEGMENTS)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise _bad(PREFILL_SEGMENTS, value, "an integer or unset") from None


def launch_plans() -> bool:
    """``KDA_COMPILE_LAUNCH_PLANS``: whether repeated KDA / GDN prefill calls take their cached launch plans
    (``0``: every call takes the ordinary path, for debugging and measuring)."""
    return _one_or_zero(LAUNCH_PLANS, True)


def decode_autotune() -> bool:
    """``KDA_COMPILE_DECODE_AUTOTUNE``: whether the Triton decode kernel autotunes its block size and warps on
    this GPU instead of taking the shipped table."""
    return _one_or_zero(DECODE_AUTOTUNE, False)


def mla_decode_kernel() -> str:
    """``KDA_COMPILE_MLA_DECODE_KERNEL``: the absorbed MLA decode kernel, ``auto``, ``triton`` or ``wgmma``."""
    return _choice(MLA_DECODE_KERNEL, TRITON_OR_WGMMA)


def topk_kernel() -> str:
    """``KDA_COMPILE_TOPK_KERNEL``: the DSA indexer's few-row top-k select, ``auto``, ``triton`` or ``cuda``."""
    return _choice(TOPK_KERNEL, TRITON_OR_CUDA)


def pool_kernel() -> str:
    """``KDA_COMPILE_POOL_KERNEL``: the pooled DSA indexer's key pooling, ``auto``, ``triton`` or ``cuda``."""
    return _choice(POOL_KERNEL, TRITON_OR_CUDA)


def indexer_kernel() -> str:
    """``KDA_COMPILE_INDEXER_KERNEL``: the DSA indexer's score kernel, ``auto``, ``triton`` or ``cuda``."""
    return _choice(INDEXER_KERNEL, TRITON_OR_CUDA)


def sparse_attention_kernel() -> str:
    """``KDA_COMPILE_SPARSE_ATTENTION_KERNEL``: the DSA sparse attention kernel, ``auto``, ``triton`` or ``cuda``."""
    return _choice(SPARSE_ATTENTION_KERNEL, TRITON_OR_CUDA)


def raw_reader(names: tuple[str, ...]) -> Callable[[], tuple]:
    """A function returning the raw values of the variables ``names`` (None where unset), for a cache key that
    must change when one of them does (the KDA / GDN launch plans). On CPython it reads the mapping ``os.environ``
    keeps its values in (``_data``, kept in sync by every ``os.environ`` write; the values are then bytes):
    ``os.environ.get`` encodes its key on every call, which costs more host time than the rest of such a key."""
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and encode is not None:
        keys = tuple(encode(name) for name in names)
        return lambda: tuple(map(data.get, keys))
    return lambda: tuple(os.environ.get(name) for name in names)


# ----------------------------------------------------------------------------------------------
# The list docs/environment.md is generated from
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Switch:
    name: str
    type: str  # "bool", "choice", "int" or "path"
    default: str
    accepted: str
    meaning: str
    read: Callable[[], Any]


def _kernel(name: str, read: Callable[[], str], meaning: str, choices: tuple[str, ...] = TRITON_OR_CUDA) -> Switch:
    """A kernel override: default ``auto`` (the op's own choice); a forced kernel still falls back, logged, on a
    call it cannot take."""
    return Switch(name, "choice", "auto", ", ".join(choices) + " (case ignored)", meaning, read)


SWITCHES = (
    Switch(CHECK_INPUTS, "bool", "off", "1, true, yes, on / 0, false, no, off, empty (case ignored)",
           "Run the ops' value checks that read tensors on the host (offsets, indices, gates): a device-to-host copy "
           "per call on CUDA. Read on every call. docs/kda-input-checks.md", check_inputs),
    Switch(STRICT, "bool", "off", "1 / 0, empty",
           "Strict mode for the whole process: a slower path (op fallback, rewrite left alone, graph break in "
           "kda_compile's code) raises StrictModeError. Read when a Config is made and at every fallback.", strict),
    Switch(SUBSTITUTION, "bool", "on", "1, true, on, yes, empty / 0, false, off, no (case ignored)",
           "Register the trace-time substitutes of FLA's and HF's KDA / GDN functions when kda_compile first "
           "installs its hooks (optimize() or the backend). An unknown value logs a warning and leaves it on.",
           substitution),
    Switch(CACHE_DIR, "path", "$XDG_CACHE_HOME/kda_compile (~/.cache/kda_compile)", "a folder; empty: no disk cache",
           "Where the cubins NVRTC compiles are kept across processes (in its nvrtc/ subfolder).", cache_dir),
    Switch(PREFILL_SEGMENTS, "int", "unset (chosen from the SM count)", "an integer (below 1 counts as 1)",
           "Force the Triton scan's segment count (tuning).", prefill_segments),
    Switch(LAUNCH_PLANS, "bool", "on", "1, empty / 0",
           "Serve repeated KDA / GDN prefill calls from cached launch plans; 0 sends every call through the "
           "ordinary path (debugging, measuring).", launch_plans),
    Switch(DECODE_AUTOTUNE, "bool", "off", "1 / 0, empty",
           "Autotune the Triton KDA / GDN decode kernel on this GPU instead of taking the shipped table.",
           decode_autotune),
    _kernel(PREPARE_KERNEL, prepare_kernel, "The KDA / GDN prefill's prepare kernel."),
    _kernel(SCAN_KERNEL, scan_kernel, "The KDA / GDN prefill's state scan."),
    _kernel(MLA_DECODE_KERNEL, mla_decode_kernel, "The absorbed MLA decode kernel.", TRITON_OR_WGMMA),
    _kernel(TOPK_KERNEL, topk_kernel, "The DSA indexer's top-k select for few rows (decode)."),
    _kernel(POOL_KERNEL, pool_kernel, "The pooled DSA indexer's key-pooling kernel."),
    _kernel(INDEXER_KERNEL, indexer_kernel, "The DSA indexer's score kernel for few queries (decode)."),
    _kernel(SPARSE_ATTENTION_KERNEL, sparse_attention_kernel, "The DSA sparse attention forward."),
)


def markdown_table() -> str:
    """The table of docs/environment.md (tests/test_envs.py checks that the page holds it)."""
    rows = ["| variable | type | default | accepted | meaning |", "|---|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.type} | {s.default} | {s.accepted} | {s.meaning} |" for s in SWITCHES]
    return "\n".join(rows) + "\n"
