"""Fault isolation over drawn calls (the parametrised cases of ``test_fault_isolation.py``, generalised):
hypothesis draws the layout (packed sequences of 0 to 150 tokens, empty and 1-token ones included, or a
batch), which sequence holds the bad token and where, which input, head and channel, the bad value, the gate
form and, on CUDA, the backend and dtype. The property: every other sequence (outputs and final state) is
bitwise unchanged, and the bad sequence's tokens before the start of the bad token's 64-token chunk (before
the bad token itself for token-by-token kernels) are bitwise unchanged.

The CPU run checks the reference math; the GPU box runs the CUDA variant over every backend, with the
``thorough`` profile for many draws (``tests/kda/draws.py``).
"""
import contextlib
import importlib.util
import os
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_compile.ops import chunk_kda, fused_recurrent_kda
from kda_compile.testing import GATE_FORMS, KDAShape, make_kda_args

from .draws import draws
from .test_fault_isolation import INPUTS, make_case_like, replace_sequence, spans

CHUNK = 64
_LENGTHS = st.one_of(st.sampled_from((0, 1, 2, 63, 64, 65, 128)), st.integers(0, 150))


@st.composite
def bad_calls(draw, *, max_seqs=5):
    """(layout sizes, bad sequence, offset, input name, head, channel, value)."""
    if draw(st.booleans()):
        lengths = draw(st.lists(_LENGTHS, min_size=2, max_size=max_seqs))
        if not any(lengths):
            lengths[draw(st.integers(0, len(lengths) - 1))] = draw(st.integers(1, 150))
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        layout = {"batch": 1, "T": cu[-1], "cu_seqlens": cu}
    else:
        lengths = [draw(st.integers(1, 130))] * draw(st.integers(2, 4))
        layout = {"batch": len(lengths), "T": lengths[0], "cu_seqlens": None}
    seq = draw(st.sampled_from([n for n, length in enumerate(lengths) if length > 0]))
    offset = draw(st.integers(0, lengths[seq] - 1))
    name = draw(st.sampled_from(INPUTS))
    # -inf in g is a legal reset (test_extreme_gates.py), and in a sigmoid beta a legal 0: not faults.
    values = (float("nan"), float("inf")) if name in ("g", "beta") else (float("nan"), float("inf"), float("-inf"))
    value = draw(st.sampled_from(values))
    return layout, seq, offset, name, draw(st.integers(0, 1 << 10)), draw(st.integers(0, 1 << 10)), value


def poison_at(args, name, value, seq, offset, head, channel):
    b, span = spans(args)[seq]
    t = args[name].clone()
    h = head % t.shape[2]
    index = (b, span.start + offset, h) if name == "beta" else (b, span.start + offset, h, channel % t.shape[3])
    t[index] = value
    out = type(args)(args)
    out[name] = t
    return out


def assert_drawn_isolated(impl, args, bad_call, *, token_by_token=False):
    _, seq, offset, name, head, channel, value = bad_call
    other = make_case_like(args, seed=args.seed + 101)
    baseline = replace_sequence(args, other, seq, offset)
    bad = poison_at(baseline, name, value, seq, offset, head, channel)
    o_ref, s_ref = impl(**baseline)
    o_bad, s_bad = impl(**bad)
    assert torch.isfinite(o_ref).all(), "the finite baseline call is not finite"
    where = f"{name}={value} at token {offset} of sequence {seq}"
    for n, (b, span) in enumerate(spans(args)):
        if n == seq:
            clean = offset if token_by_token else (offset // CHUNK) * CHUNK
            kept = slice(span.start, span.start + clean)
            assert torch.equal(o_bad[b, kept], o_ref[b, kept]), f"{where}: tokens before its chunk changed"
            continue
        assert torch.equal(o_bad[b, span], o_ref[b, span]), f"{where} changed sequence {n}'s outputs"
        if s_ref is not None:
            assert torch.equal(s_bad[n], s_ref[n]), f"{where} changed sequence {n}'s final state"


def _args(layout, *, seed, device="cpu", dtype=torch.float32, K=16, V=16, H=1, HV=2, **options):
    shape = KDAShape(layout["batch"], layout["T"], H, HV, K, V)
    return make_kda_args(shape, seed=seed, dtype=dtype, cu_seqlens=layout["cu_seqlens"], device=device,
                         initial_state=True, **options)


@settings(max_examples=draws(12), deadline=None)
@given(bad_call=bad_calls(), seed=st.integers(0, 2 ** 16), gate_form=st.sampled_from(GATE_FORMS),
       op=st.sampled_from((chunk_kda, fused_recurrent_kda)))
def test_reference_isolates_drawn_faults(bad_call, seed, gate_form, op):
    args = _args(bad_call[0], seed=seed, gate_form=gate_form, qk_l2norm=gate_form != "precomputed",
                 beta_sigmoid=gate_form != "precomputed")
    assert_drawn_isolated(op, args, bad_call)


# ------------------------------------------------------------------------------------------------
# CUDA: every backend through the public ops (run on the GPU box)
# ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _backend(name):
    """Only backend ``name`` (and the reference) serves the call; ``cuda_kernels``: the Triton chunk backend
    with our NVRTC prepare and scan kernels forced on."""
    from kda_compile.ops.kda.prefill.cuda import prepare as cuda_prepare
    from kda_compile.ops.kda.prefill.cuda import scan as cuda_scan
    from kda_compile.ops.kda.backends.registry import only_backends

    forced = (cuda_prepare.KERNEL_ENV, cuda_scan.KERNEL_ENV) if name == "cuda_kernels" else ()
    with mock.patch.dict(os.environ, dict.fromkeys(forced, "cuda")), \
            only_backends("triton_chunk" if name == "cuda_kernels" else name):
        yield


def _call(op, backend):
    def call(**kw):
        with _backend(backend), torch.no_grad():
            return op(**kw)
    return call


CUDA_PREFILL = ("triton_chunk", "cuda_kernels", "fla", "reference")
CUDA_DECODE = ("triton_decode", "fla", "reference")


@pytest.mark.cuda
@settings(max_examples=draws(24), deadline=None)
@given(bad_call=bad_calls(), seed=st.integers(0, 2 ** 16), data=st.data())
def test_cuda_backends_isolate_drawn_faults(bad_call, seed, data):
    prefill = data.draw(st.booleans(), label="prefill")
    backend = data.draw(st.sampled_from(CUDA_PREFILL if prefill else CUDA_DECODE), label="backend")
    if backend == "fla" and importlib.util.find_spec("fla") is None:
        return
    if backend == "cuda_kernels":  # the NVRTC kernels' design point
        args = _args(bad_call[0], seed=seed, device="cuda", dtype=torch.bfloat16, K=128, V=128, H=2, HV=2,
                     gate_form="lower_bound", lower_bound=-5.0, qk_l2norm=True, beta_sigmoid=True)
    else:
        dtype = data.draw(st.sampled_from((torch.bfloat16, torch.float32)), label="dtype")
        gate_form = data.draw(st.sampled_from(GATE_FORMS), label="gate_form")
        args = _args(bad_call[0], seed=seed, device="cuda", dtype=dtype, K=64, V=32, H=2, HV=4,
                     gate_form=gate_form, qk_l2norm=True, beta_sigmoid=True)
    op = chunk_kda if prefill else fused_recurrent_kda
    assert_drawn_isolated(_call(op, backend), args, bad_call,
                          token_by_token=not prefill and backend != "reference")
