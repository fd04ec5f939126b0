"""The attention op on CUDA: every implementation against the naive fp64 softmax, which one serves
which case, no [Sq, Sk] memory, and torch.compile with Inductor.

GPU box: ``python -m pytest tests/attention/test_attention_cuda.py -m cuda``.
Tolerances (relative RMS error against float64 on the same rounded inputs): bfloat16 2e-2 (out, lse)
and 4e-2 (gradients), float16 5e-3 / 1e-2 (naive.OUT_TOL / GRAD_TOL).
"""
import pytest
import torch

from kda_compile.ops._common import clear_fallback_events, fallback_events
from kda_compile.ops.attention import attention, attention_backend, explain_dispatch
from kda_compile.testing import assert_rel_close

from .naive import Case, check_against_naive, make_inputs

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")

CASES = {  # head dims the SDPA kernels accept, odd lengths on purpose
    "causal-mha-d128": Case(b=2, h=4, hkv=4, sq=130, sk=130, dqk=128, dv=128, causal=True),
    "causal-gqa-d64": Case(h=8, hkv=2, sq=96, sk=96, dqk=64, dv=64, causal=True),
    "mla-192-128": Case(h=4, hkv=4, sq=80, sk=80, dqk=192, dv=128, causal=True),
    "chunked-prefill": Case(h=4, hkv=2, sq=40, sk=200, dqk=64, dv=64, causal=True),
    "decode": Case(b=3, h=8, hkv=2, sq=1, sk=300, dqk=128, dv=128, causal=True),
    "window": Case(h=4, hkv=2, sq=150, sk=150, dqk=64, dv=64, causal=True, window=33),
    "bool-mask-empty-rows": Case(b=2, h=4, hkv=4, sq=64, sk=64, dqk=64, dv=64, mask="bool", mask_shape="b1",
                                 dead_rows=True),
    "float-mask-causal": Case(h=4, hkv=4, sq=72, sk=72, dqk=64, dv=64, causal=True, mask="float", mask_shape="11"),
    "sinks-gqa": Case(h=8, hkv=2, sq=100, sk=100, dqk=64, dv=64, causal=True, sinks=True),
    "sinks-window-decode": Case(h=8, hkv=2, sq=1, sk=100, dqk=64, dv=64, causal=True, window=16, sinks=True),
    "sq>sk": Case(h=2, hkv=2, sq=70, sk=20, dqk=64, dv=64, causal=True),
    "softcap": Case(h=4, hkv=2, sq=90, sk=90, dqk=64, dv=64, causal=True, softcap=30.0),
    "transposed-fused-kv": Case(b=2, h=4, hkv=2, sq=77, sk=77, dqk=64, dv=64, causal=True, noncontiguous=True),
}
IMPLEMENTATIONS = ["auto", "cudnn", "flash", "efficient", "triton"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", list(CASES))
def test_every_implementation_matches_naive(name, impl, dtype):
    case = CASES[name]
    args, kw = make_inputs(case, dtype, CUDA)
    call = {n: kw[n] for n in ("attn_mask", "is_causal", "softcap", "sliding_window")}
    float_mask = kw["attn_mask"] is not None and kw["attn_mask"].is_floating_point()  # it will need a gradient
    servable = {}
    with attention_backend(impl):
        for backward in (False, True):  # a forced SDPA backend that cannot serve a case says so
            try:
                explain_dispatch(*args, **call, backward=backward, mask_needs_grad=backward and float_mask)
                servable[backward] = True
            except ValueError as exc:
                assert impl in ("cudnn", "flash", "efficient") and "cannot serve" in str(exc), exc
                servable[backward] = False
        if not servable[False]:
            pytest.skip(f"{impl} does not serve {name}")
        # Gradients through lse always take the Triton backward: checked with "auto" / "triton" only.
        check_against_naive(case, dtype, CUDA, grads=servable[True], lse_grads=impl in ("auto", "triton"))


def test_float32_and_float64():
    check_against_naive(CASES["sinks-gqa"], torch.float32, CUDA)
    check_against_naive(CASES["window"].with_(sq=40, sk=40), torch.float64, CUDA)


@pytest.mark.parametrize("case,kwargs,backward,allowed", [
    (CASES["causal-mha-d128"], {}, False, {"cudnn", "flash"}),
    (CASES["causal-mha-d128"], {}, True, {"cudnn", "flash"}),
    (CASES["chunked-prefill"], {}, False, {"flash"}),
    (CASES["window"], {}, True, {"flash"}),
    (CASES["mla-192-128"], {}, True, {"cudnn", "efficient"}),
    (CASES["bool-mask-empty-rows"], {}, False, {"cudnn", "efficient"}),
    (CASES["bool-mask-empty-rows"], {}, True, {"efficient"}),
    (CASES["softcap"], {}, False, {"triton"}),
    (CASES["causal-gqa-d64"], {"dropout_p": 0.1}, False, {"triton"}),
    (CASES["float-mask-causal"], {"mask_needs_grad": True}, True, {"triton"}),
    (CASES["causal-gqa-d64"], {"lse_grad": True}, True, {"triton"}),
], ids=lambda x: None)
def test_dispatch_picks_the_expected_implementation(case, kwargs, backward, allowed):
    args, kw = make_inputs(case, torch.bfloat16, CUDA)
    call = {n: kw[n] for n in ("attn_mask", "is_causal", "softcap", "sliding_window")}
    impl, reason = explain_dispatch(*args, **call, backward=backward, **kwargs)
    assert impl in allowed, f"{impl} ({reason})"


def test_float64_runs_the_reference_and_logs_it():
    clear_fallback_events()
    args, kwargs = make_inputs(CASES["decode"], torch.float64, CUDA)
    attention(*args, **kwargs)
    assert any(e.chosen == "reference" for e in fallback_events())


@pytest.mark.parametrize("impl,extra", [("auto", {}), ("cudnn", {}), ("flash", {}), ("efficient", {}),
                                        ("triton", {}), ("auto", {"softcap": 30.0}), ("auto", {"sliding_window": 512})])
def test_no_score_matrix_is_materialised(impl, extra):
    # 8 heads x 8192^2 scores would take 1 GiB in bf16; inputs are 8 MiB each.
    b, h, t, d = 1, 8, 8192, 64
    q, k, v = (torch.randn(b, t, h, d, device=CUDA, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
               for _ in range(3))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with attention_backend(impl):
        try:
            out = attention(q, k, v, is_causal=True, **extra)
        except ValueError as exc:
            pytest.skip(str(exc))
        out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    extra_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    assert extra_mib < 128, f"{impl}: {extra_mib:.0f} MiB above the inputs"


def _loss(q, k, v, **kw):
    return attention(q, k, v, **kw).float().square().mean()


@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(is_causal=True, softcap=20.0),
                                dict(is_causal=True, sliding_window=24)], ids=["causal", "softcap", "window"])
