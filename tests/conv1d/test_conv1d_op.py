"""kda_compile.ops.causal_conv1d_update: the custom op (opcheck, the in-place state under torch.compile), its
reference against Hugging Face's own function and a hand-written loop, its kernel choice and its argument errors;
the CUDA kernel inside a CUDA graph on the GPU."""
import pytest
import torch

from kda_compile.ops import causal_conv1d_update
from kda_compile.ops.conv1d.choice import choose_kernel

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def inputs(batch=2, channels=6, tokens=1, state_len=4, width=4, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, channels, generator=g).transpose(1, 2)
    state = torch.randn(batch, channels, state_len, generator=g)
    weight = torch.randn(channels, width, generator=g)
    bias = torch.randn(channels, generator=g)
    return [t.to(device, dtype) for t in (x, state, weight, bias)]


def loop(x, state, weight, bias, silu):
    """The definition, one output at a time, in float64."""
    window = torch.cat([state, x], -1).double()
    L, W, T = state.shape[-1], weight.shape[-1], x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.float64)
    for t in range(T):
        taps = window[..., L + t - W + 1: L + t + 1]
        out[..., t] = (taps * weight.double()).sum(-1) + bias.double()
    return (torch.nn.functional.silu(out) if silu else out), window[..., -L:]


@pytest.mark.parametrize("tokens, state_len, width", [(1, 4, 4), (3, 3, 4), (5, 2, 3)])
def test_the_op_matches_a_hand_written_loop_in_float64(tokens, state_len, width):
    x, state, weight, bias = inputs(tokens=tokens, state_len=state_len, width=width, dtype=torch.float64)
    want, want_state = loop(x, state, weight, bias, silu=True)
    out = causal_conv1d_update(x, state, weight, bias, "silu")
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, want_state, rtol=0, atol=0)


def test_the_op_is_hugging_faces_causal_conv1d_update():
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    hf = getattr(modeling.causal_conv1d_update, "__wrapped__", modeling.causal_conv1d_update)
    x, state, weight, bias = inputs(tokens=2, dtype=torch.bfloat16)
    hf_state = state.clone()
    want = hf(x, hf_state, weight, bias, "silu")
    out = causal_conv1d_update(x, state, weight, bias, "silu")
    assert torch.equal(out, want.contiguous()) and torch.equal(state, hf_state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(dtype):
    x, state, weight, bias = inputs(dtype=dtype)
    torch.library.opcheck(torch.ops.kda_compile.causal_conv1d_update.default, (x, state, weight, bias, "silu", "auto"))
    torch.library.opcheck(torch.ops.kda_compile.causal_conv1d_update.default, (x, state, weight, None, None, "auto"))


def test_fullgraph_compile_writes_the_state_in_place():
    x, state, weight, bias = inputs()
    eager_state = state.clone()
    want = causal_conv1d_update(x, eager_state, weight, bias, "silu")
    compiled = torch.compile(causal_conv1d_update, fullgraph=True, backend="inductor")
    out = compiled(x, state, weight, bias, "silu")
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(state, eager_state)
    out = compiled(x, state, weight, bias, "silu")  # the next step reads the rolled state
    torch.testing.assert_close(out, causal_conv1d_update(x, eager_state, weight, bias, "silu"))


def test_cpu_runs_the_reference_and_the_triton_kernel_says_why_it_cannot():
    x, state, weight, bias = inputs()
    assert choose_kernel("auto", x, state, weight) == "reference"
    with pytest.raises(ValueError, match=r"\(kernel='triton'\) but cannot run this call: .*cpu"):
        causal_conv1d_update(x, state, weight, bias, kernel="triton")


@pytest.mark.parametrize("change, pattern", [
    (lambda a: a.update(x=a["x"][0]), r"x must be a 3-D tensor, got a torch.float32 tensor of shape \[6, 1\]"),
    (lambda a: a.update(weight=a["weight"][:5]), r"weight must be \[C, W\] with C = 6"),
    (lambda a: a.update(conv_state=a["conv_state"][..., :2]), r"conv_state must be .*L >= 3"),
    (lambda a: a.update(conv_state=a["conv_state"][:1]), r"conv_state must be \[B, C, L\] = \[2, 6, L\]"),
    (lambda a: a.update(bias=a["bias"].double()), r"bias must be \[6\] of weight's dtype"),
    (lambda a: a.update(activation="gelu"), r"activation must be None, 'silu' or 'swish', got 'gelu'"),
    (lambda a: a.update(kernel="cuda"), r"kernel must be one of 'auto', 'triton', 'reference', got 'cuda'"),
    (lambda a: a["weight"].requires_grad_(), r"no backward: run it under torch.no_grad"),
])
def test_bad_arguments_name_themselves(change, pattern):
    x, state, weight, bias = inputs()
    args = {"x": x, "conv_state": state, "weight": weight, "bias": bias, "activation": "silu", "kernel": "auto"}
    change(args)
    with pytest.raises((ValueError, TypeError), match=pattern):
        causal_conv1d_update(**args)


def test_no_gradient_is_needed_under_no_grad():
    x, state, weight, bias = inputs()
    weight.requires_grad_()
    with torch.no_grad():
        assert causal_conv1d_update(x, state, weight, bias, "silu").shape == x.shape


@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernel_replays_in_a_cuda_graph_and_rolls_the_state(dtype):
    x, state, weight, bias = inputs(batch=2, channels=12288, dtype=dtype, device="cuda")
    ref_state = state.clone()
    assert choose_kernel("auto", x, state, weight) == "triton"
    torch.library.opcheck(torch.ops.kda_compile.causal_conv1d_update.default, (x, state.clone(), weight, bias,
                                                                               "silu", "auto"))
    causal_conv1d_update(x, state.clone(), weight, bias, "silu")  # compile the kernel before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = causal_conv1d_update(x, state, weight, bias, "silu")
    for _ in range(3):  # each replay rolls the state once more
        graph.replay()
        want = causal_conv1d_update(x, ref_state, weight, bias, "silu", kernel="reference")
        torch.testing.assert_close(out, want, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
        torch.testing.assert_close(state, ref_state, rtol=0, atol=0)
