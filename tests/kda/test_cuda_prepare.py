"""The CUDA prepare kernel (ops/kda/prefill/cuda/prepare*.py): its choice and fallbacks (CPU), and on CUDA its
intermediates against the Triton prepare kernel's, ``A_qk`` and the inverse against float64, the whole
forward against the fp64 recurrence, and repeatability."""
import math
import os

import pytest
import torch

from kda_compile.ops._common import clear_fallback_events, fallback_events
from kda_compile.ops.kda.prefill.cuda import prepare as cuda_prepare
from kda_compile.ops.kda.prefill.cuda import prepare_source as src
from kda_compile.ops.kda.reference import kda_gate, kda_reference, l2norm
from kda_compile.ops.kda.prefill.triton.prepare import MAX_BOUNDED_DECAY
from kda_compile.testing import rel_error

from .recurrence import tolerances_for

K = V = 128
LB = -5.0
cuda = pytest.mark.cuda


# ---- CPU: source generation, choice, fallbacks ---------------------------------------------------------
def test_source_rejects_unknown_dtypes_by_name():
    base = dict(g_dtype="bf16", beta_dtype="bf16", cu_dtype="int", varlen=False, l2norm=True, has_a_log=True,
                has_dt_bias=True, beta_sigmoid=True, save_akk=False)
    assert "kda_prepare_mma" in src.kernel_source(**base)
    with pytest.raises(ValueError, match="g_dtype must be one of"):
        src.kernel_source(**{**base, "g_dtype": "f16"})
    with pytest.raises(ValueError, match="cu_dtype must be"):
        src.kernel_source(**{**base, "cu_dtype": "short"})


def test_three_ctas_fit_an_sm():
    """The kernel is laid out for three resident CTAs on an H100 (228 KiB of shared memory, 1 KiB reserved
    per CTA); the launch bounds ask the compiler for registers to match."""
    assert 3 * (src.SHARED_BYTES + 1024) <= 228 * 1024
    assert "__launch_bounds__(128, 3)" in src.kernel_source(
        g_dtype="f32", beta_dtype="f32", cu_dtype="long long", varlen=True, l2norm=False, has_a_log=False,
        has_dt_bias=False, beta_sigmoid=False, save_akk=True)


def test_requested_kernel_validates_the_environment(monkeypatch):
    monkeypatch.setenv(cuda_prepare.KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="KDA_COMPILE_PREPARE_KERNEL must be one of auto, triton, cuda, got 'fast'"):
        cuda_prepare.requested_kernel()


def test_forced_cuda_outside_the_design_runs_triton_and_records_why(monkeypatch):
    q = torch.zeros(1, 4, 1, K, dtype=torch.bfloat16)
    v = torch.zeros(1, 4, 1, V, dtype=torch.bfloat16)
    g, beta = torch.zeros(1, 4, 1, K), torch.zeros(1, 4, 1)
    clear_fallback_events()
    monkeypatch.setenv(cuda_prepare.KERNEL_ENV, "auto")
    assert cuda_prepare.choose_prepare_kernel(q, q, v, g, beta, None, True, LB) == "triton"
    assert not fallback_events()  # auto: Triton is the kernel for CPU tensors, not a fallback
    monkeypatch.setenv(cuda_prepare.KERNEL_ENV, "cuda")
    assert cuda_prepare.choose_prepare_kernel(q, q, v, g, beta, None, True, LB) == "triton"
    reasons = [e.reason for e in fallback_events()]
    assert reasons == ["the CUDA prepare kernel cannot run this call: not a CUDA tensor"]
    clear_fallback_events()


def test_the_gate_form_picks_pass_one_only():
    """KDA's per-channel and GDN's scalar gate share the kernel's prologue, inverse and pass 2: their sources differ
    in the compile-time switch that picks pass 1 (and the per-channel pass's early slice copies) alone."""
    base = dict(g_dtype="bf16", beta_dtype="bf16", cu_dtype="int", varlen=True, l2norm=True, has_a_log=True,
                has_dt_bias=True, beta_sigmoid=True, save_akk=False)
    channel, scalar = src.kernel_source(**base), src.kernel_source(**base, scalar_gate=True)
    assert "#define SCALAR_GATE 0\n" in channel
    assert channel.replace("#define SCALAR_GATE 0\n", "#define SCALAR_GATE 1\n") == scalar
    assert src.kernel_source(**base, scalar_gate=False) == channel


