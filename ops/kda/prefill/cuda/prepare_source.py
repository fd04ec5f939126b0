"""The launch description of the KDA / GDN prepare kernel for bf16 and K = V = 128 (``prepare.cu``, NVRTC).

The kernel's CUDA lives in ``prepare.cu`` (with ``prepare_device.cuh`` and one pass 1 per gate form:
``prepare_pass1_channel.cuh`` for KDA's per-channel gate, ``prepare_pass1_scalar.cuh`` for GDN's one gate per
(token, value head)); this module holds what the launcher and the kernel must agree on (the shared-memory layout,
the block size, the in-kernel constants) and ``kernel_source``, which prepends one specialisation's ``#define``s to
the file's text.

The same contract as ``prefill/triton/prepare.py`` (read its docstring for the math and the numerics), with the
gate's form a compile-time parameter (``SCALAR_GATE``). Both forms take bf16 q / k / v with K = V = 128. The KDA
form takes the in-kernel gates: the lower-bound gate (with ``lower_bound >= -MAX_BOUNDED_DECAY`` every 16-token
block's decay range is within ``DIAG_RANGE_LIMIT``, the configuration the prefill benchmark anchors on) and, as
``wide_blocks``, any lower bound and the softplus gate, with no exact-diagonal pass and a cost that does not
depend on the data; the GDN form takes every gate (the finished log decay, or the in-kernel softplus gate with
``has_a_log``), exactly. Written in CUDA because the layout it needs is one Triton does not give: each warp owns
one 16-token block of the chunk in the register layout of a ``mma.m16n8k16`` operand, so

- the loaded q / k / gate elements are the tensor-core A operands as they stand (no layout conversion
  through shared memory per K slice, which was most of the Triton kernel's instructions); the A products
  take fp32 operands rounded to TF32 on TF32 tensor cores, as the Triton kernel's (bf16 operands, or truncated
  TF32 operands, cost accuracy: docs/kda-kernels.md section 4, "Measurements moved from the code");
- the block-local cumsum is three lane shuffles per element; only the four block sums cross warps
  (one barrier per K slice, double-buffered);
- warp r multiplies only the key blocks s <= r (the products above the block diagonal are zero);
- ``x = beta 2^G k`` stays in shared memory for the second pass (no global round trip), v arrives
  by ``cp.async`` during the first pass;
- the triangular inverse: 16 x 16 diagonal blocks by substitution in fp32 (one per warp), the off-diagonal blocks by
  doubling on 3xTF32 tensor-core products (about fp32 accuracy, as the Triton kernel's ``tf32x3`` solve; three
  rounds of at most two 16 x 16 products per warp: ``solve_offdiag`` in ``prepare_device.cuh``).

One CTA of 4 warps owns one 64-token chunk of one value head (grid ``(chunk slots, HV)``), 73 KiB: 3 CTAs per SM.

The KDA form's decay exponents are formed as the Triton kernel's are, each summed over its own span across
blocks (block sums, never a difference of prefix sums; docstring of ``prefill/triton/prepare.py``); inside a block
the tails ``G_end - G`` are differences of the block-local cumsum, exact to fp32 rounding of the block's range
(with the softplus gate a block of floored steps spans up to 2400 log2 units: 2^-12 there, still far below the
bf16 rounding of the outputs).

Outputs, all in the Triton kernel's layouts: ``w, qg, kd`` ``[TT, HV, 128]``, ``u`` ``[TT, HV, 128]``,
``A_qk`` ``[TT, HV, 64]`` (bf16), ``decay`` ``[slots, HV, 128]`` fp32, and with ``SAVE_AKK`` the inverse
``T`` ``[TT, HV, 64]`` (bf16) for FLA's backward.
"""
from __future__ import annotations

from kda_compile.ops._nvrtc import cuda_source
from kda_compile.ops.kda.prefill.chunks import CHUNK

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
    (``prepare_pass1_channel.cuh``). ``row_factors`` (scalar gate only): write the rows' q / k factors
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
        "SCALAR_GATE": int(scalar_gate), "ROW_FACTORS": int(row_factors), "GATE_SOFTPLUS": int(softplus_gate),
        "WIDE_BLOCKS": int(wide_blocks),
        "KEY_ANCHOR": "1.0f" if wide_blocks else "0.5f", "STEP_CLAMP": f"{STEP_CLAMP:.1f}f",
        "LD": LD, "KEYS_BYTES": KEYS_BYTES, "XS_OFF": XS_OFF, "VS_OFF": VS_OFF, "BETA_OFF": BETA_OFF,
        "UNION_OFF": UNION_OFF, "INLINE_SEQS": INLINE_SEQS, "INLINE_OFFSETS": int(inline_offsets),
        "STAGE_OFF": STAGE_OFF, "NSTAGE": NSTAGE, "G_BYTES": 2 if g_dtype == "bf16" else 4,
        "STAGE_BYTES": stage_bytes(2 if g_dtype == "bf16" else 4),
    }
    head = "".join(f"#define {key} {value}\n" for key, value in defines.items())
    return head + cuda_source(__package__, "prepare.cu")
