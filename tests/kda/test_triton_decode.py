"""The fused Triton KDA decode step (ops/kda/decode/kernel.py) and its backend, against the fp64
token recurrence (tests/kda/recurrence.py).

Runs on CUDA, or on CPU under the Triton interpreter (one fixed config, BV = 32)::

    TRITON_INTERPRET=1 PYTHONPATH=/tmp/triton36 python -m pytest tests/kda/test_triton_decode.py -q -x

Skipped when triton is not importable or there is neither CUDA nor the interpreter. Interpreted runs
cover float32 and float16; CUDA adds bfloat16 and the op-level checks (backend choice, opcheck,
torch.compile).

Tolerances, relative RMS error against the recurrence on the same (already rounded) inputs: the
kernel computes in fp32 and keeps the state in fp32, so the final state is held to fp32 rounding
over a few tokens, 2e-5 for every input dtype (measured about 2e-7 interpreted; CUDA's approximate
exp2 / rsqrt add a few ulp). ``o`` is rounded to the input dtype once: fp32 2e-5, fp16 1e-3 (half
an fp16 ulp is 2.4e-4 relative), bf16 8e-3 (half a bf16 ulp is 2e-3).
"""

import pytest
import torch
from hypothesis import given, settings

from kda_compile.testing import KDAShape, kda_inputs, make_kda_args, rel_error

from .recurrence import compare_with_recurrence, kda_recurrence

from triton_device import INTERPRETED, triton_device  # noqa: E402

DEVICE = triton_device("the Triton decode kernel")

from kda_compile.ops.kda.backends import registry as backends  # noqa: E402
from kda_compile.ops.kda.backends.registry import (KDAOptions, only_backends, registered_backends,  # noqa: E402
                                                   select_backend)
from kda_compile.ops.kda.decode.backend import TritonDecodeBackend  # noqa: E402
from kda_compile.ops.kda.decode.kernel import (  # noqa: E402
    SHIPPED_CONFIGS,
    fused_recurrent_kda_triton,
    grid_class,
    shipped_config,
)

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
O_TOL = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
STATE_TOL = 2e-5


def triton_decode(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                  allow_neg_eigval=False, lower_bound=None, cu_seqlens=None, state_v_first=False, A_log=None,
                  dt_bias=None):
    """The launcher behind ``fused_recurrent_kda``'s keyword arguments (what the op layer does around it)."""
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)  # a strided view: the kernel reads any layout
    o, final = fused_recurrent_kda_triton(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
        scale=q.shape[-1] ** -0.5 if scale is None else scale, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound,
    )
    if final is not None and state_v_first:
        final = final.transpose(-1, -2)
    return o, final


def check(args):
    dtype = args["q"].dtype
    return compare_with_recurrence(triton_decode, args, with_grads=False,
                                   tolerances={"o": O_TOL[dtype], "final_state": STATE_TOL})


# (id, shape (B, T, H, HV, K, V), cu_seqlens, options for make_kda_args)
CASES = [
    ("decode-gva-softplus-l2norm-K60-V100", KDAShape(2, 1, 1, 2, 60, 100), None,
     dict(gate_form="softplus", qk_l2norm=True, beta_sigmoid=True, initial_state=True)),
    ("3-tokens-lower-bound-negeig", KDAShape(1, 3, 2, 4, 100, 60), None,
     dict(gate_form="lower_bound", lower_bound=-5.0, beta_sigmoid=True, allow_neg_eigval=True, initial_state=True)),
    ("lower-bound-no-A_log-no-dt_bias", KDAShape(2, 2, 1, 1, 32, 48), None,
     dict(gate_form="lower_bound", A_log=False, dt_bias=False, initial_state=True)),
    ("softplus-no-dt_bias-no-state", KDAShape(1, 2, 1, 2, 16, 40), None,
     dict(gate_form="softplus", dt_bias=False)),
    ("precomputed-no-final-state", KDAShape(2, 1, 2, 2, 60, 32), None,
     dict(initial_state=True, output_final_state=False)),
    ("v-first-noncontiguous-custom-scale", KDAShape(2, 2, 2, 2, 48, 20), None,
     dict(initial_state=True, state_v_first=True, noncontiguous=True, qk_l2norm=True, scale=0.3)),
    ("varlen-empty-seqs", KDAShape(1, 5, 1, 2, 32, 36), [0, 0, 2, 2, 5],
     dict(gate_form="softplus", initial_state=True, beta_sigmoid=True)),
    ("K256", KDAShape(1, 2, 1, 1, 256, 24), None, dict(gate_form="softplus", qk_l2norm=True, initial_state=True)),
    ("V300", KDAShape(1, 1, 1, 1, 16, 300), None, dict(initial_state=True)),
]


