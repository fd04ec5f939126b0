// Device helpers of the CUDA prepare kernel (prepare.cu): bf16 bit handling, the mma.sync products (bf16 and
// TF32), the 3xTF32 split and the 16 x 16 block products of the triangular solve, and the solve's off-diagonal
// blocks (solve_offdiag). Raw bits only (no cuda_bf16.h: NVRTC may have no include path).
#pragma once
typedef unsigned int u32;
typedef unsigned short bf16;  // raw bits (no cuda_bf16.h: NVRTC may have no include path)
#define FULL 0xffffffffu
#define LOG2E 1.4426950408889634f
#define GATE_FLOOR (-150.0f)
#define L2NORM_EPS 1e-6f
#define KD 128

__device__ __forceinline__ float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ float lg2(float x) {
    float y; asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
}
__device__ __forceinline__ float lo_bf(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi_bf(u32 v) { return __uint_as_float(v & 0xffff0000u); }
// two floats rounded to bf16 (nearest even), lo in the low half
__device__ __forceinline__ u32 pack(float lo, float hi) {
    u32 p; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(hi), "f"(lo)); return p;
}
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __uint_as_float(((u32)x) << 16); }
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
// byte offset of (row, 16-byte chunk) in a [64, 128] bf16 tile: chunks XOR-swizzled by row (ldmatrix
// rows of one 8 x 8 matrix fall in different banks)
__device__ __forceinline__ u32 swz(int row, int chunk) { return row * 256 + ((chunk ^ (row & 7)) << 4); }

__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_tf32(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// x rounded to the nearest TF32 value (fp32 bits, the 13 low ones zero): a TF32 product reads the top 19 bits of an
// fp32 operand, i.e. truncates it, a biased error (docs/kda-kernels.md section 4)
__device__ __forceinline__ u32 tf32_rna(float x) { u32 r; asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x)); return r; }
// x = hi + lo, hi rounded to TF32 and lo the rest (rounded): three TF32 products carry about fp32 accuracy
__device__ __forceinline__ void split_tf32(float x, u32& hi, u32& lo) {
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(x));
    float r = x - __uint_as_float(hi);
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(r));
}
// acc += X @ Y for 16 x 16 fp32 blocks in shared memory (row strides ldx, ldy), in 3xTF32; acc in the
// mma C layout, two 8-column tiles
__device__ __forceinline__ void prod16(float (&acc)[2][4], const float* X, int ldx, const float* Y, int ldy,
                                       int gid, int tig) {
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
        u32 ah[4], al[4];
        split_tf32(X[gid * ldx + 8 * kk + tig], ah[0], al[0]);
        split_tf32(X[(gid + 8) * ldx + 8 * kk + tig], ah[1], al[1]);
        split_tf32(X[gid * ldx + 8 * kk + tig + 4], ah[2], al[2]);
        split_tf32(X[(gid + 8) * ldx + 8 * kk + tig + 4], ah[3], al[3]);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            u32 bh0, bl0, bh1, bl1;
            split_tf32(Y[(8 * kk + tig) * ldy + 8 * nt + gid], bh0, bl0);
            split_tf32(Y[(8 * kk + tig + 4) * ldy + 8 * nt + gid], bh1, bl1);
            mma_tf32(acc[nt], ah, bh0, bh1);
            mma_tf32(acc[nt], ah, bl0, bl1);
            mma_tf32(acc[nt], al, bh0, bh1);
        }
    }
}
// acc = the 16 x 16 fp32 block Z (row stride ldz), in the mma C layout: what store16 wrote
__device__ __forceinline__ void load16(float (&acc)[2][4], const float* Z, int ldz, int gid, int tig) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
        const float2 a = *reinterpret_cast<const float2*>(Z + gid * ldz + 8 * nt + 2 * tig);
        const float2 b = *reinterpret_cast<const float2*>(Z + (gid + 8) * ldz + 8 * nt + 2 * tig);
        acc[nt][0] = a.x; acc[nt][1] = a.y; acc[nt][2] = b.x; acc[nt][3] = b.y;
    }
}
__device__ __forceinline__ void zero16(float (&acc)[2][4]) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
}
__device__ __forceinline__ void store16(float* Z, int ldz, const float (&acc)[2][4], float sign, int gid, int tig) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
        *reinterpret_cast<float2*>(Z + gid * ldz + 8 * nt + 2 * tig) = make_float2(sign * acc[nt][0], sign * acc[nt][1]);
        *reinterpret_cast<float2*>(Z + (gid + 8) * ldz + 8 * nt + 2 * tig) = make_float2(sign * acc[nt][2], sign * acc[nt][3]);
    }
}

