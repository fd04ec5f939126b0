"""CUDA C++ source of the Hopper (sm_90a) absorbed-MLA decode kernel: TMA copies, warpgroup MMA (wgmma).

Source text only (compiled at run time by NVRTC, see ``kda_compile.ops._nvrtc``); the launcher is
``wgmma_decode.py``. Triton 3.6 cannot express this schedule for 64 heads x (512 + 64) channels (see
docs/mla-decode-kernels.md section 2). Here:

- A program (384 threads, three warpgroups) owns 64 rows of the flattened (query, head) axis of one
  batch element and one KV split; grid (row blocks, splits, B), row block fastest, so the programs
  sharing a latent tile run together and the second read comes from L2.
- Shared memory (1024-byte aligned, 128-byte swizzle): the query block [64, 576] (72 KB), two latent
  stages [64 tokens, 576] (72 KB each: 512 latent channels + 64 rope channels, stored as nine
  [64 x 64] panels of 128-byte rows), P [64 rows, 64 tokens] bf16/fp16 (8 KB), per-row statistics and
  the stages' mbarriers.
- One thread copies each tile with nine TMA boxes (zero-filled past the cache's end) into a free stage;
  the stage's "full" mbarrier counts the bytes. A stage is free again when the value warps signal its
  "empty" mbarrier, so tile i + 2 streams in while tiles i and i + 1 are computed.
- Warpgroup 0 (scores) computes S = Q C^T ([64 x 64], k = 576: 36 wgmma m64n64k16, both operands
  K-major in shared memory), the mask, an online softmax in base 2, and hands P and the per-row rescale
  factor to warpgroups 1 and 2 (named barriers P_READY / P_FREE). Warpgroups 1 and 2 (values)
  accumulate O += P V over their half of the 512 value channels (wgmma m64n256k16, V read N-major from
  the same stage: each latent tile is read once from global memory for both products); the
  [64 x 256] fp32 accumulator is 128 registers per thread. So the score product of tile i + 1 and
  its softmax run while the value product of tile i does.
- Lazy rescaling: a row's running max is only raised when a tile's max exceeds it by more than
  ``RESCALE_THRESHOLD`` (base 2), so P is bounded by 2^8 and the accumulator rescale (128 multiplies per
  thread) is skipped for most tiles. The stored (max, sum) pair is consistent, so the split merge is
  unchanged.
- Output: normalised o (bf16/fp16 when the split is the only one, fp32 partials otherwise) plus the
  row max and exp-sum (natural-log units), exactly the contract of the Triton split kernel, so the
  Triton merge kernel combines the splits.

Compile-time switches (``#define``): ``ELEM`` (bf16 / f16), ``IS_CAUSAL``, ``MASK_KIND`` (0 none, 1 uint8
keep-mask, 2 additive float32), ``PARTIAL``; for timing experiments only (they break the results):
``DBG_NO_S``, ``DBG_NO_PV``, ``DBG_NO_SOFTMAX`` drop the score product, the value product, the exponentials.
"""
from __future__ import annotations

ROWS = 64  # (query, head) rows per program = the wgmma M
TILE_TOKENS = 64  # cached tokens per tile
LATENT_DIM = 512
ROPE_DIM = 64
THREADS = 384
PANEL_BYTES = 64 * 128  # 64 rows of 128 bytes (64 half-precision channels)
TILE_BYTES = (LATENT_DIM + ROPE_DIM) // 64 * PANEL_BYTES  # 9 panels
P_BYTES = PANEL_BYTES
STAT_BYTES = 4 * ROWS * 4  # rescale factors, final max, final sums (room for four [64] float arrays)
BARRIER_BYTES = 4 * 8  # full and empty mbarriers of the two stages
# The dynamic shared memory asked for: query, two stages, P, stats, barriers, and 1 KB to align the base to 1024.
SHARED_BYTES = 3 * TILE_BYTES + P_BYTES + STAT_BYTES + BARRIER_BYTES + 1024
RESCALE_THRESHOLD = 8.0  # log2 units: P <= 256 between rescales
TMA_BOX = (64, TILE_TOKENS)  # channels x tokens per TMA copy (128 bytes x 64 rows: one swizzled panel)