def test_gate_forms_in_the_design(monkeypatch):
    """GDN's scalar gate in every form (finished or in-kernel softplus: its exponents are exact for any gate) and
    KDA's in-kernel gates of any strength (softplus, any lower bound) are in the CUDA kernel's design; KDA's
    finished gates are not (their exact resets take the Triton kernel)."""
    monkeypatch.setattr(cuda_prepare, "device_unsupported", lambda x: None)  # the device checks are tested above
    q = torch.zeros(1, 4, 1, K, dtype=torch.bfloat16)
    v = torch.zeros(1, 4, 1, V, dtype=torch.bfloat16)
    g, beta = torch.zeros(1, 4, 1), torch.zeros(1, 4, 1)
    assert cuda_prepare.outside_design(q, q, v, g, beta, None, False, None, scalar_gate=True) is None
    assert "finished gate" in cuda_prepare.outside_design(q, q, v, g, beta, None, False, None)
    for lower_bound in (None, -5.0, -100.0):
        assert cuda_prepare.outside_design(q, q, v, g, beta, None, True, lower_bound) is None
    assert cuda_prepare.channel_gate_form(None) == (True, True)
    assert cuda_prepare.channel_gate_form(-5.0) == (False, False)
    assert cuda_prepare.channel_gate_form(-5.2) == (False, True)
    assert "K = 64" in cuda_prepare.outside_design(q[..., :64], q[..., :64], v, g, beta, None, False, None,
                                                  scalar_gate=True)


@pytest.mark.parametrize("g_dtype, beta_dtype, recorded", [(torch.float16, torch.bfloat16, True),
                                                          (torch.bfloat16, torch.float16, True),
                                                          (torch.bfloat16, torch.float32, False)])
def test_an_exact_pass_the_backend_did_not_expect_is_recorded(monkeypatch, g_dtype, beta_dtype, recorded):
    """A softplus call whose device, dtype and sizes the CUDA kernel serves (so the backend choice preferred our
    kernels) but whose gate or beta dtype it does not take runs the Triton prepare's exact pass: a recorded
    fallback, naming the dtypes. A finished gate or a bounded lower bound takes no exact pass the choice did not
    expect: not recorded; a forced CUDA kernel records its own fallback once."""
    q = torch.zeros(1, 4, 1, K, dtype=torch.bfloat16)
    v = torch.zeros(1, 4, 1, V, dtype=torch.bfloat16)
    g, beta = torch.zeros(1, 4, 1, K, dtype=g_dtype), torch.zeros(1, 4, 1, dtype=beta_dtype)
    clear_fallback_events()
    monkeypatch.setenv(cuda_prepare.KERNEL_ENV, "auto")
    assert cuda_prepare.choose_prepare_kernel(q, q, v, g, beta, None, True, None) == "triton"
    assert not fallback_events()  # CPU tensors: the CUDA kernel does not serve the device, the choice knew
    monkeypatch.setattr(cuda_prepare, "serves_in_kernel_gates", lambda *args: None)
    monkeypatch.setattr(cuda_prepare, "device_unsupported", lambda x: None)
    expected = "cuda" if not recorded else "triton"
    assert cuda_prepare.choose_prepare_kernel(q, q, v, g, beta, None, True, None) == expected
    reasons = [e.reason for e in fallback_events()]
    if recorded:
        assert reasons == ["the CUDA prepare kernel serves this device, dtype and sizes but not this call: g / beta "
                           f"are {g_dtype} / {beta_dtype} (the kernel takes bfloat16 or float32)"]
    else:
        assert not reasons
    clear_fallback_events()
    cuda_prepare.choose_prepare_kernel(q, q, v, g, beta, None, False, None)  # a finished gate: Triton by design
    cuda_prepare.choose_prepare_kernel(q, q, v, g, beta, None, True, LB)  # bounded: no exact pass
    assert not fallback_events()
    monkeypatch.setenv(cuda_prepare.KERNEL_ENV, "cuda")  # forced: one record, the forced kernel's
    cuda_prepare.choose_prepare_kernel(q, q, v, g, beta, None, True, None)
    assert len(fallback_events()) == (1 if recorded else 0)
    assert all(e.chosen == "Triton prepare kernel" for e in fallback_events())
    clear_fallback_events()


