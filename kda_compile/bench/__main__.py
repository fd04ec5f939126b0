"""``python -m kda_compile.bench <benchmark> [options]``: run a GPU benchmark, print its table and
write a long-format CSV (one row per op, provider, mode, shape and metric)."""
from __future__ import annotations

import argparse
import importlib
import logging
import pathlib
import sys

from kda_compile.bench.common import environment, write_csv

BENCHMARKS = {
    "kda": "kda_compile.bench.kda",
    "attention": "kda_compile.bench.attention",
    "e2e": "kda_compile.bench.e2e",
    "mla": "kda_compile.bench.mla",
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kda_compile.bench", description=__doc__)
    sub = parser.add_subparsers(dest="benchmark", required=True)
    modules = {}
    for name, module_name in BENCHMARKS.items():
        try:
            modules[name] = importlib.import_module(module_name)
        except ImportError as exc:  # a benchmark whose module is not there yet is simply not offered
            logging.getLogger("kda_compile.bench").debug("benchmark %s unavailable: %s", name, exc)
            continue
        p = sub.add_parser(name, help=(modules[name].__doc__ or "").strip().splitlines()[0])
        p.add_argument("--csv", type=pathlib.Path, default=pathlib.Path("bench_results") / f"{name}.csv",
                       help="where to write the long-format CSV (default: %(default)s)")
        modules[name].add_arguments(p)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    rows = modules[args.benchmark].run(args)
    env = environment()
    rows = [{**r, **env} for r in rows]
    write_csv(rows, args.csv)
    print(f"\n{len(rows)} rows written to {args.csv} ({env['device']}, torch {env['torch']}, "
          f"triton {env['triton']}, fla {env['fla']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
