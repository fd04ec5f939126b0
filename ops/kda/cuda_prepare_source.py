"""CUDA source of the KDA / GDN prepare kernel for bf16 and K = V = 128 (compiled with NVRTC).

The same contract as ``triton_chunk_prepare.py`` (read its docstring for the math and the numerics), with the
gate's form a parameter of the generator (``scalar_gate``): pass 1 is ``cuda_prepare_channel.py`` for KDA's
per-channel gate, ``cuda_prepare_scalar.py`` for GDN's one gate per (token, value head); the prologue (below),
the device helpers (``cuda_prepare_device.py``) and the inverse with pass 2 (``cuda_prepare_solve.py``) are
shared. Both take bf16 q / k / v with K = V = 128. The KDA form takes the in-kernel gates: the lower-bound gate
(with ``lower_bound >= -MAX_BOUNDED_DECAY`` every 16-token block's decay range is within ``DIAG_RANGE_LIMIT``, the
configuration the prefill benchmark anchors on) and, as ``wide_blocks``, any lower bound and the softplus gate,
with no exact-diagonal pass and a cost that does not depend on the data; the GDN form takes every gate (the
finished log decay, or the in-kernel softplus gate with ``has_a_log``), exactly. Written in CUDA because the layout
it needs is one Triton does not give: each warp owns one 16-token block of the chunk in the register layout of a
``mma.m16n8k16`` operand, so

- the loaded q / k / gate elements are the tensor-core A operands as they stand (no layout conversion
  through shared memory per K slice, which was most of the Triton kernel's instructions); the A products
  take fp32 operands rounded to TF32 on TF32 tensor cores, as the Triton kernel's (bf16 operands doubled the
  error of ``A_qk`` against float64: 2.9e-3 against 1.8e-3, H100; truncated TF32 operands, what the hardware
  does to fp32 bits, left nearly collinear keys a final state 1.24x FLA's error);
- the block-local cumsum is three lane shuffles per element; only the four block sums cross warps
  (one barrier per K slice, double-buffered);
- warp r multiplies only the key blocks s <= r (the products above the block diagonal are zero);
- ``x = beta 2^G k`` stays in shared memory for the second pass (no global round trip), v arrives
  by ``cp.async`` during the first pass;
- the triangular inverse: 16 x 16 diagonal blocks by substitution in fp32 (one per warp), the off-diagonal blocks by
  doubling on 3xTF32 tensor-core products (about fp32 accuracy, as the Triton kernel's ``tf32x3`` solve; three
  rounds of at most two 16 x 16 products per warp: ``solve_offdiag`` in ``cuda_prepare_device.py``).

One CTA of 4 warps owns one 64-token chunk of one value head (grid ``(chunk slots, HV)``), 73 KiB: 3 CTAs per SM.

The KDA form's decay exponents are formed as the Triton kernel's are, each summed over its own span across
blocks (block sums, never a difference of prefix sums; docstring of ``triton_chunk_prepare.py``); inside a block
the tails ``G_end - G`` are differences of the block-local cumsum, exact to fp32 rounding of the block's range
(with the softplus gate a block of floored steps spans up to 2400 log2 units: 2^-12 there, still far below the
bf16 rounding of the outputs).

Outputs, all in the Triton kernel's layouts: ``w, qg, kd`` ``[TT, HV, 128]``, ``u`` ``[TT, HV, 128]``,
``A_qk`` ``[TT, HV, 64]`` (bf16), ``decay`` ``[slots, HV, 128]`` fp32, and with ``SAVE_AKK`` the inverse
``T`` ``[TT, HV, 64]`` (bf16) for FLA's backward.
"""
from __future__ import annotations

from kda_compile.ops.kda import cuda_prepare_channel, cuda_prepare_scalar
from kda_compile.ops.kda.chunks import CHUNK, CUDA_CHUNK_COUNT
from kda_compile.ops.kda.cuda_prepare_device import HELPERS
from kda_compile.ops.kda.cuda_prepare_solve import SOLVE_AND_PASS2

KERNEL_NAME = "kda_prepare_mma"
THREADS = 128
HEAD_DIM = 128

