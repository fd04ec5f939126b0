"""Triton kernels the FLA path runs around FLA's own: the q/k L2 norm (forward and backward) and the
zeroing of the triangle FLA leaves unwritten in its ``Aqk`` residual.

Kernels and launchers only (no torch.compile, no custom ops, no backend choice). Device-agnostic, so
the same launchers run on CPU tensors under ``TRITON_INTERPRET=1``.

All three are memory-bound passes over whole rows, many rows per program: the L2 norm runs at the copy bandwidth,
and the zeroing writes whole rows (a version storing only the masked elements paid for partial-sector writes;
docs/kda-kernels.md section 8).

Math (per row ``x`` of the last dimension; eps inside the square root, as FLA and HF)::

    rstd = 1 / sqrt(sum(x^2) + eps)        (float32)
    y    = x * rstd                        (x's dtype)
    dx   = rstd * (dy - y * sum(dy * y))   (y's dtype)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

L2NORM_EPS = 1e-6
ROW_ELEMENTS = 4096  # elements a program streams: 32 rows of 128 (16 KiB of float32 in flight)
NUM_WARPS = 4


def _row_block(D: int) -> tuple[int, int]:
    BD = max(16, triton.next_power_of_2(D))
    return max(1, ROW_ELEMENTS // BD), BD


@triton.jit
def _row_tile(M, D, BM: tl.constexpr, BD: tl.constexpr):
    """This program's ``BM`` rows of an ``[M, D]`` row-major tensor: row indices, their mask, the
    element mask and the element offsets ``[BM, BD]``."""
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.arange(0, BD)
    m_rows = rows < M
    return rows, m_rows, m_rows[:, None] & (cols[None, :] < D), rows[:, None] * D + cols[None, :]


@triton.jit
def l2norm_fwd_kernel(x, y, rstd, M, D, eps, BM: tl.constexpr, BD: tl.constexpr):
    rows, m_rows, mask, offsets = _row_tile(M, D, BM, BD)
    b_x = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) + eps)
    tl.store(y + offsets, (b_x * b_rstd[:, None]).to(y.dtype.element_ty), mask=mask)
    tl.store(rstd + rows, b_rstd, mask=m_rows)


@triton.jit
def l2norm_bwd_kernel(y, rstd, dy, dx, M, D, BM: tl.constexpr, BD: tl.constexpr):
    rows, m_rows, mask, offsets = _row_tile(M, D, BM, BD)
    b_y = tl.load(y + offsets, mask=mask, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + offsets, mask=mask, other=0.0).to(tl.float32)
    b_rstd = tl.load(rstd + rows, mask=m_rows, other=0.0)
    b_dx = b_rstd[:, None] * (b_dy - b_y * tl.sum(b_dy * b_y, axis=1)[:, None])
    tl.store(dx + offsets, b_dx.to(dx.dtype.element_ty), mask=mask)


def l2norm_fwd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` for a contiguous ``x`` ``[..., D]``: ``y`` like ``x``, ``rstd`` float32 ``x.shape[:-1]``."""
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous, got strides {x.stride()}")
    D = x.shape[-1]
    M = x.numel() // D if D else 0
    y = torch.empty_like(x)
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
    if M:
        BM, BD = _row_block(D)
        l2norm_fwd_kernel[(triton.cdiv(M, BM),)](x, y, rstd, M, D, L2NORM_EPS, BM=BM, BD=BD, num_warps=NUM_WARPS)
    return y, rstd


def l2norm_bwd(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The gradient of ``x`` from the normalised ``y``, its ``rstd`` and the gradient ``dy`` of ``y``
    (any float dtype, made contiguous); returned in ``y``'s dtype."""
    if dy.shape != y.shape or rstd.shape != y.shape[:-1]:
        raise ValueError(f"y, rstd and dy must have shapes [..., D], [...] and [..., D], got "
                         f"{list(y.shape)}, {list(rstd.shape)} and {list(dy.shape)}")
    y, rstd, dy = y.contiguous(), rstd.contiguous(), dy.contiguous()
    D = y.shape[-1]
    M = y.numel() // D if D else 0
    dx = torch.empty_like(y)
    if M:
        BM, BD = _row_block(D)
        l2norm_bwd_kernel[(triton.cdiv(M, BM),)](y, rstd, dy, dx, M, D, BM=BM, BD=BD, num_warps=NUM_WARPS)
    return dx


@triton.jit
def zero_above_diagonal_kernel(a, row_in_chunk, R, T, HV, C: tl.constexpr, BR: tl.constexpr,
                               VARLEN: tl.constexpr):
    # a: [B, T, HV, C] contiguous, seen as R = B * T * HV rows of C; row r is token (r // HV) % T.
    # Whole rows are read and written back (a row-uniform mask keeps the accesses vectorised; masking
    # single elements of a store made it partial-sector writes at a tenth of the bandwidth).
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_rows = (rows < R)[:, None]
    t = (rows // HV) % T
    if VARLEN:
        diag = tl.load(row_in_chunk + t, mask=rows < R, other=0)
    else:
        diag = t % C
    cols = tl.arange(0, C)
    offsets = rows[:, None] * C + cols[None, :]
    x = tl.load(a + offsets, mask=m_rows, other=0.0)
    tl.store(a + offsets, tl.where(cols[None, :] > diag[:, None], 0.0, x).to(a.dtype.element_ty), mask=m_rows)


def zero_above_diagonal_(a: torch.Tensor, cu_seqlens: torch.Tensor | None) -> None:
    """Zero, in place, the entries above the diagonal of per-chunk matrices ``a`` ``[B, T, HV, C]``
    (row ``t`` of a chunk holds token ``t``'s row; chunks restart at every packed sequence's start).
    The entries on and below the diagonal keep their values."""
    if a.dim() != 4 or not a.is_contiguous():
        raise ValueError(f"a must be a contiguous [B, T, HV, C] tensor, got shape {list(a.shape)} and strides "
                         f"{a.stride()}")
    B, T, HV, C = a.shape
    R = B * T * HV
    if R == 0:
        return
    if C & (C - 1):
        raise ValueError(f"the chunk size C must be a power of two, got C={C}")
    row_in_chunk = a  # placeholder, never read without cu_seqlens
    if cu_seqlens is not None:
        starts = cu_seqlens.to(device=a.device, dtype=torch.long)
        t = torch.arange(T, device=a.device)
        seq = torch.searchsorted(starts[1:], t, right=True).clamp_(max=starts.numel() - 2)
        row_in_chunk = ((t - starts[seq]) % C).to(torch.int32)
    BR = max(1, ROW_ELEMENTS // C)
    zero_above_diagonal_kernel[(triton.cdiv(R, BR),)](a, row_in_chunk, R, T, HV, C=C, BR=BR,
                                                      VARLEN=cu_seqlens is not None, num_warps=NUM_WARPS)
