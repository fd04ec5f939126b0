"""FLA 0.6's deprecated ``transpose_state_layout`` (the old name of ``state_v_first``) is accepted by the four
public delta-rule functions as FLA accepts it: the same result as ``state_v_first``, a DeprecationWarning, and an
error naming it when both are given."""
import pytest
import torch

from kda_compile.ops import chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule, fused_recurrent_kda
from kda_compile.testing import KDAShape, make_kda_args

OPS = [chunk_kda, fused_recurrent_kda, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule]


def _args(op):
    args = make_kda_args(KDAShape(1, 8, 2, 2, 8, 4), seed=0, initial_state=True, output_final_state=True)
    args.pop("state_v_first", None)
    args["initial_state"] = args["initial_state"].transpose(-1, -2).contiguous()  # [N, HV, V, K]
    if op in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule):
        args["g"] = args["g"][..., 0]  # one decay per head
        args.pop("lower_bound", None)
    return args


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.__name__)
def test_the_old_name_gives_the_same_result_with_a_warning(op):
    args = _args(op)
    want = op(**args, state_v_first=True)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout.*state_v_first"):
        got = op(**args, transpose_state_layout=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.__name__)
def test_both_names_are_an_error_naming_the_old_one(op):
    with pytest.raises(ValueError, match="transpose_state_layout.*state_v_first"):
        op(**_args(op), state_v_first=True, transpose_state_layout=True)
