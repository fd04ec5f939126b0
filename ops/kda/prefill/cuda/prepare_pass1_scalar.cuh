// Pass 1 of the prepare kernel (prepare.cu) for a scalar gate per (token, value head): GDN. Included inside
// kda_prepare_mma's body, after the prologue (it reads the prologue's locals).
//
// The same math as the Triton kernel's scalar pass (prefill/triton/prepare_scalar.py): with one decay per token, the decay
// between tokens j <= i is one number 2^span(j, i], so the A products are PLAIN q k^T and k k^T of the loaded bf16
// tiles (mma.m16n8k16: exact products, fp32 accumulation, no TF32 rounding of scaled operands), scaled afterwards
// elementwise by the rows' L2-norm factors and the decay. Exponents are sums over their own span, never differences:
// the gate of each row is computed once (threads 0-63; the finished log decay, or with HAS_A_LOG the in-kernel
// -exp(A_log) softplus(g + dt_bias)), floored at GATE_FLOOR, and each row's gate through it from its 16-row block's
// start (pre) and after it to the block's end (suf) are direct sums; a cross-block span is pre_i + the blocks
// strictly between + suf_j, a span inside a block a running sum over its own rows (dspan). Exact for any gate
// (-inf: a reset), at a cost that does not depend on the data. qg, kd, x take per-row factors, decay is 2^G_last on
// every channel (the scan's layout). With ROW_FACTORS the kernel writes those factors ([slots, HV, 2, 64] fp32
// through the QG pointer) in place of the qg / kd tiles, and the CUDA scan applies them to the raw q / k (scan.cu).
//
// Leaves accq / acck as the per-channel pass does. Uses the key-tile region of pass 1 for its per-row scratch (log2
// gates, pre, suf, the key rows' L2-norm factors): 1 KiB.
    // ---- pass 1 (scalar gate): per-row gates and spans, then plain q k^T / k k^T over 16-channel slices ----
    float* gl = reinterpret_cast<float*>(smem + UNION_OFF);  // [64] log2 gates, 0 past the sequence
    float* pre = gl + 64;   // [64] the gate from the row's block start through the row (direct sums)
    float* suf = pre + 64;  // [64] the gate after the row to its block's end (direct sums)
    float* kss = suf + 64;  // [64] the rows' key L2-norm factors
    if (tid < 64) {
        float y = 0.f;
        if (tid < nvalid) {
            float x = to_f(Gin[(t0 + tid) * HV + hv]);
#if HAS_A_LOG  // the in-kernel gate: -exp(A_log) * softplus(x + dt_bias), softplus = x above 20 (as torch)
#if HAS_DT_BIAS
            x += DtBias[hv];
#endif
            y = -expf(Alog[hv]) * (x > 20.f ? x : log1pf(expf(x))) * LOG2E;
#else
            y = x * LOG2E;
#endif
            y = fmaxf(y, GATE_FLOOR);  // also maps -inf to the floor (a reset; never inf - inf)
        }
        gl[tid] = y;
    }
    if (tig == 0) { kss[row0] = ksc[0]; kss[row0 + 8] = ksc[1]; }

    float accq[4][2][4], acck[4][2][4];
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) { accq[s][nt][e] = 0.f; acck[s][nt][e] = 0.f; }

    // q / k slices arrive by cp.async, NSTAGE slices ahead, into [64][16] tiles (16-byte chunks swizzled by
    // row bit 2), as in the per-channel pass (the gate part of a stage stays unused)
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
        }
        asm volatile("cp.async.commit_group;");
    };
#pragma unroll
    for (int sl = 0; sl < NSTAGE; ++sl) issue_slice(sl);
    asm volatile("cp.async.wait_group %0;" :: "n"(NSTAGE - 1));
    __syncthreads();  // gates, key factors, slice 0
    if (tid < 64) {
        const int b0 = tid & ~15;
        float p = 0.f, sfx = 0.f;
        for (int t = b0; t <= tid; ++t) p += gl[t];
        for (int t = tid + 1; t < b0 + 16; ++t) sfx += gl[t];
        pre[tid] = p;
        suf[tid] = sfx;
    }
    __syncthreads();
    // this lane's rows (row0 + 8 hh): the gate from the chunk's start (qg, x) and to its end (kd), direct sums
    float bs[4], Gi[2], to_end[2], pre_i[2], between[4];
    float before = 0.f, after = 0.f, total = 0.f;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
        bs[b] = pre[16 * b + 15];
        if (b < wp) before += bs[b];
        if (b > wp) after += bs[b];
        total += bs[b];
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) {  // the blocks strictly between key block s and this warp's block
        float m = 0.f;
#pragma unroll
        for (int b = 0; b < 4; ++b)
            if (b > s && b < wp) m += bs[b];
        between[s] = m;
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        pre_i[hh] = pre[row0 + 8 * hh];
        Gi[hh] = before + pre_i[hh];
        to_end[hh] = suf[row0 + 8 * hh] + after;
    }
    // spans inside the own block: dspan[hh][nt][c] = sum of the gate over (j, i], i = gid + 8 hh and
    // j = 8 nt + 2 tig + c (block-local), a running sum down from row i (0 for j >= i: masked later)
    float dspan[2][2][2] = {{{0.f, 0.f}, {0.f, 0.f}}, {{0.f, 0.f}, {0.f, 0.f}}};
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int il = gid + 8 * hh;
        float r = 0.f;
