"""GDN on our chunk kernels with the scalar gate (ops/gdn/prefill/run.py, prefill/backend.py; the prepare kernel's
``SCALAR_GATE`` form): on CPU the Triton prepare and scan under the Triton interpreter, through the public
function with ``only_backends("chunk_kernels")``, against the fp64 token loop; the backend's choice on the host.

Tolerance (relative RMS error against fp64, kda_compile.testing.rel_error): fp32 interpreted 1e-5 (exact fp32
products there; measured about 2e-7), fp16 5e-3 (the intermediates are stored in fp16, kda.md section 7). Extreme
gates (``-inf``, ``-1e30``, raw in-kernel gates of 1e30) are exact resets: same tolerances, outputs after a reset
bitwise independent of everything before it. NaN never passes.
"""
import pytest
import torch
from kda_compile.ops import chunk_gated_delta_rule
from kda_compile.ops._common import clear_fallback_events, fallback_events
from kda_compile.ops.gdn.prefill import backend as chunk_backend
from kda_compile.ops.gdn.backends import fla as fla_backend
from kda_compile.ops.gdn.backends.registry import only_backends, select_backend
from kda_compile.ops.gdn.custom_ops import _options
from triton_device import INTERPRETED, triton_device

from kda_compile.testing import KDAShape, assert_rel_close, make_gdn_args
from tests.gdn.helpers import expected_fp64

DEVICE = triton_device("the GDN chunk kernels")
CUDA = torch.device("cuda")
# float32: exact products interpreted on CPU; TF32 products on CUDA (3-4e-4 measured on an H200)
TOL = {torch.float32: 1e-5 if INTERPRETED else 3e-3, torch.float16: 5e-3, torch.bfloat16: 5e-3}
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

# (id, shape (B, T, H, HV, K, V), cu_seqlens, options for make_gdn_args)
CASES = [
    ("T1-batch2-state", KDAShape(2, 1, 1, 1, 32, 16), None, dict(initial_state=True)),
    ("T70-grouped-in-kernel-l2norm", KDAShape(1, 70, 1, 2, 32, 16), None,
     dict(gate_form="in_kernel", qk_l2norm=True, beta_sigmoid=True, initial_state=True)),
    ("batch2-T65-K160-l2norm-slices", KDAShape(2, 65, 2, 2, 160, 24), None, dict(qk_l2norm=True, initial_state=True)),
    ("packed-0-1-token-neg-eigval", KDAShape(1, 80, 1, 2, 48, 32), [0, 0, 1, 1, 80],
     dict(beta_sigmoid=True, allow_neg_eigval=True, initial_state=True, state_v_first=True)),
    ("packed-in-kernel-no-dt-bias", KDAShape(1, 90, 2, 4, 16, 16), [0, 30, 30, 90],
     dict(gate_form="in_kernel", dt_bias=False, qk_l2norm=True, beta_sigmoid=True)),
]


def _run(args):
    q, v = args["q"], args["v"]
    clear_fallback_events()
    with only_backends("chunk_kernels"), torch.no_grad():
        chosen = select_backend("chunk_gdn", q.device, q.dtype, q.shape[-1], v.shape[-1], _options(1.0, *[False] * 4))
        assert chosen.name == "chunk_kernels"
        out = chunk_gated_delta_rule(**args)
    assert not fallback_events(), [e.reason for e in fallback_events()]
    return out


def _check(args, o, final):
    o_ref, final_ref = expected_fp64(args)
    tol = TOL[args["q"].dtype]
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    assert_rel_close(o, o_ref, tol, name="o")
    assert_rel_close(final, final_ref, max(tol, 1e-6), name="final_state")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_recurrence(case):
    _, shape, cu, options = case
    args = make_gdn_args(shape, seed=3, dtype=torch.float32, device=DEVICE, cu_seqlens=cu, **options)
    _check(args, *_run(args))


def test_float16_matches_recurrence():
    args = make_gdn_args(KDAShape(1, 70, 1, 2, 32, 32), seed=4, dtype=torch.float16, device=DEVICE,
                         gate_form="in_kernel", qk_l2norm=True, beta_sigmoid=True, initial_state=True)
    _check(args, *_run(args))


