"""The launch description of the KDA / GDN prefill's recurrence for bf16 and K = V = 128 (``scan.cu``, NVRTC).

The kernel's CUDA lives in ``scan.cu``; this module holds what the launcher and the kernel must agree on (the
stage layout in shared memory, the value blocks) and ``kernel_source``, which prepends one specialisation's
``#define``s to the file's text.

The same contract as the plain (one-segment) ``kda_chunk_scan_kernel`` of ``prefill/triton/scan.py`` (read its
docstring for the math): per 64-token chunk, with the fp32 state ``S [128, BV]`` (one block of value columns)::

    v_new = u - w S
    o     = qg S + A_qk v_new
    S     = diag(decay) S + kd^T v_new

with the products on bf16 operands (``S`` and ``v_new`` rounded to bf16, as the Triton kernel and FLA do) and
fp32 accumulation. Written in CUDA because one step of this loop is a chain of small products whose latency,
not bandwidth, bounds a long sequence with few heads (docs/kda-kernels.md section 3).

Each warp owns 16 value columns and keeps everything of them in registers, so warps never exchange data: the
fp32 state is held transposed, ``S^T [16, 128]``, in the ``mma.m16n8k16`` accumulator layout; rounded to bf16 and
packed, those registers are the A fragments of ``S^T``. Every product is taken transposed, so the bf16 operands
kept in registers are always A fragments (one register order, no moves between products):

- ``v_new^T = u^T - S^T w^T``: ``w`` as B fragments (plain ``ldmatrix`` of the token-major tile); ``v_new^T``
  comes out in the accumulator layout, which rounded and packed is the A operand of the next two products;
- ``o^T = S^T qg^T + v_new^T A_qk^T`` (``A_qk`` lower triangular: 10 of its 16 blocks), written back through
  a per-warp staging tile (``stmatrix.trans``) as 16-byte rows of ``o``;
- ``S^T = S^T diag(decay) + v_new^T kd`` (``kd`` B fragments by ``ldmatrix.trans``).

With a scalar gate (GDN) the kernel has a ``row_factors`` form: ``qg = diag(qf) q`` and ``kd = diag(kf) k`` are not
read as tiles; the raw q / k rows of the value head's q/k head arrive instead, with each chunk's factors, and the
products take them where they cost least: ``S^T q^T`` has its token columns scaled by ``qf`` (fp32, after the
product), and ``v_new^T`` its token columns by ``kf`` before the state update (rounded to bf16 again, as ``kd`` was).
The prepare kernel then writes two ``[T, HV, 128]`` tiles fewer, and the value heads of one q/k head share q / k
rows in L2; one long sequence pays some scan time (the factors sit on the chunk step's dependency chain) and still
gains overall (docs/gdn.md section 4).

The chunk's tiles (``w, qg, kd`` ``[64, 128]``, ``u`` ``[64, BV]``, ``A_qk`` ``[64, 64]``, ``decay``) arrive by
``cp.async`` while the previous chunk computes (``stages`` chunks in shared memory); each thread copies fixed
16-byte columns of fixed rows, whole chunks without row checks. One barrier per chunk, for reusing a stage. One
CTA of ``BV / 16`` warps per (value block, head, sequence): grid ``(128 / BV, HV, N)``, BV = 32 (more CTAs, for
few heads), 64, or 128 for many (sequence, head) pairs (one CTA a pair loads the chunk's w / qg / kd tiles once;
``scan.block_v_for``). With packed sequences a CTA finds its sequence's first chunk from ``cu_seqlens`` alone when
there are at most ``INLINE_SEQS`` of them (else from ``chunk_offsets``), and the CTAs zero the rows of ``o`` past the
last sequence, so ``o`` need not start zeroed.

The design of the state in registers, against the first design whose warps split the state by rows and passed
``S`` and ``v_new`` through shared memory, and what bounds a chunk step now: docs/kda-kernels.md section 5.
"""
from __future__ import annotations

from kda_compile.ops._nvrtc import cuda_source
from kda_compile.ops.kda.prefill.chunks import CHUNK
from kda_compile.ops.kda.prefill.cuda.prepare_source import INLINE_SEQS