# Shared memory (bytes): x and v tiles (bf16 [64, 128], 16-byte chunks XOR-swizzled by row), beta, then one
# region that pass 1 uses for the key tiles and block sums and the solve reuses for T, L and a scratch tile.
TILE_BYTES = CHUNK * HEAD_DIM * 2
LD = 72  # fp32 row stride of the solve's [64, 64] matrices (bank spread for fragment access)
KEYS_BYTES = 2 * 4 * 32 * 8 * 4  # [parity][warp][lane][8] fp32
SUMS_BYTES = 2 * 4 * 16 * 4  # [parity][block][16 channels] fp32
# With wide blocks, the diagonal block's product takes steps clamped at -STEP_CLAMP (log2 units): a pair across a
# clamped step decays by less than 2^-24 of its product either way (fp32 rounding of an O(1) entry), and 8 clamped
# steps span at most 192, so a factor anchored at the middle of 8 rows stays within 2^+-96.
STEP_CLAMP = 24.0
# With at most INLINE_SEQS packed sequences the prepare (its ``inline_offsets`` form) and the scan find their chunks
# from cu_seqlens alone: no chunk plan is launched or computed before them. A compile-time form of the prepare: the
# kernel with both lookups spilled 8 bytes (wide blocks).
INLINE_SEQS = 128
NSTAGE = 4  # q / k / gate slices in flight (cp.async): [64][16] tiles of q, k (bf16) and the gate (bf16 / fp32)


def stage_bytes(g_bytes: int) -> int:
    return 2 * CHUNK * 16 * 2 + CHUNK * 16 * g_bytes

SOLVE_BYTES = 2 * CHUNK * LD * 4 + 4 * 16 * 20 * 4  # T, L, per-warp Z [16][20]
XS_OFF, VS_OFF, BETA_OFF = 0, TILE_BYTES, 2 * TILE_BYTES
UNION_OFF = BETA_OFF + CHUNK * 4
STAGE_OFF = UNION_OFF + KEYS_BYTES + SUMS_BYTES
SHARED_BYTES = UNION_OFF + max(KEYS_BYTES + SUMS_BYTES + NSTAGE * stage_bytes(4), SOLVE_BYTES)

_DTYPES = {"bf16": "bf16", "f32": "float"}

# The kernel's signature, the chunk's place and pointers, the v tile's copies: what every gate form needs before
# its pass 1 (then the per-channel form's slice copies, then ``_PROLOGUE_TAIL``).
_PROLOGUE = r"""extern "C" __global__ void __launch_bounds__(128, 3) kda_prepare_mma(
    const bf16* __restrict__ Q, const bf16* __restrict__ Kin, const bf16* __restrict__ Vin,
    const G_T* __restrict__ Gin, const BETA_T* __restrict__ Beta, const float* __restrict__ Alog,
    const float* __restrict__ DtBias, bf16* __restrict__ W, bf16* __restrict__ U, bf16* __restrict__ QG,
    bf16* __restrict__ KDo, bf16* __restrict__ AQK, float* __restrict__ DECAY, bf16* __restrict__ AKK,
    const CU_T* __restrict__ cu_seqlens, const int* __restrict__ chunk_offsets,
    int T, int N, int H, int HV, float scale, float beta_scale, float lower_bound)
{
    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, wp = (tid >> 5) & 3, gid = lane >> 2, tig = lane & 3;
    // (& 3: the compiler learns wp < 4; measured 4-6% faster and no spills in the wide-block forms, H200)
    const int slot = blockIdx.x, hv = blockIdx.y, h = hv / (HV / H);
    long long bos;
    int seq_len, chunk;
#if IS_VARLEN
    {
        int lo = N, first = 0;  // the sequence holding this chunk slot (N: past the last sequence), its first slot
#if INLINE_OFFSETS
        // No chunk plan (at most INLINE_SEQS sequences): lane i loads the offsets of sequences i, i + 32, ...; a warp
        // scan of their chunk counts gives each sequence's first slot, a ballot the sequence holding this slot, and
        // its lane passes its offsets on (one round of loads up to 32 sequences).
        int carry = 0;
        for (int base = 0; base < N; base += 32) {
            int b0 = 0, b1 = 0, count = 0;  // (offsets fit an int: the kernel's T is one)
            if (base + lane < N) {
                b0 = (int)cu_seqlens[base + lane];
                b1 = (int)cu_seqlens[base + lane + 1];
                count = chunk_count(b1 - b0);
            }
            int x = count;
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const int y = __shfl_up_sync(FULL, x, off);
                if (lane >= off) x += y;
            }
            const int begin = carry + x - count;
            const unsigned holds = __ballot_sync(FULL, slot >= begin && slot < begin + count);
            if (holds) {
                const int src = __ffs(holds) - 1;
                lo = base + src;
                first = __shfl_sync(FULL, begin, src);
                const int b = __shfl_sync(FULL, b0, src);
                bos = b;
                seq_len = __shfl_sync(FULL, b1, src) - b;
                break;
            }
            carry += __shfl_sync(FULL, x, 31);
        }
        if (lo >= N) return;
#else
        {
            // the last n <= N with chunk_offsets[n] <= slot. Each warp searches 32-ary, one probe a lane (the probes
            // that hold form a prefix of the lanes: the offsets do not decrease), so N <= 32 takes one round of
            // loads and N <= 1024 two, not log2(N + 1).
            int hi = N;
            lo = 0;
            while (lo < hi) {
                const int step = (hi - lo + 31) >> 5, probe = lo + (lane + 1) * step;
                const bool holds = probe <= hi && chunk_offsets[probe] <= slot;
                lo += __popc(__ballot_sync(FULL, holds)) * step;
                hi = min(hi, lo + step - 1);
            }
            if (lo < N) first = chunk_offsets[lo];
        }
        if (lo >= N) return;
        bos = (long long)cu_seqlens[lo];
        seq_len = (int)((long long)cu_seqlens[lo + 1] - bos);
#endif
        chunk = slot - first;
    }
#else
    {
        const int nch = (T + 63) / 64;
        bos = (long long)(slot / nch) * T;
        seq_len = T;
        chunk = slot % nch;
    }
#endif
    const int start = chunk * 64;
    const int nvalid = min(64, seq_len - start);
    const long long t0 = bos + start;
    const long long qs_row = (long long)H * KD, vs_row = (long long)HV * KD, a_row = (long long)HV * 64;
    const bf16* q = Q + (t0 * H + h) * KD;
    const bf16* k = Kin + (t0 * H + h) * KD;
    const bf16* v = Vin + (t0 * HV + hv) * KD;
    const G_T* g = Gin + (t0 * HV + hv) * KD;
    const long long o_off = (t0 * HV + hv) * KD;
    unsigned char* xs = smem + XS_OFF;
    unsigned char* vsm = smem + VS_OFF;
    float* betas = reinterpret_cast<float*>(smem + BETA_OFF);
    float* keys = reinterpret_cast<float*>(smem + UNION_OFF);             // [2][4][32][8]
    float* sums = reinterpret_cast<float*>(smem + UNION_OFF + KEYS_BYTES); // [2][4][16]

    // ---- v tile by cp.async (zeros past the sequence), beta ---------------------------------------
    for (int i = tid; i < 64 * 16; i += 128) {
        const int row = i >> 4, ch = i & 15;
        const bool ok = row < nvalid;
        const bf16* src = v + (ok ? row * vs_row + ch * 8 : 0);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                     :: "r"(smem_addr(vsm) + swz(row, ch)), "l"(src), "r"(ok ? 16 : 0));
    }
    asm volatile("cp.async.commit_group;");
"""

