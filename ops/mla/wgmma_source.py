"""CUDA C++ source of the Hopper (sm_90a) absorbed-MLA decode kernel: warpgroup MMA (wgmma) on shared memory.

Source text only (compiled at run time by NVRTC, see ``kda_compile.ops._nvrtc``); the launcher is
``wgmma_decode.py``. Triton 3.6 cannot express this schedule for 64 heads x (512 + 64) channels (see
results/README.md, "MLA decode kernel variants"): it splits the score product over both warpgroups
(32 tokens each, the [64, 576] query read from shared memory twice per tile) and waits for every copy
at the top of the loop. Here:

- A program (256 threads, two warpgroups) owns 64 rows of the flattened (query, head) axis of one
  batch element and one KV split; grid (row blocks, splits, B), row block fastest, so the programs
  sharing a latent tile run together and the second read comes from L2.
- Shared memory (1024-byte aligned, 128-byte swizzle): the query block [64, 576] (72 KB), two latent
  stages [64 tokens, 576] (72 KB each: 512 latent channels + 64 rope channels, stored as nine
  [64 x 64] panels of 128-byte rows), P [64 rows, 64 tokens] bf16/fp16 (8 KB) and per-row statistics.
  Tile i + 1 is copied (cp.async, zero-filled past the end) while tile i is computed.
- Warpgroup 0 computes S = Q C^T ([64 x 64], k = 576: 36 wgmma m64n64k16, both operands K-major in
  shared memory), the mask, an online softmax in base 2, and writes P and the per-row rescale factor.
  Both warpgroups then accumulate O += P V over their half of the 512 value channels (wgmma
  m64n256k16, V read N-major from the same latent stage: each latent tile is read once from global
  memory for both products); the [64 x 256] fp32 accumulator is 128 registers per thread.
- Lazy rescaling: a row's running max is only raised when a tile's max exceeds it by more than
  ``RESCALE_THRESHOLD`` (base 2), so P is bounded by 2^8 and the accumulator rescale (128 multiplies per
  thread) is skipped for most tiles. The stored (max, sum) pair is consistent, so the split merge is
  unchanged.
- Output: normalised o (bf16/fp16 when the split is the only one, fp32 partials otherwise) plus the
  row max and exp-sum (natural-log units), exactly the contract of the Triton split kernel, so the
  Triton merge kernel combines the splits.

Compile-time switches (``#define``): ``ELEM`` (bf16 / f16), ``IS_CAUSAL``, ``MASK_KIND`` (0 none, 1 uint8
keep-mask, 2 additive float32), ``PARTIAL``.
"""
from __future__ import annotations

ROWS = 64  # (query, head) rows per program = the wgmma M
TILE_TOKENS = 64  # cached tokens per tile
LATENT_DIM = 512
ROPE_DIM = 64
THREADS = 256
PANEL_BYTES = 64 * 128  # 64 rows of 128 bytes (64 half-precision channels)
TILE_BYTES = (LATENT_DIM + ROPE_DIM) // 64 * PANEL_BYTES  # 9 panels
P_BYTES = PANEL_BYTES
STAT_BYTES = 6 * ROWS * 4  # alpha, final max, final sums and tile maxima per warpgroup
# The dynamic shared memory asked for: query, two stages, P, stats, and 1 KB to align the base to 1024.
SHARED_BYTES = 3 * TILE_BYTES + P_BYTES + STAT_BYTES + 1024
RESCALE_THRESHOLD = 8.0  # log2 units: P <= 256 between rescales

KERNEL_NAME = "mla_decode_wgmma"


def _operands(count: int) -> str:
    return ", ".join(f"%{i}" for i in range(count))


def _wgmma(name: str, n: int, acc: str, trans_b: int) -> str:
    """A device function issuing one ``wgmma.mma_async m64n{n}k16`` with both operands in shared memory."""
    regs = n // 2
    outs = ", ".join(f'"+f"({acc}[{i}])' for i in range(regs))
    return f"""
__device__ __forceinline__ void {name}(float* {acc}, u64 desc_a, u64 desc_b, int accumulate) {{
  asm volatile(
    "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 2}, 0;\\n"
    "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.ELEM_PTX.ELEM_PTX "
    "{{{_operands(regs)}}}, %{regs}, %{regs + 1}, p, 1, 1, 0, {trans_b};\\n}}\\n"
    : {outs}
    : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}}
"""


