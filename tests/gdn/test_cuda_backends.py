"""Every GDN backend on CUDA against the fp64 token loop: FLA's GDN kernels (needs fla-core 0.6), the
route through the KDA kernels (FLA's KDA kernels, or our Triton prefill / decode without FLA), forward
and gradients, bf16 and fp32, packed sequences, grouped heads, every in-kernel option.

Tolerances (relative RMS error against fp64): fp32 2e-3 forward and gradients (TF32 dots in the
kernels); bf16 2e-2 (FLA's own tests use a few 1e-3 to 1e-2 per tensor for bf16). NaN never passes."""
import pytest
import torch

from kda_compile.ops import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from kda_compile.ops.gdn.backends import fla as fla_backend
from kda_compile.ops.gdn.backends.registry import only_backends, select_backend
from kda_compile.ops.gdn.custom_ops import _options
from kda_compile.ops._common import clear_fallback_events, fallback_events
from kda_compile.testing import KDAShape, assert_rel_close, make_gdn_args
from tests.gdn.helpers import TENSORS, expected_fp64, loss_weights

pytestmark = pytest.mark.cuda
TOL = {torch.float32: 2e-3, torch.bfloat16: 2e-2}
CASES = {
    "plain": dict(shape=KDAShape(2, 200, 2, 4, 64, 64)),
    "qwen3-next-layer": dict(shape=KDAShape(1, 300, 4, 8, 128, 128), gate_form="in_kernel", qk_l2norm=True,
                             beta_sigmoid=True, initial_state=True),
    "olmo-neg-eigval-varlen": dict(shape=KDAShape(1, 257, 2, 2, 96, 192), cu_seqlens=[0, 0, 100, 257],
                                   gate_form="in_kernel", qk_l2norm=True, beta_sigmoid=True, allow_neg_eigval=True,
                                   initial_state=True, state_v_first=True),
}


def _backend_or_skip(name):
    if name == "fla" and fla_backend._load_fla()[1] is not None:
        pytest.skip(fla_backend._load_fla()[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["fla", "kda_kernels"])
def test_chunk_forward_and_gradients(backend, case, dtype):
    _backend_or_skip(backend)
    options = dict(CASES[case])
    args = make_gdn_args(options.pop("shape"), seed=11, dtype=dtype, device="cuda", requires_grad=True, **options)
    K, V = args["q"].shape[-1], args["v"].shape[-1]
    training = _options(1.0, False, False, False, False, training=True)
    chosen = select_backend("chunk_gdn", args["q"].device, dtype, K, V, training)
    if backend == "fla" and fla_backend._backward_refusal() is not None:
        _check_fla_forward_only(args, chosen, dtype)
        return
    with only_backends(backend):
        assert select_backend("chunk_gdn", args["q"].device, dtype, K, V, training).name == backend
        o, final = chunk_gated_delta_rule(**args)
        leaves = {n: args[n] for n in TENSORS if args.get(n) is not None}
        do, dht = loss_weights(o, final)
        loss = (o.double() * do).sum() + (final.double() * dht).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()))
    ref_leaves = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    o_ref, final_ref = expected_fp64({**args, **ref_leaves})
    grads_ref = torch.autograd.grad((o_ref * do).sum() + (final_ref * dht).sum(), list(ref_leaves.values()))
    tol = TOL[dtype]
    assert_rel_close(o, o_ref, tol, name="o")
    assert_rel_close(final, final_ref, tol, name="final_state")
    for name, grad, grad_ref in zip(leaves, grads, grads_ref):
        assert_rel_close(grad, grad_ref, tol * 2, name="d" + name)
    assert chosen.name in ("fla", "kda_kernels")  # the default never picks the reference on CUDA


def _check_fla_forward_only(args, chosen, dtype):
    """Where fla-core refuses its gated chunk backward (Hopper, Triton >= 3.4 and < 3.7.1, no tilelang),
    training calls go to the KDA kernels with a recorded fallback naming the reason; inference keeps
    FLA's forward, checked here against the fp64 loop."""
    assert chosen.name == "kda_kernels"
    clear_fallback_events()
    o, _ = chunk_gated_delta_rule(**args)
    (o.float().sum()).backward()
    reasons = [e.reason for e in fallback_events()]
    assert any("fla-core refuses its gated chunk backward" in r for r in reasons), reasons
    with only_backends("fla"), torch.no_grad():
        assert select_backend("chunk_gdn", args["q"].device, dtype, args["q"].shape[-1], args["v"].shape[-1],
                              _options(1.0, False, False, False, False)).name == "fla"
        o, final = chunk_gated_delta_rule(**args)
    o_ref, final_ref = expected_fp64({n: (t.detach() if torch.is_tensor(t) else t) for n, t in args.items()})
    assert_rel_close(o, o_ref, TOL[dtype], name="o")
    assert_rel_close(final, final_ref, TOL[dtype], name="final_state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["fla", "kda_kernels"])
def test_decode_step(backend, case, dtype):
    _backend_or_skip(backend)
    options = dict(CASES[case])
    shape = options.pop("shape")
    options.pop("cu_seqlens", None)
    shape = KDAShape(3, 1, shape.heads, shape.value_heads, shape.key_dim, shape.value_dim)
    args = make_gdn_args(shape, seed=12, dtype=dtype, device="cuda", **{**options, "initial_state": True})
    with only_backends(backend), torch.no_grad():
        o, final = fused_recurrent_gated_delta_rule(**args)
    o_ref, final_ref = expected_fp64(args)
    assert_rel_close(o, o_ref, TOL[dtype], name="o")
    assert_rel_close(final, final_ref, TOL[dtype], name="final_state")
