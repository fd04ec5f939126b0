/* The absorbed-MLA decode kernel (sm_90a): TMA copies of the latent tiles, warpgroup MMA; the schedule is
   described in decode/wgmma_decode_source.py, which prepends the specialisation's #defines (IS_BF16, IS_CAUSAL,
   MASK_KIND, PARTIAL, the DBG_* switches) and the geometry (ROWS, TILE_TOKENS, PANEL_BYTES, TILE_BYTES, THREADS,
   STAT_BYTES, RESCALE_THRESHOLD). */
#include "../../hopper/ptx.cuh"
#include "../../hopper/wgmma.cuh"
#include "../../hopper/latent_tile.cuh"

#define CHUNKS_PER_ROW 72          /* (512 + 64) channels x 2 bytes / 16 */
#define LATENT_CHUNKS 64
#define COPIER 128                 /* the thread issuing the TMA copies (first of warpgroup 1) */
#define BAR_P_READY 1              /* named barriers: P and the rescale factors of a tile are written ... */
#define BAR_P_FREE 2               /* ... and the value warps are done reading them */
#define VALUE_WARPS 8
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
      store_p_tile(s_p, p_pack, r_a, col2);
      if ((lane & 3) == 0) { s_alpha[r_a] = alpha[0]; s_alpha[r_a + 8] = alpha[1]; }
      fence_async_shared();
      bar_arrive(BAR_P_READY, THREADS);
    }
    store_row_stats(l_run, m_run, s_lsum, s_max, r_a, lane);
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
      rescale_rows(o, a0, a1);
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
    store_output_row(out, o_base, o, e, inv);
  }
}
