"""Graph rewrites that turn eager model code into kda_compile ops during torch.compile.

They run on the Dynamo FX graph inside the ``kda_compile`` backend, before Inductor:

- ``matching.py``: op families and patterns, so each rewrite reads as data;
- ``graph_tools.py``: example values, symbolic-size facts, inserting and erasing nodes;
- ``manager.py``: the rewrite registry, the pass manager and the report entries;
- one file per rewrite (``softmax_attention.py``, ``sdpa_attention.py``; ``attention_mask.py`` reads
  eager and SDPA masks for them; ``attention_spellings.py`` and ``attention_normalize.py`` bring more
  spellings of eager attention to the form ``softmax_attention.py`` matches).
"""
from kda_compile.passes import kda_recurrence  # noqa: F401  (registers the rewrite; runs first)
from kda_compile.passes import kda_prologue  # noqa: F401  (registers the rewrite; runs after kda_recurrence)
from kda_compile.passes import kda_sites  # noqa: F401  (registers the kda_substitution report; after kda_prologue)
from kda_compile.passes import dsa_attention  # noqa: F401  (registers the rewrite; before the attention rewrites)
from kda_compile.passes import softmax_attention  # noqa: F401  (registers the rewrite)
from kda_compile.passes import sdpa_attention  # noqa: F401  (registers the rewrite; runs after softmax_attention)
from kda_compile.passes import mla_absorb  # noqa: F401  (registers the rewrite; runs after the attention rewrites)
from kda_compile.passes.manager import (REWRITES, GraphReport, GraphRewrite, LeftAlone, PassManager, Rewritten,
                                        register_rewrite)

__all__ = ["REWRITES", "GraphReport", "GraphRewrite", "LeftAlone", "PassManager", "Rewritten", "register_rewrite"]
