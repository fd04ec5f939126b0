"""Tiles of the prepare kernel (``prefill/triton/prepare.py``): loads and stores of a chunk's rows, beta, the L2-norm
sums and the ``A`` stripes' stores.

Triton only. A chunk is 64 rows of a row-major ``[TT, heads, width]`` tensor; every pointer already points at the
chunk's first row, offsets inside the chunk are int32.
"""
import triton
import triton.language as tl

L2NORM_EPS = tl.constexpr(1e-6)


@triton.jit
def load_tile(ptr, rows, ok, cols, col_ok, stride, NB: tl.constexpr, BC: tl.constexpr):
    """The chunk's ``[BT, BKC]`` tile of a row-major tensor as fp32 ``[NB, BC, BKC]`` (0 outside). Loaded
    as a 2-D tile and reshaped: Triton then lays each 16-row block out inside one warp (lanes along
    the rows), so the block scans and sums below stay in registers and shuffles; a 3-D load puts the
    warps along the rows of every block instead."""
    return tl.reshape(load_rows(ptr, rows, ok, cols, col_ok, stride), [NB, BC, cols.shape[0]])


@triton.jit
def load_rows(ptr, rows, ok, cols, col_ok, stride):
    """The chunk's ``[BT, len(cols)]`` tile of a row-major tensor as fp32 (0 outside)."""
    x = tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0)
    return x.to(tl.float32)


@triton.jit
def store_tile(ptr, x3, rows, ok, cols, col_ok, stride):
    """Store an ``[NB, BC, BKC]`` tile as the chunk's ``[BT, BKC]`` rows (the inverse of ``load_tile``)."""
    x = tl.reshape(x3, [rows.shape[0], cols.shape[0]])
    tl.store(ptr + rows[:, None] * stride + cols[None, :], x.to(ptr.dtype.element_ty),
             mask=ok[:, None] & col_ok[None, :])


@triton.jit
def load_beta(Beta, rows, ok, beta_scale, HV: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """beta of the chunk rows ``rows`` (any shape; ``Beta`` points at the chunk's first row), 0 outside
    the sequence."""
    b = tl.load(Beta + rows * HV, mask=ok, other=0.0).to(tl.float32)
    if BETA_SIGMOID:
        b = tl.where(ok, tl.sigmoid(b) * beta_scale, 0.0)
    return b


@triton.jit
def l2_sums(Q, Kt, rows, ok, K: tl.constexpr, stride: tl.constexpr):
    """Sums of squares ``[BT]`` of the chunk's q and k rows over all K channels. 64-channel tiles in an unrolled
    loop: every load is issued before the first sum waits (a loop of dependent 16-channel iterations left each
    load's latency exposed: docs/kda-kernels.md section 8)."""
    q_sq = tl.zeros([rows.shape[0]], dtype=tl.float32)
    k_sq = tl.zeros([rows.shape[0]], dtype=tl.float32)
    for k0 in tl.static_range(0, K, 64):
        wide = k0 + tl.arange(0, 64)
        q_wide = load_rows(Q, rows, ok, wide, wide < K, stride)
        q_sq += tl.sum(q_wide * q_wide, 1)
        k_wide = load_rows(Kt, rows, ok, wide, wide < K, stride)
        k_sq += tl.sum(k_wide * k_wide, 1)
    return q_sq, k_sq


@triton.jit
def store_stripe(X, rows, ok, s: tl.constexpr, value, HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Columns ``[16 s, 16 s + 16)`` of the chunk's rows of ``X [TT, HV, BT]`` (``X`` points at the
    chunk's first row)."""
    cols = s * BC + tl.arange(0, BC)
    tl.store(X + rows[:, None] * (HV * BT) + cols[None, :], value.to(X.dtype.element_ty), mask=ok[:, None])


@triton.jit
def assemble(s0, s1, s2, s3, BT: tl.constexpr):
    """Four ``[BT, BC]`` column stripes side by side: ``[BT, 4 * BC]``."""
    BC: tl.constexpr = s0.shape[1]
    x = tl.join(tl.join(s0, s1), tl.join(s2, s3))  # [BT, BC, 2 (stripe % 2), 2 (stripe // 2)]
    return tl.reshape(tl.permute(x, (0, 3, 2, 1)), [BT, 4 * BC])


@triton.jit
def column_stripes(x, BC: tl.constexpr):
    """The four ``[BT, BC]`` column stripes of a ``[BT, 4 * BC]`` tile (the inverse of ``assemble``)."""
    BT: tl.constexpr = x.shape[0]
    x = tl.permute(tl.reshape(x, [BT, 2, 2, BC]), (0, 3, 1, 2))  # [BT, BC, stripe // 2, stripe % 2]
    even, odd = tl.split(x)
    s0, s2 = tl.split(even)
    s1, s3 = tl.split(odd)
    return s0, s1, s2, s3
