/* The DSA top-k of a few rows held in registers, one CTA or a cluster of two per row (a radix select over the
   int32 score codes, then a compaction in key order); described in indexer/cuda_topk.py, which prepends THREADS, PER
   (codes a thread holds) and CLUSTER (CTAs per row). */
#define FULL 0xffffffffu
#if CLUSTER > 1
/* the CTAs of a row's cluster: shared memory of the peer CTA, and a barrier of the whole cluster */
__device__ __forceinline__ int cluster_rank() {
    unsigned int r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return (int)r;
}
__device__ __forceinline__ int load_peer(const int* p, int rank) {
    unsigned int local_addr, addr; int v;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(local_addr) : "l"(p));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(addr) : "r"(local_addr), "r"(rank));
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS, 1) dsa_topk_resident(
#else
extern "C" __global__ void __launch_bounds__(THREADS, 1) dsa_topk_resident(
#endif
    const int* __restrict__ codes, const long long* __restrict__ Lo, const long long* __restrict__ Hi,
    int* __restrict__ out, long long scb, long long scs, long long sct, long long sob, long long sos, long long sok,
    long long row0, int topk, long long queries, long long keys, int causal)
{
    __shared__ int hist[2][256];  // this CTA's histogram of the round (by round parity: the peer may still read it)
    __shared__ int warp_hist[THREADS / 32][256];  // each warp's own histogram: no atomics across warps
    __shared__ int scan[2][THREADS / 32];
    __shared__ unsigned int state[2][4];  // prefix, mask, remaining, whole (the rest of the matching keys are in)
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5;
#if CLUSTER > 1
    __shared__ int hist_all[256];  // the cluster's histogram of the round
    __shared__ int totals[2];      // this CTA's selected-for-sure and tied counts
    const int rank = cluster_rank();
#else
    const int rank = 0;
#endif
    const long long local = blockIdx.x / CLUSTER, b = blockIdx.y;
    long long lo = 0, hi = keys;  // Lo null: the ranges of a call without packed sequences (visible_ranges)
    if (Lo != nullptr) {
        lo = Lo[row0 + local]; hi = Hi[row0 + local];
    } else if (causal) {
        hi = row0 + local + keys - queries + 1;
        hi = hi < 0 ? 0 : hi;
    }
    const int* row = codes + b * scb + local * scs;
    int* dst = out + b * sob + local * sos;
    const long long c0 = lo + ((long long)rank * THREADS + tid) * PER;

    // u: the code with its sign bit flipped (the same order, unsigned), 0 for a key outside [lo, hi)
    unsigned int u[PER];
    if (sct == 1 && (reinterpret_cast<unsigned long long>(row + c0) & 15) == 0) {  // (the same for every thread)
#pragma unroll
        for (int q = 0; q < PER / 4; ++q) {
            const long long c = c0 + 4 * q;
            if (c + 3 < hi) {
                const int4 x = *reinterpret_cast<const int4*>(row + c);
                u[4 * q] = (unsigned int)x.x ^ 0x80000000u; u[4 * q + 1] = (unsigned int)x.y ^ 0x80000000u;
                u[4 * q + 2] = (unsigned int)x.z ^ 0x80000000u; u[4 * q + 3] = (unsigned int)x.w ^ 0x80000000u;
            } else {
#pragma unroll
                for (int e = 0; e < 4; ++e) u[4 * q + e] = c + e < hi ? (unsigned int)row[c + e] ^ 0x80000000u : 0u;
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const long long c = c0 + j;
            u[j] = c < hi ? (unsigned int)row[c * sct] ^ 0x80000000u : 0u;
        }
    }

    unsigned int prefix = 0u, mask = 0u, whole = 0u;
    int remaining = topk;
    for (int i = tid; i < 256 * (THREADS / 32); i += THREADS) (&warp_hist[0][0])[i] = 0;
    __syncthreads();
    for (int rnd = 0; rnd < 4 && !whole; ++rnd) {  // (uniform: every thread reads the same state)
        const int shift = 24 - 8 * rnd;
        unsigned int* const st = state[rnd & 1];  // (by round parity: no barrier between reading and rewriting)
#pragma unroll
        for (int j = 0; j < PER; ++j)
            if (u[j] != 0u && (u[j] & mask) == prefix) atomicAdd(&warp_hist[wp][(u[j] >> shift) & 255u], 1);
        __syncthreads();
        for (int i = tid; i < 256; i += THREADS) {
            int sum = 0;
#pragma unroll
            for (int w = 0; w < THREADS / 32; ++w) { sum += warp_hist[w][i]; warp_hist[w][i] = 0; }  // (next round)
            hist[rnd & 1][i] = sum;
        }
#if CLUSTER > 1
        cluster_sync();  // every CTA's histogram of the round is complete
        for (int i = tid; i < 256; i += THREADS)
            hist_all[i] = hist[rnd & 1][i] + load_peer(&hist[rnd & 1][i], rank ^ 1);
        const int* const round_hist = hist_all;
#else
        const int* const round_hist = hist[rnd & 1];
#endif
        __syncthreads();
        if (wp == 0) {  // the bin holding the remaining-th best matching key; lane l scans bins 255 - 8 l - k
            int count[8], own = 0;
#pragma unroll
            for (int k = 0; k < 8; ++k) { count[k] = round_hist[255 - 8 * lane - k]; own += count[k]; }
            int upto = own;  // matching keys in the bins of lanes <= this one (higher bins first)
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const int y = __shfl_up_sync(FULL, upto, off);
                if (lane >= off) upto += y;
            }
            const int total = __shfl_sync(FULL, upto, 31), above = upto - own;
            if (rnd == 0 && total <= remaining) {  // every visible key is in
                if (lane == 0) { st[0] = 0u; st[1] = 0u; st[2] = (unsigned int)total; st[3] = 1u; }
            } else if (above < remaining && remaining <= upto) {  // (exactly one lane)
                int acc = above;
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    if (acc < remaining && remaining <= acc + count[k]) {
                        const unsigned int bin = 255u - 8u * lane - k;
                        const int need = remaining - acc;
                        st[0] = prefix | (bin << shift);
                        st[1] = mask | (255u << shift);
                        st[2] = (unsigned int)need;
                        st[3] = need == count[k] ? 1u : 0u;
                    }
                    acc += count[k];
                }
            }
        }
        __syncthreads();
        prefix = st[0]; mask = st[1]; remaining = (int)st[2]; whole = st[3];
    }

    // keys above the prefix are in; of those equal to it (after four rounds: the code tau), all when whole, else
    // the first `remaining` in key order
    int sure = 0, tied = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        if (u[j] != 0u) {
            const unsigned int v = u[j] & mask;
            sure += v > prefix;
            tied += v == prefix;
        }
    }
    if (whole) { sure += tied; tied = 0; }
    int xs = sure, xt = tied;  // block-wide exclusive scans of both counts
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int ys = __shfl_up_sync(FULL, xs, off), yt = __shfl_up_sync(FULL, xt, off);
        if (lane >= off) { xs += ys; xt += yt; }
    }
    if (lane == 31) { scan[0][wp] = xs; scan[1][wp] = xt; }
    __syncthreads();
    if (wp == 0) {
        int s = lane < THREADS / 32 ? scan[0][lane] : 0, t = lane < THREADS / 32 ? scan[1][lane] : 0;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int ys = __shfl_up_sync(FULL, s, off), yt = __shfl_up_sync(FULL, t, off);
            if (lane >= off) { s += ys; t += yt; }
        }
        if (lane < THREADS / 32) { scan[0][lane] = s; scan[1][lane] = t; }
    }
    __syncthreads();
    int sure_before = xs - sure + (wp > 0 ? scan[0][wp - 1] : 0);
    int tie_rank = xt - tied + (wp > 0 ? scan[1][wp - 1] : 0);
    int sure_all = scan[0][THREADS / 32 - 1], tied_all = scan[1][THREADS / 32 - 1];
#if CLUSTER > 1
    if (tid == 0) { totals[0] = sure_all; totals[1] = tied_all; }
    cluster_sync();  // both CTAs' counts are written
    {
        const int peer_sure = load_peer(&totals[0], rank ^ 1), peer_tied = load_peer(&totals[1], rank ^ 1);
        if (rank == 1) { sure_before += peer_sure; tie_rank += peer_tied; }  // rank 0 holds the lower keys
        sure_all += peer_sure; tied_all += peer_tied;
    }
    cluster_sync();  // the peer's reads of this CTA's shared memory are done before either CTA exits
#endif
    const int selected = sure_all + min(tied_all, remaining);
    int pos = sure_before + min(tie_rank, remaining);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        if (u[j] != 0u) {
            const unsigned int v = u[j] & mask;
            bool take = v > prefix || (whole && v == prefix);
            if (!whole && v == prefix) take = tie_rank++ < remaining;
            if (take) dst[(pos++) * sok] = (int)(c0 + j);
        }
    }
    for (int p = selected + rank * THREADS + tid; p < topk; p += CLUSTER * THREADS) dst[p * sok] = -1;
}
