"""DeepSeek Sparse Attention (DSA) as torch.compile-native custom ops (``torch.ops.kda_compile.dsa_*``).

Public: ``dsa_indexer_topk`` (the lightning indexer's scores and their top-k selection), ``dsa_pooled_indexer_topk``
(glm5_next's pooled indexer, ``pooled.py``) and
``dsa_sparse_attention`` (softmax attention over each query's selected keys, absorbed MQA or expanded
heads, with lse and a backward). Layout of the folder: ``reference.py`` (blockwise torch math: the CPU
path and the tests' oracle), ``pooled.py`` (glm5_next's pooled indexer in torch), ``triton_indexer.py`` /
``triton_pooled.py`` (blockwise fused token / pool scores + exact top-k),
``triton_sparse.py`` / ``triton_sparse_bwd.py`` (the sparse attention forward / backward kernels),
``kernels.py`` (which implementation runs a CUDA call), ``custom_ops.py`` (torch.library registration),
``api.py`` (checks and public functions). Design note: docs/dsa.md.
"""
from kda_compile.ops.dsa.api import dsa_indexer_topk, dsa_pooled_indexer_topk, dsa_sparse_attention

__all__ = ["dsa_indexer_topk", "dsa_pooled_indexer_topk", "dsa_sparse_attention"]
