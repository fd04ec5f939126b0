"""A chunked delta-rule backward runs on the backend its forward ran on (whose residuals it holds), whatever
would be selected when the backward runs: e.g. a forward under ``only_backends`` and a backward after the block,
or a backend registered in between."""
import pytest
import torch

from kda_compile.ops import chunk_gated_delta_rule, chunk_kda
from kda_compile.ops.gdn.backends import registry as gdn_backends
from kda_compile.ops.kda.backends import registry as kda_backends
from kda_compile.testing import KDAShape, make_gdn_args, make_kda_args


class _Unusable:
    """A backend that would serve every call, and fails if it is asked for a backward."""

    name = "unusable"
    serves = ("chunk_kda", "chunk_gdn")

    def unsupported_reason(self, *args):
        return None

    def chunk_backward(self, *args, **kwargs):
        raise AssertionError("the backward ran on a backend its forward did not run on")


@pytest.mark.parametrize("module, op", [(kda_backends, chunk_kda), (gdn_backends, chunk_gated_delta_rule)],
                         ids=["kda", "gdn"])
def test_backward_runs_where_the_forward_ran(monkeypatch, module, op):
    make = make_kda_args if op is chunk_kda else make_gdn_args
    args = make(KDAShape(1, 20, 1, 1, 8, 8), seed=3, requires_grad=True, initial_state=True)
    o, _ = op(**args)
    want = torch.autograd.grad(o.sum(), [args["q"], args["g"]])
    monkeypatch.setattr(module.REGISTRY, "entries", [(100, _Unusable()), *module.REGISTRY.entries])
    with module.only_backends("reference"):
        o, _ = op(**args)
    got = torch.autograd.grad(o.sum(), [args["q"], args["g"]])  # after the block: _Unusable would be selected
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_backend_named_rejects_unknown_names():
    with pytest.raises(ValueError, match="backend must name a registered KDA backend.*'nope'"):
        kda_backends.backend_named("nope")
