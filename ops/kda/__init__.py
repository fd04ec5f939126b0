from kda_compile.ops.kda.api import chunk_kda, fused_recurrent_kda  # noqa: F401
from kda_compile.ops.kda.reference import kda_reference  # noqa: F401  (the float64 math the kernels are checked by)