# ---- CUDA -------------------------------------------------------------------------------------------------
def _inputs(B, T, H, HV, *, offsets=None, g_dtype=torch.bfloat16, beta_dtype=torch.bfloat16, raw=True, shift=-4.0,
            seed=0, strong=False, a_log=None):
    """Fresh inputs. ``shift``: added to the raw gate (-4: about 0.2 nats a step, so 2^G stays well inside fp32
    over a chunk; 0: the benchmark's ~2.5 nats). ``raw=False``: unit-norm q / k and beta in (0, 1). ``strong``:
    Mamba-style ``A_log = log U(1, 16)`` (softplus gate: up to ~40 nats a step, most 16-token blocks spanning more
    than 2^120 in some channel); ``a_log``: one A_log per value head instead."""
    torch.manual_seed(seed)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v = torch.randn(B, T, H, K, **bf16), torch.randn(B, T, H, K, **bf16), torch.randn(B, T, HV, V, **bf16)
    g = (torch.randn(B, T, HV, K, device="cuda") + shift).to(g_dtype)
    beta = torch.randn(B, T, HV, device="cuda").to(beta_dtype)
    if not raw:
        q, k = (torch.nn.functional.normalize(x.float(), dim=-1).to(torch.bfloat16) for x in (q, k))
        beta = torch.sigmoid(beta.float()).to(beta_dtype)
    A_log, dt_bias = torch.rand(HV, device="cuda"), torch.randn(HV * K, device="cuda") * 0.1
    if strong:
        A_log = torch.log(1 + 15 * torch.rand(HV, device="cuda"))
    if a_log is not None:
        A_log = torch.tensor(a_log, device="cuda", dtype=torch.float32)
    cu = torch.tensor(offsets, device="cuda", dtype=torch.int32) if offsets is not None else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, cu=cu)


def _run(kernel, x, *, l2norm=True, sigmoid=True, use_a_log=True, use_dt=True, save=False, lower_bound=LB):
    """chunk_kda_prefill with one prepare kernel; its outputs and the prepare kernel's intermediates."""
    from kda_compile.ops.kda.prefill import run as tc

    captured, original, original_cuda = {}, tc.launch_scan, tc.launch_scan_cuda

    def capturing(scan):
        def capture(w, u, qg, kd, a_qk, decay, *args, **kwargs):
            captured.update(w=w.clone(), u=u.clone(), qg=qg.clone(), kd=kd.clone(), a_qk=a_qk.clone(),
                            decay=decay.clone())
            return scan(w, u, qg, kd, a_qk, decay, *args, **kwargs)
        return capture

    previous = os.environ.get(cuda_prepare.KERNEL_ENV)
    os.environ[cuda_prepare.KERNEL_ENV] = kernel
    tc.launch_scan, tc.launch_scan_cuda = capturing(original), capturing(original_cuda)  # (the CUDA pair: the second)
    try:
        o, final, residuals = tc.chunk_kda_prefill(
            x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"] if use_a_log else None,
            x["dt_bias"] if use_dt else None, None, x["cu"], scale=K ** -0.5, output_final_state=True,
            use_qk_l2norm_in_kernel=l2norm, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=sigmoid,
            lower_bound=lower_bound, save_residuals=save)
    finally:
        tc.launch_scan, tc.launch_scan_cuda = original, original_cuda
        if previous is None:
            os.environ.pop(cuda_prepare.KERNEL_ENV)
        else:
            os.environ[cuda_prepare.KERNEL_ENV] = previous
    captured.update(o=o, final=final)
    if save:
        captured["akk"] = residuals[2]
    return captured


