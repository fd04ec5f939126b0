"""The pool-forming kernel that reads whole token rows: ``pool_rows.cu`` (``pooled/cuda_keys.py`` launches it).

glm5_next's cache stores each token's key, gate scores and validity flag side by side in one row
(``cat([k, gate, valid])``, ``2 D + 1`` elements: 514 bytes at D = 128), so the keys and gates a pool needs are
one contiguous span of ``P`` rows. Views of such rows have no 16-byte aligned row starts, and a kernel that
indexes ``k[b, t, d]`` element by element issues 2-byte loads (the Triton kernel's rate there: docs/dsa.md, section 4,
"Tuning measurements", "pool keys"). This
kernel copies each pool's span with 16-byte ``cp.async`` copies from the 16-byte boundary below its first byte
(every copied chunk holds a byte of the span, so it stays inside the allocation) and reads the elements from
shared memory.

The math is ``triton_keys.form_pools_kernel``'s (``pooled.reference.pooled_keys``), per channel ``d``::

    g[j]  = softmax_j(gate[tok_j, d] + ape[j, d])                 (float32; tokens past T or not valid excluded)
    pk[d] = sum_j round(round(g[j]) * k[tok_j, d])                (rounded to k's dtype, summed in float32)

and pool ``p`` of row ``b`` (tokens ``first[b] + p * P + j``) is valid when all ``P`` tokens exist and are valid.

Layout: a token row of a batch row is up to two *spans* (byte ranges read for each token). ``SPANS`` = 1: keys and gates
(and the flag element, in HF's rows) lie in one span; ``SPANS`` = 2: the keys in span 0, the gates in span 1 (separate
tensors with contiguous rows). Which keys are valid (``MASK``): every key (``MASK_NONE``: pools from token 0); a
``[B, T]`` uint8 mask (``MASK_INPUT``); or the flag element of each token row (``MASK_FLAGS``, one span: nonzero, NaN
included, means valid, as ``Tensor.bool`` reads HF's flags), in which case the kernel also writes the ``[B, T]`` bool
mask the rest of the op reads, for every token from the row's first valid key on; ``FIRST_NAME``, launched before it,
finds that key by reading the flags from token 0 until one is set (one round of 1024 tokens for a row without left
padding) and writes the mask for the tokens it read. With a mask the pools start at each row's first valid key. Work:
one warp per pool, up to ``MAX_WARPS`` warps a CTA looping over the flattened ``(b, p)`` pools with two stages per warp:
the next pool's spans are copied while the current one is reduced. Lane ``l`` owns channels ``l + 32 i``, so a warp's
2-byte reads of a row are 64 contiguous bytes (one shared-memory wavefront) and its 2-byte stores of ``pk`` are
coalesced; ``ape`` lives in registers for the kernel's life. With ``PAIRS`` (D a multiple of 64, pools of at most 16)
the products of channels ``c`` and ``c + 32`` are one 16-bit pair multiply: the same rounding, about a third fewer
instructions (the math, not the copies, bounded the one-channel form).

Parameters of the pool kernel, in order: ``base0, base1`` (the spans' bytes at b = 0, t = 0), ``valid`` (the uint8
mask read with ``MASK_INPUT``, the ``[B, T]`` contiguous mask written with ``MASK_FLAGS``, else unused), ``ape``
(float32 ``[P, D]`` contiguous), ``first`` (int64 ``[B]``; unused without a mask), ``pk`` (``[B, NP, D]`` contiguous,
k's dtype), ``pool_valid`` (uint8 ``[B, NP]`` contiguous); then int64 ``sb0, st0, sb1, st1`` (byte strides of the
spans), ``svb, svt`` (the input mask's element strides), and int32 ``w0, w1`` (span widths in bytes), ``k_off, g_off,
v_off`` (byte offsets of the key, gate and flag elements in their spans), ``B, T, NP, D``, ``stage_bytes`` (shared
memory per warp and stage), ``span1_at`` (where span 1's copy starts in a stage, 16-byte aligned). Of the first-key
kernel (grid ``B``): ``flags`` (the flag element of token 0, batch row 0), ``valid``, ``first``, int64 ``sb, st``
(byte strides), int32 ``T``.
"""
from __future__ import annotations

