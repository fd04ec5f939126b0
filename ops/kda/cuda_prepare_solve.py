"""The part of the CUDA prepare kernel (``cuda_prepare_source.py``) after pass 1, the same for every gate form:
``A_qk`` (lower triangle) to global memory, ``L = beta A_kk`` (strictly lower), the triangular inverse
``T = (I + L)^-1`` (16 x 16 diagonal blocks by substitution, one per warp, then the off-diagonal blocks by
doubling on 3xTF32 products), then pass 2: ``w = T x`` and
``u = T (beta v)`` on bf16 tensor cores (the same bf16 ``T`` in both: docs/kda-kernels.md section 4).
"""
from __future__ import annotations

SOLVE_AND_PASS2 = r"""    __syncthreads();  // the union region becomes the solve's

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
"""
