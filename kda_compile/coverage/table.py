"""The coverage table as markdown (``docs/coverage.md``) and the sweep's summary line.

Besides the table, :func:`document` writes what ``--resume`` reads back (kda_compile/coverage/stored.py):
every row as the JSON of ``Row.to_dict()`` in one HTML comment at the end of the file (invisible when
rendered; ``>`` escaped as ``\\u003e`` so that no row can close the comment), and a hand-written notes
block between :data:`NOTES_BEGIN` and :data:`NOTES_END` that a rewrite keeps.
"""
from __future__ import annotations

import collections
import datetime
import json
from typing import Iterable, Sequence

from kda_compile.coverage.sweep import Row

NOTES_BEGIN = "<!-- notes: hand-written, kept when the tool rewrites this file -->"
NOTES_END = "<!-- /notes -->"
ROWS_BEGIN = "<!-- coverage rows: one Row.to_dict() JSON a line, read back by --resume"
ROWS_END = "-->"

ATTN_TEXT = {"eager": "eager attention",
             "sdpa": "SDPA attention (`attn_implementation=\"sdpa\"`: each family's "
                     "`scaled_dot_product_attention` call)"}
COLUMNS = ("Family", "Status", "Attention", "Layers", "Rewritten", "Left alone (reason)", "Graph breaks",
           "Logits error", "Time (s)")

COLUMN_NOTES = """\
Columns:

- **Family**: the `model_type` (a key of transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`).
- **Status**: `ok` (built, ran eagerly and compiled), or where it stopped: `no such attention` (an SDPA
  sweep only: transformers has no SDPA attention for the family), `build failed` (the tiny
  config or the model could not be built), `eager failed` (the eager forward raised), `compile failed`
  (torch.compile raised), `timeout` (no result within the per-family limit), `crashed` (the worker
  process died); the reason follows.
- **Attention**: the attention kinds among the model's module classes: `softmax` (a class named
  `*Attention` / `*Attn` not matched below), `MLA` (an attention module with a `kv_b_proj`), `DSA` (an
  `*Indexer*`), `KDA` (`*KimiDelta*` / `*KDA*` / `*DeltaAttention`), `GDN` (`*GatedDeltaNet*`), `other` (Mamba /
  mixer / RWKV / LSTM / short-conv / recurrent / linear-attention layers); plus the kind of every op a site became
  (a linear-attention layer rewritten into `chunk_kda` is KDA).
- **Layers**: decoder layers of the tiny model (2, or one per distinct layer kind of a hybrid).
- **Rewritten**: the sites kda_compile's rewrites replaced, by the op they became (`op x count`,
  over all compiled graphs).
- **Left alone (reason)**: candidates a rewrite saw and did not replace, `rewrite: reason x count`.
- **Graph breaks**: Dynamo's graph-break count (`torch._dynamo.utils.counters["graph_break"]`), and the
  number of graphs compiled in brackets.
- **Logits error**: `|compiled - eager| / |eager|` of the fp32 logits on the same input ids.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _counts(d: dict[str, int]) -> str:
    return "<br>".join(_cell(k if n == 1 else f"{k} x{n}") for k, n in d.items()) or "-"


def format_row(row: Row) -> list[str]:
    status = row.status if not row.reason else f"{row.status}: {row.reason}"
    breaks = "-" if row.graph_breaks is None else f"{row.graph_breaks} ({row.graphs} graphs)"
    error = "-" if row.logits_error is None else f"{row.logits_error:.1e}"
    return [f"`{row.family}`", _cell(status), ", ".join(row.attention) or "-",
            "-" if row.layers is None else str(row.layers), _counts(row.rewritten), _counts(row.left_alone),
            breaks, error, f"{row.seconds:.0f}"]


def markdown_table(rows: Iterable[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(format_row(r)) + " |" for r in rows]
    return "\n".join(lines)


def summary(rows: Sequence[Row]) -> dict[str, int]:
    """Counts: families run, without the attention implementation asked for (SDPA sweeps only), built, ok
    (compiled), fully rewritten, with left-alone sites, with graph breaks, failures (any status but ok and
    "no such attention")."""
    unsupported = [r for r in rows if r.status == "no such attention"]
    built = [r for r in rows if r.status not in ("build failed", "no such attention")]
    ok = [r for r in rows if r.status == "ok"]
    return {
        "families": len(rows),
        **({"without this attention": len(unsupported)} if unsupported else {}),
        "built": len(built),
        "compiled": len(ok),
        "fully rewritten": sum(r.fully_rewritten for r in ok),
        "with left-alone sites": sum(bool(r.left_alone) for r in ok),
        "with graph breaks": sum(bool(r.graph_breaks) for r in ok),
        "no site rewritten": sum(not r.rewritten for r in ok),
        "failures": len(rows) - len(ok) - len(unsupported),
    }


def summary_line(rows: Sequence[Row]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in summary(rows).items())


def _versions_text(versions: dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))


def sources(rows: Sequence[Row]) -> str:
    """Which command produced which rows: one bullet per (date, command, versions), oldest first."""
    groups: dict[tuple[str, str, str], list[str]] = collections.defaultdict(list)
    for row in rows:
        groups[(row.date, row.command, _versions_text(row.versions))].append(row.family)
    lines = []
    for (date, command, versions), families in sorted(groups.items()):
        what = (f"`{command}`" if command else "an unrecorded command") + (f" on {date}" if date else "")
        what += f" with {versions}" if versions else ""
        lines.append(f"- {what} ({len(families)}): " + ", ".join(f"`{f}`" for f in sorted(families)))
    return "\n".join(lines)


def rows_block(rows: Sequence[Row]) -> str:
    """The HTML comment holding every row's ``to_dict()`` JSON, one a line (see the module docstring)."""
    lines = [json.dumps(r.to_dict()).replace(">", "\\u003e") for r in rows]
    return "\n".join([ROWS_BEGIN, *lines, ROWS_END])


