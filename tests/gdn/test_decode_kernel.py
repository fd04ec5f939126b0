"""GDN decode on our fused Triton step with the scalar gate (ops/gdn/decode/kernel.py, decode/backend.py; the KDA decode
kernel's ``SCALAR_GATE`` form): against the fp64 token loop through the public function with
``only_backends("decode_kernel")``, on CUDA or on CPU under the Triton interpreter; the backend's choice on the host;
``@pytest.mark.cuda`` tests of the default choice, opcheck and torch.compile on a GPU.

Tolerances (relative RMS error against fp64 on the same rounded inputs, as tests/kda/test_triton_decode.py: the
kernel computes in fp32 and keeps the state in fp32): final state 2e-5; ``o``, rounded once to the input dtype,
fp32 2e-5, fp16 1e-3, bf16 8e-3. Extreme gates (``-inf``, ``-1e30``, raw in-kernel gates of 1e30) are exact resets:
same tolerances, and the outputs after a reset are bitwise independent of everything before it. NaN never passes.
"""
import pytest
import torch
from kda_compile.ops import fused_recurrent_gated_delta_rule
from kda_compile.ops._common import clear_fallback_events, fallback_events
from kda_compile.ops.gdn.decode import backend as decode_backend
from kda_compile.ops.gdn.backends import fla as fla_backend
from kda_compile.ops.gdn.backends.registry import only_backends, registered_backends, select_backend
from kda_compile.ops.gdn.custom_ops import _options
from in_place_decode import check_in_place_decode
from triton_device import INTERPRETED, triton_device

from kda_compile.testing import KDAShape, assert_rel_close, make_gdn_args, rel_error
from tests.gdn.helpers import expected_fp64, op_flags, op_tensors

DEVICE = triton_device("the GDN decode kernel")
CUDA = torch.device("cuda")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
O_TOL = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
STATE_TOL = 2e-5
ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA (not the interpreter)")

# (id, shape (B, T, H, HV, K, V), cu_seqlens, options for make_gdn_args)
CASES = [
    ("T1-batch3-state", KDAShape(3, 1, 1, 1, 32, 16), None, dict(initial_state=True)),
    ("grouped-in-kernel-l2norm-beta", KDAShape(2, 1, 2, 8, 64, 48), None,
     dict(gate_form="in_kernel", qk_l2norm=True, beta_sigmoid=True, initial_state=True)),
    ("3-tokens-neg-eigval-v-first-transposed", KDAShape(2, 3, 2, 4, 48, 40), None,
     dict(beta_sigmoid=True, allow_neg_eigval=True, initial_state=True, state_v_first=True, noncontiguous=True,
          scale=0.3)),
    ("packed-empty-seqs-no-dt-bias-v-first", KDAShape(1, 5, 1, 2, 32, 36), [0, 0, 2, 2, 5],
     dict(gate_form="in_kernel", dt_bias=False, qk_l2norm=True, initial_state=True, state_v_first=True)),
    ("K60-V100-no-state", KDAShape(2, 2, 1, 2, 60, 100), None, dict(gate_form="in_kernel", beta_sigmoid=True)),
    ("K256", KDAShape(1, 2, 1, 1, 256, 24), None, dict(gate_form="in_kernel", qk_l2norm=True, initial_state=True)),
]


def _run(args, expect_backend=True):
    q, v = args["q"], args["v"]
    clear_fallback_events()
    with only_backends("decode_kernel"), torch.no_grad():
        chosen = select_backend("fused_recurrent_gdn", q.device, q.dtype, q.shape[-1], v.shape[-1],
                                _options(1.0, *[False] * 4))
        assert chosen.name == "decode_kernel"
        out = fused_recurrent_gated_delta_rule(**args)
    assert not fallback_events(), [e.reason for e in fallback_events()]
    return out


def _check(args, o, final):
    o_ref, final_ref = expected_fp64(args)
    assert_rel_close(o, o_ref, O_TOL[args["q"].dtype], name="o")
    assert_rel_close(final, final_ref, STATE_TOL, name="final_state")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_recurrence(case, dtype):
    _, shape, cu, options = case
    args = make_gdn_args(shape, seed=3, dtype=dtype, device=DEVICE, cu_seqlens=cu, **options)
    _check(args, *_run(args))


