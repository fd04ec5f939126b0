"""``python -m kda_compile.coverage``: which Hugging Face causal-LM families kda_compile rewrites.

Sweeps every causal LM of the installed transformers (or ``--families a,b``) with tiny random
configs through the ``kda_compile`` backend (``Config(compiler="eager")``) and writes a markdown
table to ``docs/coverage.md``: attention kinds, sites rewritten / left alone with reasons, graph
breaks, logits error. Needs transformers; imports it only when a family is built.

- :func:`~kda_compile.coverage.sweep.run_family`: one family in-process, a :class:`Row`;
- :func:`~kda_compile.coverage.sweep.run_isolated`: the same in a subprocess with a time limit;
- :func:`~kda_compile.coverage.table.document`: the markdown file, which ends with every row's JSON in
  an HTML comment;
- :func:`~kda_compile.coverage.stored.read_document`: those rows (and the hand-written notes) read back,
  so that ``--resume`` completes a partial table without re-running the families it already has.
"""
from kda_compile.coverage.stored import read_document
from kda_compile.coverage.sweep import Row, attention_kinds, run_family, run_isolated
from kda_compile.coverage.table import document, markdown_table, summary, summary_line

__all__ = ["Row", "attention_kinds", "run_family", "run_isolated", "document", "markdown_table", "read_document",
           "summary", "summary_line"]
