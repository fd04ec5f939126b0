"""The DeepSeek Sparse Attention rewrite (docs/dsa-rewrite.md): the rewrite and its indexer half
(``attention.py``), the attention over the selection (``sparse.py``), its absorbed form over the latent cache
(``absorb.py``), glm5_next's pooled indexer (``pooled.py``), the graph patterns (``patterns.py``), and
qwen4_exp's QSA indexer traced without a graph break (``qsa_indexer.py``, a trace-time substitution).
"""
