"""Context parallelism for the chunked delta rules (KDA, GDN): a packed batch split along T over the ranks of
a process group, states chained across ranks by one all-gather (docs/context-parallel.md)."""
from kda_compile.ops.context_parallel.chain import context_parallel_chunk
from kda_compile.ops.context_parallel.context import CPContext, build_cp_context, context_offsets, plan_slice

__all__ = ["CPContext", "build_cp_context", "context_offsets", "context_parallel_chunk", "plan_slice"]
