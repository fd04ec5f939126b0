"""The public kda_compile.testing module: the assertions fail when they must (NaN, inf, a real
mismatch) and pass when they must; the strategies draw valid inputs within their bounds; the
module docstring's example runs."""
import math
import re
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kda_compile.testing as testing
from kda_compile.ops import attention, chunk_kda, mla_attention
from kda_compile.testing import (
    GATE_FORMS,
    AttentionCase,
    MLACase,
    KDAShape,
    assert_rel_close,
    attention_cases,
    attention_inputs,
    kda_inputs,
    kda_shapes,
    make_attention_args,
    make_kda_args,
    make_mla_args,
    mla_cases,
    mla_inputs,
    rel_error,
    varlen_splits,
)


# ---------------------------------------------------------------------------------------------
# rel_error / assert_rel_close
# ---------------------------------------------------------------------------------------------
def test_rel_error_values():
    b = torch.tensor([3.0, 4.0])
    assert rel_error(b, b) == 0.0
    assert rel_error(torch.tensor([3.0, 5.0]), b) == pytest.approx(1 / 5, rel=1e-15)
    assert rel_error(torch.zeros(3), torch.zeros(3)) == 0.0
    assert rel_error(torch.ones(3), torch.zeros(3)) == math.inf
    assert rel_error(torch.ones(4), torch.zeros(4), floor=4.0) == pytest.approx(0.5)


def test_rel_error_is_computed_in_float64():
    # In fp32, 1 + 1e-9 rounds to 1 and the error would read 0; in fp64 it does not.
    b = torch.ones(10, dtype=torch.float64)
    a = b + 1e-9
    assert rel_error(a, b) == pytest.approx(1e-9, rel=1e-6)
    # bf16 inputs are compared exactly as given, not re-rounded.
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    assert rel_error(x, x.double()) == 0.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["actual", "expected"])
def test_non_finite_never_passes(bad, where):
    good = torch.ones(5)
    broken = good.clone()
    broken[2] = bad
    actual, expected = (broken, good) if where == "actual" else (good, broken)
    with pytest.raises(AssertionError, match="o_test: relative error (nan|inf)"):
        assert_rel_close(actual, expected, 1e30, name="o_test")
    assert not rel_error(actual, expected) <= 1e30


def test_real_mismatch_fails_with_the_error_in_the_message():
    gen = torch.Generator().manual_seed(0)
    expected = torch.randn(4, 8, generator=gen)
    actual = expected.clone()
    actual[1, 3] += 0.5
    err = rel_error(actual, expected)
    with pytest.raises(AssertionError) as info:
        assert_rel_close(actual, expected, err / 2, name="dq")
    message = str(info.value)
    assert message.startswith("dq: relative error")
    assert f"{err:.3e}" in message
    assert "[1, 3]" in message  # the worst element is located
    assert assert_rel_close(actual, expected, err * 1.01, name="dq") == pytest.approx(err)


def test_assert_rel_close_argument_errors():
    with pytest.raises(ValueError, match="same shape"):
        assert_rel_close(torch.ones(3), torch.ones(4), 1e-3)
    with pytest.raises(ValueError, match="tol must be"):
        assert_rel_close(torch.ones(3), torch.ones(3), math.nan)
    with pytest.raises(TypeError, match="actual must be a torch.Tensor"):
        rel_error([1.0], torch.ones(1))


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------
@given(kda_shapes(max_batch=3, min_T=2, max_T=50, heads=(1, 3), gva_ratios=(1, 2), key_dims=(60, 100),
                  value_dims=(8,), max_work=100_000))
def test_kda_shapes_respect_bounds(shape):
    assert 1 <= shape.batch <= 3 and 2 <= shape.seq_len <= 50
    assert shape.heads in (1, 3) and shape.value_heads // shape.heads in (1, 2)
    assert shape.value_heads % shape.heads == 0
    assert shape.key_dim in (60, 100) and shape.value_dim == 8
    assert shape.work <= 100_000 or (shape.batch == 1 and shape.seq_len == 2)


@given(st.integers(0, 300).flatmap(lambda t: st.tuples(st.just(t), varlen_splits(t, max_seqs=5))))
def test_varlen_splits_are_valid(total_and_cu):
    total, cu = total_and_cu
    assert cu[0] == 0 and cu[-1] == total and 2 <= len(cu) <= 6
    assert all(a <= b for a, b in zip(cu, cu[1:]))