# Beta, the rows' L2-norm factors, the gate's slope.
_PROLOGUE_TAIL = r"""    if (tid < 64) {
        float b = 0.f;
        if (tid < nvalid) {
            b = to_f(Beta[(t0 + tid) * HV + hv]);
#if BETA_SIGMOID
            b = beta_scale / (1.f + __expf(-b));
#endif
        }
        betas[tid] = b;
    }

    // ---- per-row scales: L2 norms over all 128 channels ---------------------------------------------
    const int row0 = 16 * wp + gid;  // this lane's rows: row0 and row0 + 8
    const bool ok0 = row0 < nvalid, ok1 = row0 + 8 < nvalid;
    float qsc[2] = {scale, scale}, ksc[2] = {1.f, 1.f};
#if L2NORM
    {
        float sq[2] = {0.f, 0.f}, sk[2] = {0.f, 0.f};
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            if (hh ? ok1 : ok0) {
                const int row = row0 + 8 * hh;
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const uint4 a = *reinterpret_cast<const uint4*>(q + row * qs_row + (tig + 4 * c) * 8);
                    const uint4 b = *reinterpret_cast<const uint4*>(k + row * qs_row + (tig + 4 * c) * 8);
                    const u32 av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        sq[hh] += lo_bf(av[e]) * lo_bf(av[e]) + hi_bf(av[e]) * hi_bf(av[e]);
                        sk[hh] += lo_bf(bv[e]) * lo_bf(bv[e]) + hi_bf(bv[e]) * hi_bf(bv[e]);
                    }
                }
            }
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            sq[hh] += __shfl_xor_sync(FULL, sq[hh], 1);
            sq[hh] += __shfl_xor_sync(FULL, sq[hh], 2);
            sk[hh] += __shfl_xor_sync(FULL, sk[hh], 1);
            sk[hh] += __shfl_xor_sync(FULL, sk[hh], 2);
            qsc[hh] = scale / sqrtf(sq[hh] + L2NORM_EPS);
            ksc[hh] = 1.f / sqrtf(sk[hh] + L2NORM_EPS);
        }
    }
#endif
    float slope = -LOG2E;
#if HAS_A_LOG
    slope = -ex2(Alog[hv] * LOG2E) * LOG2E;
#endif
    const float lb2 = lower_bound * LOG2E;
    __syncthreads();  // betas
    const float beta_r[2] = {betas[row0], betas[row0 + 8]};

"""

