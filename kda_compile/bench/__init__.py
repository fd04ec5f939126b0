"""Benchmarks: ``python -m kda_compile.bench {kda,attention,...}`` (GPU).

Every benchmark module exposes ``add_arguments(parser)`` and ``run(args) -> list[dict]``; rows are
long-format (op, provider, mode, shape, metric, unit, p20, p50, p80) and get the environment
columns (device, torch, triton, fla) added by ``__main__`` before the CSV is written.
"""