_PRELUDE = r"""
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

#define ROWS 64
#define TILE_TOKENS 64
#define CHUNKS_PER_ROW 72          /* (512 + 64) channels x 2 bytes / 16 */
#define LATENT_CHUNKS 64
#define PANEL_BYTES 8192
#define TILE_BYTES 73728
#define LOAD_THREADS (LOADER_WG1 ? 128 : 256)  /* the threads copying the latent tiles */
#define LOADS_PER_THREAD (4608 / LOAD_THREADS)  /* 64 rows x 72 chunks */
#define NEG_INF __int_as_float(0xff800000)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ float fast_log2(float x) {
  float y; asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
}
__device__ __forceinline__ void st_global_f32x2(float* p, float a, float b) {
  asm volatile("st.global.v2.f32 [%0], {%1, %2};" :: "l"(p), "f"(a), "f"(b) : "memory");
}
/* Score units: base 2 (the scale carries log2(e)), or natural with an additive mask, whose huge finite
   values (finfo.min) must not overflow to -inf when multiplied by log2(e). */
#if MASK_KIND == 2
#define TO_LOG2 LOG2E
#define TO_NATURAL 1.0f
#else
#define TO_LOG2 1.0f
#define TO_NATURAL LN2
#endif
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 r;
  asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
#if SPLIT_S
#define SCORE_N 32
#define SCORES_HERE true
#define TOKEN_BASE (wg * 32)
#else
#define SCORE_N 64
#define SCORES_HERE (wg == 0)
#define TOKEN_BASE 0
#endif
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ float fast_exp2(float x) {
  float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
}
__device__ __forceinline__ void st_shared_b32(u32 addr, u32 v) {
  asm volatile("st.shared.b32 [%0], %1;" :: "r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r; asm("cvt.rn.ELEM_PTXx2.f32 %0, %2, %1;" : "=r"(r) : "f"(lo), "f"(hi)); return r;
}
/* Shared-memory matrix descriptor, 128-byte swizzle. K-major operands: lead = unused (16), stride =
   1024 (next 8 rows). N-major operands: lead = next 64-channel panel, stride = next 8 K-rows. */
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 lead, u32 stride) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lead >> 4) << 16) | ((u64)(stride >> 4) << 32) | (1ull << 62);
}
/* The byte offset of 16-byte chunk c (0..71) of row r (0..63) in a [64 x 576] swizzled tile. */
__device__ __forceinline__ u32 tile_offset(int r, int c) {
  return (u32)((c >> 3) * PANEL_BYTES + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}
"""

