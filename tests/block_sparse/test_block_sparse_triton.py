"""The Triton forward kernel (ops/block_sparse/triton_forward.py) against the float64 reference: on CUDA, or on
CPU under the Triton interpreter. Relative error (Frobenius) of out within 1e-5 in float32 (IEEE dots), 3e-3 in
float16, 2e-2 in bfloat16 (CUDA only: the interpreter has no bfloat16 dots); lse (float32 in every case) within
1e-5 in float32, 2e-3 otherwise, -inf exactly where the reference has it."""
import pytest
import torch

from tests.triton_device import triton_device

DEVICE = triton_device("the block-sparse Triton kernel")

from kda_compile.ops.block_sparse.reference import block_sparse_attention_reference  # noqa: E402
from kda_compile.ops.block_sparse.triton_forward import (  # noqa: E402
    block_sparse_attention_fwd_triton,
    block_size_problem,
    key_tile,
    selection_in_block_order,
    split_count,
)
from kda_compile.testing import BlockSparseCase, assert_rel_close, make_block_sparse_args  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def _run_and_compare(args, dtype, splits=None):
    scale = args["scale"] if args["scale"] is not None else args["query"].shape[-1] ** -0.5
    extra = (args["query_positions"], args["key_padding_mask"])
    out, lse = block_sparse_attention_fwd_triton(args["query"], args["key"], args["value"], args["block_indices"],
                                                 args["block_size"], scale, *extra, splits=splits)
    ref_out, ref_lse = block_sparse_attention_reference(
        *(args[n].double() for n in ("query", "key", "value")), args["block_indices"], args["block_size"], scale,
        *extra)
    assert out.dtype == dtype and out.is_contiguous() and lse.dtype == torch.float32
    assert_rel_close(out, ref_out, TOLERANCE[dtype], name="out")
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and (out[empty] == 0).all()
    if (~empty).any():
        assert_rel_close(lse[~empty], ref_lse[~empty], 1e-5 if dtype == torch.float32 else 2e-3, name="lse")
    return out, lse