def _case_args(case, dtype, seed=3):
    _, shape, cu_seqlens, options = case
    return make_kda_args(shape, seed=seed, dtype=dtype, cu_seqlens=cu_seqlens, device=DEVICE, **options)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_recurrence(case, dtype):
    check(_case_args(case, dtype))


def test_tokens_outside_every_sequence_are_zero():
    # cu_seqlens [0, 1, 3] over T = 5: tokens 3 and 4 belong to no sequence and must read 0.
    args = make_kda_args(KDAShape(1, 3, 1, 2, 16, 40), seed=6, cu_seqlens=[0, 1, 3], initial_state=True,
                         gate_form="softplus", device=DEVICE)
    want_o, want_final = kda_recurrence(**args)
    padded = dict(args)
    for key in ("q", "k", "v", "g", "beta"):
        x = args[key]
        padded[key] = torch.cat([x, torch.randn_like(x[:, :2])], dim=1)
    o, final = triton_decode(**padded)
    assert torch.all(o[:, 3:] == 0)
    assert rel_error(o[:, :3], want_o) < O_TOL[torch.float32]
    assert rel_error(final, want_final) < STATE_TOL


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_beta_zero_and_one_and_gates_near_minus_infinity(dtype):
    args = make_kda_args(KDAShape(2, 4, 1, 2, 60, 40), seed=5, dtype=dtype, initial_state=True, device=DEVICE)
    beta = args["beta"].clone()
    beta[0] = 0.0  # no write: the state only decays
    beta[1, :2] = 1.0  # full overwrite along k
    g = args["g"].clone()
    g[0, 1] = float("-inf")  # the state resets to 0 on every channel
    g[1, 2, :, :7] = -1e30  # some channels reset
    g[1, 3] = 0.0  # no decay
    args.update(beta=beta, g=g)
    errors = check(args)
    assert all(e == e for e in errors.values())  # no NaN anywhere


def test_raw_gates_far_out_stay_finite():
    # softplus of +-1e4 and the sigmoid's saturation: g -> -inf (reset) and g -> 0, no NaN / inf.
    args = make_kda_args(KDAShape(1, 3, 1, 1, 32, 16), seed=2, gate_form="softplus", initial_state=True,
                         device=DEVICE)
    f = args["g"].clone()
    f[0, 0, :, :10] = 1e4
    f[0, 1, :, 10:20] = -1e4
    f[0, 2, :, 20:] = -30.0  # softplus below fp32's 1 + exp(x) resolution: needs the exp(x) branch
    args["g"] = f
    check(args)
    args["lower_bound"] = -5.0  # the same raw gates through the lower-bound form
    check(args)


def test_l2norm_eps_inside_the_sqrt():
    # Rows of norm ~1e-3: x / sqrt(|x|^2 + 1e-6) is x / (sqrt(2) |x|), not x / |x| (F.normalize).
    args = make_kda_args(KDAShape(1, 2, 1, 1, 32, 16), seed=12, qk_l2norm=True, initial_state=True, device=DEVICE)
    args["q"] = args["q"] / args["q"].norm(dim=-1, keepdim=True) * 1e-3
    args["k"] = args["k"] / args["k"].norm(dim=-1, keepdim=True) * 1e-3
    check(args)


