"""The host side of a KDA prefill call: eager inference goes straight to the backend (no custom-op dispatcher),
packed sequences are planned from the caller's host copy of ``cu_seqlens`` when there is one, and a call can be
captured in a CUDA graph. Same results as the op path and as planning on the device.

The Triton launcher runs on CUDA, or on CPU under the Triton interpreter (small shapes, float32).
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kda_compile.ops import chunk_kda
from kda_compile.ops.kda import api, custom_ops
from kda_compile.testing import KDAShape, make_kda_args, rel_error

from triton_device import triton_device  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class _CountKdaOps(TorchDispatchMode):
    """Counts calls of the ``kda_compile::chunk_kda_fwd`` op (and, being a dispatch mode, forces the op path)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "chunk_kda_fwd" in str(func):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _call_kwargs(args):
    skip = ("q", "k", "v", "g", "beta")
    return {key: value for key, value in args.items() if key not in skip}


@pytest.mark.parametrize("cu_seqlens", [None, [0, 5, 5, 40, 70]], ids=["batched", "packed"])
def test_eager_inference_skips_the_dispatcher_and_matches_the_op(device, cu_seqlens):
    shape = KDAShape(2 if cu_seqlens is None else 1, 70, 1, 2, 16, 16)
    args = make_kda_args(shape, seed=5, device=device, cu_seqlens=cu_seqlens, initial_state=True,
                         output_final_state=True, gate_form="softplus")
    call = lambda: chunk_kda(args["q"], args["k"], args["v"], args["g"], args["beta"], **_call_kwargs(args))  # noqa: E731
    with torch.no_grad():
        direct = call()
        with _CountKdaOps() as counter:
            through_op = call()
    assert counter.calls == 1  # the dispatch mode saw the op: dispatcher_needed() held under it
    assert torch.equal(direct[0], through_op[0]) and torch.equal(direct[1], through_op[1])


def test_dispatcher_needed_only_while_tracing_or_under_a_mode():
    assert not api.dispatcher_needed()
    with _CountKdaOps():
        assert api.dispatcher_needed()


def test_gradients_still_take_the_op(device, monkeypatch):
    """A call that needs gradients goes through the op (its autograd); the direct path is for inference only."""
    def refuse(*args, **kwargs):
        raise AssertionError("the direct inference path ran for a call that needs gradients")

    monkeypatch.setattr(custom_ops, "chunk_kda_inference", refuse)
    args = make_kda_args(KDAShape(1, 20, 1, 1, 16, 16), seed=2, device=device, requires_grad=True)
    o, _ = chunk_kda(args["q"], args["k"], args["v"], args["g"], args["beta"], **_call_kwargs(args))
    o.sum().backward()
    assert args["q"].grad is not None and torch.isfinite(args["q"].grad).all()


# ---- the Triton launcher: host planning of packed sequences ------------------------------------------------
@pytest.mark.parametrize("offsets", [[0, 1, 1, 64, 65, 130], [0, 30, 50], [0, 0, 0]],
                         ids=["empty-and-partial-chunks", "tokens-past-the-last", "all-empty"])
def test_host_planned_chunks_match_device_planning(offsets):
    device = triton_device("the Triton prefill kernels")
    from kda_compile.ops.kda.prefill.run import chunk_kda_prefill

    tail = 0 if offsets[-1] == 130 else 20  # tokens after the last sequence (they belong to none)
    T = offsets[-1] + tail
    drawn = offsets + [T] if tail else offsets  # drawn with the tail as one more sequence, then dropped
    args = make_kda_args(KDAShape(1, T, 1, 1, 16, 16), seed=7, device=device, cu_seqlens=drawn, initial_state=True,
                         gate_form="lower_bound")
    if tail:
        args["cu_seqlens"] = args["cu_seqlens"][:-1]
        args["initial_state"] = args["initial_state"][:-1]
    common = dict(scale=16 ** -0.5, output_final_state=True, use_gate_in_kernel=True,
                  lower_bound=args["lower_bound"])
    inputs = (args["q"], args["k"], args["v"], args["g"], args["beta"], args["A_log"], args["dt_bias"],
              args["initial_state"], args["cu_seqlens"])
    o_device, final_device, _ = chunk_kda_prefill(*inputs, **common)
    o_host, final_host, _ = chunk_kda_prefill(*inputs, **common, cu_seqlens_cpu=args["cu_seqlens"].cpu())
    assert torch.isfinite(o_host).all() and torch.isfinite(final_host).all()
    assert rel_error(o_host, o_device) == 0 and rel_error(final_host, final_device) == 0
    assert torch.all(o_host[:, offsets[-1]:] == 0)


# ---- CUDA: graph capture, FLA's planning from the host copy -------------------------------------------------
@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("cu_seqlens", [None, [0, 100, 100, 300]], ids=["batched", "packed"])
@pytest.mark.parametrize("gate_form", ["lower_bound", "softplus"])
def test_a_call_is_captured_in_a_cuda_graph(cu_seqlens, gate_form):
    shape = KDAShape(1, 300, 2, 2, 64, 64)
    args = make_kda_args(shape, seed=11, dtype=torch.bfloat16, device="cuda", cu_seqlens=cu_seqlens,
                         initial_state=True, output_final_state=True, gate_form=gate_form)
    kwargs = _call_kwargs(args)
    if cu_seqlens is not None:
        kwargs["cu_seqlens_cpu"] = args["cu_seqlens"].cpu()  # FLA's chunk plan: made by the warm-up, reused by the capture
    call = lambda: chunk_kda(args["q"], args["k"], args["v"], args["g"], args["beta"], **kwargs)  # noqa: E731
    with torch.no_grad():
        want = call()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call()  # warm-up on a side stream, as torch.cuda.graphs asks
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        for tensor in (args["q"], args["k"], args["v"]):
            tensor.mul_(1.0)  # replays read the inputs' memory as it is then
        graph.replay()
        torch.cuda.synchronize()
    assert rel_error(captured[0], want[0]) < 1e-6 and rel_error(captured[1], want[1]) < 1e-6


@cuda
@pytest.mark.cuda
def test_packed_call_with_host_offsets_never_synchronises():
    shape = KDAShape(1, 1000, 2, 2, 128, 128)
    offsets = [0, 1, 1, 300, 1000]
    args = make_kda_args(shape, seed=3, dtype=torch.bfloat16, device="cuda", cu_seqlens=offsets,
                         initial_state=True, output_final_state=True, gate_form="lower_bound")
    kwargs = dict(_call_kwargs(args), cu_seqlens_cpu=torch.tensor(offsets))
    call = lambda: chunk_kda(args["q"], args["k"], args["v"], args["g"], args["beta"], **kwargs)  # noqa: E731
    with torch.no_grad():
        want = chunk_kda(args["q"], args["k"], args["v"], args["g"], args["beta"], **_call_kwargs(args))
        call()  # compiles
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = call()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert rel_error(got[0], want[0]) < 1e-6 and rel_error(got[1], want[1]) < 1e-6