// The off-diagonal blocks by doubling: each 32 x 32 half inverts as [[T00, 0], [T10, T11]] with
// T10 = -T11 L10 T00, and the lower-left 32 x 32 block is T_BA = -T_B (L_BA T_A) (T_A, T_B the halves'
// inverses). Three rounds of at most two 16 x 16 products per warp, all warps busy; a block-row substitution
// (T_ps = -T_pp sum_t L_pt T_ts, one warp per block row) chains 16 products through one warp at a time.
// Intermediates live in L's upper blocks (zeros, never read as L): X(r, c) for r < c.
// Every warp of the CTA calls it (it holds two barriers); a function of its own (not inlined) keeps the
// kernel's register allocation from spilling around it.
__device__ __noinline__ void solve_offdiag(float* Ts, float* Ls, float* Zs, int wp, int gid, int tig) {
    auto Tb = [&](int r, int c) { return Ts + 16 * r * LD + 16 * c; };
    auto Lb = [&](int r, int c) { return Ls + 16 * r * LD + 16 * c; };
    float* M20 = Lb(0, 1);  // L20 T00 (+ L21 T10)
    float* M30 = Lb(0, 2);  // L30 T00 (+ L31 T10)
    float* M21 = Lb(0, 3);  // L21 T11
    float* M31 = Lb(1, 2);  // L31 T11
    float* Y31 = Lb(1, 3);  // T33 M31
    float acc[2][4];
    if (wp & 1) {  // T10 = -T11 (L10 T00), T32 = -T33 (L32 T22)
        const int p = wp, s = wp - 1;
        zero16(acc);
        prod16(acc, Lb(p, s), LD, Tb(s, s), LD, gid, tig);
        store16(Zs, 20, acc, 1.f, gid, tig);
        __syncwarp();
        zero16(acc);
        prod16(acc, Tb(p, p), LD, Zs, 20, gid, tig);
        store16(Tb(p, s), LD, acc, -1.f, gid, tig);
    } else {  // warp 0: row block 2, warp 2: row block 3 of L_BA T_A, the parts without T10
        const int r = wp == 0 ? 2 : 3;
        zero16(acc);
        prod16(acc, Lb(r, 0), LD, Tb(0, 0), LD, gid, tig);
        store16(r == 2 ? M20 : M30, LD, acc, 1.f, gid, tig);
        zero16(acc);
        prod16(acc, Lb(r, 1), LD, Tb(1, 1), LD, gid, tig);
        store16(r == 2 ? M21 : M31, LD, acc, 1.f, gid, tig);
    }
    __syncthreads();
    if (wp == 0 || wp == 2) {  // M20 += L21 T10, M30 += L31 T10
        const int r = wp == 0 ? 2 : 3;
        float* m = r == 2 ? M20 : M30;
        load16(acc, m, LD, gid, tig);
        prod16(acc, Lb(r, 1), LD, Tb(1, 0), LD, gid, tig);
        store16(m, LD, acc, 1.f, gid, tig);
    } else if (wp == 1) {  // T21 = -T22 M21
        zero16(acc);
        prod16(acc, Tb(2, 2), LD, M21, LD, gid, tig);
        store16(Tb(2, 1), LD, acc, -1.f, gid, tig);
    } else {  // Y31 = T33 M31
        zero16(acc);
        prod16(acc, Tb(3, 3), LD, M31, LD, gid, tig);
        store16(Y31, LD, acc, 1.f, gid, tig);
    }
    __syncthreads();
    if (wp == 0) {  // T20 = -T22 M20
        zero16(acc);
        prod16(acc, Tb(2, 2), LD, M20, LD, gid, tig);
        store16(Tb(2, 0), LD, acc, -1.f, gid, tig);
    } else if (wp == 1) {  // T30 = -(T32 M20 + T33 M30)
        zero16(acc);
        prod16(acc, Tb(3, 2), LD, M20, LD, gid, tig);
        prod16(acc, Tb(3, 3), LD, M30, LD, gid, tig);
        store16(Tb(3, 0), LD, acc, -1.f, gid, tig);
    } else if (wp == 2) {  // T31 = -(T32 M21 + T33 M31)
        load16(acc, Y31, LD, gid, tig);
        prod16(acc, Tb(3, 2), LD, M21, LD, gid, tig);
        store16(Tb(3, 1), LD, acc, -1.f, gid, tig);
    }
}