CASES = [
    ("tail", dict(B=2, T=300, H=2, HV=2), {}),
    ("gva", dict(B=1, T=256, H=4, HV=8), {}),
    ("varlen-empty-and-1-token", dict(B=1, T=333, H=4, HV=4, offsets=[0, 0, 100, 101, 333]), {}),
    ("no-l2norm-sigmoid-alog-dtbias", dict(B=2, T=130, H=2, HV=2, raw=False),
     dict(l2norm=False, sigmoid=False, use_a_log=False, use_dt=False)),
    ("fp32-gate-and-beta-kept-inverse", dict(B=1, T=200, H=2, HV=2, g_dtype=torch.float32,
                                             beta_dtype=torch.float32), dict(save=True)),
    ("benchmark-decays", dict(B=2, T=300, H=2, HV=2, shift=0.0), {}),
    ("one-token", dict(B=1, T=1, H=2, HV=2), {}),
    # wide blocks: gates whose 16-token blocks may decay by more than 2^120
    ("softplus-benchmark-decays", dict(B=2, T=300, H=2, HV=2, shift=0.0), dict(lower_bound=None)),
    ("softplus-strong-decays-packed", dict(B=1, T=333, H=4, HV=4, offsets=[0, 0, 100, 101, 333], shift=0.0,
                                           strong=True), dict(lower_bound=None)),
    ("softplus-strong-no-l2norm-fp32-gate-kept-inverse",
     dict(B=1, T=200, H=2, HV=4, raw=False, strong=True, shift=1.0, g_dtype=torch.float32),
     dict(lower_bound=None, l2norm=False, sigmoid=False, save=True)),
    ("softplus-mild-decays-no-bias", dict(B=2, T=130, H=2, HV=2, shift=-4.0), dict(lower_bound=None, use_dt=False)),
    # exp(A_log) 1 / 5 / 6.7 / 16 by head: blocks within and far beyond 2^120 side by side (about 1 / 0.46 / 0 / 0
    # of each head's blocks within it)
    ("softplus-mixed-strengths-by-head", dict(B=1, T=512, H=2, HV=4, shift=0.0, a_log=[0.0, 1.6, 1.9, 2.8]),
     dict(lower_bound=None)),
    ("lower-bound-minus-40", dict(B=2, T=300, H=2, HV=2, shift=0.0), dict(lower_bound=-40.0)),
]


