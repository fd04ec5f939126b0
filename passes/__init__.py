"""Graph rewrites that turn eager model code into kda_compile ops during torch.compile.

They run on the Dynamo FX graph inside the ``kda_compile`` backend, before Inductor, in the order of
``manager.PIPELINE``. One folder per model family, so "the DSA rewrite" is ``dsa/``:

- ``attention/``: softmax attention and SDPA calls -> ``kda_compile.ops.attention`` (``softmax.py``,
  ``sdpa.py``; ``mask.py`` reads eager and SDPA masks for them; ``spellings.py``, ``normalize.py`` and
  ``fold.py`` bring more spellings of eager attention to the form ``softmax.py`` matches);
- ``delta_rule/``: KDA / GDN recurrences collapsed and their prologues folded into the KDA ops;
- ``dsa/``: DeepSeek Sparse Attention -> the DSA ops; ``mla/``: MLA expand-then-attend -> ``mla_attention``;
- ``substitution/``: trace-time substitution (what Dynamo traces in place of known KDA entry points, before
  the graph exists) and the report of its sites;
- ``toolkit/``: op families and patterns as data (``matching.py``) and FX graph helpers (``graph_tools.py``);
- ``rewrite.py``: what a rewrite is and the registry; ``report.py``: the report entries;
  ``manager.py``: the ordered pipeline and the pass manager.
"""
from kda_compile.passes.manager import PassManager
from kda_compile.passes.report import GraphReport, LeftAlone, Rewritten
from kda_compile.passes.rewrite import REWRITES, GraphRewrite, register_rewrite

__all__ = ["REWRITES", "GraphReport", "GraphRewrite", "LeftAlone", "PassManager", "Rewritten", "register_rewrite"]
