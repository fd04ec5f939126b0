from kda_compile.ops.kda.api import chunk_kda, fused_recurrent_kda  # noqa: F401
