"""Graph rewrites that turn eager model code into kda_compile ops during torch.compile.

They run on the Dynamo FX graph inside the ``kda_compile`` backend, before Inductor:

- ``toolkit/matching.py``: op families and patterns, so each rewrite reads as data;
- ``toolkit/graph_tools.py``: example values, symbolic-size facts, inserting and erasing nodes;
- ``manager.py``: the rewrite registry, the pass manager and the report entries;
- one file per rewrite (``attention/softmax.py``, ``attention/sdpa.py``; ``attention/mask.py`` reads
  eager and SDPA masks for them; ``attention/spellings.py`` and ``attention/normalize.py`` bring more
  spellings of eager attention to the form ``attention/softmax.py`` matches).
"""
from kda_compile.passes.delta_rule import recurrence as _kda_recurrence  # noqa: F401  (registers the rewrite; runs first)
from kda_compile.passes.delta_rule import prologue as _kda_prologue  # noqa: F401  (registers the rewrite; runs after kda_recurrence)
from kda_compile.passes.substitution import sites as _kda_sites  # noqa: F401  (registers the kda_substitution report; after kda_prologue)
from kda_compile.passes.dsa import attention as _dsa_attention  # noqa: F401  (registers the rewrite; before the attention rewrites)
from kda_compile.passes.attention import softmax as _softmax_attention  # noqa: F401  (registers the rewrite)
from kda_compile.passes.attention import sdpa as _sdpa_attention  # noqa: F401  (registers the rewrite; runs after softmax_attention)
from kda_compile.passes.mla import absorb as _mla_absorb  # noqa: F401  (registers the rewrite; runs after the attention rewrites)
from kda_compile.passes.manager import (REWRITES, GraphReport, GraphRewrite, LeftAlone, PassManager, Rewritten,
                                        register_rewrite)

__all__ = ["REWRITES", "GraphReport", "GraphRewrite", "LeftAlone", "PassManager", "Rewritten", "register_rewrite"]
