"""The DSA indexer stage: the query-key scores as int32 codes (Triton, and the sm_90a warpgroup-MMA kernel for a few
queries) and the exact top-k over them (Triton radix select, and the CUDA kernel holding a row in registers)."""