KERNEL_NAME = "kda_scan_mma"
HEAD_DIM = 128
BLOCK_VS = (32, 64, 128)

# Shared memory (bytes) of one stage: the chunk's tiles.
W_OFF, QG_OFF, KD_OFF = 0, CHUNK * HEAD_DIM * 2, 2 * CHUNK * HEAD_DIM * 2
A_OFF = 3 * CHUNK * HEAD_DIM * 2
DECAY_OFF = A_OFF + CHUNK * CHUNK * 2
U_OFF = DECAY_OFF + HEAD_DIM * 4


def fact_off(block_v: int) -> int:
    """Where a stage keeps the chunk's per-token factors (``row_factors``): past its ``u`` tile."""
    return U_OFF + CHUNK * block_v * 2


FACT_BYTES = 2 * CHUNK * 4  # the q and k row factors of one chunk, fp32


def stage_bytes(block_v: int, row_factors: bool = False) -> int:
    return fact_off(block_v) + (FACT_BYTES if row_factors else 0)


O_STAGE_BYTES = CHUNK * 16 * 2  # one warp's o tile [64 tokens][16 columns], bf16
MAX_SHARED_BYTES = 227 * 1024  # dynamic shared memory of one CTA on sm_90


def shared_bytes(stages: int, block_v: int, row_factors: bool = False) -> int:
    return stages * stage_bytes(block_v, row_factors) + block_v // 16 * O_STAGE_BYTES


def kernel_source(*, cu_dtype: str, varlen: bool, has_h0: bool, store_ht: bool, stages: int, block_v: int,
                  row_factors: bool = False) -> str:
    """The kernel's CUDA text for one specialisation (``cu_dtype``: "int" or "long long", the cu_seqlens
    element type; ``stages``: chunks of tiles in shared memory, 2 or 3; ``block_v``: value columns per CTA,
    32, 64 or 128, 16 per warp; 3 stages of 128 columns do not fit an SM's shared memory). ``row_factors`` (a
    scalar gate, GDN): ``QG`` / ``KDt`` are the raw ``q`` / ``k`` ``[TT, H, 128]`` and ``FACT``
    ``[slots, HV, 2, 64]`` fp32 holds each token's factors, ``qg = diag(qf) q`` and ``kd = diag(kf) k`` (the
    prepare kernel's ``ROW_FACTORS`` output): the prepare writes no ``qg`` / ``kd``, and the value heads of one
    q/k head read the same q / k rows."""
    if cu_dtype not in ("int", "long long"):
        raise ValueError(f"cu_dtype must be 'int' or 'long long', got {cu_dtype!r}")
    if stages not in (2, 3):
        raise ValueError(f"stages must be 2 or 3, got {stages!r}")
    if block_v not in BLOCK_VS:
        raise ValueError(f"block_v must be one of {BLOCK_VS}, got {block_v!r}")
    if shared_bytes(stages, block_v, row_factors) > MAX_SHARED_BYTES:
        raise ValueError(f"stages={stages} with block_v={block_v} needs {shared_bytes(stages, block_v, row_factors)} "
                         f"bytes of shared memory; a CTA takes at most {MAX_SHARED_BYTES}")
    defines = {"NSTAGE": stages, "BV": block_v, "WARPS": block_v // 16,
        "CU_T": cu_dtype, "IS_VARLEN": int(varlen), "HAS_H0": int(has_h0), "STORE_HT": int(store_ht),
        "ROW_FACTORS": int(row_factors), "FACT_OFF": fact_off(block_v),
        "W_OFF": W_OFF, "QG_OFF": QG_OFF, "KD_OFF": KD_OFF, "A_OFF": A_OFF, "DECAY_OFF": DECAY_OFF,
        "U_OFF": U_OFF, "STAGE_BYTES": stage_bytes(block_v, row_factors), "INLINE_SEQS": INLINE_SEQS,
    }
    head = "".join(f"#define {key} {value}\n" for key, value in defines.items())
    return head + cuda_source(__package__, "scan.cu")
