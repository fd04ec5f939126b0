/* The DSA indexer score kernel for a few queries (sm_90a): keys streamed by TMA, warpgroup MMA with the query
   heads in registers; the design is described in indexer/wgmma_indexer_source.py, which prepends the specialisation's
   #defines (IS_BF16, HAS_KEY_MASK, WEIGHT_KIND, STAGES, PROGRAMS_PER_SM) and the geometry (HEADS, DIM, TILE_KEYS,
   THREADS, PANEL_BYTES, TILE_BYTES, REDUCE_BYTES). */
#include "../../hopper/ptx.cuh"
#include "../../hopper/wgmma.cuh"

/* d [64 x 64] (+)= A [64 x 16] B^T with A (the query heads) in registers, B in shared memory (K-major, 128-byte
   swizzle): one wgmma.mma_async m64n64k16 (the register-A overload of wgmma.cuh's form). */
__device__ __forceinline__ void wgmma_scores(float* acc, const u32* a, u64 desc_b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" WGMMA_M64N64K16 WGMMA_D32
               ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
               : WGMMA_ACC32(acc) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}
#define FULL_MASK 0xffffffffu
#define CODE_HIDDEN (-2147483647 - 1)

__device__ __forceinline__ int score_code(float score, bool visible) {
  const int bits = __float_as_int(score + 0.f);  /* + 0 folds -0 onto +0 */
  int code = bits >= 0 ? bits : bits ^ 0x7FFFFFFF;
  code = code > CODE_HIDDEN + 1 ? code : CODE_HIDDEN + 1;  /* only the all-ones NaN pattern reaches the hidden code */
  return visible ? code : CODE_HIDDEN;
}