def _extreme(args, values):
    """The gate with ``values`` written at tokens 5, 17, 40 (chunk 0) and 66 (chunk 1) of every value head."""
    g = args["g"].detach().clone()
    for t, value in zip((5, 17, 40, 66), values):
        if t < g.shape[1]:
            g[:, t] = value
    return {**args, "g": g}


@pytest.mark.parametrize("values", [(float("-inf"),) * 4, (-1e30, -1e4, float("-inf"), -200.0)],
                         ids=["minus-inf", "huge"])
def test_extreme_finished_gates_are_exact(values):
    args = make_gdn_args(KDAShape(1, 90, 1, 2, 32, 16), seed=5, dtype=torch.float32, device=DEVICE,
                         qk_l2norm=True, beta_sigmoid=True, initial_state=True)
    _check(_extreme(args, values), *_run(_extreme(args, values)))


def test_extreme_in_kernel_gates_are_exact():
    """Raw gates of 1e30 through ``-exp(A_log) * softplus(g + dt_bias)`` (softplus = x above 20): -inf-like
    decays from the in-kernel gate, and a packed sequence with them."""
    args = make_gdn_args(KDAShape(1, 90, 1, 2, 32, 16), seed=6, dtype=torch.float32, device=DEVICE,
                         cu_seqlens=[0, 10, 90], gate_form="in_kernel", qk_l2norm=True, beta_sigmoid=True,
                         initial_state=True)
    extreme = _extreme(args, (1e30, 1e30, 1e6, 1e30))
    _check(extreme, *_run(extreme))


def test_a_reset_forgets_everything_before_it():
    """After a ``-inf`` gate at token 40, the outputs from token 40 on (the rest of its chunk and the next one) and
    the final state do not depend, bitwise, on any input before it."""
    args = make_gdn_args(KDAShape(1, 100, 1, 2, 32, 16), seed=7, dtype=torch.float32, device=DEVICE,
                         qk_l2norm=True, beta_sigmoid=True, initial_state=True)
    g = args["g"].detach().clone()
    g[:, 40] = float("-inf")
    first = _run({**args, "g": g})
    other = make_gdn_args(KDAShape(1, 100, 1, 2, 32, 16), seed=8, dtype=torch.float32, device=DEVICE,
                          qk_l2norm=True, beta_sigmoid=True, initial_state=True)
    mixed = {name: (value.detach().clone() if torch.is_tensor(value) else value) for name, value in args.items()}
    for name in ("q", "k", "v", "beta"):
        mixed[name][:, :40] = other[name][:, :40]
    g2 = g.clone()
    g2[:, :40] = other["g"][:, :40]
    mixed["g"], mixed["initial_state"] = g2, other["initial_state"]
    second = _run(mixed)
    assert torch.equal(first[0][:, 40:], second[0][:, 40:])
    assert torch.equal(first[1], second[1])


def test_a_bad_sequence_leaves_the_others_alone():
    """NaN in one packed sequence's inputs: every other sequence's outputs and final state are bitwise those of a
    call where that sequence is finite."""
    cu = [0, 21, 45, 120]
    args = make_gdn_args(KDAShape(1, 120, 1, 2, 32, 16), seed=9, dtype=torch.float32, device=DEVICE,
                         cu_seqlens=cu, gate_form="in_kernel", qk_l2norm=True, beta_sigmoid=True, initial_state=True)
    clean = _run(args)
    for name in ("q", "k", "v", "g", "beta"):
        bad = {n: (t.detach().clone() if torch.is_tensor(t) else t) for n, t in args.items()}
        bad[name][:, 30] = float("nan")  # sequence 1
        o, final = _run(bad)
        for n, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
            if n == 1:
                continue
            assert torch.equal(o[:, start:end], clean[0][:, start:end]), (name, n)
            assert torch.equal(final[n], clean[1][n]), (name, n)