#pragma unroll
        for (int t = 15; t >= 1; --t) {  // after adding row t's gate, r = span(t - 1, i]
            if (t <= il) r += gl[16 * wp + t];
            const int j = t - 1;
            if (((j & 7) >> 1) == tig) dspan[hh][j >> 3][j & 1] = r;
        }
    }
    const float qf[2] = {qsc[0] * ex2(Gi[0]), qsc[1] * ex2(Gi[1])};
    const float kdf[2] = {ksc[0] * ex2(to_end[0]), ksc[1] * ex2(to_end[1])};
    const float xf[2] = {ksc[0] * beta_r[0] * ex2(Gi[0]), ksc[1] * beta_r[1] * ex2(Gi[1])};
    const float decay_last = ex2(total);
#if ROW_FACTORS  // no qg / kd tiles: the rows' factors [slot][hv][q | k][64] (0 past the sequence), for the scan
    if (tig == 0) {
        float* fa = reinterpret_cast<float*>(QG) + ((long long)slot * HV + hv) * 128;
        fa[row0] = ok0 ? qf[0] : 0.f;
        fa[row0 + 8] = ok1 ? qf[1] : 0.f;
        fa[64 + row0] = ok0 ? kdf[0] : 0.f;
        fa[64 + row0 + 8] = ok1 ? kdf[1] : 0.f;
    }
#endif
    const int lrow = 16 * wp + ((lane >> 3) & 1) * 8 + (lane & 7), lchunk = lane >> 4;  // ldmatrix row address
    const u32 lm_off = lrow * 32 + ((lchunk ^ ((lrow >> 2) & 1)) << 4);
    const u32 lm_key0 = lm_off - wp * 16 * 32;  // the same lane's address in key block 0

#pragma unroll 1
    for (int sl = 0; sl < KD / 16; ++sl) {
        const int c0 = 16 * sl;
        const u32 st = smem_addr(stages + (sl % NSTAGE) * STAGE_BYTES);
        u32 aq[4], ak[4], kb[4][4];
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(aq[0]), "=r"(aq[1]), "=r"(aq[2]), "=r"(aq[3]) : "r"(st + lm_off));
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(ak[0]), "=r"(ak[1]), "=r"(ak[2]), "=r"(ak[3]) : "r"(st + 2048 + lm_off));
#pragma unroll
        for (int s = 0; s < 4; ++s)  // key block s as B operands: [n-tile 0: rows 0-7 | 1: rows 8-15] x [k 0-7 | 8-15]
            if (s <= wp)
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                             : "=r"(kb[s][0]), "=r"(kb[s][1]), "=r"(kb[s][2]), "=r"(kb[s][3])
                             : "r"(st + 2048 + lm_key0 + s * 16 * 32));
        asm volatile("cp.async.wait_group %0;" :: "n"(NSTAGE - 2));  // this thread's copies of slice sl + 1
        __syncthreads();  // slice sl + 1 visible; stage sl % NSTAGE consumed
        issue_slice(sl + NSTAGE);

        // qg, kd (global), x = beta 2^G k (shared, for pass 2): per-row factors on the raw elements
        // (lane elements: rows row0 + 8 hh, channels c0 + {2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9})
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int row = row0 + 8 * hh;
            const u32 qa = aq[hh], qb = aq[2 + hh], ka = ak[hh], kbb = ak[2 + hh];
            if (!ROW_FACTORS && (hh ? ok1 : ok0)) {
                const long long o = o_off + row * vs_row + c0 + 2 * tig;
                *reinterpret_cast<u32*>(QG + o) = pack(lo_bf(qa) * qf[hh], hi_bf(qa) * qf[hh]);
                *reinterpret_cast<u32*>(QG + o + 8) = pack(lo_bf(qb) * qf[hh], hi_bf(qb) * qf[hh]);
                *reinterpret_cast<u32*>(KDo + o) = pack(lo_bf(ka) * kdf[hh], hi_bf(ka) * kdf[hh]);
                *reinterpret_cast<u32*>(KDo + o + 8) = pack(lo_bf(kbb) * kdf[hh], hi_bf(kbb) * kdf[hh]);
            }
            *reinterpret_cast<u32*>(xs + swz(row, 2 * sl) + 4 * tig) = pack(lo_bf(ka) * xf[hh], hi_bf(ka) * xf[hh]);
            *reinterpret_cast<u32*>(xs + swz(row, 2 * sl + 1) + 4 * tig) =
                pack(lo_bf(kbb) * xf[hh], hi_bf(kbb) * xf[hh]);
        }
        if (wp == 0 && gid == 0) {
            float* dst = DECAY + ((long long)slot * HV + hv) * KD + c0;
            dst[2 * tig] = decay_last; dst[2 * tig + 1] = decay_last;
            dst[2 * tig + 8] = decay_last; dst[2 * tig + 9] = decay_last;
        }
        // plain products of this warp's rows with the keys of blocks s <= wp
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            if (s <= wp) {
                mma_bf16(accq[s][0], aq, kb[s][0], kb[s][2]);
                mma_bf16(accq[s][1], aq, kb[s][1], kb[s][3]);
                mma_bf16(acck[s][0], ak, kb[s][0], kb[s][2]);
                mma_bf16(acck[s][1], ak, kb[s][1], kb[s][3]);
            }
        }
    }
    // the decay and the L2-norm factors, elementwise (element e: row row0 + 8 (e >> 1), column
    // 16 s + 8 nt + 2 tig + (e & 1))
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        if (s <= wp) {
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int hh = e >> 1, j = 16 * s + 8 * nt + 2 * tig + (e & 1);
                    const float span = (s < wp) ? pre_i[hh] + between[s] + suf[j] : dspan[hh][nt][e & 1];
                    const float f = ex2(span) * kss[j];
                    accq[s][nt][e] *= qsc[hh] * f;
                    acck[s][nt][e] *= ksc[hh] * f;
                }
        }
    }
