"""One family through the ``kda_compile`` backend: a :class:`Row` of the coverage table.

:func:`run_family` builds the tiny model (models.py), runs eager logits, then
``kda_compile.optimize(model, config, fullgraph=False)`` on the same input ids (so Dynamo runs
with the scoped config optimize() sets: data-dependent MoE routing captured), and reads the
rewrite reports, Dynamo's graph-break counter, the breaks the report names (model line and
reason) and the relative logits error.
:func:`run_isolated` does the same in a subprocess with a time limit, so that a hang or a crash
becomes a row ("timeout", "crashed") instead of stopping the sweep.

Attention kinds (:func:`attention_kinds`), from the module classes of the built model:
``KDA`` a class whose name holds "KimiDelta" or "KDA" or ends in "DeltaAttention"; ``GDN`` "GatedDeltaNet"; ``DSA``
"Indexer"
(DeepSeek sparse attention's indexer); ``MLA`` an attention module with a ``kv_b_proj``;
``softmax`` any other class whose name ends in "Attention" (or "Attn"); ``other`` state-space /
recurrent / convolution mixers ("Mamba", "Mixer", "Rwkv", "Lstm", "ShortConv", "Recurrent",
"LinearAttention", "Retention"). A class matches the first kind in that order. The kinds of the ops the
rewrites made are added (:func:`with_rewritten_kinds`): a KDA layer named ``...LinearAttention`` is KDA.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from kda_compile.config import Config

logger = logging.getLogger("kda_compile.coverage")

SWEEP_CONFIG = Config(compiler="eager")
BATCH, LENGTH = 2, 12
STATUSES = ("ok", "no such attention", "build failed", "eager failed", "compile failed", "timeout", "crashed")
_NO_SUCH_ATTENTION = "does not support an attention implementation"
_OTHER = ("Mamba", "Mixer", "Rwkv", "RWKV", "Lstm", "LSTM", "ShortConv", "Recurrent", "LinearAttention",
          "Retention")
_PIP_HINT = re.compile(r"\.? You can install it with pip.*$")
_NODE_SUFFIX = re.compile(r"\b([A-Za-z]\w*?)_\d+\b")  # attn_weights_3 -> attn_weights: one reason per kind


@dataclass
class Row:
    """One family's line of the coverage table.

    ``status``: one of :data:`STATUSES`; ``reason``: why a non-"ok" family stopped (first line of
    the error). ``rewritten``: op -> number of rewritten sites that became it; ``left_alone``:
    "rewrite: reason" -> count; ``graph_breaks``: Dynamo's graph-break count, ``graphs``: graphs
    compiled; ``logits_error``: ``|compiled - eager| / |eager|`` (None unless both ran).
    ``attn``: the HF attention implementation the model was built with (``eager`` / ``sdpa``).
    ``command``, ``date``, ``versions``: what produced the row (the sweep's command line, the day it
    ran, transformers / torch versions); empty until ``python -m kda_compile.coverage`` fills them.
    """

    family: str
    status: str = "ok"
    reason: str = ""
    attention: list[str] = field(default_factory=list)
    layers: int | None = None
    rewritten: dict[str, int] = field(default_factory=dict)
    left_alone: dict[str, int] = field(default_factory=dict)
    graph_breaks: int | None = None
    graph_break_reasons: list[str] = field(default_factory=list)
    graphs: int | None = None
    logits_error: float | None = None
    seconds: float = 0.0
    attn: str = "eager"
    command: str = ""
    date: str = ""
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def fully_rewritten(self) -> bool:
        return self.status == "ok" and bool(self.rewritten) and not self.left_alone

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Row":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def attention_kinds(model: torch.nn.Module) -> list[str]:
    """The attention kinds of ``model`` (see the module docstring), in a fixed order."""
    kinds: set[str] = set()
    for module in model.modules():
        name = type(module).__name__
        if "KimiDelta" in name or "KDA" in name or name.endswith("DeltaAttention"):
            kinds.add("KDA")
        elif "GatedDeltaNet" in name:
            kinds.add("GDN")
        elif "Indexer" in name:
            kinds.add("DSA")
        elif (name.endswith("Attention") or name.endswith("Attn")) and hasattr(module, "kv_b_proj"):
            kinds.add("MLA")
        elif any(s in name for s in _OTHER):
            kinds.add("other")
        elif name.endswith("Attention") or name.endswith("Attn"):
            kinds.add("softmax")
    return [k for k in KIND_ORDER if k in kinds]


# The attention kind an op a site became implies (a layer whose class name says nothing, e.g. glm5_next's
# Glm5NextTextLinearAttention, which is KDA).
KIND_OF_OP = {"chunk_kda": "KDA", "fused_recurrent_kda": "KDA", "chunk_gated_delta_rule": "GDN",
              "fused_recurrent_gated_delta_rule": "GDN", "mla_attention": "MLA", "dsa_indexer_topk": "DSA",
              "dsa_pooled_indexer_topk": "DSA", "dsa_sparse_attention": "DSA", "compressed_sparse_attention": "DSA"}
KIND_ORDER = ("softmax", "MLA", "DSA", "KDA", "GDN", "other")


def with_rewritten_kinds(kinds: list[str], ops: dict[str, int]) -> list[str]:
    """``kinds`` with those the rewritten ops imply; a layer the class names called "other" and that became a
    delta-rule op is that op's kind."""
    implied = {KIND_OF_OP[op.rsplit(".", 1)[-1]] for op in ops if op.rsplit(".", 1)[-1] in KIND_OF_OP}
    found = set(kinds) | implied
    if implied & {"KDA", "GDN"} and "other" in found and not _other_left(kinds, implied):
        found.discard("other")
    return [k for k in KIND_ORDER if k in found]


