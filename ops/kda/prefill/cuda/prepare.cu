// The KDA / GDN prepare kernel, kda_prepare_mma: bf16 q / k / v with K = V = 128, one CTA of 4 warps per 64-token
// chunk of one value head (grid (chunk slots, HV)). Design: docs/kda-kernels.md section 4 (the per-channel gate),
// docs/gdn.md section 4 (the scalar gate); the contract and the layout: prepare_source.py; the launch: launch.py.
//
// The launcher prepends the specialisation's #defines (prepare_source.kernel_source): element types G_T,
// BETA_T, CU_T; the flags IS_VARLEN, INLINE_OFFSETS, L2NORM, HAS_A_LOG, HAS_DT_BIAS, BETA_SIGMOID, SAVE_AKK,
// SCALAR_GATE, ROW_FACTORS, GATE_SOFTPLUS, WIDE_BLOCKS; and the shared-memory layout (XS_OFF, VS_OFF, BETA_OFF,
// UNION_OFF, KEYS_BYTES, STAGE_OFF, NSTAGE, STAGE_BYTES, G_BYTES, LD) with the constants KEY_ANCHOR, STEP_CLAMP,
// INLINE_SEQS, so the Python launch description and the kernel read one set of numbers.
//
// The kernel: the prologue (the chunk's place, pointers, the v tile's copies, beta, the rows' L2-norm factors), one
// pass 1 chosen by the gate's form (SCALAR_GATE: prepare_pass1_scalar.cuh, else prepare_pass1_channel.cuh, whose
// slice copies are issued in the prologue), then for every form A_qk to global memory, the triangular inverse
// T = (I + L)^-1 and pass 2: w = T x, u = T (beta v).
#include "chunk_count.cuh"
#include "prepare_device.cuh"

extern "C" __global__ void __launch_bounds__(128, 3) kda_prepare_mma(
    const bf16* __restrict__ Q, const bf16* __restrict__ Kin, const bf16* __restrict__ Vin,
    const G_T* __restrict__ Gin, const BETA_T* __restrict__ Beta, const float* __restrict__ Alog,
    const float* __restrict__ DtBias, bf16* __restrict__ W, bf16* __restrict__ U, bf16* __restrict__ QG,
    bf16* __restrict__ KDo, bf16* __restrict__ AQK, float* __restrict__ DECAY, bf16* __restrict__ AKK,
    const CU_T* __restrict__ cu_seqlens, const int* __restrict__ chunk_offsets,
    int T, int N, int H, int HV, float scale, float beta_scale, float lower_bound)
{
    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, wp = (tid >> 5) & 3, gid = lane >> 2, tig = lane & 3;
    // (& 3: the compiler learns wp < 4, which keeps the wide-block forms from spilling: docs/kda-kernels.md section 4.1)
    const int slot = blockIdx.x, hv = blockIdx.y, h = hv / (HV / H);
    long long bos;
    int seq_len, chunk;
#if IS_VARLEN
    {
        int lo = N, first = 0;  // the sequence holding this chunk slot (N: past the last sequence), its first slot
#if INLINE_OFFSETS
        // No chunk plan (at most INLINE_SEQS sequences): lane i loads the offsets of sequences i, i + 32, ...; a warp
        // scan of their chunk counts gives each sequence's first slot, a ballot the sequence holding this slot, and
        // its lane passes its offsets on (one round of loads up to 32 sequences).
        int carry = 0;
        for (int base = 0; base < N; base += 32) {
            int b0 = 0, b1 = 0, count = 0;  // (offsets fit an int: the kernel's T is one)
            if (base + lane < N) {
                b0 = (int)cu_seqlens[base + lane];
                b1 = (int)cu_seqlens[base + lane + 1];
                count = chunk_count(b1 - b0);
            }
            int x = count;
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const int y = __shfl_up_sync(FULL, x, off);
                if (lane >= off) x += y;
            }
            const int begin = carry + x - count;
            const unsigned holds = __ballot_sync(FULL, slot >= begin && slot < begin + count);
            if (holds) {
                const int src = __ffs(holds) - 1;
                lo = base + src;
                first = __shfl_sync(FULL, begin, src);
                const int b = __shfl_sync(FULL, b0, src);
                bos = b;
                seq_len = __shfl_sync(FULL, b1, src) - b;
                break;
            }
            carry += __shfl_sync(FULL, x, 31);
        }
        if (lo >= N) return;
#else
        {
            // the last n <= N with chunk_offsets[n] <= slot. Each warp searches 32-ary, one probe a lane (the probes
            // that hold form a prefix of the lanes: the offsets do not decrease), so N <= 32 takes one round of
            // loads and N <= 1024 two, not log2(N + 1).
            int hi = N;
            lo = 0;
            while (lo < hi) {
                const int step = (hi - lo + 31) >> 5, probe = lo + (lane + 1) * step;
                const bool holds = probe <= hi && chunk_offsets[probe] <= slot;
                lo += __popc(__ballot_sync(FULL, holds)) * step;
                hi = min(hi, lo + step - 1);
            }
            if (lo < N) first = chunk_offsets[lo];
        }
        if (lo >= N) return;
        bos = (long long)cu_seqlens[lo];
        seq_len = (int)((long long)cu_seqlens[lo + 1] - bos);
#endif
        chunk = slot - first;
    }