def test_tokens_outside_every_sequence_are_zero():
    """The launcher with cu_seqlens [0, 1, 3] over T = 5 (the public function refuses offsets short of T): tokens 3
    and 4 belong to no sequence and read 0."""
    from kda_compile.ops.gdn.decode.kernel import fused_recurrent_gdn_triton

    args = make_gdn_args(KDAShape(1, 3, 1, 2, 16, 40), seed=6, device=DEVICE, cu_seqlens=[0, 1, 3],
                         gate_form="in_kernel", initial_state=True)
    q, k, v, g, beta, A_log, dt_bias, h0, cu = (
        torch.cat([t, torch.randn_like(t[:, :2])], dim=1) if i < 5 else t for i, t in enumerate(op_tensors(args)))
    scale, _, _, gate, *_ = op_flags(args)
    o, final = fused_recurrent_gdn_triton(q, k, v, g, beta, A_log, dt_bias, h0, cu, scale=scale,
                                          output_final_state=True, use_gate_in_kernel=gate)
    assert torch.all(o[:, 3:] == 0)
    _check(args, o[:, :3], final)


def _with_gates(args, values, tokens=(1, 3, 4)):
    g = args["g"].detach().clone()
    for t, value in zip(tokens, values):
        g[:, t] = value
    return {**args, "g": g}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("values", [(float("-inf"),) * 3, (-1e30, -1e4, -200.0)], ids=["minus-inf", "huge"])
def test_extreme_finished_gates(values, dtype):
    args = make_gdn_args(KDAShape(2, 6, 1, 2, 32, 16), seed=5, dtype=dtype, device=DEVICE, qk_l2norm=True,
                         beta_sigmoid=True, initial_state=True)
    extreme = _with_gates(args, values)
    o, final = _run(extreme)
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    _check(extreme, o, final)


def test_extreme_in_kernel_gates():
    """Raw gates of 1e30 through ``-exp(A_log) * softplus(g + dt_bias)`` (softplus = x above 20): resets from the
    in-kernel gate; -1e30 gives softplus 0 (no decay); a packed call with them."""
    args = make_gdn_args(KDAShape(1, 8, 1, 2, 32, 16), seed=6, device=DEVICE, cu_seqlens=[0, 3, 8],
                         gate_form="in_kernel", qk_l2norm=True, beta_sigmoid=True, initial_state=True)
    extreme = _with_gates(args, (1e30, -1e30, 1e6, 1e30), tokens=(1, 2, 4, 6))
    _check(extreme, *_run(extreme))


def test_a_reset_forgets_everything_before_it():
    """After a ``-inf`` gate at token 3, the outputs from token 3 on and the final state do not depend, bitwise, on
    any input before it (the initial state included)."""
    shape = KDAShape(2, 6, 1, 2, 32, 16)
    options = dict(device=DEVICE, qk_l2norm=True, beta_sigmoid=True, initial_state=True)
    args = _with_gates(make_gdn_args(shape, seed=7, **options), (float("-inf"),), tokens=(3,))
    other = make_gdn_args(shape, seed=8, **options)
    mixed = {n: (t.detach().clone() if torch.is_tensor(t) else t) for n, t in args.items()}
    for name in ("q", "k", "v", "g", "beta"):
        mixed[name][:, :3] = other[name][:, :3]
    mixed["initial_state"] = other["initial_state"]
    first, second = _run(args), _run(mixed)
    assert torch.equal(first[0][:, 3:], second[0][:, 3:])
    assert torch.equal(first[1], second[1])


@pytest.mark.parametrize("gate_form", ["precomputed", "in_kernel"])
def test_scalar_form_is_the_broadcast_form(gate_form):
    """The kernel with one gate per (token, value head) against the same kernel fed the gate broadcast over K (the
    KDA route's input): the same per-channel values, so bitwise the same results interpreted (the GPU may contract
    the multiplies differently: 1e-6 there)."""
    from kda_compile.ops.gdn.backends.kda import per_channel_bias, per_channel_gate
    from kda_compile.ops.kda.decode.kernel import fused_recurrent_kda_triton

    args = make_gdn_args(KDAShape(2, 3, 1, 2, 60, 40), seed=9, device=DEVICE, gate_form=gate_form, qk_l2norm=True,
                         beta_sigmoid=True, allow_neg_eigval=True, initial_state=True)
    q, k, v, g, beta, A_log, dt_bias, h0, cu = op_tensors(args)
    scale, _, l2, gate, sigmoid, neg = op_flags(args)
    flags = dict(scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=gate,
                 use_beta_sigmoid_in_kernel=sigmoid, allow_neg_eigval=neg)
    scalar = fused_recurrent_kda_triton(q, k, v, g, beta, A_log, dt_bias, h0, cu, **flags, scalar_gate=True)
    K = q.shape[-1]
    broadcast = fused_recurrent_kda_triton(q, k, v, per_channel_gate(g, K), beta, A_log, per_channel_bias(dt_bias, K),
                                           h0, cu, **flags)
    for got, want in zip(scalar, broadcast):
        assert torch.equal(got, want) if INTERPRETED else rel_error(got, want) < 1e-6


