// The KDA / GDN prefill's recurrence, kda_scan_mma: bf16, K = V = 128, the fp32 state in registers. One CTA of
// BV / 16 warps per (value block, head, sequence): grid (128 / BV, HV, N). Design: docs/kda-kernels.md section 5;
// the contract and the stage layout: scan_source.py, which prepends the specialisation's #defines (NSTAGE, BV, WARPS,
// CU_T, IS_VARLEN, HAS_H0, STORE_HT, ROW_FACTORS, INLINE_SEQS and the stage layout W_OFF, QG_OFF, KD_OFF,
// A_OFF, DECAY_OFF, U_OFF, FACT_OFF, STAGE_BYTES).
#include "chunk_count.cuh"

typedef unsigned int u32;
typedef unsigned short bf16;  // raw bits (no cuda_bf16.h: NVRTC may have no include path)
#define KD 128
#define VD 128

__device__ __forceinline__ float lo_bf(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi_bf(u32 v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ u32 pack(float lo, float hi) {  // two floats rounded to bf16, lo in the low half
    u32 p; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(hi), "f"(lo)); return p;
}
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
// byte offset of (row, 16-byte chunk) in a bf16 tile of 128, 64 or 32 columns: chunks XOR-swizzled by row, so
// the 8 rows one ldmatrix matrix reads fall in different banks
__device__ __forceinline__ u32 swz128(int row, int chunk) { return row * 256 + ((chunk ^ (row & 7)) << 4); }
__device__ __forceinline__ u32 swz64(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }
__device__ __forceinline__ u32 swz32(int row, int chunk) { return row * 64 + ((chunk ^ ((row >> 1) & 3)) << 4); }
#if BV == 128
#define SWZ_U swz128
#elif BV == 64
#define SWZ_U swz64
#else
#define SWZ_U swz32
#endif
__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void ldm_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldm_x4_t(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void cp16(u32 dst, const void* src, bool ok) {  // zeros when !ok
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(ok ? 16 : 0));
}

__device__ __forceinline__ void stm_x4_t(u32 addr, const u32 (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};"
                 :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]));
}

// acc[t] = (S^T x^T) for the 8 token tiles of a token-major bf16 tile x [64][128] at shared address x_s: the
// state's A fragments sa times x's B fragments (plain ldmatrix, lane rows / chunks of pattern "b" below)
__device__ __forceinline__ void state_times_tile(float (&acc)[8][4], const u32 (&sa)[8][4], u32 x_s, int b_row_l,
                                                 int b_chunk_l) {
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
#pragma unroll
        for (int tp = 0; tp < 4; ++tp) {
            u32 b[4];
            ldm_x4(b, x_s + swz128(16 * tp + b_row_l, 2 * kk + b_chunk_l));
            mma_bf16(acc[2 * tp], sa[kk], b[0], b[1]);
            mma_bf16(acc[2 * tp + 1], sa[kk], b[2], b[3]);
        }
}