_KERNEL = r"""
extern "C" __global__ void __launch_bounds__(256, 1) mla_decode_wgmma(
    const u16* __restrict__ q_lat, const u16* __restrict__ q_rope, const u16* __restrict__ latent,
    const u16* __restrict__ k_rope, const void* __restrict__ mask, void* __restrict__ out,
    float* __restrict__ lse, float* __restrict__ row_max, float* __restrict__ row_sum,
    long long sqb, long long sqh, long long sqs, long long spb, long long sph, long long sps,
    long long scb, long long sct, long long skb, long long skt,
    long long smb, long long smh, long long sms, long long smt,
    long long sob, long long soh, long long sos, long long sosplit,
    long long slb, long long slh, long long sls, long long slsplit,
    int H, int Sq, int T, int tiles_per_split, float scale) {
  extern __shared__ unsigned char smem_raw[];
  const u32 raw = smem_addr(smem_raw);
  const u32 base = (raw + 1023u) & ~1023u;
  const u32 s_q = base, s_p = base + 3 * TILE_BYTES;
  float* stats = (float*)(smem_raw + (s_p + PANEL_BYTES - raw));
  float* s_alpha = stats;            /* [64] rescale factor of this tile */
  float* s_max = stats + ROWS;       /* [64] final running max */
  float* s_lsum = stats + 2 * ROWS;  /* [2][64] final row sums per scoring warpgroup */
#if SPLIT_S
  float* s_tmax = stats + 4 * ROWS;  /* [2][64] tile row maxima per warpgroup */
#endif

  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int row0 = blockIdx.x * ROWS, rows_total = Sq * H;
  const int split = blockIdx.y;
  const long long b = blockIdx.z;
  const int lo = split * tiles_per_split * TILE_TOKENS;
  int hi = imin(lo + tiles_per_split * TILE_TOKENS, T);
#if IS_CAUSAL
  { const int last_row = imin(row0 + ROWS, rows_total) - 1; hi = imin(hi, T - Sq + last_row / H + 1); }
#endif
  const int num_tiles = hi > lo ? (hi - lo + TILE_TOKENS - 1) / TILE_TOKENS : 0;

  /* The query block: rows past Sq * H are zero-filled. */
  #pragma unroll
  for (int k = 0; k < 18; ++k) {
    const int idx = tid + 256 * k, r = idx / CHUNKS_PER_ROW, c = idx - r * CHUNKS_PER_ROW;
    const int row = row0 + r;
    const bool ok = row < rows_total;
    const int qi = ok ? row / H : 0, h = ok ? row - qi * H : 0;
    const u16* src = c < LATENT_CHUNKS ? q_lat + b * sqb + h * sqh + qi * sqs + c * 8
                                       : q_rope + b * spb + h * sph + qi * sps + (c - LATENT_CHUNKS) * 8;
    cp_async16(s_q + tile_offset(r, c), ok ? (const void*)src : (const void*)q_lat, ok ? 16 : 0);
  }
  const u16* lat_b = latent + b * scb;
  const u16* rope_b = k_rope + b * skb;
  auto load_tile = [&](int tile, u32 stage) {
    if (LOADER_WG1 && wg == 0) return;
    const int t0 = lo + tile * TILE_TOKENS;
    #pragma unroll
    for (int k = 0; k < LOADS_PER_THREAD; ++k) {
      const int idx = (LOADER_WG1 ? tid - 128 : tid) + LOAD_THREADS * k, r = idx / CHUNKS_PER_ROW;
      const int c = idx - r * CHUNKS_PER_ROW;
      const int tok = t0 + r;
      const bool ok = tok < hi;
      const u16* src = c < LATENT_CHUNKS ? lat_b + (long long)tok * sct + c * 8
                                         : rope_b + (long long)tok * skt + (c - LATENT_CHUNKS) * 8;
      cp_async16(stage + tile_offset(r, c), ok ? (const void*)src : (const void*)latent, ok ? 16 : 0);
    }
  };
  if (num_tiles > 0) load_tile(0, base + TILE_BYTES);
  cp_async_commit();

  /* This thread's accumulator rows (the wgmma D layout): r_a and r_a + 8 of the 64. */
  const int r_a = warp * 16 + (lane >> 2);
  const int col2 = 2 * (lane & 3);
  int row_limit[2];
#if MASK_KIND
  long long mask_row[2];
#endif
  #pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int row = row0 + r_a + 8 * e;
    const int qi = row < rows_total ? row / H : 0;
    row_limit[e] = IS_CAUSAL ? imin(hi, T - Sq + qi + 1) : hi;
#if MASK_KIND
    const int h = row < rows_total ? row - qi * H : 0;
    mask_row[e] = b * smb + h * smh + qi * sms;
#endif
  }
  float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};
  float o[128];
  #pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;

  for (int it = 0; it < num_tiles; ++it) {
    cp_async_wait_all();
    fence_async_shared();
    __syncthreads();  /* tile it has landed everywhere; every warp is done with tile it - 1 and P */
    if (it + 1 < num_tiles && (!DBG_NO_LOADS || it < 1)) load_tile(it + 1, base + TILE_BYTES * (1 + ((it + 1) & 1)));
    cp_async_commit();
    const u32 s_kv = base + TILE_BYTES * (1 + (it & 1));
    const int t0 = lo + it * TILE_TOKENS;
    if (SCORES_HERE) {
      float s[SCORE_N / 2];
#if !DBG_NO_S
      wgmma_fence();
      #pragma unroll
      for (int kk = 0; kk < 36; ++kk) {
        const u32 off = (kk >> 2) * PANEL_BYTES + (kk & 3) * 32;
        wgmma_scores(s, smem_desc(s_q + off, 16, 1024), smem_desc(s_kv + off + TOKEN_BASE * 128, 16, 1024), kk > 0);
      }
      wgmma_commit();
      wgmma_wait_all();
#else
      #pragma unroll
      for (int i = 0; i < SCORE_N / 2; ++i) s[i] = 0.01f * i;
#endif
      float tile_max[2] = {NEG_INF, NEG_INF};
      #pragma unroll
      for (int i = 0; i < SCORE_N / 2; ++i) {
        const int e = (i >> 1) & 1;
        const int tok = t0 + TOKEN_BASE + 8 * (i >> 2) + col2 + (i & 1);
        bool keep = tok < row_limit[e];
        float v = s[i] * scale;
#if MASK_KIND == 1
        keep = keep && ((const unsigned char*)mask)[mask_row[e] + tok * smt] != 0;
#elif MASK_KIND == 2
        if (keep) v += ((const float*)mask)[mask_row[e] + tok * smt];
#endif
        s[i] = keep ? v : NEG_INF;
        tile_max[e] = fmaxf(tile_max[e], s[i]);
      }
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        tile_max[e] = fmaxf(tile_max[e], __shfl_xor_sync(0xffffffffu, tile_max[e], 1));
        tile_max[e] = fmaxf(tile_max[e], __shfl_xor_sync(0xffffffffu, tile_max[e], 2));
      }
#if SPLIT_S
      /* Each warpgroup saw half of the tile's tokens: exchange the row maxima. */
      if ((lane & 3) == 0) { s_tmax[wg * ROWS + r_a] = tile_max[0]; s_tmax[wg * ROWS + r_a + 8] = tile_max[1]; }
      bar_sync(1, 256);
      tile_max[0] = fmaxf(tile_max[0], s_tmax[(1 - wg) * ROWS + r_a]);
      tile_max[1] = fmaxf(tile_max[1], s_tmax[(1 - wg) * ROWS + r_a + 8]);
#endif
      float alpha[2];
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        alpha[e] = 1.f;
        if (tile_max[e] > m_run[e] + RESCALE_THRESHOLD / TO_LOG2) {  /* false while both are -inf */
          alpha[e] = fast_exp2((m_run[e] - tile_max[e]) * TO_LOG2);  /* 0 when m_run is -inf */
          m_run[e] = tile_max[e];
        }
        l_run[e] *= alpha[e];
      }
      const float m_use[2] = {m_run[0] == NEG_INF ? 0.f : m_run[0], m_run[1] == NEG_INF ? 0.f : m_run[1]};
      #pragma unroll
      for (int j = 0; j < SCORE_N / 8; ++j) {
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
#if DBG_NO_SOFTMAX
          const float p0 = s[4 * j + 2 * e], p1 = s[4 * j + 2 * e + 1];
#else
          const float p0 = fast_exp2((s[4 * j + 2 * e] - m_use[e]) * TO_LOG2);
          const float p1 = fast_exp2((s[4 * j + 2 * e + 1] - m_use[e]) * TO_LOG2);
#endif
          l_run[e] += p0 + p1;
          const int r = r_a + 8 * e, chunk = TOKEN_BASE / 8 + j;
          st_shared_b32(s_p + r * 128 + ((chunk ^ (r & 7)) << 4) + 2 * col2, pack2(p0, p1));
        }
      }
      if (wg == 0 && (lane & 3) == 0) { s_alpha[r_a] = alpha[0]; s_alpha[r_a + 8] = alpha[1]; }
      fence_async_shared();
    }
    __syncthreads();  /* P and the rescale factors are written */
    const float a0 = s_alpha[r_a], a1 = s_alpha[r_a + 8];
    if (a0 != 1.f || a1 != 1.f) {
      #pragma unroll
      for (int i = 0; i < 128; ++i) o[i] *= (i & 2) ? a1 : a0;
    }
#if !DBG_NO_PV
    wgmma_fence();
    #pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      wgmma_values(o, smem_desc(s_p + kk * 32, 16, 1024),
                   smem_desc(s_kv + wg * 4 * PANEL_BYTES + kk * 2048, PANEL_BYTES, 1024), 1);
    }
    wgmma_commit();
    wgmma_wait_all();
#endif
  }
  cp_async_wait_all();

  if (SCORES_HERE) {  /* each scoring warpgroup holds partial row sums over its tokens */
    #pragma unroll
    for (int e = 0; e < 2; ++e) {
      l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 1);
      l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 2);
    }
    if ((lane & 3) == 0) {
      s_lsum[wg * ROWS + r_a] = l_run[0]; s_lsum[wg * ROWS + r_a + 8] = l_run[1];
      s_max[r_a] = m_run[0]; s_max[r_a + 8] = m_run[1];
    }
  }
  __syncthreads();
  #pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = r_a + 8 * e, row = row0 + r;
    if (row >= rows_total) continue;
    const int qi = row / H, h = row - qi * H;
    const float l = SPLIT_S ? s_lsum[r] + s_lsum[ROWS + r] : s_lsum[r];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const long long o_base = b * sob + h * soh + qi * sos + split * sosplit + wg * 256 + col2;
    #pragma unroll
    for (int j = 0; j < 32; ++j) {
      const float v0 = o[4 * j + 2 * e] * inv, v1 = o[4 * j + 2 * e + 1] * inv;
#if PARTIAL
      st_global_f32x2((float*)out + o_base + 8 * j, v0, v1);
#else
      *(u32*)((u16*)out + o_base + 8 * j) = pack2(v0, v1);
#endif
    }
    if (wg == 0 && (lane & 3) == 0) {
      const long long stat = b * slb + h * slh + qi * sls + split * slsplit;
      const float m = s_max[r];
#if PARTIAL
      row_max[stat] = m == NEG_INF ? NEG_INF : m * TO_NATURAL;
      row_sum[stat] = l;
#else
      lse[stat] = l > 0.f ? (m == NEG_INF ? 0.f : m) * TO_NATURAL + fast_log2(l) * LN2 : NEG_INF;
#endif
    }
  }
}
"""


