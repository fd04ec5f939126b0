/* Device functions of the pool-forming kernels over whole token rows (pooled/cuda_keys_source.py describes them):
   16-bit element conversions and pair products (IS_BF16), the pool's softmax weights (POOL), the flag test, and
   the cp.async copies of a pool's spans into a warp's stage (SPANS, MASK). */
typedef unsigned short ELEM;  // raw 16-bit values (no cuda_fp16.h / cuda_bf16.h: NVRTC may have no include path)
#define NEG_INF __int_as_float(0xff800000)
#define LOG2E 1.4426950408889634f

#if IS_BF16
__device__ __forceinline__ float to_f32(ELEM x) { return __uint_as_float((unsigned)x << 16); }
__device__ __forceinline__ ELEM from_f32(float x) {
    ELEM r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x)); return r;
}
#else
__device__ __forceinline__ float to_f32(ELEM x) {
    float f; asm("{ .reg .f16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(x)); return f;
}
__device__ __forceinline__ ELEM from_f32(float x) {
    ELEM r; asm("{ .reg .f16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(r) : "f"(x)); return r;
}
#endif

// Approximate fp32 exponential (of x in log2 units) and reciprocal, as Triton's exp and division are: the
// probabilities are rounded to k's 16-bit dtype right after, so the approximations' last bits rarely survive.
__device__ __forceinline__ float exp2_approx(float x) {
    float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
}
__device__ __forceinline__ float rcp_approx(float x) {
    float y; asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
}

#if IS_BF16
#define PAIR "bf16x2"
#else
#define PAIR "f16x2"
#endif
// {hi, lo} rounded to the 16-bit dtype, packed (lo in the low half)
__device__ __forceinline__ unsigned pack_pair(float lo, float hi) {
    unsigned r; asm("cvt.rn." PAIR ".f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
// both halves' products, rounded once (an fma with -0 is the product: sm_80 has no bf16x2 mul)
__device__ __forceinline__ unsigned mul_pair(unsigned a, unsigned b) {
    unsigned r; asm("fma.rn." PAIR " %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u)); return r;
}
__device__ __forceinline__ float low_f32(unsigned x) { return to_f32((ELEM)(x & 0xffffu)); }
__device__ __forceinline__ float high_f32(unsigned x) { return to_f32((ELEM)(x >> 16)); }

__device__ __forceinline__ ELEM smem_elem(const char* p) { return *reinterpret_cast<const ELEM*>(p); }

// The softmax weights of one channel over the pool's tokens: e[j] (unnormalised, 0 for an excluded token) and
// the reciprocal of their sum. g: the channel's gate element in token row 0; ape(j): its position bias.
template <typename Ape>
__device__ __forceinline__ float pool_weights(float (&e)[POOL], const char* g, long long gst, unsigned keep, Ape ape)
{
    float m = NEG_INF;
#pragma unroll
    for (int j = 0; j < POOL; ++j) {
        e[j] = (keep >> j) & 1u ? to_f32(smem_elem(g + j * gst)) + ape(j) : NEG_INF;
        m = fmaxf(m, e[j]);
    }
    if (m == NEG_INF) m = 0.0f;  // an all-excluded pool: zeros
    const float m2 = m * LOG2E;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < POOL; ++j) {
        e[j] = exp2_approx(fmaf(e[j], LOG2E, -m2));
        sum += e[j];
    }
    return rcp_approx(sum > 0.0f ? sum : 1.0f);
}

// A flag element (k's 16-bit dtype) marks a valid key when nonzero, NaN included, as Tensor.bool reads it.
__device__ __forceinline__ bool is_valid_flag(unsigned short bits) { return (bits & 0x7fffu) != 0; }

__device__ __forceinline__ unsigned shared_address(const void* p) {
    unsigned a; asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p)); return a;
}

__device__ __forceinline__ void copy16(unsigned dst, const char* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(src));
}

struct Stage {
    long long tok0;     // the pool's first token
    int rows;           // tokens of the pool that exist (0..POOL)
    int shift0, shift1; // bytes from the 16-byte boundary below each span's first byte to that byte
};

// Copy one span of `rows` token rows (`stride` bytes apart, `width` bytes each) from `a` into shared memory at
// `dst`, from the 16-byte boundary below `a`; the shift of `a` above that boundary.
__device__ __forceinline__ int copy_span(unsigned dst, const char* a, int rows, long long stride, int width, int lane)
{
    const char* a0 = (const char*)((unsigned long long)a & ~15ull);
    const int shift = (int)(a - a0);
    const int chunks = (int)(((long long)(rows - 1) * stride + width + shift + 15) >> 4);
    for (int i = lane; i < chunks; i += 32) copy16(dst + 16 * i, a0 + 16ll * i);
    return shift;
}

// Issue the copies of pool idx's spans into a stage buffer (one commit group, empty when the pool has no token).
__device__ __forceinline__ Stage issue(
    int idx, char* buf, const char* base0, const char* base1, const long long* first,
    long long sb0, long long st0, long long sb1, long long st1, int w0, int w1, int T, int NP, int span1_at,
    int lane)
{
    Stage s;
    const int b = idx / NP, p = idx - b * NP;
    s.tok0 = (MASK != MASK_NONE ? first[b] : 0ll) + (long long)p * POOL;
    const long long left = (long long)T - s.tok0;
    s.rows = left <= 0 ? 0 : (left < POOL ? (int)left : POOL);
    s.shift0 = 0;
    s.shift1 = 0;
    if (s.rows > 0) {
        const unsigned dst = shared_address(buf);
        s.shift0 = copy_span(dst, base0 + (long long)b * sb0 + s.tok0 * st0, s.rows, st0, w0, lane);
        if (SPANS == 2)
            s.shift1 = copy_span(dst + span1_at, base1 + (long long)b * sb1 + s.tok0 * st1, s.rows, st1, w1, lane);
    }
    asm volatile("cp.async.commit_group;\n" ::);
    return s;
}