# ---- the backend's choice (host only) ------------------------------------------------------------------------
def test_serves_cuda_inference_of_its_design_first():
    inference, training = (_options(1.0, False, True, True, False, training=t) for t in (False, True))
    backend = chunk_backend.ChunkKernelsBackend()
    for dtype in (torch.bfloat16, torch.float16):
        assert backend.unsupported_reason(CUDA, dtype, 128, 128, inference) is None
        assert select_backend("chunk_gdn", CUDA, dtype, 128, 128, inference).name == "chunk_kernels"
    assert "inference only" in backend.unsupported_reason(CUDA, torch.bfloat16, 128, 128, training)
    assert select_backend("chunk_gdn", CUDA, torch.bfloat16, 128, 128, training).name != "chunk_kernels"
    assert "designed for" in backend.unsupported_reason(CUDA, torch.float32, 128, 128, inference)
    assert "designed for" in backend.unsupported_reason(CUDA, torch.bfloat16, 64, 128, inference)
    assert "needs CUDA" in backend.unsupported_reason(torch.device("cpu"), torch.bfloat16, 128, 128, inference)
    assert "fused_recurrent_gdn" not in backend.serves
    assert backend.in_design(CUDA, torch.bfloat16, 128, 128, inference)
    assert not backend.in_design(CUDA, torch.bfloat16, 128, 128, training)
    assert not backend.in_design(CUDA, torch.float32, 128, 128, inference)
    with only_backends("chunk_kernels"):
        assert backend.unsupported_reason(torch.device("cpu"), torch.float32, 60, 100, inference) is None


def test_calls_outside_its_design_are_not_fallbacks(monkeypatch):
    """Training and other widths go to FLA as before this backend existed: nothing is recorded."""
    monkeypatch.setattr(fla_backend, "_load_fla", lambda: (object(), None))
    monkeypatch.setattr(fla_backend, "_backward_refusal", lambda: None)
    clear_fallback_events()
    training = _options(1.0, False, True, True, False, training=True)
    assert select_backend("chunk_gdn", CUDA, torch.bfloat16, 128, 128, training).name == "fla"
    inference = _options(1.0, False, True, True, False)
    assert select_backend("chunk_gdn", CUDA, torch.float32, 64, 64, inference).name == "fla"
    assert not fallback_events()


def test_fla_reuses_kdas_chunk_index_cache(monkeypatch):
    """GDN's FLA backend takes KDA's chunk indices: with ``cu_seqlens_cpu`` they are computed once per offsets
    (no synchronisation on later calls), without it on every call."""
    calls = []

    def prepare(cu_seqlens, chunk_size, cu_seqlens_cpu=None):
        calls.append(cu_seqlens_cpu is not None)
        return torch.zeros(1)
    fla = {"prepare_chunk_indices": prepare}
    opts = _options(1.0, False, False, False, False, chunk_size=64)
    offsets = [0, 7, 130, 131]
    cu, cu_cpu = torch.tensor(offsets), torch.tensor(offsets)
    backend = fla_backend.FLAGDNBackend()
    first = backend._chunk_indices(fla, cu, opts, cu_cpu)
    assert backend._chunk_indices(fla, cu, opts, cu_cpu) is first and calls == [True]
    backend._chunk_indices(fla, cu, opts)
    assert calls == [True, False]
    assert backend._chunk_indices(fla, None, opts, None) is None


@pytest.mark.parametrize("per_channel_only", [dict(lower_bound=-5.0), dict(save_residuals=True)], ids=str)
def test_scalar_gate_launcher_refuses_per_channel_options(per_channel_only):
    """GDN runs KDA's launcher with ``scalar_gate=True``: the lower-bound gate and FLA's residuals belong to the
    per-channel gate and are refused before any launch."""
    from kda_compile.ops.kda.prefill.run import chunk_kda_prefill

    x = torch.zeros(1, 4, 1, 16)
    with pytest.raises(ValueError, match="scalar gate takes no lower_bound and saves no residuals"):
        chunk_kda_prefill(x, x, x, x[..., 0], x[..., 0], None, None, None, None, scale=1.0, output_final_state=False,
                          scalar_gate=True, **per_channel_only)
