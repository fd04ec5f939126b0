"""CUDA C++ source of the Hopper (sm_90a) DSA indexer score kernel for a few queries (decode, short chunks).

The kernel is ``wgmma_indexer.cu`` (with the shared helpers of ``ops/hopper/``), compiled at run time by NVRTC
(``kda_compile.ops._nvrtc``); this module holds the geometry the launcher (``indexer/wgmma_indexer.py``) sizes by and
prepends each specialisation's ``#define``s. It writes the same int32 score codes as the Triton kernels of
``indexer/triton_indexer.py`` (``triton_topk.score_codes``: order-preserving codes of the float32 score, ``INT32_MIN``
for a key the query may not see), for one query's H_I <= 64 indexer heads of 128 channels against a stream of cached
keys:

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

Against the Triton heads-as-rows kernel and the device's read bandwidth: docs/dsa.md, section 4, "Tuning measurements",
"wgmma indexer".

Compile-time switches (``#define``): ``IS_BF16`` (1: bf16, 0: f16), ``STAGES``, ``HAS_KEY_MASK``, ``WEIGHT_KIND``
(the weights are read in their own dtype: float32, bfloat16 or float16).
"""
from __future__ import annotations

from kda_compile.ops._nvrtc import cuda_source

HEADS = 64  # indexer heads per program = the wgmma M (fewer are zero-padded)
DIM = 128  # indexer head dim the kernel is written for (two 64-channel panels)
TILE_KEYS = 64  # keys per tile = the wgmma N
THREADS = 128
PANEL_BYTES = 64 * 128  # 64 rows of 128 bytes (64 half-precision channels)
TILE_BYTES = 2 * PANEL_BYTES
STAGES = 3  # with four programs per SM (the sweep of stages x programs: docs/dsa.md section 4, "wgmma indexer")
REDUCE_BYTES = 2 * 4 * TILE_KEYS * 4  # [2 buffers][4 warps][64 columns] float32
KERNEL_NAME = "dsa_indexer_wgmma"


SM_SHARED_BYTES = 228 * 1024  # shared memory of an sm_90 SM (each resident program also reserves 1 KB)
MAX_PROGRAMS_PER_SM = 5  # 65536 registers / (5 x 128 threads): 102 registers a thread (six would spill)


def programs_per_sm(stages: int = STAGES) -> int:
    """Programs an SM holds at once, by their shared memory (the kernel's launch bounds ask the compiler to fit
    their registers too)."""
    return max(1, min(MAX_PROGRAMS_PER_SM, SM_SHARED_BYTES // (shared_bytes(stages) + 1024)))


def shared_bytes(stages: int = STAGES) -> int:
    """Dynamic shared memory: the key stages, the reduction buffers, the mbarriers and 1 KB to align to 1024."""
    return TILE_BYTES * stages + REDUCE_BYTES + 8 * stages + 1024


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
        ("IS_BF16", int(elem == "bf16")), ("HAS_KEY_MASK", int(bool(has_key_mask))),
        ("WEIGHT_KIND", WEIGHT_KINDS.index(weight)), ("STAGES", stages), ("PROGRAMS_PER_SM", programs_per_sm(stages)),
        ("HEADS", HEADS), ("DIM", DIM), ("TILE_KEYS", TILE_KEYS), ("THREADS", THREADS), ("PANEL_BYTES", PANEL_BYTES),
        ("TILE_BYTES", TILE_BYTES), ("REDUCE_BYTES", REDUCE_BYTES)))
    return defines + cuda_source(__package__, "wgmma_indexer.cu")
