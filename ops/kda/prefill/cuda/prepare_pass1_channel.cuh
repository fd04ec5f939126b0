// Pass 1 of the prepare kernel (prepare.cu) for the per-channel gate (KDA: the in-kernel lower-bound gate, or with
// GATE_SOFTPLUS the in-kernel softplus gate). Included inside kda_prepare_mma's body, after the prologue: it reads
// the prologue's locals and the slice copies issue_slice starts. Per 16-channel slice: the gate, its block-local
// cumsum (lane shuffles), the block sums exchanged between warps, qg, kd, decay, x = beta 2^G k (into shared memory)
// and the A_qk / A_kk stripes on TF32 tensor cores with the decay folded into the operands through per-block anchors
// (the Triton kernel's prefill/triton/prepare_channel.py; every exponent a sum over its own span).
//
// A 16-token block whose decay spans at most DIAG_RANGE_LIMIT (the bounded lower-bound gate) takes its product with
// itself through one anchor, as the stripes do. WIDE_BLOCKS (gates of any strength) forms that product on its own:
// exponents from the steps clamped at -STEP_CLAMP and one anchor per 8-column tile, so every factor stays in range
// whatever the data (docs/kda-kernels.md section 4.1); no exact element-by-element pass.
//
// Leaves accq[s][nt][e] / acck[s][nt][e]: A_qk and A_kk (before beta and the triangle masks) of this warp's 16 rows
// against key block s, in the mma accumulator layout.
    // ---- pass 1 over 16-channel slices ----------------------------------------------------------------
    // lane elements: rows row0 + 8 hh, channels c0 + {2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9} (mma A layout)
#if GATE_SOFTPLUS
#if HAS_A_LOG
    const float neg_a = -ex2(Alog[hv] * LOG2E);
#else
    const float neg_a = -1.f;
#endif
#endif
    float accq[4][2][4], acck[4][2][4];
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) { accq[s][nt][e] = 0.f; acck[s][nt][e] = 0.f; }

    asm volatile("cp.async.wait_group %0;" :: "n"(NSTAGE - 1));
    __syncthreads();
    const int lrow = 16 * wp + ((lane >> 3) & 1) * 8 + (lane & 7), lchunk = lane >> 4;  // ldmatrix row address
    const u32 lm_off = lrow * 32 + ((lchunk ^ ((lrow >> 2) & 1)) << 4);

#pragma unroll 1
    for (int sl = 0; sl < KD / 16; ++sl) {
        const int c0 = 16 * sl, par = sl & 1;
        const u32 st = smem_addr(stages + (sl % NSTAGE) * STAGE_BYTES);
        u32 rq[2][2], rk[2][2];
        float L[2][4];
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(rq[0][0]), "=r"(rq[1][0]), "=r"(rq[0][1]), "=r"(rq[1][1]) : "r"(st + lm_off));
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(rk[0][0]), "=r"(rk[1][0]), "=r"(rk[0][1]), "=r"(rk[1][1]) : "r"(st + 2048 + lm_off));
#if G_BYTES == 2
        {
            u32 rg[2][2];
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                         : "=r"(rg[0][0]), "=r"(rg[1][0]), "=r"(rg[0][1]), "=r"(rg[1][1]) : "r"(st + 4096 + lm_off));
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                L[hh][0] = lo_bf(rg[hh][0]); L[hh][1] = hi_bf(rg[hh][0]);
                L[hh][2] = lo_bf(rg[hh][1]); L[hh][3] = hi_bf(rg[hh][1]);
            }
        }
#else
        {
            const float* gt = reinterpret_cast<const float*>(stages + (sl % NSTAGE) * STAGE_BYTES + 4096);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const float2 a = *reinterpret_cast<const float2*>(gt + (row0 + 8 * hh) * 16 + 2 * tig);
                const float2 b = *reinterpret_cast<const float2*>(gt + (row0 + 8 * hh) * 16 + 2 * tig + 8);
                L[hh][0] = a.x; L[hh][1] = a.y; L[hh][2] = b.x; L[hh][3] = b.y;
            }
        }
