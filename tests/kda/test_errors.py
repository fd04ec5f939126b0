"""Bad inputs raise ValueError or TypeError naming the argument and the offending value, for both
public KDA functions; and nothing is raised for the valid edge of each rule."""
import re

import pytest
import torch

from kda_compile.ops import chunk_kda, fused_recurrent_kda
from kda_compile.testing import KDAShape, make_kda_args

OPS = [chunk_kda, fused_recurrent_kda]


def _args(**options):
    shape = options.pop("shape", KDAShape(2, 8, 2, 4, 16, 8))
    return make_kda_args(shape, seed=0, **options)


def _expect_error(op, args, *fragments, kinds=(ValueError, TypeError)):
    """The call raises one of ``kinds`` whose message contains every fragment (argument, value)."""
    pattern = "".join(f"(?=.*{re.escape(f)})" for f in fragments)
    with pytest.raises(kinds, match=re.compile(pattern, re.S)):
        op(**args)


def _ids(op):
    return op.__name__


@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_wrong_rank(op):
    a = _args()
    _expect_error(op, dict(a, q=a["q"][0]), "q", "[8, 2, 16]")
    _expect_error(op, dict(a, beta=a["beta"][..., None]), "beta", "[2, 8, 4, 1]")


@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_value_heads_not_a_multiple_of_heads(op):
    a = _args(shape=KDAShape(1, 8, 2, 3, 16, 8))  # make_kda_args builds it; the op must refuse it
    _expect_error(op, a, "v", "3")


@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_key_dim_above_256(op):
    a = _args(shape=KDAShape(1, 4, 1, 1, 300, 8))
    _expect_error(op, a, "300", "256")
    op(**_args(shape=KDAShape(1, 4, 1, 1, 256, 8)))  # the limit itself is fine


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_initial_state_not_float32(op, dtype):
    a = _args(initial_state=True)
    bad = a["initial_state"].to(dtype)
    _expect_error(op, dict(a, initial_state=bad), "initial_state", str(dtype).replace("torch.", ""))


@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_cu_seqlens_needs_batch_one(op):
    a = _args()
    _expect_error(op, dict(a, cu_seqlens=torch.tensor([0, 3, 8])), "cu_seqlens", "batch", "[2, 8, 2, 16]")


@pytest.mark.parametrize(
    "name, make_bad, value",
    [
        ("k", lambda a: a["k"][:, :-1], "[2, 7, 2, 16]"),
        ("v", lambda a: a["v"][:, :-1], "[2, 7, 4, 8]"),
        ("g", lambda a: a["g"][..., :-1], "[2, 8, 4, 15]"),
        ("beta", lambda a: a["beta"][:, :, :-1], "[2, 8, 3]"),
        ("initial_state", lambda a: a["initial_state"][:, :, :-1], "[2, 4, 15, 8]"),
    ],
)
@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_mismatched_shapes(op, name, make_bad, value):
    a = _args(initial_state=True)
    _expect_error(op, dict(a, **{name: make_bad(a)}), name, value)


@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_varlen_state_count(op):
    # N = len(cu_seqlens) - 1 states are expected, not B.
    a = _args(shape=KDAShape(1, 8, 1, 1, 16, 8), cu_seqlens=[0, 3, 8], initial_state=True)
    _expect_error(op, dict(a, initial_state=a["initial_state"][:1]), "initial_state", "[1, 1, 16, 8]")


@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_unknown_keyword(op):
    with pytest.raises(TypeError, match="not_an_option"):
        op(**_args(), not_an_option=1)


@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_neg_eigval_requires_beta_sigmoid(op):
    _expect_error(op, dict(_args(), allow_neg_eigval=True), "allow_neg_eigval", "use_beta_sigmoid_in_kernel")


@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_gate_parameters(op):
    a = _args(gate_form="softplus")
    _expect_error(op, dict(a, A_log=None), "A_log")  # softplus gate without A_log
    _expect_error(op, dict(a, A_log=a["A_log"][:-1]), "A_log", "[3]")
    _expect_error(op, dict(a, dt_bias=a["dt_bias"][:-1]), "dt_bias", "[63]")
    op(**dict(a, dt_bias=None))  # dt_bias is optional


@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_non_tensor_input(op):
    a = _args()
    _expect_error(op, dict(a, q=a["q"].tolist()), "q", "list")
