// How a sequence's 64-token chunks are counted (CHUNK in prefill/chunks.py): the device twin of
// chunks.first_chunk_slots, included by the chunk plan, the CUDA prepare and the CUDA scan.
#pragma once
// chunks of a sequence of len tokens: none when it is empty (a negative length, from bad offsets, counts as empty).
// The int form keeps 32-bit arithmetic where offsets fit an int (the prepare's registers are tight).
__device__ __forceinline__ int chunk_count(long long len) {
    return len > 0 ? (int)((len + 63) / 64) : 0;
}
__device__ __forceinline__ int chunk_count(int len) {
    return len > 0 ? (len + 63) / 64 : 0;
}
