"""CUDA source of the pool-forming kernel that reads whole token rows (``cuda_pool_keys.py`` launches it).

glm5_next's cache stores each token's key, gate scores and validity flag side by side in one row
(``cat([k, gate, valid])``, ``2 D + 1`` elements: 514 bytes at D = 128), so the keys and gates a pool needs are
one contiguous span of ``P`` rows. Views of such rows have no 16-byte aligned row starts, and a kernel that
indexes ``k[b, t, d]`` element by element issues 2-byte loads (the Triton kernel reaches 1.5 TB/s there). This
kernel copies each pool's span with 16-byte ``cp.async`` copies from the 16-byte boundary below its first byte
(every copied chunk holds a byte of the span, so it stays inside the allocation) and reads the elements from
shared memory.

The math is ``triton_pool_keys.form_pools_kernel``'s (``pooled.pooled_keys``), per channel ``d``::

    g[j]  = softmax_j(gate[tok_j, d] + ape[j, d])                 (float32; tokens past T or not valid excluded)
    pk[d] = sum_j round(round(g[j]) * k[tok_j, d])                (rounded to k's dtype, summed in float32)

and pool ``p`` of row ``b`` (tokens ``first[b] + p * P + j``) is valid when all ``P`` tokens exist and are valid.

Layout: a token row of a batch row is up to two *spans* (byte ranges read for each token). ``SPANS`` = 1: keys and gates
(and the flag element, in HF's rows) lie in one span; ``SPANS`` = 2: the keys in span 0, the gates in span 1 (separate
tensors with contiguous rows). Which keys are valid (``MASK``): every key (``MASK_NONE``: pools from token 0); a
``[B, T]`` uint8 mask (``MASK_INPUT``); or the flag element of each token row (``MASK_FLAGS``, one span: nonzero, NaN
included, means valid, as ``Tensor.bool`` reads HF's flags), in which case the kernel also writes the ``[B, T]`` bool
mask the rest of the op reads, for every token from the row's first valid key on; ``FIRST_NAME``, launched before it,
finds that key by reading the flags from token 0 until one is set (one round of 1024 tokens for a row without left
padding) and writes the mask for the tokens it read. With a mask the pools start at each row's first valid key. Work:
one warp per pool, up to ``MAX_WARPS`` warps a CTA looping over the flattened ``(b, p)`` pools with two stages per warp:
the next pool's spans are copied while the current one is reduced. Lane ``l`` owns channels ``l + 32 i``, so a warp's
2-byte reads of a row are 64 contiguous bytes (one shared-memory wavefront) and its 2-byte stores of ``pk`` are
coalesced; ``ape`` lives in registers for the kernel's life. With ``PAIRS`` (D a multiple of 64, pools of at most 16)
the products of channels ``c`` and ``c + 32`` are one 16-bit pair multiply: the same rounding, about a third fewer
instructions (the math, not the copies, bounded the one-channel form).

Parameters of the pool kernel, in order: ``base0, base1`` (the spans' bytes at b = 0, t = 0), ``valid`` (the uint8
mask read with ``MASK_INPUT``, the ``[B, T]`` contiguous mask written with ``MASK_FLAGS``, else unused), ``ape``
(float32 ``[P, D]`` contiguous), ``first`` (int64 ``[B]``; unused without a mask), ``pk`` (``[B, NP, D]`` contiguous,
k's dtype), ``pool_valid`` (uint8 ``[B, NP]`` contiguous); then int64 ``sb0, st0, sb1, st1`` (byte strides of the
spans), ``svb, svt`` (the input mask's element strides), and int32 ``w0, w1`` (span widths in bytes), ``k_off, g_off,
v_off`` (byte offsets of the key, gate and flag elements in their spans), ``B, T, NP, D``, ``stage_bytes`` (shared
memory per warp and stage), ``span1_at`` (where span 1's copy starts in a stage, 16-byte aligned). Of the first-key
kernel (grid ``B``): ``flags`` (the flag element of token 0, batch row 0), ``valid``, ``first``, int64 ``sb, st``
(byte strides), int32 ``T``.
"""
from __future__ import annotations

