/* The DSA sparse-attention forward (sm_90a): gathered latent rows, warpgroup MMA; the schedule is described in
   sparse/wgmma_forward_source.py, which prepends the specialisation's #defines (IS_BF16, ROPE, PARTIAL) and the
   geometry (ROWS, TILE_TOKENS, PANEL_BYTES, P_BYTES, TILE_BYTES, THREADS, STAT_BYTES, P_BUFFER_BYTES, BAR_VALUES,
   GATHER_THREADS, RESCALE_THRESHOLD). */
#include "../../hopper/ptx.cuh"
#include "../../hopper/wgmma.cuh"
#include "../../hopper/latent_tile.cuh"
#define ROW_CHUNKS (64 + 8 * ROPE)   /* 16-byte chunks of a row: 512 (+ 64) channels */
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ void cp_async_arrive(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ int load_index(const int* row, long long sik, int pos, int hi) {
  return pos < hi ? __ldg(row + pos * sik) : -1;
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) dsa_sparse_wgmma(
    const u16* __restrict__ q, const u16* __restrict__ kv, const int* __restrict__ idx,
    void* __restrict__ out, float* __restrict__ lse,
    long long sqb, long long sqs, long long sqh, long long skb, long long skt, long long skh,
    long long sib, long long sis, long long sik,
    long long sob, long long sos, long long sosplit, long long soh,
    long long slb, long long sls, long long slsplit, long long slh,
    int S, int topk, int head_blocks, int blocks_per_kv_head, int per_split, float scale) {
  extern __shared__ unsigned char smem_raw[];
  const u32 raw = smem_addr(smem_raw);
  const u32 base = (raw + 1023u) & ~1023u;
  const u32 s_q = base, s_p = base + 3 * TILE_BYTES;  /* (without rope: the two P buffers) */
  float* stats = (float*)(smem_raw + (s_p + P_BUFFER_BYTES - raw));
  float* s_alpha = stats;            /* [2][64] rescale factors of the tile in each stage */
  float* s_max = stats + 2 * ROWS;   /* [64] final running max */
  float* s_lsum = stats + 3 * ROWS;  /* [64] final row sums */
  /* full[stage]: the stage's rows landed; p_full[stage]: P and the rescale factors of its tile are written */
  const u32 bar_full = s_p + P_BUFFER_BYTES + STAT_BYTES, bar_p_full = bar_full + 16;

  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int head_block = blockIdx.x % head_blocks, token = blockIdx.x / head_blocks;
  const long long b = token / S, s = token - b * S;
  const int split = blockIdx.y;
  const int h0 = head_block * ROWS, kvh = head_block / blocks_per_kv_head;
  const int lo = split * per_split, hi = imin(lo + per_split, topk);
  const int num_tiles = hi > lo ? (hi - lo + TILE_TOKENS - 1) / TILE_TOKENS : 0;
  const int* idx_row = idx + b * sib + s * sis;
  const u16* kv_base = kv + b * skb + kvh * skh;

  if (tid == 0) {
    mbar_init(bar_full, GATHER_THREADS); mbar_init(bar_full + 8, GATHER_THREADS);
    mbar_init(bar_p_full, 128); mbar_init(bar_p_full + 8, 128);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  /* The query block (every thread, cp.async, its own group). */
  const u16* q_base = q + b * sqb + s * sqs + (long long)h0 * sqh;
  for (int i = tid; i < ROWS * ROW_CHUNKS; i += THREADS) {
    const int r = i / ROW_CHUNKS, c = i - r * ROW_CHUNKS;
    cp_async16(s_q + tile_offset(r, c), q_base + r * sqh + c * 8, 16);
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
  __syncthreads();  /* the barriers are initialised */

  /* Gather roles (value warpgroups): warp w of half `half` copies rows 16 w .. 16 w + 15: latent chunks
     32 half + lane (one 512-byte run of a row per instruction) and rope chunks 64 + 4 half + (lane & 3) of rows
     16 w + 8 j + (lane >> 2), j = 0, 1. Lane l loads the index of row 16 w + (l & 15); shuffles share it. */
  const int half = wg - 1, gather_warp = warp;
  /* P of the tile in a stage: with rope, that stage's rope panel (free once the tile's scores are computed, and
     refilled only after both value warpgroups' products of the tile); without, a buffer of its own */
  auto p_buffer = [&](int stage) {
    return ROPE ? base + TILE_BYTES * (1 + stage) + 8 * PANEL_BYTES : s_p + stage * P_BYTES;
  };
  auto tile_index = [&](int tile) {
    return load_index(idx_row, sik, lo + tile * TILE_TOKENS + 16 * gather_warp + (lane & 15), hi);
  };
  auto gather = [&](int stage, int ix) {
    const u32 dst = base + TILE_BYTES * (1 + stage);
    const int c = 32 * half + lane;
    const u16* kv_lane = kv_base + c * 8;
    asm volatile("" : "+l"(kv_lane));  /* kept as one value: otherwise ptxas spills a word on some forms */
    #pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int row = __shfl_sync(FULL_MASK, ix, j);
      const int r = 16 * gather_warp + j;
      cp_async16(dst + tile_offset(r, c), row >= 0 ? (const void*)(kv_lane + row * skt) : (const void*)kv,
                 row >= 0 ? 16 : 0);
    }
#if ROPE
    #pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int row = __shfl_sync(FULL_MASK, ix, 8 * j + (lane >> 2));
      const int r = 16 * gather_warp + 8 * j + (lane >> 2), cr = 64 + 4 * half + (lane & 3);
      const void* from = row >= 0 ? (const void*)(kv_lane + row * skt + (cr - c) * 8) : (const void*)kv;
      cp_async16(dst + tile_offset(r, cr), from, row >= 0 ? 16 : 0);
    }
#endif
    cp_async_arrive(bar_full + 8 * stage);
  };
  int ix = -1;
  if (wg > 0) {
    for (int st = 0; st < 2 && st < num_tiles; ++st) gather(st, tile_index(st));
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");  /* this thread's query chunks (the gathers: no group) */
  fence_async_shared();
  __syncthreads();  /* the query block landed */

  const int r_a = warp * 16 + (lane >> 2);
  const int col2 = 2 * (lane & 3);
  float o[128];
  float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};

  if (wg == 0) {
    /* the indices at positions lane and 32 + lane of the next tile, loaded an iteration ahead */
    int next_lo = load_index(idx_row, sik, lo + lane, hi), next_hi = load_index(idx_row, sik, lo + 32 + lane, hi);
    for (int it = 0; it < num_tiles; ++it) {
      const u32 s_kv = base + TILE_BYTES * (1 + (it & 1));
      /* which of the tile's 64 positions hold a valid index: bit c of valid_lo (c < 32) or valid_hi */
      const u32 valid_lo = __ballot_sync(FULL_MASK, next_lo >= 0), valid_hi = __ballot_sync(FULL_MASK, next_hi >= 0);
      const int t1 = lo + (it + 1) * TILE_TOKENS;
      next_lo = load_index(idx_row, sik, t1 + lane, hi);
      next_hi = load_index(idx_row, sik, t1 + 32 + lane, hi);
      mbar_wait(bar_full + 8 * (it & 1), (it >> 1) & 1);
      fence_async_shared();  /* the gathered rows (generic-proxy writes) before the wgmma reads them */
      float sc[32];
      wgmma_fence();
      #pragma unroll
      for (int kk = 0; kk < 4 * ROW_CHUNKS / 8; ++kk) {
        const u32 off = (kk >> 2) * PANEL_BYTES + (kk & 3) * 32;
        wgmma_scores(sc, smem_desc(s_q + off, 16, 1024), smem_desc(s_kv + off, 16, 1024), kk > 0);
      }
      wgmma_commit();
      wgmma_wait_all();
      float tile_max[2] = {NEG_INF, NEG_INF};
      #pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int e = (i >> 1) & 1;
        const int col = 8 * (i >> 2) + col2 + (i & 1);
        const bool keep = ((col < 32 ? valid_lo >> col : valid_hi >> (col - 32)) & 1u) != 0u;
        sc[i] = keep ? sc[i] * scale : NEG_INF;
        tile_max[e] = fmaxf(tile_max[e], sc[i]);
      }
      float alpha[2];
      u32 p_pack[16];
      online_softmax_tile(sc, tile_max, m_run, l_run, alpha, p_pack);  /* base 2: TO_LOG2 is 1 here */
      /* P of tile it - 2, in the same buffer, was read: tile it's rows came after that tile's value products */
      const u32 p_buf = p_buffer(it & 1);
      store_p_tile(p_buf, p_pack, r_a, col2);
      if ((lane & 3) == 0) { s_alpha[(it & 1) * ROWS + r_a] = alpha[0]; s_alpha[(it & 1) * ROWS + r_a + 8] = alpha[1]; }
      fence_async_shared();
      mbar_arrive(bar_p_full + 8 * (it & 1));
    }
    store_row_stats(l_run, m_run, s_lsum, s_max, r_a, lane);
  } else {
    #pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    const u32 v_cols = half * 4 * PANEL_BYTES;
    for (int it = 0; it < num_tiles; ++it) {
      const int stage = it & 1;
      const u32 s_kv = base + TILE_BYTES * (1 + stage);
      const bool refill = it + 2 < num_tiles;
      if (refill) ix = tile_index(it + 2);  /* in flight while this tile is computed */
      mbar_wait(bar_p_full + 8 * stage, (it >> 1) & 1);  /* P and the rescale factors of tile it are written */
      mbar_wait(bar_full + 8 * stage, (it >> 1) & 1);
      fence_async_shared();
      const float a0 = s_alpha[stage * ROWS + r_a], a1 = s_alpha[stage * ROWS + r_a + 8];
      rescale_rows(o, a0, a1);
      wgmma_fence();
      #pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        wgmma_values(o, smem_desc(p_buffer(stage) + kk * 32, 16, 1024),
                     smem_desc(s_kv + v_cols + kk * 2048, PANEL_BYTES, 1024), 1);
      }
      wgmma_commit();
      wgmma_wait_all();
      if (refill) {  /* the stage is free for tile it + 2 once both value warpgroups are done with it (and P) */
        bar_sync(BAR_VALUES, GATHER_THREADS);
        gather(stage, ix);
      }
    }
  }
  __syncthreads();  /* the row statistics are in shared memory */

  #pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = r_a + 8 * e;
    const long long h = h0 + r;
    const float l = s_lsum[r];
    if (wg == 0) {
      if ((lane & 3) == 0) {
        const float m = s_max[r];
        lse[b * slb + s * sls + split * slsplit + h * slh] =
            l > 0.f ? ((m == NEG_INF ? 0.f : m) + fast_log2(l)) * LN2 : NEG_INF;
      }
      continue;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const long long o_base = b * sob + s * sos + split * sosplit + h * soh + half * 256 + col2;
    store_output_row(out, o_base, o, e, inv);
  }
}
