"""The Triton kernels of the FLA path (ops/kda/backends/fla_glue.py): the row L2 norm, its backward, and
the zeroing of the triangles above the diagonal of per-chunk blocks, against torch math in float64.

Runs on CUDA, or on CPU under the Triton interpreter. Tolerances (relative error): the kernels compute
in float32, so the float64 reference is met to float32 rounding (1e-6) for float32 inputs and to half
an ulp of the stored dtype for the others (float16 1e-3, bfloat16 8e-3).
"""

import pytest
import torch
from hypothesis import given, strategies as st

from kda_compile.testing import assert_rel_close

from triton_device import triton_device  # noqa: E402

DEVICE = triton_device("the Triton glue kernels")

from kda_compile.ops.kda.backends.fla_glue import L2NORM_EPS, l2norm_bwd, l2norm_fwd, zero_above_diagonal_  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _l2norm_reference(x: torch.Tensor):
    x = x.double().requires_grad_()
    rstd = (x.square().sum(-1) + L2NORM_EPS).rsqrt()
    return x, x * rstd[..., None], rstd


@pytest.mark.parametrize("dtype", DTYPES)
@given(rows=st.integers(0, 70), D=st.sampled_from([1, 8, 24, 64, 100, 128, 256]), seed=st.integers(0, 2**16))
def test_l2norm_forward_and_backward_match_float64(dtype, rows, D, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 2, D, generator=gen) * 3).to(DEVICE, dtype)
    dy = torch.randn(rows, 2, D, generator=gen).to(DEVICE, dtype)
    y, rstd = l2norm_fwd(x)
    assert y.dtype == dtype and y.shape == x.shape and rstd.dtype == torch.float32 and rstd.shape == x.shape[:-1]
    dx = l2norm_bwd(y, rstd, dy)
    assert dx.dtype == dtype and dx.shape == x.shape
    if rows == 0:
        return
    leaf, y_ref, rstd_ref = _l2norm_reference(x)
    (dx_ref,) = torch.autograd.grad(y_ref, leaf, dy.double())
    assert_rel_close(y.double(), y_ref, TOL[dtype], name="y")
    assert_rel_close(rstd.double(), rstd_ref, 1e-6, name="rstd")
    # dx is computed from the rounded y: a further rounding of y's dtype. dx = rstd (dy - y (dy . y)) cancels
    # (exactly for D = 1), so its error is judged against the size of the terms, ||rstd dy||.
    terms = torch.linalg.vector_norm(rstd_ref.detach()[..., None] * dy.double()).item()
    assert_rel_close(dx.double(), dx_ref, 2 * TOL[dtype], name="dx", floor=terms)


def test_l2norm_of_zero_rows_is_zero_and_finite():
    x = torch.zeros(3, 128, device=DEVICE)
    y, rstd = l2norm_fwd(x)
    dx = l2norm_bwd(y, rstd, torch.ones_like(x))
    assert not y.any() and torch.isfinite(rstd).all() and torch.isfinite(dx).all()


def test_l2norm_rejects_what_it_cannot_take():
    with pytest.raises(ValueError, match="x must be contiguous"):
        l2norm_fwd(torch.randn(4, 8, device=DEVICE).t())
    with pytest.raises(ValueError, match="y, rstd and dy must have shapes"):
        l2norm_bwd(torch.randn(4, 8, device=DEVICE), torch.randn(4, device=DEVICE), torch.randn(4, 9, device=DEVICE))


def _row_in_chunk(T: int, chunk: int, cu_seqlens) -> torch.Tensor:
    """Each token's row in its chunk; chunks restart at every sequence start."""
    starts = [0] if cu_seqlens is None else cu_seqlens[:-1]
    return torch.tensor([(t - max(s for s in starts if s <= t)) % chunk for t in range(T)])


@pytest.mark.parametrize("cu_seqlens", [None, [0, 0, 5, 70, 70, 90]], ids=["batched", "packed"])
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_zero_above_diagonal_zeroes_only_the_upper_triangles(cu_seqlens, chunk, dtype):
    B = 2 if cu_seqlens is None else 1
    T, HV = 90, 3
    a = (torch.randn(B, T, HV, chunk, device=DEVICE) + 10).to(dtype)  # no entry is zero beforehand
    before = a.clone()
    zero_above_diagonal_(a, None if cu_seqlens is None else torch.tensor(cu_seqlens, device=DEVICE))
    above = (torch.arange(chunk)[None, :] > _row_in_chunk(T, chunk, cu_seqlens)[:, None])[None, :, None, :]
    above = above.expand(B, T, HV, chunk).to(DEVICE)
    assert not a[above].any()
    assert torch.equal(a[~above], before[~above])


def test_zero_above_diagonal_rejects_what_it_cannot_take():
    with pytest.raises(ValueError, match="a must be a contiguous"):
        zero_above_diagonal_(torch.zeros(1, 8, 2, 16, device=DEVICE).transpose(1, 2), None)
    with pytest.raises(ValueError, match="power of two"):
        zero_above_diagonal_(torch.zeros(1, 8, 2, 24, device=DEVICE), None)