KERNEL_NAME = "mla_decode_wgmma"


def _operands(count: int) -> str:
    return ", ".join(f"%{i}" for i in range(count))


def wgmma_function(name: str, n: int, acc: str, trans_b: int) -> str:
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


# Shared with the DSA sparse-attention kernel (ops/dsa/wgmma_sparse_source.py): helpers and PTX wrappers.
PRELUDE = r"""
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

#define CHUNKS_PER_ROW 72          /* (512 + 64) channels x 2 bytes / 16 */
#define LATENT_CHUNKS 64
#define COPIER 128                 /* the thread issuing the TMA copies (first of warpgroup 1) */
#define BAR_P_READY 1              /* named barriers: P and the rescale factors of a tile are written ... */
#define BAR_P_FREE 2               /* ... and the value warps are done reading them */
#define VALUE_WARPS 8
#define NEG_INF __int_as_float(0xff800000)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ float fast_log2(float x) {
  float y; asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
}
__device__ __forceinline__ float fast_exp2(float x) {
  float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
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
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void st_shared_b32(u32 addr, u32 v) {
  asm volatile("st.shared.b32 [%0], %1;" :: "r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r; asm("cvt.rn.ELEM_PTXx2.f32 %0, %2, %1;" : "=r"(r) : "f"(lo), "f"(hi)); return r;
}
/* The driver's CUtensorMap (cuTensorMapEncodeTiled on the host), passed by value as a __grid_constant__. */
struct __align__(64) TensorMap { u64 opaque[16]; };
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  u32 done;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
/* One [64 tokens x 64 channels] box at (channel c0, token c1, batch c2) into 128-byte-swizzled shared
   memory, counted on `bar`; tokens past the cache's end arrive as zeros. */
__device__ __forceinline__ void tma_load(u32 dst, const TensorMap* map, int c0, int c1, int c2, u32 bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4}], [%5];"
               :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
/* Shared-memory matrix descriptor, 128-byte swizzle. K-major operands: lead = unused (16), stride =
   1024 (next 8 rows). N-major operands: lead = next 64-channel panel, stride = next 8 K-rows. */
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 lead, u32 stride) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lead >> 4) << 16) | ((u64)(stride >> 4) << 32) | (1ull << 62);
}
/* The byte offset of 16-byte chunk c (0..71) of row r (0..63) in a [64 x 576] swizzled block. */
__device__ __forceinline__ u32 tile_offset(int r, int c) {
  return (u32)((c >> 3) * PANEL_BYTES + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}
/* One tile's online-softmax step over a thread's 32 scores of the wgmma m64n64 accumulator (rows r and r + 8;
   masked entries -inf; units that TO_LOG2 turns into base 2) and its rows' maxima over them: the maxima across
   the quad, a lazy rescale (alpha = 1 unless a row's tile max exceeds its running max by RESCALE_THRESHOLD), the
   running sums, and P as packed pairs of ELEM. */
__device__ __forceinline__ void online_softmax_tile(const float* s, float* tile_max, float* m_run, float* l_run,
                                                    float* alpha, u32* p_pack) {
  #pragma unroll
  for (int e = 0; e < 2; ++e) {
    tile_max[e] = fmaxf(tile_max[e], __shfl_xor_sync(0xffffffffu, tile_max[e], 1));
    tile_max[e] = fmaxf(tile_max[e], __shfl_xor_sync(0xffffffffu, tile_max[e], 2));
    alpha[e] = 1.f;
    if (tile_max[e] > m_run[e] + RESCALE_THRESHOLD / TO_LOG2) {  /* false while both are -inf */
      alpha[e] = fast_exp2((m_run[e] - tile_max[e]) * TO_LOG2);  /* 0 when m_run is -inf */
      m_run[e] = tile_max[e];
    }
    l_run[e] *= alpha[e];
  }
  const float m_use[2] = {m_run[0] == NEG_INF ? 0.f : m_run[0], m_run[1] == NEG_INF ? 0.f : m_run[1]};
  #pragma unroll
  for (int j = 0; j < 8; ++j) {
    #pragma unroll
    for (int e = 0; e < 2; ++e) {
#if DBG_NO_SOFTMAX
      const float p0 = s[4 * j + 2 * e], p1 = s[4 * j + 2 * e + 1];
#else
      const float p0 = fast_exp2((s[4 * j + 2 * e] - m_use[e]) * TO_LOG2);
      const float p1 = fast_exp2((s[4 * j + 2 * e + 1] - m_use[e]) * TO_LOG2);
#endif
      l_run[e] += p0 + p1;
      p_pack[2 * j + e] = pack2(p0, p1);
    }
  }
}
"""