from kda_compile.ops._nvrtc import cuda_source

KERNEL_NAME = "dsa_pool_rows"
FIRST_NAME = "dsa_pool_first"  # each row's first valid key from the flags in its token rows
FIRST_THREADS = 256
MASK_NONE, MASK_INPUT, MASK_FLAGS = 0, 1, 2  # every key valid / a [B, T] uint8 mask / flags in the rows (see above)
MAX_WARPS = 4  # warps a CTA (fewer where two stages of a warp's spans need more shared memory)
MAX_CHANNELS = 256  # 8 channels a lane
MAX_POOL = 32  # one lane per token of a pool (the validity ballot)
APE_REGISTERS = 64  # ape values a lane keeps in registers (more spill: read through the L1 instead)

_TYPES = ("bf16", "f16")


def kernel_source(*, elem: str, pool: int, channels: int, spans: int, mask: int, pairs: bool = False) -> str:
    """The kernel for 16-bit ``elem`` ("bf16" / "f16"), pools of ``pool`` tokens, at most ``channels`` key channels
    (a multiple of 32 up to ``MAX_CHANNELS``), ``spans`` (1 or 2) and the keys' validity from ``mask``
    (``MASK_NONE``, ``MASK_INPUT`` or ``MASK_FLAGS``, which needs one span). ``pairs``: the products of channels
    ``c`` and ``c + 32`` in one 16-bit pair multiply (the launcher's choice when D is a multiple of 64)."""
    if elem not in _TYPES:
        raise ValueError(f"elem={elem!r}: expected one of {_TYPES}")
    if not 1 <= pool <= MAX_POOL:
        raise ValueError(f"pool={pool}: expected 1 to {MAX_POOL}")
    if channels % 32 or not 32 <= channels <= MAX_CHANNELS:
        raise ValueError(f"channels={channels}: expected a multiple of 32 up to {MAX_CHANNELS}")
    if spans not in (1, 2):
        raise ValueError(f"spans={spans}: expected 1 or 2")
    if pairs and channels % 64:
        raise ValueError(f"pairs with channels={channels}: expected a multiple of 64")
    if mask not in (MASK_NONE, MASK_INPUT, MASK_FLAGS) or (mask == MASK_FLAGS and spans != 1):
        raise ValueError(f"mask={mask} with spans={spans}: expected 0, 1, or 2 with one span")
    cpl = channels // 32
    head = (f"#define IS_BF16 {int(elem == 'bf16')}\n#define POOL {pool}\n#define CPL {cpl}\n"
            f"#define APE_IN_REGISTERS {int(cpl * pool <= APE_REGISTERS)}\n"
            f"#define SPANS {spans}\n#define PAIRS {int(pairs)}\n#define MASK {mask}\n#define MASK_NONE {MASK_NONE}\n"
            f"#define MASK_INPUT {MASK_INPUT}\n#define MASK_FLAGS {MASK_FLAGS}\n"
            f"#define MAX_WARPS {MAX_WARPS}\n#define KERNEL_NAME {KERNEL_NAME}\n#define FIRST_NAME {FIRST_NAME}\n"
            f"#define FIRST_THREADS {FIRST_THREADS}\n")
    return head + cuda_source(__package__, "pool_rows.cu")


def span_area(pool: int, token_stride: int, width: int) -> int:
    """Shared bytes of one span's copy in a stage: ``pool`` rows ``token_stride`` bytes apart, ``width`` bytes
    each, plus up to 15 bytes before the first (the 16-byte boundary), rounded up to 16."""
    return (((pool - 1) * token_stride + width + 15 + 15) >> 4) << 4


def shared_bytes(stage_bytes: int, warps: int) -> int:
    """Dynamic shared memory of a CTA of ``warps`` warps, two stages each."""
    return warps * 2 * stage_bytes