def test_mixed_input_dtypes_and_output_contract():
    args = make_kda_args(KDAShape(2, 2, 1, 2, 60, 36), seed=11, dtype=torch.float16, gate_form="softplus",
                         initial_state=True, device=DEVICE)
    args["g"] = args["g"].float()
    args["beta"] = args["beta"].float()
    o, final = triton_decode(**args)
    assert o.dtype == torch.float16 and o.is_contiguous() and o.shape == (2, 2, 2, 36)
    assert final.dtype == torch.float32 and final.is_contiguous() and final.shape == (2, 2, 60, 36)
    check(args)


def test_bitwise_deterministic():
    args = make_kda_args(KDAShape(2, 3, 1, 2, 60, 100), seed=4, gate_form="lower_bound", qk_l2norm=True,
                         initial_state=True, device=DEVICE)
    o1, s1 = triton_decode(**args)
    o2, s2 = triton_decode(**args)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


def test_initial_state_is_not_modified():
    args = make_kda_args(KDAShape(1, 2, 1, 1, 32, 32), seed=8, initial_state=True, device=DEVICE)
    before = args["initial_state"].clone()
    triton_decode(**args)
    assert torch.equal(args["initial_state"], before)


IN_PLACE_CASES = [c for c in CASES if c[3].get("initial_state") and c[3].get("output_final_state", True)]


@pytest.mark.parametrize("case", IN_PLACE_CASES, ids=[c[0] for c in IN_PLACE_CASES])
def test_final_state_written_over_the_initial_state(case):
    """``final_state=initial_state``: the same launch reads each state tile and writes it back, with the result of
    a fresh final state to the bit (packed sequences, a transposed ``state_v_first`` view, V split over programs)."""
    args = _case_args(case, torch.float32)
    o_fresh, final_fresh = triton_decode(**args)
    state = args["initial_state"].clone()
    view = state.transpose(-1, -2) if args["state_v_first"] else state
    o, final = fused_recurrent_kda_triton(
        args["q"], args["k"], args["v"], args["g"], args["beta"], args["A_log"], args["dt_bias"], view,
        args["cu_seqlens"], scale=args["q"].shape[-1] ** -0.5 if args["scale"] is None else args["scale"],
        output_final_state=True, use_qk_l2norm_in_kernel=args["use_qk_l2norm_in_kernel"],
        use_gate_in_kernel=args["use_gate_in_kernel"], use_beta_sigmoid_in_kernel=args["use_beta_sigmoid_in_kernel"],
        allow_neg_eigval=args["allow_neg_eigval"], lower_bound=args["lower_bound"], final_state=view)
    assert final is view
    assert torch.equal(o, o_fresh)
    assert torch.equal(state, final_fresh)  # both in the caller's layout (triton_decode transposes back)


def test_final_state_needs_output_final_state_and_its_shape():
    args = make_kda_args(KDAShape(1, 1, 1, 1, 16, 16), seed=8, initial_state=True, device=DEVICE)
    h0 = args["initial_state"]
    plain = dict(scale=0.25, output_final_state=False)
    with pytest.raises(ValueError, match="final_state is where the final state is written: it needs output_final_state"):
        fused_recurrent_kda_triton(args["q"], args["k"], args["v"], args["g"], args["beta"], None, None, h0, None,
                                   final_state=h0, **plain)
    with pytest.raises(ValueError, match=r"final_state must be a float32 tensor of shape \[N, HV, K, V\] = \[1, 1, 16, "
                                         r"16\], got torch.float16 \[1, 1, 16, 16\]"):
        fused_recurrent_kda_triton(args["q"], args["k"], args["v"], args["g"], args["beta"], None, None, h0, None,
                                   final_state=h0.half(), **dict(plain, output_final_state=True))


@settings(deadline=None)
@given(kda_inputs(max_batch=2, max_T=4, heads=(1, 2), gva_ratios=(1, 2), key_dims=(16, 60, 100),
                  value_dims=(16, 60, 100), dtypes=(torch.float32, torch.float16), max_seqs=3,
                  allow_neg_eigval=(False, True), state_v_first=(False, True), noncontiguous=(False, True),
                  scales=(None, 0.5), max_work=60_000, device=DEVICE))
