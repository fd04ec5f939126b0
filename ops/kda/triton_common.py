"""What our KDA Triton kernels share: the gate-form codes and the tensor-core operand helper.

Triton only (no torch.compile, no custom ops). The gate codes are ``tl.constexpr`` for the kernels;
launchers pass ``int(GATE_...)`` as the ``GATE`` argument.
"""
import os

import triton
import triton.language as tl

# Gate forms (the GATE constexpr): the caller's finished log-decay, or the raw projection gated in the kernel.
GATE_PRECOMPUTED = tl.constexpr(0)
GATE_SOFTPLUS = tl.constexpr(1)
GATE_LOWER_BOUND = tl.constexpr(2)

# Triton 3.6's interpreter gets products of bfloat16 operands wrong (relative error ~1e9 on a plain
# [16, 16] product), and its float32 -> bfloat16 conversion truncates where the GPU rounds to nearest
# even. Interpreted, a bfloat16 operand is therefore rounded to nearest even by hand and multiplied in
# float32: the values the GPU multiplies.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def round_to_bf16(x):
    """float32 ``x`` rounded to the nearest bfloat16 (ties to even), as float32 (finite inputs)."""
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def tf32_round(x):
    """float32 ``x`` rounded to the nearest TF32 value (10 mantissa bits), for ``input_precision="tf32"``
    products: Hopper's tensor cores drop the 13 low bits of an fp32 operand (truncation, a biased error
    twice as large: docs/kda-kernels.md section 8). Identity when
    interpreted (the interpreter multiplies in full fp32)."""
    if INTERPRETED:
        y = x.to(tl.float32)
    else:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        y = ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return y


@triton.jit
def dot_operand(x, DOT_BF16: tl.constexpr):
    """An operand of a bf16 or TF32 tensor-core product: bfloat16 for bf16 inputs (full tensor-core
    rate), else float32 rounded to TF32 (``tf32_round``).

    One return statement: the compiler (unlike the interpreter) checks every return of a function
    for one type, even those behind a constexpr ``if``."""
    if DOT_BF16:
        if INTERPRETED:
            y = round_to_bf16(x)
        else:
            y = x.to(tl.bfloat16)
    else:
        y = tf32_round(x)
    return y