def test_launcher_refuses_lower_bound_with_the_scalar_gate():
    from kda_compile.ops.kda.decode.kernel import fused_recurrent_kda_triton

    x = torch.zeros(1, 1, 1, 16)
    with pytest.raises(ValueError, match="the scalar gate takes no lower_bound"):
        fused_recurrent_kda_triton(x, x, x, x[..., 0], x[..., 0], scale=1.0, use_gate_in_kernel=True,
                                   lower_bound=-5.0, scalar_gate=True)


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors through the Triton interpreter; on CUDA "
                    "test_opcheck_on_cuda")
@pytest.mark.parametrize("options", ["in-kernel-grouped-v-first", "packed"])
def test_opcheck_on_this_backend(options):
    """The decode op on this backend (interpreted on CPU): schema, fake outputs against the kernel's."""
    args = _opcheck_args(options, device="cpu")
    with only_backends("decode_kernel"):
        torch.library.opcheck(torch.ops.kda_compile.fused_recurrent_gdn_fwd.default,
                              (*op_tensors(args), *op_flags(args)))


@pytest.mark.parametrize("options", ["in-kernel-grouped-v-first", "packed"])
def test_in_place_op_on_this_backend(options):
    """The in-place decode op on this backend (the kernel handed the state as its final state; interpreted on
    CPU): the state it leaves and its o equal the out-of-place op's to the bit, and opcheck passes."""
    args = _opcheck_args(options, device=DEVICE)
    scale, _, *flags = op_flags(args)
    with only_backends("decode_kernel"):
        check_in_place_decode("fused_recurrent_gdn", op_tensors(args), scale, flags)


def _opcheck_args(options, device, dtype=torch.float32, K=32, V=16):
    if options == "packed":
        return make_gdn_args(KDAShape(1, 4, 1, 2, K, V), seed=10, dtype=dtype, device=device, cu_seqlens=[0, 0, 1, 4],
                             gate_form="in_kernel", dt_bias=False, initial_state=True, noncontiguous=True)
    return make_gdn_args(KDAShape(2, 2, 2, 4, K, V), seed=10, dtype=dtype, device=device, gate_form="in_kernel",
                         qk_l2norm=True, beta_sigmoid=True, allow_neg_eigval=True, initial_state=True,
                         state_v_first=True, noncontiguous=True, scale=0.3)


# ---- the backend's choice (host only) ------------------------------------------------------------------------
def test_registered_above_fla_for_decode(monkeypatch):
    names = registered_backends()
    assert names.index("decode_kernel") < names.index("fla") < names.index("kda_kernels")
    backend = decode_backend.DecodeKernelBackend()
    assert backend.serves == frozenset({"fused_recurrent_gdn"})  # chunk_gdn never lands here
    opts = _options(1.0, True, True, True, False)
    monkeypatch.setattr(fla_backend, "_load_fla", lambda: (object(), None))
    monkeypatch.setattr(decode_backend, "_kernel_unusable", lambda: None)
    clear_fallback_events()
    assert select_backend("fused_recurrent_gdn", CUDA, torch.bfloat16, 128, 128, opts).name == "decode_kernel"
    assert not fallback_events()  # the first choice on CUDA
    monkeypatch.setattr(decode_backend, "_kernel_unusable", lambda: "triton is not installed")
    assert select_backend("fused_recurrent_gdn", CUDA, torch.bfloat16, 128, 128, opts).name == "fla"
    assert [e.chosen for e in fallback_events()] == ["fla"]  # our kernel missing on CUDA is recorded
    clear_fallback_events()


@pytest.mark.parametrize("device, dtype, K, expected", [
    ("cpu", torch.float32, 128, "needs CUDA, got cpu"),
    ("cuda", torch.float64, 128, "float16/bfloat16/float32, got torch.float64"),
    ("cuda", torch.bfloat16, 300, "K <= 256 in registers, got K=300"),
])
def test_unsupported_reasons(device, dtype, K, expected, monkeypatch):
    monkeypatch.setattr(decode_backend, "_kernel_unusable", lambda: None)
    backend, opts = decode_backend.DecodeKernelBackend(), _options(1.0, False, True, True, False)
    assert expected in backend.unsupported_reason(torch.device(device), dtype, K, 64, opts)
    assert backend.unsupported_reason(CUDA, torch.float16, 256, 300, opts) is None
    with only_backends("decode_kernel"):
        assert backend.unsupported_reason(torch.device("cpu"), torch.float32, 60, 100, opts) is None


