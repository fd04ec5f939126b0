"""``python -m kda_compile.bench <benchmark> [options]``: run a GPU benchmark, print its table and
write a long-format CSV (one row per op, provider, mode, shape and metric; columns ``CSV_COLUMNS``).

``python -m kda_compile.bench report [--dir benchmarks]``: redraw the plot of every CSV in that folder
and rewrite its README.md (tables of medians and speedups). To refresh the repository's ``benchmarks/``:
run the benchmark command that its README names for that CSV, copy the run's CSV over
``benchmarks/<name>.csv`` (runs split over several calls: concatenate their rows under one header), then
run ``report``.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import pathlib
import sys

from kda_compile.bench.common import environment, write_csv
from kda_compile.cli_help import HelpFormatter

BENCHMARKS = {
    "kda": "kda_compile.bench.kda",
    "attention": "kda_compile.bench.attention",
    "e2e": "kda_compile.bench.e2e",
    "mla": "kda_compile.bench.mla",
    "dsa": "kda_compile.bench.dsa",
    "gdn": "kda_compile.bench.gdn",
    "cp": "kda_compile.bench.context_parallel",
    "moe": "kda_compile.bench.moe",
    "block_sparse": "kda_compile.bench.block_sparse",
}
REPORT_DIR = pathlib.Path("benchmarks")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kda_compile.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="benchmark", required=True)
    modules = {}
    for name, module_name in BENCHMARKS.items():
        try:
            modules[name] = importlib.import_module(module_name)
        except ImportError as exc:  # a benchmark whose module is not there yet is simply not offered
            logging.getLogger("kda_compile.bench").debug("benchmark %s unavailable: %s", name, exc)
            continue
        p = sub.add_parser(name, help=(modules[name].__doc__ or "").strip().splitlines()[0],
                           formatter_class=HelpFormatter)
        p.add_argument("--csv", type=pathlib.Path, default=pathlib.Path("bench_results") / f"{name}.csv",
                       help="where to write the long-format CSV (default: %(default)s)")
        modules[name].add_arguments(p)
    report = sub.add_parser("report", help="redraw each CSV's plot and rewrite README.md in a results folder")
    report.add_argument("--dir", type=pathlib.Path, default=REPORT_DIR,
                        help="folder of benchmark CSVs (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.benchmark == "report":
        return _report(args.dir)
    rows = modules[args.benchmark].run(args)
    env = environment()
    rows = [{**r, **env} for r in rows]
    write_csv(rows, args.csv)
    print(f"\n{len(rows)} rows written to {args.csv} ({env['device']}; {env['versions']})")
    return 0


def _report(directory: pathlib.Path) -> int:
    from kda_compile.bench.report import ReportError, write_report

    try:
        written = write_report(directory)
    except ReportError as exc:
        raise SystemExit(f"report: {exc}") from exc
    print("\n".join(f"wrote {path}" for path in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