CASES = {
    "prefill-block16": BlockSparseCase(b=2, heads=4, groups=2, sq=40, t=40, block_size=16, slots=2),
    "prefill-block32-padded-keys": BlockSparseCase(b=2, heads=2, groups=1, sq=20, t=70, block_size=32, slots=3,
                                                   padding=True),
    "decode": BlockSparseCase(b=3, heads=6, groups=3, sq=1, t=75, block_size=16, slots=4),
    "chunk-positions": BlockSparseCase(b=2, heads=3, groups=1, sq=5, t=50, block_size=16, slots=5, positions=True),
    "repeats-transposed": BlockSparseCase(b=1, heads=4, groups=2, sq=6, t=64, dim=24, dv=8, block_size=48,
                                          slots=3, repeats=True, transposed=True, scale=0.3),
    "one-block-of-128": BlockSparseCase(b=1, heads=2, groups=2, sq=3, t=130, block_size=128, slots=2),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_triton_forward_matches_the_reference(name, dtype):
    args = make_block_sparse_args(CASES[name], dtype, DEVICE, seed=len(name))
    _run_and_compare(args, dtype)


def test_rows_without_a_visible_key_give_zero():
    args = make_block_sparse_args(CASES["chunk-positions"], torch.float32, DEVICE, seed=1)
    args["block_indices"][0, 0, 1] = -1  # every slot empty
    args["query_positions"][1, 2] = -1  # before the first key
    args["block_indices"][1, 0, 3] = torch.tensor([2, -1, -1, -1, -1])
    args["query_positions"][1, 3] = 20  # block 2 starts at slot 32: all in its future
    out, lse = _run_and_compare(args, torch.float32)
    for b, i in ((0, 1), (1, 2), (1, 3)):
        assert (out[b, :, i] == 0).all() and torch.isinf(lse[b, :, i]).all()


def test_a_repeated_block_counts_once():
    args = make_block_sparse_args(CASES["decode"], torch.float32, DEVICE, seed=2)
    args["block_indices"][..., 1:] = -1
    once, _ = block_sparse_attention_fwd_triton(args["query"], args["key"], args["value"], args["block_indices"],
                                                16, 0.25)
    args["block_indices"][..., 2] = args["block_indices"][..., 0]
    args["block_indices"][..., 3] = args["block_indices"][..., 0]
    twice, _ = block_sparse_attention_fwd_triton(args["query"], args["key"], args["value"], args["block_indices"],
                                                 16, 0.25)
    torch.testing.assert_close(twice, once, rtol=0, atol=0)


def test_unchecked_entries_out_of_range_are_empty_slots():
    # What CUDA does without KDA_COMPILE_CHECK_INPUTS: never a row past the keys.
    args = make_block_sparse_args(CASES["decode"], torch.float32, DEVICE, seed=3)
    clean, _ = block_sparse_attention_fwd_triton(args["query"], args["key"], args["value"], args["block_indices"],
                                                 16, 0.25)
    bad = args["block_indices"].clone()
    bad[bad == -1] = 1000
    with_bad, _ = block_sparse_attention_fwd_triton(args["query"], args["key"], args["value"], bad, 16, 0.25)
    torch.testing.assert_close(with_bad, clean, rtol=0, atol=0)


SPLIT_CASES = ["decode", "chunk-positions", "repeats-transposed", "prefill-block32-padded-keys"]


@pytest.mark.parametrize("splits", [2, 3, 64], ids=["2-runs", "3-runs", "one-run-per-slot"])
@pytest.mark.parametrize("name", SPLIT_CASES)
def test_split_selections_match_the_reference(name, splits):
    """Selections split into runs of slots (partials merged by their log-sum-exp) give the unsplit results; a
    count above the slots is one run per slot. Runs without a key (every slot empty or in the future) merge to
    zero rows and -inf."""
    args = make_block_sparse_args(CASES[name], torch.float32, DEVICE, seed=len(name) + splits)
    if name == "chunk-positions":
        args["block_indices"][0, 0, 1] = -1
        args["query_positions"][1, 2] = -1
    out, lse = _run_and_compare(args, torch.float32, splits=splits)
    whole, whole_lse = block_sparse_attention_fwd_triton(
        args["query"], args["key"], args["value"], args["block_indices"], args["block_size"],
        args["scale"] if args["scale"] is not None else args["query"].shape[-1] ** -0.5,
        args["query_positions"], args["key_padding_mask"], splits=1)
    assert_rel_close(out, whole, 1e-6, name="split out")
    assert torch.equal(torch.isinf(lse), torch.isinf(whole_lse))


def test_a_repeat_across_a_run_boundary_counts_once():
    args = make_block_sparse_args(CASES["decode"], torch.float32, DEVICE, seed=5)
    args["block_indices"][..., 1] = args["block_indices"][..., 0]  # sorted, slots 0 and 1 fall in different runs
    _run_and_compare(args, torch.float32, splits=4)


def test_split_count_fills_the_device_and_leaves_full_grids_alone():
    cpu = torch.device("cpu")  # the interpreter's device: 4 SMs assumed, 8 programs wanted
    assert split_count(programs=8, slots=16, device=cpu) == 1
    assert split_count(programs=1, slots=16, device=cpu) == 8
    assert split_count(programs=3, slots=16, device=cpu) == 3  # 3 runs of 6, 6 and 4 slots
    assert split_count(programs=1, slots=5, device=cpu) == 5
    assert split_count(programs=1, slots=1, device=cpu) == 1


def test_a_small_grid_splits_by_default():
    case = BlockSparseCase(b=1, heads=4, groups=1, sq=1, t=200, block_size=16, slots=6)
    args = make_block_sparse_args(case, torch.float32, DEVICE, seed=9)
    assert split_count(1, 6, DEVICE) > 1
    _run_and_compare(args, torch.float32)


def test_selection_in_block_order_and_accepted_block_sizes():
    idx = torch.tensor([[[[3, -1, 1, 3, 7, -5]]]])
    assert selection_in_block_order(idx, 5).tolist() == [[[[1, 3, 3, 5, 5, 5]]]]
    assert [key_tile(n) for n in (16, 32, 48, 128, 8, 24)] == [16, 32, 16, 64, None, None]
    assert block_size_problem(128) is None
    assert "not a multiple of 16" in block_size_problem(24)


# ----------------------------------------------------------------------------------------------
# Backward (ops/block_sparse/triton_backward.py)
# ----------------------------------------------------------------------------------------------
from kda_compile.ops.block_sparse.triton_backward import block_sparse_attention_bwd_triton  # noqa: E402

GRAD_TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _compare_gradients(args, dtype):
    scale = args["scale"] if args["scale"] is not None else args["query"].shape[-1] ** -0.5
    extra = (args["query_positions"], args["key_padding_mask"])
    q, k, v, idx = (args[n] for n in ("query", "key", "value", "block_indices"))
    out, lse = block_sparse_attention_fwd_triton(q, k, v, idx, args["block_size"], scale, *extra)
    gen = torch.Generator().manual_seed(11)
    grad_out = torch.randn(out.shape, generator=gen).to(DEVICE, dtype)
    grads = block_sparse_attention_bwd_triton(grad_out, q, k, v, idx, *extra, out, lse,
                                              args["block_size"], scale)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = block_sparse_attention_reference(*leaves, idx, args["block_size"], scale, *extra)
    expected = torch.autograd.grad(ref_out, leaves, grad_out.double())
    for name, got, want, like in zip(("dq", "dk", "dv"), grads, expected, (q, k, v)):
        assert got.dtype == like.dtype and got.shape == like.shape and got.is_contiguous()
        assert_rel_close(got, want, GRAD_TOLERANCE[dtype], name=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["prefill-block16", "decode", "chunk-positions", "repeats-transposed",
                                  "prefill-block32-padded-keys"])
def test_triton_backward_matches_the_reference(name, dtype):
    args = make_block_sparse_args(CASES[name], dtype, DEVICE, seed=len(name) + 1)
    _compare_gradients(args, dtype)


def test_triton_backward_with_rows_without_a_key():
    args = make_block_sparse_args(CASES["chunk-positions"], torch.float32, DEVICE, seed=12)
    args["block_indices"][0, 0, 1] = -1  # a row without a key: no gradient from it, no NaN
    args["query_positions"][1, 2] = -1
    _compare_gradients(args, torch.float32)
