"""Launch plans of eager GDN prefill inference (``chunk_gated_delta_rule`` through ops/kda/prefill/fast_path.py with the
scalar gate): a planned call returns exactly what the ordinary path returns (bitwise: the same kernels on the same
inputs), plans are used only where GDN's backend choice runs our CUDA chunk kernels, and a planned call can be
captured in a CUDA graph. The machinery is KDA's (tests/kda/test_fast_path.py); these tests cover what GDN adds:
its gate forms (in-kernel or finished, fp32 or bf16), grouped value heads, its options in the signature."""
import pytest
import torch

from kda_compile.ops import chunk_gated_delta_rule
from kda_compile.ops.gdn.backends.registry import only_backends
from kda_compile.ops.kda.prefill import fast_path
from tests.kda.test_fast_path import (_Calls, _fresh_plans, check_captured_in_a_cuda_graph,  # noqa: F401
                                      check_gradients_take_the_op, check_no_plan_elsewhere,
                                      check_planned_equals_ordinary, env)

K = V = 128
cuda = pytest.mark.cuda
# _fresh_plans: KDA's autouse fixture, active here too (every test starts and ends with no plans)


def test_no_plan_on_the_cpu():
    q = torch.zeros(1, 4, 1, K, dtype=torch.bfloat16)
    v = torch.zeros(1, 4, 2, V, dtype=torch.bfloat16)
    g = torch.zeros(1, 4, 2)
    for _ in range(2):
        chunk_gated_delta_rule(q, q, v, g, g)
    assert fast_path.plan_count() == 0


def _inputs(B, T, H, HV, *, offsets=None, cu_dtype=torch.int32, h0=True, v_first=False, in_kernel=True,
            fp32_gate=True, neg_eig=False, seed=0):
    torch.manual_seed(seed)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    N = B if offsets is None else len(offsets) - 1
    g = torch.randn(B, T, HV, device="cuda") if in_kernel else -torch.rand(B, T, HV, device="cuda")
    beta = torch.randn(B, T, HV, device="cuda")
    state = torch.randn(N, HV, V, K, device="cuda") if v_first else torch.randn(N, HV, K, V, device="cuda")
    x = dict(q=torch.randn(B, T, H, K, **bf16), k=torch.randn(B, T, H, K, **bf16), v=torch.randn(B, T, HV, V, **bf16),
             g=g if fp32_gate else g.bfloat16(), beta=beta if fp32_gate else beta.bfloat16(),
             initial_state=state if h0 else None, output_final_state=h0, state_v_first=v_first,
             cu_seqlens=None if offsets is None else torch.tensor(offsets, device="cuda", dtype=cu_dtype),
             use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg_eig)
    if in_kernel:
        x.update(use_gate_in_kernel=True, A_log=torch.rand(HV, device="cuda"),
                 dt_bias=torch.randn(HV, device="cuda") * 0.1)
    return x


CASES = {
    "batch": dict(B=2, T=300, H=2, HV=2),
    "grouped-value-heads": dict(B=1, T=256, H=2, HV=4),
    "packed-empty-one-token": dict(B=1, T=333, H=2, HV=4, offsets=[0, 0, 100, 101, 333]),
    "packed-int64-tokens-past-the-last": dict(B=1, T=400, H=2, HV=2, offsets=[0, 130, 260], cu_dtype=torch.int64),
    "value-first-state": dict(B=2, T=200, H=2, HV=2, v_first=True),
    "no-state": dict(B=1, T=129, H=2, HV=2, h0=False),
    "finished-gate": dict(B=1, T=200, H=2, HV=2, in_kernel=False),
    "bf16-gate-and-beta-negative-eigenvalues": dict(B=1, T=200, H=2, HV=2, fp32_gate=False, neg_eig=True),
    "one-token": dict(B=1, T=1, H=2, HV=2),
}


@cuda
@pytest.mark.parametrize("case", list(CASES))
def test_planned_call_equals_the_ordinary_path(case, monkeypatch):
    check_planned_equals_ordinary(chunk_gated_delta_rule, _inputs(**CASES[case]), _Calls(monkeypatch))


@cuda
def test_no_plan_where_the_ordinary_path_runs_other_kernels(monkeypatch):
    check_no_plan_elsewhere(chunk_gated_delta_rule, _inputs(1, 200, 2, 2), _Calls(monkeypatch), [
        (env(monkeypatch, "KDA_COMPILE_PREPARE_KERNEL", "triton"), {}),  # the Triton prepare runs
        (env(monkeypatch, "KDA_COMPILE_CHECK_INPUTS", "1"), {}),  # value checks asked for: every call checks
        (only_backends("reference"), {}),
    ])


@cuda
def test_kda_and_gdn_calls_do_not_share_plans(monkeypatch):
    """GDN and KDA calls learn separate plans (the op's name leads GDN's signature options)."""
    from kda_compile.ops import chunk_kda

    x = _inputs(1, 200, 2, 2)
    with torch.inference_mode():
        for _ in range(2):
            chunk_gated_delta_rule(**x)
        g = x["g"][..., None].expand(-1, -1, -1, K).contiguous()
        kda = dict(x, g=g, dt_bias=x["dt_bias"].repeat_interleave(K), lower_bound=-5.0)
        kda.pop("state_v_first")
        for _ in range(2):
            chunk_kda(**kda)
    assert fast_path.plan_count() == 2


@cuda
def test_gradients_take_the_op(monkeypatch):
    check_gradients_take_the_op(chunk_gated_delta_rule, _inputs(1, 200, 2, 2), _Calls(monkeypatch))


@cuda
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_captured_in_a_cuda_graph(packed, monkeypatch):
    offsets = [0, 0, 100, 101, 320] if packed else None
    check_captured_in_a_cuda_graph(chunk_gated_delta_rule,
                                   lambda seed: _inputs(1, 333, 2, 4, offsets=offsets, seed=seed), _Calls(monkeypatch))