_KERNEL = r"""
extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_wgmma(
    const u16* __restrict__ q_lat, const u16* __restrict__ q_rope, const void* __restrict__ mask,
    void* __restrict__ out, float* __restrict__ lse, float* __restrict__ row_max, float* __restrict__ row_sum,
    long long sqb, long long sqh, long long sqs, long long spb, long long sph, long long sps,
    long long smb, long long smh, long long sms, long long smt,
    long long sob, long long soh, long long sos, long long sosplit,
    long long slb, long long slh, long long sls, long long slsplit,
    int H, int Sq, int T, int tiles_per_split, float scale,
    const __grid_constant__ TensorMap tm_latent, const __grid_constant__ TensorMap tm_rope) {
  extern __shared__ unsigned char smem_raw[];
  const u32 raw = smem_addr(smem_raw);
  const u32 base = (raw + 1023u) & ~1023u;
  const u32 s_q = base, s_p = base + 3 * TILE_BYTES;
  float* stats = (float*)(smem_raw + (s_p + PANEL_BYTES - raw));
  float* s_alpha = stats;            /* [64] rescale factor of the current tile */
  float* s_max = stats + ROWS;       /* [64] final running max */
  float* s_lsum = stats + 2 * ROWS;  /* [64] final row sums */
  /* full[stage]: the stage's bytes landed; empty[stage]: the value warps are done with it. */
  const u32 bar_full = s_p + PANEL_BYTES + STAT_BYTES, bar_empty = bar_full + 16;

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

  /* The query block (every thread, cp.async): rows past Sq * H are zero-filled. */
  #pragma unroll
  for (int k = 0; k < 64 * CHUNKS_PER_ROW / THREADS; ++k) {
    const int idx = tid + THREADS * k, r = idx / CHUNKS_PER_ROW, c = idx - r * CHUNKS_PER_ROW;
    const int row = row0 + r;
    const bool ok = row < rows_total;
    const int qi = ok ? row / H : 0, h = ok ? row - qi * H : 0;
    const u16* src = c < LATENT_CHUNKS ? q_lat + b * sqb + h * sqh + qi * sqs + c * 8
                                       : q_rope + b * spb + h * sph + qi * sps + (c - LATENT_CHUNKS) * 8;
    cp_async16(s_q + tile_offset(r, c), ok ? (const void*)src : (const void*)q_lat, ok ? 16 : 0);
  }
  asm volatile("cp.async.commit_group;" ::: "memory");

  auto issue_tile = [&](int tile, int stage) {  /* nine boxes: eight latent panels and the rope panel */
    const u32 dst = base + TILE_BYTES * (1 + stage), bar = bar_full + 8 * stage;
    const int tok = lo + tile * TILE_TOKENS;
    mbar_expect_tx(bar, TILE_BYTES);
    #pragma unroll
    for (int p = 0; p < 8; ++p) tma_load(dst + p * PANEL_BYTES, &tm_latent, p * 64, tok, (int)b, bar);
    tma_load(dst + 8 * PANEL_BYTES, &tm_rope, 0, tok, (int)b, bar);
  };
  if (tid == 0) {
    mbar_init(bar_full, 1); mbar_init(bar_full + 8, 1);
    mbar_init(bar_empty, VALUE_WARPS); mbar_init(bar_empty + 8, VALUE_WARPS);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (tid == COPIER) {
    for (int st = 0; st < 2 && st < num_tiles; ++st) issue_tile(st, st);
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  fence_async_shared();
  __syncthreads();  /* the query block landed */

  /* This thread's accumulator rows (the wgmma D layout): r_a and r_a + 8 of the 64. */
  const int r_a = warp * 16 + (lane >> 2);
  const int col2 = 2 * (lane & 3);
  float o[128];  /* value warpgroups: O[:, 256 (wg - 1) + ...] */
  float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};  /* score warpgroup */

  if (wg == 0) {
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
    for (int it = 0; it < num_tiles; ++it) {
      const u32 s_kv = base + TILE_BYTES * (1 + (it & 1));
      const int t0 = lo + it * TILE_TOKENS;
      mbar_wait(bar_full + 8 * (it & 1), (it >> 1) & 1);  /* tile it has landed */
      float s[32];
#if !DBG_NO_S
      wgmma_fence();
      #pragma unroll
      for (int kk = 0; kk < 36; ++kk) {
        const u32 off = (kk >> 2) * PANEL_BYTES + (kk & 3) * 32;
        wgmma_scores(s, smem_desc(s_q + off, 16, 1024), smem_desc(s_kv + off, 16, 1024), kk > 0);
      }
      wgmma_commit();
      wgmma_wait_all();
#else
      #pragma unroll
      for (int i = 0; i < 32; ++i) s[i] = 0.01f * i;
#endif
      float tile_max[2] = {NEG_INF, NEG_INF};
      #pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int e = (i >> 1) & 1;
        const int tok = t0 + 8 * (i >> 2) + col2 + (i & 1);
        bool keep = tok < row_limit[e];
        float v = s[i] * scale;
#if MASK_KIND
        const long long at = mask_row[e] + imin(tok, T - 1) * smt;  /* read unconditionally: no divergence */
#endif
#if MASK_KIND == 1
        keep = keep & (((const unsigned char*)mask)[at] != 0);
#elif MASK_KIND == 2
        v += ((const float*)mask)[at];
#endif
        s[i] = keep ? v : NEG_INF;
        tile_max[e] = fmaxf(tile_max[e], s[i]);
      }
      float alpha[2];
      u32 p_pack[16];
      online_softmax_tile(s, tile_max, m_run, l_run, alpha, p_pack);
      if (it > 0) bar_sync(BAR_P_FREE, THREADS);  /* the value warps are done with P of tile it - 1 */
      #pragma unroll
      for (int j = 0; j < 8; ++j) {
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int r = r_a + 8 * e;
          st_shared_b32(s_p + r * 128 + ((j ^ (r & 7)) << 4) + 2 * col2, p_pack[2 * j + e]);
        }
      }
      if ((lane & 3) == 0) { s_alpha[r_a] = alpha[0]; s_alpha[r_a + 8] = alpha[1]; }
      fence_async_shared();
      bar_arrive(BAR_P_READY, THREADS);
    }
    #pragma unroll
    for (int e = 0; e < 2; ++e) {
      l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 1);
      l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 2);
    }
    if ((lane & 3) == 0) {
      s_lsum[r_a] = l_run[0]; s_lsum[r_a + 8] = l_run[1];
      s_max[r_a] = m_run[0]; s_max[r_a + 8] = m_run[1];
    }
  } else {
    #pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    const u32 v_cols = (wg - 1) * 4 * PANEL_BYTES;
    for (int it = 0; it < num_tiles; ++it) {
      const int stage = it & 1;
      const u32 s_kv = base + TILE_BYTES * (1 + stage);
      bar_sync(BAR_P_READY, THREADS);  /* P and the rescale factors of tile it are written */
      mbar_wait(bar_full + 8 * stage, (it >> 1) & 1);  /* (already complete: orders the TMA bytes for us) */
      const float a0 = s_alpha[r_a], a1 = s_alpha[r_a + 8];
      if (a0 != 1.f || a1 != 1.f) {
        #pragma unroll
        for (int i = 0; i < 128; ++i) o[i] *= (i & 2) ? a1 : a0;
      }
#if !DBG_NO_PV
      wgmma_fence();
      #pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        wgmma_values(o, smem_desc(s_p + kk * 32, 16, 1024), smem_desc(s_kv + v_cols + kk * 2048, PANEL_BYTES, 1024), 1);
      }
      wgmma_commit();
      wgmma_wait_all();
#endif
      if (it + 1 < num_tiles) bar_arrive(BAR_P_FREE, THREADS);
      if (it + 2 < num_tiles) {  /* the stage is free for tile it + 2 once every value warp is done */
        if (lane == 0) mbar_arrive(bar_empty + 8 * stage);
        if (tid == COPIER) {
          mbar_wait(bar_empty + 8 * stage, (it >> 1) & 1);
          issue_tile(it + 2, stage);
        }
        __syncwarp();
      }
    }
  }
  __syncthreads();  /* the row statistics are in shared memory */

  #pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = r_a + 8 * e, row = row0 + r;
    if (row >= rows_total) continue;
    const int qi = row / H, h = row - qi * H;
    const float l = s_lsum[r];
    if (wg == 0) {
      if ((lane & 3) == 0) {
        const long long stat = b * slb + h * slh + qi * sls + split * slsplit;
        const float m = s_max[r];
#if PARTIAL
        row_max[stat] = m == NEG_INF ? NEG_INF : m * TO_NATURAL;
        row_sum[stat] = l;
#else
        lse[stat] = l > 0.f ? (m == NEG_INF ? 0.f : m) * TO_NATURAL + fast_log2(l) * LN2 : NEG_INF;
#endif
      }
      continue;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const long long o_base = b * sob + h * soh + qi * sos + split * sosplit + (wg - 1) * 256 + col2;
    #pragma unroll
    for (int j = 0; j < 32; ++j) {
      const float v0 = o[4 * j + 2 * e] * inv, v1 = o[4 * j + 2 * e + 1] * inv;
#if PARTIAL
      st_global_f32x2((float*)out + o_base + 8 * j, v0, v1);
#else
      *(u32*)((u16*)out + o_base + 8 * j) = pack2(v0, v1);
#endif
    }
  }
}
"""


