"""The triangular inverse of the prepare kernel (``prefill/triton/prepare.py``): ``T = (I + L)^-1`` for the chunk's
strictly lower ``L = beta A_kk``, the same for every gate form.

Forward substitution on the four 16 x 16 diagonal blocks at once (fp32), then ``T = (I + N)^-1 D^-1`` with
``N = D^-1 L_off`` strictly block-lower, so the block series ``I - N + N^2 - N^3`` is exact algebra, applied stripe
by stripe in Horner form on 3xTF32 products (``SOLVE_PRECISION``). Never an element-level Neumann series (NaN on 16
identical keys, kda.md section 5). Triton only.
"""
import triton
import triton.language as tl


@triton.jit
def unit_lower_inverse_blocks(D, NB: tl.constexpr, BC: tl.constexpr):
    """``(I + D_b)^-1`` for each strictly lower-triangular ``[BC, BC]`` block of ``D`` ``[NB, BC, BC]``
    (fp32): column-oriented forward substitution, after step j row j of ``Y`` is final and is
    eliminated from the rows below it."""
    rows = tl.arange(0, BC)[None, :, None]
    cols = tl.arange(0, BC)[None, None, :]
    Y = tl.where(rows == cols, 1.0, 0.0) + tl.zeros([NB, BC, BC], dtype=tl.float32)
    for j in range(0, BC - 1):
        y_j = tl.sum(tl.where(rows == j, Y, 0.0), 1)  # row j of Y, [NB, BC]
        d_j = tl.sum(tl.where(cols == j, D, 0.0), 2)  # column j of D, [NB, BC]
        Y -= d_j[:, :, None] * y_j[:, None, :]
    return Y


@triton.jit
def split_tf32(x):
    """``x = hi + lo`` with ``hi`` exact in TF32 (mantissa rounded to 10 bits) and ``lo`` the exact
    remainder (<= half a TF32 ulp): products of the parts on TF32 tensor cores carry about fp32 accuracy."""
    hi = ((x.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def solve_dot(a_hi, a_lo, b, PRECISION: tl.constexpr):
    """``a @ b`` in fp32 accuracy: three TF32 products of the split operands when ``PRECISION`` is
    "tf32x3" (``a`` split once by the caller and reused), else one product in ``PRECISION``."""
    if PRECISION == "tf32x3":
        b_hi, b_lo = split_tf32(b)
        y = tl.dot(a_hi, b_hi, input_precision="tf32")
        y = tl.dot(a_hi, b_lo, y, input_precision="tf32")
        y = tl.dot(a_lo, b_hi, y, input_precision="tf32")
    else:
        y = tl.dot(a_hi + a_lo, b, input_precision=PRECISION)
    return y


@triton.jit
def horner(n_hi, n_lo, d, steps: tl.constexpr, PRECISION: tl.constexpr):
    """``(I + N)^-1 d`` for a strictly block-lower ``N = n_hi + n_lo`` whose ``steps + 1``-th power
    kills ``d``."""
    t = d
    for _ in tl.static_range(steps):
        t = d - solve_dot(n_hi, n_lo, t, PRECISION)
    return t
