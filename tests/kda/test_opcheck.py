"""``torch.library.opcheck`` on every KDA custom op: schema, autograd registration, fake tensors
(shapes AND strides) and AOT dispatch with dynamic shapes, on contiguous and non-contiguous inputs,
with and without initial state, with the gate / beta / L2-norm options, and varlen.

The op-level arguments are built from public-level ones the way ``chunk_kda`` builds them: the
state in [N, HV, K, V] layout, ``A_log`` / ``dt_bias`` only with the in-kernel gate, ``scale``
resolved to a float.
"""
import pytest
import torch

import kda_compile.ops  # noqa: F401  (registers torch.ops.kda_compile.*)
from kda_compile.testing import KDAShape, make_kda_args
from in_place_decode import check_in_place_decode

OPTION_SETS = {
    "plain": dict(shape=KDAShape(2, 70, 2, 2, 32, 16)),
    "softplus-l2norm-negeig": dict(shape=KDAShape(1, 20, 2, 4, 60, 16), gate_form="softplus", qk_l2norm=True,
                                   beta_sigmoid=True, allow_neg_eigval=True, scale=0.3),
    "lower-bound-no-A_log": dict(shape=KDAShape(2, 33, 2, 2, 32, 24), gate_form="lower_bound", A_log=False,
                                 lower_bound=-5.0),
    "varlen-empty-seqs": dict(shape=KDAShape(1, 40, 2, 4, 16, 16), cu_seqlens=[0, 0, 13, 40], gate_form="softplus",
                              dt_bias=False),
}


def _public_args(name, noncontiguous, with_state, device, requires_grad=False, output_final_state=True):
    options = dict(OPTION_SETS[name])
    shape = options.pop("shape")
    return make_kda_args(shape, seed=3, noncontiguous=noncontiguous, initial_state=with_state, device=device,
                         requires_grad=requires_grad, output_final_state=output_final_state, **options)


def _tensors(a):
    """The op-level tensor arguments from public-level ones."""
    gate = a["use_gate_in_kernel"]
    h0 = a["initial_state"]
    if h0 is not None and a["state_v_first"]:
        h0 = h0.transpose(-1, -2)
    return (a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"] if gate else None,
            a["dt_bias"] if gate else None, h0, a["cu_seqlens"])


def _flags(a):
    scale = a["scale"] if a["scale"] is not None else a["q"].shape[-1] ** -0.5
    return (float(scale), a["output_final_state"], a["use_qk_l2norm_in_kernel"], a["use_gate_in_kernel"],
            a["use_beta_sigmoid_in_kernel"], a["allow_neg_eigval"], a["lower_bound"])


def chunk_fwd_args(a, *, save_for_backward, chunk_size=64, keep_intermediates=False):
    return (*_tensors(a), *_flags(a), False, chunk_size, save_for_backward, keep_intermediates)


def recurrent_fwd_args(a):
    return (*_tensors(a), *_flags(a))


@pytest.mark.parametrize("with_state", [False, True], ids=["no-state", "state"])
@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("options", OPTION_SETS)
def test_chunk_kda_fwd(options, noncontiguous, with_state, device):
    args = _public_args(options, noncontiguous, with_state, device, requires_grad=True)
    torch.library.opcheck(torch.ops.kda_compile.chunk_kda_fwd.default, chunk_fwd_args(args, save_for_backward=True))


@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "transposed"])
def test_chunk_kda_fwd_inference_without_final_state(noncontiguous, device):
    args = _public_args("plain", noncontiguous, True, device, output_final_state=False)
    torch.library.opcheck(torch.ops.kda_compile.chunk_kda_fwd.default,
                          chunk_fwd_args(args, save_for_backward=False, chunk_size=16))


@pytest.mark.parametrize("with_state, with_dht", [(False, False), (True, True), (False, True)],
                         ids=["no-state-no-dht", "state-dht", "no-state-dht"])
@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("options", OPTION_SETS)
def test_chunk_kda_bwd(options, noncontiguous, with_state, with_dht, device):
    args = _public_args(options, noncontiguous, with_state, device)
    fwd = chunk_fwd_args(args, save_for_backward=True)
    o, final, *residuals = torch.ops.kda_compile.chunk_kda_fwd(*fwd)
    gen = torch.Generator().manual_seed(0)
    # Non-contiguous cotangents too: the op must not assume a layout for do / dht.
    do = torch.randn(o.shape[:1] + o.shape[2:3] + o.shape[1:2] + o.shape[3:], generator=gen).transpose(1, 2)
    do = (do if noncontiguous else do.contiguous()).to(device=device, dtype=o.dtype)
    dht = torch.randn(final.shape, generator=gen).to(device) if with_dht else None
    scale, _, *flags = _flags(args)
    bwd = (*_tensors(args), *residuals, do, dht, scale, *flags, False, 64)
    torch.library.opcheck(torch.ops.kda_compile.chunk_kda_bwd.default, bwd)