def test_fuzz_against_recurrence(args):
    check(args)


# ------------------------------------------------------------------------------------------------
# The backend: choice, glue, reasons.
# ------------------------------------------------------------------------------------------------
OPTS = KDAOptions(scale=0.125, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True)


def test_registered_above_fla_for_decode_only(monkeypatch):
    # Without FLA (CPU CI) the forced call below ends on the reference: keep that out of the global
    # fallback record other tests read.
    from kda_compile.ops import _backend_registry

    monkeypatch.setattr(_backend_registry, "record_fallback", lambda *args: None)
    names = registered_backends()
    assert names.index("triton_decode") < names.index("fla") < names.index("reference")
    assert TritonDecodeBackend.serves == frozenset({"fused_recurrent_kda"})  # chunk_kda never lands here
    cuda = torch.device("cuda")
    assert select_backend("fused_recurrent_kda", cuda, torch.bfloat16, 128, 128, OPTS).name == "triton_decode"
    with only_backends("fla"):
        assert select_backend("fused_recurrent_kda", cuda, torch.bfloat16, 128, 128, OPTS).name != "triton_decode"


@pytest.mark.parametrize("device, dtype, K, expected", [
    ("cpu", torch.float32, 128, "needs CUDA, got cpu"),
    ("cuda", torch.float64, 128, "float16/bfloat16/float32 inputs, got torch.float64"),
    ("cuda", torch.bfloat16, 300, "K <= 256 in registers, got K=300"),
])
def test_unsupported_reasons(device, dtype, K, expected):
    reason = TritonDecodeBackend().unsupported_reason(torch.device(device), dtype, K, 64, OPTS)
    assert reason is not None and expected in reason
    assert TritonDecodeBackend().unsupported_reason(torch.device("cuda"), torch.float16, 256, 300, OPTS) is None