KERNEL_NAME = "dsa_pool_rows"
FIRST_NAME = "dsa_pool_first"  # each row's first valid key from the flags in its token rows
FIRST_THREADS = 256
MASK_NONE, MASK_INPUT, MASK_FLAGS = 0, 1, 2  # every key valid / a [B, T] uint8 mask / flags in the rows (see above)
MAX_WARPS = 4  # warps a CTA (fewer where two stages of a warp's spans need more shared memory)
MAX_CHANNELS = 256  # 8 channels a lane
MAX_POOL = 32  # one lane per token of a pool (the validity ballot)
APE_REGISTERS = 64  # ape values a lane keeps in registers (more spill: read through the L1 instead)

_BODY = r"""
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
"""

_TYPES = ("bf16", "f16")


def kernel_source(*, elem: str, pool: int, channels: int, spans: int, mask: int, pairs: bool = False) -> str:
    """The kernel for 16-bit ``elem`` ("bf16" / "f16"), pools of ``pool`` tokens, at most ``channels`` key channels
    (a multiple of 32 up to ``MAX_CHANNELS``), ``spans`` (1 or 2) and the keys' validity from ``mask``
    (``MASK_NONE``, ``MASK_INPUT`` or ``MASK_FLAGS``, which needs one span). ``pairs``: the products of channels
    ``c`` and ``c + 32`` in one 16-bit pair multiply (the launcher's choice when D is a multiple of 64)."""
    if elem not in _TYPES:
        raise ValueError(f"elem={elem!r}: expected one of {_TYPES}")
    if not 1 <= pool <= MAX_POOL:
        raise ValueError(f"pool={pool}: expected 1 to {MAX_POOL}")
    if channels % 32 or not 32 <= channels <= MAX_CHANNELS:
        raise ValueError(f"channels={channels}: expected a multiple of 32 up to {MAX_CHANNELS}")
    if spans not in (1, 2):
        raise ValueError(f"spans={spans}: expected 1 or 2")
    if pairs and channels % 64:
        raise ValueError(f"pairs with channels={channels}: expected a multiple of 64")
    if mask not in (MASK_NONE, MASK_INPUT, MASK_FLAGS) or (mask == MASK_FLAGS and spans != 1):
        raise ValueError(f"mask={mask} with spans={spans}: expected 0, 1, or 2 with one span")
    cpl = channels // 32
    head = (f"#define IS_BF16 {int(elem == 'bf16')}\n#define POOL {pool}\n#define CPL {cpl}\n"
            f"#define APE_IN_REGISTERS {int(cpl * pool <= APE_REGISTERS)}\n"
            f"#define SPANS {spans}\n#define PAIRS {int(pairs)}\n#define MASK {mask}\n#define MASK_NONE {MASK_NONE}\n"
            f"#define MASK_INPUT {MASK_INPUT}\n#define MASK_FLAGS {MASK_FLAGS}\n"
            f"#define MAX_WARPS {MAX_WARPS}\n#define KERNEL_NAME {KERNEL_NAME}\n#define FIRST_NAME {FIRST_NAME}\n"
            f"#define FIRST_THREADS {FIRST_THREADS}\n")
    return head + _BODY


def span_area(pool: int, token_stride: int, width: int) -> int:
    """Shared bytes of one span's copy in a stage: ``pool`` rows ``token_stride`` bytes apart, ``width`` bytes
    each, plus up to 15 bytes before the first (the 16-byte boundary), rounded up to 16."""
    return (((pool - 1) * token_stride + width + 15 + 15) >> 4) << 4


def shared_bytes(stage_bytes: int, warps: int) -> int:
    """Dynamic shared memory of a CTA of ``warps`` warps, two stages each."""
    return warps * 2 * stage_bytes