#else
    {
        const int nch = (T + 63) / 64;
        bos = (long long)(slot / nch) * T;
        seq_len = T;
        chunk = slot % nch;
    }
#endif
    const int start = chunk * 64;
    const int nvalid = min(64, seq_len - start);
    const long long t0 = bos + start;
    const long long qs_row = (long long)H * KD, vs_row = (long long)HV * KD, a_row = (long long)HV * 64;
    const bf16* q = Q + (t0 * H + h) * KD;
    const bf16* k = Kin + (t0 * H + h) * KD;
    const bf16* v = Vin + (t0 * HV + hv) * KD;
    const G_T* g = Gin + (t0 * HV + hv) * KD;
    const long long o_off = (t0 * HV + hv) * KD;
    unsigned char* xs = smem + XS_OFF;
    unsigned char* vsm = smem + VS_OFF;
    float* betas = reinterpret_cast<float*>(smem + BETA_OFF);
    float* keys = reinterpret_cast<float*>(smem + UNION_OFF);             // [2][4][32][8]
    float* sums = reinterpret_cast<float*>(smem + UNION_OFF + KEYS_BYTES); // [2][4][16]

    // ---- v tile by cp.async (zeros past the sequence), beta ---------------------------------------
    for (int i = tid; i < 64 * 16; i += 128) {
        const int row = i >> 4, ch = i & 15;
        const bool ok = row < nvalid;
        const bf16* src = v + (ok ? row * vs_row + ch * 8 : 0);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                     :: "r"(smem_addr(vsm) + swz(row, ch)), "l"(src), "r"(ok ? 16 : 0));
    }
    asm volatile("cp.async.commit_group;");
#if !SCALAR_GATE  // the per-channel pass 1's slice copies, issued right after the v tile's so their round trips
                  // overlap the L2 norms' loads (docs/kda-kernels.md section 4)
    // q / k / gate slices arrive by cp.async, NSTAGE slices ahead, into [64][16] tiles (16-byte chunks
    // swizzled by row bit 2); each warp takes its block's mma fragments with ldmatrix
    unsigned char* stages = smem + STAGE_OFF;
    auto issue_slice = [&](int sl) {
        if (sl < KD / 16) {
            unsigned char* st = stages + (sl % NSTAGE) * STAGE_BYTES;
            const int row = tid >> 1, ch = tid & 1, c = 16 * sl + 8 * ch;
            const bool ok = row < nvalid;
            const u32 dst = smem_addr(st) + row * 32 + ((ch ^ ((row >> 2) & 1)) << 4);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                         :: "r"(dst), "l"(q + (ok ? row * qs_row + c : 0)), "r"(ok ? 16 : 0));
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                         :: "r"(dst + 2048), "l"(k + (ok ? row * qs_row + c : 0)), "r"(ok ? 16 : 0));
#if G_BYTES == 2
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                         :: "r"(dst + 4096), "l"(g + (ok ? row * vs_row + c : 0)), "r"(ok ? 16 : 0));
#else
            for (int part = 0; part < 2; ++part) {  // fp32 gate: [64][16] fp32, 4 chunks a row, unswizzled
                const int r2 = (tid + 128 * part) >> 2, ch2 = (tid + 128 * part) & 3;
                const bool ok2 = r2 < nvalid;
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                             :: "r"(smem_addr(st) + 4096 + r2 * 64 + ch2 * 16),
                                "l"(g + (ok2 ? r2 * vs_row + 16 * sl + 4 * ch2 : 0)), "r"(ok2 ? 16 : 0));
            }
