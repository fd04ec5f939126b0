"""``python -m kda_compile.coverage [--families a,b] [--out coverage.md] [--attn eager|sdpa] [--jobs N]
[--timeout S] [--resume] [--budget S]``

Runs each family in its own process (at most ``--timeout`` seconds), rewrites ``--out`` after every
finished family (families still pending are listed as not run), and prints a summary line.

``--resume`` completes a partial file instead of starting over: it keeps the rows already in ``--out``
(read back exactly from the JSON comment the file ends with; a file from before that comment has its
table parsed, see stored.py) and runs only the families without a row, or the ``--families`` given
(whose rows it replaces). Every row records the command, date and versions that produced it, and the
file lists the rows by the command that produced them. The hand-written notes block of ``--out`` is
kept in every case. ``--budget S`` starts no family after S seconds; those left are listed as not
run, for a later ``--resume``. ``--attn`` picks the HF attention implementation the tiny models are built
with: ``eager`` (their own matmul-softmax code, docs/coverage.md) or ``sdpa`` (their
``scaled_dot_product_attention`` call, docs/coverage-sdpa.md); one file holds rows of one implementation.

``--worker FAMILY`` (internal) runs one family in this process and prints its row as JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import pathlib
import shlex
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from kda_compile.cli_help import HelpFormatter
from kda_compile.coverage.models import ATTN_IMPLEMENTATIONS

logger = logging.getLogger("kda_compile.coverage")


# Run first, so that a sweep cut short still covers the families kda_compile targets.
PRIORITY = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "gpt_oss", "deepseek_v3",
            "kimi_linear", "qwen3_next", "gpt2")


def _versions() -> dict[str, str]:
    import torch

    versions = {}
    try:
        import transformers

        versions["transformers"] = transformers.__version__
    except ImportError:
        pass
    versions["torch"] = torch.__version__
    return versions


def _worker(family: str, attn: str) -> int:
    from kda_compile.coverage.sweep import run_family

    logging.basicConfig(level=logging.WARNING)
    row = run_family(family, attn=attn)
    sys.stdout.write("\n" + json.dumps(row.to_dict()) + "\n")
    sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kda_compile.coverage", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--families", help="comma-separated model types (default: every causal LM)")
    parser.add_argument("--out", default="coverage.md",
                        help="markdown file to write (the repository's table is docs/coverage.md: name it to refresh "
                             "that one)")
    parser.add_argument("--attn", default="eager", choices=ATTN_IMPLEMENTATIONS,
                        help="HF attention implementation the tiny models are built with")
    parser.add_argument("--jobs", type=int, default=1, help="families run at once (one process each)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per family")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows already in --out; run only families without one (or --families)")
    parser.add_argument("--budget", type=float, default=None,
                        help="start no family after this many seconds (the rest are listed as not run)")
    parser.add_argument("--worker", metavar="FAMILY", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args.worker, args.attn)

    from kda_compile.coverage.models import model_types
    from kda_compile.coverage.stored import Stored, read_document
    from kda_compile.coverage.sweep import Row, run_isolated
    from kda_compile.coverage.table import document, summary_line

    known = model_types()
    out = pathlib.Path(args.out)
    stored = read_document(out.read_text()) if out.exists() else Stored()
    rows: dict[str, Row] = dict(stored.rows) if args.resume else {}
    other = sorted({row.attn for row in rows.values()} - {args.attn})
    if other:
        parser.error(f"--attn {args.attn}: {out} holds rows built with {', '.join(other)} attention; "
                     "resume it with that --attn, or write another --out")
    if args.families:
        families = [f.strip() for f in args.families.split(",") if f.strip()]
        unknown = sorted(set(families) - set(known))
        if unknown:
            parser.error(f"--families: not causal-LM model types of this transformers: {', '.join(unknown)}")
    else:
        ordered = [f for f in PRIORITY if f in known] + [f for f in known if f not in PRIORITY]
        families = [f for f in ordered if f not in rows]
    if args.resume:
        print(f"kept {len(rows)} rows of {out}" + (" (parsed from its table)" if stored.parsed else "")
              + f"; running {len(families)} families", flush=True)
    command = ("python -m kda_compile.coverage " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))).strip()
    versions = _versions()
    date = datetime.date.today().isoformat()
    out.parent.mkdir(parents=True, exist_ok=True)
    done: set[str] = set()
    threads = 1 if args.jobs > 1 else None
    start = time.perf_counter()
    over_budget = threading.Event()

    def write() -> None:
        pending = {f for f in families if f not in rows}
        if args.resume:  # completing the table: every family of this transformers without a row
            pending |= {f for f in known if f not in rows}
        pending = sorted(pending)
        if over_budget.is_set():
            reason = (f"the sweep's time budget (`--budget {args.budget:g}`) ran out before them; "
                      "`--resume` runs them")
        else:
            reason = "the sweep had not reached them when this file was written; `--resume` runs them"
        out.write_text(document([rows[f] for f in sorted(rows)], command=command, not_run=pending,
                                not_run_reason=reason if pending else "", versions=versions, date=date,
                                notes=stored.notes, attn=args.attn))

    def run_one(family: str) -> Row | None:
        if args.budget is not None and time.perf_counter() - start > args.budget:
            over_budget.set()
            return None
        return run_isolated(family, args.timeout, threads, attn=args.attn)

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run_one, f): f for f in families}
        for future in as_completed(futures):
            row = future.result()
            if row is None:
                continue
            row.command, row.date, row.versions = command, date, dict(versions)
            rows[row.family] = row
            done.add(row.family)
            print(f"[{len(done)}/{len(families)}] {row.family}: {row.status}"
                  + (f" ({row.reason})" if row.reason else "")
                  + (f", rewritten {row.rewritten}, left alone {len(row.left_alone)}, "
                     f"graph breaks {row.graph_breaks}" if row.status == "ok" else "")
                  + f" [{row.seconds:.0f} s]", flush=True)
            write()
    write()
    print(f"{summary_line(list(rows.values()))} ({time.perf_counter() - start:.0f} s); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
