"""``dsa_pooled_indexer_topk`` on calls drawn by ``kda_compile.testing.dsa_pooled_inputs`` against the dense float64
oracle that follows HF's ``Glm5NextTextIndexer`` step by step (``pooled_naive.dense_pooled``): the same indices on
quantised inputs (exact pool keys and scores, many ties), a true top-k in score order otherwise. On CPU (the
blockwise torch path) and, on the GPU box, on CUDA (the pool, score and layout kernels)."""
import pytest
import torch
from hypothesis import given, settings

from kda_compile.ops import dsa_pooled_indexer_topk
from kda_compile.testing import DSAPooledCase, dsa_pooled_inputs, make_dsa_pooled_args

from .pooled_naive import assert_true_pooled_topk, dense_pooled


def _check(args):
    got = dsa_pooled_indexer_topk(**args)
    cpu = {n: (v.cpu() if torch.is_tensor(v) else v) for n, v in args.items()}
    valid = cpu["key_valid"]
    want = dense_pooled(cpu["q"], cpu["k"], cpu["gate"], cpu["weights"], None if valid is None else valid != 0,
                        cpu["ape"], cpu["query_mask"], cpu["topk"], cpu["scale"], cpu["q_offset"], cpu["select_tail"])
    assert got.dtype == torch.int32 and got.shape == want.shape
    if args.case.quantised:
        assert torch.equal(got.cpu(), want), args
    else:
        assert_true_pooled_topk(got, want.to(got.device), args, args["topk"], args["scale"])


@settings(max_examples=60, deadline=None)
@given(dsa_pooled_inputs(dtypes=(torch.float32, torch.bfloat16)))
def test_pooled_indexer_matches_hf_on_drawn_calls(args):
    _check(args)


@pytest.mark.cuda
@settings(max_examples=40, deadline=None)
@given(dsa_pooled_inputs(dtypes=(torch.bfloat16, torch.float16), device="cuda", max_t=300, dims=(64, 128),
                         pools=(4, 16)))
def test_pooled_indexer_matches_hf_on_drawn_cuda_calls(args):
    _check(args)


def test_hf_rows_are_views_of_one_cache_tensor():
    args = make_dsa_pooled_args(DSAPooledCase(key_flags="hf rows", padding=True, b=3), torch.bfloat16, seed=1)
    k, gate, flags = args["k"], args["gate"], args["key_valid"]
    assert k.stride() == gate.stride() and flags.stride() == k.stride()[:2]
    assert gate.data_ptr() - k.data_ptr() == 2 * k.shape[-1] and flags.data_ptr() - k.data_ptr() == 4 * k.shape[-1]
    assert flags.dtype == torch.bfloat16 and bool((flags[1:] == 0).any()) and bool((flags < 0).any())


def test_bad_case_options_are_named():
    with pytest.raises(ValueError, match="key_flags must be one of"):
        make_dsa_pooled_args(DSAPooledCase(key_flags="packed"))
    with pytest.raises(TypeError, match="dtype must be one of"):
        make_dsa_pooled_args(DSAPooledCase(), torch.int32)