@cuda
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_the_triton_kernel_and_the_recurrence(case):
    """Every intermediate within bf16 rounding of the Triton prepare kernel's (they round at the same points,
    in different orders), and the forward within the bf16 tolerance of the fp64 recurrence."""
    _, shape, flags = case
    x = _inputs(**shape)
    clear_fallback_events()
    got, want = _run("cuda", x, **flags), _run("triton", x, **flags)
    assert not fallback_events(), "the CUDA prepare kernel did not run"
    slots = want["decay"].shape[0]  # varlen allocates an upper bound of chunk slots: compare the real ones
    if x["cu"] is not None:
        slots = int(((x["cu"][1:] - x["cu"][:-1] + 63) // 64).sum())
    got["decay"], want["decay"] = got["decay"][:slots], want["decay"][:slots]
    errors = {}
    for name in want:
        a, b = got[name].double(), want[name].double()
        assert not a.isnan().any(), name
        errors[name] = (a - b).norm().item() / max(b.norm().item(), 1e-30) if b.norm() > 0 else (a - b).norm().item()
    print(" ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    for name in ("w", "u", "qg", "kd", "a_qk", "akk"):
        if name in errors:
            assert errors[name] < 8e-3, (name, errors[name])
    assert errors["decay"] < 1e-5
    ref_o, ref_final = kda_reference(
        *(x[n].double() for n in ("q", "k", "v", "g", "beta")), scale=K ** -0.5, cu_seqlens=x["cu"],
        A_log=x["A_log"].double() if flags.get("use_a_log", True) else None,
        dt_bias=x["dt_bias"].double() if flags.get("use_dt", True) else None,
        use_qk_l2norm_in_kernel=flags.get("l2norm", True), use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=flags.get("sigmoid", True), lower_bound=flags.get("lower_bound", LB))
    tol = tolerances_for(torch.bfloat16, "cuda")
    o_err, o_err_triton = rel_error(got["o"].double(), ref_o.double()), rel_error(want["o"].double(), ref_o.double())
    print(f"o vs fp64: cuda {o_err:.2e}, triton {o_err_triton:.2e}")
    assert o_err < tol["o"]
    assert rel_error(got["final"].double(), ref_final.double()) < tol["final_state"]


@cuda
def test_a_qk_and_the_inverse_match_float64():
    """The kept ``A_qk`` and ``(I + A_kk)^-1`` against a float64 computation of the same chunk matrices."""
    from .test_triton_chunk import _chunk_reference

    x = _inputs(1, 200, 2, 2)
    for kernel in ("cuda", "triton"):
        out = _run(kernel, x, l2norm=True, save=True)
        gate = kda_gate(x["g"].double().cpu(), x["A_log"].double().cpu(), x["dt_bias"].double().cpu(), LB)[0]
        f64 = lambda t: t[0].double().cpu()  # noqa: E731
        _, want_qk, want_kk = _chunk_reference(l2norm(f64(x["q"])), l2norm(f64(x["k"])), gate,
                                               torch.sigmoid(f64(x["beta"])), K ** -0.5)
        qk_err, kk_err = rel_error(f64(out["a_qk"]), want_qk), rel_error(f64(out["akk"]), want_kk)
        print(f"{kernel}: A_qk {qk_err:.2e}, inverse {kk_err:.2e} against float64")
        assert qk_err < 6e-3 and kk_err < 6e-3


@cuda
def test_repeated_runs_are_bitwise_identical():
    x = _inputs(2, 300, 2, 2, shift=-2.0)
    for lower_bound in (LB, None):
        first, second = _run("cuda", x, lower_bound=lower_bound), _run("cuda", x, lower_bound=lower_bound)
        for name in first:
            assert torch.equal(first[name], second[name]), (lower_bound, name)


@cuda
def test_in_kernel_gates_choose_the_cuda_kernel_and_finished_gates_do_not():
    x = _inputs(1, 64, 1, 1)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], None)
    for lower_bound in (LB, -6.0, None):  # bounded, wide lower bound, softplus
        assert cuda_prepare.choose_prepare_kernel(*args, True, lower_bound) == "cuda"
    assert cuda_prepare.choose_prepare_kernel(*args, False, None) == "triton"
    half = x["q"].half()
    assert cuda_prepare.choose_prepare_kernel(half, half, x["v"].half(), x["g"], x["beta"], None, True, LB) == "triton"
    assert math.isclose(MAX_BOUNDED_DECAY, 5.147, rel_tol=1e-3)


EXTREME_RAW = [("projection +-inf", dict(f_value=float("inf"))), ("projection -1e30", dict(f_value=-1e30)),
               ("bias +-1e4, A_log 6", dict(bias_value=1e4, a_log=6.0))]


@cuda
@pytest.mark.parametrize("lower_bound", [LB, None], ids=["lower-bound", "softplus"])
@pytest.mark.parametrize("case", EXTREME_RAW, ids=[c[0] for c in EXTREME_RAW])
def test_extreme_raw_gates_and_biases(case, lower_bound):
    """Projections of +-inf / -1e30 and biases of +-1e4 (with exp(A_log) = 403) pin steps at no decay or at the
    bound (lower-bound gate), or at no decay or a reset (softplus: the floor, 2^-150 a step). Both prepare kernels
    stay finite, agree, and the forward follows the fp64 recurrence."""
    _, spec = case
    x = _inputs(1, 200, 2, 2)
    f = x["g"].float()
    if "f_value" in spec:
        f[:, 10:40, :, :32] = spec["f_value"]
        f[:, 100:130, :, 64:] = -spec["f_value"]
        f[:, 150] = spec["f_value"]
    x["g"] = f.to(x["g"].dtype)
    if "bias_value" in spec:
        signs = torch.where(torch.arange(2 * K, device="cuda") % 3 == 0, 1.0, -1.0)
        x["dt_bias"] = spec["bias_value"] * signs
        x["A_log"] = torch.full_like(x["A_log"], spec["a_log"])
    clear_fallback_events()
    got, want = _run("cuda", x, lower_bound=lower_bound), _run("triton", x, lower_bound=lower_bound)
    assert not fallback_events(), "the CUDA prepare kernel did not run"
    for name in ("w", "u", "qg", "kd", "a_qk", "o", "final"):
        assert torch.isfinite(got[name]).all(), name
        assert rel_error(got[name].double(), want[name].double()) < 8e-3, name
    ref_o, ref_final = kda_reference(
        *(x[n].double() for n in ("q", "k", "v", "g", "beta")), scale=K ** -0.5, A_log=x["A_log"].double(),
        dt_bias=x["dt_bias"].double(), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound)
    tol = tolerances_for(torch.bfloat16, "cuda")
    assert rel_error(got["o"].double(), ref_o.double()) < tol["o"]
    assert rel_error(got["final"].double(), ref_final.double()) < tol["final_state"]