#endif
        }
        asm volatile("cp.async.commit_group;");
    };
#pragma unroll
    for (int sl = 0; sl < NSTAGE; ++sl) issue_slice(sl);
#endif
    if (tid < 64) {
        float b = 0.f;
        if (tid < nvalid) {
            b = to_f(Beta[(t0 + tid) * HV + hv]);
#if BETA_SIGMOID
            b = beta_scale / (1.f + __expf(-b));
#endif
        }
        betas[tid] = b;
    }

    // ---- per-row scales: L2 norms over all 128 channels ---------------------------------------------
    const int row0 = 16 * wp + gid;  // this lane's rows: row0 and row0 + 8
    const bool ok0 = row0 < nvalid, ok1 = row0 + 8 < nvalid;
    float qsc[2] = {scale, scale}, ksc[2] = {1.f, 1.f};
#if L2NORM
    {
        float sq[2] = {0.f, 0.f}, sk[2] = {0.f, 0.f};
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            if (hh ? ok1 : ok0) {
                const int row = row0 + 8 * hh;
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const uint4 a = *reinterpret_cast<const uint4*>(q + row * qs_row + (tig + 4 * c) * 8);
                    const uint4 b = *reinterpret_cast<const uint4*>(k + row * qs_row + (tig + 4 * c) * 8);
                    const u32 av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        sq[hh] += lo_bf(av[e]) * lo_bf(av[e]) + hi_bf(av[e]) * hi_bf(av[e]);
                        sk[hh] += lo_bf(bv[e]) * lo_bf(bv[e]) + hi_bf(bv[e]) * hi_bf(bv[e]);
                    }
                }
            }
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            sq[hh] += __shfl_xor_sync(FULL, sq[hh], 1);
            sq[hh] += __shfl_xor_sync(FULL, sq[hh], 2);
            sk[hh] += __shfl_xor_sync(FULL, sk[hh], 1);
            sk[hh] += __shfl_xor_sync(FULL, sk[hh], 2);
            qsc[hh] = scale / sqrtf(sq[hh] + L2NORM_EPS);
            ksc[hh] = 1.f / sqrtf(sk[hh] + L2NORM_EPS);
        }
    }
#endif
    float slope = -LOG2E;
#if HAS_A_LOG
    slope = -ex2(Alog[hv] * LOG2E) * LOG2E;
#endif
    const float lb2 = lower_bound * LOG2E;
    __syncthreads();  // betas
    const float beta_r[2] = {betas[row0], betas[row0 + 8]};

