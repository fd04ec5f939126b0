"""One prefill speedup plot from several ``python -m kda_compile.bench kda`` CSVs (runs split to fit the
device's time limit); not part of the package. Usage, from the repository root:

    python kda_compile/bench/results/kda_plot_csvs.py OUT.png RUN1.csv [RUN2.csv ...]

Medians (p50) per provider, mode and shape, in the order the CSVs list them; the plot is the benchmark's own
(``_plot_prefill_speedup``). Session 12: kda_lower_bound_h100_2026-11-22_session12_prefill_speedup.png."""
import csv
import sys
from pathlib import Path

from kda_compile.bench.kda import _plot_prefill_speedup

PROVIDERS = ("FLA", "ours (FLA path)", "ours (own kernels)")


def prefill_table(paths: list[str]) -> list[list]:
    """Rows as the benchmark's prefill table: mode, shape, the three medians, two speedups, own error."""
    times, errors, order = {}, {}, []
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                key = (row["mode"], row["shape"])
                if row["mode"] not in ("fwd", "fwd+bwd"):
                    continue
                if key not in order:
                    order.append(key)
                if row["metric"] == "time":
                    times[key + (row["provider"],)] = float(row["p50"])
                elif row["metric"] == "rel_err_vs_fla" and row["provider"] == "ours (own kernels)":
                    errors[key] = float(row["p50"])
    table = []
    for key in order:
        fla, path, own = (times[key + (p,)] for p in PROVIDERS)
        table.append([*key, fla, path, own, fla / path, fla / own, errors.get(key, float("nan"))])
    return table


if __name__ == "__main__":
    _plot_prefill_speedup(prefill_table(sys.argv[2:]), Path(sys.argv[1]))