#endif

        // gate (log2 units), masked to 0 past the sequence
        float db[4] = {0.f, 0.f, 0.f, 0.f};
#if HAS_DT_BIAS
        {
            const float2 d0 = *reinterpret_cast<const float2*>(DtBias + hv * KD + c0 + 2 * tig);
            const float2 d1 = *reinterpret_cast<const float2*>(DtBias + hv * KD + c0 + 2 * tig + 8);
            db[0] = d0.x; db[1] = d0.y; db[2] = d1.x; db[3] = d1.y;
        }
#endif
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float x = L[hh][j] + db[j];
#if GATE_SOFTPLUS
                // -exp(A_log) softplus(x) / ln 2 (the Triton kernel's log2_gate): softplus = x above 20, else
                // log2(1 + e) = log2(u) + (e - (u - 1)) / ln 2 with u = 1 + e rounded (e < 1: u - 1 is exact)
                const float e = ex2(fminf(x, 20.f) * LOG2E), u = 1.f + e;
                const float l = x > 20.f ? x * LOG2E : lg2(u) + (e < 1.f ? e - (u - 1.f) : 0.f) * LOG2E;
                const float y = fmaxf(neg_a * l, GATE_FLOOR);
#else
                const float y = fmaxf(__fdividef(lb2, 1.f + ex2(x * slope)), GATE_FLOOR);
#endif
                L[hh][j] = (hh ? ok1 : ok0) ? y : 0.f;
            }
#if WIDE_BLOCKS
        float Lc[2][4];  // the steps clamped at -STEP_CLAMP: the diagonal block's own exponents (below)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int j = 0; j < 4; ++j) Lc[hh][j] = fmaxf(L[hh][j], -STEP_CLAMP);
#endif
        // block-local inclusive cumsum over the 16 rows (lanes 4 apart, then the two halves)
#pragma unroll
        for (int off = 1; off < 8; off <<= 1)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const float t = __shfl_up_sync(FULL, L[hh][j], 4 * off);
                    if (gid >= off) L[hh][j] += t;
#if WIDE_BLOCKS
                    const float tc = __shfl_up_sync(FULL, Lc[hh][j], 4 * off);
                    if (gid >= off) Lc[hh][j] += tc;
#endif
                }
        float S_own[4];
#if WIDE_BLOCKS
        // the diagonal block's exponents: rows 0-7 (e00) and 8-15 (e1[0]) against the anchor of columns 0-7, the middle
        // of the clamped range of rows 0-7; rows 8-15 against that of columns 8-15 (e1[1])
        float e00[4], e1[2][4];
#endif
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            L[1][j] += __shfl_sync(FULL, L[0][j], 28 + tig);
            S_own[j] = __shfl_sync(FULL, L[1][j], 28 + tig);
#if WIDE_BLOCKS
            const float h7 = __shfl_sync(FULL, Lc[0][j], 28 + tig);
            const float c1 = Lc[1][j] + h7;
            const float a0 = 0.5f * h7, a1 = 0.5f * (h7 + __shfl_sync(FULL, c1, 28 + tig));
            e00[j] = Lc[0][j] - a0;
            e1[0][j] = c1 - a0;
            e1[1][j] = c1 - a1;
#endif
        }
        const int cl[4] = {2 * tig, 2 * tig + 1, 2 * tig + 8, 2 * tig + 9};
        if (gid == 7) {
#pragma unroll
            for (int j = 0; j < 4; ++j) sums[(par * 4 + wp) * 16 + cl[j]] = L[1][j];
        }
        // key tile of this block: k 2^(a - G), anchor a at the middle of the block's decay range (with WIDE_BLOCKS
        // at its end, a = S: k 2^(S - G) <= k for any decay; the block's own product is formed below)
        float kf[2][4];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            kf[hh][0] = lo_bf(rk[hh][0]) * ksc[hh]; kf[hh][1] = hi_bf(rk[hh][0]) * ksc[hh];
            kf[hh][2] = lo_bf(rk[hh][1]) * ksc[hh]; kf[hh][3] = hi_bf(rk[hh][1]) * ksc[hh];
        }
        {
            float kt[8];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                for (int j = 0; j < 4; ++j) kt[4 * hh + j] = kf[hh][j] * ex2(KEY_ANCHOR * S_own[j] - L[hh][j]);
            // [parity][warp][half][lane] float4s: a quarter-warp's 16-byte accesses fill one 128-byte wavefront
            // (lanes 32 bytes apart took two)
            float4* dst = reinterpret_cast<float4*>(keys + (par * 4 + wp) * 256) + lane;
            dst[0] = make_float4(kt[0], kt[1], kt[2], kt[3]);
            dst[32] = make_float4(kt[4], kt[5], kt[6], kt[7]);
        }
