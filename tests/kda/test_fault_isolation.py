"""A bad token never corrupts good ones: NaN / Inf in q, k, v, g or beta of one sequence leave every other
sequence of a packed (cu_seqlens) or batched call, and their final states, bitwise unchanged, in every
implementation: the reference math (CPU), our Triton prefill and decode kernels (CPU under the Triton
interpreter, and CUDA), and on CUDA the public ops on each backend (Triton, the CUDA prepare / scan kernels,
FLA's kernels when installed).

Within the bad sequence, tokens before the start of the bad token's chunk (``chunk_size`` tokens counted
from the sequence's start) are unchanged too; the token-by-token decode kernel leaves every token before
the bad one unchanged.

Each comparison is against a call where the bad sequence holds other, finite values (a different seed), so
the good sequences are shown not to depend on the bad sequence's values at all.
"""
import importlib.util
import os

import pytest
import torch

from kda_compile.ops import chunk_kda, fused_recurrent_kda
from kda_compile.testing import KDAShape, make_kda_args

NAN, INF = float("nan"), float("inf")
INPUTS = ("q", "k", "v", "g", "beta")
# Sequences that start mid-chunk of the packed tokens (21, 45), one spanning two chunks (45 .. 120).
PACKED = [0, 21, 45, 120]
BATCH, BATCH_T = 3, 24
BAD_SEQ, BAD_OFFSET = 1, 5  # the poisoned token: sequence 1, its sixth token


def _triton_available() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"


def make_case(layout, *, device="cpu", dtype=torch.float32, K=16, V=16, H=1, HV=2, packed=PACKED, seed=0, **options):
    if layout == "packed":
        shape, cu = KDAShape(1, packed[-1], H, HV, K, V), packed
    else:
        shape, cu = KDAShape(BATCH, BATCH_T, H, HV, K, V), None
    options.setdefault("initial_state", True)
    return make_kda_args(shape, seed=seed, dtype=dtype, cu_seqlens=cu, device=device, **options)


def spans(args):
    """(batch index, token slice) of every sequence."""
    if args["cu_seqlens"] is not None:
        cu = args["cu_seqlens"].tolist()
        return [(0, slice(cu[n], cu[n + 1])) for n in range(len(cu) - 1)]
    return [(b, slice(0, args["q"].shape[1])) for b in range(args["q"].shape[0])]


def replace_sequence(args, other, seq, offset=0):
    """``args`` with the tokens of sequence ``seq`` from ``offset`` on taken from ``other``, in every token input
    (with ``offset = 0``, its initial state too)."""
    b, span = spans(args)[seq]
    tokens = slice(span.start + offset, span.stop)
    out = type(args)(args)
    for name in INPUTS:
        t = args[name].clone()
        t[b, tokens] = other[name][b, tokens]
        out[name] = t
    if args.get("initial_state") is not None and offset == 0:
        h0 = args["initial_state"].clone()
        h0[seq] = other["initial_state"][seq]
        out["initial_state"] = h0
    return out


def poison(args, name, value, seq=BAD_SEQ, offset=BAD_OFFSET):
    """``args`` with ``value`` at one token of sequence ``seq``: one channel of one head (beta: one head)."""
    b, span = spans(args)[seq]
    out = type(args)(args)
    t = args[name].clone()
    index = (b, span.start + offset, 0) if name == "beta" else (b, span.start + offset, 0, 0)
    t[index] = value
    out[name] = t
    return out


