"""DeepSeek-V4's core attention as sparse attention: each query attends to its sliding window of recent keys,
to compressed entries (the top-k an indexer selected: CSA; every entry already closed: HCA) and to a per-head
sink, without the dense [S, Tw + Tc] mask Hugging Face builds (docs/dsa.md, section 6).

Layout of the folder: ``api.py`` (checks and ``compressed_sparse_attention``, which builds each query's key list
and runs ``dsa_sparse_attention`` over it), ``reference.py`` (the dense computation as Hugging Face's eager code
writes it: the tests' oracle, for small sizes).
"""
from kda_compile.ops.dsa.compressed.api import compressed_sparse_attention

__all__ = ["compressed_sparse_attention"]
