"""CUDA C++ source of the Hopper (sm_90a) DSA indexer score kernel for a few queries (decode, short chunks).

Source text only (compiled at run time by NVRTC, see ``kda_compile.ops._nvrtc``); the launcher is
``wgmma_indexer.py``. It writes the same int32 score codes as the Triton kernels of ``triton_indexer.py``
(``triton_topk.score_codes``: order-preserving codes of the float32 score, ``INT32_MIN`` for a key the query may
not see), for one query's H_I <= 64 indexer heads of 128 channels against a stream of cached keys:

    score[s] = sum_h w[h] * relu(scale * q[h] . k[s])

Decode reads every cached key once per query, so the kernel is a key stream: the design keeps many bytes in
flight and does little per byte.

- A program (one warpgroup, 128 threads) owns one query of one batch row and a contiguous run of 64-key tiles.
  Its query's heads [64, 128] are the MMA's A operand in registers (32 per thread, loaded once; heads past H_I
  are zeros) and their weights too (zero past H_I, so padded heads add nothing).
- Keys arrive by TMA (a [B, T, 128] tensor map, boxes of 64 channels x 64 keys, 128-byte swizzle, zeros past T)
  into a ring of ``STAGES`` stages of [64 keys x 128 channels], one "full" mbarrier each; thread 0 refills a stage
  once every warp has passed the tile's reduction barrier (by then their MMAs on it completed). Four programs
  share an SM (``programs_per_sm``), so up to 12 tiles (192 KB) are in flight per SM.
- Per tile: S = Q K^T ([64 heads x 64 keys], k = 128: eight wgmma m64n64k16, B from shared memory), then each
  thread folds its two heads, ``w * max(scale * s, 0)``, reduces its 16 columns over the eight lanes that hold
  the same columns (a reduce-scatter: 14 shuffles, each lane ends with two whole columns), and the four warps'
  sums meet in shared memory (double-buffered, one barrier per tile); 64 threads add them and store the tile's 64
  codes.
- Tiles of the program's run that lie wholly outside the query's visible range ``[lo, hi)`` are not loaded:
  their codes are written hidden. With a null ``Lo`` the ranges of a call without packed sequences are computed
  in the kernel (``query_count``, ``key_count``, ``causal``), so decode launches no range kernels.

H200, CUDA-graph replay, 64 heads x 128, bf16: batch 64 x 32k keys (537 MB) 149 us, 3.6 TB/s, against 160 us for
the Triton heads-as-rows kernel and 140 us for torch's row sum over as many bytes (the read bandwidth this GPU
reaches); 16 queries x 4-token chunks x 16k keys 47 against 83 us (docs/dsa.md section 4).

Compile-time switches (``#define``): ``ELEM`` (bf16 / f16), ``STAGES``, ``HAS_KEY_MASK``, ``WEIGHT_KIND`` (the
weights are read in their own dtype: float32, bfloat16 or float16).
"""
from __future__ import annotations

from kda_compile.ops.mla.wgmma_source import PRELUDE

HEADS = 64  # indexer heads per program = the wgmma M (fewer are zero-padded)
DIM = 128  # indexer head dim the kernel is written for (two 64-channel panels)
TILE_KEYS = 64  # keys per tile = the wgmma N
THREADS = 128
PANEL_BYTES = 64 * 128  # 64 rows of 128 bytes (64 half-precision channels)
TILE_BYTES = 2 * PANEL_BYTES
STAGES = 3  # with four programs per SM (H200, batch 64 x 32k keys: 149 us; 2 stages x 5 programs 153, 4 x 3 154)
REDUCE_BYTES = 2 * 4 * TILE_KEYS * 4  # [2 buffers][4 warps][64 columns] float32
KERNEL_NAME = "dsa_indexer_wgmma"


SM_SHARED_BYTES = 228 * 1024  # shared memory of an H100 / H200 SM (each resident program also reserves 1 KB)
MAX_PROGRAMS_PER_SM = 5  # 65536 registers / (5 x 128 threads): 102 registers a thread (six would spill)


def programs_per_sm(stages: int = STAGES) -> int:
    """Programs an SM holds at once, by their shared memory (the kernel's launch bounds ask the compiler to fit
    their registers too)."""
    return max(1, min(MAX_PROGRAMS_PER_SM, SM_SHARED_BYTES // (shared_bytes(stages) + 1024)))


def shared_bytes(stages: int = STAGES) -> int:
    """Dynamic shared memory: the key stages, the reduction buffers, the mbarriers and 1 KB to align to 1024."""
    return TILE_BYTES * stages + REDUCE_BYTES + 8 * stages + 1024


_KERNEL = r"""
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
"""


def _wgmma_register_a() -> str:
    """``wgmma_scores``: one ``wgmma.mma_async m64n64k16`` with A (the query heads) in registers, B in shared
    memory (K-major, 128-byte swizzle)."""
    outs = ", ".join(f'"+f"(acc[{i}])' for i in range(32))
    regs = ", ".join(f"%{i}" for i in range(32))
    return f"""
__device__ __forceinline__ void wgmma_scores(float* acc, const u32* a, u64 desc_b, int accumulate) {{
  asm volatile(
    "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %37, 0;\\n"
    "wgmma.mma_async.sync.aligned.m64n64k16.f32.ELEM_PTX.ELEM_PTX "
    "{{{regs}}}, {{%32, %33, %34, %35}}, %36, p, 1, 1, 0;\\n}}\\n"
    : {outs}
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}}
"""


WEIGHT_KINDS = ("f32", "bf16", "f16")


def kernel_source(*, elem: str, has_key_mask: bool, weight: str = "f32", stages: int = STAGES) -> str:
    """The kernel's CUDA source for one specialisation (``elem``: "bf16" or "f16"; ``weight``: the weights' dtype,
    one of ``WEIGHT_KINDS``)."""
    if elem not in ("bf16", "f16"):
        raise ValueError(f"elem must be 'bf16' or 'f16', got {elem!r}")
    if weight not in WEIGHT_KINDS:
        raise ValueError(f"weight must be one of {WEIGHT_KINDS}, got {weight!r}")
    if not 2 <= stages <= 8:
        raise ValueError(f"stages must be 2 to 8, got {stages!r}")
    defines = "".join(f"#define {name} {value}\n" for name, value in (
        ("HAS_KEY_MASK", int(bool(has_key_mask))), ("WEIGHT_KIND", WEIGHT_KINDS.index(weight)), ("STAGES", stages),
        ("PROGRAMS_PER_SM", programs_per_sm(stages)), ("HEADS", HEADS), ("DIM", DIM), ("TILE_KEYS", TILE_KEYS),
        ("THREADS", THREADS), ("PANEL_BYTES", PANEL_BYTES), ("TILE_BYTES", TILE_BYTES), ("REDUCE_BYTES", REDUCE_BYTES),
        ("RESCALE_THRESHOLD", "8.0f")))  # (the prelude's softmax step: unused here)
    body = PRELUDE + _wgmma_register_a() + _KERNEL
    return defines + body.replace("ELEM_PTX", elem)
