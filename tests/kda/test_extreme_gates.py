"""Gates of -inf (a full reset: legal in log space) and very negative finite gates (-1e30, -1e4, -200) reset
the state exactly: finite outputs that match the fp64 token recurrence at the usual tolerances, in the
reference math (CPU), our Triton prefill and decode kernels (CPU interpreter and CUDA), and on CUDA through
every backend of the public ops.

The reference sums each decay over its own span of gates (reference.py, ``_span_decays``): exact down to
-inf. Our Triton prefill floors each step at -150 in log2 units (2^-150 is 0 in fp32: a floored step is an
exact reset) and forms every decay from the sums of its own span (a sub-block's own gates, direct sums of
block sums across sub-blocks), never as a difference of cumulative sums that an earlier huge gate would
swamp; so with extreme gates it is as exact as without: held here to 2e-6 in fp32 (measured 1.3e-7; the
earlier difference-of-cumsums kernel measured 2.6e-5 on the same cases), and a reset makes the outputs after
it bitwise independent of everything before it.
"""
import importlib.util
import math
import os

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kda_compile.ops import chunk_kda, fused_recurrent_kda
from kda_compile.testing import KDAShape, kda_inputs, make_kda_args

from .draws import draws
from .recurrence import compare_with_recurrence

EXTREME = (float("-inf"), -1e30, -1e4, -200.0)
PATTERNS = ("token", "channels", "random", "run")


