"""CUDA source of the KDA prefill's recurrence for bf16 and K = V = 128 (compiled with NVRTC).

The same contract as the plain (one-segment) ``kda_chunk_scan_kernel`` of ``triton_chunk_scan.py`` (read its
docstring for the math): per 64-token chunk, with the fp32 state ``S [128, 64]`` (one 64-column value block)::

    v_new = u - w S
    o     = qg S + A_qk v_new
    S     = diag(decay) S + kd^T v_new

with the products on bf16 operands (``S`` and ``v_new`` rounded to bf16, as the Triton kernel and FLA do) and
fp32 accumulation. Written in CUDA because one step of this loop is a chain of four small products whose
latency, not bandwidth, bounds a long sequence with few heads: the Triton kernel spends 3.4-3.9 us a chunk
there (1 x 32768 x 32, H100) in layout conversions through shared memory and a full wait after each
``wgmma``; this kernel takes 2.4 us. Its warps keep every operand in the ``mma.m16n8k16`` register layout:

- phase 1, warp w owns tokens ``[16 tb, 16 tb + 16)`` (``tb = w % 4``) and a column range of the value block (all
  64 with 4 warps, half with 8): ``v_new`` and ``qg S`` from the bf16 state in shared memory (``ldmatrix.trans``
  B fragments shared by both products); ``v_new`` goes to shared memory as bf16;
- phase 2, warp w owns state rows ``[128 w / WARPS, 128 (w + 1) / WARPS)`` in fp32 registers:
  ``S = decay S + kd^T v_new`` (``kd^T`` fragments by ``ldmatrix.trans`` of the token-major ``kd`` tile), then
  writes its rows of the bf16 state; and finishes its tokens' ``o += A_qk v_new`` over the key blocks ``<= tb``
  (``A_qk`` is lower triangular), stored to global memory from the fragments;
- the next chunk's tiles (``w, qg, kd`` ``[64, 128]``, ``u, A_qk`` ``[64, 64]``, ``decay``) arrive by
  ``cp.async`` while this one computes (``stages`` chunks in shared memory); two barriers per chunk.

One CTA per (value block, head, sequence): grid ``(2, HV, N)``; 153 KiB of shared memory with two stages, so one
CTA per SM. Measured (H100, session 17): neither a third stage nor 8 warps instead of 4 changed the 2.4 us step;
ncu calls it latency-bound inside the CTA (issue slots 16% busy, DRAM 26%).
"""
from __future__ import annotations

KERNEL_NAME = "kda_scan_mma"
HEAD_DIM = 128
BLOCK_V = 64
CHUNK = 64

# Shared memory (bytes): two stages of the chunk's tiles, then the bf16 state and v_new.
W_OFF, QG_OFF, KD_OFF = 0, CHUNK * HEAD_DIM * 2, 2 * CHUNK * HEAD_DIM * 2
U_OFF = 3 * CHUNK * HEAD_DIM * 2
A_OFF = U_OFF + CHUNK * BLOCK_V * 2
DECAY_OFF = A_OFF + CHUNK * CHUNK * 2
STAGE_BYTES = DECAY_OFF + HEAD_DIM * 4
STATE_BYTES = HEAD_DIM * BLOCK_V * 2 + CHUNK * BLOCK_V * 2  # the bf16 state and v_new, past the stages


def shared_bytes(stages: int) -> int:
    return stages * STAGE_BYTES + STATE_BYTES

