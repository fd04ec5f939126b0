/* The latent-attention tile of the MLA decode and DSA sparse-attention kernels: the byte offsets of the
   128-byte-swizzled [64 x D] blocks (PANEL_BYTES per 64-channel panel) and one tile's online-softmax step.
   Needs PANEL_BYTES, RESCALE_THRESHOLD (log2 units), PARTIAL (float32 partial outputs) and MASK_KIND (2: additive float mask; undefined or other: none
   or a keep-mask); DBG_NO_SOFTMAX (timing experiments only) drops the exponentials. */

/* Score units: base 2 (the scale carries log2(e)), or natural with an additive mask, whose huge finite
   values (finfo.min) must not overflow to -inf when multiplied by log2(e). */
#if MASK_KIND == 2
#define TO_LOG2 LOG2E
#define TO_NATURAL 1.0f
#else
#define TO_LOG2 1.0f
#define TO_NATURAL LN2
#endif
/* The byte offset of 16-byte chunk c (0..71) of row r (0..63) in a [64 x 576] swizzled block. */
__device__ __forceinline__ u32 tile_offset(int r, int c) {
  return (u32)((c >> 3) * PANEL_BYTES + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}
/* One tile's online-softmax step over a thread's 32 scores of the wgmma m64n64 accumulator (rows r and r + 8;
   masked entries -inf; units that TO_LOG2 turns into base 2) and its rows' maxima over them: the maxima across
   the quad, a lazy rescale (alpha = 1 unless a row's tile max exceeds its running max by RESCALE_THRESHOLD), the
   running sums, and P as packed pairs of the 16-bit element type. */
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
/* A score warpgroup's row statistics once its tiles are done: the running sums added across the quad, then the
   sums and maxima of rows r_a and r_a + 8 into shared memory (lane 0 of the quad). */
__device__ __forceinline__ void store_row_stats(float* l_run, const float* m_run, float* s_lsum, float* s_max,
                                                int r_a, int lane) {
  #pragma unroll
  for (int e = 0; e < 2; ++e) {
    l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 1);
    l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 2);
  }
  if ((lane & 3) == 0) {
    s_lsum[r_a] = l_run[0]; s_lsum[r_a + 8] = l_run[1];
    s_max[r_a] = m_run[0]; s_max[r_a + 8] = m_run[1];
  }
}
/* A value warpgroup's [64 x 256] accumulator rescaled by its rows' factors (a0: row r_a, a1: row r_a + 8). */
__device__ __forceinline__ void rescale_rows(float* o, float a0, float a1) {
  if (a0 != 1.f || a1 != 1.f) {
    #pragma unroll
    for (int i = 0; i < 128; ++i) o[i] *= (i & 2) ? a1 : a0;
  }
}
/* Row e (0: r_a, 1: r_a + 8) of a value warpgroup's accumulator times inv (1 / the row's sum) at o_base: float32
   pairs with PARTIAL, else pairs of the 16-bit element type. */
__device__ __forceinline__ void store_output_row(void* out, long long o_base, const float* o, int e, float inv) {
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
/* A score warpgroup's P (online_softmax_tile's packed pairs, rows r_a and r_a + 8, columns from col2) into the
   [64 x 64] 128-byte-swizzled buffer at p_buf, the A operand of the value product. */
__device__ __forceinline__ void store_p_tile(u32 p_buf, const u32* p_pack, int r_a, int col2) {
  #pragma unroll
  for (int j = 0; j < 8; ++j) {
    #pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = r_a + 8 * e;
      st_shared_b32(p_buf + r * 128 + ((j ^ (r & 7)) << 4) + 2 * col2, p_pack[2 * j + e]);
    }
  }
}