def test_a_kernel_that_does_not_compile_falls_back_once(monkeypatch):
    """A compile failure of a call variant: the call is served by the next backend (the reference on CPU), recorded,
    and the variant is not launched again."""
    from triton.runtime.errors import OutOfResources

    launches = []

    def failing(*args, **kwargs):
        launches.append(1)
        raise OutOfResources(300_000, 232_448, "shared memory")

    monkeypatch.setattr(decode_backend, "_launcher", lambda: failing)
    monkeypatch.setattr(decode_backend, "_failed_variants", {})
    args = make_gdn_args(KDAShape(2, 1, 1, 2, 16, 8), seed=11, gate_form="in_kernel", initial_state=True)
    clear_fallback_events()
    with only_backends("decode_kernel"), torch.no_grad():
        for _ in range(2):
            o, final = fused_recurrent_gated_delta_rule(**args)
            _check(args, o, final)
    assert len(launches) == 1
    events = fallback_events()
    assert [(e.chosen, n) for e, n in events.items()] == [("reference", 2)]
    assert "our Triton decode kernel (scalar gate) failed to compile: OutOfResources" in next(iter(events)).reason
    clear_fallback_events()


# ---- CUDA: the default choice, opcheck, torch.compile (run on a GPU) ---------------------------------------------
QWEN = KDAShape(8, 1, 16, 32, 128, 128)  # Qwen3-Next's decode step: 16 q/k heads, 32 value heads, K = V = 128
QWEN_OPTIONS = dict(gate_form="in_kernel", qk_l2norm=True, beta_sigmoid=True, initial_state=True)


@pytest.fixture
def decode_calls(monkeypatch):
    calls = []
    original = decode_backend.DecodeKernelBackend.recurrent_forward

    def counting(self, *args, **kwargs):
        calls.append(args[0].shape)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(decode_backend.DecodeKernelBackend, "recurrent_forward", counting)
    return calls


@pytest.mark.cuda
@ON_CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
@pytest.mark.parametrize("fla", ["as-installed", "missing"])
def test_cuda_default_is_this_kernel(dtype, packed, fla, decode_calls, monkeypatch):
    """CUDA decode runs this backend at Qwen3-Next's widths, ahead of FLA's step where fla-core is installed and
    of the KDA route where it is not."""
    if fla == "missing":
        monkeypatch.setattr(fla_backend, "_load_fla", lambda: (None, "fla-core is not installed"))
    shape, cu = (KDAShape(1, 9, 16, 32, 128, 128), [0, 1, 1, 4, 9]) if packed else (QWEN, None)
    args = make_gdn_args(shape, seed=12, dtype=dtype, device="cuda", cu_seqlens=cu, **QWEN_OPTIONS)
    with torch.no_grad():
        o, final = fused_recurrent_gated_delta_rule(**args)
    assert len(decode_calls) == 1
    _check(args, o, final)


@pytest.mark.cuda
@ON_CUDA
@pytest.mark.parametrize("values", [(float("-inf"),) * 3, (-1e30, -1e4, -200.0)], ids=["minus-inf", "huge"])
def test_cuda_extreme_gates(values):
    args = make_gdn_args(KDAShape(4, 6, 16, 32, 128, 128), seed=13, dtype=torch.bfloat16, device="cuda",
                         qk_l2norm=True, beta_sigmoid=True, initial_state=True)
    extreme = _with_gates(args, values)
    _check(extreme, *_run(extreme))


@pytest.mark.cuda
@ON_CUDA
@pytest.mark.parametrize("options", ["in-kernel-grouped-v-first", "packed"])
def test_opcheck_on_cuda(options, decode_calls):
    args = _opcheck_args(options, device="cuda", dtype=torch.bfloat16, K=128, V=128)
    with only_backends("decode_kernel"):
        torch.library.opcheck(torch.ops.kda_compile.fused_recurrent_gdn_fwd.default,
                              (*op_tensors(args), *op_flags(args)))
    assert decode_calls


@pytest.mark.cuda
@ON_CUDA
def test_cuda_compiled_decode_step(decode_calls):
    args = make_gdn_args(QWEN, seed=14, dtype=torch.bfloat16, device="cuda", **QWEN_OPTIONS)

    def step(q, k, v, g, beta, state):
        return fused_recurrent_gated_delta_rule(**{**args, "q": q, "k": k, "v": v, "g": g, "beta": beta,
                                                   "initial_state": state})

    inputs = (args["q"], args["k"], args["v"], args["g"], args["beta"], args["initial_state"])
    with only_backends("decode_kernel"), torch.no_grad():
        want = step(*inputs)
        got = torch.compile(step, backend="aot_eager", fullgraph=True)(*inputs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(decode_calls) >= 2
