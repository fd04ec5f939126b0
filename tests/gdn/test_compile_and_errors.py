"""torch.compile over the GDN functions: one graph (fullgraph=True), the GDN ops in it, eager's results;
dynamic=True compiles once for new lengths; training through the compiled function matches eager.
Bad arguments: ValueError / TypeError naming the argument, in eager calls and, unchanged, from a
fullgraph-compiled function when it runs. "aot_eager" keeps it fast."""
import pytest
import torch

from kda_compile.ops import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from kda_compile.testing import KDAShape, assert_rel_close, make_gdn_args
from tests.kda.test_compile import CountingBackend, check_compiled_once_for_lengths

GDN_OPS = {"kda_compile.chunk_gdn_fwd", "kda_compile.fused_recurrent_gdn_fwd"}
NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


def prefill_then_decode(q, k, v, g, beta, A_log, dt_bias, h0):
    """As HF's GDN layers call it: prefill with the chunk function, one decode step from its state."""
    kw = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    o, state = chunk_gated_delta_rule(q[:, :-1], k[:, :-1], v[:, :-1], g[:, :-1], beta[:, :-1], initial_state=h0,
                                      output_final_state=True, **kw)
    o_last, state = fused_recurrent_gated_delta_rule(q[:, -1:], k[:, -1:], v[:, -1:], g[:, -1:], beta=beta[:, -1:],
                                                     initial_state=state, output_final_state=True, **kw)
    return torch.cat([o, o_last], 1), state


def _inputs(T, *, seed=0, requires_grad=False):
    a = make_gdn_args(KDAShape(2, T, 2, 4, 16, 8), seed=seed, gate_form="in_kernel", qk_l2norm=True,
                      initial_state=True, requires_grad=requires_grad)
    return [a[n] for n in NAMES]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_dynamic_lengths_compile_once_and_match_eager():
    backend = check_compiled_once_for_lengths(prefill_then_decode, lambda T: _inputs(T, seed=T), (37, 64, 90))
    assert GDN_OPS <= backend.custom_ops(), backend.custom_ops()


def test_training_through_compile_matches_eager():
    backend = CountingBackend()
    compiled = torch.compile(prefill_then_decode, backend=backend, fullgraph=True)
    inputs = _inputs(40, requires_grad=True)
    results = []
    for fn in (compiled, prefill_then_decode):
        o, state = fn(*inputs)
        gen = torch.Generator().manual_seed(1)
        loss = (o * torch.randn(o.shape, generator=gen)).sum() + (state * torch.randn(state.shape, generator=gen)).sum()
        results.append((o.detach(), torch.autograd.grad(loss, inputs)))
    (o, grads), (o_eager, grads_eager) = results
    assert len(backend.graphs) == 1
    assert "kda_compile.chunk_gdn_fwd" in backend.custom_ops()
    assert_rel_close(o, o_eager, 1e-6, name="o")
    for name, grad, grad_eager in zip(NAMES, grads, grads_eager):
        assert_rel_close(grad, grad_eager, 1e-6, name="d" + name)


def _good():
    return make_gdn_args(KDAShape(1, 6, 2, 4, 8, 8), gate_form="in_kernel", seed=1)


BAD_CALLS = {
    "per-channel gate": (lambda a: dict(a, g=a["g"][..., None].expand(1, 6, 4, 8)), ValueError,
                         r"g must be of shape \[B, T, HV\] = \[1, 6, 4\] .*"
                         r"got a torch.float32 tensor of shape \[1, 6, 4, 8\]"),
    "grouped heads": (lambda a: dict(a, v=a["v"][:, :, :3], g=a["g"][:, :, :3], beta=a["beta"][:, :, :3],
                                     A_log=a["A_log"][:3], dt_bias=a["dt_bias"][:3]), ValueError,
                      r"v must be a multiple of the q/k heads .*got 3 value heads for 2 q/k heads"),
    "dt_bias size": (lambda a: dict(a, dt_bias=torch.zeros(32)), ValueError,
                     r"dt_bias must be a tensor of HV=4 elements .*got a torch.float32 tensor of shape \[32\]"),
    "A_log missing": (lambda a: dict(a, A_log=None), ValueError, r"A_log must be a \[HV\] tensor when use_gate_in"),
    "bf16 state": (lambda a: dict(a, initial_state=torch.zeros(1, 4, 8, 8, dtype=torch.bfloat16)), TypeError,
                   r"initial_state must be float32"),
    "neg eigval": (lambda a: dict(a, allow_neg_eigval=True), ValueError,
                   r"allow_neg_eigval must be False unless use_beta_sigmoid_in_kernel=True, got True"),
    "scale": (lambda a: dict(a, scale=-1.0), ValueError, r"scale must be a finite float > 0 .*got -1.0"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_arguments_name_the_argument(case):
    make, kind, message = BAD_CALLS[case]
    with pytest.raises(kind, match=message):
        chunk_gated_delta_rule(**make(_good()))
    with pytest.raises(kind, match=message):
        fused_recurrent_gated_delta_rule(**make(_good()))


def test_unsupported_fla_options_are_refused():
    a = _good()
    with pytest.raises(TypeError, match=r"cp_context must be None or a kda_compile.ops.CPContext from "
                                        r"kda_compile.ops.build_cp_context \(FLA's FLACPContext is not accepted\), got"):
        chunk_gated_delta_rule(**a, cp_context=object())
    with pytest.raises(TypeError, match=r"chunk_gated_delta_rule\(\) got an unexpected keyword argument 'head_first'"):
        chunk_gated_delta_rule(**a, head_first=False)
    with pytest.raises(ValueError, match=r"chunk_size must be one of \[16, 32, 64\], got 128"):
        chunk_gated_delta_rule(**a, chunk_size=128)
    with pytest.raises(ValueError, match=r"gk must be None \(kda_compile's GDN takes the per-head gate g only"):
        fused_recurrent_gated_delta_rule(**a, gk=torch.zeros(1, 6, 4, 8))
    with pytest.raises(ValueError, match=r"gv must be None"):
        fused_recurrent_gated_delta_rule(**a, gv=torch.zeros(1, 6, 4, 8))


def test_bad_packed_offsets_are_refused():
    a = make_gdn_args(KDAShape(1, 10, 1, 2, 8, 8), cu_seqlens=[0, 4, 10])
    with pytest.raises(ValueError, match=r"cu_seqlens must be offsets ending at T=10"):
        chunk_gated_delta_rule(**dict(a, cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32)))


def test_errors_raise_unchanged_under_fullgraph_compile():
    make, kind, message = BAD_CALLS["dt_bias size"]
    compiled = torch.compile(lambda a: chunk_gated_delta_rule(**a), backend="aot_eager", fullgraph=True)
    with pytest.raises(kind, match=message):
        compiled(make(_good()))
    compiled_decode = torch.compile(lambda a: fused_recurrent_gated_delta_rule(**a), backend="aot_eager",
                                    fullgraph=True)
    with pytest.raises(ValueError, match=r"gk must be None"):
        compiled_decode(dict(_good(), gk=torch.zeros(1, 6, 4, 8)))
