"""Packed sequences without a chunk plan: with at most ``INLINE_SEQS`` sequences our CUDA prepare (its
``inline_offsets`` form) and scan find each chunk's sequence from ``cu_seqlens`` alone, no ``chunk_offsets`` computed
or launched before them, and the CUDA scan zeroes the rows of ``o`` past the last sequence (``o`` is not zero-filled
first). On CUDA: the prepare returns bitwise what its chunk-plan form returns, the forward matches the fp64
recurrence on both sides of the limit, rows of no sequence read 0 over memory left full of NaN, and launch plans
launch the chunk plan only beyond the limit."""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_compile.ops import chunk_kda
from kda_compile.ops.kda.prefill.cuda import prepare as cuda_prepare
from kda_compile.ops.kda.prefill import fast_path
from kda_compile.ops.kda.prefill import run as triton_chunk
from kda_compile.ops.kda.prefill.cuda import prepare_source as prepare_src
from kda_compile.ops.kda.reference import kda_reference
from kda_compile.testing import rel_error

from .recurrence import tolerances_for

K = V = 128
LB = -5.0
LIMIT = prepare_src.INLINE_SEQS
cuda = pytest.mark.cuda


def _lengths(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([0, 1, rng.randint(2, 63), rng.randint(64, 150)]) for _ in range(count)]