DEFAULT_SWITCHES = {"SPLIT_S": 0, "LOADER_WG1": 0,
                    "DBG_NO_LOADS": 0, "DBG_NO_S": 0, "DBG_NO_PV": 0, "DBG_NO_SOFTMAX": 0}


def kernel_source(*, elem: str, is_causal: bool, mask_kind: int, partial: bool, switches: dict | None = None) -> str:
    """The kernel's CUDA source for one specialisation (``elem``: "bf16" or "f16"). ``switches`` override
    ``DEFAULT_SWITCHES`` (schedule experiments; the DBG_ ones break the results and are for timing only)."""
    if elem not in ("bf16", "f16"):
        raise ValueError(f"elem must be 'bf16' or 'f16', got {elem!r}")
    if mask_kind not in (0, 1, 2):
        raise ValueError(f"mask_kind must be 0, 1 or 2, got {mask_kind!r}")
    flags = {**DEFAULT_SWITCHES, **(switches or {})}
    defines = "".join(f"#define {k} {int(v)}\n" for k, v in flags.items())
    defines += (f"#define IS_CAUSAL {int(is_causal)}\n#define MASK_KIND {mask_kind}\n#define PARTIAL {int(partial)}\n"
               f"#define RESCALE_THRESHOLD {RESCALE_THRESHOLD}f\n")
    scores = _wgmma("wgmma_scores", 32 if flags["SPLIT_S"] else 64, "d", 0)
    body = _PRELUDE + scores + _wgmma("wgmma_values", 256, "d", 1) + _KERNEL
    return defines + body.replace("ELEM_PTX", elem)
