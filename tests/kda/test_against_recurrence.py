"""chunk_kda and fused_recurrent_kda against the fp64 recurrence on fixed cases covering every
option: outputs, final states and every gradient (q, k, v, g, beta, initial_state, A_log, dt_bias).

Tolerances (relative RMS error, see recurrence.TOLERANCES): bf16 as kda.md section 7, fp32 1e-4
(o, state, dq, dk, dv, dh0), 5e-4 (dg, dbeta, ddt_bias), 5e-3 (dA_log); fp64 1e-10.
"""
import pytest
import torch

from kda_compile.ops import chunk_kda, fused_recurrent_kda
from kda_compile.testing import KDAShape, make_kda_args

from .recurrence import compare_with_recurrence

# (id, shape, cu_seqlens, options for make_kda_args)
CASES = [
    ("mha-precomputed-gate-state", KDAShape(2, 100, 2, 2, 64, 64), None,
     dict(initial_state=True)),
    ("gva-softplus-l2norm-K60-V100", KDAShape(1, 65, 2, 4, 60, 100), None,
     dict(gate_form="softplus", qk_l2norm=True)),
    ("lower-bound-no-A_log-negeig-v-first", KDAShape(2, 130, 1, 2, 100, 60), None,
     dict(gate_form="lower_bound", A_log=False, lower_bound=-5.0, beta_sigmoid=True, allow_neg_eigval=True,
          initial_state=True, state_v_first=True)),
    ("varlen-empty-seqs-noncontiguous", KDAShape(1, 150, 2, 2, 32, 48), [0, 0, 17, 80, 80, 150],
     dict(gate_form="lower_bound", initial_state=True, noncontiguous=True, beta_sigmoid=True)),
    ("one-token-custom-scale", KDAShape(3, 1, 1, 1, 16, 16), None,
     dict(scale=0.3, initial_state=True)),
    ("K256-no-final-state", KDAShape(1, 20, 1, 1, 256, 32), None,
     dict(output_final_state=False, gate_form="softplus", dt_bias=False)),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def _case_args(shape, cu_seqlens, options, dtype, device):
    return make_kda_args(shape, seed=7, dtype=dtype, cu_seqlens=cu_seqlens, device=device, **options)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_chunk_kda_forward_and_gradients(case, dtype, device):
    _, shape, cu_seqlens, options = case
    compare_with_recurrence(chunk_kda, _case_args(shape, cu_seqlens, options, dtype, device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fused_recurrent_kda_inference(case, dtype, device):
    _, shape, cu_seqlens, options = case
    with torch.no_grad():  # the decode kernel itself (no input requires grad)
        compare_with_recurrence(fused_recurrent_kda, _case_args(shape, cu_seqlens, options, dtype, device),
                                with_grads=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_recurrent_kda_gradients(dtype, device):
    # With inputs requiring grad it takes the differentiable path: same result, with a backward.
    _, shape, cu_seqlens, options = CASES[3]
    compare_with_recurrence(fused_recurrent_kda, _case_args(shape, cu_seqlens, options, dtype, device))


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_chunk_sizes(chunk_size, device):
    args = _case_args(KDAShape(2, 70, 2, 2, 60, 32), None, dict(initial_state=True, gate_form="softplus"),
                      torch.float32, device)

    def op(**kw):
        return chunk_kda(**kw, chunk_size=chunk_size)

    compare_with_recurrence(op, args)


def test_fused_recurrent_kda_positional_order(device):
    # FLA's order: (q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, ...).
    args = _case_args(KDAShape(1, 5, 1, 1, 16, 16), None, dict(gate_form="softplus", initial_state=True),
                      torch.float32, device)
    a = args
    o_pos, s_pos = fused_recurrent_kda(a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"], 0.2,
                                       a["initial_state"], True, False, True)
    o_kw, s_kw = fused_recurrent_kda(**dict(args, scale=0.2, output_final_state=True))
    torch.testing.assert_close(o_pos, o_kw, rtol=0, atol=0)
    torch.testing.assert_close(s_pos, s_kw, rtol=0, atol=0)
