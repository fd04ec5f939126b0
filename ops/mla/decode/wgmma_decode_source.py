"""CUDA C++ source of the Hopper (sm_90a) absorbed-MLA decode kernel: TMA copies, warpgroup MMA (wgmma).

The kernel is ``wgmma_decode.cu`` (with the shared helpers of ``ops/hopper/``), compiled at run time by NVRTC
(``kda_compile.ops._nvrtc``); this module holds the geometry the launcher (``decode/wgmma_decode.py``) sizes by and
prepends each specialisation's ``#define``s. Triton 3.6 cannot express this schedule for 64 heads x (512 + 64)
channels (see docs/mla-decode-kernels.md section 2). Here:

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

Compile-time switches (``#define``): ``IS_BF16`` (1: bf16, 0: f16), ``IS_CAUSAL``, ``MASK_KIND`` (0 none, 1 uint8
keep-mask, 2 additive float32), ``PARTIAL``; for timing experiments only (they break the results):
``DBG_NO_S``, ``DBG_NO_PV``, ``DBG_NO_SOFTMAX`` drop the score product, the value product, the exponentials.
"""
from __future__ import annotations

from kda_compile.ops._nvrtc import cuda_source

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
    return f"#define IS_BF16 {int(elem == 'bf16')}\n" + defines + cuda_source(__package__, "wgmma_decode.cu")
