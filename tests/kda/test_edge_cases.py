"""kda.md section 7 edge cases: finite outputs that match the fp64 recurrence.

Very negative gates (the state must reset, no NaN), g = 0, beta = 0 and 1, runs of 16 and 64
identical keys (the ill-conditioned triangular solve), T = 1, T < chunk, zero-length sequences in
cu_seqlens (at the start, middle and end, and all of them).
"""
import pytest
import torch

from kda_compile.ops import chunk_kda, fused_recurrent_kda
from kda_compile.testing import KDAShape, make_kda_args

from .recurrence import compare_with_recurrence, kda_recurrence

DTYPES = [torch.float32, torch.bfloat16]


def _chunk(args, tolerances=None):
    return compare_with_recurrence(chunk_kda, args, tolerances=tolerances)


def _fused(args, tolerances=None):
    with torch.no_grad():
        return compare_with_recurrence(fused_recurrent_kda, args, with_grads=False, tolerances=tolerances)


OPS = {"chunk_kda": _chunk, "fused_recurrent_kda": _fused}


def _args(shape, dtype, device, **options):
    return make_kda_args(shape, seed=11, dtype=dtype, device=device, initial_state=True, **options)


def _uniform(like, low, high, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(like.shape, generator=gen) * (high - low) + low).to(like)