def _offsets(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


# (offsets, tokens after the last sequence): empty and one-token sequences, a tail of no sequence, two rounds of the
# warp's lookup (33 sequences), the largest count without a chunk plan, and one more (the plan)
CASES = {
    "empty-one-token-tail": (_offsets([0, 100, 1, 232]), 67),
    "33-sequences": (_offsets(_lengths(33, 1)), 5),
    "inline-limit": (_offsets(_lengths(LIMIT, 2)), 0),
    "first-and-last-empty": (_offsets([0, 64, 65, 0]), 0),
    "beyond-the-limit": (_offsets(_lengths(LIMIT + 2, 3)), 9),
}


def _inputs(offsets, tail, *, H=2, HV=2, scalar_gate=False, cu_dtype=torch.int32, seed=0):
    torch.manual_seed(seed)
    T = offsets[-1] + tail
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    N = len(offsets) - 1
    return dict(
        q=torch.randn(1, T, H, K, **bf16), k=torch.randn(1, T, H, K, **bf16), v=torch.randn(1, T, HV, V, **bf16),
        g=torch.randn(1, T, HV, **bf16) if scalar_gate else torch.randn(1, T, HV, K, **bf16),
        beta=torch.randn(1, T, HV, **bf16), A_log=torch.rand(HV, device="cuda"),
        dt_bias=torch.randn(HV if scalar_gate else HV * K, device="cuda") * 0.1,
        initial_state=torch.randn(N, HV, K, V, device="cuda"),
        cu_seqlens=torch.tensor(offsets, device="cuda", dtype=cu_dtype))


def _forward(x, *, lower_bound, scalar_gate=False):
    return triton_chunk.chunk_kda_prefill(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["initial_state"], x["cu_seqlens"],
        scale=K ** -0.5, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound, scalar_gate=scalar_gate)


def _spy_prepare(monkeypatch) -> list:
    """Whether each CUDA prepare launch from now on ran the ``inline_offsets`` form."""
    seen, real = [], triton_chunk.launch_prepare

    def spy(tensors, slots, args):
        seen.append(bool(args.get("INLINE_OFFSETS")))
        return real(tensors, slots, args)
    monkeypatch.setattr(triton_chunk, "launch_prepare", spy)
    return seen


def _poison_free_memory(nbytes: int) -> None:
    torch.full((nbytes // 2 + 4096,), float("nan"), device="cuda", dtype=torch.bfloat16)


@cuda
@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "gdn"])
@pytest.mark.parametrize("case", [name for name in CASES if name != "beyond-the-limit"])
def test_the_prepare_without_a_chunk_plan_returns_what_it_returns_with_one(case, gate, monkeypatch):
    offsets, tail = CASES[case]
    scalar_gate = gate == "gdn"
    x = _inputs(offsets, tail, scalar_gate=scalar_gate, cu_dtype=torch.int64 if case == "33-sequences" else torch.int32)
    lower_bound = LB if gate == "lower_bound" else None
    seen = _spy_prepare(monkeypatch)
    _poison_free_memory(x["v"].numel() * 2 * 8)  # o comes from new_empty: unwritten rows would read NaN
    o, final, _ = _forward(x, lower_bound=lower_bound, scalar_gate=scalar_gate)
    monkeypatch.setattr(triton_chunk, "INLINE_SEQS", 0)  # the prepare's chunk-plan form for any count
    o_plan, final_plan, _ = _forward(x, lower_bound=lower_bound, scalar_gate=scalar_gate)
    assert seen == [True, False]
    assert not o.isnan().any() and torch.equal(o, o_plan) and torch.equal(final, final_plan)
    assert torch.all(o[:, offsets[-1]:] == 0)


@cuda
@settings(deadline=None, max_examples=40)
@given(lengths=st.lists(st.sampled_from([0, 1, 2, 63, 64, 65, 127, 128, 129, 200]) | st.integers(0, 300),
                        min_size=1, max_size=LIMIT + 12),
       tail=st.sampled_from([0, 0, 1, 63, 64, 130]), gate=st.sampled_from(["lower_bound", "softplus", "gdn"]),
       int64=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_drawn_packings_equal_the_chunk_plan_form(lengths, tail, gate, int64, seed):
    """Drawn sequence counts (1 to INLINE_SEQS + 12, empty ones and a tail of no sequence included) and lengths
    around the chunk size: the default call equals the chunk-plan form bitwise, rows of no sequence read 0."""
    offsets = _offsets(lengths)
    scalar_gate = gate == "gdn"
    x = _inputs(offsets, tail, scalar_gate=scalar_gate, cu_dtype=torch.int64 if int64 else torch.int32, seed=seed)
    lower_bound = LB if gate == "lower_bound" else None
    _poison_free_memory(x["v"].numel() * 2 * 8)
    o, final, _ = _forward(x, lower_bound=lower_bound, scalar_gate=scalar_gate)
    limit = triton_chunk.INLINE_SEQS
    triton_chunk.INLINE_SEQS = 0  # the prepare's chunk-plan form for any count
    try:
        o_plan, final_plan, _ = _forward(x, lower_bound=lower_bound, scalar_gate=scalar_gate)
    finally:
        triton_chunk.INLINE_SEQS = limit
    assert not o.isnan().any() and torch.equal(o, o_plan) and torch.equal(final, final_plan)
    assert torch.all(o[:, offsets[-1]:] == 0)


@cuda
@pytest.mark.parametrize("case", ["empty-one-token-tail", "inline-limit", "beyond-the-limit"])
def test_the_forward_matches_the_recurrence_on_both_sides_of_the_limit(case, monkeypatch):
    offsets, tail = CASES[case]
    x = _inputs(offsets, tail, H=2, HV=4, seed=3)
    seen = _spy_prepare(monkeypatch)
    _poison_free_memory(x["v"].numel() * 2 * 8)
    o, final, _ = _forward(x, lower_bound=LB)
    assert seen == [len(offsets) - 1 <= LIMIT]
    end = offsets[-1]  # the reference takes no tokens past the last sequence
    ref_o, ref_final = kda_reference(
        *(x[name][:, :end].double() for name in ("q", "k", "v", "g", "beta")), scale=K ** -0.5,
        cu_seqlens=x["cu_seqlens"], initial_state=x["initial_state"].double(), A_log=x["A_log"].double(),
        dt_bias=x["dt_bias"].double(), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=LB)
    tol = tolerances_for(torch.bfloat16, "cuda")
    assert rel_error(o[:, :end].double(), ref_o.double()) < tol["o"]
    assert rel_error(final.double(), ref_final.double()) < tol["final_state"]
    assert torch.all(o[:, end:] == 0)


@cuda
@pytest.mark.parametrize("count", [5, LIMIT + 1])
def test_launch_plans_launch_a_chunk_plan_only_beyond_the_limit(count):
    fast_path.clear_plans()
    offsets = _offsets(_lengths(count, 4))
    x = _inputs(offsets, 3, seed=5)
    kwargs = dict(initial_state=x.pop("initial_state"), output_final_state=True, cu_seqlens=x.pop("cu_seqlens"),
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  lower_bound=LB)
    try:
        with torch.inference_mode():
            want = chunk_kda(**x, **kwargs)
            chunk_kda(**x, **kwargs)  # learns the plan
            plans = [plan for plan in fast_path._plans.values() if plan is not None]
            assert len(plans) == 1 and (plans[0].planner_args is None) == (count <= LIMIT)
            _poison_free_memory(want[0].numel() * 2 * 8)
            got = chunk_kda(**x, **kwargs)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.all(got[0][:, offsets[-1]:] == 0)
    finally:
        fast_path.clear_plans()


def test_the_inline_form_is_refused_beyond_the_limit():
    args = dict(IS_VARLEN=True, N=LIMIT + 1, HV=1, INLINE_OFFSETS=True)
    with pytest.raises(ValueError, match=rf"INLINE_OFFSETS takes at most {LIMIT} sequences, got N={LIMIT + 1}"):
        cuda_prepare.launch_prepare((torch.empty(0),) * 17, 1, args)
    with pytest.raises(ValueError, match="inline_offsets needs varlen"):
        prepare_src.kernel_source(g_dtype="bf16", beta_dtype="bf16", cu_dtype="int", varlen=False, l2norm=True,
                                  has_a_log=True, has_dt_bias=True, beta_sigmoid=True, save_akk=False,
                                  inline_offsets=True)