extern "C" __global__ void __launch_bounds__(32 * WARPS, 1) kda_scan_mma(
    const bf16* __restrict__ W, const bf16* __restrict__ U, const bf16* __restrict__ QG, const bf16* __restrict__ KDt,
    const bf16* __restrict__ AQK, const float* __restrict__ DECAY, bf16* __restrict__ O, const float* __restrict__ H0,
    float* __restrict__ HT, const CU_T* __restrict__ cu_seqlens, const int* __restrict__ chunk_offsets,
    const float* __restrict__ FACT, int T, int HV, int H, long long h0_sn, long long h0_sh, long long h0_sk,
    long long h0_sv)
{
    constexpr int NTHREADS = 32 * WARPS;
    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5, gid = lane >> 2, tig = lane & 3;
    const int hv = blockIdx.y, n = blockIdx.z, v0 = BV * blockIdx.x, wc = 16 * wp;  // this warp: columns v0 + wc ..
    long long bos;
    int seq_len, first_chunk;
#if IS_VARLEN
    bos = (long long)cu_seqlens[n];
    seq_len = (int)((long long)cu_seqlens[n + 1] - bos);
    if (gridDim.z <= INLINE_SEQS) {
        // few sequences, no chunk plan: the chunks of the sequences before n, counted by each warp (every load
        // issued at once)
        int count = 0;
#pragma unroll
        for (int r = 0; r < INLINE_SEQS / 32; ++r) {
            const int i = 32 * r + lane;
            if (i < n) {
                count += chunk_count((long long)cu_seqlens[i + 1] - (long long)cu_seqlens[i]);
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) count += __shfl_xor_sync(0xffffffffu, count, off);
        first_chunk = count;
    } else {
        first_chunk = chunk_offsets[n];
    }
    const long long packed_end = (long long)cu_seqlens[gridDim.z];  // o's rows from here on belong to no sequence
#else
    bos = (long long)n * T;
    seq_len = T;
    first_chunk = n * ((T + 63) / 64);
#endif
    const int nch = (seq_len + 63) / 64;
    const long long k_row = (long long)HV * KD, v_row = (long long)HV * VD, a_row = (long long)HV * 64;

    // ---- the fp32 state, transposed, in mma C layout: ST[j][e] = S[8 j + 2 tig + (e & 1)][wc + gid + 8 (e >> 1)]
    float ST[16][4];
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
#if HAS_H0
            const int key = 8 * j + 2 * tig + (e & 1), col = v0 + wc + gid + 8 * (e >> 1);
            ST[j][e] = H0[n * h0_sn + hv * h0_sh + key * h0_sk + col * h0_sv];
#else
            ST[j][e] = 0.f;
#endif
        }

    // ---- the chunk's tiles by cp.async (zeros past the sequence). Each thread copies fixed 16-byte columns of
    // fixed rows: its global pointers advance by whole chunks, its shared offsets are constants. ----------------
    constexpr int KR = NTHREADS / 16, AR = NTHREADS / 8, UC = BV / 8, UR = NTHREADS / UC;  // rows per pass
    const int krow = tid / 16, kch = tid % 16, arow = tid / 8, ach = tid % 8, urow = tid / UC, uch = tid % UC;
    const long long k_off = (bos + krow) * k_row + hv * KD + kch * 8;
    const long long a_off = (bos + arow) * a_row + hv * 64 + ach * 8;
    const long long u_off = (bos + urow) * v_row + hv * VD + v0 + uch * 8;
    auto copy_rows = [&](u32 st, int c, int nvalid, bool full) {  // full: a whole chunk, no row checks (inlined)
        const long long kc = k_off + 64LL * c * k_row, ac = a_off + 64LL * c * a_row, uc = u_off + 64LL * c * v_row;
#if ROW_FACTORS  // QG / KDt are the raw q / k [TT, H, 128] of this value head's q/k head (formed per chunk: held
        // across the loop, these offsets spilled registers with 32 value columns a CTA)
        const long long q_row = (long long)H * KD;
        const long long qc = ((bos + krow + 64LL * c) * H + hv / (HV / H)) * KD + kch * 8;
#else
        const long long q_row = k_row, qc = kc;
#endif
#pragma unroll
        for (int i = 0; i < 64 / KR; ++i) {  // w, qg, kd (or q, k): [64][128]
            const int row = krow + KR * i;
            const bool ok = full || row < nvalid;
            const long long off = ok ? kc + KR * i * k_row : 0, qoff = ok ? qc + KR * i * q_row : 0;
            const u32 dst = st + swz128(row, kch);
            cp16(dst + W_OFF, W + off, ok);
            cp16(dst + QG_OFF, QG + qoff, ok);
            cp16(dst + KD_OFF, KDt + qoff, ok);
        }
#pragma unroll
        for (int i = 0; i < 64 / AR; ++i) {  // A_qk: [64][64]
            const int row = arow + AR * i;
            const bool ok = full || row < nvalid;
            cp16(st + A_OFF + swz64(row, ach), AQK + (ok ? ac + AR * i * a_row : 0), ok);
        }
#pragma unroll
        for (int i = 0; i < 64 / UR; ++i) {  // u (this value block): [64][BV]
            const int row = urow + UR * i;
            const bool ok = full || row < nvalid;
            cp16(st + U_OFF + SWZ_U(row, uch), U + (ok ? uc + UR * i * v_row : 0), ok);
        }
    };
    auto issue = [&](int c) {  // one commit group per call, empty past the last chunk
        if (c < nch) {
            const u32 st = smem_addr(smem + (c % NSTAGE) * STAGE_BYTES);
            const int nvalid = min(64, seq_len - 64 * c);
            if (nvalid == 64)
                copy_rows(st, c, nvalid, true);
            else
                copy_rows(st, c, nvalid, false);
            if (tid < 32)
                cp16(st + DECAY_OFF + 16 * tid, DECAY + ((long long)(first_chunk + c) * HV + hv) * KD + 4 * tid, true);
#if ROW_FACTORS  // the chunk's q and k row factors [2][64] (0 past the sequence)
            else if (tid < 64)
                cp16(st + FACT_OFF + 16 * (tid - 32),
                     FACT + ((long long)(first_chunk + c) * HV + hv) * 128 + 4 * (tid - 32), true);
#endif
        }
        asm volatile("cp.async.commit_group;");
    };
#pragma unroll
    for (int c = 0; c < NSTAGE - 1; ++c) issue(c);

    // ldmatrix lane addresses. "a": matrices (rows +0, chunk +0), (+8, +0), (+0, +1), (+8, +1): with .trans the
    // B fragments of two 8-column tiles of a row-major [k][n] tile. "b": (+0, +0), (+0, +1), (+8, +0), (+8, +1):
    // the B fragments of two 8-row tiles of a row-major [n][k] tile, or with .trans the accumulator-layout
    // fragments of the transposes of two 8-row tiles.
    const int a_row_l = ((lane >> 3) & 1) * 8 + (lane & 7), a_chunk_l = lane >> 4;
    const int b_row_l = (lane >> 4) * 8 + (lane & 7), b_chunk_l = (lane >> 3) & 1;
    // this warp's o staging tile [64 tokens][16 columns] (two 16-byte chunks a row, swizzled), past the stages
    unsigned char* ostage = smem + NSTAGE * STAGE_BYTES + wp * 2048;
    auto oswz = [](int row, int chunk) { return row * 32 + ((chunk ^ ((row >> 2) & 1)) << 4); };

#pragma unroll 1
    for (int c = 0; c < nch; ++c) {
        asm volatile("cp.async.wait_group %0;" :: "n"(NSTAGE - 2));  // chunk c's group is complete
        __syncthreads();  // every thread's part of chunk c is visible; every warp is done with chunk c - 1
        issue(c + NSTAGE - 1);  // into chunk c - 1's stage
        const u32 st = smem_addr(smem + (c % NSTAGE) * STAGE_BYTES);
        const int nvalid = min(64, seq_len - 64 * c);

        // S^T rounded to bf16 as A fragments, one per 16 keys
        u32 sa[8][4];
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
#pragma unroll
            for (int q = 0; q < 4; ++q)
                sa[kk][q] = pack(ST[2 * kk + (q >> 1)][2 * (q & 1)], ST[2 * kk + (q >> 1)][2 * (q & 1) + 1]);

        // ---- v_new^T = u^T - S^T w^T: 16 columns x 8 token tiles, then rounded to bf16 as A fragments (va[kk]:
        // tokens 16 kk ..) -----------------------------------------------------------------------------------------
        u32 va[4][4];
        {
            float acc[8][4];
            state_times_tile(acc, sa, st + W_OFF, b_row_l, b_chunk_l);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                u32 uu[4];  // u^T in the accumulator layout (transposed load of the token-major u tile)
                ldm_x4_t(uu, st + U_OFF + SWZ_U(16 * kk + b_row_l, wc / 8 + b_chunk_l));
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const float* a = acc[2 * kk + (q >> 1)] + 2 * (q & 1);
                    va[kk][q] = pack(lo_bf(uu[q]) - a[0], hi_bf(uu[q]) - a[1]);
                }
            }
        }

        // ---- o^T = S^T qg^T + v_new^T A_qk^T (A_qk lower triangular: token blocks kk <= tp), stored through the
        // staging tile (stmatrix.trans) as 16-byte rows ----------------------------------------------------------
        {
            float acc[8][4];
            state_times_tile(acc, sa, st + QG_OFF, b_row_l, b_chunk_l);
#if ROW_FACTORS  // S^T q^T, then each token's column times its q factor: S^T qg^T with qg = diag(qf) q
            {
                const float* fq = reinterpret_cast<const float*>(smem + (c % NSTAGE) * STAGE_BYTES + FACT_OFF);
#pragma unroll
                for (int t = 0; t < 8; ++t) {
                    const float2 f = *reinterpret_cast<const float2*>(fq + 8 * t + 2 * tig);
                    acc[t][0] *= f.x; acc[t][1] *= f.y; acc[t][2] *= f.x; acc[t][3] *= f.y;
                }
            }
#endif
#pragma unroll
            for (int tp = 0; tp < 4; ++tp)
#pragma unroll
                for (int kk = 0; kk <= tp; ++kk) {
                    u32 b[4];
                    ldm_x4(b, st + A_OFF + swz64(16 * tp + b_row_l, 2 * kk + b_chunk_l));
                    mma_bf16(acc[2 * tp], va[kk], b[0], b[1]);
                    mma_bf16(acc[2 * tp + 1], va[kk], b[2], b[3]);
                }
            const u32 os = smem_addr(ostage);
#pragma unroll
            for (int tp = 0; tp < 4; ++tp) {
                const u32 r[4] = {pack(acc[2 * tp][0], acc[2 * tp][1]), pack(acc[2 * tp][2], acc[2 * tp][3]),
                                  pack(acc[2 * tp + 1][0], acc[2 * tp + 1][1]), pack(acc[2 * tp + 1][2], acc[2 * tp + 1][3])};
                stm_x4_t(os + oswz(16 * tp + b_row_l, b_chunk_l), r);
            }
            __syncwarp();
            bf16* dst = O + (bos + 64LL * c) * v_row + hv * VD + v0 + wc;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = 16 * i + (lane >> 1), chunk = lane & 1;
                if (row < nvalid)
                    *reinterpret_cast<uint4*>(dst + row * v_row + 8 * chunk) =
                        *reinterpret_cast<const uint4*>(ostage + oswz(row, chunk));
            }
        }

        // ---- S^T = S^T diag(decay) + v_new^T kd ------------------------------------------------------------------
        {
            const float* dec = reinterpret_cast<const float*>(smem + (c % NSTAGE) * STAGE_BYTES + DECAY_OFF);
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const float2 d = *reinterpret_cast<const float2*>(dec + 8 * j + 2 * tig);
                ST[j][0] *= d.x; ST[j][1] *= d.y; ST[j][2] *= d.x; ST[j][3] *= d.y;
            }