#if WIDE_BLOCKS
        // The block against itself, for gates of any strength (docs/kda-kernels.md section 4.1): exponents from the
        // clamped cumsum Lc (a pair across a step below -STEP_CLAMP decays by less than 2^-STEP_CLAMP either way),
        // one anchor per 8-column tile: columns 0-7 at a0 for all 16 rows (rows 8-15 only lose factors that
        // underflow: their pairs decay by less than 2^-30), columns 8-15 at a1 (rows 0-7 there are above the
        // diagonal). Every factor stays within 2^+-(4 STEP_CLAMP) where a pair can matter.
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) {
            u32 dq[4], dk[4], b[2];  // A operands (rows 0-15) and B operand of one column tile
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int p = 0; p < 2; ++p) {
                    const int j = 2 * ks + p;
                    if (nt == 0) {
                        const float f = ex2(e00[j]);
                        dq[2 * p] = tf32_rna(((j & 1) ? hi_bf(rq[0][j >> 1]) : lo_bf(rq[0][j >> 1])) * qsc[0] * f);
                        dk[2 * p] = tf32_rna(kf[0][j] * f);
                        b[p] = tf32_rna(kf[0][j] * ex2(-e00[j]));
                    } else {
                        b[p] = tf32_rna(kf[1][j] * ex2(-e1[nt][j]));
                    }
                    const float f = ex2(e1[nt][j]);
                    dq[2 * p + 1] = tf32_rna(((j & 1) ? hi_bf(rq[1][j >> 1]) : lo_bf(rq[1][j >> 1])) * qsc[1] * f);
                    dk[2 * p + 1] = tf32_rna(kf[1][j] * f);
                }
#pragma unroll
                for (int s = 0; s < 4; ++s)
                    if (s == wp) {  // (warp-uniform)
                        mma_tf32(accq[s][nt], dq, b[0], b[1]);
                        mma_tf32(acck[s][nt], dk, b[0], b[1]);
                    }
            }
        }
