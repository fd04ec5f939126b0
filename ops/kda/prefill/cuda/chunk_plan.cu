// The chunk plan of packed sequences, kda_chunk_plan: from cu_seqlens ([N + 1], CU_T) it writes chunk_offsets
// ([N + 1] int32, the first 64-token chunk slot of each sequence); one block of 1024 threads scans the lengths a
// tile at a time, so any N. prefill/cuda/chunk_plan.py prepends CU_T and launches it.
#include "chunk_count.cuh"

extern "C" __global__ void kda_chunk_plan(const CU_T* __restrict__ cu_seqlens, int* __restrict__ chunk_offsets, int N)
{
    __shared__ int warp_prefix[32];
    __shared__ int carry;
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5, warps = blockDim.x >> 5;
    if (tid == 0) { chunk_offsets[0] = 0; carry = 0; }
    __syncthreads();
    for (int base = 0; base < N; base += blockDim.x) {
        const int i = base + tid;
        int x = 0;
        if (i < N) {
            x = chunk_count((long long)cu_seqlens[i + 1] - (long long)cu_seqlens[i]);
        }
        for (int off = 1; off < 32; off <<= 1) {  // inclusive scan in the warp
            const int y = __shfl_up_sync(0xffffffffu, x, off);
            if (lane >= off) x += y;
        }
        if (lane == 31) warp_prefix[wp] = x;
        __syncthreads();
        if (wp == 0) {  // inclusive scan of the warp totals
            int t = lane < warps ? warp_prefix[lane] : 0;
            for (int off = 1; off < 32; off <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, t, off);
                if (lane >= off) t += y;
            }
            if (lane < warps) warp_prefix[lane] = t;
        }
        __syncthreads();
        const int prefix = carry + (wp > 0 ? warp_prefix[wp - 1] : 0) + x;
        if (i < N) chunk_offsets[i + 1] = prefix;
        __syncthreads();  // every thread has read carry
        if (tid == blockDim.x - 1) carry = prefix;
        __syncthreads();
    }
}
