"""The public ``block_sparse_attention`` and its custom ops: against a per-row oracle (naive.py) in float64 on
fresh random inputs (relative error, Frobenius, under 1e-12: float64 throughout); gradients by gradcheck in
float64; ``torch.library.opcheck`` on contiguous and non-contiguous inputs; ``torch.compile(fullgraph=True,
dynamic=True)``: one graph across Sq / T / K, gradients through it; the values of ``block_indices``; no keys."""
import pytest
import torch
from hypothesis import given, settings

from kda_compile.ops import block_sparse_attention
from kda_compile.testing import BlockSparseCase, assert_rel_close, block_sparse_inputs, make_block_sparse_args
from tests.block_sparse.naive import naive_block_sparse_attention

OPCHECK_CASES = {
    "gqa-positions-padding": BlockSparseCase(b=2, heads=4, groups=2, sq=3, t=20, dim=8, dv=6, block_size=8,
                                             slots=3, positions=True, padding=True, repeats=True),
    "transposed-decode": BlockSparseCase(b=2, heads=3, groups=1, sq=1, t=17, dim=8, dv=8, block_size=4, slots=2,
                                         transposed=True),
}


@settings(max_examples=20)
@given(block_sparse_inputs(dtypes=(torch.float64,)))
def test_op_matches_the_per_row_oracle(args):
    out = block_sparse_attention(**args)
    assert out.dtype == torch.float64 and out.shape == (*args["query"].shape[:3], args["value"].shape[-1])
    assert_rel_close(out, naive_block_sparse_attention(**args), 1e-12, name="out")


@pytest.mark.parametrize("name", list(OPCHECK_CASES))
def test_gradcheck(name):
    args = make_block_sparse_args(OPCHECK_CASES[name], torch.float64, seed=4, requires_grad=True)
    tensors = (args.pop("query"), args.pop("key"), args.pop("value"))
    assert torch.autograd.gradcheck(lambda q, k, v: block_sparse_attention(q, k, v, **args), tensors)


@pytest.mark.parametrize("name", list(OPCHECK_CASES))
def test_opcheck(name, device):
    case = OPCHECK_CASES[name]
    args = make_block_sparse_args(case, torch.float64, device, seed=5, requires_grad=True)
    extra = (args["query_positions"], args["key_padding_mask"], case.block_size, 0.4)
    tensors = (args["query"], args["key"], args["value"], args["block_indices"])
    torch.library.opcheck(torch.ops.kda_compile.block_sparse_attention_fwd.default, (*tensors, *extra))
    grad_out = torch.randn(case.sq, case.b, case.heads, case.dv, dtype=torch.float64, device=device)
    grad_out = grad_out.permute(1, 2, 0, 3)  # non-contiguous
    plain = [t.detach() for t in tensors[:3]]
    with torch.no_grad():
        out, lse = torch.ops.kda_compile.block_sparse_attention_fwd(*tensors, *extra)
    torch.library.opcheck(torch.ops.kda_compile.block_sparse_attention_bwd.default,
                          (grad_out, *plain, args["block_indices"], *extra[:2], out, lse, *extra[2:]))


def _layer(q, k, v, idx, positions):
    return block_sparse_attention(q, k, v, idx, block_size=4, query_positions=positions).sum(1)


def test_compile_fullgraph_dynamic_one_graph_and_gradients():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_layer, backend=counter, fullgraph=True, dynamic=True)
    for seed, (sq, t, slots) in enumerate([(5, 11, 3), (9, 23, 5), (7, 30, 6)]):  # sizes apart: no duck sizing
        case = BlockSparseCase(b=2, heads=4, groups=2, sq=sq, t=t, dim=8, dv=8, block_size=4, slots=slots,
                               positions=True)
        args = make_block_sparse_args(case, torch.float64, seed=seed, requires_grad=True)
        inputs = (args["query"], args["key"], args["value"], args["block_indices"], args["query_positions"])
        got = compiled(*inputs)
        ref_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        want = _layer(*ref_inputs)
        assert_rel_close(got, want, 1e-12, name="compiled vs eager")
        got.sum().backward()
        want.sum().backward()
        for a, r in zip(inputs[:3], ref_inputs[:3]):
            assert_rel_close(a.grad, r.grad, 1e-12, name="gradient through the compiled graph")
    assert counter.frame_count == 1, "dynamic Sq / T / K must not recompile"
    torch._dynamo.reset()