@pytest.mark.parametrize("output_final_state", [False, True])
def test_backend_recurrent_forward(output_final_state):
    args = make_kda_args(KDAShape(2, 1, 1, 2, 60, 40), seed=9, dtype=torch.float16, gate_form="lower_bound",
                         lower_bound=-5.0, qk_l2norm=True, beta_sigmoid=True, initial_state=True, device=DEVICE)
    opts = KDAOptions(scale=60 ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
    o, final = TritonDecodeBackend().recurrent_forward(
        args["q"], args["k"], args["v"], args["g"], args["beta"], args["A_log"], args["dt_bias"],
        args["initial_state"], None, opts, output_final_state)
    want_o, want_final = kda_recurrence(**{**args, "output_final_state": True})
    assert o.dtype == torch.float16
    assert rel_error(o, want_o) < O_TOL[torch.float16]
    if output_final_state:
        assert rel_error(final, want_final) < STATE_TOL
    else:
        assert final is None


def test_grid_class_buckets():
    assert [grid_class(n) for n in (1, 32, 64, 65, 256, 2048, 8192, 10**6)] == [64, 64, 64, 256, 256, 4096,
                                                                               4096, 4096]


@pytest.mark.parametrize("interpreted", ["0", "1"])
def test_shipped_configs_fit_every_head_dim(monkeypatch, interpreted):
    """Every (K, V, grid class) gets a config the autotuner's own pruning would keep on a GPU: 8-64 fp32 state
    elements per thread, BV no wider than V needs; at K = V = 128 the measured table itself. Interpreted (no
    registers), the interpreter's one config, BV = 32 at most."""
    monkeypatch.setenv("TRITON_INTERPRET", interpreted)
    for nh_class in SHIPPED_CONFIGS:
        for BK in (16, 32, 64, 128, 256):
            for V in (1, 8, 16, 60, 100, 128, 256):
                config = shipped_config(BK, V, nh_class)
                per_thread = BK * config["BV"] // (32 * config["num_warps"])
                assert interpreted == "1" or 8 <= per_thread <= 64, (BK, V, nh_class, config)
                assert config["BV"] <= max(16, 1 << (V - 1).bit_length()), (BK, V, nh_class, config)
        if interpreted == "0":
            assert (shipped_config(128, 128, nh_class)["BV"], shipped_config(128, 128, nh_class)["num_warps"]) \
                == SHIPPED_CONFIGS[nh_class]


def test_default_launch_does_not_autotune(monkeypatch):
    """The first call of a new launch key compiles the shipped config only (a fresh process's first decode step
    costs one compile, not 13 compiles and timings); KDA_COMPILE_DECODE_AUTOTUNE=1 autotunes."""
    from kda_compile.ops.kda.decode import kernel as triton_decode

    monkeypatch.setattr(triton_decode, "_TUNED", {})
    monkeypatch.delenv(triton_decode.AUTOTUNE_ENV, raising=False)
    tuner = triton_decode.fused_recurrent_kda_decode_kernel

    def no_autotuning(*args, **kwargs):
        raise AssertionError("the default decode launch ran the autotuner")

    monkeypatch.setattr(type(tuner), "run", no_autotuning)
    args = make_kda_args(KDAShape(2, 1, 2, 2, 32, 32), seed=3, dtype=torch.float32, gate_form="softplus",
                         initial_state=True, device=DEVICE)
    check(args)
    (config,) = triton_decode._TUNED.values()
    assert config == shipped_config(32, 32, grid_class(4))


# ------------------------------------------------------------------------------------------------
# CUDA: the public op picks this backend, passes opcheck, and compiles.
# ------------------------------------------------------------------------------------------------
def _decode_args(B=4, T=1, H=4, K=128, V=128, dtype=torch.bfloat16, noncontiguous=False):
    return make_kda_args(KDAShape(B, T, H, H, K, V), seed=1, dtype=dtype, gate_form="softplus", qk_l2norm=True,
                         beta_sigmoid=True, initial_state=True, noncontiguous=noncontiguous, device="cuda")


@pytest.fixture
def decode_calls(monkeypatch):
    calls = []
    original = TritonDecodeBackend.recurrent_forward

    def counting(self, *args, **kwargs):
        calls.append(args[0].shape)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TritonDecodeBackend, "recurrent_forward", counting)
    return calls


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA (not the interpreter)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_public_fused_recurrent_kda_uses_triton_decode(dtype, decode_calls):
    from kda_compile.ops import fused_recurrent_kda

    args = _decode_args(dtype=dtype)
    with torch.no_grad():
        compare_with_recurrence(fused_recurrent_kda, args, with_grads=False,
                                tolerances={"o": O_TOL[dtype], "final_state": STATE_TOL})
    assert len(decode_calls) == 1
    with only_backends("fla"), torch.no_grad():
        fused_recurrent_kda(**args)
    assert len(decode_calls) == 1  # forced to the FLA path: not ours


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA (not the interpreter)")
@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "transposed"])
def test_opcheck_on_cuda(noncontiguous, decode_calls):
    args = _decode_args(B=2, T=2, H=2, K=60, V=100, noncontiguous=noncontiguous)  # T = 2: really strided
    op_args = (args["q"], args["k"], args["v"], args["g"], args["beta"], args["A_log"], args["dt_bias"],
               args["initial_state"], None, 60 ** -0.5, True, True, True, True, False, None)
    torch.library.opcheck(torch.ops.kda_compile.fused_recurrent_kda_fwd.default, op_args)
    assert decode_calls


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA (not the interpreter)")
def test_compiled_decode_step(decode_calls):
    from kda_compile.ops import fused_recurrent_kda

    args = _decode_args()

    def step(q, k, v, g, beta, state):
        call = {**args, "q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": state}
        return fused_recurrent_kda(**call)

    inputs = (args["q"], args["k"], args["v"], args["g"], args["beta"], args["initial_state"])
    with torch.no_grad():
        want = step(*inputs)
        got = torch.compile(step, backend="aot_eager", fullgraph=True)(*inputs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(decode_calls) >= 2