def document(rows: Sequence[Row], *, command: str, not_run: Sequence[str] = (), not_run_reason: str = "",
             versions: dict[str, str] | None = None, date: str | None = None, notes: str = "",
             attn: str = "eager") -> str:
    """The whole ``docs/coverage.md``: header, summary, where the rows come from, the hand-written
    ``notes`` (kept verbatim between the notes markers), column notes, table, families not run, and
    the rows as JSON for ``--resume``."""
    date = date or datetime.date.today().isoformat()
    versions = versions or {}
    version_text = _versions_text(versions)
    parts = [
        "# Model coverage" + ("" if attn == "eager" else f" ({attn} attention)"),
        "",
        "Every causal LM of the installed transformers, built tiny with random weights (hidden size 64, "
        f"4 heads, 2 layers or one per layer kind of a hybrid, fp32, {ATTN_TEXT.get(attn, attn)}; nothing "
        "downloaded), "
        "run eagerly and through `kda_compile.optimize(model, Config(compiler=\"eager\"), fullgraph=False)` "
        "on the same input ids (batch 2, 12 tokens): what kda_compile's rewrites did "
        "to each family, where Dynamo broke the graph, and how far the logits moved. Each family runs in "
        "its own process with a time limit. Tiny random models exercise the code paths, not the numerics "
        "of real checkpoints; a family that fails here may fail for its tiny config only.",
        "",
        f"Generated by `python -m kda_compile.coverage`; last written by `{command}` on {date}"
        + (f" with {version_text}" if version_text else "") + ". `--resume` keeps the rows already here and "
        "runs only the families without one (or those named by `--families`), so rows may come from "
        "different runs:",
        "",
        sources(rows),
        "",
        f"Summary: {summary_line(rows)}.",
        "",
        NOTES_BEGIN,
        notes.strip("\n"),
        NOTES_END,
        "",
        COLUMN_NOTES,
        markdown_table(rows),
    ]
    if not_run:
        parts += ["", f"Not run ({len(not_run)}): {not_run_reason}", "",
                  ", ".join(f"`{name}`" for name in not_run)]
    parts += ["", rows_block(rows)]
    return "\n".join(parts) + "\n"
