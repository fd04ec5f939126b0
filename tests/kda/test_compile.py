"""torch.compile over a function calling both KDA ops: one graph (fullgraph=True, no break), the
custom ops visible in it, the eager result; dynamic=True compiles once for many lengths; training
through the compiled function matches eager. "aot_eager" keeps it fast; one test uses Inductor."""
import pytest
import torch

from kda_compile.ops import chunk_kda, fused_recurrent_kda
from kda_compile.testing import KDAShape, assert_rel_close, make_kda_args

KDA_OPS = {"kda_compile.chunk_kda_fwd", "kda_compile.fused_recurrent_kda_fwd"}


class CountingBackend:
    """Records every graph Dynamo hands over, then compiles it with ``backend``."""

    def __init__(self, backend="aot_eager"):
        self.backend = backend
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)

    def custom_ops(self):
        names = set()
        for gm in self.graphs:
            for node in gm.graph.nodes:
                if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                    names.add(node.target.name().split(".")[0].replace("::", "."))
        return names


def prefill_then_decode(q, k, v, g, beta, A_log, dt_bias, h0):
    """Prefill with chunk_kda, then one decode step with fused_recurrent_kda from its state."""
    o, state = chunk_kda(q[:, :-1], k[:, :-1], v[:, :-1], g[:, :-1], beta[:, :-1], initial_state=h0,
                         output_final_state=True, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                         A_log=A_log, dt_bias=dt_bias)
    o_last, state = fused_recurrent_kda(q[:, -1:], k[:, -1:], v[:, -1:], g[:, -1:], beta[:, -1:], A_log, dt_bias,
                                        initial_state=state, output_final_state=True, use_gate_in_kernel=True,
                                        use_qk_l2norm_in_kernel=True)
    return torch.cat([o, o_last], 1), state


def _inputs(T, device, *, seed=0, requires_grad=False, B=2):
    a = make_kda_args(KDAShape(B, T, 2, 4, 32, 16), seed=seed, gate_form="softplus", qk_l2norm=True,
                      initial_state=True, device=device, requires_grad=requires_grad)
    return [a[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_fullgraph_matches_eager(device):
    backend = CountingBackend()
    compiled = torch.compile(prefill_then_decode, backend=backend, fullgraph=True)
    inputs = _inputs(70, device)
    with torch.no_grad():
        o, state = compiled(*inputs)
        o_eager, state_eager = prefill_then_decode(*inputs)
    assert len(backend.graphs) == 1
    assert KDA_OPS <= backend.custom_ops(), backend.custom_ops()
    assert_rel_close(o, o_eager, 1e-6, name="o")
    assert_rel_close(state, state_eager, 1e-6, name="final_state")


def check_compiled_once_for_lengths(fn, inputs_of, lengths) -> CountingBackend:
    """``fn`` compiled with ``dynamic=True`` over ``inputs_of(T)`` for each length: eager's ``(o, state)`` each
    time from one compilation. Returns the backend that recorded it (GDN's tests use this too)."""
    backend = CountingBackend()
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=True)
    for T in lengths:
        inputs = inputs_of(T)
        with torch.no_grad():
            o, state = compiled(*inputs)
            o_eager, state_eager = fn(*inputs)
        assert_rel_close(o, o_eager, 1e-6, name=f"o (T={T})")
        assert_rel_close(state, state_eager, 1e-6, name=f"final_state (T={T})")
    assert len(backend.graphs) == 1, f"{len(backend.graphs)} compilations for {len(lengths)} lengths"
    return backend


def test_dynamic_lengths_compile_once(device):
    check_compiled_once_for_lengths(prefill_then_decode, lambda T: _inputs(T, device, seed=T), (37, 64, 101))


def test_dynamic_varlen_compiles_once(device):
    def packed(q, k, v, g, beta, cu_seqlens):
        return chunk_kda(q, k, v, g, beta, cu_seqlens=cu_seqlens, output_final_state=True)

    backend = CountingBackend()
    compiled = torch.compile(packed, backend=backend, fullgraph=True, dynamic=True)
    for cu in ([0, 20, 45], [0, 0, 30, 64, 90], [0, 3, 120]):
        a = make_kda_args(KDAShape(1, cu[-1], 1, 2, 32, 16), seed=len(cu), cu_seqlens=cu, device=device)
        call = [a[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")]
        o, state = compiled(*call)
        o_eager, state_eager = packed(*call)
        assert_rel_close(o, o_eager, 1e-6, name=f"o {cu}")
        assert_rel_close(state, state_eager, 1e-6, name=f"final_state {cu}")
    assert len(backend.graphs) == 1, f"{len(backend.graphs)} compilations for 3 packings"


def _train_step(fn, inputs):
    o, state = fn(*inputs)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen).to(o)
    dht = torch.randn(state.shape, generator=gen).to(state)
    loss = (o * do).sum() + (state * dht).sum()
    leaves = [t for t in inputs if t.requires_grad]
    return o.detach(), torch.autograd.grad(loss, leaves)


NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


def _check_training(backend, device, tol):
    compiled = torch.compile(prefill_then_decode, backend=backend, fullgraph=True)
    inputs = _inputs(70, device, requires_grad=True)
    o, grads = _train_step(compiled, inputs)
    o_eager, grads_eager = _train_step(prefill_then_decode, inputs)
    assert_rel_close(o, o_eager, tol, name="o")
    for name, grad, grad_eager in zip(NAMES, grads, grads_eager):
        assert_rel_close(grad, grad_eager, tol, name="d" + name)


def test_training_through_compile_matches_eager(device):
    backend = CountingBackend()
    _check_training(backend, device, 1e-6)
    assert len(backend.graphs) == 1
    assert "kda_compile.chunk_kda_fwd" in backend.custom_ops()


@pytest.mark.slow
def test_inductor_training_matches_eager(device):
    _check_training("inductor", device, 1e-5)
