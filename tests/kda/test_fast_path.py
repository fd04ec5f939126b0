"""Launch plans of eager KDA prefill inference (ops/kda/prefill/fast_path.py): a planned call returns exactly what the
ordinary path returns (bitwise: the same kernels on the same inputs), plans are used only where the ordinary path
would run our CUDA kernels, the value checks still run, and a planned call can be captured in a CUDA graph."""
import contextlib

import pytest
import torch

from kda_compile.ops import chunk_kda
from kda_compile.ops.kda.prefill import fast_path
from kda_compile.ops.kda.backends.registry import only_backends

K = V = 128
LB = -5.0
cuda = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _fresh_plans():
    fast_path.clear_plans()
    yield
    fast_path.clear_plans()


# ---- CPU --------------------------------------------------------------------------------------------------
def test_no_signature_for_calls_no_plan_serves():
    q = torch.zeros(1, 4, 1, K, dtype=torch.bfloat16)
    assert fast_path.signature(q, q, q, q, q[..., 0], None, None, None, None, None, ()) is None  # CPU
    chunk_kda(q, q, q, q.float(), q[..., 0].float(), use_gate_in_kernel=True, lower_bound=LB)
    assert fast_path.plan_count() == 0


def test_the_environment_reader_sees_every_change(monkeypatch):
    monkeypatch.delenv("KDA_COMPILE_SCAN_KERNEL", raising=False)
    before = fast_path._environment()
    monkeypatch.setenv("KDA_COMPILE_SCAN_KERNEL", "triton")
    index = fast_path._ENVIRONMENT.index("KDA_COMPILE_SCAN_KERNEL")
    assert fast_path._environment()[index] in ("triton", b"triton")
    monkeypatch.delenv("KDA_COMPILE_SCAN_KERNEL")
    assert fast_path._environment() == before


def test_the_signature_reads_the_switches_the_kernel_choice_reads():
    pytest.importorskip("triton")
    from kda_compile.ops.kda.prefill.cuda import prepare as cuda_prepare
    from kda_compile.ops.kda.prefill.cuda import scan as cuda_scan
    from kda_compile.ops.kda.prefill import run as triton_chunk
    from kda_compile.ops.envs import CHECK_INPUTS as CHECK_INPUTS_ENV

    for name in (triton_chunk.SEGMENTS_ENV, cuda_prepare.KERNEL_ENV, cuda_scan.KERNEL_ENV, CHECK_INPUTS_ENV):
        assert name in fast_path._ENVIRONMENT


def test_workspace_regions_are_aligned_and_disjoint():
    lay = fast_path._layout(tokens=300, HV=3, slots=9, num_seqs=4)
    starts = [lay.w, lay.u, lay.qg, lay.kd, lay.a_qk, lay.decay, lay.chunk_offsets]
    assert all(s % fast_path.ALIGN == 0 for s in starts) and starts == sorted(starts)
    assert lay.u - lay.w >= 300 * 3 * K * 2 and lay.decay - lay.a_qk >= 300 * 3 * 64 * 2
    assert lay.size - lay.chunk_offsets >= 5 * 4


# ---- CUDA -------------------------------------------------------------------------------------------------
def _inputs(B, T, H, HV, *, offsets=None, cu_dtype=torch.int32, h0=True, v_first=False, fp32_gate=False, seed=0,
            lower_bound=LB):
    torch.manual_seed(seed)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    N = B if offsets is None else len(offsets) - 1
    g = torch.randn(B, T, HV, K, device="cuda")
    beta = torch.randn(B, T, HV, device="cuda")
    state = torch.randn(N, HV, V, K, device="cuda") if v_first else torch.randn(N, HV, K, V, device="cuda")
    return dict(q=torch.randn(B, T, H, K, **bf16), k=torch.randn(B, T, H, K, **bf16),
                v=torch.randn(B, T, HV, V, **bf16), g=g if fp32_gate else g.bfloat16(),
                beta=beta if fp32_gate else beta.bfloat16(),
                A_log=torch.rand(HV, device="cuda"), dt_bias=torch.randn(HV * K, device="cuda") * 0.1,
                initial_state=state if h0 else None, output_final_state=h0, state_v_first=v_first,
                cu_seqlens=None if offsets is None else torch.tensor(offsets, device="cuda", dtype=cu_dtype),
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                lower_bound=lower_bound)


