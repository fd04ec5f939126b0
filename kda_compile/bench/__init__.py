"""Benchmarks: ``python -m kda_compile.bench {kda,attention,mla,e2e}`` (GPU) and
``python -m kda_compile.bench report`` (the README and plots of the repository's ``benchmarks/`` folder).

Every benchmark module exposes ``add_arguments(parser)`` and ``run(args) -> list[dict]``; rows are
long-format (op, provider, mode, gate, shape, metric, unit, p20, p50, p80, made by ``common.row``) and get
the environment columns (device, versions) added by ``__main__`` before the CSV is written
(``common.CSV_COLUMNS``). ``catalog.py`` says what each curated CSV measures; ``report.py`` renders them.
"""
