"""DeepSeek Sparse Attention (DSA) as torch.compile-native custom ops (``torch.ops.kda_compile.dsa_*``).

Public: ``dsa_indexer_topk`` (the lightning indexer's scores and their top-k selection), ``dsa_pooled_indexer_topk``
(glm5_next's pooled indexer), ``dsa_sparse_attention`` (softmax attention over each query's selected keys,
absorbed MQA or expanded heads, with lse and a backward) and ``compressed_sparse_attention`` (DeepSeek-V4's
attention over a sliding window, compressed entries and sinks, on the sparse attention op).

Layout of the folder: ``api.py`` (checks and public functions), ``custom_ops.py`` (torch.library registration),
``reference.py`` (blockwise torch math: the CPU path and the tests' oracle), ``kernels.py`` (which implementation
runs a CUDA call), ``sharding.py`` (DTensor rules); by stage: ``indexer/`` (the scores as int32 codes and their exact
top-k: Triton, the sm_90a wgmma score kernel, the CUDA top-k), ``compressed/`` (DeepSeek-V4's attention: each query's
window and compressed keys listed for the sparse attention, and its dense reference), ``sparse/`` (the sparse attention forward in Triton
and as the sm_90a wgmma kernel, the backward in Triton), ``pooled/`` (glm5_next's pooled indexer: its torch
reference, the pool keys in Triton or CUDA, the pool scores, Hugging Face's slot layout). Design note: docs/dsa.md.
"""
from kda_compile.ops.dsa.api import dsa_indexer_topk, dsa_pooled_indexer_topk, dsa_sparse_attention
from kda_compile.ops.dsa.compressed import compressed_sparse_attention

__all__ = ["compressed_sparse_attention", "dsa_indexer_topk", "dsa_pooled_indexer_topk", "dsa_sparse_attention"]