@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("options", [name for name in OPTION_SETS if "varlen" not in name])
def test_chunk_kda_keeping_intermediates(options, noncontiguous, device):
    """``keep_intermediates`` (FLA's ``disable_recompute``): on CUDA the FLA backend keeps FLA's ``w, u, qg,
    kg, v_new, h`` as six more residuals; their fake shapes must be the real ones, and the backward op
    must take them (on CPU the reference keeps nothing: the schema path is what runs)."""
    args = _public_args(options, noncontiguous, True, device, requires_grad=True)
    fwd = chunk_fwd_args(args, save_for_backward=True, keep_intermediates=True)
    torch.library.opcheck(torch.ops.kda_compile.chunk_kda_fwd.default, fwd)
    o, final, *residuals = torch.ops.kda_compile.chunk_kda_fwd(*[a.detach() if isinstance(a, torch.Tensor) else a
                                                                for a in fwd])
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=o.dtype)
    scale, _, *flags = _flags(args)
    bwd = (*[t.detach() if t is not None else None for t in _tensors(args)], *residuals, do, None, scale, *flags,
           False, 64, True, True)
    torch.library.opcheck(torch.ops.kda_compile.chunk_kda_bwd.default, bwd)


def test_keeping_intermediates_with_packed_sequences_is_refused():
    """The public functions drop the request with a logged reason; a direct caller of the op gets an error
    naming the argument (the kept chunk states would have a data-dependent count)."""
    args = _public_args("varlen-empty-seqs", False, False, "cpu", requires_grad=True)
    with pytest.raises(ValueError, match=r"keep_intermediates=True needs cu_seqlens=None .* 3 sequences"):
        torch.ops.kda_compile.chunk_kda_fwd(*chunk_fwd_args(args, save_for_backward=True, keep_intermediates=True))


@pytest.mark.parametrize("with_state", [False, True], ids=["no-state", "state"])
@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("options", OPTION_SETS)
def test_fused_recurrent_kda_fwd(options, noncontiguous, with_state, device):
    args = _public_args(options, noncontiguous, with_state, device)
    torch.library.opcheck(torch.ops.kda_compile.fused_recurrent_kda_fwd.default, recurrent_fwd_args(args))


@pytest.mark.parametrize("options", OPTION_SETS)
def test_noncontiguous_inputs_are_really_noncontiguous(options):
    # Guard for the tests above: the transposed cases must exercise strided inputs (a size-1 head
    # dim would make the "transposed" tensors contiguous).
    args = _public_args(options, True, True, "cpu")
    for key in ("q", "k", "v", "g", "beta", "initial_state"):
        assert not args[key].is_contiguous(), key


class _ResidualBackend:
    """A CPU backend whose backward needs its forward's residuals (as FLA's and ours do on CUDA)."""
    name = "needs_residuals"
    serves = frozenset({"chunk_kda"})
    backward_calls = 0

    def unsupported_reason(self, device, dtype, K, V, opts):
        return None

    def residual_meta(self, q, k, v, opts, save):
        return [((1,), torch.float32)] if save else []

    def chunk_forward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts, output_final_state, save):
        from kda_compile.ops.kda.backends.registry import REFERENCE
        o, final, _ = REFERENCE.chunk_forward(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts,
                                              output_final_state, save)
        return o, final, ([q.new_ones(1, dtype=torch.float32)] if save else [])

    def chunk_backward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, residuals, do, dht, opts):
        from kda_compile.ops.kda.backends.registry import REFERENCE
        assert len(residuals) == 1 and residuals[0].numel() == 1, "called without the forward's residuals"
        type(self).backward_calls += 1
        return REFERENCE.chunk_backward(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, [], do, dht, opts)


def test_differentiating_a_forward_that_saved_nothing_recomputes(monkeypatch):
    """``chunk_kda_fwd(save_for_backward=False)`` differentiated anyway (opcheck does; the public
    functions do not) must not hand the serving backend's backward empty residuals: its gradients are
    the reference's, equal to those of a forward that saved."""
    from kda_compile.ops.kda.backends import registry as backends

    monkeypatch.setattr(backends.REGISTRY, "entries", [(100, _ResidualBackend()), *backends.REGISTRY.entries])
    args = _public_args("plain", True, True, "cpu", requires_grad=True)
    leaves = [t for t in _tensors(args) if t is not None and t.requires_grad]
    grads = {}
    for save in (True, False):
        o, final, *_ = torch.ops.kda_compile.chunk_kda_fwd(*chunk_fwd_args(args, save_for_backward=save))
        grads[save] = torch.autograd.grad((o.float().square().sum() + final.square().sum()), leaves)
    assert _ResidualBackend.backward_calls == 1  # the saving forward's backward only
    for with_residuals, recomputed in zip(grads[True], grads[False]):
        torch.testing.assert_close(recomputed, with_residuals, rtol=1e-5, atol=1e-6)
    torch.library.opcheck(torch.ops.kda_compile.chunk_kda_fwd.default, chunk_fwd_args(args, save_for_backward=False))


@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("options", OPTION_SETS)
def test_fused_recurrent_kda_inplace(options, noncontiguous, device):
    """The decode op that writes its final state over its initial state: declared mutation, fake, and the
    state it leaves equal to the out-of-place op's final state (on the same inputs)."""
    args = _public_args(options, noncontiguous, True, device)
    scale, _, *flags = _flags(args)
    check_in_place_decode("fused_recurrent_kda", _tensors(args), scale, flags)