#if ROW_FACTORS  // v_new^T kd = (v_new^T diag(kf)) k: each token's column of v_new^T times its k factor
            {
                const float* fk = reinterpret_cast<const float*>(smem + (c % NSTAGE) * STAGE_BYTES + FACT_OFF) + 64;
#pragma unroll
                for (int kk = 0; kk < 4; ++kk)
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        const float2 f = *reinterpret_cast<const float2*>(fk + 16 * kk + 8 * (q >> 1) + 2 * tig);
                        va[kk][q] = pack(lo_bf(va[kk][q]) * f.x, hi_bf(va[kk][q]) * f.y);
                    }
            }
#endif
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
#pragma unroll
                for (int jp = 0; jp < 8; ++jp) {
                    u32 b[4];
                    ldm_x4_t(b, st + KD_OFF + swz128(16 * kk + a_row_l, 2 * jp + a_chunk_l));
                    mma_bf16(ST[2 * jp], va[kk], b[0], b[1]);
                    mma_bf16(ST[2 * jp + 1], va[kk], b[2], b[3]);
                }
        }
    }

#if IS_VARLEN
    {
        // the rows of o past the last sequence (tokens of no sequence) read 0, as in the reference: CTA n zeroes its
        // value columns of rows last + n, last + n + N, ... (none in the usual call)
        const int N = gridDim.z;
        const long long last = max(0LL, packed_end);
        const long long rows = last + n < T ? (T - last - n + N - 1) / N : 0;
        for (long long i = tid; i < rows * (BV / 8); i += NTHREADS) {
            const long long row = last + n + (i / (BV / 8)) * N;
            *reinterpret_cast<uint4*>(O + row * v_row + hv * VD + v0 + 8 * (i % (BV / 8))) = make_uint4(0, 0, 0, 0);
        }
    }
#endif
#if STORE_HT
    float* ht = HT + ((long long)n * HV + hv) * KD * VD + v0 + wc + gid;
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            ht[(8 * j + 2 * tig + (e & 1)) * VD + 8 * (e >> 1)] = ST[j][e];
#endif
}
