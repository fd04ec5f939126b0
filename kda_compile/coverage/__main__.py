"""``python -m kda_compile.coverage [--families a,b] [--out docs/coverage.md] [--jobs N] [--timeout S]``

Runs each family in its own process (at most ``--timeout`` seconds), rewrites ``--out`` after every
finished family (families still pending are listed as not run), and prints a summary line.
``--worker FAMILY`` (internal) runs one family in this process and prints its row as JSON.
"""
from __future__ import annotations

import argparse
import json
import logging
import pathlib
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

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


def _worker(family: str) -> int:
    from kda_compile.coverage.sweep import run_family

    logging.basicConfig(level=logging.WARNING)
    row = run_family(family)
    sys.stdout.write("\n" + json.dumps(row.to_dict()) + "\n")
    sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kda_compile.coverage", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", help="comma-separated model types (default: every causal LM)")
    parser.add_argument("--out", default="docs/coverage.md", help="markdown file to write")
    parser.add_argument("--jobs", type=int, default=1, help="families run at once (one process each)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per family")
    parser.add_argument("--worker", metavar="FAMILY", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args.worker)

    from kda_compile.coverage.models import model_types
    from kda_compile.coverage.sweep import Row, run_isolated
    from kda_compile.coverage.table import document, summary_line

    known = model_types()
    if args.families:
        families = [f.strip() for f in args.families.split(",") if f.strip()]
        unknown = sorted(set(families) - set(known))
        if unknown:
            parser.error(f"--families: not causal-LM model types of this transformers: {', '.join(unknown)}")
    else:
        families = [f for f in PRIORITY if f in known] + [f for f in known if f not in PRIORITY]
    command = "python -m kda_compile.coverage " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    versions = _versions()
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: dict[str, Row] = {}
    threads = 1 if args.jobs > 1 else None

    def write() -> None:
        pending = [f for f in families if f not in rows]
        ordered = [rows[f] for f in sorted(rows)]
        reason = "the sweep had not reached them when this file was written" if pending else ""
        out.write_text(document(ordered, command=command.strip(), not_run=sorted(pending),
                                not_run_reason=reason, versions=versions))

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run_isolated, f, args.timeout, threads): f for f in families}
        for future in as_completed(futures):
            row = future.result()
            rows[row.family] = row
            print(f"[{len(rows)}/{len(families)}] {row.family}: {row.status}"
                  + (f" ({row.reason})" if row.reason else "")
                  + (f", rewritten {row.rewritten}, left alone {len(row.left_alone)}, "
                     f"graph breaks {row.graph_breaks}" if row.status == "ok" else "")
                  + f" [{row.seconds:.0f} s]", flush=True)
            write()
    print(f"{summary_line(list(rows.values()))} ({time.perf_counter() - start:.0f} s); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