def assert_isolated(impl, args, name, value, *, chunk=64, token_by_token=False):
    """Against a call whose bad sequence holds other finite values from the bad token on: the other sequences
    (outputs and final states) bitwise equal, and the bad sequence's tokens before its bad token's chunk
    (before the bad token itself for a token-by-token kernel)."""
    other = make_case_like(args, seed=args.seed + 101)
    baseline = replace_sequence(args, other, BAD_SEQ, BAD_OFFSET)
    bad = poison(baseline, name, value)
    o_ref, s_ref = impl(**baseline)
    o_bad, s_bad = impl(**bad)
    for n, (b, span) in enumerate(spans(args)):
        if n == BAD_SEQ:
            clean = BAD_OFFSET if token_by_token else (BAD_OFFSET // chunk) * chunk
            kept = slice(span.start, span.start + clean)
            assert torch.equal(o_bad[b, kept], o_ref[b, kept]), f"{name}={value}: tokens before the bad chunk changed"
            assert not torch.equal(o_bad[b, span], o_ref[b, span]), "the poisoned call did not change its sequence"
            continue
        assert torch.equal(o_bad[b, span], o_ref[b, span]), f"{name}={value} in sequence {BAD_SEQ} changed sequence {n}"
        if s_ref is not None:
            assert torch.equal(s_bad[n], s_ref[n]), f"{name}={value} in sequence {BAD_SEQ} changed the state of {n}"


def make_case_like(args, seed):
    """Fresh finite values of the same shapes, dtype and device (another seed)."""
    fresh = make_kda_args(args.shape, seed=seed, dtype=args["q"].dtype, device=args["q"].device,
                          cu_seqlens=None if args["cu_seqlens"] is None else args["cu_seqlens"].tolist(),
                          gate_form=args.gate_form, initial_state=args["initial_state"] is not None,
                          qk_l2norm=args["use_qk_l2norm_in_kernel"], beta_sigmoid=args["use_beta_sigmoid_in_kernel"],
                          lower_bound=args["lower_bound"])
    return fresh


BAD_VALUES = [(name, NAN) for name in INPUTS] + [("q", INF), ("k", -INF), ("v", INF), ("g", INF), ("beta", -INF)]
_ids = [f"{n}={v}" for n, v in BAD_VALUES]


# ------------------------------------------------------------------------------------------------
# The reference math (what CPU runs, and CUDA's fallback)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["packed", "batched"])
@pytest.mark.parametrize("name, value", BAD_VALUES, ids=_ids)
@pytest.mark.parametrize("op", [chunk_kda, fused_recurrent_kda], ids=lambda op: op.__name__)
def test_reference_isolates_sequences(op, name, value, layout):
    assert_isolated(op, make_case(layout), name, value)


@pytest.mark.parametrize("name", INPUTS)
def test_reference_isolates_with_in_kernel_options(name):
    args = make_case("packed", gate_form="softplus", qk_l2norm=True, beta_sigmoid=True)
    assert_isolated(chunk_kda, args, name, NAN)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_reference_bad_token_reaches_nothing_before_its_chunk(chunk_size):
    # Sequence 1 is 75 tokens long; the bad token is its 71st: tokens before its chunk keep their values.
    args = make_case("packed", packed=[0, 21, 96, 120])
    other = make_case_like(args, seed=7)
    baseline = replace_sequence(args, other, BAD_SEQ)
    bad = poison(baseline, "k", NAN, offset=70)
    op = lambda **kw: chunk_kda(**kw, chunk_size=chunk_size)  # noqa: E731
    o_ref, _ = op(**baseline)
    o_bad, _ = op(**bad)
    start = 21 + (70 // chunk_size) * chunk_size
    assert torch.equal(o_bad[:, :start], o_ref[:, :start])
    assert not torch.isfinite(o_bad[:, 21 + 70]).all()


# ------------------------------------------------------------------------------------------------
# Our Triton kernels, called directly (CPU: the interpreter; small shapes, NaN in each input)
# ------------------------------------------------------------------------------------------------
triton_only = pytest.mark.skipif(not _triton_available(), reason="needs triton with CUDA or TRITON_INTERPRET=1")
TRITON_DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1" else "cpu"
TRITON_VALUES = [(name, NAN) for name in INPUTS] + [("v", INF)]


def _prefill(segments=None):
    from .prefill_check import triton_prefill
    return lambda **kw: triton_prefill(**kw, segments=segments)


def _decode():
    from .test_triton_decode import triton_decode
    return triton_decode


@triton_only
@pytest.mark.parametrize("layout", ["packed", "batched"])
@pytest.mark.parametrize("name, value", TRITON_VALUES, ids=[f"{n}={v}" for n, v in TRITON_VALUES])
def test_triton_prefill_isolates_sequences(name, value, layout):
    args = make_case(layout, device=TRITON_DEVICE, HV=1)
    assert_isolated(_prefill(), args, name, value)


@triton_only
@pytest.mark.parametrize("name", ["k", "g"])
def test_triton_prefill_isolates_with_in_kernel_options(name):
    args = make_case("packed", device=TRITON_DEVICE, HV=1, gate_form="softplus", qk_l2norm=True, beta_sigmoid=True)
    assert_isolated(_prefill(), args, name, NAN)


@triton_only
@pytest.mark.parametrize("layout", ["packed", "batched"])
@pytest.mark.parametrize("name, value", TRITON_VALUES, ids=[f"{n}={v}" for n, v in TRITON_VALUES])
def test_triton_decode_isolates_sequences(name, value, layout):
    args = make_case(layout, device=TRITON_DEVICE, packed=[0, 3, 9, 12], HV=1) if layout == "packed" else \
        make_case(layout, device=TRITON_DEVICE, HV=1)
    assert_isolated(_decode(), args, name, value, token_by_token=True)


# ------------------------------------------------------------------------------------------------
# CUDA: every backend through the public ops (run on the GPU box)
# ------------------------------------------------------------------------------------------------
def _with_backends(op, *names, **extra):
    from kda_compile.ops.kda.backends.registry import only_backends

    def call(**kw):
        with only_backends(*names):
            return op(**kw, **extra)
    return call


CUDA_VALUES = [(name, NAN) for name in INPUTS] + [("q", INF), ("v", INF), ("g", INF)]
_cuda_ids = [f"{n}={v}" for n, v in CUDA_VALUES]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", ["packed", "batched"])
@pytest.mark.parametrize("name, value", CUDA_VALUES, ids=_cuda_ids)
@pytest.mark.parametrize("backend", ["triton_chunk", "fla", "reference"])
def test_cuda_chunk_backends_isolate_sequences(backend, name, value, layout, dtype):
    if backend == "fla" and importlib.util.find_spec("fla") is None:
        pytest.skip("fla-core is not installed")
    args = make_case(layout, device="cuda", dtype=dtype, K=64, V=32, H=2, HV=4,
                     gate_form="softplus", qk_l2norm=True, beta_sigmoid=True)
    assert_isolated(_with_backends(chunk_kda, backend), args, name, value)


@pytest.mark.cuda
@pytest.mark.parametrize("gate_form", ["lower_bound", "softplus"])
@pytest.mark.parametrize("layout", ["packed", "batched"])
@pytest.mark.parametrize("name, value", CUDA_VALUES, ids=_cuda_ids)
def test_cuda_prepare_and_scan_kernels_isolate_sequences(monkeypatch, name, value, layout, gate_form):
    # The NVRTC kernels' design point: bf16, K = V = 128, an in-kernel gate (the bounded lower-bound gate, or
    # softplus through the wide-block form); both kernels forced on.
    monkeypatch.setenv("KDA_COMPILE_PREPARE_KERNEL", "cuda")
    monkeypatch.setenv("KDA_COMPILE_SCAN_KERNEL", "cuda")
    args = make_case(layout, device="cuda", dtype=torch.bfloat16, K=128, V=128, H=2, HV=2, gate_form=gate_form,
                     lower_bound=-5.0 if gate_form == "lower_bound" else None, qk_l2norm=True, beta_sigmoid=True)
    assert_isolated(_with_backends(chunk_kda, "triton_chunk"), args, name, value)


@pytest.mark.cuda
@pytest.mark.parametrize("name, value", CUDA_VALUES, ids=_cuda_ids)
def test_cuda_segmented_scan_isolates_sequences(name, value):
    # Two segments per sequence (summaries of the first carried into the second), sequences of 1-9 chunks.
    args = make_case("packed", device="cuda", packed=[0, 37, 600, 700], K=64, V=64, H=1, HV=2)
    assert_isolated(_prefill(segments=2), args, name, value)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", ["packed", "batched"])
@pytest.mark.parametrize("name, value", CUDA_VALUES, ids=_cuda_ids)
@pytest.mark.parametrize("backend", ["triton_decode", "fla", "reference"])
def test_cuda_decode_backends_isolate_sequences(backend, name, value, layout, dtype):
    if backend == "fla" and importlib.util.find_spec("fla") is None:
        pytest.skip("fla-core is not installed")
    args = make_case(layout, device="cuda", dtype=dtype, K=64, V=32, H=2, HV=4, packed=[0, 3, 9, 12],
                     gate_form="softplus", qk_l2norm=True, beta_sigmoid=True)
    with torch.no_grad():
        assert_isolated(_with_backends(fused_recurrent_kda, backend), args, name, value,
                        token_by_token=backend != "reference")
