"""kda_compile.ops.moe_experts: the custom op (opcheck, autograd, torch.compile), its kernel choice and its
argument errors; CUDA kernels against the float64 reference on the GPU."""
import pytest
import torch

from kda_compile.ops import moe_experts
from kda_compile.ops.moe.choice import PAIRS_PER_EXPERT, choose_kernel
from kda_compile.ops.moe.reference import moe_experts_reference

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def routed(tokens=5, top_k=2, experts=4, width=24, inter=16, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=g)
    index = torch.randint(0, experts, (tokens, top_k), generator=g)
    weights = torch.rand(tokens, top_k, generator=g)
    gate_up = torch.randn(experts, 2 * inter, width, generator=g) / width ** 0.5
    down = torch.randn(experts, width, inter, generator=g) / inter ** 0.5
    return [t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in (x, index, weights, gate_up, down)]


def test_the_op_matches_a_hand_written_loop_in_float64():
    x, index, weights, gate_up, down = routed(dtype=torch.float64)
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = index[t, j]
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            want[t] += weights[t, j] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(moe_experts(x, index, weights, gate_up, down), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(dtype):
    x, index, weights, gate_up, down = routed(dtype=dtype)
    for t in (x, weights, gate_up, down):
        t.requires_grad_()
    torch.library.opcheck(torch.ops.kda_compile.moe_experts.default, (x, index, weights, gate_up, down, "auto"))


def test_gradients_match_finite_differences():
    inputs = routed(tokens=3, top_k=2, experts=3, width=6, inter=4, dtype=torch.float64)
    x, index, weights, gate_up, down = [t.requires_grad_() if t.is_floating_point() else t for t in inputs]
    torch.autograd.gradcheck(lambda a, w, gu, d: moe_experts(a, index, w, gu, d), (x, weights, gate_up, down))


def test_fullgraph_compile_gives_the_eager_result():
    inputs = routed()
    compiled = torch.compile(moe_experts, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*inputs), moe_experts(*inputs))


def test_cpu_and_float64_run_the_reference_and_explicit_kernels_say_why_they_cannot():
    x, index, weights, gate_up, down = routed()
    assert choose_kernel("auto", x, index, gate_up, down) == "reference"
    with pytest.raises(ValueError, match=r"\(kernel='grouped_mm'\) but cannot run this call: .*CUDA"):
        moe_experts(x, index, weights, gate_up, down, kernel="grouped_mm")


@pytest.mark.parametrize("change, pattern", [
    (lambda a: a.__setitem__(0, a[0][0]), r"hidden_states must be a 2-D tensor, got a torch.float32 tensor of shape"),
    (lambda a: a.__setitem__(1, a[1].float()), r"top_k_index must be .*of dtype int32, int64"),
    (lambda a: a.__setitem__(2, a[2][:, :1]), r"top_k_weights must be of top_k_index's shape \[5, 2\]"),
    (lambda a: a.__setitem__(1, a[1][:4]), r"top_k_index must be \[T, K\] with T = 5"),
    (lambda a: a.__setitem__(3, a[3][:, :31]), r"gate_up_proj must be \[E, 2I, H\] .*an even middle size"),
    (lambda a: a.__setitem__(3, a[3][:, :, :20]), r"gate_up_proj must be .*H = 24"),
    (lambda a: a.__setitem__(4, a[4][:, :, :8]), r"down_proj must be \[E, H, I\] = \[4, 24, 16\]"),
    (lambda a: a.__setitem__(4, a[4].double()), r"down_proj must be of hidden_states' dtype torch.float32"),
    (lambda a: a.__setitem__(2, a[2].long()), r"top_k_weights must be a floating tensor"),
])
def test_bad_arguments_name_themselves(change, pattern):
    args = routed()
    change(args)
    with pytest.raises((ValueError, TypeError), match=pattern):
        moe_experts(*args)


def test_a_bad_kernel_name_is_refused_eagerly_and_under_fullgraph_compile():
    args = routed()
    with pytest.raises(ValueError, match=r"kernel must be one of 'auto', 'triton', 'grouped_mm', 'reference', got"):
        moe_experts(*args, kernel="cutlass")
    compiled = torch.compile(lambda *a: moe_experts(*a, kernel="cutlass"), fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match="kernel must be one of"):
        compiled(*args)


@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 64, 2048])
@pytest.mark.parametrize("kernel", ["auto", "triton", "grouped_mm"])
def test_cuda_kernels_match_the_reference_in_bfloat16(kernel, tokens):
    inputs = routed(tokens=tokens, top_k=8, experts=64, width=256, inter=128, dtype=torch.bfloat16, device="cuda")
    inputs[1][0, -1] = 64  # a sentinel slot
    out = moe_experts(*inputs, kernel=kernel)
    ref = moe_experts_reference(*[t.double() if t.is_floating_point() else t for t in inputs])
    assert not out.isnan().any()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-2


@CUDA
@pytest.mark.cuda
def test_cuda_auto_takes_the_triton_kernels_for_decode_and_the_grouped_gemm_for_prefill():
    x, index, weights, gate_up, down = routed(tokens=64, top_k=8, experts=64, dtype=torch.bfloat16, device="cuda")
    assert choose_kernel("auto", x, index, gate_up, down) == "triton"
    many = torch.zeros(PAIRS_PER_EXPERT * 64 // 8 + 1, 8, dtype=torch.long, device="cuda")
    assert choose_kernel("auto", x, many, gate_up, down) == "grouped_mm"


@CUDA
@pytest.mark.cuda
def test_cuda_opcheck_and_graph_replay():
    inputs = routed(tokens=8, top_k=4, experts=16, width=64, inter=32, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(torch.ops.kda_compile.moe_experts.default, (*inputs, "auto"))
    static = [t.clone() for t in inputs]
    moe_experts(*static)  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts(*static)
    fresh = routed(tokens=8, top_k=4, experts=16, width=64, inter=32, dtype=torch.bfloat16, device="cuda", seed=1)
    for s, f in zip(static, fresh):
        s.copy_(f)
    graph.replay()
    torch.testing.assert_close(out, moe_experts(*fresh), rtol=0, atol=0)