#endif
        asm volatile("cp.async.wait_group %0;" :: "n"(NSTAGE - 2));  // this thread's copies of slice sl + 1
        __syncthreads();  // block sums, key tiles and slice sl + 1's tiles visible; stage sl % NSTAGE consumed
        issue_slice(sl + NSTAGE);

        // block sums of all four blocks: prefix P (own), total, anchors, stripe factors 2^(P_r - a_s)
        float S[4][4];
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const float2 a = *reinterpret_cast<const float2*>(sums + (par * 4 + s) * 16 + 2 * tig);
            const float2 b = *reinterpret_cast<const float2*>(sums + (par * 4 + s) * 16 + 2 * tig + 8);
            S[s][0] = a.x; S[s][1] = a.y; S[s][2] = b.x; S[s][3] = b.y;
        }
        // Every exponent is a sum over its own span, never a difference of prefix sums (as the Triton kernel's
        // _block_gates): p_r - a_s = S_s / 2 + the blocks strictly between s and r (r > s), -S_r / 2 (r = s).
        float P[4], Glast[4], later[4], m[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float before = 0.f, after = 0.f, total = 0.f;  // blocks s < wp (so far: s < b < wp), s > wp, all
#pragma unroll
            for (int s = 3; s >= 0; --s) {  // (wp is warp-uniform: no divergence; stripes s > wp are not taken)
                const float Ss = S[s][j];
                if (s < wp) {
                    m[s][j] = ex2(fmaf(1.f - KEY_ANCHOR, Ss, before));
                    before += Ss;
                } else if (s == wp) {
                    m[s][j] = WIDE_BLOCKS ? 0.f : ex2(-0.5f * Ss);  // (WIDE_BLOCKS: the product above)
                } else {
                    m[s][j] = 0.f;
                    after += Ss;
                }
                total += Ss;
            }
            P[j] = before;
            later[j] = after;
            Glast[j] = total;
        }
        if (wp == 0 && gid == 0) {
            float* dst = DECAY + ((long long)slot * HV + hv) * KD + c0;
#pragma unroll
            for (int j = 0; j < 4; ++j) dst[cl[j]] = ex2(Glast[j]);
        }
        // A operands rounded to TF32 (nearest): the hardware would truncate fp32 bits, and on nearly collinear keys
        // the biased products of A_kk cost the final state 1.24x FLA's error (docs/kda-kernels.md section 4).
        // k index tig <-> channel 2 tig, tig + 4 <-> 2 tig + 1 (k-step 0; k-step 1: + 8)
        u32 aq[2][4], ak[2][4];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int row = row0 + 8 * hh;
            float qe[4], ke[4], qg[4], kd[4], xv[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float e = ex2(L[hh][j]);
                const float qf = ((j & 1) ? hi_bf(rq[hh][j >> 1]) : lo_bf(rq[hh][j >> 1])) * qsc[hh];
                const float eP = ex2(P[j]);
                qe[j] = qf * e;
                ke[j] = kf[hh][j] * e;
                qg[j] = qe[j] * eP;
                kd[j] = kf[hh][j] * ex2((S_own[j] - L[hh][j]) + later[j]);  // the gate after the row
                xv[j] = ke[j] * eP * beta_r[hh];
            }
#pragma unroll
            for (int ks = 0; ks < 2; ++ks) {
                aq[ks][hh] = tf32_rna(qe[2 * ks]); aq[ks][2 + hh] = tf32_rna(qe[2 * ks + 1]);
                ak[ks][hh] = tf32_rna(ke[2 * ks]); ak[ks][2 + hh] = tf32_rna(ke[2 * ks + 1]);
            }
            if (hh ? ok1 : ok0) {
                const long long o = o_off + row * vs_row + c0 + 2 * tig;
                *reinterpret_cast<u32*>(QG + o) = pack(qg[0], qg[1]);
                *reinterpret_cast<u32*>(QG + o + 8) = pack(qg[2], qg[3]);
                *reinterpret_cast<u32*>(KDo + o) = pack(kd[0], kd[1]);
                *reinterpret_cast<u32*>(KDo + o + 8) = pack(kd[2], kd[3]);
            }
            *reinterpret_cast<u32*>(xs + swz(row, 2 * sl) + 4 * tig) = pack(xv[0], xv[1]);
            *reinterpret_cast<u32*>(xs + swz(row, 2 * sl + 1) + 4 * tig) = pack(xv[2], xv[3]);
        }
        // A stripes: rows of this block against the keys of blocks s <= wp (s < wp with WIDE_BLOCKS)
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            if (s < wp || (!WIDE_BLOCKS && s == wp)) {
                const float4* src = reinterpret_cast<const float4*>(keys + (par * 4 + s) * 256) + lane;
                const float4 k0 = src[0], k1 = src[32];
                const float kb[8] = {k0.x * m[s][0], k0.y * m[s][1], k0.z * m[s][2], k0.w * m[s][3],
                                     k1.x * m[s][0], k1.y * m[s][1], k1.z * m[s][2], k1.w * m[s][3]};
#pragma unroll
                for (int ks = 0; ks < 2; ++ks)
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt) {
                        const u32 b0 = tf32_rna(kb[4 * nt + 2 * ks]), b1 = tf32_rna(kb[4 * nt + 2 * ks + 1]);
                        mma_tf32(accq[s][nt], aq[ks], b0, b1);
                        mma_tf32(acck[s][nt], ak[ks], b0, b1);
                    }
            }
        }
    }
