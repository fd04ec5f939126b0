"""``torch.library.opcheck`` on every GDN custom op (schema, autograd registration, fake tensors with
their strides, AOT dispatch with dynamic shapes), on contiguous and non-contiguous inputs, with and
without initial state, with the in-kernel options and packed sequences. Also on the route through the
KDA kernels (``only_backends("kda_kernels")``), whose residuals are the KDA op's."""
import pytest
import torch

import kda_compile.ops  # noqa: F401  (registers torch.ops.kda_compile.*)
from kda_compile.ops.gdn.backends.registry import only_backends
from kda_compile.testing import KDAShape, make_gdn_args
from tests.gdn.helpers import op_flags, op_tensors
from in_place_decode import check_in_place_decode
from triton_device import INTERPRETED

OPTION_SETS = {
    "plain": dict(shape=KDAShape(2, 19, 2, 2, 16, 8)),
    "in-kernel-negeig-v-first": dict(shape=KDAShape(1, 20, 2, 4, 12, 8), gate_form="in_kernel", qk_l2norm=True,
                                     beta_sigmoid=True, allow_neg_eigval=True, state_v_first=True, scale=0.3),
    "varlen-empty-seqs": dict(shape=KDAShape(1, 30, 2, 4, 8, 8), cu_seqlens=[0, 0, 11, 30], gate_form="in_kernel",
                              dt_bias=False),
}
BACKENDS = {"default": (), "kda-route": ("kda_kernels",)}


def _args(name, noncontiguous, with_state, requires_grad=False):
    options = dict(OPTION_SETS[name])
    return make_gdn_args(options.pop("shape"), seed=3, noncontiguous=noncontiguous, initial_state=with_state,
                         requires_grad=requires_grad, **options)


# (options, non-contiguous, with state, backends): each opcheck compiles (AOT dispatch), so a few cases
# that together cover every option, layout and backend.
CASES = [("plain", False, False, "default"), ("in-kernel-negeig-v-first", True, True, "default"),
         ("varlen-empty-seqs", True, True, "default"), ("in-kernel-negeig-v-first", True, True, "kda-route"),
         ("varlen-empty-seqs", False, True, "kda-route")]
IDS = ["-".join([c[0], "transposed" if c[1] else "contiguous", "state" if c[2] else "no-state", c[3]]) for c in CASES]


@pytest.mark.parametrize("options, noncontiguous, with_state, backends", CASES, ids=IDS)
def test_chunk_gdn_fwd_and_bwd(options, noncontiguous, with_state, backends):
    args = _args(options, noncontiguous, with_state, requires_grad=True)
    fwd = (*op_tensors(args), *op_flags(args), 16, True)
    with only_backends(*BACKENDS[backends]):
        torch.library.opcheck(torch.ops.kda_compile.chunk_gdn_fwd.default, fwd)
        detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in fwd]
        o, final, *residuals = torch.ops.kda_compile.chunk_gdn_fwd(*detached)
        gen = torch.Generator().manual_seed(0)
        do = torch.randn(o.shape[0], o.shape[2], o.shape[1], o.shape[3], generator=gen).transpose(1, 2)
        do = do if noncontiguous else do.contiguous()
        dht = torch.randn(final.shape, generator=gen) if with_state else None
        scale, _, *flags = op_flags(args)
        bwd = (*detached[:9], *residuals, do, dht, scale, *flags, 16)
        torch.library.opcheck(torch.ops.kda_compile.chunk_gdn_bwd.default, bwd)


@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "transposed"])
def test_chunk_gdn_fwd_inference_without_final_state(noncontiguous):
    args = _args("plain", noncontiguous, True)
    flags = list(op_flags(args))
    flags[1] = False
    torch.library.opcheck(torch.ops.kda_compile.chunk_gdn_fwd.default, (*op_tensors(args), *flags, 64, False))


@pytest.mark.parametrize("options, noncontiguous, with_state, backends", CASES, ids=IDS)
def test_fused_recurrent_gdn_fwd(options, noncontiguous, with_state, backends):
    args = _args(options, noncontiguous, with_state)
    with only_backends(*BACKENDS[backends]):
        torch.library.opcheck(torch.ops.kda_compile.fused_recurrent_gdn_fwd.default,
                              (*op_tensors(args), *op_flags(args)))


@pytest.mark.parametrize("options", OPTION_SETS)
def test_noncontiguous_inputs_are_really_noncontiguous(options):
    args = _args(options, True, True)
    for key in ("q", "k", "v", "g", "beta"):
        assert not args[key].is_contiguous(), key


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors through the Triton interpreter; on CUDA "
                    "tests/gdn/test_chunk_kernels_cuda.py::test_opcheck_on_this_backend")
@pytest.mark.parametrize("options", ["in-kernel-negeig-v-first", "varlen-empty-seqs"])
def test_chunk_gdn_fwd_inference_on_our_chunk_kernels(options):
    """The inference op on the ``chunk_kernels`` backend (our Triton kernels with the scalar gate; interpreted on
    CPU): the fake's outputs match the kernels' (no residuals)."""
    args = _args(options, True, True)
    with only_backends("chunk_kernels"):
        torch.library.opcheck(torch.ops.kda_compile.chunk_gdn_fwd.default,
                              (*op_tensors(args), *op_flags(args), 64, False))


@pytest.mark.parametrize("options, noncontiguous, with_state, backends", [c for c in CASES if c[2]],
                         ids=[i for c, i in zip(CASES, IDS) if c[2]])
def test_fused_recurrent_gdn_inplace(options, noncontiguous, with_state, backends):
    """The decode op that writes its final state over its initial state: declared mutation, fake, and the
    state it leaves equal to the out-of-place op's final state (on every backend: the KDA route copies it)."""
    args = _args(options, noncontiguous, with_state)
    scale, _, *flags = op_flags(args)
    with only_backends(*BACKENDS[backends]):
        check_in_place_decode("fused_recurrent_gdn", op_tensors(args), scale, flags)