#if SCALAR_GATE
#include "prepare_pass1_scalar.cuh"
#else
#include "prepare_pass1_channel.cuh"
#endif
    __syncthreads();  // the union region becomes the solve's

    // ---- A_qk (lower triangle incl. diagonal), L = beta A_kk (strictly lower) ---------------------------
    float* Ts = reinterpret_cast<float*>(smem + UNION_OFF);  // [64][LD]
    float* Ls = Ts + 64 * LD;                               // [64][LD] (row block r written by warp r)
    float* Zs = Ls + 64 * LD + wp * 16 * 20;                // [16][20] per warp
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int rl = gid + 8 * hh, cl0 = 8 * nt + 2 * tig;  // in-block row, column
                float a0 = accq[s][nt][2 * hh], a1 = accq[s][nt][2 * hh + 1];
                float l0 = acck[s][nt][2 * hh] * beta_r[hh], l1 = acck[s][nt][2 * hh + 1] * beta_r[hh];
                if (s > wp) { a0 = a1 = l0 = l1 = 0.f; }
                if (s == wp) {
                    if (cl0 > rl) a0 = 0.f;
                    if (cl0 + 1 > rl) a1 = 0.f;
                    if (cl0 >= rl) l0 = 0.f;
                    if (cl0 + 1 >= rl) l1 = 0.f;
                }
                if (hh ? ok1 : ok0)
                    *reinterpret_cast<u32*>(AQK + (t0 + row0 + 8 * hh) * a_row + hv * 64 + 16 * s + cl0) = pack(a0, a1);
                *reinterpret_cast<float2*>(Ls + (16 * wp + rl) * LD + 16 * s + cl0) = make_float2(l0, l1);
            }
    __syncwarp();

    // ---- T = (I + L)^-1: the diagonal block by substitution (lane c: column c), then block rows ------
    {
        const int c = lane & 15;
        const float* Nr = Ls + 16 * wp * LD + 16 * wp;
        float y[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            float acc = (i == c) ? 1.f : 0.f;
#pragma unroll
            for (int j = 0; j < i; ++j) acc -= Nr[i * LD + j] * y[j];
            y[i] = acc;
        }
        if (lane < 16) {
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                float* row = Ts + (16 * wp + i) * LD;
                row[16 * wp + c] = y[i];
#pragma unroll
                for (int s = 0; s < 4; ++s)
                    if (s > wp) row[16 * s + c] = 0.f;
            }
        }
    }
    __syncthreads();  // the diagonal blocks
    solve_offdiag(Ts, Ls, Zs, wp, gid, tig);
    asm volatile("cp.async.wait_all;");
    __syncthreads();
    // beta v, rounded to bf16, in place of the v tile (each row's 16-byte chunks stay in that row's 256 bytes
    // whatever the swizzle): u = T (beta v) takes the same bf16 T as w = T x, as in the Triton kernel. Rounding
    // T diag(beta) as u's operand instead gave u and w different roundings of T, and u - w S, small for nearly
    // collinear keys, lost their cancellation (docs/kda-kernels.md section 4).
    for (int c = tid; c < 64 * 16; c += 128) {
        uint4* p = reinterpret_cast<uint4*>(vsm + c * 16);
        uint4 x = *p;
        const float b = betas[c >> 4];
        x.x = pack(lo_bf(x.x) * b, hi_bf(x.x) * b);
        x.y = pack(lo_bf(x.y) * b, hi_bf(x.y) * b);
        x.z = pack(lo_bf(x.z) * b, hi_bf(x.z) * b);
        x.w = pack(lo_bf(x.w) * b, hi_bf(x.w) * b);
        *p = x;
    }
    __syncthreads();

    // ---- pass 2: w = T x, u = T (beta v) for this warp's 16 rows -----------------------------------------
    u32 at[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int rl = gid + 8 * (e & 1), col = 16 * kk + 2 * tig + 8 * (e >> 1);
            const float2 t = *reinterpret_cast<const float2*>(Ts + (16 * wp + rl) * LD + col);
            at[kk][e] = pack(t.x, t.y);
        }
    }
#if SAVE_AKK
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
        if (hh ? ok1 : ok0) {
            bf16* dst = AKK + (t0 + row0 + 8 * hh) * a_row + hv * 64;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                const float2 t = *reinterpret_cast<const float2*>(Ts + (row0 + 8 * hh) * LD + 8 * nt + 2 * tig);
                *reinterpret_cast<u32*>(dst + 8 * nt + 2 * tig) = pack(t.x, t.y);
            }
        }
#endif
#pragma unroll
    for (int which = 0; which < 2; ++which) {
        const u32 tile = smem_addr(which ? vsm : xs);
        bf16* out = (which ? U : W) + o_off;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float acc[8][4];
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                if (kk <= wp) {
#pragma unroll
                    for (int pp = 0; pp < 4; ++pp) {
                        const int mi = lane >> 3, token = 16 * kk + ((mi & 1) << 3) + (lane & 7);
                        const int chunk16 = 2 * (4 * half + pp) + (mi >> 1);
                        u32 b0, b1, b2, b3;
                        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                                     : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(tile + swz(token, chunk16)));
                        mma_bf16(acc[2 * pp], at[kk], b0, b1);
                        mma_bf16(acc[2 * pp + 1], at[kk], b2, b3);
                    }
                }
            }
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
                if (hh ? ok1 : ok0) {
                    bf16* dst = out + (row0 + 8 * hh) * vs_row + 64 * half + 2 * tig;
#pragma unroll
                    for (int nt = 0; nt < 8; ++nt)
                        *reinterpret_cast<u32*>(dst + 8 * nt) = pack(acc[nt][2 * hh], acc[nt][2 * hh + 1]);
                }
        }
    }
}
