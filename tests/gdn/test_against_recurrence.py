"""The GDN ops against the fp64 token-by-token recurrence, over drawn calls (shapes with T = 1, odd T,
grouped value heads, packed sequences with empty ones, every flag): forward outputs and final states,
and the gradients of every differentiable input.

Tolerances (relative RMS error, kda_compile.testing.rel_error): fp32 forward 1e-5, gradients 1e-4 (the
chunked WY form reorders the sums; measured errors are ~1e-7); fp64 1e-10 (final states are fp32: 1e-6).
NaN never passes.
"""
import pytest
import torch
from hypothesis import given, settings

from kda_compile.ops import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from kda_compile.ops.gdn.backends.registry import only_backends
from kda_compile.testing import KDAShape, assert_rel_close, gdn_inputs, make_gdn_args
from tests.gdn.helpers import TENSORS, expected_fp64, loss_weights

FWD_TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
GRAD_TOL = {torch.float32: 1e-4, torch.float64: 1e-9}


def _check_forward(fn, args):
    o, final = fn(**args)
    o_ref, final_ref = expected_fp64(args)
    tol = FWD_TOL[args["q"].dtype]
    assert o.dtype == args["q"].dtype and o.shape == args["v"].shape
    assert_rel_close(o, o_ref, tol, name="o")
    if args["output_final_state"]:
        assert final.dtype == torch.float32  # states are fp32 whatever the inputs: fp32's tolerance
        assert_rel_close(final, final_ref, max(tol, 1e-6), name="final_state")
    else:
        assert final is None


@settings(max_examples=12)
@given(gdn_inputs(max_T=90, key_dims=(8, 16, 30), value_dims=(8, 12), dtypes=(torch.float32, torch.float64)))
def test_chunk_forward_matches_recurrence(args):
    _check_forward(chunk_gated_delta_rule, args)


@settings(max_examples=12)
@given(gdn_inputs(max_T=20, key_dims=(8, 16), value_dims=(8, 12)))
def test_fused_recurrent_forward_matches_recurrence(args):
    _check_forward(fused_recurrent_gated_delta_rule, args)


def _check_gradients(fn, args):
    leaves = {n: args[n] for n in TENSORS if args.get(n) is not None and args[n].requires_grad}
    o, final = fn(**args)
    do, dht = loss_weights(o, final)
    loss = (o.double() * do).sum() + ((final.double() * dht).sum() if final is not None else 0)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    ref_leaves = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    o_ref, final_ref = expected_fp64({**args, **ref_leaves})
    loss_ref = (o_ref * do).sum() + ((final_ref * dht).sum() if final is not None else 0)
    grads_ref = torch.autograd.grad(loss_ref, list(ref_leaves.values()))
    for name, grad, grad_ref in zip(leaves, grads, grads_ref):
        assert_rel_close(grad, grad_ref, GRAD_TOL[args["q"].dtype], name="d" + name)


@settings(max_examples=12)
@given(gdn_inputs(max_T=70, key_dims=(8, 16), value_dims=(8,), requires_grad=True, initial_state=(False, True)))
def test_chunk_gradients_match_recurrence(args):
    _check_gradients(chunk_gated_delta_rule, args)


def test_fused_recurrent_with_grad_takes_the_differentiable_path():
    args = make_gdn_args(KDAShape(2, 5, 2, 4, 8, 8), gate_form="in_kernel", qk_l2norm=True, beta_sigmoid=True,
                         allow_neg_eigval=True, initial_state=True, requires_grad=True, seed=4)
    _check_gradients(fused_recurrent_gated_delta_rule, args)


@pytest.mark.parametrize("options", [dict(), dict(gate_form="in_kernel", qk_l2norm=True, beta_sigmoid=True),
                                     dict(cu_seqlens=[0, 0, 9, 21])], ids=["plain", "in-kernel", "varlen"])
def test_route_through_kda_kernels_matches_recurrence(options):
    """The KDA route (gate broadcast over K, gradient summed back) on CPU: the KDA op's reference serves
    underneath, so this checks the route's own plumbing (shapes, dt_bias repeat, dg / ddt_bias sums)."""
    shape = KDAShape(1 if "cu_seqlens" in options else 2, 21, 2, 4, 16, 8)
    args = make_gdn_args(shape, initial_state=True, requires_grad=True, seed=7, **options)
    with only_backends("kda_kernels"):
        _check_forward(chunk_gated_delta_rule, args)
        _check_gradients(chunk_gated_delta_rule, args)
        with torch.no_grad():
            _check_forward(fused_recurrent_gated_delta_rule, args)


def test_fused_recurrent_defaults_mean_no_decay_and_unit_beta():
    args = make_gdn_args(KDAShape(1, 6, 1, 2, 8, 8), seed=2)
    o, final = fused_recurrent_gated_delta_rule(args["q"], args["k"], args["v"], output_final_state=True)
    explicit = dict(args, g=torch.zeros_like(args["g"]), beta=torch.ones_like(args["beta"]))
    o_ref, final_ref = expected_fp64(explicit)
    assert_rel_close(o, o_ref, 1e-5, name="o")
    assert_rel_close(final, final_ref, 1e-5, name="final_state")


def test_minus_inf_gate_resets_the_state():
    args = make_gdn_args(KDAShape(1, 40, 1, 2, 8, 8), initial_state=True, seed=5)
    args["g"][:, 20] = float("-inf")
    o, final = chunk_gated_delta_rule(**args, chunk_size=16)
    later = dict(args, initial_state=None, **{n: args[n][:, 20:] for n in ("q", "k", "v", "g", "beta")})
    later["g"] = later["g"].clone()
    later["g"][:, 0] = 0.0
    o_later, final_later = chunk_gated_delta_rule(**later)
    assert torch.isfinite(o).all()
    assert_rel_close(o[:, 20:], o_later, 1e-6, name="o after the reset")
    assert_rel_close(final, final_later, 1e-6, name="final_state")
