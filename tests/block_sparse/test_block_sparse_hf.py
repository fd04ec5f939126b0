"""The reference (ops/block_sparse/reference.py) against Hugging Face's own path on a tiny MiniMax-M3 config:
``MiniMaxM3VLIndexer.build_block_mask`` (transformers 5.23) and eager softmax attention over the dense mask, on
the indexer's own selection and on random ones. Equal within float32 rounding: relative error (Frobenius) under
1e-5 in float32; rows without a visible key are compared only by their documented value (0), since HF's additive
``finfo.min`` mask averages every value there."""
import pytest
import torch

pytest.importorskip("transformers.models.minimax_m3_vl")

from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hf  # noqa: E402

from kda_compile.coverage.models import tiny_config  # noqa: E402
from kda_compile.ops.block_sparse.reference import block_sparse_attention_reference, visible_keys  # noqa: E402
from kda_compile.testing import assert_rel_close  # noqa: E402
from kda_compile.testing.block_sparse_strategies import random_block_indices  # noqa: E402

TOLERANCE = 1e-5


def _config(block_size: int):
    cfg = tiny_config("minimax_m3_vl_text")
    cfg.index_n_heads = cfg.num_key_value_heads  # HF's contract: one selection per KV group
    cfg.index_block_size = block_size
    cfg.index_topk_blocks = 3
    cfg.layer_types = ["minimax_m3_sparse"] * len(cfg.layer_types)
    return cfg


def _hf_attention(cfg, q, k, v, mask):
    """HF's eager attention of MiniMax-M3 over its dense additive mask: [B, H, Sq, D]."""
    module = torch.nn.Module()
    module.num_key_value_groups = cfg.num_attention_heads // cfg.num_key_value_heads
    module.training = False
    out, _ = hf.eager_attention_forward(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5)
    return out.transpose(1, 2)


def _qkv(cfg, b, sq, t, gen):
    heads, groups, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return (torch.randn(b, heads, sq, dim, generator=gen), torch.randn(b, groups, t, dim, generator=gen),
            torch.randn(b, groups, t, dim, generator=gen))


@pytest.mark.parametrize("block_size", [16, 8, 5])
@pytest.mark.parametrize("b, sq, t", [(2, 37, 37), (1, 1, 29), (2, 6, 40)])
def test_reference_is_hf_build_block_mask_plus_eager_softmax(block_size, b, sq, t):
    cfg = _config(block_size)
    gen = torch.Generator().manual_seed(block_size * 100 + t)
    q, k, v = _qkv(cfg, b, sq, t, gen)
    blocks = -(-t // block_size)
    idx = random_block_indices(b, cfg.num_key_value_heads, sq, blocks, 3, gen)
    idx[..., 0] = torch.arange(t - sq, t) // block_size  # the query's own block (HF's local block): a key to see
    positions = torch.arange(t - sq, t).expand(b, sq)
    indexer = hf.MiniMaxM3VLIndexer(cfg, 0)
    mask = indexer.build_block_mask(idx, None, t, torch.float32, q.device, positions)
    expected = _hf_attention(cfg, q, k, v, mask)
    out, lse = block_sparse_attention_reference(q, k, v, idx, block_size, q.shape[-1] ** -0.5)
    assert torch.isfinite(lse).all()
    assert_rel_close(out, expected, TOLERANCE, name="out")


def test_reference_with_padding_is_hf_with_its_attention_mask():
    # HF replaces its causal bound by the model's 4D mask when one is given (causal and padding together).
    cfg = _config(16)
    gen = torch.Generator().manual_seed(3)
    b, sq, t = 2, 5, 45
    q, k, v = _qkv(cfg, b, sq, t, gen)
    idx = random_block_indices(b, cfg.num_key_value_heads, sq, 3, 3, gen)
    idx[..., 0] = 2  # the block holding every query: each row keeps a visible key
    padding = torch.ones(b, t, dtype=torch.bool)
    padding[1, 30:33] = False
    padding[0, :7] = False
    positions = torch.arange(t - sq, t).expand(b, sq)
    causal = torch.arange(t)[None, None, None, :] <= positions[:, None, :, None]
    indexer = hf.MiniMaxM3VLIndexer(cfg, 0)
    mask = indexer.build_block_mask(idx, causal & padding[:, None, None, :], t, torch.float32, q.device, positions)
    expected = _hf_attention(cfg, q, k, v, mask)
    out, _ = block_sparse_attention_reference(q, k, v, idx, 16, q.shape[-1] ** -0.5, positions, padding)
    assert_rel_close(out, expected, TOLERANCE, name="out")


def test_reference_on_the_indexers_own_selection():
    cfg = _config(8)
    torch.manual_seed(0)
    indexer = hf.MiniMaxM3VLIndexer(cfg, 0).eval()
    b, t = 2, 30
    hidden = torch.randn(b, t, cfg.hidden_size)
    rotary = hf.MiniMaxM3VLRotaryEmbedding(cfg)
    positions = torch.arange(t).expand(b, t)
    embeddings = rotary(hidden, positions)
    with torch.no_grad():
        idx = indexer(hidden, embeddings, None, positions)
    assert idx.shape == (b, cfg.num_key_value_heads, t, 3) and (idx == -1).any()  # early queries: -1 padding
    q, k, v = _qkv(cfg, b, t, t, torch.Generator().manual_seed(1))
    mask = indexer.build_block_mask(idx, None, t, torch.float32, q.device, positions)
    expected = _hf_attention(cfg, q, k, v, mask)
    out, _ = block_sparse_attention_reference(q, k, v, idx, 8, q.shape[-1] ** -0.5, positions)
    assert_rel_close(out, expected, TOLERANCE, name="out")


def test_visible_keys_match_the_dense_mask_and_repeats_are_harmless():
    cfg = _config(4)
    gen = torch.Generator().manual_seed(5)
    b, sq, t = 1, 7, 23
    idx = random_block_indices(b, cfg.num_key_value_heads, sq, 6, 4, gen, repeats=True)
    positions = torch.randint(0, t, (b, sq), generator=gen)
    mask = hf.MiniMaxM3VLIndexer(cfg, 0).build_block_mask(idx, None, t, torch.float32, "cpu", positions)
    heads_per_group = cfg.num_attention_heads // cfg.num_key_value_heads
    ours = visible_keys(idx, t, 4, positions, None).repeat_interleave(heads_per_group, dim=1)
    assert torch.equal(ours, mask == 0)
    deduplicated = idx.clone()
    deduplicated[..., -1] = torch.where(idx[..., -1] == idx[..., 0], -1, idx[..., -1])
    assert torch.equal(visible_keys(deduplicated, t, 4, positions, None), visible_keys(idx, t, 4, positions, None))


def test_a_row_without_a_visible_key_gives_zero_and_minus_infinity():
    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 2, 3, 8, generator=gen), torch.randn(1, 1, 20, 8, generator=gen), torch.randn(
        1, 1, 20, 8, generator=gen)
    idx = torch.tensor([[[[-1, -1], [1, -1], [0, 1]]]])
    positions = torch.tensor([[19, 3, -1]])  # row 1: block 1 starts at slot 8 > 3; row 2: before every key
    out, lse = block_sparse_attention_reference(q, k, v, idx, 8, 0.5, positions)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.full_like(lse, float("-inf")))
