/* The pool-forming kernel over whole token rows (KERNEL_NAME) and, with MASK_FLAGS, the first-key kernel, one
   NVRTC module; pooled/cuda_keys_source.py describes them and prepends the specialisation's #defines (IS_BF16, POOL,
   CPL, APE_IN_REGISTERS, SPANS, PAIRS, MASK and its values, MAX_WARPS, KERNEL_NAME, FIRST_NAME, FIRST_THREADS). */
#include "pool_rows_device.cuh"
#include "pool_first_key.cuh"

extern "C" __global__ void __launch_bounds__(32 * MAX_WARPS, 3) KERNEL_NAME(
    const char* __restrict__ base0, const char* __restrict__ base1, unsigned char* __restrict__ valid,
    const float* __restrict__ ape, const long long* __restrict__ first, ELEM* __restrict__ pk,
    unsigned char* __restrict__ pool_valid,
    long long sb0, long long st0, long long sb1, long long st1, long long svb, long long svt,
    int w0, int w1, int k_off, int g_off, int v_off, int B, int T, int NP, int D, int stage_bytes, int span1_at)
{
    extern __shared__ __align__(16) char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int total = B * NP, step = gridDim.x * warps;
    int idx = blockIdx.x * warps + warp;
    if (idx >= total) return;  // (whole warps; no CTA barrier below)
    char* const bufs = smem + (size_t)(warp * 2) * stage_bytes;  // this warp's two stages, stage_bytes each

#if APE_IN_REGISTERS
    float a[CPL][POOL];  // ape[j, c] of this lane's channels, for the kernel's life
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
        const int c = lane + 32 * i;
#pragma unroll
        for (int j = 0; j < POOL; ++j) a[i][j] = c < D ? ape[j * D + c] : 0.0f;
    }
#define APE(i, j, c) a[i][j]
#else
#define APE(i, j, c) __ldg(ape + (j) * D + (c))
#endif
    // the gates' span and stride (span 1, or span 0 when keys and gates share a row)
    const long long gst = SPANS == 2 ? st1 : st0;
    const unsigned pool_bits = POOL == 32 ? 0xffffffffu : ((1u << POOL) - 1u);

    Stage cur = issue(idx, bufs, base0, base1, first, sb0, st0, sb1, st1, w0, w1, T, NP, span1_at, lane);
    int stage = 0;
    for (; idx < total; idx += step) {
        const int next = idx + step;
        Stage nxt = cur;
        if (next < total) {
            nxt = issue(next, bufs + (stage ^ 1) * stage_bytes, base0, base1, first, sb0, st0, sb1, st1, w0, w1, T,
                        NP, span1_at, lane);
            asm volatile("cp.async.wait_group 1;\n" ::);
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::);
        }
        __syncwarp();  // every lane's copies of this stage are visible to the warp
        const int b = idx / NP, p = idx - b * NP;
        const char* here = bufs + stage * stage_bytes;
        const char* ks = here + cur.shift0 + k_off;
        const char* gs = (SPANS == 2 ? here + span1_at + cur.shift1 : here + cur.shift0) + g_off;
        // which of the pool's tokens exist and are valid: lane j looks at token j
        bool ok = lane < cur.rows;
        if (MASK == MASK_INPUT && ok) ok = valid[(long long)b * svb + (cur.tok0 + lane) * svt] != 0;
        if (MASK == MASK_FLAGS && ok) {  // the token row's flag element; the bool mask is written as it is read
            ok = is_valid_flag(*reinterpret_cast<const unsigned short*>(here + cur.shift0 + lane * st0 + v_off));
            valid[(long long)b * T + cur.tok0 + lane] = ok;
        }
        const unsigned keep = __ballot_sync(0xffffffffu, ok) & pool_bits;
        ELEM* out = pk + ((long long)b * NP + p) * D;
#if PAIRS
        // channels c and c + 32 together: their probabilities and keys packed in one register each, one 16-bit
        // pair multiply rounding both products (the product of two 16-bit values is exact in fp32, so this is the
        // rounding of the fp32 product, bit for bit)
#pragma unroll
        for (int i = 0; i < CPL; i += 2) {
            const int c0 = lane + 32 * i, c1 = c0 + 32;
            float e0[POOL], e1[POOL];
            const float inv0 = pool_weights(e0, gs + 2 * c0, gst, keep, [&](int j) { return APE(i, j, c0); });
            const float inv1 = pool_weights(e1, gs + 2 * c1, gst, keep, [&](int j) { return APE(i + 1, j, c1); });
            float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
            for (int j = 0; j < POOL; ++j) {
                const char* row = ks + j * st0;
                const unsigned keys = (keep >> j) & 1u  // an excluded token's key (any bits, NaN included): 0
                    ? (unsigned)smem_elem(row + 2 * c0) | ((unsigned)smem_elem(row + 2 * c1) << 16) : 0u;
                const unsigned prod = mul_pair(pack_pair(e0[j] * inv0, e1[j] * inv1), keys);
                acc0 += low_f32(prod);
                acc1 += high_f32(prod);
            }
            out[c0] = from_f32(acc0);
            out[c1] = from_f32(acc1);
        }
#else
#pragma unroll
        for (int i = 0; i < CPL; ++i) {
            const int c = lane + 32 * i;
            if (c < D) {
                float e[POOL];
                const float inv = pool_weights(e, gs + 2 * c, gst, keep, [&](int j) { return APE(i, j, c); });
                float acc = 0.0f;
#pragma unroll
                for (int j = 0; j < POOL; ++j) {
                    // an excluded token's key (any bits, NaN included) takes no part
                    const float key = (keep >> j) & 1u ? to_f32(smem_elem(ks + j * st0 + 2 * c)) : 0.0f;
                    acc += to_f32(from_f32(to_f32(from_f32(e[j] * inv)) * key));
                }
                out[c] = from_f32(acc);
            }
        }
#endif
        if (lane == 0) pool_valid[(long long)b * NP + p] = __popc(keep) == POOL;
        __syncwarp();  // every lane has read this stage before the next iteration refills it
        cur = nxt;
        stage ^= 1;
    }
}