def test_inductor_fullgraph_matches_eager(kw):
    args, _ = make_inputs(Case(b=2, h=8, hkv=2, sq=100, sk=100, dqk=64, dv=64, noncontiguous=True), torch.bfloat16,
                          CUDA, requires_grad=True)
    compiled = torch.compile(lambda q, k, v: _loss(q, k, v, **kw), fullgraph=True)
    loss_c = compiled(*args)
    grads_c = torch.autograd.grad(loss_c, args)
    loss_e = _loss(*args, **kw)
    grads_e = torch.autograd.grad(loss_e, args)
    assert_rel_close(loss_c, loss_e, 1e-3, name="loss")
    for a, b in zip(grads_c, grads_e):
        assert_rel_close(a, b, 1e-2, name="grad")


def test_inductor_dynamic_lengths_do_not_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(lambda q, k, v: _loss(q, k, v, is_causal=True), backend=counter, dynamic=True,
                             fullgraph=True)
    frames = None
    for t in (129, 257, 513):
        args, _ = make_inputs(Case(h=8, hkv=2, sq=t, sk=t, dqk=64, dv=64, noncontiguous=True), torch.bfloat16,
                              CUDA, requires_grad=True)
        compiled(*args).backward()
        frames = frames or counter.frame_count
    assert counter.frame_count == frames


def test_dropout_trains_under_inductor():
    args, _ = make_inputs(Case(h=4, hkv=2, sq=64, sk=64, dqk=64, dv=64), torch.bfloat16, CUDA, requires_grad=True)
    compiled = torch.compile(lambda q, k, v: _loss(q, k, v, is_causal=True, dropout_p=0.1), fullgraph=True)
    loss = compiled(*args)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(a.grad).all() for a in args)


def test_cuda_graphs_are_kept_under_reduce_overhead():
    # Every output of the op lives on the GPU (the dropout seed too), so Inductor keeps CUDA graphs.
    from torch._dynamo.utils import counters

    counters.clear()
    args, _ = make_inputs(Case(h=8, hkv=2, sq=1, sk=256, dqk=64, dv=64, noncontiguous=True), torch.bfloat16, CUDA)
    compiled = torch.compile(lambda q, k, v: attention(q, k, v, is_causal=True) * 2, mode="reduce-overhead",
                             fullgraph=True)
    for _ in range(3):
        out = compiled(*args)
    assert_rel_close(out, attention(*args, is_causal=True) * 2, 1e-2, name="out")
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
