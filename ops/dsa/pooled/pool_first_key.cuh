/* The first-key kernel (FIRST_NAME) of the pool-forming module: compiled with it, launched before the pool kernel
   when the keys' validity comes from the flags in the token rows (MASK_FLAGS). Needs pool_rows_device.cuh. */
#if MASK == MASK_FLAGS
// Each batch row's first valid key, from the flags of its token rows (one CTA a row, FIRST_THREADS threads, 4 tokens
// a thread per round): rounds stop at the first that finds one, so a row without left padding costs one round. The
// flags a round reads are written to the bool mask (the pool kernel writes the rest: every token from first on).
extern "C" __global__ void __launch_bounds__(FIRST_THREADS) FIRST_NAME(
    const char* __restrict__ flags, unsigned char* __restrict__ valid, long long* __restrict__ first,
    long long sb, long long st, int T)
{
    __shared__ int found;
    const int b = blockIdx.x;
    if (threadIdx.x == 0) found = T;
    __syncthreads();
    const char* row = flags + (long long)b * sb;
    for (int t0 = 0; t0 < T; t0 += 4 * FIRST_THREADS) {
        int mine = T;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int t = t0 + u * FIRST_THREADS + threadIdx.x;
            if (t < T) {
                const bool ok = is_valid_flag(*reinterpret_cast<const unsigned short*>(row + (long long)t * st));
                valid[(long long)b * T + t] = ok;
                if (ok && t < mine) mine = t;
            }
        }
        if (mine < T) atomicMin(&found, mine);
        __syncthreads();
        const bool done = found < T;
        __syncthreads();  // every thread has read found before any adds to it in the next round
        if (done) break;
    }
    if (threadIdx.x == 0) first[b] = found;
}
#endif
