"""glm5_next's pool-forming kernel (``ops/dsa/pooled/triton_keys.py``) against the torch reference
``pooled.pooled_keys``: the same validity bits, pool keys within rounding (float32 1e-6, float16 one unit in
the last place: 2e-3 relative), on drawn widths, pool sizes (powers of two or not), left padding and holes.

Runs on CUDA, or on CPU under the Triton interpreter.
"""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_compile.ops.dsa.pooled.reference import first_valid, pooled_keys
from kda_compile.testing import assert_rel_close

from .pooled_naive import KEY_MASK_FORMS, drawn_key_mask

from triton_device import triton_device  # noqa: E402

DEVICE = triton_device("the DSA pool-forming kernel")

from kda_compile.ops.dsa.pooled.triton_keys import pooled_keys_triton  # noqa: E402

TOL = {torch.float32: 1e-6, torch.float16: 2e-3}


@st.composite
def pool_cases(draw):
    b = draw(st.integers(1, 3))
    pool = draw(st.sampled_from([1, 3, 4, 16]))
    t = draw(st.integers(1, 5 * pool + 7))
    d = draw(st.sampled_from([8, 20, 32]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, t, d, generator=g).to(dtype)
    gate = (torch.randn(b, t, d, generator=g) * 3).to(dtype)
    ape = torch.randn(pool, d, generator=g).to(dtype)
    return k, gate, drawn_key_mask(draw(st.sampled_from(KEY_MASK_FORMS)), b, t, g), ape


@settings(max_examples=25, deadline=None)
@given(pool_cases())
def test_pool_keys_match_reference(case):
    k, gate, valid, ape = case
    first = first_valid(valid)
    want_pk, want_valid = pooled_keys(k.double(), gate.double(), valid, ape.double(), first)
    ref_pk, ref_valid = pooled_keys(k, gate, valid, ape, first)
    dev = [x.to(DEVICE) for x in (k, gate, valid, ape, first)]
    pk, pool_valid = pooled_keys_triton(*dev)
    assert pk.dtype == k.dtype and pk.shape == ref_pk.shape
    assert torch.equal(pool_valid.cpu(), ref_valid) and torch.equal(ref_valid, want_valid)
    assert not torch.isnan(pk).any()
    assert_rel_close(pk.cpu(), ref_pk, TOL[k.dtype], name="pk", floor=1e-6)
    # as close to the float64 pools as the reference is (both round the products to k's dtype)
    ref_err = (ref_pk.double() - want_pk).norm()
    assert float((pk.cpu().double() - want_pk).norm()) <= 2 * float(ref_err) + 1e-6 * float(want_pk.norm()) + 1e-12


def test_strided_inputs():
    """Keys, gates and the position embedding as strided views."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 40, 64, generator=g)[:, :, ::2]
    gate = torch.randn(2, 64, 40, generator=g).transpose(1, 2)[:, :, :32]
    valid = torch.rand(2, 40, generator=g) > 0.1
    ape = torch.randn(32, 4, generator=g).t()  # [4, 32], transposed
    first = first_valid(valid)
    ref_pk, ref_valid = pooled_keys(k, gate, valid, ape, first)
    pk, pool_valid = pooled_keys_triton(*(x.to(DEVICE) for x in (k, gate, valid, ape, first)))
    assert torch.equal(pool_valid.cpu(), ref_valid)
    assert_rel_close(pk.cpu(), ref_pk, 1e-6, name="pk", floor=1e-6)


@settings(max_examples=10, deadline=None)
@given(pool_cases())
def test_no_key_mask_equals_a_mask_of_every_key(case):
    """``key_valid`` None (the kernel reads no mask and no first key): bit for bit the pools of a mask that keeps
    every key, in the kernel and in the reference."""
    k, gate, _, ape = case
    every = torch.ones(k.shape[:2], dtype=torch.bool)
    zeros = torch.zeros(k.shape[0], dtype=torch.long)
    dev = lambda *xs: [x.to(DEVICE) for x in xs]  # noqa: E731
    pk, pool_valid = pooled_keys_triton(*dev(k, gate), None, *dev(ape, zeros))
    want_pk, want_valid = pooled_keys_triton(*dev(k, gate, every, ape, first_valid(every)))
    assert torch.equal(pk, want_pk) and torch.equal(pool_valid, want_valid)
    ref = pooled_keys(k, gate, None, ape, zeros)
    ref_all = pooled_keys(k, gate, every, ape, first_valid(every))
    assert torch.equal(ref[0], ref_all[0]) and torch.equal(ref[1], ref_all[1])