class _Calls:
    """Counts planned calls."""

    def __init__(self, monkeypatch):
        self.n = 0
        original = fast_path.Plan.__call__

        def counted(plan, *args):
            self.n += 1
            return original(plan, *args)
        monkeypatch.setattr(fast_path.Plan, "__call__", counted)


def _poison_free_memory(nbytes: int) -> None:
    """Leave NaN in freed blocks of the caching allocator, so a planned output that is not fully written shows."""
    torch.full((nbytes // 2 + 4096,), float("nan"), device="cuda", dtype=torch.bfloat16)


CASES = {
    "batch": dict(B=2, T=300, H=2, HV=2),
    "grouped-value-heads": dict(B=1, T=256, H=2, HV=4),
    "packed-empty-one-token": dict(B=1, T=333, H=2, HV=2, offsets=[0, 0, 100, 101, 333]),
    "packed-int64-tokens-past-the-last": dict(B=1, T=400, H=2, HV=2, offsets=[0, 130, 260], cu_dtype=torch.int64),
    "value-first-state": dict(B=2, T=200, H=2, HV=2, v_first=True),
    "no-state": dict(B=1, T=129, H=2, HV=2, h0=False),
    "fp32-gate-and-beta": dict(B=1, T=200, H=2, HV=2, fp32_gate=True),
    "one-token": dict(B=1, T=1, H=2, HV=2),
    "softplus-packed": dict(B=1, T=333, H=2, HV=4, offsets=[0, 0, 100, 101, 333], lower_bound=None),
    "wide-lower-bound": dict(B=2, T=200, H=2, HV=2, lower_bound=-20.0),
}


def check_planned_equals_ordinary(op, x, calls):
    """The first two calls of a signature take the ordinary path (the second learns the plan); the next two take
    the plan and return bitwise the same, over freed memory left full of NaN. Shared with GDN's tests."""
    with torch.inference_mode():
        o_ref, s_ref = op(**x)  # the ordinary path: a signature seen once gets no plan
        assert fast_path.plan_count() == 0
        op(**x)  # seen twice: the plan is learned
        assert fast_path.plan_count() == 1 and calls.n == 0
        for _ in range(2):
            _poison_free_memory(o_ref.numel() * 2 * 8)
            o, s = op(**x)
            assert torch.equal(o, o_ref)
            assert (s is None and s_ref is None) or torch.equal(s, s_ref)
    assert calls.n == 2
    assert o.shape == o_ref.shape and not o.isnan().any()


def check_gradients_take_the_op(op, x, calls):
    with torch.no_grad():
        op(**x)
        op(**x)
    q = x["q"].clone().requires_grad_()
    o, _ = op(**{**x, "q": q})
    assert o.grad_fn is not None and calls.n == 0


def check_captured_in_a_cuda_graph(op, make_inputs, calls):
    """A planned call captured in a CUDA graph and replayed on fresh inputs equals an eager call on them.
    ``make_inputs(seed)``: the call's keyword arguments. Shared with GDN's tests."""
    static = {name: (t.clone() if isinstance(t, torch.Tensor) else t) for name, t in make_inputs(0).items()}
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            op(**static)  # learns the plan
            op(**static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_graph, s_graph = op(**static)
        for seed in (1, 2):  # replayed twice: the graph's kernels and workspace serve every replay
            fresh = make_inputs(seed)
            for name, t in fresh.items():
                if isinstance(t, torch.Tensor) and name != "cu_seqlens":
                    static[name].copy_(t)
            graph.replay()
            torch.cuda.synchronize()
            o_eager, s_eager = op(**{**fresh, "cu_seqlens": static["cu_seqlens"]})
            assert torch.equal(o_graph, o_eager) and torch.equal(s_graph, s_eager), seed
    assert calls.n >= 2


@cuda
@pytest.mark.parametrize("case", list(CASES))
def test_planned_call_equals_the_ordinary_path(case, monkeypatch):
    check_planned_equals_ordinary(chunk_kda, _inputs(**CASES[case]), _Calls(monkeypatch))


@contextlib.contextmanager
def env(monkeypatch, name: str, value: str):
    """``name=value`` in the environment inside the block only."""
    monkeypatch.setenv(name, value)
    try:
        yield
    finally:
        monkeypatch.delenv(name)


def check_no_plan_elsewhere(op, x, calls, elsewhere) -> None:
    """``op(**x)`` twice keeps one plan; each of ``elsewhere``, a ``(context manager, keyword overrides)`` pair, is
    a new signature whose ordinary path runs other kernels (or checks values): called twice, it keeps no plan. No
    call is planned."""
    with torch.inference_mode():
        op(**x)
        op(**x)
        for context, overrides in elsewhere:
            with context:
                op(**{**x, **overrides})
                op(**{**x, **overrides})
    assert fast_path.plan_count() == 1 and calls.n == 0


@cuda
def test_no_plan_where_the_ordinary_path_runs_other_kernels(monkeypatch):
    check_no_plan_elsewhere(chunk_kda, _inputs(1, 200, 2, 2), _Calls(monkeypatch), [
        (env(monkeypatch, "KDA_COMPILE_PREPARE_KERNEL", "triton"), {}),  # the Triton prepare runs
        (only_backends("fla"), {}),
        (contextlib.nullcontext(), {"use_gate_in_kernel": False, "A_log": None, "dt_bias": None}),  # a finished gate
    ])


@cuda
def test_no_plan_while_value_checks_are_asked_for(monkeypatch):
    """``KDA_COMPILE_CHECK_INPUTS=1``: every call runs the ordinary path, whose op checks the values."""
    calls = _Calls(monkeypatch)
    monkeypatch.setenv("KDA_COMPILE_CHECK_INPUTS", "1")
    x = _inputs(1, 200, 2, 2)
    with torch.inference_mode():
        for _ in range(3):
            chunk_kda(**x)
    assert fast_path.plan_count() == 0 and calls.n == 0


@cuda
def test_a_bad_argument_reaches_the_argument_checks():
    x = _inputs(1, 64, 2, 2)
    with torch.inference_mode():
        for _ in range(2):
            chunk_kda(**x)
        for bad in ([1, 2], None):
            with pytest.raises(TypeError, match="k must be a (torch.T|t)ensor"):
                chunk_kda(**{**x, "k": bad})


@cuda
def test_plans_switched_off(monkeypatch):
    calls = _Calls(monkeypatch)
    monkeypatch.setenv(fast_path.PLANS_ENV, "0")
    x = _inputs(1, 200, 2, 2)
    with torch.inference_mode():
        chunk_kda(**x)
        chunk_kda(**x)
    assert fast_path.plan_count() == 0 and calls.n == 0


@cuda
def test_gradients_take_the_op(monkeypatch):
    check_gradients_take_the_op(chunk_kda, _inputs(1, 200, 2, 2), _Calls(monkeypatch))


@cuda
def test_host_offsets_are_still_checked():
    x = _inputs(1, 200, 2, 2, offsets=[0, 50, 200])
    good = torch.tensor([0, 50, 200])
    with torch.inference_mode():
        chunk_kda(**x, cu_seqlens_cpu=good)
        chunk_kda(**x, cu_seqlens_cpu=good)
        with pytest.raises(ValueError, match="cu_seqlens_cpu"):
            chunk_kda(**x, cu_seqlens_cpu=torch.tensor([0, 250, 200]))


@cuda
def test_side_stream_and_another_current_device(monkeypatch):
    calls = _Calls(monkeypatch)
    x = _inputs(2, 300, 2, 2)
    with torch.inference_mode():
        chunk_kda(**x)
        o_ref, s_ref = chunk_kda(**x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            o, s = chunk_kda(**x)
        torch.cuda.current_stream().wait_stream(stream)
        assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
        if torch.cuda.device_count() > 1:
            with torch.cuda.device(1):
                o, s = chunk_kda(**x)
            assert torch.equal(o, o_ref)
    assert calls.n >= 1


@cuda
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_captured_in_a_cuda_graph(packed, monkeypatch):
    offsets = [0, 0, 100, 101, 320] if packed else None
    check_captured_in_a_cuda_graph(chunk_kda, lambda seed: _inputs(1, 333, 2, 2, offsets=offsets, seed=seed),
                                   _Calls(monkeypatch))
