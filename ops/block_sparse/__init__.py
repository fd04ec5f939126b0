"""Block-sparse attention (``block_sparse_attention``): each query attends to the key blocks its KV group selected,
MiniMax-M3's sparse layers without a dense mask."""
from kda_compile.ops.block_sparse.api import block_sparse_attention

__all__ = ["block_sparse_attention"]