def kernel_source(*, g_dtype: str, beta_dtype: str, cu_dtype: str, varlen: bool, l2norm: bool, has_a_log: bool,
                  has_dt_bias: bool, beta_sigmoid: bool, save_akk: bool, scalar_gate: bool = False,
                  row_factors: bool = False, softplus_gate: bool = False, wide_blocks: bool = False,
                  inline_offsets: bool = False) -> str:
    """The kernel's CUDA text for one specialisation (``g_dtype`` / ``beta_dtype``: "bf16" or "f32";
    ``cu_dtype``: "int" or "long long", the cu_seqlens element type). ``scalar_gate``: one gate per (token, value
    head), ``g`` ``[TT, HV]`` and ``dt_bias`` ``[HV]`` (GDN); ``has_a_log`` then selects the in-kernel softplus
    gate (GDN's requires ``A_log``), else ``g`` is the finished log decay. Without it (KDA) the gate is
    ``[TT, HV, K]`` and in-kernel: the lower-bound form, or with ``softplus_gate`` the softplus form. ``wide_blocks``
    (per-channel gate only): a 16-token block may decay by more than ``DIAG_RANGE_LIMIT`` (the softplus gate, a lower
    bound below ``-MAX_BOUNDED_DECAY``), so its product with itself is formed on clamped steps with two anchors
    (``cuda_prepare_channel.py``). ``row_factors`` (scalar gate only): write the rows' q / k factors
    ``[slots, HV, 2, 64]`` fp32 through the ``QG`` pointer instead of the ``qg`` / ``kd`` tiles, for the CUDA scan's
    ``row_factors`` form. ``inline_offsets`` (with ``varlen``, at most ``INLINE_SEQS`` sequences): the chunk slots
    are found from ``cu_seqlens`` alone, ``chunk_offsets`` is not read."""
    if inline_offsets and not varlen:
        raise ValueError("inline_offsets needs varlen (packed sequences)")
    if row_factors and not scalar_gate:
        raise ValueError("row_factors needs scalar_gate (one gate per token and value head)")
    if scalar_gate and (softplus_gate or wide_blocks):
        raise ValueError("softplus_gate and wide_blocks are forms of the per-channel gate; the scalar gate takes every "
                         f"gate as it is, got softplus_gate={softplus_gate}, wide_blocks={wide_blocks}")
    if softplus_gate and not wide_blocks:
        raise ValueError("softplus_gate needs wide_blocks: the softplus gate does not bound a block's decay")
    for name, value in (("g_dtype", g_dtype), ("beta_dtype", beta_dtype)):
        if value not in _DTYPES:
            raise ValueError(f"{name} must be one of {sorted(_DTYPES)}, got {value!r}")
    if cu_dtype not in ("int", "long long"):
        raise ValueError(f"cu_dtype must be 'int' or 'long long', got {cu_dtype!r}")
    defines = {
        "G_T": _DTYPES[g_dtype], "BETA_T": _DTYPES[beta_dtype], "CU_T": cu_dtype,
        "IS_VARLEN": int(varlen), "L2NORM": int(l2norm), "HAS_A_LOG": int(has_a_log),
        "HAS_DT_BIAS": int(has_dt_bias), "BETA_SIGMOID": int(beta_sigmoid), "SAVE_AKK": int(save_akk),
        "ROW_FACTORS": int(row_factors), "GATE_SOFTPLUS": int(softplus_gate), "WIDE_BLOCKS": int(wide_blocks),
        "KEY_ANCHOR": "1.0f" if wide_blocks else "0.5f", "STEP_CLAMP": f"{STEP_CLAMP:.1f}f",
        "LD": LD, "KEYS_BYTES": KEYS_BYTES, "XS_OFF": XS_OFF, "VS_OFF": VS_OFF, "BETA_OFF": BETA_OFF,
        "UNION_OFF": UNION_OFF, "INLINE_SEQS": INLINE_SEQS, "INLINE_OFFSETS": int(inline_offsets),
        "STAGE_OFF": STAGE_OFF, "NSTAGE": NSTAGE, "G_BYTES": 2 if g_dtype == "bf16" else 4,
        "STAGE_BYTES": stage_bytes(2 if g_dtype == "bf16" else 4),
    }
    head = "".join(f"#define {key} {value}\n" for key, value in defines.items())
    if scalar_gate:
        body = _PROLOGUE + _PROLOGUE_TAIL + cuda_prepare_scalar.PASS1
    else:
        body = _PROLOGUE + cuda_prepare_channel.ISSUE_SLICES + _PROLOGUE_TAIL + cuda_prepare_channel.PASS1
    return head + CUDA_CHUNK_COUNT + HELPERS + body + SOLVE_AND_PASS2