@pytest.mark.parametrize("op", OPS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_very_negative_gates_reset_the_state(op, dtype, device):
    args = _args(KDAShape(2, 80, 1, 2, 32, 16), dtype, device)
    args["g"] = _uniform(args["g"], -1e3, -30.0)
    OPS[op](args)
    # exp(g) underflows to 0: each token starts from an empty state, so o_t = beta_t (q_t . k_t) v_t.
    o, _ = chunk_kda(**args)
    assert torch.isfinite(o).all()
    o_ref, _ = kda_recurrence(**dict(args, initial_state=None))
    torch.testing.assert_close(o.double(), o_ref, rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("op", OPS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_very_negative_in_kernel_gate(op, dtype, device):
    # softplus(f) = f for large f, A = 16: g ~ -16 * 60 per token.
    args = _args(KDAShape(1, 70, 2, 2, 60, 32), dtype, device, gate_form="softplus", dt_bias=False)
    args["g"] = _uniform(args["g"], 40.0, 80.0)
    # The exact dA_log = sum(dg * g) is ~1e-94 here (dg ~ exp(g)); the op's dg is the fp32 leftover
    # of cancelling O(1) terms (~1e-8), multiplied by |g| ~ 1e3 over T * K terms: an absolute
    # ~4e-5 against the 1.4e-3 floor. 5e-2 of the floor still fails any real gradient error.
    # On CUDA, FLA's TF32/bf16 products leave dg noise ~10x larger (measured 0.11-0.25 of the floor on
    # an H200), still far below a real error (|sum dg * g| with |g| ~ 1e3).
    OPS[op](args, tolerances=dict(A_log=5e-2 if device.type == "cpu" else 5e-1))


@pytest.mark.parametrize("op", OPS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_gate_no_decay(op, dtype, device):
    args = _args(KDAShape(2, 100, 2, 2, 64, 32), dtype, device)
    args["g"] = torch.zeros_like(args["g"])
    OPS[op](args)


@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("op", OPS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_beta_zero_and_one(beta, op, dtype, device):
    args = _args(KDAShape(2, 70, 1, 1, 32, 32), dtype, device)
    args["beta"] = torch.full_like(args["beta"], beta)
    OPS[op](args)
    if beta == 0.0:  # nothing is written: o_t = S_t^T (scale q_t) with S_t the decayed initial state
        o, state = chunk_kda(**args)
        decay = args["g"].double().cumsum(1).exp()  # [B, T, HV, K]
        h0 = args["initial_state"].double()
        expected = torch.einsum("btk,btk,bkv->btv", args["q"][:, :, 0].double() * 32 ** -0.5, decay[:, :, 0], h0[:, 0])
        torch.testing.assert_close(o[:, :, 0].double(), expected, rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(state[:, 0].double(), decay[:, -1, 0, :, None] * h0[:, 0], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("run_length", [16, 64])
@pytest.mark.parametrize("beta", [None, 1.0])
@pytest.mark.parametrize("op", OPS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_identical_keys(run_length, beta, op, dtype, device):
    # A run of identical unit keys makes the intra-chunk system as ill-conditioned as it gets.
    args = _args(KDAShape(1, 96, 1, 1, 64, 32), dtype, device)
    start = 10
    k = args["k"].clone()
    k[:, start : start + run_length] = k[:, start : start + 1]
    args["k"] = k
    args["q"] = k.clone()  # read back what was written
    tolerances = None
    if beta is not None:
        args["beta"] = torch.full_like(args["beta"], beta)
        if device.type == "cuda":
            # beta = 1 overwrites the state along the repeated key, so dh0 along it is 0 by exact
            # cancellation; FLA's TF32/bf16 solve leaves RMS noise of 1e-5..2e-5 there (measured on an
            # H200: 8e-3 / 2e-2 of the grad floor). Other gradients keep their tolerances.
            tolerances = dict(initial_state=5e-2)
    OPS[op](args, tolerances=tolerances)


@pytest.mark.parametrize("T", [1, 5, 63, 64, 65])
@pytest.mark.parametrize("op", OPS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_short_sequences(T, op, dtype, device):
    OPS[op](_args(KDAShape(2, T, 2, 4, 60, 100), dtype, device, gate_form="lower_bound"))


@pytest.mark.parametrize(
    "cu_seqlens", [[0, 0, 5, 40], [0, 5, 5, 40], [0, 5, 40, 40], [0, 0, 0, 70, 70]], ids=str
)
@pytest.mark.parametrize("op", OPS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_sequences_in_cu_seqlens(cu_seqlens, op, dtype, device):
    T = cu_seqlens[-1]
    args = _args(KDAShape(1, T, 1, 2, 32, 16), dtype, device, cu_seqlens=cu_seqlens, gate_form="softplus")
    OPS[op](args)
    _, state = chunk_kda(**args)
    for n in range(len(cu_seqlens) - 1):
        if cu_seqlens[n] == cu_seqlens[n + 1]:
            assert torch.equal(state[n], args["initial_state"][n]), f"empty sequence {n} changed its state"


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("op", [chunk_kda, fused_recurrent_kda], ids=lambda f: f.__name__)
def test_all_sequences_empty(with_state, op, device):
    # T = 0 packed tokens: o is empty; final states are the initial states (or zeros).
    args = make_kda_args(KDAShape(1, 0, 1, 2, 16, 16), cu_seqlens=[0, 0, 0], initial_state=with_state,
                         device=device)
    o, state = op(**args)
    assert o.shape == (1, 0, 2, 16)
    expected = args["initial_state"] if with_state else torch.zeros(2, 2, 16, 16, device=device)
    assert torch.equal(state, expected)


@pytest.mark.parametrize("rule", ["kda", "gdn"])
def test_gradients_of_a_call_without_tokens(rule, device):
    """T = 0: the final state is the initial state, so its gradient passes straight through; every other
    input gets an empty gradient (the reference backward used to fail: o depends on nothing)."""
    from kda_compile.ops import chunk_gated_delta_rule

    q, k = (torch.randn(1, 0, 2, 8, device=device, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 0, 2, 8, device=device, requires_grad=True)
    g = torch.randn((1, 0, 2, 8) if rule == "kda" else (1, 0, 2), device=device, requires_grad=True)
    beta = torch.rand(1, 0, 2, device=device, requires_grad=True)
    h0 = torch.randn(1, 2, 8, 8, device=device, requires_grad=True)
    op = chunk_kda if rule == "kda" else chunk_gated_delta_rule
    o, final = op(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    dht = torch.randn_like(final)
    grads = torch.autograd.grad((o.sum(), (final * dht).sum()), (q, k, v, g, beta, h0), allow_unused=True)
    assert torch.equal(grads[-1], dht)
    assert all(grad is None or grad.numel() == 0 for grad in grads[:-1])
