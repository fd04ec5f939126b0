"""Custom ops in the ``torch.ops.kda_compile`` namespace, with their public Python entry points.

One folder per operator: reference math beside the kernels, one module registering the ops.
Ops know nothing of models or of torch.compile passes.
"""
from kda_compile.ops._argument_errors import raising_argument_errors  # for graph rewrites (not an op)
from kda_compile.ops._common import tag_compile_caches
from kda_compile.ops._sharding import register_sharding_rules
from kda_compile.ops.attention import attention, attention_with_lse
from kda_compile.ops.block_sparse import block_sparse_attention
from kda_compile.ops.context_parallel import CPContext, build_cp_context
from kda_compile.ops.conv1d import causal_conv1d_update
from kda_compile.ops.dsa import (compressed_sparse_attention, dsa_indexer_topk, dsa_pooled_indexer_topk,
                                 dsa_sparse_attention)
from kda_compile.ops.gdn import chunk_gated_delta_rule, chunk_gdn, fused_recurrent_gated_delta_rule, fused_recurrent_gdn
from kda_compile.ops.kda import chunk_kda, fused_recurrent_kda
from kda_compile.ops.mla import mla_attention
from kda_compile.ops.moe import moe_experts

tag_compile_caches()
register_sharding_rules()  # DTensor inputs: each op runs on its local heads (docs/distributed.md)

__all__ = ["CPContext", "attention", "attention_with_lse", "block_sparse_attention", "build_cp_context",
           "causal_conv1d_update", "compressed_sparse_attention",
           "chunk_gated_delta_rule", "chunk_gdn", "chunk_kda", "dsa_indexer_topk", "dsa_pooled_indexer_topk",
           "dsa_sparse_attention", "fused_recurrent_gated_delta_rule", "fused_recurrent_gdn", "fused_recurrent_kda",
           "mla_attention", "moe_experts"]