def with_extreme_gates(args, value, pattern, seed=0):
    """``args`` (a finished gate ``g``) with ``value`` at some gates: ``token`` (every channel of one token
    near the middle), ``channels`` (a quarter of the channels of every third token), ``random`` (20% of all
    gates), ``run`` (ten tokens in a row, every channel)."""
    g = args["g"].detach().clone()
    T = g.shape[1]
    gen = torch.Generator().manual_seed(seed)
    if T == 0:
        return args
    if pattern == "token":
        g[:, T // 2] = value
    elif pattern == "channels":
        g[:, ::3, :, : max(1, g.shape[-1] // 4)] = value
    elif pattern == "random":
        g[(torch.rand(g.shape, generator=gen) < 0.2).to(g.device)] = value
    else:
        g[:, T // 3: T // 3 + 10] = value
    out = type(args)(args)
    out["g"] = g.requires_grad_(args["g"].requires_grad)
    return out


def _drawn(max_T=80, **kw):
    return kda_inputs(max_T=max_T, heads=(1,), gva_ratios=(1, 2), key_dims=(16, 32), value_dims=(8, 16),
                      gate_forms=("precomputed",), dtypes=(torch.float32,), max_seqs=3, **kw)


# ------------------------------------------------------------------------------------------------
# Reference math (CPU)
# ------------------------------------------------------------------------------------------------
@settings(max_examples=draws(8))
@given(args=_drawn(), value=st.sampled_from(EXTREME), pattern=st.sampled_from(PATTERNS))
@example(args=make_kda_args(KDAShape(1, 70, 1, 1, 16, 8), seed=1, initial_state=True), value=float("-inf"),
         pattern="run")
def test_reference_chunk_matches_recurrence_with_gradients(args, value, pattern):
    compare_with_recurrence(chunk_kda, with_extreme_gates(args, value, pattern), with_grads=True)


@settings(max_examples=draws(8))
@given(args=_drawn(), value=st.sampled_from(EXTREME), pattern=st.sampled_from(PATTERNS),
       chunk_size=st.sampled_from((16, 32, 64)))
def test_reference_chunk_sizes_and_recurrent_op(args, value, pattern, chunk_size):
    args = with_extreme_gates(args, value, pattern)
    compare_with_recurrence(lambda **kw: chunk_kda(**kw, chunk_size=chunk_size), args, with_grads=False)
    with torch.no_grad():
        compare_with_recurrence(fused_recurrent_kda, args, with_grads=False)


@pytest.mark.parametrize("value", [1e30, 1e4])
def test_in_kernel_softplus_gate_of_huge_projection(value):
    # f = +1e30 makes g = -exp(A_log) * 1e30 per step inside the op: an exact reset, no NaN.
    args = make_kda_args(KDAShape(1, 70, 1, 2, 16, 8), seed=2, gate_form="softplus", initial_state=True)
    f = args["g"].clone()
    f[:, 20:30, :, :5] = value
    f[:, 50] = value
    args["g"] = f
    compare_with_recurrence(chunk_kda, args, with_grads=True)


def test_state_is_reset_exactly():
    # After a -inf gate on every channel the state no longer depends on anything before it: changing every
    # earlier token and the initial state leaves the outputs from the reset on, and the final state, unchanged
    # up to rounding (they are computed by other operations, so not bitwise), and finite.
    a = make_kda_args(KDAShape(1, 40, 1, 1, 16, 8), seed=3, initial_state=True)
    b = make_kda_args(KDAShape(1, 40, 1, 1, 16, 8), seed=4, initial_state=True)
    for args in (a, b):
        args["g"][:, 25] = float("-inf")
    for name in ("q", "k", "v", "g", "beta"):
        b[name][:, 25:] = a[name][:, 25:]
    (oa, sa), (ob, sb) = chunk_kda(**a), chunk_kda(**b)
    assert torch.isfinite(oa).all() and torch.isfinite(sa).all()
    torch.testing.assert_close(oa[:, 25:], ob[:, 25:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sa, sb, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Our Triton kernels, called directly (CPU: the interpreter; fixed small cases)
# ------------------------------------------------------------------------------------------------
def _triton_available() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"


triton_only = pytest.mark.skipif(not _triton_available(), reason="needs triton with CUDA or TRITON_INTERPRET=1")
TRITON_DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1" else "cpu"
if _triton_available():  # (imported here, not inside a drawn test: that module defines drawn tests itself)
    from .test_triton_decode import check as check_decode


@triton_only
@pytest.mark.parametrize("value, pattern", [(float("-inf"), "run"), (-1e30, "random"), (-1e4, "channels"),
                                            (float("-inf"), "token")])
def test_triton_prefill_extreme_gates(value, pattern):
    from .prefill_check import check
    args = make_kda_args(KDAShape(1, 70, 1, 1, 16, 16), seed=5, cu_seqlens=[0, 30, 70], initial_state=True,
                         device=TRITON_DEVICE)
    args["g"] = args["g"] * 0.05  # weak decays elsewhere: the terms spanning many tokens count
    check(with_extreme_gates(args, value, pattern))


# Drawn gate values: the floored ones (a reset: -inf .. about -104 nats) and huge finite ones above the floor,
# whose sub-blocks take the exact diagonal and the direct sums too (-100 nats: 2^-144 per step).
HUGE = EXTREME + (-100.0, -60.0)
# fp32 rounding of the kernel's products (interpreted: exact fp32); the difference-of-cumsums kernel measured
# 2.6e-5 on these inputs (weak decays elsewhere, so the terms spanning many tokens count).
EXACT_FP32 = dict(o=2e-6, final_state=2e-6)


def _small_prefill_args(seed, device=None, **kw):
    args = make_kda_args(KDAShape(1, 70, 1, 1, 16, 16), seed=seed, cu_seqlens=[0, 30, 70], initial_state=True,
                         device=device or TRITON_DEVICE, **kw)
    args["g"] = args["g"] * 0.05
    return args


@triton_only
@settings(deadline=None)
@given(value=st.sampled_from(HUGE), pattern=st.sampled_from(PATTERNS), seed=st.integers(0, 2 ** 16))
@example(value=float("-inf"), pattern="random", seed=0)
@example(value=-100.0, pattern="run", seed=1)
def test_triton_prefill_extreme_gates_are_exact(value, pattern, seed):
    from .prefill_check import check
    if TRITON_DEVICE != "cpu":  # TF32 products on the GPU: the usual tolerances (the CUDA tests below)
        return
    check(with_extreme_gates(_small_prefill_args(seed), value, pattern, seed=seed), tolerances=EXACT_FP32)


@triton_only
@pytest.mark.parametrize("value", [float("inf"), 1e30])
def test_triton_prefill_in_kernel_softplus_of_huge_projection(value):
    # f = +inf / +1e30 gives g = -inf / -exp(A_log) 1e30 per step inside the kernel: an exact reset.
    from .prefill_check import check
    args = make_kda_args(KDAShape(1, 70, 1, 2, 16, 16), seed=8, gate_form="softplus", initial_state=True,
                         device=TRITON_DEVICE)
    args["A_log"] = torch.full_like(args["A_log"], math.log(0.02))  # weak decays elsewhere
    f = args["g"].clone()
    f[:, 20:30, :, :5] = value
    f[:, 50] = value
    args["g"] = f
    check(args, tolerances=EXACT_FP32 if TRITON_DEVICE == "cpu" else None)


@triton_only
@pytest.mark.parametrize("reset_at", [25, 16, 64])
def test_triton_prefill_reset_is_exact(reset_at):
    # After a -inf gate on every channel, outputs from the reset on and the final state are bitwise those of a
    # call whose tokens before the reset (and initial state) differ: every term that spans the reset is an exact 0.
    # reset_at 25: mid sub-block; 16: a sub-block's first row; 64: a chunk's first token.
    from .prefill_check import triton_prefill
    a = make_kda_args(KDAShape(1, 90, 1, 1, 16, 16), seed=3, initial_state=True, device=TRITON_DEVICE)
    b = make_kda_args(KDAShape(1, 90, 1, 1, 16, 16), seed=4, initial_state=True, device=TRITON_DEVICE)
    for args in (a, b):
        args["g"] = args["g"] * 0.05
        args["g"][:, reset_at] = float("-inf")
    for name in ("q", "k", "v", "g", "beta"):
        b[name][:, reset_at:] = a[name][:, reset_at:]
    (oa, sa), (ob, sb) = triton_prefill(**a), triton_prefill(**b)
    assert torch.isfinite(oa).all() and torch.isfinite(sa).all()
    assert torch.equal(oa[:, reset_at:], ob[:, reset_at:])
    assert torch.equal(sa, sb)


@triton_only
@settings(deadline=None)
@given(value=st.sampled_from(HUGE + (float("inf"), 1e30)), pattern=st.sampled_from(PATTERNS),
       seed=st.integers(0, 2 ** 16), gate_form=st.sampled_from(("precomputed", "softplus")))
def test_triton_decode_extreme_gates_drawn(value, pattern, seed, gate_form):
    # The decode kernel multiplies the state by exp(g) token by token: exp(-inf) = 0 resets it exactly. A positive
    # value is a raw projection of the in-kernel softplus gate (g = -exp(A_log) softplus(f) = -inf / -1e30 ...).
    if gate_form == "precomputed" and value > 0:
        value = -value
    if gate_form == "softplus" and value < 0:
        value = -value
    args = make_kda_args(KDAShape(2, 6, 1, 2, 16, 16), seed=seed, initial_state=True, gate_form=gate_form,
                         device=TRITON_DEVICE)
    check_decode(with_extreme_gates(args, value, pattern, seed=seed))


@triton_only
@pytest.mark.parametrize("value", [float("-inf"), -1e30])
def test_triton_decode_extreme_gates(value):
    from .test_triton_decode import check
    args = make_kda_args(KDAShape(2, 6, 1, 2, 16, 16), seed=6, initial_state=True, device=TRITON_DEVICE)
    check(with_extreme_gates(args, value, "random"))


# ------------------------------------------------------------------------------------------------
# CUDA: every backend through the public ops (run on the GPU box)
# ------------------------------------------------------------------------------------------------
def _backend_op(op, name):
    from kda_compile.ops.kda.backends.registry import only_backends

    def call(**kw):
        with only_backends(name):
            return op(**kw)
    return call


CUDA_CHUNK_SHAPE = KDAShape(1, 200, 2, 4, 64, 64)


@pytest.mark.cuda
@settings(max_examples=draws(10), deadline=None)
@given(value=st.sampled_from(HUGE), pattern=st.sampled_from(PATTERNS), seed=st.integers(0, 2 ** 16),
       dtype=st.sampled_from((torch.bfloat16, torch.float32)))
def test_cuda_triton_prefill_extreme_gates(value, pattern, seed, dtype):
    # Our Triton prefill on the GPU, called directly (one packed shape per dtype: two compiles of each kernel).
    from .prefill_check import check
    args = make_kda_args(CUDA_CHUNK_SHAPE, seed=seed, dtype=dtype, cu_seqlens=[0, 70, 70, 200], initial_state=True,
                         device="cuda")
    args["g"] = args["g"] * 0.05
    check(with_extreme_gates(args, value, pattern, seed=seed))


@pytest.mark.cuda
@pytest.mark.parametrize("value, pattern", [(float("-inf"), "run"), (-1e30, "random"), (-100.0, "channels")])
def test_cuda_prefill_k128_extreme_gates_through_the_cuda_scan(monkeypatch, value, pattern):
    # bf16, K = V = 128: the Triton prepare (finished gates are outside the CUDA prepare's design) feeds the CUDA scan.
    from kda_compile.ops.kda.prefill.cuda import scan as cuda_scan

    from .prefill_check import check
    args = make_kda_args(KDAShape(1, 200, 1, 2, 128, 128), seed=9, dtype=torch.bfloat16, initial_state=True,
                         device="cuda")
    args["g"] = args["g"] * 0.05
    monkeypatch.setenv(cuda_scan.KERNEL_ENV, "cuda")
    check(with_extreme_gates(args, value, pattern))


# One shape (packed or not) per dtype: each new shape costs FLA a cold autotune of minutes on the GPU, so the
# draws vary the gates, their pattern, the data and the backend, not the sizes (CUDA_CHUNK_SHAPE, above).


@pytest.mark.cuda
@settings(max_examples=12, deadline=None)  # each draw with gradients runs the fp64 token loop: ~20 s on a busy host
@given(value=st.sampled_from(EXTREME), pattern=st.sampled_from(PATTERNS), seed=st.integers(0, 2 ** 16),
       backend=st.sampled_from(("triton_chunk", "fla", "reference")),
       dtype=st.sampled_from((torch.bfloat16, torch.float32)), packed=st.booleans())
def test_cuda_chunk_backends_extreme_gates(value, pattern, seed, backend, dtype, packed):
    if backend == "fla" and importlib.util.find_spec("fla") is None:
        return
    args = make_kda_args(CUDA_CHUNK_SHAPE, seed=seed, dtype=dtype, cu_seqlens=[0, 70, 70, 200] if packed else None,
                         initial_state=True, device="cuda")
    compare_with_recurrence(_backend_op(chunk_kda, backend), with_extreme_gates(args, value, pattern, seed=seed),
                            with_grads=backend != "triton_chunk")


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["triton_decode", "fla", "reference"])
@pytest.mark.parametrize("value", EXTREME)
def test_cuda_decode_backends_extreme_gates(backend, value):
    if backend == "fla" and importlib.util.find_spec("fla") is None:
        pytest.skip("fla-core is not installed")
    args = make_kda_args(KDAShape(3, 4, 2, 4, 64, 64), seed=7, initial_state=True, device="cuda")
    with torch.no_grad():
        compare_with_recurrence(_backend_op(fused_recurrent_kda, backend), with_extreme_gates(args, value, "random"),
                                with_grads=False)