@given(st.integers(1, 300).flatmap(lambda t: varlen_splits(t, max_seqs=5, allow_empty=False)))
def test_varlen_splits_without_empty_sequences(cu):
    assert all(a < b for a, b in zip(cu, cu[1:]))


def _check_valid(args):
    s = args.shape
    B, T, H, HV, K, V = s.batch, s.seq_len, s.heads, s.value_heads, s.key_dim, s.value_dim
    assert HV % H == 0 and K <= 256
    assert args["q"].shape == args["k"].shape == (B, T, H, K)
    assert args["v"].shape == (B, T, HV, V) and args["g"].shape == (B, T, HV, K)
    assert args["beta"].shape == (B, T, HV)
    dtype = args["q"].dtype
    assert all(args[n].dtype == dtype for n in ("k", "v", "g", "beta"))
    N = args.num_seqs
    if args["cu_seqlens"] is not None:
        cu = args["cu_seqlens"].tolist()
        assert B == 1 and cu[0] == 0 and cu[-1] == T and cu == sorted(cu) and N == len(cu) - 1
    else:
        assert N == B
    h0 = args["initial_state"]
    if h0 is not None:
        assert h0.dtype == torch.float32
        assert h0.shape == ((N, HV, V, K) if args["state_v_first"] else (N, HV, K, V))
    assert args["use_beta_sigmoid_in_kernel"] or not args["allow_neg_eigval"]
    assert args.gate_form in GATE_FORMS
    assert args["use_gate_in_kernel"] == (args.gate_form != "precomputed")
    if args.gate_form == "precomputed":
        assert (args["g"] <= 0).all()
    if args.gate_form == "softplus":
        assert args["A_log"] is not None and args["lower_bound"] is None
    if args.gate_form == "lower_bound":
        assert -5.0 <= args["lower_bound"] < 0
    for name in ("A_log", "dt_bias"):
        if args[name] is not None:
            assert args[name].dtype == torch.float32
    if not args["use_beta_sigmoid_in_kernel"]:
        assert ((args["beta"] >= 0) & (args["beta"] <= 1)).all()
    if not args["use_qk_l2norm_in_kernel"] and T > 0:
        norms = args["k"].float().norm(dim=-1)
        assert torch.allclose(norms, torch.ones_like(norms), atol=1e-2)


@given(kda_inputs(max_T=100, noncontiguous=(False, True), allow_neg_eigval=(False, True),
                  state_v_first=(False, True), scales=(None, 0.5), max_work=300_000))
def test_kda_inputs_are_valid_and_accepted_by_the_op(args):
    _check_valid(args)
    o, state = chunk_kda(**args)
    assert o.shape == args["v"].shape and o.dtype == args["q"].dtype and torch.isfinite(o).all()
    assert (state is not None) == args["output_final_state"]


@given(kda_inputs(max_T=20, noncontiguous=True, initial_state=True, requires_grad=True, heads=(2,),
                  key_dims=(16,), value_dims=(16,)))
def test_kda_inputs_layout_and_grad_options(args):
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        if args.shape.seq_len > 1 or name == "initial_state":
            assert not args[name].is_contiguous(), name
        assert args[name].is_leaf and args[name].requires_grad, name
    assert args["cu_seqlens"] is None or not args["cu_seqlens"].requires_grad


@given(kda_inputs(varlen=True, max_seqs=3, dtypes=torch.bfloat16, gate_forms="lower_bound", max_T=40))
def test_kda_inputs_fixed_options_are_honoured(args):
    assert args["cu_seqlens"] is not None and args.num_seqs <= 3
    assert args["q"].dtype == torch.bfloat16 and args.gate_form == "lower_bound"


@pytest.mark.parametrize(
    "options, fragment",
    [
        (dict(gate_forms=("sigmoid",)), "gate_forms"),
        (dict(dtypes=(torch.int32,)), "dtypes"),
        (dict(key_dims=(512,)), "key_dims"),
        (dict(heads=(0,)), "heads"),
        (dict(allow_neg_eigval=True, beta_sigmoid=False), "allow_neg_eigval"),
        (dict(varlen="yes"), "varlen"),
        (dict(min_T=5, max_T=2), "min_T"),
    ],
)
def test_kda_inputs_rejects_bad_options(options, fragment):
    with pytest.raises(ValueError, match=fragment):
        kda_inputs(**options).example()