/* weight i of the query's heads, as float: float32, bfloat16 or float16 (WEIGHT_KIND 0, 1, 2) */
__device__ __forceinline__ float load_weight(const void* w, long long i) {
#if WEIGHT_KIND == 0
  return __ldg((const float*)w + i);
#elif WEIGHT_KIND == 1
  return __uint_as_float((u32)__ldg((const unsigned short*)w + i) << 16);
#else
  float f;
  asm("{ .reg .f16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(__ldg((const unsigned short*)w + i)));
  return f;
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS, PROGRAMS_PER_SM) dsa_indexer_wgmma(
    const u16* __restrict__ q, const void* __restrict__ w, const unsigned char* __restrict__ key_mask,
    const long long* __restrict__ Lo, const long long* __restrict__ Hi, int* __restrict__ out,
    long long sqb, long long sqs, long long sqh, long long swb, long long sws, long long swh,
    long long smb, long long smt, long long sob, long long sos,
    long long row0, int H, int width, int tiles_per_program, float scale, long long query_count,
    long long key_count, int causal,
    const __grid_constant__ TensorMap keys) {
  extern __shared__ unsigned char smem_raw[];
  const u32 raw = smem_addr(smem_raw);
  const u32 base = (raw + 1023u) & ~1023u;
  float* red = (float*)(smem_raw + (base + TILE_BYTES * STAGES - raw));  /* [2][4][64] */
  const u32 bar_full = base + TILE_BYTES * STAGES + REDUCE_BYTES;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const long long local = blockIdx.y, b = blockIdx.z, qi = row0 + local;
  /* Lo null: the ranges of a call without packed sequences (reference.visible_ranges), computed here */
  long long lo = 0, hi = key_count;
  if (Lo != nullptr) {
    lo = Lo[qi]; hi = Hi[qi];
  } else if (causal) {
    hi = qi + key_count - query_count + 1;
    hi = hi < 0 ? 0 : hi;
  }
  hi = hi < width ? hi : width;
  const int tile_count = (width + TILE_KEYS - 1) / TILE_KEYS;
  const int t_begin = blockIdx.x * tiles_per_program;
  const int t_end = imin(t_begin + tiles_per_program, tile_count);
  /* the tiles of this run that hold a visible key: [v_begin, v_end) */
  const int v_begin = hi > lo ? (int)(t_begin > lo / TILE_KEYS ? t_begin : lo / TILE_KEYS) : t_end;
  const int v_end = hi > lo ? imin(t_end, (int)((hi + TILE_KEYS - 1) / TILE_KEYS)) : t_end;
  const int n = v_end > v_begin ? v_end - v_begin : 0;
  int* out_row = out + b * sob + local * sos;

  auto issue_tile = [&](int i) {
    const int stage = i % STAGES;
    const u32 dst = base + TILE_BYTES * stage, bar = bar_full + 8 * stage;
    mbar_expect_tx(bar, TILE_BYTES);
    tma_load(dst, &keys, 0, (v_begin + i) * TILE_KEYS, (int)b, bar);
    tma_load(dst + PANEL_BYTES, &keys, 64, (v_begin + i) * TILE_KEYS, (int)b, bar);
  };
  if (tid == 0) {
    for (int st = 0; st < STAGES; ++st) mbar_init(bar_full + 8 * st, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int i = 0; i < STAGES && i < n; ++i) issue_tile(i);
  }
  /* The query's heads as the MMA's A fragments in registers (heads past H are zeros): for k-step kk, rows r_a
     and r_a + 8, channels 16 kk + col2 (+ 1) and 16 kk + 8 + col2 (+ 1). */
  const int r_a = warp * 16 + (lane >> 2), col2 = 2 * (lane & 3);
  u32 qa[DIM / 16][4];
  {
    const u16* q_base = q + b * sqb + qi * sqs;
    const u32* row0p = (const u32*)(q_base + r_a * sqh + col2);
    const u32* row1p = (const u32*)(q_base + (r_a + 8) * sqh + col2);
    #pragma unroll
    for (int kk = 0; kk < DIM / 16; ++kk) {
      qa[kk][0] = r_a < H ? __ldg(row0p + 8 * kk) : 0u;
      qa[kk][1] = r_a + 8 < H ? __ldg(row1p + 8 * kk) : 0u;
      qa[kk][2] = r_a < H ? __ldg(row0p + 8 * kk + 4) : 0u;
      qa[kk][3] = r_a + 8 < H ? __ldg(row1p + 8 * kk + 4) : 0u;
    }
  }
  /* Tiles of the run outside the visible range: hidden codes, nothing loaded. */
  for (int t = t_begin * TILE_KEYS + tid; t < t_end * TILE_KEYS && t < width; t += THREADS) {
    if (t < v_begin * TILE_KEYS || t >= v_end * TILE_KEYS) out_row[t] = CODE_HIDDEN;
  }
  const float w0 = r_a < H ? load_weight(w, b * swb + qi * sws + r_a * swh) : 0.f;
  const float w1 = r_a + 8 < H ? load_weight(w, b * swb + qi * sws + (r_a + 8) * swh) : 0.f;
  __syncthreads();  /* the barriers are initialised */

  for (int i = 0; i < n; ++i) {
    const int stage = i % STAGES;
    const u32 s_k = base + TILE_BYTES * stage;
    mbar_wait(bar_full + 8 * stage, (i / STAGES) & 1);
    float acc[32];
    wgmma_fence();
    #pragma unroll
    for (int kk = 0; kk < DIM / 16; ++kk) {
      wgmma_scores(acc, qa[kk], smem_desc(s_k + (kk >> 2) * PANEL_BYTES + (kk & 3) * 32, 16, 1024), kk > 0);
    }
    wgmma_commit();
    wgmma_wait_all();
    /* v[2 j + c]: this thread's two heads folded, column 8 j + 2 (lane & 3) + c */
    float v[16];
    #pragma unroll
    for (int j = 0; j < 8; ++j) {
      #pragma unroll
      for (int c = 0; c < 2; ++c) {
        v[2 * j + c] = fmaxf(acc[4 * j + c] * scale, 0.f) * w0 + fmaxf(acc[4 * j + 2 + c] * scale, 0.f) * w1;
      }
    }
    /* Reduce-scatter over lane bits 4, 3, 2 (the lanes holding the same columns): lane l ends with the warp's
       sums of columns 2 l and 2 l + 1. */
    const bool b4 = (lane >> 4) & 1, b3 = (lane >> 3) & 1, b2 = (lane >> 2) & 1;
    #pragma unroll
    for (int m = 0; m < 8; ++m) {
      const float give = b4 ? v[m] : v[m + 8], keep = b4 ? v[m + 8] : v[m];
      v[m] = keep + __shfl_xor_sync(FULL_MASK, give, 16);
    }
    #pragma unroll
    for (int m = 0; m < 4; ++m) {
      const float give = b3 ? v[m] : v[m + 4], keep = b3 ? v[m + 4] : v[m];
      v[m] = keep + __shfl_xor_sync(FULL_MASK, give, 8);
    }
    #pragma unroll
    for (int m = 0; m < 2; ++m) {
      const float give = b2 ? v[m] : v[m + 2], keep = b2 ? v[m + 2] : v[m];
      v[m] = keep + __shfl_xor_sync(FULL_MASK, give, 4);
    }
    float* part = red + (i & 1) * 4 * TILE_KEYS;
    *(float2*)(part + warp * TILE_KEYS + 2 * lane) = make_float2(v[0], v[1]);
    __syncthreads();  /* every warp's sums are written and its MMAs on this stage completed */
    if (tid == 0 && i + STAGES < n) issue_tile(i + STAGES);
    if (tid < TILE_KEYS) {
      const float score = (part[tid] + part[TILE_KEYS + tid]) + (part[2 * TILE_KEYS + tid] + part[3 * TILE_KEYS + tid]);
      const long long key = (long long)(v_begin + i) * TILE_KEYS + tid;
      bool visible = key >= lo && key < hi;
#if HAS_KEY_MASK
      visible = visible && key_mask[b * smb + key * smt] != 0;
#endif
      if (key < width) out_row[key] = score_code(score, visible);
    }
  }
}
