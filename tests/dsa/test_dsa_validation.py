"""Bad arguments of the DSA ops raise a ValueError / TypeError naming the argument, its value and what is
accepted."""
import pytest
import torch

from kda_compile.ops import dsa_indexer_topk, dsa_sparse_attention


def _indexer(**over):
    args = dict(q=torch.randn(1, 4, 2, 8), k=torch.randn(1, 6, 8), weights=torch.randn(1, 4, 2), topk=3)
    args.update(over)
    return args


@pytest.mark.parametrize("over,kind,words", [
    (dict(q=torch.randn(1, 4, 8)), ValueError, ["q", "4-D"]),
    (dict(q=torch.randn(1, 4, 2, 8).int()), TypeError, ["q", "float16, bfloat16, float32, float64"]),
    (dict(k=torch.randn(1, 6, 7)), ValueError, ["k", "D = 8"]),
    (dict(k=torch.randn(2, 6, 8)), ValueError, ["k", "B = 1"]),
    (dict(weights=torch.randn(1, 4, 3)), ValueError, ["weights", "[1, 4, 2]"]),
    (dict(weights=torch.ones(1, 4, 2, dtype=torch.int64)), TypeError, ["weights", "floating"]),
    (dict(topk=0), ValueError, ["topk", ">= 1", "got 0"]),
    (dict(topk=2.0), TypeError, ["topk", "int"]),
    (dict(topk=True), TypeError, ["topk", "int"]),
    (dict(scale=float("nan")), ValueError, ["scale", "finite"]),
    (dict(is_causal=1), TypeError, ["is_causal", "bool"]),
    (dict(key_mask=torch.ones(1, 6)), TypeError, ["key_mask", "bool"]),
    (dict(key_mask=torch.ones(1, 5, dtype=torch.bool)), ValueError, ["key_mask", "[1, 6]"]),
    (dict(cu_seqlens=torch.tensor([0, 4], dtype=torch.int32)), ValueError, ["cu_seqlens", "S == T"]),
    (dict(cu_seqlens=torch.tensor([0.0, 6.0])), TypeError, ["cu_seqlens", "int32, int64"]),
])
def test_indexer_errors(over, kind, words):
    with pytest.raises(kind) as info:
        dsa_indexer_topk(**_indexer(**over))
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_indexer_bad_cu_seqlens_values():
    args = _indexer(q=torch.randn(1, 6, 2, 8), weights=torch.randn(1, 6, 2),
                    cu_seqlens=torch.tensor([0, 4, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing offsets from 0 to T = 6"):
        dsa_indexer_topk(**args)


def _attention(**over):
    args = dict(q=torch.randn(1, 3, 4, 12), k=torch.randn(1, 7, 1, 12), v=None,
                indices=torch.zeros(1, 3, 2, dtype=torch.int32), d_v=8)
    args.update(over)
    return args


@pytest.mark.parametrize("over,kind,words", [
    (dict(d_v=None), TypeError, ["d_v", "v is None"]),
    (dict(d_v=13), ValueError, ["d_v", "Dqk = 12"]),
    (dict(d_v=0), ValueError, ["d_v", "1 <= d_v"]),
    (dict(indices=torch.zeros(1, 3, 2, dtype=torch.int64)), TypeError, ["indices", "int32"]),
    (dict(indices=torch.zeros(1, 2, 2, dtype=torch.int32)), ValueError, ["indices", "[1, 3, topk >= 1]"]),
    (dict(indices=torch.zeros(1, 3, 0, dtype=torch.int32)), ValueError, ["indices", "topk >= 1"]),
    (dict(k=torch.randn(1, 7, 3, 12)), ValueError, ["k", "Hkv dividing Hq = 4"]),
    (dict(k=torch.randn(1, 7, 1, 10)), ValueError, ["k", "Dqk = 12"]),
    (dict(k=torch.randn(1, 7, 1, 12).half()), TypeError, ["k", "q's dtype"]),
    (dict(v=torch.randn(1, 6, 1, 8), d_v=None), ValueError, ["v", "[1, 7, 1]"]),
    (dict(v=torch.randn(1, 7, 1, 8), d_v=9), ValueError, ["d_v", "v's last dim 8"]),
    (dict(scale=float("inf")), ValueError, ["scale", "finite"]),
    (dict(q=torch.randn(1, 3, 4, 12).int()), TypeError, ["q", "float16"]),
])
def test_attention_errors(over, kind, words):
    with pytest.raises(kind) as info:
        dsa_sparse_attention(**_attention(**over))
    for word in words:
        assert word in str(info.value), (word, str(info.value))