_BODY = r"""
typedef unsigned int u32;
typedef unsigned short bf16;  // raw bits (no cuda_bf16.h: NVRTC may have no include path)
#define KD 128
#define VD 128
#define BV 64

__device__ __forceinline__ float lo_bf(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi_bf(u32 v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ u32 pack(float lo, float hi) {  // two floats rounded to bf16, lo in the low half
    u32 p; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(hi), "f"(lo)); return p;
}
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
// byte offset of (row, 16-byte chunk) in a bf16 tile of 128 (wide) or 64 columns: chunks XOR-swizzled by
// row, so the 8 rows one ldmatrix matrix reads fall in different banks
__device__ __forceinline__ u32 swz128(int row, int chunk) { return row * 256 + ((chunk ^ (row & 7)) << 4); }
__device__ __forceinline__ u32 swz64(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }
__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void ldm_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldm_x4_t(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void cp16(u32 dst, const void* src, bool ok) {  // zeros when !ok
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(ok ? 16 : 0));
}

extern "C" __global__ void __launch_bounds__(32 * WARPS, 1) kda_scan_mma(
    const bf16* __restrict__ W, const bf16* __restrict__ U, const bf16* __restrict__ QG, const bf16* __restrict__ KDt,
    const bf16* __restrict__ AQK, const float* __restrict__ DECAY, bf16* __restrict__ O, const float* __restrict__ H0,
    float* __restrict__ HT, const CU_T* __restrict__ cu_seqlens, const int* __restrict__ chunk_offsets,
    int T, int HV, long long h0_sn, long long h0_sh, long long h0_sk, long long h0_sv)
{
    // Warp wp: tokens [16 tb, 16 tb + 16) and value columns [cb, cb + 8 NT) in phase 1 / the output; state rows
    // [16 MT wp, 16 MT (wp + 1)) (MT 16-row tiles x 8 column tiles of 8) in phase 2.
    constexpr int NT = 8 * 4 / WARPS, MT = 8 / WARPS, NTHREADS = 32 * WARPS;
    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5, gid = lane >> 2, tig = lane & 3;
    const int tb = wp & 3, cb = (wp >> 2) * 8 * NT, r0 = 16 * MT * wp;
    const int iv = blockIdx.x, hv = blockIdx.y, n = blockIdx.z, v0 = BV * iv;
    long long bos;
    int seq_len, first_chunk;
#if IS_VARLEN
    bos = (long long)cu_seqlens[n];
    seq_len = (int)((long long)cu_seqlens[n + 1] - bos);
    first_chunk = chunk_offsets[n];
#else
    bos = (long long)n * T;
    seq_len = T;
    first_chunk = n * ((T + 63) / 64);
#endif
    const int nch = (seq_len + 63) / 64;
    const long long k_row = (long long)HV * KD, v_row = (long long)HV * VD, a_row = (long long)HV * 64;

    // ---- the fp32 state in mma C layout: rows r0 + 16 mt + gid (+ 8), columns 8 nt + 2 tig (+ 1) ----------------
    float S[MT][8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
#if HAS_H0
                const int row = r0 + 16 * mt + gid + 8 * (e >> 1), col = v0 + 8 * nt + 2 * tig + (e & 1);
                S[mt][nt][e] = H0[n * h0_sn + hv * h0_sh + row * h0_sk + col * h0_sv];
#else
                S[mt][nt][e] = 0.f;
#endif
            }
    unsigned char* state = smem + STATE_OFF;  // bf16 [128][64], swizzled
    unsigned char* vnew = smem + VNEW_OFF;    // bf16 [64][64], swizzled
    auto write_state = [&]() {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int row = r0 + 16 * mt + gid + 8 * hh;
                    *reinterpret_cast<u32*>(state + swz64(row, nt) + 4 * tig) = pack(S[mt][nt][2 * hh], S[mt][nt][2 * hh + 1]);
                }
    };
    write_state();

    // ---- the chunk's tiles by cp.async (zeros past the sequence) ---------------------------------------
    auto issue = [&](int c) {  // one commit group per call, empty past the last chunk
        if (c < nch) {
            unsigned char* st = smem + (c % NSTAGE) * STAGE_BYTES;
            const long long t0 = bos + 64LL * c;
            const int nvalid = min(64, seq_len - 64 * c);
            for (int i = tid; i < 64 * 16; i += NTHREADS) {  // w, qg, kd: [64][128]
                const int row = i >> 4, ch = i & 15;
                const bool ok = row < nvalid;
                const long long off = ok ? ((t0 + row) * k_row + hv * KD + ch * 8) : 0;
                const u32 dst = swz128(row, ch);
                cp16(smem_addr(st + W_OFF) + dst, W + off, ok);
                cp16(smem_addr(st + QG_OFF) + dst, QG + off, ok);
                cp16(smem_addr(st + KD_OFF) + dst, KDt + off, ok);
            }
            for (int i = tid; i < 64 * 8; i += NTHREADS) {  // u (this value block) and A_qk: [64][64]
                const int row = i >> 3, ch = i & 7;
                const bool ok = row < nvalid;
                const u32 dst = swz64(row, ch);
                cp16(smem_addr(st + U_OFF) + dst, U + (ok ? (t0 + row) * v_row + hv * VD + v0 + ch * 8 : 0), ok);
                cp16(smem_addr(st + A_OFF) + dst, AQK + (ok ? (t0 + row) * a_row + hv * 64 + ch * 8 : 0), ok);
            }
            if (tid < 32)
                cp16(smem_addr(st + DECAY_OFF) + 16 * tid, DECAY + ((long long)(first_chunk + c) * HV + hv) * KD + 4 * tid, true);
        }
        asm volatile("cp.async.commit_group;");
    };
#pragma unroll
    for (int c = 0; c < NSTAGE - 1; ++c) issue(c);

    // ldmatrix lane addresses: A fragments (rows = this warp's tokens), B fragments of row-major [k][n] tiles
    // (transposed loads), and kd^T fragments (transposed loads of the token-major kd tile)
    const int a_row_l = 16 * tb + ((lane >> 3) & 1) * 8 + (lane & 7), a_chunk_l = lane >> 4;
    const int b_row_l = ((lane >> 3) & 1) * 8 + (lane & 7), b_chunk_l = lane >> 4;
    const int t_row_l = (lane >> 4) * 8 + (lane & 7), t_chunk_l = (lane >> 3) & 1;

#pragma unroll 1
    for (int c = 0; c < nch; ++c) {
        asm volatile("cp.async.wait_group %0;" :: "n"(NSTAGE - 2));  // chunk c's group is complete
        __syncthreads();  // this chunk's tiles and the state are visible; every warp is done with chunk c - 1
        issue(c + NSTAGE - 1);  // into chunk c - 1's stage
        const unsigned char* st = smem + (c % NSTAGE) * STAGE_BYTES;
        const u32 w_s = smem_addr(st + W_OFF), qg_s = smem_addr(st + QG_OFF), kd_s = smem_addr(st + KD_OFF);
        const u32 a_s = smem_addr(st + A_OFF), state_s = smem_addr(state), vnew_s = smem_addr(vnew);
        const int nvalid = min(64, seq_len - 64 * c);

        // ---- phase 1: v_new = u - w S and o = qg S for this warp's tokens and columns -------------------
        float accv[NT][4], acco[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) { accv[nt][e] = 0.f; acco[nt][e] = 0.f; }
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            u32 aw[4], aq[4];
            ldm_x4(aw, w_s + swz128(a_row_l, 2 * kk + a_chunk_l));
            ldm_x4(aq, qg_s + swz128(a_row_l, 2 * kk + a_chunk_l));
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                u32 b[4];
                ldm_x4_t(b, state_s + swz64(16 * kk + b_row_l, cb / 8 + 2 * np + b_chunk_l));
                mma_bf16(accv[2 * np], aw, b[0], b[1]);
                mma_bf16(accv[2 * np + 1], aw, b[2], b[3]);
                mma_bf16(acco[2 * np], aq, b[0], b[1]);
                mma_bf16(acco[2 * np + 1], aq, b[2], b[3]);
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int row = 16 * tb + gid + 8 * hh, chunk = cb / 8 + nt;
                const u32 uu = *reinterpret_cast<const u32*>(st + U_OFF + swz64(row, chunk) + 4 * tig);
                *reinterpret_cast<u32*>(vnew + swz64(row, chunk) + 4 * tig) =
                    pack(lo_bf(uu) - accv[nt][2 * hh], hi_bf(uu) - accv[nt][2 * hh + 1]);
            }
        __syncthreads();  // v_new visible; every warp is done reading the state

        // ---- phase 2a: S = decay S + kd^T v_new for this warp's state rows ---------------------------------
        {
            const float* dec = reinterpret_cast<const float*>(st + DECAY_OFF);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const float d0 = dec[r0 + 16 * mt + gid], d1 = dec[r0 + 16 * mt + gid + 8];
#pragma unroll
                for (int nt = 0; nt < 8; ++nt) {
                    S[mt][nt][0] *= d0; S[mt][nt][1] *= d0; S[mt][nt][2] *= d1; S[mt][nt][3] *= d1;
                }
            }
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {  // 16 tokens at a time
                u32 ka[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)  // kd^T rows r0 + 16 mt ..: transposed load of the token-major tile
                    ldm_x4_t(ka[mt], kd_s + swz128(16 * kk + t_row_l, (r0 + 16 * mt) / 8 + t_chunk_l));
#pragma unroll
                for (int np = 0; np < 4; ++np) {
                    u32 b[4];
                    ldm_x4_t(b, vnew_s + swz64(16 * kk + b_row_l, 2 * np + b_chunk_l));
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_bf16(S[mt][2 * np], ka[mt], b[0], b[1]);
                        mma_bf16(S[mt][2 * np + 1], ka[mt], b[2], b[3]);
                    }
                }
            }
        }
        // ---- phase 2b: o += A_qk v_new over key blocks <= tb, stored ----------------------------------------
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            if (kk <= tb) {
                u32 aa[4];
                ldm_x4(aa, a_s + swz64(a_row_l, 2 * kk + a_chunk_l));
#pragma unroll
                for (int np = 0; np < NT / 2; ++np) {
                    u32 b[4];
                    ldm_x4_t(b, vnew_s + swz64(16 * kk + b_row_l, cb / 8 + 2 * np + b_chunk_l));
                    mma_bf16(acco[2 * np], aa, b[0], b[1]);
                    mma_bf16(acco[2 * np + 1], aa, b[2], b[3]);
                }
            }
        }
        {
            const long long t0 = bos + 64LL * c;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int row = 16 * tb + gid + 8 * hh;
                if (row < nvalid) {
                    bf16* dst = O + (t0 + row) * v_row + hv * VD + v0 + cb + 2 * tig;
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
                        *reinterpret_cast<u32*>(dst + 8 * nt) = pack(acco[nt][2 * hh], acco[nt][2 * hh + 1]);
                }
            }
        }
        write_state();  // phase 1 of every warp is done (barrier above): the bf16 state may be replaced
    }

#if STORE_HT
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int row = r0 + 16 * mt + gid + 8 * hh, col = v0 + 8 * nt + 2 * tig;
                *reinterpret_cast<float2*>(HT + (((long long)n * HV + hv) * KD + row) * VD + col) =
                    make_float2(S[mt][nt][2 * hh], S[mt][nt][2 * hh + 1]);
            }
#endif
}
"""