def _other_left(kinds: list[str], implied: set[str]) -> bool:
    """Whether "other" must stay: the class names found it, and no delta-rule kind explains it (a hybrid with
    Mamba layers keeps it; its delta-rule kind would then come from a class name too)."""
    return "other" in kinds and bool({"KDA", "GDN"} & set(kinds))


def _first_line(exc: BaseException) -> str:
    text = [ln.strip() for ln in f"{type(exc).__name__}: {exc}".strip().splitlines() if ln.strip()]
    line = text[0] if text else type(exc).__name__
    if line.endswith(":") and len(text) > 1:  # "Class validation error for validator ...:" + the cause
        line = f"{line} {text[1]}"
    if isinstance(exc, ImportError):  # a missing optional package: what needs it, without pip's instructions
        line = _PIP_HINT.sub("", line)
    return line if len(line) <= 240 else line[:237] + "..."


def _logits(out: Any) -> torch.Tensor:
    logits = getattr(out, "logits", None)
    if logits is None:
        logits = out[0] if isinstance(out, (tuple, list)) else out
    return logits


def _layer_total(model: torch.nn.Module) -> int | None:
    from kda_compile.coverage.models import LAYER_KEYS

    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for key in LAYER_KEYS:
        value = getattr(cfg, key, None)
        if isinstance(value, int):
            return value
    return None


def run_family(family: str, config: Config = SWEEP_CONFIG, seed: int = 0, attn: str = "eager") -> Row:
    """Build ``family`` tiny with HF attention implementation ``attn``, compile it with the kda_compile
    backend and fill its :class:`Row`."""
    from torch._dynamo.utils import counters

    from kda_compile.coverage.models import build_model, vocab_size
    from kda_compile.optimize import optimize
    from kda_compile.report import report

    row = Row(family, attn=attn)
    start = time.perf_counter()
    try:
        try:
            model = build_model(family, seed=seed, attn=attn)
        except Exception as exc:  # noqa: BLE001  (every failure becomes a row)
            unsupported = attn != "eager" and _NO_SUCH_ATTENTION in str(exc)
            row.status = "no such attention" if unsupported else "build failed"
            row.reason = f"transformers has no {attn} attention for this family" if unsupported else _first_line(exc)
            return row
        row.attention = attention_kinds(model)
        row.layers = _layer_total(model)
        high = max(4, min(vocab_size(model), 200))
        ids = torch.randint(3, high, (BATCH, LENGTH), generator=torch.Generator().manual_seed(seed))
        try:
            with torch.no_grad():
                expected = _logits(model(input_ids=ids)).float()
        except Exception as exc:  # noqa: BLE001
            row.status, row.reason = "eager failed", _first_line(exc)
            return row
        torch._dynamo.reset()
        counters.clear()
        compiled = None
        try:  # as users run it: optimize() (its scoped Dynamo config and graph-break record included)
            compiled = optimize(model, config, fullgraph=False)
            with torch.no_grad():
                got = _logits(compiled(input_ids=ids)).float()
        except Exception as exc:  # noqa: BLE001
            row.status, row.reason = "compile failed", _first_line(exc)
            logger.debug("%s: %s", family, traceback.format_exc())
        else:
            denom = float(expected.double().norm()) or 1.0
            row.logits_error = float((got.double() - expected.double()).norm()) / denom
        breaks = counters.get("graph_break", {})
        row.graph_breaks = int(sum(breaks.values()))
        compiled_report = report(compiled) if compiled is not None else None
        named = compiled_report.graph_breaks if compiled_report is not None else ()
        row.graph_break_reasons = sorted(f"{b.location}: {b.reason}"[:200] for b in named) or sorted(
            str(r).splitlines()[0][:200] for r in breaks)
        reports = compiled_report.graphs if compiled_report is not None else ()
        row.graphs = len(reports)
        ops: collections.Counter[str] = collections.Counter()
        left: collections.Counter[str] = collections.Counter()
        for graph in reports:
            for entries in graph.sites().values():
                ops[entries[-1].op] += 1
            for entry in graph.left_alone:
                reason = _NODE_SUFFIX.sub(r"\1", entry.reason)
                left[f"{entry.rewrite}: {reason}"] += 1
        row.rewritten, row.left_alone = dict(sorted(ops.items())), dict(sorted(left.items()))
        row.attention = with_rewritten_kinds(row.attention, ops)
        return row
    finally:
        row.seconds = round(time.perf_counter() - start, 1)
        torch._dynamo.reset()


def run_isolated(family: str, timeout: float, threads: int | None = None, attn: str = "eager") -> Row:
    """:func:`run_family` in a fresh ``python -m kda_compile.coverage --worker`` process, at most
    ``timeout`` seconds; a timeout or a crash (no row printed) becomes a row with that status."""
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "kda_compile.coverage", "--worker", family, "--attn", attn],
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return Row(family, status="timeout", reason=f"no result within {timeout:g} s", attn=attn,
                   seconds=round(time.perf_counter() - start, 1))
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return Row.from_dict(json.loads(line))
            except (ValueError, TypeError):
                break
    tail = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    reason = f"exit code {proc.returncode}" + (f": {tail[-1][:200]}" if tail else "")
    return Row(family, status="crashed", reason=reason, attn=attn,
               seconds=round(time.perf_counter() - start, 1))
