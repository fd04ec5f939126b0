"""GDN on our chunk kernels on CUDA (``chunk_kernels`` backend, ops/gdn/prefill/run.py): the CUDA prepare kernel's
scalar-gate form against the Triton one (the reference implementation of the same algorithm) and both against
the fp64 token loop; the default backend choice for bf16 / fp16, K = V = 128 inference; extreme gates; fault
isolation across packed sequences; opcheck of the op on this backend; the host-planned packed path.

Tolerances (relative RMS error against fp64, kda_compile.testing.rel_error): bf16 and fp16 inputs 1e-2 for ``o``
and the final state (the intermediates ``w, u, qg, kd, A_qk`` are stored in the input dtype, as FLA's; the KDA
prefill measures 3-4e-3 on the same scan), intermediates of the two prepare kernels within 8e-3 of each other
(bf16 rounding at the same points, in different orders), ``decay`` within 1e-5. NaN never passes.
"""
import os

import pytest
import torch
from kda_compile.ops import chunk_gated_delta_rule
from kda_compile.ops._common import clear_fallback_events, fallback_events
from kda_compile.ops.gdn.backends.registry import only_backends, select_backend
from kda_compile.ops.gdn.custom_ops import _options
from kda_compile.ops.kda.prefill.cuda import prepare as cuda_prepare
from kda_compile.ops.kda.prefill.cuda import scan as cuda_scan
from kda_compile.ops.kda.prefill import fast_path

from kda_compile.testing import KDAShape, make_gdn_args, rel_error
from tests.gdn.helpers import expected_fp64, op_flags, op_tensors

pytestmark = pytest.mark.cuda
TOL = 1e-2
QWEN = KDAShape(1, 300, 4, 8, 128, 128)  # Qwen3-Next's head layout (16 q/k heads, 32 value heads), fewer heads
QWEN_OPTIONS = dict(gate_form="in_kernel", qk_l2norm=True, beta_sigmoid=True, initial_state=True)


def _args(shape=QWEN, dtype=torch.bfloat16, seed=21, **options):
    return make_gdn_args(shape, seed=seed, dtype=dtype, device="cuda", **{**QWEN_OPTIONS, **options})


def _call(args, **env):
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        with torch.no_grad():
            return chunk_gated_delta_rule(**args)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _errors(args, o, final):
    o_ref, final_ref = expected_fp64(args)
    assert not o.isnan().any() and not final.isnan().any()
    return rel_error(o.double(), o_ref), rel_error(final.double(), final_ref)


def _intermediates(args, kernel):
    """The prepare kernel's outputs (as the scan receives them) and the forward's, with one prepare kernel and the
    Triton scan (with the CUDA scan, the CUDA prepare writes row factors instead of ``qg`` / ``kd``)."""
    from kda_compile.ops.kda.prefill import run as tc

    captured, original = {}, tc.launch_scan

    def capture(w, u, qg, kd, a_qk, decay, *rest, **kwargs):
        captured.update(w=w.clone(), u=u.clone(), qg=qg.clone(), kd=kd.clone(), a_qk=a_qk.clone(), decay=decay.clone())
        return original(w, u, qg, kd, a_qk, decay, *rest, **kwargs)

    tc.launch_scan = capture
    try:
        env = {cuda_prepare.KERNEL_ENV: kernel, cuda_scan.KERNEL_ENV: "triton"}
        captured["o"], captured["final"] = _call(args, **env)
    finally:
        tc.launch_scan = original
    return captured


CASES = {
    "qwen3-next-layer": dict(),
    "packed-0-and-1-token-neg-eigval": dict(cu_seqlens=[0, 0, 1, 130, 300], allow_neg_eigval=True),
    "finished-gate": dict(gate_form="precomputed", qk_l2norm=False, beta_sigmoid=False),
    "in-kernel-gate-no-dt-bias": dict(dt_bias=False, initial_state=False),
}