DEBUG_SWITCHES = {"DBG_NO_S": 0, "DBG_NO_PV": 0, "DBG_NO_SOFTMAX": 0}


def kernel_source(*, elem: str, is_causal: bool, mask_kind: int, partial: bool, switches: dict | None = None) -> str:
    """The kernel's CUDA source for one specialisation (``elem``: "bf16" or "f16"). ``switches`` set
    ``DEBUG_SWITCHES`` (timing experiments only: they break the results)."""
    if elem not in ("bf16", "f16"):
        raise ValueError(f"elem must be 'bf16' or 'f16', got {elem!r}")
    if mask_kind not in (0, 1, 2):
        raise ValueError(f"mask_kind must be 0, 1 or 2, got {mask_kind!r}")
    unknown = set(switches or {}) - set(DEBUG_SWITCHES)
    if unknown:
        raise ValueError(f"switches must be among {sorted(DEBUG_SWITCHES)}, got {sorted(unknown)}")
    flags = {**DEBUG_SWITCHES, **(switches or {})}
    defines = "".join(f"#define {k} {int(v)}\n" for k, v in flags.items())
    defines += (f"#define IS_CAUSAL {int(is_causal)}\n#define MASK_KIND {mask_kind}\n#define PARTIAL {int(partial)}\n"
               f"#define RESCALE_THRESHOLD {RESCALE_THRESHOLD}f\n")
    # The geometry the launcher sizes shared memory and the grid by, so the C text cannot drift from it.
    defines += "".join(f"#define {name} {value}\n" for name, value in (
        ("ROWS", ROWS), ("TILE_TOKENS", TILE_TOKENS), ("PANEL_BYTES", PANEL_BYTES), ("TILE_BYTES", TILE_BYTES),
        ("THREADS", THREADS), ("STAT_BYTES", STAT_BYTES)))
    body = PRELUDE + wgmma_function("wgmma_scores", 64, "d", 0) + wgmma_function("wgmma_values", 256, "d", 1) + _KERNEL
    return defines + body.replace("ELEM_PTX", elem)
