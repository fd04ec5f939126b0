"""CUDA C++ source of the Hopper (sm_90a) DSA sparse-attention forward: gathered latent rows, warpgroup MMA.

The kernel is ``wgmma_forward.cu`` (with the shared helpers of ``ops/hopper/``), compiled at run time by NVRTC
(``kda_compile.ops._nvrtc``); this module holds the geometry the launcher (``sparse/wgmma_forward.py``) sizes by and
prepends each specialisation's ``#define``s. The absorbed MQA form of DeepSeek-V3.2 / GLM-5: every query head attends to
the same gathered key rows ``kv[b, idx, kvh, :]`` of 512 latent (+ 64 rope) channels, and the value is the row's first
512 channels. The schedule is that of our MLA decode kernel (``ops/mla/decode/wgmma_decode_source.py``; both include
``ops/hopper/latent_tile.cuh``), with the contiguous TMA tiles replaced by a gather:

- A program (384 threads, three warpgroups) owns 64 query heads of one KV head of one query token and one
  contiguous range (split) of its top-k list; grid (token x head blocks, splits), head block fastest, so the
  programs gathering the same rows run together and the second read comes from L2.
- Shared memory (1024-byte aligned, 128-byte swizzle): the query block [64 heads, D] (D = 512 or 576), two
  stages of 64 gathered rows [64, D] stored as [64 x 64] panels of 128-byte rows, P [64 x 64] per stage (with
  rope in the stage's rope panel, which the scores no longer need once computed; without, 8 KB of its own),
  per-row statistics and the mbarriers.
- The value warpgroups gather. Each owns half of the value columns (four latent panels) and, for the scores,
  half of the rope panel's columns; once both have finished their value products of tile i (a 256-thread named
  barrier: P of tile i may live in the rope panel) they copy tile i + 2 into the stage (``cp.async`` of 16
  bytes, zero-filled for index -1 or a position past the split, each warp copying 512 contiguous bytes of one
  latent row per instruction) and arrive on the stage's "full" mbarrier when their copies land
  (``cp.async.mbarrier.arrive.noinc``: 256 arrivals complete a phase). The indices of tile i + 2 are loaded at
  the start of iteration i, so their latency hides under the iteration.
- Warpgroup 0 (scores) computes S = Q K^T ([64 x 64], k = D: wgmma m64n64k16), masks the positions whose index
  is -1 or past the split (a 64-bit ballot of the tile's indices per warp), runs the online softmax in base 2
  with lazy rescaling (the row max moves only when a tile exceeds it by ``RESCALE_THRESHOLD``) and hands P and
  the rescale factors to the value warpgroups through the stage's "P full" mbarrier (P and the factors are
  per stage, so the scores of tile i + 1 never wait for the value product of tile i); they accumulate
  O += P V (wgmma m64n256k16, V = the latent panels of the same stage, read N-major: each row is gathered once
  for both products).
- Output: o normalised by the row's exp-sum (q's dtype, or float32 partials with ``PARTIAL``) and the
  natural-log lse (-inf, and o = 0, for a row that saw no valid index), the contract of the Triton kernel's
  split form, so its combine kernel merges the splits.

Compile-time switches (``#define``): ``IS_BF16`` (1: bf16, 0: f16), ``ROPE`` (1: 576-channel rows, 0: 512),
``PARTIAL``.
"""
from __future__ import annotations

from kda_compile.ops._nvrtc import cuda_source
from kda_compile.ops.mla.decode.wgmma_decode_source import RESCALE_THRESHOLD

ROWS = 64  # query heads per program = the wgmma M
TILE_TOKENS = 64  # gathered rows per tile
LATENT_DIM = 512  # the value width, and the latent part of a row
ROPE_DIM = 64
THREADS = 384
PANEL_BYTES = 64 * 128  # 64 rows of 128 bytes (64 half-precision channels)
P_BYTES = PANEL_BYTES
STAT_BYTES = 4 * ROWS * 4
BARRIER_BYTES = 4 * 8  # the "full" and "P full" mbarriers of the two stages
GATHER_THREADS = 256  # the value warpgroups: arrivals per phase of a "full" mbarrier
KERNEL_NAME = "dsa_sparse_wgmma"


def tile_bytes(rope: bool) -> int:
    return (LATENT_DIM + (ROPE_DIM if rope else 0)) // 64 * PANEL_BYTES


def p_buffer_bytes(rope: bool) -> int:
    """Shared memory of the P buffers outside the stages: none with rope (P lives in the stage's rope panel)."""
    return 0 if rope else 2 * P_BYTES


def shared_bytes(rope: bool) -> int:
    """Dynamic shared memory: query block, two stages, P, statistics, barriers and 1 KB to align to 1024."""
    return 3 * tile_bytes(rope) + p_buffer_bytes(rope) + STAT_BYTES + BARRIER_BYTES + 1024


def kernel_source(*, elem: str, rope: bool, partial: bool) -> str:
    """The kernel's CUDA source for one specialisation (``elem``: "bf16" or "f16")."""
    if elem not in ("bf16", "f16"):
        raise ValueError(f"elem must be 'bf16' or 'f16', got {elem!r}")
    defines = "".join(f"#define {name} {value}\n" for name, value in (
        ("IS_BF16", int(elem == "bf16")), ("ROPE", int(bool(rope))), ("PARTIAL", int(bool(partial))),
        ("RESCALE_THRESHOLD", f"{RESCALE_THRESHOLD}f"), ("ROWS", ROWS), ("TILE_TOKENS", TILE_TOKENS),
        ("PANEL_BYTES", PANEL_BYTES), ("P_BYTES", P_BYTES), ("TILE_BYTES", tile_bytes(rope)), ("THREADS", THREADS),
        ("STAT_BYTES", STAT_BYTES), ("P_BUFFER_BYTES", p_buffer_bytes(rope)), ("BAR_VALUES", 3),
        ("GATHER_THREADS", GATHER_THREADS)))
    return defines + cuda_source(__package__, "wgmma_forward.cu")