def kernel_source(*, cu_dtype: str, varlen: bool, has_h0: bool, store_ht: bool, stages: int, warps: int) -> str:
    """The kernel's CUDA text for one specialisation (``cu_dtype``: "int" or "long long", the cu_seqlens
    element type; ``stages``: chunks of tiles in shared memory, 2 or 3; ``warps``: 4 or 8)."""
    if cu_dtype not in ("int", "long long"):
        raise ValueError(f"cu_dtype must be 'int' or 'long long', got {cu_dtype!r}")
    if stages not in (2, 3):
        raise ValueError(f"stages must be 2 or 3, got {stages!r}")
    if warps not in (4, 8):
        raise ValueError(f"warps must be 4 or 8, got {warps!r}")
    defines = {"NSTAGE": stages, "WARPS": warps,
        "CU_T": cu_dtype, "IS_VARLEN": int(varlen), "HAS_H0": int(has_h0), "STORE_HT": int(store_ht),
        "W_OFF": W_OFF, "QG_OFF": QG_OFF, "KD_OFF": KD_OFF, "U_OFF": U_OFF, "A_OFF": A_OFF,
        "DECAY_OFF": DECAY_OFF, "STAGE_BYTES": STAGE_BYTES, "STATE_OFF": stages * STAGE_BYTES,
        "VNEW_OFF": stages * STAGE_BYTES + HEAD_DIM * BLOCK_V * 2,
    }
    head = "".join(f"#define {key} {value}\n" for key, value in defines.items())
    return head + _BODY
