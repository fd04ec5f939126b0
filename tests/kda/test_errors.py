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


# ------------------------------------------------------------------------------------------------
# No silent garbage from bad arguments
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", OPS, ids=_ids)
@pytest.mark.parametrize("name, dim, letter", [("q", 3, "K"), ("q", 2, "H"), ("v", 3, "V"), ("v", 2, "HV")])
def test_zero_sized_head_dims(op, name, dim, letter):
    a = _args(shape=KDAShape(1, 8, 1, 1, 16, 8))
    cut = {"q": ("q", "k") + (("g",) if dim == 3 else ()), "v": ("v",) + (("g", "beta") if dim == 2 else ())}[name]
    if name == "q" and dim == 2:
        cut = ("q", "k")
    bad = dict(a)
    for n in cut:
        bad[n] = a[n].narrow(dim, 0, 0)
    _expect_error(op, bad, name, f"{letter} >= 1")


@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_empty_batch_and_tokens_are_fine(op):
    for shape in (KDAShape(0, 8, 1, 1, 16, 8), KDAShape(2, 0, 1, 1, 16, 8)):
        o, state = op(**_args(shape=shape, initial_state=True))
        assert o.shape == (shape.batch, shape.seq_len, 1, 8) and state.shape == (shape.batch, 1, 16, 8)


@pytest.mark.parametrize("op", OPS, ids=_ids)
@pytest.mark.parametrize("name", ["k", "v"])
def test_mixed_qkv_dtypes(op, name):
    a = _args()
    _expect_error(op, dict(a, **{name: a[name].to(torch.bfloat16)}), name, "q's dtype", "bfloat16", kinds=TypeError)


@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_gate_and_beta_may_have_their_own_dtype(op):
    a = _args()
    o, _ = op(**dict(a, g=a["g"].double(), beta=a["beta"].half()))
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("op", OPS, ids=_ids)
@pytest.mark.parametrize("name", ["A_log", "dt_bias"])
def test_gate_parameters_without_in_kernel_gate(op, name):
    a = _args(gate_form="softplus")
    bad = dict(a, use_gate_in_kernel=False, **{"A_log": None, "dt_bias": None})
    bad[name] = a[name]
    _expect_error(op, bad, name, "use_gate_in_kernel")


@pytest.mark.parametrize("op", OPS, ids=_ids)
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -0.5])
def test_scale_finite_and_positive(op, scale):
    _expect_error(op, dict(_args(), scale=scale), "scale", str(scale))


@pytest.mark.parametrize("op", OPS, ids=_ids)
@pytest.mark.parametrize("offsets, fragment", [
    ([0, 3, 7], "ending at T=10"), ([2, 5, 10], "starting at 0"), ([0, 6, 3, 10], "non-decreasing"),
    ([0, -3, 10], "non-decreasing"), ([0], "ending at T=10"), ([0, 3, 12], "ending at T=10"),
])
def test_cu_seqlens_values(op, offsets, fragment):
    a = _args(shape=KDAShape(1, 10, 1, 1, 16, 8))
    _expect_error(op, dict(a, cu_seqlens=torch.tensor(offsets)), "cu_seqlens", str(offsets), fragment)


@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_empty_sequences_are_fine(op):
    a = _args(shape=KDAShape(1, 10, 1, 1, 16, 8), cu_seqlens=[0, 0, 4, 4, 10], initial_state=True)
    o, state = op(**a)
    assert torch.equal(state[0], a["initial_state"][0]) and torch.equal(state[2], a["initial_state"][2])


def test_cu_seqlens_cpu():
    a = _args(shape=KDAShape(1, 10, 1, 1, 16, 8), cu_seqlens=[0, 4, 10])
    chunk_kda(**a, cu_seqlens_cpu=torch.tensor([0, 4, 10]))  # a matching host copy is fine
    _expect_error(chunk_kda, dict(a, cu_seqlens_cpu=torch.tensor([0, 5, 10])), "cu_seqlens_cpu", "[0, 5, 10]",
                  "equal to cu_seqlens [0, 4, 10]")
    _expect_error(chunk_kda, dict(a, cu_seqlens_cpu=torch.tensor([0, 10])), "cu_seqlens_cpu", "3 offsets")
    _expect_error(chunk_kda, dict(a, cu_seqlens=None, cu_seqlens_cpu=torch.tensor([0, 10])), "cu_seqlens_cpu",
                  "None when cu_seqlens is None")


@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_check_inputs_rejects_positive_gates(op, monkeypatch):
    a = _args()
    g = a["g"].clone()
    g[1, 3, 2, 5] = 0.5
    bad = dict(a, g=g)
    op(**bad)  # not checked by default: a value check reads the device
    _expect_error(op, dict(bad, check_inputs=True), "g", "1 positive", "[1, 3, 2, 5]", "<= 0")
    monkeypatch.setenv("KDA_COMPILE_CHECK_INPUTS", "1")
    _expect_error(op, bad, "g", "1 positive")  # the op's own run-time check
    monkeypatch.setenv("KDA_COMPILE_CHECK_INPUTS", "maybe")
    _expect_error(op, a, "KDA_COMPILE_CHECK_INPUTS", "'maybe'")


def _first_line_compiled(op, args, dynamic):
    torch._dynamo.reset()
    compiled = torch.compile(lambda kw: op(**kw), backend="aot_eager", fullgraph=True, dynamic=dynamic)
    try:
        compiled(args)
    except (ValueError, TypeError) as error:
        return type(error), str(error).splitlines()[0]
    finally:
        torch._dynamo.reset()
    raise AssertionError("the compiled call raised nothing")


def _first_line_eager(op, args):
    try:
        op(**args)
    except (ValueError, TypeError) as error:
        return type(error), str(error).splitlines()[0]
    raise AssertionError("the eager call raised nothing")


COMPILED_CASES = {
    "scale-nan": lambda a: dict(a, scale=float("nan")),
    "mixed-dtype": lambda a: dict(a, k=a["k"].to(torch.bfloat16)),
    "g-shape": lambda a: dict(a, g=a["g"][..., :-1]),
    "A_log-without-gate": lambda a: dict(a, A_log=torch.zeros(4)),
    "unknown-keyword": lambda a: dict(a, not_an_option=1),
    "K=0": lambda a: dict(a, q=a["q"][..., :0], k=a["k"][..., :0], g=a["g"][..., :0]),
}


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("case", sorted(COMPILED_CASES))
@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_compiled_error_is_ours(op, case, dynamic):
    # Under torch.compile(fullgraph=True) the user sees our error first (same type, same first line), not
    # Dynamo's "Observed exception".
    args = COMPILED_CASES[case](_args())
    assert _first_line_compiled(op, args, dynamic) == _first_line_eager(op, args)


def test_compiled_check_inputs_argument_points_to_the_variable():
    kind, line = _first_line_compiled(chunk_kda, dict(_args(), check_inputs=True), False)
    assert kind is ValueError and "check_inputs" in line and "KDA_COMPILE_CHECK_INPUTS" in line


def test_compiled_run_time_checks(monkeypatch):
    monkeypatch.setenv("KDA_COMPILE_CHECK_INPUTS", "1")
    a = _args()
    g = a["g"].clone()
    g[0, 0, 0, 0] = 1.0
    kind, line = _first_line_compiled(chunk_kda, dict(a, g=g), False)
    assert kind is ValueError and line.startswith("g must be <= 0")