def test_make_kda_args_is_deterministic():
    shape = KDAShape(2, 9, 1, 2, 16, 8)
    a = make_kda_args(shape, seed=5, initial_state=True, gate_form="softplus")
    b = make_kda_args(shape, seed=5, initial_state=True, gate_form="softplus")
    c = make_kda_args(shape, seed=6, initial_state=True, gate_form="softplus")
    for name, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[name]), name
    assert not torch.equal(a["q"], c["q"])
    with pytest.raises(ValueError, match="cu_seqlens"):
        make_kda_args(shape, cu_seqlens=[0, 9])  # batch 2 cannot be packed


def test_repr_is_a_short_summary():
    args = make_kda_args(KDAShape(1, 300, 2, 4, 128, 128), seed=42, cu_seqlens=[0, 100, 300])
    text = repr(args)
    assert len(text) < 600 and "seed=42" in text and "cu_seqlens=[0, 100, 300]" in text


@pytest.mark.parametrize("index, test_name", [(0, "test_chunk_matches_recurrent"), (1, "test_attention_matches_sdpa")])
def test_module_docstring_examples_run(index, test_name):
    blocks = re.findall(r"::\n\n(.*?)\n\n(?=\S)", testing.__doc__, re.S)
    namespace = {}
    exec(compile(textwrap.dedent(blocks[index]), "<kda_compile.testing docstring>", "exec"), namespace)
    namespace[test_name]()  # runs the @given test (profile-sized)


# ---------------------------------------------------------------------------------------------
# attention strategies
# ---------------------------------------------------------------------------------------------
@settings(deadline=None)
@given(args=attention_inputs(dtypes=(torch.float32, torch.float64)))
def test_attention_inputs_are_valid_calls(args):
    case = args.case
    assert args["query"].shape == (case.b, case.h, case.sq, case.dqk)
    assert args["key"].shape == (case.b, case.hkv, case.sk, case.dqk) and case.h % case.hkv == 0
    assert args["value"].shape == (case.b, case.hkv, case.sk, case.dv)
    assert args["query"].is_contiguous() != case.noncontiguous or case.sq == 1 or case.h == 1
    assert (args["attn_mask"] is None) == (case.mask == "none")
    assert (args["sliding_window"] is None) or case.causal
    out = attention(**args)  # the op accepts every draw
    assert out.shape == (case.b, case.h, case.sq, case.dv) and torch.isfinite(out).all()


@given(case=attention_cases(max_batch=1, max_q_len=3, max_kv_len=4, kv_heads=2, group_sizes=(2,), head_dims=8,
                            value_dims=(4,), masks=("bool",), causal=True, max_window=0, sinks=False))
def test_attention_cases_respect_their_bounds(case):
    assert case.b == 1 and case.sq <= 3 and case.sk <= 4 and (case.hkv, case.h) == (2, 4)
    assert (case.dqk, case.dv, case.mask, case.causal, case.window, case.sinks) == (8, 4, "bool", True, None, False)


@pytest.mark.parametrize("options, fragment", [
    (dict(masks=("sometimes",)), "masks"), (dict(mask_shapes=("3d",)), "mask_shapes"), (dict(kv_heads=(0,)), "kv_heads"),
    (dict(max_q_len=0), "max_q_len"), (dict(max_window=-1), "max_window"), (dict(dtypes=(torch.int64,)), "dtypes"),
])
def test_attention_inputs_reject_bad_options(options, fragment):
    with pytest.raises(ValueError, match=fragment):
        attention_inputs(**options).example()


def test_make_attention_args_is_deterministic_and_checks_its_case():
    case = AttentionCase(b=2, h=4, hkv=2, sq=3, sk=7, mask="float_inf", mask_shape="b1", sinks=True, dead_rows=True)
    a, b = make_attention_args(case, seed=3), make_attention_args(case, seed=3)
    for name, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[name]), name
    assert (a["attn_mask"][:, :, 0] == -math.inf).all() and a["sinks"].shape == (4,)
    assert "seed=3" in repr(a) and len(repr(a)) < 400
    with pytest.raises(ValueError, match="case.mask must be one of"):
        make_attention_args(case.with_(mask="sometimes"))
    with pytest.raises(TypeError, match="dtype must be one of"):
        make_attention_args(case, dtype=torch.int32)


def test_public_names():
    for name in testing.__all__:
        assert getattr(testing, name) is not None
    assert testing.__doc__ and "@given(kda_inputs(" in testing.__doc__