@pytest.mark.parametrize("case", CASES)
def test_cuda_prepare_matches_triton_prepare_and_the_recurrence(case):
    args = _args(**CASES[case])
    clear_fallback_events()
    got = _intermediates(args, "cuda")
    assert not fallback_events(), [e.reason for e in fallback_events()]
    want = _intermediates(args, "triton")
    slots = want["decay"].shape[0]
    if args["cu_seqlens"] is not None:
        cu = args["cu_seqlens"]
        slots = int(((cu[1:] - cu[:-1] + 63) // 64).sum())
    for name in ("w", "u", "qg", "kd", "a_qk"):
        assert rel_error(got[name].double(), want[name].double()) < 8e-3, name
    assert rel_error(got["decay"][:slots].double(), want["decay"][:slots].double()) < 1e-5
    for which in (got, want):
        o_err, final_err = _errors(args, which["o"], which["final"])
        assert o_err < TOL and final_err < TOL, (o_err, final_err)


@pytest.mark.parametrize("case", CASES)
def test_row_factor_pair_matches_the_tile_pair_and_the_recurrence(case):
    """With the CUDA prepare and scan, the prepare writes each row's q / k factors and the scan scales the raw q / k
    (``plan.cuda_pair_served``): the same forward as the prepare's ``qg`` / ``kd`` tiles through the Triton
    scan, within the intermediates' tolerance, and as close to the fp64 recurrence."""
    from kda_compile.ops.kda.prefill import run as tc

    args = _args(**CASES[case])
    seen, original = [], tc.launch_scan_cuda

    def spy(*a, factors=None, **kw):
        seen.append(factors is not None)
        return original(*a, factors=factors, **kw)

    tc.launch_scan_cuda = spy
    fast_path.clear_plans()  # the ordinary path, not a launch plan kept by an earlier call
    try:
        clear_fallback_events()
        o, final = _call(args, **{cuda_prepare.KERNEL_ENV: "cuda", cuda_scan.KERNEL_ENV: "cuda"})
        assert not fallback_events(), [e.reason for e in fallback_events()]
    finally:
        tc.launch_scan_cuda = original
    assert seen == [True]
    tiles = _intermediates(args, "cuda")
    assert rel_error(o.double(), tiles["o"].double()) < 8e-3
    assert rel_error(final.double(), tiles["final"].double()) < 8e-3
    o_err, final_err = _errors(args, o, final)
    assert o_err < TOL and final_err < TOL, (o_err, final_err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_default_backend_serves_inference_and_matches_the_recurrence(dtype):
    args = _args(dtype=dtype, cu_seqlens=[0, 100, 100, 300])
    opts = _options(1.0, True, True, True, False)
    assert select_backend("chunk_gdn", args["q"].device, dtype, 128, 128, opts).name == "chunk_kernels"
    clear_fallback_events()
    o, final = _call(args)
    assert not fallback_events(), [e.reason for e in fallback_events()]
    o_err, final_err = _errors(args, o, final)
    assert o_err < TOL and final_err < TOL, (o_err, final_err)


@pytest.mark.parametrize("values", [(float("-inf"),) * 3, (-1e30, -1e4, -200.0)], ids=["minus-inf", "huge"])
def test_extreme_gates_are_exact(values):
    args = _args(gate_form="precomputed", beta_sigmoid=False)
    g = args["g"].clone()
    for t, value in zip((5, 70, 200), values):
        g[:, t] = value
    args = {**args, "g": g}
    o, final = _call(args)
    o_err, final_err = _errors(args, o, final)
    assert o_err < TOL and final_err < TOL, (o_err, final_err)


def test_a_reset_forgets_everything_before_it():
    args = _args(gate_form="precomputed", beta_sigmoid=False)
    g = args["g"].clone()
    g[:, 100] = float("-inf")
    first = _call({**args, "g": g})
    other = _args(gate_form="precomputed", beta_sigmoid=False, seed=22)
    mixed = {n: (t.clone() if torch.is_tensor(t) else t) for n, t in args.items()}
    for name in ("q", "k", "v", "beta"):
        mixed[name][:, :100] = other[name][:, :100]
    mixed["g"] = g.clone()
    mixed["g"][:, :100] = other["g"][:, :100]
    mixed["initial_state"] = other["initial_state"]
    second = _call(mixed)
    assert torch.equal(first[0][:, 100:], second[0][:, 100:])
    assert torch.equal(first[1], second[1])


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
def test_a_bad_sequence_leaves_the_others_alone(name):
    cu = [0, 21, 45, 300]
    args = _args(cu_seqlens=cu)
    clean = _call(args)
    bad = {n: (t.clone() if torch.is_tensor(t) else t) for n, t in args.items()}
    bad[name][:, 30] = float("nan")  # sequence 1
    o, final = _call(bad)
    for n, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        if n != 1:
            assert torch.equal(o[:, start:end], clean[0][:, start:end]), n
            assert torch.equal(final[n], clean[1][n]), n


def test_host_planned_packed_calls_are_bitwise_the_same():
    cu = [0, 0, 1, 130, 300]
    args = _args(cu_seqlens=cu)
    o, final = _call(args)
    o_host, final_host = _call({**args, "cu_seqlens_cpu": torch.tensor(cu, dtype=torch.int32)})
    assert torch.equal(o, o_host) and torch.equal(final, final_host)


def test_opcheck_on_this_backend():
    args = _args(shape=KDAShape(1, 70, 2, 4, 128, 128), cu_seqlens=[0, 0, 10, 70])
    fwd = (*op_tensors(args), *op_flags(args), 64, False)
    with only_backends("chunk_kernels"):
        torch.library.opcheck(torch.ops.kda_compile.chunk_gdn_fwd.default, fwd)