def test_graph_holds_the_op():
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    args = make_block_sparse_args(OPCHECK_CASES["gqa-positions-padding"], seed=6)
    torch.compile(lambda a: block_sparse_attention(**a), backend=capture, fullgraph=True)(args)
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("block_sparse_attention_fwd" in t for t in targets), targets
    torch._dynamo.reset()


@pytest.mark.parametrize("value", [5, 6, 1000, -2, -(2**40)])
@pytest.mark.parametrize("mode", ["eager", "autograd", "compiled"])
def test_block_indices_outside_minus_one_to_the_block_count_are_refused(value, mode):
    args = make_block_sparse_args(OPCHECK_CASES["gqa-positions-padding"], seed=7)  # T = 20, 8-slot blocks: 3
    args["block_size"] = 4  # 5 blocks
    args["block_indices"][1, 0, 2, 1] = value
    if mode == "autograd":
        args["query"].requires_grad_(True)
    call = lambda: block_sparse_attention(**args)  # noqa: E731
    if mode == "compiled":
        torch._dynamo.reset()
        call = lambda: torch.compile(lambda a: block_sparse_attention(**a), backend="aot_eager",  # noqa: E731
                                     fullgraph=True)(args)
    with pytest.raises(ValueError) as raised:
        call()
    torch._dynamo.reset()
    assert str(raised.value).splitlines()[0] == (
        f"block_indices must be -1 (empty slot) or block indices in [0, ceil(T / block_size)) = [0, 5), got "
        f"{value} at block_indices[1, 0, 2, 1] (1 entries out of range)")


def test_no_keys_give_zeros_and_zero_gradients():
    q = torch.randn(1, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 0, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 0, 4, dtype=torch.float64, requires_grad=True)
    out = block_sparse_attention(q, k, v, torch.full((1, 1, 3, 2), -1), block_size=16)
    assert torch.equal(out, torch.zeros(1, 2, 3, 4, dtype=torch.float64))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_op_runs_the_kernel_and_matches_the_reference(dtype):
    from kda_compile.ops._common import clear_fallback_events, fallback_events

    tolerance = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    clear_fallback_events()
    case = BlockSparseCase(b=2, heads=8, groups=2, sq=33, t=300, dim=64, dv=64, block_size=128, slots=3,
                           positions=True, padding=True, repeats=True)
    args = make_block_sparse_args(case, dtype, "cuda", seed=8)
    leaves = [args[n].requires_grad_() for n in ("query", "key", "value")]
    out = block_sparse_attention(**args)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, grad_out)
    assert not fallback_events()
    cpu = {n: (t.detach().double().cpu().requires_grad_() if t.is_floating_point() else t.cpu())
           if isinstance(t, torch.Tensor) else t for n, t in args.items()}
    expected = block_sparse_attention(**cpu)
    assert_rel_close(out, expected, tolerance, name="out")
    expected_grads = torch.autograd.grad(expected, [cpu[n] for n in ("query", "key", "value")], grad_out.cpu().double())
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected_grads):
        assert_rel_close(got, want, 2 * tolerance, name=name)


@pytest.mark.cuda
def test_cuda_fallbacks_are_recorded():
    from kda_compile.ops._common import clear_fallback_events, fallback_events

    clear_fallback_events()
    case = BlockSparseCase(b=1, heads=2, groups=1, sq=4, t=40, dim=16, dv=16, block_size=12, slots=2)
    args = make_block_sparse_args(case, torch.float32, "cuda", seed=9, requires_grad=True)
    block_sparse_attention(**args).sum().backward()
    events = fallback_events()
    assert {event.chosen for event in events} == {"torch reference", "torch reference backward"}, events
    assert all("block_size 12 is not a multiple of 16" in event.reason for event in events), events


@pytest.mark.parametrize("b, sq", [(0, 3), (2, 0)])
def test_no_queries_give_an_empty_output(b, sq):
    q, k, v = torch.randn(b, 2, sq, 8), torch.randn(b, 1, 9, 8), torch.randn(b, 1, 9, 4)
    out = block_sparse_attention(q, k, v, torch.zeros(b, 1, sq, 2, dtype=torch.long), block_size=4)
    assert out.shape == (b, 2, sq, 4)