# ---------------------------------------------------------------------------------------------
# MLA strategies
# ---------------------------------------------------------------------------------------------
@settings(deadline=None)
@given(args=mla_inputs(dtypes=(torch.float32, torch.float64)))
def test_mla_inputs_are_valid_calls(args):
    case = args.case
    assert args["q_nope"].shape == (case.b, case.h, case.sq, case.dn)
    assert args["q_rope"].shape == (case.b, case.h, case.sq, case.dr)
    assert args["kv_latent"].shape[-2:] == (case.t, case.r) and args["k_rope"].shape[-2:] == (case.t, case.dr)
    assert args["kv_b_weight"].shape == (case.h * (case.dn + case.dv), case.r)
    assert (args["attn_mask"] is None) == (case.mask == "none") and args["scale"] == case.softmax_scale
    out = mla_attention(**args)  # the op accepts every draw
    assert out.shape == (case.b, case.h, case.sq, case.dv) and torch.isfinite(out).all()


@given(case=mla_cases(max_batch=1, max_heads=2, max_t=5, query_kinds="decode", nope_dims=8, rope_dims=4,
                      value_dims=8, ranks=16, masks="padding", causal=False, hf_layout=True, transposed_weight=False))
def test_mla_cases_respect_their_bounds(case):
    assert case.b == 1 and case.h <= 2 and case.t <= 5 and case.sq == 1
    assert (case.dn, case.dr, case.dv, case.r, case.mask, case.causal) == (8, 4, 8, 16, "padding", False)


@pytest.mark.parametrize("options, fragment", [
    (dict(query_kinds=("verify",)), "query_kinds"), (dict(masks=("causal",)), "masks"), (dict(ranks=(0,)), "ranks"),
    (dict(max_t=0), "max_t"), (dict(dtypes=(torch.int8,)), "dtypes"),
])
def test_mla_inputs_reject_bad_options(options, fragment):
    with pytest.raises(ValueError, match=fragment):
        mla_inputs(**options).example()


def test_make_mla_args_is_deterministic_and_checks_its_case():
    case = MLACase(b=2, h=2, sq=3, t=7, mask="padding", transposed_weight=True)
    a, b = make_mla_args(case, seed=4), make_mla_args(case, seed=4)
    for name, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[name]), name
    assert not a["kv_b_weight"].is_contiguous() and a["attn_mask"].shape == (2, 1, 3, 7)
    assert "seed=4" in repr(a) and len(repr(a)) < 400
    with pytest.raises(ValueError, match="case.mask_shape must be one of"):
        make_mla_args(case.with_(mask_shape="3d"))



# ---------------------------------------------------------------------------------------------
# block-sparse attention strategies
# ---------------------------------------------------------------------------------------------
@settings(deadline=None)
@given(args=testing.block_sparse_inputs(dtypes=(torch.float32, torch.float64)))
def test_block_sparse_inputs_are_valid_calls(args):
    from kda_compile.ops import block_sparse_attention

    case = args.case
    assert args["query"].shape == (case.b, case.heads, case.sq, case.dim) and case.heads % case.groups == 0
    assert args["key"].shape == (case.b, case.groups, case.t, case.dim)
    assert args["value"].shape == (case.b, case.groups, case.t, case.dv)
    idx = args["block_indices"]
    assert idx.shape == (case.b, case.groups, case.sq, case.slots) and (idx[0, 0, 0] == -1).all()
    assert ((idx >= -1) & (idx < -(-case.t // case.block_size))).all()
    assert (args["query_positions"] is None) != case.positions and (args["key_padding_mask"] is None) != case.padding
    out = block_sparse_attention(**args)  # the op accepts every draw
    assert out.shape == (case.b, case.heads, case.sq, case.dv) and torch.isfinite(out).all()


@given(case=testing.block_sparse_cases(max_batch=1, max_queries=3, max_keys=9, max_groups=1, max_heads_per_group=2,
                                       block_sizes=(4,), head_dims=(8,), kinds="decode", transposed=False))
def test_block_sparse_cases_respect_their_bounds(case):
    assert case.b == 1 and case.sq == 1 and case.t <= 9 and case.groups == 1 and case.heads <= 2
    assert (case.block_size, case.dim, case.dv, case.transposed) == (4, 8, 8, False)


def test_make_block_sparse_args_is_deterministic_and_checks_its_case():
    case = testing.BlockSparseCase(positions=True, padding=True, repeats=True, slots=3)
    a, b = testing.make_block_sparse_args(case, seed=3), testing.make_block_sparse_args(case, seed=3)
    for name, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[name]), name
    assert "seed=3" in repr(a)
    with pytest.raises(ValueError, match="case.groups must divide case.heads"):
        testing.make_block_sparse_args(case.with_(groups=3))
    with pytest.raises(ValueError, match="kinds must contain only"):
        testing.block_sparse_inputs(kinds=("sometimes",)).example()
